/*
 * bucketd-inspect's shared parts: the parsed options and the settings every command runs with,
 * the MongoDB connection, and the helpers more than one command's file needs (output escaped
 * for a terminal, stored numbers and their formatting, times, BSON type names), defined in
 * tools/inspect_common.c. The commands live in tools/bucketd-inspect.c (usage, arguments,
 * buckets, summaries rebuild, sensors, main), tools/inspect_verify.c (verify) and
 * tools/inspect_deadletter.c (dead-letter list|replay); top in tools/inspect_top.c.
 */
#ifndef BUCKETD_INSPECT_H
#define BUCKETD_INSPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <mongoc/mongoc.h>

#include "bucketd/common.h"
#include "bucketd/config.h"

/* Documents per reply: pages hold up to max_readings readings, so keep batches modest. */
#define BATCH_SIZE 64

/* Exit statuses, as the usage text lists them. */
#define EXIT_PROBLEMS 1
#define EXIT_USAGE 2

/* Type masks for field checks; every type checked for is below 32. */
#define T_BIT(t) (UINT32_C(1) << (t))
#define T_INT (T_BIT(BSON_TYPE_INT32) | T_BIT(BSON_TYPE_INT64))
#define T_NUM (T_INT | T_BIT(BSON_TYPE_DOUBLE))

/* The command given; its options by id (their table and parser are in bucketd-inspect.c). */
enum command {
    CMD_NONE = 0,
    CMD_BUCKETS,
    CMD_VERIFY,
    CMD_DL_LIST,
    CMD_DL_REPLAY,
    CMD_SUMMARIES_REBUILD,
    CMD_SENSORS,
    CMD_TOP
};

enum opt_id {
    OPT_CONFIG,
    OPT_URI,
    OPT_URI_FILE,
    OPT_DATABASE,
    OPT_COLLECTION,
    OPT_SUMMARY_COLLECTION,
    OPT_SENSOR,
    OPT_FROM,
    OPT_TO,
    OPT_JSON,
    OPT_TABLE,
    OPT_RAW_NAMES,
    OPT_MAX_READINGS,
    OPT_SPAN,
    OPT_FILE,
    OPT_DRY_RUN,
    OPT_SUMMARIES,
    OPT_SILENT,
    OPT_METRICS,
    OPT_INTERVAL,
    OPT_ONCE,
    OPT_HELP,
    OPT_VERSION,
    N_OPTS
};

/* The command line as parsed. */
struct options {
    enum command cmd;
    const char *value[N_OPTS]; /* last value given, NULL if the option was not given */
    bool given[N_OPTS];
    int64_t from_ms, to_ms;
    uint64_t silent_ms;
    bool table;
    bool raw_names;
};

/* What the command runs with, after the config file and the options are merged. */
struct settings {
    const char *uri;
    char uri_buf[BD_CONFIG_URI_MAX]; /* read from --uri-file */
    const char *database;
    const char *collection;
    char summary_collection[BD_SUMMARY_COLLECTION_MAX];
    uint64_t span_ms;
    uint32_t max_readings;
    const char *write_concern;
    uint64_t wtimeout_ms;
    const char *spool_dir;
};

/* One client for the run and the bucket collection; all NULL for a command that needs no
 * server (inspect_conn_close accepts that). */
struct conn {
    mongoc_uri_t *uri;
    mongoc_client_t *client;
    mongoc_collection_t *coll;
};

/* A stored numeric value in its own kind: int32/int64 as is_int, double otherwise. */
struct num {
    bool is_int;
    union {
        double f;
        int64_t i;
    } v;
};

/* Output: text from the documents through bd_escape (inspect_put_safe); JSON with what a
 * terminal acts on written as \u escapes (inspect_put_json). */
void inspect_put_safe(const char *s);
void inspect_put_json(const char *s);

/* Numbers: the stored value at it, if numeric; as a double; compared as MongoDB does (2 when a
 * NaN leaves them unordered); printed with as many digits as read back the same. */
bool inspect_num_get(const bson_iter_t *it, struct num *out);
double inspect_num_as_double(const struct num *n);
int inspect_num_cmp(const struct num *a, const struct num *b);
void inspect_fmt_double(double v, char *buf, size_t cap);
void inspect_fmt_num(const struct num *n, char *buf, size_t cap);

/* Times: ms since the epoch as RFC 3339 in UTC; Unix seconds or RFC 3339 to ms (-EINVAL,
 * -ERANGE). */
void inspect_fmt_time(int64_t ms, char *buf, size_t cap);
int inspect_parse_time(const char *s, int64_t *out_ms);

/* BSON types: a type's name for messages; whether it is in a T_* mask; a value as relaxed
 * extended JSON (malloc'd, NULL on OOM). */
const char *inspect_type_name(bson_type_t t);
bool inspect_type_in(bson_type_t t, uint32_t mask);
char *inspect_value_json(const bson_iter_t *it);

/* Grows *buf of elem-sized items to hold need of them (doubling); 0 or -ENOMEM. */
int inspect_grow(void **buf, size_t *cap, size_t need, size_t elem);

/* The connection: opened as the daemon connects (error API 2); closed when zeroed or open. */
int inspect_conn_open(struct conn *c, const struct settings *s, struct bd_err *err);
void inspect_conn_close(struct conn *c);
/* After mongoc_cursor_next() returned false: 0 at the end, or -EIO with the reason. */
int inspect_cursor_status(mongoc_cursor_t *cursor, const struct settings *s, struct bd_err *err);

/* verify [--summaries]: prints one line per problem and the totals; *status is EXIT_PROBLEMS
 * when it found any. 0, or negative with err set. */
int inspect_verify(struct conn *c, const struct options *o, const struct settings *s, int *status,
                   struct bd_err *err);

/* dead-letter list|replay; *status is EXIT_PROBLEMS when a line was unreadable or a record
 * refused. 0, or negative with err set. */
int inspect_dead_letter(struct conn *c, const struct options *o, const struct settings *s,
                        int *status, struct bd_err *err);

#endif
