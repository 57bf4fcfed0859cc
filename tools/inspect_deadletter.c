/*
 * bucketd-inspect dead-letter list|replay: shows the updates MongoDB refused for good
 * (<spool.dir>/dead-letter.jsonl, see include/bucketd/deadletter.h) and sends them again once
 * the cause is fixed. Replay marks each page it changes with replayed.<record id> instead of
 * the writer's sequence, so a second replay changes nothing and the daemon's own idempotency
 * filter is left as it was (details above struct replayer).
 *
 * Every line of the file is untrusted: a torn or foreign line is counted and reported, never
 * sent. Single-threaded; the file is read one line at a time.
 */
#include "inspect.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "bucketd/bucket.h"
#include "bucketd/deadletter.h"
#include "bucketd/mongo.h"

/* One record of the dead-letter file. Strings and the two sub-documents point into doc. */
struct dl_record {
    bson_t *doc;
    int64_t time_ms;
    const char *writer_id;
    int64_t seq;
    const char *database;
    const char *collection;
    const char *bucket_id;
    int64_t n_readings;
    int64_t code;
    const char *message;
    bson_t filter; /* static views into doc */
    bson_t update;
    char id[17]; /* record id, 16 hex digits */
};

struct dl_tally {
    uint64_t records, readings, unreadable;
    uint64_t applied, already, refused;
};

/*
 * The record id: hex XXH3-64 of writer_id, '\0', seq in decimal, '\0', bucket_id. A writer
 * sends one update per page per sequence number, so the id names one refused update; the same
 * update written down twice has one id, and replay applies it once.
 */
static int dl_record_id(const char *writer_id, int64_t seq, const char *bucket_id, char out[17]) {
    char num[24];
    int nn = snprintf(num, sizeof(num), "%" PRId64, seq);
    size_t wl = strlen(writer_id), bl = strlen(bucket_id);
    size_t len = wl + 1 + (size_t)nn + 1 + bl;
    char *buf = malloc(len);
    if (buf == NULL) {
        return -ENOMEM;
    }
    memcpy(buf, writer_id, wl + 1);
    memcpy(buf + wl + 1, num, (size_t)nn + 1);
    memcpy(buf + wl + 1 + (size_t)nn + 1, bucket_id, bl);
    snprintf(out, 17, "%016" PRIx64, (uint64_t)XXH3_64bits(buf, len));
    free(buf);
    return 0;
}

static bool dl_utf8(const bson_t *doc, const char *key, const char **out) {
    bson_iter_t it;
    if (!bson_iter_init_find(&it, doc, key) || !BSON_ITER_HOLDS_UTF8(&it)) {
        return false;
    }
    *out = bson_iter_utf8(&it, NULL);
    return true;
}

static bool dl_int(const bson_t *doc, const char *key, int64_t *out) {
    bson_iter_t it;
    if (!bson_iter_init_find(&it, doc, key) || !inspect_type_in(bson_iter_type(&it), T_INT)) {
        return false;
    }
    *out = bson_iter_as_int64(&it);
    return true;
}

/* A sub-document (or array) of doc as a static view. */
static bool dl_sub(const bson_t *doc, const char *key, bson_type_t type, bson_t *out) {
    bson_iter_t it;
    uint32_t len = 0;
    const uint8_t *data = NULL;
    if (!bson_iter_init_find(&it, doc, key) || bson_iter_type(&it) != type) {
        return false;
    }
    if (type == BSON_TYPE_ARRAY) {
        bson_iter_array(&it, &len, &data);
    } else {
        bson_iter_document(&it, &len, &data);
    }
    return bson_init_static(out, data, len);
}

/* Parses one line (without its newline). -EINVAL with the reason in why; -ENOMEM. */
static int dl_parse(const char *line, size_t len, struct dl_record *r, char *why, size_t cap) {
    bson_error_t berr;
    bson_iter_t it;
    const char *missing = NULL;

    memset(r, 0, sizeof(*r));
    r->doc = bson_new_from_json((const uint8_t *)line, (ssize_t)len, &berr);
    if (r->doc == NULL) {
        snprintf(why, cap, "not extended JSON: %s", berr.message);
        return -EINVAL;
    }
    if (!bson_iter_init_find(&it, r->doc, "time") || !BSON_ITER_HOLDS_DATE_TIME(&it)) {
        missing = "date 'time'";
    } else if ((r->time_ms = bson_iter_date_time(&it)),
               !dl_utf8(r->doc, "writer_id", &r->writer_id)) {
        missing = "string 'writer_id'";
    } else if (!dl_int(r->doc, "seq", &r->seq)) {
        missing = "integer 'seq'";
    } else if (!dl_utf8(r->doc, "database", &r->database) || *r->database == '\0') {
        missing = "string 'database'";
    } else if (!dl_utf8(r->doc, "collection", &r->collection) || *r->collection == '\0') {
        missing = "string 'collection'";
    } else if (!dl_utf8(r->doc, "bucket_id", &r->bucket_id)) {
        missing = "string 'bucket_id'";
    } else if (!dl_int(r->doc, "n_readings", &r->n_readings)) {
        missing = "integer 'n_readings'";
    } else if (!dl_int(r->doc, "code", &r->code)) {
        missing = "integer 'code'";
    } else if (!dl_utf8(r->doc, "message", &r->message)) {
        missing = "string 'message'";
    } else if (!dl_sub(r->doc, "filter", BSON_TYPE_DOCUMENT, &r->filter)) {
        missing = "document 'filter'";
    } else if (!dl_sub(r->doc, "update", BSON_TYPE_ARRAY, &r->update)) {
        missing = "array 'update'";
    }
    if (missing != NULL) {
        snprintf(why, cap, "no %s", missing);
        bson_destroy(r->doc);
        r->doc = NULL;
        return -EINVAL;
    }
    if (dl_record_id(r->writer_id, r->seq, r->bucket_id, r->id) < 0) {
        bson_destroy(r->doc);
        r->doc = NULL;
        return -ENOMEM;
    }
    return 0;
}

/* Messages are printed on one line (line breaks and tabs as spaces), escaped. */
static void print_one_line(const char *s) {
    char *line = strdup(s);
    if (line == NULL) {
        fputs("(out of memory)", stdout);
        return;
    }
    for (char *c = line; *c != '\0'; c++) {
        *c = *c == '\n' || *c == '\r' || *c == '\t' ? ' ' : *c;
    }
    inspect_put_safe(line);
    free(line);
}

static void dl_print(const struct dl_record *r) {
    char t[64];
    inspect_fmt_time(r->time_ms, t, sizeof(t));
    printf("%s  %s  ", t, r->id);
    inspect_put_safe(r->bucket_id);
    printf("  %" PRId64 " readings  code %" PRId64 ": ", r->n_readings, r->code);
    print_one_line(r->message);
    putchar('\n');
}

/*
 * Replay. The record's update is what the daemon sent: its filter holds "w.<writer_id>":
 * {$not: {$gte: seq}} and its pipeline sets "w.<writer_id>" to seq. Sent as it is, it could
 * lower the page's sequence below numbers the daemon has used since (a retry of a later update
 * would then apply twice), or match nothing because the sequence moved on. So both are
 * rewritten:
 *
 *   filter  the record's filter without "w.<writer_id>" (shard-key fields and _id stay),
 *           plus "replayed.<record id>": {$exists: false};
 *   update  the record's pipeline with "w.<writer_id>" dropped from every $set/$addFields
 *           stage, plus a last stage {$set: {"replayed.<record id>": <time of this replay>}};
 *
 * sent with upsert. A page already marked matches nothing, the upsert's insert meets the
 * existing _id and MongoDB answers 11000; the mark is then looked up to tell "already replayed"
 * from another duplicate key.
 */
struct replayer {
    int64_t now_ms;
    bson_t opts; /* upsert, writeConcern */
};

static int replayer_init(struct replayer *rp, const struct settings *s, struct bd_err *err) {
    mongoc_write_concern_t *wc = NULL;
    bson_init(&rp->opts);
    rp->now_ms = bd_floor_div(bd_now_ns(), BD_NS_PER_MS);
    int rc = bd_mongo_write_concern_new(s->write_concern, s->wtimeout_ms, &wc, err);
    if (rc < 0) {
        return rc;
    }
    BSON_APPEND_BOOL(&rp->opts, "upsert", true);
    if (!mongoc_write_concern_append(wc, &rp->opts)) {
        rc = bd_err_set(err, -EINVAL, "mongodb.write_concern: cannot be applied");
    }
    mongoc_write_concern_destroy(wc);
    return rc;
}

static void replayer_close(struct replayer *rp) {
    bson_destroy(&rp->opts);
}

static bool is_set_stage(const bson_t *stage, const char **op, bson_t *fields) {
    bson_iter_t it;
    if (bson_count_keys(stage) != 1 || !bson_iter_init(&it, stage) || !bson_iter_next(&it)) {
        return false;
    }
    *op = bson_iter_key(&it);
    if ((strcmp(*op, "$set") != 0 && strcmp(*op, "$addFields") != 0) ||
        !BSON_ITER_HOLDS_DOCUMENT(&it)) {
        return false;
    }
    uint32_t len = 0;
    const uint8_t *data = NULL;
    bson_iter_document(&it, &len, &data);
    return bson_init_static(fields, data, len);
}

/* The filter and update replay sends (see above); both initialised by the call. */
static int replay_rewrite(const struct dl_record *r, int64_t now_ms, bson_t *filter, bson_t *update,
                          char *why, size_t cap) {
    char wkey[256], mark[64], idx[16];
    const char *ikey;
    bson_iter_t it;
    bson_t cond, stage, fields, kept, set;
    uint32_t n = 0;

    snprintf(wkey, sizeof(wkey), "%s%s", BD_WRITER_KEY_PREFIX, r->writer_id);
    snprintf(mark, sizeof(mark), "replayed.%s", r->id);

    bson_init(filter);
    if (!bson_has_field(&r->filter, "_id")) {
        BSON_APPEND_UTF8(filter, "_id", r->bucket_id);
    }
    bson_copy_to_excluding_noinit(&r->filter, filter, wkey, NULL);
    BSON_APPEND_DOCUMENT_BEGIN(filter, mark, &cond);
    BSON_APPEND_BOOL(&cond, "$exists", false);
    bson_append_document_end(filter, &cond);

    bson_init(update);
    if (!bson_iter_init(&it, &r->update)) {
        snprintf(why, cap, "the update is not a pipeline");
        return -EINVAL;
    }
    while (bson_iter_next(&it)) {
        uint32_t len = 0;
        const uint8_t *data = NULL;
        const char *op = NULL;
        if (!BSON_ITER_HOLDS_DOCUMENT(&it)) {
            snprintf(why, cap, "stage %s of the update is not a document", bson_iter_key(&it));
            return -EINVAL;
        }
        bson_iter_document(&it, &len, &data);
        if (!bson_init_static(&stage, data, len)) {
            snprintf(why, cap, "stage %s of the update is not BSON", bson_iter_key(&it));
            return -EINVAL;
        }
        if (!is_set_stage(&stage, &op, &fields)) {
            bson_uint32_to_string(n++, &ikey, idx, sizeof(idx));
            BSON_APPEND_DOCUMENT(update, ikey, &stage);
            continue;
        }
        bson_init(&kept);
        bson_copy_to_excluding_noinit(&fields, &kept, wkey, NULL);
        /* A stage that only set the sequence would now be empty, which MongoDB refuses. */
        if (bson_count_keys(&kept) > 0) {
            bson_uint32_to_string(n++, &ikey, idx, sizeof(idx));
            BSON_APPEND_DOCUMENT_BEGIN(update, ikey, &set);
            BSON_APPEND_DOCUMENT(&set, op, &kept);
            bson_append_document_end(update, &set);
        }
        bson_destroy(&kept);
    }
    bson_uint32_to_string(n, &ikey, idx, sizeof(idx));
    BSON_APPEND_DOCUMENT_BEGIN(update, ikey, &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
    BSON_APPEND_DATE_TIME(&set, mark, now_ms);
    bson_append_document_end(&stage, &set);
    bson_append_document_end(update, &stage);
    return 0;
}

/* After an 11000: does the page carry this record's mark? 1 yes, 0 no, -EIO unreachable. */
static int already_replayed(mongoc_collection_t *coll, const bson_t *filter,
                            const struct dl_record *r, struct bd_err *err) {
    char mark[64];
    bson_iter_t it;
    bson_t q, cond, opts;
    const bson_t *doc = NULL;
    bson_error_t berr;
    int rc = 0;

    snprintf(mark, sizeof(mark), "replayed.%s", r->id);
    bson_init(&q);
    if (bson_iter_init_find(&it, filter, "_id")) {
        bson_append_iter(&q, "_id", -1, &it);
    }
    BSON_APPEND_DOCUMENT_BEGIN(&q, mark, &cond);
    BSON_APPEND_BOOL(&cond, "$exists", true);
    bson_append_document_end(&q, &cond);
    bson_init(&opts);
    BSON_APPEND_INT64(&opts, "limit", 1);
    mongoc_cursor_t *cursor = mongoc_collection_find_with_opts(coll, &q, &opts, NULL);
    if (mongoc_cursor_next(cursor, &doc)) {
        rc = 1;
    } else if (mongoc_cursor_error(cursor, &berr)) {
        rc = bd_err_set(err, -EIO, "cannot reach MongoDB: %s", berr.message);
    }
    mongoc_cursor_destroy(cursor);
    bson_destroy(&opts);
    bson_destroy(&q);
    return rc;
}

static bool unreachable(const bson_error_t *e) {
    return e->domain == MONGOC_ERROR_SERVER_SELECTION || e->domain == MONGOC_ERROR_STREAM;
}

/* Sends one record again and prints what became of it. <0 only when MongoDB is unreachable. */
static int replay_one(struct conn *c, const struct options *o, const struct settings *s,
                      struct replayer *rp, const struct dl_record *r, struct dl_tally *t,
                      struct bd_err *err) {
    char why[640];
    bson_t filter, update, reply;
    bson_error_t berr;
    mongoc_collection_t *coll = NULL;
    int rc = 0;
    /* Records go where they were going unless the command line says otherwise. */
    const char *db = o->given[OPT_DATABASE] ? s->database : r->database;
    const char *cname = o->given[OPT_COLLECTION] ? s->collection : r->collection;
    bool dry = o->given[OPT_DRY_RUN];

    bson_init(&reply);
    printf("%s ", r->id);
    inspect_put_safe(r->bucket_id);
    printf(": ");
    if (replay_rewrite(r, rp->now_ms, &filter, &update, why, sizeof(why)) < 0) {
        printf("cannot be replayed (%s)\n", why);
        t->refused++;
        goto out;
    }
    if (dry) {
        /* One document, so the pipeline prints as the array it is. */
        bson_t stmt = BSON_INITIALIZER;
        BSON_APPEND_DOCUMENT(&stmt, "filter", &filter);
        BSON_APPEND_ARRAY(&stmt, "update", &update);
        BSON_APPEND_BOOL(&stmt, "upsert", true);
        char *json = bson_as_canonical_extended_json(&stmt, NULL);
        printf("would send to %s.%s\n  %s\n", db, cname, json != NULL ? json : "(not printable)");
        bson_free(json);
        bson_destroy(&stmt);
        goto out;
    }
    coll = mongoc_client_get_collection(c->client, db, cname);
    if (mongoc_collection_update_one(coll, &filter, &update, &rp->opts, &reply, &berr)) {
        printf("applied\n");
        t->applied++;
        goto out;
    }
    if (unreachable(&berr)) {
        printf("not sent\n");
        rc = bd_err_set(err, -EIO, "cannot reach MongoDB: %s", berr.message);
        goto out;
    }
    if (berr.code == 11000) {
        rc = already_replayed(coll, &filter, r, err);
        if (rc < 0) {
            printf("unknown\n");
            goto out;
        }
        if (rc == 1) {
            rc = 0;
            printf("already replayed\n");
            t->already++;
            goto out;
        }
    }
    if (berr.domain == MONGOC_ERROR_WRITE_CONCERN) {
        printf("not confirmed (write concern error %" PRIu32 ": ", berr.code);
        print_one_line(berr.message);
        printf("; replay again)\n");
    } else {
        printf("refused again (code %" PRIu32 ": ", berr.code);
        print_one_line(berr.message);
        printf(")\n");
    }
    t->refused++;
out:
    mongoc_collection_destroy(coll);
    bson_destroy(&reply);
    bson_destroy(&filter);
    bson_destroy(&update);
    return rc;
}

static void dl_summary(const struct options *o, const struct dl_tally *t) {
    printf("%" PRIu64 " records, %" PRIu64 " readings", t->records, t->readings);
    if (o->cmd == CMD_DL_REPLAY && o->given[OPT_DRY_RUN]) {
        printf(": dry run, nothing sent");
    } else if (o->cmd == CMD_DL_REPLAY) {
        printf(": %" PRIu64 " applied, %" PRIu64 " already replayed, %" PRIu64 " refused again",
               t->applied, t->already, t->refused);
    }
    if (t->unreadable > 0) {
        printf(", %" PRIu64 " unreadable lines", t->unreadable);
    }
    putchar('\n');
}

/* list and replay; *status is EXIT_PROBLEMS when a line was unreadable or a record refused. */
int inspect_dead_letter(struct conn *c, const struct options *o, const struct settings *s,
                        int *status, struct bd_err *err) {
    char path[1100];
    char why[640];
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    uint64_t lineno = 0;
    struct dl_tally t = {0};
    struct replayer rp = {0};
    bool replay = o->cmd == CMD_DL_REPLAY;
    int rc = 0;
    FILE *f = NULL;

    bson_init(&rp.opts);
    if (o->given[OPT_FILE]) {
        snprintf(path, sizeof(path), "%s", o->value[OPT_FILE]);
    } else {
        snprintf(path, sizeof(path), "%s/%s", s->spool_dir, BD_DEADLETTER_FILE);
    }
    f = fopen(path, "re");
    if (f == NULL) {
        /* The daemon creates the file at start; after it was moved away, it is simply empty. */
        if (errno == ENOENT && !o->given[OPT_FILE]) {
            printf("%s: no such file, no dead letters\n", path);
            dl_summary(o, &t);
            goto out;
        }
        rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
        goto out;
    }
    if (replay && !o->given[OPT_DRY_RUN]) {
        bson_destroy(&rp.opts);
        rc = replayer_init(&rp, s, err);
        if (rc < 0) {
            goto out;
        }
    } else {
        rp.now_ms = bd_floor_div(bd_now_ns(), BD_NS_PER_MS);
    }
    while ((n = getline(&line, &cap, f)) >= 0) {
        struct dl_record r;
        bool newline = n > 0 && line[n - 1] == '\n';
        size_t len = newline ? (size_t)n - 1 : (size_t)n;
        lineno++;
        if (len == 0) {
            continue;
        }
        rc = dl_parse(line, len, &r, why, sizeof(why));
        if (rc == -ENOMEM) {
            bd_err_set(err, rc, "out of memory");
            goto out;
        }
        if (rc < 0) {
            rc = 0;
            printf("%s:%" PRIu64 ": unreadable record (%s)%s\n", path, lineno, why,
                   newline ? "" : " (the last line, without a newline: torn, or being written)");
            t.unreadable++;
            continue;
        }
        t.records++;
        t.readings += (uint64_t)BD_MAX(r.n_readings, 0);
        if (replay) {
            rc = replay_one(c, o, s, &rp, &r, &t, err);
        } else {
            dl_print(&r);
        }
        bson_destroy(r.doc);
        if (rc < 0) {
            break;
        }
    }
    if (rc == 0 && ferror(f)) {
        rc = bd_err_set(err, -EIO, "%s: read error", path);
    }
    dl_summary(o, &t);
    if (t.unreadable > 0 || t.refused > 0) {
        *status = EXIT_PROBLEMS;
    }
out:
    if (f != NULL) {
        fclose(f);
    }
    free(line);
    replayer_close(&rp);
    return rc;
}
