#!/usr/bin/env bash
# Install the Debian packages bucketd needs to build, test and run its demo. Safe to re-run:
# packages already present are not touched, and apt is only called when something is missing.
# Run as root (or with sudo available) on Debian bookworm.
set -euo pipefail

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
  # promtool checks a real /metrics scrape (tests/e2e/test_metrics.py); Debian ships it in the
  # prometheus package (19 MB download, 96 MB installed, a few seconds). The tests use only
  # promtool; on a machine booted with systemd the package also starts a Prometheus server on
  # :9090 (systemctl disable --now prometheus if that is unwanted).
  prometheus
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
