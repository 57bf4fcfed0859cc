/*
 * Flusher thread: drains dirty sensors, builds per-bucket deltas and writes them to MongoDB.
 *
 * Threads: everything in struct bd_flusher below the "flusher thread only" line is touched by
 * the flusher thread alone; the mutex/condition variable pair is the doorbell from the other
 * threads (wake, stop). The mongoc client is popped from the pool once and used only here.
 *
 * Whenever woken (the interval, or a ring past its high-water mark): pop every dirty sensor and
 * move its readings out of the ring into deltas keyed by (sensor, bucket start, page). Once per
 * flush.interval: send the deltas in unordered bulks of at most flush.max_updates upserts. A delta
 * leaves the pending set when MongoDB acknowledged it or rejected it for good (quarantined,
 * counted, logged); on a transient error the remaining deltas are retried after a backoff and
 * nothing new is drained in between, which keeps each bucket's updates in order and memory bounded
 * by the rings.
 *
 * Page accounting: each sensor keeps, in flusher_state, the page and reading count of every
 * bucket it still has open (inside the late/future window); a page that reaches
 * buckets.max_readings moves new readings to the next page. A bucket that an earlier run may
 * have written (it starts before the look-up horizon: now + max_future at start-up, or the
 * newest bucket the writer state remembers) is "unknown": its readings collect in one delta
 * with page BD_PAGE_UNKNOWN, and before the batch is first sent one query per chunk of
 * flush.max_updates such deltas reads the existing pages and counts, and the delta is split
 * over the right pages.
 *
 * Exactly once: each batch takes one number from the writer sequence (writer.h) and every
 * update carries it (bucket.c). A retry re-sends the same updates with the same number, so an
 * update MongoDB applied before the reply was lost comes back as duplicate key (11000),
 * counted as already applied. An 11000 on an update that was never sent ambiguously cannot be
 * our own echo: it is another writer's insert racing ours (retried) or, if it persists, a
 * second daemon using this writer_id (counted in writer_conflicts, quarantined, logged).
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
#include "bucketd/writer.h"

/* Readings the deltas may hold before they are written ahead of the interval (~50 MB). */
#define MAX_QUEUED (UINT64_C(1) << 20)

/* Page of a delta whose bucket's existing pages are not known yet. */
#define BD_PAGE_UNKNOWN UINT32_MAX

/* Definitive duplicate-key answers an update may get before it counts as a writer conflict. */
#define MAX_DUP_REFUSALS 3

struct bucket_state {
    int64_t start_ms;
    uint32_t page;
    uint32_t count; /* readings in the page, as written or pending */
    bool known;     /* page and count include what earlier runs wrote */
};

/* Per pending delta: where it stands with MongoDB. */
struct delta_meta {
    bool done;          /* acknowledged, already applied or quarantined */
    bool maybe_applied; /* an attempt ended without a definitive answer */
    uint8_t dup_refusals;
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
    bool wake_pending;     /* guarded by mu */
    bool stop;             /* guarded by mu */
    int64_t stop_deadline; /* guarded by mu */

    bd_flusher_drained_cb drained;
    void *drained_arg;

    /* ---- flusher thread only ---- */
    mongoc_client_t *client;
    mongoc_collection_t *coll;
    bool indexes_ok;

    struct bd_delta *deltas; /* pending deltas [0, n_deltas); buffers reused */
    struct delta_meta *meta; /* per delta */
    uint32_t n_deltas, cap_deltas;
    struct delta_slot *slots;
    uint32_t slot_mask;

    uint64_t queued;  /* readings in the deltas */
    int64_t send_at;  /* monotonic ns of the next scheduled write */
    uint32_t attempt; /* consecutive failed bulk writes */
    int64_t retry_at; /* monotonic ns of the next attempt, 0 = none */
    uint64_t rng;     /* xorshift state for jitter */
    bool clean_stop;  /* not started, or the thread ended through its stop path */
    struct bd_ratelimit fail_log;
    struct bd_ratelimit quarantine_log;
    struct bd_ratelimit conflict_log;

    struct bd_writer *writer; /* NULL with the blackhole sink */
    char writer_key[160];     /* "w.<writer_id>" */
    bool seq_known;           /* the sequence is past every number in the documents */
    bool have_seq;            /* batch_seq belongs to the pending batch */
    uint64_t batch_seq;
    int64_t learn_horizon_ms; /* buckets starting at or before this may hold earlier pages */
    int64_t batch_max_start_ms;
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

static void report_previous_run(const struct bd_flusher *f) {
    const struct bd_writer_prev *p = bd_writer_previous(f->writer);
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
                "readings it accepted after its last acknowledged write (%s) and before it "
                "ended were lost; nothing it wrote will be written twice",
                p->writer_id, when);
    }
}

static int open_writer(struct bd_flusher *f, struct bd_err *err) {
    int rc = bd_writer_open(&f->writer, f->cfg->spool.dir, f->cfg->writer_id, err);
    if (rc < 0) {
        return rc;
    }
    snprintf(f->writer_key, sizeof(f->writer_key), BD_WRITER_KEY_PREFIX "%s", f->cfg->writer_id);
    f->seq_known = bd_writer_previous(f->writer)->found;
    int64_t horizon = bd_now_ns() / BD_NS_PER_MS + (int64_t)f->cfg->buckets.max_future_ms;
    f->learn_horizon_ms = BD_MAX(horizon, bd_writer_max_bucket_start(f->writer));
    report_previous_run(f);
    return 0;
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
    f->clean_stop = true; /* a daemon that fails before the thread starts accepted nothing */
    f->fail_log.interval_ns = 10 * BD_NS_PER_S;
    f->fail_log.burst = 1;
    f->quarantine_log.interval_ns = 10 * BD_NS_PER_S;
    f->quarantine_log.burst = 5;
    f->conflict_log.interval_ns = 10 * BD_NS_PER_S;
    f->conflict_log.burst = 3;
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
        rc = bd_mongo_write_concern_new(cfg->mongodb.write_concern, cfg->mongodb.wtimeout_ms,
                                        &f->wc, err);
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
        rc = open_writer(f, err);
        if (rc < 0) {
            goto out;
        }
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
    free(f->meta);
    free(f->slots);
    bd_writer_close(f->writer, f->clean_stop);
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
                             f->cfg->buckets.span_ms +
                         3;
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
    b->known = f->writer == NULL || start_ms > f->learn_horizon_ms;
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
        struct delta_meta *meta = realloc(f->meta, cap * sizeof(*meta));
        if (meta == NULL) {
            return NULL;
        }
        f->meta = meta;
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
    f->meta[f->n_deltas] = (struct delta_meta){0};
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
        if (!f->meta[i].done) {
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
        /* A sensor's readings mostly fall in one bucket: while they do, its state and delta
         * are the ones the previous reading used. Both pointers come from the latest
         * bucket_state / delta_get call (either may move what earlier calls returned). */
        struct bucket_state *b = NULL;
        struct bd_delta *d = NULL;
        int64_t lo_ns = 0, hi_ns = 0; /* b's bucket, [lo_ns, hi_ns) */
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            if (b == NULL || ts < lo_ns || ts >= hi_ns) {
                int64_t start = bd_bucket_start_ms(ts, span);
                b = bucket_state(f, s, start, now_ms);
                if (b == NULL) {
                    break;
                }
                d = NULL;
                lo_ns = start * BD_NS_PER_MS;
                hi_ns = (start + (int64_t)span) * BD_NS_PER_MS;
            }
            if (b->known && b->count >= cap) {
                b->page++;
                b->count = 0;
                d = NULL;
            }
            if (d == NULL) {
                d = delta_get(f, s, b->start_ms, b->known ? b->page : BD_PAGE_UNKNOWN);
            }
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
    /* Nothing is drained until the retry succeeds (already said when the write began). */
    BD_ASSERT(bd_sensor_table_stalled(f->table));
}

/*
 * Before a bulk write to MongoDB: nothing is drained until it (and any retry) is done, so UDP
 * listeners paused for a congested ring must read again, into the rings (see
 * bd_sensor_table_set_stalled). The blackhole sink's writes take no time: not said.
 */
static void begin_write(struct bd_flusher *f) {
    if (f->cfg->sink != BD_SINK_BLACKHOLE && !bd_sensor_table_stalled(f->table)) {
        bd_sensor_table_set_stalled(f->table, true);
        if (f->drained != NULL) {
            f->drained(f->drained_arg);
        }
    }
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
        struct delta_meta *m = &f->meta[ops[index]];
        struct bd_delta *d = &f->deltas[ops[index]];
        if (code == 11000 && m->maybe_applied) {
            /* The filter refused our own sequence number: an earlier attempt got through. */
            m->done = true;
            BD_STAT_ADD(f->stats, updates_already_applied, 1);
            BD_STAT_ADD(f->stats, readings_flushed, d->n_readings);
            continue;
        }
        if (code == 11000 && ++m->dup_refusals < MAX_DUP_REFUSALS) {
            /* Another writer's upsert created the document between our match and our insert;
             * the next attempt finds it and updates it. */
            retry = true;
            continue;
        }
        if (code != 11000 && transient_code(code)) {
            retry = true;
            continue;
        }
        m->done = true;
        BD_STAT_ADD(f->stats, updates_quarantined, 1);
        BD_STAT_ADD(f->stats, readings_quarantined, d->n_readings);
        char id[1024];
        bd_bucket_id(id, sizeof(id), d->sensor->id, d->start_ms, d->page);
        if (code == 11000) {
            /* A configuration error, not bad data: its own limiter, so bad input cannot hide it. */
            BD_STAT_ADD(f->stats, writer_conflicts, 1);
            if (bd_ratelimit_ok(&f->conflict_log, bd_mono_ns())) {
                bd_error("bucket %s already holds sequence %" PRIu64 " or newer of writer_id %s, "
                         "which this daemon never sent: another daemon is using writer_id %s; "
                         "give each daemon its own (%u readings not written)",
                         id, f->batch_seq, f->cfg->writer_id, f->cfg->writer_id, d->n_readings);
            }
        } else if (bd_ratelimit_ok(&f->quarantine_log, bd_mono_ns())) {
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
    mongoc_bulk_operation_t *bulk =
        mongoc_collection_create_bulk_operation_with_opts(f->coll, &opts);
    bson_destroy(&opts);
    bson_init(&upsert_opts);
    BSON_APPEND_BOOL(&upsert_opts, "upsert", true);
    for (uint32_t i = 0; i < n_ops; i++) {
        struct bd_delta *d = &f->deltas[ops[i]];
        bd_delta_build_update(d, f->cfg->buckets.span_ms, f->writer_key, f->batch_seq, &selector,
                              &update);
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
            f->meta[ops[i]].done = true;
            BD_STAT_ADD(f->stats, readings_flushed, f->deltas[ops[i]].n_readings);
        }
    } else {
        bool has_write_errors = array_nonempty(&reply, "writeErrors");
        bool wc_error = array_nonempty(&reply, "writeConcernErrors");
        bool retry = handle_write_errors(f, &reply, ops, n_ops, failed);
        bool net = berr.domain == MONGOC_ERROR_STREAM ||
                   berr.domain == MONGOC_ERROR_SERVER_SELECTION ||
                   mongoc_error_has_label(&reply, "RetryableWriteError");
        /* Network, server selection, write concern or a command-level failure: an update with
         * no error of its own may or may not have been applied. It stays pending and is marked,
         * so that the duplicate-key answer to its retry counts as applied. */
        bool ambiguous = !has_write_errors || wc_error || net;
        for (uint32_t i = 0; i < n_ops; i++) {
            struct delta_meta *m = &f->meta[ops[i]];
            if (m->done || failed[i]) {
                continue;
            }
            if (ambiguous) {
                m->maybe_applied = true;
                retry = true;
            } else {
                m->done = true;
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

/* ---- what earlier runs wrote ------------------------------------------------------------ */

/* This writer's sequence number in a bucket document, 0 if it has none. */
static uint64_t doc_writer_seq(const struct bd_flusher *f, const bson_t *doc) {
    bson_iter_t it, child;
    if (bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, f->writer_key, &child) &&
        BSON_ITER_HOLDS_NUMBER(&child)) {
        int64_t v = bson_iter_as_int64(&child);
        return v > 0 ? (uint64_t)v : 0;
    }
    return 0;
}

/* what: "MongoDB page look-up", ...: the step before a batch's first write that failed. */
static void log_lookup_failure(struct bd_flusher *f, const char *what, const char *msg) {
    if (bd_ratelimit_ok(&f->fail_log, bd_mono_ns())) {
        bd_error("%s failed (%s); keeping %" PRIu64 " readings and retrying with backoff", what,
                 msg, pending_readings(f));
    }
}

/* Raise the sequence above a number found in the collection; false if it cannot be saved. */
static bool raise_sequence(struct bd_flusher *f, uint64_t seen) {
    struct bd_err err = {0};
    if (bd_writer_raise(f->writer, seen, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    return true;
}

/*
 * Without a writer state on disk (first start, or the spool directory was lost) the sequence
 * must continue above the highest number this writer id left in the collection, or the filter
 * would refuse its first updates. One query, once, sorted on w.<writer_id>: a collection scan
 * on a large collection, which is why the number is normally kept on disk.
 */
static bool recover_sequence(struct bd_flusher *f) {
    if (f->seq_known) {
        return true;
    }
    bson_t filter, cond, opts, sort, proj;
    const bson_t *doc;
    bson_error_t berr;
    uint64_t seen = 0;
    bson_init(&filter);
    BSON_APPEND_DOCUMENT_BEGIN(&filter, f->writer_key, &cond);
    BSON_APPEND_BOOL(&cond, "$exists", true);
    bson_append_document_end(&filter, &cond);
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, f->writer_key, -1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", 1);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
    BSON_APPEND_INT32(&proj, f->writer_key, 1);
    bson_append_document_end(&opts, &proj);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(f->coll, &filter, &opts, NULL);
    while (mongoc_cursor_next(cur, &doc)) {
        seen = BD_MAX(seen, doc_writer_seq(f, doc));
    }
    bool ok = !mongoc_cursor_error(cur, &berr);
    mongoc_cursor_destroy(cur);
    bson_destroy(&opts);
    bson_destroy(&filter);
    if (!ok) {
        log_lookup_failure(f, "MongoDB sequence look-up", berr.message);
        return false;
    }
    if (!raise_sequence(f, seen)) {
        return false;
    }
    f->seq_known = true;
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

static struct learn_item *find_item(struct learn_item *items, uint32_t n, const char *sensor_id,
                                    int64_t start_ms) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = cmp_learn_key(&items[mid], sensor_id, start_ms);
        if (c == 0) {
            return &items[mid];
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return NULL;
}

/*
 * Put an unknown delta's readings on the right pages, given the last existing page and its
 * count: what still fits stays on that page, the rest fills the next ones (arrival order).
 */
static bool repage(struct bd_flusher *f, uint32_t di, uint32_t page, uint32_t count,
                   int64_t now_ms) {
    const uint32_t cap = f->cfg->buckets.max_readings;
    struct bd_sensor *s = f->deltas[di].sensor;
    const int64_t start = f->deltas[di].start_ms;
    struct bucket_state *b = bucket_state(f, s, start, now_ms);
    if (b == NULL) {
        return false;
    }
    if (count >= cap) {
        page++;
        count = 0;
    }
    f->deltas[di].page = page;
    while (count + f->deltas[di].n_readings > cap) {
        struct bd_delta *next = delta_get(f, s, start, page + 1);
        if (next == NULL) {
            return false;
        }
        uint32_t ni = (uint32_t)(next - f->deltas);
        if (bd_delta_split(&f->deltas[di], cap - count, next) < 0) {
            bd_delta_reset(next);
            f->meta[ni].done = true; /* empty: nothing to send */
            return false;
        }
        di = ni;
        page++;
        count = 0;
    }
    b->page = page;
    b->count = count + f->deltas[di].n_readings;
    b->known = true;
    return true;
}

/* {$or: [{sensor_id, bucket_start}, ...]} for the items, with the fields page look-up needs. */
static mongoc_cursor_t *query_pages(struct bd_flusher *f, const struct learn_item *items,
                                    uint32_t n) {
    bson_t filter, or, clause, opts, proj;
    char idx[16];
    const char *key;
    bson_init(&filter);
    BSON_APPEND_ARRAY_BEGIN(&filter, "$or", & or);
    for (uint32_t i = 0; i < n; i++) {
        bson_uint32_to_string(i, &key, idx, sizeof(idx));
        BSON_APPEND_DOCUMENT_BEGIN(& or, key, &clause);
        BSON_APPEND_UTF8(&clause, "sensor_id", items[i].sensor_id);
        BSON_APPEND_DATE_TIME(&clause, "bucket_start", items[i].start_ms);
        bson_append_document_end(& or, &clause);
    }
    bson_append_array_end(&filter, & or);
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
    BSON_APPEND_INT32(&proj, "sensor_id", 1);
    BSON_APPEND_INT32(&proj, "bucket_start", 1);
    BSON_APPEND_INT32(&proj, "page", 1);
    BSON_APPEND_INT32(&proj, "count", 1);
    BSON_APPEND_INT32(&proj, f->writer_key, 1);
    bson_append_document_end(&opts, &proj);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(f->coll, &filter, &opts, NULL);
    bson_destroy(&opts);
    bson_destroy(&filter);
    return cur;
}

/* Fold one returned page into its item: the highest page wins. */
static uint64_t note_page(const struct bd_flusher *f, struct learn_item *items, uint32_t n,
                          const bson_t *doc) {
    bson_iter_t it;
    const char *sensor_id = NULL;
    int64_t start = 0, page = -1, count = 0;
    if (!bson_iter_init(&it, doc)) {
        return 0;
    }
    while (bson_iter_next(&it)) {
        const char *k = bson_iter_key(&it);
        if (strcmp(k, "sensor_id") == 0 && BSON_ITER_HOLDS_UTF8(&it)) {
            sensor_id = bson_iter_utf8(&it, NULL);
        } else if (strcmp(k, "bucket_start") == 0 && BSON_ITER_HOLDS_DATE_TIME(&it)) {
            start = bson_iter_date_time(&it);
        } else if (strcmp(k, "page") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
            page = bson_iter_as_int64(&it);
        } else if (strcmp(k, "count") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
            count = bson_iter_as_int64(&it);
        }
    }
    struct learn_item *item = sensor_id == NULL ? NULL : find_item(items, n, sensor_id, start);
    if (item != NULL && page >= 0 && page < BD_PAGE_UNKNOWN &&
        (item->count == UINT32_MAX || (uint32_t)page > item->page ||
         ((uint32_t)page == item->page && (uint64_t)count > item->count))) {
        item->page = (uint32_t)page;
        item->count = count < 0 ? 0 : (uint32_t)BD_MIN(count, (int64_t)UINT32_MAX - 1);
    }
    return doc_writer_seq(f, doc);
}

/* Look up one chunk of unknown deltas and put them on their pages. */
static bool learn_chunk(struct bd_flusher *f, struct learn_item *items, uint32_t n,
                        uint64_t *max_seq) {
    const bson_t *doc;
    bson_error_t berr;
    qsort(items, n, sizeof(*items), cmp_learn);
    mongoc_cursor_t *cur = query_pages(f, items, n);
    BD_STAT_ADD(f->stats, page_lookups, 1);
    while (mongoc_cursor_next(cur, &doc)) {
        *max_seq = BD_MAX(*max_seq, note_page(f, items, n, doc));
    }
    bool ok = !mongoc_cursor_error(cur, &berr);
    mongoc_cursor_destroy(cur);
    if (!ok) {
        log_lookup_failure(f, "MongoDB page look-up", berr.message);
        return false;
    }
    int64_t now_ms = bd_now_ns() / BD_NS_PER_MS;
    for (uint32_t i = 0; i < n; i++) {
        bool none = items[i].count == UINT32_MAX;
        if (!repage(f, items[i].delta, none ? 0 : items[i].page, none ? 0 : items[i].count,
                    now_ms)) {
            f->deltas[items[i].delta].page = BD_PAGE_UNKNOWN;
            bd_error("flusher: out of memory while placing readings on pages; retrying");
            return false;
        }
    }
    return true;
}

/* Learn the pages of every unknown delta: one query per flush.max_updates of them. */
static bool learn_pages(struct bd_flusher *f) {
    const uint32_t max = f->cfg->flush.max_updates;
    struct learn_item *items = malloc((size_t)max * sizeof(*items));
    uint64_t max_seq = 0;
    bool ok = items != NULL;
    uint32_t next = 0;
    while (ok) {
        uint32_t n = 0;
        /* Deltas added by splits are appended with known pages, so one pass suffices. */
        for (; next < f->n_deltas && n < max; next++) {
            if (!f->meta[next].done && f->deltas[next].page == BD_PAGE_UNKNOWN) {
                const struct bd_delta *d = &f->deltas[next];
                items[n++] = (struct learn_item){.sensor_id = d->sensor->id,
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
    /* Pages changed under the index. */
    if (rebuild_slots(f, f->slot_mask) < 0) {
        ok = false;
    }
    /* A number above ours here means the state on disk is behind the collection. */
    return ok && raise_sequence(f, max_seq);
}

/* Before a batch's first attempt: the sequence and the pages must be right. */
static bool prepare_batch(struct bd_flusher *f) {
    struct bd_err err = {0};
    if (!recover_sequence(f) || !learn_pages(f)) {
        return false;
    }
    if (bd_writer_next(f->writer, &f->batch_seq, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    f->batch_max_start_ms = INT64_MIN;
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        f->batch_max_start_ms = BD_MAX(f->batch_max_start_ms, f->deltas[i].start_ms);
    }
    f->have_seq = true;
    return true;
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
    if (!f->have_seq && !prepare_batch(f)) {
        all = false;
        goto out;
    }
    for (uint32_t i = 0; i < f->n_deltas; i++) {
        if (f->meta[i].done) {
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
        bd_sensor_table_set_stalled(f->table, false);
        f->have_seq = false;
        bd_writer_acked(f->writer, bd_now_ns() / BD_NS_PER_MS, f->batch_max_start_ms);
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
            begin_write(f);
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
        begin_write(f);
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
    f->clean_stop = true;
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
    f->clean_stop = false;
    int rc = pthread_create(&f->thread, NULL, flusher_main, f);
    if (rc != 0) {
        f->clean_stop = true;
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
