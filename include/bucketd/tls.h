/*
 * TLS for TCP listeners (listeners[].tls): a server context built from a listener's
 * certificate, key and optional client CA bundle, and one connection's TLS state driven through
 * memory BIOs, so that the caller moves the bytes (ciphertext in from its socket reads,
 * handshake and alert bytes out with its own writes) and nothing here blocks or touches a socket.
 *
 * Threads: a context is built on the thread that loads or reloads the configuration and then
 * used by the ingest thread; a connection's state belongs to the ingest thread. OpenSSL's error
 * queue is per thread, so every call clears it before it starts.
 */
#ifndef BUCKETD_TLS_H
#define BUCKETD_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "bucketd/common.h"
#include "bucketd/config.h"

/* bd_tls_read(): the peer ended the session with close_notify (an orderly end of stream). */
#define BD_TLS_CLOSED (-1)
/* bd_tls_read(): the session failed (handshake or protocol error); bd_tls_reason() says why. */
#define BD_TLS_FAILED (-2)

/* A listener's server context (an SSL_CTX); connections keep a reference of their own. */
struct bd_tls_ctx;
/* One connection's TLS state. */
struct bd_tls;

/* Whether the listener is configured for TLS (tls.cert set). */
bool bd_tls_enabled(const struct bd_listener_config *lc);

/*
 * Build the server context of lc: TLS 1.2 at least, no renegotiation, no compression, no
 * session resumption; with tls.client_ca, a client must present a certificate that verifies
 * against it. On failure *key names the key at fault ("cert", "key" or "client_ca") and err
 * says why, without the key ("cannot read '/x': No such file or directory").
 */
int bd_tls_ctx_new(struct bd_tls_ctx **out, const struct bd_listener_config *lc, const char **key,
                   struct bd_err *err);
/* The certificate's notAfter as "2026-11-26 00:00:00 UTC" into buf; true if it is past. */
bool bd_tls_ctx_expiry(const struct bd_tls_ctx *ctx, char *buf, size_t cap);
/* Drop this reference (connections made from it keep theirs). NULL is a no-op. */
void bd_tls_ctx_free(struct bd_tls_ctx *ctx);

/* A new server-side session on ctx, waiting for the client's hello. */
int bd_tls_new(struct bd_tls **out, struct bd_tls_ctx *ctx);
void bd_tls_free(struct bd_tls *t);

/* Ciphertext received from the peer (copied). 0 or -ENOMEM. */
int bd_tls_feed(struct bd_tls *t, const void *data, size_t len);
/*
 * Advance the session on what was fed and decrypt into buf: the number of plaintext bytes (> 0),
 * 0 when more input is needed, BD_TLS_CLOSED or BD_TLS_FAILED. Either may leave bytes to send
 * (bd_tls_output_len): handshake messages, alerts.
 */
ssize_t bd_tls_read(struct bd_tls *t, char *buf, size_t cap);
/* Whether the handshake has completed. */
bool bd_tls_established(const struct bd_tls *t);
/* Ciphertext fed but not yet turned into plaintext (for the stop's unread accounting). */
size_t bd_tls_unread(const struct bd_tls *t);
/* Bytes waiting to be sent to the peer, and taking up to cap of them into buf (returns how many). */
size_t bd_tls_output_len(const struct bd_tls *t);
size_t bd_tls_take_output(struct bd_tls *t, char *buf, size_t cap);
/* Start an orderly close (close_notify, then bd_tls_take_output). */
void bd_tls_shutdown(struct bd_tls *t);
/* Why the session failed (OpenSSL's reason), "" if it did not. */
const char *bd_tls_reason(const struct bd_tls *t);

#endif
