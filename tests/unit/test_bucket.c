/*
 * Bucket arithmetic and the per-bucket update document (src/bucket.c).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

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
