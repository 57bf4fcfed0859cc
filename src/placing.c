/*
 * The placing journal (include/bucketd/placing.h): one file beside the spool holding the placed
 * form of the unplaced record being replayed. Flusher thread only.
 */
#include "bucketd/placing.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/alloc.h"
#include "bucketd/crc32c.h"

#define MAGIC "BDPLACE1"
#define VERSION 1
#define HDR BD_PLACING_HEADER_BYTES
#define TMP_FILE "placing.rec.tmp"

static int paths(const char *dir, char *path, char *tmp, size_t cap) {
    int a = snprintf(path, cap, "%s/%s", dir, BD_PLACING_FILE);
    int b = snprintf(tmp, cap, "%s/%s", dir, TMP_FILE);
    return a < 0 || b < 0 || (size_t)a >= cap || (size_t)b >= cap ? -ENAMETOOLONG : 0;
}

static uint32_t check(const uint8_t *h, const uint8_t *data, size_t len) {
    return bd_crc32c(bd_crc32c(0, h, 48), data, len);
}

int bd_placing_save(const char *dir, const struct bd_placing *p, struct bd_err *err) {
    char path[PATH_MAX], tmp[PATH_MAX];
    if (paths(dir, path, tmp, sizeof(path)) < 0) {
        return bd_err_set(err, -ENAMETOOLONG, "%s: path too long", dir);
    }
    if (p->len > UINT32_MAX) {
        return bd_err_set(err, -EMSGSIZE, "placed record too large (%zu bytes)", p->len);
    }
    uint8_t *buf = bd_malloc(HDR + p->len);
    if (buf == NULL) {
        return bd_err_set(err, -ENOMEM, "out of memory writing %s", path);
    }
    memset(buf, 0, HDR);
    memcpy(buf, MAGIC, 8);
    bd_put_le32(buf + 8, VERSION);
    bd_put_le32(buf + 12, HDR);
    bd_put_le64(buf + 16, p->segment);
    bd_put_le64(buf + 24, p->offset);
    bd_put_le64(buf + 32, p->seq);
    bd_put_le32(buf + 40, p->n_readings);
    bd_put_le32(buf + 44, (uint32_t)p->len);
    if (p->len > 0) {
        memcpy(buf + HDR, p->data, p->len);
    }
    bd_put_le32(buf + 48, check(buf, buf + HDR, p->len));
    int rc = bd_replace_file(dir, path, tmp, buf, HDR + p->len, 0600, err);
    free(buf);
    return rc;
}

int bd_placing_load(const char *dir, struct bd_placing *p, struct bd_err *err) {
    memset(p, 0, sizeof(*p));
    char path[PATH_MAX], tmp[PATH_MAX];
    if (paths(dir, path, tmp, sizeof(path)) < 0) {
        return bd_err_set(err, -ENAMETOOLONG, "%s: path too long", dir);
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return bd_err_set(err, e == ENOENT ? -ENOENT : -e, "%s: %s", path, strerror(e));
    }
    struct stat st;
    uint8_t h[HDR];
    int rc = 0;
    if (fstat(fd, &st) < 0) {
        rc = -errno;
    } else if (st.st_size < HDR || pread(fd, h, HDR, 0) != HDR) {
        rc = -EBADMSG;
        bd_err_set(err, rc, "%s: too short", path);
    } else if (memcmp(h, MAGIC, 8) != 0 || bd_get_le32(h + 8) != VERSION ||
               bd_get_le32(h + 12) != HDR ||
               (uint64_t)st.st_size != HDR + (uint64_t)bd_get_le32(h + 44)) {
        rc = -EBADMSG;
        bd_err_set(err, rc, "%s: not a placing journal of this version, or torn", path);
    }
    if (rc == 0) {
        p->len = bd_get_le32(h + 44);
        p->data = bd_malloc(p->len ? p->len : 1);
        if (p->data == NULL) {
            rc = bd_err_set(err, -ENOMEM, "out of memory reading %s", path);
        } else if (p->len > 0 && pread(fd, p->data, p->len, HDR) != (ssize_t)p->len) {
            rc = bd_err_set(err, -EIO, "%s: cannot read it whole", path);
        } else if (bd_get_le32(h + 48) != check(h, p->data, p->len)) {
            rc = bd_err_set(err, -EBADMSG, "%s: checksum mismatch", path);
        }
    } else if (rc != -EBADMSG) {
        bd_err_set(err, rc, "%s: %s", path, strerror(-rc));
    }
    close(fd);
    if (rc < 0) {
        bd_placing_clear(p);
        return rc;
    }
    p->segment = bd_get_le64(h + 16);
    p->offset = bd_get_le64(h + 24);
    p->seq = bd_get_le64(h + 32);
    p->n_readings = bd_get_le32(h + 40);
    return 0;
}

int bd_placing_remove(const char *dir) {
    char path[PATH_MAX], tmp[PATH_MAX];
    if (paths(dir, path, tmp, sizeof(path)) < 0) {
        return -ENAMETOOLONG;
    }
    (void)unlink(tmp);
    if (unlink(path) < 0) {
        return errno == ENOENT ? 0 : -errno;
    }
    return 0;
}

void bd_placing_clear(struct bd_placing *p) {
    free(p->data);
    memset(p, 0, sizeof(*p));
}
