/*
 * CRC-32C in software, slicing-by-8 (see include/bucketd/crc32c.h). The tables are built on the
 * first call under pthread_once, so any thread may call it; afterwards they are read-only.
 *
 * Slicing-by-8: table[0] is the classic byte-at-a-time table; table[k][b] is the CRC of byte b
 * followed by k zero bytes, so eight input bytes can be folded in with eight independent look-ups
 * XORed together instead of eight dependent ones. About 1 byte per cycle, which is plenty for
 * records that are written to disk anyway.
 */
#include "bucketd/crc32c.h"

#include <pthread.h>
#include <string.h>

#define POLY UINT32_C(0x82F63B78)

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        }
        table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = table[0][b];
        for (int t = 1; t < 8; t++) {
            c = table[0][c & 0xff] ^ (c >> 8);
            table[t][b] = c;
        }
    }
}

/* Little-endian load whatever the host order, so a checksum means the same on every machine. */
static uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint32_t bd_crc32c(uint32_t crc, const void *data, size_t len) {
    const uint8_t *p = data;
    pthread_once(&table_once, build_tables);
    crc = ~crc;
    while (len >= 8) {
        uint32_t lo = load_le32(p) ^ crc;
        uint32_t hi = load_le32(p + 4);
        crc = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^
              table[4][lo >> 24] ^ table[3][hi & 0xff] ^ table[2][(hi >> 8) & 0xff] ^
              table[1][(hi >> 16) & 0xff] ^ table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len > 0) {
        crc = table[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
        p++;
        len--;
    }
    return ~crc;
}
