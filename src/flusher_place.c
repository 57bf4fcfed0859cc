/*
 * Placing unplaced spool records (src/flusher_place.h). Flusher thread only. Called by the
 * spool policy (flusher_spool.c); calls the writer side (placement, sequence, building) and,
 * through it, the I/O runner.
 *
 * An unplaced record (unplaced.h) is a batch spooled as it was drained: no sequence number, and
 * pages only where they were known. Its life, and what a crash at each point leaves:
 *
 *   1. appended      the batch could not be placed (a bucket's pages or the writer sequence
 *                    unknown, or an unplaced record already ahead of it) when it had to go to
 *                    the spool: MongoDB away, memory short, a stop. A crash before the append
 *                    returned loses the batch; with spool.sync=interval or none, one after it
 *                    but before the next sync may too (README "Delivery guarantees").
 *   2. synced        durable: every later start finds it, in order.
 *   3. placed        at the head of the spool once every record before it is written. Loaded
 *                    into a batch of its own, over detached sensors; the sequence learnt from the
 *                    collection when unknown (first start offline), its unknown buckets' pages
 *                    looked up (the collection holds everything this writer sent before it),
 *                    then built. A crash here: the record is placed again at the next start.
 *   4. numbered      its number taken from the writer state (saved first, so never reused).
 *                    A crash here wastes the number, nothing else: nothing was sent.
 *   5. journaled     the placed form saved whole in the placing journal (placing.h), durable,
 *                    naming the record's position, before anything of it is sent. From here the
 *                    record is never placed again: a start that finds the journal naming the
 *                    head record replays the journal instead (step 6 with the same number).
 *   6. sent          the placed updates written and settled by the settle engine, as any
 *                    spooled batch (replay.h): a crash before they are all acknowledged replays
 *                    them again with the same number, and the filter applies each once.
 *   7. acknowledged  the record acknowledged in the spool. With spool.sync=batch that is
 *                    durable at once; otherwise the spool's checkpoint is synced first (retire).
 *                    A crash before that brings the record back at the head: the journal still
 *                    names it, so its placed form is replayed once more (all already applied).
 *   8. retired       the acknowledgement durable, the journal removed. A journal found naming
 *                    any other record than the head is stale and removed.
 *
 * Hence no reading is ever written under two sequence numbers: a number is given to a record's
 * readings once, at step 4, and from step 5 on every attempt uses it; before step 5 nothing was
 * sent. The journal holds one record at a time, which is why its record's acknowledgement is
 * made durable (step 7) before the next record's journal replaces it.
 *
 * Ordering: the placed form takes a number when it is placed, later than the numbers of records
 * spooled before it was. So once an unplaced record is in the spool, every later batch is
 * spooled unplaced too (flusher_spool.c), and so is every batch spooled while a spool left by an
 * earlier run is not empty: a page never receives a smaller number after a larger one.
 */
#include "flusher_place.h"

#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "bucketd/log.h"
#include "bucketd/placing.h"
#include "bucketd/unplaced.h"
#include "flusher_int.h"
#include "flusher_writer.h"

static void (*point_fn)(int point, void *arg);
static void *point_arg;

void bd_flusher_place_hook(void (*fn)(int point, void *arg), void *arg) {
    point_fn = fn;
    point_arg = arg;
}

void flusher_place_point(int point) {
    if (point_fn != NULL) {
        point_fn(point, point_arg);
    }
}

/* Build every pending delta of the batch being written into the placed form. */
static bool build(struct bd_flusher *f, int64_t wall_ms) {
    /* Deltas split while building are appended to the batch: the loop reaches them too. */
    for (uint32_t di = 0; di < f->batch.n; di++) {
        int rc = flusher_writer_build_into(f, di, &f->place.buf, wall_ms);
        if (rc < 0) {
            flusher_log_oom(f, "while building a placed spool record");
            return false;
        }
    }
    return true;
}

/* The previous record's acknowledgement must be durable before its journal is replaced. */
static bool retired(struct bd_flusher *f) {
    if (f->place.journaled) {
        flusher_place_retire(f);
    }
    return !f->place.journaled;
}

enum flusher_place_result flusher_place_record(struct bd_flusher *f,
                                               const struct bd_spool_record *rec, int64_t wall_ms,
                                               struct bd_replay **out) {
    *out = NULL;
    if (f->writer.have_seq || !retired(f)) {
        /* A numbered batch goes first (it cannot wait behind the spool: the spool was empty
         * when it was numbered), or the last journal cannot go yet. */
        return FLUSHER_PLACE_WAIT;
    }
    struct bd_err err = {0};
    struct bd_unplaced *u = NULL;
    int rc = bd_unplaced_load(&u, rec->data, rec->len, &f->lim, &err);
    if (rc == 0) {
        flusher_place_point(BD_PLACE_LOADED);
    }
    if (rc == -EBADMSG) {
        bd_error("%s: skipped (%" PRIu32 " readings)", err.msg, rec->n_readings);
        return FLUSHER_PLACE_BAD;
    }
    if (rc < 0) {
        flusher_log_oom(f, "while loading an unplaced spool record");
        return FLUSHER_PLACE_WAIT;
    }
    /* For its placing the record is the batch being written: the writer side places, numbers
     * and builds it as it does every batch. The batch it stands in for has no number (above)
     * and is put back as it was. */
    struct bd_batch live = f->batch;
    f->batch = *bd_unplaced_batch(u);
    bool ok = flusher_writer_prepare(f) && build(f, wall_ms);
    const uint64_t seq = f->writer.batch_seq;
    *bd_unplaced_batch(u) = f->batch;
    f->batch = live;
    f->writer.have_seq = false;
    bd_unplaced_free(u);
    struct bd_replay_buf *buf = &f->place.buf;
    if (!ok) {
        bd_replay_buf_reset(buf);
        return FLUSHER_PLACE_WAIT;
    }
    if (buf->n_updates == 0) {
        return FLUSHER_PLACE_OK; /* every update was quarantined while building */
    }
    flusher_place_point(BD_PLACE_NUMBERED);
    struct bd_placing pl = {.segment = rec->segment,
                            .offset = rec->offset,
                            .seq = seq,
                            .n_readings = buf->n_readings,
                            .data = buf->data,
                            .len = buf->len};
    rc = bd_placing_save(f->cfg->spool.dir, &pl, &err);
    if (rc == 0) {
        f->place.journaled = true;
        flusher_place_point(BD_PLACE_JOURNALED);
        struct bd_spool_record placed = {.id = rec->id,
                                         .seq = seq,
                                         .n_readings = buf->n_readings,
                                         .data = buf->data,
                                         .len = buf->len};
        rc = bd_replay_load(out, &placed, &err);
    }
    bd_replay_buf_reset(buf);
    if (rc < 0) {
        if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("cannot place a spooled batch of %" PRIu32 " readings: %s; trying again",
                     rec->n_readings, err.msg);
        }
        return FLUSHER_PLACE_WAIT;
    }
    BD_STAT_ADD(f->stats, spool_records_placed, 1);
    return FLUSHER_PLACE_OK;
}

int flusher_place_resume(struct bd_flusher *f, const struct bd_spool_record *head,
                         struct bd_replay **out) {
    *out = NULL;
    struct bd_err err = {0};
    struct bd_placing pl;
    int rc = bd_placing_load(f->cfg->spool.dir, &pl, &err);
    if (rc == -ENOENT || rc == -EBADMSG) {
        if (rc == -EBADMSG) {
            /* Not durable whole, so nothing of it was sent: its record is placed again. */
            bd_warn("%s: ignored", err.msg);
        }
        (void)bd_placing_remove(f->cfg->spool.dir);
        return 0;
    }
    if (rc < 0) {
        bd_error("%s", err.msg);
        return rc;
    }
    if (head != NULL && (head->flags & BD_SPOOL_UNPLACED) != 0 && head->segment == pl.segment &&
        head->offset == pl.offset) {
        struct bd_spool_record placed = {.id = head->id,
                                         .seq = pl.seq,
                                         .n_readings = pl.n_readings,
                                         .data = pl.data,
                                         .len = pl.len};
        rc = bd_replay_load(out, &placed, &err);
        if (rc < 0) {
            bd_error("%s", err.msg);
        } else {
            f->place.journaled = true;
            bd_info("the spooled batch at the head of %s was placed before the last stop "
                    "(%" PRIu32 " readings, flush sequence %" PRIu64
                    "): it is written as it was placed",
                    f->cfg->spool.dir, pl.n_readings, pl.seq);
        }
    } else {
        rc = bd_placing_remove(f->cfg->spool.dir); /* its record was acknowledged */
    }
    bd_placing_clear(&pl);
    return rc;
}

void flusher_place_retire(struct bd_flusher *f) {
    if (!f->place.journaled) {
        return;
    }
    int rc = bd_spool_flush(f->spool.disk);
    if (rc == 0) {
        rc = bd_placing_remove(f->cfg->spool.dir);
    }
    if (rc < 0) {
        if (bd_ratelimit_ok(&f->spool.log, bd_mono_ns())) {
            bd_error("cannot retire the placing journal in %s: %s; trying again", f->cfg->spool.dir,
                     strerror(-rc));
        }
        return;
    }
    f->place.journaled = false;
    flusher_place_point(BD_PLACE_RETIRED);
}

void flusher_place_close(struct bd_flusher *f) {
    bd_replay_buf_close(&f->place.buf);
}
