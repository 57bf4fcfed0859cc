/*
 * Configuration: the schema table and the YAML loader (the strict unit parsers are src/units.c).
 *
 * The schema table below is the only place a key is described: its path, type, bounds,
 * default, whether SIGHUP may change it, and its help text. Defaults, validation, the dump and
 * the reload check are all driven by it, so adding a key means adding one row.
 *
 * Runs on the main thread only: at start-up before any other thread exists, and later on
 * SIGHUP. bd_config_load parses into a private copy and copies it into the caller's struct
 * only once the whole file is valid, so a bad file never leaves a half-applied config behind.
 * Nothing allocated here outlives a call; the libyaml document is freed before returning.
 */
#include "bucketd/config.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <inttypes.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "bucketd/creds.h"
#include "bucketd/log.h"
#include "bucketd/mongo.h"
#include "bucketd/parse.h"
#include "bucketd/spool.h"
#include "bucketd/tls.h"
#include "bucketd/units.h"

/*
 * Retention becomes a TTL index's expireAfterSeconds. MongoDB 6.0 refuses a value above the
 * seconds since 1970 (about 1.7e9 today); 50 years stays below that for decades.
 */
#define MAX_RETENTION_MS (50 * 365 * BD_MS_PER_DAY)

/* A config file is a few KiB; anything this large is a wrong path, not a config. */
#define MAX_FILE_BYTES (1024 * 1024)

/* A value as text: the longest is an allow list of BD_ALLOW_MAX IPv6 prefixes. */
#define VALUE_TEXT_LEN (BD_ALLOW_MAX * (BD_CIDR_TEXT_LEN + 4) + 8)

/* Listener keys live under this pseudo-section; their offsets are into the listener struct. */
#define LISTENER_PREFIX "listeners[]."

enum key_type {
    T_STRING,
    T_DURATION, /* "1500ms", "1s", "5m", "1h", "0"; stored in milliseconds */
    T_SIZE,     /* "64KiB", "8MiB", "1GiB", bytes as a bare integer */
    T_UINT,
    T_ENUM,
    T_HOSTPORT, /* numeric "host:port" or "[v6]:port" */
    T_LOGLEVEL,
    T_LISTENERS, /* the sequence of listener mappings */
    T_CIDRS,     /* a list of address prefixes (struct bd_allow) */
};

enum key_flag {
    KF_RELOAD = 1 << 0,   /* SIGHUP may change it; everything else needs a restart */
    KF_REQUIRED = 1 << 1, /* must be present (listener keys) */
    KF_UDP = 1 << 2,      /* only valid on udp listeners */
    KF_TCP = 1 << 3,      /* only valid on tcp listeners */
    KF_EMPTY_OK = 1 << 4, /* hostport: "" means disabled */
    KF_RESOLVE = 1 << 5,  /* hostport: also store the sockaddr at addr_off */
    KF_UNSET_OK = 1 << 6, /* no default: "" until the file sets it (the dump then leaves it out) */
    KF_SECRET = 1 << 7,   /* may hold credentials: a reload logs that it changed, not its value */
};

struct enum_name {
    const char *name;
    int value;
};

struct key_def {
    const char *path; /* "flush.interval"; listener keys "listeners[].bind" */
    enum key_type type;
    size_t off;  /* into struct bd_config, or struct bd_listener_config for listener keys */
    size_t size; /* of that field */
    size_t addr_off;
    uint64_t min, max; /* numbers: value bounds; strings: length bounds */
    const char *def;   /* default, written as a user would write it; NULL = none */
    const struct enum_name *names;
    /* Extra rule beyond the bounds; returns why the value is refused, or NULL. */
    const char *(*check)(const char *text, uint64_t num);
    unsigned flags;
    const char *help;
};

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
static const struct key_def schema[] = {
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
    {.path = "log.level", .type = T_LOGLEVEL, CFG(log.level), .def = "info",
     .names = level_names, .flags = KF_RELOAD, .help = "least severe level logged"},
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

#define N_KEYS BD_ARRAY_LEN(schema)

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

static const char *check_uri(const char *s, uint64_t unused) {
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

static const char *check_spool_sync(const char *s, uint64_t unused) {
    (void)unused;
    uint64_t ms;
    return bd_config_spool_sync(s, &ms) < 0
               ? "must be none, batch, or an interval from 10ms to 1h (e.g. 1s, 10s)"
               : NULL;
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

static bool in_listener(const struct key_def *k) {
    return strncmp(k->path, LISTENER_PREFIX, sizeof(LISTENER_PREFIX) - 1) == 0;
}

static void format_number(const struct key_def *k, uint64_t v, char *buf, size_t len) {
    if (k->type == T_DURATION) {
        bd_units_format_duration_ms(v, buf, len);
    } else if (k->type == T_SIZE) {
        bd_units_format_size(v, buf, len);
    } else {
        snprintf(buf, len, "%" PRIu64, v);
    }
}

struct value {
    uint64_t num;
    int ival;
    struct sockaddr_storage addr;
};

/*
 * Parse text as the row's type and apply its bounds and extra rule. On failure writes a reason
 * into why (without the key; the caller adds position and key).
 */
static int parse_value(const struct key_def *k, const char *text, struct value *v, char *why,
                       size_t why_len) {
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

static void store_value(const struct key_def *k, void *base, const char *text,
                        const struct value *v) {
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

/* The field as text that parse_value takes back unchanged. */
static void format_value(const struct key_def *k, const void *base, char *buf, size_t len) {
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
    struct value v;
    char why[256];
    if (parse_value(k, text, &v, why, sizeof(why)) < 0) {
        fprintf(stderr, "<2>bucketd: default of %s: %s\n", k->path, why);
        BD_ASSERT(!"schema default is invalid");
    }
    store_value(k, base, text, &v);
}

static void listener_defaults(struct bd_listener_config *lc) {
    memset(lc, 0, sizeof(*lc));
    for (size_t i = 0; i < N_KEYS; i++) {
        if (in_listener(&schema[i]) && schema[i].def != NULL) {
            apply_default(&schema[i], lc, schema[i].def);
        }
    }
}

void bd_config_defaults(struct bd_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &schema[i];
        if (in_listener(k) || k->type == T_LISTENERS) {
            continue;
        }
        if (k->def != NULL) {
            apply_default(k, cfg, k->def);
        }
    }
    snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", cfg->mongodb.uri_given);
}

/* ---- Schema lookups -------------------------------------------------------------------------- */

static int find_key(const char *path) {
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strcmp(schema[i].path, path) == 0) {
            return (int)i;
        }
    }
    return -1;
}

/* True if some key lives under "<path>.", i.e. path names a section. */
static bool is_section(const char *path) {
    size_t len = strlen(path);
    for (size_t i = 0; i < N_KEYS; i++) {
        if (strncmp(schema[i].path, path, len) == 0 && schema[i].path[len] == '.') {
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
        const char *p = schema[i].path;
        if (strncmp(p, prefix, plen) != 0) {
            continue;
        }
        const char *name = p + plen;
        size_t len = strcspn(name, ".[");
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            const char *q = schema[j].path;
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

static void valid_keys(const char *prefix, char *buf, size_t len) {
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

/* ---- The YAML walk --------------------------------------------------------------------------- */

struct loader {
    const char *path;
    const char *text; /* the file, for turning a reader error's byte offset into line:column */
    size_t text_len;
    yaml_document_t *doc;
    struct bd_config *cfg;
    struct bd_err *err;
    /* Where each top-level key was given, for errors found after the walk. */
    bool set[N_KEYS];
    yaml_mark_t mark[N_KEYS];
};

static int fail(struct loader *ld, yaml_mark_t mark, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(struct loader *ld, yaml_mark_t mark, const char *key, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return bd_err_set(ld->err, -EINVAL, "%s:%zu:%zu: %s: %s", ld->path, mark.line + 1,
                      mark.column + 1, key, msg);
}

static yaml_node_t *node_at(struct loader *ld, int index) {
    yaml_node_t *n = yaml_document_get_node(ld->doc, index);
    BD_ASSERT(n != NULL);
    return n;
}

static const char *scalar(const yaml_node_t *n) {
    return (const char *)n->data.scalar.value;
}

/* "key:" with nothing after it: treated as an empty section, so all children can be commented. */
static bool is_null(const yaml_node_t *n) {
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
           (n->data.scalar.length == 0 || strcmp(scalar(n), "~") == 0 ||
            strcmp(scalar(n), "null") == 0);
}

static const char *node_kind(const yaml_node_t *n) {
    return n->type == YAML_MAPPING_NODE    ? "a mapping"
           : n->type == YAML_SEQUENCE_NODE ? "a list"
                                           : "a value";
}

static int apply_leaf(struct loader *ld, const struct key_def *k, yaml_node_t *vn,
                      const char *shown, void *base) {
    char why[300];
    struct value v;

    if (vn->type != YAML_SCALAR_NODE) {
        /* A list where an address belongs is nearly always an IPv6 address left unquoted. */
        return fail(ld, vn->start_mark, shown, "expected a single value, not %s%s", node_kind(vn),
                    k->type == T_HOSTPORT ? " (quote IPv6 addresses: \"[::]:8089\")" : "");
    }
    if (strlen(scalar(vn)) != vn->data.scalar.length) {
        return fail(ld, vn->start_mark, shown, "contains a NUL character");
    }
    if (parse_value(k, scalar(vn), &v, why, sizeof(why)) < 0) {
        return fail(ld, vn->start_mark, shown, "%s", why);
    }
    store_value(k, base, scalar(vn), &v);
    return 0;
}

/*
 * A list of prefixes. An empty list (or "allow:" with every entry commented out) is refused
 * rather than read as "nobody" or "everybody": either reading would surprise someone.
 */
static int apply_cidrs(struct loader *ld, const struct key_def *k, yaml_node_t *vn,
                       const char *shown, void *base) {
    struct bd_allow *a = (struct bd_allow *)(void *)((char *)base + k->off);
    char why[300], item[200];
    uint32_t i = 0;

    if (vn->type != YAML_SEQUENCE_NODE ||
        vn->data.sequence.items.start == vn->data.sequence.items.top) {
        return fail(ld, vn->start_mark, shown,
                    "expected a non-empty list of address prefixes (e.g. [\"192.168.1.0/24\", "
                    "\"fd00::/8\"]); leave the key out to accept every sender");
    }
    memset(a, 0, sizeof(*a));
    for (yaml_node_item_t *it = vn->data.sequence.items.start; it < vn->data.sequence.items.top;
         it++, i++) {
        yaml_node_t *en = node_at(ld, *it);
        snprintf(item, sizeof(item), "%s[%" PRIu32 "]", shown, i);
        if (i >= BD_ALLOW_MAX) {
            return fail(ld, en->start_mark, item, "at most %d prefixes are supported",
                        BD_ALLOW_MAX);
        }
        if (en->type != YAML_SCALAR_NODE) {
            return fail(ld, en->start_mark, item, "expected an address prefix, not %s",
                        node_kind(en));
        }
        if (strlen(scalar(en)) != en->data.scalar.length) {
            return fail(ld, en->start_mark, item, "contains a NUL character");
        }
        if (bd_cidr_parse(scalar(en), &a->e[i], why, sizeof(why)) < 0) {
            return fail(ld, en->start_mark, item, "%s", why);
        }
        a->n = i + 1;
    }
    return 0;
}

static int walk_listeners(struct loader *ld, yaml_node_t *seq);

/*
 * Apply one mapping. prefix is the schema path of this level ("", "flush.", "listeners[]."),
 * shown the same as the user sees it ("listeners[2]."); set and mark record what was given.
 */
static int walk_mapping(struct loader *ld, yaml_node_t *map, const char *prefix, const char *shown,
                        void *base, bool *set, yaml_mark_t *mark) {
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *kn = node_at(ld, p->key);
        yaml_node_t *vn = node_at(ld, p->value);
        char path[128], disp[160], list[256];
        int rc = 0;

        if (kn->type != YAML_SCALAR_NODE) {
            return fail(ld, kn->start_mark, shown[0] != '\0' ? shown : "config",
                        "a key must be a plain name, not %s", node_kind(kn));
        }
        const char *name = scalar(kn);
        snprintf(path, sizeof(path), "%s%s", prefix, name);
        snprintf(disp, sizeof(disp), "%s%s", shown, name);

        /* libyaml keeps both copies of a repeated key; silently taking one would hide a typo. */
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = node_at(ld, q->key);
            if (prev->type == YAML_SCALAR_NODE &&
                prev->data.scalar.length == kn->data.scalar.length &&
                memcmp(prev->data.scalar.value, kn->data.scalar.value, kn->data.scalar.length) ==
                    0) {
                return fail(ld, kn->start_mark, disp,
                            "duplicate key (first given at line %zu, column %zu)",
                            prev->start_mark.line + 1, prev->start_mark.column + 1);
            }
        }

        /*
         * A name is one path component: a literal "flush.interval" or "listeners[].bind" key
         * would otherwise match a row of another level and be stored at the wrong base.
         */
        bool plain = strlen(name) == kn->data.scalar.length && strpbrk(name, ".[") == NULL;
        int idx = plain ? find_key(path) : -1;
        if (idx >= 0 && schema[idx].type == T_LISTENERS) {
            rc = walk_listeners(ld, vn);
        } else if (idx >= 0 && schema[idx].type == T_CIDRS) {
            rc = apply_cidrs(ld, &schema[idx], vn, disp, base);
        } else if (idx >= 0) {
            rc = apply_leaf(ld, &schema[idx], vn, disp, base);
        } else if (plain && is_section(path)) {
            char sub_prefix[160], sub_shown[168];
            snprintf(sub_prefix, sizeof(sub_prefix), "%s.", path);
            snprintf(sub_shown, sizeof(sub_shown), "%s.", disp);
            if (is_null(vn)) {
                continue;
            }
            if (vn->type != YAML_MAPPING_NODE) {
                valid_keys(sub_prefix, list, sizeof(list));
                return fail(ld, vn->start_mark, disp, "expected a mapping with keys: %s", list);
            }
            rc = walk_mapping(ld, vn, sub_prefix, sub_shown, base, set, mark);
        } else {
            struct suggest s = {.typo = name, .best_dist = SIZE_MAX};
            char hint[96] = "";
            each_child(prefix, consider_name, &s);
            /* Within two edits is a typo; further off, a guess would mislead more than help. */
            if (s.best != NULL && s.best_dist <= 2) {
                snprintf(hint, sizeof(hint), "did you mean \"%.*s\"? ", (int)s.best_len, s.best);
            }
            valid_keys(prefix, list, sizeof(list));
            return fail(ld, kn->start_mark, disp, "unknown key; %svalid keys here: %s", hint, list);
        }
        if (rc < 0) {
            return rc;
        }
        if (idx >= 0) {
            set[idx] = true;
            mark[idx] = schema[idx].type == T_LISTENERS ? kn->start_mark : vn->start_mark;
        }
    }
    return 0;
}

static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) {
        return false;
    }
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *x = (const struct sockaddr_in *)a;
        const struct sockaddr_in *y = (const struct sockaddr_in *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)a;
    const struct sockaddr_in6 *y = (const struct sockaddr_in6 *)b;
    return x->sin6_port == y->sin6_port &&
           memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
}

/*
 * listeners[].tls: cert and key together, and a context that builds from them, so that a missing
 * or unreadable file, bad PEM or a key of another certificate fails here and not at start.
 */
static int check_tls(struct loader *ld, const struct bd_listener_config *lc, const char *shown,
                     const bool *set, const yaml_mark_t *mark) {
    int cert = find_key(LISTENER_PREFIX "tls.cert");
    int key = find_key(LISTENER_PREFIX "tls.key");
    int ca = find_key(LISTENER_PREFIX "tls.client_ca");
    struct bd_tls_ctx *ctx = NULL;
    struct bd_err terr = {0};
    const char *bad = NULL;
    char k[64];

    if (!set[cert] && !set[key] && !set[ca]) {
        return 0;
    }
    if (!set[cert] || !set[key]) {
        int given = set[cert] ? cert : set[key] ? key : ca;
        snprintf(k, sizeof(k), "%s.tls", shown);
        return fail(ld, mark[given], k, "needs both cert and key (%s is missing)",
                    set[cert] ? "key" : "cert");
    }
    if (bd_tls_ctx_new(&ctx, lc, &bad, &terr) < 0) {
        int at = strcmp(bad, "key") == 0 ? key : strcmp(bad, "client_ca") == 0 ? ca : cert;
        snprintf(k, sizeof(k), "%s.tls.%s", shown, bad);
        return fail(ld, mark[at], k, "%s", terr.msg);
    }
    bd_tls_ctx_free(ctx);
    return 0;
}

static int walk_listener(struct loader *ld, yaml_node_t *item, uint32_t n) {
    struct bd_listener_config *lc = &ld->cfg->listeners[n];
    bool set[N_KEYS] = {false};
    yaml_mark_t mark[N_KEYS];
    char shown[32], key[64];

    snprintf(shown, sizeof(shown), "listeners[%" PRIu32 "]", n);
    if (item->type != YAML_MAPPING_NODE) {
        return fail(ld, item->start_mark, shown, "expected a mapping (proto, bind, ...), not %s",
                    node_kind(item));
    }
    listener_defaults(lc);
    snprintf(key, sizeof(key), "%s.", shown);
    int rc = walk_mapping(ld, item, LISTENER_PREFIX, key, lc, set, mark);
    if (rc < 0) {
        return rc;
    }

    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &schema[i];
        if (!in_listener(k)) {
            continue;
        }
        const char *name = k->path + sizeof(LISTENER_PREFIX) - 1;
        if ((k->flags & KF_REQUIRED) && !set[i]) {
            return fail(ld, item->start_mark, shown, "missing required key \"%s\"", name);
        }
    }
    /* A second pass: whether a key fits depends on proto, which may come after it. */
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &schema[i];
        bool wrong = ((k->flags & KF_UDP) && lc->proto != BD_PROTO_UDP) ||
                     ((k->flags & KF_TCP) && lc->proto != BD_PROTO_TCP);
        if (in_listener(k) && set[i] && wrong) {
            snprintf(key, sizeof(key), "%s.%s", shown, k->path + sizeof(LISTENER_PREFIX) - 1);
            return fail(ld, mark[i], key, "only valid on %s listeners (this one is %s)",
                        (k->flags & KF_UDP) ? "udp" : "tcp", bd_proto_name(lc->proto));
        }
    }
    /* The default (64) gives way to a smaller max_connections; a value given must fit in it. */
    int per_ip = find_key(LISTENER_PREFIX "max_connections_per_ip");
    if (!set[per_ip]) {
        lc->max_connections_per_ip = BD_MIN(lc->max_connections_per_ip, lc->max_connections);
    } else if (lc->max_connections_per_ip > lc->max_connections) {
        snprintf(key, sizeof(key), "%s.max_connections_per_ip", shown);
        return fail(ld, mark[per_ip], key, "must not exceed max_connections (%" PRIu32 ")",
                    lc->max_connections);
    }
    for (uint32_t j = 0; j < n; j++) {
        const struct bd_listener_config *other = &ld->cfg->listeners[j];
        if (other->proto == lc->proto && same_addr(&other->addr, &lc->addr)) {
            int bind = find_key(LISTENER_PREFIX "bind");
            snprintf(key, sizeof(key), "%s.bind", shown);
            return fail(ld, mark[bind], key, "listeners[%" PRIu32 "] already binds %s %s", j,
                        bd_proto_name(lc->proto), other->bind);
        }
    }
    return check_tls(ld, lc, shown, set, mark);
}

static int walk_listeners(struct loader *ld, yaml_node_t *seq) {
    if (is_null(seq)) {
        return 0; /* the "at least one" check reports it with the right position */
    }
    if (seq->type != YAML_SEQUENCE_NODE) {
        return fail(ld, seq->start_mark, "listeners", "expected a list of listeners, not %s",
                    node_kind(seq));
    }
    for (yaml_node_item_t *it = seq->data.sequence.items.start; it < seq->data.sequence.items.top;
         it++) {
        yaml_node_t *item = node_at(ld, *it);
        if (ld->cfg->n_listeners >= BD_MAX_LISTENERS) {
            return fail(ld, item->start_mark, "listeners", "at most %d listeners are supported",
                        BD_MAX_LISTENERS);
        }
        int rc = walk_listener(ld, item, ld->cfg->n_listeners);
        if (rc < 0) {
            return rc;
        }
        ld->cfg->n_listeners++;
    }
    return 0;
}

static yaml_mark_t mark_of(struct loader *ld, const char *path, yaml_mark_t fallback) {
    int i = find_key(path);
    BD_ASSERT(i >= 0);
    return ld->set[i] ? ld->mark[i] : fallback;
}

/* A rule that involves more than one key: which key the message is about, the other one (for a
 * position when the first was not given in the file), and why. */
struct rule_failure {
    const char *key;
    const char *other; /* NULL: none */
    char why[200];
};

/*
 * The rules that involve more than one key. Checked once the whole file is applied, and again
 * on the configuration a reload would run (some of its keys may keep running values). True, and
 * rf filled, when cfg breaks one.
 */
static bool broken_rule(const struct bd_config *cfg, struct rule_failure *rf) {
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

/* Rules that involve more than one key, checked once the whole file is applied. */
static int validate(struct loader *ld, yaml_mark_t top) {
    struct rule_failure rf;
    if (!broken_rule(ld->cfg, &rf)) {
        return 0;
    }
    yaml_mark_t where = rf.other != NULL ? mark_of(ld, rf.other, top) : top;
    return fail(ld, mark_of(ld, rf.key, where), rf.key, "%s", rf.why);
}

/*
 * The URI the daemon connects with (cfg->mongodb.uri): mongodb.uri or the content of
 * mongodb.uri_file, with the password of mongodb.password_file put into it. At most one
 * place holds the password. Files are read now, so --check-config and a reload see a missing
 * or unreadable one.
 */
static int resolve_credentials(struct loader *ld, yaml_mark_t top) {
    struct bd_config *cfg = ld->cfg;
    char *text = NULL, *pw = NULL;
    struct bd_err e = {0};
    int rc = 0;
    bool uri_set = ld->set[find_key("mongodb.uri")];
    yaml_mark_t uf_mark = mark_of(ld, "mongodb.uri_file", top);
    yaml_mark_t pf_mark = mark_of(ld, "mongodb.password_file", top);

    cfg->mongodb.uri_file_path[0] = cfg->mongodb.password_file_path[0] = '\0';
    snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", cfg->mongodb.uri_given);
    if (cfg->mongodb.uri_file[0] == '\0' && cfg->mongodb.password_file[0] == '\0') {
        return 0;
    }
    text = malloc(BD_CREDS_MAX_FILE + 1);
    pw = malloc(BD_CREDS_MAX_FILE + 1);
    if (text == NULL || pw == NULL) {
        rc = bd_err_set(ld->err, -ENOMEM, "%s: out of memory", ld->path);
        goto out;
    }
    if (cfg->mongodb.uri_file[0] != '\0') {
        const char *path = cfg->mongodb.uri_file_path;
        if (uri_set) {
            rc = fail(ld, uf_mark, "mongodb.uri_file",
                      "give mongodb.uri or mongodb.uri_file, not both");
            goto out;
        }
        if (bd_creds_path(cfg->mongodb.uri_file, ld->path, cfg->mongodb.uri_file_path,
                          sizeof(cfg->mongodb.uri_file_path), &e) < 0 ||
            bd_creds_read(NULL, path, text, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = fail(ld, uf_mark, "mongodb.uri_file", "%s", e.msg);
            goto out;
        }
        const char *why = check_uri(text, 0);
        if (why != NULL) {
            rc = fail(ld, uf_mark, "mongodb.uri_file", "%s: %s", path, why);
            goto out;
        }
        if (strlen(text) >= sizeof(cfg->mongodb.uri)) {
            rc = fail(ld, uf_mark, "mongodb.uri_file", "%s: longer than %zu bytes", path,
                      sizeof(cfg->mongodb.uri) - 1);
            goto out;
        }
        snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", text);
    }
    if (cfg->mongodb.password_file[0] != '\0') {
        const char *path = cfg->mongodb.password_file_path;
        const char *from = cfg->mongodb.uri_file[0] != '\0' ? "mongodb.uri_file" : "mongodb.uri";
        if (bd_creds_path(cfg->mongodb.password_file, ld->path, cfg->mongodb.password_file_path,
                          sizeof(cfg->mongodb.password_file_path), &e) < 0 ||
            bd_creds_read(NULL, path, pw, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = fail(ld, pf_mark, "mongodb.password_file", "%s", e.msg);
            goto out;
        }
        if (bd_uri_add_password(cfg->mongodb.uri, pw, text, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = fail(ld, pf_mark, "mongodb.password_file", "%s (%s)", e.msg, from);
            goto out;
        }
        const char *why = check_uri(text, 0);
        if (why != NULL) {
            rc = fail(ld, pf_mark, "mongodb.password_file", "%s with this password: %s", from, why);
            goto out;
        }
        snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", text);
    }
out:
    /* Both buffers held secrets. */
    if (text != NULL) {
        explicit_bzero(text, BD_CREDS_MAX_FILE + 1);
    }
    if (pw != NULL) {
        explicit_bzero(pw, BD_CREDS_MAX_FILE + 1);
    }
    free(text);
    free(pw);
    return rc;
}

static int yaml_failure(struct loader *ld, const yaml_parser_t *parser) {
    if (parser->error == YAML_MEMORY_ERROR) {
        return bd_err_set(ld->err, -ENOMEM, "%s: out of memory parsing YAML", ld->path);
    }
    yaml_mark_t mark = parser->problem_mark;
    if (parser->error == YAML_READER_ERROR) {
        /* Reader errors (bad UTF-8, control characters) carry a byte offset, not a mark. */
        memset(&mark, 0, sizeof(mark));
        for (size_t i = 0; i < parser->problem_offset && i < ld->text_len; i++) {
            if (ld->text[i] == '\n') {
                mark.line++;
                mark.column = 0;
            } else {
                mark.column++;
            }
        }
    }
    const char *problem = parser->problem != NULL ? parser->problem : "malformed YAML";
    if (parser->context != NULL) {
        /*
         * The usual way into a flow-context error here is an unquoted IPv6 bind: YAML reads
         * [::]:8089 as the start of a list, and libyaml's message does not hint at that.
         */
        bool flow = strstr(parser->context, "flow") != NULL;
        return bd_err_set(ld->err, -EINVAL,
                          "%s:%zu:%zu: syntax error: %s (%s at line %zu, column %zu)%s", ld->path,
                          mark.line + 1, mark.column + 1, problem, parser->context,
                          parser->context_mark.line + 1, parser->context_mark.column + 1,
                          flow ? "; a value starting with '[' must be quoted, as in "
                                 "bind: \"[::]:8089\""
                               : "");
    }
    return bd_err_set(ld->err, -EINVAL, "%s:%zu:%zu: syntax error: %s", ld->path, mark.line + 1,
                      mark.column + 1, problem);
}

static int read_file(const char *path, char **out, size_t *out_len, struct bd_err *err) {
    char *buf = NULL;
    size_t len = 0;
    int fd = -1;
    int rc = 0;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
        goto out;
    }
    buf = malloc(MAX_FILE_BYTES + 1);
    if (buf == NULL) {
        rc = bd_err_set(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (;;) {
        ssize_t n = read(fd, buf + len, MAX_FILE_BYTES + 1 - len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0) {
            break;
        }
        len += (size_t)n;
        if (len > MAX_FILE_BYTES) {
            rc = bd_err_set(err, -EFBIG, "%s: larger than %d bytes; is this a config file?", path,
                            MAX_FILE_BYTES);
            goto out;
        }
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    buf = NULL;
out:
    free(buf);
    if (fd >= 0) {
        close(fd);
    }
    return rc;
}

int bd_config_load(struct bd_config *cfg, const char *path, struct bd_err *err) {
    struct loader *ld = NULL;
    struct bd_config *next = NULL;
    char *text = NULL;
    size_t text_len = 0;
    yaml_parser_t parser;
    bool parser_ok = false;
    yaml_document_t doc, extra;
    bool doc_ok = false, extra_ok = false;
    int rc = 0;

    rc = read_file(path, &text, &text_len, err);
    if (rc < 0) {
        goto out;
    }
    next = malloc(sizeof(*next));
    ld = calloc(1, sizeof(*ld));
    if (next == NULL || ld == NULL) {
        rc = bd_err_set(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    bd_config_defaults(next);
    if (strlen(path) >= sizeof(next->path)) {
        rc = bd_err_set(err, -ENAMETOOLONG, "%s: path too long", path);
        goto out;
    }
    snprintf(next->path, sizeof(next->path), "%s", path);
    *ld = (struct loader){
        .path = path, .text = text, .text_len = text_len, .doc = &doc, .cfg = next, .err = err};

    if (!yaml_parser_initialize(&parser)) {
        rc = bd_err_set(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    parser_ok = true;
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, text_len);
    if (!yaml_parser_load(&parser, &doc)) {
        rc = yaml_failure(ld, &parser);
        goto out;
    }
    doc_ok = true;

    yaml_node_t *root = yaml_document_get_root_node(&doc);
    yaml_mark_t top = {0, 0, 0};
    if (root != NULL && !is_null(root)) {
        top = root->start_mark;
        if (root->type != YAML_MAPPING_NODE) {
            char list[256];
            valid_keys("", list, sizeof(list));
            rc = fail(ld, root->start_mark, "config", "expected a mapping with keys: %s", list);
            goto out;
        }
        rc = walk_mapping(ld, root, "", "", next, ld->set, ld->mark);
        if (rc < 0) {
            goto out;
        }
    }

    /* A second document would be ignored by the walk above; refuse it instead. */
    if (!yaml_parser_load(&parser, &extra)) {
        rc = yaml_failure(ld, &parser);
        goto out;
    }
    extra_ok = true;
    yaml_node_t *extra_root = yaml_document_get_root_node(&extra);
    if (extra_root != NULL) {
        rc = fail(ld, extra_root->start_mark, "config", "only one YAML document is allowed");
        goto out;
    }

    rc = resolve_credentials(ld, top);
    if (rc < 0) {
        goto out;
    }
    rc = validate(ld, top);
    if (rc < 0) {
        goto out;
    }
    *cfg = *next;
out:
    if (extra_ok) {
        yaml_document_delete(&extra);
    }
    if (doc_ok) {
        yaml_document_delete(&doc);
    }
    if (parser_ok) {
        yaml_parser_delete(&parser);
    }
    free(ld);
    if (next != NULL) {
        explicit_bzero(next->mongodb.uri, sizeof(next->mongodb.uri));
    }
    free(next);
    free(text);
    return rc;
}

/* ---- Dump and reload check ------------------------------------------------------------------- */

static bool quoted_type(const struct key_def *k) {
    return k->type == T_STRING || k->type == T_HOSTPORT;
}

static void put_value(FILE *out, const struct key_def *k, const void *base) {
    char buf[VALUE_TEXT_LEN];
    format_value(k, base, buf, sizeof(buf));
    if (k->flags & KF_SECRET) {
        char plain[sizeof(buf)];
        snprintf(plain, sizeof(plain), "%s", buf);
        bd_uri_redact(plain, buf, sizeof(buf));
        explicit_bzero(plain, sizeof(plain));
    }
    if (!quoted_type(k)) {
        fprintf(out, "%s\n", buf);
        return;
    }
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)buf; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\') {
            fprintf(out, "\\%c", *p);
        } else if (*p < 0x20 || *p == 0x7f) {
            fprintf(out, "\\x%02x", *p);
        } else {
            fputc(*p, out);
        }
    }
    fputs("\"\n", out);
}

static bool listener_key_applies(const struct key_def *k, const struct bd_listener_config *lc) {
    return !(((k->flags & KF_UDP) && lc->proto != BD_PROTO_UDP) ||
             ((k->flags & KF_TCP) && lc->proto != BD_PROTO_TCP));
}

int bd_config_dump(const struct bd_config *cfg, FILE *out) {
    const char *section = NULL;
    size_t section_len = 0;

    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &schema[i];
        if (in_listener(k)) {
            continue;
        }
        if (k->type == T_LISTENERS) {
            fprintf(out, "listeners:\n");
            for (uint32_t n = 0; n < cfg->n_listeners; n++) {
                const struct bd_listener_config *lc = &cfg->listeners[n];
                const char *sub = NULL; /* the nested mapping being printed ("tls.cert") */
                bool first = true;
                for (size_t j = 0; j < N_KEYS; j++) {
                    const struct key_def *lk = &schema[j];
                    if (!in_listener(lk) || !listener_key_applies(lk, lc) ||
                        ((lk->flags & KF_UNSET_OK) && *((const char *)lc + lk->off) == '\0')) {
                        continue;
                    }
                    if (lk->type == T_CIDRS && lc->allow.n == 0) {
                        continue; /* absent: everyone; the dump reads back the same */
                    }
                    const char *name = lk->path + sizeof(LISTENER_PREFIX) - 1;
                    const char *dot = strchr(name, '.');
                    if (dot == NULL) {
                        sub = NULL;
                        fprintf(out, "  %s %s: ", first ? "-" : " ", name);
                    } else {
                        size_t len = (size_t)(dot - name);
                        if (sub == NULL || strncmp(sub, name, len + 1) != 0) {
                            sub = name;
                            fprintf(out, "  %s %.*s:\n", first ? "-" : " ", (int)len, name);
                        }
                        fprintf(out, "      %s: ", dot + 1);
                    }
                    put_value(out, lk, lc);
                    first = false;
                }
            }
            section = NULL;
            continue;
        }
        if ((k->flags & KF_UNSET_OK) && *(const char *)((const char *)cfg + k->off) == '\0') {
            continue; /* not set: left out, so that the dump reads back to "not set" */
        }
        if (k->off == offsetof(struct bd_config, mongodb.uri_given) &&
            cfg->mongodb.uri_file[0] != '\0') {
            continue; /* replaced by mongodb.uri_file; both would not read back */
        }
        const char *dot = strchr(k->path, '.');
        if (dot == NULL) {
            section = NULL;
            fprintf(out, "%s: ", k->path);
        } else {
            size_t len = (size_t)(dot - k->path);
            if (section == NULL || len != section_len || strncmp(section, k->path, len) != 0) {
                section = k->path;
                section_len = len;
                fprintf(out, "%.*s:\n", (int)len, k->path);
            }
            fprintf(out, "  %s: ", dot + 1);
        }
        put_value(out, k, cfg);
    }
    return ferror(out) ? -EIO : 0;
}

static bool key_differs(const struct key_def *k, const void *a, const void *b) {
    char x[VALUE_TEXT_LEN], y[VALUE_TEXT_LEN];
    format_value(k, a, x, sizeof(x));
    format_value(k, b, y, sizeof(y));
    return strcmp(x, y) != 0;
}

bool bd_listener_same(const struct bd_listener_config *a, const struct bd_listener_config *b) {
    return a->proto == b->proto && same_addr(&a->addr, &b->addr);
}

static void listener_text(const struct bd_listener_config *lc, char *buf, size_t len) {
    snprintf(buf, len, "%s %s", bd_proto_name(lc->proto), lc->bind);
}

static void report(bd_config_change_cb cb, void *arg, const char *key, const char *from,
                   const char *to, bool applied) {
    if (cb != NULL) {
        struct bd_config_change c = {.key = key, .from = from, .to = to, .applied = applied};
        cb(arg, &c);
    }
}

/*
 * The listener set of the file, each listener the file keeps (same proto and address) with its
 * running values: a listener is a socket, so its other keys need a restart.
 */
static void merge_listeners(const struct bd_config *cur, const struct bd_config *next,
                            struct bd_config *out, bd_config_change_cb cb, void *arg) {
    char key[64], x[VALUE_TEXT_LEN], y[VALUE_TEXT_LEN];
    for (uint32_t n = 0; n < next->n_listeners; n++) {
        const struct bd_listener_config *want = &next->listeners[n];
        const struct bd_listener_config *have = NULL;
        for (uint32_t c = 0; c < cur->n_listeners && have == NULL; c++) {
            have = bd_listener_same(&cur->listeners[c], want) ? &cur->listeners[c] : NULL;
        }
        if (have == NULL) {
            listener_text(want, y, sizeof(y));
            report(cb, arg, "listeners", "", y, true);
            out->listeners[n] = *want;
            continue;
        }
        for (size_t j = 0; j < N_KEYS; j++) {
            const struct key_def *lk = &schema[j];
            /* bind names the socket both share, however it is written. */
            if (in_listener(lk) && !(lk->flags & KF_RESOLVE) && listener_key_applies(lk, want) &&
                key_differs(lk, have, want)) {
                snprintf(key, sizeof(key), "listeners[%" PRIu32 "].%s", n,
                         lk->path + sizeof(LISTENER_PREFIX) - 1);
                format_value(lk, have, x, sizeof(x));
                format_value(lk, want, y, sizeof(y));
                report(cb, arg, key, x, y, (lk->flags & KF_RELOAD) != 0);
            }
        }
        out->listeners[n] = *have;
        /* A kept listener takes its reloadable keys (allow) from the file. */
        for (size_t j = 0; j < N_KEYS; j++) {
            const struct key_def *lk = &schema[j];
            if (in_listener(lk) && (lk->flags & KF_RELOAD)) {
                memcpy((char *)&out->listeners[n] + lk->off, (const char *)want + lk->off,
                       lk->size);
            }
        }
    }
    for (uint32_t c = 0; c < cur->n_listeners; c++) {
        bool kept = false;
        for (uint32_t n = 0; n < next->n_listeners && !kept; n++) {
            kept = bd_listener_same(&cur->listeners[c], &next->listeners[n]);
        }
        if (!kept) {
            listener_text(&cur->listeners[c], x, sizeof(x));
            report(cb, arg, "listeners", x, "", true);
        }
    }
    out->n_listeners = next->n_listeners;
}

int bd_config_reload_merge(const struct bd_config *cur, const struct bd_config *next,
                           struct bd_config *out, bd_config_change_cb cb, void *arg,
                           struct bd_err *err) {
    char x[VALUE_TEXT_LEN], y[VALUE_TEXT_LEN];
    struct bd_config *merged = malloc(sizeof(*merged));
    if (merged == NULL) {
        return bd_err_set(err, -ENOMEM, "%s: out of memory", next->path);
    }
    *merged = *cur;
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &schema[i];
        if (in_listener(k)) {
            continue;
        }
        if (k->type == T_LISTENERS) {
            merge_listeners(cur, next, merged, cb, arg);
            continue;
        }
        /* A key the file leaves unset keeps what the daemon worked out for it (writer_id: the
         * id kept in spool.dir, which a restart would use as well). */
        if ((k->flags & KF_UNSET_OK) && *((const char *)next + k->off) == '\0') {
            continue;
        }
        if (!key_differs(k, cur, next)) {
            continue;
        }
        format_value(k, cur, x, sizeof(x));
        format_value(k, next, y, sizeof(y));
        if (k->flags & KF_SECRET) {
            snprintf(x, sizeof(x), "(not shown)");
            snprintf(y, sizeof(y), "(changed)");
        }
        bool applied = (k->flags & KF_RELOAD) != 0;
        report(cb, arg, k->path, x, y, applied);
        if (applied) {
            memcpy((char *)merged + k->off, (const char *)next + k->off, k->size);
        }
    }
    /* The files' contents are no key of the file: a change there shows only in the result. */
    if (strcmp(cur->mongodb.uri, next->mongodb.uri) != 0 &&
        !key_differs(&schema[find_key("mongodb.uri")], cur, next) &&
        !key_differs(&schema[find_key("mongodb.uri_file")], cur, next) &&
        !key_differs(&schema[find_key("mongodb.password_file")], cur, next)) {
        report(cb, arg,
               next->mongodb.password_file[0] != '\0' && next->mongodb.uri_file[0] == '\0'
                   ? "mongodb.password_file (its content)"
                   : "mongodb.uri_file (its content)",
               "(not shown)", "(changed)", false);
    }
    struct rule_failure rf;
    int rc = 0;
    if (broken_rule(merged, &rf)) {
        /* Possible only through a running value kept for a key that needs a restart. */
        rc = bd_err_set(err, -EINVAL,
                        "%s: %s: %s (with the running values of the keys that "
                        "need a restart)",
                        next->path, rf.key, rf.why);
    } else {
        *out = *merged;
    }
    free(merged);
    return rc;
}

void bd_config_warnings(const struct bd_config *cfg, bd_config_warn_cb cb, void *arg) {
    char why[160], msg[1400];
    const char *files[3] = {NULL, NULL, NULL};
    const char *keys[3] = {NULL, NULL, NULL};
    size_t n = 0;
    if (bd_uri_has_password(cfg->mongodb.uri_given) && cfg->mongodb.uri_file[0] == '\0') {
        files[n] = cfg->path;
        keys[n++] = "the configuration file (mongodb.uri)";
    }
    if (cfg->mongodb.uri_file[0] != '\0' && cfg->mongodb.password_file[0] == '\0' &&
        bd_uri_has_password(cfg->mongodb.uri)) {
        files[n] = cfg->mongodb.uri_file_path;
        keys[n++] = "mongodb.uri_file";
    }
    if (cfg->mongodb.password_file[0] != '\0') {
        files[n] = cfg->mongodb.password_file_path;
        keys[n++] = "mongodb.password_file";
    }
    for (size_t i = 0; i < n; i++) {
        if (bd_creds_exposed(files[i], why, sizeof(why))) {
            snprintf(msg, sizeof(msg),
                     "%s: %s holds the MongoDB password and is %s: let only root and the "
                     "daemon read it (mode 0640 with group bucketd, or 0600 owned by the "
                     "daemon's user)%s",
                     files[i], keys[i], why,
                     files[i] == cfg->path ? ", or move the password to mongodb.password_file "
                                             "or a systemd credential (README: Credentials)"
                                           : "");
            cb(arg, msg);
        }
    }
    bd_mongo_uri_warnings(cfg->mongodb.uri,
                          cfg->mongodb.uri_file[0] != '\0' ? "mongodb.uri_file" : "mongodb.uri", cb,
                          arg);
}
