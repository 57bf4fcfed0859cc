/*
 * Lines held while the wall clock is not trusted (src/ingest_hold.h; hold.h has the rules and the
 * record layout). Ingest thread only: the daemon polls the clock on the same loop and calls
 * ingest_hold_tick after each poll, so the hold's state changes between lines, never during one;
 * while it holds, the ingest core puts each parsed line into the memory hold (one flag test a
 * line).
 *
 * Durability: at each tick the lines held since the last one are appended as one record to the
 * held-lines spool (<spool.dir>/held, its own spool.h directory, with spool.sync, spool.max_bytes
 * / 4 and drop_newest) and leave memory: what is held is on disk within the bound of the
 * flusher's spool, and memory holds at most one tick's lines. The spool is opened when first
 * needed (or at start when an earlier run left one), so a daemon whose clock is trusted writes
 * nothing there.
 *
 * Release: once the clock is trusted, the oldest record is read back and acknowledged, then its
 * lines are parsed again (with their listener's format and precision, kept in the record) and
 * handed to the sensor table as if they had arrived at their true wall time, oldest first,
 * RELEASE_PER_TICK at most a tick and only while the buffer pool is not congested: releasing a
 * long hold at once must not fill the pool and drop what it holds or what arrives meanwhile. A
 * line whose sensor is busy waits for the next tick, and with it every line behind it. The
 * record is acknowledged before its lines go on, so a crash can lose them (like any reading not
 * yet written: the crash bound) but never hand them to the table twice.
 */
#include "ingest_hold.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bucketd/sensor.h"

#define RELEASE_PER_TICK 20000

static bool open_disk(struct bd_ingest *in) {
    if (in->held_disk != NULL) {
        return true;
    }
    if (in->held_dir == NULL) {
        return false;
    }
    struct bd_err err = {0};
    if (bd_spool_open(&in->held_disk, &in->held_opts, &err) < 0) {
        if (bd_ratelimit_ok(&in->held_log, bd_mono_ns())) {
            bd_error("lines held for the clock stay in memory: %s", err.msg);
        }
        return false;
    }
    return true;
}

int ingest_hold_open(struct bd_ingest *in, const struct bd_clock *clock,
                     const struct bd_config *cfg, struct bd_err *err) {
    in->clock = clock;
    in->held_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 2};
    in->hold_point = malloc(sizeof(*in->hold_point));
    size_t cap = (size_t)(cfg->limits.memory / 4);
    if (in->hold_point == NULL || bd_hold_new(&in->hold, cap) < 0 ||
        bd_hold_new(&in->releasing, cap) < 0) {
        return bd_err_set(err, -ENOMEM, "ingest: out of memory");
    }
    bd_hold_boot_id(in->boot_id);
    if (cfg->sink == BD_SINK_MONGODB) {
        size_t len = strlen(cfg->spool.dir) + sizeof("/" BD_HOLD_DIR);
        in->held_dir = malloc(len);
        uint64_t interval_ms = 0;
        int sync = bd_config_spool_sync(cfg->spool.sync, &interval_ms);
        if (in->held_dir == NULL || sync < 0) {
            return bd_err_set(err, -ENOMEM, "ingest: out of memory");
        }
        snprintf(in->held_dir, len, "%s/%s", cfg->spool.dir, BD_HOLD_DIR);
        in->held_opts = (struct bd_spool_opts){.dir = in->held_dir,
                                               .max_bytes = cfg->spool.max_bytes / 4,
                                               .sync = (enum bd_spool_sync)sync,
                                               .sync_interval_ms = interval_ms,
                                               .full = BD_SPOOL_DROP_NEWEST};
        struct stat st;
        if (stat(in->held_dir, &st) == 0 && open_disk(in) && !bd_spool_empty(in->held_disk)) {
            struct bd_spool_stats ss;
            bd_spool_get_stats(in->held_disk, &ss);
            bd_info("%s holds %" PRIu64 " bytes of lines held while the clock was not trusted, "
                    "from an earlier run: they are written once the clock is trusted",
                    in->held_dir, ss.bytes);
        }
    }
    ingest_hold_tick(in);
    return 0;
}

/* The lines held since the last tick, to disk as one record (kept in memory if they cannot). */
static void persist(struct bd_ingest *in) {
    uint64_t n = bd_hold_count(in->hold);
    if (n == 0 || !open_disk(in)) {
        return;
    }
    uint8_t *rec = NULL;
    size_t len = 0;
    if (bd_hold_record(in->hold, in->boot_id, bd_now_ns(), bd_clock_boot_ns(in->clock), &rec,
                       &len) < 0) {
        return; /* out of memory: tried again at the next tick */
    }
    struct bd_spool_stats before, after;
    bd_spool_get_stats(in->held_disk, &before);
    int rc =
        bd_spool_append(in->held_disk, 0, (uint32_t)BD_MIN(n, (uint64_t)UINT32_MAX), 0, rec, len);
    bd_spool_get_stats(in->held_disk, &after);
    free(rec);
    bool disk = after.write_errors > before.write_errors;
    if (rc == 0 || (rc == -ENOSPC && !disk) || rc == -EMSGSIZE) {
        if (rc != 0) {
            /* The held-lines spool is full (drop_newest): these lines are dropped. */
            BD_STAT_ADD(in->stats, drop_clock_hold_full, n);
            if (bd_ratelimit_ok(&in->held_log, bd_mono_ns())) {
                bd_error("%s is full (spool.max_bytes / 4): %" PRIu64 " lines held for the clock "
                         "dropped",
                         in->held_dir, n);
            }
        }
        bd_hold_clear(in->hold);
    } else if (bd_ratelimit_ok(&in->held_log, bd_mono_ns())) {
        bd_error("cannot write %" PRIu64 " lines held for the clock to %s: %s; they stay in "
                 "memory",
                 n, in->held_dir, strerror(-rc));
    }
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

/* The next record of the held-lines spool into in->releasing, acknowledged. */
static bool next_record(struct bd_ingest *in) {
    struct bd_spool_record rec;
    if (in->held_disk == NULL || bd_spool_peek(in->held_disk, &rec) < 0) {
        return false;
    }
    uint64_t n = 0, dropped = 0;
    if (bd_hold_take(in->releasing, rec.data, rec.len, in->boot_id, &n, &dropped) < 0) {
        bd_error("%s: a record of %" PRIu32 " held lines does not parse: skipped", in->held_dir,
                 rec.n_readings);
        dropped = rec.n_readings;
    }
    BD_STAT_ADD(in->stats, drop_clock_hold_full, dropped);
    bd_spool_ack(in->held_disk, rec.id);
    return true;
}

static void release(struct bd_ingest *in) {
    const bool timed_out = bd_clock_state(in->clock) == BD_CLOCK_TIMED_OUT;
    uint64_t unsynced = 0;
    struct bd_hold_line hl;
    for (int k = 0; k < RELEASE_PER_TICK; k++) {
        /* Oldest first: the record being released, the spool's next, what memory holds. */
        struct bd_hold *from = in->releasing;
        if (bd_hold_count(from) == 0 && !next_record(in)) {
            from = in->hold;
        }
        if (bd_hold_peek(from, &hl) < 0 || bd_sensor_table_congested(in->table)) {
            break; /* nothing left, or the flusher drains first: the rest at the next tick */
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
        bd_hold_pop(from);
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
    if (in->holding || (in->held_disk != NULL && !bd_spool_empty(in->held_disk))) {
        persist(in); /* behind what the disk holds, in order */
    }
    if (trusted) {
        release(in);
    }
    if (in->held_disk != NULL) {
        bd_spool_tick(in->held_disk, bd_mono_ns());
    }
}

void ingest_hold_save(struct bd_ingest *in) {
    if (in->hold == NULL) {
        return;
    }
    in->holding = false;
    if (bd_clock_trusted(in->clock)) {
        release(in); /* what the pool takes now; the rest stays on disk */
    }
    /* Lines of a record already acknowledged go back to the spool, behind the rest. */
    uint64_t taken = bd_hold_count(in->releasing);
    if (taken > 0) {
        persist(in); /* memory's first: they came later, but nothing orders them */
        struct bd_hold *swap = in->hold;
        in->hold = in->releasing;
        in->releasing = swap;
    }
    uint64_t n = bd_hold_count(in->hold);
    persist(in);
    uint64_t left = bd_hold_count(in->hold);
    if (left > 0) {
        BD_STAT_ADD(in->stats, readings_lost, left);
        bd_error("%" PRIu64 " lines held while the clock was not trusted were lost: they could "
                 "not be written to %s",
                 left, in->held_dir != NULL ? in->held_dir : "(no spool with the blackhole sink)");
    }
    if (in->held_disk != NULL) {
        bd_spool_flush(in->held_disk);
        if (!bd_spool_empty(in->held_disk)) {
            bd_warn("lines held while the clock was not trusted are kept in %s (%" PRIu64
                    " from this stop): the next start writes them once the clock is trusted",
                    in->held_dir, n - left);
        }
    }
}
