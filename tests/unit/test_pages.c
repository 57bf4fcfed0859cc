/*
 * Page accounting (src/pages.c): slots, their reuse and eviction, placing readings on pages,
 * learning a bucket's stored pages; then a seeded simulation of one sensor against a model of
 * the store, checking the invariants of include/bucketd/pages.h after every flush.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/common.h"
#include "bucketd/pages.h"

#define SPAN INT64_C(60000)
#define T0 INT64_C(1736949600000) /* a bucket boundary */

/* Window: (180000 + 60000) / 60000 + 3 = 7 slots. */
static const struct bd_pages_limits lim = {
    .span_ms = SPAN,
    .max_late_ms = 3 * SPAN,
    .max_future_ms = SPAN,
    .max_readings = 5,
    .max_bytes = 1000,
};
#define WINDOW 7u
#define OVERHEAD 100u

static struct bd_pages *pages;
static struct bd_pages_pool pool;

static void setup(void) {
    pages = NULL;
    bd_pages_pool_init(&pool);
}

static void teardown(void) {
    bd_alloc_fail_after(-1, 0);
    bd_pages_free(&pool, pages);
    bd_pages_pool_close(&pool);
}

TestSuite(pages, .init = setup, .fini = teardown);

/* The slot of start, which must succeed; stamped with batch as the flusher does on placing. */
static struct bd_page_slot *slot_in(int64_t start, int64_t now, int64_t horizon,
                                    uint64_t pinned_from, uint64_t batch) {
    struct bd_page_slot *s = bd_pages_slot(&pool, &pages, &lim, start, now, horizon, pinned_from);
    cr_assert_not_null(s, "slot of %" PRId64, start);
    cr_assert_eq(bd_page_slot_start_ms(s, &lim), start);
    s->batch = batch;
    return s;
}

Test(pages, nothing_yet) {
    cr_assert_null(bd_pages_find(NULL, &lim, T0));
    bd_pages_free(&pool, NULL);
}

Test(pages, first_slot) {
    struct bd_page_slot *s = bd_pages_slot(&pool, &pages, &lim, T0, T0, T0 - SPAN, 1);
    cr_assert_not_null(s);
    cr_assert_not_null(pages);
    cr_assert_eq(pages->n, 1);
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), INT64_MIN, "nothing dropped yet");
    cr_assert_eq(bd_page_slot_start_ms(s, &lim), T0);
    cr_assert_eq(s->page, 0);
    cr_assert_eq(s->count, 0);
    cr_assert_eq(s->bytes, 0);
    cr_assert_eq(s->batch, 0);
    cr_assert(s->known);
    cr_assert_eq(bd_pages_find(pages, &lim, T0), s);
    cr_assert_null(bd_pages_find(pages, &lim, T0 + SPAN));
}

/* Known only for buckets newer than the look-up horizon: an earlier run may have written them. */
Test(pages, known_only_after_the_horizon) {
    const int64_t horizon = T0;
    cr_assert(!slot_in(T0 - SPAN, T0, horizon, 1, 0)->known, "before the horizon");
    cr_assert(!slot_in(T0, T0, horizon, 1, 0)->known, "at the horizon");
    cr_assert(slot_in(T0 + SPAN, T0, horizon, 1, 0)->known, "after the horizon");
    cr_assert(slot_in(T0 + 2 * SPAN, T0, horizon, 1, 0)->known);
    cr_assert_eq(pages->n, 4);
}

/* An existing slot is returned as it is, whatever the arguments of the later call. */
Test(pages, existing_slot_is_kept) {
    struct bd_page_slot *s = slot_in(T0, T0, T0 - SPAN, 1, 1);
    bd_pages_place(s, &lim, 50, OVERHEAD);
    bd_pages_place(s, &lim, 50, OVERHEAD);
    struct bd_page_slot *again =
        bd_pages_slot(&pool, &pages, &lim, T0, T0 + 100 * SPAN, T0 + SPAN, 9);
    cr_assert_eq(again, s);
    cr_assert(again->known, "a later horizon does not make a known slot unknown");
    cr_assert_eq(again->count, 2);
    cr_assert_eq(again->bytes, OVERHEAD + 100);
    cr_assert_eq(pages->n, 1);
}

/*
 * A bucket that can no longer receive readings (start + span < now - max_late) gives its slot
 * to a new bucket; the dropped bucket is then remembered in forgot_max_ms, and a slot for it or
 * any older bucket is created unknown: this run may have written it.
 */
Test(pages, closed_buckets_are_reused) {
    const int64_t a = T0, b = T0 + SPAN;
    slot_in(a, a, T0 - SPAN, 2, 1);
    slot_in(b, b, T0 - SPAN, 2, 1);
    cr_assert_eq(pages->n, 2);
    /* closed_before = now - max_late = a + 4 spans + 1: both a and b are closed. */
    const int64_t now = a + 7 * SPAN + 1;
    struct bd_page_slot *c = slot_in(T0 + 6 * SPAN, now, T0 - SPAN, 2, 2);
    cr_assert_eq(pages->n, 2, "reused, not grown");
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), a);
    cr_assert(c->known, "newer than every dropped bucket");
    cr_assert_null(bd_pages_find(pages, &lim, a));
    cr_assert_not_null(bd_pages_find(pages, &lim, b));

    /* The dropped bucket comes back (a late reading, a clock jump): its pages are unknown. */
    struct bd_page_slot *again = slot_in(a, now, T0 - SPAN, 3, 3);
    cr_assert_eq(pages->n, 2, "b's slot was reused");
    cr_assert_null(bd_pages_find(pages, &lim, b));
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), b);
    cr_assert(!again->known, "a was written by this run");
    cr_assert_eq(again->count, 0);

    /* A bucket never seen, older than a dropped one: unknown too (a's slot goes now). */
    struct bd_page_slot *older = slot_in(a - SPAN, now, T0 - 10 * SPAN, 4, 4);
    cr_assert(!older->known);
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), b, "forgot_max_ms only grows");
    cr_assert_null(bd_pages_find(pages, &lim, a));

    /* A bucket never seen, newer than every dropped one: known. */
    struct bd_page_slot *newer = slot_in(b + SPAN, now, T0 - 10 * SPAN, 5, 5);
    cr_assert(newer->known);
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), b);
    cr_assert_eq(pages->n, 2);
}

/* A bucket that a reading at now - max_late still falls in keeps its slot. */
Test(pages, open_buckets_are_not_reused) {
    const int64_t x = T0 + 6 * SPAN;
    /* closed_before = now - max_late = x + span - 1: a reading at closed_before lands in x. */
    const int64_t now = x + SPAN - 1 + 3 * SPAN;
    slot_in(x, now, T0, 5, 1);
    slot_in(T0 + 9 * SPAN, now, T0, 5, 1);
    slot_in(T0 + 10 * SPAN, now, T0, 5, 1);
    cr_assert_eq(pages->n, 3, "nothing closed yet, nothing reused");
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), INT64_MIN);
    /* 2 ms later x has closed: the next new bucket takes its slot. */
    slot_in(T0 + 11 * SPAN, now + 2, T0, 5, 1);
    cr_assert_eq(pages->n, 3);
    cr_assert_null(bd_pages_find(pages, &lim, x));
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), x);
}

/* Slots holding readings of the batch being filled (batch >= pinned_from) are never reused. */
Test(pages, pinned_slots_are_not_reused) {
    slot_in(T0, T0, T0 - SPAN, 1, 4);
    slot_in(T0 + SPAN, T0, T0 - SPAN, 1, 5);
    const int64_t now = T0 + 100 * SPAN; /* both closed */
    slot_in(T0 + 100 * SPAN, now, T0 - SPAN, 4, 5);
    cr_assert_eq(pages->n, 3, "batches 4 and 5 are pending: pinned, so the pages grow");
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), INT64_MIN);
    slot_in(T0 + 99 * SPAN, now, T0 - SPAN, 5, 5);
    cr_assert_eq(pages->n, 3, "batch 4 is settled: its slot is reused");
    cr_assert_null(bd_pages_find(pages, &lim, T0));
    cr_assert_not_null(bd_pages_find(pages, &lim, T0 + SPAN));
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), T0);
}

/* Fill the window with open buckets (the clock jumped back) given in no particular order. */
static void fill_window(uint64_t batch) {
    static const int order[WINDOW] = {3, 0, 6, 1, 5, 2, 4};
    for (uint32_t i = 0; i < WINDOW; i++) {
        slot_in(T0 + order[i] * SPAN, T0, T0 - SPAN, 1, batch);
    }
    cr_assert_eq(pages->n, WINDOW);
}

/* More buckets open than the window holds: the oldest unpinned one is forgotten. */
Test(pages, window_overflow_evicts_the_oldest_unpinned) {
    fill_window(1);
    struct bd_page_slot *s = slot_in(T0 + 7 * SPAN, T0, T0 - SPAN, 2, 2);
    cr_assert_eq(pages->n, WINDOW, "evicted, not grown");
    cr_assert_null(bd_pages_find(pages, &lim, T0), "the oldest went");
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), T0);
    cr_assert(s->known);

    /* The oldest is pinned now (T0 + SPAN, batch 2): the next oldest goes instead. */
    bd_pages_find(pages, &lim, T0 + SPAN)->batch = 2;
    s = slot_in(T0 - SPAN, T0, T0 - 2 * SPAN, 2, 2);
    cr_assert_eq(pages->n, WINDOW);
    cr_assert_not_null(bd_pages_find(pages, &lim, T0 + SPAN), "pinned");
    cr_assert_null(bd_pages_find(pages, &lim, T0 + 2 * SPAN));
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), T0 + 2 * SPAN);
    cr_assert(!s->known, "older than a dropped bucket");
    struct bd_page_slot *back = slot_in(T0 + 2 * SPAN, T0, T0 - 2 * SPAN, 3, 3);
    cr_assert(!back->known, "the dropped bucket itself");
}

/* Every slot pinned: the pages grow past the window rather than drop a pending bucket. */
Test(pages, growth_when_all_pinned) {
    fill_window(3);
    for (uint32_t i = 0; i < 3; i++) {
        slot_in(T0 + (10 + i) * SPAN, T0 + 100 * SPAN, T0 - SPAN, 3, 3);
    }
    cr_assert_eq(pages->n, WINDOW + 3);
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), INT64_MIN);
    for (int64_t k = 0; k < 7; k++) {
        cr_assert_not_null(bd_pages_find(pages, &lim, T0 + k * SPAN), "bucket %" PRId64, k);
    }
    for (int64_t k = 10; k < 13; k++) {
        cr_assert_not_null(bd_pages_find(pages, &lim, T0 + k * SPAN), "bucket %" PRId64, k);
    }
}

/* A window of 2^33 buckets: more slots than a uint32_t counts. */
static const struct bd_pages_limits wide = {
    .span_ms = SPAN,
    .max_late_ms = (UINT64_C(1) << 33) * SPAN,
    .max_future_ms = 0,
    .max_readings = 5,
    .max_bytes = 1000,
};

/* A window of more slots than a uint32_t counts is capped, not wrapped to a handful. */
Test(pages, huge_window) {
    for (int64_t k = 0; k < 8; k++) {
        struct bd_page_slot *s = bd_pages_slot(&pool, &pages, &wide, T0 + k * SPAN, T0, T0 - 1, 1);
        cr_assert_not_null(s);
        s->batch = 0;
    }
    cr_assert_eq(pages->n, 8, "nothing evicted");
    cr_assert_eq(bd_pages_forgot_max_ms(pages, &lim), INT64_MIN);
}

Test(pages, allocation_failure_changes_nothing) {
    bd_alloc_fail_after(0, 0);
    cr_assert_null(bd_pages_slot(&pool, &pages, &lim, T0, T0, T0 - SPAN, 1));
    cr_assert_null(pages, "no pages yet");

    slot_in(T0, T0, T0 - SPAN, 1, 1);
    slot_in(T0 + SPAN, T0, T0 - SPAN, 1, 1);
    struct bd_pages *before = pages;
    const uint32_t n = pages->n;
    cr_assert_eq(n, 2, "full (room for 1, 2, 4, ...): the next new slot grows the pages");
    bd_alloc_fail_after(0, 0);
    cr_assert_null(bd_pages_slot(&pool, &pages, &lim, T0 + 2 * SPAN, T0, T0 - SPAN, 1));
    cr_assert_eq(pages, before);
    cr_assert_eq(pages->n, n);
    cr_assert_null(bd_pages_find(pages, &lim, T0 + 2 * SPAN));

    /* Reusing a slot allocates nothing: it succeeds while allocations fail. */
    bd_alloc_fail_after(0, 1);
    struct bd_page_slot *s =
        bd_pages_slot(&pool, &pages, &lim, T0 + 100 * SPAN, T0 + 100 * SPAN, T0 - SPAN, 2);
    bd_alloc_fail_after(-1, 0);
    cr_assert_not_null(s);
    cr_assert_eq(pages->n, n);
}

/* A sensor's second bucket moves its pages from the pool to the heap: when that allocation fails,
 * the pages stay the pool's object, whole, and the pool keeps it. */
Test(pages, a_failed_move_to_the_heap_keeps_the_pool_object) {
    struct bd_page_slot *first = slot_in(T0, T0, T0 - SPAN, 1, 1);
    first->count = 3;
    struct bd_pages *before = pages;
    const uint64_t chunk_bytes = pool.chunk_bytes;
    bd_alloc_fail_after(0, 0);
    cr_assert_null(bd_pages_slot(&pool, &pages, &lim, T0 + SPAN, T0, T0 - SPAN, 1));
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(pages, before, "still the pool's object");
    cr_assert_eq(pages->n, 1);
    cr_assert_eq(bd_pages_find(pages, &lim, T0)->count, 3);
    cr_assert_null(bd_pages_find(pages, &lim, T0 + SPAN));
    /* Once memory is back, the move happens and the object is reused by the next sensor. */
    slot_in(T0 + SPAN, T0, T0 - SPAN, 1, 1);
    cr_assert_neq(pages, before, "on the heap");
    cr_assert_eq(bd_pages_find(pages, &lim, T0)->count, 3);
    struct bd_pages *other = NULL;
    cr_assert_not_null(bd_pages_slot(&pool, &other, &lim, T0, T0, T0 - SPAN, 1));
    cr_assert_eq(other, before, "the freed object is the next one handed out");
    cr_assert_eq(pool.chunk_bytes, chunk_bytes, "no new chunk");
    bd_pages_free(&pool, other);
}

/* A slot of the given state, known, as after a look-up. */
static struct bd_page_slot known_slot(uint32_t page, uint32_t count, uint64_t bytes) {
    struct bd_page_slot s = {.bucket = (int32_t)(T0 / SPAN)};
    bd_pages_learn(&s, page, count, bytes);
    return s;
}

Test(pages, place_moves_on_at_max_readings) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    for (uint32_t i = 1; i <= lim.max_readings; i++) {
        cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 0, "reading %u", i);
        cr_assert_eq(s.count, i);
    }
    cr_assert_eq(s.bytes, OVERHEAD + 10 * lim.max_readings, "the overhead is charged once");
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 1);
    cr_assert_eq(s.count, 1);
    cr_assert_eq(s.bytes, OVERHEAD + 10);
    for (uint32_t i = 2; i <= lim.max_readings; i++) {
        cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 1);
    }
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 2);
}

Test(pages, place_moves_on_before_max_bytes) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    /* 100 + 3 * 300 = 1000 = max_bytes: fits exactly. */
    cr_assert_eq(bd_pages_place(&s, &lim, 300, OVERHEAD), 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 300, OVERHEAD), 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 300, OVERHEAD), 0);
    cr_assert_eq(s.bytes, lim.max_bytes);
    cr_assert_eq(bd_pages_place(&s, &lim, 1, OVERHEAD), 1, "one byte more would pass max_bytes");
    cr_assert_eq(s.bytes, OVERHEAD + 1);
    cr_assert_eq(s.count, 1);
}

/* A reading larger than any page still gets a page, of its own. */
Test(pages, oversized_reading_gets_a_page_of_its_own) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 5000, OVERHEAD), 0, "first on an empty page");
    cr_assert_eq(s.count, 1);
    cr_assert_eq(s.bytes, OVERHEAD + 5000);
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 1, "nothing joins it");
    cr_assert_eq(bd_pages_place(&s, &lim, 5000, OVERHEAD), 2, "it leaves a page with readings");
    cr_assert_eq(bd_pages_place(&s, &lim, 5000, OVERHEAD), 3);
    cr_assert_eq(s.count, 1);
}

/*
 * A sensor's new field brings a summary entry to every page it lands on: the overhead grows
 * while a page is open, and the open page is charged the growth (the page document would pass
 * max_bytes otherwise).
 */
Test(pages, place_charges_the_overhead_a_new_field_adds_to_an_open_page) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 100, OVERHEAD), 0);
    cr_assert_eq(s.bytes, OVERHEAD + 100);
    /* A reading with a new long field name: its summary entry adds 500 to the overhead. */
    cr_assert_eq(bd_pages_place(&s, &lim, 100, OVERHEAD + 500), 0);
    cr_assert_eq(s.bytes, OVERHEAD + 500 + 200, "the open page is charged the growth");
    /* Charged once: the same overhead again adds only the reading. */
    cr_assert_eq(bd_pages_place(&s, &lim, 50, OVERHEAD + 500), 0);
    cr_assert_eq(s.bytes, OVERHEAD + 500 + 250);
    /* Growth and reading together pass max_bytes (1000): the next page, charged in full. */
    cr_assert_eq(bd_pages_place(&s, &lim, 60, OVERHEAD + 600), 1);
    cr_assert_eq(s.count, 1);
    cr_assert_eq(s.bytes, OVERHEAD + 600 + 60);

    /* After a look-up the learned estimate holds the overhead of the next placement. */
    s = known_slot(3, 2, 600);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD + 300), 3);
    cr_assert_eq(s.bytes, 620, "the learned size already holds this overhead");
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD + 400), 3);
    cr_assert_eq(s.bytes, 740, "growth after the look-up is charged");
}

Test(pages, learn_then_place) {
    /* A partly filled last page: readings join it until it is full. */
    struct bd_page_slot s = known_slot(3, 4, 500);
    cr_assert(s.known);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 3);
    cr_assert_eq(s.count, 5);
    cr_assert_eq(s.bytes, 520, "the learned size already holds the overhead");
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 4);

    /* A full last page: the next reading opens the next one. */
    s = known_slot(2, lim.max_readings, 300);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 3);
    cr_assert_eq(s.bytes, OVERHEAD + 20);

    /* A page over max_readings (an earlier configuration): the same. */
    s = known_slot(0, lim.max_readings + 3, 300);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 1);

    /* A last page near max_bytes. */
    s = known_slot(1, 2, 990);
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 1);
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 2);

    /* A stored page without readings keeps its estimated size. */
    s = known_slot(2, 0, 150);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 2);
    cr_assert_eq(s.bytes, 170);

    /* Nothing stored: page 0, charged its overhead. */
    s = known_slot(0, 0, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 20, OVERHEAD), 0);
    cr_assert_eq(s.bytes, OVERHEAD + 20);
}

/* The pending readings of an unknown slot are forgotten by learn: the caller places them. */
Test(pages, learn_makes_an_unknown_slot_known) {
    struct bd_page_slot *s = slot_in(T0, T0, T0, 1, 1);
    cr_assert(!s->known);
    s->count += 3; /* as the flusher counts pending readings */
    s->bytes += 90;
    bd_pages_learn(s, 7, 2, 250);
    cr_assert(s->known);
    cr_assert_eq(s->page, 7);
    cr_assert_eq(s->count, 2);
    cr_assert_eq(s->bytes, 250);
    cr_assert_eq(s->batch, 1, "learn leaves the batch alone");
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(bd_pages_place(s, &lim, 30, OVERHEAD), 7);
    }
    cr_assert_eq(bd_pages_place(s, &lim, 30, OVERHEAD), 8);
}

Test(pages, close_page) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    bd_pages_place(&s, &lim, 30, OVERHEAD);
    bd_pages_place(&s, &lim, 30, OVERHEAD);
    bd_pages_close_page(&s);
    cr_assert_eq(s.page, 1);
    cr_assert_eq(s.count, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 30, OVERHEAD), 1);
    cr_assert_eq(s.count, 1);
    cr_assert_eq(s.bytes, OVERHEAD + 30, "a new page is charged its overhead");

    /* Closing a page just learned. */
    s = known_slot(4, 1, 200);
    bd_pages_close_page(&s);
    cr_assert_eq(bd_pages_place(&s, &lim, 30, OVERHEAD), 5);
}

Test(pages, place_needs_a_known_slot, .signal = SIGABRT) {
    struct bd_page_slot s = {.bucket = (int32_t)(T0 / SPAN)};
    bd_pages_place(&s, &lim, 30, OVERHEAD);
}

Test(pages, close_page_needs_a_known_slot, .signal = SIGABRT) {
    struct bd_page_slot s = {.bucket = (int32_t)(T0 / SPAN)};
    bd_pages_close_page(&s);
}

/* ---- property test: one sensor against a model of the store ------------------------------ */

/*
 * The simulation plays the flusher and MongoDB. Readings arrive with timestamps around a
 * wall clock that advances, stalls in outages (no flush for a while, time moving on), and jumps
 * back and forth. A reading whose slot is known is placed at once; one whose slot is unknown
 * waits for the flush. A flush looks up each waiting bucket in the model (its last page and that
 * page's readings and size: what the real look-up returns), learns it, places the waiting
 * readings, sometimes has a page refused for size (close_page, the readings placed again), and
 * commits everything to the model. After each flush the model must show: no page over
 * max_readings, no page of two or more readings over max_bytes, every reading stored once, and
 * every known slot in agreement with what is stored.
 */

#define SIM_BUCKETS 16384
#define SIM_BASE (T0 - INT64_C(4000) * SPAN)

struct sim_page {
    uint32_t count;
    uint64_t bytes;
};

struct sim_bucket {
    uint32_t n_pages, cap;
    struct sim_page *page;
};

struct sim_reading {
    int64_t start;
    uint32_t page; /* BD_PAGE_UNKNOWN while waiting for a look-up */
    uint64_t bytes;
};

struct sim {
    uint64_t rng;
    struct bd_pages_limits lim;
    uint32_t window;
    uint64_t overhead;
    int64_t now, horizon;
    uint64_t batch;
    struct bd_pages *pages;
    struct sim_bucket *buckets;
    struct sim_reading *pending;
    size_t n_pending, cap_pending;
    uint64_t generated, stored;
    uint32_t lo, hi; /* buckets the model holds pages in: [lo, hi] */
    /* What happened, to show the simulation reaches every case. */
    uint64_t n_unknown, n_learned, n_relocated, n_grown_past_window, n_flushes, max_slots;
};

static uint64_t rnd(struct sim *s) {
    /* splitmix64: small, seedable, good enough to pick steps. */
    uint64_t z = (s->rng += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static int64_t below(struct sim *s, int64_t n) {
    return n <= 0 ? 0 : (int64_t)(rnd(s) % (uint64_t)n);
}

static struct sim_bucket *bucket_of(struct sim *s, int64_t start) {
    int64_t i = (start - SIM_BASE) / SPAN;
    cr_assert(start % SPAN == 0 && i >= 0 && i < SIM_BUCKETS, "bucket %" PRId64 " out of range",
              start);
    return &s->buckets[i];
}

static struct sim_page *page_of(struct sim *s, int64_t start, uint32_t page) {
    struct sim_bucket *b = bucket_of(s, start);
    if (page >= b->cap) {
        uint32_t cap = BD_MAX(page + 1, b->cap * 2);
        b->page = realloc(b->page, cap * sizeof(*b->page));
        cr_assert_not_null(b->page);
        memset(b->page + b->cap, 0, (cap - b->cap) * sizeof(*b->page));
        b->cap = cap;
    }
    b->n_pages = BD_MAX(b->n_pages, page + 1);
    uint32_t i = (uint32_t)((start - SIM_BASE) / SPAN);
    s->lo = BD_MIN(s->lo, i);
    s->hi = BD_MAX(s->hi, i);
    return &b->page[page];
}

static void store(struct sim *s, int64_t start, uint32_t page, uint64_t bytes) {
    struct sim_page *p = page_of(s, start, page);
    if (p->count == 0) {
        p->bytes = s->overhead;
    }
    p->count++;
    p->bytes += bytes;
    s->stored++;
}

/* What a look-up of the bucket returns: its last page with readings (page 0, count 0: none). */
static void look_up(struct sim *s, int64_t start, uint32_t *page, uint32_t *count,
                    uint64_t *bytes) {
    const struct sim_bucket *b = bucket_of(s, start);
    *page = 0;
    *count = 0;
    *bytes = 0;
    for (uint32_t i = b->n_pages; i-- > 0;) {
        if (b->page[i].count > 0) {
            *page = i;
            *count = b->page[i].count;
            *bytes = b->page[i].bytes;
            return;
        }
    }
}

static void push_pending(struct sim *s, int64_t start, uint32_t page, uint64_t bytes) {
    if (s->n_pending == s->cap_pending) {
        s->cap_pending = s->cap_pending == 0 ? 256 : s->cap_pending * 2;
        s->pending = realloc(s->pending, s->cap_pending * sizeof(*s->pending));
        cr_assert_not_null(s->pending);
    }
    s->pending[s->n_pending++] = (struct sim_reading){start, page, bytes};
}

/* Pages an earlier run left in buckets up to the horizon. */
static void earlier_run(struct sim *s) {
    const int64_t last = s->horizon - s->horizon % SPAN;
    for (int64_t start = last - 40 * SPAN; start <= last; start += SPAN) {
        if (below(s, 10) < 3) {
            continue;
        }
        uint32_t n = 1 + (uint32_t)below(s, 4);
        for (uint32_t p = 0; p < n; p++) {
            uint32_t count = p + 1 < n ? s->lim.max_readings : 1 + (uint32_t)below(s, 3);
            for (uint32_t r = 0; r < count; r++) {
                store(s, start, p, 40 + (uint64_t)below(s, 80));
                s->generated++;
            }
        }
    }
}

static void place_reading(struct sim *s, int64_t seed, int step) {
    int64_t ts;
    int64_t kind = below(s, 100);
    if (kind < 2) {
        ts = s->now - below(s, 60 * SPAN); /* a straggler from long ago */
    } else if (kind < 12) {
        ts = s->now + below(s, (int64_t)s->lim.max_future_ms + 1);
    } else {
        /* Late up to max_late, and a little more: the ingest clock ran ahead of ours. */
        ts = s->now - below(s, (int64_t)s->lim.max_late_ms + 5000);
    }
    const int64_t start = ts - ts % SPAN;
    uint64_t bytes = 40 + (uint64_t)below(s, 160);
    if (below(s, 100) == 0) {
        bytes = s->lim.max_bytes + 200; /* too large for any page */
    }
    const uint32_t n_before = s->pages != NULL ? s->pages->n : 0;
    struct bd_page_slot *slot =
        bd_pages_slot(&pool, &s->pages, &s->lim, start, s->now, s->horizon, s->batch);
    cr_assert_not_null(slot, "seed %" PRId64 " step %d", seed, step);
    cr_assert_eq(bd_page_slot_start_ms(slot, &s->lim), start);
    if (s->pages->n > n_before && n_before >= s->window) {
        /* Grown past the window: only when every other slot holds pending readings. */
        for (uint32_t i = 0; i < s->pages->n; i++) {
            const struct bd_page_slot *o = &s->pages->slot[i];
            cr_assert(o == slot || o->batch >= s->batch,
                      "seed %" PRId64 " step %d: grew to %u slots past an unpinned one", seed, step,
                      s->pages->n);
        }
        s->n_grown_past_window++;
    }
    s->max_slots = BD_MAX(s->max_slots, s->pages->n);
    if (slot->known) {
        push_pending(s, start, bd_pages_place(slot, &s->lim, bytes, s->overhead), bytes);
    } else {
        slot->count++;
        slot->bytes += bytes;
        push_pending(s, start, BD_PAGE_UNKNOWN, bytes);
        s->n_unknown++;
    }
    slot->batch = s->batch;
    s->generated++;
}

static void check_model(struct sim *s, int64_t seed, int step) {
    cr_assert_eq(s->stored, s->generated,
                 "seed %" PRId64 " step %d: %" PRIu64 " readings stored, %" PRIu64 " generated",
                 seed, step, s->stored, s->generated);
    for (uint32_t i = s->lo; i <= s->hi && i < SIM_BUCKETS; i++) {
        const struct sim_bucket *b = &s->buckets[i];
        for (uint32_t p = 0; p < b->n_pages; p++) {
            const struct sim_page *pg = &b->page[p];
            cr_assert_leq(pg->count, s->lim.max_readings,
                          "seed %" PRId64 " step %d: bucket %" PRId64 " page %u holds %u readings",
                          seed, step, SIM_BASE + i * SPAN, p, pg->count);
            cr_assert(pg->count <= 1 || pg->bytes <= s->lim.max_bytes,
                      "seed %" PRId64 " step %d: bucket %" PRId64 " page %u holds %" PRIu64
                      " bytes in %u readings",
                      seed, step, SIM_BASE + i * SPAN, p, pg->bytes, pg->count);
        }
    }
    /* A known slot's page, count and bytes include everything stored in its bucket. */
    for (uint32_t i = 0; s->pages != NULL && i < s->pages->n; i++) {
        const struct bd_page_slot *sl = &s->pages->slot[i];
        cr_assert(sl->known, "seed %" PRId64 " step %d: slot %" PRId64 " unknown after a flush",
                  seed, step, bd_page_slot_start_ms(sl, &s->lim));
        uint32_t page, count;
        uint64_t bytes;
        look_up(s, bd_page_slot_start_ms(sl, &s->lim), &page, &count, &bytes);
        if (count == 0) {
            cr_assert_eq(sl->count, 0, "seed %" PRId64 " step %d: slot %" PRId64, seed, step,
                         bd_page_slot_start_ms(sl, &s->lim));
            continue;
        }
        cr_assert(sl->page > page || (sl->page == page && sl->count == count && sl->bytes == bytes),
                  "seed %" PRId64 " step %d: slot %" PRId64 " at page %u (%u readings, %" PRIu64
                  " bytes), stored: page %u (%u readings, %" PRIu64 " bytes)",
                  seed, step, bd_page_slot_start_ms(sl, &s->lim), sl->page, sl->count, sl->bytes,
                  page, count, bytes);
        cr_assert(sl->page == page || sl->count == 0,
                  "seed %" PRId64 " step %d: slot %" PRId64 " counts readings not stored", seed,
                  step, bd_page_slot_start_ms(sl, &s->lim));
    }
}

static void flush(struct sim *s, int64_t seed, int step) {
    /* Every bucket with pending readings still has its slot. */
    for (size_t i = 0; i < s->n_pending; i++) {
        struct bd_page_slot *slot = bd_pages_find(s->pages, &s->lim, s->pending[i].start);
        cr_assert_not_null(slot,
                           "seed %" PRId64 " step %d: the slot of %" PRId64
                           " was dropped with readings pending",
                           seed, step, s->pending[i].start);
        cr_assert_eq(slot->batch, s->batch);
    }
    /* Look up and learn each waiting bucket, then place its readings in arrival order. */
    for (size_t i = 0; i < s->n_pending; i++) {
        const int64_t start = s->pending[i].start;
        if (s->pending[i].page != BD_PAGE_UNKNOWN) {
            continue;
        }
        struct bd_page_slot *slot = bd_pages_find(s->pages, &s->lim, start);
        cr_assert(!slot->known, "seed %" PRId64 " step %d: waiting readings, known slot", seed,
                  step);
        uint32_t page, count;
        uint64_t bytes;
        look_up(s, start, &page, &count, &bytes);
        bd_pages_learn(slot, page, count, bytes);
        s->n_learned++;
        for (size_t j = i; j < s->n_pending; j++) {
            if (s->pending[j].start == start && s->pending[j].page == BD_PAGE_UNKNOWN) {
                s->pending[j].page =
                    bd_pages_place(slot, &s->lim, s->pending[j].bytes, s->overhead);
            }
        }
    }
    /* Sometimes a page is refused for size: its readings move after the bucket's last page. */
    if (s->n_pending > 0 && below(s, 4) == 0) {
        const struct sim_reading victim = s->pending[below(s, (int64_t)s->n_pending)];
        struct bd_page_slot *slot = bd_pages_find(s->pages, &s->lim, victim.start);
        bd_pages_close_page(slot);
        for (size_t j = 0; j < s->n_pending; j++) {
            struct sim_reading *r = &s->pending[j];
            if (r->start == victim.start && r->page == victim.page) {
                r->page = bd_pages_place(slot, &s->lim, r->bytes, s->overhead);
                cr_assert_gt(r->page, victim.page);
            }
        }
        s->n_relocated++;
    }
    for (size_t i = 0; i < s->n_pending; i++) {
        store(s, s->pending[i].start, s->pending[i].page, s->pending[i].bytes);
    }
    s->n_pending = 0;
    s->batch++;
    s->n_flushes++;
    check_model(s, seed, step);
}

static void simulate(int64_t seed, int steps) {
    struct sim s = {
        .rng = (uint64_t)seed,
        .lim = {.span_ms = SPAN,
                .max_late_ms = (2 + (uint64_t)seed % 3) * SPAN,
                .max_future_ms = SPAN,
                .max_readings = 5 + (uint32_t)(seed % 3),
                .max_bytes = 1000},
        .overhead = 120,
        .now = T0 + 17,
        .batch = 1,
        .lo = UINT32_MAX,
    };
    s.window = (uint32_t)((s.lim.max_late_ms + s.lim.max_future_ms) / SPAN + 3);
    s.horizon = s.now + (int64_t)s.lim.max_future_ms;
    s.buckets = calloc(SIM_BUCKETS, sizeof(*s.buckets));
    cr_assert_not_null(s.buckets);
    earlier_run(&s);
    const int64_t lowest = T0 - 2000 * SPAN, highest = T0 + 10000 * SPAN;
    int outage = 0;

    for (int step = 0; step < steps; step++) {
        int64_t event = below(&s, 1000);
        if (event < 3 && outage == 0) {
            /* The store is unreachable for a while; time moves on past span + max_late. */
            outage = 50 + (int)below(&s, 300);
            s.now += SPAN + (int64_t)s.lim.max_late_ms + below(&s, 3 * SPAN);
        } else if (event < 6) {
            s.now -= 1 + below(&s, 10 * SPAN); /* the clock jumps back */
        } else if (event < 9) {
            s.now += 1 + below(&s, 20 * SPAN); /* and forward */
        }
        s.now += below(&s, outage > 0 ? 4000 : 2000);
        if (s.now < lowest || s.now > highest) {
            s.now = T0 + below(&s, 100 * SPAN);
        }
        if (outage > 0) {
            outage--;
        }
        if (outage == 0 && below(&s, 12) == 0) {
            flush(&s, seed, step);
        } else {
            place_reading(&s, seed, step);
        }
    }
    flush(&s, seed, steps);

    /* The run must have reached the cases it is meant to test. */
    cr_assert_gt(s.n_unknown, 0, "seed %" PRId64 ": no unknown slot", seed);
    cr_assert_gt(s.n_relocated, 0, "seed %" PRId64 ": no page refused", seed);
    cr_assert_gt(s.n_grown_past_window, 0, "seed %" PRId64 ": never grew past the window", seed);
    cr_assert_gt(bd_pages_forgot_max_ms(s.pages, &s.lim), INT64_MIN,
                 "seed %" PRId64 ": nothing forgotten", seed);

    cr_log_info("seed %" PRId64 ": %" PRIu64 " readings, %" PRIu64 " flushes, %" PRIu64
                " waited for a look-up, %" PRIu64 " look-ups, %" PRIu64 " pages refused, %" PRIu64
                " times grown past the window, up to %" PRIu64 " slots",
                seed, s.generated, s.n_flushes, s.n_unknown, s.n_learned, s.n_relocated,
                s.n_grown_past_window, s.max_slots);
    for (uint32_t i = 0; i < SIM_BUCKETS; i++) {
        free(s.buckets[i].page);
    }
    free(s.buckets);
    free(s.pending);
    bd_pages_free(&pool, s.pages);
}

Test(pages, simulation_keeps_the_invariants) {
    static const int64_t seeds[] = {1, 2, 3, 42, 1234, 99991, 20250115, 7777777};
    for (size_t i = 0; i < BD_ARRAY_LEN(seeds); i++) {
        simulate(seeds[i], 6000);
    }
}

/* ---- The compact form: 16 bytes of pages and 24 a slot, from a pool ---------------------- */

/* A sensor with one bucket open takes 40 bytes of a pool chunk, without an allocator header. */
Test(pages, one_slot_takes_40_bytes_of_the_pool) {
    cr_assert_eq(sizeof(struct bd_pages), 16);
    cr_assert_eq(sizeof(struct bd_page_slot), 24);
    cr_assert_eq(BD_PAGES_ONE_SLOT_BYTES, 40);
    slot_in(T0, T0, T0 - SPAN, 1, 1);
    cr_assert_eq(pages->n, 1, "one slot to start with");
    cr_assert_eq(pages->fill_bytes, 0);
    cr_assert_eq(pages->sized_fields, BD_PAGES_UNSIZED);
    cr_assert_eq(pool.chunk_bytes, BD_PAGES_POOL_CHUNK);
    /* The next sensors' pages follow in the same chunk, 40 bytes apart. */
    struct bd_pages *other[3] = {NULL};
    for (int i = 0; i < 3; i++) {
        cr_assert_not_null(bd_pages_slot(&pool, &other[i], &lim, T0, T0, T0 - SPAN, 1));
        cr_assert_eq((char *)other[i] - (char *)(i == 0 ? pages : other[i - 1]),
                     BD_PAGES_ONE_SLOT_BYTES);
    }
    cr_assert_eq(pool.chunk_bytes, BD_PAGES_POOL_CHUNK);
    /* A freed one is the next one handed out. */
    struct bd_pages *was = other[1];
    bd_pages_free(&pool, other[1]);
    other[1] = NULL;
    cr_assert_not_null(bd_pages_slot(&pool, &other[1], &lim, T0 + SPAN, T0, T0 - SPAN, 1));
    cr_assert_eq(other[1], was);
    cr_assert_eq(other[1]->n, 1);
    cr_assert_eq(bd_pages_forgot_max_ms(other[1], &lim), INT64_MIN, "starts afresh");
    cr_assert_not_null(bd_pages_find(other[1], &lim, T0 + SPAN));
    cr_assert_null(bd_pages_find(other[1], &lim, T0));
    for (int i = 0; i < 3; i++) {
        bd_pages_free(&pool, other[i]);
    }
}

/* A second slot moves the pages to the heap, every field kept, and gives the pool its object
 * back; freeing them then goes to the heap. */
Test(pages, a_second_slot_moves_the_pages_off_the_pool) {
    struct bd_page_slot *a = slot_in(T0, T0, T0 - SPAN, 1, 7);
    a->count = 3;
    a->bytes = 333;
    pages->fill_bytes = 1234;
    pages->sized_fields = 3;
    pages->overhead_bytes = 100;
    pages->reading_max_bytes = 50;
    struct bd_pages *was = pages;
    slot_in(T0 + SPAN, T0, T0 - SPAN, 1, 7);
    cr_assert_neq(pages, was);
    cr_assert_eq(pages->n, 2);
    cr_assert_eq(pages->fill_bytes, 1234);
    cr_assert_eq(pages->sized_fields, 3);
    cr_assert_eq(pages->overhead_bytes, 100);
    cr_assert_eq(pages->reading_max_bytes, 50);
    const struct bd_page_slot *kept = bd_pages_find(pages, &lim, T0);
    cr_assert_not_null(kept);
    cr_assert_eq(kept->count, 3);
    cr_assert_eq(kept->bytes, 333);
    cr_assert_eq(kept->batch, 7);
    struct bd_pages *next = NULL;
    cr_assert_not_null(bd_pages_slot(&pool, &next, &lim, T0, T0, T0 - SPAN, 1));
    cr_assert_eq(next, was, "the pool's object is reused");
    bd_pages_free(&pool, next);
}

/* Batch ids are kept in 32 bits and compared wrap-safe: across 2^32 a slot of the pending batch
 * is still pinned and one of an older batch is not. */
Test(pages, pinned_across_the_32_bit_wrap) {
    const uint64_t id = UINT64_C(0x1FFFFFFFF); /* the low 32 bits wrap at the next batch */
    slot_in(T0, T0, T0 - SPAN, id - 1, id);
    slot_in(T0 + SPAN, T0, T0 - SPAN, id - 1, id - 1);
    const int64_t now = T0 + 100 * SPAN; /* both closed */
    slot_in(T0 + 100 * SPAN, now, T0 - SPAN, id, id + 1);
    cr_assert_eq(pages->n, 2, "batch id - 1 is settled: its slot is reused");
    cr_assert_not_null(bd_pages_find(pages, &lim, T0), "batch id is pending: kept");
    cr_assert_null(bd_pages_find(pages, &lim, T0 + SPAN));
    slot_in(T0 + 99 * SPAN, now, T0 - SPAN, id + 1, id + 1);
    cr_assert_eq(pages->n, 2, "batch id is settled now, its slot reused across the wrap");
    cr_assert_null(bd_pages_find(pages, &lim, T0));
    cr_assert_not_null(bd_pages_find(pages, &lim, T0 + 100 * SPAN), "batch id + 1: pinned");
}

/* Bucket numbers: every instant of an int64_t of nanoseconds has one, with buckets of a minute;
 * a start that is not a multiple of the span is none. */
Test(pages, bucket_numbers_cover_every_instant) {
    const int64_t first = bd_floor_div(INT64_MIN / 1000000, SPAN) * SPAN;
    const int64_t last = INT64_MAX / 1000000 / SPAN * SPAN;
    cr_assert(bd_pages_start_ok(&lim, first));
    cr_assert(bd_pages_start_ok(&lim, last));
    cr_assert(!bd_pages_start_ok(&lim, T0 + 1));
    cr_assert(!bd_pages_start_ok(&wide, (int64_t)INT32_MAX * SPAN + SPAN));
    slot_in(first, T0, T0 - SPAN, 1, 1); /* pinned: both kept */
    slot_in(last, T0, T0 - SPAN, 1, 1);
    cr_assert_eq(bd_page_slot_start_ms(bd_pages_find(pages, &lim, first), &lim), first);
    cr_assert_eq(bd_page_slot_start_ms(bd_pages_find(pages, &lim, last), &lim), last);
    cr_assert_null(bd_pages_find(pages, &lim, T0 + 1));
}

/* More slots than 8 bits count (a wide window), each with its own state. */
Test(pages, more_than_255_slots_keep_apart) {
    const uint32_t n = 1000;
    for (uint32_t k = 0; k < n; k++) {
        struct bd_page_slot *s = bd_pages_slot(&pool, &pages, &wide, T0 + k * SPAN, T0, T0 - 1, 1);
        cr_assert_not_null(s);
        s->batch = k;
        s->count = k;
        s->bytes = k * 7;
    }
    cr_assert_eq(pages->n, n, "nothing evicted");
    for (uint32_t k = 0; k < n; k++) {
        struct bd_page_slot *s = bd_pages_find(pages, &wide, T0 + k * SPAN);
        cr_assert_not_null(s);
        cr_assert_eq(s->count, k);
        cr_assert_eq(s->bytes, k * 7);
        cr_assert(s->known);
    }
}

/* A reading past 4 GiB (bytes saturate) still gets a page of its own, and the next reading
 * the page after it, as with exact sizes. */
Test(pages, bytes_saturate_and_still_close_the_page) {
    struct bd_page_slot s = known_slot(0, 0, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 0);
    cr_assert_eq(bd_pages_place(&s, &lim, UINT64_C(5) << 30, OVERHEAD), 1, "a page of its own");
    cr_assert_eq(s.bytes, UINT32_MAX);
    cr_assert_eq(bd_pages_place(&s, &lim, 1, OVERHEAD), 2);
    cr_assert_eq(s.bytes, OVERHEAD + 1);
    /* A look-up's estimate past 4 GiB: the next reading opens the next page. */
    s = known_slot(4, 3, UINT64_C(6) << 30);
    cr_assert_eq(s.bytes, UINT32_MAX);
    cr_assert_eq(bd_pages_place(&s, &lim, 1, OVERHEAD), 5);
    cr_assert_eq(s.bytes, OVERHEAD + 1);
}

/* The overhead shares its word with known: the learned mark, and growth after it, fit. */
Test(pages, overhead_and_known_share_a_word) {
    struct bd_page_slot s = known_slot(0, 2, 300);
    cr_assert(s.known);
    cr_assert_eq(s.overhead, BD_PAGE_OVERHEAD_LEARNED);
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD), 0);
    cr_assert_eq(s.overhead, OVERHEAD);
    cr_assert(s.known, "setting the overhead leaves known alone");
    cr_assert_eq(bd_pages_place(&s, &lim, 10, OVERHEAD + 50), 0);
    cr_assert_eq(s.overhead, OVERHEAD + 50);
    cr_assert_eq(s.bytes, 300 + 10 + 50 + 10);
    /* An overhead past 31 bits is kept below the learned mark. */
    s = known_slot(0, 0, 0);
    cr_assert_eq(bd_pages_place(&s, &lim, 1, UINT64_C(1) << 32), 0);
    cr_assert_eq(s.overhead, BD_PAGE_OVERHEAD_LEARNED - 1);
    cr_assert(s.known);
}
