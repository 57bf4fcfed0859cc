/*
 * The MongoDB store (see include/bucketd/store.h): mongo-c-driver behind the flusher's store
 * interface, running the queries that src/queries.c builds (the buckets' filter, the summaries'
 * aggregate). The client is popped from the pool on first use by the flusher thread and pushed
 * back by release() when that thread ends.
 *
 * The store keeps its own copies of the settings it needs (names, write concern, retention):
 * the configuration it was made from is replaced by a reload, which reaches the store through
 * reconfigure(), called by the flusher between store calls.
 */
#include "bucketd/store.h"

#include <errno.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/log.h"
#include "bucketd/mongo.h"
#include "bucketd/queries.h"
#include "bucketd/retention.h"

/* A failed retention change (privileges, a conflicting index) is tried again this often. */
#define RETENTION_RETRY_NS (60 * BD_NS_PER_S)

/* The TTL index of one collection (retention.h): the wanted expiry, and whether it is in place. */
struct ttl {
    uint64_t seconds; /* 0: none */
    bool ok;
    int64_t next_try_ns;
};

struct mongo_store {
    struct bd_store base;
    char database[sizeof(((struct bd_config *)0)->mongodb.database)];
    char collection[sizeof(((struct bd_config *)0)->mongodb.collection)];
    bool summaries_on; /* summaries.interval > 0 */
    struct ttl pages_ttl, summary_ttl;
    char writer_key[160];
    mongoc_uri_t *uri;
    mongoc_client_pool_t *pool;
    mongoc_write_concern_t *wc;
    mongoc_client_t *client;
    mongoc_collection_t *coll;
    char summary_coll[BD_SUMMARY_COLLECTION_MAX];
    bool indexes_ok, summary_index_ok;
    struct bd_ratelimit index_log;
};

static bool ensure_client(struct mongo_store *m) {
    if (m->client == NULL) {
        m->client = mongoc_client_pool_pop(m->pool);
        if (m->client == NULL) {
            return false;
        }
        m->coll = mongoc_client_get_collection(m->client, m->database, m->collection);
    }
    return true;
}

/*
 * {sensor_id: 1, bucket_start: 1} on a collection (unique on the summary collection, where
 * $merge needs it). Idempotent: createIndexes with an existing identical index is a no-op on the
 * server.
 */
static bool create_index(struct mongo_store *m, const char *coll, bool unique, bson_error_t *berr) {
    bson_t cmd, indexes, idx, key, reply;
    bson_init(&cmd);
    BSON_APPEND_UTF8(&cmd, "createIndexes", coll);
    BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &indexes);
    BSON_APPEND_DOCUMENT_BEGIN(&indexes, "0", &idx);
    BSON_APPEND_DOCUMENT_BEGIN(&idx, "key", &key);
    BSON_APPEND_INT32(&key, "sensor_id", 1);
    BSON_APPEND_INT32(&key, "bucket_start", 1);
    bson_append_document_end(&idx, &key);
    BSON_APPEND_UTF8(&idx, "name", "sensor_id_1_bucket_start_1");
    if (unique) {
        BSON_APPEND_BOOL(&idx, "unique", true);
    }
    bson_append_document_end(&indexes, &idx);
    bson_append_array_end(&cmd, &indexes);
    mongoc_database_t *db = mongoc_client_get_database(m->client, m->database);
    bool ok = mongoc_database_write_command_with_opts(db, &cmd, NULL, &reply, berr);
    if (ok) {
        bd_info("indexes ready on %s.%s", m->database, coll);
    } else if (bd_ratelimit_ok(&m->index_log, bd_mono_ns())) {
        bd_error("cannot create indexes on %s.%s (will retry): %s", m->database, coll,
                 berr->message);
    }
    mongoc_database_destroy(db);
    bson_destroy(&reply);
    bson_destroy(&cmd);
    return ok;
}

/* The retention's TTL index of coll in place (retention.h), once per change of value. */
static void ensure_ttl(struct mongo_store *m, const char *coll, const char *key, struct ttl *t) {
    int64_t now = bd_mono_ns();
    if (t->ok || now < t->next_try_ns) {
        return;
    }
    bson_error_t berr;
    enum bd_retention_done done;
    int64_t old = 0;
    mongoc_database_t *db = mongoc_client_get_database(m->client, m->database);
    t->ok = bd_retention_sync(db, coll, t->seconds, &done, &old, &berr);
    mongoc_database_destroy(db);
    if (!t->ok) {
        t->next_try_ns = now + RETENTION_RETRY_NS;
        bd_error("%s: cannot set the TTL index %s on %s.%s (tried again in %d s): %s", key,
                 BD_RETENTION_INDEX, m->database, coll, (int)(RETENTION_RETRY_NS / BD_NS_PER_S),
                 berr.message);
    } else if (done == BD_RETENTION_CREATED) {
        bd_info("%s: documents of %s.%s are deleted by MongoDB %" PRIu64 " s after their "
                "bucket_end (TTL index %s created)",
                key, m->database, coll, t->seconds, BD_RETENTION_INDEX);
    } else if (done == BD_RETENTION_CHANGED) {
        bd_info("%s: documents of %s.%s are deleted by MongoDB %" PRIu64 " s after their "
                "bucket_end (TTL index %s changed from %" PRId64 " s by collMod)",
                key, m->database, coll, t->seconds, BD_RETENTION_INDEX, old);
    } else if (done == BD_RETENTION_DROPPED) {
        bd_info("%s: off; TTL index %s dropped from %s.%s, no document expires any more", key,
                BD_RETENTION_INDEX, m->database, coll);
    }
}

/* No server could be selected or reached: every other call would wait as long and fail too. */
static bool unreachable(const bson_error_t *e) {
    return e->domain == MONGOC_ERROR_SERVER_SELECTION || e->domain == MONGOC_ERROR_STREAM;
}

/*
 * The indexes and TTL indexes, each until it succeeds once. false (error set) when MongoDB
 * cannot be reached: the caller's write would only wait a server-selection timeout more to fail
 * the same way (a start while MongoDB is away must not spend several timeouts here before its
 * first failure, when the batches go to the spool). Any other failure is logged and retried at
 * the next prepare without holding the writes back.
 */
static bool ensure_indexes(struct mongo_store *m, bson_error_t *error) {
    if (!m->indexes_ok) {
        m->indexes_ok = create_index(m, m->collection, false, error);
        if (!m->indexes_ok && unreachable(error)) {
            return false;
        }
    }
    if (!m->summary_index_ok && m->summaries_on) {
        m->summary_index_ok = create_index(m, m->summary_coll, true, error);
        if (!m->summary_index_ok && unreachable(error)) {
            return false;
        }
    }
    ensure_ttl(m, m->collection, "buckets.retention", &m->pages_ttl);
    if (m->summaries_on) {
        ensure_ttl(m, m->summary_coll, "summaries.retention", &m->summary_ttl);
    }
    return true;
}

/* A new wanted value is tried at the next prepare, whatever failed before. */
static void set_ttl(struct ttl *t, uint64_t retention_ms) {
    uint64_t seconds = retention_ms / 1000;
    if (seconds != t->seconds || !t->ok) {
        *t = (struct ttl){.seconds = seconds};
    }
}

static bool m_prepare(struct bd_store *st, bson_error_t *error) {
    struct mongo_store *m = (struct mongo_store *)st;
    if (!ensure_client(m)) {
        bson_set_error(error, MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_TOO_BIG,
                       "no client available from the pool");
        return false;
    }
    return ensure_indexes(m, error);
}

static bool m_bulk_upsert(struct bd_store *st, const bson_t *const *selectors,
                          const bson_t *const *updates, uint32_t n, bson_t *reply,
                          bson_error_t *error) {
    struct mongo_store *m = (struct mongo_store *)st;
    bson_t opts, upsert_opts;
    bool ok = true;
    bson_init(&opts);
    BSON_APPEND_BOOL(&opts, "ordered", false);
    mongoc_write_concern_append(m->wc, &opts);
    mongoc_bulk_operation_t *bulk =
        mongoc_collection_create_bulk_operation_with_opts(m->coll, &opts);
    bson_destroy(&opts);
    bson_init(&upsert_opts);
    BSON_APPEND_BOOL(&upsert_opts, "upsert", true);
    for (uint32_t i = 0; i < n && ok; i++) {
        /* The driver checks each statement here; a refusal means nothing was sent. */
        ok = mongoc_bulk_operation_update_one_with_opts(bulk, selectors[i], updates[i],
                                                        &upsert_opts, error);
    }
    bson_destroy(&upsert_opts);
    if (ok) {
        ok = mongoc_bulk_operation_execute(bulk, reply, error) != 0;
    } else {
        bson_init(reply);
    }
    mongoc_bulk_operation_destroy(bulk);
    return ok;
}

/* This writer's sequence number in a bucket document ("w.<writer_id>"), 0 if it has none. */
static uint64_t doc_writer_seq(const struct mongo_store *m, const bson_t *doc) {
    bson_iter_t it, child;
    if (bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, m->writer_key, &child) &&
        BSON_ITER_HOLDS_NUMBER(&child)) {
        int64_t v = bson_iter_as_int64(&child);
        return v > 0 ? (uint64_t)v : 0;
    }
    return 0;
}

static bool m_find_pages(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                         bd_store_page_cb fn, void *arg, bson_error_t *error) {
    struct mongo_store *m = (struct mongo_store *)st;
    bson_t filter, opts, proj;
    const bson_t *doc;
    bd_queries_buckets_filter(keys, n, &filter);
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
    BSON_APPEND_INT32(&proj, "sensor_id", 1);
    BSON_APPEND_INT32(&proj, "bucket_start", 1);
    BSON_APPEND_INT32(&proj, "page", 1);
    BSON_APPEND_INT32(&proj, "count", 1);
    BSON_APPEND_INT32(&proj, m->writer_key, 1);
    bson_append_document_end(&opts, &proj);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(m->coll, &filter, &opts, NULL);
    bson_destroy(&opts);
    bson_destroy(&filter);
    while (mongoc_cursor_next(cur, &doc)) {
        bson_iter_t it;
        struct bd_page_info info = {.page = -1};
        if (!bson_iter_init(&it, doc)) {
            continue;
        }
        while (bson_iter_next(&it)) {
            const char *k = bson_iter_key(&it);
            if (strcmp(k, "sensor_id") == 0 && BSON_ITER_HOLDS_UTF8(&it)) {
                info.sensor_id = bson_iter_utf8(&it, NULL);
            } else if (strcmp(k, "bucket_start") == 0 && BSON_ITER_HOLDS_DATE_TIME(&it)) {
                info.start_ms = bson_iter_date_time(&it);
            } else if (strcmp(k, "page") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
                info.page = bson_iter_as_int64(&it);
            } else if (strcmp(k, "count") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
                info.count = bson_iter_as_int64(&it);
            }
        }
        info.writer_seq = doc_writer_seq(m, doc);
        if (info.sensor_id != NULL && info.page >= 0) {
            fn(arg, &info);
        }
    }
    bool ok = !mongoc_cursor_error(cur, error);
    mongoc_cursor_destroy(cur);
    return ok;
}

static bool m_refresh_summaries(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                                bson_error_t *error) {
    struct mongo_store *m = (struct mongo_store *)st;
    bson_t pipeline, opts;
    const bson_t *doc;
    /* $merge on sensor_id, bucket_start needs the unique index */
    if (!ensure_indexes(m, error)) {
        return false;
    }
    bd_queries_summaries_pipeline(keys, n, NULL, m->summary_coll, &pipeline);
    bson_init(&opts);
    mongoc_write_concern_append(m->wc, &opts);
    mongoc_cursor_t *cur =
        mongoc_collection_aggregate(m->coll, MONGOC_QUERY_NONE, &pipeline, &opts, NULL);
    while (mongoc_cursor_next(cur, &doc)) {
        /* $merge returns no documents */
    }
    bool ok = !mongoc_cursor_error(cur, error);
    mongoc_cursor_destroy(cur);
    bson_destroy(&opts);
    bson_destroy(&pipeline);
    return ok;
}

/*
 * One query sorted on w.<writer_id>: a collection scan on a large collection, which is why the
 * number is normally kept on disk (writer.h).
 */
static bool m_max_writer_seq(struct bd_store *st, uint64_t *seq, bson_error_t *error) {
    struct mongo_store *m = (struct mongo_store *)st;
    bson_t filter, cond, opts, sort, proj;
    const bson_t *doc;
    uint64_t seen = 0;
    bson_init(&filter);
    BSON_APPEND_DOCUMENT_BEGIN(&filter, m->writer_key, &cond);
    BSON_APPEND_BOOL(&cond, "$exists", true);
    bson_append_document_end(&filter, &cond);
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, m->writer_key, -1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT64(&opts, "limit", 1);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
    BSON_APPEND_INT32(&proj, m->writer_key, 1);
    bson_append_document_end(&opts, &proj);
    mongoc_cursor_t *cur = mongoc_collection_find_with_opts(m->coll, &filter, &opts, NULL);
    while (mongoc_cursor_next(cur, &doc)) {
        seen = BD_MAX(seen, doc_writer_seq(m, doc));
    }
    bool ok = !mongoc_cursor_error(cur, error);
    mongoc_cursor_destroy(cur);
    bson_destroy(&opts);
    bson_destroy(&filter);
    *seq = seen;
    return ok;
}

/* Between store calls (the flusher, adopting a reload): nothing of this is in use. */
static void m_reconfigure(struct bd_store *st, const struct bd_config *cfg) {
    struct mongo_store *m = (struct mongo_store *)st;
    struct bd_err err = {0};
    mongoc_write_concern_t *wc = NULL;
    if (bd_mongo_write_concern_new(cfg->mongodb.write_concern, cfg->mongodb.wtimeout_ms, &wc,
                                   &err) < 0) {
        bd_error("%s; keeping the running write concern", err.msg); /* validated at load */
    } else {
        mongoc_write_concern_destroy(m->wc);
        m->wc = wc;
    }
    if (cfg->summaries.interval_ms > 0 && !m->summaries_on) {
        m->summary_index_ok = false;
    }
    m->summaries_on = cfg->summaries.interval_ms > 0;
    set_ttl(&m->pages_ttl, cfg->buckets.retention_ms);
    set_ttl(&m->summary_ttl, cfg->summaries.retention_ms);
}

static void m_release(struct bd_store *st) {
    struct mongo_store *m = (struct mongo_store *)st;
    if (m->client != NULL) {
        mongoc_collection_destroy(m->coll);
        mongoc_client_pool_push(m->pool, m->client);
        m->coll = NULL;
        m->client = NULL;
    }
}

static void m_destroy(struct bd_store *st) {
    struct mongo_store *m = (struct mongo_store *)st;
    m_release(st);
    if (m->pool != NULL) {
        mongoc_client_pool_destroy(m->pool);
    }
    mongoc_write_concern_destroy(m->wc);
    mongoc_uri_destroy(m->uri);
    free(m);
}

static const struct bd_store_ops mongo_ops = {
    .prepare = m_prepare,
    .bulk_upsert = m_bulk_upsert,
    .find_pages = m_find_pages,
    .refresh_summaries = m_refresh_summaries,
    .max_writer_seq = m_max_writer_seq,
    .reconfigure = m_reconfigure,
    .release = m_release,
    .destroy = m_destroy,
};

int bd_store_mongo_new(struct bd_store **out, const struct bd_config *cfg, const char *writer_key,
                       struct bd_err *err) {
    int rc = 0;
    bson_error_t berr;
    struct mongo_store *m = bd_calloc(1, sizeof(*m));
    if (m == NULL) {
        return bd_err_set(err, -ENOMEM, "store: out of memory");
    }
    m->base.ops = &mongo_ops;
    snprintf(m->database, sizeof(m->database), "%s", cfg->mongodb.database);
    snprintf(m->collection, sizeof(m->collection), "%s", cfg->mongodb.collection);
    m->summaries_on = cfg->summaries.interval_ms > 0;
    set_ttl(&m->pages_ttl, cfg->buckets.retention_ms);
    set_ttl(&m->summary_ttl, cfg->summaries.retention_ms);
    snprintf(m->writer_key, sizeof(m->writer_key), "%s", writer_key);
    bd_config_summary_collection(cfg, m->summary_coll, sizeof(m->summary_coll));
    m->index_log.interval_ns = 10 * BD_NS_PER_S;
    m->index_log.burst = 1;
    m->uri = bd_mongo_uri_new(cfg->mongodb.uri, err);
    if (m->uri == NULL) {
        rc = -EINVAL;
        goto out;
    }
    rc = bd_mongo_write_concern_new(cfg->mongodb.write_concern, cfg->mongodb.wtimeout_ms, &m->wc,
                                    err);
    if (rc < 0) {
        goto out;
    }
    m->pool = mongoc_client_pool_new_with_error(m->uri, &berr);
    if (m->pool == NULL) {
        rc = bd_err_set(err, -EINVAL, "mongodb.uri: %s", berr.message);
        goto out;
    }
    mongoc_client_pool_set_error_api(m->pool, MONGOC_ERROR_API_VERSION_2);
    mongoc_client_pool_set_appname(m->pool, "bucketd");
    *out = &m->base;
    m = NULL;
out:
    if (m != NULL) {
        m_destroy(&m->base);
    }
    return rc;
}

void bd_store_free(struct bd_store *st) {
    if (st != NULL) {
        st->ops->destroy(st);
    }
}
