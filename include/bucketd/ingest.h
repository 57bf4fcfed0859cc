/*
 * Listeners: UDP (libuv recvmmsg into a preallocated slab) and TCP (newline framing per
 * connection). Everything here runs on the ingest thread, which owns the uv loop; each line is
 * parsed with the listener's parser and handed to the sensor table. With a UDP listener the
 * ingest thread also reads the kernel's UDP drop counters from /proc, once a second and once
 * more at stop, into the stats (see below; src/kstats.c).
 */
#ifndef BUCKETD_INGEST_H
#define BUCKETD_INGEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "bucketd/config.h"
#include "bucketd/sensor.h"
#include "bucketd/stats.h"

struct bd_ingest;

/*
 * Bind every listener of cfg on loop and start reading. Errors name the listener's bind. On
 * error, handles already opened are closed and free themselves in their close callbacks: run the
 * loop before uv_loop_close().
 */
int bd_ingest_new(struct bd_ingest **out, uv_loop_t *loop, const struct bd_config *cfg,
                  struct bd_sensor_table *table, struct bd_stats *stats, struct bd_err *err);

/*
 * A reload: make the open listeners those of cfg (matched by proto and address, as
 * bd_config_reload_merge matches them). Listeners only in cfg are opened; a removed listener
 * is closed as at a stop. A listener that cannot be opened is logged and left out of cfg (so
 * that cfg says what runs): -1 then, else 0.
 */
int bd_ingest_set_listeners(struct bd_ingest *in, struct bd_config *cfg);

/* Called on the loop thread when a stop has finished with every connection. */
typedef void (*bd_ingest_stopped_cb)(void *arg);

/*
 * Stop taking input: close every listener, stop reading every connection. Complete lines
 * already received still go to the rings under backpressure: a connection that has to wait for
 * ring space stays open (not read) until bd_ingest_resume() finishes it or bd_ingest_abort()
 * gives up on it. cb runs once no connection is left (possibly before this returns). Bytes
 * never processed (kernel backlog, a torn last line) are counted in tcp_unread_at_stop. The
 * caller then runs the loop until the close callbacks have fired and calls bd_ingest_free().
 */
void bd_ingest_stop(struct bd_ingest *in, bd_ingest_stopped_cb cb, void *arg);

/*
 * The wall clock's trust (clock.h): while it is not trusted, parsed lines are held (hold.h)
 * instead of accepted, and released, stamped and judged at their true wall time, once it is.
 * set_clock takes back the lines an earlier stop saved in spool.dir; clock_tick follows the
 * clock after each of the owner's polls; save_held, at the stop (after the loop), saves what is
 * still held. Without set_clock every line is accepted at once (the clock always trusted).
 */
struct bd_clock;
int bd_ingest_set_clock(struct bd_ingest *in, const struct bd_clock *clock,
                        const struct bd_config *cfg, struct bd_err *err);
void bd_ingest_clock_tick(struct bd_ingest *in);
void bd_ingest_save_held(struct bd_ingest *in);

/*
 * How long a stop may spend reading out what a UDP socket buffer still holds (default 500 ms;
 * tests shorten it). Datagrams still queued after it are discarded and counted in
 * udp_unread_at_stop.
 */
void bd_ingest_set_udp_stop_drain(struct bd_ingest *in, int64_t ns);

/* The stop deadline passed: close the connections still waiting, counting their bytes. */
void bd_ingest_abort(struct bd_ingest *in);

/* Ring space came free: TCP connections paused by backpressure resume reading (or, during a
 * stop, finish their buffers). */
void bd_ingest_resume(struct bd_ingest *in);

/*
 * Release everything once the loop has run the close callbacks that bd_ingest_stop() started.
 * Called earlier (or without a stop) it stops first and the last close callback frees instead,
 * so the loop must still be run before uv_loop_close(). bd_ingest_free(NULL) is a no-op.
 */
void bd_ingest_free(struct bd_ingest *in);

/* Introspection for tests and metrics (loop thread only). */
/* TCP connections open right now, over all listeners. */
uint32_t bd_ingest_connections(const struct bd_ingest *in);
/* TCP connections whose reading is paused by backpressure. */
uint32_t bd_ingest_paused(const struct bd_ingest *in);
/* Bound port of listener idx (0-based, cfg order), useful with "host:0"; or a negative errno. */
int bd_ingest_listener_port(struct bd_ingest *in, uint32_t idx);
/* Listeners, for metrics: how many slots, and what the listener in slot idx (0-based) is;
 * -ENOENT for a slot without a running listener (free, or removed by a reload). */
struct bd_ingest_listener_info {
    enum bd_proto proto;
    enum bd_format format;
    const char *bind;             /* as configured; valid while the listener exists */
    uint32_t connections;         /* TCP connections open now */
    uint64_t drop_not_allowed;    /* datagrams or connections refused by its allow list */
    uint64_t tcp_rejected_per_ip; /* TCP connections refused by max_connections_per_ip */
};
uint32_t bd_ingest_n_listeners(const struct bd_ingest *in);
int bd_ingest_listener_info(const struct bd_ingest *in, uint32_t idx,
                            struct bd_ingest_listener_info *out);

/*
 * Kernel UDP counters. Datagrams the kernel drops never reach us, so only the kernel can count
 * them: udp_socket_drops is the "drops" column of /proc/net/udp and /proc/net/udp6 for our own
 * sockets (found by the inode of their descriptors), udp_kernel_rcvbuf_errors and
 * udp_kernel_in_errors the growth of the host's Udp RcvbufErrors and InErrors in /proc/net/snmp and
 * Udp6RcvbufErrors and Udp6InErrors in /proc/net/snmp6 since bd_ingest_new(). They are read every
 * second and once more by bd_ingest_stop() before the sockets close, and added as deltas, so the
 * stats stay monotonic. If /proc cannot be read, one warning is logged and they stay at 0. The
 * parsers of the /proc text are in include/bucketd/kstats.h.
 */

#endif
