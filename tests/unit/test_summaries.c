/*
 * The set of buckets due a summary refresh and the aggregate that refreshes them
 * (src/summaries.c): marking is idempotent, a round takes what was marked before it and nothing
 * after, a failed round gives its buckets back, an allocation failure changes nothing, and the
 * pipeline is the documented one with the buckets asked for.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/summaries.h"

static struct bd_summaries *s;

static void setup(void) {
    cr_assert_eq(bd_summaries_new(&s), 0);
}

static void teardown(void) {
    bd_alloc_fail_after(-1, 0);
    bd_summaries_free(s);
}

TestSuite(summaries, .init = setup, .fini = teardown);

Test(summaries, marking_a_bucket_twice_lists_it_once) {
    cr_assert_eq(bd_summaries_mark(s, "a", 0), 0);
    cr_assert_eq(bd_summaries_mark(s, "a", 0), 0);
    cr_assert_eq(bd_summaries_mark(s, "a", 3600000), 0);
    cr_assert_eq(bd_summaries_mark(s, "b", 0), 0);
    cr_assert_eq(bd_summaries_waiting(s), 3);
}

Test(summaries, many_buckets_each_listed_once_across_index_growth) {
    char id[32];
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 5000; i++) {
            snprintf(id, sizeof(id), "sensor,n=%d", i % 2500);
            cr_assert_eq(bd_summaries_mark(s, id, (int64_t)(i / 2500) * 3600000), 0);
        }
    }
    cr_assert_eq(bd_summaries_waiting(s), 5000);
    struct bd_page_key keys[7000];
    cr_assert_eq(bd_summaries_begin(s), 5000);
    cr_assert_eq(bd_summaries_next(s, keys, 7000), 5000);
    /* Every (id, start) exactly once. */
    static unsigned char seen[2500][2];
    memset(seen, 0, sizeof(seen));
    for (int i = 0; i < 5000; i++) {
        int n = -1;
        cr_assert_eq(sscanf(keys[i].sensor_id, "sensor,n=%d", &n), 1);
        int b = (int)(keys[i].start_ms / 3600000);
        cr_assert(n >= 0 && n < 2500 && (b == 0 || b == 1));
        cr_assert_eq(seen[n][b]++, 0, "%s %d listed twice", keys[i].sensor_id, b);
    }
}

Test(summaries, a_round_takes_what_was_marked_before_it_in_chunks) {
    struct bd_page_key keys[2];
    bd_summaries_mark(s, "a", 0);
    bd_summaries_mark(s, "b", 0);
    bd_summaries_mark(s, "c", 0);
    cr_assert_eq(bd_summaries_begin(s), 3);
    cr_assert_eq(bd_summaries_waiting(s), 0);
    /* Marked during the round, even a bucket of the round: waits for the next one, since the
     * refresh under way may have read its pages before the write. */
    bd_summaries_mark(s, "a", 0);
    bd_summaries_mark(s, "d", 0);
    cr_assert_eq(bd_summaries_waiting(s), 2);
    cr_assert_eq(bd_summaries_next(s, keys, 2), 2);
    cr_assert_str_eq(keys[0].sensor_id, "a");
    cr_assert_str_eq(keys[1].sensor_id, "b");
    bd_summaries_advance(s, 2);
    cr_assert_eq(bd_summaries_in_round(s), 1);
    cr_assert_eq(bd_summaries_begin(s), 1, "a round under way goes on");
    cr_assert_eq(bd_summaries_next(s, keys, 2), 1);
    cr_assert_str_eq(keys[0].sensor_id, "c");
    bd_summaries_advance(s, 1);
    cr_assert_eq(bd_summaries_next(s, keys, 2), 0, "the round is over");
    cr_assert_eq(bd_summaries_begin(s), 2);
    cr_assert_eq(bd_summaries_next(s, keys, 2), 2);
    cr_assert_str_eq(keys[0].sensor_id, "a");
    cr_assert_str_eq(keys[1].sensor_id, "d");
}

Test(summaries, a_failed_round_gives_its_buckets_back_without_duplicates) {
    struct bd_page_key keys[4];
    bd_summaries_mark(s, "a", 0);
    bd_summaries_mark(s, "b", 0);
    bd_summaries_mark(s, "c", 0);
    bd_summaries_begin(s);
    cr_assert_eq(bd_summaries_next(s, keys, 1), 1);
    bd_summaries_advance(s, 1);   /* "a" refreshed */
    bd_summaries_mark(s, "b", 0); /* written again meanwhile */
    cr_assert_eq(bd_summaries_next(s, keys, 4), 2);
    cr_assert_eq(bd_summaries_requeue(s), 0); /* the refresh of b and c failed */
    cr_assert_eq(bd_summaries_in_round(s), 0);
    cr_assert_eq(bd_summaries_waiting(s), 2, "b once, c");
    cr_assert_eq(bd_summaries_begin(s), 2);
    cr_assert_eq(bd_summaries_next(s, keys, 4), 2);
    cr_assert_str_eq(keys[0].sensor_id, "b");
    cr_assert_str_eq(keys[1].sensor_id, "c");
}

Test(summaries, each_allocation_failure_leaves_the_set_as_it_was) {
    char id[32];
    for (long k = 0;; k++) {
        bd_summaries_free(s);
        cr_assert_eq(bd_summaries_new(&s), 0);
        for (int i = 0; i < 40; i++) { /* up to an index growth */
            snprintf(id, sizeof(id), "s%d", i);
            cr_assert_eq(bd_summaries_mark(s, id, 0), 0);
        }
        bd_alloc_fail_after(k, 0);
        int failed = 0;
        for (int i = 40; i < 80; i++) {
            snprintf(id, sizeof(id), "s%d", i);
            failed += bd_summaries_mark(s, id, 0) < 0;
        }
        bd_alloc_fail_after(-1, 0);
        if (failed == 0) {
            cr_assert_eq(bd_summaries_waiting(s), 80);
            break;
        }
        cr_assert_eq(failed, 1);
        cr_assert_eq(bd_summaries_waiting(s), 79, "only the failed mark is missing (k=%ld)", k);
        /* Still consistent: marking again dedupes. */
        for (int i = 0; i < 80; i++) {
            snprintf(id, sizeof(id), "s%d", i);
            cr_assert_eq(bd_summaries_mark(s, id, 0), 0);
        }
        cr_assert_eq(bd_summaries_waiting(s), 80);
    }
}

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

Test(summaries, the_pipeline_matches_the_buckets_and_merges_into_the_collection) {
    struct bd_page_key keys[2] = {{"w,site=roof", 3600000}, {"x", -3600000}};
    bson_t p, m;
    bson_iter_t it;
    bd_summaries_pipeline(keys, 2, NULL, "b_summary", &p);
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

Test(summaries, a_given_match_replaces_the_buckets) {
    bson_t match, p, m;
    bson_iter_t it;
    bson_init(&match);
    BSON_APPEND_UTF8(&match, "sensor_id", "x");
    bd_summaries_pipeline(NULL, 0, &match, "c", &p);
    stage(&p, 0, "$match", &m);
    cr_assert(bson_equal(&m, &match));
    cr_assert(bson_iter_init(&it, &p) && bson_iter_find_descendant(&it, "6.$merge.into", &it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), "c");
    bson_destroy(&p);
    bson_destroy(&match);
}
