/*
 * The settle engine: what becomes of each update of a bulk once its outcome is known
 * (outcome.h), the same rules for the flusher's batches and for records replayed from the
 * spool (replay.h):
 *   applied      settled: readings_flushed, its bucket marked for a summary refresh;
 *   not_sent, retry, config   left pending: sent again with the next attempt, unbounded;
 *   ambiguous    left pending, marked maybe_applied;
 *   duplicate    its page is read back: it holds the update's sequence number or a later one
 *                -> applied if an attempt may have reached the server, else another daemon uses
 *                this writer_id (writer_conflicts, quarantined); a lower number or none ->
 *                another writer's insert raced ours: sent again, BD_SETTLE_MAX_DUP_CHECKS times
 *                at most, then quarantined;
 *   too_large    with a host that can move readings (relocate): moved to new pages after the
 *                bucket's last one (read back first when an attempt may have applied it: then
 *                half move, or, alone, it is quarantined); without one, like refused;
 *   refused      sent again BD_SETTLE_MAX_REFUSALS times at most (too_large counts too), then
 *                quarantined;
 *   permanent    quarantined: counted, logged (rate-limited), kept in the dead-letter file.
 * A bulk the driver refused before sending anything is halved until the refused update is
 * alone; that one is then too large (a host that can move readings) or permanent.
 *
 * The host keeps its updates as it likes (a batch's deltas, a spool record's entries) and shows
 * the engine one at a time through get/put; the engine keeps no pointer into the host across a
 * call of the host (relocate may move its arrays).
 *
 * Flusher thread only (or a unit test's); the store calls run through the runner given
 * (storecall.h), so the find_pages callback runs on that runner's thread and calls get only.
 */
#ifndef BUCKETD_SETTLE_H
#define BUCKETD_SETTLE_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/config.h"
#include "bucketd/deadletter.h"
#include "bucketd/log.h"
#include "bucketd/outcome.h"
#include "bucketd/stats.h"
#include "bucketd/store.h"
#include "bucketd/storecall.h"

/* Refusals (configuration-type errors, repeated size refusals) before an update is quarantined. */
#define BD_SETTLE_MAX_REFUSALS 8

/* Duplicate-key answers whose read-back found another writer's insert, before quarantine. */
#define BD_SETTLE_MAX_DUP_CHECKS 3

struct bd_summaries;

/* What settling needs and the logs it keeps; one per flusher, shared with its replay. */
struct bd_settle {
    struct bd_store *store;
    bd_store_runner run; /* runs each store call (the flusher's I/O runner) */
    void *run_arg;
    struct bd_deadletter *dead; /* may be NULL */
    struct bd_stats *stats;
    const struct bd_config *cfg; /* writer_id, mongodb.database/collection (kept current) */
    struct bd_summaries *sums;   /* buckets written are marked here; may be NULL */
    struct bd_ratelimit quarantine_log, conflict_log, fail_log, oom_log, sums_log;
};

/* Set the log limits (the rest is the caller's to fill). */
void bd_settle_init(struct bd_settle *s);

/* One update as the engine sees it (a copy: put writes the state back). */
struct bd_settle_upd {
    const char *sensor_id;
    int64_t start_ms;
    uint32_t page;
    uint32_t n_readings;
    bool done;          /* acknowledged, already applied, or quarantined */
    bool maybe_applied; /* an attempt may have reached the server and been applied */
    uint8_t refusals;
    uint8_t dup_checks;
};

/* Where the updates being settled live. */
struct bd_settle_host {
    void *arg;
    void (*get)(void *arg, uint32_t item, struct bd_settle_upd *u);
    void (*put)(void *arg, uint32_t item, const struct bd_settle_upd *u);
    /* Move the item's readings [keep, n) to new pages after its bucket's last page: 0, or
     * -ENOMEM with nothing changed. NULL: the host cannot move readings. */
    int (*relocate)(void *arg, uint32_t item, uint32_t keep);
    uint64_t seq;     /* the writer sequence number the updates carry */
    const char *what; /* "" or "spooled ": how the logs name the updates */
};

/* One bulk: items[0..n) of the host, sent as filters/updates[0..n). outcomes and readback are
 * the caller's scratch arrays of n. */
struct bd_settle_chunk {
    uint32_t n;
    const uint32_t *items;
    const bson_t *const *filters, *const *updates;
    struct bd_op_outcome *outcomes;
    uint32_t *readback;
};

/*
 * Send the chunk as one bulk through the store, classify the answer into bulk, count it, and
 * settle every update by its outcome. A bulk the driver refused whole is settled as not sent
 * and *chunk_max halved (the caller sends the same updates again, fewer a bulk). Returns the
 * bulk's cause (BD_CAUSE_NONE: every update applied).
 */
enum bd_bulk_cause bd_settle_send(struct bd_settle *s, const struct bd_settle_host *h,
                                  const struct bd_settle_chunk *c, uint32_t *chunk_max,
                                  struct bd_bulk_outcome *bulk, int64_t wall_ms);

/*
 * Give an update up: done, counted, logged (rate-limited) with its bucket id, and kept in the
 * dead-letter file with filter/update (when both are given) for an operator to replay.
 * conflict: the page holds this writer's number although no attempt can have reached it.
 */
void bd_settle_quarantine(struct bd_settle *s, const struct bd_settle_host *h, uint32_t item,
                          int64_t code, const char *why, const bson_t *filter, const bson_t *update,
                          int64_t wall_ms, bool conflict);

/* An update that cannot be sent as it is: half its readings move to new pages (the host's
 * relocate), or, alone, it is quarantined. -ENOMEM if the move failed (nothing changed). */
int bd_settle_shrink(struct bd_settle *s, const struct bd_settle_host *h, uint32_t item,
                     int64_t code, const char *why, const bson_t *filter, const bson_t *update,
                     int64_t wall_ms);

/* Log (rate-limited) that memory ran out doing what; what is left is tried again. */
void bd_settle_log_oom(struct bd_settle *s, const char *what);

#endif
