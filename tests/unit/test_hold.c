/*
 * Lines held while the wall clock is not trusted (src/hold.c): the FIFO, its bound, and the
 * records of the held-lines spool taken back within one boot and after a reboot.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/hold.h"

TestSuite(hold);

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

/* A record of h's lines, taken back into a new hold as the given boot. */
static struct bd_hold *round_trip(struct bd_hold *h, const char *boot_then, const char *boot_now,
                                  size_t cap, uint64_t *n, uint64_t *dropped) {
    uint8_t *rec;
    size_t len;
    cr_assert_eq(bd_hold_record(h, boot_then, 5000, 300, &rec, &len), 0);
    struct bd_hold *back;
    cr_assert_eq(bd_hold_new(&back, cap), 0);
    cr_assert_eq(bd_hold_take(back, rec, len, boot_now, n, dropped), 0);
    free(rec);
    return back;
}

Test(hold, a_record_taken_back_within_one_boot_keeps_its_stamps) {
    struct bd_hold *h;
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    add(h, "b v=2 123", 200, 0);
    uint64_t n, dropped;
    struct bd_hold *back = round_trip(h, "boot-1", "boot-1", 1 << 20, &n, &dropped);
    cr_assert_eq(n, 2);
    cr_assert_eq(dropped, 0);
    expect_next(back, "a v=1", BD_HOLD_BOOT, 100);
    expect_next(back, "b v=2 123", BD_HOLD_BOOT, 200);
    bd_hold_clear(h);
    cr_assert_eq(bd_hold_count(h), 0);
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, after_a_reboot_lines_carry_their_estimated_wall_time) {
    struct bd_hold *h;
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    uint64_t n, dropped;
    /* Recorded with the wall clock (untrusted) at 5000 and the boot clock at 300. */
    struct bd_hold *back = round_trip(h, "boot-1", "boot-2", 1 << 20, &n, &dropped);
    cr_assert_eq(n, 1);
    expect_next(back, "a v=1", BD_HOLD_WALL, 5000 - (300 - 100));
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, a_damaged_record_takes_nothing) {
    struct bd_hold *h, *back;
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    cr_assert_eq(bd_hold_new(&back, 1 << 20), 0);
    add(h, "a v=1", 100, 0);
    add(h, "b v=2", 100, 0);
    uint8_t *rec;
    size_t len;
    uint64_t n, dropped;
    cr_assert_eq(bd_hold_record(h, "boot-1", 1, 1, &rec, &len), 0);
    for (size_t cut = 0; cut < len; cut++) {
        int rc = bd_hold_take(back, rec, cut, "boot-1", &n, &dropped);
        /* A cut at the boundary between the two lines is a shorter valid record. */
        bool boundary = cut == BD_HOLD_RECORD_HEADER || cut == BD_HOLD_RECORD_HEADER + 16 + 5;
        cr_assert_eq(rc, boundary ? 0 : -EBADMSG, "cut at %zu: %d", cut, rc);
        bd_hold_clear(back);
    }
    rec[0] = 'X';
    cr_assert_eq(bd_hold_take(back, rec, len, "boot-1", &n, &dropped), -EBADMSG);
    cr_assert_eq(bd_hold_count(back), 0);
    free(rec);
    bd_hold_free(h);
    bd_hold_free(back);
}

Test(hold, a_full_hold_takes_what_fits_and_counts_the_rest) {
    struct bd_hold *h;
    cr_assert_eq(bd_hold_new(&h, 1 << 20), 0);
    add(h, "a v=1", 1, 0);
    add(h, "b v=2", 2, 0);
    add(h, "c v=3", 3, 0);
    uint64_t n, dropped;
    struct bd_hold *back = round_trip(h, "boot-1", "boot-1", 2 * (16 + 5), &n, &dropped);
    cr_assert_eq(n, 2);
    cr_assert_eq(dropped, 1);
    expect_next(back, "a v=1", BD_HOLD_BOOT, 1);
    bd_hold_free(h);
    bd_hold_free(back);
}
