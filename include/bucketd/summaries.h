/*
 * Summary documents for dashboards: one small document per sensor and bucket in the summary
 * collection (summaries.collection), holding the bucket's totals over all its pages -- count,
 * pages, and min / max / sum / count / avg per numeric field -- so that reading a month of
 * hourly figures touches a few hundred bytes per hour instead of whole pages of readings.
 *
 * A summary is derived data: it is recomputed on the server from the bucket's pages (their
 * `summary` and `count`) by one aggregate ending in $merge, never folded in by increments. A
 * refresh is therefore idempotent: it can be repeated, lost, or run by two daemons, and the next
 * one makes the document right again; no reading can be counted twice in it, and it needs no
 * writer sequence of its own. Its price is that the server reads the bucket's pages again at
 * each refresh; at most once per summaries.interval per bucket, and only for buckets whose
 * pages were written since the last one.
 *
 * This module keeps the set of buckets due a refresh; the aggregate is queries.h's, and the
 * store (store.h: refresh_summaries) runs it. A refresh round takes every bucket marked so far
 * (bd_summaries_begin) and works through them in chunks; buckets marked meanwhile wait for the
 * next round, so a page written while its bucket's refresh was in flight is never missed.
 * Flusher thread only.
 */
#ifndef BUCKETD_SUMMARIES_H
#define BUCKETD_SUMMARIES_H

#include <stdint.h>

/* struct bd_page_key; the aggregate that refreshes a summary is bd_queries_summaries_pipeline. */
#include "bucketd/queries.h"

struct bd_summaries;

int bd_summaries_new(struct bd_summaries **out);
/* NULL is a no-op. */
void bd_summaries_free(struct bd_summaries *s);

/* The bucket (sensor_id, start_ms) had a page written: refresh its summary in the next round.
 * Marking one already marked is a no-op. -ENOMEM leaves the set as it was. */
int bd_summaries_mark(struct bd_summaries *s, const char *sensor_id, int64_t start_ms);

/* Buckets marked and waiting for a round, and those of the round under way. */
uint32_t bd_summaries_waiting(const struct bd_summaries *s);
uint32_t bd_summaries_in_round(const struct bd_summaries *s);

/* Start a round with every bucket marked, unless one is under way. Returns the buckets left in
 * the round. */
uint32_t bd_summaries_begin(struct bd_summaries *s);

/* The next chunk of the round: up to max keys (pointing into the set; valid until the next call
 * of any function here). Returns how many (0: the round is over). */
uint32_t bd_summaries_next(struct bd_summaries *s, struct bd_page_key *keys, uint32_t max);

/* The chunk of n keys just returned by bd_summaries_next was refreshed. */
void bd_summaries_advance(struct bd_summaries *s, uint32_t n);

/* The round stops (a refresh failed): its buckets not refreshed yet are marked again, for the
 * next round. Returns how many could not be kept (out of memory; their summaries stay as they
 * are until their buckets are written again). */
uint32_t bd_summaries_requeue(struct bd_summaries *s);

#endif
