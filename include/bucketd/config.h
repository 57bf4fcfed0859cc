/*
 * The daemon's configuration: one schema table (src/config_schema.c) describes every key, its
 * type, bounds, default and help; this header is the parsed result (src/config.c loads it, with
 * src/config_files.c for the files it names; src/units.c reads its numbers). Loaded on the main
 * thread before any other thread starts; a reload (reload.h) loads the file again on that thread
 * and hands each other thread its own copy, so a struct bd_config is never changed while another
 * thread reads it.
 */
#ifndef BUCKETD_CONFIG_H
#define BUCKETD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>

#include "bucketd/allow.h"
#include "bucketd/common.h"
/* The strict unit parsers (bd_parse_duration_ms, bd_parse_size, bd_parse_hostport). */
#include "bucketd/units.h"

#define BD_MAX_LISTENERS 16
/* A URI with a percent-encoded password from mongodb.password_file (up to 3 bytes per byte). */
#define BD_CONFIG_URI_MAX 8192

enum bd_proto { BD_PROTO_UDP = 0, BD_PROTO_TCP };
enum bd_format { BD_FORMAT_INFLUX = 0, BD_FORMAT_GRAPHITE };
enum bd_precision { BD_PREC_NS = 0, BD_PREC_US, BD_PREC_MS, BD_PREC_S };
enum bd_sink { BD_SINK_MONGODB = 0, BD_SINK_BLACKHOLE };

/* Where a value was written in the file (1-based line and column); 0 when it was not (its
 * default). For messages about a value that only fails on this host (bd_config_check_binds). */
struct bd_config_pos {
    uint32_t line, col;
};

struct bd_listener_config {
    enum bd_proto proto;
    char bind[128];               /* as written: "host:port" or "[v6]:port" */
    struct sockaddr_storage addr; /* resolved from bind (numeric hosts only) */
    enum bd_format format;
    enum bd_precision precision;     /* default ns */
    uint64_t rcvbuf;                 /* udp: SO_RCVBUF request in bytes, default 8 MiB */
    uint32_t max_connections;        /* tcp: default 1024 */
    uint64_t idle_timeout_ms;        /* tcp: default 5 min; 0 = never */
    uint32_t max_connections_per_ip; /* tcp: per IPv4 address or IPv6 /64; default
                                        64; 0 (not from a file) = max_connections */
    struct bd_allow allow;           /* senders allowed; empty (absent) = everyone */
    /* tcp: TLS when cert is set (src/tls.c); "" = not set. Validated when loaded. */
    struct {
        char cert[512];      /* PEM certificate chain */
        char key[512];       /* PEM private key */
        char client_ca[512]; /* PEM CA bundle: clients must present a certificate it verifies */
    } tls;
};

struct bd_config {
    char path[1024]; /* file it was loaded from */
    /* "" unless the file sets it; the daemon then uses the id kept in spool.dir (writer.h). */
    char writer_id[128];

    struct bd_listener_config listeners[BD_MAX_LISTENERS];
    uint32_t n_listeners;

    enum bd_sink sink;

    struct {
        /*
         * The URI the daemon connects with: mongodb.uri, or what mongodb.uri_file holds, with
         * the password of mongodb.password_file percent-encoded into it. Holds the password:
         * never log it (bd_uri_redact). Not a key of the file; uri_given is.
         */
        char uri[BD_CONFIG_URI_MAX];
        char uri_given[1024];     /* mongodb.uri as the file writes it (or the default) */
        char uri_file[1024];      /* mongodb.uri_file as written; "" = not used */
        char password_file[1024]; /* mongodb.password_file as written; "" = not used */
        /* Where those two were read from (bd_creds_path), for messages and the mode check. */
        char uri_file_path[1024];
        char password_file_path[1024];
        char database[128];
        char collection[128];
        char write_concern[64]; /* "1", "majority" or a number >= 1; "0" is refused */
        uint64_t wtimeout_ms;   /* write concern timeout, default 5s; 0 = none */
    } mongodb;

    struct {
        uint64_t span_ms;       /* default 1h; must divide a day evenly */
        uint32_t max_readings;  /* per document page, default 1000 */
        uint64_t max_bytes;     /* estimated BSON bytes per page, default 128 KiB */
        uint64_t max_late_ms;   /* readings older than now - max_late are dropped; default 24h */
        uint64_t max_future_ms; /* readings newer than now + max_future are dropped; default 10m */
        uint64_t retention_ms;  /* TTL on bucket_end (whole seconds); 0 (default) = none */
    } buckets;

    struct {
        uint64_t interval_ms;      /* default 1s */
        uint32_t max_updates;      /* bucket updates per bulk write, default 1000 */
        uint64_t stop_timeout_ms;  /* how long a stop may spend flushing, default 30s */
        uint64_t max_delay_ms;     /* a page's readings wait for more at most, default 30s */
        uint64_t retry_initial_ms; /* first backoff after a failed bulk write, default 100ms */
        uint64_t retry_max_ms;     /* backoff cap, default 10s */
    } flush;

    struct {
        char collection[128];  /* "" (default): "<mongodb.collection>_summary" */
        uint64_t interval_ms;  /* a bucket's summary is refreshed at most this often; 0 = off */
        uint64_t retention_ms; /* TTL on the summaries' bucket_end; 0 (default) = none */
    } summaries;

    struct {
        char dir[1024];     /* default /var/lib/bucketd/spool */
        uint64_t max_bytes; /* default 1 GiB */
        char sync[16];      /* none | batch | a duration; default 1s (bd_config_spool_sync) */
        int when_full;      /* enum bd_spool_when_full, default drop_oldest */
    } spool;

    struct {
        char bind[128];              /* default "127.0.0.1:9273"; "" disables */
        uint64_t unhealthy_after_ms; /* /healthz: MongoDB unreachable this long; default 1m */
        uint32_t spool_high_water;   /* /healthz: percent of spool.max_bytes; default 80 */
        uint64_t silent_after_ms;    /* bucketd_sensors_silent: no reading this long; 15m */
    } metrics;

    struct {
        int level; /* enum bd_log_level, default info */
    } log;

    struct {
        uint64_t wait_for_sync_ms; /* trust an unsynchronised clock after this; default 10m */
    } time;

    struct {
        char loops[8]; /* ingest.loops: "auto" or 1..BD_MAX_INGEST_LOOPS (bd_config_ingest_loops) */
    } ingest;

    struct {
        uint32_t max_sensors;    /* default 100000 */
        uint64_t memory;         /* buffer pool + pending batches, default 64 MiB */
        uint32_t ring_size;      /* no longer used; accepted for older configs */
        uint32_t max_fields;     /* fields per line, default 32 (<= BD_PARSE_MAX_FIELDS) */
        uint32_t max_line;       /* bytes per line, default 64 KiB */
        uint32_t max_name;       /* bytes of a sensor id or field key, default 1 KiB; 0: none */
        uint64_t sensor_memory;  /* sensor state, default 64 MiB; 0: unbounded (tests) */
        uint64_t sensor_idle_ms; /* evict sensors silent this long, default 1h; 0 = never */
    } limits;

    /* Where the addresses were written in the file, for bd_config_check_binds; not settings
     * (apart from the listeners, whose structs compare equal between two files). */
    struct {
        struct bd_config_pos listener_bind[BD_MAX_LISTENERS]; /* by index in the file */
        struct bd_config_pos metrics_bind;                    /* 0: the default */
    } at;
};

/* spool.when_full (the same values as spool.h's enum bd_spool_full). */
enum bd_spool_when_full {
    BD_SPOOL_FULL_DROP_OLDEST,
    BD_SPOOL_FULL_DROP_NEWEST,
    BD_SPOOL_FULL_BLOCK,
};

/* ingest.loops: at most this many. */
#define BD_MAX_INGEST_LOOPS 16
/*
 * ingest.loops text to a number of loops on a box with `cores` online CPUs: a number as
 * written, or "auto": 1 with fewer than 4 cores, else 2 (see src/ingest_loops.c for why no
 * more). 0, or -EINVAL for anything else.
 */
int bd_config_ingest_loops(const char *text, uint32_t cores, uint32_t *loops);

/* spool.sync text: enum bd_spool_sync (spool.h) and *interval_ms, or -EINVAL. */
int bd_config_spool_sync(const char *text, uint64_t *interval_ms);

/* The summary collection's name: summaries.collection, or "<mongodb.collection>_summary". */
#define BD_SUMMARY_COLLECTION_MAX 136
void bd_config_summary_collection(const struct bd_config *cfg, char *buf, size_t cap);

/* Fill cfg with every default (writer_id stays "": see struct bd_config). */
void bd_config_defaults(struct bd_config *cfg);

/*
 * Load and validate a YAML file over the defaults. On error returns a negative errno and
 * err->msg reads "FILE:LINE:COL: KEY: message" (unknown keys list the valid ones).
 */
int bd_config_load(struct bd_config *cfg, const char *path, struct bd_err *err);

/*
 * What a loaded configuration should be warned about, without failing it (--check-config
 * prints these, the daemon logs them at start): a file holding the MongoDB password readable by
 * more than the daemon (bd_creds_exposed), and URI options that weaken TLS or send credentials
 * in clear (bd_mongo_uri_warnings), and a metrics.silent_after not below limits.sensor_idle (the
 * gauge could never count a sensor). cb is called once per warning, with a whole sentence.
 */
typedef void (*bd_config_warn_cb)(void *arg, const char *msg);
void bd_config_warnings(const struct bd_config *cfg, bd_config_warn_cb cb, void *arg);

/*
 * Whether each address the configuration binds (every listener's bind, metrics.bind) can be
 * bound on this host, tried with bind(2) on a socket of the listener's type at the same
 * address with port 0: an address no interface holds (a placeholder, another host's) fails
 * with EADDRNOTAVAIL, while the configured port may be held by the running daemon itself (a
 * file checked before a reload or a restart) without failing the check. A port held by
 * another program is therefore found only at start. cb is called once per address that
 * cannot be bound, with "FILE:LINE:COL: KEY: message" (FILE: KEY for a default); returns how
 * many there were.
 */
int bd_config_check_binds(const struct bd_config *cfg, bd_config_warn_cb cb, void *arg);

/*
 * Print the effective config as YAML that bd_config_load reads back to the same values, except
 * that a password in mongodb.uri is shown as "*****" (and mongodb.uri is left out when
 * mongodb.uri_file replaces it). Returns 0 or -EIO if writing failed.
 */
int bd_config_dump(const struct bd_config *cfg, FILE *out);

/* One difference between the running configuration and the file a reload read. */
struct bd_config_change {
    /* "flush.interval"; "listeners[2].format" (a kept listener, by its index in the file);
     * "listeners" for a listener added (from "") or removed (to ""), shown as "udp 0.0.0.0:8089". */
    const char *key;
    const char *from; /* the running value, as the file would write it */
    const char *to;   /* the file's value */
    bool applied;     /* false: the key needs a restart and keeps its running value */
};
typedef void (*bd_config_change_cb)(void *arg, const struct bd_config_change *c);

/*
 * For SIGHUP: *out = cur with every key the schema marks reloadable taken from next. The
 * listener set is next's: listeners are matched by proto and address, those only in next are
 * added, those only in cur removed, and a kept one keeps its running values except allow, which
 * is applied (its other keys need a restart). A key next leaves unset (writer_id) keeps its
 * running value. cb (may be NULL) is called for every difference, applied or not. -EINVAL, with out untouched, if the result
 * breaks a rule between keys (possible when a key that needs a restart keeps its value).
 */
int bd_config_reload_merge(const struct bd_config *cur, const struct bd_config *next,
                           struct bd_config *out, bd_config_change_cb cb, void *arg,
                           struct bd_err *err);

/* The same socket: same proto and address (what a reload matches listeners by). */
bool bd_listener_same(const struct bd_listener_config *a, const struct bd_listener_config *b);

/* Names for log lines and tools. */
const char *bd_proto_name(enum bd_proto p);
const char *bd_format_name(enum bd_format f);
const char *bd_precision_name(enum bd_precision p);
int bd_format_parse(const char *s, enum bd_format *out);
int bd_precision_parse(const char *s, enum bd_precision *out);

#endif
