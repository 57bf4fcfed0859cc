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
#     /usr/bin paths, the sysctl.d drop-in, the man pages, copyright and changelog, the
#     Prometheus rules and Grafana dashboard in /usr/share/bucketd), maintainer
#     scripts that neither enable nor start the service;
#   - lintian: no error or warning (overrides in tools/packaging/bucketd.lintian-overrides, each with
#     its reason; informational tags are printed, not failed);
#   - installed into a fresh Debian root made by mmdebstrap --variant=apt (the Essential
#     packages and apt) of the machine's release from the machine's apt sources, in which
#     tests/packages/check-installed.sh runs dpkg -i, apt-get -f install and its checks: bucketd
#     --version, --check-config of the shipped config, the tools, the sysctl drop-in and the
#     postinst's net.core.rmem_max, a reinstall keeping an edited conffile, a purge. The amd64
#     root also gets systemd and man-db, for the man pages, systemctl is-enabled,
#     systemd-analyze verify and systemd-analyze security (exposure at most 1.6). The arm64 root
#     runs under qemu (the binfmt_misc entry tools/test-aarch64.sh registers), in the background
#     while the rest is checked: it is the slow part (about 90 s of CPU, every package's scripts
#     emulated), and its unit and man pages are the amd64 package's files.
#
#   BD_TEST_PACKAGES_INSTALL_ARM64=0   leave the arm64 root out (reported as a skip)
#
# What it needs, installed here when missing (as root): lintian, mmdebstrap, arch-test and
# dpkg-dev; the arm64 root also needs qemu-user-static with binfmt_misc. Where a package cannot
# be built or a root cannot be made (no aarch64 build tree, no root, the apt sources out of
# reach), the step says "SKIPPED" and why and appends the skip to BUCKETD_TEST_SKIP_LOG (stage
# "packages"), unless BUCKETD_TEST_REQUIRE_ALL=1 (CI), where it fails. A check that fails fails
# the run. The logs of the roots: build/test-packages-<arch>.log.
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

# tools/install-deps.sh --all (tools/test.sh runs it first) has installed these; run on its own,
# this installs what is missing, through tools/apt.sh (waits for apt's locks).
. "$root/tools/apt.sh"
bd_apt_install lintian mmdebstrap arch-test dpkg-dev

# The fresh roots: the machine's Debian release, from its own apt sources.
bd_apt_sources # codename, sources

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
    for lib in libc6 libmongoc-1.0-0 libbson-1.0-0 libuv1 libyaml-0-2 libxxhash0 libsystemd0 \
        libssl3; do
        grep -qE "(^|, )$lib( |,|$)" <<<"$field" || missing_libs+=" $lib"
    done
    [ -z "$missing_libs" ] && ok "Depends: $field" || fail "Depends '$field' lacks$missing_libs"
    [ "$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles)" = /etc/bucketd/bucketd.yaml ] &&
        ok "conffiles: /etc/bucketd/bucketd.yaml" || fail "conffiles is not /etc/bucketd/bucketd.yaml"
    local f
    for f in /usr/bin/bucketd /usr/bin/bucketd-parse /usr/bin/bucketd-inspect /usr/bin/bucketd-sim \
        /etc/bucketd/bucketd.yaml /lib/systemd/system/bucketd.service \
        /usr/lib/sysctl.d/60-bucketd.conf /usr/share/man/man8/bucketd.8.gz \
        /usr/share/man/man5/bucketd.yaml.5.gz /usr/share/man/man7/bucketd-metrics.7.gz \
        /usr/share/man/man7/bucketd-schema.7.gz \
        /usr/share/man/man1/bucketd-parse.1.gz /usr/share/man/man1/bucketd-inspect.1.gz \
        /usr/share/man/man1/bucketd-sim.1.gz /usr/share/doc/bucketd/copyright \
        /usr/share/doc/bucketd/changelog.Debian.gz /usr/share/bucketd/bucketd-rules.yml \
        /usr/share/bucketd/bucketd-dashboard.json; do
        grep -qx "$f" <<<"$contents" || fail "$f is not in the package"
    done
    if grep -q '^/usr/local' <<<"$contents"; then
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
    # (Comments and here-documents left out: the first-run message names the command to run.)
    postinst="$(dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./postinst | grep -v '^[[:space:]]*#' |
        sed '/<<-*EOF$/,/^[[:space:]]*EOF$/d')"
    if grep -Eq 'deb-systemd-invoke +(start|restart)|systemctl +(start|enable)' <<<"$postinst"; then
        fail "the postinst starts or enables the service"
    else
        ok "the postinst neither enables nor starts the service"
    fi
    grep -q 'postinst' <<<"$info" || fail "no postinst"
    # The unit's exposure, from this package's own file (the amd64 root checks it installed).
    if command -v systemd-analyze >/dev/null; then
        local exposure
        exposure="$(dpkg-deb --fsys-tarfile "$deb" | tar -xO ./lib/systemd/system/bucketd.service |
            { cat >"$tmp.service"; systemd-analyze security --offline=true "$tmp.service" 2>&1 || true; } |
            sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')"
        rm -f "$tmp.service"
        if [ -n "$exposure" ] && awk -v e="$exposure" 'BEGIN { exit !(e <= 1.6) }'; then
            ok "systemd-analyze security of its unit: exposure $exposure (at most 1.6)"
        else
            fail "systemd-analyze security of its unit: exposure '$exposure', more than 1.6"
        fi
    fi
    # lintian as root says so on stderr; that line is noise here.
    if lintian --display-info --fail-on error,warning "$deb" 2> >(grep -v 'running with root' >&2); then
        ok "lintian: no error or warning"
    else
        fail "lintian"
    fi
}

# --- Install into a fresh root ---------------------------------------------------------------

# Makes the root and runs the checks in it, output in build/test-packages-<arch>.log; the exit
# status says what happened: 0 passed, 1 a check failed, 2 no root could be made, 3 the apt
# sources cannot be reached.
install_test() { # deb, arch, mode (tests/packages/check-installed.sh)
    local deb="$1" arch="$2" mode="$3" version rc=0 include=""
    local log="$root/build/test-packages-$arch.log"
    version="$(dpkg-deb -f "$deb" Version)"
    # The smallest root apt works in (mmdebstrap's "apt" variant: the Essential packages and
    # apt), with mount for the checks' namespaces; systemd-analyze and man need their packages.
    include="--include=mount"
    [ "$mode" = full ] && include="--include=mount,systemd,man-db"
    mmdebstrap --variant=apt --arch="$arch" "$include" --quiet \
        --customize-hook="copy-in $deb $root/tests/packages/check-installed.sh /tmp" \
        --customize-hook="chroot \"\$1\" bash /tmp/check-installed.sh /tmp/$(basename "$deb") $version $mode" \
        "$codename" /dev/null "${sources[@]}" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        return 0
    elif grep -q '^check-installed:' "$log"; then
        return 1
    elif grep -qiE 'Temporary failure resolving|Could not resolve|Failed to fetch|Unable to connect' "$log"; then
        return 3
    fi
    return 2
}

# Prints what install_test found.
install_report() { # arch, its exit status, seconds
    local arch="$1" rc="$2"
    local log="$root/build/test-packages-$arch.log"
    echo "== package for $arch: installed into a fresh $codename root ($3 s)"
    grep -E '^(--|  ok:|  FAILED:|check-installed:)' "$log" || true
    case "$rc" in
    0) ;;
    1) fail "$arch: the installed package's checks (see $log)" ;;
    3)
        tail -5 "$log"
        skip "install-$arch" "the apt sources cannot be reached from here (see $log)"
        ;;
    *)
        tail -20 "$log" >&2
        fail "$arch: the fresh root could not be made (see $log)"
        ;;
    esac
}

can_make_roots=1
if [ "$(id -u)" -ne 0 ]; then
    can_make_roots=0
    why_no_roots="making a Debian root needs root"
elif [ -z "$codename" ] || [ ${#sources[@]} -eq 0 ]; then
    can_make_roots=0
    why_no_roots="no Debian release or apt sources on this machine"
fi

# --- Build both, install arm64 in the background, check amd64 meanwhile -----------------------

mkdir -p build
host_arch="$(dpkg --print-architecture)"
host_deb=""
arm_deb=""
if [ ! -x build/bucketd ]; then
    skip "$host_arch" "no build in build/ (tools/test.sh builds it first)"
else
    host_deb="$(build_deb build "$host_arch")" || fail "cpack in build/"
fi
if [ ! -x build-aarch64/bucketd ]; then
    skip arm64 "no aarch64 build in build-aarch64/ (tools/test-aarch64.sh makes it; see its skip)"
else
    arm_deb="$(build_deb build-aarch64 arm64)" || fail "cpack in build-aarch64/"
fi

# The arm64 root is the slow part (every package's scripts run under qemu): it runs while the
# rest is checked, and without systemd and man-db, whose checks are the amd64 root's (the same
# unit and pages).
arm_pid=""
# A run that ends early (a skip that fails under BUCKETD_TEST_REQUIRE_ALL) ends the arm64 root's
# mmdebstrap too, which would otherwise go on into the next stage.
stop_arm_job() {
    if [ -n "$arm_pid" ] && kill -0 "$arm_pid" 2>/dev/null; then
        pkill -TERM -P "$arm_pid" 2>/dev/null || true
        kill -TERM "$arm_pid" 2>/dev/null || true
        wait "$arm_pid" 2>/dev/null || true
    fi
}
trap stop_arm_job EXIT
if [ -n "$arm_deb" ] && [ "$can_make_roots" = 1 ]; then
    if [ "${BD_TEST_PACKAGES_INSTALL_ARM64:-1}" = 0 ]; then
        skip install-arm64 "not run: BD_TEST_PACKAGES_INSTALL_ARM64=0"
    elif [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
        skip install-arm64 "no binfmt_misc entry for aarch64 (tools/test-aarch64.sh makes it)"
    else
        arm_start=$SECONDS
        install_test "$arm_deb" arm64 programs &
        arm_pid=$!
    fi
fi

if [ -n "$host_deb" ]; then
    check_deb "$host_deb" "$host_arch"
    if [ "$can_make_roots" = 1 ]; then
        t0=$SECONDS
        rc=0
        install_test "$host_deb" "$host_arch" full || rc=$?
        install_report "$host_arch" "$rc" $((SECONDS - t0))
    else
        skip "install-$host_arch" "$why_no_roots"
    fi
fi
if [ -n "$arm_deb" ]; then
    check_deb "$arm_deb" arm64
    if [ -n "$arm_pid" ]; then
        rc=0
        wait "$arm_pid" || rc=$?
        install_report arm64 "$rc" $((SECONDS - arm_start))
    elif [ "$can_make_roots" != 1 ]; then
        skip install-arm64 "$why_no_roots"
    fi
fi

echo "test-packages: $((SECONDS - start)) s"
if [ "$failures" -ne 0 ]; then
    echo "test-packages: $failures check(s) FAILED" >&2
    exit 1
fi
echo "test-packages: both packages passed"
