#!/usr/bin/env bash
# Set up, check the format, build and run every bucketd test: the whole suite once plain and under
# AddressSanitizer + UndefinedBehaviorSanitizer, the ring stress test and the end-to-end tests
# (the daemon's threads) under ThreadSanitizer, the whole suite again on an aarch64 build under
# qemu (tools/test-aarch64.sh), then each parser's libFuzzer target for 60 seconds. This is the
# command CI runs (.ci/run). Build trees: build/, build-asan/, build-tsan/, build-aarch64/ under
# the repository root.
#
#   bash tools/test.sh            # everything
#   BD_TEST_QUICK=1 bash ...      # plain build only
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc 2>/dev/null || echo 2)"

bash tools/install-deps.sh

# The house format (.clang-format, STYLE.md): any C file that clang-format would change fails.
echo "== format"
git ls-files '*.c' '*.h' | xargs clang-format --dry-run --Werror

configure_build() { # dir, extra cmake args...
  local dir="$1"; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBD_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

run_ctest() { # dir, label, extra ctest args...
  local dir="$1" label="$2"; shift 2
  echo "== $label"
  (cd "$dir" && ctest --output-on-failure --no-tests=error "$@")
}

configure_build build
run_ctest build "plain build: unit, end-to-end and stress tests"

if [ "${BD_TEST_QUICK:-0}" != "1" ]; then
  configure_build build-asan -DBD_ASAN=ON -DBD_UBSAN=ON
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest build-asan "ASan+UBSan build: unit, end-to-end and stress tests"

  configure_build build-tsan -DBD_TSAN=ON
  # The daemon's two threads (ingest loop, flusher) and the rings, under TSan: the stress test
  # and the end-to-end tests, which run the TSan-built daemon.
  # tests/tsan.supp: races TSan reports inside the uninstrumented libmongoc/libbson (see there).
  TSAN_OPTIONS="halt_on_error=1 suppressions=$root/tests/tsan.supp" run_ctest build-tsan "TSan build: ring stress and end-to-end tests" \
    -L "stress|e2e"

  # The same unit, stress and end-to-end tests on an aarch64 build, run under qemu.
  bash tools/test-aarch64.sh

  # libFuzzer on each parser for 60 s (clang, ASan+UBSan); any finding fails the run.
  echo "== fuzzing the parsers"
  bash tests/fuzz/run.sh "${BD_FUZZ_SECONDS:-60}"
fi
echo "all test runs passed"
