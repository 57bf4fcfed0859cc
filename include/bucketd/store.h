/*
 * Where the flusher's updates go, behind a small interface: one unordered bulk of upserts, the
 * page look-up of buckets, and the recovery of this writer's sequence. bd_store_mongo_new is the
 * real one (mongo-c-driver, a client popped from a pool once and used by one thread); unit tests
 * put a scripted store behind the same interface, so the flusher's decisions run without a
 * server.
 *
 * Threads: a store is used by one thread at a time (the flusher).
 */
#ifndef BUCKETD_STORE_H
#define BUCKETD_STORE_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
/* struct bd_page_key, a bucket for the page look-up, and the queries the store runs. */
#include "bucketd/queries.h"

/* One stored page of a bucket. */
struct bd_page_info {
    const char *sensor_id;
    int64_t start_ms;
    int64_t page;
    int64_t count;
    uint64_t writer_seq; /* this writer's w entry, 0 if none */
};

typedef void (*bd_store_page_cb)(void *arg, const struct bd_page_info *info);

struct bd_store;

struct bd_store_ops {
    /* Connect (and create the indexes, once). false and error filled if not possible now. */
    bool (*prepare)(struct bd_store *st, bson_error_t *error);
    /* One unordered bulk of n upserts with the configured write concern. reply is initialised in
     * every case and destroyed by the caller. Returns what mongoc_bulk_operation_execute does. */
    bool (*bulk_upsert)(struct bd_store *st, const bson_t *const *selectors,
                        const bson_t *const *updates, uint32_t n, bson_t *reply,
                        bson_error_t *error);
    /* Every stored page of these n buckets: fn once per page document. */
    bool (*find_pages)(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                       bd_store_page_cb fn, void *arg, bson_error_t *error);
    /* Recompute the summary documents of these n buckets (summaries.h): one aggregate on the
     * page collection (queries.h), ending in $merge into the summary collection, with the
     * configured write concern. NULL in a store without summaries. */
    bool (*refresh_summaries)(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                              bson_error_t *error);
    /* The highest number this writer left in the collection (0: none). */
    bool (*max_writer_seq)(struct bd_store *st, uint64_t *seq, bson_error_t *error);
    /* A reload: take cfg's write concern, summaries.interval and retention (the keys that need
     * a restart are unchanged). Called between store calls. NULL in a store with no settings. */
    void (*reconfigure)(struct bd_store *st, const struct bd_config *cfg);
    /* The using thread ends: give back what belongs to it (the pooled client). */
    void (*release)(struct bd_store *st);
    void (*destroy)(struct bd_store *st);
};

struct bd_store {
    const struct bd_store_ops *ops;
};

/*
 * The MongoDB store of cfg->mongodb, for writer key "w.<writer_id>". Parses the URI and write
 * concern and creates the client pool; connects only when first used.
 */
int bd_store_mongo_new(struct bd_store **out, const struct bd_config *cfg, const char *writer_key,
                       struct bd_err *err);

/* NULL is a no-op. */
void bd_store_free(struct bd_store *st);

#endif
