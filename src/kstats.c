/*
 * The kernel's UDP counters (what they mean: include/bucketd/ingest.h): the parsers of /proc
 * text (include/bucketd/kstats.h), and the object the ingest stage keeps while a UDP listener is
 * open (src/kstats_int.h), whose timer reads /proc once a second into the stats.
 *
 * Threads: the ingest thread only (src/ingest_int.h); the stats are written with relaxed
 * atomic adds, as every counter. Ownership: struct ingest_kstats owns its read buffer, the
 * sockets its owner described and what it has already counted of each; it is allocated by
 * ingest_kstats_new() and frees itself when its timer has closed. Which sockets are bucketd's
 * it asks its owner (ingest.c) through the callback it was handed; below it, only the ingest
 * core (the handle count).
 */
#include "bucketd/kstats.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ingest_core.h"
#include "kstats_int.h"

/* How often the kernel's UDP counters are read. */
#define KSTATS_INTERVAL_MS 1000
/* /proc text is read through this buffer: all of /proc/net/snmp (about 1.6 KiB), or a run of
 * whole lines of /proc/net/udp (about 130 bytes a socket; a busy host lists thousands). */
#define KSTATS_BUF 16384

struct ingest_kstats {
    struct bd_ingest *in; /* whose handle the timer is; its stats */
    uv_timer_t timer;
    ingest_kstats_sockets_cb sockets;
    void *arg;
    uint32_t cap;                        /* slots */
    struct ingest_kstats_socket *wanted; /* cap: what sockets() said at the last update */
    struct bd_kstats_sock *socks;        /* cap: the same, for the parser */
    uint64_t *seen_inode;                /* cap: the socket drops_seen belongs to */
    uint64_t *drops_seen;                /* cap: its drops already added to udp_socket_drops */
    uint32_t n;                          /* slots in use at the last update */
    struct bd_kstats_snmp snmp_last;     /* the values already accounted for */
    bool snmp_known;                     /* snmp_last holds a reading (the first is the baseline) */
    struct bd_kstats_snmp snmp6_last;    /* the same for IPv6 (/proc/net/snmp6) */
    bool snmp6_known;
    bool warned;
    char buf[KSTATS_BUF];
};

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

int bd_kstats_parse_snmp(const char *text, size_t len, struct bd_kstats_snmp *out) {
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

int bd_kstats_parse_snmp6(const char *text, size_t len, struct bd_kstats_snmp *out) {
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

size_t bd_kstats_parse_udp_drops(const char *text, size_t len, struct bd_kstats_sock *socks,
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

static void kstats_warn(struct ingest_kstats *k, const char *path, int rc) {
    if (!k->warned) {
        k->warned = true;
        bd_warn("cannot read %s (%s): the kernel's UDP drop counters (udp_socket_drops, "
                "udp_kernel_rcvbuf_errors, udp_kernel_in_errors) are not counted",
                path, strerror(-rc));
    }
}

/* What read_proc() does with a /proc file. */
enum proc_kind {
    PROC_UDP_SOCKETS, /* /proc/net/udp{,6}: runs of whole lines to bd_kstats_parse_udp_drops */
    PROC_SNMP,        /* /proc/net/snmp, whole, to bd_kstats_parse_snmp */
    PROC_SNMP6,       /* /proc/net/snmp6, whole, to bd_kstats_parse_snmp6 */
};

/*
 * Reads path through k->buf, handing each run of whole lines to bd_kstats_parse_udp_drops(), or
 * the whole file (which must then fit) to the snmp parser its kind names. 0 or a negative errno.
 */
static int read_proc(struct ingest_kstats *k, const char *path, enum proc_kind kind,
                     struct bd_kstats_snmp *snmp) {
    bool whole_file = kind != PROC_UDP_SOCKETS;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -errno;
    }
    char *buf = k->buf;
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
        bd_kstats_parse_udp_drops(buf, whole, k->socks, k->n);
        memmove(buf, buf + whole, have - whole);
        have -= whole;
    }
    close(fd);
    if (rc == 0 && whole_file) {
        rc = kind == PROC_SNMP ? bd_kstats_parse_snmp(buf, have, snmp)
                               : bd_kstats_parse_snmp6(buf, have, snmp);
    } else if (rc == 0) {
        bd_kstats_parse_udp_drops(buf, have, k->socks, k->n);
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
static void kstats_read_snmp_file(struct ingest_kstats *k, const char *path, enum proc_kind kind,
                                  struct bd_kstats_snmp *last, bool *known) {
    struct bd_stats *stats = k->in->stats;
    struct bd_kstats_snmp cur;
    int rc = read_proc(k, path, kind, &cur);
    if (rc < 0) {
        if (!(kind == PROC_SNMP6 && rc == -ENOENT)) {
            kstats_warn(k, path, rc);
        }
        return;
    }
    if (*known) {
        add_growth(&stats->udp_kernel_rcvbuf_errors, cur.rcvbuf_errors, &last->rcvbuf_errors);
        add_growth(&stats->udp_kernel_in_errors, cur.in_errors, &last->in_errors);
    }
    *last = cur;
    *known = true;
}

static void kstats_read_snmp(struct ingest_kstats *k) {
    kstats_read_snmp_file(k, "/proc/net/snmp", PROC_SNMP, &k->snmp_last, &k->snmp_known);
    kstats_read_snmp_file(k, "/proc/net/snmp6", PROC_SNMP6, &k->snmp6_last, &k->snmp6_known);
}

static void kstats_read_sockets(struct ingest_kstats *k) {
    bool v4 = false;
    bool v6 = false;
    memset(k->wanted, 0, k->cap * sizeof(*k->wanted));
    k->n = k->sockets(k->arg, k->wanted, k->cap);
    BD_ASSERT(k->n <= k->cap);
    for (uint32_t i = 0; i < k->n; i++) {
        uint64_t inode = k->wanted[i].inode;
        k->socks[i] = (struct bd_kstats_sock){inode, 0, false};
        if (k->seen_inode[i] != inode) {
            /* Another socket in this slot: it has added nothing yet. */
            k->seen_inode[i] = inode;
            k->drops_seen[i] = 0;
        }
        v4 |= inode != 0 && !k->wanted[i].v6;
        v6 |= inode != 0 && k->wanted[i].v6;
    }
    int rc = v4 ? read_proc(k, "/proc/net/udp", PROC_UDP_SOCKETS, NULL) : 0;
    if (rc < 0) {
        kstats_warn(k, "/proc/net/udp", rc);
    }
    rc = v6 ? read_proc(k, "/proc/net/udp6", PROC_UDP_SOCKETS, NULL) : 0;
    if (rc < 0) {
        kstats_warn(k, "/proc/net/udp6", rc);
    }
    for (uint32_t i = 0; i < k->n; i++) {
        if (k->socks[i].found) {
            add_growth(&k->in->stats->udp_socket_drops, k->socks[i].drops, &k->drops_seen[i]);
        }
    }
}

void ingest_kstats_update(struct ingest_kstats *k) {
    if (k != NULL) {
        kstats_read_snmp(k);
        kstats_read_sockets(k);
    }
}

static void kstats_free(struct ingest_kstats *k) {
    free(k->wanted);
    free(k->socks);
    free(k->seen_inode);
    free(k->drops_seen);
    free(k);
}

static void on_kstats_timer_closed(uv_handle_t *h) {
    struct ingest_kstats *k = h->data;
    struct bd_ingest *in = k->in;
    kstats_free(k);
    ingest_handle_closed(in);
}

static void on_kstats_timer(uv_timer_t *t) {
    ingest_kstats_update(t->data);
}

int ingest_kstats_new(struct ingest_kstats **out, struct bd_ingest *in, uint32_t n_slots,
                      ingest_kstats_sockets_cb sockets, void *arg, struct bd_err *err) {
    *out = NULL;
    struct ingest_kstats *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    k->in = in;
    k->sockets = sockets;
    k->arg = arg;
    k->cap = n_slots;
    k->wanted = calloc(n_slots, sizeof(*k->wanted));
    k->socks = calloc(n_slots, sizeof(*k->socks));
    k->seen_inode = calloc(n_slots, sizeof(*k->seen_inode));
    k->drops_seen = calloc(n_slots, sizeof(*k->drops_seen));
    if (k->wanted == NULL || k->socks == NULL || k->seen_inode == NULL || k->drops_seen == NULL) {
        kstats_free(k);
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    ingest_kstats_update(k);
    uv_timer_init(in->loop, &k->timer);
    k->timer.data = k;
    ingest_handle_opened(in);
    /* Unreferenced: the counters alone must not keep the loop running. */
    uv_unref((uv_handle_t *)&k->timer);
    int rc = uv_timer_start(&k->timer, on_kstats_timer, KSTATS_INTERVAL_MS, KSTATS_INTERVAL_MS);
    if (rc < 0) {
        ingest_kstats_close(k);
        return bd_err_set(err, rc, "ingest: kernel counters timer: %s", uv_strerror(rc));
    }
    *out = k;
    return 0;
}

void ingest_kstats_close(struct ingest_kstats *k) {
    if (k != NULL) {
        uv_close((uv_handle_t *)&k->timer, on_kstats_timer_closed);
    }
}
