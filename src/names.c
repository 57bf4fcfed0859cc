/*
 * The reversible escape of field and tag names (names.h). Pure functions, any thread.
 *
 * Escaping is rare (names are checked once per sensor and name), so clarity wins over speed:
 * one pass to measure, one to write.
 */
#include "bucketd/names.h"

#include <bson/bson.h>
#include <errno.h>
#include <string.h>

#include "bucketd/common.h"

static bool is_reserved_field(const char *name, size_t len, enum bd_name_kind kind) {
    return kind == BD_NAME_FIELD && len == 2 && name[0] == 't' && name[1] == 's';
}

/* The escape sequence for byte i of name, or NULL if the byte is stored as it is. */
static const char *escape_of(const char *name, size_t len, size_t i, enum bd_name_kind kind) {
    switch (name[i]) {
    case '%':
        return "%25";
    case '.':
        return "%2E";
    case '$':
        return i == 0 ? "%24" : NULL;
    case 't':
        return i == 0 && is_reserved_field(name, len, kind) ? "%74" : NULL;
    default:
        return NULL;
    }
}

bool bd_name_valid(const char *name, size_t len) {
    return len > 0 && bson_utf8_validate(name, len, false);
}

size_t bd_name_escaped_len(const char *name, size_t len, enum bd_name_kind kind) {
    size_t n = len;
    for (size_t i = 0; i < len; i++) {
        if (escape_of(name, len, i, kind) != NULL) {
            n += 2;
        }
    }
    return n;
}

int bd_name_escape(const char *name, size_t len, enum bd_name_kind kind, char *out, size_t cap) {
    size_t n = bd_name_escaped_len(name, len, kind);
    if (n + 1 > cap) {
        return -ENAMETOOLONG;
    }
    char *p = out;
    for (size_t i = 0; i < len; i++) {
        const char *e = escape_of(name, len, i, kind);
        if (e != NULL) {
            memcpy(p, e, 3);
            p += 3;
        } else {
            *p++ = name[i];
        }
    }
    *p = '\0';
    return (int)n;
}

int bd_name_unescape(const char *key, size_t len, char *out, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; i < len; n++) {
        if (n + 1 >= cap) {
            return -ENAMETOOLONG;
        }
        char c = key[i];
        if (c == '%' && len - i >= 3) {
            int hi = bd_hex_value(key[i + 1]);
            int lo = bd_hex_value(key[i + 2]);
            int byte = hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
            /* Only what bd_name_escape writes: other sequences stay as they are. */
            if (byte == '%' || byte == '.' || byte == '$' || byte == 't') {
                out[n] = (char)byte;
                i += 3;
                continue;
            }
        }
        out[n] = c;
        i++;
    }
    if (n + 1 > cap) {
        return -ENAMETOOLONG;
    }
    out[n] = '\0';
    return (int)n;
}
