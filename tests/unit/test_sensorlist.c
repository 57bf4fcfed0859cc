/*
 * GET /sensors' pure parts (src/sensorlist.c): the query, the cursor, the time format and the
 * JSON page, checked against hand-built sensors.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/sensorlist.h"

static struct bd_sensorlist_query q;
static char why[256];

static int parse(const char *s) {
    why[0] = '\0';
    return bd_sensorlist_parse_query(s, strlen(s), &q, why, sizeof(why));
}

Test(sensorlist, no_query_means_every_sensor_from_the_start) {
    cr_assert_eq(parse(""), 0);
    cr_assert_not(q.silent);
    cr_assert_not(q.after);
    cr_assert_eq(q.limit, BD_SENSORLIST_LIMIT_DEFAULT);
}

Test(sensorlist, silent_limit_and_after) {
    cr_assert_eq(parse("silent=15m&limit=7&after=1795922184469433076-12"), 0, "%s", why);
    cr_assert(q.silent);
    cr_assert_eq(q.silent_ms, 15 * 60 * 1000);
    cr_assert_eq(q.limit, 7);
    cr_assert(q.after);
    cr_assert_eq(q.after_pos.last_ns, INT64_C(1795922184469433076));
    cr_assert_eq(q.after_pos.serial, 12);
    /* Percent-encoding and empty pieces are fine. */
    cr_assert_eq(parse("%73ilent=1%73&&limit=1000&"), 0, "%s", why);
    cr_assert_eq(q.silent_ms, 1000);
    cr_assert_eq(q.limit, BD_SENSORLIST_LIMIT_MAX);
    cr_assert_eq(parse("silent=0"), 0, "%s", why);
    cr_assert_eq(q.silent_ms, 0);
}

Test(sensorlist, bad_queries_say_why) {
    static const struct {
        const char *query, *why;
    } bad[] = {
        {"limit=0", "limit: \"0\" is not a whole number from 1 to 1000"},
        {"limit=1001", "limit: \"1001\" is not a whole number from 1 to 1000"},
        {"limit=-1", "limit: \"-1\" is not a whole number from 1 to 1000"},
        {"limit=99999999999999999999999", "is not a whole number"},
        {"limit=", "limit: empty value"},
        {"limit", "limit: empty value"},
        {"silent=5", "silent: \"5\" is not a duration"},
        {"silent=1.5s", "silent: \"1.5s\" is not a duration"},
        {"silent=1s&silent=2s", "silent: given twice"},
        {"after=abc", "after: \"abc\" is not a cursor"},
        {"after=1-", "is not a cursor"},
        {"after=-1", "is not a cursor"},
        {"after=1-2-3", "is not a cursor"},
        {"after=99999999999999999999-1", "is not a cursor"},
        {"sort=name", "unknown query parameter \"sort\" (silent, limit or after)"},
        {"silent=%zz", "silent: \"%zz\" is not percent-encoded correctly"},
        {"silent=%00", "not percent-encoded correctly"},
        {"x%1b[2J=1", "unknown query parameter \"x%1b[2J\""},
        {"%1b[2J=1", "unknown query parameter \"%1b[2J\""},
        {"\x1b[2J=1", "unknown query parameter \"\\x1b[2J\""},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(parse(bad[i].query), -EINVAL, "%s", bad[i].query);
        cr_assert_not_null(strstr(why, bad[i].why), "%s: %s", bad[i].query, why);
    }
}

Test(sensorlist, a_long_value_is_refused_and_quoted_short) {
    char query[300] = "after=";
    memset(query + 6, '7', 200);
    query[206] = '\0';
    cr_assert_eq(parse(query), -EINVAL);
    cr_assert_not_null(strstr(why, "too long"), "%s", why);
    cr_assert_lt(strlen(why), 120, "%s", why);
}

Test(sensorlist, cursor_round_trips) {
    const struct bd_sensor_pos in[] = {{0, 0}, {1, 2}, {INT64_MAX, UINT64_MAX}};
    for (size_t i = 0; i < 3; i++) {
        char buf[BD_SENSORLIST_CURSOR_CAP];
        bd_sensorlist_cursor_format(&in[i], buf, sizeof(buf));
        struct bd_sensor_pos out;
        cr_assert_eq(bd_sensorlist_cursor_parse(buf, strlen(buf), &out), 0, "%s", buf);
        cr_assert_eq(out.last_ns, in[i].last_ns);
        cr_assert_eq(out.serial, in[i].serial);
    }
}

Test(sensorlist, time_is_rfc3339_utc_with_milliseconds) {
    char buf[BD_SENSORLIST_TIME_CAP];
    bd_sensorlist_format_time(INT64_C(1736949600123456789), buf, sizeof(buf));
    cr_assert_str_eq(buf, "2025-01-15T14:00:00.123Z");
    bd_sensorlist_format_time(0, buf, sizeof(buf));
    cr_assert_str_eq(buf, "1970-01-01T00:00:00.000Z");
}

/* A sensor as the table would hand it, with only what the page reads. */
static struct bd_sensor *fake_sensor(const char *id, size_t len) {
    struct bd_sensor *s = aligned_alloc(128, (sizeof(*s) + len + 1 + 127) / 128 * 128);
    cr_assert_not_null(s);
    memset(s, 0, sizeof(*s));
    memcpy(s->id_buf, id, len);
    s->id_buf[len] = '\0';
    s->id_len = (uint32_t)len;
    return s;
}

static void response_free(struct bd_http_response *r) {
    free(r->body);
    memset(r, 0, sizeof(*r));
}

Test(sensorlist, page_json_escapes_ids_and_gives_the_next_cursor) {
    static const char hostile[] = "m,id=a\"b\\c\x01\xc2\x9b";
    struct bd_sensor *a = fake_sensor("m,id=plain", 10);
    struct bd_sensor *b = fake_sensor(hostile, sizeof(hostile) - 1);
    struct bd_sensor_info v[2] = {
        {.s = a, .pos = {INT64_C(1736949600123456789), 4}, .accepted = 3},
        {.s = b, .pos = {INT64_C(1736949601000000000), 9}, .accepted = 1},
    };
    struct bd_http_response r = {0};
    bd_sensorlist_render(v, 2, true, &r);
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.content_type, "application/json");
    cr_assert_str_eq(r.body, "{\"sensors\":[{\"sensor_id\":\"m,id=plain\",\"last_seen\":"
                             "\"2025-01-15T14:00:00.123Z\",\"readings_accepted\":3},"
                             "{\"sensor_id\":\"m,id=a\\\"b\\\\c\\u0001\\u009b\",\"last_seen\":"
                             "\"2025-01-15T14:00:01.000Z\",\"readings_accepted\":1}],"
                             "\"next\":\"1736949601000000000-9\"}\n");
    response_free(&r);
    bd_sensorlist_render(v, 1, false, &r);
    cr_assert_not_null(strstr(r.body, "\"next\":null"));
    response_free(&r);
    bd_sensorlist_render(v, 0, false, &r);
    cr_assert_str_eq(r.body, "{\"sensors\":[],\"next\":null}\n");
    response_free(&r);
    free(a);
    free(b);
}

Test(sensorlist, a_page_of_long_ids_stops_at_the_body_cap) {
    /* 1000 ids of 900 control bytes: 5.4 MB escaped; the page stops past BODY_MAX. */
    char id[900];
    memset(id, 0x02, sizeof(id));
    struct bd_sensor *s = fake_sensor(id, sizeof(id));
    static struct bd_sensor_info v[1000];
    for (uint32_t i = 0; i < 1000; i++) {
        v[i] = (struct bd_sensor_info){.s = s, .pos = {1000 + i, i}, .accepted = 1};
    }
    struct bd_http_response r = {0};
    bd_sensorlist_render(v, 1000, false, &r);
    cr_assert_lt(r.len, BD_SENSORLIST_BODY_MAX + 8000);
    cr_assert_geq(r.len, BD_SENSORLIST_BODY_MAX);
    /* Entries listed: the cursor names the last of them. */
    size_t listed = 0;
    for (const char *p = r.body; (p = strstr(p, "\"sensor_id\"")) != NULL; p++) {
        listed++;
    }
    cr_assert_lt(listed, 1000);
    char want[64];
    snprintf(want, sizeof(want), "\"next\":\"%zu-%zu\"}\n", 1000 + listed - 1, listed - 1);
    cr_assert_not_null(strstr(r.body, want), "%s", r.body + r.len - 60);
    response_free(&r);
    free(s);
}

Test(sensorlist, error_is_json) {
    struct bd_http_response r = {0};
    bd_sensorlist_render_error("limit: \"0\" is not", &r);
    cr_assert_eq(r.status, 400);
    cr_assert_str_eq(r.body, "{\"error\":\"limit: \\\"0\\\" is not\"}\n");
    response_free(&r);
}
