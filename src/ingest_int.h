/*
 * The ingest stage's shared types: struct bd_ingest and the listener slots it holds. Types
 * only; each file's calls are declared in its own header, and each file calls only the files
 * below it (a higher one only through a callback it was handed):
 *
 *   ingest.c       the public API (include/bucketd/ingest.h): the listener set and its reloads,
 *                  stop, abort, resume, introspection; opens and closes listeners through udp.c
 *                  and tcp.c, and the kernel counters through kstats.c
 *   udp.c          UDP listeners (src/udp.h): recvmmsg into the slab, backpressure, the read-out
 *                  at stop
 *   tcp.c          TCP listeners and their connections (src/tcp.h): admission, framing,
 *                  backpressure, the idle sweep; on a TLS listener it feeds each connection's
 *                  filter the ciphertext it reads and writes out what the filter has to send
 *   tcp_tls.c      TLS as that filter (src/tcp_tls.h): a listener's server context, and per
 *                  connection ciphertext in, plaintext and bytes to send out, the handshake's
 *                  deadline and its counters
 *   kstats.c       the kernel's UDP counters (src/kstats_int.h; parsers in
 *                  include/bucketd/kstats.h): its own buffers and timer, the sockets to look
 *                  for asked of ingest.c through a callback
 *   ingest_hold.c  lines held while the wall clock is not trusted (src/ingest_hold.h, hold.h):
 *                  the clock's state at each poll, the release of held lines once it is trusted,
 *                  their save at the stop and load at the start
 *   ingest_loops.c the receive loops of a UDP listener when ingest.loops > 1 (src/ingest_loops.h):
 *                  its extra SO_REUSEPORT sockets, each read by a thread of its own into a
 *                  datagram ring (dgram_ring.h) that the ingest thread empties through udp.c
 *   ingest_core.c  the core under all of them (src/ingest_core.h): listener slots and the
 *                  lifetime of every uv handle, lines to the parser and the sensor table (or to
 *                  the hold), bad line samples, allow refusals, address formatting
 *
 * Threads: everything in these files runs on the ingest thread, the one that owns the uv loop
 * handed to bd_ingest_new(); there are no locks, and no atomics apart from the stats counters,
 * except the receive loops' threads of ingest_loops.c, which touch only their own socket, their
 * datagram ring and the stats counters.
 */
#ifndef BUCKETD_INGEST_INT_H
#define BUCKETD_INGEST_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "bucketd/allow.h"
#include "bucketd/clock.h"
#include "bucketd/hold.h"
#include "bucketd/spool.h"
#include "bucketd/ingest.h"
#include "bucketd/log.h"
#include "bucketd/parse.h"
#include "bucketd/tls.h"

/* At stop, how long a UDP listener may spend reading what its socket buffer still holds. */
#define UDP_STOP_DRAIN_NS (500 * BD_NS_PER_MS)

/* Listener slots: every listener a configuration may have, and as many removed ones still
 * finishing their connections. */
#define LISTENER_SLOTS (2 * BD_MAX_LISTENERS)

struct conn;          /* a TCP connection (tcp.c) */
struct ingest_loops;  /* a UDP listener's extra receive loops (ingest_loops.c) */
struct ingest_kstats; /* the kernel's UDP counters (kstats.c) */

struct listener {
    struct bd_ingest *in;
    uint32_t idx;
    struct bd_listener_config cfg; /* a copy: the config may be reloaded under us */
    char name[192];                /* "listener 2 (tcp 0.0.0.0:8094)" for errors and logs */

    /*
     * Its slot of in->listeners (see struct bd_ingest): in_use from open until everything of a
     * removed listener is gone; active while the configuration has it. closing counts the
     * uv_close() calls on h and sweep whose callbacks have not run: the slot's memory holds
     * those handles, so it is reused only once they are done.
     */
    bool in_use;
    bool active;
    uint32_t closing;

    union {
        uv_handle_t handle;
        uv_udp_t udp;
        uv_tcp_t tcp;
    } h;
    bool h_open;

    struct bd_parser parser;
    bool parser_ok;
    struct bd_point *point;

    struct bd_tls_ctx *tls; /* TCP with listeners[].tls: the server context; else NULL */

    char *slab;          /* UDP only */
    bool udp_paused;     /* UDP: reading stopped for a congested ring (see udp_maybe_pause) */
    uint64_t sock_inode; /* UDP: of the socket, to find it in /proc/net/udp; 0 if unknown */
    /* UDP with ingest.loops > 1: the socket joins a SO_REUSEPORT group with the sockets of
     * the extra receive loops (ingest_loops.c), whose datagrams loop_async brings here. */
    bool reuseport;
    struct ingest_loops *loops;
    uv_async_t loop_async;
    bool loop_async_open;

    /*
     * TCP idle timeout: one sweeping timer per listener rather than a timer per connection.
     * A read then costs one store of the loop's cached time instead of a heap update, the
     * connection holds one handle instead of two, and a sweep over max_connections entries
     * every idle_timeout/4 (at most 1 s) is noise. The price is that a connection may live
     * up to one sweep interval past its timeout, which no client can tell apart from jitter.
     */
    uv_timer_t sweep;
    bool sweep_open;
    struct conn *conns; /* tcp.c's list; NULL when none is open */
    uint32_t n_conns;
    uint32_t n_paused;
    struct bd_peer_counts peers; /* TCP: open connections per source (max_connections_per_ip) */

    uint64_t n_not_allowed;     /* datagrams or connections refused by cfg.allow */
    uint64_t n_rejected_per_ip; /* TCP connections refused by max_connections_per_ip */

    struct bd_ratelimit rl_lines;  /* samples of bad lines */
    uint64_t rl_lines_reported;    /* rl_lines.suppressed already mentioned in a sample */
    struct bd_ratelimit rl_events; /* receive errors, refused connections */
};

struct bd_ingest {
    uv_loop_t *loop;
    struct bd_sensor_table *table;
    struct bd_stats *stats;
    size_t max_line;
    uint32_t n_loops; /* ingest.loops as resolved for this box: receive loops per UDP listener */

    /*
     * Slots, never moved (they hold uv handles): the listeners of the configuration in its order
     * at start, then those a reload adds, in free slots. A removed TCP listener keeps its slot
     * while its connections last. n_listeners is the high-water mark of slots used (every loop
     * over listeners walks that far: a free slot has nothing open, so every step skips it).
     */
    struct listener *listeners;
    uint32_t n_listeners;
    uint32_t cap_listeners; /* LISTENER_SLOTS */

    /* The kernel's UDP counters while a UDP listener is open and the stop has not come (see
     * ingest.h); freed by kstats.c once its timer has closed. */
    struct ingest_kstats *kstats;

    int64_t udp_stop_drain_ns; /* UDP_STOP_DRAIN_NS; shorter in tests */

    uint32_t open_handles; /* uv handles open, listeners', connections' and kstats' alike */
    bool stopping;
    /* Called once, when a stop has no connection left draining its buffer. */
    bd_ingest_stopped_cb stopped_cb;
    void *stopped_arg;
    bool released; /* the owner let go; destroy once open_handles reaches 0 */

    /* The clock's hold (ingest_hold.c): while the wall clock is not trusted (holding), parsed
     * lines go to the hold with their arrival's boot time instead of to the sensor table. */
    const struct bd_clock *clock; /* NULL: the clock is always trusted (unit tests) */
    struct bd_hold *hold;         /* lines held since the last poll */
    bool holding;
    bool unsynced_logged;                /* readings_stamped_unsynced's log line, once a wait */
    struct bd_parser hold_parsers[2][4]; /* per format and precision, made on first use */
    bool hold_parser_ok[2][4];
    struct bd_point *hold_point;
    /* The held-lines spool (<spool.dir>/held; no dir: none, with the blackhole sink), opened
     * when first needed, and the lines of the record being released (acknowledged on disk). */
    struct bd_spool *held_disk;
    struct bd_spool_opts held_opts;
    char *held_dir;
    struct bd_hold *releasing;
    struct bd_ratelimit held_log;
    char boot_id[40];
};

#endif
