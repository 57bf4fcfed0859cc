/*
 * What every part of the flusher shares: struct bd_flusher, made of the life cycle's fields
 * (flusher.c), the state all parts read -- the two batches and their accounting, the page
 * limits, the store, the settle engine -- and one sub-struct per part, each owned by its file:
 *
 *   flusher.c            the thread, bd_flusher_step and its mode, the life cycle
 *   flusher_reload.c     a configuration handed over by a reload        (struct flusher_reload)
 *   flusher_spool.c      the spool policy and its replay                (struct flusher_spool)
 *   flusher_place.c      placing unplaced spool records at replay       (struct flusher_place)
 *   flusher_writer.c     placement, sequence, building, settling, retry (struct flusher_writer)
 *   flusher_summaries.c  the summary refreshes                          (struct flusher_sums)
 *   flusher_drain.c      sensor queues into the fill batch, eviction    (struct flusher_drain)
 *   flusher_io.c         store calls on the I/O thread                  (struct flusher_io)
 *
 * Each file calls only the files below it in this list (and modules under the flusher: settle,
 * replay, batch, pages, store, ...); a lower part reaches a higher one only through a callback
 * it was given (the I/O runner's idle work, the drained callback). Internal names carry their
 * part's prefix, flusher_<part>_. Flusher thread only, but for the fields the mutex guards.
 */
#ifndef BUCKETD_FLUSHER_INT_H
#define BUCKETD_FLUSHER_INT_H

#include <pthread.h>

#include "bucketd/batch.h"
#include "bucketd/deadletter.h"
#include "bucketd/flusher.h"
#include "bucketd/pages.h"
#include "bucketd/settle.h"
#include "flusher_drain.h"
#include "flusher_io.h"
#include "flusher_mode.h"
#include "flusher_place.h"
#include "flusher_reload.h"
#include "flusher_spool.h"
#include "flusher_summaries.h"
#include "flusher_writer.h"

struct bd_flusher {
    /* ---- life cycle (flusher.c) ---- */
    /*
     * The configuration this thread runs with: cfg_own, its own copy, which nothing else reads
     * (the daemon's copy may change on the loop thread at any time). A reload hands the next one
     * over (struct flusher_reload, under mu); the step adopts it first thing, where no store
     * call is in flight, and frees the one it replaced.
     */
    const struct bd_config *cfg; /* == cfg_own */
    struct bd_config *cfg_own;
    struct bd_sensor_table *table;
    struct bd_stats *stats;

    pthread_t thread;
    bool started;
    /* The doorbell from the other threads (wake, stop, reload). */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool wake_pending;     /* guarded by mu */
    bool stop;             /* guarded by mu */
    int64_t stop_deadline; /* guarded by mu */

    /* ---- flusher thread only ---- */
    bool clean_stop; /* not started, or the thread ended through its stop path */
    int64_t stop_by; /* the stop's monotonic deadline once seen (0: none) */
    int64_t send_at; /* monotonic ns of the next scheduled write */

    /* ---- shared by the parts ---- */
    struct bd_store *store;     /* NULL with the blackhole sink */
    struct bd_deadletter *dead; /* NULL with the blackhole sink */
    /* The settle engine, shared with the spool replay: the store runner, the log limits. */
    struct bd_settle settle;
    /* The batch being written (or waiting for its retry) and the next one, being filled. */
    struct bd_batch batch, fill;
    /* The sensors' page accounting of one slot (the others' is on the heap). */
    struct bd_pages_pool pages_pool;
    struct bd_pages_limits lim;
    uint64_t batch_id;        /* the batch being written, or the last one; starts at 1 */
    uint64_t fill_id;         /* always batch_id + 1 */
    uint64_t queued;          /* readings in the fill batch */
    uint64_t fill_bytes;      /* estimated memory of the fill batch's readings */
    uint64_t batch_bytes;     /* the same for the batch being written */
    uint64_t budget;          /* limits.memory / 2: both batches together */
    int64_t learn_horizon_ms; /* buckets starting at or before this may hold earlier pages */

    /* ---- the parts ---- */
    struct flusher_io io;
    struct flusher_drain drain;
    struct flusher_sums sums;
    struct flusher_writer writer;
    struct flusher_spool spool;
    struct flusher_place place;
    struct flusher_reload reload;
};

/* The two batches' readings have reached their half of limits.memory: draining stops. */
static inline bool flusher_over_budget(const struct bd_flusher *f) {
    return f->batch_bytes + f->fill_bytes >= f->budget;
}

/* Memory ran out doing what (rate-limited, one limiter for the whole flusher). */
static inline void flusher_log_oom(struct bd_flusher *f, const char *what) {
    bd_settle_log_oom(&f->settle, what);
}

#endif
