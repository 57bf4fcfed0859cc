/*
 * Stress test for the SPSC ring (include/bucketd/ring.h): one producer thread and one consumer
 * thread run flat out through a tiny ring, so nearly every record meets a full or an empty ring
 * and many wrap the array end; the counters start just below UINT32_MAX so head and tail also
 * cross the 32-bit wrap (often mid-record). Records are 1..8 entries of two cells each (the ring's
 * cells are single words): every entry's first cell carries its record's sequence number, its
 * own position and the record length, its second a payload word, the first entry's a checksum
 * over the payload. The consumer checks each record arrives exactly once, in order, whole and
 * intact. Guard cells around the cell array and guard bytes around the ring struct catch stray
 * writes in builds without AddressSanitizer.
 *
 * A plain program, not a Criterion suite: it wants two real threads for seconds at a time.
 * Meant to run under ThreadSanitizer (BD_TSAN=ON) as well as plain and with ASan/UBSan.
 * The main thread owns the ring; during the run only the producer writes head and the cells,
 * and only the consumer writes tail. Exit 0 on success, 1 on any mismatch, 2 on bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bucketd/ring.h"

#define MAX_RECORD 8
#define GUARD_CELLS 8
#define GUARD_BYTES 256
#define GUARD_WORD UINT64_C(0xa5a5a5a5deadbeef)
#define GUARD_BYTE 0x5a
/* After this many failed tries in a row, give up the CPU: on a machine with fewer cores than
 * threads (or under TSan), pure spinning would only burn the other side's time slice. */
#define SPINS_BEFORE_YIELD 64

struct options {
    double seconds;    /* Stop after this long (0: no time limit). */
    uint64_t records;  /* Stop after this many records (0: no count limit). */
    uint32_t capacity; /* Ring capacity in cells, a power of two >= 2. */
    uint32_t start;    /* Initial value of head and tail. */
    uint64_t seed;     /* Producer's random seed: record lengths and payloads. */
    bool observer;     /* Run a third thread that samples bd_ring_used(). */
};

/* The ring with guard bytes on both sides: nothing may write outside the struct. */
static struct {
    unsigned char before[GUARD_BYTES];
    struct bd_ring ring;
    unsigned char after[GUARD_BYTES];
} g;

static uint64_t *g_block; /* GUARD_CELLS + capacity + GUARD_CELLS cells. */
static struct options g_opt;
static uint32_t g_max_len;

/* Cross-thread flags and totals. The ring's own counters carry the record data. */
static _Atomic bool g_failed;        /* Set by whichever thread sees a mismatch first. */
static _Atomic bool g_producer_done; /* Release: published after the last push. */
static _Atomic uint64_t g_produced_records, g_produced_cells;
static _Atomic bool g_consumer_done;
static pthread_barrier_t g_barrier;

/* Results, each written by one thread and read by main after pthread_join. */
static uint64_t g_push_full;  /* Producer: pushes refused because the ring was full. */
static uint64_t g_poll_empty; /* Consumer: polls that found nothing. */
static uint64_t g_consumed_records, g_consumed_cells;
static uint64_t g_observer_samples;

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

/* xorshift64*: fast, and good enough to vary lengths and payload bits. */
static uint64_t next_rand(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * UINT64_C(0x2545f4914f6cdd1d);
}

/* The first cell of every entry: sequence number (56 bits), position in the record, record
 * length in entries. */
static uint64_t cell_tag(uint64_t seq, uint32_t pos, uint32_t len) {
    return (seq << 8) | ((uint64_t)pos << 4) | len;
}

/* Over the sequence number, the length and the payload words, in order. */
static uint64_t checksum(uint64_t seq, uint32_t len, const uint64_t *payload) {
    uint64_t h = UINT64_C(0xcbf29ce484222325) ^ seq ^ ((uint64_t)len << 56);
    for (uint32_t i = 1; i < len; i++) {
        h = (h ^ payload[i]) * UINT64_C(0x100000001b3);
        h ^= h >> 29;
    }
    return h;
}

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("ring_stress: FAIL: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    atomic_store_explicit(&g_failed, true, memory_order_relaxed);
}

static bool failed(void) {
    return atomic_load_explicit(&g_failed, memory_order_relaxed);
}

static void *producer(void *arg) {
    struct bd_ring *r = &g.ring;
    uint64_t rec[2 * MAX_RECORD]; /* entry i: tag at 2i, payload (checksum for 0) at 2i + 1 */
    uint64_t payload[MAX_RECORD];
    uint64_t rng = g_opt.seed;
    uint64_t seq = 0, cells = 0;
    uint64_t deadline = 0;

    pthread_barrier_wait(&g_barrier);
    if (g_opt.seconds > 0) {
        deadline = mono_ns() + (uint64_t)(g_opt.seconds * 1e9);
    }

    while (!failed()) {
        if (g_opt.records != 0 && seq == g_opt.records) {
            break;
        }
        /* Reading the clock costs more than a push: look every 1024 records. */
        if (deadline != 0 && (seq & 1023) == 0 && mono_ns() >= deadline) {
            break;
        }

        uint64_t x = next_rand(&rng);
        uint32_t len = 1 + (uint32_t)(x % g_max_len);
        for (uint32_t i = 1; i < len; i++) {
            payload[i] = next_rand(&rng);
            rec[2 * i] = cell_tag(seq, i, len);
            rec[2 * i + 1] = payload[i];
        }
        rec[0] = cell_tag(seq, 0, len);
        rec[1] = checksum(seq, len, payload);

        for (unsigned spins = 0; !bd_ring_push(r, rec, 2 * len); spins++) {
            g_push_full++;
            if (failed()) {
                goto out;
            }
            if (spins >= SPINS_BEFORE_YIELD) {
                sched_yield();
            }
        }
        seq++;
        cells += 2 * len;
    }

out:
    atomic_store_explicit(&g_produced_records, seq, memory_order_relaxed);
    atomic_store_explicit(&g_produced_cells, cells, memory_order_relaxed);
    /* Pairs with the acquire load in consumer(): once it sees done, the totals above and the
     * head of the last push are visible to it. */
    atomic_store_explicit(&g_producer_done, true, memory_order_release);
    return arg;
}

/* Checks the record of `len` entries (2 * len cells) at free-running index idx; false after
 * reporting. */
static bool check_record(const struct bd_ring *r, uint32_t idx, uint64_t seq, uint32_t len) {
    uint64_t payload[MAX_RECORD];

    for (uint32_t i = 1; i < len; i++) {
        uint64_t tag = *bd_ring_at(r, idx + 2 * i);
        if (tag != cell_tag(seq, i, len)) {
            fail("record %" PRIu64 " (len %u) entry %u at index %" PRIu32 ": tag %#" PRIx64
                 ", want %#" PRIx64 " (seq %" PRIu64 ", pos %u, len %u)",
                 seq, len, i, idx + 2 * i, tag, cell_tag(seq, i, len), tag >> 8,
                 (unsigned)(tag >> 4) & 15, (unsigned)tag & 15);
            return false;
        }
        payload[i] = *bd_ring_at(r, idx + 2 * i + 1);
    }
    uint64_t sum = checksum(seq, len, payload);
    uint64_t got = *bd_ring_at(r, idx + 1);
    if (got != sum) {
        fail("record %" PRIu64 " (len %u) at index %" PRIu32 ": checksum %#" PRIx64
             ", payload gives %#" PRIx64,
             seq, len, idx, got, sum);
        return false;
    }
    return true;
}

static void *consumer(void *arg) {
    struct bd_ring *r = &g.ring;
    uint64_t seq = 0, cells = 0, windows = 0;
    unsigned spins = 0;

    pthread_barrier_wait(&g_barrier);

    while (!failed()) {
        uint32_t tail;
        uint32_t avail = bd_ring_available(r, &tail);
        if (avail == 0) {
            g_poll_empty++;
            /* Pairs with the release store in producer(). Checked before a last look at the
             * ring, so a record pushed just before done is never left behind. */
            if (atomic_load_explicit(&g_producer_done, memory_order_acquire) &&
                bd_ring_available(r, &tail) == 0) {
                break;
            }
            if (++spins >= SPINS_BEFORE_YIELD) {
                sched_yield();
            }
            continue;
        }
        spins = 0;
        if (avail > bd_ring_capacity(r)) {
            fail("available %" PRIu32 " exceeds capacity %" PRIu32 " (tail %" PRIu32 ")", avail,
                 bd_ring_capacity(r), tail);
            break;
        }

        /* Walk every record in the window; hand the cells back either record by record or
         * all at once, alternating, so both patterns of tail updates are exercised. */
        bool per_record = (windows++ & 1) != 0;
        uint32_t off = 0;
        while (off < avail) {
            uint64_t tag = *bd_ring_at(r, tail + off);
            uint32_t len = (uint32_t)(tag & 15);
            if ((tag >> 8) != (seq & (UINT64_MAX >> 8)) || ((tag >> 4) & 15) != 0) {
                fail("at index %" PRIu32 ": expected the first cell of record %" PRIu64
                     ", found tag %#" PRIx64 " (seq %" PRIu64 ", pos %u, len %u)",
                     tail + off, seq, tag, tag >> 8, (unsigned)(tag >> 4) & 15, len);
                goto out;
            }
            if (len < 1 || len > g_max_len) {
                fail("record %" PRIu64 " at index %" PRIu32 ": length %u outside 1..%u", seq,
                     tail + off, len, g_max_len);
                goto out;
            }
            if (2 * len > avail - off) {
                fail("record %" PRIu64 " at index %" PRIu32 ": %u cells but only %u published"
                     " (a record must appear whole)",
                     seq, tail + off, 2 * len, avail - off);
                goto out;
            }
            if (!check_record(r, tail + off, seq, len)) {
                goto out;
            }
            if (per_record) {
                bd_ring_consume(r, 2 * len);
            }
            off += 2 * len;
            seq++;
            cells += 2 * len;
        }
        if (!per_record) {
            bd_ring_consume(r, avail);
        }
    }

out:
    g_consumed_records = seq;
    g_consumed_cells = cells;
    atomic_store_explicit(&g_consumer_done, true, memory_order_relaxed);
    return arg;
}

/* Optional third thread: bd_ring_used() must stay within 0..capacity even when neither side's
 * counter is its own (it once loaded head before tail and could go "negative"). */
static void *observer(void *arg) {
    struct bd_ring *r = &g.ring;
    uint32_t cap = bd_ring_capacity(r);
    uint64_t n = 0;

    pthread_barrier_wait(&g_barrier);
    while (!failed() && !atomic_load_explicit(&g_consumer_done, memory_order_relaxed)) {
        uint32_t used = bd_ring_used(r);
        if (used > cap) {
            fail("bd_ring_used() from a third thread gave %" PRIu32 " > capacity %" PRIu32, used,
                 cap);
            break;
        }
        n++;
    }
    g_observer_samples = n;
    return arg;
}

/* Moves the ring's cells into a block with guard cells on both sides. bd_ring_init_at() has
 * validated the capacity and set the counters; only the array changes place. */
static int guard_ring(struct bd_ring *r) {
    uint32_t cap = bd_ring_capacity(r);
    g_block = malloc((GUARD_CELLS * 2 + (size_t)cap) * sizeof(*g_block));
    if (g_block == NULL) {
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < GUARD_CELLS * 2 + cap; i++) {
        g_block[i] = GUARD_WORD ^ i;
    }
    free(r->cells);
    r->cells = g_block + GUARD_CELLS;
    r->cons_cells = r->cells; /* the consumer's read-only copy */
    return 0;
}

static int check_guards(uint32_t cap) {
    int bad = 0;
    for (uint32_t i = 0; i < GUARD_CELLS * 2 + cap; i++) {
        if (i == GUARD_CELLS) {
            i += cap - 1; /* The ring's own cells. */
            continue;
        }
        if (g_block[i] != (GUARD_WORD ^ i)) {
            fprintf(stderr, "ring_stress: FAIL: guard cell %d (relative to cells[0]) overwritten\n",
                    (int)i - GUARD_CELLS);
            bad = 1;
        }
    }
    for (size_t i = 0; i < GUARD_BYTES; i++) {
        if (g.before[i] != GUARD_BYTE || g.after[i] != GUARD_BYTE) {
            fprintf(stderr, "ring_stress: FAIL: guard byte %zu %s struct bd_ring overwritten\n", i,
                    g.before[i] != GUARD_BYTE ? "before" : "after");
            bad = 1;
            break;
        }
    }
    return bad;
}

static void usage(FILE *f, const char *argv0) {
    fprintf(f,
            "usage: %s [-t SECONDS] [-n RECORDS] [-c CAPACITY] [-s START] [-S SEED] [-o]\n"
            "  -t SECONDS  stop after this long (default 2; 0 = no time limit)\n"
            "  -n RECORDS  stop after this many records (default 0 = no count limit)\n"
            "  -c CAPACITY ring capacity in cells, a power of two >= 2 (default 16)\n"
            "  -s START    initial head/tail (default UINT32_MAX - 37 = %" PRIu32 ")\n"
            "  -S SEED     producer random seed (default 0x5eed)\n"
            "  -o          also run a thread sampling bd_ring_used() from outside\n"
            "The run stops at whichever limit comes first; at least one must be set.\n",
            argv0, UINT32_MAX - 37);
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-' || v > max) {
        return false;
    }
    *out = v;
    return true;
}

static int parse_args(int argc, char **argv, struct options *o) {
    uint64_t v;
    int c;

    *o = (struct options){.seconds = 2, .capacity = 16, .start = UINT32_MAX - 37, .seed = 0x5eed};
    while ((c = getopt(argc, argv, "t:n:c:s:S:oh")) != -1) {
        switch (c) {
        case 't': {
            char *end;
            errno = 0;
            o->seconds = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(o->seconds >= 0) ||
                o->seconds > 86400) {
                fprintf(stderr, "ring_stress: -t: bad duration '%s'\n", optarg);
                return -1;
            }
            break;
        }
        case 'n':
            if (!parse_u64(optarg, UINT64_MAX >> 8, &o->records)) {
                fprintf(stderr, "ring_stress: -n: bad record count '%s'\n", optarg);
                return -1;
            }
            break;
        case 'c':
            if (!parse_u64(optarg, UINT32_C(1) << 24, &v)) {
                fprintf(stderr, "ring_stress: -c: bad capacity '%s'\n", optarg);
                return -1;
            }
            o->capacity = (uint32_t)v;
            break;
        case 's':
            if (!parse_u64(optarg, UINT32_MAX, &v)) {
                fprintf(stderr, "ring_stress: -s: bad start '%s'\n", optarg);
                return -1;
            }
            o->start = (uint32_t)v;
            break;
        case 'S':
            if (!parse_u64(optarg, UINT64_MAX, &o->seed) || o->seed == 0) {
                fprintf(stderr, "ring_stress: -S: bad seed '%s' (nonzero)\n", optarg);
                return -1;
            }
            break;
        case 'o':
            o->observer = true;
            break;
        case 'h':
            usage(stdout, argv[0]);
            exit(0);
        default:
            return -1;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "ring_stress: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (o->seconds == 0 && o->records == 0) {
        fprintf(stderr, "ring_stress: -t 0 needs -n\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    struct bd_ring *r = &g.ring;
    pthread_t prod, cons, obs;
    int rc = 1;

    if (parse_args(argc, argv, &g_opt) != 0) {
        usage(stderr, argv[0]);
        return 2;
    }
    memset(g.before, GUARD_BYTE, sizeof(g.before));
    memset(g.after, GUARD_BYTE, sizeof(g.after));
    int err = bd_ring_init_at(r, g_opt.capacity, g_opt.start);
    if (err != 0) {
        fprintf(stderr, "ring_stress: bd_ring_init_at(capacity %" PRIu32 "): %s\n", g_opt.capacity,
                strerror(-err));
        return 2;
    }
    if (guard_ring(r) != 0) {
        fprintf(stderr, "ring_stress: out of memory\n");
        return 1;
    }
    g_max_len = g_opt.capacity / 2 < MAX_RECORD ? g_opt.capacity / 2 : MAX_RECORD;

    unsigned nthreads = g_opt.observer ? 3 : 2;
    if (pthread_barrier_init(&g_barrier, NULL, nthreads + 1) != 0) {
        fprintf(stderr, "ring_stress: pthread_barrier_init failed\n");
        goto out;
    }
    if (pthread_create(&prod, NULL, producer, NULL) != 0 ||
        pthread_create(&cons, NULL, consumer, NULL) != 0 ||
        (g_opt.observer && pthread_create(&obs, NULL, observer, NULL) != 0)) {
        /* Not recoverable without a way to cancel the barrier; say so and leave. */
        fprintf(stderr, "ring_stress: pthread_create failed\n");
        exit(1);
    }

    /* Read before the barrier: no thread starts work until main reaches it too. */
    uint64_t t0 = mono_ns();
    pthread_barrier_wait(&g_barrier);
    pthread_join(prod, NULL);
    pthread_join(cons, NULL);
    uint64_t t1 = mono_ns();
    if (g_opt.observer) {
        pthread_join(obs, NULL);
    }
    pthread_barrier_destroy(&g_barrier);

    uint64_t records = atomic_load(&g_produced_records);
    uint64_t cells = atomic_load(&g_produced_cells);
    uint32_t cap = bd_ring_capacity(r);
    uint32_t end = (uint32_t)(g_opt.start + cells);
    uint32_t tail;
    bool ok = !failed();

    if (ok && (g_consumed_records != records || g_consumed_cells != cells)) {
        fprintf(stderr,
                "ring_stress: FAIL: produced %" PRIu64 " records / %" PRIu64
                " cells, consumed %" PRIu64 " / %" PRIu64 "\n",
                records, cells, g_consumed_records, g_consumed_cells);
        ok = false;
    }
    if (ok &&
        (atomic_load(&r->head) != end || atomic_load(&r->tail) != end ||
         bd_ring_available(r, &tail) != 0 || bd_ring_used(r) != 0 || bd_ring_free(r) != cap)) {
        fprintf(stderr,
                "ring_stress: FAIL: final head %" PRIu32 " tail %" PRIu32 " (want %" PRIu32
                "), used %" PRIu32 ", free %" PRIu32 " of %" PRIu32 "\n",
                atomic_load(&r->head), atomic_load(&r->tail), end, bd_ring_used(r), bd_ring_free(r),
                cap);
        ok = false;
    }
    if (check_guards(cap) != 0) {
        ok = false;
    }
    if (ok && records == 0) {
        fprintf(stderr, "ring_stress: FAIL: no record went through\n");
        ok = false;
    }

    double secs = (double)(t1 - t0) / 1e9;
    printf("ring_stress: %s: capacity %" PRIu32 ", start %" PRIu32 " -> %" PRIu32
           " (counters %s UINT32_MAX), seed %#" PRIx64 "\n",
           ok ? "ok" : "FAILED", cap, g_opt.start, end,
           (uint64_t)g_opt.start + cells > UINT32_MAX ? "crossed" : "did not cross", g_opt.seed);
    printf("ring_stress: %" PRIu64 " records, %" PRIu64 " cells in %.3f s: %.0f records/s, "
           "%.0f cells/s; %" PRIu64 " pushes refused (full), %" PRIu64 " empty polls",
           records, cells, secs, secs > 0 ? (double)records / secs : 0.0,
           secs > 0 ? (double)cells / secs : 0.0, g_push_full, g_poll_empty);
    if (g_opt.observer) {
        printf("; %" PRIu64 " outside samples of bd_ring_used", g_observer_samples);
    }
    printf("\n");
    rc = ok ? 0 : 1;

out:
    free(g_block);
    r->cells = NULL; /* Lived in g_block: not for bd_ring_close(). */
    r->cons_cells = NULL;
    return rc;
}
