/*
 * The queries about buckets (src/queries.c): the summaries' pipeline is the documented one with
 * the buckets asked for (or the match given), and the buckets' filter names each bucket once.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/queries.h"

static const bson_t *stage(const bson_t *pipeline, uint32_t i, const char *name, bson_t *out) {
    bson_iter_t it, st;
    char key[16];
    snprintf(key, sizeof(key), "%u", i);
    cr_assert(bson_iter_init_find(&it, pipeline, key), "stage %u", i);
    cr_assert(BSON_ITER_HOLDS_DOCUMENT(&it));
    cr_assert(bson_iter_recurse(&it, &st) && bson_iter_next(&st));
    cr_assert_str_eq(bson_iter_key(&st), name, "stage %u", i);
    uint32_t len;
    const uint8_t *data;
    if (!BSON_ITER_HOLDS_DOCUMENT(&st)) {
        bson_init(out); /* $unwind: "$f" */
        return out;
    }
    bson_iter_document(&st, &len, &data);
    cr_assert(bson_init_static(out, data, len));
    return out;
}

Test(queries, the_pipeline_matches_the_buckets_and_merges_into_the_collection) {
    struct bd_page_key keys[2] = {{"w,site=roof", 3600000}, {"x", -3600000}};
    bson_t p, m;
    bson_iter_t it;
    bd_queries_summaries_pipeline(keys, 2, NULL, "b_summary", &p);
    cr_assert_eq(bson_count_keys(&p), 7);
    stage(&p, 0, "$match", &m);
    cr_assert(bson_iter_init(&it, &m) && bson_iter_find_descendant(&it, "$or.1.bucket_start", &it));
    cr_assert_eq(bson_iter_date_time(&it), -3600000);
    cr_assert(bson_iter_init(&it, &m) && bson_iter_find_descendant(&it, "$or.0.sensor_id", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "w,site=roof");
    cr_assert(bson_iter_init(&it, &m) && !bson_iter_find_descendant(&it, "$or.2", &it));
    stage(&p, 1, "$project", &m);
    stage(&p, 2, "$unwind", &m);
    stage(&p, 3, "$group", &m);
    stage(&p, 4, "$group", &m);
    stage(&p, 5, "$project", &m);
    stage(&p, 6, "$merge", &m);
    cr_assert(bson_iter_init(&it, &m) && bson_iter_find_descendant(&it, "into", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "b_summary");
    cr_assert(bson_iter_init(&it, &m) && bson_iter_find_descendant(&it, "on.1", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "bucket_start");
    cr_assert(bson_iter_init(&it, &m) && bson_iter_find_descendant(&it, "whenMatched", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "replace");
    bson_destroy(&p);
}

Test(queries, a_given_match_replaces_the_buckets) {
    bson_t match, p, m;
    bson_iter_t it;
    bson_init(&match);
    BSON_APPEND_UTF8(&match, "sensor_id", "x");
    bd_queries_summaries_pipeline(NULL, 0, &match, "c", &p);
    stage(&p, 0, "$match", &m);
    cr_assert(bson_equal(&m, &match));
    cr_assert(bson_iter_init(&it, &p) && bson_iter_find_descendant(&it, "6.$merge.into", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "c");
    bson_destroy(&p);
    bson_destroy(&match);
}

Test(queries, the_buckets_filter_lists_each_bucket_by_sensor_and_start) {
    struct bd_page_key keys[3] = {{"a", 0}, {"b,site=x", 7200000}, {"a", 3600000}};
    bson_t f;
    bson_iter_t it;
    bd_queries_buckets_filter(keys, 3, &f);
    cr_assert_eq(bson_count_keys(&f), 1);
    for (uint32_t i = 0; i < 3; i++) {
        char path[32];
        snprintf(path, sizeof(path), "$or.%u.sensor_id", i);
        cr_assert(bson_iter_init(&it, &f) && bson_iter_find_descendant(&it, path, &it), "%s", path);
        cr_assert_str_eq(bson_iter_utf8(&it, NULL), keys[i].sensor_id);
        snprintf(path, sizeof(path), "$or.%u.bucket_start", i);
        cr_assert(bson_iter_init(&it, &f) && bson_iter_find_descendant(&it, path, &it), "%s", path);
        cr_assert(BSON_ITER_HOLDS_DATE_TIME(&it));
        cr_assert_eq(bson_iter_date_time(&it), keys[i].start_ms);
    }
    cr_assert(bson_iter_init(&it, &f) && !bson_iter_find_descendant(&it, "$or.3", &it));
    bson_destroy(&f);
}
