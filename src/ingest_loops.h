/*
 * A UDP listener's extra receive loops (src/ingest_loops.c), used when ingest.loops > 1.
 * Called by ingest.c on the ingest thread; calls down into udp.c and the ingest core.
 */
#ifndef BUCKETD_INGEST_LOOPS_H
#define BUCKETD_INGEST_LOOPS_H

#include "ingest_int.h"

/*
 * After the listener's own socket is bound (with SO_REUSEPORT: l->reuseport): open n_extra
 * more sockets on the address it got, each read by a thread of its own, and the async handle
 * that brings their datagrams to the ingest thread. On failure what was opened stays for
 * ingest_loops_close().
 */
int ingest_loops_open(struct listener *l, uint32_t n_extra, struct bd_err *err);

/* Hand what the receive loops read since to the parser, unless the listener is paused for
 * congestion (bd_ingest_resume calls it once the pause ends). */
void ingest_loops_consume(struct listener *l);

/*
 * At stop or the listener's removal (`when`, for the log), after the listener's own socket was
 * read out: every receive loop reads out its socket (within in->udp_stop_drain_ns, the rest
 * counted in udp_unread_at_stop) while this thread parses what they hand over; then the
 * threads end. Their sockets stay open (the kernel's counters are read once more) until
 * ingest_loops_close(). Idempotent; a no-op without receive loops.
 */
void ingest_loops_read_out(struct listener *l, const char *when);

/* Read out (if not yet), close the loops' sockets and free them; the async handle closes with
 * the listener's other handles. Idempotent. */
void ingest_loops_close(struct listener *l);

/* For the kernel's drop counters: the inode of receive loop k's socket (k from 0, the loops past
 * the first), 0 when there is none. Valid until ingest_loops_close(). */
uint64_t ingest_loops_sock_inode(const struct listener *l, uint32_t k);

#endif
