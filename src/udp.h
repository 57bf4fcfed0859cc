/*
 * UDP listeners (src/udp.c), called by ingest.c; they call down into the ingest core only.
 * Ingest thread only.
 */
#ifndef BUCKETD_UDP_H
#define BUCKETD_UDP_H

#include "ingest_int.h"

/* Allocate the slab, bind, set the receive buffer and start reading. On failure the handle, if
 * opened, is left for the caller to close with the listener's other handles. */
int ingest_udp_open(struct listener *l, struct bd_err *err);
/* Read again once the congestion is gone or the flusher has stalled (bd_ingest_resume). */
void ingest_udp_maybe_resume(struct listener *l);
/* At stop (or removal), before the socket closes: read out what its receive buffer still holds.
 * when ("at stop", "at its removal") is for the log. */
void ingest_udp_drain_at_stop(struct listener *l, const char *when);

#endif
