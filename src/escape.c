/*
 * Escaping of untrusted text for logs and tool output (see include/bucketd/escape.h for what is
 * escaped and how). Stateless; any thread; allocates nothing.
 */
#include "bucketd/escape.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "bucketd/common.h"

static const char hex[] = "0123456789abcdef";

/*
 * Characters that are valid UTF-8 but must not reach a terminal or a log viewer raw: C1
 * controls (U+009B is CSI, U+0085 a line break to some viewers), and the characters that
 * reorder text or are invisible, with which a crafted id can look like another one or hide a
 * part of the line.
 */
static bool invisible(uint32_t cp) {
    return (cp >= 0x80 && cp <= 0x9f) || cp == 0xad || cp == 0x61c || cp == 0x180e ||
           (cp >= 0x200b && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202e) ||
           (cp >= 0x2060 && cp <= 0x2064) || (cp >= 0x2066 && cp <= 0x206f) || cp == 0xfeff ||
           (cp >= 0xfff9 && cp <= 0xfffb) || (cp >= 0xe0000 && cp <= 0xe007f);
}

/*
 * Length of the valid UTF-8 character at p (at most n bytes available) and its code point;
 * 0 if the bytes there are not one (a stray continuation byte, a truncated sequence, an overlong
 * form, a surrogate, beyond U+10FFFF).
 */
static size_t utf8_char(const unsigned char *p, size_t n, uint32_t *cp) {
    size_t len;
    uint32_t min;
    uint32_t c = p[0];
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2, min = 0x80, c &= 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3, min = 0x800, c &= 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4, min = 0x10000, c &= 0x07;
    } else {
        return 0;
    }
    if (n < len) {
        return 0;
    }
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80) {
            return 0;
        }
        c = (c << 6) | (p[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) {
        return 0;
    }
    *cp = c;
    return len;
}

/* "\\xNN", "\\uNNNN" or "\\UNNNNNNNN" into e; returns its length. */
static size_t hex_escape(char *e, char kind, uint32_t v, int digits) {
    e[0] = '\\';
    e[1] = kind;
    for (int d = 0; d < digits; d++) {
        e[2 + d] = hex[(v >> (4 * (digits - 1 - d))) & 0xf];
    }
    return (size_t)digits + 2;
}

static bool plain(unsigned char ch, unsigned flags) {
    return ch >= 0x20 && ch < 0x7f && ((flags & BD_ESC_KEEP_QUOTES) || (ch != '"' && ch != '\\'));
}

size_t bd_escape(char *out, size_t cap, const char *in, size_t len, unsigned flags) {
    const unsigned char *p = (const unsigned char *)in;
    size_t i = 0, o = 0;
    if (cap == 0) {
        return 0;
    }
    while (i < len) {
        /* The common case: a run of printable ASCII, copied at once. */
        size_t run = 0;
        while (i + run < len && plain(p[i + run], flags)) {
            run++;
        }
        if (run > 0) {
            size_t n = BD_MIN(run, cap - 1 - o);
            memcpy(out + o, p + i, n);
            o += n;
            i += n;
            if (n < run) {
                break;
            }
            continue;
        }
        char esc[12];
        size_t used = 1, elen;
        const char *src = esc;
        uint32_t cp = 0;
        unsigned char ch = p[i];
        if (ch < 0x80) {
            elen = hex_escape(esc, 'x', ch, 2);
        } else if ((used = utf8_char(p + i, len - i, &cp)) == 0) {
            used = 1;
            elen = hex_escape(esc, 'x', ch, 2);
        } else if (invisible(cp)) {
            elen = cp > 0xffff ? hex_escape(esc, 'U', cp, 8) : hex_escape(esc, 'u', cp, 4);
        } else {
            src = (const char *)p + i;
            elen = used;
        }
        /* Whole or not at all, and room left for the NUL. */
        if (o + elen >= cap) {
            break;
        }
        memcpy(out + o, src, elen);
        o += elen;
        i += used;
    }
    out[o] = '\0';
    return i;
}

const char *bd_escape_str(char *out, size_t cap, const char *in) {
    bd_escape(out, cap, in, strlen(in), 0);
    return out;
}

size_t bd_escape_json(char *out, size_t cap, const char *in, size_t len) {
    const unsigned char *p = (const unsigned char *)in;
    size_t i = 0, o = 0;
    if (cap == 0) {
        return 0;
    }
    while (i < len) {
        char esc[16];
        size_t used = 1, elen = 1;
        const char *src = (const char *)p + i;
        uint32_t cp = 0;
        if (p[i] >= 0x80 && (used = utf8_char(p + i, len - i, &cp)) != 0 && invisible(cp)) {
            if (cp > 0xffff) {
                /* JSON spells a character beyond the BMP as a UTF-16 surrogate pair. */
                uint32_t v = cp - 0x10000;
                elen = (size_t)snprintf(esc, sizeof(esc), "\\u%04x\\u%04x",
                                        (unsigned)(0xd800 + (v >> 10)),
                                        (unsigned)(0xdc00 + (v & 0x3ff)));
            } else {
                elen = (size_t)snprintf(esc, sizeof(esc), "\\u%04x", (unsigned)cp);
            }
            src = esc;
        } else if (used == 0) {
            used = 1; /* not UTF-8: left for the JSON reader to refuse */
        } else {
            elen = used;
        }
        if (o + elen >= cap) {
            break;
        }
        memcpy(out + o, src, elen);
        o += elen;
        i += used;
    }
    out[o] = '\0';
    return i;
}

size_t bd_escape_json_string(char *out, size_t cap, const char *in, size_t len) {
    const unsigned char *p = (const unsigned char *)in;
    size_t i = 0, o = 0;
    if (cap == 0) {
        return 0;
    }
    while (i < len) {
        char esc[16];
        size_t used = 1, elen;
        const char *src = esc;
        uint32_t cp = 0;
        unsigned char ch = p[i];
        if (ch == '"' || ch == '\\') {
            esc[0] = '\\';
            esc[1] = (char)ch;
            elen = 2;
        } else if (ch < 0x20 || ch == 0x7f) {
            elen = hex_escape(esc, 'u', ch, 4);
        } else if (ch < 0x80) {
            src = (const char *)p + i;
            elen = 1;
        } else if ((used = utf8_char(p + i, len - i, &cp)) == 0) {
            /* Not UTF-8, which JSON cannot carry: the text the logs show, "\xNN". */
            used = 1;
            esc[0] = '\\';
            elen = 1 + hex_escape(esc + 1, 'x', ch, 2);
        } else if (invisible(cp)) {
            if (cp > 0xffff) {
                /* JSON spells a character beyond the BMP as a UTF-16 surrogate pair. */
                uint32_t v = cp - 0x10000;
                elen = hex_escape(esc, 'u', 0xd800 + (v >> 10), 4);
                elen += hex_escape(esc + elen, 'u', 0xdc00 + (v & 0x3ff), 4);
            } else {
                elen = hex_escape(esc, 'u', cp, 4);
            }
        } else {
            src = (const char *)p + i;
            elen = used;
        }
        if (o + elen >= cap) {
            break;
        }
        memcpy(out + o, src, elen);
        o += elen;
        i += used;
    }
    out[o] = '\0';
    return i;
}
