/*
 * Lines held while the wall clock cannot be trusted (include/bucketd/hold.h): a FIFO of entries
 * in one growing buffer (header and text back to back), consumed from its head; the consumed
 * part is reclaimed when it passes half of the buffer. Ingest thread only.
 */
#include "bucketd/hold.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/alloc.h"
#include "bucketd/crc32c.h"

#define ENTRY_HDR 16 /* u32 length, u8 format, u8 precision, u8 kind, u8 0, i64 stamp */
#define FILE_MAGIC "BDHELD01"
#define FILE_HDR 72 /* magic, u32 entries, u32 0, boot id[40], i64 wall, i64 boot */
#define TMP_FILE "held.lines.tmp"
#define BAD_FILE "held.lines.bad"

struct bd_hold {
    uint8_t *buf;
    size_t head, len, cap; /* entries in [head, len) */
    size_t max_bytes;
    uint64_t n;
};

int bd_hold_new(struct bd_hold **out, size_t max_bytes) {
    struct bd_hold *h = bd_calloc(1, sizeof(*h));
    if (h == NULL) {
        return -ENOMEM;
    }
    h->max_bytes = max_bytes;
    *out = h;
    return 0;
}

void bd_hold_free(struct bd_hold *h) {
    if (h != NULL) {
        free(h->buf);
        free(h);
    }
}

void bd_hold_set_max_bytes(struct bd_hold *h, size_t max_bytes) {
    h->max_bytes = max_bytes;
}

uint64_t bd_hold_count(const struct bd_hold *h) {
    return h->n;
}

size_t bd_hold_bytes(const struct bd_hold *h) {
    return h->len - h->head;
}

int bd_hold_add(struct bd_hold *h, const struct bd_hold_line *l) {
    size_t need = ENTRY_HDR + l->len;
    if (l->len > UINT32_MAX || bd_hold_bytes(h) + need > h->max_bytes) {
        return -ENOSPC;
    }
    if (h->head > 0 && h->head >= h->len / 2) {
        memmove(h->buf, h->buf + h->head, h->len - h->head);
        h->len -= h->head;
        h->head = 0;
    }
    if (h->len + need > h->cap) {
        size_t cap = h->cap ? h->cap : 64 * 1024;
        while (cap < h->len + need) {
            cap *= 2;
        }
        uint8_t *buf = bd_realloc(h->buf, cap);
        if (buf == NULL) {
            return -ENOMEM;
        }
        h->buf = buf;
        h->cap = cap;
    }
    uint8_t *p = h->buf + h->len;
    bd_put_le32(p, (uint32_t)l->len);
    p[4] = l->format;
    p[5] = l->precision;
    p[6] = l->kind;
    p[7] = 0;
    bd_put_le64(p + 8, (uint64_t)l->stamp_ns);
    memcpy(p + ENTRY_HDR, l->line, l->len);
    h->len += need;
    h->n++;
    return 0;
}

int bd_hold_peek(const struct bd_hold *h, struct bd_hold_line *out) {
    if (h->n == 0) {
        return -ENOENT;
    }
    const uint8_t *p = h->buf + h->head;
    *out = (struct bd_hold_line){.format = p[4],
                                 .precision = p[5],
                                 .kind = p[6],
                                 .stamp_ns = (int64_t)bd_get_le64(p + 8),
                                 .line = (const char *)p + ENTRY_HDR,
                                 .len = bd_get_le32(p)};
    return 0;
}

void bd_hold_pop(struct bd_hold *h) {
    if (h->n == 0) {
        return;
    }
    h->head += ENTRY_HDR + bd_get_le32(h->buf + h->head);
    h->n--;
    if (h->n == 0) {
        h->head = h->len = 0;
    }
}

void bd_hold_boot_id(char id[40]) {
    memset(id, 0, 40);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL) {
        return;
    }
    if (fgets(id, 40, f) == NULL) {
        id[0] = '\0';
    }
    fclose(f);
    id[strcspn(id, "\n")] = '\0';
}

static int path_of(const char *dir, const char *name, char *out) {
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
    return n < 0 || n >= PATH_MAX ? -ENAMETOOLONG : 0;
}

int bd_hold_save(const struct bd_hold *h, const char *dir, const char *boot_id, int64_t wall_ns,
                 int64_t boot_ns, struct bd_err *err) {
    char path[PATH_MAX], tmp[PATH_MAX];
    if (path_of(dir, BD_HOLD_FILE, path) < 0 || path_of(dir, TMP_FILE, tmp) < 0) {
        return bd_err_set(err, -ENAMETOOLONG, "%s: path too long", dir);
    }
    if (h->n == 0) {
        return unlink(path) < 0 && errno != ENOENT
                   ? bd_err_set(err, -errno, "%s: %s", path, strerror(errno))
                   : 0;
    }
    size_t body = bd_hold_bytes(h);
    uint8_t *buf = bd_malloc(FILE_HDR + body + 4);
    if (buf == NULL) {
        return bd_err_set(err, -ENOMEM, "out of memory saving %s", path);
    }
    memset(buf, 0, FILE_HDR);
    memcpy(buf, FILE_MAGIC, 8);
    bd_put_le32(buf + 8, (uint32_t)BD_MIN(h->n, (uint64_t)UINT32_MAX));
    snprintf((char *)buf + 16, 40, "%s", boot_id);
    bd_put_le64(buf + 56, (uint64_t)wall_ns);
    bd_put_le64(buf + 64, (uint64_t)boot_ns);
    memcpy(buf + FILE_HDR, h->buf + h->head, body);
    bd_put_le32(buf + FILE_HDR + body, bd_crc32c(0, buf, FILE_HDR + body));
    int rc = bd_replace_file(dir, path, tmp, buf, FILE_HDR + body + 4, 0600, err);
    free(buf);
    return rc;
}

int bd_hold_load(struct bd_hold *h, const char *dir, const char *boot_id, uint64_t *n_lines,
                 uint64_t *n_dropped, struct bd_err *err) {
    *n_lines = *n_dropped = 0;
    char path[PATH_MAX], bad[PATH_MAX];
    if (path_of(dir, BD_HOLD_FILE, path) < 0 || path_of(dir, BAD_FILE, bad) < 0) {
        return bd_err_set(err, -ENAMETOOLONG, "%s: path too long", dir);
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return errno == ENOENT ? 0 : bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
    }
    struct stat st;
    uint8_t *buf = NULL;
    int rc = 0;
    if (fstat(fd, &st) < 0) {
        rc = bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
    } else if (st.st_size < FILE_HDR + 4 || (buf = bd_malloc((size_t)st.st_size)) == NULL) {
        rc = st.st_size < FILE_HDR + 4 ? bd_err_set(err, -EBADMSG, "%s: too short", path)
                                       : bd_err_set(err, -ENOMEM, "out of memory reading %s", path);
    } else if (pread(fd, buf, (size_t)st.st_size, 0) != st.st_size) {
        rc = bd_err_set(err, -EIO, "%s: cannot read it whole", path);
    }
    close(fd);
    size_t size = (size_t)st.st_size;
    if (rc == 0 && (memcmp(buf, FILE_MAGIC, 8) != 0 ||
                    bd_get_le32(buf + size - 4) != bd_crc32c(0, buf, size - 4))) {
        rc = bd_err_set(err, -EBADMSG, "%s: not a held-lines file, or damaged", path);
    }
    /* Check every entry before taking any, so a bad file takes nothing. */
    uint64_t entries = 0;
    for (size_t at = FILE_HDR; rc == 0 && at < size - 4; entries++) {
        if (size - 4 - at < ENTRY_HDR || bd_get_le32(buf + at) > size - 4 - at - ENTRY_HDR) {
            rc =
                bd_err_set(err, -EBADMSG, "%s: entry %" PRIu64 " runs past the end", path, entries);
        }
        at += ENTRY_HDR + (rc == 0 ? bd_get_le32(buf + at) : 0);
    }
    if (rc == -EBADMSG) {
        (void)rename(path, bad);
    }
    if (rc < 0) {
        free(buf);
        return rc;
    }
    char saved_id[41] = {0};
    memcpy(saved_id, buf + 16, 40);
    bool same_boot = saved_id[0] != '\0' && strcmp(saved_id, boot_id) == 0;
    int64_t saved_wall = (int64_t)bd_get_le64(buf + 56);
    int64_t saved_boot = (int64_t)bd_get_le64(buf + 64);
    for (size_t at = FILE_HDR; at < size - 4;) {
        const uint8_t *p = buf + at;
        struct bd_hold_line l = {.format = p[4],
                                 .precision = p[5],
                                 .kind = p[6],
                                 .stamp_ns = (int64_t)bd_get_le64(p + 8),
                                 .line = (const char *)p + ENTRY_HDR,
                                 .len = bd_get_le32(p)};
        if (!same_boot && l.kind == BD_HOLD_BOOT) {
            /* Another boot: its boot-time stamp means nothing now; the wall time it arrived
             * at, by the untrusted clock of the save, is the best there is. */
            l.kind = BD_HOLD_WALL;
            l.stamp_ns = saved_wall - (saved_boot - l.stamp_ns);
        }
        /* A line the hold cannot take (full, out of memory) is dropped, counted by the caller. */
        if (bd_hold_add(h, &l) == 0) {
            (*n_lines)++;
        } else {
            (*n_dropped)++;
        }
        at += ENTRY_HDR + l.len;
    }
    free(buf);
    if (unlink(path) < 0) {
        rc = bd_err_set(err, -errno, "%s: taken back but cannot be removed: %s", path,
                        strerror(errno));
    }
    return rc;
}
