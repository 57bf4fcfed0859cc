/*
 * Ingest hot-path benchmark: parse -> sensor lookup -> queue push, as the ingest thread runs it,
 * with a second thread draining the queues as the flusher does (woken through the table's wake
 * callback when the pool passes its wake-up mark; it pops the dirty sensors, decodes each
 * reading and hands the cells back), so the cross-core traffic of the hand-off is in the figure.
 * No sockets and no MongoDB: this isolates what bench/run.sh's packed UDP figure spends in
 * bucketd's own code from the kernel and the sender.
 *
 * The input is the packed UDP load of bench/run.sh: lines like
 *   m2,site=plant-4,sensor=s294 f0=-2.69,f1=81224i,f2=52.08 1736949600018555033
 * for --sensors sensors (default 1000) in round-robin order with shuffled starts, in
 * "datagrams" of --per-datagram lines (default 400), each ended by bd_sensor_table_publish()
 * as the UDP listener does. A push refused by a full pool is retried after a yield (the
 * listener would pause instead); the retries are reported, not hidden.
 *
 * --short-names names every sensor as issue 28's edge box does (m,site=s000123: one tag, a
 * 14-byte id) instead.
 *
 * --burst N sends N consecutive lines of each sensor (a sender that reports a sensor's readings
 * together) instead of one: the sensor table's same-sensor-as-last path.
 *
 * --inline drains in the producer's thread instead, after the datagram whose readings woke
 * it: no cross-core traffic and much less noise on a shared machine, for comparing changes to
 * the code on one core.
 *
 * Reported per run (best of --runs by producer CPU time), one JSON object on stdout:
 * producer ns/reading (thread CPU time), consumer ns/reading, wall readings/s.
 *
 *   bench_hotpath [--sensors N] [--fields N] [--per-datagram N] [--lines N] [--runs N]
 *                 [--memory-mib N] [--seconds S] [--burst N] [--inline] [--short-names]
 */
#include <errno.h>
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

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/parse.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

#define NOW_S INT64_C(1736949600)

static unsigned g_sensors = 1000;
static unsigned g_burst = 1;
static unsigned g_fields = 3;
static unsigned g_per_datagram = 400;
static unsigned g_lines = 400000;
static unsigned g_runs = 5;
static unsigned g_memory_mib = 64;
static double g_seconds = 1.0;
static bool g_inline;
static bool g_short_names;

static char *g_buf; /* all lines, '\n'-terminated */
static size_t g_buf_len;

struct run_state {
    struct bd_sensor_table *table;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool wake_pending; /* guarded by mu */
    atomic_bool done;
    uint64_t produced;
    uint64_t consumed;
    uint64_t full_retries;
    double producer_cpu_s;
    double consumer_cpu_s;
    double wall_s;
    double check; /* sum of decoded values: keeps the decode honest */
};

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void build_input(void) {
    size_t cap = (size_t)g_lines * 160;
    g_buf = malloc(cap);
    if (g_buf == NULL) {
        fprintf(stderr, "bench_hotpath: out of memory\n");
        exit(1);
    }
    uint64_t rng = 0x9e3779b97f4a7c15u;
    size_t o = 0;
    for (unsigned k = 0; k < g_lines; k++) {
        unsigned sensor = (k / g_burst) % g_sensors;
        uint64_t ts = (uint64_t)NOW_S * 1000000000u + (uint64_t)k * 1000u;
        int n = g_short_names ? snprintf(g_buf + o, cap - o, "m,site=s%06u ", sensor)
                              : snprintf(g_buf + o, cap - o, "m%u,site=plant-%u,sensor=s%u ",
                                         sensor % 4, sensor % 7, sensor);
        o += (size_t)n;
        for (unsigned f = 0; f < g_fields; f++) {
            uint64_t r = rng_next(&rng);
            if (f % 3 == 1) {
                n = snprintf(g_buf + o, cap - o, "%sf%u=%" PRIu64 "i", f ? "," : "", f, r % 100000);
            } else {
                n = snprintf(g_buf + o, cap - o, "%sf%u=%s%" PRIu64 ".%02" PRIu64, f ? "," : "", f,
                             (r & 1) ? "-" : "", (r >> 8) % 100, (r >> 20) % 100);
            }
            o += (size_t)n;
        }
        n = snprintf(g_buf + o, cap - o, " %" PRIu64 "\n", ts);
        o += (size_t)n;
    }
    g_buf_len = o;
}

/* Ingest side: the table's wake callback, as bd_flusher_wake. */
static void wake(void *arg) {
    struct run_state *st = arg;
    pthread_mutex_lock(&st->mu);
    st->wake_pending = true;
    pthread_cond_signal(&st->cv);
    pthread_mutex_unlock(&st->mu);
}

static void wait_for_wake(struct run_state *st) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 10 * 1000 * 1000; /* the flush interval's timer, shortened */
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&st->mu);
    if (!st->wake_pending && !atomic_load(&st->done)) {
        pthread_cond_timedwait(&st->cv, &st->mu, &ts);
    }
    st->wake_pending = false;
    pthread_mutex_unlock(&st->mu);
}

/* The flusher's drain, minus the deltas: returns the readings taken. */
static uint64_t drain_all(struct run_state *st) {
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_sensor *s;
    uint64_t got = 0;
    while ((s = bd_sensor_table_next_dirty(st->table)) != NULL) {
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            st->check += vals[0].kind == BD_VAL_FLOAT ? vals[0].v.f : 0;
            bd_sensor_consume(s, cells);
            got++;
        }
    }
    st->consumed += got;
    return got;
}

static void *consumer(void *arg) {
    struct run_state *st = arg;
    double c0 = thread_cpu_s();
    for (;;) {
        bool done = atomic_load_explicit(&st->done, memory_order_acquire);
        uint64_t got = drain_all(st);
        if (done && got == 0) {
            break; /* the producer's last publish came before done */
        }
        wait_for_wake(st);
    }
    st->consumer_cpu_s = thread_cpu_s() - c0;
    return NULL;
}

static int one_run(struct run_state *st, const struct bd_config *cfg) {
    struct bd_stats stats;
    memset(&stats, 0, sizeof(stats));
    struct bd_err err;
    if (bd_sensor_table_new(&st->table, cfg, &stats, &err) != 0) {
        fprintf(stderr, "bench_hotpath: %s\n", err.msg);
        return -1;
    }
    struct bd_parser parser;
    if (bd_parser_init(&parser, BD_FORMAT_INFLUX, BD_PREC_NS, cfg->limits.max_line) != 0) {
        return -1;
    }
    struct bd_point *pt = malloc(sizeof(*pt));
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    bd_sensor_table_set_wake(st->table, wake, st);
    pthread_t th;
    if (!g_inline) {
        pthread_create(&th, NULL, consumer, st);
    }

    int64_t now_ns = (NOW_S + 1) * BD_NS_PER_S;
    double w0 = mono_s();
    double c0 = thread_cpu_s();
    /* Whole passes over the input until --seconds have passed; the first pass creates the
     * sensors, as a daemon's first seconds do. */
    do {
        unsigned in_dgram = 0;
        int prc;
        /* The daemon's batch interface: the parser finds the lines (see udp_datagram). */
        bd_parse_begin(&parser, g_buf, g_buf_len);
        while ((prc = bd_parse_next(&parser, pt, NULL, NULL)) != BD_PARSE_END) {
            if (prc != BD_PARSE_OK) {
                fprintf(stderr, "bench_hotpath: a generated line does not parse\n");
                exit(1);
            }
            int rc;
            while ((rc = bd_sensor_table_accept(st->table, pt, now_ns)) == -ENOBUFS) {
                st->full_retries++;
                bd_sensor_table_publish(st->table);
                if (g_inline) {
                    drain_all(st);
                } else {
                    wake(st);
                    sched_yield();
                }
            }
            if (rc != 0) {
                fprintf(stderr, "bench_hotpath: accept failed: %d\n", rc);
                exit(1);
            }
            st->produced++;
            if (++in_dgram == g_per_datagram) {
                bd_sensor_table_publish(st->table);
                in_dgram = 0;
                if (g_inline && st->wake_pending) {
                    st->wake_pending = false;
                    drain_all(st);
                }
            }
        }
        bd_sensor_table_publish(st->table);
    } while (mono_s() - w0 < g_seconds);
    if (g_inline) {
        drain_all(st); /* its time counts: in this mode the producer is both */
    }
    st->producer_cpu_s = thread_cpu_s() - c0;
    atomic_store_explicit(&st->done, true, memory_order_release);
    wake(st);
    if (!g_inline) {
        pthread_join(th, NULL);
    }
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
    st->wall_s = mono_s() - w0;

    free(pt);
    bd_parser_close(&parser);
    bd_sensor_table_free(st->table);
    if (st->consumed != st->produced) {
        fprintf(stderr, "bench_hotpath: %" PRIu64 " readings pushed, %" PRIu64 " drained\n",
                st->produced, st->consumed);
        return -1;
    }
    return 0;
}

static unsigned arg_uint(const char *v, const char *name) {
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x == 0 || x > 100000000ul) {
        fprintf(stderr, "bench_hotpath: bad %s: %s\n", name, v);
        exit(2);
    }
    return (unsigned)x;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL && strcmp(a, "--inline") != 0 && strcmp(a, "--short-names") != 0) {
            fprintf(stderr, "usage: see the comment at the top of bench/bench_hotpath.c\n");
            return 2;
        }
        if (strcmp(a, "--sensors") == 0) {
            g_sensors = arg_uint(v, a);
        } else if (strcmp(a, "--fields") == 0) {
            g_fields = arg_uint(v, a);
        } else if (strcmp(a, "--per-datagram") == 0) {
            g_per_datagram = arg_uint(v, a);
        } else if (strcmp(a, "--burst") == 0) {
            g_burst = arg_uint(v, a);
        } else if (strcmp(a, "--lines") == 0) {
            g_lines = arg_uint(v, a);
        } else if (strcmp(a, "--runs") == 0) {
            g_runs = arg_uint(v, a);
        } else if (strcmp(a, "--memory-mib") == 0) {
            g_memory_mib = arg_uint(v, a);
        } else if (strcmp(a, "--inline") == 0) {
            g_inline = true;
            continue;
        } else if (strcmp(a, "--short-names") == 0) {
            g_short_names = true;
            continue;
        } else if (strcmp(a, "--seconds") == 0) {
            g_seconds = atof(v);
        } else {
            fprintf(stderr, "bench_hotpath: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (g_fields > 16 || !(g_seconds > 0)) {
        fprintf(stderr, "bench_hotpath: --fields at most 16, --seconds > 0\n");
        return 2;
    }
    build_input();
    struct bd_config cfg;
    bd_config_defaults(&cfg);
    cfg.limits.memory = (uint64_t)g_memory_mib << 20;
    cfg.limits.max_sensors = g_sensors + 1;

    struct run_state best = {0};
    double best_ns = 0;
    for (unsigned r = 0; r < g_runs; r++) {
        struct run_state st = {0};
        if (one_run(&st, &cfg) != 0) {
            return 1;
        }
        double ns = st.producer_cpu_s * 1e9 / (double)st.produced;
        if (r == 0 || ns < best_ns) {
            best_ns = ns;
            best = st;
        }
    }
    printf("{\"mode\":\"%s\",\"sensors\":%u,\"burst\":%u,\"fields\":%u,\"per_datagram\":%u,"
           "\"memory_mib\":%u,"
           "\"runs\":%u,"
           "\"readings\":%" PRIu64 ",\"producer_ns_per_reading\":%.1f,"
           "\"consumer_ns_per_reading\":%.1f,\"wall_readings_per_s\":%.0f,"
           "\"full_ring_retries\":%" PRIu64 ",\"check\":%.0f}\n",
           g_inline ? "inline" : "two threads", g_sensors, g_burst, g_fields, g_per_datagram,
           g_memory_mib, g_runs, best.produced, best_ns,
           best.consumer_cpu_s * 1e9 / (double)best.consumed, (double)best.produced / best.wall_s,
           best.full_retries, best.check);
    return 0;
}
