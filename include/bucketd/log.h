/*
 * Logging to stderr with syslog priority prefixes ("<3>", "<4>", ...) so journald files each
 * line under the right priority. Safe from any thread: one fprintf per line, stderr unbuffered.
 */
#ifndef BUCKETD_LOG_H
#define BUCKETD_LOG_H

#include <stdint.h>

enum bd_log_level {
    BD_LOG_ERROR = 3, /* syslog LOG_ERR */
    BD_LOG_WARN = 4,  /* LOG_WARNING */
    BD_LOG_INFO = 6,  /* LOG_INFO */
    BD_LOG_DEBUG = 7, /* LOG_DEBUG */
};

void bd_log_set_level(enum bd_log_level level);
enum bd_log_level bd_log_get_level(void);
/* Parse "error|warn|info|debug"; returns 0 or -EINVAL. */
int bd_log_level_parse(const char *s, enum bd_log_level *out);

void bd_log(enum bd_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define bd_error(...) bd_log(BD_LOG_ERROR, __VA_ARGS__)
#define bd_warn(...) bd_log(BD_LOG_WARN, __VA_ARGS__)
#define bd_info(...) bd_log(BD_LOG_INFO, __VA_ARGS__)
#define bd_debug(...) bd_log(BD_LOG_DEBUG, __VA_ARGS__)

/*
 * Rate limiter for samples of bad input: at most `burst` lines per `interval_ns`; the caller
 * owns the struct (one per call site or reason) and uses it from one thread only.
 */
struct bd_ratelimit {
    int64_t interval_ns;
    uint32_t burst;
    int64_t window_start;
    uint32_t used;
    uint64_t suppressed;
};
/* Returns 1 if this event may be logged now, 0 if it is suppressed (and counted). */
int bd_ratelimit_ok(struct bd_ratelimit *rl, int64_t now_mono_ns);

#endif
