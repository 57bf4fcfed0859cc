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
/* bd_page_slot.overhead after a look-up (see there). */
#define BD_PAGE_OVERHEAD_LEARNED UINT64_MAX

struct bd_pages_limits {
    uint64_t span_ms;
    uint64_t max_late_ms;
    uint64_t max_future_ms;
    uint32_t max_readings;
    uint64_t max_bytes; /* BD_PAGE_MAX_BYTES in the daemon */
};

struct bd_page_slot {
    int64_t start_ms;
    uint32_t page;  /* the page new readings go to (known slots) */
    uint32_t count; /* readings on that page, stored or pending; unknown slots: pending */
    uint64_t bytes; /* estimated BSON bytes of that page, overhead included once known */
    /* The page overhead (bd_pages_place's overhead_bytes) that bytes includes:
     * BD_PAGE_OVERHEAD_LEARNED after bd_pages_learn, whose estimate holds the overhead the next
     * bd_pages_place is given. */
    uint64_t overhead;
    uint64_t batch; /* the newest batch that placed readings here */
    bool known;
};

/* One sensor's open buckets (the sensor's flusher_state). */
struct bd_pages {
    uint32_t n, cap;
    int64_t forgot_max_ms; /* newest bucket start whose slot was dropped (INT64_MIN: none) */
    /* The sensor's page sizes as the flusher last worked them out, while it had sized_fields
     * field names (UINT32_MAX: not yet): a page's overhead and the largest reading's bytes. */
    uint32_t sized_fields;
    uint64_t overhead_bytes, reading_max_bytes;
    /* Bytes of the sensor's readings in the flusher's fill batch fill_id, for its share
     * (flusher_drain.c); kept here by the flusher, untouched by the functions below. */
    uint64_t fill_bytes, fill_id;
    struct bd_page_slot slot[];
};

/*
 * The slot of bucket start_ms, created if missing. A new slot reuses the slot of a bucket that
 * can no longer receive readings at now_ms, or the oldest one past the window's size (a clock
 * jump), but never one whose batch is >= pinned_from (readings in a pending batch). Buckets
 * starting at or before horizon_ms may hold pages written by an earlier run. *pp may move;
 * NULL (nothing changed) on allocation failure.
 */
struct bd_page_slot *bd_pages_slot(struct bd_pages **pp, const struct bd_pages_limits *lim,
                                   int64_t start_ms, int64_t now_ms, int64_t horizon_ms,
                                   uint64_t pinned_from);

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
    if (s->count == 0) {
        if (s->bytes < overhead_bytes) {
            s->bytes = overhead_bytes;
        }
        s->overhead = overhead_bytes;
    } else if (s->overhead == BD_PAGE_OVERHEAD_LEARNED) {
        s->overhead = overhead_bytes;
    }
    uint64_t grown = overhead_bytes > s->overhead ? overhead_bytes - s->overhead : 0;
    if (s->count > 0 &&
        (s->count >= lim->max_readings || s->bytes + grown + reading_bytes > lim->max_bytes)) {
        s->page++;
        s->count = 0;
        s->bytes = overhead_bytes;
        grown = 0;
    }
    s->count++;
    s->bytes += grown + reading_bytes;
    s->overhead = BD_MAX(s->overhead, overhead_bytes);
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
struct bd_page_slot *bd_pages_find(struct bd_pages *p, int64_t start_ms);

void bd_pages_free(struct bd_pages *p);

#endif
