/*
 * bucketd-inspect top: a live view of a running daemon built from its /metrics endpoint
 * (tools/inspect_top.c). bucketd-inspect's argument parser (tools/bucketd-inspect.c) fills the
 * options and hands over; nothing here needs MongoDB.
 */
#ifndef BUCKETD_INSPECT_TOP_H
#define BUCKETD_INSPECT_TOP_H

#include <stdbool.h>
#include <stdint.h>

struct bd_top_options {
    /* "http://HOST:PORT[/PATH]" or "HOST:PORT" (path /metrics); the config's metrics.bind
     * when that is what the caller found. Never NULL. */
    const char *target;
    uint64_t interval_ms; /* between scrapes; the rates are differences over it */
    bool once;            /* one plain snapshot after two scrapes, then exit */
};

/* Runs the view until 'q', a signal, or (--once) the snapshot. Returns the exit status. */
int bd_top_run(const struct bd_top_options *o);

#endif
