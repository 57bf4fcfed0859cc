/*
 * Lines held while the wall clock cannot be trusted (clock.h; README "Clocks on gateways").
 *
 * While the clock is not trusted, a reading without a timestamp cannot be stamped and one with a
 * timestamp cannot be judged against buckets.max_late / max_future. The ingest thread keeps each
 * such line as it came (its text, its listener's format and precision) with the boot-time clock
 * (CLOCK_BOOTTIME) of its arrival. Once the clock is trusted the lines are handed to the sensor
 * table again, oldest first, as if they had arrived at their true wall time: the wall time at
 * sync minus the boot time elapsed since the arrival (bd_clock_boot_to_wall_ns). A bare reading
 * is stamped with that time and every reading is judged against it, so a gateway that boots with
 * its clock hours behind stores each reading in its true hour.
 *
 * In memory at most max_bytes of lines (the ingest takes limits.memory / 4); past it a line is
 * refused (the caller counts drop_clock_hold_full). On disk (src/ingest_hold.c): at each poll the
 * lines held since the last one are appended as one record to the held-lines spool
 * (<spool.dir>/held, spool.h) and leave memory, so that what is held is as durable as what the
 * flusher spools and memory holds at most one poll's lines. A record carries the kernel's boot
 * id: the boot-time stamps still hold after a restart within the same boot; after a reboot they
 * mean nothing, so each line is given the (untrusted) wall time it arrived at instead, as
 * estimated at the append, and is released with it (counted in readings_stamped_unsynced).
 *
 * A record (integers little-endian): "BDHELD02", the boot id (36 bytes, NUL padded to 40), i64
 * wall ns and i64 boot ns at the append, then per line: u32 line length, u8 format, u8
 * precision, u8 kind, u8 0, i64 stamp (boot ns, or wall ns for kind BD_HOLD_WALL), the line. The
 * spool checks each record (CRC-32C).
 *
 * Ingest thread only; no I/O.
 */
#ifndef BUCKETD_HOLD_H
#define BUCKETD_HOLD_H

#include <stddef.h>
#include <stdint.h>

#include "bucketd/common.h"

/* The held-lines spool, under spool.dir. */
#define BD_HOLD_DIR "held"
#define BD_HOLD_RECORD_HEADER 64

enum bd_hold_kind {
    BD_HOLD_BOOT = 0, /* stamp: CLOCK_BOOTTIME at arrival, converted once the clock is trusted */
    BD_HOLD_WALL = 1, /* stamp: the untrusted wall time at arrival (held across a reboot) */
};

struct bd_hold_line {
    uint8_t format, precision, kind;
    int64_t stamp_ns;
    const char *line; /* valid until the next pop or add */
    size_t len;
};

struct bd_hold;

int bd_hold_new(struct bd_hold **out, size_t max_bytes);
void bd_hold_free(struct bd_hold *h); /* NULL is a no-op */
void bd_hold_set_max_bytes(struct bd_hold *h, size_t max_bytes);

/* Keep one line. 0; -ENOSPC past max_bytes; -ENOMEM. */
int bd_hold_add(struct bd_hold *h, const struct bd_hold_line *l);

/* The oldest line: 0, or -ENOENT when nothing is held. */
int bd_hold_peek(const struct bd_hold *h, struct bd_hold_line *out);
void bd_hold_pop(struct bd_hold *h);

uint64_t bd_hold_count(const struct bd_hold *h);
size_t bd_hold_bytes(const struct bd_hold *h);

/* The kernel's boot id (/proc/sys/kernel/random/boot_id) into id[40]; "" when unknown. */
void bd_hold_boot_id(char id[40]);

/* Drop everything held (once written elsewhere). */
void bd_hold_clear(struct bd_hold *h);

/* A record of everything held (malloc'ed into *out), with the boot id and the clocks now. */
int bd_hold_record(const struct bd_hold *h, const char *boot_id, int64_t wall_ns, int64_t boot_ns,
                   uint8_t **out, size_t *out_len);

/*
 * Take a record's lines into h, behind what it holds: the boot-time stamps as they were when
 * boot_id is the record's, else each line's estimated wall time (BD_HOLD_WALL). *n_lines taken,
 * *n_dropped refused by h (full). 0, or -EBADMSG (nothing taken) when it does not parse.
 */
int bd_hold_take(struct bd_hold *h, const uint8_t *rec, size_t len, const char *boot_id,
                 uint64_t *n_lines, uint64_t *n_dropped);

#endif
