/*
 * Unit tests for the sensor table's slab (include/bucketd/slab.h, src/slab.c): alignment, size
 * classes, reuse of freed blocks by their class, blocks past the classes, chunks. One thread,
 * as in the daemon.
 */
#include <criterion/criterion.h>

#include <stdint.h>
#include <string.h>

#include "bucketd/slab.h"

static struct bd_slab sl;

static void setup(void) {
    bd_slab_init(&sl);
}

static void teardown(void) {
    bd_slab_close(&sl);
}

TestSuite(slab, .init = setup, .fini = teardown);

Test(slab, blocks_are_aligned_whole_units_that_do_not_overlap) {
    cr_assert_eq(bd_slab_size(1), 128);
    cr_assert_eq(bd_slab_size(128), 128);
    cr_assert_eq(bd_slab_size(129), 256);
    cr_assert_eq(bd_slab_size(319), 384);
    unsigned char *prev = NULL;
    size_t prev_size = 0;
    for (size_t size = 1; size <= BD_SLAB_MAX; size += 37) {
        unsigned char *p = bd_slab_alloc(&sl, size);
        cr_assert_not_null(p);
        cr_assert_eq((uintptr_t)p % BD_SLAB_UNIT, 0, "size %zu", size);
        memset(p, 0xab, bd_slab_size(size)); /* the whole block is the caller's */
        if (prev != NULL && p > prev) {
            cr_assert_geq((size_t)(p - prev), bd_slab_size(prev_size), "no overlap");
        }
        prev = p;
        prev_size = size;
    }
    cr_assert_geq(sl.chunk_bytes, BD_SLAB_CHUNK);
}

Test(slab, a_freed_block_serves_the_next_of_its_class_only) {
    void *a = bd_slab_alloc(&sl, 300); /* 3 units */
    void *b = bd_slab_alloc(&sl, 200); /* 2 units */
    cr_assert_neq(a, b);
    bd_slab_free(&sl, a, 300);
    void *c = bd_slab_alloc(&sl, 200);
    cr_assert_neq(c, a, "another class: not the freed 3-unit block");
    void *d = bd_slab_alloc(&sl, 384);
    cr_assert_eq(d, a, "the same class: the freed block, last in first out");
    void *e = bd_slab_alloc(&sl, 257);
    cr_assert_neq(e, a);
}

Test(slab, one_chunk_holds_its_share_then_a_new_one_follows) {
    uint64_t n = (BD_SLAB_CHUNK - BD_SLAB_UNIT) / 384;
    for (uint64_t i = 0; i < n; i++) {
        cr_assert_not_null(bd_slab_alloc(&sl, 384));
    }
    cr_assert_eq(sl.chunk_bytes, BD_SLAB_CHUNK);
    cr_assert_not_null(bd_slab_alloc(&sl, 384));
    cr_assert_eq(sl.chunk_bytes, 2 * BD_SLAB_CHUNK);
}

Test(slab, blocks_past_the_classes_come_from_the_allocator) {
    unsigned char *p = bd_slab_alloc(&sl, BD_SLAB_MAX + 1);
    cr_assert_not_null(p);
    cr_assert_eq((uintptr_t)p % BD_SLAB_UNIT, 0);
    cr_assert_eq(sl.chunk_bytes, 0, "no chunk taken for it");
    memset(p, 1, bd_slab_size(BD_SLAB_MAX + 1));
    bd_slab_free(&sl, p, BD_SLAB_MAX + 1); /* free()d: ASan checks the pairing */
}
