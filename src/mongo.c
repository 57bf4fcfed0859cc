/*
 * MongoDB connection settings shared by the daemon (flusher) and the tools. Stateless.
 */
#include "bucketd/mongo.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void default_option(mongoc_uri_t *uri, const char *key, int32_t value) {
    if (!mongoc_uri_has_option(uri, key)) {
        mongoc_uri_set_option_as_int32(uri, key, value);
    }
}

mongoc_uri_t *bd_mongo_uri_new(const char *s, struct bd_err *err) {
    bson_error_t berr;
    mongoc_uri_t *uri = mongoc_uri_new_with_error(s, &berr);
    if (uri == NULL) {
        bd_err_set(err, -EINVAL, "mongodb.uri: %s", berr.message);
        return NULL;
    }
    default_option(uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 2000);
    default_option(uri, MONGOC_URI_CONNECTTIMEOUTMS, 2000);
    default_option(uri, MONGOC_URI_SOCKETTIMEOUTMS, 10000);
    return uri;
}

int bd_mongo_write_concern_new(const char *s, mongoc_write_concern_t **out, struct bd_err *err) {
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
        mongoc_write_concern_set_wmajority(wc, 0);
    } else {
        mongoc_write_concern_set_w(wc, (int32_t)w);
    }
    *out = wc;
    return 0;
}
