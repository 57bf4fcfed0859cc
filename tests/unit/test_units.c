/*
 * Unit tests for src/units.c: the strict number, duration, size and address parsers that the
 * config schema and the tools read with, and durations and sizes back to text.
 */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <string.h>

#include "bucketd/units.h"

static uint16_t port_of(const struct sockaddr_storage *ss) {
    if (ss->ss_family == AF_INET6) {
        return ntohs(((const struct sockaddr_in6 *)ss)->sin6_port);
    }
    return ntohs(((const struct sockaddr_in *)ss)->sin_port);
}

Test(units, duration_parser) {
    static const struct {
        const char *text;
        uint64_t ms;
    } good[] = {{"1s", 1000},
                {"1500ms", 1500},
                {"5m", 300000},
                {"1h", 3600000},
                {"0", 0},
                {"0ms", 0},
                {"0h", 0},
                {"007s", 7000},
                {"24h", 86400000},
                {"1ms", 1},
                {"5124095576030h", UINT64_C(18446744073708000000)}};
    static const struct {
        const char *text;
        int rc;
    } bad[] = {{"1x", -EINVAL},
               {"-1s", -EINVAL},
               {"", -EINVAL},
               {"1", -EINVAL},
               {" 1s", -EINVAL},
               {"1s ", -EINVAL},
               {"+1s", -EINVAL},
               {"1.5s", -EINVAL},
               {"s", -EINVAL},
               {"1S", -EINVAL},
               {"1 s", -EINVAL},
               {"1h30m", -EINVAL},
               {"0x10s", -EINVAL},
               {"1sec", -EINVAL},
               {"1us", -EINVAL},
               {"18446744073709551616ms", -ERANGE},
               {"99999999999999999999", -ERANGE},
               {"5124095576031h", -ERANGE},
               {"18446744073709552s", -ERANGE}};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        uint64_t ms = 42;
        cr_assert_eq(bd_parse_duration_ms(good[i].text, &ms), 0, "\"%s\"", good[i].text);
        cr_assert_eq(ms, good[i].ms, "\"%s\" gave %lu", good[i].text, (unsigned long)ms);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t ms = 42;
        cr_assert_eq(bd_parse_duration_ms(bad[i].text, &ms), bad[i].rc, "\"%s\"", bad[i].text);
        cr_assert_eq(ms, 42, "\"%s\" wrote its output on failure", bad[i].text);
    }
    uint64_t ms = 0;
    cr_assert_eq(bd_parse_duration_ms(NULL, &ms), -EINVAL);
}

Test(units, size_parser) {
    static const struct {
        const char *text;
        uint64_t bytes;
    } good[] = {{"64KiB", 65536},
                {"8MiB", 8u << 20},
                {"1GiB", 1u << 30},
                {"12", 12},
                {"12B", 12},
                {"0", 0},
                {"4096", 4096},
                {"1024GiB", 1ull << 40},
                {"17179869183GiB", 17179869183ull << 30}};
    static const struct {
        const char *text;
        int rc;
    } bad[] = {{"1kb", -EINVAL},
               {"1KB", -EINVAL},
               {"1k", -EINVAL},
               {"1 KiB", -EINVAL},
               {"-1", -EINVAL},
               {"", -EINVAL},
               {"1KiBx", -EINVAL},
               {"KiB", -EINVAL},
               {"1.5MiB", -EINVAL},
               {"1mib", -EINVAL},
               {"1TiB", -EINVAL},
               {" 12", -EINVAL},
               {"17179869184GiB", -ERANGE},
               {"99999999999999999999", -ERANGE}};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        uint64_t n = 42;
        cr_assert_eq(bd_parse_size(good[i].text, &n), 0, "\"%s\"", good[i].text);
        cr_assert_eq(n, good[i].bytes, "\"%s\" gave %lu", good[i].text, (unsigned long)n);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t n = 42;
        cr_assert_eq(bd_parse_size(bad[i].text, &n), bad[i].rc, "\"%s\"", bad[i].text);
        cr_assert_eq(n, 42, "\"%s\" wrote its output on failure", bad[i].text);
    }
}

Test(units, hostport_parser) {
    struct sockaddr_storage ss;
    char text[INET6_ADDRSTRLEN];

    cr_assert_eq(bd_parse_hostport("0.0.0.0:8089", &ss), 0);
    cr_assert_eq(ss.ss_family, AF_INET);
    cr_assert_eq(port_of(&ss), 8089);
    cr_assert_eq(bd_parse_hostport("1.2.3.4:80", &ss), 0);
    inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, text, sizeof(text));
    cr_assert_str_eq(text, "1.2.3.4");
    cr_assert_eq(bd_parse_hostport("[::1]:80", &ss), 0);
    cr_assert_eq(ss.ss_family, AF_INET6);
    cr_assert_eq(port_of(&ss), 80);
    inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, text, sizeof(text));
    cr_assert_str_eq(text, "::1");
    cr_assert_eq(bd_parse_hostport("[::]:8089", &ss), 0);
    cr_assert_eq(bd_parse_hostport("[2001:db8::17]:65535", &ss), 0);
    cr_assert_eq(port_of(&ss), 65535);
    cr_assert_eq(bd_parse_hostport("127.0.0.1:0", &ss), 0);

    static const char *const bad[] = {"localhost:80",
                                      "1.2.3:80",
                                      "10.1:80",
                                      "0x7f.0.0.1:80",
                                      "::1:80",
                                      "[::1]80",
                                      "[::1]",
                                      "1.2.3.4",
                                      "1.2.3.4:65536",
                                      "1.2.3.4:-1",
                                      "1.2.3.4:",
                                      ":80",
                                      "1.2.3.4:80x",
                                      "[1.2.3.4]:80",
                                      "[::1:80",
                                      "",
                                      "1.2.3.4: 80",
                                      " 1.2.3.4:80",
                                      "[]:80",
                                      "1.2.3.4:+80",
                                      "[::1]:99999999999999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(bd_parse_hostport(bad[i], &ss), -EINVAL, "\"%s\"", bad[i]);
    }
    cr_assert_eq(bd_parse_hostport(NULL, &ss), -EINVAL);
}

/* Text from the formatters reads back to the same value, in the largest unit that is exact. */
Test(units, durations_and_sizes_back_to_text) {
    static const struct {
        uint64_t ms;
        const char *text;
    } durations[] = {{0, "0"},        {1, "1ms"},        {1500, "1500ms"},
                     {1000, "1s"},    {90000, "90s"},    {300000, "5m"},
                     {3600000, "1h"}, {86400000, "24h"}, {3661000, "3661s"}};
    static const struct {
        uint64_t bytes;
        const char *text;
    } sizes[] = {{0, "0"},       {100, "100"},       {4096, "4KiB"},     {65536, "64KiB"},
                 {1536, "1536"}, {8u << 20, "8MiB"}, {1u << 30, "1GiB"}, {1ull << 40, "1024GiB"}};
    char buf[32];
    for (size_t i = 0; i < sizeof(durations) / sizeof(durations[0]); i++) {
        bd_units_format_duration_ms(durations[i].ms, buf, sizeof(buf));
        cr_assert_str_eq(buf, durations[i].text);
        uint64_t back = 42;
        cr_assert_eq(bd_parse_duration_ms(buf, &back), 0, "\"%s\"", buf);
        cr_assert_eq(back, durations[i].ms, "\"%s\"", buf);
    }
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        bd_units_format_size(sizes[i].bytes, buf, sizeof(buf));
        cr_assert_str_eq(buf, sizes[i].text);
        uint64_t back = 42;
        cr_assert_eq(bd_parse_size(buf, &back), 0, "\"%s\"", buf);
        cr_assert_eq(back, sizes[i].bytes, "\"%s\"", buf);
    }
}

/* Whole numbers: digits only (a leading '-' for a signed one); the reason a host:port is refused. */
Test(units, whole_numbers_and_hostport_reasons) {
    uint64_t n = 42;
    cr_assert_eq(bd_units_parse_uint("0", &n), 0);
    cr_assert_eq(n, 0);
    cr_assert_eq(bd_units_parse_uint("18446744073709551615", &n), 0);
    cr_assert_eq(n, UINT64_MAX);
    n = 42;
    cr_assert_eq(bd_units_parse_uint("18446744073709551616", &n), -ERANGE);
    cr_assert_eq(bd_units_parse_uint("1k", &n), -EINVAL);
    cr_assert_eq(bd_units_parse_uint("-1", &n), -EINVAL);
    cr_assert_eq(bd_units_parse_uint("", &n), -EINVAL);
    cr_assert_eq(bd_units_parse_uint(NULL, &n), -EINVAL);
    cr_assert_eq(n, 42);

    int64_t i = 42;
    cr_assert_eq(bd_units_parse_int("-9223372036854775808", &i), 0);
    cr_assert_eq(i, INT64_MIN);
    cr_assert_eq(bd_units_parse_int("9223372036854775807", &i), 0);
    cr_assert_eq(i, INT64_MAX);
    cr_assert_eq(bd_units_parse_int("-0", &i), 0);
    cr_assert_eq(i, 0);
    i = 42;
    cr_assert_eq(bd_units_parse_int("9223372036854775808", &i), -ERANGE);
    cr_assert_eq(bd_units_parse_int("-9223372036854775809", &i), -ERANGE);
    cr_assert_eq(bd_units_parse_int("--1", &i), -EINVAL);
    cr_assert_eq(bd_units_parse_int("+1", &i), -EINVAL);
    cr_assert_eq(bd_units_parse_int(" 1", &i), -EINVAL);
    cr_assert_eq(bd_units_parse_int("-", &i), -EINVAL);
    cr_assert_eq(bd_units_parse_int("1s", &i), -EINVAL);
    cr_assert_eq(bd_units_parse_int(NULL, &i), -EINVAL);
    cr_assert_eq(i, 42);

    struct sockaddr_storage ss;
    const char *why = NULL;
    cr_assert_eq(bd_units_parse_hostport("::1:80", &ss, &why), -EINVAL);
    cr_assert_str_eq(why, "an IPv6 address needs brackets, as in [::1]:8089");
    cr_assert_eq(bd_units_parse_hostport("1.2.3.4:65536", &ss, &why), -EINVAL);
    cr_assert_str_eq(why, "the port must be a number from 0 to 65535");
    cr_assert_eq(bd_units_parse_hostport("localhost:80", &ss, &why), -EINVAL);
    cr_assert_str_eq(why, "the host must be a numeric IPv4 address or a bracketed IPv6 address");
}
