/*
 * SPSC ring of whole datagrams (include/bucketd/dgram_ring.h): a receive loop's thread
 * produces, the ingest thread consumes. Each side owns its own line of the struct; the waiting
 * flag has a line of its own. The buffer is allocated at init and freed at close; nothing is
 * allocated per datagram.
 */
#include "bucketd/dgram_ring.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Past the array's end, so that a reader of a record's bytes (the parser classifies 64 bytes
 * at a time) never leaves the allocation. */
#define SLACK 128

int bd_dgram_ring_init(struct bd_dgram_ring *r, uint32_t cap) {
    memset(r, 0, sizeof(*r));
    if (cap < 4096 || (cap & (cap - 1)) != 0) {
        return -EINVAL;
    }
    r->buf = aligned_alloc(BD_DGRAM_ALIGN, (size_t)cap + SLACK);
    if (r->buf == NULL) {
        return -ENOMEM;
    }
    memset(r->buf + cap, 0, SLACK);
    r->mask = cap - 1;
    atomic_init(&r->head, 0);
    atomic_init(&r->tail, 0);
    atomic_init(&r->waiting, 0);
    return 0;
}

void bd_dgram_ring_close(struct bd_dgram_ring *r) {
    free(r->buf);
    r->buf = NULL;
}

uint32_t bd_dgram_ring_capacity(const struct bd_dgram_ring *r) {
    return r->mask + 1;
}

/* Room for n records of max_len and one filler, against the tail value t. */
static bool room_for(const struct bd_dgram_ring *r, uint32_t head, uint32_t t, uint32_t n,
                     uint32_t max_len) {
    uint64_t need = (uint64_t)(n + 1) * bd_dgram_record_size(max_len);
    return (uint64_t)(r->mask + 1) - (uint32_t)(head - t) >= need;
}

bool bd_dgram_ring_fits(struct bd_dgram_ring *r, uint32_t n, uint32_t max_len) {
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (room_for(r, head, r->tail_cache, n, max_len)) {
        return true;
    }
    /* Pairs with the consumer's store of tail in bd_dgram_ring_release: the room it gives
     * back is no longer read. */
    r->tail_cache = atomic_load_explicit(&r->tail, memory_order_acquire);
    return room_for(r, head, r->tail_cache, n, max_len);
}

int bd_dgram_ring_push(struct bd_dgram_ring *r, const void *data, uint32_t len,
                       const struct sockaddr *peer, uint32_t peer_len, int64_t arrival_ns,
                       uint32_t flags) {
    uint32_t cap = r->mask + 1;
    uint32_t need = bd_dgram_record_size(len);
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    uint32_t pos = head & r->mask;
    uint32_t to_end = cap - pos; /* a multiple of BD_DGRAM_ALIGN, never 0 */
    uint32_t total = need <= to_end ? need : to_end + need;
    if (len > cap || total > cap) {
        return -ENOBUFS;
    }
    if (cap - (uint32_t)(head - r->tail_cache) < total) {
        /* Pairs with the consumer's store of tail (bd_dgram_ring_release). */
        r->tail_cache = atomic_load_explicit(&r->tail, memory_order_acquire);
        if (cap - (uint32_t)(head - r->tail_cache) < total) {
            return -ENOBUFS;
        }
    }
    if (need > to_end) {
        struct bd_dgram *fill = (struct bd_dgram *)(r->buf + pos);
        fill->size = to_end;
        fill->len = UINT32_MAX;
        pos = 0;
    }
    struct bd_dgram *d = (struct bd_dgram *)(r->buf + pos);
    d->size = need;
    d->len = len;
    d->arrival_ns = arrival_ns;
    d->flags = flags;
    memset(&d->peer, 0, sizeof(d->peer));
    d->peer_len = peer_len < sizeof(d->peer) ? peer_len : (uint32_t)sizeof(d->peer);
    if (peer != NULL) {
        memcpy(&d->peer, peer, d->peer_len);
    } else {
        d->peer_len = 0;
    }
    memcpy(d->data, data, len);
    /* Publishes the records written above: pairs with the consumer's acquire load of head in
     * bd_dgram_ring_peek. */
    atomic_store_explicit(&r->head, head + total, memory_order_release);
    return 0;
}

bool bd_dgram_ring_wait_begin(struct bd_dgram_ring *r, uint32_t n, uint32_t max_len) {
    /* seq_cst with the consumer's store of tail and exchange of waiting (see the header): if
     * this load misses the tail it stores, its exchange sees this 1. */
    atomic_store_explicit(&r->waiting, 1, memory_order_seq_cst);
    uint32_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
    r->tail_cache = atomic_load_explicit(&r->tail, memory_order_seq_cst);
    if (room_for(r, head, r->tail_cache, n, max_len)) {
        /* A wake-up the consumer sends anyway is only a spurious one. */
        atomic_store_explicit(&r->waiting, 0, memory_order_relaxed);
        return false;
    }
    return true;
}

const struct bd_dgram *bd_dgram_ring_peek(struct bd_dgram_ring *r) {
    for (;;) {
        if (r->next == r->head_cache) {
            /* Pairs with the producer's release store of head in bd_dgram_ring_push. */
            r->head_cache = atomic_load_explicit(&r->head, memory_order_acquire);
            if (r->next == r->head_cache) {
                return NULL;
            }
        }
        const struct bd_dgram *d = (const struct bd_dgram *)(r->buf + (r->next & r->mask));
        if (d->len != UINT32_MAX) {
            return d;
        }
        r->next += d->size; /* a filler up to the end of the array */
    }
}

void bd_dgram_ring_pop(struct bd_dgram_ring *r) {
    const struct bd_dgram *d = (const struct bd_dgram *)(r->buf + (r->next & r->mask));
    r->next += d->size;
}

bool bd_dgram_ring_release(struct bd_dgram_ring *r) {
    if (atomic_load_explicit(&r->tail, memory_order_relaxed) == r->next) {
        return false; /* nothing popped since: the producer saw this tail already */
    }
    /* Gives the room back (the producer's acquire loads pair with it) and, seq_cst with the
     * producer's store of waiting and load of tail, decides the wake-up (see the header). */
    atomic_store_explicit(&r->tail, r->next, memory_order_seq_cst);
    return atomic_exchange_explicit(&r->waiting, 0, memory_order_seq_cst) != 0;
}
