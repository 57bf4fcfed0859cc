/*
 * Allow lists (CIDR prefixes) and the per-source connection counts of TCP listeners
 * (include/bucketd/allow.h). No state of its own: the config owns the lists, a TCP listener its
 * table, both used on the ingest thread only.
 */
#include "bucketd/allow.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/common.h"

static uint64_t load_be64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

static void store_be64(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

static struct bd_addr128 from_bytes(const uint8_t b[16]) {
    return (struct bd_addr128){load_be64(b), load_be64(b + 8)};
}

static struct bd_addr128 from_v4(uint32_t host_order) {
    return (struct bd_addr128){0, UINT64_C(0x0000ffff00000000) | host_order};
}

static struct bd_addr128 mask_of(unsigned bits) {
    struct bd_addr128 m = {0, 0};
    if (bits >= 64) {
        m.hi = UINT64_MAX;
        m.lo = bits == 64 ? 0 : UINT64_MAX << (128 - bits);
    } else if (bits > 0) {
        m.hi = UINT64_MAX << (64 - bits);
    }
    return m;
}

static bool is_mapped(const struct bd_addr128 *a) {
    return a->hi == 0 && (a->lo >> 32) == 0xffff;
}

bool bd_addr128_from_sockaddr(const struct sockaddr *sa, struct bd_addr128 *out) {
    if (sa->sa_family == AF_INET) {
        *out = from_v4(ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr));
        return true;
    }
    if (sa->sa_family == AF_INET6) {
        *out = from_bytes(((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr);
        return true;
    }
    return false;
}

static void format_addr(const struct bd_addr128 *a, unsigned bits, char *buf, size_t cap) {
    char text[INET6_ADDRSTRLEN] = "?";
    if (is_mapped(a) && bits >= 96) {
        struct in_addr v4 = {htonl((uint32_t)a->lo)};
        inet_ntop(AF_INET, &v4, text, sizeof(text));
        snprintf(buf, cap, "%s/%u", text, bits - 96);
    } else {
        uint8_t b[16];
        store_be64(b, a->hi);
        store_be64(b + 8, a->lo);
        inet_ntop(AF_INET6, b, text, sizeof(text));
        snprintf(buf, cap, "%s/%u", text, bits);
    }
}

void bd_cidr_format(const struct bd_cidr *c, char *buf, size_t cap) {
    format_addr(&c->net, c->bits, buf, cap);
}

int bd_cidr_parse(const char *text, struct bd_cidr *out, char *why, size_t cap) {
    char host[INET6_ADDRSTRLEN + 1];
    const char *slash = strchr(text, '/');
    size_t hlen = slash != NULL ? (size_t)(slash - text) : strlen(text);
    struct bd_addr128 a;
    unsigned max = 0, bits = 0, offset = 0;

    if (hlen == 0 || hlen >= sizeof(host)) {
        snprintf(why, cap, "\"%s\" is not an address or prefix (e.g. 192.168.1.0/24, fd00::/8)",
                 text);
        return -EINVAL;
    }
    memcpy(host, text, hlen);
    host[hlen] = '\0';
    struct in_addr v4;
    struct in6_addr v6;
    if (inet_pton(AF_INET, host, &v4) == 1) {
        a = from_v4(ntohl(v4.s_addr));
        max = 32;
        offset = 96;
    } else if (inet_pton(AF_INET6, host, &v6) == 1) {
        a = from_bytes(v6.s6_addr);
        max = 128;
    } else {
        snprintf(why, cap,
                 "\"%s\" is not an IPv4 or IPv6 address (e.g. 192.168.1.0/24, fd00::/8; no "
                 "host names)",
                 text);
        return -EINVAL;
    }
    bits = max;
    if (slash != NULL) {
        const char *p = slash + 1;
        unsigned n = 0;
        size_t digits = strspn(p, "0123456789");
        if (digits == 0 || digits > 3 || p[digits] != '\0') {
            snprintf(why, cap, "\"%s\": the prefix length must be a number from 0 to %u", text,
                     max);
            return -EINVAL;
        }
        for (size_t i = 0; i < digits; i++) {
            n = n * 10 + (unsigned)(p[i] - '0');
        }
        if (n > max) {
            snprintf(why, cap, "\"%s\": the prefix length must be a number from 0 to %u", text,
                     max);
            return -EINVAL;
        }
        bits = n;
    }
    bits += offset;
    struct bd_addr128 m = mask_of(bits);
    struct bd_addr128 net = {a.hi & m.hi, a.lo & m.lo};
    if (net.hi != a.hi || net.lo != a.lo) {
        char meant[BD_CIDR_TEXT_LEN];
        format_addr(&net, bits, meant, sizeof(meant));
        snprintf(why, cap, "\"%s\" has host bits set beyond the prefix (did you mean %s?)", text,
                 meant);
        return -EINVAL;
    }
    /* Field by field over zeroes: configs are compared with memcmp, padding included. */
    memset(out, 0, sizeof(*out));
    out->net = net;
    out->mask = m;
    out->bits = (uint8_t)bits;
    return 0;
}

bool bd_allow_match(const struct bd_allow *allow, const struct sockaddr *sa) {
    struct bd_addr128 a;
    if (allow->n == 0) {
        return true;
    }
    if (!bd_addr128_from_sockaddr(sa, &a)) {
        return false;
    }
    for (uint32_t i = 0; i < allow->n; i++) {
        if (bd_cidr_match(&allow->e[i], &a)) {
            return true;
        }
    }
    return false;
}

/* ---- Per-source counts ----------------------------------------------------------------------- */

bool bd_peer_key(const struct sockaddr *sa, struct bd_addr128 *key) {
    if (!bd_addr128_from_sockaddr(sa, key)) {
        return false;
    }
    if (!is_mapped(key)) {
        key->lo = 0; /* IPv6: the /64 */
    }
    return true;
}

int bd_peer_counts_init(struct bd_peer_counts *t, uint32_t max_keys, uint64_t seed) {
    uint32_t n = 8;
    while (n < 2 * (uint64_t)max_keys) {
        n *= 2;
    }
    memset(t, 0, sizeof(*t));
    t->slots = calloc(n, sizeof(t->slots[0]));
    if (t->slots == NULL) {
        return -ENOMEM;
    }
    t->mask = n - 1;
    t->seed = seed;
    return 0;
}

void bd_peer_counts_close(struct bd_peer_counts *t) {
    free(t->slots);
    t->slots = NULL;
}

/* splitmix64's finaliser over both halves and the seed. */
static uint32_t slot_of(const struct bd_peer_counts *t, const struct bd_addr128 *k) {
    uint64_t x = k->hi ^ t->seed;
    x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    x ^= k->lo;
    x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return (uint32_t)x & t->mask;
}

static bool same_key(const struct bd_addr128 *a, const struct bd_addr128 *b) {
    return a->hi == b->hi && a->lo == b->lo;
}

/* The slot holding key, or the free slot where it would go. */
static uint32_t find(const struct bd_peer_counts *t, const struct bd_addr128 *key) {
    uint32_t i = slot_of(t, key);
    while (t->slots[i].count != 0 && !same_key(&t->slots[i].key, key)) {
        i = (i + 1) & t->mask;
    }
    return i;
}

uint32_t bd_peer_counts_get(const struct bd_peer_counts *t, const struct bd_addr128 *key) {
    return t->slots[find(t, key)].count;
}

uint32_t bd_peer_counts_add(struct bd_peer_counts *t, const struct bd_addr128 *key) {
    uint32_t i = find(t, key);
    if (t->slots[i].count == 0) {
        /* At most half full, so probing always ends at a free slot. */
        if (t->used >= (t->mask + 1) / 2) {
            return 0;
        }
        t->slots[i].key = *key;
        t->used++;
    }
    return ++t->slots[i].count;
}

void bd_peer_counts_remove(struct bd_peer_counts *t, const struct bd_addr128 *key) {
    uint32_t i = find(t, key);
    BD_ASSERT(t->slots[i].count > 0);
    if (--t->slots[i].count > 0) {
        return;
    }
    t->used--;
    /* Backward-shift deletion: move up every later entry of the run that may fill the hole. */
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & t->mask; t->slots[j].count != 0; j = (j + 1) & t->mask) {
        uint32_t home = slot_of(t, &t->slots[j].key);
        /* j may move to hole unless its home lies cyclically in (hole, j]. */
        bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole].count = 0;
}
