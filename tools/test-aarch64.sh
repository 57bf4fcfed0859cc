#!/usr/bin/env bash
# Builds bucketd for aarch64 (arm64, the edge boxes' CPU) with Debian's cross compiler and runs
# the unit, stress and end-to-end tests on it under qemu user-mode emulation: the real arm64
# binaries (portable parser code, char unsigned, arm64 libmongoc/libuv/...) against the same
# test server. Build tree: build-aarch64/ under the repository root.
#
# What it needs from the machine, installed or set up here (as root or with sudo): the arm64
# architecture added to dpkg, gcc-aarch64-linux-gnu, qemu-user-static, the arm64 -dev packages,
# and a binfmt_misc entry that makes the kernel run aarch64 programs through qemu (Criterion and
# the end-to-end tests start the test programs themselves, so they must run like native ones).
# Where the packages cannot be installed (a mirror without arm64) or binfmt_misc cannot be set up
# (no privilege to mount or register it), the script says so and exits 0 without testing; any
# other failure (build, a test) fails the run.
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

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi

# --- Packages -------------------------------------------------------------------------------

arm_pkgs=(libmongoc-dev libbson-dev libuv1-dev libyaml-dev libxxhash-dev libsystemd-dev
          libcriterion-dev)
host_pkgs=(gcc-aarch64-linux-gnu qemu-user-static)
missing=()
for p in "${host_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$p")
done
for p in "${arm_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p:arm64" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$p:arm64")
done
if [ ${#missing[@]} -ne 0 ]; then
    echo "test-aarch64: installing ${missing[*]}"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        $sudo dpkg --add-architecture arm64
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! { $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends \
        "${missing[@]}"; }; then
        echo "test-aarch64: SKIPPED: the cross compiler or the arm64 packages cannot be" \
            "installed here (see apt's messages above)"
        exit 0
    fi
fi

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
    echo "test-aarch64: SKIPPED: cannot set up binfmt_misc for aarch64 here (needs root)"
    exit 0
fi

# --- Build and test -------------------------------------------------------------------------

cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE="$root/tools/aarch64-toolchain.cmake" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBD_WERROR=ON >/dev/null
cmake --build build-aarch64 -j "$jobs"
if [ "$(head -c 20 build-aarch64/bucketd | od -An -tx1 -j18 -N2 | tr -d ' ')" != "b700" ]; then
    echo "test-aarch64: build-aarch64/bucketd is not an aarch64 program" >&2
    exit 1
fi
echo "== aarch64 build under qemu: unit, stress and end-to-end tests"
(cd build-aarch64 && ctest --output-on-failure --no-tests=error)
