/*
 * bucketd-parse: shows what bucketd's parser makes of input lines (DESIGN.md §5). Reads stdin
 * as one stream of lines, parses each with the same code the daemon runs (src/parse*.c) and
 * prints one JSON object per line: the point, or {"error":"...","line":N}. Blank and comment
 * lines print nothing. Single-threaded; every buffer is allocated once at start-up.
 *
 * Choices the contract leaves open, documented in --help too:
 * - A string field value may hold raw newlines, so when a line ends inside one the next line
 *   joins it (as the line-protocol reference decoder does); the entry keeps the number of the
 *   line it started on.
 * - A point without a timestamp gets --default-time, else the current time, truncated to the
 *   precision as the reference decoder does.
 * - Floats print as the shortest text that reads back as the same double, with ".0" added to
 *   integral ones so they stay floats to a JSON reader. The parser never yields NaN or
 *   infinities (it rejects them); should one ever reach the printer it prints null.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bucketd/common.h"
#include "bucketd/config.h"
#include "bucketd/escape.h"
#include "bucketd/parse.h"
#include "bucketd/units.h"

/* Longest line (or entry, when a string spans lines) accepted; longer ones get an error. */
#define MAX_LINE (1024 * 1024)
#define READ_CHUNK (64 * 1024)

static const char usage[] =
    "usage: bucketd-parse [--format influx|graphite] [--precision ns|us|ms|s]\n"
    "                     [--default-time NS]\n"
    "\n"
    "Reads lines on stdin and prints, per line, what bucketd makes of it as one JSON object:\n"
    "  {\"name\":...,\"tags\":[{\"key\":...,\"value\":...}],\n"
    "   \"fields\":[{\"key\":...,\"value\":{KIND:...}}],\"time\":NS}\n"
    "with KIND float, int, uint, bool or string, tags sorted by key; or, for a line bucketd\n"
    "rejects, {\"error\":\"...\",\"line\":N} (N counts input lines from 1). Blank and comment\n"
    "lines print nothing.\n"
    "\n"
    "  --format F        influx (default) or graphite\n"
    "  --precision P     unit of line-protocol timestamps: ns (default), us, ms or s;\n"
    "                    Graphite timestamps are always seconds\n"
    "  --default-time NS time (ns since the epoch) of points without one; default: now.\n"
    "                    Either is truncated to the precision.\n"
    "  --help            this text\n"
    "\n"
    "A line that ends inside a quoted string value continues on the next line. Floats print\n"
    "as the shortest decimal that reads back exactly, integral ones with \".0\". Lines longer\n"
    "than 1 MiB are rejected. Exit status: 0, 1 on a read error, 2 on bad options.\n";

/* ---------------------------------------------------------------------------------------- */
/* JSON output (stdout is buffered by stdio; it is flushed before every blocking read)      */

/*
 * A JSON string. Everything printed comes from the parser, which hands out valid UTF-8 only
 * (and static ASCII messages). Characters past ASCII pass through as they are, except those a
 * terminal acts on or that hide or reorder text (C1 controls, bidi controls: bd_escape_json),
 * written as \u escapes: the same JSON string, safe to read on a terminal.
 */
static void put_json_string(const char *str, size_t len) {
    const unsigned char *s = (const unsigned char *)str;
    char buf[BD_ESCAPE_CAP(256)];
    putchar('"');
    for (size_t i = 0; i < len;) {
        unsigned char c = s[i];
        if (c >= 0x80) {
            size_t run = 1;
            while (i + run < len && s[i + run] >= 0x80 && run < 256) {
                run++;
            }
            /* A cut inside a character would leave its bytes unrecognised: end before it. */
            while (i + run < len && (s[i + run] & 0xc0) == 0x80 && run > 1) {
                run--;
            }
            size_t used = bd_escape_json(buf, sizeof(buf), str + i, run);
            fputs(buf, stdout);
            i += used > 0 ? used : run;
            continue;
        }
        if (c == '"' || c == '\\') {
            putchar('\\');
            putchar(c);
        } else if (c < 0x20 || c == 0x7f) {
            printf("\\u%04x", c);
        } else {
            putchar(c);
        }
        i++;
    }
    putchar('"');
}

static void put_json_float(double v) {
    if (!isfinite(v)) {
        fputs("null", stdout);
        return;
    }
    /* The shortest of 15, 16 or 17 significant digits that reads back as the same double. */
    char buf[40];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*g", prec, v);
        if (strtod(buf, NULL) == v) {
            break;
        }
    }
    fputs(buf, stdout);
    if (strspn(buf, "-0123456789") == strlen(buf)) {
        fputs(".0", stdout);
    }
}

static void put_field_value(const struct bd_field *f) {
    switch (f->kind) {
    case BD_VAL_FLOAT:
        fputs("{\"float\":", stdout);
        put_json_float(f->v.f);
        break;
    case BD_VAL_INT:
        printf("{\"int\":%" PRId64, f->v.i);
        break;
    case BD_VAL_UINT:
        printf("{\"uint\":%" PRIu64, f->v.u);
        break;
    case BD_VAL_BOOL:
        printf("{\"bool\":%s", f->v.b ? "true" : "false");
        break;
    case BD_VAL_STRING:
        fputs("{\"string\":", stdout);
        put_json_string(f->v.s.ptr, f->v.s.len);
        break;
    }
    putchar('}');
}

static void put_point(const struct bd_point *pt, int64_t time_ns) {
    fputs("{\"name\":", stdout);
    put_json_string(pt->name.ptr, pt->name.len);
    fputs(",\"tags\":[", stdout);
    for (uint32_t i = 0; i < pt->n_tags; i++) {
        fputs(i == 0 ? "{\"key\":" : ",{\"key\":", stdout);
        put_json_string(pt->tags[i].key.ptr, pt->tags[i].key.len);
        fputs(",\"value\":", stdout);
        put_json_string(pt->tags[i].value.ptr, pt->tags[i].value.len);
        putchar('}');
    }
    fputs("],\"fields\":[", stdout);
    for (uint32_t i = 0; i < pt->n_fields; i++) {
        fputs(i == 0 ? "{\"key\":" : ",{\"key\":", stdout);
        put_json_string(pt->fields[i].key.ptr, pt->fields[i].key.len);
        fputs(",\"value\":", stdout);
        put_field_value(&pt->fields[i]);
        putchar('}');
    }
    printf("],\"time\":%" PRId64 "}\n", time_ns);
}

static void put_error(const char *msg, uint64_t line) {
    fputs("{\"error\":", stdout);
    put_json_string(msg, strlen(msg));
    printf(",\"line\":%" PRIu64 "}\n", line);
}

/* ---------------------------------------------------------------------------------------- */
/* Input                                                                                    */

/*
 * stdin in one buffer of MAX_LINE + READ_CHUNK bytes: buf[start, end) is unread, and the entry
 * being parsed always begins at start, so an entry of up to MAX_LINE bytes plus its '\n' fits.
 */
struct reader {
    char *buf;
    size_t cap;
    size_t start;
    size_t end;
    bool eof;
    int err;
};

/* Moves the unread bytes to the front and reads more; false at end of input or on error. */
static bool reader_fill(struct reader *r) {
    if (r->eof) {
        return false;
    }
    if (r->start > 0) {
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    /* Whoever reads our output interactively sees each answer before we wait for more. */
    fflush(stdout);
    for (;;) {
        ssize_t got = read(STDIN_FILENO, r->buf + r->end, BD_MIN(READ_CHUNK, r->cap - r->end));
        if (got > 0) {
            r->end += (size_t)got;
            return true;
        }
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            r->err = errno;
        }
        r->eof = true;
        return false;
    }
}

enum line_end { LINE_NEWLINE, LINE_EOF, LINE_TOO_LONG, LINE_NONE };

/*
 * Finds the end of the line that starts at offset from (relative to r->start): sets *len to
 * the entry's length up to that line's end, without the '\n'.
 */
static enum line_end reader_line(struct reader *r, size_t from, size_t *len) {
    size_t scanned = from;
    for (;;) {
        size_t avail = r->end - r->start;
        const char *nl = memchr(r->buf + r->start + scanned, '\n', avail - scanned);
        if (nl != NULL) {
            *len = (size_t)(nl - (r->buf + r->start));
            return *len > MAX_LINE ? LINE_TOO_LONG : LINE_NEWLINE;
        }
        scanned = avail;
        if (avail > MAX_LINE) {
            return LINE_TOO_LONG;
        }
        if (!reader_fill(r)) {
            *len = r->end - r->start;
            if (*len == from && from == 0) {
                return LINE_NONE;
            }
            return LINE_EOF;
        }
    }
}

/* Drops input up to and including the next '\n'; returns false if input ended first. */
static bool reader_skip_line(struct reader *r) {
    for (;;) {
        const char *nl = memchr(r->buf + r->start, '\n', r->end - r->start);
        if (nl != NULL) {
            r->start = (size_t)(nl - r->buf) + 1;
            return true;
        }
        r->start = r->end;
        if (!reader_fill(r)) {
            return false;
        }
    }
}

static uint64_t count_newlines(const char *s, size_t n) {
    uint64_t c = 0;
    for (const char *p = s; (p = memchr(p, '\n', (size_t)(s + n - p))) != NULL; p++) {
        c++;
    }
    return c;
}

/* ---------------------------------------------------------------------------------------- */
/* Main                                                                                     */

struct options {
    enum bd_format format;
    enum bd_precision precision;
    bool has_default_time;
    int64_t default_time;
};

static int bad_usage(const char *fmt, const char *arg) {
    fputs("bucketd-parse: ", stderr);
    fprintf(stderr, fmt, arg);
    fputs("\nTry 'bucketd-parse --help'.\n", stderr);
    return 2;
}

/* 0, 1 to exit successfully at once (--help), or 2 for bad usage (already reported). */
static int parse_args(int argc, char **argv, struct options *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage, stdout);
            return 1;
        }
        const char *names[] = {"--format", "--precision", "--default-time"};
        size_t which = BD_ARRAY_LEN(names);
        const char *val = NULL;
        for (size_t k = 0; k < BD_ARRAY_LEN(names); k++) {
            size_t nl = strlen(names[k]);
            if (strncmp(a, names[k], nl) == 0 && (a[nl] == '\0' || a[nl] == '=')) {
                which = k;
                val = a[nl] == '=' ? a + nl + 1 : NULL;
            }
        }
        if (which == BD_ARRAY_LEN(names)) {
            return bad_usage("unknown option '%s'", a);
        }
        if (val == NULL) {
            if (i + 1 == argc) {
                return bad_usage("option '%s' needs a value", a);
            }
            val = argv[++i];
        }
        if (which == 0 && bd_format_parse(val, &o->format) != 0) {
            return bad_usage("--format: '%s' is not influx or graphite", val);
        }
        if (which == 1 && bd_precision_parse(val, &o->precision) != 0) {
            return bad_usage("--precision: '%s' is not ns, us, ms or s", val);
        }
        if (which == 2) {
            if (bd_units_parse_int(val, &o->default_time) != 0) {
                return bad_usage("--default-time: '%s' is not a time in nanoseconds", val);
            }
            o->has_default_time = true;
        }
    }
    return 0;
}

/* Rounds t down (towards the past) to a whole number of units. */
static int64_t truncate_time(int64_t t, int64_t unit) {
    int64_t r = t % unit;
    if (r < 0) {
        r += unit;
    }
    return t - r;
}

int main(int argc, char **argv) {
    struct options o = {BD_FORMAT_INFLUX, BD_PREC_NS, false, 0};
    int rc = parse_args(argc, argv, &o);
    if (rc != 0) {
        return rc == 1 ? 0 : rc;
    }
    int64_t unit = o.format == BD_FORMAT_GRAPHITE ? 1 : bd_parse_unit_ns(o.precision);

    struct bd_parser parser;
    struct bd_point *pt = malloc(sizeof(*pt));
    struct reader r = {.cap = MAX_LINE + READ_CHUNK + 1};
    r.buf = malloc(r.cap);
    if (pt == NULL || r.buf == NULL || bd_parser_init(&parser, o.format, o.precision, MAX_LINE)) {
        fputs("bucketd-parse: out of memory\n", stderr);
        free(pt);
        free(r.buf);
        return 1;
    }

    uint64_t lineno = 1;
    for (;;) {
        size_t len = 0;
        enum line_end e = reader_line(&r, 0, &len);
        if (e == LINE_NONE) {
            break;
        }
        if (e == LINE_TOO_LONG) {
            put_error("line too long", lineno);
            lineno++;
            if (!reader_skip_line(&r)) {
                break;
            }
            continue;
        }
        const char *entry = r.buf + r.start;
        const char *errmsg = NULL;
        bool too_long = false;
        rc = bd_parse_line(&parser, entry, len, pt, &errmsg);
        /* A string value still open at the end of the line goes on with the next line. */
        while (rc < 0 && errmsg == bd_parse_err_open_string && e == LINE_NEWLINE) {
            size_t more = 0;
            e = reader_line(&r, len + 1, &more);
            entry = r.buf + r.start; /* reading more may have moved the buffer's contents */
            if (e == LINE_TOO_LONG) {
                too_long = true;
                errmsg = "line too long";
                break;
            }
            len = more;
            rc = bd_parse_line(&parser, entry, len, pt, &errmsg);
        }
        if (rc < 0) {
            put_error(errmsg != NULL ? errmsg : "invalid line", lineno);
        } else if (rc == BD_PARSE_OK) {
            int64_t t = pt->time_ns;
            if (!pt->has_time) {
                t = truncate_time(o.has_default_time ? o.default_time : bd_now_ns(), unit);
            }
            put_point(pt, t);
        }
        lineno += 1 + count_newlines(entry, len);
        if (too_long) {
            /* Past the lines joined so far, then the one that made the entry too long. */
            r.start += len + 1;
            lineno++;
            if (!reader_skip_line(&r)) {
                break;
            }
            continue;
        }
        r.start += len;
        if (e != LINE_NEWLINE) {
            break;
        }
        r.start++; /* the '\n' */
    }

    fflush(stdout);
    bd_parser_close(&parser);
    free(pt);
    free(r.buf);
    if (r.err != 0) {
        fprintf(stderr, "bucketd-parse: reading stdin: %s\n", strerror(r.err));
        return 1;
    }
    if (ferror(stdout)) {
        fprintf(stderr, "bucketd-parse: writing stdout failed\n");
        return 1;
    }
    return 0;
}
