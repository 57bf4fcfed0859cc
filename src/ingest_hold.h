/*
 * Lines held while the wall clock is not trusted (ingest_hold.c): what ingest.c calls at the
 * start, at each poll of the clock and at the stop. Calls the ingest core and the sensor table.
 */
#ifndef BUCKETD_INGEST_HOLD_H
#define BUCKETD_INGEST_HOLD_H

#include "ingest_int.h"

/* The hold (limits.memory / 4), lines an earlier stop saved taken back, the clock's state. */
int ingest_hold_open(struct bd_ingest *in, const struct bd_clock *clock,
                     const struct bd_config *cfg, struct bd_err *err);
/* After each poll of the clock: hold while it is not trusted, release once it is. */
void ingest_hold_tick(struct bd_ingest *in);
/* At the stop: what is still held saved for the next start (lost, counted, if it cannot be). */
void ingest_hold_save(struct bd_ingest *in);

#endif
