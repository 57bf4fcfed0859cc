/*
 * bucketd-inspect top: scrapes a running daemon's /metrics every interval and shows what an
 * operator on a gateway asks first: how fast readings arrive (per protocol and listener), what
 * is dropped and why, how full the buffer pool and the spool are, whether MongoDB answers and
 * how fast, and how many sensors are tracked. Rates are the differences between two scrapes
 * divided by the time between them, as Prometheus's rate() over the same window.
 *
 * Two ways out: on a terminal a screen redrawn in place (ANSI escapes, the alternate screen,
 * the terminal in non-canonical no-echo mode so that a single 'q' quits), restored on every
 * exit, including SIGINT, SIGTERM and SIGHUP; otherwise (or --once) plain text, one snapshot
 * per interval, the first after two scrapes.
 *
 * The endpoint is reached with a plain blocking-free HTTP/1.1 GET (poll with a deadline; the
 * daemon answers with Content-Length and closes). Everything the endpoint sends is untrusted
 * text: label values are shown with every byte outside printable ASCII replaced, so a metrics
 * port that is not bucketd's cannot drive the terminal.
 *
 * Single-threaded; every buffer belongs to the struct view of bd_top_run.
 */
#include "inspect_top.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "bucketd/common.h"
#include "bucketd/units.h"

#define EXIT_USAGE 2
/* The daemon's whole exposition is a few tens of KiB; anything far larger is not bucketd. */
#define MAX_BODY (8 * 1024 * 1024)
/* A scrape slower than this is reported as an error (the daemon answers in milliseconds). */
#define MIN_SCRAPE_TIMEOUT_MS 2000

/* ---- Samples ------------------------------------------------------------------------------ */

struct sample {
    const char *name;   /* into scrape.text */
    const char *labels; /* k="v",... as sent without the braces, or "" */
    double value;
};

struct scrape {
    char *text; /* the body, cut into names and labels in place */
    struct sample *s;
    size_t n, cap;
    int64_t mono_ns; /* when the reply arrived */
};

static void scrape_clear(struct scrape *sc) {
    free(sc->text);
    free(sc->s);
    *sc = (struct scrape){0};
}

/* Parses the Prometheus text format in place: comments and blank lines skipped, a sample line
 * is NAME[{LABELS}] VALUE [TIMESTAMP]. Lines that do not parse are skipped. */
static int scrape_parse(struct scrape *sc) {
    char *p = sc->text;
    while (*p != '\0') {
        char *eol = strchr(p, '\n');
        char *next = eol != NULL ? eol + 1 : p + strlen(p);
        if (eol != NULL) {
            *eol = '\0';
        }
        char *q = p;
        if (*q == '#' || *q == '\0') {
            p = next;
            continue;
        }
        const char *name = q;
        while (*q != '\0' && *q != '{' && *q != ' ' && *q != '\t') {
            q++;
        }
        const char *labels = "";
        if (*q == '{') {
            /* Labels are kept without their braces: k="v",k2="v2". */
            *q++ = '\0';
            labels = q;
            bool quoted = false;
            for (; *q != '\0'; q++) {
                if (quoted && *q == '\\' && q[1] != '\0') {
                    q++;
                } else if (*q == '"') {
                    quoted = !quoted;
                } else if (!quoted && *q == '}') {
                    break;
                }
            }
            if (*q != '}') {
                p = next;
                continue;
            }
            *q++ = '\0';
        } else if (*q != '\0') {
            *q++ = '\0';
        } else {
            p = next;
            continue;
        }
        while (*q == ' ' || *q == '\t') {
            q++;
        }
        char *end = NULL;
        double v = strtod(q, &end);
        if (end == q || (*end != '\0' && *end != ' ' && *end != '\t' && *end != '\r')) {
            p = next;
            continue;
        }
        if (sc->n == sc->cap) {
            size_t cap = sc->cap != 0 ? sc->cap * 2 : 256;
            struct sample *s = realloc(sc->s, cap * sizeof(*s));
            if (s == NULL) {
                return -ENOMEM;
            }
            sc->s = s;
            sc->cap = cap;
        }
        sc->s[sc->n++] = (struct sample){.name = name, .labels = labels, .value = v};
        p = next;
    }
    return 0;
}

/* The value of name{labels}: labels as the daemon writes them, without braces ("" for none). */
static bool get(const struct scrape *sc, const char *name, const char *labels, double *out) {
    if (sc == NULL || sc->text == NULL) {
        return false;
    }
    for (size_t i = 0; i < sc->n; i++) {
        if (strcmp(sc->s[i].name, name) == 0 && strcmp(sc->s[i].labels, labels) == 0) {
            *out = sc->s[i].value;
            return true;
        }
    }
    return false;
}

/* The value of label key in a label set (k="v",...), unescaped, every byte outside printable ASCII
 * shown as '?'. False if absent. */
static bool label(const char *labels, const char *key, char *out, size_t cap) {
    size_t kl = strlen(key);
    const char *p = labels;
    while (*p != '\0') {
        const char *k = p;
        while (*p != '\0' && *p != '=') {
            p++;
        }
        if (*p != '=' || p[1] != '"') {
            return false;
        }
        bool match = (size_t)(p - k) == kl && memcmp(k, key, kl) == 0;
        size_t n = 0;
        for (p += 2; *p != '\0' && *p != '"'; p++) {
            char c = *p;
            if (c == '\\' && p[1] != '\0') {
                c = *++p == 'n' ? '?' : *p;
            }
            if (match && n + 1 < cap) {
                out[n++] = (c >= 0x20 && c < 0x7f) ? c : '?';
            }
        }
        if (match) {
            out[n] = '\0';
            return true;
        }
        if (*p == '"') {
            p++;
        }
        if (*p == ',') {
            p++;
        }
    }
    return false;
}

/* ---- Fetching ----------------------------------------------------------------------------- */

struct target {
    char host[256];
    char port[16];
    char path[256];
    char shown[600]; /* http://host:port/path */
};

static int parse_target(const char *s, struct target *t, struct bd_err *err) {
    const char *p = s;
    if (strncmp(p, "http://", 7) == 0) {
        p += 7;
    } else if (strstr(p, "://") != NULL) {
        return bd_err_set(err, -EINVAL, "--metrics: '%s': only http:// is supported", s);
    }
    const char *slash = strchr(p, '/');
    size_t hp_len = slash != NULL ? (size_t)(slash - p) : strlen(p);
    const char *path = slash != NULL ? slash : "/metrics";
    const char *colon = NULL;
    const char *host = p;
    size_t host_len = 0;
    if (*p == '[') {
        const char *rb = memchr(p, ']', hp_len);
        if (rb == NULL || rb + 1 >= p + hp_len || rb[1] != ':') {
            return bd_err_set(err, -EINVAL, "--metrics: '%s': expected [v6-address]:port", s);
        }
        host = p + 1;
        host_len = (size_t)(rb - host);
        colon = rb + 1;
    } else {
        for (const char *c = p; c < p + hp_len; c++) {
            if (*c == ':') {
                colon = c;
            }
        }
        if (colon == NULL) {
            return bd_err_set(err, -EINVAL, "--metrics: '%s': expected HOST:PORT or a URL", s);
        }
        host_len = (size_t)(colon - p);
    }
    size_t port_len = (size_t)(p + hp_len - colon - 1);
    uint64_t port = 0;
    char portbuf[16];
    if (host_len == 0 || host_len >= sizeof(t->host) || port_len == 0 ||
        port_len >= sizeof(portbuf)) {
        return bd_err_set(err, -EINVAL, "--metrics: '%s': expected HOST:PORT or a URL", s);
    }
    memcpy(portbuf, colon + 1, port_len);
    portbuf[port_len] = '\0';
    if (bd_units_parse_uint(portbuf, &port) < 0 || port == 0 || port > 65535) {
        return bd_err_set(err, -EINVAL, "--metrics: '%s': bad port '%s'", s, portbuf);
    }
    if (strlen(path) >= sizeof(t->path)) {
        return bd_err_set(err, -EINVAL, "--metrics: '%s': path too long", s);
    }
    for (const char *c = path; *c != '\0'; c++) {
        if (*c <= 0x20 || *c >= 0x7f) {
            return bd_err_set(err, -EINVAL, "--metrics: '%s': bad character in the path", s);
        }
    }
    memcpy(t->host, host, host_len);
    t->host[host_len] = '\0';
    snprintf(t->port, sizeof(t->port), "%" PRIu64, port);
    snprintf(t->path, sizeof(t->path), "%s", path);
    /* A daemon listening on every address is asked on loopback. */
    if (strcmp(t->host, "0.0.0.0") == 0) {
        snprintf(t->host, sizeof(t->host), "127.0.0.1");
    } else if (strcmp(t->host, "::") == 0) {
        snprintf(t->host, sizeof(t->host), "::1");
    }
    bool v6 = strchr(t->host, ':') != NULL;
    snprintf(t->shown, sizeof(t->shown), "http://%s%s%s:%s%s", v6 ? "[" : "", t->host,
             v6 ? "]" : "", t->port, t->path);
    return 0;
}

/* Set from the signal handlers; the loop and every wait check them. */
static volatile sig_atomic_t stop_signal;
static volatile sig_atomic_t resized;

static void on_stop(int sig) {
    stop_signal = sig;
}

static void on_winch(int sig) {
    resized = 1;
}

/* Reads what the keyboard sent; true if it asks to quit. */
static bool quit_key(int key_fd) {
    char buf[64];
    ssize_t n = read(key_fd, buf, sizeof(buf));
    for (ssize_t i = 0; i < n; i++) {
        if (buf[i] == 'q' || buf[i] == 'Q') {
            return true;
        }
    }
    return false;
}

/*
 * Waits until fd (may be -1) is ready for events, the deadline passes (0), the key fd (may be
 * -1) sends 'q' (-ECANCELED) or a stop signal arrives (-EINTR). A window resize returns
 * -EAGAIN when resize_wakes, so that the screen is drawn again at once.
 */
static int wait_ready(int fd, short events, int64_t deadline_ns, int key_fd, bool resize_wakes) {
    for (;;) {
        if (stop_signal != 0) {
            return -EINTR;
        }
        if (resize_wakes && resized) {
            return -EAGAIN;
        }
        int64_t left = deadline_ns - bd_mono_ns();
        if (left <= 0) {
            return 0;
        }
        struct pollfd pf[2];
        nfds_t n = 0;
        int fd_at = -1, key_at = -1;
        if (fd >= 0) {
            pf[n] = (struct pollfd){.fd = fd, .events = events};
            fd_at = (int)n++;
        }
        if (key_fd >= 0) {
            pf[n] = (struct pollfd){.fd = key_fd, .events = POLLIN};
            key_at = (int)n++;
        }
        int ms = (int)((left + 999999) / 1000000);
        int r = poll(pf, n, ms);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (key_at >= 0 && (pf[key_at].revents & (POLLIN | POLLHUP))) {
            if (quit_key(key_fd)) {
                return -ECANCELED;
            }
            if (pf[key_at].revents & POLLHUP) {
                key_fd = -1;
            }
        }
        if (fd_at >= 0 && pf[fd_at].revents != 0) {
            return 1;
        }
    }
}

/* One GET of the target into *body (NUL-terminated). 0, or a negative errno with err set;
 * -ECANCELED and -EINTR as wait_ready. */
static int fetch(const struct target *t, int64_t timeout_ms, int key_fd, char **body,
                 struct bd_err *err) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int fd = -1;
    int rc = 0;
    int64_t deadline = bd_mono_ns() + timeout_ms * 1000000;

    *body = NULL;
    int g = getaddrinfo(t->host, t->port, &hints, &ai);
    if (g != 0) {
        rc = bd_err_set(err, -EHOSTUNREACH, "cannot reach %s: %s", t->shown, gai_strerror(g));
        goto out;
    }
    fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        rc = bd_err_set(err, -errno, "cannot reach %s: socket: %s", t->shown, strerror(errno));
        goto out;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
        rc = bd_err_set(err, -errno, "cannot reach %s: %s", t->shown, strerror(errno));
        goto out;
    }
    rc = wait_ready(fd, POLLOUT, deadline, key_fd, false);
    if (rc <= 0) {
        rc = rc == 0 ? bd_err_set(err, -ETIMEDOUT,
                                  "cannot reach %s: no connection within %" PRId64 " ms", t->shown,
                                  timeout_ms)
                     : rc;
        goto out;
    }
    int soerr = 0;
    socklen_t sl = sizeof(soerr);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 || soerr != 0) {
        soerr = soerr != 0 ? soerr : errno;
        rc = bd_err_set(err, -soerr, "cannot reach %s: %s", t->shown, strerror(soerr));
        goto out;
    }
    char req[1024];
    bool v6 = strchr(t->host, ':') != NULL;
    int rl = snprintf(req, sizeof(req),
                      "GET %s HTTP/1.1\r\nHost: %s%s%s:%s\r\nUser-Agent: bucketd-inspect/%s\r\n"
                      "Accept: text/plain\r\nConnection: close\r\n\r\n",
                      t->path, v6 ? "[" : "", t->host, v6 ? "]" : "", t->port, BD_VERSION);
    size_t sent = 0;
    while (sent < (size_t)rl) {
        ssize_t w = send(fd, req + sent, (size_t)rl - sent, MSG_NOSIGNAL);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            rc = bd_err_set(err, -errno, "%s: sending the request: %s", t->shown, strerror(errno));
            goto out;
        }
        if (w > 0) {
            sent += (size_t)w;
            continue;
        }
        rc = wait_ready(fd, POLLOUT, deadline, key_fd, false);
        if (rc <= 0) {
            rc = rc == 0
                     ? bd_err_set(err, -ETIMEDOUT, "%s: request not taken within %" PRId64 " ms",
                                  t->shown, timeout_ms)
                     : rc;
            goto out;
        }
    }
    for (;;) {
        if (cap - len < 4096) {
            size_t ncap = cap != 0 ? cap * 2 : 65536;
            char *nb = realloc(buf, ncap + 1);
            if (nb == NULL) {
                rc = bd_err_set(err, -ENOMEM, "out of memory");
                goto out;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t r = recv(fd, buf + len, cap - len, 0);
        if (r > 0) {
            len += (size_t)r;
            if (len > MAX_BODY) {
                rc = bd_err_set(err, -EFBIG, "%s: reply larger than %d bytes: not bucketd?",
                                t->shown, MAX_BODY);
                goto out;
            }
            continue;
        }
        if (r == 0) {
            break;
        }
        if (errno != EAGAIN && errno != EINTR) {
            rc = bd_err_set(err, -errno, "%s: reading the reply: %s", t->shown, strerror(errno));
            goto out;
        }
        rc = wait_ready(fd, POLLIN, deadline, key_fd, false);
        if (rc <= 0) {
            rc = rc == 0
                     ? bd_err_set(err, -ETIMEDOUT, "%s: no complete reply within %" PRId64 " ms",
                                  t->shown, timeout_ms)
                     : rc;
            goto out;
        }
    }
    if (buf == NULL) {
        rc = bd_err_set(err, -EPROTO, "%s: connection closed without a reply", t->shown);
        goto out;
    }
    buf[len] = '\0';
    /* Status line, then the headers up to the blank line. */
    int status = 0;
    char *hdr_end = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) != 0 || sscanf(buf + 8, " %3d", &status) != 1 ||
        hdr_end == NULL) {
        rc = bd_err_set(err, -EPROTO, "%s: not an HTTP reply", t->shown);
        goto out;
    }
    if (status != 200) {
        char *eol = strstr(buf, "\r\n");
        *eol = '\0';
        for (char *c = buf; *c != '\0'; c++) {
            *c = (*c >= 0x20 && *c < 0x7f) ? *c : '?';
        }
        rc = bd_err_set(err, -EPROTO, "%s: %.200s", t->shown, buf);
        goto out;
    }
    *hdr_end = '\0';
    for (char *h = buf; (h = strchr(h, '\n')) != NULL; h++) {
        if (strncasecmp(h + 1, "transfer-encoding:", 18) == 0) {
            rc = bd_err_set(err, -EPROTO, "%s: a chunked reply: not bucketd?", t->shown);
            goto out;
        }
    }
    char *start = hdr_end + 4;
    memmove(buf, start, len - (size_t)(start - buf) + 1);
    *body = buf;
    buf = NULL;
    rc = 0;
out:
    free(buf);
    if (fd >= 0) {
        close(fd);
    }
    if (ai != NULL) {
        freeaddrinfo(ai);
    }
    return rc;
}

/* ---- Formatting --------------------------------------------------------------------------- */

struct text {
    char *buf;
    size_t len, cap;
};

static void put(struct text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct text *t, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = t->cap - t->len;
        int n = vsnprintf(t->buf != NULL ? t->buf + t->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) {
            return;
        }
        if ((size_t)n < room) {
            t->len += (size_t)n;
            return;
        }
        size_t ncap = BD_MAX(t->cap * 2, t->len + (size_t)n + 256);
        char *nb = realloc(t->buf, ncap);
        if (nb == NULL) {
            return; /* a shorter screen rather than none */
        }
        t->buf = nb;
        t->cap = ncap;
    }
}

/* A count or a rate: 950, 12.3k, 4.56M; "-" when unknown. */
static const char *fmt_num(char *b, size_t cap, bool known, double v) {
    if (!known || !isfinite(v)) {
        snprintf(b, cap, "-");
    } else if (fabs(v) >= 1e9) {
        snprintf(b, cap, "%.2fG", v / 1e9);
    } else if (fabs(v) >= 1e6) {
        snprintf(b, cap, "%.2fM", v / 1e6);
    } else if (fabs(v) >= 1e4) {
        snprintf(b, cap, "%.1fk", v / 1e3);
    } else if (v == floor(v)) {
        snprintf(b, cap, "%.0f", v);
    } else {
        snprintf(b, cap, "%.1f", v);
    }
    return b;
}

static const char *fmt_bytes(char *b, size_t cap, bool known, double v) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    if (!known || !isfinite(v)) {
        snprintf(b, cap, "-");
        return b;
    }
    size_t u = 0;
    while (fabs(v) >= 1024 && u + 1 < BD_ARRAY_LEN(unit)) {
        v /= 1024;
        u++;
    }
    snprintf(b, cap, u == 0 ? "%.0f %s" : "%.1f %s", v, unit[u]);
    return b;
}

/* Seconds as 850ms, 4.2s, 3m05s, 2h10m, 3d04h. */
static const char *fmt_secs(char *b, size_t cap, bool known, double s) {
    if (!known || !isfinite(s) || s < 0) {
        snprintf(b, cap, "-");
    } else if (s == 0) {
        snprintf(b, cap, "0s");
    } else if (s < 0.001) {
        snprintf(b, cap, "%.0fus", s * 1e6);
    } else if (s < 1) {
        snprintf(b, cap, "%.3gms", s * 1e3);
    } else if (s < 60) {
        snprintf(b, cap, "%.1fs", s);
    } else if (s < 3600) {
        snprintf(b, cap, "%dm%02ds", (int)(s / 60), (int)fmod(s, 60));
    } else if (s < 86400) {
        snprintf(b, cap, "%dh%02dm", (int)(s / 3600), (int)fmod(s / 60, 60));
    } else {
        snprintf(b, cap, "%dd%02dh", (int)(s / 86400), (int)fmod(s / 3600, 24));
    }
    return b;
}

/* ---- The view ----------------------------------------------------------------------------- */

struct view {
    struct target target;
    uint64_t interval_ms;
    bool live;
    struct scrape prev, cur; /* cur.text == NULL: no scrape has succeeded yet */
    bool have_prev;          /* prev is from the same daemon run as cur */
    char error[600];         /* the last scrape's failure, "" after a success */
    int64_t error_since_ns;
    int64_t retry_seen_ns; /* when bulk_retries_total was last seen rising; 0 never */
};

/* The per-second rate of counter name{labels} over the last interval. */
static bool rate(const struct view *v, const char *name, const char *labels, double *out) {
    double a, b;
    if (!v->have_prev || !get(&v->prev, name, labels, &a) || !get(&v->cur, name, labels, &b) ||
        b < a) {
        return false;
    }
    double dt = (double)(v->cur.mono_ns - v->prev.mono_ns) / 1e9;
    if (dt <= 0) {
        return false;
    }
    *out = (b - a) / dt;
    return true;
}

/* One "label  rate/s  total" row of a counter. */
static void counter_row(struct text *t, const struct view *v, const char *what, const char *name,
                        const char *labels, bool bytes) {
    double r = 0, total = 0;
    bool hr = rate(v, name, labels, &r);
    bool ht = get(&v->cur, name, labels, &total);
    char rb[32], tb[32];
    if (bytes) {
        fmt_bytes(rb, sizeof(rb), hr, r);
        fmt_bytes(tb, sizeof(tb), ht, total);
    } else {
        fmt_num(rb, sizeof(rb), hr, r);
        fmt_num(tb, sizeof(tb), ht, total);
    }
    put(t, "  %-28s %12s %14s\n", what, rb, tb);
}

/*
 * The q-quantile of a histogram from its cumulative bucket counts (the counts since start, or
 * their growth over the interval when prev is given), interpolated linearly inside the bucket
 * as Prometheus's histogram_quantile() does. False without observations.
 */
static bool quantile(const struct scrape *cur, const struct scrape *prev, const char *bucket_name,
                     double q, double *out) {
    double le_prev = 0, cnt_prev = 0, total = 0;
    char le[64];
    /* The daemon writes the buckets in increasing le, +Inf last. */
    for (size_t i = 0; i < cur->n; i++) {
        if (strcmp(cur->s[i].name, bucket_name) == 0 &&
            label(cur->s[i].labels, "le", le, sizeof(le))) {
            double c = cur->s[i].value, p = 0;
            if (prev != NULL && !get(prev, bucket_name, cur->s[i].labels, &p)) {
                return false;
            }
            total = c - p;
        }
    }
    if (!(total > 0)) {
        return false;
    }
    double rank = q * total;
    for (size_t i = 0; i < cur->n; i++) {
        if (strcmp(cur->s[i].name, bucket_name) != 0 ||
            !label(cur->s[i].labels, "le", le, sizeof(le))) {
            continue;
        }
        double upper = strtod(le, NULL);
        double c = cur->s[i].value, p = 0;
        if (prev != NULL) {
            get(prev, bucket_name, cur->s[i].labels, &p);
        }
        double cnt = c - p;
        if (cnt >= rank) {
            if (isinf(upper)) {
                *out = le_prev; /* beyond the last bound: the bound, as Prometheus does */
            } else if (cnt > cnt_prev) {
                *out = le_prev + (upper - le_prev) * (rank - cnt_prev) / (cnt - cnt_prev);
            } else {
                *out = upper;
            }
            return true;
        }
        le_prev = upper;
        cnt_prev = cnt;
    }
    return false;
}

static void section_ingest(struct text *t, const struct view *v) {
    put(t, "INGEST                              per second          total\n");
    counter_row(t, v, "readings accepted", "bucketd_readings_accepted_total", "", false);
    counter_row(t, v, "lines", "bucketd_lines_total", "", false);
    counter_row(t, v, "udp datagrams", "bucketd_udp_datagrams_total", "", false);
    counter_row(t, v, "udp bytes", "bucketd_udp_bytes_total", "", true);
    counter_row(t, v, "tcp bytes", "bucketd_tcp_bytes_total", "", true);
    counter_row(t, v, "tcp connections accepted", "bucketd_tcp_connections_total", "", false);
    counter_row(t, v, "readings written", "bucketd_readings_flushed_total", "", false);

    /* Per listener: what the daemon counts per socket (connections, refused senders). */
    bool any = false;
    for (size_t i = 0; i < v->cur.n; i++) {
        const struct sample *s = &v->cur.s[i];
        if (strcmp(s->name, "bucketd_listener_info") != 0) {
            continue;
        }
        if (!any) {
            put(t, "LISTENERS\n");
            any = true;
        }
        char proto[16] = "?", bind[160] = "?", format[32] = "?";
        label(s->labels, "proto", proto, sizeof(proto));
        label(s->labels, "bind", bind, sizeof(bind));
        label(s->labels, "format", format, sizeof(format));
        /* The per-listener series carry {proto,bind} in this order. */
        char key[256], b1[32], b2[32];
        snprintf(key, sizeof(key), "proto=\"%s\",bind=\"%s\"", proto, bind);
        double conns = 0, refused = 0;
        bool hc = get(&v->cur, "bucketd_listener_connections", key, &conns);
        bool hr = rate(v, "bucketd_listener_drop_not_allowed_total", key, &refused);
        char line[256];
        int n = snprintf(line, sizeof(line), "  %-4s %-24s %-9s", proto, bind, format);
        if (hc && n > 0 && (size_t)n < sizeof(line)) {
            n += snprintf(line + n, sizeof(line) - (size_t)n, " %s connections",
                          fmt_num(b1, sizeof(b1), true, conns));
        }
        if (n > 0 && (size_t)n < sizeof(line)) {
            snprintf(line + n, sizeof(line) - (size_t)n, "  not allowed %s/s",
                     fmt_num(b2, sizeof(b2), hr, refused));
        }
        put(t, "%s\n", line);
    }
}

static void section_drops(struct text *t, const struct view *v) {
    put(t, "DROPPED                             per second          total\n");
    int shown = 0;
    for (size_t i = 0; i < v->cur.n; i++) {
        const struct sample *s = &v->cur.s[i];
        if (strcmp(s->name, "bucketd_dropped_total") != 0) {
            continue;
        }
        double r = 0;
        bool hr = rate(v, s->name, s->labels, &r);
        if (s->value == 0 && !(hr && r > 0)) {
            continue;
        }
        char reason[64] = "?";
        label(s->labels, "reason", reason, sizeof(reason));
        counter_row(t, v, reason, s->name, s->labels, false);
        shown++;
    }
    static const struct {
        const char *what, *name;
    } more[] = {
        {"udp socket (kernel)", "bucketd_udp_socket_drops_total"},
        {"udp truncated", "bucketd_udp_truncated_total"},
        {"string fields", "bucketd_string_fields_dropped_total"},
        {"spool full (readings)", "bucketd_spool_dropped_readings_total"},
        {"quarantined (readings)", "bucketd_readings_quarantined_total"},
        {"lost at a stop", "bucketd_readings_lost_total"},
    };
    for (size_t k = 0; k < BD_ARRAY_LEN(more); k++) {
        double total = 0;
        if (get(&v->cur, more[k].name, "", &total) && total > 0) {
            counter_row(t, v, more[k].what, more[k].name, "", false);
            shown++;
        }
    }
    if (shown == 0) {
        put(t, "  none\n");
    }
}

static void section_pool_spool(struct text *t, const struct view *v) {
    double used = 0, segs = 0, high = 0, segb = 0, batches = 0, pend = 0, oldest = 0;
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    bool hu = get(&v->cur, "bucketd_pool_segments_in_use", "", &used);
    bool hs = get(&v->cur, "bucketd_pool_segments", "", &segs) && segs > 0;
    bool hh = get(&v->cur, "bucketd_pool_segments_high_water", "", &high);
    bool hb = get(&v->cur, "bucketd_pool_segment_bytes", "", &segb);
    put(t, "BUFFER POOL  %s of %s segments in use (%s), high water %s, %s each\n",
        fmt_num(b1, sizeof(b1), hu, used), fmt_num(b2, sizeof(b2), hs, segs),
        hu && hs ? (snprintf(b3, sizeof(b3), "%.1f%%", 100 * used / segs), b3) : "-",
        fmt_num(b4, sizeof(b4), hh, high), fmt_bytes(b5, sizeof(b5), hb, segb));
    bool hbt = get(&v->cur, "bucketd_pending_batches", "", &batches);
    bool hp = get(&v->cur, "bucketd_pending_readings", "", &pend);
    bool ho = get(&v->cur, "bucketd_oldest_pending_age_seconds", "", &oldest);
    put(t, "             pending: %s batches, %s readings, oldest %s\n",
        fmt_num(b1, sizeof(b1), hbt, batches), fmt_num(b2, sizeof(b2), hp, pend),
        fmt_secs(b3, sizeof(b3), ho, oldest));

    double bytes = 0, nseg = 0, max = 0, readings = 0;
    bool hby = get(&v->cur, "bucketd_spool_bytes", "", &bytes);
    bool hn = get(&v->cur, "bucketd_spool_segments", "", &nseg);
    bool hm = get(&v->cur, "bucketd_spool_max_bytes", "", &max) && max > 0;
    bool hr = get(&v->cur, "bucketd_spool_readings", "", &readings);
    char pct[32] = "-";
    if (hby && hm) {
        snprintf(pct, sizeof(pct), "%.1f%%", 100 * bytes / max);
    }
    put(t, "SPOOL        %s in %s segments (%s of %s), %s readings waiting\n",
        fmt_bytes(b1, sizeof(b1), hby, bytes), fmt_num(b2, sizeof(b2), hn, nseg), pct,
        fmt_bytes(b3, sizeof(b3), hm, max), fmt_num(b4, sizeof(b4), hr, readings));
    double in = 0, out = 0;
    bool hi = rate(v, "bucketd_readings_spooled_total", "", &in);
    bool hot = rate(v, "bucketd_spool_records_replayed_total", "", &out);
    put(t, "             spooled %s readings/s, replayed %s records/s\n",
        fmt_num(b1, sizeof(b1), hi, in), fmt_num(b2, sizeof(b2), hot, out));
}

static void section_mongodb(struct text *t, struct view *v) {
    char b1[32], b2[32], b3[32], b4[32];
    double reach = 0, down = 0, since = 0, healthy = 0;
    bool hre = get(&v->cur, "bucketd_mongodb_reachable", "", &reach);
    bool hd = get(&v->cur, "bucketd_mongodb_unreachable_seconds", "", &down);
    bool hs = get(&v->cur, "bucketd_seconds_since_last_successful_write", "", &since);
    bool hh = get(&v->cur, "bucketd_healthy", "", &healthy);
    const char *state = !hre ? "state unknown" : reach != 0 ? "reachable" : "UNREACHABLE";
    char downs[64] = "";
    if (hre && reach == 0 && hd) {
        snprintf(downs, sizeof(downs), " for %s", fmt_secs(b1, sizeof(b1), true, down));
    }
    put(t, "MONGODB      %s%s, last successful write %s ago, /healthz %s\n", state, downs,
        fmt_secs(b2, sizeof(b2), hs, since),
        !hh            ? "-"
        : healthy != 0 ? "healthy"
                       : "UNHEALTHY");
    double w = 0, u = 0, r = 0;
    bool hw = rate(v, "bucketd_bulk_writes_total", "", &w);
    bool hu = rate(v, "bucketd_updates_sent_total", "", &u);
    bool hr = rate(v, "bucketd_bulk_retries_total", "", &r);
    if (hr && r > 0) {
        v->retry_seen_ns = v->cur.mono_ns;
    }
    char seen[64] = "none seen";
    if (v->retry_seen_ns != 0) {
        snprintf(seen, sizeof(seen), "last seen %s ago",
                 fmt_secs(b4, sizeof(b4), true, (double)(bd_mono_ns() - v->retry_seen_ns) / 1e9));
    }
    put(t, "             %s bulk writes/s, %s updates/s, failed writes %s/s (%s)\n",
        fmt_num(b1, sizeof(b1), hw, w), fmt_num(b2, sizeof(b2), hu, u),
        fmt_num(b3, sizeof(b3), hr, r), seen);

    static const char hist[] = "bucketd_bulk_write_duration_seconds_bucket";
    const struct scrape *prev = v->have_prev ? &v->prev : NULL;
    double p50, p90, p99, n = 0, sum = 0, n0 = 0, sum0 = 0;
    const char *over = "this interval";
    if (prev == NULL || !quantile(&v->cur, prev, hist, 0.5, &p50)) {
        prev = NULL;
        over = "since start";
    }
    bool ok = quantile(&v->cur, prev, hist, 0.5, &p50) &&
              quantile(&v->cur, prev, hist, 0.9, &p90) &&
              quantile(&v->cur, prev, hist, 0.99, &p99) &&
              get(&v->cur, "bucketd_bulk_write_duration_seconds_count", "", &n) &&
              get(&v->cur, "bucketd_bulk_write_duration_seconds_sum", "", &sum);
    if (ok && prev != NULL && get(prev, "bucketd_bulk_write_duration_seconds_count", "", &n0) &&
        get(prev, "bucketd_bulk_write_duration_seconds_sum", "", &sum0)) {
        n -= n0;
        sum -= sum0;
    }
    if (!ok || !(n > 0)) {
        put(t, "             bulk write latency: no writes yet\n");
        return;
    }
    char b5[32];
    put(t, "             bulk write latency p50 %s  p90 %s  p99 %s  mean %s (%s, %s writes)\n",
        fmt_secs(b1, sizeof(b1), true, p50), fmt_secs(b2, sizeof(b2), true, p90),
        fmt_secs(b3, sizeof(b3), true, p99), fmt_secs(b4, sizeof(b4), true, sum / n), over,
        fmt_num(b5, sizeof(b5), true, n));
}

static void section_sensors(struct text *t, const struct view *v) {
    char b1[32], b2[32], b3[32], b4[32], b5[32], b6[32];
    double n = 0, max = 0, ev = 0, evt = 0, mem = 0, memmax = 0, silent = 0;
    bool hn = get(&v->cur, "bucketd_sensors", "", &n);
    bool hm = get(&v->cur, "bucketd_sensors_max", "", &max);
    bool he = rate(v, "bucketd_sensors_evicted_total", "", &ev);
    bool het = get(&v->cur, "bucketd_sensors_evicted_total", "", &evt);
    bool hmem = get(&v->cur, "bucketd_sensor_memory_bytes", "", &mem);
    bool hmm = get(&v->cur, "bucketd_sensor_memory_max_bytes", "", &memmax) && memmax > 0;
    put(t, "SENSORS      %s tracked of %s, evicted %s/s (%s in all), memory %s of %s",
        fmt_num(b1, sizeof(b1), hn, n), fmt_num(b2, sizeof(b2), hm, max),
        fmt_num(b3, sizeof(b3), he, ev), fmt_num(b4, sizeof(b4), het, evt),
        fmt_bytes(b5, sizeof(b5), hmem, mem),
        hmm ? fmt_bytes(b6, sizeof(b6), true, memmax) : "unbounded");
    /* The silent-sensor gauge, on daemons that have it. */
    if (get(&v->cur, "bucketd_sensors_silent", "", &silent)) {
        put(t, ", %s silent", fmt_num(b1, sizeof(b1), true, silent));
    }
    put(t, "\n");
}

/* The whole screen (or snapshot) as text, one '\n' per line. */
static void render(struct text *t, struct view *v) {
    char b1[32], when[64];
    double now_s = (double)bd_now_ns() / 1e9;
    time_t now = (time_t)now_s;
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char version[64] = "?";
    for (size_t i = 0; i < v->cur.n; i++) {
        if (strcmp(v->cur.s[i].name, "bucketd_build_info") == 0) {
            label(v->cur.s[i].labels, "version", version, sizeof(version));
        }
    }
    double start = 0;
    bool hs = get(&v->cur, "bucketd_start_time_seconds", "", &start);
    char every[32];
    bd_units_format_duration_ms(v->interval_ms, every, sizeof(every));
    put(t, "bucketd %s at %s  up %s  every %s  %s%s\n", version, v->target.shown,
        fmt_secs(b1, sizeof(b1), hs, BD_MAX(now_s - start, 0.0)), every, when,
        v->live ? "  (q quits)" : "");
    if (v->error[0] != '\0') {
        put(t, "ERROR: %s (for %s, retrying every %s)\n", v->error,
            fmt_secs(b1, sizeof(b1), true, (double)(bd_mono_ns() - v->error_since_ns) / 1e9),
            every);
    }
    if (v->cur.text == NULL) {
        return;
    }
    if (!v->have_prev) {
        put(t, "(rates after the next scrape)\n");
    }
    section_ingest(t, v);
    section_drops(t, v);
    section_pool_spool(t, v);
    section_mongodb(t, v);
    section_sensors(t, v);
}

/* One scrape into v->cur (the old cur becomes prev); the error is kept in v->error. */
static int scrape_once(struct view *v, int key_fd) {
    struct bd_err err = {0};
    char *body = NULL;
    int64_t timeout = BD_MAX((int64_t)v->interval_ms, MIN_SCRAPE_TIMEOUT_MS);
    int rc = fetch(&v->target, timeout, key_fd, &body, &err);
    if (rc == -ECANCELED || rc == -EINTR) {
        return rc;
    }
    if (rc < 0) {
        if (v->error[0] == '\0') {
            v->error_since_ns = bd_mono_ns();
        }
        snprintf(v->error, sizeof(v->error), "%s", err.msg);
        return rc;
    }
    struct scrape next = {.text = body, .mono_ns = bd_mono_ns()};
    if (scrape_parse(&next) < 0) {
        scrape_clear(&next);
        snprintf(v->error, sizeof(v->error), "out of memory");
        return -ENOMEM;
    }
    double x;
    if (!get(&next, "bucketd_start_time_seconds", "", &x) &&
        !get(&next, "bucketd_readings_accepted_total", "", &x)) {
        scrape_clear(&next);
        if (v->error[0] == '\0') {
            v->error_since_ns = bd_mono_ns();
        }
        snprintf(v->error, sizeof(v->error), "%.500s: no bucketd metrics in the reply",
                 v->target.shown);
        return -EPROTO;
    }
    /* Rates only between two scrapes of the same daemon run: a restart resets the counters. */
    double s0 = 0, s1 = 0;
    bool same = v->cur.text != NULL && get(&v->cur, "bucketd_start_time_seconds", "", &s0) &&
                get(&next, "bucketd_start_time_seconds", "", &s1) && s0 == s1;
    scrape_clear(&v->prev);
    v->prev = v->cur;
    v->cur = next;
    v->have_prev = same;
    v->error[0] = '\0';
    return 0;
}

/* ---- Terminal ----------------------------------------------------------------------------- */

static struct termios saved_tty;
static bool tty_changed;

static void tty_restore(int key_fd) {
    if (tty_changed) {
        tcsetattr(key_fd, TCSAFLUSH, &saved_tty);
        tty_changed = false;
    }
}

/* The screen: each line cut to the width, cleared to its end, the rest of the screen cleared. */
static void draw(const struct text *t) {
    struct winsize ws = {0};
    size_t cols = 80, rows = 24;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
        cols = ws.ws_col;
        rows = ws.ws_row > 0 ? ws.ws_row : rows;
    }
    struct text o = {0};
    put(&o, "\033[H");
    const char *p = t->buf != NULL ? t->buf : "";
    for (size_t row = 0; *p != '\0' && row < rows; row++) {
        const char *eol = strchr(p, '\n');
        size_t len = eol != NULL ? (size_t)(eol - p) : strlen(p);
        /* The last row without its newline: a newline there would scroll the screen. */
        put(&o, "%.*s\033[K%s", (int)BD_MIN(len, cols), p, row + 1 < rows ? "\r\n" : "");
        p = eol != NULL ? eol + 1 : p + len;
    }
    put(&o, "\033[J");
    if (o.buf != NULL) {
        bd_write_all(STDOUT_FILENO, o.buf, o.len);
    }
    free(o.buf);
}

/* ---- Main loop ---------------------------------------------------------------------------- */

static int run_plain(struct view *v, bool once) {
    int scrapes = 0;
    int64_t next = bd_mono_ns();
    for (;;) {
        int rc = scrape_once(v, -1);
        if (rc == -EINTR) {
            return 128 + stop_signal;
        }
        if (rc < 0 && (once || v->cur.text == NULL)) {
            /* Nothing to show yet: an address or a daemon that is not there. */
            fprintf(stderr, "bucketd-inspect: top: %s\n", v->error);
            return EXIT_USAGE;
        }
        if (rc < 0) {
            fprintf(stderr, "bucketd-inspect: top: %s (retrying)\n", v->error);
        } else if (++scrapes >= 2) {
            struct text t = {0};
            render(&t, v);
            if (t.buf != NULL) {
                fwrite(t.buf, 1, t.len, stdout);
            }
            free(t.buf);
            if (!once) {
                putchar('\n');
            }
            if (fflush(stdout) != 0 || ferror(stdout)) {
                fprintf(stderr, "bucketd-inspect: top: writing stdout failed\n");
                return EXIT_USAGE;
            }
            if (once) {
                return 0;
            }
        }
        next += (int64_t)v->interval_ms * 1000000;
        if (wait_ready(-1, 0, next, -1, false) == -EINTR) {
            return 128 + stop_signal;
        }
    }
}

static int run_live(struct view *v) {
    int key_fd = isatty(STDIN_FILENO) ? STDIN_FILENO : -1;
    if (key_fd >= 0 && tcgetattr(key_fd, &saved_tty) == 0) {
        struct termios raw = saved_tty;
        /* Keys one at a time, not echoed; ISIG stays so that Ctrl-C and Ctrl-\ still work. */
        raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
        raw.c_cc[VMIN] = 1;
        raw.c_cc[VTIME] = 0;
        if (tcsetattr(key_fd, TCSAFLUSH, &raw) == 0) {
            tty_changed = true;
        }
    }
    static const char enter[] = "\033[?1049h\033[?25l\033[H\033[2J";
    static const char leave[] = "\033[?25h\033[?1049l";
    bd_write_all(STDOUT_FILENO, enter, sizeof(enter) - 1);

    int status = 0;
    struct text t = {0};
    int64_t next = bd_mono_ns();
    for (;;) {
        int rc = scrape_once(v, key_fd);
        if (rc == -ECANCELED) {
            break;
        }
        if (rc == -EINTR) {
            status = 128 + stop_signal;
            break;
        }
        t.len = 0;
        render(&t, v);
        draw(&t);
        next += (int64_t)v->interval_ms * 1000000;
        if (next < bd_mono_ns()) {
            next = bd_mono_ns(); /* a slow scrape: no burst of catching up */
        }
        for (;;) {
            rc = wait_ready(-1, 0, next, key_fd, true);
            if (rc != -EAGAIN) {
                break;
            }
            resized = 0;
            draw(&t);
        }
        if (rc == -ECANCELED) {
            break;
        }
        if (rc == -EINTR) {
            status = 128 + stop_signal;
            break;
        }
    }
    free(t.buf);
    bd_write_all(STDOUT_FILENO, leave, sizeof(leave) - 1);
    tty_restore(key_fd);
    return status;
}

int bd_top_run(const struct bd_top_options *o) {
    static struct view v;
    struct bd_err err = {0};
    v = (struct view){.interval_ms = o->interval_ms};
    if (parse_target(o->target, &v.target, &err) < 0) {
        fprintf(stderr, "bucketd-inspect: top: %s\n", err.msg);
        return EXIT_USAGE;
    }
    v.live = !o->once && isatty(STDOUT_FILENO);

    struct sigaction sa = {0};
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_stop; /* no SA_RESTART: poll returns and the loop looks */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sa.sa_handler = on_winch;
    sigaction(SIGWINCH, &sa, NULL);

    int status = v.live ? run_live(&v) : run_plain(&v, o->once);
    scrape_clear(&v.prev);
    scrape_clear(&v.cur);
    return status;
}
