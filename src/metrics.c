/*
 * /metrics and /healthz (include/bucketd/metrics.h): the exposition text, the health verdict,
 * and the routes of the HTTP server (http.c) that serve them on the ingest thread's loop.
 *
 * A scrape reads atomics and a few loop-thread fields and formats about 20 KB of text: tens of
 * microseconds, since no series is per sensor (bench row 11a); only bucketd_sensors_silent
 * looks at every sensor, one pass over the index (on this thread, which owns the table):
 * about a millisecond per 60,000 sensors, measured on x86-64; /healthz skips it.
 *
 * /sensors (sensorlist.h) lists the sensors from the table on the same thread: one pass over
 * the index into a page of at most BD_SENSORLIST_LIMIT_MAX entries preallocated here.
 */
#include "bucketd/metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/ingest.h"
#include "bucketd/log.h"
#include "bucketd/pool.h"
#include "bucketd/sensor.h"
#include "bucketd/sensorlist.h"

#define PREFIX "bucketd_"
#define DROP_PREFIX "drop_"

static void append_str(struct bd_http_response *out, const char *s) {
    bd_http_body_append(out, s, strlen(s));
}

static uint64_t load_u64(const _Atomic uint64_t *p) {
    return atomic_load_explicit((_Atomic uint64_t *)p, memory_order_relaxed);
}

static int64_t load_i64(const _Atomic int64_t *p) {
    return atomic_load_explicit((_Atomic int64_t *)p, memory_order_relaxed);
}

/*
 * bucketd_<stat name><suffix>, but summaries_ for summary_: promtool's lint refuses "_summary_"
 * in a name (the name of a metric type), and the feature is "summaries" in the config anyway.
 */
static const char *metric_name(char *buf, size_t cap, const char *stat, const char *suffix) {
    static const char summary[] = "summary_";
    if (strncmp(stat, summary, strlen(summary)) == 0) {
        snprintf(buf, cap, PREFIX "summaries_%s%s", stat + strlen(summary), suffix);
    } else {
        snprintf(buf, cap, PREFIX "%s%s", stat, suffix);
    }
    return buf;
}

/* ---------------------------------------------------------------------------------------- */
/* Exposition helpers                                                                       */

/* HELP text: backslash and newline escaped. */
static void append_help(struct bd_http_response *out, const char *name, const char *help,
                        const char *type) {
    bd_http_body_printf(out, "# HELP %s ", name);
    for (const char *p = help; *p != '\0'; p++) {
        if (*p == '\\') {
            bd_http_body_append(out, "\\\\", 2);
        } else if (*p == '\n') {
            bd_http_body_append(out, "\\n", 2);
        } else {
            bd_http_body_append(out, p, 1);
        }
    }
    bd_http_body_printf(out, "\n# TYPE %s %s\n", name, type);
}

bool bd_metrics_append_label_value(struct bd_http_response *out, const char *value) {
    bool ok = true;
    const char *run = value;
    for (const char *p = value;; p++) {
        const char *esc = *p == '\\' ? "\\\\" : *p == '"' ? "\\\"" : *p == '\n' ? "\\n" : NULL;
        if (esc == NULL && *p != '\0') {
            continue;
        }
        ok &= bd_http_body_append(out, run, (size_t)(p - run));
        if (*p == '\0') {
            break;
        }
        ok &= bd_http_body_append(out, esc, 2);
        run = p + 1;
    }
    return ok;
}

static void metric_u64(struct bd_http_response *out, const char *name, const char *help,
                       const char *type, uint64_t v) {
    append_help(out, name, help, type);
    bd_http_body_printf(out, "%s %" PRIu64 "\n", name, v);
}

static void metric_f(struct bd_http_response *out, const char *name, const char *help,
                     const char *type, double v) {
    append_help(out, name, help, type);
    bd_http_body_printf(out, "%s %.6f\n", name, v);
}

/* name{key="value"} v for one listener. */
static void listener_sample(struct bd_http_response *out, const char *name,
                            const struct bd_metrics_listener *l, bool with_format, uint64_t v) {
    bd_http_body_printf(out, "%s{proto=\"", name);
    bd_metrics_append_label_value(out, l->proto);
    append_str(out, "\",bind=\"");
    bd_metrics_append_label_value(out, l->bind);
    if (with_format) {
        append_str(out, "\",format=\"");
        bd_metrics_append_label_value(out, l->format);
    }
    bd_http_body_printf(out, "\"} %" PRIu64 "\n", v);
}

/* Cumulative buckets, _sum (scaled by 1/divisor) and _count (the +Inf bucket). */
static void histogram(struct bd_http_response *out, const char *name, const char *help,
                      const struct bd_histogram *h, const struct bd_histogram_def *def,
                      double divisor) {
    append_help(out, name, help, "histogram");
    uint64_t cum = 0;
    for (uint32_t i = 0; i <= def->n_bounds; i++) {
        cum += load_u64(&h->bucket[i]);
        if (i < def->n_bounds) {
            bd_http_body_printf(out, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name,
                                (double)def->bounds[i] / divisor, cum);
        } else {
            bd_http_body_printf(out, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, cum);
        }
    }
    double sum = (double)load_u64(&h->sum) / divisor;
    bd_http_body_printf(out, "%s_sum %.6f\n%s_count %" PRIu64 "\n", name, sum, name, cum);
}

/* ---------------------------------------------------------------------------------------- */
/* Health                                                                                   */

static uint64_t spool_high_water_bytes(const struct bd_metrics_view *v) {
    return v->spool_max_bytes / 100 * v->spool_high_water_pct +
           v->spool_max_bytes % 100 * v->spool_high_water_pct / 100;
}

/* Seconds MongoDB has been unreachable (0: reachable, or not asked yet). */
static double unreachable_s(const struct bd_metrics_view *v) {
    int64_t down = load_i64(&v->stats->mongodb_down_mono_ns);
    if (!v->mongodb || down == 0 || v->now_mono_ns < down) {
        return 0;
    }
    return (double)(v->now_mono_ns - down) / (double)BD_NS_PER_S;
}

/* Seconds since the last successful write, or since the start when there was none. */
static double since_write_s(const struct bd_metrics_view *v) {
    int64_t ok = load_i64(&v->stats->mongodb_ok_mono_ns);
    int64_t from = ok != 0 ? ok : v->start_mono_ns;
    return v->now_mono_ns > from ? (double)(v->now_mono_ns - from) / (double)BD_NS_PER_S : 0;
}

void bd_health_eval(const struct bd_metrics_view *v, struct bd_health *out) {
    memset(out, 0, sizeof(*out));
    const struct bd_stats *st = v->stats;
    double down_s = unreachable_s(v);
    if (v->mongodb && load_i64(&st->mongodb_down_mono_ns) != 0 &&
        down_s * 1000.0 > (double)v->unhealthy_after_ms) {
        snprintf(out->reasons[out->n_reasons++], sizeof(out->reasons[0]),
                 "MongoDB unreachable for %.0f s (metrics.unhealthy_after: %" PRIu64 " s)", down_s,
                 v->unhealthy_after_ms / 1000);
    }
    /* Acknowledged records stay in their segment file until it is finished: past the mark
     * only while something waits for its replay (readings, or older segments). */
    uint64_t spool = load_u64(&st->spool_bytes);
    uint64_t mark = spool_high_water_bytes(v);
    bool waiting = load_u64(&st->spool_readings) > 0 || load_u64(&st->spool_segments) > 1;
    if (v->mongodb && spool > mark && waiting) {
        snprintf(out->reasons[out->n_reasons++], sizeof(out->reasons[0]),
                 "spool holds %" PRIu64 " bytes, past its high-water mark of %" PRIu64
                 " bytes (%u%% of spool.max_bytes)",
                 spool, mark, v->spool_high_water_pct);
    }
    uint64_t corrupt = load_u64(&st->spool_corrupt_records);
    if (corrupt > 0) {
        snprintf(out->reasons[out->n_reasons++], sizeof(out->reasons[0]),
                 "%" PRIu64 " corrupt spool records found since the start (skipped; see the log)",
                 corrupt);
    }
    out->healthy = out->n_reasons == 0;
}

/* A JSON string of our own making (no control characters), quotes and backslashes escaped. */
static void json_string(struct bd_http_response *out, const char *s) {
    bd_http_body_append(out, "\"", 1);
    for (const char *p = s; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\') {
            bd_http_body_append(out, "\\", 1);
        }
        bd_http_body_append(out, p, 1);
    }
    bd_http_body_append(out, "\"", 1);
}

void bd_health_render(const struct bd_metrics_view *v, struct bd_http_response *out) {
    struct bd_health h;
    bd_health_eval(v, &h);
    const struct bd_stats *st = v->stats;
    out->status = h.healthy ? 200 : 503;
    out->content_type = "application/json";
    bd_http_body_printf(out, "{\"status\":\"%s\",\"reasons\":[", h.healthy ? "ok" : "unhealthy");
    for (uint32_t i = 0; i < h.n_reasons; i++) {
        if (i > 0) {
            bd_http_body_append(out, ",", 1);
        }
        json_string(out, h.reasons[i]);
    }
    bd_http_body_append(out, "]", 1);
    if (v->mongodb) {
        bool written = load_i64(&st->mongodb_ok_mono_ns) != 0;
        bd_http_body_printf(out, ",\"mongodb_reachable\":%s",
                            load_i64(&st->mongodb_down_mono_ns) == 0 ? "true" : "false");
        if (written) {
            bd_http_body_printf(out, ",\"seconds_since_last_write\":%.3f", since_write_s(v));
        } else {
            append_str(out, ",\"seconds_since_last_write\":null");
        }
        bd_http_body_printf(out, ",\"spool_bytes\":%" PRIu64 ",\"spool_high_water_bytes\":%" PRIu64,
                            load_u64(&st->spool_bytes), spool_high_water_bytes(v));
    }
    if (v->clock) {
        bd_http_body_printf(out, ",\"clock\":\"%s\",\"clock_synchronized\":%s",
                            bd_clock_state_name(v->clock_state),
                            v->clock_synchronized ? "true" : "false");
    }
    bd_http_body_printf(out,
                        ",\"spool_corrupt_records\":%" PRIu64 ",\"pending_readings\":%" PRIu64
                        ",\"oldest_pending_age_seconds\":%.3f}\n",
                        load_u64(&st->spool_corrupt_records), load_u64(&st->pending_readings),
                        (double)load_u64(&st->oldest_pending_age_ms) / 1000.0);
}

/* ---------------------------------------------------------------------------------------- */
/* Exposition                                                                               */

void bd_metrics_render(const struct bd_metrics_view *v, struct bd_http_response *out) {
    const struct bd_stats *st = v->stats;
    char name[96];
    out->content_type = "text/plain; version=0.0.4; charset=utf-8";

    /* Counters: bucketd_<name>_total, the drops apart. */
#define BD_METRICS_COUNTER(n, help)                                                                \
    if (strncmp(#n, DROP_PREFIX, strlen(DROP_PREFIX)) != 0) {                                      \
        metric_u64(out, metric_name(name, sizeof(name), #n, "_total"), help, "counter",            \
                   load_u64(&st->n));                                                              \
    }
    BD_STATS_LIST(BD_METRICS_COUNTER)
#undef BD_METRICS_COUNTER

    append_help(out, PREFIX "dropped_total",
                "lines or readings dropped, by reason (the drop_* counters of the stats line)",
                "counter");
#define BD_METRICS_DROP(n, help)                                                                   \
    if (strncmp(#n, DROP_PREFIX, strlen(DROP_PREFIX)) == 0) {                                      \
        bd_http_body_printf(out, PREFIX "dropped_total{reason=\"%s\"} %" PRIu64 "\n",              \
                            #n + strlen(DROP_PREFIX), load_u64(&st->n));                           \
    }
    BD_STATS_LIST(BD_METRICS_DROP)
#undef BD_METRICS_DROP

    /* Gauges of stats.h: bucketd_<name>; the age in seconds. */
#define BD_METRICS_GAUGE(n, help)                                                                  \
    if (strcmp(#n, "oldest_pending_age_ms") != 0) {                                                \
        metric_u64(out, metric_name(name, sizeof(name), #n, ""), help, "gauge", load_u64(&st->n)); \
    }
    BD_GAUGES_LIST(BD_METRICS_GAUGE)
#undef BD_METRICS_GAUGE
    metric_f(out, PREFIX "oldest_pending_age_seconds",
             "age of the oldest reading accepted and not yet written (acknowledged by MongoDB)",
             "gauge", (double)load_u64(&st->oldest_pending_age_ms) / 1000.0);
    metric_u64(out, PREFIX "pool_segment_bytes", "bytes of one buffer pool segment", "gauge",
               v->pool_segment_bytes);
    metric_u64(out, PREFIX "sensors",
               "sensors tracked now (series seen, less those evicted after limits.sensor_idle)",
               "gauge", v->sensors);
    metric_u64(out, PREFIX "sensors_max", "limits.max_sensors", "gauge", v->max_sensors);
    if (v->silent_after_ms > 0) {
        metric_u64(out, PREFIX "sensors_silent",
                   "sensors tracked whose last reading is older than metrics.silent_after", "gauge",
                   v->sensors_silent);
    }
    metric_u64(out, PREFIX "sensor_memory_bytes",
               "memory charged to the sensors (ids, names, tags, index, page accounting)", "gauge",
               v->sensor_memory);
    metric_u64(out, PREFIX "sensor_memory_max_bytes", "limits.sensor_memory", "gauge",
               v->sensor_memory_max);

    if (v->mongodb) {
        metric_u64(out, PREFIX "spool_max_bytes", "spool.max_bytes", "gauge", v->spool_max_bytes);
        metric_u64(out, PREFIX "spool_high_water_bytes",
                   "spool size past which /healthz answers 503 (metrics.spool_high_water)", "gauge",
                   spool_high_water_bytes(v));
        metric_u64(out, PREFIX "mongodb_reachable",
                   "1 unless the last attempt to reach MongoDB failed (0 since then)", "gauge",
                   load_i64(&st->mongodb_down_mono_ns) == 0);
        metric_f(out, PREFIX "mongodb_unreachable_seconds",
                 "how long MongoDB has been unreachable (0: reachable)", "gauge", unreachable_s(v));
        int64_t ok_wall = load_i64(&st->mongodb_ok_wall_ms);
        metric_f(out, PREFIX "last_successful_write_timestamp_seconds",
                 "Unix time of the last bulk write MongoDB answered (0: none yet)", "gauge",
                 (double)ok_wall / 1000.0);
        metric_f(out, PREFIX "seconds_since_last_successful_write",
                 "seconds since the last bulk write MongoDB answered (since the start if none)",
                 "gauge", since_write_s(v));
    }
    struct bd_health health;
    bd_health_eval(v, &health);
    metric_u64(out, PREFIX "healthy", "1 while /healthz answers 200, 0 while it answers 503",
               "gauge", health.healthy);

    if (v->clock) {
        metric_u64(out, PREFIX "clock_synchronized",
                   "1 while the kernel reports the wall clock synchronised (adjtimex) and it "
                   "reads no earlier than this writer's last acknowledged write or the build time",
                   "gauge", v->clock_synchronized);
        metric_u64(out, PREFIX "clock_trusted",
                   "1 while readings are stamped and judged with the wall clock: synchronised, or "
                   "trusted by timeout after time.wait_for_sync",
                   "gauge", v->clock_state != BD_CLOCK_WAITING);
        metric_u64(out, PREFIX "clock_steps_total",
                   "steps of the wall clock of more than 1 s against the boot-time clock",
                   "counter", v->clock_steps);
    }

    histogram(out, PREFIX "bulk_write_duration_seconds",
              "time a bulk write to MongoDB took, every attempt (from the flusher's call to the "
              "answer)",
              &st->bulk_latency, &bd_hist_bulk_latency_us, 1e6);
    histogram(out, PREFIX "update_readings",
              "readings per bucket update sent (one update per bucket page per flush and attempt)",
              &st->update_readings, &bd_hist_update_readings, 1);

    /* Listeners. */
    append_help(out, PREFIX "listener_info", "one series per listener: its proto, bind and format",
                "gauge");
    for (uint32_t i = 0; i < v->n_listeners; i++) {
        listener_sample(out, PREFIX "listener_info", &v->listeners[i], true, 1);
    }
    append_help(out, PREFIX "listener_connections", "TCP connections open now, per listener",
                "gauge");
    for (uint32_t i = 0; i < v->n_listeners; i++) {
        if (v->listeners[i].tcp) {
            listener_sample(out, PREFIX "listener_connections", &v->listeners[i], false,
                            v->listeners[i].connections);
        }
    }
    append_help(out, PREFIX "listener_drop_not_allowed_total",
                "UDP datagrams or TCP connections dropped, per listener: sender not in its allow",
                "counter");
    for (uint32_t i = 0; i < v->n_listeners; i++) {
        listener_sample(out, PREFIX "listener_drop_not_allowed_total", &v->listeners[i], false,
                        v->listeners[i].drop_not_allowed);
    }
    append_help(out, PREFIX "listener_tcp_rejected_per_ip_total",
                "TCP connections refused, per listener: the sender already held "
                "max_connections_per_ip",
                "counter");
    for (uint32_t i = 0; i < v->n_listeners; i++) {
        if (v->listeners[i].tcp) {
            listener_sample(out, PREFIX "listener_tcp_rejected_per_ip_total", &v->listeners[i],
                            false, v->listeners[i].tcp_rejected_per_ip);
        }
    }

    /* The HTTP server itself. */
    if (v->http != NULL) {
        metric_u64(out, PREFIX "http_connections_total", "metrics HTTP connections accepted",
                   "counter", v->http->connections);
        metric_u64(out, PREFIX "http_connections_rejected_total",
                   "metrics HTTP connections refused past the connection limit (503)", "counter",
                   v->http->rejected);
        metric_u64(out, PREFIX "http_timeouts_total",
                   "metrics HTTP connections closed by a deadline (request head or response)",
                   "counter", v->http->timed_out);
        metric_u64(out, PREFIX "http_connections_open", "metrics HTTP connections open now",
                   "gauge", v->http_open);
        append_help(out, PREFIX "http_responses_total", "metrics HTTP responses, by status",
                    "counter");
        for (size_t i = 0; i < BD_ARRAY_LEN(v->http->responses); i++) {
            bd_http_body_printf(out, PREFIX "http_responses_total{code=\"%s\"} %" PRIu64 "\n",
                                bd_http_counter_codes[i], v->http->responses[i]);
        }
    }

    metric_f(out, PREFIX "start_time_seconds", "Unix time the daemon started", "gauge",
             (double)v->start_wall_ms / 1000.0);
    append_help(out, PREFIX "build_info", "the running version", "gauge");
    append_str(out, PREFIX "build_info{version=\"");
    bd_metrics_append_label_value(out, v->version);
    append_str(out, "\"} 1\n");
}

/* ---------------------------------------------------------------------------------------- */
/* The server                                                                               */

struct bd_metrics {
    const struct bd_config *cfg;
    const struct bd_stats *stats;
    const struct bd_sensor_table *table;
    const struct bd_ingest *ingest;
    const struct bd_clock *clock; /* NULL: not exported */
    int64_t start_mono_ns, start_wall_ms;
    struct bd_http *http;
    struct bd_http_route routes[3];
    struct bd_sensor_info page[BD_SENSORLIST_LIMIT_MAX]; /* /sensors */
};

/* The view; with_silent: count the silent sensors too (a pass over the sensor index, which
 * /healthz does not need). */
static void view_now(const struct bd_metrics *m, struct bd_metrics_view *v, bool with_silent) {
    memset(v, 0, sizeof(*v));
    v->stats = m->stats;
    v->version = BD_VERSION;
    v->sensors = m->table != NULL ? bd_sensor_table_count(m->table) : 0;
    v->max_sensors = m->cfg->limits.max_sensors;
    v->silent_after_ms = m->cfg->metrics.silent_after_ms;
    if (m->table != NULL && v->silent_after_ms > 0 && with_silent) {
        int64_t before = bd_now_ns() - (int64_t)(v->silent_after_ms * BD_NS_PER_MS);
        v->sensors_silent = bd_sensor_table_count_silent(m->table, before);
    }
    v->sensor_memory = m->table != NULL ? bd_sensor_table_memory(m->table) : 0;
    v->sensor_memory_max = m->cfg->limits.sensor_memory;
    v->pool_segment_bytes = m->table != NULL ? bd_sensor_table_pool(m->table)->seg_bytes : 0;
    v->mongodb = m->cfg->sink == BD_SINK_MONGODB;
    v->spool_max_bytes = m->cfg->spool.max_bytes;
    v->spool_high_water_pct = m->cfg->metrics.spool_high_water;
    v->unhealthy_after_ms = m->cfg->metrics.unhealthy_after_ms;
    v->now_mono_ns = bd_mono_ns();
    v->start_mono_ns = m->start_mono_ns;
    v->start_wall_ms = m->start_wall_ms;
    uint32_t n = m->ingest != NULL ? bd_ingest_n_listeners(m->ingest) : 0;
    for (uint32_t i = 0; i < n && v->n_listeners < BD_MAX_LISTENERS; i++) {
        struct bd_ingest_listener_info info;
        if (bd_ingest_listener_info(m->ingest, i, &info) == 0) {
            v->listeners[v->n_listeners++] =
                (struct bd_metrics_listener){.proto = bd_proto_name(info.proto),
                                             .bind = info.bind,
                                             .format = bd_format_name(info.format),
                                             .tcp = info.proto == BD_PROTO_TCP,
                                             .connections = info.connections,
                                             .drop_not_allowed = info.drop_not_allowed,
                                             .tcp_rejected_per_ip = info.tcp_rejected_per_ip};
        }
    }
    if (m->http != NULL) {
        v->http = bd_http_counters(m->http);
        v->http_open = bd_http_open_connections(m->http);
    }
    if (m->clock != NULL) {
        v->clock = true;
        v->clock_state = bd_clock_state(m->clock);
        v->clock_synchronized = bd_clock_synchronized(m->clock);
        v->clock_steps = bd_clock_steps(m->clock);
    }
}

void bd_metrics_view_now(const struct bd_metrics *m, struct bd_metrics_view *v) {
    view_now(m, v, true);
}

static void serve_metrics(void *arg, const struct bd_http_request *req,
                          struct bd_http_response *resp) {
    (void)req;
    struct bd_metrics_view v;
    bd_metrics_view_now(arg, &v);
    bd_metrics_render(&v, resp);
}

static void serve_health(void *arg, const struct bd_http_request *req,
                         struct bd_http_response *resp) {
    (void)req;
    struct bd_metrics_view v;
    view_now(arg, &v, false);
    bd_health_render(&v, resp);
}

static void serve_sensors(void *arg, const struct bd_http_request *req,
                          struct bd_http_response *resp) {
    struct bd_metrics *m = arg;
    struct bd_sensorlist_query q;
    char why[256];
    if (bd_sensorlist_parse_query(req->query, req->query_len, &q, why, sizeof(why)) < 0) {
        bd_sensorlist_render_error(why, resp);
        return;
    }
    int64_t before = INT64_MAX;
    if (q.silent) {
        before = bd_now_ns() - (int64_t)(q.silent_ms * BD_NS_PER_MS);
    }
    bool more = false;
    uint32_t n = 0;
    if (m->table != NULL) {
        n = bd_sensor_table_list(m->table, q.after ? &q.after_pos : NULL, before, m->page, q.limit,
                                 &more);
    }
    bd_sensorlist_render(m->page, n, more, resp);
}

int bd_metrics_new(struct bd_metrics **out, uv_loop_t *loop, const struct bd_config *cfg,
                   const struct bd_stats *stats, const struct bd_sensor_table *table,
                   const struct bd_ingest *ingest, struct bd_err *err) {
    *out = NULL;
    if (cfg->metrics.bind[0] == '\0') {
        return 0;
    }
    struct sockaddr_storage addr;
    int rc = bd_parse_hostport(cfg->metrics.bind, &addr);
    if (rc < 0) {
        return bd_err_set(err, rc, "metrics.bind: invalid address \"%s\"", cfg->metrics.bind);
    }
    struct bd_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return bd_err_set(err, -ENOMEM, "metrics: out of memory");
    }
    m->cfg = cfg;
    m->stats = stats;
    m->table = table;
    m->ingest = ingest;
    m->start_mono_ns = bd_mono_ns();
    m->start_wall_ms = bd_now_ns() / BD_NS_PER_MS;
    m->routes[0] = (struct bd_http_route){"/metrics", serve_metrics, m};
    m->routes[1] = (struct bd_http_route){"/healthz", serve_health, m};
    m->routes[2] = (struct bd_http_route){"/sensors", serve_sensors, m};
    struct bd_http_limits lim;
    bd_http_default_limits(&lim);
    rc = bd_http_new(&m->http, loop, cfg->metrics.bind, &addr, &lim, m->routes,
                     BD_ARRAY_LEN(m->routes), err);
    if (rc < 0) {
        free(m);
        return rc;
    }
    int port = bd_http_port(m->http);
    bd_info("metrics: serving /metrics, /healthz and /sensors on %s (port %d)", cfg->metrics.bind,
            port);
    *out = m;
    return 0;
}

void bd_metrics_free(struct bd_metrics *m) {
    if (m == NULL) {
        return;
    }
    bd_http_free(m->http);
    free(m);
}

void bd_metrics_set_clock(struct bd_metrics *m, const struct bd_clock *clock) {
    if (m != NULL) {
        m->clock = clock;
    }
}

int bd_metrics_port(const struct bd_metrics *m) {
    return bd_http_port(m->http);
}
