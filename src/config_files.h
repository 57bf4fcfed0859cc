/*
 * The files around a configuration (src/config_files.c): the configuration file itself, the
 * credential files it names (mongodb.uri_file, mongodb.password_file: read into the URI the
 * daemon connects with, and checked for who may read them: bd_config_warnings, config.h) and the
 * TLS files of a listener (built into a context once, as a trial). The loader (src/config.c) calls these; their
 * messages carry no position, which the loader adds. They call only down: the schema's URI rule
 * (src/config_schema.c), src/creds.c, src/tls.c, src/mongo.c.
 *
 * Run on the thread that loads a configuration (the main thread); nothing here keeps state.
 */
#ifndef BUCKETD_CONFIG_FILES_H
#define BUCKETD_CONFIG_FILES_H

#include <stdbool.h>
#include <stddef.h>

#include "bucketd/common.h"
#include "bucketd/config.h"

/*
 * The whole configuration file, NUL-terminated, into *out (malloc'ed; the caller frees it) and
 * its length. -errno with err naming the path, or -EFBIG past 1 MiB (not a configuration).
 */
int config_files_read(const char *path, char **out, size_t *out_len, struct bd_err *err);

/*
 * The URI the daemon connects with (cfg->mongodb.uri): mongodb.uri or the content of
 * mongodb.uri_file, with the password of mongodb.password_file put into it; and where those
 * files were read from (cfg->mongodb.uri_file_path, password_file_path). config_path is the
 * configuration file (relative names are read beside it); uri_set says mongodb.uri was given in
 * it. On failure returns a negative errno and *key names the key at fault, err->msg saying why
 * (-EINVAL); or *key is NULL and err->msg is the whole message (-ENOMEM).
 */
int config_files_resolve_uri(struct bd_config *cfg, const char *config_path, bool uri_set,
                             const char **key, struct bd_err *err);

/*
 * A listener's TLS context built from its files and freed: a missing or unreadable file, bad
 * PEM or a key of another certificate fails the configuration, not the start. On failure *bad
 * names the tls key at fault ("cert", "key", "client_ca") and err->msg says why.
 */
int config_files_tls_trial(const struct bd_listener_config *lc, const char **bad,
                           struct bd_err *err);

#endif
