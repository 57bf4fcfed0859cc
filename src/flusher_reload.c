/*
 * The flusher's part in a reload (SIGHUP, see reload.h): the loop thread hands over a new
 * configuration with bd_flusher_reconfigure(); the flusher adopts it at the start of its next
 * step.
 *
 * Why a copy handed over under the mutex and adopted at a safe point, rather than fields the
 * loop changes in place (atomics): a step reads many keys together (an interval with the retry
 * settings, max_updates with the arrays sized for it, the time window with the page limits), and
 * a store call on the I/O thread reads the store's settings while it runs. Adopting a whole
 * snapshot at the start of a step, where no store call is in flight (bd_io_run has returned),
 * gives every key of one step the same configuration, lets derived state (the chunk arrays, the
 * page limits, the summary set, the spool's cap, the store's write concern) change with it, and
 * keeps every read of f->cfg a plain read on this thread: nothing else reads cfg_own, and the
 * mutex orders the hand-over, so ThreadSanitizer has nothing to report.
 *
 * Threads: bd_flusher_reconfigure and bd_flusher_set_reconfigured run on any thread (the loop);
 * flusher_reload_adopt on the flusher thread (or a unit test stepping a flusher it never
 * started).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/log.h"
#include "flusher_int.h"

void bd_flusher_set_reconfigured(struct bd_flusher *f, bd_flusher_reconfigured_cb cb, void *arg) {
    f->reconfigured = cb;
    f->reconfigured_arg = arg;
}

int bd_flusher_reconfigure(struct bd_flusher *f, const struct bd_config *cfg, uint64_t gen) {
    struct bd_config *copy = bd_malloc(sizeof(*copy));
    if (copy == NULL) {
        return -ENOMEM;
    }
    *copy = *cfg;
    pthread_mutex_lock(&f->mu);
    struct bd_config *replaced = f->cfg_next;
    f->cfg_next = copy;
    f->cfg_next_gen = gen;
    /* Adopted at the next step: wake the thread rather than wait out the old interval. */
    f->wake_pending = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    free(replaced);
    return 0;
}

/* The arrays one bulk is built in, at start (setup) and when a reload raises flush.max_updates. */
void flusher_chunk_free(struct bd_flusher *f) {
    void *arrays[] = {f->ops,      f->selectors, f->updates, f->sel_ptrs,
                      f->upd_ptrs, f->outcomes,  f->readback};
    for (size_t i = 0; i < BD_ARRAY_LEN(arrays); i++) {
        free(arrays[i]);
    }
}

int flusher_chunk_alloc(struct bd_flusher *f, uint32_t max) {
    /* A flusher struct only as the holder of the new arrays: flusher_chunk_free frees either
     * set. */
    struct bd_flusher fresh = {
        .ops = bd_calloc(max, sizeof(*f->ops)),
        /* bson_t is declared 128-byte aligned: calloc does not promise that. */
        .selectors = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)max * sizeof(*f->selectors)),
        .updates = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)max * sizeof(*f->updates)),
        .sel_ptrs = bd_calloc(max, sizeof(*f->sel_ptrs)),
        .upd_ptrs = bd_calloc(max, sizeof(*f->upd_ptrs)),
        .outcomes = bd_calloc(max, sizeof(*f->outcomes)),
        .readback = bd_calloc(max, sizeof(*f->readback)),
    };
    if (fresh.ops == NULL || fresh.selectors == NULL || fresh.updates == NULL ||
        fresh.sel_ptrs == NULL || fresh.upd_ptrs == NULL || fresh.outcomes == NULL ||
        fresh.readback == NULL) {
        flusher_chunk_free(&fresh);
        return -ENOMEM;
    }
    flusher_chunk_free(f);
    f->ops = fresh.ops;
    f->selectors = fresh.selectors;
    f->updates = fresh.updates;
    f->sel_ptrs = fresh.sel_ptrs;
    f->upd_ptrs = fresh.upd_ptrs;
    f->outcomes = fresh.outcomes;
    f->readback = fresh.readback;
    f->chunk_cap = max;
    return 0;
}

/* flush.max_updates sizes the arrays one bulk is built in: they grow with it (never shrink: a
 * larger array holds a smaller bulk). If they cannot grow, the running value stays. */
static void adopt_max_updates(struct bd_flusher *f, struct bd_config *next) {
    uint32_t want = next->flush.max_updates;
    if (want > f->chunk_cap && flusher_chunk_alloc(f, want) < 0) {
        bd_error("flusher: out of memory for flush.max_updates %u; keeping %u", want,
                 f->cfg->flush.max_updates);
        next->flush.max_updates = f->cfg->flush.max_updates;
        return;
    }
    /* A bulk halved after a driver refusal stays halved until it succeeds (write_pending
     * restores the configured size then). */
    f->chunk_max = f->attempt > 0 ? BD_MIN(f->chunk_max, want) : want;
}

static void adopt_summaries(struct bd_flusher *f, const struct bd_config *prev, int64_t wall_ms) {
    uint64_t was = prev->summaries.interval_ms, now = f->cfg->summaries.interval_ms;
    if (was != 0 && now == 0) {
        flusher_summaries_close(f, "summaries were turned off (summaries.interval: 0)");
        return;
    }
    if (was == 0 && now != 0) {
        struct bd_err err = {0};
        if (flusher_summaries_open(f, &err) < 0) {
            bd_error("%s: summaries stay off until the next reload", err.msg);
        }
        f->sums_next_ms = 0; /* the first round is one interval from the next step */
        return;
    }
    if (f->sums != NULL && now < was && f->sums_next_ms > wall_ms + (int64_t)now) {
        f->sums_next_ms = wall_ms + (int64_t)now; /* a shorter interval counts from now */
    }
}

void flusher_reload_adopt(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms) {
    pthread_mutex_lock(&f->mu);
    struct bd_config *next = f->cfg_next;
    uint64_t gen = f->cfg_next_gen;
    f->cfg_next = NULL;
    pthread_mutex_unlock(&f->mu);
    if (next == NULL) {
        return;
    }
    struct bd_config *prev = f->cfg_own;

    adopt_max_updates(f, next);
    f->lim.max_late_ms = next->buckets.max_late_ms;
    f->lim.max_future_ms = next->buckets.max_future_ms;
    int64_t interval_ns = (int64_t)next->flush.interval_ms * BD_NS_PER_MS;
    if (f->send_at > mono_ns + interval_ns) {
        f->send_at = mono_ns + interval_ns; /* a shorter interval counts from now */
    }
    if (f->spool != NULL) {
        bd_spool_set_max_bytes(f->spool, next->spool.max_bytes);
    }
    if (f->store != NULL && f->store->ops->reconfigure != NULL) {
        f->store->ops->reconfigure(f->store, next);
    }
    f->cfg_own = next;
    f->cfg = next;
    f->settle.cfg = next;
    adopt_summaries(f, prev, wall_ms);
    free(prev);
    if (f->reconfigured != NULL) {
        f->reconfigured(f->reconfigured_arg, gen);
    }
    if (f->store != NULL) {
        /* Indexes and retention as now configured, without waiting for the next write (an idle
         * daemon may have none for long). A failure is the store's to log; writes retry it. */
        bson_error_t berr;
        (void)flusher_prepare_store(f, &berr);
    }
}
