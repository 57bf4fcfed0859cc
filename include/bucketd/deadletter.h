/*
 * Dead letters: bucket updates MongoDB refused for good (a permanent per-document error such as
 * a failed collection validator), kept on disk so that an operator can see what was refused and
 * send it again once the cause is fixed (`bucketd-inspect dead-letter`).
 *
 * File: <spool.dir>/dead-letter.jsonl, append-only, one record per line in MongoDB canonical
 * Extended JSON (types survive the round trip), each line written whole with one write(2) and
 * fsync'ed: dead letters are rare, and each one is readings nobody else holds. A line:
 *
 *   {"time": {"$date": ...}, "writer_id": ..., "seq": NumberLong, "database": ...,
 *    "collection": ..., "bucket_id": ..., "n_readings": NumberLong, "code": NumberLong,
 *    "message": ..., "filter": {...}, "update": [...]}
 *
 * The file is opened (O_APPEND, created 0600 when missing) for each append and closed after it,
 * so an operator may move it away while the daemon runs; the next record starts a new file.
 * A last line without its newline (a crash in the middle of a write) is cut off, logged, when the
 * file is next opened, so every line stays one record; a tail that is a whole record only lacks
 * its newline, which is added instead.
 *
 * Flusher thread only after bd_deadletter_open.
 */
#ifndef BUCKETD_DEADLETTER_H
#define BUCKETD_DEADLETTER_H

#include <bson/bson.h>
#include <stdint.h>

#include "bucketd/common.h"

#define BD_DEADLETTER_FILE "dead-letter.jsonl"

/* Beyond this size the file takes no more records (each refusal is still counted and logged). */
#define BD_DEADLETTER_MAX_BYTES (UINT64_C(256) << 20)

struct bd_deadletter;

/* One refused update, as it was sent. */
struct bd_deadletter_record {
    int64_t time_ms;       /* wall clock when it was refused */
    const char *writer_id; /* this daemon's writer_id */
    uint64_t seq;          /* the flush sequence number the update carried */
    const char *database;  /* where it was going */
    const char *collection;
    const char *bucket_id; /* the document's _id */
    uint32_t n_readings;   /* readings inside the update */
    int64_t code;          /* MongoDB's error code (0 if none) */
    const char *message;   /* MongoDB's or the driver's message */
    const bson_t *filter;  /* the update's filter, as sent */
    const bson_t *update;  /* the update (a pipeline: an array document), as sent */
};

/*
 * Open (create if missing) <dir>/dead-letter.jsonl for appending and repair a torn tail. dir
 * must exist (bd_writer_open creates spool.dir). Errors name the path.
 */
int bd_deadletter_open(struct bd_deadletter **out, const char *dir, struct bd_err *err);

/*
 * Append one record and fsync it. -ENOSPC when the record would take the file past
 * BD_DEADLETTER_MAX_BYTES (or the disk is full), -EINVAL when a string of it is not UTF-8
 * (JSON cannot carry it), other negative errno values on I/O errors (err names the path); the
 * record is then not kept. Blocks for an open, a write and an fsync.
 */
int bd_deadletter_append(struct bd_deadletter *dl, const struct bd_deadletter_record *rec,
                         struct bd_err *err);

/* Path of the file (for log messages). */
const char *bd_deadletter_path(const struct bd_deadletter *dl);

/* NULL is a no-op. */
void bd_deadletter_close(struct bd_deadletter *dl);

#endif
