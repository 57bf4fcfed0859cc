/*
 * Lock-free single-producer / single-consumer ring of 16-byte cells.
 *
 * The producer is the ingest thread (one per ring); the consumer is the flusher thread. head
 * and tail are free-running 32-bit counters (they wrap at UINT32_MAX; only their difference
 * matters) on separate 128-byte lines so the two threads never share a cache line pair. Each
 * side loads its own index relaxed and the other side's index with acquire, and publishes its
 * own with release. Capacity is a power of two; a record of n cells is pushed whole or not at
 * all, and may wrap around the end of the array (cells are addressed by index & mask).
 *
 * The ring does not know what the cells mean: the sensor module encodes readings into them.
 */
#ifndef BUCKETD_RING_H
#define BUCKETD_RING_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define BD_RING_CACHELINE 128

struct bd_cell {
    uint64_t w[2];
};

struct bd_ring {
    /* Written by the producer only. */
    alignas(BD_RING_CACHELINE) _Atomic uint32_t head;
    /* Written by the consumer only. */
    alignas(BD_RING_CACHELINE) _Atomic uint32_t tail;
    /* Read-only after init. */
    alignas(BD_RING_CACHELINE) uint32_t mask;
    struct bd_cell *cells;
};

/* capacity must be a power of two >= 2. Returns 0, -EINVAL or -ENOMEM. */
int bd_ring_init(struct bd_ring *r, uint32_t capacity);
/* As bd_ring_init with both counters starting at `start` (tests start near UINT32_MAX). */
int bd_ring_init_at(struct bd_ring *r, uint32_t capacity, uint32_t start);
void bd_ring_close(struct bd_ring *r);

static inline uint32_t bd_ring_capacity(const struct bd_ring *r) {
    return r->mask + 1;
}

/* Producer: cells free right now (a lower bound: the consumer may free more meanwhile). */
static inline uint32_t bd_ring_free(struct bd_ring *r) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    /* Pairs with the release store of tail in bd_ring_consume(): the cells before tail are no
     * longer read by the consumer, so they may be overwritten. */
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    return r->mask + 1 - (head - tail);
}

/* Producer: copy n cells in as one record; false (nothing written) if they do not fit. */
static inline bool bd_ring_push(struct bd_ring *r, const struct bd_cell *src, uint32_t n) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_acquire); /* see bd_ring_free */
    if (r->mask + 1 - (head - tail) < n) {
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        r->cells[(head + i) & r->mask] = src[i];
    }
    /* Pairs with the acquire load of head in bd_ring_available(): the cells written above are
     * visible to the consumer before it sees the new head. */
    atomic_store_explicit(&r->head, head + n, memory_order_release);
    return true;
}

/* Consumer: cells published and not yet consumed; *tail_out gets the first one's index. */
static inline uint32_t bd_ring_available(struct bd_ring *r, uint32_t *tail_out) {
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    /* Pairs with the release store of head in bd_ring_push(). */
    uint32_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    *tail_out = tail;
    return head - tail;
}

/* Consumer: the cell at free-running index idx (from bd_ring_available's tail onwards). */
static inline const struct bd_cell *bd_ring_at(const struct bd_ring *r, uint32_t idx) {
    return &r->cells[idx & r->mask];
}

/* Consumer: hand n cells back to the producer. */
static inline void bd_ring_consume(struct bd_ring *r, uint32_t n) {
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    /* Pairs with the acquire load of tail in bd_ring_push()/bd_ring_free(): our reads of the
     * consumed cells happen before the producer may overwrite them. */
    atomic_store_explicit(&r->tail, tail + n, memory_order_release);
}

/* Either side: cells in use (approximate when called from a third thread). */
static inline uint32_t bd_ring_used(struct bd_ring *r) {
    /* Tail first, in its own statement (the operands of `-` are unsequenced): tail never passes
     * head, so a third thread racing both sides cannot get a wrapped "negative" count. Head may
     * have gained more than a ring's worth since tail was read; clamp to the capacity. */
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    uint32_t used = atomic_load_explicit(&r->head, memory_order_acquire) - tail;
    return used > r->mask + 1 ? r->mask + 1 : used;
}

#endif
