/*
 * The flusher's I/O runner (src/flusher_io.h): every store call of the flusher -- its writes,
 * look-ups, summary refreshes, and the spool replay's through the settle engine -- runs here on
 * the I/O thread (io.h) while the flusher thread does the idle work flusher.c handed down (the
 * drain). Without an I/O thread (a unit test, a flusher never started) calls run inline.
 *
 * What the I/O thread and the flusher thread share while a call runs: the call reads only the
 * batch being written (its built updates, and its deltas in the look-up callbacks); draining
 * touches only the fill batch, the sensor queues and the page slots, which nothing in a call
 * reads.
 */
#include "flusher_io.h"

#include "bucketd/common.h"
#include "flusher_int.h"

void flusher_io_run(void *arg, bd_io_fn fn, void *fn_arg) {
    struct bd_flusher *f = arg;
    int64_t idle_ns = BD_MIN((int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS, 100 * BD_NS_PER_MS);
    bd_io_run(f->io.worker, fn, fn_arg, f->io.idle, f->io.idle_arg, idle_ns);
}

bool flusher_io_call(struct bd_flusher *f, struct bd_store_call *c) {
    return bd_store_call(f->store, flusher_io_run, f, c);
}

bool flusher_io_prepare(struct bd_flusher *f, bson_error_t *error) {
    struct bd_store_call call = {.kind = BD_CALL_PREPARE, .error = error};
    return flusher_io_call(f, &call);
}
