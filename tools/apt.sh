# Sourced, not run: the one way bucketd's scripts call apt. tools/install-deps.sh installs
# everything the test command needs before any stage starts, so the stages find their packages
# present and never call apt at all; where a stage still has to (the arm64 downloads of
# tools/test-aarch64.sh, a script run on its own), it goes through bd_apt_get, which
#   - takes /var/lock/bucketd-apt.lock first, so two of bucketd's own scripts never run apt at
#     the same time (tools/test.sh runs the package checks beside the fuzzing);
#   - waits for apt's and dpkg's own locks, held by another program (unattended-upgrades, an
#     operator's apt), rather than failing: dpkg's lock through DPkg::Lock::Timeout, and the
#     lists lock of `apt-get update`, which that option does not cover, by trying again while
#     apt says "Could not get lock", for up to BD_APT_WAIT seconds (default 900).
#
#   . tools/apt.sh
#   bd_apt_install PKG...      # installs those of PKG... not installed yet (one update first)
#   bd_apt_get ARGS...         # apt-get ARGS..., as root (sudo when not root), waiting for locks
#   bd_apt_sources             # sets codename (this machine's Debian release) and sources (its
#                              # apt source files): what a fresh root of this release is made from

BD_APT_SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    BD_APT_SUDO="sudo"
fi
BD_APT_UPDATED=0

bd_apt_get() { # apt-get arguments...
    local - # the options set here end with the function
    set -o pipefail
    local wait="${BD_APT_WAIT:-900}" start=$SECONDS errlog rc
    errlog="$(mktemp)"
    while :; do
        # stderr is shown as it comes and kept to tell a lock held elsewhere from a real failure.
        rc=0
        { $BD_APT_SUDO env DEBIAN_FRONTEND=noninteractive \
            flock /var/lock/bucketd-apt.lock \
            apt-get -o DPkg::Lock::Timeout=60 "$@" 2>&1 1>&3 | tee "$errlog" >&2; } 3>&1 || rc=$?
        if [ "$rc" -eq 0 ] || ! grep -q "Could not get lock" "$errlog" ||
            [ $((SECONDS - start)) -ge "$wait" ]; then
            rm -f "$errlog"
            return "$rc"
        fi
        echo "apt: a lock is held by another program; trying again in 5 s" >&2
        sleep 5
    done
}

bd_apt_missing() { # packages... -> prints those not installed
    local p
    for p in "$@"; do
        if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != *"install ok installed"* ]]; then
            echo "$p"
        fi
    done
}

bd_apt_install() { # packages...
    local missing
    mapfile -t missing < <(bd_apt_missing "$@")
    if [ ${#missing[@]} -eq 0 ]; then
        return 0
    fi
    echo "apt: installing ${missing[*]}"
    if [ "$BD_APT_UPDATED" -eq 0 ]; then
        bd_apt_get update -q
        BD_APT_UPDATED=1
    fi
    bd_apt_get install -y -q --no-install-recommends "${missing[@]}"
}

bd_apt_sources() { # sets codename and the array sources
    local f
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    sources=()
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources; do
        if [ -s "$f" ]; then
            sources+=("$f")
        fi
    done
}
