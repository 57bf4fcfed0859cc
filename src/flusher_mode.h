/*
 * How the flusher writes, named once (flusher.c computes it from the parts' state at each step;
 * the step, the summaries' round and bd_flusher_idle go by it).
 */
#ifndef BUCKETD_FLUSHER_MODE_H
#define BUCKETD_FLUSHER_MODE_H

enum flusher_mode {
    /* MongoDB takes the writes: the fill batch is written when it is due. */
    FLUSHER_WRITING,
    /* A write failed: the batch being written waits for its retry (the next one waits behind
     * it, or onto the spool once it is due too); or nothing waits, but the next write is the
     * first after failures. */
    FLUSHER_RETRYING,
    /* The spool holds records and its last replay failed: the batches go onto the spool. */
    FLUSHER_SPOOLING,
    /* The spool holds records and is replayed: the batches wait in memory behind it. */
    FLUSHER_REPLAYING,
};

#endif
