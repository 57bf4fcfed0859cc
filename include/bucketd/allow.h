/*
 * Who may send, and how many connections one sender may hold: address prefixes (CIDR) for a
 * listener's allow list, and a count of open connections per source. Pure functions over
 * addresses; the table belongs to whoever embeds it (a TCP listener, on the ingest thread).
 *
 * Every address is kept as 128 bits, an IPv4 address as its IPv4-mapped IPv6 form
 * (::ffff:a.b.c.d), so that one compare serves IPv4 sockets, IPv6 sockets and dual-stack
 * sockets whose IPv4 peers arrive as ::ffff:a.b.c.d. An IPv4 prefix a.b.c.d/n is the mapped
 * prefix /96+n: it matches IPv4 peers only. An IPv6 prefix short enough to cover ::ffff:0:0/96
 * (::/0 ... ::/80) matches IPv4 peers too.
 */
#ifndef BUCKETD_ALLOW_H
#define BUCKETD_ALLOW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* Prefixes per allow list; a gateway's LAN needs a handful. */
#define BD_ALLOW_MAX 32
/* Longest text of one prefix: an IPv6 address, '/', three digits. */
#define BD_CIDR_TEXT_LEN 56

/* An address as two big-endian-ordered halves in host integers: hi holds bits 0-63. */
struct bd_addr128 {
    uint64_t hi, lo;
};

struct bd_cidr {
    struct bd_addr128 net;  /* host bits zero */
    struct bd_addr128 mask; /* bits ones */
    uint8_t bits;           /* 0..128, of the 128-bit form */
};

/* A listener's allow list; n == 0 means every sender may send. */
struct bd_allow {
    uint32_t n;
    struct bd_cidr e[BD_ALLOW_MAX];
};

/*
 * "10.0.0.0/8", "192.168.1.7" (= /32), "fd00::/8", "::1" (= /128), "::ffff:10.0.0.0/104".
 * Host bits set beyond the prefix are refused (a typo more often than not). 0, or -EINVAL with
 * the reason in why (cap bytes), which names the prefix that was probably meant.
 */
int bd_cidr_parse(const char *text, struct bd_cidr *out, char *why, size_t cap);

/* Text that bd_cidr_parse takes back to the same prefix: IPv4 form for a mapped /96..128. */
void bd_cidr_format(const struct bd_cidr *c, char *buf, size_t cap);

/* The 128-bit form of an AF_INET or AF_INET6 address; false for any other family. */
bool bd_addr128_from_sockaddr(const struct sockaddr *sa, struct bd_addr128 *out);

static inline bool bd_cidr_match(const struct bd_cidr *c, const struct bd_addr128 *a) {
    return ((a->hi & c->mask.hi) == c->net.hi) & ((a->lo & c->mask.lo) == c->net.lo);
}

/* Whether sa may send: true for an empty list; false for an address of another family. */
bool bd_allow_match(const struct bd_allow *allow, const struct sockaddr *sa);

/*
 * Open connections per source. The key is the IPv4 address, or the /64 of an IPv6 address: one
 * IPv6 host picks any address in its /64 (SLAAC privacy addresses), so counting per address
 * would not limit it. Open addressing with linear probing and backward-shift deletion, at most
 * half full (bd_peer_counts_init sizes it for max_keys), seeded so that a sender cannot choose
 * addresses that collide.
 */
struct bd_peer_counts {
    struct bd_peer_slot {
        struct bd_addr128 key;
        uint32_t count; /* 0: free */
    } * slots;
    uint32_t mask; /* slots - 1, a power of two */
    uint32_t used;
    uint64_t seed;
};

/* Room for max_keys distinct sources. 0, or -ENOMEM. */
int bd_peer_counts_init(struct bd_peer_counts *t, uint32_t max_keys, uint64_t seed);
void bd_peer_counts_close(struct bd_peer_counts *t);
/* The key sa counts under (IPv6: its /64); false for a family without an address. */
bool bd_peer_key(const struct sockaddr *sa, struct bd_addr128 *key);
/* Connections key holds now. */
uint32_t bd_peer_counts_get(const struct bd_peer_counts *t, const struct bd_addr128 *key);
/* One more for key: its new count, or 0 if the table already holds max_keys sources. */
uint32_t bd_peer_counts_add(struct bd_peer_counts *t, const struct bd_addr128 *key);
/* One fewer for key (which must hold one). */
void bd_peer_counts_remove(struct bd_peer_counts *t, const struct bd_addr128 *key);

#endif
