/*
 * UDP listeners (src/udp.h): libuv recvmmsg into a preallocated slab, one datagram at a time to
 * the parser through the ingest core (src/ingest_core.h), allow checks before the parser sees a
 * byte, backpressure by pausing the socket, and the read-out of the socket buffer at stop.
 *
 * Threads: the ingest thread only (src/ingest_int.h). Ownership: the listener's slab (20 x 64
 * KiB) is allocated at open and freed with the listener (ingest_listener_release); nothing is
 * allocated per datagram.
 */
#include "udp.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "ingest_core.h"

/*
 * libuv 1.44 cuts a recvmmsg buffer into 64 KiB slots, one datagram each, and reads at most 20
 * per syscall; a smaller buffer silently falls back to one datagram per syscall.
 */
#define UDP_SLOT_SIZE (64 * 1024)
#define UDP_SLOTS 20
#define UDP_SLAB_SIZE (UDP_SLOT_SIZE * UDP_SLOTS)
/* After the read-out at stop (UDP_STOP_DRAIN_NS), how many more datagrams it reads only to count them (udp_unread_at_stop). */
#define UDP_STOP_DISCARD_MAX 100000

static void on_udp_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    struct listener *l = h->data;
    (void)suggested;
    /*
     * The slab can be handed out again on every call: libuv delivers all datagrams of one
     * recvmmsg (and the final UV_UDP_MMSG_FREE) before it asks for a buffer again, and we
     * finish with each datagram inside its callback.
     */
    *buf = uv_buf_init(l->slab, UDP_SLAB_SIZE);
}

void ingest_udp_datagram(struct listener *l, const char *data, size_t len,
                         const struct sockaddr *peer, int64_t now_ns) {
    /* The parser splits the datagram into lines itself, from the same pass that maps them. */
    bd_parse_begin(&l->parser, data, len);
    while (ingest_next_line_of_batch(l, peer, now_ns) != BD_PARSE_END) {
    }
    /* A datagram is one batch of the sensor table's hand-off (see sensor.h). */
    bd_sensor_table_publish(l->in->table);
}

static void on_udp_recv(uv_udp_t *h, ssize_t nread, const uv_buf_t *buf,
                        const struct sockaddr *addr, unsigned flags);

/*
 * UDP backpressure. A ring past its high-water mark has woken the flusher; if it is still past
 * the mark when a receive batch ends and the flusher is free to drain, the flusher is late
 * (scheduling), and until it has drained the ring to a quarter the listener stops reading:
 * datagrams wait in the socket's receive buffer (rcvbuf) instead of overrunning the ring. Loss
 * then happens only when that buffer overflows too, and the kernel counts it
 * (udp_socket_drops). Only between recvmmsg batches: libuv drops the rest of a batch whose
 * callback stops the handle. Not while the flusher is stalled (a write in flight or waiting
 * for its retry): it drains nothing then, so the rings are the buffer -- they are sized for
 * the slowest write and hold far more than the socket buffer -- and a paused listener resumes
 * as soon as the flusher says it has stalled.
 */
void ingest_udp_maybe_pause(struct listener *l) {
    struct bd_ingest *in = l->in;
    if (l->udp_paused || in->stopping || !bd_sensor_table_udp_should_pause(in->table)) {
        return;
    }
    if (uv_udp_recv_stop(&l->h.udp) == 0) {
        l->udp_paused = true;
        BD_STAT_ADD(in->stats, udp_pauses, 1);
        bd_sensor_table_request_drain(in->table);
    }
}

/* bd_ingest_resume: read again once the congestion is gone or the flusher has stalled. */
void ingest_udp_maybe_resume(struct listener *l) {
    struct bd_ingest *in = l->in;
    if (!l->udp_paused || !l->h_open || !bd_sensor_table_udp_may_resume(in->table)) {
        return;
    }
    int rc = uv_udp_recv_start(&l->h.udp, on_udp_alloc, on_udp_recv);
    if (rc < 0) {
        /* Nothing else would start it again: say so loudly, and retry at the next drain. */
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            bd_error("%s: cannot resume reading: %s", l->name, uv_strerror(rc));
        }
        return;
    }
    l->udp_paused = false;
}

static void on_udp_recv(uv_udp_t *h, ssize_t nread, const uv_buf_t *buf,
                        const struct sockaddr *addr, unsigned flags) {
    struct listener *l = h->data;
    struct bd_ingest *in = l->in;

    if (flags & UV_UDP_MMSG_FREE) {
        /* End of a recvmmsg batch: the slab is ours and stays allocated. */
        ingest_udp_maybe_pause(l);
        return;
    }
    if (nread < 0) {
        BD_STAT_ADD(in->stats, udp_recv_errors, 1);
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            bd_warn("%s: receive error: %s", l->name, uv_strerror((int)nread));
        }
        return;
    }
    if (addr == NULL) {
        /* nread == 0 without a sender: the socket had nothing more to read. */
        return;
    }
    BD_STAT_ADD(in->stats, udp_datagrams, 1);
    BD_STAT_ADD(in->stats, udp_bytes, (uint64_t)nread);
    if (l->cfg.allow.n > 0 && !bd_allow_match(&l->cfg.allow, addr)) {
        ingest_not_allowed(l, addr); /* before the parser sees a byte of it */
        return;
    }
    if (flags & UV_UDP_PARTIAL) {
        /* The kernel cut the datagram to fit the slot; its last line would be a lie. */
        BD_STAT_ADD(in->stats, udp_truncated, 1);
        if (bd_ratelimit_ok(&l->rl_events, ingest_loop_now_ns(l))) {
            char who[PEER_LEN];
            ingest_format_addr(addr, who, sizeof(who));
            bd_warn("%s: truncated datagram from %s dropped (more than %d bytes)", l->name, who,
                    UDP_SLOT_SIZE);
        }
        return;
    }
    /* One clock read per datagram: every line in it arrived at the same moment. */
    ingest_udp_datagram(l, buf->base, (size_t)nread, addr, bd_now_ns());
    if (!(flags & UV_UDP_MMSG_CHUNK)) {
        ingest_udp_maybe_pause(l); /* one recvmsg, not part of a batch */
    }
}

/*
 * A bigger socket buffer absorbs scheduling stalls. Failing to get it is not fatal, but the
 * operator must hear about it, with the sysctl that caps it.
 */
static void udp_set_rcvbuf(struct listener *l) {
    uint64_t want = l->cfg.rcvbuf;
    if (want == 0) {
        return; /* keep the kernel default */
    }
    int value = want > INT_MAX ? INT_MAX : (int)want;
    int rc = -1;
#ifdef SO_RCVBUFFORCE
    /* With CAP_NET_ADMIN (root) the size asked for is granted past net.core.rmem_max, as the
     * operator configured it; without, EPERM, and SO_RCVBUF below is capped by the sysctl. */
    uv_os_fd_t fd;
    if (uv_fileno(&l->h.handle, &fd) == 0 &&
        setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &value, sizeof(value)) == 0) {
        rc = 0;
    }
#endif
    if (rc != 0) {
        rc = uv_recv_buffer_size(&l->h.handle, &value);
    }
    if (rc < 0) {
        bd_warn("%s: cannot set SO_RCVBUF to %llu bytes: %s", l->name, (unsigned long long)want,
                uv_strerror(rc));
    }
    int got = 0; /* 0 asks libuv to read the option back */
    rc = uv_recv_buffer_size(&l->h.handle, &got);
    if (rc < 0) {
        bd_warn("%s: cannot read SO_RCVBUF back: %s", l->name, uv_strerror(rc));
        return;
    }
    uint64_t granted = (uint64_t)got;
#ifdef __linux__
    /* Linux doubles the request to cover its bookkeeping and reports the doubled figure. */
    granted /= 2;
#endif
    bd_info("%s: receive buffer %llu bytes (asked for %llu; SO_RCVBUF reads back %d)", l->name,
            (unsigned long long)granted, (unsigned long long)want, got);
    if (granted < want) {
        bd_warn("%s: the kernel granted a receive buffer of %llu bytes, less than the %llu "
                "asked for; raise net.core.rmem_max to at least %llu",
                l->name, (unsigned long long)granted, (unsigned long long)want,
                (unsigned long long)want);
    }
}

int ingest_udp_open(struct listener *l, struct bd_err *err) {
    struct bd_ingest *in = l->in;
    const struct sockaddr *sa = (const struct sockaddr *)&l->cfg.addr;
    int rc = 0;

    l->slab = malloc(UDP_SLAB_SIZE);
    if (l->slab == NULL) {
        rc = bd_err_set(err, -ENOMEM, "%s: cannot allocate the receive buffer", l->name);
        goto out;
    }
    rc = uv_udp_init_ex(in->loop, &l->h.udp, (unsigned)sa->sa_family | UV_UDP_RECVMMSG);
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }
    l->h.handle.data = l;
    l->h_open = true;
    ingest_handle_opened(in);

    if (l->reuseport) {
        /* Before the bind: the extra receive loops' sockets join this one (ingest_loops.c). */
        uv_os_fd_t rfd;
        int on = 1;
        if (uv_fileno(&l->h.handle, &rfd) != 0 ||
            setsockopt(rfd, SOL_SOCKET, SO_REUSEPORT, &on, sizeof(on)) != 0) {
            rc = bd_err_set(err, -errno, "%s: cannot set SO_REUSEPORT: %s", l->name,
                            strerror(errno));
            goto out;
        }
    }
    rc = uv_udp_bind(&l->h.udp, sa, 0);
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }
    udp_set_rcvbuf(l);
    uv_os_fd_t fd;
    struct stat st;
    if (uv_fileno(&l->h.handle, &fd) == 0 && fstat(fd, &st) == 0) {
        l->sock_inode = (uint64_t)st.st_ino;
    }
    rc = uv_udp_recv_start(&l->h.udp, on_udp_alloc, on_udp_recv);
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }
out:
    /* On failure the handle (if opened) is closed by the caller with every other listener. */
    return rc;
}

/*
 * The read-out at stop (or removal) ran out of time (senders still sending keep the buffer
 * full): what the socket still holds is read once more, unparsed, only to be counted in
 * udp_unread_at_stop, up to UDP_STOP_DISCARD_MAX datagrams, so that the loss is a number and
 * not a guess.
 */
static void udp_discard_at_stop(struct listener *l, uv_os_fd_t fd, struct mmsghdr *msgs,
                                struct iovec *iov, const char *when) {
    uint64_t discarded = 0;
    while (discarded < UDP_STOP_DISCARD_MAX) {
        for (int k = 0; k < UDP_SLOTS; k++) {
            msgs[k].msg_hdr = (struct msghdr){.msg_iov = &iov[k], .msg_iovlen = 1};
        }
        int n = recvmmsg(fd, msgs, UDP_SLOTS, MSG_DONTWAIT, NULL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break;
        }
        discarded += (uint64_t)n;
    }
    BD_STAT_ADD(l->in->stats, udp_unread_at_stop, discarded);
    bd_warn("%s: still reading the socket buffer after %d ms %s; %s%llu datagrams left "
            "in it are discarded (udp_unread_at_stop; senders still sending?)",
            l->name, (int)(l->in->udp_stop_drain_ns / BD_NS_PER_MS), when,
            discarded >= UDP_STOP_DISCARD_MAX ? "at least " : "", (unsigned long long)discarded);
}

/*
 * At stop (or the listener's removal by a reload, `when` says which, for the log): the
 * datagrams already in the socket's receive buffer arrived before the stop, and
 * with UDP backpressure that buffer may hold megabytes. Read them out (non-blocking, into the
 * slab, through the same path as the loop's reads) until the socket is empty or
 * UDP_STOP_DRAIN_NS has passed (senders that keep sending could keep it full), instead of
 * losing them when the socket closes; what is left then is counted (udp_discard_at_stop).
 */
void ingest_udp_drain_at_stop(struct listener *l, const char *when) {
    uv_os_fd_t fd;
    if (l->slab == NULL || uv_fileno(&l->h.handle, &fd) != 0) {
        return;
    }
    struct mmsghdr msgs[UDP_SLOTS];
    struct iovec iov[UDP_SLOTS];
    struct sockaddr_storage peers[UDP_SLOTS];
    int64_t deadline = bd_mono_ns() + l->in->udp_stop_drain_ns;
    uint64_t n_read = 0;
    for (;;) {
        memset(msgs, 0, sizeof(msgs));
        for (int k = 0; k < UDP_SLOTS; k++) {
            iov[k] = (struct iovec){l->slab + (size_t)k * UDP_SLOT_SIZE, UDP_SLOT_SIZE};
            msgs[k].msg_hdr.msg_iov = &iov[k];
            msgs[k].msg_hdr.msg_iovlen = 1;
            msgs[k].msg_hdr.msg_name = &peers[k];
            msgs[k].msg_hdr.msg_namelen = sizeof(peers[k]);
        }
        int n = recvmmsg(fd, msgs, UDP_SLOTS, MSG_DONTWAIT, NULL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            break; /* empty (EAGAIN), or an error the loop would have counted: stop here */
        }
        for (int k = 0; k < n; k++) {
            uv_buf_t buf = uv_buf_init(iov[k].iov_base, UDP_SLOT_SIZE);
            unsigned flags = UV_UDP_MMSG_CHUNK; /* part of a batch: no pause decision */
            if (msgs[k].msg_hdr.msg_flags & MSG_TRUNC) {
                flags |= UV_UDP_PARTIAL;
            }
            on_udp_recv(&l->h.udp, (ssize_t)msgs[k].msg_len, &buf,
                        (const struct sockaddr *)&peers[k], flags);
        }
        n_read += (uint64_t)n;
        if (bd_mono_ns() >= deadline) {
            udp_discard_at_stop(l, fd, msgs, iov, when);
            break;
        }
    }
    if (n_read > 0) {
        bd_info("%s: %llu datagrams read from the socket buffer %s", l->name,
                (unsigned long long)n_read, when);
    }
}
