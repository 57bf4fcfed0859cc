/*
 * The on-disk spool (format, promises and recovery rules in include/bucketd/spool.h).
 *
 * One thread owns a spool. In memory it keeps the list of segment files, oldest first (number,
 * size, and the unacknowledged records and readings in it when known), one descriptor appending
 * to the newest segment and one reading the oldest, and the payload of the record peek returned.
 * The read position is always in the oldest segment: segments before it are deleted as soon as
 * they are finished, so the checkpoint's read segment doubles as the delete watermark.
 *
 * Every change of the directory follows the same order: make the data a checkpoint will point
 * past durable, save the checkpoint (temp file, fsync, rename, directory fsync), then unlink, then
 * fsync the directory. A crash anywhere in between leaves either the old checkpoint (the records
 * are delivered again: at-least-once) or the new one with leftover files below its watermark
 * (deleted at the next open).
 */
#include "bucketd/spool.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/alloc.h"
#include "bucketd/crc32c.h"
#include "bucketd/log.h"

#define SEG_HDR BD_SPOOL_SEGMENT_HEADER_BYTES
#define REC_HDR BD_SPOOL_RECORD_HEADER_BYTES
#define CKPT_LEN BD_SPOOL_CHECKPOINT_BYTES
#define SEG_MAGIC "BDSPSEG1"
#define REC_MAGIC "BDRC"
#define CKPT_MAGIC "BDSPCKPT"
#define FORMAT_VERSION 1
#define CKPT_FILE "spool.ckpt"
#define CKPT_TMP_FILE "spool.ckpt.tmp"
/* Bytes read at a time when scanning forward for the next valid record. */
#define SCAN_CHUNK 65536
#define DIR_CAP 1024
#define PATH_CAP (DIR_CAP + 64)

struct seg {
    uint64_t no;
    uint64_t size;     /* bytes in the file (the newest: up to the last good record) */
    uint64_t records;  /* unacknowledged records in it, when counted */
    uint64_t readings; /* and their readings */
    bool counted;      /* records/readings are known */
};

struct bd_spool {
    char dir[DIR_CAP];
    struct bd_spool_opts o; /* o.dir points at dir */

    struct seg *segs; /* oldest first; the newest takes the appends */
    size_t n, cap;
    uint64_t next_no; /* number of the next segment to create */

    int wfd;          /* appending to segs[n - 1]; -1: none, the next append creates one */
    bool unsynced;    /* the newest segment holds data not yet fdatasync'ed */
    bool seal_active; /* a write failed there: the next append starts a new segment */
    uint8_t *wbuf;    /* one record, header and payload, for a single write(2) */
    size_t wbuf_cap;

    int rfd;         /* reading segs[0]; -1: not open */
    uint64_t rfd_no; /* the segment rfd reads */
    uint64_t rd_off; /* first unacknowledged byte in segs[0] */
    bool peeked;     /* peek_* describe the record peek returned, still unacknowledged */
    uint64_t peek_id, peek_next, peek_readings;
    uint64_t peek_seq, peek_off;
    uint32_t peek_flags;
    size_t peek_len;
    uint64_t last_id;
    uint8_t *buf; /* payload being checked or delivered */
    size_t buf_cap;
    uint8_t *scan; /* SCAN_CHUNK bytes for the forward scan */

    bool ckpt_dirty; /* the read position moved since the checkpoint was saved */
    int64_t last_sync_ns;
    bool synced_once;

    uint64_t bytes_read; /* by the reading helpers; recovery_bytes_read is its value after open */
    struct bd_spool_stats st;
    struct bd_ratelimit corrupt_log;
};

/* ------------------------------------------------------------------------------------------ */
/* Test hook                                                                                  */

static int crash_step;

void bd_spool_crash_at(int step) {
    crash_step = step;
}

static void crash_point(int step) {
    if (crash_step == step) {
        _exit(BD_SPOOL_CRASH_EXIT);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Encoding                                                                                   */

static void encode_seg_header(uint8_t *h, uint64_t no) {
    memset(h, 0, SEG_HDR);
    memcpy(h, SEG_MAGIC, 8);
    bd_put_le32(h + 8, FORMAT_VERSION);
    bd_put_le32(h + 12, SEG_HDR);
    bd_put_le64(h + 16, no);
    bd_put_le32(h + 28, bd_crc32c(0, h, 28));
}

static bool seg_header_ok(const uint8_t *h, uint64_t no) {
    return memcmp(h, SEG_MAGIC, 8) == 0 && bd_get_le32(h + 8) == FORMAT_VERSION &&
           bd_get_le32(h + 12) == SEG_HDR && bd_get_le64(h + 16) == no &&
           bd_get_le32(h + 28) == bd_crc32c(0, h, 28);
}

static void encode_rec_header(uint8_t *h, uint64_t seq, uint32_t n_readings, uint32_t flags,
                              const void *data, size_t len) {
    memcpy(h, REC_MAGIC, 4);
    bd_put_le32(h + 4, (uint32_t)len);
    bd_put_le64(h + 8, seq);
    bd_put_le32(h + 16, n_readings);
    bd_put_le32(h + 20, flags);
    bd_put_le32(h + 24, bd_crc32c(0, h, 24));
    bd_put_le32(h + 28, bd_crc32c(bd_crc32c(0, h, 28), data, len));
}

static void encode_ckpt(uint8_t *c, uint64_t seg, uint64_t off) {
    memset(c, 0, CKPT_LEN);
    memcpy(c, CKPT_MAGIC, 8);
    bd_put_le32(c + 8, FORMAT_VERSION);
    bd_put_le64(c + 16, seg);
    bd_put_le64(c + 24, off);
    bd_put_le32(c + 32, bd_crc32c(0, c, 32));
}

/* ------------------------------------------------------------------------------------------ */
/* Files                                                                                      */

static void seg_path(const struct bd_spool *s, uint64_t no, char *out) {
    snprintf(out, PATH_CAP, "%s/spool-%016" PRIx64 ".seg", s->dir, no);
}

static void file_path(const struct bd_spool *s, const char *name, char *out) {
    snprintf(out, PATH_CAP, "%s/%s", s->dir, name);
}

/* "spool-<16 lowercase hex>.seg" -> its number; false for any other name. */
static bool parse_seg_name(const char *name, uint64_t *no) {
    if (strlen(name) != 6 + 16 + 4 || strncmp(name, "spool-", 6) != 0 ||
        strcmp(name + 22, ".seg") != 0) {
        return false;
    }
    uint64_t v = 0;
    for (int i = 6; i < 22; i++) {
        char c = name[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) {
            return false;
        }
        v = v << 4 | (uint64_t)d;
    }
    *no = v;
    return v != 0;
}

static int sync_dir(const struct bd_spool *s) {
    int rc = 0;
    int dfd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) < 0) {
        rc = -errno;
    }
    if (dfd >= 0) {
        close(dfd);
    }
    if (rc < 0) {
        bd_warn("spool: %s: fsync of the directory: %s", s->dir, strerror(-rc));
    }
    return rc;
}

/* pread exactly len bytes; -EIO when the file ends first. Counted in bytes_read. */
static int pread_all(struct bd_spool *s, int fd, void *buf, size_t len, uint64_t off) {
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = pread(fd, p, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -errno;
        }
        if (n == 0) {
            return -EIO;
        }
        s->bytes_read += (uint64_t)n;
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int data_sync(struct bd_spool *s, int fd) {
    s->st.syncs++;
    return fdatasync(fd) < 0 ? -errno : 0;
}

static int grow(uint8_t **buf, size_t *cap, size_t need) {
    if (need <= *cap) {
        return 0;
    }
    size_t n = BD_MAX(need, (size_t)4096);
    uint8_t *p = bd_realloc(*buf, n);
    if (p == NULL) {
        return -ENOMEM;
    }
    *buf = p;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Reading records                                                                            */

enum rec_state {
    REC_OK,          /* a valid record */
    REC_BAD_PAYLOAD, /* the header is sound (its length can be trusted), the record check fails */
    REC_BAD,         /* no record starts here */
};

struct rec_hdr {
    uint32_t len;
    uint64_t seq;
    uint32_t n_readings;
    uint32_t flags;
};

/*
 * What starts at off in a segment whose valid bytes end at end. With verify, the payload is read
 * into s->buf and checked; without, only the header is. 0 and *state, or a read error / -ENOMEM.
 */
static int check_record(struct bd_spool *s, int fd, uint64_t off, uint64_t end, bool verify,
                        struct rec_hdr *h, enum rec_state *state) {
    uint8_t b[REC_HDR];
    *state = REC_BAD;
    if (off > end || end - off < REC_HDR) {
        return 0;
    }
    int rc = pread_all(s, fd, b, REC_HDR, off);
    if (rc < 0) {
        return rc;
    }
    if (memcmp(b, REC_MAGIC, 4) != 0 || bd_get_le32(b + 24) != bd_crc32c(0, b, 24)) {
        return 0;
    }
    h->len = bd_get_le32(b + 4);
    h->seq = bd_get_le64(b + 8);
    h->n_readings = bd_get_le32(b + 16);
    h->flags = bd_get_le32(b + 20);
    if (h->len > BD_SPOOL_MAX_RECORD || end - off - REC_HDR < h->len) {
        return 0;
    }
    if (!verify) {
        *state = REC_OK;
        return 0;
    }
    rc = grow(&s->buf, &s->buf_cap, h->len);
    if (rc == 0 && h->len > 0) {
        rc = pread_all(s, fd, s->buf, h->len, off + REC_HDR);
    }
    if (rc < 0) {
        return rc;
    }
    uint32_t crc = bd_crc32c(bd_crc32c(0, b, 28), s->buf, h->len);
    *state = crc == bd_get_le32(b + 28) ? REC_OK : REC_BAD_PAYLOAD;
    return 0;
}

/*
 * The first offset at or after `from` where a sound record header starts (see check_record), or
 * end when there is none: the forward scan that resynchronises after damage.
 */
static int find_next(struct bd_spool *s, int fd, uint64_t from, uint64_t end, bool verify,
                     uint64_t *found) {
    uint64_t pos = from;
    int rc = 0;
    if (s->scan == NULL) {
        s->scan = bd_malloc(SCAN_CHUNK);
        if (s->scan == NULL) {
            return -ENOMEM;
        }
    }
    while (pos < end && end - pos >= REC_HDR) {
        size_t n = (size_t)BD_MIN(end - pos, (uint64_t)SCAN_CHUNK);
        rc = pread_all(s, fd, s->scan, n, pos);
        if (rc < 0) {
            return rc;
        }
        const uint8_t *p = s->scan;
        size_t left = n;
        const uint8_t *hit;
        while ((hit = memmem(p, left, REC_MAGIC, 4)) != NULL) {
            uint64_t cand = pos + (uint64_t)(hit - s->scan);
            struct rec_hdr h;
            enum rec_state st;
            rc = check_record(s, fd, cand, end, verify, &h, &st);
            if (rc < 0) {
                return rc;
            }
            if (st != REC_BAD) {
                *found = cand;
                return 0;
            }
            left -= (size_t)(hit - p) + 1;
            p = hit + 1;
        }
        /* The last three bytes may begin a magic that the next chunk completes. */
        if (n <= 3) {
            break;
        }
        pos += n - 3;
    }
    *found = end;
    return 0;
}

/*
 * Records and readings from off to end, by their headers only (payloads are skipped by length,
 * damage by the forward scan): what a segment about to be dropped unread held.
 */
static void count_records(struct bd_spool *s, int fd, uint64_t off, uint64_t end, uint64_t *records,
                          uint64_t *readings) {
    *records = 0;
    *readings = 0;
    while (off < end) {
        struct rec_hdr h;
        enum rec_state st;
        if (check_record(s, fd, off, end, false, &h, &st) < 0) {
            return;
        }
        if (st == REC_OK) {
            (*records)++;
            *readings += h.n_readings;
            off += REC_HDR + (uint64_t)h.len;
        } else if (find_next(s, fd, off + 1, end, false, &off) < 0) {
            return;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Checkpoint and deletes                                                                     */

static uint64_t read_seg_no(const struct bd_spool *s) {
    return s->n > 0 ? s->segs[0].no : s->next_no;
}

static uint64_t read_off(const struct bd_spool *s) {
    return s->n > 0 ? BD_MAX(s->rd_off, (uint64_t)SEG_HDR) : SEG_HDR;
}

static int save_ckpt(struct bd_spool *s) {
    char tmp[PATH_CAP], path[PATH_CAP];
    uint8_t c[CKPT_LEN];
    int rc = 0;
    /* Data first: the checkpoint must not point past records a power loss could take back. */
    if (s->n == 1 && s->wfd >= 0 && s->unsynced) {
        rc = data_sync(s, s->wfd);
        if (rc < 0) {
            s->st.write_errors++;
            bd_warn("spool: %s: fdatasync before the checkpoint: %s", s->dir, strerror(-rc));
            return rc;
        }
        s->unsynced = false;
    }
    file_path(s, CKPT_TMP_FILE, tmp);
    file_path(s, CKPT_FILE, path);
    encode_ckpt(c, read_seg_no(s), read_off(s));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    rc = bd_write_all(fd, c, sizeof(c));
    if (rc == 0 && fsync(fd) < 0) {
        rc = -errno;
    }
    if (close(fd) < 0 && rc == 0) {
        rc = -errno;
    }
    if (rc < 0) {
        goto out;
    }
    crash_point(BD_SPOOL_CRASH_CKPT_TMP_WRITTEN);
    if (rename(tmp, path) < 0) {
        rc = -errno;
        goto out;
    }
    crash_point(BD_SPOOL_CRASH_CKPT_RENAMED);
    rc = sync_dir(s);
out:
    if (rc < 0) {
        unlink(tmp);
        bd_warn("spool: cannot save %s: %s", path, strerror(-rc));
        return rc;
    }
    s->ckpt_dirty = false;
    return 0;
}

static void close_reader(struct bd_spool *s) {
    if (s->rfd >= 0) {
        close(s->rfd);
        s->rfd = -1;
    }
}

/*
 * Delete the oldest segment: finished (everything in it acknowledged or skipped), or dropped by
 * drop_oldest with what it still held counted. The checkpoint naming the next segment goes
 * first; if it cannot be saved the file is deleted anyway, because freeing space must not
 * depend on writing (a crash before the next save then counts the file as missing, and loses
 * nothing: it held nothing left to deliver, or was dropped).
 */
static void remove_oldest(struct bd_spool *s, bool dropped) {
    char path[PATH_CAP];
    struct seg old = s->segs[0];
    BD_ASSERT(s->n > 0);
    seg_path(s, old.no, path);
    if (dropped) {
        uint64_t records = old.records, readings = old.readings;
        /* A counted segment still counts the record peek returned, if any: it goes too. */
        if (!old.counted) {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            records = readings = 0;
            if (fd >= 0) {
                count_records(s, fd, read_off(s), old.size, &records, &readings);
                close(fd);
            }
        }
        /* Except the record peek returned: its reader holds it and finishes it from memory
         * (bd_spool_holds turns false), so counting it here would count readings as dropped
         * that are written. */
        if (s->peeked) {
            records -= BD_MIN(records, 1);
            readings -= BD_MIN(readings, s->peek_readings);
        }
        s->st.dropped_records += records;
        s->st.dropped_readings += readings;
        bd_warn("spool: %s: spool.max_bytes (%" PRIu64 ") reached: dropped the oldest segment, "
                "%" PRIu64 " unacknowledged records with %" PRIu64 " readings%s",
                path, s->o.max_bytes, records, readings,
                s->peeked ? " (and the record being replayed, finished from memory)" : "");
    }
    close_reader(s);
    if (s->n == 1 && s->wfd >= 0) {
        close(s->wfd);
        s->wfd = -1;
        s->unsynced = false;
    }
    memmove(&s->segs[0], &s->segs[1], (s->n - 1) * sizeof(s->segs[0]));
    s->n--;
    s->rd_off = SEG_HDR;
    s->peeked = false;
    s->ckpt_dirty = true;
    (void)save_ckpt(s);
    crash_point(BD_SPOOL_CRASH_DELETE_RECORDED);
    if (unlink(path) < 0 && errno != ENOENT) {
        bd_warn("spool: cannot delete %s: %s", path, strerror(errno));
    }
    crash_point(BD_SPOOL_CRASH_DELETE_UNLINKED);
    (void)sync_dir(s);
}

/* Delete the segments before the newest that replay has finished with. */
static void release_finished(struct bd_spool *s) {
    while (s->n > 1 && !s->peeked && s->rd_off >= s->segs[0].size) {
        remove_oldest(s, false);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Appending                                                                                  */

static uint64_t total_bytes(const struct bd_spool *s) {
    uint64_t b = 0;
    for (size_t i = 0; i < s->n; i++) {
        b += s->segs[i].size;
    }
    return b;
}

/* Start segment next_no: sync the full one, create the file with its header, sync the dir. */
static int rotate(struct bd_spool *s) {
    char path[PATH_CAP];
    uint8_t h[SEG_HDR];
    int rc = 0;
    int fd = -1;

    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        struct seg *p = bd_reallocarray(s->segs, cap, sizeof(*p));
        if (p == NULL) {
            return -ENOMEM;
        }
        s->segs = p;
        s->cap = cap;
    }
    if (s->wfd >= 0 && s->unsynced) {
        rc = data_sync(s, s->wfd);
        if (rc < 0) {
            s->st.write_errors++;
            bd_warn("spool: segment %016" PRIx64 ": fdatasync: %s", s->segs[s->n - 1].no,
                    strerror(-rc));
            return rc;
        }
        s->unsynced = false;
    }
    uint64_t no = s->next_no++;
    seg_path(s, no, path);
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) {
        rc = -errno;
        goto out;
    }
    encode_seg_header(h, no);
    rc = bd_write_all(fd, h, sizeof(h));
    if (rc < 0) {
        goto out;
    }
    crash_point(BD_SPOOL_CRASH_SEGMENT_CREATED);
    rc = sync_dir(s);
out:
    if (rc < 0) {
        s->st.write_errors++;
        bd_warn("spool: cannot start %s: %s", path, strerror(-rc));
        if (fd >= 0) {
            close(fd);
            unlink(path);
        }
        return rc;
    }
    if (s->wfd >= 0) {
        close(s->wfd);
    }
    s->wfd = fd;
    s->unsynced = true;
    s->seal_active = false;
    s->segs[s->n++] = (struct seg){.no = no, .size = SEG_HDR, .counted = true};
    release_finished(s);
    return 0;
}

int bd_spool_append(struct bd_spool *s, uint64_t seq, uint32_t n_readings, uint32_t flags,
                    const void *data, size_t len) {
    if (len > BD_SPOOL_MAX_RECORD || REC_HDR + SEG_HDR + (uint64_t)len > s->o.max_bytes) {
        return -EMSGSIZE;
    }
    uint64_t rec = REC_HDR + (uint64_t)len;
    bool new_seg;
    for (;;) {
        const struct seg *last = s->n > 0 ? &s->segs[s->n - 1] : NULL;
        new_seg = s->wfd < 0 || s->seal_active ||
                  (last->size > SEG_HDR && last->size + rec > s->o.segment_bytes);
        uint64_t need = rec + (new_seg ? SEG_HDR : 0);
        uint64_t have = total_bytes(s);
        if (have + need <= s->o.max_bytes) {
            break;
        }
        if (s->o.full == BD_SPOOL_BLOCK) {
            return -ENOSPC;
        }
        if (s->o.full == BD_SPOOL_DROP_NEWEST) {
            s->st.dropped_records++;
            s->st.dropped_readings += n_readings;
            return -ENOSPC;
        }
        remove_oldest(s, true);
    }
    int rc = new_seg ? rotate(s) : 0;
    if (rc < 0) {
        return rc;
    }

    struct seg *seg = &s->segs[s->n - 1];
    rc = grow(&s->wbuf, &s->wbuf_cap, (size_t)rec);
    if (rc < 0) {
        return rc;
    }
    encode_rec_header(s->wbuf, seq, n_readings, flags, data, len);
    if (len > 0) {
        memcpy(s->wbuf + REC_HDR, data, len);
    }
    if (crash_step == BD_SPOOL_CRASH_RECORD_TORN) {
        (void)bd_write_all(s->wfd, s->wbuf, (size_t)rec / 2);
        crash_point(BD_SPOOL_CRASH_RECORD_TORN);
    }
    /* One write(2): a process killed mid-append leaves the record whole or absent. */
    rc = bd_write_all(s->wfd, s->wbuf, (size_t)rec);
    if (rc == 0) {
        crash_point(BD_SPOOL_CRASH_RECORD_WRITTEN);
    }
    if (rc == 0 && s->o.sync == BD_SPOOL_SYNC_BATCH) {
        rc = data_sync(s, s->wfd);
    }
    if (rc < 0) {
        char path[PATH_CAP];
        seg_path(s, seg->no, path);
        s->st.write_errors++;
        /* Cut back to the last good record; if even that fails, the bytes stay as a torn tail
         * that replay and the next open skip, because seg->size stays at the good end. After a
         * failed fdatasync the file's cached state cannot be trusted: appends move on. */
        if (ftruncate(s->wfd, (off_t)seg->size) < 0) {
            bd_warn("spool: %s: cannot cut back a failed append: %s", path, strerror(errno));
        }
        s->seal_active = true;
        bd_warn("spool: %s: append of %zu bytes failed: %s", path, len, strerror(-rc));
        return rc;
    }
    seg->size += rec;
    seg->records++;
    seg->readings += n_readings;
    s->unsynced = s->o.sync != BD_SPOOL_SYNC_BATCH;
    s->st.appended++;
    s->st.appended_bytes += len;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Sync                                                                                       */

int bd_spool_flush(struct bd_spool *s) {
    int rc = 0;
    if (s->wfd >= 0 && s->unsynced) {
        rc = data_sync(s, s->wfd);
        if (rc < 0) {
            s->st.write_errors++;
            bd_warn("spool: %s: fdatasync: %s", s->dir, strerror(-rc));
            return rc;
        }
        s->unsynced = false;
    }
    if (s->ckpt_dirty) {
        rc = save_ckpt(s);
    }
    return rc;
}

int bd_spool_tick(struct bd_spool *s, int64_t mono_ns) {
    if (s->o.sync != BD_SPOOL_SYNC_INTERVAL || !(s->unsynced || s->ckpt_dirty)) {
        return 0;
    }
    if (s->synced_once &&
        mono_ns - s->last_sync_ns < (int64_t)s->o.sync_interval_ms * BD_NS_PER_MS) {
        return 0;
    }
    s->synced_once = true;
    s->last_sync_ns = mono_ns;
    return bd_spool_flush(s);
}

/* ------------------------------------------------------------------------------------------ */
/* Replay                                                                                     */

static void log_corrupt(struct bd_spool *s, uint64_t no, uint64_t off, uint64_t skipped,
                        const char *what) {
    if (bd_ratelimit_ok(&s->corrupt_log, bd_mono_ns())) {
        char path[PATH_CAP];
        seg_path(s, no, path);
        bd_warn("spool: %s: %s at offset %" PRIu64 ", skipped %" PRIu64 " bytes", path, what, off,
                skipped);
    }
}

/* Open the reader on segs[0]; false when it cannot be read (then it is skipped, counted). */
static bool open_reader(struct bd_spool *s) {
    struct seg *seg = &s->segs[0];
    if (s->rfd >= 0 && s->rfd_no == seg->no) {
        return true;
    }
    close_reader(s);
    char path[PATH_CAP];
    seg_path(s, seg->no, path);
    s->rfd = open(path, O_RDONLY | O_CLOEXEC);
    if (s->rfd < 0) {
        if (errno == ENOENT) {
            s->st.missing_segments++;
        } else {
            s->st.corrupt_records++;
        }
        bd_warn("spool: %s: %s; its records are skipped", path, strerror(errno));
        return false;
    }
    s->rfd_no = seg->no;
    uint8_t h[SEG_HDR];
    if (seg->size >= SEG_HDR && pread_all(s, s->rfd, h, SEG_HDR, 0) == 0 &&
        !seg_header_ok(h, seg->no)) {
        bd_warn("spool: %s: damaged segment header; reading its records anyway", path);
    }
    return true;
}

int bd_spool_peek(struct bd_spool *s, struct bd_spool_record *rec) {
    for (;;) {
        if (s->peeked) {
            *rec = (struct bd_spool_record){.id = s->peek_id,
                                            .seq = s->peek_seq,
                                            .n_readings = (uint32_t)s->peek_readings,
                                            .flags = s->peek_flags,
                                            .segment = s->segs[0].no,
                                            .offset = s->peek_off,
                                            .data = s->buf,
                                            .len = s->peek_len};
            return 0;
        }
        if (s->n == 0) {
            return -ENOENT;
        }
        struct seg *seg = &s->segs[0];
        s->rd_off = BD_MAX(s->rd_off, (uint64_t)SEG_HDR);
        if (s->rd_off >= seg->size) {
            if (s->n == 1) {
                return -ENOENT;
            }
            remove_oldest(s, false);
            continue;
        }
        if (!open_reader(s)) {
            s->rd_off = seg->size;
            continue;
        }
        struct rec_hdr h;
        enum rec_state st;
        uint64_t off = s->rd_off;
        int rc = check_record(s, s->rfd, off, seg->size, true, &h, &st);
        if (rc == -ENOMEM) {
            return rc;
        }
        if (rc < 0) {
            s->st.corrupt_records++;
            log_corrupt(s, seg->no, off, seg->size - off, strerror(-rc));
            s->rd_off = seg->size;
            continue;
        }
        if (st == REC_OK) {
            s->peeked = true;
            s->peek_id = ++s->last_id;
            s->peek_next = off + REC_HDR + h.len;
            s->peek_seq = h.seq;
            s->peek_off = off;
            s->peek_flags = h.flags;
            s->peek_readings = h.n_readings;
            s->peek_len = h.len;
            s->st.replayed++;
            continue;
        }
        s->st.corrupt_records++;
        if (st == REC_BAD_PAYLOAD) {
            s->rd_off = off + REC_HDR + h.len;
            if (seg->counted) {
                seg->records -= BD_MIN(seg->records, 1);
                seg->readings -= BD_MIN(seg->readings, (uint64_t)h.n_readings);
            }
            log_corrupt(s, seg->no, off, REC_HDR + (uint64_t)h.len, "record check failed");
            continue;
        }
        rc = find_next(s, s->rfd, off + 1, seg->size, true, &s->rd_off);
        if (rc == -ENOMEM) {
            return rc;
        }
        if (rc < 0) {
            s->rd_off = seg->size;
        }
        log_corrupt(s, seg->no, off, s->rd_off - off, "no valid record header");
    }
}

int bd_spool_ack(struct bd_spool *s, uint64_t id) {
    if (!s->peeked || id != s->peek_id) {
        /* While a record is peeked, last_id is its id: a smaller one is gone already. */
        return id != 0 && id <= s->last_id ? 0 : -EINVAL;
    }
    struct seg *seg = &s->segs[0];
    if (seg->counted) {
        seg->records -= BD_MIN(seg->records, 1);
        seg->readings -= BD_MIN(seg->readings, s->peek_readings);
    }
    s->rd_off = s->peek_next;
    s->peeked = false;
    s->ckpt_dirty = true;
    s->st.acked++;
    if (s->n > 1 && s->rd_off >= seg->size) {
        release_finished(s); /* saves the checkpoint before deleting */
        return 0;
    }
    return s->o.sync == BD_SPOOL_SYNC_BATCH ? save_ckpt(s) : 0;
}

void bd_spool_set_max_bytes(struct bd_spool *s, uint64_t max_bytes) {
    /* Checked before every write, so a lower cap takes effect at the next append. */
    s->o.max_bytes = max_bytes == 0 ? UINT64_MAX : max_bytes;
}

bool bd_spool_holds(const struct bd_spool *s, uint64_t id) {
    return s->peeked && s->peek_id == id;
}

bool bd_spool_empty(const struct bd_spool *s) {
    return s->n == 0 || (s->n == 1 && !s->peeked && s->rd_off >= s->segs[0].size);
}

void bd_spool_get_stats(const struct bd_spool *s, struct bd_spool_stats *out) {
    *out = s->st;
    out->bytes = total_bytes(s);
    out->segments = s->n;
    out->records = out->readings = out->uncounted_segments = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->segs[i].counted) {
            out->records += s->segs[i].records;
            out->readings += s->segs[i].readings;
        } else {
            out->uncounted_segments++;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Open and recovery                                                                          */

/* spool.dir with its parents (common.h), then checked to be a writable directory. */
static int make_dirs(const char *dir, struct bd_err *err) {
    int rc = bd_mkdir_p(dir, 0700, err);
    if (rc < 0) {
        return rc;
    }
    struct stat st;
    if (stat(dir, &st) < 0) {
        int e = errno;
        return bd_err_set(err, -e, "spool.dir %s: %s", dir, strerror(e));
    }
    if (!S_ISDIR(st.st_mode)) {
        return bd_err_set(err, -ENOTDIR, "spool.dir %s: %s", dir, strerror(ENOTDIR));
    }
    if (access(dir, W_OK | X_OK) < 0) {
        int e = errno;
        return bd_err_set(err, -e, "spool.dir %s: cannot write: %s", dir, strerror(e));
    }
    return 0;
}

/* The checkpoint, if there is a sound one. A bad one is logged and counted, never an error. */
static bool load_ckpt(struct bd_spool *s, uint64_t *seg, uint64_t *off) {
    char path[PATH_CAP];
    uint8_t c[CKPT_LEN + 1];
    file_path(s, CKPT_FILE, path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) {
            return false;
        }
        bd_warn("spool: %s: %s; replay starts at the oldest segment", path, strerror(errno));
        s->st.bad_checkpoints++;
        return false;
    }
    ssize_t n;
    do {
        n = read(fd, c, sizeof(c));
    } while (n < 0 && errno == EINTR);
    close(fd);
    if (n > 0) {
        s->bytes_read += (uint64_t)n;
    }
    if (n != CKPT_LEN || memcmp(c, CKPT_MAGIC, 8) != 0 || bd_get_le32(c + 8) != FORMAT_VERSION ||
        bd_get_le32(c + 32) != bd_crc32c(0, c, 32) || bd_get_le64(c + 16) == 0 ||
        bd_get_le64(c + 24) < SEG_HDR) {
        bd_warn("spool: %s is damaged; replay starts at the oldest segment (records already "
                "acknowledged may be delivered again)",
                path);
        s->st.bad_checkpoints++;
        return false;
    }
    *seg = bd_get_le64(c + 16);
    *off = bd_get_le64(c + 24);
    return true;
}

static int cmp_seg(const void *a, const void *b) {
    uint64_t x = ((const struct seg *)a)->no, y = ((const struct seg *)b)->no;
    return x < y ? -1 : x > y;
}

/* The segment files present, sorted, with their sizes. */
static int list_segments(struct bd_spool *s, struct bd_err *err) {
    DIR *d = opendir(s->dir);
    if (d == NULL) {
        int e = errno;
        return bd_err_set(err, -e, "spool.dir %s: %s", s->dir, strerror(e));
    }
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        uint64_t no;
        struct stat st;
        char path[PATH_CAP];
        if (!parse_seg_name(de->d_name, &no)) {
            continue;
        }
        seg_path(s, no, path);
        if (stat(path, &st) < 0 || !S_ISREG(st.st_mode)) {
            continue;
        }
        if (s->n == s->cap) {
            size_t cap = s->cap ? s->cap * 2 : 16;
            struct seg *p = bd_reallocarray(s->segs, cap, sizeof(*p));
            if (p == NULL) {
                rc = bd_err_set(err, -ENOMEM, "spool: out of memory");
                break;
            }
            s->segs = p;
            s->cap = cap;
        }
        s->segs[s->n++] = (struct seg){.no = no, .size = (uint64_t)st.st_size};
    }
    closedir(d);
    if (s->n > 1) {
        qsort(s->segs, s->n, sizeof(s->segs[0]), cmp_seg);
    }
    return rc;
}

/* Give the newest segment a fresh header (it was created but its header never made it). */
static int reset_segment(struct bd_spool *s, int fd, uint64_t no) {
    uint8_t h[SEG_HDR];
    encode_seg_header(h, no);
    if (ftruncate(fd, 0) < 0) {
        return -errno;
    }
    int rc = bd_write_all(fd, h, sizeof(h));
    return rc < 0 ? rc : data_sync(s, fd);
}

/*
 * Read the newest segment through: count its records from the read position on, find its end,
 * cut off what follows the last valid record, and keep it open for appends. When it cannot be
 * opened or read, it is left as it is (replay copes) and appends go to a new segment.
 */
static void recover_last(struct bd_spool *s) {
    struct seg *seg = &s->segs[s->n - 1];
    char path[PATH_CAP];
    seg_path(s, seg->no, path);
    int fd = open(path, O_RDWR | O_APPEND | O_CLOEXEC);
    int rc = 0;
    if (fd < 0) {
        bd_warn("spool: %s: %s; appends go to a new segment", path, strerror(errno));
        return;
    }
    uint64_t from = s->n == 1 ? read_off(s) : SEG_HDR;
    uint64_t off = SEG_HDR, good_end = SEG_HDR, records = 0, readings = 0;
    uint8_t h[SEG_HDR];
    bool header_ok =
        seg->size >= SEG_HDR && pread_all(s, fd, h, SEG_HDR, 0) == 0 && seg_header_ok(h, seg->no);
    while (off < seg->size) {
        struct rec_hdr rh;
        enum rec_state st;
        rc = check_record(s, fd, off, seg->size, true, &rh, &st);
        if (rc < 0) {
            goto fail;
        }
        if (st == REC_OK) {
            off += REC_HDR + (uint64_t)rh.len;
            good_end = off;
            if (off > from) {
                records++;
                readings += rh.n_readings;
            }
        } else if (st == REC_BAD_PAYLOAD) {
            off += REC_HDR + (uint64_t)rh.len;
        } else {
            rc = find_next(s, fd, off + 1, seg->size, true, &off);
            if (rc < 0) {
                goto fail;
            }
        }
    }
    if (!header_ok && good_end == SEG_HDR) {
        /* Nothing valid in it: a creation cut short. Start it again. */
        rc = reset_segment(s, fd, seg->no);
        if (rc < 0) {
            goto fail;
        }
        if (seg->size > 0) {
            s->st.torn_tails++;
            bd_warn("spool: %s: no valid header or record in %" PRIu64 " bytes (an interrupted "
                    "creation); started it again",
                    path, seg->size);
        }
    } else if (good_end < seg->size) {
        if (ftruncate(fd, (off_t)good_end) < 0) {
            rc = -errno;
            goto fail;
        }
        rc = data_sync(s, fd);
        if (rc < 0) {
            goto fail;
        }
        s->st.torn_tails++;
        bd_warn("spool: %s: cut off %" PRIu64 " bytes after the last valid record at offset "
                "%" PRIu64 " (an interrupted write)",
                path, seg->size - good_end, good_end);
    } else if (!header_ok) {
        bd_warn("spool: %s: damaged segment header; its records are kept", path);
    }
    seg->size = good_end;
    seg->records = records;
    seg->readings = readings;
    seg->counted = true;
    s->wfd = fd;
    if (s->n == 1 && s->rd_off > good_end) {
        bd_warn("spool: the checkpoint points past the end of %s; nothing is left to replay "
                "there",
                path);
        s->rd_off = good_end;
        s->ckpt_dirty = true;
    }
    return;
fail:
    bd_warn("spool: %s: %s; appends go to a new segment", path, strerror(-rc));
    close(fd);
}

/* Descriptors and memory only: the files stay as they are. */
static void destroy(struct bd_spool *s) {
    if (s->wfd >= 0) {
        close(s->wfd);
    }
    close_reader(s);
    free(s->segs);
    free(s->wbuf);
    free(s->buf);
    free(s->scan);
    free(s);
}

static int check_opts(const struct bd_spool_opts *o, struct bd_err *err) {
    if (o == NULL || o->dir == NULL || o->dir[0] == '\0') {
        return bd_err_set(err, -EINVAL, "spool: no directory given");
    }
    if (strlen(o->dir) >= DIR_CAP) {
        return bd_err_set(err, -ENAMETOOLONG, "spool.dir %s: %s", o->dir, strerror(ENAMETOOLONG));
    }
    if ((unsigned)o->sync > BD_SPOOL_SYNC_BATCH || (unsigned)o->full > BD_SPOOL_BLOCK) {
        return bd_err_set(err, -EINVAL, "spool: bad sync or full policy");
    }
    return 0;
}

int bd_spool_open(struct bd_spool **out, const struct bd_spool_opts *o, struct bd_err *err) {
    struct bd_spool *s = NULL;
    int rc = check_opts(o, err);
    *out = NULL;
    if (rc < 0) {
        return rc;
    }
    s = bd_calloc(1, sizeof(*s));
    if (s == NULL) {
        return bd_err_set(err, -ENOMEM, "spool: out of memory");
    }
    snprintf(s->dir, sizeof(s->dir), "%s", o->dir);
    s->o = *o;
    s->o.dir = s->dir;
    if (s->o.max_bytes == 0) {
        s->o.max_bytes = UINT64_MAX;
    }
    if (s->o.segment_bytes == 0) {
        s->o.segment_bytes = BD_SPOOL_DEFAULT_SEGMENT_BYTES;
    }
    if (s->o.sync_interval_ms == 0) {
        s->o.sync_interval_ms = BD_SPOOL_DEFAULT_SYNC_INTERVAL_MS;
    }
    s->wfd = -1;
    s->rfd = -1;
    s->corrupt_log.interval_ns = 60 * BD_NS_PER_S;
    s->corrupt_log.burst = 10;

    rc = make_dirs(s->dir, err);
    if (rc == 0) {
        rc = list_segments(s, err);
    }
    if (rc < 0) {
        goto out;
    }
    char path[PATH_CAP];
    file_path(s, CKPT_TMP_FILE, path);
    (void)unlink(path);

    uint64_t ck_seg = 0, ck_off = SEG_HDR;
    bool have_ckpt = load_ckpt(s, &ck_seg, &ck_off);
    if (!have_ckpt) {
        if (s->n > 0 && s->st.bad_checkpoints == 0) {
            bd_info("spool: %s: no checkpoint; replay starts at the oldest segment", s->dir);
        }
        s->ckpt_dirty = s->n > 0 || s->st.bad_checkpoints > 0;
    }

    /* Deletes a crash cut short: every segment below the checkpoint's read segment is done. */
    size_t done = 0;
    while (have_ckpt && done < s->n && s->segs[done].no < ck_seg) {
        seg_path(s, s->segs[done].no, path);
        if (unlink(path) < 0 && errno != ENOENT) {
            bd_warn("spool: cannot delete %s: %s", path, strerror(errno));
        }
        done++;
    }
    if (done > 0) {
        memmove(&s->segs[0], &s->segs[done], (s->n - done) * sizeof(s->segs[0]));
        s->n -= done;
        (void)sync_dir(s);
    }

    /* The read position, and the gaps from it on. */
    s->rd_off = SEG_HDR;
    if (have_ckpt && s->n > 0) {
        if (s->segs[0].no == ck_seg) {
            s->rd_off = ck_off;
        } else {
            s->st.missing_segments += s->segs[0].no - ck_seg;
        }
    }
    for (size_t i = 1; i < s->n; i++) {
        s->st.missing_segments += s->segs[i].no - s->segs[i - 1].no - 1;
    }
    if (s->st.missing_segments > 0) {
        bd_warn("spool: %s: %" PRIu64 " segments missing from the sequence; their records are "
                "lost",
                s->dir, s->st.missing_segments);
    }
    s->next_no = s->n > 0 ? s->segs[s->n - 1].no + 1 : 1;
    if (have_ckpt && ck_seg > s->next_no) {
        s->next_no = ck_seg;
    }

    if (s->n > 0) {
        recover_last(s);
    }
    s->st.recovery_bytes_read = s->bytes_read;
    if (s->wfd < 0) {
        /* The directory must take a new segment: the one real error an open can report. */
        rc = rotate(s);
        if (rc < 0) {
            seg_path(s, s->next_no - 1, path);
            rc = bd_err_set(err, rc, "spool.dir %s: cannot create %s: %s", s->dir, path,
                            strerror(-rc));
            goto out;
        }
    }
out:
    if (rc < 0) {
        destroy(s);
        return rc;
    }
    *out = s;
    return 0;
}

void bd_spool_close(struct bd_spool *s) {
    if (s == NULL) {
        return;
    }
    (void)bd_spool_flush(s);
    destroy(s);
}
