/*
 * The dead-letter store (src/deadletter.c): records read back with libbson to what was written,
 * the exact line format (the end-to-end test writes files in it), torn tails, the size cap,
 * bad directories, a file moved away while in use.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/deadletter.h"

static char dir[256];
static char path[320];

static void make_dir(void) {
    snprintf(dir, sizeof(dir), "/tmp/bd-deadletter-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
}

static void remove_dir(void) {
    char cmd[300];
    chmod(dir, 0700);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(deadletter, .init = make_dir, .fini = remove_dir);

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                    */

/* Reads a whole file into a NUL-terminated buffer (free it); *len is its size. */
static char *slurp(const char *p, size_t *len) {
    FILE *f = fopen(p, "rb");
    cr_assert_not_null(f, "%s", p);
    char *buf = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&buf, &n);
    char chunk[65536];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), f)) > 0) {
        fwrite(chunk, 1, got, m);
    }
    fclose(f);
    fclose(m);
    if (len != NULL) {
        *len = n;
    }
    return buf;
}

static void spit(const char *p, const char *text, int flags) {
    int fd = open(p, O_WRONLY | O_CREAT | flags, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
}

static size_t count_lines(const char *text) {
    size_t n = 0;
    for (const char *p = text; *p; p++) {
        n += *p == '\n';
    }
    return n;
}

static struct bd_deadletter *open_ok(void) {
    struct bd_deadletter *dl = NULL;
    struct bd_err err = {0};
    cr_assert_eq(bd_deadletter_open(&dl, dir, &err), 0, "%s", err.msg);
    cr_assert_not_null(dl);
    return dl;
}

static void append_ok(struct bd_deadletter *dl, const struct bd_deadletter_record *rec) {
    struct bd_err err = {0};
    cr_assert_eq(bd_deadletter_append(dl, rec, &err), 0, "%s", err.msg);
}

/* A filter and an update shaped like bucket.c's, with values of every kind they can carry. */
struct sample {
    bson_t filter, update;
};

static void sample_init(struct sample *s, const char *id, int64_t seq) {
    bson_t c, n, st, set, lit, arr, r, meta, tags;
    bson_init(&s->filter);
    BSON_APPEND_UTF8(&s->filter, "_id", id);
    BSON_APPEND_DOCUMENT_BEGIN(&s->filter, "w.gw-1", &c);
    BSON_APPEND_DOCUMENT_BEGIN(&c, "$not", &n);
    BSON_APPEND_INT64(&n, "$gte", seq);
    bson_append_document_end(&c, &n);
    bson_append_document_end(&s->filter, &c);

    bson_init(&s->update);
    BSON_APPEND_DOCUMENT_BEGIN(&s->update, "0", &st);
    BSON_APPEND_DOCUMENT_BEGIN(&st, "$set", &set);
    BSON_APPEND_DOCUMENT_BEGIN(&set, "_n", &lit);
    BSON_APPEND_ARRAY_BEGIN(&lit, "$literal", &arr);
    BSON_APPEND_DOCUMENT_BEGIN(&arr, "0", &r);
    BSON_APPEND_DATE_TIME(&r, "ts", INT64_C(1736949600123));
    BSON_APPEND_DOUBLE(&r, "temp", 0.1);
    BSON_APPEND_DOUBLE(&r, "big", 1e300);
    BSON_APPEND_DOUBLE(&r, "neg0", -0.0);
    BSON_APPEND_DOUBLE(&r, "inf", INFINITY);
    BSON_APPEND_INT64(&r, "min", INT64_MIN);
    BSON_APPEND_INT64(&r, "max", INT64_MAX);
    BSON_APPEND_BOOL(&r, "on", true);
    bson_append_document_end(&arr, &r);
    BSON_APPEND_DOCUMENT_BEGIN(&arr, "1", &r);
    BSON_APPEND_DATE_TIME(&r, "ts", INT64_C(-5));
    BSON_APPEND_INT32(&r, "i32", -7);
    bson_append_document_end(&arr, &r);
    bson_append_array_end(&lit, &arr);
    bson_append_document_end(&set, &lit);
    BSON_APPEND_DOCUMENT_BEGIN(&set, "meta", &lit);
    BSON_APPEND_DOCUMENT_BEGIN(&lit, "$literal", &meta);
    BSON_APPEND_UTF8(&meta, "measurement", "w\"e\\a/th\ter \xc3\xa9\xe2\x82\xac");
    BSON_APPEND_DOCUMENT_BEGIN(&meta, "tags", &tags);
    BSON_APPEND_UTF8(&tags, "loc", "$home");
    bson_append_document_end(&meta, &tags);
    bson_append_document_end(&lit, &meta);
    bson_append_document_end(&set, &lit);
    BSON_APPEND_INT32(&set, "page", 0);
    BSON_APPEND_INT64(&set, "w.gw-1", seq);
    bson_append_document_end(&st, &set);
    bson_append_document_end(&s->update, &st);
    BSON_APPEND_DOCUMENT_BEGIN(&s->update, "1", &st);
    BSON_APPEND_UTF8(&st, "$unset", "_n");
    bson_append_document_end(&s->update, &st);
}

static void sample_destroy(struct sample *s) {
    bson_destroy(&s->filter);
    bson_destroy(&s->update);
}

static struct bd_deadletter_record record_of(const struct sample *s, const char *id, uint64_t seq) {
    return (struct bd_deadletter_record){
        .time_ms = INT64_C(1736953200456),
        .writer_id = "gw-1",
        .seq = seq,
        .database = "telemetry",
        .collection = "buckets",
        .bucket_id = id,
        .n_readings = 2,
        .code = 121,
        .message = "Document failed validation",
        .filter = &s->filter,
        .update = &s->update,
    };
}

/* The line parsed back must carry exactly the record (types included). */
static void check_line(const char *line, size_t len, const struct bd_deadletter_record *rec) {
    bson_error_t berr;
    bson_iter_t it;
    uint32_t n = 0;
    const uint8_t *data = NULL;
    bson_t *doc = bson_new_from_json((const uint8_t *)line, (ssize_t)len, &berr);
    cr_assert_not_null(doc, "line does not parse: %s: %.*s", berr.message, (int)len, line);

    static const char *const keys[] = {"time",       "writer_id", "seq",        "database",
                                       "collection", "bucket_id", "n_readings", "code",
                                       "message",    "filter",    "update"};
    cr_assert(bson_iter_init(&it, doc));
    for (size_t i = 0; i < BD_ARRAY_LEN(keys); i++) {
        cr_assert(bson_iter_next(&it), "missing %s", keys[i]);
        cr_assert_str_eq(bson_iter_key(&it), keys[i], "keys in the documented order");
    }
    cr_assert_not(bson_iter_next(&it), "no other key");

    cr_assert(bson_iter_init_find(&it, doc, "time") && BSON_ITER_HOLDS_DATE_TIME(&it));
    cr_assert_eq(bson_iter_date_time(&it), rec->time_ms);
    cr_assert(bson_iter_init_find(&it, doc, "writer_id") && BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), rec->writer_id);
    cr_assert(bson_iter_init_find(&it, doc, "seq") && BSON_ITER_HOLDS_INT64(&it));
    cr_assert_eq((uint64_t)bson_iter_int64(&it), rec->seq);
    cr_assert(bson_iter_init_find(&it, doc, "database") && BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), rec->database);
    cr_assert(bson_iter_init_find(&it, doc, "collection") && BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), rec->collection);
    cr_assert(bson_iter_init_find(&it, doc, "bucket_id") && BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), rec->bucket_id);
    cr_assert(bson_iter_init_find(&it, doc, "n_readings") && BSON_ITER_HOLDS_INT64(&it));
    cr_assert_eq(bson_iter_int64(&it), (int64_t)rec->n_readings);
    cr_assert(bson_iter_init_find(&it, doc, "code") && BSON_ITER_HOLDS_INT64(&it));
    cr_assert_eq(bson_iter_int64(&it), rec->code);
    cr_assert(bson_iter_init_find(&it, doc, "message") && BSON_ITER_HOLDS_UTF8(&it));
    cr_assert_str_eq(bson_iter_utf8(&it, NULL), rec->message);

    bson_t sub;
    cr_assert(bson_iter_init_find(&it, doc, "filter") && BSON_ITER_HOLDS_DOCUMENT(&it));
    bson_iter_document(&it, &n, &data);
    cr_assert(bson_init_static(&sub, data, n));
    cr_assert(bson_equal(&sub, rec->filter), "filter differs: %s",
              bson_as_canonical_extended_json(&sub, NULL));
    cr_assert(bson_iter_init_find(&it, doc, "update") && BSON_ITER_HOLDS_ARRAY(&it));
    bson_iter_array(&it, &n, &data);
    cr_assert(bson_init_static(&sub, data, n));
    cr_assert(bson_equal(&sub, rec->update), "update differs: %s",
              bson_as_canonical_extended_json(&sub, NULL));
    bson_destroy(doc);
}

/* Every line of the file against recs, in order. */
static void check_file(const struct bd_deadletter_record *recs, size_t n) {
    size_t len = 0;
    char *text = slurp(path, &len);
    cr_assert_eq(count_lines(text), n, "%zu records expected in:\n%s", n, text);
    cr_assert(len == 0 || text[len - 1] == '\n', "the file ends with a newline");
    const char *p = text;
    for (size_t i = 0; i < n; i++) {
        const char *nl = strchr(p, '\n');
        check_line(p, (size_t)(nl - p), &recs[i]);
        p = nl + 1;
    }
    free(text);
}

/* ------------------------------------------------------------------------------------------ */
/* Tests                                                                                      */

Test(deadletter, records_read_back_to_what_was_written) {
    struct sample a, b;
    sample_init(&a, "weather,loc=$home|1736949600|0", 81234);
    sample_init(&b, "weather,loc=$home|1736953200|3", INT64_MAX);
    struct bd_deadletter_record recs[3] = {
        record_of(&a, "weather,loc=$home|1736949600|0", 81234),
        record_of(&b, "weather,loc=$home|1736953200|3", (uint64_t)INT64_MAX),
        record_of(&a, "weather,loc=$home|1736949600|0", 81234),
    };
    recs[1].code = 0;
    recs[1].message = "no code: \"quoted\", new\nline, \xc3\xa9";
    recs[1].time_ms = -1;
    recs[2].n_readings = UINT32_MAX;
    recs[2].code = INT64_MIN;

    struct bd_deadletter *dl = open_ok();
    cr_assert_str_eq(bd_deadletter_path(dl), path);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0, "open creates the file");
    cr_assert_eq(st.st_size, 0);
    cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);
    for (size_t i = 0; i < BD_ARRAY_LEN(recs); i++) {
        append_ok(dl, &recs[i]);
    }
    bd_deadletter_close(dl);
    check_file(recs, BD_ARRAY_LEN(recs));

    /* Reopening keeps the records and appends after them. */
    dl = open_ok();
    append_ok(dl, &recs[0]);
    bd_deadletter_close(dl);
    struct bd_deadletter_record again[4] = {recs[0], recs[1], recs[2], recs[0]};
    check_file(again, 4);
    sample_destroy(&a);
    sample_destroy(&b);
}

/*
 * The exact bytes of one small record. tests/e2e/test_dead_letter.py writes dead-letter files
 * itself and checks that its writer produces this same line, so both stay in the one format.
 */
Test(deadletter, line_format_is_canonical_extended_json) {
    static const char want[] =
        "{ \"time\" : { \"$date\" : { \"$numberLong\" : \"1736953200456\" } }, "
        "\"writer_id\" : \"gw-1\", \"seq\" : { \"$numberLong\" : \"42\" }, "
        "\"database\" : \"telemetry\", \"collection\" : \"buckets\", "
        "\"bucket_id\" : \"s,a=b|1736949600|0\", \"n_readings\" : { \"$numberLong\" : \"1\" }, "
        "\"code\" : { \"$numberLong\" : \"121\" }, \"message\" : \"Document failed validation\", "
        "\"filter\" : { \"_id\" : \"s,a=b|1736949600|0\", \"w.gw-1\" : { \"$not\" : { \"$gte\" : "
        "{ \"$numberLong\" : \"42\" } } } }, "
        "\"update\" : [ { \"$set\" : { \"x\" : { \"$numberDouble\" : \"21.5\" }, "
        "\"w.gw-1\" : { \"$numberLong\" : \"42\" } } }, { \"$unset\" : \"_n\" } ] }\n";
    bson_t *filter = BCON_NEW("_id", BCON_UTF8("s,a=b|1736949600|0"), "w.gw-1", "{", "$not", "{",
                              "$gte", BCON_INT64(42), "}", "}");
    bson_t *update = BCON_NEW("0", "{", "$set", "{", "x", BCON_DOUBLE(21.5), "w.gw-1",
                              BCON_INT64(42), "}", "}", "1", "{", "$unset", BCON_UTF8("_n"), "}");
    struct bd_deadletter_record rec = {
        .time_ms = INT64_C(1736953200456),
        .writer_id = "gw-1",
        .seq = 42,
        .database = "telemetry",
        .collection = "buckets",
        .bucket_id = "s,a=b|1736949600|0",
        .n_readings = 1,
        .code = 121,
        .message = "Document failed validation",
        .filter = filter,
        .update = update,
    };
    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    char *text = slurp(path, NULL);
    cr_assert_str_eq(text, want);
    free(text);
    bson_destroy(filter);
    bson_destroy(update);
}

Test(deadletter, torn_tail_is_cut_off_at_open) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    size_t good = 0;
    free(slurp(path, &good));

    /* A crash in the middle of the second record's write. */
    spit(path, "{ \"time\" : { \"$date\" : { \"$numberLong\" : \"17", O_APPEND);
    dl = open_ok();
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((size_t)st.st_size, good, "the torn line is gone (size %lld, want %zu)",
                 (long long)st.st_size, good);
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    struct bd_deadletter_record two[2] = {rec, rec};
    check_file(two, 2);
    sample_destroy(&a);
}

Test(deadletter, torn_tail_appearing_while_open_is_cut_off_before_the_next_append) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    spit(path, "{ \"half", O_APPEND);
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    struct bd_deadletter_record two[2] = {rec, rec};
    check_file(two, 2);
    sample_destroy(&a);
}

Test(deadletter, file_of_one_torn_line_becomes_empty) {
    spit(path, "{ \"time\" : { \"$da", O_TRUNC);
    struct bd_deadletter *dl = open_ok();
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 0);
    bd_deadletter_close(dl);
}

Test(deadletter, whole_record_without_newline_is_kept) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    /* Drop the newline only: the write stopped one byte short, or an editor removed it. */
    size_t len = 0;
    char *text = slurp(path, &len);
    cr_assert_eq(truncate(path, (off_t)len - 1), 0);
    free(text);

    dl = open_ok();
    append_ok(dl, &rec);
    bd_deadletter_close(dl);
    struct bd_deadletter_record two[2] = {rec, rec};
    check_file(two, 2);
    sample_destroy(&a);
}

Test(deadletter, size_cap_refuses_records_past_it) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    struct bd_err err = {0};

    /* The size of one record's line. */
    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    size_t line = 0;
    free(slurp(path, &line));

    /* A (sparse) file that leaves room for exactly one more record: its last byte a newline. */
    int fd = open(path, O_WRONLY | O_TRUNC);
    cr_assert_geq(fd, 0);
    cr_assert_eq(ftruncate(fd, (off_t)(BD_DEADLETTER_MAX_BYTES - line - 1)), 0);
    cr_assert_eq(pwrite(fd, "\n", 1, (off_t)(BD_DEADLETTER_MAX_BYTES - line - 1)), 1);
    close(fd);

    append_ok(dl, &rec);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((uint64_t)st.st_size, BD_DEADLETTER_MAX_BYTES, "filled to the cap exactly");

    cr_assert_eq(bd_deadletter_append(dl, &rec, &err), -ENOSPC);
    cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((uint64_t)st.st_size, BD_DEADLETTER_MAX_BYTES, "nothing written past the cap");
    bd_deadletter_close(dl);
    sample_destroy(&a);
}

Test(deadletter, bad_directory_errors_name_the_path) {
    struct bd_deadletter *dl = (struct bd_deadletter *)1;
    struct bd_err err = {0};
    char bad[320];

    snprintf(bad, sizeof(bad), "%s/missing", dir);
    cr_assert_eq(bd_deadletter_open(&dl, bad, &err), -ENOENT);
    cr_assert_null(dl);
    cr_assert_not_null(strstr(err.msg, bad), "%s", err.msg);

    snprintf(bad, sizeof(bad), "%s/plain-file", dir);
    spit(bad, "x", O_TRUNC);
    cr_assert_eq(bd_deadletter_open(&dl, bad, &err), -ENOTDIR);
    cr_assert_not_null(strstr(err.msg, bad), "%s", err.msg);

    /* The file's own name taken by a directory. */
    cr_assert_eq(mkdir(path, 0700), 0);
    cr_assert_lt(bd_deadletter_open(&dl, dir, &err), 0);
    cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
    cr_assert_eq(rmdir(path), 0);

    /* Without write permission (root writes anyway, so only checked for other users). */
    if (geteuid() != 0) {
        cr_assert_eq(chmod(dir, 0500), 0);
        cr_assert_eq(bd_deadletter_open(&dl, dir, &err), -EACCES);
        cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
        cr_assert_eq(chmod(dir, 0700), 0);
    }
}

Test(deadletter, append_fails_cleanly_and_names_the_path) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    struct bd_err err = {0};
    struct bd_deadletter *dl = open_ok();

    /* A string JSON cannot carry: refused, nothing written. */
    rec.bucket_id = "bad \xff utf-8";
    cr_assert_eq(bd_deadletter_append(dl, &rec, &err), -EINVAL);
    cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 0);

    /* A bad byte in MongoDB's message only costs that byte. */
    rec.bucket_id = "s|0|0";
    rec.message = "bad \xff byte";
    append_ok(dl, &rec);
    rec.message = "bad ? byte";
    check_file(&rec, 1);

    /* The directory gone: the error names the file. */
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(bd_deadletter_append(dl, &rec, &err), -ENOENT);
    cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
    cr_assert_eq(mkdir(dir, 0700), 0);
    bd_deadletter_close(dl);
    sample_destroy(&a);
}

Test(deadletter, file_moved_away_while_open_starts_a_new_file) {
    struct sample a;
    sample_init(&a, "s|0|0", 7);
    struct bd_deadletter_record rec = record_of(&a, "s|0|0", 7);
    char moved[400];
    snprintf(moved, sizeof(moved), "%s.archived", path);

    struct bd_deadletter *dl = open_ok();
    append_ok(dl, &rec);
    cr_assert_eq(rename(path, moved), 0);
    rec.seq = 8;
    append_ok(dl, &rec);
    bd_deadletter_close(dl);

    check_file(&rec, 1);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600);
    char *old = slurp(moved, NULL);
    cr_assert_eq(count_lines(old), 1, "the moved file keeps its record only");
    free(old);
    sample_destroy(&a);
}

Test(deadletter, close_null_is_a_no_op) {
    bd_deadletter_close(NULL);
}
