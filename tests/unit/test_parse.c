/*
 * Unit tests for the line parsers (include/bucketd/parse.h, src/parse*.c), line protocol: every
 * part of its grammar, names and escapes, each number form (against strtod and strtoll, and
 * the fast path against the general parser), booleans, timestamps and precision, and series
 * keys. Limits, malformed and mutated lines, Graphite plaintext and batch parsing are in
 * test_parse_edge.c; the conformance corpus as a whole runs in tests/e2e/test_lp_conformance.py.
 */
#include "parse_harness.h"

TestSuite(parse, .init = influx_ns, .fini = teardown);
/* Tests that set up their own parsers, with other precisions or limits. */
TestSuite(parse_setup);

/* Same kind and value (the key is not compared: it points into a line since overwritten). */
static bool same_value(const struct bd_field *a, const struct bd_field *b) {
    if (a->kind != b->kind) {
        return false;
    }
    switch (a->kind) {
    case BD_VAL_FLOAT:
        return same_double(a->v.f, b->v.f);
    case BD_VAL_INT:
        return a->v.i == b->v.i;
    case BD_VAL_UINT:
        return a->v.u == b->v.u;
    case BD_VAL_BOOL:
        return a->v.b == b->v.b;
    default:
        return a->v.s.len == b->v.s.len && memcmp(a->v.s.ptr, b->v.s.ptr, a->v.s.len) == 0;
    }
}

/*
 * A field value read every way the parser can read it: last on its line (where fewer than 8
 * bytes may follow it), before a timestamp (where plain lines load it 8 bytes at once), between
 * other fields, and by the general parser alone. All must give the same field, which is
 * returned; rc is the common result.
 */
static int parse_value(const char *value, struct bd_field *out) {
    static const char *const forms[] = {"m v=%s", "m v=%s 1", "m,t=1 a=1i,v=%s,b=t 1"};
    char line[512];
    int rc0 = 0;
    for (size_t i = 0; i < 2 * BD_ARRAY_LEN(forms); i++) {
        snprintf(line, sizeof(line), forms[i % BD_ARRAY_LEN(forms)], value);
        errmsg = NULL;
        int rc = i < BD_ARRAY_LEN(forms)
                     ? bd_parse_line(&parser, line, strlen(line), &point, &errmsg)
                     : bd_parse_line_general(&parser, line, strlen(line), &point, &errmsg);
        if (i == 0) {
            rc0 = rc;
        }
        cr_assert_eq(rc, rc0, "\"%s\": rc %d, first %d", line, rc, rc0);
        if (rc == BD_PARSE_OK) {
            const struct bd_field *f = field(&point, "v");
            cr_assert(i == 0 || same_value(f, out), "\"%s\" read differently", line);
            *out = *f;
        }
    }
    return rc0;
}

static double parse_float(const char *value) {
    struct bd_field f;
    cr_assert_eq(parse_value(value, &f), BD_PARSE_OK, "%s", value);
    cr_assert_eq(f.kind, BD_VAL_FLOAT, "%s", value);
    return f.v.f;
}

/* ---- Line protocol: structure ------------------------------------------------------------ */

Test(parse, full_line) {
    const struct bd_point *pt = ok("weather,location=us-midwest,season=summer "
                                   "temperature=82,humidity=71i,ok=t,note=\"warm\" "
                                   "1465839830100400200");
    expect_str(pt->name, "weather");
    cr_assert_eq(pt->n_tags, 2);
    expect_str(pt->tags[0].key, "location");
    expect_str(pt->tags[0].value, "us-midwest");
    expect_str(pt->tags[1].key, "season");
    expect_str(pt->tags[1].value, "summer");
    cr_assert_eq(pt->n_fields, 4);
    expect_str(pt->fields[0].key, "temperature");
    cr_assert_eq(pt->fields[0].kind, BD_VAL_FLOAT);
    cr_assert_eq(pt->fields[0].v.f, 82.0);
    expect_str(pt->fields[1].key, "humidity");
    cr_assert_eq(pt->fields[1].kind, BD_VAL_INT);
    cr_assert_eq(pt->fields[1].v.i, 71);
    cr_assert_eq(pt->fields[2].kind, BD_VAL_BOOL);
    cr_assert(pt->fields[2].v.b);
    cr_assert_eq(pt->fields[3].kind, BD_VAL_STRING);
    expect_str(pt->fields[3].v.s, "warm");
    cr_assert(pt->has_time);
    cr_assert_eq(pt->time_ns, 1465839830100400200);
    expect_str(pt->series_key, "weather,location=us-midwest,season=summer");
}

Test(parse, no_tags_no_time) {
    const struct bd_point *pt = ok("cpu value=1");
    expect_str(pt->name, "cpu");
    cr_assert_eq(pt->n_tags, 0);
    cr_assert_eq(pt->n_fields, 1);
    cr_assert_not(pt->has_time);
    expect_str(pt->series_key, "cpu");
}

Test(parse, spaces_between_sections) {
    const struct bd_point *pt = ok("   cpu,a=1    v=1     42   ");
    expect_str(pt->name, "cpu");
    expect_str(pt->series_key, "cpu,a=1");
    cr_assert_eq(pt->time_ns, 42);
    pt = ok("cpu v=1 ");
    cr_assert_not(pt->has_time);
}

Test(parse, blank_and_comment_lines) {
    const char *skip[] = {"",
                          "   ",
                          "\r",
                          "  \r",
                          "#",
                          "# a comment",
                          "   # indented comment",
                          "#comment with \xff bytes\r",
                          "#m v=1 1"};
    for (size_t i = 0; i < sizeof(skip) / sizeof(skip[0]); i++) {
        cr_assert_eq(parse(skip[i]), BD_PARSE_SKIP, "\"%s\"", skip[i]);
    }
    /* Like the reference decoder: control characters are not allowed in comments either. */
    fails("# tab\there", BD_PARSE_ESYNTAX, NULL);
    fails("#\r\r", BD_PARSE_ESYNTAX, NULL);
    /* Only a space indents; a tab is not part of the grammar. */
    fails("\tcpu v=1", BD_PARSE_ESYNTAX, NULL);
}

Test(parse, trailing_cr) {
    const struct bd_point *pt = ok("cpu v=1\r");
    cr_assert_eq(field(pt, "v")->v.f, 1.0);
    pt = ok("cpu v=1 7\r");
    cr_assert_eq(pt->time_ns, 7);
    ok("cpu v=1 7 \r");
    /* Only the last '\r' belongs to the line ending. */
    fails("cpu v=1\r\r", BD_PARSE_ESYNTAX, NULL);
    fails("cpu v=1\rx", BD_PARSE_ESYNTAX, NULL);
    fails("cpu,a=b\r v=1", BD_PARSE_ESYNTAX, NULL);
}

/* ---- Line protocol: names and escapes --------------------------------------------------- */

Test(parse, measurement_escapes) {
    expect_str(ok("c\\,pu v=1")->name, "c,pu");
    expect_str(ok("c\\ pu v=1")->name, "c pu");
    expect_str(ok("cpu=load v=1")->name, "cpu=load");
    expect_str(ok("c\\=pu v=1")->name, "c\\=pu"); /* '=' needs no escape here */
    expect_str(ok("c\\pu v=1")->name, "c\\pu");
    expect_str(ok("\"cpu\" v=1")->name, "\"cpu\"");
    expect_str(ok("c\\\\ pu v=1")->name, "c\\ pu"); /* literal '\', then escaped ' ' */
    expect_str(ok("wè,t=x v=1")->name, "wè");
}

Test(parse, tag_escapes) {
    const struct bd_point *pt = ok("m,k\\,1=v\\,1,k\\=2=v\\=2,k\\ 3=v\\ 3 f=1");
    cr_assert_eq(pt->n_tags, 3);
    expect_str(pt->tags[0].key, "k 3");
    expect_str(pt->tags[0].value, "v 3");
    expect_str(pt->tags[1].key, "k,1");
    expect_str(pt->tags[1].value, "v,1");
    expect_str(pt->tags[2].key, "k=2");
    expect_str(pt->tags[2].value, "v=2");
    pt = ok("m,path=c:\\temp,q=\\\\\\,x f=1");
    expect_str(pt->tags[0].value, "c:\\temp");
    expect_str(pt->tags[1].value, "\\\\,x"); /* two literal '\', then an escaped ',' */
}

Test(parse, field_key_escapes) {
    const struct bd_point *pt = ok("m va\\,l=1,va\\=l=2,va\\ l=3,va\\l=4");
    expect_str(pt->fields[0].key, "va,l");
    expect_str(pt->fields[1].key, "va=l");
    expect_str(pt->fields[2].key, "va l");
    expect_str(pt->fields[3].key, "va\\l");
}

Test(parse, string_values) {
    const struct bd_point *pt = ok("m a=\"x\\\"y\",b=\"back\\\\slash\",c=\"\\n\\t\\r\","
                                   "d=\"keep \\, \\a\",e=\"\",f=\"a,b c=d\",g=\"wè\"");
    expect_str(field(pt, "a")->v.s, "x\"y");
    expect_str(field(pt, "b")->v.s, "back\\slash");
    expect_str(field(pt, "c")->v.s, "\n\t\r");
    expect_str(field(pt, "d")->v.s, "keep \\, \\a");
    expect_str(field(pt, "e")->v.s, "");
    expect_str(field(pt, "f")->v.s, "a,b c=d");
    expect_str(field(pt, "g")->v.s, "wè");
    cr_assert_eq(field(pt, "a")->kind, BD_VAL_STRING);
    /* "\\" ends in a backslash, then the closing quote. */
    expect_str(field(ok("m s=\"test\\\\\" 5"), "s")->v.s, "test\\");
}

Test(parse, string_spanning_lines) {
    /* A reader that joins lines passes the newline inside the string. */
    const struct bd_point *pt = ok("m s=\"one\ntwo\",v=1 9");
    expect_str(field(pt, "s")->v.s, "one\ntwo");
    cr_assert_eq(pt->time_ns, 9);
    /* Cut at the newline, the first part says the string is still open. */
    int rc = parse("m s=\"one");
    cr_assert_eq(rc, BD_PARSE_ESYNTAX);
    cr_assert_eq(errmsg, bd_parse_err_open_string);
    rc = parse("m s=\"one\\\"");
    cr_assert_eq(errmsg, bd_parse_err_open_string);
    /* Outside a string a newline is just a bad character. */
    fails("m v=1\nm v=2", BD_PARSE_ESYNTAX, NULL);
    fails("m\n v=1", BD_PARSE_ESYNTAX, NULL);
}

Test(parse, unescaped_text_goes_to_scratch) {
    char line[] = "m\\ x,t\\=k=v\\ 1 f\\,k=\"a\\\"b\"";
    const struct bd_point *pt = ok(line);
    const char *lo = parser.scratch;
    const char *hi = parser.scratch + parser.scratch_cap;
    cr_assert(pt->name.ptr >= lo && pt->name.ptr < hi);
    cr_assert(pt->tags[0].key.ptr >= lo && pt->tags[0].key.ptr < hi);
    cr_assert(pt->fields[0].v.s.ptr >= lo && pt->fields[0].v.s.ptr < hi);
    /* Without escapes the views point into the line itself. */
    char plain[] = "m,t=v f=\"s\"";
    pt = ok(plain);
    cr_assert_eq(pt->name.ptr, plain);
    cr_assert_eq(pt->tags[0].value.ptr, plain + 4);
    cr_assert_eq(pt->fields[0].v.s.ptr, plain + 9);
}

/* ---- Line protocol: values --------------------------------------------------------------- */

Test(parse, integers) {
    cr_assert_eq(field(ok("m v=123i"), "v")->v.i, 123);
    cr_assert_eq(field(ok("m v=-123i"), "v")->v.i, -123);
    cr_assert_eq(field(ok("m v=0i"), "v")->v.i, 0);
    cr_assert_eq(field(ok("m v=9223372036854775807i"), "v")->v.i, INT64_MAX);
    cr_assert_eq(field(ok("m v=-9223372036854775808i"), "v")->v.i, INT64_MIN);
    cr_assert_eq(field(ok("m v=0009223372036854775807i"), "v")->v.i, INT64_MAX);
    cr_assert_eq(field(ok("m v=1i"), "v")->kind, BD_VAL_INT);
    fails("m v=9223372036854775808i", BD_PARSE_ERANGE, "integer out of range");
    fails("m v=-9223372036854775809i", BD_PARSE_ERANGE, "integer out of range");
    fails("m v=99999999999999999999999i", BD_PARSE_ERANGE, NULL);
    const char *bad[] = {"m v=1.5i", "m v=-i",  "m v=1ii", "m v=9e10i",
                         "m v=--1i", "m v=1-i", "m v=.i"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid integer");
    }
}

Test(parse, unsigned_integers) {
    cr_assert_eq(field(ok("m v=0u"), "v")->v.u, 0);
    cr_assert_eq(field(ok("m v=42u"), "v")->kind, BD_VAL_UINT);
    cr_assert_eq(field(ok("m v=18446744073709551615u"), "v")->v.u, UINT64_MAX);
    cr_assert_eq(field(ok("m v=00018446744073709551615u"), "v")->v.u, UINT64_MAX);
    fails("m v=18446744073709551616u", BD_PARSE_ERANGE, "unsigned integer out of range");
    fails("m v=-1u", BD_PARSE_ESYNTAX, "invalid unsigned integer");
    fails("m v=-0u", BD_PARSE_ESYNTAX, NULL);
    fails("m v=1.0u", BD_PARSE_ESYNTAX, NULL);
    fails("m v=--1u", BD_PARSE_ESYNTAX, NULL);
}

Test(parse, float_forms) {
    struct {
        const char *text;
        double want;
    } cases[] = {
        {"1", 1.0},
        {"1.", 1.0},
        {".5", 0.5},
        {"-.5", -0.5},
        {"-1.2e+78", -1.2e78},
        {"1E5", 1e5},
        {"1e-5", 1e-5},
        {"1.0e4", 1e4},
        {"-0", -0.0},
        {"0.1", 0.1},
        {"00.25", 0.25},
        {"12.123", 12.123},
        {"6.632243e+06", 6632243.0},
        {"1e22", 1e22},
        {"1e23", 1e23},
        {"12e30", 12e30},
        {"9007199254740993", 9007199254740992.0}, /* 2^53 + 1 rounds to even */
        {"123456789012345678901234567890", 123456789012345678901234567890.0},
        {"2.2250738585072011e-308", 2.2250738585072011e-308},
        {"4.9e-324", 4.9e-324},
        {"1e-400", 0.0}, /* below the subnormals: 0, as Go's ParseFloat gives */
        {"1.7976931348623157e308", 1.7976931348623157e308},
        {"0.000000000000000000000000000001", 1e-30},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        double got = parse_float(cases[i].text);
        cr_assert(same_double(got, cases[i].want), "%s: got %.17g, want %.17g", cases[i].text, got,
                  cases[i].want);
    }
    /* DBL_MAX written out in full, 309 digits. */
    char big[400] = "";
    snprintf(big, sizeof(big), "%.1f", 1.7976931348623157e308);
    cr_assert(same_double(parse_float(big), 1.7976931348623157e308));
}

Test(parse, float_errors) {
    const char *bad[] = {"m v=1.1.1", "m v=-",      "m v=.",    "m v=-.",    "m v=1e",   "m v=1e+",
                         "m v=--1",   "m v=1a",     "m v=0x10", "m v=0x1p3", "m v=-inf", "m v=-Inf",
                         "m v=1_0",   "m v=1.5e5.", "m v=1\"",  "m v=+1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = parse(bad[i]);
        cr_assert_eq(rc, BD_PARSE_ESYNTAX, "\"%s\": rc %d", bad[i], rc);
    }
    /* Words that start no number are no value at all. */
    fails("m v=NaN", BD_PARSE_ESYNTAX, "invalid field value");
    fails("m v=inf", BD_PARSE_ESYNTAX, "invalid field value");
    fails("m v=abc", BD_PARSE_ESYNTAX, "invalid field value");
    fails("m v=1e309", BD_PARSE_ERANGE, "float out of range");
    fails("m v=-1e400", BD_PARSE_ERANGE, "float out of range");
}

/* Fast path and strtod must agree to the bit on every decimal they both read. */
Test(parse, float_matches_strtod) {
    uint64_t seed = 0x9e3779b97f4a7c15u;
    for (int n = 0; n < 200000; n++) {
        lcg_next(&seed);
        uint64_t r = seed >> 11;
        char text[96];
        size_t o = 0;
        if (r & 1) {
            text[o++] = '-';
        }
        /* Up to 25 digits each side: also past the 19 that fit in the fast path's integer. */
        int int_digits = (int)((r >> 1) % 26);
        int frac_digits = (int)((r >> 6) % 26);
        for (int k = 0; k < int_digits; k++) {
            lcg_next(&seed);
            text[o++] = (char)('0' + (seed >> 33) % 10);
        }
        if (frac_digits > 0 || int_digits == 0) {
            text[o++] = '.';
            for (int k = 0; k < BD_MAX(frac_digits, 1); k++) {
                lcg_next(&seed);
                text[o++] = (char)('0' + (seed >> 33) % 10);
            }
        }
        if ((r >> 11) & 1) {
            o += (size_t)snprintf(text + o, sizeof(text) - o, "e%d", (int)((r >> 12) % 80) - 40);
        }
        text[o] = '\0';
        double want = strtod(text, NULL);
        double got = parse_float(text);
        cr_assert(same_double(got, want), "%s: got %.17g, strtod %.17g", text, got, want);
    }
}

/* Where the fast paths end: 2^53, 10^22, 8 characters, 19 digits; each as strtod reads it. */
Test(parse, float_fast_path_boundaries_match_strtod) {
    static const char *const cases[] = {
        "9007199254740992",
        "9007199254740993",
        "9007199254740993.0",
        "9007199254740991.5",
        "-9007199254740993",
        "900719925474099.3",
        "1e22",
        "1e23",
        "1e-22",
        "1e-23",
        "9007199254740992e22",
        "9007199254740992e-22",
        "9007199254740993e-22",
        "12345e-22",
        "1.5e-23",
        "4.5e22",
        "123456789012345678e22",
        "1e308",
        "1.7976931348623157e308",
        "4.9e-324",
        "5e-324",
        "2.4703282292062328e-324",
        "2.2250738585072014e-308",
        "2.2250738585072011e-308",
        "1e-320",
        "1.",
        ".5",
        "-.5",
        "-0",
        "-0.0",
        "0",
        "0.0",
        "-0.",
        "-.0",
        "99999999",
        "9999999.9",
        ".9999999",
        "-.1234567",
        "12345678",
        "1234567.8",
        "0.1234567",
        "1.2345678",
        "-99999999",
        "999999999",
        "99999999.9",
        "0.30000000000000004",
        "1.00000000000000011102230246251565404236316680908203125",
        "1.00000000000000011102230246251565404236316680908203124",
        "1234567890123456789",
        "12345678901234567890",
        "0.0000000000000000000000001",
        "3.141592653589793238462643",
        "00000000000000000000000001",
        "1.0000000000000000000000000000000000000000000000001",
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(cases); i++) {
        double want = strtod(cases[i], NULL);
        double got = parse_float(cases[i]);
        cr_assert(same_double(got, want), "%s: got %.17g, strtod %.17g", cases[i], got, want);
    }
}

/* Short values, the ones the 8-byte path reads, against strtod in every position. */
Test(parse, short_floats_match_strtod) {
    uint64_t seed = 7;
    for (int n = 0; n < 100000; n++) {
        lcg_next(&seed);
        uint64_t r = seed >> 11;
        char text[16];
        size_t o = 0;
        if (r & 1) {
            text[o++] = '-';
        }
        size_t digits = 1 + (size_t)((r >> 1) % 9);     /* 9: one past what the path takes */
        size_t dot = (size_t)((r >> 5) % (digits + 2)); /* past the end: no dot */
        for (size_t k = 0; k < digits; k++) {
            if (k == dot) {
                text[o++] = '.';
            }
            text[o++] = (char)('0' + (r >> (9 + 3 * k)) % 10);
        }
        if (dot == digits) {
            text[o++] = '.';
        }
        text[o] = '\0';
        double want = strtod(text, NULL);
        double got = parse_float(text);
        cr_assert(same_double(got, want), "%s: got %.17g, strtod %.17g", text, got, want);
    }
}

Test(parse, integers_match_strtoll_in_every_position) {
    uint64_t seed = 11;
    for (int n = 0; n < 50000; n++) {
        lcg_next(&seed);
        uint64_t r = seed >> 8;
        char text[40];
        bool neg = r & 1;
        bool unsig = !neg && (r & 2);
        /* Up to 19 digits: 18 always fit an int64, 19 a uint64. */
        int digits = 1 + (int)((r >> 2) % (unsig ? 19 : 18));
        uint64_t v = (seed * 0x2545f4914f6cdd1du) % 10000000000000000000u;
        snprintf(text, sizeof(text), "%s%0*llu%c", neg ? "-" : "", digits,
                 (unsigned long long)(v % (digits >= 19 ? 10000000000000000000u
                                                        : (uint64_t)pow(10, digits))),
                 unsig ? 'u' : 'i');
        struct bd_field f;
        cr_assert_eq(parse_value(text, &f), BD_PARSE_OK, "%s", text);
        text[strlen(text) - 1] = '\0';
        if (unsig) {
            cr_assert_eq(f.kind, BD_VAL_UINT);
            cr_assert_eq(f.v.u, strtoull(text, NULL, 10), "%s", text);
        } else {
            cr_assert_eq(f.kind, BD_VAL_INT);
            cr_assert_eq(f.v.i, strtoll(text, NULL, 10), "%s", text);
        }
    }
    /* Shapes the 8-byte path must leave to the general one. */
    static const char *const bad[] = {"-5u", "1.5i", ".i", "-i", "+5i", "5ii", "1-2i", "0x1i"};
    for (size_t i = 0; i < BD_ARRAY_LEN(bad); i++) {
        struct bd_field f;
        cr_assert_lt(parse_value(bad[i], &f), 0, "%s", bad[i]);
    }
}

/*
 * bd_parse_line must give what the general parser alone gives, to the message, on plain lines
 * with the slips that make the fast path step aside: double and trailing spaces, empty keys and
 * values, '=' ending a tag value or inside a measurement, repeated keys, words, long numbers.
 */
Test(parse, fast_path_agrees_with_general_parser) {
    agrees_with_general(random_plain_line, 99);
}

Test(parse, booleans) {
    const char *yes[] = {"t", "T", "true", "True", "TRUE"};
    const char *no[] = {"f", "F", "false", "False", "FALSE"};
    char line[32];
    for (int i = 0; i < 5; i++) {
        snprintf(line, sizeof(line), "m v=%s", yes[i]);
        const struct bd_field *f = field(ok(line), "v");
        cr_assert_eq(f->kind, BD_VAL_BOOL);
        cr_assert(f->v.b, "%s", yes[i]);
        snprintf(line, sizeof(line), "m v=%s", no[i]);
        f = field(ok(line), "v");
        cr_assert_eq(f->kind, BD_VAL_BOOL);
        cr_assert_not(f->v.b, "%s", no[i]);
    }
    const char *bad[] = {"m v=tru", "m v=tRUE", "m v=Falsey", "m v=FALSe", "m v=t1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid boolean");
    }
}

Test(parse, duplicate_fields_keep_first_place_last_value) {
    const struct bd_point *pt = ok("m a=1,b=2,a=\"x\",c=3");
    cr_assert_eq(pt->n_fields, 3);
    expect_str(pt->fields[0].key, "a");
    cr_assert_eq(pt->fields[0].kind, BD_VAL_STRING);
    expect_str(pt->fields[0].v.s, "x");
    expect_str(pt->fields[1].key, "b");
    expect_str(pt->fields[2].key, "c");
}

Test(parse, duplicate_tags_rejected) {
    fails("cpu,b=2,b=1,c=3 v=1i", BD_PARSE_ESYNTAX, "duplicate tag key");
    fails("cpu,b=2,c=3,b=1 v=1i", BD_PARSE_ESYNTAX, "duplicate tag key");
    fails("cpu,b\\ x=2,b\\ x=2 v=1", BD_PARSE_ESYNTAX, "duplicate tag key");
}

/* ---- Line protocol: timestamps ----------------------------------------------------------- */

Test(parse, timestamps_ns) {
    cr_assert_eq(ok("m v=1 0")->time_ns, 0);
    cr_assert_eq(ok("m v=1 -1")->time_ns, -1);
    cr_assert_eq(ok("m v=1 9223372036854775807")->time_ns, INT64_MAX);
    cr_assert_eq(ok("m v=1 -9223372036854775808")->time_ns, INT64_MIN);
    fails("m v=1 9223372036854775808", BD_PARSE_ERANGE, "timestamp out of range");
    fails("m v=1 -9223372036854775809", BD_PARSE_ERANGE, NULL);
    const char *bad[] = {"m v=1 -",   "m v=1 1-2", "m v=1 --5", "m v=1 12a",
                         "m v=1 -1?", "m v=1 +5",  "m v=1 1.5", "m v=1 x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid timestamp");
    }
    fails("m v=1 9223372036854775807 12", BD_PARSE_ESYNTAX, "unexpected text after timestamp");
}

Test(parse_setup, precision_scaling) {
    struct {
        enum bd_precision prec;
        const char *line;
        int64_t want;
    } cases[] = {
        {BD_PREC_NS, "m v=1 946730096789012345", 946730096789012345},
        {BD_PREC_US, "m v=1 946730096789012", 946730096789012000},
        {BD_PREC_MS, "m v=1 946730096789", 946730096789000000},
        {BD_PREC_S, "m v=1 946730096", 946730096000000000},
        {BD_PREC_S, "m v=1 -5", -5000000000},
        {BD_PREC_S, "m v=1 9223372036", 9223372036000000000},
        {BD_PREC_S, "m v=1 -9223372036", -9223372036000000000},
        {BD_PREC_MS, "m v=1 9223372036854", 9223372036854000000},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        init_with(BD_FORMAT_INFLUX, cases[i].prec, 1024);
        const struct bd_point *pt = ok(cases[i].line);
        cr_assert(pt->has_time);
        cr_assert_eq(pt->time_ns, cases[i].want, "%s", cases[i].line);
        bd_parser_close(&parser);
    }
    cr_assert_eq(bd_parse_unit_ns(BD_PREC_US), 1000);
}

Test(parse_setup, timestamp_overflow_after_scaling) {
    const struct {
        enum bd_precision prec;
        const char *line;
    } cases[] = {
        {BD_PREC_S, "m v=1 9223372037"},         {BD_PREC_S, "m v=1 -9223372037"},
        {BD_PREC_MS, "m v=1 9223372036855"},     {BD_PREC_US, "m v=1 9223372036854776"},
        {BD_PREC_US, "m v=1 -9223372036854776"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        init_with(BD_FORMAT_INFLUX, cases[i].prec, 1024);
        fails(cases[i].line, BD_PARSE_ERANGE, "timestamp out of range");
        bd_parser_close(&parser);
    }
}

/* ---- Line protocol: series key ----------------------------------------------------------- */

Test(parse, series_key_is_canonical) {
    const char *same[] = {
        "cpu,host=a,region=b,zone=c v=1",
        "cpu,zone=c,host=a,region=b v=1 5",
        "cpu,region=b,zone=c,host=a f=\"x\",g=2i",
        "  cpu,zone=c,region=b,host=a v=1",
    };
    char first[128];
    copy_key(first, sizeof(first), ok(same[0])->series_key);
    cr_assert_str_eq(first, "cpu,host=a,region=b,zone=c");
    for (size_t i = 1; i < sizeof(same) / sizeof(same[0]); i++) {
        char key[128];
        copy_key(key, sizeof(key), ok(same[i])->series_key);
        cr_assert_str_eq(key, first, "%s", same[i]);
    }
    const struct bd_point *pt = ok("cpu,last=1,first=2 v=1");
    expect_str(pt->tags[0].key, "first");
    expect_str(pt->tags[1].key, "last");
    expect_str(pt->series_key, "cpu,first=2,last=1");
}

Test(parse, series_key_keeps_escapes) {
    /* Sorted by the unescaped key; each tag written back escaped. */
    const struct bd_point *pt = ok("c\\ p\\,u,z\\=k=a\\ b,a\\,k=c\\=d v=1");
    expect_str(pt->name, "c p,u");
    expect_str(pt->tags[0].key, "a,k");
    expect_str(pt->tags[1].key, "z=k");
    expect_str(pt->series_key, "c\\ p\\,u,a\\,k=c\\=d,z\\=k=a\\ b");
    /* A literal backslash stays one, so the key reads back to the same tags. */
    pt = ok("m,b=x\\\\ y,a=\\q v=1");
    expect_str(pt->tags[1].value, "x\\ y");
    expect_str(pt->series_key, "m,a=\\q,b=x\\\\ y");
    /* Different tag sets never share a key. */
    char k1[64];
    char k2[64];
    copy_key(k1, sizeof(k1), ok("m,a=1\\,b\\=2 v=1")->series_key);
    copy_key(k2, sizeof(k2), ok("m,a=1,b=2 v=1")->series_key);
    cr_assert_str_neq(k1, k2);
}

/* Two tags the wrong way round are swapped (the fast walk's own case, without the general
 * sort): the series key is the sorted one, the tags come sorted, and one key twice is refused
 * as the general parser refuses it. */
Test(parse, two_unsorted_tags_are_swapped) {
    const char *lines[][2] = {
        {"m,site=p1,sensor=s7 v=1 5", "m,sensor=s7,site=p1"}, /* same first byte */
        {"m,b=2,a=1 v=1", "m,a=1,b=2"},                       /* first bytes fall */
        {"m,ab=1,a=2 v=1", "m,a=2,ab=1"},                     /* one key a prefix of the other */
        {"m,sensor_long_key_name_x=1,sensor_long_key_name=2 v=1",
         "m,sensor_long_key_name=2,sensor_long_key_name_x=1"}, /* past 16 bytes: memcmp */
    };
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++) {
        const struct bd_point *pt = ok(lines[i][0]);
        expect_str(pt->series_key, lines[i][1]);
        cr_assert_eq(pt->n_tags, 2);
        char key[128];
        copy_key(key, sizeof(key), pt->tags[0].key);
        cr_assert(strstr(lines[i][1], key) == lines[i][1] + 2, "%s: first tag %s", lines[i][0],
                  key);
    }
    const struct bd_point *pt = ok("m,site=p1,sensor=s7 v=1 5");
    expect_str(pt->tags[0].key, "sensor");
    expect_str(pt->tags[0].value, "s7");
    expect_str(pt->tags[1].key, "site");
    expect_str(pt->tags[1].value, "p1");
    cr_assert_eq(pt->time_ns, 5);
    fails("cpu,b=2,b=1 v=1i", BD_PARSE_ESYNTAX, "duplicate tag key");
    fails("cpu,site=2,site=1 v=1i", BD_PARSE_ESYNTAX, "duplicate tag key");
}

Test(parse, sorted_tags_need_no_copy) {
    char line[] = "cpu,a=1,b=2 v=1";
    const struct bd_point *pt = ok(line);
    cr_assert_eq(pt->series_key.ptr, line);
    cr_assert_eq(pt->series_key.len, strlen("cpu,a=1,b=2"));
}
