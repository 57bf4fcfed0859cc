/*
 * Unit tests for the listeners (include/bucketd/ingest.h; src/ingest.c and the files under it,
 * see src/ingest_int.h) with a real uv loop, real sockets on 127.0.0.1 ephemeral ports, the real
 * parser and a real sensor table. The test thread plays every part in turn: it sends with plain
 * non-blocking sockets, runs the loop without blocking until the counters say the input was
 * processed, and for the backpressure test drains the queues as the flusher would. Every test
 * ends with uv_loop_close() == 0. The parsers of the kernel's counters: test_kstats.c.
 *
 * Not covered: UV_UDP_PARTIAL. libuv hands each datagram a 64 KiB slot, and the largest UDP
 * payload loopback can carry (65507 bytes over IPv4, 65527 over IPv6) fits in one, so the
 * kernel never truncates here.
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/ingest.h"
#include "bucketd/log.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

#define TEST_MAX_LINE 256
#define WAIT_NS (5 * BD_NS_PER_S)

struct fx {
    uv_loop_t loop;
    struct bd_config cfg;
    struct bd_stats stats;
    struct bd_sensor_table *table;
    struct bd_ingest *in;
};

static struct fx *fx_new(void) {
    struct fx *f = calloc(1, sizeof(*f));
    cr_assert_not_null(f);
    cr_assert_eq(uv_loop_init(&f->loop), 0);
    /* Quiet the info line of every bound listener; bad-line samples (warnings) still show. */
    bd_log_set_level(BD_LOG_WARN);
    bd_config_defaults(&f->cfg);
    f->cfg.n_listeners = 0;
    f->cfg.limits.max_line = TEST_MAX_LINE;
    return f;
}

/* Appends a listener; returns its index. */
static uint32_t fx_listen(struct fx *f, enum bd_proto proto, const char *bind,
                          enum bd_format format) {
    uint32_t i = f->cfg.n_listeners++;
    struct bd_listener_config *l = &f->cfg.listeners[i];
    l->proto = proto;
    snprintf(l->bind, sizeof(l->bind), "%s", bind);
    cr_assert_eq(bd_parse_hostport(bind, &l->addr), 0, "bind %s", bind);
    l->format = format;
    l->precision = BD_PREC_NS;
    l->rcvbuf = 256 * 1024;
    l->max_connections = 16;
    l->idle_timeout_ms = 0;
    return i;
}

static void fx_start(struct fx *f) {
    struct bd_err err = {0};
    cr_assert_eq(bd_sensor_table_new(&f->table, &f->cfg, &f->stats, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_ingest_new(&f->in, &f->loop, &f->cfg, f->table, &f->stats, &err), 0, "%s",
                 err.msg);
    cr_assert_not_null(f->in);
}

static void sleep_us(long us) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000};
    nanosleep(&ts, NULL);
}

/* Runs the loop without blocking until cond holds; fails the test after WAIT_NS. */
#define RUN_UNTIL(f, cond)                                                                         \
    do {                                                                                           \
        int64_t deadline_ = bd_mono_ns() + WAIT_NS;                                                \
        while (!(cond)) {                                                                          \
            cr_assert(bd_mono_ns() < deadline_, "timed out waiting for %s", #cond);                \
            uv_run(&(f)->loop, UV_RUN_NOWAIT);                                                     \
            sleep_us(200);                                                                         \
        }                                                                                          \
    } while (0)

/* Drains the loop the way the daemon does at shutdown and checks nothing is left behind. */
static void run_until_closed(uv_loop_t *loop) {
    int64_t deadline = bd_mono_ns() + WAIT_NS;
    while (uv_loop_alive(loop)) {
        cr_assert(bd_mono_ns() < deadline, "handles still open after stop");
        uv_run(loop, UV_RUN_NOWAIT);
        sleep_us(200);
    }
}

static void on_stopped(void *arg) {
    *(bool *)arg = true;
}

static void fx_finish(struct fx *f) {
    bd_ingest_stop(f->in, NULL, NULL);
    bd_ingest_abort(f->in);
    run_until_closed(&f->loop);
    bd_ingest_free(f->in);
    bd_sensor_table_free(f->table);
    cr_assert_eq(uv_loop_close(&f->loop), 0);
    free(f);
}

#define STAT(f, name) BD_STAT_GET(&(f)->stats, name)

/* ---------------------------------------------------------------------------------------- */
/* Client sockets                                                                           */

static void set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    cr_assert(fl >= 0);
    cr_assert_eq(fcntl(fd, F_SETFL, fl | O_NONBLOCK), 0);
}

static void udp_send(int family, int port, const char *data, size_t len) {
    int fd = socket(family, SOCK_DGRAM, 0);
    cr_assert(fd >= 0);
    ssize_t n;
    if (family == AF_INET6) {
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        a.sin6_addr = in6addr_loopback;
        n = sendto(fd, data, len, 0, (struct sockaddr *)&a, sizeof(a));
    } else {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        n = sendto(fd, data, len, 0, (struct sockaddr *)&a, sizeof(a));
    }
    cr_assert_eq(n, (ssize_t)len, "sendto: %s", strerror(errno));
    close(fd);
}

static void udp_send_str(int port, const char *s) {
    udp_send(AF_INET, port, s, strlen(s));
}

/* Connects while the loop is not running: the kernel completes the handshake into the
 * backlog, and the loop accepts on its next turn. */
static int tcp_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect: %s", strerror(errno));
    set_nonblock(fd);
    return fd;
}

/* Writes everything, turning the loop whenever the socket buffer is full. */
static void tcp_send(struct fx *f, int fd, const char *data, size_t len) {
    size_t off = 0;
    int64_t deadline = bd_mono_ns() + WAIT_NS;
    while (off < len) {
        ssize_t n = send(fd, data + off, len - off, MSG_NOSIGNAL);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        cr_assert(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK), "send: %s", strerror(errno));
        cr_assert(bd_mono_ns() < deadline, "send stalled");
        uv_run(&f->loop, UV_RUN_NOWAIT);
        sleep_us(200);
    }
}

static void tcp_send_str(struct fx *f, int fd, const char *s) {
    tcp_send(f, fd, s, strlen(s));
}

/* True once the server side has closed: EOF or reset, not "no data yet". */
static bool peer_closed(int fd) {
    char b[64];
    ssize_t n = recv(fd, b, sizeof(b), 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* ---------------------------------------------------------------------------------------- */
/* UDP                                                                                      */

Test(ingest, udp_several_lines_per_datagram) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    cr_assert(port > 0);

    /* The last line of a datagram needs no '\n'; blank and comment lines are not lines. */
    udp_send_str(port, "cpu,host=a value=1i\ncpu,host=b value=2i\n\n# note\ncpu,host=c value=3");
    udp_send_str(port, "mem,host=a used=10i\r\nmem,host=a used=11i\n");
    RUN_UNTIL(f, STAT(f, udp_datagrams) == 2);

    cr_expect_eq(STAT(f, lines), 5);
    cr_expect_eq(STAT(f, readings_accepted), 5);
    cr_expect_eq(STAT(f, drop_parse_error), 0);
    cr_expect_eq(STAT(f, udp_truncated), 0);
    cr_expect_eq(bd_sensor_table_count(f->table), 4);
    fx_finish(f);
}

Test(ingest, udp_bad_lines_are_counted_by_reason) {
    struct fx *f = fx_new();
    f->cfg.limits.max_fields = 2;
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);

    /* Garbage alone, with a control byte that the log sample must escape. */
    udp_send_str(port, "cpu,host=a\x1b[2J\n");
    /* An over-long line between two good ones: only it is lost. */
    char big[TEST_MAX_LINE * 2];
    size_t n = (size_t)snprintf(big, sizeof(big), "cpu,host=a value=1i\ncpu,host=b value=");
    memset(big + n, '9', TEST_MAX_LINE);
    n += TEST_MAX_LINE;
    n += (size_t)snprintf(big + n, sizeof(big) - n, "\ncpu,host=c value=3i\n");
    udp_send(AF_INET, port, big, n);
    /* A line of exactly max_line bytes is still fine. */
    char edge[TEST_MAX_LINE + 1];
    n = (size_t)snprintf(edge, sizeof(edge), "edge,host=a value=1,pad=\"");
    memset(edge + n, 'p', TEST_MAX_LINE - n - 1);
    edge[TEST_MAX_LINE - 1] = '"';
    udp_send(AF_INET, port, edge, TEST_MAX_LINE);
    /* More fields than limits.max_fields. */
    udp_send_str(port, "wide,host=a a=1,b=2,c=3\n");
    /* A zero-length datagram is a datagram without lines. */
    udp_send(AF_INET, port, "", 0);
    RUN_UNTIL(f, STAT(f, udp_datagrams) == 5);

    cr_expect_eq(STAT(f, drop_parse_error), 1);
    cr_expect_eq(STAT(f, drop_line_too_long), 1);
    cr_expect_eq(STAT(f, drop_too_many_fields), 1);
    cr_expect_eq(STAT(f, readings_accepted), 3);
    cr_expect_eq(STAT(f, lines), 6);
    fx_finish(f);
}

Test(ingest, udp_ipv6) {
    struct fx *f = fx_new();
    int probe = socket(AF_INET6, SOCK_DGRAM, 0);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6};
    a.sin6_addr = in6addr_loopback;
    bool have_v6 = probe >= 0 && bind(probe, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (probe >= 0) {
        close(probe);
    }
    if (!have_v6) {
        cr_assert_eq(uv_loop_close(&f->loop), 0);
        free(f);
        cr_skip_test("no IPv6 loopback");
    }
    fx_listen(f, BD_PROTO_UDP, "[::1]:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    cr_assert(port > 0);
    udp_send(AF_INET6, port, "v6,host=a value=1i\n", 19);
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);
    fx_finish(f);
}

Test(ingest, udp_graphite_listener) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_GRAPHITE);
    fx_start(f);
    int influx = bd_ingest_listener_port(f->in, 0);
    int graphite = bd_ingest_listener_port(f->in, 1);
    cr_assert(influx > 0 && graphite > 0 && influx != graphite);
    cr_expect_lt(bd_ingest_listener_port(f->in, 2), 0);

    /* Each listener parses its own format: a graphite line is garbage to influx. */
    udp_send_str(graphite, "servers.a.cpu 1.5\nservers.b.cpu 2\n");
    udp_send_str(influx, "servers.a.cpu 1.5\n");
    RUN_UNTIL(f, STAT(f, udp_datagrams) == 2);
    cr_expect_eq(STAT(f, readings_accepted), 2);
    cr_expect_eq(STAT(f, drop_parse_error), 1);
    fx_finish(f);
}

/* ---------------------------------------------------------------------------------------- */
/* TCP                                                                                      */

Test(ingest, tcp_lines_split_across_writes) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    RUN_UNTIL(f, STAT(f, tcp_connections) == 1);
    cr_expect_eq(bd_ingest_connections(f->in), 1);

    const char *parts[] = {"cpu,host=a val", "ue=1i\ncpu,host=b value=2i\ncpu,host=c va",
                           "lue=3i\r", "\n\n# comment\n", "cpu,host=d value=4i"};
    size_t total = 0;
    for (size_t i = 0; i < BD_ARRAY_LEN(parts); i++) {
        tcp_send_str(f, fd, parts[i]);
        total += strlen(parts[i]);
        /* Let each piece arrive on its own so the framing really sees partial lines. */
        RUN_UNTIL(f, STAT(f, tcp_bytes) == total);
    }
    cr_expect_eq(STAT(f, readings_accepted), 3, "the unterminated last line waits for more");

    /* EOF completes the unterminated last line and closes the connection. */
    shutdown(fd, SHUT_WR);
    RUN_UNTIL(f, bd_ingest_connections(f->in) == 0);
    cr_expect_eq(STAT(f, readings_accepted), 4);
    cr_expect_eq(STAT(f, lines), 4);
    cr_expect_eq(bd_sensor_table_count(f->table), 4);
    close(fd);
    fx_finish(f);
}

Test(ingest, tcp_many_lines_through_small_buffer) {
    /* Far more data than the connection buffer holds, so it compacts many times. */
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    enum { N = 5000 };
    char *buf = malloc(N * 48);
    size_t len = 0;
    for (int i = 0; i < N; i++) {
        len += (size_t)sprintf(buf + len, "m,host=h%d value=%di\n", i % 7, i);
    }
    tcp_send(f, fd, buf, len);
    RUN_UNTIL(f, STAT(f, lines) == N);
    cr_expect_eq(STAT(f, readings_accepted), N);
    cr_expect_eq(STAT(f, tcp_bytes), len);
    cr_expect_eq(bd_sensor_table_count(f->table), 7);
    free(buf);
    close(fd);
    fx_finish(f);
}

Test(ingest, tcp_line_too_long_closes_connection) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);

    /* Without a newline: detected as soon as the partial line passes max_line. */
    int fd = tcp_connect(port);
    tcp_send_str(f, fd, "cpu,host=a value=1i\n");
    char big[TEST_MAX_LINE + 10];
    memset(big, 'x', sizeof(big));
    tcp_send(f, fd, big, sizeof(big));
    RUN_UNTIL(f, STAT(f, drop_line_too_long) == 1 && bd_ingest_connections(f->in) == 0);
    cr_expect_eq(STAT(f, readings_accepted), 1);
    RUN_UNTIL(f, peer_closed(fd));
    close(fd);

    /* With a newline, arriving in one piece together with the line after it. */
    fd = tcp_connect(port);
    big[sizeof(big) - 1] = '\n';
    char msg[sizeof(big) + 64];
    memcpy(msg, big, sizeof(big));
    size_t n = sizeof(big) + (size_t)snprintf(msg + sizeof(big), 64, "cpu,host=b value=2i\n");
    tcp_send(f, fd, msg, n);
    RUN_UNTIL(f, STAT(f, drop_line_too_long) == 2 && bd_ingest_connections(f->in) == 0);
    cr_expect_eq(STAT(f, readings_accepted), 1, "nothing after the long line is read");
    close(fd);

    cr_expect_eq(STAT(f, tcp_connections), 2);
    fx_finish(f);
}

Test(ingest, tcp_max_connections) {
    struct fx *f = fx_new();
    uint32_t li = fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    f->cfg.listeners[li].max_connections = 2;
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);

    int a = tcp_connect(port);
    int b = tcp_connect(port);
    RUN_UNTIL(f, STAT(f, tcp_connections) == 2);
    int c = tcp_connect(port);
    RUN_UNTIL(f, STAT(f, tcp_rejected) == 1);
    cr_expect_eq(bd_ingest_connections(f->in), 2);
    RUN_UNTIL(f, peer_closed(c));
    close(c);

    /* A slot that frees up is available again. */
    close(a);
    RUN_UNTIL(f, bd_ingest_connections(f->in) == 1);
    int d = tcp_connect(port);
    RUN_UNTIL(f, STAT(f, tcp_connections) == 3);
    tcp_send_str(f, d, "cpu,host=d value=1i\n");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);
    cr_expect_eq(STAT(f, tcp_rejected), 1);
    close(b);
    close(d);
    fx_finish(f);
}

/*
 * The idle timeout closes a silent connection, never one that keeps sending. Nothing here
 * depends on speed beyond a gap between two sends far inside the timeout: the timeout is 20
 * times the busy client's 50 ms interval, and how late after the timeout the sweep closes the
 * idle one is only bounded by the wait's deadline (a loaded machine can delay a sweep).
 */
#define IDLE_TIMEOUT_MS 1000

Test(ingest, tcp_idle_timeout) {
    struct fx *f = fx_new();
    uint32_t li = fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    f->cfg.listeners[li].idle_timeout_ms = IDLE_TIMEOUT_MS;
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);

    int idle = tcp_connect(port);
    int busy = tcp_connect(port);
    RUN_UNTIL(f, STAT(f, tcp_connections) == 2);
    /* Before the send: the loop reads the line, and stamps the connection, after this. */
    int64_t t0 = bd_mono_ns();
    tcp_send_str(f, idle, "cpu,host=idle value=1i\n");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);

    /* The busy one writes every 50 ms and must outlive the idle one. */
    int sent = 0;
    int64_t next = t0;
    int64_t deadline = t0 + WAIT_NS;
    while (STAT(f, tcp_idle_closed) == 0) {
        cr_assert(bd_mono_ns() < deadline, "idle connection never closed");
        if (bd_mono_ns() >= next) {
            tcp_send_str(f, busy, "cpu,host=busy value=1i\n");
            sent++;
            next += 50 * BD_NS_PER_MS;
        }
        uv_run(&f->loop, UV_RUN_NOWAIT);
        sleep_us(200);
    }
    /* Not early (the loop's coarse cached clock may lag ours by a few ms); late only within
     * WAIT_NS. */
    int64_t elapsed_ms = (bd_mono_ns() - t0) / BD_NS_PER_MS;
    cr_expect_geq(elapsed_ms, IDLE_TIMEOUT_MS - 10, "closed after %lld ms", (long long)elapsed_ms);
    RUN_UNTIL(f, peer_closed(idle));
    cr_expect_eq(bd_ingest_connections(f->in), 1, "the busy connection stays");
    RUN_UNTIL(f, STAT(f, readings_accepted) == (uint64_t)(1 + sent));

    /* Once it falls silent it goes too. */
    RUN_UNTIL(f, STAT(f, tcp_idle_closed) == 2);
    cr_expect_eq(bd_ingest_connections(f->in), 0);
    close(idle);
    close(busy);
    fx_finish(f);
}

/* Plays the flusher: empties every dirty queue; returns readings seen, checking their order. */
static uint32_t drain_rings(struct fx *f, int64_t *next_value) {
    uint32_t seen = 0;
    struct bd_sensor *s;
    static struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    while ((s = bd_sensor_table_next_dirty(f->table)) != NULL) {
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) > 0) {
            cr_assert_eq(nv, 1);
            cr_assert_eq(vals[0].kind, BD_VAL_INT);
            cr_assert_eq(vals[0].v.i, *next_value, "reading out of order or lost");
            (*next_value)++;
            bd_sensor_consume(s, cells);
            seen++;
        }
    }
    return seen;
}

/* Plays the flusher without order checks: empties every dirty queue. */
static void consume_all(struct fx *f) {
    struct bd_sensor *s;
    static struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    while ((s = bd_sensor_table_next_dirty(f->table)) != NULL) {
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) > 0) {
            bd_sensor_consume(s, cells);
        }
    }
}

Test(ingest, tcp_backpressure_pauses_instead_of_dropping) {
    struct fx *f = fx_new();
    /* A pool of 16 segments of 30 readings: TCP waits past 4 segments (120 readings). */
    f->cfg.limits.memory = 32 * 1024;
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));

    enum { N = 3000 };
    char *buf = malloc(N * 32);
    size_t len = 0;
    for (int i = 0; i < N; i++) {
        len += (size_t)sprintf(buf + len, "bp,host=x v=%di\n", i);
    }

    size_t off = 0;
    int64_t next_value = 0;
    uint32_t pauses_seen = 0;
    int64_t deadline = bd_mono_ns() + WAIT_NS * 4;
    while (next_value < N) {
        cr_assert(bd_mono_ns() < deadline, "stuck at reading %lld", (long long)next_value);
        if (off < len) {
            ssize_t n = send(fd, buf + off, len - off, MSG_NOSIGNAL);
            if (n > 0) {
                off += (size_t)n;
            }
        }
        uv_run(&f->loop, UV_RUN_NOWAIT);
        if (bd_ingest_paused(f->in) > 0) {
            pauses_seen++;
            /* Nothing moves while paused and the pool stays full. */
            uint64_t before = STAT(f, readings_accepted);
            uv_run(&f->loop, UV_RUN_NOWAIT);
            cr_assert_eq(STAT(f, readings_accepted), before);
            cr_assert_eq(bd_ingest_paused(f->in), 1);
        }
        if (drain_rings(f, &next_value) > 0) {
            bd_ingest_resume(f->in);
        }
        sleep_us(50);
    }
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    cr_expect_eq(STAT(f, readings_accepted), N);
    cr_expect_geq(pauses_seen, 5, "paused %u times", pauses_seen);
    cr_expect_eq(bd_ingest_paused(f->in), 0);
    free(buf);
    close(fd);
    fx_finish(f);
}

/* ---------------------------------------------------------------------------------------- */
/* Lifecycle                                                                                */

Test(ingest, bind_error_names_listener_and_cleans_up) {
    /* Hold a TCP port so the second listener cannot have it. */
    int holder = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(holder, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(holder, 1), 0);
    socklen_t alen = sizeof(a);
    cr_assert_eq(getsockname(holder, (struct sockaddr *)&a, &alen), 0);
    char taken[64];
    snprintf(taken, sizeof(taken), "127.0.0.1:%u", (unsigned)ntohs(a.sin_port));

    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_listen(f, BD_PROTO_TCP, taken, BD_FORMAT_INFLUX);
    struct bd_err err = {0};
    cr_assert_eq(bd_sensor_table_new(&f->table, &f->cfg, &f->stats, &err), 0);
    struct bd_ingest *in = NULL;
    int rc = bd_ingest_new(&in, &f->loop, &f->cfg, f->table, &f->stats, &err);
    cr_expect_eq(rc, UV_EADDRINUSE);
    cr_expect_null(in);
    char want[160];
    snprintf(want, sizeof(want), "listener 2 (tcp %s): address already in use", taken);
    cr_expect_str_eq(err.msg, want);

    /* The UDP listener that did bind is closed and freed by the loop. */
    run_until_closed(&f->loop);
    cr_expect_eq(uv_loop_close(&f->loop), 0);
    bd_sensor_table_free(f->table);
    free(f);
    close(holder);
}

Test(ingest, free_without_stop_and_free_null) {
    bd_ingest_free(NULL);

    struct fx *f = fx_new();
    uint32_t li = fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    f->cfg.listeners[li].idle_timeout_ms = 1000;
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    tcp_send_str(f, fd, "cpu,host=a value=1i\ncpu,host=b val");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);

    /* Freed with a connection and a timer open: the close callbacks finish the job. */
    bd_ingest_free(f->in);
    run_until_closed(&f->loop);
    cr_expect_eq(STAT(f, readings_accepted), 1, "an unterminated line is not a reading");
    RUN_UNTIL(f, peer_closed(fd));
    close(fd);
    bd_sensor_table_free(f->table);
    cr_assert_eq(uv_loop_close(&f->loop), 0);
    free(f);
}

/*
 * Fairness: a sensor sending faster than it is drained pauses only the connection feeding it.
 * Another connection's sensor, already flowing, keeps being read meanwhile.
 */
Test(ingest, tcp_a_busy_sensor_pauses_only_its_own_connection) {
    struct fx *f = fx_new();
    /* 16 segments of 30 readings; a sensor's queue may hold 2. */
    f->cfg.limits.memory = 32 * 1024;
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    int legit = tcp_connect(port), hostile = tcp_connect(port);
    tcp_send_str(f, legit, "legit v=0i\n");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);

    static char buf[600 * 24];
    size_t len = 0;
    for (int i = 0; i < 600; i++) {
        len += (size_t)sprintf(buf + len, "hostile v=%di\n", i);
    }
    tcp_send(f, hostile, buf, len);
    RUN_UNTIL(f, bd_ingest_paused(f->in) == 1);
    /* Its share of the pool: 2 segments of 30. */
    cr_expect_eq(STAT(f, readings_accepted), 1 + 2 * 30);
    cr_expect_eq(STAT(f, tcp_sensor_pauses), 1);
    cr_expect_eq(STAT(f, tcp_congestion_pauses), 0, "a busy sensor is not a congested pool");
    cr_expect_not(bd_sensor_table_congested(f->table), "the pool itself is not congested");

    len = 0;
    for (int i = 1; i <= 50; i++) {
        len += (size_t)sprintf(buf + len, "legit v=%di\n", i);
    }
    tcp_send(f, legit, buf, len);
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1 + 2 * 30 + 50);
    cr_expect_eq(bd_ingest_paused(f->in), 1, "still only the hostile connection");

    /* Drained, the hostile connection resumes where it stopped: nothing lost or repeated. */
    int64_t deadline = bd_mono_ns() + WAIT_NS;
    while (STAT(f, readings_accepted) < 1 + 600 + 50) {
        cr_assert(bd_mono_ns() < deadline, "stuck at %" PRIu64,
                  (uint64_t)STAT(f, readings_accepted));
        consume_all(f);
        bd_ingest_resume(f->in);
        uv_run(&f->loop, UV_RUN_NOWAIT);
        sleep_us(200);
    }
    cr_expect_eq(STAT(f, lines), 1 + 600 + 50, "each line counted once");
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    cr_expect_eq(STAT(f, drop_sensor_busy), 0, "TCP waits, it does not drop");
    close(legit);
    close(hostile);
    fx_finish(f);
}

/*
 * A pool past its high-water mark pauses a connection whatever sensor its next line is for, and
 * that pause is counted apart from a busy sensor's (tcp_congestion_pauses, not
 * tcp_sensor_pauses): the first makes every connection wait, the second only one.
 */
Test(ingest, tcp_a_congested_pool_pause_is_counted_as_such) {
    struct fx *f = fx_new();
    f->cfg.limits.memory = 32 * 1024; /* 16 segments of 30 readings, congested past 4 */
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    /* Four sensors, 30 readings each: a segment each (4 in use, none past its share of 2);
     * then one more reading each, a second segment each: the first is the 5th segment, past a
     * quarter of the pool, where TCP waits (UDP would go on to three quarters). */
    static char buf[4 * 31 * 24];
    size_t len = 0;
    for (int k = 0; k < 4; k++) {
        for (int i = 0; i < 30; i++) {
            len += (size_t)sprintf(buf + len, "c,k=%d v=%di\n", k, i);
        }
    }
    for (int k = 0; k < 4; k++) {
        len += (size_t)sprintf(buf + len, "c,k=%d v=30i\n", k);
    }
    tcp_send(f, fd, buf, len);
    RUN_UNTIL(f, STAT(f, tcp_bytes) == len && bd_ingest_paused(f->in) == 1);
    cr_expect_eq(STAT(f, readings_accepted), 4 * 30 + 1, "paused after the 5th segment");
    cr_expect_eq(STAT(f, tcp_congestion_pauses), 1);
    cr_expect_eq(STAT(f, tcp_sensor_pauses), 0, "no sensor was at its share");

    /* Drained, and the sensors' own segments given back (the flusher's second look, after the
     * producer sealed them), the pool is below an eighth: the connection resumes where it
     * stopped. */
    consume_all(f);
    bd_sensor_table_publish(f->table);
    consume_all(f);
    bd_ingest_resume(f->in);
    RUN_UNTIL(f, STAT(f, readings_accepted) == 4 * 31);
    cr_expect_eq(bd_ingest_paused(f->in), 0);
    cr_expect_eq(STAT(f, tcp_congestion_pauses), 1);
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    close(fd);
    fx_finish(f);
}

Test(ingest, stop_takes_lines_buffered_by_a_paused_connection) {
    struct fx *f = fx_new();
    f->cfg.limits.memory = 32 * 1024; /* 16 segments, congested past 6 */
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    /* 40 lines to different sensors after 20 to one: a segment each congests the pool. */
    char buf[4096];
    size_t len = 0;
    for (int i = 0; i < 20; i++) {
        len += (size_t)sprintf(buf + len, "one,host=x v=%di\n", i);
    }
    for (int i = 0; i < 40; i++) {
        len += (size_t)sprintf(buf + len, "many,host=h%d v=%di\n", i, i);
    }
    tcp_send(f, fd, buf, len);
    RUN_UNTIL(f, STAT(f, tcp_bytes) == len);
    cr_expect_eq(bd_ingest_paused(f->in), 1);
    cr_expect_lt(STAT(f, lines), 60);

    bool stopped = false;
    bd_ingest_stop(f->in, on_stopped, &stopped);
    cr_expect_not(stopped, "the paused connection still owes lines to the queues");
    cr_expect_lt(STAT(f, lines), 60, "a stop does not push into a full pool");
    for (int i = 0; i < 100 && !stopped; i++) {
        /* The flusher's part: drain, then the doorbell resumes the connection. */
        consume_all(f);
        bd_ingest_resume(f->in);
        uv_run(&f->loop, UV_RUN_NOWAIT);
    }
    cr_expect(stopped, "the stop completes once the buffered lines are in the queues");
    cr_expect_eq(STAT(f, lines), 60, "stop processes what already arrived");
    cr_expect_eq(STAT(f, readings_accepted), 60);
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    run_until_closed(&f->loop);
    bd_ingest_free(f->in);
    bd_ingest_resume(NULL);
    close(fd);
    bd_sensor_table_free(f->table);
    cr_assert_eq(uv_loop_close(&f->loop), 0);
    free(f);
}

Test(ingest, abort_gives_up_on_a_paused_connection_and_counts_it) {
    struct fx *f = fx_new();
    f->cfg.limits.memory = 32 * 1024; /* 16 segments, congested past 6 */
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int fd = tcp_connect(bd_ingest_listener_port(f->in, 0));
    char buf[4096];
    size_t len = 0;
    for (int i = 0; i < 60; i++) {
        len += (size_t)sprintf(buf + len, "one,host=h%d v=%di\n", i, i);
    }
    tcp_send(f, fd, buf, len);
    RUN_UNTIL(f, STAT(f, tcp_bytes) == len);
    cr_expect_eq(bd_ingest_paused(f->in), 1);

    bool stopped = false;
    bd_ingest_stop(f->in, on_stopped, &stopped);
    cr_expect_not(stopped);
    bd_ingest_abort(f->in);
    cr_expect(stopped);
    cr_expect_gt(STAT(f, tcp_unread_at_stop), 0, "the abandoned bytes are counted");
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    run_until_closed(&f->loop);
    bd_ingest_free(f->in);
    close(fd);
    bd_sensor_table_free(f->table);
    cr_assert_eq(uv_loop_close(&f->loop), 0);
    free(f);
}

/* ---------------------------------------------------------------------------------------- */
/* Kernel UDP counters                                                                      */

static bool proc_readable(void) {
    return access("/proc/net/udp", R_OK) == 0 && access("/proc/net/snmp", R_OK) == 0;
}

/* 200 datagrams of 1 KiB, each full of valid short lines. */
static void send_burst(int port) {
    char dgram[1020];
    for (size_t o = 0; o + 6 <= sizeof(dgram); o += 6) {
        memcpy(dgram + o, "m v=1\n", 6);
    }
    for (int k = 0; k < 200; k++) {
        udp_send(AF_INET, port, dgram, sizeof(dgram));
    }
}

/*
 * A listener with the smallest receive buffer the kernel grants (a few KiB) is sent far more
 * than that while the loop is not running: the kernel must drop most of it, and say so.
 */
static int overflow_tiny_socket(struct fx *f) {
    uint32_t i = fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    f->cfg.listeners[i].rcvbuf = 1024;
    /* The default pool holds whatever the tiny buffer lets through (nothing drains it here):
     * these tests are about the kernel's drops, not about a congested pool pausing the
     * listener. */
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    cr_assert(port > 0);
    send_burst(port);
    return port;
}

Test(ingest, kernel_drops_are_read_at_stop) {
    if (!proc_readable()) {
        cr_skip_test("/proc/net is not readable here");
    }
    struct fx *f = fx_new();
    overflow_tiny_socket(f);
    /* No loop turn, so no timer: only the reading bd_ingest_stop makes can see the drops. */
    bd_ingest_stop(f->in, NULL, NULL);
    uint64_t drops = STAT(f, udp_socket_drops);
    cr_expect_gt(drops, 0);
    cr_expect_leq(drops, 200);
    /* Host-wide counters include ours (and maybe other processes' drops). */
    cr_expect_geq(STAT(f, udp_kernel_rcvbuf_errors), drops);
    cr_expect_geq(STAT(f, udp_kernel_in_errors), STAT(f, udp_kernel_rcvbuf_errors));
    fx_finish(f);
}

Test(ingest, kernel_drops_are_read_on_a_timer_and_only_grow) {
    if (!proc_readable()) {
        cr_skip_test("/proc/net is not readable here");
    }
    struct fx *f = fx_new();
    int port = overflow_tiny_socket(f);
    RUN_UNTIL(f, STAT(f, udp_socket_drops) > 0);
    uint64_t first = STAT(f, udp_socket_drops);
    /* Another burst: its drops are added to the first ones. */
    send_burst(port);
    RUN_UNTIL(f, STAT(f, udp_socket_drops) > first);
    cr_expect_geq(STAT(f, udp_kernel_rcvbuf_errors), STAT(f, udp_socket_drops));
    cr_expect_eq(STAT(f, drop_parse_error) + STAT(f, drop_line_too_long), 0);
    fx_finish(f);
}

Test(ingest, no_udp_listener_reads_no_kernel_counters) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    bd_ingest_stop(f->in, NULL, NULL);
    cr_expect_eq(STAT(f, udp_socket_drops), 0);
    cr_expect_eq(STAT(f, udp_kernel_rcvbuf_errors), 0);
    cr_expect_eq(STAT(f, udp_kernel_in_errors), 0);
    fx_finish(f);
}

/* ---------------------------------------------------------------------------------------- */
/* UDP backpressure                                                                         */

#define BP_DATAGRAMS 100
/* Sensors the datagrams go to, in turn, and readings per datagram: one segment's worth. */
#define BP_SENSORS 10
#define BP_LINES 30
#define BP_READINGS (BP_DATAGRAMS * BP_LINES)

/* BP_DATAGRAMS datagrams of BP_LINES readings each (m,k=<d % BP_SENSORS> v=<n>, n counting every
 * reading sent), into the kernel before the loop runs. */
static int backpressure_setup(struct fx *f) {
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    /* A pool of 64 segments of 60 cells, high-water mark 48; each datagram fills a segment of
     * its sensor. Batches of 20 datagrams: after the second the pool holds 40, after the third
     * 60 (past the mark: pauses). Ten sensors share the pool evenly, so none reaches its share
     * of it (8 segments past half full) before the pool is full. */
    f->cfg.limits.memory = 128 * 1024;
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    cr_assert(port > 0);
    int n = 0;
    for (int d = 0; d < BP_DATAGRAMS; d++) {
        char buf[BP_LINES * 40];
        size_t len = 0;
        for (int i = 0; i < BP_LINES; i++) {
            len += (size_t)snprintf(buf + len, sizeof(buf) - len, "m,k=%d v=%d\n", d % BP_SENSORS,
                                    n++);
        }
        udp_send_str(port, buf);
    }
    return port;
}

/* Consumer side, played by the test: drains every dirty queue, checking each sensor's values
 * arrive in the order sent. *next counts the readings drained. */
static uint32_t drain_in_order(struct fx *f, uint64_t *next) {
    static int64_t last[BP_SENSORS];
    if (*next == 0) {
        for (int k = 0; k < BP_SENSORS; k++) {
            last[k] = -1;
        }
    }
    uint32_t n = 0;
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(f->table)) != NULL) {
        int64_t ts;
        struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            cr_assert_eq(nv, 1);
            int64_t v = (int64_t)vals[0].v.f;
            int k = (int)(v / BP_LINES % BP_SENSORS);
            cr_assert_gt(v, last[k], "reading %" PRId64 " of sensor %d out of order", v, k);
            last[k] = v;
            (*next)++;
            n++;
            bd_sensor_consume(s, cells);
        }
    }
    return n;
}

/*
 * A pool past its high-water mark stops the listener between receive batches; the rest waits
 * in the socket buffer, and reading resumes once the consumer has drained the queues. Without
 * the pause the pool (64 segments) overflows: nothing drains it while the loop reads.
 */
Test(ingest, udp_pauses_for_a_congested_pool_instead_of_dropping) {
    struct fx *f = fx_new();
    backpressure_setup(f);
    uint64_t next = 0;
    uint64_t pauses = 0;
    int64_t deadline = bd_mono_ns() + WAIT_NS;
    while (STAT(f, readings_accepted) < BP_READINGS || next < BP_READINGS) {
        cr_assert(bd_mono_ns() < deadline, "stuck: %" PRIu64 " accepted, %" PRIu64 " drained",
                  (uint64_t)STAT(f, readings_accepted), next);
        uv_run(&f->loop, UV_RUN_NOWAIT);
        if (STAT(f, udp_pauses) > pauses) {
            /* Paused with datagrams still in the kernel (the first pause; a later one may come
             * with the last batch): the loop must not read them now. */
            uint64_t accepted = STAT(f, readings_accepted);
            if (pauses == 0) {
                cr_assert_lt(accepted, BP_READINGS);
            }
            pauses = STAT(f, udp_pauses);
            uv_run(&f->loop, UV_RUN_NOWAIT);
            sleep_us(2000);
            uv_run(&f->loop, UV_RUN_NOWAIT);
            cr_assert_eq(STAT(f, readings_accepted), accepted, "read while paused");
            drain_in_order(f, &next);
            bd_ingest_resume(f->in);
        } else {
            /* The flusher's part: drain (also what only the producer's take-back made
             * ready to give back), then ring the doorbell. */
            drain_in_order(f, &next);
            bd_ingest_resume(f->in);
        }
        sleep_us(200);
    }
    cr_expect_eq(next, BP_READINGS);
    cr_expect_geq(pauses, 1);
    cr_expect_eq(STAT(f, drop_buffer_full), 0);
    cr_expect_eq(STAT(f, udp_datagrams), BP_DATAGRAMS);
    fx_finish(f);
}

/*
 * While the flusher is stalled (its batches at their memory limit) it drains nothing: the
 * listener keeps reading into the pool, and what does not fit is dropped and counted.
 */
Test(ingest, udp_keeps_reading_while_the_flusher_is_stalled) {
    struct fx *f = fx_new();
    backpressure_setup(f);
    bd_sensor_table_set_stalled(f->table, true);
    RUN_UNTIL(f, STAT(f, udp_datagrams) == BP_DATAGRAMS);
    cr_expect_eq(STAT(f, udp_pauses), 0);
    cr_expect_eq(STAT(f, readings_accepted), 64 * BP_LINES);
    cr_expect_eq(STAT(f, drop_buffer_full), BP_READINGS - 64 * BP_LINES);
    cr_expect_eq(STAT(f, drop_sensor_busy), 0);
    fx_finish(f);
}

/* A listener paused for congestion reads again when the flusher stalls (it says so). */
Test(ingest, udp_paused_listener_resumes_when_the_flusher_stalls) {
    struct fx *f = fx_new();
    backpressure_setup(f);
    RUN_UNTIL(f, STAT(f, udp_pauses) == 1);
    uint64_t accepted = STAT(f, readings_accepted);
    cr_assert_lt(accepted, BP_READINGS);
    bd_ingest_resume(f->in); /* still congested, flusher not stalled: stays paused */
    uv_run(&f->loop, UV_RUN_NOWAIT);
    cr_expect_eq(STAT(f, readings_accepted), accepted);
    bd_sensor_table_set_stalled(f->table, true);
    bd_ingest_resume(f->in);
    RUN_UNTIL(f, STAT(f, udp_datagrams) == BP_DATAGRAMS);
    cr_expect_eq(STAT(f, readings_accepted), 64 * BP_LINES);
    cr_expect_eq(STAT(f, drop_buffer_full), BP_READINGS - 64 * BP_LINES);
    cr_expect_eq(STAT(f, udp_pauses), 1);
    fx_finish(f);
}

static int g_wakes;
static void count_wake(void *arg) {
    (void)arg;
    g_wakes++;
}

/*
 * The flusher is woken when the pool passes a quarter (16 segments: batch one), where it also
 * becomes congested (TCP would wait there), and by the pause itself (past 48: batch three), so a
 * pause never waits for flush.interval.
 */
Test(ingest, udp_pause_wakes_the_flusher) {
    struct fx *f = fx_new();
    backpressure_setup(f);
    g_wakes = 0;
    bd_sensor_table_set_wake(f->table, count_wake, NULL);
    RUN_UNTIL(f, STAT(f, udp_pauses) == 1);
    cr_expect_eq(STAT(f, readings_accepted), 60 * BP_LINES, "three batches of 20 datagrams");
    cr_expect_eq(g_wakes, 2, "a quarter (congested), paused");
    fx_finish(f);
}

/*
 * A started UDP listener with n datagrams ("m v=0" ...) waiting in its socket buffer, and a stop
 * read-out of drain_ns (the default is 500 ms). The loop never runs, so the stop's own read is
 * the only one.
 */
static struct fx *udp_queued_then_stop(int n, int64_t drain_ns) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    bd_ingest_set_udp_stop_drain(f->in, drain_ns);
    int port = bd_ingest_listener_port(f->in, 0);
    cr_assert(port > 0);
    for (int k = 0; k < n; k++) {
        char line[64];
        snprintf(line, sizeof(line), "m v=%d", k);
        udp_send_str(port, line);
    }
    bd_ingest_stop(f->in, NULL, NULL);
    return f;
}

/*
 * Datagrams still in the socket buffer when the daemon stops arrived before the stop: they are
 * read out and accepted, not lost with the socket.
 */
Test(ingest, udp_stop_reads_what_the_socket_buffer_holds) {
    struct fx *f = udp_queued_then_stop(50, 500 * BD_NS_PER_MS);
    cr_expect_eq(STAT(f, udp_datagrams), 50);
    cr_expect_eq(STAT(f, readings_accepted), 50);
    uint64_t next = 0;
    cr_expect_eq(drain_in_order(f, &next), 50, "every reading, in order, in a queued ring");
    fx_finish(f);
}

/*
 * A stop whose read-out runs out of time (here at once: deadline 0) still counts what it leaves:
 * the first receive batch is read and accepted, every datagram after it is discarded and
 * counted in udp_unread_at_stop, none is lost uncounted.
 */
Test(ingest, udp_stop_counts_what_its_read_out_leaves) {
    struct fx *f = udp_queued_then_stop(50, 0);
    uint64_t read = STAT(f, udp_datagrams);
    cr_expect(read > 0 && read < 50, "one receive batch read, not all: %llu",
              (unsigned long long)read);
    cr_expect_eq(STAT(f, readings_accepted), read);
    cr_expect_eq(STAT(f, udp_unread_at_stop), 50 - read, "%llu read, %llu counted unread",
                 (unsigned long long)read, (unsigned long long)STAT(f, udp_unread_at_stop));
    uint64_t next = 0;
    cr_expect_eq(drain_in_order(f, &next), read);
    fx_finish(f);
}

/* ---------------------------------------------------------------------------------------- */
/* Reload: the listener set (bd_ingest_set_listeners)                                       */

/* A copy of the running configuration with only the listeners keep[0..n) of f->cfg. */
static struct bd_config listeners_of(const struct fx *f, const uint32_t *keep, uint32_t n) {
    struct bd_config next = f->cfg;
    next.n_listeners = 0;
    for (uint32_t i = 0; i < n; i++) {
        next.listeners[next.n_listeners++] = f->cfg.listeners[keep[i]];
    }
    return next;
}

static void add_spec(struct bd_config *next, enum bd_proto proto, const char *bind) {
    struct bd_listener_config *l = &next->listeners[next->n_listeners++];
    *l = (struct bd_listener_config){.proto = proto,
                                     .format = BD_FORMAT_INFLUX,
                                     .precision = BD_PREC_NS,
                                     .rcvbuf = 256 * 1024,
                                     .max_connections = 16};
    snprintf(l->bind, sizeof(l->bind), "%s", bind);
    cr_assert_eq(bd_parse_hostport(bind, &l->addr), 0);
}

static bool udp_port_refused(int port) {
    /* A connected UDP socket hears the ICMP "port unreachable" of a closed port. */
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    (void)send(fd, "x v=1\n", 6, 0);
    char b[8];
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ssize_t n = recv(fd, b, sizeof(b), 0);
    bool refused = n < 0 && errno == ECONNREFUSED;
    close(fd);
    return refused;
}

/*
 * A removed UDP listener first reads out what its socket holds (sent before the reload), then
 * closes; an added one takes a free slot and reads at once; a kept one is not touched.
 */
Test(ingest, a_reload_adds_and_removes_udp_listeners) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int removed = bd_ingest_listener_port(f->in, 0);
    int tcp = bd_ingest_listener_port(f->in, 1);
    udp_send_str(removed, "m,l=a v=1\nm,l=a v=2\n"); /* queued: the loop does not run */

    uint32_t keep[] = {1};
    struct bd_config next = listeners_of(f, keep, 1);
    add_spec(&next, BD_PROTO_UDP, "127.0.0.2:0");
    cr_assert_eq(bd_ingest_set_listeners(f->in, &next), 0);
    cr_expect_eq(STAT(f, readings_accepted), 2, "read out at its removal");
    cr_assert_eq(next.n_listeners, 2);
    cr_expect_eq(next.listeners[0].proto, BD_PROTO_TCP);
    cr_expect_eq(next.listeners[1].proto, BD_PROTO_UDP);
    cr_expect_eq(bd_ingest_listener_port(f->in, 0), -EINVAL, "closed");
    cr_expect_eq(bd_ingest_listener_port(f->in, 1), tcp, "kept as it was");
    /* Slot 0 is still closing: the new listener took the next free one. */
    int added = bd_ingest_listener_port(f->in, 2);
    cr_assert_gt(added, 0);

    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)added)};
    cr_assert_eq(inet_pton(AF_INET, "127.0.0.2", &a.sin_addr), 1);
    cr_assert_eq(sendto(fd, "m,l=c v=3\n", 10, 0, (struct sockaddr *)&a, sizeof(a)), 10);
    close(fd);
    RUN_UNTIL(f, STAT(f, readings_accepted) == 3);
    cr_expect(udp_port_refused(removed), "the removed port is closed");
    fx_finish(f);
}

/*
 * A removed TCP listener takes no new connection, but the open ones are read to their end:
 * nothing a sender sent is lost. Its slot (and idle sweep) goes once the last one closed.
 */
Test(ingest, a_removed_tcp_listener_keeps_its_connections_until_they_close) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    uint32_t li = fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    f->cfg.listeners[li].idle_timeout_ms = 60000; /* a sweep timer that must close too */
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 1);
    int fd = tcp_connect(port);
    RUN_UNTIL(f, STAT(f, tcp_connections) == 1);
    tcp_send_str(f, fd, "m,c=1 v=1\n");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);

    uint32_t keep[] = {0};
    struct bd_config next = listeners_of(f, keep, 1);
    cr_assert_eq(bd_ingest_set_listeners(f->in, &next), 0);
    cr_assert_eq(next.n_listeners, 1);
    int other = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_expect_neq(connect(other, (struct sockaddr *)&a, sizeof(a)), 0, "no longer listening");
    close(other);

    tcp_send_str(f, fd, "m,c=1 v=2\nm,c=1 v=3");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 2);
    cr_expect_eq(bd_ingest_connections(f->in), 1);
    shutdown(fd, SHUT_WR);
    RUN_UNTIL(f, bd_ingest_connections(f->in) == 0);
    cr_expect_eq(STAT(f, readings_accepted), 3, "the unterminated last line at EOF too");
    close(fd);

    /* The slot is free again once its handles have closed (the sweep's close callback runs at
     * the end of a loop turn): a new listener takes it. */
    uv_run(&f->loop, UV_RUN_NOWAIT);
    add_spec(&next, BD_PROTO_TCP, "127.0.0.1:0");
    cr_assert_eq(bd_ingest_set_listeners(f->in, &next), 0);
    cr_expect_gt(bd_ingest_listener_port(f->in, 1), 0, "slot 1 reused");
    fx_finish(f);
}

/* A listener that cannot bind is logged and left out; the others go on. */
Test(ingest, a_listener_a_reload_cannot_open_is_left_out) {
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_UDP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    int port = bd_ingest_listener_port(f->in, 0);
    int taken = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(taken, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(taken, 1), 0);
    socklen_t alen = sizeof(a);
    cr_assert_eq(getsockname(taken, (struct sockaddr *)&a, &alen), 0);
    char bind_text[32];
    snprintf(bind_text, sizeof(bind_text), "127.0.0.1:%u", (unsigned)ntohs(a.sin_port));

    uint32_t keep[] = {0};
    struct bd_config next = listeners_of(f, keep, 1);
    add_spec(&next, BD_PROTO_TCP, bind_text);
    cr_assert_eq(bd_ingest_set_listeners(f->in, &next), -1);
    cr_assert_eq(next.n_listeners, 1, "left out of what runs");
    cr_expect_eq(next.listeners[0].proto, BD_PROTO_UDP);
    udp_send_str(port, "m v=1\n");
    RUN_UNTIL(f, STAT(f, readings_accepted) == 1);
    close(taken);
    fx_finish(f);
}

/* The kernel's drop counters follow a UDP listener a reload adds to a daemon that had none. */
Test(ingest, an_added_udp_listener_has_its_kernel_drops_read) {
    if (!proc_readable()) {
        cr_skip_test("/proc/net is not readable here");
    }
    struct fx *f = fx_new();
    fx_listen(f, BD_PROTO_TCP, "127.0.0.1:0", BD_FORMAT_INFLUX);
    fx_start(f);
    uint32_t keep[] = {0};
    struct bd_config next = listeners_of(f, keep, 1);
    add_spec(&next, BD_PROTO_UDP, "127.0.0.1:0");
    next.listeners[1].rcvbuf = 1024;
    cr_assert_eq(bd_ingest_set_listeners(f->in, &next), 0);
    send_burst(bd_ingest_listener_port(f->in, 1));
    bd_ingest_stop(f->in, NULL, NULL);
    cr_expect_gt(STAT(f, udp_socket_drops), 0);
    fx_finish(f);
}
