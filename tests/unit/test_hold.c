/*
 * Lines held while the wall clock is not trusted (src/hold.c): the FIFO, its bound, and the save
 * and load across a restart within one boot and across a reboot.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/hold.h"

static char dir[64];

static void setup(void) {
    snprintf(dir, sizeof(dir), "/tmp/bd-hold-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(hold, .init = setup, .fini = teardown);

static void add(struct bd_hold *h, const char *line, int64_t stamp, int expect) {
    struct bd_hold_line l = {.format = 1,
                             .precision = 2,
                             .kind = BD_HOLD_BOOT,
                             .stamp_ns = stamp,
                             .line = line,
                             .len = strlen(line)};
    cr_assert_eq(bd_hold_add(h, &l), expect, "adding %s", line);
}

static void expect_next(struct bd_hold *h, const char *line, uint8_t kind, int64_t stamp) {
    struct bd_hold_line l;
    cr_assert_eq(bd_hold_peek(h, &l), 0);
    cr_assert_eq(l.len, strlen(line));
    cr_assert_eq(memcmp(l.line, line, l.len), 0, "got %.*s, want %s", (int)l.len, l.line, line);
    cr_assert_eq(l.format, 1);
    cr_assert_eq(l.precision, 2);
    cr_assert_eq(l.kind, kind);
    cr_assert_eq(l.stamp_ns, stamp);
    bd_hold_pop(h);
}

Test(hold, first_in_first_out_within_its_bound) {
    struct bd_hold *h;
    cr_assert_eq(bd_hold_new(&h, 16 + 10 + 16 + 10), 0);
    add(h, "m v=1 1000", 5, 0);
    add(h, "m v=2 2000", 6, 0);
    add(h, "m v=3", 7, -ENOSPC); /* past the bound */
    cr_assert_eq(bd_hold_count(h), 2);
    expect_next(h, "m v=1 1000", BD_HOLD_BOOT, 5);
    add(h, "m v=4", 8, 0); /* room again */
    expect_next(h, "m v=2 2000", BD_HOLD_BOOT, 6);
    expect_next(h, "m v=4", BD_HOLD_BOOT, 8);
    struct bd_hold_line l;
    cr_assert_eq(bd_hold_peek(h, &l), -ENOENT);
    cr_assert_eq(bd_hold_bytes(h), 0);
    /* Many more than fit at once, through the reclaimed head. */
    bd_hold_set_max_bytes(h, 1 << 20);
    char line[32];
    for (int i = 0; i < 10000; i++) {
        snprintf(line, sizeof(line), "m v=%d", i);
        add(h, line, i, 0);
        if (i % 3 == 2) {
            for (int k = 0; k < 2; k++) {
                bd_hold_pop(h);
            }
        }
    }
    cr_assert_eq(bd_hold_count(h), 10000 - 2 * (10000 / 3));
    bd_hold_free(h);
}

Test(hold, saved_and_taken_back_within_one_boot) {
    struct bd_hold *h, *back;
    struct bd_err err = {0};
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    add(h, "b v=2 123", 200, 0);
    cr_assert_eq(bd_hold_save(h, dir, "boot-1", 5000, 300, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_hold_new(&back, 1 << 20), 0);
    uint64_t n, dropped;
    cr_assert_eq(bd_hold_load(back, dir, "boot-1", &n, &dropped, &err), 0, "%s", err.msg);
    cr_assert_eq(n, 2);
    cr_assert_eq(dropped, 0);
    expect_next(back, "a v=1", BD_HOLD_BOOT, 100);
    expect_next(back, "b v=2 123", BD_HOLD_BOOT, 200);
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_HOLD_FILE);
    cr_assert_neq(access(path, F_OK), 0, "taken back: the file goes");
    /* Nothing more to take back. */
    cr_assert_eq(bd_hold_load(back, dir, "boot-1", &n, &dropped, &err), 0);
    cr_assert_eq(n, 0);
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, after_a_reboot_lines_carry_their_estimated_wall_time) {
    struct bd_hold *h, *back;
    struct bd_err err = {0};
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    /* Saved with the wall clock (untrusted) at 5000 and the boot clock at 300. */
    cr_assert_eq(bd_hold_save(h, dir, "boot-1", 5000, 300, &err), 0, "%s", err.msg);
    cr_assert_eq(bd_hold_new(&back, 1 << 20), 0);
    uint64_t n, dropped;
    cr_assert_eq(bd_hold_load(back, dir, "boot-2", &n, &dropped, &err), 0, "%s", err.msg);
    cr_assert_eq(n, 1);
    expect_next(back, "a v=1", BD_HOLD_WALL, 5000 - (300 - 100));
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, a_damaged_file_takes_nothing_and_is_set_aside) {
    struct bd_hold *h;
    struct bd_err err = {0};
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    cr_assert_eq(bd_hold_save(h, dir, "boot-1", 5000, 300, &err), 0);
    char path[128], bad[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_HOLD_FILE);
    snprintf(bad, sizeof(bad), "%s/held.lines.bad", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    fseek(f, 80, SEEK_SET);
    fputc('X', f);
    fclose(f);
    struct bd_hold *back;
    cr_assert_eq(bd_hold_new(&back, 1 << 20), 0);
    uint64_t n, dropped;
    cr_assert_eq(bd_hold_load(back, dir, "boot-1", &n, &dropped, &err), -EBADMSG);
    cr_assert(strstr(err.msg, "damaged") != NULL, "%s", err.msg);
    cr_assert_eq(bd_hold_count(back), 0);
    cr_assert_eq(access(bad, F_OK), 0, "set aside");
    /* Saving nothing removes an old file. */
    cr_assert_eq(bd_hold_save(back, dir, "boot-1", 1, 1, &err), 0);
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, a_full_hold_takes_back_what_fits_and_counts_the_rest) {
    struct bd_hold *h, *back;
    struct bd_err err = {0};
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 1, 0);
    add(h, "b v=2", 2, 0);
    add(h, "c v=3", 3, 0);
    cr_assert_eq(bd_hold_save(h, dir, "boot-1", 10, 10, &err), 0);
    cr_assert_eq(bd_hold_new(&back, 2 * (16 + 5)), 0);
    uint64_t n, dropped;
    cr_assert_eq(bd_hold_load(back, dir, "boot-1", &n, &dropped, &err), 0, "%s", err.msg);
    cr_assert_eq(n, 2);
    cr_assert_eq(dropped, 1);
    expect_next(back, "a v=1", BD_HOLD_BOOT, 1);
    bd_hold_free(h);
    bd_hold_free(back);
}
