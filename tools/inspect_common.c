/*
 * bucketd-inspect's shared helpers (declared in tools/inspect.h): printing text from the
 * documents so that it cannot drive the terminal, stored numbers compared and formatted as
 * MongoDB and the daemon treat them, times read and written (RFC 3339, Unix seconds), BSON
 * type names for messages, and the MongoDB connection, opened exactly as the daemon connects.
 *
 * Single-threaded; nothing here keeps state between calls.
 */
#include "inspect.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/bucket.h"
#include "bucketd/escape.h"
#include "bucketd/mongo.h"
#include "bucketd/units.h"

/*
 * Text from the documents (ids, names, values in messages) was sent by anyone who could reach
 * the daemon: printed through bd_escape, so that it cannot move the cursor, recolour the
 * terminal, start a new line or reverse the text around it.
 */
void inspect_put_safe(const char *s) {
    char buf[BD_ESCAPE_CAP(1024)];
    size_t len = strlen(s);
    while (len > 0) {
        size_t used = bd_escape(buf, sizeof(buf), s, BD_MIN(len, (size_t)1024), BD_ESC_KEEP_QUOTES);
        fputs(buf, stdout);
        s += used;
        len -= used;
    }
}

/* JSON as libbson writes it, with the characters JSON allows raw but a terminal acts on
 * (C1 controls, bidi overrides) written as \u escapes: the same JSON value, safe to print. */
void inspect_put_json(const char *s) {
    char buf[BD_ESCAPE_CAP(1024)];
    size_t len = strlen(s);
    while (len > 0) {
        size_t used = bd_escape_json(buf, sizeof(buf), s, BD_MIN(len, (size_t)1024));
        fputs(buf, stdout);
        s += used;
        len -= used;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Numbers, times and type names                                                            */

bool inspect_num_get(const bson_iter_t *it, struct num *out) {
    switch (bson_iter_type(it)) {
    case BSON_TYPE_DOUBLE:
        out->is_int = false;
        out->v.f = bson_iter_double(it);
        return true;
    case BSON_TYPE_INT32:
        out->is_int = true;
        out->v.i = bson_iter_int32(it);
        return true;
    case BSON_TYPE_INT64:
        out->is_int = true;
        out->v.i = bson_iter_int64(it);
        return true;
    default:
        return false;
    }
}

double inspect_num_as_double(const struct num *n) {
    return n->is_int ? (double)n->v.i : n->v.f;
}

/*
 * -1, 0 or 1 as MongoDB compares numbers; 2 when a NaN makes them unordered. Mixed kinds go
 * through long double, which holds every int64 exactly (64-bit mantissa on x86-64, binary128
 * on aarch64), so 2^53 + 1 and 2^53 stay apart.
 */
int inspect_num_cmp(const struct num *a, const struct num *b) {
    if (a->is_int && b->is_int) {
        return (a->v.i > b->v.i) - (a->v.i < b->v.i);
    }
    long double x = a->is_int ? (long double)a->v.i : (long double)a->v.f;
    long double y = b->is_int ? (long double)b->v.i : (long double)b->v.f;
    if (x < y) {
        return -1;
    }
    if (x > y) {
        return 1;
    }
    return x == y ? 0 : 2;
}

/* The shortest of 15, 16 or 17 significant digits that reads back as the same double. */
void inspect_fmt_double(double v, char *buf, size_t cap) {
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (!isfinite(v) || strtod(buf, NULL) == v) {
            break;
        }
    }
}

void inspect_fmt_num(const struct num *n, char *buf, size_t cap) {
    if (n->is_int) {
        snprintf(buf, cap, "%" PRId64, n->v.i);
    } else {
        inspect_fmt_double(n->v.f, buf, cap);
    }
}

/* RFC 3339 in UTC, with milliseconds only when there are some. */
void inspect_fmt_time(int64_t ms, char *buf, size_t cap) {
    int64_t s = bd_floor_div(ms, 1000);
    int frac = (int)(ms - s * 1000);
    time_t t = (time_t)s;
    struct tm tm;
    size_t n = 0;
    if (gmtime_r(&t, &tm) != NULL) {
        n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    }
    if (n == 0) {
        snprintf(buf, cap, "%" PRId64 " ms", ms);
        return;
    }
    if (frac != 0) {
        snprintf(buf + n, cap - n, ".%03dZ", frac);
    } else {
        snprintf(buf + n, cap - n, "Z");
    }
}

/* Days since 1970-01-01 of a proleptic Gregorian date (no time_t range or TZ involved). */
static int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
    y -= m <= 2;
    int64_t era = bd_floor_div(y, 400);
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static bool read_digits(const char **p, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        char c = (*p)[i];
        if (c < '0' || c > '9') {
            return false;
        }
        v = v * 10 + (c - '0');
    }
    *p += n;
    *out = v;
    return true;
}

/*
 * Unix seconds ("1736949600") or RFC 3339 ("2025-01-15T14:00:00Z", with optional fraction and
 * a Z or +hh:mm offset). Fractions finer than a millisecond are truncated, as BSON dates are.
 */
int inspect_parse_time(const char *s, int64_t *out_ms) {
    int64_t secs = 0;
    if (bd_units_parse_int(s, &secs) == 0) {
        if (secs > INT64_MAX / 1000 || secs < INT64_MIN / 1000) {
            return -ERANGE;
        }
        *out_ms = secs * 1000;
        return 0;
    }
    static const int mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    const char *p = s;
    int y, mo, d, h, mi, sec, ms = 0, off_min = 0;
    if (!read_digits(&p, 4, &y) || *p++ != '-' || !read_digits(&p, 2, &mo) || *p++ != '-' ||
        !read_digits(&p, 2, &d) || (*p != 'T' && *p != 't' && *p != ' ')) {
        return -EINVAL;
    }
    p++;
    if (!read_digits(&p, 2, &h) || *p++ != ':' || !read_digits(&p, 2, &mi) || *p++ != ':' ||
        !read_digits(&p, 2, &sec)) {
        return -EINVAL;
    }
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9') {
            return -EINVAL;
        }
        for (int scale = 100; *p >= '0' && *p <= '9'; p++, scale /= 10) {
            ms += (*p - '0') * scale;
        }
    }
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int sign = *p++ == '-' ? -1 : 1;
        int oh, om;
        if (!read_digits(&p, 2, &oh) || *p++ != ':' || !read_digits(&p, 2, &om) || oh > 23 ||
            om > 59) {
            return -EINVAL;
        }
        off_min = sign * (oh * 60 + om);
    } else {
        return -EINVAL;
    }
    bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    if (*p != '\0' || mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1] ||
        (mo == 2 && d == 29 && !leap) || h > 23 || mi > 59 || sec > 60) {
        return -EINVAL;
    }
    int64_t t = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec - off_min * 60;
    *out_ms = t * 1000 + ms;
    return 0;
}

const char *inspect_type_name(bson_type_t t) {
    switch (t) {
    case BSON_TYPE_DOUBLE:
        return "double";
    case BSON_TYPE_UTF8:
        return "string";
    case BSON_TYPE_DOCUMENT:
        return "document";
    case BSON_TYPE_ARRAY:
        return "array";
    case BSON_TYPE_BINARY:
        return "binary";
    case BSON_TYPE_OID:
        return "objectId";
    case BSON_TYPE_BOOL:
        return "bool";
    case BSON_TYPE_DATE_TIME:
        return "date";
    case BSON_TYPE_NULL:
        return "null";
    case BSON_TYPE_INT32:
        return "int32";
    case BSON_TYPE_TIMESTAMP:
        return "timestamp";
    case BSON_TYPE_INT64:
        return "int64";
    case BSON_TYPE_DECIMAL128:
        return "decimal128";
    default:
        return "another BSON type";
    }
}

bool inspect_type_in(bson_type_t t, uint32_t mask) {
    return (unsigned)t < 32 && (mask & T_BIT(t)) != 0;
}

/* A value as relaxed extended JSON (malloc'd), for messages; NULL on OOM. */
char *inspect_value_json(const bson_iter_t *it) {
    bson_t tmp = BSON_INITIALIZER;
    char *json = NULL;
    if (bson_append_iter(&tmp, "v", 1, it)) {
        char *doc = bson_as_relaxed_extended_json(&tmp, NULL);
        /* The document reads '{ "v" : VALUE }': keep VALUE. */
        if (doc != NULL && strlen(doc) > 10) {
            size_t len = strlen(doc) - 10;
            json = bson_malloc(len + 1);
            memcpy(json, doc + 8, len);
            json[len] = '\0';
        }
        bson_free(doc);
    }
    bson_destroy(&tmp);
    return json;
}

/* ---------------------------------------------------------------------------------------- */
/* Arrays and the connection                                                                */

int inspect_grow(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) {
        return 0;
    }
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need) {
        n *= 2;
    }
    void *p = realloc(*buf, n * elem);
    if (p == NULL) {
        return -ENOMEM;
    }
    *buf = p;
    *cap = n;
    return 0;
}

int inspect_conn_open(struct conn *c, const struct settings *s, struct bd_err *err) {
    bson_error_t berr;
    c->uri = bd_mongo_uri_new(s->uri, err);
    if (c->uri == NULL) {
        return -EINVAL;
    }
    c->client = mongoc_client_new_from_uri_with_error(c->uri, &berr);
    if (c->client == NULL) {
        return bd_err_set(err, -EINVAL, "mongodb.uri: %s", berr.message);
    }
    mongoc_client_set_error_api(c->client, MONGOC_ERROR_API_VERSION_2);
    /* Setting it over one from the URI would only log a driver error. */
    if (mongoc_uri_get_appname(c->uri) == NULL) {
        mongoc_client_set_appname(c->client, "bucketd-inspect");
    }
    c->coll = mongoc_client_get_collection(c->client, s->database, s->collection);
    return 0;
}

void inspect_conn_close(struct conn *c) {
    mongoc_collection_destroy(c->coll);
    mongoc_client_destroy(c->client);
    mongoc_uri_destroy(c->uri);
}

/* After mongoc_cursor_next() returned false: 0 at the end, or -EIO with the reason. */
int inspect_cursor_status(mongoc_cursor_t *cursor, const struct settings *s, struct bd_err *err) {
    bson_error_t berr;
    if (!mongoc_cursor_error(cursor, &berr)) {
        return 0;
    }
    if (berr.domain == MONGOC_ERROR_SERVER_SELECTION || berr.domain == MONGOC_ERROR_STREAM) {
        return bd_err_set(err, -EIO, "cannot reach MongoDB: %s", berr.message);
    }
    return bd_err_set(err, -EIO, "reading %s.%s failed: %s", s->database, s->collection,
                      berr.message);
}
