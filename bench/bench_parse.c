/*
 * Parser benchmark: lines per second through bd_parse_line on one core, against the ceiling of
 * a memchr-only split of the same buffer.
 *
 * Single-threaded. The program builds one in-memory buffer of realistic lines (InfluxDB line
 * protocol: mixed measurements, 2-4 tags, 2-6 fields with floats and integers, 80-120 bytes,
 * nanosecond timestamps; or Graphite plaintext with dotted paths, some tagged), then times, in
 * alternation so both see the same machine noise, a pass that splits the buffer with memchr and
 * parses every line, and a pass that only splits it. Each timed run repeats whole passes until
 * it has lasted --min-time seconds; the best of --runs runs is reported, as one JSON object per
 * format on stdout. Every line must parse: a rejected line is a bug in the generator or the
 * parser and makes the program exit 1.
 *
 *   bench_parse [--format influx|graphite|all] [--lines N] [--runs N] [--min-time S]
 *               [--seed N] [--dump FILE]
 *
 * --dump writes the buffer to FILE and exits (to feed a profiler or the daemon): the influx one,
 * or the Graphite one with --format graphite.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/parse.h"

#define LINE_MIN 80
#define LINE_MAX 120
#define MAX_LINE_BYTES 512

/* ---------------------------------------------------------------------------------------- */
/* Deterministic generator                                                                  */

struct rng {
    uint64_t s;
};

/* splitmix64: a small, well-mixed generator; the same seed gives the same buffer everywhere. */
static uint64_t rng_next(struct rng *r) {
    uint64_t z = (r->s += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static uint32_t rng_below(struct rng *r, uint32_t n) {
    return (uint32_t)(rng_next(r) % n);
}

static const char *const measurements[] = {
    "weather",      "power", "vibration",    "air_quality",
    "pump_station", "hvac",  "cold_storage", "solar_inverter",
};

/* Tag keys in byte order; each line takes a random subset and emits it mostly sorted. */
static const char *const tag_keys[] = {"building", "device", "floor", "line",
                                       "region",   "site",   "zone"};

static const char *const regions[] = {"eu-west-1", "eu-central-1", "us-east-2", "ap-south-1"};

enum field_kind { FK_FLOAT, FK_INT };

struct field_spec {
    const char *name;
    enum field_kind kind;
    double lo;
    double hi;
};

static const struct field_spec field_specs[] = {
    {"temp", FK_FLOAT, -20.0, 45.0},       {"hum", FK_FLOAT, 5.0, 99.0},
    {"pressure", FK_FLOAT, 950.0, 1050.0}, {"voltage", FK_FLOAT, 210.0, 250.0},
    {"current", FK_FLOAT, 0.0, 32.0},      {"battery", FK_FLOAT, 2.8, 4.2},
    {"pm25", FK_FLOAT, 0.0, 150.0},        {"power_w", FK_INT, 0.0, 12000.0},
    {"rpm", FK_INT, 0.0, 3600.0},          {"status", FK_INT, 0.0, 8.0},
    {"co2", FK_INT, 380.0, 2400.0},        {"energy_wh", FK_INT, 0.0, 9000000.0},
};

static void tag_value(struct rng *r, const char *key, char *out, size_t cap) {
    if (strcmp(key, "region") == 0) {
        snprintf(out, cap, "%s", regions[rng_below(r, BD_ARRAY_LEN(regions))]);
    } else if (strcmp(key, "device") == 0) {
        snprintf(out, cap, "dev-%04u", rng_below(r, 10000));
    } else if (strcmp(key, "site") == 0) {
        snprintf(out, cap, "plant-%u", 1 + rng_below(r, 12));
    } else if (strcmp(key, "building") == 0) {
        snprintf(out, cap, "b%u", 1 + rng_below(r, 9));
    } else if (strcmp(key, "floor") == 0) {
        snprintf(out, cap, "%u", rng_below(r, 20));
    } else if (strcmp(key, "line") == 0) {
        snprintf(out, cap, "line-%u", 1 + rng_below(r, 6));
    } else {
        snprintf(out, cap, "z%02u", rng_below(r, 40));
    }
}

static void field_value(struct rng *r, const struct field_spec *f, char *out, size_t cap) {
    double u = (double)(rng_next(r) >> 11) / (double)(UINT64_C(1) << 53);
    double v = f->lo + u * (f->hi - f->lo);
    if (f->kind == FK_INT) {
        snprintf(out, cap, "%" PRId64 "i", (int64_t)v);
    } else {
        /* One to three decimals, as sensors usually report. */
        snprintf(out, cap, "%.*f", 1 + (int)rng_below(r, 3), v);
    }
}

/* Appends one influx line (with '\n') to out; returns its length without the newline. */
static size_t gen_influx(struct rng *r, int64_t ts, char *out) {
    char val[64];
    size_t n = 0;

    n += (size_t)sprintf(out + n, "%s", measurements[rng_below(r, BD_ARRAY_LEN(measurements))]);

    /* 2-4 distinct tag keys, chosen by a partial shuffle, then emitted in key order 4 times
     * out of 5 (what most clients do) and as drawn otherwise. */
    size_t order[BD_ARRAY_LEN(tag_keys)];
    for (size_t i = 0; i < BD_ARRAY_LEN(tag_keys); i++) {
        order[i] = i;
    }
    size_t n_tags = 2 + rng_below(r, 3);
    for (size_t i = 0; i < n_tags; i++) {
        size_t j = i + rng_below(r, (uint32_t)(BD_ARRAY_LEN(tag_keys) - i));
        size_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    if (rng_below(r, 5) != 0) {
        for (size_t i = 1; i < n_tags; i++) {
            for (size_t j = i; j > 0 && order[j - 1] > order[j]; j--) {
                size_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        }
    }
    for (size_t i = 0; i < n_tags; i++) {
        tag_value(r, tag_keys[order[i]], val, sizeof(val));
        n += (size_t)sprintf(out + n, ",%s=%s", tag_keys[order[i]], val);
    }

    /* 2-6 distinct fields. */
    size_t fidx[BD_ARRAY_LEN(field_specs)];
    for (size_t i = 0; i < BD_ARRAY_LEN(field_specs); i++) {
        fidx[i] = i;
    }
    size_t n_fields = 2 + rng_below(r, 5);
    for (size_t i = 0; i < n_fields; i++) {
        size_t j = i + rng_below(r, (uint32_t)(BD_ARRAY_LEN(field_specs) - i));
        size_t t = fidx[i];
        fidx[i] = fidx[j];
        fidx[j] = t;
        field_value(r, &field_specs[fidx[i]], val, sizeof(val));
        n +=
            (size_t)sprintf(out + n, "%c%s=%s", i == 0 ? ' ' : ',', field_specs[fidx[i]].name, val);
    }
    n += (size_t)sprintf(out + n, " %" PRId64 "\n", ts);
    return n - 1;
}

/* Appends one graphite line: "site.line.device.metric[;k=v...] value ts". */
static size_t gen_graphite(struct rng *r, int64_t ts, char *out) {
    char val[64];
    const struct field_spec *f = &field_specs[rng_below(r, BD_ARRAY_LEN(field_specs))];
    size_t n = (size_t)sprintf(out, "plant-%u.line-%u.dev-%04u.%s", 1 + rng_below(r, 12),
                               1 + rng_below(r, 6), rng_below(r, 10000), f->name);
    /* A third of the lines carry Graphite 1.1 tags. */
    if (rng_below(r, 3) == 0) {
        n += (size_t)sprintf(out + n, ";region=%s;unit=%s",
                             regions[rng_below(r, BD_ARRAY_LEN(regions))],
                             f->kind == FK_INT ? "count" : "si");
    }
    /* Graphite values carry no type suffix. */
    field_value(r, f, val, sizeof(val));
    size_t vl = strlen(val);
    if (vl > 0 && val[vl - 1] == 'i') {
        val[vl - 1] = '\0';
    }
    n += (size_t)sprintf(out + n, " %s %" PRId64 "\n", val, ts / BD_NS_PER_S);
    return n - 1;
}

struct corpus {
    char *buf;
    size_t len;
    size_t lines;
};

static int corpus_build(struct corpus *c, enum bd_format fmt, size_t lines, uint64_t seed) {
    struct rng r = {seed};
    char line[MAX_LINE_BYTES];
    size_t cap = lines * (LINE_MAX + 2);
    int64_t ts = INT64_C(1736949600) * BD_NS_PER_S;

    c->buf = malloc(cap);
    c->len = 0;
    c->lines = 0;
    if (c->buf == NULL) {
        return -ENOMEM;
    }
    while (c->lines < lines) {
        /* Readings about 1 ms apart with sub-millisecond jitter, as a busy gateway sees them. */
        ts += 1000000 + (int64_t)rng_below(&r, 1000000);
        size_t n = fmt == BD_FORMAT_INFLUX ? gen_influx(&r, ts, line) : gen_graphite(&r, ts, line);
        if (fmt == BD_FORMAT_INFLUX && (n < LINE_MIN || n > LINE_MAX)) {
            continue; /* Rejection sampling keeps every influx line within 80-120 bytes. */
        }
        memcpy(c->buf + c->len, line, n + 1);
        c->len += n + 1;
        c->lines++;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Timed passes                                                                             */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The ceiling: find every line the way any line reader must, and touch nothing else. */
static uint64_t pass_memchr(const struct corpus *c) {
    const char *p = c->buf;
    const char *end = c->buf + c->len;
    uint64_t sum = 0;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            nl = end;
        }
        sum += (uint64_t)(nl - p);
        p = nl + 1;
    }
    return sum;
}

/* The same split, and every line through the parser. Returns the number of rejected lines. */
static uint64_t pass_parse(const struct corpus *c, struct bd_parser *parser, struct bd_point *pt,
                           uint64_t *check) {
    const char *p = c->buf;
    const char *end = c->buf + c->len;
    uint64_t bad = 0;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            nl = end;
        }
        int rc = bd_parse_line(parser, p, (size_t)(nl - p), pt, NULL);
        if (rc != BD_PARSE_OK) {
            bad++;
        } else {
            /* Consume the result so no part of the parse can be optimised away. */
            *check += pt->n_fields + pt->series_key.len + (uint64_t)pt->time_ns;
        }
        p = nl + 1;
    }
    return bad;
}

/* The batch interface the daemon uses: the parser finds the lines itself (no memchr). */
static uint64_t pass_batch(const struct corpus *c, struct bd_parser *parser, struct bd_point *pt,
                           uint64_t *check) {
    uint64_t bad = 0;
    int rc;
    bd_parse_begin(parser, c->buf, c->len);
    while ((rc = bd_parse_next(parser, pt, NULL, NULL)) != BD_PARSE_END) {
        if (rc != BD_PARSE_OK) {
            bad++;
        } else {
            *check += pt->n_fields + pt->series_key.len + (uint64_t)pt->time_ns;
        }
    }
    return bad;
}

struct result {
    double parse_lps;
    double batch_lps;
    double memchr_lps;
};

static int bench_format(enum bd_format fmt, size_t lines, int runs, double min_time,
                        uint64_t seed) {
    struct corpus c = {0};
    struct bd_parser parser;
    struct bd_point *pt = NULL;
    struct result best = {0.0, 0.0, 0.0};
    uint64_t check = 0;
    int rc = 0;
    bool parser_ready = false;

    rc = corpus_build(&c, fmt, lines, seed);
    if (rc != 0) {
        fprintf(stderr, "bench_parse: out of memory for %zu lines\n", lines);
        goto out;
    }
    pt = malloc(sizeof(*pt));
    if (pt == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    rc = bd_parser_init(&parser, fmt, BD_PREC_NS, 64 * 1024);
    if (rc != 0) {
        fprintf(stderr, "bench_parse: bd_parser_init failed (%d)\n", rc);
        goto out;
    }
    parser_ready = true;

    /* A warm-up pass that also proves every generated line is valid. */
    uint64_t bad = pass_parse(&c, &parser, pt, &check) + pass_batch(&c, &parser, pt, &check);
    if (bad != 0) {
        fprintf(stderr, "bench_parse: %" PRIu64 " of %zu generated %s lines were rejected\n", bad,
                c.lines, bd_format_name(fmt));
        rc = -EINVAL;
        goto out;
    }

    for (int run = 0; run < runs; run++) {
        size_t passes = 0;
        double t0 = now_s();
        double t1 = t0;
        while (t1 - t0 < min_time) {
            pass_parse(&c, &parser, pt, &check);
            passes++;
            t1 = now_s();
        }
        double lps = (double)(passes * c.lines) / (t1 - t0);
        best.parse_lps = BD_MAX(best.parse_lps, lps);

        passes = 0;
        t0 = now_s();
        t1 = t0;
        while (t1 - t0 < min_time) {
            pass_batch(&c, &parser, pt, &check);
            passes++;
            t1 = now_s();
        }
        lps = (double)(passes * c.lines) / (t1 - t0);
        best.batch_lps = BD_MAX(best.batch_lps, lps);

        passes = 0;
        t0 = now_s();
        t1 = t0;
        while (t1 - t0 < min_time) {
            check += pass_memchr(&c);
            passes++;
            t1 = now_s();
        }
        lps = (double)(passes * c.lines) / (t1 - t0);
        best.memchr_lps = BD_MAX(best.memchr_lps, lps);
    }

    double avg_len = (double)c.len / (double)c.lines - 1.0;
    printf("{\"format\":\"%s\",\"lines\":%zu,\"bytes\":%zu,\"avg_line_bytes\":%.1f,\"runs\":%d,"
           "\"parse_lines_per_s\":%.0f,\"memchr_lines_per_s\":%.0f,\"ratio\":%.4f,"
           "\"parse_mib_per_s\":%.1f,\"ns_per_line\":%.1f,\"batch_lines_per_s\":%.0f,"
           "\"batch_ratio\":%.4f,\"batch_ns_per_line\":%.1f,\"check\":%" PRIu64 "}\n",
           bd_format_name(fmt), c.lines, c.len, avg_len, runs, best.parse_lps, best.memchr_lps,
           best.parse_lps / best.memchr_lps, best.parse_lps * (avg_len + 1.0) / (1024.0 * 1024.0),
           1e9 / best.parse_lps, best.batch_lps, best.batch_lps / best.memchr_lps,
           1e9 / best.batch_lps, check & 0xff);
    fflush(stdout);

out:
    if (parser_ready) {
        bd_parser_close(&parser);
    }
    free(pt);
    free(c.buf);
    return rc;
}

static int dump(const char *path, enum bd_format fmt, size_t lines, uint64_t seed) {
    struct corpus c = {0};
    FILE *f = NULL;
    int rc = corpus_build(&c, fmt, lines, seed);
    if (rc != 0) {
        goto out;
    }
    f = fopen(path, "wb");
    if (f == NULL || fwrite(c.buf, 1, c.len, f) != c.len) {
        fprintf(stderr, "bench_parse: cannot write %s: %s\n", path, strerror(errno));
        rc = -EIO;
        goto out;
    }
out:
    if (f != NULL && fclose(f) != 0 && rc == 0) {
        rc = -EIO;
    }
    free(c.buf);
    return rc;
}

static void usage(FILE *out) {
    fprintf(out, "usage: bench_parse [--format influx|graphite|all] [--lines N] [--runs N]\n"
                 "                   [--min-time SECONDS] [--seed N] [--dump FILE]\n");
}

int main(int argc, char **argv) {
    const char *format = "all";
    const char *dump_path = NULL;
    size_t lines = 100000;
    int runs = 7;
    double min_time = 0.3;
    uint64_t seed = 1;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (v == NULL) {
            usage(stderr);
            return 2;
        }
        if (strcmp(a, "--format") == 0) {
            format = v;
        } else if (strcmp(a, "--lines") == 0) {
            lines = strtoull(v, NULL, 10);
        } else if (strcmp(a, "--runs") == 0) {
            runs = atoi(v);
        } else if (strcmp(a, "--min-time") == 0) {
            min_time = strtod(v, NULL);
        } else if (strcmp(a, "--seed") == 0) {
            seed = strtoull(v, NULL, 10);
        } else if (strcmp(a, "--dump") == 0) {
            dump_path = v;
        } else {
            usage(stderr);
            return 2;
        }
        i++;
    }
    if (lines == 0 || runs < 1 || min_time <= 0.0) {
        usage(stderr);
        return 2;
    }
    if (dump_path != NULL) {
        enum bd_format fmt =
            strcmp(format, "graphite") == 0 ? BD_FORMAT_GRAPHITE : BD_FORMAT_INFLUX;
        return dump(dump_path, fmt, lines, seed) == 0 ? 0 : 1;
    }

    bool all = strcmp(format, "all") == 0;
    int rc = 0;
    if (all || strcmp(format, "influx") == 0) {
        rc |= bench_format(BD_FORMAT_INFLUX, lines, runs, min_time, seed);
    }
    if (all || strcmp(format, "graphite") == 0) {
        rc |= bench_format(BD_FORMAT_GRAPHITE, lines, runs, min_time, seed);
    }
    if (!all && strcmp(format, "influx") != 0 && strcmp(format, "graphite") != 0) {
        usage(stderr);
        return 2;
    }
    return rc == 0 ? 0 : 1;
}
