/*
 * The sensor table: series key -> sensor, each sensor with its own SPSC queue of readings (a
 * chain of segments from the shared buffer pool, pool.h) and a dirty flag that hands it to the
 * flusher.
 *
 * Threads: the ingest thread creates sensors, grows field dictionaries and pushes readings
 * (bd_sensor_table_accept); the flusher thread pops dirty sensors and drains their queues.
 * Immutable parts (id, measurement, tags) are written before the sensor is first published
 * through the dirty queue (a release/acquire pair).
 *
 * Eviction (limits.sensor_idle): the ingest thread takes a sensor that has been idle that long,
 * whose queue is empty and handed back, out of its index and passes it to the flusher
 * (bd_sensor_table_next_evicted); a reading of the same series creates a new sensor. A sensor
 * that a delta of the flusher's batches still refers to is not evicted (the new sensor would
 * start page accounting of its own for the same buckets). The flusher keeps the evicted sensor
 * until nothing of it is left to write, then hands it back (bd_sensor_table_release) and the
 * ingest thread frees it. So the flusher may keep sensor pointers until it releases them;
 * everything else is freed by bd_sensor_table_free(), which runs after both threads stopped.
 */
#ifndef BUCKETD_SENSOR_H
#define BUCKETD_SENSOR_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/config.h"
#include "bucketd/parse.h"
#include "bucketd/pool.h"
#include "bucketd/ring.h"
#include "bucketd/sensor_block.h"
#include "bucketd/stats.h"

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

/* Called on the ingest thread when the buffer pool passes its wake-up mark (a quarter in use):
 * the flusher should drain now rather than at the next interval. */
typedef void (*bd_sensor_wake_cb)(void *arg);

/* Reserves the buffer pool (half of limits.memory). */
int bd_sensor_table_new(struct bd_sensor_table **out, const struct bd_config *cfg,
                        struct bd_stats *stats, struct bd_err *err);
void bd_sensor_table_free(struct bd_sensor_table *t);
/*
 * How far a reload may raise limits.max_sensors and limits.max_fields: the capacity of the
 * sensor queues and the record size of the pool's segments, both sized at start.
 */
void bd_sensor_table_limits_room(const struct bd_sensor_table *t, uint32_t *max_sensors,
                                 uint32_t *max_fields);
/*
 * Ingest thread (a reload): take cfg's limits.max_sensors and limits.max_fields (within the
 * room above), limits.max_name, limits.sensor_memory, limits.sensor_idle and the accepted time
 * window (buckets.max_late, buckets.max_future). A lower max_sensors or sensor_memory keeps the
 * sensors already known; only new ones are refused.
 */
void bd_sensor_table_set_limits(struct bd_sensor_table *t, const struct bd_config *cfg);
void bd_sensor_table_set_wake(struct bd_sensor_table *t, bd_sensor_wake_cb cb, void *arg);
uint32_t bd_sensor_table_count(const struct bd_sensor_table *t);

/* Any thread: the pool the queues are built from (for its gauges). */
const struct bd_pool *bd_sensor_table_pool(const struct bd_sensor_table *t);

/*
 * Ingest thread: accept one parsed point. Applies the time window, drops string fields, checks
 * names (limits.max_name) and field keys, finds or creates the sensor and pushes the reading
 * into its queue. Returns 0 when accepted, else a negative errno; every drop is already counted
 * in the stats by reason, except -EAGAIN: the sensor is busy and nothing was counted. Busy means
 * this sensor's queue already holds its share of the buffer pool (BD_SENSOR_SHARE_DIV: one
 * sensor sending faster than it is written cannot take the room of the others), or the sensor
 * is new and the pool three quarters full (a flood of new names cannot take the room of the
 * sensors already flowing). The caller decides: a TCP connection stops reading until bd_ingest_resume, UDP counts
 * the reading in drop_sensor_busy.
 */
int bd_sensor_table_accept(struct bd_sensor_table *t, const struct bd_point *pt, int64_t now_ns);

/* A sensor's share of the buffer pool: 1/BD_SENSOR_SHARE_DIV of its segments (at least 2); and
 * of the flusher's batches while other sensors wait to be drained. */
#define BD_SENSOR_SHARE_DIV 8

/*
 * Ingest thread, about once a second (the daemon calls it at every flusher doorbell): take back
 * the idle segments the flusher reported (as publish does: input may have stopped), free the
 * sensors the flusher released, and evict sensors idle for limits.sensor_idle (now_ns: wall
 * clock). The index is swept a part at a time, so one call stays short with any number of
 * sensors; a new sensor refused for max_sensors or sensor_memory makes the next call sweep
 * further. Evicted sensors are counted in sensors_evicted.
 */
void bd_sensor_table_sweep(struct bd_sensor_table *t, int64_t now_ns);

/* Flusher thread: the next sensor the ingest thread evicted, or NULL. Its queue is empty. */
struct bd_sensor *bd_sensor_table_next_evicted(struct bd_sensor_table *t);

/* Flusher thread: done with an evicted sensor (its flusher state freed, no batch refers to it):
 * the ingest thread frees it at its next sweep. */
void bd_sensor_table_release(struct bd_sensor_table *t, struct bd_sensor *s);

/* Ingest thread: bytes of sensor state now (ids, names, tags, index, the flusher's page
 * accounting estimated), against limits.sensor_memory. */
uint64_t bd_sensor_table_memory(const struct bd_sensor_table *t);

/*
 * Ingest thread: end of a batch of accepts (a datagram, a TCP read). Readings accepted while
 * their sensor was already queued are only guaranteed to reach the flusher once this has run
 * (see the hand-off protocol in sensor.c), so call it before the thread goes idle. It also takes
 * back the idle segments the flusher reported. Cheap when there is nothing to do.
 */
void bd_sensor_table_publish(struct bd_sensor_table *t);

/*
 * Ingest thread: true while the buffer pool is congested: it passed a quarter in use (or ran
 * out) and has not yet come back to an eighth. TCP listeners stop reading meanwhile. Takes
 * back the idle segments the flusher reported first (a paused listener publishes nothing).
 */
bool bd_sensor_table_congested(struct bd_sensor_table *t);

/*
 * Ingest thread, UDP backpressure: true while the pool is past three quarters and the flusher
 * is able to drain (not stalled, see below). The pause ends when bd_sensor_table_udp_may_resume()
 * turns true: the pool is back at half (idle segments the flusher reported taken back first) or
 * the flusher stalls.
 */
bool bd_sensor_table_udp_should_pause(struct bd_sensor_table *t);
bool bd_sensor_table_udp_may_resume(struct bd_sensor_table *t);

/*
 * Ingest thread: wake the flusher to drain now. A listener pausing for congestion calls it, so
 * a pause never waits for flush.interval.
 */
void bd_sensor_table_request_drain(struct bd_sensor_table *t);

/*
 * Flusher thread: say whether it has stopped draining: its pending batches reached their half
 * of limits.memory. Ingest thread: read it. While the flusher is stalled, a UDP pause would move
 * the buffering from the pool into the one socket buffer all sensors share, which holds far
 * less: UDP keeps reading into the pool.
 */
void bd_sensor_table_set_stalled(struct bd_sensor_table *t, bool stalled);
bool bd_sensor_table_stalled(const struct bd_sensor_table *t);

/* Flusher thread: true if a sensor waits in the dirty queue (nothing is popped). */
bool bd_sensor_table_has_dirty(struct bd_sensor_table *t);

/* Flusher thread: pop the next dirty sensor (its dirty flag cleared) or NULL. */
struct bd_sensor *bd_sensor_table_next_dirty(struct bd_sensor_table *t);

/*
 * Flusher thread: decode the reading at the consumer end of the sensor's queue. Returns the
 * number of cells it occupies (0 if the queue is empty); fills *ts_ns, vals[0..*n_vals).
 * The caller consumes the cells with bd_sensor_consume() once done with them. Finding the queue
 * empty hands drained segments back to the pool (and reports an idle one to the producer).
 */
uint32_t bd_sensor_peek_reading(struct bd_sensor *s, int64_t *ts_ns, struct bd_reading_value *vals,
                                uint32_t *n_vals);

/* Flusher thread: the reading peeked (cells of it) is done with. */
static inline void bd_sensor_consume(struct bd_sensor *s, uint32_t cells) {
    s->rpos = (uint16_t)(s->rpos + cells);
}

/* ---- Listing (GET /sensors, bucketd_sensors_silent) ---- */

/* A place in the listing order: last_ns, then serial (unique), ascending. */
struct bd_sensor_pos {
    int64_t last_ns;
    uint64_t serial;
};

/* One sensor listed. s stays valid while the ingest thread does not return to its loop (only
 * its own sweep frees sensors). */
struct bd_sensor_info {
    const struct bd_sensor *s;
    struct bd_sensor_pos pos;
    uint64_t accepted;
};

/*
 * Ingest thread: the sensors tracked whose last reading is older than before_ns (wall clock;
 * INT64_MAX: every sensor) and that come after *after (NULL: from the first), in the listing
 * order, the first cap of them into out[0..cap). Returns how many; *more says whether others
 * follow. One pass over the index with a bounded heap: time linear in the index size (at most
 * twice limits.max_sensors slots), memory out alone; allocates nothing.
 */
uint32_t bd_sensor_table_list(const struct bd_sensor_table *t, const struct bd_sensor_pos *after,
                              int64_t before_ns, struct bd_sensor_info *out, uint32_t cap,
                              bool *more);

/* Ingest thread: how many sensors tracked have their last reading older than before_ns. */
uint32_t bd_sensor_table_count_silent(const struct bd_sensor_table *t, int64_t before_ns);

/* Ingest thread: the index's size in slots, and the sensor in slot i (NULL: an empty slot). */
uint32_t bd_sensor_table_slots(const struct bd_sensor_table *t);
const struct bd_sensor *bd_sensor_table_slot(const struct bd_sensor_table *t, uint32_t i);

/* Visit every sensor (any thread, once the ingest thread has stopped). */
void bd_sensor_table_foreach(struct bd_sensor_table *t, void (*fn)(struct bd_sensor *, void *),
                             void *arg);

#endif
