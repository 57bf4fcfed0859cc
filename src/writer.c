/*
 * Writer identity and flush sequence, persisted under spool.dir (see include/bucketd/writer.h
 * for the files and the reasoning). The state file is small text so an operator can read it;
 * a file that does not parse is treated as missing (logged), and the flusher then learns the
 * sequence back from the bucket documents before its first write. The identity is worked out
 * on the main thread before the flusher starts; the rest is the flusher thread's.
 */
#include "bucketd/writer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
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
    int64_t saved_ack_ms;  /* last_ack_ms as the file holds it */
    uint64_t lost_at_stop; /* readings the stop lost, saved by the closing write */
    struct bd_writer_prev prev;
    struct bd_ratelimit save_log;
};

static int parse_state(const char *text, struct bd_writer_prev *p) {
    char id[128] = "";
    unsigned version = 0;
    uint64_t reserved = 0, lost = 0;
    int64_t max_start = 0, last_ack = 0;
    int clean = 0, pos = 0, more = 0;
    int n = sscanf(text,
                   "bucketd-writer %u\nwriter_id %127s\nreserved %" SCNu64
                   "\nmax_bucket_start_ms %" SCNd64 "\nlast_ack_ms %" SCNd64 "\nclean %d\n%n",
                   &version, id, &reserved, &max_start, &last_ack, &clean, &pos);
    /* Since the stop's losses are kept: one more line (files without it are read as 0). */
    if (n == 6 && pos > 0 && text[pos] != '\0' &&
        sscanf(text + pos, "lost_at_stop %" SCNu64 "\n%n", &lost, &more) == 1 && more > 0) {
        pos += more;
    }
    if (n != 6 || version != 1 || pos == 0 || text[pos] != '\0' || reserved == 0 ||
        (clean != 0 && clean != 1)) {
        return -EINVAL;
    }
    p->found = true;
    p->clean = clean == 1;
    p->reserved = reserved;
    p->max_bucket_start_ms = max_start;
    p->last_ack_ms = last_ack;
    p->lost_at_stop = lost;
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

/* Replace writer.state with the current values, durable before returning. */
static int save_state(struct bd_writer *w, bool clean, struct bd_err *err) {
    char buf[512];
    int len = snprintf(buf, sizeof(buf),
                       "bucketd-writer 1\nwriter_id %s\nreserved %" PRIu64
                       "\nmax_bucket_start_ms %" PRId64 "\nlast_ack_ms %" PRId64
                       "\nclean %d\nlost_at_stop %" PRIu64 "\n",
                       w->writer_id, w->reserved, w->max_bucket_start_ms, w->last_ack_ms,
                       clean ? 1 : 0, clean ? w->lost_at_stop : 0);
    BD_ASSERT(len > 0 && (size_t)len < sizeof(buf));
    return bd_replace_file(w->dir, w->state_path, w->tmp_path, buf, (size_t)len, 0640, err);
}

static int reserve(struct bd_writer *w, uint64_t upto, struct bd_err *err) {
    uint64_t old = w->reserved;
    w->reserved = upto;
    int rc = save_state(w, false, err);
    if (rc < 0) {
        w->reserved = old;
    }
    return rc;
}

/* Create dir if missing and flock its writer.lock: *fd is the locked descriptor. */
static int lock_dir(const char *dir, int *fd, struct bd_err *err) {
    char lock_path[1100];
    int rc = 0;
    snprintf(lock_path, sizeof(lock_path), "%s/writer.lock", dir);
    rc = bd_mkdir_p(dir, 0700, err);
    if (rc < 0) {
        return rc;
    }
    *fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
    if (*fd < 0) {
        return bd_err_set(err, -errno, "spool.dir %s: %s: %s", dir, lock_path, strerror(errno));
    }
    if (flock(*fd, LOCK_EX | LOCK_NB) < 0) {
        if (errno == EWOULDBLOCK) {
            rc = bd_err_set(err, -EBUSY,
                            "spool.dir %s is in use by another bucketd (%s is locked); each "
                            "daemon needs its own spool.dir and writer_id",
                            dir, lock_path);
        } else {
            rc = bd_err_set(err, -errno, "%s: flock: %s", lock_path, strerror(errno));
        }
        close(*fd);
        *fd = -1;
    }
    return rc;
}

int bd_writer_open(struct bd_writer **out, const char *dir, const char *writer_id,
                   struct bd_err *err) {
    int rc = 0;
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

    rc = lock_dir(dir, &w->lock_fd, err);
    if (rc < 0) {
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
    bool advanced = max_start_ms > w->max_bucket_start_ms;
    w->last_ack_ms = now_ms;
    if (advanced) {
        w->max_bucket_start_ms = max_start_ms;
    }
    /* Written when a newer bucket was written (once per span, normally), else at most once per
     * BD_WRITER_ACK_SAVE_MS: not at every flush, since nothing should wear the disk while
     * MongoDB keeps up. Synced like every rewrite (replace_file): two fsyncs each time. */
    if (!advanced && now_ms >= w->saved_ack_ms &&
        now_ms - w->saved_ack_ms < BD_WRITER_ACK_SAVE_MS) {
        return;
    }
    w->saved_ack_ms = now_ms;
    if (save_state(w, false, &err) < 0) {
        if (bd_ratelimit_ok(&w->save_log, bd_mono_ns())) {
            bd_warn("%s", err.msg);
        }
    }
}

int64_t bd_writer_max_bucket_start(const struct bd_writer *w) {
    return w->max_bucket_start_ms;
}

void bd_writer_set_lost_at_stop(struct bd_writer *w, uint64_t lost) {
    if (w != NULL) {
        w->lost_at_stop = lost;
    }
}

void bd_writer_close(struct bd_writer *w, bool clean) {
    if (w == NULL) {
        return;
    }
    struct bd_err err = {0};
    if (save_state(w, clean, &err) < 0) {
        bd_error("%s", err.msg);
    }
    close(w->lock_fd);
    free(w);
}

/* ---- Identity ------------------------------------------------------------------------------ */

/* The config's rule for writer_id: it becomes part of the field path "w.<writer_id>". */
static bool valid_id(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > BD_WRITER_ID_MAX) {
        return false;
    }
    for (const char *p = s; *p != '\0'; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_')) {
            return false;
        }
    }
    return true;
}

/* writer-id into id: 1 if it holds one, 0 if there is none, or a negative error. */
static int read_id_file(const char *path, char *id, struct bd_err *err) {
    char buf[256];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) {
            return 0;
        }
        return bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
    }
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int saved = errno;
    close(fd);
    if (n < 0) {
        return bd_err_set(err, -saved, "%s: %s", path, strerror(saved));
    }
    buf[n] = '\0';
    size_t len = strcspn(buf, "\n");
    bool one_line = buf[len] == '\0' || (buf[len] == '\n' && buf[len + 1] == '\0');
    buf[len] = '\0';
    if (!one_line || !valid_id(buf)) {
        return bd_err_set(err, -EINVAL,
                          "%s does not hold a writer id (one line of 1 to %d letters, digits, "
                          "'-' and '_'): correct it, or delete it to have a new id generated",
                          path, BD_WRITER_ID_MAX);
    }
    memcpy(id, buf, strlen(buf) + 1); /* valid_id bounds its length */
    return 1;
}

int bd_writer_peek(const char *dir, struct bd_writer_prev *out) {
    char path[1100], buf[1024];
    memset(out, 0, sizeof(*out));
    snprintf(path, sizeof(path), "%s/writer.state", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -errno;
    }
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int saved = errno;
    close(fd);
    if (n < 0) {
        return -saved;
    }
    buf[n] = '\0';
    if (parse_state(buf, out) < 0) {
        memset(out, 0, sizeof(*out));
        return -EINVAL;
    }
    return 0;
}

/* The writer id writer.state names, if it parses and the id is valid. */
static bool state_writer_id(const char *dir, char *id) {
    struct bd_writer_prev prev;
    if (bd_writer_peek(dir, &prev) < 0 || !valid_id(prev.writer_id)) {
        return false;
    }
    memcpy(id, prev.writer_id, strlen(prev.writer_id) + 1); /* valid_id bounds its length */
    return true;
}

/* "w-" and 16 hex digits from the kernel's random source. */
static int random_id(char *id, struct bd_err *err) {
    uint8_t r[8];
    size_t got = 0;
    while (got < sizeof(r)) {
        ssize_t n = getrandom(r + got, sizeof(r) - got, 0);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return bd_err_set(err, -errno, "cannot generate a writer id: getrandom: %s",
                              strerror(errno));
        }
        got += (size_t)n;
    }
    char *p = id;
    p += sprintf(p, "w-");
    for (size_t i = 0; i < sizeof(r); i++) {
        p += sprintf(p, "%02x", r[i]);
    }
    return 0;
}

static void log_identity(const struct bd_writer_identity *w, const char *dir, const char *path) {
    switch (w->source) {
    case BD_WRITER_ID_CONFIGURED:
        bd_info("writer_id %s (set in the configuration; kept in %s)", w->id, path);
        break;
    case BD_WRITER_ID_REPLACED:
        bd_warn("writer_id %s set in the configuration is not the id %s kept (%s): this daemon "
                "now writes as %s, and %s keeps it; if another daemon uses %s, give one of "
                "them another writer_id (two daemons sharing one conflict)",
                w->id, path, w->kept, w->id, path, w->id);
        break;
    case BD_WRITER_ID_KEPT:
        bd_info("writer_id %s (kept in %s since its first start)", w->id, path);
        break;
    case BD_WRITER_ID_ADOPTED:
        bd_info("writer_id %s (named by %s/writer.state, written by an earlier version; now "
                "kept in %s)",
                w->id, dir, path);
        break;
    case BD_WRITER_ID_GENERATED:
        bd_info("writer_id %s (generated on this first start and kept in %s; set writer_id "
                "in the configuration to choose one)",
                w->id, path);
        break;
    }
}

int bd_writer_identity(const char *dir, const char *configured, struct bd_writer_identity *out,
                       struct bd_err *err) {
    char path[1100], tmp[1100];
    int lock_fd = -1;
    memset(out, 0, sizeof(*out));
    BD_ASSERT(configured[0] == '\0' || valid_id(configured)); /* the config checked it */
    snprintf(path, sizeof(path), "%s/" BD_WRITER_ID_FILE, dir);
    snprintf(tmp, sizeof(tmp), "%s/" BD_WRITER_ID_FILE ".tmp", dir);
    /* Under the lock, so that two daemons started together cannot both generate an id. */
    int rc = lock_dir(dir, &lock_fd, err);
    if (rc < 0) {
        return rc;
    }
    rc = read_id_file(path, out->kept, err);
    if (rc < 0) {
        goto out;
    }
    bool kept = rc == 1;
    rc = 0;
    if (configured[0] != '\0') {
        snprintf(out->id, sizeof(out->id), "%s", configured);
        out->source = kept && strcmp(out->kept, configured) != 0 ? BD_WRITER_ID_REPLACED
                                                                 : BD_WRITER_ID_CONFIGURED;
    } else if (kept) {
        snprintf(out->id, sizeof(out->id), "%s", out->kept);
        out->source = BD_WRITER_ID_KEPT;
    } else if (state_writer_id(dir, out->id)) {
        out->source = BD_WRITER_ID_ADOPTED;
    } else {
        rc = random_id(out->id, err);
        if (rc < 0) {
            goto out;
        }
        out->source = BD_WRITER_ID_GENERATED;
    }
    if (!kept || strcmp(out->kept, out->id) != 0) {
        char line[BD_WRITER_ID_MAX + 2];
        int len = snprintf(line, sizeof(line), "%s\n", out->id);
        rc = bd_replace_file(dir, path, tmp, line, (size_t)len, 0640, err);
        if (rc < 0) {
            goto out;
        }
    }
    log_identity(out, dir, path);
out:
    close(lock_fd);
    return rc;
}
