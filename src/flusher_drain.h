/*
 * The flusher's drain (flusher_drain.c): moves the sensor queues' readings into the fill batch,
 * placing each on its bucket page, and hands evicted sensors back once nothing of them is left
 * to write. Calls no other part of the flusher.
 */
#ifndef BUCKETD_FLUSHER_DRAIN_H
#define BUCKETD_FLUSHER_DRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/flusher.h"
#include "bucketd/sensor.h"

struct flusher_drain {
    /* Sensors whose drain stopped early (an allocation failure, the memory budget): drained
     * first next time. */
    struct bd_sensor *requeued;
    struct bd_sensor *evicted;     /* evicted sensors not released yet */
    bd_flusher_drained_cb drained; /* called after each drain, with drained_arg */
    void *drained_arg;
};

/*
 * Release evicted sensors no batch refers to any more, then drain the sensor queues into the
 * fill batch (up to the memory budget; with to_mark, only until the fill is large, for a caller
 * that hands it to the writer next) and call the drained callback. True when to_mark stopped it
 * with sensors still waiting.
 */
bool flusher_drain_run(struct bd_flusher *f, int64_t wall_ms, bool to_mark);
/* At free: release every evicted sensor still held (the batches are closed). */
void flusher_drain_release_evicted(struct bd_flusher *f);
/* The fill batch is large: written whole, nothing held back. */
bool flusher_drain_fill_large(const struct bd_flusher *f);
/* The fill batch is due: the interval passed, it is large, or a stop. */
bool flusher_drain_fill_due(const struct bd_flusher *f, int64_t mono_ns, bool stopping);

#endif
