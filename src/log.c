/*
 * stderr logging with syslog priority prefixes, and a small rate limiter for samples of bad
 * input. The level is an atomic so any thread may log; each line is one fprintf call.
 */
#include "bucketd/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/escape.h"

static _Atomic int log_level = BD_LOG_INFO;

void bd_log_set_level(enum bd_log_level level) {
    atomic_store_explicit(&log_level, (int)level, memory_order_relaxed);
}

enum bd_log_level bd_log_get_level(void) {
    return (enum bd_log_level)atomic_load_explicit(&log_level, memory_order_relaxed);
}

int bd_log_level_parse(const char *s, enum bd_log_level *out) {
    static const struct {
        const char *name;
        enum bd_log_level level;
    } names[] = {{"error", BD_LOG_ERROR},
                 {"warn", BD_LOG_WARN},
                 {"info", BD_LOG_INFO},
                 {"debug", BD_LOG_DEBUG}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcmp(s, names[i].name) == 0) {
            *out = names[i].level;
            return 0;
        }
    }
    return -EINVAL;
}

void bd_log(enum bd_log_level level, const char *fmt, ...) {
    if ((int)level > atomic_load_explicit(&log_level, memory_order_relaxed)) {
        return;
    }
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    /*
     * Call sites escape the untrusted text they log (bd_escape); this second pass catches what
     * one forgot, or text relayed from elsewhere (the driver, the server's error messages), so
     * that no log line can carry a line break, a terminal escape or a bidi override.
     */
    char safe[BD_ESCAPE_CAP(sizeof(line))];
    bd_escape(safe, sizeof(safe), line, strlen(line), BD_ESC_KEEP_QUOTES);
    /* One write per line so lines from two threads never interleave. */
    fprintf(stderr, "<%d>%s\n", (int)level, safe);
}

int bd_ratelimit_ok(struct bd_ratelimit *rl, int64_t now_mono_ns) {
    if (now_mono_ns - rl->window_start >= rl->interval_ns) {
        rl->window_start = now_mono_ns;
        rl->used = 0;
    }
    if (rl->used < rl->burst) {
        rl->used++;
        return 1;
    }
    rl->suppressed++;
    return 0;
}
