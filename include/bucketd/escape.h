/*
 * Escaping of untrusted text (sensor ids, field and tag names, bucket ids, line contents,
 * server messages) for log lines and the tools' human-readable output. Stateless; any thread.
 *
 * Ordinary UTF-8 ("température", "東京") stays readable. Escaped, so that text from the network
 * can neither forge a log line nor move or hide what a reader sees:
 *   - C0 controls and DEL               -> \xNN
 *   - bytes that are not valid UTF-8    -> \xNN (each byte; overlong forms, surrogates and
 *                                          values above U+10FFFF included)
 *   - C1 controls U+0080..U+009F        -> \u0085, \u009b (CSI), ...
 *   - bidi controls and invisible formatting characters: U+00AD, U+061C, U+180E,
 *     U+200B..U+200F, U+2028, U+2029, U+202A..U+202E, U+2060..U+2064, U+2066..U+206F, U+FEFF,
 *     U+FFF9..U+FFFB                    -> \uXXXX
 *   - Unicode tag characters U+E0000..U+E007F -> \UXXXXXXXX
 *   - unless BD_ESC_KEEP_QUOTES: '"' and '\' -> \x22, \x5c (so that a quoted value cannot be
 *     closed early and an escape seen in the output was made by bucketd, not sent to it)
 */
#ifndef BUCKETD_ESCAPE_H
#define BUCKETD_ESCAPE_H

#include <stddef.h>

enum bd_escape_flags {
    /* Leave '"' and '\' as they are: for whole log lines, whose own text uses them. */
    BD_ESC_KEEP_QUOTES = 1 << 0,
};

/*
 * Escape len bytes of in into out (cap bytes, cap >= 1), always NUL-terminated. Stops before an
 * escape or a UTF-8 character that would not fit whole, so the output never ends inside one.
 * Returns how many bytes of in were consumed: less than len means the output was truncated.
 */
size_t bd_escape(char *out, size_t cap, const char *in, size_t len, unsigned flags);

/* bd_escape of a NUL-terminated string; returns out, for use as a printf argument. */
const char *bd_escape_str(char *out, size_t cap, const char *in);

/*
 * For JSON text (valid JSON in, the same JSON value out): the characters above that JSON
 * allows raw in a string (C1 controls, bidi and invisible formatting characters) become \uXXXX
 * escapes, so that JSON printed to a terminal is as safe as escaped text; everything else is
 * copied. Same contract as bd_escape for cap, truncation and the return value.
 */
size_t bd_escape_json(char *out, size_t cap, const char *in, size_t len);

/*
 * Untrusted text as the inside of a JSON string (the quotes are the caller's), always valid
 * JSON: '"' and '\\' escaped as JSON does, C0 controls and DEL as \u00NN, the characters above
 * kept from a terminal (C1, bidi, invisible) as \uNNNN; other UTF-8 unchanged, so the value
 * decodes to the text itself. A byte that is not UTF-8 becomes the text "\xNN" (its backslash
 * escaped), as the logs show it. Same contract as bd_escape for cap, truncation and the return
 * value; BD_ESCAPE_JSON_CAP(n) bytes always suffice.
 */
size_t bd_escape_json_string(char *out, size_t cap, const char *in, size_t len);
#define BD_ESCAPE_JSON_CAP(n) ((n)*6 + 1)

/* Room for the escape of n input bytes without truncation: "\xNN" is the worst case, 4 per
 * byte ("\u009b" is 3 per byte of its character, "\U000e0041" 2.5). */
#define BD_ESCAPE_CAP(n) ((n)*4 + 1)

#endif
