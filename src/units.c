/*
 * Strict number, duration, size and address parsers (include/bucketd/units.h), and durations
 * and sizes back to text. A leaf: stateless, any thread; it calls libc alone.
 */
#include "bucketd/units.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Numbers and units ----------------------------------------------------------------------- */

struct unit {
    const char *suffix;
    uint64_t mult;
};

static const struct unit duration_units[] = {
    {"ms", 1}, {"s", BD_MS_PER_S}, {"m", BD_MS_PER_M}, {"h", BD_MS_PER_H}, {NULL, 0}};
/* Decimal "KB"/"kb" are refused on purpose: which multiplier they mean is a guess. */
static const struct unit size_units[] = {
    {"B", 1}, {"KiB", BD_KIB}, {"MiB", BD_MIB}, {"GiB", BD_GIB}, {NULL, 0}};

/*
 * Leading decimal digits of s. strtoull alone would accept spaces, a sign (and negate "-1" into
 * a huge number) and an empty string, so the first character must be a digit.
 */
static int parse_digits(const char *s, uint64_t *out, const char **end) {
    if (s == NULL || *s < '0' || *s > '9') {
        return -EINVAL;
    }
    char *e = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &e, 10);
    if (errno == ERANGE) {
        return -ERANGE;
    }
    *out = v;
    *end = e;
    return 0;
}

int bd_units_parse_uint(const char *s, uint64_t *out) {
    uint64_t v = 0;
    const char *end = NULL;
    int rc = parse_digits(s, &v, &end);
    if (rc < 0) {
        return rc;
    }
    if (*end != '\0') {
        return -EINVAL;
    }
    *out = v;
    return 0;
}

int bd_units_parse_int(const char *s, int64_t *out) {
    bool neg = s != NULL && *s == '-';
    uint64_t v = 0;
    int rc = bd_units_parse_uint(neg ? s + 1 : s, &v);
    if (rc < 0) {
        return rc;
    }
    if (v > (uint64_t)INT64_MAX + neg) {
        return -ERANGE;
    }
    /* -(INT64_MAX + 1) without overflow: negate in unsigned arithmetic. */
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

/* A number and a unit; a bare number is allowed when bare_ok, and 0 always (0 is 0 in any unit). */
static int parse_scaled(const char *s, const struct unit *units, bool bare_ok, uint64_t *out) {
    uint64_t v = 0;
    const char *end = NULL;
    int rc = parse_digits(s, &v, &end);
    if (rc < 0) {
        return rc;
    }
    if (*end == '\0') {
        if (!bare_ok && v != 0) {
            return -EINVAL;
        }
        *out = v;
        return 0;
    }
    for (const struct unit *u = units; u->suffix != NULL; u++) {
        if (strcmp(end, u->suffix) == 0) {
            if (v > UINT64_MAX / u->mult) {
                return -ERANGE;
            }
            *out = v * u->mult;
            return 0;
        }
    }
    return -EINVAL;
}

int bd_parse_duration_ms(const char *s, uint64_t *out_ms) {
    return parse_scaled(s, duration_units, false, out_ms);
}

int bd_parse_size(const char *s, uint64_t *out_bytes) {
    return parse_scaled(s, size_units, true, out_bytes);
}

/* Largest unit that divides v exactly, so the printed text parses back to the same value. */
static void format_scaled(uint64_t v, const struct unit *units, const char *bare_suffix, char *buf,
                          size_t len) {
    const struct unit *best = NULL;
    for (const struct unit *u = units; u->suffix != NULL; u++) {
        if (v != 0 && v % u->mult == 0) {
            best = u;
        }
    }
    if (best == NULL || best->mult == 1) {
        snprintf(buf, len, "%" PRIu64 "%s", v, v == 0 ? "" : bare_suffix);
    } else {
        snprintf(buf, len, "%" PRIu64 "%s", v / best->mult, best->suffix);
    }
}

void bd_units_format_duration_ms(uint64_t ms, char *buf, size_t len) {
    format_scaled(ms, duration_units, "ms", buf, len);
}

void bd_units_format_size(uint64_t bytes, char *buf, size_t len) {
    format_scaled(bytes, size_units, "", buf, len);
}

/* ---- Addresses ------------------------------------------------------------------------------- */

int bd_units_parse_hostport(const char *s, struct sockaddr_storage *out, const char **why) {
    char host[INET6_ADDRSTRLEN + IF_NAMESIZE + 2];
    const char *port_text = NULL;
    size_t host_len = 0;
    bool v6 = false;

    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':') {
            *why = "an IPv6 address takes the form [address]:port";
            return -EINVAL;
        }
        host_len = (size_t)(close - s - 1);
        s++;
        port_text = close + 2;
        v6 = true;
    } else {
        const char *colon = strrchr(s, ':');
        if (colon == NULL) {
            *why = "expected host:port";
            return -EINVAL;
        }
        if (memchr(s, ':', (size_t)(colon - s)) != NULL) {
            *why = "an IPv6 address needs brackets, as in [::1]:8089";
            return -EINVAL;
        }
        host_len = (size_t)(colon - s);
        port_text = colon + 1;
    }
    if (host_len == 0 || host_len >= sizeof(host)) {
        *why = "expected a numeric address before the port";
        return -EINVAL;
    }
    memcpy(host, s, host_len);
    host[host_len] = '\0';

    uint64_t port = 0;
    if (bd_units_parse_uint(port_text, &port) < 0 || port > 65535) {
        *why = "the port must be a number from 0 to 65535";
        return -EINVAL;
    }

    memset(out, 0, sizeof(*out));
    if (v6) {
        struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)out;
        char *scope = strchr(host, '%');
        if (scope != NULL) {
            *scope++ = '\0';
            uint64_t index = 0;
            if (bd_units_parse_uint(scope, &index) == 0 && index <= UINT32_MAX) {
                sin6->sin6_scope_id = (uint32_t)index;
            } else if ((sin6->sin6_scope_id = if_nametoindex(scope)) == 0) {
                *why = "unknown interface after '%'";
                return -EINVAL;
            }
        }
        if (inet_pton(AF_INET6, host, &sin6->sin6_addr) != 1) {
            *why = "not a numeric IPv6 address";
            return -EINVAL;
        }
        sin6->sin6_family = AF_INET6;
        sin6->sin6_port = htons((uint16_t)port);
    } else {
        struct sockaddr_in *sin = (struct sockaddr_in *)out;
        /*
         * inet_pton, not inet_aton or getaddrinfo: those also take "10.1" and "0x7f.1", and a
         * name here would make start-up depend on DNS.
         */
        if (inet_pton(AF_INET, host, &sin->sin_addr) != 1) {
            *why = "the host must be a numeric IPv4 address or a bracketed IPv6 address";
            return -EINVAL;
        }
        sin->sin_family = AF_INET;
        sin->sin_port = htons((uint16_t)port);
    }
    return 0;
}

int bd_parse_hostport(const char *s, struct sockaddr_storage *out) {
    const char *why = NULL;
    if (s == NULL) {
        return -EINVAL;
    }
    return bd_units_parse_hostport(s, out, &why);
}
