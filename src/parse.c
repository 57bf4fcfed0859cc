/*
 * Line parsers: InfluxDB line protocol and Graphite plaintext (include/bucketd/parse.h).
 *
 * Runs on the ingest thread, once per received line; each listener owns its struct bd_parser,
 * so nothing here is shared between threads. The hot path never allocates and makes no system
 * call: views point into the caller's line, and only text that has to differ from the input is
 * written into the parser's scratch buffer (names and strings that carried escapes, a series
 * key whose tags arrived unsorted, the rare float that needs strtod). bd_parser_init sizes that
 * buffer once from max_line; each call starts writing it from the beginning again. A batch
 * (bd_parse_begin: a datagram, or the complete lines of a TCP read) is classified 64 bytes at a
 * time into bitmaps (separators, newlines, bytes that need the general parser), with AVX-512 or
 * AVX2 when the CPU has it, else SSE2 or word arithmetic; lines are then found from the newline
 * bits, and plain influx lines (ASCII, no escapes or strings: nearly all of them) are walked
 * separator by separator from the flattened bitmap. The general parser decides every other line and
 * every error (see "Plain lines" below). bd_parse_line is a batch of one line.
 *
 * The parser is three files, each calling only down: this one (the public calls, the batch,
 * the fast walk over plain lines), src/parse_general.c below it (the general parser, which
 * also holds the rules of both formats) and src/parse_simd.c, a leaf (the classifiers and
 * flatteners, chosen once in bd_parser_init). src/parse_common.h holds what they share.
 * The rules of each format (the conformance corpus' corners, Graphite as carbon takes it) are
 * written down at the top of src/parse_general.c.
 */
#include "bucketd/parse.h"
#include "parse_int.h"

#include <errno.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"
#include "parse_common.h"
#include "parse_general.h"

#ifdef PLAIN_SSE2
#include <emmintrin.h>
#endif

/* Scratch room past two line lengths (see bd_parser_init): the NUL after a float for strtod. */
#define SCRATCH_SLACK 64

/* ---------------------------------------------------------------------------------------- */
/* Plain lines: the fast path                                                               */

/*
 * Nearly every line is plain: ASCII without control characters, backslashes or double quotes,
 * so it has no escapes, no string values and nothing to check as UTF-8. In such a line the
 * separators alone give the structure. The text is classified 64 bytes at a time into three
 * bitmaps (one bit per byte): sep for ' ', ',', '=' and '\n', nl for '\n', odd for every byte
 * that keeps a line from being plain. A line's end is then the next nl bit, its plainness one
 * test of its odd bits, and its tokens the runs between sep bits, walked with
 * count-trailing-zeros instead of classifying byte after byte. Anything else goes to the
 * general parser (src/parse_general.c), and so does every plain line the fast walk does not
 * accept: the
 * general parser alone decides errors and their messages, so the fast path only has to be
 * right about the lines it accepts (the fuzzers compare the two on every input).
 *
 * The bitmaps cover a window of the batch's text starting at p->base. The word past the text
 * carries an end mark in sep and nl (bit len - base), so the last line ends like the others,
 * and a walk never runs off the bitmaps: every line's end is a sep bit.
 */
#define MASK_WORDS (BD_PARSE_WINDOW_WORDS + 3) /* the end mark's word, and two zero ones */
#define MASK_SEP(p) ((p)->masks)
#define MASK_NL(p) ((p)->masks + MASK_WORDS)
#define MASK_ODD(p) ((p)->masks + 2 * MASK_WORDS)

/* Internal result of the fast walk: the general parser must decide this line. */
#define PLAIN_MISS 3

/*
 * Classifies buf[base, ...) for as much as the window holds, and puts the end mark at the
 * buffer's end if the window reaches it. The last partial block goes through a copy padded
 * with a letter, so nothing past the text is read.
 */
static void window_fill(struct bd_parser *p, size_t base) {
    size_t avail = p->len - base;
    size_t bytes = BD_MIN(avail, p->window_words * 64);
    size_t full = bytes / 64;
    uint64_t *sep = MASK_SEP(p), *nl = MASK_NL(p), *odd = MASK_ODD(p);
    p->base = base;
    p->classify(p->buf + base, full, p->chars, sep, nl, odd);
    size_t words = full;
    if (bytes % 64 != 0) {
        char pad[64];
        memset(pad, 'a', sizeof(pad));
        memcpy(pad, p->buf + base + full * 64, bytes % 64);
        p->classify(pad, 1, p->chars, sep + full, nl + full, odd + full);
        words++;
    }
    if (bytes == avail) {
        /* The end mark (bytes may be a multiple of 64: then it opens a word of its own). */
        if (bytes / 64 == words) {
            sep[words] = nl[words] = odd[words] = 0;
            words++;
        }
        sep[bytes / 64] |= UINT64_C(1) << (bytes % 64);
        nl[bytes / 64] |= UINT64_C(1) << (bytes % 64);
    }
    p->n_words = words;
    nl[words] = odd[words] = nl[words + 1] = odd[words + 1] = 0;
    p->n_seps = p->flatten(sep, words, p->sep_pos);
    p->sep_next = 0;
}

/* The first bit of m at or after bit r, as a bit index, or SIZE_MAX if none before word n. */
static inline size_t bit_next(const uint64_t *m, size_t n, size_t r) {
    size_t w = r / 64;
    uint64_t bits = m[w] & (~UINT64_C(0) << (r % 64));
    while (bits == 0) {
        if (++w >= n) {
            return SIZE_MAX;
        }
        bits = m[w];
    }
    return w * 64 + (size_t)__builtin_ctzll(bits);
}

/* Whether any bit of m in [r0, r1) is set. */
static inline bool bits_any(const uint64_t *m, size_t r0, size_t r1) {
    size_t w0 = r0 / 64, w1 = r1 / 64;
    uint64_t lo = ~UINT64_C(0) << (r0 % 64);
    uint64_t hi = (UINT64_C(1) << (r1 % 64)) - 1;
    if (w0 == w1) {
        return (m[w0] & lo & hi) != 0;
    }
    uint64_t any = (m[w0] & lo) | (m[w1] & hi);
    for (size_t w = w0 + 1; w < w1; w++) {
        any |= m[w];
    }
    return any != 0;
}

/*
 * A field value of the shape sensors send: [-] digits with at most one '.', at most 8 of them
 * (the '.' counted), and an 'i' or 'u' suffix for integers (then no '.'); for Graphite also
 * [+], and never a suffix. Read without a branch
 * on the shape, which varies from field to field and would be mispredicted: the 8 bytes after
 * the sign are loaded at once (room, the bytes readable from v, must allow it), the '.' is
 * squeezed out of the word, the digits moved to its end behind '0's and converted eight at a
 * time; the float is one division by an exact power of ten, which rounds correctly (Clinger's
 * fast path, as read_f64_short in parse_general.c). False for any other shape, which
 * parse_general_scalar() decides.
 */
static inline bool plain_number(const char *v, size_t len, size_t room, bool graphite,
                                struct bd_field *f) {
    bool neg = v[0] == '-';
    bool sign = neg | (graphite & (v[0] == '+')); /* Graphite takes "+1", line protocol not */
    unsigned char last = (unsigned char)v[len - 1];
    bool is_i = !graphite & (last == 'i');
    bool is_u = !graphite & (last == 'u');
    bool sfx = is_i | is_u;
    size_t k = len - sign - sfx;
    if (k - 1 >= 8 || room - sign < 8) {
        return false;
    }
    uint64_t w = load_le64(v + sign);
    uint64_t dots = bytes_eq(w, '.') & (~UINT64_C(0) >> (64 - 8 * k));
    bool has_dot = dots != 0;
    /* Arithmetic, not branches: whether there is a '.' is as random as the field order. */
    size_t at = (size_t)__builtin_ctzll(dots | (UINT64_C(1) << 63)) / 8;
    uint64_t below = ((UINT64_C(1) << (8 * at)) - 1) | ((uint64_t)has_dot - 1);
    w = (w & below) | ((w >> 8) & ~below);
    k -= has_dot;
    bool ok = k != 0;
    k += !ok; /* "." alone: fails, but keeps the shifts below defined */
    size_t decimals = (k - at) & (0 - (size_t)has_dot);
    /* k digits (1 to 8) to the end of the word, '0's before them. */
    uint64_t aligned = (w << (8 * (8 - k))) | ((BYTES('0') >> (8 * k - 1)) >> 1);
    uint32_t d = 0;
    ok &= digits8(aligned, &d) & !(sfx & has_dot) & !(neg & is_u);
#if FLT_EVAL_METHOD == 0
    double x = (double)d / pow10_exact[decimals];
    x = neg ? -x : x;
    uint64_t xbits;
    memcpy(&xbits, &x, sizeof(xbits));
#else
    ok &= sfx;
    uint64_t xbits = 0;
#endif
    uint64_t ibits = neg ? ~(uint64_t)d + 1 : (uint64_t)d;
    f->kind = is_u ? BD_VAL_UINT : is_i ? BD_VAL_INT : BD_VAL_FLOAT;
    f->v.u = sfx ? ibits : xbits;
    return ok;
}

#ifdef PLAIN_SSE2
/*
 * Sixteen ASCII digits at once (SSE2): pairs by a 16-bit multiply-add, then quads and octets by
 * pmaddwd, each step halving the number of lanes. False unless all sixteen are digits.
 */
static inline bool digits16(__m128i text, uint64_t *out) {
    __m128i x = _mm_sub_epi8(text, _mm_set1_epi8('0'));
    /* A byte above 9 (unsigned: what was below '0' wrapped around) leaves a rest. */
    __m128i over = _mm_subs_epu8(x, _mm_set1_epi8(9));
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(over, _mm_setzero_si128())) != 0xffff) {
        return false;
    }
    /* The first byte is the most significant digit: each 16-bit lane holds (high, low). */
    __m128i pairs =
        _mm_add_epi16(_mm_mullo_epi16(_mm_and_si128(x, _mm_set1_epi16(0xff)), _mm_set1_epi16(10)),
                      _mm_srli_epi16(x, 8));
    __m128i quads = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00010064)); /* *100 + 1 */
    quads = _mm_packs_epi32(quads, quads); /* at most 9999: no saturation */
    __m128i octs = _mm_madd_epi16(quads, _mm_set1_epi32(0x00012710)); /* *10000 + 1 */
    uint64_t hi = (uint32_t)_mm_cvtsi128_si32(octs);
    uint64_t lo = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(octs, 4));
    *out = hi * 100000000 + lo;
    return true;
}
#endif

/*
 * A timestamp of 1 to 19 digits, no sign: sixteen at a time with SSE2, else eight (room, the
 * bytes readable from s, must hold 8 for a shorter one; before, those readable before s, 16 - n
 * for the SSE2 read of 9 to 15 digits). False for anything else.
 */
static inline bool plain_digits(const char *s, size_t n, size_t room, size_t before,
                                uint64_t *out) {
    uint32_t d8 = 0;
    if (n - 1 >= 19 || room < 8) {
        return false;
    }
#ifdef PLAIN_SSE2
    if (n > 8 && n < 16 && before >= 16 - n) {
        /* Seconds (10 digits), milliseconds (13): the sixteen bytes that end with the digits,
         * those before them turned into '0's. */
        static const uint8_t keep[32] = {0,    0,    0,    0,    0,    0,    0,    0,
                                         0,    0,    0,    0,    0,    0,    0,    0,
                                         0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                         0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
        __m128i m = _mm_loadu_si128((const __m128i *)(const void *)(keep + n));
        __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(s + n - 16));
        x = _mm_or_si128(_mm_and_si128(m, x), _mm_andnot_si128(m, _mm_set1_epi8('0')));
        return digits16(x, out);
    }
    if (n >= 16) {
        /* The leading 0 to 3 digits, then the last sixteen. */
        size_t head = n - 16;
        uint64_t low = 0;
        bool ok = digits16(_mm_loadu_si128((const __m128i *)(const void *)(s + head)), &low);
        if (head != 0) {
            ok &= digits8(align_digits(load_le64(s), head), &d8);
        }
        *out = (uint64_t)d8 * UINT64_C(10000000000000000) + low;
        return ok;
    }
#endif
    if (n <= 8) {
        bool ok = digits8(align_digits(load_le64(s), n), &d8);
        *out = d8;
        return ok;
    }
    size_t i = n % 8;
    uint64_t v = 0;
    bool ok = true;
    if (i != 0) {
        ok = digits8(align_digits(load_le64(s), i), &d8);
        v = d8;
    }
    for (; i < n; i += 8) {
        ok &= digits8(load_le64(s + i), &d8);
        v = v * 100000000 + d8;
    }
    *out = v;
    return ok;
}

/*
 * n bytes from src to o, n at most 16: one 16-byte copy when 16 bytes are readable from src
 * (below end), else a memcpy. The copy may write up to 15 bytes past o + n: the caller has
 * that room.
 */
static inline char *copy_upto16(char *o, const char *src, size_t n, const char *end) {
    if (n <= 16 && (size_t)(end - src) >= 16) {
        memcpy(o, src, 16);
    } else {
        memcpy(o, src, n);
    }
    return o + n;
}

/*
 * The series key of a plain line whose tags were put in order (finish_tags), as
 * parse_general_series_key builds it, at the start of scratch: the measurement, then each
 * tag's raw text after sep, mostly by 16-byte copies. The key is at most the line, at most
 * max_line bytes, and scratch holds 2 * max_line + SCRATCH_SLACK: the copies' overrun fits.
 */
static inline struct bd_str plain_series_key(const struct bd_parser *p, const char *name,
                                             size_t name_len, const struct raw_span *raw,
                                             uint32_t n, char sep) {
    const char *end = p->buf + p->len;
    char *dst = p->scratch;
    char *o = copy_upto16(dst, name, name_len, end);
    for (uint32_t i = 0; i < n; i++) {
        *o++ = sep;
        o = copy_upto16(o, raw[i].ptr, raw[i].len, end);
    }
    return (struct bd_str){dst, (size_t)(o - dst)};
}

/*
 * The end of a fast walk: the series key. Tags in order (first bytes rising, or found sorted
 * here) make it the line's own prefix of key_len bytes; otherwise they are sorted (a repeated
 * key leaves the line to the general parser) and the key is built in scratch with sep.
 */
static inline __attribute__((always_inline)) int finish_tags(struct bd_parser *p,
                                                             struct bd_point *pt, const char *line,
                                                             bool in_order, char sep,
                                                             size_t key_len) {
    uint32_t nt = pt->n_tags;
    if (__builtin_expect(!in_order, 0)) {
        struct raw_span raw[BD_PARSE_MAX_TAGS];
        bool sorted = true;
        for (uint32_t k = 0; k < nt; k++) {
            raw[k] = (struct raw_span){
                pt->tags[k].key.ptr,
                (size_t)(pt->tags[k].value.ptr + pt->tags[k].value.len - pt->tags[k].key.ptr)};
            sorted &= k == 0 || str_cmp(pt->tags[k - 1].key, pt->tags[k].key) < 0;
        }
        if (!sorted) {
            if (nt == 2) {
                /* Two tags the wrong way round, the usual unsorted line: swapped, unless they
                 * are one key twice, which the general parser refuses. */
                if (str_eq(pt->tags[0].key, pt->tags[1].key)) {
                    return PLAIN_MISS;
                }
                struct bd_tag t = pt->tags[0];
                pt->tags[0] = pt->tags[1];
                pt->tags[1] = t;
                struct raw_span r = raw[0];
                raw[0] = raw[1];
                raw[1] = r;
            } else if (parse_general_sort_tags(pt, raw, false, NULL) < 0) {
                return PLAIN_MISS;
            }
            pt->series_key = plain_series_key(p, line, pt->name.len, raw, nt, sep);
            return BD_PARSE_OK;
        }
    }
    pt->series_key = (struct bd_str){line, key_len};
    return BD_PARSE_OK;
}

/*
 * The head of a plain line s[a, e), the same in both formats: the name runs to the first
 * separator that is not '='; each tag follows tag_sep as key '=' value, the key never empty.
 * Line protocol's tag values end at the next separator and are never empty; Graphite's may
 * hold '=' and must not start with '~'. A space must follow. Fills pt->name and pt->tags and
 * says in *in_order whether the keys' first bytes rose (see finish_tags). Takes separators
 * from P at *j. Returns the space after the head, where the series key ends, or e when the
 * general parser must decide.
 */
static inline __attribute__((always_inline)) size_t walk_head(const char *s, size_t a, size_t e,
                                                              const uint16_t *P, size_t *j,
                                                              bool graphite, struct bd_point *pt,
                                                              bool *in_order) {
    const char tag_sep = graphite ? ';' : ',';
    size_t i = P[(*j)++];
    while (i != e && s[i] == '=') {
        i = P[(*j)++];
    }
    if (i == a || i == e) {
        return e;
    }
    pt->name = (struct bd_str){s + a, i - a};
    uint32_t nt = 0;
    bool rising = true;
    unsigned char prev = 0; /* the last tag key's first byte; never 0 in a plain line */
    while (s[i] == tag_sep) {
        size_t ke = P[(*j)++];
        if (ke == e || s[ke] != '=' || ke == i + 1 || nt == BD_PARSE_MAX_TAGS) {
            return e;
        }
        size_t ve = P[(*j)++];
        while (graphite && ve != e && s[ve] == '=') {
            ve = P[(*j)++];
        }
        if (ve == ke + 1 || ve == e || (graphite ? s[ke + 1] == '~' : s[ve] == '=')) {
            return e;
        }
        struct bd_tag *t = &pt->tags[nt];
        t->key = (struct bd_str){s + i + 1, ke - i - 1};
        t->value = (struct bd_str){s + ke + 1, ve - ke - 1};
        unsigned char first = (unsigned char)s[i + 1];
        rising &= prev < first;
        prev = first;
        nt++;
        i = ve;
    }
    pt->n_tags = nt;
    *in_order = rising;
    return s[i] == ' ' ? i : e;
}

/*
 * After a plain line's last value, at the space i before its end e: true if the timestamp runs
 * from i + 1 to the end (the next separator, taken from P at *j, is e) and is not empty.
 */
static inline bool time_follows(const uint16_t *P, size_t *j, size_t i, size_t e) {
    return P[(*j)++] == e && i + 1 != e;
}

/*
 * The timestamp of a plain line, s[t, e): digits only, at most max units of unit_ns each, read
 * fast. False for anything else, which the format's own reader decides.
 */
static inline bool plain_time(const struct bd_parser *p, const char *s, size_t t, size_t e,
                              uint64_t max, int64_t unit_ns, struct bd_point *pt) {
    uint64_t v = 0;
    if (!plain_digits(s + t, e - t, p->len - p->base - t, p->base + t, &v) || v > max) {
        return false;
    }
    pt->has_time = true;
    pt->time_ns = (int64_t)v * unit_ns;
    return true;
}

/*
 * The general parser's grammar for a plain line s[a, e) of the window (positions relative to
 * the window) that starts with its measurement: single spaces between the sections and none
 * at the end (anything else is legal but rare, and left to the general parser). BD_PARSE_OK,
 * or PLAIN_MISS wherever the general parser must decide. The separators come in order from
 * p->sep_pos at p->sep_next, so each token ends at the next one: a measurement may hold '=',
 * nothing else may hold a separator of the wrong kind. e, the line's end, is a separator too
 * (its '\n' or the end mark): every position is compared with it before the next is taken,
 * so none past it is used, and s[e] is never read.
 */
static inline __attribute__((always_inline)) int
walk_influx(struct bd_parser *p, const char *s, size_t a, size_t e, struct bd_point *pt) {
    const uint16_t *P = p->sep_pos;
    size_t j = p->sep_next;
    bool in_order = true;
    size_t i = walk_head(s, a, e, P, &j, false, pt, &in_order);
    if (i == e) {
        goto miss;
    }
    size_t head_end = i;

    /* Fields: i is the separator before each key. */
    pt->n_fields = 0;
    uint64_t seen = 0;
    size_t room_end = p->len - p->base;
    for (;;) {
        size_t ke = P[j++];
        if (ke == e || s[ke] != '=' || ke == i + 1) {
            goto miss;
        }
        size_t ve = P[j++];
        if (ve == ke + 1 || (ve != e && s[ve] == '=')) {
            goto miss;
        }
        struct bd_field *slot = field_slot(pt, (struct bd_str){s + i + 1, ke - i - 1}, &seen);
        const char *v = s + ke + 1;
        size_t len = ve - ke - 1;
        if (slot == NULL) {
            goto miss;
        }
        if (!plain_number(v, len, room_end - ke - 1, false, slot)) {
            struct scratch sc = {p->scratch, p->scratch_cap, 0};
            if (parse_general_scalar(&sc, v, len, slot, NULL) != 0) {
                goto miss;
            }
        }
        i = ve;
        if (i == e || s[i] != ',') {
            break;
        }
    }

    pt->has_time = false;
    if (i != e) {
        if (!time_follows(P, &j, i, e)) {
            goto miss;
        }
        if (!plain_time(p, s, i + 1, e, (uint64_t)max_in_unit[p->precision],
                        ns_per_unit[p->precision], pt) &&
            parse_general_influx_time(p, s + i + 1, e - i - 1, pt, NULL) != 0) {
            goto miss;
        }
    }
    p->sep_next = j;
    return finish_tags(p, pt, s + a, in_order, ',', head_end - a);

miss:
    p->sep_next = j;
    return PLAIN_MISS;
}

/*
 * The fast walk for a plain Graphite line s[a, e): "path[;key=value...] value [timestamp]" with
 * single spaces, no tab, no control or non-ASCII byte and no '!' or '^' (those are odd bytes
 * for this format, so a tag key holding one never gets here). The separators are ' ', ';', '='
 * and the line end; a path and a tag value may hold '=', nothing else may hold a separator.
 * BD_PARSE_OK, or PLAIN_MISS wherever the general parser must decide.
 */
static inline __attribute__((always_inline)) int
walk_graphite(struct bd_parser *p, const char *s, size_t a, size_t e, struct bd_point *pt) {
    const uint16_t *P = p->sep_pos;
    size_t j = p->sep_next;
    bool in_order = true;
    size_t i = walk_head(s, a, e, P, &j, true, pt, &in_order);
    if (i == e) {
        goto miss;
    }
    size_t path_end = i; /* s[i] is the space before the value */

    size_t ve = P[j++];
    if (ve == i + 1 || (ve != e && s[ve] != ' ')) {
        goto miss;
    }
    pt->n_fields = 1;
    struct bd_field *f = &pt->fields[0];
    f->key = (struct bd_str){parse_general_graphite_key, sizeof(parse_general_graphite_key) - 1};
    const char *v = s + i + 1;
    size_t room_end = p->len - p->base;
    if (!plain_number(v, ve - i - 1, room_end - i - 1, true, f)) {
        if (parse_general_f64(v, ve - i - 1, true, p->scratch, &f->v.f) != NUM_OK) {
            goto miss;
        }
        f->kind = BD_VAL_FLOAT;
    }

    pt->has_time = false;
    if (ve != e) {
        if (!time_follows(P, &j, ve, e)) {
            goto miss;
        }
        if (!plain_time(p, s, ve + 1, e, (uint64_t)(INT64_MAX / BD_NS_PER_S), BD_NS_PER_S, pt) &&
            parse_general_graphite_time(s + ve + 1, e - ve - 1, &pt->has_time, &pt->time_ns) !=
                NUM_OK) {
            goto miss;
        }
    }
    p->sep_next = j;
    return finish_tags(p, pt, s + a, in_order, ';', path_end - a);

miss:
    p->sep_next = j;
    return PLAIN_MISS;
}

/* ---------------------------------------------------------------------------------------- */
/* Public                                                                                   */

void bd_parser_set_window(struct bd_parser *p, size_t words) {
    BD_ASSERT(words >= 1 && words <= BD_PARSE_WINDOW_WORDS);
    p->window_words = words;
}

int bd_parser_init(struct bd_parser *p, enum bd_format format, enum bd_precision precision,
                   size_t max_line) {
    memset(p, 0, sizeof(*p));
    if ((format != BD_FORMAT_INFLUX && format != BD_FORMAT_GRAPHITE) ||
        (size_t)precision >= BD_ARRAY_LEN(ns_per_unit) || max_line == 0 ||
        max_line > (SIZE_MAX - SCRATCH_SLACK) / 2) {
        return -EINVAL;
    }
    /*
     * What one line can put in the scratch buffer at once: its unescaped names and strings
     * (never longer than the text they came from), plus either the series key (at most the
     * measurement and tag text) or a float's copy for strtod (at most the line, plus a NUL).
     */
    p->scratch_cap = 2 * max_line + SCRATCH_SLACK;
    p->scratch = malloc(p->scratch_cap);
    p->masks = malloc(3 * MASK_WORDS * sizeof(uint64_t));
    /* Every bit of the window and its end mark, and those flatten() may write past them. */
    p->sep_pos = malloc((BD_PARSE_WINDOW + 64 + FLATTEN_SLACK) * sizeof(uint16_t));
    if (p->scratch == NULL || p->masks == NULL || p->sep_pos == NULL) {
        bd_parser_close(p);
        return -ENOMEM;
    }
    p->format = format;
    p->precision = precision;
    p->max_line = max_line;
    p->window_words = BD_PARSE_WINDOW_WORDS;
    /* The tag separator, and the bytes besides control and non-ASCII ones that need the
     * general parser: line protocol's escapes and strings; Graphite's tag keys may not hold
     * '!' or '^', which the general parser checks. */
    memcpy(p->chars, format == BD_FORMAT_INFLUX ? ",\"\\" : ";!^", sizeof(p->chars));
    /* BD_PARSE_ISA (avx512, avx2, sse2, swar) pins the variant, to compare them in a benchmark. */
    const char *isa = getenv("BD_PARSE_ISA");
    if (isa == NULL || bd_parser_set_isa(p, isa) != 0) {
        (void)bd_parser_set_isa(p, "best");
    }
    return 0;
}

int64_t bd_parse_unit_ns(enum bd_precision prec) {
    BD_ASSERT((size_t)prec < BD_ARRAY_LEN(ns_per_unit));
    return ns_per_unit[prec];
}

void bd_parser_close(struct bd_parser *p) {
    free(p->scratch);
    free(p->masks);
    free(p->sep_pos);
    p->scratch = NULL;
    p->masks = NULL;
    p->sep_pos = NULL;
    p->scratch_cap = 0;
}

/*
 * Line r0..r1 of the window (relative positions), its end a separator in the bitmaps: the fast
 * walk of its format if the line is plain (odd: it holds a byte that is not), else, or if the
 * walk steps aside, the general parser, which also answers empty and too long lines.
 */
static inline int parse_window_line(struct bd_parser *p, size_t r0, size_t r1, bool odd,
                                    struct bd_point *pt, const char **errmsg) {
    const char *s = p->buf + p->base;
    size_t len = r1 - r0;
    if (!odd && len > 0 && len <= p->max_line && s[r0] != ' ' && s[r0] != '#') {
        int rc = p->format == BD_FORMAT_INFLUX ? walk_influx(p, s, r0, r1, pt)
                                               : walk_graphite(p, s, r0, r1, pt);
        if (rc != PLAIN_MISS) {
            return rc;
        }
    }
    /* Past this line's separators, which the walk left unread or half read. */
    while (p->sep_next < p->n_seps && p->sep_pos[p->sep_next] <= r1) {
        p->sep_next++;
    }
    return parse_general_line(p, s + r0, len, pt, errmsg);
}

void bd_parse_begin(struct bd_parser *p, const char *buf, size_t len) {
    p->buf = buf;
    p->len = len;
    p->pos = 0;
    p->n_words = 0;
    window_fill(p, 0);
}

/*
 * The end of the line that starts at r in the window, from the newline bits, and whether it
 * holds an odd byte. The common case, a line that ends in r's bitmap word or one of the next
 * two, is decided without a branch on which (where a line ends is as random as its length);
 * the two words after the last are always readable and zero. SIZE_MAX if the window holds no
 * end for it.
 */
static inline size_t line_end(const struct bd_parser *p, size_t r, bool *odd) {
    size_t w = r / 64;
    if (w >= p->n_words) {
        return SIZE_MAX;
    }
    const uint64_t *nl = MASK_NL(p), *od = MASK_ODD(p);
    const uint64_t hb = UINT64_C(1) << 63;
    uint64_t lo = ~UINT64_C(0) << (r % 64);
    uint64_t m0 = nl[w] & lo, m1 = nl[w + 1], m2 = nl[w + 2];
    if ((m0 | m1 | m2) == 0) {
        size_t hit = bit_next(nl, p->n_words, r);
        *odd = hit != SIZE_MAX && bits_any(od, r, hit);
        return hit;
    }
    size_t c1 = 64 + (size_t)__builtin_ctzll(m1 | hb);
    size_t c2 = 128 + (size_t)__builtin_ctzll(m2 | hb);
    size_t c = m0 != 0 ? (size_t)__builtin_ctzll(m0 | hb) : m1 != 0 ? c1 : c2;
    size_t hw = c / 64; /* the word of the line end, 0 to 2 after w */
    uint64_t hm = (UINT64_C(1) << (c % 64)) - 1;
    *odd = ((od[w] & lo & (hw == 0 ? hm : ~UINT64_C(0))) |
            (od[w + 1] & (hw == 1   ? hm
                          : hw == 2 ? ~UINT64_C(0)
                                    : 0)) |
            (od[w + 2] & (hw == 2 ? hm : 0))) != 0;
    return w * 64 + c;
}

int bd_parse_next(struct bd_parser *p, struct bd_point *pt, struct bd_str *line,
                  const char **errmsg) {
    size_t a = p->pos;
    if (a >= p->len) {
        return BD_PARSE_END;
    }
    bool odd = false;
    size_t hit = line_end(p, a - p->base, &odd);
    if (hit == SIZE_MAX && a > p->base) {
        /* The window ends inside this line: start the next one at it. */
        window_fill(p, a);
        hit = line_end(p, 0, &odd);
    }
    if (hit == SIZE_MAX) {
        /* A line longer than a window: found the plain way, and never a plain line. */
        const char *nl = memchr(p->buf + a, '\n', p->len - a);
        size_t e = nl != NULL ? (size_t)(nl - p->buf) : p->len;
        p->pos = e + 1;
        if (line != NULL) {
            *line = (struct bd_str){p->buf + a, e - a};
        }
        return parse_general_line(p, p->buf + a, e - a, pt, errmsg);
    }
    size_t r = a - p->base;
    p->pos = p->base + hit + 1;
    if (line != NULL) {
        *line = (struct bd_str){p->buf + a, hit - r};
    }
    return parse_window_line(p, r, hit, odd, pt, errmsg);
}

int bd_parse_line(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                  const char **errmsg) {
    if (len > p->max_line) {
        /* The general parser's answer: the same code and the very same message pointer as a
         * long line of a batch gets (callers may compare messages by address). */
        return parse_general_line(p, line, len, pt, errmsg);
    }
    if (len < BD_PARSE_WINDOW) {
        /* One line as a batch of its own; a '\n' in it is odd and leaves it to the general
         * parser, which knows string values that hold one. */
        bd_parse_begin(p, line, len);
        return parse_window_line(p, 0, len, bits_any(MASK_ODD(p), 0, len), pt, errmsg);
    }
    return parse_general_line(p, line, len, pt, errmsg);
}
