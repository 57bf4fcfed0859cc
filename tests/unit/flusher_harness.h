/*
 * The flusher's unit-test harness, shared by the test files that drive bd_flusher_step on one
 * thread against the scripted store (fake_store.h): the configuration, start, stop and restart
 * over one spool directory, readings accepted into the sensor table, and stepping until idle.
 * Header-only; each test file defines its own TestSuite with setup/teardown below.
 */
#ifndef BUCKETD_TEST_FLUSHER_HARNESS_H
#define BUCKETD_TEST_FLUSHER_HARNESS_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/config.h"
#include "bucketd/deadletter.h"
#include "bucketd/flusher.h"
#include "bucketd/sensor.h"
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

#include "fake_store.h"

#define MS BD_NS_PER_MS
#define HOUR_MS INT64_C(3600000)

static struct bd_config cfg;
static struct bd_stats stats;
static struct bd_sensor_table *table;
static struct bd_flusher *flusher;
static struct fake_store fs;
static char dir[64];
static int64_t now_ms; /* wall clock of the test: two days ahead, past the look-up horizon */
static int64_t mono;
static struct bd_point pt;

static void configure(void) {
    bd_config_defaults(&cfg);
    snprintf(cfg.writer_id, sizeof(cfg.writer_id), "t1");
    cfg.limits.max_sensors = 64;
    cfg.limits.memory = UINT64_C(256) << 20;
    cfg.limits.max_name = 64 * 1024; /* the longest names bucketd can be configured for */
    cfg.limits.max_fields = 64;
    cfg.flush.max_delay_ms = 0; /* every page written when its batch is; holding has its tests */
    snprintf(dir, sizeof(dir), "/tmp/bd-flusher-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cfg.spool.dir, sizeof(cfg.spool.dir), "%s", dir);
    now_ms = (bd_now_ns() / MS / HOUR_MS + 48) * HOUR_MS + 10 * 60000;
    mono = 1;
}

static void start(void) {
    struct bd_err err = {0};
    memset(&stats, 0, sizeof(stats));
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0, "%s", err.msg);
    fake_init(&fs, cfg.writer_id);
    cr_assert_eq(bd_flusher_new_with_store(&flusher, &cfg, table, &stats, &fs.base, &err), 0, "%s",
                 err.msg);
    bd_flusher_seed(flusher, 12345); /* backoff jitter the same at every run */
}

static void setup(void) {
    configure();
    start();
}

static void stop(void) {
    bd_alloc_fail_after(-1, 0);
    bd_flusher_free(flusher);
    flusher = NULL;
    bd_sensor_table_free(table);
    table = NULL;
    fake_free(&fs);
}

static void teardown(void) {
    stop();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

static struct bd_str S(const char *s) {
    return (struct bd_str){s, strlen(s)};
}

/* One reading of sensor id with the given fields (value v each) at ts_ms, accepted at now_ms. */
static void
accept_fields(const char *id, const char *const *fields, uint32_t n, double v, int64_t ts_ms) {
    memset(&pt, 0, sizeof(pt));
    pt.series_key = S(id);
    pt.name = S(id);
    pt.has_time = true;
    pt.time_ns = ts_ms * MS;
    for (uint32_t i = 0; i < n; i++) {
        struct bd_field *f = &pt.fields[pt.n_fields++];
        f->key = S(fields[i]);
        f->kind = BD_VAL_FLOAT;
        f->v.f = v;
    }
    cr_assert_eq(bd_sensor_table_accept(table, &pt, now_ms * MS), 0, "reading of %s refused", id);
}

static void accept1(const char *id, double v, int64_t ts_ms) {
    static const char *const f[] = {"v"};
    accept_fields(id, f, 1, v, ts_ms);
}

static void publish(void) {
    bd_sensor_table_publish(table);
}

/* Step until nothing is pending (retries taken as soon as they are due); steps taken. */
static int run(int max_steps) {
    publish();
    for (int i = 0; i < max_steps; i++) {
        bd_flusher_step(flusher, mono, now_ms, true);
        if (bd_flusher_idle(flusher)) {
            return i + 1;
        }
        int64_t retry = bd_flusher_retry_at(flusher);
        mono = retry > mono ? retry : mono + 1;
    }
    return -1;
}

static const char *sensor_name(char *buf, size_t cap, int i) {
    snprintf(buf, cap, "m,s=%d", i);
    return buf;
}

/* n sensors, k readings each, one bucket; returns the readings sent. */
static int64_t send_sensors(int n, int k) {
    char name[32];
    int64_t start = now_ms / HOUR_MS * HOUR_MS;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < k; j++) {
            accept1(sensor_name(name, sizeof(name), i), i * 100 + j, start + j * 1000);
        }
    }
    return (int64_t)n * k;
}

static void assert_stored(int n, int k) {
    char name[32];
    for (int i = 0; i < n; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), k, "sensor %d", i);
    }
}

static int dead_letters(void) {
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
    FILE *fp = fopen(path, "r");
    int n = 0, c;
    if (fp == NULL) {
        return 0;
    }
    while ((c = fgetc(fp)) != EOF) {
        n += c == '\n';
    }
    fclose(fp);
    return n;
}

#define STAT(name) BD_STAT_GET(&stats, name)

/* k more readings of each of n sensors in the same bucket, after the first `after` of each. */
static void send_more(int n, int k, int after) {
    char name[32];
    int64_t start = now_ms / HOUR_MS * HOUR_MS;
    for (int i = 0; i < n; i++) {
        for (int j = after; j < after + k; j++) {
            accept1(sensor_name(name, sizeof(name), i), i * 100 + j, start + j * 1000);
        }
    }
}

static void spool_timing(void) {
    cfg.flush.interval_ms = 10;
    cfg.flush.retry_initial_ms = 5000;
    cfg.flush.retry_max_ms = 5000;
}

static uint64_t spool_file_bytes(void) {
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "cat %s/spool-*.seg 2>/dev/null | wc -c", dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    unsigned long long n = 0;
    cr_assert_eq(fscanf(p, "%llu", &n), 1);
    pclose(p);
    return n;
}

/* The daemon's end without a stop (a crash plays with the files before restart_new). */
static void restart_free(void) {
    bd_flusher_free(flusher);
    flusher = NULL;
    bd_sensor_table_free(table);
    table = NULL;
}

/* A new flusher and sensor table over the same spool directory and the same stored model (the
 * test store stays), its scripted faults cleared. */
static void restart_new(void) {
    struct bd_err err = {0};
    memset(&stats, 0, sizeof(stats));
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0, "%s", err.msg);
    fs.next_fault = fs.n_faults = 0;
    cr_assert_eq(bd_flusher_new_with_store(&flusher, &cfg, table, &stats, &fs.base, &err), 0, "%s",
                 err.msg);
    bd_flusher_seed(flusher, 12345);
}

/* A restart of the daemon over the same spool directory. */
static void restart(void) {
    restart_free();
    restart_new();
}

static const char **long_names(int n, size_t len) {
    const char **fields = calloc((size_t)n, sizeof(*fields));
    for (int i = 0; i < n; i++) {
        char *name = malloc(len + 1);
        memset(name, 'a' + (i % 26), len);
        char tag[16];
        snprintf(tag, sizeof(tag), "f%02dx", i % 100);
        memcpy(name, tag, 4);
        name[len] = '\0';
        fields[i] = name;
    }
    return fields;
}

static void free_names(const char **fields, int n) {
    for (int i = 0; i < n; i++) {
        free((char *)fields[i]);
    }
    free(fields);
}

/* Defect 1: one sensor whose page would pass 16 MiB (32 fields with 200-character names, 3,000
 * readings) beside five normal sensors. */
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#endif
