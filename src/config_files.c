/*
 * The files around a configuration (src/config_files.h): the configuration file read whole,
 * the credential files it names read into the URI the daemon connects with, a listener's TLS
 * files built once as a trial, and (bd_config_warnings, config.h) whether a file holding the
 * MongoDB password is readable by more than the daemon.
 *
 * Runs on the thread that loads a configuration (the main thread). Buffers that held a secret
 * are zeroed before they are freed; nothing outlives a call. Calls only down: the schema's URI
 * rule, src/creds.c, src/tls.c and src/mongo.c.
 */
#include "config_files.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/creds.h"
#include "bucketd/mongo.h"
#include "bucketd/tls.h"
#include "config_schema.h"

/* A config file is a few KiB; anything this large is a wrong path, not a config. */
#define MAX_FILE_BYTES (1024 * 1024)

int config_files_read(const char *path, char **out, size_t *out_len, struct bd_err *err) {
    char *buf = NULL;
    size_t len = 0;
    int fd = -1;
    int rc = 0;

    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
        goto out;
    }
    buf = malloc(MAX_FILE_BYTES + 1);
    if (buf == NULL) {
        rc = bd_err_set(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (;;) {
        ssize_t n = read(fd, buf + len, MAX_FILE_BYTES + 1 - len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
            goto out;
        }
        if (n == 0) {
            break;
        }
        len += (size_t)n;
        if (len > MAX_FILE_BYTES) {
            rc = bd_err_set(err, -EFBIG, "%s: larger than %d bytes; is this a config file?", path,
                            MAX_FILE_BYTES);
            goto out;
        }
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    buf = NULL;
out:
    free(buf);
    if (fd >= 0) {
        close(fd);
    }
    return rc;
}

/* -EINVAL with *key and err->msg set: key is at fault, for the reason fmt gives. */
static int refuse(const char **key, const char *which, struct bd_err *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int refuse(const char **key, const char *which, struct bd_err *err, const char *fmt, ...) {
    char msg[sizeof(err->msg)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    *key = which;
    return bd_err_set(err, -EINVAL, "%s", msg);
}

/*
 * At most one place holds the password. Files are read now, so --check-config and a reload see
 * a missing or unreadable one.
 */
int config_files_resolve_uri(struct bd_config *cfg, const char *config_path, bool uri_set,
                             const char **key, struct bd_err *err) {
    char *text = NULL, *pw = NULL;
    struct bd_err e = {0};
    int rc = 0;

    *key = NULL;
    cfg->mongodb.uri_file_path[0] = cfg->mongodb.password_file_path[0] = '\0';
    snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", cfg->mongodb.uri_given);
    if (cfg->mongodb.uri_file[0] == '\0' && cfg->mongodb.password_file[0] == '\0') {
        return 0;
    }
    text = malloc(BD_CREDS_MAX_FILE + 1);
    pw = malloc(BD_CREDS_MAX_FILE + 1);
    if (text == NULL || pw == NULL) {
        rc = bd_err_set(err, -ENOMEM, "%s: out of memory", config_path);
        goto out;
    }
    if (cfg->mongodb.uri_file[0] != '\0') {
        const char *uf = "mongodb.uri_file";
        const char *path = cfg->mongodb.uri_file_path;
        if (uri_set) {
            rc = refuse(key, uf, err, "give mongodb.uri or mongodb.uri_file, not both");
            goto out;
        }
        if (bd_creds_path(cfg->mongodb.uri_file, config_path, cfg->mongodb.uri_file_path,
                          sizeof(cfg->mongodb.uri_file_path), &e) < 0 ||
            bd_creds_read(NULL, path, text, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = refuse(key, uf, err, "%s", e.msg);
            goto out;
        }
        const char *why = config_schema_check_uri(text);
        if (why != NULL) {
            rc = refuse(key, uf, err, "%s: %s", path, why);
            goto out;
        }
        if (strlen(text) >= sizeof(cfg->mongodb.uri)) {
            rc = refuse(key, uf, err, "%s: longer than %zu bytes", path,
                        sizeof(cfg->mongodb.uri) - 1);
            goto out;
        }
        snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", text);
    }
    if (cfg->mongodb.password_file[0] != '\0') {
        const char *pf = "mongodb.password_file";
        const char *path = cfg->mongodb.password_file_path;
        const char *from = cfg->mongodb.uri_file[0] != '\0' ? "mongodb.uri_file" : "mongodb.uri";
        if (bd_creds_path(cfg->mongodb.password_file, config_path, cfg->mongodb.password_file_path,
                          sizeof(cfg->mongodb.password_file_path), &e) < 0 ||
            bd_creds_read(NULL, path, pw, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = refuse(key, pf, err, "%s", e.msg);
            goto out;
        }
        if (bd_uri_add_password(cfg->mongodb.uri, pw, text, BD_CREDS_MAX_FILE + 1, &e) < 0) {
            rc = refuse(key, pf, err, "%s (%s)", e.msg, from);
            goto out;
        }
        const char *why = config_schema_check_uri(text);
        if (why != NULL) {
            rc = refuse(key, pf, err, "%s with this password: %s", from, why);
            goto out;
        }
        snprintf(cfg->mongodb.uri, sizeof(cfg->mongodb.uri), "%s", text);
    }
out:
    /* Both buffers held secrets. */
    if (text != NULL) {
        explicit_bzero(text, BD_CREDS_MAX_FILE + 1);
    }
    if (pw != NULL) {
        explicit_bzero(pw, BD_CREDS_MAX_FILE + 1);
    }
    free(text);
    free(pw);
    return rc;
}

int config_files_tls_trial(const struct bd_listener_config *lc, const char **bad,
                           struct bd_err *err) {
    struct bd_tls_ctx *ctx = NULL;
    int rc = bd_tls_ctx_new(&ctx, lc, bad, err);
    if (rc < 0) {
        return rc;
    }
    bd_tls_ctx_free(ctx);
    return 0;
}

void bd_config_warnings(const struct bd_config *cfg, bd_config_warn_cb cb, void *arg) {
    char why[160], msg[1400];
    const char *files[3] = {NULL, NULL, NULL};
    const char *keys[3] = {NULL, NULL, NULL};
    size_t n = 0;
    if (bd_uri_has_password(cfg->mongodb.uri_given) && cfg->mongodb.uri_file[0] == '\0') {
        files[n] = cfg->path;
        keys[n++] = "the configuration file (mongodb.uri)";
    }
    if (cfg->mongodb.uri_file[0] != '\0' && cfg->mongodb.password_file[0] == '\0' &&
        bd_uri_has_password(cfg->mongodb.uri)) {
        files[n] = cfg->mongodb.uri_file_path;
        keys[n++] = "mongodb.uri_file";
    }
    if (cfg->mongodb.password_file[0] != '\0') {
        files[n] = cfg->mongodb.password_file_path;
        keys[n++] = "mongodb.password_file";
    }
    for (size_t i = 0; i < n; i++) {
        if (bd_creds_exposed(files[i], why, sizeof(why))) {
            snprintf(msg, sizeof(msg),
                     "%s: %s holds the MongoDB password and is %s: let only root and the "
                     "daemon read it (mode 0640 with group bucketd, or 0600 owned by the "
                     "daemon's user)%s",
                     files[i], keys[i], why,
                     files[i] == cfg->path ? ", or move the password to mongodb.password_file "
                                             "or a systemd credential (README: Credentials)"
                                           : "");
            cb(arg, msg);
        }
    }
    bd_mongo_uri_warnings(cfg->mongodb.uri,
                          cfg->mongodb.uri_file[0] != '\0' ? "mongodb.uri_file" : "mongodb.uri", cb,
                          arg);
    /* Not an error: a file that set limits.sensor_idle low before metrics.silent_after existed
     * must still load with the new key's default. */
    if (cfg->metrics.silent_after_ms > 0 && cfg->limits.sensor_idle_ms > 0 &&
        cfg->metrics.silent_after_ms >= cfg->limits.sensor_idle_ms) {
        char a[32], b[32];
        bd_units_format_duration_ms(cfg->metrics.silent_after_ms, a, sizeof(a));
        bd_units_format_duration_ms(cfg->limits.sensor_idle_ms, b, sizeof(b));
        snprintf(msg, sizeof(msg),
                 "metrics.silent_after (%s) is not below limits.sensor_idle (%s): a sensor is "
                 "forgotten before it counts as silent, so bucketd_sensors_silent stays 0",
                 a, b);
        cb(arg, msg);
    }
}
