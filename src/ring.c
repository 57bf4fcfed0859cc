/*
 * Allocation for the SPSC ring (include/bucketd/ring.h holds the lock-free hot path inline).
 * Called on the ingest thread when a sensor is created and on the main thread at shutdown.
 */
#include "bucketd/ring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int bd_ring_init_at(struct bd_ring *r, uint32_t capacity, uint32_t start) {
    if (capacity < 2 || (capacity & (capacity - 1)) != 0) {
        return -EINVAL;
    }
    r->cells = calloc(capacity, sizeof(*r->cells));
    if (r->cells == NULL) {
        return -ENOMEM;
    }
    r->mask = capacity - 1;
    atomic_init(&r->head, start);
    atomic_init(&r->tail, start);
    return 0;
}

int bd_ring_init(struct bd_ring *r, uint32_t capacity) {
    return bd_ring_init_at(r, capacity, 0);
}

void bd_ring_close(struct bd_ring *r) {
    free(r->cells);
    r->cells = NULL;
}
