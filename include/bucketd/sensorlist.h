/*
 * GET /sensors on the metrics listener: the query it takes, the cursor it pages with and the
 * JSON it answers, as pure functions (the metrics module serves them with the sensor table's
 * bd_sensor_table_list on the ingest thread's loop).
 *
 * Query: silent=DURATION (as in the configuration: "90s", "15m"; only sensors whose last
 * reading is older), limit=N (1..BD_SENSORLIST_LIMIT_MAX, default BD_SENSORLIST_LIMIT_DEFAULT),
 * after=CURSOR (the "next" of the previous page). Anything else is refused with a reason.
 *
 * Order and cursor: sensors sorted by last_seen, oldest first, ties by creation order; the
 * cursor is the last listed sensor's place in that order ("<last_ns>-<serial>"), so a page
 * continues after it whatever was created or evicted meanwhile: a sensor is never skipped, a
 * new one comes at the end, and one that sent a reading between two pages moves to the end
 * (and may be listed again there).
 *
 * Stateless; any thread.
 */
#ifndef BUCKETD_SENSORLIST_H
#define BUCKETD_SENSORLIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bucketd/http.h"
#include "bucketd/sensor.h"

#define BD_SENSORLIST_LIMIT_DEFAULT 100
#define BD_SENSORLIST_LIMIT_MAX 1000
/* A page ends early once its body passes this size (long ids; a page of 1000 ids of 40 bytes
 * is about 100 KiB), so that the 32 connections of the server hold at most a few MiB of
 * responses; "next" continues it. */
#define BD_SENSORLIST_BODY_MAX (256 * 1024)

struct bd_sensorlist_query {
    bool silent; /* silent= given */
    uint64_t silent_ms;
    uint32_t limit;
    bool after; /* after= given */
    struct bd_sensor_pos after_pos;
};

/*
 * Parse the query string q[0..len) (without the '?'; percent-encoding decoded). 0, or -EINVAL
 * with why (cap bytes, NUL-terminated; any text of the request in it escaped) saying what is
 * wrong.
 */
int bd_sensorlist_parse_query(const char *q, size_t len, struct bd_sensorlist_query *out, char *why,
                              size_t cap);

/* The cursor text of pos (BD_SENSORLIST_CURSOR_CAP bytes suffice); and back: 0 or -EINVAL. */
#define BD_SENSORLIST_CURSOR_CAP 48
void bd_sensorlist_cursor_format(const struct bd_sensor_pos *pos, char *buf, size_t cap);
int bd_sensorlist_cursor_parse(const char *s, size_t len, struct bd_sensor_pos *out);

/* ns since the epoch as RFC 3339 in UTC with milliseconds: "2026-11-29T03:08:24.123Z"
 * (BD_SENSORLIST_TIME_CAP bytes suffice). */
#define BD_SENSORLIST_TIME_CAP 40
void bd_sensorlist_format_time(int64_t ns, char *buf, size_t cap);

/*
 * The 200 answer for the page v[0..n) (more: sensors follow it): {"sensors":[{"sensor_id",
 * "last_seen", "readings_accepted"}...], "next": cursor or null}. Ids are escaped for JSON and
 * terminals (bd_escape_json_string). Stops early past BD_SENSORLIST_BODY_MAX.
 */
void bd_sensorlist_render(const struct bd_sensor_info *v, uint32_t n, bool more,
                          struct bd_http_response *out);

/* The 400 answer: {"error": why}. */
void bd_sensorlist_render_error(const char *why, struct bd_http_response *out);

#endif
