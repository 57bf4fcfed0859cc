/*
 * Reload on SIGHUP (see include/bucketd/reload.h for what changes and when).
 *
 * Threads: the loop thread owns struct bd_reload and every uv handle in it. The flusher thread
 * only calls flusher_reconfigured(), which stores the generation it adopted (an atomic) and
 * rings `adopted` under mu, the lock that keeps it from ringing a handle being closed (the
 * flusher runs on after the loop has closed its handles, until the daemon joins it).
 *
 * Generations: every SIGHUP that gets as far as handing a configuration to the flusher takes
 * the next number; the reload is complete when the flusher reports the newest one. Two SIGHUPs
 * in quick succession give one "reload complete", for the second.
 */
#include "bucketd/reload.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <systemd/sd-daemon.h>
#include <time.h>

#include "bucketd/log.h"

struct bd_reload {
    struct bd_reload_targets t;
    uv_async_t adopted;
    bool adopted_open; /* guarded by mu */
    pthread_mutex_t mu;
    _Atomic uint64_t adopted_gen;  /* the newest generation the flusher runs */
    uint64_t gen;                  /* the newest handed over (loop thread) */
    uint64_t done_gen;             /* the newest reported complete (loop thread) */
    uint32_t changes, not_applied; /* of the reload running (loop thread) */
};

/* sd_notify wants MONOTONIC_USEC with RELOADING=1 (systemd >= 253, Type=notify-reload: it tells
 * this reload from an earlier one); systemd 252 ignores the field. */
static void notify_reloading(const char *path) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t usec = (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
    sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%" PRIu64 "\nSTATUS=reloading %s", usec, path);
}

static void notify_ready(const char *status) {
    sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

/* Flusher thread. */
static void flusher_reconfigured(void *arg, uint64_t gen) {
    struct bd_reload *r = arg;
    atomic_store_explicit(&r->adopted_gen, gen, memory_order_relaxed);
    pthread_mutex_lock(&r->mu);
    if (r->adopted_open) {
        uv_async_send(&r->adopted);
    }
    pthread_mutex_unlock(&r->mu);
}

static void on_adopted(uv_async_t *h) {
    struct bd_reload *r = h->data;
    uint64_t gen = atomic_load_explicit(&r->adopted_gen, memory_order_relaxed);
    if (gen != r->gen || r->done_gen == gen) {
        return; /* an older one; the newest is still on its way */
    }
    r->done_gen = gen;
    bd_info("reload complete: every thread runs the configuration of %s", r->t.cfg->path);
    notify_ready("ready (configuration reloaded)");
}

static void on_change(void *arg, const struct bd_config_change *c) {
    struct bd_reload *r = arg;
    r->changes++;
    if (strcmp(c->key, "listeners") == 0) {
        bd_info("reload: listener %s %s", c->from[0] != '\0' ? c->from : c->to,
                c->from[0] != '\0' ? "removed" : "added");
    } else if (c->applied) {
        bd_info("reload: %s: %s -> %s", c->key, c->from, c->to);
    } else {
        r->not_applied++;
        bd_warn("reload: %s: %s -> %s needs a restart; keeping %s until then", c->key, c->from,
                c->to, c->from);
    }
}

/* A limit the sensor table sized at start cannot grow past (room): the running value stays. */
static void fit(struct bd_reload *r, const char *key, uint32_t *want, uint32_t room,
                uint32_t running, const char *sized) {
    if (*want > room) {
        bd_warn("reload: %s: %u is more than %s (%u); keeping %u until a restart", key, *want,
                sized, room, running);
        *want = running;
        r->not_applied++;
    }
}

static void fit_table_room(struct bd_reload *r, struct bd_config *next) {
    uint32_t sensors_room, fields_room;
    bd_sensor_table_limits_room(r->t.table, &sensors_room, &fields_room);
    fit(r, "limits.max_sensors", &next->limits.max_sensors, sensors_room,
        r->t.cfg->limits.max_sensors, "the sensor queues reserved at start hold");
    fit(r, "limits.max_fields", &next->limits.max_fields, fields_room, r->t.cfg->limits.max_fields,
        "the buffer pool's segments were sized for at start");
}

void bd_reload_run(struct bd_reload *r) {
    struct bd_config *cur = r->t.cfg;
    struct bd_config *loaded = malloc(sizeof(*loaded));
    struct bd_config *next = malloc(sizeof(*next));
    struct bd_err err = {0};
    char status[160];

    notify_reloading(cur->path);
    bd_info("SIGHUP: reloading %s", cur->path);
    if (loaded == NULL || next == NULL) {
        bd_err_set(&err, -ENOMEM, "%s: out of memory", cur->path);
        goto refused;
    }
    if (bd_config_load(loaded, cur->path, &err) < 0) {
        goto refused;
    }
    r->changes = r->not_applied = 0;
    if (bd_config_reload_merge(cur, loaded, next, on_change, r, &err) < 0) {
        goto refused;
    }
    fit_table_room(r, next);

    bd_log_set_level((enum bd_log_level)next->log.level);
    bd_sensor_table_set_limits(r->t.table, next);
    if (r->t.clock != NULL) {
        bd_clock_set_wait(r->t.clock, next->time.wait_for_sync_ms);
        bd_clock_poll(r->t.clock); /* a wait already past the new bound ends now */
    }
    if (bd_ingest_set_listeners(r->t.ingest, next) < 0) {
        r->not_applied++; /* a listener that could not be opened: logged, left out of next */
    }
    r->gen++;
    if (bd_flusher_reconfigure(r->t.flusher, next, r->gen) < 0) {
        bd_error("reload: out of memory handing the configuration to the flusher; it keeps "
                 "running the previous one");
        r->gen--;
        notify_ready("ready (reload incomplete: the flusher keeps its configuration)");
    }
    *cur = *next;
    BD_STAT_ADD(r->t.stats, config_reloads, 1);
    bd_info("reload: %s read: %u changes, %u of them not applied (named above)", cur->path,
            r->changes, r->not_applied);
    goto out;

refused:
    BD_STAT_ADD(r->t.stats, config_reload_errors, 1);
    bd_error("reload: %s; the running configuration stays in force", err.msg);
    snprintf(status, sizeof(status), "ready (reload refused: %.100s)", err.msg);
    notify_ready(status);
out:
    free(loaded);
    free(next);
}

int bd_reload_new(struct bd_reload **out, uv_loop_t *loop, const struct bd_reload_targets *t,
                  struct bd_err *err) {
    struct bd_reload *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        return bd_err_set(err, -ENOMEM, "reload: out of memory");
    }
    r->t = *t;
    pthread_mutex_init(&r->mu, NULL);
    atomic_init(&r->adopted_gen, 0);
    uv_async_init(loop, &r->adopted, on_adopted);
    r->adopted.data = r;
    r->adopted_open = true;
    bd_flusher_set_reconfigured(t->flusher, flusher_reconfigured, r);
    *out = r;
    return 0;
}

void bd_reload_close(struct bd_reload *r) {
    if (r == NULL) {
        return;
    }
    pthread_mutex_lock(&r->mu);
    bool open = r->adopted_open;
    r->adopted_open = false;
    pthread_mutex_unlock(&r->mu);
    if (open) {
        uv_close((uv_handle_t *)&r->adopted, NULL);
    }
}

void bd_reload_free(struct bd_reload *r) {
    if (r == NULL) {
        return;
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
}
