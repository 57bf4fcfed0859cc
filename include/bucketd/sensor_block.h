/*
 * A sensor and its block: struct bd_sensor, the names that follow it in the same allocation
 * (the id, the measurement and the tags) and the accessors that read them, and the field names
 * it learns (struct bd_sensor_names). The sensor table (sensor.h, sensor.c) makes its sensors'
 * blocks in its slab and runs their queues; detached sensors (the flusher's unplaced records,
 * tests) come from bd_sensor_detached_new. The threads that read and write each field are
 * noted at the field; see sensor.h for the table's protocols.
 */
#ifndef BUCKETD_SENSOR_BLOCK_H
#define BUCKETD_SENSOR_BLOCK_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/parse.h"
#include "bucketd/pool.h"
#include "bucketd/ring.h"

struct bd_sensor_table;

/* Distinct field names one sensor may use over its lifetime. */
#define BD_SENSOR_MAX_FIELDS 64
/* Field names whose short form sits in the sensor's first cache line (see field_key). */
#define BD_SENSOR_KEY_SLOTS 4

/*
 * Layout: every reading of a sensor reads its first 64-byte line (lookup and field checks) and
 * writes the producer's end of its queue, the second line; a lookup also reads the id, in the
 * third line (id_buf, at 158). Their spare bytes hold fields the flusher reads but writes
 * at most once per drain (dirty, reclaim, its page accounting pointer, the list flags), or only
 * once the ingest thread has let go of the sensor (evicted_next), or never; what it writes per
 * reading or per segment (its end of the queue, segs_given, flusher_refs) is in the third line,
 * with the id, so that a drain never takes the producer's lines away from it. The struct ends
 * at 158 bytes and the names follow it in the same block (see id_buf), whose slab size
 * limits.sensor_memory charges (sensor.c): a short-named sensor (`m,site=s000123`: one tag and
 * an id of up to 16 bytes) fits a 192-byte block, bucketd-sim's ids
 * (`m1,rack=r07,sensor=s12345,site=plant-2`) a 256-byte one. Blocks of 256 bytes and more are
 * 128-byte aligned: the first two lines form one 128-byte pair, which the adjacent-line
 * prefetcher brings with one miss, and the id the next pair. A 192-byte block sits at 0 or 64
 * mod 128 (slab.h): at 0 it is laid out as above and its third line pairs with the next
 * block's first; at 64 the first line pairs with the previous block's third and the second
 * with the third, the id's. Either way a reading touches two 128-byte pairs, as with larger
 * blocks (the lookup's misses on the first line and on the id overlap: the id is at a fixed
 * offset from the sensor), but the third line, which the flusher writes, shares a pair with a
 * line the producer uses: the prefetcher may fetch it along on a producer's miss. No line is
 * written by both threads.
 */
struct bd_sensor {
    /* First line. Immutable after creation unless said otherwise. The struct is aligned to a
     * line, not a pair: a 192-byte block may sit at 64 mod 128. */
    /* Names of fields 0..BD_SENSOR_KEY_SLOTS-1 packed as length | bytes << 8 when at most 7
     * bytes long (exact, so a match needs no string), else 0. */
    alignas(BD_RING_LINE) uint64_t field_key[BD_SENSOR_KEY_SLOTS];
    struct bd_sensor_table *table; /* NULL for a detached sensor (bd_sensor_detached_new) */
    /* Flusher thread only, once the ingest thread evicted the sensor and handed it over
     * (bd_sensor_table_next_evicted): its link in the flusher's list of evicted sensors not yet
     * released. The ingest thread no longer writes the sensor then, so this line is not
     * shared. */
    struct bd_sensor *evicted_next;
    uint32_t id_len; /* bytes of the series key in id_buf */
    uint16_t n_tags;
    /* Field dictionary size: appended by the ingest thread, read by the flusher. A name's index
     * is published (release on n_fields) before any reading that uses it is pushed. */
    _Atomic uint8_t n_fields;
    /* 1 while the sensor sits in the dirty queue; see the hand-off protocol in sensor.c. */
    _Atomic uint8_t dirty;
    /* 1 while queued for the producer to take back an idle segment (flusher sets, ingest
     * clears). */
    _Atomic uint8_t reclaim;
    uint8_t recheck; /* ingest thread only: on the table's re-check list */
    /* Bit i set: field name i (i < BD_SENSOR_KEY_SLOTS) is read from field_key[i]. Set by the
     * ingest thread before it publishes the name (n_fields), read by the flusher after. */
    _Atomic uint8_t names_inline;
    /* Ingest thread, set at creation: the block's size in slab lines (BD_SLAB_LINE, slab.h), 0
     * for a block larger than the slab's classes. */
    uint8_t slab_lines;
    uint8_t tags_wide; /* the tag offsets after the id are 32-bit (else 16): bd_sensor_tag_key */
    /* Flusher thread only, set when a sensor joins one of its lists (see below). */
    bool flusher_requeued;
    bool flusher_evicted; /* handed over by bd_sensor_table_next_evicted */

    /* Second line: the producer's end of the queue (ingest thread only) and the hand-over of
     * a new chain (see the queue protocol in sensor.c); its spare bytes hold fields that are
     * immutable after creation or written seldom. */
    alignas(BD_RING_LINE) struct bd_seg *wseg; /* segment being filled, NULL: none */
    /* First segment of a new chain, for the consumer to take (producer stores, consumer
     * takes and clears). */
    _Atomic(struct bd_seg *) first;
    /* Ingest thread only: when the last reading was accepted (wall clock, ns; never moves
     * back), for eviction and /sensors, and how many were. Stored with every reading, in the
     * line the reading writes anyway. */
    int64_t last_ns;
    uint64_t accepted;
    /* Cells written into wseg, and the cells it holds (its class's, pool.h): a segment holds
     * fewer than 65,536 cells (sensor.c checks the pool's). */
    uint16_t wpos;
    uint16_t wcap;
    /* Ingest thread only: the pool units (pool.h) this queue ever took. */
    uint32_t segs_taken;
    /* The field names that are not read from field_key (names_inline), NULL while there is
     * none: see struct bd_sensor_names. */
    struct bd_sensor_names *names;
    /* Creation order, unique over the table's life: orders sensors of equal last_ns for
     * /sensors' paging. */
    uint64_t serial;
    /* Flusher thread only: the sensor's page accounting (struct bd_pages, pages.h, which also
     * holds the sensor's share of the fill batch); NULL while it has none (yet, or its
     * allocation failed). */
    void *flusher_state;

    /* Third line: written by the flusher per reading or per segment; the id follows. */
    /* Flusher thread only: the consumer's end of the queue, and its link in its list of
     * sensors whose drain an allocation failure interrupted (flusher_requeued: on that list). */
    struct bd_seg *rseg;
    struct bd_sensor *flusher_next;
    /* Flusher thread writes (once per segment it hands back, its units), the ingest thread
     * reads when the queue needs a new segment: segs_taken - segs_given is what the queue
     * holds. */
    _Atomic uint32_t segs_given;
    /* Deltas of the flusher's batches that refer to this sensor (batch.c): the flusher alone
     * writes it (relaxed); the ingest thread reads it before evicting (see Eviction in sensor.c).
     * An evicted sensor is released only once none does. */
    _Atomic uint32_t flusher_refs;
    /* Ingest thread only (written at creation and when the sensor learns a name that needs an
     * allocation, read when it is freed): the bytes charged to the table's sensor memory for
     * this sensor (limits.sensor_memory). */
    uint32_t mem_cost;
    uint16_t rpos; /* flusher thread only: cells of rseg consumed (as wpos) */

    /*
     * The names, in the same block: the id's bytes first (a lookup reads them at a fixed
     * offset from the sensor, so their cache miss overlaps the first line's instead of
     * following it), NUL-terminated; then the offsets of tags 1..n_tags-1's keys from the
     * measurement (16-bit, or 32-bit when tags_wide; unaligned: read with memcpy; tag 0's key
     * follows the measurement's NUL); then the measurement and each tag's key and value,
     * NUL-terminated (bd_sensor_measurement, bd_sensor_tag_key, bd_sensor_tag_value). The names
     * of short fields live inside field_key: one allocation per sensor.
     */
    char id_buf[];
};

/*
 * A sensor's field names as BSON keys (escaped as names.h says), NUL-terminated, through
 * bd_sensor_field_name(); entries below n_fields are immutable. A name of at most 6 bytes that
 * needs no escaping, among the first BD_SENSOR_KEY_SLOTS, is read from its packed form in
 * field_key (which holds it NUL-terminated on a little-endian machine) and needs no pointer;
 * the others are here. The sensor's names block, and its more array, are each allocated once
 * and never moved: the flusher reads them while the ingest thread appends. Where a name needed
 * escaping, bit i of escaped (ingest thread only) is set and the name as lines spell it follows
 * the key's NUL: lines are matched by it.
 */
struct bd_sensor_names {
    uint64_t escaped;
    char *name[BD_SENSOR_KEY_SLOTS]; /* fields 0..BD_SENSOR_KEY_SLOTS-1 not inline */
    char **more;                     /* fields BD_SENSOR_KEY_SLOTS.. (up to the maximum) */
};

/* Field name i (i < n_fields). */
static inline const char *bd_sensor_field_name(const struct bd_sensor *s, uint32_t i) {
    if (i < BD_SENSOR_KEY_SLOTS) {
        if ((atomic_load_explicit(&s->names_inline, memory_order_relaxed) >> i) & 1) {
            return (const char *)&s->field_key[i] + 1;
        }
        return s->names->name[i];
    }
    return s->names->more[i - BD_SENSOR_KEY_SLOTS];
}

/* The series key, NUL-terminated (id_len bytes). */
static inline const char *bd_sensor_id(const struct bd_sensor *s) {
    return s->id_buf;
}

/* Bytes of the tag offsets after the id's NUL (tags 1..n_tags-1: tag 0's key is implicit). */
static inline size_t bd_sensor_tag_offsets_size(uint32_t n_tags, bool wide) {
    return n_tags > 1 ? (size_t)(n_tags - 1) * (wide ? 4 : 2) : 0;
}

/* The measurement, NUL-terminated. */
static inline const char *bd_sensor_measurement(const struct bd_sensor *s) {
    return s->id_buf + s->id_len + 1 + bd_sensor_tag_offsets_size(s->n_tags, s->tags_wide);
}

/* Tag i's key and value (i < n_tags), NUL-terminated; the value follows the key's NUL. */
static inline const char *bd_sensor_tag_key(const struct bd_sensor *s, uint32_t i) {
    const char *m = bd_sensor_measurement(s);
    if (i == 0) {
        return m + strlen(m) + 1;
    }
    const char *offs = s->id_buf + s->id_len + 1 + (size_t)(i - 1) * (s->tags_wide ? 4 : 2);
    uint32_t off;
    if (s->tags_wide) {
        memcpy(&off, offs, 4);
    } else {
        uint16_t o;
        memcpy(&o, offs, 2);
        off = o;
    }
    return m + off;
}
static inline const char *bd_sensor_tag_value(const struct bd_sensor *s, uint32_t i) {
    const char *key = bd_sensor_tag_key(s, i);
    return key + strlen(key) + 1;
}

/*
 * The size of a sensor's block (struct and names, see id_buf) for an id of id_len bytes and
 * names_len bytes of measurement and tags (each with its NUL): *wide says whether the tag
 * offsets need 32 bits. bd_sensor_names_put() writes the names into it.
 */
size_t bd_sensor_block_size(size_t id_len, uint32_t n_tags, size_t names_len, bool *wide);

/*
 * Write a sensor's identity into its block (bd_sensor_block_size bytes, the struct zeroed):
 * the id, then the tag offsets, measurement and tags, each put by put(arg, i, dst) for string
 * i (0: the measurement, 1 + 2k: tag k's key, 2 + 2k: its value), which writes it with its NUL
 * and returns the byte after it. Sets id_len, n_tags and tags_wide.
 */
void bd_sensor_names_put(struct bd_sensor *s, const char *id, size_t id_len, uint32_t n_tags,
                         bool wide, char *(*put)(void *arg, uint32_t i, char *dst), void *arg);

/* Initialise a new sensor's atomics (all zero / NULL): the struct was zeroed with memset, which
 * C11 does not count as initialising an atomic. */
void bd_sensor_atomics_init(struct bd_sensor *s);

/*
 * A sensor outside any table (the flusher's unplaced spool records, tests): its block from
 * aligned_alloc with the id, measurement and tags (keys[i], values[i]) as given (BSON-ready,
 * NUL-free), the rest zero. -ENOMEM, or -EINVAL for more than UINT16_MAX tags. Freed with
 * free() (the field names are the owner's).
 */
int bd_sensor_detached_new(struct bd_sensor **out, const struct bd_str *id,
                           const struct bd_str *measurement, const struct bd_str *keys,
                           const struct bd_str *values, uint32_t n_tags);

#endif
