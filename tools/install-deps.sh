#!/usr/bin/env bash
# Install the Debian packages bucketd needs. Safe to re-run: packages already present are not
# touched, and apt is only called when something is missing. Run as root (or with sudo
# available) on Debian bookworm.
#
#   bash tools/install-deps.sh          # build, run, the unit and end-to-end tests, the demo
#   bash tools/install-deps.sh --all    # and every other stage of tools/test.sh: the fuzzers
#                                       # (clang, libFuzzer), the aarch64 build and its qemu
#                                       # run, the package checks (lintian, mmdebstrap)
#
# tools/test.sh runs this (with --all unless BD_TEST_QUICK=1) before any of its stages starts,
# so that no stage has to call apt, and never two at once: the package checks run beside the
# fuzzing. apt is called through tools/apt.sh, which waits for a lock another program holds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
. ./apt.sh

all=0
case "${1:-}" in
  "") ;;
  --all) all=1 ;;
  -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install-deps.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
esac

PACKAGES=(
  # build
  build-essential cmake pkg-config
  libmongoc-dev libbson-dev libuv1-dev libyaml-dev libxxhash-dev libsystemd-dev
  # TLS on TCP listeners; the openssl CLI makes the end-to-end tests' certificates
  libssl-dev openssl
  # the man pages (tools/man/*.scd); dpkg-shlibdeps for the Debian package (cpack -G DEB)
  scdoc dpkg-dev
  # tests; clang-format checks the house format (.clang-format)
  libcriterion-dev clang-format
  # MongoDB test server and the Python end-to-end tests (Debian's python3, not a venv)
  python3 python3-mockupdb python3-mongomock python3-pymongo
  # tests/e2e/test_monitoring.py reads the Prometheus rules and their promtool tests
  python3-yaml
  # mount(8): the spool's full-filesystem tests mount a small tmpfs (not in a minimal root)
  mount
  # tests/e2e/test_top.py runs bucketd-inspect top on a terminal: tmux gives it one and reads
  # the screen back (capture-pane)
  tmux
  # promtool checks a real /metrics scrape (tests/e2e/test_metrics.py) and the shipped rules and
  # dashboard (tests/e2e/test_monitoring.py, tests/prometheus/); Debian ships it in the
  # prometheus package (19 MB download, 96 MB installed, a few seconds). The tests use only
  # promtool; on a machine booted with systemd the package also starts a Prometheus server on
  # :9090 (systemctl disable --now prometheus if that is unwanted).
  prometheus
)
if [ "$all" -eq 1 ]; then
  PACKAGES+=(
    # tests/fuzz/run.sh: clang with libFuzzer (compiler-rt) and llvm-symbolizer, below
    clang
    # tools/test-aarch64.sh: Debian's cross compiler and qemu user-mode emulation
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static
    # tools/test-packages.sh: lintian, and the fresh Debian roots the packages install into
    lintian mmdebstrap arch-test
  )
fi

bd_apt_install "${PACKAGES[@]}"

if [ "$all" -eq 1 ]; then
  # libFuzzer lives in compiler-rt, which clang only recommends; both come in clang's version.
  llvm_major="$(clang -dumpversion | cut -d. -f1)"
  bd_apt_install "libclang-rt-${llvm_major}-dev" "llvm-${llvm_major}"
  # arm64 among dpkg's architectures, so that tools/test-aarch64.sh can download the arm64
  # libraries it unpacks into its sysroot (they are never installed).
  # A mirror without arm64 fails the update: that is for tools/test-aarch64.sh to report.
  if ! grep -qx arm64 <<<"$(dpkg --print-foreign-architectures)"; then
    $BD_APT_SUDO dpkg --add-architecture arm64
  fi
  if ! apt-cache show libmongoc-dev:arm64 >/dev/null 2>&1; then
    bd_apt_get update -q || echo "install-deps: apt-get update failed after adding arm64"
  fi
fi
echo "install-deps: all packages present"
