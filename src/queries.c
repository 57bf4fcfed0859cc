/*
 * The queries about buckets, as BSON (include/bucketd/queries.h): the filter of a set of
 * buckets and the aggregate that recomputes their summaries. A leaf: builds documents with
 * libbson, calls nothing of bucketd's but BD_ASSERT, keeps no state; any thread.
 */
#include "bucketd/queries.h"

#include "bucketd/common.h"

/* ---- Buckets ------------------------------------------------------------------------------ */

void bd_queries_buckets_filter(const struct bd_page_key *keys, uint32_t n, bson_t *filter) {
    bson_t or, clause;
    char idx[16];
    const char *key;
    bson_init(filter);
    BSON_APPEND_ARRAY_BEGIN(filter, "$or", & or);
    for (uint32_t i = 0; i < n; i++) {
        bson_uint32_to_string(i, &key, idx, sizeof(idx));
        BSON_APPEND_DOCUMENT_BEGIN(& or, key, &clause);
        BSON_APPEND_UTF8(&clause, "sensor_id", keys[i].sensor_id);
        BSON_APPEND_DATE_TIME(&clause, "bucket_start", keys[i].start_ms);
        bson_append_document_end(& or, &clause);
    }
    bson_append_array_end(filter, & or);
}

/* ---- The summaries' aggregate ------------------------------------------------------------ */

/*
 * After the $match, in MongoDB's extended JSON (the pages' `summary` keys are field names already
 * escaped for MongoDB, see names.h, so they are safe as keys here):
 *
 *   {$project: {_id: 0, sensor_id: 1, meta: 1, bucket_start: 1, bucket_end: 1,
 *               f: {$concatArrays: [[{k: null, c: "$count", p: {$literal: 1}}],
 *                                   {$objectToArray: {$ifNull: ["$summary", {}]}}]}}}
 *       one row per page ({k: null}: its count, and 1 for the page count) and per field
 *   {$unwind: "$f"}
 *   {$group: {_id: {s: "$sensor_id", t: "$bucket_start", k: "$f.k"}, meta: {$first: "$meta"},
 *             end: {$first: "$bucket_end"}, min: {$min: "$f.v.min"}, max: {$max: "$f.v.max"},
 *             sum: {$sum: "$f.v.sum"}, n: {$sum: "$f.v.count"}, count: {$sum: "$f.c"},
 *             pages: {$sum: "$f.p"}}}
 *       per bucket and field; the page rows (k null) carry count and pages, the others 0
 *   {$group: {_id: {s: "$_id.s", t: "$_id.t"}, meta: {$first: "$meta"}, end: {$first: "$end"},
 *             count: {$sum: "$count"}, pages: {$sum: "$pages"},
 *             fields: {$push: {k: "$_id.k", v: {min: "$min", max: "$max", sum: "$sum",
 *                      count: "$n", avg: {$cond: [{$gt: ["$n", 0]}, {$divide: ["$sum", "$n"]},
 *                                                  null]}}}}}}
 *   {$project: {_id: 0, sensor_id: "$_id.s", bucket_start: "$_id.t", bucket_end: "$end",
 *               meta: 1, pages: 1, count: 1,
 *               summary: {$arrayToObject: {$filter: {input: "$fields", as: "x",
 *                                                    cond: {$ne: ["$$x.k", null]}}}}}}
 *   {$merge: {into, on: ["sensor_id", "bucket_start"], whenMatched: "replace",
 *             whenNotMatched: "insert"}}
 *
 * min and max keep their BSON types ($min/$max compare across numeric types), count is the sum of
 * the pages' int64 counts, avg is recomputed from the totals.
 */
static const char *const pipeline_rest =
    "["
    "{\"$project\": {\"_id\": 0, \"sensor_id\": 1, \"meta\": 1, \"bucket_start\": 1,"
    " \"bucket_end\": 1, \"f\": {\"$concatArrays\": [[{\"k\": null, \"c\": \"$count\","
    " \"p\": {\"$literal\": 1}}], {\"$objectToArray\": {\"$ifNull\": [\"$summary\", {}]}}]}}},"
    "{\"$unwind\": \"$f\"},"
    "{\"$group\": {\"_id\": {\"s\": \"$sensor_id\", \"t\": \"$bucket_start\", \"k\": \"$f.k\"},"
    " \"meta\": {\"$first\": \"$meta\"}, \"end\": {\"$first\": \"$bucket_end\"},"
    " \"min\": {\"$min\": \"$f.v.min\"}, \"max\": {\"$max\": \"$f.v.max\"},"
    " \"sum\": {\"$sum\": \"$f.v.sum\"}, \"n\": {\"$sum\": \"$f.v.count\"},"
    " \"count\": {\"$sum\": \"$f.c\"}, \"pages\": {\"$sum\": \"$f.p\"}}},"
    "{\"$group\": {\"_id\": {\"s\": \"$_id.s\", \"t\": \"$_id.t\"},"
    " \"meta\": {\"$first\": \"$meta\"}, \"end\": {\"$first\": \"$end\"},"
    " \"count\": {\"$sum\": \"$count\"}, \"pages\": {\"$sum\": \"$pages\"},"
    " \"fields\": {\"$push\": {\"k\": \"$_id.k\", \"v\": {\"min\": \"$min\", \"max\": \"$max\","
    " \"sum\": \"$sum\", \"count\": \"$n\", \"avg\": {\"$cond\": [{\"$gt\": [\"$n\", 0]},"
    " {\"$divide\": [\"$sum\", \"$n\"]}, null]}}}}}},"
    "{\"$project\": {\"_id\": 0, \"sensor_id\": \"$_id.s\", \"bucket_start\": \"$_id.t\","
    " \"bucket_end\": \"$end\", \"meta\": 1, \"pages\": 1, \"count\": 1,"
    " \"summary\": {\"$arrayToObject\": {\"$filter\": {\"input\": \"$fields\", \"as\": \"x\","
    " \"cond\": {\"$ne\": [\"$$x.k\", null]}}}}}}"
    "]";

void bd_queries_summaries_pipeline(const struct bd_page_key *keys, uint32_t n, const bson_t *match,
                                   const char *into, bson_t *pipeline) {
    bson_t stage, merge, on, rest;
    bson_iter_t it;
    uint32_t i = 0;
    char idx[16];
    const char *key;
    bson_init(pipeline);
    bson_uint32_to_string(i++, &key, idx, sizeof(idx));
    BSON_APPEND_DOCUMENT_BEGIN(pipeline, key, &stage);
    if (match != NULL) {
        BSON_APPEND_DOCUMENT(&stage, "$match", match);
    } else {
        bson_t own;
        bd_queries_buckets_filter(keys, n, &own);
        BSON_APPEND_DOCUMENT(&stage, "$match", &own);
        bson_destroy(&own);
    }
    bson_append_document_end(pipeline, &stage);
    /* A constant that parses: checked by the unit tests. */
    bool parsed = bson_init_from_json(&rest, pipeline_rest, -1, NULL);
    BD_ASSERT(parsed);
    if (bson_iter_init(&it, &rest)) {
        while (bson_iter_next(&it)) {
            uint32_t len;
            const uint8_t *data;
            bson_t doc;
            bson_iter_document(&it, &len, &data);
            if (bson_init_static(&doc, data, len)) {
                bson_uint32_to_string(i++, &key, idx, sizeof(idx));
                BSON_APPEND_DOCUMENT(pipeline, key, &doc);
            }
        }
    }
    bson_destroy(&rest);
    bson_uint32_to_string(i, &key, idx, sizeof(idx));
    BSON_APPEND_DOCUMENT_BEGIN(pipeline, key, &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$merge", &merge);
    BSON_APPEND_UTF8(&merge, "into", into);
    BSON_APPEND_ARRAY_BEGIN(&merge, "on", &on);
    BSON_APPEND_UTF8(&on, "0", "sensor_id");
    BSON_APPEND_UTF8(&on, "1", "bucket_start");
    bson_append_array_end(&merge, &on);
    BSON_APPEND_UTF8(&merge, "whenMatched", "replace");
    BSON_APPEND_UTF8(&merge, "whenNotMatched", "insert");
    bson_append_document_end(&stage, &merge);
    bson_append_document_end(pipeline, &stage);
}
