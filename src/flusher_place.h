/*
 * The flusher's placing of unplaced spool records (flusher_place.c): an unplaced record read
 * back at the head of the spool is placed like a batch, numbered, journaled (placing.h) and
 * handed to the replay in its placed form. Called by the spool policy; calls the writer side
 * and the I/O runner below it.
 */
#ifndef BUCKETD_FLUSHER_PLACE_H
#define BUCKETD_FLUSHER_PLACE_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/replay.h"
#include "bucketd/spool.h"

struct bd_flusher;

struct flusher_place {
    struct bd_replay_buf buf; /* the placed form being built */
    bool journaled;           /* a journal names the record being replayed */
};

enum flusher_place_result {
    FLUSHER_PLACE_OK,   /* *out holds the placed form (NULL: nothing of it is left to write) */
    FLUSHER_PLACE_WAIT, /* MongoDB, the writer state or the disk failed: try again later */
    FLUSHER_PLACE_BAD,  /* the record does not parse: skip it (counted, logged) */
};

/* Place the unplaced record rec (at the head of the spool). On OK the journal is durable
 * before *out is returned. */
enum flusher_place_result flusher_place_record(struct bd_flusher *f,
                                               const struct bd_spool_record *rec, int64_t wall_ms,
                                               struct bd_replay **out);

/* At open: the journal's placed form when it names head, the record at the head of the spool
 * (0 and *out set); 0 and *out NULL when there is none (a journal naming another record is
 * removed: its record was acknowledged); a negative errno when it cannot be read. */
int flusher_place_resume(struct bd_flusher *f, const struct bd_spool_record *head,
                         struct bd_replay **out);

/* The record whose placed form was replayed is acknowledged: once that is durable, the journal
 * goes. */
void flusher_place_retire(struct bd_flusher *f);

void flusher_place_close(struct bd_flusher *f);

/* The test hook's points (bd_flusher_place_hook): a no-op unless a test set one. */
void flusher_place_point(int point);

#endif
