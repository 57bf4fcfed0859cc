/*
 * Unit tests for the line parsers (include/bucketd/parse.h, src/parse*.c) at their edges: the
 * limits on fields, tags, line length and scratch space, malformed, NUL-holding, invalid UTF-8
 * and mutated lines (which must fail cleanly), Graphite plaintext, batch parsing
 * (bd_parse_begin / bd_parse_next) against line-by-line parsing, and timestamp digits in every
 * position. The line-protocol grammar is tested in test_parse.c.
 */
#include "parse_harness.h"

TestSuite(parse, .init = influx_ns, .fini = teardown);
/* Tests that set up their own parsers, with other precisions or limits. */
TestSuite(parse_setup);

/* ---- Line protocol: limits --------------------------------------------------------------- */

static char *fields_line(unsigned n) {
    size_t cap = 32 + (size_t)n * 16;
    char *line = malloc(cap);
    size_t o = (size_t)snprintf(line, cap, "m ");
    for (unsigned i = 0; i < n; i++) {
        o += (size_t)snprintf(line + o, cap - o, "%sf%u=%ui", i ? "," : "", i, i);
    }
    return line;
}

static char *tags_line(unsigned n) {
    size_t cap = 32 + (size_t)n * 16;
    char *line = malloc(cap);
    size_t o = (size_t)snprintf(line, cap, "m");
    for (unsigned i = 0; i < n; i++) {
        o += (size_t)snprintf(line + o, cap - o, ",t%u=v%u", i, i);
    }
    snprintf(line + o, cap - o, " v=1");
    return line;
}

Test(parse, too_many_fields) {
    char *line = fields_line(BD_PARSE_MAX_FIELDS);
    const struct bd_point *pt = ok(line);
    cr_assert_eq(pt->n_fields, BD_PARSE_MAX_FIELDS);
    cr_assert_eq(pt->fields[BD_PARSE_MAX_FIELDS - 1].v.i, BD_PARSE_MAX_FIELDS - 1);
    free(line);
    line = fields_line(BD_PARSE_MAX_FIELDS + 1);
    fails(line, BD_PARSE_ETOO_MANY_FIELDS, "too many fields");
    free(line);
}

Test(parse, too_many_tags) {
    /* The conformance corpus holds a valid point with 255 tags. */
    char *line = tags_line(255);
    const struct bd_point *pt = ok(line);
    cr_assert_eq(pt->n_tags, 255);
    free(line);
    line = tags_line(BD_PARSE_MAX_TAGS);
    pt = ok(line);
    cr_assert_eq(pt->n_tags, BD_PARSE_MAX_TAGS);
    /* Sorted by bytes: t0, t1, t10, t100, ... */
    expect_str(pt->tags[0].key, "t0");
    expect_str(pt->tags[1].key, "t1");
    expect_str(pt->tags[2].key, "t10");
    expect_str(pt->tags[3].key, "t100");
    free(line);
    line = tags_line(BD_PARSE_MAX_TAGS + 1);
    fails(line, BD_PARSE_ETOO_MANY_TAGS, "too many tags");
    free(line);
}

/* Exponents and digit runs too long to track exactly must still give the right value. */
Test(parse_setup, float_extreme_lengths) {
    size_t cap = 2 * 1024 * 1024;
    init_with(BD_FORMAT_INFLUX, BD_PREC_NS, cap);
    char *line = malloc(cap);
    /* 10^999999 * 10^-10000000: zero, though the exponents nearly cancel if one is capped. */
    size_t o = (size_t)snprintf(line, cap, "m v=1");
    memset(line + o, '0', 999999);
    o += 999999;
    snprintf(line + o, cap - o, "e-10000000");
    cr_assert(same_double(field(ok(line), "v")->v.f, 0.0));
    /* 0.(1.5 million zeros)1e1500010 = 1e9 */
    o = (size_t)snprintf(line, cap, "m v=0.");
    memset(line + o, '0', 1500000);
    o += 1500000;
    snprintf(line + o, cap - o, "1e1500010");
    cr_assert(same_double(field(ok(line), "v")->v.f, 1e9));
    /* 1 followed by 1.2 million zeros, then e-1200000 = 1 */
    o = (size_t)snprintf(line, cap, "m v=1");
    memset(line + o, '0', 1200000);
    o += 1200000;
    snprintf(line + o, cap - o, "e-1200000");
    cr_assert(same_double(field(ok(line), "v")->v.f, 1.0));
    free(line);
    bd_parser_close(&parser);
}

Test(parse_setup, line_too_long) {
    init_with(BD_FORMAT_INFLUX, BD_PREC_NS, 16);
    ok("cpu v=1 12345678");
    ok("cpu v=1 1234567\r");
    fails("cpu v=1 123456789", BD_PARSE_ETOO_LONG, "line too long");
    bd_parser_close(&parser);
}

/* The longest line a small parser accepts, full of escapes and unsorted tags, fits scratch. */
Test(parse_setup, scratch_worst_case) {
    init_with(BD_FORMAT_INFLUX, BD_PREC_NS, 64);
    ok("\\ \\ \\ ,z\\ =\\ \\ ,a\\ =\\ \\  s=\"\\\\\\\\\\\\\",v=1.00000000000000000001");
    cr_assert_eq(field(&point, "v")->v.f, 1.0);
    bd_parser_close(&parser);
}

/* ---- Line protocol: malformed lines ------------------------------------------------------ */

Test(parse, malformed_lines) {
    const char *bad[] = {
        "cpu",
        "cpu ",
        "cpu,",
        "cpu,,,",
        "cpu,a",
        "cpu,a=",
        "cpu,a= v=1",
        "cpu,a==b v=1",
        "cpu,=a v=1",
        "cpu, a=1 v=1",
        "cpu,a=1, v=1",
        "cpu,a=1,,b=2 v=1",
        "cpu,a=1",
        "cpu,a=1 ",
        "cpu v",
        "cpu v=",
        "cpu v= ",
        "cpu v=,w=1",
        "cpu v=1,",
        "cpu v=1,,w=2",
        "cpu =1",
        "cpu v=1 x",
        "cpu v=1 1 2",
        ",a=1 v=1",
        " ,a=1 v=1",
        "=",
        "cpu v=\"abc",
        "cpu v=\"a\"x",
        "cpu v=\"a\"\"",
        "cpu v=1\t2",
        "cpu\tv=1",
        "cpu v=1\t",
        "cpu,a=b\tv=1",
        "x\x01y v=1",
        "m x\x01y=1",
        "m,x\x01y=v v=1",
        "cpu value=a",
        "cpu 1434055562000000000i",
        "cpu \"\\, '= \"\\ v=1.0",
        "cpu,host=f\\==o,",
        "cpu,host=serverA\\,,=us-east value=1i",
        "\\",
        "m\\",
        "m v=1 \\",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = parse(bad[i]);
        cr_assert_lt(rc, 0, "\"%s\" accepted", bad[i]);
        cr_assert_not_null(errmsg, "\"%s\"", bad[i]);
    }
    fails("cpu,a=1", BD_PARSE_ESYNTAX, "missing field set");
    fails("cpu v=\"abc", BD_PARSE_ESYNTAX, "unterminated string");
    fails("cpu,a= v=1", BD_PARSE_ESYNTAX, "missing tag value");
}

Test(parse, nul_bytes_are_characters) {
    cr_assert_lt(parse_n("m v=1\0", 6), 0);
    cr_assert_lt(parse_n("m\0 v=1", 6), 0);
    const struct bd_point *pt = NULL;
    cr_assert_eq(parse_n("m s=\"a\0b\"", 9), BD_PARSE_OK);
    pt = &point;
    cr_assert_eq(field(pt, "s")->v.s.len, 3);
}

Test(parse, invalid_utf8) {
    const char *bad[] = {
        "m\xff v=1",
        "m,t=\xc3 v=1",
        "m,t=v f\xc3\x28=1",
        "m s=\"bad\xff\"",
        "m s=\"\xc0\xaf\"",         /* overlong '/' */
        "m s=\"\xed\xa0\x80\"",     /* surrogate */
        "m s=\"\xf4\x90\x80\x80\"", /* past U+10FFFF */
        "m s=\"\xe2\x82\"",         /* truncated */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid UTF-8");
    }
    const struct bd_point *pt = ok("m\xc3\xa9,\xe2\x82\xac=\xf0\x9f\x98\x80 s=\"\xe6\x97\xa5\"");
    expect_str(pt->name, "m\xc3\xa9");
    expect_str(pt->tags[0].value, "\xf0\x9f\x98\x80");
}

/* Name and tags as "len:bytes" runs, to compare two points after the scratch is reused. */
static size_t dump_series(const struct bd_point *pt, char *out, size_t cap) {
    size_t o = 0;
    struct bd_str parts[1 + 2 * BD_PARSE_MAX_TAGS];
    size_t n = 0;
    parts[n++] = pt->name;
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        parts[n++] = pt->tags[i].key;
        parts[n++] = pt->tags[i].value;
    }
    for (size_t i = 0; i < n; i++) {
        o += (size_t)snprintf(out + o, cap - o, "%zu:", parts[i].len);
        cr_assert_lt(o + parts[i].len, cap);
        memcpy(out + o, parts[i].ptr, parts[i].len);
        o += parts[i].len;
    }
    return o;
}

/* Mutated valid lines must never crash, and anything accepted must be well-formed. */
Test(parse, mutated_lines_fail_cleanly) {
    const char *seeds[] = {
        "weather,location=us\\ midwest,season=summer temperature=82,note=\"a\\\"b\" 1465839830",
        "cpu,b=2,a=1 v=1.5e3,i=-3i,u=4u,t=true,s=\"x\" 123",
        "m\\,x,k\\==v\\ w f\\ g=\"\\\\\",h=.5 -9",
    };
    const char alphabet[] = " ,=\\\"\r\n\t#-.0123456789eEiutfTF\x01\xff\xc3\xa9";
    uint64_t seed = 42;
    char buf[256];
    int accepted = 0;
    for (int n = 0; n < 100000; n++) {
        lcg_next(&seed);
        const char *src = seeds[(seed >> 40) % 3];
        size_t len = strlen(src);
        memcpy(buf, src, len);
        for (int m = 0; m < 1 + (int)((seed >> 20) % 4); m++) {
            lcg_next(&seed);
            size_t at = (size_t)(seed >> 33) % (len + 1);
            char c = alphabet[(seed >> 13) % (sizeof(alphabet) - 1)];
            switch ((seed >> 8) % 3) {
            case 0: /* replace */
                if (at < len) {
                    buf[at] = c;
                }
                break;
            case 1: /* insert */
                if (len + 1 < sizeof(buf)) {
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = c;
                    len++;
                }
                break;
            default: /* delete */
                if (at < len) {
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                }
                break;
            }
        }
        /* A heap copy of exactly len bytes lets ASan catch any read past the line. */
        char *line = malloc(len + 1);
        memcpy(line, buf, len);
        int rc = parse_n(line, len);
        cr_assert(rc == BD_PARSE_OK || rc == BD_PARSE_SKIP || rc == BD_PARSE_ESYNTAX ||
                      rc == BD_PARSE_ETOO_MANY_FIELDS || rc == BD_PARSE_ETOO_MANY_TAGS ||
                      rc == BD_PARSE_ERANGE,
                  "rc %d", rc);
        if (rc < 0) {
            cr_assert_not_null(errmsg);
        }
        if (rc == BD_PARSE_OK) {
            cr_assert_gt(point.name.len, 0);
            cr_assert_gt(point.n_fields, 0);
            for (uint32_t i = 1; i < point.n_tags; i++) {
                struct bd_str a = point.tags[i - 1].key;
                struct bd_str b = point.tags[i].key;
                int c = memcmp(a.ptr, b.ptr, BD_MIN(a.len, b.len));
                cr_assert(c < 0 || (c == 0 && a.len < b.len), "tags out of order");
            }
            /* The series key is line protocol itself: read back, it gives the same series. */
            char want[1024];
            char got[1024];
            char again[512];
            size_t wn = dump_series(&point, want, sizeof(want));
            cr_assert_lt(point.series_key.len + 8, sizeof(again));
            memcpy(again, point.series_key.ptr, point.series_key.len);
            memcpy(again + point.series_key.len, " f=1", 4);
            cr_assert_eq(parse_n(again, point.series_key.len + 4), BD_PARSE_OK, "%.*s",
                         (int)(point.series_key.len + 4), again);
            size_t gn = dump_series(&point, got, sizeof(got));
            cr_assert(wn == gn && memcmp(want, got, wn) == 0, "%.*s", (int)wn, want);
            accepted++;
        }
        free(line);
    }
    /* Enough mutants stay valid for the checks above to mean something. */
    cr_assert_gt(accepted, 10000, "only %d accepted", accepted);
}

Test(parse, parser_state_does_not_leak_between_lines) {
    ok("m\\ x,b=2,a=1 s=\"e\\\"\" 5");
    const struct bd_point *pt = ok("n v=1");
    expect_str(pt->name, "n");
    cr_assert_eq(pt->n_tags, 0);
    cr_assert_eq(pt->n_fields, 1);
    cr_assert_not(pt->has_time);
    expect_str(pt->series_key, "n");
}

Test(parse_setup, init_checks_arguments) {
    cr_assert_eq(bd_parser_init(&parser, (enum bd_format)7, BD_PREC_NS, 100), -EINVAL);
    cr_assert_eq(bd_parser_init(&parser, BD_FORMAT_INFLUX, (enum bd_precision)9, 100), -EINVAL);
    cr_assert_eq(bd_parser_init(&parser, BD_FORMAT_INFLUX, BD_PREC_NS, 0), -EINVAL);
    cr_assert_eq(bd_parser_init(&parser, BD_FORMAT_INFLUX, BD_PREC_NS, SIZE_MAX), -EINVAL);
    bd_parser_close(&parser); /* harmless on a parser that failed to start, and twice */
    bd_parser_close(&parser);
}

/* ---- Graphite ---------------------------------------------------------------------------- */

TestSuite(graphite, .init = graphite, .fini = teardown);

Test(graphite, plain) {
    const struct bd_point *pt = ok("servers.web01.cpu 42.5 1700000000");
    expect_str(pt->name, "servers.web01.cpu");
    cr_assert_eq(pt->n_tags, 0);
    cr_assert_eq(pt->n_fields, 1);
    expect_str(pt->fields[0].key, "value");
    cr_assert_eq(pt->fields[0].kind, BD_VAL_FLOAT);
    cr_assert_eq(pt->fields[0].v.f, 42.5);
    cr_assert(pt->has_time);
    cr_assert_eq(pt->time_ns, 1700000000000000000);
    expect_str(pt->series_key, "servers.web01.cpu");
}

Test(graphite, values) {
    cr_assert_eq(ok("a 42 1")->fields[0].v.f, 42.0); /* integers read as floats */
    cr_assert_eq(ok("a -7 1")->fields[0].v.f, -7.0);
    cr_assert_eq(ok("a +7 1")->fields[0].v.f, 7.0);
    cr_assert_eq(ok("a 1e3")->fields[0].v.f, 1000.0);
    cr_assert_eq(ok("a .25")->fields[0].v.f, 0.25);
    const char *bad[] = {"a nan 1",  "a inf 1", "a -inf", "a 1x 1",
                         "a 0x10 1", "a 1,5 1", "a - 1",  "a 1i 1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid float");
    }
    fails("a 1e999 1", BD_PARSE_ERANGE, "float out of range");
    fails("a", BD_PARSE_ESYNTAX, "missing value");
    fails("a   ", BD_PARSE_ESYNTAX, "missing value");
}

Test(graphite, timestamps) {
    const struct bd_point *pt = ok("a 1 1700000000.5");
    cr_assert_eq(pt->time_ns, 1700000000500000000);
    cr_assert_eq(ok("a 1 1700000000.123456789")->time_ns, 1700000000123456789);
    cr_assert_eq(ok("a 1 1700000000.1234567891")->time_ns, 1700000000123456789);
    cr_assert_eq(ok("a 1 1700000000.")->time_ns, 1700000000000000000);
    cr_assert_eq(ok("a 1 0")->time_ns, 0);
    cr_assert_eq(ok("a 1 -2.5")->time_ns, -2500000000);
    cr_assert_eq(ok("a 1 9223372036.854775807")->time_ns, INT64_MAX);
    cr_assert_not(ok("a 1 -1")->has_time);
    cr_assert_not(ok("a 1")->has_time);
    cr_assert_not(ok("a 1   ")->has_time);
    cr_assert(ok("a 1 -1.5")->has_time);
    fails("a 1 9223372036.854775808", BD_PARSE_ERANGE, "timestamp out of range");
    fails("a 1 99999999999", BD_PARSE_ERANGE, "timestamp out of range");
    const char *bad[] = {"a 1 x", "a 1 1.5.5", "a 1 1e9", "a 1 .5", "a 1 -", "a 1 12a"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid timestamp");
    }
    fails("a 1 2 3", BD_PARSE_ESYNTAX, "unexpected text after timestamp");
}

Test(parse_setup, graphite_ignores_precision) {
    init_with(BD_FORMAT_GRAPHITE, BD_PREC_MS, 1024);
    cr_assert_eq(ok("a 1 2")->time_ns, 2000000000);
    bd_parser_close(&parser);
}

Test(graphite, whitespace_and_skips) {
    const struct bd_point *pt = ok("\t a.b \t 3 \t 5 \t\r");
    expect_str(pt->name, "a.b");
    cr_assert_eq(pt->time_ns, 5000000000);
    cr_assert_eq(parse(""), BD_PARSE_SKIP);
    cr_assert_eq(parse(" \t "), BD_PARSE_SKIP);
    cr_assert_eq(parse("# note"), BD_PARSE_SKIP);
    fails("a\x01"
          "b 1",
          BD_PARSE_ESYNTAX, "invalid character in path");
    fails("a\xff 1", BD_PARSE_ESYNTAX, "invalid UTF-8");
}

Test(graphite, tags) {
    const struct bd_point *pt = ok("disk.used;rack=a1;dc=ams;host=db=1 12 1700000000");
    expect_str(pt->name, "disk.used");
    cr_assert_eq(pt->n_tags, 3);
    expect_str(pt->tags[0].key, "dc");
    expect_str(pt->tags[0].value, "ams");
    expect_str(pt->tags[1].key, "host");
    expect_str(pt->tags[1].value, "db=1");
    expect_str(pt->tags[2].key, "rack");
    expect_str(pt->series_key, "disk.used;dc=ams;host=db=1;rack=a1");
    char k2[64];
    copy_key(k2, sizeof(k2), ok("disk.used;host=db=1;dc=ams;rack=a1 13")->series_key);
    cr_assert_str_eq(k2, "disk.used;dc=ams;host=db=1;rack=a1");
    char line[] = "x;a=1;b=2 1";
    pt = ok(line);
    cr_assert_eq(pt->series_key.ptr, line);
    expect_str(pt->series_key, "x;a=1;b=2");
}

Test(graphite, bad_tags) {
    const char *bad[] = {"a; 1",     "a;k 1",    "a;=v 1",   "a;k= 1",  "a;k=~v 1",
                         "a;k!=v 1", "a;k^=v 1", "a;k=v; 1", "a;;k=v 1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        fails(bad[i], BD_PARSE_ESYNTAX, "invalid tag");
    }
    fails(";k=v 1", BD_PARSE_ESYNTAX, "missing path");
    fails("a;k=1;k=2 1", BD_PARSE_ESYNTAX, "duplicate tag key");
    expect_str(ok("a;site=p1;sensor=s7 1")->series_key, "a;sensor=s7;site=p1");
    fails("a;k=1;k=1 1", BD_PARSE_ESYNTAX, "duplicate tag key");
}

/* Printable ASCII lines take memchr to find their tokens; the others the byte loop. Both read
 * the same point out of the same text. */
Test(graphite, printable_and_other_lines_agree) {
    const char *lines[] = {
        "servers.web01.cpu 42.5 1700000000", "disk.used;rack=a1;dc=ams;host=db=1 12 1700000000.25",
        "a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p;k=v -0.125e2 1700000001", "x 1", "x;a=1 2 3"};
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++) {
        char key[256], name[256], tabbed[256];
        const struct bd_point *pt = ok(lines[i]);
        double v = pt->fields[0].v.f;
        int64_t t = pt->time_ns;
        bool has = pt->has_time;
        copy_key(key, sizeof(key), pt->series_key);
        copy_key(name, sizeof(name), pt->name);
        /* A tab before the value: legal, not printable. */
        snprintf(tabbed, sizeof(tabbed), "%s", lines[i]);
        *strchr(tabbed, ' ') = '\t';
        pt = ok(tabbed);
        expect_str(pt->name, name);
        expect_str(pt->series_key, key);
        cr_assert_eq(pt->fields[0].v.f, v, "%s", lines[i]);
        cr_assert_eq(pt->has_time, has);
        cr_assert_eq(pt->time_ns, t);
    }
    /* Non-ASCII names are checked as UTF-8 and kept. */
    const struct bd_point *pt = ok("temp;city=z\xc3\xbcrich 3 4");
    expect_str(pt->tags[0].value, "z\xc3\xbcrich");
    fails("a\x7f"
          "b 1",
          BD_PARSE_ESYNTAX, "invalid character in path");
    fails("a.very.long.path\x1f.beyond.eight.bytes 1", BD_PARSE_ESYNTAX,
          "invalid character in path");
    /* 19 digits never overflow while read; 20 and more are out of range, not wrapped. */
    fails("a 1 9999999999999999999", BD_PARSE_ERANGE, "timestamp out of range");
    fails("a 1 18446744073709551616", BD_PARSE_ERANGE, "timestamp out of range");
    fails("a 1 184467440737095516160000", BD_PARSE_ERANGE, "timestamp out of range");
    cr_assert_eq(ok("a 1 0000000000000000000000001")->time_ns, 1000000000);
}

Test(graphite, too_many_tags) {
    char line[8192];
    size_t o = (size_t)snprintf(line, sizeof(line), "m");
    for (unsigned i = 0; i <= BD_PARSE_MAX_TAGS; i++) {
        o += (size_t)snprintf(line + o, sizeof(line) - o, ";t%u=v", i);
    }
    snprintf(line + o, sizeof(line) - o, " 1");
    fails(line, BD_PARSE_ETOO_MANY_TAGS, "too many tags");
}

/* ---------------------------------------------------------------------------------------- */
/* Batch parsing (bd_parse_begin / bd_parse_next)                                           */

static size_t random_graphite_line(uint64_t *seed, char *line, size_t cap);

/* What a test stream of one format is made of (see make_stream). */
struct stream_kind {
    const char *const *odd; /* lines that must leave the fast path */
    size_t n_odd;
    size_t (*random_line)(uint64_t *seed, char *line, size_t cap); /* with slips */
    bool too_long;         /* now and then a line over the parser's max_line (300) */
    const char *long_head; /* the line longer than the window: this, */
    char long_fill;        /* then long_line of these, */
    const char *long_tail; /* then this, and one more ordinary line */
};

/*
 * Line protocol's odd lines: blank, comment, "\r\n", string values (one with an escaped quote),
 * non-ASCII names, a tab, a repeated field, a name starting with '=', unsorted tags, and dense
 * separators.
 */
static const char *const influx_odd[] = {
    "",
    "# a comment",
    "   ",
    "cpu,host=a v=1 1700000000000000000\r",
    "s,host=b msg=\"a \\\"quoted\\\" word\",v=2i 5",
    "température,salle=cuisine v=21.5",
    "tab\tbed v=1",
    "\r",
    "cpu v=1,v=2,w=3 7",
    "=m v=1",
    "m,b=1,a=2 v=1",
    /* Dense separators: more than 32 in some half words, every bit of some words. */
    "m,a=b,c=d,e=f,g=h,i=j,k=l,m=n,o=p,q=r,s=t,u=v,w=x x=1,y=2,z=3,a=4i,b=5u,c=6,d=7 8",
    "=,= ,=,=,= ,,,,==== ,, == , ,=,=,= ,,,,==== ,, == , ,=,=,= ,,,,==== ,, == , ,=,=,=,,=",
};

/*
 * Graphite's: blank, comment, tabs, "\r\n", tags, no timestamp, non-ASCII, '!' in a tag key,
 * leading spaces, and dense separators.
 */
static const char *const graphite_odd[] = {
    "",
    "# comment",
    "\ta.b 1 2",
    "a.b\t1",
    "a.b 1 2\r",
    "a;k=v 1 2",
    "p 1",
    "é.b 1 5",
    "a;k!=v 1",
    "  a 1",
    "a;b=c;d=e;f=g;h=i;j=k;l=m;n=o;p=q;r=s;t=u;v=w;x=y 1 2",
    "=;= ;=;=;= ;;;;==== ;; == ; ;=;=;= ;;;;==== ;; == ; ;=;=;",
};

static const struct stream_kind influx_stream = {
    .odd = influx_odd,
    .n_odd = BD_ARRAY_LEN(influx_odd),
    .random_line = random_plain_line,
    .too_long = true,
    .long_head = "long,host=x v=",
    .long_fill = '7',
    .long_tail = "\nafter v=1 3\n",
};

static const struct stream_kind graphite_stream = {
    .odd = graphite_odd,
    .n_odd = BD_ARRAY_LEN(graphite_odd),
    .random_line = random_graphite_line,
    .too_long = false,
    .long_head = "long.path",
    .long_fill = 'p',
    .long_tail = " 1 2\nafter 1 3\n",
};

/*
 * A stream as a datagram or TCP read holds it: random lines of the format, and between them its
 * odd lines, a line over max_line (line protocol) and, when long_line is not 0, a line longer
 * than the whole window. Returns its length; the last line has no '\n' when seed says so.
 */
static size_t make_stream(const struct stream_kind *k, uint64_t seed, char *buf, size_t cap,
                          size_t long_line) {
    size_t o = 0;
    char line[512];
    for (int n = 0; n < 400 && o + 600 < cap; n++) {
        lcg_next(&seed);
        uint64_t r = seed >> 33;
        if (r % 7 == 0) {
            o += (size_t)snprintf(buf + o, cap - o, "%s\n", k->odd[(r >> 3) % k->n_odd]);
        } else if (k->too_long && r % 97 == 1) {
            /* Over the parser's max_line (300): counted as too long, never parsed. */
            o += (size_t)snprintf(buf + o, cap - o, "big v=1%0350d\n", 0);
        } else {
            size_t len = k->random_line(&seed, line, sizeof(line));
            memcpy(buf + o, line, len);
            o += len;
            buf[o++] = '\n';
        }
    }
    if (long_line > 0 && o + long_line + 1 < cap) {
        o += (size_t)snprintf(buf + o, cap - o, "%s", k->long_head);
        while (long_line-- > 0) {
            buf[o++] = k->long_fill;
        }
        o += (size_t)snprintf(buf + o, cap - o, "%s", k->long_tail);
    }
    if ((seed >> 60) & 1) {
        o--; /* no '\n' after the last line */
    }
    return o;
}

/*
 * Every line of a batch must come back with exactly the text between its newlines and exactly
 * what bd_parse_line gives for that text (code, message, point), whatever the format, the
 * classifier variant and wherever the window boundaries fall (windows of 1, 2, 3, 256 words).
 */
static void batch_check(enum bd_format format) {
    static const char *const isas[] = {"avx512", "avx2", "sse2", "swar"};
    static const size_t windows[] = {1, 2, 3, BD_PARSE_WINDOW_WORDS};
    struct bd_parser single;
    struct bd_point *other = malloc(sizeof(*other));
    size_t cap = 256 * 1024;
    char *buf = malloc(cap);
    char a[2048];
    char b[2048];
    cr_assert(other != NULL && buf != NULL);
    cr_assert_eq(bd_parser_init(&single, format, BD_PREC_NS, 300), 0);
    int variants = 0;
    long lines = 0, accepted = 0;
    for (size_t v = 0; v < BD_ARRAY_LEN(isas); v++) {
        for (size_t w = 0; w < BD_ARRAY_LEN(windows); w++) {
            init_with(format, BD_PREC_NS, 300);
            if (bd_parser_set_isa(&parser, isas[v]) != 0) {
                bd_parser_close(&parser);
                continue; /* not on this CPU */
            }
            bd_parser_set_window(&parser, windows[w]);
            variants++;
            for (uint64_t seed = 1; seed <= 12; seed++) {
                size_t big = seed % 3 == 0 ? 40000 : 0;
                size_t len =
                    make_stream(format == BD_FORMAT_INFLUX ? &influx_stream : &graphite_stream,
                                seed * 7919, buf, cap, big);
                bd_parse_begin(&parser, buf, len);
                size_t pos = 0;
                for (;;) {
                    struct bd_str line = {NULL, 0};
                    const char *e1 = NULL;
                    int rc = bd_parse_next(&parser, &point, &line, &e1);
                    if (rc == BD_PARSE_END) {
                        break;
                    }
                    /* The line is the text up to the next '\n' (or the end). */
                    const char *nl = memchr(buf + pos, '\n', len - pos);
                    size_t want = nl != NULL ? (size_t)(nl - buf) - pos : len - pos;
                    cr_assert(line.ptr == buf + pos && line.len == want,
                              "%s/%zu: line at %zu: got %zu bytes at %td, want %zu", isas[v],
                              windows[w], pos, line.len, line.ptr - buf, want);
                    cr_assert_eq(bd_parse_offset(&parser), pos + want + 1);
                    pos += want + 1;
                    lines++;
                    size_t an = rc == BD_PARSE_OK ? describe(&point, a, sizeof(a)) : 0;
                    const char *e2 = NULL;
                    int rc2 = bd_parse_line(&single, line.ptr, line.len, other, &e2);
                    cr_assert_eq(rc, rc2, "%s/%zu: \"%.*s\": batch %d, line %d", isas[v],
                                 windows[w], (int)line.len, line.ptr, rc, rc2);
                    cr_assert(rc >= 0 || e1 == e2, "\"%.*s\": \"%s\" vs \"%s\"", (int)line.len,
                              line.ptr, e1, e2);
                    if (rc == BD_PARSE_OK) {
                        size_t bn = describe(other, b, sizeof(b));
                        cr_assert(an == bn && memcmp(a, b, an) == 0,
                                  "%s/%zu: \"%.*s\":\n%.*s\nvs\n%.*s", isas[v], windows[w],
                                  (int)line.len, line.ptr, (int)an, a, (int)bn, b);
                        accepted++;
                    }
                }
                cr_assert_geq(pos, len, "%s/%zu: the batch ended at %zu of %zu", isas[v],
                              windows[w], pos, len);
            }
            bd_parser_close(&parser);
        }
    }
    bd_parser_close(&single);
    free(other);
    free(buf);
    /* Every window with the portable variant at least; more where the CPU has SSE2 or AVX2. */
    cr_assert_geq(variants, 4, "only %d classifier/window variants ran", variants);
    /* The random lines slip often: a quarter to a half of them are valid. */
    cr_assert_gt(accepted, lines / 8, "%ld of %ld lines accepted", accepted, lines);
}

Test(parse_setup, batch_matches_line_by_line) {
    batch_check(BD_FORMAT_INFLUX);
}

Test(parse_setup, graphite_batch_matches_line_by_line) {
    batch_check(BD_FORMAT_GRAPHITE);
}

/* An empty batch, and a batch of nothing but newlines. */
Test(parse, batch_empty_and_blank) {
    bd_parse_begin(&parser, "", 0);
    cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_END);
    const char *nls = "\n\n\n";
    bd_parse_begin(&parser, nls, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_SKIP);
    }
    cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_END);
    /* A batch whose length is a whole number of bitmap words, the last line unterminated. */
    char text[128];
    memset(text, 'a', sizeof(text));
    memcpy(text, "cpu v=1 1\n", 10);
    memcpy(text + 120, " v=2 200", 8);
    bd_parse_begin(&parser, text, sizeof(text));
    cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_OK);
    cr_assert_eq(point.time_ns, 1);
    cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_OK);
    cr_assert_eq(point.name.len, 110);
    cr_assert_eq(point.time_ns, 200);
    cr_assert_eq(bd_parse_next(&parser, &point, NULL, NULL), BD_PARSE_END);
}

/*
 * Timestamps of every length the fast path reads (1 to 19 digits, 16 at a time with SSE2 past
 * 15), clean and with one byte that is no digit at each position ('/' and ':' border the
 * digits): the same answer as the general parser, to the value.
 */
Test(parse, timestamp_digits_every_length_and_position) {
    static const char bad[] = {'/', ':', 'x'};
    struct bd_point *other = malloc(sizeof(*other));
    cr_assert_not_null(other);
    char line[64];
    int checked = 0;
    for (size_t n = 1; n <= 19; n++) {
        for (int at = -1; at < (int)n; at++) {
            for (size_t b = 0; b < (at < 0 ? 1 : sizeof(bad)); b++) {
                int o = snprintf(line, sizeof(line), "m v=1 ");
                for (size_t k = 0; k < n; k++) {
                    line[o + (int)k] = (char)('1' + (k * 7 + n) % 9);
                }
                if (at >= 0) {
                    line[o + at] = bad[b];
                }
                size_t len = (size_t)o + n;
                line[len] = '\0'; /* for strtoll below; the parsers get the length */
                const char *e1 = NULL;
                const char *e2 = NULL;
                int rc1 = bd_parse_line(&parser, line, len, &point, &e1);
                int rc2 = bd_parse_line_general(&parser, line, len, other, &e2);
                cr_assert_eq(rc1, rc2, "\"%.*s\": %d vs general %d", (int)len, line, rc1, rc2);
                cr_assert_eq(rc1 == BD_PARSE_OK, at < 0, "\"%.*s\": %d", (int)len, line, rc1);
                if (rc1 == BD_PARSE_OK) {
                    cr_assert_eq(point.time_ns, other->time_ns, "\"%.*s\"", (int)len, line);
                    cr_assert_eq(point.time_ns, strtoll(line + o, NULL, 10));
                }
                checked++;
            }
        }
    }
    free(other);
    cr_assert_gt(checked, 500);
}

/* A Graphite line as senders write them, sometimes with one slip. */
static size_t random_graphite_line(uint64_t *seed, char *line, size_t cap) {
    static const char *const paths[] = {"a", "plant.l1.dev-7.temp", "x=y", "p.q", "s.t.u"};
    static const char *const keys[] = {"k", "region", "unit", "a", "b", "z", "k!", "^k", ""};
    static const char *const values[] = {"eu", "si", "v=w", "~x", "1", "", "count", "a;b"};
    static const char *const nums[] = {"1",  "-2",       "3.5",       ".5",        "1.", "+7",
                                       "-0", "12345678", "123456789", "1e3",       "7i", "x",
                                       "",   "+-1",      "99.25",     "-1234.5678"};
    static const char *const times[] = {"",
                                        "",
                                        " 1",
                                        " -1",
                                        " 1736949600",
                                        " 1.5",
                                        " 99999999999",
                                        " 9223372037",
                                        " 9223372036",
                                        " x",
                                        "  5",
                                        " 1 "};
    static const char slips[] = " ;=.-\t~!";
    size_t o = (size_t)snprintf(line, cap, "%s", PICK(seed, paths));
    int n_tags = (int)((*seed >> 20) % 4);
    for (int k = 0; k < n_tags; k++) {
        o += (size_t)snprintf(line + o, cap - o, ";%s=%s", PICK(seed, keys), PICK(seed, values));
    }
    o += (size_t)snprintf(line + o, cap - o, " %s%s", PICK(seed, nums), PICK(seed, times));
    lcg_next(seed);
    if ((*seed >> 40) % 4 == 0 && o > 0) {
        line[(*seed >> 8) % o] = slips[(*seed >> 50) % (sizeof(slips) - 1)];
    }
    return BD_MIN(o, cap - 1);
}

/* The Graphite fast walk must give what parse_graphite alone gives, to the message. */
Test(graphite, fast_path_agrees_with_general_parser) {
    agrees_with_general(random_graphite_line, 7);
}
