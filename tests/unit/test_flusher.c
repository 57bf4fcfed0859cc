/*
 * The flusher's decisions (src/flusher.c with pages, batch, outcome and bucket), driven through
 * bd_flusher_step on one thread with the clocks passed in, against a scripted store
 * (fake_store.h): what is stored, how often, on which pages, under which sequence number, and
 * what is counted, for each kind of answer MongoDB can give, and for allocation failures at
 * every allocation of a step. Expected values come from what each test sent.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/config.h"
#include "bucketd/deadletter.h"
#include "bucketd/flusher.h"
#include "bucketd/sensor.h"
#include "bucketd/spool.h"
#include "fake_store.h"
#include "flusher_harness.h"

TestSuite(flusher, .init = setup, .fini = teardown);

Test(flusher, every_reading_stored_once_with_one_update_per_page) {
    int64_t sent = send_sensors(3, 10);
    cr_assert_gt(run(10), 0);
    assert_stored(3, 10);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(updates_sent), 3);
    cr_assert_eq(fs.bulks, 1);
    cr_assert_eq(STAT(updates_quarantined), 0);
}

Test(flusher, bulks_are_chunked_at_max_updates_with_one_sequence_number) {
    stop();
    cfg.flush.max_updates = 3;
    start();
    send_sensors(7, 2);
    cr_assert_gt(run(10), 0);
    assert_stored(7, 2);
    cr_assert_eq(fs.bulks, 3);
    cr_assert_eq(fs.bulk_sizes[0], 3);
    cr_assert_eq(fs.bulk_sizes[1], 3);
    cr_assert_eq(fs.bulk_sizes[2], 1);
    cr_assert_eq(fs.seqs[0], fs.seqs[1]);
    cr_assert_eq(fs.seqs[1], fs.seqs[2]);
    /* The next batch takes a higher number. */
    send_sensors(1, 1);
    cr_assert_gt(run(10), 0);
    cr_assert_gt(fs.seqs[3], fs.seqs[2]);
}

Test(flusher, a_lost_reply_is_resent_with_the_same_number_and_counted_applied_once) {
    fake_script(&fs, FAULT_LOST_REPLY, 0);
    int64_t sent = send_sensors(4, 5);
    cr_assert_gt(run(10), 0);
    assert_stored(4, 5); /* applied once, not twice */
    cr_assert_eq(fs.bulks, 2);
    cr_assert_eq(fs.seqs[0], fs.seqs[1]);
    cr_assert_eq(STAT(updates_already_applied), 4);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

Test(flusher, a_write_concern_error_is_ambiguous_and_applied_once) {
    fake_script(&fs, FAULT_WC_ERROR, 64);
    int64_t sent = send_sensors(2, 3);
    cr_assert_gt(run(10), 0);
    assert_stored(2, 3);
    cr_assert_eq(STAT(updates_already_applied), 2);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
}

Test(flusher, nothing_sent_then_a_racing_insert_is_retried_not_counted_applied) {
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    fs.races = 1;
    int64_t sent = send_sensors(1, 15);
    cr_assert_gt(run(10), 0);
    assert_stored(1, 15);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(updates_sent), 2); /* the refused insert and its retry; not the unsent one */
}

/* A dead-letter file that takes nothing more (at its cap): the refusal is still quarantined,
 * and its readings are counted as kept nowhere. */
Test(flusher, a_quarantined_update_the_dead_letter_file_cannot_keep_is_counted) {
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, BD_DEADLETTER_FILE);
    /* Sparse (no disk used), its last line whole. */
    FILE *fp = fopen(path, "w");
    cr_assert_not_null(fp);
    cr_assert_eq(fseeko(fp, (off_t)BD_DEADLETTER_MAX_BYTES - 1, SEEK_SET), 0);
    cr_assert_eq(fputc('\n', fp), '\n');
    cr_assert_eq(fclose(fp), 0);
    fs.poison = "m,s=1";
    send_sensors(3, 4);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 4);
    cr_assert_eq(fake_stored(&fs, "m,s=2"), 4);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(deadletter_write_errors), 1);
    cr_assert_eq(STAT(deadletter_dropped_readings), 4);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq((uint64_t)st.st_size, BD_DEADLETTER_MAX_BYTES, "nothing appended");
}

Test(flusher, another_daemon_with_this_writer_id_is_a_conflict_not_applied) {
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    fs.races = 1;
    fs.race_wseq = UINT64_C(1) << 40;
    send_sensors(1, 5);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 0);
    cr_assert_eq(STAT(writer_conflicts), 1);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(readings_flushed), 0);
    cr_assert_eq(STAT(readings_quarantined), 5);
    cr_assert_eq(dead_letters(), 1);
}

Test(flusher, a_permanent_refusal_quarantines_one_update_and_the_rest_is_stored) {
    fs.poison = "m,s=1";
    send_sensors(3, 4);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 4);
    cr_assert_eq(fake_stored(&fs, "m,s=1"), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=2"), 4);
    cr_assert_eq(STAT(updates_quarantined), 1);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(readings_flushed), 8);
    cr_assert_eq(dead_letters(), 1);
    cr_assert_eq(STAT(deadletter_write_errors), 0);
    cr_assert_eq(STAT(deadletter_dropped_readings), 0);
    cr_assert_eq(fs.bulks, 1); /* not retried */
}

Test(flusher, transient_command_errors_are_retried_without_limit) {
    for (int i = 0; i < 12; i++) {
        fake_script(&fs, FAULT_CMD_ERROR, 91);
    }
    send_sensors(2, 2);
    cr_assert_gt(run(40), 0);
    assert_stored(2, 2);
    cr_assert_eq(fs.bulks, 13);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(bulk_retries), 12);
}

Test(flusher, refusals_are_bounded_then_quarantined) {
    /* BadValue: a command-level code of no known class. */
    for (int i = 0; i < 30; i++) {
        fake_script(&fs, FAULT_CMD_ERROR, 2);
    }
    send_sensors(2, 3);
    cr_assert_gt(run(40), 0);
    cr_assert_eq(STAT(updates_quarantined), 2);
    cr_assert_eq(STAT(readings_quarantined), 6);
    cr_assert_eq(fs.bulks, 8); /* MAX_REFUSALS */
    cr_assert_eq(dead_letters(), 2);
}

/*
 * A deployment error on every update (the collection sharded on a key the upserts cannot
 * target): nothing is quarantined however long it lasts, the readings wait, and once the
 * operator has fixed the deployment every one is stored once.
 */
Test(flusher, a_deployment_error_keeps_everything_until_it_is_fixed) {
    fs.refuse_all = 61;
    int64_t sent = send_sensors(3, 4);
    cr_assert_eq(run(40), -1, "still pending while MongoDB refuses");
    cr_assert_eq(fs.bulks, 40);
    cr_assert_eq(fs.n_docs, 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_quarantined), 0);
    cr_assert_eq(STAT(readings_flushed), 0);
    cr_assert_eq(STAT(bulk_retries), 40);
    cr_assert_eq(dead_letters(), 0);
    cr_assert(!bd_flusher_idle(flusher));
    /* Every attempt carried the batch's one sequence number. */
    for (uint32_t i = 1; i < 40; i++) {
        cr_assert_eq(fs.seqs[i], fs.seqs[0]);
    }

    fs.refuse_all = 0;
    cr_assert_gt(run(10), 0);
    assert_stored(3, 4);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(dead_letters(), 0);
}

/* The same for a command-level deployment error (missing privileges: 13). */
Test(flusher, an_unauthorized_command_is_retried_not_quarantined) {
    for (int i = 0; i < 20; i++) {
        fake_script(&fs, FAULT_CMD_ERROR, 13);
    }
    int64_t sent = send_sensors(2, 3);
    cr_assert_gt(run(40), 0);
    assert_stored(2, 3);
    cr_assert_eq(fs.bulks, 21);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(dead_letters(), 0);
}

/*
 * An unsatisfiable write concern (100): the server applies the updates and says so in a
 * writeConcernError. The retries find them in the pages (duplicate key) but still without the
 * write concern: they stay pending until an answer confirms them, then count as applied, once.
 */
Test(flusher, an_unsatisfiable_write_concern_settles_only_once_confirmed) {
    for (int i = 0; i < 3; i++) {
        fake_script(&fs, FAULT_WC_ERROR, 100);
    }
    int64_t sent = send_sensors(2, 3);
    cr_assert_gt(run(10), 0);
    assert_stored(2, 3);
    cr_assert_eq(fs.bulks, 4, "three answers with the write concern error, then one without");
    cr_assert_eq(STAT(updates_already_applied), 2);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

/*
 * A collection sharded on {sensor_id, bucket_start} behind mongos: every upsert's filter must
 * hold both as equalities, also for late readings (an older bucket) and overflow pages.
 */
Test(flusher, a_sharded_collection_takes_every_upsert) {
    stop();
    cfg.buckets.max_readings = 4;
    start();
    fs.sharded = true;
    int64_t sent = send_sensors(3, 10);
    int64_t late = now_ms / HOUR_MS * HOUR_MS - 3 * HOUR_MS;
    accept1("m,s=0", 1.0, late);
    accept1("m,s=0", 2.0, late + 1000);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 12);
    cr_assert_eq(fake_stored(&fs, "m,s=1"), 10);
    cr_assert_eq(fake_stored(&fs, "m,s=2"), 10);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent + 2);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(fs.bulks, 1, "no update was refused");
    cr_assert_eq(fake_max_count(&fs), 4);
}

Test(flusher, a_driver_refusal_halves_the_bulk_until_the_refused_update_is_alone) {
    stop();
    cfg.flush.max_updates = 4;
    start();
    fs.client_max_ops = 1;
    send_sensors(4, 3);
    cr_assert_gt(run(10), 0);
    assert_stored(4, 3);
    cr_assert_eq(fs.bulk_sizes[0], 4);
    cr_assert_eq(fs.bulk_sizes[1], 2);
    cr_assert_eq(fs.bulk_sizes[2], 1);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(bulk_writes), 4); /* the refused bulks never reached the server */
}

/*
 * The driver split the bulk of four: the first command answered a duplicate key for the first
 * update (another writer's insert raced it) and applied the second; the next command failed
 * whole (code, or its connection with 0) and applied nothing. mongoc then returns the duplicate
 * key as the bulk's error, and its counts answer for two updates of four: which of the three
 * without an entry of their own ran is unknown. They are sent again with the raced one under
 * the same number: the one applied proves so by the page read back, the two never applied are
 * applied now, and nothing is counted flushed that is not stored.
 */
static void split_bulk_whose_second_command_failed(int32_t code) {
    fake_script(&fs, FAULT_SPLIT_FAILED, code);
    fs.races = 1; /* the first inserting upsert: sensor 0's, in the first command */
    int64_t sent = send_sensors(4, 5);
    cr_assert_gt(run(10), 0);
    assert_stored(4, 5);
    int64_t stored = 0;
    char name[32];
    for (int i = 0; i < 4; i++) {
        stored += fake_stored(&fs, sensor_name(name, sizeof(name), i));
    }
    cr_assert_eq(stored, sent);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)stored, "flushed %" PRIu64 ", stored %" PRId64,
                 STAT(readings_flushed), stored);
    for (uint32_t i = 0; i < fs.n_docs; i++) {
        cr_assert_eq(fs.docs[i].updates, 1, "%s applied once", fs.docs[i].id);
    }
    cr_assert_eq(fs.bulks, 2);
    cr_assert_eq(fs.bulk_sizes[0], 4);
    cr_assert_eq(fs.bulk_sizes[1], 4, "the raced update and the three not answered for, again");
    cr_assert_eq(fs.seqs[1], fs.seqs[0], "under the same number");
    cr_assert_eq(STAT(updates_already_applied), 1, "sensor 1's, proved by its page");
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

Test(flusher, a_split_bulk_whose_second_command_was_refused_is_not_counted_applied) {
    split_bulk_whose_second_command_failed(11600);
}

Test(flusher, a_split_bulk_whose_second_command_was_unauthorized_is_not_counted_applied) {
    split_bulk_whose_second_command_failed(13);
}

Test(flusher, a_split_bulk_whose_second_command_lost_its_connection_is_not_counted_applied) {
    split_bulk_whose_second_command_failed(0);
}

Test(flusher, an_update_refused_client_side_alone_moves_to_a_new_page) {
    fake_script(&fs, FAULT_CLIENT_LARGE, 0);
    send_sensors(1, 6);
    cr_assert_gt(run(10), 0);
    assert_stored(1, 6);
    cr_assert_eq(fs.n_docs, 1);
    cr_assert_eq(fs.docs[0].page, 1);
}

/* n distinct field names of len bytes each ("fNN" then filler), for size limits; free_names
 * gives them back. */
Test(flusher, an_oversized_page_is_split_and_never_blocks_other_sensors) {
    const char **fields = long_names(32, 200);
    int64_t start = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 3000; j++) {
        accept_fields("big", fields, 32, j, start + j);
    }
    send_sensors(5, 40);
    cr_assert_gt(run(20), 0);
    cr_assert_eq(fake_stored(&fs, "big"), 3000);
    assert_stored(5, 40);
    cr_assert_leq(fs.max_update_bytes, BD_UPDATE_MAX_BYTES);
    cr_assert_leq(fake_max_count(&fs), cfg.buckets.max_readings);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_flushed), 3200);
    int big_pages = 0;
    for (uint32_t i = 0; i < fs.n_docs; i++) {
        big_pages += strcmp(fs.docs[i].sensor_id, "big") == 0;
    }
    cr_assert_geq(big_pages, 3, "20 MB of readings need three 8 MiB pages");
    free_names(fields, 32);
}

Test(flusher, a_document_size_refusal_moves_readings_to_the_next_page) {
    fs.max_doc_bytes = 6000;
    int64_t start = now_ms / HOUR_MS * HOUR_MS;
    int64_t sent = 0;
    for (int round = 0; round < 6; round++) {
        for (int j = 0; j < 20; j++) {
            accept1("grow", j, start + round * 100 + j);
            sent++;
        }
        cr_assert_gt(run(20), 0);
    }
    cr_assert_eq(fake_stored(&fs, "grow"), sent);
    cr_assert_gt(fs.n_docs, 1);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
}

/* Defect 3: late readings of a bucket whose slot was dropped after an outage go back to its
 * stored pages, not to a fresh page 0. */
Test(flusher, a_forgotten_bucket_is_learned_again_and_keeps_its_page_cap) {
    stop();
    cfg.buckets.span_ms = 60000;
    cfg.buckets.max_readings = 5;
    cfg.buckets.max_late_ms = 5000;
    start();
    int64_t b0 = now_ms / 60000 * 60000;
    now_ms = b0 + 4500;
    for (int j = 0; j < 5; j++) {
        accept1("late", j, b0 + j * 1000);
    }
    cr_assert_gt(run(10), 0);
    /* Near the end of b0: one reading of b1 first, then late readings of b0 (still within
     * max_late when accepted), drained only after an outage of three minutes. */
    now_ms = b0 + 62000;
    accept1("late", 100, b0 + 61000);
    for (int j = 0; j < 3; j++) {
        accept1("late", 10 + j, b0 + 58000 + j);
    }
    now_ms = b0 + 240000;
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "late"), 9);
    cr_assert_leq(fake_max_count(&fs), 5, "a page holds at most max_readings readings");
    int b0_pages = 0;
    for (uint32_t i = 0; i < fs.n_docs; i++) {
        b0_pages += fs.docs[i].start_ms == b0;
    }
    cr_assert_eq(b0_pages, 2);
}

/*
 * An idle sensor is evicted only once its readings are written; the flusher then releases it.
 * The same series sending again into the same bucket is a new sensor: the bucket's pages are
 * read back first, so its page cap holds across the eviction.
 */
Test(flusher, an_evicted_sensor_is_written_first_and_its_bucket_read_back_later) {
    stop();
    cfg.buckets.max_readings = 5;
    cfg.limits.sensor_idle_ms = 60000;
    start();
    uint64_t empty = bd_sensor_table_memory(table);
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 3; j++) {
        accept1("ev", j, t0 + j * 1000);
    }
    /* Silent long enough, but not yet written: not evicted. */
    bd_sensor_table_sweep(table, (now_ms + 60000) * MS);
    cr_assert_eq(STAT(sensors_evicted), 0);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "ev"), 3);
    cr_assert_gt(run(10), 0); /* the producer seals its idle segment, the flusher gives it back */
    now_ms += 61000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 1);
    cr_assert_eq(bd_sensor_table_count(table), 0);
    cr_assert_gt(run(10), 0); /* the flusher releases it */
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(bd_sensor_table_memory(table), empty, "freed");

    uint64_t lookups = STAT(page_lookups);
    for (int j = 0; j < 4; j++) {
        accept1("ev", 10 + j, t0 + 10000 + j * 1000);
    }
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "ev"), 7);
    cr_assert_gt(STAT(page_lookups), lookups, "the bucket's pages were read back");
    cr_assert_leq(fake_max_count(&fs), 5, "a page holds at most max_readings readings");
    cr_assert_eq(STAT(readings_flushed), 7);
}

/* Evicted sensors the flusher still holds at a stop are released with it (no leak, no
 * assertion), their readings written. */
Test(flusher, a_stop_releases_evicted_sensors_still_held) {
    stop();
    cfg.limits.sensor_idle_ms = 1000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    accept1("a", 1, t0);
    cr_assert_gt(run(10), 0);
    cr_assert_gt(run(10), 0);
    now_ms += 5000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 1);
    /* No step: the flusher never took it. stop() frees both. */
}

/*
 * A sensor whose readings the flusher still holds is not evicted, however long it is silent:
 * here they wait in the fill batch for flush.max_delay. Were it evicted, the same series
 * sending again would be a new sensor with page accounting of its own for the same bucket,
 * and both deltas would go in one bulk under one sequence number: the second draws a duplicate
 * key, its read-back finds our own number, and it is quarantined as a writer conflict. Held,
 * the sensor goes on: one update of one page. Once written, it is evicted.
 */
Test(flusher, a_sensor_whose_readings_wait_in_the_fill_batch_is_not_evicted) {
    stop();
    cfg.flush.max_delay_ms = 30000;
    cfg.limits.sensor_idle_ms = 2000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 9; j++) {
        accept1("held", j, t0 + j * 1000);
    }
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* drained into the fill batch, held */
    publish();                                     /* the producer seals its idle segment */
    bd_flusher_step(flusher, mono, now_ms, false); /* and the flusher gives it back */
    cr_assert_eq(fs.bulks, 0, "held for max_delay");
    cr_assert_eq(STAT(pending_readings), 9);
    now_ms += 3000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 0, "its readings are still held");

    accept1("held", 9, t0 + 9000);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "held"), 10);
    cr_assert_eq(STAT(readings_flushed), 10);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(readings_quarantined), 0);
    cr_assert_eq(fs.n_docs, 1, "one page");
    cr_assert_eq(fs.docs[0].updates, 1, "one update");

    cr_assert_gt(run(10), 0); /* the producer seals its idle segment, the flusher gives it back */
    now_ms += 3000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 1, "written: evicted");
}

/*
 * The same while a batch waits for its retry: the sensor is not evicted while the batch holds
 * its readings. Were it, its readings sent again later would fill page 0, and the series
 * sending again in the meantime would be a new sensor taking the bucket for new, its readings
 * drained onto page 0 too: a page over max_readings.
 */
Test(flusher, a_sensor_whose_readings_wait_for_a_retry_is_not_evicted) {
    stop();
    cfg.buckets.max_readings = 5;
    cfg.limits.sensor_idle_ms = 2000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 4; j++) {
        accept1("retried", j, t0 + j * 1000);
    }
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* drained, sent, failed: waits for a retry */
    cr_assert_eq(fs.bulks, 1);
    cr_assert_gt(bd_flusher_retry_at(flusher), mono);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* before the retry: the segment goes back */
    now_ms += 3000;
    bd_sensor_table_sweep(table, now_ms * MS);
    cr_assert_eq(STAT(sensors_evicted), 0, "its readings wait for the retry");

    for (int j = 4; j < 8; j++) {
        accept1("retried", j, t0 + j * 1000);
    }
    cr_assert_gt(run(20), 0);
    cr_assert_eq(fake_stored(&fs, "retried"), 8);
    cr_assert_leq(fake_max_count(&fs), 5, "a page holds at most max_readings readings");
    cr_assert_eq(fs.n_docs, 2);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(readings_quarantined), 0);
}

/*
 * Fairness: a sensor with far more readings than the others takes at most an eighth of the
 * batches' memory in one batch while others wait; the others' readings go into that batch, its
 * rest into the next ones. Its readings come in six loads (its queue holds at most an eighth
 * of the pool), drained into the fill batch one after another before the batch is written.
 */
static void busy_loads(int loads, int per_load, bool quiet) {
    static const char *const fields[] = {"a", "b", "c", "d", "e", "f", "g", "h"};
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    bd_flusher_step(flusher, mono, now_ms, false); /* nothing yet: the next write is due later */
    for (int k = 0; k < loads; k++) {
        for (int j = 0; j < per_load; j++) {
            accept_fields("busy", fields, 8, j, t0 + k * per_load + j);
        }
        if (quiet) {
            accept1("quiet", k, t0 + k); /* queued behind it: waiting while it is drained */
        }
        publish();
        bd_flusher_step(flusher, mono, now_ms, false); /* drained, not yet due */
    }
}

Test(flusher, one_sensor_takes_at_most_its_share_of_a_batch_while_others_wait) {
    stop();
    /* Batches 1 MiB, a sensor's share of one 128 KiB: less than the busy sensor's 1,800
     * readings of 8 fields take in a batch (88 bytes each in a delta). */
    cfg.limits.memory = 2 << 20;
    cfg.limits.max_fields = 8;
    start();
    busy_loads(6, 300, true);
    accept1("quiet", 6, now_ms / HOUR_MS * HOUR_MS + 6); /* waiting when the batch is written */
    publish();
    bd_flusher_step(flusher, mono, now_ms, true); /* one batch */
    cr_assert_eq(fake_stored(&fs, "quiet"), 7, "the quiet sensor did not wait");
    int64_t first = fake_stored(&fs, "busy");
    cr_assert_gt(first, 0);
    cr_assert_lt(first, 6 * 300, "the busy sensor took only its share of the first batch");
    cr_assert_gt(run(50), 0);
    cr_assert_eq(fake_stored(&fs, "busy"), 6 * 300);
    cr_assert_eq(STAT(readings_flushed), 6 * 300 + 7);
}

/* A sensor's share is of each batch: once the batch that held its share is written, the next
 * one takes its share again (not a reading at a time), while others still wait. */
Test(flusher, a_sensors_share_starts_again_in_the_next_batch) {
    stop();
    cfg.limits.memory = 2 << 20; /* a sensor's share of a batch: 128 KiB */
    cfg.limits.max_fields = 8;
    start();
    const int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    busy_loads(6, 300, true);
    accept1("quiet", 6, t0 + 6);
    publish();
    bd_flusher_step(flusher, mono, now_ms, true); /* the first batch */
    const int64_t first = fake_stored(&fs, "busy");
    cr_assert_gt(first, 0);
    cr_assert_lt(first, 6 * 300, "the busy sensor took only its share of the first batch");
    accept1("quiet", 7, t0 + 7); /* waiting while the busy sensor is drained again */
    publish();
    bd_flusher_step(flusher, mono, now_ms, true); /* the second batch */
    const int64_t second = fake_stored(&fs, "busy") - first;
    cr_assert_eq(fake_stored(&fs, "quiet"), 8);
    cr_assert_geq(second, BD_MIN(first, 6 * 300 - first),
                  "a new share in the second batch: %" PRId64 " of the %" PRId64 " left", second,
                  6 * 300 - first);
    cr_assert_gt(run(50), 0);
    cr_assert_eq(fake_stored(&fs, "busy"), 6 * 300);
}

/* Alone, a sensor takes what it needs: its share of a batch applies only while others wait. */
Test(flusher, a_sensor_alone_is_not_held_to_a_share) {
    stop();
    cfg.limits.memory = 4 << 20;
    cfg.limits.max_fields = 8;
    start();
    busy_loads(6, 300, false);
    bd_flusher_step(flusher, mono, now_ms, true);
    cr_assert_eq(fake_stored(&fs, "busy"), 6 * 300);
}

/* The same readings for every round of the allocation sweep: three sensors, two buckets. */
static void sweep_readings(int64_t t0) {
    static const char *const fields[] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 12; j++) {
            char id[16];
            snprintf(id, sizeof(id), "m,s=%d", i);
            accept_fields(id, fields, 1 + (uint32_t)(j % 3), j, t0 - (j % 2) * HOUR_MS + j);
        }
    }
    publish();
}

/*
 * Every allocation of a step fails once, in turn; the readings are then all stored once. With
 * look_up, the buckets are inside the look-up horizon and pages exist already, so the failures
 * also hit reading pages back and placing readings on them. With hold, pages are held back for
 * flush.max_delay (a page of 1,000, so 12 readings are far from due): the step is a regular one
 * (not stopping) at the flush interval, so the failures also hit moving held deltas back into
 * the next batch; the rest is written once max_delay has passed.
 */
static void allocation_sweep(bool look_up, bool hold) {
    stop();
    cfg.buckets.max_readings = hold ? 1000 : 5;
    if (hold) {
        cfg.flush.max_delay_ms = 30000;
    }
    start();
    if (look_up) {
        now_ms = bd_now_ns() / MS;
    }
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    int64_t wall0 = now_ms;
    int64_t step_mono = mono + (int64_t)cfg.flush.interval_ms * MS + 1; /* the interval is due */
    /* Count the allocations of a clean run of the same work. */
    if (look_up) {
        fake_put(&fs, "m,s=0", t0, 0, 4, 3);
    }
    sweep_readings(t0);
    bd_alloc_fail_after(-1, 0);
    bd_flusher_step(flusher, step_mono, now_ms, !hold);
    long allocations = bd_alloc_fail_after(-1, 0);
    cr_assert_gt(allocations, 5);
    for (long k = 0; k < allocations + 2; k++) {
        stop();
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "rm -rf %s/*", dir);
        cr_assert_eq(system(cmd), 0);
        now_ms = wall0;
        start();
        if (look_up) {
            fake_put(&fs, "m,s=0", t0, 0, 4, 3);
        }
        sweep_readings(t0);
        bd_alloc_fail_after(k, 0);
        bd_flusher_step(flusher, step_mono, now_ms, !hold);
        bd_alloc_fail_after(-1, 0);
        mono = step_mono + 1;
        if (hold) {
            now_ms += cfg.flush.max_delay_ms + 1;
        }
        cr_assert_gt(run(20), 0, "allocation %ld", k);
        cr_assert_eq(fake_stored(&fs, "m,s=0"), 12 + (look_up ? 4 : 0), "allocation %ld", k);
        cr_assert_eq(fake_stored(&fs, "m,s=1"), 12, "allocation %ld", k);
        cr_assert_eq(fake_stored(&fs, "m,s=2"), 12, "allocation %ld", k);
        cr_assert_leq(fake_max_count(&fs), cfg.buckets.max_readings, "allocation %ld", k);
        cr_assert_eq(STAT(readings_flushed), 36, "allocation %ld", k);
        cr_assert_eq(STAT(readings_lost), 0);
        cr_assert_eq(STAT(updates_quarantined), 0);
    }
    now_ms = wall0;
}

Test(flusher, each_allocation_failure_delays_but_never_loses_or_duplicates) {
    allocation_sweep(false, false);
}

Test(flusher, each_allocation_failure_around_a_page_look_up_is_safe) {
    allocation_sweep(true, false);
}

Test(flusher, each_allocation_failure_while_holding_pages_back_is_safe) {
    allocation_sweep(false, true);
}

/* Memory never comes back: at the deadline, what was not written is counted lost. */
Test(flusher, at_a_stop_without_memory_everything_unwritten_is_counted_lost) {
    int64_t sent = send_sensors(3, 4);
    publish();
    bd_alloc_fail_after(0, 1);
    cr_assert_eq(run(5), -1);
    uint64_t lost = bd_flusher_abandon(flusher);
    bd_alloc_fail_after(-1, 0);
    cr_assert_eq(lost + STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(readings_lost), lost);
    cr_assert_eq(lost, (uint64_t)sent);
}

/* A spool that takes nothing: every record is larger than its cap, and the policy refuses. */
static void spool_refuses_everything(void) {
    stop();
    cfg.spool.max_bytes = 64;
    cfg.spool.when_full = BD_SPOOL_FULL_DROP_NEWEST;
    start();
}

Test(flusher, an_unreachable_server_at_the_deadline_loses_what_cannot_be_spooled_counted) {
    spool_refuses_everything();
    for (int i = 0; i < 10; i++) {
        fake_script(&fs, FAULT_UNREACHABLE, 0);
    }
    int64_t sent = send_sensors(2, 5);
    cr_assert_eq(run(5), -1);
    cr_assert_eq(bd_flusher_abandon(flusher), (uint64_t)sent);
    cr_assert_eq(STAT(readings_lost), (uint64_t)sent);
    cr_assert_eq(STAT(updates_sent), 0, "nothing reached the server");
    cr_assert_eq(STAT(bulk_writes), 0);
    /* The next start exports what this stop lost (the alert BucketdStopLostReadings), and the
     * one after a stop that lost nothing exports 0. */
    restart();
    cr_assert_eq(STAT(previous_stop_readings_lost), (uint64_t)sent);
    cr_assert_eq(bd_flusher_abandon(flusher), 0);
    restart();
    cr_assert_eq(STAT(previous_stop_readings_lost), 0);
}

/*
 * The stop message says why readings remain, by what the last attempts met: no server, a
 * connection failing mid-request, a server still refusing (transient errors, retried without
 * bound), updates that could not be built. Each case: the readings counted lost and the reason
 * in the error line.
 */
enum no_memory { MEMORY, NO_MEMORY_AT_ALL, NO_MEMORY_AFTER_ONE_ATTEMPT };

static void stop_reason_is_logged(enum fake_fault fault, int32_t code, enum no_memory no_memory,
                                  const char *why) {
    stop();
    configure();
    start();
    spool_refuses_everything();
    for (int i = 0; fault != FAULT_NONE && i < 60; i++) {
        fake_script(&fs, fault, code);
    }
    int64_t sent = send_sensors(2, 3);
    if (no_memory == NO_MEMORY_AFTER_ONE_ATTEMPT) {
        /* Drained and tried once (no server), then no memory to build the updates again. */
        fake_script(&fs, FAULT_UNREACHABLE, 0);
        publish();
        bd_flusher_step(flusher, mono, now_ms, true);
        cr_assert(!bd_flusher_idle(flusher));
        mono = bd_flusher_retry_at(flusher);
    }
    if (no_memory != MEMORY) {
        bd_alloc_fail_after(0, 1);
    }
    cr_assert_eq(run(8), -1, "%s: still pending", why);
    cr_redirect_stderr();
    cr_assert_eq(bd_flusher_abandon(flusher), (uint64_t)sent, "%s", why);
    bd_alloc_fail_after(-1, 0);
    fflush(stderr);
    FILE *log = cr_get_redirected_stderr();
    char line[2048];
    bool found = false;
    while (fgets(line, sizeof(line), log) != NULL) {
        if (strstr(line, "stop deadline") != NULL && strstr(line, "were not stored") != NULL) {
            cr_assert_not_null(strstr(line, why), "reason \"%s\" not in: %s", why, line);
            found = true;
        }
    }
    cr_assert(found, "no stop message for \"%s\"", why);
    cr_assert_eq(STAT(readings_lost), (uint64_t)sent);
}

Test(flusher, the_stop_message_says_the_server_was_unreachable) {
    stop_reason_is_logged(FAULT_UNREACHABLE, 0, MEMORY, "MongoDB was unreachable");
}

Test(flusher, the_stop_message_says_the_connection_kept_failing) {
    stop_reason_is_logged(FAULT_LOST_REQUEST, 0, MEMORY,
                          "the connection to MongoDB kept failing during writes");
}

Test(flusher, the_stop_message_says_the_server_kept_refusing) {
    stop_reason_is_logged(FAULT_CMD_ERROR, 91, MEMORY,
                          "MongoDB kept refusing updates that were still being retried");
}

Test(flusher, the_stop_message_says_updates_could_not_be_built) {
    stop_reason_is_logged(FAULT_NONE, 0, NO_MEMORY_AFTER_ONE_ATTEMPT,
                          "updates could not be built or were refused by the driver");
}

Test(flusher, the_stop_message_says_readings_were_never_drained) {
    stop_reason_is_logged(FAULT_NONE, 0, NO_MEMORY_AT_ALL, "they were never drained");
}

/* Defect 5: long ids keep distinct documents. */
Test(flusher, sensor_ids_sharing_a_long_prefix_keep_their_own_documents) {
    static char a[1101], b[1101];
    memset(a, 'x', 1100);
    memset(b, 'x', 1100);
    a[1099] = 'a';
    b[1099] = 'b';
    int64_t start = now_ms / HOUR_MS * HOUR_MS;
    for (int h = 0; h < 3; h++) {
        accept1(a, h, start - h * HOUR_MS);
        accept1(b, h, start - h * HOUR_MS);
    }
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fs.n_docs, 6);
    cr_assert_eq(fake_stored(&fs, a), 3);
    cr_assert_eq(fake_stored(&fs, b), 3);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

/* After a restart every bucket up to the look-up horizon may hold pages: they are read back and
 * new readings continue the last page, up to the cap. */
Test(flusher, stored_pages_are_learned_before_appending) {
    stop();
    cfg.buckets.max_readings = 12;
    start();
    now_ms = bd_now_ns() / MS; /* inside the horizon: every bucket is looked up */
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    fake_put(&fs, "m,s=0", b, 0, 12, 5);
    fake_put(&fs, "m,s=0", b, 1, 10, 5);
    fake_put(&fs, "m,s=1", b, 0, 2, 7);
    for (int i = 0; i < 3; i++) {
        char id[16];
        snprintf(id, sizeof(id), "m,s=%d", i);
        for (int j = 0; j < 5; j++) {
            accept1(id, j, b + j * 1000);
        }
    }
    cr_assert_gt(run(10), 0);
    cr_assert_gt(fs.seqs[0], 7, "the sequence continues above what the pages hold");
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 12 + 10 + 5);
    cr_assert_eq(fake_stored(&fs, "m,s=1"), 2 + 5);
    cr_assert_eq(fake_stored(&fs, "m,s=2"), 5);
    cr_assert_leq(fake_max_count(&fs), 12);
    char id[BD_BUCKET_ID_MAX];
    bd_bucket_id(id, sizeof(id), "m,s=0", b, 2);
    struct fake_doc *p2 = fake_find(&fs, id);
    cr_assert_not_null(p2, "page 1 filled to the cap, the rest on page 2");
    cr_assert_eq(p2->count, 3);
    cr_assert_geq(STAT(page_lookups), 1);
}

Test(flusher, a_failed_look_up_keeps_the_readings_and_is_tried_again) {
    now_ms = bd_now_ns() / MS;
    fs.find_fails = true;
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    accept1("m,s=0", 1, b);
    publish();
    bd_flusher_step(flusher, mono, now_ms, true);
    cr_assert_eq(fs.bulks, 0, "nothing is written before the sequence and pages are known");
    cr_assert_neq(bd_flusher_retry_at(flusher), 0);
    fs.find_fails = false;
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 1);
    cr_assert_eq(STAT(readings_flushed), 1);
}

/* 64 fields with 16 KiB names: a page of 8 MiB (estimated) makes an update of more than 16 MiB
 * (each name appears in the summary operators too): it is split before it is sent. */
Test(flusher, an_update_over_16_MiB_is_split_before_it_is_sent) {
    const char **fields = long_names(64, 16384);
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    for (int j = 0; j < 20; j++) {
        accept_fields("wide", fields, 64, j, b + j);
    }
    cr_assert_gt(run(20), 0);
    cr_assert_eq(fake_stored(&fs, "wide"), 20);
    cr_assert_leq(fs.max_update_bytes, BD_UPDATE_MAX_BYTES);
    cr_assert_eq(STAT(updates_quarantined), 0);
    free_names(fields, 64);
}

/* A reading whose update alone passes 16 MiB cannot be sent in any form: quarantined, kept. */
Test(flusher, a_single_reading_too_large_to_send_is_quarantined) {
    const char **fields = long_names(64, 30000);
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    accept_fields("huge", fields, 64, 1, b);
    accept1("m,s=0", 1, b);
    cr_assert_gt(run(20), 0);
    cr_assert_eq(STAT(readings_quarantined), 1);
    cr_assert_eq(fake_stored(&fs, "huge"), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 1);
    cr_assert_eq(dead_letters(), 1);
    free_names(fields, 64);
}

/* Refused for its size after an attempt that may have reached the server: read back first; a
 * page refused whatever its size is quarantined after MAX_REFUSALS, not moved on forever. */
Test(flusher, size_refusals_after_an_ambiguous_attempt_are_bounded) {
    fake_script(&fs, FAULT_LOST_REQUEST, 0);
    fs.too_large = "m,s=0";
    send_sensors(2, 4);
    cr_assert_gt(run(100), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=0"), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=1"), 4);
    cr_assert_eq(STAT(readings_quarantined), 4);
    cr_assert_eq(STAT(readings_flushed), 4);
    cr_assert_geq(STAT(page_lookups), 1, "the ambiguous update's page was read back");
}

Test(flusher, a_duplicate_key_without_our_sequence_is_retried_a_bounded_number_of_times) {
    fs.dup_always = "m,s=0";
    send_sensors(2, 3);
    cr_assert_gt(run(20), 0);
    cr_assert_eq(STAT(readings_quarantined), 3);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_already_applied), 0);
    cr_assert_eq(fake_stored(&fs, "m,s=1"), 3);
    cr_assert_eq(dead_letters(), 1);
}

Test(flusher, a_failed_read_back_leaves_the_update_pending) {
    send_sensors(1, 1);
    cr_assert_gt(run(10), 0);
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    accept1("other", 1, b);
    fs.races = 1;
    fs.find_fails = true;
    publish();
    bd_flusher_step(flusher, mono, now_ms, true);
    cr_assert_eq(STAT(readings_flushed), 1, "the raced update is not settled yet");
    fs.find_fails = false;
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, "other"), 1);
    cr_assert_eq(STAT(readings_flushed), 2);
    cr_assert_eq(STAT(updates_already_applied), 0);
}

Test(flusher, the_blackhole_sink_counts_and_discards) {
    stop();
    cfg.sink = BD_SINK_BLACKHOLE;
    struct bd_err err = {0};
    memset(&stats, 0, sizeof(stats));
    cr_assert_eq(bd_sensor_table_new(&table, &cfg, &stats, &err), 0);
    fake_init(&fs, cfg.writer_id);
    cr_assert_eq(bd_flusher_new(&flusher, &cfg, table, &stats, &err), 0, "%s", err.msg);
    int64_t sent = send_sensors(3, 7);
    cr_assert_gt(run(5), 0);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)sent);
    cr_assert_eq(STAT(bulk_writes), 0);
}

Test(flusher, a_stop_gives_up_what_keeps_failing_and_cannot_be_spooled_and_counts_it) {
    spool_refuses_everything();
    for (int i = 0; i < 10; i++) {
        fake_script(&fs, FAULT_LOST_REQUEST, 0);
    }
    int64_t sent = send_sensors(2, 2);
    cr_assert_eq(run(5), -1);
    cr_assert_eq(bd_flusher_abandon(flusher), (uint64_t)sent);
    cr_assert_eq(STAT(readings_lost), (uint64_t)sent);
    /* Nothing is left: the next stop has nothing to give up. */
    cr_assert(bd_flusher_idle(flusher));
    cr_assert_eq(bd_flusher_abandon(flusher), 0);
}

/*
 * Property: random readings of a few sensors, in and out of order, late and early, across
 * buckets, through outages (nothing sent), lost replies, racing inserts and jumps of the wall
 * clock, with a small page cap, and idle sensors evicted between flushes (limits.sensor_idle)
 * while the flusher may still hold their readings (flush.max_delay, a retry). After every
 * settled flush: every accepted reading stored exactly once, no page over the cap, no update
 * without readings.
 */
Test(flusher, property_random_arrivals_outages_and_clock_jumps) {
    stop();
    cfg.buckets.span_ms = 60000;
    cfg.buckets.max_readings = 4;
    cfg.buckets.max_late_ms = 150000;
    cfg.buckets.max_future_ms = 30000;
    cfg.flush.max_updates = 5;
    cfg.flush.max_delay_ms = 20000;
    cfg.limits.sensor_idle_ms = 5000;
    uint64_t evicted = 0;
    for (uint64_t seed = 1; seed <= 6; seed++) {
        start();
        uint64_t rng = seed * UINT64_C(0x9E3779B97F4A7C15);
        int64_t sent[4] = {0};
        now_ms = bd_now_ns() / MS + 48 * HOUR_MS;
        for (int step = 0; step < 120; step++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            uint32_t r = (uint32_t)(rng >> 32);
            int n = 1 + (int)(r % 7);
            for (int k = 0; k < n; k++) {
                int sensor = (int)((r >> (3 + k)) % 4);
                /* Anywhere in the accepted window: late, out of order, or a little ahead. */
                int64_t age = (int64_t)((r >> (5 + k)) % 170000) - 25000;
                char id[16];
                snprintf(id, sizeof(id), "m,s=%d", sensor);
                accept1(id, step, now_ms - age);
                sent[sensor]++;
            }
            switch (r % 11) {
            case 0:
                fake_script(&fs, FAULT_UNREACHABLE, 0); /* an outage: nothing sent */
                fake_script(&fs, FAULT_UNREACHABLE, 0);
                break;
            case 1:
                fake_script(&fs, FAULT_LOST_REPLY, 0);
                break;
            case 2:
                fs.races = 1;
                break;
            case 3:
                now_ms += 10 * 60000; /* the clock jumps ahead: buckets close, slots go */
                break;
            case 4:
                now_ms -= 3 * 60000; /* and back */
                break;
            default:
                now_ms += 7000;
                break;
            }
            if (r % 3 != 0) {
                /* Part of a flush: drained (held, sent, or failed and waiting for its retry),
                 * idle segments sealed and given back; then idle sensors are evicted. */
                mono += (r >> 20) % 2 ? 1000 * MS : 0;
                for (int k = 0; k < 2; k++) {
                    publish();
                    bd_flusher_step(flusher, mono, now_ms, false);
                }
                bd_sensor_table_sweep(table, now_ms * MS);
            } else {
                cr_assert_gt(run(60), 0, "seed %" PRIu64 " step %d", seed, step);
                for (int i = 0; i < 4; i++) {
                    char id[16];
                    snprintf(id, sizeof(id), "m,s=%d", i);
                    cr_assert_eq(fake_stored(&fs, id), sent[i], "seed %" PRIu64 " step %d", seed,
                                 step);
                }
                cr_assert_leq(fake_max_count(&fs), 4, "seed %" PRIu64 " step %d", seed, step);
            }
        }
        cr_assert_eq(fs.empty_updates, 0);
        cr_assert_eq(STAT(updates_quarantined), 0);
        cr_assert_eq(STAT(writer_conflicts), 0);
        evicted += STAT(sensors_evicted);
        stop();
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "rm -rf %s/*", dir);
        cr_assert_eq(system(cmd), 0);
    }
    cr_assert_gt(evicted, 0, "sensors were evicted and came back");
    start(); /* for teardown */
}

/* ---- draining while a batch is being written ---------------------------------------------- */

Test(flusher, readings_drained_while_a_write_waits_for_its_retry_follow_it_in_order) {
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_sensors(3, 4);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* drained, written, failed */
    cr_assert_eq(fs.bulks, 1);
    int64_t retry = bd_flusher_retry_at(flusher);
    cr_assert_gt(retry, mono);
    /* While the batch waits for its retry, new readings of the same pages are drained (the
     * queues empty) but not written: the failed batch goes first. */
    send_more(3, 5, 4);
    publish();
    bd_flusher_step(flusher, retry - 1, now_ms, false);
    cr_assert_not(bd_sensor_table_has_dirty(table), "drained during the backoff");
    cr_assert_eq(fs.bulks, 1, "nothing written before the retry");
    cr_assert_eq(run(10) > 0, true);
    /* The retry, then the readings drained meanwhile, under the next sequence number. */
    cr_assert_eq(fs.bulks, 3);
    cr_assert_eq(fs.seqs[0], fs.seqs[1], "the retry re-sends the same number");
    cr_assert_eq(fs.seqs[2], fs.seqs[1] + 1, "the next batch takes the next number");
    assert_stored(3, 9);
    cr_assert_eq(STAT(readings_flushed), 27);
    cr_assert_eq(STAT(writer_conflicts), 0);
    cr_assert_eq(STAT(updates_quarantined), 0);
}

Test(flusher, readings_drained_before_and_after_a_look_up_keep_the_page_cap) {
    /* Page 0 was stored by an earlier run with 8 readings; the cap is 10. The batch being
     * written looks the bucket up; readings drained into the next batch before the look-up
     * (page unknown then) and after it (page known) must be placed in arrival order from the
     * learned count: 3 to pages 0-1, then 3, then 8 more -- never past the cap. */
    stop();
    cfg.buckets.max_readings = 10;
    start();
    now_ms = bd_now_ns() / MS; /* inside the horizon: the bucket is looked up */
    int64_t b = now_ms / HOUR_MS * HOUR_MS;
    const char *name = "m,s=0";
    fake_put(&fs, name, b, 0, 8, 5);
    fs.find_fails = true;
    int j = 0;
    for (; j < 3; j++) {
        accept1(name, j, b + j);
    }
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* the look-up fails: pages unknown */
    cr_assert_eq(fs.bulks, 0);
    int64_t retry = bd_flusher_retry_at(flusher);
    cr_assert_gt(retry, 0);
    for (; j < 6; j++) {
        accept1(name, j, b + j);
    }
    publish();
    mono = retry - 1;
    bd_flusher_step(flusher, mono, now_ms, false); /* drained while the pages are unknown */
    fs.find_fails = false;
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    mono = retry;
    bd_flusher_step(flusher, mono, now_ms, false); /* looked up and placed; the write fails */
    cr_assert_eq(fs.bulks, 1);
    retry = bd_flusher_retry_at(flusher);
    for (; j < 14; j++) {
        accept1(name, j, b + j);
    }
    publish();
    mono = retry - 1;
    bd_flusher_step(flusher, mono, now_ms, false); /* drained with the pages known */
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fake_stored(&fs, name), 8 + 14);
    cr_assert_leq(fake_max_count(&fs), 10);
    cr_assert_eq(STAT(updates_quarantined), 0);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

static atomic_bool g_pushed, g_drained_in_flight;

/* Flusher thread, after each drain: did one empty the queues while a bulk was held? */
static void drained_cb(void *arg) {
    (void)arg;
    pthread_mutex_lock(&fs.mu);
    bool holding = fs.holding;
    pthread_mutex_unlock(&fs.mu);
    if (holding && atomic_load(&g_pushed) && !bd_sensor_table_has_dirty(table)) {
        atomic_store(&g_drained_in_flight, true);
    }
}

Test(flusher, the_flusher_thread_drains_while_a_bulk_is_in_flight) {
    stop();
    cfg.flush.interval_ms = 20;
    start();
    now_ms = bd_now_ns() / MS;
    atomic_store(&g_pushed, false);
    atomic_store(&g_drained_in_flight, false);
    bd_flusher_set_drained(flusher, drained_cb, NULL);
    fs.hold = true;
    struct bd_err err = {0};
    cr_assert_eq(bd_flusher_start(flusher, &err), 0, "%s", err.msg);
    send_sensors(3, 4);
    publish();
    bd_flusher_wake(flusher);
    cr_assert(fake_wait_holding(&fs, 20), "the first bulk never came");
    /* The first batch is in flight (held): more readings for the same pages. */
    send_more(3, 5, 4);
    publish();
    atomic_store(&g_pushed, true);
    bd_flusher_wake(flusher);
    int64_t deadline = bd_mono_ns() + 20 * BD_NS_PER_S;
    while (!atomic_load(&g_drained_in_flight) && bd_mono_ns() < deadline) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
        bd_flusher_wake(flusher);
    }
    cr_assert(atomic_load(&g_drained_in_flight), "nothing drained while the bulk was in flight");
    fake_release_hold(&fs);
    bd_flusher_stop(flusher, bd_mono_ns() + 20 * BD_NS_PER_S);
    assert_stored(3, 9);
    cr_assert_geq(fs.bulks, 2);
    for (uint32_t i = 1; i < fs.bulks && i < 256; i++) {
        cr_assert_gt(fs.seqs[i], fs.seqs[i - 1], "bulk %u: sequence numbers in order", i);
    }
    cr_assert_eq(STAT(readings_flushed), 27);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

/* The next reading of sensor i (field v, its count so far as value and milliseconds into the
 * bucket), counted in per_sensor[i] once accepted; bd_sensor_table_accept's result. */
static int accept_next(int i, int64_t start_ms, int64_t *per_sensor) {
    char name[32];
    memset(&pt, 0, sizeof(pt));
    sensor_name(name, sizeof(name), i);
    pt.series_key = S(name);
    pt.name = S(name);
    pt.has_time = true;
    pt.time_ns = (start_ms + per_sensor[i]) * MS;
    pt.n_fields = 1;
    pt.fields[0] = (struct bd_field){.key = S("v"), .kind = BD_VAL_FLOAT};
    pt.fields[0].v.f = (double)per_sensor[i];
    int rc = bd_sensor_table_accept(table, &pt, now_ms * MS);
    per_sensor[i] += rc == 0;
    return rc;
}

/*
 * While MongoDB keeps up, a flood is handed to the writer at the early-write mark (a quarter of
 * the batches' budget), not drained up to the whole budget first: what the fill holds when the writer
 * takes it is at most the mark and one delta, and the rest follows. One reading a page makes a
 * delta of every reading, so that the queues hold more than the budget.
 */
Test(flusher, a_flood_goes_to_the_writer_at_the_early_write_mark_while_mongodb_keeps_up) {
    stop();
    cfg.limits.memory = UINT64_C(2) << 20; /* batches 1 MiB, early-write mark 256 KiB */
    cfg.flush.interval_ms = 600000;        /* memory, not the interval, starts the writes */
    cfg.buckets.max_readings = 1;
    start();
    struct bd_delta one;
    struct bd_reading_value v = {.field = 0, .kind = BD_VAL_FLOAT, .v.f = 1.0};
    bd_delta_init(&one, NULL, 0, 0);
    cr_assert_eq(bd_delta_add(&one, MS, &v, 1), 0);
    uint64_t delta_bytes = bd_delta_bytes(&one);
    bd_delta_close(&one);
    uint64_t mark = cfg.limits.memory / 8;
    uint64_t budget = cfg.limits.memory / 2;
    /* A first write starts the interval. */
    accept1("first", 1, now_ms / HOUR_MS * HOUR_MS);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_flushed), 1);
    mono += MS;

    int64_t start_ms = now_ms / HOUR_MS * HOUR_MS;
    int64_t per_sensor[32] = {0}, accepted = 0;
    char name[32];
    for (bool room = true; room;) {
        room = false;
        for (int i = 0; i < 32; i++) {
            if (accept_next(i, start_ms, per_sensor) == 0) {
                accepted++;
                room = true;
            }
        }
    }
    cr_assert_gt((uint64_t)accepted * delta_bytes, budget, "the queues hold more than the budget");
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    uint64_t first = STAT(readings_flushed) - 1;
    cr_assert_eq(STAT(flushes_for_memory), 1, "written early, for memory");
    cr_assert_gt(first, 0);
    cr_assert_leq(first * delta_bytes, mark + delta_bytes,
                  "the first write took %" PRIu64 " readings of %" PRIu64 " bytes each: more than "
                  "the early-write mark (%" PRIu64 " bytes)",
                  first, delta_bytes, mark);
    cr_assert_gt(run(10000), 0);
    for (int i = 0; i < 32; i++) {
        cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), i)), per_sensor[i],
                     "sensor %d", i);
    }
    cr_assert_eq(STAT(readings_flushed), (uint64_t)accepted + 1);
}

/* ---- the spool ------------------------------------------------------------------------------ */

/* Bytes of the spool's segment files. */
/* A flush interval short enough that the next batch comes due while the first waits for its
 * retry, which is far off: the pattern that sends batches to the spool. */
Test(flusher, the_batches_stop_draining_at_their_memory_budget_and_resume) {
    stop();
    cfg.limits.memory = UINT64_C(2) << 20; /* batches 1 MiB, the pool 1 MiB */
    cfg.flush.interval_ms = 600000;        /* memory, not the interval, starts the writes */
    cfg.flush.retry_initial_ms = 5000;
    cfg.flush.retry_max_ms = 5000;
    cfg.spool.max_bytes = 64; /* no batch fits: they stay in memory */
    cfg.spool.when_full = BD_SPOOL_FULL_BLOCK;
    start();
    /* A first write goes through and starts the interval; then MongoDB is away. */
    fake_script(&fs, FAULT_NONE, 0);
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    accept1("first", 1, now_ms / HOUR_MS * HOUR_MS);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(fake_stored(&fs, "first"), 1);
    int64_t start_ms = now_ms / HOUR_MS * HOUR_MS;
    int64_t accepted = 0;
    int64_t per_sensor[32] = {0};
    bool stalled = false;
    char name[32];
    for (int round = 0; round < 2000 && !stalled; round++) {
        for (int i = 0; i < 32; i++) {
            for (int j = 0; j < 20; j++) {
                sensor_name(name, sizeof(name), i);
                int rc = accept_next(i, start_ms, per_sensor);
                if (rc == -EAGAIN) {
                    break; /* its share of the pool is full: a TCP sender would wait */
                }
                cr_assert_eq(rc, 0, "reading of %s refused: %d", name, rc);
                accepted++;
            }
        }
        publish();
        mono += MS; /* long before the interval */
        bd_flusher_step(flusher, mono, now_ms, false);
        stalled = bd_sensor_table_stalled(table);
    }
    cr_assert(stalled, "never stalled after %lld readings", (long long)accepted);
    cr_assert_geq(STAT(flushes_for_memory), 1, "the first batch was written early");
    cr_assert_eq(fs.sent, 1, "MongoDB took nothing after the first");
    cr_assert_lt(STAT(pending_readings), (uint64_t)accepted, "some wait in their queues");
    cr_assert_eq(STAT(readings_spooled), 0);
    /* MongoDB back. */
    cr_assert_gt(run(5000), 0);
    int64_t stored = 0;
    for (int i = 0; i < 32; i++) {
        int64_t n = fake_stored(&fs, sensor_name(name, sizeof(name), i));
        cr_assert_eq(n, per_sensor[i], "sensor %d: %lld of %lld", i, (long long)n,
                     (long long)per_sensor[i]);
        stored += n;
    }
    cr_assert_eq(stored, accepted);
    cr_assert_eq(STAT(readings_flushed), (uint64_t)accepted + 1);
    cr_assert(!bd_sensor_table_stalled(table), "the stall ended");
    cr_assert_eq(STAT(readings_lost), 0);
    cr_assert_leq(fake_max_count(&fs), cfg.buckets.max_readings);
}

/* ---- holding pages back for more readings (flush.max_delay) --------------------------------- */

/* One reading per sensor per second of wall clock for `seconds`, a step every second. */
static void one_hertz(int sensors, int seconds, int64_t t0_ms) {
    char name[32];
    for (int t = 0; t < seconds; t++) {
        for (int i = 0; i < sensors; i++) {
            accept1(sensor_name(name, sizeof(name), i), t, t0_ms + t * 1000);
        }
        publish();
        now_ms = t0_ms + t * 1000;
        mono += 1000 * MS;
        bd_flusher_step(flusher, mono, now_ms, false);
    }
}

Test(flusher, a_page_is_held_back_until_max_delay_then_written_once) {
    stop();
    cfg.flush.max_delay_ms = 30000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    one_hertz(2, 29, t0);
    cr_assert_eq(fs.bulks, 0, "nothing before 30 s: the readings wait in memory");
    cr_assert_eq(STAT(pending_readings), 58);
    cr_assert_eq(STAT(oldest_pending_age_ms), 28000, "drained at t0, now t0 + 28 s");
    cr_assert_gt(STAT(pool_segments), 0);
    one_hertz(2, 2, t0 + 29000);
    cr_assert_eq(fs.bulks, 1, "one bulk once the oldest reading waited 30 s");
    cr_assert_eq(STAT(updates_sent), 2, "one update per page");
    cr_assert_eq(STAT(readings_flushed), 62, "seconds 0 to 30 of both sensors");
    /* A stop writes what is held. */
    cr_assert_gt(run(5), 0);
    assert_stored(2, 31);
}

Test(flusher, a_page_is_written_early_when_enough_readings_wait) {
    stop();
    cfg.flush.max_delay_ms = 30000;
    cfg.buckets.max_readings = 320; /* 1/32 of it: 10 readings */
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    char name[32];
    for (int j = 0; j < 10; j++) {
        accept1(sensor_name(name, sizeof(name), 0), j, t0 + j);
    }
    accept1(sensor_name(name, sizeof(name), 1), 0, t0); /* a quiet sensor stays held */
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_flushed), 10);
    cr_assert_eq(fake_stored(&fs, sensor_name(name, sizeof(name), 1)), 0);
}

Test(flusher, an_hour_of_a_1hz_sensor_rewrites_at_most_20_bytes_per_byte_stored) {
    stop();
    cfg.flush.max_delay_ms = 30000; /* the defaults: 1 s flushes, 1000-reading pages */
    cfg.flush.interval_ms = 1000;
    cfg.buckets.max_readings = 1000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    one_hertz(3, 3600, t0);
    cr_assert_gt(run(10), 0);
    assert_stored(3, 3600);
    uint64_t stored = 0, rewritten = 0;
    for (uint32_t i = 0; i < fs.n_docs; i++) {
        stored += (uint64_t)fs.docs[i].count;
        rewritten += fs.docs[i].rewritten;
        cr_assert_leq(fs.docs[i].updates, 40, "page %" PRId64 ": %u updates", fs.docs[i].page,
                      fs.docs[i].updates);
    }
    /* In readings; bytes follow (the page header is small next to 1,000 readings). */
    double ratio = (double)rewritten / (double)stored;
    cr_log_info("an hour of 1 Hz: %u pages, rewritten / stored = %.2f", fs.n_docs, ratio);
    cr_assert_leq(ratio, 20.0, "rewritten / stored = %.1f", ratio);
    cr_assert_geq(ratio, 10.0, "held too long (%.1f): readings must show within max_delay", ratio);
}

Test(flusher, an_outage_whose_attempts_outlast_their_backoff_is_spooled_too) {
    /* Server selection blocks longer than the backoff: at every step the retry is already due.
     * The failed batch must still go to the spool once the next batch is due. */
    stop();
    cfg.flush.interval_ms = 10;
    cfg.flush.retry_initial_ms = 1;
    cfg.flush.retry_max_ms = 2;
    start();
    for (int i = 0; i < 20; i++) {
        fake_script(&fs, FAULT_UNREACHABLE, 0);
    }
    send_sensors(2, 3);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* written, failed */
    send_more(2, 2, 3);
    publish();
    mono += 50 * MS; /* past the retry and the interval */
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled), 10, "the failed batch and the next on disk");
    fs.n_faults = fs.next_fault; /* MongoDB back */
    cr_assert_gt(run(10), 0);
    assert_stored(2, 5);
    cr_assert_eq(STAT(writer_conflicts), 0);
}

/* ---- summary documents (summaries.h) ------------------------------------------------------- */

static const struct fake_summary *summary_of(int sensor, int64_t start_ms) {
    char name[32];
    return fake_summary_of(&fs, sensor_name(name, sizeof(name), sensor), start_ms);
}

Test(flusher, written_buckets_have_their_summaries_recomputed_once_per_interval) {
    stop();
    cfg.summaries.interval_ms = 60000;
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    char name[32];
    /* Two sensors, readings in two buckets each. */
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 5; j++) {
            accept1(sensor_name(name, sizeof(name), i), j, t0 - HOUR_MS + j * 1000);
            accept1(sensor_name(name, sizeof(name), i), j, t0 + j * 1000);
        }
    }
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_flushed), 20);
    cr_assert_eq(fs.refresh_calls, 0, "the first round comes an interval after the start");
    cr_assert_eq(STAT(summary_buckets_pending), 4);
    mono += 59000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 59000, false);
    cr_assert_eq(fs.refresh_calls, 0);
    mono += 1000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 60000, false);
    cr_assert_eq(fs.refresh_calls, 1, "one aggregate for the four buckets");
    cr_assert_eq(fs.n_sums, 4);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(summary_of(i, t0)->count, 5);
        cr_assert_eq(summary_of(i, t0 - HOUR_MS)->count, 5);
    }
    cr_assert_eq(STAT(summary_buckets_refreshed), 4);
    cr_assert_eq(STAT(summary_buckets_pending), 0);
    /* More readings for one bucket: only that one is recomputed, at the next round. */
    accept1(sensor_name(name, sizeof(name), 0), 9, t0 + 9000);
    publish();
    mono += 1000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 61000, false);
    cr_assert_eq(fs.refresh_calls, 1, "not before the interval");
    mono += 60000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 121000, false);
    cr_assert_eq(fs.refresh_calls, 2);
    cr_assert_eq(summary_of(0, t0)->count, 6);
    cr_assert_eq(summary_of(0, t0)->refreshes, 2);
    cr_assert_eq(summary_of(1, t0)->refreshes, 1, "an unchanged bucket is not read again");
    cr_assert_eq(STAT(summary_refreshes), 2);
}

Test(flusher, a_failed_summary_refresh_is_tried_again_and_never_delays_readings) {
    stop();
    cfg.summaries.interval_ms = 10000;
    cfg.flush.max_updates = 2; /* buckets per aggregate too */
    start();
    int64_t t0 = now_ms / HOUR_MS * HOUR_MS;
    char name[32];
    for (int i = 0; i < 3; i++) {
        accept1(sensor_name(name, sizeof(name), i), i, t0);
    }
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    fs.refresh_fails = true;
    mono += 10000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 10000, false);
    cr_assert_eq(STAT(summary_refresh_errors), 1);
    cr_assert_eq(STAT(summary_buckets_pending), 3, "kept for the next round");
    /* Readings keep flowing meanwhile. */
    accept1(sensor_name(name, sizeof(name), 3), 3, t0);
    publish();
    mono += 1000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 11000, false);
    cr_assert_eq(STAT(readings_flushed), 4);
    cr_assert_eq(fs.refresh_calls, 1, "not retried before the interval");
    fs.refresh_fails = false;
    /* The next rounds: chunks of flush.max_updates buckets, one chunk per step. */
    for (int s = 0; s < 4; s++) {
        mono += 10000 * MS;
        bd_flusher_step(flusher, mono, now_ms + 21000 + s * 10000, false);
    }
    cr_assert_eq(fs.refresh_max_keys, 2);
    cr_assert_eq(fs.n_sums, 4);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(summary_of(i, t0)->count, 1, "sensor %d", i);
    }
    cr_assert_eq(STAT(summary_buckets_pending), 0);
    cr_assert_eq(STAT(summary_buckets_skipped), 0);
}

/* A stop starts no summary refresh past its deadline (flush.stop_timeout): with aggregates that
 * take 300 ms each and a deadline 400 ms away, what is left of three is counted, not waited for. */
Test(flusher, a_stop_starts_no_summary_refresh_past_its_deadline) {
    stop();
    cfg.summaries.interval_ms = 3600000;
    cfg.flush.max_updates = 1; /* one bucket per aggregate */
    start();
    now_ms = bd_now_ns() / MS;
    fs.refresh_delay_us = 300000;
    struct bd_err err = {0};
    cr_assert_eq(bd_flusher_start(flusher, &err), 0, "%s", err.msg);
    send_sensors(3, 2);
    publish();
    bd_flusher_stop(flusher, bd_mono_ns() + 400 * MS);
    assert_stored(3, 2);
    cr_assert_lt(fs.refresh_calls, 3, "refreshes started past the deadline");
    cr_assert_eq(STAT(summary_buckets_refreshed) + STAT(summary_buckets_skipped), 3);
    cr_assert_geq(STAT(summary_buckets_skipped), 1);
}

Test(flusher, a_stop_recomputes_the_summaries_written_last_without_waiting) {
    stop();
    cfg.summaries.interval_ms = 3600000;
    start();
    send_sensors(3, 4);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fs.n_sums, 3);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(summary_of(i, now_ms / HOUR_MS * HOUR_MS)->count, 4);
    }
    cr_assert_eq(STAT(summary_buckets_pending), 0);
}

Test(flusher, summaries_left_unrefreshed_at_a_stop_are_counted) {
    stop();
    cfg.summaries.interval_ms = 3600000;
    start();
    send_sensors(2, 3);
    fs.refresh_fails = true;
    cr_assert_gt(run(10), 0);
    cr_assert_eq(STAT(readings_flushed), 6, "the readings do not wait for summaries");
    cr_assert_eq(fs.n_sums, 0);
    bd_flusher_free(flusher);
    flusher = NULL;
    cr_assert_eq(STAT(summary_buckets_skipped), 2);
    bd_sensor_table_free(table);
    table = NULL;
    fake_free(&fs);
    start(); /* for the teardown */
}

Test(flusher, summaries_off_sends_no_aggregate) {
    stop();
    cfg.summaries.interval_ms = 0;
    start();
    send_sensors(2, 3);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(fs.refresh_calls, 0);
    cr_assert_eq(STAT(summary_buckets_pending), 0);
}

Test(flusher, spooled_batches_replayed_later_refresh_their_summaries) {
    stop();
    cfg.summaries.interval_ms = 3600000;
    spool_timing();
    start();
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_sensors(2, 3);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* written, failed */
    send_more(2, 2, 3);
    publish();
    mono += 20 * MS;
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_spooled), 10, "both batches on disk");
    cr_assert_gt(run(20), 0);
    assert_stored(2, 5);
    cr_assert_gt(STAT(spool_records_replayed), 0);
    int64_t start_ms = now_ms / HOUR_MS * HOUR_MS;
    cr_assert_eq(summary_of(0, start_ms)->count, 5);
    cr_assert_eq(summary_of(1, start_ms)->count, 5);
}

/* ---- reload (bd_flusher_reconfigure) --------------------------------------------------------- */

static _Atomic uint64_t g_reconfigured_gen;
static atomic_int g_reconfigured_calls;

static void reconfigured_cb(void *arg, uint64_t gen) {
    (void)arg;
    atomic_store(&g_reconfigured_gen, gen);
    atomic_fetch_add(&g_reconfigured_calls, 1);
}

static void watch_reconfigured(void) {
    atomic_store(&g_reconfigured_gen, 0);
    atomic_store(&g_reconfigured_calls, 0);
    bd_flusher_set_reconfigured(flusher, reconfigured_cb, NULL);
}

/* flush.max_updates sizes the arrays a bulk is built in: a reload above the value at start
 * grows them (ASan would see a write past them), one below keeps them. */
Test(flusher, a_reload_is_adopted_at_the_next_step_and_sizes_the_bulks) {
    stop();
    cfg.flush.max_updates = 2;
    start();
    watch_reconfigured();
    struct bd_config next = cfg;
    next.flush.max_updates = 5;
    snprintf(next.mongodb.write_concern, sizeof(next.mongodb.write_concern), "1");
    next.buckets.retention_ms = UINT64_C(720) * HOUR_MS;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 7), 0);
    cr_assert_eq(atomic_load(&g_reconfigured_calls), 0, "taken at a step, not before");
    send_sensors(7, 2);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(atomic_load(&g_reconfigured_calls), 1);
    cr_assert_eq(atomic_load(&g_reconfigured_gen), 7);
    cr_assert_eq(fs.reconfigures, 1, "the store got its part");
    cr_assert_str_eq(fs.write_concern, "1");
    cr_assert_eq(fs.retention_ms, UINT64_C(720) * HOUR_MS);
    cr_assert_eq(fs.bulks, 2);
    cr_assert_eq(fs.bulk_sizes[0], 5);
    cr_assert_eq(fs.bulk_sizes[1], 2);
    assert_stored(7, 2);

    next.flush.max_updates = 3;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 8), 0);
    send_more(7, 1, 2);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(atomic_load(&g_reconfigured_gen), 8);
    cr_assert_eq(fs.bulks, 5);
    cr_assert_eq(fs.bulk_sizes[2], 3);
    cr_assert_eq(fs.bulk_sizes[3], 3);
    cr_assert_eq(fs.bulk_sizes[4], 1);
    assert_stored(7, 3);
    cr_assert_eq(STAT(readings_flushed), 21);
}

/* A hand-over the flusher has not taken yet is replaced by the next: the newest wins. */
Test(flusher, a_second_reload_before_the_step_replaces_the_first) {
    watch_reconfigured();
    struct bd_config next = cfg;
    next.flush.max_updates = 3;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 1), 0);
    next.flush.max_updates = 4;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 2), 0);
    send_sensors(5, 1);
    cr_assert_gt(run(10), 0);
    cr_assert_eq(atomic_load(&g_reconfigured_calls), 1);
    cr_assert_eq(atomic_load(&g_reconfigured_gen), 2);
    cr_assert_eq(fs.bulk_sizes[0], 4);
    cr_assert_eq(fs.bulk_sizes[1], 1);
}

/* A shorter interval counts from the reload, not from the last write under the old one. */
/* A reload that raises flush.max_updates while a bulk the driver refused is being retried: the
 * halved bulk size holds until the batch is settled, then the new one applies. */
Test(flusher, a_reload_during_a_retry_keeps_the_halved_bulk) {
    stop();
    cfg.flush.max_updates = 4;
    start();
    fs.client_max_ops = 2;
    fake_script(&fs, FAULT_UNREACHABLE, 0);
    send_sensors(8, 1);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false); /* 4 of 8 updates: no server */
    cr_assert(!bd_flusher_idle(flusher));
    cr_assert_eq(fs.bulk_sizes[0], 4);
    struct bd_config next = cfg;
    next.flush.max_updates = 8;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 1), 0);
    cr_assert_gt(run(20), 0);
    assert_stored(8, 1);
    cr_assert_eq(fs.bulk_sizes[1], 4, "the retry keeps its bulk size");
    cr_assert_eq(fs.bulk_sizes[2], 2, "halved after the driver's refusal");
    for (uint32_t i = 2; i < fs.bulks; i++) {
        cr_assert_leq(fs.bulk_sizes[i], 2, "bulk %u", i);
    }
    /* Settled: the next batch is sent in bulks of the new size. */
    fs.client_max_ops = 0;
    uint32_t before = fs.bulks;
    send_more(8, 1, 1);
    cr_assert_gt(run(20), 0);
    assert_stored(8, 2);
    cr_assert_eq(fs.bulks, before + 1);
    cr_assert_eq(fs.bulk_sizes[before], 8);
}

Test(flusher, a_shorter_flush_interval_counts_from_the_reload) {
    stop();
    cfg.flush.interval_ms = 3600000;
    start();
    bd_flusher_step(flusher, mono, now_ms, false); /* nothing yet: the next write is in 1 h */
    send_sensors(2, 3);
    publish();
    bd_flusher_step(flusher, mono + 1000 * MS, now_ms + 1000, false);
    cr_assert_eq(fs.bulks, 0, "the hour is not over");
    struct bd_config next = cfg;
    next.flush.interval_ms = 100;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 1), 0);
    bd_flusher_step(flusher, mono + 2000 * MS, now_ms + 2000, false);
    cr_assert_eq(fs.bulks, 0, "100 ms from the reload, not yet");
    bd_flusher_step(flusher, mono + 2100 * MS, now_ms + 2100, false);
    cr_assert_eq(fs.bulks, 1);
    assert_stored(2, 3);
}

Test(flusher, a_reload_turns_summaries_on_and_off) {
    stop();
    cfg.summaries.interval_ms = 0;
    start();
    struct bd_config next = cfg;
    next.summaries.interval_ms = 10000;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 1), 0);
    send_sensors(2, 3);
    publish();
    bd_flusher_step(flusher, mono, now_ms, false);
    cr_assert_eq(STAT(readings_flushed), 6);
    cr_assert_eq(STAT(summary_buckets_pending), 2, "written buckets are marked from the reload on");
    mono += 10000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 10000, false);
    cr_assert_eq(fs.refresh_calls, 1);
    cr_assert_eq(summary_of(0, now_ms / HOUR_MS * HOUR_MS)->count, 3);

    send_more(1, 1, 3);
    publish();
    mono += 1000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 11000, false);
    cr_assert_eq(STAT(summary_buckets_pending), 1);
    next.summaries.interval_ms = 0;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 2), 0);
    mono += 1000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 12000, false);
    cr_assert_eq(STAT(summary_buckets_pending), 0);
    cr_assert_eq(STAT(summary_buckets_skipped), 1, "the bucket left unrefreshed is counted");
    mono += 60000 * MS;
    bd_flusher_step(flusher, mono, now_ms + 72000, false);
    cr_assert_eq(fs.refresh_calls, 1, "no refresh once off");
}

/* The thread: a reload from another thread wakes it, and the flusher runs the new interval. */
Test(flusher, the_flusher_thread_adopts_a_reload_handed_over_by_another_thread) {
    stop();
    cfg.flush.interval_ms = 3600000;
    start();
    now_ms = bd_now_ns() / MS;
    watch_reconfigured();
    struct bd_err err = {0};
    cr_assert_eq(bd_flusher_start(flusher, &err), 0, "%s", err.msg);
    send_sensors(3, 4);
    publish();
    struct bd_config next = cfg;
    next.flush.interval_ms = 20;
    cr_assert_eq(bd_flusher_reconfigure(flusher, &next, 3), 0);
    int64_t deadline = bd_mono_ns() + 20 * BD_NS_PER_S;
    while (STAT(readings_flushed) < 12 && bd_mono_ns() < deadline) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    cr_assert_eq(atomic_load(&g_reconfigured_gen), 3);
    cr_assert_eq(STAT(readings_flushed), 12, "written within the new interval, not the hour");
    bd_flusher_stop(flusher, bd_mono_ns() + 20 * BD_NS_PER_S);
    assert_stored(3, 4);
}
