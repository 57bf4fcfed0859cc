/*
 * The flusher's drain (src/flusher_drain.h): moves the readings of dirty sensors out of their
 * queues into the fill batch's deltas, keyed by (sensor, bucket start, page), pages.h deciding
 * the page of each reading; and the flusher's part in evicting idle sensors. Flusher thread
 * only: it runs at each step and, while a store call is in flight, as the I/O runner's idle work
 * (flusher.c hands it down), touching only the fill batch, the sensor queues and the page slots.
 *
 * Eviction (include/bucketd/sensor.h, and Eviction in src/sensor.c): an evicted sensor is kept
 * until nothing of it is left to write -- no reading in its queue, no delta of a batch not yet
 * settled refers to it -- and then handed back to the ingest thread, which frees it. Nothing it
 * accepted is lost: its last readings are written (or spooled) like any other before it goes.
 * Its page accounting goes with it. A reading of the same series later creates a new sensor
 * whose buckets must not be taken for new: the buckets this one may have written are put behind
 * the look-up horizon, so a bucket up to its newest one has its pages read back from MongoDB
 * before anything is added to it (pages.h), as after a restart.
 *
 * The lowest part but the I/O runner: it calls no other part of the flusher.
 */
#include "flusher_drain.h"

#include "bucketd/bucket.h"
#include "bucketd/pages.h"
#include "flusher_int.h"

/* Readings the deltas may hold before they are written ahead of the interval (~50 MB). */
#define MAX_QUEUED (UINT64_C(1) << 20)

/* An allocation failure interrupted this sensor's drain: it is drained first next time. */
static void requeue(struct bd_flusher *f, struct bd_sensor *s) {
    if (!s->flusher_requeued) {
        s->flusher_requeued = true;
        s->flusher_next = f->drain.requeued;
        f->drain.requeued = s;
    }
}

/* ---- eviction ------------------------------------------------------------------------------ */

/* Whether nothing of s is left to write. A reading still queued is drained first. */
static bool finished(struct bd_flusher *f, struct bd_sensor *s) {
    if (s->flusher_requeued) {
        return false; /* its drain was interrupted: the flusher_drain_requeue list finishes it */
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

static void release_evicted(struct bd_flusher *f, struct bd_sensor *s) {
    struct bd_pages *p = s->flusher_state;
    if (p != NULL) {
        int64_t newest = bd_pages_forgot_max_ms(p, &f->lim);
        for (uint32_t i = 0; i < p->n; i++) {
            newest = BD_MAX(newest, bd_page_slot_start_ms(&p->slot[i], &f->lim));
        }
        f->learn_horizon_ms = BD_MAX(f->learn_horizon_ms, newest);
        bd_pages_free(&f->pages_pool, p);
        s->flusher_state = NULL;
    }
    bd_sensor_table_release(f->table, s);
}

static void evict_step(struct bd_flusher *f) {
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_evicted(f->table)) != NULL) {
        s->evicted_next = f->drain.evicted;
        f->drain.evicted = s;
    }
    struct bd_sensor **link = &f->drain.evicted;
    while ((s = *link) != NULL) {
        if (!finished(f, s)) {
            link = &s->evicted_next;
            continue;
        }
        *link = s->evicted_next;
        s->evicted_next = NULL;
        release_evicted(f, s);
    }
}

void flusher_drain_release_evicted(struct bd_flusher *f) {
    if (f->table == NULL) {
        return;
    }
    struct bd_sensor *s;
    while ((s = bd_sensor_table_next_evicted(f->table)) != NULL) {
        s->evicted_next = f->drain.evicted;
        f->drain.evicted = s;
    }
    while ((s = f->drain.evicted) != NULL) {
        f->drain.evicted = s->evicted_next;
        s->evicted_next = NULL;
        s->flusher_requeued = false; /* the flusher_drain_requeue list dies with the flusher */
        s->flusher_next = NULL;
        BD_ASSERT(s->flusher_refs == 0); /* the batches are closed */
        release_evicted(f, s);
    }
}

/* ---- draining ------------------------------------------------------------------------------ */

/* Slots holding readings of this batch id or later must not be dropped: those of the batch
 * being written while it is pending, else those of the fill batch. */
static uint64_t pinned_from(const struct bd_flusher *f) {
    return bd_batch_pending_readings(&f->batch) > 0 ? f->batch_id : f->fill_id;
}

/*
 * Fairness: while other sensors wait to be drained, one sensor's readings take at most
 * 1/BD_SENSOR_SHARE_DIV of the batches' memory in the fill batch; the rest waits in its queue
 * (whose share of the pool then pauses its TCP connection, sensor.h) and goes into the next
 * batch. Without it a sensor sending faster than MongoDB takes it fills every batch, and the
 * others wait behind it. Alone, a sensor takes what it needs. Kept with the sensor's pages: a
 * reading was just placed, so it has them; zeroed when the fill batch is handed on
 * (flusher_writer_fill_gone).
 */
static bool over_fill_share(struct bd_flusher *f, struct bd_pages *p, uint64_t grew) {
    p->fill_bytes = (uint32_t)BD_MIN(p->fill_bytes + grew, UINT32_MAX);
    return p->fill_bytes >= BD_MIN(f->budget / BD_SENSOR_SHARE_DIV, UINT32_MAX) &&
           bd_sensor_table_has_dirty(f->table);
}

/* The drain stops here: the memory budget, or with to_mark the early-write mark. */
static bool drain_full(const struct bd_flusher *f, bool to_mark) {
    return flusher_over_budget(f) || (to_mark && flusher_drain_fill_large(f));
}

/*
 * Move one sensor's readings into the fill batch. A reading is added whole or not at all: its
 * page is decided on a copy of the bucket's slot, committed only once the reading is in its
 * delta and consumed from the queue. On an allocation failure, or when the batches reach their
 * memory budget, the rest stays in the queue and the sensor on the flusher_drain_requeue list.
 */
static uint64_t drain_sensor(struct bd_flusher *f, struct bd_sensor *s, int64_t wall_ms,
                             bool to_mark) {
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_pages **pp = (struct bd_pages **)&s->flusher_state;
    const uint64_t span = f->cfg->buckets.span_ms;
    /* Sizing each reading costs a strlen per field. When even readings holding every field the
     * sensor has cannot fill a page before max_readings does, they are all charged that upper
     * bound instead: the byte limit cannot be reached, and the count limit decides as before.
     * Once the sensor has more fields than the bound counted, readings are sized exactly (a
     * relaxed load suffices: the reading's fields were published before the reading). The
     * bound and the page overhead are kept with the sensor's pages until its fields change. */
    const uint32_t n_known = atomic_load_explicit(&s->n_fields, memory_order_acquire);
    uint64_t overhead, rb_max;
    if (*pp != NULL && (*pp)->sized_fields == n_known) { /* n_known < BD_PAGES_UNSIZED */
        overhead = (*pp)->overhead_bytes;
        rb_max = (*pp)->reading_max_bytes;
    } else {
        overhead = bd_page_overhead_bytes(s);
        rb_max = bd_reading_bytes_max(s, n_known);
        if (*pp != NULL) {
            /* Names are bounded (pages.h): the sizes fit, else they are not kept. */
            const bool fits =
                overhead <= BD_PAGES_SIZED_OVERHEAD_MAX && rb_max <= BD_PAGES_SIZED_READING_MAX;
            (*pp)->sized_fields = fits ? n_known : BD_PAGES_UNSIZED;
            (*pp)->overhead_bytes = (uint32_t)overhead & BD_PAGES_SIZED_OVERHEAD_MAX;
            (*pp)->reading_max_bytes = (uint32_t)rb_max & BD_PAGES_SIZED_READING_MAX;
        }
    }
    const bool exact = overhead + (uint64_t)f->lim.max_readings * rb_max > f->lim.max_bytes;
    struct bd_page_slot *slot = NULL;
    int64_t di = -1, start = 0, lo_ns = 0, hi_ns = 0; /* slot's bucket: [lo_ns, hi_ns) */
    uint32_t cur_page = 0;
    uint64_t moved = 0;
    int64_t ts;
    uint32_t nv, cells;

    while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
        if (slot == NULL || ts < lo_ns || ts >= hi_ns) {
            start = bd_bucket_start_ms(ts, span);
            slot = bd_pages_slot(&f->pages_pool, pp, &f->lim, start, wall_ms, f->learn_horizon_ms,
                                 pinned_from(f));
            if (slot == NULL) {
                goto fail;
            }
            di = -1;
            lo_ns = start * BD_NS_PER_MS;
            hi_ns = (start + (int64_t)span) * BD_NS_PER_MS;
        }
        /* All or nothing: the slot's counts are put back if the reading cannot be added. */
        const uint32_t was_page = slot->page, was_count = slot->count;
        const uint64_t was_bytes = slot->bytes;
        uint64_t rb = rb_max;
        if (exact || atomic_load_explicit(&s->n_fields, memory_order_relaxed) != n_known) {
            rb = bd_reading_bytes(s, vals, nv);
        }
        uint32_t page = BD_PAGE_UNKNOWN;
        if (slot->known) {
            page = bd_pages_place(slot, &f->lim, rb, overhead);
        } else {
            slot->count++;
            slot->bytes += rb;
        }
        uint32_t had = f->fill.n;
        if (di < 0 || page != cur_page) {
            di = bd_batch_get(&f->fill, s, start, page);
            cur_page = page;
            if (di >= 0 && f->fill.meta[di].first_ms == 0) {
                f->fill.meta[di].first_ms = wall_ms; /* when its oldest reading was drained */
            }
        }
        uint64_t held = di < 0 || f->fill.n > had ? 0 : bd_delta_bytes(&f->fill.deltas[di]);
        if (di < 0 || bd_delta_add(&f->fill.deltas[di], ts, vals, nv) < 0) {
            if (di >= 0) {
                bd_batch_truncate(&f->fill, had); /* a delta created for this reading goes too */
            }
            slot->page = was_page;
            slot->count = was_count;
            slot->bytes = was_bytes;
            goto fail;
        }
        slot->batch = f->fill_id;
        bd_sensor_consume(s, cells);
        /* What the batch holds for it: buffer growth, and a new delta's own struct. */
        uint64_t grew = bd_delta_bytes(&f->fill.deltas[di]) - held;
        f->fill_bytes += grew;
        moved++;
        if (drain_full(f, to_mark) || over_fill_share(f, *pp, grew)) {
            requeue(f, s); /* the rest waits in the queue */
            return moved;
        }
    }
    return moved;
fail:
    flusher_log_oom(f, "while draining a sensor");
    requeue(f, s);
    return moved;
}

/*
 * Drain the sensor queues into the fill batch, until the batches reach their memory budget
 * (then the flusher is "stalled": bd_sensor_table_set_stalled) and ring the doorbell so paused
 * listeners read again. With to_mark the drain also stops once the fill is large, so that the
 * writer takes it at that mark rather than at the whole budget: a flood then holds about a
 * quarter of the budget while MongoDB keeps up, and the whole budget only while writes lag.
 */
bool flusher_drain_run(struct bd_flusher *f, int64_t wall_ms, bool to_mark) {
    evict_step(f);
    bool stalled = flusher_over_budget(f);
    if (!stalled) {
        struct bd_sensor *list = f->drain.requeued, *s;
        f->drain.requeued = NULL;
        while (list != NULL && !drain_full(f, to_mark)) {
            s = list;
            list = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
            f->queued += drain_sensor(f, s, wall_ms, to_mark);
        }
        while (list != NULL) { /* full: the rest stays listed */
            s = list;
            list = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
            requeue(f, s);
        }
        while (!drain_full(f, to_mark) && (s = bd_sensor_table_next_dirty(f->table)) != NULL) {
            f->queued += drain_sensor(f, s, wall_ms, to_mark);
        }
        stalled = flusher_over_budget(f);
    }
    if (stalled != bd_sensor_table_stalled(f->table)) {
        bd_sensor_table_set_stalled(f->table, stalled);
    }
    if (f->drain.drained != NULL) {
        f->drain.drained(f->drain.drained_arg);
    }
    return to_mark && !stalled && flusher_drain_fill_large(f) &&
           (f->drain.requeued != NULL || bd_sensor_table_has_dirty(f->table));
}

/* A quarter of the budget: a write while MongoDB keeps up holds that much, and while one is in
 * flight the fill may take the other three quarters. */
bool flusher_drain_fill_large(const struct bd_flusher *f) {
    return f->queued >= MAX_QUEUED || f->fill_bytes >= f->budget / 4;
}

bool flusher_drain_fill_due(const struct bd_flusher *f, int64_t mono_ns, bool stopping) {
    return f->fill.n > 0 && (stopping || mono_ns >= f->send_at || flusher_drain_fill_large(f));
}
