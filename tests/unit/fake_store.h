/*
 * A scripted store for the flusher's unit tests (include/bucketd/store.h): an in-memory model of
 * the bucket collection that applies the flusher's upserts the way MongoDB does for what the
 * flusher relies on (the w.<writer_id> filter, upsert, duplicate key on a racing insert, a
 * document size limit), plus faults scripted per bulk call. Header-only: included by the test
 * files that need it.
 */
#ifndef BUCKETD_TEST_FAKE_STORE_H
#define BUCKETD_TEST_FAKE_STORE_H

#include <mongoc/mongoc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/bucket.h"
#include "bucketd/store.h"

enum fake_fault {
    FAULT_NONE,
    FAULT_UNREACHABLE,  /* server selection fails: nothing sent */
    FAULT_LOST_REPLY,   /* everything applied, then the connection fails before the reply */
    FAULT_CMD_ERROR,    /* the server refuses the whole command (code), nothing applied */
    FAULT_RETRYABLE,    /* like FAULT_CMD_ERROR, labelled RetryableWriteError */
    FAULT_WC_ERROR,     /* applied, then a writeConcernError (code, 64 if 0) */
    FAULT_CLIENT_LARGE, /* the driver refuses the bulk client-side: nothing sent */
    FAULT_LOST_REQUEST, /* the connection fails before the server executed anything */
    /* The driver split the bulk: the first half ran as one command (applied, counted in the
     * reply), then it refused a document of the next client-side. */
    FAULT_CLIENT_PARTIAL,
    /* The driver split the bulk: the first half ran as one command (applied, its counts and
     * writeErrors in the reply), then the next command failed whole with nothing of it applied:
     * the server refused it (code), or with code 0 the connection failed sending it. As mongoc
     * reports such a bulk, the error is then the first writeErrors entry if there is one (the
     * second command's failure is nowhere in the answer), else that failure. */
    FAULT_SPLIT_FAILED,
};

struct fake_doc {
    char *id;
    char *sensor_id;
    int64_t start_ms;
    int64_t page;
    int64_t count;
    uint64_t bytes;   /* sum of the sizes of the updates applied: the model of the document size */
    uint64_t wseq;    /* this writer's entry */
    uint64_t other;   /* another writer's entry (a racing insert) */
    uint32_t updates; /* updates applied */
    uint64_t rewritten; /* readings written by the storage engine: the count after each update */
};

/* A summary document: the totals of a bucket's pages at its last refresh. */
struct fake_summary {
    char *sensor_id;
    int64_t start_ms;
    int64_t count; /* the pages' counts summed */
    uint32_t pages;
    uint32_t refreshes; /* times it was recomputed */
};

struct fake_store {
    struct bd_store base;
    char writer_key[160];
    struct fake_doc *docs;
    uint32_t n_docs, cap_docs;

    enum fake_fault faults[64]; /* consumed one per bulk call */
    int32_t fault_codes[64];
    uint32_t n_faults, next_fault;
    bool find_fails;         /* page look-ups and sequence recovery fail */
    uint32_t races;          /* the next N inserting upserts lose a race to another writer */
    uint64_t race_wseq;      /* the racing insert's w.<writer_id> (0: another writer id) */
    uint64_t max_doc_bytes;  /* 0: no limit; else 17419/17420 past it */
    const char *poison;      /* sensor id refused with 121 */
    const char *dup_always;  /* sensor id always answered 11000, nothing stored */
    const char *too_large;   /* sensor id always answered 17419/17420 */
    uint32_t client_max_ops; /* > 0: bulks larger than this are refused client-side */
    int32_t refuse_all;      /* nonzero: every update is refused with this code, nothing applied */
    bool sharded;            /* like mongos: an upsert whose filter lacks the shard key is 61 */

    uint32_t bulks;     /* bulk_upsert calls */
    uint32_t sent;      /* updates that reached the model */
    uint64_t seqs[256]; /* the sequence number of each bulk call (first 256) */
    uint32_t bulk_sizes[256];
    uint64_t max_update_bytes;
    uint32_t empty_updates; /* updates that carried no reading (the flusher must send none) */

    /* A bulk in flight, held: with hold set, bulk_upsert (on the flusher's I/O thread) says
     * it is holding and waits for release before it does anything. Guarded by mu. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool hold, holding;
    uint32_t delay_us; /* each bulk takes this long first (a slow server) */

    /* Summary refreshes (summaries.h): recomputed from the model's pages, like the aggregate. */
    struct fake_summary *sums;
    uint32_t n_sums, cap_sums;
    uint32_t refresh_calls, refresh_max_keys;
    bool refresh_fails;        /* answered like an unreachable server, nothing changed */
    uint32_t refresh_delay_us; /* each refresh takes this long first (a slow aggregate) */

    /* The settings the last reconfigure (a reload) handed over. */
    uint32_t reconfigures;
    char write_concern[64];
    uint64_t retention_ms, summaries_retention_ms;
};

/* Test thread: wait until a bulk is held (false after timeout_s). */
static bool fake_wait_holding(struct fake_store *fs, int timeout_s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_s;
    pthread_mutex_lock(&fs->mu);
    while (!fs->holding && pthread_cond_timedwait(&fs->cv, &fs->mu, &ts) == 0) {
    }
    bool held = fs->holding;
    pthread_mutex_unlock(&fs->mu);
    return held;
}

/* Test thread: let the held bulk (and every later one) go. */
static void fake_release_hold(struct fake_store *fs) {
    pthread_mutex_lock(&fs->mu);
    fs->hold = false;
    pthread_cond_broadcast(&fs->cv);
    pthread_mutex_unlock(&fs->mu);
}

static struct fake_doc *fake_find(struct fake_store *fs, const char *id) {
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        if (strcmp(fs->docs[i].id, id) == 0) {
            return &fs->docs[i];
        }
    }
    return NULL;
}

static struct fake_doc *fake_insert(struct fake_store *fs, const char *id) {
    if (fs->n_docs == fs->cap_docs) {
        fs->cap_docs = fs->cap_docs ? fs->cap_docs * 2 : 64;
        fs->docs = realloc(fs->docs, fs->cap_docs * sizeof(*fs->docs));
    }
    struct fake_doc *d = &fs->docs[fs->n_docs++];
    memset(d, 0, sizeof(*d));
    d->id = strdup(id);
    return d;
}

/* What the flusher's update says: seq from the filter, readings and keys from stage 1. */
struct fake_update {
    const char *id;
    uint64_t seq;
    int64_t n;
    const char *sensor_id;
    int64_t start_ms;
    int64_t page;
    bool has_shard_key; /* the filter holds sensor_id and bucket_start as stage 1 stores them */
};

static void fake_parse(const bson_t *sel, const bson_t *upd, const char *writer_key,
                       struct fake_update *u) {
    bson_iter_t it, child;
    memset(u, 0, sizeof(*u));
    if (bson_iter_init_find(&it, sel, "_id")) {
        u->id = bson_iter_utf8(&it, NULL);
    }
    /* The key "w.<writer_id>" holds a dot: found as one key, then descended. */
    if (bson_iter_init_find(&it, sel, writer_key) && bson_iter_recurse(&it, &child) &&
        bson_iter_find_descendant(&child, "$not.$gte", &it)) {
        u->seq = (uint64_t)bson_iter_as_int64(&it);
    }
    bson_iter_init(&it, upd);
    if (bson_iter_find_descendant(&it, "0.$set._n.$literal", &child)) {
        bson_iter_t arr;
        bson_iter_recurse(&child, &arr);
        while (bson_iter_next(&arr)) {
            u->n++;
        }
    }
    bson_iter_init(&it, upd);
    if (bson_iter_find_descendant(&it, "0.$set.sensor_id.$literal", &child)) {
        u->sensor_id = bson_iter_utf8(&child, NULL);
    }
    bson_iter_init(&it, upd);
    if (bson_iter_find_descendant(&it, "0.$set.bucket_start", &child)) {
        u->start_ms = bson_iter_date_time(&child);
    }
    bson_iter_init(&it, upd);
    if (bson_iter_find_descendant(&it, "0.$set.page", &child)) {
        u->page = bson_iter_as_int64(&child);
    }
    /* Equalities of the same BSON type and value as the document's fields (a string and a
     * date): what mongos extracts a shard key {sensor_id[, bucket_start]} from. */
    bson_iter_t sid, start;
    u->has_shard_key =
        u->sensor_id != NULL && bson_iter_init_find(&sid, sel, "sensor_id") &&
        BSON_ITER_HOLDS_UTF8(&sid) && strcmp(bson_iter_utf8(&sid, NULL), u->sensor_id) == 0 &&
        bson_iter_init_find(&start, sel, "bucket_start") && BSON_ITER_HOLDS_DATE_TIME(&start) &&
        bson_iter_date_time(&start) == u->start_ms;
}

static void fake_write_error(bson_t *errs, uint32_t *n_errs, uint32_t index, int32_t code,
                             const char *msg) {
    char key[16];
    bson_t e;
    snprintf(key, sizeof(key), "%u", *n_errs);
    bson_append_document_begin(errs, key, -1, &e);
    BSON_APPEND_INT32(&e, "index", (int32_t)index);
    BSON_APPEND_INT32(&e, "code", code);
    BSON_APPEND_UTF8(&e, "errmsg", msg);
    bson_append_document_end(errs, &e);
    (*n_errs)++;
}

static bool fake_prepare(struct bd_store *st, bson_error_t *error) {
    (void)st;
    (void)error;
    return true;
}

static bool fake_bulk(struct bd_store *st, const bson_t *const *sels, const bson_t *const *upds,
                      uint32_t n, bson_t *reply, bson_error_t *error) {
    struct fake_store *fs = (struct fake_store *)st;
    enum fake_fault fault = FAULT_NONE;
    int32_t code = 0;
    pthread_mutex_lock(&fs->mu);
    if (fs->hold) {
        fs->holding = true;
        pthread_cond_broadcast(&fs->cv);
        while (fs->hold) {
            pthread_cond_wait(&fs->cv, &fs->mu);
        }
        fs->holding = false;
    }
    pthread_mutex_unlock(&fs->mu);
    if (fs->delay_us > 0) {
        struct timespec ts = {fs->delay_us / 1000000, (long)(fs->delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    if (fs->next_fault < fs->n_faults) {
        code = fs->fault_codes[fs->next_fault];
        fault = fs->faults[fs->next_fault++];
    }
    if (fs->bulks < 256) {
        struct fake_update u;
        fake_parse(sels[0], upds[0], fs->writer_key, &u);
        fs->seqs[fs->bulks] = u.seq;
        fs->bulk_sizes[fs->bulks] = n;
    }
    fs->bulks++;
    bson_init(reply);
    if (fault == FAULT_UNREACHABLE) {
        bson_set_error(error, MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE,
                       "No suitable servers found");
        return false;
    }
    if (fault == FAULT_CLIENT_LARGE || (fs->client_max_ops > 0 && n > fs->client_max_ops)) {
        bson_set_error(error, MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID,
                       "Document 0 is too large for the cluster");
        return false;
    }
    if (fault == FAULT_LOST_REQUEST) {
        bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
                       "Failed to send the request: connection reset");
        return false;
    }
    if (fault == FAULT_CMD_ERROR || fault == FAULT_RETRYABLE) {
        BSON_APPEND_INT32(reply, "nMatched", 0);
        if (fault == FAULT_RETRYABLE) {
            bson_t labels;
            BSON_APPEND_ARRAY_BEGIN(reply, "errorLabels", &labels);
            BSON_APPEND_UTF8(&labels, "0", "RetryableWriteError");
            bson_append_array_end(reply, &labels);
        }
        bson_set_error(error, MONGOC_ERROR_SERVER, (uint32_t)code, "command refused (%d)", code);
        return false;
    }
    bson_t errs;
    uint32_t n_errs = 0;
    int64_t matched = 0, upserted = 0;
    bson_init(&errs);
    const uint32_t n_run = fault == FAULT_CLIENT_PARTIAL || fault == FAULT_SPLIT_FAILED ? n / 2 : n;
    for (uint32_t i = 0; i < n_run; i++) {
        struct fake_update u;
        fake_parse(sels[i], upds[i], fs->writer_key, &u);
        uint64_t size = (uint64_t)sels[i]->len + upds[i]->len;
        fs->max_update_bytes = size > fs->max_update_bytes ? size : fs->max_update_bytes;
        fs->sent++;
        fs->empty_updates += u.n == 0;
        if (fs->sharded && !u.has_shard_key) {
            fake_write_error(&errs, &n_errs, i, 61,
                             "Failed to target upsert by query :: could not extract exact shard "
                             "key");
            continue;
        }
        if (fs->refuse_all != 0) {
            fake_write_error(&errs, &n_errs, i, fs->refuse_all, "refused by the deployment");
            continue;
        }
        if (fs->poison != NULL && u.sensor_id != NULL && strcmp(u.sensor_id, fs->poison) == 0) {
            fake_write_error(&errs, &n_errs, i, 121, "Document failed validation");
            continue;
        }
        if (fs->dup_always != NULL && u.sensor_id != NULL &&
            strcmp(u.sensor_id, fs->dup_always) == 0) {
            fake_write_error(&errs, &n_errs, i, 11000, "E11000 duplicate key error");
            continue;
        }
        if (fs->too_large != NULL && u.sensor_id != NULL &&
            strcmp(u.sensor_id, fs->too_large) == 0) {
            fake_write_error(&errs, &n_errs, i, 17420, "Document to upsert is too large");
            continue;
        }
        struct fake_doc *d = fake_find(fs, u.id);
        if (d == NULL && fs->races > 0) {
            /* Another writer inserts the page between our match and our insert. */
            fs->races--;
            d = fake_insert(fs, u.id);
            d->sensor_id = strdup(u.sensor_id);
            d->start_ms = u.start_ms;
            d->page = u.page;
            d->other = 1;
            d->wseq = fs->race_wseq;
            fake_write_error(&errs, &n_errs, i, 11000, "E11000 duplicate key error");
            continue;
        }
        if (d != NULL && d->wseq >= u.seq) {
            /* The filter matches nothing; the upsert's insert hits the existing _id. */
            fake_write_error(&errs, &n_errs, i, 11000, "E11000 duplicate key error");
            continue;
        }
        if (fs->max_doc_bytes > 0 && (d == NULL ? 0 : d->bytes) + size > fs->max_doc_bytes) {
            fake_write_error(&errs, &n_errs, i, d == NULL ? 17420 : 17419,
                             "Resulting document after update is larger than the limit");
            continue;
        }
        if (d == NULL) {
            d = fake_insert(fs, u.id);
            d->sensor_id = strdup(u.sensor_id);
            d->start_ms = u.start_ms;
            d->page = u.page;
            upserted++;
        } else {
            matched++;
        }
        d->count += u.n;
        d->bytes += size;
        d->updates++;
        d->rewritten += (uint64_t)d->count; /* the storage engine writes the whole document */
        d->wseq = u.seq;
    }
    BSON_APPEND_INT64(reply, "nMatched", matched);
    BSON_APPEND_INT64(reply, "nModified", matched);
    BSON_APPEND_INT64(reply, "nUpserted", upserted);
    int32_t first_code = 0;
    bson_iter_t first;
    if (n_errs > 0) {
        BSON_APPEND_ARRAY(reply, "writeErrors", &errs);
        if (bson_iter_init(&first, &errs) && bson_iter_find_descendant(&first, "0.code", &first)) {
            first_code = bson_iter_int32(&first);
        }
    }
    bson_destroy(&errs);
    if (fault == FAULT_SPLIT_FAILED) {
        if (first_code != 0) {
            bson_set_error(error, MONGOC_ERROR_SERVER, (uint32_t)first_code,
                           "the first write error (%d)", first_code);
        } else if (code != 0) {
            bson_set_error(error, MONGOC_ERROR_SERVER, (uint32_t)code, "command refused (%d)",
                           code);
        } else {
            bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
                           "Failed to send the request: connection reset");
        }
        return false;
    }
    if (fault == FAULT_CLIENT_PARTIAL) {
        bson_set_error(error, MONGOC_ERROR_BSON, MONGOC_ERROR_BSON_INVALID,
                       "Document %u is too large for the cluster", n_run);
        return false;
    }
    if (fault == FAULT_LOST_REPLY) {
        bson_reinit(reply);
        bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
                       "Failed to read 4 bytes: socket error or timeout");
        return false;
    }
    if (fault == FAULT_WC_ERROR) {
        bson_t wces, wce;
        BSON_APPEND_ARRAY_BEGIN(reply, "writeConcernErrors", &wces);
        BSON_APPEND_DOCUMENT_BEGIN(&wces, "0", &wce);
        const int32_t wc_code = code != 0 ? code : 64;
        const char *wc_msg =
            wc_code == 100 ? "Not enough data-bearing nodes" : "waiting for replication timed out";
        BSON_APPEND_INT32(&wce, "code", wc_code);
        BSON_APPEND_UTF8(&wce, "errmsg", wc_msg);
        bson_append_document_end(&wces, &wce);
        bson_append_array_end(reply, &wces);
        bson_set_error(error, MONGOC_ERROR_WRITE_CONCERN, (uint32_t)wc_code, "%s", wc_msg);
        return false;
    }
    if (n_errs > 0) {
        bson_set_error(error, MONGOC_ERROR_SERVER, 11000, "write errors");
        return false;
    }
    return true;
}

static bool fake_find_pages(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                            bd_store_page_cb fn, void *arg, bson_error_t *error) {
    struct fake_store *fs = (struct fake_store *)st;
    if (fs->find_fails) {
        bson_set_error(error, MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE,
                       "No suitable servers found");
        return false;
    }
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        const struct fake_doc *d = &fs->docs[i];
        for (uint32_t k = 0; k < n; k++) {
            if (d->start_ms == keys[k].start_ms && strcmp(d->sensor_id, keys[k].sensor_id) == 0) {
                struct bd_page_info info = {.sensor_id = d->sensor_id,
                                            .start_ms = d->start_ms,
                                            .page = d->page,
                                            .count = d->count,
                                            .writer_seq = d->wseq};
                fn(arg, &info);
                break;
            }
        }
    }
    return true;
}

static bool fake_max_seq(struct bd_store *st, uint64_t *seq, bson_error_t *error) {
    struct fake_store *fs = (struct fake_store *)st;
    if (fs->find_fails) {
        bson_set_error(error, MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE,
                       "No suitable servers found");
        return false;
    }
    *seq = 0;
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        *seq = fs->docs[i].wseq > *seq ? fs->docs[i].wseq : *seq;
    }
    return true;
}

static struct fake_summary *fake_summary_of(struct fake_store *fs, const char *sensor_id,
                                            int64_t start_ms) {
    for (uint32_t i = 0; i < fs->n_sums; i++) {
        if (fs->sums[i].start_ms == start_ms && strcmp(fs->sums[i].sensor_id, sensor_id) == 0) {
            return &fs->sums[i];
        }
    }
    return NULL;
}

static bool fake_refresh(struct bd_store *st, const struct bd_page_key *keys, uint32_t n,
                         bson_error_t *error) {
    struct fake_store *fs = (struct fake_store *)st;
    if (fs->refresh_delay_us > 0) {
        struct timespec ts = {fs->refresh_delay_us / 1000000,
                              (fs->refresh_delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    fs->refresh_calls++;
    fs->refresh_max_keys = n > fs->refresh_max_keys ? n : fs->refresh_max_keys;
    if (fs->refresh_fails) {
        bson_set_error(error, MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE,
                       "No suitable servers found");
        return false;
    }
    for (uint32_t k = 0; k < n; k++) {
        int64_t count = 0;
        uint32_t pages = 0;
        for (uint32_t i = 0; i < fs->n_docs; i++) {
            const struct fake_doc *d = &fs->docs[i];
            if (d->start_ms == keys[k].start_ms && strcmp(d->sensor_id, keys[k].sensor_id) == 0) {
                count += d->count;
                pages++;
            }
        }
        if (pages == 0) {
            continue; /* the aggregate's $match finds nothing: no document */
        }
        struct fake_summary *sm = fake_summary_of(fs, keys[k].sensor_id, keys[k].start_ms);
        if (sm == NULL) {
            if (fs->n_sums == fs->cap_sums) {
                fs->cap_sums = fs->cap_sums ? fs->cap_sums * 2 : 16;
                fs->sums = realloc(fs->sums, fs->cap_sums * sizeof(*fs->sums));
            }
            sm = &fs->sums[fs->n_sums++];
            memset(sm, 0, sizeof(*sm));
            sm->sensor_id = strdup(keys[k].sensor_id);
            sm->start_ms = keys[k].start_ms;
        }
        sm->count = count;
        sm->pages = pages;
        sm->refreshes++;
    }
    return true;
}

static void fake_reconfigure(struct bd_store *st, const struct bd_config *cfg) {
    struct fake_store *fs = (struct fake_store *)st;
    fs->reconfigures++;
    snprintf(fs->write_concern, sizeof(fs->write_concern), "%s", cfg->mongodb.write_concern);
    fs->retention_ms = cfg->buckets.retention_ms;
    fs->summaries_retention_ms = cfg->summaries.retention_ms;
}

static void fake_release(struct bd_store *st) {
    (void)st;
}

/* The flusher owns the store it is given and destroys it: the test keeps the model alive. */
static void fake_destroy(struct bd_store *st) {
    (void)st;
}

static const struct bd_store_ops fake_ops = {
    .prepare = fake_prepare,
    .bulk_upsert = fake_bulk,
    .find_pages = fake_find_pages,
    .refresh_summaries = fake_refresh,
    .max_writer_seq = fake_max_seq,
    .reconfigure = fake_reconfigure,
    .release = fake_release,
    .destroy = fake_destroy,
};

static void fake_init(struct fake_store *fs, const char *writer_id) {
    memset(fs, 0, sizeof(*fs));
    fs->base.ops = &fake_ops;
    pthread_mutex_init(&fs->mu, NULL);
    pthread_cond_init(&fs->cv, NULL);
    snprintf(fs->writer_key, sizeof(fs->writer_key), "w.%s", writer_id);
}

static void fake_free(struct fake_store *fs) {
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        free(fs->docs[i].id);
        free(fs->docs[i].sensor_id);
    }
    free(fs->docs);
    for (uint32_t i = 0; i < fs->n_sums; i++) {
        free(fs->sums[i].sensor_id);
    }
    free(fs->sums);
    pthread_cond_destroy(&fs->cv);
    pthread_mutex_destroy(&fs->mu);
}

/* A page an earlier run stored. */
static void fake_put(struct fake_store *fs, const char *sensor_id, int64_t start_ms, int64_t page,
                     int64_t count, uint64_t wseq) {
    char id[BD_BUCKET_ID_MAX];
    bd_bucket_id(id, sizeof(id), sensor_id, start_ms, (uint32_t)page);
    struct fake_doc *d = fake_insert(fs, id);
    d->sensor_id = strdup(sensor_id);
    d->start_ms = start_ms;
    d->page = page;
    d->count = count;
    d->wseq = wseq;
}

static void fake_script(struct fake_store *fs, enum fake_fault fault, int32_t code) {
    if (fs->n_faults >= sizeof(fs->faults) / sizeof(fs->faults[0])) {
        fprintf(stderr, "fake_script: more than %zu faults scripted\n",
                sizeof(fs->faults) / sizeof(fs->faults[0]));
        abort();
    }
    fs->faults[fs->n_faults] = fault;
    fs->fault_codes[fs->n_faults] = code;
    fs->n_faults++;
}

/* Readings stored for one sensor, over all its pages. */
static int64_t fake_stored(const struct fake_store *fs, const char *sensor_id) {
    int64_t n = 0;
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        if (strcmp(fs->docs[i].sensor_id, sensor_id) == 0) {
            n += fs->docs[i].count;
        }
    }
    return n;
}

static int64_t fake_max_count(const struct fake_store *fs) {
    int64_t m = 0;
    for (uint32_t i = 0; i < fs->n_docs; i++) {
        m = fs->docs[i].count > m ? fs->docs[i].count : m;
    }
    return m;
}

#endif
