/*
 * The sensor table: series key -> sensor, each sensor with its own SPSC ring of readings and a
 * dirty flag that hands it to the flusher.
 *
 * Threads: the ingest thread creates sensors, grows field dictionaries and pushes readings
 * (bd_sensor_table_accept); the flusher thread pops dirty sensors and drains their rings. A
 * sensor is never freed before bd_sensor_table_free(), which runs after both threads stopped,
 * so the flusher may keep sensor pointers. Immutable parts (id, measurement, tags) are written
 * before the sensor is first published through the dirty queue (a release/acquire pair).
 */
#ifndef BUCKETD_SENSOR_H
#define BUCKETD_SENSOR_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/config.h"
#include "bucketd/parse.h"
#include "bucketd/ring.h"
#include "bucketd/stats.h"

/* Distinct field names one sensor may use over its lifetime. */
#define BD_SENSOR_MAX_FIELDS 64
/* Field names whose short form sits in the sensor's first cache line (see field_key). */
#define BD_SENSOR_KEY_SLOTS 4

/*
 * Layout: every reading of a sensor reads its first 64-byte line (lookup and field checks) and
 * the ring's producer line right after it; the two form one 128-byte pair (the block is 128-byte
 * aligned), so the adjacent-line prefetcher brings both with one miss. The rest is cold.
 */
struct bd_sensor {
    /* First line. Immutable after creation unless said otherwise. */
    alignas(BD_RING_CACHELINE) uint64_t hash; /* XXH3 of id */
    char *id;                                 /* series key, NUL-terminated: id_buf */
    uint32_t id_len;
    /* Field dictionary size: appended by the ingest thread, read by the flusher. A name's index
     * is published (release on n_fields) before any reading that uses it is pushed. */
    _Atomic uint32_t n_fields;
    /* 1 while the sensor sits in the dirty queue; see the hand-off protocol in sensor.c. */
    _Atomic uint32_t dirty;
    uint32_t recheck; /* ingest thread only: on the table's re-check list */
    /* Names of fields 0..BD_SENSOR_KEY_SLOTS-1 packed as length | bytes << 8 when at most 7
     * bytes long (exact, so a match needs no string), else 0. */
    uint64_t field_key[BD_SENSOR_KEY_SLOTS];

    struct bd_ring ring; /* at offset 64: its producer line completes the pair */

    /* Cold: immutable after creation. */
    char *measurement;
    uint32_t n_tags;
    char **tag_keys; /* sorted by the keys sent; stored escaped (names.h), as BSON keys */
    char **tag_values;

    /* The names as BSON keys (escaped as names.h says), NUL-terminated; entries below n_fields
     * are immutable. Where a name needed escaping, bit i of field_escaped (ingest thread only)
     * is set and the name as lines spell it follows the key's NUL: lines are matched by it. */
    char *field_names[BD_SENSOR_MAX_FIELDS];
    uint64_t field_escaped;

    /* Flusher thread only: its page accounting, and its link in the flusher's own list of
     * sensors whose drain an allocation failure interrupted (flusher_requeued: on that list). */
    void *flusher_state;
    struct bd_sensor *flusher_next;
    bool flusher_requeued;

    /* The id's bytes, in the same block: a lookup reads them at a fixed offset from the
     * sensor, so their cache miss overlaps the first line's instead of following it. */
    char id_buf[];
};

/* One decoded field value of a reading. */
struct bd_reading_value {
    uint16_t field; /* index into the sensor's field_names */
    uint8_t kind;   /* enum bd_value_kind: FLOAT, INT, UINT or BOOL */
    union {
        double f;
        int64_t i;
        uint64_t u;
        bool b;
    } v;
};

struct bd_sensor_table;

/* Called on the ingest thread when a ring crosses its high-water mark (half full). */
typedef void (*bd_sensor_wake_cb)(void *arg);

int bd_sensor_table_new(struct bd_sensor_table **out, const struct bd_config *cfg,
                        struct bd_stats *stats, struct bd_err *err);
void bd_sensor_table_free(struct bd_sensor_table *t);
void bd_sensor_table_set_wake(struct bd_sensor_table *t, bd_sensor_wake_cb cb, void *arg);
uint32_t bd_sensor_table_count(const struct bd_sensor_table *t);

/*
 * Ingest thread: accept one parsed point. Applies the time window, drops string fields, checks
 * field keys, finds or creates the sensor and pushes the reading into its ring. Returns 0 when
 * accepted, else a negative errno; every drop is already counted in the stats by reason.
 */
int bd_sensor_table_accept(struct bd_sensor_table *t, const struct bd_point *pt, int64_t now_ns);

/*
 * Ingest thread: end of a batch of accepts (a datagram, a TCP read). Readings accepted while
 * their sensor was already queued are only guaranteed to reach the flusher once this has run
 * (see the hand-off protocol in sensor.c), so call it before the thread goes idle. Cheap when
 * there is nothing to do.
 */
void bd_sensor_table_publish(struct bd_sensor_table *t);

/*
 * Ingest thread: true if any ring is above its high-water mark (TCP and UDP listeners use it to
 * pause reading).
 */
bool bd_sensor_table_congested(const struct bd_sensor_table *t);

/*
 * Ingest thread, UDP backpressure: true if the congested ring (the last to cross its high-water
 * mark) is still past the mark, and the flusher is able to drain (not stalled, see below).
 * The pause ends when bd_sensor_table_congested() turns false (the ring at a quarter or less)
 * or the flusher stalls.
 */
bool bd_sensor_table_udp_should_pause(const struct bd_sensor_table *t);

/*
 * Ingest thread: wake the flusher to drain now. A listener pausing for congestion calls it: the
 * ring that made it pause may have crossed its high-water mark before the flusher's last drain
 * passed it and refilled since without crossing again, and then nothing else would wake the
 * flusher before flush.interval, however long the pause.
 */
void bd_sensor_table_request_drain(struct bd_sensor_table *t);

/*
 * Flusher thread: say whether it has stopped draining rings: a bulk write is in flight, or a
 * failed one waits for its retry. Ingest thread: read it. While the flusher is stalled, a UDP
 * pause would move the buffering from the rings, sized for the slowest write, into the one
 * socket buffer all sensors share, which holds far less: UDP keeps reading into the rings.
 */
void bd_sensor_table_set_stalled(struct bd_sensor_table *t, bool stalled);
bool bd_sensor_table_stalled(const struct bd_sensor_table *t);

/* Flusher thread: true if a sensor waits in the dirty queue (nothing is popped). */
bool bd_sensor_table_has_dirty(struct bd_sensor_table *t);

/* Flusher thread: pop the next dirty sensor (its dirty flag cleared) or NULL. */
struct bd_sensor *bd_sensor_table_next_dirty(struct bd_sensor_table *t);

/*
 * Flusher thread: decode the reading at the consumer side of the sensor's ring. Returns the
 * number of cells it occupies (0 if the ring is empty); fills *ts_ns, vals[0..*n_vals).
 * The caller consumes the cells with bd_ring_consume() once done with them.
 */
uint32_t bd_sensor_peek_reading(struct bd_sensor *s, int64_t *ts_ns, struct bd_reading_value *vals,
                                uint32_t *n_vals);

/* Visit every sensor (any thread, once the ingest thread has stopped). */
void bd_sensor_table_foreach(struct bd_sensor_table *t, void (*fn)(struct bd_sensor *, void *),
                             void *arg);

#endif
