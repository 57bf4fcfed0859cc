/*
 * bd_escape: each class of character, invalid UTF-8, and truncation that never splits an escape
 * or a character.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "bucketd/escape.h"

static const char *esc(const char *in, size_t len, unsigned flags) {
    static char out[1024];
    size_t used = bd_escape(out, sizeof(out), in, len, flags);
    cr_assert_eq(used, len, "whole input consumed");
    return out;
}

#define ESC(s) esc((s), sizeof(s) - 1, 0)

Test(escape, printable_ascii_and_utf8_text_stay_readable) {
    cr_assert_str_eq(ESC("temp,room=a b"), "temp,room=a b");
    cr_assert_str_eq(ESC("temp\xc3\xa9rature"), "temp\xc3\xa9rature"); /* température */
    cr_assert_str_eq(ESC("\xe6\x9d\xb1\xe4\xba\xac"), "\xe6\x9d\xb1\xe4\xba\xac"); /* 東京 */
    cr_assert_str_eq(ESC("\xf0\x9f\x8c\xa1"), "\xf0\x9f\x8c\xa1"); /* U+1F321 thermometer */
    cr_assert_str_eq(ESC("\xc2\xa0\xc2\xb0"), "\xc2\xa0\xc2\xb0"); /* U+00A0, U+00B0: not C1 */
}

Test(escape, c0_controls_and_del) {
    cr_assert_str_eq(ESC("a\nb\rc\td\x1b[2J\x7f"), "a\\x0ab\\x0dc\\x09d\\x1b[2J\\x7f");
    cr_assert_str_eq(esc("a\0b", 3, 0), "a\\x00b");
}

Test(escape, quote_and_backslash_unless_kept) {
    cr_assert_str_eq(ESC("a\"b\\c"), "a\\x22b\\x5cc");
    cr_assert_str_eq(esc("a\"b\\c\n", 6, BD_ESC_KEEP_QUOTES), "a\"b\\c\\x0a");
}

Test(escape, c1_controls) {
    cr_assert_str_eq(ESC("\xc2\x80"), "\\u0080");
    cr_assert_str_eq(ESC("x\xc2\x85y"), "x\\u0085y"); /* NEL */
    cr_assert_str_eq(ESC("\xc2\x9b"
                         "2J\xc2\x9b"
                         "31mFORGED"),
                     "\\u009b2J\\u009b31mFORGED"); /* CSI */
    cr_assert_str_eq(ESC("\xc2\x9f"), "\\u009f");
}

Test(escape, bidi_and_invisible_formatting) {
    cr_assert_str_eq(ESC("a\xe2\x80\xae"
                         "b"),
                     "a\\u202eb"); /* RLO */
    cr_assert_str_eq(ESC("\xe2\x80\xaa\xe2\x80\xab\xe2\x80\xac\xe2\x80\xad"),
                     "\\u202a\\u202b\\u202c\\u202d");
    cr_assert_str_eq(ESC("\xd8\x9c"), "\\u061c");                        /* ALM */
    cr_assert_str_eq(ESC("\xe2\x80\x8e\xe2\x80\x8f"), "\\u200e\\u200f"); /* LRM, RLM */
    cr_assert_str_eq(ESC("\xe2\x81\xa6\xe2\x81\xa9"), "\\u2066\\u2069"); /* LRI, PDI */
    cr_assert_str_eq(ESC("\xe2\x80\xa8\xe2\x80\xa9"), "\\u2028\\u2029"); /* line/para sep */
    cr_assert_str_eq(ESC("\xe2\x80\x8b\xef\xbb\xbf"), "\\u200b\\ufeff"); /* ZWSP, BOM */
    cr_assert_str_eq(ESC("\xf3\xa0\x81\x81"), "\\U000e0041");            /* tag LATIN A */
    /* Neighbours of the ranges are ordinary text. */
    cr_assert_str_eq(ESC("\xe2\x80\x90\xe2\x81\xb0"), "\xe2\x80\x90\xe2\x81\xb0");
}

Test(escape, invalid_utf8_byte_by_byte) {
    cr_assert_str_eq(ESC("a\xff"
                         "b"),
                     "a\\xffb");
    cr_assert_str_eq(ESC("\x80"), "\\x80");                            /* stray continuation */
    cr_assert_str_eq(ESC("\xc3"), "\\xc3");                            /* truncated at the end */
    cr_assert_str_eq(ESC("\xc3("), "\\xc3(");                          /* bad continuation */
    cr_assert_str_eq(ESC("\xc0\xaf"), "\\xc0\\xaf");                   /* overlong '/' */
    cr_assert_str_eq(ESC("\xe0\x80\xaf"), "\\xe0\\x80\\xaf");          /* overlong, 3 bytes */
    cr_assert_str_eq(ESC("\xed\xa0\x80"), "\\xed\\xa0\\x80");          /* surrogate */
    cr_assert_str_eq(ESC("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80"); /* > U+10FFFF */
}

Test(escape, truncation_never_splits_an_escape_or_a_character) {
    char out[8];
    /* "\u009b" is 6 bytes: with "ab" first, 2 + 6 + NUL > 8, so it is left out whole. */
    size_t used = bd_escape(out, sizeof(out),
                            "ab\xc2\x9b"
                            "c",
                            5, 0);
    cr_assert_eq(used, 2);
    cr_assert_str_eq(out, "ab");

    /* A three-byte character needs 3 bytes + NUL. */
    char four[4];
    used = bd_escape(four, sizeof(four), "x\xe6\x9d\xb1", 4, 0);
    cr_assert_eq(used, 1);
    cr_assert_str_eq(four, "x");

    /* Every cap: the output is a prefix of the full escape ending at an escape boundary. */
    static const char in[] = "a\n\xc2\x9b\xe2\x80\xae\xe6\x9d\xb1\xff\"z";
    char full[128];
    cr_assert_eq(bd_escape(full, sizeof(full), in, sizeof(in) - 1, 0), sizeof(in) - 1);
    const char *bounds[] = {"",
                            "a",
                            "a\\x0a",
                            "a\\x0a\\u009b",
                            "a\\x0a\\u009b\\u202e",
                            "a\\x0a\\u009b\\u202e\xe6\x9d\xb1",
                            "a\\x0a\\u009b\\u202e\xe6\x9d\xb1\\xff",
                            "a\\x0a\\u009b\\u202e\xe6\x9d\xb1\\xff\\x22",
                            "a\\x0a\\u009b\\u202e\xe6\x9d\xb1\\xff\\x22z"};
    for (size_t cap = 1; cap <= strlen(full) + 1; cap++) {
        char buf[128];
        size_t n = bd_escape(buf, cap, in, sizeof(in) - 1, 0);
        cr_assert_leq(strlen(buf), cap - 1);
        bool found = false;
        for (size_t b = 0; b < sizeof(bounds) / sizeof(bounds[0]); b++) {
            found = found || strcmp(buf, bounds[b]) == 0;
        }
        cr_assert(found, "cap %zu: \"%s\" ends inside an escape", cap, buf);
        /* The longest boundary that fits is the one taken. */
        for (size_t b = 0; b < sizeof(bounds) / sizeof(bounds[0]); b++) {
            if (strlen(bounds[b]) < cap) {
                cr_assert_geq(strlen(buf), strlen(bounds[b]), "cap %zu", cap);
            }
        }
        cr_assert_leq(n, sizeof(in) - 1);
    }
    cr_assert_eq(bd_escape(out, 0, "abc", 3, 0), 0);
}

Test(escape, worst_case_fits_the_documented_room) {
    char in[64], out[BD_ESCAPE_CAP(64)];
    memset(in, 0x01, sizeof(in));
    cr_assert_eq(bd_escape(out, sizeof(out), in, sizeof(in), 0), sizeof(in));
    memset(in, '"', sizeof(in));
    cr_assert_eq(bd_escape(out, sizeof(out), in, sizeof(in), 0), sizeof(in));
}

Test(escape, escape_str) {
    char out[64];
    cr_assert_str_eq(bd_escape_str(out, sizeof(out), "s\xe2\x80\xae"), "s\\u202e");
}

/* bd_escape_json_string of a NUL-terminated string, into a buffer big enough. */
static const char *jstr(const char *in, size_t len) {
    static char out[512];
    size_t used = bd_escape_json_string(out, sizeof(out), in, len);
    cr_assert_eq(used, len);
    return out;
}

Test(escape, json_string_quotes_backslashes_and_controls) {
    cr_assert_str_eq(jstr("plain id", 8), "plain id");
    cr_assert_str_eq(jstr("temp\xc3\xa9rature", 12), "temp\xc3\xa9rature", "UTF-8 unchanged");
    cr_assert_str_eq(jstr("a\"b\\c", 5), "a\\\"b\\\\c");
    cr_assert_str_eq(jstr("\x01\n\x1f\x7f", 4), "\\u0001\\u000a\\u001f\\u007f");
    cr_assert_str_eq(jstr("a\0b", 3), "a\\u0000b");
}

Test(escape, json_string_terminal_characters_and_invalid_utf8) {
    /* CSI, RLO: \uNNNN; a tag character: its surrogate pair. */
    cr_assert_str_eq(jstr("\xc2\x9b"
                          "2J\xe2\x80\xae",
                          7),
                     "\\u009b2J\\u202e");
    cr_assert_str_eq(jstr("\xf3\xa0\x80\x81", 4), "\\udb40\\udc01");
    /* Not UTF-8: the logs' "\xNN", its backslash escaped for JSON. */
    cr_assert_str_eq(jstr("a\xff", 2), "a\\\\xff");
    cr_assert_str_eq(jstr("\xc3", 1), "\\\\xc3");
}

Test(escape, json_string_worst_case_fits_and_truncation_is_whole) {
    char in[64], out[BD_ESCAPE_JSON_CAP(64)];
    memset(in, 0x01, sizeof(in));
    cr_assert_eq(bd_escape_json_string(out, sizeof(out), in, sizeof(in)), sizeof(in));
    cr_assert_eq(strlen(out), 6 * sizeof(in));
    char small[10];
    cr_assert_eq(bd_escape_json_string(small, sizeof(small), "\x01\x02", 2), 1);
    cr_assert_str_eq(small, "\\u0001");
}
