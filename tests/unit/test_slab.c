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
    cr_assert_eq(bd_slab_size(129), 192);
    cr_assert_eq(bd_slab_size(192), 192);
    cr_assert_eq(bd_slab_size(193), 256);
    cr_assert_eq(bd_slab_size(319), 384);
    unsigned char *prev = NULL;
    size_t prev_size = 0;
    for (size_t size = 1; size <= BD_SLAB_MAX; size += 37) {
        unsigned char *p = bd_slab_alloc(&sl, size);
        cr_assert_not_null(p);
        size_t align = bd_slab_size(size) == BD_SLAB_SMALL ? BD_SLAB_LINE : BD_SLAB_UNIT;
        cr_assert_eq((uintptr_t)p % align, 0, "size %zu", size);
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

/* 192-byte blocks come two from three units: one at 0 mod 128, its twin right after it at 64
 * mod 128; they share no byte with each other or with the blocks of other classes. */
Test(slab, small_blocks_come_in_pairs_from_three_units) {
    unsigned char *a = bd_slab_alloc(&sl, 150);
    unsigned char *b = bd_slab_alloc(&sl, 192);
    unsigned char *c = bd_slab_alloc(&sl, 200); /* 256: whole units again */
    unsigned char *d = bd_slab_alloc(&sl, 129);
    cr_assert_not_null(a);
    cr_assert_not_null(b);
    cr_assert_not_null(c);
    cr_assert_not_null(d);
    cr_assert_eq((uintptr_t)a % BD_SLAB_UNIT, 0);
    cr_assert_eq(b, a + BD_SLAB_SMALL, "the twin follows");
    cr_assert_eq((uintptr_t)b % BD_SLAB_UNIT, BD_SLAB_LINE);
    cr_assert_eq(c, a + 2 * BD_SLAB_SMALL, "the next block starts on a unit after the pair");
    cr_assert_eq((uintptr_t)c % BD_SLAB_UNIT, 0);
    cr_assert_eq(d, c + 256, "a new pair");
    memset(a, 1, BD_SLAB_SMALL);
    memset(b, 2, BD_SLAB_SMALL);
    memset(c, 3, 256);
    cr_assert_eq(a[BD_SLAB_SMALL - 1], 1);
    cr_assert_eq(b[0], 2);
    cr_assert_eq(b[BD_SLAB_SMALL - 1], 2);
    /* A freed small block serves the next small one, not another class. */
    bd_slab_free(&sl, b, 192);
    cr_assert_neq(bd_slab_alloc(&sl, 128), b);
    cr_assert_eq(bd_slab_alloc(&sl, 180), b);
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
