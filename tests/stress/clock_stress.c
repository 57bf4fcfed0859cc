/*
 * Stress test for the clock's published state (src/clock.c): the main thread plays the loop
 * thread and polls a played clock source that goes round waiting (2 hours behind,
 * unsynchronised), synchronised (stepped to the true time) and waiting again (set back by
 * hand, which revokes the trust), while reader threads, as the flusher and ingest will, ask
 * bd_clock_trusted and convert a boot-time stamp with bd_clock_boot_to_wall_ns. A reader that
 * finds the clock trusted must get the offset of a trusted poll, never the 2-hours-behind one a
 * waiting poll measured. Meant to run under ThreadSanitizer (the tsan stage runs tests/stress/):
 * the readers share nothing with the owner but the clock's atomics.
 *
 * A plain program, not a Criterion suite (Criterion does not run under TSan). Exit 0 on
 * success, 1 on a failure, 2 on bad usage.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bucketd/clock.h"
#include "bucketd/log.h"

#define READERS 3
#define H (3600 * BD_NS_PER_S)
#define TRUE_WALL (INT64_C(1767225600) * BD_NS_PER_S)

/* The played source: written by the owner only, between its own polls. */
struct fake {
    int status;
    int64_t wall, boot;
};

static int fake_status(void *arg) {
    return ((struct fake *)arg)->status;
}
static int64_t fake_wall(void *arg) {
    return ((struct fake *)arg)->wall;
}
static int64_t fake_mono(void *arg) {
    return ((struct fake *)arg)->boot;
}
static int64_t fake_boot(void *arg) {
    return ((struct fake *)arg)->boot;
}

struct shared {
    struct bd_clock *c;
    int64_t trusted_offset;
    atomic_bool done;
    atomic_ulong trusted_seen, waiting_seen, bad;
};

static void *reader(void *arg) {
    struct shared *s = arg;
    while (!atomic_load(&s->done)) {
        int64_t wall = 0;
        int rc = bd_clock_boot_to_wall_ns(s->c, 1000, &wall);
        if (rc == 0) {
            atomic_fetch_add(&s->trusted_seen, 1);
            if (wall - 1000 != s->trusted_offset) {
                atomic_fetch_add(&s->bad, 1);
            }
        } else if (rc == -EAGAIN) {
            atomic_fetch_add(&s->waiting_seen, 1);
        } else {
            atomic_fetch_add(&s->bad, 1);
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2;
    if (argc > 2 || !(seconds > 0)) {
        fprintf(stderr, "usage: %s [SECONDS]\n", argv[0]);
        return 2;
    }
    struct fake f = {.status = 0, .wall = TRUE_WALL - 2 * H, .boot = BD_NS_PER_S};
    struct bd_clock_source src = {fake_status, fake_wall, fake_mono, fake_boot, &f};
    struct bd_clock_opts opts = {.wait_for_sync_ms = 3600000, .floor_what = "nothing"};
    struct shared s = {.trusted_offset = TRUE_WALL - BD_NS_PER_S};
    struct bd_err err = {0};
    bd_log_set_level(BD_LOG_ERROR); /* every round logs its changes */
    if (bd_clock_new(&s.c, &src, &opts, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    pthread_t t[READERS];
    for (int i = 0; i < READERS; i++) {
        pthread_create(&t[i], NULL, reader, &s);
    }
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    unsigned long rounds = 0;
    do {
        for (int k = 0; k < 100; k++, rounds++) {
            f.boot += 1000; /* time passes a little; no wait bound is reached */
            f.status = 0;
            f.wall = f.boot + TRUE_WALL - 2 * H - BD_NS_PER_S;
            bd_clock_poll(s.c);
            f.status = 1;
            f.wall = f.boot + s.trusted_offset;
            bd_clock_poll(s.c);
            if (!bd_clock_trusted(s.c)) {
                fprintf(stderr, "round %lu: not trusted once synchronised\n", rounds);
                atomic_fetch_add(&s.bad, 1);
            }
            f.status = 0;
            f.wall = f.boot + TRUE_WALL - 2 * H - BD_NS_PER_S;
            bd_clock_poll(s.c);
            if (bd_clock_trusted(s.c)) {
                fprintf(stderr, "round %lu: still trusted after a step by hand\n", rounds);
                atomic_fetch_add(&s.bad, 1);
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((double)(now.tv_sec - start.tv_sec) + (double)(now.tv_nsec - start.tv_nsec) / 1e9 <
             seconds);
    atomic_store(&s.done, true);
    for (int i = 0; i < READERS; i++) {
        pthread_join(t[i], NULL);
    }
    unsigned long bad = atomic_load(&s.bad);
    printf("clock_stress: %lu rounds; readers saw the clock trusted %lu times, waiting %lu "
           "times; %lu bad\n",
           rounds, atomic_load(&s.trusted_seen), atomic_load(&s.waiting_seen), bad);
    bd_clock_free(s.c);
    return bad == 0 ? 0 : 1;
}
