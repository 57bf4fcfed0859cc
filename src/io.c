/*
 * The I/O thread (include/bucketd/io.h). One mutex guards the hand-off: the caller posts a call
 * and waits on done_cv, waking for pokes and every idle interval to run its idle work with the
 * mutex released; the thread waits on call_cv, runs the call without the mutex and signals
 * done_cv. At most one call is ever posted.
 */
#include "bucketd/io.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bucketd/alloc.h"

struct bd_io {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t call_cv; /* the thread waits here for a call */
    pthread_cond_t done_cv; /* the caller waits here for the end of the call, or a poke */
    /* Guarded by mu. */
    bd_io_fn fn;
    void *arg;
    bool busy; /* a call is posted or running */
    bool poked;
    bool stop;
};

static void *io_main(void *p) {
    struct bd_io *io = p;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->busy && !io->stop) {
            pthread_cond_wait(&io->call_cv, &io->mu);
        }
        if (io->stop) {
            break;
        }
        bd_io_fn fn = io->fn;
        void *arg = io->arg;
        pthread_mutex_unlock(&io->mu);
        fn(arg);
        pthread_mutex_lock(&io->mu);
        io->busy = false;
        pthread_cond_signal(&io->done_cv);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

int bd_io_new(struct bd_io **out, struct bd_err *err) {
    struct bd_io *io = bd_calloc(1, sizeof(*io));
    if (io == NULL) {
        return bd_err_set(err, -ENOMEM, "I/O thread: out of memory");
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->call_cv, NULL);
    pthread_cond_init(&io->done_cv, &attr);
    pthread_condattr_destroy(&attr);
    int rc = pthread_create(&io->thread, NULL, io_main, io);
    if (rc != 0) {
        pthread_cond_destroy(&io->call_cv);
        pthread_cond_destroy(&io->done_cv);
        pthread_mutex_destroy(&io->mu);
        free(io);
        return bd_err_set(err, -rc, "I/O thread: cannot start: %s", strerror(rc));
    }
    pthread_setname_np(io->thread, "bd-io"); /* for top, perf and the bench */
    *out = io;
    return 0;
}

void bd_io_free(struct bd_io *io) {
    if (io == NULL) {
        return;
    }
    pthread_mutex_lock(&io->mu);
    BD_ASSERT(!io->busy);
    io->stop = true;
    pthread_cond_signal(&io->call_cv);
    pthread_mutex_unlock(&io->mu);
    pthread_join(io->thread, NULL);
    pthread_cond_destroy(&io->call_cv);
    pthread_cond_destroy(&io->done_cv);
    pthread_mutex_destroy(&io->mu);
    free(io);
}

void bd_io_run(struct bd_io *io, bd_io_fn fn, void *arg, bd_io_fn idle, void *idle_arg,
               int64_t idle_ns) {
    if (io == NULL) {
        fn(arg);
        return;
    }
    pthread_mutex_lock(&io->mu);
    BD_ASSERT(!io->busy);
    io->fn = fn;
    io->arg = arg;
    io->busy = true;
    pthread_cond_signal(&io->call_cv);
    while (io->busy) {
        if (!io->poked) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t ns = ts.tv_nsec + idle_ns;
            ts.tv_sec += ns / BD_NS_PER_S;
            ts.tv_nsec = ns % BD_NS_PER_S;
            pthread_cond_timedwait(&io->done_cv, &io->mu, &ts);
        }
        if (!io->busy) {
            break;
        }
        io->poked = false;
        pthread_mutex_unlock(&io->mu);
        if (idle != NULL) {
            idle(idle_arg);
        }
        pthread_mutex_lock(&io->mu);
    }
    pthread_mutex_unlock(&io->mu);
}

void bd_io_poke(struct bd_io *io) {
    if (io == NULL) {
        return;
    }
    pthread_mutex_lock(&io->mu);
    io->poked = true;
    pthread_cond_signal(&io->done_cv);
    pthread_mutex_unlock(&io->mu);
}
