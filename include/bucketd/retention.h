/*
 * Retention (buckets.retention, summaries.retention): MongoDB deletes a document once its
 * bucket_end is older than the retention, through a TTL index bucketd keeps on {bucket_end: 1}
 * under its own name. This module brings that index to the configured value: created with
 * createIndexes (expireAfterSeconds), changed in place with collMod when the value changes,
 * dropped when retention is turned off (0). An index on {bucket_end: 1} under another name is
 * the operator's: never changed or dropped; with retention on it is a conflict (MongoDB allows
 * one index per key pattern), reported as an error.
 *
 * What this costs MongoDB (bucketd-schema(7), "Retention"): the TTL monitor of the primary wakes every 60 s
 * (ttlMonitorSleepSecs) and deletes the expired documents through the index; each deletion is an
 * ordinary write (the document and every index entry of it, journalled), replicated to every
 * secondary through the oplog.
 *
 * Threads: whichever thread uses the client (the flusher's I/O thread).
 */
#ifndef BUCKETD_RETENTION_H
#define BUCKETD_RETENTION_H

#include <mongoc/mongoc.h>
#include <stdbool.h>
#include <stdint.h>

/* The name of the TTL index bucketd keeps, on the page and the summary collection alike. */
#define BD_RETENTION_INDEX "bucket_end_ttl"

enum bd_retention_done {
    BD_RETENTION_UNCHANGED, /* already as wanted (or off with no index of ours) */
    BD_RETENTION_CREATED,   /* createIndexes */
    BD_RETENTION_CHANGED,   /* collMod; *old_seconds says from what */
    BD_RETENTION_DROPPED,   /* dropIndexes: retention turned off */
};

/*
 * Bring db.coll's TTL index to seconds (0: none). true and *done on success; false with error
 * set when a command failed or another index on {bucket_end: 1} is in the way (error code 0,
 * domain MONGOC_ERROR_COMMAND, the message naming that index).
 */
bool bd_retention_sync(mongoc_database_t *db, const char *coll, uint64_t seconds,
                       enum bd_retention_done *done, int64_t *old_seconds, bson_error_t *error);

#endif
