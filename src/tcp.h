/*
 * TCP listeners and their connections (src/tcp.c), called by ingest.c; they call down into the
 * TLS filter (src/tcp_tls.h) and the ingest core only. Ingest thread only.
 */
#ifndef BUCKETD_TCP_H
#define BUCKETD_TCP_H

#include <stdbool.h>
#include <stdint.h>

#include "ingest_int.h"

/* Bind, listen and start the idle sweep (with the server context first on a TLS listener). On
 * failure the handles already opened are left for the caller to close. */
int ingest_tcp_open(struct listener *l, struct bd_err *err);
/*
 * Stop the listener's connections: close its idle sweep, stop reading every connection and
 * finish what each holds (a connection that has to wait for ring space stays, paused, for
 * resume or abort). The listening socket is the caller's to close. Idempotent.
 */
void ingest_tcp_close(struct listener *l);
/* The stop deadline passed: close every connection of l, counting what it never processed. */
void ingest_tcp_abort_conns(struct listener *l);
/* Resume or finish the paused connections of l; false when the rings are congested again and
 * bd_ingest_resume() must stop there. *now_ns is read once, when first needed. */
bool ingest_tcp_resume_conns(struct listener *l, int64_t *now_ns);

#endif
