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
 *   2. $set  readings = existing readings + _n, re-sorted by ts only when the first new
 *            reading is older than the last stored one (late data), and summary.<f>.avg =
 *            sum / count;
 *   3. $unset _n.
 *
 * Idempotency: the filter is {_id, "w.<writer_id>": {$not: {$gte: seq}}} and stage 1 sets
 * "w.<writer_id>" to seq, the writer's flush sequence (writer.h). Sent again after an ambiguous
 * failure, the update finds no matching document; the upsert then inserts an _id that exists
 * and MongoDB answers duplicate key (11000): "already applied". Each writer id has its own
 * entry in w, so several daemons can append to one bucket.
 *
 * Every value that comes from the network is wrapped in $literal so that a string starting
 * with '$' is never read as a field path. Field keys were checked by the sensor table (no '.',
 * no leading '$', not "ts"), so they are safe inside dotted paths.
 */
#include "bucketd/bucket.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int bd_bucket_id(char *buf, size_t cap, const char *sensor_id, int64_t start_ms, uint32_t page) {
    int n = snprintf(buf, cap, "%s|%" PRId64 "|%" PRIu32, sensor_id, bd_floor_div(start_ms, 1000),
                     page);
    return (n < 0 || (size_t)n >= cap) ? -ENAMETOOLONG : 0;
}

void bd_delta_init(struct bd_delta *d, struct bd_sensor *s, int64_t start_ms, uint32_t page) {
    memset(d, 0, sizeof(*d));
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
    free(d->readings);
    free(d->values);
    free(d->summaries);
    memset(d, 0, sizeof(*d));
}

static int grow(void **buf, uint32_t *cap, uint32_t need, size_t elem) {
    if (need <= *cap) {
        return 0;
    }
    uint32_t n = *cap ? *cap : 8;
    while (n < need) {
        n *= 2;
    }
    void *p = realloc(*buf, (size_t)n * elem);
    if (p == NULL) {
        return -ENOMEM;
    }
    *buf = p;
    *cap = n;
    return 0;
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

/* Fold one reading's numeric values into the delta's summaries. */
static int fold(struct bd_delta *d, const struct bd_reading_value *vals, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        struct bd_num num;
        if (!to_num(&vals[i], &num)) {
            continue;
        }
        struct bd_field_summary *fs = NULL;
        for (uint32_t j = 0; j < d->n_summaries; j++) {
            if (d->summaries[j].field == vals[i].field) {
                fs = &d->summaries[j];
                break;
            }
        }
        if (fs == NULL) {
            if (grow((void **)&d->summaries, &d->cap_summaries, d->n_summaries + 1,
                     sizeof(*d->summaries)) < 0) {
                return -ENOMEM;
            }
            fs = &d->summaries[d->n_summaries++];
            fs->field = vals[i].field;
            fs->min = num;
            fs->max = num;
            fs->sum = 0;
            fs->count = 0;
        }
        if (num_less(&num, &fs->min)) {
            fs->min = num;
        }
        if (num_less(&fs->max, &num)) {
            fs->max = num;
        }
        fs->sum += num_as_double(&num);
        fs->count++;
    }
    return 0;
}

int bd_delta_add(struct bd_delta *d, int64_t ts_ns, const struct bd_reading_value *vals,
                 uint32_t n) {
    if (grow((void **)&d->readings, &d->cap_readings, d->n_readings + 1, sizeof(*d->readings)) <
            0 ||
        grow((void **)&d->values, &d->cap_values, d->n_values + n, sizeof(*d->values)) < 0) {
        return -ENOMEM;
    }
    struct bd_delta_reading *r = &d->readings[d->n_readings];
    r->ts_ns = ts_ns;
    r->seq = d->n_readings;
    r->first = d->n_values;
    r->n = n;
    memcpy(&d->values[d->n_values], vals, n * sizeof(*vals));
    d->n_readings++;
    d->n_values += n;
    return fold(d, vals, n);
}

int bd_delta_split(struct bd_delta *src, uint32_t keep, struct bd_delta *dst) {
    BD_ASSERT(keep < src->n_readings);
    for (uint32_t i = keep; i < src->n_readings; i++) {
        const struct bd_delta_reading *r = &src->readings[i];
        if (bd_delta_add(dst, r->ts_ns, &src->values[r->first], r->n) < 0) {
            return -ENOMEM;
        }
    }
    src->n_values = src->readings[keep].first;
    src->n_readings = keep;
    src->n_summaries = 0;
    for (uint32_t i = 0; i < keep; i++) {
        const struct bd_delta_reading *r = &src->readings[i];
        /* Re-folding needs no new memory: it only revisits fields already summarised. */
        int rc = fold(src, &src->values[r->first], r->n);
        BD_ASSERT(rc == 0);
    }
    return 0;
}

static int cmp_reading(const void *a, const void *b) {
    const struct bd_delta_reading *x = a, *y = b;
    if (x->ts_ns != y->ts_ns) {
        return x->ts_ns < y->ts_ns ? -1 : 1;
    }
    return x->seq < y->seq ? -1 : (x->seq > y->seq);
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

/* {$add: [{$ifNull: ["$<path>", zero]}, inc]} */
static void append_add(bson_t *parent, const char *key, const char *path, bool as_int,
                       int64_t inc_i, double inc_f) {
    bson_t op, args, ifnull, ifargs;
    char ref[320];
    snprintf(ref, sizeof(ref), "$%s", path);
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

/* {$min|$max: ["$<path>", value]}: MongoDB ignores the missing field on the first write. */
static void append_minmax(bson_t *parent, const char *key, const char *op_name, const char *path,
                          const struct bd_num *n) {
    bson_t op, args;
    char ref[320];
    snprintf(ref, sizeof(ref), "$%s", path);
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

static void append_readings_merge(bson_t *parent, int64_t first_ts_ms) {
    bson_t rd, cond, gte, gte_args, last, last_args, sorted, sort_spec, sort_by;
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
    BSON_APPEND_DOCUMENT_BEGIN(&cond, "2", &sorted);
    BSON_APPEND_DOCUMENT_BEGIN(&sorted, "$sortArray", &sort_spec);
    append_concat(&sort_spec, "input");
    BSON_APPEND_DOCUMENT_BEGIN(&sort_spec, "sortBy", &sort_by);
    BSON_APPEND_INT32(&sort_by, "ts", 1);
    bson_append_document_end(&sort_spec, &sort_by);
    bson_append_document_end(&sorted, &sort_spec);
    bson_append_document_end(&cond, &sorted);
    bson_append_array_end(&rd, &cond);
    bson_append_document_end(parent, &rd);
}

static void append_literal_utf8(bson_t *parent, const char *key, const char *value) {
    bson_t lit;
    BSON_APPEND_DOCUMENT_BEGIN(parent, key, &lit);
    BSON_APPEND_UTF8(&lit, "$literal", value);
    bson_append_document_end(parent, &lit);
}

void bd_delta_build_update(struct bd_delta *d, uint64_t span_ms, const char *writer_key,
                           uint64_t seq, bson_t *selector, bson_t *update) {
    struct bd_sensor *s = d->sensor;
    char id[1024];
    char key[320];
    char path[320];
    char idx[16];
    const char *ikey;
    bson_t stage, set, lit, arr, rdoc, meta, tags;

    BD_ASSERT(d->n_readings > 0);
    qsort(d->readings, d->n_readings, sizeof(*d->readings), cmp_reading);

    /* Sensor ids are bounded by limits.max_line, which config caps far below this buffer's
     * use; a longer id is truncated consistently, it still names one document. */
    if (bd_bucket_id(id, sizeof(id), s->id, d->start_ms, d->page) < 0) {
        id[sizeof(id) - 1] = '\0';
    }
    bson_t cond, not_cond;
    bson_init(selector);
    BSON_APPEND_UTF8(selector, "_id", id);
    BSON_APPEND_DOCUMENT_BEGIN(selector, writer_key, &cond);
    BSON_APPEND_DOCUMENT_BEGIN(&cond, "$not", &not_cond);
    BSON_APPEND_INT64(&not_cond, "$gte", (int64_t)seq);
    bson_append_document_end(&cond, &not_cond);
    bson_append_document_end(selector, &cond);

    bson_init(update);
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
            const struct bd_reading_value *v = &d->values[r->first + j];
            append_value(&rdoc, s->field_names[v->field], v);
        }
        bson_append_document_end(&arr, &rdoc);
    }
    bson_append_array_end(&lit, &arr);
    bson_append_document_end(&set, &lit);

    append_literal_utf8(&set, "sensor_id", s->id);
    BSON_APPEND_DOCUMENT_BEGIN(&set, "meta", &lit);
    BSON_APPEND_DOCUMENT_BEGIN(&lit, "$literal", &meta);
    BSON_APPEND_UTF8(&meta, "measurement", s->measurement);
    BSON_APPEND_DOCUMENT_BEGIN(&meta, "tags", &tags);
    for (uint32_t i = 0; i < s->n_tags; i++) {
        BSON_APPEND_UTF8(&tags, s->tag_keys[i], s->tag_values[i]);
    }
    bson_append_document_end(&meta, &tags);
    bson_append_document_end(&lit, &meta);
    bson_append_document_end(&set, &lit);
    BSON_APPEND_DATE_TIME(&set, "bucket_start", d->start_ms);
    BSON_APPEND_DATE_TIME(&set, "bucket_end", d->start_ms + (int64_t)span_ms - 1);
    BSON_APPEND_INT32(&set, "page", (int32_t)d->page);
    BSON_APPEND_INT64(&set, writer_key, (int64_t)seq);
    append_add(&set, "count", "count", true, d->n_readings, 0);
    for (uint32_t i = 0; i < d->n_summaries; i++) {
        const struct bd_field_summary *fs = &d->summaries[i];
        const char *f = s->field_names[fs->field];
        snprintf(key, sizeof(key), "summary.%s.min", f);
        append_minmax(&set, key, "$min", key, &fs->min);
        snprintf(key, sizeof(key), "summary.%s.max", f);
        append_minmax(&set, key, "$max", key, &fs->max);
        snprintf(key, sizeof(key), "summary.%s.sum", f);
        append_add(&set, key, key, false, 0, fs->sum);
        snprintf(key, sizeof(key), "summary.%s.count", f);
        append_add(&set, key, key, true, fs->count, 0);
    }
    bson_append_document_end(&stage, &set);
    bson_append_document_end(update, &stage);

    /* Stage 2. */
    BSON_APPEND_DOCUMENT_BEGIN(update, "1", &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
    append_readings_merge(&set, bd_floor_div(d->readings[0].ts_ns, BD_NS_PER_MS));
    for (uint32_t i = 0; i < d->n_summaries; i++) {
        const char *f = s->field_names[d->summaries[i].field];
        bson_t div, args;
        snprintf(key, sizeof(key), "summary.%s.avg", f);
        BSON_APPEND_DOCUMENT_BEGIN(&set, key, &div);
        BSON_APPEND_ARRAY_BEGIN(&div, "$divide", &args);
        snprintf(path, sizeof(path), "$summary.%s.sum", f);
        BSON_APPEND_UTF8(&args, "0", path);
        snprintf(path, sizeof(path), "$summary.%s.count", f);
        BSON_APPEND_UTF8(&args, "1", path);
        bson_append_array_end(&div, &args);
        bson_append_document_end(&set, &div);
    }
    bson_append_document_end(&stage, &set);
    bson_append_document_end(update, &stage);

    /* Stage 3. */
    BSON_APPEND_DOCUMENT_BEGIN(update, "2", &stage);
    BSON_APPEND_UTF8(&stage, "$unset", "_n");
    bson_append_document_end(update, &stage);
}
