/*
 * Dead letters: bucket updates MongoDB refused for good, one canonical Extended JSON line each
 * in <spool.dir>/dead-letter.jsonl (the format and the reasoning are in deadletter.h).
 *
 * Flusher thread only after bd_deadletter_open; the struct holds nothing but the path. The file
 * is opened for every append and closed after it (O_APPEND, created 0600 when missing), so an
 * operator may move the file away while the daemon runs: the next refusal starts a new file.
 * Dead letters are rare, so an open, an fsync and a close per record cost nothing that matters.
 *
 * Torn tail: a crash (or a full disk) in the middle of an append can leave a last line without
 * its newline. Every open of the file checks the last byte, at start-up and before each append:
 * a tail that parses as a whole record only lacks its newline, which is added; anything else is
 * cut off (logged), so the next record starts on a line of its own and every line stays a record.
 * An append that fails half-way truncates the file back to where it started.
 */
#include "bucketd/deadletter.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/log.h"

/* Bytes read at a time when looking back for the last newline. */
#define SCAN_CHUNK 65536
/* A tail longer than this is not parsed to see whether it is a whole record: it is cut off. */
#define MAX_TAIL_PARSE (UINT64_C(64) << 20)

struct bd_deadletter {
    char dir[1024];
    char path[1100];
};

static int pread_all(int fd, char *buf, size_t len, off_t off) {
    while (len > 0) {
        ssize_t n = pread(fd, buf, len, off);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (n == 0) {
            return -EIO; /* the file shrank under us */
        }
        buf += n;
        len -= (size_t)n;
        off += n;
    }
    return 0;
}

/* Offset just past the last '\n' before `size` (0 if there is none). */
static int find_line_start(int fd, uint64_t size, uint64_t *out) {
    char *buf = malloc(SCAN_CHUNK);
    if (buf == NULL) {
        return -ENOMEM;
    }
    int rc = 0;
    uint64_t end = size;
    *out = 0;
    while (end > 0) {
        size_t n = (size_t)BD_MIN(end, (uint64_t)SCAN_CHUNK);
        rc = pread_all(fd, buf, n, (off_t)(end - n));
        if (rc < 0) {
            goto out;
        }
        char *nl = memrchr(buf, '\n', n);
        if (nl != NULL) {
            *out = end - n + (uint64_t)(nl - buf) + 1;
            goto out;
        }
        end -= n;
    }
out:
    free(buf);
    return rc;
}

/* Whether bytes [start, size) are one whole JSON object (a record without its newline). */
static bool tail_is_record(int fd, uint64_t start, uint64_t size) {
    uint64_t len = size - start;
    if (len > MAX_TAIL_PARSE) {
        return false;
    }
    bool whole = false;
    char *buf = malloc((size_t)len);
    if (buf != NULL && pread_all(fd, buf, (size_t)len, (off_t)start) == 0) {
        bson_t *doc = bson_new_from_json((const uint8_t *)buf, (ssize_t)len, NULL);
        whole = doc != NULL;
        bson_destroy(doc);
    }
    free(buf);
    return whole;
}

/*
 * Make the file end with a newline (or be empty), see the header comment. *size is the file's
 * size afterwards. fd is open read-write.
 */
static int repair_tail(int fd, const char *path, uint64_t *size, struct bd_err *err) {
    struct stat st;
    char last = '\n';
    int rc = 0;
    if (fstat(fd, &st) < 0) {
        return bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        return bd_err_set(err, -EINVAL, "%s: not a regular file", path);
    }
    *size = (uint64_t)st.st_size;
    if (*size > 0) {
        rc = pread_all(fd, &last, 1, (off_t)(*size - 1));
    }
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: %s", path, strerror(-rc));
    }
    if (last == '\n') {
        return 0;
    }
    uint64_t start = 0;
    rc = find_line_start(fd, *size, &start);
    if (rc < 0) {
        return bd_err_set(err, rc, "%s: %s", path, strerror(-rc));
    }
    if (tail_is_record(fd, start, *size)) {
        rc = bd_write_all(fd, "\n", 1);
        if (rc == 0 && fsync(fd) < 0) {
            rc = -errno;
        }
        if (rc < 0) {
            return bd_err_set(err, rc, "%s: cannot end the last record with a newline: %s", path,
                              strerror(-rc));
        }
        bd_warn("%s: the last record had no newline (an interrupted write); added one", path);
        *size += 1;
        return 0;
    }
    if (ftruncate(fd, (off_t)start) < 0 || fsync(fd) < 0) {
        return bd_err_set(err, -errno, "%s: cannot cut off a torn last line: %s", path,
                          strerror(errno));
    }
    bd_warn("%s: cut off a torn last line of %" PRIu64 " bytes at offset %" PRIu64
            " (an interrupted write; that record is lost)",
            path, *size - start, start);
    *size = start;
    return 0;
}

static int sync_dir(const char *dir) {
    int rc = 0;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) < 0) {
        rc = -errno;
    }
    if (dfd >= 0) {
        close(dfd);
    }
    return rc;
}

/*
 * Open the file read-write for appending, creating it (0600, the directory entry synced) when
 * missing, and repair its tail. *fd is -1 on error.
 */
static int open_file(const struct bd_deadletter *dl, int *fd, uint64_t *size, struct bd_err *err) {
    bool created = false;
    int rc = 0;
    *fd = open(dl->path, O_RDWR | O_APPEND | O_CLOEXEC);
    if (*fd < 0 && errno == ENOENT) {
        *fd = open(dl->path, O_RDWR | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        created = *fd >= 0;
        if (*fd < 0 && errno == EEXIST) {
            *fd = open(dl->path, O_RDWR | O_APPEND | O_CLOEXEC);
        }
    }
    if (*fd < 0) {
        return bd_err_set(err, -errno, "%s: %s", dl->path, strerror(errno));
    }
    if (created) {
        rc = sync_dir(dl->dir);
        if (rc < 0) {
            rc = bd_err_set(err, rc, "%s: fsync: %s", dl->dir, strerror(-rc));
            goto out;
        }
    }
    rc = repair_tail(*fd, dl->path, size, err);
out:
    if (rc < 0) {
        close(*fd);
        *fd = -1;
    }
    return rc;
}

int bd_deadletter_open(struct bd_deadletter **out, const char *dir, struct bd_err *err) {
    struct stat st;
    int fd = -1;
    uint64_t size = 0;
    int rc = 0;
    struct bd_deadletter *dl = NULL;

    *out = NULL;
    if (stat(dir, &st) < 0) {
        return bd_err_set(err, -errno, "dead letters: %s: %s", dir, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) {
        return bd_err_set(err, -ENOTDIR, "dead letters: %s: %s", dir, strerror(ENOTDIR));
    }
    dl = calloc(1, sizeof(*dl));
    if (dl == NULL) {
        return bd_err_set(err, -ENOMEM, "dead letters: out of memory");
    }
    int n = snprintf(dl->dir, sizeof(dl->dir), "%s", dir);
    int m = snprintf(dl->path, sizeof(dl->path), "%s/%s", dir, BD_DEADLETTER_FILE);
    if (n < 0 || (size_t)n >= sizeof(dl->dir) || m < 0 || (size_t)m >= sizeof(dl->path)) {
        rc = bd_err_set(err, -ENAMETOOLONG, "dead letters: %s: %s", dir, strerror(ENAMETOOLONG));
        goto out;
    }
    rc = open_file(dl, &fd, &size, err);
out:
    if (fd >= 0) {
        close(fd);
    }
    if (rc < 0) {
        free(dl);
        return rc;
    }
    *out = dl;
    return 0;
}

/* MongoDB's and the driver's messages are UTF-8, but a bad byte must not cost the record. */
static char *utf8_or_replaced(const char *s) {
    char *copy = bson_strdup(s != NULL ? s : "");
    if (!bson_utf8_validate(copy, strlen(copy), false)) {
        for (char *p = copy; *p != '\0'; p++) {
            if ((unsigned char)*p >= 0x80) {
                *p = '?';
            }
        }
    }
    return copy;
}

/* The record as one line: canonical Extended JSON and '\n'. NULL if it cannot be written. */
static char *format_line(const struct bd_deadletter_record *rec, size_t *len) {
    bson_t doc = BSON_INITIALIZER;
    char *message = utf8_or_replaced(rec->message);
    char *json = NULL;
    char *line = NULL;
    size_t json_len = 0;

    BSON_APPEND_DATE_TIME(&doc, "time", rec->time_ms);
    BSON_APPEND_UTF8(&doc, "writer_id", rec->writer_id);
    BSON_APPEND_INT64(&doc, "seq", (int64_t)rec->seq);
    BSON_APPEND_UTF8(&doc, "database", rec->database);
    BSON_APPEND_UTF8(&doc, "collection", rec->collection);
    BSON_APPEND_UTF8(&doc, "bucket_id", rec->bucket_id);
    BSON_APPEND_INT64(&doc, "n_readings", (int64_t)rec->n_readings);
    BSON_APPEND_INT64(&doc, "code", rec->code);
    BSON_APPEND_UTF8(&doc, "message", message);
    BSON_APPEND_DOCUMENT(&doc, "filter", rec->filter);
    BSON_APPEND_ARRAY(&doc, "update", rec->update);

    /* NULL when a string in it is not UTF-8: JSON cannot carry it. */
    json = bson_as_canonical_extended_json(&doc, &json_len);
    if (json != NULL) {
        line = malloc(json_len + 1);
        if (line != NULL) {
            memcpy(line, json, json_len);
            line[json_len] = '\n';
            *len = json_len + 1;
        }
    }
    bson_free(json);
    bson_free(message);
    bson_destroy(&doc);
    return line;
}

int bd_deadletter_append(struct bd_deadletter *dl, const struct bd_deadletter_record *rec,
                         struct bd_err *err) {
    int rc = 0;
    int fd = -1;
    uint64_t size = 0;
    size_t len = 0;
    char *line = NULL;

    BD_ASSERT(rec->writer_id != NULL && rec->database != NULL && rec->collection != NULL &&
              rec->bucket_id != NULL && rec->filter != NULL && rec->update != NULL);
    line = format_line(rec, &len);
    if (line == NULL) {
        rc = bd_err_set(err, -EINVAL,
                        "%s: the refused update of %s cannot be written as JSON (a string in it "
                        "is not UTF-8)",
                        dl->path, rec->bucket_id);
        goto out;
    }
    rc = open_file(dl, &fd, &size, err);
    if (rc < 0) {
        goto out;
    }
    if (size + len > BD_DEADLETTER_MAX_BYTES) {
        rc = bd_err_set(err, -ENOSPC,
                        "%s: full (%" PRIu64 " bytes; a record of %zu bytes would pass the cap of "
                        "%" PRIu64 " bytes)",
                        dl->path, size, len, BD_DEADLETTER_MAX_BYTES);
        goto out;
    }
    /* One write(2) of the whole line: O_APPEND puts it at the end in one piece. The loop only
     * matters for a short write (a signal, a full disk), after which the rest follows it. */
    rc = bd_write_all(fd, line, len);
    if (rc == 0 && fsync(fd) < 0) {
        rc = -errno;
    }
    if (rc < 0) {
        /* Leave no part of this record behind; if even that fails, the next open repairs. */
        if (ftruncate(fd, (off_t)size) == 0) {
            (void)fsync(fd);
        }
        rc = bd_err_set(err, rc, "%s: %s", dl->path, strerror(-rc));
        goto out;
    }
out:
    if (fd >= 0 && close(fd) < 0 && rc == 0) {
        rc = bd_err_set(err, -errno, "%s: close: %s", dl->path, strerror(errno));
    }
    free(line);
    return rc;
}

const char *bd_deadletter_path(const struct bd_deadletter *dl) {
    return dl->path;
}

void bd_deadletter_close(struct bd_deadletter *dl) {
    free(dl);
}
