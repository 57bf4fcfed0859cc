/* Writer sequence under spool.dir: monotonic across clean stops, crashes and torn files; every
 * rewrite of writer.state synced before and after its rename (fsync seen through an override). */
#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bucketd/writer.h"

static char dir[256];

static void make_dir(void) {
    snprintf(dir, sizeof(dir), "/tmp/bd-writer-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void remove_dir(void) {
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(writer, .init = make_dir, .fini = remove_dir);

static struct bd_writer *open_ok(const char *sub) {
    char path[300];
    struct bd_writer *w = NULL;
    struct bd_err err = {0};
    snprintf(path, sizeof(path), "%s/%s", dir, sub);
    cr_assert_eq(bd_writer_open(&w, path, "gw-1", &err), 0, "%s", err.msg);
    return w;
}

static uint64_t next_ok(struct bd_writer *w) {
    uint64_t seq = 0;
    struct bd_err err = {0};
    cr_assert_eq(bd_writer_next(w, &seq, &err), 0, "%s", err.msg);
    return seq;
}

Test(writer, sequence_increases_and_survives_a_clean_stop) {
    struct bd_writer *w = open_ok("spool");
    cr_assert_not(bd_writer_previous(w)->found, "a new directory has no state");
    uint64_t last = 0;
    /* Cross a reservation block boundary. */
    for (uint64_t i = 0; i < BD_WRITER_BLOCK + 10; i++) {
        uint64_t seq = next_ok(w);
        cr_assert_gt(seq, last);
        last = seq;
    }
    bd_writer_acked(w, 1234, 7200000);
    bd_writer_close(w, true);

    w = open_ok("spool");
    const struct bd_writer_prev *p = bd_writer_previous(w);
    cr_assert(p->found && p->clean);
    cr_assert_str_eq(p->writer_id, "gw-1");
    cr_assert_eq(p->last_ack_ms, 1234);
    cr_assert_eq(bd_writer_max_bucket_start(w), 7200000);
    cr_assert_gt(next_ok(w), last);
    bd_writer_close(w, true);
}

Test(writer, a_crash_never_brings_back_a_used_number) {
    char path[300];
    snprintf(path, sizeof(path), "%s/spool", dir);
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct bd_writer *w = NULL;
        uint64_t seq = 0;
        if (bd_writer_open(&w, path, "gw-1", NULL) < 0) {
            _exit(2);
        }
        for (int i = 0; i < 100; i++) {
            if (bd_writer_next(w, &seq, NULL) < 0) {
                _exit(3);
            }
        }
        if (write(fds[1], &seq, sizeof(seq)) != sizeof(seq)) {
            _exit(4);
        }
        _exit(0); /* no close: like SIGKILL */
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    uint64_t child_last = 0;
    cr_assert_eq(read(fds[0], &child_last, sizeof(child_last)), (ssize_t)sizeof(child_last));
    close(fds[0]);
    close(fds[1]);

    struct bd_writer *w = open_ok("spool");
    cr_assert(bd_writer_previous(w)->found);
    cr_assert_not(bd_writer_previous(w)->clean, "the child never stopped cleanly");
    cr_assert_gt(next_ok(w), child_last);
    bd_writer_close(w, true);
}

Test(writer, a_second_daemon_on_the_same_directory_is_refused) {
    struct bd_writer *w = open_ok("spool");
    struct bd_writer *other = NULL;
    struct bd_err err = {0};
    char path[300];
    snprintf(path, sizeof(path), "%s/spool", dir);
    cr_assert_eq(bd_writer_open(&other, path, "gw-2", &err), -EBUSY);
    cr_assert(strstr(err.msg, "in use by another bucketd") != NULL, "%s", err.msg);
    bd_writer_close(w, true);
}

Test(writer, a_torn_state_file_counts_as_missing) {
    struct bd_writer *w = open_ok("spool");
    bd_writer_close(w, true);
    char path[300];
    snprintf(path, sizeof(path), "%s/spool/writer.state", dir);
    FILE *fp = fopen(path, "w");
    cr_assert_not_null(fp);
    fputs("bucketd-writer 1\nwriter_id gw-1\nreser", fp);
    fclose(fp);
    w = open_ok("spool");
    cr_assert_not(bd_writer_previous(w)->found);
    bd_writer_close(w, true);
}

Test(writer, raise_skips_past_a_number_seen_in_the_collection) {
    struct bd_writer *w = open_ok("spool");
    struct bd_err err = {0};
    uint64_t first = next_ok(w);
    cr_assert_eq(bd_writer_raise(w, first + 10 * BD_WRITER_BLOCK, &err), 0, "%s", err.msg);
    cr_assert_eq(next_ok(w), first + 10 * BD_WRITER_BLOCK + 1);
    /* Lower numbers change nothing. */
    cr_assert_eq(bd_writer_raise(w, 5, &err), 0);
    cr_assert_eq(next_ok(w), first + 10 * BD_WRITER_BLOCK + 2);
    bd_writer_close(w, true);
    /* The raised reservation reached the disk. */
    w = open_ok("spool");
    cr_assert_gt(next_ok(w), first + 10 * BD_WRITER_BLOCK + 2);
    bd_writer_close(w, true);
}

Test(writer, an_unusable_directory_is_a_clear_error) {
    struct bd_writer *w = NULL;
    struct bd_err err = {0};
    char path[300];
    snprintf(path, sizeof(path), "%s/file", dir);
    FILE *fp = fopen(path, "w");
    cr_assert_not_null(fp);
    fclose(fp);
    snprintf(path, sizeof(path), "%s/file/spool", dir);
    cr_assert_lt(bd_writer_open(&w, path, "gw-1", &err), 0);
    cr_assert(strstr(err.msg, path) != NULL, "the error names the path: %s", err.msg);
}

/* ---- Identity (bd_writer_identity) -------------------------------------------------------- */

static char spool[300], id_path[340], log_path[340];

/* The daemon's log goes to a file of the test's own (each test runs in its own process). */
static void capture_log(void) {
    snprintf(spool, sizeof(spool), "%s/spool", dir);
    snprintf(id_path, sizeof(id_path), "%s/" BD_WRITER_ID_FILE, spool);
    snprintf(log_path, sizeof(log_path), "%s/log", dir);
    cr_assert_not_null(freopen(log_path, "w", stderr));
}

/* What was logged since the last call, in buf. */
static const char *logged(char *buf, size_t cap) {
    static long seen;
    fflush(stderr);
    FILE *fp = fopen(log_path, "r");
    cr_assert_not_null(fp);
    fseek(fp, seen, SEEK_SET);
    size_t n = fread(buf, 1, cap - 1, fp);
    buf[n] = '\0';
    seen += (long)n;
    fclose(fp);
    return buf;
}

static const char *file_text(const char *path, char *buf, size_t cap) {
    FILE *fp = fopen(path, "r");
    if (fp == NULL) {
        return NULL;
    }
    size_t n = fread(buf, 1, cap - 1, fp);
    buf[n] = '\0';
    fclose(fp);
    return buf;
}

static void identity_ok(const char *configured, struct bd_writer_identity *id) {
    struct bd_err err = {0};
    cr_assert_eq(bd_writer_identity(spool, configured, id, &err), 0, "%s", err.msg);
}

static bool generated_form(const char *id) {
    return strlen(id) == 18 && strncmp(id, "w-", 2) == 0 &&
           strspn(id + 2, "0123456789abcdef") == 16;
}

Test(writer, without_writer_id_one_is_generated_then_kept) {
    struct bd_writer_identity a, b;
    char buf[4096], text[256];
    capture_log();
    identity_ok("", &a);
    cr_assert_eq(a.source, BD_WRITER_ID_GENERATED);
    cr_assert(generated_form(a.id), "generated id %s", a.id);
    cr_assert_str_eq(a.kept, "");
    snprintf(text, sizeof(text), "%s\n", a.id);
    cr_assert_str_eq(file_text(id_path, buf, sizeof(buf)), text);
    const char *log = logged(buf, sizeof(buf));
    cr_assert_not_null(strstr(log, "<6>writer_id "), "%s", log);
    cr_assert_not_null(strstr(log, a.id), "%s", log);
    cr_assert_not_null(strstr(log, "generated on this first start"), "%s", log);
    cr_assert_not_null(strstr(log, id_path), "the log says where it is kept: %s", log);

    /* Later starts reuse it, and leave the file alone. */
    struct stat before, after;
    cr_assert_eq(stat(id_path, &before), 0);
    identity_ok("", &b);
    cr_assert_eq(b.source, BD_WRITER_ID_KEPT);
    cr_assert_str_eq(b.id, a.id);
    cr_assert_str_eq(b.kept, a.id);
    cr_assert_eq(stat(id_path, &after), 0);
    cr_assert_eq(before.st_ino, after.st_ino, "not rewritten");
    log = logged(buf, sizeof(buf));
    cr_assert_not_null(strstr(log, "kept in"), "%s", log);
    cr_assert_null(strstr(log, "<4>"), "no warning: %s", log);

    /* No temporary file is left behind. */
    char tmp[400];
    snprintf(tmp, sizeof(tmp), "%s.tmp", id_path);
    cr_assert_neq(access(tmp, F_OK), 0);
}

Test(writer, generated_ids_differ) {
    struct bd_writer_identity a, b;
    capture_log();
    identity_ok("", &a);
    snprintf(spool, sizeof(spool), "%s/other", dir);
    identity_ok("", &b);
    cr_assert(generated_form(a.id) && generated_form(b.id));
    cr_assert_str_neq(a.id, b.id);
}

Test(writer, a_configured_writer_id_is_used_and_kept) {
    struct bd_writer_identity id;
    char buf[4096];
    capture_log();
    identity_ok("gw-1", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_CONFIGURED);
    cr_assert_str_eq(id.id, "gw-1");
    cr_assert_str_eq(file_text(id_path, buf, sizeof(buf)), "gw-1\n");
    const char *log = logged(buf, sizeof(buf));
    cr_assert_not_null(strstr(log, "writer_id gw-1 (set in the configuration"), "%s", log);

    /* The same again: no warning. */
    identity_ok("gw-1", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_CONFIGURED);
    cr_assert_str_eq(id.kept, "gw-1");
    cr_assert_null(strstr(logged(buf, sizeof(buf)), "<4>"));

    /* writer_id taken out of the config: the daemon keeps the id it had. */
    identity_ok("", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_KEPT);
    cr_assert_str_eq(id.id, "gw-1");
}

Test(writer, a_configured_writer_id_other_than_the_kept_one_warns_and_replaces_it) {
    struct bd_writer_identity gen, id;
    char buf[4096];
    capture_log();
    identity_ok("", &gen);
    logged(buf, sizeof(buf));

    identity_ok("gw-2", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_REPLACED);
    cr_assert_str_eq(id.id, "gw-2");
    cr_assert_str_eq(id.kept, gen.id);
    cr_assert_str_eq(file_text(id_path, buf, sizeof(buf)), "gw-2\n");
    const char *log = logged(buf, sizeof(buf));
    cr_assert_not_null(strstr(log, "<4>writer_id gw-2 set in the configuration is not the id"),
                       "%s", log);
    cr_assert_not_null(strstr(log, gen.id), "the warning names the old id: %s", log);

    /* From now on the new one is kept. */
    identity_ok("", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_KEPT);
    cr_assert_str_eq(id.id, "gw-2");
}

/* A spool.dir written by a version without writer-id keeps the id its writer.state names. */
Test(writer, the_id_of_an_earlier_version_is_adopted) {
    struct bd_writer_identity id;
    char buf[4096];
    capture_log();
    struct bd_writer *w = open_ok("spool"); /* writer.state names gw-1 */
    bd_writer_close(w, true);
    cr_assert_neq(access(id_path, F_OK), 0);
    identity_ok("", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_ADOPTED);
    cr_assert_str_eq(id.id, "gw-1");
    cr_assert_str_eq(file_text(id_path, buf, sizeof(buf)), "gw-1\n");
    identity_ok("", &id);
    cr_assert_eq(id.source, BD_WRITER_ID_KEPT);
    cr_assert_str_eq(id.id, "gw-1");
}

Test(writer, a_writer_id_file_without_a_valid_id_is_an_error) {
    static const char *const bad[] = {
        "",
        "\n",
        "gw 1\n",
        "gw.1\n",
        "gw-1\nmore\n",
        "gw-1\n\n",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
        "aaaa\n"};
    char buf[256];
    capture_log();
    cr_assert_eq(mkdir(spool, 0750), 0);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct bd_writer_identity id;
        struct bd_err err = {0};
        FILE *fp = fopen(id_path, "w");
        cr_assert_not_null(fp);
        fputs(bad[i], fp);
        fclose(fp);
        cr_assert_eq(bd_writer_identity(spool, "", &id, &err), -EINVAL, "content %zu", i);
        cr_assert_not_null(strstr(err.msg, id_path), "%s", err.msg);
        cr_assert_str_eq(file_text(id_path, buf, sizeof(buf)), bad[i], "left as it was");
    }
    /* Without a newline, and at the longest, it is an id. */
    FILE *fp = fopen(id_path, "w");
    cr_assert_not_null(fp);
    fputs("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", fp);
    fclose(fp);
    struct bd_writer_identity id;
    identity_ok("", &id);
    cr_assert_eq(strlen(id.id), 64);
}

Test(writer, no_identity_while_another_daemon_holds_the_directory) {
    struct bd_writer_identity id;
    struct bd_err err = {0};
    capture_log();
    struct bd_writer *w = open_ok("spool");
    cr_assert_eq(bd_writer_identity(spool, "", &id, &err), -EBUSY);
    cr_assert_not_null(strstr(err.msg, "in use by another bucketd"), "%s", err.msg);
    cr_assert_neq(access(id_path, F_OK), 0, "nothing written");
    bd_writer_close(w, true);
    /* Released: the lock does not outlive the call either, so the writer can open after it. */
    identity_ok("", &id);
    w = open_ok("spool");
    bd_writer_close(w, true);
}

/* writer.state's last_ack_ms as the file holds it now (-1: no such line). */
static int64_t state_ack_ms(const char *sub) {
    char path[400], buf[1024];
    snprintf(path, sizeof(path), "%s/%s/writer.state", dir, sub);
    const char *text = file_text(path, buf, sizeof(buf));
    const char *at = strstr(text, "last_ack_ms ");
    return at != NULL ? strtoll(at + strlen("last_ack_ms "), NULL, 10) : -1;
}

Test(writer, acknowledgements_rewrite_the_state_file_at_most_once_a_minute) {
    struct bd_writer *w = open_ok("spool");
    next_ok(w);
    const int64_t t0 = 1000000;
    bd_writer_acked(w, t0, 3600000);
    cr_assert_eq(state_ack_ms("spool"), t0, "the first acknowledgement is recorded");
    /* Flushes every second within the minute, same bucket: the file is left alone. */
    for (int64_t s = 1; s < 60; s++) {
        bd_writer_acked(w, t0 + s * 1000, 3600000);
    }
    cr_assert_eq(state_ack_ms("spool"), t0);
    /* A newer bucket is recorded at once (the look-up horizon after a clock jump needs it). */
    bd_writer_acked(w, t0 + 59500, 7200000);
    cr_assert_eq(state_ack_ms("spool"), t0 + 59500);
    bd_writer_acked(w, t0 + 60000, 7200000);
    cr_assert_eq(state_ack_ms("spool"), t0 + 59500);
    bd_writer_acked(w, t0 + 59500 + BD_WRITER_ACK_SAVE_MS, 7200000);
    cr_assert_eq(state_ack_ms("spool"), t0 + 59500 + BD_WRITER_ACK_SAVE_MS, "a minute later");
    /* A stop records the last one exactly. */
    bd_writer_acked(w, t0 + 130000, 7200000);
    bd_writer_close(w, true);
    cr_assert_eq(state_ack_ms("spool"), t0 + 130000);
}

/*
 * fsync as the writer calls it in this test binary: an executable's own definition comes before
 * the C library's, so the writer's calls land here. For files under `watch` it notes what each
 * call made durable -- the temporary state file, complete, while writer.state still held the old
 * text; or the directory, once writer.state held the new text -- and can fail instead (nothing
 * synced, errno fail_errno) for the files whose name ends in fail_suffix. Everything else goes
 * to the kernel.
 */
static struct {
    char watch[400];
    const char *fail_suffix;
    int fail_errno;
    char log[1024]; /* one letter per call: t (temp file), d (directory), ! (failed) */
    char tmp_text[1024], state_text[1024];
} fsyncs;

static void watch_fsyncs(const char *sub) {
    memset(&fsyncs, 0, sizeof(fsyncs));
    snprintf(fsyncs.watch, sizeof(fsyncs.watch), "%s/%s", dir, sub);
}

static const char *file_text(const char *path, char *buf, size_t cap);

int fsync(int fd) {
    char link[64], path[PATH_MAX], other[PATH_MAX + 32];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof(path) - 1);
    size_t w = strlen(fsyncs.watch);
    if (n <= 0 || w == 0 || strncmp(path, fsyncs.watch, w) != 0 ||
        (path[w] != '\0' && path[w] != '/')) {
        return (int)syscall(SYS_fsync, fd);
    }
    path[n] = '\0';
    size_t at = strlen(fsyncs.log);
    if (fsyncs.fail_suffix != NULL && (size_t)n >= strlen(fsyncs.fail_suffix) &&
        strcmp(path + n - strlen(fsyncs.fail_suffix), fsyncs.fail_suffix) == 0) {
        fsyncs.log[at] = '!';
        errno = fsyncs.fail_errno;
        return -1;
    }
    bool is_dir = path[w] == '\0';
    fsyncs.log[at] = is_dir ? 'd' : 't';
    snprintf(other, sizeof(other), "%s/writer.state", fsyncs.watch);
    if (file_text(other, fsyncs.state_text, sizeof(fsyncs.state_text)) == NULL) {
        fsyncs.state_text[0] = '\0';
    }
    if (!is_dir && file_text(path, fsyncs.tmp_text, sizeof(fsyncs.tmp_text)) == NULL) {
        fsyncs.tmp_text[0] = '\0';
    }
    return (int)syscall(SYS_fsync, fd);
}

static const char *state_text(const char *sub, char *buf, size_t cap) {
    char path[400];
    snprintf(path, sizeof(path), "%s/%s/writer.state", dir, sub);
    return file_text(path, buf, cap);
}

/*
 * Every rewrite of writer.state is durable before it replaces the old one, the once-a-minute
 * rewrite after an acknowledgement too: the temporary file is fsynced complete before the rename
 * (else a power loss after the rename can leave an empty or partial writer.state where the
 * synced reservation was), then the directory after it.
 */
Test(writer, an_acknowledgement_rewrites_the_state_file_through_fsync_and_rename) {
    struct bd_writer *w = open_ok("spool");
    next_ok(w);
    char before[1024], after[1024];
    cr_assert_not_null(state_text("spool", before, sizeof(before)));
    watch_fsyncs("spool");
    bd_writer_acked(w, 1000000, 3600000);
    cr_assert_str_eq(fsyncs.log, "td", "the temp file, then the directory");
    cr_assert_not_null(state_text("spool", after, sizeof(after)));
    cr_assert_not_null(strstr(after, "last_ack_ms 1000000\n"));
    cr_assert_str_eq(fsyncs.tmp_text, after, "the temp file was complete when synced");
    cr_assert_str_eq(fsyncs.state_text, after, "the directory was synced after the rename");
    char tmp[400];
    snprintf(tmp, sizeof(tmp), "%s/spool/writer.state.tmp", dir);
    cr_assert_eq(access(tmp, F_OK), -1, "no temp file left");
    bd_writer_close(w, true);
}

/* An fsync that fails leaves the old writer.state in place (nothing unsynced is renamed over
 * it) and is reported: by the call that reserves numbers, and in the log after an ack. */
Test(writer, a_failed_fsync_keeps_the_old_state_file_and_is_reported) {
    capture_log();
    struct bd_writer *w = open_ok("spool");
    next_ok(w);
    char before[1024], now[1024], log[4096];
    cr_assert_not_null(state_text("spool", before, sizeof(before)));
    (void)logged(log, sizeof(log));

    watch_fsyncs("spool");
    fsyncs.fail_suffix = "/writer.state.tmp";
    fsyncs.fail_errno = EIO;
    bd_writer_acked(w, 1000000, 3600000);
    cr_assert_str_eq(fsyncs.log, "!");
    cr_assert_str_eq(state_text("spool", now, sizeof(now)), before, "the old file stays");
    cr_assert_not_null(strstr(logged(log, sizeof(log)), "writer.state"), "%s", log);
    cr_assert_not_null(strstr(log, strerror(EIO)), "%s", log);

    /* The reservation of the next block fails and says why; the old file stays. */
    uint64_t seq = 0;
    struct bd_err err = {0};
    int rc = 0;
    for (uint64_t i = 0; i < BD_WRITER_BLOCK && rc == 0; i++) {
        rc = bd_writer_next(w, &seq, &err);
    }
    cr_assert_eq(rc, -EIO, "%s", err.msg);
    cr_assert_not_null(strstr(err.msg, "writer.state"), "%s", err.msg);
    cr_assert_str_eq(state_text("spool", now, sizeof(now)), before);

    /* A failed fsync of the directory after the rename is reported too. */
    watch_fsyncs("spool");
    fsyncs.fail_suffix = "/spool";
    fsyncs.fail_errno = EIO;
    cr_assert_eq(bd_writer_next(w, &seq, &err), -EIO);
    cr_assert_str_eq(fsyncs.log, "t!");
    watch_fsyncs("");
    bd_writer_close(w, true);
}

Test(writer, what_a_clean_stop_lost_is_read_back_and_a_crash_reads_as_none) {
    struct bd_writer *w = open_ok("spool");
    bd_writer_set_lost_at_stop(w, 42);
    bd_writer_close(w, true);
    w = open_ok("spool");
    cr_assert_eq(bd_writer_previous(w)->lost_at_stop, 42);
    bd_writer_set_lost_at_stop(w, 7);
    bd_writer_close(w, false); /* not a clean stop: its count says nothing */
    w = open_ok("spool");
    cr_assert_eq(bd_writer_previous(w)->lost_at_stop, 0);
    bd_writer_close(w, true);
    w = open_ok("spool");
    cr_assert_eq(bd_writer_previous(w)->lost_at_stop, 0, "a stop that lost nothing");
    bd_writer_close(w, true);
}

Test(writer, a_state_file_of_the_earlier_format_is_read) {
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/spool", dir);
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof(path), "%s/spool/writer.state", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("bucketd-writer 1\nwriter_id gw-1\nreserved 4097\nmax_bucket_start_ms 0\n"
          "last_ack_ms 5\nclean 1\n",
          f);
    fclose(f);
    struct bd_writer *w = open_ok("spool");
    const struct bd_writer_prev *p = bd_writer_previous(w);
    cr_assert(p->found && p->clean);
    cr_assert_eq(p->last_ack_ms, 5);
    cr_assert_eq(p->lost_at_stop, 0);
    bd_writer_close(w, true);
}
