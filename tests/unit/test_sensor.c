/*
 * Sensor table (src/sensor.c): acceptance rules, counted drops, the ring encoding and the
 * dirty hand-off, driven with hand-built points on one thread.
 */
#include <criterion/criterion.h>
#include <malloc.h>
#include <string.h>
#include <xxhash.h>

/*
 * White box: the module is compiled into this test (its definitions take the place of the
 * library's) with XXH3 routed through a hook, so tests can force full-hash and slot
 * collisions that real keys would almost never produce.
 */
static bool force_hash;
static uint64_t forced_hash;
/* When set, the forced hash of key "s<i>" is forced_of(i): the table hashes a sensor's id again
 * when it moves it within the index, and must get the same hash as at its creation. */
static uint64_t (*forced_of)(int i);
static XXH64_hash_t hooked_xxh3(const void *p, size_t len) {
    if (!force_hash) {
        return XXH3_64bits(p, len);
    }
    if (forced_of == NULL) {
        return forced_hash;
    }
    int i = 0;
    for (size_t k = 1; k < len; k++) {
        i = i * 10 + (((const char *)p)[k] - '0');
    }
    return forced_of(i);
}
#define XXH3_64bits hooked_xxh3
#include "../../src/sensor.c"

#include "bucketd/bucket.h"
#include "bucketd/pages.h"

_Static_assert(FLUSHER_SENSOR_COST == BD_PAGES_ONE_SLOT_BYTES,
               "the table charges what the flusher's pages of one slot take");
#undef XXH3_64bits

#define NOW (INT64_C(1736949600) * BD_NS_PER_S)

static struct bd_config cfg;
static struct bd_stats stats;
static struct bd_sensor_table *table;
static struct bd_point pt;
static int wakes;

static int drain_expect(struct bd_sensor *s, double want);
static void table_with(uint32_t max_name, uint64_t sensor_memory, uint64_t idle_ms);
static void drain_and_hand_back(struct bd_sensor *s);

static void on_wake(void *arg) {
    (void)arg;
    wakes++;
}

static void setup(void) {
    memset(&cfg, 0, sizeof(cfg));
    memset(&stats, 0, sizeof(stats));
    cfg.limits.max_sensors = 4;
    cfg.limits.memory = 32 * 1024; /* a pool of 16 segments of 60 cells */
    cfg.limits.max_fields = 8;
    cfg.buckets.max_late_ms = 3600 * 1000;
    cfg.buckets.max_future_ms = 60 * 1000;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    bd_sensor_table_set_wake(table, on_wake, NULL);
    wakes = 0;
    force_hash = false;
    forced_of = NULL;
}

static void teardown(void) {
    bd_sensor_table_free(table);
}

TestSuite(sensor, .init = setup, .fini = teardown);

static struct bd_str S(const char *s) {
    return (struct bd_str){s, strlen(s)};
}

/* A point "m,tag=v f1=... [t]" built by hand. */
static void
point(const char *key, const char *name, bool has_time, int64_t t) {
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
    cr_assert_str_eq(s->id_buf, "m,a=b");
    cr_assert_str_eq(bd_sensor_measurement(s), "m");
    cr_assert_eq(s->n_tags, 1);
    cr_assert_str_eq(bd_sensor_tag_value(s, 0), "b");
    cr_assert_null(bd_sensor_table_next_dirty(table), "queued once");

    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    uint32_t cells = bd_sensor_peek_reading(s, &ts, vals, &n);
    cr_assert_eq(cells, 5);
    cr_assert_eq(n, 4);
    cr_assert_eq(ts, NOW - 5);
    cr_assert_str_eq(bd_sensor_field_name(s, vals[0].field), "temp");
    cr_assert_eq(vals[0].v.f, 21.5);
    cr_assert_eq(vals[1].kind, BD_VAL_INT);
    cr_assert_eq(vals[1].v.i, -7);
    cr_assert_eq(vals[2].kind, BD_VAL_UINT);
    cr_assert_eq(vals[2].v.u, 9);
    cr_assert_eq(vals[3].kind, BD_VAL_BOOL);
    cr_assert(vals[3].v.b);
    bd_sensor_consume(s, cells);
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
    /* Empty, invalid UTF-8 or holding a NUL: no escape makes these a key. */
    static const struct bd_str bad_fields[] = {{"", 0}, {"a\xff", 2}, {"a\0b", 3}};
    for (size_t i = 0; i < sizeof(bad_fields) / sizeof(bad_fields[0]); i++) {
        point("m", "m", true, NOW);
        struct bd_field *f = &pt.fields[pt.n_fields++];
        f->key = bad_fields[i];
        f->kind = BD_VAL_FLOAT;
        cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "field %zu", i);
    }
    point("m\xff", "m\xff", true, NOW);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "invalid UTF-8 measurement");
    point("m,a\xff=c", "m", true, NOW);
    pt.tags[0] = (struct bd_tag){S("a\xff"), S("c")};
    pt.n_tags = 1;
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0, "invalid UTF-8 tag key");
    cr_assert_eq(BD_STAT_GET(&stats, drop_bad_name), 5);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 0);
}

Test(sensor, names_mongodb_cannot_address_are_stored_escaped) {
    /* Short and long names, some past the first line's short forms (BD_SENSOR_KEY_SLOTS), so
     * both ways of matching a name see escaped ones; then the same line again, fields in
     * another order: every name must be found, none appended twice. */
    static const char *sent[] = {"cpu.user", "$x", "ts", "ok", "k8s.pod.restarts", "%", "a$b"};
    static const char *stored[] = {"cpu%2Euser",           "%24x", "%74s", "ok",
                                   "k8s%2Epod%2Erestarts", "%25",  "a$b"};
    cfg.limits.max_fields = 8;
    for (int pass = 0; pass < 2; pass++) {
        point("m,host.name=h1,k8s.pod=x", "m", true, NOW);
        pt.tags[0] = (struct bd_tag){S("host.name"), S("h1")};
        pt.tags[1] = (struct bd_tag){S("k8s.pod"), S("x")};
        pt.tags[2] = (struct bd_tag){S("ts"), S("$t")};
        pt.n_tags = 3;
        for (int i = 0; i < 7; i++) {
            int k = pass == 0 ? i : 6 - i;
            add_float(sent[k], k);
        }
        cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "pass %d", pass);
    }
    cr_assert_eq(BD_STAT_GET(&stats, drop_bad_name), 0);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 2);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_str_eq(s->id_buf, "m,host.name=h1,k8s.pod=x", "the id keeps the series key");
    cr_assert_str_eq(bd_sensor_tag_key(s, 0), "host%2Ename");
    cr_assert_str_eq(bd_sensor_tag_key(s, 1), "k8s%2Epod");
    cr_assert_str_eq(bd_sensor_tag_key(s, 2), "ts", "ts is reserved in readings only");
    cr_assert_str_eq(bd_sensor_tag_value(s, 2), "$t", "values are not names");
    cr_assert_eq(atomic_load(&s->n_fields), 7);
    for (int i = 0; i < 7; i++) {
        cr_assert_str_eq(bd_sensor_field_name(s, (uint32_t)i), stored[i]);
    }
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    bd_sensor_consume(s, bd_sensor_peek_reading(s, &ts, vals, &n));
    cr_assert_eq(bd_sensor_peek_reading(s, &ts, vals, &n), 8);
    for (uint32_t i = 0; i < 7; i++) {
        cr_assert_eq(vals[i].field, 6 - i, "value %u: the index first given", i);
        cr_assert_eq(vals[i].v.f, 6 - i);
    }
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

/* Readings of s drained in order: each must carry the next value from *next in field 0. */
static int drain_in_order(struct bd_sensor *s, int *next) {
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n, cells;
    int seen = 0;
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
        cr_assert_eq(vals[0].v.f, (double)*next, "FIFO order");
        bd_sensor_consume(s, cells);
        (*next)++;
        seen++;
    }
    return seen;
}

Test(sensor, full_pool_counts_drops_and_wakes_the_flusher) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 16;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    bd_sensor_table_set_wake(table, on_wake, NULL);
    const struct bd_pool *pool = bd_sensor_table_pool(table);
    cr_assert_eq(pool->n_segs, 16);
    cr_assert_eq(pool->seg_cells, 60);
    /* 2 cells per reading: 30 a segment, 480 in the pool. Nine sensors in turn, 100 readings
     * each: all nine start with a segment; each may hold its share of 2, so seven fill two
     * segments and the pool runs out for the last two. */
    int accepted = 0, busy = 0;
    char key[16];
    for (int i = 0; i < 900; i++) {
        snprintf(key, sizeof(key), "m%d", i % 9);
        point(key, "m", true, NOW);
        add_float("v", i);
        int rc = bd_sensor_table_accept(table, &pt, NOW);
        accepted += rc == 0;
        busy += rc == -EAGAIN;
    }
    cr_assert_eq(accepted, 480);
    cr_assert_eq(busy, 7 * 40, "the seven sensors at their share");
    cr_assert_eq(BD_STAT_GET(&stats, drop_buffer_full), 2 * 70, "the two left without a segment");
    cr_assert_eq(bd_pool_in_use(pool), 16);
    cr_assert_eq(bd_pool_high_water(pool), 16);
    cr_assert_eq(wakes, 2,
                 "at a quarter, where it is congested, and when a sensor first reached its share");
    cr_assert(bd_sensor_table_congested(table));

    int drained = 0;
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        int64_t ts;
        struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            drained++;
            bd_sensor_consume(s, cells);
        }
    }
    cr_assert_eq(drained, 480);
    /* Every segment a producer left went back; their own (full) ones stay until they move on. */
    cr_assert_eq(bd_pool_in_use(pool), 9);
    cr_assert(bd_sensor_table_congested(table), "9 of 16 segments: not yet down to an eighth");
}

Test(sensor, an_idle_sensor_gives_its_last_segment_back) {
    const struct bd_pool *pool = bd_sensor_table_pool(table);
    point("m", "m", true, NOW);
    add_float("v", 0);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_pool_in_use(pool), 1);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    int next = 0;
    cr_assert_eq(drain_in_order(s, &next), 1);
    cr_assert_eq(bd_pool_in_use(pool), 1, "the producer's segment: only it may leave it");
    /* The producer takes the report, seals the segment and queues the sensor once more. */
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(drain_in_order(s, &next), 0);
    cr_assert_eq(bd_pool_in_use(pool), 0, "a quiet sensor holds no segment");
    cr_assert_null(bd_sensor_table_next_dirty(table));
    /* And it starts a new chain when it speaks again. */
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(drain_in_order(s, &next), 1);
    cr_assert_eq(next, 2);
}

Test(sensor, a_report_overtaken_by_a_push_keeps_the_segment) {
    const struct bd_pool *pool = bd_sensor_table_pool(table);
    point("m", "m", true, NOW);
    add_float("v", 0);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    int next = 0;
    cr_assert_eq(drain_in_order(s, &next), 1); /* reports the segment idle */
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0); /* ... but a reading follows */
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_pool_in_use(pool), 1);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(drain_in_order(s, &next), 1, "the reading after the report is not lost");
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(drain_in_order(s, &next), 0);
    cr_assert_eq(bd_pool_in_use(pool), 0);
}

Test(sensor, many_quiet_sensors_share_a_small_pool) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 1000;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    const struct bd_pool *pool = bd_sensor_table_pool(table);
    char key[32];
    /* 1000 sensors, one reading each, through 16 segments: drained and taken back as they go. */
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "sensor-%d", i);
        point(key, key, true, NOW);
        add_float("v", i);
        cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "sensor %d", i);
        bd_sensor_table_publish(table);
        struct bd_sensor *s;
        while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
            drain_expect(s, i);
        }
        cr_assert_leq(bd_pool_in_use(pool), 2);
    }
    cr_assert_eq(BD_STAT_GET(&stats, drop_buffer_full), 0);
    cr_assert_leq(bd_pool_high_water(pool), 2);
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

/* A reload's limits: max_sensors within the queues' capacity (the next power of two of the
 * start value), max_fields up to the start value; the time window freely. */
Test(sensor, a_reload_changes_the_limits_and_the_time_window) {
    uint32_t sensors_room, fields_room;
    bd_sensor_table_limits_room(table, &sensors_room, &fields_room);
    cr_assert_eq(sensors_room, 4, "the queues hold next_pow2(4) sensors");
    cr_assert_eq(fields_room, 8);

    struct bd_config next = cfg;
    next.limits.max_sensors = 2;
    next.limits.max_fields = 1;
    next.buckets.max_late_ms = 7200 * 1000;
    next.buckets.max_future_ms = 0;
    bd_sensor_table_set_limits(table, &next);
    char keys[3][8];
    for (int i = 0; i < 3; i++) {
        snprintf(keys[i], sizeof(keys[i]), "s%d", i);
        point(keys[i], keys[i], true, NOW - INT64_C(7000) * BD_NS_PER_S);
        add_float("v", 1);
        bd_sensor_table_accept(table, &pt, NOW);
    }
    cr_assert_eq(bd_sensor_table_count(table), 2);
    cr_assert_eq(BD_STAT_GET(&stats, drop_sensor_limit), 1);
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_old), 0, "within the longer max_late");
    point("s0", "s0", true, NOW + BD_NS_PER_S);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_new), 1, "max_future 0");
    point("s0", "s0", true, NOW);
    add_float("v", 1);
    add_float("w", 2);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_too_many_fields), 1, "max_fields 1");

    /* Raised again: the sensors known stay, and a new one fits. */
    next.limits.max_sensors = 4;
    next.limits.max_fields = 8;
    bd_sensor_table_set_limits(table, &next);
    point("s2", "s2", true, NOW);
    add_float("v", 1);
    add_float("w", 2);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(bd_sensor_table_count(table), 3);
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
    cr_assert_eq(drain_expect(s, 1), 2);
}

Test(sensor, many_sensors_grow_the_index) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 5000;
    cfg.limits.memory = 32 << 20; /* a segment for every sensor, under half the pool */
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

/* Drains s, returning how many readings it held; each must carry value `want` in field 0. */
static int drain_expect(struct bd_sensor *s, double want) {
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n, cells;
    int seen = 0;
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
        cr_assert_eq(vals[0].v.f, want, "%s: reading of another sensor", s->id_buf);
        bd_sensor_consume(s, cells);
        seen++;
    }
    return seen;
}

Test(sensor, equal_full_hashes_are_told_apart_by_the_id) {
    /* Same hash for every key: same length different bytes, and different lengths. */
    static const char *keys[] = {"m,x=1", "m,x=2", "m,x=10", "m"};
    force_hash = true;
    forced_hash = UINT64_C(0x1234567800000007);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 4; i++) {
            point(keys[i], "m", true, NOW);
            add_float("v", i);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
        }
    }
    cr_assert_eq(bd_sensor_table_count(table), 4, "one sensor per distinct id");
    struct bd_sensor *s;
    int found = 0;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        int i = 0;
        while (strcmp(keys[i], s->id_buf) != 0) {
            i++;
        }
        cr_assert_eq(s->id_len, strlen(keys[i]));
        cr_assert_eq(drain_expect(s, i), 3, "%s: its own three readings", s->id_buf);
        found++;
    }
    cr_assert_eq(found, 4);
}

static uint64_t same_slot(int i) {
    return ((uint64_t)(i + 1) << 40) | 5; /* same low bits: same slot */
}

Test(sensor, slot_collisions_with_other_hashes_probe_on) {
    /* Every hash lands on the same slot but differs above the index bits: each probe meets
     * other sensors' entries and must reject them on the slot's tag (the hash's top 16 bits)
     * or, where the tags are equal (most of them here), on the sensor's id. */
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 3000;
    cfg.limits.memory = 16 << 20; /* a segment for every sensor */
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    force_hash = true;
    forced_of = same_slot;
    char key[32];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 3000; i++) {
            snprintf(key, sizeof(key), "s%d", i);
            point(key, "s", true, NOW);
            add_float("v", i);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
        }
    }
    cr_assert_eq(bd_sensor_table_count(table), 3000, "found again, not created twice");
    cr_assert_geq(table->slot_mask + 1, 6000u, "the index stays at most half full");
    int n = 0;
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        cr_assert_eq(drain_expect(s, atoi(s->id_buf + 1)), 2);
        n++;
    }
    cr_assert_eq(n, 3000);
}

/* Where sensor addresses use the tag's bits, the index drops the tags and keeps bare addresses:
 * lookups, growth and eviction (the shift of a probe run) go on, reading each sensor's hash. */
/* The flusher's part, until nothing moves: every queue drained, every segment handed back. */
static void drain_everything(void) {
    int popped;
    do {
        bd_sensor_table_publish(table);
        popped = 0;
        struct bd_sensor *s;
        while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
            int64_t ts;
            struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
            uint32_t n, cells;
            while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
                bd_sensor_consume(s, cells);
            }
            popped++;
        }
    } while (popped > 0);
}

static uint64_t shared_runs(int i) {
    return ((uint64_t)(i % 7) << 52) | (uint64_t)(i % 3); /* long shared runs */
}

Test(sensor, an_index_without_tags_finds_grows_and_evicts) {
    const int64_t idle_ns = 60 * BD_NS_PER_S;
    cfg.limits.max_sensors = 3000;
    cfg.limits.memory = 16 << 20;
    table_with(0, 0, 60000);
    force_hash = true;
    forced_of = shared_runs;
    char key[32];
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "s%d", i);
        point(key, "s", true, NOW);
        add_float("v", i);
        cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
        if (i == 400) {
            drop_tags(table);
            cr_assert_eq(table->tag_mask, 0);
        }
    }
    cr_assert_eq(bd_sensor_table_count(table), 1000);
    cr_assert_gt(table->slot_mask + 1, 1024u, "grown after the tags went");
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "s%d", i);
        struct bd_str k = S(key);
        struct bd_sensor *s = lookup(table, &k, shared_runs(i));
        cr_assert_not_null(s, "%s", key);
        cr_assert_str_eq(s->id_buf, key);
    }
    /* Everyone drained and handed back; the even ones speak again, the odd ones are evicted
     * from the middle of the runs, and every even one is still found. */
    drain_everything();
    const int64_t later = NOW + 2 * idle_ns;
    for (int i = 0; i < 1000; i += 2) {
        snprintf(key, sizeof(key), "s%d", i);
        point(key, "s", true, later);
        add_float("v", i);
        cr_assert_eq(bd_sensor_table_accept(table, &pt, later), 0);
    }
    bd_sensor_table_sweep(table, later);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 500);
    cr_assert_eq(bd_sensor_table_count(table), 500);
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "s%d", i);
        struct bd_str k = S(key);
        struct bd_sensor *f = lookup(table, &k, shared_runs(i));
        if (i % 2 == 0) {
            cr_assert_not_null(f, "%s", key);
            cr_assert_str_eq(f->id_buf, key);
        } else {
            cr_assert_null(f, "%s evicted", key);
        }
    }
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_evicted(table)) != NULL) {
        bd_sensor_table_release(table, s);
    }
    drain_everything();
    cr_assert_eq(bd_pool_in_use(&table->pool), 0);
}

Test(sensor, short_and_long_field_names) {
    /* Names of 1, 7 and 8 bytes, two long ones sharing a prefix, and more fields than the
     * first line holds short forms for; then the same names in another order. */
    static const char *names[] = {"a", "seven77", "eight888", "temperature1", "temperature2", "f5"};
    cfg.limits.max_fields = 8;
    point("m", "m", true, NOW);
    for (int i = 0; i < 6; i++) {
        add_float(names[i], i);
    }
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_eq(atomic_load(&s->n_fields), 6);
    for (int i = 0; i < 6; i++) {
        cr_assert_str_eq(bd_sensor_field_name(s, i), names[i]);
    }
    cr_assert_eq(s->field_key[0], pack_key(&(struct bd_str){"a", 1}));
    cr_assert_neq(s->field_key[1], 0, "7 bytes: packed");
    cr_assert_eq(s->field_key[2], 0, "8 bytes: the string decides");
    cr_assert_eq(s->field_key[3], 0);

    point("m", "m", true, NOW);
    static const int order[] = {5, 4, 3, 2, 1, 0};
    for (int i = 0; i < 6; i++) {
        add_float(names[order[i]], order[i]);
    }
    add_float("seven7", 99);    /* a prefix of a packed name: new */
    add_float("eight8889", 98); /* a long name extending a long name: new */
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(atomic_load(&s->n_fields), 8);
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    bd_sensor_consume(s, bd_sensor_peek_reading(s, &ts, vals, &n));
    cr_assert_eq(bd_sensor_peek_reading(s, &ts, vals, &n), 9);
    for (uint32_t i = 0; i < 6; i++) {
        cr_assert_eq(vals[i].field, order[i], "value %u: same index as first seen", i);
        cr_assert_eq(vals[i].v.f, order[i]);
    }
    cr_assert_str_eq(bd_sensor_field_name(s, vals[6].field), "seven7");
    cr_assert_str_eq(bd_sensor_field_name(s, vals[7].field), "eight8889");
}

/* One allocation per sensor (a slab block): its measurement and tags follow the id in the
 * sensor's block, and a short field name needing no escape is read from its packed form,
 * allocating nothing. */
Test(sensor, short_names_and_the_tags_cost_no_allocation_of_their_own) {
    uint64_t empty = bd_sensor_table_memory(table);
    point("m,site=s000123", "m", true, NOW);
    pt.n_tags = 1;
    pt.tags[0].key = S("site");
    pt.tags[0].value = S("s000123");
    add_float("sixsix", 1); /* 6 bytes: in field_key */
    add_float("f1", 2);
    add_float("seven77", 3); /* 7 bytes: no room for the NUL, a string of its own */
    add_float("a.b", 4);     /* escaped: a string of its own */
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    const char *lo = (const char *)s, *hi = s->id_buf + 64;
    cr_assert(bd_sensor_measurement(s) > s->id_buf && bd_sensor_measurement(s) < hi,
              "measurement in the block");
    cr_assert(bd_sensor_tag_key(s, 0) > lo && bd_sensor_tag_key(s, 0) < hi);
    cr_assert_str_eq(bd_sensor_measurement(s), "m");
    cr_assert_str_eq(bd_sensor_tag_key(s, 0), "site");
    cr_assert_str_eq(bd_sensor_tag_value(s, 0), "s000123");
    cr_assert_eq(bd_sensor_field_name(s, 0), (const char *)&s->field_key[0] + 1);
    cr_assert_eq(bd_sensor_field_name(s, 1), (const char *)&s->field_key[1] + 1);
    cr_assert(bd_sensor_field_name(s, 2) < lo || bd_sensor_field_name(s, 2) >= hi);
    cr_assert(bd_sensor_field_name(s, 3) < lo || bd_sensor_field_name(s, 3) >= hi);
    cr_assert_str_eq(bd_sensor_field_name(s, 0), "sixsix");
    cr_assert_str_eq(bd_sensor_field_name(s, 1), "f1");
    cr_assert_str_eq(bd_sensor_field_name(s, 2), "seven77");
    cr_assert_str_eq(bd_sensor_field_name(s, 3), "a%2Eb"); /* names.h: "." escaped */
    /* The struct, the id, no tag offset (tag 0's key follows the measurement), the measurement
     * and the tag. */
    size_t block = offsetof(struct bd_sensor, id_buf) + sizeof("m,site=s000123") + sizeof("m") +
                   sizeof("site") + sizeof("s000123");
    cr_assert_eq(bd_slab_size(block), BD_SLAB_SMALL, "a 192-byte slab block");
    cr_assert_eq(s->slab_lines, 3);
    /* Charged: the block and the flusher's estimate, the names block (the first name that is
     * not inline brings it) and the two strings. */
    cr_assert_eq(bd_sensor_table_memory(table) - empty,
                 bd_slab_size(block) + FLUSHER_SENSOR_COST + sizeof(struct bd_sensor_names) +
                     sizeof("seven77") + sizeof("a%2Eb") + sizeof("a.b") + 3 * MALLOC_OVERHEAD);
    /* A second reading matches every name, inline or not, and frees cleanly at the end. */
    point("m,site=s000123", "m", true, NOW);
    add_float("a.b", 5);
    add_float("sixsix", 6);
    add_float("seven77", 7);
    add_float("f1", 8);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(atomic_load(&s->n_fields), 4);
}

/* Issue 28: a quiet short-named sensor (three short fields) costs one 192-byte block and the
 * flusher's estimate, nothing else: no names block, no string of its own. */
Test(sensor, a_short_named_sensor_is_one_192_byte_block) {
    uint64_t empty = bd_sensor_table_memory(table);
    point("m,site=s000123", "m", true, NOW);
    pt.n_tags = 1;
    pt.tags[0].key = S("site");
    pt.tags[0].value = S("s000123");
    add_float("f0", 1);
    add_float("f1", 2);
    add_float("f2", 3);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    cr_assert_eq((size_t)s->slab_lines * BD_SLAB_LINE, 192, "block of %u lines",
                 (unsigned)s->slab_lines);
    cr_assert_eq((uintptr_t)s % BD_SLAB_LINE, 0);
    cr_assert_null(s->names, "every name inline");
    cr_assert_eq(bd_sensor_table_memory(table) - empty, 192 + FLUSHER_SENSOR_COST);
    cr_assert_str_eq(bd_sensor_field_name(s, 2), "f2");
    cr_assert_str_eq(bd_sensor_tag_key(s, 0), "site");
    cr_assert_str_eq(bd_sensor_tag_value(s, 0), "s000123");
}

Test(sensor, reading_behind_a_cleared_flag_is_requeued_by_publish) {
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0); /* flag 0: queued at once */
    cr_assert_eq(table->n_recheck, 0);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0); /* flag 1: to the re-check list */
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(table->n_recheck, 1, "listed once per batch");

    /* Plays the race: the consumer pops and clears after the producer saw the flag set, and
     * (as far as the producer knows) drains before those readings arrived. */
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    cr_assert_null(bd_sensor_table_next_dirty(table));
    bd_sensor_table_publish(table);
    cr_assert_eq(table->n_recheck, 0);
    cr_assert_eq(s->recheck, 0);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s, "queued again by the re-check");
    cr_assert_null(bd_sensor_table_next_dirty(table), "once");
    cr_assert_eq(drain_expect(s, 1), 3);
}

Test(sensor, publish_leaves_a_queued_sensor_alone) {
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    bd_sensor_table_publish(table); /* still queued: nothing to do */
    bd_sensor_table_publish(table); /* empty list */
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    cr_assert_null(bd_sensor_table_next_dirty(table), "in the queue once");
    cr_assert_eq(drain_expect(s, 1), 2);
}

Test(sensor, publish_requeues_a_sensor_the_consumer_cleared_after_the_look) {
    point("m", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table); /* popped, nothing drained */
    cr_assert_not_null(s);
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    }
    /* The flag was already 0 again: queued directly. */
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    /* Now the flag is 0 but the producer saw 1 for the next readings (they go on the list). */
    atomic_store(&s->dirty, 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(table->n_recheck, 1);
    atomic_store(&s->dirty, 0); /* the consumer's clear, after the producer's look */
    bd_sensor_table_publish(table);
    cr_assert_eq(bd_sensor_table_next_dirty(table), s, "queued again by the re-check");
    cr_assert_eq(drain_expect(s, 1), 7);
}

Test(sensor, recheck_list_settles_itself_when_full) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = RECHECK_MAX + 10;
    cfg.limits.memory = 16 << 20; /* a segment for every sensor */
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    char key[32];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < RECHECK_MAX + 10; i++) {
            snprintf(key, sizeof(key), "s%d", i);
            point(key, "s", true, NOW);
            add_float("v", i);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
        }
    }
    cr_assert_eq(table->n_recheck, 10, "settled once at RECHECK_MAX");
    bd_sensor_table_publish(table);
    int n = 0;
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        cr_assert_eq(drain_expect(s, atoi(s->id_buf + 1)), 2);
        n++;
    }
    cr_assert_eq(n, RECHECK_MAX + 10, "each queued once");
}

Test(sensor, block_layout) {
    point("m,k=v", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_eq((uintptr_t)s % BD_RING_CACHELINE, 0, "sensor block 128-byte aligned");
    cr_assert_eq((uintptr_t)&s->wseg - (uintptr_t)s, BD_RING_LINE,
                 "the queue's producer line pairs with the first line");
    cr_assert_eq((uintptr_t)&s->rseg - (uintptr_t)s, 2 * BD_RING_LINE,
                 "what the flusher writes per reading is past the producer's line");
    cr_assert_eq(bd_sensor_id(s), s->id_buf);
    cr_assert_str_eq(bd_sensor_id(s), "m,k=v");
    cr_assert_str_eq(bd_sensor_measurement(s), "m");
}

/* The bytes of a sensor's names as sent: the id, the measurement, each tag key and value, each
 * with a NUL. */
static size_t names_bytes(const struct bd_point *p) {
    size_t n = p->series_key.len + 1 + p->name.len + 1;
    for (uint32_t i = 0; i < p->n_tags; i++) {
        n += p->tags[i].key.len + 1 + p->tags[i].value.len + 1;
    }
    return n;
}

/* bucketd-sim's ids (bench/edgemem.py) each take a 256-byte slab block (two units), the issue's
 * short ones (one tag, an id of up to 16 bytes) a 192-byte one, charged with the flusher's
 * estimate and nothing else while the fields are short. */
Test(sensor, bucketd_sim_ids_fit_a_256_byte_block) {
    static const struct {
        const char *id, *meas;
        uint32_t n;
        const char *k[3], *v[3];
        size_t block;
    } shapes[] = {
        {"m,site=s000123", "m", 1, {"site"}, {"s000123"}, 192},
        {"mx,site=s000123", "mx", 1, {"site"}, {"s000123"}, 192},
        {"m,site=s00012345", "m", 1, {"site"}, {"s00012345"}, 192},
        {"m,site=s000123456", "m", 1, {"site"}, {"s000123456"}, 256}, /* 17 bytes: the next */
        {"m1,sensor=s12345,site=plant-2", "m1", 2, {"sensor", "site"}, {"s12345", "plant-2"}, 256},
        {"m1,rack=r07,sensor=s12345,site=plant-2",
         "m1",
         3,
         {"rack", "sensor", "site"},
         {"r07", "s12345", "plant-2"},
         256},
    };
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 8;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++) {
        uint64_t before = bd_sensor_table_memory(table);
        point(shapes[k].id, shapes[k].meas, true, NOW);
        pt.n_tags = shapes[k].n;
        for (uint32_t i = 0; i < shapes[k].n; i++) {
            pt.tags[i] = (struct bd_tag){S(shapes[k].k[i]), S(shapes[k].v[i])};
        }
        add_float("f0", 1);
        add_float("f1", 2);
        add_float("f2", 3);
        cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "%s", shapes[k].id);
        struct bd_sensor *s = bd_sensor_table_next_dirty(table);
        cr_assert_not_null(s);
        cr_assert_str_eq(bd_sensor_id(s), shapes[k].id);
        cr_assert_eq((size_t)s->slab_lines * BD_SLAB_LINE, shapes[k].block,
                     "%s: a %zu-byte block, not %u lines", shapes[k].id, shapes[k].block,
                     s->slab_lines);
        cr_assert_eq(s->mem_cost, shapes[k].block + FLUSHER_SENSOR_COST, "%s", shapes[k].id);
        cr_assert_eq(bd_sensor_table_memory(table) - before, shapes[k].block + FLUSHER_SENSOR_COST);
        cr_assert_str_eq(bd_sensor_measurement(s), shapes[k].meas);
        for (uint32_t i = 0; i < shapes[k].n; i++) {
            cr_assert_str_eq(bd_sensor_tag_key(s, i), shapes[k].k[i]);
            cr_assert_str_eq(bd_sensor_tag_value(s, i), shapes[k].v[i]);
        }
        drain_expect(s, 1);
    }
}

/* A tag key as names.h stores it: '%' and '.' escaped anywhere, '$' as the first byte. */
static void escape_tag_key(const char *k, char *out) {
    for (size_t i = 0; k[i] != '\0'; i++) {
        if (k[i] == '%' || k[i] == '.' || (i == 0 && k[i] == '$')) {
            out += sprintf(out, "%%%02X", (unsigned char)k[i]);
        } else {
            *out++ = k[i];
        }
    }
    *out = '\0';
}

/* Whatever the tags' number, spelling and length, the accessors give back the measurement, each
 * key (escaped) and value sent: none, one, many, names needing escapes, UTF-8, names long
 * enough for a block past the slab's classes, and more than 64 KiB of them (32-bit offsets). */
Test(sensor, tag_accessors_return_what_was_sent_for_every_shape) {
    bd_sensor_table_free(table);
    cfg.limits.max_sensors = 64;
    cfg.limits.memory = 1 << 20;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    static const uint32_t counts[] = {0, 1, 2, 3, 7, 40, BD_PARSE_MAX_TAGS};
    static const size_t value_lens[] = {1, 6, 300, 30000};
    static char keys[BD_PARSE_MAX_TAGS][32], want_keys[BD_PARSE_MAX_TAGS][96];
    static char values[BD_PARSE_MAX_TAGS][30001];
    char id[64], meas[32];
    int made = 0;
    for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
        for (size_t l = 0; l < sizeof(value_lens) / sizeof(value_lens[0]); l++) {
            uint32_t n = counts[c];
            size_t vlen = value_lens[l];
            if (n * vlen > 200000) {
                continue; /* the big shapes with a few tags are enough */
            }
            snprintf(id, sizeof(id), "m%d,shape=%zu.%zu", made, c, l);
            snprintf(meas, sizeof(meas), "m%d%s", made, l % 2 ? ".x" : "é");
            point(id, meas, true, NOW);
            pt.n_tags = n;
            for (uint32_t i = 0; i < n; i++) {
                /* Sorted keys, as the parser hands them; some need escapes. */
                snprintf(keys[i], sizeof(keys[i]), "%s%03u%s", i % 3 == 0 ? "$k" : "k", i,
                         i % 4 == 1 ? ".a%b" : "");
                escape_tag_key(keys[i], want_keys[i]);
                memset(values[i], 'a' + (int)(i % 26), vlen);
                values[i][vlen] = '\0';
                if (vlen > 2) {
                    memcpy(values[i], "é", 2); /* UTF-8; values are not escaped */
                }
                pt.tags[i] = (struct bd_tag){S(keys[i]), S(values[i])};
            }
            add_float("v", made);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "%s", id);
            struct bd_sensor *s = bd_sensor_table_next_dirty(table);
            cr_assert_not_null(s);
            cr_assert_str_eq(bd_sensor_id(s), id);
            cr_assert_eq(s->id_len, strlen(id));
            cr_assert_eq(s->n_tags, n);
            cr_assert_str_eq(bd_sensor_measurement(s), meas);
            cr_assert_eq(s->tags_wide, names_bytes(&pt) > UINT16_MAX, "%s", id);
            for (uint32_t i = 0; i < n; i++) {
                cr_assert_str_eq(bd_sensor_tag_key(s, i), want_keys[i], "%s tag %u", id, i);
                cr_assert_str_eq(bd_sensor_tag_value(s, i), values[i], "%s tag %u", id, i);
            }
            cr_assert_eq(drain_expect(s, made), 1);
            made++;
            if (made % 8 == 0) {
                /* Room for more: evict nothing, just a fresh table. */
                bd_sensor_table_free(table);
                cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
            }
        }
    }
    cr_assert_geq(made, 20);
}

/* A detached sensor (the flusher's unplaced records) lays its names out as the table's do. */
Test(sensor, a_detached_sensor_holds_the_names_it_was_given) {
    struct bd_str keys[3] = {S("a%2Eb"), S("k"), S("zz")};
    struct bd_str values[3] = {S("1"), S(""), S("\xc3\xa9t\xc3\xa9")};
    static char big[70000];
    memset(big, 'x', sizeof(big) - 1);
    for (int wide = 0; wide < 2; wide++) {
        if (wide) {
            values[1] = S(big);
        }
        struct bd_sensor *s;
        struct bd_str id = S("m,a.b=1,k=,zz=x"), meas = S("m");
        cr_assert_eq(bd_sensor_detached_new(&s, &id, &meas, keys, values, 3), 0);
        cr_assert_eq((uintptr_t)s % BD_RING_CACHELINE, 0);
        cr_assert_str_eq(bd_sensor_id(s), "m,a.b=1,k=,zz=x");
        cr_assert_str_eq(bd_sensor_measurement(s), "m");
        cr_assert_eq(s->tags_wide, wide);
        for (uint32_t i = 0; i < 3; i++) {
            cr_assert_str_eq(bd_sensor_tag_key(s, i), keys[i].ptr);
            cr_assert_str_eq(bd_sensor_tag_value(s, i), values[i].ptr);
        }
        cr_assert_null(s->table);
        cr_assert_eq(atomic_load(&s->n_fields), 0);
        free(s);
    }
    struct bd_sensor *s = NULL;
    struct bd_str m = S("m");
    cr_assert_eq(bd_sensor_detached_new(&s, &m, &m, NULL, NULL, 0), 0);
    cr_assert_str_eq(bd_sensor_measurement(s), "m");
    cr_assert_eq(s->n_tags, 0);
    free(s);
}

/* pack_key's register-only packing against the plain byte copy it replaced, every length. */
Test(sensor, pack_key_matches_a_byte_copy) {
    unsigned char buf[16];
    uint32_t x = 12345;
    for (int round = 0; round < 1000; round++) {
        for (size_t i = 0; i < sizeof(buf); i++) {
            x = x * 1103515245u + 12345u;
            buf[i] = (unsigned char)(x >> 16);
        }
        for (size_t len = 0; len <= 8; len++) {
            struct bd_str key = {(const char *)buf + round % 8, len};
            uint64_t want = 0;
            if (len <= 7) {
                memcpy(&want, key.ptr, len);
                want = (want << 8) | len;
            }
            cr_assert_eq(pack_key(&key), want, "len %zu round %d", len, round);
        }
    }
}

/* ---- Names, sensor memory and eviction ---------------------------------------------------- */

static void table_with(uint32_t max_name, uint64_t sensor_memory, uint64_t idle_ms) {
    bd_sensor_table_free(table);
    cfg.limits.max_name = max_name;
    cfg.limits.sensor_memory = sensor_memory;
    cfg.limits.sensor_idle_ms = idle_ms;
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
}

Test(sensor, names_longer_than_max_name_are_refused_and_counted) {
    table_with(32, 0, 0);
    char id[64], key[64];
    memset(id, 'i', 33);
    id[33] = '\0';
    point(id, "m", true, NOW);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_name_too_long), 1);
    cr_assert_eq(bd_sensor_table_count(table), 0);
    id[32] = '\0'; /* exactly max_name: fine */
    point(id, "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    memset(key, 'k', 33);
    key[33] = '\0';
    point(id, "m", true, NOW);
    add_float(key, 2);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_name_too_long), 2);
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), 1);
}

Test(sensor, sensor_memory_bounds_new_sensors_and_new_field_names) {
    table_with(0, 0, 0);
    uint64_t empty = bd_sensor_table_memory(table);
    point("m,s=0", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    uint64_t one = bd_sensor_table_memory(table) - empty;
    cr_assert_gt(one, 200, "a sensor costs its struct, names and index slots: %" PRIu64, one);
    cr_assert_lt(one, 1024, "a short-named sensor costs %" PRIu64 " bytes", one);

    /* Room for the empty table, that sensor and a bit: the next sensor is refused. */
    table_with(0, empty + one + one / 2, 0);
    point("m,s=0", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    point("m,s=1", "m", true, NOW);
    add_float("v", 1);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_sensor_memory), 1);
    cr_assert_eq(bd_sensor_table_count(table), 1);
    /* The known sensor keeps going, and a long new field name of it is refused too. */
    char key[600];
    memset(key, 'f', sizeof(key) - 1);
    key[sizeof(key) - 1] = '\0';
    point("m,s=0", "m", true, NOW);
    add_float(key, 2);
    cr_assert_lt(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(BD_STAT_GET(&stats, drop_sensor_memory), 2);
    point("m,s=0", "m", true, NOW);
    add_float("v", 3);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
}

/* The flusher's part, played by the test: drain s, hand its idle segment back. */
static void drain_and_hand_back(struct bd_sensor *s) {
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n, cells;
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
        bd_sensor_consume(s, cells);
    }
    bd_sensor_table_publish(table); /* the producer seals its idle segment, queues s again */
    cr_assert_eq(bd_sensor_table_next_dirty(table), s);
    cr_assert_eq(bd_sensor_peek_reading(s, &ts, vals, &n), 0); /* gives the sealed one back */
}

Test(sensor, an_idle_sensor_is_evicted_released_and_freed_then_starts_again) {
    const int64_t idle_ns = 60 * BD_NS_PER_S;
    table_with(0, 0, 60000);
    uint64_t empty = bd_sensor_table_memory(table);
    point("m,s=0", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);

    /* Readings still queued: never evicted, however long it has been. */
    bd_sensor_table_sweep(table, NOW + 10 * idle_ns);
    cr_assert_eq(bd_sensor_table_count(table), 1);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 0);

    drain_and_hand_back(s);
    cr_assert_eq(bd_pool_in_use(bd_sensor_table_pool(table)), 0);
    /* Another sensor, silent only half of limits.sensor_idle at the next sweep, stays. */
    const int64_t t1 = NOW + 12 * idle_ns;
    point("m,s=1", "m", true, t1);
    add_float("v", 2);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, t1), 0);
    struct bd_sensor *s1 = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s1);
    drain_and_hand_back(s1);
    bd_sensor_table_sweep(table, t1 + idle_ns / 2);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 1);
    cr_assert_eq(bd_sensor_table_count(table), 1, "m,s=1 is not idle long enough");
    cr_assert_eq(bd_sensor_table_next_evicted(table), s);
    cr_assert_null(bd_sensor_table_next_evicted(table));
    cr_assert_gt(bd_sensor_table_memory(table), empty, "held until the flusher releases it");

    /* A reading of the same series now starts a new sensor. */
    point("m,s=0", "m", true, t1 + idle_ns);
    add_float("v", 3);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, t1 + idle_ns), 0);
    cr_assert_eq(bd_sensor_table_count(table), 2);

    uint64_t before = bd_sensor_table_memory(table);
    bd_sensor_table_release(table, s);
    bd_sensor_table_sweep(table, t1 + idle_ns); /* frees at once, whatever the time */
    cr_assert_lt(bd_sensor_table_memory(table), before);
    /* Everything drained and evicted: the table is back to its empty size (index grown or not,
     * the memory of the sensors is all given back). */
    struct bd_sensor *a;
    while ((a = bd_sensor_table_next_dirty(table)) != NULL) {
        drain_and_hand_back(a);
    }
    bd_sensor_table_sweep(table, NOW + 30 * idle_ns);
    cr_assert_eq(bd_sensor_table_count(table), 0);
    while ((a = bd_sensor_table_next_evicted(table)) != NULL) {
        bd_sensor_table_release(table, a);
    }
    bd_sensor_table_sweep(table, NOW + 30 * idle_ns);
    cr_assert_eq(bd_sensor_table_memory(table), empty);
}

/* Series keys that differ in one byte only, at every position of every length from 1 to 40:
 * alternate readings of the two go to two sensors, each its own, whether the sensor is found as
 * the last reading's or through the index (its ids are compared word by word). */
Test(sensor, keys_differing_in_one_byte_anywhere_are_two_sensors) {
    char a[48], b[48];
    for (size_t len = 1; len <= 40; len++) {
        for (size_t at = 0; at < len; at++) {
            table_with(0, 0, 0);
            for (size_t i = 0; i < len; i++) {
                a[i] = (char)('a' + i % 26);
            }
            a[len] = '\0';
            memcpy(b, a, len + 1);
            b[at] = 'Z';
            /* a, b, b, a, a: each one found as the last reading's sensor and not. */
            const char *order[] = {a, b, b, a, a};
            for (int k = 0; k < 5; k++) {
                point(order[k], "m", true, NOW);
                add_float("v", order[k] == a ? 1.0 : 2.0);
                cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
            }
            cr_assert_eq(bd_sensor_table_count(table), 2, "length %zu, byte %zu", len, at);
            struct bd_sensor *s;
            int sensors = 0;
            while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
                sensors++;
                double want = strcmp(s->id_buf, a) == 0 ? 1.0 : 2.0;
                cr_assert(strcmp(s->id_buf, a) == 0 || strcmp(s->id_buf, b) == 0);
                int64_t ts;
                struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
                uint32_t n, cells;
                int readings = 0;
                while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
                    cr_assert_eq(vals[0].v.f, want, "length %zu, byte %zu: %s", len, at, s->id_buf);
                    bd_sensor_consume(s, cells);
                    readings++;
                }
                cr_assert_eq(readings, want == 1.0 ? 3 : 2, "length %zu, byte %zu", len, at);
            }
            cr_assert_eq(sensors, 2);
        }
    }
}

/* The table keeps the last reading's sensor to find the next reading of the same series without
 * a lookup: once that sensor is evicted, the series' next reading must start a new sensor, not
 * go into the queue of the one the flusher is letting go of. */
Test(sensor, the_last_readings_sensor_evicted_its_series_starts_a_new_sensor) {
    const int64_t idle_ns = 60 * BD_NS_PER_S;
    table_with(0, 0, 60000);
    point("m,s=0", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(s);
    drain_and_hand_back(s);

    const int64_t t1 = NOW + 2 * idle_ns;
    bd_sensor_table_sweep(table, t1);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 1);
    cr_assert_eq(bd_sensor_table_count(table), 0);
    cr_assert_eq(bd_sensor_table_next_evicted(table), s);

    point("m,s=0", "m", true, t1);
    add_float("v", 2);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, t1), 0);
    cr_assert_eq(bd_sensor_table_count(table), 1, "a new sensor for the series");
    struct bd_sensor *again = bd_sensor_table_next_dirty(table);
    cr_assert_not_null(again);
    cr_assert_neq(again, s);
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    cr_assert_eq(bd_sensor_peek_reading(s, &ts, vals, &n), 0, "nothing for the evicted sensor");
    cr_assert_gt(bd_sensor_peek_reading(again, &ts, vals, &n), 0);
    cr_assert_eq(ts, t1);
    cr_assert_eq(vals[0].v.f, 2.0);
    bd_sensor_table_release(table, s);
    bd_sensor_table_sweep(table, t1);
}

/* Input stops right after the flusher reported a sensor's segment idle: no publish follows (no
 * more batches of accepts). The sweeps alone (at the flusher's doorbells) must take the report
 * back, so that the flusher can return the segment and the sensor can be evicted; else it stays
 * tracked until some reading arrives. */
Test(sensor, sweeps_alone_take_back_idle_segments_so_quiet_sensors_are_evicted) {
    const int64_t idle_ns = 60 * BD_NS_PER_S;
    table_with(0, 0, 60000);
    point("m,s=0", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    bd_sensor_table_publish(table); /* the end of the last batch of input */
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_eq(drain_expect(s, 1), 1); /* reports the segment idle */
    cr_assert_eq(atomic_load(&s->reclaim), 1);
    /* From here on only doorbells: a sweep, then the flusher's look, each second. */
    for (int i = 1; i <= 5 && bd_sensor_table_count(table) > 0; i++) {
        bd_sensor_table_sweep(table, NOW + idle_ns + i * BD_NS_PER_S);
        struct bd_sensor *d;
        while ((d = bd_sensor_table_next_dirty(table)) != NULL) {
            cr_assert_eq(drain_expect(d, 0), 0);
        }
    }
    cr_assert_eq(bd_sensor_table_count(table), 0, "evicted without any further input");
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 1);
    cr_assert_eq(bd_pool_in_use(&table->pool), 0);
    cr_assert_eq(bd_sensor_table_next_evicted(table), s);
    bd_sensor_table_release(table, s);
}

Test(sensor, past_three_quarters_new_sensors_wait_and_known_ones_go_on) {
    cfg.limits.max_sensors = 16;
    table_with(0, 0, 0);
    const struct bd_pool *pool = bd_sensor_table_pool(table);
    char key[16];
    /* One sensor alone stops at its share: 2 of 16 segments. */
    int n = 0;
    do {
        point("m,s=0", "m", true, NOW);
        add_float("v", n++);
    } while (bd_sensor_table_accept(table, &pt, NOW) == 0 && n < 1000);
    cr_assert_eq(n - 1, 2 * 30);
    cr_assert_eq(bd_pool_in_use(pool), 2);
    /* Five more, two segments each, reach 12 (three quarters); the last reading of each leaves
     * one cell pair of its second segment free. */
    for (int k = 1; k <= 5; k++) {
        snprintf(key, sizeof(key), "m,s=%d", k);
        for (int i = 0; i < 59; i++) {
            point(key, "m", true, NOW);
            add_float("v", i);
            cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "sensor %d reading %d", k, i);
        }
    }
    cr_assert_eq(bd_pool_in_use(pool), 12);
    point("m,s=new", "m", true, NOW);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), -EAGAIN);
    cr_assert_eq(bd_sensor_table_count(table), 6, "not created");
    /* A known sensor goes on in its segment; at its share, its next segment waits. */
    point("m,s=1", "m", true, NOW);
    add_float("v", 59);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), -EAGAIN);
    cr_assert_eq(BD_STAT_GET(&stats, drop_buffer_full), 0, "waiting is not dropping");
}

/* ---- A take that seals the producer's own segment -------------------------------------------
 *
 * A reading that needs a new segment may find the pool empty; the producer then takes back the
 * idle segments the flusher reported, and its own may be among them: sealed and forgotten
 * before the second take. The tests below drive that on one thread through the pool's take
 * hook. Sensor k is "m,s=k"; its i-th reading carries k * 1000 + i.
 */

#define SEQ_SENSORS 9
static int sent[SEQ_SENSORS];    /* readings accepted, per sensor */
static int drained[SEQ_SENSORS]; /* readings drained, per sensor, each checked in order */
static int takes;                /* bd_pool_take calls since the hook was set */
static int fail_take;            /* this take (from 1) fails as if the pool were empty */
static int flush_at_take;        /* before this take, the flusher drains every dirty sensor */

static int accept_seq(int k) {
    char key[16];
    snprintf(key, sizeof(key), "m,s=%d", k);
    point(key, "m", true, NOW);
    add_float("v", k * 1000 + sent[k]);
    int rc = bd_sensor_table_accept(table, &pt, NOW);
    if (rc == 0) {
        sent[k]++;
    }
    return rc;
}

/* The flusher's part: drain every dirty sensor; each reading must be the next one its sensor
 * sent. Returns how many sensors were popped. */
static int drain_dirty_seq(void) {
    int popped = 0;
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        int k = atoi(strchr(s->id_buf, '=') + 1);
        cr_assert(k >= 0 && k < SEQ_SENSORS);
        popped++;
        int64_t ts;
        struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
        uint32_t n, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n)) != 0) {
            cr_assert_lt(drained[k], sent[k], "sensor %d: more readings drained than sent", k);
            cr_assert_eq(vals[0].v.f, k * 1000 + drained[k],
                         "sensor %d: reading %d drained out of order, twice or never", k,
                         drained[k]);
            drained[k]++;
            bd_sensor_consume(s, cells);
        }
    }
    return popped;
}

/* Until nothing moves: the producer takes back idle segments, the flusher gives them back. */
static void drain_until_quiet(void) {
    do {
        bd_sensor_table_publish(table);
    } while (drain_dirty_seq() > 0);
}

static bool on_take(void *arg) {
    (void)arg;
    takes++;
    if (takes == flush_at_take) {
        drain_dirty_seq();
    }
    return takes == fail_take;
}

/* Every reading sent was drained once, in order, and every segment is back in the pool. */
static void assert_all_drained_and_given_back(void) {
    uint64_t total = 0;
    for (int k = 0; k < SEQ_SENSORS; k++) {
        cr_assert_eq(drained[k], sent[k], "sensor %d: %d readings accepted, %d drained", k, sent[k],
                     drained[k]);
        total += (uint64_t)sent[k];
    }
    cr_assert_eq(BD_STAT_GET(&stats, readings_accepted), total);
    cr_assert_eq(bd_pool_in_use(&table->pool), 0, "segments taken and never given back");
}

/* Sensor 0 fills one segment (30 readings of 2 cells) and the flusher drains it: the producer's
 * own segment, read to the end, is reported idle (the producer has not taken the report). */
static void fill_one_segment_and_report_it_idle(void) {
    memset(sent, 0, sizeof(sent));
    memset(drained, 0, sizeof(drained));
    cr_assert_eq(table->pool.seg_cells, 60);
    for (int i = 0; i < 30; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    cr_assert_eq(drain_dirty_seq(), 1);
    cr_assert_eq(drained[0], 30);
    struct bd_str key = S("m,s=0");
    struct bd_sensor *s = lookup(table, &key, XXH3_64bits(key.ptr, key.len));
    cr_assert_eq(atomic_load(&s->reclaim), 1, "reported idle, the report not yet taken");
}

Test(sensor, a_take_that_seals_the_producers_segment_while_the_flusher_runs_loses_nothing) {
    cfg.limits.max_sensors = 16;
    table_with(0, 0, 0);
    struct bd_pool *pool = &table->pool;
    fill_one_segment_and_report_it_idle();
    /* Eight more sensors take the other 15 segments: one each, then two each for seven. */
    for (int k = 1; k <= 8; k++) {
        cr_assert_eq(accept_seq(k), 0);
    }
    for (int k = 1; k <= 7; k++) {
        for (int i = 1; i < 60; i++) {
            cr_assert_eq(accept_seq(k), 0, "sensor %d reading %d", k, i);
        }
    }
    cr_assert_eq(bd_pool_in_use(pool), pool->n_segs, "the pool is full");

    /* Sensor 0's next reading needs a segment. The first take finds the pool empty, so the
     * producer takes back the idle report: it seals its own segment and forgets it. Before the
     * second take the flusher (running meanwhile) drains every sensor, gives back the sealed
     * segment and the ones their producers left, and the second take gets one of them. */
    takes = 0;
    fail_take = 0;
    flush_at_take = 2;
    bd_pool_set_take_hook(pool, on_take, NULL);
    cr_assert_eq(accept_seq(0), 0);
    bd_pool_set_take_hook(pool, NULL, NULL);
    cr_assert_eq(takes, 2, "the first take found the pool empty, the second did not");
    /* Sensor 0 goes on: the rest of that segment, and a reading in another. */
    for (int i = 0; i < 30; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    cr_assert_eq(sent[0], 61);
    drain_until_quiet();
    assert_all_drained_and_given_back();
}

Test(sensor, a_take_that_seals_the_producers_segment_starts_a_new_chain) {
    table_with(0, 0, 0);
    fill_one_segment_and_report_it_idle();
    /* The first take fails (the pool looked full): the producer takes back the idle report,
     * sealing its own segment; the second take succeeds. The new segment must not be linked
     * behind the sealed one, whose published count carries the sealed bit. */
    takes = 0;
    fail_take = 1;
    flush_at_take = 0;
    bd_pool_set_take_hook(&table->pool, on_take, NULL);
    cr_assert_eq(accept_seq(0), 0);
    bd_pool_set_take_hook(&table->pool, NULL, NULL);
    cr_assert_eq(takes, 2);
    /* The rest of the new segment (a third would pass the sensor's share of 2: the sealed one
     * is not given back before the flusher's next look). */
    for (int i = 0; i < 29; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    cr_assert_eq(sent[0], 60);
    drain_until_quiet();
    assert_all_drained_and_given_back();
    /* And the queue goes on as usual. */
    for (int i = 0; i < 40; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    drain_until_quiet();
    assert_all_drained_and_given_back();
}

/* ---- Small first segments (pool.h) ---- */

/* A pool of 512 KiB: 256 large segments of 60 cells and 1024 small ones of 12 cells, counted in
 * 2048 units of 256 bytes (a large segment is 4). */
static void two_class_table(uint32_t max_sensors, uint64_t idle_ms) {
    memset(sent, 0, sizeof(sent));
    memset(drained, 0, sizeof(drained));
    cfg.limits.max_sensors = max_sensors;
    cfg.limits.memory = 1024 * 1024;
    cfg.limits.max_fields = 16;
    table_with(0, 0, idle_ms);
    const struct bd_pool *pool = &table->pool;
    cr_assert_eq(pool->small.n_segs, 1024);
    cr_assert_eq(pool->small.seg_cells, 12);
    cr_assert_eq(pool->large.n_segs, 256);
    cr_assert_eq(pool->large.seg_cells, 60);
    cr_assert_eq(pool->unit_bytes, 256);
    cr_assert_eq(pool->n_units, 2048);
}

static struct bd_sensor *seq_sensor(int k) {
    char key[16];
    snprintf(key, sizeof(key), "m,s=%d", k);
    struct bd_str id = S(key);
    return lookup(table, &id, XXH3_64bits(id.ptr, id.len));
}

Test(sensor, a_chain_starts_in_a_small_segment_and_grows_into_large_ones) {
    two_class_table(16, 0);
    const struct bd_pool *pool = &table->pool;
    /* Six readings of 2 cells fill the small segment; the seventh goes on in a large one. */
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    struct bd_sensor *s = seq_sensor(0);
    cr_assert_eq(bd_pool_in_use(pool), 1, "one small segment");
    cr_assert_eq(s->wcap, 12);
    cr_assert_eq(accept_seq(0), 0);
    cr_assert_eq(bd_pool_in_use(pool), 1 + 4, "and a large one behind it");
    cr_assert_eq(s->wcap, 60);
    cr_assert_eq(s->segs_taken, 5);
    /* 30 readings fill the large segment; the next large one follows it. */
    for (int i = 0; i < 30; i++) {
        cr_assert_eq(accept_seq(0), 0);
    }
    cr_assert_eq(bd_pool_in_use(pool), 1 + 4 + 4);
    cr_assert_eq(drain_dirty_seq(), 1);
    cr_assert_eq(drained[0], 37);
    cr_assert_eq(bd_pool_in_use(pool), 4, "the two left behind went back, each to its class");
    cr_assert_eq(atomic_load(&s->segs_given), 5);
    drain_until_quiet();
    assert_all_drained_and_given_back();
    cr_assert_eq(BD_STAT_GET(&stats, drop_buffer_full), 0);
}

Test(sensor, a_sensor_going_quiet_and_returning_starts_small_again) {
    two_class_table(16, 0);
    const struct bd_pool *pool = &table->pool;
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 8; i++) { /* past one small segment: a large one follows */
            cr_assert_eq(accept_seq(0), 0);
        }
        cr_assert_eq(bd_pool_in_use(pool), 5, "round %d", round);
        drain_until_quiet();
        assert_all_drained_and_given_back();
        /* Quiet: nothing held; the next reading starts a new chain, small. */
        cr_assert_eq(accept_seq(0), 0);
        cr_assert_eq(bd_pool_in_use(pool), 1, "round %d", round);
        cr_assert_eq(seq_sensor(0)->wcap, 12);
        drain_until_quiet();
        assert_all_drained_and_given_back();
    }
}

Test(sensor, a_record_too_large_for_a_small_segment_starts_in_a_large_one) {
    two_class_table(16, 0);
    const struct bd_pool *pool = &table->pool;
    char name[8];
    point("m,s=0", "m", true, NOW);
    for (int f = 0; f < 12; f++) { /* 13 cells */
        snprintf(name, sizeof(name), "f%d", f);
        add_float(name, f);
    }
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0);
    cr_assert_eq(bd_pool_in_use(pool), 4);
    cr_assert_eq(seq_sensor(0)->wcap, 60);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    int64_t ts;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    uint32_t n;
    uint32_t cells = bd_sensor_peek_reading(s, &ts, vals, &n);
    cr_assert_eq(cells, 13);
    cr_assert_eq(n, 12);
    for (uint32_t f = 0; f < n; f++) {
        cr_assert_eq(vals[f].v.f, (double)f);
    }
    bd_sensor_consume(s, cells);
    drain_and_hand_back(s);
    cr_assert_eq(bd_pool_in_use(pool), 0);
}

Test(sensor, either_class_stands_in_for_the_other_when_it_runs_out) {
    two_class_table(16, 0);
    struct bd_pool *pool = &table->pool;
    /* Every small segment in use, as if many quiet sensors held them. */
    pool->small.bumped = pool->small.n_segs;
    atomic_store(&pool->taken, pool->small.n_segs);
    cr_assert_eq(accept_seq(0), 0);
    cr_assert_eq(seq_sensor(0)->wcap, 60, "a new chain in a large segment");
    drain_until_quiet();
    cr_assert_eq(drained[0], sent[0]);
    /* And the other way: every large segment in use, a chain grows into another small one. */
    two_class_table(16, 0);
    pool = &table->pool;
    pool->large.bumped = pool->large.n_segs;
    atomic_store(&pool->taken, (uint64_t)pool->large.n_segs * 4);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(accept_seq(1), 0);
    }
    cr_assert_eq(seq_sensor(1)->wcap, 12);
    cr_assert_eq(bd_pool_in_use(pool), 1024 + 1);
    cr_assert_eq(accept_seq(1), 0, "the small segment is full: another small one follows");
    cr_assert_eq(seq_sensor(1)->wcap, 12);
    cr_assert_eq(bd_pool_in_use(pool), 1024 + 2);
    drain_until_quiet();
    cr_assert_eq(drained[1], sent[1]);
    cr_assert_eq(sent[1], 7);
    cr_assert_eq(bd_pool_in_use(pool), 1024, "both small segments went back");
}

/*
 * The allocation sweep with both classes: sensors 0-3 send readings that start chains (small)
 * and grow them (large), in a pattern that takes segments of both classes, and the n-th take
 * fails (as if the pool were empty) or runs the flusher first, for every n the script reaches.
 * Whatever fails, every reading accepted is drained once, in order, and every segment comes
 * back to its class.
 */
static void sweep_script(void) {
    for (int i = 0; i < 40; i++) {
        for (int k = 0; k < 4; k++) {
            if (i < 10 * (k + 1)) { /* sensor k sends 10 (k + 1) readings */
                accept_seq(k);
            }
        }
        if (i % 9 == 8) {
            drain_until_quiet(); /* quiet: the next readings start new chains */
        }
    }
}

Test(sensor, the_allocation_sweep_across_both_classes_loses_nothing) {
    two_class_table(16, 0);
    takes = 0;
    fail_take = 0;
    flush_at_take = 0;
    bd_pool_set_take_hook(&table->pool, on_take, NULL);
    sweep_script();
    bd_pool_set_take_hook(&table->pool, NULL, NULL);
    int total_takes = takes;
    cr_assert_gt(total_takes, 10);
    for (int mode = 0; mode < 2; mode++) {
        for (int n = 1; n <= total_takes; n++) {
            bd_sensor_table_free(table);
            table = NULL;
            memset(&stats, 0, sizeof(stats));
            two_class_table(16, 0);
            takes = 0;
            fail_take = mode == 0 ? n : 0;
            flush_at_take = mode == 1 ? n : 0;
            bd_pool_set_take_hook(&table->pool, on_take, NULL);
            sweep_script();
            bd_pool_set_take_hook(&table->pool, NULL, NULL);
            drain_until_quiet();
            assert_all_drained_and_given_back();
            cr_assert_eq(table->pool.small.bumped + table->pool.large.bumped > 0, true);
            if (mode == 0) {
                cr_assert_leq(BD_STAT_GET(&stats, drop_buffer_full), 1, "take %d", n);
            } else {
                cr_assert_eq(BD_STAT_GET(&stats, drop_buffer_full), 0, "take %d", n);
            }
        }
    }
}

Test(sensor, an_idle_sensor_with_small_segments_is_evicted_and_returns) {
    const int64_t idle_ns = 60 * BD_NS_PER_S;
    two_class_table(16, 60000);
    for (int i = 0; i < 8; i++) { /* a small segment and a large one */
        cr_assert_eq(accept_seq(0), 0);
    }
    bd_sensor_table_sweep(table, NOW + 10 * idle_ns);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 0, "readings queued: kept");
    drain_until_quiet();
    assert_all_drained_and_given_back();
    bd_sensor_table_sweep(table, NOW + 11 * idle_ns);
    cr_assert_eq(BD_STAT_GET(&stats, sensors_evicted), 1);
    struct bd_sensor *gone = bd_sensor_table_next_evicted(table);
    cr_assert_not_null(gone);
    bd_sensor_table_release(table, gone);
    /* The same series returns: a new sensor, a new chain, small first. */
    point("m,s=0", "m", true, NOW + 11 * idle_ns);
    add_float("v", 7);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW + 11 * idle_ns), 0);
    cr_assert_eq(bd_sensor_table_count(table), 1);
    cr_assert_eq(bd_pool_in_use(&table->pool), 1);
    struct bd_sensor *s = bd_sensor_table_next_dirty(table);
    cr_assert_neq(s, NULL);
    cr_assert_eq(s->wcap, 12);
    cr_assert_eq(drain_expect(s, 7), 1);
    uint64_t before = bd_sensor_table_memory(table);
    bd_sensor_table_sweep(table, NOW + 11 * idle_ns); /* frees the released one */
    cr_assert_lt(bd_sensor_table_memory(table), before);
}

/* ---- Listing (/sensors) ---- */

static void many_sensors_table(void) {
    cfg.limits.max_sensors = 64;
    cfg.limits.memory = 512 * 1024;
    table_with(0, 0, 0);
}

static void accept_at(const char *id, int64_t now) {
    point(id, "m", true, now);
    add_float("v", 1);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, now), 0, "%s", id);
}

Test(sensor, list_is_oldest_first_with_counts_and_the_silent_filter) {
    many_sensors_table();
    accept_at("m,s=b", NOW + 2 * BD_NS_PER_S);
    accept_at("m,s=a", NOW + 1 * BD_NS_PER_S);
    accept_at("m,s=c", NOW + 3 * BD_NS_PER_S);
    accept_at("m,s=a", NOW + 4 * BD_NS_PER_S); /* a moves to the end */
    accept_at("m,s=a", NOW + 4 * BD_NS_PER_S);

    struct bd_sensor_info v[8];
    bool more = true;
    uint32_t n = bd_sensor_table_list(table, NULL, INT64_MAX, v, 8, &more);
    cr_assert_eq(n, 3);
    cr_assert_not(more);
    cr_assert_str_eq(v[0].s->id_buf, "m,s=b");
    cr_assert_str_eq(v[1].s->id_buf, "m,s=c");
    cr_assert_str_eq(v[2].s->id_buf, "m,s=a");
    cr_assert_eq(v[0].pos.last_ns, NOW + 2 * BD_NS_PER_S);
    cr_assert_eq(v[2].pos.last_ns, NOW + 4 * BD_NS_PER_S);
    cr_assert_eq(v[0].accepted, 1);
    cr_assert_eq(v[2].accepted, 3);

    /* Silent: last reading strictly older than the bound. */
    n = bd_sensor_table_list(table, NULL, NOW + 3 * BD_NS_PER_S, v, 8, &more);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(v[0].s->id_buf, "m,s=b");
    cr_assert_eq(bd_sensor_table_count_silent(table, NOW + 3 * BD_NS_PER_S), 1);
    cr_assert_eq(bd_sensor_table_count_silent(table, NOW + 3 * BD_NS_PER_S + 1), 2);
    cr_assert_eq(bd_sensor_table_count_silent(table, NOW), 0);

    /* A cap below the matches: the first ones, and more. */
    n = bd_sensor_table_list(table, NULL, INT64_MAX, v, 2, &more);
    cr_assert_eq(n, 2);
    cr_assert(more);
    cr_assert_str_eq(v[1].s->id_buf, "m,s=c");
}

Test(sensor, last_seen_never_moves_back_with_the_wall_clock) {
    many_sensors_table();
    accept_at("m,s=a", NOW);
    accept_at("m,s=a", NOW - 10 * BD_NS_PER_S); /* the clock stepped back */
    struct bd_sensor_info v[2];
    bool more;
    cr_assert_eq(bd_sensor_table_list(table, NULL, INT64_MAX, v, 2, &more), 1);
    cr_assert_eq(v[0].pos.last_ns, NOW);
    cr_assert_eq(v[0].accepted, 2);
}

Test(sensor, paging_with_ties_lists_every_sensor_exactly_once) {
    many_sensors_table();
    /* 40 sensors over 4 instants: ten share each last_ns, so pages split ties. */
    char ids[40][16];
    for (int i = 0; i < 40; i++) {
        snprintf(ids[i], sizeof(ids[i]), "m,s=%d", i);
        accept_at(ids[i], NOW + (i % 4) * BD_NS_PER_MS);
    }
    int seen[40] = {0};
    struct bd_sensor_pos after = {0, 0}, last = {INT64_MIN, 0};
    bool first = true, more = true;
    int pages = 0, late = 0;
    while (more) {
        struct bd_sensor_info v[7];
        uint32_t n = bd_sensor_table_list(table, first ? NULL : &after, INT64_MAX, v, 7, &more);
        first = false;
        pages++;
        cr_assert_leq(pages, 6, "41 sensors in pages of 7");
        for (uint32_t k = 0; k < n; k++) {
            cr_assert(last.last_ns < v[k].pos.last_ns ||
                          (last.last_ns == v[k].pos.last_ns && last.serial < v[k].pos.serial),
                      "strictly ascending across pages");
            last = v[k].pos;
            if (strcmp(v[k].s->id_buf, "m,s=late") == 0) {
                late++;
                continue;
            }
            int idx = atoi(strchr(v[k].s->id_buf, '=') + 1);
            seen[idx]++;
        }
        if (n > 0) {
            after = v[n - 1].pos;
        }
        /* A sensor created between pages comes after everything listed: on a later page. */
        if (pages == 2) {
            accept_at("m,s=late", NOW + 10 * BD_NS_PER_MS);
        }
    }
    for (int i = 0; i < 40; i++) {
        cr_assert_eq(seen[i], 1, "sensor %d listed %d times", i, seen[i]);
    }
    cr_assert_eq(late, 1);
    cr_assert_eq(last.last_ns, NOW + 10 * BD_NS_PER_MS, "the late sensor closes the list");
    cr_assert_eq(pages, 6);
}

/* ---- The defaults agree (issue 28) ---- */

/* A table with the default configuration. */
static void default_table(void) {
    bd_sensor_table_free(table);
    table = NULL;
    bd_config_defaults(&cfg);
    struct bd_err err;
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
}

/* Three short fields on the point, which must then be accepted (sensor number i); every 1,000
 * the flusher's part drains. Adds the point's names to *names. */
static void accept_three_fields(uint32_t i, uint64_t *names) {
    add_float("f0", 1);
    add_float("f1", 2);
    add_float("f2", 3);
    *names += names_bytes(&pt);
    cr_assert_eq(bd_sensor_table_accept(table, &pt, NOW), 0, "sensor %u", i);
    if (i % 1000 == 999) {
        drain_everything();
    }
}

/* What the table holds for n sensors beyond the flusher's estimate: what it charged (the blocks
 * and the index) and the queues' cells, allocated at start for max_sensors. */
static uint64_t table_bytes_of(uint32_t n) {
    uint64_t rings =
        (uint64_t)(bd_ring_capacity(&table->dirty) + bd_ring_capacity(&table->reclaim) +
                   bd_ring_capacity(&table->evict) + bd_ring_capacity(&table->dead)) *
        sizeof(*table->dirty.cells);
    return bd_sensor_table_memory(table) - (uint64_t)n * FLUSHER_SENSOR_COST + rings;
}

/* With the default configuration, limits.sensor_memory admits limits.max_sensors sensors of
 * ordinary names: ids as bucketd-sim and the README spell them, three short fields each. And
 * what the table holds for each beyond its names -- its block, its share of the index and of the
 * queues' cells -- is at most 256 bytes (issue 28; the flusher's page accounting aside). */
Test(sensor, the_default_sensor_memory_admits_max_sensors_ordinary_sensors) {
    default_table();
    uint32_t n = cfg.limits.max_sensors;
    cr_assert_eq(n, 100000);
    char id[64], v1[16], v2[16], v3[16];
    uint64_t names = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i % 3 == 2) {
            snprintf(id, sizeof(id), "m1,rack=r%02u,sensor=s%u,site=plant-%u", i % 40, i, i % 100);
            snprintf(v1, sizeof(v1), "r%02u", i % 40);
            snprintf(v2, sizeof(v2), "s%u", i);
            snprintf(v3, sizeof(v3), "plant-%u", i % 100);
            point(id, "m1", true, NOW);
            pt.n_tags = 3;
            pt.tags[0] = (struct bd_tag){S("rack"), S(v1)};
            pt.tags[1] = (struct bd_tag){S("sensor"), S(v2)};
            pt.tags[2] = (struct bd_tag){S("site"), S(v3)};
        } else if (i % 3 == 0) {
            snprintf(id, sizeof(id), "m,site=s%06u", i);
            snprintf(v1, sizeof(v1), "s%06u", i);
            point(id, "m", true, NOW);
            pt.n_tags = 1;
            pt.tags[0].key = S("site");
            pt.tags[0].value = S(v1);
        } else {
            snprintf(id, sizeof(id), "m1,sensor=s%u,site=plant-%u", i, i % 100);
            snprintf(v1, sizeof(v1), "s%u", i);
            snprintf(v2, sizeof(v2), "plant-%u", i % 100);
            point(id, "m1", true, NOW);
            pt.n_tags = 2;
            pt.tags[0].key = S("sensor");
            pt.tags[0].value = S(v1);
            pt.tags[1].key = S("site");
            pt.tags[1].value = S(v2);
        }
        accept_three_fields(i, &names);
    }
    cr_assert_eq(bd_sensor_table_count(table), n);
    cr_assert_eq(BD_STAT_GET(&stats, drop_sensor_memory), 0);
    cr_assert_leq(bd_sensor_table_memory(table), cfg.limits.sensor_memory);
    /* Charged: the blocks, the index and the flusher's estimate; the queues are allocated at
     * start for max_sensors. */
    uint64_t table_bytes = table_bytes_of(n);
    cr_assert_leq(table_bytes - names, (uint64_t)n * 256, "%.1f bytes a sensor beyond its names",
                  (double)(table_bytes - names) / n);
    drain_everything();
}

/* What the flusher's page accounting of n sensors with one bucket open takes: each sensor's
 * state made by bd_pages_slot from a pool, as the flusher makes it on draining the sensor's
 * first reading; the pool's chunks with what the allocator adds (glibc: the usable size and an
 * 8-byte header). */
static uint64_t one_slot_pages_bytes(uint32_t n) {
    const struct bd_pages_limits lim = {.span_ms = cfg.buckets.span_ms,
                                        .max_late_ms = cfg.buckets.max_late_ms,
                                        .max_future_ms = cfg.buckets.max_future_ms,
                                        .max_readings = cfg.buckets.max_readings,
                                        .max_bytes = BD_PAGE_MAX_BYTES};
    const int64_t start = bd_bucket_start_ms(NOW, lim.span_ms);
    struct bd_pages **all = calloc(n, sizeof(*all));
    cr_assert_not_null(all);
    struct bd_pages_pool pool;
    bd_pages_pool_init(&pool);
    for (uint32_t i = 0; i < n; i++) {
        struct bd_page_slot *s =
            bd_pages_slot(&pool, &all[i], &lim, start, NOW / BD_NS_PER_MS, 0, 1);
        cr_assert_not_null(s);
        cr_assert_eq(all[i]->n, 1);
    }
    const uint64_t chunks = pool.chunk_bytes / BD_PAGES_POOL_CHUNK;
    const uint64_t bytes = chunks * (malloc_usable_size(pool.chunks) + sizeof(size_t));
    for (uint32_t i = 0; i < n; i++) {
        bd_pages_free(&pool, all[i]);
    }
    bd_pages_pool_close(&pool);
    free(all);
    return bytes;
}

/* Issue 28's edge-box sensor, `m,site=s000123`, takes a 192-byte block, and what it costs beyond
 * its names with limits.max_sensors of them -- its block, its share of the index and of the
 * queues' cells, and the flusher's page accounting for its open bucket -- is at most 256 bytes. */
Test(sensor, max_sensors_short_named_sensors_take_at_most_256_bytes_each_beyond_their_names) {
    default_table();
    uint32_t n = cfg.limits.max_sensors;
    char id[32], v[16];
    uint64_t names = 0;
    for (uint32_t i = 0; i < n; i++) {
        snprintf(id, sizeof(id), "m,site=s%06u", i);
        snprintf(v, sizeof(v), "s%06u", i);
        point(id, "m", true, NOW);
        pt.n_tags = 1;
        pt.tags[0] = (struct bd_tag){S("site"), S(v)};
        accept_three_fields(i, &names);
    }
    cr_assert_eq(bd_sensor_table_count(table), n);
    uint32_t seen = 0;
    for (uint32_t i = 0; i < bd_sensor_table_slots(table); i++) {
        const struct bd_sensor *s = bd_sensor_table_slot(table, i);
        if (s != NULL) {
            cr_assert_eq(s->slab_lines * BD_SLAB_LINE, BD_SLAB_SMALL, "%s: %u lines",
                         bd_sensor_id(s), s->slab_lines);
            seen++;
        }
    }
    cr_assert_eq(seen, n);
    cr_assert_eq(bd_sensor_table_memory(table),
                 (uint64_t)n * (BD_SLAB_SMALL + FLUSHER_SENSOR_COST) +
                     (uint64_t)bd_sensor_table_slots(table) * sizeof(slot_t),
                 "charged: the blocks, the flusher's estimate and the index");
    uint64_t pages = one_slot_pages_bytes(n);
    uint64_t total = table_bytes_of(n) + pages;
    cr_log_info("%.1f bytes a sensor beyond its names, %.1f of them page accounting",
                (double)(total - names) / n, (double)pages / n);
    cr_assert_leq(total - names, (uint64_t)n * 256, "%.1f bytes a sensor beyond its names",
                  (double)(total - names) / n);
    drain_everything();
}
