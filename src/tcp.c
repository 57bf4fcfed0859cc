/*
 * TCP listeners and their connections (src/tcp.h): who may connect (allow, max_connections,
 * max_connections_per_ip, all decided at accept, before a byte is read), newline framing in a
 * per-connection buffer that grows on demand, backpressure by pausing a connection's reads,
 * and the sweep that closes idle connections and gives back buffer memory. On a TLS listener
 * each connection has a filter (src/tcp_tls.h): what is read goes into it, plaintext comes out
 * into the line buffer, and what it has for the peer is written here, under a cap on what may
 * wait to be sent (see OUT_QUEUE_MAX). Lines go down to the ingest core (src/ingest_core.h).
 *
 * Threads: the ingest thread only (src/ingest_int.h). Ownership: each connection is one heap
 * block (struct conn) with its receive buffer and, with TLS, its filter, allocated at accept
 * and freed by its close callback; bytes being written are one block per write, freed by its
 * callback.
 */
#include "tcp.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include "ingest_core.h"
#include "tcp_tls.h"

/*
 * Room beyond max_line in a connection buffer. A pending partial line never exceeds max_line
 * (longer ones close the connection), so after compaction at least this much is free and every
 * read gets a useful buffer. It is also the threshold below which the tail is compacted.
 */
#define CONN_SLACK 4096

/*
 * A connection's first buffer. It doubles while reads fill it or a partial line takes half of
 * it, up to max_line + CONN_SLACK, and the sweep shrinks it back to what the connection has
 * held lately (freeing it when nothing came): the memory an open connection costs follows
 * what its sender sends, not limits.max_line. A sender that keeps reads full reaches the
 * largest buffer within a few reads and stays there, so bulk ingest reads as before.
 */
#define CONN_BUF_MIN 4096
/* What the sweep leaves a connection that holds a few bytes of a line and sends nothing: a
 * thousand of them then cost a quarter of a MiB. The next read grows it to CONN_BUF_MIN. */
#define CONN_BUF_IDLE 256

/* Descriptors beyond the TCP connections: listeners, MongoDB, spool, metrics, the loop. */
#define NOFILE_RESERVE 256

/*
 * Output bytes a connection may have queued (written by neither uv_try_write nor the kernel)
 * before it stops reading, and the level they must fall to before it reads again. Only TLS
 * writes: the session answers some records with records of its own (a KeyUpdate that asks for
 * one, a TLS 1.2 renegotiation attempt), so a peer that sends them and never reads would
 * otherwise make the queue grow without bound. Stopping the reads stops the input that makes
 * the output: backpressure, as for lines. The queue then holds at most this plus what one
 * read's ciphertext (at most max_line + CONN_SLACK) answers.
 */
#define OUT_QUEUE_MAX (64 * 1024)
#define OUT_QUEUE_RESUME (OUT_QUEUE_MAX / 2)

struct conn {
    uv_tcp_t tcp; /* tcp.data points back here */
    struct listener *l;
    struct conn *prev, *next; /* l->conns; unlinked once closing */
    struct sockaddr_storage peer;
    struct bd_addr128 peer_key; /* what l->peers counts it under, when peer_counted */
    bool peer_counted;
    uint64_t last_active_ms; /* uv_now() when it last completed a line, for the idle sweep */
    bool paused;             /* reading stopped by backpressure */
    bool out_blocked;        /* reading stopped while the peer leaves our output unread */
    bool eof;                /* the peer finished sending; close once the buffer is consumed */
    struct ingest_tls *tls;  /* TLS listener: the connection's filter; NULL on plain ones */
    bool filled;             /* the last read filled the room it was given: grow */
    /*
     * buf[start, len) is received and not yet consumed; buf[start, scan) is known to hold no
     * '\n', so memchr never rescans bytes of a line that arrives in many reads. buf grows on
     * demand up to max_line + CONN_SLACK and is given back by the idle sweep; NULL with cap 0
     * while there is nothing in it.
     */
    size_t start, scan, len, cap;
    size_t peak;    /* most bytes held at once since the last sweep */
    bool peak_read; /* something was read since the last sweep */
    char *buf;
};

/* A refused connection needs a handle of its own only until its close callback runs. */
struct rejected {
    uv_tcp_t tcp;
    struct bd_ingest *in;
};

static void conn_close(struct conn *c);
static void conn_read_start(struct conn *c);

static void on_conn_closed(uv_handle_t *h) {
    struct conn *c = h->data;
    struct bd_ingest *in = c->l->in;
    ingest_tls_free(c->tls);
    free(c->buf);
    free(c);
    ingest_handle_closed(in);
}

static void on_rejected_closed(uv_handle_t *h) {
    struct rejected *r = h->data;
    struct bd_ingest *in = r->in;
    free(r);
    ingest_handle_closed(in);
}

static void conn_pause(struct conn *c) {
    if (!c->paused) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->paused = true;
        c->l->n_paused++;
        bd_sensor_table_request_drain(c->l->in->table);
    }
}

static void conn_unpause(struct conn *c) {
    if (c->paused) {
        c->paused = false;
        c->l->n_paused--;
    }
}

/* conn_drain_lines stopped early: the pool is congested (every connection waits) or the
 * sensor of the next line is busy (only this connection waits). */
#define DRAIN_CONGESTED 1
#define DRAIN_BUSY 2

/* Stop reading c because conn_drain returned rc (> 0), counted under why: a busy sensor
 * (tcp_sensor_pauses) or a congested pool (tcp_congestion_pauses). */
static void conn_pause_drain(struct conn *c, int rc) {
    if (!c->paused) {
        if (rc == DRAIN_BUSY) {
            BD_STAT_ADD(c->l->in->stats, tcp_sensor_pauses, 1);
        } else {
            BD_STAT_ADD(c->l->in->stats, tcp_congestion_pauses, 1);
        }
    }
    conn_pause(c);
}

/*
 * Consume the complete lines in the buffer. Returns 0 when only a partial line (if any) is left,
 * DRAIN_CONGESTED when it stopped early because the sensor table is congested, DRAIN_BUSY when
 * the next line's sensor is busy (that line and the rest wait in the buffer), or -E2BIG when a
 * line exceeds max_line and the connection must go.
 *
 * Congestion is checked after every line, not once per read: one 64 KiB read holds hundreds of
 * lines, enough to overrun a ring, and TCP promises backpressure rather than drops.
 */
static int conn_drain_lines(struct conn *c, int64_t now_ns, bool backpressure) {
    struct listener *l = c->l;
    struct bd_ingest *in = l->in;
    const struct sockaddr *peer = (const struct sockaddr *)&c->peer;

    if (c->buf == NULL) {
        return 0; /* nothing received since the sweep gave the buffer back */
    }
    /* The complete lines are those up to the last '\n': one batch for the parser. */
    const char *last = memrchr(c->buf + c->scan, '\n', c->len - c->scan);
    if (last != NULL) {
        /* Only a complete line shows the sender is alive: trickled bytes do not. */
        c->last_active_ms = uv_now(in->loop);
        size_t first = c->start;
        size_t end = (size_t)(last - c->buf) + 1;
        bd_parse_begin(&l->parser, c->buf + first, end - first);
        for (;;) {
            int rc = ingest_next_line_of_batch(l, peer, now_ns);
            if (rc == BD_PARSE_END) {
                break;
            }
            if (rc == INGEST_BUSY) {
                return DRAIN_BUSY; /* c->start stays at the start of this line */
            }
            c->start = c->scan = first + bd_parse_offset(&l->parser);
            if (rc < 0) {
                return -E2BIG;
            }
            if (backpressure && bd_sensor_table_congested(in->table)) {
                return DRAIN_CONGESTED;
            }
        }
        c->start = end;
    }
    c->scan = c->len;
    size_t pending = c->len - c->start;
    if (pending > in->max_line) {
        /* No newline yet and already too long: the line can only get longer. */
        BD_STAT_ADD(in->stats, lines, 1);
        BD_STAT_ADD(in->stats, drop_line_too_long, 1);
        ingest_sample_bad_line(l, peer, ingest_too_long_reason(l), c->buf + c->start, pending);
        return -E2BIG;
    }
    if (pending == 0) {
        /* Rewinding an empty buffer is free; moving a partial line waits until room runs out. */
        c->start = c->scan = c->len = 0;
    }
    return 0;
}

/* Move the pending bytes to the front of the buffer. */
static void conn_compact(struct conn *c) {
    if (c->start > 0) {
        size_t pending = c->len - c->start;
        memmove(c->buf, c->buf + c->start, pending);
        c->scan -= c->start;
        c->len = pending;
        c->start = 0;
    }
}

/* The buffer at cap bytes (compacted first); false, buffer unchanged, when out of memory. */
static bool conn_resize(struct conn *c, size_t cap) {
    conn_compact(c);
    BD_ASSERT(cap > c->len);
    char *b = realloc(c->buf, cap);
    if (b == NULL) {
        return false;
    }
    c->buf = b;
    c->cap = cap;
    return true;
}

/* Room at the end of the buffer for more plaintext: compacted, and grown (up to max_line +
 * slack) when less than the slack is free; false when there is none at all (out of memory). */
static bool conn_room(struct conn *c) {
    conn_compact(c);
    size_t max = c->l->in->max_line + CONN_SLACK;
    if (c->cap - c->len >= CONN_SLACK || c->cap >= max) {
        return c->len < c->cap;
    }
    size_t want = BD_MAX((size_t)CONN_BUF_MIN, c->cap);
    while (want - c->len < CONN_SLACK && want < max) {
        want = BD_MIN(want * 2, max);
    }
    return conn_resize(c, want) || c->len < c->cap;
}

/* Bytes for the peer whose write is in flight; freed by on_written. */
struct out_req {
    uv_write_t req;
    char data[];
};

static void on_written(uv_write_t *req, int status) {
    uv_stream_t *s = req->handle;
    struct conn *c = s->data;
    free((struct out_req *)req);
    /* A failed write shows up as a read error or the close that caused it: a connection that
     * stopped reading for its output reads again to see it. */
    if (!c->out_blocked || uv_is_closing((uv_handle_t *)s) ||
        (status == 0 && uv_stream_get_write_queue_size(s) > OUT_QUEUE_RESUME)) {
        return;
    }
    c->out_blocked = false;
    if (!c->paused && !c->eof) {
        conn_read_start(c);
    }
}

/* Send what the TLS filter has for the peer (handshake messages, alerts, close_notify):
 * uv_try_write, the remainder queued with uv_write in a block freed by its callback. */
static void conn_send_output(struct conn *c) {
    size_t n = ingest_tls_output_len(c->tls);
    if (n == 0) {
        return;
    }
    struct out_req *w = malloc(sizeof(*w) + n);
    if (w == NULL) {
        char sink[256];
        while (ingest_tls_take_output(c->tls, sink, sizeof(sink)) > 0) {
        }
        return; /* the handshake cannot go on; the deadline closes the connection */
    }
    n = ingest_tls_take_output(c->tls, w->data, n);
    uv_buf_t b = uv_buf_init(w->data, (unsigned)n);
    int sent = uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    if (sent == (int)n || (sent < 0 && sent != UV_EAGAIN)) {
        free(w);
        return;
    }
    if (sent > 0) {
        b.base += sent;
        b.len -= (size_t)sent;
    }
    if (uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        free(w);
        return;
    }
    if (!c->out_blocked && !c->eof &&
        uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > OUT_QUEUE_MAX) {
        /* The peer does not read what we send: read nothing more until it does (on_written).
         * A paused connection is not read either; the first of the two to end leaves it
         * to the other. */
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->out_blocked = true;
        BD_STAT_ADD(c->l->in->stats, tls_output_pauses, 1);
    }
}

/*
 * conn_drain_lines on a TLS connection: the buffered lines, then as much more plaintext as the
 * filter holds, under the same backpressure. The filter is asked for more only when the lines
 * are consumed, so a connection that pauses keeps its plaintext in the buffer and the rest
 * still encrypted in the filter. -EPROTO when the session failed (counted and logged there).
 */
static int conn_drain_tls(struct conn *c, int64_t now_ns, bool backpressure) {
    for (;;) {
        int rc = conn_drain_lines(c, now_ns, backpressure);
        if (rc != 0) {
            return rc;
        }
        /* Only a partial line (at most max_line) is left: room after it, the buffer grown
         * if need be (buffers grow on demand). */
        if (!conn_room(c)) {
            bd_warn("%s: out of memory for TLS input; closing a connection", c->l->name);
            return -ENOMEM;
        }
        ssize_t n = ingest_tls_read(c->tls, c->buf + c->len, c->cap - c->len);
        conn_send_output(c);
        if (n > 0) {
            c->len += (size_t)n;
            continue;
        }
        if (n == 0) {
            return 0;
        }
        if (n == INGEST_TLS_CLOSED) {
            /* close_notify: the end of the stream, as a TCP EOF; answered with ours. */
            if (!c->eof) {
                c->eof = true;
                ingest_tls_shutdown(c->tls);
                conn_send_output(c);
            }
            return 0;
        }
        return -EPROTO;
    }
}

/* conn_drain_lines, as one batch of the sensor table's hand-off (see sensor.h). */
static int conn_drain(struct conn *c, int64_t now_ns, bool backpressure) {
    int rc = c->tls != NULL ? conn_drain_tls(c, now_ns, backpressure)
                            : conn_drain_lines(c, now_ns, backpressure);
    bd_sensor_table_publish(c->l->in->table);
    return rc;
}

/* Bytes the kernel holds for this connection that were never read (for the stop log). */
static uint64_t unread_in_kernel(struct conn *c) {
    uv_os_fd_t fd;
    int n = 0;
    if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0 && ioctl(fd, FIONREAD, &n) == 0 && n > 0) {
        return (uint64_t)n;
    }
    return 0;
}

/*
 * A connection that will not be read again (EOF or stopping): consume its buffered lines under
 * backpressure. Returns 1 if it must wait for ring space (left open, paused), else 0 after
 * closing it. At EOF the unterminated last line is a reading; at a stop it is a torn line and
 * counted, with what the kernel still held, in tcp_unread_at_stop.
 */
static int conn_finish(struct conn *c, int64_t now_ns) {
    struct listener *l = c->l;
    int rc = conn_drain(c, now_ns, true);
    if (rc > 0) {
        return 1;
    }
    if (rc == 0 && c->len > c->start) {
        if (c->eof) {
            rc = ingest_handle_line(l, c->buf + c->start, c->len - c->start,
                                    (const struct sockaddr *)&c->peer, now_ns);
            bd_sensor_table_publish(l->in->table);
            if (rc == INGEST_BUSY) {
                return 1; /* offered again when resumed */
            }
        } else {
            BD_STAT_ADD(l->in->stats, tcp_unread_at_stop, c->len - c->start);
        }
    }
    if (!c->eof) {
        BD_STAT_ADD(l->in->stats, tcp_unread_at_stop, unread_in_kernel(c));
    }
    conn_close(c);
    return 0;
}

static void on_conn_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    struct conn *c = h->data;
    size_t max = c->l->in->max_line + CONN_SLACK;
    (void)suggested;
    if (c->start > 0 && c->cap - c->len < BD_MIN((size_t)CONN_SLACK, c->cap / 2)) {
        conn_compact(c);
    }
    size_t want = c->cap;
    if (c->cap < CONN_BUF_MIN) {
        want = BD_MAX((size_t)CONN_BUF_MIN, c->cap * 2);
    } else if (c->cap < max && (c->filled || c->cap - c->len < c->cap / 2)) {
        want = BD_MIN(c->cap * 2, max);
    }
    c->filled = false;
    if (want != c->cap && !conn_resize(c, want) && c->len == c->cap) {
        /* No room at all (out of memory): libuv reports UV_ENOBUFS and on_conn_read closes. */
        *buf = uv_buf_init(NULL, 0);
        return;
    }
    /* conn_drain keeps a partial line at or below max_line, so the slack of the largest
     * buffer is always free, and a smaller one grew above while less than half was free. */
    BD_ASSERT(c->len < c->cap);
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(c->cap - c->len));
}

/*
 * The sweep's half of the buffer policy: a buffer larger than twice what the connection held
 * since the last sweep shrinks to that (at least CONN_BUF_MIN, or CONN_BUF_IDLE when nothing
 * was read since the last sweep), and one that held nothing is freed. A paused or finished
 * connection keeps its buffer: it holds lines owed to the rings.
 */
static void conn_trim(struct conn *c) {
    size_t pending = c->len - c->start;
    size_t held = BD_MAX(c->peak, pending);
    bool read = c->peak_read;
    c->peak = pending;
    c->peak_read = false;
    if (c->buf == NULL || c->paused || c->eof) {
        return;
    }
    if (held == 0) {
        free(c->buf);
        c->buf = NULL;
        c->cap = c->start = c->scan = c->len = 0;
        return;
    }
    size_t want = read ? CONN_BUF_MIN : CONN_BUF_IDLE;
    while (want < 2 * held) {
        want *= 2;
    }
    if (want < c->cap) {
        (void)conn_resize(c, want); /* a failed shrink keeps the larger buffer */
    }
}

/* nread bytes of ciphertext read into the free end of the buffer (on_conn_alloc). */
static void conn_read_tls(struct conn *c, ssize_t nread) {
    struct listener *l = c->l;
    /* Not last_active_ms: only a complete line shows the sender is alive. */
    BD_STAT_ADD(l->in->stats, tcp_bytes, (uint64_t)nread);
    /* The filter copies the ciphertext out, and the plaintext takes its place. */
    if (ingest_tls_feed(c->tls, c->buf + c->len, (size_t)nread) < 0) {
        bd_warn("%s: out of memory for TLS input; closing a connection", l->name);
        conn_close(c);
        return;
    }
    int64_t now_ns = bd_now_ns();
    int rc = conn_drain(c, now_ns, true);
    if (rc < 0) {
        conn_close(c);
    } else if (rc > 0) {
        conn_pause_drain(c, rc);
    } else if (c->eof && conn_finish(c, now_ns) > 0) {
        conn_pause(c); /* close_notify came */
    }
}

static void on_conn_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
    struct conn *c = s->data;
    struct listener *l = c->l;
    struct bd_ingest *in = l->in;
    (void)buf; /* always c->buf + c->len, handed out by on_conn_alloc */

    if (nread == 0) {
        return; /* EAGAIN */
    }
    if (nread < 0) {
        if (nread == UV_EOF) {
            /* Whatever is buffered is still owed to the rings, under the same backpressure:
             * a congested connection waits (paused) until bd_ingest_resume() finishes it. On
             * TLS, an EOF without close_notify keeps what was decrypted, as a plain one does. */
            c->eof = true;
            if (conn_finish(c, bd_now_ns()) > 0) {
                conn_pause(c);
            }
            return;
        } else {
            char who[PEER_LEN];
            ingest_format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
            bd_debug("%s: connection from %s: %s", l->name, who, uv_strerror((int)nread));
        }
        conn_close(c);
        return;
    }
    if (c->tls != NULL) {
        conn_read_tls(c, nread);
        return;
    }

    c->filled = (size_t)nread == c->cap - c->len;
    c->len += (size_t)nread;
    c->peak = BD_MAX(c->peak, c->len - c->start);
    c->peak_read = true;
    BD_STAT_ADD(in->stats, tcp_bytes, (uint64_t)nread);

    int rc = conn_drain(c, bd_now_ns(), true);
    if (rc < 0) {
        conn_close(c);
    } else if (rc > 0) {
        conn_pause_drain(c, rc);
    }
}

static void close_sweep(struct listener *l) {
    if (l->sweep_open) {
        ingest_listener_close_handle(l, (uv_handle_t *)&l->sweep);
        l->sweep_open = false;
    }
}

/* The last connection of l went: a listener a reload removed closes its idle sweep, and its
 * slot is free once that has closed. */
static void conns_gone(struct listener *l) {
    if (l->active || l->in->stopping) {
        return;
    }
    bd_info("%s: the last connection left open at its removal has closed", l->name);
    close_sweep(l);
    ingest_listener_maybe_free(l);
}

/* Read again after a pause; a connection that cannot is closed. */
static void conn_read_start(struct conn *c) {
    int rc = uv_read_start((uv_stream_t *)&c->tcp, on_conn_alloc, on_conn_read);
    if (rc < 0) {
        bd_warn("%s: cannot resume reading: %s", c->l->name, uv_strerror(rc));
        conn_close(c);
    }
}

static void conn_close(struct conn *c) {
    struct listener *l = c->l;
    conn_unpause(c);
    if (c->peer_counted) {
        bd_peer_counts_remove(&l->peers, &c->peer_key);
        c->peer_counted = false;
    }
    if (c->prev != NULL) {
        c->prev->next = c->next;
    } else {
        l->conns = c->next;
    }
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    c->prev = c->next = NULL;
    l->n_conns--;
    /* uv_close closes the descriptor right away; only the memory waits for the callback. */
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    if (l->conns == NULL) {
        conns_gone(l);
    }
}

static void reject(struct listener *l, uv_stream_t *server) {
    struct bd_ingest *in = l->in;
    struct rejected *r = malloc(sizeof(*r));
    if (r == NULL) {
        bd_error("%s: out of memory refusing a connection", l->name);
        return;
    }
    r->in = in;
    uv_tcp_init(in->loop, &r->tcp); /* without an address family it cannot fail */
    r->tcp.data = r;
    ingest_handle_opened(in);
    /*
     * Accepting and closing at once, instead of leaving the connection in the backlog, tells
     * the client straight away and keeps the backlog free for connections we will take.
     */
    char who[PEER_LEN] = "?";
    if (uv_accept(server, (uv_stream_t *)&r->tcp) == 0) {
        struct sockaddr_storage peer;
        int plen = sizeof(peer);
        if (uv_tcp_getpeername(&r->tcp, (struct sockaddr *)&peer, &plen) == 0) {
            ingest_format_addr((const struct sockaddr *)&peer, who, sizeof(who));
        }
    }
    BD_STAT_ADD(in->stats, tcp_rejected, 1);
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        bd_warn("%s: refusing connection from %s: max_connections (%u) reached", l->name, who,
                l->cfg.max_connections);
    }
    uv_close((uv_handle_t *)&r->tcp, on_rejected_closed);
}

/*
 * Whether the accepted connection c may stay: its sender is in the allow list and holds fewer
 * than max_connections_per_ip connections (then counted as one more). Refusals are counted and
 * logged, rate limited, with the sender's address.
 */
static bool admit(struct listener *l, struct conn *c) {
    const struct sockaddr *peer = (const struct sockaddr *)&c->peer;
    if (l->cfg.allow.n > 0 && !bd_allow_match(&l->cfg.allow, peer)) {
        ingest_not_allowed(l, peer);
        return false;
    }
    if (!bd_peer_key(peer, &c->peer_key)) {
        return true; /* no address to count by (not seen on TCP/IP sockets) */
    }
    /* 0 (a config built without the loader): max_connections is the only limit. */
    uint32_t per_ip =
        l->cfg.max_connections_per_ip > 0 ? l->cfg.max_connections_per_ip : l->cfg.max_connections;
    if (bd_peer_counts_get(&l->peers, &c->peer_key) >= per_ip ||
        bd_peer_counts_add(&l->peers, &c->peer_key) == 0) {
        BD_STAT_ADD(l->in->stats, tcp_rejected_per_ip, 1);
        l->n_rejected_per_ip++;
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            char who[PEER_LEN];
            ingest_format_addr(peer, who, sizeof(who));
            bd_warn("%s: refusing connection from %s: it holds max_connections_per_ip (%u)%s",
                    l->name, who, per_ip,
                    peer->sa_family == AF_INET6 && c->peer_key.lo == 0 ? " in its /64" : "");
        }
        return false;
    }
    c->peer_counted = true;
    return true;
}

static void on_tcp_connection(uv_stream_t *server, int status) {
    struct listener *l = server->data;
    struct bd_ingest *in = l->in;
    struct conn *c = NULL;
    int rc = 0;

    if (status < 0) {
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            bd_warn("%s: accept failed: %s", l->name, uv_strerror(status));
        }
        return;
    }
    if (in->stopping || l->n_conns >= l->cfg.max_connections) {
        reject(l, server);
        return;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        reject(l, server);
        return;
    }
    c->l = l;
    uv_tcp_init(in->loop, &c->tcp); /* without an address family it cannot fail */
    c->tcp.data = c;
    ingest_handle_opened(in);

    /* Linked first so that conn_close() below undoes exactly one thing on any failure. */
    c->next = l->conns;
    if (l->conns != NULL) {
        l->conns->prev = c;
    }
    l->conns = c;
    l->n_conns++;

    rc = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (rc < 0) {
        goto out;
    }
    int plen = sizeof(c->peer);
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&c->peer, &plen) < 0) {
        c->peer.ss_family = AF_UNSPEC; /* matches no allow list */
    }
    if (!admit(l, c)) {
        conn_close(c); /* before anything is read */
        return;
    }
    if (l->tls != NULL && (rc = ingest_tls_new(&c->tls, l, (const struct sockaddr *)&c->peer,
                                               uv_now(in->loop))) < 0) {
        goto out;
    }
    c->last_active_ms = uv_now(in->loop);
    rc = uv_read_start((uv_stream_t *)&c->tcp, on_conn_alloc, on_conn_read);
    if (rc < 0) {
        goto out;
    }
    BD_STAT_ADD(in->stats, tcp_connections, 1);
    if (bd_log_get_level() >= BD_LOG_DEBUG) {
        char who[PEER_LEN];
        ingest_format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
        bd_debug("%s: connection from %s (%u open)", l->name, who, l->n_conns);
    }
out:
    if (rc < 0) {
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            bd_warn("%s: cannot take a connection: %s", l->name, uv_strerror(rc));
        }
        conn_close(c);
    }
}

static void on_sweep(uv_timer_t *t) {
    struct listener *l = t->data;
    uint64_t now = uv_now(l->in->loop);
    struct conn *next = NULL;
    for (struct conn *c = l->conns; c != NULL; c = next) {
        next = c->next;
        if (c->tls != NULL && ingest_tls_handshake_overdue(c->tls, now)) {
            conn_close(c);
            continue;
        }
        conn_trim(c);
        /* A paused connection is silent because we stopped reading, not because it is idle. */
        if (l->cfg.idle_timeout_ms > 0 && !c->paused &&
            now - c->last_active_ms >= l->cfg.idle_timeout_ms) {
            BD_STAT_ADD(l->in->stats, tcp_idle_closed, 1);
            if (bd_log_get_level() >= BD_LOG_DEBUG) {
                char who[PEER_LEN];
                ingest_format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
                bd_debug("%s: closing idle connection from %s", l->name, who);
            }
            conn_close(c);
        }
    }
}

/*
 * Every TCP connection is a descriptor. Raise the soft RLIMIT_NOFILE to the hard limit when the
 * listeners' max_connections need more than it allows, and warn when even the hard limit (the
 * unit's LimitNOFILE=) is short: accept would fail with EMFILE before max_connections.
 */
static void check_nofile(struct listener *l) {
    struct bd_ingest *in = l->in;
    struct rlimit rl;
    rlim_t need = NOFILE_RESERVE;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        const struct listener *o = &in->listeners[i];
        if (o->in_use && o->cfg.proto == BD_PROTO_TCP) {
            need += o->cfg.max_connections;
        }
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= need) {
        return;
    }
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) == 0) {
            bd_info("%s: open files limit raised from %llu to %llu", l->name,
                    (unsigned long long)was, (unsigned long long)rl.rlim_cur);
        } else {
            rl.rlim_cur = was;
        }
    }
    if (rl.rlim_cur < need) {
        bd_warn("%s: max_connections cannot be honoured: the TCP listeners' max_connections and "
                "%d other descriptors need %llu open files, RLIMIT_NOFILE allows %llu (raise "
                "LimitNOFILE= in the unit)",
                l->name, NOFILE_RESERVE, (unsigned long long)need, (unsigned long long)rl.rlim_cur);
    }
}

int ingest_tcp_open(struct listener *l, struct bd_err *err) {
    struct bd_ingest *in = l->in;
    const struct sockaddr *sa = (const struct sockaddr *)&l->cfg.addr;
    int rc = 0;

    rc = ingest_tls_listener_open(l, err);
    if (rc < 0) {
        goto out;
    }
    rc = uv_tcp_init_ex(in->loop, &l->h.tcp, sa->sa_family);
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }
    l->h.handle.data = l;
    l->h_open = true;
    ingest_handle_opened(in);

    /* libuv defers EADDRINUSE from bind to listen, so both report the same way. */
    rc = uv_tcp_bind(&l->h.tcp, sa, 0);
    if (rc == 0) {
        rc = uv_listen((uv_stream_t *)&l->h.tcp, SOMAXCONN, on_tcp_connection);
    }
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }

    /* The descriptors the connections need: raise the soft limit, or say it is short. */
    check_nofile(l);
    rc = bd_peer_counts_init(&l->peers, l->cfg.max_connections, (uint64_t)bd_mono_ns());
    if (rc < 0) {
        bd_err_set(err, rc, "%s: out of memory", l->name);
        goto out;
    }

    /* Always swept: idle connections close (idle_timeout), buffers shrink (conn_trim), and
     * with TLS the handshake deadline (no longer than idle_timeout). */
    {
        uint64_t span = l->tls != NULL               ? ingest_tls_handshake_timeout_ms(l)
                        : l->cfg.idle_timeout_ms > 0 ? l->cfg.idle_timeout_ms
                                                     : 4000;
        uint64_t every = BD_MIN(BD_MAX(span / 4, (uint64_t)1), (uint64_t)1000);
        uv_timer_init(in->loop, &l->sweep);
        l->sweep.data = l;
        l->sweep_open = true;
        ingest_handle_opened(in);
        /* Unreferenced: an idle sweep alone must not keep the loop running. */
        uv_unref((uv_handle_t *)&l->sweep);
        rc = uv_timer_start(&l->sweep, on_sweep, every, every);
        if (rc < 0) {
            bd_err_set(err, rc, "%s: idle timer: %s", l->name, uv_strerror(rc));
            goto out;
        }
    }
out:
    return rc;
}

void ingest_tcp_close(struct listener *l) {
    close_sweep(l);
    int64_t now_ns = l->conns != NULL ? bd_now_ns() : 0;
    struct conn *next = NULL;
    for (struct conn *c = l->conns; c != NULL; c = next) {
        next = c->next;
        /* Complete lines already received are owed to the rings; a connection that has to
         * wait for ring space stays open, not read, until resume or abort finishes it. */
        uv_read_stop((uv_stream_t *)&c->tcp);
        if (conn_finish(c, now_ns) > 0) {
            conn_pause(c);
        }
    }
}

void ingest_tcp_abort_conns(struct listener *l) {
    while (l->conns != NULL) {
        struct conn *c = l->conns;
        BD_STAT_ADD(l->in->stats, tcp_unread_at_stop,
                    (c->len - c->start) + unread_in_kernel(c) +
                        (c->tls != NULL ? ingest_tls_unread(c->tls) : 0));
        conn_close(c);
    }
}

bool ingest_tcp_resume_conns(struct listener *l, int64_t *now_ns) {
    struct bd_ingest *in = l->in;
    struct conn *next = NULL;
    for (struct conn *c = l->conns; c != NULL && l->n_paused > 0; c = next) {
        next = c->next;
        if (!c->paused) {
            continue;
        }
        if (bd_sensor_table_congested(in->table)) {
            return false;
        }
        if (*now_ns == 0) {
            *now_ns = bd_now_ns();
        }
        if (c->eof || in->stopping) {
            /* Never read again: finish the buffer, then close. A busy sensor keeps only this
             * connection waiting. */
            if (conn_finish(c, *now_ns) > 0) {
                if (bd_sensor_table_congested(in->table)) {
                    return false;
                }
            }
            continue;
        }
        /* Lines left in the buffer when the connection paused go first, in order. */
        int rc = conn_drain(c, *now_ns, true);
        if (rc < 0) {
            conn_close(c);
            continue;
        }
        if (rc == DRAIN_BUSY) {
            continue; /* its sensor is still busy: the others go on */
        }
        if (rc > 0) {
            return false;
        }
        conn_unpause(c);
        c->last_active_ms = uv_now(in->loop);
        if (!c->out_blocked) {
            conn_read_start(c); /* else once the peer has read our output (on_written) */
        }
    }
    return true;
}
