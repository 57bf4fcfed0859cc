#!/bin/bash
# Runs inside a fresh Debian root (tools/test-packages.sh makes it with mmdebstrap: Essential
# packages, apt and mount, plus systemd and man-db for the "full" checks; the machine's own
# architecture, or arm64 under qemu), as root: installs the bucketd package as an operator would
# and checks the result.
#
#   check-installed.sh DEB VERSION [full|programs]
#
# dpkg -i (which leaves it unconfigured: its libraries are missing), apt-get -f install (which
# must install them, not remove bucketd); then bucketd --version and --check-config of the
# shipped config, the tools, the monitoring files, the man pages, the service neither enabled
# nor started, systemd-analyze verify of the installed unit, its systemd-analyze security
# exposure (at most 1.6), the sysctl drop-in and what the postinst did to net.core.rmem_max, a
# reinstall that keeps an edited conffile, and a purge. "programs" (a root without systemd and man-db: the
# arm64 one, where every package's scripts run under qemu) leaves out the man pages and the
# unit's checks, which are the same files in every architecture's package.
#
# The postinst would raise the machine's own net.core.rmem_max (the chroot shares the kernel):
# the configuration step runs in its own mount and network namespaces, with a file bound over
# /proc/sys/net/core/rmem_max holding the kernel's default, and the check reads that file.
set -euo pipefail
deb="$1"
version="$2"
mode="${3:-full}"
export DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8
failures=0
ok() { echo "  ok: $*"; }
fail() { echo "  FAILED: $*" >&2; failures=$((failures + 1)); }

echo "-- dpkg -i $(basename "$deb")"
if dpkg -i "$deb" >/tmp/dpkg-i.log 2>&1; then
    fail "dpkg -i succeeded without the libraries: does Depends name them?"
else
    grep -q 'dependency problems' /tmp/dpkg-i.log && ok "dpkg -i: dependencies missing, as expected" ||
        { cat /tmp/dpkg-i.log >&2; fail "dpkg -i failed for another reason"; }
fi

echo "-- apt-get -f install"
# mmdebstrap leaves its package lists in the root while its hooks run; elsewhere, fetch them.
if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
    apt-get update -q >/dev/null
fi
apt-get -f install -y -q --no-install-recommends --download-only >/dev/null
echo 212992 >/tmp/rmem_max
# Offline from here: the packages are in apt's cache.
# (/ of a chroot is no mount point: unshare leaves propagation alone, and /proc is made private
# before anything is mounted under it, so that the bind stays in this namespace.)
unshare --mount --propagation unchanged --net sh -c 'mount --make-rprivate /proc &&
    mount --bind /tmp/rmem_max /proc/sys/net/core/rmem_max &&
    apt-get -f install -y -q --no-install-recommends' >/tmp/apt-f.log 2>&1 ||
    { cat /tmp/apt-f.log >&2; fail "apt-get -f install"; }
status="$(dpkg-query -W -f='${Status} ${Version}' bucketd 2>/dev/null || true)"
if [ "$status" != "install ok installed $version" ]; then
    echo "check-installed: FAILED: after apt-get -f install, bucketd is '$status'" >&2
    exit 1
fi
ok "bucketd $version installed"
ok "Depends: $(dpkg-query -W -f='${Depends}' bucketd)"
# The first installation says which two keys to edit before the first start.
grep -q '^ *listeners\[\]\.bind ' /tmp/apt-f.log && grep -q '^ *mongodb\.uri ' /tmp/apt-f.log &&
    ok "the postinst names listeners[].bind and mongodb.uri to edit" ||
    fail "the postinst's message does not name listeners[].bind and mongodb.uri: $(cat /tmp/apt-f.log)"

echo "-- programs"
out="$(bucketd --version 2>&1)" || true
[ "$out" = "bucketd ${version%-*}" ] && ok "bucketd --version: $out" || fail "bucketd --version: '$out'"
# The shipped listeners bind a placeholder address that this root's host does not have:
# --check-config names the first one by its line. Then edited as an operator would (in place:
# the file keeps its owner and mode), the file passes.
conf=/etc/bucketd/bucketd.yaml
line="$(grep -n -m1 '^ *bind: "192\.168\.1\.10:' "$conf" | cut -d: -f1)"
if out="$(bucketd -c "$conf" --check-config 2>&1)"; then
    fail "--check-config passed the shipped placeholder address: $out"
else
    case "$out" in
    *"$conf:$line:"*"listeners[0].bind: \"192.168.1.10:"*"cannot be bound on this host"*)
        ok "--check-config of the shipped config names listeners[0].bind at line $line" ;;
    *) fail "--check-config of the shipped config: $out" ;;
    esac
fi
edited="$(sed 's/192\.168\.1\.10:/127.0.0.1:/' "$conf")"
printf '%s\n' "$edited" >"$conf"
out="$(bucketd -c "$conf" --check-config 2>&1)" &&
    ok "--check-config of the config with the listeners on 127.0.0.1: $out" ||
    fail "--check-config: $out"
for tool in bucketd-parse bucketd-sim bucketd-inspect; do
    "$tool" --help >/dev/null && ok "$tool --help" || fail "$tool --help"
done
out="$(echo 'weather,site=roof temp=21.5 1736949600000000000' | bucketd-parse 2>&1)" || true
case "$out" in
*'"temp"'*'"float":21.5'*) ok "bucketd-parse parses a line" ;;
*) fail "bucketd-parse: $out" ;;
esac

# The monitoring files: the rules for Prometheus, the dashboard for Grafana (README, "Alerts and
# a Grafana dashboard"); what they hold is checked by tests/e2e/test_monitoring.py.
grep -q '^ *- alert: BucketdDown$' /usr/share/bucketd/bucketd-rules.yml &&
    ok "/usr/share/bucketd/bucketd-rules.yml" || fail "no Prometheus rules in /usr/share/bucketd"
grep -q '"uid": "bucketd"' /usr/share/bucketd/bucketd-dashboard.json &&
    ok "/usr/share/bucketd/bucketd-dashboard.json" || fail "no dashboard in /usr/share/bucketd"

conffiles="$(dpkg-query -W -f='${Conffiles}' bucketd)"
case "$conffiles" in
*/etc/bucketd/bucketd.yaml*) ok "conffile: /etc/bucketd/bucketd.yaml" ;;
*) fail "/etc/bucketd/bucketd.yaml is not a conffile: '$conffiles'" ;;
esac
# It may hold the MongoDB password: the service's group reads it, other users do not.
getent passwd bucketd >/dev/null && getent group bucketd >/dev/null &&
    ok "system user and group bucketd" || fail "no system user or group bucketd"
perm="$(stat -c '%U:%G %a' /etc/bucketd/bucketd.yaml)"
[ "$perm" = "root:bucketd 640" ] && ok "/etc/bucketd/bucketd.yaml is $perm" ||
    fail "/etc/bucketd/bucketd.yaml is '$perm', not root:bucketd 640"
out="$(setpriv --reuid=bucketd --regid=bucketd --clear-groups \
    bucketd -c /etc/bucketd/bucketd.yaml --check-config 2>&1)" &&
    ok "user bucketd can read it: $out" || fail "user bucketd cannot check the config: $out"
out="$(setpriv --reuid=nobody --regid=nogroup --clear-groups cat /etc/bucketd/bucketd.yaml 2>&1 ||
    true)"
case "$out" in
*"Permission denied"*) ok "user nobody cannot read it" ;;
*) fail "user nobody reading /etc/bucketd/bucketd.yaml: '${out:0:200}'" ;;
esac

if [ "$mode" = full ]; then
    echo "-- man pages"
    for page in bucketd.8 bucketd.yaml.5 bucketd-metrics.7 bucketd-schema.7 bucketd-parse.1 \
        bucketd-inspect.1 bucketd-sim.1; do
        path="$(man -w "${page%.*}" "${page##*.}" 2>/dev/null || true)"
        warnings="$(man --warnings -E UTF-8 -l -Tutf8 -Z "$path" 2>&1 >/dev/null || true)"
        [ -n "$path" ] && [ -z "$warnings" ] && ok "man ${page%.*}(${page##*.}): $path" ||
            fail "man ${page%.*}(${page##*.}): '$path' $warnings"
    done

    echo "-- the service"
    unit=/lib/systemd/system/bucketd.service
    grep -q '^ExecStart=/usr/bin/bucketd ' "$unit" && ! grep -q /usr/local "$unit" &&
        ok "the unit runs /usr/bin/bucketd" || fail "the unit's paths: $(grep Exec "$unit")"
    enabled="$(systemctl is-enabled bucketd.service 2>/dev/null || true)"
    [ "$enabled" = disabled ] && ok "not enabled (systemctl is-enabled: $enabled)" ||
        fail "systemctl is-enabled: '$enabled', not disabled"
    if systemd-analyze verify "$unit" >/tmp/verify.log 2>&1 && [ ! -s /tmp/verify.log ]; then
        ok "systemd-analyze verify: no complaint"
    else
        cat /tmp/verify.log >&2
        fail "systemd-analyze verify $unit"
    fi
    systemd-analyze security --offline=true "$unit" >/tmp/security.log 2>&1 || true
    exposure="$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' /tmp/security.log)"
    if [ -n "$exposure" ] && awk -v e="$exposure" 'BEGIN { exit !(e <= 1.6) }'; then
        ok "systemd-analyze security: exposure $exposure (at most 1.6)"
    else
        tail -5 /tmp/security.log >&2
        fail "systemd-analyze security: exposure '$exposure', more than 1.6"
    fi

fi

echo "-- net.core.rmem_max"
dropin=/usr/lib/sysctl.d/60-bucketd.conf
want="$(sed -n 's/^net\.core\.rmem_max *= *\([0-9]*\)$/\1/p' "$dropin")"
[ -n "$want" ] && ok "$dropin sets net.core.rmem_max = $want" || fail "$dropin: no net.core.rmem_max"
# Every rcvbuf of the shipped config fits under it (sizes as the config writes them).
while read -r size; do
    bytes="$(echo "$size" | awk '/KiB$/ { print $0 * 1024; next } /MiB$/ { print $0 * 1048576; next }
        /GiB$/ { print $0 * 1073741824; next } { print $0 + 0 }')"
    [ "$bytes" -le "${want:-0}" ] && ok "rcvbuf $size of the shipped config fits" ||
        fail "rcvbuf $size of the shipped config is more than net.core.rmem_max $want"
done < <(sed -n 's/^ *rcvbuf: *\([0-9A-Za-z]*\).*/\1/p' /etc/bucketd/bucketd.yaml)
[ "$(cat /tmp/rmem_max)" = "$want" ] && ok "the postinst raised net.core.rmem_max from 212992 to $want" ||
    fail "after the postinst, net.core.rmem_max is $(cat /tmp/rmem_max), not $want"

echo "-- reinstall with an edited conffile, then purge"
echo "# edited by the operator" >>/etc/bucketd/bucketd.yaml
dpkg -i "$deb" >/tmp/dpkg-re.log 2>&1 || { cat /tmp/dpkg-re.log >&2; fail "dpkg -i again"; }
tail -1 /etc/bucketd/bucketd.yaml | grep -q 'edited by the operator' &&
    ok "the edited /etc/bucketd/bucketd.yaml is kept" || fail "the edited conffile was replaced"
perm="$(stat -c '%U:%G %a' /etc/bucketd/bucketd.yaml)"
[ "$perm" = "root:bucketd 640" ] && ok "and stays $perm" || fail "after reinstalling: '$perm'"
dpkg --purge bucketd >/tmp/purge.log 2>&1 || { cat /tmp/purge.log >&2; fail "dpkg --purge"; }
[ ! -e /etc/bucketd/bucketd.yaml ] && [ ! -e /usr/bin/bucketd ] && [ ! -e /usr/share/bucketd ] &&
    ok "purged" ||
    fail "files left after the purge"

if [ "$failures" -ne 0 ]; then
    echo "check-installed: $failures check(s) FAILED" >&2
    exit 1
fi
echo "check-installed: every check passed"
