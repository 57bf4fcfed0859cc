/*
 * Lock-free single-producer / single-consumer ring of 8-byte cells.
 *
 * The producer is the ingest thread (one per ring); the consumer is the flusher thread. head
 * and tail are free-running 32-bit counters (they wrap at UINT32_MAX; only their difference
 * matters) 128 bytes apart so the two threads never share a cache line pair. Each side loads
 * its own index relaxed and the other side's index with acquire (into a private copy, see
 * struct bd_ring), and publishes its own with release. Capacity is a power of two; a record of
 * n cells is pushed whole or not at all, and may wrap around the end of the array (cells are
 * addressed by index & mask).
 *
 * The ring does not know what the cells mean. Its users pass pointers, one a cell: the sensor
 * table's dirty, reclaim, evict and dead queues carry sensors, the buffer pool's free lists
 * segments (8 bytes an entry: a queue sized for 100,000 sensors takes 1 MiB).
 */
#ifndef BUCKETD_RING_H
#define BUCKETD_RING_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define BD_RING_CACHELINE 128
/* One cache line; each side's state fits in one, and 2 x 64 = BD_RING_CACHELINE apart. */
#define BD_RING_LINE 64

/*
 * Each side keeps, in its own line, a private copy of the other side's counter, refreshed only
 * when the copy says there is nothing to do (the producer: "full"; the consumer: "empty").
 * A push then touches the producer line and the cells, never the line the consumer writes,
 * and a drain reads the producer line once per refresh rather than once per record. The
 * copies are only ever behind the real counters (the other side only moves its counter
 * forward), so a stale copy makes the ring look fuller (producer) or emptier (consumer) than
 * it is, never the reverse: it can delay a push or a pop until the refresh, never corrupt one.
 *
 * Layout: the struct is 64-byte aligned and 256 bytes long, producer line at 0, consumer line
 * at 128, padding after each. head and tail are always 128 bytes apart, so they never share
 * a line or an adjacent-line prefetch pair, wherever the ring sits. An owner may place the ring
 * at an offset of 64 mod 128 so that the head line pairs with a line of its own that the
 * producer reads anyway (the sensor does).
 */
struct bd_ring {
    union {
        struct {
            /* Written by the producer only; the consumer reads head. */
            _Atomic uint32_t head;
            uint32_t tail_cache; /* producer's copy of tail, never ahead of it */
            uint32_t mask;       /* read-only after init */
            uint64_t *cells;
        };
        alignas(BD_RING_LINE) unsigned char producer_line_[BD_RING_CACHELINE];
    };
    union {
        struct {
            /* Written by the consumer only; the producer reads tail. */
            _Atomic uint32_t tail;
            uint32_t head_cache; /* consumer's copy of head, never ahead of it */
            uint32_t cons_mask;  /* read-only copies, so the consumer stays in its line */
            uint64_t *cons_cells;
        };
        unsigned char consumer_line_[BD_RING_CACHELINE];
    };
};

/* capacity must be a power of two >= 2. Returns 0, -EINVAL or -ENOMEM. */
int bd_ring_init(struct bd_ring *r, uint32_t capacity);
/* As bd_ring_init with both counters starting at `start` (tests start near UINT32_MAX). */
int bd_ring_init_at(struct bd_ring *r, uint32_t capacity, uint32_t start);
void bd_ring_close(struct bd_ring *r);

static inline uint32_t bd_ring_capacity(const struct bd_ring *r) {
    return r->mask + 1;
}

/* Producer: reload the copy of tail. */
static inline uint32_t bd_ring_refresh_tail(struct bd_ring *r) {
    /* Pairs with the release store of tail in bd_ring_consume(): the cells before tail are no
     * longer read by the consumer, so they may be overwritten. */
    r->tail_cache = atomic_load_explicit(&r->tail, memory_order_acquire);
    return r->tail_cache;
}

/* Producer: cells free right now (a lower bound: the consumer may free more meanwhile). Reads
 * the consumer's tail: for the hot path use bd_ring_used_hint(). */
static inline uint32_t bd_ring_free(struct bd_ring *r) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    return r->mask + 1 - (head - bd_ring_refresh_tail(r));
}

/* Producer: cells in use as of the last refresh of the tail copy: an upper bound that costs no
 * shared read. */
static inline uint32_t bd_ring_used_hint(const struct bd_ring *r) {
    return atomic_load_explicit(&r->head, memory_order_relaxed) - r->tail_cache;
}

/* Producer: start fetching, for writing, the line the next push will write first. */
static inline void bd_ring_prefetch_push(const struct bd_ring *r) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    __builtin_prefetch(&r->cells[head & r->mask], 1);
}

/* Producer: copy n cells in as one record; false (nothing written) if they do not fit. */
static inline bool bd_ring_push(struct bd_ring *r, const uint64_t *src, uint32_t n) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (r->mask + 1 - (head - r->tail_cache) < n &&
        r->mask + 1 - (head - bd_ring_refresh_tail(r)) < n) {
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

/*
 * Consumer: cells published and not yet consumed; *tail_out gets the first one's index. A lower
 * bound that ends on a record boundary: head is only reloaded once the records seen at the last
 * load are consumed, so 0 always means "empty at a fresh look".
 */
static inline uint32_t bd_ring_available(struct bd_ring *r, uint32_t *tail_out) {
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    uint32_t avail = r->head_cache - tail;
    /* Used up, or (a caller that consumed without asking) behind tail: more than a ring's
     * worth in wrapped arithmetic. */
    if (avail == 0 || avail > r->cons_mask + 1) {
        /* Pairs with the release store of head in bd_ring_push(). */
        r->head_cache = atomic_load_explicit(&r->head, memory_order_acquire);
        avail = r->head_cache - tail;
    }
    *tail_out = tail;
    return avail;
}

/* Consumer: the cell at free-running index idx (from bd_ring_available's tail onwards). */
static inline const uint64_t *bd_ring_at(const struct bd_ring *r, uint32_t idx) {
    return &r->cons_cells[idx & r->cons_mask];
}

/* Producer: push one pointer (a record of one cell); false if the ring is full. */
static inline bool bd_ring_push_ptr(struct bd_ring *r, const void *p) {
    uint64_t c = (uint64_t)(uintptr_t)p;
    return bd_ring_push(r, &c, 1);
}

/* Consumer: the pointer in the cell at free-running index idx. */
static inline void *bd_ring_ptr_at(const struct bd_ring *r, uint32_t idx) {
    return (void *)(uintptr_t)*bd_ring_at(r, idx);
}

/* Consumer: hand n cells back to the producer (n at most what bd_ring_available returned). */
static inline void bd_ring_consume(struct bd_ring *r, uint32_t n) {
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    /* Pairs with the acquire load of tail in bd_ring_refresh_tail(): our reads of the consumed
     * cells happen before the producer may overwrite them. */
    atomic_store_explicit(&r->tail, tail + n, memory_order_release);
}

/* Either side: cells in use (approximate when called from a third thread). Reads both lines. */
static inline uint32_t bd_ring_used(struct bd_ring *r) {
    /* Tail first, in its own statement (the operands of `-` are unsequenced): tail never passes
     * head, so a third thread racing both sides cannot get a wrapped "negative" count. Head may
     * have gained more than a ring's worth since tail was read; clamp to the capacity. */
    uint32_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    uint32_t used = atomic_load_explicit(&r->head, memory_order_acquire) - tail;
    return used > r->mask + 1 ? r->mask + 1 : used;
}

#endif
