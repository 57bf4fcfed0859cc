#!/usr/bin/env bash
# Runs bucketd's benchmark suite (DESIGN.md section 7) and prints one markdown report: the
# machine and conditions, then one table row per figure with bucketd's number, the baseline
# measured in the same run, their ratio, the target and whether it is met.
#
#   bench/run.sh [--quick] [--build DIR] [--only LIST] [--outage SECONDS]
#                [--writecost SECONDS] [--summary-hours N] [--no-netns]
#
#   --quick     reduced suite that finishes in under a minute: short steps, fewer search steps
#               and rounds, fewer sensors, the first idle-connection case, no peers, an outage
#               until the spool holds records, no write-cost row (unless --only or --writecost
#               names it); its report is not saved
#   --build DIR Release build directory (default build-bench/ in the repository)
#   --only LIST comma-separated subset:
#               parser,udp,tcp,memory,latency,standin,peers,slowdb,replay,writecost,summaries,
#               metrics,tls,idleconns,hostile,reboot
#   --outage S  how long MongoDB is away before the replay row (default 600; --quick: until
#               the spool holds records for 1 s) and the reboot row (default 600, --quick 30)
#   --writecost S   how long the 1 Hz sensors of the write-cost row send (default 300,
#               --quick 60)
#   --summary-hours N   past hours of 1 Hz readings for the summaries row (default 48,
#               --quick 6)
#   --no-netns  stay in the host network namespace
#
# The full suite saves its report as bench/results/<date>-<short commit>.md. bench/README.md
# explains each figure. As root the suite runs in a private network namespace (unshare -n,
# loopback only) so that the kernel's UDP drop counters in /proc/net/snmp count our sockets
# alone; every process it starts is stopped on exit, Ctrl-C or failure.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
PYTHON=/usr/bin/python3

quick=0
build=$REPO/build-bench
only=""
outage=""
writecost=""
summary_hours=""
netns=1
orig_args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --build) build=$2; shift ;;
        --build=*) build=${1#--build=} ;;
        --only) only=$2; shift ;;
        --only=*) only=${1#--only=} ;;
        --outage) outage=$2; shift ;;
        --outage=*) outage=${1#--outage=} ;;
        --writecost) writecost=$2; shift ;;
        --writecost=*) writecost=${1#--writecost=} ;;
        --summary-hours) summary_hours=$2; shift ;;
        --summary-hours=*) summary_hours=${1#--summary-hours=} ;;
        --no-netns) netns=0 ;;
        -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$build" in /*) ;; *) build=$PWD/$build ;; esac

log() { printf 'bench: %s\n' "$*" >&2; }

# The peers' packages come from Debian's mirror, which the private network namespace below
# cannot reach: fetch them first (a no-op once cached). A failure is reported by the peer rows.
if [ "${BD_BENCH_IN_NETNS:-0}" != 1 ] && [ "$quick" = 0 ] &&
    { [ -z "$only" ] || [[ ",$only," == *,peers,* ]]; }; then
    bash "$HERE/peers/setup.sh" >/dev/null 2>&1 || log "peers: setup failed (see bench/peers/setup.sh)"
fi

# A private network namespace: same kernel and sysctls, but our own loopback and our own
# /proc/net/snmp, so other processes on this shared machine cannot add UDP drops to ours.
if [ "$netns" = 1 ] && [ "${BD_BENCH_IN_NETNS:-0}" != 1 ] && [ "$(id -u)" = 0 ] &&
    command -v unshare >/dev/null && command -v ip >/dev/null &&
    unshare -n true 2>/dev/null; then
    export BD_BENCH_IN_NETNS=1
    exec unshare -n -- bash "$0" "${orig_args[@]}"
fi
in_netns=0
if [ "${BD_BENCH_IN_NETNS:-0}" = 1 ]; then
    ip link set lo up
    in_netns=1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/bucketd-bench.XXXXXX")
suite_pid=""

# Stops whatever is still running: the suite first (it stops its own children), then every
# process group a pid file under $work/pids names, in case the suite could not.
cleanup() {
    local rc=$? f pid
    trap - EXIT INT TERM
    if [ -n "$suite_pid" ] && kill -0 "$suite_pid" 2>/dev/null; then
        kill -TERM "$suite_pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$suite_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$suite_pid" 2>/dev/null || true
    fi
    for f in "$work"/pids/*; do
        [ -e "$f" ] || continue
        pid=${f##*/}
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    sleep 0.3
    for f in "$work"/pids/*; do
        [ -e "$f" ] || continue
        pid=${f##*/}
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    if [ "${BD_BENCH_KEEP:-0}" = 1 ]; then
        log "work directory kept: $work"
    else
        rm -rf "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The commit and the state of the tree are taken now, before building: others may commit while
# the suite runs, and the report must name the code that was measured.
commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=0
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    dirty=1
fi

# Build (Release). Tests are left out: only the daemon, the simulator and the bench programs
# are needed. A simulator that does not build is reported by the rows that need it.
log "building (Release) in $build"
cmake -S "$REPO" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBD_TESTS=OFF >"$work/cmake.log" 2>&1 ||
    { cat "$work/cmake.log" >&2; exit 1; }
jobs=$(nproc 2>/dev/null || echo 2)
cmake --build "$build" -j "$jobs" --target bucketd bench_bench_parse bench_udp_sink \
    >>"$work/cmake.log" 2>&1 || { tail -n 40 "$work/cmake.log" >&2; exit 1; }
if [ -f "$REPO/tools/bucketd-sim.c" ]; then
    cmake --build "$build" -j "$jobs" --target bucketd-sim >>"$work/cmake.log" 2>&1 ||
        log "bucketd-sim did not build; rows that need it will say so"
fi

# Only the full suite is saved: a quick or partial report is not a result.
out=""
if [ "$quick" = 0 ] && [ -z "$only" ]; then
    mkdir -p "$HERE/results"
    out=$HERE/results/$(date +%Y-%m-%d)-$commit.md
fi

args=(--repo "$REPO" --build "$build" --work "$work" --date "$(date '+%Y-%m-%d %H:%M %Z')"
      --commit "$commit")
[ "$dirty" = 1 ] && args+=(--dirty)
[ "$quick" = 1 ] && args+=(--quick)
[ -n "$only" ] && args+=(--only "$only")
[ -n "$outage" ] && args+=(--outage "$outage")
[ -n "$writecost" ] && args+=(--writecost "$writecost")
[ -n "$summary_hours" ] && args+=(--summary-hours "$summary_hours")
[ -n "$out" ] && args+=(--out "$out")
[ "$in_netns" = 1 ] && args+=(--netns)

# The suite runs in the background so that this shell can take INT/TERM and clean up.
"$PYTHON" "$HERE/suite.py" "${args[@]}" &
suite_pid=$!
set +e
wait "$suite_pid"
rc=$?
set -e
suite_pid=""
if [ -n "$out" ] && [ "$rc" = 0 ]; then
    log "report saved to ${out#"$REPO"/}"
fi
exit "$rc"
