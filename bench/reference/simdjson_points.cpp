// simdjson (Debian libsimdjson-dev) reading the same points as bench_parse, as NDJSON, every value
// visited, against memchr over the same text (bench/reference/run.sh builds and runs it).
#include <simdjson.h>
#include <chrono>
#include <cstdio>
#include <cstring>
using namespace simdjson;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char **argv) {
    padded_string json = padded_string::load(argv[1]);
    size_t lines = 0; for (size_t i = 0; i < json.size(); i++) lines += json.data()[i] == '\n';
    ondemand::parser parser;
    double best_p = 1e9, best_m = 1e9; uint64_t chk = 0;
    for (int run = 0; run < 7; run++) {
        double t0 = now();
        ondemand::document_stream docs = parser.iterate_many(json, 1 << 20);
        for (auto doc : docs) {
            ondemand::object o = doc.get_object();
            for (auto f : o) {
                std::string_view k = f.unescaped_key();
                if (k == "name") { std::string_view s = f.value().get_string(); chk += s.size(); }
                else if (k == "tags") { for (auto t : f.value().get_object()) { std::string_view v = t.value().get_string(); chk += v.size() + t.unescaped_key().value().size(); } }
                else if (k == "fields") { for (auto t : f.value().get_object()) { ondemand::number n = t.value().get_number(); chk += n.is_int64() ? (uint64_t)n.get_int64() : (uint64_t)n.get_double(); } }
                else { chk += f.value().get_int64(); }
            }
        }
        double t1 = now();
        const char *p = json.data(), *end = p + json.size();
        while (p < end) { const char *nl = (const char *)memchr(p, '\n', end - p); if (!nl) nl = end; chk += nl - p; p = nl + 1; }
        double t2 = now();
        if (t1 - t0 < best_p) best_p = t1 - t0;
        if (t2 - t1 < best_m) best_m = t2 - t1;
    }
    printf("simdjson %s: %zu docs, %.1f ns/doc; memchr %.1f ns/line; ratio %.1f%% (chk %llu)\n",
           simdjson::get_active_implementation()->name().data(), lines, best_p * 1e9 / lines, best_m * 1e9 / lines,
           100.0 * best_m / best_p, (unsigned long long)(chk & 255));
}
