/*
 * Listeners: UDP datagrams and TCP line streams turned into parsed points for the sensor table.
 * This file holds the part every listener shares (lifetime, one listener's open and close, bad
 * line samples, lines to the sensor table) and the public API; UDP is in udp.c, TCP in tcp.c,
 * the kernel's UDP counters in kstats.c (see src/ingest_int.h).
 *
 * Threads: everything in these files runs on the ingest thread, the one that owns the uv loop
 * handed to bd_ingest_new(); nothing here is touched from any other thread, so there are no
 * locks or atomics apart from the stats counters.
 *
 * Ownership: struct bd_ingest owns an array of listeners and, when one of them is UDP, the timer
 * and buffers that read the kernel's UDP counters from /proc. Each listener owns its uv handle,
 * one parser, one struct bd_point (heap: about 12 KiB), for UDP one 20 x 64 KiB receive slab,
 * and for TCP an idle-sweep timer and its connections. Each connection is one heap block (struct
 * plus a receive buffer of limits.max_line + CONN_SLACK bytes) allocated at accept and freed by
 * its close callback. Nothing is allocated per datagram or per line.
 *
 * A reload changes the listener set (bd_ingest_set_listeners): a new listener opens in a free
 * slot; a removed one closes its socket (UDP: after reading out its buffer, as at a stop) and,
 * TCP, keeps its connections until their senders close them, so that nothing they send is
 * lost; its slot is free again once its handles have closed.
 *
 * Lifetime: every uv handle that is open counts in in->open_handles and its close callback
 * decrements it. The struct is destroyed when it has been released (bd_ingest_free, or a failed
 * bd_ingest_new) and no handle is left open, so a close callback never sees freed memory, even
 * if the owner frees before running the loop.
 */
#include "bucketd/ingest.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "bucketd/escape.h"
#include "bucketd/log.h"
#include "bucketd/parse.h"
#include "ingest_int.h"

/* Bad-line samples: a few per listener every 10 s, whatever the input rate. */
#define SAMPLE_BURST 5
#define SAMPLE_INTERVAL_NS (10 * BD_NS_PER_S)
/* Bytes of an offending line quoted in a sample. */
#define SAMPLE_QUOTE 96

/* Listener slots: every listener a configuration may have, and as many removed ones still
 * finishing their connections. */
#define LISTENER_SLOTS (2 * BD_MAX_LISTENERS)

/* ---------------------------------------------------------------------------------------- */
/* Lifetime                                                                                 */

void ingest_listener_release(struct listener *l) {
    BD_ASSERT(l->conns == NULL);
    if (l->parser_ok) {
        bd_parser_close(&l->parser);
        l->parser_ok = false;
    }
    free(l->point);
    l->point = NULL;
    free(l->slab);
    l->slab = NULL;
    bd_tls_ctx_free(l->tls);
    l->tls = NULL;
    bd_peer_counts_close(&l->peers);
}

static void destroy(struct bd_ingest *in) {
    BD_ASSERT(in->open_handles == 0);
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        ingest_listener_release(&in->listeners[i]);
    }
    free(in->listeners);
    ingest_kstats_free(in);
    free(in);
}

void ingest_handle_closed(struct bd_ingest *in) {
    BD_ASSERT(in->open_handles > 0);
    in->open_handles--;
    if (in->open_handles == 0 && in->released) {
        destroy(in);
    }
}

/* A removed listener whose handles and connections are all gone gives its slot back. */
static void maybe_free_slot(struct listener *l) {
    if (l->in_use && !l->active && l->closing == 0 && !l->h_open && !l->sweep_open &&
        l->conns == NULL) {
        ingest_listener_release(l);
        l->in_use = false;
    }
}

void ingest_on_listener_handle_closed(uv_handle_t *h) {
    struct listener *l = h->data;
    struct bd_ingest *in = l->in;
    BD_ASSERT(l->closing > 0);
    l->closing--;
    maybe_free_slot(l);
    ingest_handle_closed(in);
}

static void close_handle(struct listener *l, uv_handle_t *h) {
    l->closing++;
    uv_close(h, ingest_on_listener_handle_closed);
}

/* ---------------------------------------------------------------------------------------- */
/* Log helpers                                                                              */

void ingest_format_addr(const struct sockaddr *sa, char *out, size_t cap) {
    char host[INET6_ADDRSTRLEN] = "?";
    if (sa == NULL) {
        snprintf(out, cap, "?");
        return;
    }
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a4 = (const struct sockaddr_in *)sa;
        uv_ip4_name(a4, host, sizeof(host));
        snprintf(out, cap, "%s:%u", host, (unsigned)ntohs(a4->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)sa;
        uv_ip6_name(a6, host, sizeof(host));
        snprintf(out, cap, "[%s]:%u", host, (unsigned)ntohs(a6->sin6_port));
    } else {
        snprintf(out, cap, "(family %d)", (int)sa->sa_family);
    }
}

/*
 * Quote at most SAMPLE_QUOTE bytes of untrusted input so a sample can never forge log lines,
 * carry terminal escapes or break the quoting (bd_escape; the quote and backslash too).
 */
static void sanitise(const char *line, size_t len, char *out, size_t cap) {
    bd_escape(out, cap, line, BD_MIN(len, (size_t)SAMPLE_QUOTE), 0);
}

int64_t ingest_loop_now_ns(const struct listener *l) {
    /* The loop's cached monotonic time is good enough for rate limiting and costs nothing. */
    return (int64_t)uv_now(l->in->loop) * BD_NS_PER_MS;
}

void ingest_sample_bad_line(struct listener *l, const struct sockaddr *peer, const char *reason,
                            const char *line, size_t len) {
    if (!bd_ratelimit_ok(&l->rl_lines, ingest_loop_now_ns(l))) {
        return;
    }
    char who[PEER_LEN];
    char quoted[SAMPLE_QUOTE * 4 + 8];
    ingest_format_addr(peer, who, sizeof(who));
    sanitise(line, len, quoted, sizeof(quoted));
    /* Say how many samples the limiter swallowed since the last one, so the rate is visible. */
    char more[48] = "";
    uint64_t suppressed = l->rl_lines.suppressed - l->rl_lines_reported;
    l->rl_lines_reported = l->rl_lines.suppressed;
    if (suppressed > 0) {
        snprintf(more, sizeof(more), " (%llu similar not logged)", (unsigned long long)suppressed);
    }
    bd_warn("%s: bad line from %s: %s (%zu bytes): \"%s\"%s%s", l->name, who, reason, len, quoted,
            len > SAMPLE_QUOTE ? "..." : "", more);
}

static const char *parse_reason(int rc) {
    switch (rc) {
    case BD_PARSE_ETOO_MANY_FIELDS:
        return "too many fields";
    case BD_PARSE_ETOO_MANY_TAGS:
        return "too many tags";
    case BD_PARSE_ERANGE:
        return "value out of range";
    default:
        return "syntax error";
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Lines                                                                                    */

const char *ingest_too_long_reason(const struct listener *l) {
    /* A stream cannot resynchronise on a line it did not keep, so TCP gives up the connection. */
    return l->cfg.proto == BD_PROTO_TCP ? "line longer than limits.max_line, connection closed"
                                        : "line longer than limits.max_line";
}

/*
 * What the parser made of one line (text, without its '\n'): counted, sampled if bad, and if
 * good handed to the sensor table. Returns 0, -E2BIG when the line exceeds max_line (TCP
 * closes the connection on it, UDP just moves to the next line), or INGEST_BUSY (TCP only) when
 * its sensor is busy and the line must be offered again later.
 */
static int line_result(struct listener *l, int rc, const char *errmsg, struct bd_str line,
                       const struct sockaddr *peer, int64_t now_ns) {
    struct bd_ingest *in = l->in;
    if (rc == BD_PARSE_SKIP) {
        return 0;
    }
    if (rc == BD_PARSE_ETOO_LONG) {
        BD_STAT_ADD(in->stats, lines, 1);
        BD_STAT_ADD(in->stats, drop_line_too_long, 1);
        ingest_sample_bad_line(l, peer, ingest_too_long_reason(l), line.ptr, line.len);
        return -E2BIG;
    }
    if (rc < 0) {
        BD_STAT_ADD(in->stats, lines, 1);
        if (rc == BD_PARSE_ETOO_MANY_FIELDS) {
            BD_STAT_ADD(in->stats, drop_too_many_fields, 1);
        } else {
            BD_STAT_ADD(in->stats, drop_parse_error, 1);
        }
        ingest_sample_bad_line(l, peer, errmsg != NULL ? errmsg : parse_reason(rc), line.ptr,
                               line.len);
        return 0;
    }
    /* Every refusal (time window, names, limits, pool full) is counted by the table itself,
     * except a busy sensor's: a TCP line waits for it (counted once it goes through), a UDP
     * reading is dropped. */
    if (bd_sensor_table_accept(in->table, l->point, now_ns) == -EAGAIN) {
        if (l->cfg.proto == BD_PROTO_TCP) {
            return INGEST_BUSY;
        }
        BD_STAT_ADD(in->stats, drop_sensor_busy, 1);
    }
    BD_STAT_ADD(in->stats, lines, 1);
    return 0;
}

void ingest_not_allowed(struct listener *l, const struct sockaddr *peer) {
    BD_STAT_ADD(l->in->stats, drop_not_allowed, 1);
    l->n_not_allowed++;
    if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
        char who[PEER_LEN];
        ingest_format_addr(peer, who, sizeof(who));
        bd_warn("%s: %s from %s dropped: not in allow", l->name,
                l->cfg.proto == BD_PROTO_UDP ? "datagram" : "connection", who);
    }
}

/* One line without its '\n', on its own (a TCP stream's unterminated last line). */
int ingest_handle_line(struct listener *l, const char *line, size_t len,
                       const struct sockaddr *peer, int64_t now_ns) {
    const char *errmsg = NULL;
    int rc = bd_parse_line(&l->parser, line, len, l->point, &errmsg);
    return line_result(l, rc, errmsg, (struct bd_str){line, len}, peer, now_ns);
}

/*
 * The next line of the batch begun on the listener's parser (bd_parse_begin); BD_PARSE_END
 * when there is none, else what line_result() returns for it.
 */
int ingest_next_line_of_batch(struct listener *l, const struct sockaddr *peer, int64_t now_ns) {
    const char *errmsg = NULL;
    struct bd_str line;
    int rc = bd_parse_next(&l->parser, l->point, &line, &errmsg);
    if (rc == BD_PARSE_END) {
        return BD_PARSE_END;
    }
    return line_result(l, rc, errmsg, line, peer, now_ns);
}

void ingest_maybe_stopped(struct bd_ingest *in) {
    if (!in->stopping || in->stopped_cb == NULL) {
        return;
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        if (in->listeners[i].conns != NULL) {
            return;
        }
    }
    bd_ingest_stopped_cb cb = in->stopped_cb;
    in->stopped_cb = NULL;
    cb(in->stopped_arg);
}

/* ---------------------------------------------------------------------------------------- */
/* One listener                                                                             */

static void log_bound(const struct listener *l) {
    struct sockaddr_storage local;
    int len = sizeof(local);
    char where[PEER_LEN] = "?";
    int rc = l->cfg.proto == BD_PROTO_UDP
                 ? uv_udp_getsockname(&l->h.udp, (struct sockaddr *)&local, &len)
                 : uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&local, &len);
    if (rc == 0) {
        ingest_format_addr((const struct sockaddr *)&local, where, sizeof(where));
    }
    bd_info("%s: listening on %s, format %s, precision %s", l->name, where,
            bd_format_name(l->cfg.format), bd_precision_name(l->cfg.precision));
}

int ingest_listener_open(struct bd_ingest *in, struct listener *l, uint32_t idx,
                         const struct bd_listener_config *cfg, struct bd_err *err) {
    l->in = in;
    l->idx = idx;
    l->cfg = *cfg;
    l->in_use = true;
    l->active = true;
    /* Numbered from 1, as a person counts the entries of the listeners list. */
    snprintf(l->name, sizeof(l->name), "listener %u (%s %s)", idx + 1, bd_proto_name(l->cfg.proto),
             l->cfg.bind);
    l->rl_lines = (struct bd_ratelimit){.interval_ns = SAMPLE_INTERVAL_NS, .burst = SAMPLE_BURST};
    l->rl_events = l->rl_lines;

    int rc = bd_parser_init(&l->parser, l->cfg.format, l->cfg.precision, in->max_line);
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: cannot set up the parser: %s", l->name, strerror(-rc));
    }
    l->parser_ok = true;
    l->point = malloc(sizeof(*l->point));
    if (l->point == NULL) {
        return bd_err_set(err, -ENOMEM, "%s: out of memory", l->name);
    }

    rc = l->cfg.proto == BD_PROTO_UDP ? ingest_udp_open(l, err) : ingest_tcp_open(l, err);
    if (rc < 0) {
        return rc;
    }
    log_bound(l);
    return 0;
}

/* The listening socket alone (a removed TCP listener keeps its connections and their sweep). */
static void close_socket(struct listener *l) {
    if (l->h_open) {
        if (l->cfg.proto == BD_PROTO_UDP) {
            uv_udp_recv_stop(&l->h.udp);
        }
        close_handle(l, &l->h.handle);
        l->h_open = false;
    }
}

void ingest_listener_close(struct listener *l) {
    close_socket(l);
    if (l->sweep_open) {
        close_handle(l, (uv_handle_t *)&l->sweep);
        l->sweep_open = false;
    }
    ingest_tcp_stop_conns(l);
}

void ingest_listener_conns_gone(struct listener *l) {
    if (l->active || l->in->stopping) {
        return;
    }
    bd_info("%s: the last connection left open at its removal has closed", l->name);
    if (l->sweep_open) {
        close_handle(l, (uv_handle_t *)&l->sweep);
        l->sweep_open = false;
    }
    maybe_free_slot(l);
}

/* ---------------------------------------------------------------------------------------- */
/* Public API                                                                               */

int bd_ingest_new(struct bd_ingest **out, uv_loop_t *loop, const struct bd_config *cfg,
                  struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err) {
    struct bd_ingest *in = NULL;
    int rc = 0;

    *out = NULL;
    in = calloc(1, sizeof(*in));
    if (in == NULL) {
        rc = bd_err_set(err, -ENOMEM, "ingest: out of memory");
        goto out;
    }
    in->loop = loop;
    in->table = table;
    in->stats = stats;
    in->max_line = cfg->limits.max_line;
    in->udp_stop_drain_ns = UDP_STOP_DRAIN_NS;
    BD_ASSERT(cfg->n_listeners <= BD_MAX_LISTENERS);
    in->cap_listeners = LISTENER_SLOTS;
    in->listeners = calloc(in->cap_listeners, sizeof(*in->listeners));
    if (in->listeners == NULL) {
        rc = bd_err_set(err, -ENOMEM, "ingest: out of memory");
        goto out;
    }

    for (uint32_t i = 0; i < cfg->n_listeners; i++) {
        in->n_listeners = i + 1; /* so the cleanup below sees this one too */
        rc = ingest_listener_open(in, &in->listeners[i], i, &cfg->listeners[i], err);
        if (rc < 0) {
            goto out;
        }
    }
    rc = ingest_kstats_start(in, err);
    if (rc < 0) {
        goto out;
    }

    *out = in;
    in = NULL;
out:
    if (in != NULL) {
        /* Handles already opened close asynchronously; the last close callback frees in. */
        bd_ingest_free(in);
    }
    return rc;
}

void bd_ingest_set_udp_stop_drain(struct bd_ingest *in, int64_t ns) {
    in->udp_stop_drain_ns = ns;
}

void bd_ingest_stop(struct bd_ingest *in, bd_ingest_stopped_cb cb, void *arg) {
    if (in == NULL || in->stopping) {
        return;
    }
    in->stopping = true;
    in->stopped_cb = cb;
    in->stopped_arg = arg;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        if (l->h_open && l->cfg.proto == BD_PROTO_UDP) {
            ingest_udp_drain_at_stop(l, "at stop");
        }
    }
    /* The last reading, while our sockets still exist, for the stats printed at the stop. */
    ingest_kstats_update(in);
    ingest_kstats_stop(in);
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        ingest_listener_close(&in->listeners[i]);
    }
    ingest_maybe_stopped(in);
}

void bd_ingest_abort(struct bd_ingest *in) {
    if (in == NULL || !in->stopping) {
        return;
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        ingest_tcp_abort_conns(&in->listeners[i]);
    }
    ingest_maybe_stopped(in);
}

void bd_ingest_resume(struct bd_ingest *in) {
    if (in == NULL) {
        return;
    }
    int64_t now_ns = 0;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        if (l->cfg.proto == BD_PROTO_UDP) {
            ingest_udp_maybe_resume(l);
        }
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        if (!ingest_tcp_resume_conns(&in->listeners[i], &now_ns)) {
            return;
        }
    }
    ingest_maybe_stopped(in);
}

void bd_ingest_free(struct bd_ingest *in) {
    if (in == NULL) {
        return;
    }
    /* Tolerate a free without a stop: close now and let the last close callback destroy. */
    bd_ingest_stop(in, NULL, NULL);
    bd_ingest_abort(in);
    in->released = true;
    if (in->open_handles == 0) {
        destroy(in);
    }
}

uint32_t bd_ingest_connections(const struct bd_ingest *in) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        n += in->listeners[i].n_conns;
    }
    return n;
}

uint32_t bd_ingest_paused(const struct bd_ingest *in) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        n += in->listeners[i].n_paused;
    }
    return n;
}

int bd_ingest_listener_port(struct bd_ingest *in, uint32_t idx) {
    if (idx >= in->n_listeners || !in->listeners[idx].h_open) {
        return -EINVAL;
    }
    struct listener *l = &in->listeners[idx];
    struct sockaddr_storage local;
    int len = sizeof(local);
    int rc = l->cfg.proto == BD_PROTO_UDP
                 ? uv_udp_getsockname(&l->h.udp, (struct sockaddr *)&local, &len)
                 : uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&local, &len);
    if (rc < 0) {
        return rc;
    }
    if (local.ss_family == AF_INET) {
        return ntohs(((const struct sockaddr_in *)&local)->sin_port);
    }
    if (local.ss_family == AF_INET6) {
        return ntohs(((const struct sockaddr_in6 *)&local)->sin6_port);
    }
    return -EAFNOSUPPORT;
}

/* The active listener that binds what lc binds, or NULL. */
static struct listener *find_active(struct bd_ingest *in, const struct bd_listener_config *lc) {
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        if (l->active && bd_listener_same(&l->cfg, lc)) {
            return l;
        }
    }
    return NULL;
}

/*
 * A reload removed l. UDP: what its socket buffer holds arrived before the reload, so it is read
 * out first, as at a stop. TCP: no new connection; the open ones stay, read as before, until
 * their senders close them (or the idle timeout does), so nothing they send is lost.
 */
static void remove_listener(struct listener *l) {
    l->active = false;
    if (l->cfg.proto == BD_PROTO_UDP) {
        ingest_udp_drain_at_stop(l, "at its removal");
    }
    if (l->conns == NULL) {
        ingest_listener_close(l);
        bd_info("%s: removed", l->name);
    } else {
        close_socket(l);
        bd_info("%s: removed; its %u open connections stay until their senders close them", l->name,
                l->n_conns);
    }
    maybe_free_slot(l);
}

/* A listener a reload added, in a free slot. */
static int add_listener(struct bd_ingest *in, const struct bd_listener_config *lc,
                        struct bd_err *err) {
    uint32_t i = 0;
    while (i < in->cap_listeners && in->listeners[i].in_use) {
        i++;
    }
    if (i == in->cap_listeners) {
        return bd_err_set(err, -ENOSPC,
                          "listener %s %s: not added: listeners removed earlier still have "
                          "connections open; try again once they have closed",
                          bd_proto_name(lc->proto), lc->bind);
    }
    struct listener *l = &in->listeners[i];
    memset(l, 0, sizeof(*l));
    in->n_listeners = BD_MAX(in->n_listeners, i + 1);
    int rc = ingest_listener_open(in, l, i, lc, err);
    if (rc < 0) {
        l->active = false;
        ingest_listener_close(l); /* what it opened; the slot frees itself once closed */
        maybe_free_slot(l);
        return rc;
    }
    /* The kernel's drop counters read this socket from now on (started here when it is the
     * first UDP listener). Without them the listener still works. */
    struct bd_err kerr = {0};
    if (ingest_kstats_start(in, &kerr) < 0) {
        bd_warn("%s: %s; the kernel's UDP drop counters are not read", l->name, kerr.msg);
    }
    return 0;
}

/* Whether cfg still has the active listener l. */
static bool kept(const struct listener *l, const struct bd_config *cfg) {
    for (uint32_t k = 0; k < cfg->n_listeners; k++) {
        if (bd_listener_same(&l->cfg, &cfg->listeners[k])) {
            return true;
        }
    }
    return false;
}

int bd_ingest_set_listeners(struct bd_ingest *in, struct bd_config *cfg) {
    struct bd_listener_config now[BD_MAX_LISTENERS];
    uint32_t n = 0;
    int rc = 0;
    bool udp_goes = false;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        const struct listener *l = &in->listeners[i];
        udp_goes |= l->active && l->cfg.proto == BD_PROTO_UDP && !kept(l, cfg);
    }
    if (udp_goes) {
        ingest_kstats_update(in); /* the drops of sockets about to close, while they exist */
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        if (l->active && !kept(l, cfg)) {
            remove_listener(l);
        }
    }
    /* Removed first: a listener may take over an address one of them had. */
    for (uint32_t k = 0; k < cfg->n_listeners; k++) {
        struct listener *l = find_active(in, &cfg->listeners[k]);
        struct bd_err err = {0};
        if (l != NULL) {
            ingest_tls_listener_reload(l); /* certificate rotation */
            /* allow applies to a kept listener at once (bd_config_reload_merge merged it). */
            l->cfg.allow = cfg->listeners[k].allow;
            now[n++] = l->cfg;
        } else if (add_listener(in, &cfg->listeners[k], &err) < 0) {
            bd_error("reload: %s; the configuration runs without it", err.msg);
            rc = -1;
        } else {
            now[n++] = cfg->listeners[k];
        }
    }
    memcpy(cfg->listeners, now, n * sizeof(now[0]));
    cfg->n_listeners = n;
    return rc;
}

uint32_t bd_ingest_n_listeners(const struct bd_ingest *in) {
    return in->n_listeners;
}

int bd_ingest_listener_info(const struct bd_ingest *in, uint32_t idx,
                            struct bd_ingest_listener_info *out) {
    if (idx >= in->n_listeners) {
        return -EINVAL;
    }
    const struct listener *l = &in->listeners[idx];
    if (!l->active) {
        return -ENOENT; /* a free slot, or one a reload removed */
    }
    *out = (struct bd_ingest_listener_info){
        l->cfg.proto,     l->cfg.format,
        l->cfg.bind,      l->cfg.proto == BD_PROTO_TCP ? l->n_conns : 0,
        l->n_not_allowed, l->n_rejected_per_ip};
    return 0;
}
