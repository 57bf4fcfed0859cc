/*
 * The pending batch: the bucket deltas one flush sends, indexed by (sensor, bucket start, page),
 * with what each has been through with MongoDB. Creating a delta is all or nothing; a batch never
 * sends an empty delta. Flusher thread only.
 */
#ifndef BUCKETD_BATCH_H
#define BUCKETD_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/bucket.h"

/* Per delta: where it stands with MongoDB. */
struct bd_batch_meta {
    bool done;          /* acknowledged, already applied, quarantined, or emptied */
    bool maybe_applied; /* an attempt may have reached the server and been applied */
    uint8_t refusals;   /* answers that refused it (bounded, then quarantined) */
    uint8_t dup_checks; /* duplicate-key answers whose read-back found a racing insert */
    int64_t first_ms;   /* wall clock when its oldest reading was drained (0: not set) */
};

struct bd_batch {
    struct bd_delta *deltas; /* [0, n); buffers of [n, cap) kept for reuse */
    struct bd_batch_meta *meta;
    uint32_t n, cap;
    uint32_t *slots; /* open addressing: delta index + 1, 0 = empty */
    uint32_t slot_mask;
};

/* Deltas whose buffers a cleared batch keeps for reuse. */
#define BD_BATCH_KEEP 4096

int bd_batch_init(struct bd_batch *b);
void bd_batch_close(struct bd_batch *b);

/* Index of the delta of (s, start_ms, page) or -1. */
int64_t bd_batch_find(const struct bd_batch *b, const struct bd_sensor *s, int64_t start_ms,
                      uint32_t page);

/*
 * Index of the delta of (s, start_ms, page), created empty (not done) if missing; -ENOMEM with
 * nothing changed. An empty delta found done is taken up again. Delta pointers taken before
 * this call may move.
 */
int64_t bd_batch_get(struct bd_batch *b, struct bd_sensor *s, int64_t start_ms, uint32_t page);

/* Drop the deltas from index n on (undo of bd_batch_get calls that created them). */
void bd_batch_truncate(struct bd_batch *b, uint32_t n);

/* Readings in deltas not done. */
uint64_t bd_batch_pending_readings(const struct bd_batch *b);

/* Empty the batch, keeping its buffers. */
void bd_batch_clear(struct bd_batch *b);

#endif
