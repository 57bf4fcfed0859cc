#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Counting TCP proxy: measures the bytes a client puts on the wire to a server.

    /usr/bin/python3 bench/count_proxy.py --target HOST:PORT [--listen HOST:PORT] [--writes]

Listens on 127.0.0.1 (a free port unless --listen gives one), forwards every
connection to --target unchanged, and counts the bytes and wire-protocol
messages going each way.  Prints {"ready":true,"port":P} on one line to stdout
once it accepts connections; on SIGTERM or SIGINT it closes everything and
prints the totals as a second JSON line:

    {"connections":N,"c2s_bytes":B,"s2c_bytes":B,"c2s_messages":M,"s2c_messages":M}

Messages are counted by MongoDB's wire framing (each message starts with its
little-endian int32 length), so c2s_messages is the number of requests (bulk
writes, handshakes, heartbeats).  With --writes each client request that is an
update command (OP_MSG) is also decoded, and the totals gain a list "writes" of
{"t": seconds since start, "bytes": message size, "updates": statements,
"readings": readings appended}: readings are counted in bucketd's update
pipeline (the length of stage 1's $set._n.$literal array), so the bench suite
can tell the flush cycles apart on the wire.  The bench suite runs it between bucketd and
the MongoDB stand-in: bytes client->server divided by readings flushed is the
wire cost of a reading.  Two threads per connection, one per direction; each
count has one writer and is summed at the end.
"""

import argparse
import json
import signal
import socket
import struct
import sys
import threading
import time


OP_MSG = 2013


def bulk_update_summary(msg):
    """(statements, readings) of an OP_MSG update command, or None for anything else."""
    import bson
    if len(msg) < 21 or struct.unpack_from('<i', msg, 12)[0] != OP_MSG:
        return None
    flags = struct.unpack_from('<I', msg, 16)[0]
    end = len(msg) - (4 if flags & 1 else 0)
    i = 20
    body = None
    seqs = {}
    while i < end:
        kind = msg[i]
        i += 1
        if kind == 0:
            size = struct.unpack_from('<i', msg, i)[0]
            body = bson.decode(bytes(msg[i:i + size]))
            i += size
        elif kind == 1:
            size = struct.unpack_from('<i', msg, i)[0]
            stop = i + size
            j = msg.index(b'\0', i + 4)
            ident = bytes(msg[i + 4:j]).decode()
            j += 1
            docs = []
            while j < stop:
                dsize = struct.unpack_from('<i', msg, j)[0]
                docs.append(bson.decode(bytes(msg[j:j + dsize])))
                j += dsize
            seqs[ident] = docs
            i = stop
        else:
            return None
    if body is None or 'update' not in body:
        return None
    stmts = seqs.get('updates', body.get('updates', []))
    readings = 0
    for st in stmts:
        try:
            readings += len(st['u'][0]['$set']['_n']['$literal'])
        except (KeyError, IndexError, TypeError):
            pass
    return len(stmts), readings


class Pump(object):
    """Copies one direction of one connection and counts it."""

    def __init__(self, src, dst, writes=None, t0=0.0):
        self.src = src
        self.dst = dst
        self.bytes = 0
        self.messages = 0
        self.writes = writes    # list to append decoded update commands to, or None
        self.t0 = t0
        self._need = 0          # bytes left in the current message
        self._hdr = b''         # partial length prefix
        self._msg = bytearray()

    def _done(self):
        try:
            s = bulk_update_summary(self._msg)
        except Exception:  # a message we cannot decode is only not itemised
            s = None
        if s is not None:
            self.writes.append({'t': round(time.monotonic() - self.t0, 4),
                                'bytes': len(self._msg), 'updates': s[0], 'readings': s[1]})
        self._msg = bytearray()

    def _frame(self, data):
        i = 0
        n = len(data)
        while i < n:
            if self._need > 0:
                take = min(self._need, n - i)
                if self.writes is not None:
                    self._msg += data[i:i + take]
                self._need -= take
                i += take
                if self._need == 0 and self.writes is not None:
                    self._done()
                continue
            want = 4 - len(self._hdr)
            self._hdr += data[i:i + want]
            i += min(want, n - i)
            if len(self._hdr) == 4:
                length = struct.unpack('<i', self._hdr)[0]
                if self.writes is not None:
                    self._msg = bytearray(self._hdr)
                self._hdr = b''
                self.messages += 1
                self._need = max(length - 4, 0)

    def run(self):
        try:
            while True:
                data = self.src.recv(1 << 16)
                if not data:
                    break
                self.bytes += len(data)
                self._frame(data)
                self.dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (self.dst, self.src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def parse_addr(s):
    host, _, port = s.rpartition(':')
    return host.strip('[]') or '127.0.0.1', int(port)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--target', required=True, help='HOST:PORT of the server')
    ap.add_argument('--listen', default='127.0.0.1:0', help='HOST:PORT to listen on')
    ap.add_argument('--writes', action='store_true', help='itemise update commands')
    args = ap.parse_args()
    target = parse_addr(args.target)

    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(parse_addr(args.listen))
    lsock.listen(64)

    pumps = []
    socks = []
    writes = []
    t0 = time.monotonic()
    lock = threading.Lock()
    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()
        try:
            lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        lsock.close()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    print(json.dumps({'ready': True, 'port': lsock.getsockname()[1]}), flush=True)

    connections = 0
    while not stopping.is_set():
        try:
            client, _ = lsock.accept()
        except OSError:
            break
        try:
            server = socket.create_connection(target, timeout=5)
            server.settimeout(None)
        except OSError:
            client.close()
            continue
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connections += 1
        up = Pump(client, server, writes if args.writes else None, t0)
        down = Pump(server, client)
        with lock:
            pumps.append((up, down))
            socks.extend((client, server))
        for p in (up, down):
            threading.Thread(target=p.run, daemon=True).start()

    with lock:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        totals = {
            'connections': connections,
            'c2s_bytes': sum(u.bytes for u, _ in pumps),
            's2c_bytes': sum(d.bytes for _, d in pumps),
            'c2s_messages': sum(u.messages for u, _ in pumps),
            's2c_messages': sum(d.messages for _, d in pumps),
        }
        if args.writes:
            totals['writes'] = sorted(writes, key=lambda w: w['t'])
    print(json.dumps(totals), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
