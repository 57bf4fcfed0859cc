/*
 * CRC-32C (src/crc32c.c): published check values (the "123456789" check of the CRC catalogue and
 * the iSCSI test patterns of RFC 3720 B.4), chaining, and the sliced loop against a bit-at-a-time
 * reference at every length and alignment around the 8-byte steps.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/crc32c.h"

/* The definition itself: one bit at a time, no tables. */
static uint32_t crc_reference(const uint8_t *p, size_t len) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < len; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
    }
    return ~c;
}

Test(crc32c, check_value) {
    cr_assert_eq(bd_crc32c(0, "123456789", 9), 0xE3069283u);
    cr_assert_eq(bd_crc32c(0, "", 0), 0u);
    cr_assert_eq(bd_crc32c(0, "a", 1), 0xC1D04330u);
}

Test(crc32c, rfc3720_patterns) {
    uint8_t buf[32];
    memset(buf, 0, sizeof(buf));
    cr_assert_eq(bd_crc32c(0, buf, sizeof(buf)), 0x8A9136AAu);
    memset(buf, 0xFF, sizeof(buf));
    cr_assert_eq(bd_crc32c(0, buf, sizeof(buf)), 0x62A8AB43u);
    for (int i = 0; i < 32; i++) {
        buf[i] = (uint8_t)i;
    }
    cr_assert_eq(bd_crc32c(0, buf, sizeof(buf)), 0x46DD794Eu);
    for (int i = 0; i < 32; i++) {
        buf[i] = (uint8_t)(31 - i);
    }
    cr_assert_eq(bd_crc32c(0, buf, sizeof(buf)), 0x113FDB5Cu);
}

Test(crc32c, chains_and_matches_the_reference_at_every_length_and_alignment) {
    uint8_t buf[300];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof(buf); i++) {
        x = x * 1103515245u + 12345u;
        buf[i] = (uint8_t)(x >> 16);
    }
    for (size_t start = 0; start < 9; start++) {
        for (size_t len = 0; start + len <= 100; len++) {
            cr_assert_eq(bd_crc32c(0, buf + start, len), crc_reference(buf + start, len),
                         "start %zu len %zu", start, len);
        }
    }
    uint32_t whole = bd_crc32c(0, buf, sizeof(buf));
    cr_assert_eq(whole, crc_reference(buf, sizeof(buf)));
    for (size_t cut = 0; cut <= sizeof(buf); cut += 7) {
        cr_assert_eq(bd_crc32c(bd_crc32c(0, buf, cut), buf + cut, sizeof(buf) - cut), whole,
                     "cut at %zu", cut);
    }
}
