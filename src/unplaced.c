/*
 * Unplaced spool records (include/bucketd/unplaced.h): encoding a batch's deltas with their
 * readings, and loading a record back into a batch over detached sensors. Flusher thread only.
 *
 * A detached sensor is a struct bd_sensor outside any sensor table, holding just what building
 * an update reads (id, measurement, tags, field names) and the flusher's page accounting; the
 * loaded record owns it. One per distinct id, so that deltas of one bucket page merge.
 */
#include "bucketd/unplaced.h"

#include <errno.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "bucketd/alloc.h"
#include "bucketd/bucket.h"
#include "bucketd/parse.h"

/* Fixed part of an entry: 8 u32 and one i64. */
#define ENTRY_HEADER 40
/* A value as stored: u16 field, u8 kind, u8 0, u64 value. */
#define VALUE_BYTES 12
#define READING_HEADER 12

struct bd_unplaced {
    struct bd_batch batch;
    struct bd_sensor **sensors;
    uint32_t n_sensors, cap_sensors;
    uint32_t *index; /* open addressing on the id's hash: sensor index + 1, 0 = empty */
    uint32_t index_mask;
    uint64_t readings;
};

/* ---- encoding ---------------------------------------------------------------------------- */

static uint8_t *put_str(uint8_t *p, const char *s, size_t len) {
    bd_put_le32(p, (uint32_t)len);
    memcpy(p + 4, s, len);
    return p + 4 + len;
}

int bd_unplaced_add(struct bd_replay_buf *buf, const struct bd_delta *d) {
    const struct bd_sensor *s = d->sensor;
    uint32_t n_names = 0;
    for (uint32_t i = 0; i < d->n_values; i++) {
        n_names = BD_MAX(n_names, (uint32_t)bd_delta_value(d, i).field + 1);
    }
    size_t meas_len = strlen(bd_sensor_measurement(s));
    size_t need = ENTRY_HEADER + s->id_len + meas_len;
    for (uint32_t i = 0; i < s->n_tags; i++) {
        need += 8 + strlen(bd_sensor_tag_key(s, i)) + strlen(bd_sensor_tag_value(s, i));
    }
    for (uint32_t i = 0; i < n_names; i++) {
        need += 4 + strlen(bd_sensor_field_name(s, i));
    }
    need += (size_t)d->n_readings * READING_HEADER + (size_t)d->n_values * VALUE_BYTES;
    if (need > UINT32_MAX) {
        return -EMSGSIZE;
    }
    if (bd_replay_buf_reserve(buf, need) < 0) {
        return -ENOMEM;
    }
    uint8_t *p = buf->data + buf->len;
    bd_put_le32(p, (uint32_t)need);
    bd_put_le32(p + 4, d->n_readings);
    bd_put_le64(p + 8, (uint64_t)d->start_ms);
    bd_put_le32(p + 16, d->page);
    bd_put_le32(p + 20, s->id_len);
    bd_put_le32(p + 24, (uint32_t)meas_len);
    bd_put_le32(p + 28, s->n_tags);
    bd_put_le32(p + 32, n_names);
    bd_put_le32(p + 36, 0);
    p += ENTRY_HEADER;
    memcpy(p, bd_sensor_id(s), s->id_len);
    p += s->id_len;
    memcpy(p, bd_sensor_measurement(s), meas_len);
    p += meas_len;
    for (uint32_t i = 0; i < s->n_tags; i++) {
        const char *key = bd_sensor_tag_key(s, i), *value = bd_sensor_tag_value(s, i);
        p = put_str(p, key, strlen(key));
        p = put_str(p, value, strlen(value));
    }
    for (uint32_t i = 0; i < n_names; i++) {
        const char *name = bd_sensor_field_name(s, i);
        p = put_str(p, name, strlen(name));
    }
    for (uint32_t r = 0; r < d->n_readings; r++) {
        const struct bd_delta_reading *dr = &d->readings[r];
        bd_put_le64(p, (uint64_t)dr->ts_ns);
        bd_put_le32(p + 8, dr->n);
        p += READING_HEADER;
        for (uint32_t k = 0; k < dr->n; k++) {
            const struct bd_reading_value val = bd_delta_value(d, dr->first + k), *v = &val;
            p[0] = (uint8_t)(v->field & 0xff);
            p[1] = (uint8_t)(v->field >> 8);
            p[2] = v->kind;
            p[3] = 0;
            uint64_t bits = 0;
            switch (v->kind) {
            case BD_VAL_FLOAT:
                memcpy(&bits, &v->v.f, sizeof(bits));
                break;
            case BD_VAL_INT:
                bits = (uint64_t)v->v.i;
                break;
            case BD_VAL_UINT:
                bits = v->v.u;
                break;
            default:
                bits = v->v.b ? 1 : 0;
                break;
            }
            bd_put_le64(p + 4, bits);
            p += VALUE_BYTES;
        }
    }
    BD_ASSERT((size_t)(p - (buf->data + buf->len)) == need);
    buf->len += need;
    buf->n_readings += d->n_readings;
    buf->n_updates++;
    return 0;
}

/* ---- loading ----------------------------------------------------------------------------- */

static void sensor_free(struct bd_sensor *s) {
    if (s == NULL) {
        return;
    }
    bd_pages_free(NULL, s->flusher_state); /* detached sensors' pages are on the heap */
    uint32_t n = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    for (uint32_t i = 0; i < n; i++) {
        free((char *)bd_sensor_field_name(s, i)); /* a detached sensor's names are its own */
    }
    if (s->names != NULL) {
        free(s->names->more);
        free(s->names);
    }
    free(s); /* the measurement and the tags are in its block */
}

void bd_unplaced_free(struct bd_unplaced *u) {
    if (u == NULL) {
        return;
    }
    bd_batch_close(&u->batch); /* its deltas refer to the sensors */
    for (uint32_t i = 0; i < u->n_sensors; i++) {
        sensor_free(u->sensors[i]);
    }
    free(u->sensors);
    free(u->index);
    free(u);
}

struct bd_batch *bd_unplaced_batch(struct bd_unplaced *u) {
    return &u->batch;
}

uint64_t bd_unplaced_readings(const struct bd_unplaced *u) {
    return u->readings;
}

uint32_t bd_unplaced_sensors(const struct bd_unplaced *u) {
    return u->n_sensors;
}

/* A bounded reader over the payload. */
struct rd {
    const uint8_t *p, *end;
    bool bad;
};

static const uint8_t *take(struct rd *r, size_t n) {
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *at = r->p;
    r->p += n;
    return at;
}

static uint32_t take32(struct rd *r) {
    const uint8_t *p = take(r, 4);
    return p ? bd_get_le32(p) : 0;
}

static char *take_str(struct rd *r, size_t len) {
    const uint8_t *p = take(r, len);
    if (p == NULL || memchr(p, '\0', len) != NULL) {
        r->bad = true;
        return NULL;
    }
    char *s = bd_malloc(len + 1);
    if (s != NULL) {
        memcpy(s, p, len);
        s[len] = '\0';
    }
    return s;
}

/* The entry's string of len bytes (NUL-free), not copied. */
static bool take_name(struct rd *r, size_t len, struct bd_str *out) {
    const uint8_t *p = take(r, len);
    if (p == NULL || memchr(p, '\0', len) != NULL) {
        r->bad = true;
        return false;
    }
    *out = (struct bd_str){(const char *)p, len};
    return true;
}

/* The sensor of this id, or NULL and *slot the index slot a new one goes in. */
static struct bd_sensor *find_sensor(struct bd_unplaced *u, const char *id, size_t id_len,
                                     uint32_t *slot) {
    uint32_t j = (uint32_t)XXH3_64bits(id, id_len) & u->index_mask;
    while (u->index[j] != 0) {
        struct bd_sensor *s = u->sensors[u->index[j] - 1];
        if (s->id_len == id_len && memcmp(bd_sensor_id(s), id, id_len) == 0) {
            return s;
        }
        j = (j + 1) & u->index_mask;
    }
    *slot = j;
    return NULL;
}

/* A new detached sensor with the entry's identity (measurement, tags), in index slot j. */
static int add_sensor(struct bd_unplaced *u, uint32_t j, const char *id, size_t id_len,
                      struct rd *r, uint32_t meas_len, uint32_t n_tags, struct bd_sensor **out) {
    if (u->n_sensors == u->cap_sensors) {
        uint32_t cap = u->cap_sensors ? u->cap_sensors * 2 : 16;
        struct bd_sensor **grown = bd_reallocarray(u->sensors, cap, sizeof(*grown));
        if (grown == NULL) {
            return -ENOMEM;
        }
        u->sensors = grown;
        u->cap_sensors = cap;
    }
    struct bd_str meas;
    struct bd_str *tags = bd_calloc(n_tags ? 2 * (size_t)n_tags : 1, sizeof(*tags));
    if (tags == NULL) {
        return -ENOMEM;
    }
    /* Keys, then values (bd_sensor_tag_value). */
    take_name(r, meas_len, &meas);
    for (uint32_t i = 0; i < n_tags && !r->bad; i++) {
        take_name(r, take32(r), &tags[i]);
        take_name(r, take32(r), &tags[n_tags + i]);
    }
    struct bd_sensor *s = NULL;
    int rc = r->bad ? -EBADMSG
                    : bd_sensor_detached_new(&s, &(struct bd_str){id, id_len}, &meas, tags,
                                             tags + n_tags, n_tags);
    free(tags);
    if (rc < 0) {
        return rc == -EINVAL ? -EBADMSG : rc;
    }
    u->sensors[u->n_sensors++] = s;
    u->index[j] = u->n_sensors;
    *out = s;
    return 0;
}

/* Skip an entry's tags (a sensor seen before keeps the identity it was made with). */
static void skip_tags(struct rd *r, uint32_t meas_len, uint32_t n_tags) {
    take(r, meas_len);
    for (uint32_t i = 0; i < 2 * n_tags && !r->bad; i++) {
        take(r, take32(r));
    }
}

/* The entry's field names: a sensor's dictionary only grows, so a longer list extends it. */
static int read_names(struct bd_sensor *s, struct rd *r, uint32_t n_names) {
    uint32_t have = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    /* A detached sensor has no inline names (names_inline 0): every name is in names, whose
     * more array it grows at will (no other thread reads it). */
    if (n_names > have && s->names == NULL) {
        s->names = bd_calloc(1, sizeof(*s->names));
        if (s->names == NULL) {
            return -ENOMEM;
        }
    }
    if (n_names > have && n_names > BD_SENSOR_KEY_SLOTS) {
        char **more =
            bd_reallocarray(s->names->more, n_names - BD_SENSOR_KEY_SLOTS, sizeof(char *));
        if (more == NULL) {
            return -ENOMEM;
        }
        s->names->more = more;
    }
    for (uint32_t i = 0; i < n_names; i++) {
        uint32_t len = take32(r);
        if (i < have) {
            take(r, len);
            continue;
        }
        char *name = take_str(r, len);
        if (name == NULL) {
            return r->bad ? -EBADMSG : -ENOMEM;
        }
        if (i < BD_SENSOR_KEY_SLOTS) {
            s->names->name[i] = name;
        } else {
            s->names->more[i - BD_SENSOR_KEY_SLOTS] = name;
        }
        atomic_store_explicit(&s->n_fields, i + 1, memory_order_relaxed);
    }
    return r->bad ? -EBADMSG : 0;
}

/* The readings of one entry into its delta (a page slot made for its bucket first). */
static int read_readings(struct bd_unplaced *u, struct bd_sensor *s, struct rd *r, int64_t start_ms,
                         uint32_t page, uint32_t n_readings, const struct bd_pages_limits *lim) {
    struct bd_pages **pp = (struct bd_pages **)&s->flusher_state;
    if (!bd_pages_start_ok(lim, start_ms)) {
        return -EBADMSG; /* not a bucket of this span: its readings could not be in it either */
    }
    struct bd_page_slot *slot = bd_pages_find(*pp, lim, start_ms);
    if (slot == NULL) {
        /* Unknown: a horizon past the bucket; known: a horizon before it (a new slot). */
        slot = bd_pages_slot(NULL, pp, lim, start_ms, start_ms,
                             page == BD_PAGE_UNKNOWN ? INT64_MAX : INT64_MIN, 0);
        if (slot == NULL) {
            return -ENOMEM;
        }
    }
    if (page != BD_PAGE_UNKNOWN && slot->known && page >= slot->page) {
        /* Readings that must move off a page (too large) go after the highest one known. */
        if (page > slot->page) {
            slot->count = 0;
        }
        slot->page = page;
        slot->count += n_readings;
    }
    int64_t di = bd_batch_get(&u->batch, s, start_ms, page);
    if (di < 0) {
        return -ENOMEM;
    }
    struct bd_reading_value vals[BD_PARSE_MAX_FIELDS];
    const uint32_t n_fields = atomic_load_explicit(&s->n_fields, memory_order_relaxed);
    for (uint32_t k = 0; k < n_readings; k++) {
        const uint8_t *h = take(r, READING_HEADER);
        if (h == NULL) {
            return -EBADMSG;
        }
        int64_t ts = (int64_t)bd_get_le64(h);
        uint32_t nv = bd_get_le32(h + 8);
        if (nv == 0 || nv > BD_PARSE_MAX_FIELDS) {
            return -EBADMSG;
        }
        for (uint32_t i = 0; i < nv; i++) {
            const uint8_t *v = take(r, VALUE_BYTES);
            if (v == NULL) {
                return -EBADMSG;
            }
            vals[i].field = (uint16_t)(v[0] | v[1] << 8);
            vals[i].kind = v[2];
            uint64_t bits = bd_get_le64(v + 4);
            if (vals[i].field >= n_fields) {
                return -EBADMSG;
            }
            switch (vals[i].kind) {
            case BD_VAL_FLOAT:
                memcpy(&vals[i].v.f, &bits, sizeof(bits));
                break;
            case BD_VAL_INT:
                vals[i].v.i = (int64_t)bits;
                break;
            case BD_VAL_UINT:
                vals[i].v.u = bits;
                break;
            case BD_VAL_BOOL:
                vals[i].v.b = bits != 0;
                break;
            default:
                return -EBADMSG;
            }
        }
        if (bd_delta_add(&u->batch.deltas[di], ts, vals, nv) < 0) {
            return -ENOMEM;
        }
        if (bd_bucket_start_ms(ts, lim->span_ms) != start_ms) {
            return -EBADMSG;
        }
    }
    u->readings += n_readings;
    return 0;
}

int bd_unplaced_load(struct bd_unplaced **out, const uint8_t *data, size_t len,
                     const struct bd_pages_limits *lim, struct bd_err *err) {
    *out = NULL;
    struct bd_unplaced *u = bd_calloc(1, sizeof(*u));
    if (u == NULL) {
        return -ENOMEM;
    }
    /* Entries are at least ENTRY_HEADER bytes: that bounds the distinct sensors. */
    size_t max_sensors = len / ENTRY_HEADER + 1;
    uint32_t slots = 16;
    while (slots < 2 * max_sensors && slots < (UINT32_C(1) << 30)) {
        slots *= 2;
    }
    u->index_mask = slots - 1;
    u->index = bd_calloc(slots, sizeof(*u->index));
    int rc = u->index == NULL ? -ENOMEM : bd_batch_init(&u->batch);
    struct rd r = {.p = data, .end = data + len};
    size_t at = 0;
    while (rc == 0 && r.p < r.end) {
        at = (size_t)(r.p - data);
        const uint8_t *h = take(&r, ENTRY_HEADER);
        if (h == NULL) {
            rc = -EBADMSG;
            break;
        }
        uint32_t entry_len = bd_get_le32(h);
        uint32_t n_readings = bd_get_le32(h + 4);
        int64_t start_ms = (int64_t)bd_get_le64(h + 8);
        uint32_t page = bd_get_le32(h + 16);
        uint32_t id_len = bd_get_le32(h + 20), meas_len = bd_get_le32(h + 24);
        uint32_t n_tags = bd_get_le32(h + 28), n_names = bd_get_le32(h + 32);
        if (entry_len < ENTRY_HEADER || entry_len > len - at || n_readings == 0 ||
            n_names > BD_SENSOR_MAX_FIELDS || n_tags > len) {
            rc = -EBADMSG;
            break;
        }
        struct rd e = {.p = h + ENTRY_HEADER, .end = data + at + entry_len};
        const uint8_t *id = take(&e, id_len);
        struct bd_sensor *s = NULL;
        uint32_t slot = 0;
        if (id == NULL || memchr(id, '\0', id_len) != NULL) {
            rc = -EBADMSG;
        } else if ((s = find_sensor(u, (const char *)id, id_len, &slot)) == NULL) {
            rc = add_sensor(u, slot, (const char *)id, id_len, &e, meas_len, n_tags, &s);
        } else {
            skip_tags(&e, meas_len, n_tags);
            rc = e.bad ? -EBADMSG : 0;
        }
        if (rc == 0) {
            rc = read_names(s, &e, n_names);
        }
        if (rc == 0) {
            rc = read_readings(u, s, &e, start_ms, page, n_readings, lim);
        }
        if (rc == 0 && e.p != e.end) {
            rc = -EBADMSG; /* the entry's length and its contents disagree */
        }
        r.p = data + at + entry_len;
    }
    if (rc < 0) {
        if (rc == -EBADMSG) {
            bd_err_set(err, rc, "unplaced spool record: entry at byte %zu of %zu does not parse",
                       at, len);
        } else {
            bd_err_set(err, rc, "unplaced spool record: out of memory loading it");
        }
        bd_unplaced_free(u);
        return rc;
    }
    *out = u;
    return 0;
}
