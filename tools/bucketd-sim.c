/*
 * bucketd-sim: the sensor simulator and load generator that operators and the benchmarks use
 * (DESIGN.md §7). It makes the readings of N simulated sensors as InfluxDB line protocol or
 * Graphite plaintext and sends them to a bucketd listener: over UDP with sendmmsg (a batch of
 * datagrams per call, optionally many lines per datagram) or over TCP (big blocking writes,
 * round-robin over one or more connections), flat out or paced by a token bucket. It ends with
 * one JSON summary line on stdout and can write per-sensor counts, so a test knows exactly what
 * must have arrived.
 *
 * Single-threaded. struct sim owns everything and sim_init() allocates all of it once: the
 * sensor table (pre-formatted line heads, last timestamps, counts), the look-ahead window, the
 * datagram slots with their mmsghdr/iovec arrays and the TCP chunk. The send loop allocates
 * nothing and formats numbers by hand, because snprintf alone would make the generator slower
 * than the daemon it is meant to load.
 *
 * Repeatability: two PRNG streams seeded from --seed (one shapes the stream: sensors, late,
 * duplicate and out-of-order picks; one draws field values), and no decision depends on timing,
 * so the same options and seed give the same lines. With --time-base the timestamps repeat too.
 * Under --rate the grouping of lines into datagrams follows the pacing and may differ between
 * runs; the lines themselves do not.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/parse.h"

/* Datagrams per sendmmsg call: enough to amortise the syscall, small enough to stay in cache. */
#define UDP_BATCH 64
/* Largest UDP payload over IPv4; loopback carries it without fragmentation trouble. */
#define UDP_MAX_PAYLOAD 65507
#define DEFAULT_PACKED_DATAGRAM 1400
#define MAX_PER_DATAGRAM 4096
/* TCP writes: big enough that the syscall cost vanishes, small enough to pace smoothly. */
#define TCP_CHUNK (256 * 1024)
#define MAX_CONNECTIONS 1024
/* Look-ahead for --out-of-order: a reading may be sent up to WINDOW - 1 places early. */
#define WINDOW 64
#define MAX_SENSORS 10000000u
#define MAX_FIELDS 64
/* Room per pre-formatted line head; the longest head the naming scheme makes is ~55 bytes. */
#define HEAD_STRIDE 64
/* A send that makes no progress for this long is given up (counted in send_errors). */
#define GIVE_UP_NS (2 * BD_NS_PER_S)
#define BACKOFF_MIN_NS (50 * 1000)
#define BACKOFF_MAX_NS (10 * BD_NS_PER_MS)

static const char usage[] =
    "usage: bucketd-sim --target HOST:PORT [options]\n"
    "\n"
    "Simulates sensors sending readings to bucketd and prints one JSON summary line:\n"
    "  {\"readings\":N,\"malformed\":N,\"datagrams\":N,\"bytes\":N,\"sensors\":N,\n"
    "   \"elapsed_s\":X,\"readings_per_s\":X,\"send_errors\":N,\"proto\":...,\"format\":...,\n"
    "   \"per_datagram\":N,...}\n"
    "\n"
    "Where and how:\n"
    "  --target HOST:PORT    numeric IPv4 address or [IPv6]:port (required)\n"
    "  --proto udp|tcp       default udp\n"
    "  --format influx|graphite   default influx\n"
    "  --per-datagram N      UDP: lines per datagram, default 1 (1..4096)\n"
    "  --max-datagram BYTES  UDP: datagram size cap; default 1400 when --per-datagram > 1,\n"
    "                        else 65507 (the most UDP takes); e.g. 65000 on loopback\n"
    "  --connections N       TCP: connections, written round-robin chunk by chunk (default 1)\n"
    "\n"
    "What:\n"
    "  --sensors N           distinct series (default 10)\n"
    "  --sensor-offset N     number the sensors from N (default 0), to run several\n"
    "                        simulators with disjoint sensors\n"
    "  --short-names         influx: every sensor is m,site=sNNNNNN (one short tag, as many\n"
    "                        quiet sensors of an edge box); default: m0..m3 with two or\n"
    "                        three tags, such as m1,sensor=s12345,site=plant-2\n"
    "  --fields F            influx: numeric fields f0..f{F-1} per reading, even ones floats,\n"
    "                        odd ones integers (default 4, 1..64); graphite has one value\n"
    "  --seq                 add an integer field seq=<n>i unique per reading (graphite: the\n"
    "                        value is the sequence number)\n"
    "  --seq-start N         first sequence number (default 0)\n"
    "\n"
    "How many, how fast:\n"
    "  --count N             valid readings to send\n"
    "  --duration SECONDS    stop after this long (whichever of --count/--duration is first;\n"
    "                        with neither, run until SIGINT or SIGTERM)\n"
    "  --rate R              readings per second overall, paced by a token bucket\n"
    "                        (default 0: flat out)\n"
    "\n"
    "Timestamps:\n"
    "  --precision ns|us|ms|s   influx timestamp unit (default ns); graphite is always s\n"
    "  --spread SECONDS      stamp readings uniformly over [now - SECONDS, now] (default 0)\n"
    "  --time-base NS        use NS (ns since the epoch) as \"now\" instead of the clock, so\n"
    "                        runs repeat byte for byte\n"
    "  Readings are stamped at least 1 ns apart in the order they are made, so the stream is\n"
    "  in time order unless the options below disturb it.\n"
    "\n"
    "Disturbances (fractions of readings, 0..1, default 0):\n"
    "  --late F              stamp the reading up to --late-by seconds further in the past\n"
    "  --late-by SECONDS     default 3600\n"
    "  --out-of-order F      send the reading after a later one (up to 63 places later)\n"
    "  --dup-ts F            reuse the timestamp of the sensor's previous reading\n"
    "  --malformed F         also send a broken line that bucketd must reject; malformed\n"
    "                        lines are counted apart and never as readings (nor in --count\n"
    "                        or --rate)\n"
    "\n"
    "Other:\n"
    "  --seed S              PRNG seed (default 1): same options and seed, same lines\n"
    "  --counts-file PATH    write \"sensor_id<TAB>count\" per sensor that was sent readings,\n"
    "                        sensor_id being the series key bucketd derives\n"
    "  --record PATH         append every byte the kernel accepted to PATH (the exact lines\n"
    "                        sent, for checks that a peer stored them intact)\n"
    "  --quiet               no progress or warnings on stderr\n"
    "  --help                this text\n"
    "\n"
    "UDP datagrams go out 64 per sendmmsg call; on ENOBUFS/EAGAIN the simulator backs off and\n"
    "retries, and gives up (counting send_errors) only after 2 s without progress.\n"
    "Exit status: 0; 1 if something could not be sent or written; 2 on bad options.\n";

/* ---------------------------------------------------------------------------------------- */
/* Options                                                                                  */

struct options {
    const char *target;
    struct sockaddr_storage addr;
    enum bd_proto proto;
    enum bd_format format;
    enum bd_precision precision;
    uint32_t sensors;
    uint64_t sensor_offset;
    bool short_names;
    uint32_t fields;
    bool seq;
    uint64_t seq_start;
    bool has_count;
    uint64_t count;
    bool has_duration;
    int64_t duration_ns;
    double rate;
    uint32_t per_datagram;
    uint32_t max_datagram; /* 0 until set or defaulted */
    uint32_t connections;
    int64_t spread_ns;
    double late;
    int64_t late_by_ns;
    double out_of_order;
    double dup_ts;
    double malformed;
    uint64_t seed;
    bool has_time_base;
    int64_t time_base;
    const char *counts_file;
    const char *record;
    bool quiet;
};

enum opt_id {
    OPT_TARGET = 256,
    OPT_PROTO,
    OPT_FORMAT,
    OPT_SENSORS,
    OPT_SENSOR_OFFSET,
    OPT_SHORT_NAMES,
    OPT_FIELDS,
    OPT_SEQ,
    OPT_SEQ_START,
    OPT_COUNT,
    OPT_DURATION,
    OPT_RATE,
    OPT_PER_DATAGRAM,
    OPT_MAX_DATAGRAM,
    OPT_CONNECTIONS,
    OPT_PRECISION,
    OPT_SPREAD,
    OPT_TIME_BASE,
    OPT_LATE,
    OPT_LATE_BY,
    OPT_OUT_OF_ORDER,
    OPT_DUP_TS,
    OPT_MALFORMED,
    OPT_SEED,
    OPT_COUNTS_FILE,
    OPT_RECORD,
    OPT_QUIET,
    OPT_HELP,
};

static const struct option long_options[] = {
    {"target", required_argument, NULL, OPT_TARGET},
    {"proto", required_argument, NULL, OPT_PROTO},
    {"format", required_argument, NULL, OPT_FORMAT},
    {"sensors", required_argument, NULL, OPT_SENSORS},
    {"sensor-offset", required_argument, NULL, OPT_SENSOR_OFFSET},
    {"short-names", no_argument, NULL, OPT_SHORT_NAMES},
    {"fields", required_argument, NULL, OPT_FIELDS},
    {"seq", no_argument, NULL, OPT_SEQ},
    {"seq-start", required_argument, NULL, OPT_SEQ_START},
    {"count", required_argument, NULL, OPT_COUNT},
    {"duration", required_argument, NULL, OPT_DURATION},
    {"rate", required_argument, NULL, OPT_RATE},
    {"per-datagram", required_argument, NULL, OPT_PER_DATAGRAM},
    {"max-datagram", required_argument, NULL, OPT_MAX_DATAGRAM},
    {"connections", required_argument, NULL, OPT_CONNECTIONS},
    {"precision", required_argument, NULL, OPT_PRECISION},
    {"spread", required_argument, NULL, OPT_SPREAD},
    {"time-base", required_argument, NULL, OPT_TIME_BASE},
    {"late", required_argument, NULL, OPT_LATE},
    {"late-by", required_argument, NULL, OPT_LATE_BY},
    {"out-of-order", required_argument, NULL, OPT_OUT_OF_ORDER},
    {"dup-ts", required_argument, NULL, OPT_DUP_TS},
    {"malformed", required_argument, NULL, OPT_MALFORMED},
    {"seed", required_argument, NULL, OPT_SEED},
    {"counts-file", required_argument, NULL, OPT_COUNTS_FILE},
    {"record", required_argument, NULL, OPT_RECORD},
    {"quiet", no_argument, NULL, OPT_QUIET},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int bad_usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("bucketd-sim: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\nTry 'bucketd-sim --help'.\n", stderr);
    return 2;
}

/* Decimal digits only, no sign, no spaces, within [min, max]. */
static bool parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out) {
    if (s[0] < '0' || s[0] > '9') {
        return false;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < min || v > max) {
        return false;
    }
    *out = (uint64_t)v;
    return true;
}

static bool parse_u32(const char *s, uint32_t min, uint32_t max, uint32_t *out) {
    uint64_t v = 0;
    if (!parse_u64(s, min, max, &v)) {
        return false;
    }
    *out = (uint32_t)v;
    return true;
}

/* A finite decimal number within [min, max]; strtod's hex and "inf" forms are refused. */
static bool parse_double(const char *s, double min, double max, double *out) {
    if (*s == '\0' || strpbrk(s, "xXnNiI") != NULL) {
        return false;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || !isfinite(v) || v < min || v > max) {
        return false;
    }
    *out = v;
    return true;
}

/* Seconds (fractions allowed) to nanoseconds; at most ten years, which no option needs. */
static bool parse_seconds(const char *s, bool allow_zero, int64_t *out_ns) {
    double v = 0;
    if (!parse_double(s, 0.0, 10.0 * 366 * 86400, &v) || (!allow_zero && v <= 0)) {
        return false;
    }
    *out_ns = (int64_t)llround(v * 1e9);
    return true;
}

static bool parse_fraction(const char *s, double *out) {
    return parse_double(s, 0.0, 1.0, out);
}

/* 0 to run, 1 to exit successfully at once (--help), 2 for bad usage (already reported). */
static int parse_args(int argc, char **argv, struct options *o) {
    opterr = 0;
    for (;;) {
        int idx = -1;
        int c = getopt_long(argc, argv, ":h", long_options, &idx);
        if (c == -1) {
            break;
        }
        const char *v = optarg;
        bool ok = true;
        const char *want = NULL;
        switch (c) {
        case 'h':
        case OPT_HELP:
            fputs(usage, stdout);
            return 1;
        case OPT_TARGET:
            o->target = v;
            ok = bd_parse_hostport(v, &o->addr) == 0;
            want = "a numeric HOST:PORT such as 127.0.0.1:8089 or [::1]:8089";
            break;
        case OPT_PROTO:
            ok = strcmp(v, "udp") == 0 || strcmp(v, "tcp") == 0;
            o->proto = strcmp(v, "tcp") == 0 ? BD_PROTO_TCP : BD_PROTO_UDP;
            want = "udp or tcp";
            break;
        case OPT_FORMAT:
            ok = bd_format_parse(v, &o->format) == 0;
            want = "influx or graphite";
            break;
        case OPT_SENSORS:
            ok = parse_u32(v, 1, MAX_SENSORS, &o->sensors);
            want = "a number of sensors from 1 to 10000000";
            break;
        case OPT_SENSOR_OFFSET:
            ok = parse_u64(v, 0, UINT64_MAX / 2, &o->sensor_offset);
            want = "a sensor number";
            break;
        case OPT_SHORT_NAMES:
            o->short_names = true;
            break;
        case OPT_FIELDS:
            ok = parse_u32(v, 1, MAX_FIELDS, &o->fields);
            want = "a number of fields from 1 to 64";
            break;
        case OPT_SEQ:
            o->seq = true;
            break;
        case OPT_SEQ_START:
            ok = parse_u64(v, 0, (uint64_t)INT64_MAX / 2, &o->seq_start);
            want = "a sequence number";
            break;
        case OPT_COUNT:
            ok = parse_u64(v, 1, (uint64_t)INT64_MAX / 2, &o->count);
            o->has_count = true;
            want = "a positive number of readings";
            break;
        case OPT_DURATION:
            ok = parse_seconds(v, false, &o->duration_ns);
            o->has_duration = true;
            want = "a positive number of seconds";
            break;
        case OPT_RATE:
            ok = parse_double(v, 0.0, 1e10, &o->rate);
            want = "readings per second (0 = flat out)";
            break;
        case OPT_PER_DATAGRAM:
            ok = parse_u32(v, 1, MAX_PER_DATAGRAM, &o->per_datagram);
            want = "a number of lines from 1 to 4096";
            break;
        case OPT_MAX_DATAGRAM:
            ok = parse_u32(v, 64, UDP_MAX_PAYLOAD, &o->max_datagram);
            want = "a datagram size from 64 to 65507 bytes";
            break;
        case OPT_CONNECTIONS:
            ok = parse_u32(v, 1, MAX_CONNECTIONS, &o->connections);
            want = "a number of connections from 1 to 1024";
            break;
        case OPT_PRECISION:
            ok = bd_precision_parse(v, &o->precision) == 0;
            want = "ns, us, ms or s";
            break;
        case OPT_SPREAD:
            ok = parse_seconds(v, true, &o->spread_ns);
            want = "a number of seconds";
            break;
        case OPT_TIME_BASE: {
            uint64_t t = 0;
            ok = parse_u64(v, 0, (uint64_t)INT64_MAX / 2, &t);
            o->time_base = (int64_t)t;
            o->has_time_base = true;
            want = "a time in nanoseconds since the epoch";
            break;
        }
        case OPT_LATE:
            ok = parse_fraction(v, &o->late);
            want = "a fraction from 0 to 1";
            break;
        case OPT_LATE_BY:
            ok = parse_seconds(v, false, &o->late_by_ns);
            want = "a positive number of seconds";
            break;
        case OPT_OUT_OF_ORDER:
            ok = parse_fraction(v, &o->out_of_order);
            want = "a fraction from 0 to 1";
            break;
        case OPT_DUP_TS:
            ok = parse_fraction(v, &o->dup_ts);
            want = "a fraction from 0 to 1";
            break;
        case OPT_MALFORMED:
            ok = parse_fraction(v, &o->malformed);
            want = "a fraction from 0 to 1";
            break;
        case OPT_SEED:
            ok = parse_u64(v, 0, UINT64_MAX, &o->seed);
            want = "an unsigned integer";
            break;
        case OPT_COUNTS_FILE:
            o->counts_file = v;
            break;
        case OPT_RECORD:
            o->record = v;
            break;
        case OPT_QUIET:
            o->quiet = true;
            break;
        case ':':
            return bad_usage("option '%s' needs a value", argv[optind - 1]);
        default:
            return bad_usage("unknown option '%s'", argv[optind - 1]);
        }
        if (!ok) {
            return bad_usage("--%s: '%s' is not %s", long_options[idx].name, v, want);
        }
    }
    if (optind < argc) {
        return bad_usage("unexpected argument '%s'", argv[optind]);
    }
    if (o->target == NULL) {
        return bad_usage("--target HOST:PORT is required");
    }
    if (o->max_datagram == 0) {
        o->max_datagram = o->per_datagram > 1 ? DEFAULT_PACKED_DATAGRAM : UDP_MAX_PAYLOAD;
    }
    if (o->proto == BD_PROTO_UDP && o->connections > 1) {
        return bad_usage("--connections is for --proto tcp");
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Random numbers                                                                           */

/* splitmix64: turns the seed into well-mixed, never-zero xorshift states. */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* xorshift64*: three shifts and a multiply per number, plenty for simulated sensors. */
static inline uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * UINT64_C(0x2545F4914F6CDD1D);
}

/* Uniform in [0, n) by a multiply-high (Lemire), so no modulo bias for large n and no divide. */
static inline uint64_t rng_below(uint64_t *s, uint64_t n) {
    return (uint64_t)(((unsigned __int128)rng_next(s) * n) >> 64);
}

/* A fraction as a threshold on a 64-bit draw; UINT64_MAX means "always". */
static uint64_t fraction_threshold(double f) {
    if (f >= 1.0) {
        return UINT64_MAX;
    }
    double t = f * 18446744073709551616.0;
    return t >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)t;
}

static inline bool rng_chance(uint64_t *s, uint64_t threshold) {
    return threshold == UINT64_MAX || rng_next(s) < threshold;
}

/* ---------------------------------------------------------------------------------------- */
/* Number formatting (the hot path: a line holds half a dozen numbers)                      */

static const char digit_pairs[201] = "00010203040506070809"
                                     "10111213141516171819"
                                     "20212223242526272829"
                                     "30313233343536373839"
                                     "40414243444546474849"
                                     "50515253545556575859"
                                     "60616263646566676869"
                                     "70717273747576777879"
                                     "80818283848586878889"
                                     "90919293949596979899";

static const uint64_t powers_of_ten[20] = {
    UINT64_C(1),
    UINT64_C(10),
    UINT64_C(100),
    UINT64_C(1000),
    UINT64_C(10000),
    UINT64_C(100000),
    UINT64_C(1000000),
    UINT64_C(10000000),
    UINT64_C(100000000),
    UINT64_C(1000000000),
    UINT64_C(10000000000),
    UINT64_C(100000000000),
    UINT64_C(1000000000000),
    UINT64_C(10000000000000),
    UINT64_C(100000000000000),
    UINT64_C(1000000000000000),
    UINT64_C(10000000000000000),
    UINT64_C(100000000000000000),
    UINT64_C(1000000000000000000),
    UINT64_C(10000000000000000000),
};

/* Decimal digits of v: log2 from the leading zeros, times log10(2) ~ 1233/4096, then one fix. */
static inline unsigned decimal_digits(uint64_t v) {
    v |= 1;
    unsigned t = ((unsigned)(64 - __builtin_clzll(v)) * 1233) >> 12;
    return t + (v >= powers_of_ten[t]);
}

static inline void put_pair(char *t, unsigned v) {
    t[0] = digit_pairs[2 * v];
    t[1] = digit_pairs[2 * v + 1];
}

/*
 * Writes the digits straight into place from the right, four at a time: no temporary, no
 * variable-length copy, and a dependency chain of one division per four digits. Timestamps
 * have 19 digits, so this loop is most of the generator's time.
 */
static inline char *put_u64(char *p, uint64_t v) {
    char *end = p + decimal_digits(v);
    char *t = end;
    while (v >= 10000) {
        unsigned r = (unsigned)(v % 10000);
        v /= 10000;
        t -= 4;
        put_pair(t, r / 100);
        put_pair(t + 2, r % 100);
    }
    unsigned w = (unsigned)v;
    if (w >= 100) {
        t -= 2;
        put_pair(t, w % 100);
        w /= 100;
    }
    if (w >= 10) {
        put_pair(t - 2, w);
    } else {
        t[-1] = (char)('0' + w);
    }
    return end;
}

static inline char *put_i64(char *p, int64_t v) {
    if (v < 0) {
        *p++ = '-';
        return put_u64(p, (uint64_t)0 - (uint64_t)v);
    }
    return put_u64(p, (uint64_t)v);
}

/* A float with two decimals from its value in hundredths: -1234 -> "-12.34". */
static inline char *put_hundredths(char *p, int64_t v) {
    if (v < 0) {
        *p++ = '-';
        v = -v;
    }
    p = put_u64(p, (uint64_t)v / 100);
    *p++ = '.';
    put_pair(p, (unsigned)(v % 100));
    return p + 2;
}

/* Field values: floats in [-50.00, 149.99], integers in [-100, 99899]; at most 6 characters. */
#define FLOAT_SPAN 20000
#define FLOAT_LOW 5000
#define INT_SPAN 100000
#define INT_LOW 100
#define VALUE_MAX_CHARS 6

/* ---------------------------------------------------------------------------------------- */
/* Broken lines for --malformed: each one bucketd's parser rejects (checked by the tests)   */

struct breakage {
    const char *body; /* after the head */
    bool ts;          /* then " <timestamp>" */
    const char *tail; /* then this */
};

static const struct breakage influx_breakage[] = {
    {"", true, ""},              /* no field set: the timestamp is taken for a field */
    {" f0=12.3.4", true, ""},    /* a float with two dots */
    {" f0=,f1=2i", true, ""},    /* an empty field value */
    {" f0=1.5 12x4", false, ""}, /* a timestamp that is not a number */
    {"", false, ""},             /* the head alone: no field set at all */
    {" f0=1i2", true, ""},       /* an integer suffix in the middle */
    {" f0=1.5,=2", true, ""},    /* an empty field key */
    {" f0=1.5", true, " junk"},  /* text after the timestamp */
};

static const struct breakage graphite_breakage[] = {
    {" abc", true, ""},       /* a value that is not a number */
    {"", false, ""},          /* no value */
    {" 1.5 12x", false, ""},  /* a timestamp that is not a number */
    {" 1.5", true, " extra"}, /* text after the timestamp */
    {" 1.5.2", true, ""},     /* a float with two dots */
};

/* Longest body + tail above, so buffers can be sized from it. */
#define BREAKAGE_MAX_EXTRA 24

/* ---------------------------------------------------------------------------------------- */
/* The simulator                                                                            */

enum entry_kind { ENTRY_READING = 0, ENTRY_MALFORMED };

#define FLAG_LATE 1u
#define FLAG_DUP 2u
#define FLAG_OOO 4u

/* One line to send, as decided by the shape stream; its field values are drawn when formatted. */
struct entry {
    uint64_t seq;
    int64_t ts_ns;
    uint32_t sensor;
    uint8_t kind;
    uint8_t flags;
    uint8_t variant; /* malformed: index into the breakage table */
    bool decided;    /* the out-of-order draw was made for it at the window's head */
};

/* What was put in a datagram or chunk, kept until the send succeeds so only sent lines count. */
struct sent {
    uint32_t sensor;
    uint32_t end; /* TCP: offset just past the line in the chunk */
    uint8_t kind;
    uint8_t flags;
};

struct counters {
    uint64_t readings;
    uint64_t malformed;
    uint64_t datagrams;
    uint64_t bytes;
    uint64_t syscalls;
    uint64_t retries;     /* sends retried after ENOBUFS/EAGAIN */
    uint64_t refused;     /* ECONNREFUSED reports: an earlier datagram reached no listener */
    uint64_t send_errors; /* datagrams (UDP) or chunks (TCP) given up */
    uint64_t late;
    uint64_t dup_ts;
    uint64_t out_of_order;
};

struct udp_out {
    int fd;
    struct mmsghdr msgs[UDP_BATCH];
    struct iovec iov[UDP_BATCH];
    char *slots;      /* UDP_BATCH slots of slot_size bytes */
    size_t slot_size; /* a datagram's lines, one more (a line is formatted before it is known to
                       * fit) and slack */
    uint32_t first[UDP_BATCH + 1]; /* datagram d holds sent[first[d], first[d + 1]) */
    char *carry;                   /* a line that did not fit in the last datagram of a batch */
    size_t carry_len;
    struct sent carry_sent;
};

struct tcp_out {
    int *fds;
    uint32_t n_fds;
    uint32_t next;
    char *chunk; /* TCP_CHUNK + line_max + slack bytes */
};

struct sim {
    const struct options *o;
    int64_t unit_ns; /* timestamp unit on the wire */
    size_t line_max; /* upper bound of any line this run makes, '\n' included */
    size_t slack;    /* room every line buffer keeps past line_max for fixed-size copies */

    /* Sensor table, indexed 0..sensors-1 (sensor number = sensor_offset + index). */
    char *heads; /* HEAD_STRIDE bytes per sensor: "m1,site=..,sensor=s7" or "sim.s7.value" */
    uint8_t *head_len;
    int64_t *last_ts; /* INT64_MIN until the sensor's first reading */
    uint64_t *count;  /* readings sent */

    char field_keys[MAX_FIELDS][8]; /* " f0=", ",f1=", ... */
    uint8_t field_key_len[MAX_FIELDS];

    uint64_t shape_rng;
    uint64_t value_rng;
    uint64_t late_thr, ooo_thr, dup_thr, malformed_thr;

    /* Look-ahead window (ring of WINDOW entries) between the generator and the senders. */
    struct entry win[WINDOW];
    uint32_t win_head;
    uint32_t win_count;
    uint64_t generated; /* readings made so far */
    int64_t clock_ns;   /* "now" for the readings being made, refreshed once per batch */
    int64_t last_base;  /* base time of the last reading made, to keep them 1 ns apart */
    uint64_t ts_high;   /* timestamp / 10^9 whose digits are in ts_high_text */
    char ts_high_text[16];
    uint8_t ts_high_len;

    struct sent *sent;
    uint32_t sent_cap;

    struct udp_out udp;
    struct tcp_out tcp;

    struct counters st;
    int fatal_errno; /* set when sending cannot go on */
    FILE *record;    /* --record: a copy of what was sent */
};

/*
 * SIGINT/SIGTERM ask for a clean end (summary and counts still written). A signal handler may
 * only touch a volatile sig_atomic_t; there are no other threads.
 */
static volatile sig_atomic_t stop_requested;

static void on_stop_signal(int sig) {
    (void)sig;
    stop_requested = 1;
}

/* Measurement and tags of sensor number g, in wire order and sorted (the series key). */
static int format_sensor(const struct options *o, uint64_t g, bool sorted, char *buf, size_t cap) {
    if (o->format == BD_FORMAT_GRAPHITE) {
        return snprintf(buf, cap, "sim.s%" PRIu64 ".value", g);
    }
    if (o->short_names) {
        return snprintf(buf, cap, "m,site=s%06" PRIu64, g);
    }
    unsigned m = (unsigned)(g % 4);
    unsigned site = (unsigned)(g % 5);
    unsigned rack = (unsigned)(g % 16);
    /*
     * Two sensors in three write their tags unsorted, so the daemon's sorting is exercised;
     * every third one also carries a third tag, so the tag count varies.
     */
    switch (g % 3) {
    case 0:
        return sorted ? snprintf(buf, cap, "m%u,sensor=s%" PRIu64 ",site=plant-%u", m, g, site)
                      : snprintf(buf, cap, "m%u,site=plant-%u,sensor=s%" PRIu64, m, site, g);
    case 1:
        return snprintf(buf, cap, "m%u,sensor=s%" PRIu64 ",site=plant-%u", m, g, site);
    default:
        return sorted ? snprintf(buf, cap, "m%u,rack=r%02u,sensor=s%" PRIu64 ",site=plant-%u", m,
                                 rack, g, site)
                      : snprintf(buf, cap, "m%u,site=plant-%u,sensor=s%" PRIu64 ",rack=r%02u", m,
                                 site, g, rack);
    }
}

static void sim_close(struct sim *s) {
    if (s->record != NULL) {
        fclose(s->record);
    }
    free(s->heads);
    free(s->head_len);
    free(s->last_ts);
    free(s->count);
    free(s->sent);
    free(s->udp.slots);
    free(s->udp.carry);
    free(s->tcp.chunk);
    if (s->udp.fd >= 0) {
        close(s->udp.fd);
    }
    for (uint32_t i = 0; i < s->tcp.n_fds; i++) {
        if (s->tcp.fds[i] >= 0) {
            close(s->tcp.fds[i]);
        }
    }
    free(s->tcp.fds);
    memset(s, 0, sizeof(*s));
    s->udp.fd = -1;
}

static int sim_init(struct sim *s, const struct options *o, struct bd_err *err) {
    memset(s, 0, sizeof(*s));
    s->udp.fd = -1;
    s->o = o;
    s->unit_ns = o->format == BD_FORMAT_GRAPHITE ? BD_NS_PER_S : bd_parse_unit_ns(o->precision);

    size_t n = o->sensors;
    /* Zeroed: whole HEAD_STRIDE blocks are copied, so no byte of them is ever indeterminate. */
    s->heads = calloc(n, HEAD_STRIDE);
    s->head_len = malloc(n);
    s->last_ts = malloc(n * sizeof(*s->last_ts));
    s->count = calloc(n, sizeof(*s->count));
    if (s->heads == NULL || s->head_len == NULL || s->last_ts == NULL || s->count == NULL) {
        return bd_err_set(err, -ENOMEM, "out of memory for %zu sensors", n);
    }
    size_t head_max = 0;
    for (size_t i = 0; i < n; i++) {
        int len =
            format_sensor(o, o->sensor_offset + i, false, s->heads + i * HEAD_STRIDE, HEAD_STRIDE);
        BD_ASSERT(len > 0 && len < HEAD_STRIDE);
        s->head_len[i] = (uint8_t)len;
        s->last_ts[i] = INT64_MIN;
        head_max = BD_MAX(head_max, (size_t)len);
    }

    size_t keys_len = 0;
    for (uint32_t j = 0; j < o->fields; j++) {
        int len =
            snprintf(s->field_keys[j], sizeof(s->field_keys[j]), "%sf%u=", j == 0 ? " " : ",", j);
        s->field_key_len[j] = (uint8_t)len;
        keys_len += (size_t)len;
    }
    /* Bound of any line: head, fields or value, seq, " ts", '\n', and room for a breakage. */
    size_t body =
        o->format == BD_FORMAT_GRAPHITE ? 1 + 20 : keys_len + o->fields * (VALUE_MAX_CHARS + 1);
    size_t seq = o->format == BD_FORMAT_GRAPHITE ? 0 : (o->seq ? sizeof(",seq=") + 21 : 0);
    s->line_max =
        head_max + BD_MAX(body + seq, (size_t)BREAKAGE_MAX_EXTRA) + 1 + 20 + BREAKAGE_MAX_EXTRA + 1;
    /* Formatting may write this far past a line's end before the next part overwrites it. */
    s->slack = HEAD_STRIDE + 8;

    uint64_t seed = o->seed;
    s->shape_rng = splitmix64(&seed) | 1;
    s->value_rng = splitmix64(&seed) | 1;
    s->late_thr = fraction_threshold(o->late);
    s->ooo_thr = fraction_threshold(o->out_of_order);
    s->dup_thr = fraction_threshold(o->dup_ts);
    s->malformed_thr = fraction_threshold(o->malformed);
    s->last_base = INT64_MIN;
    s->ts_high = UINT64_MAX;

    uint32_t udp_lines = UDP_BATCH * o->per_datagram;
    s->sent_cap = BD_MAX(udp_lines, (uint32_t)(TCP_CHUNK / 8)) + 1;
    s->sent = malloc(s->sent_cap * sizeof(*s->sent));
    if (s->sent == NULL) {
        return bd_err_set(err, -ENOMEM, "out of memory");
    }
    if (o->proto == BD_PROTO_UDP) {
        if (s->line_max > o->max_datagram) {
            return bd_err_set(err, -EINVAL,
                              "--max-datagram %u is smaller than the longest line these options "
                              "can make (%zu bytes)",
                              o->max_datagram, s->line_max);
        }
        /* Few lines per datagram need small slots: they stay in cache. */
        s->udp.slot_size =
            BD_MIN((size_t)o->max_datagram, o->per_datagram * s->line_max) + s->line_max + s->slack;
        s->udp.slots = malloc(UDP_BATCH * s->udp.slot_size);
        s->udp.carry = malloc(s->line_max + s->slack);
        if (s->udp.slots == NULL || s->udp.carry == NULL) {
            return bd_err_set(err, -ENOMEM, "out of memory for datagram buffers");
        }
        /* Connected socket: no address per message, and the kernel caches the route. */
        for (uint32_t i = 0; i < UDP_BATCH; i++) {
            s->udp.iov[i].iov_base = s->udp.slots + i * s->udp.slot_size;
            s->udp.msgs[i].msg_hdr.msg_iov = &s->udp.iov[i];
            s->udp.msgs[i].msg_hdr.msg_iovlen = 1;
        }
    } else {
        s->tcp.chunk = malloc(TCP_CHUNK + s->line_max + s->slack);
        s->tcp.fds = malloc(o->connections * sizeof(int));
        if (s->tcp.chunk == NULL || s->tcp.fds == NULL) {
            return bd_err_set(err, -ENOMEM, "out of memory for the TCP chunk");
        }
    }
    return 0;
}

static socklen_t addr_len(const struct sockaddr_storage *ss) {
    return ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

static int connect_one(const struct options *o, int type, int *out_fd, struct bd_err *err) {
    int fd = socket(o->addr.ss_family, type | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return bd_err_set(err, -errno, "socket: %s", strerror(errno));
    }
    if (type == SOCK_DGRAM) {
        /* A larger send buffer rides out short receiver stalls instead of blocking at once. */
        int sz = 4 * 1024 * 1024;
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    }
    if (connect(fd, (const struct sockaddr *)&o->addr, addr_len(&o->addr)) != 0) {
        int e = errno;
        close(fd);
        return bd_err_set(err, -e, "connect to %s: %s", o->target, strerror(e));
    }
    *out_fd = fd;
    return 0;
}

static int sim_connect(struct sim *s, struct bd_err *err) {
    const struct options *o = s->o;
    if (o->proto == BD_PROTO_UDP) {
        return connect_one(o, SOCK_DGRAM, &s->udp.fd, err);
    }
    for (uint32_t i = 0; i < o->connections; i++) {
        int fd = -1;
        int rc = connect_one(o, SOCK_STREAM, &fd, err);
        if (rc != 0) {
            return rc;
        }
        s->tcp.fds[s->tcp.n_fds++] = fd;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Generator: decides what each line is (sensor, time, disturbances), WINDOW lines ahead     */

static bool gen_exhausted(const struct sim *s) {
    return s->o->has_count && s->generated == s->o->count;
}

static void win_push(struct sim *s, const struct entry *e) {
    BD_ASSERT(s->win_count < WINDOW);
    s->win[(s->win_head + s->win_count) & (WINDOW - 1)] = *e;
    s->win_count++;
}

/* Makes one reading, preceded by a malformed line when --malformed picks it. */
static void gen_make(struct sim *s) {
    const struct options *o = s->o;
    uint64_t *r = &s->shape_rng;
    uint32_t sensor = (uint32_t)rng_below(r, o->sensors);

    /* Real sensors do not share a nanosecond; this also makes the stream time-ordered. */
    int64_t base = s->last_base == INT64_MIN ? s->clock_ns : BD_MAX(s->clock_ns, s->last_base + 1);
    s->last_base = base;

    if (s->malformed_thr != 0 && rng_chance(r, s->malformed_thr)) {
        struct entry bad = {
            .ts_ns = base,
            .sensor = (uint32_t)rng_below(r, o->sensors),
            .kind = ENTRY_MALFORMED,
            .decided = true,
        };
        bad.variant = (uint8_t)(o->format == BD_FORMAT_GRAPHITE
                                    ? rng_below(r, BD_ARRAY_LEN(graphite_breakage))
                                    : rng_below(r, BD_ARRAY_LEN(influx_breakage)));
        win_push(s, &bad);
    }

    struct entry e = {.seq = o->seq_start + s->generated, .sensor = sensor};
    /* Each draw happens whatever the outcome, so one option never shifts another's picks. */
    bool dup = s->dup_thr != 0 && rng_chance(r, s->dup_thr);
    int64_t spread = o->spread_ns > 0 ? (int64_t)rng_below(r, (uint64_t)o->spread_ns + 1) : 0;
    bool late = s->late_thr != 0 && rng_chance(r, s->late_thr);
    int64_t late_by = late ? 1 + (int64_t)rng_below(r, (uint64_t)o->late_by_ns) : 0;
    if (dup && s->last_ts[sensor] != INT64_MIN) {
        e.ts_ns = s->last_ts[sensor];
        e.flags = FLAG_DUP;
    } else {
        e.ts_ns = BD_MAX(base - spread - late_by, 0);
        e.flags = late ? FLAG_LATE : 0;
    }
    s->last_ts[sensor] = e.ts_ns;
    s->generated++;
    win_push(s, &e);
}

/*
 * The next line to send, or NULL when the run has made its last one. The window is kept full
 * so the out-of-order pick sees the same candidates whatever the batch sizes were.
 */
static struct entry *gen_peek(struct sim *s) {
    while (s->win_count + 2 <= WINDOW && !gen_exhausted(s)) {
        gen_make(s);
    }
    if (s->win_count == 0) {
        return NULL;
    }
    struct entry *h = &s->win[s->win_head];
    if (!h->decided) {
        h->decided = true;
        if (s->ooo_thr != 0 && rng_chance(&s->shape_rng, s->ooo_thr) && s->win_count > 1) {
            uint32_t k = 1 + (uint32_t)rng_below(&s->shape_rng, s->win_count - 1);
            struct entry *other = &s->win[(s->win_head + k) & (WINDOW - 1)];
            struct entry tmp = *h;
            *h = *other;
            *other = tmp;
            /* The reading sent late gets its own pick when it reaches the head. */
            other->decided = false;
            h->decided = true;
            if (h->kind == ENTRY_READING) {
                h->flags |= FLAG_OOO;
            }
        }
    }
    return h;
}

static void gen_pop(struct sim *s) {
    BD_ASSERT(s->win_count > 0);
    s->win_head = (s->win_head + 1) & (WINDOW - 1);
    s->win_count--;
}

/* ---------------------------------------------------------------------------------------- */
/* Formatting                                                                               */

/* Exactly nine digits, leading zeros kept: the low part of a timestamp. */
static inline char *put_nine_digits(char *p, uint32_t v) {
    uint32_t hi = v / 10000; /* 5 digits */
    uint32_t lo = v % 10000;
    p[0] = (char)('0' + hi / 10000);
    put_pair(p + 1, (hi % 10000) / 100);
    put_pair(p + 3, hi % 100);
    put_pair(p + 5, lo / 100);
    put_pair(p + 7, lo % 100);
    return p + 9;
}

/*
 * " <timestamp>". Neighbouring readings share the leading digits of their timestamps, so those
 * are formatted once and copied while they stay the same; only the low nine digits are new.
 */
static inline char *put_time(struct sim *s, char *p, int64_t ts_ns) {
    uint64_t v = (uint64_t)(ts_ns / s->unit_ns);
    *p++ = ' ';
    if (v < UINT64_C(1000000000)) {
        return put_u64(p, v);
    }
    uint64_t high = v / UINT64_C(1000000000);
    if (high != s->ts_high) {
        s->ts_high = high;
        s->ts_high_len = (uint8_t)(put_u64(s->ts_high_text, high) - s->ts_high_text);
    }
    memcpy(p, s->ts_high_text, sizeof(s->ts_high_text));
    return put_nine_digits(p + s->ts_high_len, (uint32_t)(v % UINT64_C(1000000000)));
}

/* Writes e's line, '\n' included, at p (room: line_max + slack); returns the end. */
static char *format_entry(struct sim *s, const struct entry *e, char *p) {
    const struct options *o = s->o;
    /* A fixed-size copy compiles to a few moves; the buffers have HEAD_STRIDE bytes of slack. */
    memcpy(p, s->heads + (size_t)e->sensor * HEAD_STRIDE, HEAD_STRIDE);
    p += s->head_len[e->sensor];

    if (e->kind == ENTRY_MALFORMED) {
        const struct breakage *b = o->format == BD_FORMAT_GRAPHITE ? &graphite_breakage[e->variant]
                                                                   : &influx_breakage[e->variant];
        size_t len = strlen(b->body);
        memcpy(p, b->body, len);
        p += len;
        if (b->ts) {
            p = put_time(s, p, e->ts_ns);
        }
        len = strlen(b->tail);
        memcpy(p, b->tail, len);
        p += len;
        *p++ = '\n';
        return p;
    }

    uint64_t *r = &s->value_rng;
    if (o->format == BD_FORMAT_GRAPHITE) {
        *p++ = ' ';
        if (o->seq) {
            p = put_u64(p, e->seq);
        } else {
            p = put_hundredths(p, (int64_t)rng_below(r, FLOAT_SPAN) - FLOAT_LOW);
        }
    } else {
        for (uint32_t j = 0; j < o->fields; j++) {
            memcpy(p, s->field_keys[j], 8);
            p += s->field_key_len[j];
            if (j & 1) {
                p = put_i64(p, (int64_t)rng_below(r, INT_SPAN) - INT_LOW);
                *p++ = 'i';
            } else {
                p = put_hundredths(p, (int64_t)rng_below(r, FLOAT_SPAN) - FLOAT_LOW);
            }
        }
        if (o->seq) {
            memcpy(p, ",seq=", 5);
            p = put_u64(p + 5, e->seq);
            *p++ = 'i';
        }
    }
    p = put_time(s, p, e->ts_ns);
    *p++ = '\n';
    return p;
}

/* ---------------------------------------------------------------------------------------- */
/* Accounting: only what the kernel took counts                                              */

static void account(struct sim *s, const struct sent *m) {
    if (m->kind == ENTRY_MALFORMED) {
        s->st.malformed++;
        return;
    }
    s->st.readings++;
    s->count[m->sensor]++;
    s->st.late += (m->flags & FLAG_LATE) != 0;
    s->st.dup_ts += (m->flags & FLAG_DUP) != 0;
    s->st.out_of_order += (m->flags & FLAG_OOO) != 0;
}

static void sleep_until(int64_t mono_ns) {
    struct timespec ts = {.tv_sec = mono_ns / BD_NS_PER_S, .tv_nsec = mono_ns % BD_NS_PER_S};
    /* An interruption only means a signal arrived; the callers re-check their clocks. */
    (void)clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* UDP                                                                                      */

/*
 * Fills up to UDP_BATCH datagrams with lines, at most budget of them readings (malformed lines
 * come on top). Returns the number of datagrams; *used is the readings taken from the budget.
 */
static uint32_t udp_fill(struct sim *s, uint64_t budget, uint64_t *used) {
    struct udp_out *u = &s->udp;
    const struct options *o = s->o;
    uint32_t d = 0;
    uint32_t n_sent = 0;
    uint32_t lines = 0;
    size_t pos = 0;
    char *slot = u->slots;
    u->first[0] = 0;

    if (u->carry_len > 0) {
        memcpy(slot, u->carry, u->carry_len);
        pos = u->carry_len;
        lines = 1;
        s->sent[n_sent++] = u->carry_sent;
        u->carry_len = 0;
    }
    for (;;) {
        if (lines == o->per_datagram) {
            if (d + 1 == UDP_BATCH) {
                break;
            }
            u->iov[d].iov_len = pos;
            u->first[++d] = n_sent;
            slot += u->slot_size;
            pos = 0;
            lines = 0;
        }
        struct entry *e = gen_peek(s);
        if (e == NULL) {
            break;
        }
        if (e->kind == ENTRY_READING) {
            if (*used == budget) {
                break;
            }
            (*used)++;
        }
        char *line = slot + pos;
        size_t len = (size_t)(format_entry(s, e, line) - line);
        struct sent m = {.sensor = e->sensor, .kind = e->kind, .flags = e->flags};
        gen_pop(s);
        BD_ASSERT(len <= s->line_max);
        if (pos + len <= o->max_datagram) {
            pos += len;
            lines++;
            BD_ASSERT(n_sent < s->sent_cap);
            s->sent[n_sent++] = m;
            continue;
        }
        /* It does not fit: it starts the next datagram, or the next batch. */
        BD_ASSERT(pos > 0);
        if (d + 1 == UDP_BATCH) {
            memcpy(u->carry, line, len);
            u->carry_len = len;
            u->carry_sent = m;
            break;
        }
        u->iov[d].iov_len = pos;
        u->first[++d] = n_sent;
        slot += u->slot_size;
        memmove(slot, line, len);
        pos = len;
        lines = 1;
        BD_ASSERT(n_sent < s->sent_cap);
        s->sent[n_sent++] = m;
    }
    if (pos == 0) {
        return d;
    }
    u->iov[d].iov_len = pos;
    u->first[d + 1] = n_sent;
    return d + 1;
}

static void udp_account(struct sim *s, uint32_t d) {
    struct udp_out *u = &s->udp;
    BD_ASSERT(u->msgs[d].msg_len == u->iov[d].iov_len);
    for (uint32_t i = u->first[d]; i < u->first[d + 1]; i++) {
        account(s, &s->sent[i]);
    }
    s->st.datagrams++;
    s->st.bytes += u->iov[d].iov_len;
    if (s->record != NULL) {
        fwrite(u->iov[d].iov_base, 1, u->iov[d].iov_len, s->record);
    }
}

/*
 * Sends datagrams [0, n): partial sends continue where the kernel stopped; ENOBUFS/EAGAIN back
 * off (50 us doubling to 10 ms) and retry; after GIVE_UP_NS without progress, or on an error
 * retrying cannot fix, the rest are counted in send_errors and the run stops.
 */
static void udp_send(struct sim *s, uint32_t n) {
    struct udp_out *u = &s->udp;
    uint32_t done = 0;
    int64_t backoff = BACKOFF_MIN_NS;
    int64_t stuck_since = 0;
    while (done < n) {
        int rc = sendmmsg(u->fd, u->msgs + done, n - done, 0);
        s->st.syscalls++;
        if (rc > 0) {
            for (uint32_t d = done; d < done + (uint32_t)rc; d++) {
                udp_account(s, d);
            }
            done += (uint32_t)rc;
            backoff = BACKOFF_MIN_NS;
            stuck_since = 0;
            continue;
        }
        int e = rc < 0 ? errno : EIO;
        if (e == EINTR) {
            continue;
        }
        if (e == ECONNREFUSED) {
            /* The report is about an earlier datagram; this one was not sent, so send it again. */
            s->st.refused++;
            continue;
        }
        if (e == ENOBUFS || e == EAGAIN || e == EWOULDBLOCK) {
            int64_t now = bd_mono_ns();
            if (stuck_since == 0) {
                stuck_since = now;
            }
            if (now - stuck_since < GIVE_UP_NS) {
                s->st.retries++;
                sleep_until(now + backoff);
                backoff = BD_MIN(backoff * 2, BACKOFF_MAX_NS);
                continue;
            }
        }
        s->st.send_errors += n - done;
        s->fatal_errno = e;
        return;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* TCP                                                                                      */

/* Fills the chunk with lines, at most budget readings; returns its length. */
static size_t tcp_fill(struct sim *s, uint64_t budget, uint64_t *used, uint32_t *n_sent) {
    size_t pos = 0;
    uint32_t n = 0;
    while (pos < TCP_CHUNK) {
        struct entry *e = gen_peek(s);
        if (e == NULL) {
            break;
        }
        if (e->kind == ENTRY_READING) {
            if (*used == budget) {
                break;
            }
            (*used)++;
        }
        char *end = format_entry(s, e, s->tcp.chunk + pos);
        pos = (size_t)(end - s->tcp.chunk);
        BD_ASSERT(n < s->sent_cap);
        s->sent[n++] = (struct sent){
            .sensor = e->sensor, .end = (uint32_t)pos, .kind = e->kind, .flags = e->flags};
        gen_pop(s);
    }
    *n_sent = n;
    return pos;
}

/*
 * Writes the chunk to the next connection. A signal does not cut a chunk short: a line cut in
 * half would reach the daemon as a different, possibly valid, line.
 */
static void tcp_send(struct sim *s, size_t len, uint32_t n_sent) {
    struct tcp_out *t = &s->tcp;
    int fd = t->fds[t->next];
    t->next = (t->next + 1) % t->n_fds;
    size_t off = 0;
    int e = 0;
    while (off < len) {
        ssize_t w = send(fd, t->chunk + off, len - off, MSG_NOSIGNAL);
        s->st.syscalls++;
        if (w > 0) {
            off += (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else {
            e = w < 0 ? errno : EIO;
            break;
        }
    }
    for (uint32_t i = 0; i < n_sent && s->sent[i].end <= off; i++) {
        account(s, &s->sent[i]);
    }
    s->st.bytes += off;
    if (s->record != NULL) {
        fwrite(t->chunk, 1, off, s->record);
    }
    if (off < len) {
        s->st.send_errors++;
        s->fatal_errno = e;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The run                                                                                  */

struct pacer {
    double rate; /* readings per second; 0 = flat out */
    double tokens;
    double step;  /* readings released at a time: about a millisecond's worth */
    double burst; /* tokens kept at most, so a stall is not followed by a flood */
    int64_t last_ns;
};

static void pacer_init(struct pacer *p, double rate, uint64_t batch_readings, int64_t now) {
    p->rate = rate;
    p->step = BD_MAX(1.0, BD_MIN(rate / 1000.0, (double)batch_readings));
    p->burst = 2 * p->step;
    p->tokens = p->step;
    p->last_ns = now;
}

/* Readings that may go now (sleeping until there are some); 0 when the run must end. */
static uint64_t pace(struct pacer *p, int64_t deadline) {
    for (;;) {
        if (stop_requested) {
            return 0;
        }
        int64_t now = bd_mono_ns();
        if (now >= deadline) {
            return 0;
        }
        if (p->rate <= 0) {
            return UINT64_MAX;
        }
        p->tokens = BD_MIN(p->burst, p->tokens + (double)(now - p->last_ns) * p->rate / 1e9);
        p->last_ns = now;
        if (p->tokens >= p->step) {
            return (uint64_t)p->tokens;
        }
        int64_t wake = now + (int64_t)ceil((p->step - p->tokens) / p->rate * 1e9);
        sleep_until(BD_MIN(wake, deadline));
    }
}

static void progress(const struct sim *s, int64_t start, int64_t now) {
    double secs = (double)(now - start) / 1e9;
    fprintf(stderr, "\rbucketd-sim: %" PRIu64 " readings, %.0f/s ", s->st.readings,
            secs > 0 ? (double)s->st.readings / secs : 0.0);
}

/* Sends until --count, --duration, a signal or a fatal error; returns the elapsed ns. */
static int64_t run(struct sim *s) {
    const struct options *o = s->o;
    int64_t start = bd_mono_ns();
    int64_t deadline = o->has_duration ? start + o->duration_ns : INT64_MAX;
    uint64_t batch_readings =
        o->proto == BD_PROTO_UDP ? (uint64_t)UDP_BATCH * o->per_datagram : TCP_CHUNK / 128;
    struct pacer p;
    pacer_init(&p, o->rate, batch_readings, start);
    bool show = !o->quiet && isatty(STDERR_FILENO);
    int64_t next_show = start + BD_NS_PER_S;
    int64_t now = start;

    while (s->fatal_errno == 0) {
        if (gen_exhausted(s) && s->win_count == 0 && s->udp.carry_len == 0) {
            break;
        }
        uint64_t budget = pace(&p, deadline);
        if (budget == 0) {
            break;
        }
        s->clock_ns = o->has_time_base ? o->time_base : bd_now_ns();
        uint64_t used = 0;
        if (o->proto == BD_PROTO_UDP) {
            uint32_t n = udp_fill(s, budget, &used);
            if (n > 0) {
                udp_send(s, n);
            }
        } else {
            uint32_t n_sent = 0;
            size_t len = tcp_fill(s, budget, &used, &n_sent);
            if (len > 0) {
                tcp_send(s, len, n_sent);
            }
        }
        p.tokens -= (double)used;
        now = bd_mono_ns();
        if (show && now >= next_show) {
            progress(s, start, now);
            next_show = now + BD_NS_PER_S;
        }
    }
    if (show) {
        fputc('\n', stderr);
    }
    return bd_mono_ns() - start;
}

static void print_summary(const struct sim *s, int64_t elapsed_ns) {
    const struct options *o = s->o;
    double secs = (double)elapsed_ns / 1e9;
    double rate = secs > 0 ? (double)s->st.readings / secs : 0.0;
    printf("{\"readings\":%" PRIu64 ",\"malformed\":%" PRIu64 ",\"datagrams\":%" PRIu64
           ",\"bytes\":%" PRIu64 ",\"sensors\":%u,\"elapsed_s\":%.6f,\"readings_per_s\":%.1f"
           ",\"send_errors\":%" PRIu64 ",\"proto\":\"%s\",\"format\":\"%s\",\"per_datagram\":%u",
           s->st.readings, s->st.malformed, s->st.datagrams, s->st.bytes, o->sensors, secs, rate,
           s->st.send_errors, bd_proto_name(o->proto), bd_format_name(o->format), o->per_datagram);
    if (o->proto == BD_PROTO_UDP) {
        printf(",\"max_datagram\":%u,\"retries\":%" PRIu64 ",\"refused\":%" PRIu64, o->max_datagram,
               s->st.retries, s->st.refused);
    } else {
        printf(",\"connections\":%u", o->connections);
    }
    printf(",\"syscalls\":%" PRIu64 ",\"mbytes_per_s\":%.1f,\"late\":%" PRIu64
           ",\"dup_ts\":%" PRIu64 ",\"out_of_order\":%" PRIu64 ",\"seed\":%" PRIu64 "}\n",
           s->st.syscalls, secs > 0 ? (double)s->st.bytes / secs / 1e6 : 0.0, s->st.late,
           s->st.dup_ts, s->st.out_of_order, o->seed);
    fflush(stdout);
}

static int write_counts(const struct sim *s, const char *path, struct bd_err *err) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return bd_err_set(err, -errno, "%s: %s", path, strerror(errno));
    }
    char key[HEAD_STRIDE];
    for (uint32_t i = 0; i < s->o->sensors; i++) {
        if (s->count[i] == 0) {
            continue;
        }
        (void)format_sensor(s->o, s->o->sensor_offset + i, true, key, sizeof(key));
        fprintf(f, "%s\t%" PRIu64 "\n", key, s->count[i]);
    }
    bool failed = ferror(f) != 0;
    if (fclose(f) != 0 || failed) {
        return bd_err_set(err, -EIO, "%s: write failed", path);
    }
    return 0;
}

int main(int argc, char **argv) {
    struct options o = {
        .proto = BD_PROTO_UDP,
        .format = BD_FORMAT_INFLUX,
        .precision = BD_PREC_NS,
        .sensors = 10,
        .fields = 4,
        .per_datagram = 1,
        .connections = 1,
        .late_by_ns = 3600 * BD_NS_PER_S,
        .seed = 1,
    };
    int rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }

    int status = 1;
    struct bd_err err = {0};
    struct sim s;
    if (sim_init(&s, &o, &err) != 0) {
        status = err.code == -EINVAL ? 2 : 1;
        fprintf(stderr, "bucketd-sim: %s\n", err.msg);
        goto out;
    }
    if (o.record != NULL && (s.record = fopen(o.record, "w")) == NULL) {
        fprintf(stderr, "bucketd-sim: --record %s: %s\n", o.record, strerror(errno));
        goto out;
    }
    if (sim_connect(&s, &err) != 0) {
        fprintf(stderr, "bucketd-sim: %s\n", err.msg);
        goto out;
    }
    struct sigaction sa = {.sa_handler = on_stop_signal};
    sigemptyset(&sa.sa_mask);
    /* A second signal kills at once, for a run stuck writing to a receiver that never reads. */
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    int64_t elapsed = run(&s);
    print_summary(&s, elapsed);
    status = 0;
    if (s.fatal_errno != 0) {
        fprintf(stderr, "bucketd-sim: sending stopped: %s\n", strerror(s.fatal_errno));
        status = 1;
    }
    if (s.st.send_errors > 0 || s.st.refused > 0) {
        if (!o.quiet) {
            fprintf(stderr,
                    "bucketd-sim: %" PRIu64 " sends given up, %" PRIu64
                    " datagrams refused (nobody listening at %s?)\n",
                    s.st.send_errors, s.st.refused, o.target);
        }
        status = 1;
    }
    if (o.counts_file != NULL && write_counts(&s, o.counts_file, &err) != 0) {
        fprintf(stderr, "bucketd-sim: counts file %s\n", err.msg);
        status = 1;
    }
out:
    sim_close(&s);
    return status;
}
