#!/usr/bin/env bash
# Line and branch coverage of bucketd's modules by the unit tests alone (no MongoDB, no daemon):
# builds build-cov/ with gcov instrumentation (BD_COVERAGE, Debug), runs every unit test, and
# prints one row per module: lines executed, branches taken at least once. The flusher's modules
# come first; the rest follow with --all. gcov's own per-line reports (*.gcov, with the counts
# of every line and branch) are left in build-cov/gcov/ for reading.
#
#   bash tools/coverage.sh           # the flusher's modules
#   bash tools/coverage.sh --all     # every module under src/
#
# What the unit tests cannot reach is named, not hidden: store.c is the mongoc implementation of
# the store interface (reached end to end, through the test server) and io.c the I/O thread.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc 2>/dev/null || echo 2)"
export MONGOC_DISABLE_SHM=1

# The flusher and what its decisions are made of (DESIGN.md §3, the seams of the flusher);
# queries holds the summaries' aggregate and the buckets' filter (once in summaries and store);
# flusher_* are the flusher's parts (src/flusher_int.h), settle the engine it shares with replay
# (once in flusher and replay), storecall the store-call runner.
flusher_modules="flusher flusher_reload flusher_spool flusher_writer flusher_summaries flusher_drain
flusher_io settle storecall outcome pages batch bucket replay store io writer deadletter summaries
queries spool alloc"

all=0
[ "${1:-}" = "--all" ] && all=1

cmake -S . -B build-cov -DCMAKE_BUILD_TYPE=Debug -DBD_COVERAGE=ON -DBD_WERROR=ON >/dev/null
cmake --build build-cov -j "$jobs" >/dev/null
objdir="$root/build-cov/CMakeFiles/bd_core.dir/src"
find "$root/build-cov" -name '*.gcda' -delete
(cd build-cov && ctest -L unit --no-tests=error -j "$jobs" >ctest-output.txt) ||
  { cat build-cov/ctest-output.txt; exit 1; }

mkdir -p build-cov/gcov
cd build-cov/gcov
rm -f ./*.gcov

if [ "$all" = 1 ]; then
  modules="$(cd "$root/src" && ls ./*.c | sed 's|^\./||; s|\.c$||')"
else
  modules="$flusher_modules"
fi

printf '%-20s %16s %22s\n' module "lines" "branches taken"
total_l=0 total_lh=0 total_b=0 total_bh=0
for m in $modules; do
  obj="$objdir/$m.c.o"
  if [ ! -f "$objdir/$m.c.gcda" ]; then
    printf '%-20s %16s %22s\n' "$m" "not run" "-"
    continue
  fi
  # gcov -b -c: per file "Lines executed:P% of N" and "Taken at least once:P% of N".
  out="$(gcov -b -c -o "$obj" "$root/src/$m.c" 2>/dev/null |
    awk -v f="$root/src/$m.c" '/^File /{cur=($2=="\x27" f "\x27")} cur' )"
  lp="$(sed -n 's/^Lines executed:\([0-9.]*\)% of \([0-9]*\)/\1 \2/p;T;q' <<<"$out")"
  bp="$(sed -n 's/^Taken at least once:\([0-9.]*\)% of \([0-9]*\)/\1 \2/p;T;q' <<<"$out")"
  read -r lpct ln <<<"${lp:-0 0}"
  read -r bpct bn <<<"${bp:-0 0}"
  printf '%-20s %7s%% of %5s %12s%% of %5s\n' "$m" "$lpct" "$ln" "$bpct" "$bn"
  total_l=$((total_l + ln))
  total_lh=$((total_lh + $(awk -v p="$lpct" -v n="$ln" 'BEGIN{printf "%d", p*n/100+0.5}')))
  total_b=$((total_b + bn))
  total_bh=$((total_bh + $(awk -v p="$bpct" -v n="$bn" 'BEGIN{printf "%d", p*n/100+0.5}')))
done
awk -v l="$total_l" -v lh="$total_lh" -v b="$total_b" -v bh="$total_bh" 'BEGIN{
  printf "%-20s %7.2f%% of %5d %12.2f%% of %5d\n", "total", l ? 100*lh/l : 0, l,
    b ? 100*bh/b : 0, b }'
echo "(unit tests only; per-line counts in build-cov/gcov/*.gcov)"
