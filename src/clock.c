/*
 * Whether the wall clock can be trusted (include/bucketd/clock.h has the state machine).
 *
 * Threads: the owner (the loop thread, on a timer in daemon.c; reload.c for the wait) runs
 * bd_clock_poll and bd_clock_set_wait and alone touches the fields above `pub_*`. What other
 * threads read is published in the pub_* atomics: the offset first (relaxed), then the state
 * with a release store that pairs with the acquire load in bd_clock_trusted and
 * bd_clock_boot_to_wall_ns, so a reader that sees a trusted state sees an offset measured while
 * it was trusted.
 *
 * Owns only its struct; the source's arg belongs to the caller.
 */
#include "bucketd/clock.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/timex.h>
#include <time.h>

#include "bucketd/log.h"

#ifndef BD_BUILD_TIME_S
#define BD_BUILD_TIME_S 0 /* CMakeLists.txt defines it; 0: no build-time floor */
#endif

struct bd_clock {
    struct bd_clock_source src;
    /* Owner thread only. */
    uint64_t wait_ms;
    int64_t floor_ms;
    char floor_what[96];
    enum bd_clock_state state;
    int64_t wait_start_mono_ns;
    bool polled;            /* last_offset_ns holds a measurement */
    int64_t last_offset_ns; /* CLOCK_REALTIME - CLOCK_BOOTTIME at the last poll */
    bool synced;            /* at the last poll */
    bool status_error_logged;
    uint64_t steps;
    /* Published for every thread. */
    _Atomic int pub_state;
    _Atomic bool pub_synced;
    _Atomic uint64_t pub_steps;
    _Atomic int64_t pub_offset_ns; /* wall - boottime at the newest trusted poll */
};

/* ---- The kernel's clocks ---- */

static int64_t read_clock(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * BD_NS_PER_S + ts.tv_nsec;
}

static int sys_sync_status(void *arg) {
    struct timex tx;
    memset(&tx, 0, sizeof(tx)); /* modes 0: only read; needs no privilege */
    int rc = adjtimex(&tx);
    if (rc < 0) {
        return -errno;
    }
    return rc == TIME_ERROR || (tx.status & STA_UNSYNC) != 0 ? 0 : 1;
}

static int64_t sys_wall_ns(void *arg) {
    return read_clock(CLOCK_REALTIME);
}

static int64_t sys_mono_ns(void *arg) {
    return read_clock(CLOCK_MONOTONIC);
}

static int64_t sys_boot_ns(void *arg) {
    return read_clock(CLOCK_BOOTTIME);
}

static const struct bd_clock_source system_source = {
    .sync_status = sys_sync_status,
    .wall_ns = sys_wall_ns,
    .mono_ns = sys_mono_ns,
    .boot_ns = sys_boot_ns,
    .arg = NULL,
};

const struct bd_clock_source *bd_clock_system_source(void) {
    return &system_source;
}

int64_t bd_clock_build_time_s(void) {
    return (int64_t)BD_BUILD_TIME_S;
}

/* ---- Formatting for the log ---- */

static const char *fmt_wall(char *buf, size_t cap, int64_t wall_ms) {
    time_t s = (time_t)(wall_ms >= 0 ? wall_ms / 1000 : (wall_ms - 999) / 1000);
    struct tm tm;
    if (gmtime_r(&s, &tm) == NULL || strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) {
        snprintf(buf, cap, "%" PRId64 " ms", wall_ms);
    }
    return buf;
}

static const char *fmt_duration(char *buf, size_t cap, uint64_t ms) {
    if (ms != 0 && ms % 60000 == 0) {
        snprintf(buf, cap, "%" PRIu64 "m", ms / 60000);
    } else if (ms % 1000 == 0) {
        snprintf(buf, cap, "%" PRIu64 "s", ms / 1000);
    } else {
        snprintf(buf, cap, "%" PRIu64 "ms", ms);
    }
    return buf;
}

/* Why the clock is not synchronised now, for the log. */
static const char *why_not(const struct bd_clock *c, bool kernel, int64_t wall_ms, char *buf,
                           size_t cap) {
    char now[40], floor[40];
    if (!kernel) {
        snprintf(buf, cap, "the kernel reports it unsynchronised (it reads %s)",
                 fmt_wall(now, sizeof(now), wall_ms));
    } else {
        snprintf(buf, cap, "it reads %s, earlier than %s (%s)", fmt_wall(now, sizeof(now), wall_ms),
                 c->floor_what, fmt_wall(floor, sizeof(floor), c->floor_ms));
    }
    return buf;
}

/* ---- The state machine ---- */

static void publish(struct bd_clock *c, int64_t offset_ns) {
    if (c->state != BD_CLOCK_WAITING) {
        atomic_store_explicit(&c->pub_offset_ns, offset_ns, memory_order_relaxed);
    }
    atomic_store_explicit(&c->pub_synced, c->synced, memory_order_relaxed);
    atomic_store_explicit(&c->pub_steps, c->steps, memory_order_relaxed);
    /* Pairs with the acquire loads of bd_clock_trusted and bd_clock_boot_to_wall_ns. */
    atomic_store_explicit(&c->pub_state, (int)c->state, memory_order_release);
}

static void log_change(const struct bd_clock *c, bool first, enum bd_clock_state prev,
                       bool prev_synced, bool kernel, int64_t wall_ms, const char *revoked) {
    char why[200], wait[32], now[40];
    fmt_duration(wait, sizeof(wait), c->wait_ms);
    fmt_wall(now, sizeof(now), wall_ms);
    if (!first && prev == c->state) {
        if (prev_synced != c->synced && c->state == BD_CLOCK_SYNCED) {
            if (c->synced) {
                bd_info("clock: the kernel reports the wall clock synchronised again (%s)", now);
            } else {
                bd_warn("clock: %s; still trusted: it was synchronised in this run and has not "
                        "been stepped since",
                        why_not(c, kernel, wall_ms, why, sizeof(why)));
            }
        }
        return;
    }
    switch (c->state) {
    case BD_CLOCK_SYNCED:
        bd_info("clock: the wall clock is synchronised (%s): trusted%s", now,
                prev == BD_CLOCK_TIMED_OUT && !first ? " (it was trusted by timeout until now)"
                                                     : "");
        break;
    case BD_CLOCK_TIMED_OUT:
        if (c->wait_ms == 0) {
            /* The configuration's choice, not a problem to warn of. */
            bd_info("clock: not synchronised: %s; time.wait_for_sync is 0: trusting it as it is",
                    why_not(c, kernel, wall_ms, why, sizeof(why)));
        } else {
            bd_warn("clock: still not synchronised after time.wait_for_sync (%s): %s; trusting "
                    "it as it is (trusted by timeout) until it is synchronised",
                    wait, why_not(c, kernel, wall_ms, why, sizeof(why)));
        }
        break;
    case BD_CLOCK_WAITING:
        if (first) {
            bd_warn("clock: not trusted yet: %s; waiting up to %s (time.wait_for_sync) for it "
                    "to be synchronised",
                    why_not(c, kernel, wall_ms, why, sizeof(why)), wait);
        } else {
            bd_warn("clock: no longer trusted: %s; waiting up to %s (time.wait_for_sync) for it "
                    "to be synchronised",
                    revoked, wait);
        }
        break;
    }
}

void bd_clock_poll(struct bd_clock *c) {
    bool first = !c->polled;
    int status = c->src.sync_status(c->src.arg);
    int64_t boot = c->src.boot_ns(c->src.arg);
    int64_t wall = c->src.wall_ns(c->src.arg);
    int64_t mono = c->src.mono_ns(c->src.arg);
    int64_t offset = wall - boot;
    int64_t wall_ms = wall >= 0 ? wall / BD_NS_PER_MS : (wall - BD_NS_PER_MS + 1) / BD_NS_PER_MS;
    char now[40], revoked[200] = "";

    if (status < 0 && !c->status_error_logged) {
        bd_warn("clock: cannot read the kernel's synchronisation status (adjtimex: %s); taking "
                "the wall clock as unsynchronised",
                strerror(-status));
        c->status_error_logged = true;
    }
    bool kernel = status == 1;
    bool above_floor = wall_ms >= c->floor_ms;
    bool stepped = false;
    if (c->polled) {
        int64_t d = offset - c->last_offset_ns;
        if (d > BD_CLOCK_STEP_NS || d < -BD_CLOCK_STEP_NS) {
            stepped = true;
            c->steps++;
            bd_warn("clock: the wall clock was stepped %s by %.3f s (against the boot-time "
                    "clock); it reads %s; the kernel reports it %s",
                    d > 0 ? "forwards" : "backwards", (double)(d > 0 ? d : -d) / BD_NS_PER_S,
                    fmt_wall(now, sizeof(now), wall_ms),
                    kernel ? "synchronised" : "unsynchronised");
        }
    }
    c->polled = true;
    c->last_offset_ns = offset;

    enum bd_clock_state prev = c->state;
    bool prev_synced = c->synced;
    c->synced = kernel && above_floor;
    if (c->state == BD_CLOCK_SYNCED && !above_floor) {
        char floor[40];
        snprintf(revoked, sizeof(revoked), "it reads %s, earlier than %s (%s)",
                 fmt_wall(now, sizeof(now), wall_ms), c->floor_what,
                 fmt_wall(floor, sizeof(floor), c->floor_ms));
        c->state = BD_CLOCK_WAITING;
        c->wait_start_mono_ns = mono;
    } else if (c->state == BD_CLOCK_SYNCED && stepped && !kernel) {
        snprintf(revoked, sizeof(revoked),
                 "it was stepped while the kernel reports it unsynchronised (it reads %s)",
                 fmt_wall(now, sizeof(now), wall_ms));
        c->state = BD_CLOCK_WAITING;
        c->wait_start_mono_ns = mono;
    }
    if (c->state != BD_CLOCK_SYNCED && c->synced) {
        c->state = BD_CLOCK_SYNCED;
    } else if (c->state == BD_CLOCK_WAITING && mono - c->wait_start_mono_ns >= 0 &&
               (uint64_t)(mono - c->wait_start_mono_ns) / BD_NS_PER_MS >= c->wait_ms) {
        c->state = BD_CLOCK_TIMED_OUT;
    }
    publish(c, offset);
    if (first || prev != c->state || prev_synced != c->synced) {
        log_change(c, first, prev, prev_synced, kernel, wall_ms, revoked);
    }
}

void bd_clock_set_wait(struct bd_clock *c, uint64_t wait_for_sync_ms) {
    c->wait_ms = wait_for_sync_ms;
}

int bd_clock_new(struct bd_clock **out, const struct bd_clock_source *src,
                 const struct bd_clock_opts *opts, struct bd_err *err) {
    *out = NULL;
    struct bd_clock *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return bd_err_set(err, -ENOMEM, "clock: out of memory");
    }
    c->src = *src;
    c->wait_ms = opts->wait_for_sync_ms;
    c->floor_ms = opts->floor_wall_ms;
    snprintf(c->floor_what, sizeof(c->floor_what), "%s",
             opts->floor_what != NULL ? opts->floor_what : "the floor");
    c->state = BD_CLOCK_WAITING;
    c->wait_start_mono_ns = c->src.mono_ns(c->src.arg);
    atomic_init(&c->pub_state, BD_CLOCK_WAITING);
    atomic_init(&c->pub_synced, false);
    atomic_init(&c->pub_steps, 0);
    atomic_init(&c->pub_offset_ns, 0);
    bd_clock_poll(c);
    *out = c;
    return 0;
}

void bd_clock_free(struct bd_clock *c) {
    free(c);
}

/* ---- Readers ---- */

enum bd_clock_state bd_clock_state(const struct bd_clock *c) {
    return (enum bd_clock_state)atomic_load_explicit(&((struct bd_clock *)c)->pub_state,
                                                     memory_order_acquire);
}

bool bd_clock_trusted(const struct bd_clock *c) {
    return bd_clock_state(c) != BD_CLOCK_WAITING;
}

bool bd_clock_synchronized(const struct bd_clock *c) {
    return atomic_load_explicit(&((struct bd_clock *)c)->pub_synced, memory_order_relaxed);
}

uint64_t bd_clock_steps(const struct bd_clock *c) {
    return atomic_load_explicit(&((struct bd_clock *)c)->pub_steps, memory_order_relaxed);
}

const char *bd_clock_state_name(enum bd_clock_state s) {
    switch (s) {
    case BD_CLOCK_SYNCED:
        return "synchronized";
    case BD_CLOCK_TIMED_OUT:
        return "timeout";
    case BD_CLOCK_WAITING:
        break;
    }
    return "waiting";
}

int64_t bd_clock_boot_ns(const struct bd_clock *c) {
    return c->src.boot_ns(c->src.arg);
}

int bd_clock_boot_to_wall_ns(const struct bd_clock *c, int64_t boot_ns, int64_t *wall_ns) {
    if (!bd_clock_trusted(c)) {
        return -EAGAIN;
    }
    *wall_ns = boot_ns +
               atomic_load_explicit(&((struct bd_clock *)c)->pub_offset_ns, memory_order_relaxed);
    return 0;
}
