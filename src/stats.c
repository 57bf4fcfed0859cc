/*
 * Formatting of the daemon-wide counters (include/bucketd/stats.h). Reads are relaxed: a stats
 * line is a snapshot that may be a few events stale, never torn per counter.
 */
#include "bucketd/stats.h"

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
