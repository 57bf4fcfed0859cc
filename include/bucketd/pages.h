/*
 * Page accounting: for each sensor, the buckets that can still receive readings, and for each
 * the page new readings go to, how many readings and (estimated) bytes that page holds. A page is
 * full at buckets.max_readings readings or BD_PAGE_MAX_BYTES bytes; the next reading opens the
 * next page. These are the invariants every stored page keeps, whatever the arrival order,
 * outages or clock jumps:
 *
 *   - a slot is "known" only when its page, count and bytes include everything already stored
 *     in that bucket by this writer; readings of an unknown slot wait (in a delta with page
 *     BD_PAGE_UNKNOWN) until the flusher has read the bucket's pages back from MongoDB and
 *     calls bd_pages_learn();
 *   - a slot is created known only for a bucket nobody can have written before: newer than the
 *     look-up horizon (what earlier runs may have written) and newer than every bucket whose
 *     slot this sensor has dropped (what this run may have written);
 *   - a slot that readings of a batch still pending were placed in is never dropped, so a
 *     bucket never has two slots that disagree.
 *
 * Pure bookkeeping on the flusher thread: no I/O, no clock (now is passed in), so unit tests
 * drive it with any arrival order.
 */
#ifndef BUCKETD_PAGES_H
#define BUCKETD_PAGES_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"

/* Page of a delta whose bucket's stored pages are not known yet. */
#define BD_PAGE_UNKNOWN UINT32_MAX
/* bd_page_slot.overhead after a look-up (see there): its largest value. */
#define BD_PAGE_OVERHEAD_LEARNED ((UINT32_C(1) << 31) - 1)

struct bd_pages_limits {
    uint64_t span_ms;
    uint64_t max_late_ms;
    uint64_t max_future_ms;
    uint32_t max_readings;
    uint64_t max_bytes; /* BD_PAGE_MAX_BYTES in the daemon */
};

/*
 * Sizes are kept in 32 bits: a page holds at most BD_PAGE_MAX_BYTES (8 MiB) but for a single
 * reading (at most limits.max_line, 16 MiB), a page's overhead is names of at most 64 KiB each;
 * bytes saturates at UINT32_MAX all the same (above any max_bytes, so it decides alike).
 *
 * A slot is 24 bytes. Its bucket is kept as a bucket number, start_ms / span_ms: bucket starts
 * are multiples of the span, and with a span of at least a minute (buckets.span) every instant
 * of an int64_t of nanoseconds has a bucket number within an int32_t. Its batch is the low 32
 * bits of the batch id, compared wrap-safe: batch ids grow by one a batch, and the slots that
 * count as pinned hold the batch being written or the fill batch, at most one id apart.
 */
struct bd_page_slot {
    int32_t bucket; /* the bucket's start: bucket * span_ms */
    uint32_t batch; /* the newest batch that placed readings here (its id's low 32 bits) */
    uint32_t page;  /* the page new readings go to (known slots) */
    uint32_t count; /* readings on that page, stored or pending; unknown slots: pending */
    uint32_t bytes; /* estimated BSON bytes of that page, overhead included once known */
    /* The page overhead (bd_pages_place's overhead_bytes) that bytes includes:
     * BD_PAGE_OVERHEAD_LEARNED after bd_pages_learn, whose estimate holds the overhead the next
     * bd_pages_place is given. */
    uint32_t overhead : 31;
    uint32_t known : 1;
};

/* Largest bd_pages.n: slots a sensor can have (window_slots in pages.c is at most this). */
#define BD_PAGES_MAX_SLOTS UINT16_MAX
/* bd_pages.forgot_max when no slot was dropped yet. */
#define BD_PAGES_FORGOT_NONE INT32_MIN
/* Largest sizes bd_pages keeps (bd_pages.sized_fields): a page's overhead and a reading's bytes
 * (a sensor with larger names has them worked out on each drain instead). */
#define BD_PAGES_SIZED_OVERHEAD_MAX ((UINT32_C(1) << 25) - 1)
#define BD_PAGES_SIZED_READING_MAX UINT16_MAX

/*
 * One sensor's open buckets (the sensor's flusher_state): a 16-byte header and its slots, so
 * that the common sensor with one bucket open takes 40 bytes, an object of a struct
 * bd_pages_pool (no allocator header). A sensor with more slots is on the heap, its capacity
 * worked out from n (the slots grow 1, 2, 4, ... up to BD_PAGES_MAX_SLOTS and never shrink).
 */
struct bd_pages {
    int32_t forgot_max; /* newest bucket number whose slot was dropped (BD_PAGES_FORGOT_NONE) */
    /* Bytes of the sensor's readings in the flusher's fill batch, for its share
     * (flusher_drain.c; saturates at UINT32_MAX); kept here by the flusher, zeroed when the fill
     * batch is handed to the writer, untouched by the functions below. */
    uint32_t fill_bytes;
    /* The sensor's page sizes as the flusher last worked them out, while it had sized_fields
     * field names (BD_PAGES_UNSIZED: not yet, or too large to keep): a page's overhead and the
     * largest reading's bytes. */
    uint32_t overhead_bytes : 25;
    uint32_t sized_fields : 7;
    uint32_t reading_max_bytes : 16;
    uint32_t n : 16;
    struct bd_page_slot slot[];
};

/* What a sensor with one bucket open takes: one object of struct bd_pages_pool. */
#define BD_PAGES_ONE_SLOT_BYTES (sizeof(struct bd_pages) + sizeof(struct bd_page_slot))

/* bd_pages.sized_fields before the sizes are first worked out (a sensor has at most 64). */
#define BD_PAGES_UNSIZED 127

/*
 * The one-slot pages of the flusher's sensors, carved from chunks of BD_PAGES_POOL_CHUNK bytes
 * (at most 64 KiB, so that the allocator keeps them in its heap); a freed one goes on a free
 * list for the next sensor. Chunks are given back only by bd_pages_pool_close(). One thread
 * (the flusher's); pages with more slots are on the heap.
 */
#define BD_PAGES_POOL_CHUNK (64 * 1024 - 16)
struct bd_pages_pool {
    void *free;            /* free objects, linked through their first bytes */
    unsigned char *chunks; /* chunks, linked through their first bytes */
    unsigned char *bump;   /* the current chunk's unused part */
    size_t bump_left;
    uint64_t chunk_bytes; /* chunks allocated, in bytes */
};

void bd_pages_pool_init(struct bd_pages_pool *pool);
/* Every chunk: the pages from it must be freed (or forgotten) first. */
void bd_pages_pool_close(struct bd_pages_pool *pool);

/* A slot's bucket start, and the newest bucket start whose slot was dropped (INT64_MIN: none). */
static inline int64_t bd_page_slot_start_ms(const struct bd_page_slot *s,
                                            const struct bd_pages_limits *lim) {
    return (int64_t)s->bucket * (int64_t)lim->span_ms;
}
static inline int64_t bd_pages_forgot_max_ms(const struct bd_pages *p,
                                             const struct bd_pages_limits *lim) {
    return p->forgot_max == BD_PAGES_FORGOT_NONE ? INT64_MIN
                                                 : (int64_t)p->forgot_max * (int64_t)lim->span_ms;
}

/* Whether start_ms can be a bucket's start under lim: a multiple of the span whose bucket number
 * fits a slot (always so for bd_bucket_start_ms of a span of a minute or more). */
bool bd_pages_start_ok(const struct bd_pages_limits *lim, int64_t start_ms);

/*
 * The slot of bucket start_ms (bd_pages_start_ok), created if missing. A new slot reuses the slot
 * of a bucket that can no longer receive readings at now_ms, or the oldest one past the window's
 * size (a clock jump), but never one whose batch is pinned_from or newer (readings in a pending
 * batch; pinned_from 0: every slot). A new slot's batch is 0. Compared wrap-safe, a slot whose
 * batch is 2^31 or more before pinned_from may count as pinned: it is kept, which is always
 * safe. Buckets starting at or before horizon_ms may hold pages written by an earlier
 * run. *pp may move; NULL (nothing changed) on allocation failure. Pages of one slot come from
 * pool (the heap if NULL): free them with the same pool.
 */
struct bd_page_slot *bd_pages_slot(struct bd_pages_pool *pool, struct bd_pages **pp,
                                   const struct bd_pages_limits *lim, int64_t start_ms,
                                   int64_t now_ms, int64_t horizon_ms, uint64_t pinned_from);

/*
 * Known slot: the page a reading of reading_bytes goes to, counted in. overhead_bytes is the
 * page's size without readings (bd_page_overhead_bytes), charged when a page opens. It grows
 * while a page is open when the sensor gets a new field (the field's summary entry): the open
 * page is charged the growth with the reading that brings it, so that a page never holds more
 * than lim->max_bytes. A reading too large for any page still gets a page of its own (the
 * update builder decides whether it can be sent). Inline: the flusher calls it for every
 * reading it drains.
 */
static inline uint32_t bd_pages_place(struct bd_page_slot *s, const struct bd_pages_limits *lim,
                                      uint64_t reading_bytes, uint64_t overhead_bytes) {
    BD_ASSERT(s->known);
    /* A page's overhead is below BD_PAGE_OVERHEAD_LEARNED (its names are bounded). */
    overhead_bytes = BD_MIN(overhead_bytes, (uint64_t)BD_PAGE_OVERHEAD_LEARNED - 1);
    if (s->count == 0) {
        if (s->bytes < overhead_bytes) {
            s->bytes = (uint32_t)overhead_bytes;
        }
        s->overhead = (uint32_t)overhead_bytes;
    } else if (s->overhead == BD_PAGE_OVERHEAD_LEARNED) {
        s->overhead = (uint32_t)overhead_bytes;
    }
    uint64_t grown = overhead_bytes > s->overhead ? overhead_bytes - s->overhead : 0;
    if (s->count > 0 &&
        (s->count >= lim->max_readings || s->bytes + grown + reading_bytes > lim->max_bytes)) {
        s->page++;
        s->count = 0;
        s->bytes = (uint32_t)BD_MIN(overhead_bytes, UINT32_MAX);
        grown = 0;
    }
    s->count++;
    s->bytes = (uint32_t)BD_MIN(s->bytes + grown + reading_bytes, UINT32_MAX);
    s->overhead = (uint32_t)BD_MAX(s->overhead, overhead_bytes);
    return s->page;
}

/*
 * What MongoDB holds of the bucket: its last page and that page's readings (page 0, count 0 if
 * none), est_bytes that page's estimated size, including the overhead the caller passes to its
 * next bd_pages_place. The slot becomes known, its pending count reset: the caller places the
 * pending readings again with bd_pages_place.
 */
void bd_pages_learn(struct bd_page_slot *s, uint32_t page, uint32_t count, uint64_t est_bytes);

/* The current page cannot take more (MongoDB refused it for size): the next reading opens the
 * page after it. */
void bd_pages_close_page(struct bd_page_slot *s);

/* Find the slot of a bucket without creating it (NULL if none). */
struct bd_page_slot *bd_pages_find(struct bd_pages *p, const struct bd_pages_limits *lim,
                                   int64_t start_ms);

/* Free p (NULL: nothing), allocated by bd_pages_slot with this pool. */
void bd_pages_free(struct bd_pages_pool *pool, struct bd_pages *p);

#endif
