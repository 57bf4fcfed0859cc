/*
 * The buffer pool (include/bucketd/pool.h): one reserved block cut into a large and (in a pool
 * big enough) a small class of equal segments. The ingest thread takes them, first from the
 * segments the flusher gave back, then from the part of the class never used yet, so the
 * resident size grows only with the segments in use at once. The flusher gives segments back
 * through an SPSC ring per class (a segment's address tells its class). Tests may hook every take
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

static int class_init(struct bd_pool_class *c, unsigned char *base, size_t seg_bytes, uint64_t n,
                      size_t unit_bytes) {
    c->base = base;
    c->seg_bytes = seg_bytes;
    c->seg_cells = (uint32_t)((seg_bytes - BD_SEG_HEADER) / sizeof(struct bd_cell));
    c->seg_units = (uint32_t)(seg_bytes / unit_bytes);
    c->n_segs = (uint32_t)n;
    return n > 0 ? bd_ring_init(&c->free, pow2_at_least(n)) : 0;
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
    /* Half of the block for the small class, when both halves stay worth having. */
    uint64_t n_small = 0;
    if (bytes >= BD_POOL_SMALL_MIN_BYTES && n / 2 >= 16) {
        n = n / 2;
        n_small = (bytes - n * seg) / BD_SEG_SMALL_BYTES;
    }
    size_t unit = n_small > 0 ? BD_SEG_SMALL_BYTES : seg;
    size_t total = (size_t)n * seg + (size_t)n_small * BD_SEG_SMALL_BYTES;
    /* Reserved, not touched: no memset, so untouched pages never become resident. */
    p->block = aligned_alloc(BD_RING_CACHELINE, total);
    if (p->block == NULL) {
        return bd_err_set(err, -ENOMEM, "buffer pool: cannot reserve %llu bytes",
                          (unsigned long long)total);
    }
    int rc = class_init(&p->large, p->block, seg, n, unit);
    if (rc == 0) {
        rc = class_init(&p->small, p->block + (size_t)n * seg, BD_SEG_SMALL_BYTES, n_small, unit);
    }
    if (rc < 0) {
        bd_pool_close(p);
        return bd_err_set(err, rc, "buffer pool: out of memory");
    }
    p->seg_bytes = seg;
    p->seg_cells = p->large.seg_cells;
    p->n_segs = p->large.n_segs;
    p->unit_bytes = unit;
    p->n_units = (uint32_t)(total / unit);
    atomic_init(&p->taken, 0);
    atomic_init(&p->given, 0);
    atomic_init(&p->high_water, 0);
    return 0;
}

void bd_pool_close(struct bd_pool *p) {
    if (p->block == NULL) {
        return;
    }
    bd_ring_close(&p->large.free);
    bd_ring_close(&p->small.free);
    free(p->block);
    p->block = NULL;
}

void bd_pool_set_take_hook(struct bd_pool *p, bd_pool_take_hook hook, void *arg) {
    p->take_hook = hook;
    p->take_hook_arg = arg;
}

/* A segment of class c: one given back first, else one never used yet; NULL if none. */
static struct bd_seg *class_take(struct bd_pool_class *c) {
    uint32_t tail;
    if (c->n_segs == 0) {
        return NULL;
    }
    /* The free ring's consumer is this (ingest) thread. */
    if (bd_ring_available(&c->free, &tail) != 0) {
        struct bd_seg *seg = bd_ring_ptr_at(&c->free, tail);
        bd_ring_consume(&c->free, 1);
        return seg;
    }
    if (c->bumped < c->n_segs) {
        return (struct bd_seg *)(void *)(c->base + (size_t)c->bumped++ * c->seg_bytes);
    }
    return NULL;
}

struct bd_seg *bd_pool_take(struct bd_pool *p, uint32_t cells, bool small, uint32_t *seg_cells,
                            uint32_t *units) {
    /* Tests' seam: a load and a branch per segment taken, nothing per reading. */
    if (__builtin_expect(p->take_hook != NULL, 0) && p->take_hook(p->take_hook_arg)) {
        return NULL;
    }
    bool fits_small = cells <= p->small.seg_cells;
    struct bd_pool_class *c = small && fits_small ? &p->small : &p->large;
    struct bd_seg *seg = class_take(c);
    if (seg == NULL && (c == &p->small || fits_small)) {
        c = c == &p->small ? &p->large : &p->small; /* the other class stands in */
        seg = class_take(c);
    }
    if (seg == NULL) {
        return NULL;
    }
    /* Not yet linked into any chain: nobody else can see it, relaxed stores suffice (the
     * release that links it publishes them). */
    atomic_store_explicit(&seg->published, 0, memory_order_relaxed);
    atomic_store_explicit(&seg->consumed, 0, memory_order_relaxed);
    atomic_store_explicit(&seg->next, NULL, memory_order_relaxed);
    uint64_t taken = atomic_load_explicit(&p->taken, memory_order_relaxed) + c->seg_units;
    atomic_store_explicit(&p->taken, taken, memory_order_relaxed);
    uint32_t used = bd_pool_in_use(p);
    if (used > atomic_load_explicit(&p->high_water, memory_order_relaxed)) {
        atomic_store_explicit(&p->high_water, used, memory_order_relaxed);
    }
    *seg_cells = c->seg_cells;
    *units = c->seg_units;
    return seg;
}

uint32_t bd_pool_give(struct bd_pool *p, struct bd_seg *seg) {
    /* The small class lies after the large one in the block. */
    struct bd_pool_class *c =
        p->small.n_segs > 0 && (unsigned char *)seg >= p->small.base ? &p->small : &p->large;
    bool ok = bd_ring_push_ptr(&c->free, seg);
    BD_ASSERT(ok); /* capacity >= segments, each given back once per take */
    uint64_t given = atomic_load_explicit(&p->given, memory_order_relaxed) + c->seg_units;
    atomic_store_explicit(&p->given, given, memory_order_relaxed);
    return c->seg_units;
}
