/*
 * The kernel's UDP counters as the ingest stage reads them (src/kstats.c), called by ingest.c:
 * an object that owns its buffers and its timer, reads /proc once a second and when asked, and
 * adds what grew to the stats. Which sockets are bucketd's it asks its owner through the
 * callback it was handed. Ingest thread only.
 */
#ifndef BUCKETD_KSTATS_INT_H
#define BUCKETD_KSTATS_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ingest_int.h"

/* One slot's UDP socket, as the owner's callback describes it. */
struct ingest_kstats_socket {
    uint64_t inode; /* of the socket's descriptor; 0: no open UDP socket in this slot */
    bool v6;        /* listed in /proc/net/udp6 rather than /proc/net/udp */
};

/* Fills out[0..k) with the sockets of the owner's first k slots (k <= cap: the slots in use
 * so far) and returns k. */
typedef uint32_t (*ingest_kstats_sockets_cb)(void *arg, struct ingest_kstats_socket *out,
                                             uint32_t cap);

/*
 * Read the counters a first time (the baseline of the host-wide ones) and start the timer, a
 * handle of in (it counts in in->open_handles). n_slots sockets at most, as sockets() says.
 * 0, or a negative errno with nothing left open.
 */
int ingest_kstats_new(struct ingest_kstats **out, struct bd_ingest *in, uint32_t n_slots,
                      ingest_kstats_sockets_cb sockets, void *arg, struct bd_err *err);
/* Brings the three counters up to date (a few small reads of /proc, never per packet). */
void ingest_kstats_update(struct ingest_kstats *k);
/* Close the timer; k frees itself, buffers and all, in its close callback. NULL: no-op. */
void ingest_kstats_close(struct ingest_kstats *k);

#endif
