/*
 * Unit tests for the SPSC ring (include/bucketd/ring.h, src/ring.c), single-threaded: one
 * thread plays producer and consumer in turn, so every result is exact and checked against a
 * 64-bit reference model. Concurrency is covered by tests/stress/ring_stress.c under TSan.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/ring.h"

/* Cell i of record `seq` (i < 256): it depends on both values, so a cell from the wrong record,
 * the wrong position or a stale lap of the array never compares equal. */
static uint64_t cell_for(uint64_t seq, uint32_t i) {
    return (seq << 8) | i;
}

static void make_record(uint64_t *dst, uint64_t seq, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        dst[i] = cell_for(seq, i);
    }
}

/* Reads the record of n cells at free-running index idx back through bd_ring_at. */
static void expect_record(const struct bd_ring *r, uint32_t idx, uint64_t seq, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint64_t got = *bd_ring_at(r, idx + i);
        cr_assert_eq(got, cell_for(seq, i), "record %llu cell %u (index %u)",
                     (unsigned long long)seq, i, idx + i);
    }
}

/*
 * Every observable count, from both sides, against what the model says is in the ring. The
 * consumer's count comes from its copy of head, refreshed only when that copy is used up: it
 * may lag behind pushes made since, but is never more than what is in the ring, is 0 only when
 * the ring is empty, and a second look after consuming what it reported is exact again.
 */
static void expect_counts(struct bd_ring *r, uint32_t start, uint64_t pushed, uint64_t consumed) {
    uint32_t cap = bd_ring_capacity(r);
    uint32_t in_use = (uint32_t)(pushed - consumed);
    uint32_t tail = 0;

    uint32_t avail = bd_ring_available(r, &tail);
    cr_assert_leq(avail, in_use, "available never exceeds what is in the ring");
    cr_assert_eq(avail == 0, in_use == 0, "available is 0 exactly when the ring is empty");
    cr_assert_eq(r->head_cache - tail, avail, "available comes from the consumer's copy");
    cr_assert_eq(tail, (uint32_t)(start + consumed), "tail index");
    cr_assert_eq(bd_ring_free(r), cap - in_use, "free");
    cr_assert_eq(r->tail_cache, (uint32_t)(start + consumed), "free refreshes the copy of tail");
    cr_assert_eq(bd_ring_used_hint(r), in_use, "hint after a refresh");
    cr_assert_eq(bd_ring_used(r), in_use, "used");
    cr_assert_eq(atomic_load(&r->head), (uint32_t)(start + pushed), "head");
    cr_assert_eq(atomic_load(&r->tail), (uint32_t)(start + consumed), "tail");
}

Test(ring, init_rejects_bad_capacity) {
    static const uint32_t bad[] = {0, 1, 3, 5, 6, 7, 12, 100, 1023, 0x80000001u, UINT32_MAX};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct bd_ring r;
        cr_assert_eq(bd_ring_init(&r, bad[i]), -EINVAL, "capacity %u", bad[i]);
        cr_assert_eq(bd_ring_init_at(&r, bad[i], UINT32_MAX - 3), -EINVAL, "capacity %u", bad[i]);
    }
}

Test(ring, init_accepts_powers_of_two) {
    for (uint32_t cap = 2; cap <= 4096; cap <<= 1) {
        struct bd_ring r;
        cr_assert_eq(bd_ring_init(&r, cap), 0, "capacity %u", cap);
        cr_assert_eq(bd_ring_capacity(&r), cap);
        cr_assert_not_null(r.cells);
        bd_ring_close(&r);
        cr_assert_null(r.cells);
        bd_ring_close(&r); /* A second close is harmless. */
    }
}

Test(ring, empty_ring) {
    static const uint32_t starts[] = {0, 12345, UINT32_MAX - 3, UINT32_MAX};
    for (size_t i = 0; i < sizeof(starts) / sizeof(starts[0]); i++) {
        struct bd_ring r;
        cr_assert_eq(bd_ring_init_at(&r, 8, starts[i]), 0);
        expect_counts(&r, starts[i], 0, 0);
        bd_ring_close(&r);
    }
}

Test(ring, fill_to_exactly_full) {
    struct bd_ring r;
    uint64_t rec[8];
    uint64_t snapshot[8];
    cr_assert_eq(bd_ring_init(&r, 8), 0);

    make_record(rec, 0, 3);
    cr_assert(bd_ring_push(&r, rec, 3));
    make_record(rec, 1, 5);
    cr_assert(bd_ring_push(&r, rec, 5), "5 cells fit exactly in the 5 left");
    expect_counts(&r, 0, 8, 0);

    /* Full: one more cell is refused and neither head nor any cell changes. */
    memcpy(snapshot, r.cells, sizeof(snapshot));
    make_record(rec, 2, 1);
    cr_assert_not(bd_ring_push(&r, rec, 1));
    cr_assert_eq(memcmp(snapshot, r.cells, sizeof(snapshot)), 0, "a refused push wrote cells");
    expect_counts(&r, 0, 8, 0);

    expect_record(&r, 0, 0, 3);
    expect_record(&r, 3, 1, 5);
    bd_ring_close(&r);
}

Test(ring, whole_capacity_record) {
    struct bd_ring r;
    uint64_t rec[17];
    cr_assert_eq(bd_ring_init_at(&r, 16, UINT32_MAX - 6), 0);

    make_record(rec, 7, 17);
    cr_assert_not(bd_ring_push(&r, rec, 17), "a record larger than the ring never fits");
    expect_counts(&r, UINT32_MAX - 6, 0, 0);

    cr_assert(bd_ring_push(&r, rec, 16), "a record of exactly the capacity fits an empty ring");
    expect_counts(&r, UINT32_MAX - 6, 16, 0);
    expect_record(&r, UINT32_MAX - 6, 7, 16);
    bd_ring_close(&r);
}

Test(ring, partial_consume_then_push) {
    struct bd_ring r;
    uint64_t rec[8];
    cr_assert_eq(bd_ring_init(&r, 8), 0);

    make_record(rec, 0, 2);
    cr_assert(bd_ring_push(&r, rec, 2));
    make_record(rec, 1, 4);
    cr_assert(bd_ring_push(&r, rec, 4));
    make_record(rec, 2, 3);
    cr_assert_not(bd_ring_push(&r, rec, 3), "3 cells do not fit in 2");

    /* Consume the first record only: exactly its cells come back to the producer. */
    expect_record(&r, 0, 0, 2);
    bd_ring_consume(&r, 2);
    expect_counts(&r, 0, 6, 2);

    cr_assert(bd_ring_push(&r, rec, 3), "3 cells fit in the 4 now free");
    expect_counts(&r, 0, 9, 2);
    expect_record(&r, 2, 1, 4);
    expect_record(&r, 6, 2, 3);
    bd_ring_close(&r);
}

Test(ring, record_wraps_array_end) {
    struct bd_ring r;
    uint64_t rec[6];
    cr_assert_eq(bd_ring_init(&r, 8), 0);

    make_record(rec, 0, 5);
    cr_assert(bd_ring_push(&r, rec, 5));
    bd_ring_consume(&r, 5);

    /* Indices 5..10: three cells at the end of the array, three at its start. */
    make_record(rec, 1, 6);
    cr_assert(bd_ring_push(&r, rec, 6));
    expect_counts(&r, 0, 11, 5);
    expect_record(&r, 5, 1, 6);

    uint64_t want = cell_for(1, 3);
    cr_assert_eq(memcmp(&r.cells[0], &want, sizeof(want)), 0, "cell 3 lands on slot 0");
    want = cell_for(1, 2);
    cr_assert_eq(memcmp(&r.cells[7], &want, sizeof(want)), 0, "cell 2 lands on slot 7");
    bd_ring_close(&r);
}

Test(ring, multi_cell_all_or_nothing) {
    struct bd_ring r;
    uint64_t rec[8];
    uint64_t snapshot[8];

    /* For every fill level and record size: fits exactly when n <= free, else nothing moves. */
    for (uint32_t fill = 0; fill <= 8; fill++) {
        for (uint32_t n = 1; n <= 8; n++) {
            cr_assert_eq(bd_ring_init_at(&r, 8, UINT32_MAX - 4), 0);
            make_record(rec, 100, fill);
            cr_assert(fill == 0 || bd_ring_push(&r, rec, fill));

            memcpy(snapshot, r.cells, sizeof(snapshot));
            make_record(rec, 200, n);
            bool ok = bd_ring_push(&r, rec, n);
            cr_assert_eq(ok, n <= 8 - fill, "fill %u, record of %u", fill, n);
            if (ok) {
                expect_counts(&r, UINT32_MAX - 4, fill + n, 0);
                expect_record(&r, UINT32_MAX - 4 + fill, 200, n);
            } else {
                expect_counts(&r, UINT32_MAX - 4, fill, 0);
                cr_assert_eq(memcmp(snapshot, r.cells, sizeof(snapshot)), 0,
                             "refused push of %u at fill %u wrote cells", n, fill);
            }
            expect_record(&r, UINT32_MAX - 4, 100, fill);
            bd_ring_close(&r);
        }
    }
}

/* xorshift32: deterministic record sizes, so a failure reproduces. */
static uint32_t next_rand(uint32_t *s) {
    uint32_t x = *s;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *s = x;
}

/*
 * Many producer/consumer turns with counters started just below the 32-bit wrap. The model
 * keeps 64-bit counts and a queue of record sizes; the ring must agree with it on every count
 * at every step while head and tail cross UINT32_MAX (and, with the small capacity, the array
 * end) many times over.
 */
static void run_cycles(uint32_t cap, uint32_t start, uint32_t max_len, uint32_t seed) {
    struct bd_ring r;
    uint64_t rec[16];
    uint32_t lens[64];             /* Queue of record sizes in the ring, oldest first. */
    uint32_t q_first = 0, q_n = 0; /* Ring of at most cap records, cap <= 64. */
    uint64_t pushed = 0, consumed = 0, next_seq = 0, next_expected = 0;
    uint32_t rng = seed;
    bool wrapped_head = false, wrapped_tail = false, saw_full = false, saw_empty = false;

    cr_assert(cap <= 64 && max_len <= 16);
    cr_assert_eq(bd_ring_init_at(&r, cap, start), 0);

    for (int step = 0; step < 20000; step++) {
        if (next_rand(&rng) % 2 == 0) {
            uint32_t n = 1 + next_rand(&rng) % max_len;
            uint32_t in_use = (uint32_t)(pushed - consumed);
            uint32_t old_head = atomic_load(&r.head);
            make_record(rec, next_seq, n);
            bool ok = bd_ring_push(&r, rec, n);
            cr_assert_eq(ok, n <= cap - in_use, "step %d: push %u with %u in use", step, n, in_use);
            if (ok) {
                wrapped_head |= atomic_load(&r.head) < old_head;
                lens[(q_first + q_n) % 64] = n;
                q_n++;
                pushed += n;
                next_seq++;
            }
        } else if (q_n > 0) {
            /* Consume one to three whole records in one go. */
            uint32_t k = 1 + next_rand(&rng) % 3;
            uint32_t tail = 0, total = 0;
            uint32_t avail = bd_ring_available(&r, &tail);
            cr_assert_gt(avail, 0, "step %d: records in the ring but none available", step);
            for (; k > 0 && q_n > 0; k--) {
                uint32_t n = lens[q_first];
                if (total + n > avail) {
                    /* Pushed after the consumer's copy of head: the next look finds it. */
                    cr_assert_gt(total, 0, "step %d: first record beyond available", step);
                    break;
                }
                expect_record(&r, tail + total, next_expected, n);
                total += n;
                next_expected++;
                q_first = (q_first + 1) % 64;
                q_n--;
            }
            uint32_t old_tail = atomic_load(&r.tail);
            bd_ring_consume(&r, total);
            wrapped_tail |= atomic_load(&r.tail) < old_tail;
            consumed += total;
        }
        expect_counts(&r, start, pushed, consumed);
        saw_full |= pushed - consumed == cap;
        saw_empty |= pushed == consumed;
    }

    cr_assert(wrapped_head && wrapped_tail, "the counters never crossed UINT32_MAX");
    cr_assert(saw_full && saw_empty, "the run never reached both full and empty");
    cr_assert_gt(pushed, (uint64_t)cap * 100, "too few cells went through");
    bd_ring_close(&r);
}

Test(ring, counters_wrap_from_uint32_max_minus_3) {
    run_cycles(8, UINT32_MAX - 3, 4, 0x1234567u);
    run_cycles(16, UINT32_MAX - 3, 8, 0xdeadbeefu);
}

Test(ring, counters_wrap_from_uint32_max) {
    run_cycles(8, UINT32_MAX, 4, 0x2468aceu);
    run_cycles(2, UINT32_MAX, 2, 0x13579bdu);
}

Test(ring, counters_wrap_mid_record) {
    /* Head crosses UINT32_MAX inside the very first record (indices MAX-2 .. MAX+3). */
    struct bd_ring r;
    uint64_t rec[6];
    const uint32_t start = UINT32_MAX - 2;
    cr_assert_eq(bd_ring_init_at(&r, 8, start), 0);

    make_record(rec, 9, 6);
    cr_assert(bd_ring_push(&r, rec, 6));
    cr_assert_eq(atomic_load(&r.head), 3u, "head wrapped to 3");
    expect_counts(&r, start, 6, 0);
    expect_record(&r, start, 9, 6);

    /* Full across the wrap: free 2, a 3-cell record is refused, a 2-cell one fits. */
    make_record(rec, 10, 3);
    cr_assert_not(bd_ring_push(&r, rec, 3));
    make_record(rec, 10, 2);
    cr_assert(bd_ring_push(&r, rec, 2));
    expect_counts(&r, start, 8, 0);

    /* Tail crosses UINT32_MAX inside the record too. */
    bd_ring_consume(&r, 6);
    cr_assert_eq(atomic_load(&r.tail), 3u, "tail wrapped to 3");
    expect_counts(&r, start, 8, 6);
    expect_record(&r, 3, 10, 2);
    bd_ring_close(&r);

    /* And over many cycles with records up to the whole ring. */
    run_cycles(8, start, 8, 0xfeedfaceu);
    run_cycles(32, UINT32_MAX - 13, 16, 0xc0ffee1u);
}

Test(ring, used_from_both_sides) {
    struct bd_ring r;
    uint64_t rec[4];
    cr_assert_eq(bd_ring_init_at(&r, 4, UINT32_MAX - 1), 0);
    cr_assert_eq(bd_ring_used(&r), 0);

    make_record(rec, 1, 3);
    cr_assert(bd_ring_push(&r, rec, 3)); /* head wraps: MAX-1 -> 1 */
    cr_assert_eq(bd_ring_used(&r), 3);
    cr_assert_eq(bd_ring_used(&r) + bd_ring_free(&r), 4);

    make_record(rec, 2, 1);
    cr_assert(bd_ring_push(&r, rec, 1));
    cr_assert_eq(bd_ring_used(&r), 4, "full");
    cr_assert_eq(bd_ring_free(&r), 0);

    bd_ring_consume(&r, 3); /* tail wraps too */
    cr_assert_eq(bd_ring_used(&r), 1);
    bd_ring_consume(&r, 1);
    cr_assert_eq(bd_ring_used(&r), 0, "empty");
    cr_assert_eq(bd_ring_free(&r), 4);
    bd_ring_close(&r);
}

/*
 * The producer's copy of tail: it is refreshed only when the ring looks full, so a push with
 * room by the copy never reads the consumer's line, and a push refused by a stale copy reads
 * it once and goes through. Counters start just below UINT32_MAX so the copy, head and tail
 * all cross the wrap.
 */
Test(ring, cached_tail_refreshed_only_when_full) {
    struct bd_ring r;
    uint64_t rec[8];
    const uint32_t start = UINT32_MAX - 5;
    cr_assert_eq(bd_ring_init_at(&r, 8, start), 0);

    make_record(rec, 1, 6);
    cr_assert(bd_ring_push(&r, rec, 6));
    cr_assert_eq(r.tail_cache, start, "room by the copy: tail not read");
    cr_assert_eq(bd_ring_used_hint(&r), 6);

    /* The consumer frees 6 cells (tail wraps to 0); the producer's copy does not know yet. */
    uint32_t tail;
    cr_assert_eq(bd_ring_available(&r, &tail), 6);
    expect_record(&r, tail, 1, 6);
    bd_ring_consume(&r, 6);
    cr_assert_eq(atomic_load(&r.tail), 0u);
    cr_assert_eq(r.tail_cache, start, "still stale");
    cr_assert_eq(bd_ring_used_hint(&r), 6, "the hint is an upper bound");

    /* 2 cells fit by the stale copy: pushed without a refresh. */
    make_record(rec, 2, 2);
    cr_assert(bd_ring_push(&r, rec, 2));
    cr_assert_eq(r.tail_cache, start);
    cr_assert_eq(atomic_load(&r.head), 2u, "head wrapped");

    /* 5 cells do not fit by the copy (full), fit by the real tail: one refresh, pushed. */
    make_record(rec, 3, 5);
    cr_assert(bd_ring_push(&r, rec, 5));
    cr_assert_eq(r.tail_cache, 0u, "refreshed across the wrap");
    cr_assert_eq(bd_ring_used_hint(&r), 7);

    /* Really full now: a refresh changes nothing and the push is refused, nothing written. */
    make_record(rec, 4, 2);
    cr_assert_not(bd_ring_push(&r, rec, 2));
    cr_assert_eq(atomic_load(&r.head), 7u);
    expect_counts(&r, start, 13, 6);
    bd_ring_close(&r);
}

/*
 * The consumer's copy of head: it reports what it saw until that is consumed, then looks again,
 * so a record pushed meanwhile shows up on the next look, never half of one.
 */
Test(ring, cached_head_refreshed_only_when_used_up) {
    struct bd_ring r;
    uint64_t rec[4];
    const uint32_t start = UINT32_MAX - 2;
    cr_assert_eq(bd_ring_init_at(&r, 16, start), 0);

    uint32_t tail;
    cr_assert_eq(bd_ring_available(&r, &tail), 0);
    make_record(rec, 1, 3);
    cr_assert(bd_ring_push(&r, rec, 3)); /* head wraps to 0 */
    cr_assert_eq(bd_ring_available(&r, &tail), 3);
    cr_assert_eq(r.head_cache, 0u);

    make_record(rec, 2, 4);
    cr_assert(bd_ring_push(&r, rec, 4));
    cr_assert_eq(bd_ring_available(&r, &tail), 3, "the copy is not used up: not refreshed");
    cr_assert_eq(tail, start);
    expect_record(&r, tail, 1, 3);
    bd_ring_consume(&r, 3);

    cr_assert_eq(bd_ring_available(&r, &tail), 4, "used up: refreshed");
    cr_assert_eq(tail, 0u);
    expect_record(&r, tail, 2, 4);

    /* A caller that consumes without looking first leaves the copy behind tail: the next look
     * must refresh rather than report a wrapped count. */
    bd_ring_consume(&r, 4);
    make_record(rec, 3, 2);
    cr_assert(bd_ring_push(&r, rec, 2));
    bd_ring_consume(&r, 2);
    cr_assert_eq(bd_ring_available(&r, &tail), 0, "copy behind tail is refreshed");
    cr_assert_eq(tail, 6u);
    bd_ring_close(&r);
}

Test(ring, layout_keeps_sides_apart) {
    struct bd_ring r;
    cr_assert_eq(bd_ring_init(&r, 4), 0);
    uintptr_t head = (uintptr_t)&r.head, tail = (uintptr_t)&r.tail;
    cr_assert_eq(tail - head, BD_RING_CACHELINE, "head and tail 128 bytes apart");
    cr_assert_lt((uintptr_t)&r.cells + sizeof(r.cells) - head, (uintptr_t)BD_RING_LINE);
    cr_assert_lt((uintptr_t)&r.cons_cells + sizeof(r.cons_cells) - tail, (uintptr_t)BD_RING_LINE);
    cr_assert_eq(r.cons_cells, r.cells);
    cr_assert_eq(r.cons_mask, r.mask);
    cr_assert_eq((uintptr_t)r.cells % BD_RING_LINE, 0, "cells line-aligned");
    bd_ring_close(&r);
    cr_assert_null(r.cons_cells);
}
