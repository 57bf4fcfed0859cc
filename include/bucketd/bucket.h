/*
 * Bucket arithmetic and per-flush bucket deltas: which bucket a reading belongs to, the
 * readings and running summaries one flush adds to one bucket page, and the single MongoDB
 * update (an upsert with an update pipeline) that applies them. Used by the flusher thread
 * only; pure functions apart from the delta's own buffers, so unit tests drive them directly.
 */
#ifndef BUCKETD_BUCKET_H
#define BUCKETD_BUCKET_H

#include <bson/bson.h>
#include <stdint.h>

#include "bucketd/sensor.h"

/* floor(a / b) for b > 0, also for negative a (timestamps before 1970). */
int64_t bd_floor_div(int64_t a, int64_t b);

/* Start of the bucket (ms since the epoch) holding a reading taken at ts_ns. */
int64_t bd_bucket_start_ms(int64_t ts_ns, uint64_t span_ms);

/*
 * Sensor ids up to this many bytes appear verbatim in a bucket's _id. A longer id is shortened to
 * its first BD_BUCKET_ID_PREFIX bytes (cut at a UTF-8 character boundary), '~' and the 32 hex
 * digits of the XXH3-128 digest of the whole id, so that ids of any accepted length keep
 * distinct, bounded _ids; the full id is always in the document's sensor_id. A shorter id that
 * has that shape itself (189 to 192 bytes, '~', 32 lowercase hex digits) takes the digest form
 * too, so that no id written verbatim is ever another id's digest form.
 */
#define BD_BUCKET_ID_MAX_VERBATIM 256
#define BD_BUCKET_ID_PREFIX 192

/*
 * Deterministic document id "<sensor_id or its digest form>|<bucket_start_unix_seconds>|<page>"
 * into buf; -ENAMETOOLONG if it does not fit in cap (BD_BUCKET_ID_MAX always fits).
 */
#define BD_BUCKET_ID_MAX (BD_BUCKET_ID_MAX_VERBATIM + 48)
int bd_bucket_id(char *buf, size_t cap, const char *sensor_id, int64_t start_ms, uint32_t page);

/*
 * Size limits of what the flusher sends. A page closes when its estimated BSON size would pass
 * BD_PAGE_MAX_BYTES (half of MongoDB's 16 MiB document limit, so estimates never bring it
 * close); an update whose own BSON is larger than BD_UPDATE_MAX_BYTES (the server's document
 * limit; the driver refuses statements above it plus 16 KiB) is never sent as built.
 */
#define BD_PAGE_MAX_BYTES (UINT64_C(8) << 20)
#define BD_UPDATE_MAX_BYTES (UINT64_C(16) << 20)

/* A numeric value as stored: kept in its own BSON type (double or int64). Packed (9 bytes) so
 * that a field's summary takes 32 bytes: a batch holds one per field of every page it updates. */
struct __attribute__((packed)) bd_num {
    bool is_int;
    union {
        double f;
        int64_t i;
    } v;
};

struct bd_field_summary {
    double sum;
    uint32_t count; /* readings of the delta holding the field: a delta holds < 2^32 readings */
    uint16_t field; /* index into the sensor's field names */
    struct bd_num min, max;
};

struct bd_delta_reading {
    int64_t ts_ns;
    uint32_t first; /* index of its first value in the delta's values: grows in arrival order */
    uint32_t n;
};

/*
 * What one flush adds to one bucket page. Buffers are reused across flushes.
 *
 * One allocation holds everything, at the address of summaries: cap_summaries summaries (one
 * per numeric field the readings hold, sized exactly: a sensor has at most
 * BD_SENSOR_MAX_FIELDS fields), then cap_readings readings, then the values of cap_values
 * values in two arrays: their 8 bytes (bd_delta_value decodes them), then one byte each for the
 * field (6 bits) and kind (2 bits). A batch holds a delta for every page it updates: for the
 * common few readings of a few fields per flush, no part of it is rounded up to a power of two.
 */
struct bd_delta {
    struct bd_sensor *sensor;
    int64_t start_ms;
    struct bd_field_summary *summaries; /* the delta's allocation (NULL: none yet) */
    struct bd_delta_reading *readings;  /* inside it */
    uint32_t page;
    uint32_t n_readings, cap_readings;
    uint32_t n_values, cap_values;
    uint8_t n_summaries, cap_summaries;
};

void bd_delta_init(struct bd_delta *d, struct bd_sensor *s, int64_t start_ms, uint32_t page);
/* A delta for (s, start_ms, page) that keeps d's buffers (emptied) for reuse. */
void bd_delta_retarget(struct bd_delta *d, struct bd_sensor *s, int64_t start_ms, uint32_t page);
/* Memory the delta holds: its struct and its buffers' capacity. */
uint64_t bd_delta_bytes(const struct bd_delta *d);
/* Drop the contents, keep the buffers. */
void bd_delta_reset(struct bd_delta *d);
void bd_delta_close(struct bd_delta *d);

/*
 * Add one reading (values of numeric kinds are folded into the summaries). All or nothing:
 * -ENOMEM leaves the delta exactly as it was.
 */
int bd_delta_add(struct bd_delta *d, int64_t ts_ns, const struct bd_reading_value *vals,
                 uint32_t n);

/* Value i (0 <= i < n_values) as it was added. */
struct bd_reading_value bd_delta_value(const struct bd_delta *d, uint32_t i);

/* bd_reading_bytes of the delta's reading r (readings[r]). */
uint64_t bd_delta_reading_bytes(const struct bd_delta *d, uint32_t r);

/*
 * Move the readings after the first `keep` (arrival order; 0 moves all) into dst, which must be
 * initialised (it may already hold readings), and recompute src's summaries. For a bucket page
 * that fills up: keep is what still fits. -ENOMEM leaves src whole and dst as it was. Moving a
 * whole delta into an empty one hands the buffers over (src gets dst's), allocating nothing.
 */
int bd_delta_split(struct bd_delta *src, uint32_t keep, struct bd_delta *dst);

/*
 * Append src's readings [from, to) (arrival order) to dst, as bd_delta_split would move them,
 * leaving src as it is. -ENOMEM (no room made with bd_delta_reserve) leaves dst as it was.
 */
int bd_delta_copy_readings(const struct bd_delta *src, uint32_t from, uint32_t to,
                           struct bd_delta *dst);

/* Cut the delta to its first `keep` readings (arrival order), its summaries folded again. */
void bd_delta_truncate(struct bd_delta *d, uint32_t keep);

/*
 * Make room for `readings` more readings holding `values` values (and as many new summaries, up
 * to one per field a sensor can have), so that adding them cannot fail. -ENOMEM leaves the contents as they were.
 */
int bd_delta_reserve(struct bd_delta *d, uint32_t readings, uint32_t values);

/* Estimated BSON bytes of one reading inside a document's readings array (an upper bound). */
uint64_t bd_reading_bytes(const struct bd_sensor *s, const struct bd_reading_value *vals,
                          uint32_t n);

/* The same for a reading that holds every one of the sensor's first n_fields fields: an upper
 * bound of bd_reading_bytes for any reading using only those fields. */
uint64_t bd_reading_bytes_max(const struct bd_sensor *s, uint32_t n_fields);

/* Estimated BSON bytes of a page document without its readings (an upper bound for one writer). */
uint64_t bd_page_overhead_bytes(const struct bd_sensor *s);

/* Dotted path of a writer's sequence in a bucket document: "w.<writer_id>". */
#define BD_WRITER_KEY_PREFIX "w."

/*
 * Build the upsert for this delta: *selector = {_id, sensor_id, bucket_start, <writer_key>:
 * {$not: {$gte: seq}}} (the two shard-key fields as equalities, with the document's values and
 * types), *update = the update pipeline (see bucket.c for the document it maintains), which also
 * sets <writer_key> to seq. Sorts the delta's readings by time. The delta must hold a reading. Both
 * bson_t are initialised by this call, also on failure; the caller destroys them. Returns 0, or
 * -ENOMEM. Names of any length are written whole.
 */
int bd_delta_build_update(struct bd_delta *d, uint64_t span_ms, const char *writer_key,
                          uint64_t seq, bson_t *selector, bson_t *update);

#endif
