/*
 * The buffer pool: every sensor's queue of readings is a chain of segments carved from one block
 * reserved at start under limits.memory (half of it; the other half bounds the flusher's pending
 * batches). A quiet sensor holds no segment; a bursty one holds as many as it needs.
 *
 * Two classes of segment. Large ones (BD_SEG_MIN_BYTES or more: a record of the most fields a
 * line may carry) and, in a pool of at least BD_POOL_SMALL_MIN_BYTES, small ones of
 * BD_SEG_SMALL_BYTES (12 cells: three readings of three fields) from half of the block. A
 * sensor starts a chain with a small segment when its record fits and one is free, and goes on
 * with large ones: a quiet sensor with a few pending readings holds 256 bytes, a bursty one
 * quickly moves to the large class. Either class stands in for the other when it runs out (a
 * record too large for a small segment only ever goes into a large one). Use is counted in
 * units of unit_bytes (the small size, or the large one in a pool of one class): the pressure
 * marks and a sensor's share are fractions of n_units. The block is reserved, not touched: the kernel maps its pages when a segment is first
 * used, so the resident size follows the most segments ever in use at once, not the budget.
 *
 * Threads: the ingest thread takes segments (bd_pool_take), the flusher thread gives drained
 * ones back (bd_pool_give). The hand-back is an SPSC ring of segment pointers (ring.h) whose
 * capacity is the number of segments, so it never fills. A segment is reused by the ingest
 * thread only after the flusher gave it back, and the flusher gives back only segments the
 * ingest thread has left (see the queue protocol in sensor.c): no segment is ever written by
 * one side while the other still reads it.
 */
#ifndef BUCKETD_POOL_H
#define BUCKETD_POOL_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"
#include "bucketd/ring.h"

/* A segment's header takes its first 64-byte line; cells follow, line-aligned. */
#define BD_SEG_HEADER 64
/* Smallest segment: 1 KiB, 60 cells -- a reading of up to 59 fields. */
#define BD_SEG_MIN_BYTES 1024
/* The small class: 256 bytes, the header and 12 cells. */
#define BD_SEG_SMALL_BYTES 256
/* Pools smaller than this have large segments only (a handful of segments split in two
 * classes would leave each sensor less room for its record). */
#define BD_POOL_SMALL_MIN_BYTES (256 * 1024)
/* Set in published once the producer has left a segment without linking a successor. */
#define BD_SEG_SEALED (UINT32_C(1) << 31)

/* A cell of a segment: the sensor table encodes a reading as a header cell and a cell a value
 * (sensor.c). */
struct bd_cell {
    uint64_t w[2];
};

struct bd_seg {
    /* Cells written and visible to the consumer; BD_SEG_SEALED once the producer left the
     * segment for good without a successor. Producer stores (release), consumer loads. */
    _Atomic uint32_t published;
    /* Cells the consumer has finished with, stored once per drain (release); the producer
     * reads it to tell whether an idle segment can be handed back. */
    _Atomic uint32_t consumed;
    /* The next segment of the chain (producer stores, release): once set, published is final. */
    _Atomic(struct bd_seg *) next;
    unsigned char pad_[BD_SEG_HEADER - 16];
    struct bd_cell cells[];
};

/*
 * Tests: called on entry to every bd_pool_take() (so once per segment taken, never per reading),
 * on the ingest thread. It may play the flusher between two takes (drain queues, give segments
 * back), and returns true to make this take fail as if every segment were in use. Set with
 * bd_pool_set_take_hook(); the daemon never sets one.
 */
typedef bool (*bd_pool_take_hook)(void *arg);

/* One class of segments: a part of the block, cut into equal segments. */
struct bd_pool_class {
    unsigned char *base;
    size_t seg_bytes;
    uint32_t seg_cells;  /* cells per segment */
    uint32_t seg_units;  /* units (bd_pool.unit_bytes) per segment */
    uint32_t n_segs;     /* 0: the class is absent */
    uint32_t bumped;     /* ingest thread: segments handed out of base for the first time */
    struct bd_ring free; /* flusher -> ingest: segments given back */
};

struct bd_pool {
    unsigned char *block;
    /* The large class (a record of max_record_cells cells always fits). */
    size_t seg_bytes;
    uint32_t seg_cells;
    uint32_t n_segs;
    struct bd_pool_class large;
    struct bd_pool_class small;  /* n_segs 0 in a pool under BD_POOL_SMALL_MIN_BYTES */
    size_t unit_bytes;           /* what use is counted in */
    uint32_t n_units;            /* units in all */
    bd_pool_take_hook take_hook; /* ingest thread: tests only, NULL otherwise */
    void *take_hook_arg;
    _Atomic uint64_t taken;      /* units ever taken (ingest thread writes) */
    _Atomic uint64_t given;      /* units ever given back (flusher thread writes) */
    _Atomic uint32_t high_water; /* most units in use at once (ingest thread writes) */
};

/*
 * Reserve bytes of segments, each large enough for a record of max_record_cells cells (a
 * reading of the most fields a line may carry). -EINVAL if bytes holds fewer than 16 segments,
 * -ENOMEM.
 */
int bd_pool_init(struct bd_pool *p, uint64_t bytes, uint32_t max_record_cells, struct bd_err *err);
void bd_pool_close(struct bd_pool *p);

/*
 * Ingest thread: a segment (its header reset) of at least cells cells (cells <= seg_cells), a
 * small one when small is set and cells fit in one; NULL when no segment that fits is free.
 * *seg_cells: its cells; *units: the units it counts for.
 */
struct bd_seg *bd_pool_take(struct bd_pool *p, uint32_t cells, bool small, uint32_t *seg_cells,
                            uint32_t *units);

/* Tests, on the ingest thread (or before it runs): set or clear (NULL) the take hook. */
void bd_pool_set_take_hook(struct bd_pool *p, bd_pool_take_hook hook, void *arg);

/* Flusher thread: hand back a segment the producer has left; returns the units it counted. */
uint32_t bd_pool_give(struct bd_pool *p, struct bd_seg *seg);

/* Any thread: units in use now (approximate off the two owning threads). */
static inline uint32_t bd_pool_in_use(const struct bd_pool *p) {
    /* given first: it never passes taken, so the difference cannot wrap. */
    uint64_t given = atomic_load_explicit(&p->given, memory_order_relaxed);
    uint64_t taken = atomic_load_explicit(&p->taken, memory_order_relaxed);
    return taken > given ? (uint32_t)(taken - given) : 0;
}

static inline uint32_t bd_pool_high_water(const struct bd_pool *p) {
    return atomic_load_explicit(&p->high_water, memory_order_relaxed);
}

#endif
