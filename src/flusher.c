/*
 * Flusher thread: drains dirty sensors, builds per-bucket deltas and writes them to MongoDB.
 *
 * Threads: everything in struct bd_flusher below the "flusher thread only" line is touched by
 * the flusher thread alone; the mutex/condition variable pair is the doorbell from the other
 * threads (wake, stop). The mongoc client is popped from the pool once and used only here.
 *
 * Whenever woken (the interval, or a ring past its high-water mark): pop every dirty sensor and
 * move its readings out of the ring into deltas keyed by (sensor, bucket start, page). Once per
 * flush.interval: send the deltas in unordered bulks of at most flush.max_updates upserts. A delta leaves the pending set when MongoDB acknowledged it or
 * rejected it for good (quarantined, counted, logged); on a transient error the remaining
 * deltas are retried after a backoff and nothing new is drained in between, which keeps each
 * bucket's updates in order and memory bounded by the rings.
 *
 * Page accounting: each sensor keeps, in flusher_state, the page and reading count of every
 * bucket it still has open (inside the late/future window) as this process wrote them; a page
 * that reaches buckets.max_readings moves new readings to the next page.
 */
#include "bucketd/flusher.h"

#include <errno.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/bucket.h"
#include "bucketd/log.h"
#include "bucketd/mongo.h"

/* Readings the deltas may hold before they are written ahead of the interval (~50 MB). */
#define MAX_QUEUED (UINT64_C(1) << 20)

struct bucket_state {
    int64_t start_ms;
    uint32_t page;
    uint32_t count; /* readings in the page, as written or pending */
};

/*
 * The buckets of one sensor that can still receive readings: those within buckets.max_late
 * of now, up to buckets.max_future ahead. Entries for buckets that fell out of the window are
 * reused, so the array only grows to the number of buckets a sensor really keeps open.
 */
struct sensor_state {
    uint32_t n, cap;
    struct bucket_state b[];
};

/* Open-addressing index of this flush's deltas by (sensor, start, page). */
struct delta_slot {
    uint32_t idx_plus1; /* 0 = empty */
};

struct bd_flusher {
    const struct bd_config *cfg;
    struct bd_sensor_table *table;
    struct bd_stats *stats;

    mongoc_uri_t *uri;
    mongoc_client_pool_t *pool;
    mongoc_write_concern_t *wc;

    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool wake_pending; /* guarded by mu */
    bool stop;         /* guarded by mu */
    int64_t stop_deadline; /* guarded by mu */

    bd_flusher_drained_cb drained;
    void *drained_arg;

    /* ---- flusher thread only ---- */
    mongoc_client_t *client;
    mongoc_collection_t *coll;
    bool indexes_ok;

    struct bd_delta *deltas; /* pending deltas [0, n_deltas); buffers reused */
    bool *done;              /* per delta: acknowledged or quarantined */
    uint32_t n_deltas, cap_deltas;
    struct delta_slot *slots;
    uint32_t slot_mask;

    uint64_t queued;   /* readings in the deltas */
    int64_t send_at;   /* monotonic ns of the next scheduled write */
    uint32_t attempt;  /* consecutive failed bulk writes */
    int64_t retry_at;  /* monotonic ns of the next attempt, 0 = none */
    uint64_t rng;      /* xorshift state for jitter */
    struct bd_ratelimit fail_log;
    struct bd_ratelimit quarantine_log;
};

static void driver_log(mongoc_log_level_t level, const char *domain, const char *message,
                       void *data) {
    (void)data;
    switch (level) {
    case MONGOC_LOG_LEVEL_ERROR:
    case MONGOC_LOG_LEVEL_CRITICAL:
        bd_error("mongoc[%s]: %s", domain, message);
        break;
    case MONGOC_LOG_LEVEL_WARNING:
        bd_warn("mongoc[%s]: %s", domain, message);
        break;
    default:
        bd_debug("mongoc[%s]: %s", domain, message);
        break;
    }
}

void bd_flusher_install_driver_log(void) {
    mongoc_log_set_handler(driver_log, NULL);
}

int bd_flusher_new(struct bd_flusher **out, const struct bd_config *cfg,
                   struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err) {
    int rc = 0;
    bson_error_t berr;
    struct bd_flusher *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        rc = bd_err_set(err, -ENOMEM, "flusher: out of memory");
        goto out;
    }
    f->cfg = cfg;
    f->table = table;
    f->stats = stats;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->rng = (uint64_t)bd_now_ns() | 1;
    f->fail_log.interval_ns = 10 * BD_NS_PER_S;
    f->fail_log.burst = 1;
    f->quarantine_log.interval_ns = 10 * BD_NS_PER_S;
    f->quarantine_log.burst = 5;
    f->slot_mask = 1024 - 1;
    f->slots = calloc(f->slot_mask + 1, sizeof(*f->slots));
    if (f->slots == NULL) {
        rc = bd_err_set(err, -ENOMEM, "flusher: out of memory");
        goto out;
    }
    if (cfg->sink == BD_SINK_MONGODB) {
        f->uri = bd_mongo_uri_new(cfg->mongodb.uri, err);
        if (f->uri == NULL) {
            rc = -EINVAL;
            goto out;
        }
        rc = bd_mongo_write_concern_new(cfg->mongodb.write_concern, &f->wc, err);
        if (rc < 0) {
            goto out;
        }
        f->pool = mongoc_client_pool_new_with_error(f->uri, &berr);
        if (f->pool == NULL) {
            rc = bd_err_set(err, -EINVAL, "mongodb.uri: %s", berr.message);
            goto out;
        }
        mongoc_client_pool_set_error_api(f->pool, MONGOC_ERROR_API_VERSION_2);
        mongoc_client_pool_set_appname(f->pool, "bucketd");
    }
    *out = f;
    f = NULL;
out:
    bd_flusher_free(f);
    return rc;
}

void bd_flusher_set_drained(struct bd_flusher *f, bd_flusher_drained_cb cb, void *arg) {
    f->drained = cb;
    f->drained_arg = arg;
}

static void release_sensor_state(struct bd_sensor *s, void *arg) {
    (void)arg;
    free(s->flusher_state);
    s->flusher_state = NULL;
}

void bd_flusher_free(struct bd_flusher *f) {
    if (f == NULL) {
        return;
    }
    BD_ASSERT(!f->started);
    for (uint32_t i = 0; i < f->cap_deltas; i++) {
        bd_delta_close(&f->deltas[i]);
    }
    free(f->deltas);
    free(f->done);
    free(f->slots);
    if (f->table != NULL) {
        bd_sensor_table_foreach(f->table, release_sensor_state, NULL);
    }
    if (f->pool != NULL) {
        mongoc_client_pool_destroy(f->pool);
    }
    mongoc_write_concern_destroy(f->wc);
    mongoc_uri_destroy(f->uri);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void bd_flusher_wake(struct bd_flusher *f) {
    pthread_mutex_lock(&f->mu);
    f->wake_pending = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* ---- bucket pages --------------------------------------------------------------------- */

static struct bucket_state *bucket_state(struct bd_flusher *f, struct bd_sensor *s,
                                         int64_t start_ms, int64_t now_ms) {
    struct sensor_state *ss = s->flusher_state;
    const int64_t span = (int64_t)f->cfg->buckets.span_ms;
    /* A bucket ending before this can no longer receive readings. */
    const int64_t closed_before = now_ms - (int64_t)f->cfg->buckets.max_late_ms - span;
    uint32_t oldest = 0, reuse = UINT32_MAX;
    for (uint32_t i = 0; ss != NULL && i < ss->n; i++) {
        if (ss->b[i].start_ms == start_ms) {
            return &ss->b[i];
        }
        if (ss->b[i].start_ms + span < closed_before && reuse == UINT32_MAX) {
            reuse = i;
        }
        if (ss->b[i].start_ms < ss->b[oldest].start_ms) {
            oldest = i;
        }
    }
    struct bucket_state *b = NULL;
    if (reuse != UINT32_MAX) {
        b = &ss->b[reuse];
    } else if (ss == NULL || ss->n == ss->cap) {
        /* The window holds at most max_late/span + max_future/span + 2 buckets; past that
         * (a clock jump) the oldest is forgotten rather than growing without bound. */
        uint64_t limit = (f->cfg->buckets.max_late_ms + f->cfg->buckets.max_future_ms) /
                             f->cfg->buckets.span_ms + 3;
        uint32_t cap = ss == NULL ? 2 : ss->cap * 2;
        if (ss != NULL && ss->cap >= limit) {
            b = &ss->b[oldest];
        } else {
            cap = (uint32_t)BD_MIN((uint64_t)cap, limit);
            struct sensor_state *grown = realloc(ss, sizeof(*ss) + cap * sizeof(ss->b[0]));
            if (grown == NULL) {
                return NULL;
            }
            if (ss == NULL) {
                grown->n = 0;
            }
            grown->cap = cap;
            ss = grown;
            s->flusher_state = ss;
            b = &ss->b[ss->n++];
        }
    } else {
        b = &ss->b[ss->n++];
    }
    b->start_ms = start_ms;
    b->page = 0;
    b->count = 0;
    return b;
}

/* ---- deltas ---------------------------------------------------------------------------- */

static uint64_t delta_hash(const struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    uint64_t h = (uint64_t)(uintptr_t)s * UINT64_C(0x9E3779B97F4A7C15);
    h ^= (uint64_t)start_ms * UINT64_C(0xC2B2AE3D27D4EB4F);
    h ^= (uint64_t)page * UINT64_C(0x165667B19E3779F9);
    return h ^ (h >> 29);
}

static int rebuild_slots(struct bd_flusher *f, uint32_t mask) {
    struct delta_slot *slots = calloc((size_t)mask + 1, sizeof(*slots));
    if (slots == NULL) {
        return -ENOMEM;
    }
    free(f->slots);
    f->slots = slots;
    f->slot_mask = mask;
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        const struct bd_delta *d = &f->deltas[i];
        uint32_t j = (uint32_t)delta_hash(d->sensor, d->start_ms, d->page) & mask;
        while (slots[j].idx_plus1 != 0) {
            j = (j + 1) & mask;
        }
        slots[j].idx_plus1 = i + 1;
    }
    return 0;
}

static struct bd_delta *delta_get(struct bd_flusher *f, struct bd_sensor *s, int64_t start_ms,
                                  uint32_t page) {
    uint32_t j = (uint32_t)delta_hash(s, start_ms, page) & f->slot_mask;
    while (f->slots[j].idx_plus1 != 0) {
        struct bd_delta *d = &f->deltas[f->slots[j].idx_plus1 - 1];
        if (d->sensor == s && d->start_ms == start_ms && d->page == page) {
            return d;
        }
        j = (j + 1) & f->slot_mask;
    }
    if (f->n_deltas == f->cap_deltas) {
        uint32_t cap = f->cap_deltas ? f->cap_deltas * 2 : 256;
        struct bd_delta *nd = realloc(f->deltas, (size_t)cap * sizeof(*nd));
        if (nd == NULL) {
            return NULL;
        }
        memset(nd + f->cap_deltas, 0, (size_t)(cap - f->cap_deltas) * sizeof(*nd));
        f->deltas = nd;
        bool *done = realloc(f->done, cap * sizeof(*done));
        if (done == NULL) {
            return NULL;
        }
        f->done = done;
        f->cap_deltas = cap;
    }
    struct bd_delta *d = &f->deltas[f->n_deltas];
    /* Keep the buffers of a delta slot used by an earlier flush. */
    struct bd_delta keep = *d;
    bd_delta_init(d, s, start_ms, page);
    d->readings = keep.readings;
    d->cap_readings = keep.cap_readings;
    d->values = keep.values;
    d->cap_values = keep.cap_values;
    d->summaries = keep.summaries;
    d->cap_summaries = keep.cap_summaries;
    f->done[f->n_deltas] = false;
    f->slots[j].idx_plus1 = ++f->n_deltas;
    if (f->n_deltas * 2 > f->slot_mask && rebuild_slots(f, f->slot_mask * 2 + 1) < 0) {
        return NULL;
    }
    return d;
}

static void clear_deltas(struct bd_flusher *f) {
    f->queued = 0;
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        bd_delta_reset(&f->deltas[i]);
    }
    f->n_deltas = 0;
    memset(f->slots, 0, ((size_t)f->slot_mask + 1) * sizeof(*f->slots));
}

static uint64_t pending_readings(const struct bd_flusher *f) {
    uint64_t n = 0;
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        if (!f->done[i]) {
            n += f->deltas[i].n_readings;
        }
    }
    return n;
}

/*
 * Move every dirty sensor's readings into deltas. Returns the number of readings moved. An
 * allocation failure leaves the rest in the ring (the sensor is re-queued by its next reading
 * or by the next drain) rather than losing it.
 */
static uint64_t drain(struct bd_flusher *f) {
    uint64_t moved = 0;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_sensor *s;
    const uint64_t span = f->cfg->buckets.span_ms;
    const uint32_t cap = f->cfg->buckets.max_readings;
    const int64_t now_ms = bd_now_ns() / BD_NS_PER_MS;

    while ((s = bd_sensor_table_next_dirty(f->table)) != NULL) {
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            int64_t start = bd_bucket_start_ms(ts, span);
            struct bucket_state *b = bucket_state(f, s, start, now_ms);
            if (b == NULL) {
                break;
            }
            if (b->count >= cap) {
                b->page++;
                b->count = 0;
            }
            struct bd_delta *d = delta_get(f, s, start, b->page);
            if (d == NULL || bd_delta_add(d, ts, vals, nv) < 0) {
                bd_error("flusher: out of memory; readings stay in the ring of %s", s->id);
                break;
            }
            b->count++;
            bd_ring_consume(&s->ring, cells);
            moved++;
        }
    }
    return moved;
}

/* ---- MongoDB ---------------------------------------------------------------------------- */

static bool ensure_client(struct bd_flusher *f) {
    if (f->client == NULL) {
        f->client = mongoc_client_pool_pop(f->pool);
        f->coll = mongoc_client_get_collection(f->client, f->cfg->mongodb.database,
                                               f->cfg->mongodb.collection);
    }
    return f->client != NULL;
}

/* Idempotent: createIndexes with an existing identical index is a no-op on the server. */
static void ensure_indexes(struct bd_flusher *f) {
    if (f->indexes_ok || !ensure_client(f)) {
        return;
    }
    bson_t cmd, indexes, idx, key, reply;
    bson_error_t berr;
    bson_init(&cmd);
    BSON_APPEND_UTF8(&cmd, "createIndexes", f->cfg->mongodb.collection);
    BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &indexes);
    BSON_APPEND_DOCUMENT_BEGIN(&indexes, "0", &idx);
    BSON_APPEND_DOCUMENT_BEGIN(&idx, "key", &key);
    BSON_APPEND_INT32(&key, "sensor_id", 1);
    BSON_APPEND_INT32(&key, "bucket_start", 1);
    bson_append_document_end(&idx, &key);
    BSON_APPEND_UTF8(&idx, "name", "sensor_id_1_bucket_start_1");
    bson_append_document_end(&indexes, &idx);
    bson_append_array_end(&cmd, &indexes);
    mongoc_database_t *db = mongoc_client_get_database(f->client, f->cfg->mongodb.database);
    if (mongoc_database_write_command_with_opts(db, &cmd, NULL, &reply, &berr)) {
        f->indexes_ok = true;
        bd_info("indexes ready on %s.%s", f->cfg->mongodb.database, f->cfg->mongodb.collection);
    } else if (bd_ratelimit_ok(&f->fail_log, bd_mono_ns())) {
        bd_error("cannot create indexes on %s.%s (will retry): %s", f->cfg->mongodb.database,
                 f->cfg->mongodb.collection, berr.message);
    }
    mongoc_database_destroy(db);
    bson_destroy(&reply);
    bson_destroy(&cmd);
}

/* Server error codes that mean "try again later" rather than "this update is wrong". */
static bool transient_code(int64_t code) {
    static const int64_t codes[] = {
        6,     /* HostUnreachable */
        7,     /* HostNotFound */
        89,    /* NetworkTimeout */
        91,    /* ShutdownInProgress */
        189,   /* PrimarySteppedDown */
        262,   /* ExceededTimeLimit */
        9001,  /* SocketException */
        10107, /* NotWritablePrimary */
        11600, /* InterruptedAtShutdown */
        11602, /* InterruptedDueToReplStateChange */
        13435, /* NotPrimaryNoSecondaryOk */
        13436, /* NotPrimaryOrSecondary */
        64,    /* WriteConcernFailed */
        50,    /* MaxTimeMSExpired */
        112,   /* WriteConflict */
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(codes); i++) {
        if (codes[i] == code) {
            return true;
        }
    }
    return false;
}

static uint64_t next_rand(struct bd_flusher *f) {
    f->rng ^= f->rng << 13;
    f->rng ^= f->rng >> 7;
    f->rng ^= f->rng << 17;
    return f->rng;
}

static void schedule_retry(struct bd_flusher *f) {
    uint64_t cap = f->cfg->flush.retry_max_ms;
    uint64_t base = f->cfg->flush.retry_initial_ms;
    uint32_t shift = f->attempt < 30 ? f->attempt : 30;
    uint64_t ceiling = base << shift;
    if (ceiling > cap || ceiling < base) {
        ceiling = cap;
    }
    /* Full jitter: spread retries of many daemons over the whole window. */
    uint64_t delay_ms = ceiling ? next_rand(f) % (ceiling + 1) : 0;
    f->attempt++;
    BD_STAT_ADD(f->stats, bulk_retries, 1);
    f->retry_at = bd_mono_ns() + (int64_t)delay_ms * BD_NS_PER_MS;
}

/* Walk writeErrors back to the chunk's deltas: transient ones stay pending, others are
 * quarantined. Returns true if any op needs a retry. */
static bool handle_write_errors(struct bd_flusher *f, const bson_t *reply, const uint32_t *ops,
                                uint32_t n_ops, bool *failed) {
    bson_iter_t it, arr;
    bool retry = false;
    if (!bson_iter_init_find(&it, reply, "writeErrors") || !BSON_ITER_HOLDS_ARRAY(&it) ||
        !bson_iter_recurse(&it, &arr)) {
        return false;
    }
    while (bson_iter_next(&arr)) {
        bson_iter_t e;
        int64_t index = -1, code = 0;
        const char *msg = "";
        if (!BSON_ITER_HOLDS_DOCUMENT(&arr) || !bson_iter_recurse(&arr, &e)) {
            continue;
        }
        while (bson_iter_next(&e)) {
            const char *k = bson_iter_key(&e);
            if (strcmp(k, "index") == 0) {
                index = bson_iter_as_int64(&e);
            } else if (strcmp(k, "code") == 0) {
                code = bson_iter_as_int64(&e);
            } else if (strcmp(k, "errmsg") == 0 && BSON_ITER_HOLDS_UTF8(&e)) {
                msg = bson_iter_utf8(&e, NULL);
            }
        }
        if (index < 0 || (uint64_t)index >= n_ops) {
            continue;
        }
        failed[index] = true;
        if (transient_code(code)) {
            retry = true;
            continue;
        }
        struct bd_delta *d = &f->deltas[ops[index]];
        f->done[ops[index]] = true;
        BD_STAT_ADD(f->stats, updates_quarantined, 1);
        BD_STAT_ADD(f->stats, readings_quarantined, d->n_readings);
        if (bd_ratelimit_ok(&f->quarantine_log, bd_mono_ns())) {
            char id[1024];
            bd_bucket_id(id, sizeof(id), d->sensor->id, d->start_ms, d->page);
            bd_error("MongoDB rejected the update of bucket %s (%u readings dropped): code %" PRId64
                     ": %s",
                     id, d->n_readings, code, msg);
        }
    }
    return retry;
}

static bool array_nonempty(const bson_t *doc, const char *key) {
    bson_iter_t it, arr;
    return bson_iter_init_find(&it, doc, key) && BSON_ITER_HOLDS_ARRAY(&it) &&
           bson_iter_recurse(&it, &arr) && bson_iter_next(&arr);
}

/* Send one chunk of pending deltas; returns true if all of it is settled. */
static bool send_chunk(struct bd_flusher *f, uint32_t *ops, uint32_t n_ops, bool *failed) {
    bson_t opts, upsert_opts, reply, selector, update;
    bson_error_t berr;
    bool settled = true;

    bson_init(&opts);
    BSON_APPEND_BOOL(&opts, "ordered", false);
    mongoc_write_concern_append(f->wc, &opts);
    mongoc_bulk_operation_t *bulk = mongoc_collection_create_bulk_operation_with_opts(f->coll, &opts);
    bson_destroy(&opts);
    bson_init(&upsert_opts);
    BSON_APPEND_BOOL(&upsert_opts, "upsert", true);
    for (uint32_t i = 0; i < n_ops; i++) {
        struct bd_delta *d = &f->deltas[ops[i]];
        bd_delta_build_update(d, f->cfg->buckets.span_ms, &selector, &update);
        if (!mongoc_bulk_operation_update_one_with_opts(bulk, &selector, &update, &upsert_opts,
                                                        &berr)) {
            /* The driver refused the document itself: it can never succeed. */
            BD_ASSERT(false && "update document refused by the driver");
        }
        bson_destroy(&selector);
        bson_destroy(&update);
        failed[i] = false;
    }
    bson_destroy(&upsert_opts);

    uint32_t ok = mongoc_bulk_operation_execute(bulk, &reply, &berr);
    BD_STAT_ADD(f->stats, bulk_writes, 1);
    BD_STAT_ADD(f->stats, updates_sent, n_ops);
    if (ok) {
        for (uint32_t i = 0; i < n_ops; i++) {
            f->done[ops[i]] = true;
            BD_STAT_ADD(f->stats, readings_flushed, f->deltas[ops[i]].n_readings);
        }
    } else {
        bool has_write_errors = array_nonempty(&reply, "writeErrors");
        bool wc_error = array_nonempty(&reply, "writeConcernErrors");
        bool retry = handle_write_errors(f, &reply, ops, n_ops, failed);
        bool net = berr.domain == MONGOC_ERROR_STREAM ||
                   berr.domain == MONGOC_ERROR_SERVER_SELECTION ||
                   mongoc_error_has_label(&reply, "RetryableWriteError");
        if (!has_write_errors || wc_error || net) {
            /* Network, server selection, write concern or a command-level failure: nothing is
             * known to have been applied, so the whole chunk stays pending. */
            for (uint32_t i = 0; i < n_ops; i++) {
                failed[i] = !f->done[ops[i]];
            }
            retry = true;
        }
        for (uint32_t i = 0; i < n_ops; i++) {
            if (!failed[i]) {
                f->done[ops[i]] = true;
                BD_STAT_ADD(f->stats, readings_flushed, f->deltas[ops[i]].n_readings);
            }
        }
        if (retry) {
            settled = false;
            if (bd_ratelimit_ok(&f->fail_log, bd_mono_ns())) {
                bd_error("MongoDB write failed (%s); keeping %" PRIu64
                         " readings and retrying with backoff",
                         berr.message, pending_readings(f));
            }
        }
    }
    bson_destroy(&reply);
    mongoc_bulk_operation_destroy(bulk);
    return settled;
}

/* Write every pending delta; true when none is left pending. */
static bool send_pending(struct bd_flusher *f) {
    uint32_t max = f->cfg->flush.max_updates;
    uint32_t *ops = malloc((size_t)max * sizeof(*ops));
    bool *failed = malloc((size_t)max * sizeof(*failed));
    bool all = true;
    if (ops == NULL || failed == NULL) {
        all = false;
        goto out;
    }
    if (!ensure_client(f)) {
        all = false;
        goto out;
    }
    ensure_indexes(f);
    uint32_t n = 0;
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        if (f->done[i]) {
            continue;
        }
        ops[n++] = i;
        if (n == max) {
            all = send_chunk(f, ops, n, failed) && all;
            n = 0;
            if (!all) {
                /* Stop at the first failing chunk: later chunks wait for the retry. */
                goto out;
            }
        }
    }
    if (n > 0) {
        all = send_chunk(f, ops, n, failed) && all;
    }
out:
    free(ops);
    free(failed);
    return all;
}

/* Write what the deltas hold: one bulk per flush.max_updates deltas. */
static void write_pending(struct bd_flusher *f) {
    if (f->cfg->sink == BD_SINK_BLACKHOLE) {
        for (uint32_t i = 0; i < f->n_deltas; i++) {
            BD_STAT_ADD(f->stats, readings_flushed, f->deltas[i].n_readings);
        }
        clear_deltas(f);
        return;
    }
    if (send_pending(f)) {
        if (f->attempt > 0) {
            bd_info("MongoDB writes succeed again after %u failed attempts", f->attempt);
        }
        f->attempt = 0;
        f->retry_at = 0;
        clear_deltas(f);
    } else {
        schedule_retry(f);
    }
}

/*
 * One step of the flusher. Draining and writing are separate: a ring past its high-water mark
 * wakes the flusher to move readings into the deltas (freeing the ring), but the write waits
 * for the interval, so each bucket still gets one update per flush.interval however small the
 * rings are. The deltas are bounded: a full bulk (flush.max_updates) or MAX_QUEUED readings
 * are written at once. While a failed write waits for its retry nothing is drained, so the
 * batch being retried never changes and the rings are the buffer.
 */
static void flush_step(struct bd_flusher *f, int64_t now, bool stopping) {
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    if (f->retry_at != 0) {
        if (now >= f->retry_at) {
            write_pending(f);
        }
        return;
    }
    f->queued += drain(f);
    if (f->drained != NULL) {
        f->drained(f->drained_arg);
    }
    if (f->n_deltas == 0) {
        if (now >= f->send_at) {
            f->send_at = now + interval_ns;
        }
        return;
    }
    if (stopping || now >= f->send_at || f->n_deltas >= f->cfg->flush.max_updates ||
        f->queued >= MAX_QUEUED) {
        BD_STAT_ADD(f->stats, flushes, 1);
        write_pending(f);
        f->send_at = now + interval_ns;
    }
}

/* Readings still in rings at the end: counted as lost, rings emptied. */
static uint64_t discard_rings(struct bd_flusher *f) {
    uint64_t lost = 0;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(f->table)) != NULL) {
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            bd_ring_consume(&s->ring, cells);
            lost++;
        }
    }
    return lost;
}

static void timespec_after_ns(struct timespec *ts, int64_t delta_ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    int64_t ns = ts->tv_nsec + (delta_ns > 0 ? delta_ns : 0);
    ts->tv_sec += ns / BD_NS_PER_S;
    ts->tv_nsec = ns % BD_NS_PER_S;
}

static void *flusher_main(void *arg) {
    struct bd_flusher *f = arg;
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    int64_t stop_deadline = 0;
    bool have_deadline = false;

    if (f->cfg->sink == BD_SINK_MONGODB && ensure_client(f)) {
        ensure_indexes(f);
    }
    f->send_at = bd_mono_ns() + interval_ns;
    for (;;) {
        int64_t now = bd_mono_ns();
        int64_t wait_ns = (f->retry_at ? f->retry_at : f->send_at) - now;
        bool stopping;
        pthread_mutex_lock(&f->mu);
        if (!f->stop && !f->wake_pending && wait_ns > 0) {
            struct timespec ts;
            timespec_after_ns(&ts, wait_ns);
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        }
        f->wake_pending = false;
        stopping = f->stop;
        if (stopping && !have_deadline) {
            stop_deadline = f->stop_deadline;
            have_deadline = true;
        }
        pthread_mutex_unlock(&f->mu);

        flush_step(f, bd_mono_ns(), stopping);
        if (!stopping) {
            continue;
        }
        if (f->n_deltas == 0 && !bd_sensor_table_has_dirty(f->table)) {
            break;
        }
        if (bd_mono_ns() >= stop_deadline) {
            uint64_t lost = pending_readings(f) + discard_rings(f);
            BD_STAT_ADD(f->stats, readings_lost, lost);
            bd_error("stop deadline (flush.stop_timeout=%" PRIu64 "ms) passed with MongoDB "
                     "unreachable: %" PRIu64 " accepted readings were not stored",
                     f->cfg->flush.stop_timeout_ms, lost);
            clear_deltas(f);
            break;
        }
        if (f->retry_at != 0) {
            /* Sleep out the backoff, but not past the deadline. */
            int64_t until = BD_MIN(f->retry_at, stop_deadline);
            int64_t ns = until - bd_mono_ns();
            if (ns > 0) {
                struct timespec ts = {.tv_sec = ns / BD_NS_PER_S, .tv_nsec = ns % BD_NS_PER_S};
                nanosleep(&ts, NULL);
            }
        }
    }
    if (f->client != NULL) {
        mongoc_collection_destroy(f->coll);
        mongoc_client_pool_push(f->pool, f->client);
        f->coll = NULL;
        f->client = NULL;
    }
    return NULL;
}

int bd_flusher_start(struct bd_flusher *f, struct bd_err *err) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_destroy(&f->cv);
    pthread_cond_init(&f->cv, &attr);
    pthread_condattr_destroy(&attr);
    int rc = pthread_create(&f->thread, NULL, flusher_main, f);
    if (rc != 0) {
        return bd_err_set(err, -rc, "flusher: cannot start thread: %s", strerror(rc));
    }
    f->started = true;
    return 0;
}

void bd_flusher_stop(struct bd_flusher *f, int64_t deadline_mono_ns) {
    if (!f->started) {
        return;
    }
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    f->stop_deadline = deadline_mono_ns;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    f->started = false;
}
