/*
 * Page accounting (see include/bucketd/pages.h for the invariants). Flusher thread only.
 */
#include "bucketd/pages.h"

#include <stdlib.h>

#include "bucketd/alloc.h"
#include "bucketd/common.h"

_Static_assert(sizeof(struct bd_pages) + sizeof(struct bd_page_slot) <= 56,
               "a sensor's pages with one slot fit a 64-byte malloc chunk");

struct bd_page_slot *bd_pages_find(struct bd_pages *p, int64_t start_ms) {
    for (uint32_t i = 0; p != NULL && i < p->n; i++) {
        if (p->slot[i].start_ms == start_ms) {
            return &p->slot[i];
        }
    }
    return NULL;
}

/* Slots a sensor needs at most: every bucket of the accepted window, and a spare. */
static uint32_t window_slots(const struct bd_pages_limits *lim) {
    uint64_t n = (lim->max_late_ms + lim->max_future_ms) / lim->span_ms + 3;
    return (uint32_t)BD_MIN(n, (uint64_t)BD_PAGES_MAX_SLOTS);
}

struct bd_page_slot *bd_pages_slot(struct bd_pages **pp, const struct bd_pages_limits *lim,
                                   int64_t start_ms, int64_t now_ms, int64_t horizon_ms,
                                   uint64_t pinned_from) {
    struct bd_pages *p = *pp;
    struct bd_page_slot *found = bd_pages_find(p, start_ms);
    if (found != NULL) {
        return found;
    }
    const int64_t span = (int64_t)lim->span_ms;
    /* A bucket ending before this can no longer receive readings at now_ms. */
    const int64_t closed_before = now_ms - (int64_t)lim->max_late_ms;
    uint32_t reuse = UINT32_MAX, oldest = UINT32_MAX;
    for (uint32_t i = 0; p != NULL && i < p->n; i++) {
        const struct bd_page_slot *s = &p->slot[i];
        if (s->batch >= pinned_from) {
            continue;
        }
        if (s->start_ms + span < closed_before && reuse == UINT32_MAX) {
            reuse = i;
        }
        if (oldest == UINT32_MAX || s->start_ms < p->slot[oldest].start_ms) {
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
        p->forgot_max_ms = BD_MAX(p->forgot_max_ms, s->start_ms);
    } else {
        if (p == NULL || p->n == p->cap) {
            /* Most sensors only ever have one bucket open: start with room for one. */
            if (p != NULL && p->cap == BD_PAGES_MAX_SLOTS) {
                return NULL; /* window_slots reuses a slot before */
            }
            uint32_t cap = p == NULL ? 1 : BD_MIN((uint32_t)p->cap * 2, BD_PAGES_MAX_SLOTS);
            struct bd_pages *grown = bd_realloc(p, sizeof(*p) + (size_t)cap * sizeof(p->slot[0]));
            if (grown == NULL) {
                return NULL;
            }
            if (p == NULL) {
                grown->n = 0;
                grown->forgot_max_ms = INT64_MIN;
                grown->sized_fields = BD_PAGES_UNSIZED;
                grown->overhead_bytes = 0;
                grown->reading_max_bytes = 0;
                grown->fill_bytes = 0;
            }
            grown->cap = (uint16_t)cap;
            p = grown;
            *pp = p;
        }
        s = &p->slot[p->n++];
    }
    *s = (struct bd_page_slot){
        .start_ms = start_ms,
        .known = start_ms > horizon_ms && start_ms > p->forgot_max_ms,
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

void bd_pages_free(struct bd_pages *p) {
    free(p);
}
