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
 * started). Each part adopts its own keys (the writer's chunk arrays, the spool's cap, the
 * summaries' interval); this file calls them, all below it, and flusher.c calls it.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/log.h"
#include "flusher_int.h"
#include "flusher_io.h"
#include "flusher_reload.h"
#include "flusher_spool.h"
#include "flusher_summaries.h"
#include "flusher_writer.h"

void bd_flusher_set_reconfigured(struct bd_flusher *f, bd_flusher_reconfigured_cb cb, void *arg) {
    f->reload.reconfigured = cb;
    f->reload.reconfigured_arg = arg;
}

int bd_flusher_reconfigure(struct bd_flusher *f, const struct bd_config *cfg, uint64_t gen) {
    struct bd_config *copy = bd_malloc(sizeof(*copy));
    if (copy == NULL) {
        return -ENOMEM;
    }
    *copy = *cfg;
    pthread_mutex_lock(&f->mu);
    struct bd_config *replaced = f->reload.cfg_next;
    f->reload.cfg_next = copy;
    f->reload.cfg_next_gen = gen;
    /* Adopted at the next step: wake the thread rather than wait out the old interval. */
    f->wake_pending = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    free(replaced);
    return 0;
}

void flusher_reload_adopt(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms) {
    pthread_mutex_lock(&f->mu);
    struct bd_config *next = f->reload.cfg_next;
    uint64_t gen = f->reload.cfg_next_gen;
    f->reload.cfg_next = NULL;
    pthread_mutex_unlock(&f->mu);
    if (next == NULL) {
        return;
    }
    struct bd_config *prev = f->cfg_own;

    flusher_writer_adopt_max_updates(f, next);
    f->lim.max_late_ms = next->buckets.max_late_ms;
    f->lim.max_future_ms = next->buckets.max_future_ms;
    int64_t interval_ns = (int64_t)next->flush.interval_ms * BD_NS_PER_MS;
    if (f->send_at > mono_ns + interval_ns) {
        f->send_at = mono_ns + interval_ns; /* a shorter interval counts from now */
    }
    flusher_spool_set_max_bytes(f, next->spool.max_bytes);
    if (f->store != NULL && f->store->ops->reconfigure != NULL) {
        f->store->ops->reconfigure(f->store, next);
    }
    f->cfg_own = next;
    f->cfg = next;
    f->settle.cfg = next;
    flusher_summaries_adopt(f, prev, wall_ms);
    free(prev);
    if (f->reload.reconfigured != NULL) {
        f->reload.reconfigured(f->reload.reconfigured_arg, gen);
    }
    if (f->store != NULL) {
        /* Indexes and retention as now configured, without waiting for the next write (an idle
         * daemon may have none for long). A failure is the store's to log; writes retry it. */
        bson_error_t berr;
        (void)flusher_io_prepare(f, &berr);
    }
}
