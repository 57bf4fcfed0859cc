/*
 * Reload on SIGHUP (systemctl reload): read the configuration file again and change what may
 * change while running.
 *
 * The file is validated whole first (bd_config_load): one that does not validate changes
 * nothing, and its file:line:col error is logged. Otherwise the keys the schema marks reloadable
 * take the file's values (bd_config_reload_merge); every other key that differs is named in the
 * log and keeps its running value until a restart. Each thread then gets the new values at a
 * point where it reads none of them:
 *   - the loop thread (this module runs on it): log.level, the sensor table's limits and time
 *     window, the clock's time.wait_for_sync, the listener set (added listeners are opened, removed ones closed as at a stop);
 *   - the flusher thread: a copy of the whole configuration, adopted at the start of its next
 *     step (bd_flusher_reconfigure, flusher_reload.c), which passes the store its part.
 * Once the flusher runs the new configuration, the reload is complete: "reload complete" is
 * logged and systemd told READY=1 (after RELOADING=1 at the start; sd_notify(3)).
 *
 * Threads: everything runs on the loop thread, except the flusher's "reconfigured" callback,
 * which only rings this module's async handle.
 */
#ifndef BUCKETD_RELOAD_H
#define BUCKETD_RELOAD_H

#include <uv.h>

#include "bucketd/clock.h"
#include "bucketd/config.h"
#include "bucketd/flusher.h"
#include "bucketd/ingest.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

struct bd_reload;

/* What a reload changes. cfg is the loop thread's running configuration, updated in place. */
struct bd_reload_targets {
    struct bd_config *cfg;
    struct bd_sensor_table *table;
    struct bd_flusher *flusher;
    struct bd_ingest *ingest;
    struct bd_stats *stats;
    struct bd_clock *clock; /* time.wait_for_sync; NULL: none */
};

/* Sets the flusher's reconfigured callback; the handles live on loop. */
int bd_reload_new(struct bd_reload **out, uv_loop_t *loop, const struct bd_reload_targets *t,
                  struct bd_err *err);

/* SIGHUP: reload cfg->path. */
void bd_reload_run(struct bd_reload *r);

/* The daemon stops: close the handles (no more reloads; the flusher's callback does nothing).
 * Run the loop afterwards for their close callbacks. */
void bd_reload_close(struct bd_reload *r);

/* After bd_reload_close and the loop run, or if the loop never ran. NULL is a no-op. */
void bd_reload_free(struct bd_reload *r);

#endif
