/*
 * TLS on TCP listeners as a filter (src/tcp_tls.c): tcp.c feeds a connection's filter the
 * ciphertext it reads, takes plaintext out of it into the connection's line buffer, and writes
 * out the bytes the filter has for the peer; the filter never touches the socket or the
 * connection and calls nothing of tcp.c. It counts and logs what happens to the session
 * (handshakes, failures, the handshake deadline) under the listener's name. Below it: the
 * OpenSSL session (include/bucketd/tls.h) and the ingest core. Ingest thread only.
 */
#ifndef BUCKETD_TCP_TLS_H
#define BUCKETD_TCP_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "ingest_int.h"

/* ---- A listener's server context (l->tls) ---- */

/* Build it when l->cfg has tls (and log the certificate); 0 without tls. */
int ingest_tls_listener_open(struct listener *l, struct bd_err *err);
/* A reload kept l: read its certificate and key again; on failure the running context stays. */
void ingest_tls_listener_reload(struct listener *l);
/* The handshake deadline of the listener: min(10 s, idle_timeout). */
uint64_t ingest_tls_handshake_timeout_ms(const struct listener *l);

/* ---- One connection's filter ---- */

struct ingest_tls;

/* ingest_tls_read(): close_notify, the peer's orderly end of the stream. */
#define INGEST_TLS_CLOSED (-1)

/* A session on l's context for the connection from peer (which must outlive the filter: it is
 * the connection's, quoted in logs), accepted at now_ms (uv_now). 0 or -ENOMEM. */
int ingest_tls_new(struct ingest_tls **out, struct listener *l, const struct sockaddr *peer,
                   uint64_t now_ms);
/* NULL is a no-op. */
void ingest_tls_free(struct ingest_tls *t);
/* Ciphertext read from the peer (copied). 0 or -ENOMEM. */
int ingest_tls_feed(struct ingest_tls *t, const void *data, size_t len);
/*
 * Decrypt what was fed into buf: the number of plaintext bytes (> 0), 0 when more ciphertext
 * is needed, INGEST_TLS_CLOSED, or -EPROTO when the session failed (counted in
 * tls_handshake_failures or tls_errors and logged, rate limited). A completed handshake is
 * counted in tls_handshakes. Any call may leave bytes for the peer (ingest_tls_output_len).
 */
ssize_t ingest_tls_read(struct ingest_tls *t, char *buf, size_t cap);
/* Bytes waiting to be sent to the peer, and taking up to cap of them into buf (how many). */
size_t ingest_tls_output_len(const struct ingest_tls *t);
size_t ingest_tls_take_output(struct ingest_tls *t, char *buf, size_t cap);
/* Answer the peer's close_notify with ours (then in the output). */
void ingest_tls_shutdown(struct ingest_tls *t);
/* Ciphertext fed but not yet turned into plaintext (for the stop's unread accounting). */
size_t ingest_tls_unread(const struct ingest_tls *t);
/* True (counted in tls_handshake_timeouts and logged) when the session is still in its
 * handshake past the listener's deadline: the connection must close. */
bool ingest_tls_handshake_overdue(struct ingest_tls *t, uint64_t now_ms);

#endif
