/*
 * The queries bucketd sends MongoDB about buckets, built as BSON: which page documents a set of
 * buckets is (a filter, for the page look-up and for the summaries' $match), and the aggregate
 * that recomputes the summary documents of buckets (summaries.h says what a summary is and why
 * it is recomputed, never incremented). The MongoDB store (store.c) runs them, the summary
 * refresh and bucketd-inspect ask for them.
 *
 * A leaf (src/queries.c): it only builds documents, with libbson; it calls nothing of bucketd's
 * but BD_ASSERT, keeps no state and may run on any thread.
 */
#ifndef BUCKETD_QUERIES_H
#define BUCKETD_QUERIES_H

#include <bson/bson.h>
#include <stdint.h>

/* A bucket: a sensor's bucket that starts at start_ms (the page documents' bucket_start). */
struct bd_page_key {
    const char *sensor_id;
    int64_t start_ms;
};

/* {$or: [{sensor_id, bucket_start}, ...]}: the documents of these n buckets. Initialises
 * filter. */
void bd_queries_buckets_filter(const struct bd_page_key *keys, uint32_t n, bson_t *filter);

/*
 * The aggregate, run on the page collection, that recomputes the summaries of these n buckets
 * and writes them into the collection `into` with $merge (on sensor_id and bucket_start, which
 * needs a unique index on them there; an existing document is replaced and keeps its _id). If
 * match is not NULL it is the pipeline's $match instead of the buckets' (keys may then be NULL):
 * bucketd-inspect rebuilds the summaries of a period with it. Initialises pipeline (an array).
 */
void bd_queries_summaries_pipeline(const struct bd_page_key *keys, uint32_t n, const bson_t *match,
                                   const char *into, bson_t *pipeline);

#endif
