/*
 * bucketd-inspect: reads the bucket documents bucketd wrote (README "Document schema") for
 * operators after an incident and for the tests.
 *
 *   buckets  prints one sensor's bucket pages in a time range, as extended JSON (one document
 *            per line) or as a table of hourly figures combined over the pages of each bucket;
 *   verify   scans the collection (or one sensor) and reports every document that breaks an
 *            invariant of the schema, one line per problem (tools/inspect_verify.c);
 *   summaries rebuild
 *            recomputes the summary documents of a range from the buckets;
 *   sensors  lists the sensors of the summary collection by their newest bucket, oldest first;
 *            with --silent, only those whose newest bucket ended longer ago (a daemon that
 *            restarted no longer knows when its sensors last reported);
 *   top      a live view of a running daemon from its /metrics (tools/inspect_top.c);
 *   dead-letter list|replay
 *            shows the updates MongoDB refused for good and sends them again once the cause is
 *            fixed (tools/inspect_deadletter.c).
 *
 * This file holds the usage text, the argument parser, the settings (the config file, then the
 * options over it), buckets, summaries rebuild, sensors and top's entry, and main(); what the
 * commands share is in tools/inspect.h. It connects exactly as the daemon does: the same URI
 * defaults (bd_mongo_uri_new), the same config file and keys, error API 2. Single-threaded;
 * one mongoc client, owned by main().
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mongoc/mongoc.h>

#include "bucketd/bucket.h"
#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/creds.h"
#include "bucketd/escape.h"
#include "bucketd/mongo.h"
#include "bucketd/names.h"
#include "bucketd/queries.h"
#include "bucketd/units.h"
#include "inspect.h"
#include "inspect_top.h"

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

/* ---------------------------------------------------------------------------------------- */
/* Options and settings                                                                     */

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
    if (o->given[OPT_FROM] && inspect_parse_time(o->value[OPT_FROM], &o->from_ms) < 0) {
        return bad_usage("--from: '%s' is not RFC 3339 or unix seconds", o->value[OPT_FROM]);
    }
    if (o->given[OPT_TO] && inspect_parse_time(o->value[OPT_TO], &o->to_ms) < 0) {
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
        if (bd_units_parse_int(o->value[OPT_MAX_READINGS], &n) != 0 || n < 1 || n > UINT32_MAX) {
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

static int table_field_index(struct table *t, const char *name, size_t *out) {
    for (size_t i = 0; i < t->n_names; i++) {
        if (strcmp(t->names[i], name) == 0) {
            *out = i;
            return 0;
        }
    }
    char *copy = strdup(name);
    if (copy == NULL ||
        inspect_grow((void **)&t->names, &t->cap_names, t->n_names + 1, sizeof(*t->names)) < 0) {
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
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "min") && inspect_num_get(&it, &n) &&
        (!f->has_min || inspect_num_cmp(&n, &f->min) < 0)) {
        f->min = n;
        f->has_min = true;
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "max") && inspect_num_get(&it, &n) &&
        (!f->has_max || inspect_num_cmp(&n, &f->max) > 0)) {
        f->max = n;
        f->has_max = true;
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "sum") && inspect_num_get(&it, &n)) {
        f->sum += inspect_num_as_double(&n);
    }
    if (bson_iter_recurse(summary, &it) && bson_iter_find(&it, "count") &&
        inspect_type_in(bson_iter_type(&it), T_INT)) {
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
        if (inspect_grow((void **)&t->rows, &t->cap_rows, t->n_rows + 1, sizeof(*t->rows)) < 0) {
            return -ENOMEM;
        }
        row = &t->rows[t->n_rows++];
        memset(row, 0, sizeof(*row));
        row->start_ms = start;
    }
    row->pages++;
    if (bson_iter_init_find(&it, doc, "count") && inspect_type_in(bson_iter_type(&it), T_INT)) {
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
        inspect_fmt_time(row->start_ms, buf, cap);
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
            inspect_fmt_num(&f->min, buf, cap);
        }
        break;
    case 1:
        if (f->has_max) {
            inspect_fmt_num(&f->max, buf, cap);
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
        inspect_put_json(json);
        putchar('\n');
        bson_free(json);
    }
    rc = inspect_cursor_status(cursor, s, err);
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
    rc = inspect_cursor_status(cur, s, err);
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
        inspect_fmt_time(start, t1, sizeof(t1));
        inspect_fmt_time(end, t2, sizeof(t2));
        printf("%s %s ", t1, t2);
        inspect_put_safe(id);
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
        inspect_fmt_time(cutoff_ms, cut, sizeof(cut));
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

    mongoc_init();
    /* Listing dead letters, and printing what a replay would send, need no server. */
    bool offline = o.cmd == CMD_DL_LIST || (o.cmd == CMD_DL_REPLAY && o.given[OPT_DRY_RUN]);
    rc = offline ? 0 : inspect_conn_open(&c, &s, &err);
    if (rc == 0) {
        switch (o.cmd) {
        case CMD_BUCKETS:
            rc = cmd_buckets(&c, &o, &s, &err);
            break;
        case CMD_VERIFY:
            rc = inspect_verify(&c, &o, &s, &status, &err);
            break;
        case CMD_SUMMARIES_REBUILD:
            rc = cmd_summaries_rebuild(&c, &o, &s, &err);
            break;
        case CMD_SENSORS:
            rc = cmd_sensors(&c, &o, &s, &err);
            break;
        default:
            rc = inspect_dead_letter(&c, &o, &s, &status, &err);
            break;
        }
    }
    if (rc < 0) {
        fflush(stdout);
        fprintf(stderr, "bucketd-inspect: %s\n", err.msg);
        status = EXIT_USAGE;
    }
    inspect_conn_close(&c);
    mongoc_cleanup();
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "bucketd-inspect: writing stdout failed\n");
        status = EXIT_USAGE;
    }
    return status;
}
