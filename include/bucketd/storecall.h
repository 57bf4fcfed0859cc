/*
 * One store call (store.h), whatever thread runs it: the call's arguments and result in one
 * struct, and a runner that makes it -- inline, or on the flusher's I/O thread with draining
 * going on meanwhile. Every store call of the flusher and of the spool replay goes through
 * bd_store_call, so there is one place where a call is dispatched.
 *
 * Threads: the struct belongs to the caller until the runner returns; bd_store_call_run runs on
 * whatever thread the runner chose (it touches nothing but the call and the store).
 */
#ifndef BUCKETD_STORECALL_H
#define BUCKETD_STORECALL_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/io.h"
#include "bucketd/store.h"

enum bd_store_call_kind {
    BD_CALL_PREPARE, /* prepare: connect, indexes */
    BD_CALL_BULK,    /* bulk_upsert of n selectors/updates into reply */
    BD_CALL_FIND,    /* find_pages of n keys, cb once per page */
    BD_CALL_MAX_SEQ, /* max_writer_seq into *seq */
    BD_CALL_REFRESH, /* refresh_summaries of n keys */
};

struct bd_store_call {
    enum bd_store_call_kind kind;
    uint32_t n;
    const bson_t *const *selectors, *const *updates;
    bson_t *reply;
    const struct bd_page_key *keys;
    bd_store_page_cb cb;
    void *cb_arg;
    uint64_t *seq;
    bson_error_t *error;
    /* Set by bd_store_call. */
    struct bd_store *st;
    bool ok;
};

/* Runs fn(fn_arg) -- one store call -- and returns once it has returned. */
typedef void (*bd_store_runner)(void *run_arg, bd_io_fn fn, void *fn_arg);

/* A bd_io_fn: makes the call c (a struct bd_store_call) on c->st. */
void bd_store_call_run(void *c);

/* Make call c on st through run(run_arg); returns c->ok. */
bool bd_store_call(struct bd_store *st, bd_store_runner run, void *run_arg,
                   struct bd_store_call *c);

#endif
