/*
 * /metrics (Prometheus text exposition, format 0.0.4), /healthz (one line of JSON) and /sensors
 * (the sensors tracked, sensorlist.h) on metrics.bind, served by the HTTP server of http.h on
 * the ingest thread's uv loop, the thread that owns the sensor table.
 *
 * What is exported (bucketd-metrics(7), tools/man/bucketd-metrics.7.scd, lists every name):
 *   - every counter of stats.h as bucketd_<name>_total, except the drop_* counters, which are
 *     one counter bucketd_dropped_total{reason="<name without drop_>"};
 *   - every gauge of stats.h as bucketd_<name> (oldest_pending_age_ms in seconds), and the
 *     sensors tracked and those silent past metrics.silent_after, the spool's limits, MongoDB reachable, the time of the last successful
 *     write and the seconds since, health as a 0/1 gauge, one series per listener
 *     ({proto, bind} labels) and the HTTP server's own counters; the wall clock's state
 *     (clock.h: synchronised, trusted, steps seen);
 *   - histograms of bulk-write latency (seconds) and readings per update.
 * The counters are read with relaxed loads: a scrape is a snapshot that may be a few events
 * stale, never torn per value. The flusher thread writes what it owns (stats.h); the rest
 * (sensors, listeners, HTTP) belongs to the loop thread that serves the request.
 *
 * Health (/healthz and bucketd_healthy): unhealthy, with a reason each, when MongoDB has been
 * unreachable longer than metrics.unhealthy_after, when the spool holds more than
 * metrics.spool_high_water percent of spool.max_bytes, or when corrupt spool records were
 * found since the start (they were skipped; the log names them). The clock's state is in
 * /healthz's JSON too, never a reason by itself.
 *
 * The rendering functions are pure over struct bd_metrics_view, for unit tests.
 */
#ifndef BUCKETD_METRICS_H
#define BUCKETD_METRICS_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "bucketd/clock.h"
#include "bucketd/config.h"
#include "bucketd/http.h"
#include "bucketd/stats.h"

struct bd_ingest;
struct bd_sensor_table;

struct bd_metrics_listener {
    const char *proto;  /* "udp", "tcp" */
    const char *bind;   /* as configured */
    const char *format; /* "influx", "graphite" */
    bool tcp;
    uint32_t connections;         /* tcp: open now */
    uint64_t drop_not_allowed;    /* datagrams or connections refused by its allow list */
    uint64_t tcp_rejected_per_ip; /* tcp: connections refused by max_connections_per_ip */
};

/* Everything one scrape reads. */
struct bd_metrics_view {
    const struct bd_stats *stats;
    const char *version;
    uint32_t sensors, max_sensors;
    uint64_t silent_after_ms; /* metrics.silent_after; 0: bucketd_sensors_silent not exported */
    uint32_t sensors_silent;  /* sensors whose last reading is older than that */
    uint64_t sensor_memory, sensor_memory_max; /* bytes: now, limits.sensor_memory */
    uint64_t pool_segment_bytes;
    bool mongodb; /* the sink is MongoDB: its gauges and the spool's are exported */
    uint64_t spool_max_bytes;
    uint32_t spool_high_water_pct;
    uint64_t unhealthy_after_ms;
    int64_t now_mono_ns, start_mono_ns;
    int64_t start_wall_ms;
    uint32_t n_listeners;
    struct bd_metrics_listener listeners[BD_MAX_LISTENERS];
    const struct bd_http_counters *http; /* NULL: not exported */
    uint32_t http_open;
    bool clock; /* the clock's fields below are set (exported) */
    enum bd_clock_state clock_state;
    bool clock_synchronized;
    uint64_t clock_steps;
};

/* The exposition text of view into out (Content-Type text/plain; version=0.0.4). */
void bd_metrics_render(const struct bd_metrics_view *view, struct bd_http_response *out);

/* The health verdict: healthy, or one sentence per reason (at most the three above). */
struct bd_health {
    bool healthy;
    uint32_t n_reasons;
    char reasons[3][192];
};
void bd_health_eval(const struct bd_metrics_view *view, struct bd_health *out);

/* /healthz: 200 or 503 and one line of JSON. */
void bd_health_render(const struct bd_metrics_view *view, struct bd_http_response *out);

/* A label value in the exposition format: \ " and newline escaped. */
bool bd_metrics_append_label_value(struct bd_http_response *out, const char *value);

/* ---- The server, on the ingest thread's loop ---- */

struct bd_metrics;

/*
 * Listen on cfg->metrics.bind and serve /metrics, /healthz and /sensors from stats, table and ingest
 * (all outliving the server; ingest may be NULL). With an empty metrics.bind, *out is NULL
 * and 0 is returned. Errors name metrics.bind.
 */
int bd_metrics_new(struct bd_metrics **out, uv_loop_t *loop, const struct bd_config *cfg,
                   const struct bd_stats *stats, const struct bd_sensor_table *table,
                   const struct bd_ingest *ingest, struct bd_err *err);
/* Close (the memory goes with the last close callback: run the loop). NULL is a no-op. */
void bd_metrics_free(struct bd_metrics *m);
/* The clock whose state /metrics and /healthz show (outliving the server). NULL m: no-op. */
void bd_metrics_set_clock(struct bd_metrics *m, const struct bd_clock *clock);
/* The bound port, or a negative errno. */
int bd_metrics_port(const struct bd_metrics *m);
/* The view a scrape would read now (tests, benchmarks). */
void bd_metrics_view_now(const struct bd_metrics *m, struct bd_metrics_view *view);

#endif
