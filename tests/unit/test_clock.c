/*
 * Unit tests for src/clock.c: the state machine of a trusted wall clock (waiting, synchronized,
 * trusted by timeout) against a played clock source: the kernel's synchronisation status and
 * the wall, monotonic and boot-time clocks are fields the test sets. The log lines are read
 * back from stderr (redirected to a file for each test that checks them).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/clock.h"

#define S BD_NS_PER_S
#define MIN (60 * S)
#define H (60 * MIN)
/* 2026-01-01T00:00:00Z: the true time the tests play. */
#define TRUE_WALL (INT64_C(1767225600) * S)

struct fake {
    int status; /* 1 synchronised, 0 not, < 0 an error */
    int64_t wall, mono, boot;
};

static int fake_status(void *arg) {
    return ((struct fake *)arg)->status;
}
static int64_t fake_wall(void *arg) {
    return ((struct fake *)arg)->wall;
}
static int64_t fake_mono(void *arg) {
    return ((struct fake *)arg)->mono;
}
static int64_t fake_boot(void *arg) {
    return ((struct fake *)arg)->boot;
}

/* Time passes for every clock alike (no step, no suspend). */
static void advance(struct fake *f, int64_t ns) {
    f->wall += ns;
    f->mono += ns;
    f->boot += ns;
}

static struct bd_clock *new_clock(struct fake *f, uint64_t wait_ms, int64_t floor_ms) {
    struct bd_clock_source src = {fake_status, fake_wall, fake_mono, fake_boot, f};
    struct bd_clock_opts opts = {
        .wait_for_sync_ms = wait_ms, .floor_wall_ms = floor_ms, .floor_what = "the test floor"};
    struct bd_clock *c = NULL;
    struct bd_err err = {0};
    cr_assert_eq(bd_clock_new(&c, &src, &opts, &err), 0, "%s", err.msg);
    return c;
}

/* ---- stderr capture ---- */

static FILE *cap;
static int saved_stderr = -1;

static void capture_start(void) {
    fflush(stderr);
    cap = tmpfile();
    cr_assert_not_null(cap);
    saved_stderr = dup(2);
    dup2(fileno(cap), 2);
}

/* What was logged since capture_start (or the last capture_take); keeps capturing. */
static char *capture_take(void) {
    static char buf[16384];
    static long done;
    fflush(stderr);
    fseek(cap, 0, SEEK_END);
    long end = ftell(cap);
    fseek(cap, done, SEEK_SET);
    size_t n = fread(buf, 1, sizeof(buf) - 1, cap);
    buf[n] = '\0';
    done = end;
    return buf;
}

static void capture_stop(void) {
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    fclose(cap);
}

static int count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = strstr(hay, needle); p != NULL; p = strstr(p + 1, needle)) {
        n++;
    }
    return n;
}

TestSuite(clock, .init = capture_start, .fini = capture_stop);

/* A gateway booted 2 hours behind and unsynchronised; NTP then steps it and the kernel reports
 * it synchronised. */
Test(clock, unsynchronised_then_synchronised) {
    struct fake f = {.status = 0, .wall = TRUE_WALL - 2 * H, .mono = 5 * S, .boot = 7 * S};
    struct bd_clock *c = new_clock(&f, 600000, 0);
    char *log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    cr_assert(!bd_clock_trusted(c));
    cr_assert(!bd_clock_synchronized(c));
    cr_assert_str_eq(bd_clock_state_name(bd_clock_state(c)), "waiting");
    cr_assert_not_null(strstr(log, "clock: not trusted yet: the kernel reports it unsynchronised"),
                       "%s", log);
    cr_assert_not_null(strstr(log, "waiting up to 10m"), "%s", log);

    /* A reading arrives 3 s later: stamped from the boot-time clock, not convertible yet. */
    advance(&f, 3 * S);
    int64_t stamped_boot = f.boot;
    int64_t true_time_of_reading = TRUE_WALL + 3 * S;
    int64_t wall = 0;
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, stamped_boot, &wall), -EAGAIN);
    for (int i = 0; i < 10; i++) {
        advance(&f, S / 2);
        bd_clock_poll(c);
        cr_assert(!bd_clock_trusted(c));
    }
    cr_assert_str_eq(capture_take(), "", "no line while nothing changes");

    /* NTP: the clock is stepped to the true time and reported synchronised. */
    f.wall = TRUE_WALL + 3 * S + 5 * S;
    f.status = 1;
    bd_clock_poll(c);
    log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    cr_assert(bd_clock_trusted(c));
    cr_assert(bd_clock_synchronized(c));
    cr_assert_str_eq(bd_clock_state_name(bd_clock_state(c)), "synchronized");
    cr_assert_eq(bd_clock_steps(c), 1);
    cr_assert_not_null(strstr(log, "stepped forwards by 7200.000 s"), "%s", log);
    cr_assert_not_null(strstr(log, "clock: the wall clock is synchronised (2026-01-01T00:00:08Z)"),
                       "%s", log);
    /* True time = wall time at sync - boot time elapsed since the reading. */
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, stamped_boot, &wall), 0);
    cr_assert_eq(wall, true_time_of_reading, "%lld != %lld", (long long)wall,
                 (long long)true_time_of_reading);
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, f.boot, &wall), 0);
    cr_assert_eq(wall, f.wall);
    bd_clock_free(c);
}

/* A clock synchronised from the start: trusted at once, and nothing but the one line. */
Test(clock, synchronised_from_the_start) {
    struct fake f = {.status = 1, .wall = TRUE_WALL, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 600000, (TRUE_WALL - H) / BD_NS_PER_MS);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    cr_assert(bd_clock_synchronized(c));
    for (int i = 0; i < 20; i++) {
        advance(&f, S / 2);
        f.wall += S / 2000; /* NTP slews: 500 ppm at most, never a step */
        bd_clock_poll(c);
    }
    char *log = capture_take();
    cr_assert_eq(count(log, "clock:"), 1, "%s", log);
    cr_assert_eq(bd_clock_steps(c), 0);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    bd_clock_free(c);
}

/* NTP steps a synchronised clock back: logged and counted, still trusted. By hand (the kernel
 * then reports it unsynchronised), the trust goes and the wait starts again. */
Test(clock, step_backwards) {
    struct fake f = {.status = 1, .wall = TRUE_WALL, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 60000, 0);
    capture_take();
    advance(&f, S);
    f.wall -= 90 * S;
    bd_clock_poll(c);
    char *log = capture_take();
    cr_assert_not_null(strstr(log, "stepped backwards by 90.000 s"), "%s", log);
    cr_assert_not_null(strstr(log, "the kernel reports it synchronised"), "%s", log);
    cr_assert_eq(bd_clock_steps(c), 1);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    int64_t wall = 0;
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, f.boot, &wall), 0);
    cr_assert_eq(wall, f.wall, "the conversion follows the stepped clock");

    advance(&f, S);
    f.wall -= 3 * H;
    f.status = 0;
    bd_clock_poll(c);
    log = capture_take();
    cr_assert_eq(bd_clock_steps(c), 2);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    cr_assert(!bd_clock_trusted(c));
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, f.boot, &wall), -EAGAIN);
    cr_assert_not_null(strstr(log, "clock: no longer trusted: it was stepped while the kernel "
                                   "reports it unsynchronised"),
                       "%s", log);
    /* The new wait runs from the revocation: 60 s later, trusted by timeout. */
    advance(&f, 59 * S);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    advance(&f, S);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT);
    bd_clock_free(c);
}

/* A step forwards that is not NTP's (the kernel still reports unsynchronised) while waiting:
 * counted and logged, and the clock stays untrusted. */
Test(clock, step_forwards_while_waiting) {
    struct fake f = {.status = 0, .wall = TRUE_WALL - 24 * H, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 600000, 0);
    capture_take();
    advance(&f, S / 2);
    f.wall += 24 * H;
    bd_clock_poll(c);
    char *log = capture_take();
    cr_assert_eq(bd_clock_steps(c), 1);
    cr_assert_not_null(strstr(log, "stepped forwards by 86400.000 s"), "%s", log);
    cr_assert_not_null(strstr(log, "the kernel reports it unsynchronised"), "%s", log);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    /* A second of drift between polls is not a step; more is. */
    advance(&f, S / 2);
    f.wall += S;
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_steps(c), 1);
    advance(&f, S / 2);
    f.wall += S + 1;
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_steps(c), 2);
    bd_clock_free(c);
}

/* The floor: a clock the kernel calls synchronised but earlier than what this writer already
 * stored is not trusted; once past it, it is. Stepped below it later, the trust goes. */
Test(clock, floor) {
    int64_t floor_ms = TRUE_WALL / BD_NS_PER_MS;
    struct fake f = {.status = 1, .wall = TRUE_WALL - 10 * S, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 600000, floor_ms);
    char *log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    cr_assert(!bd_clock_synchronized(c), "below the floor is not synchronised");
    cr_assert_not_null(strstr(log, "it reads 2025-12-31T23:59:50Z, earlier than the test floor "
                                   "(2026-01-01T00:00:00Z)"),
                       "%s", log);
    for (int i = 0; i < 19; i++) {
        advance(&f, S / 2);
        bd_clock_poll(c);
        cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING, "poll %d", i);
    }
    advance(&f, S / 2); /* now exactly at the floor */
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    cr_assert(bd_clock_synchronized(c));

    advance(&f, S);
    f.wall -= 60 * S; /* the kernel still says synchronised */
    bd_clock_poll(c);
    log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    cr_assert(!bd_clock_synchronized(c));
    cr_assert_not_null(strstr(log, "clock: no longer trusted: it reads 2025-12-31T23:59:01Z, "
                                   "earlier than the test floor"),
                       "%s", log);
    bd_clock_free(c);
}

/* A clock that never synchronises: trusted by timeout once time.wait_for_sync has passed on the
 * monotonic clock (a step of the wall clock does not shorten it), logged once; synchronised
 * later, it says so. */
Test(clock, wait_bound) {
    struct fake f = {.status = 0, .wall = TRUE_WALL - 2 * H, .mono = 3 * S, .boot = 3 * S};
    struct bd_clock *c = new_clock(&f, 60000, 0);
    capture_take();
    advance(&f, 30 * S);
    f.wall += 3 * H;
    bd_clock_poll(c);
    advance(&f, 30 * S - 1);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    advance(&f, 1);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT);
    cr_assert(bd_clock_trusted(c));
    cr_assert(!bd_clock_synchronized(c));
    cr_assert_str_eq(bd_clock_state_name(bd_clock_state(c)), "timeout");
    int64_t wall = 0;
    cr_assert_eq(bd_clock_boot_to_wall_ns(c, f.boot - S, &wall), 0);
    cr_assert_eq(wall, f.wall - S, "taken as it is");
    for (int i = 0; i < 100; i++) {
        advance(&f, S / 2);
        bd_clock_poll(c);
    }
    char *log = capture_take();
    cr_assert_eq(count(log, "trusted by timeout"), 1, "%s", log);
    cr_assert_not_null(strstr(log, "still not synchronised after time.wait_for_sync (1m): the "
                                   "kernel reports it unsynchronised"),
                       "%s", log);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT);

    f.status = 1;
    advance(&f, S / 2);
    bd_clock_poll(c);
    log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    cr_assert_not_null(strstr(log, "it was trusted by timeout until now"), "%s", log);
    bd_clock_free(c);
}

/* time.wait_for_sync: 0 trusts the clock as it is from the start. */
Test(clock, wait_zero_trusts_at_once) {
    struct fake f = {.status = 0, .wall = TRUE_WALL - 2 * H, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 0, 0);
    char *log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT);
    cr_assert(bd_clock_trusted(c));
    cr_assert_not_null(strstr(log, "time.wait_for_sync is 0: trusting it as it is"), "%s", log);
    bd_clock_free(c);
}

/* A reload of time.wait_for_sync: a wait still running is bounded by the new value from its
 * start; a longer one extends it; a clock already trusted stays so. */
Test(clock, reload_of_the_wait) {
    struct fake f = {.status = 0, .wall = TRUE_WALL, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 60000, 0);
    advance(&f, 30 * S);
    bd_clock_poll(c);
    bd_clock_set_wait(c, 600000); /* 10m */
    advance(&f, 60 * S);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING, "the longer wait runs on");
    bd_clock_set_wait(c, 120000); /* 2m: 90 s have passed */
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    advance(&f, 30 * S);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT, "2m after the start");
    bd_clock_set_wait(c, 3600000);
    advance(&f, S);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT, "a trusted clock stays trusted");
    bd_clock_free(c);

    f = (struct fake){.status = 0, .wall = TRUE_WALL, .mono = S, .boot = S};
    c = new_clock(&f, 600000, 0);
    advance(&f, S);
    bd_clock_poll(c);
    bd_clock_set_wait(c, 0);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_TIMED_OUT, "0 ends the wait at the next poll");
    bd_clock_free(c);
}

/* Synchronised once, then the kernel drops the flag without a step (NTP silent for hours): the
 * gauge says so, the trust stays. */
Test(clock, loss_of_sync_without_a_step_keeps_trust) {
    struct fake f = {.status = 1, .wall = TRUE_WALL, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 600000, 0);
    capture_take();
    advance(&f, S / 2);
    f.status = 0;
    bd_clock_poll(c);
    char *log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    cr_assert(bd_clock_trusted(c));
    cr_assert(!bd_clock_synchronized(c));
    cr_assert_not_null(strstr(log, "still trusted"), "%s", log);
    advance(&f, 20 * MIN);
    bd_clock_poll(c);
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_SYNCED);
    f.status = 1;
    bd_clock_poll(c);
    cr_assert(bd_clock_synchronized(c));
    cr_assert_not_null(strstr(capture_take(), "synchronised again"));
    bd_clock_free(c);
}

/* adjtimex refused (a seccomp filter): unsynchronised, said once. */
Test(clock, status_error_is_unsynchronised) {
    struct fake f = {.status = -EPERM, .wall = TRUE_WALL, .mono = S, .boot = S};
    struct bd_clock *c = new_clock(&f, 600000, 0);
    for (int i = 0; i < 5; i++) {
        advance(&f, S / 2);
        bd_clock_poll(c);
    }
    char *log = capture_take();
    cr_assert_eq(bd_clock_state(c), BD_CLOCK_WAITING);
    cr_assert_eq(count(log, "cannot read the kernel's synchronisation status"), 1, "%s", log);
    cr_assert_not_null(strstr(log, strerror(EPERM)), "%s", log);
    bd_clock_free(c);
}

/* The system source answers: a status, and clocks that move forwards. */
Test(clock, system_source) {
    const struct bd_clock_source *s = bd_clock_system_source();
    int st = s->sync_status(s->arg);
    cr_assert(st == 0 || st == 1 || st < 0);
    int64_t b0 = s->boot_ns(s->arg), m0 = s->mono_ns(s->arg);
    cr_assert_gt(s->wall_ns(s->arg), INT64_C(1600000000) * S);
    cr_assert_geq(s->boot_ns(s->arg), b0);
    cr_assert_geq(s->mono_ns(s->arg), m0);
    cr_assert_gt(bd_clock_build_time_s(), INT64_C(1700000000), "the build time is set");
}

/* ---- Readers on other threads (run under TSan in the tsan stage) ---- */

struct race {
    struct bd_clock *c;
    int64_t trusted_offset;
    atomic_bool done;
    atomic_int bad, seen_trusted;
};

static void *reader(void *arg) {
    struct race *r = arg;
    while (!atomic_load(&r->done)) {
        int64_t wall;
        if (bd_clock_boot_to_wall_ns(r->c, 1000, &wall) == 0) {
            atomic_fetch_add(&r->seen_trusted, 1);
            if (wall - 1000 != r->trusted_offset) {
                atomic_fetch_add(&r->bad, 1);
            }
        }
    }
    return NULL;
}

/* A reader that sees the clock trusted sees an offset measured while it was trusted, never the
 * 2-hours-behind one of the waiting polls. */
Test(clock, readers_on_other_threads) {
    struct fake f = {.status = 0, .wall = TRUE_WALL - 2 * H, .mono = S, .boot = S};
    struct race r = {0};
    r.c = new_clock(&f, 600000, 0);
    r.trusted_offset = TRUE_WALL - S;
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(pthread_create(&t[i], NULL, reader, &r), 0);
    }
    for (int round = 0; round < 200; round++) {
        /* Waiting, 2 h behind; then stepped, synchronised; then set back by hand. */
        f.status = 0;
        f.wall = f.boot + TRUE_WALL - 2 * H - S;
        bd_clock_poll(r.c);
        f.status = 1;
        f.wall = f.boot + r.trusted_offset;
        bd_clock_poll(r.c);
        cr_assert(bd_clock_trusted(r.c));
        f.status = 0;
        f.wall = f.boot + TRUE_WALL - 2 * H - S;
        bd_clock_poll(r.c);
        cr_assert(!bd_clock_trusted(r.c));
    }
    atomic_store(&r.done, true);
    for (int i = 0; i < 2; i++) {
        pthread_join(t[i], NULL);
    }
    cr_assert_eq(atomic_load(&r.bad), 0);
    bd_clock_free(r.c);
}
