/*
 * The general parser (src/parse_general.h): InfluxDB line protocol and Graphite plaintext read
 * byte by byte, for every line the fast walk of src/parse.c does not accept. It alone decides
 * errors and their messages; the fast walk only has to be right about the lines it accepts.
 *
 * Runs on the ingest thread, once per line that needs it; each listener owns its struct
 * bd_parser, so nothing here is shared between threads. Views point into the caller's line;
 * text that has to differ from the input (names and strings that carried escapes, a series key
 * whose tags arrived unsorted, the rare float that needs strtod) is written into the parser's
 * scratch buffer, from its beginning again on each line. Calls nothing above it.
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
#include "parse_general.h"
#include "parse_int.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"

const char bd_parse_err_open_string[] = "unterminated string";

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

enum num_rc parse_general_f64(const char *s, size_t n, bool plus_ok, char *tmp, double *out) {
#if FLT_EVAL_METHOD == 0
    if (read_f64_short(s, n, out)) {
        return NUM_OK;
    }
#endif
    return read_f64_any(s, n, plus_ok, tmp, out);
}

/* ---------------------------------------------------------------------------------------- */
/* Points                                                                                   */

/*
 * Sorts the tags by key (insertion sort: there are few, and senders mostly sort them already)
 * and rejects a repeated key. raw moves along with the tags. in_order says every key was
 * already greater than the one before it: then they are sorted and distinct, nothing to do.
 */
int parse_general_sort_tags(struct bd_point *pt, struct raw_span *raw, bool in_order,
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
struct bd_str parse_general_series_key(struct scratch *sc, const char *name, size_t name_len,
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
__attribute__((noinline)) struct bd_field *parse_general_field_find(struct bd_point *pt,
                                                                    struct bd_str key) {
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        if (str_eq(pt->fields[i].key, key)) {
            return &pt->fields[i];
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* InfluxDB line protocol                                                                   */

/* A boolean or number field value, v[0, len) up to its separator; 0 or a bd_parse_status. */
int parse_general_scalar(struct scratch *sc, const char *v, size_t len, struct bd_field *f,
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
        rc = parse_general_f64(v, len, false, sc->buf + sc->used, &f->v.f);
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
    return parse_general_scalar(sc, s + start, i - start, f, errmsg);
}

/* A timestamp token in the listener's precision into pt; 0 or a bd_parse_status. */
int parse_general_influx_time(const struct bd_parser *p, const char *s, size_t n,
                              struct bd_point *pt, const char **errmsg) {
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
        int rc = parse_general_influx_time(p, s + ts, i - ts, pt, errmsg);
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

    int rc = parse_general_sort_tags(pt, raw, in_order, errmsg);
    if (rc < 0) {
        return rc;
    }
    pt->series_key = parse_general_series_key(&sc, name, name_len, raw, pt->n_tags, ',', in_order);
    return BD_PARSE_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Graphite plaintext                                                                       */

const char parse_general_graphite_key[sizeof(PARSE_GRAPHITE_KEY)] = PARSE_GRAPHITE_KEY;

static bool graphite_space(char c) {
    return c == ' ' || c == '\t';
}

/*
 * Seconds since the epoch, [-]digits[.digits], to nanoseconds. Digits past the ninth decimal
 * are below a nanosecond and ignored. -1 is the conventional "no timestamp".
 */
enum num_rc parse_general_graphite_time(const char *s, size_t n, bool *has, int64_t *ns) {
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
    f->key = (struct bd_str){parse_general_graphite_key, sizeof(parse_general_graphite_key) - 1};
    f->kind = BD_VAL_FLOAT;
    BD_ASSERT(i - vs + 1 <= sc.cap - sc.used);
    enum num_rc rc = parse_general_f64(s + vs, i - vs, true, sc.buf + sc.used, &f->v.f);
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
        rc = parse_general_graphite_time(s + ts, i - ts, &pt->has_time, &pt->time_ns);
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

    int rc2 = parse_general_sort_tags(pt, raw, in_order, errmsg);
    if (rc2 < 0) {
        return rc2;
    }
    pt->series_key =
        parse_general_series_key(&sc, s + ps, name_end - ps, raw, pt->n_tags, ';', in_order);
    return BD_PARSE_OK;
}

/* The general parser, for one line (without its '\n'). */
int parse_general_line(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
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

int bd_parse_line_general(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                          const char **errmsg) {
    return parse_general_line(p, line, len, pt, errmsg);
}
