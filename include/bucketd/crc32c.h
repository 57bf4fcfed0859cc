/*
 * CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of iSCSI, ext4 metadata
 * and most write-ahead logs: it detects every burst error up to 32 bits and, unlike CRC-32 (zlib),
 * has a hardware instruction on x86 and ARMv8 should the software version ever be too slow.
 *
 * Software slicing-by-8: eight 1 KiB tables, built once (thread-safe) on first use, one table
 * look-up per input byte and eight bytes per step. Any thread.
 */
#ifndef BUCKETD_CRC32C_H
#define BUCKETD_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/*
 * CRC-32C of data, continuing from crc: pass 0 to start, and the result of the previous call to
 * carry on, so that bd_crc32c(bd_crc32c(0, a, na), b, nb) is the CRC of a followed by b.
 * bd_crc32c(0, "123456789", 9) == 0xE3069283.
 */
uint32_t bd_crc32c(uint32_t crc, const void *data, size_t len);

#endif
