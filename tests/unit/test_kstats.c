/*
 * Unit tests for the parsers of the kernel's UDP counters (include/bucketd/kstats.h): samples
 * of /proc/net/snmp, /proc/net/snmp6 and /proc/net/udp{,6} text as Linux prints them, and this
 * machine's own /proc/net/snmp6. How the ingest stage reads them into the stats (the timer,
 * the read at stop, a listener a reload adds) is tested in test_ingest.c with real sockets.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/common.h"
#include "bucketd/kstats.h"

/* /proc/net/snmp as Linux 6.x prints it (other protocols shortened). */
static const char snmp_sample[] =
    "Ip: Forwarding DefaultTTL InReceives InHdrErrors\n"
    "Ip: 1 64 123456 0\n"
    "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors "
    "IgnoredMulti MemErrors\n"
    "Udp: 17858128 46006 428512 18332646 428510 0 2 0 0\n"
    "UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors "
    "InCsumErrors IgnoredMulti MemErrors\n"
    "UdpLite: 0 0 7 0 7 0 0 0 0\n";

Test(kstats, parse_snmp_reads_udp_columns_by_name) {
    struct bd_kstats_snmp s = {0};
    cr_assert_eq(bd_kstats_parse_snmp(snmp_sample, strlen(snmp_sample), &s), 0);
    cr_expect_eq(s.in_errors, 428512);
    cr_expect_eq(s.rcvbuf_errors, 428510);

    /* Another column order (an older or newer kernel): found by name, not by place. */
    const char *moved = "Udp: RcvbufErrors InDatagrams InErrors\nUdp: 5 99 18446744073709551615\n";
    cr_assert_eq(bd_kstats_parse_snmp(moved, strlen(moved), &s), 0);
    cr_expect_eq(s.rcvbuf_errors, 5);
    cr_expect_eq(s.in_errors, UINT64_MAX);
}

Test(kstats, parse_snmp_rejects_what_it_cannot_read) {
    static const char *const bad[] = {
        "",
        "Ip: Forwarding\nIp: 1\n",
        /* The header alone; the values of UdpLite do not stand in for Udp's. */
        "Udp: InErrors RcvbufErrors\nUdpLite: 1 2\n",
        /* A column missing, a value missing, a value that is not a counter, an overflow. */
        "Udp: InDatagrams InErrors\nUdp: 1 2\n",
        "Udp: InErrors RcvbufErrors\nUdp: 1\n",
        "Udp: InErrors RcvbufErrors\nUdp: 1 -2\n",
        "Udp: InErrors RcvbufErrors\nUdp: 1 18446744073709551616\n",
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(bad); i++) {
        struct bd_kstats_snmp s = {0};
        cr_expect_eq(bd_kstats_parse_snmp(bad[i], strlen(bad[i]), &s), -EINVAL, "%s", bad[i]);
    }
}

/* /proc/net/udp and /proc/net/udp6 lines as the kernel prints them. */
static const char udp_sample[] =
    "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode ref pointer drops            \n"
    "  245: 00000000:0044 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        "
    "0 16623 2 0000000000000000 0        \n"
    "  790: 0100007F:1F99 00000000:0000 07 00000000:00034000 00:00000000 00000000     0        "
    "0 981234 2 0000000000000000 4711     \n"
    "  791: garbage line with too few columns\n"
    "  792: 0100007F:1F9A 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        "
    "0 notanumber 2 0000000000000000 3\n";
static const char udp6_sample[] =
    "  sl  local_address                         remote_address                        st "
    "tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n"
    "  790: 00000000000000000000000001000000:1F99 00000000000000000000000000000000:0000 07 "
    "00000000:00000000 00:00000000 00000000     0        0 981299 2 0000000000000000 12\n";

/* /proc/net/snmp6 as Linux prints it (abridged), UdpLite6 after Udp6 with the same names. */
static const char snmp6_sample[] = "Ip6InReceives                   \t1234\n"
                                   "Icmp6InErrors                   \t0\n"
                                   "Udp6InDatagrams                 \t12\n"
                                   "Udp6NoPorts                     \t0\n"
                                   "Udp6InErrors                    \t17\n"
                                   "Udp6OutDatagrams                \t12\n"
                                   "Udp6RcvbufErrors                \t5\n"
                                   "Udp6SndbufErrors                \t0\n"
                                   "UdpLite6InErrors                \t99\n"
                                   "UdpLite6RcvbufErrors            \t98\n";

Test(kstats, parse_snmp6_reads_udp6_lines_by_name) {
    struct bd_kstats_snmp s = {0, 0};
    cr_assert_eq(bd_kstats_parse_snmp6(snmp6_sample, strlen(snmp6_sample), &s), 0);
    cr_expect_eq(s.in_errors, 17);
    cr_expect_eq(s.rcvbuf_errors, 5);
    const char *bad[] = {
        "",
        "Udp6InErrors 17\n",                            /* no RcvbufErrors */
        "Udp6InErrors 17\nUdp6RcvbufErrors x\n",        /* not a number */
        "Udp6InErrors\nUdp6RcvbufErrors 5\n",           /* no value */
        "UdpLite6InErrors 1\nUdpLite6RcvbufErrors 2\n", /* another protocol */
    };
    for (size_t i = 0; i < BD_ARRAY_LEN(bad); i++) {
        cr_expect_eq(bd_kstats_parse_snmp6(bad[i], strlen(bad[i]), &s), -EINVAL, "%s", bad[i]);
    }
    /* The machine's own file, where the kernel has IPv6. */
    FILE *f = fopen("/proc/net/snmp6", "r");
    if (f != NULL) {
        char buf[16384];
        size_t n = fread(buf, 1, sizeof(buf), f);
        fclose(f);
        cr_expect_eq(bd_kstats_parse_snmp6(buf, n, &s), 0, "this kernel's /proc/net/snmp6");
    }
}

Test(kstats, parse_udp_drops_finds_sockets_by_inode) {
    struct bd_kstats_sock socks[3] = {{981234, 0, false}, {981299, 0, false}, {5, 77, false}};
    cr_expect_eq(bd_kstats_parse_udp_drops(udp_sample, strlen(udp_sample), socks, 3), 1);
    cr_expect_eq(bd_kstats_parse_udp_drops(udp6_sample, strlen(udp6_sample), socks, 3), 1);
    cr_expect(socks[0].found);
    cr_expect_eq(socks[0].drops, 4711);
    cr_expect(socks[1].found);
    cr_expect_eq(socks[1].drops, 12);
    /* Not listed: left alone. */
    cr_expect(!socks[2].found);
    cr_expect_eq(socks[2].drops, 77);

    /* Read in pieces, as the daemon reads a long file: whole lines go through one at a time. */
    struct bd_kstats_sock again = {981234, 0, false};
    const char *p = udp_sample;
    const char *end = udp_sample + strlen(udp_sample);
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl != NULL ? (size_t)(nl - p) + 1 : (size_t)(end - p);
        bd_kstats_parse_udp_drops(p, len, &again, 1);
        p += len;
    }
    cr_expect(again.found);
    cr_expect_eq(again.drops, 4711);
    /* The last line without its '\n' still counts. */
    struct bd_kstats_sock last = {981299, 0, false};
    cr_expect_eq(bd_kstats_parse_udp_drops(udp6_sample, strlen(udp6_sample) - 1, &last, 1), 1);
    cr_expect_eq(last.drops, 12);
}
