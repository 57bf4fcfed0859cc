/*
 * The flusher's part in the summary documents (include/bucketd/summaries.h): every bucket page
 * MongoDB acknowledged marks its bucket; once per summaries.interval, while nothing else is
 * waiting to be written, the marked buckets' summaries are recomputed, flush.max_updates buckets
 * per aggregate, on the I/O thread (draining goes on meanwhile). A refresh that fails leaves its
 * buckets marked for the next round: nothing about the readings depends on it, so it is never
 * retried ahead of them. At a stop, the buckets marked are refreshed once everything else is
 * written; those that cannot be (MongoDB away, the deadline) are counted and logged.
 * Flusher thread only.
 */
#include "flusher_int.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/escape.h"

int flusher_summaries_open(struct bd_flusher *f, struct bd_err *err) {
    if (f->store == NULL || f->cfg->summaries.interval_ms == 0 ||
        f->store->ops->refresh_summaries == NULL) {
        return 0;
    }
    if (bd_summaries_new(&f->sums) < 0) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    f->settle.sums = f->sums;
    f->sums_log.interval_ns = 10 * BD_NS_PER_S;
    f->sums_log.burst = 1;
    return 0;
}

void flusher_summaries_close(struct bd_flusher *f, const char *why) {
    if (f->sums == NULL) {
        return;
    }
    uint64_t left = (uint64_t)bd_summaries_waiting(f->sums) + bd_summaries_in_round(f->sums);
    if (left > 0) {
        BD_STAT_ADD(f->stats, summary_buckets_skipped, left);
        bd_warn("the summary documents of %" PRIu64 " buckets were not refreshed before %s; "
                "they miss the readings written last until their buckets are written again "
                "(bucketd-inspect summaries rebuilds them)",
                left, why);
    }
    bd_summaries_free(f->sums);
    f->sums = NULL;
    f->settle.sums = NULL;
}

/* Is it time for a round: the interval passed (or a stop with everything else written), and no
 * batch waits for MongoDB. */
static bool round_due(const struct bd_flusher *f, int64_t wall_ms, bool stopping) {
    if (bd_batch_pending_readings(&f->batch) > 0 || f->attempt > 0 || flusher_spool_active(f)) {
        return false;
    }
    if (stopping) {
        return bd_flusher_idle((struct bd_flusher *)f);
    }
    return wall_ms >= f->sums_next_ms;
}

void flusher_summaries_step(struct bd_flusher *f, int64_t wall_ms, bool stopping) {
    if (f->sums == NULL) {
        return;
    }
    if (f->sums_next_ms == 0) {
        f->sums_next_ms = wall_ms + (int64_t)f->cfg->summaries.interval_ms; /* the first round */
    }
    if (!round_due(f, wall_ms, stopping)) {
        return;
    }
    f->sums_next_ms = wall_ms + (int64_t)f->cfg->summaries.interval_ms;
    if (bd_summaries_begin(f->sums) == 0) {
        return;
    }
    const uint32_t max = BD_MAX(1, f->cfg->flush.max_updates);
    struct bd_page_key *keys = bd_calloc(max, sizeof(*keys));
    if (keys == NULL) {
        return; /* the round stays; the next step tries again */
    }
    bson_error_t berr = {0};
    uint32_t n;
    /* At a stop, no aggregate starts past the stop's deadline: the rest is counted. */
    while ((!stopping || f->stop_by == 0 || bd_mono_ns() < f->stop_by) &&
           (n = bd_summaries_next(f->sums, keys, max)) > 0) {
        struct bd_store_call call = {.kind = BD_CALL_REFRESH, .keys = keys, .n = n, .error = &berr};
        if (!bd_store_call(f->store, flusher_run_io, f, &call)) {
            BD_STAT_ADD(f->stats, summary_refresh_errors, 1);
            if (bd_ratelimit_ok(&f->sums_log, bd_mono_ns())) {
                bd_error("refreshing the summary documents of %u buckets failed (code %u: %s); "
                         "trying again in %" PRIu64 " ms",
                         n, berr.code, berr.message, f->cfg->summaries.interval_ms);
            }
            uint32_t lost = bd_summaries_requeue(f->sums);
            BD_STAT_ADD(f->stats, summary_buckets_skipped, lost);
            break;
        }
        bd_summaries_advance(f->sums, n);
        BD_STAT_ADD(f->stats, summary_refreshes, 1);
        BD_STAT_ADD(f->stats, summary_buckets_refreshed, n);
        if (!stopping) {
            /* Readings drained meanwhile come first: the rest of the round goes on at the
             * next step. */
            if (bd_summaries_in_round(f->sums) > 0) {
                f->sums_next_ms = wall_ms;
            }
            break;
        }
    }
    free(keys);
}

uint32_t flusher_summaries_pending(const struct bd_flusher *f) {
    return f->sums == NULL ? 0 : bd_summaries_waiting(f->sums) + bd_summaries_in_round(f->sums);
}
