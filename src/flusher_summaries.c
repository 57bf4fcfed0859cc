/*
 * The flusher's part in the summary documents (include/bucketd/summaries.h): every bucket page
 * MongoDB acknowledged marks its bucket; once per summaries.interval, while nothing else is
 * waiting to be written, the marked buckets' summaries are recomputed, flush.max_updates buckets
 * per aggregate, on the I/O thread (draining goes on meanwhile). A refresh that fails leaves its
 * buckets marked for the next round: nothing about the readings depends on it, so it is never
 * retried ahead of them. At a stop, the buckets marked are refreshed once everything else is
 * written; those that cannot be (MongoDB away, the deadline) are counted and logged. The marks
 * are the settle engine's (settle.h: f->settle.sums is this set). Flusher thread only; calls
 * only the I/O runner below it.
 */
#include "flusher_summaries.h"

#include "flusher_int.h"
#include "flusher_io.h"

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
    if (bd_summaries_new(&f->sums.set) < 0) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    f->settle.sums = f->sums.set;
    f->sums.log.interval_ns = 10 * BD_NS_PER_S;
    f->sums.log.burst = 1;
    return 0;
}

void flusher_summaries_close(struct bd_flusher *f, const char *why) {
    if (f->sums.set == NULL) {
        return;
    }
    uint64_t left =
        (uint64_t)bd_summaries_waiting(f->sums.set) + bd_summaries_in_round(f->sums.set);
    if (left > 0) {
        BD_STAT_ADD(f->stats, summary_buckets_skipped, left);
        bd_warn("the summary documents of %" PRIu64 " buckets were not refreshed before %s; "
                "they miss the readings written last until their buckets are written again "
                "(bucketd-inspect summaries rebuilds them)",
                left, why);
    }
    bd_summaries_free(f->sums.set);
    f->sums.set = NULL;
    f->settle.sums = NULL;
}

/* Is it time for a round: the interval passed (or a stop with everything else written), and no
 * batch waits for MongoDB. */
static bool round_due(const struct bd_flusher *f, enum flusher_mode mode, bool idle,
                      int64_t wall_ms, bool stopping) {
    if (mode != FLUSHER_WRITING) {
        return false;
    }
    if (stopping) {
        return idle;
    }
    return wall_ms >= f->sums.next_ms;
}

void flusher_summaries_step(struct bd_flusher *f, enum flusher_mode mode, bool idle,
                            int64_t wall_ms, bool stopping) {
    if (f->sums.set == NULL) {
        return;
    }
    if (f->sums.next_ms == 0) {
        f->sums.next_ms = wall_ms + (int64_t)f->cfg->summaries.interval_ms; /* the first round */
    }
    if (!round_due(f, mode, idle, wall_ms, stopping)) {
        return;
    }
    f->sums.next_ms = wall_ms + (int64_t)f->cfg->summaries.interval_ms;
    if (bd_summaries_begin(f->sums.set) == 0) {
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
           (n = bd_summaries_next(f->sums.set, keys, max)) > 0) {
        struct bd_store_call call = {.kind = BD_CALL_REFRESH, .keys = keys, .n = n, .error = &berr};
        if (!flusher_io_call(f, &call)) {
            BD_STAT_ADD(f->stats, summary_refresh_errors, 1);
            if (bd_ratelimit_ok(&f->sums.log, bd_mono_ns())) {
                bd_error("refreshing the summary documents of %u buckets failed (code %u: %s); "
                         "trying again in %" PRIu64 " ms",
                         n, berr.code, berr.message, f->cfg->summaries.interval_ms);
            }
            uint32_t lost = bd_summaries_requeue(f->sums.set);
            BD_STAT_ADD(f->stats, summary_buckets_skipped, lost);
            break;
        }
        bd_summaries_advance(f->sums.set, n);
        BD_STAT_ADD(f->stats, summary_refreshes, 1);
        BD_STAT_ADD(f->stats, summary_buckets_refreshed, n);
        if (!stopping) {
            /* Readings drained meanwhile come first: the rest of the round goes on at the
             * next step. */
            if (bd_summaries_in_round(f->sums.set) > 0) {
                f->sums.next_ms = wall_ms;
            }
            break;
        }
    }
    free(keys);
}

uint32_t flusher_summaries_pending(const struct bd_flusher *f) {
    return f->sums.set == NULL
               ? 0
               : bd_summaries_waiting(f->sums.set) + bd_summaries_in_round(f->sums.set);
}

void flusher_summaries_adopt(struct bd_flusher *f, const struct bd_config *prev, int64_t wall_ms) {
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
        f->sums.next_ms = 0; /* the first round is one interval from the next step */
        return;
    }
    if (f->sums.set != NULL && now < was && f->sums.next_ms > wall_ms + (int64_t)now) {
        f->sums.next_ms = wall_ms + (int64_t)now; /* a shorter interval counts from now */
    }
}
