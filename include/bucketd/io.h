/*
 * The flusher's I/O thread: runs one blocking call at a time (a MongoDB round trip through the
 * store) while the calling thread keeps doing other work in between -- the flusher drains the
 * sensor queues into its next batch while a bulk write is in flight, so a slow or timing-out
 * MongoDB never stops draining.
 *
 * Threads: one caller thread (the flusher) calls bd_io_run; the I/O thread runs the call; any
 * thread may bd_io_poke. Everything the call touches belongs to the caller, which does not
 * touch it until bd_io_run returns: the mutex hand-off orders the two threads' accesses.
 */
#ifndef BUCKETD_IO_H
#define BUCKETD_IO_H

#include <stdint.h>

#include "bucketd/common.h"

struct bd_io;

typedef void (*bd_io_fn)(void *arg);

int bd_io_new(struct bd_io **out, struct bd_err *err);
/* Stops and joins the thread (no call may be running). bd_io_free(NULL) is a no-op. */
void bd_io_free(struct bd_io *io);

/*
 * Run fn(arg) on the I/O thread and return once it returned. Meanwhile, on the calling thread,
 * call idle(idle_arg) each time bd_io_poke() is called and at least every idle_ns. With io NULL,
 * fn runs on the calling thread (unit tests, the blackhole sink).
 */
void bd_io_run(struct bd_io *io, bd_io_fn fn, void *arg, bd_io_fn idle, void *idle_arg,
               int64_t idle_ns);

/* Any thread: have the caller waiting in bd_io_run run its idle work now (coalesced). */
void bd_io_poke(struct bd_io *io);

#endif
