/*
 * The listeners' internals, shared by their source files:
 *   ingest.c  the shared part: lifetime of struct bd_ingest and its handles, one listener's
 *             open and close (reusable per listener), bad-line samples, lines to the sensor
 *             table, and the public API of include/bucketd/ingest.h;
 *   udp.c     UDP listeners: recvmmsg into the slab, backpressure, the read-out at stop;
 *   tcp.c     TCP listeners and their connections: framing, backpressure, idle sweep;
 *   tcp_tls.c TLS on TCP connections (listeners[].tls): ciphertext in, plaintext into the
 *             connection's buffer, handshake bytes out, the handshake deadline;
 *   kstats.c  the kernel's UDP counters from /proc (the parsers of ingest.h and the timer).
 * Everything here runs on the ingest thread, the one that owns the uv loop.
 */
#ifndef BUCKETD_INGEST_INT_H
#define BUCKETD_INGEST_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "bucketd/allow.h"
#include "bucketd/ingest.h"
#include "bucketd/log.h"
#include "bucketd/parse.h"
#include "bucketd/tls.h"

/* At stop, how long a UDP listener may spend reading what its socket buffer still holds. */
#define UDP_STOP_DRAIN_NS (500 * BD_NS_PER_MS)

/* Longest "[v6 address]:port" we format. */
#define PEER_LEN 64

struct listener;

struct conn {
    uv_tcp_t tcp; /* tcp.data points back here */
    struct listener *l;
    struct conn *prev, *next; /* l->conns; unlinked once closing */
    struct sockaddr_storage peer;
    struct bd_addr128 peer_key; /* what l->peers counts it under, when peer_counted */
    bool peer_counted;
    uint64_t last_active_ms; /* uv_now() when it last completed a line, for the idle sweep */
    bool paused;             /* reading stopped by backpressure */
    bool out_blocked;        /* TLS: reading stopped while the peer leaves our output unread */
    bool eof;                /* the peer finished sending; close once the buffer is consumed */
    struct bd_tls *tls;      /* TLS listener: the session (tcp_tls.c); NULL on plain ones */
    uint64_t accepted_ms;    /* TLS: uv_now() at accept, for the handshake deadline */
    bool filled;             /* the last read filled the room it was given: grow (tcp.c) */
    /*
     * buf[start, len) is received and not yet consumed; buf[start, scan) is known to hold no
     * '\n', so memchr never rescans bytes of a line that arrives in many reads. buf grows on
     * demand up to max_line + CONN_SLACK and is given back by the idle sweep (tcp.c); NULL
     * with cap 0 while there is nothing in it.
     */
    size_t start, scan, len, cap;
    size_t peak;    /* most bytes held at once since the last sweep */
    bool peak_read; /* something was read since the last sweep */
    char *buf;
};

struct listener {
    struct bd_ingest *in;
    uint32_t idx;
    struct bd_listener_config cfg; /* a copy: the config may be reloaded under us */
    char name[192];                /* "listener 2 (tcp 0.0.0.0:8094)" for errors and logs */

    /*
     * Its slot of in->listeners (see struct bd_ingest): in_use from open until everything of a
     * removed listener is gone; active while the configuration has it. closing counts the
     * uv_close() calls on h and sweep whose callbacks have not run: the slot's memory holds
     * those handles, so it is reused only once they are done.
     */
    bool in_use;
    bool active;
    uint32_t closing;

    union {
        uv_handle_t handle;
        uv_udp_t udp;
        uv_tcp_t tcp;
    } h;
    bool h_open;

    struct bd_parser parser;
    bool parser_ok;
    struct bd_point *point;

    struct bd_tls_ctx *tls; /* TCP with listeners[].tls: the server context; else NULL */

    char *slab;          /* UDP only */
    bool udp_paused;     /* UDP: reading stopped for a congested ring (see udp_maybe_pause) */
    uint64_t sock_inode; /* UDP: of the socket, to find it in /proc/net/udp; 0 if unknown */
    uint64_t drops_seen; /* UDP: its kernel drops already added to udp_socket_drops */

    /*
     * TCP idle timeout: one sweeping timer per listener rather than a timer per connection.
     * A read then costs one store of the loop's cached time instead of a heap update, the
     * connection holds one handle instead of two, and a sweep over max_connections entries
     * every idle_timeout/4 (at most 1 s) is noise. The price is that a connection may live
     * up to one sweep interval past its timeout, which no client can tell apart from jitter.
     */
    uv_timer_t sweep;
    bool sweep_open;
    struct conn *conns;
    uint32_t n_conns;
    uint32_t n_paused;
    struct bd_peer_counts peers; /* TCP: open connections per source (max_connections_per_ip) */

    uint64_t n_not_allowed;     /* datagrams or connections refused by cfg.allow */
    uint64_t n_rejected_per_ip; /* TCP connections refused by max_connections_per_ip */

    struct bd_ratelimit rl_lines;  /* samples of bad lines */
    uint64_t rl_lines_reported;    /* rl_lines.suppressed already mentioned in a sample */
    struct bd_ratelimit rl_events; /* receive errors, refused connections */
};

struct bd_ingest {
    uv_loop_t *loop;
    struct bd_sensor_table *table;
    struct bd_stats *stats;
    size_t max_line;

    /*
     * Slots, never moved (they hold uv handles): the listeners of the configuration in its order
     * at start, then those a reload adds, in free slots. A removed TCP listener keeps its slot
     * while its connections last. n_listeners is the high-water mark of slots used (every loop
     * over listeners walks that far: a free slot has nothing open, so every step skips it).
     */
    struct listener *listeners;
    uint32_t n_listeners;
    uint32_t cap_listeners; /* LISTENER_SLOTS */

    /* Kernel UDP counters (only with a UDP listener; see ingest.h). */
    uv_timer_t kstats_timer;
    bool kstats_open;
    char *kstats_buf;                 /* KSTATS_BUF bytes (kstats.c) */
    struct bd_udp_sock *kstats_socks; /* one per listener */
    struct bd_udp_snmp snmp_last;     /* the values already accounted for */
    bool snmp_known;                  /* snmp_last holds a reading (the first is the baseline) */
    struct bd_udp_snmp snmp6_last;    /* the same for IPv6 (/proc/net/snmp6) */
    bool snmp6_known;
    bool kstats_warned;

    int64_t udp_stop_drain_ns; /* UDP_STOP_DRAIN_NS; shorter in tests */

    uint32_t open_handles;
    bool stopping;
    /* Called once, when a stop has no connection left draining its buffer. */
    bd_ingest_stopped_cb stopped_cb;
    void *stopped_arg;
    bool released; /* the owner let go; destroy once open_handles reaches 0 */
};

/* ---- ingest.c ---- */

/* An open handle of in closed (every close callback ends here); destroys in when it was the
 * last one and the owner has let go. */
void ingest_handle_closed(struct bd_ingest *in);
/* Close callback of a listener's own handles (socket, idle sweep). */
void ingest_on_listener_handle_closed(uv_handle_t *h);
/* The last connection of l went (tcp.c): a listener a reload removed closes its idle sweep. */
void ingest_listener_conns_gone(struct listener *l);

/*
 * One listener, the slot l of in->listeners (zeroed): its name, parser and point, and its socket
 * bound and read (udp.c, tcp.c). On failure the handles already opened stay for
 * ingest_listener_close(); ingest_listener_release() frees the rest once they have closed.
 */
int ingest_listener_open(struct bd_ingest *in, struct listener *l, uint32_t idx,
                         const struct bd_listener_config *cfg, struct bd_err *err);
/*
 * Stop one listener: close its socket and idle sweep, stop reading its connections and finish
 * what they hold (a connection that has to wait for ring space stays, paused, for resume or
 * abort). A UDP listener's socket buffer is read out first by ingest_udp_drain_at_stop().
 * Idempotent.
 */
void ingest_listener_close(struct listener *l);
/* Free what the listener owns once its handles and connections have closed. */
void ingest_listener_release(struct listener *l);

/* "addr:port" or "[addr]:port" of sa, "?" for NULL. */
void ingest_format_addr(const struct sockaddr *sa, char *out, size_t cap);
/* The loop's cached monotonic time (ns): good enough for rate limiting and costs nothing. */
int64_t ingest_loop_now_ns(const struct listener *l);
/* A bad line, quoted and rate limited (a few per listener every 10 s). */
void ingest_sample_bad_line(struct listener *l, const struct sockaddr *peer, const char *reason,
                            const char *line, size_t len);
const char *ingest_too_long_reason(const struct listener *l);
/* A datagram or connection from a sender outside l->cfg.allow: counted and logged (rate
 * limited) with its address. */
void ingest_not_allowed(struct listener *l, const struct sockaddr *peer);
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
/* During a stop: call the stopped callback once no listener has a connection left. */
void ingest_maybe_stopped(struct bd_ingest *in);

/* ---- udp.c ---- */

/* Allocate the slab, bind, set the receive buffer and start reading. */
int ingest_udp_open(struct listener *l, struct bd_err *err);
/* Read again once the congestion is gone or the flusher has stalled (bd_ingest_resume). */
void ingest_udp_maybe_resume(struct listener *l);
/* At stop (or removal), before the socket closes: read out what its receive buffer still holds.
 * when ("at stop", "at its removal") is for the log. */
void ingest_udp_drain_at_stop(struct listener *l, const char *when);

/* ---- tcp.c ---- */

/* Bind, listen and start the idle sweep. */
int ingest_tcp_open(struct listener *l, struct bd_err *err);
/* Stop reading every connection of l and finish what each holds (see ingest_listener_close). */
void ingest_tcp_stop_conns(struct listener *l);
/* The stop deadline passed: close every connection of l, counting what it never processed. */
void ingest_tcp_abort_conns(struct listener *l);
/* Resume or finish the paused connections of l; false when the rings are congested again and
 * bd_ingest_resume() must stop there. *now_ns is read once, when first needed. */
bool ingest_tcp_resume_conns(struct listener *l, int64_t *now_ns);

/* For tcp_tls.c: the connection steps of tcp.c (see there). */
/* Room at the end of the connection's buffer for more plaintext: compacted, and grown (up to
 * max_line + slack) when less than the slack is free; false when there is none at all (out of
 * memory). */
bool ingest_conn_room(struct conn *c);
int ingest_conn_drain_lines(struct conn *c, int64_t now_ns, bool backpressure);
int ingest_conn_drain(struct conn *c, int64_t now_ns, bool backpressure);
int ingest_conn_finish(struct conn *c, int64_t now_ns);
void ingest_conn_pause(struct conn *c);
/* Read again (the peer has read our TLS output); a connection that cannot is closed. */
void ingest_conn_read_start(struct conn *c);
void ingest_conn_close(struct conn *c);

/* ---- tcp_tls.c ---- */

/* A TLS listener's server context (l->tls), when l->cfg has tls; 0 otherwise. */
int ingest_tls_listener_open(struct listener *l, struct bd_err *err);
/* A reload kept l: read its certificate and key again; on failure the running context stays. */
void ingest_tls_listener_reload(struct listener *l);
/* A connection accepted on a TLS listener: its session. */
int ingest_tls_conn_start(struct conn *c);
/* on_conn_read of a TLS connection (nread != 0): ciphertext or the end of the stream. */
void ingest_tls_on_read(struct conn *c, ssize_t nread);
/* conn_drain of a TLS connection: the buffered lines, then as much more plaintext as the session
 * holds, under the same backpressure. -EPROTO when the session failed (counted and logged). */
int ingest_tls_drain(struct conn *c, int64_t now_ns, bool backpressure);
/* The handshake deadline of the listener: min(10 s, idle_timeout). */
uint64_t ingest_tls_handshake_timeout_ms(const struct listener *l);
/* True (counted and logged) when c is still in its handshake past the deadline: close it. */
bool ingest_tls_handshake_overdue(struct conn *c, uint64_t now_ms);

/* ---- kstats.c ---- */

/* With a UDP listener: the buffers, the baseline reading and the timer. */
int ingest_kstats_start(struct bd_ingest *in, struct bd_err *err);
/* Brings the three counters up to date (a few small reads of /proc, never per packet). */
void ingest_kstats_update(struct bd_ingest *in);
/* Close the timer (at stop). */
void ingest_kstats_stop(struct bd_ingest *in);
/* Free the buffers (at destroy). */
void ingest_kstats_free(struct bd_ingest *in);

#endif
