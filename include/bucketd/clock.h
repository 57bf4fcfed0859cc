/*
 * Whether the wall clock can be trusted (DESIGN.md §4 "Time"; README "Clocks on gateways").
 *
 * A gateway without a battery-backed clock boots with the wall clock at 1970 or at the time
 * saved at the last shutdown, until NTP steps it. The kernel knows: adjtimex(2) reports the
 * clock unsynchronised (STA_UNSYNC, or the TIME_ERROR return) until a time daemon has set it.
 * This module polls that status (bd_clock_poll, once a second on the loop thread) and keeps a
 * small state machine:
 *
 *   WAITING      not trusted: the kernel reports the clock unsynchronised, or it reads earlier
 *                than the floor (the newest wall time this writer already stored, or the
 *                build time). The daemon starts here unless the clock is synchronised.
 *   SYNCED       trusted: the kernel reports it synchronised and it is not before the floor.
 *   TIMED_OUT    trusted by timeout: time.wait_for_sync passed in WAITING (at once when it is
 *                0), so the clock is taken as it is; logged once per wait.
 *
 *   WAITING   -> SYNCED     synchronised and not before the floor
 *   WAITING   -> TIMED_OUT  waited time.wait_for_sync (monotonic time) without that
 *   TIMED_OUT -> SYNCED     synchronised and not before the floor
 *   SYNCED    -> WAITING    the clock reads earlier than the floor, or it was stepped while the
 *                           kernel reports it unsynchronised (set by hand or by something that
 *                           does not synchronise it); the wait starts again
 *
 * A clock once synchronised that merely loses the kernel's synchronised flag (no NTP reply for
 * hours: the kernel sets STA_UNSYNC once its error estimate passes 16 s) stays trusted: it drifts
 * by parts per million. A step of the wall clock is seen against the boot-time clock (the
 * offset CLOCK_REALTIME - CLOCK_BOOTTIME changes by more than BD_CLOCK_STEP_NS between polls;
 * CLOCK_BOOTTIME rather than CLOCK_MONOTONIC, which stops during suspend and would make every
 * resume look like a step) and logged with its size.
 *
 * Threads: one owner thread (the loop) calls bd_clock_poll and bd_clock_set_wait; any thread
 * reads the published state (bd_clock_trusted and the other getters), each one atomic load,
 * cheap enough for once per batch. The clock source's functions may be called from any thread.
 *
 * Low in the layers: calls only the clock source, common.h and log.h. The flusher, ingest and
 * metrics call it, never the other way round.
 */
#ifndef BUCKETD_CLOCK_H
#define BUCKETD_CLOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"

/* A change of CLOCK_REALTIME - CLOCK_BOOTTIME between two polls larger than this is a step
 * (NTP slews at most 500 ppm: 0.5 ms per second). */
#define BD_CLOCK_STEP_NS BD_NS_PER_S

/* How often the owner should call bd_clock_poll (the issue asks for at least once a second). */
#define BD_CLOCK_POLL_MS 500

enum bd_clock_state {
    BD_CLOCK_WAITING = 0,
    BD_CLOCK_SYNCED = 1,
    BD_CLOCK_TIMED_OUT = 2,
};

/* Where the clock reads its time; bd_clock_system_source() is the kernel, unit tests play one. */
struct bd_clock_source {
    /* The kernel's synchronisation status: 1 synchronised, 0 not, or a negative errno when it
     * cannot be asked (taken as not synchronised; logged once). */
    int (*sync_status)(void *arg);
    int64_t (*wall_ns)(void *arg); /* CLOCK_REALTIME */
    int64_t (*mono_ns)(void *arg); /* CLOCK_MONOTONIC */
    int64_t (*boot_ns)(void *arg); /* CLOCK_BOOTTIME (counts suspend) */
    void *arg;
};

/* adjtimex(2) and clock_gettime(2). */
const struct bd_clock_source *bd_clock_system_source(void);

/* The build time (Unix seconds): a compile-time constant, the floor when no other is known. */
int64_t bd_clock_build_time_s(void);

struct bd_clock_opts {
    uint64_t wait_for_sync_ms; /* time.wait_for_sync; 0 trusts the clock at once */
    int64_t floor_wall_ms;     /* the wall clock is never earlier than this (0: no floor) */
    const char *floor_what;    /* what the floor is, for the log ("the build time") */
};

struct bd_clock;

/* Allocates, copies *src and *opts (floor_what too), and polls once: the state is known on
 * return. Logs the state it starts in. */
int bd_clock_new(struct bd_clock **out, const struct bd_clock_source *src,
                 const struct bd_clock_opts *opts, struct bd_err *err);
void bd_clock_free(struct bd_clock *c); /* NULL is a no-op */

/* Owner thread: read the kernel's status and the clocks, move the state machine, publish. */
void bd_clock_poll(struct bd_clock *c);

/* Owner thread (a reload of time.wait_for_sync): a wait still running is bounded by the new
 * value from its start (0 ends it), applied by the next bd_clock_poll; a clock already trusted
 * stays trusted. */
void bd_clock_set_wait(struct bd_clock *c, uint64_t wait_for_sync_ms);

/* ---- Any thread: one atomic load each ---- */

/* Stamp and judge readings with the wall clock (SYNCED or TIMED_OUT). */
bool bd_clock_trusted(const struct bd_clock *c);
enum bd_clock_state bd_clock_state(const struct bd_clock *c);
/* At the last poll: the kernel reported the clock synchronised and it was not before the
 * floor (the gauge bucketd_clock_synchronized). */
bool bd_clock_synchronized(const struct bd_clock *c);
/* Steps of the wall clock seen since the start. */
uint64_t bd_clock_steps(const struct bd_clock *c);
/* "waiting", "synchronized", "timeout" (the /healthz and log name of a state). */
const char *bd_clock_state_name(enum bd_clock_state s);

/* The boot-time clock of the source (CLOCK_BOOTTIME): what readings are stamped with while
 * the clock is not trusted. */
int64_t bd_clock_boot_ns(const struct bd_clock *c);

/*
 * The wall time of a CLOCK_BOOTTIME stamp: boot_ns plus (wall - boottime) as measured at the
 * newest poll that found the clock trusted, i.e. the wall time at sync minus the boot time
 * elapsed since the stamp. -EAGAIN while the clock is not trusted (hold the reading).
 */
int bd_clock_boot_to_wall_ns(const struct bd_clock *c, int64_t boot_ns, int64_t *wall_ns);

#endif
