/*
 * The flusher and the on-disk spool (src/flusher_spool.c, src/flusher_place.c), driven through
 * bd_flusher_step against the scripted store (fake_store.h) with restarts over the same spool
 * directory: what an outage spools and how it is replayed, placed and unplaced records, a
 * crash at every point of an unplaced record's life, full and failing spools. Expected values
 * come from what each test sent.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/flusher.h"
#include "bucketd/placing.h"
#include "bucketd/spool.h"
#include "flusher_harness.h"

TestSuite(flusher_spool, .init = setup, .fini = teardown);

Test(flusher_spool, nothing_is_written_to_the_spool_while_mongodb_keeps_up) {
    uint64_t at_start = spool_file_bytes();
    for (int round = 0; round < 5; round++) {
        send_more(4, 10, round * 10);
        cr_assert_gt(run(10), 0);
    }
    assert_stored(4, 50);
    cr_assert_eq(STAT(readings_spooled), 0);
    cr_assert_eq(spool_file_bytes(), at_start, "the spool files did not grow");
}

Test(flusher_spool, an_outage_spools_the_failed_batch_and_the_next_then_replays_them_in_order) {
    stop();
    spool_timing();
    start();
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_sensors(3, 4);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* written, failed */
    cr_assert_eq(fs.bulks, 1);
    int64_t retry = bd_flusher_retry_at(flusher);
    /* The next batch comes due while the failed one waits: both go to the spool. */
    send_more(3, 5, 4);
    publish();
    mono += 20 * MS;
    cr_assert_lt(mono, retry);
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled), 27, "both batches on disk");
    cr_assert_eq(fs.bulks, 1, "nothing sent before the retry");
    cr_assert_gt(spool_file_bytes(), 32);
    cr_assert_eq(STAT(spool_bytes), spool_file_bytes(), "the gauge is the files' size");
    cr_assert_eq(STAT(pending_readings), 0, "nothing left in memory");
    /* Still away: a third batch joins them on the spool, behind. */
    send_more(3, 1, 9);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled), 30);
    /* Back: replayed oldest first, each record under its own number, increasing. */
    cr_assert_gt(run(20), 0);
    assert_stored(3, 10);
    cr_assert_eq(STAT(readings_flushed), 30);
    cr_assert_eq(STAT(spool_records_replayed), 3);
    cr_assert_eq(fs.bulks, 4);
    cr_assert_eq(fs.seqs[1], fs.seqs[0], "the failed batch replayed with its own number");
    cr_assert_lt(fs.seqs[1], fs.seqs[2]);
    cr_assert_lt(fs.seqs[2], fs.seqs[3]);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert(bd_flusher_idle(flusher));
    cr_assert_eq(STAT(oldest_pending_age_ms), 0, "nothing waits");
}

Test(flusher_spool, a_stop_while_mongodb_is_away_spools_and_the_next_start_writes_it_once) {
    for (int i = 0; i < 10; i++) {
        fake_script(&fs, FAULT_LOST_REPLY, 0); /* applied, answer lost: may be in already */
    }
    send_sensors(2, 3);
    cr_assert_eq(run(3), -1);
    send_more(2, 2, 3); /* still in the queues at the deadline */
    publish();
    cr_assert_eq(bd_flusher_abandon(flusher), 0, "nothing lost: spooled");
    cr_assert_eq(STAT(readings_lost), 0);
    cr_assert_eq(STAT(readings_spooled), 10);
    restart();
    send_more(2, 1, 5); /* new readings after the restart: behind the spool */
    cr_assert_gt(run(20), 0);
    assert_stored(2, 6);
    cr_assert_eq(STAT(spool_records_replayed), 2);
    cr_assert_geq(STAT(updates_already_applied), 2, "the lost replies' updates were in");
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    for (uint32_t i = 1; i < fs.bulks && i < 256; i++) {
        cr_assert_geq(fs.seqs[i], fs.seqs[i - 1], "bulk %u out of sequence order", i);
    }
}

Test(flusher_spool, a_spool_that_cannot_take_a_batch_keeps_it_in_memory_and_loses_nothing) {
    stop();
    spool_timing();
    cfg.spool.max_bytes = 64; /* nothing fits */
    cfg.spool.when_full = BD_SPOOL_FULL_BLOCK;
    start();
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_sensors(2, 3);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false); /* due: the spool refuses it */
    cr_assert_eq(STAT(readings_spooled), 0);
    cr_assert_gt(run(10), 0); /* MongoDB back: written from memory */
    assert_stored(2, 3);
    cr_assert_eq(STAT(readings_lost), 0);
}

/* One sensor's five readings written once with the given fault, then a sixth reading due
 * while that batch waits for its retry: both batches go to the spool. */
static void spool_two_batches_after(enum fake_fault fault) {
    fake_script(&fs, fault, 0);
    send_sensors(1, 5);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    send_more(1, 1, 5);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false);
}

/*
 * Defect 2 through the spool: batches that never reached MongoDB (no server) are spooled; when
 * they are replayed, their pages hold a number of this writer_id at or above theirs, written by
 * another daemon with the same writer_id. That is a conflict (counted, quarantined), not "applied
 * before": this run spooled them and knows nothing of them was sent.
 */
Test(flusher_spool, a_writer_id_clash_met_replaying_batches_never_sent_is_a_conflict) {
    stop();
    spool_timing();
    start();
    spool_two_batches_after(FAULT_UNREACHABLE); /* nothing sent */
    cr_assert_eq(STAT(readings_spooled), 6);
    fs.races = 1;
    fs.race_wseq = UINT64_C(1) << 40;
    cr_assert_gt(run(20), 0);
    cr_assert_geq(STAT(writer_conflicts), 1);
    cr_assert_eq(STAT(updates_already_applied), 0, "not taken for our own earlier write");
    cr_assert_eq(STAT(readings_flushed), 0);
    cr_assert_eq(STAT(readings_quarantined), 6);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 0);
    cr_assert_geq(dead_letters(), 1);
}

/* The same after an attempt that may have reached MongoDB (its reply lost): the page holds the
 * batch's own write, which counts as applied once. */
Test(flusher_spool, a_batch_spooled_after_a_lost_reply_is_applied_once_when_replayed) {
    stop();
    spool_timing();
    start();
    spool_two_batches_after(FAULT_LOST_REPLY); /* applied, the reply lost */
    cr_assert_eq(STAT(readings_spooled), 6);
    cr_assert_gt(run(20), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 6);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_already_applied), 1);
    cr_assert_eq(STAT(readings_flushed), 6);
    cr_assert_eq(STAT(updates_quarantined), 0);
}

/* While MongoDB is away, two batches of the same shape come due one after the other: the
 * first fails and both are then offered to the spool (cap as given, policy drop_newest). */
static void two_batches_while_away(uint64_t spool_max_bytes) {
    stop();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s/*", dir);
    cr_assert_eq(system(cmd), 0);
    spool_timing();
    cfg.spool.max_bytes = spool_max_bytes;
    cfg.spool.when_full = BD_SPOOL_FULL_DROP_NEWEST;
    start();
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_more(2, 3, 0);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* written, failed */
    send_more(2, 3, 3);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false); /* the next is due: both to the spool */
}

/* spool.when_full: drop_newest with a spool that holds one batch: the second is dropped,
 * counted in spool_dropped_readings (not lost at a stop, never written), the first replayed. */
Test(flusher_spool, a_full_spool_with_drop_newest_drops_the_newest_batch_and_counts_it) {
    /* The size of one batch's record on disk, from a spool with room for both. */
    two_batches_while_away(UINT64_C(1) << 30);
    cr_assert_eq(STAT(readings_spooled), 12);
    uint64_t both = STAT(spool_bytes);
    cr_assert_gt(both, 0);
    /* Room for one and a half: the first goes in, the second is dropped. */
    two_batches_while_away(both * 3 / 4);
    cr_assert_eq(STAT(readings_spooled), 6);
    cr_assert_eq(STAT(spool_dropped_readings), 6);
    cr_assert_eq(STAT(pending_readings), 0, "nothing kept in memory either");
    /* MongoDB back: the spooled batch is written, then later readings; the dropped one never. */
    cr_assert_gt(run(10), 0);
    char name[32];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), 3);
    }
    send_more(2, 2, 10);
    cr_assert_gt(run(10), 0);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), 3 + 2);
    }
    cr_assert_eq(STAT(readings_flushed), 10);
    cr_assert_eq(bd_flusher_abandon(flusher), 0);
    cr_assert_eq(STAT(readings_lost), 0, "dropped by the policy, counted there");
}

/*
 * spool.when_full: drop_oldest while a record is being replayed: MongoDB away, batches A and B
 * spooled, A's replay fails, batch C comes due and the full spool drops its oldest (only)
 * segment, A and B in it. A is still in the replay's hands and is written from memory when
 * MongoDB is back: not counted as dropped. B is dropped and counted, C written. Every reading
 * accepted is stored or counted dropped, none both. Returns the readings of one batch.
 */
static int replaying_record_in_a_dropped_segment(void) {
    /* The bytes of the spool holding two batches, from a spool with room for more. */
    two_batches_while_away(UINT64_C(1) << 30);
    uint64_t two = STAT(spool_bytes);
    cr_assert_eq(STAT(readings_spooled), 12);
    stop();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s/*", dir);
    cr_assert_eq(system(cmd), 0);
    cfg.spool.max_bytes = two + (two - BD_SPOOL_SEGMENT_HEADER_BYTES) / 4; /* not three */
    cfg.spool.when_full = BD_SPOOL_FULL_DROP_OLDEST;
    start();
    fake_script(&fs, FAULT_UNREACHABLE, 0); /* A */
    fake_script(&fs, FAULT_UNREACHABLE, 0); /* A's first replay */
    send_more(2, 3, 0);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* A written, failed */
    send_more(2, 3, 3);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false); /* B due: both to the spool */
    cr_assert_eq(STAT(readings_spooled), 12);
    cr_assert_eq(STAT(spool_dropped_readings), 0);
    send_more(2, 3, 6);
    publish();
    mono = bd_flusher_retry_at(flusher);
    bd_flusher_step(flusher, mono, now_ms, false); /* A's replay fails; C due: spooled */
    cr_assert_eq(fs.bulks, 2, "A, then its replay");
    cr_assert_eq(STAT(readings_spooled), 18);
    cr_assert_gt(STAT(spool_dropped_readings), 0, "the segment holding A and B was dropped");
    return 6;
}

Test(flusher_spool, a_full_spool_dropping_the_record_being_replayed_counts_it_once) {
    int batch = replaying_record_in_a_dropped_segment();
    cr_assert_gt(run(20), 0);
    char name[32];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), 3 + 3, "A and C");
    }
    cr_assert_eq(STAT(readings_flushed), 2 * batch);
    cr_assert_eq(STAT(spool_dropped_readings), batch, "B alone: A was written");
    cr_assert_eq(STAT(readings_flushed) + STAT(spool_dropped_readings), 3 * batch,
                 "every reading accepted stored or counted dropped, none both");
    cr_assert_eq(STAT(readings_lost), 0);
}

/* The same, but the stop's deadline passes with MongoDB still away: what the replay held of A
 * is on no disk any more, so it is counted lost (not silently gone); C stays spooled. */
Test(flusher_spool,
     a_stop_gives_up_a_record_being_replayed_that_a_full_spool_dropped_and_counts_it) {
    int batch = replaying_record_in_a_dropped_segment();
    bd_flusher_abandon(flusher);
    cr_assert_eq(STAT(readings_flushed), 0);
    cr_assert_eq(STAT(spool_dropped_readings), batch, "B");
    cr_assert_eq(STAT(readings_lost), batch, "A");
    /* The next start replays C alone. */
    restart();
    cr_assert_gt(run(20), 0);
    char name[32];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), 3, "C");
    }
}

/* A batch over the spool's record size (16 MiB of updates) goes to disk as several records,
 * each replayed and acknowledged on its own; every reading stored once. */
Test(flusher_spool, a_batch_larger_than_a_spool_record_is_spooled_in_several) {
    stop();
    spool_timing();
    start();
    const char **fields = long_names(64, 16384); /* ~2 MiB per update */
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    char id[32];
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    for (int i = 0; i < 12; i++) {
        snprintf(id, sizeof(id), "wide%d", i);
        accept_fields(id, fields, 64, i, b + i);
    }
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* written, failed */
    mono += 20 * MS;
    accept_fields("wide0", fields, 64, 99, b + 99);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* both batches to the spool */
    cr_assert_eq(STAT(readings_spooled), 13);
    cr_assert_eq(STAT(spool_segments) > 0, true);
    cr_assert_gt(run(20), 0);
    for (int i = 0; i < 12; i++) {
        snprintf(id, sizeof(id), "wide%d", i);
        cr_assert_eq(fake_stored(&fs, id), i == 0 ? 2 : 1, "%s", id);
    }
    cr_assert_geq(STAT(spool_records_replayed), 3, "the first batch in two records at least");
    cr_assert_eq(STAT(readings_flushed), 13);
    cr_assert_eq(STAT(updates_quarantined), 0);
    free_names(fields, 64);
}

/*
 * Backpressure: the two batches take at most half of limits.memory. A fill batch that reaches
 * a quarter of that before flush.interval is written early (flushes_for_memory). While MongoDB is
 * away and the spool takes nothing, draining stops at the budget: the table is marked stalled
 * (input pauses on the pool) and the readings wait in their queues. Once MongoDB is back every
 * accepted reading is stored once and the stall ends.
 */

/* ---- unplaced records: a first start offline, and a crash at every point of their life ---- */

/* A first start (nothing in spool.dir: no writer state) with spool_timing(). */
static void first_start(void) {
    stop();
    spool_timing();
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf %s/* %s/.[!.]*", dir, dir);
    cr_assert_eq(system(cmd), 0);
    start();
}

/* MongoDB away since the first start: the sequence cannot be learnt, so the failed batch and
 * the next go to the spool unplaced (3 sensors, 4 then 5 readings each). */
static void spool_unplaced_offline(void) {
    fs.find_fails = true;
    for (int i = 0; i < 8; i++) {
        fake_script(&fs, FAULT_UNREACHABLE, 0);
    }
    send_sensors(3, 4);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* the sequence look-up fails */
    send_more(3, 5, 4);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false);
}

/* MongoDB back. */
static void back_online(void) {
    fs.find_fails = false;
    fs.next_fault = fs.n_faults = 0;
}

Test(flusher_spool, a_first_start_offline_spools_unplaced_and_writes_once_when_mongodb_answers) {
    first_start();
    spool_unplaced_offline();
    cr_assert_eq(STAT(readings_spooled), 27, "spooled %" PRIu64 ", pending %" PRIu64 ", bulks %u",
                 STAT(readings_spooled), STAT(pending_readings), fs.bulks);
    cr_assert_eq(STAT(readings_spooled_unplaced), 27,
                 "no sequence: nothing could be placed (%" PRIu64 ")",
                 STAT(readings_spooled_unplaced));
    cr_assert_eq(STAT(pending_readings), 0, "nothing left in memory");
    cr_assert_eq(fs.bulks, 0, "nothing sent without a sequence");
    back_online();
    cr_assert_gt(run(50), 0);
    assert_stored(3, 9);
    cr_assert_eq(STAT(spool_records_placed), 2);
    cr_assert_eq(STAT(spool_records_replayed), 2);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_lt(fs.seqs[0], fs.seqs[fs.bulks - 1], "each record placed under its own number");
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_PLACING_FILE);
    cr_assert_neq(access(path, F_OK), 0, "the placing journal is retired");
}

Test(flusher_spool, batches_behind_an_unplaced_record_are_spooled_unplaced_too) {
    first_start();
    spool_unplaced_offline();
    /* The sequence is known now (MongoDB answered a look-up) but the spool holds unplaced
     * records: a batch spooled behind them must not take a number before they do. */
    fs.find_fails = false;
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_more(3, 2, 9);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled_unplaced), STAT(readings_spooled));
    back_online();
    cr_assert_gt(run(50), 0);
    assert_stored(3, 11);
    for (uint32_t i = 1; i < fs.bulks; i++) {
        cr_assert_geq(fs.seqs[i], fs.seqs[i - 1], "bulk %u out of sequence order", i);
    }
    cr_assert_eq(STAT(writer_conflicts), 0);
}

static int crash_point = -1;
static bool crashed;
static char snap[80];
static uint64_t journal_seq;

/* The crash: the spool directory as it is at this point is what the next start finds (a
 * killed process's writes are in the page cache); nothing more reaches the collection. */
static void crash_hook(int point, void *arg) {
    (void)arg;
    if (crashed || point != crash_point) {
        return;
    }
    crashed = true;
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && cp -a %s %s", snap, dir, snap);
    cr_assert_eq(system(cmd), 0);
    struct bd_placing pl;
    struct bd_err err = {0};
    journal_seq = bd_placing_load(snap, &pl, &err) == 0 ? pl.seq : 0;
    bd_placing_clear(&pl);
    fs.find_fails = true;
    fs.next_fault = fs.n_faults = 0;
    for (int i = 0; i < 60; i++) {
        fake_script(&fs, FAULT_UNREACHABLE, 0);
    }
}

static void crash_and_restart(int point, const char *sync, bool lost_reply) {
    snprintf(cfg.spool.sync, sizeof(cfg.spool.sync), "%s", sync);
    first_start();
    snprintf(snap, sizeof(snap), "%s.snap", dir);
    crash_point = point;
    crashed = false;
    journal_seq = 0;
    bd_flusher_place_hook(crash_hook, NULL);
    spool_unplaced_offline();
    if (!crashed) {
        back_online();
        if (lost_reply) {
            fake_script(&fs, FAULT_LOST_REPLY, 0); /* the first placed bulk: applied, no reply */
        }
        publish();
        for (int i = 0; i < 100 && !crashed; i++) {
            bd_flusher_step(flusher, mono, now_ms, false);
            int64_t retry = bd_flusher_retry_at(flusher);
            mono = retry > mono ? retry : mono + 1;
        }
    }
    bd_flusher_place_hook(NULL, NULL);
    cr_assert(crashed, "point %d (sync %s) never reached", point, sync);
    uint32_t bulks_before = fs.bulks;
    restart_free();
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && mv %s %s", dir, snap, dir);
    cr_assert_eq(system(cmd), 0);
    back_online();
    restart_new();
    cr_assert_gt(run(50), 0, "point %d (sync %s): not idle after the restart", point, sync);
    /* Every reading whose record was appended is stored exactly once: at the first point only
     * the first batch was on disk when the process died. */
    assert_stored(3, point == BD_PLACE_APPENDED ? 4 : 9);
    cr_assert_eq(STAT(writer_conflicts), 0, "point %d (sync %s)", point, sync);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_lost), 0);
    if (point >= BD_PLACE_JOURNALED && point <= BD_PLACE_SENT) {
        cr_assert_neq(journal_seq, 0, "point %d: the journal was durable", point);
        cr_assert_gt(fs.bulks, bulks_before);
        cr_assert_eq(fs.seqs[bulks_before], journal_seq,
                     "point %d (sync %s): resumed under the journal's number", point, sync);
    }
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_PLACING_FILE);
    cr_assert_neq(access(path, F_OK), 0, "the placing journal is retired in the end");
}

Test(flusher_spool, a_crash_at_every_point_of_an_unplaced_record_stores_each_reading_once) {
    static const char *const syncs[] = {"batch", "none"};
    for (size_t k = 0; k < sizeof(syncs) / sizeof(syncs[0]); k++) {
        for (int point = BD_PLACE_APPENDED; point <= BD_PLACE_RETIRED; point++) {
            crash_and_restart(point, syncs[k], false);
        }
    }
}

Test(flusher_spool, a_crash_after_a_lost_reply_of_a_placed_record_stores_each_reading_once) {
    crash_and_restart(BD_PLACE_JOURNALED, "batch", true);
    crash_and_restart(BD_PLACE_SENT, "batch", true);
    crash_and_restart(BD_PLACE_ACKED, "none", true);
}

Test(flusher_spool,
     an_evicted_sensor_returning_while_mongodb_is_away_is_spooled_and_keeps_its_cap) {
    stop();
    spool_timing();
    cfg.buckets.max_readings = 5;
    cfg.limits.sensor_idle_ms = 60000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 3; j++) {
        accept1("ev", j, t0 + j * 1000);
    }
    cr_assert_gt(run(10), 0);
    cr_assert_gt(run(10), 0); /* the idle segment handed back */
    now_ms += 61000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 1);
    cr_assert_gt(run(10), 0); /* released */

    /* Back while MongoDB is away: its bucket's pages are unknown (the evicted sensor wrote
     * them), so the batches go to the spool unplaced. */
    fs.find_fails = true;
    for (int i = 0; i < 8; i++) {
        fake_script(&fs, FAULT_UNREACHABLE, 0);
    }
    for (int j = 0; j < 4; j++) {
        accept1("ev", 10 + j, t0 + 10000 + j * 1000);
    }
    publish();
    mono += 1000 * MS; /* due: written, and the write fails */
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(pending_readings), 4);
    for (int j = 0; j < 4; j++) {
        accept1("ev", 20 + j, t0 + 20000 + j * 1000);
    }
    publish();
    mono += 20 * MS; /* the next batch is due: the failed one goes to the spool, then it */
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled_unplaced), 8,
                 "unknown pages: spooled unplaced (%" PRIu64 " of %" PRIu64 ", pending %" PRIu64
                 ", bulks %u)",
                 STAT(readings_spooled_unplaced), STAT(readings_spooled), STAT(pending_readings),
                 fs.bulks);
    cr_assert_eq(STAT(pending_readings), 0, "nothing waits in memory");
    /* A restart before MongoDB is back: the spool is all that is left. */
    restart();
    back_online();
    cr_assert_gt(run(50), 0);
    cr_assert_eq(fake_stored(&fs, "ev"), 11);
    cr_assert_leq(fake_max_count(&fs), 5, "a page holds at most max_readings readings");
    cr_assert_eq(STAT(spool_records_placed), 2);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

/* Every allocation of spooling a batch unplaced, and then of placing it, failing in turn: the
 * step is delayed, never a reading lost or written twice. */
Test(flusher_spool, each_allocation_failure_spooling_and_placing_unplaced_is_safe) {
    for (int phase = 0; phase < 2; phase++) {
        long allocations = -1;
        for (long k = -1; k < allocations + 2; k++) {
            first_start();
            if (phase == 0) {
                /* The spooling step: the second step of spool_unplaced_offline. */
                fs.find_fails = true;
                for (int i = 0; i < 8; i++) {
                    fake_script(&fs, FAULT_UNREACHABLE, 0);
                }
                send_sensors(3, 4);
                publish();
                bd_flusher_step(flusher, mono, now_ms, false);
                send_more(3, 5, 4);
                publish();
                mono += 20 * MS;
                bd_alloc_fail_after(k < 0 ? -1 : k, 0);
                bd_flusher_step(flusher, mono, now_ms, false);
            } else {
                spool_unplaced_offline();
                back_online();
                mono = bd_flusher_retry_at(flusher) + 1;
                bd_alloc_fail_after(k < 0 ? -1 : k, 0);
                bd_flusher_step(flusher, mono, now_ms, false); /* the placing step */
            }
            long counted = bd_alloc_fail_after(-1, 0);
            if (k < 0) {
                allocations = counted;
                cr_assert_gt(allocations, 3, "phase %d", phase);
            }
            back_online();
            cr_assert_gt(run(60), 0, "phase %d, allocation %ld", phase, k);
            assert_stored(3, 9);
            cr_assert_eq(STAT(readings_lost), 0);
            cr_assert_eq(STAT(writer_conflicts), 0, "phase %d, allocation %ld", phase, k);
            cr_assert_eq(STAT(updates_quarantined), 0);
        }
    }
}
