/*
 * Daemon-wide counters. Each counter has one writing thread (named beside it), so writers use a
 * relaxed load and store (see BD_STAT_ADD) and readers (stats line, metrics) relaxed loads. The
 * X-macro keeps the list in one place for printing.
 */
#ifndef BUCKETD_STATS_H
#define BUCKETD_STATS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* clang-format off */
/* X(name, help) */
#define BD_STATS_LIST(X)                                                                   \
    /* ingest thread */                                                                    \
    X(udp_datagrams, "UDP datagrams received")                                            \
    X(udp_bytes, "UDP payload bytes received")                                            \
    X(udp_truncated, "UDP datagrams dropped because they were truncated")                  \
    X(udp_datagrams_other_loops, "UDP datagrams read by a receive loop past the first (ingest.loops)") \
    X(udp_recv_errors, "UDP receive errors reported by libuv")                            \
    X(udp_socket_drops, "datagrams the kernel dropped on bucketd's UDP sockets (/proc/net/udp)") \
    X(udp_kernel_rcvbuf_errors,                                                            \
      "host-wide UDP receive-buffer drops since start (/proc/net/snmp{,6})")              \
    X(udp_kernel_in_errors, "host-wide UDP InErrors since start (/proc/net/snmp{,6})")        \
    X(udp_pauses, "times UDP reading paused for the buffer pool past its high-water mark")           \
    X(udp_unread_at_stop, "UDP datagrams still queued past the read-out at a stop (or a listener's removal), discarded") \
    X(tcp_connections, "TCP connections accepted")                                        \
    X(tcp_rejected, "TCP connections refused (max_connections)")                           \
    X(tcp_rejected_per_ip, "TCP connections refused (max_connections_per_ip)")             \
    X(drop_not_allowed, "UDP datagrams and TCP connections dropped: sender not in allow")  \
    X(tcp_bytes, "TCP payload bytes received")                                            \
    X(tcp_idle_closed, "TCP connections closed by the idle timeout")                       \
    X(tcp_unread_at_stop, "TCP bytes never processed because the daemon stopped")            \
    X(tls_handshakes, "TLS handshakes completed on TCP listeners with tls")                 \
    X(tls_handshake_failures, "TLS connections closed: handshake failed (plain text, bad or missing client certificate, protocol error)") \
    X(tls_handshake_timeouts, "TLS connections closed: handshake not finished in time")       \
    X(tls_errors, "TLS connections closed: the session failed after its handshake")        \
    X(tls_output_pauses, "times a TLS connection stopped reading: its peer left 64 KiB of TLS output unread") \
    X(lines, "non-empty, non-comment input lines")                                        \
    X(readings_accepted, "readings accepted into a sensor queue")                           \
    X(drop_line_too_long, "lines dropped: longer than limits.max_line")                    \
    X(drop_parse_error, "lines dropped: syntax error")                                     \
    X(drop_too_many_fields, "lines dropped: more fields than limits.max_fields")           \
    X(drop_no_numeric, "lines dropped: no numeric or boolean field left")                  \
    X(drop_bad_name, "lines dropped: a name unusable in BSON (empty, bad UTF-8, NUL)")     \
    X(drop_field_limit, "lines dropped: sensor already has BD_SENSOR_MAX_FIELDS fields")   \
    X(drop_too_old, "lines dropped: timestamp older than buckets.max_late")               \
    X(drop_too_new, "lines dropped: timestamp further ahead than buckets.max_future")      \
    X(readings_held, "lines held while the wall clock was not trusted (time.wait_for_sync)") \
    X(drop_clock_hold_full, "lines dropped: the clock's hold was full (limits.memory / 4)") \
    X(readings_stamped_unsynced,                                                             \
      "held lines stamped and judged with an unsynchronised clock (wait bound, or a reboot)") \
    X(drop_buffer_full, "readings dropped: the buffer pool (half of limits.memory) was full") \
    X(drop_sensor_limit, "readings dropped: limits.max_sensors reached")                   \
    X(drop_sensor_memory, "readings dropped: a new sensor or field name past limits.sensor_memory") \
    X(drop_name_too_long, "readings dropped: a sensor id or field key longer than limits.max_name") \
    X(drop_sensor_busy, "UDP readings dropped: their sensor held its share of a buffer pool past half full, or was new then") \
    X(tcp_sensor_pauses, "times a TCP connection stopped reading for a busy sensor (see drop_sensor_busy)") \
    X(tcp_congestion_pauses, "times a TCP connection stopped reading for a congested buffer pool (every connection waits)") \
    X(sensors_evicted, "sensors forgotten after limits.sensor_idle without readings")       \
    X(string_fields_dropped, "string fields dropped (strings are not stored)")              \
    /* loop thread (reload.c) */                                                           \
    X(config_reloads, "SIGHUP reloads that read a valid file (its reloadable keys applied)") \
    X(config_reload_errors, "SIGHUP reloads refused: the file did not validate")          \
    /* flusher thread */                                                                   \
    X(readings_flushed, "readings written to the sink")                                    \
    X(flushes, "flush cycles with data")                                                   \
    X(flushes_for_memory, "flushes started before flush.interval: the batch filled to a quarter of the batches' memory") \
    X(bulk_writes, "bulk writes that reached MongoDB")                                                     \
    X(updates_sent, "bucket updates that reached MongoDB (one per bucket page per flush and attempt)")                 \
    X(bulk_retries, "bulk writes retried after a transient error")                         \
    X(updates_quarantined, "bucket updates given up (kept in the dead-letter file)")               \
    X(readings_quarantined, "readings inside quarantined updates")                         \
    X(deadletter_write_errors, "quarantined updates the dead-letter file could not keep (full, disk error)") \
    X(deadletter_dropped_readings, "readings of quarantined updates kept nowhere (dead-letter file full or failing)") \
    X(updates_already_applied, "bucket updates MongoDB had already applied (a retried write)") \
    X(writer_conflicts, "updates refused: a bucket holds a newer sequence of this writer_id")  \
    X(page_lookups, "queries learning the pages of buckets written before this start")       \
    X(readings_spooled, "readings written to the on-disk spool (MongoDB away or behind)")    \
    X(spool_records_replayed, "spool records written to MongoDB and acknowledged")          \
    X(readings_spooled_unplaced,                                                             \
      "readings spooled before their pages or sequence number were known (placed at replay)") \
    X(spool_records_placed, "unplaced spool records placed, numbered and journaled at replay") \
    X(spool_corrupt_records, "spool records skipped for a bad checksum (each counted once)") \
    X(spool_dropped_readings, "readings dropped from a full spool (spool.when_full)")        \
    X(spool_write_errors, "spool writes or syncs that failed (disk full, I/O error)")        \
    X(summary_refreshes, "aggregates that recomputed summary documents")                    \
    X(summary_buckets_refreshed, "summary documents recomputed (one per bucket and refresh)") \
    X(summary_refresh_errors, "summary refreshes that failed (tried again at the next interval)") \
    X(summary_buckets_skipped, "buckets whose summary was not refreshed after a write (stop, memory)") \
    X(readings_lost, "readings given up at shutdown: not written, not spooled")

/* Gauges: values now, set by the flusher thread at each step (BD_GAUGE_SET). */
#define BD_GAUGES_LIST(X)                                                                   \
    X(pool_segments_in_use, "buffer pool units holding readings now")                       \
    X(pool_segments_high_water, "most buffer pool units in use at once since start")        \
    X(pool_segments, "buffer pool units in all (half of limits.memory)")                    \
    X(pending_batches, "batches in memory not settled: the one being written, the next")    \
    X(pending_readings, "readings in those batches")                                        \
    X(spool_bytes, "bytes of the spool's segment files")                                    \
    X(spool_segments, "spool segment files")                                                \
    X(spool_readings, "readings in the spool not yet replayed (of the segments read so far)")  \
    X(summary_buckets_pending, "buckets whose summary document waits for its refresh")      \
    X(oldest_pending_age_ms, "age of the oldest reading accepted and not yet written (ms)")  \
    X(previous_stop_readings_lost, "readings the previous run's stop gave up (its readings_lost)")
/* clang-format on */

/*
 * Histograms (exported by /metrics, src/metrics.c): fixed upper bounds, ascending, and one
 * more bucket past the last for +Inf. Counts per bucket are not cumulative here (the exposition
 * adds them up); sum is in the histogram's unit (microseconds, readings). One writing thread.
 */
#define BD_HIST_MAX_BUCKETS 16
struct bd_histogram {
    _Atomic uint64_t bucket[BD_HIST_MAX_BUCKETS];
    _Atomic uint64_t sum;
};
struct bd_histogram_def {
    uint32_t n_bounds; /* buckets: n_bounds + 1 (the last is +Inf) */
    uint64_t bounds[BD_HIST_MAX_BUCKETS - 1];
};
/* Bulk-write latency in microseconds; readings per bucket update sent. */
extern const struct bd_histogram_def bd_hist_bulk_latency_us;
extern const struct bd_histogram_def bd_hist_update_readings;

struct bd_stats {
#define BD_STATS_FIELD(name, help) _Atomic uint64_t name;
    BD_STATS_LIST(BD_STATS_FIELD)
    BD_GAUGES_LIST(BD_STATS_FIELD)
#undef BD_STATS_FIELD
    /* Flusher thread (bd_stats_bulk_done, bd_stats_mongodb_failed); 0 = not yet. */
    struct bd_histogram bulk_latency;     /* every bulk write attempt MongoDB was asked */
    struct bd_histogram update_readings;  /* every update of a bulk that reached MongoDB */
    _Atomic int64_t mongodb_ok_mono_ns;   /* last bulk write MongoDB answered */
    _Atomic int64_t mongodb_ok_wall_ms;   /* the same, wall clock */
    _Atomic int64_t mongodb_down_mono_ns; /* first failure to reach it since then (0: reachable) */
};

/*
 * A relaxed load and store rather than atomic_fetch_add: every counter has a single writer, so
 * no increment can be lost, and on x86 a fetch_add is a locked instruction that waits for the
 * store buffer to drain -- on the ingest hot path that meant waiting, for every reading, on the
 * cache miss of the ring cells just written. Readers still never see a torn value.
 */
#define BD_STAT_ADD(st, name, n)                                                                   \
    atomic_store_explicit(&(st)->name,                                                             \
                          atomic_load_explicit(&(st)->name, memory_order_relaxed) + (n),           \
                          memory_order_relaxed)
#define BD_STAT_GET(st, name) atomic_load_explicit(&(st)->name, memory_order_relaxed)
#define BD_GAUGE_SET(st, name, v) atomic_store_explicit(&(st)->name, (v), memory_order_relaxed)

/* One observation: the writing thread's relaxed add to its bucket and to the sum. */
void bd_histogram_observe(struct bd_histogram *h, const struct bd_histogram_def *def, uint64_t v);

/*
 * Flusher thread, after a bulk write attempt (started at start_mono_ns; the clocks are read
 * here): its latency, and when MongoDB answered it (reached: not unreachable, not refused by the
 * driver, not a connection lost mid-request) the time of the last successful write and
 * MongoDB reachable again. Readings per update are observed by the caller.
 */
void bd_stats_bulk_done(struct bd_stats *st, int64_t start_mono_ns, bool reached);
/* Flusher thread: a store call could not reach MongoDB (unreachable, connection lost). */
void bd_stats_mongodb_failed(struct bd_stats *st);

/* One line "name=value name=value ..." (no newline), counters then gauges, into buf; returns
 * bytes written. */
size_t bd_stats_format(const struct bd_stats *st, char *buf, size_t cap);

#endif
