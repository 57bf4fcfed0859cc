/*
 * Spool replay's decisions (src/replay.c), driven directly: records are built the way the
 * flusher spools a batch (deltas of real sensors, bd_delta_build_update, bd_replay_buf_add),
 * parsed back with bd_replay_load and written with bd_replay_attempt against the scripted store
 * of fake_store.h, on the test thread. For each answer MongoDB can give: what is stored, under
 * which sequence number, what is quarantined into the dead-letter file, and what is counted.
 * Expected values come from the readings each test put into its record.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/deadletter.h"
#include "bucketd/replay.h"
#include "bucketd/sensor.h"
#include "bucketd/summaries.h"

/* The scripted store has helpers only test_flusher uses (holding a bulk on another thread). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "fake_store.h"
#pragma GCC diagnostic pop

#define MS BD_NS_PER_MS
#define HOUR_MS INT64_C(3600000)
/* As src/replay.c: attempts of a refused update, duplicate-key answers without our number. */
#define MAX_REFUSALS 8
#define MAX_DUP_CHECKS 3
#define SEQ UINT64_C(7)
#define MAX_SPECS 16

static struct bd_config cfg;
static struct bd_stats stats;
static struct bd_sensor_table *table;
static struct fake_store fs;
static struct bd_deadletter *dead;
static struct bd_summaries *sums;
static struct bd_settle settle; /* what the flusher shares with its replay */
static struct bd_replay_env env;
static uint32_t record_flags; /* the flags build_record gives every update */
static char dir[64];
static int64_t now_ms;  /* wall clock of the test */
static int64_t hour_ms; /* start of the bucket the readings go to: the last hour */

#define STAT(name) BD_STAT_GET(&stats, name)

/* The flusher runs store calls on its I/O thread; here they run on the caller's. */
static void run_here(void *arg, bd_io_fn fn, void *fn_arg) {
    (void)arg;
    fn(fn_arg);
}

static void setup(void) {
    struct bd_err err = {0};
    bd_config_defaults(&cfg);
    snprintf(cfg.writer_id, sizeof(cfg.writer_id), "t1");
    cfg.limits.max_sensors = 64;
    cfg.limits.memory = UINT64_C(64) << 20;
    cfg.limits.max_fields = 16;
    snprintf(dir, sizeof(dir), "/tmp/bd-replay-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cfg.spool.dir, sizeof(cfg.spool.dir), "%s", dir);
    now_ms = bd_now_ns() / MS;
    /* The hour before this one: however far into the hour the test runs, no reading is
     * ahead of the clock (900 readings a second apart must not pass buckets.max_future). */
    hour_ms = (now_ms / HOUR_MS - 1) * HOUR_MS;
    record_flags = 0;
    memset(&stats, 0, sizeof(stats));
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0, "%s", err.msg);
    fake_init(&fs, cfg.writer_id);
    cr_assert_eq(bd_deadletter_open(&dead, dir, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_summaries_new(&sums), 0);
    settle = (struct bd_settle){.store = &fs.base,
                                .run = run_here,
                                .dead = dead,
                                .stats = &stats,
                                .cfg = &cfg,
                                .sums = NULL};
    bd_settle_init(&settle);
    env = (struct bd_replay_env){.settle = &settle};
}

static void teardown(void) {
    bd_alloc_fail_after(-1, 0);
    bd_summaries_free(sums);
    bd_deadletter_close(dead);
    bd_sensor_table_free(table);
    fake_free(&fs);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(replay, .init = setup, .fini = teardown);

/* A fresh collection and fresh counters (the sensors and the dead-letter file stay). */
static void reset_store(void) {
    fake_free(&fs);
    fake_init(&fs, cfg.writer_id);
    memset(&stats, 0, sizeof(stats));
}

static void remove_dead_letters(void) {
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
    unlink(path);
}

/* ---- records, built as the flusher builds them ---------------------------------------------- */

/* One update of a record: n readings of sensor id in the bucket `hour` hours from hour_ms. */
struct spec {
    const char *id;
    uint32_t n;
    int64_t hour;
};

struct record {
    struct bd_replay_buf buf;
    struct bd_spool_record rec;
    size_t ends[MAX_SPECS]; /* payload offset after each update */
    uint32_t grown;         /* times the payload had to grow (with fail_growth) */
    uint32_t n;
    uint64_t readings;
};

/* Offsets inside the first update of a record. */
#define ID_LEN_AT 20
#define ID_AT 24

/* build_record: every growth of the payload fails once first. */
static bool fail_growth;

static int64_t spec_start(const struct spec *sp) {
    return hour_ms + sp->hour * HOUR_MS;
}

static struct bd_str S(const char *s) {
    return (struct bd_str){s, strlen(s)};
}

/* Accept every spec's readings through the sensor table, drain them from the sensors' queues
 * into one delta per spec, and encode each delta's update (sequence seq) into the record. */
static void
build_record(struct record *r, const struct spec *sp, uint32_t n, uint64_t seq) {
    cr_assert_leq(n, MAX_SPECS);
    memset(r, 0, sizeof(*r));
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t j = 0; j < sp[i].n; j++) {
            struct bd_point pt;
            memset(&pt, 0, sizeof(pt));
            pt.series_key = S(sp[i].id);
            pt.name = S(sp[i].id);
            pt.has_time = true;
            pt.time_ns = (spec_start(&sp[i]) + 1000 * (int64_t)j + 500) * MS;
            pt.fields[0].key = S("v");
            pt.fields[0].kind = BD_VAL_FLOAT;
            pt.fields[0].v.f = i * 1000.0 + j;
            pt.n_fields = 1;
            cr_assert_eq(bd_sensor_table_accept(table, &pt, now_ms * MS), 0, "%s refused",
                         sp[i].id);
        }
    }
    bd_sensor_table_publish(table);
    struct bd_delta d[MAX_SPECS];
    bool have[MAX_SPECS] = {false};
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_dirty(table)) != NULL) {
        int64_t ts;
        struct bd_reading_value vals[BD_SENSOR_MAX_FIELDS];
        uint32_t n_vals, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &n_vals)) > 0) {
            int64_t start = bd_bucket_start_ms(ts, cfg.buckets.span_ms);
            uint32_t i = 0;
            while (i < n && (strcmp(sp[i].id, s->id_buf) != 0 || spec_start(&sp[i]) != start)) {
                i++;
            }
            cr_assert_lt(i, n, "a reading of %s nobody sent", s->id_buf);
            if (!have[i]) {
                bd_delta_init(&d[i], s, start, 0);
                have[i] = true;
            }
            cr_assert_eq(bd_delta_add(&d[i], ts, vals, n_vals), 0);
            bd_sensor_consume(s, cells);
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        cr_assert(have[i], "no reading of %s reached its queue", sp[i].id);
        cr_assert_eq(d[i].n_readings, sp[i].n);
        char key[160];
        snprintf(key, sizeof(key), BD_WRITER_KEY_PREFIX "%s", cfg.writer_id);
        bson_t sel, upd;
        cr_assert_eq(bd_delta_build_update(&d[i], cfg.buckets.span_ms, key, seq, &sel, &upd), 0);
        size_t need = ID_AT + strlen(sp[i].id) + sel.len + upd.len;
        if (fail_growth && r->buf.len + need > r->buf.cap) {
            /* The payload must grow: that failing leaves it exactly as it was. */
            struct bd_replay_buf before = r->buf;
            bd_alloc_fail_after(0, 0);
            int rc = bd_replay_buf_add(&r->buf, sp[i].id, d[i].start_ms, d[i].page, d[i].n_readings,
                                       record_flags, &sel, &upd);
            bd_alloc_fail_after(-1, 0);
            cr_assert_eq(rc, -ENOMEM);
            cr_assert(memcmp(&before, &r->buf, sizeof(before)) == 0, "update %u", i);
            r->grown++;
        }
        cr_assert_eq(bd_replay_buf_add(&r->buf, sp[i].id, d[i].start_ms, d[i].page, d[i].n_readings,
                                       record_flags, &sel, &upd),
                     0);
        bson_destroy(&sel);
        bson_destroy(&upd);
        bd_delta_close(&d[i]);
        cr_assert_geq(r->buf.cap, r->buf.len, "the buffer holds what it says");
        r->ends[i] = r->buf.len;
        r->readings += sp[i].n;
    }
    r->n = n;
    cr_assert_eq(r->buf.n_updates, n);
    cr_assert_eq(r->buf.n_readings, r->readings);
    r->rec = (struct bd_spool_record){.id = 42,
                                      .seq = seq,
                                      .n_readings = r->buf.n_readings,
                                      .data = r->buf.data,
                                      .len = r->buf.len};
}

static void free_record(struct record *r) {
    bd_replay_buf_close(&r->buf);
}

static struct bd_replay *load(const struct record *r) {
    struct bd_err err = {0};
    struct bd_replay *rp = NULL;
    cr_assert_eq(bd_replay_load(&rp, &r->rec, &err), 0, "%s", err.msg);
    cr_assert_not_null(rp);
    return rp;
}

static char last_msg[512];

static bool attempt(struct bd_replay *rp, enum bd_bulk_cause *cause) {
    bool ok = bd_replay_attempt(rp, &env, now_ms, cause, last_msg, sizeof(last_msg));
    if (!ok) {
        cr_assert_neq(*cause, BD_CAUSE_NONE, "a failed attempt says why");
        cr_assert_neq(last_msg[0], '\0', "a failed attempt has a message");
    }
    return ok;
}

/* The stored page of spec sp (page 0), or NULL. */
static struct fake_doc *page_of(const struct spec *sp) {
    char id[BD_BUCKET_ID_MAX];
    bd_bucket_id(id, sizeof(id), sp->id, spec_start(sp), 0);
    return fake_find(&fs, id);
}

/* Readings stored in spec sp's bucket (every page of it). */
static int64_t stored(const struct spec *sp) {
    int64_t n = 0;
    for (uint32_t i = 0; i < fs.n_docs; i++) {
        if (strcmp(fs.docs[i].sensor_id, sp->id) == 0 && fs.docs[i].start_ms == spec_start(sp)) {
            n += fs.docs[i].count;
        }
    }
    return n;
}

/* ---- the dead-letter file ------------------------------------------------------------------- */

struct dead_line {
    char bucket_id[BD_BUCKET_ID_MAX];
    char message[256];
    int64_t n_readings, code, seq;
};

/* Parse every line of the dead-letter file into out (at most max); the number of lines. */
static int read_dead(struct dead_line *out, int max) {
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
    FILE *fp = fopen(path, "r");
    if (fp == NULL) {
        return 0;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int n = 0;
    while ((len = getline(&line, &cap, fp)) > 0) {
        cr_assert_eq(line[len - 1], '\n', "every line whole");
        bson_error_t berr;
        bson_t *doc = bson_new_from_json((const uint8_t *)line, len - 1, &berr);
        cr_assert_not_null(doc, "line %d: %s", n + 1, berr.message);
        if (n < max) {
            struct dead_line *dl = &out[n];
            memset(dl, 0, sizeof(*dl));
            bson_iter_t it;
            cr_assert(bson_iter_init_find(&it, doc, "bucket_id") && BSON_ITER_HOLDS_UTF8(&it));
            snprintf(dl->bucket_id, sizeof(dl->bucket_id), "%s", bson_iter_utf8(&it, NULL));
            cr_assert(bson_iter_init_find(&it, doc, "message") && BSON_ITER_HOLDS_UTF8(&it));
            snprintf(dl->message, sizeof(dl->message), "%s", bson_iter_utf8(&it, NULL));
            cr_assert(bson_iter_init_find(&it, doc, "n_readings"));
            dl->n_readings = bson_iter_as_int64(&it);
            cr_assert(bson_iter_init_find(&it, doc, "code"));
            dl->code = bson_iter_as_int64(&it);
            cr_assert(bson_iter_init_find(&it, doc, "seq"));
            dl->seq = bson_iter_as_int64(&it);
            cr_assert(bson_iter_init_find(&it, doc, "filter") && BSON_ITER_HOLDS_DOCUMENT(&it));
            cr_assert(bson_iter_init_find(&it, doc, "update") && BSON_ITER_HOLDS_ARRAY(&it));
        }
        bson_destroy(doc);
        n++;
    }
    free(line);
    fclose(fp);
    return n;
}

/* The dead-letter line of spec sp's update, with code and readings as expected. */
static void assert_dead_letter(const struct dead_line *dl, const struct spec *sp, int64_t code) {
    char id[BD_BUCKET_ID_MAX];
    bd_bucket_id(id, sizeof(id), sp->id, spec_start(sp), 0);
    cr_assert_str_eq(dl->bucket_id, id);
    cr_assert_eq(dl->n_readings, sp->n, "%s", id);
    cr_assert_eq(dl->code, code, "%s", id);
    cr_assert_eq(dl->seq, (int64_t)SEQ, "%s", id);
}

/* ---- 1. applied whole, and again after a crash: exactly once -------------------------------- */

static const struct spec three[] = {
    {"m,s=0", 5, 0},
    {"m,s=1", 3, 0},
    {"m,s=0", 2, -1}, /* the same sensor, the hour before: another bucket */
};

static void applied_then_replayed(uint32_t max_updates) {
    cfg.flush.max_updates = max_updates;
    settle.sums = sums;
    struct record r;
    build_record(&r, three, 3, SEQ);
    struct bd_replay *rp = load(&r);
    cr_assert_eq(bd_replay_seq(rp), SEQ);
    cr_assert_eq(bd_replay_pending_readings(rp), 10);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    cr_assert_eq(cause, BD_CAUSE_NONE);
    uint32_t bulks = (3 + max_updates - 1) / max_updates;
    cr_assert_eq(fs.bulks, bulks);
    for (uint32_t b = 0; b < bulks; b++) {
        cr_assert_eq(fs.bulk_sizes[b], b + 1 < bulks ? max_updates : 3 - b * max_updates);
        cr_assert_eq(fs.seqs[b], SEQ);
    }
    for (int i = 0; i < 3; i++) {
        struct fake_doc *d = page_of(&three[i]);
        cr_assert_not_null(d, "%s hour %" PRId64, three[i].id, three[i].hour);
        cr_assert_eq(d->count, three[i].n);
        cr_assert_eq(d->wseq, SEQ, "the record's sequence on the page");
        cr_assert_eq(d->updates, 1);
    }
    cr_assert_eq(fs.n_docs, 3);
    cr_assert_eq(STAT(readings_flushed), 10);
    cr_assert_eq(STAT(updates_sent), 3);
    cr_assert_eq(STAT(bulk_writes), bulks);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(bd_replay_pending_readings(rp), 0);
    cr_assert_eq(bd_summaries_waiting(sums), 3, "every bucket written is marked");
    bd_replay_free(rp);

    /* A crash came before the record was acknowledged: the next start replays it. */
    rp = load(&r);
    cr_assert_eq(bd_replay_pending_readings(rp), 10);
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    for (int i = 0; i < 3; i++) {
        struct fake_doc *d = page_of(&three[i]);
        cr_assert_eq(d->count, three[i].n, "nothing applied twice");
        cr_assert_eq(d->updates, 1, "nothing applied twice");
        cr_assert_eq(d->wseq, SEQ);
    }
    cr_assert_eq(fs.n_docs, 3);
    cr_assert_eq(STAT(updates_already_applied), 3, "proved applied by the page look-up");
    cr_assert_geq(STAT(page_lookups), 1);
    cr_assert_eq(STAT(readings_flushed), 20, "the replay settles the record's 10 again");
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(read_dead(NULL, 0), 0);
    cr_assert_eq(bd_replay_pending_readings(rp), 0);
    bd_replay_free(rp);
    free_record(&r);
}

Test(replay, a_record_is_applied_whole_and_a_replay_of_it_applies_nothing_twice) {
    applied_then_replayed(1000);
}

Test(replay, a_record_is_sent_in_bulks_of_max_updates) {
    applied_then_replayed(2);
}

Test(replay, a_record_is_sent_one_update_per_bulk_at_max_updates_1) {
    applied_then_replayed(1);
}

/* ---- 2. a permanent refusal ------------------------------------------------------------------ */

static const struct spec four[] = {
    {"m,s=0", 1, 0}, {"m,s=1", 2, 0}, {"m,s=2", 3, 0}, {"m,s=3", 4, 0}};

static const struct spec poisoned[] = {{"m,s=0", 4, 0}, {"m,s=1", 4, 0}, {"m,s=2", 4, 0}};

Test(replay, a_permanent_refusal_quarantines_one_update_at_once_and_stores_the_rest) {
    fs.poison = "m,s=1";
    struct record r;
    build_record(&r, poisoned, 3, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause), "settled: two stored, one quarantined");
    cr_assert_eq(cause, BD_CAUSE_SERVER, "the bulk had a write error");
    cr_assert_eq(fs.bulks, 1, "not retried");
    cr_assert_eq(stored(&poisoned[0]), 4);
    cr_assert_eq(stored(&poisoned[1]), 0);
    cr_assert_eq(stored(&poisoned[2]), 4);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(readings_flushed), 8);
    cr_assert_eq(STAT(deadletter_write_errors), 0);
    cr_assert_eq(bd_replay_pending_readings(rp), 0);
    struct dead_line dl[2];
    cr_assert_eq(read_dead(dl, 2), 1);
    assert_dead_letter(&dl[0], &poisoned[1], 121);
    cr_assert_str_eq(dl[0].message, "Document failed validation");
    bd_replay_free(rp);
    free_record(&r);
}

Test(replay, without_a_dead_letter_file_a_quarantine_is_still_counted) {
    settle.dead = NULL;
    fs.poison = "m,s=2";
    struct record r;
    build_record(&r, poisoned, 3, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(stored(&poisoned[0]) + stored(&poisoned[1]), 8);
    cr_assert_eq(stored(&poisoned[2]), 0);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(deadletter_write_errors), 0, "no file: nothing failed to write");
    cr_assert_eq(read_dead(NULL, 0), 0);
    bd_replay_free(rp);
    free_record(&r);
}

/* The flusher's limit on quarantine lines (five each ten seconds): a replay that quarantines
 * many updates in a row logs a few of them, and counts every one. */
Test(replay, quarantines_are_logged_rate_limited_and_all_counted) {
    enum { RECORDS = 8, LIMIT = 5 };
    fs.poison = "m,s=1";
    cr_redirect_stderr();
    for (int k = 0; k < RECORDS; k++) {
        struct record r;
        build_record(&r, poisoned, 3, SEQ + (uint64_t)k);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        cr_assert(attempt(rp, &cause), "record %d settled", k);
        bd_replay_free(rp);
        free_record(&r);
    }
    fflush(stderr);
    FILE *log = cr_get_redirected_stderr();
    char line[2048];
    int logged = 0;
    while (fgets(line, sizeof(line), log) != NULL) {
        logged += strstr(line, "MongoDB rejected the spooled update of bucket") != NULL;
    }
    cr_assert_eq(STAT(updates_quarantined), RECORDS, "every quarantine counted");
    cr_assert_eq(read_dead(NULL, 0), RECORDS, "and kept in the dead-letter file");
    cr_assert_eq(logged, LIMIT, "%d quarantine lines logged", logged);
}

/* ---- 10. the dead-letter file at its cap ----------------------------------------------------- */

Test(replay, a_quarantined_update_the_dead_letter_file_cannot_keep_is_counted) {
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
    FILE *fp = fopen(path, "w"); /* sparse, its last line whole */
    cr_assert_not_null(fp);
    cr_assert_eq(fseeko(fp, (off_t)BD_DEADLETTER_MAX_BYTES - 1, SEEK_SET), 0);
    cr_assert_eq(fputc('\n', fp), '\n');
    cr_assert_eq(fclose(fp), 0);
    fs.poison = "m,s=1";
    struct record r;
    build_record(&r, poisoned, 3, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(stored(&poisoned[0]), 4);
    cr_assert_eq(stored(&poisoned[2]), 4);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(deadletter_write_errors), 1);
    cr_assert_eq(STAT(deadletter_dropped_readings), 4);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((uint64_t)st.st_size, BD_DEADLETTER_MAX_BYTES, "nothing appended");
    bd_replay_free(rp);
    free_record(&r);
}

/* ---- 3. refusals: bounded, transient and deployment errors: never quarantined ---------------- */

enum refusal_how {
    BY_TOO_LARGE,   /* one sensor's update answered 17420 */
    BY_WRITE_ERROR, /* every update answered with its own writeErrors entry (refuse_all) */
    BY_COMMAND,     /* the whole command refused (FAULT_CMD_ERROR) */
};

struct refusal {
    const char *name;
    enum refusal_how how;
    int32_t code;
    bool bounded; /* quarantined at the MAX_REFUSALS-th attempt; else retried without limit */
    const char *message; /* the message kept in the dead-letter file */
};

static const struct refusal refusals[] = {
    {"too large", BY_TOO_LARGE, 17420, true, "Document to upsert is too large"},
    {"Atlas refusal", BY_WRITE_ERROR, 8000, true, "refused by the deployment"},
    {"command refusal (BadValue)", BY_COMMAND, 2, true, "command refused (2)"},
    {"per-update transient", BY_WRITE_ERROR, 91, false, NULL},
    {"command transient", BY_COMMAND, 91, false, NULL},
    {"per-update deployment error", BY_WRITE_ERROR, 13, false, NULL},
    {"command deployment error", BY_COMMAND, 61, false, NULL},
};

Test(replay, refusals_are_bounded_and_transient_or_deployment_errors_are_retried_forever) {
    for (size_t c = 0; c < BD_ARRAY_LEN(refusals); c++) {
        const struct refusal *rf = &refusals[c];
        reset_store();
        remove_dead_letters();
        bool hit[3] = {rf->how != BY_TOO_LARGE, true, rf->how != BY_TOO_LARGE};
        uint64_t hit_readings = 0;
        for (int i = 0; i < 3; i++) {
            hit_readings += hit[i] ? poisoned[i].n : 0;
        }
        uint32_t tries = rf->bounded ? MAX_REFUSALS : 3 * MAX_REFUSALS;
        if (rf->how == BY_TOO_LARGE) {
            fs.too_large = "m,s=1";
        } else if (rf->how == BY_WRITE_ERROR) {
            fs.refuse_all = rf->code;
        } else {
            for (uint32_t k = 0; k < tries; k++) {
                fake_script(&fs, FAULT_CMD_ERROR, rf->code);
            }
        }
        struct record r;
        build_record(&r, poisoned, 3, SEQ);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        for (uint32_t k = 1; k < tries; k++) {
            cr_assert_not(attempt(rp, &cause), "%s: attempt %u", rf->name, k);
            cr_assert_eq(cause, BD_CAUSE_SERVER, "%s", rf->name);
            cr_assert_eq(STAT(updates_quarantined), 0, "%s: attempt %u", rf->name, k);
            cr_assert_eq(bd_replay_pending_readings(rp), hit_readings, "%s", rf->name);
        }
        bool ok = attempt(rp, &cause);
        cr_assert_eq(fs.bulks, tries, "%s: one bulk per attempt", rf->name);
        cr_assert_eq(STAT(readings_flushed), 12 - hit_readings, "%s", rf->name);
        if (rf->bounded) {
            cr_assert(ok, "%s: settled by quarantine at attempt %u", rf->name, tries);
            cr_assert_eq(STAT(updates_quarantined), hit[0] + hit[1] + hit[2], "%s", rf->name);
            cr_assert_eq(STAT(readings_quarantined), hit_readings, "%s", rf->name);
            struct dead_line dl[3];
            int n = read_dead(dl, 3);
            cr_assert_eq(n, hit[0] + hit[1] + hit[2], "%s", rf->name);
            for (int i = 0, k = 0; i < 3; i++) {
                if (hit[i]) {
                    assert_dead_letter(&dl[k], &poisoned[i], rf->code);
                    cr_assert_str_eq(dl[k].message, rf->message, "%s", rf->name);
                    k++;
                }
            }
            for (int i = 0; i < 3; i++) {
                cr_assert_eq(stored(&poisoned[i]), hit[i] ? 0 : 4, "%s", rf->name);
            }
        } else {
            cr_assert_not(ok, "%s: never given up", rf->name);
            cr_assert_eq(cause, BD_CAUSE_SERVER, "%s", rf->name);
            cr_assert_eq(STAT(updates_quarantined), 0, "%s", rf->name);
            cr_assert_eq(read_dead(NULL, 0), 0, "%s", rf->name);
            cr_assert_eq(bd_replay_pending_readings(rp), 12, "%s", rf->name);
            /* The deployment recovers: every reading stored once. */
            fs.refuse_all = 0;
            cr_assert(attempt(rp, &cause), "%s: %s", rf->name, last_msg);
            for (int i = 0; i < 3; i++) {
                cr_assert_eq(stored(&poisoned[i]), 4, "%s", rf->name);
                cr_assert_eq(page_of(&poisoned[i])->updates, 1, "%s", rf->name);
            }
            cr_assert_eq(STAT(readings_flushed), 12, "%s", rf->name);
        }
        cr_assert_eq(bd_replay_pending_readings(rp), 0, "%s", rf->name);
        bd_replay_free(rp);
        free_record(&r);
    }
}

/* ---- 4. the driver refusing a bulk client-side: bisected ------------------------------------- */

struct bisect_case {
    uint32_t max_updates, n, client_max;
    uint32_t sizes[8]; /* the bulk calls, in order (0 ends) */
};

static const struct bisect_case bisections[] = {
    {8, 8, 2, {8, 4, 2, 2, 2, 2}},
    {7, 7, 3, {7, 3, 3, 1}},
    {8, 5, 1, {5, 2, 1, 1, 1, 1, 1}},
    {4, 6, 3, {4, 2, 2, 2}}, /* the halved size stays for the rest of the record */
};

static const char *const sensor_ids[] = {"m,s=0", "m,s=1", "m,s=2", "m,s=3",
                                         "m,s=4", "m,s=5", "m,s=6", "m,s=7"};

static uint32_t make_specs(struct spec *sp, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        sp[i] = (struct spec){sensor_ids[i], i + 1, 0};
    }
    return n * (n + 1) / 2;
}

Test(replay, a_bulk_the_driver_refuses_is_bisected_until_the_bulks_pass) {
    for (size_t c = 0; c < BD_ARRAY_LEN(bisections); c++) {
        const struct bisect_case *bc = &bisections[c];
        reset_store();
        cfg.flush.max_updates = bc->max_updates;
        fs.client_max_ops = bc->client_max;
        struct spec sp[8];
        uint32_t total = make_specs(sp, bc->n);
        struct record r;
        build_record(&r, sp, bc->n, SEQ);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        cr_assert(attempt(rp, &cause), "case %zu: %s", c, last_msg);
        uint32_t calls = 0, passed = 0;
        while (calls < 8 && bc->sizes[calls] != 0) {
            cr_assert_eq(fs.bulk_sizes[calls], bc->sizes[calls], "case %zu, call %u", c, calls);
            passed += bc->sizes[calls] <= bc->client_max;
            calls++;
        }
        cr_assert_eq(fs.bulks, calls, "case %zu", c);
        for (uint32_t i = 0; i < bc->n; i++) {
            cr_assert_eq(stored(&sp[i]), sp[i].n, "case %zu, %s", c, sp[i].id);
            cr_assert_eq(page_of(&sp[i])->updates, 1);
        }
        cr_assert_eq(STAT(readings_flushed), total);
        cr_assert_eq(STAT(bulk_writes), passed, "refused bulks were never sent");
        cr_assert_eq(STAT(updates_sent), bc->n);
        cr_assert_eq(STAT(updates_quarantined), 0);
        bd_replay_free(rp);
        free_record(&r);
    }
}

/* Bisection goes on from where it was after an attempt that failed for another reason. */
Test(replay, the_halved_bulk_size_holds_across_attempts) {
    cfg.flush.max_updates = 8;
    fs.client_max_ops = 2;
    fake_script(&fs, FAULT_NONE, 0);        /* 8: refused by the driver */
    fake_script(&fs, FAULT_NONE, 0);        /* 4: refused by the driver */
    fake_script(&fs, FAULT_UNREACHABLE, 0); /* 2: no server */
    struct spec sp[8];
    uint32_t total = make_specs(sp, 8);
    struct record r;
    build_record(&r, sp, 8, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(cause, BD_CAUSE_UNREACHABLE);
    cr_assert_eq(fs.bulks, 3);
    cr_assert_eq(fs.n_docs, 0);
    cr_assert_eq(bd_replay_pending_readings(rp), total);
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    cr_assert_eq(fs.bulks, 7, "four bulks of two, none of eight again");
    for (uint32_t b = 3; b < 7; b++) {
        cr_assert_eq(fs.bulk_sizes[b], 2);
    }
    for (uint32_t i = 0; i < 8; i++) {
        cr_assert_eq(stored(&sp[i]), sp[i].n);
    }
    cr_assert_eq(STAT(readings_flushed), total);
    bd_replay_free(rp);
    free_record(&r);
}

/* A single update the driver refuses is refused for good: quarantined, the rest stored. */
Test(replay, a_single_update_the_driver_refuses_is_quarantined) {
    cfg.flush.max_updates = 2;
    fake_script(&fs, FAULT_CLIENT_LARGE, 0); /* both */
    fake_script(&fs, FAULT_CLIENT_LARGE, 0); /* the first alone */
    static const struct spec two[] = {{"m,s=0", 3, 0}, {"m,s=1", 2, 0}};
    struct record r;
    build_record(&r, two, 2, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(cause, BD_CAUSE_CLIENT);
    cr_assert_eq(fs.bulks, 3);
    cr_assert_eq(fs.bulk_sizes[0], 2);
    cr_assert_eq(fs.bulk_sizes[1], 1);
    cr_assert_eq(fs.bulk_sizes[2], 1);
    cr_assert_eq(stored(&two[0]), 0);
    cr_assert_eq(stored(&two[1]), 2);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 3);
    cr_assert_eq(STAT(readings_flushed), 2);
    cr_assert_eq(STAT(bulk_writes), 1);
    struct dead_line dl[2];
    cr_assert_eq(read_dead(dl, 2), 1);
    assert_dead_letter(&dl[0], &two[0], MONGOC_ERROR_BSON_INVALID);
    cr_assert_str_eq(dl[0].message, "Document 0 is too large for the cluster");
    bd_replay_free(rp);
    free_record(&r);
}

/* The driver ran part of a split bulk, then refused a document of the next command client-side:
 * not bisected (the server executed some of it: nothing says which), every update sent again,
 * the applied ones proved so by the page look-up. */
Test(replay, a_client_refusal_after_part_of_the_bulk_ran_sends_it_again_whole) {
    cfg.flush.max_updates = 4;
    fake_script(&fs, FAULT_CLIENT_PARTIAL, 0);
    struct record r;
    build_record(&r, four, 4, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(cause, BD_CAUSE_CLIENT);
    cr_assert_eq(fs.bulks, 1);
    cr_assert_eq(stored(&four[0]) + stored(&four[1]), 3, "the first command ran");
    cr_assert_eq(stored(&four[2]) + stored(&four[3]), 0);
    cr_assert_eq(bd_replay_pending_readings(rp), 10, "nothing taken as settled");
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(updates_sent), 2, "the first command's two updates reached the server");
    cr_assert_eq(STAT(bulk_writes), 1);
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    cr_assert_eq(fs.bulks, 2);
    cr_assert_eq(STAT(updates_sent), 2 + 4);
    cr_assert_eq(fs.bulk_sizes[1], 4, "sent again whole, not halved");
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(stored(&four[i]), four[i].n, "%s", four[i].id);
        cr_assert_eq(page_of(&four[i])->updates, 1, "%s", four[i].id);
    }
    cr_assert_eq(STAT(updates_already_applied), 2);
    cr_assert_eq(STAT(readings_flushed), 10);
    cr_assert_eq(STAT(updates_quarantined), 0);
    bd_replay_free(rp);
    free_record(&r);
}

/* The driver split the bulk of four: the first command answered a duplicate key for the first
 * update (another writer's insert raced it) and applied the second; the next command failed
 * whole and applied nothing, and mongoc returned the duplicate key as the bulk's error. Its
 * counts answer for two updates of four, so which of the three without an entry of their own
 * ran is unknown: nothing is counted flushed, all four are sent again under the record's
 * number, the one applied proves so by its page, and each page is applied once. */
Test(replay, a_split_bulk_whose_second_command_failed_leaves_its_updates_pending) {
    static const int32_t codes[] = {11600, 13, 0 /* the connection failed */};
    for (size_t c = 0; c < BD_ARRAY_LEN(codes); c++) {
        reset_store();
        cfg.flush.max_updates = 4;
        fake_script(&fs, FAULT_SPLIT_FAILED, codes[c]);
        fs.races = 1; /* the first inserting upsert: four[0]'s, in the first command */
        struct record r;
        build_record(&r, four, 4, SEQ);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        cr_assert_not(attempt(rp, &cause), "code %d", codes[c]);
        cr_assert_eq(cause, BD_CAUSE_SERVER, "code %d", codes[c]);
        cr_assert_eq(stored(&four[0]), 0, "code %d: the racing insert holds nothing of ours",
                     codes[c]);
        cr_assert_eq(stored(&four[1]), four[1].n, "code %d: the first command ran", codes[c]);
        cr_assert_eq(stored(&four[2]) + stored(&four[3]), 0, "code %d: never applied", codes[c]);
        cr_assert_eq(STAT(readings_flushed), 0, "code %d: nothing known applied", codes[c]);
        cr_assert_eq(bd_replay_pending_readings(rp), r.readings, "code %d", codes[c]);
        cr_assert(attempt(rp, &cause), "code %d: %s", codes[c], last_msg);
        cr_assert_eq(fs.bulks, 2, "code %d", codes[c]);
        cr_assert_eq(fs.bulk_sizes[1], 4, "code %d", codes[c]);
        cr_assert_eq(fs.seqs[1], SEQ, "code %d", codes[c]);
        uint64_t total = 0;
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(stored(&four[i]), four[i].n, "code %d: %s", codes[c], four[i].id);
            cr_assert_eq(page_of(&four[i])->updates, 1, "code %d: %s", codes[c], four[i].id);
            cr_assert_eq(page_of(&four[i])->wseq, SEQ, "code %d", codes[c]);
            total += four[i].n;
        }
        cr_assert_eq(STAT(readings_flushed), total, "code %d", codes[c]);
        cr_assert_eq(STAT(updates_already_applied), 1, "code %d: four[1]'s", codes[c]);
        cr_assert_eq(STAT(updates_quarantined), 0, "code %d", codes[c]);
        cr_assert_eq(STAT(writer_conflicts), 0, "code %d", codes[c]);
        cr_assert_eq(bd_replay_pending_readings(rp), 0, "code %d", codes[c]);
        bd_replay_free(rp);
        free_record(&r);
    }
}

/* ---- 5. duplicate keys ----------------------------------------------------------------------- */

static const struct spec pair[] = {{"m,s=0", 3, 0}, {"m,s=1", 2, 0}};

/* Another writer's insert of the page raced ours: its page does not hold our number, so the
 * update is sent again, and then matches. */
Test(replay, a_duplicate_key_from_another_writers_race_is_retried_then_stored) {
    fs.races = 1;
    fs.race_wseq = 0;
    struct record r;
    build_record(&r, pair, 2, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(cause, BD_CAUSE_SERVER);
    cr_assert_eq(STAT(page_lookups), 1);
    cr_assert_eq(stored(&pair[0]), 0, "the racing insert holds nothing of ours");
    cr_assert_eq(stored(&pair[1]), 2);
    cr_assert_eq(bd_replay_pending_readings(rp), 3);
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    cr_assert_eq(stored(&pair[0]), 3);
    cr_assert_eq(stored(&pair[1]), 2);
    cr_assert_eq(page_of(&pair[0])->wseq, SEQ);
    cr_assert_eq(page_of(&pair[0])->other, 1, "the other writer's entry stays");
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_flushed), 5);
    bd_replay_free(rp);
    free_record(&r);
}

/* Every attempt answered 11000 and the pages of the bucket (two of them) hold an older number
 * of ours: never applied by this record; quarantined after MAX_DUP_CHECKS look-ups. */
Test(replay, duplicate_keys_without_our_number_are_bounded_then_quarantined) {
    fs.dup_always = "m,s=0";
    fake_put(&fs, "m,s=0", hour_ms, 0, 10, SEQ - 1);
    fake_put(&fs, "m,s=0", hour_ms, 1, 4, SEQ - 1);
    static const struct spec three_hours[] = {{"m,s=0", 3, 0}, {"m,s=1", 2, 0}, {"m,s=0", 1, -1}};
    struct record r;
    build_record(&r, three_hours, 3, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    for (int k = 1; k < MAX_DUP_CHECKS; k++) {
        cr_assert_not(attempt(rp, &cause), "attempt %d", k);
        cr_assert_eq(cause, BD_CAUSE_SERVER);
        cr_assert_eq(STAT(updates_quarantined), 0);
        cr_assert_eq(bd_replay_pending_readings(rp), 4);
    }
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(STAT(page_lookups), MAX_DUP_CHECKS);
    cr_assert_eq(STAT(updates_quarantined), 2);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(readings_flushed), 2);
    cr_assert_eq(stored(&three_hours[0]), 14, "the earlier pages unchanged");
    cr_assert_eq(stored(&three_hours[1]), 2);
    cr_assert_eq(stored(&three_hours[2]), 0);
    struct dead_line dl[3];
    cr_assert_eq(read_dead(dl, 3), 2);
    assert_dead_letter(&dl[0], &three_hours[0], 11000);
    assert_dead_letter(&dl[1], &three_hours[2], 11000);
    bd_replay_free(rp);
    free_record(&r);
}

/* Each duplicate is judged by its own page: not by another page of its bucket (page 1 holds a
 * later batch's number), nor by the same page number of its sensor's other bucket. */
Test(replay, each_duplicate_is_judged_by_the_page_it_targets) {
    fs.dup_always = "m,s=0";
    static const struct spec two_hours[] = {{"m,s=0", 3, 0}, {"m,s=0", 2, -1}};
    fake_put(&fs, "m,s=0", spec_start(&two_hours[0]), 0, 6, SEQ - 1);
    fake_put(&fs, "m,s=0", spec_start(&two_hours[0]), 1, 4, SEQ + 1);
    fake_put(&fs, "m,s=0", spec_start(&two_hours[1]), 0, 2, SEQ); /* applied before a crash */
    struct record r;
    build_record(&r, two_hours, 2, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(STAT(updates_already_applied), 1, "the hour before holds our number");
    cr_assert_eq(STAT(readings_flushed), 2);
    cr_assert_eq(bd_replay_pending_readings(rp), 3, "page 0 of this hour does not");
    for (int k = 1; k < MAX_DUP_CHECKS; k++) {
        cr_assert_eq(STAT(updates_quarantined), 0);
        cr_assert_eq(attempt(rp, &cause), k + 1 == MAX_DUP_CHECKS, "attempt %d", k + 1);
    }
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 3);
    cr_assert_eq(STAT(updates_already_applied), 1);
    struct dead_line dl[2];
    cr_assert_eq(read_dead(dl, 2), 1);
    assert_dead_letter(&dl[0], &two_hours[0], 11000);
    bd_replay_free(rp);
    free_record(&r);
}

/* A page that holds this writer's number or a later one is taken as applied by an earlier
 * attempt of this record: a spooled update may have been sent before a crash, so the replay
 * cannot tell that from another daemon using the same writer_id. */
/*
 * A page that holds this record's number (or a later one) although no attempt of the update
 * can have reached MongoDB: another daemon writes with this writer_id. Known only for records
 * this run spooled (run_first_seq at or below the record's number) with the update's flag
 * clear and no ambiguous attempt since; then it is a conflict, counted and quarantined. Any
 * other way it counts as applied before.
 */
Test(replay, our_number_in_a_page_never_sent_to_is_a_conflict_only_when_that_is_known) {
    static const struct {
        const char *name;
        uint64_t run_first_seq;
        uint32_t flags;
        bool lost_reply_first; /* a first attempt applies it and loses the reply */
        bool conflict;
    } rows[] = {
        {"this run, never sent", SEQ, 0, false, true},
        {"this run, from an earlier number on", SEQ - 3, 0, false, true},
        {"this run, sent before it was spooled", SEQ, BD_REPLAY_MAYBE_SENT, false, false},
        {"this run, an ambiguous replay attempt", SEQ, 0, true, false},
        {"an earlier run's record", SEQ + 1, 0, false, false},
        {"no number taken yet by this run", 0, 0, false, false},
    };
    for (size_t k = 0; k < BD_ARRAY_LEN(rows); k++) {
        reset_store();
        remove_dead_letters();
        env.run_first_seq = rows[k].run_first_seq;
        record_flags = rows[k].flags;
        struct record r;
        build_record(&r, pair, 2, SEQ);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        if (rows[k].lost_reply_first) {
            fake_script(&fs, FAULT_LOST_REPLY, 0);
            cr_assert_not(attempt(rp, &cause), "%s", rows[k].name);
            cr_assert_eq(stored(&pair[0]), 3, "%s: applied, the reply lost", rows[k].name);
        } else {
            /* Another daemon with this writer_id inserted the first page, number above ours. */
            fs.races = 1;
            fs.race_wseq = SEQ + 5;
        }
        cr_assert(attempt(rp, &cause), "%s: settled", rows[k].name);
        cr_assert_eq(stored(&pair[1]), 2, "%s", rows[k].name);
        if (rows[k].conflict) {
            cr_assert_eq(STAT(writer_conflicts), 1, "%s", rows[k].name);
            cr_assert_eq(STAT(updates_quarantined), 1, "%s", rows[k].name);
            cr_assert_eq(STAT(readings_quarantined), 3, "%s", rows[k].name);
            cr_assert_eq(STAT(updates_already_applied), 0, "%s", rows[k].name);
            cr_assert_eq(STAT(readings_flushed), 2, "%s", rows[k].name);
            struct dead_line dl[2];
            cr_assert_eq(read_dead(dl, 2), 1, "%s", rows[k].name);
            assert_dead_letter(&dl[0], &pair[0], 11000);
        } else {
            cr_assert_eq(STAT(writer_conflicts), 0, "%s", rows[k].name);
            cr_assert_eq(STAT(updates_quarantined), 0, "%s", rows[k].name);
            cr_assert_geq(STAT(updates_already_applied), 1, "%s", rows[k].name);
            cr_assert_eq(STAT(readings_flushed), 5, "%s", rows[k].name);
        }
        bd_replay_free(rp);
        free_record(&r);
    }
}

Test(replay, a_page_holding_our_number_or_a_later_one_counts_as_applied) {
    fs.races = 1;
    fs.race_wseq = SEQ + 5;
    struct record r;
    build_record(&r, pair, 2, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(STAT(updates_already_applied), 1);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_flushed), 5);
    cr_assert_eq(stored(&pair[0]), 0);
    cr_assert_eq(page_of(&pair[0])->wseq, SEQ + 5);
    cr_assert_eq(stored(&pair[1]), 2);
    bd_replay_free(rp);
    free_record(&r);
}

/* A look-up that fails decides nothing and uses up none of the duplicate checks. */
Test(replay, a_failed_page_look_up_settles_nothing_and_is_asked_again) {
    struct record r;
    build_record(&r, pair, 2, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause));
    bd_replay_free(rp);
    rp = load(&r); /* replayed after a crash */
    fs.find_fails = true;
    for (int k = 0; k < 2 * MAX_DUP_CHECKS; k++) {
        cr_assert_not(attempt(rp, &cause), "look-up %d", k);
        cr_assert_eq(cause, BD_CAUSE_SERVER);
        cr_assert_eq(bd_replay_pending_readings(rp), 5);
    }
    cr_assert_eq(STAT(page_lookups), 2 * MAX_DUP_CHECKS);
    fs.find_fails = false;
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(STAT(updates_already_applied), 2);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(stored(&pair[0]), 3);
    cr_assert_eq(stored(&pair[1]), 2);
    cr_assert_eq(page_of(&pair[0])->updates, 1);
    bd_replay_free(rp);
    free_record(&r);
}

/* ---- 6. connection failures and write-concern errors ----------------------------------------- */

struct fault_case {
    const char *name;
    enum fake_fault fault;
    int32_t code;
    enum bd_bulk_cause cause;
    bool first_applied; /* the first bulk's updates reached the collection */
    bool first_settled; /* ... and the answer says so */
    bool rest_sent;     /* the second bulk was sent in the same attempt */
};

static const struct fault_case faults[] = {
    {"unreachable", FAULT_UNREACHABLE, 0, BD_CAUSE_UNREACHABLE, false, false, false},
    {"lost request", FAULT_LOST_REQUEST, 0, BD_CAUSE_CONNECTION, false, false, false},
    {"lost reply", FAULT_LOST_REPLY, 0, BD_CAUSE_CONNECTION, true, false, false},
    {"write concern timeout", FAULT_WC_ERROR, 64, BD_CAUSE_SERVER, true, false, true},
    {"write concern unsatisfiable", FAULT_WC_ERROR, 100, BD_CAUSE_SERVER, true, false, true},
    {"retryable command error", FAULT_RETRYABLE, 91, BD_CAUSE_SERVER, false, false, true},
};

Test(replay, connection_failures_lose_nothing_and_later_attempts_settle_exactly_once) {
    for (size_t c = 0; c < BD_ARRAY_LEN(faults); c++) {
        const struct fault_case *fc = &faults[c];
        reset_store();
        cfg.flush.max_updates = 2;
        fake_script(&fs, fc->fault, fc->code);
        struct record r;
        build_record(&r, four, 4, SEQ);
        struct bd_replay *rp = load(&r);
        enum bd_bulk_cause cause;
        cr_assert_not(attempt(rp, &cause), "%s", fc->name);
        cr_assert_eq(cause, fc->cause, "%s: cause %d", fc->name, cause);
        cr_assert_eq(fs.bulks, fc->rest_sent ? 2 : 1, "%s", fc->name);
        uint64_t pending = 0, flushed = 0, ambiguous = 0;
        for (int i = 0; i < 4; i++) {
            bool first = i < 2;
            bool applied = first ? fc->first_applied : fc->rest_sent;
            bool settled = first ? fc->first_settled : fc->rest_sent;
            cr_assert_eq(stored(&four[i]), applied ? four[i].n : 0, "%s: %s", fc->name, four[i].id);
            pending += settled ? 0 : four[i].n;
            flushed += settled ? four[i].n : 0;
            ambiguous += applied && !settled;
        }
        cr_assert_eq(bd_replay_pending_readings(rp), pending, "%s", fc->name);
        cr_assert_eq(STAT(readings_flushed), flushed, "%s", fc->name);
        cr_assert_eq(STAT(bulk_writes), fc->cause == BD_CAUSE_UNREACHABLE ? 0 : fs.bulks,
                     "%s: a bulk that reached no server is not counted", fc->name);
        /* The next attempt: every reading stored once, what may have been applied proved so. */
        cr_assert(attempt(rp, &cause), "%s: %s", fc->name, last_msg);
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(stored(&four[i]), four[i].n, "%s: %s", fc->name, four[i].id);
            cr_assert_eq(page_of(&four[i])->updates, 1, "%s", fc->name);
            cr_assert_eq(page_of(&four[i])->wseq, SEQ);
        }
        cr_assert_eq(STAT(updates_already_applied), ambiguous, "%s", fc->name);
        cr_assert_eq(STAT(readings_flushed), 10, "%s", fc->name);
        cr_assert_eq(STAT(updates_quarantined), 0, "%s", fc->name);
        cr_assert_eq(bd_replay_pending_readings(rp), 0);
        bd_replay_free(rp);
        free_record(&r);
    }
}

/* ---- 8. pending readings and the sequence ---------------------------------------------------- */

Test(replay, pending_readings_follow_partial_settling) {
    static const struct spec sp[] = {{"m,s=0", 5, 0}, {"m,s=1", 3, 0}, {"m,s=2", 2, 0}};
    fs.too_large = "m,s=1";
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    struct record r;
    build_record(&r, sp, 3, UINT64_C(123456789012));
    struct bd_replay *rp = load(&r);
    cr_assert_eq(bd_replay_seq(rp), UINT64_C(123456789012));
    cr_assert_eq(bd_replay_pending_readings(rp), 10);
    enum bd_bulk_cause cause;
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(cause, BD_CAUSE_UNREACHABLE);
    cr_assert_eq(bd_replay_pending_readings(rp), 10, "nothing settled");
    cr_assert_not(attempt(rp, &cause));
    cr_assert_eq(bd_replay_pending_readings(rp), 3, "two settled, the too large one waits");
    for (int k = 2; k < MAX_REFUSALS; k++) {
        cr_assert_not(attempt(rp, &cause));
        cr_assert_eq(bd_replay_pending_readings(rp), 3);
    }
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(bd_replay_pending_readings(rp), 0);
    cr_assert_eq(bd_replay_seq(rp), UINT64_C(123456789012));
    cr_assert_eq(STAT(readings_quarantined), 3);
    cr_assert_eq(fs.seqs[1], UINT64_C(123456789012), "the record's number in the filters");
    bd_replay_free(rp);
    free_record(&r);
}

/* A record larger than the payload's first buffer (64 KiB): each growth failing once changes
 * nothing; the record then holds every update and writes every reading once. */
Test(replay, a_payload_grows_past_its_first_buffer_and_a_failed_growth_changes_nothing) {
    static const struct spec big[] = {
        {"m,s=0", 900, 0}, {"m,s=1", 900, 0}, {"m,s=2", 900, 0}, {"m,s=3", 900, 0}};
    fail_growth = true;
    struct record r;
    build_record(&r, big, 4, SEQ);
    fail_growth = false;
    cr_assert_gt(r.buf.len, 64 * 1024, "past the first buffer: %zu bytes", r.buf.len);
    cr_assert_geq(r.grown, 2, "the first allocation and a growth");
    struct bd_replay *rp = load(&r);
    cr_assert_eq(bd_replay_pending_readings(rp), 3600);
    enum bd_bulk_cause cause;
    cr_assert(attempt(rp, &cause), "%s", last_msg);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(stored(&big[i]), 900);
    }
    cr_assert_eq(STAT(readings_flushed), 3600);
    bd_replay_free(rp);
    free_record(&r);
}

/* ---- 7. malformed payloads ------------------------------------------------------------------- */

/* Load a copy of data[0, len) in a buffer of exactly that size (so an overread is caught). */
static int load_bytes(const uint8_t *data, size_t len, struct bd_replay **out, struct bd_err *err) {
    uint8_t *copy = malloc(len ? len : 1);
    cr_assert_not_null(copy);
    memcpy(copy, data, len);
    struct bd_spool_record rec = {.id = 9, .seq = SEQ, .n_readings = 1, .data = copy, .len = len};
    *out = NULL;
    memset(err, 0, sizeof(*err));
    int rc = bd_replay_load(out, &rec, err);
    free(copy);
    return rc;
}

static void assert_rejected(const uint8_t *data, size_t len, const char *what) {
    struct bd_replay *rp;
    struct bd_err err;
    int rc = load_bytes(data, len, &rp, &err);
    cr_assert_eq(rc, -EBADMSG, "%s: %d", what, rc);
    cr_assert_null(rp, "%s", what);
    cr_assert_eq(err.code, -EBADMSG, "%s", what);
    cr_assert_not_null(strstr(err.msg, "does not hold updates as written"), "%s: %s", what,
                       err.msg);
    cr_assert_not_null(strstr(err.msg, "spool record 9 (sequence 7)"), "%s: %s", what, err.msg);
}

Test(replay, a_payload_cut_anywhere_but_between_updates_is_refused) {
    struct record r;
    build_record(&r, pair, 2, SEQ);
    for (size_t len = 0; len < r.buf.len; len++) {
        char what[64];
        snprintf(what, sizeof(what), "cut at %zu of %zu", len, r.buf.len);
        if (len == r.ends[0]) {
            /* Exactly the first update: a whole record of one update. */
            struct bd_replay *rp;
            struct bd_err err;
            cr_assert_eq(load_bytes(r.buf.data, len, &rp, &err), 0, "%s: %s", what, err.msg);
            cr_assert_eq(bd_replay_pending_readings(rp), pair[0].n);
            bd_replay_free(rp);
            continue;
        }
        assert_rejected(r.buf.data, len, what);
    }
    free_record(&r);
}

Test(replay, payloads_that_do_not_hold_updates_as_written_are_refused) {
    struct record r;
    build_record(&r, pair, 2, SEQ);
    const size_t len = r.buf.len;
    const uint32_t id_len = (uint32_t)strlen(pair[0].id);
    const size_t filter_at = ID_AT + id_len;
    const uint32_t filter_len = bd_get_le32(r.buf.data + filter_at);
    const size_t update_at = filter_at + filter_len;
    const uint32_t update_len = bd_get_le32(r.buf.data + update_at);
    cr_assert_eq(update_at + update_len, r.ends[0], "the layout as replay.h says");
    uint8_t *p = malloc(len + 64);
    cr_assert_not_null(p);

    struct {
        const char *what;
        size_t at;    /* where to write */
        uint32_t v;   /* a little-endian u32, or */
        int byte;     /* one byte (>= 0) */
        size_t extra; /* garbage bytes appended */
    } cases[] = {
        {"an empty sensor id", ID_LEN_AT, 0, -1, 0},
        {"an id longer than the record", ID_LEN_AT, (uint32_t)len, -1, 0},
        {"an id length of 2^32-1", ID_LEN_AT, UINT32_MAX, -1, 0},
        {"a filter shorter than an empty document", filter_at, 4, -1, 0},
        {"a filter of length 0", filter_at, 0, -1, 0},
        {"a filter longer than the record", filter_at, (uint32_t)len, -1, 0},
        {"a filter not ending in NUL", filter_at + filter_len - 1, 0, 'x', 0},
        {"an update shorter than an empty document", update_at, 3, -1, 0},
        {"an update longer than the record", update_at, (uint32_t)len, -1, 0},
        {"an update not ending in NUL", update_at + update_len - 1, 0, 1, 0},
        {"an update reaching into the next", update_at, update_len + 1, -1, 0},
        {"one byte of trailing garbage", 0, 0, -2, 1},
        {"a header's worth of trailing garbage", 0, 0, -2, ID_AT},
        {"a header and more of trailing garbage", 0, 0, -2, ID_AT + 17},
        {"a document's worth of trailing zeros", 0, 0, -3, 40},
    };
    for (size_t c = 0; c < BD_ARRAY_LEN(cases); c++) {
        memcpy(p, r.buf.data, len);
        if (cases[c].byte >= 0) {
            p[cases[c].at] = (uint8_t)cases[c].byte;
        } else if (cases[c].byte == -1) {
            bd_put_le32(p + cases[c].at, cases[c].v);
        } else {
            memset(p + len, cases[c].byte == -2 ? 0xab : 0, cases[c].extra);
        }
        assert_rejected(p, len + cases[c].extra, cases[c].what);
    }
    /* The same record untouched loads. */
    struct bd_replay *rp;
    struct bd_err err;
    cr_assert_eq(load_bytes(r.buf.data, len, &rp, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_replay_pending_readings(rp), 5);
    bd_replay_free(rp);
    free(p);
    free_record(&r);
}

/* An update without a sensor id, the rest of it consistent. */
Test(replay, an_update_without_a_sensor_id_is_refused) {
    struct record r;
    build_record(&r, pair, 2, SEQ);
    const size_t id_len = strlen(pair[0].id);
    const size_t len = r.buf.len - id_len;
    uint8_t *p = malloc(len);
    cr_assert_not_null(p);
    memcpy(p, r.buf.data, ID_AT);
    bd_put_le32(p + ID_LEN_AT, 0);
    memcpy(p + ID_AT, r.buf.data + ID_AT + id_len, r.buf.len - ID_AT - id_len);
    assert_rejected(p, len, "an empty sensor id");
    /* The same bytes with the id put back load. */
    struct bd_replay *rp;
    struct bd_err err;
    cr_assert_eq(load_bytes(r.buf.data, r.buf.len, &rp, &err), 0, "%s", err.msg);
    bd_replay_free(rp);
    free(p);
    free_record(&r);
}

/* Documents whose frame is right but whose elements are not BSON. */
Test(replay, documents_whose_elements_do_not_parse_are_refused) {
    struct record r;
    build_record(&r, pair, 2, SEQ);
    const size_t len = r.buf.len;
    const size_t filter_at = ID_AT + strlen(pair[0].id);
    const uint32_t filter_len = bd_get_le32(r.buf.data + filter_at);
    const size_t update_at = filter_at + filter_len;
    uint8_t *p = malloc(len);
    cr_assert_not_null(p);
    struct {
        const char *what;
        size_t at;
        uint8_t byte;
    } cases[] = {
        {"a filter element of unknown type", filter_at + 4, 0x20},
        {"an update element of unknown type", update_at + 4, 0x20},
        /* The filter's first element is _id, a string: type, "_id\0", then its length (the
         * high byte here) reaching past the document. */
        {"a filter string longer than its document", filter_at + 4 + 1 + 4 + 3, 0x7f},
    };
    cr_assert_eq(r.buf.data[filter_at + 4], BSON_TYPE_UTF8, "the filter starts with _id");
    for (size_t c = 0; c < BD_ARRAY_LEN(cases); c++) {
        memcpy(p, r.buf.data, len);
        p[cases[c].at] = cases[c].byte;
        assert_rejected(p, len, cases[c].what);
    }
    free(p);
    free_record(&r);
}

/* ---- 9. allocation failures ------------------------------------------------------------------ */

Test(replay, each_allocation_failure_while_loading_is_an_error_and_nothing_else) {
    struct record r;
    build_record(&r, four, 4, SEQ);
    struct bd_err err = {0};
    struct bd_replay *rp = NULL;
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(bd_replay_load(&rp, &r.rec, &err), 0);
    long allocations = bd_alloc_fail_after(-1, 0);
    bd_replay_free(rp);
    cr_assert_gt(allocations, 2);
    for (long k = 0; k < allocations + 2; k++) {
        rp = NULL;
        memset(&err, 0, sizeof(err));
        bd_alloc_fail_after(k, 0);
        int rc = bd_replay_load(&rp, &r.rec, &err);
        bd_alloc_fail_after(-1, 0);
        if (k < allocations) {
            cr_assert_eq(rc, -ENOMEM, "allocation %ld: %d", k, rc);
            cr_assert_null(rp);
            cr_assert_not_null(strstr(err.msg, "out of memory"), "%s", err.msg);
        } else {
            cr_assert_eq(rc, 0, "allocation %ld", k);
            cr_assert_eq(bd_replay_pending_readings(rp), 10);
            bd_replay_free(rp);
        }
    }
    free_record(&r);
}

/*
 * One update was applied by an earlier attempt (a duplicate key, read back), the others are
 * new, and written buckets are marked for their summaries: each allocation of the attempt fails
 * in turn. The attempt fails or settles what it can; once memory is back, every reading is
 * stored exactly once and counted once.
 */
static const struct spec sweep_specs[] = {{"m,s=0", 3, 0}, {"m,s=1", 2, 0}, {"m,s=2", 4, 0}};

static void sweep_store(void) {
    reset_store();
    fake_put(&fs, "m,s=1", hour_ms, 0, 2, SEQ); /* applied before a crash */
    bd_summaries_free(sums);
    cr_assert_eq(bd_summaries_new(&sums), 0);
    settle.sums = sums;
}

Test(replay, each_allocation_failure_in_an_attempt_delays_but_never_loses_or_duplicates) {
    struct record r;
    build_record(&r, sweep_specs, 3, SEQ);
    sweep_store();
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    bd_alloc_fail_after(-1, 0);
    cr_assert(attempt(rp, &cause));
    long allocations = bd_alloc_fail_after(-1, 0);
    bd_replay_free(rp);
    cr_assert_eq(STAT(updates_already_applied), 1);
    cr_assert_gt(allocations, 8);
    for (long k = 0; k < allocations + 2; k++) {
        sweep_store();
        rp = load(&r);
        bd_alloc_fail_after(k, 0);
        bool ok = attempt(rp, &cause);
        bd_alloc_fail_after(-1, 0);
        if (k < 6) {
            /* The attempt's own arrays: nothing is sent. */
            cr_assert_not(ok, "allocation %ld", k);
            cr_assert_eq(cause, BD_CAUSE_CLIENT, "allocation %ld", k);
            cr_assert_str_eq(last_msg, "out of memory replaying the spool");
            cr_assert_eq(fs.bulks, 0, "allocation %ld", k);
            cr_assert_eq(bd_replay_pending_readings(rp), 9);
        }
        for (int tries = 0; !ok && tries < 3; tries++) {
            ok = attempt(rp, &cause);
        }
        cr_assert(ok, "allocation %ld: %s", k, last_msg);
        for (int i = 0; i < 3; i++) {
            cr_assert_eq(stored(&sweep_specs[i]), sweep_specs[i].n, "allocation %ld: %s", k,
                         sweep_specs[i].id);
            cr_assert_eq(page_of(&sweep_specs[i])->wseq, SEQ);
            cr_assert_leq(page_of(&sweep_specs[i])->updates, 1, "allocation %ld", k);
        }
        cr_assert_eq(STAT(readings_flushed), 9, "allocation %ld", k);
        cr_assert_eq(STAT(updates_already_applied), 1, "allocation %ld", k);
        cr_assert_eq(STAT(updates_quarantined), 0, "allocation %ld", k);
        cr_assert_eq(bd_summaries_waiting(sums) + STAT(summary_buckets_skipped), 3,
                     "allocation %ld: every bucket marked or counted skipped", k);
        cr_assert_eq(bd_replay_pending_readings(rp), 0);
        bd_replay_free(rp);
    }
    free_record(&r);
}

/* Memory never comes back during an attempt: nothing is sent, nothing settled. */
Test(replay, an_attempt_without_memory_sends_nothing) {
    struct record r;
    build_record(&r, sweep_specs, 3, SEQ);
    struct bd_replay *rp = load(&r);
    enum bd_bulk_cause cause;
    bd_alloc_fail_after(0, 1);
    bool ok = attempt(rp, &cause);
    bd_alloc_fail_after(-1, 0);
    cr_assert_not(ok);
    cr_assert_eq(cause, BD_CAUSE_CLIENT);
    cr_assert_eq(fs.bulks, 0);
    cr_assert_eq(bd_replay_pending_readings(rp), 9);
    cr_assert(attempt(rp, &cause));
    cr_assert_eq(STAT(readings_flushed), 9);
    bd_replay_free(rp);
    free_record(&r);
}
