/*
 * Page accounting (see include/bucketd/pages.h for the invariants), and the pool of one-slot
 * pages. Flusher thread only (and the unplaced readings' loader, before the flusher runs, with
 * no pool); the pool owns its chunks until bd_pages_pool_close().
 */
#include "bucketd/pages.h"

#include <stdlib.h>
#include <string.h>

#if defined(__has_include)
#if __has_include(<sanitizer/asan_interface.h>)
#include <sanitizer/asan_interface.h>
#endif
#endif
#ifndef ASAN_POISON_MEMORY_REGION
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

#include "bucketd/alloc.h"
#include "bucketd/common.h"

_Static_assert(sizeof(struct bd_pages) == 16 && sizeof(struct bd_page_slot) == 24,
               "a sensor's pages with one slot take 40 bytes");
_Static_assert(BD_PAGES_ONE_SLOT_BYTES >= sizeof(void *), "a free object holds the list's link");

/* The first bytes of a chunk link the chunks; its objects follow. */
#define CHUNK_LINK 16

void bd_pages_pool_init(struct bd_pages_pool *pool) {
    memset(pool, 0, sizeof(*pool));
}

void bd_pages_pool_close(struct bd_pages_pool *pool) {
    unsigned char *c = pool->chunks;
    while (c != NULL) {
        unsigned char *next;
        memcpy(&next, c, sizeof(next));
        ASAN_UNPOISON_MEMORY_REGION(c, BD_PAGES_POOL_CHUNK);
        free(c);
        c = next;
    }
    memset(pool, 0, sizeof(*pool));
}

static struct bd_pages *pool_alloc(struct bd_pages_pool *pool) {
    if (pool == NULL) {
        return bd_malloc(BD_PAGES_ONE_SLOT_BYTES);
    }
    void *p = pool->free;
    if (p != NULL) {
        ASAN_UNPOISON_MEMORY_REGION(p, BD_PAGES_ONE_SLOT_BYTES);
        memcpy(&pool->free, p, sizeof(void *));
        return p;
    }
    if (pool->bump_left < BD_PAGES_ONE_SLOT_BYTES) {
        /* The rest of the chunk (less than an object) stays unused. */
        unsigned char *chunk = bd_malloc(BD_PAGES_POOL_CHUNK);
        if (chunk == NULL) {
            return NULL;
        }
        memcpy(chunk, &pool->chunks, sizeof(void *));
        pool->chunks = chunk;
        pool->bump = chunk + CHUNK_LINK;
        pool->bump_left = BD_PAGES_POOL_CHUNK - CHUNK_LINK;
        pool->chunk_bytes += BD_PAGES_POOL_CHUNK;
        ASAN_POISON_MEMORY_REGION(pool->bump, pool->bump_left);
    }
    p = pool->bump;
    pool->bump += BD_PAGES_ONE_SLOT_BYTES;
    pool->bump_left -= BD_PAGES_ONE_SLOT_BYTES;
    ASAN_UNPOISON_MEMORY_REGION(p, BD_PAGES_ONE_SLOT_BYTES);
    return p;
}

static void pool_free(struct bd_pages_pool *pool, struct bd_pages *p) {
    if (pool == NULL) {
        free(p);
        return;
    }
    memcpy(p, &pool->free, sizeof(void *));
    pool->free = p;
    ASAN_POISON_MEMORY_REGION(p, BD_PAGES_ONE_SLOT_BYTES);
}

/* The slots pages of n slots have room for: they grow 1, 2, 4, ... up to BD_PAGES_MAX_SLOTS. */
static uint32_t cap_of(uint32_t n) {
    uint32_t cap = 1;
    while (cap < n) {
        cap *= 2;
    }
    return BD_MIN(cap, (uint32_t)BD_PAGES_MAX_SLOTS);
}

bool bd_pages_start_ok(const struct bd_pages_limits *lim, int64_t start_ms) {
    const int64_t span = (int64_t)lim->span_ms;
    return span > 0 && start_ms % span == 0 && start_ms / span > BD_PAGES_FORGOT_NONE &&
           start_ms / span <= INT32_MAX;
}

/* The bucket number of start_ms (bd_pages_start_ok). */
static int32_t bucket_of(const struct bd_pages_limits *lim, int64_t start_ms) {
    BD_ASSERT(bd_pages_start_ok(lim, start_ms));
    return (int32_t)(start_ms / (int64_t)lim->span_ms);
}

static struct bd_page_slot *find(struct bd_pages *p, int32_t bucket) {
    for (uint32_t i = 0; p != NULL && i < p->n; i++) {
        if (p->slot[i].bucket == bucket) {
            return &p->slot[i];
        }
    }
    return NULL;
}

struct bd_page_slot *bd_pages_find(struct bd_pages *p, const struct bd_pages_limits *lim,
                                   int64_t start_ms) {
    return bd_pages_start_ok(lim, start_ms) ? find(p, bucket_of(lim, start_ms)) : NULL;
}

/* Slots a sensor needs at most: every bucket of the accepted window, and a spare. */
static uint32_t window_slots(const struct bd_pages_limits *lim) {
    uint64_t n = (lim->max_late_ms + lim->max_future_ms) / lim->span_ms + 3;
    return (uint32_t)BD_MIN(n, (uint64_t)BD_PAGES_MAX_SLOTS);
}

/* Pages of p's slots and one more: p itself, grown, or (p NULL) new; NULL if out of memory. */
static struct bd_pages *grow(struct bd_pages_pool *pool, struct bd_pages *p) {
    if (p == NULL) {
        struct bd_pages *fresh = pool_alloc(pool);
        if (fresh != NULL) {
            *fresh = (struct bd_pages){
                .forgot_max = BD_PAGES_FORGOT_NONE,
                .sized_fields = BD_PAGES_UNSIZED,
            };
        }
        return fresh;
    }
    const uint32_t cap = cap_of(p->n);
    if (p->n < cap) {
        return p;
    }
    if (cap == BD_PAGES_MAX_SLOTS) {
        return NULL; /* window_slots reuses a slot before */
    }
    const size_t bytes = sizeof(*p) + (size_t)cap_of(p->n + 1) * sizeof(p->slot[0]);
    if (p->n > 1) {
        return bd_realloc(p, bytes);
    }
    /* From the pool to the heap: the pool's object is given back once copied. */
    struct bd_pages *moved = bd_malloc(bytes);
    if (moved != NULL) {
        memcpy(moved, p, BD_PAGES_ONE_SLOT_BYTES);
        pool_free(pool, p);
    }
    return moved;
}

struct bd_page_slot *bd_pages_slot(struct bd_pages_pool *pool, struct bd_pages **pp,
                                   const struct bd_pages_limits *lim, int64_t start_ms,
                                   int64_t now_ms, int64_t horizon_ms, uint64_t pinned_from) {
    struct bd_pages *p = *pp;
    const int32_t bucket = bucket_of(lim, start_ms);
    struct bd_page_slot *found = find(p, bucket);
    if (found != NULL) {
        return found;
    }
    const int64_t span = (int64_t)lim->span_ms;
    /* A bucket ending before this can no longer receive readings at now_ms. */
    const int64_t closed_before = now_ms - (int64_t)lim->max_late_ms;
    uint32_t reuse = UINT32_MAX, oldest = UINT32_MAX;
    for (uint32_t i = 0; p != NULL && i < p->n; i++) {
        const struct bd_page_slot *s = &p->slot[i];
        if ((int32_t)(s->batch - (uint32_t)pinned_from) >= 0) {
            continue; /* pinned: its batch is pinned_from or newer */
        }
        if (bd_page_slot_start_ms(s, lim) + span < closed_before && reuse == UINT32_MAX) {
            reuse = i;
        }
        if (oldest == UINT32_MAX || s->bucket < p->slot[oldest].bucket) {
            oldest = i;
        }
    }
    if (reuse == UINT32_MAX && p != NULL && p->n >= window_slots(lim)) {
        /* More buckets open than the window holds (the clock jumped): forget the oldest. */
        reuse = oldest;
    }
    struct bd_page_slot *s;
    if (reuse != UINT32_MAX) {
        s = &p->slot[reuse];
        p->forgot_max = BD_MAX(p->forgot_max, s->bucket);
    } else {
        struct bd_pages *grown = grow(pool, p);
        if (grown == NULL) {
            return NULL;
        }
        p = grown;
        *pp = p;
        s = &p->slot[p->n++];
    }
    *s = (struct bd_page_slot){
        .bucket = bucket,
        .known = start_ms > horizon_ms && start_ms > bd_pages_forgot_max_ms(p, lim),
    };
    return s;
}

void bd_pages_learn(struct bd_page_slot *s, uint32_t page, uint32_t count, uint64_t est_bytes) {
    s->page = page;
    s->count = count;
    s->bytes = (uint32_t)BD_MIN(est_bytes, UINT32_MAX);
    s->overhead = BD_PAGE_OVERHEAD_LEARNED;
    s->known = true;
}

void bd_pages_close_page(struct bd_page_slot *s) {
    BD_ASSERT(s->known);
    s->page++;
    s->count = 0;
    s->bytes = 0;
}

void bd_pages_free(struct bd_pages_pool *pool, struct bd_pages *p) {
    if (p == NULL) {
        return;
    }
    if (p->n <= 1) {
        pool_free(pool, p);
    } else {
        free(p);
    }
}
