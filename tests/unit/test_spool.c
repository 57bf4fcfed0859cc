/*
 * The on-disk spool (src/spool.c): FIFO delivery across segment rotations and reopens, crashes
 * at every step of the write / checkpoint / delete sequence (a forked child exits at the step,
 * the parent reopens), damage on disk (torn tail, flipped bytes, a missing segment, a missing or
 * garbage checkpoint), the byte cap under each full policy, a full disk (RLIMIT_FSIZE), bad
 * directories, and a start-up that reads only the newest segment.
 *
 * Every record's payload, length and n_readings follow from its seq, so what a test expects
 * comes from what it appended. Records of LEN bytes take REC bytes on disk, and a segment of
 * SEG bytes holds PER_SEG of them.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bucketd/spool.h"

#define LEN 100
#define REC (BD_SPOOL_RECORD_HEADER_BYTES + LEN)
#define SEG 1024
#define PER_SEG ((SEG - BD_SPOOL_SEGMENT_HEADER_BYTES) / REC) /* 7 */

static char base[256];
static char dir[300];

static void make_dir(void) {
    snprintf(base, sizeof(base), "/tmp/bd-spool-test-XXXXXX");
    cr_assert_not_null(mkdtemp(base));
    snprintf(dir, sizeof(dir), "%s/spool", base);
}

static void remove_dir(void) {
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "chmod -R u+rwx '%s'; rm -rf '%s'", base, base);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(spool, .init = make_dir, .fini = remove_dir);

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                    */

static size_t fixed_len(uint64_t seq) {
    (void)seq;
    return LEN;
}

static size_t varied_len(uint64_t seq) {
    return (size_t)((seq * 37) % 601);
}

static uint32_t readings_of(uint64_t seq) {
    return (uint32_t)(seq % 50 + 1);
}

static uint8_t byte_of(uint64_t seq, size_t i) {
    return (uint8_t)(seq * 131 + i * 7 + 1);
}

static struct bd_spool_opts opts(uint64_t seg_bytes, uint64_t max_bytes, enum bd_spool_sync sync,
                                 enum bd_spool_full full) {
    return (struct bd_spool_opts){
        .dir = dir, .max_bytes = max_bytes, .segment_bytes = seg_bytes, .sync = sync, .full = full};
}

static struct bd_spool *open_ok(const struct bd_spool_opts *o) {
    struct bd_spool *s = NULL;
    struct bd_err err = {0};
    cr_assert_eq(bd_spool_open(&s, o, &err), 0, "%s", err.msg);
    cr_assert_not_null(s);
    return s;
}

static int append_seq(struct bd_spool *s, uint64_t seq, size_t (*len_of)(uint64_t)) {
    uint8_t buf[1024];
    size_t len = len_of(seq);
    cr_assert_leq(len, sizeof(buf));
    for (size_t i = 0; i < len; i++) {
        buf[i] = byte_of(seq, i);
    }
    return bd_spool_append(s, seq, readings_of(seq), 0, buf, len);
}

static void append_ok(struct bd_spool *s, uint64_t from, uint64_t to, size_t (*len_of)(uint64_t)) {
    for (uint64_t seq = from; seq < to; seq++) {
        cr_assert_eq(append_seq(s, seq, len_of), 0, "append of seq %llu", (unsigned long long)seq);
    }
}

static void check_record(const struct bd_spool_record *r, size_t (*len_of)(uint64_t)) {
    cr_assert_eq(r->len, len_of(r->seq), "seq %llu: length", (unsigned long long)r->seq);
    cr_assert_eq(r->n_readings, readings_of(r->seq));
    for (size_t i = 0; i < r->len; i++) {
        cr_assert_eq(r->data[i], byte_of(r->seq, i), "seq %llu byte %zu",
                     (unsigned long long)r->seq, i);
    }
}

/* Peek, check and acknowledge up to `max` records; their seqs go to out. Returns how many. */
static size_t take(struct bd_spool *s, uint64_t *out, size_t max, size_t (*len_of)(uint64_t)) {
    size_t n = 0;
    struct bd_spool_record r;
    while (n < max) {
        int rc = bd_spool_peek(s, &r);
        if (rc == -ENOENT) {
            break;
        }
        cr_assert_eq(rc, 0);
        check_record(&r, len_of);
        out[n++] = r.seq;
        cr_assert_eq(bd_spool_ack(s, r.id), 0);
    }
    return n;
}

/* Everything left is exactly seqs [first, last), in order, and then the spool is empty. */
static void expect_rest(struct bd_spool *s, uint64_t first, uint64_t last,
                        size_t (*len_of)(uint64_t)) {
    static uint64_t got[4096];
    size_t n = take(s, got, BD_ARRAY_LEN(got), len_of);
    cr_assert_eq(n, last - first, "%zu records delivered, %llu expected (first %llu)", n,
                 (unsigned long long)(last - first), (unsigned long long)first);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(got[i], first + i, "record %zu is seq %llu, want %llu", i,
                     (unsigned long long)got[i], (unsigned long long)(first + i));
    }
    cr_assert(bd_spool_empty(s));
}

static void seg_file(uint64_t no, char *out, size_t cap) {
    snprintf(out, cap, "%s/spool-%016llx.seg", dir, (unsigned long long)no);
}

static bool seg_exists(uint64_t no) {
    char p[400];
    struct stat st;
    seg_file(no, p, sizeof(p));
    return stat(p, &st) == 0;
}

/* Sum of the segment files' sizes, and how many there are. */
static uint64_t disk_bytes(uint64_t *files) {
    uint64_t total = 0, n = 0;
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, "spool-", 6) == 0 && strstr(de->d_name, ".seg") != NULL) {
            char p[600];
            struct stat st;
            snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
            cr_assert_eq(stat(p, &st), 0);
            total += (uint64_t)st.st_size;
            n++;
        }
    }
    closedir(d);
    if (files != NULL) {
        *files = n;
    }
    return total;
}

/* The stats' view of the files matches the directory's. */
static void check_disk(const struct bd_spool *s) {
    struct bd_spool_stats st;
    uint64_t files = 0;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(disk_bytes(&files), st.bytes);
    cr_assert_eq(files, st.segments);
}

static void flip_byte(uint64_t seg_no, uint64_t off) {
    char p[400];
    uint8_t b;
    seg_file(seg_no, p, sizeof(p));
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0, "%s", p);
    cr_assert_eq(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x5a;
    cr_assert_eq(pwrite(fd, &b, 1, (off_t)off), 1);
    close(fd);
}

/* Offset of the i-th fixed-length record of a segment. */
static uint64_t rec_off(int i) {
    return BD_SPOOL_SEGMENT_HEADER_BYTES + (uint64_t)i * REC;
}

static void *shared_mem(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(p, MAP_FAILED);
    memset(p, 0, n);
    return p;
}

/* ------------------------------------------------------------------------------------------ */
/* Delivery                                                                                   */

Test(spool, fifo_across_rotations) {
    struct bd_spool_opts o = opts(2048, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    struct bd_spool_record r, again;
    uint64_t got[400];
    size_t n = 0;

    cr_assert(bd_spool_empty(s));
    cr_assert_eq(bd_spool_peek(s, &r), -ENOENT);
    /* Two appends for each record taken, so the reader trails the writer by many segments. */
    for (uint64_t seq = 0; seq < 300; seq++) {
        cr_assert_eq(append_seq(s, seq, varied_len), 0);
        if (seq % 2 == 1) {
            n += take(s, got + n, 1, varied_len);
        }
        if (seq == 150) {
            struct bd_spool_stats st;
            bd_spool_get_stats(s, &st);
            cr_assert_gt(st.segments, 5, "several segments are pending");
            cr_assert_eq(st.records, 151 - n);
            check_disk(s);
        }
    }
    /* peek returns the same record until it is acknowledged, ack takes only that one. */
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(bd_spool_peek(s, &again), 0);
    cr_assert_eq(r.id, again.id);
    cr_assert_eq(r.seq, again.seq);
    cr_assert_eq(bd_spool_ack(s, r.id + 1), -EINVAL);
    cr_assert_eq(bd_spool_ack(s, 0), -EINVAL);
    cr_assert_not(bd_spool_empty(s));

    n += take(s, got + n, BD_ARRAY_LEN(got) - n, varied_len);
    cr_assert_eq(n, 300);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(got[i], i);
    }
    cr_assert(bd_spool_empty(s));
    cr_assert_eq(bd_spool_ack(s, r.id), 0, "an id acknowledged before is gone: 0");

    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.appended, 300);
    cr_assert_eq(st.replayed, 300);
    cr_assert_eq(st.acked, 300);
    cr_assert_eq(st.records, 0);
    cr_assert_eq(st.readings, 0);
    cr_assert_eq(st.segments, 1, "finished segments are deleted");
    cr_assert_eq(st.corrupt_records + st.torn_tails + st.missing_segments, 0);
    uint64_t bytes = 0;
    for (uint64_t seq = 0; seq < 300; seq++) {
        bytes += varied_len(seq);
    }
    cr_assert_eq(st.appended_bytes, bytes);
    check_disk(s);

    /* A record bigger than a segment gets one of its own. */
    uint8_t *big = calloc(1, 5000);
    cr_assert_eq(bd_spool_append(s, 1000, 3, 0, big, 5000), 0);
    cr_assert_eq(append_seq(s, 1001, varied_len), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.segments, 2, "the finished segment went when the big record started one");
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(r.len, 5000);
    cr_assert_eq(memcmp(r.data, big, 5000), 0);
    cr_assert_eq(bd_spool_ack(s, r.id), 0);
    expect_rest(s, 1001, 1002, varied_len);
    free(big);
    check_disk(s);
    bd_spool_close(s);
}

Test(spool, reopen_delivers_exactly_the_unacknowledged_records) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    uint64_t got[64];
    append_ok(s, 0, 60, fixed_len);
    cr_assert_eq(take(s, got, 23, fixed_len), 23);
    /* Peeked but not acknowledged: still owed after a restart. */
    struct bd_spool_record r;
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(r.seq, 23);
    bd_spool_close(s);

    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    /* 60 records, 7 a segment: segments 1-9, the first 3 (records 0-20) deleted. */
    cr_assert_eq(st.segments, 6);
    cr_assert_eq(st.uncounted_segments, 5, "older segments are not read at open");
    cr_assert_eq(st.records, 60 - 8 * PER_SEG, "the newest segment is counted");
    cr_assert_eq(st.replayed + st.acked + st.corrupt_records + st.torn_tails, 0);
    check_disk(s);
    expect_rest(s, 23, 60, fixed_len);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.records, 0);
    cr_assert_eq(st.uncounted_segments, 0);

    append_ok(s, 60, 65, fixed_len);
    bd_spool_close(s);
    s = open_ok(&o);
    expect_rest(s, 60, 65, fixed_len);
    bd_spool_close(s);
    s = open_ok(&o);
    cr_assert(bd_spool_empty(s));
    bd_spool_close(s);
}

/* ------------------------------------------------------------------------------------------ */
/* Crashes                                                                                    */

enum { IDLE, APPENDING, ACKING };

struct progress {
    int appended; /* appends that returned 0: seqs [0, appended) */
    int acked;    /* acks that returned 0: seqs [0, acked) */
    int inflight; /* what the child was doing when it stopped */
};

/*
 * Child: 10 records, 3 acknowledged, then the crash step armed and, in turn, one append and one
 * acknowledgement until the step is reached. sync=batch, so each call is durable on return.
 */
static void crash_child(int step, struct progress *p) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = NULL;
    struct bd_spool_record r;
    if (bd_spool_open(&s, &o, NULL) < 0) {
        _exit(1);
    }
    for (int i = 0; i < 10; i++) {
        if (append_seq(s, (uint64_t)i, fixed_len) < 0) {
            _exit(2);
        }
        p->appended++;
    }
    for (int i = 0; i < 3; i++) {
        if (bd_spool_peek(s, &r) < 0 || bd_spool_ack(s, r.id) < 0) {
            _exit(3);
        }
        p->acked++;
    }
    bd_spool_crash_at(step);
    for (int i = 0; i < 100; i++) {
        p->inflight = APPENDING;
        if (append_seq(s, (uint64_t)p->appended, fixed_len) < 0) {
            _exit(4);
        }
        p->appended++;
        p->inflight = ACKING;
        if (bd_spool_peek(s, &r) < 0 || bd_spool_ack(s, r.id) < 0) {
            _exit(5);
        }
        p->acked++;
        p->inflight = IDLE;
    }
    _exit(0); /* the step was never reached */
}

/*
 * Run the child to the crash, reopen, and check what comes back. A killed process keeps the page
 * cache, so the outcome is exact: `ack_done` says whether the acknowledgement in progress took
 * effect (its checkpoint was renamed into place), `append_done` whether the append in progress
 * left its record. Both are within the promise for power loss (spool.h): everything appended
 * and not acknowledged comes back exactly once, the operation in progress either way.
 */
static void crash_case(int step, int want_inflight, bool ack_done, bool append_done) {
    struct progress *p = shared_mem(sizeof(*p));
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        crash_child(step, p);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == BD_SPOOL_CRASH_EXIT,
              "the child stopped at the crash step (status %d)", status);
    cr_assert_eq(p->inflight, want_inflight);

    uint64_t first = (uint64_t)p->acked + (ack_done && p->inflight == ACKING);
    uint64_t last = (uint64_t)p->appended + (append_done && p->inflight == APPENDING);
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.corrupt_records + st.missing_segments + st.bad_checkpoints, 0);
    cr_assert_eq(st.torn_tails, step == BD_SPOOL_CRASH_RECORD_TORN ? 1u : 0u);
    check_disk(s);
    if (p->inflight == ACKING && ack_done) {
        /* The acknowledgement that finished a segment: the segment is gone after the open. */
        uint64_t seg_no = (uint64_t)p->acked / PER_SEG + 1;
        if ((uint64_t)(p->acked + 1) % PER_SEG == 0) {
            cr_assert_not(seg_exists(seg_no), "segment %llu deleted", (unsigned long long)seg_no);
        }
    }
    expect_rest(s, first, last, fixed_len);
    /* And the spool goes on working. */
    append_ok(s, 1000, 1010, fixed_len);
    expect_rest(s, 1000, 1010, fixed_len);
    bd_spool_close(s);
    munmap(p, sizeof(*p));
}

Test(spool, crash_with_a_record_half_written) {
    crash_case(BD_SPOOL_CRASH_RECORD_TORN, APPENDING, false, false);
}

Test(spool, crash_after_a_record_is_written_before_its_sync) {
    crash_case(BD_SPOOL_CRASH_RECORD_WRITTEN, APPENDING, false, true);
}

Test(spool, crash_after_a_segment_is_created_before_the_directory_sync) {
    crash_case(BD_SPOOL_CRASH_SEGMENT_CREATED, APPENDING, false, false);
}

Test(spool, crash_after_the_temp_checkpoint_before_the_rename) {
    /* The only at-least-once case under sync=batch: the record being acknowledged comes back. */
    crash_case(BD_SPOOL_CRASH_CKPT_TMP_WRITTEN, ACKING, false, false);
    char p[400];
    struct stat st;
    snprintf(p, sizeof(p), "%s/spool.ckpt.tmp", dir);
    cr_assert_neq(stat(p, &st), 0, "the open removed the temp checkpoint");
}

Test(spool, crash_after_the_checkpoint_rename_before_the_directory_sync) {
    crash_case(BD_SPOOL_CRASH_CKPT_RENAMED, ACKING, true, false);
}

Test(spool, crash_after_recording_a_delete_before_the_unlink) {
    crash_case(BD_SPOOL_CRASH_DELETE_RECORDED, ACKING, true, false);
}

Test(spool, crash_after_the_unlink_before_the_directory_sync) {
    crash_case(BD_SPOOL_CRASH_DELETE_UNLINKED, ACKING, true, false);
}

/*
 * With sync=none and sync=interval an acknowledgement is kept in memory until the checkpoint is
 * saved: a crash before that delivers those records again (at-least-once), one after it does not.
 */
static void unsaved_ack_child(enum bd_spool_sync sync, int how) {
    struct bd_spool_opts o = opts(1 << 20, 0, sync, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = NULL;
    struct bd_spool_record r;
    if (bd_spool_open(&s, &o, NULL) < 0) {
        _exit(1);
    }
    for (int i = 0; i < 10; i++) {
        if (append_seq(s, (uint64_t)i, fixed_len) < 0) {
            _exit(2);
        }
    }
    if (bd_spool_tick(s, 1 * BD_NS_PER_S) < 0) {
        _exit(3);
    }
    for (int i = 0; i < 5; i++) {
        if (bd_spool_peek(s, &r) < 0 || bd_spool_ack(s, r.id) < 0) {
            _exit(4);
        }
    }
    if (how == 1 && bd_spool_flush(s) < 0) {
        _exit(5);
    }
    if (how == 2) {
        (void)bd_spool_tick(s, 1 * BD_NS_PER_S + 999 * BD_NS_PER_MS); /* too early */
    }
    if (how == 3 && bd_spool_tick(s, 2 * BD_NS_PER_S) < 0) {
        _exit(6);
    }
    _exit(BD_SPOOL_CRASH_EXIT);
}

static void unsaved_ack_case(enum bd_spool_sync sync, int how, uint64_t first) {
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        unsaved_ack_child(sync, how);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == BD_SPOOL_CRASH_EXIT, "status %d", status);
    struct bd_spool_opts o = opts(1 << 20, 0, sync, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    expect_rest(s, first, 10, fixed_len);
    bd_spool_close(s);
}

Test(spool, crash_with_unsaved_acknowledgements_delivers_them_again) {
    unsaved_ack_case(BD_SPOOL_SYNC_NONE, 0, 0);
    remove_dir();
    make_dir();
    unsaved_ack_case(BD_SPOOL_SYNC_NONE, 1, 5); /* bd_spool_flush saved them */
    remove_dir();
    make_dir();
    unsaved_ack_case(BD_SPOOL_SYNC_INTERVAL, 2, 0); /* the interval had not passed */
    remove_dir();
    make_dir();
    unsaved_ack_case(BD_SPOOL_SYNC_INTERVAL, 3, 5); /* it had: the tick saved them */
}

Test(spool, tick_syncs_by_policy) {
    struct bd_spool_stats st;
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_INTERVAL, BD_SPOOL_DROP_OLDEST);
    o.sync_interval_ms = 500;
    struct bd_spool *s = open_ok(&o);
    int64_t t = 10 * BD_NS_PER_S;
    bd_spool_get_stats(s, &st);
    uint64_t syncs = st.syncs;

    append_ok(s, 0, 1, fixed_len);
    cr_assert_eq(bd_spool_tick(s, t), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs + 1, "unsynced data: the first tick syncs");
    append_ok(s, 1, 2, fixed_len);
    cr_assert_eq(bd_spool_tick(s, t + 499 * BD_NS_PER_MS), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs + 1, "not before the interval");
    cr_assert_eq(bd_spool_tick(s, t + 500 * BD_NS_PER_MS), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs + 2);
    cr_assert_eq(bd_spool_tick(s, t + 5 * BD_NS_PER_S), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs + 2, "nothing to sync");
    cr_assert_eq(bd_spool_flush(s), 0);
    bd_spool_close(s);

    /* none: never from tick; batch: every append. */
    o.sync = BD_SPOOL_SYNC_NONE;
    s = open_ok(&o);
    bd_spool_get_stats(s, &st);
    syncs = st.syncs;
    append_ok(s, 2, 3, fixed_len);
    cr_assert_eq(bd_spool_tick(s, t + 100 * BD_NS_PER_S), 0);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs);
    bd_spool_close(s);
    o.sync = BD_SPOOL_SYNC_BATCH;
    s = open_ok(&o);
    bd_spool_get_stats(s, &st);
    syncs = st.syncs;
    append_ok(s, 3, 6, fixed_len);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.syncs, syncs + 3);
    expect_rest(s, 0, 6, fixed_len);
    bd_spool_close(s);
}

/* ------------------------------------------------------------------------------------------ */
/* Damage on disk                                                                             */

Test(spool, torn_tail_is_cut_off) {
    struct bd_spool_opts o = opts(4096, 0, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 5, fixed_len);
    bd_spool_close(s);
    char p[400];
    seg_file(1, p, sizeof(p));
    /* The last record loses its end; then a second run where only part of a header is left. */
    cr_assert_eq(truncate(p, (off_t)rec_off(5) - 10), 0);

    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.torn_tails, 1);
    cr_assert_eq(st.records, 4);
    struct stat sb;
    cr_assert_eq(stat(p, &sb), 0);
    cr_assert_eq((uint64_t)sb.st_size, rec_off(4), "cut at the end of the last whole record");
    append_ok(s, 5, 7, fixed_len); /* at offsets rec_off(4) and rec_off(5) */
    bd_spool_close(s);
    cr_assert_eq(truncate(p, (off_t)rec_off(5) + 7), 0);

    s = open_ok(&o);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.torn_tails, 1);
    cr_assert_eq(st.corrupt_records, 0);
    uint64_t got[8];
    cr_assert_eq(take(s, got, 8, fixed_len), 5);
    cr_assert(got[0] == 0 && got[1] == 1 && got[2] == 2 && got[3] == 3 && got[4] == 5);
    bd_spool_close(s);
}

Test(spool, flipped_bytes_skip_only_the_damaged_records) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 3 * PER_SEG, fixed_len); /* segments 1-3 full */
    bd_spool_close(s);
    flip_byte(1, rec_off(2) + BD_SPOOL_RECORD_HEADER_BYTES + 50); /* seq 2's payload */
    flip_byte(1, rec_off(4) + 4);                                 /* seq 4's length */
    flip_byte(3, rec_off(2) + BD_SPOOL_RECORD_HEADER_BYTES + 1);  /* seq 16, newest segment */

    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.torn_tails, 0, "damage followed by valid records is not a torn tail");
    cr_assert_eq(st.records, PER_SEG - 1, "the newest segment counts its valid records");
    uint64_t got[32];
    size_t n = take(s, got, 32, fixed_len);
    cr_assert_eq(n, 3 * PER_SEG - 3);
    for (size_t i = 0, seq = 0; i < n; i++, seq++) {
        while (seq == 2 || seq == 4 || seq == 16) {
            seq++;
        }
        cr_assert_eq(got[i], seq, "record %zu", i);
    }
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.corrupt_records, 3);
    cr_assert(bd_spool_empty(s));
    bd_spool_close(s);
}

Test(spool, garbage_between_records_is_scanned_past) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 2 * PER_SEG, fixed_len);
    bd_spool_close(s);
    /* Zeros over all of seq 2 and the start of seq 3's header: one damaged stretch. */
    char p[400];
    uint8_t zeros[2 * REC];
    memset(zeros, 0, sizeof(zeros));
    seg_file(1, p, sizeof(p));
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    cr_assert_eq(pwrite(fd, zeros, REC + 10, (off_t)rec_off(2)), REC + 10);
    close(fd);

    s = open_ok(&o);
    uint64_t got[32];
    size_t n = take(s, got, 32, fixed_len);
    cr_assert_eq(n, 2 * PER_SEG - 2);
    cr_assert(got[0] == 0 && got[1] == 1 && got[2] == 4 && got[3] == 5);
    cr_assert_eq(got[n - 1], 2 * PER_SEG - 1);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.corrupt_records, 1, "one damaged stretch, one count");
    bd_spool_close(s);
}

Test(spool, missing_segment_is_skipped_and_counted) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 3 * PER_SEG, fixed_len);
    bd_spool_close(s);
    char p[400];
    seg_file(2, p, sizeof(p));
    cr_assert_eq(unlink(p), 0);

    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.missing_segments, 1);
    uint64_t got[32];
    size_t n = take(s, got, 32, fixed_len);
    cr_assert_eq(n, 2 * PER_SEG);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(got[i], i < PER_SEG ? i : i + PER_SEG, "record %zu", i);
    }
    bd_spool_close(s);
}

/* 3 segments, 10 records acknowledged (segment 1 deleted, 3 records of segment 2 done). */
static void ten_acknowledged(void) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    uint64_t got[16];
    append_ok(s, 0, 3 * PER_SEG, fixed_len);
    cr_assert_eq(take(s, got, 10, fixed_len), 10);
    bd_spool_close(s);
    cr_assert_not(seg_exists(1));
}

Test(spool, missing_checkpoint_starts_at_the_oldest_segment) {
    ten_acknowledged();
    char p[400];
    snprintf(p, sizeof(p), "%s/spool.ckpt", dir);
    cr_assert_eq(unlink(p), 0);
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.bad_checkpoints + st.missing_segments, 0);
    /* Seqs 7-9 were acknowledged but their segment remains: delivered again (idempotent). */
    expect_rest(s, PER_SEG, 3 * PER_SEG, fixed_len);
    bd_spool_close(s);
}

Test(spool, garbage_checkpoint_starts_at_the_oldest_segment) {
    ten_acknowledged();
    char p[400];
    snprintf(p, sizeof(p), "%s/spool.ckpt", dir);
    static const char *const bad[] = {"garbage, not a checkpoint, forty bytes..", "BDSPCKPT", ""};
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    for (size_t i = 0; i < BD_ARRAY_LEN(bad); i++) {
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        cr_assert_geq(fd, 0);
        cr_assert_eq(write(fd, bad[i], strlen(bad[i])), (ssize_t)strlen(bad[i]));
        close(fd);
        struct bd_spool *s = open_ok(&o);
        struct bd_spool_stats st;
        bd_spool_get_stats(s, &st);
        cr_assert_eq(st.bad_checkpoints, 1, "checkpoint %zu", i);
        struct bd_spool_record r;
        cr_assert_eq(bd_spool_peek(s, &r), 0);
        cr_assert_eq(r.seq, PER_SEG, "from the oldest segment");
        bd_spool_close(s);
    }
    /* A flipped bit in an otherwise sound checkpoint. */
    struct bd_spool *s = open_ok(&o);
    uint64_t got[4];
    cr_assert_eq(take(s, got, 3, fixed_len), 3);
    bd_spool_close(s);
    int fd = open(p, O_RDWR);
    uint8_t c[BD_SPOOL_CHECKPOINT_BYTES];
    cr_assert_eq(read(fd, c, sizeof(c)), (ssize_t)sizeof(c));
    c[24] ^= 1;
    cr_assert_eq(pwrite(fd, c, sizeof(c), 0), (ssize_t)sizeof(c));
    close(fd);
    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.bad_checkpoints, 1);
    bd_spool_close(s); /* saves a sound checkpoint again */
    s = open_ok(&o);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.bad_checkpoints, 0);
    expect_rest(s, PER_SEG, 3 * PER_SEG, fixed_len);
    bd_spool_close(s);
}

/* ------------------------------------------------------------------------------------------ */
/* Space                                                                                      */

#define CAP 4096

/* The record being replayed (peeked) goes with its segment, but is not counted as dropped: its
 * reader writes it from memory. */
Test(spool, drop_oldest_keeps_the_files_under_the_cap) {
    struct bd_spool_opts o = opts(SEG, CAP, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    struct bd_spool_record r;
    uint64_t got[128];
    size_t n = 0;

    append_ok(s, 0, 5, fixed_len);
    n += take(s, got + n, 2, fixed_len);
    cr_assert_eq(bd_spool_peek(s, &r), 0); /* seq 2, in the segment that will be dropped */
    cr_assert(bd_spool_holds(s, r.id));
    for (uint64_t seq = 5; seq < 100; seq++) {
        cr_assert_eq(append_seq(s, seq, fixed_len), 0);
        cr_assert_leq(disk_bytes(NULL), CAP, "after seq %llu", (unsigned long long)seq);
        check_disk(s);
    }
    cr_assert_not(bd_spool_holds(s, r.id), "its segment is gone");
    cr_assert_eq(bd_spool_ack(s, r.id), 0, "the peeked record was dropped: nothing to do");
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    uint64_t first = 100 - st.records;
    cr_assert_eq(first % PER_SEG, 0, "whole segments went");
    cr_assert_eq(st.dropped_records, first - 3, "seq 3 on: seq 2 is its reader's");
    uint64_t readings = 0;
    for (uint64_t seq = 3; seq < first; seq++) {
        readings += readings_of(seq);
    }
    cr_assert_eq(st.dropped_readings, readings);
    expect_rest(s, first, 100, fixed_len);
    bd_spool_close(s);
}

Test(spool, drop_oldest_of_an_uncounted_segment_counts_it_from_disk) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 3 * PER_SEG, fixed_len);
    bd_spool_close(s);
    o.max_bytes = 3 * (BD_SPOOL_SEGMENT_HEADER_BYTES + PER_SEG * REC);
    s = open_ok(&o);
    append_ok(s, 100, 101, fixed_len);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, PER_SEG);
    uint64_t readings = 0;
    for (uint64_t seq = 0; seq < PER_SEG; seq++) {
        readings += readings_of(seq);
    }
    cr_assert_eq(st.dropped_readings, readings);
    cr_assert_leq(disk_bytes(NULL), o.max_bytes);
    uint64_t got[32];
    size_t n = take(s, got, 32, fixed_len);
    cr_assert_eq(n, 2 * PER_SEG + 1);
    for (size_t i = 0; i < 2 * PER_SEG; i++) {
        cr_assert_eq(got[i], PER_SEG + i);
    }
    cr_assert_eq(got[n - 1], 100);
    bd_spool_close(s);
}

/* The same with a segment an earlier run wrote (counted from disk when dropped) and the only
 * segment there is: the record being replayed is not counted either way. */
Test(spool, drop_oldest_never_counts_the_record_being_replayed) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 3 * PER_SEG, fixed_len);
    bd_spool_close(s);
    o.max_bytes = 3 * (BD_SPOOL_SEGMENT_HEADER_BYTES + PER_SEG * REC);
    s = open_ok(&o);
    struct bd_spool_record r;
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(r.seq, 0);
    append_ok(s, 100, 101, fixed_len);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, PER_SEG - 1);
    uint64_t readings = 0;
    for (uint64_t seq = 1; seq < PER_SEG; seq++) {
        readings += readings_of(seq);
    }
    cr_assert_eq(st.dropped_readings, readings);
    cr_assert_not(bd_spool_holds(s, r.id));
    cr_assert_eq(bd_spool_ack(s, r.id), 0);
    bd_spool_close(s);

    remove_dir();
    make_dir();
    uint64_t cap = BD_SPOOL_SEGMENT_HEADER_BYTES + 14 * REC + 10;
    o = opts(1 << 20, cap, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    s = open_ok(&o);
    append_ok(s, 0, 14, fixed_len);
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(bd_spool_ack(s, r.id), 0);
    cr_assert_eq(bd_spool_peek(s, &r), 0);
    cr_assert_eq(r.seq, 1);
    append_ok(s, 14, 15, fixed_len);
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, 12, "seqs 2 to 13");
    readings = 0;
    for (uint64_t seq = 2; seq < 14; seq++) {
        readings += readings_of(seq);
    }
    cr_assert_eq(st.dropped_readings, readings);
    cr_assert_not(bd_spool_holds(s, r.id));
    expect_rest(s, 14, 15, fixed_len);
    bd_spool_close(s);
}

Test(spool, drop_oldest_with_a_single_segment_drops_it_whole) {
    uint64_t cap = BD_SPOOL_SEGMENT_HEADER_BYTES + 14 * REC + 10;
    struct bd_spool_opts o = opts(1 << 20, cap, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    append_ok(s, 0, 15, fixed_len);
    cr_assert_leq(disk_bytes(NULL), cap);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, 14);
    cr_assert_eq(st.segments, 1);
    check_disk(s);
    expect_rest(s, 14, 15, fixed_len);
    bd_spool_close(s);
    s = open_ok(&o);
    cr_assert(bd_spool_empty(s));
    bd_spool_close(s);
}

Test(spool, drop_newest_refuses_and_counts) {
    struct bd_spool_opts o = opts(SEG, CAP, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_NEWEST);
    struct bd_spool *s = open_ok(&o);
    uint64_t accepted = 0, readings = 0;
    for (uint64_t seq = 0; seq < 60; seq++) {
        int rc = append_seq(s, seq, fixed_len);
        if (rc == 0) {
            cr_assert_eq(accepted, seq, "once full, every later record is refused");
            accepted++;
        } else {
            cr_assert_eq(rc, -ENOSPC);
            readings += readings_of(seq);
        }
        cr_assert_leq(disk_bytes(NULL), CAP);
    }
    cr_assert_lt(accepted, 60);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, 60 - accepted);
    cr_assert_eq(st.dropped_readings, readings);
    cr_assert_eq(st.write_errors, 0);
    check_disk(s);
    expect_rest(s, 0, accepted, fixed_len);
    bd_spool_close(s);
}

Test(spool, block_refuses_without_dropping_until_space_is_freed) {
    struct bd_spool_opts o = opts(SEG, CAP, BD_SPOOL_SYNC_NONE, BD_SPOOL_BLOCK);
    struct bd_spool *s = open_ok(&o);
    uint64_t seq = 0;
    int rc;
    while ((rc = append_seq(s, seq, fixed_len)) == 0) {
        seq++;
        cr_assert_leq(disk_bytes(NULL), CAP);
    }
    cr_assert_eq(rc, -ENOSPC);
    cr_assert_eq(append_seq(s, seq, fixed_len), -ENOSPC);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records + st.dropped_readings, 0);
    /* Acknowledging a whole segment deletes it, and the record goes in. */
    uint64_t got[PER_SEG];
    cr_assert_eq(take(s, got, PER_SEG, fixed_len), PER_SEG);
    cr_assert_eq(append_seq(s, seq, fixed_len), 0);
    cr_assert_leq(disk_bytes(NULL), CAP);
    expect_rest(s, PER_SEG, seq + 1, fixed_len);
    bd_spool_close(s);
}

Test(spool, record_that_can_never_fit_is_refused) {
    struct bd_spool_opts o = opts(SEG, 2000, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    static uint8_t big[2000];
    append_ok(s, 0, 3, fixed_len);
    cr_assert_eq(bd_spool_append(s, 9, 1, 0, big, sizeof(big)), -EMSGSIZE);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.dropped_records, 0);
    expect_rest(s, 0, 3, fixed_len);
    bd_spool_close(s);
}

/*
 * A full disk, as the file-size limit makes it: write(2) stops part-way with EFBIG. Each
 * failed append returns the error, is counted, and leaves no byte behind (the file is cut back);
 * the next append starts a new segment. What was appended comes back after a reopen.
 */
Test(spool, full_disk_fails_the_append_and_keeps_the_spool_consistent) {
    enum { N = 60 };
    struct result {
        int rc[N];
        uint64_t write_errors;
        int consistent; /* stats bytes == files after every append */
    } *res = shared_mem(sizeof(struct result));
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct rlimit rl = {.rlim_cur = 3000, .rlim_max = 3000};
        struct bd_spool_opts o = opts(1 << 16, 0, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
        struct bd_spool *s = NULL;
        signal(SIGXFSZ, SIG_IGN);
        if (setrlimit(RLIMIT_FSIZE, &rl) < 0 || bd_spool_open(&s, &o, NULL) < 0) {
            _exit(1);
        }
        res->consistent = 1;
        for (int i = 0; i < N; i++) {
            struct bd_spool_stats st;
            res->rc[i] = append_seq(s, (uint64_t)i, varied_len);
            bd_spool_get_stats(s, &st);
            res->consistent &= disk_bytes(NULL) == st.bytes;
            res->write_errors = st.write_errors;
        }
        bd_spool_close(s);
        _exit(0);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d", status);
    cr_assert(res->consistent, "every failed write was cut back");
    uint64_t want[N], fails = 0;
    size_t n_want = 0;
    for (int i = 0; i < N; i++) {
        if (res->rc[i] == 0) {
            want[n_want++] = (uint64_t)i;
        } else {
            cr_assert_eq(res->rc[i], -EFBIG, "append %d: %d", i, res->rc[i]);
            fails++;
        }
    }
    cr_assert_geq(fails, 3);
    cr_assert_eq(res->write_errors, fails);

    struct bd_spool_opts o = opts(1 << 16, 0, BD_SPOOL_SYNC_BATCH, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    uint64_t got[N];
    size_t n = take(s, got, N, varied_len);
    cr_assert_eq(n, n_want);
    cr_assert_eq(memcmp(got, want, n * sizeof(got[0])), 0);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.corrupt_records + st.torn_tails + st.missing_segments, 0);
    bd_spool_close(s);
    munmap(res, sizeof(*res));
}

/* ------------------------------------------------------------------------------------------ */
/* Directories and start-up                                                                   */

Test(spool, directory_is_created_with_its_parents) {
    char deep[400];
    snprintf(deep, sizeof(deep), "%s/a/b/c", base);
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    o.dir = deep;
    struct bd_spool *s = open_ok(&o);
    const char *parts[] = {"a", "a/b", "a/b/c"};
    for (size_t i = 0; i < BD_ARRAY_LEN(parts); i++) {
        char p[400];
        struct stat st;
        snprintf(p, sizeof(p), "%s/%s", base, parts[i]);
        cr_assert_eq(stat(p, &st), 0, "%s", p);
        cr_assert(S_ISDIR(st.st_mode));
        cr_assert_eq(st.st_mode & 0777, 0700, "%s: %o", p, st.st_mode & 0777);
    }
    char seg[500];
    struct stat st;
    snprintf(seg, sizeof(seg), "%s/spool-0000000000000001.seg", deep);
    cr_assert_eq(stat(seg, &st), 0, "the first segment is ready");
    cr_assert_eq(st.st_mode & 0777, 0600);
    bd_spool_close(s);
}

static int open_err(const char *path, struct bd_err *err) {
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = (struct bd_spool *)1;
    o.dir = path;
    int rc = bd_spool_open(&s, &o, err);
    if (rc == 0) {
        bd_spool_close(s);
    }
    return s == NULL ? rc : 1;
}

Test(spool, bad_directories_are_errors_naming_the_path) {
    char file[400], under[450], ro[400], ro_sub[450];
    struct bd_err err = {0};
    snprintf(file, sizeof(file), "%s/plain-file", base);
    snprintf(under, sizeof(under), "%s/sub", file);
    int fd = open(file, O_WRONLY | O_CREAT, 0600);
    cr_assert_geq(fd, 0);
    close(fd);

    cr_assert_eq(open_err(file, &err), -ENOTDIR);
    cr_assert_not_null(strstr(err.msg, file), "%s", err.msg);
    cr_assert_not_null(strstr(err.msg, "Not a directory"), "%s", err.msg);
    cr_assert_eq(open_err(under, &err), -ENOTDIR);
    cr_assert_not_null(strstr(err.msg, under), "%s", err.msg);

    /* Not writable: as an unprivileged user (root writes anyway). */
    snprintf(ro, sizeof(ro), "%s/read-only", base);
    snprintf(ro_sub, sizeof(ro_sub), "%s/sub", ro);
    cr_assert_eq(mkdir(ro, 0755), 0);
    cr_assert_eq(chmod(base, 0755), 0);
    struct bd_err *shared = shared_mem(2 * sizeof(struct bd_err));
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        if (geteuid() == 0 && (setgid(65534) < 0 || setuid(65534) < 0)) {
            _exit(1);
        }
        if (geteuid() != 0) {
            (void)chmod(ro, 0555);
        }
        int a = open_err(ro, &shared[0]);
        int b = open_err(ro_sub, &shared[1]);
        _exit(a == -EACCES && b == -EACCES ? 0 : 2);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d: %s / %s", status,
              shared[0].msg, shared[1].msg);
    cr_assert_not_null(strstr(shared[0].msg, ro), "%s", shared[0].msg);
    cr_assert_not_null(strstr(shared[0].msg, "Permission denied"), "%s", shared[0].msg);
    cr_assert_not_null(strstr(shared[1].msg, ro_sub), "%s", shared[1].msg);
    munmap(shared, 2 * sizeof(struct bd_err));
}

Test(spool, start_up_reads_only_the_newest_segment) {
    enum { SEGS = 100, BIG = 500 };
    struct bd_spool_opts o = opts(4096, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    struct bd_spool *s = open_ok(&o);
    size_t per_seg = (4096 - BD_SPOOL_SEGMENT_HEADER_BYTES) / (BD_SPOOL_RECORD_HEADER_BYTES + BIG);
    uint64_t total = SEGS * per_seg - 3; /* the newest segment not quite full */
    for (uint64_t seq = 0; seq < total; seq++) {
        uint8_t buf[BIG];
        memset(buf, (int)seq, sizeof(buf));
        cr_assert_eq(bd_spool_append(s, seq, 1, 0, buf, sizeof(buf)), 0);
    }
    bd_spool_close(s);

    s = open_ok(&o);
    struct bd_spool_stats st;
    bd_spool_get_stats(s, &st);
    cr_assert_eq(st.segments, SEGS);
    cr_assert_gt(st.bytes, 90 * 4096);
    uint64_t newest =
        (per_seg - 3) * (BD_SPOOL_RECORD_HEADER_BYTES + BIG) + BD_SPOOL_SEGMENT_HEADER_BYTES;
    cr_assert_leq(st.recovery_bytes_read, newest + BD_SPOOL_CHECKPOINT_BYTES,
                  "open read %llu bytes of %llu", (unsigned long long)st.recovery_bytes_read,
                  (unsigned long long)st.bytes);
    cr_assert_geq(st.recovery_bytes_read, newest, "and the newest segment in full");
    cr_assert_eq(st.uncounted_segments, SEGS - 1);
    cr_assert_eq(st.records, per_seg - 3);
    /* Replay streams through the rest. */
    struct bd_spool_record r;
    for (uint64_t seq = 0; seq < total; seq++) {
        cr_assert_eq(bd_spool_peek(s, &r), 0);
        cr_assert_eq(r.seq, seq);
        cr_assert_eq(r.len, BIG);
        cr_assert_eq(r.data[BIG - 1], (uint8_t)seq);
        cr_assert_eq(bd_spool_ack(s, r.id), 0);
    }
    cr_assert_eq(bd_spool_peek(s, &r), -ENOENT);
    bd_spool_close(s);
}

Test(spool, bad_options_and_close_null) {
    struct bd_spool *s = (struct bd_spool *)1;
    struct bd_spool_opts o = opts(SEG, 0, BD_SPOOL_SYNC_NONE, BD_SPOOL_DROP_OLDEST);
    o.dir = "";
    cr_assert_eq(bd_spool_open(&s, &o, NULL), -EINVAL);
    cr_assert_null(s);
    o.dir = dir;
    o.full = (enum bd_spool_full)7;
    cr_assert_eq(bd_spool_open(&s, &o, NULL), -EINVAL);
    bd_spool_close(NULL);
}
