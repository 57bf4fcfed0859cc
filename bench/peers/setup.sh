#!/usr/bin/env bash
# Fetch the peer daemons (rsyslog and syslog-ng, both from Debian) without
# installing them: their .debs go to bench/peers/.cache/ and each daemon is
# unpacked with `dpkg -x` into bench/peers/.root/<name>/.  They both want to
# be the system logger and conflict as packages, so neither is ever installed
# and neither is ever started as the machine's logger; run_peer.sh runs them
# as ordinary foreground processes with private configs.
#
# Plain library packages they link against (libestr0, libfastjson4,
# liblognorm5, libivykis0, libnet1, libwrap0, ...) are installed with apt-get
# when missing and we are root; otherwise (or with PEERS_NO_APT_INSTALL=1)
# they are unpacked too, into .root/libs/, which run_peer.sh puts on
# LD_LIBRARY_PATH.
#
# As root it runs `apt-get update` first (PEERS_NO_APT_UPDATE=1 skips that): package lists
# older than the mirror name versions it no longer serves.
#
# Idempotent: a .deb already in the cache is not fetched again and a tree
# already unpacked from the same .debs is left alone.  At the end it prints
# where the binaries and module folders are and writes them to .root/env.sh.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=$HERE/.cache
ROOT=$HERE/.root

PEERS=(rsyslog syslog-ng)
declare -A PEER_PKGS=(
    [rsyslog]="rsyslog rsyslog-mongodb"
    [syslog-ng]="syslog-ng-core syslog-ng-mod-mongodb"
)

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

command -v apt-get >/dev/null || die "needs apt-get and dpkg (Debian)"
command -v dpkg >/dev/null || die "needs dpkg"

mkdir -p "$CACHE" "$ROOT"
# apt's download sandbox user must be able to write here, or apt-get prints
# a warning for every file.
chmod 0777 "$CACHE" 2>/dev/null || true

is_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}

# Candidate "version architecture" of each package we may fetch, from one
# apt-cache call (each call reads the whole package list: about a second).
declare -A CANDIDATE=()
load_candidates() {
    local pkg="" ver="" line
    while IFS= read -r line; do
        case "$line" in
            "Package: "*) pkg=${line#Package: } ;;
            "Version: "*) ver=${line#Version: } ;;
            "Architecture: "*) [ -n "$pkg" ] && CANDIDATE[$pkg]="$ver ${line#Architecture: }" ;;
        esac
    done < <(apt-cache show --no-all-versions "$@" 2>/dev/null || true)
}

# The .deb file name apt-get download gives the candidate of PKG.
deb_name() {
    local pkg=$1 ver arch
    read -r ver arch <<<"${CANDIDATE[$pkg]:-}"
    if [ -z "$ver" ] || [ -z "$arch" ]; then die "no candidate for package $pkg"; fi
    printf '%s_%s_%s.deb' "$pkg" "${ver//:/%3a}" "$arch"
}

# Download PKG's candidate .deb into the cache unless it is there; print its path.
fetch() {
    local pkg=$1 name
    name=$(deb_name "$pkg")
    if [ ! -s "$CACHE/$name" ]; then
        log "downloading $pkg"
        (cd "$CACHE" && apt-get download -qq "$pkg" >/dev/null 2>&1) ||
            (cd "$CACHE" && apt-get download "$pkg") || die "apt-get download $pkg failed"
        [ -s "$CACHE/$name" ] || die "apt-get download $pkg did not produce $name"
    fi
    printf '%s\n' "$CACHE/$name"
}

# Unpack the .debs given after NAME into .root/NAME unless the tree there was
# unpacked from exactly these files.
extract() {
    local name=$1; shift
    local dest=$ROOT/$name stamp want
    stamp=$dest/.unpacked-from
    want=$(for d in "$@"; do basename "$d"; done | sort)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return
    fi
    log "unpacking into ${dest#"$HERE"/}"
    rm -rf "$dest"
    mkdir -p "$dest"
    for d in "$@"; do
        dpkg -x "$d" "$dest"
    done
    printf '%s\n' "$want" >"$stamp"
}

# Library packages the given packages depend on directly (every alternative
# that is a real package; virtual names, and helpers such as lsb-base that
# only init scripts use, are left out: nothing here runs init scripts).
lib_deps() {
    apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "$@" 2>/dev/null |
        sed -n 's/^ *|\{0,1\}Depends: \([^<> ]*\)$/\1/p' |
        grep -E '^(lib|zlib)' | sort -u
}

# The missing ones, with their own missing library dependencies.
missing_libs() {
    local todo seen=" " out=() p
    todo=$(lib_deps "$@")
    while [ -n "$todo" ]; do
        local next=""
        for p in $todo; do
            case "$seen" in *" $p "*) continue ;; esac
            seen="$seen$p "
            if ! is_installed "$p"; then
                out+=("$p")
                next="$next $(lib_deps "$p" | tr '\n' ' ')"
            fi
        done
        todo=$next
    done
    [ ${#out[@]} -eq 0 ] || printf '%s\n' "${out[@]}" | sort -u
}

all_pkgs=""
for peer in "${PEERS[@]}"; do
    all_pkgs="$all_pkgs ${PEER_PKGS[$peer]}"
done
# shellcheck disable=SC2086
load_candidates $all_pkgs
if [ "$(id -u)" = 0 ] && [ "${PEERS_NO_APT_UPDATE:-0}" != 1 ]; then
    # Lists that name versions the mirror no longer has make every download fail ("Unable to
    # fetch some archives"): refresh them first when we may.
    log "apt-get update"
    apt-get update -qq
    # shellcheck disable=SC2086
    load_candidates $all_pkgs
fi
if [ ${#CANDIDATE[@]} -lt 4 ]; then
    # The package lists are missing or stale on a fresh machine.
    [ "$(id -u)" = 0 ] || die "no candidates for $all_pkgs; run 'apt-get update' as root"
    log "apt-get update"
    apt-get update -qq
    # shellcheck disable=SC2086
    load_candidates $all_pkgs
    [ ${#CANDIDATE[@]} -ge 4 ] || die "Debian does not offer all of:$all_pkgs"
fi
# shellcheck disable=SC2086
missing=$(missing_libs $all_pkgs)

if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ] && [ "${PEERS_NO_APT_INSTALL:-0}" != 1 ]; then
        log "installing libraries: ${missing//$'\n'/ }"
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            $missing >/dev/null
    else
        log "unpacking libraries privately: ${missing//$'\n'/ }"
        # shellcheck disable=SC2086
        load_candidates $missing
        debs=()
        for p in $missing; do
            debs+=("$(fetch "$p")")
        done
        extract libs "${debs[@]}"
    fi
fi

for peer in "${PEERS[@]}"; do
    debs=()
    for p in ${PEER_PKGS[$peer]}; do
        debs+=("$(fetch "$p")")
    done
    extract "$peer" "${debs[@]}"
done

# Locate what run_peer.sh needs.
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null ||
            echo x86_64-linux-gnu)
R=$ROOT/rsyslog
S=$ROOT/syslog-ng
rsyslogd=$R/usr/sbin/rsyslogd
rsyslog_moddir=$R/usr/lib/$multiarch/rsyslog
syslog_ng=$S/usr/sbin/syslog-ng
mongo_mod=$(find "$S/usr/lib" -name 'libafmongodb.so' | head -n1)
core_lib=$(find "$S/usr/lib" -name 'libsyslog-ng-*.so.*' | head -n1)
[ -n "$mongo_mod" ] || die "syslog-ng's mongodb module (libafmongodb.so) not found in $S"
[ -n "$core_lib" ] || die "libsyslog-ng not found in $S"
syslog_ng_moddir=$(dirname "$mongo_mod")
syslog_ng_libdir=$(dirname "$core_lib")
[ -x "$rsyslogd" ] || die "rsyslogd not found in $R"
[ -f "$rsyslog_moddir/ommongodb.so" ] || die "ommongodb.so not found in $rsyslog_moddir"
[ -f "$rsyslog_moddir/imudp.so" ] || die "imudp.so not found in $rsyslog_moddir"
[ -x "$syslog_ng" ] || die "syslog-ng not found in $S"

ld_path=$syslog_ng_libdir
if [ -d "$ROOT/libs" ]; then
    ld_path=$ROOT/libs/usr/lib/$multiarch:$ROOT/libs/lib/$multiarch:$ld_path
fi

cat >"$ROOT/env.sh" <<EOF
# Written by setup.sh: where the unpacked peers are.
RSYSLOGD='$rsyslogd'
RSYSLOG_MODDIR='$rsyslog_moddir'
SYSLOG_NG='$syslog_ng'
SYSLOG_NG_MODDIR='$syslog_ng_moddir'
PEERS_LD_LIBRARY_PATH='$ld_path'
EOF

rs_ver=$(LD_LIBRARY_PATH=$ld_path "$rsyslogd" -v 2>/dev/null | head -n1 || true)
sn_ver=$(LD_LIBRARY_PATH=$ld_path "$syslog_ng" --version 2>/dev/null | head -n1 || true)
cat <<EOF
rsyslog:   $rsyslogd
           ${rs_ver:-(version unknown)}
           modules: $rsyslog_moddir
syslog-ng: $syslog_ng
           ${sn_ver:-(version unknown)}
           modules: $syslog_ng_moddir
LD_LIBRARY_PATH for the peers: $ld_path
(also written to ${ROOT#"$HERE"/}/env.sh)
EOF
