/*
 * The pending batch (see include/bucketd/batch.h). Flusher thread only.
 */
#include "bucketd/batch.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"

static uint64_t key_hash(const struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    uint64_t h = (uint64_t)(uintptr_t)s * UINT64_C(0x9E3779B97F4A7C15);
    h ^= (uint64_t)start_ms * UINT64_C(0xC2B2AE3D27D4EB4F);
    h ^= (uint64_t)page * UINT64_C(0x165667B19E3779F9);
    return h ^ (h >> 29);
}

static void index_into(uint32_t *slots, uint32_t mask, const struct bd_batch *b, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_delta *d = &b->deltas[i];
        uint32_t j = (uint32_t)key_hash(d->sensor, d->start_ms, d->page) & mask;
        while (slots[j] != 0) {
            j = (j + 1) & mask;
        }
        slots[j] = i + 1;
    }
}

int bd_batch_init(struct bd_batch *b) {
    memset(b, 0, sizeof(*b));
    b->slot_mask = 1024 - 1;
    b->slots = bd_calloc((size_t)b->slot_mask + 1, sizeof(*b->slots));
    return b->slots == NULL ? -ENOMEM : 0;
}

/* Deltas [from, to) leave the batch: their sensors are referred to once less (sensor.h). */
static void unref(struct bd_batch *b, uint32_t from, uint32_t to) {
    for (uint32_t i = from; i < to; i++) {
        struct bd_sensor *s = b->deltas[i].sensor;
        BD_ASSERT(s != NULL);
        uint32_t refs = atomic_load_explicit(&s->flusher_refs, memory_order_relaxed);
        BD_ASSERT(refs > 0);
        /* Relaxed: the last one gone lets the sensor be evicted; nothing else is published. */
        atomic_store_explicit(&s->flusher_refs, refs - 1, memory_order_relaxed);
    }
}

void bd_batch_close(struct bd_batch *b) {
    unref(b, 0, b->n);
    for (uint32_t i = 0; i < b->cap; i++) {
        bd_delta_close(&b->deltas[i]);
    }
    free(b->deltas);
    free(b->meta);
    free(b->slots);
    memset(b, 0, sizeof(*b));
}

int64_t bd_batch_find(const struct bd_batch *b, const struct bd_sensor *s, int64_t start_ms,
                      uint32_t page) {
    uint32_t j = (uint32_t)key_hash(s, start_ms, page) & b->slot_mask;
    while (b->slots[j] != 0) {
        const struct bd_delta *d = &b->deltas[b->slots[j] - 1];
        if (d->sensor == s && d->start_ms == start_ms && d->page == page) {
            return b->slots[j] - 1;
        }
        j = (j + 1) & b->slot_mask;
    }
    return -1;
}

int64_t bd_batch_get(struct bd_batch *b, struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    int64_t found = bd_batch_find(b, s, start_ms, page);
    if (found >= 0) {
        struct bd_batch_meta *m = &b->meta[found];
        if (m->done) {
            /* Only an emptied delta can be found done: a batch is cleared once settled. */
            BD_ASSERT(b->deltas[found].n_readings == 0);
            *m = (struct bd_batch_meta){0};
        }
        return found;
    }
    /* Every allocation first, so that a failure leaves the batch as it was. */
    if (b->n == b->cap) {
        /* By half as much again: a batch of 100k pages' deltas (72 bytes each with their meta)
         * leaves 12% unused, not up to half. */
        uint64_t grown = b->cap ? (uint64_t)b->cap + b->cap / 2 : 256;
        if (grown > UINT32_MAX - 1) {
            return -ENOMEM; /* indices stay below UINT32_MAX (slots hold index + 1) */
        }
        uint32_t cap = (uint32_t)grown;
        struct bd_delta *nd = bd_reallocarray(b->deltas, cap, sizeof(*nd));
        if (nd == NULL) {
            return -ENOMEM;
        }
        memset(nd + b->cap, 0, (size_t)(cap - b->cap) * sizeof(*nd));
        b->deltas = nd;
        struct bd_batch_meta *meta = bd_reallocarray(b->meta, cap, sizeof(*meta));
        if (meta == NULL) {
            return -ENOMEM; /* the larger deltas array is kept; cap is not raised yet */
        }
        b->meta = meta;
        b->cap = cap;
    }
    if ((b->n + 1) * 2 > b->slot_mask) {
        uint32_t mask = b->slot_mask * 2 + 1;
        uint32_t *slots = bd_calloc((size_t)mask + 1, sizeof(*slots));
        if (slots == NULL) {
            return -ENOMEM;
        }
        index_into(slots, mask, b, b->n);
        free(b->slots);
        b->slots = slots;
        b->slot_mask = mask;
    }
    struct bd_delta *d = &b->deltas[b->n];
    /* Keep the buffers of a delta slot used by an earlier flush. */
    bd_delta_retarget(d, s, start_ms, page);
    /* This thread alone writes it. Relaxed: a drain creates the delta before it reports the
     * queue empty (sensor.c, report_idle's release), which the producer sees before it can find
     * the sensor evictable. */
    atomic_store_explicit(&s->flusher_refs,
                          atomic_load_explicit(&s->flusher_refs, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    b->meta[b->n] = (struct bd_batch_meta){0};
    uint32_t j = (uint32_t)key_hash(s, start_ms, page) & b->slot_mask;
    while (b->slots[j] != 0) {
        j = (j + 1) & b->slot_mask;
    }
    b->slots[j] = ++b->n;
    return b->n - 1;
}

void bd_batch_truncate(struct bd_batch *b, uint32_t n) {
    if (n >= b->n) {
        return;
    }
    unref(b, n, b->n);
    for (uint32_t i = n; i < b->n; i++) {
        bd_delta_reset(&b->deltas[i]);
    }
    b->n = n;
    memset(b->slots, 0, ((size_t)b->slot_mask + 1) * sizeof(*b->slots));
    index_into(b->slots, b->slot_mask, b, b->n);
}

uint64_t bd_batch_pending_readings(const struct bd_batch *b) {
    uint64_t n = 0;
    for (uint32_t i = 0; i < b->n; i++) {
        if (!b->meta[i].done) {
            n += b->deltas[i].n_readings;
        }
    }
    return n;
}

void bd_batch_clear(struct bd_batch *b) {
    unref(b, 0, b->n);
    for (uint32_t i = 0; i < b->n; i++) {
        bd_delta_reset(&b->deltas[i]);
    }
    /* Buffers are kept for the next batch's deltas, but not without bound: after a batch of
     * very many sensors, what lies past BD_BATCH_KEEP deltas goes back to the allocator, so the
     * two batches do not each hold the memory of the largest batch ever. */
    for (uint32_t i = BD_BATCH_KEEP; i < b->cap; i++) {
        bd_delta_close(&b->deltas[i]); /* zeroed: no buffers, as never used */
    }
    b->n = 0;
    /* The arrays too (a shrinking realloc that fails keeps the larger block, which is fine). */
    if (b->cap > BD_BATCH_KEEP) {
        struct bd_delta *nd = bd_reallocarray(b->deltas, BD_BATCH_KEEP, sizeof(*nd));
        if (nd != NULL) {
            b->deltas = nd;
            b->cap = BD_BATCH_KEEP; /* meta may stay larger than cap: harmless */
            struct bd_batch_meta *nm = bd_reallocarray(b->meta, BD_BATCH_KEEP, sizeof(*nm));
            if (nm != NULL) {
                b->meta = nm;
            }
        }
    }
    if (b->slot_mask + 1 > 4 * BD_BATCH_KEEP) {
        uint32_t *slots = bd_calloc(4 * BD_BATCH_KEEP, sizeof(*slots));
        if (slots != NULL) {
            free(b->slots);
            b->slots = slots;
            b->slot_mask = 4 * BD_BATCH_KEEP - 1;
            return;
        }
    }
    memset(b->slots, 0, ((size_t)b->slot_mask + 1) * sizeof(*b->slots));
}
