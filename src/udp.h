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
/* One datagram (not truncated, its sender allowed) that arrived at now_ns (wall clock): its
 * lines to the parser and the sensor table, then the table's publish. */
void ingest_udp_datagram(struct listener *l, const char *data, size_t len,
                         const struct sockaddr *peer, int64_t now_ns);
/* Between batches of datagrams: stop reading while the pool is congested and the flusher
 * could drain (see udp.c). */
void ingest_udp_maybe_pause(struct listener *l);
/* Read again once the congestion is gone or the flusher has stalled (bd_ingest_resume). */
void ingest_udp_maybe_resume(struct listener *l);
/* At stop (or removal), before the socket closes: read out what its receive buffer still holds.
 * when ("at stop", "at its removal") is for the log. */
void ingest_udp_drain_at_stop(struct listener *l, const char *when);

#endif
