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
#include "bucketd/log.h"

/* Fixed part of an update's entry: n_readings, flags, start, page, id length. */
#define ENTRY_HEADER 24

struct bd_replay {
    uint8_t *data; /* the payload, copied */
    size_t len;
    uint64_t seq;
    uint32_t n;
    /* Each update as the settle engine sees it: maybe_applied is BD_REPLAY_MAYBE_SENT, or an
     * attempt of this replay was ambiguous. */
    struct bd_settle_upd *u;
    bson_t *filters, *updates; /* views into data, BSON_ALIGNOF(bson_t) aligned arrays */
    char *ids;
    uint32_t chunk_max; /* flush.max_updates, halved after a driver refusal */
};

int bd_replay_buf_reserve(struct bd_replay_buf *buf, size_t need) {
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
    return 0;
}

int bd_replay_buf_add(struct bd_replay_buf *buf, const char *sensor_id, int64_t start_ms,
                      uint32_t page, uint32_t n_readings, uint32_t flags, const bson_t *filter,
                      const bson_t *update) {
    size_t id_len = strlen(sensor_id);
    size_t need = ENTRY_HEADER + id_len + filter->len + update->len;
    if (bd_replay_buf_reserve(buf, need) < 0) {
        return -ENOMEM;
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
        struct bd_settle_upd *u = &r->u[i];
        uint32_t id_len = bd_get_le32(p + 20);
        u->n_readings = bd_get_le32(p);
        u->maybe_applied = (bd_get_le32(p + 4) & BD_REPLAY_MAYBE_SENT) != 0;
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

/* The settle engine's view of the record's updates: they are kept as it sees them. */
static void upd_get(void *arg, uint32_t i, struct bd_settle_upd *v) {
    *v = ((const struct bd_replay *)arg)->u[i];
}

static void upd_put(void *arg, uint32_t i, const struct bd_settle_upd *v) {
    ((struct bd_replay *)arg)->u[i] = *v;
}

bool bd_replay_attempt(struct bd_replay *r, const struct bd_replay_env *env, int64_t wall_ms,
                       enum bd_bulk_cause *cause, char *msg, size_t msg_cap) {
    struct bd_settle *s = env->settle;
    const uint32_t max = s->cfg->flush.max_updates;
    if (r->chunk_max == 0) {
        r->chunk_max = max;
    }
    if (env->run_first_seq == 0 || r->seq < env->run_first_seq) {
        /* Spooled by an earlier run: its attempts after the spooling are not known. */
        for (uint32_t i = 0; i < r->n; i++) {
            r->u[i].maybe_applied = true;
        }
    }
    /* Its updates cannot move to other pages: they were built, and numbered, when spooled. */
    const struct bd_settle_host host = {.arg = r,
                                        .get = upd_get,
                                        .put = upd_put,
                                        .relocate = NULL,
                                        .seq = r->seq,
                                        .what = "spooled "};
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
        const struct bd_settle_chunk chunk = {.n = n,
                                              .items = idx,
                                              .filters = sels,
                                              .updates = upds,
                                              .outcomes = outs,
                                              .readback = dups};
        uint32_t chunk_max = r->chunk_max;
        enum bd_bulk_cause c = bd_settle_send(s, &host, &chunk, &r->chunk_max, bulk, wall_ms);
        if (c != BD_CAUSE_NONE) {
            *cause = c;
            snprintf(msg, msg_cap, "%s", bulk->message);
        }
        if (c == BD_CAUSE_UNREACHABLE || c == BD_CAUSE_CONNECTION) {
            break; /* the rest waits for the next attempt */
        }
        if (r->chunk_max < chunk_max) {
            next = idx[0]; /* halved after a driver refusal: the same updates, fewer a bulk */
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
