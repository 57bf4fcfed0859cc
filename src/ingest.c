/*
 * The ingest stage's public API (include/bucketd/ingest.h) and its top layer: UDP datagrams and
 * TCP line streams turned into parsed points for the sensor table. This file keeps the set of
 * listeners (opened at start, changed by a reload), the stop, abort and resume that go over all
 * of them, and the kernel's UDP counters while a UDP listener is open. Below it, udp.c and
 * tcp.c run the listeners, kstats.c the counters, and the ingest core (ingest_core.c) what they
 * share; src/ingest_int.h maps the files. Nothing below calls back up here except through the
 * callbacks handed down (the stopped callback of a stop, the sockets kstats.c asks about).
 *
 * Threads: the ingest thread only, the one that owns the uv loop handed to bd_ingest_new().
 *
 * Ownership: struct bd_ingest owns its listener slots (ingest_core.c) and, with a UDP listener,
 * the kernel counters' object (kstats.c). With ingest.loops > 1 a UDP listener also has its
 * receive loops (ingest_loops.c), opened with it and closed, after their sockets are read out,
 * before its own socket closes. A reload changes the listener set
 * (bd_ingest_set_listeners): a new listener opens in a free slot; a removed one closes its
 * socket (UDP: after reading out its buffer, as at a stop) and, TCP, keeps its connections
 * until their senders close them, so that nothing they send is lost; its slot is free again
 * once its handles have closed. The struct is destroyed once released (bd_ingest_free, or a
 * failed bd_ingest_new) and its last handle has closed, even if the owner frees before running
 * the loop.
 */
#include "bucketd/ingest.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bucketd/log.h"
#include "ingest_core.h"
#include "ingest_hold.h"
#include "ingest_loops.h"
#include "kstats_int.h"
#include "tcp.h"
#include "tcp_tls.h"
#include "udp.h"

/* ---------------------------------------------------------------------------------------- */
/* Listeners                                                                                */

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

/*
 * One listener, the slot l of in->listeners (zeroed): what every listener has (ingest core),
 * then its socket bound and read (udp.c, tcp.c). On failure the handles already opened stay
 * for listener_close(); ingest_listener_release() frees the rest once they have closed.
 */
static int listener_open(struct bd_ingest *in, struct listener *l, uint32_t idx,
                         const struct bd_listener_config *cfg, struct bd_err *err) {
    int rc = ingest_listener_init(in, l, idx, cfg, err);
    if (rc < 0) {
        return rc;
    }
    l->reuseport = l->cfg.proto == BD_PROTO_UDP && in->n_loops > 1;
    rc = l->cfg.proto == BD_PROTO_UDP ? ingest_udp_open(l, err) : ingest_tcp_open(l, err);
    if (rc == 0 && l->reuseport) {
        rc = ingest_loops_open(l, in->n_loops - 1, err);
    }
    if (rc < 0) {
        return rc;
    }
    log_bound(l);
    return 0;
}

/*
 * Stop one listener: close its socket, then (TCP) its idle sweep, and stop reading its
 * connections and finish what they hold (a connection that has to wait for ring space stays,
 * paused, for resume or abort). A UDP listener's socket buffer is read out first by
 * ingest_udp_drain_at_stop(). Idempotent.
 */
static void listener_close(struct listener *l) {
    ingest_loops_close(l);
    ingest_listener_close_socket(l);
    if (l->cfg.proto == BD_PROTO_TCP) {
        ingest_tcp_close(l);
    }
}

/* During a stop: call the stopped callback once no listener has a connection left. */
static void maybe_stopped(struct bd_ingest *in) {
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
/* Kernel counters                                                                          */

/*
 * kstats.c asks which slots hold an open UDP socket: slot i is listener i's own socket; with
 * receive loops, the sockets of listener i's loops past the first follow all the listeners'
 * slots, n_loops - 1 of them per listener slot, so every socket keeps its slot.
 */
static uint32_t kstats_sockets(void *arg, struct ingest_kstats_socket *out, uint32_t cap) {
    struct bd_ingest *in = arg;
    uint32_t extra = in->n_loops - 1;
    uint32_t n = extra == 0 ? in->n_listeners : in->cap_listeners + in->n_listeners * extra;
    BD_ASSERT(n <= cap);
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        const struct listener *l = &in->listeners[i];
        bool udp = l->cfg.proto == BD_PROTO_UDP && l->h_open && l->sock_inode != 0;
        bool v6 = l->cfg.addr.ss_family == AF_INET6;
        out[i] = (struct ingest_kstats_socket){udp ? l->sock_inode : 0, v6};
        for (uint32_t k = 0; k < extra; k++) {
            uint64_t inode = l->cfg.proto == BD_PROTO_UDP ? ingest_loops_sock_inode(l, k) : 0;
            out[in->cap_listeners + i * extra + k] = (struct ingest_kstats_socket){inode, v6};
        }
    }
    return n;
}

/* With a UDP listener, and not yet: the kernel counters' baseline and timer. */
static int kstats_start(struct bd_ingest *in, struct bd_err *err) {
    bool udp = false;
    if (in->kstats != NULL || in->stopping) {
        return 0; /* started already (a reload adding a UDP listener asks again) */
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        udp |= in->listeners[i].cfg.proto == BD_PROTO_UDP;
    }
    if (!udp) {
        return 0;
    }
    return ingest_kstats_new(&in->kstats, in, in->cap_listeners * in->n_loops, kstats_sockets, in,
                             err);
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
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (bd_config_ingest_loops(cfg->ingest.loops, cores > 0 ? (uint32_t)cores : 1, &in->n_loops) <
        0) {
        in->n_loops = 1; /* the loader checked the text: not reached */
    }
    BD_ASSERT(cfg->n_listeners <= BD_MAX_LISTENERS);
    in->cap_listeners = LISTENER_SLOTS;
    in->listeners = calloc(in->cap_listeners, sizeof(*in->listeners));
    if (in->listeners == NULL) {
        rc = bd_err_set(err, -ENOMEM, "ingest: out of memory");
        goto out;
    }

    for (uint32_t i = 0; i < cfg->n_listeners; i++) {
        in->n_listeners = i + 1; /* so the cleanup below sees this one too */
        rc = listener_open(in, &in->listeners[i], i, &cfg->listeners[i], err);
        if (rc < 0) {
            goto out;
        }
    }
    rc = kstats_start(in, err);
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

int bd_ingest_set_clock(struct bd_ingest *in, const struct bd_clock *clock,
                        const struct bd_config *cfg, struct bd_err *err) {
    return ingest_hold_open(in, clock, cfg, err);
}

void bd_ingest_clock_tick(struct bd_ingest *in) {
    if (in != NULL) {
        ingest_hold_tick(in);
    }
}

void bd_ingest_save_held(struct bd_ingest *in) {
    if (in != NULL) {
        ingest_hold_save(in);
    }
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
        ingest_loops_read_out(l, "at stop"); /* then its receive loops' sockets, if any */
    }
    /* The last reading, while our sockets still exist, for the stats printed at the stop. */
    ingest_kstats_update(in->kstats);
    ingest_kstats_close(in->kstats);
    in->kstats = NULL;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        listener_close(&in->listeners[i]);
    }
    maybe_stopped(in);
}

void bd_ingest_abort(struct bd_ingest *in) {
    if (in == NULL || !in->stopping) {
        return;
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        ingest_tcp_abort_conns(&in->listeners[i]);
    }
    maybe_stopped(in);
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
            ingest_loops_consume(l); /* what the receive loops read while it was paused */
        }
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        if (!ingest_tcp_resume_conns(&in->listeners[i], &now_ns)) {
            return;
        }
    }
    maybe_stopped(in);
}

void bd_ingest_free(struct bd_ingest *in) {
    if (in == NULL) {
        return;
    }
    /* Tolerate a free without a stop: close now and let the last close callback destroy. */
    bd_ingest_stop(in, NULL, NULL);
    bd_ingest_abort(in);
    ingest_release(in);
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
        ingest_loops_read_out(l, "at its removal");
        ingest_loops_close(l);
    }
    if (l->conns == NULL) {
        listener_close(l);
        bd_info("%s: removed", l->name);
    } else {
        ingest_listener_close_socket(l);
        bd_info("%s: removed; its %u open connections stay until their senders close them", l->name,
                l->n_conns);
    }
    ingest_listener_maybe_free(l);
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
    int rc = listener_open(in, l, i, lc, err);
    if (rc < 0) {
        l->active = false;
        listener_close(l); /* what it opened; the slot frees itself once closed */
        ingest_listener_maybe_free(l);
        return rc;
    }
    /* The kernel's drop counters read this socket from now on (started here when it is the
     * first UDP listener). Without them the listener still works. */
    struct bd_err kerr = {0};
    if (kstats_start(in, &kerr) < 0) {
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
        ingest_kstats_update(
            in->kstats); /* the drops of sockets about to close, while they exist */
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
