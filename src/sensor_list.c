/*
 * The sensor table's listing order (include/bucketd/sensor.h, "Listing"): the sensors silent
 * since a time, by last reading then creation, for GET /sensors (whose page is sensorlist.c) and
 * the bucketd_sensors_silent gauge. One pass over the table's index with a bounded heap in the
 * caller's array. Ingest thread, like the index it reads.
 */
#include "bucketd/sensor.h"

static bool pos_less(const struct bd_sensor_pos *a, const struct bd_sensor_pos *b) {
    return a->last_ns < b->last_ns || (a->last_ns == b->last_ns && a->serial < b->serial);
}

/* out[0..n) is a max-heap by position: move out[i] down to its place. */
static void heap_down(struct bd_sensor_info *h, uint32_t n, uint32_t i) {
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, top = i;
        if (l < n && pos_less(&h[top].pos, &h[l].pos)) {
            top = l;
        }
        if (r < n && pos_less(&h[top].pos, &h[r].pos)) {
            top = r;
        }
        if (top == i) {
            return;
        }
        struct bd_sensor_info tmp = h[i];
        h[i] = h[top];
        h[top] = tmp;
        i = top;
    }
}

static void heap_up(struct bd_sensor_info *h, uint32_t i) {
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!pos_less(&h[parent].pos, &h[i].pos)) {
            return;
        }
        struct bd_sensor_info tmp = h[i];
        h[i] = h[parent];
        h[parent] = tmp;
        i = parent;
    }
}

uint32_t bd_sensor_table_list(const struct bd_sensor_table *t, const struct bd_sensor_pos *after,
                              int64_t before_ns, struct bd_sensor_info *out, uint32_t cap,
                              bool *more) {
    /* The cap smallest positions past `after`: a max-heap of them, whose root is the one a
     * smaller candidate replaces. */
    uint32_t n = 0;
    uint64_t matched = 0;
    for (uint32_t i = 0, n_slots = bd_sensor_table_slots(t); i < n_slots; i++) {
        const struct bd_sensor *s = bd_sensor_table_slot(t, i);
        if (s == NULL || s->last_ns >= before_ns) {
            continue;
        }
        struct bd_sensor_info c = {.s = s, .pos = {s->last_ns, s->serial}, .accepted = s->accepted};
        if (after != NULL && !pos_less(after, &c.pos)) {
            continue;
        }
        matched++;
        if (n < cap) {
            out[n] = c;
            heap_up(out, n++);
        } else if (cap > 0 && pos_less(&c.pos, &out[0].pos)) {
            out[0] = c;
            heap_down(out, n, 0);
        }
    }
    *more = matched > n;
    /* Heap sort: the largest goes last. */
    for (uint32_t k = n; k > 1; k--) {
        struct bd_sensor_info tmp = out[0];
        out[0] = out[k - 1];
        out[k - 1] = tmp;
        heap_down(out, k - 1, 0);
    }
    return n;
}

uint32_t bd_sensor_table_count_silent(const struct bd_sensor_table *t, int64_t before_ns) {
    uint32_t n = 0;
    for (uint32_t i = 0, n_slots = bd_sensor_table_slots(t); i < n_slots; i++) {
        const struct bd_sensor *s = bd_sensor_table_slot(t, i);
        n += s != NULL && s->last_ns < before_ns;
    }
    return n;
}
