/*
 * The flusher's writer side (src/flusher_writer.h): the batch being written, from the moment
 * the fill batch becomes it until every update of it is settled. Flusher thread only; its store
 * calls go through the I/O runner (flusher_io.h), so the drain goes on meanwhile.
 *
 *   placement  a bucket whose pages were unknown when its readings were drained (an earlier
 *              run's, an evicted sensor's) has them looked up first (learn_pages), and readings
 *              move to new pages when an update is too large (place_readings);
 *   sequence   each batch takes one number from the writer sequence (writer.h), recovered from
 *              the collection on a first start; every update carries it (bucket.c), so a retry
 *              re-sends the same updates with the same number and the filter applies each once;
 *   building   one update per delta, split before it is sent if over BD_UPDATE_MAX_BYTES;
 *   settling   by the settle engine (settle.h), this batch being its host: what each answer
 *              means, read-backs, quarantine;
 *   retry      a batch with updates pending is tried again after a backoff with full jitter.
 *
 * Every update is built under BD_UPDATE_MAX_BYTES, so the driver's client-side size refusal is a
 * safety net: the bulk is then halved until the refused update is alone, and that one is treated
 * as too large. A slot that the batch being written still has readings in is pinned so the drain
 * cannot reuse it; a bucket whose pages were unknown when its readings were drained into the
 * fill batch is placed right after the batch being written learns it (learn_chunk), before any
 * later reading is placed from the slot.
 *
 * Calls the I/O runner below it; never the spool policy, the reload or flusher.c above it.
 */
#include "flusher_writer.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/log.h"
#include "bucketd/pages.h"
#include "bucketd/settle.h"
#include "flusher_int.h"
#include "flusher_io.h"

static void report_previous_run(const struct bd_flusher *f) {
    const struct bd_writer_prev *p = bd_writer_previous(f->writer.state);
    BD_GAUGE_SET(f->stats, previous_stop_readings_lost, p->lost_at_stop);
    if (p->lost_at_stop > 0) {
        bd_warn("the previous stop of writer %s gave up %" PRIu64
                " readings (readings_lost; its log says why)",
                p->writer_id, p->lost_at_stop);
    }
    if (!p->found) {
        bd_info("no writer state in %s: the flush sequence of writer %s will be read from the "
                "bucket documents before the first write",
                f->cfg->spool.dir, f->cfg->writer_id);
    } else if (!p->clean) {
        char when[64] = "never";
        if (p->last_ack_ms > 0) {
            time_t t = (time_t)(p->last_ack_ms / 1000);
            struct tm tm;
            gmtime_r(&t, &tm);
            strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
        }
        bd_warn("the previous run of writer %s did not stop cleanly (killed or crashed): "
                "readings it accepted after its last acknowledged write (at or up to a "
                "minute after %s) and before it ended were lost; nothing it wrote will be "
                "written twice",
                p->writer_id, when);
    }
}

int flusher_writer_open(struct bd_flusher *f, struct bd_err *err) {
    int rc = bd_writer_open(&f->writer.state, f->cfg->spool.dir, f->cfg->writer_id, err);
    if (rc < 0) {
        return rc;
    }
    f->writer.seq_known = bd_writer_previous(f->writer.state)->found;
    int64_t horizon = bd_now_ns() / BD_NS_PER_MS + (int64_t)f->cfg->buckets.max_future_ms;
    f->learn_horizon_ms = BD_MAX(horizon, bd_writer_max_bucket_start(f->writer.state));
    report_previous_run(f);
    return 0;
}

/* ---- the chunk arrays ---------------------------------------------------------------------- */

/* The arrays one bulk is built in, at start (setup) and when a reload raises flush.max_updates. */
static void free_arrays(struct flusher_writer *w) {
    void *arrays[] = {w->ops,      w->selectors, w->updates, w->sel_ptrs,
                      w->upd_ptrs, w->outcomes,  w->readback};
    for (size_t i = 0; i < BD_ARRAY_LEN(arrays); i++) {
        free(arrays[i]);
    }
}

void flusher_writer_chunk_free(struct bd_flusher *f) {
    free_arrays(&f->writer);
}

int flusher_writer_chunk_alloc(struct bd_flusher *f, uint32_t max) {
    struct flusher_writer *w = &f->writer;
    struct flusher_writer fresh = {
        .ops = bd_calloc(max, sizeof(*w->ops)),
        /* bson_t is declared 128-byte aligned: calloc does not promise that. */
        .selectors = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)max * sizeof(*w->selectors)),
        .updates = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)max * sizeof(*w->updates)),
        .sel_ptrs = bd_calloc(max, sizeof(*w->sel_ptrs)),
        .upd_ptrs = bd_calloc(max, sizeof(*w->upd_ptrs)),
        .outcomes = bd_calloc(max, sizeof(*w->outcomes)),
        .readback = bd_calloc(max, sizeof(*w->readback)),
    };
    if (fresh.ops == NULL || fresh.selectors == NULL || fresh.updates == NULL ||
        fresh.sel_ptrs == NULL || fresh.upd_ptrs == NULL || fresh.outcomes == NULL ||
        fresh.readback == NULL) {
        free_arrays(&fresh);
        return -ENOMEM;
    }
    free_arrays(w);
    w->ops = fresh.ops;
    w->selectors = fresh.selectors;
    w->updates = fresh.updates;
    w->sel_ptrs = fresh.sel_ptrs;
    w->upd_ptrs = fresh.upd_ptrs;
    w->outcomes = fresh.outcomes;
    w->readback = fresh.readback;
    w->chunk_cap = max;
    return 0;
}

/* flush.max_updates sizes the arrays one bulk is built in: they grow with it (never shrink: a
 * larger array holds a smaller bulk). If they cannot grow, the running value stays. */
void flusher_writer_adopt_max_updates(struct bd_flusher *f, struct bd_config *next) {
    uint32_t want = next->flush.max_updates;
    if (want > f->writer.chunk_cap && flusher_writer_chunk_alloc(f, want) < 0) {
        bd_error("flusher: out of memory for flush.max_updates %u; keeping %u", want,
                 f->cfg->flush.max_updates);
        next->flush.max_updates = f->cfg->flush.max_updates;
        return;
    }
    /* A bulk halved after a driver refusal stays halved until it succeeds (flusher_writer_write
     * restores the configured size then). */
    f->writer.chunk_max = f->writer.attempt > 0 ? BD_MIN(f->writer.chunk_max, want) : want;
}

/* ---- pages ------------------------------------------------------------------------------- */

/* How the readings of a delta get their pages again. */
enum place_mode {
    PLACE_LEARNED,  /* the bucket's stored pages were just read back */
    PLACE_RELOCATE, /* the current page cannot take them: start after it */
    PLACE_KNOWN,    /* the slot just became known: continue from it */
};

/*
 * Put the readings [keep, n) of delta di of batch b on pages from its bucket's slot: after a
 * look-up (learned page/count/bytes), on new pages after the bucket's last one, or from a slot
 * that a look-up for the other batch just made known. All or nothing: the target deltas are
 * created and given room first, then the readings move (which cannot fail), then the slot is
 * updated. -ENOMEM leaves everything as it was.
 */
static int place_readings(struct bd_flusher *f, struct bd_batch *b, uint32_t di, uint32_t keep,
                          enum place_mode mode, uint32_t page, uint32_t count, uint64_t bytes) {
    const uint64_t id = b == &f->batch ? f->batch_id : f->fill_id;
    struct bd_delta *d = &b->deltas[di];
    struct bd_sensor *s = d->sensor;
    const int64_t start = d->start_ms;
    const uint32_t n = d->n_readings;
    struct bd_page_slot *slot = bd_pages_find(s->flusher_state, &f->lim, start);
    BD_ASSERT(slot != NULL); /* a slot with readings in the pending batch is never dropped */
    struct bd_page_slot next = *slot;
    if (mode == PLACE_LEARNED) {
        bd_pages_learn(&next, page, count, bytes);
    } else if (mode == PLACE_RELOCATE) {
        bd_pages_close_page(&next);
    }
    const uint64_t overhead = bd_page_overhead_bytes(s);
    uint32_t *first = bd_malloc((size_t)(n - keep + 1) * sizeof(*first));
    uint32_t *pages = bd_malloc((size_t)(n - keep + 1) * sizeof(*pages));
    int64_t *target = bd_malloc((size_t)(n - keep + 1) * sizeof(*target));
    uint32_t groups = 0, had = b->n;
    int rc = 0;
    if (first == NULL || pages == NULL || target == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    /* Runs of consecutive readings on one page: pages only grow as readings are placed. */
    for (uint32_t i = keep; i < n; i++) {
        uint32_t p = bd_pages_place(&next, &f->lim, bd_delta_reading_bytes(d, i), overhead);
        if (groups == 0 || pages[groups - 1] != p) {
            first[groups] = i;
            pages[groups] = p;
            groups++;
        }
    }
    for (uint32_t g = 0; g < groups; g++) {
        target[g] = bd_batch_get(b, s, start, pages[g]);
        if (target[g] < 0) {
            rc = -ENOMEM;
            goto out;
        }
        BD_ASSERT((uint32_t)target[g] != di);
    }
    d = &b->deltas[di]; /* bd_batch_get may have moved it */
    for (uint32_t g = 0; g < groups; g++) {
        uint32_t end = g + 1 < groups ? first[g + 1] : n;
        uint32_t values =
            (end < n ? d->readings[end].first : d->n_values) - d->readings[first[g]].first;
        if (bd_delta_reserve(&b->deltas[target[g]], end - first[g], values) < 0) {
            rc = -ENOMEM;
            goto out;
        }
    }
    /* Each run copied to its page's delta, then the source cut once (its summaries folded
     * again once, not once per page: a long delta spread over many pages stays linear). */
    for (uint32_t g = 0; g < groups; g++) {
        uint32_t end = g + 1 < groups ? first[g + 1] : n;
        int moved = bd_delta_copy_readings(d, first[g], end, &b->deltas[target[g]]);
        BD_ASSERT(moved == 0); /* room was made above */
        /* Readings moved for their size keep their count of refusals, so a page that MongoDB
         * refuses whatever its size cannot move them on forever. */
        struct bd_batch_meta *tm = &b->meta[target[g]];
        tm->refusals = BD_MAX(tm->refusals, b->meta[di].refusals);
    }
    bd_delta_truncate(d, keep);
    /* The fill batch may have placed readings here already: its id stays. */
    next.batch = BD_MAX(next.batch, id);
    *slot = next;
    if (d->n_readings == 0) {
        b->meta[di].done = true;
    }
out:
    if (rc < 0) {
        bd_batch_truncate(b, had);
    }
    free(first);
    free(pages);
    free(target);
    return rc;
}

/* ---- settling ----------------------------------------------------------------------------- */

/* The settle engine's view of the batch being written. */
static void delta_get(void *arg, uint32_t di, struct bd_settle_upd *u) {
    const struct bd_flusher *f = arg;
    const struct bd_delta *d = &f->batch.deltas[di];
    const struct bd_batch_meta *m = &f->batch.meta[di];
    *u = (struct bd_settle_upd){.sensor_id = bd_sensor_id(d->sensor),
                                .start_ms = d->start_ms,
                                .page = d->page,
                                .n_readings = d->n_readings,
                                .done = m->done,
                                .maybe_applied = m->maybe_applied,
                                .refusals = m->refusals,
                                .dup_checks = m->dup_checks};
}

static void delta_put(void *arg, uint32_t di, const struct bd_settle_upd *u) {
    struct bd_batch_meta *m = &((struct bd_flusher *)arg)->batch.meta[di];
    m->done = u->done;
    m->maybe_applied = u->maybe_applied;
    m->refusals = u->refusals;
    m->dup_checks = u->dup_checks;
}

static int delta_relocate(void *arg, uint32_t di, uint32_t keep) {
    struct bd_flusher *f = arg;
    return place_readings(f, &f->batch, di, keep, PLACE_RELOCATE, 0, 0, 0);
}

static struct bd_settle_host batch_host(struct bd_flusher *f) {
    return (struct bd_settle_host){.arg = f,
                                   .get = delta_get,
                                   .put = delta_put,
                                   .relocate = delta_relocate,
                                   .seq = f->writer.batch_seq,
                                   .what = ""};
}

/* ---- writing ------------------------------------------------------------------------------ */

void flusher_writer_note_failure(struct bd_flusher *f, enum bd_bulk_cause cause, const char *msg) {
    f->writer.last_cause = cause;
    snprintf(f->writer.last_error, sizeof(f->writer.last_error), "%s", msg);
    if (cause == BD_CAUSE_UNREACHABLE || cause == BD_CAUSE_CONNECTION) {
        bd_stats_mongodb_failed(f->stats);
    }
}

/*
 * Build the update of delta di into chunk position n. 0: built; 1: not to be sent now (it was
 * split, and its readings will come round again, or quarantined); -ENOMEM.
 */
int flusher_writer_build_one(struct bd_flusher *f, uint32_t di, uint32_t n, int64_t wall_ms) {
    for (;;) {
        struct bd_delta *d = &f->batch.deltas[di];
        bson_t *sel = &f->writer.selectors[n], *upd = &f->writer.updates[n];
        int rc = bd_delta_build_update(d, f->cfg->buckets.span_ms, f->writer.writer_key,
                                       f->writer.batch_seq, sel, upd);
        if (rc == 0 && (uint64_t)sel->len + upd->len <= BD_UPDATE_MAX_BYTES) {
            return 0;
        }
        if (rc == 0) {
            /* Too large as built: split it before anything is sent. */
            bool alone = d->n_readings == 1;
            const struct bd_settle_host host = batch_host(f);
            rc = bd_settle_shrink(&f->settle, &host, di, 10334,
                                  "the update of one reading is larger than MongoDB's 16 MiB "
                                  "document limit",
                                  sel, upd, wall_ms);
            bson_destroy(sel);
            bson_destroy(upd);
            if (rc < 0) {
                return rc;
            }
            if (alone) {
                return 1;
            }
            continue; /* the first half, built again */
        }
        bson_destroy(sel);
        bson_destroy(upd);
        return rc;
    }
}

int flusher_writer_build_into(struct bd_flusher *f, uint32_t di, struct bd_replay_buf *buf,
                              int64_t wall_ms) {
    if (f->batch.meta[di].done || f->batch.deltas[di].n_readings == 0) {
        f->batch.meta[di].done = true;
        return 1;
    }
    int rc = flusher_writer_build_one(f, di, 0, wall_ms);
    if (rc != 0) {
        return rc;
    }
    const struct bd_delta *d = &f->batch.deltas[di];
    rc = bd_replay_buf_add(buf, bd_sensor_id(d->sensor), d->start_ms, d->page, d->n_readings,
                           f->batch.meta[di].maybe_applied ? BD_REPLAY_MAYBE_SENT : 0,
                           &f->writer.selectors[0], &f->writer.updates[0]);
    bson_destroy(&f->writer.selectors[0]);
    bson_destroy(&f->writer.updates[0]);
    return rc;
}

/*
 * Send the chunk f->writer.ops[0..n) (built in f->writer.selectors/updates) and settle it. Returns the cause
 * of a failure, BD_CAUSE_NONE if every update applied.
 */
static enum bd_bulk_cause send_chunk(struct bd_flusher *f, uint32_t n, int64_t wall_ms) {
    struct bd_bulk_outcome bulk;
    for (uint32_t i = 0; i < n; i++) {
        f->writer.sel_ptrs[i] = &f->writer.selectors[i];
        f->writer.upd_ptrs[i] = &f->writer.updates[i];
    }
    const struct bd_settle_host host = batch_host(f);
    const struct bd_settle_chunk chunk = {.n = n,
                                          .items = f->writer.ops,
                                          .filters = f->writer.sel_ptrs,
                                          .updates = f->writer.upd_ptrs,
                                          .outcomes = f->writer.outcomes,
                                          .readback = f->writer.readback};
    enum bd_bulk_cause cause =
        bd_settle_send(&f->settle, &host, &chunk, &f->writer.chunk_max, &bulk, wall_ms);
    if (cause != BD_CAUSE_NONE) {
        flusher_writer_note_failure(f, cause, bulk.message);
    }
    for (uint32_t i = 0; i < n; i++) {
        bson_destroy(&f->writer.selectors[i]);
        bson_destroy(&f->writer.updates[i]);
    }
    return cause;
}

/* A store call before a batch's first write failed: log (rate-limited) what. */
static void log_lookup_failure(struct bd_flusher *f, const char *what, const char *msg) {
    if (bd_ratelimit_ok(&f->settle.fail_log, bd_mono_ns())) {
        bd_error("%s failed (%s); keeping %" PRIu64 " readings and retrying with backoff", what,
                 msg, bd_batch_pending_readings(&f->batch));
    }
}

/* Raise the sequence above a number found in the collection; false if it cannot be saved. */
static bool raise_sequence(struct bd_flusher *f, uint64_t seen) {
    struct bd_err err = {0};
    if (bd_writer_raise(f->writer.state, seen, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    return true;
}

/*
 * Without a writer state on disk (first start, or the spool directory was lost) the sequence
 * must continue above the highest number this writer id left in the collection, or the filter
 * would refuse its first updates.
 */
static bool recover_sequence(struct bd_flusher *f) {
    uint64_t seen = 0;
    bson_error_t berr;
    if (f->writer.seq_known) {
        return true;
    }
    struct bd_store_call call = {.kind = BD_CALL_MAX_SEQ, .seq = &seen, .error = &berr};
    if (!flusher_io_call(f, &call)) {
        flusher_writer_note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        log_lookup_failure(f, "MongoDB sequence look-up", berr.message);
        return false;
    }
    if (!raise_sequence(f, seen)) {
        return false;
    }
    f->writer.seq_known = true;
    bd_info("writer %s: flush sequence continues above %" PRIu64 " (highest in %s.%s)",
            f->cfg->writer_id, seen, f->cfg->mongodb.database, f->cfg->mongodb.collection);
    return true;
}

/* One unknown delta and the last page its bucket already has in MongoDB. */
struct learn_item {
    const char *sensor_id;
    int64_t start_ms;
    uint32_t delta;
    uint32_t page;
    uint32_t count; /* UINT32_MAX: no page found */
};

static int cmp_learn_key(const struct learn_item *x, const char *sensor_id, int64_t start_ms) {
    if (x->start_ms != start_ms) {
        return x->start_ms < start_ms ? -1 : 1;
    }
    return strcmp(x->sensor_id, sensor_id);
}

static int cmp_learn(const void *a, const void *b) {
    const struct learn_item *y = b;
    return cmp_learn_key(a, y->sensor_id, y->start_ms);
}

struct learn_ctx {
    struct learn_item *items;
    uint32_t n;
    uint64_t max_seq;
};

/* Fold one returned page into its item: the highest page wins. */
static void learn_page(void *arg, const struct bd_page_info *info) {
    struct learn_ctx *c = arg;
    c->max_seq = BD_MAX(c->max_seq, info->writer_seq);
    uint32_t lo = 0, hi = c->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int cmp = cmp_learn_key(&c->items[mid], info->sensor_id, info->start_ms);
        if (cmp == 0) {
            struct learn_item *item = &c->items[mid];
            if (info->page < BD_PAGE_UNKNOWN &&
                (item->count == UINT32_MAX || (uint32_t)info->page > item->page ||
                 ((uint32_t)info->page == item->page && (uint64_t)info->count > item->count))) {
                item->page = (uint32_t)info->page;
                item->count = (uint32_t)BD_MAX(0, BD_MIN(info->count, (int64_t)UINT32_MAX - 1));
            }
            return;
        }
        if (cmp < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
}

/* Look up one chunk of unknown deltas and put them on their pages. */
static bool learn_chunk(struct bd_flusher *f, struct learn_item *items, uint32_t n,
                        uint64_t *max_seq) {
    bson_error_t berr;
    struct bd_page_key *keys = bd_calloc(n, sizeof(*keys));
    if (keys == NULL) {
        flusher_log_oom(f, "while looking pages up");
        return false;
    }
    qsort(items, n, sizeof(*items), cmp_learn);
    for (uint32_t i = 0; i < n; i++) {
        keys[i] =
            (struct bd_page_key){.sensor_id = items[i].sensor_id, .start_ms = items[i].start_ms};
    }
    struct learn_ctx ctx = {.items = items, .n = n};
    BD_STAT_ADD(f->stats, page_lookups, 1);
    struct bd_store_call call = {.kind = BD_CALL_FIND,
                                 .keys = keys,
                                 .n = n,
                                 .cb = learn_page,
                                 .cb_arg = &ctx,
                                 .error = &berr};
    bool ok = flusher_io_call(f, &call);
    free(keys);
    *max_seq = BD_MAX(*max_seq, ctx.max_seq);
    if (!ok) {
        flusher_writer_note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        log_lookup_failure(f, "MongoDB page look-up", berr.message);
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_delta *d = &f->batch.deltas[items[i].delta];
        bool none = items[i].count == UINT32_MAX;
        uint32_t count = none ? 0 : items[i].count;
        /* The stored page's size, estimated from its count and this delta's readings. */
        uint64_t per_reading = 0;
        for (uint32_t r = 0; r < d->n_readings; r++) {
            per_reading += bd_delta_reading_bytes(d, r);
        }
        per_reading /= BD_MAX(d->n_readings, 1);
        uint64_t bytes = count == 0 ? 0 : bd_page_overhead_bytes(d->sensor) + count * per_reading;
        struct bd_sensor *sensor = d->sensor; /* d may move when readings are placed */
        const int64_t start_ms = d->start_ms;
        if (place_readings(f, &f->batch, items[i].delta, 0, PLACE_LEARNED, none ? 0 : items[i].page,
                           count, bytes) < 0) {
            flusher_log_oom(f, "while placing readings on pages");
            return false;
        }
        /* Readings of this bucket drained into the fill batch while its pages were unknown
         * came after this batch's: they go on the pages right after them, now, before any
         * drained later is placed from the slot (which is known from here on). */
        int64_t fi = bd_batch_find(&f->fill, sensor, start_ms, BD_PAGE_UNKNOWN);
        if (fi >= 0 && place_readings(f, &f->fill, (uint32_t)fi, 0, PLACE_KNOWN, 0, 0, 0) < 0) {
            flusher_log_oom(f, "while placing readings on pages");
            return false;
        }
    }
    return true;
}

/* Learn the pages of every unknown delta: one query per flush.max_updates of them. */
static bool learn_pages(struct bd_flusher *f) {
    const uint32_t max = f->cfg->flush.max_updates;
    struct learn_item *items = bd_malloc((size_t)max * sizeof(*items));
    uint64_t max_seq = 0;
    bool ok = items != NULL;
    uint32_t next = 0;
    if (!ok) {
        flusher_log_oom(f, "while looking pages up");
    }
    while (ok) {
        uint32_t n = 0;
        /* Deltas added by placing readings have known pages, so one pass suffices. */
        for (; next < f->batch.n && n < max; next++) {
            const struct bd_delta *d = &f->batch.deltas[next];
            if (!f->batch.meta[next].done && d->page == BD_PAGE_UNKNOWN && d->n_readings > 0) {
                items[n++] = (struct learn_item){.sensor_id = bd_sensor_id(d->sensor),
                                                 .start_ms = d->start_ms,
                                                 .delta = next,
                                                 .count = UINT32_MAX};
            }
        }
        if (n == 0) {
            break;
        }
        ok = learn_chunk(f, items, n, &max_seq);
    }
    free(items);
    /* A number above ours here means the state on disk is behind the collection. */
    return ok && raise_sequence(f, max_seq);
}

int flusher_writer_take_sequence(struct bd_flusher *f, struct bd_err *err) {
    int rc = bd_writer_next(f->writer.state, &f->writer.batch_seq, err);
    if (rc < 0) {
        return rc;
    }
    f->writer.run_first_seq =
        f->writer.run_first_seq ? f->writer.run_first_seq : f->writer.batch_seq;
    f->writer.batch_max_start_ms = INT64_MIN;
    for (uint32_t i = 0; i < f->batch.n; i++) {
        f->writer.batch_max_start_ms =
            BD_MAX(f->writer.batch_max_start_ms, f->batch.deltas[i].start_ms);
    }
    f->writer.have_seq = true;
    return 0;
}

/* Before a batch's first attempt: the sequence and the pages must be right. */
bool flusher_writer_prepare(struct bd_flusher *f) {
    struct bd_err err = {0};
    if (!recover_sequence(f) || !learn_pages(f)) {
        return false;
    }
    if (flusher_writer_take_sequence(f, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    return true;
}

bool flusher_writer_settled(const struct bd_flusher *f) {
    for (uint32_t i = 0; i < f->batch.n; i++) {
        if (!f->batch.meta[i].done && f->batch.deltas[i].n_readings > 0) {
            return false;
        }
    }
    return true;
}

/* Write every pending delta; true when none is left pending. */
static bool send_pending(struct bd_flusher *f, int64_t wall_ms) {
    bson_error_t berr;
    if (!flusher_io_prepare(f, &berr)) {
        flusher_writer_note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        return false;
    }
    if (!f->writer.have_seq && !flusher_writer_prepare(f)) {
        return false;
    }
    uint32_t next = 0;
    for (;;) {
        uint32_t n = 0;
        int rc = 0;
        /* Deltas appended while building (split readings) are picked up by later chunks. */
        while (n < f->writer.chunk_max && next < f->batch.n) {
            uint32_t di = next;
            if (f->batch.meta[di].done || f->batch.deltas[di].n_readings == 0) {
                f->batch.meta[di].done = true;
                next++;
                continue;
            }
            rc = flusher_writer_build_one(f, di, n, wall_ms);
            if (rc < 0) {
                break;
            }
            if (rc == 0) {
                f->writer.ops[n++] = di;
                next++;
            } else if (f->batch.meta[di].done) {
                next++; /* quarantined; a split delta is built again (its first half) */
            }
        }
        if (rc < 0) {
            for (uint32_t i = 0; i < n; i++) {
                bson_destroy(&f->writer.selectors[i]);
                bson_destroy(&f->writer.updates[i]);
            }
            flusher_log_oom(f, "while building updates");
            flusher_writer_note_failure(f, BD_CAUSE_CLIENT, "out of memory while building updates");
            return false;
        }
        if (n == 0) {
            break;
        }
        uint32_t chunk_max = f->writer.chunk_max;
        enum bd_bulk_cause cause = send_chunk(f, n, wall_ms);
        if (cause == BD_CAUSE_UNREACHABLE || cause == BD_CAUSE_CONNECTION) {
            break; /* the rest waits for the next attempt */
        }
        if (f->writer.chunk_max < chunk_max) {
            next = f->writer
                       .ops[0]; /* halved after a driver refusal: the same updates, fewer a bulk */
        }
    }
    return flusher_writer_settled(f);
}

static uint64_t next_rand(struct bd_flusher *f) {
    f->writer.rng ^= f->writer.rng << 13;
    f->writer.rng ^= f->writer.rng >> 7;
    f->writer.rng ^= f->writer.rng << 17;
    return f->writer.rng;
}

void flusher_writer_schedule_retry(struct bd_flusher *f, int64_t mono_ns) {
    uint64_t cap = f->cfg->flush.retry_max_ms;
    uint64_t base = f->cfg->flush.retry_initial_ms;
    uint32_t shift = f->writer.attempt < 30 ? f->writer.attempt : 30;
    uint64_t ceiling = base << shift;
    if (ceiling > cap || ceiling < base) {
        ceiling = cap;
    }
    /* Full jitter: spread retries of many daemons over the whole window. */
    uint64_t delay_ms = ceiling ? next_rand(f) % (ceiling + 1) : 0;
    f->writer.attempt++;
    BD_STAT_ADD(f->stats, bulk_retries, 1);
    f->writer.retry_at = mono_ns + (int64_t)delay_ms * BD_NS_PER_MS;
    if (f->writer.retry_at == 0) {
        f->writer.retry_at = 1;
    }
    if (bd_ratelimit_ok(&f->settle.fail_log, bd_mono_ns())) {
        bd_error("MongoDB write failed (%s); keeping %" PRIu64
                 " readings and retrying with backoff",
                 f->writer.last_error, bd_batch_pending_readings(&f->batch));
    }
}

void flusher_writer_recovered(struct bd_flusher *f, const char *how) {
    if (f->writer.attempt > 0) {
        bd_info("MongoDB writes succeed again after %u failed attempts%s", f->writer.attempt, how);
    }
    f->writer.attempt = 0;
    f->writer.retry_at = 0;
    f->writer.last_cause = BD_CAUSE_NONE;
}

void flusher_writer_batch_done(struct bd_flusher *f) {
    bd_batch_clear(&f->batch);
    f->batch_bytes = 0;
}

/*
 * The fill batch becomes the batch to write, with the next id; the old one (settled and
 * cleared) is filled next. This is what keeps a bucket page's updates in flush-sequence order
 * while draining never stops: a batch is written only once every update of the previous one is
 * settled (acknowledged, proved applied, or quarantined), and its writer sequence number is
 * taken only then (prepare_batch), so a page can never receive a later number before an earlier
 * one is in -- which the w.<writer_id> filter would otherwise take for "already applied".
 */
void flusher_writer_fill_gone(const struct bd_batch *b) {
    /* A sensor's fill_bytes grows only once a reading is in a delta of the fill batch
     * (flusher_drain.c), and a delta stays in its batch until the batch is cleared: these are
     * all the sensors with a share counted. */
    for (uint32_t i = 0; i < b->n; i++) {
        struct bd_pages *p = b->deltas[i].sensor->flusher_state;
        if (p != NULL) {
            p->fill_bytes = 0;
        }
    }
}

void flusher_writer_swap_in_fill(struct bd_flusher *f) {
    BD_ASSERT(bd_batch_pending_readings(&f->batch) == 0);
    flusher_writer_fill_gone(&f->fill);
    struct bd_batch done = f->batch;
    f->batch = f->fill;
    f->fill = done;
    f->batch_bytes = f->fill_bytes;
    f->fill_bytes = 0;
    f->batch_id = f->fill_id;
    f->fill_id++;
    f->queued = 0;
}

/* Of a page's readings pending, this fraction of buckets.max_readings is worth an update. */
#define HOLD_FRACTION 32

/*
 * Whether delta di of the batch about to be written is worth an update now. A growing document
 * is rewritten whole by the storage engine at every update, so a page updated every
 * flush.interval with a few readings each time costs its size times the number of updates: a
 * 1 Hz sensor's page of 1,000 readings rewritten 1,000 times is ~500 bytes rewritten per byte
 * stored. Held back until flush.max_delay passed or enough readings gathered, it is updated
 * about max_readings / (rate x max_delay) times: ~34 for that sensor with the defaults, ~17
 * bytes rewritten per byte stored. Readings held wait in the fill batch, under limits.memory
 * and inside the crash-loss bound (README).
 */
static bool delta_due(const struct bd_flusher *f, uint32_t di, int64_t wall_ms, bool stopping) {
    const struct bd_delta *d = &f->batch.deltas[di];
    const struct bd_batch_meta *m = &f->batch.meta[di];
    if (stopping || f->cfg->flush.max_delay_ms == 0 || d->page == BD_PAGE_UNKNOWN ||
        wall_ms - m->first_ms >= (int64_t)f->cfg->flush.max_delay_ms ||
        (uint64_t)d->n_readings * HOLD_FRACTION >= f->lim.max_readings || flusher_over_budget(f)) {
        return true;
    }
    /* A page that new readings no longer go to will not grow: nothing to wait for. */
    const struct bd_page_slot *slot = bd_pages_find(d->sensor->flusher_state, &f->lim, d->start_ms);
    return slot == NULL || !slot->known || slot->page != d->page;
}

/*
 * After flusher_writer_swap_in_fill: the deltas of the batch to write that are not due yet go back into the
 * (empty) fill batch, ahead of anything drained later, so their readings stay in order. A
 * delta that cannot be moved (out of memory) is simply written now.
 */
void flusher_writer_hold_back(struct bd_flusher *f, int64_t wall_ms, bool stopping) {
    for (uint32_t di = 0; di < f->batch.n; di++) {
        struct bd_delta *d = &f->batch.deltas[di];
        if (f->batch.meta[di].done || d->n_readings == 0 || delta_due(f, di, wall_ms, stopping)) {
            continue;
        }
        uint32_t had = f->fill.n;
        int64_t t = bd_batch_get(&f->fill, d->sensor, d->start_ms, d->page);
        if (t < 0) {
            continue;
        }
        d = &f->batch.deltas[di];
        uint64_t moved = bd_delta_bytes(d);
        if (bd_delta_split(d, 0, &f->fill.deltas[t]) < 0) {
            bd_batch_truncate(&f->fill, had);
            continue;
        }
        f->fill.meta[t].first_ms = f->batch.meta[di].first_ms;
        f->batch.meta[di].done = true;
        f->fill_bytes += moved;
        f->queued += f->fill.deltas[t].n_readings;
        struct bd_page_slot *slot = bd_pages_find(d->sensor->flusher_state, &f->lim, d->start_ms);
        if (slot != NULL) {
            /* Pinned with the fill batch now (the newest id: no slot holds a later one). */
            slot->batch = (uint32_t)f->fill_id;
        }
    }
}

/* Write what the batch holds: one bulk per flush.max_updates deltas. */
void flusher_writer_write(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms) {
    if (f->store == NULL) {
        for (uint32_t i = 0; i < f->batch.n; i++) {
            BD_STAT_ADD(f->stats, readings_flushed, f->batch.deltas[i].n_readings);
        }
        flusher_writer_batch_done(f);
        return;
    }
    if (send_pending(f, wall_ms)) {
        flusher_writer_recovered(f, "");
        f->writer.chunk_max = f->cfg->flush.max_updates;
        f->writer.have_seq = false;
        bd_writer_acked(f->writer.state, wall_ms, f->writer.batch_max_start_ms);
        flusher_writer_batch_done(f);
    } else {
        flusher_writer_schedule_retry(f, mono_ns);
    }
}
