/*
 * The flusher's spool policy: which batches go to the on-disk spool and when, and replaying it.
 * Flusher thread only (src/flusher_spool.h). Calls the placing of unplaced records, the writer
 * side, the drain and the I/O runner below it; the replay of a record is replay.h's, settled by
 * the same engine (settle.h) as the flusher's own writes.
 *
 * Rules, each there for ordering (a page's updates must reach MongoDB in sequence order):
 *   - A batch goes to the spool only when it is the batch being written and not in flight: a
 *     failed batch once the next one is due too, every later batch while the spool holds
 *     anything, and at a stop's deadline. Appended as one record (several for a huge batch),
 *     all in order behind older ones, in one of two forms:
 *       placed    its updates built with its sequence number (replay.h), when it has its
 *                 number already or can take one without MongoDB: the sequence and every page
 *                 known, and no unplaced record ahead of it;
 *       unplaced  its readings as drained (unplaced.h), otherwise -- a bucket's pages or the
 *                 sequence unknown (a restart, an evicted sensor, a first start offline), or an
 *                 unplaced record ahead. Placed and numbered when replayed (flusher_place.c).
 *     So whatever bucketd knows of MongoDB, every batch that must leave memory can.
 *   - While the spool holds records, nothing is written to MongoDB directly: the spool is
 *     replayed oldest first, and the batches behind it wait in memory while the replay keeps up,
 *     or are appended to the spool when MongoDB is still away (the replay's last attempt
 *     failed) or memory runs short.
 * Nothing is written to disk while MongoDB takes every batch when it is due.
 */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/log.h"
#include "bucketd/unplaced.h"
#include "flusher_drain.h"
#include "flusher_int.h"
#include "flusher_io.h"
#include "flusher_place.h"
#include "flusher_spool.h"
#include "flusher_writer.h"

/* A record's payload is cut at this size: several records for one batch, in order. Smaller
 * for unplaced records, whose placed form (BSON) is larger and is held whole at replay. */
#define SPOOL_RECORD_TARGET (UINT64_C(16) << 20)
#define UNPLACED_RECORD_TARGET (UINT64_C(4) << 20)

/* Records replayed per step at most: a step also drains and must come back soon. */
#define REPLAY_PER_STEP 16

int flusher_spool_open(struct bd_flusher *f, struct bd_err *err) {
    f->spool.log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 2};
    uint64_t interval_ms = 0;
    int sync = bd_config_spool_sync(f->cfg->spool.sync, &interval_ms);
    if (sync < 0) {
        return bd_err_set(err, -EINVAL, "spool.sync: invalid value \"%s\"", f->cfg->spool.sync);
    }
    static const enum bd_spool_full full[] = {
        [BD_SPOOL_FULL_DROP_OLDEST] = BD_SPOOL_DROP_OLDEST,
        [BD_SPOOL_FULL_DROP_NEWEST] = BD_SPOOL_DROP_NEWEST,
        [BD_SPOOL_FULL_BLOCK] = BD_SPOOL_BLOCK,
    };
    struct bd_spool_opts o = {.dir = f->cfg->spool.dir,
                              .max_bytes = f->cfg->spool.max_bytes,
                              .sync = (enum bd_spool_sync)sync,
                              .sync_interval_ms = interval_ms,
                              .full = full[f->cfg->spool.when_full]};
    if (f->store == NULL) {
        return 0; /* the blackhole sink keeps nothing */
    }
    int rc = bd_spool_open(&f->spool.disk, &o, err);
    if (rc < 0) {
        return rc;
    }
    if (!bd_spool_empty(f->spool.disk)) {
        struct bd_spool_stats st;
        bd_spool_get_stats(f->spool.disk, &st);
        f->spool.oldest_ms = bd_now_ns() / BD_NS_PER_MS;
        bd_info("spool %s holds %" PRIu64 " bytes in %" PRIu64
                " segments from an earlier run: they are written to MongoDB first, oldest first",
                f->cfg->spool.dir, st.bytes, st.segments);
        /* Its records may be unplaced: what is spooled behind them must be too. */
        f->spool.unplaced_ahead = true;
    }
    struct bd_spool_record head;
    rc = bd_spool_peek(f->spool.disk, &head);
    rc = flusher_place_resume(f, rc == 0 ? &head : NULL, &f->spool.replay);
    if (rc < 0) {
        return bd_err_set(err, rc, "cannot read the placing journal in %s: %s", f->cfg->spool.dir,
                          strerror(-rc));
    }
    if (f->spool.replay != NULL) {
        f->spool.replay_id = head.id;
    }
    return 0;
}

void flusher_spool_close(struct bd_flusher *f) {
    flusher_place_close(f);
    bd_replay_free(f->spool.replay);
    f->spool.replay = NULL;
    bd_replay_buf_close(&f->spool.buf);
    bd_spool_close(f->spool.disk);
    f->spool.disk = NULL;
}

void flusher_spool_tick(struct bd_flusher *f, int64_t mono_ns) {
    if (f->spool.disk != NULL) {
        bd_spool_tick(f->spool.disk, mono_ns);
    }
}

void flusher_spool_set_max_bytes(struct bd_flusher *f, uint64_t max_bytes) {
    if (f->spool.disk != NULL) {
        bd_spool_set_max_bytes(f->spool.disk, max_bytes);
    }
}

bool flusher_spool_active(const struct bd_flusher *f) {
    return f->spool.disk != NULL && (f->spool.replay != NULL || !bd_spool_empty(f->spool.disk));
}

int64_t flusher_spool_oldest_ms(const struct bd_flusher *f) {
    return flusher_spool_active(f) ? f->spool.oldest_ms : 0;
}

void flusher_spool_stats(struct bd_flusher *f) {
    struct bd_spool_stats st;
    bd_spool_get_stats(f->spool.disk, &st);
    atomic_store_explicit(&f->stats->spool_corrupt_records, st.corrupt_records,
                          memory_order_relaxed);
    atomic_store_explicit(&f->stats->spool_dropped_readings, st.dropped_readings,
                          memory_order_relaxed);
    atomic_store_explicit(&f->stats->spool_write_errors, st.write_errors, memory_order_relaxed);
    BD_GAUGE_SET(f->stats, spool_bytes, st.bytes);
    BD_GAUGE_SET(f->stats, spool_segments, st.segments);
    BD_GAUGE_SET(f->stats, spool_readings, st.readings);
}

/*
 * Whether the batch about to be spooled goes placed (numbered now, without asking MongoDB): it
 * has its number already, or the sequence and every page are known and no unplaced record is
 * ahead of it (flusher_place.c, Ordering). Otherwise it goes unplaced.
 */
static bool placed_offline(struct bd_flusher *f) {
    if (f->writer.have_seq) {
        return true;
    }
    if (!f->writer.seq_known || f->spool.unplaced_ahead) {
        return false;
    }
    for (uint32_t i = 0; i < f->batch.n; i++) {
        if (!f->batch.meta[i].done && f->batch.deltas[i].n_readings > 0 &&
            f->batch.deltas[i].page == BD_PAGE_UNKNOWN) {
            return false;
        }
    }
    struct bd_err err = {0};
    if (flusher_writer_take_sequence(f, &err) < 0) {
        if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("cannot save the flush sequence before spooling: %s; the batch is spooled "
                     "unplaced",
                     err.msg);
        }
        return false;
    }
    return true;
}

/* Append the payload encoded so far as one record; the deltas in it, [from, to), are done. */
static bool append_record(struct bd_flusher *f, const uint32_t *dis, uint32_t n_dis, bool placed) {
    struct bd_replay_buf *buf = &f->spool.buf;
    if (buf->n_updates == 0) {
        return true;
    }
    struct bd_spool_stats before, after;
    bd_spool_get_stats(f->spool.disk, &before);
    int rc = bd_spool_append(f->spool.disk, placed ? f->writer.batch_seq : 0, buf->n_readings,
                             placed ? 0 : BD_SPOOL_UNPLACED, buf->data, buf->len);
    bd_spool_get_stats(f->spool.disk, &after);
    /* -ENOSPC is the policy refusing at spool.max_bytes, or the disk itself being full: only
     * the disk's failure counts as a write error. */
    bool disk = after.write_errors > before.write_errors;
    if (rc == -ENOSPC && !disk && f->cfg->spool.when_full == BD_SPOOL_FULL_DROP_NEWEST) {
        /* The policy drops the newest: this batch (counted by the spool as dropped). */
        if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("the spool in %s is full (spool.max_bytes): %u readings dropped "
                     "(spool.when_full: drop_newest)",
                     f->cfg->spool.dir, buf->n_readings);
        }
        rc = 0;
    } else if (rc == 0) {
        BD_STAT_ADD(f->stats, readings_spooled, buf->n_readings);
        if (!placed) {
            BD_STAT_ADD(f->stats, readings_spooled_unplaced, buf->n_readings);
            f->spool.unplaced_ahead = true;
            flusher_place_point(BD_PLACE_APPENDED);
        }
        if (f->spool.oldest_ms == 0 || !flusher_spool_active(f)) {
            /* The first record of a new backlog: its batch's oldest reading. */
            int64_t oldest = 0;
            for (uint32_t k = 0; k < n_dis; k++) {
                int64_t t = f->batch.meta[dis[k]].first_ms;
                oldest = t > 0 && (oldest == 0 || t < oldest) ? t : oldest;
            }
            f->spool.oldest_ms = oldest > 0 ? oldest : bd_now_ns() / BD_NS_PER_MS;
        }
    }
    if (rc < 0) {
        if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("cannot write %u readings to the spool in %s: %s; they stay in memory "
                     "(limits.memory) and are tried again",
                     buf->n_readings, f->cfg->spool.dir,
                     disk            ? strerror(-rc)
                     : rc == -ENOSPC ? "the spool is full (spool.max_bytes, spool.when_full: block)"
                                     : strerror(-rc));
        }
        bd_replay_buf_reset(buf);
        return false;
    }
    for (uint32_t k = 0; k < n_dis; k++) {
        f->batch.meta[dis[k]].done = true;
    }
    bd_replay_buf_reset(buf);
    return true;
}

bool flusher_spool_batch(struct bd_flusher *f, int64_t wall_ms) {
    if (f->spool.disk == NULL || bd_batch_pending_readings(&f->batch) == 0) {
        return f->spool.disk != NULL;
    }
    const bool placed = placed_offline(f);
    const uint64_t target = placed ? SPOOL_RECORD_TARGET : UNPLACED_RECORD_TARGET;
    bool ok = true;
    uint32_t *dis = bd_malloc((size_t)(f->batch.n ? f->batch.n : 1) * sizeof(*dis));
    uint32_t n_dis = 0;
    if (dis == NULL) {
        return false;
    }
    /* Deltas split while building are appended to the batch: the loop reaches them too. */
    for (uint32_t di = 0; ok && di < f->batch.n; di++) {
        int rc;
        if (placed) {
            rc = flusher_writer_build_into(f, di, &f->spool.buf, wall_ms);
        } else if (f->batch.meta[di].done || f->batch.deltas[di].n_readings == 0) {
            f->batch.meta[di].done = true;
            rc = 1;
        } else {
            rc = bd_unplaced_add(&f->spool.buf, &f->batch.deltas[di]);
        }
        if (rc < 0) {
            ok = false;
            break;
        }
        if (rc == 1) {
            continue; /* nothing of it to spool (done, split, quarantined) */
        }
        if (n_dis == 0 || dis[n_dis - 1] != di) {
            uint32_t *grown = dis;
            if (n_dis >= f->batch.n) {
                grown = bd_realloc(dis, (size_t)(n_dis + 1) * 2 * sizeof(*dis));
            }
            if (grown == NULL) {
                ok = false;
                break;
            }
            dis = grown;
            dis[n_dis++] = di;
        }
        if (f->spool.buf.len >= target) {
            ok = append_record(f, dis, n_dis, placed);
            n_dis = 0;
        }
    }
    if (ok) {
        ok = append_record(f, dis, n_dis, placed);
    } else {
        bd_replay_buf_reset(&f->spool.buf);
    }
    free(dis);
    if (ok && bd_batch_pending_readings(&f->batch) == 0) {
        /* Everything is on disk: the batch is settled as far as memory goes. The retry
         * schedule stays: the replay of the spool keeps to it. */
        f->writer.have_seq = false;
        flusher_writer_batch_done(f);
        return true;
    }
    return false;
}

/* Replay records from the spool's head until one fails or enough were done for one step. */
static void replay(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms) {
    struct bd_replay_env env = {.settle = &f->settle, .run_first_seq = f->writer.run_first_seq};
    bson_error_t perr;
    if (!flusher_io_prepare(f, &perr)) {
        flusher_writer_note_failure(f, BD_CAUSE_UNREACHABLE, perr.message);
        flusher_writer_schedule_retry(f, mono_ns);
        return;
    }
    for (int done = 0; done < REPLAY_PER_STEP; done++) {
        if (f->spool.replay == NULL) {
            struct bd_spool_record rec;
            int rc = bd_spool_peek(f->spool.disk, &rec);
            if (rc == -ENOENT) {
                break;
            }
            if (rc < 0) {
                if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
                    bd_error("cannot read the spool in %s: %s; trying again", f->cfg->spool.dir,
                             strerror(-rc));
                }
                flusher_writer_schedule_retry(f, mono_ns);
                return;
            }
            struct bd_err err = {0};
            if ((rec.flags & BD_SPOOL_UNPLACED) != 0) {
                enum flusher_place_result pr =
                    flusher_place_record(f, &rec, wall_ms, &f->spool.replay);
                if (pr == FLUSHER_PLACE_WAIT) {
                    flusher_writer_schedule_retry(f, mono_ns);
                    return;
                }
                rc = pr == FLUSHER_PLACE_BAD ? -EBADMSG : 0;
                if (rc == 0 && f->spool.replay == NULL) {
                    /* Nothing of it left to write (quarantined while building). */
                    bd_spool_ack(f->spool.disk, rec.id);
                    flusher_place_retire(f);
                    continue;
                }
            } else {
                rc = bd_replay_load(&f->spool.replay, &rec, &err);
                if (rc < 0) {
                    bd_error("%s: skipped", err.msg);
                }
            }
            if (rc < 0) {
                /* Its checksum held, so this is not a torn write: a bug or a foreign file. */
                BD_STAT_ADD(f->stats, spool_corrupt_records, 1);
                bd_spool_ack(f->spool.disk, rec.id);
                continue;
            }
            f->spool.replay_id = rec.id;
        }
        enum bd_bulk_cause cause;
        char msg[512];
        if (!bd_replay_attempt(f->spool.replay, &env, wall_ms, &cause, msg, sizeof(msg))) {
            flusher_writer_note_failure(f, cause, msg);
            flusher_writer_schedule_retry(f, mono_ns);
            return;
        }
        if (f->place.journaled) {
            flusher_place_point(BD_PLACE_SENT);
        }
        int rc = bd_spool_ack(f->spool.disk, f->spool.replay_id);
        if (f->place.journaled) {
            flusher_place_point(BD_PLACE_ACKED);
        }
        if (rc < 0 && bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("cannot record a replayed batch as done in %s: %s (it may be sent again "
                     "after a restart; MongoDB applies it once)",
                     f->cfg->spool.dir, strerror(-rc));
        }
        bd_replay_free(f->spool.replay);
        f->spool.replay = NULL;
        BD_STAT_ADD(f->stats, spool_records_replayed, 1);
        flusher_place_retire(f); /* when it was an unplaced record */
    }
    if (!flusher_spool_active(f)) {
        f->spool.oldest_ms = 0;
        f->spool.unplaced_ahead = false;
    }
    flusher_writer_recovered(f, " (replaying the spool)");
}

void flusher_spool_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    /* The batch being written follows the spool onto it (when its pages are known). */
    if (bd_batch_pending_readings(&f->batch) > 0) {
        flusher_spool_batch(f, wall_ms);
    }
    if (mono_ns >= f->writer.retry_at) {
        replay(f, mono_ns, wall_ms);
    }
    if (!flusher_spool_active(f) || bd_batch_pending_readings(&f->batch) > 0) {
        return; /* the next step writes as usual, or the batch still waits */
    }
    /* The next batch: onto the spool while MongoDB is away or memory runs short; else it
     * waits in memory for the replay to finish. */
    bool away = f->writer.retry_at != 0;
    if (flusher_drain_fill_due(f, mono_ns, stopping) &&
        (away || flusher_over_budget(f) || stopping)) {
        flusher_writer_swap_in_fill(f);
        BD_STAT_ADD(f->stats, flushes, 1);
        flusher_spool_batch(f, wall_ms);
        f->send_at = mono_ns + (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    }
}

/* A stop gives up the record being replayed. Still on disk, it is replayed at the next start;
 * but drop_oldest may have deleted its segment (spool.h): what it holds not written is lost. */
static void give_up_replay(struct bd_flusher *f) {
    if (f->spool.replay == NULL || bd_spool_holds(f->spool.disk, f->spool.replay_id)) {
        return;
    }
    uint64_t lost = bd_replay_pending_readings(f->spool.replay);
    BD_STAT_ADD(f->stats, readings_lost, lost);
    bd_error("%" PRIu64 " readings of a spooled batch were lost: the full spool in %s dropped "
             "them from disk (spool.when_full: drop_oldest) while they were being replayed, and "
             "MongoDB did not take them before the stop deadline",
             lost, f->cfg->spool.dir);
    bd_replay_free(f->spool.replay);
    f->spool.replay = NULL;
}

void flusher_spool_everything(struct bd_flusher *f, int64_t wall_ms) {
    if (f->spool.disk == NULL) {
        return;
    }
    give_up_replay(f);
    uint64_t before = BD_STAT_GET(f->stats, readings_spooled);
    uint64_t before_unplaced = BD_STAT_GET(f->stats, readings_spooled_unplaced);
    /* Whatever is still queued joins the next batch, memory budget or not: this is the end. */
    f->budget = UINT64_MAX;
    (void)flusher_drain_run(f, wall_ms, false);
    if (bd_batch_pending_readings(&f->batch) > 0 && !flusher_spool_batch(f, wall_ms)) {
        return; /* the older batch could not go: the next must not overtake it */
    }
    if (bd_batch_pending_readings(&f->fill) > 0) {
        flusher_writer_swap_in_fill(f);
        flusher_spool_batch(f, wall_ms);
    }
    bd_spool_flush(f->spool.disk);
    flusher_spool_stats(f);
    uint64_t spooled = BD_STAT_GET(f->stats, readings_spooled) - before;
    uint64_t unplaced = BD_STAT_GET(f->stats, readings_spooled_unplaced) - before_unplaced;
    if (spooled > 0) {
        bd_warn("%" PRIu64 " readings MongoDB did not take were written to the spool in %s "
                "(%" PRIu64 " of them unplaced: their pages or sequence number are learnt from "
                "MongoDB first): the next start writes them first",
                spooled, f->cfg->spool.dir, unplaced);
    }
}
