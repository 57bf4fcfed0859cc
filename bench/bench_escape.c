/*
 * Escaping benchmark: what bd_escape (every log line, every logged id, bucketd-inspect's
 * output) costs, in MB/s of input and ns per 64-byte id, against memcpy of the same bytes (the
 * ceiling), for three inputs: ASCII ids, UTF-8 text (names in French and Japanese) and hostile
 * text (C1 controls, bidi overrides, invalid bytes). Also the cost of one bd_log line sent to
 * /dev/null against the fprintf it wraps.
 *
 * Single-threaded. Timed runs alternate baseline and measurement so both see the same noise;
 * each repeats whole passes for at least --min-time seconds; the best of --runs runs is printed
 * as one JSON object per input on stdout, with the conditions.
 *
 *   bench_escape [--runs N] [--min-time S]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/common.h"
#include "bucketd/escape.h"
#include "bucketd/log.h"

#define ID_LEN 64
#define N_IDS 4096

static volatile size_t sink; /* keeps the work from being optimised away */

static void fill(char *buf, size_t n, const char *pattern) {
    size_t pl = strlen(pattern);
    for (size_t i = 0; i < n; i++) {
        buf[i] = pattern[i % pl];
    }
}

static double pass_escape(const char *ids, double min_s, size_t *bytes) {
    char out[BD_ESCAPE_CAP(ID_LEN)];
    int64_t t0 = bd_mono_ns(), t;
    size_t n = 0;
    do {
        for (size_t i = 0; i < N_IDS; i++) {
            sink += bd_escape(out, sizeof(out), ids + i * ID_LEN, ID_LEN, 0);
        }
        n += N_IDS;
        t = bd_mono_ns();
    } while ((double)(t - t0) / 1e9 < min_s);
    *bytes = n * ID_LEN;
    return (double)(t - t0) / 1e9;
}

static double pass_copy(const char *ids, double min_s, size_t *bytes) {
    char out[BD_ESCAPE_CAP(ID_LEN)];
    int64_t t0 = bd_mono_ns(), t;
    size_t n = 0;
    do {
        for (size_t i = 0; i < N_IDS; i++) {
            memcpy(out, ids + i * ID_LEN, ID_LEN);
            out[ID_LEN] = '\0';
            sink += (size_t)out[i % ID_LEN];
        }
        n += N_IDS;
        t = bd_mono_ns();
    } while ((double)(t - t0) / 1e9 < min_s);
    *bytes = n * ID_LEN;
    return (double)(t - t0) / 1e9;
}

int main(int argc, char **argv) {
    int runs = 5;
    double min_s = 0.3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--runs") == 0) {
            runs = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--min-time") == 0) {
            min_s = atof(argv[i + 1]);
        }
    }
    static const struct {
        const char *name, *pattern;
    } inputs[] = {
        {"ascii", "weather,site=roof,room=kitchen-2|1736949600|0;"},
        {"utf8", "temp\xc3\xa9rature,ville=\xe6\x9d\xb1\xe4\xba\xac,"},
        {"hostile", "ev\xc2\x9b"
                    "2J\xe2\x80\xae\xff\x1b[31m\xc2\x85"},
    };
    static char ids[N_IDS * ID_LEN];
    for (size_t k = 0; k < BD_ARRAY_LEN(inputs); k++) {
        fill(ids, sizeof(ids), inputs[k].pattern);
        double best_e = 0, best_c = 0;
        for (int r = 0; r < runs; r++) {
            size_t be, bc;
            double se = pass_escape(ids, min_s, &be);
            double sc = pass_copy(ids, min_s, &bc);
            best_e = BD_MAX(best_e, (double)be / se / 1e6);
            best_c = BD_MAX(best_c, (double)bc / sc / 1e6);
        }
        printf("{\"input\":\"%s\",\"id_bytes\":%d,\"escape_mb_s\":%.1f,\"memcpy_mb_s\":%.1f,"
               "\"ratio\":%.3f,\"escape_ns_per_id\":%.1f,\"runs\":%d,\"min_time_s\":%.2f}\n",
               inputs[k].name, ID_LEN, best_e, best_c, best_e / best_c, ID_LEN / best_e * 1e3, runs,
               min_s);
    }

    /* One log line (about 150 bytes, with an escaped id in it) vs the bare fprintf. */
    if (freopen("/dev/null", "w", stderr) == NULL) {
        return 1;
    }
    const char *id = "weather,site=roof|1736949600|0";
    double best_log = 1e30, best_raw = 1e30;
    for (int r = 0; r < runs; r++) {
        int64_t t0 = bd_mono_ns();
        size_t n = 0;
        do {
            for (int i = 0; i < 1000; i++) {
                bd_error("MongoDB rejected the update of bucket %s for good (%u readings "
                         "quarantined): code %d: %s",
                         id, 12u, 121, "Document failed validation");
            }
            n += 1000;
        } while ((double)(bd_mono_ns() - t0) / 1e9 < min_s);
        best_log = BD_MIN(best_log, (double)(bd_mono_ns() - t0) / (double)n);
        t0 = bd_mono_ns();
        n = 0;
        do {
            for (int i = 0; i < 1000; i++) {
                fprintf(stderr,
                        "<3>MongoDB rejected the update of bucket %s for good (%u readings "
                        "quarantined): code %d: %s\n",
                        id, 12u, 121, "Document failed validation");
            }
            n += 1000;
        } while ((double)(bd_mono_ns() - t0) / 1e9 < min_s);
        best_raw = BD_MIN(best_raw, (double)(bd_mono_ns() - t0) / (double)n);
    }
    printf("{\"input\":\"log_line\",\"bd_log_ns\":%.0f,\"fprintf_ns\":%.0f,\"ratio\":%.2f,"
           "\"runs\":%d,\"min_time_s\":%.2f}\n",
           best_log, best_raw, best_log / best_raw, runs, min_s);
    return 0;
}
