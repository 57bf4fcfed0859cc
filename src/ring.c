/*
 * Allocation for the SPSC ring (include/bucketd/ring.h holds the lock-free hot path inline).
 * Called on the ingest thread when a sensor is created and on the main thread at shutdown.
 */
#include "bucketd/ring.h"

#include <errno.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

_Static_assert(sizeof(struct bd_ring) == 2 * BD_RING_CACHELINE, "ring: two 128-byte halves");
_Static_assert(offsetof(struct bd_ring, tail) - offsetof(struct bd_ring, head) == BD_RING_CACHELINE,
               "ring: head and tail 128 bytes apart");
_Static_assert(offsetof(struct bd_ring, cells) < BD_RING_LINE &&
                   offsetof(struct bd_ring, cons_cells) - BD_RING_CACHELINE < BD_RING_LINE,
               "ring: each side's state in its own 64-byte line");

int bd_ring_init_at(struct bd_ring *r, uint32_t capacity, uint32_t start) {
    if (capacity < 2 || (capacity & (capacity - 1)) != 0) {
        return -EINVAL;
    }
    /* Line-aligned: a cell never straddles two lines, eight cells share one. */
    size_t bytes = (size_t)capacity * sizeof(*r->cells);
    bytes = (bytes + BD_RING_LINE - 1) & ~(size_t)(BD_RING_LINE - 1);
    r->cells = aligned_alloc(BD_RING_LINE, bytes);
    if (r->cells == NULL) {
        return -ENOMEM;
    }
    r->mask = capacity - 1;
    r->cons_mask = r->mask;
    r->cons_cells = r->cells;
    atomic_init(&r->head, start);
    atomic_init(&r->tail, start);
    r->tail_cache = start;
    r->head_cache = start;
    return 0;
}

int bd_ring_init(struct bd_ring *r, uint32_t capacity) {
    return bd_ring_init_at(r, capacity, 0);
}

void bd_ring_close(struct bd_ring *r) {
    free(r->cells);
    r->cells = NULL;
    r->cons_cells = NULL;
}
