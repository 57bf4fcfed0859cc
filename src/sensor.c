/*
 * Sensor table: series key -> sensor, with one SPSC queue per sensor (segments of the buffer
 * pool) and a dirty queue that hands sensors with new readings to the flusher.
 *
 * Threads: the ingest thread owns the hash index, creates sensors, appends field names and is
 * the single producer of every sensor queue, of the dirty queue and the consumer of the reclaim
 * queue. The flusher thread is the single consumer of the first two and the producer of the
 * third, and likewise for the evict queue (ingest -> flusher) and the dead queue (back). A
 * sensor lives until it is evicted (see Eviction) or the table is freed.
 *
 * Index: open addressing, linear probing, at most half full. A slot is 8 bytes: the sensor's
 * address with the top 16 bits of its hash in the address's unused top bits, so a probe that
 * meets another sensor is rejected without touching it (all but 1 in 65,536); a tag match is
 * confirmed by the length and the bytes of the id (one miss, the sensor's first line and its
 * id, which follows it). Where addresses use those bits, slots hold bare addresses and every
 * probe reads the sensor. The sensor keeps no hash: moving it in the index (growth, or the
 * shift that empties an evicted sensor's slot: no tombstones) hashes its id again.
 *
 * Memory. Each sensor is one block (struct, id, measurement and tags) from the table's slab
 * (slab.h: 128-byte aligned, in 128-byte size classes, and a 192-byte class 64-byte aligned;
 * no slack beside each block), plus one allocation per field name longer than 6 bytes or
 * escaped (shorter ones live in field_key), so that eviction can give it all back. Their
 * sizes, with the index as it grows and an estimate of the flusher's page accounting, are
 * charged to limits.sensor_memory; a new sensor that would pass it is refused
 * (drop_sensor_memory). Names are bounded by limits.max_name, so one sensor costs at most a few
 * hundred KiB whatever it sends.
 *
 * Eviction. bd_sensor_table_sweep() looks at a part of the index at a time for sensors silent
 * for limits.sensor_idle whose queue is empty and handed back (no segment: wseg and first NULL;
 * not dirty, not on the re-check list, not reported idle) and whose readings no delta of the
 * flusher's batches holds any more (flusher_refs 0: the fill batch, the batch being written or
 * waiting for its retry). Evicted while held, the sensor's page accounting would leave with it
 * while a returning reading's new sensor began its own for the same bucket, and both deltas
 * could go in one bulk under one sequence number (a false writer conflict) or overfill a page.
 * Such a sensor is taken out of the index and pushed on the evict queue; the ingest thread
 * never touches it again. The flusher writes what it still holds for it, then pushes it on the
 * dead queue, and the next sweep frees it. Both queues hold each sensor once and at most
 * evict_cap sensors are between eviction and freeing, so neither fills.
 *
 * Hand-off protocol. The producer pushes a reading (a release store, see the queue protocol) and then looks at
 * the sensor's dirty flag with a plain load (acquire: an ordinary load on x86), which costs no
 * locked instruction, does not wait for the cell stores to drain, and leaves the line shared:
 *   - 0: the sensor is not queued (the consumer popped it, or it never was): the producer sets
 *     the flag to 1 and pushes the sensor on the dirty queue (a release store of its head). Only
 *     the producer ever writes 1 and it just read 0, so no exchange is needed, and the sensor is
 *     in the queue at most once.
 *   - 1: the sensor is queued or being drained. The reading will be drained unless the consumer
 *     already made its last look at this queue and cleared the flag after the value we read --
 *     the store-buffer race (each side writes one word, then reads the other's) that only a full
 *     barrier on both sides would close. Instead of paying a barrier per reading, the producer
 *     notes the sensor on a re-check list and settles the list once per batch, in
 *     bd_sensor_table_publish().
 * The consumer pops a sensor, clears its flag (release), then does an acq_rel read-modify-write
 * on t->handoff and only then drains. publish() does an acq_rel read-modify-write on the same
 * word, then re-reads the flag of every listed sensor and queues those that read 0. Take a
 * reading R that found the flag 1, set by the producer when it queued entry E, and the
 * consumer's pop of E:
 *   - If the consumer's RMW comes after publish's RMW in handoff's modification order, it
 *     synchronises with it (RMWs continue release sequences), so R's push happens before the
 *     drain, whose fresh acquire load of head sees R.
 *   - Otherwise publish's RMW synchronises with the consumer's, so the clear after popping E
 *     happens before the re-check, which reads that 0 -- and queues the sensor again, after R --
 *     or a 1 stored later by the producer itself. That later 1 cannot come before R's load in
 *     program order (R would have read it rather than the 1 of E, which the clear follows in the
 *     flag's modification order), so it comes with a queue entry pushed after R.
 * Either way R is drained. A reading that found 0 queues the sensor itself, after the push.
 *
 * Queue protocol. A sensor's queue is a chain of pool segments: a new chain starts with a
 * small one when the record fits (pool.h), the segments after it are large (either class
 * standing in for the other when it runs out); wcap is the producer's segment's size in cells,
 * and the consumer needs none (it reads up to published). A record (one reading) never
 * spans segments: it is written whole into the producer's segment (wseg) at wpos, then
 * published with a release store of wseg->published, which the consumer loads with acquire. A
 * record that does not fit starts a new segment, linked with a release store of the old one's
 * next (so the old one's published is final before the consumer can see the link), or, when the
 * producer has no segment, of the sensor's `first`, which the consumer takes (load acquire, then
 * clears: only the producer stores a non-NULL value, and only once the consumer took the
 * previous one, see below). Which of the two is decided after the take: a take that finds the
 * pool empty first takes back the reported idle segments, which may seal the producer's own.
 * A sealed segment is final: it never gets a successor. The consumer hands a segment back to
 * the pool once it has read all of it and the producer has left it: it has a successor, or it
 * is sealed.
 * An idle sensor must not keep its last segment: when a drain finds the queue empty in the
 * producer's own segment, the consumer stores what it consumed into the segment (release) and
 * puts the sensor on the reclaim queue (once: the reclaim flag). The producer, at its next
 * publish, takes it off and, if nothing was pushed since (wpos == consumed, acquire), seals the
 * segment (published |= SEALED, release), forgets it and marks the sensor dirty; the consumer
 * then finds it sealed and read to the end and gives it back. If the producer did push since,
 * it keeps the segment: the consumer will drain it and report it again. Sealing requires that
 * the consumer has read the segment, so it has taken it from `first`: the next chain's `first`
 * store never overwrites an untaken one.
 *
 * Cell encoding of one reading: a header cell {ts_ns, n_values} followed by n_values value cells
 * {value bits, field index | kind << 16}.
 */
#include "bucketd/sensor.h"

#include <bson/bson.h>
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "bucketd/log.h"
#include "bucketd/names.h"
#include "bucketd/slab.h"

_Static_assert(alignof(struct bd_sensor) == BD_SLAB_LINE, "a 192-byte block is 64-byte aligned");
_Static_assert(offsetof(struct bd_sensor, wseg) == BD_RING_LINE,
               "the queue's producer line must pair with the sensor's first line");
_Static_assert(BD_SENSOR_MAX_FIELDS <= 64, "bd_sensor_names.escaped has one bit per field");
_Static_assert(BD_SENSOR_KEY_SLOTS <= 8, "names_inline has one bit per key slot");
/* The short-named sensor (`m,site=s000123`: the struct, 15 bytes of id, none of tag
 * offsets and 15 of measurement and tag) fits a 192-byte slab block, bucketd-sim's
 * (`m1,rack=r07,sensor=s12345,site=plant-2`: 39 bytes of id, 4 of tag offsets, 39 of names) a
 * 256-byte one (issue 28); test_sensor checks the blocks they get. */
_Static_assert(offsetof(struct bd_sensor, id_buf) <= 158, "struct bd_sensor grew past 158 bytes");
_Static_assert(offsetof(struct bd_sensor, id_buf) + 15 + 15 <= BD_SLAB_SMALL,
               "a short-named sensor fits the slab's 192-byte class");
_Static_assert(offsetof(struct bd_sensor, rseg) == 2 * BD_RING_LINE,
               "what the flusher writes per reading starts after the producer's line");
_Static_assert(offsetof(struct bd_sensor, id_buf) < 3 * BD_RING_LINE,
               "a lookup finds the id's first bytes in the third line: a 192-byte block holds it");
_Static_assert(offsetof(struct bd_sensor, flusher_state) + sizeof(void *) <= 2 * BD_RING_LINE,
               "last_ns, accepted and wpos are written with every reading: in the producer's line");
_Static_assert(offsetof(struct bd_sensor, evicted_next) + sizeof(void *) <= BD_RING_LINE &&
                   offsetof(struct bd_sensor, flusher_evicted) < BD_RING_LINE,
               "the lookup's fields and the seldom written ones share the first line");
/* wpos, wcap and rpos are 16-bit: the largest segment holds a record of 1 + BD_PARSE_MAX_FIELDS
 * cells in a power of two of bytes (pool.c), far fewer than 65,536 cells. */
_Static_assert(2 * (BD_SEG_HEADER + (1 + BD_PARSE_MAX_FIELDS) * sizeof(struct bd_cell)) /
                       sizeof(struct bd_cell) <=
                   UINT16_MAX,
               "a segment's cells fit the 16-bit positions");

/* Pool thresholds, in eighths of its segments: wake the flusher early; pause TCP input and
 * resume it; pause UDP input and resume it. TCP waits first, from the wake-up mark on: its
 * senders hold what it does not read, so the pool keeps its upper part for datagrams, which
 * cannot wait long, and a TCP flood makes no more of the pool resident than the flusher needs
 * to keep busy (on an edge box the pool's resident part counts: issue 28). At the high mark no
 * new sensor is created: see bd_sensor_table_accept. */
#define POOL_WAKE_EIGHTHS 2
#define POOL_TCP_HIGH_EIGHTHS 2
#define POOL_TCP_LOW_EIGHTHS 1
#define POOL_HIGH_EIGHTHS 6
#define POOL_LOW_EIGHTHS 4

/* The re-check list is settled early when it fills (a batch of very many lines). */
#define RECHECK_MAX 1024
/* Initial index size: slots, a power of two. */
#define INITIAL_SLOTS 1024
/* What the flusher allocates for a sensor's page accounting (BD_PAGES_ONE_SLOT_BYTES, pages.h:
 * an object of its pool, without an allocator header): charged to the sensor up front. */
#define FLUSHER_SENSOR_COST 40
/* An allocation's cost beyond its size (the allocator's header and rounding). */
#define MALLOC_OVERHEAD 16
/* Short field names live in the sensor's field_key (see field_index): its bytes 1..len. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define INLINE_NAMES 1
#else
#define INLINE_NAMES 0
#endif
/* Index slots a sweep looks at per call (after a refusal: the whole index), and how often it
 * looks (after a refusal: sooner). */
#define SWEEP_SLOTS 65536
#define SWEEP_EVERY_NS BD_NS_PER_S
#define SWEEP_SOON_NS (100 * BD_NS_PER_MS)

/* An index slot: the sensor's address with the top 16 bits of its hash in the address's unused
 * top bits (tag_mask; 0 where addresses use them: then the address alone), 0 when empty. */
typedef uint64_t slot_t;
#define SLOT_TAG_MASK (UINT64_C(0xffff) << 48)

struct bd_sensor_table {
    /* Read-modify-written by both threads: see the hand-off protocol. Alone in its pair. */
    alignas(BD_RING_CACHELINE) _Atomic uint64_t handoff;

    alignas(BD_RING_CACHELINE) struct bd_stats *stats;

    /* The sensors' blocks (ingest thread only). */
    struct bd_slab slab;

    /* Hash index, ingest thread only. */
    slot_t *slots;
    uint64_t tag_mask; /* SLOT_TAG_MASK, or 0 once a sensor's address used those bits */
    uint32_t slot_mask;
    uint32_t count;
    uint32_t max_sensors;
    /* The sensor of the last reading accepted (NULL: none, or it was evicted since): a
     * sender's run of lines of one sensor finds it without a hash or a probe. */
    struct bd_sensor *last;

    /* Dirty queue: cells carry sensor pointers; capacity >= max_sensors, so it never fills
     * (a sensor is in it at most once). */
    struct bd_ring dirty;

    /* Sensors whose flag read 1 after a push since the last publish; ingest thread only. */
    struct bd_sensor **recheck;
    uint32_t n_recheck;

    /* The segments every queue is built from, and the sensors whose idle segment the flusher
     * reports (flusher -> ingest; capacity >= max_sensors, each sensor in it at most once). */
    struct bd_pool pool;
    struct bd_ring reclaim;
    uint32_t wake_segs;     /* in use above this: wake the flusher (once per crossing) */
    uint32_t tcp_high_segs; /* in use above this: congested (TCP waits) */
    uint32_t tcp_low_segs;  /* congestion ends at or below this */
    uint32_t high_segs;     /* in use above this: UDP pauses, no new sensor */
    uint32_t low_segs;      /* a UDP pause ends at or below this */
    bool wake_armed;
    /* The limits (bd_sensor_table_set_limits), ingest thread only. */
    uint32_t max_fields;
    uint32_t pool_fields; /* max_fields at start: what a pool segment holds a record of */
    int64_t max_late_ns;
    int64_t max_future_ns;

    bd_sensor_wake_cb wake;
    void *wake_arg;
    bool congested; /* ingest thread only: see bd_sensor_table_congested */

    struct bd_ratelimit limit_log;
    uint32_t max_name;     /* bytes; 0: no limit */
    uint64_t max_memory;   /* limits.sensor_memory; 0: no limit */
    uint64_t memory;       /* charged to the sensors that exist (or await freeing) */
    int64_t idle_ns;       /* limits.sensor_idle; 0: never evict */
    uint64_t next_serial;  /* the next sensor's serial */
    uint32_t share_segs;   /* the most segments one sensor's queue may hold */
    bool share_wake_armed; /* a sensor at its share wakes the flusher (once per segment taken) */
    uint32_t sweep_at;     /* next index slot the sweep looks at */
    bool sweep_all;        /* a refusal happened: the next sweep covers the whole index */
    int64_t swept_ns;      /* when the last sweep looked at the index */
    /* Eviction queues (see Eviction at the top). */
    struct bd_ring evict;
    struct bd_ring dead;
    uint32_t evict_cap;  /* sensors evicted and not yet freed, at most */
    uint32_t n_evicting; /* evicted, not yet freed */

    /* Written by the flusher, read by the ingest thread: see bd_sensor_table_set_stalled. */
    atomic_bool consumer_stalled;
};

/* The sensor of an index slot (NULL: empty). */
static inline struct bd_sensor *slot_sensor(const struct bd_sensor_table *t, slot_t e) {
    return (struct bd_sensor *)(uintptr_t)(e & ~t->tag_mask);
}

/* Zeroed memory aligned for types with alignas(BD_RING_CACHELINE) members. */
static void *zalloc_aligned(size_t size) {
    size = (size + BD_RING_CACHELINE - 1) & ~(size_t)(BD_RING_CACHELINE - 1);
    void *p = aligned_alloc(BD_RING_CACHELINE, size);
    if (p != NULL) {
        memset(p, 0, size);
    }
    return p;
}

static uint32_t next_pow2(uint32_t v) {
    uint32_t p = 2;
    while (p < v && p < (UINT32_C(1) << 31)) {
        p <<= 1;
    }
    return p;
}

static void sensor_free(struct bd_sensor_table *t, struct bd_sensor *s);

/* The limits a reload may change (bd_sensor_table_set_limits). */
static void take_limits(struct bd_sensor_table *t, const struct bd_config *cfg) {
    t->max_sensors = cfg->limits.max_sensors;
    t->max_fields = cfg->limits.max_fields;
    t->max_name = cfg->limits.max_name;
    t->max_memory = cfg->limits.sensor_memory;
    t->idle_ns = (int64_t)cfg->limits.sensor_idle_ms * BD_NS_PER_MS;
    t->max_late_ns = (int64_t)cfg->buckets.max_late_ms * BD_NS_PER_MS;
    t->max_future_ns = (int64_t)cfg->buckets.max_future_ms * BD_NS_PER_MS;
}

int bd_sensor_table_new(struct bd_sensor_table **out, const struct bd_config *cfg,
                        struct bd_stats *stats, struct bd_err *err) {
    int rc = 0;
    struct bd_sensor_table *t = zalloc_aligned(sizeof(*t));
    if (t == NULL) {
        rc = bd_err_set(err, -ENOMEM, "sensor table: out of memory");
        goto out;
    }
    t->stats = stats;
    take_limits(t, cfg);
    t->pool_fields = t->max_fields;
    t->limit_log.interval_ns = 10 * BD_NS_PER_S;
    t->limit_log.burst = 1;
    atomic_init(&t->handoff, 0);
    atomic_init(&t->consumer_stalled, false);
    t->slot_mask = INITIAL_SLOTS - 1;
    t->tag_mask = SLOT_TAG_MASK;
    bd_slab_init(&t->slab);
    t->slots = calloc(t->slot_mask + 1, sizeof(*t->slots));
    t->recheck = calloc(RECHECK_MAX, sizeof(*t->recheck));
    if (t->slots == NULL || t->recheck == NULL) {
        rc = bd_err_set(err, -ENOMEM, "sensor table: out of memory");
        goto out;
    }
    uint32_t cap = next_pow2(t->max_sensors);
    rc = bd_ring_init(&t->dirty, cap);
    if (rc == 0) {
        rc = bd_ring_init(&t->reclaim, cap);
    }
    /* Evictions in flight are bounded by a quarter of the sensors (at least 64): the flusher
     * releases them within a flush or two, and a sweep that finds the bound reached leaves the
     * rest for the next one. */
    t->evict_cap = BD_MAX(cap / 4, UINT32_C(64));
    if (rc == 0) {
        rc = bd_ring_init(&t->evict, t->evict_cap);
    }
    if (rc == 0) {
        rc = bd_ring_init(&t->dead, t->evict_cap);
    }
    if (rc < 0) {
        bd_err_set(err, rc, "sensor table: cannot allocate the sensor queues");
        goto out;
    }
    t->evict_cap = BD_MIN(bd_ring_capacity(&t->evict), bd_ring_capacity(&t->dead));
    rc = bd_pool_init(&t->pool, cfg->limits.memory / 2, 1 + t->max_fields, err);
    if (rc < 0) {
        goto out;
    }
    BD_ASSERT(t->pool.seg_cells <= UINT16_MAX); /* wpos, wcap, rpos */
    /* In units of the pool (pool.h): a large segment counts several where there are small. */
    t->wake_segs = t->pool.n_units / 8 * POOL_WAKE_EIGHTHS;
    t->tcp_high_segs = t->pool.n_units / 8 * POOL_TCP_HIGH_EIGHTHS;
    t->tcp_low_segs = t->pool.n_units / 8 * POOL_TCP_LOW_EIGHTHS;
    t->high_segs = t->pool.n_units / 8 * POOL_HIGH_EIGHTHS;
    t->low_segs = t->pool.n_units / 8 * POOL_LOW_EIGHTHS;
    t->share_segs =
        BD_MAX(t->pool.n_units / BD_SENSOR_SHARE_DIV, UINT32_C(2) * t->pool.large.seg_units);
    t->wake_armed = true;
    t->memory = (uint64_t)(t->slot_mask + 1) * sizeof(*t->slots);
    *out = t;
    t = NULL;
out:
    bd_sensor_table_free(t);
    return rc;
}

void bd_sensor_table_limits_room(const struct bd_sensor_table *t, uint32_t *max_sensors,
                                 uint32_t *max_fields) {
    /* Both queues hold each sensor at most once, so their capacity is the real sensor limit. */
    *max_sensors = BD_MIN(bd_ring_capacity(&t->dirty), bd_ring_capacity(&t->reclaim));
    *max_fields = t->pool_fields;
}

void bd_sensor_table_set_limits(struct bd_sensor_table *t, const struct bd_config *cfg) {
    uint32_t sensors_room, fields_room;
    bd_sensor_table_limits_room(t, &sensors_room, &fields_room);
    BD_ASSERT(cfg->limits.max_sensors <= sensors_room && cfg->limits.max_fields <= fields_room);
    take_limits(t, cfg);
}

/* An evicted sensor the flusher has not popped still holds its page accounting. */
static void free_evicted(struct bd_sensor_table *t, struct bd_ring *r) {
    uint32_t tail;
    while (bd_ring_available(r, &tail) != 0) {
        struct bd_sensor *s = bd_ring_ptr_at(r, tail);
        bd_ring_consume(r, 1);
        BD_ASSERT(s->flusher_state == NULL); /* the flusher releases its state first */
        sensor_free(t, s);
    }
}

void bd_sensor_table_free(struct bd_sensor_table *t) {
    if (t == NULL) {
        return;
    }
    if (t->slots != NULL) {
        for (uint32_t i = 0; i <= t->slot_mask; i++) {
            struct bd_sensor *s = slot_sensor(t, t->slots[i]);
            if (s != NULL) {
                BD_ASSERT(s->flusher_state == NULL); /* the flusher releases its state first */
                sensor_free(t, s);
            }
        }
    }
    if (t->evict.cells != NULL) {
        free_evicted(t, &t->evict);
    }
    if (t->dead.cells != NULL) {
        free_evicted(t, &t->dead);
    }
    free(t->slots);
    free(t->recheck);
    bd_ring_close(&t->dirty);
    bd_ring_close(&t->reclaim);
    bd_ring_close(&t->evict);
    bd_ring_close(&t->dead);
    bd_pool_close(&t->pool);
    bd_slab_close(&t->slab);
    free(t);
}

void bd_sensor_table_set_wake(struct bd_sensor_table *t, bd_sensor_wake_cb cb, void *arg) {
    t->wake = cb;
    t->wake_arg = arg;
}

uint32_t bd_sensor_table_count(const struct bd_sensor_table *t) {
    return t->count;
}

uint64_t bd_sensor_table_memory(const struct bd_sensor_table *t) {
    return t->memory;
}

const struct bd_pool *bd_sensor_table_pool(const struct bd_sensor_table *t) {
    return &t->pool;
}

void bd_sensor_table_foreach(struct bd_sensor_table *t, void (*fn)(struct bd_sensor *, void *),
                             void *arg) {
    for (uint32_t i = 0; i <= t->slot_mask; i++) {
        if (t->slots[i] != 0) {
            fn(slot_sensor(t, t->slots[i]), arg);
        }
    }
}

uint32_t bd_sensor_table_slots(const struct bd_sensor_table *t) {
    return t->slot_mask + 1;
}

const struct bd_sensor *bd_sensor_table_slot(const struct bd_sensor_table *t, uint32_t i) {
    return slot_sensor(t, t->slots[i]);
}

/* Whether field name i lives in the sensor's field_key (see field_index). */
static bool name_inline(const struct bd_sensor *s, uint32_t i) {
    return i < BD_SENSOR_KEY_SLOTS &&
           ((atomic_load_explicit(&s->names_inline, memory_order_relaxed) >> i) & 1);
}

/* Everything a sensor owns; its cost leaves the table's account. */
static void sensor_free(struct bd_sensor_table *t, struct bd_sensor *s) {
    uint32_t n = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    for (uint32_t i = 0; i < n; i++) {
        if (!name_inline(s, i)) {
            free((void *)bd_sensor_field_name(s, i));
        }
    }
    if (s->names != NULL) {
        free(s->names->more);
        free(s->names);
    }
    /* The measurement and the tags are in the sensor's own block. */
    BD_ASSERT(t->memory >= s->mem_cost);
    t->memory -= s->mem_cost;
    bd_slab_free(&t->slab, s,
                 s->slab_lines ? (size_t)s->slab_lines * BD_SLAB_LINE : BD_SLAB_MAX + 1);
}

/*
 * The size of a name as its BSON key (names.h) plus, when keep_name is set and it differs, the
 * name itself after the key's NUL.
 */
static size_t key_size(const struct bd_str *s, enum bd_name_kind kind, bool keep_name,
                       bool *escaped) {
    size_t klen = bd_name_escaped_len(s->ptr, s->len, kind);
    *escaped = klen != s->len;
    return klen + 1 + (*escaped && keep_name ? s->len + 1 : 0);
}

/* Write what key_size() measured at p; returns the byte after it. */
static char *put_key(char *p, const struct bd_str *s, enum bd_name_kind kind, bool keep_name) {
    size_t klen = bd_name_escaped_len(s->ptr, s->len, kind);
    if (klen == s->len) {
        memcpy(p, s->ptr, s->len);
        p[s->len] = '\0';
        return p + s->len + 1;
    }
    int rc = bd_name_escape(s->ptr, s->len, kind, p, klen + 1);
    BD_ASSERT(rc == (int)klen);
    p += klen + 1;
    if (keep_name) {
        memcpy(p, s->ptr, s->len);
        p[s->len] = '\0';
        p += s->len + 1;
    }
    return p;
}

static char *put_str(char *p, const struct bd_str *s) {
    memcpy(p, s->ptr, s->len);
    p[s->len] = '\0';
    return p + s->len + 1;
}

/* A new sensor's names from its point (bd_sensor_names_put): the measurement, then each tag's
 * key (escaped) and value. */
static char *put_name(void *arg, uint32_t i, char *dst) {
    const struct bd_point *pt = arg;
    if (i == 0) {
        return put_str(dst, &pt->name);
    }
    const struct bd_tag *tag = &pt->tags[(i - 1) / 2];
    return i % 2 ? put_key(dst, &tag->key, BD_NAME_TAG, false) : put_str(dst, &tag->value);
}

/* A sensor's hash, from its id: the index keeps only its top 16 bits (the slot's tag), so a
 * move within the index (growth, a removal's shift) hashes the id again. */
static uint64_t sensor_hash(const struct bd_sensor *s) {
    return XXH3_64bits(s->id_buf, s->id_len);
}

static void slot_insert(struct bd_sensor_table *t, slot_t *slots, uint32_t mask,
                        struct bd_sensor *s, uint64_t hash) {
    uint32_t i = (uint32_t)hash & mask;
    while (slots[i] != 0) {
        i = (i + 1) & mask;
    }
    slots[i] = (uint64_t)(uintptr_t)s | (hash & t->tag_mask);
}

/* Empty slot i and shift the entries after it in the probe run back, so every entry stays
 * reachable from its home slot without tombstones. */
static void slot_remove(struct bd_sensor_table *t, uint32_t i) {
    slot_t *slots = t->slots;
    uint32_t mask = t->slot_mask;
    uint32_t j = i;
    for (;;) {
        slots[i] = 0;
        for (;;) {
            j = (j + 1) & mask;
            if (slots[j] == 0) {
                return;
            }
            uint32_t home = (uint32_t)sensor_hash(slot_sensor(t, slots[j])) & mask;
            /* Entry j may move to i unless its home lies cyclically in (i, j]. */
            bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                break;
            }
        }
        slots[i] = slots[j];
        i = j;
    }
}

static int grow_index(struct bd_sensor_table *t) {
    uint32_t new_mask = t->slot_mask * 2 + 1;
    slot_t *slots = calloc((size_t)new_mask + 1, sizeof(*slots));
    if (slots == NULL) {
        return -ENOMEM;
    }
    for (uint32_t i = 0; i <= t->slot_mask; i++) {
        if (t->slots[i] != 0) {
            struct bd_sensor *s = slot_sensor(t, t->slots[i]);
            slot_insert(t, slots, new_mask, s, sensor_hash(s));
        }
    }
    free(t->slots);
    t->memory += (uint64_t)(new_mask - t->slot_mask) * sizeof(*slots);
    t->slots = slots;
    t->slot_mask = new_mask;
    t->sweep_at = 0;
    return 0;
}

/* A sensor whose address uses the tag's bits (not seen on Linux's usual address spaces): the
 * index keeps bare addresses from now on, and every hash comparison reads the sensor. */
static void drop_tags(struct bd_sensor_table *t) {
    for (uint32_t i = 0; i <= t->slot_mask; i++) {
        t->slots[i] &= ~t->tag_mask;
    }
    t->tag_mask = 0;
}

/* A refusal of a new sensor (counted by the caller): logged now and then, and the next sweep
 * looks at every sensor, so that room comes back as soon as idle ones can go. Under a flood this
 * runs for every refused line: nothing is formatted unless the log line is due. */
static void refuse_new(struct bd_sensor_table *t, const char *what, const char *key, uint64_t limit,
                       const char *unit) {
    t->sweep_all = true;
    if (bd_ratelimit_ok(&t->limit_log, bd_mono_ns())) {
        bd_warn("%s (%s=%" PRIu64 "%s): readings of new sensors are dropped until idle sensors "
                "are evicted (limits.sensor_idle)",
                what, key, limit, unit);
    }
}

/* A new sensor: validated names, linked into the index. NULL on a counted drop. */
static struct bd_sensor *sensor_create(struct bd_sensor_table *t, const struct bd_point *pt,
                                       uint64_t hash) {
    if (t->max_name > 0 && pt->series_key.len > t->max_name) {
        BD_STAT_ADD(t->stats, drop_name_too_long, 1);
        return NULL;
    }
    if (t->count >= t->max_sensors) {
        BD_STAT_ADD(t->stats, drop_sensor_limit, 1);
        refuse_new(t, "sensor limit reached", "limits.max_sensors", t->max_sensors, "");
        return NULL;
    }
    /* The id and measurement are BSON strings, tag keys keys (escaped below, so '.' or a
     * leading '$' are fine): each must be valid UTF-8 without NUL. */
    if (!bd_name_valid(pt->series_key.ptr, pt->series_key.len) ||
        !bd_name_valid(pt->name.ptr, pt->name.len)) {
        BD_STAT_ADD(t->stats, drop_bad_name, 1);
        return NULL;
    }
    /* The measurement and the tags (keys escaped), each NUL-terminated, after the id. */
    size_t names_len = pt->name.len + 1;
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        if (!bd_name_valid(pt->tags[i].key.ptr, pt->tags[i].key.len) ||
            !bson_utf8_validate(pt->tags[i].value.ptr, pt->tags[i].value.len, false)) {
            BD_STAT_ADD(t->stats, drop_bad_name, 1);
            return NULL;
        }
        bool escaped;
        names_len += key_size(&pt->tags[i].key, BD_NAME_TAG, false, &escaped);
        names_len += pt->tags[i].value.len + 1;
    }
    /* One block: the struct, the id, the tag offsets, the measurement and the tags. */
    _Static_assert(BD_PARSE_MAX_TAGS <= UINT16_MAX, "n_tags is 16-bit");
    bool wide;
    size_t block = bd_sensor_block_size(pt->series_key.len, pt->n_tags, names_len, &wide);
    /* What it will cost: the block, the index slots its arrival makes the index grow by (the
     * index is charged as it grows: at most half full, two to four 8-byte slots a sensor), and
     * the flusher's page accounting. */
    bool grow = (t->count + 1) * 2 > t->slot_mask + 1; /* at most half full: see lookup */
    size_t slab_bytes = bd_slab_size(block);
    uint64_t cost =
        slab_bytes + (slab_bytes > BD_SLAB_MAX ? MALLOC_OVERHEAD : 0) + FLUSHER_SENSOR_COST;
    uint64_t grown = grow ? (uint64_t)(t->slot_mask + 1) * sizeof(slot_t) : 0;
    if (t->max_memory > 0 && t->memory + cost + grown > t->max_memory) {
        BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
        refuse_new(t, "sensor memory full", "limits.sensor_memory", t->max_memory, " bytes");
        return NULL;
    }
    if (grow && grow_index(t) < 0) {
        goto oom;
    }
    /* From the slab: 128-byte aligned (the first line and the producer's pair), a 192-byte
     * block 64-byte aligned (see the layout in sensor_block.h). */
    _Static_assert(BD_SLAB_UNIT % BD_RING_CACHELINE == 0 && BD_SLAB_LINE == BD_RING_LINE,
                   "slab blocks align the sensor's lines");
    void *mem = bd_slab_alloc(&t->slab, block);
    if (mem == NULL) {
        goto oom;
    }
    struct bd_sensor *s = mem;
    memset(s, 0, offsetof(struct bd_sensor, id_buf));
    bd_sensor_names_put(s, pt->series_key.ptr, pt->series_key.len, pt->n_tags, wide, put_name,
                        (void *)pt);
    s->table = t;
    s->serial = t->next_serial++;
    s->mem_cost = (uint32_t)cost;
    s->slab_lines = slab_bytes > BD_SLAB_MAX ? 0 : (uint8_t)(slab_bytes / BD_SLAB_LINE);
    t->memory += cost;
    bd_sensor_atomics_init(s);
    if ((uint64_t)(uintptr_t)s & t->tag_mask) {
        drop_tags(t);
    }
    slot_insert(t, t->slots, t->slot_mask, s, hash);
    t->count++;
    return s;
oom:
    BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
    if (bd_ratelimit_ok(&t->limit_log, bd_mono_ns())) {
        bd_error("out of memory creating a sensor: its readings are dropped");
    }
    return NULL;
}

/*
 * Whether the n bytes at a and b are equal, in 8-byte words for a series key of 8 bytes or
 * more: the first and the last word at once (they overlap below 16 bytes), where two ids of one
 * sender most often differ, then those between. Inline, where memcmp is a call through the PLT
 * and a dispatch on the CPU for 20 to 60 bytes, every reading.
 */
static inline bool id_equal(const char *a, const char *b, size_t n) {
    if (n < 8) {
        return memcmp(a, b, n) == 0;
    }
    uint64_t a0, b0, a1, b1;
    memcpy(&a0, a, 8);
    memcpy(&b0, b, 8);
    memcpy(&a1, a + n - 8, 8);
    memcpy(&b1, b + n - 8, 8);
    if (((a0 ^ b0) | (a1 ^ b1)) != 0) {
        return false;
    }
    for (size_t i = 8; i + 8 < n; i += 8) {
        memcpy(&a0, a + i, 8);
        memcpy(&b0, b + i, 8);
        if (a0 != b0) {
            return false;
        }
    }
    return true;
}

static struct bd_sensor *lookup(struct bd_sensor_table *t, const struct bd_str *key,
                                uint64_t hash) {
    for (uint32_t i = (uint32_t)hash & t->slot_mask;; i = (i + 1) & t->slot_mask) {
        slot_t e = t->slots[i];
        if (e == 0) {
            return NULL;
        }
        /* The tag rejects all but 1 in 65,536 other sensors without reading them. */
        if (((e ^ hash) & t->tag_mask) != 0) {
            continue;
        }
        struct bd_sensor *s = slot_sensor(t, e);
        if (s->id_len == key->len && id_equal(s->id_buf, key->ptr, key->len)) {
            return s;
        }
    }
}

/* The last reading's sensor if key is its id: no hash, no probe; else NULL. */
static inline struct bd_sensor *lookup_last(const struct bd_sensor_table *t,
                                            const struct bd_str *key) {
    struct bd_sensor *s = t->last;
    if (s != NULL && s->id_len == key->len && id_equal(s->id_buf, key->ptr, key->len)) {
        return s;
    }
    return NULL;
}

/* The packed short form of a field name (see bd_sensor.field_key): 0 if longer than 7 bytes. */
static uint64_t pack_key(const struct bd_str *key) {
    size_t len = key->len;
    const unsigned char *p = (const unsigned char *)key->ptr;
    uint64_t w;
    /* Fixed-size loads inside [p, p + len) only, combined in registers: a memcpy of `len`
     * bytes into a local and a load of all 8 stalled on store forwarding, every reading. */
    if (len > 7) {
        return 0;
    } else if (len >= 4) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + len - 4, 4); /* overlaps lo by 8 - len bytes, with the same values */
        w = (uint64_t)lo | (uint64_t)hi << ((len - 4) * 8);
    } else if (len > 0) {
        w = (uint64_t)p[0] | (uint64_t)p[len / 2] << (len / 2 * 8) |
            (uint64_t)p[len - 1] << ((len - 1) * 8);
    } else {
        w = 0;
    }
    return (w << 8) | len;
}

/* Whether field name i is key (not NUL-terminated; strncmp stops at the name's own end). */
static bool field_is(const struct bd_sensor *s, uint32_t i, const struct bd_str *key) {
    const char *name = bd_sensor_field_name(s, i);
    if (!name_inline(s, i) && ((s->names->escaped >> i) & 1)) {
        name += strlen(name) + 1; /* the name as sent, after its BSON key */
    }
    return strncmp(name, key->ptr, key->len) == 0 && name[key->len] == '\0';
}

/* As field_is, from the first line alone when both names are short: packed forms are equal
 * exactly when the names are, and a long name packs to 0, which no short key equals. */
static bool field_matches(const struct bd_sensor *s, uint32_t i, const struct bd_str *key,
                          uint64_t packed) {
    if (i < BD_SENSOR_KEY_SLOTS && packed != 0) {
        return s->field_key[i] == packed;
    }
    return field_is(s, i, key);
}

/*
 * Index of a field name in the sensor's dictionary, appending it if new; -1 on a counted drop.
 * A sensor sends its fields in the same order every time, so the name at the field's position
 * in the line (hint) is tried first and the search is the exception. The append escapes the
 * name for BSON (names.h) once, and publishes it (release) before any reading using it is
 * pushed.
 */
static int field_index(struct bd_sensor_table *t, struct bd_sensor *s, const struct bd_str *key,
                       uint32_t hint) {
    uint32_t n = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    uint64_t packed = pack_key(key);
    if (hint < n && field_matches(s, hint, key, packed)) {
        return (int)hint;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (field_matches(s, i, key, packed)) {
            return (int)i;
        }
    }
    if (t->max_name > 0 && key->len > t->max_name) {
        BD_STAT_ADD(t->stats, drop_name_too_long, 1);
        return -1;
    }
    if (!bd_name_valid(key->ptr, key->len)) {
        BD_STAT_ADD(t->stats, drop_bad_name, 1);
        return -1;
    }
    if (n >= BD_SENSOR_MAX_FIELDS) {
        BD_STAT_ADD(t->stats, drop_field_limit, 1);
        return -1;
    }
    bool escaped;
    size_t size = key_size(key, BD_NAME_FIELD, true, &escaped);
    /* A short name needing no escape is its packed form: bytes 1..len of field_key[n], followed
     * by a zero byte (len <= 6, little-endian), so no string of its own is allocated. */
    bool in_key = INLINE_NAMES && n < BD_SENSOR_KEY_SLOTS && !escaped && key->len <= 6;
    /* The sensor's names block (its first name that is not inline) and its more array (its
     * field BD_SENSOR_KEY_SLOTS): each allocated whole and never moved, the flusher may be
     * reading names meanwhile. While names is NULL every name published is inline, so the
     * flusher does not read the pointer being set. */
    size_t block = !in_key && s->names == NULL ? sizeof(struct bd_sensor_names) : 0;
    size_t more = n >= BD_SENSOR_KEY_SLOTS && (s->names == NULL || s->names->more == NULL)
                      ? (BD_SENSOR_MAX_FIELDS - BD_SENSOR_KEY_SLOTS) * sizeof(char *)
                      : 0;
    uint64_t cost = (in_key ? 0 : size + MALLOC_OVERHEAD) +
                    (block > 0 ? block + MALLOC_OVERHEAD : 0) +
                    (more > 0 ? more + MALLOC_OVERHEAD : 0);
    if (t->max_memory > 0 && t->memory + cost > t->max_memory) {
        BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
        t->sweep_all = true;
        return -1;
    }
    if (block > 0) {
        s->names = calloc(1, block);
        if (s->names == NULL) {
            BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
            return -1;
        }
        s->mem_cost += (uint32_t)(block + MALLOC_OVERHEAD);
        t->memory += block + MALLOC_OVERHEAD;
    }
    if (more > 0) {
        s->names->more = malloc(more);
        if (s->names->more == NULL) {
            BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
            return -1;
        }
        s->mem_cost += (uint32_t)(more + MALLOC_OVERHEAD);
        t->memory += more + MALLOC_OVERHEAD;
    }
    char *name = NULL;
    if (!in_key) {
        name = malloc(size);
        if (name == NULL) {
            BD_STAT_ADD(t->stats, drop_sensor_memory, 1);
            return -1;
        }
        put_key(name, key, BD_NAME_FIELD, true);
        s->mem_cost += (uint32_t)(size + MALLOC_OVERHEAD);
        t->memory += size + MALLOC_OVERHEAD;
    }
    if (escaped) {
        s->names->escaped |= UINT64_C(1) << n; /* an escaped name is never inline */
    }
    if (n < BD_SENSOR_KEY_SLOTS) {
        s->field_key[n] = packed;
        if (in_key) {
            uint8_t bits = atomic_load_explicit(&s->names_inline, memory_order_relaxed);
            atomic_store_explicit(&s->names_inline, (uint8_t)(bits | 1u << n),
                                  memory_order_relaxed);
        } else {
            s->names->name[n] = name;
        }
    } else {
        s->names->more[n - BD_SENSOR_KEY_SLOTS] = name;
    }
    /* Pairs with the acquire load in bd_sensor_peek_reading(); the queue's own release/acquire
     * on head also orders it, this keeps the dictionary self-contained. */
    atomic_store_explicit(&s->n_fields, n + 1, memory_order_release);
    return (int)n;
}

void bd_sensor_table_request_drain(struct bd_sensor_table *t) {
    if (t->wake != NULL) {
        t->wake(t->wake_arg);
    }
}

static void enqueue(struct bd_sensor_table *t, struct bd_sensor *s) {
    /* Only the producer writes 1, and it just read 0: the sensor is not in the queue. The
     * push's release store of the queue head publishes the sensor (and its immutable parts)
     * to the consumer's acquire load in bd_sensor_table_next_dirty(). */
    atomic_store_explicit(&s->dirty, 1, memory_order_relaxed);
    bool ok = bd_ring_push_ptr(&t->dirty, s);
    BD_ASSERT(ok); /* capacity >= number of sensors, each queued at most once */
}

static void mark_dirty(struct bd_sensor_table *t, struct bd_sensor *s);

/* Take back the idle segments the flusher reported: see the queue protocol. */
static void take_back_idle(struct bd_sensor_table *t) {
    bool sealed = false;
    uint32_t tail;
    while (bd_ring_available(&t->reclaim, &tail) != 0) {
        struct bd_sensor *s = bd_ring_ptr_at(&t->reclaim, tail);
        /* Off the queue, then the flag cleared (release, pairing with the acquire load in
         * report_idle()): the flusher reports the sensor again only once its entry is free,
         * and a drain after this point does report it again. */
        bd_ring_consume(&t->reclaim, 1);
        atomic_store_explicit(&s->reclaim, 0, memory_order_release);
        struct bd_seg *seg = s->wseg;
        /* Pairs with the release store of consumed in report_idle(): every cell it covers has
         * been read, so sealing cannot hide one. */
        if (seg != NULL && atomic_load_explicit(&seg->consumed, memory_order_acquire) == s->wpos) {
            /* Pairs with the acquire load of published in read_segment(). */
            atomic_store_explicit(&seg->published, s->wpos | BD_SEG_SEALED, memory_order_release);
            s->wseg = NULL;
            s->wpos = 0;
            s->wcap = 0;
            mark_dirty(t, s); /* the flusher gives it back at its next look */
            sealed = true;
        }
    }
    /* Under pressure, that next look should not wait for flush.interval. */
    if (sealed && bd_pool_in_use(&t->pool) > t->wake_segs) {
        bd_sensor_table_request_drain(t);
    }
}

static void settle_rechecks(struct bd_sensor_table *t) {
    uint32_t n = t->n_recheck;
    if (n == 0) {
        return;
    }
    /* Pairs with the RMW in bd_sensor_table_next_dirty(); see the hand-off protocol. */
    atomic_fetch_add_explicit(&t->handoff, 1, memory_order_acq_rel);
    for (uint32_t i = 0; i < n; i++) {
        struct bd_sensor *s = t->recheck[i];
        s->recheck = 0;
        if (atomic_load_explicit(&s->dirty, memory_order_acquire) == 0) { /* see mark_dirty */
            enqueue(t, s);
        }
    }
    t->n_recheck = 0;
}

void bd_sensor_table_publish(struct bd_sensor_table *t) {
    take_back_idle(t);
    settle_rechecks(t);
}

/* After a push: see the hand-off protocol at the top of this file. */
static void mark_dirty(struct bd_sensor_table *t, struct bd_sensor *s) {
    /* Acquire, pairing with the release clear in bd_sensor_table_next_dirty(): a 0 read here
     * makes the consumer's pop of the old entry (its tail store) visible before we queue the
     * sensor again, so the queue never looks as if it held a sensor twice. */
    if (atomic_load_explicit(&s->dirty, memory_order_acquire) == 0) {
        enqueue(t, s);
        return;
    }
    if (s->recheck) {
        return;
    }
    if (t->n_recheck == RECHECK_MAX) {
        settle_rechecks(t);
    }
    s->recheck = 1;
    t->recheck[t->n_recheck++] = s;
}

/* A new segment for a sensor's queue, of at least cells cells, small if asked and possible (see
 * push). The pool's pressure marks are judged here, once per segment rather than per reading.
 * NULL when the pool is exhausted even after taking back the idle segments reported so far. */
static struct bd_seg *new_segment(struct bd_sensor_table *t, uint32_t cells, bool small,
                                  uint32_t *seg_cells, uint32_t *units) {
    struct bd_seg *seg = bd_pool_take(&t->pool, cells, small, seg_cells, units);
    if (seg == NULL) {
        take_back_idle(t); /* sealed ones come back after the flusher's next look */
        seg = bd_pool_take(&t->pool, cells, small, seg_cells, units);
    }
    uint32_t used = bd_pool_in_use(&t->pool);
    if (seg == NULL || used > t->tcp_high_segs) {
        if (!t->congested) {
            t->congested = true;
            bd_sensor_table_request_drain(t);
        }
    } else if (used > t->wake_segs) {
        if (t->wake_armed) {
            t->wake_armed = false;
            bd_sensor_table_request_drain(t);
        }
    } else {
        t->wake_armed = true;
    }
    return seg;
}

/* Whether the sensor's queue holds its share of the pool (see accept). Judged once per segment,
 * never per reading. The first refusal since a segment was last taken wakes the flusher: a
 * sensor at its share is drained now rather than at the next interval. */
static bool over_share(struct bd_sensor_table *t, const struct bd_sensor *s) {
    /* Relaxed: a stale value only delays the verdict to the next segment. */
    uint32_t held = s->segs_taken - atomic_load_explicit(&s->segs_given, memory_order_relaxed);
    if (held < t->share_segs) {
        return false;
    }
    if (t->share_wake_armed) {
        t->share_wake_armed = false;
        bd_sensor_table_request_drain(t);
    }
    return true;
}

/* The n cells of a record: a fixed-size copy for the usual sizes (a header and one to three
 * values), where a memcpy of a variable size is a call and a dispatch on the size, every
 * reading. */
static inline void copy_cells(struct bd_cell *restrict dst, const struct bd_cell *restrict src,
                              uint32_t n) {
    switch (n) {
    case 2:
        memcpy(dst, src, 2 * sizeof(*src));
        break;
    case 3:
        memcpy(dst, src, 3 * sizeof(*src));
        break;
    case 4:
        memcpy(dst, src, 4 * sizeof(*src));
        break;
    default:
        memcpy(dst, src, (size_t)n * sizeof(*src));
        break;
    }
}

/* Copy a record of n cells into the sensor's queue: 0, -ENOBUFS if the pool has no room, or
 * -EAGAIN if the sensor holds its share of a pool past half full. */
static int push(struct bd_sensor_table *t, struct bd_sensor *s, const struct bd_cell *cells,
                uint32_t n) {
    struct bd_seg *seg = s->wseg;
    uint32_t pos = s->wpos;
    if (seg == NULL || pos + n > s->wcap) {
        if (over_share(t, s)) {
            return -EAGAIN;
        }
        /* A new chain starts small (a quiet sensor's few readings); a full segment is followed
         * by a large one (the sensor is bursty). */
        uint32_t cap, units;
        struct bd_seg *fresh = new_segment(t, n, seg == NULL, &cap, &units);
        if (fresh == NULL) {
            return -ENOBUFS;
        }
        /* Read again: a take that found the pool empty took back the idle segments reported so
         * far (take_back_idle), and this sensor's own may have been one of them, sealed and
         * forgotten. A sealed segment never gets a successor (the consumer hands it back once
         * read to the end): the new one then starts a new chain through first. */
        seg = s->wseg;
        s->segs_taken += units;
        t->share_wake_armed = true;
        copy_cells(fresh->cells, cells, n);
        atomic_store_explicit(&fresh->published, n, memory_order_relaxed);
        /* Release, pairing with the acquire load of next (or of first) in read_segment(): the
         * cells and published of fresh come first, and for next the old segment's final
         * published too. */
        if (seg != NULL) {
            atomic_store_explicit(&seg->next, fresh, memory_order_release);
        } else {
            atomic_store_explicit(&s->first, fresh, memory_order_release);
        }
        s->wseg = fresh;
        s->wpos = (uint16_t)n;
        s->wcap = (uint16_t)cap;
        return 0;
    }
    copy_cells(&seg->cells[pos], cells, n);
    s->wpos = (uint16_t)(pos + n);
    /* Pairs with the acquire load of published in read_segment(). */
    atomic_store_explicit(&seg->published, pos + n, memory_order_release);
    return 0;
}

int bd_sensor_table_accept(struct bd_sensor_table *t, const struct bd_point *pt, int64_t now_ns) {
    int64_t ts = pt->has_time ? pt->time_ns : now_ns;
    if (ts < now_ns - t->max_late_ns) {
        BD_STAT_ADD(t->stats, drop_too_old, 1);
        return -ERANGE;
    }
    if (ts > now_ns + t->max_future_ns) {
        BD_STAT_ADD(t->stats, drop_too_new, 1);
        return -ERANGE;
    }
    if (pt->n_fields > t->max_fields) {
        BD_STAT_ADD(t->stats, drop_too_many_fields, 1);
        return -E2BIG;
    }
    uint32_t n_strings = 0;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        n_strings += pt->fields[i].kind == BD_VAL_STRING;
    }
    if (n_strings > 0) {
        BD_STAT_ADD(t->stats, string_fields_dropped, n_strings);
    }
    uint32_t n_vals = pt->n_fields - n_strings;
    if (n_vals == 0) {
        BD_STAT_ADD(t->stats, drop_no_numeric, 1);
        return -EINVAL;
    }

    struct bd_sensor *s = lookup_last(t, &pt->series_key);
    if (s == NULL) {
        uint64_t hash = XXH3_64bits(pt->series_key.ptr, pt->series_key.len);
        s = lookup(t, &pt->series_key, hash);
        if (s == NULL) {
            /* At three quarters of the pool, the room left is for the sensors already
             * flowing. One sensor alone holds at most its share (an eighth), so it never keeps
             * new sensors out; new sensors alone never congest the pool. */
            if (bd_pool_in_use(&t->pool) >= t->high_segs) {
                return -EAGAIN;
            }
            s = sensor_create(t, pt, hash);
            if (s == NULL) {
                return -ENOSPC;
            }
            s->last_ns = now_ns; /* seen, even if its first reading does not fit */
        }
        t->last = s;
    }
    /* The cells' line was last read by the flusher: ask for it now, the field checks below
     * run while it comes. */
    if (s->wseg != NULL) {
        __builtin_prefetch(&s->wseg->cells[s->wpos], 1);
    }

    struct bd_cell cells[1 + BD_PARSE_MAX_FIELDS];
    cells[0].w[0] = (uint64_t)ts;
    cells[0].w[1] = n_vals;
    uint32_t n = 1;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        const struct bd_field *f = &pt->fields[i];
        if (f->kind == BD_VAL_STRING) {
            continue;
        }
        int idx = field_index(t, s, &f->key, n - 1);
        if (idx < 0) {
            return -EINVAL;
        }
        uint64_t bits = 0;
        switch (f->kind) {
        case BD_VAL_FLOAT:
            memcpy(&bits, &f->v.f, sizeof(bits));
            break;
        case BD_VAL_INT:
            bits = (uint64_t)f->v.i;
            break;
        case BD_VAL_UINT:
            bits = f->v.u;
            break;
        default:
            bits = f->v.b ? 1 : 0;
            break;
        }
        cells[n].w[0] = bits;
        cells[n].w[1] = (uint64_t)idx | ((uint64_t)f->kind << 16);
        n++;
    }

    int rc = push(t, s, cells, n);
    if (rc == -EAGAIN) {
        return rc; /* not counted: the caller waits (TCP) or counts it (UDP) */
    }
    if (rc < 0) {
        BD_STAT_ADD(t->stats, drop_buffer_full, 1);
        mark_dirty(t, s);
        return rc;
    }
    if (now_ns > s->last_ns) {
        s->last_ns = now_ns; /* a wall clock stepped back does not reorder /sensors' pages */
    }
    s->accepted++;
    BD_STAT_ADD(t->stats, readings_accepted, 1);
    mark_dirty(t, s);
    return 0;
}

bool bd_sensor_table_congested(struct bd_sensor_table *t) {
    if (!t->congested) {
        return false;
    }
    take_back_idle(t);
    if (bd_pool_in_use(&t->pool) > t->tcp_low_segs) {
        return true;
    }
    t->congested = false;
    return false;
}

bool bd_sensor_table_udp_should_pause(struct bd_sensor_table *t) {
    return t->congested && bd_pool_in_use(&t->pool) > t->high_segs && !bd_sensor_table_stalled(t);
}

bool bd_sensor_table_udp_may_resume(struct bd_sensor_table *t) {
    take_back_idle(t);
    return bd_pool_in_use(&t->pool) <= t->low_segs || bd_sensor_table_stalled(t);
}

void bd_sensor_table_set_stalled(struct bd_sensor_table *t, bool stalled) {
    /* A hint for a pause decision, ordering nothing: relaxed. */
    atomic_store_explicit(&t->consumer_stalled, stalled, memory_order_relaxed);
}

bool bd_sensor_table_stalled(const struct bd_sensor_table *t) {
    return atomic_load_explicit(&t->consumer_stalled, memory_order_relaxed);
}

bool bd_sensor_table_has_dirty(struct bd_sensor_table *t) {
    uint32_t tail;
    return bd_ring_available(&t->dirty, &tail) != 0;
}

struct bd_sensor *bd_sensor_table_next_dirty(struct bd_sensor_table *t) {
    uint32_t tail;
    if (bd_ring_available(&t->dirty, &tail) == 0) {
        return NULL;
    }
    struct bd_sensor *s = bd_ring_ptr_at(&t->dirty, tail);
    bd_ring_consume(&t->dirty, 1);
    /* Clear, then the RMW, then the caller drains: see the hand-off protocol at the top of
     * this file. The RMW's release orders the clear before it. */
    atomic_store_explicit(&s->dirty, 0, memory_order_release);
    atomic_fetch_add_explicit(&t->handoff, 1, memory_order_acq_rel);
    return s;
}

/* Consumer: the drain found the producer's own segment read to the end; see the queue
 * protocol. */
static void report_idle(struct bd_sensor_table *t, struct bd_sensor *s) {
    /* Pairs with the acquire load in take_back_idle(). */
    atomic_store_explicit(&s->rseg->consumed, s->rpos, memory_order_release);
    /* Pairs with the release clear in take_back_idle(): a 0 here means the producer has
     * finished with the previous report. */
    if (atomic_load_explicit(&s->reclaim, memory_order_acquire) == 0) {
        atomic_store_explicit(&s->reclaim, 1, memory_order_relaxed);
        bool ok = bd_ring_push_ptr(&t->reclaim, s);
        BD_ASSERT(ok); /* capacity >= number of sensors, each in it at most once */
    }
}

/* Consumer: a segment of s read to the end and left by the producer goes back to the pool. */
static void give_back(struct bd_sensor_table *t, struct bd_sensor *s, struct bd_seg *seg) {
    uint32_t units = bd_pool_give(&t->pool, seg);
    /* Single writer (this thread); the producer reads it relaxed (over_share). */
    atomic_store_explicit(&s->segs_given,
                          atomic_load_explicit(&s->segs_given, memory_order_relaxed) + units,
                          memory_order_relaxed);
}

/* Consumer: the segment holding the next record (*published: its cells readable), or NULL if
 * the queue is empty. Hands back segments read to the end that the producer has left. */
static struct bd_seg *read_segment(struct bd_sensor *s, uint32_t *published) {
    struct bd_sensor_table *t = s->table;
    for (;;) {
        struct bd_seg *seg = s->rseg;
        if (seg == NULL) {
            /* Pairs with the release store of first in push(). */
            seg = atomic_load_explicit(&s->first, memory_order_acquire);
            if (seg == NULL) {
                return NULL;
            }
            atomic_store_explicit(&s->first, NULL, memory_order_relaxed);
            s->rseg = seg;
            s->rpos = 0;
        }
        /* Pairs with the release stores of published in push() and take_back_idle(). */
        uint32_t pub = atomic_load_explicit(&seg->published, memory_order_acquire);
        if (s->rpos < (pub & ~BD_SEG_SEALED)) {
            *published = pub & ~BD_SEG_SEALED;
            return seg;
        }
        /* Pairs with the release store of next in push(); after it, published is final. */
        struct bd_seg *next = atomic_load_explicit(&seg->next, memory_order_acquire);
        if (next != NULL) {
            /* A segment with a successor is never sealed (push links only the producer's
             * current segment); masked all the same, so that the bit can never pass for
             * cells to read beyond the segment's end. */
            pub = atomic_load_explicit(&seg->published, memory_order_acquire) & ~BD_SEG_SEALED;
            if (s->rpos < pub) {
                *published = pub;
                return seg;
            }
            give_back(t, s, seg);
            s->rseg = next;
            s->rpos = 0;
            continue;
        }
        if (pub & BD_SEG_SEALED) {
            give_back(t, s, seg);
            s->rseg = NULL;
            continue;
        }
        report_idle(t, s);
        return NULL;
    }
}

uint32_t bd_sensor_peek_reading(struct bd_sensor *s, int64_t *ts_ns, struct bd_reading_value *vals,
                                uint32_t *n_vals) {
    uint32_t published;
    struct bd_seg *seg = read_segment(s, &published);
    if (seg == NULL) {
        return 0;
    }
    const struct bd_cell *h = &seg->cells[s->rpos];
    uint32_t n = (uint32_t)h->w[1];
    BD_ASSERT(n >= 1 && n <= BD_PARSE_MAX_FIELDS && s->rpos + n + 1 <= published); /* whole */
    *ts_ns = (int64_t)h->w[0];
    /* Pairs with the release store in field_index(). */
    uint32_t known = atomic_load_explicit(&s->n_fields, memory_order_acquire);
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_cell *c = h + 1 + i;
        vals[i].field = (uint16_t)(c->w[1] & 0xffff);
        vals[i].kind = (uint8_t)((c->w[1] >> 16) & 0xff);
        BD_ASSERT(vals[i].field < known);
        switch (vals[i].kind) {
        case BD_VAL_FLOAT:
            memcpy(&vals[i].v.f, &c->w[0], sizeof(double));
            break;
        case BD_VAL_INT:
            vals[i].v.i = (int64_t)c->w[0];
            break;
        case BD_VAL_UINT:
            vals[i].v.u = c->w[0];
            break;
        default:
            vals[i].v.b = c->w[0] != 0;
            break;
        }
    }
    *n_vals = n;
    return n + 1;
}

/* ---- Eviction (see the top of this file) ---------------------------------------------------- */

/* Whether s may be evicted now: silent long enough, nothing of its queue left anywhere, and no
 * delta of the flusher's batches holding its readings. */
static bool evictable(const struct bd_sensor_table *t, const struct bd_sensor *s, int64_t now_ns) {
    if (now_ns - s->last_ns < t->idle_ns || s->recheck || s->wseg != NULL) {
        return false;
    }
    /* Acquire, pairing with the flusher's release clear (next_dirty) and release store of
     * reclaim: once both read 0 the flusher neither holds it in a queue nor will drain it
     * unasked; first is NULL once the flusher took the chain (wseg NULL: the chain is sealed).
     * The flusher created the deltas of every reading it drained before it reported the queue
     * empty (report_idle's release store of consumed, which take_back_idle acquired before it
     * sealed the segment), so flusher_refs is read here no older than that: relaxed suffices.
     * It only falls (the batches settled) until the sensor has readings again. */
    return atomic_load_explicit(&s->dirty, memory_order_acquire) == 0 &&
           atomic_load_explicit(&s->reclaim, memory_order_acquire) == 0 &&
           atomic_load_explicit(&s->first, memory_order_acquire) == NULL &&
           atomic_load_explicit(&s->flusher_refs, memory_order_relaxed) == 0;
}

void bd_sensor_table_sweep(struct bd_sensor_table *t, int64_t now_ns) {
    /* The idle segments the flusher reported since the last batch of input: without input no
     * publish takes them back, and a sensor holding one is never evictable. Sealed now (and
     * the sensors so marked dirty settled, as at the end of a batch), the flusher gives them
     * back at its next look and a later sweep can evict. Publishing more often than at the end
     * of every batch is always safe. */
    bd_sensor_table_publish(t);
    /* What the flusher released first: their memory is what a refused sensor waits for. */
    uint32_t tail;
    while (bd_ring_available(&t->dead, &tail) != 0) {
        struct bd_sensor *s = bd_ring_ptr_at(&t->dead, tail);
        bd_ring_consume(&t->dead, 1);
        sensor_free(t, s);
        t->n_evicting--;
    }
    if (t->idle_ns == 0 || t->count == 0 ||
        now_ns - t->swept_ns < (t->sweep_all ? SWEEP_SOON_NS : SWEEP_EVERY_NS)) {
        return;
    }
    t->swept_ns = now_ns;
    uint32_t todo = t->sweep_all ? t->slot_mask + 1 : BD_MIN(t->slot_mask + 1, SWEEP_SLOTS);
    t->sweep_all = false;
    uint32_t evicted = 0;
    uint32_t i = t->sweep_at & t->slot_mask;
    while (todo > 0 && t->n_evicting < t->evict_cap) {
        struct bd_sensor *s = slot_sensor(t, t->slots[i]);
        if (s != NULL && evictable(t, s, now_ns)) {
            /* The entry shifted into slot i (if any) is looked at next, so i stays. */
            slot_remove(t, i);
            if (t->last == s) {
                t->last = NULL;
            }
            t->count--;
            t->n_evicting++;
            bool ok = bd_ring_push_ptr(&t->evict, s);
            BD_ASSERT(ok); /* n_evicting <= evict_cap <= its capacity */
            evicted++;
            todo--;
            continue;
        }
        i = (i + 1) & t->slot_mask;
        todo--;
    }
    t->sweep_at = i;
    if (evicted > 0) {
        BD_STAT_ADD(t->stats, sensors_evicted, evicted);
        bd_sensor_table_request_drain(t); /* the flusher releases them */
    }
}

struct bd_sensor *bd_sensor_table_next_evicted(struct bd_sensor_table *t) {
    uint32_t tail;
    if (bd_ring_available(&t->evict, &tail) == 0) {
        return NULL;
    }
    struct bd_sensor *s = bd_ring_ptr_at(&t->evict, tail);
    bd_ring_consume(&t->evict, 1);
    s->flusher_evicted = true;
    return s;
}

void bd_sensor_table_release(struct bd_sensor_table *t, struct bd_sensor *s) {
    BD_ASSERT(s->flusher_evicted && s->flusher_state == NULL && s->flusher_refs == 0);
    bool ok = bd_ring_push_ptr(&t->dead, s);
    BD_ASSERT(ok); /* at most evict_cap sensors between eviction and freeing */
}
