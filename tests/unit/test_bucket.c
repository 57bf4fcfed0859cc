/*
 * Bucket arithmetic and the per-bucket update document (src/bucket.c).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"

#define HOUR_MS INT64_C(3600000)
#define MS INT64_C(1000000)

#define STR(s) ((struct bd_str){s, sizeof(s) - 1})

static struct bd_sensor *sensor;
static struct bd_sensor_names names;

static void setup(void) {
    struct bd_str keys[] = {STR("loc"), STR("room")}, values[] = {STR("$home"), STR("kitchen")};
    cr_assert_eq(bd_sensor_detached_new(&sensor, &STR("weather,loc=$home,room=kitchen"),
                                        &STR("weather"), keys, values, 2),
                 0);
    memset(&names, 0, sizeof(names));
    names.name[0] = "temp";
    names.name[1] = "n";
    names.name[2] = "on";
    names.name[3] = "big";
    sensor->names = &names;
    atomic_init(&sensor->n_fields, 4);
}

static void teardown(void) {
    free(sensor);
}

TestSuite(bucket, .init = setup, .fini = teardown);

Test(bucket, floor_div_rounds_towards_minus_infinity) {
    cr_assert_eq(bd_floor_div(7, 2), 3);
    cr_assert_eq(bd_floor_div(-7, 2), -4);
    cr_assert_eq(bd_floor_div(-8, 2), -4);
    cr_assert_eq(bd_floor_div(0, 5), 0);
    cr_assert_eq(bd_floor_div(-1, 1000000), -1);
}

Test(bucket, hour_boundaries) {
    int64_t h = INT64_C(1736949600000); /* 2025-01-15T14:00:00Z in ms */
    cr_assert_eq(bd_bucket_start_ms(h * MS, HOUR_MS), h);
    cr_assert_eq(bd_bucket_start_ms(h * MS - 1, HOUR_MS), h - HOUR_MS, "1 ns before the hour");
    cr_assert_eq(bd_bucket_start_ms((h + HOUR_MS) * MS - 1, HOUR_MS), h, "last ns of the hour");
    cr_assert_eq(bd_bucket_start_ms((h + HOUR_MS) * MS, HOUR_MS), h + HOUR_MS);
    /* Before 1970 the bucket still starts at or before the reading. */
    cr_assert_eq(bd_bucket_start_ms(-1, HOUR_MS), -HOUR_MS);
    cr_assert_eq(bd_bucket_start_ms(-HOUR_MS * MS, HOUR_MS), -HOUR_MS);
    /* Other spans. */
    cr_assert_eq(bd_bucket_start_ms((h + 61000) * MS, 60000), h + 60000);
    cr_assert_eq(bd_bucket_start_ms((h + 5 * HOUR_MS) * MS, 24 * HOUR_MS), h - 14 * HOUR_MS,
                 "day buckets start at midnight UTC");
}

Test(bucket, document_id) {
    char buf[128];
    cr_assert_eq(bd_bucket_id(buf, sizeof(buf), "s,a=b", INT64_C(1736949600000), 2), 0);
    cr_assert_str_eq(buf, "s,a=b|1736949600|2");
    cr_assert_eq(bd_bucket_id(buf, 8, "long-sensor-name", 0, 0), -ENAMETOOLONG);
}

static struct bd_reading_value fv(uint16_t field, double f) {
    struct bd_reading_value v = {.field = field, .kind = BD_VAL_FLOAT};
    v.v.f = f;
    return v;
}

static struct bd_reading_value iv(uint16_t field, int64_t i) {
    struct bd_reading_value v = {.field = field, .kind = BD_VAL_INT};
    v.v.i = i;
    return v;
}

Test(bucket, summaries_fold_numeric_fields_only) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value r1[] = {fv(0, 21.5), iv(1, 7), {.field = 2, .kind = BD_VAL_BOOL}};
    struct bd_reading_value r2[] = {fv(0, -3.25), iv(1, -9)};
    struct bd_reading_value r3[] = {fv(0, 40.0)};
    cr_assert_eq(bd_delta_add(&d, 3 * MS, r1, 3), 0);
    cr_assert_eq(bd_delta_add(&d, 1 * MS, r2, 2), 0);
    cr_assert_eq(bd_delta_add(&d, 2 * MS, r3, 1), 0);
    cr_assert_eq(d.n_readings, 3);
    cr_assert_eq(d.n_summaries, 2, "the boolean field has no summary");
    const struct bd_field_summary *t = &d.summaries[0], *n = &d.summaries[1];
    cr_assert_eq(t->field, 0);
    cr_assert(!t->min.is_int && t->min.v.f == -3.25);
    cr_assert(!t->max.is_int && t->max.v.f == 40.0);
    cr_assert_eq(t->count, 3);
    cr_assert_float_eq(t->sum, 58.25, 1e-12);
    cr_assert(n->min.is_int && n->min.v.i == -9);
    cr_assert(n->max.is_int && n->max.v.i == 7);
    cr_assert_eq(n->count, 2);
    bd_delta_close(&d);
}

Test(bucket, huge_unsigned_becomes_double) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value v = {.field = 3, .kind = BD_VAL_UINT};
    v.v.u = UINT64_MAX;
    cr_assert_eq(bd_delta_add(&d, 0, &v, 1), 0);
    cr_assert(!d.summaries[0].max.is_int);
    cr_assert_float_eq(d.summaries[0].max.v.f, 18446744073709551615.0, 1);
    v.v.u = 5;
    cr_assert_eq(bd_delta_add(&d, 0, &v, 1), 0);
    cr_assert(d.summaries[0].min.is_int && d.summaries[0].min.v.i == 5);
    bd_delta_close(&d);
}

/* Find a dotted path inside a built document. */
static bool find(const bson_t *doc, const char *path, bson_iter_t *out) {
    bson_iter_t it;
    return bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, path, out);
}

Test(bucket, update_document_shape) {
    struct bd_delta d;
    int64_t start = INT64_C(1736949600000);
    bd_delta_init(&d, sensor, start, 1);
    struct bd_reading_value a[] = {fv(0, 2.0), iv(1, 1)};
    struct bd_reading_value b[] = {fv(0, 1.0)};
    struct bd_reading_value c[] = {fv(0, 3.0)};
    /* Out of order on purpose, and two readings with the same timestamp. */
    cr_assert_eq(bd_delta_add(&d, (start + 20) * MS, a, 2), 0);
    cr_assert_eq(bd_delta_add(&d, (start + 10) * MS + 5, b, 1), 0);
    cr_assert_eq(bd_delta_add(&d, (start + 10) * MS + 5, c, 1), 0);

    bson_t sel, upd;
    bd_delta_build_update(&d, 3600000, "w.gw-1", 42, &sel, &upd);
    bson_iter_t it;
    cr_assert(find(&sel, "_id", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "weather,loc=$home,room=kitchen|1736949600|1");
    /* Idempotency: the filter skips documents this writer already brought to seq 42. The
     * writer key is one top-level name containing a dot, so look it up without descending. */
    cr_assert(bson_iter_init_find(&it, &sel, "w.gw-1"));
    bson_iter_t cond;
    cr_assert(bson_iter_recurse(&it, &cond) && bson_iter_find_descendant(&cond, "$not.$gte", &it));
    cr_assert(BSON_ITER_HOLDS_INT64(&it) && bson_iter_int64(&it) == 42);
    /* The shard-key fields as equalities (mongos targets an upsert by them), with the values
     * and BSON types stage 1 stores: a string sensor_id, a date bucket_start. */
    cr_assert(bson_iter_init_find(&it, &sel, "sensor_id"));
    cr_assert(BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), bd_sensor_id(sensor));
    cr_assert(bson_iter_init_find(&it, &sel, "bucket_start"));
    cr_assert(BSON_ITER_HOLDS_DATE_TIME(&it));
    cr_assert_eq(bson_iter_date_time(&it), start);
    cr_assert_eq(bson_count_keys(&sel), 4);
    /* Only _id, sensor_id and bucket_start are equalities, the fields an upsert seeds its new
     * document with; the writer condition is an operator expression. */
    static const char *const order[] = {"_id", "sensor_id", "bucket_start", "w.gw-1"};
    size_t k = 0;
    cr_assert(bson_iter_init(&it, &sel));
    while (bson_iter_next(&it)) {
        cr_assert_lt(k, 4);
        cr_assert_str_eq(bson_iter_key(&it), order[k]);
        cr_assert_eq(BSON_ITER_HOLDS_DOCUMENT(&it), k == 3);
        k++;
    }

    /* New readings sorted by time, ties in arrival order. */
    cr_assert(find(&upd, "0.$set._n.$literal.0.ts", &it));
    cr_assert_eq(bson_iter_date_time(&it), start + 10);
    cr_assert(find(&upd, "0.$set._n.$literal.0.temp", &it));
    cr_assert_eq(bson_iter_double(&it), 1.0, "equal timestamps keep arrival order");
    cr_assert(find(&upd, "0.$set._n.$literal.1.temp", &it));
    cr_assert_eq(bson_iter_double(&it), 3.0);
    cr_assert(find(&upd, "0.$set._n.$literal.2.n", &it));
    cr_assert(BSON_ITER_HOLDS_INT64(&it) && bson_iter_int64(&it) == 1);
    cr_assert_not(find(&upd, "0.$set._n.$literal.3", &it));

    /* Strings from the network are literals; constants are plain. The pipeline sets sensor_id
     * and bucket_start to exactly what the filter holds, so the fields an upsert seeds from the
     * filter are overwritten with themselves. */
    cr_assert(find(&upd, "0.$set.sensor_id.$literal", &it));
    cr_assert(BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), bd_sensor_id(sensor));
    cr_assert(find(&upd, "0.$set.bucket_start", &it));
    cr_assert(BSON_ITER_HOLDS_DATE_TIME(&it));
    cr_assert_eq(bson_iter_date_time(&it), start);
    cr_assert(find(&upd, "0.$set.meta.$literal.tags.loc", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "$home");
    cr_assert(find(&upd, "0.$set.bucket_end", &it));
    cr_assert_eq(bson_iter_date_time(&it), start + 3600000 - 1);
    cr_assert(find(&upd, "0.$set.page", &it));
    cr_assert_eq(bson_iter_int32(&it), 1);
    cr_assert(find(&upd, "0.$set.count.$add.1", &it));
    cr_assert_eq(bson_iter_int64(&it), 3);

    /* Summary operators with dotted paths. */
    cr_assert(find(&upd, "0.$set", &it));
    bson_iter_t set;
    cr_assert(bson_iter_recurse(&it, &set));
    cr_assert(bson_iter_find(&set, "summary.temp.min"));
    cr_assert(bson_iter_init(&it, &upd) && bson_iter_find_descendant(&it, "0.$set", &it));
    bson_iter_recurse(&it, &set);
    cr_assert(bson_iter_find(&set, "summary.n.count"));
    cr_assert(bson_iter_init(&it, &upd) && bson_iter_find_descendant(&it, "0.$set", &it));
    bson_iter_recurse(&it, &set);
    cr_assert(bson_iter_find(&set, "w.gw-1"));
    cr_assert(BSON_ITER_HOLDS_INT64(&set) && bson_iter_int64(&set) == 42);

    /* Stage 2 merges and averages, stage 3 drops the scratch field. */
    cr_assert(find(&upd, "1.$set.readings.$cond.0.$gte.0", &it));
    cr_assert_eq(bson_iter_date_time(&it), start + 10);
    /* Late readings: re-sorted by ts, equal timestamps by position (arrival order). */
    const char *by = "1.$set.readings.$cond.2.$let.in.$map.input.$sortArray.sortBy";
    char path[160];
    snprintf(path, sizeof(path), "%s.t", by);
    cr_assert(find(&upd, path, &it));
    snprintf(path, sizeof(path), "%s.i", by);
    cr_assert(find(&upd, path, &it), "the tie-breaker");
    cr_assert(find(&upd, "2.$unset", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "_n");

    bson_destroy(&sel);
    bson_destroy(&upd);
    bd_delta_close(&d);
}

Test(bucket, reset_keeps_buffers) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value a[] = {fv(0, 1.0)};
    for (int i = 0; i < 100; i++) {
        cr_assert_eq(bd_delta_add(&d, i, a, 1), 0);
    }
    void *buf = d.readings;
    bd_delta_reset(&d);
    cr_assert_eq(d.n_readings, 0);
    cr_assert_eq(d.n_summaries, 0);
    cr_assert_eq(bd_delta_add(&d, 0, a, 1), 0);
    cr_assert_eq(d.readings, buf);
    bd_delta_close(&d);
}

Test(bucket, split_moves_the_tail_and_recomputes_summaries) {
    struct bd_delta d, tail;
    bd_delta_init(&d, sensor, 0, 0);
    bd_delta_init(&tail, sensor, 0, 1);
    /* Values 5,1,9,3,7 arriving in that order; field "n" only on the last two. */
    const double temps[] = {5, 1, 9, 3, 7};
    for (int i = 0; i < 5; i++) {
        struct bd_reading_value v[] = {fv(0, temps[i]), iv(1, i)};
        cr_assert_eq(bd_delta_add(&d, (int64_t)(10 - i) * MS, v, i >= 3 ? 2 : 1), 0);
    }
    cr_assert_eq(bd_delta_split(&d, 2, &tail), 0);

    cr_assert_eq(d.n_readings, 2);
    cr_assert_eq(d.n_values, 2);
    cr_assert_eq(d.n_summaries, 1, "field n only occurs in the moved readings");
    cr_assert_eq(d.summaries[0].min.v.f, 1.0);
    cr_assert_eq(d.summaries[0].max.v.f, 5.0);
    cr_assert_eq(d.summaries[0].sum, 6.0);
    cr_assert_eq(d.summaries[0].count, 2);

    cr_assert_eq(tail.n_readings, 3);
    cr_assert_eq(tail.n_values, 5);
    cr_assert_eq(tail.readings[0].ts_ns, 8 * MS, "the tail keeps arrival order");
    cr_assert_eq(tail.summaries[0].min.v.f, 3.0);
    cr_assert_eq(tail.summaries[0].max.v.f, 9.0);
    cr_assert_eq(tail.summaries[0].sum, 19.0);
    cr_assert_eq(tail.summaries[1].count, 2);
    cr_assert_eq(tail.summaries[1].min.v.i, 3);

    /* The kept part still takes new readings after the split. */
    struct bd_reading_value v[] = {fv(0, 0.5)};
    cr_assert_eq(bd_delta_add(&d, 0, v, 1), 0);
    cr_assert_eq(d.readings[2].first, 2);
    cr_assert_eq(d.summaries[0].min.v.f, 0.5);
    bd_delta_close(&d);
    bd_delta_close(&tail);
}

/* Ids past BD_BUCKET_ID_MAX_VERBATIM bytes: a prefix cut at a character boundary and a digest
 * of the whole id; ids that differ anywhere keep apart, the form always fits. */
Test(bucket, long_ids_keep_their_own_bounded_id) {
    static char a[1101], b[1101], id_a[BD_BUCKET_ID_MAX], id_b[BD_BUCKET_ID_MAX];
    memset(a, 'x', 1100);
    memset(b, 'x', 1100);
    b[1099] = 'y';
    cr_assert_eq(bd_bucket_id(id_a, sizeof(id_a), a, 0, 0), 0);
    cr_assert_eq(bd_bucket_id(id_b, sizeof(id_b), b, 0, 0), 0);
    cr_assert_str_neq(id_a, id_b);
    cr_assert_eq(strlen(id_a), BD_BUCKET_ID_PREFIX + 1 + 32 + strlen("|0|0"));
    cr_assert_eq(strncmp(id_a, a, BD_BUCKET_ID_PREFIX), 0);
    cr_assert_eq(id_a[BD_BUCKET_ID_PREFIX], '~');
    /* Same id, other bucket or page: other _id. */
    cr_assert_eq(bd_bucket_id(id_b, sizeof(id_b), a, 3600000, 0), 0);
    cr_assert_str_neq(id_a, id_b);
    cr_assert_eq(bd_bucket_id(id_b, sizeof(id_b), a, 0, 1), 0);
    cr_assert_str_neq(id_a, id_b);
    /* Exactly at the limit: verbatim. One byte more: digest form. */
    a[BD_BUCKET_ID_MAX_VERBATIM] = '\0';
    cr_assert_eq(bd_bucket_id(id_a, sizeof(id_a), a, 0, 0), 0);
    cr_assert_eq(strncmp(id_a, a, BD_BUCKET_ID_MAX_VERBATIM), 0);
    cr_assert_eq(id_a[BD_BUCKET_ID_MAX_VERBATIM], '|');
    a[BD_BUCKET_ID_MAX_VERBATIM] = 'x';
    a[BD_BUCKET_ID_MAX_VERBATIM + 1] = '\0';
    cr_assert_eq(bd_bucket_id(id_a, sizeof(id_a), a, 0, 0), 0);
    cr_assert_eq(id_a[BD_BUCKET_ID_PREFIX], '~');
}

/*
 * A short id spelling a long id's digest form (anyone can compute the digest of a known id)
 * must not get that long id's _id: the two sensors would share their pages.
 */
Test(bucket, a_short_id_never_takes_a_long_ids_digest_form) {
    static char a[301], forged[BD_BUCKET_ID_MAX], id_a[BD_BUCKET_ID_MAX], id_f[BD_BUCKET_ID_MAX];
    memset(a, 'a', 300);
    cr_assert_eq(bd_bucket_id(id_a, sizeof(id_a), a, 0, 0), 0);
    /* The forged id is the long id's _id without its "|<bucket start>|<page>". */
    size_t n = strlen(id_a) - strlen("|0|0");
    memcpy(forged, id_a, n);
    forged[n] = '\0';
    cr_assert_leq(strlen(forged), BD_BUCKET_ID_MAX_VERBATIM);
    cr_assert_eq(bd_bucket_id(id_f, sizeof(id_f), forged, 0, 0), 0);
    cr_assert_str_neq(id_f, id_a, "two sensor ids share the _id %s", id_a);
    /* Its _id is a digest form of its own. */
    cr_assert_eq(id_f[BD_BUCKET_ID_PREFIX], '~');
    cr_assert_eq(strncmp(id_f, forged, BD_BUCKET_ID_PREFIX), 0);

    /* The same with the prefix cut before a character (189 bytes kept). */
    memcpy(a + BD_BUCKET_ID_PREFIX - 3, "\xf0\x9f\x98\x80", 4);
    cr_assert_eq(bd_bucket_id(id_a, sizeof(id_a), a, 0, 0), 0);
    cr_assert_eq(id_a[BD_BUCKET_ID_PREFIX - 3], '~');
    n = strlen(id_a) - strlen("|0|0");
    memcpy(forged, id_a, n);
    forged[n] = '\0';
    cr_assert_eq(bd_bucket_id(id_f, sizeof(id_f), forged, 0, 0), 0);
    cr_assert_str_neq(id_f, id_a);

    /* Other ids ending in '~' and hex digits keep their verbatim _id: a length no digest form
     * has, or digits a digest form never uses. */
    static const char *const verbatim[] = {"sensor~0123456789abcdef0123456789abcdef",
                                           "sensor~0123456789ABCDEF0123456789ABCDEF"};
    for (size_t i = 0; i < 2; i++) {
        cr_assert_eq(bd_bucket_id(id_f, sizeof(id_f), verbatim[i], 0, 0), 0);
        cr_assert_eq(strncmp(id_f, verbatim[i], strlen(verbatim[i])), 0);
        cr_assert_str_eq(id_f + strlen(verbatim[i]), "|0|0");
    }
    memset(forged, 'x', BD_BUCKET_ID_PREFIX);
    memcpy(forged + BD_BUCKET_ID_PREFIX, "~0123456789ABCDEF0123456789ABCDEF", 34);
    cr_assert_eq(bd_bucket_id(id_f, sizeof(id_f), forged, 0, 0), 0);
    cr_assert_eq(strncmp(id_f, forged, strlen(forged)), 0);
}

Test(bucket, a_long_id_is_cut_before_a_character_not_inside_it) {
    static char a[400], id[BD_BUCKET_ID_MAX];
    memset(a, 'x', sizeof(a) - 1);
    a[sizeof(a) - 1] = '\0';
    /* A three-byte character (U+20AC) straddling the prefix's end. */
    memcpy(a + BD_BUCKET_ID_PREFIX - 1, "\xe2\x82\xac", 3);
    cr_assert_eq(bd_bucket_id(id, sizeof(id), a, 0, 0), 0);
    cr_assert_eq(id[BD_BUCKET_ID_PREFIX - 1], '~', "the character goes whole into the digest");
    cr_assert_eq(strncmp(id, a, BD_BUCKET_ID_PREFIX - 1), 0);
}

/* Field names of any length are written whole and stay apart in the summaries. */
Test(bucket, long_field_names_keep_their_own_summaries) {
    static char k1[332], k2[332];
    memset(k1, 'f', 331);
    memset(k2, 'f', 331);
    k2[330] = 'g';
    names.name[0] = k1;
    names.name[1] = k2;
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value v[2] = {fv(0, 1.5), fv(1, 2.5)};
    cr_assert_eq(bd_delta_add(&d, 0, v, 2), 0);
    bson_t sel, upd;
    cr_assert_eq(bd_delta_build_update(&d, HOUR_MS, "w.t", 1, &sel, &upd), 0);
    char want1[400], want2[400];
    snprintf(want1, sizeof(want1), "summary.%s.min", k1);
    snprintf(want2, sizeof(want2), "summary.%s.min", k2);
    bson_iter_t it, set;
    int found = 0;
    cr_assert(bson_iter_init(&it, &upd) && bson_iter_find_descendant(&it, "0.$set", &set));
    bson_iter_t keys;
    bson_iter_recurse(&set, &keys);
    while (bson_iter_next(&keys)) {
        const char *k = bson_iter_key(&keys);
        found += strcmp(k, want1) == 0 ? 1 : strcmp(k, want2) == 0 ? 2 : 0;
    }
    cr_assert_eq(found, 3, "both summaries, under their whole names");
    bson_destroy(&sel);
    bson_destroy(&upd);
    bd_delta_close(&d);
}

/* ---- The compact delta (one allocation: summaries, readings, 9-byte values) ---------------- */

static struct bd_reading_value uv(uint16_t field, uint64_t u) {
    struct bd_reading_value v = {.field = field, .kind = BD_VAL_UINT};
    v.v.u = u;
    return v;
}

static struct bd_reading_value bv(uint16_t field, bool b) {
    struct bd_reading_value v = {.field = field, .kind = BD_VAL_BOOL};
    v.v.b = b;
    return v;
}

static void assert_same_value(struct bd_reading_value got, struct bd_reading_value want) {
    cr_assert_eq(got.field, want.field);
    cr_assert_eq(got.kind, want.kind);
    if (want.kind == BD_VAL_BOOL) {
        cr_assert_eq(got.v.b, want.v.b);
    } else {
        cr_assert_eq(memcmp(&got.v, &want.v, sizeof(uint64_t)), 0, "the value's 8 bytes");
    }
}

/* Every kind and the highest field a sensor can have come back as they were added. */
Test(bucket, compact_values_come_back_as_added) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    const struct bd_reading_value vals[] = {
        fv(0, -0.0),       fv(BD_SENSOR_MAX_FIELDS - 1, 1e308),
        iv(1, INT64_MIN),  iv(2, INT64_MAX),
        uv(3, UINT64_MAX), uv(5, 42),
        bv(6, true),       bv(BD_SENSOR_MAX_FIELDS - 2, false),
        fv(7, NAN),
    };
    const uint32_t n = BD_ARRAY_LEN(vals);
    cr_assert_eq(bd_delta_add(&d, 5, vals, 4), 0);
    cr_assert_eq(bd_delta_add(&d, 6, vals + 4, n - 4), 0);
    cr_assert_eq(d.n_values, n);
    for (uint32_t i = 0; i < n; i++) {
        assert_same_value(bd_delta_value(&d, i), vals[i]);
    }
    cr_assert_eq(d.readings[1].first, 4);
    cr_assert_eq(d.readings[1].n, n - 4);
    /* Booleans have no summary; every other field one, in the order first seen. */
    cr_assert_eq(d.n_summaries, n - 2);
    cr_assert_eq(d.summaries[1].field, BD_SENSOR_MAX_FIELDS - 1);
    cr_assert(!d.summaries[4].min.is_int, "a uint above INT64_MAX is summarised as a double");
    cr_assert(d.summaries[5].min.is_int && d.summaries[5].max.v.i == 42);
    bd_delta_close(&d);
}

/* A few readings of a few fields take what they need: no capacity rounded up, one summary per
 * numeric field (not one per value added). */
Test(bucket, a_small_delta_is_sized_exactly) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    for (int i = 0; i < 3; i++) {
        struct bd_reading_value r[] = {fv(0, i), iv(1, i), bv(2, i & 1)};
        cr_assert_eq(bd_delta_add(&d, i * MS, r, 3), 0);
    }
    cr_assert_eq(d.cap_readings, 3);
    cr_assert_eq(d.cap_values, 9);
    cr_assert_eq(d.n_summaries, 2);
    cr_assert_eq(d.cap_summaries, 2);
    cr_assert_eq(bd_delta_bytes(&d), sizeof(d) + 2 * 32 + 3 * 16 + 9 * 9);
    /* A new field: one more summary, exactly. */
    struct bd_reading_value r[] = {iv(3, 9), fv(0, -1)};
    cr_assert_eq(bd_delta_add(&d, 4 * MS, r, 2), 0);
    cr_assert_eq(d.cap_summaries, 3);
    cr_assert_eq(d.summaries[2].field, 3);
    cr_assert_eq(d.summaries[0].min.v.f, -1.0);
    cr_assert_eq(d.summaries[0].count, 4);
    cr_assert_eq(d.summaries[1].count, 3);
    bd_delta_close(&d);
}

/* Integers and doubles of one field: min and max keep the type of the value they came from,
 * integers compare exactly (no rounding through double). */
Test(bucket, mixed_int_and_double_min_max_keep_their_types) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value a[] = {iv(0, 5)}, b[] = {fv(0, 4.5)}, c[] = {iv(0, 7)};
    cr_assert_eq(bd_delta_add(&d, 0, a, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 1, b, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 2, c, 1), 0);
    cr_assert(!d.summaries[0].min.is_int);
    cr_assert_eq(d.summaries[0].min.v.f, 4.5);
    cr_assert(d.summaries[0].max.is_int);
    cr_assert_eq(d.summaries[0].max.v.i, 7);
    cr_assert_eq(d.summaries[0].sum, 16.5);
    /* INT64_MAX - 1 and INT64_MAX are the same double: compared as integers they differ. */
    struct bd_reading_value e[] = {iv(1, INT64_MAX)}, f[] = {iv(1, INT64_MAX - 1)};
    cr_assert_eq(bd_delta_add(&d, 3, e, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 4, f, 1), 0);
    cr_assert_eq(d.summaries[1].min.v.i, INT64_MAX - 1);
    cr_assert_eq(d.summaries[1].max.v.i, INT64_MAX);
    bd_delta_close(&d);
}

/* A copy of what a delta holds, to compare before and after a failed call. */
struct delta_copy {
    uint32_t n_readings, n_values, n_summaries;
    struct bd_delta_reading readings[64];
    struct bd_reading_value values[256];
    struct bd_field_summary summaries[8];
};

static void copy_delta(const struct bd_delta *d, struct delta_copy *c) {
    memset(c, 0, sizeof(*c));
    c->n_readings = d->n_readings;
    c->n_values = d->n_values;
    c->n_summaries = d->n_summaries;
    for (uint32_t i = 0; i < d->n_readings; i++) {
        c->readings[i] = d->readings[i];
    }
    for (uint32_t i = 0; i < d->n_values; i++) {
        c->values[i] = bd_delta_value(d, i);
    }
    for (uint32_t i = 0; i < d->n_summaries; i++) {
        c->summaries[i] = d->summaries[i];
    }
}

static void assert_delta_is(const struct bd_delta *d, const struct delta_copy *c) {
    cr_assert_eq(d->n_readings, c->n_readings);
    cr_assert_eq(d->n_values, c->n_values);
    cr_assert_eq(d->n_summaries, c->n_summaries);
    for (uint32_t i = 0; i < d->n_readings; i++) {
        cr_assert_eq(memcmp(&c->readings[i], &d->readings[i], sizeof(c->readings[i])), 0);
    }
    for (uint32_t i = 0; i < d->n_values; i++) {
        assert_same_value(bd_delta_value(d, i), c->values[i]);
    }
    for (uint32_t i = 0; i < d->n_summaries; i++) {
        cr_assert_eq(memcmp(&c->summaries[i], &d->summaries[i], sizeof(c->summaries[i])), 0);
    }
}

/* Out of memory, an add or a split changes nothing, whichever part had to grow. */
Test(bucket, allocation_failures_leave_deltas_as_they_were) {
    struct bd_delta d, tail;
    bd_delta_init(&d, sensor, 0, 0);
    bd_delta_init(&tail, sensor, 0, 1);
    struct delta_copy before, tail_before;
    int failed = 0;
    for (int i = 0; i < 40; i++) {
        /* Readings of 1 to 3 values, a new field now and then: each part grows in turn. */
        struct bd_reading_value r[] = {fv((uint16_t)(i / 10), i), iv(1, -i), bv(2, i & 1)};
        const uint32_t n = 1 + (uint32_t)i % 3;
        copy_delta(&d, &before);
        bd_alloc_fail_after(0, 0);
        int rc = bd_delta_add(&d, (40 - i) * MS, r, n);
        bd_alloc_fail_after(-1, 0);
        if (rc < 0) {
            cr_assert_eq(rc, -ENOMEM);
            assert_delta_is(&d, &before);
            failed++;
        }
        if (rc < 0 || i % 2 == 0) {
            cr_assert_eq(bd_delta_add(&d, (40 - i) * MS, r, n), 0);
        }
    }
    cr_assert_gt(failed, 3, "growing took an allocation more than once");
    /* Into an empty tail and into one that holds readings already. */
    for (int k = 0; k < 2; k++) {
        copy_delta(&d, &before);
        copy_delta(&tail, &tail_before);
        bd_alloc_fail_after(0, 1);
        cr_assert_eq(bd_delta_split(&d, 5, &tail), -ENOMEM);
        bd_alloc_fail_after(-1, 0);
        assert_delta_is(&d, &before);
        assert_delta_is(&tail, &tail_before);
        cr_assert_eq(bd_delta_split(&d, 30 - 10 * (uint32_t)k, &tail), 0);
    }
    cr_assert_eq(d.n_readings, 20);
    bd_delta_close(&d);
    bd_delta_close(&tail);
}

static void build_json(struct bd_delta *d, char **sel_json, char **upd_json) {
    bson_t sel, upd;
    cr_assert_eq(bd_delta_build_update(d, HOUR_MS, "w.t", 7, &sel, &upd), 0);
    *sel_json = bson_as_canonical_extended_json(&sel, NULL);
    *upd_json = bson_as_canonical_extended_json(&upd, NULL);
    bson_destroy(&sel);
    bson_destroy(&upd);
}

/* A whole delta moved into an empty one (a page held back for more readings) takes no memory
 * and builds the update the same readings added one by one would. */
Test(bucket, moving_a_whole_delta_hands_its_buffers_over) {
    struct bd_delta d, moved, direct;
    bd_delta_init(&d, sensor, HOUR_MS, 0);
    bd_delta_init(&moved, sensor, HOUR_MS, 2);
    bd_delta_init(&direct, sensor, HOUR_MS, 2);
    /* The empty target has buffers of its own from an earlier batch. */
    struct bd_reading_value old[] = {fv(3, 1.0)};
    cr_assert_eq(bd_delta_add(&moved, HOUR_MS * MS, old, 1), 0);
    bd_delta_reset(&moved);
    void *moved_buf = moved.summaries, *src_buf;
    for (int i = 0; i < 5; i++) {
        struct bd_reading_value r[] = {fv(0, 10 - i), iv(1, i), bv(2, true)};
        int64_t ts = (HOUR_MS + 100 - i % 2) * MS;
        cr_assert_eq(bd_delta_add(&d, ts, r, 1 + (uint32_t)i % 3), 0);
        cr_assert_eq(bd_delta_add(&direct, ts, r, 1 + (uint32_t)i % 3), 0);
    }
    src_buf = d.summaries;
    bd_alloc_fail_after(0, 1);
    cr_assert_eq(bd_delta_split(&d, 0, &moved), 0, "no allocation");
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(moved.summaries, src_buf);
    cr_assert_eq(d.summaries, moved_buf, "the source keeps the target's buffers for reuse");
    cr_assert_eq(d.n_readings, 0);
    cr_assert_eq(d.n_summaries, 0);
    cr_assert_eq(d.page, 0);
    cr_assert_eq(moved.page, 2, "the target keeps its page");
    cr_assert_eq(moved.n_readings, 5);
    char *s1, *u1, *s2, *u2;
    build_json(&moved, &s1, &u1);
    build_json(&direct, &s2, &u2);
    cr_assert_str_eq(s1, s2);
    cr_assert_str_eq(u1, u2);
    bson_free(s1);
    bson_free(u1);
    bson_free(s2);
    bson_free(u2);
    bd_delta_close(&d);
    bd_delta_close(&moved);
    bd_delta_close(&direct);
}

/* Readings of equal timestamps keep their arrival order in the update, also around a reading
 * without values (it shares its first value index with the next one). */
Test(bucket, equal_timestamps_stay_in_arrival_order) {
    struct bd_delta d;
    bd_delta_init(&d, sensor, 0, 0);
    struct bd_reading_value a[] = {fv(0, 1)}, b[] = {fv(0, 2)}, c[] = {fv(0, 3)},
                            e[] = {fv(0, 4), iv(1, 4)};
    cr_assert_eq(bd_delta_add(&d, 5 * MS, a, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 5 * MS, b, 0), 0);
    cr_assert_eq(bd_delta_add(&d, 5 * MS, b, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 3 * MS, c, 1), 0);
    cr_assert_eq(bd_delta_add(&d, 5 * MS, e, 2), 0);
    bson_t sel, upd;
    cr_assert_eq(bd_delta_build_update(&d, HOUR_MS, "w.t", 1, &sel, &upd), 0);
    bson_iter_t it, arr;
    cr_assert(find(&upd, "0.$set._n.$literal", &it) && bson_iter_recurse(&it, &arr));
    static const struct {
        int64_t ts_ms;
        int n_keys;
        double temp;
    } want[] = {{3, 2, 3}, {5, 2, 1}, {5, 1, 0}, {5, 2, 2}, {5, 3, 4}};
    size_t k = 0;
    while (bson_iter_next(&arr)) {
        cr_assert_lt(k, BD_ARRAY_LEN(want));
        bson_t rd;
        uint32_t len;
        const uint8_t *data;
        bson_iter_document(&arr, &len, &data);
        cr_assert(bson_init_static(&rd, data, len));
        cr_assert_eq(bson_count_keys(&rd), (uint32_t)want[k].n_keys, "reading %zu", k);
        cr_assert(find(&rd, "ts", &it));
        cr_assert_eq(bson_iter_date_time(&it), want[k].ts_ms);
        if (want[k].n_keys > 1) {
            cr_assert(find(&rd, "temp", &it));
            cr_assert_eq(bson_iter_double(&it), want[k].temp, "reading %zu", k);
        }
        k++;
    }
    cr_assert_eq(k, BD_ARRAY_LEN(want));
    bson_destroy(&sel);
    bson_destroy(&upd);
    bd_delta_close(&d);
}

/* Per field, what the readings [from, to) of summaries_follow_any_field_order sent. */
struct ref_summary {
    uint32_t count;
    double min, max, sum;
};

static void check_summaries(const struct bd_delta *d, const struct ref_summary *ref,
                            const char *what) {
    uint32_t want = 0;
    for (uint32_t f = 0; f < BD_SENSOR_MAX_FIELDS; f++) {
        want += ref[f].count != 0;
    }
    cr_assert_eq(d->n_summaries, want, "%s: %u summaries, sent %u numeric fields", what,
                 d->n_summaries, want);
    uint64_t seen = 0;
    for (uint32_t j = 0; j < d->n_summaries; j++) {
        const struct bd_field_summary *fs = &d->summaries[j];
        const struct ref_summary *r = &ref[fs->field];
        cr_assert_eq(seen >> fs->field & 1, 0, "%s: field %u summarised twice", what, fs->field);
        seen |= UINT64_C(1) << fs->field;
        cr_assert_eq(fs->count, r->count, "%s: field %u", what, fs->field);
        cr_assert_float_eq(fs->sum, r->sum, 1e-6, "%s: field %u", what, fs->field);
        double mn = fs->min.is_int ? (double)fs->min.v.i : fs->min.v.f;
        double mx = fs->max.is_int ? (double)fs->max.v.i : fs->max.v.f;
        cr_assert_eq(mn, r->min, "%s: field %u min %g, sent %g", what, fs->field, mn, r->min);
        cr_assert_eq(mx, r->max, "%s: field %u max %g, sent %g", what, fs->field, mx, r->max);
    }
}

/* fold() guesses a value's summary from the one before; readings whose fields come in the
 * summaries' order, reversed, shuffled or as random subsets (some boolean) must all be
 * summarised as sent, and so must both parts of a split, which fold many readings at once. */
Test(bucket, summaries_follow_any_field_order) {
    enum { N = 300, SPLIT = 170 };
    struct bd_delta d, tail;
    bd_delta_init(&d, sensor, 0, 0);
    bd_delta_init(&tail, sensor, 0, 1);
    static struct ref_summary all[BD_SENSOR_MAX_FIELDS], head[BD_SENSOR_MAX_FIELDS],
        rest[BD_SENSOR_MAX_FIELDS];
    memset(all, 0, sizeof(all));
    memset(head, 0, sizeof(head));
    memset(rest, 0, sizeof(rest));
    uint64_t rng = 0x9e3779b97f4a7c15u;
    for (uint32_t k = 0; k < N; k++) {
        uint16_t order[BD_SENSOR_MAX_FIELDS];
        uint32_t n = 0;
        for (uint16_t f = 0; f < BD_SENSOR_MAX_FIELDS; f++) {
            rng = rng * 6364136223846793005u + 1442695040888963407u;
            /* The first 60 readings carry fields 0..7 in order, as most sensors do. */
            if (k < 60 ? f < 8 : (rng >> 40) % 3 != 0) {
                order[n++] = f;
            }
        }
        if (k % 3 == 1) { /* reversed */
            for (uint32_t i = 0; i < n / 2; i++) {
                uint16_t x = order[i];
                order[i] = order[n - 1 - i];
                order[n - 1 - i] = x;
            }
        } else if (k % 3 == 2 && k >= 60) { /* shuffled */
            for (uint32_t i = n; i > 1; i--) {
                rng = rng * 6364136223846793005u + 1442695040888963407u;
                uint32_t r = (uint32_t)((rng >> 33) % i);
                uint16_t x = order[i - 1];
                order[i - 1] = order[r];
                order[r] = x;
            }
        }
        struct bd_reading_value v[BD_SENSOR_MAX_FIELDS];
        for (uint32_t i = 0; i < n; i++) {
            uint16_t f = order[i];
            rng = rng * 6364136223846793005u + 1442695040888963407u;
            int64_t x = (int64_t)((rng >> 35) % 20001) - 10000;
            double sent;
            if (f % 5 == 4) {
                v[i] = (struct bd_reading_value){.field = f, .kind = BD_VAL_BOOL};
                v[i].v.b = x > 0;
                continue;
            } else if (f % 2 == 1) {
                v[i] = iv(f, x);
                sent = (double)x;
            } else {
                v[i] = fv(f, (double)x / 4);
                sent = (double)x / 4;
            }
            struct ref_summary *refs[] = {all, k < SPLIT ? head : rest};
            for (int r = 0; r < 2; r++) {
                struct ref_summary *s = &refs[r][f];
                s->min = s->count == 0 || sent < s->min ? sent : s->min;
                s->max = s->count == 0 || sent > s->max ? sent : s->max;
                s->sum += sent;
                s->count++;
            }
        }
        cr_assert_eq(bd_delta_add(&d, (int64_t)k * MS, v, n), 0);
    }
    check_summaries(&d, all, "whole");
    cr_assert_eq(bd_delta_split(&d, SPLIT, &tail), 0);
    check_summaries(&d, head, "kept");
    check_summaries(&tail, rest, "moved");
    bd_delta_close(&d);
    bd_delta_close(&tail);
}
