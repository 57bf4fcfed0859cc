/*
 * Parser internals for tests and fuzzers (src/parse.c). bd_parse_line() takes a fast path for
 * plain lines (see parse.c) and the general parser for everything else; the fast path must give
 * exactly the general parser's answer, and this is how tests ask the general parser alone.
 */
#ifndef BUCKETD_PARSE_INT_H
#define BUCKETD_PARSE_INT_H

#include "bucketd/parse.h"

/* bd_parse_line() without the fast path for plain lines. */
int bd_parse_line_general(struct bd_parser *p, const char *line, size_t len,
                          struct bd_point *pt, const char **errmsg);

#endif
