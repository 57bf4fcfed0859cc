/*
 * Stress test for the sensor table's dirty hand-off (src/sensor.c, "Hand-off protocol"): one
 * ingest thread accepts readings for a few sensors and publishes every few readings; one
 * flusher thread pops dirty sensors and drains them, as src/flusher.c does, as fast as it can,
 * so pops and clears constantly race the producer's look at the flag. Every reading carries its
 * sensor's sequence number; the consumer checks each arrives once and in order. The load comes
 * in short rounds: at the end of each (after the producer's publish) the consumer drains until
 * the dirty queue is empty, and then every sensor's queue must be empty too -- a reading left in
 * a queue whose sensor is not queued is a lost wake-up -- before the producer starts the next
 * round. The buffer pool is tiny (16 segments) and the sensors at their share could hold 24 of
 * them, so in the long rounds the producer runs the pool dry all the time (retried), and
 * segments go back and forth between the threads, idle ones through the reclaim queue and the
 * producer's sealing (src/sensor.c, "Queue protocol"), which a take finding the pool empty may
 * do to the very segment it is about to leave.
 *
 * A plain program, not a Criterion suite; meant to run under ThreadSanitizer as well. Exit 0
 * on success, 1 on a failure, 2 on bad usage.
 */
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/config.h"
#include "bucketd/parse.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

#define SENSORS 12
#define NOW (INT64_C(1736949600) * BD_NS_PER_S)

static struct bd_config g_cfg;
static struct bd_stats g_stats;
static struct bd_sensor_table *g_table;
static double g_seconds = 2;
static unsigned g_batch = 3; /* readings per publish */
/* limits.memory: the pool is half. 32 KiB: the smallest pool, large segments only; 512 KiB or
 * more: small segments too (pool.h), so chains start small and grow, and both classes' segments
 * go back and forth. */
static uint64_t g_memory = 32 * 1024;
static atomic_bool g_done;
static _Atomic uint64_t g_round_end; /* producer: last round finished (published) */
static _Atomic uint64_t g_round_ack; /* consumer: last round checked */
/* Most rounds are short, for many round-end checks; every eighth is long enough for the producer
 * to run ahead of the consumer and run the pool dry. */
#define ROUND_READINGS 64
#define LONG_ROUND_READINGS 4096
static atomic_bool g_failed;
static uint64_t g_sent[SENSORS];
static uint64_t g_got[SENSORS]; /* consumer only until joined */
static uint64_t g_pops;

static void fail(const char *msg, uint64_t a, uint64_t b) {
    fprintf(stderr, "handoff_stress: FAIL: %s (%" PRIu64 ", %" PRIu64 ")\n", msg, a, b);
    atomic_store(&g_failed, true);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *producer(void *arg) {
    /* Ids of different lengths; drain() finds the index after the '='. */
    static const char *keys[SENSORS] = {"m,s=0", "m,s=1", "m,s=02", "m,s=003",
                                        "m,s=4", "m,s=5", "m,s=06", "m,s=007",
                                        "m,s=8", "m,s=9", "m,s=10", "m,s=011"};
    struct bd_point *pt = calloc(1, sizeof(*pt));
    uint64_t deadline = mono_ns() + (uint64_t)(g_seconds * 1e9);
    uint64_t n = 0, r = 0, in_round = 0;
    while (!atomic_load_explicit(&g_failed, memory_order_relaxed)) {
        if ((n & 255) == 0 && mono_ns() >= deadline) {
            break;
        }
        unsigned i = (unsigned)((n * 7 + (n >> 3)) % SENSORS);
        memset(pt, 0, offsetof(struct bd_point, tags));
        pt->series_key = (struct bd_str){keys[i], strlen(keys[i])};
        pt->name = (struct bd_str){"m", 1};
        pt->has_time = true;
        pt->time_ns = NOW;
        pt->n_fields = 1;
        pt->fields[0] = (struct bd_field){.key = {"seq", 3}, .kind = BD_VAL_UINT};
        pt->fields[0].v.u = g_sent[i];
        /* A full pool drops (and counts) the reading: publish, let the consumer run, retry. */
        unsigned spins = 0;
        while (bd_sensor_table_accept(g_table, pt, NOW) != 0) {
            bd_sensor_table_publish(g_table);
            if (++spins > 16) {
                sched_yield();
            }
            if (atomic_load_explicit(&g_failed, memory_order_relaxed)) {
                goto out;
            }
        }
        g_sent[i]++;
        n++;
        if (n % g_batch == 0) {
            bd_sensor_table_publish(g_table);
        }
        if (++in_round == (r % 8 == 7 ? LONG_ROUND_READINGS : ROUND_READINGS)) {
            /* End of a round: the last batch, then wait until the consumer has checked it. */
            bd_sensor_table_publish(g_table);
            in_round = 0;
            r++;
            /* Pairs with the acquire load in consumer(). */
            atomic_store_explicit(&g_round_end, r, memory_order_release);
            while (atomic_load_explicit(&g_round_ack, memory_order_acquire) != r) {
                if (atomic_load_explicit(&g_failed, memory_order_relaxed)) {
                    goto out;
                }
                sched_yield();
            }
        }
    }
out:
    bd_sensor_table_publish(g_table); /* the ingest thread's last batch before it stops */
    /* Pairs with the acquire load in consumer(): the totals and every push are visible. */
    atomic_store_explicit(&g_done, true, memory_order_release);
    free(pt);
    return arg;
}

static void drain(struct bd_sensor *s) {
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n, cells;
    unsigned i = (unsigned)atoi(s->id_buf + 4);
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
        if (n != 1 || vals[0].v.u != g_got[i]) {
            fail("reading out of order, twice or lost", vals[0].v.u, g_got[i]);
            return;
        }
        g_got[i]++;
        bd_sensor_consume(s, cells);
    }
}

static void check_queue(struct bd_sensor *s, void *arg) {
    uint64_t *round = arg;
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    /* A peek without consuming: the consumer may look, the reading stays. */
    if (bd_sensor_peek_reading(s, &ts, vals, &n) != 0) {
        fail("round end: readings left in a queue whose sensor is not queued (lost wake-up)",
             *round, vals[0].v.u);
    }
}

static void *consumer(void *arg) {
    struct bd_sensor *s;
    uint64_t checked = 0;
    while (!atomic_load_explicit(&g_failed, memory_order_relaxed)) {
        bool done = atomic_load_explicit(&g_done, memory_order_acquire);
        uint64_t round = atomic_load_explicit(&g_round_end, memory_order_acquire);
        while ((s = bd_sensor_table_next_dirty(g_table)) != NULL) {
            g_pops++;
            drain(s);
        }
        if (round != checked) {
            /* The producer is parked until the ack: the sensors are ours to look at (the
             * foreach only reads the index, which does not change once all exist). */
            bd_sensor_table_foreach(g_table, check_queue, &round);
            checked = round;
            atomic_store_explicit(&g_round_ack, round, memory_order_release);
        }
        if (done) {
            break; /* the queue was empty after the producer's last publish */
        }
    }
    return arg;
}

int main(int argc, char **argv) {
    if (argc > 1) {
        g_seconds = atof(argv[1]);
    }
    if (argc > 2) {
        g_batch = (unsigned)atoi(argv[2]);
    }
    if (argc > 3) {
        g_memory = strtoull(argv[3], NULL, 10);
    }
    if (argc > 4 || !(g_seconds > 0) || g_batch == 0 || g_memory < 32 * 1024) {
        fprintf(stderr, "usage: %s [SECONDS [READINGS_PER_PUBLISH [MEMORY_BYTES]]]\n", argv[0]);
        return 2;
    }
    bd_config_defaults(&g_cfg);
    /* By default the smallest pool: 16 segments of 30 readings (2 cells each) for 12 sensors,
     * so pushes run it dry and wait for segments to come back, idle ones included. */
    g_cfg.limits.memory = g_memory;
    g_cfg.limits.max_sensors = SENSORS;
    struct bd_err err;
    if (bd_sensor_table_new(&g_table, &g_cfg, &g_stats, &err) != 0) {
        fprintf(stderr, "handoff_stress: cannot create the table\n");
        return 1;
    }
    pthread_t p, c;
    pthread_create(&p, NULL, producer, NULL);
    pthread_create(&c, NULL, consumer, NULL);
    pthread_join(p, NULL);
    pthread_join(c, NULL);

    uint64_t last = UINT64_MAX;
    bd_sensor_table_foreach(g_table, check_queue, &last);
    uint64_t sent = 0, got = 0;
    for (int i = 0; i < SENSORS; i++) {
        if (g_got[i] != g_sent[i]) {
            fail("a sensor's readings sent and drained differ", g_sent[i], g_got[i]);
        }
        sent += g_sent[i];
        got += g_got[i];
    }
    bool ok = !atomic_load(&g_failed) && sent > 0;
    printf("handoff_stress: %s: %" PRIu64 " readings sent in %" PRIu64 " rounds, %" PRIu64
           " drained, %" PRIu64 " pops, %" PRIu64 " full-pool retries, publish every %u\n",
           ok ? "ok" : "FAILED", sent, (uint64_t)atomic_load(&g_round_end), got, g_pops,
           (uint64_t)BD_STAT_GET(&g_stats, drop_buffer_full), g_batch);
    bd_sensor_table_free(g_table);
    return ok ? 0 : 1;
}
