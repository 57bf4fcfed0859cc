/*
 * Stress test for draining while writing (src/flusher.c with src/io.c): the real flusher thread
 * and its I/O thread against a slow scripted store (tests/unit/fake_store.h: every bulk takes a
 * few milliseconds, every seventh is lost after it was applied, every eleventh never reaches the
 * server), while this program's main thread plays the ingest thread and pushes readings for a
 * few sensors into the same bucket pages as fast as the buffer pool takes them. At the end every
 * reading must be stored exactly once, the sequence numbers of the bulks must never go down,
 * and no update may be refused as a writer conflict (which is what a later batch overtaking an
 * earlier one on a page would look like). Meant to run under ThreadSanitizer as well: the drain
 * (flusher thread) and the store calls (I/O thread) share the flusher's state only through the
 * hand-off in io.c.
 *
 * A plain program, not a Criterion suite (Criterion does not run under TSan). Exit 0 on
 * success, 1 on a failure, 2 on bad usage.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The scripted store is header-only, written for the unit tests: not every helper is used. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "../unit/fake_store.h"
#pragma GCC diagnostic pop
#include "bucketd/config.h"
#include "bucketd/flusher.h"
#include "bucketd/parse.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

#define SENSORS 8

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2;
    if (argc > 2 || !(seconds > 0)) {
        fprintf(stderr, "usage: %s [SECONDS]\n", argv[0]);
        return 2;
    }
    static struct bd_config cfg;
    static struct bd_stats stats;
    static struct fake_store fs;
    struct bd_sensor_table *table = NULL;
    struct bd_flusher *flusher = NULL;
    struct bd_err err = {0};
    char dir[] = "/tmp/bd-io-stress-XXXXXX";
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    bd_config_defaults(&cfg);
    snprintf(cfg.writer_id, sizeof(cfg.writer_id), "stress");
    snprintf(cfg.spool.dir, sizeof(cfg.spool.dir), "%s", dir);
    cfg.sink = BD_SINK_MONGODB;
    cfg.flush.interval_ms = 5;
    cfg.flush.retry_initial_ms = 1;
    cfg.flush.retry_max_ms = 5;
    cfg.buckets.max_readings = 500; /* pages fill and overflow while the test runs */
    cfg.limits.max_sensors = SENSORS;
    cfg.limits.memory = 1 << 20;
    fake_init(&fs, cfg.writer_id);
    fs.delay_us = 2000;
    for (uint32_t i = 0; i < BD_ARRAY_LEN(fs.faults); i++) {
        fs.faults[i] = i % 7 == 3 ? FAULT_LOST_REPLY : i % 11 == 5 ? FAULT_UNREACHABLE : FAULT_NONE;
    }
    fs.n_faults = BD_ARRAY_LEN(fs.faults);
    if (bd_sensor_table_new(&table, &cfg, &stats, &err) < 0 ||
        bd_flusher_new_with_store(&flusher, &cfg, table, &stats, &fs.base, &err) < 0 ||
        bd_flusher_start(flusher, &err) < 0) {
        fprintf(stderr, "flusher_io_stress: %s\n", err.msg);
        return 1;
    }
    bd_sensor_table_set_wake(table, (bd_sensor_wake_cb)bd_flusher_wake, flusher);

    int64_t now_ns = bd_now_ns();
    int64_t bucket_ms = now_ns / BD_NS_PER_MS / 3600000 * 3600000;
    static char ids[SENSORS][16];
    uint64_t sent[SENSORS] = {0}, refused = 0;
    static struct bd_point pt;
    int64_t end = bd_mono_ns() + (int64_t)(seconds * 1e9);
    uint64_t n = 0;
    while (bd_mono_ns() < end) {
        uint32_t i = (uint32_t)(n % SENSORS);
        snprintf(ids[i], sizeof(ids[i]), "m,s=%u", i);
        memset(&pt, 0, sizeof(pt));
        pt.series_key = (struct bd_str){ids[i], strlen(ids[i])};
        pt.name = pt.series_key;
        pt.has_time = true;
        /* Distinct timestamps inside the current bucket, so pages fill in arrival order. */
        pt.time_ns = (bucket_ms + (int64_t)(sent[i] % 3000000)) * BD_NS_PER_MS;
        pt.n_fields = 1;
        pt.fields[0].key = (struct bd_str){"v", 1};
        pt.fields[0].kind = BD_VAL_FLOAT;
        pt.fields[0].v.f = (double)sent[i];
        if (bd_sensor_table_accept(table, &pt, bd_now_ns()) == 0) {
            sent[i]++;
        } else {
            refused++;
            bd_sensor_table_publish(table);
            usleep(100); /* the pool is full: as a paused listener would */
        }
        if (++n % 16 == 0) {
            bd_sensor_table_publish(table);
        }
    }
    bd_sensor_table_publish(table);
    bd_flusher_stop(flusher, bd_mono_ns() + 60 * BD_NS_PER_S);

    int failed = 0;
    uint64_t total = 0;
    for (uint32_t i = 0; i < SENSORS; i++) {
        int64_t stored = fake_stored(&fs, ids[i]);
        total += sent[i];
        if (stored != (int64_t)sent[i]) {
            fprintf(stderr,
                    "flusher_io_stress: FAIL: sensor %u: sent %" PRIu64 ", stored %" PRId64 "\n", i,
                    sent[i], stored);
            failed = 1;
        }
    }
    for (uint32_t i = 1; i < fs.bulks && i < 256; i++) {
        if (fs.seqs[i] < fs.seqs[i - 1]) {
            fprintf(stderr,
                    "flusher_io_stress: FAIL: bulk %u has sequence %" PRIu64 " after %" PRIu64 "\n",
                    i, fs.seqs[i], fs.seqs[i - 1]);
            failed = 1;
        }
    }
    if (fake_max_count(&fs) > cfg.buckets.max_readings) {
        fprintf(stderr, "flusher_io_stress: FAIL: a page holds %" PRId64 " readings (cap %u)\n",
                fake_max_count(&fs), cfg.buckets.max_readings);
        failed = 1;
    }
    uint64_t conflicts = BD_STAT_GET(&stats, writer_conflicts);
    uint64_t quarantined = BD_STAT_GET(&stats, updates_quarantined);
    uint64_t flushed = BD_STAT_GET(&stats, readings_flushed);
    if (conflicts != 0 || quarantined != 0 || flushed != total) {
        fprintf(stderr,
                "flusher_io_stress: FAIL: conflicts %" PRIu64 ", quarantined %" PRIu64
                ", flushed %" PRIu64 " of %" PRIu64 "\n",
                conflicts, quarantined, flushed, total);
        failed = 1;
    }
    printf("flusher_io_stress: %s: %" PRIu64 " readings in %u bulks (%" PRIu64 " retried), %" PRIu64
           " pushes refused by a full pool\n",
           failed ? "FAILED" : "ok", total, fs.bulks, (uint64_t)BD_STAT_GET(&stats, bulk_retries),
           refused);
    bd_flusher_free(flusher);
    bd_sensor_table_free(table);
    fake_free(&fs);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0) {
        failed = 1;
    }
    return failed;
}
