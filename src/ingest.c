/*
 * Listeners: UDP datagrams and TCP line streams turned into parsed points for the sensor table.
 *
 * Threads: everything in this file runs on the ingest thread, the one that owns the uv loop
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
 * Lifetime: every uv handle that is open counts in in->open_handles and its close callback
 * decrements it. The struct is destroyed when it has been released (bd_ingest_free, or a failed
 * bd_ingest_new) and no handle is left open, so a close callback never sees freed memory, even
 * if the owner frees before running the loop.
 */
#include "bucketd/ingest.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/log.h"
#include "bucketd/parse.h"

/*
 * libuv 1.44 cuts a recvmmsg buffer into 64 KiB slots, one datagram each, and reads at most 20
 * per syscall; a smaller buffer silently falls back to one datagram per syscall.
 */
#define UDP_SLOT_SIZE (64 * 1024)
#define UDP_SLOTS 20
#define UDP_SLAB_SIZE (UDP_SLOT_SIZE * UDP_SLOTS)
/* At stop, how long a UDP listener may spend reading what its socket buffer still holds. */
#define UDP_STOP_DRAIN_NS (500 * BD_NS_PER_MS)
/* After that, how many more datagrams it reads only to count them (udp_unread_at_stop). */
#define UDP_STOP_DISCARD_MAX 100000

/*
 * Room beyond max_line in a connection buffer. A pending partial line never exceeds max_line
 * (longer ones close the connection), so after compaction at least this much is free and every
 * read gets a useful buffer. It is also the threshold below which the tail is compacted.
 */
#define CONN_SLACK 4096

/* Bad-line samples: a few per listener every 10 s, whatever the input rate. */
#define SAMPLE_BURST 5
#define SAMPLE_INTERVAL_NS (10 * BD_NS_PER_S)
/* Bytes of an offending line quoted in a sample. */
#define SAMPLE_QUOTE 96

/* Longest "[v6 address]:port" we format. */
#define PEER_LEN 64

/* How often the kernel's UDP counters are read. */
#define KSTATS_INTERVAL_MS 1000
/* /proc text is read through this buffer: all of /proc/net/snmp (about 1.6 KiB), or a run of
 * whole lines of /proc/net/udp (about 130 bytes a socket; a busy host lists thousands). */
#define KSTATS_BUF 16384

struct listener;

struct conn {
    uv_tcp_t tcp; /* tcp.data points back here */
    struct listener *l;
    struct conn *prev, *next; /* l->conns; unlinked once closing */
    struct sockaddr_storage peer;
    uint64_t last_active_ms; /* uv_now() of the last read, for the idle sweep */
    bool paused;             /* reading stopped by backpressure */
    bool eof;                /* the peer finished sending; close once the buffer is consumed */
    /*
     * buf[start, len) is received and not yet consumed; buf[start, scan) is known to hold no
     * '\n', so memchr never rescans bytes of a line that arrives in many reads.
     */
    size_t start, scan, len, cap;
    char buf[];
};

struct listener {
    struct bd_ingest *in;
    uint32_t idx;
    struct bd_listener_config cfg; /* a copy: the config may be reloaded under us */
    char name[192];                /* "listener 2 (tcp 0.0.0.0:8094)" for errors and logs */

    union {
        uv_handle_t handle;
        uv_udp_t udp;
        uv_tcp_t tcp;
    } h;
    bool h_open;

    struct bd_parser parser;
    bool parser_ok;
    struct bd_point *point;

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

    struct bd_ratelimit rl_lines;  /* samples of bad lines */
    uint64_t rl_lines_reported;    /* rl_lines.suppressed already mentioned in a sample */
    struct bd_ratelimit rl_events; /* receive errors, refused connections */
};

struct bd_ingest {
    uv_loop_t *loop;
    struct bd_sensor_table *table;
    struct bd_stats *stats;
    size_t max_line;

    struct listener *listeners;
    uint32_t n_listeners;

    /* Kernel UDP counters (only with a UDP listener; see ingest.h). */
    uv_timer_t kstats_timer;
    bool kstats_open;
    char *kstats_buf;                 /* KSTATS_BUF bytes */
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

/* A refused connection needs a handle of its own only until its close callback runs. */
struct rejected {
    uv_tcp_t tcp;
    struct bd_ingest *in;
};

static void conn_close(struct conn *c);

/* ---------------------------------------------------------------------------------------- */
/* Lifetime                                                                                 */

static void destroy(struct bd_ingest *in) {
    BD_ASSERT(in->open_handles == 0);
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        BD_ASSERT(l->conns == NULL);
        if (l->parser_ok) {
            bd_parser_close(&l->parser);
        }
        free(l->point);
        free(l->slab);
    }
    free(in->listeners);
    free(in->kstats_buf);
    free(in->kstats_socks);
    free(in);
}

static void handle_closed(struct bd_ingest *in) {
    BD_ASSERT(in->open_handles > 0);
    in->open_handles--;
    if (in->open_handles == 0 && in->released) {
        destroy(in);
    }
}

static void on_listener_handle_closed(uv_handle_t *h) {
    struct listener *l = h->data;
    handle_closed(l->in);
}

static void on_conn_closed(uv_handle_t *h) {
    struct conn *c = h->data;
    struct bd_ingest *in = c->l->in;
    free(c);
    handle_closed(in);
}

static void on_ingest_handle_closed(uv_handle_t *h) {
    handle_closed(h->data);
}

static void on_rejected_closed(uv_handle_t *h) {
    struct rejected *r = h->data;
    struct bd_ingest *in = r->in;
    free(r);
    handle_closed(in);
}

/* ---------------------------------------------------------------------------------------- */
/* Log helpers                                                                              */

static void format_addr(const struct sockaddr *sa, char *out, size_t cap) {
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
 * carry terminal escapes or break the quoting: everything outside printable ASCII, and the
 * quote and backslash themselves, are written as \xNN.
 */
static void sanitise(const char *line, size_t len, char *out, size_t cap) {
    static const char hex[] = "0123456789abcdef";
    size_t n = BD_MIN(len, (size_t)SAMPLE_QUOTE);
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        unsigned char ch = (unsigned char)line[i];
        if (ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\') {
            out[o++] = (char)ch;
        } else {
            out[o++] = '\\';
            out[o++] = 'x';
            out[o++] = hex[ch >> 4];
            out[o++] = hex[ch & 0xf];
        }
    }
    out[o] = '\0';
}

static int64_t loop_now_ns(const struct listener *l) {
    /* The loop's cached monotonic time is good enough for rate limiting and costs nothing. */
    return (int64_t)uv_now(l->in->loop) * BD_NS_PER_MS;
}

static void sample_bad_line(struct listener *l, const struct sockaddr *peer, const char *reason,
                            const char *line, size_t len) {
    if (!bd_ratelimit_ok(&l->rl_lines, loop_now_ns(l))) {
        return;
    }
    char who[PEER_LEN];
    char quoted[SAMPLE_QUOTE * 4 + 8];
    format_addr(peer, who, sizeof(who));
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

static const char *too_long_reason(const struct listener *l) {
    /* A stream cannot resynchronise on a line it did not keep, so TCP gives up the connection. */
    return l->cfg.proto == BD_PROTO_TCP ? "line longer than limits.max_line, connection closed"
                                        : "line longer than limits.max_line";
}

/*
 * What the parser made of one line (text, without its '\n'): counted, sampled if bad, and if
 * good handed to the sensor table. Returns 0, or -E2BIG when the line exceeds max_line (TCP
 * closes the connection on it, UDP just moves to the next line).
 */
static int line_result(struct listener *l, int rc, const char *errmsg, struct bd_str line,
                       const struct sockaddr *peer, int64_t now_ns) {
    struct bd_ingest *in = l->in;
    if (rc == BD_PARSE_SKIP) {
        return 0;
    }
    BD_STAT_ADD(in->stats, lines, 1);
    if (rc == BD_PARSE_ETOO_LONG) {
        BD_STAT_ADD(in->stats, drop_line_too_long, 1);
        sample_bad_line(l, peer, too_long_reason(l), line.ptr, line.len);
        return -E2BIG;
    }
    if (rc < 0) {
        if (rc == BD_PARSE_ETOO_MANY_FIELDS) {
            BD_STAT_ADD(in->stats, drop_too_many_fields, 1);
        } else {
            BD_STAT_ADD(in->stats, drop_parse_error, 1);
        }
        sample_bad_line(l, peer, errmsg != NULL ? errmsg : parse_reason(rc), line.ptr, line.len);
        return 0;
    }
    /* Every refusal (time window, field limits, ring full) is counted by the table itself. */
    (void)bd_sensor_table_accept(in->table, l->point, now_ns);
    return 0;
}

/* One line without its '\n', on its own (a TCP stream's unterminated last line). */
static int handle_line(struct listener *l, const char *line, size_t len,
                       const struct sockaddr *peer, int64_t now_ns) {
    const char *errmsg = NULL;
    int rc = bd_parse_line(&l->parser, line, len, l->point, &errmsg);
    return line_result(l, rc, errmsg, (struct bd_str){line, len}, peer, now_ns);
}

/*
 * The next line of the batch begun on the listener's parser (bd_parse_begin); BD_PARSE_END
 * when there is none, else what line_result() returns for it.
 */
static int next_line_of_batch(struct listener *l, const struct sockaddr *peer, int64_t now_ns) {
    const char *errmsg = NULL;
    struct bd_str line;
    int rc = bd_parse_next(&l->parser, l->point, &line, &errmsg);
    if (rc == BD_PARSE_END) {
        return BD_PARSE_END;
    }
    return line_result(l, rc, errmsg, line, peer, now_ns);
}

/* ---------------------------------------------------------------------------------------- */
/* UDP                                                                                      */

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

static void udp_datagram(struct listener *l, const char *data, size_t len,
                         const struct sockaddr *peer) {
    /* One clock read per datagram: every line in it arrived at the same moment. */
    int64_t now_ns = bd_now_ns();
    /* The parser splits the datagram into lines itself, from the same pass that maps them. */
    bd_parse_begin(&l->parser, data, len);
    while (next_line_of_batch(l, peer, now_ns) != BD_PARSE_END) {
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
static void udp_maybe_pause(struct listener *l) {
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
static void udp_maybe_resume(struct listener *l) {
    struct bd_ingest *in = l->in;
    if (!l->udp_paused || !l->h_open ||
        (bd_sensor_table_congested(in->table) && !bd_sensor_table_stalled(in->table))) {
        return;
    }
    int rc = uv_udp_recv_start(&l->h.udp, on_udp_alloc, on_udp_recv);
    if (rc < 0) {
        /* Nothing else would start it again: say so loudly, and retry at the next drain. */
        if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
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
        udp_maybe_pause(l);
        return;
    }
    if (nread < 0) {
        BD_STAT_ADD(in->stats, udp_recv_errors, 1);
        if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
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
    if (flags & UV_UDP_PARTIAL) {
        /* The kernel cut the datagram to fit the slot; its last line would be a lie. */
        BD_STAT_ADD(in->stats, udp_truncated, 1);
        if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
            char who[PEER_LEN];
            format_addr(addr, who, sizeof(who));
            bd_warn("%s: truncated datagram from %s dropped (more than %d bytes)", l->name, who,
                    UDP_SLOT_SIZE);
        }
        return;
    }
    udp_datagram(l, buf->base, (size_t)nread, addr);
    if (!(flags & UV_UDP_MMSG_CHUNK)) {
        udp_maybe_pause(l); /* one recvmsg, not part of a batch */
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

static int udp_open(struct listener *l, struct bd_err *err) {
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
    in->open_handles++;

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

/* ---------------------------------------------------------------------------------------- */
/* TCP                                                                                      */

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

/*
 * Consume the complete lines in the buffer. Returns 0 when only a partial line (if any) is left,
 * 1 when it stopped early because the sensor table is congested (the rest waits in the buffer),
 * or -E2BIG when a line exceeds max_line and the connection must go.
 *
 * Congestion is checked after every line, not once per read: one 64 KiB read holds hundreds of
 * lines, enough to overrun a ring, and TCP promises backpressure rather than drops.
 */
static int conn_drain_lines(struct conn *c, int64_t now_ns, bool backpressure) {
    struct listener *l = c->l;
    struct bd_ingest *in = l->in;
    const struct sockaddr *peer = (const struct sockaddr *)&c->peer;

    /* The complete lines are those up to the last '\n': one batch for the parser. */
    const char *last = memrchr(c->buf + c->scan, '\n', c->len - c->scan);
    if (last != NULL) {
        size_t first = c->start;
        size_t end = (size_t)(last - c->buf) + 1;
        bd_parse_begin(&l->parser, c->buf + first, end - first);
        for (;;) {
            int rc = next_line_of_batch(l, peer, now_ns);
            if (rc == BD_PARSE_END) {
                break;
            }
            c->start = c->scan = first + bd_parse_offset(&l->parser);
            if (rc < 0) {
                return -E2BIG;
            }
            if (backpressure && bd_sensor_table_congested(in->table)) {
                return 1;
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
        sample_bad_line(l, peer, too_long_reason(l), c->buf + c->start, pending);
        return -E2BIG;
    }
    if (pending == 0) {
        /* Rewinding an empty buffer is free; moving a partial line waits until room runs out. */
        c->start = c->scan = c->len = 0;
    }
    return 0;
}

/* conn_drain_lines, as one batch of the sensor table's hand-off (see sensor.h). */
static int conn_drain(struct conn *c, int64_t now_ns, bool backpressure) {
    int rc = conn_drain_lines(c, now_ns, backpressure);
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
            (void)handle_line(l, c->buf + c->start, c->len - c->start,
                              (const struct sockaddr *)&c->peer, now_ns);
            bd_sensor_table_publish(l->in->table);
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

static void on_conn_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    struct conn *c = h->data;
    (void)suggested;
    if (c->cap - c->len < CONN_SLACK && c->start > 0) {
        size_t pending = c->len - c->start;
        memmove(c->buf, c->buf + c->start, pending);
        c->scan -= c->start;
        c->len = pending;
        c->start = 0;
    }
    /* conn_drain keeps a partial line at or below max_line, so the slack is always free. */
    BD_ASSERT(c->len < c->cap);
    *buf = uv_buf_init(c->buf + c->len, (unsigned)(c->cap - c->len));
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
             * a congested connection waits (paused) until bd_ingest_resume() finishes it. */
            c->eof = true;
            if (conn_finish(c, bd_now_ns()) > 0) {
                conn_pause(c);
            }
            return;
        } else {
            char who[PEER_LEN];
            format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
            bd_debug("%s: connection from %s: %s", l->name, who, uv_strerror((int)nread));
        }
        conn_close(c);
        return;
    }

    c->len += (size_t)nread;
    c->last_active_ms = uv_now(in->loop);
    BD_STAT_ADD(in->stats, tcp_bytes, (uint64_t)nread);

    int rc = conn_drain(c, bd_now_ns(), true);
    if (rc < 0) {
        conn_close(c);
    } else if (rc > 0) {
        conn_pause(c);
    }
}

static void conn_close(struct conn *c) {
    struct listener *l = c->l;
    conn_unpause(c);
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
    in->open_handles++;
    /*
     * Accepting and closing at once, instead of leaving the connection in the backlog, tells
     * the client straight away and keeps the backlog free for connections we will take.
     */
    char who[PEER_LEN] = "?";
    if (uv_accept(server, (uv_stream_t *)&r->tcp) == 0) {
        struct sockaddr_storage peer;
        int plen = sizeof(peer);
        if (uv_tcp_getpeername(&r->tcp, (struct sockaddr *)&peer, &plen) == 0) {
            format_addr((const struct sockaddr *)&peer, who, sizeof(who));
        }
    }
    BD_STAT_ADD(in->stats, tcp_rejected, 1);
    if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
        bd_warn("%s: refusing connection from %s: max_connections (%u) reached", l->name, who,
                l->cfg.max_connections);
    }
    uv_close((uv_handle_t *)&r->tcp, on_rejected_closed);
}

static void on_tcp_connection(uv_stream_t *server, int status) {
    struct listener *l = server->data;
    struct bd_ingest *in = l->in;
    struct conn *c = NULL;
    int rc = 0;

    if (status < 0) {
        if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
            bd_warn("%s: accept failed: %s", l->name, uv_strerror(status));
        }
        return;
    }
    if (in->stopping || l->n_conns >= l->cfg.max_connections) {
        reject(l, server);
        return;
    }
    size_t cap = in->max_line + CONN_SLACK;
    c = malloc(sizeof(*c) + cap);
    if (c == NULL) {
        reject(l, server);
        return;
    }
    memset(c, 0, sizeof(*c));
    c->l = l;
    c->cap = cap;
    uv_tcp_init(in->loop, &c->tcp); /* without an address family it cannot fail */
    c->tcp.data = c;
    in->open_handles++;

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
        c->peer.ss_family = AF_UNSPEC;
    }
    c->last_active_ms = uv_now(in->loop);
    rc = uv_read_start((uv_stream_t *)&c->tcp, on_conn_alloc, on_conn_read);
    if (rc < 0) {
        goto out;
    }
    BD_STAT_ADD(in->stats, tcp_connections, 1);
    if (bd_log_get_level() >= BD_LOG_DEBUG) {
        char who[PEER_LEN];
        format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
        bd_debug("%s: connection from %s (%u open)", l->name, who, l->n_conns);
    }
out:
    if (rc < 0) {
        if (bd_ratelimit_ok(&l->rl_events, loop_now_ns(l))) {
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
        /* A paused connection is silent because we stopped reading, not because it is idle. */
        if (!c->paused && now - c->last_active_ms >= l->cfg.idle_timeout_ms) {
            BD_STAT_ADD(l->in->stats, tcp_idle_closed, 1);
            if (bd_log_get_level() >= BD_LOG_DEBUG) {
                char who[PEER_LEN];
                format_addr((const struct sockaddr *)&c->peer, who, sizeof(who));
                bd_debug("%s: closing idle connection from %s", l->name, who);
            }
            conn_close(c);
        }
    }
}

static int tcp_open(struct listener *l, struct bd_err *err) {
    struct bd_ingest *in = l->in;
    const struct sockaddr *sa = (const struct sockaddr *)&l->cfg.addr;
    int rc = 0;

    rc = uv_tcp_init_ex(in->loop, &l->h.tcp, sa->sa_family);
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }
    l->h.handle.data = l;
    l->h_open = true;
    in->open_handles++;

    /* libuv defers EADDRINUSE from bind to listen, so both report the same way. */
    rc = uv_tcp_bind(&l->h.tcp, sa, 0);
    if (rc == 0) {
        rc = uv_listen((uv_stream_t *)&l->h.tcp, SOMAXCONN, on_tcp_connection);
    }
    if (rc < 0) {
        bd_err_set(err, rc, "%s: %s", l->name, uv_strerror(rc));
        goto out;
    }

    if (l->cfg.idle_timeout_ms > 0) {
        uint64_t every = BD_MIN(BD_MAX(l->cfg.idle_timeout_ms / 4, (uint64_t)1), (uint64_t)1000);
        uv_timer_init(in->loop, &l->sweep);
        l->sweep.data = l;
        l->sweep_open = true;
        in->open_handles++;
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

/* ---------------------------------------------------------------------------------------- */
/* Kernel UDP counters                                                                      */

/* The next line of text[*pos, len) without its '\n'; false at the end. */
static bool next_line(const char *text, size_t len, size_t *pos, struct bd_str *line) {
    if (*pos >= len) {
        return false;
    }
    const char *start = text + *pos;
    const char *nl = memchr(start, '\n', len - *pos);
    size_t n = nl != NULL ? (size_t)(nl - start) : len - *pos;
    *line = (struct bd_str){start, n};
    *pos += n + (nl != NULL);
    return true;
}

/* The next token of line separated by spaces or tabs, from *pos; false at the end. */
static bool next_token(struct bd_str line, size_t *pos, struct bd_str *tok) {
    size_t i = *pos;
    while (i < line.len && (line.ptr[i] == ' ' || line.ptr[i] == '\t')) {
        i++;
    }
    size_t start = i;
    while (i < line.len && line.ptr[i] != ' ' && line.ptr[i] != '\t') {
        i++;
    }
    *pos = i;
    *tok = (struct bd_str){line.ptr + start, i - start};
    return i > start;
}

static bool token_is(struct bd_str tok, const char *word) {
    return tok.len == strlen(word) && memcmp(tok.ptr, word, tok.len) == 0;
}

/* A decimal counter: digits only, at most UINT64_MAX. */
static bool token_u64(struct bd_str tok, uint64_t *out) {
    uint64_t v = 0;
    for (size_t i = 0; i < tok.len; i++) {
        unsigned d = (unsigned char)tok.ptr[i] - '0';
        if (d > 9 || v > (UINT64_MAX - d) / 10) {
            return false;
        }
        v = v * 10 + d;
    }
    *out = v;
    return tok.len > 0;
}

int bd_ingest_parse_snmp(const char *text, size_t len, struct bd_udp_snmp *out) {
    struct bd_str names = {NULL, 0};
    struct bd_str values = {NULL, 0};
    struct bd_str line;
    size_t pos = 0;
    /* "Udp:" exactly: "UdpLite:" follows with the same columns for another protocol. */
    while (values.ptr == NULL && next_line(text, len, &pos, &line)) {
        if (line.len >= 4 && memcmp(line.ptr, "Udp:", 4) == 0) {
            if (names.ptr == NULL) {
                names = line;
            } else {
                values = line;
            }
        }
    }
    if (values.ptr == NULL) {
        return -EINVAL;
    }
    unsigned got = 0;
    size_t npos = 4;
    size_t vpos = 4;
    struct bd_str name;
    struct bd_str value;
    while (next_token(names, &npos, &name) && next_token(values, &vpos, &value)) {
        if (token_is(name, "InErrors") && token_u64(value, &out->in_errors)) {
            got |= 1;
        } else if (token_is(name, "RcvbufErrors") && token_u64(value, &out->rcvbuf_errors)) {
            got |= 2;
        }
    }
    return got == 3 ? 0 : -EINVAL;
}

int bd_ingest_parse_snmp6(const char *text, size_t len, struct bd_udp_snmp *out) {
    unsigned got = 0;
    size_t pos = 0;
    struct bd_str line;
    while (got != 3 && next_line(text, len, &pos, &line)) {
        struct bd_str name;
        struct bd_str value;
        size_t tpos = 0;
        if (!next_token(line, &tpos, &name) || !next_token(line, &tpos, &value)) {
            continue;
        }
        /* "Udp6..." exactly: "UdpLite6..." lines carry the same names for another protocol. */
        if (token_is(name, "Udp6InErrors") && token_u64(value, &out->in_errors)) {
            got |= 1;
        } else if (token_is(name, "Udp6RcvbufErrors") && token_u64(value, &out->rcvbuf_errors)) {
            got |= 2;
        }
    }
    return got == 3 ? 0 : -EINVAL;
}

/* Columns of /proc/net/udp{,6} ("sl:" first), as the kernel's udp4/udp6 seq_show print them. */
#define UDP_COL_INODE 9
#define UDP_COL_DROPS 12

size_t bd_ingest_parse_udp_drops(const char *text, size_t len, struct bd_udp_sock *socks,
                                 size_t n) {
    size_t matched = 0;
    size_t pos = 0;
    struct bd_str line;
    while (next_line(text, len, &pos, &line)) {
        struct bd_str tok;
        struct bd_str col[UDP_COL_DROPS + 1];
        size_t tpos = 0;
        size_t k = 0;
        while (k <= UDP_COL_DROPS && next_token(line, &tpos, &tok)) {
            col[k++] = tok;
        }
        uint64_t inode = 0;
        uint64_t drops = 0;
        /* The header's first column is "sl", a socket's "N:". */
        if (k <= UDP_COL_DROPS || col[0].ptr[col[0].len - 1] != ':' ||
            !token_u64(col[UDP_COL_INODE], &inode) || !token_u64(col[UDP_COL_DROPS], &drops)) {
            continue;
        }
        for (size_t i = 0; i < n; i++) {
            if (socks[i].inode == inode) {
                socks[i].drops = drops;
                socks[i].found = true;
                matched++;
            }
        }
    }
    return matched;
}

static void kstats_warn(struct bd_ingest *in, const char *path, int rc) {
    if (!in->kstats_warned) {
        in->kstats_warned = true;
        bd_warn("cannot read %s (%s): the kernel's UDP drop counters (udp_socket_drops, "
                "udp_kernel_rcvbuf_errors, udp_kernel_in_errors) are not counted",
                path, strerror(-rc));
    }
}

/* What read_proc() does with a /proc file. */
enum proc_kind {
    PROC_UDP_SOCKETS, /* /proc/net/udp{,6}: runs of whole lines to bd_ingest_parse_udp_drops */
    PROC_SNMP,        /* /proc/net/snmp, whole, to bd_ingest_parse_snmp */
    PROC_SNMP6,       /* /proc/net/snmp6, whole, to bd_ingest_parse_snmp6 */
};

/*
 * Reads path through in->kstats_buf, handing each run of whole lines to
 * bd_ingest_parse_udp_drops(), or the whole file (which must then fit) to the snmp parser its
 * kind names. 0 or a negative errno.
 */
static int read_proc(struct bd_ingest *in, const char *path, enum proc_kind kind,
                     struct bd_udp_snmp *snmp) {
    bool whole_file = kind != PROC_UDP_SOCKETS;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -errno;
    }
    char *buf = in->kstats_buf;
    size_t have = 0;
    int rc = 0;
    for (;;) {
        ssize_t got = read(fd, buf + have, KSTATS_BUF - have);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            rc = got < 0 ? -errno : 0;
            break;
        }
        have += (size_t)got;
        if (whole_file) {
            if (have == KSTATS_BUF) {
                rc = -EFBIG;
                break;
            }
            continue;
        }
        /* Whole lines now; a partial last line waits for the rest (a full buffer without a
         * newline cannot be a socket's line and is dropped). */
        const char *nl = memrchr(buf, '\n', have);
        size_t whole = nl != NULL ? (size_t)(nl - buf) + 1 : (have == KSTATS_BUF ? have : 0);
        bd_ingest_parse_udp_drops(buf, whole, in->kstats_socks, in->n_listeners);
        memmove(buf, buf + whole, have - whole);
        have -= whole;
    }
    close(fd);
    if (rc == 0 && whole_file) {
        rc = kind == PROC_SNMP ? bd_ingest_parse_snmp(buf, have, snmp)
                               : bd_ingest_parse_snmp6(buf, have, snmp);
    } else if (rc == 0) {
        bd_ingest_parse_udp_drops(buf, have, in->kstats_socks, in->n_listeners);
    }
    return rc;
}

/* Adds cur - *last to the counter (a counter that went back, e.g. after a reset, adds nothing). */
static void add_growth(_Atomic uint64_t *counter, uint64_t cur, uint64_t *last) {
    if (cur > *last) {
        atomic_fetch_add_explicit(counter, cur - *last, memory_order_relaxed);
    }
    *last = cur;
}

/*
 * The host-wide counters, IPv4 (/proc/net/snmp) and IPv6 (/proc/net/snmp6) apart, each against
 * its own last reading. A kernel without IPv6 has no snmp6: that is no error.
 */
static void kstats_read_snmp_file(struct bd_ingest *in, const char *path, enum proc_kind kind,
                                  struct bd_udp_snmp *last, bool *known) {
    struct bd_udp_snmp cur;
    int rc = read_proc(in, path, kind, &cur);
    if (rc < 0) {
        if (!(kind == PROC_SNMP6 && rc == -ENOENT)) {
            kstats_warn(in, path, rc);
        }
        return;
    }
    if (*known) {
        add_growth(&in->stats->udp_kernel_rcvbuf_errors, cur.rcvbuf_errors, &last->rcvbuf_errors);
        add_growth(&in->stats->udp_kernel_in_errors, cur.in_errors, &last->in_errors);
    }
    *last = cur;
    *known = true;
}

static void kstats_read_snmp(struct bd_ingest *in) {
    kstats_read_snmp_file(in, "/proc/net/snmp", PROC_SNMP, &in->snmp_last, &in->snmp_known);
    kstats_read_snmp_file(in, "/proc/net/snmp6", PROC_SNMP6, &in->snmp6_last, &in->snmp6_known);
}

static void kstats_read_sockets(struct bd_ingest *in) {
    bool v4 = false;
    bool v6 = false;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        bool udp = l->cfg.proto == BD_PROTO_UDP && l->h_open && l->sock_inode != 0;
        in->kstats_socks[i] = (struct bd_udp_sock){udp ? l->sock_inode : 0, 0, false};
        v4 |= udp && l->cfg.addr.ss_family == AF_INET;
        v6 |= udp && l->cfg.addr.ss_family == AF_INET6;
    }
    int rc = v4 ? read_proc(in, "/proc/net/udp", PROC_UDP_SOCKETS, NULL) : 0;
    if (rc < 0) {
        kstats_warn(in, "/proc/net/udp", rc);
    }
    rc = v6 ? read_proc(in, "/proc/net/udp6", PROC_UDP_SOCKETS, NULL) : 0;
    if (rc < 0) {
        kstats_warn(in, "/proc/net/udp6", rc);
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        if (in->kstats_socks[i].found) {
            add_growth(&in->stats->udp_socket_drops, in->kstats_socks[i].drops,
                       &in->listeners[i].drops_seen);
        }
    }
}

/* Brings the three counters up to date (a few small reads of /proc, never per packet). */
static void kstats_update(struct bd_ingest *in) {
    if (in->kstats_buf != NULL) {
        kstats_read_snmp(in);
        kstats_read_sockets(in);
    }
}

static void on_kstats_timer(uv_timer_t *t) {
    kstats_update(t->data);
}

/* With a UDP listener: the buffers, the baseline reading and the timer. */
static int kstats_start(struct bd_ingest *in, struct bd_err *err) {
    bool udp = false;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        udp |= in->listeners[i].cfg.proto == BD_PROTO_UDP;
    }
    if (!udp) {
        return 0;
    }
    in->kstats_buf = malloc(KSTATS_BUF);
    in->kstats_socks = calloc(in->n_listeners, sizeof(*in->kstats_socks));
    if (in->kstats_buf == NULL || in->kstats_socks == NULL) {
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    kstats_update(in);
    uv_timer_init(in->loop, &in->kstats_timer);
    in->kstats_timer.data = in;
    in->kstats_open = true;
    in->open_handles++;
    /* Unreferenced: the counters alone must not keep the loop running. */
    uv_unref((uv_handle_t *)&in->kstats_timer);
    int rc =
        uv_timer_start(&in->kstats_timer, on_kstats_timer, KSTATS_INTERVAL_MS, KSTATS_INTERVAL_MS);
    if (rc < 0) {
        return bd_err_set(err, rc, "ingest: kernel counters timer: %s", uv_strerror(rc));
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Public API                                                                               */

static void log_bound(const struct listener *l) {
    struct sockaddr_storage local;
    int len = sizeof(local);
    char where[PEER_LEN] = "?";
    int rc = l->cfg.proto == BD_PROTO_UDP
                 ? uv_udp_getsockname(&l->h.udp, (struct sockaddr *)&local, &len)
                 : uv_tcp_getsockname(&l->h.tcp, (struct sockaddr *)&local, &len);
    if (rc == 0) {
        format_addr((const struct sockaddr *)&local, where, sizeof(where));
    }
    bd_info("%s: listening on %s, format %s, precision %s", l->name, where,
            bd_format_name(l->cfg.format), bd_precision_name(l->cfg.precision));
}

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
    if (cfg->n_listeners > 0) {
        in->listeners = calloc(cfg->n_listeners, sizeof(*in->listeners));
        if (in->listeners == NULL) {
            rc = bd_err_set(err, -ENOMEM, "ingest: out of memory");
            goto out;
        }
    }

    for (uint32_t i = 0; i < cfg->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        in->n_listeners = i + 1; /* so the cleanup below sees this one too */
        l->in = in;
        l->idx = i;
        l->cfg = cfg->listeners[i];
        /* Numbered from 1, as a person counts the entries of the listeners list. */
        snprintf(l->name, sizeof(l->name), "listener %u (%s %s)", i + 1,
                 bd_proto_name(l->cfg.proto), l->cfg.bind);
        l->rl_lines =
            (struct bd_ratelimit){.interval_ns = SAMPLE_INTERVAL_NS, .burst = SAMPLE_BURST};
        l->rl_events = l->rl_lines;

        rc = bd_parser_init(&l->parser, l->cfg.format, l->cfg.precision, in->max_line);
        if (rc < 0) {
            bd_err_set(err, rc, "%s: cannot set up the parser: %s", l->name, strerror(-rc));
            goto out;
        }
        l->parser_ok = true;
        l->point = malloc(sizeof(*l->point));
        if (l->point == NULL) {
            rc = bd_err_set(err, -ENOMEM, "%s: out of memory", l->name);
            goto out;
        }

        rc = l->cfg.proto == BD_PROTO_UDP ? udp_open(l, err) : tcp_open(l, err);
        if (rc < 0) {
            goto out;
        }
        log_bound(l);
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

/*
 * At stop: the datagrams already in the socket's receive buffer arrived before the stop, and
 * with UDP backpressure that buffer may hold megabytes. Read them out (non-blocking, into the
 * slab, through the same path as the loop's reads) until the socket is empty or
 * UDP_STOP_DRAIN_NS has passed (senders that keep sending could keep it full), instead of
 * losing them when the socket closes; what is left then is counted (udp_discard_at_stop).
 */
/*
 * The read-out at stop ran out of time (senders still sending keep the buffer full): what the
 * socket still holds is read once more, unparsed, only to be counted in udp_unread_at_stop, up
 * to UDP_STOP_DISCARD_MAX datagrams, so that the loss is a number and not a guess.
 */
static void udp_discard_at_stop(struct listener *l, uv_os_fd_t fd, struct mmsghdr *msgs,
                                struct iovec *iov) {
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
    bd_warn("%s: still reading the socket buffer after %d ms at stop; %s%llu datagrams left "
            "in it are discarded (udp_unread_at_stop; senders still sending?)",
            l->name, (int)(l->in->udp_stop_drain_ns / BD_NS_PER_MS),
            discarded >= UDP_STOP_DISCARD_MAX ? "at least " : "", (unsigned long long)discarded);
}

static void udp_drain_at_stop(struct listener *l) {
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
            udp_discard_at_stop(l, fd, msgs, iov);
            break;
        }
    }
    if (n_read > 0) {
        bd_info("%s: %llu datagrams read from the socket buffer at stop", l->name,
                (unsigned long long)n_read);
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
            udp_drain_at_stop(l);
        }
    }
    /* The last reading, while our sockets still exist, for the stats printed at the stop. */
    kstats_update(in);
    if (in->kstats_open) {
        uv_close((uv_handle_t *)&in->kstats_timer, on_ingest_handle_closed);
        in->kstats_open = false;
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        if (l->h_open) {
            if (l->cfg.proto == BD_PROTO_UDP) {
                uv_udp_recv_stop(&l->h.udp);
            }
            uv_close(&l->h.handle, on_listener_handle_closed);
            l->h_open = false;
        }
        if (l->sweep_open) {
            uv_close((uv_handle_t *)&l->sweep, on_listener_handle_closed);
            l->sweep_open = false;
        }
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
    maybe_stopped(in);
}

void bd_ingest_abort(struct bd_ingest *in) {
    if (in == NULL || !in->stopping) {
        return;
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        while (l->conns != NULL) {
            struct conn *c = l->conns;
            BD_STAT_ADD(in->stats, tcp_unread_at_stop, (c->len - c->start) + unread_in_kernel(c));
            conn_close(c);
        }
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
            udp_maybe_resume(l);
        }
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        struct listener *l = &in->listeners[i];
        struct conn *next = NULL;
        for (struct conn *c = l->conns; c != NULL && l->n_paused > 0; c = next) {
            next = c->next;
            if (!c->paused) {
                continue;
            }
            if (bd_sensor_table_congested(in->table)) {
                return;
            }
            if (now_ns == 0) {
                now_ns = bd_now_ns();
            }
            if (c->eof || in->stopping) {
                /* Never read again: finish the buffer, then close. */
                if (conn_finish(c, now_ns) > 0) {
                    return;
                }
                continue;
            }
            /* Lines left in the buffer when the connection paused go first, in order. */
            int rc = conn_drain(c, now_ns, true);
            if (rc < 0) {
                conn_close(c);
                continue;
            }
            if (rc > 0) {
                return;
            }
            conn_unpause(c);
            c->last_active_ms = uv_now(in->loop);
            rc = uv_read_start((uv_stream_t *)&c->tcp, on_conn_alloc, on_conn_read);
            if (rc < 0) {
                bd_warn("%s: cannot resume reading: %s", l->name, uv_strerror(rc));
                conn_close(c);
            }
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

int bd_ingest_set_listeners(struct bd_ingest *in, struct bd_config *cfg) {
    /* Not yet: the running listeners stay. */
    cfg->n_listeners = in->n_listeners;
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        cfg->listeners[i] = in->listeners[i].cfg;
    }
    return 0;
}
