/*
 * Flusher thread: drains dirty sensors into the pending batch and writes it through the store.
 *
 * Threads: everything in struct bd_flusher below the "flusher thread only" line is touched by
 * the flusher thread alone (or by a unit test driving bd_flusher_step on a flusher it never
 * started); the mutex/condition variable pair is the doorbell from the other threads (wake,
 * stop).
 *
 * Whenever woken (the interval, the pool past its wake-up mark), and all the while a store call
 * runs on the I/O thread: pop every dirty sensor and move its readings out of its queue into
 * the fill batch's deltas, keyed by (sensor, bucket start, page); pages.h says which page each
 * reading goes to. Once per flush.interval, when the batch being written is settled, the fill
 * batch becomes the one written, in unordered bulks of at most flush.max_updates upserts. A
 * delta leaves the pending set when MongoDB acknowledged it, it proved already applied, or it
 * was quarantined (counted, logged, kept in the dead-letter file). While anything is pending,
 * the batch is retried after a backoff, and the next batch waits: a page never receives a later
 * batch's update before an earlier one is settled (see swap_in_fill).
 *
 * What the I/O thread and this thread share: a store call reads the batch being written (its
 * built updates, and its deltas in the look-up callbacks); the drain meanwhile writes only the
 * fill batch, the sensors' queues and their page slots. Settling, which moves readings between
 * pages and slots, runs after the call returned. A slot that the batch being written still has
 * readings in is pinned (pinned_from) so the drain cannot reuse it. A bucket whose pages were
 * unknown when its readings were drained into the fill batch is placed right after the batch
 * being written learns it (learn_chunk), before any later reading is placed from the slot.
 *
 * What each update's answer means is outcome.h's job; what the flusher does with it:
 *   applied      settled;
 *   not_sent, retry   sent again with the next attempt, unbounded (an outage or a failover);
 *   ambiguous    sent again; marked maybe_applied;
 *   duplicate    the page is read back: it holds our sequence number or a later one -> applied
 *                if an attempt may have reached the server, else another daemon uses this
 *                writer_id (writer_conflicts, quarantined); a lower number or none -> another
 *                writer's insert raced ours: sent again (bounded);
 *   too_large    the readings move to new pages after the bucket's last one (an update of one
 *                reading that is still too large is quarantined);
 *   refused      sent again up to MAX_REFUSALS times with backoff, then quarantined;
 *   permanent    quarantined;
 *   config       like retry (the operator fixes the deployment; the retry's log carries the
 *                bulk's message, which says what to fix).
 * Every update is built under BD_UPDATE_MAX_BYTES (a larger one is split before it is sent), so
 * the driver's client-side size refusal is a safety net: the bulk is then halved until the
 * refused update is alone, and that one is treated as too large.
 *
 * Exactly once: each batch takes one number from the writer sequence (writer.h) and every
 * update carries it (bucket.c). A retry re-sends the same updates with the same number, so an
 * update MongoDB applied before its reply was lost comes back as duplicate key (11000), and the
 * read-back above tells it from a race or a conflict.
 */
#include "bucketd/flusher.h"

#include "flusher_int.h"

#include <errno.h>
#include <inttypes.h>
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/alloc.h"
#include "bucketd/batch.h"
#include "bucketd/bucket.h"
#include "bucketd/deadletter.h"
#include "bucketd/escape.h"
#include "bucketd/io.h"
#include "bucketd/log.h"
#include "bucketd/outcome.h"
#include "bucketd/pages.h"
#include "bucketd/settle.h"
#include "bucketd/storecall.h"
#include "bucketd/writer.h"

static void driver_log(mongoc_log_level_t level, const char *domain, const char *message,
                       void *data) {
    (void)data;
    switch (level) {
    case MONGOC_LOG_LEVEL_ERROR:
    case MONGOC_LOG_LEVEL_CRITICAL:
        bd_error("mongoc[%s]: %s", domain, message);
        break;
    case MONGOC_LOG_LEVEL_WARNING:
        bd_warn("mongoc[%s]: %s", domain, message);
        break;
    default:
        bd_debug("mongoc[%s]: %s", domain, message);
        break;
    }
}

void bd_flusher_install_driver_log(void) {
    mongoc_log_set_handler(driver_log, NULL);
}

static void report_previous_run(const struct bd_flusher *f) {
    const struct bd_writer_prev *p = bd_writer_previous(f->writer);
    if (!p->found) {
        bd_info("no writer state in %s: the flush sequence of writer %s will be read from the "
                "bucket documents before the first write",
                f->cfg->spool.dir, f->cfg->writer_id);
    } else if (!p->clean) {
        char when[64] = "never";
        if (p->last_ack_ms > 0) {
            time_t t = (time_t)(p->last_ack_ms / 1000);
            struct tm tm;
            gmtime_r(&t, &tm);
            strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
        }
        bd_warn("the previous run of writer %s did not stop cleanly (killed or crashed): "
                "readings it accepted after its last acknowledged write (at or up to a "
                "minute after %s) and before it ended were lost; nothing it wrote will be "
                "written twice",
                p->writer_id, when);
    }
}

static int open_writer(struct bd_flusher *f, struct bd_err *err) {
    int rc = bd_writer_open(&f->writer, f->cfg->spool.dir, f->cfg->writer_id, err);
    if (rc < 0) {
        return rc;
    }
    f->seq_known = bd_writer_previous(f->writer)->found;
    int64_t horizon = bd_now_ns() / BD_NS_PER_MS + (int64_t)f->cfg->buckets.max_future_ms;
    f->learn_horizon_ms = BD_MAX(horizon, bd_writer_max_bucket_start(f->writer));
    report_previous_run(f);
    return 0;
}

/* Everything but the store; a NULL store means the blackhole sink. */
static int setup(struct bd_flusher *f, const struct bd_config *cfg, struct bd_sensor_table *table,
                 struct bd_stats *stats, struct bd_err *err) {
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    /* Its own copy: the caller's may change under a reload (see cfg_own). */
    f->cfg_own = bd_malloc(sizeof(*f->cfg_own));
    if (f->cfg_own == NULL) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    *f->cfg_own = *cfg;
    f->cfg = cfg = f->cfg_own;
    f->table = table;
    f->stats = stats;
    f->rng = (uint64_t)bd_now_ns() | 1;
    f->clean_stop = true; /* a daemon that fails before the thread starts accepted nothing */
    f->batch_id = 1;
    f->fill_id = 2;
    f->budget = cfg->limits.memory / 2;
    f->chunk_max = cfg->flush.max_updates;
    f->lim = (struct bd_pages_limits){.span_ms = cfg->buckets.span_ms,
                                      .max_late_ms = cfg->buckets.max_late_ms,
                                      .max_future_ms = cfg->buckets.max_future_ms,
                                      .max_readings = cfg->buckets.max_readings,
                                      .max_bytes = cfg->buckets.max_bytes};
    bd_settle_init(&f->settle);
    f->settle.store = f->store;
    f->settle.run = flusher_run_io;
    f->settle.run_arg = f;
    f->settle.stats = stats;
    f->settle.cfg = cfg;
    f->spool_log = (struct bd_ratelimit){.interval_ns = 10 * BD_NS_PER_S, .burst = 2};
    snprintf(f->writer_key, sizeof(f->writer_key), BD_WRITER_KEY_PREFIX "%s", cfg->writer_id);
    if (flusher_chunk_alloc(f, cfg->flush.max_updates) < 0 || bd_batch_init(&f->batch) < 0 ||
        bd_batch_init(&f->fill) < 0) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    return 0;
}

static int open_state(struct bd_flusher *f, struct bd_err *err) {
    /* The spool first: it creates spool.dir (with its parents), where the rest lives too. */
    int rc = flusher_spool_open(f, err);
    if (rc == 0) {
        rc = open_writer(f, err);
    }
    if (rc == 0) {
        rc = bd_deadletter_open(&f->dead, f->cfg->spool.dir, err);
        f->settle.dead = f->dead;
    }
    if (rc == 0) {
        rc = flusher_summaries_open(f, err);
    }
    return rc;
}

int bd_flusher_new_with_store(struct bd_flusher **out, const struct bd_config *cfg,
                              struct bd_sensor_table *table, struct bd_stats *stats,
                              struct bd_store *store, struct bd_err *err) {
    int rc = 0;
    struct bd_flusher *f = bd_calloc(1, sizeof(*f));
    if (f == NULL) {
        bd_store_free(store);
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    f->store = store;
    rc = setup(f, cfg, table, stats, err);
    if (rc == 0) {
        rc = open_state(f, err);
    }
    if (rc == 0) {
        *out = f;
        f = NULL;
    }
    bd_flusher_free(f);
    return rc;
}

int bd_flusher_new(struct bd_flusher **out, const struct bd_config *cfg,
                   struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err) {
    if (cfg->sink == BD_SINK_MONGODB) {
        char key[160];
        struct bd_store *store = NULL;
        snprintf(key, sizeof(key), BD_WRITER_KEY_PREFIX "%s", cfg->writer_id);
        int rc = bd_store_mongo_new(&store, cfg, key, err);
        if (rc < 0) {
            return rc;
        }
        return bd_flusher_new_with_store(out, cfg, table, stats, store, err);
    }
    int rc = 0;
    struct bd_flusher *f = bd_calloc(1, sizeof(*f));
    if (f == NULL) {
        return bd_err_set(err, -ENOMEM, "flusher: out of memory");
    }
    rc = setup(f, cfg, table, stats, err);
    if (rc == 0) {
        *out = f;
        f = NULL;
    }
    bd_flusher_free(f);
    return rc;
}

void bd_flusher_set_drained(struct bd_flusher *f, bd_flusher_drained_cb cb, void *arg) {
    f->drained = cb;
    f->drained_arg = arg;
}

static void release_sensor_state(struct bd_sensor *s, void *arg) {
    (void)arg;
    bd_pages_free(s->flusher_state);
    s->flusher_state = NULL;
    s->flusher_next = NULL;
    s->flusher_requeued = false;
}

void bd_flusher_free(struct bd_flusher *f) {
    if (f == NULL) {
        return;
    }
    BD_ASSERT(!f->started);
    bd_batch_close(&f->batch);
    bd_batch_close(&f->fill);
    flusher_chunk_free(f);
    bd_writer_close(f->writer, f->clean_stop);
    bd_deadletter_close(f->dead);
    flusher_spool_close(f);
    flusher_summaries_close(f, "the stop");
    flusher_evict_close(f);
    if (f->table != NULL) {
        bd_sensor_table_foreach(f->table, release_sensor_state, NULL);
    }
    bd_store_free(f->store);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f->cfg_next);
    free(f->cfg_own);
    free(f);
}

void bd_flusher_wake(struct bd_flusher *f) {
    pthread_mutex_lock(&f->mu);
    f->wake_pending = true;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    /* A write in flight: drain meanwhile (f->io is set before the thread starts). */
    bd_io_poke(f->io);
}

void bd_flusher_seed(struct bd_flusher *f, uint64_t seed) {
    f->rng = seed | 1;
}

int64_t bd_flusher_retry_at(const struct bd_flusher *f) {
    return f->retry_at;
}

static void log_oom(struct bd_flusher *f, const char *what) {
    bd_settle_log_oom(&f->settle, what);
}

/* ---- draining ---------------------------------------------------------------------------- */

/* An allocation failure interrupted this sensor's drain: it is drained first next time. */
void requeue(struct bd_flusher *f, struct bd_sensor *s) {
    if (!s->flusher_requeued) {
        s->flusher_requeued = true;
        s->flusher_next = f->requeued;
        f->requeued = s;
    }
}

/* Slots holding readings of this batch id or later must not be dropped: those of the batch
 * being written while it is pending, else those of the fill batch. */
static uint64_t pinned_from(const struct bd_flusher *f) {
    return bd_batch_pending_readings(&f->batch) > 0 ? f->batch_id : f->fill_id;
}

/* The two batches' readings have reached their half of limits.memory: draining stops. */
bool over_budget(const struct bd_flusher *f) {
    return f->batch_bytes + f->fill_bytes >= f->budget;
}

/*
 * Fairness: while other sensors wait to be drained, one sensor's readings take at most
 * 1/BD_SENSOR_SHARE_DIV of the batches' memory in the fill batch; the rest waits in its queue
 * (whose share of the pool then pauses its TCP connection, sensor.h) and goes into the next
 * batch. Without it a sensor sending faster than MongoDB takes it fills every batch, and the
 * others wait behind it. Alone, a sensor takes what it needs.
 */
static bool over_fill_share(struct bd_flusher *f, struct bd_sensor *s, uint64_t grew) {
    if (s->flusher_fill_id != f->fill_id) {
        s->flusher_fill_id = f->fill_id;
        s->flusher_fill_bytes = 0;
    }
    s->flusher_fill_bytes += grew;
    return s->flusher_fill_bytes >= f->budget / BD_SENSOR_SHARE_DIV &&
           bd_sensor_table_has_dirty(f->table);
}

/*
 * Move one sensor's readings into the fill batch. A reading is added whole or not at all: its
 * page is decided on a copy of the bucket's slot, committed only once the reading is in its
 * delta and consumed from the queue. On an allocation failure, or when the batches reach their
 * memory budget, the rest stays in the queue and the sensor on the requeue list.
 */
static uint64_t drain_sensor(struct bd_flusher *f, struct bd_sensor *s, int64_t wall_ms) {
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
    if (*pp != NULL && (*pp)->sized_fields == n_known) {
        overhead = (*pp)->overhead_bytes;
        rb_max = (*pp)->reading_max_bytes;
    } else {
        overhead = bd_page_overhead_bytes(s);
        rb_max = bd_reading_bytes_max(s, n_known);
        if (*pp != NULL) {
            (*pp)->sized_fields = n_known;
            (*pp)->overhead_bytes = overhead;
            (*pp)->reading_max_bytes = rb_max;
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
            slot = bd_pages_slot(pp, &f->lim, start, wall_ms, f->learn_horizon_ms, pinned_from(f));
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
        if (over_budget(f) || over_fill_share(f, s, grew)) {
            requeue(f, s); /* the rest waits in the queue */
            return moved;
        }
    }
    return moved;
fail:
    log_oom(f, "while draining a sensor");
    requeue(f, s);
    return moved;
}

/*
 * Drain the sensor queues into the fill batch, until the batches reach their memory budget
 * (then the flusher is "stalled": bd_sensor_table_set_stalled) and ring the doorbell so paused
 * listeners read again.
 */
void flusher_drain(struct bd_flusher *f, int64_t wall_ms) {
    flusher_evict_step(f);
    bool stalled = over_budget(f);
    if (!stalled) {
        struct bd_sensor *list = f->requeued, *s;
        f->requeued = NULL;
        while (list != NULL && !over_budget(f)) {
            s = list;
            list = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
            f->queued += drain_sensor(f, s, wall_ms);
        }
        while (list != NULL) { /* over budget: the rest stays listed */
            s = list;
            list = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
            requeue(f, s);
        }
        while (!over_budget(f) && (s = bd_sensor_table_next_dirty(f->table)) != NULL) {
            f->queued += drain_sensor(f, s, wall_ms);
        }
        stalled = over_budget(f);
    }
    if (stalled != bd_sensor_table_stalled(f->table)) {
        bd_sensor_table_set_stalled(f->table, stalled);
    }
    if (f->drained != NULL) {
        f->drained(f->drained_arg);
    }
}

/* Idle work while a store call runs on the I/O thread: keep draining. */
static void drain_now(void *arg) {
    struct bd_flusher *f = arg;
    flusher_drain(f, bd_now_ns() / BD_NS_PER_MS);
}

/*
 * Make a store call on the I/O thread (inline without one) and keep draining into the fill
 * batch until it returns. The call reads only the batch being written (and the callbacks' own
 * state); draining touches only the fill batch, the sensor queues and the page slots, which
 * nothing in a call reads.
 */
void flusher_run_io(void *arg, bd_io_fn fn, void *fn_arg) {
    struct bd_flusher *f = arg;
    int64_t idle_ns = BD_MIN((int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS, 100 * BD_NS_PER_MS);
    bd_io_run(f->io, fn, fn_arg, drain_now, f, idle_ns);
}

static bool call_store(struct bd_flusher *f, struct bd_store_call *c) {
    return bd_store_call(f->store, flusher_run_io, f, c);
}

/* ---- pages ------------------------------------------------------------------------------- */

/* How the readings of a delta get their pages again. */
enum place_mode {
    PLACE_LEARNED,  /* the bucket's stored pages were just read back */
    PLACE_RELOCATE, /* the current page cannot take them: start after it */
    PLACE_KNOWN,    /* the slot just became known: continue from it */
};

/*
 * Put the readings [keep, n) of delta di of batch b on pages from its bucket's slot: after a
 * look-up (learned page/count/bytes), on new pages after the bucket's last one, or from a slot
 * that a look-up for the other batch just made known. All or nothing: the target deltas are
 * created and given room first, then the readings move (which cannot fail), then the slot is
 * updated. -ENOMEM leaves everything as it was.
 */
static int place_readings(struct bd_flusher *f, struct bd_batch *b, uint32_t di, uint32_t keep,
                          enum place_mode mode, uint32_t page, uint32_t count, uint64_t bytes) {
    const uint64_t id = b == &f->batch ? f->batch_id : f->fill_id;
    struct bd_delta *d = &b->deltas[di];
    struct bd_sensor *s = d->sensor;
    const int64_t start = d->start_ms;
    const uint32_t n = d->n_readings;
    struct bd_page_slot *slot = bd_pages_find(s->flusher_state, start);
    BD_ASSERT(slot != NULL); /* a slot with readings in the pending batch is never dropped */
    struct bd_page_slot next = *slot;
    if (mode == PLACE_LEARNED) {
        bd_pages_learn(&next, page, count, bytes);
    } else if (mode == PLACE_RELOCATE) {
        bd_pages_close_page(&next);
    }
    const uint64_t overhead = bd_page_overhead_bytes(s);
    uint32_t *first = bd_malloc((size_t)(n - keep + 1) * sizeof(*first));
    uint32_t *pages = bd_malloc((size_t)(n - keep + 1) * sizeof(*pages));
    int64_t *target = bd_malloc((size_t)(n - keep + 1) * sizeof(*target));
    uint32_t groups = 0, had = b->n;
    int rc = 0;
    if (first == NULL || pages == NULL || target == NULL) {
        rc = -ENOMEM;
        goto out;
    }
    /* Runs of consecutive readings on one page: pages only grow as readings are placed. */
    for (uint32_t i = keep; i < n; i++) {
        const struct bd_delta_reading *r = &d->readings[i];
        uint32_t p = bd_pages_place(&next, &f->lim, bd_reading_bytes(s, &d->values[r->first], r->n),
                                    overhead);
        if (groups == 0 || pages[groups - 1] != p) {
            first[groups] = i;
            pages[groups] = p;
            groups++;
        }
    }
    for (uint32_t g = 0; g < groups; g++) {
        target[g] = bd_batch_get(b, s, start, pages[g]);
        if (target[g] < 0) {
            rc = -ENOMEM;
            goto out;
        }
        BD_ASSERT((uint32_t)target[g] != di);
    }
    d = &b->deltas[di]; /* bd_batch_get may have moved it */
    for (uint32_t g = 0; g < groups; g++) {
        uint32_t end = g + 1 < groups ? first[g + 1] : n;
        uint32_t values =
            (end < n ? d->readings[end].first : d->n_values) - d->readings[first[g]].first;
        if (bd_delta_reserve(&b->deltas[target[g]], end - first[g], values) < 0) {
            rc = -ENOMEM;
            goto out;
        }
    }
    for (uint32_t g = groups; g-- > 0;) {
        int moved = bd_delta_split(d, first[g], &b->deltas[target[g]]);
        BD_ASSERT(moved == 0); /* room was made above */
        /* Readings moved for their size keep their count of refusals, so a page that MongoDB
         * refuses whatever its size cannot move them on forever. */
        struct bd_batch_meta *tm = &b->meta[target[g]];
        tm->refusals = BD_MAX(tm->refusals, b->meta[di].refusals);
    }
    /* The fill batch may have placed readings here already: its id stays. */
    next.batch = BD_MAX(next.batch, id);
    *slot = next;
    if (d->n_readings == 0) {
        b->meta[di].done = true;
    }
out:
    if (rc < 0) {
        bd_batch_truncate(b, had);
    }
    free(first);
    free(pages);
    free(target);
    return rc;
}

/* ---- settling ----------------------------------------------------------------------------- */

/* The settle engine's view of the batch being written. */
static void delta_get(void *arg, uint32_t di, struct bd_settle_upd *u) {
    const struct bd_flusher *f = arg;
    const struct bd_delta *d = &f->batch.deltas[di];
    const struct bd_batch_meta *m = &f->batch.meta[di];
    *u = (struct bd_settle_upd){.sensor_id = d->sensor->id,
                                .start_ms = d->start_ms,
                                .page = d->page,
                                .n_readings = d->n_readings,
                                .done = m->done,
                                .maybe_applied = m->maybe_applied,
                                .refusals = m->refusals,
                                .dup_checks = m->dup_checks};
}

static void delta_put(void *arg, uint32_t di, const struct bd_settle_upd *u) {
    struct bd_batch_meta *m = &((struct bd_flusher *)arg)->batch.meta[di];
    m->done = u->done;
    m->maybe_applied = u->maybe_applied;
    m->refusals = u->refusals;
    m->dup_checks = u->dup_checks;
}

static int delta_relocate(void *arg, uint32_t di, uint32_t keep) {
    struct bd_flusher *f = arg;
    return place_readings(f, &f->batch, di, keep, PLACE_RELOCATE, 0, 0, 0);
}

static struct bd_settle_host batch_host(struct bd_flusher *f) {
    return (struct bd_settle_host){.arg = f,
                                   .get = delta_get,
                                   .put = delta_put,
                                   .relocate = delta_relocate,
                                   .seq = f->batch_seq,
                                   .what = ""};
}

/* ---- writing ------------------------------------------------------------------------------ */

void note_failure(struct bd_flusher *f, enum bd_bulk_cause cause, const char *msg) {
    f->last_cause = cause;
    snprintf(f->last_error, sizeof(f->last_error), "%s", msg);
    if (cause == BD_CAUSE_UNREACHABLE || cause == BD_CAUSE_CONNECTION) {
        bd_stats_mongodb_failed(f->stats);
    }
}

/*
 * Build the update of delta di into chunk position n. 0: built; 1: not to be sent now (it was
 * split, and its readings will come round again, or quarantined); -ENOMEM.
 */
int build_one(struct bd_flusher *f, uint32_t di, uint32_t n, int64_t wall_ms) {
    for (;;) {
        struct bd_delta *d = &f->batch.deltas[di];
        bson_t *sel = &f->selectors[n], *upd = &f->updates[n];
        int rc = bd_delta_build_update(d, f->cfg->buckets.span_ms, f->writer_key, f->batch_seq, sel,
                                       upd);
        if (rc == 0 && (uint64_t)sel->len + upd->len <= BD_UPDATE_MAX_BYTES) {
            return 0;
        }
        if (rc == 0) {
            /* Too large as built: split it before anything is sent. */
            bool alone = d->n_readings == 1;
            const struct bd_settle_host host = batch_host(f);
            rc = bd_settle_shrink(&f->settle, &host, di, 10334,
                                  "the update of one reading is larger than MongoDB's 16 MiB "
                                  "document limit",
                                  sel, upd, wall_ms);
            bson_destroy(sel);
            bson_destroy(upd);
            if (rc < 0) {
                return rc;
            }
            if (alone) {
                return 1;
            }
            continue; /* the first half, built again */
        }
        bson_destroy(sel);
        bson_destroy(upd);
        return rc;
    }
}

/*
 * Send the chunk f->ops[0..n) (built in f->selectors/updates) and settle it. Returns the cause
 * of a failure, BD_CAUSE_NONE if every update applied.
 */
static enum bd_bulk_cause send_chunk(struct bd_flusher *f, uint32_t n, int64_t wall_ms) {
    struct bd_bulk_outcome bulk;
    for (uint32_t i = 0; i < n; i++) {
        f->sel_ptrs[i] = &f->selectors[i];
        f->upd_ptrs[i] = &f->updates[i];
    }
    const struct bd_settle_host host = batch_host(f);
    const struct bd_settle_chunk chunk = {.n = n,
                                          .items = f->ops,
                                          .filters = f->sel_ptrs,
                                          .updates = f->upd_ptrs,
                                          .outcomes = f->outcomes,
                                          .readback = f->readback};
    enum bd_bulk_cause cause =
        bd_settle_send(&f->settle, &host, &chunk, &f->chunk_max, &bulk, wall_ms);
    if (cause != BD_CAUSE_NONE) {
        note_failure(f, cause, bulk.message);
    }
    for (uint32_t i = 0; i < n; i++) {
        bson_destroy(&f->selectors[i]);
        bson_destroy(&f->updates[i]);
    }
    return cause;
}

/* A store call before a batch's first write failed: log (rate-limited) what. */
static void log_lookup_failure(struct bd_flusher *f, const char *what, const char *msg) {
    if (bd_ratelimit_ok(&f->settle.fail_log, bd_mono_ns())) {
        bd_error("%s failed (%s); keeping %" PRIu64 " readings and retrying with backoff", what,
                 msg, bd_batch_pending_readings(&f->batch));
    }
}

/* Raise the sequence above a number found in the collection; false if it cannot be saved. */
static bool raise_sequence(struct bd_flusher *f, uint64_t seen) {
    struct bd_err err = {0};
    if (bd_writer_raise(f->writer, seen, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    return true;
}

/*
 * Without a writer state on disk (first start, or the spool directory was lost) the sequence
 * must continue above the highest number this writer id left in the collection, or the filter
 * would refuse its first updates.
 */
static bool recover_sequence(struct bd_flusher *f) {
    uint64_t seen = 0;
    bson_error_t berr;
    if (f->seq_known) {
        return true;
    }
    struct bd_store_call call = {.kind = BD_CALL_MAX_SEQ, .seq = &seen, .error = &berr};
    if (!call_store(f, &call)) {
        note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        log_lookup_failure(f, "MongoDB sequence look-up", berr.message);
        return false;
    }
    if (!raise_sequence(f, seen)) {
        return false;
    }
    f->seq_known = true;
    bd_info("writer %s: flush sequence continues above %" PRIu64 " (highest in %s.%s)",
            f->cfg->writer_id, seen, f->cfg->mongodb.database, f->cfg->mongodb.collection);
    return true;
}

/* One unknown delta and the last page its bucket already has in MongoDB. */
struct learn_item {
    const char *sensor_id;
    int64_t start_ms;
    uint32_t delta;
    uint32_t page;
    uint32_t count; /* UINT32_MAX: no page found */
};

static int cmp_learn_key(const struct learn_item *x, const char *sensor_id, int64_t start_ms) {
    if (x->start_ms != start_ms) {
        return x->start_ms < start_ms ? -1 : 1;
    }
    return strcmp(x->sensor_id, sensor_id);
}

static int cmp_learn(const void *a, const void *b) {
    const struct learn_item *y = b;
    return cmp_learn_key(a, y->sensor_id, y->start_ms);
}

struct learn_ctx {
    struct learn_item *items;
    uint32_t n;
    uint64_t max_seq;
};

/* Fold one returned page into its item: the highest page wins. */
static void learn_page(void *arg, const struct bd_page_info *info) {
    struct learn_ctx *c = arg;
    c->max_seq = BD_MAX(c->max_seq, info->writer_seq);
    uint32_t lo = 0, hi = c->n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int cmp = cmp_learn_key(&c->items[mid], info->sensor_id, info->start_ms);
        if (cmp == 0) {
            struct learn_item *item = &c->items[mid];
            if (info->page < BD_PAGE_UNKNOWN &&
                (item->count == UINT32_MAX || (uint32_t)info->page > item->page ||
                 ((uint32_t)info->page == item->page && (uint64_t)info->count > item->count))) {
                item->page = (uint32_t)info->page;
                item->count = (uint32_t)BD_MAX(0, BD_MIN(info->count, (int64_t)UINT32_MAX - 1));
            }
            return;
        }
        if (cmp < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
}

/* Look up one chunk of unknown deltas and put them on their pages. */
static bool learn_chunk(struct bd_flusher *f, struct learn_item *items, uint32_t n,
                        uint64_t *max_seq) {
    bson_error_t berr;
    struct bd_page_key *keys = bd_calloc(n, sizeof(*keys));
    if (keys == NULL) {
        log_oom(f, "while looking pages up");
        return false;
    }
    qsort(items, n, sizeof(*items), cmp_learn);
    for (uint32_t i = 0; i < n; i++) {
        keys[i] =
            (struct bd_page_key){.sensor_id = items[i].sensor_id, .start_ms = items[i].start_ms};
    }
    struct learn_ctx ctx = {.items = items, .n = n};
    BD_STAT_ADD(f->stats, page_lookups, 1);
    struct bd_store_call call = {.kind = BD_CALL_FIND,
                                 .keys = keys,
                                 .n = n,
                                 .cb = learn_page,
                                 .cb_arg = &ctx,
                                 .error = &berr};
    bool ok = call_store(f, &call);
    free(keys);
    *max_seq = BD_MAX(*max_seq, ctx.max_seq);
    if (!ok) {
        note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        log_lookup_failure(f, "MongoDB page look-up", berr.message);
        return false;
    }
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_delta *d = &f->batch.deltas[items[i].delta];
        bool none = items[i].count == UINT32_MAX;
        uint32_t count = none ? 0 : items[i].count;
        /* The stored page's size, estimated from its count and this delta's readings. */
        uint64_t per_reading = 0;
        for (uint32_t r = 0; r < d->n_readings; r++) {
            const struct bd_delta_reading *dr = &d->readings[r];
            per_reading += bd_reading_bytes(d->sensor, &d->values[dr->first], dr->n);
        }
        per_reading /= BD_MAX(d->n_readings, 1);
        uint64_t bytes = count == 0 ? 0 : bd_page_overhead_bytes(d->sensor) + count * per_reading;
        struct bd_sensor *sensor = d->sensor; /* d may move when readings are placed */
        const int64_t start_ms = d->start_ms;
        if (place_readings(f, &f->batch, items[i].delta, 0, PLACE_LEARNED, none ? 0 : items[i].page,
                           count, bytes) < 0) {
            log_oom(f, "while placing readings on pages");
            return false;
        }
        /* Readings of this bucket drained into the fill batch while its pages were unknown
         * came after this batch's: they go on the pages right after them, now, before any
         * drained later is placed from the slot (which is known from here on). */
        int64_t fi = bd_batch_find(&f->fill, sensor, start_ms, BD_PAGE_UNKNOWN);
        if (fi >= 0 && place_readings(f, &f->fill, (uint32_t)fi, 0, PLACE_KNOWN, 0, 0, 0) < 0) {
            log_oom(f, "while placing readings on pages");
            return false;
        }
    }
    return true;
}

/* Learn the pages of every unknown delta: one query per flush.max_updates of them. */
static bool learn_pages(struct bd_flusher *f) {
    const uint32_t max = f->cfg->flush.max_updates;
    struct learn_item *items = bd_malloc((size_t)max * sizeof(*items));
    uint64_t max_seq = 0;
    bool ok = items != NULL;
    uint32_t next = 0;
    if (!ok) {
        log_oom(f, "while looking pages up");
    }
    while (ok) {
        uint32_t n = 0;
        /* Deltas added by placing readings have known pages, so one pass suffices. */
        for (; next < f->batch.n && n < max; next++) {
            const struct bd_delta *d = &f->batch.deltas[next];
            if (!f->batch.meta[next].done && d->page == BD_PAGE_UNKNOWN && d->n_readings > 0) {
                items[n++] = (struct learn_item){.sensor_id = d->sensor->id,
                                                 .start_ms = d->start_ms,
                                                 .delta = next,
                                                 .count = UINT32_MAX};
            }
        }
        if (n == 0) {
            break;
        }
        ok = learn_chunk(f, items, n, &max_seq);
    }
    free(items);
    /* A number above ours here means the state on disk is behind the collection. */
    return ok && raise_sequence(f, max_seq);
}

int take_sequence(struct bd_flusher *f, struct bd_err *err) {
    int rc = bd_writer_next(f->writer, &f->batch_seq, err);
    if (rc < 0) {
        return rc;
    }
    f->run_first_seq = f->run_first_seq ? f->run_first_seq : f->batch_seq;
    f->batch_max_start_ms = INT64_MIN;
    for (uint32_t i = 0; i < f->batch.n; i++) {
        f->batch_max_start_ms = BD_MAX(f->batch_max_start_ms, f->batch.deltas[i].start_ms);
    }
    f->have_seq = true;
    return 0;
}

/* Before a batch's first attempt: the sequence and the pages must be right. */
static bool prepare_batch(struct bd_flusher *f) {
    struct bd_err err = {0};
    if (!recover_sequence(f) || !learn_pages(f)) {
        return false;
    }
    if (take_sequence(f, &err) < 0) {
        log_lookup_failure(f, "saving the flush sequence", err.msg);
        return false;
    }
    return true;
}

static bool batch_settled(const struct bd_flusher *f) {
    for (uint32_t i = 0; i < f->batch.n; i++) {
        if (!f->batch.meta[i].done && f->batch.deltas[i].n_readings > 0) {
            return false;
        }
    }
    return true;
}

/* Write every pending delta; true when none is left pending. */
static bool send_pending(struct bd_flusher *f, int64_t wall_ms) {
    bson_error_t berr;
    struct bd_store_call call = {.kind = BD_CALL_PREPARE, .error = &berr};
    if (!call_store(f, &call)) {
        note_failure(f, BD_CAUSE_UNREACHABLE, berr.message);
        return false;
    }
    if (!f->have_seq && !prepare_batch(f)) {
        return false;
    }
    uint32_t next = 0;
    for (;;) {
        uint32_t n = 0;
        int rc = 0;
        /* Deltas appended while building (split readings) are picked up by later chunks. */
        while (n < f->chunk_max && next < f->batch.n) {
            uint32_t di = next;
            if (f->batch.meta[di].done || f->batch.deltas[di].n_readings == 0) {
                f->batch.meta[di].done = true;
                next++;
                continue;
            }
            rc = build_one(f, di, n, wall_ms);
            if (rc < 0) {
                break;
            }
            if (rc == 0) {
                f->ops[n++] = di;
                next++;
            } else if (f->batch.meta[di].done) {
                next++; /* quarantined; a split delta is built again (its first half) */
            }
        }
        if (rc < 0) {
            for (uint32_t i = 0; i < n; i++) {
                bson_destroy(&f->selectors[i]);
                bson_destroy(&f->updates[i]);
            }
            log_oom(f, "while building updates");
            note_failure(f, BD_CAUSE_CLIENT, "out of memory while building updates");
            return false;
        }
        if (n == 0) {
            break;
        }
        uint32_t chunk_max = f->chunk_max;
        enum bd_bulk_cause cause = send_chunk(f, n, wall_ms);
        if (cause == BD_CAUSE_UNREACHABLE || cause == BD_CAUSE_CONNECTION) {
            break; /* the rest waits for the next attempt */
        }
        if (f->chunk_max < chunk_max) {
            next = f->ops[0]; /* halved after a driver refusal: the same updates, fewer a bulk */
        }
    }
    return batch_settled(f);
}

static uint64_t next_rand(struct bd_flusher *f) {
    f->rng ^= f->rng << 13;
    f->rng ^= f->rng >> 7;
    f->rng ^= f->rng << 17;
    return f->rng;
}

void schedule_retry(struct bd_flusher *f, int64_t mono_ns) {
    uint64_t cap = f->cfg->flush.retry_max_ms;
    uint64_t base = f->cfg->flush.retry_initial_ms;
    uint32_t shift = f->attempt < 30 ? f->attempt : 30;
    uint64_t ceiling = base << shift;
    if (ceiling > cap || ceiling < base) {
        ceiling = cap;
    }
    /* Full jitter: spread retries of many daemons over the whole window. */
    uint64_t delay_ms = ceiling ? next_rand(f) % (ceiling + 1) : 0;
    f->attempt++;
    BD_STAT_ADD(f->stats, bulk_retries, 1);
    f->retry_at = mono_ns + (int64_t)delay_ms * BD_NS_PER_MS;
    if (f->retry_at == 0) {
        f->retry_at = 1;
    }
    if (bd_ratelimit_ok(&f->settle.fail_log, bd_mono_ns())) {
        bd_error("MongoDB write failed (%s); keeping %" PRIu64
                 " readings and retrying with backoff",
                 f->last_error, bd_batch_pending_readings(&f->batch));
    }
}

void batch_done(struct bd_flusher *f) {
    bd_batch_clear(&f->batch);
    f->batch_bytes = 0;
}

/*
 * The fill batch becomes the batch to write, with the next id; the old one (settled and
 * cleared) is filled next. This is what keeps a bucket page's updates in flush-sequence order
 * while draining never stops: a batch is written only once every update of the previous one is
 * settled (acknowledged, proved applied, or quarantined), and its writer sequence number is
 * taken only then (prepare_batch), so a page can never receive a later number before an earlier
 * one is in -- which the w.<writer_id> filter would otherwise take for "already applied".
 */
void swap_in_fill(struct bd_flusher *f) {
    BD_ASSERT(bd_batch_pending_readings(&f->batch) == 0);
    struct bd_batch done = f->batch;
    f->batch = f->fill;
    f->fill = done;
    f->batch_bytes = f->fill_bytes;
    f->fill_bytes = 0;
    f->batch_id = f->fill_id;
    f->fill_id++;
    f->queued = 0;
}

/* Of a page's readings pending, this fraction of buckets.max_readings is worth an update. */
#define HOLD_FRACTION 32

/*
 * Whether delta di of the batch about to be written is worth an update now. A growing document
 * is rewritten whole by the storage engine at every update, so a page updated every
 * flush.interval with a few readings each time costs its size times the number of updates: a
 * 1 Hz sensor's page of 1,000 readings rewritten 1,000 times is ~500 bytes rewritten per byte
 * stored. Held back until flush.max_delay passed or enough readings gathered, it is updated
 * about max_readings / (rate x max_delay) times: ~34 for that sensor with the defaults, ~17
 * bytes rewritten per byte stored. Readings held wait in the fill batch, under limits.memory
 * and inside the crash-loss bound (README).
 */
static bool delta_due(const struct bd_flusher *f, uint32_t di, int64_t wall_ms, bool stopping) {
    const struct bd_delta *d = &f->batch.deltas[di];
    const struct bd_batch_meta *m = &f->batch.meta[di];
    if (stopping || f->cfg->flush.max_delay_ms == 0 || d->page == BD_PAGE_UNKNOWN ||
        wall_ms - m->first_ms >= (int64_t)f->cfg->flush.max_delay_ms ||
        (uint64_t)d->n_readings * HOLD_FRACTION >= f->lim.max_readings || over_budget(f)) {
        return true;
    }
    /* A page that new readings no longer go to will not grow: nothing to wait for. */
    const struct bd_page_slot *slot = bd_pages_find(d->sensor->flusher_state, d->start_ms);
    return slot == NULL || !slot->known || slot->page != d->page;
}

/*
 * After swap_in_fill: the deltas of the batch to write that are not due yet go back into the
 * (empty) fill batch, ahead of anything drained later, so their readings stay in order. A
 * delta that cannot be moved (out of memory) is simply written now.
 */
static void hold_back(struct bd_flusher *f, int64_t wall_ms, bool stopping) {
    for (uint32_t di = 0; di < f->batch.n; di++) {
        struct bd_delta *d = &f->batch.deltas[di];
        if (f->batch.meta[di].done || d->n_readings == 0 || delta_due(f, di, wall_ms, stopping)) {
            continue;
        }
        uint32_t had = f->fill.n;
        int64_t t = bd_batch_get(&f->fill, d->sensor, d->start_ms, d->page);
        if (t < 0) {
            continue;
        }
        d = &f->batch.deltas[di];
        uint64_t moved = bd_delta_bytes(d);
        if (bd_delta_split(d, 0, &f->fill.deltas[t]) < 0) {
            bd_batch_truncate(&f->fill, had);
            continue;
        }
        f->fill.meta[t].first_ms = f->batch.meta[di].first_ms;
        f->batch.meta[di].done = true;
        f->fill_bytes += moved;
        f->queued += f->fill.deltas[t].n_readings;
        struct bd_page_slot *slot = bd_pages_find(d->sensor->flusher_state, d->start_ms);
        if (slot != NULL) {
            slot->batch = BD_MAX(slot->batch, f->fill_id); /* pinned with the fill batch now */
        }
    }
}

/* Write what the batch holds: one bulk per flush.max_updates deltas. */
static void write_pending(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms) {
    if (f->store == NULL) {
        for (uint32_t i = 0; i < f->batch.n; i++) {
            BD_STAT_ADD(f->stats, readings_flushed, f->batch.deltas[i].n_readings);
        }
        batch_done(f);
        return;
    }
    if (send_pending(f, wall_ms)) {
        if (f->attempt > 0) {
            bd_info("MongoDB writes succeed again after %u failed attempts", f->attempt);
        }
        f->attempt = 0;
        f->retry_at = 0;
        f->chunk_max = f->cfg->flush.max_updates;
        f->last_cause = BD_CAUSE_NONE;
        f->have_seq = false;
        bd_writer_acked(f->writer, wall_ms, f->batch_max_start_ms);
        batch_done(f);
    } else {
        schedule_retry(f, mono_ns);
    }
}

/* The fill batch is due: the interval passed, or it is large. */
/* The fill batch is large: written whole, nothing held back. */
static bool fill_large(const struct bd_flusher *f) {
    return f->queued >= MAX_QUEUED || f->fill_bytes >= f->budget / 2;
}

bool fill_due(const struct bd_flusher *f, int64_t mono_ns, bool stopping) {
    return f->fill.n > 0 && (stopping || mono_ns >= f->send_at || fill_large(f));
}

static void step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping);

/* The gauges of what waits (stats.h). */
static void set_gauges(struct bd_flusher *f, int64_t wall_ms) {
    const struct bd_pool *pool = bd_sensor_table_pool(f->table);
    BD_GAUGE_SET(f->stats, pool_segments_in_use, bd_pool_in_use(pool));
    BD_GAUGE_SET(f->stats, pool_segments_high_water, bd_pool_high_water(pool));
    BD_GAUGE_SET(f->stats, pool_segments, pool->n_segs);
    uint64_t in_batch = bd_batch_pending_readings(&f->batch);
    uint64_t in_fill = bd_batch_pending_readings(&f->fill);
    BD_GAUGE_SET(f->stats, pending_batches, (uint64_t)(in_batch > 0) + (uint64_t)(in_fill > 0));
    BD_GAUGE_SET(f->stats, pending_readings, in_batch + in_fill);
    int64_t oldest = flusher_spool_oldest_ms(f);
    const struct bd_batch *both[] = {&f->batch, &f->fill};
    for (size_t b = 0; b < BD_ARRAY_LEN(both); b++) {
        for (uint32_t i = 0; i < both[b]->n; i++) {
            const struct bd_batch_meta *m = &both[b]->meta[i];
            if (!m->done && both[b]->deltas[i].n_readings > 0 && m->first_ms > 0 &&
                (oldest == 0 || m->first_ms < oldest)) {
                oldest = m->first_ms;
            }
        }
    }
    BD_GAUGE_SET(f->stats, summary_buckets_pending, flusher_summaries_pending(f));
    BD_GAUGE_SET(f->stats, oldest_pending_age_ms,
                 oldest > 0 && wall_ms > oldest ? (uint64_t)(wall_ms - oldest) : 0);
    if (f->spool != NULL) {
        flusher_spool_stats(f);
    }
}

void bd_flusher_step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    flusher_reload_adopt(f, mono_ns, wall_ms);
    step(f, mono_ns, wall_ms, stopping);
    flusher_summaries_step(f, wall_ms, stopping);
    set_gauges(f, wall_ms);
}

static void step(struct bd_flusher *f, int64_t mono_ns, int64_t wall_ms, bool stopping) {
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    /* Draining goes on whatever the batch being written is doing (waiting for its retry here,
     * in flight in call_store). */
    flusher_drain(f, wall_ms);
    if (f->spool != NULL) {
        bd_spool_tick(f->spool, mono_ns);
        if (flusher_spool_active(f)) {
            /* Older batches wait on disk: everything goes through the spool, in order. */
            flusher_spool_step(f, mono_ns, wall_ms, stopping);
            return;
        }
    }
    if (bd_batch_pending_readings(&f->batch) > 0) {
        /* MongoDB is away or refusing (an attempt failed). Once the next batch is due as well,
         * this one goes to the spool (the next follows it there): memory stays bounded, and
         * what was accepted reaches the disk within about two flush intervals. Whether the
         * retry is due does not matter: an attempt that blocks longer than its backoff (server
         * selection) leaves it always due. */
        if (f->spool != NULL && f->attempt > 0 && fill_due(f, mono_ns, stopping) &&
            flusher_spool_batch(f, wall_ms)) {
            flusher_spool_step(f, mono_ns, wall_ms, stopping);
            return;
        }
        if (mono_ns < f->retry_at) {
            return;
        }
        write_pending(f, mono_ns, wall_ms);
        if (bd_batch_pending_readings(&f->batch) > 0) {
            return;
        }
    }
    if (!fill_due(f, mono_ns, stopping)) {
        if (f->fill.n == 0 && mono_ns >= f->send_at) {
            f->send_at = mono_ns + interval_ns;
        }
        return;
    }
    bool large = fill_large(f);
    if (!stopping && mono_ns < f->send_at && large) {
        BD_STAT_ADD(f->stats, flushes_for_memory, 1);
    }
    swap_in_fill(f);
    hold_back(f, wall_ms, stopping || large);
    f->send_at = mono_ns + interval_ns;
    if (bd_batch_pending_readings(&f->batch) == 0) {
        batch_done(f); /* everything held back for more */
        return;
    }
    BD_STAT_ADD(f->stats, flushes, 1);
    write_pending(f, mono_ns, wall_ms);
}

bool bd_flusher_idle(struct bd_flusher *f) {
    return batch_settled(f) && bd_batch_pending_readings(&f->fill) == 0 && f->requeued == NULL &&
           !bd_sensor_table_has_dirty(f->table) && !flusher_spool_active(f);
}

/* Readings still in sensor queues at the end: counted as lost, queues emptied. */
static uint64_t discard_queues(struct bd_flusher *f) {
    uint64_t lost = 0;
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    struct bd_sensor *s;
    for (;;) {
        if (f->requeued != NULL) {
            s = f->requeued;
            f->requeued = s->flusher_next;
            s->flusher_next = NULL;
            s->flusher_requeued = false;
        } else if ((s = bd_sensor_table_next_dirty(f->table)) == NULL) {
            break;
        }
        int64_t ts;
        uint32_t nv, cells;
        while ((cells = bd_sensor_peek_reading(s, &ts, vals, &nv)) != 0) {
            bd_sensor_consume(s, cells);
            lost++;
        }
    }
    return lost;
}

uint64_t bd_flusher_abandon(struct bd_flusher *f) {
    flusher_spool_everything(f, bd_now_ns() / BD_NS_PER_MS);
    uint64_t pending = bd_batch_pending_readings(&f->batch) + bd_batch_pending_readings(&f->fill);
    uint64_t lost = pending + discard_queues(f);
    BD_STAT_ADD(f->stats, readings_lost, lost);
    if (lost > 0) {
        const char *why;
        switch (f->last_cause) {
        case BD_CAUSE_UNREACHABLE:
            why = "MongoDB was unreachable";
            break;
        case BD_CAUSE_CONNECTION:
            why = "the connection to MongoDB kept failing during writes";
            break;
        case BD_CAUSE_SERVER:
            why = "MongoDB kept refusing updates that were still being retried";
            break;
        case BD_CAUSE_CLIENT:
            why = "updates could not be built or were refused by the driver";
            break;
        default:
            why = pending > 0 ? "writes were still being retried" : "they were never drained";
            break;
        }
        bd_error("stop deadline (flush.stop_timeout=%" PRIu64 "ms) passed: %" PRIu64
                 " accepted readings were not stored: %s%s%s%s",
                 f->cfg->flush.stop_timeout_ms, lost, why, f->last_error[0] ? " (" : "",
                 f->last_error, f->last_error[0] ? ")" : "");
    }
    batch_done(f);
    bd_batch_clear(&f->fill);
    f->fill_bytes = 0;
    f->queued = 0;
    f->retry_at = 0;
    return lost;
}

static void timespec_after_ns(struct timespec *ts, int64_t delta_ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    int64_t ns = ts->tv_nsec + (delta_ns > 0 ? delta_ns : 0);
    ts->tv_sec += ns / BD_NS_PER_S;
    ts->tv_nsec = ns % BD_NS_PER_S;
}

static void *flusher_main(void *arg) {
    struct bd_flusher *f = arg;
    int64_t interval_ns = (int64_t)f->cfg->flush.interval_ms * BD_NS_PER_MS;
    bson_error_t berr;

    if (f->store != NULL) {
        /* Connect ahead of the first write (readings are drained meanwhile). */
        struct bd_store_call call = {.kind = BD_CALL_PREPARE, .error = &berr};
        call_store(f, &call);
    }
    f->send_at = bd_mono_ns() + interval_ns;
    for (;;) {
        int64_t now = bd_mono_ns();
        int64_t wait_ns = (f->retry_at ? BD_MIN(f->retry_at, f->send_at) : f->send_at) - now;
        bool stopping;
        pthread_mutex_lock(&f->mu);
        if (!f->stop && !f->wake_pending && wait_ns > 0) {
            struct timespec ts;
            timespec_after_ns(&ts, wait_ns);
            pthread_cond_timedwait(&f->cv, &f->mu, &ts);
        }
        f->wake_pending = false;
        stopping = f->stop;
        if (stopping && f->stop_by == 0) {
            f->stop_by = f->stop_deadline;
        }
        pthread_mutex_unlock(&f->mu);

        bd_flusher_step(f, bd_mono_ns(), bd_now_ns() / BD_NS_PER_MS, stopping);
        if (!stopping) {
            continue;
        }
        if (bd_flusher_idle(f)) {
            break;
        }
        if (bd_mono_ns() >= f->stop_by) {
            /* What MongoDB did not take goes to the spool for the next start; only what cannot
             * be spooled is lost (counted and logged). */
            bd_flusher_abandon(f);
            break;
        }
        if (f->retry_at != 0) {
            /* Sleep out the backoff, but not past the deadline. */
            int64_t until = BD_MIN(f->retry_at, f->stop_by);
            int64_t ns = until - bd_mono_ns();
            if (ns > 0) {
                struct timespec ts = {.tv_sec = ns / BD_NS_PER_S, .tv_nsec = ns % BD_NS_PER_S};
                nanosleep(&ts, NULL);
            }
        }
    }
    f->clean_stop = true;
    flusher_summaries_close(f, "the stop"); /* counted before the stop's stats line */
    if (f->store != NULL) {
        f->store->ops->release(f->store);
    }
    return NULL;
}

int bd_flusher_start(struct bd_flusher *f, struct bd_err *err) {
    if (f->store != NULL) {
        int rc = bd_io_new(&f->io, err);
        if (rc < 0) {
            return rc;
        }
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_destroy(&f->cv);
    pthread_cond_init(&f->cv, &attr);
    pthread_condattr_destroy(&attr);
    f->clean_stop = false;
    int rc = pthread_create(&f->thread, NULL, flusher_main, f);
    if (rc != 0) {
        f->clean_stop = true;
        bd_io_free(f->io);
        f->io = NULL;
        return bd_err_set(err, -rc, "flusher: cannot start thread: %s", strerror(rc));
    }
    f->started = true;
    return 0;
}

void bd_flusher_stop(struct bd_flusher *f, int64_t deadline_mono_ns) {
    if (!f->started) {
        return;
    }
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    f->stop_deadline = deadline_mono_ns;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    f->started = false;
    bd_io_free(f->io);
    f->io = NULL;
}
