/*
 * The flusher's internals, shared by its source files: flusher.c (the step: drain, batch,
 * settle) and flusher_spool.c (batches to the spool and back). Flusher thread only, as the
 * fields below the "flusher thread only" line say.
 */
#ifndef BUCKETD_FLUSHER_INT_H
#define BUCKETD_FLUSHER_INT_H

#include <mongoc/mongoc.h>
#include <pthread.h>

#include "bucketd/batch.h"
#include "bucketd/deadletter.h"
#include "bucketd/flusher.h"
#include "bucketd/io.h"
#include "bucketd/log.h"
#include "bucketd/outcome.h"
#include "bucketd/pages.h"
#include "bucketd/replay.h"
#include "bucketd/settle.h"
#include "bucketd/spool.h"
#include "bucketd/summaries.h"
#include "bucketd/writer.h"

/* Readings the deltas may hold before they are written ahead of the interval (~50 MB). */
#define MAX_QUEUED (UINT64_C(1) << 20)

struct bd_flusher {
    /*
     * The configuration this thread runs with: cfg_own, its own copy, which nothing else reads
     * (the daemon's copy may change on the loop thread at any time). A reload hands the next one
     * over in cfg_next (under mu); the step adopts it first thing, where no store call is in
     * flight (flusher_reload.c), and frees the one it replaced.
     */
    const struct bd_config *cfg; /* == cfg_own */
    struct bd_config *cfg_own;
    struct bd_config *cfg_next; /* guarded by mu; NULL: none waiting */
    uint64_t cfg_next_gen;      /* guarded by mu */
    bd_flusher_reconfigured_cb reconfigured;
    void *reconfigured_arg;
    struct bd_sensor_table *table;
    struct bd_stats *stats;

    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool wake_pending;     /* guarded by mu */
    bool stop;             /* guarded by mu */
    int64_t stop_deadline; /* guarded by mu */

    bd_flusher_drained_cb drained;
    void *drained_arg;

    /* ---- flusher thread only ---- */
    struct bd_store *store;     /* NULL with the blackhole sink */
    struct bd_deadletter *dead; /* NULL with the blackhole sink */
    struct bd_io *io;           /* runs store calls while draining goes on; NULL: inline */
    /* The batch being written (or waiting for its retry) and the next one, being filled. */
    struct bd_batch batch, fill;
    struct bd_pages_limits lim;
    uint64_t batch_id;          /* the batch being written, or the last one; starts at 1 */
    uint64_t fill_id;           /* always batch_id + 1 */
    struct bd_sensor *requeued; /* sensors whose drain an allocation failure interrupted */
    struct bd_sensor *evicted;  /* evicted sensors not released yet (flusher_evict.c) */

    uint64_t queued;      /* readings in the fill batch */
    uint64_t fill_bytes;  /* estimated memory of the fill batch's readings */
    uint64_t batch_bytes; /* the same for the batch being written */
    uint64_t budget;      /* limits.memory / 2: both batches together */
    int64_t send_at;      /* monotonic ns of the next scheduled write */
    uint32_t attempt;     /* consecutive failed attempts */
    int64_t retry_at;     /* monotonic ns of the next attempt, 0 = none */
    uint32_t chunk_max;   /* updates per bulk: flush.max_updates, halved after a driver refusal */
    uint32_t chunk_cap;   /* what the chunk arrays below hold (flush.max_updates, or more) */
    uint64_t rng;         /* xorshift state for jitter */
    bool clean_stop;      /* not started, or the thread ended through its stop path */
    enum bd_bulk_cause last_cause; /* why the last failed attempt failed */
    char last_error[512];
    /* The settle engine, shared with the spool replay: its store runner, and the log limits. */
    struct bd_settle settle;

    /* One chunk's updates, built before it is sent (flush.max_updates each). */
    uint32_t *ops;
    bson_t *selectors, *updates;
    const bson_t **sel_ptrs, **upd_ptrs;
    struct bd_op_outcome *outcomes;
    uint32_t *readback;

    struct bd_writer *writer; /* NULL with the blackhole sink */

    /* The on-disk spool (NULL with the blackhole sink), the record being replayed from it, and
     * the payload being encoded into it. */
    struct bd_spool *spool;
    struct bd_replay *replay;
    uint64_t replay_id;
    struct bd_replay_buf spool_buf;
    struct bd_ratelimit spool_log;
    /* Wall clock of the oldest reading in the spool, as far as this run knows (0: empty). */
    int64_t spool_oldest_ms;
    char writer_key[160]; /* "w.<writer_id>" */
    bool seq_known;       /* the sequence is past every number in the documents */
    bool have_seq;        /* batch_seq belongs to the pending batch */
    uint64_t batch_seq;
    uint64_t run_first_seq; /* the first sequence number this run took (0: none yet) */
    int64_t stop_by;        /* flusher thread: the stop's monotonic deadline once seen (0: none) */
    int64_t learn_horizon_ms; /* buckets starting at or before this may hold earlier pages */
    int64_t batch_max_start_ms;

    /* Buckets whose summary documents are due a refresh (NULL: summaries off, or no store). */
    struct bd_summaries *sums;
    int64_t sums_next_ms; /* wall clock of the next round */
    struct bd_ratelimit sums_log;
};

/* flusher.c */
/* The batch being written takes the next number of the writer sequence (saved first). */
int take_sequence(struct bd_flusher *f, struct bd_err *err);
int build_one(struct bd_flusher *f, uint32_t di, uint32_t n, int64_t wall_ms);
void note_failure(struct bd_flusher *f, enum bd_bulk_cause cause, const char *msg);
void schedule_retry(struct bd_flusher *f, int64_t mono_ns);
void batch_done(struct bd_flusher *f);
bool fill_due(const struct bd_flusher *f, int64_t mono_ns, bool stopping);
void swap_in_fill(struct bd_flusher *f);
bool over_budget(const struct bd_flusher *f);
void flusher_run_io(void *arg, bd_io_fn fn, void *fn_arg);
/* Drain the sensor queues into the fill batch (up to the memory budget). */
void flusher_drain(struct bd_flusher *f, int64_t wall_ms);
/* Drain this sensor first at the next drain (it has readings left). */
void requeue(struct bd_flusher *f, struct bd_sensor *s);

/* flusher_evict.c */
/* Take the sensors the ingest thread evicted; release those no batch refers to any more. */
void flusher_evict_step(struct bd_flusher *f);
/* At free: release every evicted sensor still held (the batches are closed). */
void flusher_evict_close(struct bd_flusher *f);

/* flusher_spool.c */
/* The store's prepare (connect, indexes) on the I/O thread, draining meanwhile. */
bool flusher_prepare_store(struct bd_flusher *f, bson_error_t *error);
int flusher_spool_open(struct bd_flusher *f, struct bd_err *err);
void flusher_spool_close(struct bd_flusher *f);
/* The spool holds records not yet replayed (or one being replayed). */
bool flusher_spool_active(const struct bd_flusher *f);
/* Put what the batch being written has pending onto the spool; true when nothing is left. */
bool flusher_spool_batch(struct bd_flusher *f, int64_t wall_ms);
/* The step's part when the spool is active (see flusher.c): returns once done for now. */
void flusher_spool_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping);
/* A stop's deadline passed: spool everything still in memory that can be. */
void flusher_spool_everything(struct bd_flusher *f, int64_t wall_ms);
/* Copy the spool's counters and gauges into the daemon's stats. */
void flusher_spool_stats(struct bd_flusher *f);
/* Wall clock of the oldest spooled reading (0: none). A spool left by an earlier run counts from
 * this start: its records carry no time. */
int64_t flusher_spool_oldest_ms(const struct bd_flusher *f);

/* flusher_reload.c */
/* (Re)allocate the chunk arrays (ops .. readback) for max updates a bulk; -ENOMEM keeps the old
 * ones. Between steps only: they are scratch space of one send. */
int flusher_chunk_alloc(struct bd_flusher *f, uint32_t max);
void flusher_chunk_free(struct bd_flusher *f);
/* Start of a step: adopt the configuration a reload handed over, if any. */
void flusher_reload_adopt(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms);

/* flusher_summaries.c */
int flusher_summaries_open(struct bd_flusher *f, struct bd_err *err);
/* Buckets left unrefreshed are counted and logged, saying why (a stop, a reload). */
void flusher_summaries_close(struct bd_flusher *f, const char *why);
/* After the step: a round of refreshes if one is due. */
void flusher_summaries_step(struct bd_flusher *f, int64_t wall_ms, bool stopping);
/* Buckets waiting for a refresh. */
uint32_t flusher_summaries_pending(const struct bd_flusher *f);

#endif
