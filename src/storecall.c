/*
 * One store call, dispatched (include/bucketd/storecall.h). Runs on whatever thread the runner
 * picks (the flusher's I/O thread, or the caller's); owns nothing.
 */
#include "bucketd/storecall.h"

void bd_store_call_run(void *arg) {
    struct bd_store_call *c = arg;
    const struct bd_store_ops *ops = c->st->ops;
    switch (c->kind) {
    case BD_CALL_PREPARE:
        c->ok = ops->prepare(c->st, c->error);
        break;
    case BD_CALL_BULK:
        c->ok = ops->bulk_upsert(c->st, c->selectors, c->updates, c->n, c->reply, c->error);
        break;
    case BD_CALL_FIND:
        c->ok = ops->find_pages(c->st, c->keys, c->n, c->cb, c->cb_arg, c->error);
        break;
    case BD_CALL_MAX_SEQ:
        c->ok = ops->max_writer_seq(c->st, c->seq, c->error);
        break;
    case BD_CALL_REFRESH:
        c->ok = ops->refresh_summaries(c->st, c->keys, c->n, c->error);
        break;
    }
}

bool bd_store_call(struct bd_store *st, bd_store_runner run, void *run_arg,
                   struct bd_store_call *c) {
    c->st = st;
    c->ok = false;
    run(run_arg, bd_store_call_run, c);
    return c->ok;
}
