/*
 * The flusher's I/O runner (flusher_io.c): makes store calls on the I/O thread (io.h) and, while
 * one runs, does the idle work flusher.c handed it (the drain). The lowest part: it calls no
 * other part of the flusher.
 */
#ifndef BUCKETD_FLUSHER_IO_H
#define BUCKETD_FLUSHER_IO_H

#include <bson/bson.h>
#include <stdbool.h>

#include "bucketd/io.h"
#include "bucketd/storecall.h"

struct bd_flusher;

struct flusher_io {
    struct bd_io *worker; /* the I/O thread once started; NULL: calls run inline */
    bd_io_fn idle;        /* the work done while a call runs, with idle_arg */
    void *idle_arg;
};

/* A bd_store_runner (arg: the flusher): run fn(fn_arg) on the I/O thread, idling meanwhile. */
void flusher_io_run(void *arg, bd_io_fn fn, void *fn_arg);
/* Make store call c through flusher_io_run; returns c->ok. */
bool flusher_io_call(struct bd_flusher *f, struct bd_store_call *c);
/* The store's prepare (connect, indexes). */
bool flusher_io_prepare(struct bd_flusher *f, bson_error_t *error);

#endif
