/*
 * What the parser's three files share (nothing here is linked: constants, small inline helpers):
 * src/parse.c (the public calls, the batch and its fast walk over plain lines), below it
 * src/parse_general.c (the general parser, which decides every other line and every error) and
 * src/parse_simd.c (the classifiers and flatteners behind the bitmaps). The number readers'
 * results, the scratch buffer, word-at-a-time byte arithmetic (SWAR) and the timestamp units
 * are used by the fast walk and the general parser alike; the classifiers use the word
 * arithmetic too.
 */
#ifndef BUCKETD_PARSE_COMMON_H
#define BUCKETD_PARSE_COMMON_H

#include <float.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/common.h"
#include "bucketd/parse.h"

/* The fast path uses SSE2 where the compiler has it (every x86-64) and portable word
 * arithmetic elsewhere; BD_PARSE_PORTABLE forces the latter, to test it on x86. Every file of
 * the parser is built with the same choice (tests/CMakeLists.txt: test_parse_portable). */
#if defined(__SSE2__) && !defined(BD_PARSE_PORTABLE)
#define PLAIN_SSE2 1
#endif

/* Positions flatten() may write past the last set bit (flatten_vbmi2 stores 32 at a time):
 * bd_parser_init leaves this much room after the window's. */
#define FLATTEN_SLACK 32

/* Internal result of the number readers: distinguishes a malformed token from a big one. */
enum num_rc { NUM_OK = 0, NUM_SYNTAX = -1, NUM_RANGE = -2 };

/* rc, with *errmsg (when asked for) pointing at msg, a static description. */
static inline int fail(const char **errmsg, int rc, const char *msg) {
    if (errmsg != NULL) {
        *errmsg = msg;
    }
    return rc;
}

/* The parser's scratch buffer as one line fills it (bd_parser_init sizes it). */
struct scratch {
    char *buf;
    size_t cap;
    size_t used;
};

/* Room for n more bytes; the sizing in bd_parser_init makes running out a bug, not input. */
static inline char *scratch_take(struct scratch *sc, size_t n) {
    BD_ASSERT(n <= sc->cap - sc->used);
    char *dst = sc->buf + sc->used;
    sc->used += n;
    return dst;
}

/* Eight bytes as a little-endian word, whatever the host's byte order. */
static inline uint64_t load_le64(const char *s) {
    uint64_t w;
    memcpy(&w, s, sizeof(w));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

#define BYTES(c) (UINT64_C(0x0101010101010101) * (c))

/* 0x80 in every byte of w equal to c, 0 elsewhere (exact: no carry crosses bytes). */
static inline uint64_t bytes_eq(uint64_t w, unsigned char c) {
    uint64_t x = w ^ BYTES(c);
    return ~(((x & BYTES(0x7f)) + BYTES(0x7f)) | x) & BYTES(0x80);
}

/*
 * Eight ASCII digits at once (SWAR), w holding them as load_le64() does: false unless all
 * eight are digits. A timestamp's 19 digits take three of these instead of 19 loop turns.
 */
static inline bool digits8(uint64_t w, uint32_t *out) {
    uint64_t x = w - BYTES('0');
    /* Every byte is 0..9 exactly when neither it nor it plus 6 reaches 16; a byte below '0'
     * wraps (borrowing from the byte above, which is then judged too) and fails the same way. */
    if (((x | (x + BYTES(6))) & BYTES(0xf0)) != 0) {
        return false;
    }
    /* Pairs, then quads, then all eight: the first byte is the most significant digit. */
    x = (x * 10 + (x >> 8)) & UINT64_C(0x00ff00ff00ff00ff);
    x = (x * 100 + (x >> 16)) & UINT64_C(0x0000ffff0000ffff);
    *out = (uint32_t)(x * 10000 + (x >> 32));
    return true;
}

/* The first k (1..8) characters of w moved to its end behind leading '0's, for digits8(). */
static inline uint64_t align_digits(uint64_t w, size_t k) {
    return k == 8 ? w : (w << (8 * (8 - k))) | (BYTES('0') >> (8 * k));
}

#if FLT_EVAL_METHOD == 0
/* The powers of ten that are exact doubles, and the integers that are (Clinger's fast path). */
static const double pow10_exact[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
#define MANT_EXACT (UINT64_C(1) << 53)
#endif

/* Nanoseconds per unit of a timestamp precision. */
static const int64_t ns_per_unit[] = {
    [BD_PREC_NS] = 1,
    [BD_PREC_US] = 1000,
    [BD_PREC_MS] = 1000000,
    [BD_PREC_S] = 1000000000,
};

/* The timestamps that still fit in int64 nanoseconds, as constants: a division per line costs
 * more than the rest of the timestamp. */
static const int64_t max_in_unit[] = {
    [BD_PREC_NS] = INT64_MAX,
    [BD_PREC_US] = INT64_MAX / 1000,
    [BD_PREC_MS] = INT64_MAX / 1000000,
    [BD_PREC_S] = INT64_MAX / 1000000000,
};
static const int64_t min_in_unit[] = {
    [BD_PREC_NS] = INT64_MIN,
    [BD_PREC_US] = INT64_MIN / 1000,
    [BD_PREC_MS] = INT64_MIN / 1000000,
    [BD_PREC_S] = INT64_MIN / 1000000000,
};

#endif
