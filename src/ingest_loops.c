/*
 * Receive loops (ingest.loops > 1): more cores for UDP. A UDP listener's socket joins a
 * SO_REUSEPORT group (set by udp.c before its bind; raw socket option: libuv 1.44 has no
 * UV_UDP_REUSEPORT) with n - 1 more sockets opened here on the same address, and the kernel
 * spreads the datagrams over them by 4-tuple, so one sender's datagrams always reach the same
 * socket, in order. Each extra socket is read by a thread of its own (recvmmsg into a slab of
 * 20 x 64 KiB, as udp.c does), which copies every datagram with its sender and arrival time
 * into its SPSC datagram ring (dgram_ring.h) and rings the listener's uv_async; the ingest
 * thread empties the rings and hands each datagram to udp.c (allow list, parser, sensor table)
 * exactly as if it had read it itself.
 *
 * Why the parse stays on the ingest thread. Every sensor queue is single-producer and the
 * flusher's page accounting is per sensor object; a series may arrive on any socket, so
 * either one thread stays the only producer of every queue, or the table is sharded by series
 * hash with a hand-off of parsed lines between loops and a flusher that drains every shard
 * (and shares one pool and one memory budget across shards). Sharding moves the parse too but
 * changes the sensor table, the pool's accounting and the flusher; handing parsed points to
 * one owner moves the parse but needs a serialised point format and keeps the table's accept
 * (the larger part of the per-reading cost after the parse) on one thread anyway. Handing over
 * whole datagrams changes nothing below ingest: the sensor table, the hold, the spool and the
 * flusher see one producer, as with one loop. What moves to the other cores is the kernel's
 * receive work (softirq to socket, recvmmsg, the copy out) and the allow check's read of the
 * sender; the ingest thread pays one copy it reads from another core's cache instead. It pays
 * off where the receive path, not the parse, limits the ingest thread: many small datagrams,
 * and boxes with cores to spare (ingest.loops: auto is 1 below 4 cores).
 *
 * Backpressure. A receive loop reads only while its ring surely holds a whole recvmmsg batch;
 * else it sleeps until the ingest thread frees room, and the datagrams wait in its socket's
 * buffer (counted by the kernel if that overflows), as with the listener paused. While the
 * listener is paused for congestion (udp.c) the ingest thread does not empty the rings either,
 * so the pause holds every socket of the group.
 *
 * Stop and removal: after the listener's own socket is read out, each loop reads out its own
 * socket until it is empty or the stop's read-out time (udp_stop_drain_ns) is up, the rest
 * counted in udp_unread_at_stop, while the ingest thread parses what it hands over; then the
 * threads are joined and the sockets closed, all before the listener's socket closes.
 *
 * Threads: the receive loops touch only their own socket, slab, eventfd and ring (producer
 * side), their own counters (the ingest thread adds them to the stats, whose counters each have
 * one writing thread) and uv_async_send; everything else runs on the ingest thread. Ownership: struct ingest_loops (l->loops) owns the sockets, threads, slabs and
 * rings; the async handle lives in the listener (l->loop_async) and closes like its other
 * handles. Nothing is allocated per datagram.
 */
#include "ingest_loops.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bucketd/dgram_ring.h"
#include "ingest_core.h"
#include "udp.h"

/* As udp.c: libuv 1.44's recvmmsg slots. */
#define SLOT_SIZE (64 * 1024)
#define SLOTS 20
/* Ring per receive loop: holds two recvmmsg batches of the largest datagrams. */
#define RING_BYTES (4u * 1024 * 1024)
/* Datagrams the ingest thread takes from one ring per wake-up before it lets the loop run its
 * other handles (it comes back at once through the async), and between its pause checks. */
#define CONSUME_BUDGET 256
#define PAUSE_CHECK_EVERY SLOTS
/* After the read-out time at stop, datagrams still read only to be counted (as udp.c). */
#define DISCARD_MAX 100000

struct rloop {
    struct ingest_loops *grp;
    int fd;
    int efd; /* eventfd: the ingest thread wakes the loop (room freed, stop) */
    char *slab;
    struct bd_dgram_ring ring;
    pthread_t th;
    bool started;
    bool joined;
    uint64_t inode; /* of the socket, for the kernel's drop counters (kstats.c); 0: unknown */
    /* The stop: deadline written before stop is stored (release), read after it is loaded. */
    int64_t deadline;
    _Atomic bool stop;
    _Atomic bool done;
    /* Written by the loop before done, read by the ingest thread after joining it. */
    uint64_t n_read_at_stop;
    uint64_t n_discarded;
    bool timed_out;
    /* Receive errors: the loop counts, the ingest thread adds what is new to udp_recv_errors
     * (each stats counter has one writing thread). */
    _Atomic uint64_t recv_errors;
    uint64_t recv_errors_added; /* ingest thread */
};

struct ingest_loops {
    uv_async_t *async;
    bool read_out; /* the loops have read out their sockets and ended (ingest thread) */
    uint32_t n;
    struct rloop rl[];
};

/* ---------------------------------------------------------------------------------------- */
/* Receive loop threads                                                                     */

static void wake(int efd) {
    uint64_t one = 1;
    ssize_t rc = write(efd, &one, sizeof(one));
    (void)rc; /* EAGAIN: the counter is already non-zero, a wake-up is pending anyway */
}

/* Sleep until the socket is readable (with_sock) or the ingest thread wakes us. */
static void sleep_on(struct rloop *r, bool with_sock, int timeout_ms) {
    struct pollfd p[2] = {{.fd = r->efd, .events = POLLIN}, {.fd = r->fd, .events = POLLIN}};
    int rc = poll(p, with_sock ? 2 : 1, timeout_ms);
    if (rc > 0 && (p[0].revents & POLLIN)) {
        uint64_t v;
        ssize_t n = read(r->efd, &v, sizeof(v));
        (void)n;
    }
}

static void discard_rest(struct rloop *r, struct mmsghdr *msgs, struct iovec *iov) {
    uint64_t discarded = 0;
    while (discarded < DISCARD_MAX) {
        for (int k = 0; k < SLOTS; k++) {
            msgs[k].msg_hdr = (struct msghdr){.msg_iov = &iov[k], .msg_iovlen = 1};
        }
        int n = recvmmsg(r->fd, msgs, SLOTS, MSG_DONTWAIT, NULL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        discarded += (uint64_t)n;
    }
    r->n_discarded = discarded; /* added to udp_unread_at_stop by the ingest thread */
    r->timed_out = true;
}

static void *rloop_main(void *arg) {
    struct rloop *r = arg;
    struct mmsghdr msgs[SLOTS];
    struct iovec iov[SLOTS];
    struct sockaddr_storage peers[SLOTS];
    bool stopping = false;
    for (;;) {
        if (!stopping && atomic_load_explicit(&r->stop, memory_order_acquire)) {
            stopping = true;
        }
        if (stopping && bd_mono_ns() >= r->deadline) {
            discard_rest(r, msgs, iov);
            break;
        }
        if (!bd_dgram_ring_fits(&r->ring, SLOTS, SLOT_SIZE)) {
            if (bd_dgram_ring_wait_begin(&r->ring, SLOTS, SLOT_SIZE)) {
                /* At stop the ingest thread empties the ring without being asked; the timeout
                 * only bounds the look at the deadline. */
                sleep_on(r, false, stopping ? 10 : -1);
            }
            continue;
        }
        memset(msgs, 0, sizeof(msgs));
        for (int k = 0; k < SLOTS; k++) {
            iov[k] = (struct iovec){r->slab + (size_t)k * SLOT_SIZE, SLOT_SIZE};
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
            msgs[k].msg_hdr.msg_name = &peers[k];
            msgs[k].msg_hdr.msg_namelen = sizeof(peers[k]);
        }
        int n = recvmmsg(r->fd, msgs, SLOTS, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (stopping) {
                    break; /* read out */
                }
                sleep_on(r, true, -1);
                continue;
            }
            atomic_fetch_add_explicit(&r->recv_errors, 1, memory_order_relaxed);
            if (stopping) {
                break;
            }
            continue;
        }
        /* One clock read per batch: these datagrams were all waiting at this moment. */
        int64_t now_ns = bd_now_ns();
        for (int k = 0; k < n; k++) {
            uint32_t flags = (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) ? BD_DGRAM_TRUNCATED : 0;
            int rc = bd_dgram_ring_push(&r->ring, iov[k].iov_base, msgs[k].msg_len,
                                        (const struct sockaddr *)&peers[k],
                                        msgs[k].msg_hdr.msg_namelen, now_ns, flags);
            BD_ASSERT(rc == 0); /* bd_dgram_ring_fits said a whole batch fits */
        }
        uv_async_send(r->grp->async);
        if (stopping) {
            r->n_read_at_stop += (uint64_t)n;
        }
    }
    /* Pairs with the ingest thread's acquire load in ingest_loops_close: every push above is
     * visible once done is. */
    atomic_store_explicit(&r->done, true, memory_order_release);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Ingest thread                                                                            */

/* One datagram a receive loop read: what on_udp_recv in udp.c does with one it reads. */
static void deliver(struct listener *l, const struct bd_dgram *d) {
    struct bd_ingest *in = l->in;
    const struct sockaddr *peer = d->peer_len > 0 ? &d->peer.sa : NULL;
    BD_STAT_ADD(in->stats, udp_datagrams, 1);
    BD_STAT_ADD(in->stats, udp_bytes, d->len);
    BD_STAT_ADD(in->stats, udp_datagrams_other_loops, 1);
    if (l->cfg.allow.n > 0 && (peer == NULL || !bd_allow_match(&l->cfg.allow, peer))) {
        ingest_not_allowed(l, peer);
        return;
    }
    if (d->flags & BD_DGRAM_TRUNCATED) {
        BD_STAT_ADD(in->stats, udp_truncated, 1);
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            char who[PEER_LEN];
            ingest_format_addr(peer, who, sizeof(who));
            bd_warn("%s: truncated datagram from %s dropped (more than %d bytes)", l->name, who,
                    SLOT_SIZE);
        }
        return;
    }
    ingest_udp_datagram(l, d->data, d->len, peer, d->arrival_ns);
}

/* The loop's receive errors since the last look, into the stats (ingest thread). */
static void add_recv_errors(struct bd_ingest *in, struct rloop *r) {
    uint64_t n = atomic_load_explicit(&r->recv_errors, memory_order_relaxed);
    if (n != r->recv_errors_added) {
        BD_STAT_ADD(in->stats, udp_recv_errors, n - r->recv_errors_added);
        r->recv_errors_added = n;
    }
}

static void give_back(struct rloop *r) {
    if (bd_dgram_ring_release(&r->ring)) {
        wake(r->efd);
    }
}

void ingest_loops_consume(struct listener *l) {
    struct ingest_loops *g = l->loops;
    bool more = false;
    if (g == NULL || l->udp_paused) {
        return;
    }
    for (uint32_t i = 0; i < g->n && !l->udp_paused; i++) {
        struct rloop *r = &g->rl[i];
        const struct bd_dgram *d;
        uint32_t n = 0;
        while ((d = bd_dgram_ring_peek(&r->ring)) != NULL) {
            if (n == CONSUME_BUDGET) {
                more = true;
                break;
            }
            deliver(l, d);
            bd_dgram_ring_pop(&r->ring);
            n++;
            if (n % PAUSE_CHECK_EVERY == 0) {
                give_back(r);
                ingest_udp_maybe_pause(l); /* a batch's end, as for the listener's own reads */
                if (l->udp_paused) {
                    break;
                }
            }
        }
        give_back(r);
        add_recv_errors(l->in, r);
        if (n % PAUSE_CHECK_EVERY != 0) {
            ingest_udp_maybe_pause(l);
        }
    }
    if (more && !l->udp_paused) {
        uv_async_send(&l->loop_async); /* the rest at the loop's next turn */
    }
}

static void on_loop_async(uv_async_t *h) {
    ingest_loops_consume(h->data);
}

/* Everything ring r holds now, paused or not (stop, removal). */
static void consume_all(struct listener *l, struct rloop *r) {
    const struct bd_dgram *d;
    uint32_t n = 0;
    while ((d = bd_dgram_ring_peek(&r->ring)) != NULL) {
        deliver(l, d);
        bd_dgram_ring_pop(&r->ring);
        if (++n % PAUSE_CHECK_EVERY == 0) {
            give_back(r);
        }
    }
    give_back(r);
}

static void rloop_free(struct rloop *r) {
    if (r->fd >= 0) {
        close(r->fd);
    }
    if (r->efd >= 0) {
        close(r->efd);
    }
    free(r->slab);
    bd_dgram_ring_close(&r->ring);
}

void ingest_loops_read_out(struct listener *l, const char *when) {
    struct ingest_loops *g = l->loops;
    if (g == NULL || g->read_out) {
        return;
    }
    g->read_out = true;
    int64_t deadline = bd_mono_ns() + l->in->udp_stop_drain_ns;
    for (uint32_t i = 0; i < g->n; i++) {
        struct rloop *r = &g->rl[i];
        if (r->started) {
            r->deadline = deadline;
            atomic_store_explicit(&r->stop, true, memory_order_release);
            wake(r->efd);
        }
    }
    for (;;) {
        bool all_done = true;
        for (uint32_t i = 0; i < g->n; i++) {
            struct rloop *r = &g->rl[i];
            /* done first (acquire), then the ring: once done is seen, this drain is the last. */
            bool done = !r->started || atomic_load_explicit(&r->done, memory_order_acquire);
            consume_all(l, r);
            all_done &= done;
        }
        if (all_done) {
            break;
        }
        struct timespec ts = {0, 100 * 1000}; /* the loops are reading: look again shortly */
        nanosleep(&ts, NULL);
    }
    for (uint32_t i = 0; i < g->n; i++) {
        struct rloop *r = &g->rl[i];
        if (r->started) {
            pthread_join(r->th, NULL);
            r->joined = true;
            add_recv_errors(l->in, r);
            BD_STAT_ADD(l->in->stats, udp_unread_at_stop, r->n_discarded);
            if (r->timed_out) {
                bd_warn("%s: receive loop %u still reading its socket buffer after %d ms %s; "
                        "%s%llu datagrams left in it are discarded (udp_unread_at_stop)",
                        l->name, i + 2, (int)(l->in->udp_stop_drain_ns / BD_NS_PER_MS), when,
                        r->n_discarded >= DISCARD_MAX ? "at least " : "",
                        (unsigned long long)r->n_discarded);
            }
            if (r->n_read_at_stop > 0) {
                bd_info("%s: receive loop %u: %llu datagrams read from its socket buffer %s",
                        l->name, i + 2, (unsigned long long)r->n_read_at_stop, when);
            }
        }
    }
}

void ingest_loops_close(struct listener *l) {
    struct ingest_loops *g = l->loops;
    if (g == NULL) {
        return;
    }
    ingest_loops_read_out(l, "at its close");
    for (uint32_t i = 0; i < g->n; i++) {
        BD_ASSERT(!g->rl[i].started || g->rl[i].joined);
        rloop_free(&g->rl[i]);
    }
    free(g);
    l->loops = NULL;
    if (l->loop_async_open) {
        l->loop_async_open = false;
        ingest_listener_close_handle(l, (uv_handle_t *)&l->loop_async);
    }
}

/* The listener's address as bound (the port it got when the configuration says 0). */
static int bound_addr(struct listener *l, struct sockaddr_storage *sa, socklen_t *len,
                      struct bd_err *err) {
    int n = sizeof(*sa);
    int rc = uv_udp_getsockname(&l->h.udp, (struct sockaddr *)sa, &n);
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
    }
    *len = (socklen_t)n;
    return 0;
}

/* SO_RCVBUF as udp.c asks for it (forced with CAP_NET_ADMIN, else capped by the sysctl). */
static void set_rcvbuf(int fd, uint64_t want) {
    if (want == 0) {
        return;
    }
    int value = want > INT_MAX ? INT_MAX : (int)want;
#ifdef SO_RCVBUFFORCE
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &value, sizeof(value)) == 0) {
        return;
    }
#endif
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &value, sizeof(value));
}

static int rloop_open(struct listener *l, struct rloop *r, const struct sockaddr_storage *sa,
                      socklen_t sa_len, struct bd_err *err) {
    int on = 1;
    r->fd = socket(sa->ss_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (r->fd < 0 || setsockopt(r->fd, SOL_SOCKET, SO_REUSEPORT, &on, sizeof(on)) != 0) {
        return bd_err_set(err, -errno, "%s: receive loop socket: %s", l->name, strerror(errno));
    }
    set_rcvbuf(r->fd, l->cfg.rcvbuf);
    if (bind(r->fd, (const struct sockaddr *)sa, sa_len) != 0) {
        return bd_err_set(err, -errno, "%s: receive loop bind: %s", l->name, strerror(errno));
    }
    struct stat st;
    if (fstat(r->fd, &st) == 0) {
        r->inode = (uint64_t)st.st_ino;
    }
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        return bd_err_set(err, -errno, "%s: eventfd: %s", l->name, strerror(errno));
    }
    r->slab = malloc((size_t)SLOT_SIZE * SLOTS);
    int rc = r->slab == NULL ? -ENOMEM : bd_dgram_ring_init(&r->ring, RING_BYTES);
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: cannot allocate a receive loop's buffers", l->name);
    }
    rc = pthread_create(&r->th, NULL, rloop_main, r);
    if (rc != 0) {
        return bd_err_set(err, -rc, "%s: cannot start a receive loop: %s", l->name, strerror(rc));
    }
    r->started = true;
    char name[16];
    snprintf(name, sizeof(name), "bd-recv-%u", (unsigned)(r - r->grp->rl) + 2);
    pthread_setname_np(r->th, name); /* for top and the bench; a failure changes nothing */
    return 0;
}

int ingest_loops_open(struct listener *l, uint32_t n_extra, struct bd_err *err) {
    struct bd_ingest *in = l->in;
    struct sockaddr_storage sa;
    socklen_t sa_len = 0;
    int rc = bound_addr(l, &sa, &sa_len, err);
    if (rc < 0) {
        return rc;
    }
    struct ingest_loops *g = calloc(1, sizeof(*g) + n_extra * sizeof(g->rl[0]));
    if (g == NULL) {
        return bd_err_set(err, -ENOMEM, "%s: out of memory", l->name);
    }
    g->async = &l->loop_async;
    g->n = n_extra;
    for (uint32_t i = 0; i < n_extra; i++) {
        g->rl[i].grp = g;
        g->rl[i].fd = g->rl[i].efd = -1;
    }
    /* The async first: a loop rings it as soon as it reads. */
    BD_ASSERT(uv_async_init(in->loop, &l->loop_async, on_loop_async) == 0);
    l->loop_async.data = l;
    l->loop_async_open = true;
    ingest_handle_opened(in);
    l->loops = g;
    for (uint32_t i = 0; i < n_extra; i++) {
        g->n = i + 1; /* what ingest_loops_close() must undo */
        rc = rloop_open(l, &g->rl[i], &sa, sa_len, err);
        if (rc < 0) {
            return rc;
        }
    }
    bd_info("%s: %u receive loops (SO_REUSEPORT)", l->name, n_extra + 1);
    return 0;
}

uint64_t ingest_loops_sock_inode(const struct listener *l, uint32_t k) {
    const struct ingest_loops *g = l->loops;
    if (g == NULL || k >= g->n || g->rl[k].fd < 0) {
        return 0;
    }
    return g->rl[k].inode;
}
