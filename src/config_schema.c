/*
 * The configuration's schema (src/config_schema.h): the table below is the only place a key is
 * described: its path, type, bounds, default, whether SIGHUP may change it, and its help text.
 * Defaults, validation, the dump and the reload check are all driven by it, so adding a key
 * means adding one row (and its field in struct bd_config). Then what a row drives: the enum
 * names, the rules a value must follow beyond its bounds, a value's text to its field and back,
 * the defaults and the lookups the loader's messages need; and the rules between keys.
 *
 * Runs on the thread that loads a configuration (the main thread); the table is constant, and
 * the only other state is check_uri's message buffer. Calls only down: src/units.c for numbers,
 * libmongoc (src/mongo.c) for the URI, src/log.c for level names, src/allow.c for prefixes.
 */
#include "config_schema.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"
#include "bucketd/log.h"
#include "bucketd/mongo.h"
#include "bucketd/parse.h"
#include "bucketd/spool.h"
#include "bucketd/units.h"

/*
 * Retention becomes a TTL index's expireAfterSeconds. MongoDB 6.0 refuses a value above the
 * seconds since 1970 (about 1.7e9 today); 50 years stays below that for decades.
 */
#define MAX_RETENTION_MS (50 * 365 * BD_MS_PER_DAY)

static const struct enum_name proto_names[] = {
    {"udp", BD_PROTO_UDP}, {"tcp", BD_PROTO_TCP}, {NULL, 0}};
static const struct enum_name format_names[] = {
    {"influx", BD_FORMAT_INFLUX}, {"graphite", BD_FORMAT_GRAPHITE}, {NULL, 0}};
static const struct enum_name precision_names[] = {
    {"ns", BD_PREC_NS}, {"us", BD_PREC_US}, {"ms", BD_PREC_MS}, {"s", BD_PREC_S}, {NULL, 0}};
static const struct enum_name sink_names[] = {
    {"mongodb", BD_SINK_MONGODB}, {"blackhole", BD_SINK_BLACKHOLE}, {NULL, 0}};
/* Parsing goes through bd_log_level_parse; this list only names the levels back. */
static const struct enum_name level_names[] = {{"error", BD_LOG_ERROR},
                                               {"warn", BD_LOG_WARN},
                                               {"info", BD_LOG_INFO},
                                               {"debug", BD_LOG_DEBUG},
                                               {NULL, 0}};

static const char *check_writer_id(const char *s, uint64_t unused);
static const char *check_uri(const char *s, uint64_t unused);
static const char *check_db_name(const char *s, uint64_t unused);
static const char *check_coll_name(const char *s, uint64_t unused);
static const char *check_write_concern(const char *s, uint64_t unused);
static const char *check_span(const char *s, uint64_t ms);
static const char *check_retention(const char *s, uint64_t ms);
static const char *check_pow2(const char *s, uint64_t n);
static const char *check_spool_sync(const char *s, uint64_t unused);
static const char *check_ingest_loops(const char *s, uint64_t unused);
static const struct enum_name when_full_names[] = {{"drop_oldest", BD_SPOOL_FULL_DROP_OLDEST},
                                                   {"drop_newest", BD_SPOOL_FULL_DROP_NEWEST},
                                                   {"block", BD_SPOOL_FULL_BLOCK},
                                                   {NULL, 0}};

#define FIELD(type, f) .off = offsetof(type, f), .size = sizeof(((type *)0)->f)
#define CFG(f) FIELD(struct bd_config, f)
#define LST(f) FIELD(struct bd_listener_config, f)

/* Rows of one section stay together: the dump prints a section header when the prefix changes. */
/* One row per key, packed: the schema reads as a table. */
/* clang-format off */
const struct key_def config_schema[] = {
    {.path = "writer_id", .type = T_STRING, CFG(writer_id), .min = 1, .max = 64,
     .check = check_writer_id, .flags = KF_UNSET_OK,
     .help = "identifies this daemon's writes in MongoDB; letters, digits, '-' and '_'; "
             "default: generated once, kept in spool.dir"},
    {.path = "listeners", .type = T_LISTENERS, .flags = KF_RELOAD,
     .help = "sockets readings arrive on; a reload adds and removes listeners, matched by proto "
             "and address (their other keys need a restart)"},
    {.path = "listeners[].proto", .type = T_ENUM, LST(proto), .names = proto_names,
     .flags = KF_REQUIRED, .help = "transport"},
    {.path = "listeners[].bind", .type = T_HOSTPORT, LST(bind),
     .addr_off = offsetof(struct bd_listener_config, addr), .flags = KF_REQUIRED | KF_RESOLVE,
     .help = "numeric address and port to listen on"},
    {.path = "listeners[].format", .type = T_ENUM, LST(format), .def = "influx",
     .names = format_names, .help = "line format"},
    {.path = "listeners[].precision", .type = T_ENUM, LST(precision), .def = "ns",
     .names = precision_names, .help = "unit of the timestamps on this listener"},
    {.path = "listeners[].rcvbuf", .type = T_SIZE, LST(rcvbuf), .min = 4 * BD_KIB, .max = BD_GIB,
     .def = "8MiB", .flags = KF_UDP, .help = "SO_RCVBUF request (the kernel caps it)"},
    {.path = "listeners[].max_connections", .type = T_UINT, LST(max_connections), .min = 1,
     .max = 65535, .def = "1024", .flags = KF_TCP, .help = "open connections at most"},
    {.path = "listeners[].max_connections_per_ip", .type = T_UINT, LST(max_connections_per_ip),
     .min = 1, .max = 65535, .def = "64", .flags = KF_TCP,
     .help = "open connections per source (IPv4 address, IPv6 /64) at most; default 64, or "
             "max_connections if that is smaller"},
    {.path = "listeners[].allow", .type = T_CIDRS, LST(allow), .flags = KF_RELOAD,
     .help = "address prefixes that may send (\"10.0.0.0/8\", \"fd00::/8\"); absent: everyone"},
    {.path = "listeners[].idle_timeout", .type = T_DURATION, LST(idle_timeout_ms), .min = 0,
     .max = BD_MS_PER_DAY, .def = "5m", .flags = KF_TCP,
     .help = "close connections that complete no line for this long; 0 = never"},
    {.path = "listeners[].tls.cert", .type = T_STRING, LST(tls.cert), .min = 1, .max = 511,
     .flags = KF_TCP | KF_UNSET_OK,
     .help = "TLS: PEM certificate chain file (server certificate first); turns TLS on"},
    {.path = "listeners[].tls.key", .type = T_STRING, LST(tls.key), .min = 1, .max = 511,
     .flags = KF_TCP | KF_UNSET_OK, .help = "TLS: PEM private key file of the certificate"},
    {.path = "listeners[].tls.client_ca", .type = T_STRING, LST(tls.client_ca), .min = 1,
     .max = 511, .flags = KF_TCP | KF_UNSET_OK,
     .help = "TLS: PEM CA bundle; clients must present a certificate it verifies (mutual TLS)"},
    {.path = "sink", .type = T_ENUM, CFG(sink), .def = "mongodb", .names = sink_names,
     .help = "where bucket updates go; blackhole counts and discards them"},
    {.path = "mongodb.uri", .type = T_STRING, CFG(mongodb.uri_given), .min = 1,
     .max = sizeof(((struct bd_config *)0)->mongodb.uri_given) - 1,
     .def = "mongodb://127.0.0.1:27017/", .check = check_uri, .flags = KF_SECRET,
     .help = "connection string"},
    {.path = "mongodb.uri_file", .type = T_STRING, CFG(mongodb.uri_file), .min = 0,
     .max = sizeof(((struct bd_config *)0)->mongodb.uri_file) - 1, .def = "",
     .help = "file holding the whole connection string, instead of mongodb.uri; a relative "
             "name is looked up in $CREDENTIALS_DIRECTORY when set, else beside this file"},
    {.path = "mongodb.password_file", .type = T_STRING, CFG(mongodb.password_file), .min = 0,
     .max = sizeof(((struct bd_config *)0)->mongodb.password_file) - 1, .def = "",
     .help = "file holding only the password of the user the URI names (the URI then holds "
             "no password); looked up as mongodb.uri_file"},
    {.path = "mongodb.database", .type = T_STRING, CFG(mongodb.database), .min = 1, .max = 63,
     .def = "telemetry", .check = check_db_name, .help = "database name"},
    {.path = "mongodb.collection", .type = T_STRING, CFG(mongodb.collection), .min = 1,
     .max = 120, .def = "buckets", .check = check_coll_name, .help = "collection name"},
    {.path = "mongodb.write_concern", .type = T_STRING, CFG(mongodb.write_concern), .min = 1,
     .max = 16, .def = "majority", .check = check_write_concern, .flags = KF_RELOAD,
     .help = "majority, 1 or a number of nodes; 0 is refused"},
    {.path = "mongodb.wtimeout", .type = T_DURATION, CFG(mongodb.wtimeout_ms), .min = 0,
     .max = 10 * BD_MS_PER_M, .def = "5s", .flags = KF_RELOAD,
     .help = "how long the server may wait for write_concern; expiry is retried; 0 = no limit"},
    {.path = "buckets.span", .type = T_DURATION, CFG(buckets.span_ms), .min = BD_MS_PER_M,
     .max = BD_MS_PER_DAY, .def = "1h", .check = check_span,
     .help = "time covered by one bucket document"},
    {.path = "buckets.max_readings", .type = T_UINT, CFG(buckets.max_readings), .min = 1,
     .max = 100000, .def = "1000", .help = "readings per document page"},
    {.path = "buckets.max_bytes", .type = T_SIZE, CFG(buckets.max_bytes), .min = 4 * BD_KIB,
     .max = 8 * BD_MIB, .def = "128KiB", .help = "estimated BSON bytes per document page"},
    {.path = "buckets.max_late", .type = T_DURATION, CFG(buckets.max_late_ms), .min = BD_MS_PER_S,
     .max = 30 * BD_MS_PER_DAY, .def = "24h", .flags = KF_RELOAD,
     .help = "readings older than this are dropped"},
    {.path = "buckets.max_future", .type = T_DURATION, CFG(buckets.max_future_ms), .min = 0,
     .max = BD_MS_PER_DAY, .def = "10m", .flags = KF_RELOAD,
     .help = "readings further ahead than this are dropped"},
    {.path = "buckets.retention", .type = T_DURATION, CFG(buckets.retention_ms), .min = 0,
     .max = MAX_RETENTION_MS, .def = "0", .check = check_retention, .flags = KF_RELOAD,
     .help = "bucket documents are deleted by MongoDB this long after their bucket_end (a TTL "
             "index); 0 keeps them forever"},
    {.path = "flush.interval", .type = T_DURATION, CFG(flush.interval_ms), .min = 10,
     .max = BD_MS_PER_H, .def = "1s", .flags = KF_RELOAD, .help = "time between bulk writes"},
    {.path = "flush.max_updates", .type = T_UINT, CFG(flush.max_updates), .min = 1,
     .max = 100000, .def = "1000", .flags = KF_RELOAD, .help = "bucket updates per bulk write"},
    {.path = "flush.stop_timeout", .type = T_DURATION, CFG(flush.stop_timeout_ms), .min = 0,
     .max = 10 * BD_MS_PER_M, .def = "30s", .flags = KF_RELOAD,
     .help = "time a stop may spend flushing before spooling the rest"},
    {.path = "flush.max_delay", .type = T_DURATION, CFG(flush.max_delay_ms), .min = 0,
     .max = BD_MS_PER_H, .def = "30s", .flags = KF_RELOAD,
     .help = "longest a page's readings wait for more before their update is sent"},
    {.path = "flush.retry_initial", .type = T_DURATION, CFG(flush.retry_initial_ms), .min = 1,
     .max = BD_MS_PER_M, .def = "100ms", .flags = KF_RELOAD,
     .help = "first backoff after a failed bulk write"},
    {.path = "flush.retry_max", .type = T_DURATION, CFG(flush.retry_max_ms), .min = 10,
     .max = BD_MS_PER_H, .def = "10s", .flags = KF_RELOAD, .help = "backoff cap"},
    {.path = "summaries.collection", .type = T_STRING, CFG(summaries.collection), .min = 0,
     .max = 120, .def = "", .check = check_coll_name,
     .help = "collection of one summary document per sensor and bucket; \"\" is "
             "<mongodb.collection>_summary"},
    {.path = "summaries.interval", .type = T_DURATION, CFG(summaries.interval_ms), .min = 0,
     .max = BD_MS_PER_H, .def = "60s", .flags = KF_RELOAD,
     .help = "a bucket's summary document is recomputed at most this often after its pages "
             "change; 0 turns summaries off"},
    {.path = "summaries.retention", .type = T_DURATION, CFG(summaries.retention_ms), .min = 0,
     .max = MAX_RETENTION_MS, .def = "0", .check = check_retention, .flags = KF_RELOAD,
     .help = "summary documents are deleted by MongoDB this long after their bucket_end; 0 "
             "keeps them forever; at least buckets.retention"},
    {.path = "spool.dir", .type = T_STRING, CFG(spool.dir), .min = 1,
     .max = sizeof(((struct bd_config *)0)->spool.dir) - 1, .def = "/var/lib/bucketd/spool",
     .help = "directory for batches MongoDB did not take"},
    {.path = "spool.max_bytes", .type = T_SIZE, CFG(spool.max_bytes), .min = BD_MIB,
     .max = 1024 * BD_GIB, .def = "1GiB", .flags = KF_RELOAD,
     .help = "spool size cap, file headers included; spool.when_full decides beyond it"},
    {.path = "spool.sync", .type = T_STRING, CFG(spool.sync), .min = 1,
     .max = sizeof(((struct bd_config *)0)->spool.sync) - 1, .def = "1s",
     .check = check_spool_sync,
     .help = "when spooled data is fdatasync'ed: none, batch (every batch) or an interval"},
    {.path = "spool.when_full", .type = T_ENUM, CFG(spool.when_full), .def = "drop_oldest",
     .names = when_full_names,
     .help = "at spool.max_bytes: drop_oldest, drop_newest, or block (TCP input waits)"},
    {.path = "metrics.bind", .type = T_HOSTPORT, CFG(metrics.bind), .def = "127.0.0.1:9273",
     .flags = KF_EMPTY_OK, .help = "/metrics and /healthz endpoint; \"\" disables"},
    {.path = "metrics.unhealthy_after", .type = T_DURATION, CFG(metrics.unhealthy_after_ms),
     .min = BD_MS_PER_S, .max = BD_MS_PER_DAY, .def = "1m",
     .help = "/healthz answers 503 once MongoDB has been unreachable this long"},
    {.path = "metrics.spool_high_water", .type = T_UINT, CFG(metrics.spool_high_water), .min = 1,
     .max = 100, .def = "80",
     .help = "/healthz answers 503 while the spool holds more than this percent of "
             "spool.max_bytes"},
    {.path = "metrics.silent_after", .type = T_DURATION, CFG(metrics.silent_after_ms), .min = 0,
     .max = 30 * BD_MS_PER_DAY, .def = "15m", .flags = KF_RELOAD,
     .help = "bucketd_sensors_silent counts the sensors tracked with no reading this long (keep "
             "it below limits.sensor_idle, which forgets them); 0 drops the gauge"},
    {.path = "time.wait_for_sync", .type = T_DURATION, CFG(time.wait_for_sync_ms), .min = 0,
     .max = 7 * BD_MS_PER_DAY, .def = "10m", .flags = KF_RELOAD,
     .help = "how long to wait for the kernel to report the wall clock synchronised (NTP) "
             "before trusting it as it is; 0 trusts it at once"},
    {.path = "log.level", .type = T_LOGLEVEL, CFG(log.level), .def = "info",
     .names = level_names, .flags = KF_RELOAD, .help = "least severe level logged"},
    {.path = "ingest.loops", .type = T_STRING, CFG(ingest.loops), .min = 1,
     .max = sizeof(((struct bd_config *)0)->ingest.loops) - 1, .def = "auto",
     .check = check_ingest_loops,
     .help = "threads that read each UDP listener's socket (SO_REUSEPORT): a number from 1 "
             "to 16, or auto (1 below 4 cores, else 2); TCP stays on the ingest thread"},
    {.path = "limits.max_sensors", .type = T_UINT, CFG(limits.max_sensors), .min = 1,
     .max = 10000000, .def = "100000", .flags = KF_RELOAD,
     .help = "distinct sensors tracked (a reload raises it only as far as the queues reserved "
             "at start hold)"},
    {.path = "limits.memory", .type = T_SIZE, CFG(limits.memory), .min = 256 * BD_KIB,
     .max = 64 * BD_GIB, .def = "64MiB",
     .help = "memory for buffered readings: half for the sensor queues' pool, half for "
             "pending batches"},
    {.path = "limits.ring_size", .type = T_UINT, CFG(limits.ring_size), .min = 16,
     .max = 1048576, .def = "256", .check = check_pow2, .flags = KF_RELOAD,
     .help = "no longer used (limits.memory bounds all buffering); accepted so older "
             "configs still load"},
    {.path = "limits.max_fields", .type = T_UINT, CFG(limits.max_fields), .min = 1,
     .max = BD_PARSE_MAX_FIELDS, .def = "32", .flags = KF_RELOAD,
     .help = "fields per line (a reload raises it only up to the value at start, which sized "
             "the queues' segments)"},
    {.path = "limits.max_line", .type = T_SIZE, CFG(limits.max_line), .min = 256,
     .max = 16 * BD_MIB, .def = "64KiB", .help = "bytes per line"},
    {.path = "limits.max_name", .type = T_SIZE, CFG(limits.max_name), .min = 16,
     .max = 64 * BD_KIB, .def = "1KiB", .flags = KF_RELOAD,
     .help = "bytes of a sensor id (measurement and tags) and of a field key; longer ones are "
             "refused (drop_name_too_long)"},
    {.path = "limits.sensor_memory", .type = T_SIZE, CFG(limits.sensor_memory), .min = BD_MIB,
     .max = 64 * BD_GIB, .def = "64MiB", .flags = KF_RELOAD,
     .help = "memory for the sensors themselves (ids, names, tags, index, page accounting); "
             "new sensors past it are refused (drop_sensor_memory)"},
    {.path = "limits.sensor_idle", .type = T_DURATION, CFG(limits.sensor_idle_ms), .min = 0,
     .max = 30 * BD_MS_PER_DAY, .def = "1h", .flags = KF_RELOAD,
     .help = "a sensor silent this long is forgotten (its readings are written first); 0 keeps "
             "every sensor until the stop"},
};
/* clang-format on */

const size_t config_schema_n = BD_ARRAY_LEN(config_schema);
_Static_assert(BD_ARRAY_LEN(config_schema) <= CONFIG_KEYS_MAX, "raise CONFIG_KEYS_MAX");
#define N_KEYS BD_ARRAY_LEN(config_schema)

/* ---- Enum names ------------------------------------------------------------------------------ */

static const char *enum_name(const struct enum_name *names, int value) {
    for (const struct enum_name *n = names; n->name != NULL; n++) {
        if (n->value == value) {
            return n->name;
        }
    }
    return "?";
}

static int enum_parse(const struct enum_name *names, const char *s, int *out) {
    for (const struct enum_name *n = names; n->name != NULL; n++) {
        if (s != NULL && strcmp(s, n->name) == 0) {
            *out = n->value;
            return 0;
        }
    }
    return -EINVAL;
}

static void enum_list(const struct enum_name *names, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (const struct enum_name *n = names; n->name != NULL && used < len; n++) {
        int w = snprintf(buf + used, len - used, "%s%s", used > 0 ? ", " : "", n->name);
        used += w > 0 ? (size_t)w : 0;
    }
}

const char *bd_proto_name(enum bd_proto p) {
    return enum_name(proto_names, (int)p);
}

const char *bd_format_name(enum bd_format f) {
    return enum_name(format_names, (int)f);
}

const char *bd_precision_name(enum bd_precision p) {
    return enum_name(precision_names, (int)p);
}

int bd_format_parse(const char *s, enum bd_format *out) {
    int v = 0;
    int rc = enum_parse(format_names, s, &v);
    if (rc == 0) {
        *out = (enum bd_format)v;
    }
    return rc;
}

int bd_precision_parse(const char *s, enum bd_precision *out) {
    int v = 0;
    int rc = enum_parse(precision_names, s, &v);
    if (rc == 0) {
        *out = (enum bd_precision)v;
    }
    return rc;
}

/* ---- Extra rules ----------------------------------------------------------------------------- */

static const char *check_writer_id(const char *s, uint64_t unused) {
    /* It becomes part of a field path ("w.<writer_id>"), where '.' and '$' mean something. */
    for (const char *p = s; *p != '\0'; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_')) {
            return "may contain only letters, digits, '-' and '_'";
        }
    }
    return NULL;
}

const char *config_schema_check_uri(const char *s) {
    /* Config loading runs on one thread (start-up, --check-config, a reload on the loop thread),
     * so one buffer is enough. */
    static struct bd_err uri_err;
    if (strncmp(s, "mongodb://", 10) != 0 && strncmp(s, "mongodb+srv://", 14) != 0) {
        return "must start with mongodb:// or mongodb+srv://";
    }
    if (bd_mongo_uri_check(s, &uri_err) < 0) {
        return uri_err.msg;
    }
    return NULL;
}

static const char *check_uri(const char *s, uint64_t unused) {
    return config_schema_check_uri(s);
}

static const char *check_db_name(const char *s, uint64_t unused) {
    return strpbrk(s, "/\\. \"$") != NULL ? "must not contain / \\ . space \" or $" : NULL;
}

static const char *check_coll_name(const char *s, uint64_t unused) {
    if (strchr(s, '$') != NULL) {
        return "must not contain $";
    }
    return strncmp(s, "system.", 7) == 0 ? "system.* collections are reserved" : NULL;
}

static const char *check_write_concern(const char *s, uint64_t unused) {
    uint64_t n = 0;
    if (strcmp(s, "majority") == 0) {
        return NULL;
    }
    if (bd_units_parse_uint(s, &n) < 0 || (n > 0 && s[0] == '0')) {
        return "must be 1, majority or a number of nodes";
    }
    if (n == 0) {
        return "0 is refused: unacknowledged writes would lose data silently";
    }
    /* A replica set has at most 50 members; a larger w could never be satisfied. */
    return n > 50 ? "must be at most 50" : NULL;
}

void bd_config_summary_collection(const struct bd_config *cfg, char *buf, size_t cap) {
    if (cfg->summaries.collection[0] != '\0') {
        snprintf(buf, cap, "%s", cfg->summaries.collection);
    } else {
        snprintf(buf, cap, "%s_summary", cfg->mongodb.collection);
    }
}

int bd_config_spool_sync(const char *text, uint64_t *interval_ms) {
    if (strcmp(text, "none") == 0) {
        *interval_ms = 0;
        return BD_SPOOL_SYNC_NONE;
    }
    if (strcmp(text, "batch") == 0) {
        *interval_ms = 0;
        return BD_SPOOL_SYNC_BATCH;
    }
    if (bd_parse_duration_ms(text, interval_ms) < 0 || *interval_ms < 10 ||
        *interval_ms > BD_MS_PER_H) {
        return -EINVAL;
    }
    return BD_SPOOL_SYNC_INTERVAL;
}

int bd_config_ingest_loops(const char *text, uint32_t cores, uint32_t *loops) {
    if (strcmp(text, "auto") == 0) {
        *loops = cores < 4 ? 1 : 2;
        return 0;
    }
    uint32_t n = 0;
    if (text[0] == '\0' || strlen(text) > 2) {
        return -EINVAL;
    }
    for (const char *c = text; *c != '\0'; c++) {
        if (*c < '0' || *c > '9') {
            return -EINVAL;
        }
        n = n * 10 + (uint32_t)(*c - '0');
    }
    if (n < 1 || n > BD_MAX_INGEST_LOOPS) {
        return -EINVAL;
    }
    *loops = n;
    return 0;
}

static const char *check_spool_sync(const char *s, uint64_t unused) {
    (void)unused;
    uint64_t ms;
    return bd_config_spool_sync(s, &ms) < 0
               ? "must be none, batch, or an interval from 10ms to 1h (e.g. 1s, 10s)"
               : NULL;
}

static const char *check_ingest_loops(const char *s, uint64_t unused) {
    (void)unused;
    uint32_t n;
    return bd_config_ingest_loops(s, 1, &n) < 0 ? "must be auto or a number from 1 to 16" : NULL;
}

static const char *check_span(const char *s, uint64_t ms) {
    /* Buckets must start at the same instants every day, or a bucket would straddle midnight. */
    return BD_MS_PER_DAY % ms != 0 ? "must divide 24h evenly (e.g. 1m, 15m, 1h, 6h, 24h)" : NULL;
}

static const char *check_retention(const char *s, uint64_t ms) {
    /* expireAfterSeconds is a number of seconds: "1500ms" would be rounded behind the user's back. */
    return ms % BD_MS_PER_S != 0 ? "must be whole seconds (e.g. 720h, 90m, 3600s)" : NULL;
}

static const char *check_pow2(const char *s, uint64_t n) {
    return (n & (n - 1)) != 0 ? "must be a power of two" : NULL;
}

/* ---- Values: text <-> field, driven by a schema row ------------------------------------------ */

static void format_number(const struct key_def *k, uint64_t v, char *buf, size_t len) {
    if (k->type == T_DURATION) {
        bd_units_format_duration_ms(v, buf, len);
    } else if (k->type == T_SIZE) {
        bd_units_format_size(v, buf, len);
    } else {
        snprintf(buf, len, "%" PRIu64, v);
    }
}

int config_schema_parse_value(const struct key_def *k, const char *text, struct config_value *v,
                              char *why, size_t why_len) {
    const char *reason = NULL;
    char a[32], b[32];
    int rc = 0;

    memset(v, 0, sizeof(*v));
    switch (k->type) {
    case T_STRING: {
        size_t len = strlen(text);
        if (len < k->min || len > k->max) {
            if (len == 0) {
                snprintf(why, why_len, "must not be empty");
            } else {
                snprintf(why, why_len, "must be %" PRIu64 " to %" PRIu64 " characters long", k->min,
                         k->max);
            }
            return -EINVAL;
        }
        break;
    }
    case T_DURATION:
    case T_SIZE:
    case T_UINT:
        if (k->type == T_DURATION) {
            rc = bd_parse_duration_ms(text, &v->num);
        } else if (k->type == T_SIZE) {
            rc = bd_parse_size(text, &v->num);
        } else {
            rc = bd_units_parse_uint(text, &v->num);
        }
        if (rc == -ERANGE) {
            snprintf(why, why_len, "\"%s\" is too large", text);
            return -EINVAL;
        }
        if (rc < 0) {
            snprintf(why, why_len, "\"%s\" is not %s", text,
                     k->type == T_DURATION ? "a duration (e.g. 1500ms, 30s, 5m, 1h, 0)"
                     : k->type == T_SIZE   ? "a size (e.g. 4096, 64KiB, 8MiB, 1GiB)"
                                           : "a whole number");
            return -EINVAL;
        }
        if (v->num < k->min || v->num > k->max) {
            format_number(k, k->min, a, sizeof(a));
            format_number(k, k->max, b, sizeof(b));
            snprintf(why, why_len, "%s is out of range (%s to %s)", text, a, b);
            return -EINVAL;
        }
        break;
    case T_ENUM:
    case T_LOGLEVEL: {
        enum bd_log_level level = BD_LOG_INFO;
        if (k->type == T_LOGLEVEL) {
            rc = bd_log_level_parse(text, &level);
            v->ival = (int)level;
        } else {
            rc = enum_parse(k->names, text, &v->ival);
        }
        if (rc < 0) {
            char list[128];
            enum_list(k->names, list, sizeof(list));
            snprintf(why, why_len, "\"%s\" is not one of: %s", text, list);
            return -EINVAL;
        }
        break;
    }
    case T_HOSTPORT:
        if (text[0] == '\0' && (k->flags & KF_EMPTY_OK)) {
            break;
        }
        if (strlen(text) >= k->size) {
            snprintf(why, why_len, "is longer than %zu characters", k->size - 1);
            return -EINVAL;
        }
        if (bd_units_parse_hostport(text, &v->addr, &reason) < 0) {
            snprintf(why, why_len, "\"%s\": %s", text, reason);
            return -EINVAL;
        }
        break;
    case T_LISTENERS:
    case T_CIDRS:
        BD_ASSERT(!"not a scalar key");
    }
    if (k->check != NULL && (reason = k->check(text, v->num)) != NULL) {
        snprintf(why, why_len, "%s", reason);
        return -EINVAL;
    }
    return 0;
}

void config_schema_store_value(const struct key_def *k, void *base, const char *text,
                               const struct config_value *v) {
    char *field = (char *)base + k->off;
    switch (k->type) {
    case T_STRING:
    case T_HOSTPORT:
        BD_ASSERT(strlen(text) < k->size);
        memset(field, 0, k->size);
        memcpy(field, text, strlen(text));
        if (k->flags & KF_RESOLVE) {
            memcpy((char *)base + k->addr_off, &v->addr, sizeof(v->addr));
        }
        break;
    case T_DURATION:
    case T_SIZE:
    case T_UINT:
        if (k->size == sizeof(uint32_t)) {
            BD_ASSERT(v->num <= UINT32_MAX);
            uint32_t n = (uint32_t)v->num;
            memcpy(field, &n, sizeof(n));
        } else {
            BD_ASSERT(k->size == sizeof(uint64_t));
            memcpy(field, &v->num, sizeof(v->num));
        }
        break;
    case T_ENUM:
    case T_LOGLEVEL:
        /* The enum fields share int's size and representation on every ABI we build for. */
        BD_ASSERT(k->size == sizeof(int));
        memcpy(field, &v->ival, sizeof(int));
        break;
    case T_LISTENERS:
    case T_CIDRS:
        BD_ASSERT(!"not a scalar key");
    }
}

/* A flow sequence, ["10.0.0.0/8", "fd00::/8"], that the loader reads back to the same list. */
static void format_cidrs(const struct bd_allow *a, char *buf, size_t len) {
    size_t used = 0;
    char one[BD_CIDR_TEXT_LEN];
    for (uint32_t i = 0; i <= a->n && used < len; i++) {
        int w = 0;
        if (i == a->n) {
            w = snprintf(buf + used, len - used, "]");
        } else {
            bd_cidr_format(&a->e[i], one, sizeof(one));
            w = snprintf(buf + used, len - used, "%s\"%s\"", i == 0 ? "[" : ", ", one);
        }
        used += w > 0 ? (size_t)w : 0;
    }
    if (a->n == 0) {
        /* Not a value a file can give (an empty list is refused): for the reload report. */
        snprintf(buf, len, "(absent: everyone)");
    }
}

void config_schema_format_value(const struct key_def *k, const void *base, char *buf, size_t len) {
    const char *field = (const char *)base + k->off;
    uint64_t num = 0;
    int ival = 0;
    switch (k->type) {
    case T_STRING:
    case T_HOSTPORT:
        snprintf(buf, len, "%.*s", (int)k->size, field);
        break;
    case T_DURATION:
    case T_SIZE:
    case T_UINT:
        if (k->size == sizeof(uint32_t)) {
            uint32_t n = 0;
            memcpy(&n, field, sizeof(n));
            num = n;
        } else {
            memcpy(&num, field, sizeof(num));
        }
        format_number(k, num, buf, len);
        break;
    case T_ENUM:
    case T_LOGLEVEL:
        memcpy(&ival, field, sizeof(ival));
        snprintf(buf, len, "%s", enum_name(k->names, ival));
        break;
    case T_CIDRS:
        format_cidrs((const struct bd_allow *)(const void *)field, buf, len);
        break;
    case T_LISTENERS:
        BD_ASSERT(!"listeners is not a scalar key");
    }
}

/* Defaults go through the same parser as the file, so a bad default fails loudly at start. */
static void apply_default(const struct key_def *k, void *base, const char *text) {
    struct config_value v;
    char why[256];
    if (config_schema_parse_value(k, text, &v, why, sizeof(why)) < 0) {
        fprintf(stderr, "<2>bucketd: default of %s: %s\n", k->path, why);
        BD_ASSERT(!"schema default is invalid");
    }
    config_schema_store_value(k, base, text, &v);
}

void config_schema_listener_defaults(struct bd_listener_config *lc) {
    memset(lc, 0, sizeof(*lc));
    for (size_t i = 0; i < N_KEYS; i++) {
        if (config_schema_in_listener(&config_schema[i]) && config_schema[i].def != NULL) {
            apply_default(&config_schema[i], lc, config_schema[i].def);
        }
    }
}

void bd_config_defaults(struct bd_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &config_schema[i];
        if (config_schema_in_listener(k) || k->type == T_LISTENERS) {
            continue;
        }
        if (k->def != NULL) {
            apply_default(k, cfg, k->def);
        }
    }
    snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", cfg->mongodb.uri_given);
}

/* ---- Schema lookups -------------------------------------------------------------------------- */

int config_schema_find(const char *path) {
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strcmp(config_schema[i].path, path) == 0) {
            return (int)i;
        }
    }
    return -1;
}

bool config_schema_is_section(const char *path) {
    size_t len = strlen(path);
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strncmp(config_schema[i].path, path, len) == 0 && config_schema[i].path[len] == '.') {
            return true;
        }
    }
    return false;
}

/* Calls fn for each distinct key name directly under prefix, in schema order. */
static void each_child(const char *prefix, void (*fn)(const char *name, size_t len, void *arg),
                       void *arg) {
    size_t plen = strlen(prefix);
    for (size_t i = 0; i < N_KEYS; i++) {
        const char *p = config_schema[i].path;
        if (strncmp(p, prefix, plen) != 0) {
            continue;
        }
        const char *name = p + plen;
        size_t len = strcspn(name, ".[");
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            const char *q = config_schema[j].path;
            seen = strncmp(q, prefix, plen) == 0 && strncmp(q + plen, name, len) == 0 &&
                   strcspn(q + plen, ".[") == len;
        }
        if (!seen) {
            fn(name, len, arg);
        }
    }
}

struct text_buf {
    char *buf;
    size_t len, used;
};

static void append_name(const char *name, size_t len, void *arg) {
    struct text_buf *tb = arg;
    if (tb->used < tb->len) {
        int w = snprintf(tb->buf + tb->used, tb->len - tb->used, "%s%.*s", tb->used > 0 ? ", " : "",
                         (int)len, name);
        tb->used += w > 0 ? (size_t)w : 0;
    }
}

void config_schema_valid_keys(const char *prefix, char *buf, size_t len) {
    struct text_buf tb = {buf, len, 0};
    buf[0] = '\0';
    each_child(prefix, append_name, &tb);
}

/* Edit distance, to suggest the key a typo meant. Names are short; longer ones get no hint. */
static size_t edit_distance(const char *a, size_t alen, const char *b, size_t blen) {
    size_t row[65];
    if (alen >= BD_ARRAY_LEN(row) || blen >= BD_ARRAY_LEN(row)) {
        return SIZE_MAX;
    }
    for (size_t j = 0; j <= blen; j++) {
        row[j] = j;
    }
    for (size_t i = 1; i <= alen; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= blen; j++) {
            size_t up = row[j];
            size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
            row[j] = BD_MIN(BD_MIN(row[j] + 1, row[j - 1] + 1), diag + cost);
            diag = up;
        }
    }
    return row[blen];
}

struct suggest {
    const char *typo;
    const char *best;
    size_t best_len, best_dist;
};

static void consider_name(const char *name, size_t len, void *arg) {
    struct suggest *s = arg;
    size_t d = edit_distance(s->typo, strlen(s->typo), name, len);
    if (d < s->best_dist) {
        s->best = name;
        s->best_len = len;
        s->best_dist = d;
    }
}

const char *config_schema_nearest(const char *prefix, const char *typo, size_t *len) {
    struct suggest s = {.typo = typo, .best_dist = SIZE_MAX};
    each_child(prefix, consider_name, &s);
    /* Within two edits is a typo; further off, a guess would mislead more than help. */
    if (s.best == NULL || s.best_dist > 2) {
        return NULL;
    }
    *len = s.best_len;
    return s.best;
}

/* ---- Rules between keys ---------------------------------------------------------------------- */

bool config_schema_broken_rule(const struct bd_config *cfg, struct rule_failure *rf) {
    char into[BD_SUMMARY_COLLECTION_MAX], a[32];
    *rf = (struct rule_failure){0};
    if (cfg->n_listeners == 0) {
        rf->key = "listeners";
        snprintf(rf->why, sizeof(rf->why), "at least one listener is required");
        return true;
    }
    bd_config_summary_collection(cfg, into, sizeof(into));
    if (strcmp(into, cfg->mongodb.collection) == 0) {
        rf->key = "summaries.collection";
        snprintf(rf->why, sizeof(rf->why), "must differ from mongodb.collection");
        return true;
    }
    if (cfg->flush.retry_initial_ms > cfg->flush.retry_max_ms) {
        rf->key = "flush.retry_initial";
        rf->other = "flush.retry_max";
        snprintf(rf->why, sizeof(rf->why), "must not exceed flush.retry_max");
        return true;
    }
    /*
     * MongoDB deletes a document once its bucket_end is older than the retention. A bucket still
     * takes readings up to buckets.max_late after its end, so a shorter retention would delete
     * pages that a late reading then starts again from nothing.
     */
    uint64_t open_ms = cfg->buckets.max_late_ms + cfg->buckets.span_ms;
    if (cfg->buckets.retention_ms != 0 && cfg->buckets.retention_ms < open_ms) {
        bd_units_format_duration_ms(open_ms, a, sizeof(a));
        rf->key = "buckets.retention";
        rf->other = "buckets.max_late";
        snprintf(rf->why, sizeof(rf->why),
                 "must be 0 (off) or at least buckets.max_late + buckets.span (%s), so that no "
                 "bucket expires while it can still take readings",
                 a);
        return true;
    }
    /*
     * Summaries may outlive their pages (dashboards keep their hourly figures), never the
     * reverse: bucketd-inspect verify reports pages without a summary as a problem.
     */
    if (cfg->summaries.retention_ms != 0 &&
        (cfg->buckets.retention_ms == 0 ||
         cfg->summaries.retention_ms < cfg->buckets.retention_ms)) {
        rf->key = "summaries.retention";
        rf->other = "buckets.retention";
        snprintf(rf->why, sizeof(rf->why),
                 "must be 0 (off) or at least buckets.retention (which must then be set): a "
                 "summary may outlive its pages, not expire before them");
        return true;
    }
    return false;
}
