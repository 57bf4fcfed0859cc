/*
 * The settle engine (include/bucketd/settle.h): the rules that turn each update's outcome into
 * applied, sent again, read back, moved to new pages, or quarantined, for the flusher's batches
 * and the spool replay alike. Flusher thread only; the read-back's page callback runs on the
 * runner's thread and reads the host through get, as the store call reads the host's updates.
 */
#include "bucketd/settle.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/escape.h"
#include "bucketd/summaries.h"

void bd_settle_init(struct bd_settle *s) {
    s->quarantine_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 5};
    s->conflict_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 3};
    s->fail_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 1};
    s->oom_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 1};
    s->sums_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 1};
}

void bd_settle_log_oom(struct bd_settle *s, const char *what) {
    if (bd_ratelimit_ok(&s->oom_log, bd_mono_ns())) {
        bd_error("flusher: out of memory %s; the readings stay where they are and are tried "
                 "again",
                 what);
    }
}

static void applied(struct bd_settle *s, const struct bd_settle_host *h, uint32_t item) {
    struct bd_settle_upd u;
    h->get(h->arg, item, &u);
    u.done = true;
    h->put(h->arg, item, &u);
    BD_STAT_ADD(s->stats, readings_flushed, u.n_readings);
    if (s->sums != NULL && bd_summaries_mark(s->sums, u.sensor_id, u.start_ms) < 0) {
        BD_STAT_ADD(s->stats, summary_buckets_skipped, 1);
        if (bd_ratelimit_ok(&s->sums_log, bd_mono_ns())) {
            char shown[BD_ESCAPE_CAP(256)];
            bd_escape(shown, sizeof(shown), u.sensor_id, strlen(u.sensor_id), 0);
            bd_error("out of memory: the summary document of a bucket of %s will not be "
                     "refreshed until the bucket is written again",
                     shown);
        }
    }
}

void bd_settle_quarantine(struct bd_settle *s, const struct bd_settle_host *h, uint32_t item,
                          int64_t code, const char *why, const bson_t *filter, const bson_t *update,
                          int64_t wall_ms, bool conflict) {
    struct bd_settle_upd u;
    h->get(h->arg, item, &u);
    char id[BD_BUCKET_ID_MAX], shown[BD_ESCAPE_CAP(BD_BUCKET_ID_MAX)];
    bd_bucket_id(id, sizeof(id), u.sensor_id, u.start_ms, u.page);
    bd_escape_str(shown, sizeof(shown), id); /* the id holds the sensor id, sent by anyone */
    u.done = true;
    h->put(h->arg, item, &u);
    BD_STAT_ADD(s->stats, updates_quarantined, 1);
    BD_STAT_ADD(s->stats, readings_quarantined, u.n_readings);
    if (conflict) {
        /* A configuration error, not bad data: its own limiter, so bad input cannot hide it. */
        BD_STAT_ADD(s->stats, writer_conflicts, 1);
        if (bd_ratelimit_ok(&s->conflict_log, bd_mono_ns())) {
            bd_error("bucket %s already holds sequence %" PRIu64 " or newer of writer_id %s, "
                     "which this daemon never sent: another daemon is using writer_id %s; "
                     "give each daemon its own (%u %sreadings not written)",
                     shown, h->seq, s->cfg->writer_id, s->cfg->writer_id, u.n_readings, h->what);
        }
    } else if (bd_ratelimit_ok(&s->quarantine_log, bd_mono_ns())) {
        bd_error("MongoDB rejected the %supdate of bucket %s for good (%u readings "
                 "quarantined%s): code %" PRId64 ": %s",
                 h->what, shown, u.n_readings,
                 s->dead != NULL ? ", kept in the dead-letter file" : "", code, why);
    }
    if (s->dead != NULL && filter != NULL && update != NULL) {
        struct bd_err err = {0};
        struct bd_deadletter_record rec = {.time_ms = wall_ms,
                                           .writer_id = s->cfg->writer_id,
                                           .seq = h->seq,
                                           .database = s->cfg->mongodb.database,
                                           .collection = s->cfg->mongodb.collection,
                                           .bucket_id = id,
                                           .n_readings = u.n_readings,
                                           .code = code,
                                           .message = why,
                                           .filter = filter,
                                           .update = update};
        if (bd_deadletter_append(s->dead, &rec, &err) < 0) {
            BD_STAT_ADD(s->stats, deadletter_write_errors, 1);
            BD_STAT_ADD(s->stats, deadletter_dropped_readings, u.n_readings);
            if (bd_ratelimit_ok(&s->quarantine_log, bd_mono_ns())) {
                bd_error("cannot keep the quarantined update of bucket %s in %s (%u readings "
                         "kept nowhere): %s",
                         shown, bd_deadletter_path(s->dead), u.n_readings, err.msg);
            }
        }
    }
}

int bd_settle_shrink(struct bd_settle *s, const struct bd_settle_host *h, uint32_t item,
                     int64_t code, const char *why, const bson_t *filter, const bson_t *update,
                     int64_t wall_ms) {
    struct bd_settle_upd u;
    h->get(h->arg, item, &u);
    if (u.n_readings > 1 && h->relocate != NULL) {
        return h->relocate(h->arg, item, u.n_readings / 2);
    }
    bd_settle_quarantine(s, h, item, code, why, filter, update, wall_ms, false);
    return 0;
}

struct readback_ctx {
    const struct bd_settle_host *h;
    const struct bd_settle_chunk *c;
    const uint32_t *pos; /* chunk positions to check */
    uint32_t n;
    uint64_t *seen; /* per position: w.<writer_id> of its page, 0 if none */
    bool *found;
};

static void readback_page(void *arg, const struct bd_page_info *info) {
    struct readback_ctx *rc = arg;
    for (uint32_t i = 0; i < rc->n; i++) {
        struct bd_settle_upd u;
        rc->h->get(rc->h->arg, rc->c->items[rc->pos[i]], &u);
        if (u.start_ms == info->start_ms && (int64_t)u.page == info->page &&
            strcmp(u.sensor_id, info->sensor_id) == 0) {
            rc->found[i] = true;
            rc->seen[i] = info->writer_seq;
        }
    }
}

/*
 * Duplicate-key answers (and size refusals of updates that may have been applied): read the
 * pages back and decide. pos[0..n) are positions in the chunk.
 */
static void settle_readback(struct bd_settle *s, const struct bd_settle_host *h,
                            const struct bd_settle_chunk *c, const uint32_t *pos, uint32_t n,
                            int64_t wall_ms) {
    struct bd_page_key *keys = bd_calloc(n, sizeof(*keys));
    uint64_t *seen = bd_calloc(n, sizeof(*seen));
    bool *found = bd_calloc(n, sizeof(*found));
    bson_error_t berr;
    if (keys == NULL || seen == NULL || found == NULL) {
        bd_settle_log_oom(s, "while reading pages back");
        goto out; /* they stay pending: the next attempt asks again */
    }
    for (uint32_t i = 0; i < n; i++) {
        struct bd_settle_upd u;
        h->get(h->arg, c->items[pos[i]], &u);
        keys[i] = (struct bd_page_key){.sensor_id = u.sensor_id, .start_ms = u.start_ms};
    }
    struct readback_ctx ctx = {.h = h, .c = c, .pos = pos, .n = n, .seen = seen, .found = found};
    BD_STAT_ADD(s->stats, page_lookups, 1);
    struct bd_store_call call = {.kind = BD_CALL_FIND,
                                 .keys = keys,
                                 .n = n,
                                 .cb = readback_page,
                                 .cb_arg = &ctx,
                                 .error = &berr};
    if (!bd_store_call(s->store, s->run, s->run_arg, &call)) {
        if (bd_ratelimit_ok(&s->fail_log, bd_mono_ns())) {
            bd_error("reading back %u pages after a duplicate-key answer failed (%s); asking "
                     "again with the next attempt",
                     n, berr.message);
        }
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = pos[i], item = c->items[p];
        const struct bd_op_outcome *o = &c->outcomes[p];
        struct bd_settle_upd u;
        h->get(h->arg, item, &u);
        if (found[i] && seen[i] >= h->seq) {
            if (u.maybe_applied) {
                /* An earlier attempt of this very update got through. */
                BD_STAT_ADD(s->stats, updates_already_applied, 1);
                applied(s, h, item);
            } else {
                bd_settle_quarantine(s, h, item, o->code,
                                     "the page holds this writer's sequence already", c->filters[p],
                                     c->updates[p], wall_ms, true);
            }
        } else if (o->kind == BD_OUTCOME_TOO_LARGE) {
            if (bd_settle_shrink(s, h, item, o->code, "larger than MongoDB's document limit",
                                 c->filters[p], c->updates[p], wall_ms) < 0) {
                bd_settle_log_oom(s, "while moving readings to a new page");
            }
        } else if (++u.dup_checks >= BD_SETTLE_MAX_DUP_CHECKS) {
            h->put(h->arg, item, &u);
            bd_settle_quarantine(s, h, item, o->code,
                                 "duplicate key again and again, without this writer's sequence "
                                 "in the page",
                                 c->filters[p], c->updates[p], wall_ms, false);
        } else {
            h->put(h->arg, item, &u);
        }
    }
out:
    free(keys);
    free(seen);
    free(found);
}

/* Act on the outcome of each update of the chunk just sent. */
static void settle_chunk(struct bd_settle *s, const struct bd_settle_host *h,
                         const struct bd_settle_chunk *c, const struct bd_bulk_outcome *bulk,
                         int64_t wall_ms) {
    uint32_t n_readback = 0;
    for (uint32_t p = 0; p < c->n; p++) {
        uint32_t item = c->items[p];
        const struct bd_op_outcome *o = &c->outcomes[p];
        const char *msg = bd_outcome_message(bulk, o);
        /* An update's own code and message, else the bulk's. */
        const char *why = *msg != '\0' ? msg : bulk->message;
        const int64_t code = o->code != 0 ? o->code : bulk->code;
        struct bd_settle_upd u;
        h->get(h->arg, item, &u);
        enum bd_outcome kind = (enum bd_outcome)o->kind;
        if (kind == BD_OUTCOME_TOO_LARGE && h->relocate == NULL) {
            kind = BD_OUTCOME_REFUSED; /* its readings cannot move: only refused again */
        }
        switch (kind) {
        case BD_OUTCOME_APPLIED:
            applied(s, h, item);
            break;
        case BD_OUTCOME_NOT_SENT:
        case BD_OUTCOME_RETRY:
        case BD_OUTCOME_CONFIG: /* the deployment must change: kept, retried, logged */
            break;
        case BD_OUTCOME_AMBIGUOUS:
            u.maybe_applied = true;
            h->put(h->arg, item, &u);
            break;
        case BD_OUTCOME_DUPLICATE:
            c->readback[n_readback++] = p;
            break;
        case BD_OUTCOME_TOO_LARGE:
        case BD_OUTCOME_REFUSED:
            u.refusals++;
            h->put(h->arg, item, &u);
            if (u.refusals >= BD_SETTLE_MAX_REFUSALS) {
                bd_settle_quarantine(s, h, item, code, why, c->filters[p], c->updates[p], wall_ms,
                                     false);
            } else if (kind == BD_OUTCOME_REFUSED) {
                /* sent again with the next attempt */
            } else if (u.maybe_applied) {
                c->readback[n_readback++] = p; /* too large: it may be in the page already */
            } else if (h->relocate(h->arg, item, 0) < 0) {
                bd_settle_log_oom(s, "while moving readings to a new page");
            }
            break;
        case BD_OUTCOME_PERMANENT:
            bd_settle_quarantine(s, h, item, code, why, c->filters[p], c->updates[p], wall_ms,
                                 false);
            break;
        }
    }
    if (n_readback > 0) {
        settle_readback(s, h, c, c->readback, n_readback, wall_ms);
    }
}

enum bd_bulk_cause bd_settle_send(struct bd_settle *s, const struct bd_settle_host *h,
                                  const struct bd_settle_chunk *c, uint32_t *chunk_max,
                                  struct bd_bulk_outcome *bulk, int64_t wall_ms) {
    bson_t reply;
    bson_error_t berr = {0};
    struct bd_store_call call = {.kind = BD_CALL_BULK,
                                 .selectors = c->filters,
                                 .updates = c->updates,
                                 .n = c->n,
                                 .reply = &reply,
                                 .error = &berr};
    int64_t start_ns = bd_mono_ns();
    bool ok = bd_store_call(s->store, s->run, s->run_arg, &call);
    bd_outcome_classify(ok, &reply, &berr, c->n, c->outcomes, bulk);
    bson_destroy(&reply);
    if (bulk->reached > 0) {
        BD_STAT_ADD(s->stats, bulk_writes, 1);
        BD_STAT_ADD(s->stats, updates_sent, bulk->reached);
        for (uint32_t i = 0; i < c->n; i++) {
            struct bd_settle_upd u;
            h->get(h->arg, c->items[i], &u);
            bd_histogram_observe(&s->stats->update_readings, &bd_hist_update_readings,
                                 u.n_readings);
        }
    }
    if (bulk->cause != BD_CAUSE_CLIENT) {
        bd_stats_bulk_done(s->stats, start_ns,
                           bulk->cause == BD_CAUSE_NONE || bulk->cause == BD_CAUSE_SERVER);
    }
    if (bulk->cause == BD_CAUSE_CLIENT && !bulk->partly_executed) {
        /* The driver refused the bulk and sent nothing; it does not say reliably which update
         * it refused. Halve the bulk until the refused update is alone: too large, if its
         * readings can move to new pages, else refused for good. */
        if (c->n > 1) {
            *chunk_max = BD_MAX(1, c->n / 2);
        } else {
            c->outcomes[0].kind = h->relocate != NULL ? BD_OUTCOME_TOO_LARGE : BD_OUTCOME_PERMANENT;
            c->outcomes[0].code = (int32_t)bulk->code;
        }
    }
    settle_chunk(s, h, c, bulk, wall_ms);
    return bulk->cause;
}
