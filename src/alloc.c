/*
 * Allocation wrappers with a failure switch for tests (see include/bucketd/alloc.h). The switch
 * costs one relaxed atomic load per allocation, and only the flusher's modules use them.
 */
#include "bucketd/alloc.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

static _Atomic long fail_countdown = -1; /* -1: never fail */
static _Atomic int fail_sticky;
static _Atomic long counted;

static int should_fail(void) {
    atomic_fetch_add_explicit(&counted, 1, memory_order_relaxed);
    long left = atomic_load_explicit(&fail_countdown, memory_order_relaxed);
    if (left < 0) {
        return 0;
    }
    if (left == 0) {
        if (!atomic_load_explicit(&fail_sticky, memory_order_relaxed)) {
            atomic_store_explicit(&fail_countdown, -1, memory_order_relaxed);
        }
        return 1;
    }
    atomic_store_explicit(&fail_countdown, left - 1, memory_order_relaxed);
    return 0;
}

long bd_alloc_fail_after(long n, int sticky) {
    atomic_store_explicit(&fail_sticky, sticky, memory_order_relaxed);
    atomic_store_explicit(&fail_countdown, n, memory_order_relaxed);
    return atomic_exchange_explicit(&counted, 0, memory_order_relaxed);
}

void *bd_malloc(size_t n) {
    return should_fail() ? NULL : malloc(n);
}

void *bd_calloc(size_t count, size_t size) {
    return should_fail() ? NULL : calloc(count, size);
}

void *bd_realloc(void *p, size_t n) {
    return should_fail() ? NULL : realloc(p, n);
}

void *bd_reallocarray(void *p, size_t count, size_t size) {
    if (size != 0 && count > SIZE_MAX / size) {
        return NULL;
    }
    return bd_realloc(p, count * size);
}
