/*
 * bucketd-inspect verify: scans the collection (or one sensor's documents) and reports every
 * document that breaks an invariant of the schema (README "Document schema"), one line per
 * problem; with --summaries, also every summary document that does not match the buckets'
 * readings, or has no bucket.
 *
 * It streams: documents come sorted by {sensor_id, bucket_start} (the order of the daemon's
 * index, so a real MongoDB walks the index instead of sorting), in batches, and only the page
 * list of the bucket being read is kept, so memory stays flat however big the collection is.
 * The summary collection is read in the same order alongside.
 *
 * Single-threaded; the struct verifier of inspect_verify owns everything kept between
 * documents.
 */
#include "inspect.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/bucket.h"

/* Relative tolerance for sum and avg: the daemon adds per flush, in another order. */
#define SUM_REL_TOL 1e-9
/* Reading-level problems of one kind listed per document; the rest are counted in one line. */
#define LIST_PER_KIND 5

/* What the readings of the document being checked give for one field. */
struct field_acc {
    const char *name; /* points into the current document */
    int64_t n_num;    /* numeric readings */
    struct num min, max;
    double sum, comp; /* Neumaier-compensated sum: the reference the daemon's sum is held to */
    double sum_abs;   /* sum of |value|: the scale rounding errors of any order are bounded by */
    bool has_summary;
};

struct page_info {
    int64_t page;
    int64_t n_readings;
    char *id;
    bson_t *meta; /* NULL if the page has none (reported already) */
};

/* The bucket being read: documents come sorted by {sensor_id, bucket_start}, so all pages of
 * one bucket arrive together (in no particular page order) and only this much is kept across
 * documents. */
struct group {
    bool active;
    char *sensor_id;
    int64_t start_ms;
    struct page_info *pages;
    size_t n_pages, cap_pages;
    /* verify --summaries: the bucket's readings over all its pages (names owned). */
    int64_t n_readings;
    struct field_acc *tot;
    size_t n_tot, cap_tot;
};

/* Reading-level problem kinds, each listed LIST_PER_KIND times per document at most. */
enum rkind { RK_SHAPE, RK_TS, RK_ORDER, RK_RANGE, RK_VALUE, N_RKINDS };

static const char *const rkind_what[N_RKINDS] = {
    "readings that are not documents",
    "readings without a date ts",
    "readings out of time order",
    "readings outside the bucket",
    "reading values of a type that is not stored",
};

struct verifier {
    const struct settings *s;
    uint64_t documents, readings, problems, warnings;
    struct field_acc *acc; /* per field of the document being checked */
    size_t n_acc, cap_acc;
    uint64_t rk_count[N_RKINDS]; /* reading-level problems of the document being checked */
    struct group g;
    /* verify --summaries: the summary collection, read in the pages' order alongside them. */
    mongoc_cursor_t *sums;
    bson_t *sum_doc; /* the summary read and not yet matched, or NULL */
    const char *sum_sensor;
    int64_t sum_start;
    bool sums_done; /* the cursor is at its end (or failed): not advanced again */
    uint64_t summaries;
};

static void vsay(const char *id, const char *tag, const char *fmt, va_list ap) {
    char msg[4096];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    inspect_put_safe(id);
    printf(": %s", tag);
    inspect_put_safe(msg);
    putchar('\n');
}

static void problem(struct verifier *v, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void warning(struct verifier *v, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void reading_problem(struct verifier *v, const char *id, enum rkind k, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void problem(struct verifier *v, const char *id, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsay(id, "", fmt, ap);
    va_end(ap);
    v->problems++;
}

static void warning(struct verifier *v, const char *id, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsay(id, "warning: ", fmt, ap);
    va_end(ap);
    v->warnings++;
}

/*
 * A problem with one reading: always counted, printed only for the first few of its kind in
 * a document, so one shifted bucket does not bury everything else under thousands of lines.
 */
static void reading_problem(struct verifier *v, const char *id, enum rkind k, const char *fmt,
                            ...) {
    v->problems++;
    if (++v->rk_count[k] > LIST_PER_KIND) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsay(id, "", fmt, ap);
    va_end(ap);
}

/* Looks key up in doc; reports it missing or of the wrong type (path names it in messages). */
static bool want(struct verifier *v, const char *id, const bson_t *doc, const char *key,
                 const char *path, uint32_t types, const char *expected, bson_iter_t *it) {
    if (!bson_iter_init_find(it, doc, key)) {
        problem(v, id, "%s is missing (expected %s, found nothing)", path, expected);
        return false;
    }
    if (!inspect_type_in(bson_iter_type(it), types)) {
        problem(v, id, "%s has the wrong type (expected %s, found %s)", path, expected,
                inspect_type_name(bson_iter_type(it)));
        return false;
    }
    return true;
}

static bool sub_document(const bson_iter_t *it, bson_t *out) {
    uint32_t len = 0;
    const uint8_t *data = NULL;
    if (BSON_ITER_HOLDS_DOCUMENT(it)) {
        bson_iter_document(it, &len, &data);
    }
    return data != NULL && bson_init_static(out, data, len);
}

static struct field_acc *find_acc(struct verifier *v, const char *name) {
    for (size_t i = 0; i < v->n_acc; i++) {
        if (strcmp(v->acc[i].name, name) == 0) {
            return &v->acc[i];
        }
    }
    return NULL;
}

static struct field_acc *get_acc(struct verifier *v, const char *name) {
    struct field_acc *a = find_acc(v, name);
    if (a != NULL) {
        return a;
    }
    if (inspect_grow((void **)&v->acc, &v->cap_acc, v->n_acc + 1, sizeof(*v->acc)) < 0) {
        return NULL;
    }
    a = &v->acc[v->n_acc++];
    memset(a, 0, sizeof(*a));
    a->name = name;
    return a;
}

static void acc_add(struct field_acc *a, const struct num *n) {
    double x = inspect_num_as_double(n);
    if (a->n_num == 0 || inspect_num_cmp(n, &a->min) < 0) {
        a->min = *n;
    }
    if (a->n_num == 0 || inspect_num_cmp(n, &a->max) > 0) {
        a->max = *n;
    }
    double t = a->sum + x;
    if (fabs(a->sum) >= fabs(x)) {
        a->comp += (a->sum - t) + x;
    } else {
        a->comp += (x - t) + a->sum;
    }
    a->sum = t;
    a->sum_abs += fabs(x);
    a->n_num++;
}

/*
 * found is within SUM_REL_TOL of want_v, relative to the larger of |want_v| and scale. The
 * scale (sum of |values|, or that over count for avg) bounds the rounding error of a sum taken
 * in any order, so a sum that cancels to nearly zero is not held to an impossible precision.
 */
static bool close_enough(double found, double want_v, double scale) {
    double tol = SUM_REL_TOL * BD_MAX(fabs(want_v), scale);
    return fabs(found - want_v) <= tol;
}

/*
 * Checks the readings array: shape, ts order and range [lo_ms, hi_ms], value types; fills the
 * field accumulators and *n. -ENOMEM only.
 */
static int check_readings(struct verifier *v, const char *id, bson_iter_t *arr, bool has_range,
                          int64_t lo_ms, int64_t hi_ms, int64_t *n) {
    char a[64], b[64], c[64];
    bool has_prev = false;
    int64_t prev = 0;
    int64_t i = 0;
    for (; bson_iter_next(arr); i++) {
        bson_t r;
        bson_iter_t it;
        if (!sub_document(arr, &r)) {
            reading_problem(v, id, RK_SHAPE,
                            "readings[%" PRId64 "] has the wrong type (expected document, "
                            "found %s)",
                            i, inspect_type_name(bson_iter_type(arr)));
            continue;
        }
        if (!bson_iter_init_find(&it, &r, "ts")) {
            reading_problem(v, id, RK_TS,
                            "readings[%" PRId64 "].ts is missing (expected date, found nothing)",
                            i);
        } else if (!BSON_ITER_HOLDS_DATE_TIME(&it)) {
            reading_problem(v, id, RK_TS,
                            "readings[%" PRId64 "].ts has the wrong type (expected date, "
                            "found %s)",
                            i, inspect_type_name(bson_iter_type(&it)));
        } else {
            int64_t ts = bson_iter_date_time(&it);
            if (has_prev && ts < prev) {
                inspect_fmt_time(prev, a, sizeof(a));
                inspect_fmt_time(ts, b, sizeof(b));
                reading_problem(v, id, RK_ORDER,
                                "readings[%" PRId64 "] is out of time order (expected ts >= "
                                "%s, found %s)",
                                i, a, b);
            }
            has_prev = true;
            prev = ts;
            if (has_range && (ts < lo_ms || ts > hi_ms)) {
                inspect_fmt_time(lo_ms, a, sizeof(a));
                inspect_fmt_time(hi_ms, b, sizeof(b));
                inspect_fmt_time(ts, c, sizeof(c));
                reading_problem(v, id, RK_RANGE,
                                "readings[%" PRId64 "].ts is outside the bucket (expected %s .. "
                                "%s, found %s)",
                                i, a, b, c);
            }
        }
        bson_iter_init(&it, &r);
        while (bson_iter_next(&it)) {
            const char *key = bson_iter_key(&it);
            struct num num;
            if (strcmp(key, "ts") == 0) {
                continue;
            }
            bool numeric = inspect_num_get(&it, &num);
            if (!numeric && !BSON_ITER_HOLDS_BOOL(&it)) {
                reading_problem(v, id, RK_VALUE,
                                "readings[%" PRId64 "].%s has a type bucketd does not store "
                                "(expected double, int32, int64 or bool, found %s)",
                                i, key, inspect_type_name(bson_iter_type(&it)));
                continue;
            }
            /* Booleans get an accumulator too (with no numeric readings), so that a summary
             * of a bool-only field is told apart from one of a field no reading has. */
            struct field_acc *f = get_acc(v, key);
            if (f == NULL) {
                return -ENOMEM;
            }
            if (numeric) {
                acc_add(f, &num);
            }
        }
    }
    *n = i;
    return 0;
}

/* summary.<f> against what the readings give for f. */
static void check_field_summary(struct verifier *v, const char *id, const char *field,
                                const struct field_acc *f, const bson_t *sd) {
    char path[512], a[64], b[64];
    bson_iter_t it;
    struct num n;
    double want_sum = f->sum + f->comp;
    double want_avg = want_sum / (double)f->n_num;

    snprintf(path, sizeof(path), "summary.%s.count", field);
    if (want(v, id, sd, "count", path, T_INT, "int64", &it) &&
        bson_iter_as_int64(&it) != f->n_num) {
        problem(v, id, "%s is wrong (expected %" PRId64 ", found %" PRId64 ")", path, f->n_num,
                bson_iter_as_int64(&it));
    }
    snprintf(path, sizeof(path), "summary.%s.min", field);
    if (want(v, id, sd, "min", path, T_NUM, "a number", &it) && inspect_num_get(&it, &n) &&
        inspect_num_cmp(&n, &f->min) != 0) {
        inspect_fmt_num(&f->min, a, sizeof(a));
        inspect_fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.max", field);
    if (want(v, id, sd, "max", path, T_NUM, "a number", &it) && inspect_num_get(&it, &n) &&
        inspect_num_cmp(&n, &f->max) != 0) {
        inspect_fmt_num(&f->max, a, sizeof(a));
        inspect_fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.sum", field);
    if (want(v, id, sd, "sum", path, T_NUM, "a number", &it) && inspect_num_get(&it, &n) &&
        !close_enough(inspect_num_as_double(&n), want_sum, f->sum_abs)) {
        inspect_fmt_double(want_sum, a, sizeof(a));
        inspect_fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.avg", field);
    if (want(v, id, sd, "avg", path, T_NUM, "a number", &it) && inspect_num_get(&it, &n) &&
        !close_enough(inspect_num_as_double(&n), want_avg, f->sum_abs / (double)f->n_num)) {
        inspect_fmt_double(want_avg, a, sizeof(a));
        inspect_fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
}

/*
 * A summary document (per-field summaries) against the readings' accumulators acc[0..n): every
 * field with numeric readings summarised and right, nothing else summarised. whose says where
 * the readings are, for the messages ("" for the page's own).
 */
static void check_summary_of(struct verifier *v, const char *id, const bson_t *summary,
                             struct field_acc *acc, size_t n, const char *whose) {
    bson_iter_t it;
    bson_t sd;
    for (size_t i = 0; i < n; i++) {
        acc[i].has_summary = false;
    }
    if (!bson_iter_init(&it, summary)) {
        return;
    }
    while (bson_iter_next(&it)) {
        const char *k = bson_iter_key(&it);
        struct field_acc *f = NULL;
        for (size_t i = 0; i < n && f == NULL; i++) {
            f = strcmp(acc[i].name, k) == 0 ? &acc[i] : NULL;
        }
        if (f == NULL || f->n_num == 0) {
            problem(v, id,
                    "summary.%s summarises a field without numeric readings%s (expected no "
                    "summary, found one)",
                    k, whose);
            continue;
        }
        f->has_summary = true;
        if (!sub_document(&it, &sd)) {
            problem(v, id, "summary.%s has the wrong type (expected document, found %s)", k,
                    inspect_type_name(bson_iter_type(&it)));
            continue;
        }
        check_field_summary(v, id, k, f, &sd);
    }
    for (size_t i = 0; i < n; i++) {
        const struct field_acc *f = &acc[i];
        if (f->n_num > 0 && !f->has_summary) {
            problem(v, id,
                    "summary.%s is missing (expected a summary of %" PRId64
                    " numeric readings, found nothing)",
                    f->name, f->n_num);
        }
    }
}

static void check_summary(struct verifier *v, const char *id, const bson_t *summary) {
    check_summary_of(v, id, summary, v->acc, v->n_acc, "");
}

static void group_free(struct group *g) {
    for (size_t i = 0; i < g->n_tot; i++) {
        bson_free((char *)g->tot[i].name);
    }
    bson_free(g->tot);
    for (size_t i = 0; i < g->n_pages; i++) {
        bson_free(g->pages[i].id);
        if (g->pages[i].meta != NULL) {
            bson_destroy(g->pages[i].meta);
        }
    }
    bson_free(g->pages);
    bson_free(g->sensor_id);
    memset(g, 0, sizeof(*g));
}

static int cmp_page(const void *a, const void *b) {
    const struct page_info *x = a, *y = b;
    return (x->page > y->page) - (x->page < y->page);
}

/*
 * The pages of one bucket, all read. They describe one sensor, so they carry the same meta;
 * the lowest page is the reference. One code path writes meta, from the sensor's series key,
 * so equal means byte-equal.
 *
 * They are numbered 0..k without gaps and every page but the last is full.
 * Breaking either is a warning, not a problem: the daemon moves on to page p + 1 when it
 * builds page p's update, so when MongoDB rejects that update for good (quarantined: logged,
 * counted in updates_quarantined, dropped) page p stays short, or never exists, while page
 * p + 1 fills. The readings are lost and counted; every document left is still consistent.
 */
static void match_summary(struct verifier *v);

static void group_finish(struct verifier *v) {
    struct group *g = &v->g;
    if (!g->active) {
        return;
    }
    qsort(g->pages, g->n_pages, sizeof(*g->pages), cmp_page);
    if (v->sums != NULL) {
        match_summary(v);
    }
    const struct page_info *ref = NULL;
    for (size_t i = 0; i < g->n_pages; i++) {
        const struct page_info *p = &g->pages[i];
        if (p->meta == NULL) {
            continue;
        }
        if (ref == NULL) {
            ref = p;
        } else if (!bson_equal(ref->meta, p->meta)) {
            char *want_json = bson_as_relaxed_extended_json(ref->meta, NULL);
            char *found_json = bson_as_relaxed_extended_json(p->meta, NULL);
            problem(v, p->id,
                    "meta differs from that of %s, a page of the same bucket (expected %s, "
                    "found %s)",
                    ref->id, want_json, found_json);
            bson_free(want_json);
            bson_free(found_json);
        }
    }
    int64_t last = g->pages[g->n_pages - 1].page;
    int64_t next = 0;
    for (size_t i = 0; i < g->n_pages; i++) {
        const struct page_info *p = &g->pages[i];
        /* A repeated page number needs a second _id, and that one was reported already. */
        if (p->page < next) {
            continue;
        }
        if (p->page > next) {
            warning(v, p->id,
                    "pages of this bucket are not numbered 0..k (expected page %" PRId64
                    ", found page %" PRId64 ")",
                    next, p->page);
        }
        next = p->page == INT64_MAX ? INT64_MAX : p->page + 1;
        if (p->page != last && p->n_readings < (int64_t)v->s->max_readings) {
            warning(v, p->id,
                    "page is not full but a later page exists (expected %" PRIu32
                    " readings, found %" PRId64 ")",
                    v->s->max_readings, p->n_readings);
        }
    }
    group_free(g);
}

/* Adds a page to the bucket being read (finishing the previous bucket first). */
static void group_add(struct verifier *v, const char *id, const char *sensor_id, int64_t start_ms,
                      int64_t page, int64_t n_readings, const bson_t *meta) {
    struct group *g = &v->g;
    if (g->active && (strcmp(g->sensor_id, sensor_id) != 0 || g->start_ms != start_ms)) {
        group_finish(v);
    }
    if (!g->active) {
        g->active = true;
        g->sensor_id = bson_strdup(sensor_id);
        g->start_ms = start_ms;
    }
    if (g->n_pages == g->cap_pages) {
        g->cap_pages = g->cap_pages ? 2 * g->cap_pages : 8;
        g->pages = bson_realloc(g->pages, g->cap_pages * sizeof(*g->pages));
    }
    g->pages[g->n_pages++] = (struct page_info){page, n_readings, bson_strdup(id),
                                                meta != NULL ? bson_copy(meta) : NULL};
}

static void fmt_span(uint64_t ms, char *buf, size_t cap) {
    if (ms % 3600000 == 0) {
        snprintf(buf, cap, "%" PRIu64 "h", ms / 3600000);
    } else if (ms % 60000 == 0) {
        snprintf(buf, cap, "%" PRIu64 "m", ms / 60000);
    } else if (ms % 1000 == 0) {
        snprintf(buf, cap, "%" PRIu64 "s", ms / 1000);
    } else {
        snprintf(buf, cap, "%" PRIu64 "ms", ms);
    }
}

/* ---- verify --summaries ------------------------------------------------------------------ */

/* The page just checked (its readings in v->acc) counts towards its bucket's totals. */
static void group_fold(struct verifier *v, int64_t n) {
    struct group *g = &v->g;
    g->n_readings += n;
    for (size_t i = 0; i < v->n_acc; i++) {
        const struct field_acc *a = &v->acc[i];
        if (a->n_num == 0) {
            continue;
        }
        struct field_acc *t = NULL;
        for (size_t k = 0; k < g->n_tot && t == NULL; k++) {
            t = strcmp(g->tot[k].name, a->name) == 0 ? &g->tot[k] : NULL;
        }
        if (t == NULL) {
            if (g->n_tot == g->cap_tot) {
                g->cap_tot = g->cap_tot ? 2 * g->cap_tot : 8;
                g->tot = bson_realloc(g->tot, g->cap_tot * sizeof(*g->tot));
            }
            t = &g->tot[g->n_tot++];
            *t = (struct field_acc){.name = bson_strdup(a->name)};
        }
        if (t->n_num == 0 || inspect_num_cmp(&a->min, &t->min) < 0) {
            t->min = a->min;
        }
        if (t->n_num == 0 || inspect_num_cmp(&a->max, &t->max) > 0) {
            t->max = a->max;
        }
        t->sum += a->sum;
        t->comp += a->comp;
        t->sum_abs += a->sum_abs;
        t->n_num += a->n_num;
    }
}

/* Read the next summary document into v->sum_doc (NULL at the end, or after an error, which
 * cmd_verify reports). One without a string sensor_id or a date bucket_start is a problem and
 * skipped. */
static void next_summary(struct verifier *v) {
    const bson_t *doc;
    bson_iter_t it;
    if (v->sum_doc != NULL) {
        bson_destroy(v->sum_doc);
        v->sum_doc = NULL;
    }
    while (!v->sums_done && mongoc_cursor_next(v->sums, &doc)) {
        v->summaries++;
        const char *sensor = NULL;
        if (bson_iter_init_find(&it, doc, "sensor_id") && BSON_ITER_HOLDS_UTF8(&it)) {
            sensor = bson_iter_utf8(&it, NULL);
        }
        if (sensor == NULL || !bson_iter_init_find(&it, doc, "bucket_start") ||
            !BSON_ITER_HOLDS_DATE_TIME(&it)) {
            char *id = bson_iter_init_find(&it, doc, "_id") ? inspect_value_json(&it) : NULL;
            problem(v, id != NULL ? id : "(summary without _id)",
                    "summary document without a string sensor_id and a date bucket_start");
            bson_free(id);
            continue;
        }
        v->sum_doc = bson_copy(doc);
        bson_iter_init_find(&it, v->sum_doc, "sensor_id");
        v->sum_sensor = bson_iter_utf8(&it, NULL);
        bson_iter_init_find(&it, v->sum_doc, "bucket_start");
        v->sum_start = bson_iter_date_time(&it);
        return;
    }
    v->sums_done = true;
}

/* How a summary is named in messages: "summary <sensor_id>|<bucket start, unix s>". */
static void summary_name(char *buf, size_t cap, const char *sensor, int64_t start_ms) {
    snprintf(buf, cap, "summary %s|%" PRId64, sensor, bd_floor_div(start_ms, 1000));
}

/* The summary document v->sum_doc against the totals of the bucket v->g. */
static void check_summary_doc(struct verifier *v) {
    struct group *g = &v->g;
    const bson_t *doc = v->sum_doc;
    char id[BD_BUCKET_ID_MAX + 16], a[64], b[64];
    bson_iter_t it;
    bson_t meta, summary;
    summary_name(id, sizeof(id), g->sensor_id, g->start_ms);
    if (want(v, id, doc, "count", "count", T_INT, "int64", &it) &&
        bson_iter_as_int64(&it) != g->n_readings) {
        problem(v, id,
                "count is not the readings of the bucket's pages (expected %" PRId64
                ", found %" PRId64 ")",
                g->n_readings, bson_iter_as_int64(&it));
    }
    if (want(v, id, doc, "pages", "pages", T_INT, "a number", &it) &&
        bson_iter_as_int64(&it) != (int64_t)g->n_pages) {
        problem(v, id, "pages is wrong (expected %zu, found %" PRId64 ")", g->n_pages,
                bson_iter_as_int64(&it));
    }
    int64_t want_end = g->start_ms + (int64_t)v->s->span_ms - 1;
    if (want(v, id, doc, "bucket_end", "bucket_end", T_BIT(BSON_TYPE_DATE_TIME), "date", &it) &&
        bson_iter_date_time(&it) != want_end) {
        inspect_fmt_time(want_end, a, sizeof(a));
        inspect_fmt_time(bson_iter_date_time(&it), b, sizeof(b));
        problem(v, id, "bucket_end is wrong (expected %s, found %s)", a, b);
    }
    const bson_t *ref = NULL;
    for (size_t i = 0; i < g->n_pages && ref == NULL; i++) {
        ref = g->pages[i].meta;
    }
    if (want(v, id, doc, "meta", "meta", T_BIT(BSON_TYPE_DOCUMENT), "document", &it) &&
        sub_document(&it, &meta) && ref != NULL && !bson_equal(&meta, ref)) {
        problem(v, id, "meta differs from the pages' meta");
    }
    if (want(v, id, doc, "summary", "summary", T_BIT(BSON_TYPE_DOCUMENT), "document", &it) &&
        sub_document(&it, &summary)) {
        check_summary_of(v, id, &summary, g->tot, g->n_tot, " in the bucket's pages");
    }
}

/* Orders (sensor, start) as the server sorts {sensor_id: 1, bucket_start: 1}: strings
 * bytewise (the simple collation), then dates. */
static int cmp_bucket(const char *s1, int64_t t1, const char *s2, int64_t t2) {
    int c = strcmp(s1, s2);
    return c != 0 ? c : (t1 > t2) - (t1 < t2);
}

static void orphan_summary(struct verifier *v) {
    char id[BD_BUCKET_ID_MAX + 16];
    summary_name(id, sizeof(id), v->sum_sensor, v->sum_start);
    warning(v, id, "summary of a bucket without pages (its pages were deleted, e.g. expired)");
}

/* The bucket v->g is complete: find its summary among those read in the same order. */
static void match_summary(struct verifier *v) {
    const struct group *g = &v->g;
    char id[BD_BUCKET_ID_MAX + 16];
    for (;;) {
        if (v->sum_doc == NULL) {
            next_summary(v);
        }
        if (v->sum_doc == NULL) {
            break;
        }
        int c = cmp_bucket(v->sum_sensor, v->sum_start, g->sensor_id, g->start_ms);
        if (c > 0) {
            break;
        }
        if (c == 0) {
            check_summary_doc(v);
            next_summary(v);
            return;
        }
        orphan_summary(v);
        next_summary(v);
    }
    summary_name(id, sizeof(id), g->sensor_id, g->start_ms);
    problem(v, id,
            "no summary document for this bucket in %s (expected one, with %" PRId64
            " readings; bucketd-inspect summaries rebuild recomputes it)",
            v->s->summary_collection, g->n_readings);
}

/* Every invariant of one document; the bucket-wide ones through group_add. -ENOMEM only. */
static int check_document(struct verifier *v, const bson_t *doc) {
    int rc = 0;
    char *id = NULL;
    char *want_id = NULL;
    char a[64], b[64], span_text[32];
    bson_iter_t it, readings_it;
    bson_t meta, summary;
    const char *sensor_id = NULL;
    bool id_is_string = false, has_meta = false, has_start = false, has_end = false;
    bool has_page = false, has_count = false, has_readings = false, has_summary = false;
    int64_t start = 0, end = 0, page = 0, count = 0, n = 0;
    const int64_t span = (int64_t)v->s->span_ms;

    v->documents++;
    v->n_acc = 0;
    memset(v->rk_count, 0, sizeof(v->rk_count));

    if (bson_iter_init_find(&it, doc, "_id") && BSON_ITER_HOLDS_UTF8(&it)) {
        id = bson_strdup(bson_iter_utf8(&it, NULL));
        id_is_string = true;
    } else if (bson_iter_init_find(&it, doc, "_id")) {
        id = inspect_value_json(&it);
        if (id == NULL) {
            id = bson_strdup("(unprintable _id)");
        }
        problem(v, id, "_id has the wrong type (expected string, found %s)",
                inspect_type_name(bson_iter_type(&it)));
    } else {
        id = bson_strdup("(no _id)");
        problem(v, id, "_id is missing (expected string, found nothing)");
    }

    if (want(v, id, doc, "sensor_id", "sensor_id", T_BIT(BSON_TYPE_UTF8), "string", &it)) {
        sensor_id = bson_iter_utf8(&it, NULL);
    }
    if (want(v, id, doc, "meta", "meta", T_BIT(BSON_TYPE_DOCUMENT), "document", &it) &&
        sub_document(&it, &meta)) {
        has_meta = true;
        want(v, id, &meta, "measurement", "meta.measurement", T_BIT(BSON_TYPE_UTF8), "string", &it);
        want(v, id, &meta, "tags", "meta.tags", T_BIT(BSON_TYPE_DOCUMENT), "document", &it);
    }
    if (want(v, id, doc, "bucket_start", "bucket_start", T_BIT(BSON_TYPE_DATE_TIME), "date", &it)) {
        has_start = true;
        start = bson_iter_date_time(&it);
    }
    if (want(v, id, doc, "bucket_end", "bucket_end", T_BIT(BSON_TYPE_DATE_TIME), "date", &it)) {
        has_end = true;
        end = bson_iter_date_time(&it);
    }
    if (want(v, id, doc, "page", "page", T_INT, "int32 or int64", &it)) {
        page = bson_iter_as_int64(&it);
        has_page = page >= 0;
        if (!has_page) {
            problem(v, id, "page is negative (expected a number >= 0, found %" PRId64 ")", page);
        }
    }
    if (want(v, id, doc, "count", "count", T_INT, "int64", &it)) {
        has_count = true;
        count = bson_iter_as_int64(&it);
    }
    if (want(v, id, doc, "readings", "readings", T_BIT(BSON_TYPE_ARRAY), "array", &readings_it)) {
        has_readings = true;
    }
    if (want(v, id, doc, "summary", "summary", T_BIT(BSON_TYPE_DOCUMENT), "document", &it) &&
        sub_document(&it, &summary)) {
        has_summary = true;
    }

    if (sensor_id != NULL && has_start && has_page && page <= UINT32_MAX && id_is_string) {
        /* What the daemon writes: bd_bucket_id() (long sensor ids in their digest form). */
        want_id = bson_malloc(BD_BUCKET_ID_MAX);
        bd_bucket_id(want_id, BD_BUCKET_ID_MAX, sensor_id, start, (uint32_t)page);
        if (strcmp(id, want_id) != 0) {
            problem(v, id,
                    "_id does not match sensor_id, bucket_start and page (expected %s, "
                    "found %s)",
                    want_id, id);
        }
    }
    if (has_start && bd_floor_div(start, span) * span != start) {
        fmt_span(v->s->span_ms, span_text, sizeof(span_text));
        inspect_fmt_time(bd_floor_div(start, span) * span, a, sizeof(a));
        inspect_fmt_time(start, b, sizeof(b));
        problem(v, id, "bucket_start is not aligned to the %s span (expected %s, found %s)",
                span_text, a, b);
    }
    int64_t want_end = 0;
    /* A date near the end of int64's range has no bucket_end: report it, do not overflow. */
    bool end_ok = !__builtin_add_overflow(start, span - 1, &want_end);
    if (has_start && has_end && (!end_ok || end != want_end)) {
        if (end_ok) {
            inspect_fmt_time(want_end, a, sizeof(a));
        } else {
            snprintf(a, sizeof(a), "a date past the BSON range");
        }
        inspect_fmt_time(end, b, sizeof(b));
        problem(v, id, "bucket_end is not bucket_start + span - 1 ms (expected %s, found %s)", a,
                b);
    }

    if (has_readings) {
        bson_iter_t arr;
        if (bson_iter_recurse(&readings_it, &arr)) {
            rc = check_readings(v, id, &arr, has_start && has_end, start, end, &n);
            if (rc < 0) {
                goto out;
            }
        }
        for (int k = 0; k < N_RKINDS; k++) {
            if (v->rk_count[k] > LIST_PER_KIND) {
                inspect_put_safe(id);
                printf(": %" PRIu64 " more %s (not listed)\n", v->rk_count[k] - LIST_PER_KIND,
                       rkind_what[k]);
            }
        }
        v->readings += (uint64_t)n;
        if (has_count && count != n) {
            problem(v, id,
                    "count does not match the number of readings (expected %" PRId64
                    ", found %" PRId64 ")",
                    n, count);
        }
        if (n > (int64_t)v->s->max_readings) {
            problem(v, id,
                    "page holds more readings than max_readings (expected at most %" PRIu32
                    ", found %" PRId64 ")",
                    v->s->max_readings, n);
        }
        if (n == 0) {
            /* Every upsert the daemon sends adds at least one reading. */
            problem(v, id, "page holds no readings (expected at least 1, found 0)");
        }
        if (has_summary) {
            check_summary(v, id, &summary);
        }
    }

    if (sensor_id != NULL && has_start && has_page) {
        group_add(v, id, sensor_id, start, page, n, has_meta ? &meta : NULL);
        if (v->sums != NULL) {
            group_fold(v, n);
        }
    }
out:
    bson_free(want_id);
    bson_free(id);
    return rc;
}

static int cmd_verify(struct conn *c, const struct options *o, const struct settings *s,
                      struct verifier *v, struct bd_err *err) {
    int rc = 0;
    bson_t filter, opts, sort;
    const bson_t *doc;

    bson_init(&filter);
    if (o->given[OPT_SENSOR]) {
        BSON_APPEND_UTF8(&filter, "sensor_id", o->value[OPT_SENSOR]);
    }
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, "sensor_id", 1);
    BSON_APPEND_INT32(&sort, "bucket_start", 1);
    bson_append_document_end(&opts, &sort);
    BSON_APPEND_INT32(&opts, "batchSize", BATCH_SIZE);
    /* Without the daemon's index the server must sort the whole collection itself. */
    BSON_APPEND_BOOL(&opts, "allowDiskUse", true);

    mongoc_cursor_t *cursor = mongoc_collection_find_with_opts(c->coll, &filter, &opts, NULL);
    mongoc_collection_t *sums = NULL;
    if (o->given[OPT_SUMMARIES]) {
        sums = mongoc_client_get_collection(c->client, s->database, s->summary_collection);
        v->sums = mongoc_collection_find_with_opts(sums, &filter, &opts, NULL);
    }
    while (mongoc_cursor_next(cursor, &doc)) {
        rc = check_document(v, doc);
        if (rc < 0) {
            bd_err_set(err, rc, "out of memory");
            goto out;
        }
    }
    rc = inspect_cursor_status(cursor, s, err);
    if (rc < 0) {
        goto out;
    }
    group_finish(v);
    if (v->sums != NULL) {
        if (v->sum_doc == NULL) {
            next_summary(v);
        }
        while (v->sum_doc != NULL) {
            orphan_summary(v);
            next_summary(v);
        }
        rc = inspect_cursor_status(v->sums, s, err);
    }
out:
    if (v->sums != NULL) {
        mongoc_cursor_destroy(v->sums);
        v->sums = NULL;
    }
    mongoc_collection_destroy(sums);
    mongoc_cursor_destroy(cursor);
    bson_destroy(&opts);
    bson_destroy(&filter);
    return rc;
}

static void verifier_close(struct verifier *v) {
    /* A bucket still open here was cut short by an error: free it unchecked. */
    group_free(&v->g);
    if (v->sum_doc != NULL) {
        bson_destroy(v->sum_doc);
    }
    free(v->acc);
}

int inspect_verify(struct conn *c, const struct options *o, const struct settings *s, int *status,
                   struct bd_err *err) {
    struct verifier v = {.s = s};
    int rc = cmd_verify(c, o, s, &v, err);
    if (rc == 0) {
        printf("verified %" PRIu64 " documents, %" PRIu64 " readings", v.documents, v.readings);
        if (o->given[OPT_SUMMARIES]) {
            printf(", %" PRIu64 " summaries", v.summaries);
        }
        printf(": %" PRIu64 " problems", v.problems);
        if (v.warnings > 0) {
            printf(", %" PRIu64 " warnings", v.warnings);
        }
        putchar('\n');
        *status = v.problems > 0 ? EXIT_PROBLEMS : 0;
    }
    verifier_close(&v);
    return rc;
}
