/*
 * The flusher's writer side (flusher_writer.c): the batch being written -- the sequence number
 * it takes, the pages its readings go to, its updates built and sent in bulks, each settled by
 * the settle engine (settle.h), and the retry schedule when a write fails. Calls the I/O runner
 * below it, never the spool policy or flusher.c above it.
 */
#ifndef BUCKETD_FLUSHER_WRITER_H
#define BUCKETD_FLUSHER_WRITER_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stdint.h>

#include "bucketd/config.h"
#include "bucketd/outcome.h"
#include "bucketd/replay.h"
#include "bucketd/writer.h"

struct bd_batch;
struct bd_flusher;

struct flusher_writer {
    struct bd_writer *state; /* identity and sequence (writer.h); NULL with the blackhole sink */
    char writer_key[160];    /* "w.<writer_id>" */
    bool seq_known;          /* the sequence is past every number in the documents */
    bool have_seq;           /* batch_seq belongs to the pending batch */
    uint64_t batch_seq;
    uint64_t run_first_seq; /* the first sequence number this run took (0: none yet) */
    int64_t batch_max_start_ms;

    uint32_t attempt;              /* consecutive failed attempts */
    int64_t retry_at;              /* monotonic ns of the next attempt, 0 = none */
    uint64_t rng;                  /* xorshift state for jitter */
    enum bd_bulk_cause last_cause; /* why the last failed attempt failed */
    char last_error[512];

    /* One chunk's updates, built before it is sent (flush.max_updates each). */
    uint32_t chunk_max; /* updates per bulk: flush.max_updates, halved after a driver refusal */
    uint32_t chunk_cap; /* what the chunk arrays hold (flush.max_updates, or more) */
    uint32_t *ops;
    bson_t *selectors, *updates;
    const bson_t **sel_ptrs, **upd_ptrs;
    struct bd_op_outcome *outcomes;
    uint32_t *readback;
};

/* Open the writer state under spool.dir and say what the previous run left. */
int flusher_writer_open(struct bd_flusher *f, struct bd_err *err);
/* (Re)allocate the chunk arrays for max updates a bulk; -ENOMEM keeps the old ones. Between
 * steps only: they are scratch space of one send. */
int flusher_writer_chunk_alloc(struct bd_flusher *f, uint32_t max);
void flusher_writer_chunk_free(struct bd_flusher *f);
/* A reload: flush.max_updates of next (set back to the running value if the arrays cannot
 * grow). */
void flusher_writer_adopt_max_updates(struct bd_flusher *f, struct bd_config *next);

/* Before the batch's first attempt: the sequence recovered from the collection when unknown,
 * the pages of its unknown buckets looked up, its number taken. false (the failure noted and
 * logged) when MongoDB or the writer state failed; nothing sent. */
bool flusher_writer_prepare(struct bd_flusher *f);
/* The batch being written takes the next number of the writer sequence (saved first). */
int flusher_writer_take_sequence(struct bd_flusher *f, struct bd_err *err);
/* Build the update of delta di into chunk position n. 0: built; 1: not to be sent now (split,
 * or quarantined); -ENOMEM. */
int flusher_writer_build_one(struct bd_flusher *f, uint32_t di, uint32_t n, int64_t wall_ms);
/* Build the update of delta di and append it to buf, as a spool record holds it (replay.h).
 * 0: added; 1: nothing to add (done, empty, split -- its readings come round again -- or
 * quarantined); -ENOMEM. */
int flusher_writer_build_into(struct bd_flusher *f, uint32_t di, struct bd_replay_buf *buf,
                              int64_t wall_ms);
void flusher_writer_note_failure(struct bd_flusher *f, enum bd_bulk_cause cause, const char *msg);
void flusher_writer_schedule_retry(struct bd_flusher *f, int64_t mono_ns);
/* Writes succeed again (logged once after failures, with how appended). */
void flusher_writer_recovered(struct bd_flusher *f, const char *how);
void flusher_writer_batch_done(struct bd_flusher *f);
/* Nothing of the batch being written is pending. */
bool flusher_writer_settled(const struct bd_flusher *f);
/* The fill batch becomes the batch to write. */
void flusher_writer_swap_in_fill(struct bd_flusher *f);
/* The fill batch b is handed on (to be written, or dropped at a stop): its sensors' shares of
 * the next fill batch start from nothing (bd_pages.fill_bytes). */
void flusher_writer_fill_gone(const struct bd_batch *b);
/* After the swap: deltas not worth an update yet go back into the fill batch. */
void flusher_writer_hold_back(struct bd_flusher *f, int64_t wall_ms, bool stopping);
/* Write what the batch holds; on failure, schedule its retry. */
void flusher_writer_write(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms);

#endif
