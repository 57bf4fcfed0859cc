/*
 * libFuzzer target for the line-protocol parser (src/parse*.c, BD_FORMAT_INFLUX) and for the JSON
 * printer of bucketd-parse (tools/bucketd-parse.c), which is compiled into this file.
 *
 * Input: the low two bits of the first byte pick the listener precision (ns, us, ms, s), and its
 * bit 2 a line limit of SMALL_MAX_LINE bytes instead of 64 KiB, so that the limit itself and a
 * scratch buffer filled to its size are reached too. The rest is a stream split on '\n' as the
 * daemon splits it; a line that ends inside a string value is also tried joined with the lines
 * after it, as bucketd-parse joins them. Each line is copied into a heap block of exactly its
 * length, so AddressSanitizer reports any read past its end.
 *
 * For every line: the result must not change when the same line is parsed again, nor when the
 * general parser alone reads it (without the fast path for plain lines), nor (timestamps aside)
 * under another precision. For every accepted point: the invariants in check_point(); the
 * series key must be the escaped name and sorted tags; the point written back as canonical line
 * protocol must parse to the same point; and the JSON that bucketd-parse prints for it must read
 * back to the same values. A broken invariant prints what failed and traps, which libFuzzer
 * reports as a crash with its input.
 *
 * Single-threaded, as libFuzzer calls it. The parsers, points and buffers are set up once in
 * LLVMFuzzerInitialize and live until the process exits.
 *
 * The whole input is also read as one batch (bd_parse_begin/bd_parse_next, the daemon's way),
 * with the classifier variant and window size bits 3-6 of the first byte pick: every line must
 * come back as its text, with what bd_parse_line gives for it alone (check_batch).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/parse_int.h"
#include "bucketd/parse.h"
#include "fuzz_common.h"

/*
 * bucketd-parse keeps its printer static, beside its main(). Compiling the tool's source in here,
 * its main renamed, lets every accepted point go through put_point() without changing the tool.
 */
#define main bucketd_parse_main
#include "../../tools/bucketd-parse.c"
#undef main

#define FUZZ_MAX_LINE (64 * 1024)
#define SMALL_MAX_LINE 256
#define N_PREC 4
#define N_LIMITS 2
/* Far above what one point of FUZZ_MAX_LINE bytes can print (at most 6 bytes per input byte). */
#define JSON_CAP (2 * 1024 * 1024)

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
static char *json_mem;
static FILE *json_out;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int l = 0; l < N_LIMITS; l++) {
        for (int i = 0; i < N_PREC; i++) {
            size_t max_line = l == 0 ? FUZZ_MAX_LINE : SMALL_MAX_LINE;
            if (bd_parser_init(&parsers[l][i], BD_FORMAT_INFLUX, (enum bd_precision)i, max_line) ||
                bd_parser_init(&batchers[l][i], BD_FORMAT_INFLUX, (enum bd_precision)i, max_line)) {
                abort();
            }
        }
    }
    pt_main = malloc(sizeof(*pt_main));
    pt_other = malloc(sizeof(*pt_other));
    pair = (struct fuzz_pair){pt_main, pt_other, &snap_main, &snap_other, snapshot};
    json_mem = malloc(JSON_CAP);
    json_out = json_mem != NULL ? fmemopen(json_mem, JSON_CAP, "w") : NULL;
    if (pt_main == NULL || pt_other == NULL || json_out == NULL) {
        abort();
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Point invariants                                                                         */

static bool has_ctl(struct bd_str s) {
    for (size_t i = 0; i < s.len; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        if (c < 0x20 || c == 0x7f) {
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

/* A measurement, tag key, tag value or field key: non-empty UTF-8 without control characters. */
static void check_name(struct bd_str s, const char *line, size_t n, const struct bd_parser *p) {
    check_view(s, line, n, p);
    CHECK(s.len >= 1);
    CHECK(!has_ctl(s));
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

static bool str_same(struct bd_str a, struct bd_str b) {
    return str_order(a, b) == 0;
}

static void check_point(const struct bd_point *pt, const char *line, size_t n,
                        const struct bd_parser *p) {
    CHECK(pt->n_tags <= BD_PARSE_MAX_TAGS);
    CHECK(pt->n_fields >= 1 && pt->n_fields <= BD_PARSE_MAX_FIELDS);
    check_name(pt->name, line, n, p);
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        check_name(pt->tags[i].key, line, n, p);
        check_name(pt->tags[i].value, line, n, p);
        /* Strictly increasing: sorted, and no key twice. */
        CHECK(i == 0 || str_order(pt->tags[i - 1].key, pt->tags[i].key) < 0);
    }
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        const struct bd_field *f = &pt->fields[i];
        check_name(f->key, line, n, p);
        for (uint32_t k = 0; k < i; k++) {
            CHECK(!str_same(pt->fields[k].key, f->key));
        }
        switch (f->kind) {
        case BD_VAL_FLOAT:
            CHECK(isfinite(f->v.f));
            break;
        case BD_VAL_INT:
        case BD_VAL_UINT:
        case BD_VAL_BOOL:
            break;
        case BD_VAL_STRING:
            /* Strings may be empty and hold control characters, but only as UTF-8. */
            check_view(f->v.s, line, n, p);
            CHECK(valid_utf8(f->v.s));
            break;
        default:
            CHECK(!"field kind out of range");
        }
    }
    if (pt->has_time) {
        CHECK(pt->time_ns % bd_parse_unit_ns(p->precision) == 0);
    }
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
        const struct bd_field *f = &pt->fields[i];
        snap_str(b, f->key);
        buf_putc(b, (char)f->kind);
        switch (f->kind) {
        case BD_VAL_FLOAT:
            /* The bits, so that -0.0 and 0.0 differ. */
            buf_put(b, &f->v.f, sizeof(f->v.f));
            break;
        case BD_VAL_INT:
            buf_put(b, &f->v.i, sizeof(f->v.i));
            break;
        case BD_VAL_UINT:
            buf_put(b, &f->v.u, sizeof(f->v.u));
            break;
        case BD_VAL_BOOL:
            buf_putc(b, f->v.b ? 1 : 0);
            break;
        case BD_VAL_STRING:
            snap_str(b, f->v.s);
            break;
        }
    }
    buf_putc(b, pt->has_time ? 1 : 0);
    if (pt->has_time) {
        buf_put(b, &pt->time_ns, sizeof(pt->time_ns));
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The point as canonical line protocol                                                     */

/* Measurements escape ' ' and ','; keys and tag values also '='. Backslashes stay as they are. */
static void put_escaped(struct buf *b, struct bd_str s, bool key) {
    for (size_t i = 0; i < s.len; i++) {
        char c = s.ptr[i];
        if (c == ' ' || c == ',' || (key && c == '=')) {
            buf_putc(b, '\\');
        }
        buf_putc(b, c);
    }
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

/*
 * Writes pt as the line the daemon's parser should read back as pt, and returns the length of
 * its series-key part (name and tags). Every escapable character is escaped and nothing else,
 * as parse_general.c says canonical text is.
 */
static size_t canonical_line(struct buf *b, const struct bd_point *pt, int64_t unit) {
    b->len = 0;
    put_escaped(b, pt->name, false);
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        buf_putc(b, ',');
        put_escaped(b, pt->tags[i].key, true);
        buf_putc(b, '=');
        put_escaped(b, pt->tags[i].value, true);
    }
    size_t key_len = b->len;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        const struct bd_field *f = &pt->fields[i];
        buf_putc(b, i == 0 ? ' ' : ',');
        put_escaped(b, f->key, true);
        buf_putc(b, '=');
        switch (f->kind) {
        case BD_VAL_FLOAT:
            put_double(b, f->v.f);
            break;
        case BD_VAL_INT:
            put_text(b, "%" PRId64 "i", f->v.i);
            break;
        case BD_VAL_UINT:
            put_text(b, "%" PRIu64 "u", f->v.u);
            break;
        case BD_VAL_BOOL:
            put_text(b, "%s", f->v.b ? "true" : "false");
            break;
        case BD_VAL_STRING:
            buf_putc(b, '"');
            for (size_t k = 0; k < f->v.s.len; k++) {
                char c = f->v.s.ptr[k];
                if (c == '"' || c == '\\') {
                    buf_putc(b, '\\');
                } else if (c == '\n') {
                    buf_putc(b, '\\');
                    c = 'n';
                }
                buf_putc(b, c);
            }
            buf_putc(b, '"');
            break;
        }
    }
    if (pt->has_time) {
        put_text(b, " %" PRId64, pt->time_ns / unit);
    }
    return key_len;
}

/* ---------------------------------------------------------------------------------------- */
/* bucketd-parse's JSON, read back against the point                                        */

struct jcur {
    const char *p;
    const char *end;
};

static void json_lit(struct jcur *c, const char *lit) {
    size_t n = strlen(lit);
    CHECK((size_t)(c->end - c->p) >= n && memcmp(c->p, lit, n) == 0);
    c->p += n;
}

static unsigned hex_digit(char h) {
    if (h >= '0' && h <= '9') {
        return (unsigned)(h - '0');
    }
    if (h >= 'a' && h <= 'f') {
        return (unsigned)(h - 'a' + 10);
    }
    if (h >= 'A' && h <= 'F') {
        return (unsigned)(h - 'A' + 10);
    }
    CHECK(!"bad hex digit in \\u escape");
    return 0;
}

/* Four hex digits of a \u escape. */
static uint32_t json_hex4(struct jcur *c) {
    CHECK(c->end - c->p >= 4);
    uint32_t v = 0;
    for (int d = 0; d < 4; d++) {
        v = v * 16 + hex_digit(*c->p++);
    }
    return v;
}

/* The UTF-8 bytes of code point v into out; returns how many (1 to 4). */
static size_t utf8_encode(uint32_t v, unsigned char *out) {
    if (v < 0x80) {
        out[0] = (unsigned char)v;
        return 1;
    }
    if (v < 0x800) {
        out[0] = (unsigned char)(0xc0 | (v >> 6));
        out[1] = (unsigned char)(0x80 | (v & 0x3f));
        return 2;
    }
    if (v < 0x10000) {
        out[0] = (unsigned char)(0xe0 | (v >> 12));
        out[1] = (unsigned char)(0x80 | ((v >> 6) & 0x3f));
        out[2] = (unsigned char)(0x80 | (v & 0x3f));
        return 3;
    }
    out[0] = (unsigned char)(0xf0 | (v >> 18));
    out[1] = (unsigned char)(0x80 | ((v >> 12) & 0x3f));
    out[2] = (unsigned char)(0x80 | ((v >> 6) & 0x3f));
    out[3] = (unsigned char)(0x80 | (v & 0x3f));
    return 4;
}

/* A JSON string that must decode to exactly want's bytes. */
static void json_string(struct jcur *c, struct bd_str want) {
    json_lit(c, "\"");
    size_t k = 0;
    for (;;) {
        CHECK(c->p < c->end);
        unsigned char ch = (unsigned char)*c->p++;
        if (ch == '"') {
            break;
        }
        /* JSON allows no raw control characters in a string. */
        CHECK(ch >= 0x20);
        if (ch == '\\') {
            CHECK(c->p < c->end);
            char e = *c->p++;
            switch (e) {
            case '"':
            case '\\':
            case '/':
                ch = (unsigned char)e;
                break;
            case 'b':
                ch = '\b';
                break;
            case 'f':
                ch = '\f';
                break;
            case 'n':
                ch = '\n';
                break;
            case 'r':
                ch = '\r';
                break;
            case 't':
                ch = '\t';
                break;
            case 'u': {
                /* ASCII controls, and the invisible characters (C1, bidi, formatting) that the
                 * printer escapes (bd_escape_json); other UTF-8 passes through. A character
                 * beyond the BMP comes as a surrogate pair. The decoded code point must be the
                 * UTF-8 bytes the input held there. */
                uint32_t v = json_hex4(c);
                if (v >= 0xd800 && v < 0xdc00) {
                    CHECK(c->end - c->p >= 6 && c->p[0] == '\\' && c->p[1] == 'u');
                    c->p += 2;
                    uint32_t lo = json_hex4(c);
                    CHECK(lo >= 0xdc00 && lo < 0xe000);
                    v = 0x10000 + ((v - 0xd800) << 10) + (lo - 0xdc00);
                } else {
                    CHECK(v < 0xdc00 || v >= 0xe000);
                }
                unsigned char u8[4];
                size_t n8 = utf8_encode(v, u8);
                for (size_t b = 0; b + 1 < n8; b++) {
                    CHECK(k < want.len && (unsigned char)want.ptr[k] == u8[b]);
                    k++;
                }
                ch = u8[n8 - 1];
                break;
            }
            default:
                CHECK(!"unknown escape in JSON string");
            }
        }
        CHECK(k < want.len && (unsigned char)want.ptr[k] == ch);
        k++;
    }
    CHECK(k == want.len);
}

static bool json_digit(const struct jcur *c) {
    return c->p < c->end && *c->p >= '0' && *c->p <= '9';
}

/*
 * A JSON number (RFC 8259 grammar), copied NUL-terminated into out; frac allows a fraction and
 * an exponent. Returns whether either was present.
 */
static bool json_number(struct jcur *c, bool frac, char *out, size_t cap) {
    const char *start = c->p;
    bool real = false;
    if (c->p < c->end && *c->p == '-') {
        c->p++;
    }
    CHECK(json_digit(c));
    if (*c->p++ != '0') {
        while (json_digit(c)) {
            c->p++;
        }
    }
    if (frac && c->p < c->end && *c->p == '.') {
        c->p++;
        CHECK(json_digit(c));
        while (json_digit(c)) {
            c->p++;
        }
        real = true;
    }
    if (frac && c->p < c->end && (*c->p == 'e' || *c->p == 'E')) {
        c->p++;
        if (c->p < c->end && (*c->p == '+' || *c->p == '-')) {
            c->p++;
        }
        CHECK(json_digit(c));
        while (json_digit(c)) {
            c->p++;
        }
        real = true;
    }
    size_t len = (size_t)(c->p - start);
    CHECK(len < cap);
    memcpy(out, start, len);
    out[len] = '\0';
    return real;
}

static void json_int(struct jcur *c, int64_t want) {
    char num[48];
    json_number(c, false, num, sizeof(num));
    errno = 0;
    long long v = strtoll(num, NULL, 10);
    CHECK(errno == 0 && v == want);
}

static void json_value(struct jcur *c, const struct bd_field *f) {
    char num[48];
    switch (f->kind) {
    case BD_VAL_FLOAT: {
        json_lit(c, "{\"float\":");
        /* A fraction or exponent always, so that JSON readers keep it a float. */
        CHECK(json_number(c, true, num, sizeof(num)));
        double v = strtod(num, NULL);
        CHECK(memcmp(&v, &f->v.f, sizeof(v)) == 0);
        break;
    }
    case BD_VAL_INT:
        json_lit(c, "{\"int\":");
        json_int(c, f->v.i);
        break;
    case BD_VAL_UINT:
        json_lit(c, "{\"uint\":");
        CHECK(c->p < c->end && *c->p != '-');
        json_number(c, false, num, sizeof(num));
        errno = 0;
        unsigned long long u = strtoull(num, NULL, 10);
        CHECK(errno == 0 && u == f->v.u);
        break;
    case BD_VAL_BOOL:
        json_lit(c, "{\"bool\":");
        json_lit(c, f->v.b ? "true" : "false");
        break;
    case BD_VAL_STRING:
        json_lit(c, "{\"string\":");
        json_string(c, f->v.s);
        break;
    }
    json_lit(c, "}");
}

/* Prints pt as bucketd-parse does and reads the output back, value by value. */
static void check_json(const struct bd_point *pt) {
    int64_t t = pt->has_time ? pt->time_ns : 0;
    FILE *saved = stdout;
    /* glibc's stdout is an ordinary variable; the printer writes to whatever it points at. */
    rewind(json_out);
    stdout = json_out;
    put_point(pt, t);
    fflush(stdout);
    stdout = saved;
    long len = ftell(json_out);
    CHECK(len > 0 && len < JSON_CAP);

    struct jcur c = {json_mem, json_mem + len};
    json_lit(&c, "{\"name\":");
    json_string(&c, pt->name);
    json_lit(&c, ",\"tags\":[");
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        json_lit(&c, i == 0 ? "{\"key\":" : ",{\"key\":");
        json_string(&c, pt->tags[i].key);
        json_lit(&c, ",\"value\":");
        json_string(&c, pt->tags[i].value);
        json_lit(&c, "}");
    }
    json_lit(&c, "],\"fields\":[");
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        json_lit(&c, i == 0 ? "{\"key\":" : ",{\"key\":");
        json_string(&c, pt->fields[i].key);
        json_lit(&c, ",\"value\":");
        json_value(&c, &pt->fields[i]);
        json_lit(&c, "}");
    }
    json_lit(&c, "],\"time\":");
    json_int(&c, t);
    json_lit(&c, "}\n");
    CHECK(c.p == c.end);
}

/* ---------------------------------------------------------------------------------------- */
/* Driver                                                                                   */

/* Nothing but spaces (and the '\r' of a "\r\n"), or a comment: the lines that may be skipped. */
static bool blank_or_comment(const char *s, size_t n, bool *blank) {
    if (n > 0 && s[n - 1] == '\r') {
        n--;
    }
    size_t i = 0;
    while (i < n && s[i] == ' ') {
        i++;
    }
    *blank = i == n;
    return i == n || s[i] == '#';
}

/*
 * Parses one line (or joined entry) every way described at the top, with the parsers of one line
 * limit (set, indexed by precision); returns the first result.
 */
static int check_entry(struct bd_parser *set, enum bd_precision prec, const char *data, size_t n,
                       const char **errmsg) {
    struct bd_parser *p = &set[prec];
    int64_t unit = bd_parse_unit_ns(prec);
    char *line = exact_copy(data, n);

    const char *err = NULL;
    int rc = bd_parse_line(p, line, n, pt_main, &err);
    CHECK(rc == BD_PARSE_OK || rc == BD_PARSE_SKIP ||
          (rc <= BD_PARSE_ESYNTAX && rc >= BD_PARSE_ETOO_LONG));
    CHECK(rc >= 0 || (err != NULL && err[0] != '\0'));
    /* Only blank lines and comments are skipped, and blank ones always (a comment may fail). */
    bool blank = false;
    bool skippable = blank_or_comment(line, n, &blank);
    CHECK(rc != BD_PARSE_SKIP || skippable);
    CHECK(!blank || n > p->max_line || rc == BD_PARSE_SKIP);
    size_t key_len = 0;
    if (rc == BD_PARSE_OK) {
        check_point(pt_main, line, n, p);
        snapshot(&snap_main, pt_main);
        check_json(pt_main);
        key_len = canonical_line(&canon, pt_main, unit);
        CHECK(pt_main->series_key.len == key_len &&
              memcmp(pt_main->series_key.ptr, canon.ptr, key_len) == 0);
    }

    /* Again, on the same parser: the same answer. */
    const char *err2 = NULL;
    int rc2 = bd_parse_line(p, line, n, pt_other, &err2);
    check_same(&pair, rc, err, rc2, err2);

    /* The general parser alone: the fast path for plain lines must not change any answer. */
    const char *errg = NULL;
    int rcg = bd_parse_line_general(p, line, n, pt_other, &errg);
    check_same(&pair, rc, err, rcg, errg);

    /*
     * At ns precision: up to the timestamp's range check nothing depends on the precision, and
     * every timestamp in range at a coarser unit is in range at ns. So unless the line failed
     * with ERANGE, the ns parser must agree, with the timestamp scaled by the unit; and a line
     * that is out of range here but fine at ns must have a timestamp that overflows once scaled.
     */
    if (prec != BD_PREC_NS) {
        const char *err3 = NULL;
        int rc3 = bd_parse_line(&set[BD_PREC_NS], line, n, pt_other, &err3);
        int64_t scaled = 0;
        bool overflow = rc3 == BD_PARSE_OK && pt_other->has_time &&
                        __builtin_mul_overflow(pt_other->time_ns, unit, &scaled);
        if (rc != BD_PARSE_ERANGE) {
            CHECK(rc3 == rc && (rc >= 0 || strcmp(err3, err) == 0));
            if (rc == BD_PARSE_OK) {
                CHECK(!overflow);
                pt_other->time_ns = scaled;
                snapshot(&snap_other, pt_other);
                CHECK(buf_eq(&snap_main, &snap_other));
            }
        } else {
            CHECK(rc3 != BD_PARSE_SKIP);
            CHECK(rc3 != BD_PARSE_OK || overflow);
        }
    }

    /* The canonical text of an accepted point reads back as the same point. */
    if (rc == BD_PARSE_OK && canon.len <= p->max_line) {
        char *again = exact_copy(canon.ptr, canon.len);
        const char *err4 = NULL;
        int rc4 = bd_parse_line(p, again, canon.len, pt_other, &err4);
        if (rc4 != BD_PARSE_OK) {
            fprintf(stderr, "fuzz_influx: canonical line rejected (%s): %.*s\n", err4,
                    (int)canon.len, canon.ptr);
        }
        CHECK(rc4 == BD_PARSE_OK);
        snapshot(&snap_other, pt_other);
        /* The series key's bytes are the same; only where they live differs. */
        CHECK(buf_eq(&snap_main, &snap_other));
        free(again);
    }

    free(line);
    *errmsg = err;
    return rc;
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
        const char *err = NULL;
        int rc = check_entry(set, prec, s + pos, eol - pos, &err);

        /*
         * bucketd-parse: a string still open at the end of the line goes on with the next. An
         * entry past the line limit fails with another message, which ends the loop.
         */
        size_t end = eol;
        while (rc < 0 && err == bd_parse_err_open_string && end < n) {
            nl = memchr(s + end + 1, '\n', n - end - 1);
            end = nl != NULL ? (size_t)(nl - s) : n;
            rc = check_entry(set, prec, s + pos, end - pos, &err);
        }
        pos = eol + 1;
    }
    return 0;
}
