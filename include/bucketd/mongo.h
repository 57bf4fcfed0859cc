/*
 * MongoDB connection settings shared by the daemon and the tools, so that bucketd-inspect
 * connects exactly as bucketd does. Stateless helpers; any thread.
 */
#ifndef BUCKETD_MONGO_H
#define BUCKETD_MONGO_H

#include <mongoc/mongoc.h>

#include "bucketd/common.h"

/*
 * Parse a MongoDB URI and apply bucketd's defaults for the options it does not set:
 * serverSelectionTimeoutMS=2000, connectTimeoutMS=2000, socketTimeoutMS=10000 (a dead server
 * must not stall a flush for the driver's 30 s default). NULL and err filled on a bad URI.
 */
mongoc_uri_t *bd_mongo_uri_new(const char *uri, struct bd_err *err);

/* The same checks without keeping the result, for config validation: syntax, options (an
 * option the driver does not know is refused: it would ignore it), and that TLS files named in
 * it (tlsCAFile, tlsCertificateKeyFile, tlsCRLFile) are readable. Messages never hold the
 * password. */
int bd_mongo_uri_check(const char *uri, struct bd_err *err);

/*
 * Settings that work but weaken the connection, one sentence each, starting with what (e.g.
 * "mongodb.uri"): tlsInsecure, tlsAllowInvalidCertificates, tlsAllowInvalidHostnames (and
 * their ssl* aliases), and credentials (any authMechanism) sent without TLS to a host that is
 * not loopback.
 */
typedef void (*bd_mongo_warn_cb)(void *arg, const char *msg);
void bd_mongo_uri_warnings(const char *uri, const char *what, bd_mongo_warn_cb cb, void *arg);

/*
 * "1", "majority" or N >= 1; "0" and anything else is -EINVAL. wtimeout_ms > 0 bounds how long
 * the server waits for the replication it asks for (an expiry is a write-concern error, which
 * the flusher retries).
 */
int bd_mongo_write_concern_new(const char *s, uint64_t wtimeout_ms, mongoc_write_concern_t **out,
                               struct bd_err *err);

#endif
