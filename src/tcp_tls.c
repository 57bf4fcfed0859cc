/*
 * TLS on TCP connections (listeners[].tls): the glue between a connection of tcp.c and its
 * session (include/bucketd/tls.h). Ingest thread only (src/ingest_int.h).
 *
 * Ciphertext is read where plain text would be (on_conn_alloc hands out the free end of the
 * connection's line buffer) and fed to the session at once, which copies it; the plaintext is
 * then decrypted into that same free end and framed into lines exactly as on a plain
 * connection. A drain takes the complete lines first and asks the session for more only when
 * they are consumed, so when the rings are congested the connection pauses with its plaintext in
 * the buffer and the rest still encrypted in the session, and a resume or a stop picks both up in
 * order. Handshake messages and alerts go out as they appear: uv_try_write, the remainder queued
 * with uv_write in a block freed by its callback.
 *
 * A connection still in its handshake after ingest_tls_handshake_timeout_ms() is closed by the
 * listener's sweep (tcp.c), so half-open handshakes cannot hold connection slots.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ingest_int.h"

/* The longest a handshake may take, if idle_timeout is not shorter. */
#define HANDSHAKE_TIMEOUT_MS 10000

/*
 * Output bytes a connection may have queued (written by neither uv_try_write nor the kernel)
 * before it stops reading, and the level they must fall to before it reads again. The server
 * answers some records with records of its own (a KeyUpdate that asks for one, a TLS 1.2
 * renegotiation attempt), so a peer that sends them and never reads would otherwise make
 * the queue grow without bound. Stopping the reads stops the input that makes the output:
 * backpressure, as on plain TCP. The queue then holds at most this plus what one read's
 * ciphertext (at most max_line + 4 KiB) answers.
 */
#define OUT_QUEUE_MAX (64 * 1024)
#define OUT_QUEUE_RESUME (OUT_QUEUE_MAX / 2)

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
        ingest_conn_read_start(c);
    }
}

/* Send what the session has for the peer (handshake messages, alerts, close_notify). */
static void send_output(struct conn *c) {
    size_t n = bd_tls_output_len(c->tls);
    if (n == 0) {
        return;
    }
    struct out_req *w = malloc(sizeof(*w) + n);
    if (w == NULL) {
        char sink[256];
        while (bd_tls_take_output(c->tls, sink, sizeof(sink)) > 0) {
        }
        return; /* the handshake cannot go on; the deadline closes the connection */
    }
    n = bd_tls_take_output(c->tls, w->data, n);
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

static void peer_text(const struct conn *c, char *who, size_t cap) {
    ingest_format_addr((const struct sockaddr *)&c->peer, who, cap);
}

/* A session that failed: counted by whether it got past its handshake, logged rate limited. */
static void report_failure(struct conn *c) {
    struct listener *l = c->l;
    bool handshake = !bd_tls_established(c->tls);
    if (handshake) {
        BD_STAT_ADD(l->in->stats, tls_handshake_failures, 1);
    } else {
        BD_STAT_ADD(l->in->stats, tls_errors, 1);
    }
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        char who[PEER_LEN];
        peer_text(c, who, sizeof(who));
        bd_warn("%s: TLS %s with %s failed, closing: %s", l->name,
                handshake ? "handshake" : "session", who, bd_tls_reason(c->tls));
    }
}

/* What the listener now serves, and a warning when its certificate has expired. */
static void log_certificate(const struct listener *l, const char *when) {
    char until[64];
    bool expired = bd_tls_ctx_expiry(l->tls, until, sizeof(until));
    bd_info("%s%s: TLS with certificate %s (valid until %s)%s%s", when, l->name, l->cfg.tls.cert,
            until, l->cfg.tls.client_ca[0] != '\0' ? ", client certificates verified against " : "",
            l->cfg.tls.client_ca);
    if (expired) {
        bd_warn("%s%s: the certificate in %s expired on %s: clients that check it will refuse "
                "the connection",
                when, l->name, l->cfg.tls.cert, until);
    }
}

int ingest_tls_listener_open(struct listener *l, struct bd_err *err) {
    struct bd_err terr = {0};
    const char *key = NULL;
    if (!bd_tls_enabled(&l->cfg)) {
        return 0;
    }
    int rc = bd_tls_ctx_new(&l->tls, &l->cfg, &key, &terr);
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: tls.%s: %s", l->name, key, terr.msg);
    }
    log_certificate(l, "");
    return 0;
}

void ingest_tls_listener_reload(struct listener *l) {
    struct bd_tls_ctx *next = NULL;
    struct bd_err terr = {0};
    const char *key = NULL;
    if (l->tls == NULL) {
        return;
    }
    if (bd_tls_ctx_new(&next, &l->cfg, &key, &terr) < 0) {
        bd_error("reload: %s: tls.%s: %s; new connections keep the certificate read before",
                 l->name, key, terr.msg);
        return;
    }
    /* Open sessions hold their own reference to the context they started with. */
    bd_tls_ctx_free(l->tls);
    l->tls = next;
    bd_info("reload: %s: TLS certificate and key read again", l->name);
    log_certificate(l, "reload: ");
}

int ingest_tls_conn_start(struct conn *c) {
    c->accepted_ms = uv_now(c->l->in->loop);
    return bd_tls_new(&c->tls, c->l->tls);
}

int ingest_tls_drain(struct conn *c, int64_t now_ns, bool backpressure) {
    struct listener *l = c->l;
    for (;;) {
        int rc = ingest_conn_drain_lines(c, now_ns, backpressure);
        if (rc != 0) {
            return rc;
        }
        /* Only a partial line (at most max_line) is left: room after it, the buffer grown
         * if need be (buffers grow on demand, tcp.c). */
        if (!ingest_conn_room(c)) {
            bd_warn("%s: out of memory for TLS input; closing a connection", l->name);
            return -ENOMEM;
        }
        bool was = bd_tls_established(c->tls);
        ssize_t n = bd_tls_read(c->tls, c->buf + c->len, c->cap - c->len);
        send_output(c);
        if (!was && bd_tls_established(c->tls)) {
            BD_STAT_ADD(l->in->stats, tls_handshakes, 1);
            if (bd_log_get_level() >= BD_LOG_DEBUG) {
                char who[PEER_LEN];
                peer_text(c, who, sizeof(who));
                bd_debug("%s: TLS handshake with %s complete", l->name, who);
            }
        }
        if (n > 0) {
            c->len += (size_t)n;
            continue;
        }
        if (n == 0) {
            return 0;
        }
        if (n == BD_TLS_CLOSED) {
            /* close_notify: the end of the stream, as a TCP EOF; answered with ours. */
            if (!c->eof) {
                c->eof = true;
                bd_tls_shutdown(c->tls);
                send_output(c);
            }
            return 0;
        }
        report_failure(c);
        return -EPROTO;
    }
}

void ingest_tls_on_read(struct conn *c, ssize_t nread) {
    struct listener *l = c->l;
    struct bd_ingest *in = l->in;
    int rc = 0;

    if (nread < 0) {
        if (nread != UV_EOF) {
            char who[PEER_LEN];
            peer_text(c, who, sizeof(who));
            bd_debug("%s: connection from %s: %s", l->name, who, uv_strerror((int)nread));
            ingest_conn_close(c);
            return;
        }
        /* TCP EOF without close_notify: what was decrypted is kept, as on a plain connection. */
        c->eof = true;
        if (ingest_conn_finish(c, bd_now_ns()) > 0) {
            ingest_conn_pause(c);
        }
        return;
    }

    /* Not last_active_ms: only a complete line shows the sender is alive (tcp.c). */
    BD_STAT_ADD(in->stats, tcp_bytes, (uint64_t)nread);
    /* The ciphertext sits at the free end of the buffer (on_conn_alloc); the session copies it
     * out, and the plaintext takes its place. */
    if (bd_tls_feed(c->tls, c->buf + c->len, (size_t)nread) < 0) {
        bd_warn("%s: out of memory for TLS input; closing a connection", l->name);
        ingest_conn_close(c);
        return;
    }
    int64_t now_ns = bd_now_ns();
    rc = ingest_conn_drain(c, now_ns, true);
    if (rc < 0) {
        ingest_conn_close(c);
    } else if (rc > 0) {
        ingest_conn_pause(c);
    } else if (c->eof && ingest_conn_finish(c, now_ns) > 0) {
        ingest_conn_pause(c);
    }
}

uint64_t ingest_tls_handshake_timeout_ms(const struct listener *l) {
    uint64_t idle = l->cfg.idle_timeout_ms;
    return idle > 0 ? BD_MIN(idle, (uint64_t)HANDSHAKE_TIMEOUT_MS) : HANDSHAKE_TIMEOUT_MS;
}

bool ingest_tls_handshake_overdue(struct conn *c, uint64_t now_ms) {
    struct listener *l = c->l;
    uint64_t limit = ingest_tls_handshake_timeout_ms(l);
    if (bd_tls_established(c->tls) || now_ms - c->accepted_ms < limit) {
        return false;
    }
    BD_STAT_ADD(l->in->stats, tls_handshake_timeouts, 1);
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        char who[PEER_LEN];
        peer_text(c, who, sizeof(who));
        bd_warn("%s: TLS handshake with %s not finished within %llu ms, closing", l->name, who,
                (unsigned long long)limit);
    }
    return true;
}
