/*
 * Writer identity and flush sequence, persisted under spool.dir (see include/bucketd/writer.h
 * for the files and the reasoning). The state file is small text so an operator can read it;
 * a file that does not parse is treated as missing (logged), and the flusher then learns the
 * sequence back from the bucket documents before its first write.
 */
#include "bucketd/writer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/log.h"

struct bd_writer {
    char dir[1024];
    char state_path[1100];
    char tmp_path[1100];
    char writer_id[128];
    int lock_fd;
    uint64_t next;     /* next sequence to hand out */
    uint64_t reserved; /* first sequence not covered by the synced reservation */
    int64_t max_bucket_start_ms;
    int64_t last_ack_ms;
    struct bd_writer_prev prev;
    struct bd_ratelimit save_log;
};

static int parse_state(const char *text, struct bd_writer_prev *p) {
    char id[128] = "";
    unsigned version = 0;
    uint64_t reserved = 0;
    int64_t max_start = 0, last_ack = 0;
    int clean = 0, pos = 0;
    int n = sscanf(text,
                   "bucketd-writer %u\nwriter_id %127s\nreserved %" SCNu64
                   "\nmax_bucket_start_ms %" SCNd64 "\nlast_ack_ms %" SCNd64 "\nclean %d\n%n",
                   &version, id, &reserved, &max_start, &last_ack, &clean, &pos);
    if (n != 6 || version != 1 || pos == 0 || text[pos] != '\0' || reserved == 0 ||
        (clean != 0 && clean != 1)) {
        return -EINVAL;
    }
    p->found = true;
    p->clean = clean == 1;
    p->reserved = reserved;
    p->max_bucket_start_ms = max_start;
    p->last_ack_ms = last_ack;
    snprintf(p->writer_id, sizeof(p->writer_id), "%s", id);
    return 0;
}

static int read_state(struct bd_writer *w, struct bd_err *err) {
    char buf[1024];
    int fd = open(w->state_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) {
            return 0;
        }
        return bd_err_set(err, -errno, "%s: %s", w->state_path, strerror(errno));
    }
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int saved = errno;
    close(fd);
    if (n < 0) {
        return bd_err_set(err, -saved, "%s: %s", w->state_path, strerror(saved));
    }
    buf[n] = '\0';
    if (parse_state(buf, &w->prev) < 0) {
        bd_warn("%s does not parse (torn or edited); the flush sequence will be learned from "
                "the bucket documents before the first write",
                w->state_path);
        memset(&w->prev, 0, sizeof(w->prev));
    }
    return 0;
}

/* Replace writer.state with the current values; with sync, durable before returning. */
static int save_state(struct bd_writer *w, bool clean, bool sync, struct bd_err *err) {
    char buf[512];
    int len =
        snprintf(buf, sizeof(buf),
                 "bucketd-writer 1\nwriter_id %s\nreserved %" PRIu64
                 "\nmax_bucket_start_ms %" PRId64 "\nlast_ack_ms %" PRId64 "\nclean %d\n",
                 w->writer_id, w->reserved, w->max_bucket_start_ms, w->last_ack_ms, clean ? 1 : 0);
    BD_ASSERT(len > 0 && (size_t)len < sizeof(buf));
    int rc = 0;
    int fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0) {
        return bd_err_set(err, -errno, "%s: %s", w->tmp_path, strerror(errno));
    }
    rc = bd_write_all(fd, buf, (size_t)len);
    if (rc == 0 && sync && fsync(fd) < 0) {
        rc = -errno;
    }
    if (close(fd) < 0 && rc == 0) {
        rc = -errno;
    }
    if (rc == 0 && rename(w->tmp_path, w->state_path) < 0) {
        rc = -errno;
    }
    if (rc == 0 && sync) {
        /* The rename itself must be durable, or a crash could bring back an older block. */
        int dfd = open(w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0 || fsync(dfd) < 0) {
            rc = -errno;
        }
        if (dfd >= 0) {
            close(dfd);
        }
    }
    if (rc < 0) {
        unlink(w->tmp_path);
        return bd_err_set(err, rc, "cannot write %s: %s", w->state_path, strerror(-rc));
    }
    return 0;
}

static int reserve(struct bd_writer *w, uint64_t upto, struct bd_err *err) {
    uint64_t old = w->reserved;
    w->reserved = upto;
    int rc = save_state(w, false, true, err);
    if (rc < 0) {
        w->reserved = old;
    }
    return rc;
}

int bd_writer_open(struct bd_writer **out, const char *dir, const char *writer_id,
                   struct bd_err *err) {
    int rc = 0;
    char lock_path[1100];
    struct bd_writer *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return bd_err_set(err, -ENOMEM, "writer: out of memory");
    }
    w->lock_fd = -1;
    w->save_log.interval_ns = 60 * BD_NS_PER_S;
    w->save_log.burst = 1;
    snprintf(w->dir, sizeof(w->dir), "%s", dir);
    snprintf(w->writer_id, sizeof(w->writer_id), "%s", writer_id);
    snprintf(w->state_path, sizeof(w->state_path), "%s/writer.state", dir);
    snprintf(w->tmp_path, sizeof(w->tmp_path), "%s/writer.state.tmp", dir);
    snprintf(lock_path, sizeof(lock_path), "%s/writer.lock", dir);

    if (mkdir(dir, 0750) < 0 && errno != EEXIST) {
        rc = bd_err_set(err, -errno, "spool.dir %s: cannot create: %s", dir, strerror(errno));
        goto fail;
    }
    w->lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
    if (w->lock_fd < 0) {
        rc = bd_err_set(err, -errno, "spool.dir %s: %s: %s", dir, lock_path, strerror(errno));
        goto fail;
    }
    if (flock(w->lock_fd, LOCK_EX | LOCK_NB) < 0) {
        if (errno == EWOULDBLOCK) {
            rc = bd_err_set(err, -EBUSY,
                            "spool.dir %s is in use by another bucketd (%s is locked); each "
                            "daemon needs its own spool.dir and writer_id",
                            dir, lock_path);
        } else {
            rc = bd_err_set(err, -errno, "%s: flock: %s", lock_path, strerror(errno));
        }
        goto fail;
    }
    rc = read_state(w, err);
    if (rc < 0) {
        goto fail;
    }
    w->next = w->prev.found ? w->prev.reserved : 1;
    w->max_bucket_start_ms = w->prev.max_bucket_start_ms;
    w->last_ack_ms = w->prev.last_ack_ms;
    if (w->prev.found && strcmp(w->prev.writer_id, writer_id) != 0) {
        bd_warn("writer_id changed from %s to %s; the flush sequence carries on from %" PRIu64,
                w->prev.writer_id, writer_id, w->next);
    }
    rc = reserve(w, w->next + BD_WRITER_BLOCK, err);
    if (rc < 0) {
        goto fail;
    }
    *out = w;
    return 0;
fail:
    if (w->lock_fd >= 0) {
        close(w->lock_fd);
    }
    free(w);
    return rc;
}

const struct bd_writer_prev *bd_writer_previous(const struct bd_writer *w) {
    return &w->prev;
}

int bd_writer_next(struct bd_writer *w, uint64_t *seq, struct bd_err *err) {
    if (w->next >= w->reserved) {
        int rc = reserve(w, w->next + BD_WRITER_BLOCK, err);
        if (rc < 0) {
            return rc;
        }
    }
    *seq = w->next++;
    return 0;
}

int bd_writer_raise(struct bd_writer *w, uint64_t seen, struct bd_err *err) {
    if (seen < w->next) {
        return 0;
    }
    uint64_t old = w->next;
    w->next = seen + 1;
    if (w->next >= w->reserved) {
        int rc = reserve(w, w->next + BD_WRITER_BLOCK, err);
        if (rc < 0) {
            w->next = old;
            return rc;
        }
    }
    return 0;
}

void bd_writer_acked(struct bd_writer *w, int64_t now_ms, int64_t max_start_ms) {
    struct bd_err err = {0};
    w->last_ack_ms = now_ms;
    if (max_start_ms > w->max_bucket_start_ms) {
        w->max_bucket_start_ms = max_start_ms;
    }
    if (save_state(w, false, false, &err) < 0) {
        if (bd_ratelimit_ok(&w->save_log, bd_mono_ns())) {
            bd_warn("%s", err.msg);
        }
    }
}

int64_t bd_writer_max_bucket_start(const struct bd_writer *w) {
    return w->max_bucket_start_ms;
}

void bd_writer_close(struct bd_writer *w, bool clean) {
    if (w == NULL) {
        return;
    }
    struct bd_err err = {0};
    if (save_state(w, clean, true, &err) < 0) {
        bd_error("%s", err.msg);
    }
    close(w->lock_fd);
    free(w);
}
