/*
 * bd_config_check_binds (config.h): can this host bind the addresses a loaded configuration
 * names? A file copied from another gateway, or the package's example with its placeholder
 * address, passes every schema rule and then fails at start; --check-config asks here first.
 *
 * Each address is tried with bind(2) on a socket of the listener's own type (UDP, or TCP for
 * TCP listeners and metrics.bind) at port 0, closed at once. Port 0, not the configured port:
 * the running daemon holds its own ports, and a check of an edited file before a reload or a
 * restart (the unit's ExecStartPre) must not fail on them; the kernel then refuses only what
 * depends on the address (EADDRNOTAVAIL: no interface holds it; EAFNOSUPPORT: no IPv6 here).
 * No listen(2), so nothing is ever reachable.
 *
 * Runs on the thread that checks a configuration (the main thread, --check-config); no state.
 * Calls only down: src/units.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bucketd/config.h"

/* 0, or the errno of socket(2) or bind(2) for addr with its port set to 0. */
static int try_bind(const struct sockaddr_storage *addr, int type) {
    struct sockaddr_storage a = *addr;
    socklen_t len = sizeof(struct sockaddr_in);
    if (a.ss_family == AF_INET6) {
        ((struct sockaddr_in6 *)&a)->sin6_port = 0;
        len = sizeof(struct sockaddr_in6);
    } else {
        ((struct sockaddr_in *)&a)->sin_port = 0;
    }
    int fd = socket(a.ss_family, type | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return errno;
    }
    int rc = bind(fd, (const struct sockaddr *)&a, len) < 0 ? errno : 0;
    close(fd);
    return rc;
}

static const char *advice(int e) {
    switch (e) {
    case EADDRNOTAVAIL:
        return "no network interface of this host has that address: write one of its "
               "addresses, or 0.0.0.0 for all of them";
    case EAFNOSUPPORT:
        return "IPv6 is not available on this host";
    default:
        return NULL;
    }
}

static void report(const struct bd_config *cfg, struct bd_config_pos at, const char *key,
                   const char *bind, int e, bd_config_warn_cb cb, void *arg) {
    char where[1100], msg[1400];
    if (at.line != 0) {
        snprintf(where, sizeof(where), "%s:%" PRIu32 ":%" PRIu32, cfg->path, at.line, at.col);
    } else {
        snprintf(where, sizeof(where), "%s", cfg->path);
    }
    const char *why = advice(e);
    snprintf(msg, sizeof(msg), "%s: %s: \"%s\" cannot be bound on this host: %s%s%s%s", where, key,
             bind, strerror(e), why != NULL ? " (" : "", why != NULL ? why : "",
             why != NULL ? ")" : "");
    cb(arg, msg);
}

int bd_config_check_binds(const struct bd_config *cfg, bd_config_warn_cb cb, void *arg) {
    int problems = 0;
    for (uint32_t i = 0; i < cfg->n_listeners; i++) {
        const struct bd_listener_config *lc = &cfg->listeners[i];
        int e = try_bind(&lc->addr, lc->proto == BD_PROTO_UDP ? SOCK_DGRAM : SOCK_STREAM);
        if (e != 0) {
            char key[48];
            snprintf(key, sizeof(key), "listeners[%" PRIu32 "].bind", i);
            report(cfg, cfg->at.listener_bind[i], key, lc->bind, e, cb, arg);
            problems++;
        }
    }
    struct sockaddr_storage maddr;
    if (cfg->metrics.bind[0] != '\0' && bd_parse_hostport(cfg->metrics.bind, &maddr) == 0) {
        int e = try_bind(&maddr, SOCK_STREAM);
        if (e != 0) {
            report(cfg, cfg->at.metrics_bind, "metrics.bind", cfg->metrics.bind, e, cb, arg);
            problems++;
        }
    }
    return problems;
}
