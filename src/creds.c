/*
 * Credentials files and the password inside a MongoDB URI (include/bucketd/creds.h).
 * Stateless; any thread; nothing allocated outlives a call.
 */
#include "bucketd/creds.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int bd_creds_path(const char *name, const char *config_path, char *out, size_t cap,
                  struct bd_err *err) {
    int n;
    const char *creds = getenv("CREDENTIALS_DIRECTORY");
    if (name[0] == '/') {
        n = snprintf(out, cap, "%s", name);
    } else if (creds != NULL && creds[0] != '\0') {
        n = snprintf(out, cap, "%s/%s", creds, name);
    } else {
        const char *slash = strrchr(config_path, '/');
        if (slash == NULL) {
            n = snprintf(out, cap, "%s", name); /* the config is in the working directory */
        } else {
            n = snprintf(out, cap, "%.*s/%s", (int)(slash - config_path), config_path, name);
        }
    }
    if (n < 0 || (size_t)n >= cap) {
        return bd_err_set(err, -ENAMETOOLONG, "%s: path too long", name);
    }
    return 0;
}

static bool space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

int bd_creds_read(const char *what, const char *path, char *out, size_t cap, struct bd_err *err) {
    /* "--uri-file /p: ..." from a tool; "/p: ..." where the caller names the key itself. */
    const char *sep = what != NULL ? " " : "";
    what = what != NULL ? what : "";
    char buf[BD_CREDS_MAX_FILE + 1];
    size_t len = 0;
    int rc = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        return bd_err_set(err, -errno, "%s%s%s: %s", what, sep, path, strerror(errno));
    }
    for (;;) {
        ssize_t n = read(fd, buf + len, sizeof(buf) - len);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            rc = bd_err_set(err, -errno, "%s%s%s: %s", what, sep, path, strerror(errno));
            goto out;
        }
        if (n == 0) {
            break;
        }
        len += (size_t)n;
        if (len == sizeof(buf)) {
            rc = bd_err_set(err, -EFBIG, "%s%s%s: larger than %d bytes", what, sep, path,
                            BD_CREDS_MAX_FILE);
            goto out;
        }
    }
    if (memchr(buf, '\0', len) != NULL) {
        rc = bd_err_set(err, -EINVAL, "%s%s%s: holds a NUL byte", what, sep, path);
        goto out;
    }
    size_t start = 0;
    while (start < len && space(buf[start])) {
        start++;
    }
    while (len > start && space(buf[len - 1])) {
        len--;
    }
    if (len == start) {
        rc = bd_err_set(err, -EINVAL, "%s%s%s: empty", what, sep, path);
        goto out;
    }
    if (len - start >= cap) {
        rc = bd_err_set(err, -EFBIG, "%s%s%s: longer than %zu bytes", what, sep, path, cap - 1);
        goto out;
    }
    memcpy(out, buf + start, len - start);
    out[len - start] = '\0';
out:
    /* The buffer held a secret: do not leave it on the stack. */
    explicit_bzero(buf, sizeof(buf));
    close(fd);
    return rc;
}

/*
 * The user info of uri, as mongoc finds it: after "scheme://", up to the first '@' before the
 * first '/'. False if there is none.
 */
static bool userinfo(const char *uri, size_t *start, size_t *end) {
    const char *p = strstr(uri, "://");
    if (p == NULL) {
        return false;
    }
    p += 3;
    size_t auth = strcspn(p, "/");
    const char *at = memchr(p, '@', auth);
    if (at == NULL) {
        return false;
    }
    *start = (size_t)(p - uri);
    *end = (size_t)(at - uri);
    return true;
}

bool bd_uri_has_user(const char *uri) {
    size_t s, e;
    return userinfo(uri, &s, &e) && e > s && uri[s] != ':';
}

bool bd_uri_has_password(const char *uri) {
    size_t s, e;
    return userinfo(uri, &s, &e) && memchr(uri + s, ':', e - s) != NULL;
}

int bd_uri_add_password(const char *uri, const char *password, char *out, size_t cap,
                        struct bd_err *err) {
    static const char hex[] = "0123456789ABCDEF";
    size_t s, e, o = 0;
    if (!bd_uri_has_user(uri)) {
        return bd_err_set(err, -EINVAL,
                          "mongodb.uri names no user to go with the password (write "
                          "mongodb://USER@host/)");
    }
    if (bd_uri_has_password(uri)) {
        return bd_err_set(err, -EINVAL,
                          "mongodb.uri already holds a password: keep it in one place only");
    }
    userinfo(uri, &s, &e);
    size_t need = strlen(uri) + 1 + 3 * strlen(password) + 1;
    if (need > cap) {
        return bd_err_set(err, -ENAMETOOLONG, "the URI with the password is longer than %zu bytes",
                          cap - 1);
    }
    memcpy(out, uri, e);
    o = e;
    out[o++] = ':';
    /* RFC 3986 unreserved characters stay; everything else is percent-encoded. */
    for (const unsigned char *p = (const unsigned char *)password; *p != '\0'; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
            *p == '-' || *p == '.' || *p == '_' || *p == '~') {
            out[o++] = (char)*p;
        } else {
            out[o++] = '%';
            out[o++] = hex[*p >> 4];
            out[o++] = hex[*p & 0xf];
        }
    }
    snprintf(out + o, cap - o, "%s", uri + e);
    return 0;
}

void bd_uri_redact(const char *uri, char *out, size_t cap) {
    size_t s, e;
    const char *colon = NULL;
    if (userinfo(uri, &s, &e)) {
        colon = memchr(uri + s, ':', e - s);
    }
    if (colon == NULL) {
        snprintf(out, cap, "%s", uri);
        return;
    }
    snprintf(out, cap, "%.*s:*****%s", (int)(colon - uri), uri, uri + e);
}

/* Whether the daemon's process is in group gid (its own group or a supplementary one). */
static bool in_group(gid_t gid) {
    gid_t groups[256];
    if (gid == getegid()) {
        return true;
    }
    int n = getgroups((int)BD_ARRAY_LEN(groups), groups);
    for (int i = 0; i < n; i++) {
        if (groups[i] == gid) {
            return true;
        }
    }
    return false;
}

bool bd_creds_exposed(const char *path, char *why, size_t cap) {
    struct stat st;
    if (stat(path, &st) < 0) {
        return false;
    }
    unsigned mode = (unsigned)st.st_mode & 07777;
    if (st.st_mode & S_IROTH) {
        snprintf(why, cap, "mode %04o, readable by every local user", mode);
        return true;
    }
    if ((st.st_mode & S_IRGRP) && !in_group(st.st_gid)) {
        struct group *g = getgrgid(st.st_gid);
        char name[64];
        if (g != NULL) {
            snprintf(name, sizeof(name), "%s", g->gr_name);
        } else {
            snprintf(name, sizeof(name), "%u", (unsigned)st.st_gid);
        }
        snprintf(why, cap, "mode %04o, readable by group %s, which the daemon is not in", mode,
                 name);
        return true;
    }
    return false;
}
