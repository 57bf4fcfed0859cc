/*
 * Flusher drain benchmark: the flusher thread's share of the packed UDP load. Readings are
 * accepted into the sensor table (as the ingest thread does, not timed) and then moved out of
 * the sensor queues into bucket deltas by bd_flusher_step with the blackhole sink (timed): page
 * accounting, delta building and summaries, no MongoDB. One thread, so the figure is the CPU the
 * flusher spends per reading, which on a two-core gateway is taken from the ingest thread.
 *
 * The input matches bench/run.sh's packed figure: --sensors sensors (default 1000) with
 * --fields float fields (default 3) each, round-robin, --readings readings per round (default
 * 200000), --runs rounds (default 5; the best is reported).
 *
 *   bench_flusher [--sensors N] [--fields N] [--readings N] [--runs N]
 *
 * Prints one JSON object: ns per reading (best and median of the runs) and the conditions.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/config.h"
#include "bucketd/flusher.h"
#include "bucketd/sensor.h"

static int64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * BD_NS_PER_S + ts.tv_nsec;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    uint32_t sensors = 1000, fields = 3, readings = 200000, runs = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        uint32_t v = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        if (strcmp(argv[i], "--sensors") == 0) {
            sensors = v;
        } else if (strcmp(argv[i], "--fields") == 0) {
            fields = v;
        } else if (strcmp(argv[i], "--readings") == 0) {
            readings = v;
        } else if (strcmp(argv[i], "--runs") == 0) {
            runs = v;
        } else {
            fprintf(stderr, "bench_flusher: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (sensors == 0 || fields == 0 || fields > 32 || readings == 0 || runs == 0 || runs > 100) {
        fprintf(stderr, "bench_flusher: bad arguments\n");
        return 2;
    }
    struct bd_config cfg;
    struct bd_stats stats;
    struct bd_err err = {0};
    struct bd_sensor_table *table = NULL;
    struct bd_flusher *flusher = NULL;
    bd_config_defaults(&cfg);
    cfg.sink = BD_SINK_BLACKHOLE;
    cfg.limits.max_sensors = sensors;
    /* Room in the pool for one round's readings of every sensor (a segment each, at least). */
    uint64_t cells = (uint64_t)(readings / sensors + 1) * (fields + 1) + 64;
    cfg.limits.memory = BD_MAX(UINT64_C(64) << 20, 4 * cells * sensors * 16);
    memset(&stats, 0, sizeof(stats));
    if (bd_sensor_table_new(&table, &cfg, &stats, &err) < 0 ||
        bd_flusher_new(&flusher, &cfg, table, &stats, &err) < 0) {
        fprintf(stderr, "bench_flusher: %s\n", err.msg);
        return 1;
    }
    char(*ids)[48] = calloc(sensors, sizeof(*ids));
    static char names[32][12];
    static struct bd_point pt;
    for (uint32_t f = 0; f < fields; f++) {
        snprintf(names[f], sizeof(names[f]), "f%u", f);
    }
    for (uint32_t s = 0; s < sensors; s++) {
        snprintf(ids[s], sizeof(ids[s]), "m2,site=plant-4,sensor=s%u", s);
    }
    int64_t now_ns = bd_now_ns();
    int64_t *ns = calloc(runs, sizeof(*ns));
    for (uint32_t r = 0; r < runs; r++) {
        for (uint32_t i = 0; i < readings; i++) {
            uint32_t s = i % sensors;
            memset(&pt, 0, offsetof(struct bd_point, fields));
            pt.series_key = (struct bd_str){ids[s], strlen(ids[s])};
            pt.name = (struct bd_str){"m2", 2};
            pt.has_time = true;
            pt.time_ns = now_ns - (int64_t)(readings - i) * 1000;
            pt.n_fields = fields;
            for (uint32_t f = 0; f < fields; f++) {
                pt.fields[f].key = (struct bd_str){names[f], strlen(names[f])};
                pt.fields[f].kind = BD_VAL_FLOAT;
                pt.fields[f].v.f = (double)i * 0.5 + f;
            }
            if (bd_sensor_table_accept(table, &pt, now_ns) < 0) {
                fprintf(stderr, "bench_flusher: reading %u refused\n", i);
                return 1;
            }
        }
        bd_sensor_table_publish(table);
        int64_t t0 = cpu_ns();
        bd_flusher_step(flusher, INT64_MAX / 2, now_ns / BD_NS_PER_MS, true);
        ns[r] = cpu_ns() - t0;
    }
    uint64_t flushed = BD_STAT_GET(&stats, readings_flushed);
    if (flushed != (uint64_t)readings * runs) {
        fprintf(stderr, "bench_flusher: %" PRIu64 " readings flushed, expected %" PRIu64 "\n",
                flushed, (uint64_t)readings * runs);
        return 1;
    }
    qsort(ns, runs, sizeof(*ns), cmp_i64);
    printf("{\"sensors\":%u,\"fields\":%u,\"readings\":%u,\"runs\":%u,"
           "\"best_ns_per_reading\":%.1f,\"median_ns_per_reading\":%.1f}\n",
           sensors, fields, readings, runs, (double)ns[0] / readings,
           (double)ns[runs / 2] / readings);
    free(ns);
    free(ids);
    bd_flusher_free(flusher);
    bd_sensor_table_free(table);
    return 0;
}
