/*
 * Field and tag names as BSON keys (src/names.c): the escape, its inverse, and the names that
 * stay as they are.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "bucketd/names.h"

static const char *escape(const char *name, size_t len, enum bd_name_kind kind, char *buf,
                          size_t cap) {
    int n = bd_name_escape(name, len, kind, buf, cap);
    cr_assert_geq(n, 0, "escape of '%s'", name);
    cr_assert_eq((size_t)n, bd_name_escaped_len(name, len, kind));
    cr_assert_eq(strlen(buf), (size_t)n);
    return buf;
}

static const char *unescape(const char *key, char *buf, size_t cap) {
    int n = bd_name_unescape(key, strlen(key), buf, cap);
    cr_assert_geq(n, 0, "unescape of '%s'", key);
    cr_assert_eq(strlen(buf), (size_t)n);
    return buf;
}

/* escape(name) == key for kind, and unescape(key) == name. */
static void expect(const char *name, enum bd_name_kind kind, const char *key) {
    char e[256], u[256];
    cr_assert_str_eq(escape(name, strlen(name), kind, e, sizeof(e)), key, "escape of '%s'", name);
    cr_assert_str_eq(unescape(e, u, sizeof(u)), name, "round trip of '%s'", name);
}

Test(names, ordinary_names_are_unchanged) {
    static const char *names[] = {"temp",      "cpu_user", "host-name", "a$b", "x$",
                                  "t",         "tss",      "sts",       "TS",  "\xc3\xa9t\xc3\xa9",
                                  "a b=c,d\\", "0"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        size_t len = strlen(names[i]);
        cr_assert_eq(bd_name_escaped_len(names[i], len, BD_NAME_FIELD), len, "%s", names[i]);
        cr_assert_eq(bd_name_escaped_len(names[i], len, BD_NAME_TAG), len, "%s", names[i]);
        expect(names[i], BD_NAME_FIELD, names[i]);
        expect(names[i], BD_NAME_TAG, names[i]);
    }
}

Test(names, the_escape) {
    expect("%", BD_NAME_FIELD, "%25");
    expect(".", BD_NAME_FIELD, "%2E");
    expect("$", BD_NAME_FIELD, "%24");
    expect("$$", BD_NAME_FIELD, "%24$");
    expect("a.$b", BD_NAME_FIELD, "a%2E$b");
    expect("$a.b", BD_NAME_TAG, "%24a%2Eb");
    expect("k8s.pod", BD_NAME_TAG, "k8s%2Epod");
    expect("cpu.user", BD_NAME_FIELD, "cpu%2Euser");
    expect("...", BD_NAME_FIELD, "%2E%2E%2E");
    expect("50%.", BD_NAME_FIELD, "50%25%2E");
    /* The escape's own output, sent as a name, is escaped again and comes back intact. */
    expect("%2E", BD_NAME_FIELD, "%252E");
    expect("%24x", BD_NAME_FIELD, "%2524x");
    expect("%74s", BD_NAME_FIELD, "%2574s");
    expect("%252E", BD_NAME_TAG, "%25252E");
    /* ts is the reading's timestamp: reserved for fields, not for tag keys. */
    expect("ts", BD_NAME_FIELD, "%74s");
    expect("ts", BD_NAME_TAG, "ts");
    expect("ts.x", BD_NAME_FIELD, "ts%2Ex");
}

Test(names, unescape_decodes_only_what_the_escape_writes) {
    char u[64];
    cr_assert_str_eq(unescape("a%2eb", u, sizeof(u)), "a.b", "either case");
    cr_assert_str_eq(unescape("%41%20%00", u, sizeof(u)), "%41%20%00");
    cr_assert_str_eq(unescape("%", u, sizeof(u)), "%");
    cr_assert_str_eq(unescape("%2", u, sizeof(u)), "%2");
    cr_assert_str_eq(unescape("a%2", u, sizeof(u)), "a%2");
    cr_assert_str_eq(unescape("%%2E", u, sizeof(u)), "%.");
    cr_assert_str_eq(unescape("%2G", u, sizeof(u)), "%2G");
    cr_assert_str_eq(unescape("", u, sizeof(u)), "");
}

Test(names, round_trip_of_every_short_name) {
    /* Every name of up to 3 bytes over an alphabet of the special bytes and two others. */
    static const char alphabet[] = {'%', '.', '$', 't', 's', '2', 'E', 'a'};
    const size_t k = sizeof(alphabet);
    char name[4], e[16], u[16];
    for (size_t len = 1; len <= 3; len++) {
        size_t total = 1;
        for (size_t i = 0; i < len; i++) {
            total *= k;
        }
        for (size_t code = 0; code < total; code++) {
            size_t c = code;
            for (size_t i = 0; i < len; i++, c /= k) {
                name[i] = alphabet[c % k];
            }
            name[len] = '\0';
            for (int kind = BD_NAME_TAG; kind <= BD_NAME_FIELD; kind++) {
                escape(name, len, (enum bd_name_kind)kind, e, sizeof(e));
                cr_assert_null(strchr(e, '.'), "'%s' -> '%s'", name, e);
                cr_assert_neq(e[0], '$', "'%s' -> '%s'", name, e);
                if (kind == BD_NAME_FIELD) {
                    cr_assert_str_neq(e, "ts");
                }
                cr_assert_str_eq(unescape(e, u, sizeof(u)), name, "'%s' -> '%s'", name, e);
            }
        }
    }
}

Test(names, buffers_too_small) {
    char buf[8];
    cr_assert_eq(bd_name_escape("a.b", 3, BD_NAME_FIELD, buf, 5), -ENAMETOOLONG);
    cr_assert_eq(bd_name_escape("a.b", 3, BD_NAME_FIELD, buf, 6), 5);
    cr_assert_str_eq(buf, "a%2Eb");
    cr_assert_eq(bd_name_unescape("a%2Eb", 5, buf, 3), -ENAMETOOLONG);
    cr_assert_eq(bd_name_unescape("a%2Eb", 5, buf, 4), 3);
    cr_assert_str_eq(buf, "a.b");
    cr_assert_eq(bd_name_unescape("", 0, buf, 0), -ENAMETOOLONG);
}

Test(names, valid_names) {
    cr_assert(bd_name_valid("a.b", 3));
    cr_assert(bd_name_valid("$", 1));
    cr_assert(bd_name_valid("\xc3\xa9", 2));
    cr_assert_not(bd_name_valid("", 0));
    cr_assert_not(bd_name_valid("a\0b", 3));
    cr_assert_not(bd_name_valid("a\xff", 2));
    cr_assert_not(bd_name_valid("\xc3", 1));
}
