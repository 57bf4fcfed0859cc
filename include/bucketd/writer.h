/*
 * This daemon's identity as a MongoDB writer: the per-writer flush sequence that makes bucket
 * updates idempotent, kept under spool.dir so that it survives restarts and wall-clock jumps.
 *
 * Every bulk write carries one sequence number N, and each of its updates only applies to a
 * document whose "w.<writer_id>" is below N (bucket.c). Re-sending the same update after an
 * ambiguous failure is then a no-op. That only holds if N never repeats, so numbers are handed
 * out from a block reserved on disk (fsync'ed) before any of them is used: a crash skips the
 * rest of the block instead of reusing it.
 *
 * Files in spool.dir:
 *   writer-id     the writer id this daemon uses when the config sets none: generated on the
 *                 first start, one line, replaced atomically (bd_writer_identity);
 *   writer.lock   flock()ed while the daemon runs: a second daemon on the same directory is
 *                 refused at start-up;
 *   writer.state  text, replaced atomically and durably (write, fsync, rename, fsync of the
 *                 directory), every time:
 *                   bucketd-writer 1
 *                   writer_id <id>
 *                   reserved <first sequence not yet handed out by any run>
 *                   max_bucket_start_ms <newest bucket start written>
 *                   last_ack_ms <wall-clock ms of an acknowledged bulk write, at most
 *                                BD_WRITER_ACK_SAVE_MS before the last one>
 *                   clean <1 if the last run stopped through its stop path>
 *
 * Flusher thread only after bd_writer_open.
 */
#ifndef BUCKETD_WRITER_H
#define BUCKETD_WRITER_H

#include <stdbool.h>
#include <stdint.h>

#include "bucketd/common.h"

/* writer.state's last_ack_ms is brought up to date at most this often (and whenever a newer
 * bucket is written, and at a stop), so a crash report can be this much older than the last
 * acknowledged write. */
#define BD_WRITER_ACK_SAVE_MS 60000

/* The file in spool.dir that keeps the writer id across starts. */
#define BD_WRITER_ID_FILE "writer-id"
/* Longest writer id (the config's bound). */
#define BD_WRITER_ID_MAX 64

/* Where the writer id a daemon uses came from. */
enum bd_writer_id_source {
    BD_WRITER_ID_CONFIGURED, /* writer_id in the config, the same as kept (or none was kept) */
    BD_WRITER_ID_REPLACED,   /* writer_id in the config, another id was kept: warned, replaced */
    BD_WRITER_ID_KEPT,       /* no writer_id in the config: the one kept in writer-id */
    BD_WRITER_ID_ADOPTED,    /* none kept: the one writer.state names (an earlier version's) */
    BD_WRITER_ID_GENERATED,  /* none kept: generated now */
};

struct bd_writer_identity {
    char id[BD_WRITER_ID_MAX + 1];
    enum bd_writer_id_source source;
    char kept[BD_WRITER_ID_MAX + 1]; /* what writer-id held before, "" if nothing */
};

/*
 * The writer id this daemon writes as. configured is the config's writer_id ("" if it sets
 * none). Without one: the id kept in <dir>/writer-id; on the first start, the id writer.state
 * names (a run of an earlier version, which used the host name) or else a new one, "w-" and 16
 * hex digits from getrandom(2), kept there. With one: that id; when writer-id keeps another, a
 * warning, and the configured one replaces it. The file is written crash-safely (temporary
 * file, fsync, rename, fsync of the directory). Creates dir if missing, holds writer.lock while
 * it works (-EBUSY while another daemon runs on dir), and logs the id and where it came from.
 * A writer-id that does not hold a valid id is an error naming the file.
 */
int bd_writer_identity(const char *dir, const char *configured, struct bd_writer_identity *out,
                       struct bd_err *err);

/* Sequence numbers reserved on disk at a time: one fsync per this many bulk writes. */
#define BD_WRITER_BLOCK UINT64_C(4096)

struct bd_writer;

/* What writer.state held when the daemon started (all 0 when there was none). */
struct bd_writer_prev {
    bool found;        /* a readable state file existed */
    bool clean;        /* the previous run stopped cleanly */
    uint64_t reserved; /* sequences below this may have been used */
    int64_t max_bucket_start_ms;
    int64_t last_ack_ms;
    uint64_t lost_at_stop; /* readings the previous (clean) stop gave up (readings_lost) */
    char writer_id[128];   /* "" if none */
};

/*
 * What <dir>/writer.state holds now, read without taking writer.lock (the file is only ever
 * replaced whole, by a rename): for a reader before the flusher opens the writer, such as the
 * clock's floor (its last_ack_ms). -ENOENT without one, -EINVAL if it does not parse (*out is
 * then all 0).
 */
int bd_writer_peek(const char *dir, struct bd_writer_prev *out);

/*
 * Create spool.dir if missing, lock it, read the previous state and persist a first block.
 * Errors (another daemon holds the lock, directory not writable) are fatal to start-up and
 * name the path.
 */
int bd_writer_open(struct bd_writer **out, const char *dir, const char *writer_id,
                   struct bd_err *err);
const struct bd_writer_prev *bd_writer_previous(const struct bd_writer *w);

/*
 * The next sequence number (strictly increasing). Persists a new block first when the current
 * one is used up; -EIO etc. if that fails (the caller must not write without a number).
 */
int bd_writer_next(struct bd_writer *w, uint64_t *seq, struct bd_err *err);

/* A bucket holds sequence `seen` of this writer id: later numbers must be above it. */
int bd_writer_raise(struct bd_writer *w, uint64_t seen, struct bd_err *err);

/*
 * A bulk write was acknowledged at wall time now_ms, covering buckets up to max_start_ms.
 * Rewrites the state file when a newer bucket was written, else at most once per
 * BD_WRITER_ACK_SAVE_MS, synced like every rewrite: the file also holds the reservation, which
 * a rename of unsynced data could lose in a power cut. A failure is logged (rate-limited); the
 * old file stays.
 */
void bd_writer_acked(struct bd_writer *w, int64_t now_ms, int64_t max_start_ms);

/* Largest bucket start this writer id has written, across runs. */
int64_t bd_writer_max_bucket_start(const struct bd_writer *w);

/* What the stop lost (readings_lost), kept by the closing write for the next start to export
 * (bucketd_previous_stop_readings_lost). */
void bd_writer_set_lost_at_stop(struct bd_writer *w, uint64_t lost);

/* Record a clean (or not) stop, sync, unlock and free. NULL is a no-op. */
void bd_writer_close(struct bd_writer *w, bool clean);

#endif
