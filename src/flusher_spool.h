/*
 * The flusher's spool policy (flusher_spool.c): which batches go to the on-disk spool and when,
 * and replaying it (replay.h) ahead of anything newer. Calls the writer side, the drain and the
 * I/O runner below it.
 */
#ifndef BUCKETD_FLUSHER_SPOOL_H
#define BUCKETD_FLUSHER_SPOOL_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/log.h"
#include "bucketd/replay.h"
#include "bucketd/spool.h"

struct bd_flusher;

struct flusher_spool {
    struct bd_spool *disk;    /* NULL with the blackhole sink */
    struct bd_replay *replay; /* the record being replayed, if any */
    uint64_t replay_id;
    struct bd_replay_buf buf; /* the payload being encoded */
    struct bd_ratelimit log;
    /* Wall clock of the oldest reading in the spool, as far as this run knows (0: empty). */
    int64_t oldest_ms;
    /* The spool may hold an unplaced record: what is spooled behind it goes unplaced too. */
    bool unplaced_ahead;
};

int flusher_spool_open(struct bd_flusher *f, struct bd_err *err);
void flusher_spool_close(struct bd_flusher *f);
/* The spool holds records not yet replayed (or one being replayed). */
bool flusher_spool_active(const struct bd_flusher *f);
/* The spool's sync policy, at the start of a step. */
void flusher_spool_tick(struct bd_flusher *f, int64_t mono_ns);
/* A reload: the spool's cap. */
void flusher_spool_set_max_bytes(struct bd_flusher *f, uint64_t max_bytes);
/* Put what the batch being written has pending onto the spool; true when nothing is left. */
bool flusher_spool_batch(struct bd_flusher *f, int64_t wall_ms);
/* The step's part when the spool is active (see flusher.c): returns once done for now. */
void flusher_spool_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping);
/* A stop's deadline passed: spool everything still in memory that can be. */
void flusher_spool_everything(struct bd_flusher *f, int64_t wall_ms);
/* Copy the spool's counters and gauges into the daemon's stats. */
void flusher_spool_stats(struct bd_flusher *f);
/* Wall clock of the oldest spooled reading (0: none). A spool left by an earlier run counts from
 * this start: its records carry no time. */
int64_t flusher_spool_oldest_ms(const struct bd_flusher *f);

#endif
