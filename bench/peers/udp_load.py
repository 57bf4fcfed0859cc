#!/usr/bin/python3
"""Small paced UDP sender of InfluxDB line-protocol readings, for trying the
peers before bucketd-sim exists (run_peer.sh takes any load command).

    udp_load.py --port PORT [--count 20000] [--rate 5000] [--sensors 100]
                [--per-datagram 1] [--record FILE] [--host 127.0.0.1]

Every reading is one line with a unique integer field seq, e.g.

    weather,sensor=s0042,site=roof temp=21.53,hum=40i,seq=17i 1736949600123000000

--rate is readings per second (0: as fast as possible); the sender paces in
1 ms steps and never sleeps between the datagrams of one step.  With
--per-datagram K, K lines go in one datagram separated by newlines.
--record FILE writes every line sent, one per line, so run_peer.sh can check
that the peer stored each one verbatim.

Prints one JSON line at the end:
    {"readings": N, "datagrams": D, "bytes": B, "elapsed_s": T, "rate": N/T, "send_errors": E}
"""

import argparse
import json
import socket
import sys
import time

BASE_NS = 1736949600 * 1_000_000_000  # 2025-01-15T14:00:00Z


def make_line(seq, sensors):
    sensor = seq % sensors
    site = ('roof', 'cellar', 'garage', 'lab')[sensor % 4]
    temp = 15.0 + (seq * 37 % 1000) / 100.0
    hum = 30 + seq % 50
    ts = BASE_NS + seq * 1_000_000
    return ('weather,sensor=s%04d,site=%s temp=%.2f,hum=%di,seq=%di %d'
            % (sensor, site, temp, hum, seq, ts)).encode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--host', default='127.0.0.1')
    ap.add_argument('--port', type=int, required=True)
    ap.add_argument('--count', type=int, default=20000)
    ap.add_argument('--rate', type=float, default=5000.0, help='readings/s, 0 = unpaced')
    ap.add_argument('--sensors', type=int, default=100)
    ap.add_argument('--per-datagram', type=int, default=1)
    ap.add_argument('--record', help='write every line sent to this file')
    args = ap.parse_args()
    if args.host not in ('127.0.0.1', 'localhost', '::1') and not args.host.startswith('127.'):
        ap.error('only loopback targets are allowed')
    per = max(1, args.per_datagram)

    lines = [make_line(i, max(1, args.sensors)) for i in range(args.count)]
    datagrams = [b'\n'.join(lines[i:i + per]) for i in range(0, len(lines), per)]
    if args.record:
        with open(args.record, 'wb') as f:
            for line in lines:
                f.write(line + b'\n')

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    addr = (args.host, args.port)
    sent_bytes = errors = 0
    step = 0.001
    dg_per_s = args.rate / per if args.rate > 0 else 0
    start = time.monotonic()
    i = 0
    n = len(datagrams)
    while i < n:
        if dg_per_s:
            due = int((time.monotonic() - start) * dg_per_s) + 1
            if due <= i:
                time.sleep(step)
                continue
            end = min(n, due)
        else:
            end = n
        while i < end:
            try:
                sent_bytes += sock.sendto(datagrams[i], addr)
            except OSError:
                errors += 1
            i += 1
    elapsed = time.monotonic() - start
    print(json.dumps({'readings': args.count, 'datagrams': n, 'bytes': sent_bytes,
                      'elapsed_s': round(elapsed, 3),
                      'rate': round(args.count / elapsed, 1) if elapsed > 0 else None,
                      'send_errors': errors}))
    sys.stdout.flush()


if __name__ == '__main__':
    main()
