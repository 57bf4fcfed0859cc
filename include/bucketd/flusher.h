/*
 * The flusher: its own thread that drains dirty sensors' queues (every flush.interval, and early
 * when the buffer pool passes its wake-up mark), folds the readings into per-bucket-page deltas
 * (pages.h keeps the page accounting, batch.h the pending deltas) and, once per flush.interval,
 * writes them with unordered bulks of upserts through a store (store.h: MongoDB, or a scripted
 * one in unit tests): one update per bucket page per interval. What became of each update
 * (outcome.h) decides, by the settle engine's rules (settle.h, the same for the spool replay),
 * whether it is settled, sent again, split over new pages or quarantined (deadletter.h).
 *
 * Two batches: the one being written (in flight, or waiting for its retry) and the next one,
 * which the drain keeps filling meanwhile -- the store calls run on an I/O thread (io.h), so a
 * slow or unreachable MongoDB never stops draining. The next batch is written only once the
 * current one is settled, which keeps each page's updates in flush-sequence order. Both batches
 * together are bounded by half of limits.memory; past it draining stops (the queues and their
 * pool hold the rest) until the batch being written is settled.
 *
 * The decisions run in bd_flusher_step(), which takes its clocks as arguments: the thread calls
 * it in a loop, unit tests call it directly on a flusher that was never started.
 */
#ifndef BUCKETD_FLUSHER_H
#define BUCKETD_FLUSHER_H

#include "bucketd/config.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"
#include "bucketd/store.h"

struct bd_flusher;

/* Called on the flusher thread after each drain (main forwards it to the loop with
 * uv_async_send so TCP connections paused by backpressure resume). */
typedef void (*bd_flusher_drained_cb)(void *arg);

/*
 * With the mongodb sink: parses the URI and write concern, creates the client pool (does not
 * connect yet), opens the writer state and the dead-letter file under spool.dir.
 */
int bd_flusher_new(struct bd_flusher **out, const struct bd_config *cfg,
                   struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err);
/*
 * The same with a store the caller made (the flusher owns it from here, also on failure). The
 * writer state and dead-letter file are opened under cfg->spool.dir as with MongoDB.
 */
int bd_flusher_new_with_store(struct bd_flusher **out, const struct bd_config *cfg,
                              struct bd_sensor_table *table, struct bd_stats *stats,
                              struct bd_store *store, struct bd_err *err);
void bd_flusher_set_drained(struct bd_flusher *f, bd_flusher_drained_cb cb, void *arg);

/* Called on the flusher thread once it runs the configuration of reload generation gen. */
typedef void (*bd_flusher_reconfigured_cb)(void *arg, uint64_t gen);
void bd_flusher_set_reconfigured(struct bd_flusher *f, bd_flusher_reconfigured_cb cb, void *arg);

/*
 * Any thread (the loop, on SIGHUP): run with cfg from the next step on. cfg is copied; the keys
 * that need a restart must hold their running values (bd_config_reload_merge). The flusher takes
 * it at the start of a step, where no store call is in flight, applies what changed (flush.*,
 * buckets.max_late/max_future, summaries.interval/retention, spool.max_bytes, and the store's
 * write concern and retention), then calls the reconfigured callback with gen. A second call
 * before the first was taken replaces it. -ENOMEM if cfg cannot be copied.
 */
int bd_flusher_reconfigure(struct bd_flusher *f, const struct bd_config *cfg, uint64_t gen);
int bd_flusher_start(struct bd_flusher *f, struct bd_err *err);
/* Any thread: flush now instead of at the next interval. */
void bd_flusher_wake(struct bd_flusher *f);
/*
 * Final drain and flush, retried until deadline_mono_ns (bd_mono_ns() clock); joins the thread.
 * Call after ingest has stopped. Readings that could not be written by the deadline go to the
 * spool; what cannot be spooled is counted in readings_lost and logged with the reason.
 */
void bd_flusher_stop(struct bd_flusher *f, int64_t deadline_mono_ns);
void bd_flusher_free(struct bd_flusher *f);

/*
 * One step at monotonic time mono_ns and wall-clock time wall_ms: drain what the sensors hold
 * into the next batch, retry the batch being written when its retry is due, and when it is
 * settled, make the next batch the one written once it is due (stopping: now), settling every
 * update by its outcome. Flusher thread, or a unit test on a flusher that was never started.
 */
void bd_flusher_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping);

/* True when no reading waits: both batches settled, no sensor queued or on the requeue list. */
bool bd_flusher_idle(struct bd_flusher *f);

/* Tests: seed the backoff jitter (it is seeded from the clock), so that a run is repeatable. */
void bd_flusher_seed(struct bd_flusher *f, uint64_t seed);

/* Monotonic time of the next retry of a failed write (0: none scheduled). */
int64_t bd_flusher_retry_at(const struct bd_flusher *f);

/*
 * Test hook: the points of an unplaced spool record's life (src/flusher_place.c), in order.
 * fn(point, arg) is called on the flusher thread when one is reached (all flushers of the
 * process); NULL turns it off. Unit tests copy the spool directory there to play a crash.
 */
enum bd_flusher_place_point {
    BD_PLACE_APPENDED,  /* an unplaced record appended (and synced as spool.sync says) */
    BD_PLACE_LOADED,    /* at the head of the spool, loaded for placing */
    BD_PLACE_NUMBERED,  /* placed, numbered (writer state saved) and built, not journaled */
    BD_PLACE_JOURNALED, /* its placed form durable in the placing journal, nothing sent */
    BD_PLACE_SENT,      /* every placed update settled with MongoDB, the record not acked */
    BD_PLACE_ACKED,     /* acknowledged in the spool, the journal still there */
    BD_PLACE_RETIRED,   /* the acknowledgement durable, the journal removed */
};
void bd_flusher_place_hook(void (*fn)(int point, void *arg), void *arg);

/*
 * Give up writing what is not settled: put it on the spool (drained queues included), and count
 * what cannot be spooled in readings_lost, logging how many and why (MongoDB unreachable,
 * refusing, or still retrying; a full or failing spool). Returns the number lost.
 */
uint64_t bd_flusher_abandon(struct bd_flusher *f);

/* Route mongo-c-driver's log lines into bd_log (call once, after mongoc_init). */
void bd_flusher_install_driver_log(void);

#endif
