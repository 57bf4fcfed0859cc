/*
 * Buckets due a summary refresh (see include/bucketd/summaries.h; the aggregate that refreshes
 * them is src/queries.c's). Flusher thread only.
 *
 * Two lists: the buckets marked since the last round began (with a hash index, so marking is
 * O(1) and each bucket is listed once), and the round under way, worked through from a cursor.
 */
#include "bucketd/summaries.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "bucketd/alloc.h"
#include "bucketd/common.h"

struct entry {
    char *sensor_id;
    int64_t start_ms;
};

struct bd_summaries {
    /* Marked, waiting for the next round. */
    struct entry *wait;
    uint32_t n_wait, cap_wait;
    uint32_t *slots; /* open addressing: wait index + 1, 0 = empty */
    uint32_t slot_mask;
    /* The round under way: [pos, n_round) still to refresh. */
    struct entry *round;
    uint32_t n_round, cap_round, pos;
};

int bd_summaries_new(struct bd_summaries **out) {
    struct bd_summaries *s = bd_calloc(1, sizeof(*s));
    if (s == NULL) {
        return -ENOMEM;
    }
    *out = s;
    return 0;
}

static void free_entries(struct entry *e, uint32_t from, uint32_t n) {
    for (uint32_t i = from; i < n; i++) {
        free(e[i].sensor_id);
    }
}

void bd_summaries_free(struct bd_summaries *s) {
    if (s == NULL) {
        return;
    }
    free_entries(s->wait, 0, s->n_wait);
    free_entries(s->round, s->pos, s->n_round);
    free(s->wait);
    free(s->slots);
    free(s->round);
    free(s);
}

static uint64_t key_hash(const char *sensor_id, int64_t start_ms) {
    return XXH3_64bits_withSeed(sensor_id, strlen(sensor_id), (uint64_t)start_ms);
}

/* Slot of (sensor_id, start_ms) in the index: its entry's, or the empty one it would take. */
static uint32_t find_slot(const struct bd_summaries *s, const char *sensor_id, int64_t start_ms) {
    uint32_t i = (uint32_t)key_hash(sensor_id, start_ms) & s->slot_mask;
    for (;;) {
        uint32_t v = s->slots[i];
        if (v == 0) {
            return i;
        }
        const struct entry *e = &s->wait[v - 1];
        if (e->start_ms == start_ms && strcmp(e->sensor_id, sensor_id) == 0) {
            return i;
        }
        i = (i + 1) & s->slot_mask;
    }
}

/* Room for one more waiting entry, the index at most half full. */
static int grow_wait(struct bd_summaries *s) {
    if (s->n_wait == s->cap_wait) {
        uint32_t cap = s->cap_wait ? s->cap_wait * 2 : 64;
        struct entry *e = bd_reallocarray(s->wait, cap, sizeof(*e));
        if (e == NULL) {
            return -ENOMEM;
        }
        s->wait = e;
        s->cap_wait = cap;
    }
    if (s->slots == NULL || (uint64_t)(s->n_wait + 1) * 2 > (uint64_t)s->slot_mask + 1) {
        uint32_t n = s->slots ? (s->slot_mask + 1) * 2 : 128;
        uint32_t *slots = bd_calloc(n, sizeof(*slots));
        if (slots == NULL) {
            return -ENOMEM;
        }
        free(s->slots);
        s->slots = slots;
        s->slot_mask = n - 1;
        for (uint32_t k = 0; k < s->n_wait; k++) {
            s->slots[find_slot(s, s->wait[k].sensor_id, s->wait[k].start_ms)] = k + 1;
        }
    }
    return 0;
}

int bd_summaries_mark(struct bd_summaries *s, const char *sensor_id, int64_t start_ms) {
    if (s->slots != NULL && s->slots[find_slot(s, sensor_id, start_ms)] != 0) {
        return 0;
    }
    if (grow_wait(s) < 0) {
        return -ENOMEM;
    }
    size_t len = strlen(sensor_id) + 1;
    char *id = bd_malloc(len);
    if (id == NULL) {
        return -ENOMEM;
    }
    memcpy(id, sensor_id, len);
    s->wait[s->n_wait] = (struct entry){.sensor_id = id, .start_ms = start_ms};
    s->slots[find_slot(s, sensor_id, start_ms)] = ++s->n_wait;
    return 0;
}

uint32_t bd_summaries_waiting(const struct bd_summaries *s) {
    return s->n_wait;
}

uint32_t bd_summaries_in_round(const struct bd_summaries *s) {
    return s->n_round - s->pos;
}

uint32_t bd_summaries_begin(struct bd_summaries *s) {
    if (s->pos < s->n_round || s->n_wait == 0) {
        return s->n_round - s->pos;
    }
    /* The waiting list becomes the round; the round's empty array the waiting list. */
    struct entry *e = s->round;
    uint32_t cap = s->cap_round;
    s->round = s->wait;
    s->cap_round = s->cap_wait;
    s->n_round = s->n_wait;
    s->pos = 0;
    s->wait = e;
    s->cap_wait = cap;
    s->n_wait = 0;
    memset(s->slots, 0, ((size_t)s->slot_mask + 1) * sizeof(*s->slots));
    return s->n_round;
}

uint32_t bd_summaries_next(struct bd_summaries *s, struct bd_page_key *keys, uint32_t max) {
    uint32_t n = BD_MIN(max, s->n_round - s->pos);
    for (uint32_t i = 0; i < n; i++) {
        const struct entry *e = &s->round[s->pos + i];
        keys[i] = (struct bd_page_key){.sensor_id = e->sensor_id, .start_ms = e->start_ms};
    }
    return n;
}

void bd_summaries_advance(struct bd_summaries *s, uint32_t n) {
    n = BD_MIN(n, s->n_round - s->pos);
    free_entries(s->round, s->pos, s->pos + n);
    s->pos += n;
    if (s->pos == s->n_round) {
        s->pos = s->n_round = 0;
    }
}

uint32_t bd_summaries_requeue(struct bd_summaries *s) {
    uint32_t lost = 0;
    for (uint32_t i = s->pos; i < s->n_round; i++) {
        if (bd_summaries_mark(s, s->round[i].sensor_id, s->round[i].start_ms) < 0) {
            lost++;
        }
    }
    free_entries(s->round, s->pos, s->n_round);
    s->pos = s->n_round = 0;
    return lost;
}
