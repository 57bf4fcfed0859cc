/*
 * Configuration: the YAML loader over the schema (src/config_schema.c), the dump and the reload
 * check. bd_config_load reads the file (src/config_files.c), walks its YAML document applying
 * each key through its schema row, checks each listener and the rules between keys, and reads
 * the credential files; every error names file:line:col and the key (libyaml's marks). The dump
 * prints and the reload check compares configurations row by row.
 *
 * Runs on the main thread only: at start-up before any other thread exists, and later on
 * SIGHUP. bd_config_load parses into a private copy and copies it into the caller's struct
 * only once the whole file is valid, so a bad file never leaves a half-applied config behind.
 * Nothing allocated here outlives a call; the libyaml document is freed before returning.
 * Calls only down: the schema and the files (and src/creds.c, to hide a password in the dump).
 */
#include "bucketd/config.h"

#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "bucketd/creds.h"
#include "config_files.h"
#include "config_schema.h"

/* ---- The YAML walk --------------------------------------------------------------------------- */

struct loader {
    const char *path;
    const char *text; /* the file, for turning a reader error's byte offset into line:column */
    size_t text_len;
    yaml_document_t *doc;
    struct bd_config *cfg;
    struct bd_err *err;
    /* Where each top-level key was given, for errors found after the walk. */
    bool set[CONFIG_KEYS_MAX];
    yaml_mark_t mark[CONFIG_KEYS_MAX];
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
    struct config_value v;

    if (vn->type != YAML_SCALAR_NODE) {
        /* A list where an address belongs is nearly always an IPv6 address left unquoted. */
        return fail(ld, vn->start_mark, shown, "expected a single value, not %s%s", node_kind(vn),
                    k->type == T_HOSTPORT ? " (quote IPv6 addresses: \"[::]:8089\")" : "");
    }
    if (strlen(scalar(vn)) != vn->data.scalar.length) {
        return fail(ld, vn->start_mark, shown, "contains a NUL character");
    }
    if (config_schema_parse_value(k, scalar(vn), &v, why, sizeof(why)) < 0) {
        return fail(ld, vn->start_mark, shown, "%s", why);
    }
    config_schema_store_value(k, base, scalar(vn), &v);
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
        int idx = plain ? config_schema_find(path) : -1;
        if (idx >= 0 && config_schema[idx].type == T_LISTENERS) {
            rc = walk_listeners(ld, vn);
        } else if (idx >= 0 && config_schema[idx].type == T_CIDRS) {
            rc = apply_cidrs(ld, &config_schema[idx], vn, disp, base);
        } else if (idx >= 0) {
            rc = apply_leaf(ld, &config_schema[idx], vn, disp, base);
        } else if (plain && config_schema_is_section(path)) {
            char sub_prefix[160], sub_shown[168];
            snprintf(sub_prefix, sizeof(sub_prefix), "%s.", path);
            snprintf(sub_shown, sizeof(sub_shown), "%s.", disp);
            if (is_null(vn)) {
                continue;
            }
            if (vn->type != YAML_MAPPING_NODE) {
                config_schema_valid_keys(sub_prefix, list, sizeof(list));
                return fail(ld, vn->start_mark, disp, "expected a mapping with keys: %s", list);
            }
            rc = walk_mapping(ld, vn, sub_prefix, sub_shown, base, set, mark);
        } else {
            char hint[96] = "";
            size_t near_len = 0;
            const char *near = config_schema_nearest(prefix, name, &near_len);
            if (near != NULL) {
                snprintf(hint, sizeof(hint), "did you mean \"%.*s\"? ", (int)near_len, near);
            }
            config_schema_valid_keys(prefix, list, sizeof(list));
            return fail(ld, kn->start_mark, disp, "unknown key; %svalid keys here: %s", hint, list);
        }
        if (rc < 0) {
            return rc;
        }
        if (idx >= 0) {
            set[idx] = true;
            mark[idx] = config_schema[idx].type == T_LISTENERS ? kn->start_mark : vn->start_mark;
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
    int cert = config_schema_find(LISTENER_PREFIX "tls.cert");
    int key = config_schema_find(LISTENER_PREFIX "tls.key");
    int ca = config_schema_find(LISTENER_PREFIX "tls.client_ca");
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
    if (config_files_tls_trial(lc, &bad, &terr) < 0) {
        int at = strcmp(bad, "key") == 0 ? key : strcmp(bad, "client_ca") == 0 ? ca : cert;
        snprintf(k, sizeof(k), "%s.tls.%s", shown, bad);
        return fail(ld, mark[at], k, "%s", terr.msg);
    }
    return 0;
}

static struct bd_config_pos pos_of(yaml_mark_t m) {
    return (struct bd_config_pos){(uint32_t)m.line + 1, (uint32_t)m.column + 1};
}

static int walk_listener(struct loader *ld, yaml_node_t *item, uint32_t n) {
    struct bd_listener_config *lc = &ld->cfg->listeners[n];
    bool set[CONFIG_KEYS_MAX] = {false};
    yaml_mark_t mark[CONFIG_KEYS_MAX];
    char shown[32], key[64];

    snprintf(shown, sizeof(shown), "listeners[%" PRIu32 "]", n);
    if (item->type != YAML_MAPPING_NODE) {
        return fail(ld, item->start_mark, shown, "expected a mapping (proto, bind, ...), not %s",
                    node_kind(item));
    }
    config_schema_listener_defaults(lc);
    snprintf(key, sizeof(key), "%s.", shown);
    int rc = walk_mapping(ld, item, LISTENER_PREFIX, key, lc, set, mark);
    if (rc < 0) {
        return rc;
    }

    for (size_t i = 0; i < config_schema_n; i++) {
        const struct key_def *k = &config_schema[i];
        if (!config_schema_in_listener(k)) {
            continue;
        }
        const char *name = k->path + sizeof(LISTENER_PREFIX) - 1;
        if ((k->flags & KF_REQUIRED) && !set[i]) {
            return fail(ld, item->start_mark, shown, "missing required key \"%s\"", name);
        }
    }
    /* A second pass: whether a key fits depends on proto, which may come after it. */
    for (size_t i = 0; i < config_schema_n; i++) {
        const struct key_def *k = &config_schema[i];
        bool wrong = ((k->flags & KF_UDP) && lc->proto != BD_PROTO_UDP) ||
                     ((k->flags & KF_TCP) && lc->proto != BD_PROTO_TCP);
        if (config_schema_in_listener(k) && set[i] && wrong) {
            snprintf(key, sizeof(key), "%s.%s", shown, k->path + sizeof(LISTENER_PREFIX) - 1);
            return fail(ld, mark[i], key, "only valid on %s listeners (this one is %s)",
                        (k->flags & KF_UDP) ? "udp" : "tcp", bd_proto_name(lc->proto));
        }
    }
    /* The default (64) gives way to a smaller max_connections; a value given must fit in it. */
    int per_ip = config_schema_find(LISTENER_PREFIX "max_connections_per_ip");
    if (!set[per_ip]) {
        lc->max_connections_per_ip = BD_MIN(lc->max_connections_per_ip, lc->max_connections);
    } else if (lc->max_connections_per_ip > lc->max_connections) {
        snprintf(key, sizeof(key), "%s.max_connections_per_ip", shown);
        return fail(ld, mark[per_ip], key, "must not exceed max_connections (%" PRIu32 ")",
                    lc->max_connections);
    }
    int bind_idx = config_schema_find(LISTENER_PREFIX "bind");
    ld->cfg->at.listener_bind[n] = pos_of(mark[bind_idx]);
    for (uint32_t j = 0; j < n; j++) {
        const struct bd_listener_config *other = &ld->cfg->listeners[j];
        if (other->proto == lc->proto && same_addr(&other->addr, &lc->addr)) {
            int bind = config_schema_find(LISTENER_PREFIX "bind");
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
    int i = config_schema_find(path);
    BD_ASSERT(i >= 0);
    return ld->set[i] ? ld->mark[i] : fallback;
}

/* Rules that involve more than one key, checked once the whole file is applied. */
static int validate(struct loader *ld, yaml_mark_t top) {
    struct rule_failure rf;
    if (!config_schema_broken_rule(ld->cfg, &rf)) {
        return 0;
    }
    yaml_mark_t where = rf.other != NULL ? mark_of(ld, rf.other, top) : top;
    return fail(ld, mark_of(ld, rf.key, where), rf.key, "%s", rf.why);
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

    rc = config_files_read(path, &text, &text_len, err);
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
            config_schema_valid_keys("", list, sizeof(list));
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

    /* The URI from the credential files; their errors name the key that names the file. */
    const char *bad_key = NULL;
    struct bd_err cerr = {0};
    rc = config_files_resolve_uri(next, path, ld->set[config_schema_find("mongodb.uri")], &bad_key,
                                  &cerr);
    if (rc < 0) {
        rc = bad_key != NULL ? fail(ld, mark_of(ld, bad_key, top), bad_key, "%s", cerr.msg)
                             : bd_err_set(err, rc, "%s", cerr.msg);
        goto out;
    }
    rc = validate(ld, top);
    if (rc < 0) {
        goto out;
    }
    int metrics_bind = config_schema_find("metrics.bind");
    if (ld->set[metrics_bind]) {
        next->at.metrics_bind = pos_of(ld->mark[metrics_bind]);
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
    config_schema_format_value(k, base, buf, sizeof(buf));
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

    for (size_t i = 0; i < config_schema_n; i++) {
        const struct key_def *k = &config_schema[i];
        if (config_schema_in_listener(k)) {
            continue;
        }
        if (k->type == T_LISTENERS) {
            fprintf(out, "listeners:\n");
            for (uint32_t n = 0; n < cfg->n_listeners; n++) {
                const struct bd_listener_config *lc = &cfg->listeners[n];
                const char *sub = NULL; /* the nested mapping being printed ("tls.cert") */
                bool first = true;
                for (size_t j = 0; j < config_schema_n; j++) {
                    const struct key_def *lk = &config_schema[j];
                    if (!config_schema_in_listener(lk) || !listener_key_applies(lk, lc) ||
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
    config_schema_format_value(k, a, x, sizeof(x));
    config_schema_format_value(k, b, y, sizeof(y));
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
        for (size_t j = 0; j < config_schema_n; j++) {
            const struct key_def *lk = &config_schema[j];
            /* bind names the socket both share, however it is written. */
            if (config_schema_in_listener(lk) && !(lk->flags & KF_RESOLVE) &&
                listener_key_applies(lk, want) && key_differs(lk, have, want)) {
                snprintf(key, sizeof(key), "listeners[%" PRIu32 "].%s", n,
                         lk->path + sizeof(LISTENER_PREFIX) - 1);
                config_schema_format_value(lk, have, x, sizeof(x));
                config_schema_format_value(lk, want, y, sizeof(y));
                report(cb, arg, key, x, y, (lk->flags & KF_RELOAD) != 0);
            }
        }
        out->listeners[n] = *have;
        /* A kept listener takes its reloadable keys (allow) from the file. */
        for (size_t j = 0; j < config_schema_n; j++) {
            const struct key_def *lk = &config_schema[j];
            if (config_schema_in_listener(lk) && (lk->flags & KF_RELOAD)) {
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
    for (size_t i = 0; i < config_schema_n; i++) {
        const struct key_def *k = &config_schema[i];
        if (config_schema_in_listener(k)) {
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
        config_schema_format_value(k, cur, x, sizeof(x));
        config_schema_format_value(k, next, y, sizeof(y));
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
        !key_differs(&config_schema[config_schema_find("mongodb.uri")], cur, next) &&
        !key_differs(&config_schema[config_schema_find("mongodb.uri_file")], cur, next) &&
        !key_differs(&config_schema[config_schema_find("mongodb.password_file")], cur, next)) {
        report(cb, arg,
               next->mongodb.password_file[0] != '\0' && next->mongodb.uri_file[0] == '\0'
                   ? "mongodb.password_file (its content)"
                   : "mongodb.uri_file (its content)",
               "(not shown)", "(changed)", false);
    }
    struct rule_failure rf;
    int rc = 0;
    if (config_schema_broken_rule(merged, &rf)) {
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
