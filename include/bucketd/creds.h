/*
 * Where the MongoDB password lives: the files named by mongodb.uri_file and
 * mongodb.password_file (README "Credentials"), the URI text around a password, and whether a
 * file holding one is readable by more than the daemon. Stateless; any thread; used by the
 * config loader, the daemon's start and bucketd-inspect.
 */
#ifndef BUCKETD_CREDS_H
#define BUCKETD_CREDS_H

#include <stdbool.h>
#include <stddef.h>

#include "bucketd/common.h"

/* A secret file is a URI or a password: anything bigger is the wrong file. */
#define BD_CREDS_MAX_FILE 4096

/*
 * The path a credentials file name stands for: an absolute name as it is; a relative one in
 * $CREDENTIALS_DIRECTORY when it is set (systemd's LoadCredential=), else in the directory of
 * config_path (the config file naming it). -ENAMETOOLONG if it does not fit in cap.
 */
int bd_creds_path(const char *name, const char *config_path, char *out, size_t cap,
                  struct bd_err *err);

/*
 * Read a credentials file into out (NUL-terminated), without the whitespace around it (an
 * editor's trailing newline). Errors name what (e.g. "--uri-file"; NULL: nothing, the caller
 * names it) and the path: unreadable, empty, larger than BD_CREDS_MAX_FILE or cap, or holding
 * a NUL.
 */
int bd_creds_read(const char *what, const char *path, char *out, size_t cap, struct bd_err *err);

/* The URI's user info, as mongoc reads it: a password is present after a ':' in it. */
bool bd_uri_has_user(const char *uri);
bool bd_uri_has_password(const char *uri);

/*
 * uri (naming a user and no password) with password percent-encoded into its user info, in
 * out. -EINVAL (err says why) if uri names no user or already has a password; -ENAMETOOLONG.
 */
int bd_uri_add_password(const char *uri, const char *password, char *out, size_t cap,
                        struct bd_err *err);

/* uri with its password, if any, replaced by "*****": for logs, errors and dumps. */
void bd_uri_redact(const char *uri, char *out, size_t cap);

/*
 * Whether a file holding a password is readable by more than the daemon: by others, or by a
 * group that is neither the daemon's group nor one it is in (a root:bucketd 0640 file is
 * right: the group exists for the daemon). True, and why filled ("mode 0644, readable by
 * others"), when it is; false too when the file cannot be examined (reading it reports that).
 */
bool bd_creds_exposed(const char *path, char *why, size_t cap);

#endif
