/*
 * Formatting of the daemon-wide counters (include/bucketd/stats.h). Reads are relaxed: a stats
 * line is a snapshot that may be a few events stale, never torn per counter.
 */
#include "bucketd/stats.h"

#include "bucketd/common.h"

size_t bd_stats_format(const struct bd_stats *st, char *buf, size_t cap) {
    size_t off = 0;
    if (cap == 0) {
        return 0;
    }
    buf[0] = '\0';
#define BD_STATS_PRINT(name, help)                                                                 \
    if (off < cap) {                                                                               \
        int n = snprintf(buf + off, cap - off, "%s%s=%llu", off ? " " : "", #name,                 \
                         (unsigned long long)atomic_load_explicit(&((struct bd_stats *)st)->name,  \
                                                                  memory_order_relaxed));          \
        off += n > 0 ? (size_t)n : 0;                                                              \
    }
    BD_STATS_LIST(BD_STATS_PRINT)
    BD_GAUGES_LIST(BD_STATS_PRINT)
#undef BD_STATS_PRINT
    return off < cap ? off : cap - 1;
}

/* Bulk writes: 1 ms to 30 s (a server selection times out after 30 s by default). */
const struct bd_histogram_def bd_hist_bulk_latency_us = {14,
                                                         {1000, 2500, 5000, 10000, 25000, 50000,
                                                          100000, 250000, 500000, 1000000, 2500000,
                                                          5000000, 10000000, 30000000}};
/* Readings per update: one to a page's whole buckets.max_readings (at most 100,000). */
const struct bd_histogram_def bd_hist_update_readings = {
    14, {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000}};

void bd_histogram_observe(struct bd_histogram *h, const struct bd_histogram_def *def, uint64_t v) {
    uint32_t i = 0;
    while (i < def->n_bounds && v > def->bounds[i]) {
        i++;
    }
    BD_STAT_ADD(h, bucket[i], 1);
    BD_STAT_ADD(h, sum, v);
}

void bd_stats_bulk_done(struct bd_stats *st, int64_t start_mono_ns, bool reached) {
    int64_t now = bd_mono_ns();
    int64_t us = now > start_mono_ns ? (now - start_mono_ns) / 1000 : 0;
    bd_histogram_observe(&st->bulk_latency, &bd_hist_bulk_latency_us, (uint64_t)us);
    if (reached) {
        atomic_store_explicit(&st->mongodb_ok_mono_ns, now, memory_order_relaxed);
        atomic_store_explicit(&st->mongodb_ok_wall_ms, bd_now_ns() / BD_NS_PER_MS,
                              memory_order_relaxed);
        atomic_store_explicit(&st->mongodb_down_mono_ns, 0, memory_order_relaxed);
    }
}

void bd_stats_mongodb_failed(struct bd_stats *st) {
    if (atomic_load_explicit(&st->mongodb_down_mono_ns, memory_order_relaxed) == 0) {
        atomic_store_explicit(&st->mongodb_down_mono_ns, bd_mono_ns(), memory_order_relaxed);
    }
}
