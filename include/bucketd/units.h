/*
 * Strict parsers for the numbers a configuration and the tools' options are written in: whole
 * numbers, durations ("1500ms", "1s", "5m", "1h"), sizes ("64KiB", "8MiB", "1GiB") and numeric
 * "host:port" addresses, and the way back from a duration or size to text that parses to the
 * same value. Never atoi: no sign, no spaces, no empty text, no overflow, no guessed unit
 * (decimal "KB" is refused: which multiplier it means is a guess).
 *
 * A leaf (src/units.c): stateless, any thread, calls nothing of bucketd's; the config schema
 * (src/config_schema.c), the metrics listener and the tools use it.
 */
#ifndef BUCKETD_UNITS_H
#define BUCKETD_UNITS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#define BD_MS_PER_S UINT64_C(1000)
#define BD_MS_PER_M (60 * BD_MS_PER_S)
#define BD_MS_PER_H (60 * BD_MS_PER_M)
#define BD_MS_PER_DAY (24 * BD_MS_PER_H)
#define BD_KIB UINT64_C(1024)
#define BD_MIB (1024 * BD_KIB)
#define BD_GIB (1024 * BD_MIB)

/* Decimal digits and nothing else: 0, -EINVAL (not such a number) or -ERANGE (over 64 bits). */
int bd_units_parse_uint(const char *s, uint64_t *out);
/* The same with an optional leading '-': 0, -EINVAL or -ERANGE (outside int64_t). */
int bd_units_parse_int(const char *s, int64_t *out);

/*
 * Strict unit parsers, shared with the tools: "1500ms", "1s", "5m", "1h" (a bare number only
 * when 0); "64KiB", "8MiB", bytes as a bare number. 0, -EINVAL or -ERANGE (too large).
 */
int bd_parse_duration_ms(const char *s, uint64_t *out_ms);
int bd_parse_size(const char *s, uint64_t *out_bytes);

/* The largest unit that divides the value exactly ("90s", "1h", "64KiB"; "1500ms", "100"). */
void bd_units_format_duration_ms(uint64_t ms, char *buf, size_t len);
void bd_units_format_size(uint64_t bytes, char *buf, size_t len);

/*
 * "1.2.3.4:80", "[::1]:80", "[fe80::1%eth0]:80", "0.0.0.0:8089" -> sockaddr (numeric only: a
 * name here would make start-up depend on DNS). -EINVAL, and *why says what is wrong.
 */
int bd_units_parse_hostport(const char *s, struct sockaddr_storage *out, const char **why);
/* The same without the reason; s may be NULL (-EINVAL). */
int bd_parse_hostport(const char *s, struct sockaddr_storage *out);

#endif
