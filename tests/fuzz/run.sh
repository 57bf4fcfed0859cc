#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz/fuzz_*.c: the two parsers, and fuzz_accept for the path after
# the parser) with clang, libFuzzer, ASan and UBSan into
# build-fuzz/ under the repository root, regenerates their seed corpora there, and fuzzes each
# target in turn. Exits non-zero on any finding (crash, invariant trap, sanitizer report, leak,
# timeout, out-of-memory) and prints the input that reproduces it. Installs clang and the
# libFuzzer runtime from Debian when they are missing (run as root or with sudo).
#
#   bash tests/fuzz/run.sh [SECONDS]   # fuzz each target for SECONDS (default 60)
#   bash tests/fuzz/run.sh --smoke     # build, then run each target over its seeds once
#
# Inputs the fuzzer finds are kept in build-fuzz/corpus-<target>/ and reused by the next run;
# findings land in build-fuzz/artifacts-<target>/ and the log in build-fuzz/<target>.log.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

seconds=60
smoke=0
case "${1:-}" in
  "") ;;
  --smoke) smoke=1 ;;
  -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *)
    if ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -eq 0 ]; then
      echo "run.sh: SECONDS must be a positive whole number, not '$1'" >&2
      exit 2
    fi
    seconds="$1" ;;
esac

# --- Packages: clang, then the compiler-rt (libFuzzer) and llvm-symbolizer of its version ---

# tools/install-deps.sh --all (tools/test.sh runs it first) has installed them; run on its own,
# this installs what is missing, through tools/apt.sh (waits for apt's locks).
. "$root/tools/apt.sh"
# python3 writes the seeds; libyaml-dev links src/config.c, which bucketd-parse.c calls into.
bd_apt_install clang python3 libyaml-dev
llvm_major="$(clang -dumpversion | cut -d. -f1)"
# libFuzzer lives in compiler-rt, which clang only recommends; llvm-symbolizer names the frames.
bd_apt_install "libclang-rt-${llvm_major}-dev" "llvm-${llvm_major}"
symbolizer="/usr/lib/llvm-${llvm_major}/bin/llvm-symbolizer"

# --- Build ------------------------------------------------------------------------------------

out="$root/build-fuzz"
mkdir -p "$out"
# shellcheck disable=SC2054 # the commas belong to -fsanitize=
cflags=(-std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer
        -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
        -Wall -Wextra -Wshadow -Wno-unused-parameter -I "$root/include")

echo "== building fuzz targets with $(clang --version | head -n1)"
# The config loader (src/config.c) walks its schema (src/config_schema.c), which reads numbers
# with src/units.c and checks mongodb.uri with libmongoc (src/mongo.c); src/config_files.c reads
# the credential files (src/creds.c) and loads TLS certificates (src/tls.c, OpenSSL); allow lists
# are src/allow.c's; src/log.c escapes what it logs (src/escape.c).
read -r -a mongoc <<<"$(pkg-config --cflags --libs libmongoc-1.0 openssl)"
config_srcs=(src/config.c src/config_schema.c src/config_files.c src/units.c src/log.c
             src/mongo.c src/creds.c src/tls.c src/escape.c src/allow.c)
# The parser: the public calls and fast walk, the general parser, the classifiers.
parse_srcs=(src/parse.c src/parse_general.c src/parse_simd.c)
clang "${cflags[@]}" -o "$out/fuzz_influx" tests/fuzz/fuzz_influx.c \
  "${parse_srcs[@]}" src/common.c "${config_srcs[@]}" "${mongoc[@]}" -lyaml -lm
clang "${cflags[@]}" -o "$out/fuzz_graphite" tests/fuzz/fuzz_graphite.c \
  "${parse_srcs[@]}" src/common.c -lm
# The path after the parser: sensor table, buffer pool, pages, batch, update documents.
read -r -a accept_libs <<<"$(pkg-config --cflags --libs libbson-1.0 libxxhash)"
clang "${cflags[@]}" -o "$out/fuzz_accept" tests/fuzz/fuzz_accept.c \
  "${parse_srcs[@]}" src/common.c "${config_srcs[@]}" src/sensor.c src/sensor_block.c \
  src/sensor_list.c src/pool.c src/slab.c src/ring.c src/names.c src/bucket.c src/pages.c \
  src/batch.c src/alloc.c src/stats.c \
  "${mongoc[@]}" "${accept_libs[@]}" -lyaml -lm

# --- Seeds ------------------------------------------------------------------------------------

corpus_json="$root/../shared/corpus/line-protocol/corpus.json"
seed_args=("$out")
if [ -f "$corpus_json" ]; then
  seed_args+=(--corpus "$corpus_json")
else
  echo "run.sh: no $corpus_json; line-protocol seeds are the hand-written ones only"
fi
python3 tests/fuzz/make_seeds.py "${seed_args[@]}"

# --- Run --------------------------------------------------------------------------------------

export ASAN_OPTIONS="detect_leaks=1:symbolize=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
if [ -x "$symbolizer" ]; then
  export ASAN_SYMBOLIZER_PATH="$symbolizer"
fi

# Prints where the finding of a failed run is and how to replay it.
report_finding() { # target, log
  local target="$1" log="$2" art
  echo "!! fuzz_$target: finding; the end of $log:"
  tail -n 60 "$log" | sed 's/^/   /'
  # libFuzzer names the file it wrote; the newest artifact is the fallback.
  art="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n1)"
  if [ -z "$art" ] || [ ! -f "$art" ]; then
    art="$(find "$out/artifacts-$target" -type f -printf '%T@ %p\n' 2>/dev/null | sort -n \
      | tail -n1 | cut -d' ' -f2-)"
  fi
  if [ -n "$art" ]; then
    echo "!! reproducer: $art ($(stat -c %s "$art") bytes)"
    echo "!!   first 128 bytes (hex): $(head -c 128 "$art" | od -An -tx1 -v | tr -s ' \n' ' ')"
    echo "!!   replay: $out/fuzz_$target $art"
  else
    echo "!! no reproducer was written (see the log)"
  fi
}

failed=0
for target in influx graphite accept; do
  bin="$out/fuzz_$target"
  log="$out/$target.log"
  seeds=("$out/seeds-$target")
  # Findings kept in the repository once fixed (tests/fuzz/regressions/<target>/) run too.
  if [ -d "tests/fuzz/regressions/$target" ]; then
    seeds+=("$root/tests/fuzz/regressions/$target")
  fi
  arts="$out/artifacts-$target"
  mkdir -p "$arts"
  common=(-timeout=10 -rss_limit_mb=2048 -artifact_prefix="$arts/" -print_final_stats=1)
  if [ "$smoke" -eq 1 ]; then
    echo "== fuzz_$target: smoke run over $(find "${seeds[@]}" -type f | wc -l) seeds"
    args=("${common[@]}" -runs=0 "${seeds[@]}")
  else
    corpus="$out/corpus-$target"
    mkdir -p "$corpus"
    echo "== fuzz_$target: ${seconds}s (corpus $corpus, seeds ${seeds[*]})"
    args=("${common[@]}" -max_total_time="$seconds" -dict="$out/$target.dict" "$corpus"
          "${seeds[@]}")
  fi
  rc=0
  "$bin" "${args[@]}" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    report_finding "$target" "$log"
    failed=1
    continue
  fi
  # The last status line (runs, coverage, corpus, exec/s) and the final stats.
  grep -E '^#[0-9]+[[:space:]]+(INITED|DONE|pulse|NEW|REDUCE)' "$log" | tail -n1 \
    | sed 's/^/   /' || true
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" \
    | sed 's/^/   /' || true
done

if [ "$failed" -ne 0 ]; then
  echo "run.sh: fuzzing found a problem (see above)"
  exit 1
fi
echo "run.sh: no findings"
