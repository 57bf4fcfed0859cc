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

/* The same checks without keeping the result, for config validation: syntax, options, and
 * that TLS files named in it (tlsCAFile, tlsCertificateKeyFile, tlsCRLFile) are readable. */
int bd_mongo_uri_check(const char *uri, struct bd_err *err);

/*
 * "1", "majority" or N >= 1; "0" and anything else is -EINVAL. wtimeout_ms > 0 bounds how long
 * the server waits for the replication it asks for (an expiry is a write-concern error, which
 * the flusher retries).
 */
int bd_mongo_write_concern_new(const char *s, uint64_t wtimeout_ms, mongoc_write_concern_t **out,
                               struct bd_err *err);

#endif
