/*
 * bucketd-inspect: reads the bucket documents bucketd wrote (README "Document schema") for
 * operators after an incident and for the tests.
 *
 *   buckets  prints one sensor's bucket pages in a time range, as extended JSON (one document
 *            per line) or as a table of hourly figures combined over the pages of each bucket;
 *   verify   scans the collection (or one sensor) and reports every document that breaks an
 *            invariant of the schema, one line per problem;
 *   sensors  lists the sensors of the summary collection by their newest bucket, oldest first;
 *            with --silent, only those whose newest bucket ended longer ago (a daemon that
 *            restarted no longer knows when its sensors last reported);
 *   top      a live view of a running daemon from its /metrics (tools/inspect_top.c);
 *   dead-letter list|replay
 *            shows the updates MongoDB refused for good (<spool.dir>/dead-letter.jsonl, see
 *            include/bucketd/deadletter.h) and sends them again once the cause is fixed. Replay
 *            marks each page it changes with replayed.<record id> instead of the writer's
 *            sequence, so a second replay changes nothing and the daemon's own idempotency
 *            filter is left as it was (details above cmd_replay).
 *
 * It connects exactly as the daemon does: the same URI defaults (bd_mongo_uri_new), the same
 * config file and keys, error API 2. Single-threaded; one mongoc client, owned by main().
 *
 * verify streams: documents come sorted by {sensor_id, bucket_start} (the order of the
 * daemon's index, so a real MongoDB walks the index instead of sorting), in batches, and only
 * the page list of the bucket being read is kept, so memory stays flat however big the
 * collection is.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mongoc/mongoc.h>
#include <xxhash.h>

#include "bucketd/bucket.h"
#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/creds.h"
#include "bucketd/deadletter.h"
#include "bucketd/escape.h"
#include "bucketd/mongo.h"
#include "bucketd/names.h"
#include "bucketd/queries.h"
#include "inspect_top.h"

/* Documents per reply: pages hold up to max_readings readings, so keep batches modest. */
#define BATCH_SIZE 64
/* Relative tolerance for sum and avg: the daemon adds per flush, in another order. */
#define SUM_REL_TOL 1e-9
/* Reading-level problems of one kind listed per document; the rest are counted in one line. */
#define LIST_PER_KIND 5

#define EXIT_PROBLEMS 1
#define EXIT_USAGE 2

static const char usage[] =
    "usage: bucketd-inspect [CONNECTION] buckets --sensor ID [--from T] [--to T]\n"
    "                       [--span DURATION] [--json|--table] [--raw-names]\n"
    "       bucketd-inspect [CONNECTION] verify [--sensor ID] [--max-readings N]\n"
    "                       [--span DURATION] [--summaries]\n"
    "       bucketd-inspect [CONNECTION] summaries rebuild [--sensor ID] [--from T] [--to T]\n"
    "       bucketd-inspect [CONNECTION] sensors [--silent DURATION]\n"
    "       bucketd-inspect [CONNECTION] dead-letter list [--file PATH]\n"
    "       bucketd-inspect [CONNECTION] dead-letter replay [--file PATH] [--dry-run]\n"
    "       bucketd-inspect [-c FILE] top [--metrics URL] [--interval DURATION] [--once]\n"
    "       bucketd-inspect --help | --version\n"
    "\n"
    "Reads the bucket documents bucketd stores in MongoDB, and the updates MongoDB refused.\n"
    "\n"
    "CONNECTION (explicit options override the file; defaults as the daemon's):\n"
    "  -c, --config FILE     bucketd's YAML config: mongodb.uri (or .uri_file,\n"
    "                        .password_file), .database, .collection,\n"
    "                        .write_concern, .wtimeout, buckets.max_readings, buckets.span\n"
    "                        and spool.dir\n"
    "      --uri URI         default mongodb://127.0.0.1:27017/ (bucketd's timeouts apply\n"
    "                        unless the URI sets its own); any local user can read the\n"
    "                        command line: give a URI with a password by --uri-file\n"
    "      --uri-file FILE   a file holding the URI (whitespace around it ignored)\n"
    "                        The URI used: --uri, else --uri-file, else the environment\n"
    "                        variable BUCKETD_MONGODB_URI, else the config file's\n"
    "                        (mongodb.uri, uri_file, password_file), else the default\n"
    "      --database NAME   default telemetry\n"
    "      --collection NAME default buckets\n"
    "      --summary-collection NAME\n"
    "                        default summaries.collection, or <collection>_summary\n"
    "\n"
    "buckets: the pages of one sensor's buckets that hold readings from [--from, --to),\n"
    "sorted by bucket_start then page. T is RFC 3339 (2025-01-15T14:00:00Z) or unix seconds.\n"
    "  --json                one relaxed extended JSON document per line (default)\n"
    "  --table               one row per bucket: pages, count, and per field min, max and avg\n"
    "                        combined over its pages (min of mins, max of maxes,\n"
    "                        sum of sums / sum of counts)\n"
    "  --span DURATION       bucket span, to find the bucket holding --from (default 1h)\n"
    "  --raw-names           field names and tag keys as stored: bucketd stores a name\n"
    "                        MongoDB cannot address escaped ('%' as %25, '.' as %2E, a\n"
    "                        leading '$' as %24, a field named ts as %74s) and this command\n"
    "                        shows the names as sent unless given this (in readings a\n"
    "                        field named ts keeps its stored name beside the timestamp)\n"
    "\n"
    "verify: checks every document's invariants (id, field types, alignment, count, page\n"
    "cap, reading order and range, summaries) and prints one line per problem:\n"
    "  <_id>: <what is wrong> (expected X, found Y)\n"
    "then 'verified D documents, R readings: P problems'. Gaps in a bucket's page numbers and\n"
    "short pages followed by another page are warnings (a rejected update leaves them); they\n"
    "do not count as problems. Beyond the first 5 reading-level problems of one kind in a\n"
    "document, the rest are counted in one line. Names appear as stored (escaped).\n"
    "  --sensor ID           only this sensor\n"
    "  --max-readings N      page cap (default 3600, or buckets.max_readings)\n"
    "  --span DURATION       bucket span: 1h, 15m, ... (default 1h, or buckets.span)\n"
    "  --summaries           also check the summary collection against the pages: one\n"
    "                        summary per bucket, its count, pages, meta and per-field\n"
    "                        min/max/sum/count/avg those of the bucket's readings (a\n"
    "                        summary whose bucket has no pages left is a warning)\n"
    "\n"
    "summaries rebuild: recomputes the summary documents of the buckets with pages in\n"
    "[--from, --to) (of --sensor only, if given) from their pages, as the daemon does after\n"
    "it writes (one aggregate ending in $merge, with mongodb.write_concern); for summaries\n"
    "a crash or an unreachable MongoDB left stale. Safe to run at any time, also while the\n"
    "daemon runs. Prints how many summary documents the range holds afterwards.\n"
    "\n"
    "sensors: the sensors of the summary collection, the one whose newest bucket is the\n"
    "oldest first, one line each: <newest bucket_start> <newest bucket_end> <sensor id>,\n"
    "then 'N sensors'. For a daemon that restarted (GET /sensors of a running one knows\n"
    "each sensor's last reading to the millisecond; this knows its newest bucket). Needs\n"
    "summaries (summaries.interval above 0).\n"
    "  --silent DURATION     only the sensors whose newest bucket ended more than DURATION\n"
    "                        ago (15m, 2h, 72h): quiet at least that long\n"
    "\n"
    "dead-letter list: the updates MongoDB refused for good, one line per record:\n"
    "  <time refused> <record id> <bucket _id> <N> readings code <C>: <message>\n"
    "then 'R records, N readings'. Needs no MongoDB.\n"
    "  --file PATH           default <spool.dir>/dead-letter.jsonl\n"
    "\n"
    "dead-letter replay: sends each record's update again, to the database and collection\n"
    "it was going to (--database/--collection given here override them), and prints per\n"
    "record: applied, already replayed, or refused again (code: message). It does not set\n"
    "the writer's sequence (w.<writer_id>); it marks the page with replayed.<record id>\n"
    "= the time of the replay, and a page already marked is left alone, so running it\n"
    "again is safe. The file is not changed: move it away first, replay the moved file,\n"
    "then keep or delete it (the daemon starts a new file at its next refusal).\n"
    "  --file PATH           default <spool.dir>/dead-letter.jsonl\n"
    "  --dry-run             print each record's filter and update as they would be sent\n"
    "                        (canonical extended JSON) without connecting\n"
    "\n"
    "top: a live view of a running daemon from its /metrics endpoint, redrawn every\n"
    "interval: readings, lines, datagrams and bytes per second by protocol, the listeners\n"
    "(connections, senders refused), drops by reason, buffer pool and spool use, MongoDB\n"
    "reachable or not, writes per second and the bulk write latency (p50/p90/p99 from the\n"
    "histogram, over the interval), sensors tracked and evicted. Rates are differences\n"
    "between two scrapes. 'q' quits. An endpoint that does not answer is shown as an\n"
    "error on the screen and asked again every interval. Needs no MongoDB.\n"
    "  --metrics URL         http://HOST:PORT[/PATH] or HOST:PORT (path /metrics); default\n"
    "                        the config file's metrics.bind (an address of 0.0.0.0 or [::]\n"
    "                        is asked on loopback), else 127.0.0.1:9273\n"
    "  --interval DURATION   between scrapes, 100ms to 1h (default 1s)\n"
    "  --once                print one plain-text snapshot (two scrapes, an interval\n"
    "                        apart) and exit; when stdout is not a terminal, top prints\n"
    "                        such a snapshot every interval without --once\n"
    "\n"
    "Exit status: 0 fine, 1 verify found problems, or dead-letter found unreadable lines or\n"
    "records refused again, 2 bad usage, bad config, MongoDB unreachable, or (top) the\n"
    "metrics endpoint not answering the first time (plain text) or at all (--once).\n";

/*
 * Text from the documents (ids, names, values in messages) was sent by anyone who could reach
 * the daemon: printed through bd_escape, so that it cannot move the cursor, recolour the
 * terminal, start a new line or reverse the text around it.
 */
static void put_safe(const char *s) {
    char buf[BD_ESCAPE_CAP(1024)];
    size_t len = strlen(s);
    while (len > 0) {
        size_t used = bd_escape(buf, sizeof(buf), s, BD_MIN(len, (size_t)1024), BD_ESC_KEEP_QUOTES);
        fputs(buf, stdout);
        s += used;
        len -= used;
    }
}

/* JSON as libbson writes it, with the characters JSON allows raw but a terminal acts on
 * (C1 controls, bidi overrides) written as \u escapes: the same JSON value, safe to print. */
static void put_json(const char *s) {
    char buf[BD_ESCAPE_CAP(1024)];
    size_t len = strlen(s);
    while (len > 0) {
        size_t used = bd_escape_json(buf, sizeof(buf), s, BD_MIN(len, (size_t)1024));
        fputs(buf, stdout);
        s += used;
        len -= used;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Numbers, times and type names                                                            */

/* A stored numeric value in its own kind: int32/int64 as is_int, double otherwise. */
struct num {
    bool is_int;
    union {
        double f;
        int64_t i;
    } v;
};

static bool num_get(const bson_iter_t *it, struct num *out) {
    switch (bson_iter_type(it)) {
    case BSON_TYPE_DOUBLE:
        out->is_int = false;
        out->v.f = bson_iter_double(it);
        return true;
    case BSON_TYPE_INT32:
        out->is_int = true;
        out->v.i = bson_iter_int32(it);
        return true;
    case BSON_TYPE_INT64:
        out->is_int = true;
        out->v.i = bson_iter_int64(it);
        return true;
    default:
        return false;
    }
}

static double num_as_double(const struct num *n) {
    return n->is_int ? (double)n->v.i : n->v.f;
}

/*
 * -1, 0 or 1 as MongoDB compares numbers; 2 when a NaN makes them unordered. Mixed kinds go
 * through long double, which holds every int64 exactly (64-bit mantissa on x86-64, binary128
 * on aarch64), so 2^53 + 1 and 2^53 stay apart.
 */
static int num_cmp(const struct num *a, const struct num *b) {
    if (a->is_int && b->is_int) {
        return (a->v.i > b->v.i) - (a->v.i < b->v.i);
    }
    long double x = a->is_int ? (long double)a->v.i : (long double)a->v.f;
    long double y = b->is_int ? (long double)b->v.i : (long double)b->v.f;
    if (x < y) {
        return -1;
    }
    if (x > y) {
        return 1;
    }
    return x == y ? 0 : 2;
}

/* The shortest of 15, 16 or 17 significant digits that reads back as the same double. */
static void fmt_double(double v, char *buf, size_t cap) {
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (!isfinite(v) || strtod(buf, NULL) == v) {
            break;
        }
    }
}

static void fmt_num(const struct num *n, char *buf, size_t cap) {
    if (n->is_int) {
        snprintf(buf, cap, "%" PRId64, n->v.i);
    } else {
        fmt_double(n->v.f, buf, cap);
    }
}

/* RFC 3339 in UTC, with milliseconds only when there are some. */
static void fmt_time(int64_t ms, char *buf, size_t cap) {
    int64_t s = bd_floor_div(ms, 1000);
    int frac = (int)(ms - s * 1000);
    time_t t = (time_t)s;
    struct tm tm;
    size_t n = 0;
    if (gmtime_r(&t, &tm) != NULL) {
        n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    }
    if (n == 0) {
        snprintf(buf, cap, "%" PRId64 " ms", ms);
        return;
    }
    if (frac != 0) {
        snprintf(buf + n, cap - n, ".%03dZ", frac);
    } else {
        snprintf(buf + n, cap - n, "Z");
    }
}

/* Days since 1970-01-01 of a proleptic Gregorian date (no time_t range or TZ involved). */
static int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
    y -= m <= 2;
    int64_t era = bd_floor_div(y, 400);
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static bool read_digits(const char **p, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        char c = (*p)[i];
        if (c < '0' || c > '9') {
            return false;
        }
        v = v * 10 + (c - '0');
    }
    *p += n;
    *out = v;
    return true;
}

static bool parse_i64(const char *s, int64_t *out) {
    if (*s == '\0' || (*s != '-' && (*s < '0' || *s > '9'))) {
        return false;
    }
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0') {
        return false;
    }
    *out = (int64_t)v;
    return true;
}

/*
 * Unix seconds ("1736949600") or RFC 3339 ("2025-01-15T14:00:00Z", with optional fraction and
 * a Z or +hh:mm offset). Fractions finer than a millisecond are truncated, as BSON dates are.
 */
static int parse_time(const char *s, int64_t *out_ms) {
    int64_t secs = 0;
    if (parse_i64(s, &secs)) {
        if (secs > INT64_MAX / 1000 || secs < INT64_MIN / 1000) {
            return -ERANGE;
        }
        *out_ms = secs * 1000;
        return 0;
    }
    static const int mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    const char *p = s;
    int y, mo, d, h, mi, sec, ms = 0, off_min = 0;
    if (!read_digits(&p, 4, &y) || *p++ != '-' || !read_digits(&p, 2, &mo) || *p++ != '-' ||
        !read_digits(&p, 2, &d) || (*p != 'T' && *p != 't' && *p != ' ')) {
        return -EINVAL;
    }
    p++;
    if (!read_digits(&p, 2, &h) || *p++ != ':' || !read_digits(&p, 2, &mi) || *p++ != ':' ||
        !read_digits(&p, 2, &sec)) {
        return -EINVAL;
    }
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9') {
            return -EINVAL;
        }
        for (int scale = 100; *p >= '0' && *p <= '9'; p++, scale /= 10) {
            ms += (*p - '0') * scale;
        }
    }
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int sign = *p++ == '-' ? -1 : 1;
        int oh, om;
        if (!read_digits(&p, 2, &oh) || *p++ != ':' || !read_digits(&p, 2, &om) || oh > 23 ||
            om > 59) {
            return -EINVAL;
        }
        off_min = sign * (oh * 60 + om);
    } else {
        return -EINVAL;
    }
    bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    if (*p != '\0' || mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1] ||
        (mo == 2 && d == 29 && !leap) || h > 23 || mi > 59 || sec > 60) {
        return -EINVAL;
    }
    int64_t t = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec - off_min * 60;
    *out_ms = t * 1000 + ms;
    return 0;
}

static const char *type_name(bson_type_t t) {
    switch (t) {
    case BSON_TYPE_DOUBLE:
        return "double";
    case BSON_TYPE_UTF8:
        return "string";
    case BSON_TYPE_DOCUMENT:
        return "document";
    case BSON_TYPE_ARRAY:
        return "array";
    case BSON_TYPE_BINARY:
        return "binary";
    case BSON_TYPE_OID:
        return "objectId";
    case BSON_TYPE_BOOL:
        return "bool";
    case BSON_TYPE_DATE_TIME:
        return "date";
    case BSON_TYPE_NULL:
        return "null";
    case BSON_TYPE_INT32:
        return "int32";
    case BSON_TYPE_TIMESTAMP:
        return "timestamp";
    case BSON_TYPE_INT64:
        return "int64";
    case BSON_TYPE_DECIMAL128:
        return "decimal128";
    default:
        return "another BSON type";
    }
}

/* Type masks for field checks; every type checked for is below 32. */
#define T_BIT(t) (UINT32_C(1) << (t))
#define T_INT (T_BIT(BSON_TYPE_INT32) | T_BIT(BSON_TYPE_INT64))
#define T_NUM (T_INT | T_BIT(BSON_TYPE_DOUBLE))

static bool type_in(bson_type_t t, uint32_t mask) {
    return (unsigned)t < 32 && (mask & T_BIT(t)) != 0;
}

/* A value as relaxed extended JSON (malloc'd), for messages; NULL on OOM. */
static char *value_json(const bson_iter_t *it) {
    bson_t tmp = BSON_INITIALIZER;
    char *json = NULL;
    if (bson_append_iter(&tmp, "v", 1, it)) {
        char *doc = bson_as_relaxed_extended_json(&tmp, NULL);
        /* The document reads '{ "v" : VALUE }': keep VALUE. */
        if (doc != NULL && strlen(doc) > 10) {
            size_t len = strlen(doc) - 10;
            json = bson_malloc(len + 1);
            memcpy(json, doc + 8, len);
            json[len] = '\0';
        }
        bson_free(doc);
    }
    bson_destroy(&tmp);
    return json;
}

/* ---------------------------------------------------------------------------------------- */
/* Options and connection                                                                   */

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

static const char *const command_names[] = {
    [CMD_NONE] = "",
    [CMD_BUCKETS] = "buckets",
    [CMD_VERIFY] = "verify",
    [CMD_DL_LIST] = "dead-letter list",
    [CMD_DL_REPLAY] = "dead-letter replay",
    [CMD_SUMMARIES_REBUILD] = "summaries rebuild",
    [CMD_SENSORS] = "sensors",
    [CMD_TOP] = "top",
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

#define FOR_ANY 0u
#define FOR_BUCKETS (1u << CMD_BUCKETS)
#define FOR_VERIFY (1u << CMD_VERIFY)
#define FOR_DL_LIST (1u << CMD_DL_LIST)
#define FOR_DL_REPLAY (1u << CMD_DL_REPLAY)
#define FOR_SUMMARIES (1u << CMD_SUMMARIES_REBUILD)
#define FOR_SENSORS (1u << CMD_SENSORS)
#define FOR_TOP (1u << CMD_TOP)

static const struct opt_def {
    const char *name;
    const char *alias; /* short form or NULL */
    bool has_value;
    unsigned cmds; /* commands that take it; FOR_ANY: every one */
} opt_defs[N_OPTS] = {
    [OPT_CONFIG] = {"--config", "-c", true, FOR_ANY},
    [OPT_URI] = {"--uri", NULL, true, FOR_ANY},
    [OPT_URI_FILE] = {"--uri-file", NULL, true, FOR_ANY},
    [OPT_DATABASE] = {"--database", NULL, true, FOR_ANY},
    [OPT_COLLECTION] = {"--collection", NULL, true, FOR_ANY},
    [OPT_SUMMARY_COLLECTION] = {"--summary-collection", NULL, true, FOR_ANY},
    [OPT_SENSOR] = {"--sensor", NULL, true, FOR_BUCKETS | FOR_VERIFY | FOR_SUMMARIES},
    [OPT_FROM] = {"--from", NULL, true, FOR_BUCKETS | FOR_SUMMARIES},
    [OPT_TO] = {"--to", NULL, true, FOR_BUCKETS | FOR_SUMMARIES},
    [OPT_JSON] = {"--json", NULL, false, FOR_BUCKETS},
    [OPT_TABLE] = {"--table", NULL, false, FOR_BUCKETS},
    [OPT_RAW_NAMES] = {"--raw-names", NULL, false, FOR_BUCKETS},
    [OPT_MAX_READINGS] = {"--max-readings", NULL, true, FOR_VERIFY},
    [OPT_SPAN] = {"--span", NULL, true, FOR_BUCKETS | FOR_VERIFY},
    [OPT_FILE] = {"--file", NULL, true, FOR_DL_LIST | FOR_DL_REPLAY},
    [OPT_DRY_RUN] = {"--dry-run", NULL, false, FOR_DL_REPLAY},
    [OPT_SUMMARIES] = {"--summaries", NULL, false, FOR_VERIFY},
    [OPT_SILENT] = {"--silent", NULL, true, FOR_SENSORS},
    [OPT_METRICS] = {"--metrics", NULL, true, FOR_TOP},
    [OPT_INTERVAL] = {"--interval", NULL, true, FOR_TOP},
    [OPT_ONCE] = {"--once", NULL, false, FOR_TOP},
    [OPT_HELP] = {"--help", "-h", false, FOR_ANY},
    [OPT_VERSION] = {"--version", NULL, false, FOR_ANY},
};

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

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int bad_usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("bucketd-inspect: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\nTry 'bucketd-inspect --help'.\n", stderr);
    va_end(ap);
    return EXIT_USAGE;
}

static int find_opt(const char *a, const char **inline_val) {
    *inline_val = NULL;
    for (int k = 0; k < N_OPTS; k++) {
        const struct opt_def *d = &opt_defs[k];
        size_t nl = strlen(d->name);
        if (strcmp(a, d->name) == 0 || (d->alias != NULL && strcmp(a, d->alias) == 0)) {
            return k;
        }
        if (d->has_value && strncmp(a, d->name, nl) == 0 && a[nl] == '=') {
            *inline_val = a + nl + 1;
            return k;
        }
    }
    return -1;
}

/* 0 to run, -1 to exit 0 at once (--help, --version), or EXIT_USAGE (already reported). */
static int parse_args(int argc, char **argv, struct options *o) {
    bool dead_letter = false; /* "dead-letter" seen, its subcommand not yet */
    bool summaries = false;   /* "summaries" seen, its subcommand not yet */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || a[1] == '\0') {
            if (summaries) {
                summaries = false;
                if (strcmp(a, "rebuild") != 0) {
                    return bad_usage("unknown summaries command '%s' (rebuild)", a);
                }
                o->cmd = CMD_SUMMARIES_REBUILD;
                continue;
            }
            if (dead_letter) {
                dead_letter = false;
                if (strcmp(a, "list") == 0) {
                    o->cmd = CMD_DL_LIST;
                } else if (strcmp(a, "replay") == 0) {
                    o->cmd = CMD_DL_REPLAY;
                } else {
                    return bad_usage("unknown dead-letter command '%s' (list or replay)", a);
                }
                continue;
            }
            if (o->cmd != CMD_NONE) {
                return bad_usage("unexpected argument '%s'", a);
            }
            if (strcmp(a, "buckets") == 0) {
                o->cmd = CMD_BUCKETS;
            } else if (strcmp(a, "verify") == 0) {
                o->cmd = CMD_VERIFY;
            } else if (strcmp(a, "dead-letter") == 0) {
                dead_letter = true;
            } else if (strcmp(a, "summaries") == 0) {
                summaries = true;
            } else if (strcmp(a, "sensors") == 0) {
                o->cmd = CMD_SENSORS;
            } else if (strcmp(a, "top") == 0) {
                o->cmd = CMD_TOP;
            } else {
                return bad_usage("unknown command '%s' (buckets, verify, summaries, sensors, "
                                 "dead-letter or top)",
                                 a);
            }
            continue;
        }
        const char *val = NULL;
        int k = find_opt(a, &val);
        if (k < 0) {
            return bad_usage("unknown option '%s'", a);
        }
        if (k == OPT_HELP) {
            fputs(usage, stdout);
            return -1;
        }
        if (k == OPT_VERSION) {
            printf("bucketd-inspect %s\n", BD_VERSION);
            return -1;
        }
        if (opt_defs[k].has_value && val == NULL) {
            if (i + 1 == argc) {
                return bad_usage("option '%s' needs a value", a);
            }
            val = argv[++i];
        }
        o->given[k] = true;
        o->value[k] = val;
    }
    if (dead_letter) {
        return bad_usage("dead-letter needs a command (list or replay)");
    }
    if (summaries) {
        return bad_usage("summaries needs a command (rebuild)");
    }
    if (o->cmd == CMD_NONE) {
        return bad_usage("no command given (buckets, verify, summaries, sensors, dead-letter "
                         "or top)");
    }
    for (int k = 0; k < N_OPTS; k++) {
        if (o->given[k] && opt_defs[k].cmds != FOR_ANY && !(opt_defs[k].cmds & (1u << o->cmd))) {
            return bad_usage("option '%s' does not apply to '%s'", opt_defs[k].name,
                             command_names[o->cmd]);
        }
    }
    if (o->cmd == CMD_BUCKETS && !o->given[OPT_SENSOR]) {
        return bad_usage("buckets needs --sensor ID");
    }
    if (o->given[OPT_JSON] && o->given[OPT_TABLE]) {
        return bad_usage("--json and --table exclude each other");
    }
    o->table = o->given[OPT_TABLE];
    o->raw_names = o->given[OPT_RAW_NAMES];
    if (o->given[OPT_FROM] && parse_time(o->value[OPT_FROM], &o->from_ms) < 0) {
        return bad_usage("--from: '%s' is not RFC 3339 or unix seconds", o->value[OPT_FROM]);
    }
    if (o->given[OPT_TO] && parse_time(o->value[OPT_TO], &o->to_ms) < 0) {
        return bad_usage("--to: '%s' is not RFC 3339 or unix seconds", o->value[OPT_TO]);
    }
    if (o->given[OPT_SILENT] && (bd_parse_duration_ms(o->value[OPT_SILENT], &o->silent_ms) < 0 ||
                                 o->silent_ms > (uint64_t)INT64_MAX / 2)) {
        return bad_usage("--silent: '%s' is not a duration (15m, 2h, 72h)", o->value[OPT_SILENT]);
    }
    return 0;
}

/* The config file (or the daemon's defaults), then the explicit options over it. */
static int resolve_settings(const struct options *o, struct bd_config *cfg, struct settings *s,
                            struct bd_err *err) {
    if (o->given[OPT_CONFIG]) {
        int rc = bd_config_load(cfg, o->value[OPT_CONFIG], err);
        if (rc < 0) {
            return rc;
        }
    } else {
        bd_config_defaults(cfg);
    }
    /* Precedence: --uri, --uri-file, $BUCKETD_MONGODB_URI, the config file, the default. */
    const char *env = getenv("BUCKETD_MONGODB_URI");
    if (o->given[OPT_URI] && o->given[OPT_URI_FILE]) {
        return bd_err_set(err, -EINVAL, "--uri and --uri-file exclude each other");
    }
    if (o->given[OPT_URI]) {
        s->uri = o->value[OPT_URI];
    } else if (o->given[OPT_URI_FILE]) {
        int rc = bd_creds_read("--uri-file", o->value[OPT_URI_FILE], s->uri_buf, sizeof(s->uri_buf),
                               err);
        if (rc < 0) {
            return rc;
        }
        s->uri = s->uri_buf;
    } else if (env != NULL && env[0] != '\0') {
        s->uri = env;
    } else {
        s->uri = cfg->mongodb.uri;
    }
    s->database = o->given[OPT_DATABASE] ? o->value[OPT_DATABASE] : cfg->mongodb.database;
    s->collection = o->given[OPT_COLLECTION] ? o->value[OPT_COLLECTION] : cfg->mongodb.collection;
    if (o->given[OPT_SUMMARY_COLLECTION]) {
        snprintf(s->summary_collection, sizeof(s->summary_collection), "%s",
                 o->value[OPT_SUMMARY_COLLECTION]);
    } else if (cfg->summaries.collection[0] == '\0') {
        /* The daemon's default, after the collection given here. */
        snprintf(s->summary_collection, sizeof(s->summary_collection), "%s_summary", s->collection);
    } else {
        bd_config_summary_collection(cfg, s->summary_collection, sizeof(s->summary_collection));
    }
    s->span_ms = cfg->buckets.span_ms;
    s->max_readings = cfg->buckets.max_readings;
    s->write_concern = cfg->mongodb.write_concern;
    s->wtimeout_ms = cfg->mongodb.wtimeout_ms;
    s->spool_dir = cfg->spool.dir;
    if (o->given[OPT_SPAN]) {
        uint64_t span = 0;
        /* The daemon's rule: buckets tile every day the same way. */
        if (bd_parse_duration_ms(o->value[OPT_SPAN], &span) < 0 || span == 0 ||
            (UINT64_C(86400000) % span) != 0) {
            return bd_err_set(err, -EINVAL, "--span: '%s' is not a duration that divides a day",
                              o->value[OPT_SPAN]);
        }
        s->span_ms = span;
    }
    if (o->given[OPT_MAX_READINGS]) {
        int64_t n = 0;
        if (!parse_i64(o->value[OPT_MAX_READINGS], &n) || n < 1 || n > UINT32_MAX) {
            return bd_err_set(err, -EINVAL, "--max-readings: '%s' is not a number >= 1",
                              o->value[OPT_MAX_READINGS]);
        }
        s->max_readings = (uint32_t)n;
    }
    if (*s->database == '\0' || *s->collection == '\0' || *s->summary_collection == '\0') {
        return bd_err_set(err, -EINVAL, "the database and collection names must not be empty");
    }
    if (strcmp(s->summary_collection, s->collection) == 0) {
        return bd_err_set(err, -EINVAL, "the summary collection must differ from the collection");
    }
    return 0;
}

struct conn {
    mongoc_uri_t *uri;
    mongoc_client_t *client;
    mongoc_collection_t *coll;
};

static int conn_open(struct conn *c, const struct settings *s, struct bd_err *err) {
    bson_error_t berr;
    c->uri = bd_mongo_uri_new(s->uri, err);
    if (c->uri == NULL) {
        return -EINVAL;
    }
    c->client = mongoc_client_new_from_uri_with_error(c->uri, &berr);
    if (c->client == NULL) {
        return bd_err_set(err, -EINVAL, "mongodb.uri: %s", berr.message);
    }
    mongoc_client_set_error_api(c->client, MONGOC_ERROR_API_VERSION_2);
    /* Setting it over one from the URI would only log a driver error. */
    if (mongoc_uri_get_appname(c->uri) == NULL) {
        mongoc_client_set_appname(c->client, "bucketd-inspect");
    }
    c->coll = mongoc_client_get_collection(c->client, s->database, s->collection);
    return 0;
}

static void conn_close(struct conn *c) {
    mongoc_collection_destroy(c->coll);
    mongoc_client_destroy(c->client);
    mongoc_uri_destroy(c->uri);
}

/* After mongoc_cursor_next() returned false: 0 at the end, or -EIO with the reason. */
static int cursor_status(mongoc_cursor_t *cursor, const struct settings *s, struct bd_err *err) {
    bson_error_t berr;
    if (!mongoc_cursor_error(cursor, &berr)) {
        return 0;
    }
    if (berr.domain == MONGOC_ERROR_SERVER_SELECTION || berr.domain == MONGOC_ERROR_STREAM) {
        return bd_err_set(err, -EIO, "cannot reach MongoDB: %s", berr.message);
    }
    return bd_err_set(err, -EIO, "reading %s.%s failed: %s", s->database, s->collection,
                      berr.message);
}

/* ---------------------------------------------------------------------------------------- */
/* buckets                                                                                  */

/* {sensor_id: ID, bucket_start: {$gte: from's bucket, $lt: to}}: equality, then range (each
 * only if given). */
static void buckets_filter(const struct options *o, const struct settings *s, bson_t *filter) {
    bson_t range;
    bson_init(filter);
    if (o->given[OPT_SENSOR]) {
        BSON_APPEND_UTF8(filter, "sensor_id", o->value[OPT_SENSOR]);
    }
    if (o->given[OPT_FROM] || o->given[OPT_TO]) {
        BSON_APPEND_DOCUMENT_BEGIN(filter, "bucket_start", &range);
        if (o->given[OPT_FROM]) {
            /* The bucket holding --from starts before it. */
            int64_t span = (int64_t)s->span_ms;
            BSON_APPEND_DATE_TIME(&range, "$gte", bd_floor_div(o->from_ms, span) * span);
        }
        if (o->given[OPT_TO]) {
            BSON_APPEND_DATE_TIME(&range, "$lt", o->to_ms);
        }
        bson_append_document_end(filter, &range);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Names: stored keys shown as the names the sensors sent (include/bucketd/names.h)         */

/*
 * The name a stored key stands for, in a new allocation: the key unescaped. In a reading
 * (in_reading) a key that would read "ts" keeps its stored form: "ts" is the timestamp's.
 */
static char *name_of_key(const char *key, size_t len, bool in_reading) {
    char *name = malloc(len + 1);
    if (name == NULL) {
        return NULL;
    }
    int n = bd_name_unescape(key, len, name, len + 1);
    BD_ASSERT(n >= 0); /* never longer than the key */
    if (in_reading && n == 2 && len != 2 && memcmp(name, "ts", 2) == 0) {
        memcpy(name, key, len + 1);
    }
    return name;
}

/* Appends the sub-document at it to out under its own key, every key inside it renamed by
 * name_of_key. */
static bool append_renamed(bson_t *out, const bson_iter_t *it, bool in_reading) {
    bson_iter_t child;
    bson_t sub;
    if (!bson_iter_recurse(it, &child) ||
        !bson_append_document_begin(out, bson_iter_key(it), -1, &sub)) {
        return false;
    }
    bool ok = true;
    while (ok && bson_iter_next(&child)) {
        char *name = name_of_key(bson_iter_key(&child), bson_iter_key_len(&child), in_reading);
        ok = name != NULL && bson_append_iter(&sub, name, -1, &child);
        free(name);
    }
    return bson_append_document_end(out, &sub) && ok;
}

/* Appends the array at it to out, its documents renamed as readings. */
static bool append_readings_renamed(bson_t *out, const bson_iter_t *it) {
    bson_iter_t child;
    bson_t arr;
    if (!bson_iter_recurse(it, &child) ||
        !bson_append_array_begin(out, bson_iter_key(it), -1, &arr)) {
        return false;
    }
    bool ok = true;
    while (ok && bson_iter_next(&child)) {
        ok = BSON_ITER_HOLDS_DOCUMENT(&child) ? append_renamed(&arr, &child, true)
                                              : bson_append_iter(&arr, NULL, 0, &child);
    }
    return bson_append_array_end(out, &arr) && ok;
}

/* Appends meta to out with its tags renamed. */
static bool append_meta_renamed(bson_t *out, const bson_iter_t *it) {
    bson_iter_t child;
    bson_t meta;
    if (!bson_iter_recurse(it, &child) ||
        !bson_append_document_begin(out, bson_iter_key(it), -1, &meta)) {
        return false;
    }
    bool ok = true;
    while (ok && bson_iter_next(&child)) {
        ok = strcmp(bson_iter_key(&child), "tags") == 0 && BSON_ITER_HOLDS_DOCUMENT(&child)
                 ? append_renamed(&meta, &child, false)
                 : bson_append_iter(&meta, NULL, 0, &child);
    }
    return bson_append_document_end(out, &meta) && ok;
}

/* A bucket document as the sensors named things: field names in readings and summary and tag
 * keys in meta.tags unescaped; everything else as stored. out is always initialised. */
static bool rename_document(const bson_t *doc, bson_t *out) {
    bson_iter_t it;
    bson_init(out);
    if (!bson_iter_init(&it, doc)) {
        return false;
    }
    bool ok = true;
    while (ok && bson_iter_next(&it)) {
        const char *key = bson_iter_key(&it);
        if (strcmp(key, "readings") == 0 && BSON_ITER_HOLDS_ARRAY(&it)) {
            ok = append_readings_renamed(out, &it);
        } else if (strcmp(key, "summary") == 0 && BSON_ITER_HOLDS_DOCUMENT(&it)) {
            ok = append_renamed(out, &it, false);
        } else if (strcmp(key, "meta") == 0 && BSON_ITER_HOLDS_DOCUMENT(&it)) {
            ok = append_meta_renamed(out, &it);
        } else {
            ok = bson_append_iter(out, NULL, 0, &it);
        }
    }
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* buckets                                                                                  */

/* One bucket (all its pages) of the table: per field, the figures combined over pages. */
struct tab_field {
    bool has_min, has_max;
    struct num min, max;
    double sum;
    int64_t count;
};

struct tab_row {
    int64_t start_ms;
    int64_t pages;
    int64_t count;
    struct tab_field *fields; /* indexed like struct table.names */
    size_t n_fields;
};

struct table {
    struct tab_row *rows;
    size_t n_rows, cap_rows;
    char **names; /* every summary field seen, in order of appearance, sorted before printing */
    size_t n_names, cap_names;
    bool raw_names; /* names as stored, not unescaped */
};

static int grow(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) {
        return 0;
    }
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need) {
        n *= 2;
    }
    void *p = realloc(*buf, n * elem);
    if (p == NULL) {
        return -ENOMEM;
    }
    *buf = p;
    *cap = n;
    return 0;
}

static int table_field_index(struct table *t, const char *name, size_t *out) {
    for (size_t i = 0; i < t->n_names; i++) {
        if (strcmp(t->names[i], name) == 0) {
            *out = i;
            return 0;
        }
    }
    char *copy = strdup(name);
    if (copy == NULL ||
        grow((void **)&t->names, &t->cap_names, t->n_names + 1, sizeof(*t->names)) < 0) {
        free(copy);
        return -ENOMEM;
    }
    t->names[t->n_names] = copy;
    *out = t->n_names++;
    return 0;
}

/* Folds one field summary of a page into the row. Malformed parts are skipped: verify's job. */
static void table_fold(struct tab_field *f, bson_iter_t *summary) {
    bson_iter_t it;
    struct num n;
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "min") && num_get(&it, &n) &&
        (!f->has_min || num_cmp(&n, &f->min) < 0)) {
        f->min = n;
        f->has_min = true;
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "max") && num_get(&it, &n) &&
        (!f->has_max || num_cmp(&n, &f->max) > 0)) {
        f->max = n;
        f->has_max = true;
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "sum") && num_get(&it, &n)) {
        f->sum += num_as_double(&n);
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "count") &&
        type_in(bson_iter_type(&it), T_INT)) {
        f->count += bson_iter_as_int64(&it);
    }
}

static int table_add(struct table *t, const bson_t *doc) {
    bson_iter_t it, sum;
    if (!bson_iter_init_find(&it, doc, "bucket_start") || !BSON_ITER_HOLDS_DATE_TIME(&it)) {
        return 0;
    }
    int64_t start = bson_iter_date_time(&it);
    struct tab_row *row = t->n_rows > 0 ? &t->rows[t->n_rows - 1] : NULL;
    if (row == NULL || row->start_ms != start) {
        if (grow((void **)&t->rows, &t->cap_rows, t->n_rows + 1, sizeof(*t->rows)) < 0) {
            return -ENOMEM;
        }
        row = &t->rows[t->n_rows++];
        memset(row, 0, sizeof(*row));
        row->start_ms = start;
    }
    row->pages++;
    if (bson_iter_init_find(&it, doc, "count") && type_in(bson_iter_type(&it), T_INT)) {
        row->count += bson_iter_as_int64(&it);
    }
    if (!bson_iter_init_find(&it, doc, "summary") || !BSON_ITER_HOLDS_DOCUMENT(&it) ||
        !bson_iter_recurse(&it, &sum)) {
        return 0;
    }
    while (bson_iter_next(&sum)) {
        size_t idx = 0;
        if (!BSON_ITER_HOLDS_DOCUMENT(&sum)) {
            continue;
        }
        const char *key = bson_iter_key(&sum);
        char *name = t->raw_names ? NULL : name_of_key(key, bson_iter_key_len(&sum), false);
        if (!t->raw_names && name == NULL) {
            return -ENOMEM;
        }
        int rc = table_field_index(t, name != NULL ? name : key, &idx);
        free(name);
        if (rc < 0) {
            return rc;
        }
        if (idx >= row->n_fields) {
            struct tab_field *p = realloc(row->fields, (idx + 1) * sizeof(*p));
            if (p == NULL) {
                return -ENOMEM;
            }
            memset(p + row->n_fields, 0, (idx + 1 - row->n_fields) * sizeof(*p));
            row->fields = p;
            row->n_fields = idx + 1;
        }
        table_fold(&row->fields[idx], &sum);
    }
    return 0;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Text of one cell; row NULL means the header. Columns: start, pages, count, then per field
 * (in names order) min, max, avg. */
static void table_cell(const struct table *t, const size_t *order, const struct tab_row *row,
                       size_t col, char *buf, size_t cap) {
    static const char *const fixed[] = {"bucket_start", "pages", "count"};
    static const char *const stat[] = {"min", "max", "avg"};
    if (row == NULL) {
        if (col < 3) {
            snprintf(buf, cap, "%s", fixed[col]);
        } else {
            /* The name came from the network; ".min" (4 bytes and the NUL) always fits. */
            const char *raw = t->names[order[(col - 3) / 3]];
            bd_escape(buf, cap - 5, raw, strlen(raw), BD_ESC_KEEP_QUOTES);
            size_t n = strlen(buf);
            snprintf(buf + n, cap - n, ".%s", stat[(col - 3) % 3]);
        }
        return;
    }
    if (col == 0) {
        fmt_time(row->start_ms, buf, cap);
        return;
    }
    if (col < 3) {
        snprintf(buf, cap, "%" PRId64, col == 1 ? row->pages : row->count);
        return;
    }
    size_t idx = order[(col - 3) / 3];
    const struct tab_field *f = idx < row->n_fields ? &row->fields[idx] : NULL;
    snprintf(buf, cap, "-");
    if (f == NULL) {
        return;
    }
    switch ((col - 3) % 3) {
    case 0:
        if (f->has_min) {
            fmt_num(&f->min, buf, cap);
        }
        break;
    case 1:
        if (f->has_max) {
            fmt_num(&f->max, buf, cap);
        }
        break;
    default:
        /* Twelve digits: a combined avg is a figure to read, and the sums it comes from carry
         * rounding noise in the last digits. */
        if (f->count > 0) {
            snprintf(buf, cap, "%.12g", f->sum / (double)f->count);
        }
        break;
    }
}

static int table_print(struct table *t) {
    int rc = 0;
    size_t *order = NULL;
    size_t *width = NULL;
    char cell[256];
    size_t n_cols = 3 + 3 * t->n_names;

    /* Columns sorted by field name, rows by time (the query's order); fields keep their index
     * into every row's array through order[]. */
    char **sorted = malloc((t->n_names + 1) * sizeof(*sorted));
    order = malloc((t->n_names + 1) * sizeof(*order));
    width = calloc(n_cols, sizeof(*width));
    if (sorted == NULL || order == NULL || width == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    memcpy(sorted, t->names, t->n_names * sizeof(*sorted));
    qsort(sorted, t->n_names, sizeof(*sorted), cmp_names);
    for (size_t i = 0; i < t->n_names; i++) {
        for (size_t j = 0; j < t->n_names; j++) {
            if (t->names[j] == sorted[i]) {
                order[i] = j;
            }
        }
    }
    for (size_t r = 0; r <= t->n_rows; r++) {
        for (size_t c = 0; c < n_cols; c++) {
            table_cell(t, order, r == 0 ? NULL : &t->rows[r - 1], c, cell, sizeof(cell));
            width[c] = BD_MAX(width[c], strlen(cell));
        }
    }
    for (size_t r = 0; r <= t->n_rows; r++) {
        for (size_t c = 0; c < n_cols; c++) {
            table_cell(t, order, r == 0 ? NULL : &t->rows[r - 1], c, cell, sizeof(cell));
            /* Times read left to right, numbers line up on their last digit. */
            printf(c == 0 ? "%-*s" : "  %*s", (int)width[c], cell);
        }
        putchar('\n');
    }
out:
    free(sorted);
    free(order);
    free(width);
    return rc;
}

static void table_close(struct table *t) {
    for (size_t i = 0; i < t->n_rows; i++) {
        free(t->rows[i].fields);
    }
    for (size_t i = 0; i < t->n_names; i++) {
        free(t->names[i]);
    }
    free(t->rows);
    free(t->names);
}

static int cmd_buckets(struct conn *c, const struct options *o, const struct settings *s,
                       struct bd_err *err) {
    int rc = 0;
    bson_t filter, opts, sort, proj;
    mongoc_cursor_t *cursor = NULL;
    struct table table = {.raw_names = o->raw_names};
    const bson_t *doc;

    buckets_filter(o, s, &filter);
    bson_init(&opts);
    BSON_APPEND_DOCUMENT_BEGIN(&opts, "sort", &sort);
    BSON_APPEND_INT32(&sort, "bucket_start", 1);
    BSON_APPEND_INT32(&sort, "page", 1);
    bson_append_document_end(&opts, &sort);
    if (o->table) {
        /* The table needs the summaries only; readings are most of a document's bytes. */
        BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
        BSON_APPEND_INT32(&proj, "bucket_start", 1);
        BSON_APPEND_INT32(&proj, "page", 1);
        BSON_APPEND_INT32(&proj, "count", 1);
        BSON_APPEND_INT32(&proj, "summary", 1);
        bson_append_document_end(&opts, &proj);
    }
    BSON_APPEND_INT32(&opts, "batchSize", BATCH_SIZE);
    /* Sorting by page after the index's bucket_start order may spill on a long range. */
    BSON_APPEND_BOOL(&opts, "allowDiskUse", true);

    cursor = mongoc_collection_find_with_opts(c->coll, &filter, &opts, NULL);
    while (mongoc_cursor_next(cursor, &doc)) {
        if (o->table) {
            rc = table_add(&table, doc);
            if (rc < 0) {
                bd_err_set(err, rc, "out of memory");
                goto out;
            }
            continue;
        }
        bson_t renamed = BSON_INITIALIZER;
        char *json = NULL;
        if (o->raw_names) {
            json = bson_as_relaxed_extended_json(doc, NULL);
        } else if (rename_document(doc, &renamed)) {
            json = bson_as_relaxed_extended_json(&renamed, NULL);
        }
        bson_destroy(&renamed);
        if (json == NULL) {
            rc = bd_err_set(err, -EINVAL, "a document could not be printed as JSON");
            goto out;
        }
        put_json(json);
        putchar('\n');
        bson_free(json);
    }
    rc = cursor_status(cursor, s, err);
    if (rc < 0) {
        goto out;
    }
    if (o->table) {
        rc = table_print(&table);
        if (rc < 0) {
            bd_err_set(err, rc, "out of memory");
        }
    }
out:
    mongoc_cursor_destroy(cursor);
    table_close(&table);
    bson_destroy(&opts);
    bson_destroy(&filter);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* verify                                                                                   */

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
    put_safe(id);
    printf(": %s", tag);
    put_safe(msg);
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
    if (!type_in(bson_iter_type(it), types)) {
        problem(v, id, "%s has the wrong type (expected %s, found %s)", path, expected,
                type_name(bson_iter_type(it)));
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
    if (grow((void **)&v->acc, &v->cap_acc, v->n_acc + 1, sizeof(*v->acc)) < 0) {
        return NULL;
    }
    a = &v->acc[v->n_acc++];
    memset(a, 0, sizeof(*a));
    a->name = name;
    return a;
}

static void acc_add(struct field_acc *a, const struct num *n) {
    double x = num_as_double(n);
    if (a->n_num == 0 || num_cmp(n, &a->min) < 0) {
        a->min = *n;
    }
    if (a->n_num == 0 || num_cmp(n, &a->max) > 0) {
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
                            i, type_name(bson_iter_type(arr)));
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
                            i, type_name(bson_iter_type(&it)));
        } else {
            int64_t ts = bson_iter_date_time(&it);
            if (has_prev && ts < prev) {
                fmt_time(prev, a, sizeof(a));
                fmt_time(ts, b, sizeof(b));
                reading_problem(v, id, RK_ORDER,
                                "readings[%" PRId64 "] is out of time order (expected ts >= "
                                "%s, found %s)",
                                i, a, b);
            }
            has_prev = true;
            prev = ts;
            if (has_range && (ts < lo_ms || ts > hi_ms)) {
                fmt_time(lo_ms, a, sizeof(a));
                fmt_time(hi_ms, b, sizeof(b));
                fmt_time(ts, c, sizeof(c));
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
            bool numeric = num_get(&it, &num);
            if (!numeric && !BSON_ITER_HOLDS_BOOL(&it)) {
                reading_problem(v, id, RK_VALUE,
                                "readings[%" PRId64 "].%s has a type bucketd does not store "
                                "(expected double, int32, int64 or bool, found %s)",
                                i, key, type_name(bson_iter_type(&it)));
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
    if (want(v, id, sd, "min", path, T_NUM, "a number", &it) && num_get(&it, &n) &&
        num_cmp(&n, &f->min) != 0) {
        fmt_num(&f->min, a, sizeof(a));
        fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.max", field);
    if (want(v, id, sd, "max", path, T_NUM, "a number", &it) && num_get(&it, &n) &&
        num_cmp(&n, &f->max) != 0) {
        fmt_num(&f->max, a, sizeof(a));
        fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.sum", field);
    if (want(v, id, sd, "sum", path, T_NUM, "a number", &it) && num_get(&it, &n) &&
        !close_enough(num_as_double(&n), want_sum, f->sum_abs)) {
        fmt_double(want_sum, a, sizeof(a));
        fmt_num(&n, b, sizeof(b));
        problem(v, id, "%s is wrong (expected %s, found %s)", path, a, b);
    }
    snprintf(path, sizeof(path), "summary.%s.avg", field);
    if (want(v, id, sd, "avg", path, T_NUM, "a number", &it) && num_get(&it, &n) &&
        !close_enough(num_as_double(&n), want_avg, f->sum_abs / (double)f->n_num)) {
        fmt_double(want_avg, a, sizeof(a));
        fmt_num(&n, b, sizeof(b));
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
                    type_name(bson_iter_type(&it)));
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
        if (t->n_num == 0 || num_cmp(&a->min, &t->min) < 0) {
            t->min = a->min;
        }
        if (t->n_num == 0 || num_cmp(&a->max, &t->max) > 0) {
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
            char *id = bson_iter_init_find(&it, doc, "_id") ? value_json(&it) : NULL;
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
        fmt_time(want_end, a, sizeof(a));
        fmt_time(bson_iter_date_time(&it), b, sizeof(b));
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
        id = value_json(&it);
        if (id == NULL) {
            id = bson_strdup("(unprintable _id)");
        }
        problem(v, id, "_id has the wrong type (expected string, found %s)",
                type_name(bson_iter_type(&it)));
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
        fmt_time(bd_floor_div(start, span) * span, a, sizeof(a));
        fmt_time(start, b, sizeof(b));
        problem(v, id, "bucket_start is not aligned to the %s span (expected %s, found %s)",
                span_text, a, b);
    }
    int64_t want_end = 0;
    /* A date near the end of int64's range has no bucket_end: report it, do not overflow. */
    bool end_ok = !__builtin_add_overflow(start, span - 1, &want_end);
    if (has_start && has_end && (!end_ok || end != want_end)) {
        if (end_ok) {
            fmt_time(want_end, a, sizeof(a));
        } else {
            snprintf(a, sizeof(a), "a date past the BSON range");
        }
        fmt_time(end, b, sizeof(b));
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
                put_safe(id);
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
    rc = cursor_status(cursor, s, err);
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
        rc = cursor_status(v->sums, s, err);
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

/* ---------------------------------------------------------------------------------------- */
/* summaries rebuild                                                                        */

static int cmd_summaries_rebuild(struct conn *c, const struct options *o, const struct settings *s,
                                 struct bd_err *err) {
    bson_t filter, pipeline, opts;
    bson_error_t berr;
    const bson_t *doc;
    int rc = 0;
    buckets_filter(o, s, &filter);
    bd_queries_summaries_pipeline(NULL, 0, &filter, s->summary_collection, &pipeline);
    bson_init(&opts);
    mongoc_write_concern_t *wc = NULL;
    rc = bd_mongo_write_concern_new(s->write_concern, s->wtimeout_ms, &wc, err);
    if (rc < 0) {
        goto out;
    }
    mongoc_write_concern_append(wc, &opts);
    BSON_APPEND_BOOL(&opts, "allowDiskUse", true);
    mongoc_cursor_t *cur =
        mongoc_collection_aggregate(c->coll, MONGOC_QUERY_NONE, &pipeline, &opts, NULL);
    while (mongoc_cursor_next(cur, &doc)) {
        /* $merge returns no documents */
    }
    rc = cursor_status(cur, s, err);
    mongoc_cursor_destroy(cur);
    if (rc < 0) {
        goto out;
    }
    mongoc_collection_t *sums =
        mongoc_client_get_collection(c->client, s->database, s->summary_collection);
    int64_t n = mongoc_collection_count_documents(sums, &filter, NULL, NULL, NULL, &berr);
    mongoc_collection_destroy(sums);
    if (n < 0) {
        rc = bd_err_set(err, -EIO, "counting %s.%s failed: %s", s->database, s->summary_collection,
                        berr.message);
        goto out;
    }
    printf("rebuilt from %s.%s: %" PRId64 " summary documents in %s.%s for this range\n",
           s->database, s->collection, n, s->database, s->summary_collection);
out:
    mongoc_write_concern_destroy(wc);
    bson_destroy(&opts);
    bson_destroy(&pipeline);
    bson_destroy(&filter);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* sensors                                                                                  */

/*
 * Each sensor's newest summary: sorted by the summary collection's {sensor_id, bucket_start}
 * index (descending bucket_start), the first document of each sensor_id group; those whose
 * bucket ended before the cutoff; oldest first. A summary exists for every bucket with pages
 * once the daemon refreshed it (summaries.interval).
 */
static int cmd_sensors(struct conn *c, const struct options *o, const struct settings *s,
                       struct bd_err *err) {
    int64_t now_ms = bd_now_ns() / BD_NS_PER_MS;
    int64_t cutoff_ms = now_ms - (int64_t)o->silent_ms;
    bson_t *stages[4] = {
        BCON_NEW("$sort", "{", "sensor_id", BCON_INT32(1), "bucket_start", BCON_INT32(-1), "}"),
        BCON_NEW("$group", "{", "_id", BCON_UTF8("$sensor_id"), "bucket_start", "{", "$first",
                 BCON_UTF8("$bucket_start"), "}", "bucket_end", "{", "$first",
                 BCON_UTF8("$bucket_end"), "}", "}"),
        BCON_NEW("$sort", "{", "bucket_end", BCON_INT32(1), "_id", BCON_INT32(1), "}"),
        /* Without --silent: every sensor. */
        o->given[OPT_SILENT]
            ? BCON_NEW("$match", "{", "bucket_end", "{", "$lt", BCON_DATE_TIME(cutoff_ms), "}", "}")
            : NULL,
    };
    bson_t *pipeline = bson_new();
    bson_t arr;
    BSON_APPEND_ARRAY_BEGIN(pipeline, "pipeline", &arr);
    static const int order[] = {0, 1, 3, 2}; /* the cutoff before the final sort */
    uint32_t k = 0;
    for (size_t i = 0; i < BD_ARRAY_LEN(order); i++) {
        if (stages[order[i]] != NULL) {
            char key[16];
            const char *kp;
            bson_uint32_to_string(k++, &kp, key, sizeof(key));
            BSON_APPEND_DOCUMENT(&arr, kp, stages[order[i]]);
            bson_destroy(stages[order[i]]);
        }
    }
    bson_append_array_end(pipeline, &arr);
    bson_t *opts = BCON_NEW("allowDiskUse", BCON_BOOL(true));
    mongoc_collection_t *sums =
        mongoc_client_get_collection(c->client, s->database, s->summary_collection);
    mongoc_cursor_t *cur =
        mongoc_collection_aggregate(sums, MONGOC_QUERY_NONE, pipeline, opts, NULL);
    const bson_t *doc;
    uint64_t n = 0;
    int rc = 0;
    while (mongoc_cursor_next(cur, &doc)) {
        bson_iter_t it;
        const char *id = NULL;
        int64_t start = 0, end = 0;
        if (bson_iter_init_find(&it, doc, "_id") && BSON_ITER_HOLDS_UTF8(&it)) {
            id = bson_iter_utf8(&it, NULL);
        }
        if (bson_iter_init_find(&it, doc, "bucket_start") && BSON_ITER_HOLDS_DATE_TIME(&it)) {
            start = bson_iter_date_time(&it);
        }
        if (bson_iter_init_find(&it, doc, "bucket_end") && BSON_ITER_HOLDS_DATE_TIME(&it)) {
            end = bson_iter_date_time(&it);
        }
        if (id == NULL) {
            continue; /* not a summary bucketd wrote */
        }
        char t1[48], t2[48];
        fmt_time(start, t1, sizeof(t1));
        fmt_time(end, t2, sizeof(t2));
        printf("%s %s ", t1, t2);
        put_safe(id);
        putchar('\n');
        n++;
    }
    bson_error_t berr;
    if (mongoc_cursor_error(cur, &berr)) {
        rc = (berr.domain == MONGOC_ERROR_SERVER_SELECTION || berr.domain == MONGOC_ERROR_STREAM)
                 ? bd_err_set(err, -EIO, "cannot reach MongoDB: %s", berr.message)
                 : bd_err_set(err, -EIO, "reading %s.%s failed: %s", s->database,
                              s->summary_collection, berr.message);
    } else if (o->given[OPT_SILENT]) {
        char cut[48];
        fmt_time(cutoff_ms, cut, sizeof(cut));
        printf("%" PRIu64 " sensors whose newest bucket ended before %s (silent for more than "
               "%s)\n",
               n, cut, o->value[OPT_SILENT]);
    } else {
        printf("%" PRIu64 " sensors\n", n);
    }
    mongoc_cursor_destroy(cur);
    mongoc_collection_destroy(sums);
    bson_destroy(opts);
    bson_destroy(pipeline);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* dead-letter                                                                              */

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
    if (!bson_iter_init_find(&it, doc, key) || !type_in(bson_iter_type(&it), T_INT)) {
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
    put_safe(line);
    free(line);
}

static void dl_print(const struct dl_record *r) {
    char t[64];
    fmt_time(r->time_ms, t, sizeof(t));
    printf("%s  %s  ", t, r->id);
    put_safe(r->bucket_id);
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
    put_safe(r->bucket_id);
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
static int cmd_dead_letter(struct conn *c, const struct options *o, const struct settings *s,
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

/* ---------------------------------------------------------------------------------------- */
/* Main                                                                                     */

/* top needs no MongoDB: the endpoint is --metrics, else the config's (or the default)
 * metrics.bind, the way the other commands take their settings. */
static int cmd_top(const struct options *o) {
    static struct bd_config cfg;
    struct bd_err err = {0};
    struct bd_top_options t = {.interval_ms = 1000, .once = o->given[OPT_ONCE]};
    if (o->given[OPT_INTERVAL] &&
        (bd_parse_duration_ms(o->value[OPT_INTERVAL], &t.interval_ms) < 0 || t.interval_ms < 100 ||
         t.interval_ms > BD_MS_PER_H)) {
        return bad_usage("--interval: '%s' is not a duration from 100ms to 1h",
                         o->value[OPT_INTERVAL]);
    }
    if (o->given[OPT_METRICS]) {
        t.target = o->value[OPT_METRICS];
        return bd_top_run(&t);
    }
    if (o->given[OPT_CONFIG]) {
        if (bd_config_load(&cfg, o->value[OPT_CONFIG], &err) < 0) {
            fprintf(stderr, "bucketd-inspect: %s\n", err.msg);
            return EXIT_USAGE;
        }
    } else {
        bd_config_defaults(&cfg);
    }
    if (cfg.metrics.bind[0] == '\0') {
        fprintf(stderr,
                "bucketd-inspect: top: %s sets metrics.bind to \"\": the daemon serves no "
                "/metrics to read (set it, or give --metrics)\n",
                cfg.path);
        return EXIT_USAGE;
    }
    t.target = cfg.metrics.bind;
    return bd_top_run(&t);
}

int main(int argc, char **argv) {
    static struct bd_config cfg;
    struct options o = {0};
    struct settings s = {0};
    struct conn c = {0};
    struct verifier v = {0};
    struct bd_err err = {0};
    int status = 0;

    int rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        return rc < 0 ? 0 : rc;
    }
    if (o.cmd == CMD_TOP) {
        return cmd_top(&o);
    }
    if (resolve_settings(&o, &cfg, &s, &err) < 0) {
        fprintf(stderr, "bucketd-inspect: %s\n", err.msg);
        return EXIT_USAGE;
    }
    v.s = &s;

    mongoc_init();
    /* Listing dead letters, and printing what a replay would send, need no server. */
    bool offline = o.cmd == CMD_DL_LIST || (o.cmd == CMD_DL_REPLAY && o.given[OPT_DRY_RUN]);
    rc = offline ? 0 : conn_open(&c, &s, &err);
    if (rc == 0) {
        switch (o.cmd) {
        case CMD_BUCKETS:
            rc = cmd_buckets(&c, &o, &s, &err);
            break;
        case CMD_VERIFY:
            rc = cmd_verify(&c, &o, &s, &v, &err);
            break;
        case CMD_SUMMARIES_REBUILD:
            rc = cmd_summaries_rebuild(&c, &o, &s, &err);
            break;
        case CMD_SENSORS:
            rc = cmd_sensors(&c, &o, &s, &err);
            break;
        default:
            rc = cmd_dead_letter(&c, &o, &s, &status, &err);
            break;
        }
    }
    if (rc < 0) {
        fflush(stdout);
        fprintf(stderr, "bucketd-inspect: %s\n", err.msg);
        status = EXIT_USAGE;
        goto out;
    }
    if (o.cmd == CMD_VERIFY) {
        printf("verified %" PRIu64 " documents, %" PRIu64 " readings", v.documents, v.readings);
        if (o.given[OPT_SUMMARIES]) {
            printf(", %" PRIu64 " summaries", v.summaries);
        }
        printf(": %" PRIu64 " problems", v.problems);
        if (v.warnings > 0) {
            printf(", %" PRIu64 " warnings", v.warnings);
        }
        putchar('\n');
        status = v.problems > 0 ? EXIT_PROBLEMS : 0;
    }
out:
    verifier_close(&v);
    conn_close(&c);
    mongoc_cleanup();
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "bucketd-inspect: writing stdout failed\n");
        status = EXIT_USAGE;
    }
    return status;
}
