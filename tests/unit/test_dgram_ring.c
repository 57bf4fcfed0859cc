/*
 * Unit tests for the datagram ring (include/bucketd/dgram_ring.h, src/dgram_ring.c): exact
 * single-threaded checks of records, fillers at the array's end, room and the 32-bit counter
 * wrap; then a producer and a consumer thread through a tiny ring with the receive loops'
 * sleep/wake protocol (an eventfd, as src/ingest_loops.c uses it), every datagram checked for
 * order and content, and no wake-up lost (a lost one hangs the producer: the test's timeout
 * fails it). Run under ThreadSanitizer too (BD_TSAN=ON).
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "bucketd/dgram_ring.h"

/* Byte i of datagram seq: depends on both, so a stale lap or a shifted copy never matches. */
static unsigned char byte_of(uint64_t seq, uint32_t i) {
    return (unsigned char)((seq * 131u + i * 7u + (i >> 8)) ^ (seq >> 3));
}

static uint32_t len_of(uint64_t seq, uint32_t max) {
    return (uint32_t)((seq * 2654435761u) % (max + 1)); /* 0..max, 0 included */
}

static void fill(unsigned char *buf, uint64_t seq, uint32_t len) {
    for (uint32_t i = 0; i < len; i++) {
        buf[i] = byte_of(seq, i);
    }
}

static struct sockaddr_in peer_of(uint64_t seq) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(1000 + seq))};
    a.sin_addr.s_addr = htonl(0x7f000001u + (uint32_t)(seq & 0xff));
    return a;
}

static int push(struct bd_dgram_ring *r, uint64_t seq, uint32_t len) {
    unsigned char buf[8192];
    struct sockaddr_in a = peer_of(seq);
    fill(buf, seq, len);
    return bd_dgram_ring_push(r, buf, len, (const struct sockaddr *)&a, sizeof(a),
                              (int64_t)seq * 10, (uint32_t)(seq & 1));
}

/* The next datagram is seq of len bytes, intact; pops it. */
static void expect(struct bd_dgram_ring *r, uint64_t seq, uint32_t len) {
    const struct bd_dgram *d = bd_dgram_ring_peek(r);
    cr_assert_not_null(d, "datagram %llu missing", (unsigned long long)seq);
    cr_assert_eq(d->len, len, "datagram %llu length", (unsigned long long)seq);
    cr_assert_eq(d->arrival_ns, (int64_t)seq * 10);
    cr_assert_eq(d->flags, (uint32_t)(seq & 1));
    struct sockaddr_in a = peer_of(seq);
    cr_assert_eq(d->peer_len, sizeof(a));
    cr_assert_eq(memcmp(&d->peer.in4, &a, sizeof(a)), 0, "peer of %llu", (unsigned long long)seq);
    for (uint32_t i = 0; i < len; i++) {
        cr_assert_eq((unsigned char)d->data[i], byte_of(seq, i), "datagram %llu byte %u",
                     (unsigned long long)seq, i);
    }
    cr_assert_eq(((uintptr_t)d) % BD_DGRAM_ALIGN, 0);
    bd_dgram_ring_pop(r);
}

Test(dgram_ring, init_refuses_bad_capacities) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 2048), -EINVAL);
    cr_assert_eq(bd_dgram_ring_init(&r, 6000), -EINVAL);
    cr_assert_eq(bd_dgram_ring_init(&r, 4096), 0);
    cr_assert_eq(bd_dgram_ring_capacity(&r), 4096);
    bd_dgram_ring_close(&r);
}

Test(dgram_ring, records_in_order_and_room_given_back_only_on_release) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 4096), 0);
    cr_assert_null(bd_dgram_ring_peek(&r));
    /* 64 header + 960 data = 1024 each: four fill the ring exactly. */
    for (uint64_t s = 0; s < 4; s++) {
        cr_assert_eq(push(&r, s, 960), 0);
    }
    cr_assert_eq(push(&r, 4, 0), -ENOBUFS, "full: nothing written");
    expect(&r, 0, 960);
    expect(&r, 1, 960);
    cr_assert_eq(push(&r, 4, 0), -ENOBUFS, "popped but not released: still no room");
    cr_assert_eq(bd_dgram_ring_release(&r), false, "nobody waits");
    cr_assert_eq(push(&r, 4, 1000), 0, "room back after the release");
    expect(&r, 2, 960);
    expect(&r, 3, 960);
    expect(&r, 4, 1000);
    cr_assert_null(bd_dgram_ring_peek(&r));
    bd_dgram_ring_close(&r);
}

Test(dgram_ring, a_record_that_does_not_fit_before_the_end_starts_at_zero_after_a_filler) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 4096), 0);
    cr_assert_eq(push(&r, 0, 2900), 0); /* 64 + 2944 = 3008: 1088 left before the end */
    expect(&r, 0, 2900);
    bd_dgram_ring_release(&r);
    /* 64 + 1536 = 1600 does not fit in 1088: filler of 1088, then the record at 0. */
    cr_assert_eq(bd_dgram_ring_fits(&r, 1, 1536), true);
    cr_assert_eq(push(&r, 1, 1536), 0);
    cr_assert_eq(atomic_load(&r.head), 3008 + 1088 + 1600);
    expect(&r, 1, 1536);
    cr_assert_eq(r.next, 3008 + 1088 + 1600, "the filler was skipped");
    bd_dgram_ring_release(&r);
    bd_dgram_ring_close(&r);
}

Test(dgram_ring, fits_counts_one_filler_and_refuses_what_might_not_fit) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 8192), 0);
    /* Records of 64 + 1024: (n + 1) of them must fit in 8192. */
    cr_assert_eq(bd_dgram_ring_fits(&r, 6, 1024), true);
    cr_assert_eq(bd_dgram_ring_fits(&r, 7, 1024), false);
    cr_assert_eq(push(&r, 0, 1024), 0);
    cr_assert_eq(bd_dgram_ring_fits(&r, 5, 1024), true);
    cr_assert_eq(bd_dgram_ring_fits(&r, 6, 1024), false);
    bd_dgram_ring_close(&r);
}

Test(dgram_ring, waiting_producer_is_told_to_wake_once_room_is_released) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 4096), 0);
    for (uint64_t s = 0; s < 4; s++) {
        cr_assert_eq(push(&r, s, 960), 0);
    }
    cr_assert_eq(bd_dgram_ring_wait_begin(&r, 1, 960), true, "no room: sleep");
    cr_assert_eq(bd_dgram_ring_release(&r), false, "nothing popped: nothing to wake for");
    expect(&r, 0, 960);
    expect(&r, 1, 960);
    cr_assert_eq(bd_dgram_ring_release(&r), true, "room freed for a waiting producer: wake it");
    cr_assert_eq(bd_dgram_ring_release(&r), false, "told once");
    cr_assert_eq(bd_dgram_ring_wait_begin(&r, 1, 960), false, "room now: go on");
    cr_assert_eq(atomic_load(&r.waiting), 0);
    bd_dgram_ring_close(&r);
}

Test(dgram_ring, counters_cross_the_32_bit_wrap) {
    struct bd_dgram_ring r;
    cr_assert_eq(bd_dgram_ring_init(&r, 4096), 0);
    uint32_t start = UINT32_MAX - 4096 * 2 + 1; /* a multiple of 64 below the wrap */
    start &= ~(uint32_t)63;
    atomic_store(&r.head, start);
    atomic_store(&r.tail, start);
    r.tail_cache = r.head_cache = r.next = start;
    uint64_t pushed = 0, popped = 0;
    for (int round = 0; round < 200; round++) {
        while (push(&r, pushed, len_of(pushed, 1500)) == 0) {
            pushed++;
        }
        while (popped < pushed) {
            expect(&r, popped, len_of(popped, 1500));
            popped++;
        }
        bd_dgram_ring_release(&r);
    }
    cr_assert_gt(atomic_load(&r.head) - start, 0);
    cr_assert_lt(atomic_load(&r.head), start, "head wrapped past UINT32_MAX");
    bd_dgram_ring_close(&r);
}

/* ---- Two threads ---- */

#define N_THREADED 200000
#define MAX_THREADED 1500

struct pair {
    struct bd_dgram_ring ring;
    int efd;
    uint64_t waits;
};

static void *producer(void *arg) {
    struct pair *p = arg;
    for (uint64_t s = 0; s < N_THREADED;) {
        if (!bd_dgram_ring_fits(&p->ring, 1, MAX_THREADED)) {
            if (bd_dgram_ring_wait_begin(&p->ring, 1, MAX_THREADED)) {
                struct pollfd pf = {.fd = p->efd, .events = POLLIN};
                cr_assert_eq(poll(&pf, 1, -1), 1); /* a lost wake-up hangs here */
                uint64_t v;
                cr_assert_eq(read(p->efd, &v, sizeof(v)), (ssize_t)sizeof(v));
                p->waits++;
            }
            continue;
        }
        cr_assert_eq(push(&p->ring, s, len_of(s, MAX_THREADED)), 0);
        s++;
    }
    return NULL;
}

Test(dgram_ring, producer_and_consumer_threads_with_sleep_and_wake, .timeout = 120) {
    struct pair p = {0};
    cr_assert_eq(bd_dgram_ring_init(&p.ring, 8192), 0); /* about 6 datagrams: always full */
    p.efd = eventfd(0, EFD_NONBLOCK);
    cr_assert_geq(p.efd, 0);
    uint32_t start = UINT32_MAX - 8192 * 40 + 1;
    start &= ~(uint32_t)63;
    atomic_store(&p.ring.head, start);
    atomic_store(&p.ring.tail, start);
    p.ring.tail_cache = p.ring.head_cache = p.ring.next = start;
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, producer, &p), 0);
    uint64_t wakes = 0;
    for (uint64_t s = 0; s < N_THREADED;) {
        if (bd_dgram_ring_peek(&p.ring) == NULL) {
            sched_yield();
            continue;
        }
        expect(&p.ring, s, len_of(s, MAX_THREADED));
        s++;
        if (s % 3 == 0 && bd_dgram_ring_release(&p.ring)) {
            uint64_t one = 1;
            cr_assert_eq(write(p.efd, &one, sizeof(one)), (ssize_t)sizeof(one));
            wakes++;
        }
    }
    if (bd_dgram_ring_release(&p.ring)) {
        uint64_t one = 1;
        cr_assert_eq(write(p.efd, &one, sizeof(one)), (ssize_t)sizeof(one));
    }
    pthread_join(th, NULL);
    cr_assert_null(bd_dgram_ring_peek(&p.ring));
    cr_log_info("producer slept %llu times, woken %llu times", (unsigned long long)p.waits,
                (unsigned long long)wakes);
    close(p.efd);
    bd_dgram_ring_close(&p.ring);
}
