/*
 * The flusher's part in the summary documents (flusher_summaries.c): the set of buckets due a
 * refresh, whose marks the settle engine makes (settle.h), and the rounds of refreshes. Calls
 * only the I/O runner below it.
 */
#ifndef BUCKETD_FLUSHER_SUMMARIES_H
#define BUCKETD_FLUSHER_SUMMARIES_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/log.h"
#include "bucketd/summaries.h"
#include "flusher_mode.h"

struct bd_flusher;

struct flusher_sums {
    struct bd_summaries *set; /* NULL: summaries off, or no store */
    int64_t next_ms;          /* wall clock of the next round */
    struct bd_ratelimit log;
};

int flusher_summaries_open(struct bd_flusher *f, struct bd_err *err);
/* Buckets left unrefreshed are counted and logged, saying why (a stop, a reload). */
void flusher_summaries_close(struct bd_flusher *f, const char *why);
/* After the step, in mode (idle: no reading waits): a round of refreshes if one is due. */
void flusher_summaries_step(struct bd_flusher *f, enum flusher_mode mode, bool idle,
                            int64_t wall_ms, bool stopping);
/* A reload changed summaries.interval from prev's (f->cfg is the new configuration). */
void flusher_summaries_adopt(struct bd_flusher *f, const struct bd_config *prev, int64_t wall_ms);
/* Buckets waiting for a refresh. */
uint32_t flusher_summaries_pending(const struct bd_flusher *f);

#endif
