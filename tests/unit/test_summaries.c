/*
 * The set of buckets due a summary refresh (src/summaries.c): marking is idempotent, a round
 * takes what was marked before it and nothing after, a failed round gives its buckets back, and
 * an allocation failure changes nothing. The aggregate that refreshes them is
 * tests/unit/test_queries.c's.
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
