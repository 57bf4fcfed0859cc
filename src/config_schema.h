/*
 * The configuration's schema (src/config_schema.c): one row per key, and what is driven by a
 * row (a value's text to its field and back, the defaults, looking keys up) or by several (the
 * rules between keys). The loader (src/config.c) walks a YAML file over it, the dump and the
 * reload check print and compare by it, src/config_files.c checks the URI a credential file
 * holds with its rule. It calls nothing of theirs: below them, above src/units.c.
 *
 * Stateless apart from the table; runs on the thread that loads a configuration (the main
 * thread).
 */
#ifndef BUCKETD_CONFIG_SCHEMA_H
#define BUCKETD_CONFIG_SCHEMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#include "bucketd/allow.h"
#include "bucketd/config.h"

/* A value as text: the longest is an allow list of BD_ALLOW_MAX IPv6 prefixes. */
#define VALUE_TEXT_LEN (BD_ALLOW_MAX * (BD_CIDR_TEXT_LEN + 4) + 8)

/* Listener keys live under this pseudo-section; their offsets are into the listener struct. */
#define LISTENER_PREFIX "listeners[]."

/* Room for a flag per key of the schema (config_schema_n is at most this: checked at build). */
#define CONFIG_KEYS_MAX 128

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

/* The table: config_schema_n rows, sections kept together, in the order the dump prints. */
extern const struct key_def config_schema[];
extern const size_t config_schema_n;

static inline bool config_schema_in_listener(const struct key_def *k) {
    return strncmp(k->path, LISTENER_PREFIX, sizeof(LISTENER_PREFIX) - 1) == 0;
}

/* The row of path ("flush.interval", "listeners[].bind"), or -1. */
int config_schema_find(const char *path);

/* True if some key lives under "<path>.", i.e. path names a section. */
bool config_schema_is_section(const char *path);

/* The key names directly under prefix, "a, b, c", for a message. */
void config_schema_valid_keys(const char *prefix, char *buf, size_t len);

/* The key name under prefix within two edits of typo (what a typo meant), or NULL; *len its
 * length (the name is not NUL-terminated where it ends). */
const char *config_schema_nearest(const char *prefix, const char *typo, size_t *len);

/* A scalar value, parsed. */
struct config_value {
    uint64_t num;
    int ival;
    struct sockaddr_storage addr;
};

/*
 * Parse text as the row's type and apply its bounds and extra rule. On failure writes a reason
 * into why (without the key; the caller adds position and key) and returns -EINVAL.
 */
int config_schema_parse_value(const struct key_def *k, const char *text, struct config_value *v,
                              char *why, size_t why_len);

/* Store a parsed value in its field of base (struct bd_config or struct bd_listener_config). */
void config_schema_store_value(const struct key_def *k, void *base, const char *text,
                               const struct config_value *v);

/* The field as text that config_schema_parse_value takes back unchanged (VALUE_TEXT_LEN). */
void config_schema_format_value(const struct key_def *k, const void *base, char *buf, size_t len);

/* Every listener key's default. */
void config_schema_listener_defaults(struct bd_listener_config *lc);

/* Why mongodb.uri (or what mongodb.uri_file holds) is refused, or NULL (a static buffer:
 * configurations are loaded on one thread). */
const char *config_schema_check_uri(const char *uri);

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
bool config_schema_broken_rule(const struct bd_config *cfg, struct rule_failure *rf);

#endif
