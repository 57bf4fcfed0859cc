/*
 * Stress test for the datagram ring (include/bucketd/dgram_ring.h) with the receive loops'
 * sleep/wake protocol (src/ingest_loops.c): a producer thread pushes datagrams of random
 * length (0..MAX_LEN bytes, checksummed, with a sequence number and a sender address) through
 * a tiny ring, sleeping on an eventfd whenever it lacks room for a batch; the consumer pops
 * them, releases room every few datagrams and wakes the producer when the ring says so. The
 * counters start just below UINT32_MAX so head and tail cross the 32-bit wrap; nearly every
 * batch meets a full ring and many records a filler at the array's end. The consumer checks
 * each datagram arrives once, in order and intact; guard bytes around the ring struct catch
 * stray writes. A lost wake-up leaves the producer asleep: the consumer's watchdog then fails
 * the run instead of hanging.
 *
 * A plain program, not a Criterion suite (Criterion does not run under ThreadSanitizer here):
 * run under TSan (BD_TSAN=ON) as well as plain and with ASan/UBSan. Exit 0 on success, 1 on any
 * mismatch. Arguments: [seconds] (default 2).
 */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "bucketd/dgram_ring.h"

#define RING_BYTES 8192
#define MAX_LEN 1500
#define BATCH 3 /* datagrams the producer wants room for before it reads "a batch" */
#define GUARD 256
#define GUARD_BYTE 0x5a

struct guarded {
    unsigned char before[GUARD];
    struct bd_dgram_ring ring;
    unsigned char after[GUARD];
};

static struct guarded *g;
static int efd;
static _Atomic bool stop_producing;
static _Atomic uint64_t produced;
static uint64_t sleeps;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint32_t len_of(uint64_t seq) {
    uint64_t x = seq * 0x9e3779b97f4a7c15u;
    return (uint32_t)((x >> 29) % (MAX_LEN + 1));
}

static unsigned char byte_of(uint64_t seq, uint32_t i) {
    return (unsigned char)((seq * 131u + i * 7u + (i >> 8)) ^ (seq >> 3));
}

static void *producer(void *arg) {
    (void)arg;
    unsigned char buf[MAX_LEN];
    uint64_t seq = 0;
    while (!atomic_load_explicit(&stop_producing, memory_order_relaxed)) {
        if (!bd_dgram_ring_fits(&g->ring, BATCH, MAX_LEN)) {
            if (bd_dgram_ring_wait_begin(&g->ring, BATCH, MAX_LEN)) {
                struct pollfd p = {.fd = efd, .events = POLLIN};
                /* No timeout: a lost wake-up leaves the producer here for good, and the
                 * consumer's watchdog fails the run. The end of the run wakes it too. */
                if (poll(&p, 1, -1) == 1) {
                    uint64_t v;
                    ssize_t n = read(efd, &v, sizeof(v));
                    (void)n;
                }
                sleeps++;
            }
            continue;
        }
        for (int k = 0; k < BATCH; k++, seq++) {
            uint32_t len = len_of(seq);
            for (uint32_t i = 0; i < len; i++) {
                buf[i] = byte_of(seq, i);
            }
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = (uint16_t)seq};
            a.sin_addr.s_addr = (uint32_t)(seq >> 16);
            if (bd_dgram_ring_push(&g->ring, buf, len, (const struct sockaddr *)&a, sizeof(a),
                                   (int64_t)seq, 0) != 0) {
                fprintf(stderr, "push %" PRIu64 " failed although fits said a batch fits\n", seq);
                exit(1);
            }
        }
        atomic_store_explicit(&produced, seq, memory_order_relaxed);
    }
    return NULL;
}

static void fail(const char *what, uint64_t seq) {
    fprintf(stderr, "dgram_ring_stress: %s at datagram %" PRIu64 "\n", what, seq);
    exit(1);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    g = aligned_alloc(128, (sizeof(*g) + 127) & ~(size_t)127);
    if (g == NULL) {
        return 1;
    }
    memset(g->before, GUARD_BYTE, GUARD);
    memset(g->after, GUARD_BYTE, GUARD);
    if (bd_dgram_ring_init(&g->ring, RING_BYTES) != 0) {
        return 1;
    }
    uint32_t start = (UINT32_MAX - RING_BYTES * 64 + 1) & ~(uint32_t)63;
    atomic_store(&g->ring.head, start);
    atomic_store(&g->ring.tail, start);
    g->ring.tail_cache = g->ring.head_cache = g->ring.next = start;
    efd = eventfd(0, EFD_NONBLOCK);
    if (efd < 0) {
        return 1;
    }
    pthread_t th;
    if (pthread_create(&th, NULL, producer, NULL) != 0) {
        return 1;
    }
    uint64_t seq = 0, wakes = 0;
    uint64_t end = mono_ns() + (uint64_t)(seconds * 1e9);
    uint64_t last_progress = mono_ns();
    for (;;) {
        const struct bd_dgram *d = bd_dgram_ring_peek(&g->ring);
        uint64_t now = mono_ns();
        if (d == NULL) {
            if (now >= end) {
                atomic_store(&stop_producing, true);
                uint64_t one = 1;
                ssize_t n = write(efd, &one, sizeof(one));
                (void)n;
                pthread_join(th, NULL);
                if (bd_dgram_ring_peek(&g->ring) != NULL) {
                    continue; /* what it pushed last */
                }
                break;
            }
            if (now - last_progress > 5000000000u) {
                fail("no datagram for 5 s (a lost wake-up?)", seq);
            }
            /* Nothing to read: what we popped is given back before we wait. */
            if (bd_dgram_ring_release(&g->ring)) {
                uint64_t one = 1;
                ssize_t n = write(efd, &one, sizeof(one));
                (void)n;
                wakes++;
            }
            sched_yield();
            continue;
        }
        last_progress = now;
        uint32_t len = len_of(seq);
        if (d->len != len || d->arrival_ns != (int64_t)seq || d->peer_len != sizeof(d->peer.in4) ||
            d->peer.in4.sin_port != (uint16_t)seq ||
            d->peer.in4.sin_addr.s_addr != (uint32_t)(seq >> 16)) {
            fail("header mismatch", seq);
        }
        for (uint32_t i = 0; i < len; i++) {
            if ((unsigned char)d->data[i] != byte_of(seq, i)) {
                fail("payload mismatch", seq);
            }
        }
        bd_dgram_ring_pop(&g->ring);
        seq++;
        if (seq % 2 == 0 && bd_dgram_ring_release(&g->ring)) {
            uint64_t one = 1;
            ssize_t n = write(efd, &one, sizeof(one));
            (void)n;
            wakes++;
        }
    }
    if (seq != atomic_load(&produced)) {
        fail("count mismatch", seq);
    }
    for (int i = 0; i < GUARD; i++) {
        if (g->before[i] != GUARD_BYTE || g->after[i] != GUARD_BYTE) {
            fail("guard bytes overwritten", seq);
        }
    }
    printf("dgram_ring_stress: %" PRIu64 " datagrams in order and intact; producer slept %" PRIu64
           " times, woken %" PRIu64 " times; head crossed the 32-bit wrap: %s\n",
           seq, sleeps, wakes, atomic_load(&g->ring.head) < start ? "yes" : "no");
    close(efd);
    bd_dgram_ring_close(&g->ring);
    free(g);
    return 0;
}
