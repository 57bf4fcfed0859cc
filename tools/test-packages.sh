#!/usr/bin/env bash
# Builds bucketd's Debian packages and checks them: the amd64 one from build/ (any build tree
# configured with plain `cmake -S . -B build` makes it with `cpack -G DEB`), the arm64 one from
# the cross build in build-aarch64/ (tools/test-aarch64.sh makes that tree and its sysroot).
# tools/test.sh runs this after the aarch64 stage; by hand, after building both trees:
#
#   bash tools/test-packages.sh
#
# For each package:
#   - dpkg-deb --info/--contents: architecture, Depends (from dpkg-shlibdeps), the conffile, the
#     files where Debian wants them (binaries in /usr/bin, the unit in /lib/systemd/system with
#     /usr/bin paths, the sysctl.d drop-in, the man pages, copyright and changelog), maintainer
#     scripts that neither enable nor start the service;
#   - lintian: no error or warning (overrides in packaging/bucketd.lintian-overrides, each with
#     its reason; informational tags are printed, not failed);
#   - installed into a fresh Debian root: mmdebstrap --variant=minbase (plus systemd and man-db,
#     which systemd-analyze needs) of the machine's release, from the machine's apt sources, in
#     which tests/packages/check-installed.sh runs dpkg -i, apt-get -f install and the checks
#     (bucketd --version, --check-config of the shipped config, systemd-analyze verify and
#     security, the sysctl drop-in, a reinstall keeping an edited conffile, a purge). The arm64
#     root runs under qemu (the binfmt_misc entry tools/test-aarch64.sh registers).
#
# What it needs, installed here when missing (as root): lintian, mmdebstrap, arch-test; the arm64
# root also needs qemu-user-static with binfmt_misc. Where the packages cannot be built or a
# root cannot be made (no aarch64 build tree, no network to the apt sources, no root), the step
# says "SKIPPED" and why and appends the skip to BUCKETD_TEST_SKIP_LOG (stage "packages"),
# unless BUCKETD_TEST_REQUIRE_ALL=1 (CI), where it fails. A check that fails fails the run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export DEBIAN_FRONTEND=noninteractive
start=$SECONDS
failures=0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
skip() { # what, reason
    if [ "${BUCKETD_TEST_REQUIRE_ALL:-0}" = "1" ]; then
        echo "test-packages: FAILED: $1 cannot run: $2 (BUCKETD_TEST_REQUIRE_ALL=1)" >&2
        exit 1
    fi
    echo "test-packages: SKIPPED: $1: $2"
    if [ -n "${BUCKETD_TEST_SKIP_LOG:-}" ]; then
        printf 'packages\ttools/test-packages.sh:%s\t%s\n' "$1" "$2" >>"$BUCKETD_TEST_SKIP_LOG"
    fi
}
ok() { echo "  ok: $*"; }
fail() {
    echo "  FAILED: $*" >&2
    failures=$((failures + 1))
}

missing=()
for p in lintian mmdebstrap arch-test dpkg-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$p")
done
if [ ${#missing[@]} -ne 0 ]; then
    echo "test-packages: installing ${missing[*]}"
    $sudo apt-get update -q
    $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The fresh roots: the machine's Debian release, from its own apt sources.
codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    if [ -s "$f" ]; then
        sources+=("$f")
    fi
done

# --- Build ---------------------------------------------------------------------------------

build_deb() { # build dir, arch -> prints the package's path
    local dir="$1" arch="$2"
    rm -f "$dir"/bucketd_*_"$arch".deb
    (cd "$dir" && cpack -G DEB >cpack.log 2>&1) || { cat "$dir/cpack.log" >&2; return 1; }
    ls "$dir"/bucketd_*_"$arch".deb
}

# --- Static checks: control fields, files, lintian -----------------------------------------

check_deb() { # deb, arch
    local deb="$1" arch="$2" info contents field
    echo "== package $(basename "$deb"): contents and lintian"
    info="$(dpkg-deb --info "$deb")"
    contents="$(dpkg-deb --contents "$deb" | awk '{ print $NF }' | sed 's|^\./|/|')"
    field="$(dpkg-deb -f "$deb" Architecture)"
    [ "$field" = "$arch" ] && ok "Architecture: $arch" || fail "Architecture: '$field', not $arch"
    field="$(dpkg-deb -f "$deb" Depends)"
    local lib missing_libs=""
    for lib in libc6 libmongoc-1.0-0 libbson-1.0-0 libuv1 libyaml-0-2 libxxhash0 libsystemd0; do
        echo "$field" | grep -qE "(^|, )$lib( |,|$)" || missing_libs+=" $lib"
    done
    [ -z "$missing_libs" ] && ok "Depends: $field" || fail "Depends '$field' lacks$missing_libs"
    [ "$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)" = /etc/bucketd/bucketd.yaml ] &&
        ok "conffiles: /etc/bucketd/bucketd.yaml" || fail "conffiles is not /etc/bucketd/bucketd.yaml"
    local f
    for f in /usr/bin/bucketd /usr/bin/bucketd-parse /usr/bin/bucketd-inspect /usr/bin/bucketd-sim \
        /etc/bucketd/bucketd.yaml /lib/systemd/system/bucketd.service \
        /usr/lib/sysctl.d/60-bucketd.conf /usr/share/man/man8/bucketd.8.gz \
        /usr/share/man/man1/bucketd-parse.1.gz /usr/share/man/man1/bucketd-inspect.1.gz \
        /usr/share/man/man1/bucketd-sim.1.gz /usr/share/doc/bucketd/copyright \
        /usr/share/doc/bucketd/changelog.Debian.gz; do
        echo "$contents" | grep -qx "$f" || fail "$f is not in the package"
    done
    if echo "$contents" | grep -q '^/usr/local'; then
        fail "files under /usr/local: $(echo "$contents" | grep '^/usr/local' | tr '\n' ' ')"
    fi
    ok "$(echo "$contents" | grep -vc '/$') files, each where expected"
    local tmp
    tmp="$(mktemp -d)"
    dpkg-deb -x "$deb" "$tmp"
    local machine want_machine=b700
    [ "$arch" = amd64 ] && want_machine=3e00
    machine="$(od -An -tx1 -j18 -N2 "$tmp/usr/bin/bucketd" | tr -d ' ')"
    [ "$machine" = "$want_machine" ] && ok "/usr/bin/bucketd is an $arch program" ||
        fail "/usr/bin/bucketd's ELF machine is $machine, not $want_machine"
    grep -q '^ExecStart=/usr/bin/bucketd ' "$tmp/lib/systemd/system/bucketd.service" &&
        ! grep -q /usr/local "$tmp/lib/systemd/system/bucketd.service" &&
        ok "the unit names /usr/bin/bucketd" || fail "the unit's paths are not /usr/bin"
    rm -rf "$tmp"
    # Installing must neither enable nor start the service (README, "Building and installing").
    local postinst
    postinst="$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./postinst)"
    if echo "$postinst" | grep -Eq 'deb-systemd-invoke +(start|restart)|systemctl +(start|enable)'; then
        fail "the postinst starts or enables the service"
    else
        ok "the postinst neither enables nor starts the service"
    fi
    echo "$info" | grep -q 'postinst' || fail "no postinst"
    # lintian as root says so on stderr; that line is noise here.
    if lintian --display-info --fail-on error,warning "$deb" 2> >(grep -v 'running with root' >&2); then
        ok "lintian: no error or warning"
    else
        fail "lintian"
    fi
}

# --- Install into a fresh root ---------------------------------------------------------------

install_test() { # deb, arch
    local deb="$1" arch="$2" t0=$SECONDS version
    version="$(dpkg-deb -f "$deb" Version)"
    echo "== package $(basename "$deb"): installed into a fresh $codename $arch root"
    if [ "$(id -u)" -ne 0 ]; then
        skip "install-$arch" "making a Debian root needs root"
        return 0
    fi
    if [ -z "$codename" ] || [ ${#sources[@]} -eq 0 ]; then
        skip "install-$arch" "no Debian release or apt sources on this machine"
        return 0
    fi
    local log="$root/build/test-packages-$arch.log" rc=0
    mmdebstrap --variant=minbase --arch="$arch" --include=systemd,man-db --quiet \
        --customize-hook="copy-in $deb $root/tests/packages/check-installed.sh /tmp" \
        --customize-hook="chroot \"\$1\" bash /tmp/check-installed.sh /tmp/$(basename "$deb") $version" \
        "$codename" /dev/null "${sources[@]}" >"$log" 2>&1 || rc=$?
    # The checks' own lines; mmdebstrap's on failure.
    grep -E '^(--|  ok:|  FAILED:|check-installed:)' "$log" || true
    if [ "$rc" -ne 0 ]; then
        if grep -q '^check-installed:' "$log"; then
            fail "$arch: installed package checks (see $log)"
        elif grep -qiE 'Temporary failure resolving|Could not resolve|Failed to fetch|failed to download|apt-get update.*failed' "$log"; then
            tail -5 "$log"
            skip "install-$arch" "the apt sources cannot be reached from here (see $log)"
        else
            tail -20 "$log" >&2
            fail "$arch: the fresh root could not be made (see $log)"
        fi
    fi
    echo "  ($arch root: $((SECONDS - t0)) s)"
}

# --- amd64 ------------------------------------------------------------------------------------

host_arch="$(dpkg --print-architecture)"
if [ ! -x build/bucketd ]; then
    skip "$host_arch" "no build in build/ (tools/test.sh builds it first)"
else
    deb="$(build_deb build "$host_arch")" || { fail "cpack in build/"; deb=""; }
    if [ -n "$deb" ]; then
        check_deb "$deb" "$host_arch"
        install_test "$deb" "$host_arch"
    fi
fi

# --- arm64 (the cross build) --------------------------------------------------------------------

if [ ! -x build-aarch64/bucketd ]; then
    skip arm64 "no aarch64 build in build-aarch64/ (tools/test-aarch64.sh makes it; see its skip)"
else
    deb="$(build_deb build-aarch64 arm64)" || { fail "cpack in build-aarch64/"; deb=""; }
    if [ -n "$deb" ]; then
        check_deb "$deb" arm64
        if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
            skip install-arm64 "no binfmt_misc entry for aarch64 (tools/test-aarch64.sh makes it)"
        else
            install_test "$deb" arm64
        fi
    fi
fi

echo "test-packages: $((SECONDS - start)) s"
if [ "$failures" -ne 0 ]; then
    echo "test-packages: $failures check(s) FAILED" >&2
    exit 1
fi
