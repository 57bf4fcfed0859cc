/*
 * The pending batch (src/batch.c): deltas indexed by (sensor, bucket start, page) through their
 * growth past the first arrays and the first slot table, every allocation failing in turn (the
 * batch stays as it was), undoing creations, taking up an emptied delta again, the readings
 * still pending, and a clear that gives back what a very large batch took.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/batch.h"
#include "bucketd/sensor.h"

#define N_SENSORS 64u
#define SPAN INT64_C(3600000)
#define T0 INT64_C(1736946000000) /* an hour boundary */

static struct bd_batch batch;
static struct bd_sensor *sensors[N_SENSORS];

static void setup(void) {
    for (uint32_t i = 0; i < N_SENSORS; i++) {
        sensors[i] = aligned_alloc(alignof(struct bd_sensor), sizeof(struct bd_sensor));
        cr_assert_not_null(sensors[i]);
        memset(sensors[i], 0, sizeof(struct bd_sensor));
    }
    cr_assert_eq(bd_batch_init(&batch), 0);
}

static void teardown(void) {
    bd_alloc_fail_after(-1, 0);
    bd_batch_close(&batch);
    for (uint32_t i = 0; i < N_SENSORS; i++) {
        free(sensors[i]);
    }
}

TestSuite(batch, .init = setup, .fini = teardown);

/* Key k: sensor k % N_SENSORS, bucket k / N_SENSORS % 7, page k / (7 * N_SENSORS). */
static struct bd_sensor *key_sensor(uint32_t k) {
    return sensors[k % N_SENSORS];
}
static int64_t key_start(uint32_t k) {
    return T0 + (int64_t)(k / N_SENSORS % 7) * SPAN;
}
static uint32_t key_page(uint32_t k) {
    return k / (7 * N_SENSORS);
}

static int64_t get_key(uint32_t k) {
    return bd_batch_get(&batch, key_sensor(k), key_start(k), key_page(k));
}
static int64_t find_key(uint32_t k) {
    return bd_batch_find(&batch, key_sensor(k), key_start(k), key_page(k));
}

static uint32_t refs_total(void) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < N_SENSORS; i++) {
        n += sensors[i]->flusher_refs;
    }
    return n;
}

/* Keys [0, n) are the batch's deltas 0..n-1, each found at its index, each referring once. */
static void check_holds(uint32_t n) {
    cr_assert_eq(batch.n, n);
    cr_assert_eq(refs_total(), n, "sensor references");
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(find_key(k), (int64_t)k, "key %u", k);
        const struct bd_delta *d = &batch.deltas[k];
        cr_assert(d->sensor == key_sensor(k) && d->start_ms == key_start(k) &&
                      d->page == key_page(k),
                  "delta %u", k);
    }
    cr_assert_eq(find_key(n), -1, "key %u not created", n);
}

static void add_reading(int64_t index, double value) {
    struct bd_reading_value v = {.field = 0, .kind = BD_VAL_FLOAT, .v.f = value};
    cr_assert_eq(bd_delta_add(&batch.deltas[index], T0 * 1000000 + 1, &v, 1), 0);
}

Test(batch, a_key_is_created_once_and_found_again) {
    cr_assert_eq(find_key(0), -1);
    cr_assert_eq(get_key(0), 0);
    cr_assert_eq(get_key(1), 1);
    cr_assert_eq(get_key(0), 0, "found, not created again");
    cr_assert_eq(sensors[0]->flusher_refs, 1);
    cr_assert_eq(sensors[1]->flusher_refs, 1);
    /* Same sensor, other bucket; same bucket, other page: each its own delta. */
    cr_assert_eq(bd_batch_get(&batch, sensors[0], T0 + SPAN, 0), 2);
    cr_assert_eq(bd_batch_get(&batch, sensors[0], T0, 1), 3);
    cr_assert_eq(sensors[0]->flusher_refs, 3);
    cr_assert_eq(bd_batch_find(&batch, sensors[0], T0, 1), 3);
    cr_assert_eq(bd_batch_find(&batch, sensors[0], T0, 2), -1);
    cr_assert_eq(batch.deltas[3].n_readings, 0, "created empty");
    cr_assert(!batch.meta[3].done);
}

/* Past the first arrays (256 deltas) and the first slot table (1,024 slots, half full). */
Test(batch, growth_keeps_every_delta_and_its_readings) {
    const uint32_t n = 3000;
    for (uint32_t k = 0; k < n; k++) {
        int64_t i = get_key(k);
        cr_assert_eq(i, (int64_t)k);
        add_reading(i, k);
    }
    check_holds(n);
    cr_assert_gt(batch.slot_mask + 1, 2 * n, "the slot table grew");
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(batch.deltas[k].n_readings, 1);
        cr_assert_float_eq(batch.deltas[k].summaries[0].sum, (double)k, 0);
    }
    cr_assert_eq(bd_batch_pending_readings(&batch), n);
}

/*
 * Every allocation of a creation that grows the arrays or the slot table fails in turn: the
 * call returns -ENOMEM and the batch holds what it held (no reference taken, the key not
 * found), and the same call succeeds once memory is back.
 */
static void fill_fresh(uint32_t n) {
    bd_batch_close(&batch);
    cr_assert_eq(bd_batch_init(&batch), 0);
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
    }
}

static void each_allocation_fails_in_turn(uint32_t before) {
    fill_fresh(before);
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(get_key(before), (int64_t)before);
    long allocations = bd_alloc_fail_after(-1, 0);
    cr_assert_gt(allocations, 0, "the creation of delta %u grows something", before);
    for (long a = 0; a < allocations; a++) {
        fill_fresh(before);
        bd_alloc_fail_after(a, 1);
        cr_assert_eq(get_key(before), -ENOMEM, "allocation %ld", a);
        bd_alloc_fail_after(-1, 0);
        check_holds(before);
        cr_assert_eq(get_key(before), (int64_t)before, "allocation %ld", a);
        check_holds(before + 1);
    }
}

Test(batch, a_failed_growth_of_the_arrays_changes_nothing) {
    each_allocation_fails_in_turn(256);
}

Test(batch, a_failed_growth_of_the_slot_table_changes_nothing) {
    each_allocation_fails_in_turn(511);
}

/* The undo of creations: later deltas go, with their references; earlier ones stay found. */
Test(batch, truncate_drops_what_was_created_after) {
    for (uint32_t k = 0; k < 600; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
        add_reading(k, 1.0);
    }
    bd_batch_truncate(&batch, 200);
    check_holds(200);
    for (uint32_t k = 200; k < 600; k++) {
        cr_assert_eq(find_key(k), -1, "key %u", k);
    }
    cr_assert_eq(bd_batch_pending_readings(&batch), 200);
    bd_batch_truncate(&batch, 300); /* past the end: nothing */
    check_holds(200);
    /* A key dropped comes back empty, its buffers reused. */
    cr_assert_eq(get_key(200), 200);
    cr_assert_eq(batch.deltas[200].n_readings, 0);
    cr_assert_not_null(batch.deltas[200].readings, "the buffer of the dropped delta kept");
}

/* Done deltas are not pending; an emptied one found again is taken up as new. */
Test(batch, done_deltas_are_not_pending_and_an_emptied_one_is_taken_up_again) {
    for (uint32_t k = 0; k < 4; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
        add_reading(k, 1.0);
        add_reading(k, 2.0);
    }
    cr_assert_eq(bd_batch_pending_readings(&batch), 8);
    batch.meta[1].done = true; /* acknowledged */
    cr_assert_eq(bd_batch_pending_readings(&batch), 6);
    /* Delta 2 emptied (its readings moved to another page) and marked done. */
    bd_delta_reset(&batch.deltas[2]);
    batch.meta[2] = (struct bd_batch_meta){.done = true, .refusals = 3, .first_ms = 5};
    cr_assert_eq(bd_batch_pending_readings(&batch), 4);
    cr_assert_eq(get_key(2), 2, "found again, not created");
    cr_assert(!batch.meta[2].done);
    cr_assert_eq(batch.meta[2].refusals, 0, "its history starts again");
    cr_assert_eq(batch.meta[2].first_ms, 0);
    cr_assert_eq(batch.n, 4);
}

/*
 * A clear empties the batch and keeps the buffers of at most BD_BATCH_KEEP deltas: after a batch
 * of very many buckets, the arrays and the slot table shrink back.
 */
Test(batch, a_clear_keeps_buffers_but_gives_back_a_large_batch) {
    const uint32_t n = 2 * BD_BATCH_KEEP + 100; /* slot table past 4 * BD_BATCH_KEEP */
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
        add_reading(k, 1.0);
    }
    cr_assert_gt(batch.cap, BD_BATCH_KEEP);
    cr_assert_gt(batch.slot_mask + 1, 4 * BD_BATCH_KEEP);
    bd_batch_clear(&batch);
    cr_assert_eq(batch.n, 0);
    cr_assert_eq(refs_total(), 0);
    cr_assert_eq(bd_batch_pending_readings(&batch), 0);
    cr_assert_eq(batch.cap, BD_BATCH_KEEP);
    cr_assert_eq(batch.slot_mask + 1, 4 * BD_BATCH_KEEP);
    for (uint32_t k = 0; k < n; k += 97) {
        cr_assert_eq(find_key(k), -1, "key %u", k);
    }
    cr_assert_not_null(batch.deltas[0].readings, "buffers kept for reuse");
    /* Used again: created afresh, every key found. */
    for (uint32_t k = 0; k < 1000; k++) {
        cr_assert_eq(get_key(k + 7), (int64_t)k);
    }
    cr_assert_eq(refs_total(), 1000);
    cr_assert_eq(find_key(7 + 999), 999);
    cr_assert_eq(find_key(6), -1);
}

/* A clear whose shrinking fails keeps the larger arrays and table, still correct. */
Test(batch, a_clear_that_cannot_shrink_stays_usable) {
    const uint32_t n = BD_BATCH_KEEP + 10;
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
    }
    uint32_t mask = batch.slot_mask;
    bd_alloc_fail_after(0, 1);
    bd_batch_clear(&batch);
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(batch.n, 0);
    cr_assert_eq(refs_total(), 0);
    cr_assert_eq(batch.slot_mask, mask, "the table kept");
    cr_assert_eq(find_key(3), -1);
    for (uint32_t k = 0; k < n; k++) {
        cr_assert_eq(get_key(k), (int64_t)k);
    }
    check_holds(n);
}
