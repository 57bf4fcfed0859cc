/*
 * Spooled batches (include/bucketd/replay.h): encoding a batch's built updates into a spool
 * record, and writing a record read back to MongoDB, settling each update by its outcome.
 * Flusher thread only.
 */
#include "bucketd/replay.h"

#include <errno.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/escape.h"
#include "bucketd/log.h"
#include "bucketd/summaries.h"

/* As the flusher: refusals before quarantine, duplicate keys without our number before it. */
#define MAX_REFUSALS 8
#define MAX_DUP_CHECKS 3

/* Fixed part of an update's entry: n_readings, flags, start, page, id length. */
#define ENTRY_HEADER 24

struct upd {
    const char *sensor_id; /* NUL-terminated, in r->ids */
    int64_t start_ms;
    uint32_t page;
    uint32_t n_readings;
    bool done;
    bool maybe_sent; /* BD_REPLAY_MAYBE_SENT, or an attempt of this replay was ambiguous */
    uint8_t refusals;
    uint8_t dup_checks;
};

struct bd_replay {
    uint8_t *data; /* the payload, copied */
    size_t len;
    uint64_t seq;
    uint32_t n;
    struct upd *u;
    bson_t *filters, *updates; /* views into data, BSON_ALIGNOF(bson_t) aligned arrays */
    char *ids;
    uint32_t chunk_max; /* flush.max_updates, halved after a driver refusal */
};

int bd_replay_buf_add(struct bd_replay_buf *buf, const char *sensor_id, int64_t start_ms,
                      uint32_t page, uint32_t n_readings, uint32_t flags, const bson_t *filter,
                      const bson_t *update) {
    size_t id_len = strlen(sensor_id);
    size_t need = ENTRY_HEADER + id_len + filter->len + update->len;
    if (buf->len + need > buf->cap) {
        size_t cap = buf->cap ? buf->cap : 64 * 1024;
        while (cap < buf->len + need) {
            cap *= 2;
        }
        uint8_t *data = bd_realloc(buf->data, cap);
        if (data == NULL) {
            return -ENOMEM;
        }
        buf->data = data;
        buf->cap = cap;
    }
    uint8_t *p = buf->data + buf->len;
    bd_put_le32(p, n_readings);
    bd_put_le32(p + 4, flags);
    bd_put_le64(p + 8, (uint64_t)start_ms);
    bd_put_le32(p + 16, page);
    bd_put_le32(p + 20, (uint32_t)id_len);
    memcpy(p + ENTRY_HEADER, sensor_id, id_len);
    memcpy(p + ENTRY_HEADER + id_len, bson_get_data(filter), filter->len);
    memcpy(p + ENTRY_HEADER + id_len + filter->len, bson_get_data(update), update->len);
    buf->len += need;
    buf->n_readings += n_readings;
    buf->n_updates++;
    return 0;
}

void bd_replay_buf_reset(struct bd_replay_buf *buf) {
    buf->len = 0;
    buf->n_readings = 0;
    buf->n_updates = 0;
}

void bd_replay_buf_close(struct bd_replay_buf *buf) {
    free(buf->data);
    memset(buf, 0, sizeof(*buf));
}

void bd_replay_free(struct bd_replay *r) {
    if (r == NULL) {
        return;
    }
    free(r->data);
    free(r->u);
    free(r->filters);
    free(r->updates);
    free(r->ids);
    free(r);
}

/* A BSON document at p (at most avail bytes): its length, or 0 if it does not fit. */
static uint32_t bson_at(const uint8_t *p, size_t avail) {
    if (avail < 5) {
        return 0;
    }
    uint32_t len = bd_get_le32(p);
    return len >= 5 && len <= avail && p[len - 1] == 0 ? len : 0;
}

int bd_replay_load(struct bd_replay **out, const struct bd_spool_record *rec, struct bd_err *err) {
    int rc = 0;
    struct bd_replay *r = bd_calloc(1, sizeof(*r));
    if (r == NULL) {
        return bd_err_set(err, -ENOMEM, "spool replay: out of memory");
    }
    r->seq = rec->seq;
    r->len = rec->len;
    r->data = bd_malloc(rec->len ? rec->len : 1);
    if (r->data == NULL) {
        rc = bd_err_set(err, -ENOMEM, "spool replay: out of memory");
        goto out;
    }
    memcpy(r->data, rec->data, rec->len);
    /* First pass: count and check the entries. */
    size_t off = 0, ids_len = 0;
    uint32_t n = 0;
    while (off < r->len) {
        const uint8_t *p = r->data + off;
        size_t avail = r->len - off;
        if (avail < ENTRY_HEADER) {
            goto bad;
        }
        uint32_t id_len = bd_get_le32(p + 20);
        if (id_len == 0 || id_len > avail - ENTRY_HEADER) {
            goto bad;
        }
        size_t at = ENTRY_HEADER + id_len;
        uint32_t fl = bson_at(p + at, avail - at);
        if (fl == 0) {
            goto bad;
        }
        uint32_t ul = bson_at(p + at + fl, avail - at - fl);
        if (ul == 0) {
            goto bad;
        }
        off += at + fl + ul;
        ids_len += id_len + 1;
        n++;
    }
    if (n == 0) {
        goto bad;
    }
    r->n = n;
    r->u = bd_calloc(n, sizeof(*r->u));
    r->ids = bd_malloc(ids_len);
    r->filters = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)n * sizeof(bson_t));
    r->updates = aligned_alloc(BSON_ALIGNOF(bson_t), (size_t)n * sizeof(bson_t));
    if (r->u == NULL || r->ids == NULL || r->filters == NULL || r->updates == NULL) {
        rc = bd_err_set(err, -ENOMEM, "spool replay: out of memory");
        goto out;
    }
    off = 0;
    char *ids = r->ids;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *p = r->data + off;
        struct upd *u = &r->u[i];
        uint32_t id_len = bd_get_le32(p + 20);
        u->n_readings = bd_get_le32(p);
        u->maybe_sent = (bd_get_le32(p + 4) & BD_REPLAY_MAYBE_SENT) != 0;
        u->start_ms = (int64_t)bd_get_le64(p + 8);
        u->page = bd_get_le32(p + 16);
        memcpy(ids, p + ENTRY_HEADER, id_len);
        ids[id_len] = '\0';
        u->sensor_id = ids;
        ids += id_len + 1;
        const uint8_t *fp = p + ENTRY_HEADER + id_len;
        uint32_t fl = bd_get_le32(fp);
        uint32_t ul = bd_get_le32(fp + fl);
        /* The first pass checked the frames only: an element that does not parse would be
         * sent as it is, and MongoDB refuses the whole bulk it is in. */
        if (!bson_init_static(&r->filters[i], fp, fl) ||
            !bson_init_static(&r->updates[i], fp + fl, ul) ||
            !bson_validate(&r->filters[i], BSON_VALIDATE_NONE, NULL) ||
            !bson_validate(&r->updates[i], BSON_VALIDATE_NONE, NULL)) {
            goto bad;
        }
        off += ENTRY_HEADER + id_len + fl + ul;
    }
    *out = r;
    return 0;
bad:
    rc = bd_err_set(err, -EBADMSG,
                    "spool record %" PRIu64 " (sequence %" PRIu64
                    ") does not hold updates as written",
                    rec->id, rec->seq);
out:
    bd_replay_free(r);
    return rc;
}

uint64_t bd_replay_pending_readings(const struct bd_replay *r) {
    uint64_t n = 0;
    for (uint32_t i = 0; i < r->n; i++) {
        n += r->u[i].done ? 0 : r->u[i].n_readings;
    }
    return n;
}

uint64_t bd_replay_seq(const struct bd_replay *r) {
    return r->seq;
}

static void settle_applied(struct bd_replay *r, const struct bd_replay_env *env, uint32_t i) {
    r->u[i].done = true;
    BD_STAT_ADD(env->stats, readings_flushed, r->u[i].n_readings);
    if (env->sums != NULL &&
        bd_summaries_mark(env->sums, r->u[i].sensor_id, r->u[i].start_ms) < 0) {
        BD_STAT_ADD(env->stats, summary_buckets_skipped, 1);
    }
}

static void quarantine(struct bd_replay *r, const struct bd_replay_env *env, uint32_t i,
                       int64_t code, const char *why, int64_t wall_ms, bool conflict) {
    struct upd *u = &r->u[i];
    char id[BD_BUCKET_ID_MAX], shown[BD_ESCAPE_CAP(BD_BUCKET_ID_MAX)];
    bd_bucket_id(id, sizeof(id), u->sensor_id, u->start_ms, u->page);
    bd_escape_str(shown, sizeof(shown), id); /* the id holds the sensor id, sent by anyone */
    u->done = true;
    BD_STAT_ADD(env->stats, updates_quarantined, 1);
    BD_STAT_ADD(env->stats, readings_quarantined, u->n_readings);
    if (conflict) {
        BD_STAT_ADD(env->stats, writer_conflicts, 1);
        bd_error("bucket %s already holds sequence %" PRIu64 " or newer of writer_id %s, which "
                 "this daemon never sent: another daemon is using writer_id %s; give each daemon "
                 "its own (%u spooled readings not written)",
                 shown, r->seq, env->cfg->writer_id, env->cfg->writer_id, u->n_readings);
    } else {
        bd_error("MongoDB rejected the spooled update of bucket %s for good (%u readings "
                 "quarantined%s): code %" PRId64 ": %s",
                 shown, u->n_readings, env->dead != NULL ? ", kept in the dead-letter file" : "",
                 code, why);
    }
    if (env->dead != NULL) {
        struct bd_err err = {0};
        struct bd_deadletter_record rec = {.time_ms = wall_ms,
                                           .writer_id = env->cfg->writer_id,
                                           .seq = r->seq,
                                           .database = env->cfg->mongodb.database,
                                           .collection = env->cfg->mongodb.collection,
                                           .bucket_id = id,
                                           .n_readings = u->n_readings,
                                           .code = code,
                                           .message = why,
                                           .filter = &r->filters[i],
                                           .update = &r->updates[i]};
        if (bd_deadletter_append(env->dead, &rec, &err) < 0) {
            BD_STAT_ADD(env->stats, deadletter_write_errors, 1);
            BD_STAT_ADD(env->stats, deadletter_dropped_readings, u->n_readings);
            bd_error("cannot keep the quarantined update of bucket %s in %s (%u readings kept "
                     "nowhere): %s",
                     shown, bd_deadletter_path(env->dead), u->n_readings, err.msg);
        }
    }
}

/* One store call, run through env->run. */
struct call {
    struct bd_store *st;
    bool find; /* find_pages, else bulk_upsert */
    const bson_t **sels, **upds;
    uint32_t n;
    bson_t *reply;
    const struct bd_page_key *keys;
    bd_store_page_cb cb;
    void *cb_arg;
    bson_error_t *error;
    bool ok;
};

static void call_run(void *arg) {
    struct call *c = arg;
    if (c->find) {
        c->ok = c->st->ops->find_pages(c->st, c->keys, c->n, c->cb, c->cb_arg, c->error);
    } else {
        c->ok = c->st->ops->bulk_upsert(c->st, c->sels, c->upds, c->n, c->reply, c->error);
    }
}

struct readback {
    const struct bd_replay *r;
    const uint32_t *idx;
    uint32_t n;
    uint64_t *seen;
};

static void readback_page(void *arg, const struct bd_page_info *info) {
    struct readback *rb = arg;
    for (uint32_t k = 0; k < rb->n; k++) {
        const struct upd *u = &rb->r->u[rb->idx[k]];
        if (u->start_ms == info->start_ms && (int64_t)u->page == info->page &&
            strcmp(u->sensor_id, info->sensor_id) == 0) {
            rb->seen[k] = info->writer_seq;
        }
    }
}

/* Duplicate-key answers: the page holds our number (or a later one) -> applied before. */
static void settle_duplicates(struct bd_replay *r, const struct bd_replay_env *env,
                              const uint32_t *idx, uint32_t n, int64_t wall_ms) {
    struct bd_page_key *keys = bd_calloc(n, sizeof(*keys));
    uint64_t *seen = bd_calloc(n, sizeof(*seen));
    bson_error_t berr;
    if (keys == NULL || seen == NULL) {
        goto out; /* asked again with the next attempt */
    }
    for (uint32_t k = 0; k < n; k++) {
        keys[k] = (struct bd_page_key){.sensor_id = r->u[idx[k]].sensor_id,
                                       .start_ms = r->u[idx[k]].start_ms};
    }
    struct readback rb = {.r = r, .idx = idx, .n = n, .seen = seen};
    struct call c = {.st = env->store,
                     .find = true,
                     .keys = keys,
                     .n = n,
                     .cb = readback_page,
                     .cb_arg = &rb,
                     .error = &berr};
    BD_STAT_ADD(env->stats, page_lookups, 1);
    env->run(env->run_arg, call_run, &c);
    if (!c.ok) {
        goto out;
    }
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = idx[k];
        if (seen[k] >= r->seq && r->u[i].maybe_sent) {
            BD_STAT_ADD(env->stats, updates_already_applied, 1);
            settle_applied(r, env, i);
        } else if (seen[k] >= r->seq) {
            quarantine(r, env, i, 11000, "the page holds this writer's sequence already", wall_ms,
                       true);
        } else if (++r->u[i].dup_checks >= MAX_DUP_CHECKS) {
            quarantine(r, env, i, 11000,
                       "duplicate key again and again, without this writer's sequence in the page",
                       wall_ms, false);
        }
    }
out:
    free(keys);
    free(seen);
}

bool bd_replay_attempt(struct bd_replay *r, const struct bd_replay_env *env, int64_t wall_ms,
                       enum bd_bulk_cause *cause, char *msg, size_t msg_cap) {
    const uint32_t max = env->cfg->flush.max_updates;
    if (r->chunk_max == 0) {
        r->chunk_max = max;
    }
    if (env->run_first_seq == 0 || r->seq < env->run_first_seq) {
        /* Spooled by an earlier run: its attempts after the spooling are not known. */
        for (uint32_t i = 0; i < r->n; i++) {
            r->u[i].maybe_sent = true;
        }
    }
    uint32_t *idx = bd_calloc(max, sizeof(*idx));
    uint32_t *dups = bd_calloc(max, sizeof(*dups));
    const bson_t **sels = bd_calloc(max, sizeof(*sels));
    const bson_t **upds = bd_calloc(max, sizeof(*upds));
    struct bd_op_outcome *outs = bd_calloc(max, sizeof(*outs));
    struct bd_bulk_outcome *bulk = bd_calloc(1, sizeof(*bulk));
    *cause = BD_CAUSE_NONE;
    msg[0] = '\0';
    if (idx == NULL || dups == NULL || sels == NULL || upds == NULL || outs == NULL ||
        bulk == NULL) {
        *cause = BD_CAUSE_CLIENT;
        snprintf(msg, msg_cap, "out of memory replaying the spool");
        goto out;
    }
    uint32_t next = 0;
    for (;;) {
        uint32_t n = 0;
        for (; next < r->n && n < r->chunk_max; next++) {
            if (!r->u[next].done) {
                idx[n] = next;
                sels[n] = &r->filters[next];
                upds[n] = &r->updates[next];
                n++;
            }
        }
        if (n == 0) {
            break;
        }
        bson_t reply;
        bson_error_t berr = {0};
        struct call c = {
            .st = env->store, .sels = sels, .upds = upds, .n = n, .reply = &reply, .error = &berr};
        int64_t start_ns = bd_mono_ns();
        env->run(env->run_arg, call_run, &c);
        bd_outcome_classify(c.ok, &reply, &berr, n, outs, bulk);
        bson_destroy(&reply);
        if (bulk->reached > 0) {
            BD_STAT_ADD(env->stats, bulk_writes, 1);
            BD_STAT_ADD(env->stats, updates_sent, bulk->reached);
            for (uint32_t k = 0; k < n; k++) {
                bd_histogram_observe(&env->stats->update_readings, &bd_hist_update_readings,
                                     r->u[idx[k]].n_readings);
            }
        }
        if (bulk->cause != BD_CAUSE_CLIENT) {
            bd_stats_bulk_done(env->stats, start_ns,
                               bulk->cause == BD_CAUSE_NONE || bulk->cause == BD_CAUSE_SERVER);
        }
        if (bulk->cause == BD_CAUSE_CLIENT && !bulk->partly_executed) {
            /* Refused before sending, without saying which: halve until it is alone. */
            if (n > 1) {
                r->chunk_max = BD_MAX(1, n / 2);
                next = idx[0];
                continue;
            }
            outs[0].kind = BD_OUTCOME_PERMANENT;
            outs[0].code = (int32_t)bulk->code;
        }
        if (bulk->cause != BD_CAUSE_NONE) {
            *cause = bulk->cause;
            snprintf(msg, msg_cap, "%s", bulk->message);
        }
        uint32_t n_dups = 0;
        for (uint32_t k = 0; k < n; k++) {
            uint32_t i = idx[k];
            const char *why = bd_outcome_message(bulk, &outs[k]);
            if (*why == '\0') {
                why = bulk->message;
            }
            int64_t code = outs[k].code != 0 ? outs[k].code : bulk->code;
            switch ((enum bd_outcome)outs[k].kind) {
            case BD_OUTCOME_APPLIED:
                settle_applied(r, env, i);
                break;
            case BD_OUTCOME_AMBIGUOUS:
                r->u[i].maybe_sent = true;
                break;
            case BD_OUTCOME_NOT_SENT:
            case BD_OUTCOME_RETRY:
            case BD_OUTCOME_CONFIG: /* the deployment must change: kept, retried, logged */
                break;
            case BD_OUTCOME_DUPLICATE:
                dups[n_dups++] = i;
                break;
            case BD_OUTCOME_TOO_LARGE:
            case BD_OUTCOME_REFUSED:
                if (++r->u[i].refusals >= MAX_REFUSALS) {
                    quarantine(r, env, i, code, why, wall_ms, false);
                }
                break;
            case BD_OUTCOME_PERMANENT:
                quarantine(r, env, i, code, why, wall_ms, false);
                break;
            }
        }
        if (n_dups > 0) {
            settle_duplicates(r, env, dups, n_dups, wall_ms);
        }
        if (bulk->cause == BD_CAUSE_UNREACHABLE || bulk->cause == BD_CAUSE_CONNECTION) {
            break; /* the rest waits for the next attempt */
        }
    }
out:
    free(idx);
    free(dups);
    free(sels);
    free(upds);
    free(outs);
    free(bulk);
    for (uint32_t i = 0; i < r->n; i++) {
        if (!r->u[i].done) {
            if (*cause == BD_CAUSE_NONE) {
                *cause = BD_CAUSE_SERVER;
                snprintf(msg, msg_cap, "updates refused, retried");
            }
            return false;
        }
    }
    r->chunk_max = 0;
    return true;
}
