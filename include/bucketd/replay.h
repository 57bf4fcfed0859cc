/*
 * Spooled batches: what the flusher writes into a spool record (spool.h) when MongoDB cannot
 * take a batch now, and how a record read back is written to MongoDB.
 *
 * A record holds the updates of one batch exactly as they were built for MongoDB -- filter and
 * update, carrying the batch's writer sequence number -- plus, per update, the bucket page it
 * targets and its reading count. Replaying a record sends those same updates again, so the
 * idempotent filter (w.<writer_id> below the batch's number) makes a replay exactly once
 * whether or not an earlier attempt, before the spooling or before a crash, got through.
 *
 * Payload layout, per update, back to back (integers little-endian):
 *   u32 n_readings, u32 flags (BD_REPLAY_MAYBE_SENT), i64 bucket start (ms), u32 page,
 *   u32 id length,
 *   the sensor id's bytes, the filter (BSON), the update (BSON).
 *
 * Settling a replayed update is the flusher's (settle.h, one engine for both) without the page
 * moves: the updates were numbered and built when they were spooled, so a size refusal counts
 * as a refusal, bounded, and an update the driver refuses alone is quarantined. Applied, or
 * proved applied by reading the page's w.<writer_id> back after a duplicate key, is settled. A
 * page that holds this batch's number although no attempt of the update can have reached
 * MongoDB was written by another daemon using this writer_id: a conflict (counted,
 * quarantined). Whether an attempt may have reached MongoDB is known for records spooled by
 * this run (the flag below, then every replay attempt); a record an earlier run spooled counts
 * as possibly applied already, since a crash may have come after a send. Connection failures
 * and transient errors are retried without limit; refusals are retried a bounded number of
 * times, then the update is quarantined (dead-letter file) like any other.
 *
 * Flusher thread only; the store calls run through the settle engine's runner (the flusher's
 * I/O thread, draining meanwhile).
 */
#ifndef BUCKETD_REPLAY_H
#define BUCKETD_REPLAY_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bucketd/outcome.h"
#include "bucketd/settle.h"
#include "bucketd/spool.h"

/* A growing payload. */
struct bd_replay_buf {
    uint8_t *data;
    size_t len, cap;
    uint32_t n_readings;
    uint32_t n_updates;
};

/* An update's flag: an attempt before it was spooled may have reached MongoDB. */
#define BD_REPLAY_MAYBE_SENT 1u

/* Room for need more bytes at the end of buf (its data may move). -ENOMEM. */
int bd_replay_buf_reserve(struct bd_replay_buf *buf, size_t need);

/* Append one built update (sensor id, bucket start, page, readings, flags) to buf. -ENOMEM. */
int bd_replay_buf_add(struct bd_replay_buf *buf, const char *sensor_id, int64_t start_ms,
                      uint32_t page, uint32_t n_readings, uint32_t flags, const bson_t *filter,
                      const bson_t *update);
void bd_replay_buf_reset(struct bd_replay_buf *buf);
void bd_replay_buf_close(struct bd_replay_buf *buf);

/* What replaying needs from the flusher. */
struct bd_replay_env {
    /* The settle engine (store, runner, dead letters, stats, configuration, summaries, and the
     * log limits), shared with the flusher's own writes. */
    struct bd_settle *settle;
    /* The first sequence number this run took (0: none yet). Records with a number from it on
     * were spooled by this run, so their flags are known to be right; numbers are never
     * reused across runs (writer.h). */
    uint64_t run_first_seq;
};

struct bd_replay;

/* Parse a record read back from the spool (copied). -EBADMSG when it does not parse. */
int bd_replay_load(struct bd_replay **out, const struct bd_spool_record *rec, struct bd_err *err);
void bd_replay_free(struct bd_replay *r);

/*
 * Send every update of the record not settled yet, in bulks of flush.max_updates, and settle
 * each by its outcome. True when every update is settled (the record can be acknowledged);
 * false with *cause and msg saying why when some wait for the next attempt.
 */
bool bd_replay_attempt(struct bd_replay *r, const struct bd_replay_env *env, int64_t wall_ms,
                       enum bd_bulk_cause *cause, char *msg, size_t msg_cap);

/* Readings in the record's updates not settled yet. */
uint64_t bd_replay_pending_readings(const struct bd_replay *r);
uint64_t bd_replay_seq(const struct bd_replay *r);

#endif
