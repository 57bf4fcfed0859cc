/*
 * Bare UDP receiver: the kernel ceiling the daemon's UDP path is measured against.
 *
 * One thread, no event loop: blocking recvmmsg(MSG_WAITFORONE) into 64 preallocated 64 KiB
 * buffers, counting datagrams, payload bytes, truncated datagrams and non-empty lines (a memchr
 * per newline, the least any line reader does). It asks for the same receive buffer as the
 * daemon's default, the same way (8 MiB; SO_RCVBUFFORCE, which root gets in full, else
 * SO_RCVBUF, capped by net.core.rmem_max) so both face the same kernel buffer.
 *
 *   bench_udp_sink [--bind HOST:PORT] [--rcvbuf BYTES]
 *
 * Port 0 (the default) picks a free port. Once bound it prints one JSON line to stdout:
 * {"ready":true,"port":P,"rcvbuf":R}. On SIGTERM or SIGINT it prints the totals as a second
 * JSON line and exits 0.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#define SLOT_SIZE (64 * 1024)

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig) {
    (void)sig;
    stop_requested = 1;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Non-empty lines in one datagram; a last line without '\n' counts too. */
static uint64_t count_lines(const char *p, size_t n) {
    const char *end = p + n;
    uint64_t lines = 0;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            nl = end;
        }
        if (nl > p) {
            lines++;
        }
        p = nl + 1;
    }
    return lines;
}

static int parse_bind(const char *s, struct sockaddr_in *sa) {
    char host[64];
    const char *colon = strrchr(s, ':');
    if (colon == NULL || (size_t)(colon - s) >= sizeof(host)) {
        return -EINVAL;
    }
    memcpy(host, s, (size_t)(colon - s));
    host[colon - s] = '\0';
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
        return -EINVAL;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *bind_to = "127.0.0.1:0";
    int rcvbuf_req = 8 * 1024 * 1024;
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    char *slab = NULL;
    int fd = -1;
    int rc = 1;

    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--bind") == 0) {
            bind_to = argv[i + 1];
        } else if (strcmp(argv[i], "--rcvbuf") == 0) {
            rcvbuf_req = atoi(argv[i + 1]);
        } else {
            fprintf(stderr, "usage: bench_udp_sink [--bind HOST:PORT] [--rcvbuf BYTES]\n");
            return 2;
        }
    }
    if (parse_bind(bind_to, &sa) != 0) {
        fprintf(stderr, "bench_udp_sink: bad --bind %s\n", bind_to);
        return 2;
    }

    /* No SA_RESTART: the signal must interrupt the blocking recvmmsg. */
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_handler = on_signal;
    sigemptyset(&act.sa_mask);
    sigaction(SIGTERM, &act, NULL);
    sigaction(SIGINT, &act, NULL);

    slab = malloc((size_t)BATCH * SLOT_SIZE);
    if (slab == NULL) {
        fprintf(stderr, "bench_udp_sink: out of memory\n");
        goto out;
    }
    /* Touch the slab now so page faults do not land in the measured period. */
    memset(slab, 0, (size_t)BATCH * SLOT_SIZE);

    fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0) {
        perror("bench_udp_sink: socket");
        goto out;
    }
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf_req, sizeof(rcvbuf_req)) != 0 &&
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf_req, sizeof(rcvbuf_req)) != 0) {
        perror("bench_udp_sink: SO_RCVBUF");
        goto out;
    }
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        perror("bench_udp_sink: bind");
        goto out;
    }
    int rcvbuf = 0;
    socklen_t ol = sizeof(rcvbuf);
    getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &ol);
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    printf("{\"ready\":true,\"port\":%u,\"rcvbuf\":%d}\n", ntohs(sa.sin_port), rcvbuf);
    fflush(stdout);

    uint64_t datagrams = 0;
    uint64_t bytes = 0;
    uint64_t lines = 0;
    uint64_t truncated = 0;
    uint64_t syscalls = 0;
    double first = 0.0;
    double last = 0.0;

    while (!stop_requested) {
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = slab + (size_t)i * SLOT_SIZE;
            iov[i].iov_len = SLOT_SIZE;
            memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr));
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int n = recvmmsg(fd, msgs, BATCH, MSG_WAITFORONE, NULL);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            perror("bench_udp_sink: recvmmsg");
            goto out;
        }
        syscalls++;
        last = now_s();
        if (datagrams == 0) {
            first = last;
        }
        for (int i = 0; i < n; i++) {
            if (msgs[i].msg_hdr.msg_flags & MSG_TRUNC) {
                truncated++;
                continue;
            }
            datagrams++;
            bytes += msgs[i].msg_len;
            lines += count_lines(iov[i].iov_base, msgs[i].msg_len);
        }
    }

    printf("{\"datagrams\":%" PRIu64 ",\"lines\":%" PRIu64 ",\"bytes\":%" PRIu64
           ",\"truncated\":%" PRIu64 ",\"syscalls\":%" PRIu64 ",\"active_s\":%.6f"
           ",\"rcvbuf\":%d}\n",
           datagrams, lines, bytes, truncated, syscalls, last - first, rcvbuf);
    fflush(stdout);
    rc = 0;

out:
    if (fd >= 0) {
        close(fd);
    }
    free(slab);
    return rc;
}
