/*
 * Unit tests for src/config.c, its schema (src/config_schema.c) and the files it reads
 * (src/config_files.c): the schema defaults and the YAML loader's errors (position, key,
 * message); the strict unit parsers it reads numbers with are tests/unit/test_units.c's. Each
 * test runs in its own process (Criterion) and writes its YAML under a private mkdtemp
 * directory that the fixture removes.
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/config.h"
#include "bucketd/mongo.h"
#include "bucketd/log.h"
#include "bucketd/tls.h"
#include "tls_certs.h"

#define SHIPPED BD_SOURCE_DIR "/config/bucketd.yaml"

/* Enough for a config to load: everything else has a default. */
#define LISTENER "listeners:\n  - proto: udp\n    bind: \"127.0.0.1:8089\"\n"

static char tmpdir[256];
static char cfg_path[320];
static char dump_path[320];

static void setup(void) {
    const char *base = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/bd-config-XXXXXX", base != NULL ? base : "/tmp");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp: %s", strerror(errno));
    snprintf(cfg_path, sizeof(cfg_path), "%s/test.yaml", tmpdir);
    snprintf(dump_path, sizeof(dump_path), "%s/dump.yaml", tmpdir);
}

static void teardown(void) {
    unlink(cfg_path);
    unlink(dump_path);
    rmdir(tmpdir);
}

TestSuite(config, .init = setup, .fini = teardown);

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    cr_assert_eq(fputs(text, f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
}

static int load(const char *yaml, struct bd_config *cfg, struct bd_err *err) {
    write_file(cfg_path, yaml);
    memset(err, 0, sizeof(*err));
    return bd_config_load(cfg, cfg_path, err);
}

static void expect_ok(const char *yaml, struct bd_config *cfg) {
    struct bd_err err;
    int rc = load(yaml, cfg, &err);
    cr_assert_eq(rc, 0, "expected success, got %d: %s\n--- yaml:\n%s", rc, err.msg, yaml);
}

/*
 * The load must fail with -EINVAL and a message that starts "FILE:POS: KEY: " (pos is
 * "LINE:COL", or NULL to skip the position) and contains needle.
 */
static void expect_fail(const char *yaml, const char *pos, const char *key, const char *needle) {
    struct bd_config cfg;
    struct bd_err err;
    char prefix[512];
    int rc = load(yaml, &cfg, &err);
    cr_assert_eq(rc, -EINVAL, "expected -EINVAL, got %d (%s)\n--- yaml:\n%s", rc, err.msg, yaml);
    cr_assert_eq(err.code, -EINVAL);
    if (pos != NULL) {
        snprintf(prefix, sizeof(prefix), "%s:%s: %s: ", cfg_path, pos, key);
        cr_assert_eq(strncmp(err.msg, prefix, strlen(prefix)), 0, "message \"%s\" lacks \"%s\"",
                     err.msg, prefix);
    } else {
        snprintf(prefix, sizeof(prefix), ": %s: ", key);
        cr_assert_not_null(strstr(err.msg, prefix), "message \"%s\" lacks \"%s\"", err.msg, prefix);
    }
    cr_assert_not_null(strstr(err.msg, needle), "message \"%s\" lacks \"%s\"", err.msg, needle);
}

static uint16_t port_of(const struct sockaddr_storage *ss) {
    if (ss->ss_family == AF_INET6) {
        return ntohs(((const struct sockaddr_in6 *)ss)->sin6_port);
    }
    return ntohs(((const struct sockaddr_in *)ss)->sin_port);
}

static char *read_all(const char *path) {
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    char *buf = calloc(1, 1 << 20);
    cr_assert_not_null(buf);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* The differences a reload merge reported, one "key|from|to|applied" line each. */
struct changes {
    char text[4096];
    int n;
};

static void note_change(void *arg, const struct bd_config_change *c) {
    struct changes *ch = arg;
    size_t used = strlen(ch->text);
    snprintf(ch->text + used, sizeof(ch->text) - used, "%s|%s|%s|%s\n", c->key, c->from, c->to,
             c->applied ? "applied" : "restart");
    ch->n++;
}

static int merge(const struct bd_config *cur, const struct bd_config *next, struct bd_config *out,
                 struct changes *ch, struct bd_err *err) {
    memset(ch, 0, sizeof(*ch));
    return bd_config_reload_merge(cur, next, out, note_change, ch, err);
}

static char *dump_to_string(const struct bd_config *cfg) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_not_null(f);
    cr_assert_eq(bd_config_dump(cfg, f), 0);
    cr_assert_eq(fclose(f), 0);
    return text;
}

/* ---- The shipped example --------------------------------------------------------------------- */

Test(config, shipped_file_loads) {
    struct bd_config cfg;
    struct bd_err err = {0};
    int rc = bd_config_load(&cfg, SHIPPED, &err);
    cr_assert_eq(rc, 0, "%s", err.msg);

    cr_assert_str_eq(cfg.path, SHIPPED);
    cr_assert_eq(cfg.n_listeners, 3);
    cr_assert_eq(cfg.listeners[0].proto, BD_PROTO_UDP);
    cr_assert_str_eq(cfg.listeners[0].bind, "192.168.1.10:8089");
    cr_assert_eq(cfg.listeners[0].addr.ss_family, AF_INET);
    cr_assert_eq(port_of(&cfg.listeners[0].addr), 8089);
    cr_assert_eq(cfg.listeners[0].format, BD_FORMAT_INFLUX);
    cr_assert_eq(cfg.listeners[0].rcvbuf, 8u << 20);
    cr_assert_eq(cfg.listeners[1].proto, BD_PROTO_TCP);
    cr_assert_eq(port_of(&cfg.listeners[1].addr), 8094);
    cr_assert_eq(cfg.listeners[1].format, BD_FORMAT_INFLUX);
    cr_assert_eq(cfg.listeners[2].proto, BD_PROTO_TCP);
    cr_assert_eq(port_of(&cfg.listeners[2].addr), 2003);
    cr_assert_eq(cfg.listeners[2].format, BD_FORMAT_GRAPHITE);
    /* The example binds a LAN address and limits each sender (max_connections_per_ip). */
    cr_assert_eq(cfg.listeners[1].max_connections_per_ip, 64);
    cr_assert_eq(cfg.listeners[0].allow.n, 0);

    cr_assert_eq(cfg.sink, BD_SINK_MONGODB);
    cr_assert_str_eq(cfg.mongodb.uri, "mongodb://127.0.0.1:27017/");
    cr_assert_str_eq(cfg.mongodb.database, "telemetry");
    cr_assert_str_eq(cfg.mongodb.collection, "buckets");
    cr_assert_str_eq(cfg.mongodb.write_concern, "majority");
    cr_assert_eq(cfg.buckets.span_ms, 3600000);
    cr_assert_eq(cfg.log.level, BD_LOG_INFO);
}

/* Every key the dump prints (which is every schema key) must be written in the example. */
Test(config, shipped_file_shows_every_key) {
    struct bd_config cfg;
    struct bd_err err = {0};
    cr_assert_eq(bd_config_load(&cfg, SHIPPED, &err), 0, "%s", err.msg);
    char *shipped = read_all(SHIPPED);
    char *dump = dump_to_string(&cfg);
    int keys = 0;

    for (char *line = strtok(dump, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        line += strspn(line, " -");
        char *colon = strchr(line, ':');
        cr_assert_not_null(colon, "dump line without a key: %s", line);
        colon[1] = '\0';
        cr_assert_not_null(strstr(shipped, line), "config/bucketd.yaml does not show %s", line);
        keys++;
    }
    cr_assert_geq(keys, 30);
    free(dump);
    free(shipped);
}

Test(config, dump_reads_back_to_the_same_config) {
    struct bd_config a, b;
    struct bd_err err = {0};
    cr_assert_eq(bd_config_load(&a, SHIPPED, &err), 0, "%s", err.msg);
    char *first = dump_to_string(&a);
    write_file(dump_path, first);
    cr_assert_eq(bd_config_load(&b, dump_path, &err), 0, "%s\n--- dump:\n%s", err.msg, first);
    char *second = dump_to_string(&b);
    cr_assert_str_eq(first, second);
    cr_assert_eq(memcmp(&a.listeners, &b.listeners, sizeof(a.listeners)), 0);
    struct bd_config merged;
    struct changes ch;
    cr_assert_eq(merge(&a, &b, &merged, &ch, &err), 0, "%s", err.msg);
    cr_assert_eq(ch.n, 0, "a reload of the dump would change:\n%s", ch.text);
    free(first);
    free(second);
}

/* writer_id has no default: the dump shows it when the file sets it, and only then. */
Test(config, dump_shows_writer_id_only_when_set) {
    struct bd_config a, b;
    struct bd_err err = {0};
    expect_ok(LISTENER, &a);
    cr_assert_str_eq(a.writer_id, "");
    char *dump = dump_to_string(&a);
    cr_assert_null(strstr(dump, "writer_id"), "%s", dump);
    write_file(dump_path, dump);
    cr_assert_eq(bd_config_load(&b, dump_path, &err), 0, "%s", err.msg);
    cr_assert_str_eq(b.writer_id, "");
    struct bd_config merged;
    struct changes ch;
    cr_assert_eq(merge(&a, &b, &merged, &ch, &err), 0, "%s", err.msg);
    cr_assert_eq(ch.n, 0, "%s", ch.text);
    free(dump);

    expect_ok("writer_id: gw-7\n" LISTENER, &a);
    dump = dump_to_string(&a);
    cr_assert_not_null(strstr(dump, "writer_id: \"gw-7\"\n"), "%s", dump);
    write_file(dump_path, dump);
    cr_assert_eq(bd_config_load(&b, dump_path, &err), 0, "%s", err.msg);
    cr_assert_str_eq(b.writer_id, "gw-7");
    free(dump);
}

/* ---- Defaults -------------------------------------------------------------------------------- */

Test(config, defaults) {
    struct bd_config cfg;
    bd_config_defaults(&cfg);

    /* Not set: the daemon uses the id kept in spool.dir (generated on its first start). */
    cr_assert_str_eq(cfg.writer_id, "");

    cr_assert_eq(cfg.n_listeners, 0);
    cr_assert_eq(cfg.sink, BD_SINK_MONGODB);
    cr_assert_str_eq(cfg.mongodb.uri, "mongodb://127.0.0.1:27017/");
    cr_assert_str_eq(cfg.mongodb.database, "telemetry");
    cr_assert_str_eq(cfg.mongodb.collection, "buckets");
    cr_assert_str_eq(cfg.mongodb.write_concern, "majority");
    cr_assert_eq(cfg.buckets.span_ms, 3600000);
    cr_assert_eq(cfg.buckets.max_readings, 1000);
    cr_assert_eq(cfg.buckets.max_bytes, 128 * 1024);
    cr_assert_eq(cfg.flush.max_delay_ms, 30000);
    cr_assert_eq(cfg.buckets.max_late_ms, 24 * 3600000);
    cr_assert_eq(cfg.buckets.max_future_ms, 600000);
    cr_assert_eq(cfg.flush.interval_ms, 1000);
    cr_assert_eq(cfg.flush.max_updates, 1000);
    cr_assert_eq(cfg.flush.stop_timeout_ms, 30000);
    cr_assert_eq(cfg.flush.retry_initial_ms, 100);
    cr_assert_eq(cfg.flush.retry_max_ms, 10000);
    cr_assert_str_eq(cfg.spool.dir, "/var/lib/bucketd/spool");
    cr_assert_eq(cfg.spool.max_bytes, UINT64_C(1) << 30);
    cr_assert_str_eq(cfg.metrics.bind, "127.0.0.1:9273");
    cr_assert_eq(cfg.metrics.unhealthy_after_ms, 60000);
    cr_assert_eq(cfg.metrics.spool_high_water, 80);
    cr_assert_eq(cfg.metrics.silent_after_ms, 15 * 60000);
    cr_assert_eq(cfg.time.wait_for_sync_ms, 600000);
    cr_assert_eq(cfg.log.level, BD_LOG_INFO);
    cr_assert_eq(cfg.limits.max_sensors, 100000);
    cr_assert_eq(cfg.limits.ring_size, 256);
    cr_assert_eq(cfg.limits.max_fields, 32);
    cr_assert_eq(cfg.limits.max_line, 65536);
}

Test(config, listener_defaults) {
    struct bd_config cfg;
    expect_ok("listeners:\n  - proto: udp\n    bind: \"127.0.0.1:8089\"\n"
              "  - proto: tcp\n    bind: \"127.0.0.1:8094\"\n",
              &cfg);
    cr_assert_eq(cfg.n_listeners, 2);
    cr_assert_eq(cfg.listeners[0].format, BD_FORMAT_INFLUX);
    cr_assert_eq(cfg.listeners[0].precision, BD_PREC_NS);
    cr_assert_eq(cfg.listeners[0].rcvbuf, 8u << 20);
    cr_assert_eq(cfg.listeners[1].max_connections, 1024);
    cr_assert_eq(cfg.listeners[1].idle_timeout_ms, 300000);
    /* A file that sets one key leaves the others at their defaults. */
    cr_assert_eq(cfg.flush.interval_ms, 1000);
    cr_assert_str_eq(cfg.mongodb.database, "telemetry");
}

Test(config, enum_names) {
    enum bd_format f = BD_FORMAT_INFLUX;
    enum bd_precision p = BD_PREC_NS;

    cr_assert_str_eq(bd_proto_name(BD_PROTO_UDP), "udp");
    cr_assert_str_eq(bd_proto_name(BD_PROTO_TCP), "tcp");
    cr_assert_str_eq(bd_format_name(BD_FORMAT_GRAPHITE), "graphite");
    cr_assert_str_eq(bd_precision_name(BD_PREC_US), "us");
    cr_assert_eq(bd_format_parse("graphite", &f), 0);
    cr_assert_eq(f, BD_FORMAT_GRAPHITE);
    cr_assert_eq(bd_format_parse("Influx", &f), -EINVAL);
    cr_assert_eq(f, BD_FORMAT_GRAPHITE);
    cr_assert_eq(bd_precision_parse("ms", &p), 0);
    cr_assert_eq(p, BD_PREC_MS);
    cr_assert_eq(bd_precision_parse("", &p), -EINVAL);
    cr_assert_eq(bd_precision_parse(NULL, &p), -EINVAL);
    for (int i = BD_PREC_NS; i <= BD_PREC_S; i++) {
        cr_assert_eq(bd_precision_parse(bd_precision_name((enum bd_precision)i), &p), 0);
        cr_assert_eq((int)p, i);
    }
}

/* ---- Loader errors --------------------------------------------------------------------------- */

Test(config, unknown_key_lists_valid_keys) {
    expect_fail(LISTENER "bogus: 1\n", "4:1", "bogus",
                "unknown key; valid keys here: writer_id, listeners, sink, mongodb, buckets, "
                "flush, summaries, spool, metrics, time, log, ingest, limits");
}

Test(config, ingest_loops_auto_by_cores_or_a_number) {
    struct bd_config cfg;
    uint32_t n = 0;
    expect_ok(LISTENER, &cfg);
    cr_assert_str_eq(cfg.ingest.loops, "auto");
    cr_assert_eq(bd_config_ingest_loops("auto", 1, &n), 0);
    cr_assert_eq(n, 1);
    cr_assert_eq(bd_config_ingest_loops("auto", 3, &n), 0);
    cr_assert_eq(n, 1, "fewer than 4 cores: one loop");
    cr_assert_eq(bd_config_ingest_loops("auto", 4, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_eq(bd_config_ingest_loops("auto", 64, &n), 0);
    cr_assert_eq(n, 2);
    cr_assert_eq(bd_config_ingest_loops("16", 2, &n), 0);
    cr_assert_eq(n, 16, "a number is taken as written, whatever the cores");
    expect_ok(LISTENER "ingest:\n  loops: 3\n", &cfg);
    cr_assert_str_eq(cfg.ingest.loops, "3");
    const char *bad[] = {"0", "17", "-1", "2x", "", "100", "Auto"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(bd_config_ingest_loops(bad[i], 8, &n), -EINVAL, "%s", bad[i]);
    }
    expect_fail(LISTENER "ingest:\n  loops: 0\n", "5:10", "ingest.loops",
                "must be auto or a number from 1 to 16");
}

Test(config, summary_collection_defaults_to_the_collection_name_with_a_suffix) {
    struct bd_config cfg;
    char into[BD_SUMMARY_COLLECTION_MAX];
    expect_ok(LISTENER "mongodb:\n  collection: pages\n", &cfg);
    cr_assert_eq(cfg.summaries.interval_ms, 60000);
    bd_config_summary_collection(&cfg, into, sizeof(into));
    cr_assert_str_eq(into, "pages_summary");
    expect_ok(LISTENER "summaries:\n  collection: hourly\n  interval: 0s\n", &cfg);
    bd_config_summary_collection(&cfg, into, sizeof(into));
    cr_assert_str_eq(into, "hourly");
    cr_assert_eq(cfg.summaries.interval_ms, 0);
}

Test(config, summary_collection_must_differ_from_the_page_collection) {
    expect_fail(LISTENER "summaries:\n  collection: buckets\n", "5:15", "summaries.collection",
                "must differ from mongodb.collection");
    expect_fail(LISTENER "mongodb:\n  collection: a_summary\nsummaries:\n  collection: a_summary\n",
                "7:15", "summaries.collection", "must differ");
    expect_fail(LISTENER "summaries:\n  collection: \"system.x\"\n", "5:15", "summaries.collection",
                "reserved");
    expect_fail(LISTENER "summaries:\n  interval: 2h\n", "5:13", "summaries.interval", "1h");
}

Test(config, typo_in_nested_key) {
    expect_fail(LISTENER "flush:\n  interval: 2s\n  intervall: 2s\n", "6:3", "flush.intervall",
                "did you mean \"interval\"? valid keys here: interval, max_updates, "
                "stop_timeout, max_delay, retry_initial, retry_max");
    expect_fail("listeners:\n  - proto: udp\n    bnd: \"127.0.0.1:1\"\n", "3:5", "listeners[0].bnd",
                "did you mean \"bind\"");
    expect_fail(LISTENER "mongo:\n  uri: x\n", "4:1", "mongo", "did you mean \"mongodb\"");
}

Test(config, dotted_key_is_not_a_shortcut) {
    expect_fail(LISTENER "flush.interval: 2s\n", "4:1", "flush.interval", "unknown key");
    expect_fail(LISTENER "listeners[].bind: x\n", "4:1", "listeners[].bind", "unknown key");
}

Test(config, section_must_be_a_mapping) {
    expect_fail(LISTENER "flush: 1s\n", "4:8", "flush", "expected a mapping with keys: interval");
    expect_fail("- a\n- b\n", "1:1", "config", "expected a mapping with keys: writer_id");
    expect_fail("listeners: udp\n", "1:12", "listeners", "expected a list of listeners");
    expect_fail("listeners:\n  - udp\n", "2:5", "listeners[0]", "expected a mapping");
    expect_fail(LISTENER "sink:\n  kind: mongodb\n", "5:3", "sink", "expected a single value");
}

Test(config, bad_enum) {
    expect_fail(LISTENER "sink: mysql\n", "4:7", "sink",
                "\"mysql\" is not one of: mongodb, blackhole");
    expect_fail(LISTENER "log:\n  level: loud\n", "5:10", "log.level",
                "is not one of: error, warn, info, debug");
    expect_fail("listeners:\n  - proto: sctp\n    bind: \"127.0.0.1:1\"\n", "2:12",
                "listeners[0].proto", "\"sctp\" is not one of: udp, tcp");
    expect_fail(LISTENER "    precision: sec\n", "4:16", "listeners[0].precision",
                "is not one of: ns, us, ms, s");
}

Test(config, out_of_bounds) {
    static const struct {
        const char *yaml, *key, *needle;
    } cases[] = {
        {"flush:\n  interval: 5ms\n", "flush.interval", "out of range (10ms to 1h)"},
        {"flush:\n  interval: 2h\n", "flush.interval", "out of range"},
        {"flush:\n  interval: 0\n", "flush.interval", "out of range"},
        {"flush:\n  interval: 99999999999999999999ms\n", "flush.interval", "too large"},
        {"flush:\n  interval: -1s\n", "flush.interval", "is not a duration"},
        {"flush:\n  interval: \"\"\n", "flush.interval", "is not a duration"},
        {"flush:\n  interval: 1\n", "flush.interval", "is not a duration"},
        {"flush:\n  max_updates: 0\n", "flush.max_updates", "out of range (1 to 100000)"},
        {"flush:\n  max_updates: 100001\n", "flush.max_updates", "out of range"},
        {"flush:\n  max_updates: 1k\n", "flush.max_updates", "not a whole number"},
        {"flush:\n  retry_initial: 20s\n  retry_max: 10s\n", "flush.retry_initial",
         "must not exceed flush.retry_max"},
        {"buckets:\n  max_readings: 0\n", "buckets.max_readings", "out of range"},
        {"buckets:\n  max_readings: 100001\n", "buckets.max_readings", "out of range"},
        {"buckets:\n  span: 30s\n", "buckets.span", "out of range (1m to 24h)"},
        {"buckets:\n  span: 25h\n", "buckets.span", "out of range"},
        {"limits:\n  ring_size: 100\n", "limits.ring_size", "power of two"},
        {"limits:\n  ring_size: 8\n", "limits.ring_size", "out of range (16 to 1048576)"},
        {"limits:\n  ring_size: 2097152\n", "limits.ring_size", "out of range"},
        {"limits:\n  max_fields: 0\n", "limits.max_fields", "out of range (1 to 256)"},
        {"limits:\n  max_fields: 257\n", "limits.max_fields", "out of range"},
        {"limits:\n  max_line: 255\n", "limits.max_line", "out of range (256 to 16MiB)"},
        {"limits:\n  max_line: 17MiB\n", "limits.max_line", "out of range"},
        {"limits:\n  max_line: 1kb\n", "limits.max_line", "is not a size"},
        {"limits:\n  max_sensors: 0\n", "limits.max_sensors", "out of range"},
        {"spool:\n  max_bytes: 1KiB\n", "spool.max_bytes", "out of range (1MiB to 1024GiB)"},
        {"spool:\n  dir: \"\"\n", "spool.dir", "must not be empty"},
        {"mongodb:\n  uri: \"http://x/\"\n", "mongodb.uri", "mongodb://"},
        {"mongodb:\n  database: \"a.b\"\n", "mongodb.database", "must not contain"},
        {"mongodb:\n  collection: \"a$b\"\n", "mongodb.collection", "must not contain $"},
        {"metrics:\n  bind: \"localhost:9273\"\n", "metrics.bind", "numeric"},
        {"metrics:\n  unhealthy_after: 500ms\n", "metrics.unhealthy_after", "out of range"},
        {"metrics:\n  spool_high_water: 0\n", "metrics.spool_high_water",
         "out of range (1 to 100)"},
        {"metrics:\n  spool_high_water: 101\n", "metrics.spool_high_water", "out of range"},
        {"metrics:\n  silent_after: 721h\n", "metrics.silent_after", "out of range"},
        {"metrics:\n  silent_after: 15\n", "metrics.silent_after", "is not a duration"},
        {"time:\n  wait_for_sync: 169h\n", "time.wait_for_sync", "out of range (0 to 168h)"},
        {"time:\n  wait_for_sync: 10\n", "time.wait_for_sync", "is not a duration"},
        {"time:\n  wait_for_sync: -1s\n", "time.wait_for_sync", ""},
        {"writer_id: gw.example.com\n", "writer_id", "letters, digits"},
        {"writer_id: \"\"\n", "writer_id", "must not be empty"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char yaml[512];
        snprintf(yaml, sizeof(yaml), "%s%s", LISTENER, cases[i].yaml);
        expect_fail(yaml, NULL, cases[i].key, cases[i].needle);
    }
    static const struct {
        const char *listener, *key, *needle;
    } lcases[] = {
        {"proto: udp\n    rcvbuf: 1KiB\n", "listeners[0].rcvbuf", "out of range (4KiB to 1GiB)"},
        {"proto: udp\n    rcvbuf: 2GiB\n", "listeners[0].rcvbuf", "out of range"},
        {"proto: tcp\n    max_connections: 65536\n", "listeners[0].max_connections",
         "out of range (1 to 65535)"},
        {"proto: tcp\n    max_connections: 0\n", "listeners[0].max_connections", "out of range"},
        {"proto: tcp\n    idle_timeout: 25h\n", "listeners[0].idle_timeout", "out of range"},
    };
    for (size_t i = 0; i < sizeof(lcases) / sizeof(lcases[0]); i++) {
        char yaml[512];
        snprintf(yaml, sizeof(yaml), "listeners:\n  - bind: \"127.0.0.1:1\"\n    %s",
                 lcases[i].listener);
        expect_fail(yaml, NULL, lcases[i].key, lcases[i].needle);
    }
}

Test(config, values_at_the_bounds_load) {
    struct bd_config cfg;
    expect_ok(LISTENER "flush:\n  interval: 10ms\n  max_updates: 100000\n"
                       "  retry_initial: 10s\n  retry_max: 10s\n"
                       "limits:\n  ring_size: 1048576\n  max_fields: 256\n  max_line: 16MiB\n"
                       "  max_sensors: 1\n"
                       "buckets:\n  max_readings: 1\n",
              &cfg);
    cr_assert_eq(cfg.flush.interval_ms, 10);
    cr_assert_eq(cfg.flush.max_updates, 100000);
    cr_assert_eq(cfg.limits.ring_size, 1048576);
    cr_assert_eq(cfg.limits.max_line, 16u << 20);
    cr_assert_eq(cfg.buckets.max_readings, 1);
    expect_ok(LISTENER "flush:\n  interval: 1h\nmetrics:\n  bind: \"\"\n", &cfg);
    cr_assert_eq(cfg.flush.interval_ms, 3600000);
    cr_assert_str_eq(cfg.metrics.bind, "");
}

Test(config, write_concern) {
    struct bd_config cfg;
    expect_fail(LISTENER "mongodb:\n  write_concern: 0\n", "5:18", "mongodb.write_concern",
                "0 is refused: unacknowledged writes would lose data silently");
    expect_fail(LISTENER "mongodb:\n  write_concern: \"0\"\n", "5:18", "mongodb.write_concern",
                "unacknowledged writes would lose data silently");
    expect_fail(LISTENER "mongodb:\n  write_concern: -1\n", NULL, "mongodb.write_concern",
                "must be 1, majority or a number of nodes");
    expect_fail(LISTENER "mongodb:\n  write_concern: 01\n", NULL, "mongodb.write_concern",
                "must be 1, majority or a number of nodes");
    expect_fail(LISTENER "mongodb:\n  write_concern: most\n", NULL, "mongodb.write_concern",
                "must be 1, majority or a number of nodes");
    expect_fail(LISTENER "mongodb:\n  write_concern: 51\n", NULL, "mongodb.write_concern",
                "at most 50");
    expect_ok(LISTENER "mongodb:\n  write_concern: majority\n", &cfg);
    cr_assert_str_eq(cfg.mongodb.write_concern, "majority");
    expect_ok(LISTENER "mongodb:\n  write_concern: 3\n", &cfg);
    cr_assert_str_eq(cfg.mongodb.write_concern, "3");
    expect_ok(LISTENER "mongodb:\n  write_concern: 1\n", &cfg);
    cr_assert_str_eq(cfg.mongodb.write_concern, "1");
    /* Left out: majority (an acknowledged w:1 write can be rolled back by a failover). */
    expect_ok(LISTENER, &cfg);
    cr_assert_str_eq(cfg.mongodb.write_concern, "majority");
}

Test(config, write_concern_timeout) {
    struct bd_config cfg;
    expect_ok(LISTENER "mongodb:\n  wtimeout: 2500ms\n", &cfg);
    cr_assert_eq(cfg.mongodb.wtimeout_ms, 2500);
    expect_ok(LISTENER "mongodb:\n  wtimeout: 0\n", &cfg);
    cr_assert_eq(cfg.mongodb.wtimeout_ms, 0, "0 = no limit");
    expect_fail(LISTENER "mongodb:\n  wtimeout: 11m\n", "5:13", "mongodb.wtimeout",
                "out of range (0 to 10m)");
    /* The write concern built from it carries the timeout. */
    mongoc_write_concern_t *wc = NULL;
    cr_assert_eq(bd_mongo_write_concern_new("majority", 2500, &wc, NULL), 0);
    cr_assert(mongoc_write_concern_get_wmajority(wc));
    cr_assert_eq(mongoc_write_concern_get_wtimeout_int64(wc), 2500);
    mongoc_write_concern_destroy(wc);
    cr_assert_eq(bd_mongo_write_concern_new("2", 0, &wc, NULL), 0);
    cr_assert_eq(mongoc_write_concern_get_w(wc), 2);
    cr_assert_eq(mongoc_write_concern_get_wtimeout_int64(wc), 0);
    mongoc_write_concern_destroy(wc);
}

/* TLS and authentication go through the URI; files it names are checked at load time. */
Test(config, uri_tls_and_auth) {
    struct bd_config cfg;
    char yaml[1024], ca[400];
    snprintf(ca, sizeof(ca), "%s/ca.pem", tmpdir);
    write_file(ca, "not really a certificate, but readable\n");
    snprintf(yaml, sizeof(yaml),
             LISTENER "mongodb:\n  uri: \"mongodb://bucketd:s%%40cret@db1:27017,db2:27017/"
                      "?replicaSet=rs0&authSource=admin&tls=true&tlsCAFile=%s\"\n",
             ca);
    expect_ok(yaml, &cfg);
    struct bd_err err = {0};
    mongoc_uri_t *uri = bd_mongo_uri_new(cfg.mongodb.uri, &err);
    cr_assert_not_null(uri, "%s", err.msg);
    cr_assert_str_eq(mongoc_uri_get_username(uri), "bucketd");
    cr_assert_str_eq(mongoc_uri_get_password(uri), "s@cret");
    cr_assert_str_eq(mongoc_uri_get_auth_source(uri), "admin");
    cr_assert(mongoc_uri_get_tls(uri));
    cr_assert_str_eq(mongoc_uri_get_option_as_utf8(uri, MONGOC_URI_TLSCAFILE, NULL), ca);
    /* bucketd's timeouts apply where the URI sets none, and the URI wins where it does. */
    cr_assert_eq(mongoc_uri_get_option_as_int32(uri, MONGOC_URI_SOCKETTIMEOUTMS, 0), 10000);
    mongoc_uri_destroy(uri);
    uri = bd_mongo_uri_new("mongodb://h/?socketTimeoutMS=1234", &err);
    cr_assert_eq(mongoc_uri_get_option_as_int32(uri, MONGOC_URI_SOCKETTIMEOUTMS, 0), 1234);
    mongoc_uri_destroy(uri);

    expect_fail(LISTENER
                "mongodb:\n  uri: \"mongodb://db1/?tls=true&tlsCAFile=/nonexistent/ca.pem\"\n",
                "5:8", "mongodb.uri", "tlsCAFile '/nonexistent/ca.pem': No such file or directory");
    expect_fail(LISTENER
                "mongodb:\n  uri: \"mongodb://db1/?tlsCertificateKeyFile=/nonexistent/k.pem\"\n",
                "5:8", "mongodb.uri", "tlsCertificateKeyFile '/nonexistent/k.pem'");
    expect_fail(LISTENER "mongodb:\n  uri: \"mongodb://db1:99999/\"\n", "5:8", "mongodb.uri", "");
    expect_fail(LISTENER "mongodb:\n  uri: \"mongodb://u:p@@db1/\"\n", "5:8", "mongodb.uri", "");
}

Test(config, span_must_divide_a_day) {
    struct bd_config cfg;
    expect_fail(LISTENER "buckets:\n  span: 7m\n", "5:9", "buckets.span", "divide 24h evenly");
    expect_fail(LISTENER "buckets:\n  span: 5h\n", "5:9", "buckets.span", "divide 24h evenly");
    static const struct {
        const char *span;
        uint64_t ms;
    } ok[] = {{"1m", 60000},    {"90s", 90000},    {"15m", 900000},
              {"6h", 21600000}, {"24h", 86400000}, {"1440m", 86400000}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        char yaml[256];
        snprintf(yaml, sizeof(yaml), LISTENER "buckets:\n  span: %s\n", ok[i].span);
        expect_ok(yaml, &cfg);
        cr_assert_eq(cfg.buckets.span_ms, ok[i].ms);
    }
}

Test(config, yaml_syntax_error) {
    expect_fail(LISTENER "flush:\n\tinterval: 1s\n", "5:1", "syntax error",
                "found character that cannot start any token");
    expect_fail(LISTENER "flush:\n  interval: [1s\n", NULL, "syntax error",
                "did not find expected");
    expect_fail(LISTENER "sink: \"mongodb\n", NULL, "syntax error", "found unexpected end");
    /* Reader errors carry an offset, not a mark: the position is worked out from it. */
    expect_fail(LISTENER "sink: mon\x01godb\n", "4:10", "syntax error", "control characters");
}

Test(config, missing_file) {
    struct bd_config cfg;
    struct bd_err err = {0};
    char path[400];
    snprintf(path, sizeof(path), "%s/does-not-exist.yaml", tmpdir);
    cr_assert_eq(bd_config_load(&cfg, path, &err), -ENOENT);
    cr_assert_eq(err.code, -ENOENT);
    cr_assert_not_null(strstr(err.msg, path), "%s", err.msg);
    cr_assert_not_null(strstr(err.msg, strerror(ENOENT)), "%s", err.msg);

    cr_assert_eq(bd_config_load(&cfg, tmpdir, &err), -EISDIR, "%s", err.msg);
    cr_assert_not_null(strstr(err.msg, strerror(EISDIR)), "%s", err.msg);
}

Test(config, listener_missing_bind) {
    expect_fail("listeners:\n  - proto: tcp\n    format: influx\n", "2:5", "listeners[0]",
                "missing required key \"bind\"");
    expect_fail(LISTENER "  - bind: \"127.0.0.1:2\"\n", "4:5", "listeners[1]",
                "missing required key \"proto\"");
}

Test(config, key_not_valid_for_proto) {
    expect_fail("listeners:\n  - proto: tcp\n    bind: \"0.0.0.0:8094\"\n    rcvbuf: 1MiB\n",
                "4:13", "listeners[0].rcvbuf", "only valid on udp listeners (this one is tcp)");
    /* proto may come after the key it makes invalid. */
    expect_fail("listeners:\n  - idle_timeout: 1m\n    proto: udp\n    bind: \"0.0.0.0:1\"\n",
                "2:19", "listeners[0].idle_timeout", "only valid on tcp listeners");
    expect_fail(LISTENER "    max_connections: 5\n", "4:22", "listeners[0].max_connections",
                "only valid on tcp listeners (this one is udp)");
}

Test(config, ipv6_bind) {
    struct bd_config cfg;
    char text[INET6_ADDRSTRLEN];
    expect_ok("listeners:\n  - proto: udp\n    bind: \"[::1]:8089\"\n"
              "  - proto: tcp\n    bind: \"[::]:8094\"\n",
              &cfg);
    cr_assert_str_eq(cfg.listeners[0].bind, "[::1]:8089");
    cr_assert_eq(cfg.listeners[0].addr.ss_family, AF_INET6);
    cr_assert_eq(port_of(&cfg.listeners[0].addr), 8089);
    inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&cfg.listeners[0].addr)->sin6_addr, text,
              sizeof(text));
    cr_assert_str_eq(text, "::1");
    cr_assert_eq(cfg.listeners[1].addr.ss_family, AF_INET6);
    cr_assert_eq(port_of(&cfg.listeners[1].addr), 8094);

    /* Unquoted, [::]:8089 starts a YAML list and fails to parse; the message says to quote. */
    expect_fail("listeners:\n  - proto: udp\n    bind: [::]:8089\n", "3:12", "syntax error",
                "must be quoted, as in bind: \"[::]:8089\"");
    expect_fail("listeners:\n  - proto: udp\n    bind: [1, 2]\n", "3:11", "listeners[0].bind",
                "not a list (quote IPv6 addresses");
    expect_fail("listeners:\n  - proto: udp\n    bind: \"::1:8089\"\n", "3:11", "listeners[0].bind",
                "needs brackets");
}

Test(config, duplicate_keys) {
    expect_fail(LISTENER "flush:\n  interval: 1s\n  interval: 2s\n", "6:3", "flush.interval",
                "duplicate key (first given at line 5, column 3)");
    expect_fail(LISTENER "sink: mongodb\nsink: blackhole\n", "5:1", "sink", "duplicate key");
    expect_fail(LISTENER "    bind: \"127.0.0.1:2\"\n", "4:5", "listeners[0].bind",
                "duplicate key");
    expect_fail(LISTENER "listeners: []\n", "4:1", "listeners", "duplicate key");
}

Test(config, duplicate_listener_address) {
    struct bd_config cfg;
    expect_fail(LISTENER "  - proto: udp\n    bind: \"127.0.0.1:8089\"\n", "5:11",
                "listeners[1].bind", "listeners[0] already binds udp 127.0.0.1:8089");
    /* The same port on udp and tcp is two different sockets. */
    expect_ok(LISTENER "  - proto: tcp\n    bind: \"127.0.0.1:8089\"\n", &cfg);
    cr_assert_eq(cfg.n_listeners, 2);
}

Test(config, at_least_one_listener) {
    expect_fail("sink: blackhole\n", "1:1", "listeners", "at least one listener is required");
    expect_fail("sink: blackhole\nlisteners: []\n", "2:1", "listeners",
                "at least one listener is required");
    expect_fail("", "1:1", "listeners", "at least one listener is required");
    expect_fail("# only a comment\n", "1:1", "listeners", "at least one listener is required");
}

Test(config, too_many_listeners) {
    char yaml[4096] = "listeners:\n";
    for (int i = 0; i <= BD_MAX_LISTENERS; i++) {
        char one[64];
        snprintf(one, sizeof(one), "  - proto: udp\n    bind: \"127.0.0.1:%d\"\n", 1000 + i);
        strcat(yaml, one);
    }
    expect_fail(yaml, "34:5", "listeners", "at most 16 listeners");
}

Test(config, one_document_only) {
    expect_fail(LISTENER "---\nsink: blackhole\n", "5:1", "config",
                "only one YAML document is allowed");
}

Test(config, empty_section_keeps_defaults) {
    struct bd_config cfg;
    expect_ok(LISTENER "flush:\nlimits:\n  # max_line: 1MiB\n", &cfg);
    cr_assert_eq(cfg.flush.interval_ms, 1000);
    cr_assert_eq(cfg.limits.max_line, 65536);
}

Test(config, failed_load_leaves_config_alone) {
    struct bd_config cfg, before;
    struct bd_err err;
    expect_ok(LISTENER "flush:\n  interval: 250ms\n", &cfg);
    memcpy(&before, &cfg, sizeof(cfg));
    cr_assert_eq(load(LISTENER "flush:\n  interval: 2s\nsink: nowhere\n", &cfg, &err), -EINVAL);
    cr_assert_eq(memcmp(&before, &cfg, sizeof(cfg)), 0);
    cr_assert_eq(cfg.flush.interval_ms, 250);
}

Test(config, no_err_is_fine) {
    struct bd_config cfg;
    write_file(cfg_path, LISTENER "sink: nowhere\n");
    cr_assert_eq(bd_config_load(&cfg, cfg_path, NULL), -EINVAL);
}

/* The keys the schema marks reloadable take the file's values; the others are reported and keep
 * the running ones. */
Test(config, reload_merge_applies_reloadable_keys_and_names_the_others) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch;
    expect_ok(LISTENER "flush:\n  interval: 1s\n", &cur);
    expect_ok(LISTENER "flush:\n  interval: 2s\n  max_updates: 50\nlog:\n  level: debug\n"
                       "buckets:\n  max_late: 2h\n  retention: 720h\n  span: 15m\n"
                       "mongodb:\n  database: other\n  write_concern: \"1\"\n"
                       "  uri: \"mongodb://user:secret@db:27017/\"\n"
                       "limits:\n  max_sensors: 10\n  memory: 1MiB\n"
                       "time:\n  wait_for_sync: 0\n",
              &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    /* A URI may hold a password: its change is named, its value never shown. */
    cr_assert_str_eq(ch.text, "mongodb.uri|(not shown)|(changed)|restart\n"
                              "mongodb.database|telemetry|other|restart\n"
                              "mongodb.write_concern|majority|1|applied\n"
                              "buckets.span|1h|15m|restart\n"
                              "buckets.max_late|24h|2h|applied\n"
                              "buckets.retention|0|720h|applied\n"
                              "flush.interval|1s|2s|applied\n"
                              "flush.max_updates|1000|50|applied\n"
                              "time.wait_for_sync|10m|0|applied\n"
                              "log.level|info|debug|applied\n"
                              "limits.max_sensors|100000|10|applied\n"
                              "limits.memory|64MiB|1MiB|restart\n");
    cr_assert_eq(out.flush.interval_ms, 2000);
    cr_assert_eq(out.flush.max_updates, 50);
    cr_assert_eq(out.log.level, BD_LOG_DEBUG);
    cr_assert_eq(out.buckets.max_late_ms, 2 * 3600000);
    cr_assert_eq(out.buckets.retention_ms, UINT64_C(720) * 3600000);
    cr_assert_str_eq(out.mongodb.write_concern, "1");
    cr_assert_eq(out.limits.max_sensors, 10);
    cr_assert_eq(out.time.wait_for_sync_ms, 0);
    /* Kept until a restart. */
    cr_assert_str_eq(out.mongodb.database, "telemetry");
    cr_assert_eq(out.buckets.span_ms, 3600000);
    cr_assert_eq(out.limits.memory, UINT64_C(64) << 20);
}

/* Listeners are matched by proto and address: new ones are added, missing ones removed, and a
 * kept one keeps its running values (its other keys need a restart). */
Test(config, reload_merge_adds_and_removes_listeners) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch;
    expect_ok("listeners:\n"
              "  - {proto: udp, bind: \"127.0.0.1:8089\"}\n"
              "  - {proto: tcp, bind: \"127.0.0.1:8094\", format: influx}\n"
              "  - {proto: tcp, bind: \"127.0.0.1:2003\", format: graphite}\n",
              &cur);
    expect_ok("listeners:\n"
              "  - {proto: tcp, bind: \"127.0.0.1:08094\", format: graphite}\n"
              "  - {proto: udp, bind: \"127.0.0.1:9000\"}\n"
              "  - {proto: tcp, bind: \"127.0.0.1:2003\", format: graphite}\n"
              "  - {proto: tcp, bind: \"127.0.0.1:8089\"}\n",
              &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ch.text, "listeners[0].format|influx|graphite|restart\n"
                              "listeners||udp 127.0.0.1:9000|applied\n"
                              "listeners||tcp 127.0.0.1:8089|applied\n"
                              "listeners|udp 127.0.0.1:8089||applied\n");
    cr_assert_eq(out.n_listeners, 4);
    /* The file's order; the kept tcp listener as it runs (influx, its bind as first written). */
    cr_assert_eq(out.listeners[0].proto, BD_PROTO_TCP);
    cr_assert_eq(out.listeners[0].format, BD_FORMAT_INFLUX);
    cr_assert_str_eq(out.listeners[0].bind, "127.0.0.1:8094");
    cr_assert_eq(out.listeners[1].proto, BD_PROTO_UDP);
    cr_assert_eq(port_of(&out.listeners[1].addr), 9000);
    cr_assert_eq(port_of(&out.listeners[2].addr), 2003);
    cr_assert_eq(out.listeners[3].proto, BD_PROTO_TCP);
    cr_assert_eq(port_of(&out.listeners[3].addr), 8089);
}

/* A writer_id the file does not set keeps the id the daemon runs with (from spool.dir). */
Test(config, reload_merge_keeps_the_running_writer_id) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch;
    expect_ok(LISTENER, &cur);
    snprintf(cur.writer_id, sizeof(cur.writer_id), "w-0123456789abcdef");
    expect_ok(LISTENER, &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    cr_assert_eq(ch.n, 0, "%s", ch.text);
    cr_assert_str_eq(out.writer_id, "w-0123456789abcdef");
    expect_ok("writer_id: gw-2\n" LISTENER, &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ch.text, "writer_id|w-0123456789abcdef|gw-2|restart\n");
    cr_assert_str_eq(out.writer_id, "w-0123456789abcdef");
}

/* The rules between keys hold for what would run: here the running span (a restart key) makes
 * the file's retention too short. Nothing is merged then. */
Test(config, reload_merge_checks_the_rules_on_what_would_run) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch;
    expect_ok(LISTENER, &cur);
    expect_ok(LISTENER "buckets:\n  span: 1m\n  max_late: 1h\n  retention: 61m\n", &next);
    memset(&out, 0xa5, sizeof(out));
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), -EINVAL);
    cr_assert_not_null(strstr(err.msg, "buckets.retention: must be 0 (off) or at least "
                                       "buckets.max_late + buckets.span (2h)"),
                       "%s", err.msg);
    cr_assert_eq(out.flush.interval_ms, UINT64_C(0xa5a5a5a5a5a5a5a5));
}

/* ---- Retention ------------------------------------------------------------------------------- */

Test(config, retention_is_off_by_default_and_takes_whole_seconds) {
    struct bd_config cfg;
    expect_ok(LISTENER, &cfg);
    cr_assert_eq(cfg.buckets.retention_ms, 0);
    cr_assert_eq(cfg.summaries.retention_ms, 0);
    expect_ok(LISTENER "buckets:\n  retention: 720h\nsummaries:\n  retention: 8760h\n", &cfg);
    cr_assert_eq(cfg.buckets.retention_ms, UINT64_C(720) * 3600000);
    cr_assert_eq(cfg.summaries.retention_ms, UINT64_C(8760) * 3600000);
    expect_fail(LISTENER "buckets:\n  retention: 90001500ms\n", "5:14", "buckets.retention",
                "must be whole seconds");
    expect_fail(LISTENER "buckets:\n  retention: 438001h\n", "5:14", "buckets.retention",
                "out of range (0 to 438000h)");
}

Test(config, retention_must_outlast_the_window_a_bucket_takes_readings_in) {
    struct bd_config cfg;
    expect_fail(LISTENER "buckets:\n  retention: 24h\n", "5:14", "buckets.retention",
                "at least buckets.max_late + buckets.span (25h)");
    expect_ok(LISTENER "buckets:\n  retention: 25h\n", &cfg);
    /* Reported where retention is given, also when max_late comes later. */
    expect_fail(LISTENER "buckets:\n  retention: 25h\n  max_late: 48h\n", "5:14",
                "buckets.retention", "(49h)");
}

Test(config, summaries_may_outlive_their_pages_but_not_expire_before_them) {
    struct bd_config cfg;
    expect_fail(LISTENER "summaries:\n  retention: 720h\n", "5:14", "summaries.retention",
                "at least buckets.retention (which must then be set)");
    expect_fail(LISTENER "buckets:\n  retention: 720h\nsummaries:\n  retention: 719h\n", "7:14",
                "summaries.retention", "may outlive its pages");
    expect_ok(LISTENER "buckets:\n  retention: 720h\nsummaries:\n  retention: 720h\n", &cfg);
    expect_ok(LISTENER "buckets:\n  retention: 720h\n", &cfg);
}

/* ---- listeners[].tls ------------------------------------------------------------------------- */

/* ca, server (signed by ca) and other (self-signed) certificates and keys in tmpdir. */
static void write_tls_files(void) {
    struct test_cert ca = test_cert_make("test ca", NULL);
    struct test_cert server = test_cert_make("localhost", &ca);
    struct test_cert other = test_cert_make("other", NULL);
    test_cert_write(&ca, tmpdir, "ca");
    test_cert_write(&server, tmpdir, "server");
    test_cert_write(&other, tmpdir, "other");
    test_cert_free(&ca);
    test_cert_free(&server);
    test_cert_free(&other);
}

static void remove_tls_files(void) {
    const char *names[] = {"ca.pem",     "ca.key",    "server.pem",
                           "server.key", "other.pem", "other.key"};
    char p[400];
    for (size_t i = 0; i < BD_ARRAY_LEN(names); i++) {
        snprintf(p, sizeof(p), "%s/%s", tmpdir, names[i]);
        unlink(p);
    }
}

/* A tcp listener with a tls mapping of the given lines (each "      key: file", file in tmpdir). */
static void tls_yaml(char *out, size_t cap, const char *proto, const char *cert, const char *key,
                     const char *client_ca) {
    int n = snprintf(out, cap,
                     "listeners:\n  - proto: %s\n    bind: \"127.0.0.1:8094\"\n    tls:\n", proto);
    if (cert != NULL) {
        n += snprintf(out + n, cap - (size_t)n, "      cert: \"%s/%s\"\n", tmpdir, cert);
    }
    if (key != NULL) {
        n += snprintf(out + n, cap - (size_t)n, "      key: \"%s/%s\"\n", tmpdir, key);
    }
    if (client_ca != NULL) {
        snprintf(out + n, cap - (size_t)n, "      client_ca: \"%s/%s\"\n", tmpdir, client_ca);
    }
}

Test(config, tls_keys_load_and_the_dump_reads_back) {
    struct bd_config a, b;
    struct bd_err err = {0};
    char yaml[2048], want[600];
    write_tls_files();
    tls_yaml(yaml, sizeof(yaml), "tcp", "server.pem", "server.key", "ca.pem");
    strcat(yaml, "  - proto: tcp\n    bind: \"127.0.0.1:8095\"\n");
    expect_ok(yaml, &a);
    snprintf(want, sizeof(want), "%s/server.pem", tmpdir);
    cr_assert_str_eq(a.listeners[0].tls.cert, want);
    snprintf(want, sizeof(want), "%s/server.key", tmpdir);
    cr_assert_str_eq(a.listeners[0].tls.key, want);
    snprintf(want, sizeof(want), "%s/ca.pem", tmpdir);
    cr_assert_str_eq(a.listeners[0].tls.client_ca, want);
    cr_assert(bd_tls_enabled(&a.listeners[0]));
    cr_assert_not(bd_tls_enabled(&a.listeners[1]));

    char *first = dump_to_string(&a);
    snprintf(want, sizeof(want), "    tls:\n      cert: \"%s/server.pem\"\n", tmpdir);
    cr_assert_not_null(strstr(first, want), "dump lacks\n%s--- dump:\n%s", want, first);
    write_file(dump_path, first);
    cr_assert_eq(bd_config_load(&b, dump_path, &err), 0, "%s\n--- dump:\n%s", err.msg, first);
    char *second = dump_to_string(&b);
    cr_assert_str_eq(first, second);
    cr_assert_eq(memcmp(&a.listeners, &b.listeners, sizeof(a.listeners)), 0);

    /* Another file on a kept listener needs a restart; the same files are no change. */
    struct bd_config merged;
    struct changes ch;
    cr_assert_eq(merge(&a, &b, &merged, &ch, &err), 0, "%s", err.msg);
    cr_assert_eq(ch.n, 0, "%s", ch.text);
    snprintf(b.listeners[0].tls.client_ca, sizeof(b.listeners[0].tls.client_ca), "%s/other.pem",
             tmpdir);
    cr_assert_eq(merge(&a, &b, &merged, &ch, &err), 0, "%s", err.msg);
    snprintf(want, sizeof(want), "listeners[0].tls.client_ca|%s/ca.pem|%s/other.pem|restart\n",
             tmpdir, tmpdir);
    cr_assert_str_eq(ch.text, want);
    cr_assert_str_eq(merged.listeners[0].tls.client_ca, a.listeners[0].tls.client_ca);
    free(first);
    free(second);
    remove_tls_files();
}

Test(config, tls_errors_name_file_position_key_and_cause) {
    char yaml[2048];
    write_tls_files();
    tls_yaml(yaml, sizeof(yaml), "tcp", "server.pem", "other.key", NULL);
    expect_fail(yaml, "6:12", "listeners[0].tls.key", "does not match the certificate");
    tls_yaml(yaml, sizeof(yaml), "tcp", "missing.pem", "server.key", NULL);
    expect_fail(yaml, "5:13", "listeners[0].tls.cert", "No such file or directory");
    tls_yaml(yaml, sizeof(yaml), "tcp", "server.key", "server.key", NULL);
    expect_fail(yaml, "5:13", "listeners[0].tls.cert", "not a PEM certificate");
    tls_yaml(yaml, sizeof(yaml), "tcp", "server.pem", "server.key", "server.key");
    expect_fail(yaml, "7:18", "listeners[0].tls.client_ca", "no PEM CA certificate");
    tls_yaml(yaml, sizeof(yaml), "tcp", "server.pem", NULL, NULL);
    expect_fail(yaml, "5:13", "listeners[0].tls", "needs both cert and key (key is missing)");
    tls_yaml(yaml, sizeof(yaml), "tcp", NULL, NULL, "ca.pem");
    expect_fail(yaml, "5:18", "listeners[0].tls", "needs both cert and key (cert is missing)");
    tls_yaml(yaml, sizeof(yaml), "udp", "server.pem", "server.key", NULL);
    expect_fail(yaml, "5:13", "listeners[0].tls.cert", "only valid on tcp listeners");
    expect_fail("listeners:\n  - proto: tcp\n    bind: \"127.0.0.1:1\"\n    tls: yes\n", "4:10",
                "listeners[0].tls", "expected a mapping with keys: cert, key, client_ca");
    expect_fail("listeners:\n  - proto: tcp\n    bind: \"127.0.0.1:1\"\n    tls:\n      crt: x\n",
                "5:7", "listeners[0].tls.crt", "did you mean \"cert\"?");
    remove_tls_files();
}

/* ---- listeners[].allow and max_connections_per_ip ---- */

#define TCP_LISTENER "listeners:\n  - proto: tcp\n    bind: \"127.0.0.1:8094\"\n"

Test(config, allow_reads_a_list_of_prefixes) {
    struct bd_config cfg;
    char text[BD_CIDR_TEXT_LEN];
    expect_ok(LISTENER "    allow: [\"10.0.0.0/8\", \"192.168.1.7\", \"fd00::/8\", \"::1\"]\n",
              &cfg);
    const struct bd_allow *a = &cfg.listeners[0].allow;
    cr_assert_eq(a->n, 4);
    bd_cidr_format(&a->e[1], text, sizeof(text));
    cr_assert_str_eq(text, "192.168.1.7/32");
    bd_cidr_format(&a->e[3], text, sizeof(text));
    cr_assert_str_eq(text, "::1/128");
    /* Block style, unquoted, on a tcp listener too. */
    expect_ok(TCP_LISTENER "    allow:\n      - 127.0.0.1/32\n      - 0.0.0.0/0\n", &cfg);
    cr_assert_eq(cfg.listeners[0].allow.n, 2);
    /* Absent: everyone. */
    expect_ok(LISTENER, &cfg);
    cr_assert_eq(cfg.listeners[0].allow.n, 0);
}

Test(config, allow_errors_name_the_entry) {
    expect_fail(LISTENER "    allow: [\"10.0.0.0/8\", \"10.0.0.1/8\"]\n", "4:27",
                "listeners[0].allow[1]",
                "host bits set beyond the prefix (did you mean 10.0.0.0/8?)");
    expect_fail(LISTENER "    allow:\n      - 10.0.0.0/33\n", "5:9", "listeners[0].allow[0]",
                "the prefix length must be a number from 0 to 32");
    expect_fail(LISTENER "    allow: [gateway.lan]\n", "4:13", "listeners[0].allow[0]",
                "not an IPv4 or IPv6 address");
    expect_fail(LISTENER "    allow: [[\"10.0.0.0/8\"]]\n", "4:13", "listeners[0].allow[0]",
                "expected an address prefix, not a list");
    /* A single prefix must still be a list: a scalar is most likely a forgotten dash. */
    expect_fail(LISTENER "    allow: 10.0.0.0/8\n", "4:12", "listeners[0].allow",
                "expected a non-empty list of address prefixes");
    /* Empty, or every entry commented out: neither "nobody" nor "everybody" is assumed. */
    expect_fail(LISTENER "    allow: []\n", "4:12", "listeners[0].allow",
                "leave the key out to accept every sender");
    expect_fail(LISTENER "    allow:\n    #  - 10.0.0.0/8\n", NULL, "listeners[0].allow",
                "expected a non-empty list");
}

Test(config, allow_at_most_32_prefixes) {
    char yaml[4096];
    int used = snprintf(yaml, sizeof(yaml), "%s    allow: [", LISTENER);
    for (int i = 0; i < 33; i++) {
        used += snprintf(yaml + used, sizeof(yaml) - (size_t)used, "%s\"10.%d.0.0/16\"",
                         i > 0 ? ", " : "", i);
    }
    snprintf(yaml + used, sizeof(yaml) - (size_t)used, "]\n");
    expect_fail(yaml, NULL, "listeners[0].allow[32]", "at most 32 prefixes");
}

Test(config, max_connections_per_ip_default_bounds_and_rule) {
    struct bd_config cfg;
    expect_ok(TCP_LISTENER, &cfg);
    cr_assert_eq(cfg.listeners[0].max_connections_per_ip, 64);
    /* The default gives way to a smaller max_connections instead of breaking old files. */
    expect_ok(TCP_LISTENER "    max_connections: 10\n", &cfg);
    cr_assert_eq(cfg.listeners[0].max_connections_per_ip, 10);
    expect_ok(TCP_LISTENER "    max_connections: 10\n    max_connections_per_ip: 10\n", &cfg);
    cr_assert_eq(cfg.listeners[0].max_connections_per_ip, 10);
    expect_fail(TCP_LISTENER "    max_connections: 10\n    max_connections_per_ip: 11\n", "5:29",
                "listeners[0].max_connections_per_ip", "must not exceed max_connections (10)");
    expect_fail(TCP_LISTENER "    max_connections_per_ip: 0\n", "4:29",
                "listeners[0].max_connections_per_ip", "out of range (1 to 65535)");
    expect_fail(LISTENER "    max_connections_per_ip: 4\n", "4:29",
                "listeners[0].max_connections_per_ip", "only valid on tcp listeners");
}

Test(config, dump_of_allow_reads_back) {
    struct bd_config a, b;
    struct bd_err err = {0};
    expect_ok(TCP_LISTENER "    allow: [\"10.0.0.0/8\", \"::ffff:192.168.0.0/112\", "
                           "\"2001:db8::/32\"]\n    max_connections_per_ip: 3\n",
              &a);
    char *first = dump_to_string(&a);
    cr_assert_not_null(strstr(first, "allow: [\"10.0.0.0/8\", \"192.168.0.0/16\", "
                                     "\"2001:db8::/32\"]\n"),
                       "%s", first);
    write_file(dump_path, first);
    cr_assert_eq(bd_config_load(&b, dump_path, &err), 0, "%s\n--- dump:\n%s", err.msg, first);
    cr_assert_eq(memcmp(&a.listeners, &b.listeners, sizeof(a.listeners)), 0);
    free(first);
}

/* allow is a security setting operators change live: a kept listener applies it on SIGHUP. */
Test(config, reload_merge_applies_allow_of_a_kept_listener) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch;
    expect_ok(TCP_LISTENER, &cur);
    expect_ok(TCP_LISTENER "    allow: [\"10.0.0.0/8\"]\n    max_connections_per_ip: 5\n", &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ch.text, "listeners[0].max_connections_per_ip|64|5|restart\n"
                              "listeners[0].allow|(absent: everyone)|[\"10.0.0.0/8\"]|applied\n");
    cr_assert_eq(out.listeners[0].allow.n, 1);
    cr_assert_eq(out.listeners[0].max_connections_per_ip, 64);
    /* And back to everyone. */
    expect_ok(TCP_LISTENER, &next);
    cr_assert_eq(merge(&out, &next, &cur, &ch, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ch.text, "listeners[0].allow|[\"10.0.0.0/8\"]|(absent: everyone)|applied\n");
    cr_assert_eq(cur.listeners[0].allow.n, 0);
}

static void collect_warning(void *arg, const char *msg) {
    struct changes *w = arg;
    size_t used = strlen(w->text);
    snprintf(w->text + used, sizeof(w->text) - used, "%s\n", msg);
    w->n++;
}

Test(config, silent_after_loads_reloads_and_warns_when_not_below_sensor_idle) {
    struct bd_config cur, next, out;
    struct bd_err err = {0};
    struct changes ch, warned = {0};
    expect_ok(LISTENER "metrics:\n  silent_after: 90s\n", &cur);
    cr_assert_eq(cur.metrics.silent_after_ms, 90000);
    bd_config_warnings(&cur, collect_warning, &warned);
    cr_assert_eq(warned.n, 0, "%s", warned.text);
    expect_ok(LISTENER "metrics:\n  silent_after: 0\n", &next);
    cr_assert_eq(merge(&cur, &next, &out, &ch, &err), 0, "%s", err.msg);
    cr_assert_str_eq(ch.text, "metrics.silent_after|90s|0|applied\n");
    cr_assert_eq(out.metrics.silent_after_ms, 0);
    /* Not below limits.sensor_idle: loads, with a warning naming both keys. */
    expect_ok(LISTENER "metrics:\n  silent_after: 1h\nlimits:\n  sensor_idle: 1h\n", &cur);
    bd_config_warnings(&cur, collect_warning, &warned);
    cr_assert_eq(warned.n, 1);
    cr_assert_not_null(strstr(warned.text, "metrics.silent_after (1h) is not below "
                                           "limits.sensor_idle (1h)"),
                       "%s", warned.text);
    /* sensor_idle 0 never forgets: no warning. */
    memset(&warned, 0, sizeof(warned));
    expect_ok(LISTENER "metrics:\n  silent_after: 1h\nlimits:\n  sensor_idle: 0\n", &cur);
    bd_config_warnings(&cur, collect_warning, &warned);
    cr_assert_eq(warned.n, 0, "%s", warned.text);
}
