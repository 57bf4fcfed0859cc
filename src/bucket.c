/*
 * Bucket arithmetic and the per-bucket update document. Flusher thread only.
 *
 * One delta becomes one upsert on {_id} whose update is a pipeline, so that a single write
 * both appends the readings and keeps every summary true, including avg (classic update
 * operators cannot divide sum by count):
 *
 *   1. $set  _n (the new readings, time-ordered), the constant fields (sensor_id, meta,
 *            bucket_start, bucket_end, page), count += n, and per numeric field
 *            summary.<f>.min/max (via $min/$max), .sum and .count (via $add);
 *   2. $set  readings = existing readings + _n, re-sorted by ts (equal timestamps in arrival
 *            order, see append_sorted) only when the first new reading is older than the last
 *            stored one (late data), and summary.<f>.avg = sum / count;
 *   3. $unset _n.
 *
 * Idempotency: the filter is {_id, sensor_id, bucket_start, "w.<writer_id>": {$not: {$gte:
 * seq}}} and stage 1 sets "w.<writer_id>" to seq, the writer's flush sequence (writer.h). Sent
 * again after an ambiguous failure, the update finds no matching document; the upsert then
 * inserts an _id that exists and MongoDB answers duplicate key (11000): "already applied". Each
 * writer id has its own entry in w, so several daemons can append to one bucket.
 *
 * Sharding: mongos routes an upsert by the equalities of its filter, and MongoDB 5.x and 6.x
 * answer ShardKeyNotFound (61) when they do not cover the whole shard key. sensor_id and
 * bucket_start are in the filter, with the values and BSON types (string, date) the document
 * stores, so {sensor_id: "hashed"} and {sensor_id: 1, bucket_start: 1} both work. An upsert
 * seeds the new document with the filter's equality fields (_id, sensor_id, bucket_start; the
 * w condition is no equality); stage 1 then sets the same two fields to the same values, which
 * changes nothing, so the stored document is the one the pipeline alone would build (only the
 * order of its fields differs: bucket_start now comes before meta). A page's _id is derived
 * from its sensor_id and bucket_start, so every attempt at one page reaches the same shard and
 * that shard's _id index gives the duplicate-key answer.
 *
 * Every value that comes from the network is wrapped in $literal so that a string starting
 * with '$' is never read as a field path. Field names and tag keys come escaped from the
 * sensor table (names.h: no '.', no leading '$', a field never "ts"), so they are safe inside
 * dotted paths and never collide with a reading's ts.
 */
#include "bucketd/bucket.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "bucketd/alloc.h"

int64_t bd_floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) {
        q--;
    }
    return q;
}

int64_t bd_bucket_start_ms(int64_t ts_ns, uint64_t span_ms) {
    int64_t ms = bd_floor_div(ts_ns, BD_NS_PER_MS);
    return bd_floor_div(ms, (int64_t)span_ms) * (int64_t)span_ms;
}

/* Hex digits of the digest form: two XXH3-128 halves. */
#define DIGEST_HEX 32

/*
 * Whether an id has the shape of a long id's digest form: a prefix of BD_BUCKET_ID_PREFIX bytes
 * or up to three fewer (cut before a character), '~' and DIGEST_HEX lowercase hex digits. Such
 * an id, short as it is, takes the digest form itself: written verbatim, it would be the _id of
 * the long id whose digest it spells (anyone can compute one), and two sensors would share
 * their pages.
 */
static bool looks_like_digest(const char *id, size_t len) {
    if (len < BD_BUCKET_ID_PREFIX - 3 + 1 + DIGEST_HEX ||
        len > BD_BUCKET_ID_PREFIX + 1 + DIGEST_HEX || id[len - DIGEST_HEX - 1] != '~') {
        return false;
    }
    for (size_t i = len - DIGEST_HEX; i < len; i++) {
        char c = id[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
            return false;
        }
    }
    return true;
}

int bd_bucket_id(char *buf, size_t cap, const char *sensor_id, int64_t start_ms, uint32_t page) {
    size_t len = strlen(sensor_id);
    int64_t start_s = bd_floor_div(start_ms, 1000);
    int n;
    if (len <= BD_BUCKET_ID_MAX_VERBATIM && !looks_like_digest(sensor_id, len)) {
        n = snprintf(buf, cap, "%s|%" PRId64 "|%" PRIu32, sensor_id, start_s, page);
    } else {
        /* Cut before a UTF-8 continuation byte, never inside a character. */
        size_t keep = BD_BUCKET_ID_PREFIX;
        while (keep > 0 && ((unsigned char)sensor_id[keep] & 0xC0) == 0x80) {
            keep--;
        }
        XXH128_hash_t h = XXH3_128bits(sensor_id, len);
        n = snprintf(buf, cap, "%.*s~%016llx%016llx|%" PRId64 "|%" PRIu32, (int)keep, sensor_id,
                     (unsigned long long)h.high64, (unsigned long long)h.low64, start_s, page);
    }
    return (n < 0 || (size_t)n >= cap) ? -ENAMETOOLONG : 0;
}

/* Field (6 bits) and kind (2 bits) of a value in a delta's tag byte. */
#define TAG_FIELD_BITS 6
#define TAG_FIELD_MASK ((1u << TAG_FIELD_BITS) - 1)
_Static_assert(BD_SENSOR_MAX_FIELDS <= 1u << TAG_FIELD_BITS, "a value's field fits its tag");
_Static_assert(BD_VAL_BOOL < 4, "a value's kind fits its tag");
_Static_assert(sizeof(struct bd_field_summary) == 32, "a summary fits 32 bytes");
_Static_assert(sizeof(struct bd_delta_reading) == 16, "a reading fits 16 bytes");

/* Bytes of a delta's allocation for these capacities (see struct bd_delta). */
static size_t block_bytes(uint32_t cap_summaries, uint32_t cap_readings, uint32_t cap_values) {
    return (size_t)cap_summaries * sizeof(struct bd_field_summary) +
           (size_t)cap_readings * sizeof(struct bd_delta_reading) +
           (size_t)cap_values * (sizeof(uint64_t) + 1);
}

static uint64_t *payloads(const struct bd_delta *d) {
    return (uint64_t *)(void *)(d->readings + d->cap_readings);
}

static uint8_t *tags(const struct bd_delta *d) {
    return (uint8_t *)(payloads(d) + d->cap_values);
}

void bd_delta_init(struct bd_delta *d, struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    memset(d, 0, sizeof(*d));
    d->sensor = s;
    d->start_ms = start_ms;
    d->page = page;
}

void bd_delta_retarget(struct bd_delta *d, struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    bd_delta_reset(d);
    d->sensor = s;
    d->start_ms = start_ms;
    d->page = page;
}

void bd_delta_reset(struct bd_delta *d) {
    d->n_readings = 0;
    d->n_values = 0;
    d->n_summaries = 0;
}

void bd_delta_close(struct bd_delta *d) {
    free(d->summaries);
    memset(d, 0, sizeof(*d));
}

/* A capacity for need: from exactly what the first use needs (most deltas hold a few readings
 * of a few fields: a batch of 100k sensors must not reserve room for 8 each), then by half as
 * much again, so that a delta of a few readings stays exact and a long one is copied O(1)
 * times per reading. */
static uint32_t grown_cap(uint32_t cap, uint64_t need) {
    if (need <= cap) {
        return cap;
    }
    uint64_t n = (uint64_t)cap + cap / 2;
    return (uint32_t)BD_MIN(BD_MAX(n, need), (uint64_t)UINT32_MAX);
}

/*
 * Room for need_r readings, need_v values and need_s summaries in all (grow below: more than
 * the delta has). The allocation grows in place where the allocator can; its parts move up to
 * their new offsets (the last part first, so none overwrites another before it moved).
 * -ENOMEM changes nothing.
 */
static int grow_block(struct bd_delta *d, uint64_t need_r, uint64_t need_v, uint64_t need_s) {
    if (need_r > UINT32_MAX || need_v > UINT32_MAX) {
        return -ENOMEM;
    }
    const uint32_t cr = grown_cap(d->cap_readings, need_r), cv = grown_cap(d->cap_values, need_v);
    const uint32_t cs = (uint32_t)BD_MAX(need_s, d->cap_summaries);
    char *b = bd_realloc(d->summaries, block_bytes(cs, cr, cv));
    if (b == NULL) {
        return -ENOMEM;
    }
    const size_t old_r = block_bytes(d->cap_summaries, 0, 0);
    const size_t old_p = block_bytes(d->cap_summaries, d->cap_readings, 0);
    const size_t old_t = old_p + (size_t)d->cap_values * sizeof(uint64_t);
    const size_t new_r = block_bytes(cs, 0, 0), new_p = block_bytes(cs, cr, 0);
    const size_t new_t = new_p + (size_t)cv * sizeof(uint64_t);
    memmove(b + new_t, b + old_t, d->n_values);
    memmove(b + new_p, b + old_p, (size_t)d->n_values * sizeof(uint64_t));
    memmove(b + new_r, b + old_r, (size_t)d->n_readings * sizeof(struct bd_delta_reading));
    d->summaries = (struct bd_field_summary *)(void *)b;
    d->readings = (struct bd_delta_reading *)(void *)(b + new_r);
    d->cap_summaries = (uint8_t)cs;
    d->cap_readings = cr;
    d->cap_values = cv;
    return 0;
}

/* Room for `readings` more readings, `values` more values and `summaries` more summaries:
 * grow_block's test inline, as the drain adds a reading at a time and nearly always fits. */
static inline int grow(struct bd_delta *d, uint32_t readings, uint32_t values, uint32_t summaries) {
    const uint64_t need_r = (uint64_t)d->n_readings + readings;
    const uint64_t need_v = (uint64_t)d->n_values + values;
    const uint64_t need_s = BD_MIN((uint64_t)d->n_summaries + summaries, BD_SENSOR_MAX_FIELDS);
    if (need_r <= d->cap_readings && need_v <= d->cap_values && need_s <= d->cap_summaries) {
        return 0;
    }
    return grow_block(d, need_r, need_v, need_s);
}

struct bd_reading_value bd_delta_value(const struct bd_delta *d, uint32_t i) {
    BD_ASSERT(i < d->n_values);
    const uint8_t t = tags(d)[i];
    const uint64_t bits = payloads(d)[i];
    struct bd_reading_value v = {.field = t & TAG_FIELD_MASK, .kind = t >> TAG_FIELD_BITS};
    if (v.kind == BD_VAL_BOOL) {
        v.v.b = bits != 0;
    } else {
        memcpy(&v.v, &bits, sizeof(bits));
    }
    return v;
}

/* Numeric value as stored in MongoDB; false for booleans (stored, not summarised). */
static bool to_num(const struct bd_reading_value *v, struct bd_num *out) {
    switch (v->kind) {
    case BD_VAL_FLOAT:
        out->is_int = false;
        out->v.f = v->v.f;
        return true;
    case BD_VAL_INT:
        out->is_int = true;
        out->v.i = v->v.i;
        return true;
    case BD_VAL_UINT:
        /* BSON has no unsigned 64-bit type: values above INT64_MAX are stored as doubles. */
        if (v->v.u <= (uint64_t)INT64_MAX) {
            out->is_int = true;
            out->v.i = (int64_t)v->v.u;
        } else {
            out->is_int = false;
            out->v.f = (double)v->v.u;
        }
        return true;
    default:
        return false;
    }
}

static double num_as_double(const struct bd_num *n) {
    return n->is_int ? (double)n->v.i : n->v.f;
}

/* a < b numerically; exact for two integers. */
static bool num_less(const struct bd_num *a, const struct bd_num *b) {
    if (a->is_int && b->is_int) {
        return a->v.i < b->v.i;
    }
    return num_as_double(a) < num_as_double(b);
}

/*
 * Fold the delta's values [first, first + n) into its summaries. Needs room for a summary of
 * each numeric field among them not summarised yet (new_summaries); never allocates.
 *
 * A sensor's readings nearly always carry their fields in one order, the order its summaries
 * were made in: the summary after the last one used is tried first, and the map by field is
 * only built (once a call) when that guess misses or a field has no summary yet. A reading of
 * a few fields then costs a comparison a value instead of clearing and filling the map
 * (truncate_delta folds every reading kept again, once per page a look-up spreads a long
 * delta over: the map serves it from the first miss on).
 */
static void fold(struct bd_delta *d, uint32_t first, uint32_t n) {
    const uint8_t *t = tags(d);
    const uint64_t *pay = payloads(d);
    uint8_t at[BD_SENSOR_MAX_FIELDS]; /* summary index + 1 by field, 0: none; once mapped */
    bool mapped = false;
    uint32_t next = 0; /* the summary tried first */
    for (uint32_t i = first; i < first + n; i++) {
        const unsigned kind = t[i] >> TAG_FIELD_BITS, field = t[i] & TAG_FIELD_MASK;
        struct bd_num num;
        if (kind == BD_VAL_BOOL) {
            continue;
        } else if (kind == BD_VAL_FLOAT) {
            num.is_int = false;
            memcpy(&num.v.f, &pay[i], sizeof(num.v.f));
        } else if (kind == BD_VAL_INT || pay[i] <= (uint64_t)INT64_MAX) {
            num.is_int = true;
            num.v.i = (int64_t)pay[i];
        } else {
            /* BSON has no unsigned 64-bit type: values above INT64_MAX are stored as doubles
             * (to_num). */
            num.is_int = false;
            num.v.f = (double)pay[i];
        }
        if (next >= d->n_summaries) {
            next = 0;
        }
        struct bd_field_summary *fs;
        if (next < d->n_summaries && d->summaries[next].field == field) {
            fs = &d->summaries[next];
        } else {
            if (!mapped) {
                memset(at, 0, sizeof(at));
                for (uint32_t j = 0; j < d->n_summaries; j++) {
                    at[d->summaries[j].field] = (uint8_t)(j + 1);
                }
                mapped = true;
            }
            if (at[field] != 0) {
                fs = &d->summaries[at[field] - 1];
            } else {
                BD_ASSERT(d->n_summaries < d->cap_summaries);
                fs = &d->summaries[d->n_summaries++];
                at[field] = d->n_summaries;
                fs->field = (uint16_t)field;
                fs->min = num;
                fs->max = num;
                fs->sum = 0;
                fs->count = 0;
            }
        }
        next = (uint32_t)(fs - d->summaries) + 1;
        if (num_less(&num, &fs->min)) {
            fs->min = num;
        }
        if (num_less(&fs->max, &num)) {
            fs->max = num;
        }
        fs->sum += num_as_double(&num);
        fs->count++;
    }
}

/* The bits set in m: nearly always none (a delta's fields are summarised by its first
 * reading), so no call to libgcc's popcount, which a build for any x86-64 gets. */
static inline uint32_t count_bits(uint64_t m) {
    uint32_t k = 0;
    for (; m != 0; m &= m - 1) {
        k++;
    }
    return k;
}

/* Fields with a summary (a sensor's fields are < 64: one bit each). */
static uint64_t summarised(const struct bd_delta *d) {
    uint64_t have = 0;
    for (uint32_t j = 0; j < d->n_summaries; j++) {
        have |= UINT64_C(1) << d->summaries[j].field;
    }
    return have;
}

/* A value's tag byte. */
static uint8_t tag_of(const struct bd_reading_value *v) {
    BD_ASSERT(v->field <= TAG_FIELD_MASK && v->kind <= BD_VAL_BOOL);
    return (uint8_t)(v->field | (unsigned)v->kind << TAG_FIELD_BITS);
}

/* Whether a value of this tag is summarised (booleans are not). */
static bool tag_summarised(uint8_t t) {
    return t >> TAG_FIELD_BITS != BD_VAL_BOOL;
}

/* How many summaries the tags add to the delta's (numeric fields without one yet). */
static uint32_t new_summaries(const struct bd_delta *d, const uint8_t *t, uint32_t n) {
    const uint64_t have = summarised(d);
    uint64_t add = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tag_summarised(t[i])) {
            add |= UINT64_C(1) << (t[i] & TAG_FIELD_MASK);
        }
    }
    return count_bits(add & ~have);
}

/* Append a reading whose values are already encoded (room made); folds it in. */
static void append(struct bd_delta *d, int64_t ts_ns, const uint64_t *pay, const uint8_t *t,
                   uint32_t n) {
    struct bd_delta_reading *r = &d->readings[d->n_readings++];
    r->ts_ns = ts_ns;
    r->first = d->n_values;
    r->n = n;
    memcpy(payloads(d) + d->n_values, pay, (size_t)n * sizeof(*pay));
    memcpy(tags(d) + d->n_values, t, n);
    d->n_values += n;
    fold(d, r->first, n);
}

uint64_t bd_reading_bytes(const struct bd_sensor *s, const struct bd_reading_value *vals,
                          uint32_t n) {
    /* Array element: type, index key (up to 7 digits) and NUL; the document's length and NUL;
     * "ts" as a date. Each value: type, key, NUL, 8 bytes (booleans take 1; counted as 8). */
    uint64_t bytes = 1 + 8 + 5 + (1 + 3 + 8);
    for (uint32_t i = 0; i < n; i++) {
        bytes += 1 + strlen(bd_sensor_field_name(s, vals[i].field)) + 1 + 8;
    }
    return bytes;
}

uint64_t bd_reading_bytes_max(const struct bd_sensor *s, uint32_t n_fields) {
    uint64_t bytes = 1 + 8 + 5 + (1 + 3 + 8);
    for (uint32_t i = 0; i < n_fields; i++) {
        bytes += 1 + strlen(bd_sensor_field_name(s, i)) + 1 + 8;
    }
    return bytes;
}

uint64_t bd_page_overhead_bytes(const struct bd_sensor *s) {
    /* _id and sensor_id carry the id (the _id at most its bounded form), meta the measurement
     * and tags; bucket_start, bucket_end, page, count, the readings array's header and a few
     * w entries fit in 1 KiB; each field has a summary of five numbers under its name. */
    uint64_t bytes = 1024 + BD_BUCKET_ID_MAX + s->id_len + strlen(bd_sensor_measurement(s));
    for (uint32_t i = 0; i < s->n_tags; i++) {
        bytes += strlen(bd_sensor_tag_key(s, i)) + strlen(bd_sensor_tag_value(s, i)) + 8;
    }
    uint32_t n_fields = atomic_load_explicit(&s->n_fields, memory_order_acquire);
    for (uint32_t i = 0; i < n_fields; i++) {
        bytes += strlen(bd_sensor_field_name(s, i)) + 16 + 5 * (8 + 8);
    }
    return bytes;
}

uint64_t bd_delta_reading_bytes(const struct bd_delta *d, uint32_t r) {
    const struct bd_delta_reading *dr = &d->readings[r];
    const uint8_t *t = tags(d) + dr->first;
    uint64_t bytes = 1 + 8 + 5 + (1 + 3 + 8); /* as bd_reading_bytes */
    for (uint32_t i = 0; i < dr->n; i++) {
        bytes += 1 + strlen(bd_sensor_field_name(d->sensor, t[i] & TAG_FIELD_MASK)) + 1 + 8;
    }
    return bytes;
}

int bd_delta_reserve(struct bd_delta *d, uint32_t readings, uint32_t values) {
    return grow(d, readings, values, values);
}

int bd_delta_add(struct bd_delta *d, int64_t ts_ns, const struct bd_reading_value *vals,
                 uint32_t n) {
    /* The new summaries are counted first and every part grown before anything is written, so
     * a failure changes nothing. */
    const uint64_t have = summarised(d);
    uint64_t add = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (vals[i].kind != BD_VAL_BOOL) {
            add |= UINT64_C(1) << (tag_of(&vals[i]) & TAG_FIELD_MASK);
        }
    }
    if (grow(d, 1, n, count_bits(add & ~have)) < 0) {
        return -ENOMEM;
    }
    struct bd_delta_reading *r = &d->readings[d->n_readings++];
    r->ts_ns = ts_ns;
    r->first = d->n_values;
    r->n = n;
    uint64_t *pay = payloads(d) + d->n_values;
    uint8_t *t = tags(d) + d->n_values;
    for (uint32_t i = 0; i < n; i++) {
        t[i] = tag_of(&vals[i]);
        if (vals[i].kind == BD_VAL_BOOL) {
            pay[i] = vals[i].v.b;
        } else {
            memcpy(&pay[i], &vals[i].v, sizeof(pay[i]));
        }
    }
    d->n_values += n;
    fold(d, r->first, n);
    return 0;
}

/*
 * Cut a delta back to its first `keep` readings (in the order of readings[]) and recompute its
 * summaries. Re-folding needs no memory: a delta only shrinks.
 */
static void truncate_delta(struct bd_delta *d, uint32_t keep) {
    d->n_values = keep < d->n_readings ? d->readings[keep].first : d->n_values;
    d->n_readings = keep;
    d->n_summaries = 0;
    for (uint32_t i = 0; i < keep; i++) {
        fold(d, d->readings[i].first, d->readings[i].n);
    }
}

/* Swap two deltas' buffers and contents, keeping each one's sensor, bucket and page. */
static void swap_buffers(struct bd_delta *a, struct bd_delta *b) {
    const struct bd_delta ka = *a, kb = *b;
    *a = kb;
    *b = ka;
    a->sensor = ka.sensor;
    a->start_ms = ka.start_ms;
    a->page = ka.page;
    b->sensor = kb.sensor;
    b->start_ms = kb.start_ms;
    b->page = kb.page;
}

int bd_delta_copy_readings(const struct bd_delta *src, uint32_t from, uint32_t to,
                           struct bd_delta *dst) {
    BD_ASSERT(from <= to && to <= src->n_readings && src != dst);
    if (from == to) {
        return 0;
    }
    const uint32_t first = src->readings[from].first;
    const uint32_t values =
        (to < src->n_readings ? src->readings[to].first : src->n_values) - first;
    if (grow(dst, to - from, values, new_summaries(dst, tags(src) + first, values)) < 0) {
        return -ENOMEM;
    }
    for (uint32_t i = from; i < to; i++) {
        const struct bd_delta_reading *r = &src->readings[i];
        append(dst, r->ts_ns, payloads(src) + r->first, tags(src) + r->first, r->n);
    }
    return 0;
}

void bd_delta_truncate(struct bd_delta *d, uint32_t keep) {
    BD_ASSERT(keep <= d->n_readings);
    truncate_delta(d, keep);
}

int bd_delta_split(struct bd_delta *src, uint32_t keep, struct bd_delta *dst) {
    BD_ASSERT(keep <= src->n_readings);
    if (keep == 0 && dst->n_readings == 0) {
        /* The whole delta into an empty one: the same readings, summaries, order. */
        swap_buffers(src, dst);
        bd_delta_reset(src);
        return 0;
    }
    /* readings[] is in arrival order until the update is built (which sorts it and is the
     * delta's last use), so "the first keep" are the first to arrive. */
    if (bd_delta_copy_readings(src, keep, src->n_readings, dst) < 0) {
        return -ENOMEM;
    }
    truncate_delta(src, keep);
    return 0;
}

/* By time, equal timestamps in arrival order: values are appended in arrival order, so a later
 * reading has a larger first, or the same one after a reading without values. */
static int cmp_reading(const void *a, const void *b) {
    const struct bd_delta_reading *x = a, *y = b;
    if (x->ts_ns != y->ts_ns) {
        return x->ts_ns < y->ts_ns ? -1 : 1;
    }
    if (x->first != y->first) {
        return x->first < y->first ? -1 : 1;
    }
    return x->n < y->n ? -1 : (x->n > y->n);
}

static void append_num(bson_t *doc, const char *key, const struct bd_num *n) {
    if (n->is_int) {
        BSON_APPEND_INT64(doc, key, n->v.i);
    } else {
        BSON_APPEND_DOUBLE(doc, key, n->v.f);
    }
}

static void append_value(bson_t *doc, const char *key, const struct bd_reading_value *v) {
    struct bd_num num;
    if (to_num(v, &num)) {
        append_num(doc, key, &num);
    } else {
        BSON_APPEND_BOOL(doc, key, v->v.b);
    }
}

/*
 * A growable string for the dotted paths of field names: names are as long as the parser lets
 * them be (limits.max_line), so no fixed buffer may hold them.
 */
struct path_buf {
    char *p;
    size_t cap;
};

/* "$" if ref, then prefix, name and suffix. NULL on allocation failure. */
static const char *path_of(struct path_buf *b, bool ref, const char *prefix, const char *name,
                           const char *suffix) {
    size_t need = 1 + strlen(prefix) + strlen(name) + strlen(suffix) + 1;
    if (need > b->cap) {
        char *p = bd_realloc(b->p, need);
        if (p == NULL) {
            return NULL;
        }
        b->p = p;
        b->cap = need;
    }
    snprintf(b->p, b->cap, "%s%s%s%s", ref ? "$" : "", prefix, name, suffix);
    return b->p;
}

/* {$add: [{$ifNull: [ref, zero]}, inc]} */
static void append_add(bson_t *parent, const char *key, const char *ref, bool as_int, int64_t inc_i,
                       double inc_f) {
    bson_t op, args, ifnull, ifargs;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &op);
    BSON_APPEND_ARRAY_BEGIN(&op, "$add", &args);
    BSON_APPEND_DOCUMENT_BEGIN(&args, "0", &ifnull);
    BSON_APPEND_ARRAY_BEGIN(&ifnull, "$ifNull", &ifargs);
    BSON_APPEND_UTF8(&ifargs, "0", ref);
    if (as_int) {
        BSON_APPEND_INT64(&ifargs, "1", 0);
    } else {
        BSON_APPEND_DOUBLE(&ifargs, "1", 0.0);
    }
    bson_append_array_end(&ifnull, &ifargs);
    bson_append_document_end(&args, &ifnull);
    if (as_int) {
        BSON_APPEND_INT64(&args, "1", inc_i);
    } else {
        BSON_APPEND_DOUBLE(&args, "1", inc_f);
    }
    bson_append_array_end(&op, &args);
    bson_append_document_end(parent, &op);
}

/* {$min|$max: [ref, value]}: MongoDB ignores the missing field on the first write. */
static void append_minmax(bson_t *parent, const char *key, const char *op_name, const char *ref,
                          const struct bd_num *n) {
    bson_t op, args;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &op);
    BSON_APPEND_ARRAY_BEGIN(&op, op_name, &args);
    BSON_APPEND_UTF8(&args, "0", ref);
    append_num(&args, "1", n);
    bson_append_array_end(&op, &args);
    bson_append_document_end(parent, &op);
}

/* {$concatArrays: [{$ifNull: ["$readings", []]}, "$_n"]} */
static void append_concat(bson_t *parent, const char *key) {
    bson_t op, args, ifnull, ifargs, empty;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &op);
    BSON_APPEND_ARRAY_BEGIN(&op, "$concatArrays", &args);
    BSON_APPEND_DOCUMENT_BEGIN(&args, "0", &ifnull);
    BSON_APPEND_ARRAY_BEGIN(&ifnull, "$ifNull", &ifargs);
    BSON_APPEND_UTF8(&ifargs, "0", "$readings");
    BSON_APPEND_ARRAY_BEGIN(&ifargs, "1", &empty);
    bson_append_array_end(&ifargs, &empty);
    bson_append_array_end(&ifnull, &ifargs);
    bson_append_document_end(&args, &ifnull);
    BSON_APPEND_UTF8(&args, "1", "$_n");
    bson_append_array_end(&op, &args);
    bson_append_document_end(parent, &op);
}

/*
 * Stored readings + new readings, sorted by ts with equal timestamps in arrival order.
 * $sortArray is not documented as stable (the server's sort is not), so each reading is sorted
 * with its position in the concatenation as the tie-breaker -- stored readings are already in
 * order and come first, new ones follow in the order they arrived -- and unwrapped again:
 *   {$let: {vars: {all: <concat>}, in: {$map: {as: "x", in: "$$x.r", input: {$sortArray: {
 *     sortBy: {t: 1, i: 1}, input: {$map: {input: {$range: [0, {$size: "$$all"}]}, as: "i",
 *       in: {$let: {vars: {r: {$arrayElemAt: ["$$all", "$$i"]}},
 *                   in: {i: "$$i", t: "$$r.ts", r: "$$r"}}}}}}}}}}}
 * Nothing extra is stored in the document; the cost is one pass over the page, and only when
 * late readings arrive.
 */
static void append_sorted(bson_t *parent, const char *key) {
    bson_t let, vars, map, sorted, spec, by, inner, range, range_args, size, let2, vars2, elem,
        elem_args, item;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &let);
    BSON_APPEND_DOCUMENT_BEGIN(&let, "$let", &vars);
    {
        bson_t v;
        BSON_APPEND_DOCUMENT_BEGIN(&vars, "vars", &v);
        append_concat(&v, "all");
        bson_append_document_end(&vars, &v);
    }
    BSON_APPEND_DOCUMENT_BEGIN(&vars, "in", &map);
    {
        bson_t m;
        BSON_APPEND_DOCUMENT_BEGIN(&map, "$map", &m);
        BSON_APPEND_UTF8(&m, "as", "x");
        BSON_APPEND_UTF8(&m, "in", "$$x.r");
        BSON_APPEND_DOCUMENT_BEGIN(&m, "input", &sorted);
        BSON_APPEND_DOCUMENT_BEGIN(&sorted, "$sortArray", &spec);
        BSON_APPEND_DOCUMENT_BEGIN(&spec, "sortBy", &by);
        BSON_APPEND_INT32(&by, "t", 1);
        BSON_APPEND_INT32(&by, "i", 1);
        bson_append_document_end(&spec, &by);
        BSON_APPEND_DOCUMENT_BEGIN(&spec, "input", &inner);
        {
            bson_t im;
            BSON_APPEND_DOCUMENT_BEGIN(&inner, "$map", &im);
            BSON_APPEND_DOCUMENT_BEGIN(&im, "input", &range);
            BSON_APPEND_ARRAY_BEGIN(&range, "$range", &range_args);
            BSON_APPEND_INT32(&range_args, "0", 0);
            BSON_APPEND_DOCUMENT_BEGIN(&range_args, "1", &size);
            BSON_APPEND_UTF8(&size, "$size", "$$all");
            bson_append_document_end(&range_args, &size);
            bson_append_array_end(&range, &range_args);
            bson_append_document_end(&im, &range);
            BSON_APPEND_UTF8(&im, "as", "i");
            BSON_APPEND_DOCUMENT_BEGIN(&im, "in", &let2);
            BSON_APPEND_DOCUMENT_BEGIN(&let2, "$let", &vars2);
            {
                bson_t v2;
                BSON_APPEND_DOCUMENT_BEGIN(&vars2, "vars", &v2);
                BSON_APPEND_DOCUMENT_BEGIN(&v2, "r", &elem);
                BSON_APPEND_ARRAY_BEGIN(&elem, "$arrayElemAt", &elem_args);
                BSON_APPEND_UTF8(&elem_args, "0", "$$all");
                BSON_APPEND_UTF8(&elem_args, "1", "$$i");
                bson_append_array_end(&elem, &elem_args);
                bson_append_document_end(&v2, &elem);
                bson_append_document_end(&vars2, &v2);
            }
            BSON_APPEND_DOCUMENT_BEGIN(&vars2, "in", &item);
            BSON_APPEND_UTF8(&item, "i", "$$i");
            BSON_APPEND_UTF8(&item, "t", "$$r.ts");
            BSON_APPEND_UTF8(&item, "r", "$$r");
            bson_append_document_end(&vars2, &item);
            bson_append_document_end(&let2, &vars2);
            bson_append_document_end(&im, &let2);
            bson_append_document_end(&inner, &im);
        }
        bson_append_document_end(&spec, &inner);
        bson_append_document_end(&sorted, &spec);
        bson_append_document_end(&m, &sorted);
        bson_append_document_end(&map, &m);
    }
    bson_append_document_end(&vars, &map);
    bson_append_document_end(&let, &vars);
    bson_append_document_end(parent, &let);
}

static void append_readings_merge(bson_t *parent, int64_t first_ts_ms) {
    bson_t rd, cond, gte, gte_args, last, last_args;
    BSON_APPEND_DOCUMENT_BEGIN(parent, "readings", &rd);
    BSON_APPEND_ARRAY_BEGIN(&rd, "$cond", &cond);
    /* In order when the first new reading is not older than the last stored one; a missing
     * array gives null, which sorts below every date. */
    BSON_APPEND_DOCUMENT_BEGIN(&cond, "0", &gte);
    BSON_APPEND_ARRAY_BEGIN(&gte, "$gte", &gte_args);
    BSON_APPEND_DATE_TIME(&gte_args, "0", first_ts_ms);
    BSON_APPEND_DOCUMENT_BEGIN(&gte_args, "1", &last);
    BSON_APPEND_ARRAY_BEGIN(&last, "$arrayElemAt", &last_args);
    BSON_APPEND_UTF8(&last_args, "0", "$readings.ts");
    BSON_APPEND_INT32(&last_args, "1", -1);
    bson_append_array_end(&last, &last_args);
    bson_append_document_end(&gte_args, &last);
    bson_append_array_end(&gte, &gte_args);
    bson_append_document_end(&cond, &gte);
    append_concat(&cond, "1");
    append_sorted(&cond, "2");
    bson_append_array_end(&rd, &cond);
    bson_append_document_end(parent, &rd);
}

static void append_literal_utf8(bson_t *parent, const char *key, const char *value) {
    bson_t lit;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &lit);
    BSON_APPEND_UTF8(&lit, "$literal", value);
    bson_append_document_end(parent, &lit);
}

/* Stage 1's summary operators for one field: min, max, sum and count. */
static int append_summary_fold(bson_t *set, struct path_buf *key, struct path_buf *ref,
                               const char *f, const struct bd_field_summary *fs) {
    static const char *const parts[] = {".min", ".max", ".sum", ".count"};
    for (size_t i = 0; i < BD_ARRAY_LEN(parts); i++) {
        const char *k = path_of(key, false, "summary.", f, parts[i]);
        const char *r = path_of(ref, true, "summary.", f, parts[i]);
        if (k == NULL || r == NULL) {
            return -ENOMEM;
        }
        switch (i) {
        case 0:
            append_minmax(set, k, "$min", r, &fs->min);
            break;
        case 1:
            append_minmax(set, k, "$max", r, &fs->max);
            break;
        case 2:
            append_add(set, k, r, false, 0, fs->sum);
            break;
        default:
            append_add(set, k, r, true, fs->count, 0);
            break;
        }
    }
    return 0;
}

/* Stage 2's avg for one field: {$divide: ["$summary.<f>.sum", "$summary.<f>.count"]}. */
static int append_summary_avg(bson_t *set, struct path_buf *key, struct path_buf *ref,
                              const char *f) {
    bson_t div, args;
    const char *k = path_of(key, false, "summary.", f, ".avg");
    if (k == NULL) {
        return -ENOMEM;
    }
    BSON_APPEND_DOCUMENT_BEGIN(set, k, &div);
    BSON_APPEND_ARRAY_BEGIN(&div, "$divide", &args);
    const char *r = path_of(ref, true, "summary.", f, ".sum");
    if (r == NULL) {
        return -ENOMEM;
    }
    BSON_APPEND_UTF8(&args, "0", r);
    r = path_of(ref, true, "summary.", f, ".count");
    if (r == NULL) {
        return -ENOMEM;
    }
    BSON_APPEND_UTF8(&args, "1", r);
    bson_append_array_end(&div, &args);
    bson_append_document_end(set, &div);
    return 0;
}

int bd_delta_build_update(struct bd_delta *d, uint64_t span_ms, const char *writer_key,
                          uint64_t seq, bson_t *selector, bson_t *update) {
    struct bd_sensor *s = d->sensor;
    char id[BD_BUCKET_ID_MAX];
    char idx[16];
    const char *ikey;
    struct path_buf key = {0}, ref = {0};
    int rc = 0;
    bson_t stage, set, lit, arr, rdoc, meta, tags;

    bson_init(selector);
    bson_init(update);
    BD_ASSERT(d->n_readings > 0);
    qsort(d->readings, d->n_readings, sizeof(*d->readings), cmp_reading);

    rc = bd_bucket_id(id, sizeof(id), bd_sensor_id(s), d->start_ms, d->page);
    BD_ASSERT(rc == 0); /* BD_BUCKET_ID_MAX holds every id's bounded form */
    bson_t cond, not_cond;
    BSON_APPEND_UTF8(selector, "_id", id);
    /* The shard-key fields, as stage 1 stores them (see the header comment). A string value is
     * matched literally in a query filter, so no $literal is needed here. */
    BSON_APPEND_UTF8(selector, "sensor_id", bd_sensor_id(s));
    BSON_APPEND_DATE_TIME(selector, "bucket_start", d->start_ms);
    BSON_APPEND_DOCUMENT_BEGIN(selector, writer_key, &cond);
    BSON_APPEND_DOCUMENT_BEGIN(&cond, "$not", &not_cond);
    BSON_APPEND_INT64(&not_cond, "$gte", (int64_t)seq);
    bson_append_document_end(&cond, &not_cond);
    bson_append_document_end(selector, &cond);

    /* Stage 1. */
    BSON_APPEND_DOCUMENT_BEGIN(update, "0", &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);

    BSON_APPEND_DOCUMENT_BEGIN(&set, "_n", &lit);
    BSON_APPEND_ARRAY_BEGIN(&lit, "$literal", &arr);
    for (uint32_t i = 0; i < d->n_readings; i++) {
        const struct bd_delta_reading *r = &d->readings[i];
        bson_uint32_to_string(i, &ikey, idx, sizeof(idx));
        BSON_APPEND_DOCUMENT_BEGIN(&arr, ikey, &rdoc);
        BSON_APPEND_DATE_TIME(&rdoc, "ts", bd_floor_div(r->ts_ns, BD_NS_PER_MS));
        for (uint32_t j = 0; j < r->n; j++) {
            const struct bd_reading_value v = bd_delta_value(d, r->first + j);
            append_value(&rdoc, bd_sensor_field_name(s, v.field), &v);
        }
        bson_append_document_end(&arr, &rdoc);
    }
    bson_append_array_end(&lit, &arr);
    bson_append_document_end(&set, &lit);

    append_literal_utf8(&set, "sensor_id", bd_sensor_id(s));
    BSON_APPEND_DOCUMENT_BEGIN(&set, "meta", &lit);
    BSON_APPEND_DOCUMENT_BEGIN(&lit, "$literal", &meta);
    BSON_APPEND_UTF8(&meta, "measurement", bd_sensor_measurement(s));
    BSON_APPEND_DOCUMENT_BEGIN(&meta, "tags", &tags);
    for (uint32_t i = 0; i < s->n_tags; i++) {
        BSON_APPEND_UTF8(&tags, bd_sensor_tag_key(s, i), bd_sensor_tag_value(s, i));
    }
    bson_append_document_end(&meta, &tags);
    bson_append_document_end(&lit, &meta);
    bson_append_document_end(&set, &lit);
    BSON_APPEND_DATE_TIME(&set, "bucket_start", d->start_ms);
    BSON_APPEND_DATE_TIME(&set, "bucket_end", d->start_ms + (int64_t)span_ms - 1);
    BSON_APPEND_INT32(&set, "page", (int32_t)d->page);
    BSON_APPEND_INT64(&set, writer_key, (int64_t)seq);
    append_add(&set, "count", "$count", true, d->n_readings, 0);
    for (uint32_t i = 0; i < d->n_summaries && rc == 0; i++) {
        const struct bd_field_summary *fs = &d->summaries[i];
        rc = append_summary_fold(&set, &key, &ref, bd_sensor_field_name(s, fs->field), fs);
    }
    bson_append_document_end(&stage, &set);
    bson_append_document_end(update, &stage);

    /* Stage 2. */
    BSON_APPEND_DOCUMENT_BEGIN(update, "1", &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
    append_readings_merge(&set, bd_floor_div(d->readings[0].ts_ns, BD_NS_PER_MS));
    for (uint32_t i = 0; i < d->n_summaries && rc == 0; i++) {
        rc = append_summary_avg(&set, &key, &ref, bd_sensor_field_name(s, d->summaries[i].field));
    }
    bson_append_document_end(&stage, &set);
    bson_append_document_end(update, &stage);

    /* Stage 3. */
    BSON_APPEND_DOCUMENT_BEGIN(update, "2", &stage);
    BSON_APPEND_UTF8(&stage, "$unset", "_n");
    bson_append_document_end(update, &stage);
    free(key.p);
    free(ref.p);
    return rc;
}

uint64_t bd_delta_bytes(const struct bd_delta *d) {
    return sizeof(*d) + block_bytes(d->cap_summaries, d->cap_readings, d->cap_values);
}
