/*
 * The ingest core (src/ingest_core.c): what every listener shares and the bottom layer of the
 * ingest stage (see src/ingest_int.h). It calls nothing of udp.c, tcp.c, tcp_tls.c, kstats.c
 * or ingest.c. Ingest thread only.
 */
#ifndef BUCKETD_INGEST_CORE_H
#define BUCKETD_INGEST_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "ingest_int.h"

/* Longest "[v6 address]:port" we format. */
#define PEER_LEN 64

/* ---- Lifetimes ---- */

/*
 * Every uv handle of the stage counts in in->open_handles from its uv_*_init() until its close
 * callback, which ends in ingest_handle_closed(); the struct is destroyed when the owner has let
 * go (ingest_release) and no handle is left, so a close callback never sees freed memory.
 */
void ingest_handle_opened(struct bd_ingest *in);
void ingest_handle_closed(struct bd_ingest *in);
/* The owner lets go: destroy now if no handle is open, else when the last one closes. */
void ingest_release(struct bd_ingest *in);

/*
 * A listener in its slot l (zeroed): its name, rate limits, parser and point. The socket is
 * udp.c's or tcp.c's to open. On failure what was set up is freed by ingest_listener_release().
 */
int ingest_listener_init(struct bd_ingest *in, struct listener *l, uint32_t idx,
                         const struct bd_listener_config *cfg, struct bd_err *err);
/* Close one of the listener's own handles (its socket, its idle sweep): counted in l->closing
 * until its callback, which gives the slot back if that was all it held. */
void ingest_listener_close_handle(struct listener *l, uv_handle_t *h);
/* Close the listening socket alone (a removed TCP listener keeps its connections). */
void ingest_listener_close_socket(struct listener *l);
/* A removed listener whose handles and connections are all gone gives its slot back. */
void ingest_listener_maybe_free(struct listener *l);
/* Free what the listener owns once its handles and connections have closed. */
void ingest_listener_release(struct listener *l);

/* ---- Lines ---- */

/* A TCP line whose sensor is busy (bd_sensor_table_accept: -EAGAIN): nothing of it was taken
 * or counted; the connection stops reading and offers it again when resumed. */
#define INGEST_BUSY 1

/* One line without its '\n', on its own (a TCP stream's unterminated last line): 0, -E2BIG
 * when it exceeds max_line, or INGEST_BUSY. */
int ingest_handle_line(struct listener *l, const char *line, size_t len,
                       const struct sockaddr *peer, int64_t now_ns);
/* The next line of the batch begun on the listener's parser (bd_parse_begin): BD_PARSE_END when
 * there is none, else 0, -E2BIG or INGEST_BUSY as for ingest_handle_line(). */
int ingest_next_line_of_batch(struct listener *l, const struct sockaddr *peer, int64_t now_ns);
/* A bad line, quoted and rate limited (a few per listener every 10 s). */
void ingest_sample_bad_line(struct listener *l, const struct sockaddr *peer, const char *reason,
                            const char *line, size_t len);
const char *ingest_too_long_reason(const struct listener *l);

/* ---- Senders ---- */

/* A datagram or connection from a sender outside l->cfg.allow: counted and logged (rate
 * limited) with its address. */
void ingest_not_allowed(struct listener *l, const struct sockaddr *peer);
/* "addr:port" or "[addr]:port" of sa, "?" for NULL. */
void ingest_format_addr(const struct sockaddr *sa, char *out, size_t cap);
/* The loop's cached monotonic time (ns): good enough for rate limiting and costs nothing. */
int64_t ingest_loop_now_ns(const struct listener *l);

#endif
