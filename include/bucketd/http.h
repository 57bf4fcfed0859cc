/*
 * A small HTTP/1.x server on the ingest thread's uv loop, for /metrics, /healthz and /sensors:
 * GET and HEAD of a few known paths, one request per connection (the response says Connection:
 * close and the connection closes once it is written). Everything is bounded, so a hostile or broken
 * client costs the loop a few microseconds per event and never more memory than the limits:
 *
 *   max_connections   open connections at most; one more is accepted, answered 503 with a
 *                     single non-blocking write and closed at once;
 *   max_head_bytes    request line and headers together; a longer head is answered 431;
 *   head_timeout_ms   the whole head must arrive within this time of the accept, however
 *                     slowly it trickles in (slowloris): else 408;
 *   write_timeout_ms  a client that does not read its response is closed after this time.
 *
 * Unknown paths are answered 404, other methods 405 (with Allow: GET, HEAD), a request line
 * that is not HTTP/1.x 400. Each connection is one heap block of max_head_bytes plus its
 * response while it is written. Loop thread only.
 */
#ifndef BUCKETD_HTTP_H
#define BUCKETD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "bucketd/common.h"

struct bd_http;

struct bd_http_limits {
    uint32_t max_connections;
    uint32_t max_head_bytes;
    uint64_t head_timeout_ms;
    uint64_t write_timeout_ms;
};

/* The defaults: 32 connections, 8 KiB heads, 5 s for the head, 10 s for the response. */
void bd_http_default_limits(struct bd_http_limits *lim);

/*
 * What a route answers. The handler sets status (200, 503, ...), content_type (a static
 * string) and the body, which it writes with bd_http_body_printf/append; the server sends it
 * (without the body for HEAD) and frees it.
 */
struct bd_http_response {
    int status;
    const char *content_type;
    char *body;
    size_t len, cap;
    bool oom; /* an append failed: the server answers 500 */
};

/* Append to the body (grown as needed); false (and oom set) when memory ran out. */
bool bd_http_body_append(struct bd_http_response *r, const char *s, size_t n);
bool bd_http_body_printf(struct bd_http_response *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* What a handler is told of the request: its query string, the text after the first '?' of
 * the request target as sent (not decoded; query_len 0 without one), within max_head_bytes. */
struct bd_http_request {
    const char *query;
    size_t query_len;
};

typedef void (*bd_http_handler)(void *arg, const struct bd_http_request *req,
                                struct bd_http_response *resp);

struct bd_http_route {
    const char *path; /* "/metrics": matched without the query string ("?..."), which is the
                       * handler's to read or ignore */
    bd_http_handler fn;
    void *arg;
};

/* What the server did since it started, by outcome (for /metrics). */
struct bd_http_counters {
    uint64_t connections;  /* accepted and served */
    uint64_t rejected;     /* past max_connections: 503 and closed */
    uint64_t responses[7]; /* by status: 200, 400, 404, 405, 408, 431, 5xx */
    uint64_t timed_out;    /* closed by a deadline (head: 408; response not read) */
};
/* The statuses of bd_http_counters.responses, in order ("5xx": 500 and 503). */
extern const char *const bd_http_counter_codes[7];

/*
 * Listen on addr (bind is its text, for messages) and serve routes[0..n_routes), which must
 * outlive the server. Errors name the bind.
 */
int bd_http_new(struct bd_http **out, uv_loop_t *loop, const char *bind,
                const struct sockaddr_storage *addr, const struct bd_http_limits *lim,
                const struct bd_http_route *routes, size_t n_routes, struct bd_err *err);

/*
 * Close the listener and every connection. The memory goes with the last close callback: run
 * the loop before uv_loop_close(). bd_http_free(NULL) is a no-op.
 */
void bd_http_free(struct bd_http *h);

/* The bound port (useful with "host:0"), or a negative errno. */
int bd_http_port(const struct bd_http *h);
/* Connections open now. */
uint32_t bd_http_open_connections(const struct bd_http *h);
const struct bd_http_counters *bd_http_counters(const struct bd_http *h);

#endif
