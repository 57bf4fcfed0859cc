/*
 * Daemon lifecycle. The main thread runs the libuv loop (the ingest thread) and owns every uv
 * handle; the flusher runs on its own thread. Cross-thread doorbells: the sensor table rings
 * the flusher (condition variable) when a ring passes its high-water mark, and the flusher
 * rings the loop (uv_async_send) after each drain so paused TCP readers resume.
 *
 * SIGHUP reloads the configuration (reload.h). run_cfg is the loop thread's copy: a reload
 * changes it in place, and every other thread has a copy of its own (the flusher) or the values
 * it needs (the sensor table, the listeners, the store), so nothing else ever reads it.
 *
 * Stop order on SIGTERM/SIGINT: stop and close the listeners (data already received is parsed
 * into the rings), close the remaining handles and let the loop end, then stop the flusher,
 * which drains every ring and flushes with a deadline. Nothing accepted is dropped on a clean
 * stop unless MongoDB stays unreachable past flush.stop_timeout, which is counted and logged.
 */
#include "bucketd/daemon.h"

#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <uv.h>

#include "bucketd/clock.h"
#include "bucketd/flusher.h"
#include "bucketd/ingest.h"
#include "bucketd/log.h"
#include "bucketd/metrics.h"
#include "bucketd/reload.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"
#include "bucketd/writer.h"

struct daemon {
    const struct bd_config *cfg; /* &run_cfg */
    /* The configuration as run: the loaded one with the writer id worked out (writer.h), and
     * what reloads changed since. Loop thread only. */
    struct bd_config run_cfg;
    struct bd_reload *reload;
    uv_loop_t loop;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_async_t drained;
    uv_timer_t watchdog; /* pings systemd when the unit sets WatchdogSec */
    bool watchdog_on;
    /* Whether the wall clock is trusted (clock.h): polled on clock_timer, read by any thread. */
    struct bd_clock *clock;
    uv_timer_t clock_timer;
    bool clock_timer_on;
    /* Guards uv_async_send against the handle being closed (flusher thread vs loop). */
    pthread_mutex_t drained_mu;
    bool drained_open;
    struct bd_stats stats;
    struct bd_sensor_table *table;
    struct bd_flusher *flusher;
    struct bd_ingest *ingest;
    struct bd_metrics *metrics; /* NULL: metrics.bind is "" */
    bool stopping;
    int64_t stop_deadline; /* monotonic ns: the whole stop, loop phase and final flush */
    uv_timer_t stop_timer; /* gives up on TCP connections still draining at the deadline */
};

static void on_drained_async(uv_async_t *h) {
    struct daemon *d = h->data;
    bd_sensor_table_sweep(d->table, bd_now_ns());
    bd_ingest_resume(d->ingest);
}

/* Flusher thread. */
static void flusher_drained(void *arg) {
    struct daemon *d = arg;
    pthread_mutex_lock(&d->drained_mu);
    if (d->drained_open) {
        uv_async_send(&d->drained);
    }
    pthread_mutex_unlock(&d->drained_mu);
}

/* Ingest thread: a ring crossed its high-water mark. */
static void ring_high_water(void *arg) {
    struct daemon *d = arg;
    bd_flusher_wake(d->flusher);
}

/* Every connection is finished: nothing more will reach the rings from this loop. */
static void on_ingest_stopped(void *arg) {
    struct daemon *d = arg;
    pthread_mutex_lock(&d->drained_mu);
    d->drained_open = false;
    pthread_mutex_unlock(&d->drained_mu);
    uv_close((uv_handle_t *)&d->drained, NULL);
    uv_close((uv_handle_t *)&d->stop_timer, NULL);
    bd_reload_close(d->reload);
}

static void on_stop_deadline(uv_timer_t *t) {
    struct daemon *d = t->data;
    bd_warn("stop deadline (flush.stop_timeout) passed with TCP input still waiting for ring "
            "space; closing those connections");
    bd_ingest_abort(d->ingest);
}

static void begin_stop(struct daemon *d, const char *why) {
    if (d->stopping) {
        return;
    }
    d->stopping = true;
    d->stop_deadline = bd_mono_ns() + (int64_t)d->cfg->flush.stop_timeout_ms * BD_NS_PER_MS;
    bd_info("%s: stopping listeners, then draining rings and flushing", why);
    sd_notify(0, "STOPPING=1\nSTATUS=draining rings and flushing");
    uv_close((uv_handle_t *)&d->sig_term, NULL);
    uv_close((uv_handle_t *)&d->sig_int, NULL);
    uv_close((uv_handle_t *)&d->sig_hup, NULL);
    if (d->watchdog_on) {
        uv_close((uv_handle_t *)&d->watchdog, NULL);
    }
    if (d->clock_timer_on) {
        uv_close((uv_handle_t *)&d->clock_timer, NULL);
        d->clock_timer_on = false;
    }
    /* TCP lines already received may still wait for ring space: the flusher keeps draining
     * and its doorbell (d->drained) keeps resuming them until ingest reports it is done. */
    uv_timer_init(&d->loop, &d->stop_timer);
    d->stop_timer.data = d;
    uv_timer_start(&d->stop_timer, on_stop_deadline, d->cfg->flush.stop_timeout_ms, 0);
    bd_metrics_free(d->metrics);
    d->metrics = NULL;
    bd_ingest_stop(d->ingest, on_ingest_stopped, d);
}

static void on_signal(uv_signal_t *h, int signum) {
    struct daemon *d = h->data;
    if (signum == SIGHUP) {
        if (d->reload != NULL) { /* NULL only while a failed start winds down */
            bd_reload_run(d->reload);
        }
        return;
    }
    begin_stop(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* The loop is alive if this fires: a stuck ingest thread stops the pings and systemd
 * restarts the unit. */
static void on_watchdog(uv_timer_t *t) {
    struct daemon *d = t->data;
    char status[160];
    snprintf(status, sizeof(status), "WATCHDOG=1\nSTATUS=%llu readings accepted, %llu flushed",
             (unsigned long long)BD_STAT_GET(&d->stats, readings_accepted),
             (unsigned long long)BD_STAT_GET(&d->stats, readings_flushed));
    sd_notify(0, status);
}

static void start_watchdog(struct daemon *d) {
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) {
        return;
    }
    uv_timer_init(&d->loop, &d->watchdog);
    d->watchdog.data = d;
    uint64_t every_ms = usec / 2000 ? usec / 2000 : 1;
    uv_timer_start(&d->watchdog, on_watchdog, every_ms, every_ms);
    d->watchdog_on = true;
}

static void on_clock_timer(uv_timer_t *t) {
    struct daemon *d = t->data;
    bd_clock_poll(d->clock);
    bd_ingest_clock_tick(d->ingest); /* hold lines while it is not trusted, release once it is */
}

/*
 * The clock's floor: the wall time of the last write this writer acknowledged, as writer.state
 * keeps it (read before the flusher opens the writer), or the build time when that is later or
 * there is none.
 */
static int new_clock(struct daemon *d, struct bd_err *err) {
    struct bd_clock_opts opts = {.wait_for_sync_ms = d->cfg->time.wait_for_sync_ms,
                                 .floor_wall_ms = bd_clock_build_time_s() * 1000,
                                 .floor_what = "the build time"};
    struct bd_writer_prev prev;
    if (d->cfg->sink == BD_SINK_MONGODB && bd_writer_peek(d->cfg->spool.dir, &prev) == 0 &&
        prev.last_ack_ms > opts.floor_wall_ms) {
        opts.floor_wall_ms = prev.last_ack_ms;
        opts.floor_what = "the last write this writer had acknowledged (writer.state)";
    }
    return bd_clock_new(&d->clock, bd_clock_system_source(), &opts, err);
}

static void start_clock_timer(struct daemon *d) {
    uv_timer_init(&d->loop, &d->clock_timer);
    d->clock_timer.data = d;
    uv_timer_start(&d->clock_timer, on_clock_timer, BD_CLOCK_POLL_MS, BD_CLOCK_POLL_MS);
    d->clock_timer_on = true;
}

static void log_stats(const struct bd_stats *st, const struct bd_sensor_table *table) {
    char line[4096];
    bd_stats_format(st, line, sizeof(line));
    bd_info("stats: %s", line);
    if (table != NULL) {
        const struct bd_pool *pool = bd_sensor_table_pool(table);
        bd_info("buffer pool: at most %u of %u units of %zu bytes in use at once; %u sensors",
                bd_pool_high_water(pool), pool->n_units, pool->unit_bytes,
                bd_sensor_table_count(table));
    }
}

int bd_daemon_run(const struct bd_config *cfg) {
    int exit_code = 1;
    struct bd_err err = {0};
    struct daemon *d = calloc(1, sizeof(*d));
    bool loop_open = false;
    if (d == NULL) {
        bd_error("out of memory");
        return 1;
    }
    d->run_cfg = *cfg;
    cfg = d->cfg = &d->run_cfg;
    pthread_mutex_init(&d->drained_mu, NULL);
    signal(SIGPIPE, SIG_IGN);
    mongoc_init();
    bd_flusher_install_driver_log();

    if (cfg->sink == BD_SINK_MONGODB) {
        struct bd_writer_identity id;
        if (bd_writer_identity(cfg->spool.dir, cfg->writer_id, &id, &err) < 0) {
            bd_error("%s", err.msg);
            goto out;
        }
        snprintf(d->run_cfg.writer_id, sizeof(d->run_cfg.writer_id), "%s", id.id);
    }
    if (new_clock(d, &err) < 0) {
        bd_error("%s", err.msg);
        goto out;
    }
    if (bd_sensor_table_new(&d->table, cfg, &d->stats, &err) < 0 ||
        bd_flusher_new(&d->flusher, cfg, d->table, &d->stats, &err) < 0) {
        bd_error("%s", err.msg);
        goto out;
    }
    bd_sensor_table_set_wake(d->table, ring_high_water, d);
    bd_flusher_set_drained(d->flusher, flusher_drained, d);

    BD_ASSERT(uv_loop_init(&d->loop) == 0);
    loop_open = true;
    if (bd_ingest_new(&d->ingest, &d->loop, cfg, d->table, &d->stats, &err) < 0) {
        bd_error("%s", err.msg);
        goto out;
    }
    if (bd_ingest_set_clock(d->ingest, d->clock, cfg, &err) < 0) {
        bd_error("%s", err.msg);
        goto out;
    }
    if (bd_metrics_new(&d->metrics, &d->loop, cfg, &d->stats, d->table, d->ingest, &err) < 0) {
        bd_error("%s", err.msg);
        goto out;
    }
    bd_metrics_set_clock(d->metrics, d->clock);
    start_clock_timer(d);
    uv_signal_init(&d->loop, &d->sig_term);
    uv_signal_init(&d->loop, &d->sig_int);
    uv_signal_init(&d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    uv_async_init(&d->loop, &d->drained, on_drained_async);
    d->drained.data = d;
    d->drained_open = true;
    struct bd_reload_targets targets = {.cfg = &d->run_cfg,
                                        .table = d->table,
                                        .flusher = d->flusher,
                                        .ingest = d->ingest,
                                        .stats = &d->stats,
                                        .clock = d->clock};
    if (bd_reload_new(&d->reload, &d->loop, &targets, &err) < 0) {
        bd_error("%s", err.msg);
        begin_stop(d, "start-up failure");
        uv_run(&d->loop, UV_RUN_DEFAULT);
        goto out;
    }

    if (bd_flusher_start(d->flusher, &err) < 0) {
        bd_error("%s", err.msg);
        begin_stop(d, "start-up failure");
        uv_run(&d->loop, UV_RUN_DEFAULT);
        goto out;
    }
    if (cfg->sink == BD_SINK_MONGODB) {
        bd_info("ready: writer %s, sink mongodb %s.%s, flush every %" PRIu64 "ms", cfg->writer_id,
                cfg->mongodb.database, cfg->mongodb.collection, cfg->flush.interval_ms);
    } else {
        bd_info("ready: sink blackhole, flush every %" PRIu64 "ms", cfg->flush.interval_ms);
    }
    start_watchdog(d);
    sd_notify(0, "READY=1\nSTATUS=ready");
    uv_run(&d->loop, UV_RUN_DEFAULT);

    /* Every listener is closed: the rings hold all that was accepted, and the hold what waits
     * for the clock (released into the rings first if it is trusted now, else saved). */
    bd_ingest_save_held(d->ingest);
    bd_flusher_stop(d->flusher, d->stop_deadline);
    uint64_t unread = BD_STAT_GET(&d->stats, tcp_unread_at_stop);
    if (unread > 0) {
        bd_warn("%" PRIu64 " bytes of TCP input were not read because of the stop (senders "
                "should resend what the connection close interrupted)",
                unread);
    }
    log_stats(&d->stats, d->table);
    exit_code = 0;
out:
    bd_metrics_free(d->metrics);
    bd_ingest_free(d->ingest);
    bd_reload_close(d->reload);
    if (loop_open) {
        /* A failed start leaves handles closing (a listener that could not bind): let their
         * close callbacks run. Nothing is active here, so this returns at once otherwise. */
        uv_run(&d->loop, UV_RUN_DEFAULT);
        int rc = uv_loop_close(&d->loop);
        BD_ASSERT(rc == 0); /* every handle was closed */
    }
    bd_flusher_free(d->flusher);
    bd_reload_free(d->reload);
    bd_sensor_table_free(d->table);
    bd_clock_free(d->clock);
    mongoc_cleanup();
    pthread_mutex_destroy(&d->drained_mu);
    free(d);
    return exit_code;
}
