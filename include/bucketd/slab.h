/*
 * A slab of aligned blocks for the sensor table's sensors (one block each: struct, id,
 * measurement and tags). posix_memalign(128) of a few hundred bytes leaves up to 128 bytes of
 * slack beside every block that later allocations of the same thread rarely reuse; here blocks
 * are carved in multiples of BD_SLAB_UNIT from chunks of BD_SLAB_CHUNK bytes, and a freed block
 * goes on the free list of its size class for the next block of that size. One class is not a
 * multiple of the unit: BD_SLAB_SMALL (192 bytes, a short-named sensor), carved two at a time
 * from three units, so that one of each two sits at 64 mod 128 (its blocks are 64-byte
 * aligned, the others BD_SLAB_UNIT-aligned). Blocks larger than BD_SLAB_MAX come from
 * posix_memalign. Chunks are given back only by bd_slab_close().
 *
 * Threads: one (the sensor table's ingest thread); no locking.
 */
#ifndef BUCKETD_SLAB_H
#define BUCKETD_SLAB_H

#include <stddef.h>
#include <stdint.h>

#define BD_SLAB_UNIT 128
#define BD_SLAB_SMALL 192 /* the class between one unit and two: 64-byte aligned */
#define BD_SLAB_LINE 64   /* what every block size is a multiple of (and aligned to) */
#define BD_SLAB_MAX 2048
#define BD_SLAB_CHUNK (64 * 1024)
#define BD_SLAB_CLASSES (BD_SLAB_MAX / BD_SLAB_LINE)

struct bd_slab {
    void *free[BD_SLAB_CLASSES + 1]; /* by size in lines: a list linked through each block */
    unsigned char *chunks;           /* chunks, linked through their first unit */
    unsigned char *bump;             /* the current chunk's unused part */
    size_t bump_left;
    uint64_t chunk_bytes; /* chunks allocated, in bytes */
};

/* The size a block of size bytes takes: BD_SLAB_SMALL, or a multiple of BD_SLAB_UNIT. */
static inline size_t bd_slab_size(size_t size) {
    if (size > BD_SLAB_UNIT && size <= BD_SLAB_SMALL) {
        return BD_SLAB_SMALL;
    }
    return (size + BD_SLAB_UNIT - 1) & ~(size_t)(BD_SLAB_UNIT - 1);
}

void bd_slab_init(struct bd_slab *sl);
/* A block of bd_slab_size(size) bytes, uninitialised, BD_SLAB_UNIT-aligned (a BD_SLAB_SMALL
 * one: BD_SLAB_LINE-aligned); NULL when out of memory. */
void *bd_slab_alloc(struct bd_slab *sl, size_t size);
/* Give back a block of bd_slab_alloc(size) (the same size). */
void bd_slab_free(struct bd_slab *sl, void *p, size_t size);
/* Every chunk (blocks still out become invalid; the large ones are the caller's to free first). */
void bd_slab_close(struct bd_slab *sl);

#endif
