/*
 * MongoDB connection settings shared by the daemon (flusher) and the tools. Stateless.
 */
#include "bucketd/mongo.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
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

static mongoc_uri_t *parse_uri(const char *s, struct bd_err *err) {
    bson_error_t berr;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(s, &berr);
    if (uri == NULL) {
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
