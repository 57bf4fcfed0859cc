/*
 * A sensor's block (include/bucketd/sensor_block.h, struct bd_sensor's id_buf): its layout -- the
 * id, the tag offsets, the measurement and the tags after the struct -- written once when the
 * sensor is made, read through the accessors in sensor_block.h. The sensor table (sensor.c) puts its
 * sensors' blocks in its slab; detached sensors (the flusher's unplaced records, tests) come
 * from aligned_alloc here and belong to their caller. No state of its own: any thread.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/sensor_block.h"

size_t bd_sensor_block_size(size_t id_len, uint32_t n_tags, size_t names_len, bool *wide) {
    /* A key's offset from the measurement is below names_len: 16 bits do when it fits. */
    *wide = names_len > UINT16_MAX;
    return offsetof(struct bd_sensor, id_buf) + id_len + 1 +
           bd_sensor_tag_offsets_size(n_tags, *wide) + names_len;
}

void bd_sensor_names_put(struct bd_sensor *s, const char *id, size_t id_len, uint32_t n_tags,
                         bool wide, char *(*put)(void *arg, uint32_t i, char *dst), void *arg) {
    memcpy(s->id_buf, id, id_len);
    s->id_buf[id_len] = '\0';
    s->id_len = (uint32_t)id_len;
    s->n_tags = (uint16_t)n_tags;
    s->tags_wide = wide;
    /* Tag 0's key follows the measurement: offsets for tags 1.. only. */
    char *offs = s->id_buf + id_len + 1;
    char *base = offs + bd_sensor_tag_offsets_size(n_tags, wide);
    char *p = put(arg, 0, base);
    for (uint32_t i = 0; i < n_tags; i++) {
        uint32_t off = (uint32_t)(p - base);
        if (i > 0 && wide) {
            memcpy(offs + (size_t)(i - 1) * 4, &off, 4);
        } else if (i > 0) {
            uint16_t o = (uint16_t)off;
            memcpy(offs + (size_t)(i - 1) * 2, &o, 2);
        }
        p = put(arg, 1 + 2 * i, p);
        p = put(arg, 2 + 2 * i, p);
    }
}

struct detached_names {
    const struct bd_str *measurement, *keys, *values;
};

static char *put_detached(void *arg, uint32_t i, char *dst) {
    const struct detached_names *n = arg;
    const struct bd_str *str = i == 0  ? n->measurement
                               : i % 2 ? &n->keys[i / 2]
                                       : &n->values[i / 2 - 1];
    memcpy(dst, str->ptr, str->len);
    dst[str->len] = '\0';
    return dst + str->len + 1;
}

void bd_sensor_atomics_init(struct bd_sensor *s) {
    atomic_init(&s->n_fields, 0);
    atomic_init(&s->dirty, 0);
    atomic_init(&s->reclaim, 0);
    atomic_init(&s->names_inline, 0);
    atomic_init(&s->first, NULL);
    atomic_init(&s->segs_given, 0);
    atomic_init(&s->flusher_refs, 0);
}

int bd_sensor_detached_new(struct bd_sensor **out, const struct bd_str *id,
                           const struct bd_str *measurement, const struct bd_str *keys,
                           const struct bd_str *values, uint32_t n_tags) {
    *out = NULL;
    if (n_tags > UINT16_MAX) {
        return -EINVAL;
    }
    size_t names_len = measurement->len + 1;
    for (uint32_t i = 0; i < n_tags; i++) {
        names_len += keys[i].len + 1 + values[i].len + 1;
    }
    bool wide;
    size_t block = bd_sensor_block_size(id->len, n_tags, names_len, &wide);
    block = (block + BD_RING_CACHELINE - 1) & ~(size_t)(BD_RING_CACHELINE - 1);
    struct bd_sensor *s = aligned_alloc(BD_RING_CACHELINE, block);
    if (s == NULL) {
        return -ENOMEM;
    }
    memset(s, 0, block);
    struct detached_names n = {measurement, keys, values};
    bd_sensor_names_put(s, id->ptr, id->len, n_tags, wide, put_detached, &n);
    bd_sensor_atomics_init(s);
    *out = s;
    return 0;
}
