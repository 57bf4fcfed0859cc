/*
 * Unplaced spool records: a batch the flusher could not place -- some bucket's pages unknown
 * (an earlier run's bucket, an evicted sensor's) or the writer sequence unknown (no writer
 * state and MongoDB away) -- spooled as it is, so that what was accepted reaches the disk
 * whatever bucketd knows of MongoDB. A record holds, per delta, the sensor's identity (id,
 * measurement, tags, the field names its readings use), the bucket, the page when it was known,
 * and the readings themselves; no update is built and no sequence number taken. At replay the
 * record is loaded back into a batch of its own, over "detached" sensors (not in the sensor
 * table, owned by the loaded record), placed like any batch (pages looked up, a sequence number
 * taken), built, and written in its placed form (replay.h). The life cycle of such a record and
 * its crash points are in src/flusher_place.c.
 *
 * Payload layout, per delta, back to back (integers little-endian):
 *   u32 entry length (all of it, this field included), u32 n_readings, i64 bucket start (ms),
 *   u32 page (BD_PAGE_UNKNOWN: not known), u32 id length, u32 measurement length, u32 n_tags,
 *   u32 n_names,
 *   the id's bytes, the measurement's bytes, n_tags x (u32 length, key, u32 length, value),
 *   n_names x (u32 length, field name as a BSON key),
 *   n_readings x (i64 ts_ns, u32 n_values, n_values x (u16 field, u8 kind, u8 0, u64 value)).
 * Tag keys and field names are stored escaped, as the sensor holds them (names.h).
 *
 * Flusher thread only; pure encoding, no I/O.
 */
#ifndef BUCKETD_UNPLACED_H
#define BUCKETD_UNPLACED_H

#include <stddef.h>
#include <stdint.h>

#include "bucketd/batch.h"
#include "bucketd/common.h"
#include "bucketd/pages.h"
#include "bucketd/replay.h"

/* The spool record flag (spool.h's flags) of an unplaced record. */
#define BD_SPOOL_UNPLACED 1u

/* Append delta d as one entry (its readings counted in buf->n_readings). -ENOMEM leaves buf as
 * it was. */
int bd_unplaced_add(struct bd_replay_buf *buf, const struct bd_delta *d);

struct bd_unplaced;

/*
 * Load a record: one detached sensor per distinct sensor id, and a batch holding its deltas
 * (merged by sensor, bucket and page), each sensor with a page slot per bucket: unknown for a
 * delta without a page, known at its page otherwise. -EBADMSG (err says where) when the payload
 * does not parse, -ENOMEM.
 */
int bd_unplaced_load(struct bd_unplaced **out, const uint8_t *data, size_t len,
                     const struct bd_pages_limits *lim, struct bd_err *err);

/* The loaded batch (owned by u; its deltas refer to u's sensors). */
struct bd_batch *bd_unplaced_batch(struct bd_unplaced *u);

/* Readings and distinct sensors the record held. */
uint64_t bd_unplaced_readings(const struct bd_unplaced *u);
uint32_t bd_unplaced_sensors(const struct bd_unplaced *u);

/* Free the batch, then the sensors. NULL is a no-op. */
void bd_unplaced_free(struct bd_unplaced *u);

#endif
