/*
 * Error out-parameter, assertions and clocks shared by every module. Stateless; any thread.
 */
#include "bucketd/common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int bd_err_set(struct bd_err *err, int code, const char *fmt, ...) {
    if (err != NULL) {
        va_list ap;
        va_start(ap, fmt);
        err->code = code;
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}

_Noreturn void bd_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "<2>bucketd: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

static int64_t clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * BD_NS_PER_S + ts.tv_nsec;
}

int64_t bd_now_ns(void) {
    return clock_ns(CLOCK_REALTIME);
}

int64_t bd_mono_ns(void) {
    return clock_ns(CLOCK_MONOTONIC);
}

int bd_write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int bd_mkdir_p(const char *dir, mode_t mode, struct bd_err *err) {
    char p[4096];
    if (snprintf(p, sizeof(p), "%s", dir) >= (int)sizeof(p)) {
        return bd_err_set(err, -ENAMETOOLONG, "spool.dir %s: path too long", dir);
    }
    for (char *c = p + 1; *c != '\0'; c++) {
        if (*c != '/') {
            continue;
        }
        *c = '\0';
        if (mkdir(p, mode) < 0 && errno != EEXIST) {
            int e = errno;
            return bd_err_set(err, -e, "spool.dir %s: cannot create %s: %s", dir, p, strerror(e));
        }
        *c = '/';
    }
    if (mkdir(p, mode) < 0 && errno != EEXIST) {
        int e = errno;
        return bd_err_set(err, -e, "spool.dir %s: cannot create: %s", dir, strerror(e));
    }
    return 0;
}

int bd_replace_file(const char *dir, const char *path, const char *tmp, const void *buf, size_t len,
                    mode_t mode, struct bd_err *err) {
    int rc = 0;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) {
        return bd_err_set(err, -errno, "%s: %s", tmp, strerror(errno));
    }
    rc = bd_write_all(fd, buf, len);
    if (rc == 0 && fsync(fd) < 0) {
        rc = -errno;
    }
    if (close(fd) < 0 && rc == 0) {
        rc = -errno;
    }
    if (rc == 0 && rename(tmp, path) < 0) {
        rc = -errno;
    }
    if (rc == 0) {
        /* The rename itself must be durable, or a crash could bring back the older file. */
        int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0 || fsync(dfd) < 0) {
            rc = -errno;
        }
        if (dfd >= 0) {
            close(dfd);
        }
    }
    if (rc < 0) {
        unlink(tmp);
        return bd_err_set(err, rc, "cannot write %s: %s", path, strerror(-rc));
    }
    return 0;
}
