/*
 * Helpers shared by the parser fuzz targets (fuzz_influx.c, fuzz_graphite.c): the invariant
 * check that traps so libFuzzer reports the input, growable byte buffers for point snapshots
 * and canonical lines, and a strict UTF-8 validator written apart from src/parse*.c on purpose.
 * Test code only; each target is one translation unit, so everything here is static.
 */
#ifndef BUCKETD_FUZZ_COMMON_H
#define BUCKETD_FUZZ_COMMON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/parse_int.h"
#include "bucketd/parse.h"

#define CHECK(e) ((e) ? (void)0 : check_failed(#e, __FILE__, __LINE__))

_Noreturn static void check_failed(const char *expr, const char *file, int line) {
    fprintf(stderr, "invariant failed: %s (%s:%d)\n", expr, file, line);
    __builtin_trap();
}

/* ---------------------------------------------------------------------------------------- */
/* Growable byte buffers (point snapshots, canonical lines)                                 */

struct buf {
    char *ptr;
    size_t len;
    size_t cap;
};

static void buf_put(struct buf *b, const void *src, size_t n) {
    if (n == 0) {
        return;
    }
    if (n > b->cap - b->len) {
        size_t cap = b->cap == 0 ? 4096 : b->cap;
        while (n > cap - b->len) {
            cap *= 2;
        }
        b->ptr = realloc(b->ptr, cap);
        if (b->ptr == NULL) {
            abort();
        }
        b->cap = cap;
    }
    memcpy(b->ptr + b->len, src, n);
    b->len += n;
}

static void buf_putc(struct buf *b, char c) {
    buf_put(b, &c, 1);
}

static bool buf_eq(const struct buf *a, const struct buf *b) {
    return a->len == b->len && (a->len == 0 || memcmp(a->ptr, b->ptr, a->len) == 0);
}

/* Written apart from src/parse*.c on purpose: strict UTF-8, no overlongs or surrogates. */
static bool valid_utf8(struct bd_str s) {
    const unsigned char *p = (const unsigned char *)s.ptr;
    size_t i = 0;
    while (i < s.len) {
        unsigned c = p[i];
        size_t more = 0;
        uint32_t cp = 0;
        uint32_t min = 0;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            more = 1;
            cp = c & 0x1f;
            min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            more = 2;
            cp = c & 0x0f;
            min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            more = 3;
            cp = c & 0x07;
            min = 0x10000;
        } else {
            return false;
        }
        if (s.len - i - 1 < more) {
            return false;
        }
        for (size_t k = 1; k <= more; k++) {
            if ((p[i + k] & 0xc0) != 0x80) {
                return false;
            }
            cp = (cp << 6) | (p[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            return false;
        }
        i += more + 1;
    }
    return true;
}

/* The line in a heap block of exactly n bytes: any read past it is an ASan report. */
static char *exact_copy(const char *s, size_t n) {
    char *copy = malloc(n);
    if (copy == NULL && n > 0) {
        abort();
    }
    if (n > 0) {
        memcpy(copy, s, n);
    }
    return copy;
}

/*
 * The point under test and a second parse to compare with it, compared by value through the
 * target's own snapshot function (a series key may live in either parser's scratch buffer).
 */
struct fuzz_pair {
    struct bd_point *main;
    struct bd_point *other;
    struct buf *snap_main; /* snapshot of main, taken by the caller when main was parsed */
    struct buf *snap_other;
    void (*snapshot)(struct buf *, const struct bd_point *);
};

/* The second parse (rc2, err2, into fp->other) gave the main one's answer: code, message and
 * point. */
static void check_same(const struct fuzz_pair *fp, int rc, const char *err, int rc2,
                       const char *err2) {
    CHECK(rc2 == rc && (rc >= 0 || err2 == err));
    if (rc == BD_PARSE_OK) {
        fp->snapshot(fp->snap_other, fp->other);
        CHECK(buf_eq(fp->snap_main, fp->snap_other));
    }
}

/*
 * The whole stream as one batch, with the classifier variant and window size that bits 3-6 of
 * the first byte pick: every line must come back as the text up to its '\n', with exactly what
 * bd_parse_line gives for that text alone.
 */
static void check_batch(struct bd_parser *b, struct bd_parser *single, uint8_t how,
                        const char *data, size_t n, const struct fuzz_pair *fp) {
    static const char *const isas[] = {"avx512", "avx2", "sse2", "swar"};
    static const size_t windows[] = {1, 2, 3, BD_PARSE_WINDOW_WORDS};
    if (bd_parser_set_isa(b, isas[(how >> 3) & 3]) != 0) {
        CHECK(bd_parser_set_isa(b, "best") == 0);
    }
    bd_parser_set_window(b, windows[(how >> 5) & 3]);
    char *text = exact_copy(data, n);
    bd_parse_begin(b, text, n);
    size_t pos = 0;
    for (;;) {
        struct bd_str line = {NULL, 0};
        const char *err = NULL;
        int rc = bd_parse_next(b, fp->main, &line, &err);
        if (rc == BD_PARSE_END) {
            break;
        }
        const char *nl = memchr(text + pos, '\n', n - pos);
        size_t want = nl != NULL ? (size_t)(nl - text) - pos : n - pos;
        CHECK(pos < n && line.ptr == text + pos && line.len == want);
        pos += want + 1;
        CHECK(bd_parse_offset(b) == pos);
        if (rc == BD_PARSE_OK) {
            fp->snapshot(fp->snap_main, fp->main);
        }
        char *alone = exact_copy(line.ptr, line.len);
        const char *err2 = NULL;
        int rc2 = line.len == 0 ? BD_PARSE_SKIP
                                : bd_parse_line(single, alone, line.len, fp->other, &err2);
        check_same(fp, rc, err, rc2, err2);
        free(alone);
    }
    CHECK(pos >= n);
    free(text);
}

#endif
