/*
 * Lock-free single-producer / single-consumer ring of whole datagrams (variable-size records),
 * the hand-off from a receive loop (src/ingest_loops.c) to the ingest thread.
 *
 * The producer is one receive loop's thread, the consumer the ingest thread. As in ring.h,
 * head and tail are free-running 32-bit byte counters 128 bytes apart, each side loads its own
 * relaxed and the other's with acquire (into a private copy), and publishes its own with
 * release. A record is a 64-byte header (struct bd_dgram) and the datagram's bytes, rounded up
 * to 64, and never wraps: one that does not fit before the end of the array is preceded by a
 * filler record up to the end and starts again at 0.
 *
 * Waiting for room: a producer that finds too little room says so (bd_dgram_ring_wait_begin)
 * and sleeps until the consumer, having freed some, wakes it. The flag and the tail form a
 * store-buffer pattern (each side writes one word, then reads the other's): the four accesses
 * are seq_cst, so at least one side sees the other's store and no wake-up is lost. Nothing
 * else in the ring is seq_cst.
 */
#ifndef BUCKETD_DGRAM_RING_H
#define BUCKETD_DGRAM_RING_H

#include <netinet/in.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "bucketd/ring.h"

/* Bytes of a record header; records start at multiples of it. */
#define BD_DGRAM_ALIGN 64
/* bd_dgram.flags: the kernel cut the datagram to fit the receive slot (MSG_TRUNC). */
#define BD_DGRAM_TRUNCATED 1u

/* One record: a datagram as it arrived. */
struct bd_dgram {
    uint32_t size;      /* bytes the record takes in the ring, header included */
    uint32_t len;       /* bytes of data; UINT32_MAX: filler up to the end of the array */
    int64_t arrival_ns; /* wall clock when it was read */
    uint32_t flags;     /* BD_DGRAM_* */
    uint32_t peer_len;
    union {
        struct sockaddr sa;
        struct sockaddr_in in4;
        struct sockaddr_in6 in6;
    } peer;
    alignas(BD_DGRAM_ALIGN) char data[];
};
_Static_assert(sizeof(struct bd_dgram) == BD_DGRAM_ALIGN, "one header line");

struct bd_dgram_ring {
    union {
        struct {
            _Atomic uint32_t head; /* producer writes; consumer reads */
            uint32_t tail_cache;   /* producer's copy of tail, never ahead of it */
            uint32_t mask;
            unsigned char *buf;
        };
        alignas(BD_RING_LINE) unsigned char producer_line_[BD_RING_CACHELINE];
    };
    union {
        struct {
            _Atomic uint32_t tail; /* consumer writes; producer reads */
            uint32_t head_cache;   /* consumer's copy of head, never ahead of it */
            uint32_t next;         /* consumer: where the next record starts (popped, not
                                      yet published as tail) */
        };
        alignas(BD_RING_LINE) unsigned char consumer_line_[BD_RING_CACHELINE];
    };
    /* 1 while the producer waits for room: set by it, cleared (exchanged) by the consumer. */
    alignas(BD_RING_CACHELINE) _Atomic uint32_t waiting;
};

/* cap: bytes, a power of two, at least 4 KiB. Returns 0 or -EINVAL / -ENOMEM. */
int bd_dgram_ring_init(struct bd_dgram_ring *r, uint32_t cap);
void bd_dgram_ring_close(struct bd_dgram_ring *r);
uint32_t bd_dgram_ring_capacity(const struct bd_dgram_ring *r);

/* Bytes one datagram of len bytes takes, header included (a filler may come on top). */
static inline uint32_t bd_dgram_record_size(uint32_t len) {
    return (uint32_t)sizeof(struct bd_dgram) +
           ((len + BD_DGRAM_ALIGN - 1) & ~(uint32_t)(BD_DGRAM_ALIGN - 1));
}

/* ---- Producer ---- */

/*
 * Whether n datagrams of at most max_len bytes each surely fit now, wherever the array's end
 * falls among them (refreshes the copy of tail when the copy says no).
 */
bool bd_dgram_ring_fits(struct bd_dgram_ring *r, uint32_t n, uint32_t max_len);

/* Copy one datagram in and publish it (release). 0, or -ENOBUFS without room (nothing
 * written). peer_len bytes of peer are kept (at most a sockaddr_in6). */
int bd_dgram_ring_push(struct bd_dgram_ring *r, const void *data, uint32_t len,
                       const struct sockaddr *peer, uint32_t peer_len, int64_t arrival_ns,
                       uint32_t flags);

/*
 * The producer is about to sleep until n datagrams of max_len fit: note it (seq_cst), then
 * look again. true: still no room, sleep (the consumer's bd_dgram_ring_release will say to
 * wake it); false: room came meanwhile, the note is withdrawn, go on.
 */
bool bd_dgram_ring_wait_begin(struct bd_dgram_ring *r, uint32_t n, uint32_t max_len);

/* ---- Consumer ---- */

/* The oldest datagram not popped, or NULL when there is none (fillers are skipped). It stays
 * in place until its room is published by bd_dgram_ring_release. */
const struct bd_dgram *bd_dgram_ring_peek(struct bd_dgram_ring *r);
/* Done with the datagram peek returned. */
void bd_dgram_ring_pop(struct bd_dgram_ring *r);
/* Give the room of the popped datagrams back to the producer. Returns true when the producer
 * was waiting for room: wake it. */
bool bd_dgram_ring_release(struct bd_dgram_ring *r);

#endif
