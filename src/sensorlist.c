/*
 * GET /sensors (include/bucketd/sensorlist.h): query parsing, the paging cursor and the JSON
 * answer. Pure functions over their arguments; any thread (the metrics module calls them on
 * the ingest thread's loop). Allocates nothing but the response body it appends to.
 */
#include "bucketd/sensorlist.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "bucketd/escape.h"
#include "bucketd/units.h"

/* A decoded parameter value longer than this is refused (a cursor is about 40 bytes). */
#define VALUE_MAX 64
/* What a message quotes of the request, at most (escaped). */
#define QUOTE_MAX 40

/* Percent-decode s[0..len) into out (cap bytes, NUL-terminated); '+' is a space as in forms.
 * -EINVAL: a bad escape or a NUL; -E2BIG: longer than cap - 1. */
static int decode(const char *s, size_t len, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (c == '%') {
            int hi = i + 2 < len ? bd_hex_value(s[i + 1]) : -1;
            int lo = i + 2 < len ? bd_hex_value(s[i + 2]) : -1;
            if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) {
                return -EINVAL;
            }
            c = (char)(hi << 4 | lo);
            i += 2;
        } else if (c == '+') {
            c = ' ';
        }
        if (o + 1 >= cap) {
            return -E2BIG;
        }
        out[o++] = c;
    }
    out[o] = '\0';
    return 0;
}

/* Quote untrusted request text in a message: escaped and cut. */
static const char *quote(const char *s, size_t len, char *buf, size_t cap) {
    size_t used = bd_escape(buf, cap, s, BD_MIN(len, (size_t)QUOTE_MAX), 0);
    if (used < len && strlen(buf) + 4 < cap) {
        strcat(buf, "...");
    }
    return buf;
}

int bd_sensorlist_parse_query(const char *q, size_t len, struct bd_sensorlist_query *out, char *why,
                              size_t cap) {
    memset(out, 0, sizeof(*out));
    out->limit = BD_SENSORLIST_LIMIT_DEFAULT;
    bool have_limit = false;
    char qb[BD_ESCAPE_CAP(QUOTE_MAX) + 4];
    size_t i = 0;
    while (i < len) {
        const char *amp = memchr(q + i, '&', len - i);
        size_t end = amp != NULL ? (size_t)(amp - q) : len;
        const char *p = q + i;
        size_t plen = end - i;
        i = end + 1;
        if (plen == 0) {
            continue; /* "a=1&&b=2" */
        }
        const char *eq = memchr(p, '=', plen);
        size_t klen = eq != NULL ? (size_t)(eq - p) : plen;
        const char *v = eq != NULL ? eq + 1 : p + plen;
        size_t vlen = plen - klen - (eq != NULL);
        char key[16], val[VALUE_MAX + 1];
        int rc = decode(p, klen, key, sizeof(key));
        if (rc < 0 || (strcmp(key, "silent") != 0 && strcmp(key, "limit") != 0 &&
                       strcmp(key, "after") != 0)) {
            snprintf(why, cap, "unknown query parameter \"%s\" (silent, limit or after)",
                     quote(p, klen, qb, sizeof(qb)));
            return -EINVAL;
        }
        bool *seen = key[0] == 's' ? &out->silent : key[0] == 'l' ? &have_limit : &out->after;
        if (*seen) {
            snprintf(why, cap, "%s: given twice", key);
            return -EINVAL;
        }
        *seen = true;
        rc = decode(v, vlen, val, sizeof(val));
        if (rc == 0 && val[0] == '\0') {
            snprintf(why, cap, "%s: empty value", key);
            return -EINVAL;
        }
        if (rc < 0) {
            snprintf(why, cap, "%s: \"%s\" is %s", key, quote(v, vlen, qb, sizeof(qb)),
                     rc == -E2BIG ? "too long" : "not percent-encoded correctly");
            return -EINVAL;
        }
        if (key[0] == 's') {
            if (bd_parse_duration_ms(val, &out->silent_ms) < 0 ||
                out->silent_ms > (uint64_t)INT64_MAX / BD_NS_PER_MS) {
                snprintf(why, cap,
                         "silent: \"%s\" is not a duration (a whole number and a unit: 500ms, "
                         "90s, 15m, 2h)",
                         quote(val, strlen(val), qb, sizeof(qb)));
                return -EINVAL;
            }
        } else if (key[0] == 'l') {
            uint64_t n = 0;
            if (bd_units_parse_uint(val, &n) < 0 || n < 1 || n > BD_SENSORLIST_LIMIT_MAX) {
                snprintf(why, cap, "limit: \"%s\" is not a whole number from 1 to %d",
                         quote(val, strlen(val), qb, sizeof(qb)), BD_SENSORLIST_LIMIT_MAX);
                return -EINVAL;
            }
            out->limit = (uint32_t)n;
        } else if (bd_sensorlist_cursor_parse(val, strlen(val), &out->after_pos) < 0) {
            snprintf(why, cap, "after: \"%s\" is not a cursor (the \"next\" of a previous page)",
                     quote(val, strlen(val), qb, sizeof(qb)));
            return -EINVAL;
        }
    }
    return 0;
}

void bd_sensorlist_cursor_format(const struct bd_sensor_pos *pos, char *buf, size_t cap) {
    snprintf(buf, cap, "%" PRId64 "-%" PRIu64, pos->last_ns, pos->serial);
}

int bd_sensorlist_cursor_parse(const char *s, size_t len, struct bd_sensor_pos *out) {
    const char *dash = memchr(s, '-', len);
    char a[24], b[24];
    if (dash == NULL || dash == s || (size_t)(dash - s) >= sizeof(a) ||
        len - (size_t)(dash - s) - 1 >= sizeof(b)) {
        return -EINVAL;
    }
    memcpy(a, s, (size_t)(dash - s));
    a[dash - s] = '\0';
    memcpy(b, dash + 1, len - (size_t)(dash - s) - 1);
    b[len - (size_t)(dash - s) - 1] = '\0';
    uint64_t ns = 0, serial = 0;
    if (bd_units_parse_uint(a, &ns) < 0 || ns > (uint64_t)INT64_MAX ||
        bd_units_parse_uint(b, &serial) < 0) {
        return -EINVAL;
    }
    out->last_ns = (int64_t)ns;
    out->serial = serial;
    return 0;
}

void bd_sensorlist_format_time(int64_t ns, char *buf, size_t cap) {
    int64_t ms = ns >= 0 ? ns / BD_NS_PER_MS : -((-ns + BD_NS_PER_MS - 1) / BD_NS_PER_MS);
    int64_t sec = ms >= 0 ? ms / 1000 : -((-ms + 999) / 1000);
    time_t t = (time_t)sec;
    struct tm tm;
    if (gmtime_r(&t, &tm) == NULL) {
        snprintf(buf, cap, "1970-01-01T00:00:00.000Z");
        return;
    }
    snprintf(buf, cap, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(ms - sec * 1000));
}

/* A JSON string of untrusted text, in pieces so that any length needs no buffer of its size. */
static void json_text(struct bd_http_response *out, const char *s, size_t len) {
    char buf[1024];
    bd_http_body_append(out, "\"", 1);
    size_t i = 0;
    while (i < len && !out->oom) {
        size_t used = bd_escape_json_string(buf, sizeof(buf), s + i, len - i);
        bd_http_body_append(out, buf, strlen(buf));
        i += used;
    }
    bd_http_body_append(out, "\"", 1);
}

void bd_sensorlist_render(const struct bd_sensor_info *v, uint32_t n, bool more,
                          struct bd_http_response *out) {
    out->status = 200;
    out->content_type = "application/json";
    static const char head[] = "{\"sensors\":[";
    bd_http_body_append(out, head, sizeof(head) - 1);
    uint32_t i = 0;
    for (; i < n && !out->oom; i++) {
        if (i > 0 && out->len >= BD_SENSORLIST_BODY_MAX) {
            more = true;
            break;
        }
        char when[BD_SENSORLIST_TIME_CAP];
        bd_sensorlist_format_time(v[i].pos.last_ns, when, sizeof(when));
        const char *open = i > 0 ? ",{\"sensor_id\":" : "{\"sensor_id\":";
        bd_http_body_append(out, open, strlen(open));
        json_text(out, bd_sensor_id(v[i].s), v[i].s->id_len);
        bd_http_body_printf(out, ",\"last_seen\":\"%s\",\"readings_accepted\":%" PRIu64 "}", when,
                            v[i].accepted);
    }
    if (more && i > 0) {
        char cursor[BD_SENSORLIST_CURSOR_CAP];
        bd_sensorlist_cursor_format(&v[i - 1].pos, cursor, sizeof(cursor));
        bd_http_body_printf(out, "],\"next\":\"%s\"}\n", cursor);
    } else {
        static const char tail[] = "],\"next\":null}\n";
        bd_http_body_append(out, tail, sizeof(tail) - 1);
    }
}

void bd_sensorlist_render_error(const char *why, struct bd_http_response *out) {
    out->status = 400;
    out->content_type = "application/json";
    static const char head[] = "{\"error\":";
    bd_http_body_append(out, head, sizeof(head) - 1);
    json_text(out, why, strlen(why));
    bd_http_body_append(out, "}\n", 2);
}
