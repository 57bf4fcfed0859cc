/*
 * MongoDB connection settings shared by the daemon (flusher) and the tools. Stateless.
 */
#include "bucketd/mongo.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

static void default_option(mongoc_uri_t *uri, const char *key, int32_t value) {
    if (!mongoc_uri_has_option(uri, key)) {
        mongoc_uri_set_option_as_int32(uri, key, value);
    }
}

/*
 * TLS files named in the URI must be readable now: otherwise the driver only fails at the
 * first connection, inside a handshake error that does not name the file.
 */
static int check_tls_files(const mongoc_uri_t *uri, struct bd_err *err) {
    /* The driver stores option names lower-cased; messages use the documented spelling. */
    static const char *const keys[] = {"tlsCAFile", "tlsCertificateKeyFile", "tlsCRLFile"};
    for (size_t i = 0; i < BD_ARRAY_LEN(keys); i++) {
        const char *path = mongoc_uri_get_option_as_utf8(uri, keys[i], NULL);
        if (path != NULL && access(path, R_OK) < 0) {
            return bd_err_set(err, -errno, "%s '%s': %s", keys[i], path, strerror(errno));
        }
    }
    return 0;
}

/*
 * Every option name libmongoc acts on, in the spelling the MongoDB documentation uses (for the
 * hint). The driver compares names without regard to case and knows the deprecated ssl*
 * spellings as aliases, so both are accepted here too; a name the driver itself recognises
 * (mongoc_uri_option_is_*) is accepted even if it is missing below (a newer driver).
 */
static const char *const known_options[] = {"appName",
                                            "authMechanism",
                                            "authMechanismProperties",
                                            "authSource",
                                            "canonicalizeHostname",
                                            "compressors",
                                            "connectTimeoutMS",
                                            "directConnection",
                                            "gssapiServiceName",
                                            "heartbeatFrequencyMS",
                                            "journal",
                                            "loadBalanced",
                                            "localThresholdMS",
                                            "maxIdleTimeMS",
                                            "maxPoolSize",
                                            "maxStalenessSeconds",
                                            "minPoolSize",
                                            "readConcernLevel",
                                            "readPreference",
                                            "readPreferenceTags",
                                            "replicaSet",
                                            "retryReads",
                                            "retryWrites",
                                            "safe",
                                            "serverSelectionTimeoutMS",
                                            "serverSelectionTryOnce",
                                            "socketCheckIntervalMS",
                                            "socketTimeoutMS",
                                            "srvMaxHosts",
                                            "srvServiceName",
                                            "tls",
                                            "tlsAllowInvalidCertificates",
                                            "tlsAllowInvalidHostnames",
                                            "tlsCAFile",
                                            "tlsCertificateKeyFile",
                                            "tlsCertificateKeyFilePassword",
                                            "tlsDisableCertificateRevocationCheck",
                                            "tlsDisableOCSPEndpointCheck",
                                            "tlsInsecure",
                                            "w",
                                            "waitQueueMultiple",
                                            "waitQueueTimeoutMS",
                                            "wTimeoutMS",
                                            "zlibCompressionLevel",
                                            "ssl",
                                            "sslAllowInvalidCertificates",
                                            "sslAllowInvalidHostnames",
                                            "sslCertificateAuthorityFile",
                                            "sslClientCertificateKeyFile",
                                            "sslClientCertificateKeyPassword"};

static bool option_known(const char *key) {
    for (size_t i = 0; i < BD_ARRAY_LEN(known_options); i++) {
        if (strcasecmp(key, known_options[i]) == 0) {
            return true;
        }
    }
    return mongoc_uri_option_is_int32(key) || mongoc_uri_option_is_int64(key) ||
           mongoc_uri_option_is_bool(key) || mongoc_uri_option_is_utf8(key);
}

/* Case-insensitive edit distance counting a swap of neighbours as one edit ("tsl" is one from
 * "tls"), for "did you mean". */
static size_t distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    size_t d[32][32];
    if (la >= 32 || lb >= 32) {
        return SIZE_MAX;
    }
    for (size_t i = 0; i <= la; i++) {
        for (size_t j = 0; j <= lb; j++) {
            if (i == 0 || j == 0) {
                d[i][j] = i + j;
                continue;
            }
            int x = tolower((unsigned char)a[i - 1]), y = tolower((unsigned char)b[j - 1]);
            size_t v = BD_MIN(BD_MIN(d[i - 1][j] + 1, d[i][j - 1] + 1), d[i - 1][j - 1] + (x != y));
            if (i > 1 && j > 1 && x == tolower((unsigned char)b[j - 2]) &&
                tolower((unsigned char)a[i - 2]) == y) {
                v = BD_MIN(v, d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    return d[la][lb];
}

/*
 * libmongoc only logs a warning for an option it does not know and goes on without it, so a
 * typo ("tsl=true") would silently connect without TLS: refuse it, naming the option.
 */
static int check_option_names(const char *s, struct bd_err *err) {
    const char *q = strchr(s, '?');
    while (q != NULL && *q != '\0') {
        q++;
        size_t len = strcspn(q, "&");
        size_t klen = strcspn(q, "=&");
        char key[64];
        if (klen > 0) {
            snprintf(key, sizeof(key), "%.*s", (int)BD_MIN(klen, sizeof(key) - 1), q);
            if (klen >= sizeof(key) || !option_known(key)) {
                const char *best = NULL;
                size_t best_d = 3; /* within two edits is a typo */
                for (size_t i = 0; i < BD_ARRAY_LEN(known_options); i++) {
                    size_t d = distance(key, known_options[i]);
                    if (d < best_d) {
                        best = known_options[i];
                        best_d = d;
                    }
                }
                char hint[64] = "";
                if (best != NULL) {
                    snprintf(hint, sizeof(hint), "; did you mean \"%s\"?", best);
                }
                return bd_err_set(err, -EINVAL,
                                  "unknown URI option \"%.*s\" (the driver would ignore it)%s",
                                  (int)BD_MIN(klen, (size_t)64), q, hint);
            }
        }
        q = q[len] == '&' ? q + len : NULL;
    }
    return 0;
}

/* The driver's message may quote the password ('Password "..." must not have unescaped
 * chars'): the quoted password becomes "*****". */
static void scrub_password(char *msg, const char *s) {
    const char *p = strstr(s, "://");
    if (p == NULL) {
        return;
    }
    p += 3;
    size_t auth = strcspn(p, "/");
    const char *at = memchr(p, '@', auth);
    const char *colon = at != NULL ? memchr(p, ':', (size_t)(at - p)) : NULL;
    if (colon == NULL) {
        return;
    }
    char quoted[512];
    int n = snprintf(quoted, sizeof(quoted), "\"%.*s\"", (int)(at - colon - 1), colon + 1);
    char *hit;
    while (n > 0 && (size_t)n < sizeof(quoted) && (hit = strstr(msg, quoted)) != NULL) {
        memmove(hit + 7, hit + n, strlen(hit + n) + 1);
        memcpy(hit, "\"*****\"", 7);
    }
    explicit_bzero(quoted, sizeof(quoted));
}

static mongoc_uri_t *parse_uri(const char *s, struct bd_err *err) {
    bson_error_t berr;
    if (check_option_names(s, err) < 0) {
        return NULL;
    }
    mongoc_uri_t *uri = mongoc_uri_new_with_error(s, &berr);
    if (uri == NULL) {
        scrub_password(berr.message, s);
        bd_err_set(err, -EINVAL, "%s", berr.message);
        return NULL;
    }
    if (check_tls_files(uri, err) < 0) {
        mongoc_uri_destroy(uri);
        return NULL;
    }
    return uri;
}

int bd_mongo_uri_check(const char *s, struct bd_err *err) {
    mongoc_uri_t *uri = parse_uri(s, err);
    mongoc_uri_destroy(uri);
    return uri == NULL ? -EINVAL : 0;
}

mongoc_uri_t *bd_mongo_uri_new(const char *s, struct bd_err *err) {
    struct bd_err perr = {0};
    mongoc_uri_t *uri = parse_uri(s, &perr);
    if (uri == NULL) {
        bd_err_set(err, -EINVAL, "mongodb.uri: %s", perr.msg);
        return NULL;
    }
    default_option(uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 2000);
    default_option(uri, MONGOC_URI_CONNECTTIMEOUTMS, 2000);
    default_option(uri, MONGOC_URI_SOCKETTIMEOUTMS, 10000);
    return uri;
}

int bd_mongo_write_concern_new(const char *s, uint64_t wtimeout_ms, mongoc_write_concern_t **out,
                               struct bd_err *err) {
    char *end = NULL;
    long w = 0;
    if (strcmp(s, "majority") != 0) {
        errno = 0;
        w = strtol(s, &end, 10);
        if (errno != 0 || end == s || *end != '\0' || w < 1 || w > 1000) {
            return bd_err_set(err, -EINVAL,
                              "mongodb.write_concern: '%s' is not 1, majority or N (0 is refused)",
                              s);
        }
    }
    mongoc_write_concern_t *wc = mongoc_write_concern_new();
    if (w == 0) {
        mongoc_write_concern_set_wmajority(wc, (int32_t)BD_MIN(wtimeout_ms, (uint64_t)INT32_MAX));
    } else {
        mongoc_write_concern_set_w(wc, (int32_t)w);
    }
    if (wtimeout_ms > 0) {
        mongoc_write_concern_set_wtimeout_int64(wc, (int64_t)wtimeout_ms);
    }
    *out = wc;
    return 0;
}

static bool loopback(const char *host, int family) {
    return family == AF_UNIX || strchr(host, '/') != NULL || strcasecmp(host, "localhost") == 0 ||
           strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0;
}

void bd_mongo_uri_warnings(const char *s, const char *what, bd_mongo_warn_cb cb, void *arg) {
    static const struct {
        const char *key, *name, *why;
    } weak[] = {
        {MONGOC_URI_TLSINSECURE, "tlsInsecure",
         "the server's certificate and host name are not checked"},
        {MONGOC_URI_TLSALLOWINVALIDCERTIFICATES, "tlsAllowInvalidCertificates",
         "the server's certificate is not checked"},
        {MONGOC_URI_TLSALLOWINVALIDHOSTNAMES, "tlsAllowInvalidHostnames",
         "the server's host name is not checked against its certificate"},
    };
    char msg[512];
    bson_error_t berr;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(s, &berr);
    if (uri == NULL) {
        return; /* refused by bd_mongo_uri_check already */
    }
    for (size_t i = 0; i < BD_ARRAY_LEN(weak); i++) {
        if (mongoc_uri_get_option_as_bool(uri, weak[i].key, false)) {
            snprintf(msg, sizeof(msg),
                     "%s: %s=true: %s, so anyone on the network path can pose as MongoDB and "
                     "read the credentials and the data; use it for tests only",
                     what, weak[i].name, weak[i].why);
            cb(arg, msg);
        }
    }
    const char *mech = mongoc_uri_get_auth_mechanism(uri);
    bool creds = mongoc_uri_get_username(uri) != NULL || mech != NULL;
    if (creds && !mongoc_uri_get_tls(uri)) {
        const char *far = NULL;
        const char *srv = mongoc_uri_get_srv_hostname(uri);
        if (srv != NULL) {
            far = srv;
        }
        for (const mongoc_host_list_t *h = mongoc_uri_get_hosts(uri); h != NULL && far == NULL;
             h = h->next) {
            far = loopback(h->host, h->family) ? NULL : h->host;
        }
        if (far != NULL) {
            snprintf(msg, sizeof(msg),
                     "%s: credentials (authMechanism %s) go to %s without TLS: %s; add "
                     "tls=true",
                     what, mech != NULL ? mech : "default, SCRAM", far,
                     mech != NULL && strcasecmp(mech, "PLAIN") == 0
                         ? "PLAIN sends the password itself in clear"
                         : "anyone on the path can read the data and try the password "
                           "exchange offline");
            cb(arg, msg);
        }
    }
    mongoc_uri_destroy(uri);
}
