/*
 * libFuzzer target for the path after the parser: one input is a batch of lines that goes
 * through everything the daemon does with it up to the MongoDB call, on this one thread and
 * without a server:
 *
 *   bd_parse_begin/bd_parse_next (the listener's batch parse)
 *     -> bd_sensor_table_accept (with a fixed "now", so the time window is deterministic)
 *     -> bd_sensor_table_next_dirty / bd_sensor_peek_reading / bd_sensor_consume (the drain)
 *     -> bd_pages_slot / bd_pages_place / bd_batch_get / bd_delta_add (the fill batch)
 *     -> bd_delta_build_update (the upsert each bucket page gets per flush)
 *
 * The drain is the flusher's drain_sensor() (src/flusher.c) written again with the public
 * module functions it uses, minus what needs MongoDB: every bucket is new (no earlier run wrote
 * it), so page slots are known from the start and nothing is looked up.
 *
 * The table runs with a small configuration so that refusals happen: few sensors, a buffer
 * pool of a few segments, small pages. What the harness expects is worked out from the points
 * the parser gave and the answers of bd_sensor_table_accept, never from the updates:
 *
 *   - every refusal is counted by exactly one drop counter, every acceptance by
 *     readings_accepted;
 *   - every selector and update is valid BSON and below MongoDB's 16 MiB;
 *   - the page documents the updates build (readings appended over the flushes) stay within
 *     buckets.max_bytes unless they hold a single reading (which gets a page of its own);
 *   - an _id names one sensor, bucket and page: two distinct sensor ids never share an _id,
 *     and the _id ends in the bucket start and page the update stores;
 *   - the updates carry exactly the accepted readings: sensor id in full, timestamp (ms), and
 *     every numeric or boolean field under a key that unescapes (names.h) to the name sent,
 *     with its value in the type bucket.c documents;
 *   - summary keys unescape to distinct field names the sensor was sent, one per numeric field
 *     of the update's readings (long names sharing a prefix must not collapse into one key);
 *   - readings lie in their bucket, in time order; meta holds the measurement and tags sent;
 *   - summaries are true: per sensor, bucket and field, the counts add up to the values sent
 *     and min/max are the smallest and largest of them;
 *   - once drained, the buffer pool has every segment back, and nothing leaks (LSan).
 *
 * The first byte of an input picks the parser and the flushing; the rest is the lines:
 *   bits 0-1  precision: 0 ns, 1 us, 2 ms, 3 s
 *   bit 2     line limit SMALL_MAX_LINE instead of LARGE_MAX_LINE
 *   bit 3     Graphite instead of line protocol
 *   bit 6     drain and flush after every line (pages fill over several flushes); otherwise
 *             once, after the last line (the buffer pool fills and refuses readings)
 * so ASCII '0'-'7' are line protocol, '8'-'?' Graphite, 'p'-'\x7f' the same with a flush per
 * line.
 *
 * Built with BD_FUZZ_REPLAY, the file is a plain program with its own main() that runs every
 * file named on its command line (directories: every file inside) through the same code: the
 * seed corpus and the kept findings, in the plain and sanitizer builds, without clang.
 */
#include <bson/bson.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bucketd/batch.h"
#include "bucketd/bucket.h"
#include "bucketd/config.h"
#include "bucketd/log.h"
#include "bucketd/names.h"
#include "bucketd/pages.h"
#include "bucketd/parse.h"
#include "bucketd/pool.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

#define CHECK(e) ((e) ? (void)0 : check_failed(#e, __FILE__, __LINE__))

_Noreturn static void check_failed(const char *expr, const char *file, int line) {
    fprintf(stderr, "fuzz_accept: invariant failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* 128 KiB: room for sensor ids and field names of up to ~70 KB, as a stream of lines sends. */
#define LARGE_MAX_LINE (128u << 10)
#define SMALL_MAX_LINE 256u
#define N_PREC 4

/* The fixed clock: 2020-09-13T12:26:40Z, the time of the seeds' timestamps. */
#define NOW_NS (INT64_C(1600000000) * BD_NS_PER_S)
#define WRITER_ID "fuzz"

/* The small configuration (bd_config_defaults for the rest). */
#define CFG_MAX_SENSORS 8
/* Below the config file's minimum (256 KiB) on purpose: a pool of 16 segments of 1 KiB, which
 * inputs of a few KiB fill, so that drop_buffer_full is reached. */
#define CFG_MEMORY (UINT64_C(32) << 10)
#define CFG_MAX_READINGS 8
#define CFG_MAX_BYTES (UINT64_C(8) << 10)
#define CFG_MAX_LATE_MS (UINT64_C(7) * 24 * 3600 * 1000)
/* limits.max_name when the mode byte asks for short names. */
#define CFG_SHORT_NAME 256

/* ---------------------------------------------------------------------------------------- */
/* Byte strings                                                                             */

struct xbuf {
    unsigned char *p;
    size_t len, cap;
};

/* Appends n bytes from src (src NULL: room only, contents undefined). */
static void xput(struct xbuf *b, const void *src, size_t n) {
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (n > cap - b->len) {
            cap *= 2;
        }
        b->p = realloc(b->p, cap);
        CHECK(b->p != NULL);
        b->cap = cap;
    }
    if (n > 0 && src != NULL) {
        memcpy(b->p + b->len, src, n);
    }
    b->len += n;
}

static void xput_u32(struct xbuf *b, uint32_t v) {
    xput(b, &v, sizeof(v));
}

static void xput_u64(struct xbuf *b, uint64_t v) {
    xput(b, &v, sizeof(v));
}

/* A length-prefixed string, so that concatenations stay unambiguous. */
static void xput_str(struct xbuf *b, const void *s, size_t n) {
    xput_u32(b, (uint32_t)n);
    xput(b, s, n);
}

/* An owned byte string, and a growable list of them (sorted and compared at the end). */
struct item {
    unsigned char *p;
    size_t n;
};

struct items {
    struct item *v;
    size_t n, cap;
};

static void items_add(struct items *l, const void *p, size_t n) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = realloc(l->v, l->cap * sizeof(*l->v));
        CHECK(l->v != NULL);
    }
    unsigned char *copy = malloc(n ? n : 1);
    CHECK(copy != NULL);
    memcpy(copy, p, n);
    l->v[l->n++] = (struct item){copy, n};
}

static int item_cmp(const void *a, const void *b) {
    const struct item *x = a, *y = b;
    size_t n = x->n < y->n ? x->n : y->n;
    int c = n ? memcmp(x->p, y->p, n) : 0;
    if (c != 0) {
        return c;
    }
    return x->n < y->n ? -1 : x->n > y->n;
}

static void items_sort(struct items *l) {
    if (l->n > 1) {
        qsort(l->v, l->n, sizeof(*l->v), item_cmp);
    }
}

static bool items_has(const struct items *l, const void *p, size_t n) {
    struct item key = {(unsigned char *)p, n};
    return l->n > 0 && bsearch(&key, l->v, l->n, sizeof(*l->v), item_cmp) != NULL;
}

static void items_free(struct items *l) {
    for (size_t i = 0; i < l->n; i++) {
        free(l->v[i].p);
    }
    free(l->v);
    memset(l, 0, sizeof(*l));
}

/* ---------------------------------------------------------------------------------------- */
/* Readings as comparable byte strings                                                      */

/* A field value as bucket.c stores it: 'd' double bits, 'i' int64, 'b' bool. */
struct sval {
    const char *name;
    size_t name_len;
    char type;
    uint64_t bits;
};

static int sval_cmp(const void *a, const void *b) {
    const struct sval *x = a, *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int c = n ? memcmp(x->name, y->name, n) : 0;
    if (c != 0) {
        return c;
    }
    return x->name_len < y->name_len ? -1 : x->name_len > y->name_len;
}

/* sensor id, ts in ms, then the fields sorted by name (names are distinct within a reading). */
static void reading_bytes(struct xbuf *out, const char *id, size_t id_len, int64_t ts_ms,
                          struct sval *vals, uint32_t n) {
    out->len = 0;
    xput_str(out, id, id_len);
    xput_u64(out, (uint64_t)ts_ms);
    xput_u32(out, n);
    qsort(vals, n, sizeof(*vals), sval_cmp);
    for (uint32_t i = 0; i < n; i++) {
        CHECK(i == 0 || sval_cmp(&vals[i - 1], &vals[i]) != 0);
        xput_str(out, vals[i].name, vals[i].name_len);
        xput(out, &vals[i].type, 1);
        xput_u64(out, vals[i].bits);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Summaries: count, min and max per sensor, bucket and field                               */

/* A number as bucket.c stores and compares it (struct bd_num). */
struct num {
    bool is_int;
    int64_t i;
    double f;
};

static double num_double(const struct num *n) {
    return n->is_int ? (double)n->i : n->f;
}

/* Written apart from bucket.c: exact for two integers, else as doubles. */
static bool num_lt(const struct num *a, const struct num *b) {
    if (a->is_int && b->is_int) {
        return a->i < b->i;
    }
    return num_double(a) < num_double(b);
}

static bool num_eq(const struct num *a, const struct num *b) {
    if (a->is_int && b->is_int) {
        return a->i == b->i;
    }
    return num_double(a) == num_double(b);
}

/* key: sensor id, bucket start (ms) and field name, each length-prefixed. */
struct agg {
    struct item key;
    int64_t count;
    struct num min, max;
};

struct aggs {
    struct agg *v;
    size_t n, cap;
};

static void aggs_add(struct aggs *l, const struct xbuf *key, int64_t count, struct num min,
                     struct num max) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 64;
        l->v = realloc(l->v, l->cap * sizeof(*l->v));
        CHECK(l->v != NULL);
    }
    unsigned char *copy = malloc(key->len ? key->len : 1);
    CHECK(copy != NULL);
    memcpy(copy, key->p, key->len);
    l->v[l->n++] = (struct agg){{copy, key->len}, count, min, max};
}

static int agg_cmp(const void *a, const void *b) {
    return item_cmp(&((const struct agg *)a)->key, &((const struct agg *)b)->key);
}

/* Sort by key and fold the entries of one key into one. */
static void aggs_fold(struct aggs *l) {
    if (l->n > 1) {
        qsort(l->v, l->n, sizeof(*l->v), agg_cmp);
    }
    size_t out = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (out > 0 && item_cmp(&l->v[out - 1].key, &l->v[i].key) == 0) {
            struct agg *a = &l->v[out - 1];
            a->count += l->v[i].count;
            if (num_lt(&l->v[i].min, &a->min)) {
                a->min = l->v[i].min;
            }
            if (num_lt(&a->max, &l->v[i].max)) {
                a->max = l->v[i].max;
            }
            free(l->v[i].key.p);
        } else {
            l->v[out++] = l->v[i];
        }
    }
    l->n = out;
}

static void aggs_free(struct aggs *l) {
    for (size_t i = 0; i < l->n; i++) {
        free(l->v[i].key.p);
    }
    free(l->v);
    memset(l, 0, sizeof(*l));
}

static void agg_key(struct xbuf *k, const char *id, size_t id_len, int64_t start_ms,
                    const void *name, size_t name_len) {
    k->len = 0;
    xput_str(k, id, id_len);
    xput_u64(k, (uint64_t)start_ms);
    xput_str(k, name, name_len);
}

/* ---------------------------------------------------------------------------------------- */
/* One run                                                                                  */

/* Built updates: copies kept until the end of the input, where they are checked. */
struct update {
    bson_t *sel, *upd;
};

struct run {
    struct bd_config cfg;
    struct bd_stats stats;
    struct bd_sensor_table *table;
    struct bd_pages_limits lim;
    struct bd_pages_pool pool; /* the sensors' one-slot pages, as the flusher's */
    struct bd_batch batch;
    uint64_t fill_id;

    /* From the input: what was accepted, and the field names each sensor was sent. */
    uint64_t accepted, refused, busy;
    struct items expect;      /* reading_bytes of every accepted point */
    struct items field_names; /* id (length-prefixed), name */
    struct items metas;       /* id, measurement, tags: what meta must hold (meta_bytes) */
    struct aggs expect_sums;  /* per sensor, bucket and numeric field: count, min, max */

    struct update *updates;
    size_t n_updates, cap_updates;
};

static struct bd_parser parsers[2][2][N_PREC]; /* [graphite][small][precision] */
static struct bd_point *point;
static struct run run;
static struct xbuf scratch, scratch2, scratch3;
static struct sval *svals;

static void init_once(void) {
    static bool done;
    if (done) {
        return;
    }
    done = true;
    bd_log_set_level(BD_LOG_ERROR);
    for (int g = 0; g < 2; g++) {
        for (int s = 0; s < 2; s++) {
            for (int p = 0; p < N_PREC; p++) {
                int rc =
                    bd_parser_init(&parsers[g][s][p], g ? BD_FORMAT_GRAPHITE : BD_FORMAT_INFLUX,
                                   (enum bd_precision)p, s ? SMALL_MAX_LINE : LARGE_MAX_LINE);
                CHECK(rc == 0);
            }
        }
    }
    point = calloc(1, sizeof(*point));
    svals = calloc(BD_PARSE_MAX_FIELDS, sizeof(*svals));
    CHECK(point != NULL && svals != NULL);
}

/* The drop counters bd_sensor_table_accept may move (string_fields_dropped is not a drop). */
static uint64_t drops(const struct bd_stats *st) {
    return BD_STAT_GET(st, drop_too_many_fields) + BD_STAT_GET(st, drop_no_numeric) +
           BD_STAT_GET(st, drop_bad_name) + BD_STAT_GET(st, drop_field_limit) +
           BD_STAT_GET(st, drop_too_old) + BD_STAT_GET(st, drop_too_new) +
           BD_STAT_GET(st, drop_buffer_full) + BD_STAT_GET(st, drop_sensor_limit) +
           BD_STAT_GET(st, drop_name_too_long) + BD_STAT_GET(st, drop_sensor_memory);
}

/* What the point must come back as, if accepted (from the point, not from any output). */
static void expect_point(struct run *r, const struct bd_point *pt) {
    int64_t ts_ns = pt->has_time ? pt->time_ns : NOW_NS;
    uint32_t n = 0;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        const struct bd_field *f = &pt->fields[i];
        struct sval *v = &svals[n];
        v->name = f->key.ptr;
        v->name_len = f->key.len;
        switch (f->kind) {
        case BD_VAL_FLOAT:
            v->type = 'd';
            memcpy(&v->bits, &f->v.f, sizeof(v->bits));
            break;
        case BD_VAL_INT:
            v->type = 'i';
            v->bits = (uint64_t)f->v.i;
            break;
        case BD_VAL_UINT:
            /* BSON has no unsigned 64-bit type: above INT64_MAX it is a double. */
            if (f->v.u <= (uint64_t)INT64_MAX) {
                v->type = 'i';
                v->bits = f->v.u;
            } else {
                double d = (double)f->v.u;
                v->type = 'd';
                memcpy(&v->bits, &d, sizeof(v->bits));
            }
            break;
        case BD_VAL_BOOL:
            v->type = 'b';
            v->bits = f->v.b ? 1 : 0;
            break;
        case BD_VAL_STRING:
            continue; /* strings are dropped, and counted */
        }
        scratch2.len = 0;
        xput_str(&scratch2, pt->series_key.ptr, pt->series_key.len);
        xput(&scratch2, f->key.ptr, f->key.len);
        items_add(&r->field_names, scratch2.p, scratch2.len);
        n++;
    }
    reading_bytes(&scratch, pt->series_key.ptr, pt->series_key.len,
                  bd_floor_div(ts_ns, BD_NS_PER_MS), svals, n);
    items_add(&r->expect, scratch.p, scratch.len);

    /* Summaries: each numeric value counts in its sensor's bucket (of its own timestamp). */
    int64_t start = bd_bucket_start_ms(ts_ns, r->cfg.buckets.span_ms);
    for (uint32_t i = 0; i < n; i++) {
        const struct sval *v = &svals[i];
        struct num num = {.is_int = v->type == 'i', .i = (int64_t)v->bits};
        if (v->type == 'b') {
            continue;
        }
        if (v->type == 'd') {
            memcpy(&num.f, &v->bits, sizeof(num.f));
        }
        agg_key(&scratch3, pt->series_key.ptr, pt->series_key.len, start, v->name, v->name_len);
        aggs_add(&r->expect_sums, &scratch3, 1, num, num);
    }

    /* meta: the measurement and the tags, as sent. */
    scratch3.len = 0;
    xput_str(&scratch3, pt->series_key.ptr, pt->series_key.len);
    xput_str(&scratch3, pt->name.ptr, pt->name.len);
    xput_u32(&scratch3, pt->n_tags);
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        xput_str(&scratch3, pt->tags[i].key.ptr, pt->tags[i].key.len);
        xput_str(&scratch3, pt->tags[i].value.ptr, pt->tags[i].value.len);
    }
    items_add(&r->metas, scratch3.p, scratch3.len);
}

/* The flusher's drain_sensor(), without look-ups, allocation failures or a memory budget. */
static void drain_sensor(struct run *r, struct bd_sensor *s) {
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_pages **pp = (struct bd_pages **)&s->flusher_state;
    const uint64_t span = r->cfg.buckets.span_ms;
    const uint32_t n_known = atomic_load_explicit(&s->n_fields, memory_order_acquire);
    const uint64_t overhead = bd_page_overhead_bytes(s);
    const uint64_t rb_max = bd_reading_bytes_max(s, n_known);
    /* As the flusher: readings charged the upper bound while the byte limit cannot bind. */
    const bool exact = overhead + (uint64_t)r->lim.max_readings * rb_max > r->lim.max_bytes;
    int64_t ts;
    uint32_t nv, cells;
    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
        CHECK(nv >= 1 && nv <= r->cfg.limits.max_fields);
        int64_t start = bd_bucket_start_ms(ts, span);
        struct bd_page_slot *slot = bd_pages_slot(&r->pool, pp, &r->lim, start,
                                                  NOW_NS / BD_NS_PER_MS, INT64_MIN, r->fill_id);
        CHECK(slot != NULL);
        /* Nothing wrote these buckets before, and a reading inside the window never needs a
         * slot that was given up: every slot is known. */
        CHECK(slot->known);
        uint64_t rb = exact ? bd_reading_bytes(s, vals, nv) : rb_max;
        CHECK(bd_reading_bytes(s, vals, nv) <= rb);
        uint32_t page = bd_pages_place(slot, &r->lim, rb, overhead);
        int64_t di = bd_batch_get(&r->batch, s, start, page);
        CHECK(di >= 0);
        CHECK(bd_delta_add(&r->batch.deltas[di], ts, vals, nv) == 0);
        slot->batch = r->fill_id;
        bd_sensor_consume(s, cells);
    }
}

/* Drain every dirty sensor until none is left (idle segments come back on the second look). */
static void drain(struct run *r) {
    for (int rounds = 0;; rounds++) {
        CHECK(rounds < 16);
        bd_sensor_table_publish(r->table);
        bool any = false;
        struct bd_sensor *s;
        while ((s = bd_sensor_table_next_dirty(r->table)) != NULL) {
            drain_sensor(r, s);
            any = true;
        }
        if (!any) {
            break;
        }
    }
}

/* Build the update of every delta of the fill batch, keep copies, and start the next batch. */
static void flush(struct run *r) {
    drain(r);
    for (uint32_t i = 0; i < r->batch.n; i++) {
        struct bd_delta *d = &r->batch.deltas[i];
        CHECK(d->n_readings > 0); /* a batch never sends an empty delta */
        CHECK(d->page != BD_PAGE_UNKNOWN);
        bson_t sel, upd;
        int rc = bd_delta_build_update(d, r->cfg.buckets.span_ms, BD_WRITER_KEY_PREFIX WRITER_ID,
                                       r->fill_id, &sel, &upd);
        CHECK(rc == 0);
        if (r->n_updates == r->cap_updates) {
            r->cap_updates = r->cap_updates ? r->cap_updates * 2 : 16;
            r->updates = realloc(r->updates, r->cap_updates * sizeof(*r->updates));
            CHECK(r->updates != NULL);
        }
        r->updates[r->n_updates++] = (struct update){bson_copy(&sel), bson_copy(&upd)};
        bson_destroy(&sel);
        bson_destroy(&upd);
    }
    bd_batch_clear(&r->batch);
    r->fill_id++;
}

/* ---------------------------------------------------------------------------------------- */
/* Checking the updates                                                                     */

static const char *iter_utf8(const bson_iter_t *it, uint32_t *len) {
    CHECK(BSON_ITER_HOLDS_UTF8(it));
    return bson_iter_utf8(it, len);
}

/* The document or array at it, as a bson_t view. */
static void iter_doc(const bson_iter_t *it, bson_t *out) {
    const uint8_t *data;
    uint32_t len;
    if (BSON_ITER_HOLDS_ARRAY(it)) {
        bson_iter_array(it, &len, &data);
    } else {
        CHECK(BSON_ITER_HOLDS_DOCUMENT(it));
        bson_iter_document(it, &len, &data);
    }
    CHECK(bson_init_static(out, data, len));
}

/* The name a stored key of a field (or a tag: kind) stands for, into scratch2. */
static void unescape_kind(const char *key, size_t len, enum bd_name_kind kind) {
    scratch2.len = 0;
    xput(&scratch2, NULL, len + 1);
    int n = bd_name_unescape(key, len, (char *)scratch2.p, len + 1);
    CHECK(n >= 0);
    scratch2.len = (size_t)n;
    /* The key must be what the escape makes of that name, or two keys could mean one name. */
    CHECK(bd_name_escaped_len((const char *)scratch2.p, scratch2.len, kind) == len);
}

static void unescape_key(const char *key, size_t len) {
    unescape_kind(key, len, BD_NAME_FIELD);
}

/* A number in an update: an int64 or a double. */
static struct num iter_num(const bson_iter_t *it) {
    struct num n = {0};
    if (BSON_ITER_HOLDS_INT64(it)) {
        n.is_int = true;
        n.i = bson_iter_int64(it);
    } else {
        CHECK(BSON_ITER_HOLDS_DOUBLE(it));
        n.f = bson_iter_double(it);
    }
    return n;
}

/* Element `index` of the array under `op` in the document at it: {op: [.., ..]}. */
static bson_iter_t op_arg(const bson_iter_t *it, const char *op, const char *index) {
    bson_t doc, arr;
    bson_iter_t a, out;
    iter_doc(it, &doc);
    CHECK(bson_iter_init_find(&a, &doc, op));
    iter_doc(&a, &arr);
    CHECK(bson_iter_init_find(&out, &arr, index));
    return out;
}

/* The meta of an update ({$literal: {measurement, tags}}) in meta_bytes form. */
static void meta_of(struct xbuf *out, const char *sensor, uint32_t sensor_len, const bson_t *set) {
    bson_iter_t it, m;
    bson_t lit, meta, tags;
    CHECK(bson_iter_init_find(&it, set, "meta"));
    iter_doc(&it, &lit);
    CHECK(bson_iter_init_find(&it, &lit, "$literal"));
    iter_doc(&it, &meta);
    CHECK(bson_iter_init(&m, &meta) && bson_iter_next(&m) &&
          strcmp(bson_iter_key(&m), "measurement") == 0);
    uint32_t len;
    const char *measurement = iter_utf8(&m, &len);
    out->len = 0;
    xput_str(out, sensor, sensor_len);
    xput_str(out, measurement, len);
    CHECK(bson_iter_next(&m) && strcmp(bson_iter_key(&m), "tags") == 0);
    iter_doc(&m, &tags);
    CHECK(!bson_iter_next(&m));
    xput_u32(out, bson_count_keys(&tags));
    CHECK(bson_iter_init(&it, &tags));
    while (bson_iter_next(&it)) {
        unescape_kind(bson_iter_key(&it), bson_iter_key_len(&it), BD_NAME_TAG);
        xput_str(out, scratch2.p, scratch2.len);
        const char *value = iter_utf8(&it, &len);
        xput_str(out, value, len);
    }
}

/* One page document as the updates build it up: every reading, and the last update's parts. */
struct page_doc {
    const char *id; /* the _id, in the latest update (kept to the end) */
    bson_t readings;
    uint32_t n_readings;
    struct items summary_keys;
    const bson_t *sel, *upd; /* latest */
};

struct id_entry {
    const char *id;
    uint32_t id_len;
    const char *sensor;
    uint32_t sensor_len;
    int64_t start_ms;
    int32_t page;
    size_t update;
};

static int id_entry_cmp(const void *a, const void *b) {
    const struct id_entry *x = a, *y = b;
    struct item ix = {(unsigned char *)x->id, x->id_len}, iy = {(unsigned char *)y->id, y->id_len};
    int c = item_cmp(&ix, &iy);
    if (c != 0) {
        return c;
    }
    return x->update < y->update ? -1 : x->update > y->update;
}

/* The document a page's updates leave in MongoDB, rebuilt from their parts; its BSON size. */
static uint32_t page_doc_size(const struct page_doc *p) {
    bson_iter_t it, set;
    bson_t doc, meta_lit, w, summary, one;
    bson_init(&doc);
    CHECK(bson_iter_init_find(&it, p->sel, "_id"));
    CHECK(bson_append_iter(&doc, "_id", -1, &it));
    CHECK(bson_iter_init_find(&it, p->sel, "sensor_id"));
    CHECK(bson_append_iter(&doc, "sensor_id", -1, &it));
    CHECK(bson_iter_init_find(&it, p->sel, "bucket_start"));
    CHECK(bson_append_iter(&doc, "bucket_start", -1, &it));
    CHECK(bson_iter_init(&it, p->upd) && bson_iter_find_descendant(&it, "0.$set", &set));
    bson_t set_doc;
    iter_doc(&set, &set_doc);
    CHECK(bson_iter_init_find(&it, &set_doc, "meta"));
    iter_doc(&it, &meta_lit);
    CHECK(bson_iter_init_find(&it, &meta_lit, "$literal"));
    CHECK(bson_append_iter(&doc, "meta", -1, &it));
    CHECK(bson_iter_init_find(&it, &set_doc, "bucket_end"));
    CHECK(bson_append_iter(&doc, "bucket_end", -1, &it));
    CHECK(bson_iter_init_find(&it, &set_doc, "page"));
    CHECK(bson_append_iter(&doc, "page", -1, &it));
    BSON_APPEND_DOCUMENT_BEGIN(&doc, "w", &w);
    BSON_APPEND_INT64(&w, WRITER_ID, 0);
    bson_append_document_end(&doc, &w);
    BSON_APPEND_INT64(&doc, "count", p->n_readings);
    BSON_APPEND_ARRAY(&doc, "readings", &p->readings);
    BSON_APPEND_DOCUMENT_BEGIN(&doc, "summary", &summary);
    for (size_t i = 0; i < p->summary_keys.n; i++) {
        const struct item *k = &p->summary_keys.v[i];
        bson_append_document_begin(&summary, (const char *)k->p, (int)k->n, &one);
        BSON_APPEND_DOUBLE(&one, "min", 0);
        BSON_APPEND_DOUBLE(&one, "max", 0);
        BSON_APPEND_DOUBLE(&one, "sum", 0);
        BSON_APPEND_INT64(&one, "count", 0);
        BSON_APPEND_DOUBLE(&one, "avg", 0);
        bson_append_document_end(&summary, &one);
    }
    bson_append_document_end(&doc, &summary);
    size_t off;
    CHECK(bson_validate(&doc, BSON_VALIDATE_UTF8, &off));
    uint32_t len = doc.len;
    bson_destroy(&doc);
    return len;
}

/* Everything the run's updates must satisfy, against what the input made the harness expect. */
static void check_updates(struct run *r) {
    struct items actual = {0};
    struct aggs sums = {0};
    struct id_entry *ids = calloc(r->n_updates + 1, sizeof(*ids));
    struct page_doc *pages = calloc(r->n_updates + 1, sizeof(*pages));
    size_t n_pages = 0;
    uint64_t readings = 0;
    CHECK(ids != NULL && pages != NULL);
    items_sort(&r->field_names);
    items_sort(&r->metas);

    for (size_t u = 0; u < r->n_updates; u++) {
        const bson_t *sel = r->updates[u].sel, *upd = r->updates[u].upd;
        size_t off;
        CHECK(bson_validate(sel, BSON_VALIDATE_UTF8, &off));
        CHECK(bson_validate(upd, BSON_VALIDATE_UTF8, &off));
        CHECK((uint64_t)sel->len + upd->len <= BD_UPDATE_MAX_BYTES);

        bson_iter_t it, set_it, n_it, sub;
        uint32_t id_len, sensor_len;
        CHECK(bson_iter_init_find(&it, sel, "_id"));
        const char *id = iter_utf8(&it, &id_len);
        CHECK(bson_iter_init_find(&it, sel, "sensor_id"));
        const char *sensor = iter_utf8(&it, &sensor_len);
        CHECK(bson_iter_init_find(&it, sel, "bucket_start") && BSON_ITER_HOLDS_DATE_TIME(&it));
        int64_t start_ms = bson_iter_date_time(&it);
        CHECK(bson_iter_init(&it, upd) && bson_iter_find_descendant(&it, "0.$set", &set_it));
        bson_t set;
        iter_doc(&set_it, &set);
        CHECK(bson_iter_init_find(&it, &set, "page") && BSON_ITER_HOLDS_INT32(&it));
        int32_t page = bson_iter_int32(&it);
        CHECK(page >= 0);

        /* The _id ends in "|<bucket start in s>|<page>". */
        char tail[64];
        int tn = snprintf(tail, sizeof(tail), "|%" PRId64 "|%" PRId32, bd_floor_div(start_ms, 1000),
                          page);
        CHECK(tn > 0 && (uint32_t)tn < id_len && memcmp(id + id_len - tn, tail, (size_t)tn) == 0);
        ids[u] = (struct id_entry){id, id_len, sensor, sensor_len, start_ms, page, u};
        const int64_t span = (int64_t)r->cfg.buckets.span_ms;
        CHECK(bd_floor_div(start_ms, span) * span == start_ms);
        CHECK(bson_iter_init_find(&it, &set, "bucket_end") && BSON_ITER_HOLDS_DATE_TIME(&it));
        CHECK(bson_iter_date_time(&it) == start_ms + span - 1);

        /* meta holds the measurement and tags the sensor's points were sent with. */
        meta_of(&scratch3, sensor, sensor_len, &set);
        CHECK(items_has(&r->metas, scratch3.p, scratch3.len));

        /* The readings: sensor id in full, every key the escape of a name that was sent. */
        CHECK(bson_iter_init_find(&n_it, &set, "_n"));
        bson_t lit, arr;
        iter_doc(&n_it, &lit);
        CHECK(bson_iter_init_find(&it, &lit, "$literal") && BSON_ITER_HOLDS_ARRAY(&it));
        iter_doc(&it, &arr);
        CHECK(bson_iter_init(&it, &arr));
        uint32_t n_here = 0;
        int64_t last_ts = 0;
        struct items numeric = {0}; /* names of the numeric fields in this update's readings */
        while (bson_iter_next(&it)) {
            bson_t rdoc;
            iter_doc(&it, &rdoc);
            CHECK(bson_iter_init(&sub, &rdoc));
            CHECK(bson_iter_next(&sub) && strcmp(bson_iter_key(&sub), "ts") == 0 &&
                  BSON_ITER_HOLDS_DATE_TIME(&sub));
            int64_t ts_ms = bson_iter_date_time(&sub);
            /* In the bucket, in time order. */
            CHECK(ts_ms >= start_ms && ts_ms < start_ms + span);
            CHECK(n_here == 0 || ts_ms >= last_ts);
            last_ts = ts_ms;
            uint32_t nv = 0;
            struct xbuf names = {0};
            size_t name_off[BD_PARSE_MAX_FIELDS];
            while (bson_iter_next(&sub)) {
                CHECK(nv < BD_PARSE_MAX_FIELDS);
                const char *key = bson_iter_key(&sub);
                unescape_key(key, bson_iter_key_len(&sub));
                name_off[nv] = names.len;
                xput(&names, scratch2.p, scratch2.len);
                struct sval *v = &svals[nv];
                v->name_len = scratch2.len;
                if (BSON_ITER_HOLDS_DOUBLE(&sub)) {
                    double d = bson_iter_double(&sub);
                    v->type = 'd';
                    memcpy(&v->bits, &d, sizeof(v->bits));
                } else if (BSON_ITER_HOLDS_INT64(&sub)) {
                    v->type = 'i';
                    v->bits = (uint64_t)bson_iter_int64(&sub);
                } else {
                    CHECK(BSON_ITER_HOLDS_BOOL(&sub));
                    v->type = 'b';
                    v->bits = bson_iter_bool(&sub) ? 1 : 0;
                }
                if (v->type != 'b' && !items_has(&numeric, scratch2.p, scratch2.len)) {
                    items_add(&numeric, scratch2.p, scratch2.len);
                    items_sort(&numeric);
                }
                nv++;
            }
            CHECK(nv >= 1);
            for (uint32_t k = 0; k < nv; k++) {
                svals[k].name = (const char *)names.p + name_off[k];
            }
            reading_bytes(&scratch, sensor, sensor_len, ts_ms, svals, nv);
            items_add(&actual, scratch.p, scratch.len);
            free(names.p);
            n_here++;
        }
        CHECK(n_here > 0);
        readings += n_here;

        /* Summary keys: one per numeric field of these readings, each a name the sensor was
         * sent, none twice. */
        struct items summary = {0};
        CHECK(bson_iter_init(&it, &set));
        while (bson_iter_next(&it)) {
            const char *key = bson_iter_key(&it);
            size_t klen = bson_iter_key_len(&it);
            static const char pre[] = "summary.", post[] = ".min";
            if (klen < sizeof(pre) - 1 + sizeof(post) - 1 ||
                memcmp(key, pre, sizeof(pre) - 1) != 0 ||
                memcmp(key + klen - (sizeof(post) - 1), post, sizeof(post) - 1) != 0) {
                continue;
            }
            const char *f = key + sizeof(pre) - 1;
            size_t flen = klen - (sizeof(pre) - 1) - (sizeof(post) - 1);
            unescape_key(f, flen);
            CHECK(!items_has(&summary, scratch2.p, scratch2.len));
            CHECK(items_has(&numeric, scratch2.p, scratch2.len));
            struct xbuf sent = {0};
            xput_str(&sent, sensor, sensor_len);
            xput(&sent, scratch2.p, scratch2.len);
            CHECK(items_has(&r->field_names, sent.p, sent.len));
            free(sent.p);
            items_add(&summary, scratch2.p, scratch2.len);
            items_sort(&summary);

            /* What this update adds to the field's summary: {$min: [ref, min]}, {$max: ...},
             * count {$add: [{$ifNull: ...}, n]}. */
            bson_iter_t arg = op_arg(&it, "$min", "1");
            struct num mn = iter_num(&arg);
            agg_key(&scratch3, sensor, sensor_len, start_ms, scratch2.p, scratch2.len);
            struct xbuf path = {0};
            xput(&path, key, klen - 4);
            xput(&path, ".max", 5);
            bson_iter_t other;
            CHECK(bson_iter_init_find(&other, &set, (const char *)path.p));
            arg = op_arg(&other, "$max", "1");
            struct num mx = iter_num(&arg);
            path.len = klen - 4;
            xput(&path, ".count", 7);
            CHECK(bson_iter_init_find(&other, &set, (const char *)path.p));
            arg = op_arg(&other, "$add", "1");
            CHECK(BSON_ITER_HOLDS_INT64(&arg));
            int64_t count = bson_iter_int64(&arg);
            CHECK(count >= 1 && count <= n_here);
            free(path.p);
            aggs_add(&sums, &scratch3, count, mn, mx);
        }
        CHECK(summary.n == numeric.n);
        items_free(&numeric);
        items_free(&summary);
    }

    /* The readings are the accepted ones, no more, no fewer, each as it was sent. */
    CHECK(readings == r->accepted);
    CHECK(r->expect.n == r->accepted);
    items_sort(&actual);
    items_sort(&r->expect);
    CHECK(actual.n == r->expect.n);
    for (size_t i = 0; i < actual.n; i++) {
        CHECK(item_cmp(&actual.v[i], &r->expect.v[i]) == 0);
    }
    items_free(&actual);

    /* Summaries are true: per sensor, bucket and numeric field, the counts the updates add up
     * to, and the smallest and largest values they carry, are those of the accepted points. */
    aggs_fold(&sums);
    aggs_fold(&r->expect_sums);
    CHECK(sums.n == r->expect_sums.n);
    for (size_t i = 0; i < sums.n; i++) {
        const struct agg *a = &sums.v[i], *e = &r->expect_sums.v[i];
        CHECK(item_cmp(&a->key, &e->key) == 0);
        CHECK(a->count == e->count);
        CHECK(num_eq(&a->min, &e->min) && num_eq(&a->max, &e->max));
    }
    aggs_free(&sums);

    /* One _id, one sensor, bucket and page; its updates rebuild a page within the limits. */
    if (r->n_updates > 1) {
        qsort(ids, r->n_updates, sizeof(*ids), id_entry_cmp);
    }
    for (size_t u = 0; u < r->n_updates; u++) {
        const struct id_entry *e = &ids[u];
        struct page_doc *p;
        if (u > 0 && ids[u - 1].id_len == e->id_len &&
            memcmp(ids[u - 1].id, e->id, e->id_len) == 0) {
            const struct id_entry *prev = &ids[u - 1];
            CHECK(prev->sensor_len == e->sensor_len &&
                  memcmp(prev->sensor, e->sensor, e->sensor_len) == 0);
            CHECK(prev->start_ms == e->start_ms && prev->page == e->page);
            p = &pages[n_pages - 1];
        } else {
            p = &pages[n_pages++];
            bson_init(&p->readings);
        }
        p->sel = r->updates[e->update].sel;
        p->upd = r->updates[e->update].upd;
        bson_iter_t it, el;
        CHECK(bson_iter_init(&it, p->upd) &&
              bson_iter_find_descendant(&it, "0.$set._n.$literal", &el));
        bson_t arr;
        iter_doc(&el, &arr);
        CHECK(bson_iter_init(&it, &arr));
        while (bson_iter_next(&it)) {
            char idx[16];
            const char *ikey;
            size_t klen = bson_uint32_to_string(p->n_readings++, &ikey, idx, sizeof(idx));
            CHECK(bson_append_iter(&p->readings, ikey, (int)klen, &it));
        }
        CHECK(bson_iter_init(&it, p->upd) && bson_iter_find_descendant(&it, "0.$set", &el));
        bson_t set;
        iter_doc(&el, &set);
        CHECK(bson_iter_init(&it, &set));
        while (bson_iter_next(&it)) {
            const char *key = bson_iter_key(&it);
            size_t klen = bson_iter_key_len(&it);
            if (klen > 12 && memcmp(key, "summary.", 8) == 0 &&
                memcmp(key + klen - 4, ".min", 4) == 0 &&
                !items_has(&p->summary_keys, key + 8, klen - 12)) {
                items_add(&p->summary_keys, key + 8, klen - 12);
                items_sort(&p->summary_keys);
            }
        }
    }
    for (size_t i = 0; i < n_pages; i++) {
        struct page_doc *p = &pages[i];
        uint32_t size = page_doc_size(p);
        if (p->n_readings > 1 && size > r->cfg.buckets.max_bytes) {
            fprintf(stderr,
                    "fuzz_accept: page document of %" PRIu32 " readings is %" PRIu32
                    " bytes (buckets.max_bytes %" PRIu64 ")\n",
                    p->n_readings, size, r->cfg.buckets.max_bytes);
        }
        /* A page holds what the configuration allows, unless one reading alone is larger. */
        CHECK(p->n_readings <= r->cfg.buckets.max_readings);
        CHECK(p->n_readings == 1 || size <= r->cfg.buckets.max_bytes);
        CHECK(size <= BD_UPDATE_MAX_BYTES);
        bson_destroy(&p->readings);
        items_free(&p->summary_keys);
    }
    free(pages);
    free(ids);
}

/* ---------------------------------------------------------------------------------------- */
/* Driver                                                                                   */

static void release_pages(struct bd_sensor *s, void *arg) {
    bd_pages_free(arg, s->flusher_state);
    s->flusher_state = NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) {
        return 0;
    }
    init_once();
    const uint8_t mode = data[0];
    struct bd_parser *p = &parsers[(mode >> 3) & 1][(mode >> 2) & 1][mode & 3];
    const bool flush_each = (mode & 0x40) != 0;
    /* The longest names limits.max_name allows, or short ones (refusals of long names). */
    const uint32_t max_name = (mode & 0x20) != 0 ? CFG_SHORT_NAME : 64 * 1024;
    struct run *r = &run;

    memset(r, 0, sizeof(*r));
    bd_config_defaults(&r->cfg);
    snprintf(r->cfg.writer_id, sizeof(r->cfg.writer_id), "%s", WRITER_ID);
    r->cfg.limits.max_sensors = CFG_MAX_SENSORS;
    r->cfg.limits.memory = CFG_MEMORY;
    r->cfg.limits.max_line = (uint32_t)p->max_line;
    r->cfg.limits.max_name = max_name;
    r->cfg.buckets.max_readings = CFG_MAX_READINGS;
    r->cfg.buckets.max_bytes = CFG_MAX_BYTES;
    r->cfg.buckets.max_late_ms = CFG_MAX_LATE_MS;
    r->lim = (struct bd_pages_limits){.span_ms = r->cfg.buckets.span_ms,
                                      .max_late_ms = r->cfg.buckets.max_late_ms,
                                      .max_future_ms = r->cfg.buckets.max_future_ms,
                                      .max_readings = r->cfg.buckets.max_readings,
                                      .max_bytes = r->cfg.buckets.max_bytes};
    r->fill_id = 1;
    bd_pages_pool_init(&r->pool);
    struct bd_err err = {0};
    CHECK(bd_sensor_table_new(&r->table, &r->cfg, &r->stats, &err) == 0);
    CHECK(bd_batch_init(&r->batch) == 0);

    /* The lines, in a block of exactly their size (a read past them is an ASan report). */
    size_t n = size - 1;
    char *text = malloc(n ? n : 1);
    CHECK(text != NULL);
    memcpy(text, data + 1, n);
    bd_parse_begin(p, text, n);
    for (;;) {
        const char *errmsg = NULL;
        struct bd_str line;
        int rc = bd_parse_next(p, point, &line, &errmsg);
        if (rc == BD_PARSE_END) {
            break;
        }
        if (rc != BD_PARSE_OK) {
            continue;
        }
        uint64_t drops_before = drops(&r->stats);
        uint64_t accepted_before = BD_STAT_GET(&r->stats, readings_accepted);
        int arc = bd_sensor_table_accept(r->table, point, NOW_NS);
        if (arc == -EAGAIN) {
            /* Busy (its share of the pool, or a new sensor in a pool three quarters full):
             * nothing counted. As a TCP connection would, wait for the flusher: drained, the
             * queue is empty and the point is taken or refused for a counted reason. */
            CHECK(BD_STAT_GET(&r->stats, readings_accepted) == accepted_before);
            CHECK(drops(&r->stats) == drops_before);
            r->busy++;
            flush(r);
            arc = bd_sensor_table_accept(r->table, point, NOW_NS);
            CHECK(arc != -EAGAIN);
        }
        if (arc == 0) {
            r->accepted++;
            expect_point(r, point);
            CHECK(BD_STAT_GET(&r->stats, readings_accepted) == accepted_before + 1);
            CHECK(drops(&r->stats) == drops_before);
        } else {
            /* Refused: counted once, by its reason. */
            r->refused++;
            CHECK(arc < 0);
            CHECK(BD_STAT_GET(&r->stats, readings_accepted) == accepted_before);
            CHECK(drops(&r->stats) == drops_before + 1);
        }
        if (flush_each) {
            flush(r);
        }
    }
    flush(r);
    CHECK(bd_sensor_table_count(r->table) <= CFG_MAX_SENSORS);
    /* Drained to the end: every segment is back in the pool. */
    CHECK(bd_pool_in_use(bd_sensor_table_pool(r->table)) == 0);
    check_updates(r);

    for (size_t i = 0; i < r->n_updates; i++) {
        bson_destroy(r->updates[i].sel);
        bson_destroy(r->updates[i].upd);
    }
    free(r->updates);
    items_free(&r->expect);
    items_free(&r->field_names);
    items_free(&r->metas);
    aggs_free(&r->expect_sums);
    bd_batch_close(&r->batch);
    bd_sensor_table_foreach(r->table, release_pages, &r->pool);
    bd_pages_pool_close(&r->pool);
    bd_sensor_table_free(r->table);
    free(text);
    return 0;
}

#ifdef BD_FUZZ_REPLAY
/* ---------------------------------------------------------------------------------------- */
/* Replay: the plain program ctest runs                                                     */

static uint64_t total_accepted, total_refused, total_updates;
static uint64_t total_drops[10], total_busy;

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "fuzz_accept: %s: %s\n", path, strerror(errno));
        return -1;
    }
    struct xbuf b = {0};
    unsigned char chunk[65536];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        xput(&b, chunk, got);
    }
    fclose(f);
    /* Exactly the input's size, as libFuzzer hands it over. */
    uint8_t *data = malloc(b.len ? b.len : 1);
    CHECK(data != NULL);
    if (b.len > 0) {
        memcpy(data, b.p, b.len);
    }
    free(b.p);
    LLVMFuzzerTestOneInput(data, b.len);
    free(data);
    total_accepted += run.accepted;
    total_refused += run.refused;
    total_updates += run.n_updates;
    const uint64_t d[10] = {
        BD_STAT_GET(&run.stats, drop_too_many_fields), BD_STAT_GET(&run.stats, drop_no_numeric),
        BD_STAT_GET(&run.stats, drop_bad_name),        BD_STAT_GET(&run.stats, drop_field_limit),
        BD_STAT_GET(&run.stats, drop_too_old),         BD_STAT_GET(&run.stats, drop_too_new),
        BD_STAT_GET(&run.stats, drop_buffer_full),     BD_STAT_GET(&run.stats, drop_sensor_limit),
        BD_STAT_GET(&run.stats, drop_name_too_long),   BD_STAT_GET(&run.stats, drop_sensor_memory)};
    total_busy += run.busy;
    for (int i = 0; i < 10; i++) {
        total_drops[i] += d[i];
    }
    return 0;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file under path (a file or a directory), in name order; the count, or -1. */
static long replay_path(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fuzz_accept: %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        return replay_file(path) == 0 ? 1 : -1;
    }
    DIR *dir = opendir(path);
    if (dir == NULL) {
        fprintf(stderr, "fuzz_accept: %s: %s\n", path, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (de->d_name[0] == '.') {
            continue; /* ., .., and hidden files such as a README's editor backups */
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            names = realloc(names, cap * sizeof(*names));
            CHECK(names != NULL);
        }
        names[n++] = strdup(de->d_name);
    }
    closedir(dir);
    qsort(names, n, sizeof(*names), name_cmp);
    long count = 0;
    for (size_t i = 0; i < n; i++) {
        char *full = malloc(strlen(path) + strlen(names[i]) + 2);
        CHECK(full != NULL);
        sprintf(full, "%s/%s", path, names[i]);
        long c = stat(full, &st) == 0 && S_ISREG(st.st_mode) ? replay_path(full) : 0;
        free(full);
        free(names[i]);
        if (c < 0) {
            count = -1;
        } else if (count >= 0) {
            count += c;
        }
    }
    free(names);
    return count;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
        return 2;
    }
    long files = 0;
    for (int i = 1; i < argc; i++) {
        long c = replay_path(argv[i]);
        if (c < 0) {
            return 1;
        }
        files += c;
    }
    /* No input at all is a failure: a missing corpus must not pass as a clean run. */
    if (files == 0) {
        fprintf(stderr, "fuzz_accept: no input files\n");
        return 1;
    }
    printf("fuzz_accept: %ld inputs, %" PRIu64 " points accepted, %" PRIu64 " refused (too many "
           "fields %" PRIu64 ", no numeric %" PRIu64 ", bad name %" PRIu64 ", field limit %" PRIu64
           ", too old %" PRIu64 ", too new %" PRIu64 ", buffer full %" PRIu64
           ", sensor limit %" PRIu64 ", name too long %" PRIu64 ", sensor memory %" PRIu64
           "), %" PRIu64 " busy and offered again, %" PRIu64 " updates: all invariants held\n",
           files, total_accepted, total_refused, total_drops[0], total_drops[1], total_drops[2],
           total_drops[3], total_drops[4], total_drops[5], total_drops[6], total_drops[7],
           total_drops[8], total_drops[9], total_busy, total_updates);
    for (int g = 0; g < 2; g++) {
        for (int s = 0; s < 2; s++) {
            for (int p = 0; p < N_PREC; p++) {
                bd_parser_close(&parsers[g][s][p]);
            }
        }
    }
    free(point);
    free(svals);
    free(scratch.p);
    free(scratch2.p);
    free(scratch3.p);
    return 0;
}
#endif
