/*
 * The TTL index of buckets.retention and summaries.retention (include/bucketd/retention.h): one
 * listIndexes, then at most one createIndexes, collMod or dropIndexes. Runs where the store runs
 * (the flusher's I/O thread), before writes, whenever the wanted value is not known to be in
 * place (start, a reload that changed it, a failed attempt).
 */
#include "bucketd/retention.h"

#include <string.h>

#include "bucketd/common.h"

struct found {
    bool ours;            /* an index named BD_RETENTION_INDEX on {bucket_end: 1} */
    bool ours_elsewhere;  /* an index of that name on another key (not made by bucketd) */
    bool ours_ttl;        /* ... with expireAfterSeconds */
    int64_t ours_seconds; /* ... that many */
    char other[128];      /* another index on {bucket_end: 1}: its name ("" none) */
};

/* {bucket_end: 1} (or -1: a TTL index works either way), and nothing else. */
static bool key_is_bucket_end(const bson_t *key) {
    bson_iter_t it;
    if (!bson_iter_init(&it, key) || !bson_iter_next(&it) ||
        strcmp(bson_iter_key(&it), "bucket_end") != 0 || !BSON_ITER_HOLDS_NUMBER(&it)) {
        return false;
    }
    return !bson_iter_next(&it);
}

static void inspect_index(const bson_t *idx, struct found *f) {
    bson_iter_t it;
    const char *name = "";
    bool ttl = false, on_bucket_end = false;
    int64_t seconds = 0;
    if (!bson_iter_init(&it, idx)) {
        return;
    }
    while (bson_iter_next(&it)) {
        const char *k = bson_iter_key(&it);
        if (strcmp(k, "name") == 0 && BSON_ITER_HOLDS_UTF8(&it)) {
            name = bson_iter_utf8(&it, NULL);
        } else if (strcmp(k, "expireAfterSeconds") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
            ttl = true;
            seconds = bson_iter_as_int64(&it);
        } else if (strcmp(k, "key") == 0 && BSON_ITER_HOLDS_DOCUMENT(&it)) {
            const uint8_t *data = NULL;
            uint32_t len = 0;
            bson_t key;
            bson_iter_document(&it, &len, &data);
            on_bucket_end = bson_init_static(&key, data, len) && key_is_bucket_end(&key);
        }
    }
    if (strcmp(name, BD_RETENTION_INDEX) == 0 && !on_bucket_end) {
        f->ours_elsewhere = true;
    } else if (strcmp(name, BD_RETENTION_INDEX) == 0) {
        f->ours = true;
        f->ours_ttl = ttl;
        f->ours_seconds = seconds;
    } else if (on_bucket_end) {
        snprintf(f->other, sizeof(f->other), "%s", name);
    }
}

static bool list_indexes(mongoc_database_t *db, const char *coll, struct found *f,
                         bson_error_t *error) {
    const bson_t *doc;
    mongoc_collection_t *c = mongoc_database_get_collection(db, coll);
    /* A collection that does not exist yet has no index: the driver answers an empty cursor. */
    mongoc_cursor_t *cur = mongoc_collection_find_indexes_with_opts(c, NULL);
    while (mongoc_cursor_next(cur, &doc)) {
        inspect_index(doc, f);
    }
    bool ok = !mongoc_cursor_error(cur, error);
    mongoc_cursor_destroy(cur);
    mongoc_collection_destroy(c);
    return ok;
}

static bool run(mongoc_database_t *db, bson_t *cmd, bson_error_t *error) {
    bson_t reply;
    bool ok = mongoc_database_write_command_with_opts(db, cmd, NULL, &reply, error);
    bson_destroy(&reply);
    bson_destroy(cmd);
    return ok;
}

bool bd_retention_sync(mongoc_database_t *db, const char *coll, uint64_t seconds,
                       enum bd_retention_done *done, int64_t *old_seconds, bson_error_t *error) {
    struct found f = {0};
    bson_t cmd, child, key, indexes;
    *done = BD_RETENTION_UNCHANGED;
    if (!list_indexes(db, coll, &f, error)) {
        return false;
    }
    bson_init(&cmd);
    if (seconds == 0) {
        if (!f.ours) {
            bson_destroy(&cmd);
            return true;
        }
        BSON_APPEND_UTF8(&cmd, "dropIndexes", coll);
        BSON_APPEND_UTF8(&cmd, "index", BD_RETENTION_INDEX);
        *done = BD_RETENTION_DROPPED;
        return run(db, &cmd, error);
    }
    if (f.ours_elsewhere) {
        bson_destroy(&cmd);
        bson_set_error(error, MONGOC_ERROR_COMMAND, 0,
                       "an index named %s exists on another key than {bucket_end: 1}; bucketd "
                       "keeps its retention under that name: rename or drop that index",
                       BD_RETENTION_INDEX);
        return false;
    }
    /* The schema (config_schema.c) bounds the value far below INT32_MAX, above which MongoDB
     * refuses a TTL. */
    int32_t want = (int32_t)seconds;
    if (f.ours) {
        if (f.ours_ttl && f.ours_seconds == want) {
            bson_destroy(&cmd);
            return true;
        }
        /* In place: no index build, and the collection never goes without the index. */
        BSON_APPEND_UTF8(&cmd, "collMod", coll);
        BSON_APPEND_DOCUMENT_BEGIN(&cmd, "index", &child);
        BSON_APPEND_UTF8(&child, "name", BD_RETENTION_INDEX);
        BSON_APPEND_INT32(&child, "expireAfterSeconds", want);
        bson_append_document_end(&cmd, &child);
        *done = BD_RETENTION_CHANGED;
        *old_seconds = f.ours_ttl ? f.ours_seconds : -1;
        return run(db, &cmd, error);
    }
    if (f.other[0] != '\0') {
        bson_destroy(&cmd);
        bson_set_error(error, MONGOC_ERROR_COMMAND, 0,
                       "index %s already covers {bucket_end: 1}, and MongoDB keeps one index per "
                       "key: drop it to let bucketd keep the retention in its own index %s, or "
                       "set the retention to 0 and manage expiry yourself",
                       f.other, BD_RETENTION_INDEX);
        return false;
    }
    BSON_APPEND_UTF8(&cmd, "createIndexes", coll);
    BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &indexes);
    BSON_APPEND_DOCUMENT_BEGIN(&indexes, "0", &child);
    BSON_APPEND_DOCUMENT_BEGIN(&child, "key", &key);
    BSON_APPEND_INT32(&key, "bucket_end", 1);
    bson_append_document_end(&child, &key);
    BSON_APPEND_UTF8(&child, "name", BD_RETENTION_INDEX);
    BSON_APPEND_INT32(&child, "expireAfterSeconds", want);
    bson_append_document_end(&indexes, &child);
    bson_append_array_end(&cmd, &indexes);
    *done = BD_RETENTION_CREATED;
    return run(db, &cmd, error);
}
