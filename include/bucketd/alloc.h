/*
 * Allocation for the flusher's modules (bucket deltas, pages, the pending batch), with a switch
 * that makes the n-th allocation from now fail, so that unit tests reach every out-of-memory
 * path. The ingest hot path does not allocate and does not use these.
 *
 * Any thread; the failure switch is meant for single-threaded unit tests.
 */
#ifndef BUCKETD_ALLOC_H
#define BUCKETD_ALLOC_H

#include <stddef.h>

void *bd_malloc(size_t n);
void *bd_calloc(size_t count, size_t size);
void *bd_realloc(void *p, size_t n);
/* realloc of count * size bytes; NULL (p untouched) on overflow or failure. */
void *bd_reallocarray(void *p, size_t count, size_t size);

/*
 * Tests: the allocation after `n` more successful ones fails (0: the next one), and so does
 * every one after it when `sticky`; -1 turns failures off. Returns the allocations counted since
 * the last call, so a test can first count the allocations of a step and then fail each in turn.
 */
long bd_alloc_fail_after(long n, int sticky);

#endif
