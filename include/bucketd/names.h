/*
 * Field and tag names as BSON keys: a reversible escape for the names MongoDB cannot address.
 *
 * A field name becomes a key of every reading and of summary.<name>, a tag key a key of
 * meta.tags. MongoDB stores any key, but a key containing '.' cannot be reached by a dotted
 * path ("summary.cpu.user.min" is three levels deep), and one starting with '$' is read as an
 * operator or a field path in updates and pipelines. Inside a reading, the key "ts" is the
 * reading's timestamp. Rather than drop such a line, bucketd stores the name escaped,
 * percent-style (RFC 3986 notation, uppercase hex):
 *
 *   '%'              -> "%25"   anywhere: the escape character itself, so the escape reverses
 *   '.'              -> "%2E"   anywhere
 *   '$' (first byte) -> "%24"   a '$' elsewhere is harmless and stays
 *   "ts" (a field's whole name, not a tag key's) -> "%74s"
 *
 * Every other name is stored exactly as it arrives. The escape is injective, so unescaping the
 * stored key gives back the name that was sent. Names must be valid UTF-8 without NUL and not
 * empty (bd_name_valid): those are counted drops, since no escape makes them a key.
 *
 * Pure functions of their arguments, no allocation: any thread. The sensor table escapes a
 * name once, when a sensor first uses it, never per reading.
 */
#ifndef BUCKETD_NAMES_H
#define BUCKETD_NAMES_H

#include <stdbool.h>
#include <stddef.h>

enum bd_name_kind {
    BD_NAME_TAG,   /* a tag key: meta.tags.<key> */
    BD_NAME_FIELD, /* a field name: readings[].<name>, summary.<name>; "ts" is reserved */
};

/* Whether a name can be stored at all: not empty, valid UTF-8, no NUL. */
bool bd_name_valid(const char *name, size_t len);

/* Bytes of the escaped form of name (without a NUL); equal to len exactly when the name is
 * stored as it is. */
size_t bd_name_escaped_len(const char *name, size_t len, enum bd_name_kind kind);

/*
 * Writes the escaped form of name and a NUL to out. Returns its length (without the NUL), or
 * -ENAMETOOLONG if out (cap bytes) cannot hold it (bd_name_escaped_len() + 1 always suffice).
 */
int bd_name_escape(const char *name, size_t len, enum bd_name_kind kind, char *out, size_t cap);

/*
 * Writes the name a stored key stands for, and a NUL, to out: "%25", "%2E", "%24" and "%74"
 * (hex digits of either case) are decoded wherever they appear, every other byte is copied.
 * bd_name_unescape(bd_name_escape(x)) == x for every name x. The result is never longer than
 * the key. Returns its length, or -ENAMETOOLONG if out (cap bytes) cannot hold it (len + 1
 * always suffice).
 */
int bd_name_unescape(const char *key, size_t len, char *out, size_t cap);

#endif
