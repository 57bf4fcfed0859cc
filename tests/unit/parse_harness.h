/*
 * The parser's unit-test harness, shared by test_parse.c and test_parse_edge.c: one parser and
 * one point per test process, the suites' setup and teardown, parsing a line and checking its
 * result, the repeatable random lines and the check that bd_parse_line gives what the general
 * parser alone gives. Header-only; each test file defines its own TestSuites with the setup and
 * teardown below.
 */
#ifndef BUCKETD_TEST_PARSE_HARNESS_H
#define BUCKETD_TEST_PARSE_HARNESS_H

#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/parse.h"
/* bd_parse_line_general(): the general parser alone, to compare the fast path with. */
#include "../../src/parse_int.h"

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

/* A point is several KiB: one static per test process (Criterion forks each test). */
static struct bd_parser parser;
static struct bd_point point;
static const char *errmsg;

static void init_with(enum bd_format format, enum bd_precision precision, size_t max_line) {
    cr_assert_eq(bd_parser_init(&parser, format, precision, max_line), 0);
}

static void influx_ns(void) {
    init_with(BD_FORMAT_INFLUX, BD_PREC_NS, 64 * 1024);
}

static void graphite(void) {
    init_with(BD_FORMAT_GRAPHITE, BD_PREC_NS, 64 * 1024);
}

static void teardown(void) {
    bd_parser_close(&parser);
}

static int parse_n(const char *line, size_t len) {
    errmsg = NULL;
    return bd_parse_line(&parser, line, len, &point, &errmsg);
}

static int parse(const char *line) {
    return parse_n(line, strlen(line));
}

static const struct bd_point *ok(const char *line) {
    int rc = parse(line);
    cr_assert_eq(rc, BD_PARSE_OK, "\"%s\": rc %d (%s)", line, rc, errmsg ? errmsg : "-");
    return &point;
}

static void fails(const char *line, int want_rc, const char *want_msg) {
    int rc = parse(line);
    cr_assert_eq(rc, want_rc, "\"%s\": rc %d (%s), want %d", line, rc, errmsg ? errmsg : "-",
                 want_rc);
    cr_assert_not_null(errmsg, "\"%s\": no message", line);
    if (want_msg != NULL) {
        cr_assert_str_eq(errmsg, want_msg, "\"%s\"", line);
    }
}

static bool str_is(struct bd_str s, const char *want) {
    return s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0;
}

#define expect_str(s, want)                                                                        \
    cr_assert(str_is((s), (want)), "%s is \"%.*s\", want \"%s\"", #s, (int)(s).len, (s).ptr, (want))

static const struct bd_field *field(const struct bd_point *pt, const char *key) {
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        if (str_is(pt->fields[i].key, key)) {
            return &pt->fields[i];
        }
    }
    cr_assert_fail("no field \"%s\"", key);
    return NULL;
}

static bool same_double(double a, double b) {
    return memcmp(&a, &b, sizeof(a)) == 0;
}

/* One step of a 64-bit LCG (Knuth's MMIX constants): repeatable random tests. */
static void lcg_next(uint64_t *seed) {
    *seed = *seed * 6364136223846793005u + 1442695040888963407u;
}

/* Everything a point says, as text, to compare two parses of the same line. */
static size_t describe(const struct bd_point *pt, char *out, size_t cap) {
    size_t o = (size_t)snprintf(out, cap, "%.*s|%.*s|", (int)pt->name.len, pt->name.ptr,
                                (int)pt->series_key.len, pt->series_key.ptr);
    for (uint32_t i = 0; i < pt->n_tags && o < cap; i++) {
        o += (size_t)snprintf(out + o, cap - o, "%.*s=%.*s;", (int)pt->tags[i].key.len,
                              pt->tags[i].key.ptr, (int)pt->tags[i].value.len,
                              pt->tags[i].value.ptr);
    }
    for (uint32_t i = 0; i < pt->n_fields && o < cap; i++) {
        const struct bd_field *f = &pt->fields[i];
        uint64_t bits = 0;
        memcpy(&bits, &f->v, sizeof(bits));
        if (f->kind == BD_VAL_STRING) {
            /* The text, not where it lives (the scratch buffer of one parser or another). */
            o += (size_t)snprintf(out + o, cap - o, "%.*s:s:%.*s;", (int)f->key.len, f->key.ptr,
                                  (int)f->v.s.len, f->v.s.ptr);
            continue;
        }
        o += (size_t)snprintf(
            out + o, cap - o, "%.*s:%d:%llx;", (int)f->key.len, f->key.ptr, (int)f->kind,
            f->kind == BD_VAL_BOOL ? (unsigned long long)f->v.b : (unsigned long long)bits);
    }
    if (o < cap) {
        o += (size_t)snprintf(out + o, cap - o, "|%d:%lld", pt->has_time,
                              pt->has_time ? (long long)pt->time_ns : 0LL);
    }
    return BD_MIN(o, cap);
}

static const char *pick(uint64_t *seed, const char *const *from, size_t n) {
    lcg_next(seed);
    return from[(*seed >> 33) % n];
}

#define PICK(seed, arr) pick(seed, arr, BD_ARRAY_LEN(arr))

/* A plain line as senders write them, sometimes with one slip (see below). */
static size_t random_plain_line(uint64_t *seed, char *line, size_t cap) {
    static const char *const names[] = {"m", "cpu", "a=b", "disk_io", "x.y"};
    static const char *const keys[] = {"k", "host", "site", "a", "b", "zone", "f0", "v"};
    static const char *const values[] = {
        "1",         "-2",  "3.5",   ".5",    "1.",     "-0",         "12345678",
        "123456789", "1e3", "7i",    "8u",    "-9i",    "t",          "true",
        "F",         "x",   "-1.25", "0x10",  "+1",     "99999999.9", "1.5i",
        "-5u",       "",    "-",     "12.5 ", "4.2e-3", "-.1234567",  "1234567.8"};
    static const char *const times[] = {
        "",   "",     " 1",  " -1", " 1765432101234567890", " 17654321012345678901",
        " x", " 12 ", "  5", " 1,2"};
    static const char *const spaces[] = {" ", " ", " ", "  "};
    static const char slips[] = " ,=.-i9";
    size_t o = (size_t)snprintf(line, cap, "%s", PICK(seed, names));
    int n_tags = (int)((*seed >> 20) % 5);
    for (int k = 0; k < n_tags; k++) {
        o += (size_t)snprintf(line + o, cap - o, ",%s=%s", PICK(seed, keys), PICK(seed, keys));
    }
    o += (size_t)snprintf(line + o, cap - o, "%s", PICK(seed, spaces));
    int n_fields = 1 + (int)((*seed >> 24) % 5);
    for (int k = 0; k < n_fields; k++) {
        o += (size_t)snprintf(line + o, cap - o, "%s%s=%s", k == 0 ? "" : ",", PICK(seed, keys),
                              PICK(seed, values));
    }
    o += (size_t)snprintf(line + o, cap - o, "%s", PICK(seed, times));
    lcg_next(seed);
    if ((*seed >> 40) % 3 == 0 && o > 0) {
        line[(*seed >> 8) % o] = slips[(*seed >> 50) % (sizeof(slips) - 1)];
    }
    return BD_MIN(o, cap - 1);
}

/*
 * 200000 lines from gen through bd_parse_line and through the general parser alone on the
 * parser under test: the same code, message and point for each; more than 20000 accepted.
 */
static void agrees_with_general(size_t (*gen)(uint64_t *, char *, size_t), uint64_t seed) {
    struct bd_point *other = malloc(sizeof(*other));
    cr_assert_not_null(other);
    int accepted = 0;
    char line[512];
    char a[2048];
    char b[2048];
    for (int n = 0; n < 200000; n++) {
        size_t len = gen(&seed, line, sizeof(line));
        const char *e1 = NULL;
        const char *e2 = NULL;
        int rc1 = bd_parse_line(&parser, line, len, &point, &e1);
        int rc2 = bd_parse_line_general(&parser, line, len, other, &e2);
        cr_assert_eq(rc1, rc2, "\"%.*s\": %d vs general %d", (int)len, line, rc1, rc2);
        cr_assert(rc1 >= 0 || e1 == e2, "\"%.*s\": \"%s\" vs \"%s\"", (int)len, line, e1, e2);
        if (rc1 == BD_PARSE_OK) {
            /* The general parse reused the scratch buffer: parse again before comparing. */
            cr_assert_eq(bd_parse_line(&parser, line, len, &point, &e1), BD_PARSE_OK);
            size_t an = describe(&point, a, sizeof(a));
            cr_assert_eq(bd_parse_line_general(&parser, line, len, other, &e2), BD_PARSE_OK);
            size_t bn = describe(other, b, sizeof(b));
            cr_assert(an == bn && memcmp(a, b, an) == 0, "\"%.*s\":\n%.*s\nvs general\n%.*s",
                      (int)len, line, (int)an, a, (int)bn, b);
            accepted++;
        }
    }
    free(other);
    cr_assert_gt(accepted, 20000, "only %d accepted", accepted);
}

static void copy_key(char *dst, size_t cap, struct bd_str key) {
    cr_assert_lt(key.len, cap);
    memcpy(dst, key.ptr, key.len);
    dst[key.len] = '\0';
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#endif
