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
 * Line protocol accept/reject decisions and values follow the InfluxDB conformance corpus
 * (../shared/corpus/line-protocol/, produced by the v2 Go decoder), corners included:
 * - a backslash escapes only the characters that would otherwise end the token (measurement:
 *   space and comma; tag keys, tag values and field keys: also '='); before anything else it
 *   is a literal backslash. String values know \" \\ \n \r \t.
 * - only ' ' separates; a tab, a lone '\r' or any other control character outside a string
 *   is an error, and so is a comment line holding one.
 * - names and strings must be valid UTF-8.
 * - floats are decimal only: no hex, no inf or nan; values beyond the double range are
 *   BD_PARSE_ERANGE, values below it become 0 or a subnormal, as Go's ParseFloat does.
 * - string values may hold raw newlines (see bd_parse_err_open_string).
 * - a repeated tag key is an error; a repeated field key keeps its first place and takes the
 *   last value, as a later write of the same field would in InfluxDB (the corpus is silent).
 *
 * Graphite plaintext is "path[;key=value...] value [timestamp]" split by spaces or tabs: tags
 * as carbon accepts them (a repeated key is an error here), the value a decimal float (integers
 * too, no nan or inf), the timestamp in seconds with an optional fraction whatever precision
 * the listener has, -1 meaning none. Lines starting with '#' are skipped as comments.
 */
#include "bucketd/parse.h"
#include "parse_int.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"

/* The plain-line scanner uses SSE2 where the compiler has it (every x86-64) and portable word
 * arithmetic elsewhere; BD_PARSE_PORTABLE forces the latter, to test it on x86. */
#if defined(__SSE2__) && !defined(BD_PARSE_PORTABLE)
#include <emmintrin.h>
#define PLAIN_SSE2 1
#endif

const char bd_parse_err_open_string[] = "unterminated string";

/* Scratch room past two line lengths (see bd_parser_init): the NUL after a float for strtod. */
#define SCRATCH_SLACK 64

/* Internal result of the number readers: distinguishes a malformed token from a big one. */
enum num_rc { NUM_OK = 0, NUM_SYNTAX = -1, NUM_RANGE = -2 };

/* ---------------------------------------------------------------------------------------- */
/* Errors and scratch                                                                       */

static int fail(const char **errmsg, int rc, const char *msg) {
    if (errmsg != NULL) {
        *errmsg = msg;
    }
    return rc;
}

struct scratch {
    char *buf;
    size_t cap;
    size_t used;
};

/* Room for n more bytes; the sizing in bd_parser_init makes running out a bug, not input. */
static char *scratch_take(struct scratch *sc, size_t n) {
    BD_ASSERT(n <= sc->cap - sc->used);
    char *dst = sc->buf + sc->used;
    sc->used += n;
    return dst;
}

/* ---------------------------------------------------------------------------------------- */
/* Characters                                                                               */

static bool is_ctl(unsigned char c) {
    return c < 0x20 || c == 0x7f;
}

static bool is_digit(unsigned char c) {
    return c >= '0' && c <= '9';
}

/*
 * Token classes of line protocol. A measurement ends at ',' or ' '; tag keys, tag values and
 * field keys also at '='. Control characters end every token (and then fail the line). Exactly
 * the characters that end a token are escapable, which makes escaped text canonical.
 */
enum token { TOK_MEASUREMENT = 1, TOK_KEY = 2 };

/*
 * One bit per kind of text a byte may continue without a second look: TOK_MEASUREMENT,
 * TOK_KEY, and 4 for the run of a boolean or number (anything but ',', ' ', '\r', '\n').
 * The backslash is left out of the token bits so that the scanning loop stops on it. One
 * table lookup per byte is what keeps the scanners cheap.
 */
#define CLASS_VALUE 4
static const unsigned char char_class[256] = {
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 4, 4, 0, 4, 4, /* 00 */
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, /* 10 */
    0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0, 7, 7, 7, /* 20 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 5, 7, 7, /* 30 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* 40 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 4, 7, 7, 7, /* 50 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* 60 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 4, /* 70 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* 80 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* 90 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* a0 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* b0 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* c0 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* d0 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* e0 */
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, /* f0 */
};

static bool token_escapable(unsigned char c, enum token t) {
    return c == ',' || c == ' ' || (t == TOK_KEY && c == '=');
}

/*
 * Scans a token from s[i] and returns the index just past it; *esc tells whether it holds an
 * escape (and so needs unescaping). A backslash before anything but an escapable character is
 * kept as it is, and the character after it is judged on its own.
 */
static size_t scan_token(const char *s, size_t i, size_t n, enum token t, bool *esc) {
    for (;;) {
        while (i < n && (char_class[(unsigned char)s[i]] & t) != 0) {
            i++;
        }
        if (i == n || s[i] != '\\') {
            return i;
        }
        if (i + 1 < n && token_escapable((unsigned char)s[i + 1], t)) {
            *esc = true;
            i += 2;
        } else {
            i++;
        }
    }
}

static struct bd_str unescape_token(struct scratch *sc, const char *s, size_t len, enum token t) {
    char *dst = scratch_take(sc, len);
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '\\' && i + 1 < len && token_escapable((unsigned char)s[i + 1], t)) {
            i++;
        }
        dst[o++] = s[i];
    }
    sc->used -= len - o;
    return (struct bd_str){dst, o};
}

static struct bd_str take_token(struct scratch *sc, const char *s, size_t start, size_t end,
                                enum token t, bool esc) {
    if (!esc) {
        return (struct bd_str){s + start, end - start};
    }
    return unescape_token(sc, s + start, end - start, t);
}

static char string_unescaped(unsigned char c) {
    switch (c) {
    case '"':
    case '\\':
        return (char)c;
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    default:
        return 0;
    }
}

/*
 * Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF). Lines are nearly always
 * ASCII, so eight bytes are tested at once until a high bit shows up.
 */
static bool utf8_valid(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        if (n - i >= 8) {
            uint64_t w;
            memcpy(&w, s + i, sizeof(w));
            if ((w & UINT64_C(0x8080808080808080)) == 0) {
                i += 8;
                continue;
            }
        }
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        unsigned char lo = 0x80;
        unsigned char hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf) {
            need = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            need = 2;
            lo = c == 0xe0 ? 0xa0 : 0x80;
            hi = c == 0xed ? 0x9f : 0xbf;
        } else if (c >= 0xf0 && c <= 0xf4) {
            need = 3;
            lo = c == 0xf0 ? 0x90 : 0x80;
            hi = c == 0xf4 ? 0x8f : 0xbf;
        } else {
            return false;
        }
        if (n - i - 1 < need || s[i + 1] < lo || s[i + 1] > hi) {
            return false;
        }
        for (size_t k = 2; k <= need; k++) {
            if (s[i + k] < 0x80 || s[i + k] > 0xbf) {
                return false;
            }
        }
        i += need + 1;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Numbers                                                                                  */

/* Eight bytes as a little-endian word, whatever the host's byte order. */
static uint64_t load_le64(const char *s) {
    uint64_t w;
    memcpy(&w, s, sizeof(w));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

#define BYTES(c) (UINT64_C(0x0101010101010101) * (c))

/* 0x80 in every byte of w equal to c, 0 elsewhere (exact: no carry crosses bytes). */
static uint64_t bytes_eq(uint64_t w, unsigned char c) {
    uint64_t x = w ^ BYTES(c);
    return ~(((x & BYTES(0x7f)) + BYTES(0x7f)) | x) & BYTES(0x80);
}

/*
 * Eight ASCII digits at once (SWAR), w holding them as load_le64() does: false unless all
 * eight are digits. A timestamp's 19 digits take three of these instead of 19 loop turns.
 */
static bool digits8(uint64_t w, uint32_t *out) {
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
static uint64_t align_digits(uint64_t w, size_t k) {
    return k == 8 ? w : (w << (8 * (8 - k))) | (BYTES('0') >> (8 * k));
}

/*
 * Decimal digits to a uint64_t, as Go's ParseUint reads them: at least one, nothing else. Up to
 * 19 digits cannot overflow: from 8 on they go eight at a time, the odd ones first (with the
 * load starting at the first digit, so nothing past the token is read). Longer runs (rare:
 * leading zeros or garbage) take the careful loop.
 */
static enum num_rc read_u64(const char *s, size_t n, uint64_t *out) {
    if (n == 0) {
        return NUM_SYNTAX;
    }
    uint64_t v = 0;
    if (n >= 8 && n <= 19) {
        size_t i = n % 8;
        uint32_t d8 = 0;
        if (i != 0 && !digits8(align_digits(load_le64(s), i), &d8)) {
            return NUM_SYNTAX;
        }
        for (v = d8; i < n; i += 8) {
            if (!digits8(load_le64(s + i), &d8)) {
                return NUM_SYNTAX;
            }
            v = v * 100000000 + d8;
        }
        *out = v;
        return NUM_OK;
    }
    bool big = false;
    for (size_t i = 0; i < n; i++) {
        unsigned d = (unsigned char)s[i] - '0';
        if (d > 9) {
            return NUM_SYNTAX;
        }
        if (i >= 19 && (v > UINT64_MAX / 10 || v * 10 > UINT64_MAX - d)) {
            big = true;
        }
        v = v * 10 + d;
    }
    if (big) {
        return NUM_RANGE;
    }
    *out = v;
    return NUM_OK;
}

/* [-]digits, as Go's ParseInt reads the integers and timestamps of line protocol. */
static enum num_rc read_i64(const char *s, size_t n, int64_t *out) {
    bool neg = n > 0 && s[0] == '-';
    uint64_t v = 0;
    enum num_rc rc = read_u64(s + neg, n - neg, &v);
    if (rc != NUM_OK) {
        return rc;
    }
    if (v > (neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX)) {
        return NUM_RANGE;
    }
    /* Negating in unsigned arithmetic keeps INT64_MIN free of signed overflow. */
    *out = neg ? (int64_t)(~v + 1) : (int64_t)v;
    return NUM_OK;
}

#if FLT_EVAL_METHOD == 0
static const double pow10_exact[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
#define MANT_EXACT (UINT64_C(1) << 53)
#endif

/*
 * Decimal float: [sign] (digits [. digits] | . digits) [(e|E) [sign] digits]. The sign may be
 * '+' only where plus_ok (Graphite). Values with few digits and a small exponent are integers
 * below 2^53 times an exact power of ten, and one multiplication or division rounds once, which
 * gives the correctly rounded double (Clinger's fast path). Anything else is handed to strtod,
 * copied into tmp (n + 1 bytes) because the token is not NUL-terminated.
 */
static enum num_rc read_f64_any(const char *s, size_t n, bool plus_ok, char *tmp, double *out) {
    /* Past this the value is 0 or infinite anyway; keeping exp10 within it avoids overflow. */
    const int exp_cap = 1000000;
    size_t i = 0;
    bool neg = false;
    if (i < n && (s[i] == '-' || (plus_ok && s[i] == '+'))) {
        neg = s[i] == '-';
        i++;
    }
    uint64_t mant = 0;
    int sig = 0;       /* significant digits held in mant (at most 19 fit) */
    int exp10 = 0;     /* the value is mant * 10^exp10 ... */
    bool exact = true; /* ... exactly, unless digits were dropped or exp10 capped */
    size_t digits = 0;
    for (; i < n && is_digit((unsigned char)s[i]); i++, digits++) {
        unsigned d = (unsigned char)s[i] - '0';
        if (sig < 19) {
            if (mant != 0 || d != 0) {
                mant = mant * 10 + d;
                sig++;
            }
        } else {
            /* A digit past the 19th still scales the value; a nonzero one makes it inexact. */
            exact = exact && d == 0 && exp10 < exp_cap;
            exp10 += exp10 < exp_cap;
        }
    }
    if (i < n && s[i] == '.') {
        for (i++; i < n && is_digit((unsigned char)s[i]); i++, digits++) {
            unsigned d = (unsigned char)s[i] - '0';
            if (sig == 19 || exp10 <= -exp_cap) {
                exact = exact && d == 0;
                continue;
            }
            if (mant != 0 || d != 0) {
                mant = mant * 10 + d;
                sig++;
            }
            exp10--;
        }
    }
    if (digits == 0) {
        return NUM_SYNTAX;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        bool eneg = false;
        if (i < n && (s[i] == '+' || s[i] == '-')) {
            eneg = s[i] == '-';
            i++;
        }
        if (i == n || !is_digit((unsigned char)s[i])) {
            return NUM_SYNTAX;
        }
        int e = 0;
        for (; i < n && is_digit((unsigned char)s[i]); i++) {
            if (e < exp_cap) {
                e = e * 10 + (s[i] - '0');
            } else {
                exact = false;
            }
        }
        exp10 += eneg ? -e : e;
    }
    if (i != n) {
        return NUM_SYNTAX;
    }
    if (mant == 0 && exact) {
        *out = neg ? -0.0 : 0.0;
        return NUM_OK;
    }
#if FLT_EVAL_METHOD == 0
    /* Only where double arithmetic is not carried out in a wider type (x87) and rounded twice. */
    if (exact && mant <= MANT_EXACT && exp10 >= -22 && exp10 <= 22 + 15) {
        double m = (double)mant;
        double v = 0;
        bool fast = true;
        if (exp10 < 0) {
            v = m / pow10_exact[-exp10];
        } else if (exp10 <= 22) {
            v = m * pow10_exact[exp10];
        } else {
            /* 12e30 = 12000000000 * 1e22: exact while the scaled integer stays below 2^53. */
            uint64_t big = mant;
            for (int k = exp10 - 22; k > 0 && fast; k--) {
                big *= 10;
                fast = big <= MANT_EXACT;
            }
            v = (double)big * 1e22;
        }
        if (fast) {
            *out = neg ? -v : v;
            return NUM_OK;
        }
    }
#else
    (void)exact;
#endif
    /* The syntax was checked above, so strtod reads exactly these bytes (in the "C" locale,
     * which the daemon never changes). */
    memcpy(tmp, s, n);
    tmp[n] = '\0';
    char *end = NULL;
    double v = strtod(tmp, &end);
    if (end != tmp + n) {
        return NUM_SYNTAX;
    }
    if (isinf(v)) {
        return NUM_RANGE;
    }
    *out = v;
    return NUM_OK;
}

#if FLT_EVAL_METHOD == 0
/*
 * The shape nearly every sensor sends, [-]digits[.digits] with at most 19 digits and no
 * exponent, read in one pass. The digits form an integer m and the value is m / 10^k with k the
 * number of decimals; when m <= 2^53 and k <= 22 both are exact doubles and the one division
 * rounds correctly (Clinger's fast path). False for anything else, which read_f64_any decides.
 */
static bool read_f64_short(const char *s, size_t n, double *out) {
    bool neg = n > 0 && s[0] == '-';
    size_t i = neg;
    uint64_t mant = 0;
    /* More than 19 digits may wrap mant; the count below rejects those before it is used. */
    for (unsigned d; i < n && (d = (unsigned char)s[i] - '0') <= 9; i++) {
        mant = mant * 10 + d;
    }
    size_t digits = i - neg;
    size_t decimals = 0;
    if (i < n && s[i] == '.') {
        size_t start = ++i;
        for (unsigned d; i < n && (d = (unsigned char)s[i] - '0') <= 9; i++) {
            mant = mant * 10 + d;
        }
        decimals = i - start;
        digits += decimals;
    }
    if (i != n || digits == 0 || digits > 19 || decimals > 22 || mant > MANT_EXACT) {
        return false;
    }
    double v = (double)mant / pow10_exact[decimals];
    *out = neg ? -v : v;
    return true;
}
#endif

static enum num_rc read_f64(const char *s, size_t n, bool plus_ok, char *tmp, double *out) {
#if FLT_EVAL_METHOD == 0
    if (read_f64_short(s, n, out)) {
        return NUM_OK;
    }
#endif
    return read_f64_any(s, n, plus_ok, tmp, out);
}

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

/* ---------------------------------------------------------------------------------------- */
/* Points                                                                                   */

/* The raw text of a tag ("key=value" as it arrived), for building the series key. */
struct raw_span {
    const char *ptr;
    size_t len;
};

/* Keys are never empty and nearly always differ in their first byte: memcmp only if not. */
static int str_cmp(struct bd_str a, struct bd_str b) {
    if (a.len > 0 && b.len > 0 && a.ptr[0] != b.ptr[0]) {
        return (unsigned char)a.ptr[0] - (unsigned char)b.ptr[0];
    }
    int c = memcmp(a.ptr, b.ptr, BD_MIN(a.len, b.len));
    if (c != 0) {
        return c;
    }
    return (a.len > b.len) - (a.len < b.len);
}

static bool str_eq(struct bd_str a, struct bd_str b) {
    return a.len == b.len &&
           (a.len == 0 || (a.ptr[0] == b.ptr[0] && memcmp(a.ptr, b.ptr, a.len) == 0));
}

/*
 * Sorts the tags by key (insertion sort: there are few, and senders mostly sort them already)
 * and rejects a repeated key. raw moves along with the tags. in_order says every key was
 * already greater than the one before it: then they are sorted and distinct, nothing to do.
 */
static int sort_tags(struct bd_point *pt, struct raw_span *raw, bool in_order,
                     const char **errmsg) {
    if (in_order) {
        return 0;
    }
    for (uint32_t i = 1; i < pt->n_tags; i++) {
        struct bd_tag t = pt->tags[i];
        struct raw_span r = raw[i];
        uint32_t j = i;
        while (j > 0 && str_cmp(pt->tags[j - 1].key, t.key) > 0) {
            pt->tags[j] = pt->tags[j - 1];
            raw[j] = raw[j - 1];
            j--;
        }
        pt->tags[j] = t;
        raw[j] = r;
    }
    for (uint32_t i = 1; i < pt->n_tags; i++) {
        if (str_eq(pt->tags[i - 1].key, pt->tags[i].key)) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "duplicate tag key");
        }
    }
    return 0;
}

/*
 * The series key: the name's raw text, then each tag's raw text in key order after sep. Raw
 * text is already the canonical escaped form (every escapable character ends its token, so it
 * arrived escaped, and a backslash before anything else stays literal both ways); when the tags
 * came sorted the key is the input's own prefix and nothing is copied.
 */
static struct bd_str build_series_key(struct scratch *sc, const char *name, size_t name_len,
                                      const struct raw_span *raw, uint32_t n, char sep,
                                      bool in_order) {
    if (in_order) {
        size_t len = name_len;
        if (n > 0) {
            len = (size_t)(raw[n - 1].ptr + raw[n - 1].len - name);
        }
        return (struct bd_str){name, len};
    }
    size_t len = name_len;
    for (uint32_t i = 0; i < n; i++) {
        len += 1 + raw[i].len;
    }
    char *dst = scratch_take(sc, len);
    char *o = dst;
    memcpy(o, name, name_len);
    o += name_len;
    for (uint32_t i = 0; i < n; i++) {
        *o++ = sep;
        memcpy(o, raw[i].ptr, raw[i].len);
        o += raw[i].len;
    }
    return (struct bd_str){dst, len};
}

/* The slot of key if this line stored it already, else NULL. */
static __attribute__((noinline)) struct bd_field *field_find(struct bd_point *pt,
                                                             struct bd_str key) {
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        if (str_eq(pt->fields[i].key, key)) {
            return &pt->fields[i];
        }
    }
    return NULL;
}

/*
 * Stores a field; a key seen before on this line keeps its slot and takes the new value. seen
 * (zero at the start of a line) has one bit per hash of the keys stored so far: a key whose bit
 * is clear cannot be a repeat, so the search, a loop of unpredictable length, is rarely run.
 * Inline: the fast walk calls it once per field.
 */
static inline struct bd_field *field_slot(struct bd_point *pt, struct bd_str key, uint64_t *seen) {
    unsigned char first = (unsigned char)key.ptr[0];
    unsigned char last = (unsigned char)key.ptr[key.len - 1];
    uint64_t bit = UINT64_C(1) << ((key.len * 7 + first + last * 3) % 64);
    if ((*seen & bit) != 0) {
        struct bd_field *f = field_find(pt, key);
        if (f != NULL) {
            return f;
        }
    }
    if (pt->n_fields == BD_PARSE_MAX_FIELDS) {
        return NULL;
    }
    *seen |= bit;
    struct bd_field *f = &pt->fields[pt->n_fields++];
    f->key = key;
    return f;
}

/* ---------------------------------------------------------------------------------------- */
/* InfluxDB line protocol                                                                   */

/* A boolean or number field value, v[0, len) up to its separator; 0 or a bd_parse_status. */
static int read_scalar(struct scratch *sc, const char *v, size_t len, struct bd_field *f,
                       const char **errmsg) {
    unsigned char c = len > 0 ? (unsigned char)v[0] : 0;
    if (c == 't' || c == 'T' || c == 'f' || c == 'F') {
        static const char *const words[] = {"t", "T", "true",  "True",  "TRUE",
                                            "f", "F", "false", "False", "FALSE"};
        for (size_t k = 0; k < BD_ARRAY_LEN(words); k++) {
            if (strlen(words[k]) == len && memcmp(words[k], v, len) == 0) {
                f->kind = BD_VAL_BOOL;
                f->v.b = k < 5;
                return 0;
            }
        }
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid boolean");
    }
    if (c != '-' && c != '.' && !is_digit(c)) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid field value");
    }
    enum num_rc rc;
    if (v[len - 1] == 'i') {
        f->kind = BD_VAL_INT;
        rc = read_i64(v, len - 1, &f->v.i);
        if (rc != NUM_OK) {
            return rc == NUM_RANGE ? fail(errmsg, BD_PARSE_ERANGE, "integer out of range")
                                   : fail(errmsg, BD_PARSE_ESYNTAX, "invalid integer");
        }
    } else if (v[len - 1] == 'u') {
        f->kind = BD_VAL_UINT;
        rc = read_u64(v, len - 1, &f->v.u);
        if (rc != NUM_OK) {
            return rc == NUM_RANGE ? fail(errmsg, BD_PARSE_ERANGE, "unsigned integer out of range")
                                   : fail(errmsg, BD_PARSE_ESYNTAX, "invalid unsigned integer");
        }
    } else {
        f->kind = BD_VAL_FLOAT;
        /* The copy for strtod goes past everything kept so far and is not kept itself. */
        BD_ASSERT(len + 1 <= sc->cap - sc->used);
        rc = read_f64(v, len, false, sc->buf + sc->used, &f->v.f);
        if (rc != NUM_OK) {
            return rc == NUM_RANGE ? fail(errmsg, BD_PARSE_ERANGE, "float out of range")
                                   : fail(errmsg, BD_PARSE_ESYNTAX, "invalid float");
        }
    }
    return 0;
}

/* Reads the value of a field starting at s[*pi] and moves *pi past it; 0 or a bd_parse_status. */
static int read_field_value(struct scratch *sc, const char *s, size_t *pi, size_t n,
                            struct bd_field *f, const char **errmsg) {
    size_t i = *pi;
    unsigned char c = (unsigned char)s[i];
    if (c == '"') {
        size_t start = ++i;
        bool esc = false;
        while (i < n && s[i] != '"') {
            if (s[i] == '\\' && i + 1 < n && string_unescaped((unsigned char)s[i + 1]) != 0) {
                esc = true;
                i++;
            }
            i++;
        }
        if (i == n) {
            return fail(errmsg, BD_PARSE_ESYNTAX, bd_parse_err_open_string);
        }
        f->kind = BD_VAL_STRING;
        f->v.s = (struct bd_str){s + start, i - start};
        if (esc) {
            char *dst = scratch_take(sc, i - start);
            size_t o = 0;
            for (size_t k = start; k < i; k++) {
                char u = 0;
                if (s[k] == '\\' && k + 1 < i) {
                    u = string_unescaped((unsigned char)s[k + 1]);
                }
                if (u != 0) {
                    k++;
                    dst[o++] = u;
                } else {
                    dst[o++] = s[k];
                }
            }
            sc->used -= (i - start) - o;
            f->v.s = (struct bd_str){dst, o};
        }
        *pi = i + 1;
        return 0;
    }

    /* Booleans and numbers run to the next separator; what they hold is checked after. */
    size_t start = i;
    while (i < n && (char_class[(unsigned char)s[i]] & CLASS_VALUE) != 0) {
        i++;
    }
    *pi = i;
    return read_scalar(sc, s + start, i - start, f, errmsg);
}

/* A timestamp token in the listener's precision into pt; 0 or a bd_parse_status. */
static int read_influx_time(const struct bd_parser *p, const char *s, size_t n, struct bd_point *pt,
                            const char **errmsg) {
    int64_t t = 0;
    enum num_rc rc = read_i64(s, n, &t);
    if (rc == NUM_SYNTAX) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid timestamp");
    }
    if (rc == NUM_RANGE || t > max_in_unit[p->precision] || t < min_in_unit[p->precision]) {
        return fail(errmsg, BD_PARSE_ERANGE, "timestamp out of range");
    }
    pt->has_time = true;
    pt->time_ns = t * ns_per_unit[p->precision];
    return 0;
}

static int parse_influx(struct bd_parser *p, const char *s, size_t n, struct bd_point *pt,
                        const char **errmsg) {
    struct scratch sc = {p->scratch, p->scratch_cap, 0};
    struct raw_span raw[BD_PARSE_MAX_TAGS];
    size_t i = 0;

    while (i < n && s[i] == ' ') {
        i++;
    }
    if (i == n) {
        return BD_PARSE_SKIP;
    }
    if (s[i] == '#') {
        for (size_t k = i + 1; k < n; k++) {
            if (is_ctl((unsigned char)s[k])) {
                return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character in comment line");
            }
        }
        return BD_PARSE_SKIP;
    }
    /*
     * Every byte of a valid line belongs to a name, a string, a number or a separator, and only
     * names and strings may be non-ASCII, so checking the whole line checks exactly them.
     */
    if (!utf8_valid(s + i, n - i)) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid UTF-8");
    }

    /* Measurement. */
    const char *name = s + i;
    bool esc = false;
    size_t end = scan_token(s, i, n, TOK_MEASUREMENT, &esc);
    if (end == i) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character at start of measurement");
    }
    size_t name_len = end - i;
    pt->name = take_token(&sc, s, i, end, TOK_MEASUREMENT, esc);
    i = end;

    /* Tag set: each tag follows a comma. */
    pt->n_tags = 0;
    bool in_order = true;
    while (i < n && s[i] == ',') {
        i++;
        if (i == n || s[i] == ' ') {
            return fail(errmsg, BD_PARSE_ESYNTAX, "expected tag key after comma");
        }
        size_t ks = i;
        esc = false;
        size_t ke = scan_token(s, ks, n, TOK_KEY, &esc);
        if (ke == ks) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character at start of tag key");
        }
        if (ke == n || s[ke] != '=') {
            return fail(errmsg, BD_PARSE_ESYNTAX, "expected '=' after tag key");
        }
        bool vesc = false;
        size_t vs = ke + 1;
        size_t ve = scan_token(s, vs, n, TOK_KEY, &vesc);
        if (ve == vs) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "missing tag value");
        }
        if (pt->n_tags == BD_PARSE_MAX_TAGS) {
            return fail(errmsg, BD_PARSE_ETOO_MANY_TAGS, "too many tags");
        }
        struct bd_tag *t = &pt->tags[pt->n_tags];
        t->key = take_token(&sc, s, ks, ke, TOK_KEY, esc);
        t->value = take_token(&sc, s, vs, ve, TOK_KEY, vesc);
        raw[pt->n_tags] = (struct raw_span){s + ks, ve - ks};
        if (pt->n_tags > 0 && str_cmp(pt->tags[pt->n_tags - 1].key, t->key) >= 0) {
            in_order = false;
        }
        pt->n_tags++;
        i = ve;
    }
    if (i == n) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "missing field set");
    }
    if (s[i] != ' ') {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character in measurement or tag set");
    }
    while (i < n && s[i] == ' ') {
        i++;
    }

    /* Field set. */
    pt->n_fields = 0;
    uint64_t seen = 0;
    for (;;) {
        if (i == n) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "missing field set");
        }
        size_t ks = i;
        esc = false;
        size_t ke = scan_token(s, ks, n, TOK_KEY, &esc);
        if (ke == ks) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character at start of field key");
        }
        if (ke == n || s[ke] != '=') {
            return fail(errmsg, BD_PARSE_ESYNTAX, "expected '=' after field key");
        }
        i = ke + 1;
        if (i == n) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "missing field value");
        }
        struct bd_field f;
        f.key = take_token(&sc, s, ks, ke, TOK_KEY, esc);
        int rc = read_field_value(&sc, s, &i, n, &f, errmsg);
        if (rc < 0) {
            return rc;
        }
        struct bd_field *slot = field_slot(pt, f.key, &seen);
        if (slot == NULL) {
            return fail(errmsg, BD_PARSE_ETOO_MANY_FIELDS, "too many fields");
        }
        *slot = f;
        if (i == n || s[i] == ' ') {
            break;
        }
        if (s[i] != ',') {
            return fail(errmsg, BD_PARSE_ESYNTAX, "unexpected character after field value");
        }
        i++;
    }
    while (i < n && s[i] == ' ') {
        i++;
    }

    /* Timestamp. */
    pt->has_time = false;
    if (i < n) {
        size_t ts = i;
        while (i < n && (s[i] == '-' || is_digit((unsigned char)s[i]))) {
            i++;
        }
        if (i == ts || (i < n && s[i] != ' ')) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "invalid timestamp");
        }
        int rc = read_influx_time(p, s + ts, i - ts, pt, errmsg);
        if (rc < 0) {
            return rc;
        }
        while (i < n && s[i] == ' ') {
            i++;
        }
        if (i < n) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "unexpected text after timestamp");
        }
    }

    int rc = sort_tags(pt, raw, in_order, errmsg);
    if (rc < 0) {
        return rc;
    }
    pt->series_key = build_series_key(&sc, name, name_len, raw, pt->n_tags, ',', in_order);
    return BD_PARSE_OK;
}

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
 * general parser above, and so does every plain line the fast walk does not accept: the
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

/* Positions flatten() may write past the last set bit (flatten_vbmi2 stores 32 at a time). */
#define FLATTEN_SLACK 32

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

/*
 * A field value of the shape sensors send: [-] digits with at most one '.', at most 8 of them
 * (the '.' counted), and an 'i' or 'u' suffix for integers (then no '.'); for Graphite also
 * [+], and never a suffix. Read without a branch
 * on the shape, which varies from field to field and would be mispredicted: the 8 bytes after
 * the sign are loaded at once (room, the bytes readable from v, must allow it), the '.' is
 * squeezed out of the word, the digits moved to its end behind '0's and converted eight at a
 * time; the float is one division by an exact power of ten, which rounds correctly (Clinger's
 * fast path, as in read_f64_short). False for any other shape, which read_scalar() decides.
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
        struct scratch sc = {p->scratch, p->scratch_cap, 0};
        struct raw_span raw[BD_PARSE_MAX_TAGS];
        bool sorted = true;
        for (uint32_t k = 0; k < nt; k++) {
            raw[k] = (struct raw_span){
                pt->tags[k].key.ptr,
                (size_t)(pt->tags[k].value.ptr + pt->tags[k].value.len - pt->tags[k].key.ptr)};
            sorted &= k == 0 || str_cmp(pt->tags[k - 1].key, pt->tags[k].key) < 0;
        }
        if (!sorted) {
            if (sort_tags(pt, raw, false, NULL) < 0) {
                return PLAIN_MISS;
            }
            pt->series_key = build_series_key(&sc, line, pt->name.len, raw, nt, sep, false);
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
            if (read_scalar(&sc, v, len, slot, NULL) != 0) {
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
            read_influx_time(p, s + i + 1, e - i - 1, pt, NULL) != 0) {
            goto miss;
        }
    }
    p->sep_next = j;
    return finish_tags(p, pt, s + a, in_order, ',', head_end - a);

miss:
    p->sep_next = j;
    return PLAIN_MISS;
}

static const char graphite_field_key[] = "value";
static enum num_rc read_graphite_time(const char *s, size_t n, bool *has, int64_t *ns);

/*
 * The fast walk for a plain Graphite line s[a, e): "path[;key=value...] value [timestamp]" with
 * single spaces, no tab, no control or non-ASCII byte and no '!' or '^' (those are odd bytes
 * for this format, so a tag key holding one never gets here). The separators are ' ', ';', '='
 * and the line end; a path and a tag value may hold '=', nothing else may hold a separator.
 * BD_PARSE_OK, or PLAIN_MISS wherever parse_graphite must decide.
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
    f->key = (struct bd_str){graphite_field_key, sizeof(graphite_field_key) - 1};
    const char *v = s + i + 1;
    size_t room_end = p->len - p->base;
    if (!plain_number(v, ve - i - 1, room_end - i - 1, true, f)) {
        if (read_f64(v, ve - i - 1, true, p->scratch, &f->v.f) != NUM_OK) {
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
            read_graphite_time(s + ve + 1, e - ve - 1, &pt->has_time, &pt->time_ns) != NUM_OK) {
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
/* Graphite plaintext                                                                       */

static bool graphite_space(char c) {
    return c == ' ' || c == '\t';
}

/*
 * Seconds since the epoch, [-]digits[.digits], to nanoseconds. Digits past the ninth decimal
 * are below a nanosecond and ignored. -1 is the conventional "no timestamp".
 */
static enum num_rc read_graphite_time(const char *s, size_t n, bool *has, int64_t *ns) {
    size_t i = 0;
    bool neg = false;
    if (i < n && s[i] == '-') {
        neg = true;
        i++;
    }
    size_t int_start = i;
    uint64_t sec = 0;
    bool big = false;
    for (; i < n && is_digit((unsigned char)s[i]); i++) {
        unsigned d = (unsigned char)s[i] - '0';
        /* Nineteen digits always fit in 64 bits; only longer numbers need the check. */
        if (i - int_start >= 19 && sec > (UINT64_MAX - d) / 10) {
            big = true;
        } else {
            sec = sec * 10 + d;
        }
    }
    if (i == int_start) {
        return NUM_SYNTAX;
    }
    uint64_t frac = 0;
    if (i < n && s[i] == '.') {
        int places = 0;
        for (i++; i < n && is_digit((unsigned char)s[i]); i++) {
            if (places < 9) {
                frac = frac * 10 + (uint64_t)(s[i] - '0');
                places++;
            }
        }
        for (; places < 9; places++) {
            frac *= 10;
        }
    }
    if (i != n) {
        return NUM_SYNTAX;
    }
    if (neg && sec == 1 && frac == 0) {
        *has = false;
        return NUM_OK;
    }
    uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    if (big || sec > limit / 1000000000u || sec * 1000000000u > limit - frac) {
        return NUM_RANGE;
    }
    uint64_t mag = sec * 1000000000u + frac;
    *ns = neg ? (int64_t)(~mag + 1) : (int64_t)mag;
    *has = true;
    return NUM_OK;
}

/*
 * One tag of a tagged path, as carbon accepts it: a non-empty key without '!' or '^', '=', then
 * a non-empty value that does not start with '~' (it may hold further '=').
 */
static bool graphite_tag_ok(const char *s, size_t len, size_t *eq) {
    const char *e = memchr(s, '=', len);
    if (e == NULL || e == s || (size_t)(e - s) + 1 == len || e[1] == '~') {
        return false;
    }
    for (const char *c = s; c < e; c++) {
        if (*c == '!' || *c == '^') {
            return false;
        }
    }
    *eq = (size_t)(e - s);
    return true;
}

/*
 * Whether s[0, n) is printable ASCII (0x20 to 0x7e), eight bytes at a time. Nearly every
 * Graphite line is: it then needs no UTF-8 check, holds no tab or control character, and its
 * tokens end at the next ' ', which memchr finds far faster than a byte loop.
 */
static bool printable_ascii(const char *s, size_t n) {
    uint64_t bad = 0;
    size_t i = 0;
    for (; n - i >= 8; i += 8) {
        uint64_t w = load_le64(s + i);
        /* (b & 0x7f) + 0x60 reaches 0x80 exactly when b & 0x7f >= 0x20. */
        bad |= ~((w & BYTES(0x7f)) + BYTES(0x60)) | w | bytes_eq(w, 0x7f);
    }
    for (; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        bad |= (uint64_t)(is_ctl(c) || c >= 0x80) << 7;
    }
    return (bad & BYTES(0x80)) == 0;
}

/* End of the token starting at i: the next space or tab (only ' ' in a printable line). */
static size_t graphite_token_end(const char *s, size_t i, size_t n, bool printable) {
    if (printable) {
        const char *sp = memchr(s + i, ' ', n - i);
        return sp != NULL ? (size_t)(sp - s) : n;
    }
    while (i < n && !graphite_space(s[i])) {
        i++;
    }
    return i;
}

static int parse_graphite(struct bd_parser *p, const char *s, size_t n, struct bd_point *pt,
                          const char **errmsg) {
    struct scratch sc = {p->scratch, p->scratch_cap, 0};
    struct raw_span raw[BD_PARSE_MAX_TAGS];
    size_t i = 0;

    while (i < n && graphite_space(s[i])) {
        i++;
    }
    if (i == n || s[i] == '#') {
        return BD_PARSE_SKIP;
    }
    bool printable = printable_ascii(s + i, n - i);
    if (!printable && !utf8_valid(s + i, n - i)) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "invalid UTF-8");
    }

    /* path[;key=value...] */
    size_t ps = i;
    i = graphite_token_end(s, i, n, printable);
    for (size_t k = ps; !printable && k < i; k++) {
        if (is_ctl((unsigned char)s[k])) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "invalid character in path");
        }
    }
    size_t pe = i;
    const char *semi = memchr(s + ps, ';', pe - ps);
    size_t name_end = semi != NULL ? (size_t)(semi - s) : pe;
    if (name_end == ps) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "missing path");
    }
    pt->name = (struct bd_str){s + ps, name_end - ps};
    pt->n_tags = 0;
    bool in_order = true;
    for (size_t ts = name_end; ts < pe;) {
        ts++; /* the ';' */
        const char *next = memchr(s + ts, ';', pe - ts);
        size_t te = next != NULL ? (size_t)(next - s) : pe;
        size_t eq = 0;
        if (!graphite_tag_ok(s + ts, te - ts, &eq)) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "invalid tag");
        }
        if (pt->n_tags == BD_PARSE_MAX_TAGS) {
            return fail(errmsg, BD_PARSE_ETOO_MANY_TAGS, "too many tags");
        }
        struct bd_tag *t = &pt->tags[pt->n_tags];
        t->key = (struct bd_str){s + ts, eq};
        t->value = (struct bd_str){s + ts + eq + 1, te - ts - eq - 1};
        raw[pt->n_tags] = (struct raw_span){s + ts, te - ts};
        if (pt->n_tags > 0 && str_cmp(pt->tags[pt->n_tags - 1].key, t->key) >= 0) {
            in_order = false;
        }
        pt->n_tags++;
        ts = te;
    }

    /* value */
    while (i < n && graphite_space(s[i])) {
        i++;
    }
    if (i == n) {
        return fail(errmsg, BD_PARSE_ESYNTAX, "missing value");
    }
    size_t vs = i;
    i = graphite_token_end(s, i, n, printable);
    pt->n_fields = 1;
    struct bd_field *f = &pt->fields[0];
    f->key = (struct bd_str){graphite_field_key, sizeof(graphite_field_key) - 1};
    f->kind = BD_VAL_FLOAT;
    BD_ASSERT(i - vs + 1 <= sc.cap - sc.used);
    enum num_rc rc = read_f64(s + vs, i - vs, true, sc.buf + sc.used, &f->v.f);
    if (rc != NUM_OK) {
        return rc == NUM_RANGE ? fail(errmsg, BD_PARSE_ERANGE, "float out of range")
                               : fail(errmsg, BD_PARSE_ESYNTAX, "invalid float");
    }

    /* [timestamp] */
    while (i < n && graphite_space(s[i])) {
        i++;
    }
    pt->has_time = false;
    if (i < n) {
        size_t ts = i;
        i = graphite_token_end(s, i, n, printable);
        rc = read_graphite_time(s + ts, i - ts, &pt->has_time, &pt->time_ns);
        if (rc != NUM_OK) {
            return rc == NUM_RANGE ? fail(errmsg, BD_PARSE_ERANGE, "timestamp out of range")
                                   : fail(errmsg, BD_PARSE_ESYNTAX, "invalid timestamp");
        }
        while (i < n && graphite_space(s[i])) {
            i++;
        }
        if (i < n) {
            return fail(errmsg, BD_PARSE_ESYNTAX, "unexpected text after timestamp");
        }
    }

    int rc2 = sort_tags(pt, raw, in_order, errmsg);
    if (rc2 < 0) {
        return rc2;
    }
    pt->series_key = build_series_key(&sc, s + ps, name_end - ps, raw, pt->n_tags, ';', in_order);
    return BD_PARSE_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Public                                                                                   */

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

/* The general parser, for one line (without its '\n'). */
static int parse_general(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                         const char **errmsg) {
    if (len > p->max_line) {
        return fail(errmsg, BD_PARSE_ETOO_LONG, "line too long");
    }
    /* The '\r' of a "\r\n" ending; any other '\r' outside a string fails the line. */
    if (len > 0 && line[len - 1] == '\r') {
        len--;
    }
    if (p->format == BD_FORMAT_GRAPHITE) {
        return parse_graphite(p, line, len, pt, errmsg);
    }
    return parse_influx(p, line, len, pt, errmsg);
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
    return parse_general(p, s + r0, len, pt, errmsg);
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
        return parse_general(p, p->buf + a, e - a, pt, errmsg);
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
        return fail(errmsg, BD_PARSE_ETOO_LONG, "line too long");
    }
    if (len < BD_PARSE_WINDOW) {
        /* One line as a batch of its own; a '\n' in it is odd and leaves it to the general
         * parser, which knows string values that hold one. */
        bd_parse_begin(p, line, len);
        return parse_window_line(p, 0, len, bits_any(MASK_ODD(p), 0, len), pt, errmsg);
    }
    return parse_general(p, line, len, pt, errmsg);
}

int bd_parse_line_general(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                          const char **errmsg) {
    return parse_general(p, line, len, pt, errmsg);
}
