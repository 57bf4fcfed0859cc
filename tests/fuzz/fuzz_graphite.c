/*
 * libFuzzer target for the Graphite plaintext parser (src/parse*.c, BD_FORMAT_GRAPHITE).
 *
 * Input: the low two bits of the first byte pick the listener precision (which Graphite must
 * ignore), and its bit 2 a line limit of SMALL_MAX_LINE bytes instead of 64 KiB, so that the
 * limit itself and a scratch buffer filled to its size are reached too. The rest is a stream
 * split on '\n' as the daemon splits it. Each line is copied into a heap block of exactly its
 * length, so AddressSanitizer reports any read past its end.
 *
 * For every line: the result must not change when the same line is parsed again, nor under
 * another precision. For every accepted point: the invariants in check_point(); the series key
 * must be the path and its sorted tags; and the point written back as a canonical line must
 * parse to the same point. A broken invariant prints what failed and traps, which libFuzzer
 * reports as a crash with its input. (Graphite points hold nothing that line-protocol points
 * cannot, so bucketd-parse's JSON printer is exercised by fuzz_influx.c only.)
 *
 * Single-threaded, as libFuzzer calls it. The parsers, points and buffers are set up once in
 * LLVMFuzzerInitialize and live until the process exits.
 *
 * The general parser alone must give every line's answer too (the fast walk only speeds up
 * plain lines), and the whole input is also read as one batch, as in fuzz_influx.c
 * (check_batch).
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/parse.h"
#include "fuzz_common.h"

#define FUZZ_MAX_LINE (64 * 1024)
#define SMALL_MAX_LINE 256
#define N_PREC 4
#define N_LIMITS 2

_Static_assert(BD_PREC_NS == 0 && BD_PREC_S == N_PREC - 1, "precision from the first byte");

/* ---------------------------------------------------------------------------------------- */
/* Global state                                                                             */

/* parsers[limit][precision]: limit 0 takes lines of up to FUZZ_MAX_LINE, 1 SMALL_MAX_LINE. */
static struct bd_parser parsers[N_LIMITS][N_PREC];
/* The same, for the whole input as one batch (bd_parse_begin/bd_parse_next). */
static struct bd_parser batchers[N_LIMITS][N_PREC];
static struct bd_point *pt_main;  /* the point under test */
static struct bd_point *pt_other; /* the same line parsed again, another way */
static struct buf snap_main, snap_other, canon;
static void snapshot(struct buf *b, const struct bd_point *pt);
static struct fuzz_pair pair; /* pt_main and pt_other, compared through snapshot() */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int l = 0; l < N_LIMITS; l++) {
        for (int i = 0; i < N_PREC; i++) {
            size_t max_line = l == 0 ? FUZZ_MAX_LINE : SMALL_MAX_LINE;
            if (bd_parser_init(&parsers[l][i], BD_FORMAT_GRAPHITE, (enum bd_precision)i,
                               max_line) ||
                bd_parser_init(&batchers[l][i], BD_FORMAT_GRAPHITE, (enum bd_precision)i,
                               max_line)) {
                abort();
            }
        }
    }
    pt_main = malloc(sizeof(*pt_main));
    pt_other = malloc(sizeof(*pt_other));
    pair = (struct fuzz_pair){pt_main, pt_other, &snap_main, &snap_other, snapshot};
    if (pt_main == NULL || pt_other == NULL) {
        abort();
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Point invariants                                                                         */

/* Whether s holds a control character, a space, a tab or any byte of also. */
static bool has_any(struct bd_str s, const char *also) {
    for (size_t i = 0; i < s.len; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        if (c < 0x20 || c == 0x7f || c == ' ' || strchr(also, c) != NULL) {
            return true;
        }
    }
    return false;
}

static bool inside(struct bd_str s, const char *base, size_t n) {
    uintptr_t p = (uintptr_t)s.ptr;
    uintptr_t b = (uintptr_t)base;
    return p >= b && s.len <= n && p - b <= n - s.len;
}

/* A view points into the line or into the parser's scratch and is no longer than the line. */
static void check_view(struct bd_str s, const char *line, size_t n, const struct bd_parser *p) {
    CHECK(s.ptr != NULL);
    CHECK(s.len <= n);
    CHECK(inside(s, line, n) || inside(s, p->scratch, p->scratch_cap));
}

/* Graphite never unescapes: the path and the tags are the line's own bytes. */
static void check_text(struct bd_str s, const char *line, size_t n, const char *forbidden) {
    CHECK(s.ptr != NULL);
    CHECK(inside(s, line, n));
    CHECK(s.len >= 1);
    CHECK(!has_any(s, forbidden));
    CHECK(valid_utf8(s));
}

static int str_order(struct bd_str a, struct bd_str b) {
    size_t m = a.len < b.len ? a.len : b.len;
    int c = m == 0 ? 0 : memcmp(a.ptr, b.ptr, m);
    if (c != 0) {
        return c;
    }
    return (a.len > b.len) - (a.len < b.len);
}

static void check_point(const struct bd_point *pt, const char *line, size_t n,
                        const struct bd_parser *p) {
    CHECK(pt->n_tags <= BD_PARSE_MAX_TAGS);
    /* A path: no ';' (tags start there); never '#' first (a comment line). */
    check_text(pt->name, line, n, ";");
    CHECK(pt->name.ptr[0] != '#');
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        const struct bd_tag *t = &pt->tags[i];
        /* As carbon takes them: the key without '!', '^' or '=', the value not led by '~'. */
        check_text(t->key, line, n, ";!^=");
        check_text(t->value, line, n, ";");
        CHECK(t->value.ptr[0] != '~');
        CHECK(t->key.ptr + t->key.len + 1 == t->value.ptr && t->key.ptr[t->key.len] == '=');
        /* Strictly increasing: sorted, and no key twice. */
        CHECK(i == 0 || str_order(pt->tags[i - 1].key, t->key) < 0);
    }
    /* One float field; its key is a constant of parse_general.c, so only its text is checked. */
    CHECK(pt->n_fields == 1);
    const struct bd_field *f = &pt->fields[0];
    CHECK(f->key.len == 5 && memcmp(f->key.ptr, "value", 5) == 0);
    CHECK(f->kind == BD_VAL_FLOAT);
    CHECK(isfinite(f->v.f));
    /* -1 means "no timestamp", so it never comes out as one. */
    CHECK(!pt->has_time || pt->time_ns != -INT64_C(1000000000));
    check_view(pt->series_key, line, n, p);
}

/* Everything a point says, by value, so that two parses can be compared after the fact. */
static void snap_str(struct buf *b, struct bd_str s) {
    buf_put(b, &s.len, sizeof(s.len));
    buf_put(b, s.ptr, s.len);
}

static void snapshot(struct buf *b, const struct bd_point *pt) {
    b->len = 0;
    snap_str(b, pt->name);
    snap_str(b, pt->series_key);
    buf_put(b, &pt->n_tags, sizeof(pt->n_tags));
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        snap_str(b, pt->tags[i].key);
        snap_str(b, pt->tags[i].value);
    }
    buf_put(b, &pt->n_fields, sizeof(pt->n_fields));
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        snap_str(b, pt->fields[i].key);
        buf_putc(b, (char)pt->fields[i].kind);
        /* The bits, so that -0.0 and 0.0 differ. */
        buf_put(b, &pt->fields[i].v.f, sizeof(pt->fields[i].v.f));
    }
    buf_putc(b, pt->has_time ? 1 : 0);
    if (pt->has_time) {
        buf_put(b, &pt->time_ns, sizeof(pt->time_ns));
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The point as a canonical line                                                            */

static void put_text(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put_text(struct buf *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    CHECK(len >= 0 && (size_t)len < sizeof(tmp));
    buf_put(b, tmp, (size_t)len);
}

/* The shortest of 15, 16 or 17 significant digits that reads back as the same double. */
static void put_double(struct buf *b, double v) {
    char tmp[40];
    int len = 0;
    for (int prec = 15; prec <= 17; prec++) {
        len = snprintf(tmp, sizeof(tmp), "%.*g", prec, v);
        if (strtod(tmp, NULL) == v) {
            break;
        }
    }
    buf_put(b, tmp, (size_t)len);
}

/*
 * Writes pt as "path;k=v... value [seconds.nanoseconds]" with the tags in order, and returns the
 * length of its series-key part (path and tags).
 */
static size_t canonical_line(struct buf *b, const struct bd_point *pt) {
    b->len = 0;
    buf_put(b, pt->name.ptr, pt->name.len);
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        buf_putc(b, ';');
        buf_put(b, pt->tags[i].key.ptr, pt->tags[i].key.len);
        buf_putc(b, '=');
        buf_put(b, pt->tags[i].value.ptr, pt->tags[i].value.len);
    }
    size_t key_len = b->len;
    buf_putc(b, ' ');
    put_double(b, pt->fields[0].v.f);
    if (pt->has_time) {
        /* In unsigned arithmetic, so that INT64_MIN has a magnitude too. */
        uint64_t mag = (uint64_t)pt->time_ns;
        if (pt->time_ns < 0) {
            mag = ~mag + 1;
        }
        put_text(b, " %s%" PRIu64 ".%09" PRIu64, pt->time_ns < 0 ? "-" : "", mag / 1000000000u,
                 mag % 1000000000u);
    }
    return key_len;
}

/* ---------------------------------------------------------------------------------------- */
/* Driver                                                                                   */

/* Blank (spaces, tabs, the '\r' of a "\r\n") or a comment: exactly the lines skipped. */
static bool blank_or_comment(const char *s, size_t n) {
    if (n > 0 && s[n - 1] == '\r') {
        n--;
    }
    size_t i = 0;
    while (i < n && (s[i] == ' ' || s[i] == '\t')) {
        i++;
    }
    return i == n || s[i] == '#';
}

/* Parses one line every way described at the top, with the parsers of one line limit (set). */
static void check_line(struct bd_parser *set, enum bd_precision prec, const char *data, size_t n) {
    struct bd_parser *p = &set[prec];
    char *line = exact_copy(data, n);

    const char *err = NULL;
    int rc = bd_parse_line(p, line, n, pt_main, &err);
    CHECK(rc == BD_PARSE_OK || rc == BD_PARSE_SKIP ||
          (rc <= BD_PARSE_ESYNTAX && rc >= BD_PARSE_ETOO_LONG));
    CHECK(rc >= 0 || (err != NULL && err[0] != '\0'));
    CHECK((rc == BD_PARSE_SKIP) == (n <= p->max_line && blank_or_comment(line, n)));
    /* Graphite has no fields to count. */
    CHECK(rc != BD_PARSE_ETOO_MANY_FIELDS);
    if (rc == BD_PARSE_OK) {
        check_point(pt_main, line, n, p);
        snapshot(&snap_main, pt_main);
        size_t key_len = canonical_line(&canon, pt_main);
        CHECK(pt_main->series_key.len == key_len &&
              memcmp(pt_main->series_key.ptr, canon.ptr, key_len) == 0);
    }

    /* Again, on the same parser, and on one of another precision: the same answer. */
    for (int k = 0; k < 2; k++) {
        struct bd_parser *q = k == 0 ? p : &set[(prec + 1) % N_PREC];
        const char *err2 = NULL;
        int rc2 = bd_parse_line(q, line, n, pt_other, &err2);
        CHECK(rc2 == rc && (rc >= 0 || strcmp(err2, err) == 0));
        if (rc == BD_PARSE_OK) {
            snapshot(&snap_other, pt_other);
            CHECK(buf_eq(&snap_main, &snap_other));
        }
    }

    /* The general parser alone: the fast walk for plain lines must not change any answer. */
    const char *errg = NULL;
    int rcg = bd_parse_line_general(p, line, n, pt_other, &errg);
    check_same(&pair, rc, err, rcg, errg);

    /* The canonical text of an accepted point reads back as the same point. */
    if (rc == BD_PARSE_OK && canon.len <= p->max_line) {
        char *again = exact_copy(canon.ptr, canon.len);
        const char *err3 = NULL;
        int rc3 = bd_parse_line(p, again, canon.len, pt_other, &err3);
        if (rc3 != BD_PARSE_OK) {
            fprintf(stderr, "fuzz_graphite: canonical line rejected (%s): %.*s\n", err3,
                    (int)canon.len, canon.ptr);
        }
        CHECK(rc3 == BD_PARSE_OK);
        snapshot(&snap_other, pt_other);
        CHECK(buf_eq(&snap_main, &snap_other));
        free(again);
    }

    free(line);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) {
        return 0;
    }
    enum bd_precision prec = (enum bd_precision)(data[0] & (N_PREC - 1));
    struct bd_parser *set = parsers[(data[0] >> 2) & 1];
    const char *s = (const char *)data + 1;
    size_t n = size - 1;

    check_batch(&batchers[(data[0] >> 2) & 1][prec], &set[prec], data[0], s, n, &pair);
    for (size_t pos = 0; pos < n;) {
        const char *nl = memchr(s + pos, '\n', n - pos);
        size_t eol = nl != NULL ? (size_t)(nl - s) : n;
        check_line(set, prec, s + pos, eol - pos);
        pos = eol + 1;
    }
    return 0;
}
