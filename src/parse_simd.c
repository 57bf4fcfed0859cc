/*
 * The parser's classifiers and flatteners (src/parse_int.h: bd_parser_set_isa): the batch's
 * text, 64 bytes at a time, into the bitmaps the fast walk of src/parse.c reads (separators,
 * newlines, bytes that need the general parser; see "Plain lines" there), with AVX-512 or AVX2
 * when the CPU has it, else SSE2 or portable word arithmetic (SWAR); and the set bits of a
 * bitmap flattened into a list of positions. bd_parser_init picks the variants once, per
 * parser, through the function pointers of struct bd_parser.
 *
 * A leaf: it calls nothing of the parser's other files, keeps no state, and runs on the thread
 * of the parser that calls it (the ingest thread). BD_PARSE_PORTABLE builds the word
 * arithmetic alone (what aarch64 builds run), BD_PARSE_NO_AVX2 leaves AVX2 out.
 */
#include "parse_int.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/common.h"
#include "parse_common.h"

#ifdef PLAIN_SSE2
#include <emmintrin.h>
#endif

/* ---------------------------------------------------------------------------------------- */
/* Classifiers                                                                              */

#ifdef PLAIN_SSE2
/* 16 bytes: bit k of each result for byte k. */
static inline void class16(__m128i x, const char *ch, unsigned *sep, unsigned *nl, unsigned *odd) {
    __m128i n = _mm_cmpeq_epi8(x, _mm_set1_epi8('\n'));
    __m128i s = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(' ')),
                                          _mm_cmpeq_epi8(x, _mm_set1_epi8(ch[0]))),
                             _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('=')), n));
    /* x + 1 below 0x21 as a signed byte: a control character, DEL, or 0x80 and up. */
    __m128i bad = _mm_cmplt_epi8(_mm_add_epi8(x, _mm_set1_epi8(1)), _mm_set1_epi8(0x21));
    bad = _mm_or_si128(bad, _mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8(ch[1])),
                                         _mm_cmpeq_epi8(x, _mm_set1_epi8(ch[2]))));
    *sep = (unsigned)_mm_movemask_epi8(s);
    *nl = (unsigned)_mm_movemask_epi8(n);
    *odd = (unsigned)_mm_movemask_epi8(bad);
}

static void classify_sse2(const char *t, size_t n_words, const char *ch, uint64_t *sep,
                          uint64_t *nl, uint64_t *odd) {
    for (size_t w = 0; w < n_words; w++, t += 64) {
        uint64_t s = 0, n = 0, o = 0;
        for (unsigned k = 0; k < 64; k += 16) {
            unsigned a, b, c;
            class16(_mm_loadu_si128((const __m128i *)(const void *)(t + k)), ch, &a, &b, &c);
            s |= (uint64_t)a << k;
            n |= (uint64_t)b << k;
            o |= (uint64_t)c << k;
        }
        sep[w] = s;
        nl[w] = n;
        odd[w] = o;
    }
}

#if defined(__GNUC__) && !defined(BD_PARSE_NO_AVX2)
#include <immintrin.h>
#define PLAIN_AVX2 1

/* The same, 32 bytes per step, for CPUs that have AVX2 (chosen at bd_parser_init). */
__attribute__((target("avx2"))) static void classify_avx2(const char *t, size_t n_words,
                                                          const char *ch, uint64_t *sep,
                                                          uint64_t *nl, uint64_t *odd) {
    const __m256i sp = _mm256_set1_epi8(' '), cm = _mm256_set1_epi8(ch[0]),
                  eq = _mm256_set1_epi8('='), lf = _mm256_set1_epi8('\n'),
                  one = _mm256_set1_epi8(1), lim = _mm256_set1_epi8(0x21),
                  qu = _mm256_set1_epi8(ch[1]), bs = _mm256_set1_epi8(ch[2]);
    for (size_t w = 0; w < n_words; w++, t += 64) {
        uint64_t r[3] = {0, 0, 0};
        for (unsigned k = 0; k < 64; k += 32) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(t + k));
            __m256i n = _mm256_cmpeq_epi8(x, lf);
            __m256i s =
                _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(x, sp), _mm256_cmpeq_epi8(x, cm)),
                                _mm256_or_si256(_mm256_cmpeq_epi8(x, eq), n));
            /* Signed x + 1 below 0x21: control characters, DEL and every byte from 0x80. */
            __m256i bad = _mm256_cmpgt_epi8(lim, _mm256_add_epi8(x, one));
            bad = _mm256_or_si256(
                bad, _mm256_or_si256(_mm256_cmpeq_epi8(x, qu), _mm256_cmpeq_epi8(x, bs)));
            r[0] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(s) << k;
            r[1] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(n) << k;
            r[2] |= (uint64_t)(uint32_t)_mm256_movemask_epi8(bad) << k;
        }
        sep[w] = r[0];
        nl[w] = r[1];
        odd[w] = r[2];
    }
}
#endif

/* The same, a whole word per step, for CPUs with AVX-512BW: the compares give the bits. */
__attribute__((target("avx512f,avx512bw"))) static void
classify_avx512(const char *t, size_t n_words, const char *ch, uint64_t *sep, uint64_t *nl,
                uint64_t *odd) {
    const __m512i sp = _mm512_set1_epi8(' '), cm = _mm512_set1_epi8(ch[0]),
                  eq = _mm512_set1_epi8('='), lf = _mm512_set1_epi8('\n'),
                  one = _mm512_set1_epi8(1), lim = _mm512_set1_epi8(0x21),
                  qu = _mm512_set1_epi8(ch[1]), bs = _mm512_set1_epi8(ch[2]);
    for (size_t w = 0; w < n_words; w++, t += 64) {
        __m512i x = _mm512_loadu_si512((const void *)t);
        __mmask64 n = _mm512_cmpeq_epi8_mask(x, lf);
        sep[w] = n | _mm512_cmpeq_epi8_mask(x, sp) | _mm512_cmpeq_epi8_mask(x, cm) |
                 _mm512_cmpeq_epi8_mask(x, eq);
        nl[w] = n;
        odd[w] = _mm512_cmpgt_epi8_mask(lim, _mm512_add_epi8(x, one)) |
                 _mm512_cmpeq_epi8_mask(x, qu) | _mm512_cmpeq_epi8_mask(x, bs);
    }
}

/*
 * flatten() with AVX-512 VBMI2: each half word's positions are its lanes of 0..31 (plus the
 * half's offset) compressed by its bits, stored whole (32 positions; out has room past its
 * last bit for them) and then overwritten from the count on: no loop over the bits at all.
 */
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) static size_t
flatten_vbmi2(const uint64_t *m, size_t n_words, uint16_t *out) {
    const __m512i half = _mm512_set1_epi16(32);
    __m512i lo = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                  15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    size_t k = 0;
    for (size_t w = 0; w < n_words; w++) {
        uint64_t b = m[w];
        __m512i hi = _mm512_add_epi16(lo, half);
        _mm512_storeu_si512((void *)(out + k), _mm512_maskz_compress_epi16((__mmask32)b, lo));
        k += (unsigned)__builtin_popcount((uint32_t)b);
        _mm512_storeu_si512((void *)(out + k),
                            _mm512_maskz_compress_epi16((__mmask32)(b >> 32), hi));
        k += (unsigned)__builtin_popcount((uint32_t)(b >> 32));
        lo = _mm512_add_epi16(hi, half);
    }
    return k;
}
#define PLAIN_AVX512 1
#endif

/* The 0x80 bits of m's bytes as 8 bits, byte 0 lowest. */
static unsigned high_bits(uint64_t m) {
    return (unsigned)(((m >> 7) * UINT64_C(0x0102040810204080)) >> 56);
}

/* Portable word arithmetic, 8 bytes per step: for other CPUs (and BD_PARSE_PORTABLE). */
static void classify_swar(const char *t, size_t n_words, const char *ch, uint64_t *sep,
                          uint64_t *nl, uint64_t *odd) {
    for (size_t w = 0; w < n_words; w++, t += 64) {
        uint64_t s = 0, n = 0, o = 0;
        for (unsigned k = 0; k < 64; k += 8) {
            uint64_t x = load_le64(t + k);
            uint64_t lf = bytes_eq(x, '\n');
            /* Below 0x20 once the top bit is cleared, or the top bit set. */
            uint64_t low = ~((x & BYTES(0x7f)) + BYTES(0x60)) & BYTES(0x80);
            uint64_t bad = low | (x & BYTES(0x80)) | bytes_eq(x, 0x7f) |
                           bytes_eq(x, (unsigned char)ch[1]) | bytes_eq(x, (unsigned char)ch[2]);
            s |= (uint64_t)high_bits(bytes_eq(x, ' ') | bytes_eq(x, (unsigned char)ch[0]) |
                                     bytes_eq(x, '=') | lf)
                 << k;
            n |= (uint64_t)high_bits(lf) << k;
            o |= (uint64_t)high_bits(bad) << k;
        }
        sep[w] = s;
        nl[w] = n;
        odd[w] = o;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Flatteners                                                                               */

/*
 * The positions of the set bits of m[0, n_words), in order, into out (which has room for every bit
 * plus FLATTEN_SLACK). unroll (8 or 16) are written per word whether or not there are that many
 * (the extra ones are overwritten or ignored), so a word costs no branch per bit. ctz of a word
 * that ran out reads the top bit instead (63), not the undefined ctz(0).
 */
static inline __attribute__((always_inline)) size_t flatten_body(const uint64_t *m, size_t n_words,
                                                                 uint16_t *out, unsigned unroll) {
    size_t k = 0;
    for (size_t w = 0; w < n_words; w++) {
        uint64_t b = m[w];
        unsigned cnt = (unsigned)__builtin_popcountll(b);
        uint16_t base = (uint16_t)(w * 64);
        uint16_t *o = out + k;
        /* unroll (8 or 16) whatever the count: a branch on it would be mispredicted whenever
         * counts vary around it. Line protocol has 8 to 12 separators per 64 bytes, Graphite
         * about 5. */
        for (unsigned x = 0; x < unroll; x++) {
            o[x] = (uint16_t)(base + __builtin_ctzll(b | (UINT64_C(1) << 63)));
            b &= b - 1;
        }
        for (unsigned x = unroll; x < cnt; x++) {
            o[x] = (uint16_t)(base + __builtin_ctzll(b));
            b &= b - 1;
        }
        k += cnt;
    }
    return k;
}

static size_t flatten_plain(const uint64_t *m, size_t n_words, uint16_t *out) {
    return flatten_body(m, n_words, out, 16);
}

static size_t flatten_plain8(const uint64_t *m, size_t n_words, uint16_t *out) {
    return flatten_body(m, n_words, out, 8);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define FLATTEN_BMI 1
/* With POPCNT and BMI1 (blsr, tzcnt): the same in about half the instructions. */
__attribute__((target("popcnt,bmi,bmi2"))) static size_t
flatten_bmi(const uint64_t *m, size_t n_words, uint16_t *out) {
    return flatten_body(m, n_words, out, 16);
}

__attribute__((target("popcnt,bmi,bmi2"))) static size_t
flatten_bmi8(const uint64_t *m, size_t n_words, uint16_t *out) {
    return flatten_body(m, n_words, out, 8);
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* The choice, at bd_parser_init                                                            */

/*
 * Sets the classifier and flattener variant: "avx512" (AVX-512BW and VBMI2), "avx2", "sse2",
 * "swar" (portable word arithmetic) or "best" (the widest this CPU runs). -ENOTSUP if this
 * build or CPU lacks it.
 */
int bd_parser_set_isa(struct bd_parser *p, const char *isa) {
    bool best = strcmp(isa, "best") == 0;
    bool few = p->format == BD_FORMAT_GRAPHITE; /* few separators per word */
    p->flatten = few ? flatten_plain8 : flatten_plain;
    p->classify = classify_swar;
    p->isa = "swar";
#ifdef PLAIN_SSE2
#ifdef PLAIN_AVX512
    if ((best || strcmp(isa, "avx512") == 0) && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt")) {
        p->classify = classify_avx512;
        p->flatten = flatten_vbmi2;
        p->isa = "avx512";
        return 0;
    }
    if (strcmp(isa, "avx512") == 0) {
        return -ENOTSUP;
    }
#endif
#ifdef PLAIN_AVX2
    if ((best || strcmp(isa, "avx2") == 0) && __builtin_cpu_supports("avx2")) {
        p->classify = classify_avx2;
        p->isa = "avx2";
    } else if (strcmp(isa, "avx2") == 0) {
        return -ENOTSUP;
    } else
#endif
        if (best || strcmp(isa, "sse2") == 0) {
        p->classify = classify_sse2;
        p->isa = "sse2";
    }
#endif
    if (!best && strcmp(isa, p->isa) != 0) {
        return -ENOTSUP;
    }
#ifdef FLATTEN_BMI
    if (strcmp(p->isa, "swar") != 0 && __builtin_cpu_supports("popcnt") &&
        __builtin_cpu_supports("bmi")) {
        p->flatten = few ? flatten_bmi8 : flatten_bmi;
    }
#endif
    return 0;
}
