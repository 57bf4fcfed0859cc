#!/usr/bin/env bash
# Set up, check the format, build and run every bucketd test: the whole suite once plain and under
# AddressSanitizer + UndefinedBehaviorSanitizer, the ring stress test and the end-to-end tests
# (the daemon's threads) under ThreadSanitizer, the whole suite again on an aarch64 build under
# qemu (tools/test-aarch64.sh), the Debian packages of both builds (tools/test-packages.sh), then
# each parser's libFuzzer target for 60 seconds. Nothing here needs git. This is the
# command CI runs (.ci/run). Build trees: build/, build-asan/, build-tsan/, build-aarch64/ under
# the repository root. The tests of each build run in parallel (ctest -j, twice the cores;
# BD_TEST_JOBS=N sets the number), and the aarch64 stage runs in the background beside the
# sanitizer stages (its output in build/test-aarch64.log, printed whole when they are done).
#
#   bash tools/test.sh                              # everything
#   BD_TEST_QUICK=1 bash tools/test.sh              # plain build only (the rest: listed as skipped)
#   BUCKETD_TEST_REQUIRE_ALL=1 bash tools/test.sh   # as CI runs it: a skip fails the run unless
#                                                   # .ci/allowed-skips names it, with its reason
#
# Skips are not passes. Every test program runs through tests/run_test.py, which makes ctest
# report a program that skipped any of its tests as "Skipped" and appends each skip (stage, test
# id, reason) to build/test-skips.log; tools/test-aarch64.sh does the same when the aarch64 run
# cannot start. At the end this script lists every skip of the run and prints "all test runs
# passed" only when there was none. With BUCKETD_TEST_REQUIRE_ALL=1 a missing line-protocol
# corpus and an aarch64 run that cannot start fail at once, and any other skip fails the run
# unless .ci/allowed-skips allows it (machine-dependent skips only: no IPv6 loopback, no
# /proc/net).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc 2>/dev/null || echo 2)"
# Tests run in parallel (ctest -j): an end-to-end test spends most of its time waiting on the
# daemon's timers and its scenario, so twice as many as there are cores keeps them busy; each
# has its own ports, temporary directory and test server (tests/CMakeLists.txt).
# BD_TEST_JOBS overrides the number (1: one at a time).
test_jobs="${BD_TEST_JOBS:-$((jobs * 2))}"
export BD_TEST_JOBS="$test_jobs"

# Time per stage, printed at the end (and when a stage fails): CI has to stay well inside its
# limit, and this says where the time goes.
stage_name="dependencies"
stage_start=$SECONDS
stage_times=()
stage() { # name of the stage starting now
  stage_times+=("$stage_name $((SECONDS - stage_start))s")
  stage_name="$1"
  stage_start=$SECONDS
}
print_stage_times() {
  stage "(end)"
  echo "== time per stage (total $((SECONDS / 60)) min $((SECONDS % 60)) s): ${stage_times[*]}" |
    sed 's/s \([a-z(]\)/s, \1/g'
}

# Every package any stage needs, installed here before the first stage starts: no stage calls apt
# itself, and the package checks, which run beside the fuzzing, never race it for apt's lock.
if [ "${BD_TEST_QUICK:-0}" = "1" ]; then
  bash tools/install-deps.sh
else
  bash tools/install-deps.sh --all
fi

# libmongoc creates /dev/shm/mongoc-<pid> for its counters as soon as it is loaded (before main),
# and the SIGKILL tests leave those files behind; a later process that gets the same pid then
# prints "Falling back to malloc for counters" into output the tests read. Nothing reads them.
export MONGOC_DISABLE_SHM=1

mkdir -p build
export BUCKETD_TEST_SKIP_LOG="$root/build/test-skips.log"
: >"$BUCKETD_TEST_SKIP_LOG"
# A run that fails part-way still lists what it had skipped until then.
list_skips_on_failure() {
  local rc=$?
  [ "$rc" -ne 0 ] && stop_beside
  [ "$rc" -ne 0 ] && print_stage_times
  if [ "$rc" -ne 0 ] && [ -s "$BUCKETD_TEST_SKIP_LOG" ]; then
    BUCKETD_TEST_REQUIRE_ALL=0 /usr/bin/python3 tests/run_test.py --report \
      "$BUCKETD_TEST_SKIP_LOG" "$root/.ci/allowed-skips" || true
  fi
  return "$rc"
}
trap list_skips_on_failure EXIT

# The house format (.clang-format, STYLE.md): any C file that clang-format would change fails.
# The C sources live under these top-level directories; found with find(1), not git, so that the
# check also runs on a machine (or a source tree) without git.
stage format
echo "== format"
find src include daemon tools tests bench -type f \( -name '*.c' -o -name '*.h' \) -print0 |
  sort -z | xargs -0 clang-format --dry-run --Werror

configure_build() { # dir, extra cmake args...
  local dir="$1"; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBD_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

# A test ctest reports as skipped without a line in the skip log (a program that exited 77 by
# itself) is still listed, as a whole.
note_ctest_skips() { # stage, ctest output file
  local stage="$1" out="$2" name
  for name in $(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) (Skipped)$/\1/p' "$out"); do
    if ! grep -q "^$stage"$'\t'"$name/" "$BUCKETD_TEST_SKIP_LOG"; then
      printf '%s\t%s\t%s\n' "$stage" "$name" "ctest reported it skipped" >>"$BUCKETD_TEST_SKIP_LOG"
    fi
  done
}

run_ctest() { # dir, stage, label, extra ctest args...
  local dir="$1" stage="$2" label="$3"; shift 3
  local out="$root/$dir/ctest-output.txt"
  echo "== $label"
  (cd "$dir" && BUCKETD_TEST_STAGE="$stage" ctest --output-on-failure --no-tests=error \
    -j "$test_jobs" "$@") | tee "$out"
  note_ctest_skips "$stage" "$out"
}

# A stage that runs in the background, beside the stages that follow it: its output goes to a
# file, printed whole (each line prefixed with the stage's name) when finish_beside waits for it,
# and its own time joins the time line as "NAME (beside)". If the run fails before that, the
# EXIT trap stops it and prints what it had written.
beside_name=""
beside_pid=""
beside_log=""
start_beside() { # name, log file, command...
  beside_name="$1" beside_log="$2"
  shift 2
  echo "== $beside_name: in the background beside the next stages (output: $beside_log)"
  # Its own session, so that the trap can stop it with everything it started.
  setsid bash -c 'start=$SECONDS; rc=0; "$@" || rc=$?
                  echo "$((SECONDS - start))" >"$0.seconds"; exit "$rc"' \
    "$beside_log" "$@" >"$beside_log" 2>&1 </dev/null &
  beside_pid=$!
}
print_beside_log() { # (what the stage wrote, prefixed)
  sed "s/^/[$beside_name] /" "$beside_log"
}
finish_beside() { # waits for the background stage; fails the run if it failed
  local rc=0
  wait "$beside_pid" || rc=$?
  beside_pid=""
  echo "== $beside_name (ran in the background; $beside_log)"
  print_beside_log
  stage_times+=("$beside_name (beside) $(cat "$beside_log.seconds" 2>/dev/null || echo '?')s")
  if [ "$rc" -ne 0 ]; then
    echo "$beside_name failed (exit status $rc)" >&2
    exit "$rc"
  fi
}
stop_beside() { # on a failure elsewhere: stop the background stage and show its output so far
  if [ -n "$beside_pid" ]; then
    kill -TERM -- "-$beside_pid" 2>/dev/null || true
    wait "$beside_pid" 2>/dev/null || true
    echo "== $beside_name: stopped (the run failed elsewhere); its output so far:"
    print_beside_log
    beside_pid=""
  fi
}

skip_stage() { # stage, reason
  printf '%s\t%s\t%s\n' "$1" "tools/test.sh:$1" "$2" >>"$BUCKETD_TEST_SKIP_LOG"
}

stage "plain build"
configure_build build
# Layers only call down (src/README.md): no two files of src/ may depend on each other in a
# circle, by the object files' symbols and the includes of another module's header. The check is
# the one beside the repository (../shared/tools/layers.py); CI always has it.
stage "layers"
layers="$root/../shared/tools/layers.py"
if [ -f "$layers" ]; then
  layers_rc=0
  layers_out="$(/usr/bin/python3 "$layers" build src)" || layers_rc=$?
  if [ "$layers_rc" -ne 0 ]; then
    printf '%s\n' "$layers_out"
    echo "a circle among the files of src/: a lower layer calls a higher one (src/README.md)" >&2
    exit 1
  fi
  echo "== layers: $(printf '%s\n' "$layers_out" | tail -n 1)"
else
  skip_stage layers "no ../shared/tools/layers.py beside the repository"
fi
stage "plain tests"
run_ctest build plain "plain build: unit, end-to-end and stress tests"

if [ "${BD_TEST_QUICK:-0}" != "1" ]; then
  # The same unit, stress and end-to-end tests on an aarch64 build, run under qemu
  # (tools/test-aarch64.sh): in the background, beside the sanitizer stages. Both are mostly
  # waiting (an end-to-end test waits on the daemon's timers and its scenario), and the aarch64
  # stage, the longest, would otherwise run alone. Its output is printed, whole, once the
  # sanitizer stages are done (each line prefixed "[aarch64]"); the packages need its build.
  start_beside aarch64 "$root/build/test-aarch64.log" bash tools/test-aarch64.sh

  stage "asan build"
  configure_build build-asan -DBD_ASAN=ON -DBD_UBSAN=ON
  stage "asan tests"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_ctest build-asan asan "ASan+UBSan build: unit, end-to-end and stress tests" -LE e2e_long

  stage "tsan build"
  configure_build build-tsan -DBD_TSAN=ON
  stage "tsan tests"
  # The daemon's two threads (ingest loop, flusher) and the rings, under TSan: the stress test
  # and the end-to-end tests, which run the TSan-built daemon.
  # tests/tsan.supp: races TSan reports inside the uninstrumented libmongoc/libbson (see there).
  TSAN_OPTIONS="halt_on_error=1 suppressions=$root/tests/tsan.supp" run_ctest build-tsan tsan \
    "TSan build: ring stress and end-to-end tests" -L "stress|e2e" -LE e2e_long

  # The rest of the aarch64 stage, if it is still running.
  stage "aarch64 (rest)"
  finish_beside

  # The Debian packages, amd64 from build/ and arm64 from build-aarch64/: contents, lintian,
  # and each installed into a fresh Debian root (tools/test-packages.sh). It runs beside the
  # fuzzing, which keeps one core busy for its fixed time: its slow part, the arm64 root under
  # qemu (one core, ~100 s), then adds next to nothing to the run. Its output follows the
  # fuzzing's.
  stage "fuzzing and packages"
  echo "== Debian packages: in the background while the parsers are fuzzed"
  bash tools/test-packages.sh >build/test-packages.log 2>&1 &
  packages_pid=$!

  # libFuzzer on each parser for 60 s (clang, ASan+UBSan); any finding fails the run.
  echo "== fuzzing the parsers and the path after them"
  fuzz_rc=0
  bash tests/fuzz/run.sh "${BD_FUZZ_SECONDS:-60}" || fuzz_rc=$?

  packages_rc=0
  wait "$packages_pid" || packages_rc=$?
  echo "== Debian packages (tools/test-packages.sh, build/test-packages.log)"
  cat build/test-packages.log
  if [ "$fuzz_rc" -ne 0 ] || [ "$packages_rc" -ne 0 ]; then
    exit 1
  fi
else
  for stage in asan tsan aarch64 packages fuzz; do
    skip_stage "$stage" "not run: BD_TEST_QUICK=1"
  done
fi

# Every skip of the run, checked against .ci/allowed-skips under BUCKETD_TEST_REQUIRE_ALL=1.
trap - EXIT
print_stage_times
if [ -s "$BUCKETD_TEST_SKIP_LOG" ]; then
  /usr/bin/python3 tests/run_test.py --report "$BUCKETD_TEST_SKIP_LOG" "$root/.ci/allowed-skips"
  echo "test runs passed, except for the skips listed above (see build/test-skips.log)"
else
  echo "all test runs passed"
fi
