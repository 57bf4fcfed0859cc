/*
 * An LD_PRELOAD shim for end-to-end tests of the wall clock (tests/e2e/test_clock.py): it plays
 * a gateway whose clock is wrong and unsynchronised, then stepped by NTP.
 *
 * The control file named by $BD_CLOCK_SHIM_FILE holds one line, "<offset_ns> <synced>":
 *   - offset_ns is added to every reading of the wall clock: clock_gettime(CLOCK_REALTIME and
 *     CLOCK_REALTIME_COARSE), gettimeofday(2) and time(2);
 *   - synced (1 or 0) is what adjtimex(2) reports: with 0, STA_UNSYNC set and TIME_ERROR
 *     returned; with 1, STA_UNSYNC cleared and TIME_OK returned. Only read-only calls (modes
 *     0) are played; any other goes to the kernel untouched.
 * A test steps the clock by replacing the file (write a temporary file, rename it over). The
 * shim reads the file again once 20 ms of real monotonic time have passed since it last did,
 * so a change is seen within 20 ms by the next call; a missing or unreadable file keeps the
 * values read last (offset 0 and synchronised before any).
 *
 * Every other clock (CLOCK_MONOTONIC, CLOCK_BOOTTIME, ...) passes through: they are what the
 * daemon measures the wall clock against. The interposition works on dynamically linked code
 * calling the libc functions (the vDSO is reached through them); libc's own internal calls do
 * not pass through it, which bucketd does not rely on.
 *
 * Threads: any. The values are atomics; one caller at a time re-reads the file.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/timex.h>
#include <time.h>
#include <unistd.h>

#define REREAD_NS INT64_C(20000000)

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);
typedef int (*gettimeofday_fn)(struct timeval *, void *);
typedef int (*adjtimex_fn)(struct timex *);

static _Atomic int64_t offset_ns;
static atomic_int synced = 1;
static _Atomic int64_t read_at_ns; /* real monotonic time of the last read */
static atomic_bool loaded;         /* read_at_ns is set */
static atomic_flag reading = ATOMIC_FLAG_INIT;

static clock_gettime_fn real_clock_gettime(void) {
    static _Atomic(clock_gettime_fn) fn;
    clock_gettime_fn f = atomic_load(&fn);
    if (f == NULL) {
        f = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
        atomic_store(&fn, f);
    }
    return f;
}

static void refresh(void) {
    struct timespec now;
    if (real_clock_gettime()(CLOCK_MONOTONIC, &now) != 0) {
        return;
    }
    int64_t t = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
    if ((atomic_load(&loaded) && t - atomic_load(&read_at_ns) < REREAD_NS) ||
        atomic_flag_test_and_set(&reading)) {
        return;
    }
    const char *path = getenv("BD_CLOCK_SHIM_FILE");
    int fd = path != NULL ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (fd >= 0) {
        char buf[128];
        ssize_t n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        long long off = 0;
        int s = 1;
        if (n > 0) {
            buf[n] = '\0';
            if (sscanf(buf, "%lld %d", &off, &s) == 2) {
                atomic_store(&offset_ns, (int64_t)off);
                atomic_store(&synced, s != 0);
            }
        }
    }
    atomic_store(&read_at_ns, t);
    atomic_store(&loaded, true);
    atomic_flag_clear(&reading);
}

static void shift(struct timespec *ts) {
    refresh();
    int64_t ns = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec + atomic_load(&offset_ns);
    int64_t sec = ns / 1000000000, rem = ns % 1000000000;
    if (rem < 0) {
        rem += 1000000000;
        sec--;
    }
    ts->tv_sec = (time_t)sec;
    ts->tv_nsec = (long)rem;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    int rc = real_clock_gettime()(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        shift(ts);
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    static _Atomic(gettimeofday_fn) fn;
    gettimeofday_fn f = atomic_load(&fn);
    if (f == NULL) {
        f = (gettimeofday_fn)dlsym(RTLD_NEXT, "gettimeofday");
        atomic_store(&fn, f);
    }
    int rc = f(tv, tz);
    struct timeval *given = tv; /* glibc declares tv nonnull; a caller may still pass NULL */
    if (rc == 0 && given != NULL) {
        struct timespec ts = {tv->tv_sec, (long)tv->tv_usec * 1000};
        shift(&ts);
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    if (out != NULL) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}

int adjtimex(struct timex *tx) {
    static _Atomic(adjtimex_fn) fn;
    adjtimex_fn f = atomic_load(&fn);
    if (f == NULL) {
        f = (adjtimex_fn)dlsym(RTLD_NEXT, "adjtimex");
        atomic_store(&fn, f);
    }
    if (tx->modes != 0) {
        return f(tx);
    }
    if (f(tx) < 0) {
        memset(tx, 0, sizeof(*tx)); /* the kernel refused (a seccomp filter): play it anyway */
    }
    refresh();
    if (atomic_load(&synced)) {
        tx->status &= ~STA_UNSYNC;
        return TIME_OK;
    }
    tx->status |= STA_UNSYNC;
    return TIME_ERROR;
}
