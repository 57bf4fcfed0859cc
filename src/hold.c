/*
 * Lines held while the wall clock cannot be trusted (include/bucketd/hold.h): a FIFO of entries
 * in one growing buffer (header and text back to back), consumed from its head; the consumed
 * part is reclaimed when it passes half of the buffer; and the records of the held-lines spool
 * its entries are written to and read back from. Ingest thread only.
 */
#include "bucketd/hold.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bucketd/alloc.h"

#define ENTRY_HDR 16 /* u32 length, u8 format, u8 precision, u8 kind, u8 0, i64 stamp */
#define RECORD_MAGIC "BDHELD02"

struct bd_hold {
    uint8_t *buf;
    size_t head, len, cap; /* entries in [head, len) */
    size_t max_bytes;
    uint64_t n;
};

int bd_hold_new(struct bd_hold **out, size_t max_bytes) {
    struct bd_hold *h = bd_calloc(1, sizeof(*h));
    if (h == NULL) {
        return -ENOMEM;
    }
    h->max_bytes = max_bytes;
    *out = h;
    return 0;
}

void bd_hold_free(struct bd_hold *h) {
    if (h != NULL) {
        free(h->buf);
        free(h);
    }
}

void bd_hold_set_max_bytes(struct bd_hold *h, size_t max_bytes) {
    h->max_bytes = max_bytes;
}

uint64_t bd_hold_count(const struct bd_hold *h) {
    return h->n;
}

size_t bd_hold_bytes(const struct bd_hold *h) {
    return h->len - h->head;
}

int bd_hold_add(struct bd_hold *h, const struct bd_hold_line *l) {
    size_t need = ENTRY_HDR + l->len;
    if (l->len > UINT32_MAX || bd_hold_bytes(h) + need > h->max_bytes) {
        return -ENOSPC;
    }
    if (h->head > 0 && h->head >= h->len / 2) {
        memmove(h->buf, h->buf + h->head, h->len - h->head);
        h->len -= h->head;
        h->head = 0;
    }
    if (h->len + need > h->cap) {
        size_t cap = h->cap ? h->cap : 64 * 1024;
        while (cap < h->len + need) {
            cap *= 2;
        }
        uint8_t *buf = bd_realloc(h->buf, cap);
        if (buf == NULL) {
            return -ENOMEM;
        }
        h->buf = buf;
        h->cap = cap;
    }
    uint8_t *p = h->buf + h->len;
    bd_put_le32(p, (uint32_t)l->len);
    p[4] = l->format;
    p[5] = l->precision;
    p[6] = l->kind;
    p[7] = 0;
    bd_put_le64(p + 8, (uint64_t)l->stamp_ns);
    memcpy(p + ENTRY_HDR, l->line, l->len);
    h->len += need;
    h->n++;
    return 0;
}

int bd_hold_peek(const struct bd_hold *h, struct bd_hold_line *out) {
    if (h->n == 0) {
        return -ENOENT;
    }
    const uint8_t *p = h->buf + h->head;
    *out = (struct bd_hold_line){.format = p[4],
                                 .precision = p[5],
                                 .kind = p[6],
                                 .stamp_ns = (int64_t)bd_get_le64(p + 8),
                                 .line = (const char *)p + ENTRY_HDR,
                                 .len = bd_get_le32(p)};
    return 0;
}

void bd_hold_pop(struct bd_hold *h) {
    if (h->n == 0) {
        return;
    }
    h->head += ENTRY_HDR + bd_get_le32(h->buf + h->head);
    h->n--;
    if (h->n == 0) {
        h->head = h->len = 0;
    }
}

void bd_hold_boot_id(char id[40]) {
    memset(id, 0, 40);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL) {
        return;
    }
    if (fgets(id, 40, f) == NULL) {
        id[0] = '\0';
    }
    fclose(f);
    id[strcspn(id, "\n")] = '\0';
}

void bd_hold_clear(struct bd_hold *h) {
    h->head = h->len = 0;
    h->n = 0;
}

int bd_hold_record(const struct bd_hold *h, const char *boot_id, int64_t wall_ns, int64_t boot_ns,
                   uint8_t **out, size_t *out_len) {
    size_t body = bd_hold_bytes(h);
    uint8_t *buf = bd_malloc(BD_HOLD_RECORD_HEADER + body);
    if (buf == NULL) {
        return -ENOMEM;
    }
    memset(buf, 0, BD_HOLD_RECORD_HEADER);
    memcpy(buf, RECORD_MAGIC, 8);
    snprintf((char *)buf + 8, 40, "%s", boot_id);
    bd_put_le64(buf + 48, (uint64_t)wall_ns);
    bd_put_le64(buf + 56, (uint64_t)boot_ns);
    memcpy(buf + BD_HOLD_RECORD_HEADER, h->buf + h->head, body);
    *out = buf;
    *out_len = BD_HOLD_RECORD_HEADER + body;
    return 0;
}

int bd_hold_take(struct bd_hold *h, const uint8_t *rec, size_t len, const char *boot_id,
                 uint64_t *n_lines, uint64_t *n_dropped) {
    *n_lines = *n_dropped = 0;
    if (len < BD_HOLD_RECORD_HEADER || memcmp(rec, RECORD_MAGIC, 8) != 0) {
        return -EBADMSG;
    }
    /* Check every entry before taking any, so a bad record takes nothing. */
    for (size_t at = BD_HOLD_RECORD_HEADER; at < len;) {
        if (len - at < ENTRY_HDR || bd_get_le32(rec + at) > len - at - ENTRY_HDR) {
            return -EBADMSG;
        }
        at += ENTRY_HDR + bd_get_le32(rec + at);
    }
    char saved_id[41] = {0};
    memcpy(saved_id, rec + 8, 40);
    bool same_boot = saved_id[0] != '\0' && strcmp(saved_id, boot_id) == 0;
    int64_t saved_wall = (int64_t)bd_get_le64(rec + 48);
    int64_t saved_boot = (int64_t)bd_get_le64(rec + 56);
    for (size_t at = BD_HOLD_RECORD_HEADER; at < len;) {
        const uint8_t *p = rec + at;
        struct bd_hold_line l = {.format = p[4],
                                 .precision = p[5],
                                 .kind = p[6],
                                 .stamp_ns = (int64_t)bd_get_le64(p + 8),
                                 .line = (const char *)p + ENTRY_HDR,
                                 .len = bd_get_le32(p)};
        if (!same_boot && l.kind == BD_HOLD_BOOT) {
            /* Another boot: its boot-time stamp means nothing now; the wall time it arrived
             * at, by the untrusted clock of the append, is the best there is. */
            l.kind = BD_HOLD_WALL;
            l.stamp_ns = saved_wall - (saved_boot - l.stamp_ns);
        }
        /* A line the hold cannot take (full, out of memory) is dropped, counted by the caller. */
        if (bd_hold_add(h, &l) == 0) {
            (*n_lines)++;
        } else {
            (*n_dropped)++;
        }
        at += ENTRY_HDR + l.len;
    }
    return 0;
}
