/*
 * The kernel's UDP counters (src/kstats.c): parsers of the /proc text they are read from, pure
 * functions over text, public so that tests can feed them samples. What the counters mean, and
 * when the ingest stage reads them, is in include/bucketd/ingest.h.
 */
#ifndef BUCKETD_KSTATS_H
#define BUCKETD_KSTATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The host's UDP counters that count receive drops. */
struct bd_kstats_snmp {
    uint64_t in_errors;     /* Udp: InErrors (includes the RcvbufErrors) */
    uint64_t rcvbuf_errors; /* Udp: RcvbufErrors (socket receive buffer full) */
};

/*
 * Reads the "Udp:" header line and the "Udp:" value line after it out of /proc/net/snmp text
 * (columns are found by name). 0, or -EINVAL if either counter is missing or malformed.
 */
int bd_kstats_parse_snmp(const char *text, size_t len, struct bd_kstats_snmp *out);

/*
 * Reads Udp6InErrors and Udp6RcvbufErrors ("name value" lines) out of /proc/net/snmp6 text.
 * 0, or -EINVAL if either is missing or malformed.
 */
int bd_kstats_parse_snmp6(const char *text, size_t len, struct bd_kstats_snmp *out);

/* A socket to look up in /proc/net/udp{,6}. */
struct bd_kstats_sock {
    uint64_t inode; /* st_ino of the socket's descriptor, as the "inode" column shows it */
    uint64_t drops; /* out: its "drops" column, when found */
    bool found;     /* out: set when a line with this inode was seen */
};

/*
 * Scans /proc/net/udp or /proc/net/udp6 text, whole lines only (the header line and malformed
 * lines are skipped), and fills drops and found of every entry of socks whose inode a line
 * names. Returns how many lines matched. Entries not named are left as they were, so one
 * array can go through both files and through a file read in pieces.
 */
size_t bd_kstats_parse_udp_drops(const char *text, size_t len, struct bd_kstats_sock *socks,
                                 size_t n);

#endif
