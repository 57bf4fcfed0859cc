/*
 * TLS on TCP listeners (listeners[].tls) as a filter of a connection (src/tcp_tls.h): a
 * listener's server context, and per connection one OpenSSL session between memory buffers
 * (include/bucketd/tls.h) with what the ingest stage adds to it: counting and logging the
 * handshakes and failures under the listener's name, and the handshake deadline.
 *
 * tcp.c drives it like a BIO pair: the ciphertext it reads goes in (ingest_tls_feed, copied),
 * plaintext comes out into the free end of the connection's line buffer (ingest_tls_read), and
 * what the session has for the peer (handshake messages, alerts, KeyUpdates, close_notify) is
 * taken out and written by tcp.c (ingest_tls_take_output), which also decides when to read
 * again. The filter never sees the socket or the connection and calls nothing of tcp.c; so a
 * connection paused by backpressure keeps its undecrypted ciphertext here, and a resume or a
 * stop picks it up in order.
 *
 * Threads: the ingest thread only. Ownership: a filter is one heap block with its session,
 * created at accept and freed by the connection's close callback; a listener's context is the
 * listener's (l->tls), and each session holds a reference of its own, so a context a reload
 * replaced lives on until its last connection closes.
 */
#include "tcp_tls.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ingest_core.h"

/* The longest a handshake may take, if idle_timeout is not shorter. */
#define HANDSHAKE_TIMEOUT_MS 10000

struct ingest_tls {
    struct bd_tls *session;
    struct listener *l;
    const struct sockaddr *peer; /* the connection's, for the logs */
    uint64_t accepted_ms;        /* uv_now() at accept, for the handshake deadline */
};

/* ---------------------------------------------------------------------------------------- */
/* A listener's context                                                                     */

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

uint64_t ingest_tls_handshake_timeout_ms(const struct listener *l) {
    uint64_t idle = l->cfg.idle_timeout_ms;
    return idle > 0 ? BD_MIN(idle, (uint64_t)HANDSHAKE_TIMEOUT_MS) : HANDSHAKE_TIMEOUT_MS;
}

/* ---------------------------------------------------------------------------------------- */
/* A connection's filter                                                                    */

int ingest_tls_new(struct ingest_tls **out, struct listener *l, const struct sockaddr *peer,
                   uint64_t now_ms) {
    struct ingest_tls *t = calloc(1, sizeof(*t));
    *out = NULL;
    if (t == NULL) {
        return -ENOMEM;
    }
    int rc = bd_tls_new(&t->session, l->tls);
    if (rc < 0) {
        free(t);
        return rc;
    }
    t->l = l;
    t->peer = peer;
    t->accepted_ms = now_ms;
    *out = t;
    return 0;
}

void ingest_tls_free(struct ingest_tls *t) {
    if (t != NULL) {
        bd_tls_free(t->session);
        free(t);
    }
}

int ingest_tls_feed(struct ingest_tls *t, const void *data, size_t len) {
    return bd_tls_feed(t->session, data, len);
}

/* A session that failed: counted by whether it got past its handshake, logged rate limited. */
static void report_failure(struct ingest_tls *t) {
    struct listener *l = t->l;
    bool handshake = !bd_tls_established(t->session);
    if (handshake) {
        BD_STAT_ADD(l->in->stats, tls_handshake_failures, 1);
    } else {
        BD_STAT_ADD(l->in->stats, tls_errors, 1);
    }
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        char who[PEER_LEN];
        ingest_format_addr(t->peer, who, sizeof(who));
        bd_warn("%s: TLS %s with %s failed, closing: %s", l->name,
                handshake ? "handshake" : "session", who, bd_tls_reason(t->session));
    }
}

ssize_t ingest_tls_read(struct ingest_tls *t, char *buf, size_t cap) {
    struct listener *l = t->l;
    bool was = bd_tls_established(t->session);
    ssize_t n = bd_tls_read(t->session, buf, cap);
    if (!was && bd_tls_established(t->session)) {
        BD_STAT_ADD(l->in->stats, tls_handshakes, 1);
        if (bd_log_get_level() >= BD_LOG_DEBUG) {
            char who[PEER_LEN];
            ingest_format_addr(t->peer, who, sizeof(who));
            bd_debug("%s: TLS handshake with %s complete", l->name, who);
        }
    }
    if (n >= 0 || n == BD_TLS_CLOSED) {
        return n == BD_TLS_CLOSED ? INGEST_TLS_CLOSED : n;
    }
    report_failure(t);
    return -EPROTO;
}

size_t ingest_tls_output_len(const struct ingest_tls *t) {
    return bd_tls_output_len(t->session);
}

size_t ingest_tls_take_output(struct ingest_tls *t, char *buf, size_t cap) {
    return bd_tls_take_output(t->session, buf, cap);
}

void ingest_tls_shutdown(struct ingest_tls *t) {
    bd_tls_shutdown(t->session);
}

size_t ingest_tls_unread(const struct ingest_tls *t) {
    return bd_tls_unread(t->session);
}

bool ingest_tls_handshake_overdue(struct ingest_tls *t, uint64_t now_ms) {
    struct listener *l = t->l;
    uint64_t limit = ingest_tls_handshake_timeout_ms(l);
    if (bd_tls_established(t->session) || now_ms - t->accepted_ms < limit) {
        return false;
    }
    BD_STAT_ADD(l->in->stats, tls_handshake_timeouts, 1);
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        char who[PEER_LEN];
        ingest_format_addr(t->peer, who, sizeof(who));
        bd_warn("%s: TLS handshake with %s not finished within %llu ms, closing", l->name, who,
                (unsigned long long)limit);
    }
    return true;
}
