/*
 * The on-disk spool: opaque records (serialized batches of bucket updates) kept in FIFO order
 * in one append stream of segment files under spool.dir, so that what MongoDB cannot take now
 * survives a restart or a crash and is replayed oldest first when it can.
 *
 * Files (all in <dir>, created 0600, the directory 0700):
 *   spool-<16 lowercase hex digits>.seg  segments, numbered increasingly from 1; appends go to
 *                                        the highest, a new one starts when the next record would
 *                                        take it past segment_bytes (a record bigger than that
 *                                        gets a segment of its own)
 *   spool.ckpt                           the checkpoint: where replay resumes
 *   spool.ckpt.tmp                       a checkpoint being written (removed at open)
 *
 * Segment: a 32-byte header, then records back to back. All integers little-endian.
 *   header  0  "BDSPSEG1"  magic (8 bytes)
 *           8  u32 version (1)          12  u32 header size (32)
 *          16  u64 segment number       24  u32 reserved (0)
 *          28  u32 CRC-32C of bytes 0-27
 *   record  0  u32 magic "BDRC"         4  u32 payload length (at most BD_SPOOL_MAX_RECORD)
 *           8  u64 seq (the writer's flush sequence)
 *          16  u32 n_readings           20  u32 flags (0)
 *          24  u32 CRC-32C of bytes 0-23 (the header check: makes the length trustworthy)
 *          28  u32 CRC-32C of bytes 0-27 and the payload (the record check)
 *          32  payload
 * Every record carries its own checks; nothing is checksummed per segment. The segment header
 * is informative: records are found by their own magic and checks, so a damaged header costs
 * nothing but a warning.
 *
 * Checkpoint: 40 bytes, replaced whole (temp file, fsync, rename, directory fsync).
 *           0  "BDSPCKPT"  magic        8  u32 version (1)       12  u32 reserved (0)
 *          16  u64 read segment        24  u64 read offset (the first unacknowledged record)
 *          32  u32 CRC-32C of bytes 0-31                          36  u32 reserved (0)
 * The read segment is also the pending delete: every segment numbered below it is finished
 * (acknowledged or dropped) and is deleted, at once or, after a crash, by the next open. A
 * segment is deleted only after a checkpoint naming a later read segment is durable; the
 * watermark stays true after the unlink, so it never needs clearing.
 *
 * Durability and ordering:
 * - Records come back in the order they were appended, each at most once per open.
 * - sync=batch: append returns after fdatasync, and ack after the checkpoint is durable. After a
 *   crash (process or power), every record whose append returned 0 and whose ack had not
 *   returned is delivered again, exactly once; the one append or ack in progress at the crash
 *   may or may not have taken effect.
 * - sync=interval: bd_spool_tick syncs the data and the checkpoint every sync_interval_ms; a
 *   power loss can lose what was appended in the last interval, and a crash can deliver again
 *   what was acknowledged since the last checkpoint (at-least-once).
 * - sync=none: no sync except when a segment is sealed (full), when a segment is deleted, at
 *   bd_spool_flush and at bd_spool_close. After a crash, what was acknowledged since the last
 *   checkpoint is delivered again.
 * - Data is always fdatasync'ed before a checkpoint that points past it, and a full segment is
 *   fdatasync'ed before the next one is started, so only the newest segment can ever hold
 *   unsynced records.
 * Delivering a record again is safe for the daemon: the flusher's updates carry their writer
 * sequence in the filter, so MongoDB applies a replayed batch once (DESIGN.md §3).
 * Costs: batch pays an fdatasync per append and two fsyncs (checkpoint, directory) per
 * acknowledgement; interval and none pay about one of each per interval or per segment. Nothing
 * is written while nothing is appended, except the empty first segment an open creates when
 * there is none (which also proves the directory writable).
 *
 * Recovery (bd_spool_open) reads the checkpoint and the last segment only (the other segments'
 * sizes come from the directory listing), so start-up time does not grow with the backlog:
 * - segments below the checkpoint's read segment are deleted (a delete cut short by a crash);
 * - the last segment is read through: its end is the end of its last valid record, and anything
 *   after it (an interrupted write) is truncated away, counted in torn_tails; damage followed by
 *   valid records is left for replay to skip;
 * - no checkpoint, or one that is torn, garbage or unreadable (counted in bad_checkpoints):
 *   replay starts at the oldest segment present, so acknowledged records still on disk are
 *   delivered again (safe, as above);
 * - a gap in the numbering from the read segment on (a segment removed by hand, lost by the
 *   filesystem) is skipped and each missing number counted in missing_segments;
 * - a bad spool never fails the open; only a directory that cannot be created, is not a
 *   directory or cannot be written is an error, with the path and the reason in err.
 * Replay (bd_spool_peek) checks every record it delivers:
 * - a record whose header check passes but whose record check fails is skipped by its length,
 *   counted in corrupt_records;
 * - a position where no valid header is (a bad magic, a bad header check, a length past the
 *   segment's end) starts a scan forward, byte by byte, for the next header whose magic and
 *   check are valid; everything skipped counts as one corrupt record, and when no valid header
 *   follows, the rest of the segment is skipped the same way. A segment that cannot be read
 *   (EIO) is skipped as one corrupt record.
 *
 * Space: max_bytes caps the sum of the segment files' sizes, headers included, and is checked
 * before every write; the checkpoint file is not counted. A full spool follows `full`:
 * drop_oldest deletes whole oldest segments, unacknowledged records included (counted in
 * dropped_records and dropped_readings, one bd_warn per segment); drop_newest refuses the new
 * record (-ENOSPC, counted as dropped); block refuses it (-ENOSPC, not counted: the caller holds
 * it and stops reading input). The record peek returned is the exception to drop_oldest's
 * count: only the oldest segment can go (the read segment is the delete watermark), and it may
 * be the only one, so the record under replay goes with it; but its reader has it in memory and
 * goes on writing it, so it is not counted as dropped. bd_spool_holds then says it is gone: a
 * reader that gives it up unfinished (a stop) counts what it did not write. A crash loses it
 * uncounted, like everything else only in memory.
 *
 * Threads: one thread (the flusher, or a writer thread) owns a spool; nothing here is
 * thread-safe, bd_spool_get_stats included (the owner copies the numbers out for /metrics).
 */
#ifndef BUCKETD_SPOOL_H
#define BUCKETD_SPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bucketd/common.h"

#define BD_SPOOL_SEGMENT_HEADER_BYTES 32
#define BD_SPOOL_RECORD_HEADER_BYTES 32
#define BD_SPOOL_CHECKPOINT_BYTES 40
/* Largest payload; also the plausibility bound on a length read back from disk. */
#define BD_SPOOL_MAX_RECORD (UINT32_C(64) << 20)
#define BD_SPOOL_DEFAULT_SEGMENT_BYTES (UINT64_C(4) << 20)
#define BD_SPOOL_DEFAULT_SYNC_INTERVAL_MS 1000

struct bd_spool;

enum bd_spool_sync { BD_SPOOL_SYNC_NONE, BD_SPOOL_SYNC_INTERVAL, BD_SPOOL_SYNC_BATCH };
enum bd_spool_full { BD_SPOOL_DROP_OLDEST, BD_SPOOL_DROP_NEWEST, BD_SPOOL_BLOCK };

struct bd_spool_opts {
    const char *dir;           /* created with its parents if missing (mode 0700) */
    uint64_t max_bytes;        /* cap on all segment files, headers included; 0: no cap */
    uint64_t segment_bytes;    /* start a new segment past this; 0: 4 MiB */
    enum bd_spool_sync sync;   /* see "Durability and ordering" above */
    uint64_t sync_interval_ms; /* interval policy; 0: 1000 */
    enum bd_spool_full full;   /* what append does when the cap would be passed */
};

/*
 * Gauges (bytes .. uncounted_segments) describe the files now; the rest count since the open.
 * records and readings are exact for the segments whose contents this process knows: the ones it
 * wrote, the last one (read through at open) and any it has read through; older segments found
 * at open are not read before replay reaches them (start-up would grow with the backlog), so
 * they are left out and counted in uncounted_segments. bytes is the sum of the segment files'
 * sizes (what max_bytes caps), acknowledged records of a segment not yet deleted included.
 */
struct bd_spool_stats {
    uint64_t bytes, segments, records, readings; /* on disk, unacknowledged (see above) */
    uint64_t uncounted_segments;                 /* segments left out of records/readings */
    uint64_t appended, appended_bytes;           /* records appended, their payload bytes */
    uint64_t replayed, acked;                    /* records delivered by peek, acknowledged */
    uint64_t corrupt_records, torn_tails, missing_segments, bad_checkpoints;
    uint64_t dropped_records, dropped_readings; /* by the full policy */
    uint64_t write_errors;                      /* failed writes, syncs, segment creations */
    uint64_t syncs;                             /* fdatasync calls on segment data */
    uint64_t recovery_bytes_read;               /* bytes bd_spool_open read from the files */
};

/* One record as peek returns it. data stays valid until the next call on the spool. */
struct bd_spool_record {
    uint64_t id; /* for bd_spool_ack; opaque, unique within one open */
    uint64_t seq;
    uint32_t n_readings;
    uint32_t flags; /* as appended */
    /* Where it is on disk: its segment's number and its offset there. Unlike id, stable across
     * opens until the record is acknowledged (positions only grow). */
    uint64_t segment, offset;
    const uint8_t *data;
    size_t len;
};

/*
 * Open (create) the spool in o->dir and recover it (see above). Errors: -EINVAL for bad options;
 * a directory that cannot be created, is not a directory or cannot be written (the negative
 * errno, err names the path); -ENOMEM.
 */
int bd_spool_open(struct bd_spool **out, const struct bd_spool_opts *o, struct bd_err *err);

/*
 * Append one record (seq: the writer's flush sequence; n_readings: for the drop counters; flags:
 * the caller's, given back by peek).
 * Returns 0; -ENOSPC when the spool is full and the policy refuses (drop_newest, block: nothing
 * written); -EMSGSIZE when the record can never fit (len above BD_SPOOL_MAX_RECORD, or one
 * record and a segment header above max_bytes: nothing written, nothing dropped); or the
 * negative errno of a disk error (ENOSPC, EFBIG, EIO ...: counted in write_errors, nothing of
 * the record kept: a partial write is truncated away, or left as a torn tail that replay and
 * recovery skip, and the next append starts a new segment). With sync=batch the record is
 * durable when 0 is returned.
 */
int bd_spool_append(struct bd_spool *s, uint64_t seq, uint32_t n_readings, uint32_t flags,
                    const void *data, size_t len);

/*
 * Policy-driven durability, to be called regularly with the caller's monotonic clock: with
 * sync=interval, when unsynced data or an unsaved checkpoint is waiting and sync_interval_ms
 * has passed since the last sync, sync them. Does nothing for batch and none. 0 or -errno.
 */
int bd_spool_tick(struct bd_spool *s, int64_t mono_ns);

/* fdatasync unsynced records and save the checkpoint if it moved, now. 0 or -errno. */
int bd_spool_flush(struct bd_spool *s);

/*
 * The oldest unacknowledged record, read from disk (one record in memory at a time). 0 and *rec
 * filled; the same record again until it is acknowledged; -ENOENT when there is none; -ENOMEM.
 * Corrupt records are skipped and counted on the way, and a segment that holds nothing more to
 * deliver is deleted.
 */
int bd_spool_peek(struct bd_spool *s, struct bd_spool_record *rec);

/*
 * Acknowledge the record peek returned (FIFO: always the oldest). Moves the checkpoint (saved now
 * with sync=batch, else by tick/flush/close or the next segment delete) and deletes a segment
 * whose records are all acknowledged. 0; 0 also for an id that is already gone (acknowledged
 * before, or dropped by drop_oldest after peek returned it); -EINVAL for an id peek has not
 * returned; a negative errno when saving the checkpoint failed (the acknowledgement stands in
 * memory, and the next save carries it).
 */
int bd_spool_ack(struct bd_spool *s, uint64_t id);

/* Whether the record peek returned as id is still on disk unacknowledged: false once it is
 * acknowledged, or once drop_oldest deleted its segment while it was being replayed. */
bool bd_spool_holds(const struct bd_spool *s, uint64_t id);

/* A new cap (a reload; 0: none), applied from the next append on: a spool already above it is
 * brought under it by that append as `full` says. */
void bd_spool_set_max_bytes(struct bd_spool *s, uint64_t max_bytes);

/*
 * No unacknowledged record is left before the write end. false can still mean that peek finds
 * nothing but corrupt bytes (it then skips them and the spool becomes empty).
 */
bool bd_spool_empty(const struct bd_spool *s);

void bd_spool_get_stats(const struct bd_spool *s, struct bd_spool_stats *out);

/* Sync, save the checkpoint, close; the files stay. NULL is a no-op. */
void bd_spool_close(struct bd_spool *s);

/*
 * Test hooks: make the process _exit(86) when the spool reaches the named point, as a crash
 * would stop it there (the page cache survives, as it does when a process is killed). The first
 * time the point is reached after the call; BD_SPOOL_CRASH_NONE turns it off.
 */
enum bd_spool_crash {
    BD_SPOOL_CRASH_NONE,
    BD_SPOOL_CRASH_RECORD_TORN,      /* the first half of a record written, not the rest */
    BD_SPOOL_CRASH_RECORD_WRITTEN,   /* a record written, before its fdatasync (batch) */
    BD_SPOOL_CRASH_SEGMENT_CREATED,  /* a new segment and its header written, before dir fsync */
    BD_SPOOL_CRASH_CKPT_TMP_WRITTEN, /* the temp checkpoint written and synced, before rename */
    BD_SPOOL_CRASH_CKPT_RENAMED,     /* the checkpoint renamed into place, before dir fsync */
    BD_SPOOL_CRASH_DELETE_RECORDED,  /* the checkpoint naming a segment finished, before unlink */
    BD_SPOOL_CRASH_DELETE_UNLINKED,  /* the segment unlinked, before the directory fsync */
};
#define BD_SPOOL_CRASH_EXIT 86
void bd_spool_crash_at(int step);

#endif
