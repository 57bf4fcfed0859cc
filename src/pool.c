/*
 * The buffer pool (include/bucketd/pool.h): one reserved block cut into equal segments. The
 * ingest thread takes them, first from the segments the flusher gave back, then from the part
 * of the block never used yet, so the resident size grows only with the number of segments in
 * use at once. The flusher gives segments back through an SPSC ring. Tests may hook every take
 * (bd_pool_set_take_hook) to make it fail or to run the flusher's part in between.
 */
#include "bucketd/pool.h"

#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(struct bd_seg) == BD_SEG_HEADER, "segment header: one line");

static uint32_t pow2_at_least(uint64_t v) {
    uint32_t p = 2;
    while (p < v && p < (UINT32_C(1) << 31)) {
        p <<= 1;
    }
    return p;
}

int bd_pool_init(struct bd_pool *p, uint64_t bytes, uint32_t max_record_cells, struct bd_err *err) {
    memset(p, 0, sizeof(*p));
    size_t seg = BD_SEG_MIN_BYTES;
    while (seg < BD_SEG_HEADER + (size_t)max_record_cells * sizeof(struct bd_cell)) {
        seg *= 2;
    }
    uint64_t n = bytes / seg;
    if (n < 16 || n > UINT32_MAX / 2) {
        return bd_err_set(err, -EINVAL,
                          "buffer pool: %llu bytes make %llu segments of %zu bytes (16 to %u)",
                          (unsigned long long)bytes, (unsigned long long)n, seg, UINT32_MAX / 2);
    }
    p->seg_bytes = seg;
    p->seg_cells = (uint32_t)((seg - BD_SEG_HEADER) / sizeof(struct bd_cell));
    p->n_segs = (uint32_t)n;
    /* Reserved, not touched: no memset, so untouched pages never become resident. */
    p->base = aligned_alloc(BD_RING_CACHELINE, (size_t)n * seg);
    if (p->base == NULL) {
        return bd_err_set(err, -ENOMEM, "buffer pool: cannot reserve %llu bytes",
                          (unsigned long long)((size_t)n * seg));
    }
    int rc = bd_ring_init(&p->free, pow2_at_least(n));
    if (rc < 0) {
        free(p->base);
        p->base = NULL;
        return bd_err_set(err, rc, "buffer pool: out of memory");
    }
    atomic_init(&p->taken, 0);
    atomic_init(&p->given, 0);
    atomic_init(&p->high_water, 0);
    return 0;
}

void bd_pool_close(struct bd_pool *p) {
    if (p->base == NULL) {
        return;
    }
    bd_ring_close(&p->free);
    free(p->base);
    p->base = NULL;
}

void bd_pool_set_take_hook(struct bd_pool *p, bd_pool_take_hook hook, void *arg) {
    p->take_hook = hook;
    p->take_hook_arg = arg;
}

struct bd_seg *bd_pool_take(struct bd_pool *p) {
    struct bd_seg *seg = NULL;
    uint32_t tail;
    /* Tests' seam: a load and a branch per segment taken, nothing per reading. */
    if (__builtin_expect(p->take_hook != NULL, 0) && p->take_hook(p->take_hook_arg)) {
        return NULL;
    }
    /* The free ring's consumer is this (ingest) thread. */
    if (bd_ring_available(&p->free, &tail) != 0) {
        seg = (struct bd_seg *)(uintptr_t)bd_ring_at(&p->free, tail)->w[0];
        bd_ring_consume(&p->free, 1);
    } else if (p->bumped < p->n_segs) {
        seg = (struct bd_seg *)(void *)(p->base + (size_t)p->bumped * p->seg_bytes);
        p->bumped++;
    } else {
        return NULL;
    }
    /* Not yet linked into any chain: nobody else can see it, relaxed stores suffice (the
     * release that links it publishes them). */
    atomic_store_explicit(&seg->published, 0, memory_order_relaxed);
    atomic_store_explicit(&seg->consumed, 0, memory_order_relaxed);
    atomic_store_explicit(&seg->next, NULL, memory_order_relaxed);
    uint64_t taken = atomic_load_explicit(&p->taken, memory_order_relaxed) + 1;
    atomic_store_explicit(&p->taken, taken, memory_order_relaxed);
    uint32_t used = bd_pool_in_use(p);
    if (used > atomic_load_explicit(&p->high_water, memory_order_relaxed)) {
        atomic_store_explicit(&p->high_water, used, memory_order_relaxed);
    }
    return seg;
}

void bd_pool_give(struct bd_pool *p, struct bd_seg *seg) {
    struct bd_cell c = {{(uint64_t)(uintptr_t)seg, 0}};
    bool ok = bd_ring_push(&p->free, &c, 1);
    BD_ASSERT(ok); /* capacity >= segments, each given back once per take */
    uint64_t given = atomic_load_explicit(&p->given, memory_order_relaxed) + 1;
    atomic_store_explicit(&p->given, given, memory_order_relaxed);
}
