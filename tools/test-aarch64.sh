#!/usr/bin/env bash
# Builds bucketd for aarch64 (arm64, the edge boxes' CPU) with Debian's cross compiler and runs
# the unit, stress and end-to-end tests on it under qemu user-mode emulation: the real arm64
# binaries (portable parser code, char unsigned, arm64 libmongoc/libuv/...) against the same
# test server. Build tree: build-aarch64/ under the repository root.
#
# What it needs from the machine, set up here (as root or with sudo): gcc-aarch64-linux-gnu, its C
# library (libc6-dev-arm64-cross) and qemu-user-static (amd64 packages), arm64 added to dpkg's
# architectures so that apt can fetch arm64 packages, and a binfmt_misc entry that makes the kernel
# run aarch64 programs through qemu (Criterion and the end-to-end tests start the test programs
# themselves, so they must run like native ones). The arm64 libraries are downloaded and unpacked
# into build-aarch64-sysroot/, never installed: libmongoc-dev and libbson-dev cannot be installed
# for two architectures at once, and installing the arm64 ones would remove the machine's own. qemu
# finds them there through QEMU_LD_PREFIX.
#
# Where the packages cannot be had (a mirror without arm64) or binfmt_misc cannot be set up (no
# privilege to mount or register it), the run cannot start: the script says "SKIPPED" and why,
# appends the skip to BUCKETD_TEST_SKIP_LOG (tools/test.sh lists it at the end of the run) and
# exits 0 - unless BUCKETD_TEST_REQUIRE_ALL=1 (CI), where it says "FAILED" and exits 1. Any other
# failure (build, a test) fails the run.
#
#   bash tools/test-aarch64.sh
#
# Emulation checks that the code builds and behaves the same on aarch64; it does not reproduce
# aarch64's weaker memory ordering (qemu runs on the stronger x86 model), which is what the
# ThreadSanitizer run of the rings is for.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc 2>/dev/null || echo 2)"
# Tests in parallel, as tools/test.sh runs them (BD_TEST_JOBS, default twice the cores).
test_jobs="${BD_TEST_JOBS:-$((jobs * 2))}"

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
skip() {
    if [ "${BUCKETD_TEST_REQUIRE_ALL:-0}" = "1" ]; then
        echo "test-aarch64: FAILED: the aarch64 run cannot start: $* (BUCKETD_TEST_REQUIRE_ALL=1)" >&2
        exit 1
    fi
    echo "test-aarch64: SKIPPED: $*"
    if [ -n "${BUCKETD_TEST_SKIP_LOG:-}" ]; then
        printf 'aarch64\ttools/test-aarch64.sh\t%s\n' "$*" >>"$BUCKETD_TEST_SKIP_LOG"
    fi
    exit 0
}
export DEBIAN_FRONTEND=noninteractive

# --- Cross compiler and emulator (amd64 packages) -------------------------------------------

# tools/install-deps.sh --all (tools/test.sh runs it first) has installed these and added arm64
# to dpkg's architectures; run on its own, this does it, through tools/apt.sh (waits for apt's
# locks).
. "$root/tools/apt.sh"
bd_apt_install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static

# --- The arm64 libraries, unpacked ----------------------------------------------------------

# Their dependencies come along, the arm64 C library included; any already installed is not
# downloaded, and qemu then finds it where dpkg put it (QEMU_LD_PREFIX falls back to /).
arm_pkgs=(libmongoc-dev libbson-dev libuv1-dev libyaml-dev libxxhash-dev libsystemd-dev
          libssl-dev libcriterion-dev)
sysroot="$root/build-aarch64-sysroot"
if [ "$(cat "$sysroot/.packages" 2>/dev/null)" != "${arm_pkgs[*]}" ] ||
   [ ! -e "$sysroot/DEBIAN/symbols" ]; then
    if ! grep -qx arm64 <<<"$(dpkg --print-foreign-architectures)"; then
        $sudo dpkg --add-architecture arm64
        bd_apt_get update -q || skip "apt-get update failed after adding arm64"
    elif ! apt-cache show libmongoc-dev:arm64 >/dev/null 2>&1; then
        bd_apt_get update -q || skip "apt-get update failed"
    fi
    debs="$root/build-aarch64-debs"
    rm -rf "$sysroot" "$debs"
    mkdir -p "$debs/partial" "$sysroot"
    # The packages and everything they depend on, downloaded only: apt plans the install (which
    # would swap the amd64 -dev packages out) but carries none of it out.
    bd_apt_get install -q -y --download-only --no-install-recommends \
        -o Dir::Cache::archives="$debs" "${arm_pkgs[@]/%/:arm64}" ||
        skip "the arm64 packages cannot be downloaded here (see apt's messages above)"
    for deb in "$debs"/*.deb; do
        # Not the arm64 libc6-dev: its libc.so names the C library by absolute paths that exist
        # only on an arm64 machine; the cross compiler links with its own (libc6-dev-arm64-cross).
        case "$(basename "$deb")" in libc6-dev_*) continue ;; esac
        dpkg-deb -x "$deb" "$sysroot"
        # Their symbols and shlibs files, together in DEBIAN/: dpkg-shlibdeps computes the arm64
        # package's Depends from them (tools/packaging/packaging.cmake, tools/test-packages.sh).
        mkdir -p "$sysroot/DEBIAN" "$debs/control"
        dpkg-deb -e "$deb" "$debs/control/$(basename "$deb" .deb)"
        for f in symbols shlibs; do
            if [ -e "$debs/control/$(basename "$deb" .deb)/$f" ]; then
                cat "$debs/control/$(basename "$deb" .deb)/$f" >>"$sysroot/DEBIAN/$f"
            fi
        done
    done
    touch "$sysroot/DEBIAN/symbols" "$sysroot/DEBIAN/shlibs"
    echo "${arm_pkgs[*]}" >"$sysroot/.packages"
    echo "test-aarch64: $(ls "$debs"/*.deb | wc -l) packages unpacked into $sysroot"
fi
export BD_AARCH64_SYSROOT="$sysroot"
export QEMU_LD_PREFIX="$sysroot"

# --- binfmt_misc: run aarch64 ELF files through qemu ----------------------------------------

binfmt=/proc/sys/fs/binfmt_misc
qemu=/usr/bin/qemu-aarch64-static
if [ ! -e "$binfmt/register" ]; then
    $sudo mount -t binfmt_misc binfmt_misc "$binfmt" 2>/dev/null || true
fi
if [ ! -e "$binfmt/qemu-aarch64" ] && [ -w "$binfmt/register" ]; then
    # The ELF header of an aarch64 executable (e_machine 0xb7); F: qemu is opened now, so it
    # also serves programs started in other mount namespaces.
    magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
    mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
    printf '%s' ":qemu-aarch64:M::$magic:$mask:$qemu:F" >"$binfmt/register" 2>/dev/null || true
fi
if [ ! -e "$binfmt/qemu-aarch64" ]; then
    skip "cannot set up binfmt_misc for aarch64 here (needs root)"
fi

# --- Build and test -------------------------------------------------------------------------

cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE="$root/tools/aarch64-toolchain.cmake" \
    -DBD_AARCH64_SYSROOT="$sysroot" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBD_WERROR=ON >/dev/null
cmake --build build-aarch64 -j "$jobs"
if [ "$(head -c 20 build-aarch64/bucketd | od -An -tx1 -j18 -N2 | tr -d ' ')" != "b700" ]; then
    echo "test-aarch64: build-aarch64/bucketd is not an aarch64 program" >&2
    exit 1
fi
echo "== aarch64 build under qemu: unit, stress and end-to-end tests"
# The long end-to-end suites run on the plain build only (tests/CMakeLists.txt, e2e_long).
(cd build-aarch64 && BUCKETD_TEST_STAGE=aarch64 ctest --output-on-failure --no-tests=error \
  -j "$test_jobs" -LE e2e_long)
