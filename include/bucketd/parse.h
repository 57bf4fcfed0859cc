/*
 * Line parsers: InfluxDB line protocol and Graphite plaintext, one line at a time. Called on
 * the ingest thread per line; never allocates: names that need unescaping, and a series key
 * whose tags arrived unsorted, are written into the parser's scratch buffer; everything else
 * points into the input line. A parsed point is valid until the next call on the same parser
 * and while the line's bytes stay in place.
 */
#ifndef BUCKETD_PARSE_H
#define BUCKETD_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bucketd/config.h"

/*
 * 256, not less: the line-protocol conformance corpus has a valid point with 255 tags, and a
 * struct bd_point is allocated once per listener, so the room costs nothing per line.
 */
#define BD_PARSE_MAX_TAGS 256
#define BD_PARSE_MAX_FIELDS 256

struct bd_str {
    const char *ptr;
    size_t len;
};

enum bd_value_kind { BD_VAL_FLOAT = 0, BD_VAL_INT, BD_VAL_UINT, BD_VAL_BOOL, BD_VAL_STRING };

struct bd_tag {
    struct bd_str key;   /* unescaped */
    struct bd_str value; /* unescaped */
};

struct bd_field {
    struct bd_str key; /* unescaped */
    enum bd_value_kind kind;
    union {
        double f;
        int64_t i;
        uint64_t u;
        bool b;
        struct bd_str s; /* unescaped string value */
    } v;
};

struct bd_point {
    struct bd_str name; /* measurement (influx) or path (graphite), unescaped */
    struct bd_tag tags[BD_PARSE_MAX_TAGS];
    uint32_t n_tags; /* sorted by key (byte order); a repeated key fails the line (corpus) */
    struct bd_field fields[BD_PARSE_MAX_FIELDS];
    uint32_t n_fields; /* input order; a repeated key keeps its first place and last value */
    bool has_time;
    int64_t time_ns; /* valid if has_time; ns, from the listener's precision (Graphite: s) */
    /*
     * Canonical sensor id: influx "measurement,k1=v1,k2=v2" with tags sorted and the line
     * protocol escapes re-applied; graphite "path;k1=v1;k2=v2" with tags sorted.
     */
    struct bd_str series_key;
};

/* Result codes: >= 0 success, < 0 the reason a line is rejected (used as counter names). */
enum bd_parse_status {
    BD_PARSE_OK = 0,
    BD_PARSE_SKIP = 1,              /* blank or comment line: nothing to do */
    BD_PARSE_END = 2,               /* bd_parse_next: the buffer holds no further line */
    BD_PARSE_ESYNTAX = -1,          /* malformed line */
    BD_PARSE_ETOO_MANY_FIELDS = -2, /* more than BD_PARSE_MAX_FIELDS fields */
    BD_PARSE_ETOO_MANY_TAGS = -3,   /* more than BD_PARSE_MAX_TAGS tags */
    BD_PARSE_ERANGE = -4,           /* number or timestamp out of range */
    BD_PARSE_ETOO_LONG = -5,        /* longer than max_line */
};

/*
 * Batch parsing keeps bitmaps of the text it is reading: one bit per byte for the separators
 * (' ', ',', '=' and '\n'), the line ends, and the bytes that keep a line off the fast path.
 * They cover a window of BD_PARSE_WINDOW bytes at a time (see bd_parse_begin).
 */
#define BD_PARSE_WINDOW_WORDS 256
#define BD_PARSE_WINDOW (BD_PARSE_WINDOW_WORDS * 64)

/*
 * Classifies n_words * 64 bytes of text into the three bitmaps (one CPU-specific variant);
 * chars: the format's tag separator, then two more bytes that keep a line off the fast path.
 */
typedef void (*bd_parse_classify_fn)(const char *text, size_t n_words, const char *chars,
                                     uint64_t *sep, uint64_t *nl, uint64_t *odd);

struct bd_parser {
    enum bd_format format;
    enum bd_precision precision;
    char *scratch; /* owned; sized for the longest line the parser accepts */
    size_t scratch_cap;
    size_t max_line;

    /* The batch being read (bd_parse_begin): private to the parser (src/parse*.c). */
    const char *buf;
    size_t len;
    size_t pos;        /* start of the next line */
    size_t base;       /* offset in buf of the window's first byte */
    size_t n_words;    /* bitmap words classified, the end mark's word included */
    uint64_t *masks;   /* owned: sep, nl and odd bitmaps, BD_PARSE_WINDOW_WORDS + 1 words each */
    uint16_t *sep_pos; /* owned: the positions of the sep bits, in order */
    size_t n_seps;
    size_t sep_next; /* the first of them not yet consumed */
    bd_parse_classify_fn classify;
    char chars[3]; /* influx: ',' '"' '\\'; graphite: ';' '!' '^' (see bd_parse_classify_fn) */
    size_t (*flatten)(const uint64_t *map, size_t n_words, uint16_t *out);
    const char *isa;     /* the variant's name: "avx512", "avx2", "sse2" or "swar" */
    size_t window_words; /* BD_PARSE_WINDOW_WORDS, less only in tests */
};

/* max_line bounds the line length accepted (longer lines get BD_PARSE_ESYNTAX). */
int bd_parser_init(struct bd_parser *p, enum bd_format format, enum bd_precision precision,
                   size_t max_line);
void bd_parser_close(struct bd_parser *p);

/*
 * Parse one line (without its '\n'; a trailing '\r' is tolerated). On failure returns a
 * negative bd_parse_status and, if errmsg is not NULL, points it at a static description. It
 * is a batch of one line: a batch in progress on the same parser ends.
 */
int bd_parse_line(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                  const char **errmsg);

/*
 * Batch parsing: the lines of buf[0, len) one after another, as bd_parse_line would parse
 * each, but several times faster: the text is classified 64 bytes at a time (SIMD where the
 * CPU has it) into bitmaps that give line ends and token boundaries without a byte loop and
 * without memchr. buf must stay in place until the last bd_parse_next call on it. A '\n' ends
 * every line (also inside a quoted string: a datagram or stream is split at every newline); the
 * text after the last '\n', if any, is a last line.
 */
void bd_parse_begin(struct bd_parser *p, const char *buf, size_t len);

/*
 * Parses the next line of the batch into pt. Returns BD_PARSE_END when there is none, else what
 * bd_parse_line returns for that line (BD_PARSE_ETOO_LONG for a line over max_line); line (if
 * not NULL) gets the line's text without its '\n'. Empty lines come back as BD_PARSE_SKIP.
 */
int bd_parse_next(struct bd_parser *p, struct bd_point *pt, struct bd_str *line,
                  const char **errmsg);

/* Offset in the batch's buffer where the next line starts (after a bd_parse_next). */
static inline size_t bd_parse_offset(const struct bd_parser *p) {
    return p->pos;
}

/*
 * The message bd_parse_line gives (this very pointer, with BD_PARSE_ESYNTAX) when the line ends
 * inside a quoted string field value. Line protocol lets string values hold raw newlines, so a
 * reader of a stream that wants them may append the '\n' and the next line and parse again.
 */
extern const char bd_parse_err_open_string[];

/* Nanoseconds in one unit of a timestamp precision (1 for ns ... 10^9 for s). */
int64_t bd_parse_unit_ns(enum bd_precision prec);

#endif
