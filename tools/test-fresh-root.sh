#!/usr/bin/env bash
# Runs the test command the way a newcomer meets it: in a fresh Debian root with nothing but the
# Essential packages and apt (mmdebstrap --variant=apt, the machine's release from its own apt
# sources), holding a copy of this source tree and of ../shared beside it. Everything the tests
# need must come from tools/install-deps.sh, which the test command runs first; a package a
# stage forgot, or two stages calling apt at once, fails here where a machine that already has
# the packages would not notice. Not a stage of tools/test.sh (it repeats the whole run); run it
# when what the test command installs changes. Needs root (mmdebstrap, chroot, mounts).
#
#   bash tools/test-fresh-root.sh [COMMAND]    # default COMMAND: bash .ci/run
#
# The root is made in build-fresh-root/ under the repository root (removed and remade each run);
# the run's output goes to build-fresh-root/run.log as well as to the terminal.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cmd="${1:-bash .ci/run}"

if [ "$(id -u)" -ne 0 ]; then
    echo "test-fresh-root: needs root (mmdebstrap, chroot and mounts)" >&2
    exit 2
fi
. tools/apt.sh
bd_apt_install mmdebstrap

bd_apt_sources # codename, sources
if [ -z "$codename" ] || [ ${#sources[@]} -eq 0 ]; then
    echo "test-fresh-root: no Debian release or apt sources on this machine" >&2
    exit 2
fi

dir="$root/build-fresh-root"
mounts=()
cleanup() {
    local i
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount -l "${mounts[i]}" 2>/dev/null || true
    done
}
trap cleanup EXIT

if mountpoint -q "$dir/proc" 2>/dev/null; then
    echo "test-fresh-root: $dir is in use (its /proc is mounted)" >&2
    exit 2
fi
rm -rf "$dir"
echo "== a fresh $codename root in $dir"
mmdebstrap --variant=apt --quiet "$codename" "$dir" "${sources[@]}"

# The source tree as a clean clone has it (tracked files only when git is here), and ../shared.
mkdir -p "$dir/src/main" "$dir/src/shared"
if command -v git >/dev/null && git -C "$root" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$root" ls-files -z | (cd "$root" && xargs -0 tar -cf - --no-recursion) |
        tar -xf - -C "$dir/src/main"
else
    tar -C "$root" --exclude='./build*' -cf - . | tar -xf - -C "$dir/src/main"
fi
if [ -d "$root/../shared" ]; then
    tar -C "$root/../shared" -cf - . | tar -xf - -C "$dir/src/shared"
fi
cp /etc/resolv.conf "$dir/etc/resolv.conf"

for m in proc sys dev dev/pts dev/shm; do
    mkdir -p "$dir/$m"
    case "$m" in
    proc) mount -t proc proc "$dir/proc" ;;
    sys) mount -t sysfs sysfs "$dir/sys" ;;
    dev/shm) mount -t tmpfs tmpfs "$dir/dev/shm" ;;
    *) mount --bind "/$m" "$dir/$m" ;;
    esac
    mounts+=("$dir/$m")
done

echo "== in the root: $cmd"
start=$SECONDS
rc=0
chroot "$dir" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TERM=dumb LANG=C.UTF-8 bash -c "cd /src/main && $cmd" 2>&1 | tee "$dir/run.log" ||
    rc=$?
echo "== test-fresh-root: '$cmd' exited $rc after $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
exit "$rc"
