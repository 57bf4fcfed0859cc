/*
 * Shared basics for every module: the error out-parameter, always-on assertions and the
 * time helpers. No module state lives here; everything is safe to use from any thread.
 */
#ifndef BUCKETD_COMMON_H
#define BUCKETD_COMMON_H

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Optional detail for a failing call; the return value (negative errno) is the contract. */
struct bd_err {
    int code;
    char msg[512];
};

/* Fill *err (if not NULL) with code and a printf-style message; returns code for chaining. */
int bd_err_set(struct bd_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Invariant checks stay compiled in: a broken invariant in a daemon must stop it loudly. */
_Noreturn void bd_assert_fail(const char *expr, const char *file, int line);
#define BD_ASSERT(e) ((e) ? (void)0 : bd_assert_fail(#e, __FILE__, __LINE__))

#define BD_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define BD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define BD_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Wall clock in nanoseconds since the Unix epoch (CLOCK_REALTIME). */
int64_t bd_now_ns(void);
/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC), for timeouts and rates. */
int64_t bd_mono_ns(void);

/* mkdir -p: dir and its missing parents with mode (errors name spool.dir, its one user). */
int bd_mkdir_p(const char *dir, mode_t mode, struct bd_err *err);

/* write(2) all of buf, retrying short writes and EINTR. 0 or -errno. */
int bd_write_all(int fd, const void *buf, size_t len);

/*
 * Replace path with buf through tmp (created with mode), durable before returning: written,
 * fsynced, renamed over path, and the rename made durable by an fsync of dir. The data is synced
 * even when only the rename's atomicity is wanted: renamed unsynced, a power loss could leave an
 * empty or partial file where the old, synced one was (the filesystem may commit the rename
 * before the data). 0, or the negative errno with err naming path (tmp removed).
 */
int bd_replace_file(const char *dir, const char *path, const char *tmp, const void *buf, size_t len,
                    mode_t mode, struct bd_err *err);

/* The value of one hexadecimal digit, or -1. */
static inline int bd_hex_value(char c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

/* Little-endian integers in byte buffers (on-disk formats), whatever the host's order. */
static inline void bd_put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static inline void bd_put_le64(uint8_t *p, uint64_t v) {
    bd_put_le32(p, (uint32_t)v);
    bd_put_le32(p + 4, (uint32_t)(v >> 32));
}

static inline uint32_t bd_get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t bd_get_le64(const uint8_t *p) {
    return (uint64_t)bd_get_le32(p) | (uint64_t)bd_get_le32(p + 4) << 32;
}

#define BD_NS_PER_MS INT64_C(1000000)
#define BD_NS_PER_S INT64_C(1000000000)

#endif
