#!/usr/bin/env bash
# The parser target's reference point: simdjson (Debian's libsimdjson-dev, the state of the art in
# SIMD parsing) reading the same points as bench_parse, encoded as NDJSON, every value visited,
# against a memchr split of that JSON text, the same ceiling bench_parse uses. Prints both ratios
# from one run of each, on the same machine.
#
#   bash bench/reference/run.sh [BUILD_DIR]    # BUILD_DIR holds bench_bench_parse (build-bench)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${1:-$here/../../build-bench}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

missing=()
for p in g++ libsimdjson-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
fi

"$build/bench_bench_parse" --dump "$work/points.lp"
/usr/bin/python3 "$here/lp2json.py" "$work/points.lp" "$work/points.ndjson"
g++ -O3 -std=c++17 "$here/simdjson_points.cpp" -lsimdjson -o "$work/simdjson_points"
"$build/bench_bench_parse" --format influx
"$work/simdjson_points" "$work/points.ndjson"
