/*
 * The flusher: its own thread that drains dirty sensors' rings (every flush.interval, and early
 * when a ring crosses its high-water mark), folds the readings into per-bucket deltas and,
 * once per flush.interval, writes them with one unordered bulk of upserts through a pooled
 * mongoc client: one update per bucket page per interval, whatever the ring size.
 * Transient MongoDB failures keep the batch and retry it with exponential backoff and full
 * jitter; while a batch is pending no new readings are drained, so the rings are the bounded
 * buffer and overflow is counted at ingest.
 */
#ifndef BUCKETD_FLUSHER_H
#define BUCKETD_FLUSHER_H

#include "bucketd/config.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

struct bd_flusher;

/* Called on the flusher thread after each drain (main forwards it to the loop with
 * uv_async_send so TCP connections paused by backpressure resume). */
typedef void (*bd_flusher_drained_cb)(void *arg);

/* Parses the URI and write concern and creates the client pool; does not connect yet. */
int bd_flusher_new(struct bd_flusher **out, const struct bd_config *cfg,
                   struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err);
void bd_flusher_set_drained(struct bd_flusher *f, bd_flusher_drained_cb cb, void *arg);
int bd_flusher_start(struct bd_flusher *f, struct bd_err *err);
/* Any thread: flush now instead of at the next interval. */
void bd_flusher_wake(struct bd_flusher *f);
/*
 * Final drain and flush, retried until deadline_mono_ns (bd_mono_ns() clock); joins the thread.
 * Call after ingest has stopped. Readings that could not be written by the deadline are counted
 * in readings_lost and logged.
 */
void bd_flusher_stop(struct bd_flusher *f, int64_t deadline_mono_ns);
void bd_flusher_free(struct bd_flusher *f);

/* Route mongo-c-driver's log lines into bd_log (call once, after mongoc_init). */
void bd_flusher_install_driver_log(void);

#endif
