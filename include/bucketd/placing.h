/*
 * The placing journal: the placed form of the unplaced spool record being replayed, kept beside
 * the spool (<spool.dir>/placing.rec) from before its first send until the next placement, so
 * that a crash between numbering an unplaced record and acknowledging it never writes one
 * reading under two sequence numbers: the next start finds the journal naming the record at the
 * head of the spool and replays the journal's updates, with the number they were given, instead
 * of placing the record again. Life cycle and crash points: src/flusher_place.c.
 *
 * File, replaced whole (temp file, fsync, rename, directory fsync; integers little-endian):
 *   0  "BDPLACE1" magic   8  u32 version (1)   12  u32 header size (56)
 *   16 u64 segment and   24 u64 offset of the unplaced record (spool.h's record position)
 *   32 u64 seq           40 u32 n_readings     44  u32 payload length
 *   48 u32 CRC-32C of bytes 0-47 and the payload    52  u32 reserved (0)
 *   56 payload: the placed updates (replay.h's layout)
 * A file that is short, torn or fails its check is as good as none: the record it would name
 * is then placed again, which is safe only because the journal is durable before the first send
 * of what it holds (nothing of a journal that does not survive can have been sent).
 *
 * Flusher thread only.
 */
#ifndef BUCKETD_PLACING_H
#define BUCKETD_PLACING_H

#include <stddef.h>
#include <stdint.h>

#include "bucketd/common.h"

#define BD_PLACING_FILE "placing.rec"
#define BD_PLACING_HEADER_BYTES 56

struct bd_placing {
    uint64_t segment, offset; /* the unplaced record it is the placed form of */
    uint64_t seq;
    uint32_t n_readings;
    uint8_t *data; /* owned (bd_placing_clear) */
    size_t len;
};

/* Save p in dir, durable when 0 is returned; the negative errno with err saying why. */
int bd_placing_save(const char *dir, const struct bd_placing *p, struct bd_err *err);

/* Read dir's journal into *p. 0; -ENOENT when there is none; -EBADMSG when it is short, torn or
 * fails its check (err says which); -ENOMEM; another negative errno when it cannot be read. */
int bd_placing_load(const char *dir, struct bd_placing *p, struct bd_err *err);

/* Remove dir's journal (and a temp file left by a crash). 0 or the negative errno. */
int bd_placing_remove(const char *dir);

void bd_placing_clear(struct bd_placing *p);

#endif
