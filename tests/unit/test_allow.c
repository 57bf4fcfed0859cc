/*
 * Unit tests for src/allow.c: CIDR parsing (IPv4, IPv6, bare addresses, the edge prefixes,
 * malformed text, host bits), matching of IPv4, IPv6 and IPv4-mapped peers, and the
 * per-source connection counts (IPv6 per /64, deletion that keeps every other key findable).
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/allow.h"

static struct bd_cidr parse_ok(const char *text) {
    struct bd_cidr c;
    char why[200] = "";
    int rc = bd_cidr_parse(text, &c, why, sizeof(why));
    cr_assert_eq(rc, 0, "\"%s\": %s", text, why);
    return c;
}

static void parse_fails(const char *text, const char *needle) {
    struct bd_cidr c;
    char why[200] = "";
    cr_assert_eq(bd_cidr_parse(text, &c, why, sizeof(why)), -EINVAL, "\"%s\" was accepted", text);
    cr_assert_not_null(strstr(why, needle), "\"%s\": \"%s\" lacks \"%s\"", text, why, needle);
}

static void formats_as(const char *text, const char *want) {
    struct bd_cidr c = parse_ok(text);
    char buf[BD_CIDR_TEXT_LEN];
    bd_cidr_format(&c, buf, sizeof(buf));
    cr_assert_str_eq(buf, want, "\"%s\" formats as \"%s\"", text, buf);
    /* And the text reads back to the same prefix. */
    struct bd_cidr d = parse_ok(buf);
    cr_assert_eq(memcmp(&c, &d, sizeof(c)), 0, "\"%s\" does not read back", buf);
}

static struct sockaddr_storage addr(const char *text) {
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, text, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons(1234);
    } else {
        cr_assert_eq(inet_pton(AF_INET6, text, &v6->sin6_addr), 1, "bad test address %s", text);
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons(1234);
    }
    return ss;
}

static bool matches(const char *prefix, const char *peer) {
    struct bd_cidr c = parse_ok(prefix);
    struct sockaddr_storage ss = addr(peer);
    struct bd_addr128 a;
    cr_assert(bd_addr128_from_sockaddr((const struct sockaddr *)&ss, &a));
    return bd_cidr_match(&c, &a);
}

Test(allow, parses_and_formats_prefixes) {
    formats_as("10.0.0.0/8", "10.0.0.0/8");
    formats_as("192.168.1.7", "192.168.1.7/32");
    formats_as("192.168.1.7/32", "192.168.1.7/32");
    formats_as("0.0.0.0/0", "0.0.0.0/0");
    formats_as("fd00::/8", "fd00::/8");
    formats_as("::1", "::1/128");
    formats_as("2001:db8::1/128", "2001:db8::1/128");
    formats_as("::/0", "::/0");
    /* The mapped form of an IPv4 prefix is that prefix. */
    formats_as("::ffff:10.0.0.0/104", "10.0.0.0/8");
    formats_as("::ffff:0:0/96", "0.0.0.0/0");
    formats_as("fe80::/10", "fe80::/10");
}

Test(allow, refuses_malformed_prefixes) {
    parse_fails("", "not an address");
    parse_fails("/8", "not an address");
    parse_fails("10.0.0.0/", "prefix length");
    parse_fails("10.0.0.0/33", "from 0 to 32");
    parse_fails("::/129", "from 0 to 128");
    parse_fails("10.0.0.0/-1", "prefix length");
    parse_fails("10.0.0.0/+8", "prefix length");
    parse_fails("10.0.0.0/8/8", "prefix length");
    parse_fails("10.0.0.0/8 ", "prefix length");
    parse_fails("10.0.0.0/0008", "prefix length");
    parse_fails("10.0.0", "not an IPv4 or IPv6 address");
    parse_fails("256.0.0.0/8", "not an IPv4 or IPv6 address");
    parse_fails(" 10.0.0.0/8", "not an IPv4 or IPv6 address");
    parse_fails("localhost", "no host names");
    parse_fails("[::1]/128", "not an IPv4 or IPv6 address");
    parse_fails("fe80::1%eth0", "not an IPv4 or IPv6 address");
    parse_fails("1:2:3:4:5:6:7:8:9", "not an IPv4 or IPv6 address");
}

Test(allow, refuses_host_bits_beyond_the_prefix_and_names_the_network) {
    parse_fails("10.0.0.1/8", "did you mean 10.0.0.0/8?");
    parse_fails("192.168.1.1/24", "did you mean 192.168.1.0/24?");
    parse_fails("1.0.0.0/0", "did you mean 0.0.0.0/0?");
    parse_fails("fd00::1/8", "did you mean fd00::/8?");
    parse_fails("2001:db8::8000:0:0:0/64", "did you mean 2001:db8::/64?");
    parse_fails("::1/0", "did you mean ::/0?");
    parse_fails("10.0.0.1/31", "did you mean 10.0.0.0/31?");
}

Test(allow, matches_ipv4) {
    cr_assert(matches("10.0.0.0/8", "10.255.1.2"));
    cr_assert(!matches("10.0.0.0/8", "11.0.0.0"));
    cr_assert(!matches("10.0.0.0/8", "9.255.255.255"));
    cr_assert(matches("127.0.0.1", "127.0.0.1"));
    cr_assert(!matches("127.0.0.1", "127.0.0.2"));
    cr_assert(matches("127.0.0.2/31", "127.0.0.3"));
    cr_assert(!matches("127.0.0.2/31", "127.0.0.4"));
    cr_assert(matches("0.0.0.0/0", "1.2.3.4"));
    cr_assert(matches("0.0.0.0/0", "255.255.255.255"));
    /* An IPv4 prefix never matches a native IPv6 peer, even /0. */
    cr_assert(!matches("0.0.0.0/0", "::1"));
    cr_assert(!matches("0.0.0.0/0", "2001:db8::1"));
}

Test(allow, matches_ipv6) {
    cr_assert(matches("fd00::/8", "fd12:3456::1"));
    cr_assert(!matches("fd00::/8", "fe00::1"));
    cr_assert(matches("::1", "::1"));
    cr_assert(!matches("::1", "::2"));
    cr_assert(matches("2001:db8:0:1::/64", "2001:db8:0:1:ffff:ffff:ffff:ffff"));
    cr_assert(!matches("2001:db8:0:1::/64", "2001:db8:0:2::"));
    /* Prefixes that end inside the low half, and on either side of the halves' boundary. */
    cr_assert(matches("2001:db8::ab00:0:0:0/72", "2001:db8::abff:1:2:3"));
    cr_assert(!matches("2001:db8::ab00:0:0:0/72", "2001:db8::ac00:0:0:0"));
    cr_assert(matches("2001:db8::/63", "2001:db8:0:1::5"));
    cr_assert(!matches("2001:db8::/65", "2001:db8:0:0:8000::"));
    cr_assert(matches("::/0", "2001:db8::1"));
}

Test(allow, ipv4_mapped_peers_match_ipv4_entries) {
    /* A dual-stack socket sees IPv4 senders as ::ffff:a.b.c.d. */
    cr_assert(matches("10.0.0.0/8", "::ffff:10.0.0.5"));
    cr_assert(!matches("10.0.0.0/8", "::ffff:11.0.0.5"));
    cr_assert(matches("127.0.0.1/32", "::ffff:127.0.0.1"));
    cr_assert(matches("0.0.0.0/0", "::ffff:8.8.8.8"));
    cr_assert(matches("::ffff:10.0.0.0/104", "10.1.2.3"));
    /* ::/0 is everything, IPv4 senders on any socket included. */
    cr_assert(matches("::/0", "10.1.2.3"));
    /* IPv4-compatible (::a.b.c.d, deprecated) is not IPv4-mapped. */
    cr_assert(!matches("10.0.0.0/8", "::10.0.0.5"));
}

Test(allow, a_list_matches_any_entry_and_an_empty_list_everyone) {
    struct bd_allow a;
    memset(&a, 0, sizeof(a));
    struct sockaddr_storage p1 = addr("192.168.1.20"), p2 = addr("fd00::7"), p3 = addr("8.8.8.8");
    struct sockaddr_storage p4 = addr("::ffff:192.168.1.21");
    cr_assert(bd_allow_match(&a, (struct sockaddr *)&p3));
    a.e[a.n++] = parse_ok("192.168.1.0/24");
    a.e[a.n++] = parse_ok("fd00::/8");
    cr_assert(bd_allow_match(&a, (struct sockaddr *)&p1));
    cr_assert(bd_allow_match(&a, (struct sockaddr *)&p2));
    cr_assert(!bd_allow_match(&a, (struct sockaddr *)&p3));
    cr_assert(bd_allow_match(&a, (struct sockaddr *)&p4));
    /* No address (a failed getpeername) is never allowed by a list. */
    struct sockaddr_storage none;
    memset(&none, 0, sizeof(none));
    none.ss_family = AF_UNSPEC;
    cr_assert(!bd_allow_match(&a, (struct sockaddr *)&none));
}

static struct bd_addr128 key_of(const char *text) {
    struct sockaddr_storage ss = addr(text);
    struct bd_addr128 k;
    cr_assert(bd_peer_key((const struct sockaddr *)&ss, &k));
    return k;
}

Test(allow, peer_keys_are_ipv4_addresses_and_ipv6_slash_64s) {
    struct bd_addr128 a = key_of("10.0.0.1"), b = key_of("::ffff:10.0.0.1");
    cr_assert(a.hi == b.hi && a.lo == b.lo, "an IPv4 sender counts the same on any socket");
    struct bd_addr128 c = key_of("10.0.0.2");
    cr_assert(!(a.hi == c.hi && a.lo == c.lo));
    struct bd_addr128 d = key_of("2001:db8:0:1::1"), e = key_of("2001:db8:0:1:ffff::9");
    cr_assert(d.hi == e.hi && d.lo == e.lo, "one /64");
    struct bd_addr128 f = key_of("2001:db8:0:2::1");
    cr_assert(!(d.hi == f.hi && d.lo == f.lo));
}

Test(allow, peer_counts_add_and_remove) {
    struct bd_peer_counts t;
    cr_assert_eq(bd_peer_counts_init(&t, 4, 42), 0);
    struct bd_addr128 a = key_of("10.0.0.1"), b = key_of("fd00::1");
    cr_assert_eq(bd_peer_counts_get(&t, &a), 0);
    cr_assert_eq(bd_peer_counts_add(&t, &a), 1);
    cr_assert_eq(bd_peer_counts_add(&t, &a), 2);
    cr_assert_eq(bd_peer_counts_add(&t, &b), 1);
    cr_assert_eq(bd_peer_counts_get(&t, &a), 2);
    bd_peer_counts_remove(&t, &a);
    cr_assert_eq(bd_peer_counts_get(&t, &a), 1);
    bd_peer_counts_remove(&t, &a);
    cr_assert_eq(bd_peer_counts_get(&t, &a), 0);
    cr_assert_eq(bd_peer_counts_get(&t, &b), 1);
    cr_assert_eq(t.used, 1);
    bd_peer_counts_close(&t);
}

/*
 * Many keys in a small table (long probe runs that wrap around the end), removed in an order
 * unlike the insertion order: after every removal each remaining key still has its count.
 */
Test(allow, peer_counts_survive_removals_inside_probe_runs) {
    enum { N = 200 };
    struct bd_peer_counts t;
    cr_assert_eq(bd_peer_counts_init(&t, N, 7), 0);
    struct bd_addr128 keys[N];
    uint32_t want[N];
    for (uint32_t i = 0; i < N; i++) {
        char text[32];
        snprintf(text, sizeof(text), "10.%u.%u.1", i / 7, i % 7);
        keys[i] = key_of(text);
        want[i] = 1 + i % 3;
        for (uint32_t k = 0; k < want[i]; k++) {
            cr_assert_eq(bd_peer_counts_add(&t, &keys[i]), k + 1);
        }
    }
    for (uint32_t step = 0; step < N; step++) {
        uint32_t i = (step * 37) % N; /* 37 is coprime with 200: every key once */
        while (want[i] > 0) {
            bd_peer_counts_remove(&t, &keys[i]);
            want[i]--;
        }
        for (uint32_t j = 0; j < N; j++) {
            cr_assert_eq(bd_peer_counts_get(&t, &keys[j]), want[j], "key %u after step %u", j,
                         step);
        }
    }
    cr_assert_eq(t.used, 0);
    bd_peer_counts_close(&t);
}

Test(allow, peer_counts_refuse_a_key_past_the_size_they_were_made_for) {
    struct bd_peer_counts t;
    cr_assert_eq(bd_peer_counts_init(&t, 4, 1), 0);
    uint32_t added = 0;
    for (uint32_t i = 0; i < 64; i++) {
        char text[32];
        snprintf(text, sizeof(text), "10.0.0.%u", i);
        struct bd_addr128 k = key_of(text);
        added += bd_peer_counts_add(&t, &k) != 0;
    }
    /* Sized for 4, rounded up to a table of 8 that is never more than half full. */
    cr_assert_eq(added, 4);
    bd_peer_counts_close(&t);
}
