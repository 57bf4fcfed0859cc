/*
 * /metrics and /healthz rendering (src/metrics.c) over hand-made views, and the HTTP server's
 * response bodies (src/http.c): every counter of stats.h exactly once with HELP and TYPE and
 * its value, the drop reasons as labels, histogram buckets cumulative with _count the +Inf
 * bucket, label value escaping, and each reason of the health verdict.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/http.h"
#include "bucketd/metrics.h"
#include "bucketd/stats.h"

static struct bd_stats stats;

static void view_init(struct bd_metrics_view *v) {
    memset(&stats, 0, sizeof(stats));
    memset(v, 0, sizeof(*v));
    v->stats = &stats;
    v->version = "9.9.9";
    v->sensors = 5;
    v->max_sensors = 100000;
    v->pool_segment_bytes = 1024;
    v->mongodb = true;
    v->spool_max_bytes = 1000000;
    v->spool_high_water_pct = 80;
    v->unhealthy_after_ms = 60000;
    v->start_mono_ns = 1000 * BD_NS_PER_S;
    v->now_mono_ns = 1100 * BD_NS_PER_S;
    v->start_wall_ms = 1700000000000;
}

static char *render(const struct bd_metrics_view *v) {
    struct bd_http_response r = {0};
    bd_metrics_render(v, &r);
    cr_assert(!r.oom);
    cr_assert_not_null(r.body);
    cr_assert_eq(strlen(r.body), r.len);
    return r.body;
}

/* Lines of text equal to line. */
static int count_lines(const char *text, const char *line) {
    int n = 0;
    size_t len = strlen(line);
    for (const char *p = text; *p != '\0';) {
        const char *eol = strchr(p, '\n');
        size_t l = eol != NULL ? (size_t)(eol - p) : strlen(p);
        if (l == len && memcmp(p, line, len) == 0) {
            n++;
        }
        p += l + (eol != NULL);
    }
    return n;
}

/* Lines of text starting with prefix. */
static int count_prefix(const char *text, const char *prefix) {
    int n = 0;
    size_t len = strlen(prefix);
    for (const char *p = text; *p != '\0';) {
        if (strncmp(p, prefix, len) == 0) {
            n++;
        }
        const char *eol = strchr(p, '\n');
        if (eol == NULL) {
            break;
        }
        p = eol + 1;
    }
    return n;
}

static void metric_name(const char *stat, const char *suffix, char *out, size_t cap) {
    if (strncmp(stat, "summary_", 8) == 0) {
        snprintf(out, cap, "bucketd_summaries_%s%s", stat + 8, suffix);
    } else {
        snprintf(out, cap, "bucketd_%s%s", stat, suffix);
    }
}

Test(metrics, every_counter_once_with_help_type_and_value) {
    struct bd_metrics_view v;
    view_init(&v);
    uint64_t k = 1;
#define SET(n, help) atomic_store(&stats.n, 1000 + k++);
    BD_STATS_LIST(SET)
    BD_GAUGES_LIST(SET)
#undef SET
    char *text = render(&v);
    char line[256], name[128];
    k = 1;
    int drops = 0;
#define CHECK_COUNTER(n, help)                                                                     \
    if (strncmp(#n, "drop_", 5) == 0) {                                                            \
        snprintf(line, sizeof(line), "bucketd_dropped_total{reason=\"%s\"} %" PRIu64, #n + 5,      \
                 1000 + k);                                                                        \
        drops++;                                                                                   \
    } else {                                                                                       \
        metric_name(#n, "_total", name, sizeof(name));                                             \
        snprintf(line, sizeof(line), "# HELP %s %s", name, help);                                  \
        cr_assert_eq(count_lines(text, line), 1, "%s", line);                                      \
        snprintf(line, sizeof(line), "# TYPE %s counter", name);                                   \
        cr_assert_eq(count_lines(text, line), 1, "%s", line);                                      \
        snprintf(line, sizeof(line), "%s %" PRIu64, name, 1000 + k);                               \
    }                                                                                              \
    cr_assert_eq(count_lines(text, line), 1, "%s", line);                                          \
    k++;
    BD_STATS_LIST(CHECK_COUNTER)
#undef CHECK_COUNTER
    cr_assert_gt(drops, 5);
    cr_assert_eq(count_lines(text, "# TYPE bucketd_dropped_total counter"), 1);
    cr_assert_eq(count_prefix(text, "bucketd_dropped_total{"), drops);
#define CHECK_GAUGE(n, help)                                                                       \
    if (strcmp(#n, "oldest_pending_age_ms") != 0) {                                                \
        metric_name(#n, "", name, sizeof(name));                                                   \
        snprintf(line, sizeof(line), "# TYPE %s gauge", name);                                     \
        cr_assert_eq(count_lines(text, line), 1, "%s", line);                                      \
        snprintf(line, sizeof(line), "%s %" PRIu64, name, 1000 + k);                               \
        cr_assert_eq(count_lines(text, line), 1, "%s", line);                                      \
    } else {                                                                                       \
        snprintf(line, sizeof(line), "bucketd_oldest_pending_age_seconds %.6f",                    \
                 (double)(1000 + k) / 1000.0);                                                     \
        cr_assert_eq(count_lines(text, line), 1, "%s", line);                                      \
    }                                                                                              \
    k++;
    BD_GAUGES_LIST(CHECK_GAUGE)
#undef CHECK_GAUGE
    cr_assert_eq(count_lines(text, "bucketd_sensors 5"), 1);
    cr_assert_eq(count_lines(text, "bucketd_build_info{version=\"9.9.9\"} 1"), 1);
    free(text);
}

/* Every family has one HELP and one TYPE, and every sample line follows its family's TYPE. */
Test(metrics, families_are_well_formed) {
    struct bd_metrics_view v;
    view_init(&v);
    v.n_listeners = 2;
    v.listeners[0] = (struct bd_metrics_listener){"udp", "0.0.0.0:8089", "influx", false, 0, 2, 0};
    v.listeners[1] = (struct bd_metrics_listener){"tcp", "[::1]:8094", "graphite", true, 3, 0, 5};
    struct bd_http_counters http = {.connections = 7, .rejected = 1};
    http.responses[0] = 6;
    v.http = &http;
    v.clock = true;
    char *text = render(&v);
    char family[128] = "";
    int n_help = 0, n_type = 0;
    for (char *p = text; *p != '\0';) {
        char *eol = strchr(p, '\n');
        cr_assert_not_null(eol, "the text ends with a newline");
        *eol = '\0';
        char name[128];
        if (sscanf(p, "# HELP %127s", name) == 1) {
            n_help++;
            cr_assert_str_neq(name, family, "one HELP per family: %s", name);
            snprintf(family, sizeof(family), "%s", name);
        } else if (sscanf(p, "# TYPE %127s", name) == 1) {
            n_type++;
            cr_assert_str_eq(name, family, "TYPE after HELP: %s", p);
        } else {
            cr_assert_eq(strncmp(p, family, strlen(family)), 0, "sample of its family: %s", p);
        }
        p = eol + 1;
    }
    cr_assert_eq(n_help, n_type);
    cr_assert_gt(n_help, 60);
    free(text);
    text = render(&v);
    cr_assert_eq(
        count_lines(
            text, "bucketd_listener_info{proto=\"tcp\",bind=\"[::1]:8094\",format=\"graphite\"} 1"),
        1);
    cr_assert_eq(
        count_lines(text, "bucketd_listener_connections{proto=\"tcp\",bind=\"[::1]:8094\"} 3"), 1);
    cr_assert_eq(count_prefix(text, "bucketd_listener_connections{proto=\"udp\""), 0);
    /* Refusals per listener: not-allowed senders on both kinds, per-address limit on TCP. */
    cr_assert_eq(count_lines(text, "bucketd_listener_drop_not_allowed_total{proto=\"udp\","
                                   "bind=\"0.0.0.0:8089\"} 2"),
                 1);
    cr_assert_eq(count_lines(text, "bucketd_listener_drop_not_allowed_total{proto=\"tcp\","
                                   "bind=\"[::1]:8094\"} 0"),
                 1);
    cr_assert_eq(count_lines(text, "bucketd_listener_tcp_rejected_per_ip_total{proto=\"tcp\","
                                   "bind=\"[::1]:8094\"} 5"),
                 1);
    cr_assert_eq(count_prefix(text, "bucketd_listener_tcp_rejected_per_ip_total{proto=\"udp\""), 0);
    cr_assert_eq(count_lines(text, "bucketd_http_responses_total{code=\"200\"} 6"), 1);
    cr_assert_eq(count_lines(text, "bucketd_http_connections_rejected_total 1"), 1);
    free(text);
}

Test(metrics, histogram_buckets_are_cumulative) {
    struct bd_metrics_view v;
    view_init(&v);
    /* Latencies in microseconds: 0.5 ms, 1 ms (on the bound), 3 ms, 2 s, 60 s (past the last). */
    uint64_t lat[] = {500, 1000, 3000, 2000000, 60000000};
    for (size_t i = 0; i < BD_ARRAY_LEN(lat); i++) {
        bd_histogram_observe(&stats.bulk_latency, &bd_hist_bulk_latency_us, lat[i]);
    }
    for (int i = 0; i < 10; i++) {
        bd_histogram_observe(&stats.update_readings, &bd_hist_update_readings, 7);
    }
    bd_histogram_observe(&stats.update_readings, &bd_hist_update_readings, 1);
    char *text = render(&v);
    static const char *expect[] = {
        "bucketd_bulk_write_duration_seconds_bucket{le=\"0.001\"} 2",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"0.0025\"} 2",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"0.005\"} 3",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"1\"} 3",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"2.5\"} 4",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"30\"} 4",
        "bucketd_bulk_write_duration_seconds_bucket{le=\"+Inf\"} 5",
        "bucketd_bulk_write_duration_seconds_sum 62.004500",
        "bucketd_bulk_write_duration_seconds_count 5",
        "# TYPE bucketd_bulk_write_duration_seconds histogram",
        "bucketd_update_readings_bucket{le=\"1\"} 1",
        "bucketd_update_readings_bucket{le=\"5\"} 1",
        "bucketd_update_readings_bucket{le=\"10\"} 11",
        "bucketd_update_readings_bucket{le=\"+Inf\"} 11",
        "bucketd_update_readings_sum 71.000000",
        "bucketd_update_readings_count 11",
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(expect); i++) {
        cr_assert_eq(count_lines(text, expect[i]), 1, "%s", expect[i]);
    }
    /* Every bucket is at least the one before it. */
    uint64_t last = 0;
    int buckets = 0;
    for (char *p = strstr(text, "bucketd_bulk_write_duration_seconds_bucket"); p != NULL;
         p = strstr(p + 1, "bucketd_bulk_write_duration_seconds_bucket")) {
        uint64_t n = strtoull(strchr(p, '}') + 2, NULL, 10);
        cr_assert_geq(n, last);
        last = n;
        buckets++;
    }
    cr_assert_eq(buckets, (int)bd_hist_bulk_latency_us.n_bounds + 1);
    free(text);
}

static char *label(const char *value) {
    struct bd_http_response r = {0};
    cr_assert(bd_metrics_append_label_value(&r, value));
    return r.body != NULL ? r.body : strdup("");
}

Test(metrics, label_values_are_escaped) {
    static const char *cases[][2] = {
        {"0.0.0.0:8089", "0.0.0.0:8089"},
        {"a\"b", "a\\\"b"},
        {"back\\slash", "back\\\\slash"},
        {"new\nline", "new\\nline"},
        {"\"\\\n", "\\\"\\\\\\n"},
        {"", ""},
        {"\xc3\xa9t\xc3\xa9", "\xc3\xa9t\xc3\xa9"},
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(cases); i++) {
        char *got = label(cases[i][0]);
        cr_assert_str_eq(got, cases[i][1], "case %zu", i);
        free(got);
    }
    /* In a real scrape: a listener bind with every character that needs it. */
    struct bd_metrics_view v;
    view_init(&v);
    v.n_listeners = 1;
    v.listeners[0] = (struct bd_metrics_listener){"udp", "x\"y\\z\n", "influx", false, 0, 0, 0};
    char *text = render(&v);
    cr_assert_eq(
        count_lines(
            text,
            "bucketd_listener_info{proto=\"udp\",bind=\"x\\\"y\\\\z\\n\",format=\"influx\"} 1"),
        1);
    free(text);
}

static char *health(const struct bd_metrics_view *v, int *status) {
    struct bd_http_response r = {0};
    bd_health_render(v, &r);
    *status = r.status;
    cr_assert_str_eq(r.content_type, "application/json");
    cr_assert_not_null(r.body);
    /* One line. */
    cr_assert_eq(strchr(r.body, '\n'), r.body + r.len - 1);
    return r.body;
}

Test(health, healthy_then_each_reason) {
    struct bd_metrics_view v;
    view_init(&v);
    int status = 0;
    char *body = health(&v, &status);
    cr_assert_eq(status, 200);
    cr_assert(strstr(body, "\"status\":\"ok\",\"reasons\":[]") != NULL, "%s", body);
    cr_assert(strstr(body, "\"mongodb_reachable\":true") != NULL, "%s", body);
    cr_assert(strstr(body, "\"seconds_since_last_write\":null") != NULL, "%s", body);
    free(body);

    /* A write 2 s ago; MongoDB unreachable for 30 s: not yet past unhealthy_after (60 s). */
    atomic_store(&stats.mongodb_ok_mono_ns, v.now_mono_ns - 2 * BD_NS_PER_S);
    atomic_store(&stats.mongodb_down_mono_ns, v.now_mono_ns - 30 * BD_NS_PER_S);
    body = health(&v, &status);
    cr_assert_eq(status, 200, "%s", body);
    cr_assert(strstr(body, "\"mongodb_reachable\":false") != NULL, "%s", body);
    cr_assert(strstr(body, "\"seconds_since_last_write\":2.000") != NULL, "%s", body);
    free(body);

    /* 61 s: unhealthy. */
    atomic_store(&stats.mongodb_down_mono_ns, v.now_mono_ns - 61 * BD_NS_PER_S);
    body = health(&v, &status);
    cr_assert_eq(status, 503, "%s", body);
    cr_assert(
        strstr(body, "\"status\":\"unhealthy\",\"reasons\":[\"MongoDB unreachable for 61 s") !=
            NULL,
        "%s", body);
    free(body);
    struct bd_health h;
    bd_health_eval(&v, &h);
    cr_assert(!h.healthy);
    cr_assert_eq(h.n_reasons, 1);
    char *text = render(&v);
    cr_assert_eq(count_lines(text, "bucketd_healthy 0"), 1);
    cr_assert_eq(count_lines(text, "bucketd_mongodb_reachable 0"), 1);
    cr_assert_eq(count_lines(text, "bucketd_mongodb_unreachable_seconds 61.000000"), 1);
    free(text);

    /* Reachable again; the spool past 80% of 1000000 bytes; a corrupt record. */
    atomic_store(&stats.mongodb_down_mono_ns, 0);
    atomic_store(&stats.spool_bytes, 800000);
    bd_health_eval(&v, &h);
    cr_assert(h.healthy, "at the mark is not past it");
    atomic_store(&stats.spool_bytes, 800001);
    bd_health_eval(&v, &h);
    cr_assert(h.healthy, "past the mark, but every record was replayed");
    atomic_store(&stats.spool_readings, 10);
    atomic_store(&stats.spool_corrupt_records, 2);
    body = health(&v, &status);
    cr_assert_eq(status, 503, "%s", body);
    cr_assert(strstr(body, "past its high-water mark of 800000 bytes") != NULL, "%s", body);
    cr_assert(strstr(body, "2 corrupt spool records found") != NULL, "%s", body);
    free(body);
    bd_health_eval(&v, &h);
    cr_assert_eq(h.n_reasons, 2);
}

/* The clock's state: gauges in /metrics, the state in /healthz, never a failure by itself. */
Test(health, clock_state_is_shown_not_a_failure) {
    struct bd_metrics_view v;
    view_init(&v);
    int status = 0;
    char *text = render(&v);
    cr_assert_eq(count_prefix(text, "bucketd_clock_"), 0, "no clock: nothing exported");
    free(text);
    char *body = health(&v, &status);
    cr_assert_null(strstr(body, "clock"), "%s", body);
    free(body);

    v.clock = true;
    v.clock_state = BD_CLOCK_WAITING;
    v.clock_synchronized = false;
    v.clock_steps = 0;
    text = render(&v);
    cr_assert_eq(count_lines(text, "# TYPE bucketd_clock_synchronized gauge"), 1, "%s", text);
    cr_assert_eq(count_lines(text, "bucketd_clock_synchronized 0"), 1);
    cr_assert_eq(count_lines(text, "bucketd_clock_trusted 0"), 1);
    cr_assert_eq(count_lines(text, "# TYPE bucketd_clock_steps_total counter"), 1);
    cr_assert_eq(count_lines(text, "bucketd_clock_steps_total 0"), 1);
    cr_assert_eq(count_lines(text, "bucketd_healthy 1"), 1);
    free(text);
    body = health(&v, &status);
    cr_assert_eq(status, 200, "%s", body);
    cr_assert_not_null(strstr(body, "\"clock\":\"waiting\",\"clock_synchronized\":false"), "%s",
                       body);
    free(body);

    v.clock_state = BD_CLOCK_TIMED_OUT;
    v.clock_steps = 2;
    text = render(&v);
    cr_assert_eq(count_lines(text, "bucketd_clock_synchronized 0"), 1);
    cr_assert_eq(count_lines(text, "bucketd_clock_trusted 1"), 1);
    cr_assert_eq(count_lines(text, "bucketd_clock_steps_total 2"), 1);
    free(text);
    body = health(&v, &status);
    cr_assert_not_null(strstr(body, "\"clock\":\"timeout\",\"clock_synchronized\":false"), "%s",
                       body);
    free(body);

    v.clock_state = BD_CLOCK_SYNCED;
    v.clock_synchronized = true;
    text = render(&v);
    cr_assert_eq(count_lines(text, "bucketd_clock_synchronized 1"), 1);
    cr_assert_eq(count_lines(text, "bucketd_clock_trusted 1"), 1);
    free(text);
    body = health(&v, &status);
    cr_assert_not_null(strstr(body, "\"clock\":\"synchronized\",\"clock_synchronized\":true"), "%s",
                       body);
    free(body);
}

Test(health, blackhole_sink_has_no_mongodb_reasons) {
    struct bd_metrics_view v;
    view_init(&v);
    v.mongodb = false;
    atomic_store(&stats.mongodb_down_mono_ns, 1);
    atomic_store(&stats.spool_bytes, 999999999);
    int status = 0;
    char *body = health(&v, &status);
    cr_assert_eq(status, 200, "%s", body);
    cr_assert_null(strstr(body, "mongodb"), "%s", body);
    free(body);
    char *text = render(&v);
    cr_assert_eq(count_prefix(text, "bucketd_mongodb_"), 0);
    cr_assert_eq(count_lines(text, "bucketd_healthy 1"), 1);
    free(text);
}

Test(http, body_printf_grows) {
    struct bd_http_response r = {0};
    for (int i = 0; i < 5000; i++) {
        cr_assert(bd_http_body_printf(&r, "line %d %s\n", i, "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"));
    }
    cr_assert_eq(strlen(r.body), r.len);
    cr_assert(strncmp(r.body + r.len - 43, "line 4999 ", 10) == 0, "%s", r.body + r.len - 43);
    free(r.body);
}
