/*
 * Sensor table (src/sensor.c): acceptance rules, counted drops, the ring encoding and the
 * dirty hand-off, driven with hand-built points on one thread.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "bucketd/sensor.h"

#define NOW (INT64_C(1736949600) * BD_NS_PER_S)

static struct bd_config cfg;
static struct bd_stats stats;
static struct bd_sensor_table *table;
static struct bd_point pt;
static int wakes;

static void on_wake(void *arg) {
    (void)arg;
    wakes++;
}

static void setup(void) {
    memset(&cfg, 0, sizeof(cfg));
    memset(&stats, 0, sizeof(stats));
    cfg.limits.max_sensors = 4;
    cfg.limits.ring_size = 16;
    cfg.limits.max_fields = 8;
    cfg.buckets.max_late_ms = 3600 * 1000;
    cfg.buckets.max_future_ms = 60 * 1000;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    bd_sensor_table_set_wake(table, on_wake, NULL);
    wakes = 0;
}

static void teardown(void) {
    bd_sensor_table_free(table);
}

TestSuite(sensor, .init = setup, .fini = teardown);

static struct bd_str S(const char *s) {
    return (struct bd_str){s, strlen(s)};
}

/* A point "m,tag=v f1=... [t]" built by hand. */
static void point(const char *key, const char *name, bool has_time, int64_t t) {
    memset(&pt, 0, sizeof(pt));
    pt.series_key = S(key);
    pt.name = S(name);
    pt.has_time = has_time;
    pt.time_ns = t;
}

static void add_float(const char *k, double v) {
    struct bd_field *f = &pt.fields[pt.n_fields++];
    f->key = S(k);
    f->kind = BD_VAL_FLOAT;
    f->v.f = v;
}

static void add_kind(const char *k, enum bd_value_kind kind, int64_t v) {
    struct bd_field *f = &pt.fields[pt.n_fields++];
    f->key = S(k);
    f->kind = kind;
    if (kind == BD_VAL_STRING) {
        f->v.s = S("text");
    } else if (kind == BD_VAL_BOOL) {
        f->v.b = v != 0;
    } else {
        f->v.i = v;
    }
}

Test(sensor, accepted_reading_round_trips_through_the_ring) {
    point("m,a=b", "m", true, NOW - 5);
    pt.tags[0] = (struct bd_tag){S("a"), S("b")};
    pt.n_tags = 1;
    add_float("temp", 21.5);
    add_kind("n", BD_VAL_INT, -7);
    add_kind("u", BD_VAL_UINT, 9);
    add_kind("on", BD_VAL_BOOL, 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 1);
    cr_assert_eq(bd_sensor_table_count(table), 1);

    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    cr_assert_str_eq(s->id, "m,a=b");
    cr_assert_str_eq(s->measurement, "m");
    cr_assert_eq(s->n_tags, 1);
    cr_assert_str_eq(s->tag_values[0], "b");
    cr_assert_null(bd_sensor_table_next_dirty(table), "queued once");

    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    uint32_t cells = bd_sensor_peek_reading(s, &ts, vals, &n);
    cr_assert_eq(cells, 5);
    cr_assert_eq(n, 4);
    cr_assert_eq(ts, NOW - 5);
    cr_assert_str_eq(s->field_names[vals[0].field], "temp");
    cr_assert_eq(vals[0].v.f, 21.5);
    cr_assert_eq(vals[1].kind, BD_VAL_INT);
    cr_assert_eq(vals[1].v.i, -7);
    cr_assert_eq(vals[2].kind, BD_VAL_UINT);
    cr_assert_eq(vals[2].v.u, 9);
    cr_assert_eq(vals[3].kind, BD_VAL_BOOL);
    cr_assert(vals[3].v.b);
    bd_ring_consume(&s->ring, cells);
    cr_assert_eq(bd_sensor_peek_reading(s, &ts, vals, &n), 0);
}

Test(sensor, missing_timestamp_means_arrival_time) {
    point("m", "m", false, 0);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    int64_t ts;
    struct bd_reading_value vals[4];
    uint32_t n;
    cr_assert_gt(bd_sensor_peek_reading(s, &ts, vals, &n), 0);
    cr_assert_eq(ts, NOW);
}

Test(sensor, time_window_drops_are_counted) {
    point("m", "m", true, NOW - INT64_C(3601) * BD_NS_PER_S);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    pt.time_ns = NOW + INT64_C(61) * BD_NS_PER_S;
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    pt.time_ns = NOW - INT64_C(3600) * BD_NS_PER_S;
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "the window edge is inside");
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_old), 1);
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_new), 1);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 1);
}

Test(sensor, strings_are_dropped_and_counted) {
    point("m", "m", true, NOW);
    add_kind("s", BD_VAL_STRING, 0);
    add_float("v", 2);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, string_fields_dropped), 1);
    point("m", "m", true, NOW);
    add_kind("s", BD_VAL_STRING, 0);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_no_numeric), 1);
    cr_assert_eq(BD_STAT_GET(&stats, string_fields_dropped), 2);
}

Test(sensor, names_unusable_in_bson_are_refused) {
    const char *bad_fields[] = {"a.b", "$x", "ts", ""};
    for (size_t i = 0; i < sizeof(bad_fields) / sizeof(bad_fields[0]); i++) {
        point("m", "m", true, NOW);
        add_float(bad_fields[i], 1);
        cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "field '%s'", bad_fields[i]);
    }
    point("m\xff", "m\xff", true, NOW);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "invalid UTF-8 measurement");
    point("m,a.b=c", "m", true, NOW);
    pt.tags[0] = (struct bd_tag){S("a.b"), S("c")};
    pt.n_tags = 1;
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "dotted tag key");
    cr_assert_eq(BD_STAT_GET(&stats, drop_bad_name), 6);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 0);
}

Test(sensor, too_many_fields) {
    point("m", "m", true, NOW);
    char names[9][4];
    for (int i = 0; i < 9; i++) {
        snprintf(names[i], sizeof(names[i]), "f%d", i);
        add_float(names[i], i);
    }
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_many_fields), 1);
}

Test(sensor, full_ring_counts_drops_and_wakes_the_flusher) {
    /* 16 cells, 2 cells per reading: 8 fit. */
    int accepted = 0;
    for (int i = 0; i < 10; i++) {
        point("m", "m", true, NOW);
        add_float("v", i);
        accepted += bd_sensor_table_accept(table, &pt, NOW) == 0;
    }
    cr_assert_eq(accepted, 8);
    cr_assert_eq(BD_STAT_GET(&stats, drop_ring_full), 2);
    cr_assert_geq(wakes, 1, "crossing the high-water mark rings the doorbell");
    cr_assert(bd_sensor_table_congested(table));

    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    int64_t ts;
    struct bd_reading_value vals[4];
    uint32_t n, cells;
    int seen = 0;
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
        cr_assert_eq(vals[0].v.f, (double)seen, "FIFO order");
        bd_ring_consume(&s->ring, cells);
        seen++;
    }
    cr_assert_eq(seen, 8);
    cr_assert_not(bd_sensor_table_congested(table), "drained below the low-water mark");
}

Test(sensor, sensor_limit) {
    char keys[5][8];
    for (int i = 0; i < 5; i++) {
        snprintf(keys[i], sizeof(keys[i]), "s%d", i);
        point(keys[i], keys[i], true, NOW);
        add_float("v", 1);
        bd_sensor_table_accept(table, &pt, NOW);
    }
    cr_assert_eq(bd_sensor_table_count(table), 4);
    cr_assert_eq(BD_STAT_GET(&stats, drop_sensor_limit), 1);
}

Test(sensor, dirty_again_after_the_consumer_cleared_it) {
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    /* A reading pushed after the pop (before the drain) must queue the sensor again. */
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(bd_ring_used(&s->ring), 4);
}

Test(sensor, many_sensors_grow_the_index) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 5000;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    char key[32];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 5000; i++) {
            snprintf(key, sizeof(key), "sensor-%d", i);
            point(key, key, true, NOW);
            add_float("v", i);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
        }
    }
    cr_assert_eq(bd_sensor_table_count(table), 5000);
    int n = 0;
    while (bd_sensor_table_next_dirty(table) != NULL) {
        n++;
    }
    cr_assert_eq(n, 5000, "each sensor queued exactly once");
}
