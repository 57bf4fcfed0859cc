/*
 * The flusher (include/bucketd/flusher.h): its thread, bd_flusher_step and the life cycle. The
 * work is done by the parts below it (src/flusher_int.h lists them), which only call down:
 *
 *   mode         computed once at the start of each step (flusher_mode.h) from the parts'
 *                state, and once after it for the summaries' round and bd_flusher_idle:
 *                writing, retrying, spooling or replaying;
 *   writing      the drain has filled the fill batch; once per flush.interval, when the batch
 *                being written is settled, the fill batch becomes the one written (the writer
 *                side), in unordered bulks of at most flush.max_updates upserts, and each
 *                update is settled by the settle engine (settle.h);
 *   retrying     a write failed: the batch is retried after a backoff, and the next waits -- a
 *                page never receives a later batch's update before an earlier one is settled
 *                (flusher_writer_swap_in_fill); once the next one is due too, the failed one
 *                goes to the spool;
 *   spooling, replaying   the spool holds records: everything goes through it, in order
 *                (flusher_spool.c).
 *
 * Threads: the fields of struct bd_flusher below its "flusher thread only" line are touched by
 * the flusher thread alone (or by a unit test driving bd_flusher_step on a flusher it never
 * started); the mutex/condition variable pair is the doorbell from the other threads (wake,
 * stop, reload). Whenever woken (the interval, the pool past its wake-up mark), and all the
 * while a store call runs on the I/O thread (the drain is the I/O runner's idle work, handed
 * down from here), the dirty sensors' queues are drained into the fill batch.
 *
 * Exactly once: each batch takes one number from the writer sequence (writer.h) and every
 * update carries it (bucket.c). A retry re-sends the same updates with the same number, so an
 * update MongoDB applied before its reply was lost comes back as duplicate key (11000), and the
 * settle engine's read-back tells it from a race or a conflict.
 */
#include "bucketd/flusher.h"

#include <errno.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/alloc.h"
#include "bucketd/batch.h"
#include "bucketd/deadletter.h"
#include "bucketd/io.h"
#include "bucketd/log.h"
#include "bucketd/pages.h"
#include "bucketd/settle.h"
#include "bucketd/writer.h"
#include "flusher_drain.h"
#include "flusher_int.h"
#include "flusher_io.h"
#include "flusher_reload.h"
#include "flusher_spool.h"
#include "flusher_summaries.h"
#include "flusher_writer.h"

static void driver_log(mongoc_log_level_t level, const char *domain, const char *message,
                       void *data) {
    (void)data;
    switch (level) {
    case MONGOC_LOG_LEVEL_ERROR:
    case MONGOC_LOG_LEVEL_CRITICAL:
        bd_error("mongoc[%s]: %s", domain, message);
        break;
    case MONGOC_LOG_LEVEL_WARNING:
        bd_warn("mongoc[%s]: %s", domain, message);
        break;
    default:
        bd_debug("mongoc[%s]: %s", domain, message);
        break;
    }
}

void bd_flusher_install_driver_log(void) {
    mongoc_log_set_handler(driver_log, NULL);
}

/* Idle work while a store call runs on the I/O thread: keep draining. */
static void drain_now(void *arg) {
    struct bd_flusher *f = arg;
    (void)flusher_drain_run(f, bd_now_ns() / BD_NS_PER_MS, false);
}

/* Everything but the store; a NULL store means the blackhole sink. */
static int setup(struct bd_flusher *f, const struct bd_config *cfg, struct bd_sensor_table *table,
                 struct bd_stats *stats, struct bd_err *err) {
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    /* Its own copy: the caller's may change under a reload (see cfg_own). */
    f->cfg_own = bd_malloc(sizeof(*f->cfg_own));
    if (f->cfg_own == NULL) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    *f->cfg_own = *cfg;
    f->cfg = cfg = f->cfg_own;
    f->table = table;
    f->stats = stats;
    f->writer.rng = (uint64_t)bd_now_ns() | 1;
    f->clean_stop = true; /* a daemon that fails before the thread starts accepted nothing */
    f->batch_id = 1;
    f->fill_id = 2;
    f->budget = cfg->limits.memory / 2;
    f->writer.chunk_max = cfg->flush.max_updates;
    f->lim = (struct bd_pages_limits){.span_ms = cfg->buckets.span_ms,
                                      .max_late_ms = cfg->buckets.max_late_ms,
                                      .max_future_ms = cfg->buckets.max_future_ms,
                                      .max_readings = cfg->buckets.max_readings,
                                      .max_bytes = cfg->buckets.max_bytes};
    bd_pages_pool_init(&f->pages_pool);
    bd_settle_init(&f->settle);
    f->settle.store = f->store;
    f->settle.run = flusher_io_run;
    f->settle.run_arg = f;
    f->settle.stats = stats;
    f->settle.cfg = cfg;
    f->io.idle = drain_now; /* the drain goes on while a store call runs */
    f->io.idle_arg = f;
    snprintf(f->writer.writer_key, sizeof(f->writer.writer_key), BD_WRITER_KEY_PREFIX "%s",
             cfg->writer_id);
    if (flusher_writer_chunk_alloc(f, cfg->flush.max_updates) < 0 || bd_batch_init(&f->batch) < 0 ||
        bd_batch_init(&f->fill) < 0) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    return 0;
}

static int open_state(struct bd_flusher *f, struct bd_err *err) {
    /* The spool first: it creates spool.dir (with its parents), where the rest lives too. */
    int rc = flusher_spool_open(f, err);
    if (rc == 0) {
        rc = flusher_writer_open(f, err);
    }
    if (rc == 0) {
        rc = bd_deadletter_open(&f->dead, f->cfg->spool.dir, err);
        f->settle.dead = f->dead;
    }
    if (rc == 0) {
        rc = flusher_summaries_open(f, err);
    }
    return rc;
}

int bd_flusher_new_with_store(struct bd_flusher **out, const struct bd_config *cfg,
                              struct bd_sensor_table *table, struct bd_stats *stats,
                              struct bd_store *store, struct bd_err *err) {
    int rc = 0;
    struct bd_flusher *f = bd_calloc(1, sizeof(*f));
    if (f == NULL) {
        bd_store_free(store);
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    f->store = store;
    rc = setup(f, cfg, table, stats, err);
    if (rc == 0) {
        rc = open_state(f, err);
    }
    if (rc == 0) {
        *out = f;
        f = NULL;
    }
    bd_flusher_free(f);
    return rc;
}

int bd_flusher_new(struct bd_flusher **out, const struct bd_config *cfg,
                   struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err) {
    if (cfg->sink == BD_SINK_MONGODB) {
        char key[160];
        struct bd_store *store = NULL;
        snprintf(key, sizeof(key), BD_WRITER_KEY_PREFIX "%s", cfg->writer_id);
        int rc = bd_store_mongo_new(&store, cfg, key, err);
        if (rc < 0) {
            return rc;
        }
        return bd_flusher_new_with_store(out, cfg, table, stats, store, err);
    }
    int rc = 0;
    struct bd_flusher *f = bd_calloc(1, sizeof(*f));
    if (f == NULL) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    rc = setup(f, cfg, table, stats, err);
    if (rc == 0) {
        *out = f;
        f = NULL;
    }
    bd_flusher_free(f);
    return rc;
}

void bd_flusher_set_drained(struct bd_flusher *f, bd_flusher_drained_cb cb, void *arg) {
    f->drain.drained = cb;
    f->drain.drained_arg = arg;
}

static void release_sensor_state(struct bd_sensor *s, void *arg) {
    bd_pages_free(arg, s->flusher_state);
    s->flusher_state = NULL;
    s->flusher_next = NULL;
    s->flusher_requeued = false;
}

void bd_flusher_free(struct bd_flusher *f) {
    if (f == NULL) {
        return;
    }
    BD_ASSERT(!f->started);
    bd_batch_close(&f->batch);
    bd_batch_close(&f->fill);
    flusher_writer_chunk_free(f);
    bd_writer_set_lost_at_stop(f->writer.state, BD_STAT_GET(f->stats, readings_lost));
    bd_writer_close(f->writer.state, f->clean_stop);
    bd_deadletter_close(f->dead);
    flusher_spool_close(f);
    flusher_summaries_close(f, "the stop");
    flusher_drain_release_evicted(f);
    if (f->table != NULL) {
        bd_sensor_table_foreach(f->table, release_sensor_state, &f->pages_pool);
    }
    bd_pages_pool_close(&f->pages_pool);
    bd_store_free(f->store);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f->reload.cfg_next);
    free(f->cfg_own);
    free(f);
}

void bd_flusher_wake(struct bd_flusher *f) {
    pthread_mutex_lock(&f->mu);
    f->wake_pending = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    /* A write in flight: drain meanwhile (f->io.worker is set before the thread starts). */
    bd_io_poke(f->io.worker);
}

void bd_flusher_seed(struct bd_flusher *f, uint64_t seed) {
    f->writer.rng = seed | 1;
}

int64_t bd_flusher_retry_at(const struct bd_flusher *f) {
    return f->writer.retry_at;
}

/*
 * How the flusher writes now (flusher_mode.h), from the state of its parts: the spool's, then
 * the batch being written and the retry schedule.
 */
static enum flusher_mode mode_of(const struct bd_flusher *f) {
    if (flusher_spool_active(f)) {
        return f->writer.retry_at != 0 ? FLUSHER_SPOOLING : FLUSHER_REPLAYING;
    }
    if (!flusher_writer_settled(f) || f->writer.attempt > 0) {
        return FLUSHER_RETRYING;
    }
    return FLUSHER_WRITING;
}

/* No reading waits in mode: both batches settled, no sensor queued or on the requeue list. */
static bool idle_in(const struct bd_flusher *f, enum flusher_mode mode) {
    return (mode == FLUSHER_WRITING || mode == FLUSHER_RETRYING) && flusher_writer_settled(f) &&
           bd_batch_pending_readings(&f->fill) == 0 && f->drain.requeued == NULL &&
           !bd_sensor_table_has_dirty(f->table);
}

static enum flusher_mode step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms,
                              bool stopping);

/* The gauges of what waits (stats.h). */
static void set_gauges(struct bd_flusher *f, int64_t wall_ms) {
    const struct bd_pool *pool = bd_sensor_table_pool(f->table);
    BD_GAUGE_SET(f->stats, pool_segments_in_use, bd_pool_in_use(pool));
    BD_GAUGE_SET(f->stats, pool_segments_high_water, bd_pool_high_water(pool));
    BD_GAUGE_SET(f->stats, pool_segments, pool->n_units);
    uint64_t in_batch = bd_batch_pending_readings(&f->batch);
    uint64_t in_fill = bd_batch_pending_readings(&f->fill);
    BD_GAUGE_SET(f->stats, pending_batches, (uint64_t)(in_batch > 0) + (uint64_t)(in_fill > 0));
    BD_GAUGE_SET(f->stats, pending_readings, in_batch + in_fill);
    int64_t oldest = flusher_spool_oldest_ms(f);
    const struct bd_batch *both[] = {&f->batch, &f->fill};
    for (size_t b = 0; b < BD_ARRAY_LEN(both); b++) {
        for (uint32_t i = 0; i < both[b]->n; i++) {
            const struct bd_batch_meta *m = &both[b]->meta[i];
            if (!m->done && both[b]->deltas[i].n_readings > 0 && m->first_ms > 0 &&
                (oldest == 0 || m->first_ms < oldest)) {
                oldest = m->first_ms;
            }
        }
    }
    BD_GAUGE_SET(f->stats, summary_buckets_pending, flusher_summaries_pending(f));
    BD_GAUGE_SET(f->stats, oldest_pending_age_ms,
                 oldest > 0 && wall_ms > oldest ? (uint64_t)(wall_ms - oldest) : 0);
    if (f->spool.disk != NULL) {
        flusher_spool_stats(f);
    }
}

void bd_flusher_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    flusher_reload_adopt(f, mono_ns, wall_ms);
    /* The mode the step leaves the flusher in decides whether a summary round may run. */
    enum flusher_mode mode = step(f, mono_ns, wall_ms, stopping);
    flusher_summaries_step(f, mode, stopping && idle_in(f, mode), wall_ms, stopping);
    set_gauges(f, wall_ms);
}

/*
 * RETRYING: the batch being written failed and waits. Once the next batch is due as well, it
 * goes to the spool (the next follows it there): memory stays bounded, and what was accepted
 * reaches the disk within about two flush intervals. Whether the retry is due does not matter
 * for that: an attempt that blocks longer than its backoff (server selection) leaves it always
 * due. The batch has updates pending; true once it is settled (the fill batch may be written
 * next).
 */
static bool retry(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    if (f->spool.disk != NULL && f->writer.attempt > 0 &&
        flusher_drain_fill_due(f, mono_ns, stopping) && flusher_spool_batch(f, wall_ms)) {
        flusher_spool_step(f, mono_ns, wall_ms, stopping);
        return false;
    }
    if (mono_ns < f->writer.retry_at) {
        return false;
    }
    flusher_writer_write(f, mono_ns, wall_ms);
    return flusher_writer_settled(f);
}

/* The fill batch becomes the batch written once it is due. */
static void write_fill(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    if (!flusher_drain_fill_due(f, mono_ns, stopping)) {
        if (f->fill.n == 0 && mono_ns >= f->send_at) {
            f->send_at = mono_ns + interval_ns;
        }
        return;
    }
    bool large = flusher_drain_fill_large(f);
    if (!stopping && mono_ns < f->send_at && large) {
        BD_STAT_ADD(f->stats, flushes_for_memory, 1);
    }
    flusher_writer_swap_in_fill(f);
    flusher_writer_hold_back(f, wall_ms, stopping || large);
    f->send_at = mono_ns + interval_ns;
    if (flusher_writer_settled(f)) {
        flusher_writer_batch_done(f); /* everything held back for more */
        return;
    }
    BD_STAT_ADD(f->stats, flushes, 1);
    flusher_writer_write(f, mono_ns, wall_ms);
}

/* The step's decisions, by the mode at its start; returns the mode it leaves. */
static enum flusher_mode step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms,
                              bool stopping) {
    /* Draining goes on whatever the batch being written is doing (waiting for its retry here,
     * in flight in the I/O runner). When the writer is free, the drain stops at the early-write
     * mark, the fill is written at once, and the flusher steps again without waiting for what
     * the drain left in the queues. */
    if (flusher_drain_run(f, wall_ms, mode_of(f) == FLUSHER_WRITING)) {
        pthread_mutex_lock(&f->mu);
        f->wake_pending = true;
        pthread_mutex_unlock(&f->mu);
    }
    flusher_spool_tick(f, mono_ns);
    switch (mode_of(f)) {
    case FLUSHER_SPOOLING:
    case FLUSHER_REPLAYING:
        /* Older batches wait on disk: everything goes through the spool, in order. */
        flusher_spool_step(f, mono_ns, wall_ms, stopping);
        break;
    case FLUSHER_RETRYING:
        /* Nothing may wait (the next write is then the first after failures). */
        if (flusher_writer_settled(f) || retry(f, mono_ns, wall_ms, stopping)) {
            write_fill(f, mono_ns, wall_ms, stopping);
        }
        break;
    case FLUSHER_WRITING:
        write_fill(f, mono_ns, wall_ms, stopping);
        break;
    }
    return mode_of(f);
}

bool bd_flusher_idle(struct bd_flusher *f) {
    return idle_in(f, mode_of(f));
}

/* Readings still in sensor queues at the end: counted as lost, queues emptied. */
static uint64_t discard_queues(struct bd_flusher *f) {
    uint64_t lost = 0;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_sensor *s;
    for (;;) {
        if (f->drain.requeued != NULL) {
            s = f->drain.requeued;
            f->drain.requeued = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
        } else if ((s = bd_sensor_table_next_dirty(f->table)) == NULL) {
            break;
        }
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            bd_sensor_consume(s, cells);
            lost++;
        }
    }
    return lost;
}

uint64_t bd_flusher_abandon(struct bd_flusher *f) {
    flusher_spool_everything(f, bd_now_ns() / BD_NS_PER_MS);
    uint64_t pending = bd_batch_pending_readings(&f->batch) + bd_batch_pending_readings(&f->fill);
    uint64_t lost = pending + discard_queues(f);
    BD_STAT_ADD(f->stats, readings_lost, lost);
    if (lost > 0) {
        const char *why;
        switch (f->writer.last_cause) {
        case BD_CAUSE_UNREACHABLE:
            why = "MongoDB was unreachable";
            break;
        case BD_CAUSE_CONNECTION:
            why = "the connection to MongoDB kept failing during writes";
            break;
        case BD_CAUSE_SERVER:
            why = "MongoDB kept refusing updates that were still being retried";
            break;
        case BD_CAUSE_CLIENT:
            why = "updates could not be built or were refused by the driver";
            break;
        default:
            why = pending > 0 ? "writes were still being retried" : "they were never drained";
            break;
        }
        bd_error("stop deadline (flush.stop_timeout=%" PRIu64 "ms) passed: %" PRIu64
                 " accepted readings were not stored: %s%s%s%s",
                 f->cfg->flush.stop_timeout_ms, lost, why, f->writer.last_error[0] ? " (" : "",
                 f->writer.last_error, f->writer.last_error[0] ? ")" : "");
    }
    flusher_writer_batch_done(f);
    flusher_writer_fill_gone(&f->fill);
    bd_batch_clear(&f->fill);
    f->fill_bytes = 0;
    f->queued = 0;
    f->writer.retry_at = 0;
    return lost;
}

static void timespec_after_ns(struct timespec *ts, int64_t delta_ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    int64_t ns = ts->tv_nsec + (delta_ns > 0 ? delta_ns : 0);
    ts->tv_sec += ns / BD_NS_PER_S;
    ts->tv_nsec = ns % BD_NS_PER_S;
}

static void *flusher_main(void *arg) {
    struct bd_flusher *f = arg;
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    bson_error_t berr;

    if (f->store != NULL) {
        /* Connect ahead of the first write (readings are drained meanwhile). */
        (void)flusher_io_prepare(f, &berr);
    }
    f->send_at = bd_mono_ns() + interval_ns;
    for (;;) {
        int64_t now = bd_mono_ns();
        int64_t wait_ns =
            (f->writer.retry_at ? BD_MIN(f->writer.retry_at, f->send_at) : f->send_at) - now;
        bool stopping;
        pthread_mutex_lock(&f->mu);
        if (!f->stop && !f->wake_pending && wait_ns > 0) {
            struct timespec ts;
            timespec_after_ns(&ts, wait_ns);
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        }
        f->wake_pending = false;
        stopping = f->stop;
        if (stopping && f->stop_by == 0) {
            f->stop_by = f->stop_deadline;
        }
        pthread_mutex_unlock(&f->mu);

        bd_flusher_step(f, bd_mono_ns(), bd_now_ns() / BD_NS_PER_MS, stopping);
        if (!stopping) {
            continue;
        }
        if (bd_flusher_idle(f)) {
            break;
        }
        if (bd_mono_ns() >= f->stop_by) {
            /* What MongoDB did not take goes to the spool for the next start; only what cannot
             * be spooled is lost (counted and logged). */
            bd_flusher_abandon(f);
            break;
        }
        if (f->writer.retry_at != 0) {
            /* Sleep out the backoff, but not past the deadline. */
            int64_t until = BD_MIN(f->writer.retry_at, f->stop_by);
            int64_t ns = until - bd_mono_ns();
            if (ns > 0) {
                struct timespec ts = {.tv_sec = ns / BD_NS_PER_S, .tv_nsec = ns % BD_NS_PER_S};
                nanosleep(&ts, NULL);
            }
        }
    }
    f->clean_stop = true;
    flusher_summaries_close(f, "the stop"); /* counted before the stop's stats line */
    if (f->store != NULL) {
        f->store->ops->release(f->store);
    }
    return NULL;
}

int bd_flusher_start(struct bd_flusher *f, struct bd_err *err) {
    if (f->store != NULL) {
        int rc = bd_io_new(&f->io.worker, err);
        if (rc < 0) {
            return rc;
        }
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_destroy(&f->cv);
    pthread_cond_init(&f->cv, &attr);
    pthread_condattr_destroy(&attr);
    f->clean_stop = false;
    int rc = pthread_create(&f->thread, NULL, flusher_main, f);
    if (rc != 0) {
        f->clean_stop = true;
        bd_io_free(f->io.worker);
        f->io.worker = NULL;
        return bd_err_set(err, -rc, "flusher: cannot start thread: %s", strerror(rc));
    }
    pthread_setname_np(f->thread, "bd-flusher"); /* for top, perf and the bench */
    f->started = true;
    return 0;
}

void bd_flusher_stop(struct bd_flusher *f, int64_t deadline_mono_ns) {
    if (!f->started) {
        return;
    }
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    f->stop_deadline = deadline_mono_ns;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    f->started = false;
    bd_io_free(f->io.worker);
    f->io.worker = NULL;
}
