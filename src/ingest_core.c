/*
 * The ingest core: what every listener shares, under udp.c and tcp.c (src/ingest_int.h maps the
 * stage). It keeps the slots of listeners and the lifetime of every uv handle of the stage,
 * sets up a listener's parser and point, turns lines into parsed points for the sensor table
 * (counting and sampling the bad ones), counts and logs senders outside a listener's allow list,
 * and formats addresses for the logs. It calls nothing above it: the listeners call down into
 * it, and the owner of struct bd_ingest learns of its end only by having let go of it.
 *
 * Threads: the ingest thread only, the one that owns the uv loop.
 *
 * Ownership: struct bd_ingest owns an array of listener slots. A listener owns its uv handle,
 * one parser and one struct bd_point (heap: about 12 KiB), for UDP a receive slab, for TCP an
 * idle-sweep timer, its connections (tcp.c) and the per-source counts, for TLS a server
 * context; ingest_listener_release() frees them all once the handles have closed. Every open
 * uv handle counts in in->open_handles and its close callback decrements it; the struct is
 * destroyed when it has been released and no handle is left. Nothing here allocates per
 * datagram or per line.
 */
#include "ingest_core.h"

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

/* Bad-line samples: a few per listener every 10 s, whatever the input rate. */
#define SAMPLE_BURST 5
#define SAMPLE_INTERVAL_NS (10 * BD_NS_PER_S)
/* Bytes of an offending line quoted in a sample. */
#define SAMPLE_QUOTE 96

/* ---------------------------------------------------------------------------------------- */
/* Lifetimes                                                                                */

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
    BD_ASSERT(in->kstats == NULL); /* kstats.c frees it when its timer has closed */
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        ingest_listener_release(&in->listeners[i]);
    }
    free(in->listeners);
    for (int f = 0; f < 2; f++) {
        for (int p = 0; p < 4; p++) {
            if (in->hold_parser_ok[f][p]) {
                bd_parser_close(&in->hold_parsers[f][p]);
            }
        }
    }
    bd_spool_close(in->held_disk);
    bd_hold_free(in->hold);
    bd_hold_free(in->releasing);
    free(in->hold_point);
    free(in->held_dir);
    free(in);
}

void ingest_handle_opened(struct bd_ingest *in) {
    in->open_handles++;
}

void ingest_handle_closed(struct bd_ingest *in) {
    BD_ASSERT(in->open_handles > 0);
    in->open_handles--;
    if (in->open_handles == 0 && in->released) {
        destroy(in);
    }
}

void ingest_release(struct bd_ingest *in) {
    in->released = true;
    if (in->open_handles == 0) {
        destroy(in);
    }
}

void ingest_listener_maybe_free(struct listener *l) {
    if (l->in_use && !l->active && l->closing == 0 && !l->h_open && !l->sweep_open &&
        l->conns == NULL) {
        ingest_listener_release(l);
        l->in_use = false;
    }
}

static void on_listener_handle_closed(uv_handle_t *h) {
    struct listener *l = h->data;
    struct bd_ingest *in = l->in;
    BD_ASSERT(l->closing > 0);
    l->closing--;
    ingest_listener_maybe_free(l);
    ingest_handle_closed(in);
}

void ingest_listener_close_handle(struct listener *l, uv_handle_t *h) {
    l->closing++;
    uv_close(h, on_listener_handle_closed);
}

void ingest_listener_close_socket(struct listener *l) {
    if (l->h_open) {
        if (l->cfg.proto == BD_PROTO_UDP) {
            uv_udp_recv_stop(&l->h.udp);
        }
        ingest_listener_close_handle(l, &l->h.handle);
        l->h_open = false;
    }
}

int ingest_listener_init(struct bd_ingest *in, struct listener *l, uint32_t idx,
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
    return 0;
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
    if (in->holding) {
        /* The wall clock cannot be trusted yet: the line waits in the hold with the boot time of
         * its arrival, to be stamped and judged once it can (ingest_hold.c). */
        struct bd_hold_line held = {.format = (uint8_t)l->cfg.format,
                                    .precision = (uint8_t)l->cfg.precision,
                                    .kind = BD_HOLD_BOOT,
                                    .stamp_ns = bd_clock_boot_ns(in->clock),
                                    .line = line.ptr,
                                    .len = line.len};
        if (bd_hold_add(in->hold, &held) == 0) {
            BD_STAT_ADD(in->stats, readings_held, 1);
        } else {
            BD_STAT_ADD(in->stats, drop_clock_hold_full, 1);
        }
        BD_STAT_ADD(in->stats, lines, 1);
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
