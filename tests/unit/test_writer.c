/* Writer sequence under spool.dir: monotonic across clean stops, crashes and torn files. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
