/*
 * Parser internals for tests and fuzzers (src/parse.c, src/parse_general.c, src/parse_simd.c).
 * bd_parse_line() takes a fast path for plain lines (see parse.c) and the general parser for
 * everything else; the fast path must give exactly the general parser's answer, and this is how
 * tests ask the general parser alone.
 */
#ifndef BUCKETD_PARSE_INT_H
#define BUCKETD_PARSE_INT_H

#include "bucketd/parse.h"

/* bd_parse_line() without the fast path for plain lines (src/parse_general.c). */
int bd_parse_line_general(struct bd_parser *p, const char *line, size_t len, struct bd_point *pt,
                          const char **errmsg);

/*
 * The classifier variant: "avx512", "avx2", "sse2", "swar" (portable) or "best"; -ENOTSUP
 * when this build or CPU has not got it. bd_parser_init picks the best (or BD_PARSE_ISA's).
 * In src/parse_simd.c.
 */
int bd_parser_set_isa(struct bd_parser *p, const char *isa);

/* A smaller window (1 to BD_PARSE_WINDOW_WORDS words of 64 bytes), to test its boundaries. */
void bd_parser_set_window(struct bd_parser *p, size_t words);

#endif
