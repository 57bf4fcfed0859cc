/*
 * The flusher's part in a reload (flusher_reload.c): the configuration handed over by another
 * thread, adopted at the start of a step. Calls the writer side, the spool policy, the
 * summaries and the I/O runner below it.
 */
#ifndef BUCKETD_FLUSHER_RELOAD_H
#define BUCKETD_FLUSHER_RELOAD_H

#include <stdint.h>

#include "bucketd/config.h"
#include "bucketd/flusher.h"

struct bd_flusher;

struct flusher_reload {
    struct bd_config *cfg_next; /* guarded by the flusher's mu; NULL: none waiting */
    uint64_t cfg_next_gen;      /* guarded by mu */
    bd_flusher_reconfigured_cb reconfigured;
    void *reconfigured_arg;
};

/* Start of a step: adopt the configuration a reload handed over, if any. */
void flusher_reload_adopt(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms);

#endif
