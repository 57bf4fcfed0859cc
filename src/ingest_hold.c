/*
 * Lines held while the wall clock is not trusted (src/ingest_hold.h; hold.h has the rules and the
 * file). Ingest thread only: the daemon polls the clock on the same loop and calls
 * ingest_hold_tick after each poll, so the hold's state changes between lines, never during one;
 * while it holds, the ingest core puts each parsed line into the hold (one flag test a line).
 *
 * Release: once the clock is trusted, held lines are parsed again (with their listener's format
 * and precision, kept in the hold) and handed to the sensor table as if they had arrived at
 * their true wall time, oldest first, RELEASE_PER_TICK at most a tick and only while the buffer
 * pool is not congested: releasing a long hold at once must not fill the pool and drop what it
 * holds or what arrives meanwhile. A line whose sensor is busy waits for the next tick, and with
 * it every line behind it, so a sensor's held readings keep their order.
 */
#include "ingest_hold.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/sensor.h"

#define RELEASE_PER_TICK 20000

int ingest_hold_open(struct bd_ingest *in, const struct bd_clock *clock,
                     const struct bd_config *cfg, struct bd_err *err) {
    in->clock = clock;
    in->spool_dir = strdup(cfg->spool.dir);
    in->hold_point = malloc(sizeof(*in->hold_point));
    if (in->spool_dir == NULL || in->hold_point == NULL ||
        bd_hold_new(&in->hold, (size_t)(cfg->limits.memory / 4)) < 0) {
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    bd_hold_boot_id(in->boot_id);
    uint64_t n = 0, dropped = 0;
    int rc = bd_hold_load(in->hold, in->spool_dir, in->boot_id, &n, &dropped, err);
    if (rc < 0) {
        bd_error("%s; the lines it held are not taken back", err->msg);
        err->msg[0] = '\0';
    } else if (n + dropped > 0) {
        BD_STAT_ADD(in->stats, drop_clock_hold_full, dropped);
        bd_info("%" PRIu64 " lines held while the clock was not trusted were taken back from %s/%s"
                "%s; they are written once the clock is trusted",
                n, in->spool_dir, BD_HOLD_FILE,
                dropped ? " (some dropped: the hold is full, counted in drop_clock_hold_full)"
                        : "");
    }
    ingest_hold_tick(in);
    return 0;
}

static struct bd_parser *parser_for(struct bd_ingest *in, uint8_t format, uint8_t precision) {
    if (format >= 2 || precision >= 4) {
        return NULL;
    }
    if (!in->hold_parser_ok[format][precision]) {
        if (bd_parser_init(&in->hold_parsers[format][precision], (enum bd_format)format,
                           (enum bd_precision)precision, in->max_line) < 0) {
            return NULL;
        }
        in->hold_parser_ok[format][precision] = true;
    }
    return &in->hold_parsers[format][precision];
}

static void release(struct bd_ingest *in) {
    const bool timed_out = bd_clock_state(in->clock) == BD_CLOCK_TIMED_OUT;
    uint64_t unsynced = 0;
    struct bd_hold_line hl;
    for (int k = 0; k < RELEASE_PER_TICK && bd_hold_peek(in->hold, &hl) == 0; k++) {
        if (bd_sensor_table_congested(in->table)) {
            break; /* the flusher drains first; the rest goes at the next tick */
        }
        struct bd_parser *p = parser_for(in, hl.format, hl.precision);
        if (p == NULL) {
            break; /* out of memory: tried again at the next tick */
        }
        const char *errmsg = NULL;
        int rc = bd_parse_line(p, hl.line, hl.len, in->hold_point, &errmsg);
        if (rc >= 0 && rc != BD_PARSE_SKIP) {
            int64_t wall = hl.stamp_ns;
            if (hl.kind == BD_HOLD_BOOT &&
                bd_clock_boot_to_wall_ns(in->clock, hl.stamp_ns, &wall) < 0) {
                break; /* not trusted after all */
            }
            if (bd_sensor_table_accept(in->table, in->hold_point, wall) == -EAGAIN) {
                break; /* its sensor is busy: it and the lines behind it wait */
            }
            unsynced += timed_out || hl.kind == BD_HOLD_WALL;
        }
        bd_hold_pop(in->hold);
    }
    BD_STAT_ADD(in->stats, readings_stamped_unsynced, unsynced);
    if (unsynced > 0 && !in->unsynced_logged) {
        in->unsynced_logged = true;
        bd_warn("held readings are being stamped and judged with a wall clock that is not "
                "synchronised (%s): counted in readings_stamped_unsynced",
                timed_out ? "time.wait_for_sync passed" : "held across a reboot");
    }
}

void ingest_hold_tick(struct bd_ingest *in) {
    if (in->clock == NULL || in->hold == NULL) {
        return;
    }
    bool trusted = bd_clock_trusted(in->clock);
    if (!trusted && !in->holding) {
        in->unsynced_logged = false; /* a new wait */
    }
    in->holding = !trusted;
    if (trusted && bd_hold_count(in->hold) > 0) {
        release(in);
    }
}

void ingest_hold_save(struct bd_ingest *in) {
    if (in->hold == NULL) {
        return;
    }
    in->holding = false;
    if (bd_clock_trusted(in->clock)) {
        release(in); /* what the pool takes now; the rest is saved */
    }
    uint64_t n = bd_hold_count(in->hold);
    struct bd_err err = {0};
    int rc = bd_hold_save(in->hold, in->spool_dir, in->boot_id, bd_now_ns(),
                          bd_clock_boot_ns(in->clock), &err);
    if (rc < 0) {
        BD_STAT_ADD(in->stats, readings_lost, n);
        bd_error("%" PRIu64 " lines held while the clock was not trusted were lost: %s", n,
                 err.msg);
    } else if (n > 0) {
        bd_warn("%" PRIu64 " lines held while the clock was not trusted were saved to %s/%s: the "
                "next start takes them back",
                n, in->spool_dir, BD_HOLD_FILE);
    }
}
