/*
 * The kernel's UDP counters (see include/bucketd/ingest.h): the parsers of /proc text, and the
 * timer that reads /proc once a second into the stats while a UDP listener is open. Ingest
 * thread only (src/ingest_int.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ingest_int.h"

/* How often the kernel's UDP counters are read. */
#define KSTATS_INTERVAL_MS 1000
/* /proc text is read through this buffer: all of /proc/net/snmp (about 1.6 KiB), or a run of
 * whole lines of /proc/net/udp (about 130 bytes a socket; a busy host lists thousands). */
#define KSTATS_BUF 16384

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

void ingest_kstats_update(struct bd_ingest *in) {
    if (in->kstats_buf != NULL) {
        kstats_read_snmp(in);
        kstats_read_sockets(in);
    }
}

static void on_kstats_timer_closed(uv_handle_t *h) {
    ingest_handle_closed(h->data);
}

static void on_kstats_timer(uv_timer_t *t) {
    ingest_kstats_update(t->data);
}

int ingest_kstats_start(struct bd_ingest *in, struct bd_err *err) {
    bool udp = false;
    if (in->kstats_buf != NULL) {
        return 0; /* started already (a reload adding a UDP listener asks again) */
    }
    for (uint32_t i = 0; i < in->n_listeners; i++) {
        udp |= in->listeners[i].cfg.proto == BD_PROTO_UDP;
    }
    if (!udp) {
        return 0;
    }
    in->kstats_buf = malloc(KSTATS_BUF);
    in->kstats_socks = calloc(in->cap_listeners, sizeof(*in->kstats_socks));
    if (in->kstats_buf == NULL || in->kstats_socks == NULL) {
        ingest_kstats_free(in); /* none or both: the update reads through both */
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    ingest_kstats_update(in);
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

void ingest_kstats_stop(struct bd_ingest *in) {
    if (in->kstats_open) {
        uv_close((uv_handle_t *)&in->kstats_timer, on_kstats_timer_closed);
        in->kstats_open = false;
    }
}

void ingest_kstats_free(struct bd_ingest *in) {
    free(in->kstats_buf);
    in->kstats_buf = NULL;
    free(in->kstats_socks);
    in->kstats_socks = NULL;
}
