/*
 * The general parser (src/parse_general.c): InfluxDB line protocol and Graphite plaintext, one
 * line at a time, byte by byte. It decides every line the fast walk of src/parse.c does not
 * accept, and every error and its message; the fast walk also borrows its readers for the rare
 * value or timestamp its own do not take. Calls nothing above it. Runs on the thread of the
 * parser it is given (the ingest thread), and keeps no state of its own.
 */
#ifndef BUCKETD_PARSE_GENERAL_H
#define BUCKETD_PARSE_GENERAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/common.h"
#include "bucketd/parse.h"
#include "parse_common.h"

/* The general parser, for one line (without its '\n'): 0 or a bd_parse_status. */
int parse_general_line(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                       const char **errmsg);

/* Graphite's one field key. */
#define PARSE_GRAPHITE_KEY "value"
extern const char parse_general_graphite_key[sizeof(PARSE_GRAPHITE_KEY)];

/* A boolean or number field value, v[0, len) up to its separator; 0 or a bd_parse_status. */
int parse_general_scalar(struct scratch *sc, const char *v, size_t len, struct bd_field *f,
                         const char **errmsg);

/* A line protocol timestamp token in the listener's precision into pt; 0 or a bd_parse_status. */
int parse_general_influx_time(const struct bd_parser *p, const char *s, size_t n,
                              struct bd_point *pt, const char **errmsg);

/*
 * A decimal float as line protocol (and, with plus_ok, Graphite) writes it; tmp has room for
 * n + 1 bytes, for strtod's copy of the rare value that needs it.
 */
enum num_rc parse_general_f64(const char *s, size_t n, bool plus_ok, char *tmp, double *out);

/* A Graphite timestamp (seconds, an optional fraction; -1 is none) into *has and *ns. */
enum num_rc parse_general_graphite_time(const char *s, size_t n, bool *has, int64_t *ns);

/* The raw text of a tag ("key=value" as it arrived), for building the series key. */
struct raw_span {
    const char *ptr;
    size_t len;
};

/*
 * Sorts the tags by key and rejects a repeated key (BD_PARSE_ESYNTAX); raw moves along with
 * the tags. in_order: every key was already greater than the one before it.
 */
int parse_general_sort_tags(struct bd_point *pt, struct raw_span *raw, bool in_order,
                            const char **errmsg);

/* The series key: the name's raw text, then each tag's raw text after sep (see the .c). */
struct bd_str parse_general_series_key(struct scratch *sc, const char *name, size_t name_len,
                                       const struct raw_span *raw, uint32_t n, char sep,
                                       bool in_order);

/* The slot of key if this line stored it already, else NULL (field_slot's slow half). */
struct bd_field *parse_general_field_find(struct bd_point *pt, struct bd_str key);

/*
 * Keys are never empty and nearly always differ in their first byte; past it, short keys
 * (sensor and site: tags sent unsorted) are compared byte by byte inline, where a memcmp call
 * costs more than the few bytes up to the first difference; long ones by memcmp.
 */
static inline int str_cmp(struct bd_str a, struct bd_str b) {
    if (a.len > 0 && b.len > 0 && a.ptr[0] != b.ptr[0]) {
        return (unsigned char)a.ptr[0] - (unsigned char)b.ptr[0];
    }
    size_t n = BD_MIN(a.len, b.len);
    if (n <= 16) {
        for (size_t i = 1; i < n; i++) {
            if (a.ptr[i] != b.ptr[i]) {
                return (unsigned char)a.ptr[i] - (unsigned char)b.ptr[i];
            }
        }
    } else {
        int c = memcmp(a.ptr, b.ptr, n);
        if (c != 0) {
            return c;
        }
    }
    return (a.len > b.len) - (a.len < b.len);
}

static inline bool str_eq(struct bd_str a, struct bd_str b) {
    return a.len == b.len &&
           (a.len == 0 || (a.ptr[0] == b.ptr[0] && memcmp(a.ptr, b.ptr, a.len) == 0));
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
        struct bd_field *f = parse_general_field_find(pt, key);
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

#endif
