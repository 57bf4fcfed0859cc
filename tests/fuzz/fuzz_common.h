/*
 * Helpers shared by the parser fuzz targets (fuzz_influx.c, fuzz_graphite.c): the invariant
 * check that traps so libFuzzer reports the input, growable byte buffers for point snapshots
 * and canonical lines, and a strict UTF-8 validator written apart from src/parse.c on purpose.
 * Test code only; each target is one translation unit, so everything here is static.
 */
#ifndef BUCKETD_FUZZ_COMMON_H
#define BUCKETD_FUZZ_COMMON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Written apart from src/parse.c on purpose: strict UTF-8, no overlongs or surrogates. */
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

#endif
