/*
 * The flusher's part in evicting idle sensors (include/bucketd/sensor.h, and Eviction in
 * src/sensor.c): an evicted sensor is kept until nothing of it is left to write -- no reading in
 * its queue, no delta of a batch not yet settled refers to it -- and then handed back to the
 * ingest thread, which frees it. Nothing it accepted is lost: its last readings are written (or
 * spooled) like any other before it goes.
 *
 * Its page accounting goes with it. A reading of the same series later creates a new sensor
 * whose buckets must not be taken for new: the buckets this one may have written are put behind
 * the look-up horizon, so a bucket up to its newest one has its pages read back from MongoDB
 * before anything is added to it (pages.h), as after a restart. Flusher thread only.
 */
#include "flusher_int.h"

#include "bucketd/pages.h"

/* Whether nothing of s is left to write. A reading still queued is drained first. */
static bool finished(struct bd_flusher *f, struct bd_sensor *s) {
    if (s->flusher_requeued) {
        return false; /* its drain was interrupted: the requeue list finishes it */
    }
    int64_t ts;
    uint32_t nv;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    /* Finding the queue empty also hands back its last (sealed) segment. */
    if (bd_sensor_peek_reading(s, &ts, vals, &nv) > 0) {
        requeue(f, s);
        return false;
    }
    return s->flusher_refs == 0;
}

static void release(struct bd_flusher *f, struct bd_sensor *s) {
    struct bd_pages *p = s->flusher_state;
    if (p != NULL) {
        int64_t newest = p->forgot_max_ms;
        for (uint32_t i = 0; i < p->n; i++) {
            newest = BD_MAX(newest, p->slot[i].start_ms);
        }
        f->learn_horizon_ms = BD_MAX(f->learn_horizon_ms, newest);
        bd_pages_free(p);
        s->flusher_state = NULL;
    }
    bd_sensor_table_release(f->table, s);
}

void flusher_evict_step(struct bd_flusher *f) {
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_evicted(f->table)) != NULL) {
        s->evicted_next = f->evicted;
        f->evicted = s;
    }
    struct bd_sensor **link = &f->evicted;
    while ((s = *link) != NULL) {
        if (!finished(f, s)) {
            link = &s->evicted_next;
            continue;
        }
        *link = s->evicted_next;
        s->evicted_next = NULL;
        release(f, s);
    }
}

void flusher_evict_close(struct bd_flusher *f) {
    if (f->table == NULL) {
        return;
    }
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_evicted(f->table)) != NULL) {
        s->evicted_next = f->evicted;
        f->evicted = s;
    }
    while ((s = f->evicted) != NULL) {
        f->evicted = s->evicted_next;
        s->evicted_next = NULL;
        s->flusher_requeued = false; /* the requeue list dies with the flusher */
        s->flusher_next = NULL;
        BD_ASSERT(s->flusher_refs == 0); /* the batches are closed */
        release(f, s);
    }
}
