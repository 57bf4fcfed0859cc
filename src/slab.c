/*
 * The sensor table's slab of aligned blocks (include/bucketd/slab.h): size classes of whole
 * 128-byte units and one of 192 bytes (two carved from three units), carved from 64 KiB chunks,
 * freed blocks reused by their class. One thread (the
 * ingest thread, through the sensor table); it owns every chunk until bd_slab_close().
 */
#include "bucketd/slab.h"

#include <stdlib.h>
#include <string.h>

void bd_slab_init(struct bd_slab *sl) {
    memset(sl, 0, sizeof(*sl));
}

void *bd_slab_alloc(struct bd_slab *sl, size_t size) {
    size_t bytes = bd_slab_size(size);
    if (bytes > BD_SLAB_MAX) {
        void *p = NULL;
        return posix_memalign(&p, BD_SLAB_UNIT, bytes) == 0 ? p : NULL;
    }
    size_t cls = bytes / BD_SLAB_LINE;
    void *p = sl->free[cls];
    if (p != NULL) {
        memcpy(&sl->free[cls], p, sizeof(void *));
        return p;
    }
    /* The bump stays BD_SLAB_UNIT-aligned: a BD_SLAB_SMALL block is carved with its twin, which
     * waits on the free list (at 64 mod 128). */
    size_t carve = bytes == BD_SLAB_SMALL ? 2 * BD_SLAB_SMALL : bytes;
    _Static_assert(2 * BD_SLAB_SMALL % BD_SLAB_UNIT == 0, "two small blocks are whole units");
    if (sl->bump_left < carve) {
        /* The rest of the chunk stays unused: at most BD_SLAB_MAX bytes of 64 KiB. */
        unsigned char *chunk = aligned_alloc(BD_SLAB_UNIT, BD_SLAB_CHUNK);
        if (chunk == NULL) {
            return NULL;
        }
        memcpy(chunk, &sl->chunks, sizeof(void *));
        sl->chunks = chunk;
        sl->bump = chunk + BD_SLAB_UNIT;
        sl->bump_left = BD_SLAB_CHUNK - BD_SLAB_UNIT;
        sl->chunk_bytes += BD_SLAB_CHUNK;
    }
    p = sl->bump;
    sl->bump += carve;
    sl->bump_left -= carve;
    if (carve != bytes) {
        unsigned char *twin = (unsigned char *)p + bytes;
        memcpy(twin, &sl->free[cls], sizeof(void *));
        sl->free[cls] = twin;
    }
    return p;
}

void bd_slab_free(struct bd_slab *sl, void *p, size_t size) {
    if (p == NULL) {
        return;
    }
    size_t bytes = bd_slab_size(size);
    if (bytes > BD_SLAB_MAX) {
        free(p);
        return;
    }
    size_t cls = bytes / BD_SLAB_LINE;
    memcpy(p, &sl->free[cls], sizeof(void *));
    sl->free[cls] = p;
}

void bd_slab_close(struct bd_slab *sl) {
    unsigned char *c = sl->chunks;
    while (c != NULL) {
        unsigned char *next;
        memcpy(&next, c, sizeof(next));
        free(c);
        c = next;
    }
    memset(sl, 0, sizeof(*sl));
}
