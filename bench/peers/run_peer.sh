#!/usr/bin/env bash
# Run rsyslog or syslog-ng under a UDP load into the MongoDB stand-in (or
# $MONGODB_URI) and print one JSON line with what was sent and stored.
#
#   bench/peers/run_peer.sh rsyslog|syslog-ng --load-cmd "CMD" [--db NAME]
#
# CMD is run with bash; {PORT} becomes the peer's UDP port and {SENT} (if
# used) a file for the lines it sends.  See run_peer.py for every option and
# every field of the result, and README.md for the method.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f "$HERE/.root/env.sh" ]; then
    bash "$HERE/setup.sh" >&2
fi
# Debian's pymongo is only visible to Debian's python.
exec /usr/bin/python3 "$HERE/run_peer.py" "$@"
