/*
 * The bounded HTTP/1.x server of include/bucketd/http.h, on the ingest thread's uv loop.
 *
 * A connection goes through three states:
 *   READING  the request head is read into the connection's buffer (max_head_bytes) until the
 *            blank line that ends it; the deadline is the accept time + head_timeout_ms;
 *   WRITING  the response is being written; what the client still sends is read and discarded
 *            (so that closing does not reset the connection under the response); the deadline
 *            is the time the response was queued + write_timeout_ms;
 *   LINGER   the response is written and our side shut down: read and discard until the client
 *            closes too, LINGER_MS at most, then close.
 * One timer sweeps the deadlines, as tcp.c does for idle connections, so a connection holds one
 * handle and a read costs no timer update.
 *
 * Lifetime: every open handle counts in h->open_handles and its close callback decrements it;
 * the struct is freed once it has been released (bd_http_free) and no handle is left.
 */
#include "bucketd/http.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/log.h"

/* After the response: how long the client may take to close its side. */
#define LINGER_MS 1000
/* Longest time between two deadline sweeps. */
#define SWEEP_MAX_MS 250
/* Warnings about refused connections: a few every 10 s. */
#define WARN_BURST 3
#define WARN_INTERVAL_NS (10 * BD_NS_PER_S)

enum conn_state { ST_READING, ST_WRITING, ST_LINGER };

struct conn {
    uv_tcp_t tcp; /* tcp.data points back here */
    struct bd_http *h;
    struct conn *prev, *next; /* h->conns; unlinked once closing */
    enum conn_state state;
    bool closing;
    bool peer_eof;
    uint64_t deadline_ms; /* uv_now() */
    uv_write_t wr;
    uv_shutdown_t shut;
    char head[256]; /* the response's status line and headers */
    struct bd_http_response resp;
    size_t len; /* bytes of the request head in buf */
    size_t cap;
    char buf[];
};

struct rejected {
    uv_tcp_t tcp;
    struct bd_http *h;
};

struct bd_http {
    uv_loop_t *loop;
    char bind[128];
    struct bd_http_limits lim;
    const struct bd_http_route *routes;
    size_t n_routes;

    uv_tcp_t server;
    bool server_open;
    uv_timer_t sweep;
    bool sweep_open;

    struct conn *conns;
    uint32_t n_conns;
    struct bd_http_counters counters;
    struct bd_ratelimit rl;

    uint32_t open_handles;
    bool released;
};

const char *const bd_http_counter_codes[7] = {"200", "400", "404", "405", "408", "431", "5xx"};

void bd_http_default_limits(struct bd_http_limits *lim) {
    *lim = (struct bd_http_limits){.max_connections = 32,
                                   .max_head_bytes = 8192,
                                   .head_timeout_ms = 5000,
                                   .write_timeout_ms = 10000};
}

/* ---------------------------------------------------------------------------------------- */
/* Response bodies                                                                          */

static bool body_reserve(struct bd_http_response *r, size_t more) {
    if (r->oom) {
        return false;
    }
    if (r->len + more + 1 <= r->cap) {
        return true;
    }
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < r->len + more + 1) {
        cap *= 2;
    }
    char *p = realloc(r->body, cap);
    if (p == NULL) {
        r->oom = true;
        return false;
    }
    r->body = p;
    r->cap = cap;
    return true;
}

bool bd_http_body_append(struct bd_http_response *r, const char *s, size_t n) {
    if (!body_reserve(r, n)) {
        return false;
    }
    memcpy(r->body + r->len, s, n);
    r->len += n;
    r->body[r->len] = '\0';
    return true;
}

bool bd_http_body_printf(struct bd_http_response *r, const char *fmt, ...) {
    for (int pass = 0; pass < 2; pass++) {
        size_t room = r->cap > r->len ? r->cap - r->len : 0;
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(room ? r->body + r->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) {
            r->oom = true;
            return false;
        }
        if ((size_t)n < room) {
            r->len += (size_t)n;
            return true;
        }
        if (!body_reserve(r, (size_t)n)) {
            return false;
        }
    }
    r->oom = true; /* not reached: the second pass has the room */
    return false;
}

/* ---------------------------------------------------------------------------------------- */
/* Lifetime                                                                                 */

static void handle_closed(struct bd_http *h) {
    BD_ASSERT(h->open_handles > 0);
    h->open_handles--;
    if (h->open_handles == 0 && h->released) {
        free(h);
    }
}

static void on_own_handle_closed(uv_handle_t *handle) {
    handle_closed(handle->data);
}

static void on_conn_closed(uv_handle_t *handle) {
    struct conn *c = handle->data;
    struct bd_http *h = c->h;
    free(c->resp.body);
    free(c);
    handle_closed(h);
}

static void on_rejected_closed(uv_handle_t *handle) {
    struct rejected *r = handle->data;
    struct bd_http *h = r->h;
    free(r);
    handle_closed(h);
}

static void conn_close(struct conn *c) {
    if (c->closing) {
        return;
    }
    struct bd_http *h = c->h;
    c->closing = true;
    if (c->prev != NULL) {
        c->prev->next = c->next;
    } else {
        h->conns = c->next;
    }
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    c->prev = c->next = NULL;
    h->n_conns--;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

/* ---------------------------------------------------------------------------------------- */
/* Responses                                                                                */

static const char *reason_phrase(int status) {
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    default:
        return "Unknown";
    }
}

static void count_response(struct bd_http *h, int status) {
    static const int codes[] = {200, 400, 404, 405, 408, 431};
    for (size_t i = 0; i < BD_ARRAY_LEN(codes); i++) {
        if (codes[i] == status) {
            h->counters.responses[i]++;
            return;
        }
    }
    h->counters.responses[6]++;
}

static void on_shutdown(uv_shutdown_t *req, int status) {
    struct conn *c = req->data;
    if (c->closing) {
        return;
    }
    if (status < 0 || c->peer_eof) {
        conn_close(c);
        return;
    }
    c->state = ST_LINGER;
    c->deadline_ms = uv_now(c->h->loop) + LINGER_MS;
}

static void on_written(uv_write_t *req, int status) {
    struct conn *c = req->data;
    if (c->closing) {
        return;
    }
    c->shut.data = c;
    if (status < 0 || uv_shutdown(&c->shut, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        conn_close(c);
    }
}

/* Queue resp (already in c->resp) with its head; without the body when head_only. */
static void send_response(struct conn *c, bool head_only, const char *extra_headers) {
    struct bd_http *h = c->h;
    struct bd_http_response *r = &c->resp;
    if (r->oom) {
        r->status = 500;
        r->content_type = "text/plain; charset=utf-8";
        r->len = 0;
    }
    count_response(h, r->status);
    int n = snprintf(c->head, sizeof(c->head),
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
                     r->status, reason_phrase(r->status), r->content_type, r->len,
                     extra_headers != NULL ? extra_headers : "");
    BD_ASSERT(n > 0 && (size_t)n < sizeof(c->head));
    uv_buf_t bufs[2] = {uv_buf_init(c->head, (unsigned)n),
                        uv_buf_init(r->body != NULL ? r->body : c->head, (unsigned)r->len)};
    c->state = ST_WRITING;
    c->deadline_ms = uv_now(h->loop) + h->lim.write_timeout_ms;
    c->wr.data = c;
    int rc = uv_write(&c->wr, (uv_stream_t *)&c->tcp, bufs, head_only || r->len == 0 ? 1 : 2,
                      on_written);
    if (rc < 0) {
        conn_close(c);
    }
}

static void send_error(struct conn *c, int status, const char *extra_headers) {
    struct bd_http_response *r = &c->resp;
    r->status = status;
    r->content_type = "text/plain; charset=utf-8";
    r->len = 0;
    bd_http_body_printf(r, "%d %s\n", status, reason_phrase(status));
    send_response(c, false, extra_headers);
}

/* ---------------------------------------------------------------------------------------- */
/* Requests                                                                                 */

static bool is_tchar(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* The head is complete in c->buf[0, c->len): answer it. */
static void handle_request(struct conn *c) {
    struct bd_http *h = c->h;
    const char *line = c->buf;
    const char *eol = memchr(line, '\n', c->len);
    size_t n = (size_t)(eol - line);
    if (n > 0 && line[n - 1] == '\r') {
        n--;
    }
    /* METHOD SP request-target SP HTTP/1.x */
    const char *sp1 = memchr(line, ' ', n);
    const char *sp2 = sp1 != NULL ? memchr(sp1 + 1, ' ', n - (size_t)(sp1 + 1 - line)) : NULL;
    if (sp1 == NULL || sp2 == NULL || sp1 == line) {
        send_error(c, 400, NULL);
        return;
    }
    for (const char *p = line; p < sp1; p++) {
        if (!is_tchar(*p)) {
            send_error(c, 400, NULL);
            return;
        }
    }
    const char *target = sp1 + 1;
    size_t target_len = (size_t)(sp2 - target);
    const char *version = sp2 + 1;
    size_t version_len = n - (size_t)(version - line);
    if (target_len == 0 || target[0] != '/' || version_len != 8 ||
        memcmp(version, "HTTP/1.", 7) != 0 || (version[7] != '0' && version[7] != '1')) {
        send_error(c, 400, NULL);
        return;
    }
    const char *q = memchr(target, '?', target_len);
    size_t path_len = q != NULL ? (size_t)(q - target) : target_len;
    const struct bd_http_route *route = NULL;
    for (size_t i = 0; i < h->n_routes; i++) {
        if (strlen(h->routes[i].path) == path_len &&
            memcmp(h->routes[i].path, target, path_len) == 0) {
            route = &h->routes[i];
        }
    }
    if (route == NULL) {
        send_error(c, 404, NULL);
        return;
    }
    size_t method_len = (size_t)(sp1 - line);
    bool get = method_len == 3 && memcmp(line, "GET", 3) == 0;
    bool head = method_len == 4 && memcmp(line, "HEAD", 4) == 0;
    if (!get && !head) {
        send_error(c, 405, "Allow: GET, HEAD\r\n");
        return;
    }
    c->resp.status = 200;
    c->resp.content_type = "text/plain; charset=utf-8";
    struct bd_http_request req = {.query = q != NULL ? q + 1 : target + target_len,
                                  .query_len = q != NULL ? target_len - path_len - 1 : 0};
    route->fn(route->arg, &req, &c->resp);
    send_response(c, head, NULL);
}

/* The blank line that ends the head: "\r\n\r\n", or "\n\n" from a lax client. */
static bool head_complete(const struct conn *c, size_t from) {
    size_t start = from > 3 ? from - 3 : 0;
    for (size_t i = start; i < c->len; i++) {
        if (c->buf[i] != '\n') {
            continue;
        }
        if (i >= 1 && c->buf[i - 1] == '\n') {
            return true;
        }
        if (i >= 3 && c->buf[i - 1] == '\r' && c->buf[i - 2] == '\n' && c->buf[i - 3] == '\r') {
            return true;
        }
    }
    return false;
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
    struct conn *c = handle->data;
    (void)suggested;
    if (c->state == ST_READING) {
        *buf = uv_buf_init(c->buf + c->len, (unsigned)(c->cap - c->len));
    } else {
        *buf = uv_buf_init(c->buf, (unsigned)c->cap); /* discarded */
    }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
    struct conn *c = s->data;
    (void)buf;
    if (c->closing || nread == 0) {
        return;
    }
    if (nread < 0) {
        /* EOF or an error. Before the response: nothing to answer. While writing it: close
         * once it is written. After it: done. */
        c->peer_eof = true;
        uv_read_stop(s);
        if (c->state != ST_WRITING) {
            conn_close(c);
        }
        return;
    }
    if (c->state != ST_READING) {
        return;
    }
    size_t before = c->len;
    c->len += (size_t)nread;
    if (head_complete(c, before)) {
        handle_request(c);
    } else if (c->len == c->cap) {
        send_error(c, 431, NULL);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Connections                                                                              */

static void reject(struct bd_http *h, uv_stream_t *server) {
    static const char busy[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; "
                               "charset=utf-8\r\nContent-Length: 20\r\nConnection: close\r\n\r\n"
                               "too many connections";
    struct rejected *r = malloc(sizeof(*r));
    if (r == NULL) {
        return; /* it stays in the backlog until a connection closes */
    }
    r->h = h;
    uv_tcp_init(h->loop, &r->tcp); /* without an address family it cannot fail */
    r->tcp.data = r;
    h->open_handles++;
    if (uv_accept(server, (uv_stream_t *)&r->tcp) == 0) {
        uv_buf_t b = uv_buf_init((char *)busy, sizeof(busy) - 1);
        (void)uv_try_write((uv_stream_t *)&r->tcp, &b, 1);
    }
    h->counters.rejected++;
    if (bd_ratelimit_ok(&h->rl, (int64_t)uv_now(h->loop) * BD_NS_PER_MS)) {
        bd_warn("metrics %s: refusing a connection: %u open (the most it serves)", h->bind,
                h->lim.max_connections);
    }
    uv_close((uv_handle_t *)&r->tcp, on_rejected_closed);
}

static void on_connection(uv_stream_t *server, int status) {
    struct bd_http *h = server->data;
    if (status < 0) {
        return;
    }
    if (h->n_conns >= h->lim.max_connections) {
        reject(h, server);
        return;
    }
    struct conn *c = malloc(sizeof(*c) + h->lim.max_head_bytes);
    if (c == NULL) {
        reject(h, server);
        return;
    }
    memset(c, 0, sizeof(*c));
    c->h = h;
    c->cap = h->lim.max_head_bytes;
    uv_tcp_init(h->loop, &c->tcp);
    c->tcp.data = c;
    h->open_handles++;
    c->next = h->conns;
    if (h->conns != NULL) {
        h->conns->prev = c;
    }
    h->conns = c;
    h->n_conns++;
    c->state = ST_READING;
    c->deadline_ms = uv_now(h->loop) + h->lim.head_timeout_ms;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        conn_close(c);
        return;
    }
    h->counters.connections++;
}

static void on_sweep(uv_timer_t *t) {
    struct bd_http *h = t->data;
    uint64_t now = uv_now(h->loop);
    struct conn *next = NULL;
    for (struct conn *c = h->conns; c != NULL; c = next) {
        next = c->next;
        if (now < c->deadline_ms) {
            continue;
        }
        h->counters.timed_out++;
        if (c->state == ST_READING) {
            send_error(c, 408, NULL);
        } else {
            conn_close(c);
        }
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Public API                                                                               */

int bd_http_new(struct bd_http **out, uv_loop_t *loop, const char *bind,
                const struct sockaddr_storage *addr, const struct bd_http_limits *lim,
                const struct bd_http_route *routes, size_t n_routes, struct bd_err *err) {
    *out = NULL;
    struct bd_http *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        return bd_err_set(err, -ENOMEM, "metrics: out of memory");
    }
    h->loop = loop;
    snprintf(h->bind, sizeof(h->bind), "%s", bind);
    h->lim = *lim;
    h->routes = routes;
    h->n_routes = n_routes;
    h->rl = (struct bd_ratelimit){.interval_ns = WARN_INTERVAL_NS, .burst = WARN_BURST};

    int rc = uv_tcp_init_ex(loop, &h->server, addr->ss_family);
    if (rc < 0) {
        free(h);
        return bd_err_set(err, rc, "metrics.bind %s: %s", bind, uv_strerror(rc));
    }
    h->server.data = h;
    h->server_open = true;
    h->open_handles++;
    rc = uv_tcp_bind(&h->server, (const struct sockaddr *)addr, 0);
    if (rc == 0) {
        rc = uv_listen((uv_stream_t *)&h->server, 128, on_connection);
    }
    if (rc < 0) {
        bd_err_set(err, rc, "metrics.bind %s: %s", bind, uv_strerror(rc));
        bd_http_free(h);
        return rc;
    }
    uint64_t every =
        BD_MIN(BD_MAX(BD_MIN(lim->head_timeout_ms, lim->write_timeout_ms) / 4, (uint64_t)1),
               (uint64_t)SWEEP_MAX_MS);
    uv_timer_init(loop, &h->sweep);
    h->sweep.data = h;
    h->sweep_open = true;
    h->open_handles++;
    uv_unref((uv_handle_t *)&h->sweep);
    uv_timer_start(&h->sweep, on_sweep, every, every);
    *out = h;
    return 0;
}

void bd_http_free(struct bd_http *h) {
    if (h == NULL) {
        return;
    }
    while (h->conns != NULL) {
        conn_close(h->conns);
    }
    if (h->server_open) {
        uv_close((uv_handle_t *)&h->server, on_own_handle_closed);
        h->server_open = false;
    }
    if (h->sweep_open) {
        uv_close((uv_handle_t *)&h->sweep, on_own_handle_closed);
        h->sweep_open = false;
    }
    h->released = true;
    if (h->open_handles == 0) {
        free(h);
    }
}

int bd_http_port(const struct bd_http *h) {
    struct sockaddr_storage local;
    int len = sizeof(local);
    int rc = uv_tcp_getsockname(&h->server, (struct sockaddr *)&local, &len);
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

uint32_t bd_http_open_connections(const struct bd_http *h) {
    return h->n_conns;
}

const struct bd_http_counters *bd_http_counters(const struct bd_http *h) {
    return &h->counters;
}
