/*
 * Sensor table: series key -> sensor, with one SPSC ring per sensor and a dirty queue that
 * hands sensors with new readings to the flusher.
 *
 * Threads: the ingest thread owns the hash index, creates sensors, appends field names and is
 * the single producer of every sensor ring and of the dirty queue. The flusher thread is the
 * single consumer of both. Sensors live until bd_sensor_table_free(), which runs after both
 * threads have stopped.
 *
 * Index: open addressing, linear probing, at most half full. A slot holds the full 64-bit hash
 * next to the sensor pointer, so a probe that meets another sensor is rejected without touching
 * it; a hash match is confirmed by length and bytes of the id. Sensors are never removed.
 *
 * Hand-off protocol. The producer pushes a reading (release on the ring head) and then looks at
 * the sensor's dirty flag with a plain load (acquire: an ordinary load on x86), which costs no
 * locked instruction, does not wait for the cell stores to drain, and leaves the line shared:
 *   - 0: the sensor is not queued (the consumer popped it, or it never was): the producer sets
 *     the flag to 1 and pushes the sensor on the dirty queue (a release store of its head). Only
 *     the producer ever writes 1 and it just read 0, so no exchange is needed, and the sensor is
 *     in the queue at most once.
 *   - 1: the sensor is queued or being drained. The reading will be drained unless the consumer
 *     already made its last look at this ring and cleared the flag after the value we read --
 *     the store-buffer race (each side writes one word, then reads the other's) that only a full
 *     barrier on both sides would close. Instead of paying a barrier per reading, the producer
 *     notes the sensor on a re-check list and settles the list once per batch, in
 *     bd_sensor_table_publish().
 * The consumer pops a sensor, clears its flag (release), then does an acq_rel read-modify-write
 * on t->handoff and only then drains. publish() does an acq_rel read-modify-write on the same
 * word, then re-reads the flag of every listed sensor and queues those that read 0. Take a
 * reading R that found the flag 1, set by the producer when it queued entry E, and the
 * consumer's pop of E:
 *   - If the consumer's RMW comes after publish's RMW in handoff's modification order, it
 *     synchronises with it (RMWs continue release sequences), so R's push happens before the
 *     drain, whose fresh acquire load of head sees R.
 *   - Otherwise publish's RMW synchronises with the consumer's, so the clear after popping E
 *     happens before the re-check, which reads that 0 -- and queues the sensor again, after R --
 *     or a 1 stored later by the producer itself. That later 1 cannot come before R's load in
 *     program order (R would have read it rather than the 1 of E, which the clear follows in the
 *     flag's modification order), so it comes with a queue entry pushed after R.
 * Either way R is drained. A reading that found 0 queues the sensor itself, after the push.
 *
 * Ring cell encoding of one reading: a header cell {ts_ns, n_values} followed by n_values
 * value cells {value bits, field index | kind << 16}.
 */
#include "bucketd/sensor.h"

#include <bson/bson.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "bucketd/log.h"
#include "bucketd/names.h"

_Static_assert(offsetof(struct bd_sensor, ring) == BD_RING_LINE,
               "the ring's producer line must pair with the sensor's first line");
_Static_assert(BD_SENSOR_MAX_FIELDS <= 64, "field_escaped has one bit per field");

/* The re-check list is settled early when it fills (a batch of very many lines). */
#define RECHECK_MAX 1024
/* Initial index size: slots, a power of two. */
#define INITIAL_SLOTS 1024

struct slot {
    uint64_t hash;
    struct bd_sensor *s; /* NULL: empty */
};

struct bd_sensor_table {
    /* Read-modify-written by both threads: see the hand-off protocol. Alone in its pair. */
    alignas(BD_RING_CACHELINE) _Atomic uint64_t handoff;

    alignas(BD_RING_CACHELINE) const struct bd_config *cfg;
    struct bd_stats *stats;

    /* Hash index, ingest thread only. */
    struct slot *slots;
    uint32_t slot_mask;
    uint32_t count;
    uint32_t max_sensors;

    /* Dirty queue: cells carry sensor pointers; capacity >= max_sensors, so it never fills
     * (a sensor is in it at most once). */
    struct bd_ring dirty;

    /* Sensors whose flag read 1 after a push since the last publish; ingest thread only. */
    struct bd_sensor **recheck;
    uint32_t n_recheck;

    uint32_t ring_size;
    uint32_t high_water; /* above this a ring asks the flusher for an early flush */
    uint32_t low_water;  /* below this a congested ring lets TCP and UDP read again */
    uint32_t max_fields;
    int64_t max_late_ns;
    int64_t max_future_ns;

    bd_sensor_wake_cb wake;
    void *wake_arg;
    struct bd_sensor *congested; /* last ring seen above high water, ingest thread only */

    struct bd_ratelimit limit_log;

    /* Written by the flusher, read by the ingest thread: see bd_sensor_table_set_stalled. */
    atomic_bool consumer_stalled;
};

/* Zeroed memory aligned for types with alignas(BD_RING_CACHELINE) members. */
static void *zalloc_aligned(size_t size) {
    size = (size + BD_RING_CACHELINE - 1) & ~(size_t)(BD_RING_CACHELINE - 1);
    void *p = aligned_alloc(BD_RING_CACHELINE, size);
    if (p != NULL) {
        memset(p, 0, size);
    }
    return p;
}

static uint32_t next_pow2(uint32_t v) {
    uint32_t p = 2;
    while (p < v && p < (UINT32_C(1) << 31)) {
        p <<= 1;
    }
    return p;
}

int bd_sensor_table_new(struct bd_sensor_table **out, const struct bd_config *cfg,
                        struct bd_stats *stats, struct bd_err *err) {
    int rc = 0;
    struct bd_sensor_table *t = zalloc_aligned(sizeof(*t));
    if (t == NULL) {
        rc = bd_err_set(err, -ENOMEM, "sensor table: out of memory");
        goto out;
    }
    t->cfg = cfg;
    t->stats = stats;
    t->max_sensors = cfg->limits.max_sensors;
    t->ring_size = cfg->limits.ring_size;
    t->high_water = t->ring_size / 2;
    t->low_water = t->ring_size / 4;
    t->max_fields = cfg->limits.max_fields;
    t->max_late_ns = (int64_t)cfg->buckets.max_late_ms * BD_NS_PER_MS;
    t->max_future_ns = (int64_t)cfg->buckets.max_future_ms * BD_NS_PER_MS;
    t->limit_log.interval_ns = 10 * BD_NS_PER_S;
    t->limit_log.burst = 1;
    atomic_init(&t->handoff, 0);
    atomic_init(&t->consumer_stalled, false);
    t->slot_mask = INITIAL_SLOTS - 1;
    t->slots = calloc(t->slot_mask + 1, sizeof(*t->slots));
    t->recheck = calloc(RECHECK_MAX, sizeof(*t->recheck));
    if (t->slots == NULL || t->recheck == NULL) {
        rc = bd_err_set(err, -ENOMEM, "sensor table: out of memory");
        goto out;
    }
    rc = bd_ring_init(&t->dirty, next_pow2(t->max_sensors));
    if (rc < 0) {
        bd_err_set(err, rc, "sensor table: cannot allocate the dirty queue");
        goto out;
    }
    *out = t;
    t = NULL;
out:
    bd_sensor_table_free(t);
    return rc;
}

static void sensor_free(struct bd_sensor *s) {
    if (s == NULL) {
        return;
    }
    uint32_t nf = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    for (uint32_t i = 0; i < nf; i++) {
        free(s->field_names[i]);
    }
    for (uint32_t i = 0; i < s->n_tags; i++) {
        free(s->tag_keys ? s->tag_keys[i] : NULL);
        free(s->tag_values ? s->tag_values[i] : NULL);
    }
    free(s->tag_keys);
    free(s->tag_values);
    free(s->measurement);
    bd_ring_close(&s->ring);
    free(s);
}

void bd_sensor_table_free(struct bd_sensor_table *t) {
    if (t == NULL) {
        return;
    }
    if (t->slots != NULL) {
        for (uint32_t i = 0; i <= t->slot_mask; i++) {
            struct bd_sensor *s = t->slots[i].s;
            if (s != NULL) {
                BD_ASSERT(s->flusher_state == NULL); /* the flusher releases its state first */
                sensor_free(s);
            }
        }
    }
    free(t->slots);
    free(t->recheck);
    bd_ring_close(&t->dirty);
    free(t);
}

void bd_sensor_table_set_wake(struct bd_sensor_table *t, bd_sensor_wake_cb cb, void *arg) {
    t->wake = cb;
    t->wake_arg = arg;
}

uint32_t bd_sensor_table_count(const struct bd_sensor_table *t) {
    return t->count;
}

void bd_sensor_table_foreach(struct bd_sensor_table *t, void (*fn)(struct bd_sensor *, void *),
                             void *arg) {
    for (uint32_t i = 0; i <= t->slot_mask; i++) {
        if (t->slots[i].s != NULL) {
            fn(t->slots[i].s, arg);
        }
    }
}

static char *dup_str(const struct bd_str *s) {
    char *p = malloc(s->len + 1);
    if (p != NULL) {
        memcpy(p, s->ptr, s->len);
        p[s->len] = '\0';
    }
    return p;
}

/*
 * A name as its BSON key (names.h), NUL-terminated, in a new allocation. If the key differs
 * from the name, the name follows the key's NUL when keep_name is set, and *escaped is set.
 */
static char *dup_key(const struct bd_str *s, enum bd_name_kind kind, bool keep_name,
                     bool *escaped) {
    size_t klen = bd_name_escaped_len(s->ptr, s->len, kind);
    *escaped = klen != s->len;
    if (!*escaped) {
        return dup_str(s);
    }
    size_t size = klen + 1 + (keep_name ? s->len + 1 : 0);
    char *p = malloc(size);
    if (p == NULL) {
        return NULL;
    }
    int rc = bd_name_escape(s->ptr, s->len, kind, p, size);
    BD_ASSERT(rc == (int)klen);
    if (keep_name) {
        memcpy(p + klen + 1, s->ptr, s->len);
        p[klen + 1 + s->len] = '\0';
    }
    return p;
}

static void slot_insert(struct slot *slots, uint32_t mask, uint64_t hash, struct bd_sensor *s) {
    uint32_t i = (uint32_t)hash & mask;
    while (slots[i].s != NULL) {
        i = (i + 1) & mask;
    }
    slots[i].hash = hash;
    slots[i].s = s;
}

static int grow_index(struct bd_sensor_table *t) {
    uint32_t new_mask = t->slot_mask * 2 + 1;
    struct slot *slots = calloc((size_t)new_mask + 1, sizeof(*slots));
    if (slots == NULL) {
        return -ENOMEM;
    }
    for (uint32_t i = 0; i <= t->slot_mask; i++) {
        if (t->slots[i].s != NULL) {
            slot_insert(slots, new_mask, t->slots[i].hash, t->slots[i].s);
        }
    }
    free(t->slots);
    t->slots = slots;
    t->slot_mask = new_mask;
    return 0;
}

/* A new sensor: validated names, its ring, linked into the index. NULL on a counted drop. */
static struct bd_sensor *sensor_create(struct bd_sensor_table *t, const struct bd_point *pt,
                                       uint64_t hash) {
    struct bd_sensor *s = NULL;
    if (t->count >= t->max_sensors) {
        BD_STAT_ADD(t->stats, drop_sensor_limit, 1);
        if (bd_ratelimit_ok(&t->limit_log, bd_mono_ns())) {
            bd_warn("sensor limit reached (limits.max_sensors=%u): readings of new sensors "
                    "are dropped",
                    t->max_sensors);
        }
        return NULL;
    }
    /* The id and measurement are BSON strings, tag keys keys (escaped below, so '.' or a
     * leading '$' are fine): each must be valid UTF-8 without NUL. */
    if (!bd_name_valid(pt->series_key.ptr, pt->series_key.len) ||
        !bd_name_valid(pt->name.ptr, pt->name.len)) {
        BD_STAT_ADD(t->stats, drop_bad_name, 1);
        return NULL;
    }
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        if (!bd_name_valid(pt->tags[i].key.ptr, pt->tags[i].key.len) ||
            !bson_utf8_validate(pt->tags[i].value.ptr, pt->tags[i].value.len, false)) {
            BD_STAT_ADD(t->stats, drop_bad_name, 1);
            return NULL;
        }
    }
    /* At most half full, so probe runs stay short and an empty slot always ends them. */
    if ((t->count + 1) * 2 > t->slot_mask + 1 && grow_index(t) < 0) {
        goto oom;
    }
    s = zalloc_aligned(sizeof(*s) + pt->series_key.len + 1);
    if (s == NULL) {
        goto oom;
    }
    memcpy(s->id_buf, pt->series_key.ptr, pt->series_key.len);
    s->id_buf[pt->series_key.len] = '\0';
    s->id = s->id_buf;
    s->id_len = (uint32_t)pt->series_key.len;
    s->measurement = dup_str(&pt->name);
    s->n_tags = pt->n_tags;
    s->tag_keys = calloc(pt->n_tags ? pt->n_tags : 1, sizeof(char *));
    s->tag_values = calloc(pt->n_tags ? pt->n_tags : 1, sizeof(char *));
    if (s->measurement == NULL || s->tag_keys == NULL || s->tag_values == NULL) {
        goto oom;
    }
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        bool escaped;
        s->tag_keys[i] = dup_key(&pt->tags[i].key, BD_NAME_TAG, false, &escaped);
        s->tag_values[i] = dup_str(&pt->tags[i].value);
        if (s->tag_keys[i] == NULL || s->tag_values[i] == NULL) {
            goto oom;
        }
    }
    s->hash = hash;
    atomic_init(&s->n_fields, 0);
    atomic_init(&s->dirty, 0);
    if (bd_ring_init(&s->ring, t->ring_size) < 0) {
        goto oom;
    }
    slot_insert(t->slots, t->slot_mask, hash, s);
    t->count++;
    return s;
oom:
    sensor_free(s);
    BD_STAT_ADD(t->stats, drop_sensor_limit, 1);
    if (bd_ratelimit_ok(&t->limit_log, bd_mono_ns())) {
        bd_error("out of memory creating a sensor: its readings are dropped");
    }
    return NULL;
}

static struct bd_sensor *lookup(struct bd_sensor_table *t, const struct bd_str *key,
                                uint64_t hash) {
    for (uint32_t i = (uint32_t)hash & t->slot_mask;; i = (i + 1) & t->slot_mask) {
        const struct slot *e = &t->slots[i];
        if (e->s == NULL) {
            return NULL;
        }
        if (e->hash == hash && e->s->id_len == key->len &&
            memcmp(e->s->id_buf, key->ptr, key->len) == 0) {
            return e->s;
        }
    }
}

/* The packed short form of a field name (see bd_sensor.field_key): 0 if longer than 7 bytes. */
static uint64_t pack_key(const struct bd_str *key) {
    size_t len = key->len;
    const unsigned char *p = (const unsigned char *)key->ptr;
    uint64_t w;
    /* Fixed-size loads inside [p, p + len) only, combined in registers: a memcpy of `len`
     * bytes into a local and a load of all 8 stalled on store forwarding, every reading. */
    if (len > 7) {
        return 0;
    } else if (len >= 4) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + len - 4, 4); /* overlaps lo by 8 - len bytes, with the same values */
        w = (uint64_t)lo | (uint64_t)hi << ((len - 4) * 8);
    } else if (len > 0) {
        w = (uint64_t)p[0] | (uint64_t)p[len / 2] << (len / 2 * 8) |
            (uint64_t)p[len - 1] << ((len - 1) * 8);
    } else {
        w = 0;
    }
    return (w << 8) | len;
}

/* Whether field name i is key (not NUL-terminated; strncmp stops at the name's own end). */
static bool field_is(const struct bd_sensor *s, uint32_t i, const struct bd_str *key) {
    const char *name = s->field_names[i];
    if ((s->field_escaped >> i) & 1) {
        name += strlen(name) + 1; /* the name as sent, after its BSON key */
    }
    return strncmp(name, key->ptr, key->len) == 0 && name[key->len] == '\0';
}

/* As field_is, from the first line alone when both names are short: packed forms are equal
 * exactly when the names are, and a long name packs to 0, which no short key equals. */
static bool field_matches(const struct bd_sensor *s, uint32_t i, const struct bd_str *key,
                          uint64_t packed) {
    if (i < BD_SENSOR_KEY_SLOTS && packed != 0) {
        return s->field_key[i] == packed;
    }
    return field_is(s, i, key);
}

/*
 * Index of a field name in the sensor's dictionary, appending it if new; -1 on a counted drop.
 * A sensor sends its fields in the same order every time, so the name at the field's position
 * in the line (hint) is tried first and the search is the exception. The append escapes the
 * name for BSON (names.h) once, and publishes it (release) before any reading using it is
 * pushed.
 */
static int field_index(struct bd_sensor_table *t, struct bd_sensor *s, const struct bd_str *key,
                       uint32_t hint) {
    uint32_t n = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    uint64_t packed = pack_key(key);
    if (hint < n && field_matches(s, hint, key, packed)) {
        return (int)hint;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (field_matches(s, i, key, packed)) {
            return (int)i;
        }
    }
    if (!bd_name_valid(key->ptr, key->len)) {
        BD_STAT_ADD(t->stats, drop_bad_name, 1);
        return -1;
    }
    if (n >= BD_SENSOR_MAX_FIELDS) {
        BD_STAT_ADD(t->stats, drop_field_limit, 1);
        return -1;
    }
    bool escaped;
    char *name = dup_key(key, BD_NAME_FIELD, true, &escaped);
    if (name == NULL) {
        BD_STAT_ADD(t->stats, drop_field_limit, 1);
        return -1;
    }
    s->field_names[n] = name;
    if (escaped) {
        s->field_escaped |= UINT64_C(1) << n;
    }
    if (n < BD_SENSOR_KEY_SLOTS) {
        s->field_key[n] = packed;
    }
    /* Pairs with the acquire load in bd_sensor_peek_reading(); the ring's own release/acquire
     * on head also orders it, this keeps the dictionary self-contained. */
    atomic_store_explicit(&s->n_fields, n + 1, memory_order_release);
    return (int)n;
}

void bd_sensor_table_request_drain(struct bd_sensor_table *t) {
    if (t->wake != NULL) {
        t->wake(t->wake_arg);
    }
}

static void enqueue(struct bd_sensor_table *t, struct bd_sensor *s) {
    /* Only the producer writes 1, and it just read 0: the sensor is not in the queue. The
     * push's release store of the queue head publishes the sensor (and its immutable parts)
     * to the consumer's acquire load in bd_sensor_table_next_dirty(). */
    atomic_store_explicit(&s->dirty, 1, memory_order_relaxed);
    struct bd_cell c = {{(uint64_t)(uintptr_t)s, 0}};
    bool ok = bd_ring_push(&t->dirty, &c, 1);
    BD_ASSERT(ok); /* capacity >= number of sensors, each queued at most once */
}

void bd_sensor_table_publish(struct bd_sensor_table *t) {
    uint32_t n = t->n_recheck;
    if (n == 0) {
        return;
    }
    /* Pairs with the RMW in bd_sensor_table_next_dirty(); see the hand-off protocol. */
    atomic_fetch_add_explicit(&t->handoff, 1, memory_order_acq_rel);
    bool wake = false;
    for (uint32_t i = 0; i < n; i++) {
        struct bd_sensor *s = t->recheck[i];
        s->recheck = 0;
        if (atomic_load_explicit(&s->dirty, memory_order_acquire) == 0) { /* see mark_dirty */
            enqueue(t, s);
            /* Its high-water wake-up may have come and gone while it was not queued. */
            wake |= bd_ring_used_hint(&s->ring) > t->high_water;
        }
    }
    t->n_recheck = 0;
    if (wake) {
        bd_sensor_table_request_drain(t);
    }
}

/* After a push: see the hand-off protocol at the top of this file. */
static void mark_dirty(struct bd_sensor_table *t, struct bd_sensor *s) {
    /* Acquire, pairing with the release clear in bd_sensor_table_next_dirty(): a 0 read here
     * makes the consumer's pop of the old entry (its tail store) visible before we queue the
     * sensor again, so the queue never looks as if it held a sensor twice. */
    if (atomic_load_explicit(&s->dirty, memory_order_acquire) == 0) {
        enqueue(t, s);
        return;
    }
    if (s->recheck) {
        return;
    }
    if (t->n_recheck == RECHECK_MAX) {
        bd_sensor_table_publish(t);
    }
    s->recheck = 1;
    t->recheck[t->n_recheck++] = s;
}

int bd_sensor_table_accept(struct bd_sensor_table *t, const struct bd_point *pt, int64_t now_ns) {
    int64_t ts = pt->has_time ? pt->time_ns : now_ns;
    if (ts < now_ns - t->max_late_ns) {
        BD_STAT_ADD(t->stats, drop_too_old, 1);
        return -ERANGE;
    }
    if (ts > now_ns + t->max_future_ns) {
        BD_STAT_ADD(t->stats, drop_too_new, 1);
        return -ERANGE;
    }
    if (pt->n_fields > t->max_fields) {
        BD_STAT_ADD(t->stats, drop_too_many_fields, 1);
        return -E2BIG;
    }
    uint32_t n_strings = 0;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        n_strings += pt->fields[i].kind == BD_VAL_STRING;
    }
    if (n_strings > 0) {
        BD_STAT_ADD(t->stats, string_fields_dropped, n_strings);
    }
    uint32_t n_vals = pt->n_fields - n_strings;
    if (n_vals == 0) {
        BD_STAT_ADD(t->stats, drop_no_numeric, 1);
        return -EINVAL;
    }

    uint64_t hash = XXH3_64bits(pt->series_key.ptr, pt->series_key.len);
    struct bd_sensor *s = lookup(t, &pt->series_key, hash);
    if (s == NULL) {
        s = sensor_create(t, pt, hash);
        if (s == NULL) {
            return -ENOSPC;
        }
    }
    /* The cells' line was last read by the flusher: ask for it now, the field checks below
     * run while it comes. */
    bd_ring_prefetch_push(&s->ring);

    struct bd_cell cells[1 + BD_PARSE_MAX_FIELDS];
    cells[0].w[0] = (uint64_t)ts;
    cells[0].w[1] = n_vals;
    uint32_t n = 1;
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        const struct bd_field *f = &pt->fields[i];
        if (f->kind == BD_VAL_STRING) {
            continue;
        }
        int idx = field_index(t, s, &f->key, n - 1);
        if (idx < 0) {
            return -EINVAL;
        }
        uint64_t bits = 0;
        switch (f->kind) {
        case BD_VAL_FLOAT:
            memcpy(&bits, &f->v.f, sizeof(bits));
            break;
        case BD_VAL_INT:
            bits = (uint64_t)f->v.i;
            break;
        case BD_VAL_UINT:
            bits = f->v.u;
            break;
        default:
            bits = f->v.b ? 1 : 0;
            break;
        }
        cells[n].w[0] = bits;
        cells[n].w[1] = (uint64_t)idx | ((uint64_t)f->kind << 16);
        n++;
    }

    /* The upper bound from the producer's copy of tail costs nothing; only near the mark is
     * the real tail read, so crossing it is judged on a fresh count. */
    uint32_t used_before = bd_ring_used_hint(&s->ring);
    if (used_before + n > t->high_water) {
        used_before = t->ring_size - bd_ring_free(&s->ring);
    }
    if (!bd_ring_push(&s->ring, cells, n)) {
        BD_STAT_ADD(t->stats, drop_ring_full, 1);
        t->congested = s;
        mark_dirty(t, s);
        bd_sensor_table_request_drain(t);
        return -ENOBUFS;
    }
    BD_STAT_ADD(t->stats, readings_accepted, 1);
    mark_dirty(t, s);
    if (used_before <= t->high_water && used_before + n > t->high_water) {
        t->congested = s;
        bd_sensor_table_request_drain(t);
    }
    return 0;
}

bool bd_sensor_table_congested(const struct bd_sensor_table *t) {
    struct bd_sensor *s = t->congested;
    if (s == NULL) {
        return false;
    }
    if (bd_ring_used(&s->ring) > t->low_water) {
        return true;
    }
    ((struct bd_sensor_table *)t)->congested = NULL;
    return false;
}

bool bd_sensor_table_udp_should_pause(const struct bd_sensor_table *t) {
    struct bd_sensor *s = t->congested;
    return s != NULL && bd_ring_used(&s->ring) > t->high_water && !bd_sensor_table_stalled(t);
}

void bd_sensor_table_set_stalled(struct bd_sensor_table *t, bool stalled) {
    /* A hint for a pause decision, ordering nothing: relaxed. */
    atomic_store_explicit(&t->consumer_stalled, stalled, memory_order_relaxed);
}

bool bd_sensor_table_stalled(const struct bd_sensor_table *t) {
    return atomic_load_explicit(&t->consumer_stalled, memory_order_relaxed);
}

bool bd_sensor_table_has_dirty(struct bd_sensor_table *t) {
    uint32_t tail;
    return bd_ring_available(&t->dirty, &tail) != 0;
}

struct bd_sensor *bd_sensor_table_next_dirty(struct bd_sensor_table *t) {
    uint32_t tail;
    if (bd_ring_available(&t->dirty, &tail) == 0) {
        return NULL;
    }
    struct bd_sensor *s = (struct bd_sensor *)(uintptr_t)bd_ring_at(&t->dirty, tail)->w[0];
    bd_ring_consume(&t->dirty, 1);
    /* Clear, then the RMW, then the caller drains: see the hand-off protocol at the top of
     * this file. The RMW's release orders the clear before it. */
    atomic_store_explicit(&s->dirty, 0, memory_order_release);
    atomic_fetch_add_explicit(&t->handoff, 1, memory_order_acq_rel);
    return s;
}

uint32_t bd_sensor_peek_reading(struct bd_sensor *s, int64_t *ts_ns, struct bd_reading_value *vals,
                                uint32_t *n_vals) {
    uint32_t tail;
    uint32_t avail = bd_ring_available(&s->ring, &tail);
    if (avail == 0) {
        return 0;
    }
    const struct bd_cell *h = bd_ring_at(&s->ring, tail);
    uint32_t n = (uint32_t)h->w[1];
    BD_ASSERT(n >= 1 && n <= BD_PARSE_MAX_FIELDS && n + 1 <= avail); /* pushed whole */
    *ts_ns = (int64_t)h->w[0];
    /* Pairs with the release store in field_index(). */
    uint32_t known = atomic_load_explicit(&s->n_fields, memory_order_acquire);
    for (uint32_t i = 0; i < n; i++) {
        const struct bd_cell *c = bd_ring_at(&s->ring, tail + 1 + i);
        vals[i].field = (uint16_t)(c->w[1] & 0xffff);
        vals[i].kind = (uint8_t)((c->w[1] >> 16) & 0xff);
        BD_ASSERT(vals[i].field < known);
        switch (vals[i].kind) {
        case BD_VAL_FLOAT:
            memcpy(&vals[i].v.f, &c->w[0], sizeof(double));
            break;
        case BD_VAL_INT:
            vals[i].v.i = (int64_t)c->w[0];
            break;
        case BD_VAL_UINT:
            vals[i].v.u = c->w[0];
            break;
        default:
            vals[i].v.b = c->w[0] != 0;
            break;
        }
    }
    *n_vals = n;
    return n + 1;
}
