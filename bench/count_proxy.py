#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Counting TCP proxy: measures the bytes a client puts on the wire to a server.

    /usr/bin/python3 bench/count_proxy.py --target HOST:PORT [--listen HOST:PORT] [--writes]
        [--replies] [--sink] [--delay-writes S]

Listens on 127.0.0.1 (a free port unless --listen gives one), forwards every
connection to --target unchanged, and counts the bytes and wire-protocol
messages going each way.  Prints {"ready":true,"port":P} on one line to stdout
once it accepts connections; on SIGTERM or SIGINT it closes everything and
prints the totals as a second JSON line:

    {"connections":N,"c2s_bytes":B,"s2c_bytes":B,"c2s_messages":M,"s2c_messages":M}

Messages are counted by MongoDB's wire framing (each message starts with its
little-endian int32 length), so c2s_messages is the number of requests (bulk
writes, handshakes, heartbeats).  With --writes each client request that is an
update command (OP_MSG) is also itemised, and the totals gain a list "writes" of
{"t": seconds since start when the message was complete, "t_first": when its
length prefix arrived, "t_reply" (--sink: when the proxy's answer was sent),
"bytes": message size, "updates": statements, "readings": readings appended}:
readings are read from bucketd's update pipeline (stage 1's count increment,
which equals the length of its $set._n.$literal array) by walking the BSON
without decoding the readings, so that itemising a bulk of 200,000 readings
costs next to nothing and does not hold up the forwarding (a statement without
that field is decoded and its $literal array counted), and the bench suite
can tell the flush cycles apart on the wire.  With --replies as well (forwarding only) each
forwarded update command also gets "t_server_reply", when the server's reply to it (matched by
its responseTo) had come back through the proxy, so t_server_reply - t_first is the write's
own time as the client sees it; and aggregate commands are itemised too, in a list
"aggregates" of {"t", "t_first", "t_server_reply", "bytes", "merge": whether it holds a
$merge stage, as bucketd's summary refreshes do}.  The bench suite runs it between bucketd and
the MongoDB stand-in: bytes client->server divided by readings flushed is the
wire cost of a reading.  Two threads per connection, one per direction; each
count has one writer and is summed at the end.

Two options change what happens to update commands (everything else, the
handshake, monitoring, index creation and queries, is always forwarded):

  --delay-writes S  each update command is held S seconds before it is forwarded
                    (with --sink: before it is answered), like a server that
                    takes S seconds per bulk write;
  --sink            update commands are not forwarded: the proxy answers each
                    one itself, {n: statements, nModified: statements, ok: 1},
                    as soon as it has read it (after --delay-writes).  A server
                    that costs nothing per write, for measuring the client when
                    the real server (or the Python stand-in) would be the limit.
                    Nothing is stored: reads see none of these writes.

With either, client->server traffic is forwarded a whole message at a time.
The totals then also give "sunk_writes" (update commands answered by the proxy)
and "delayed_writes".  The ready line carries "t0", the proxy's
time.monotonic() at start (CLOCK_MONOTONIC, the same clock as other processes'
on this machine), to which each write's "t" is relative.
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


def command_name(msg):
    """The command name (the body's first key) of an OP_MSG, or None; read without decoding."""
    if len(msg) < 21 or struct.unpack_from('<i', msg, 12)[0] != OP_MSG:
        return None
    i = 20
    while i < len(msg) and msg[i] == 1:
        i += 1 + struct.unpack_from('<i', msg, i + 1)[0]
    if i + 6 > len(msg) or msg[i] != 0:
        return None
    j = msg.find(b'\0', i + 6)
    return bytes(msg[i + 6:j]).decode('utf-8', 'replace') if j > 0 else None


def is_update_command(msg):
    """True for an OP_MSG whose body (kind-0 section) is an update command.  The command's name
    is the body's first element, so the body's first key is compared without decoding it."""
    if len(msg) < 21 or struct.unpack_from('<i', msg, 12)[0] != OP_MSG:
        return False
    i = 20
    # Kind-1 sections (the updates document sequence) may come before the body.
    while i < len(msg) and msg[i] == 1:
        i += 1 + struct.unpack_from('<i', msg, i + 1)[0]
    if i + 6 > len(msg) or msg[i] != 0:
        return False
    # body: int32 size, then the first element: type byte, cstring name.
    return bytes(msg[i + 6:i + 6 + 7]) == b'update\0'


def update_statements(msg):
    """Statements of an update command: the documents of its "updates" sequence, counted by
    their sizes without decoding them, or the length of the body's updates array."""
    import bson
    i = 20
    flags = struct.unpack_from('<I', msg, 16)[0]
    end = len(msg) - (4 if flags & 1 else 0)
    body = None
    while i < end:
        kind = msg[i]
        size = struct.unpack_from('<i', msg, i + 1)[0]
        if kind == 1:
            j = msg.index(b'\0', i + 5) + 1
            if bytes(msg[i + 5:j - 1]) == b'updates':
                n = 0
                stop = i + 1 + size
                while j < stop:
                    j += struct.unpack_from('<i', msg, j)[0]
                    n += 1
                return n
        elif kind == 0:
            body = bson.decode(bytes(msg[i + 1:i + 1 + size]))
        i += 1 + size
    return len((body or {}).get('updates', []))


def op_msg_reply(request, body):
    """An OP_MSG reply to request (its requestID as responseTo) with one kind-0 body."""
    import bson
    doc = bson.encode(body)
    length = 16 + 4 + 1 + len(doc)
    request_id = struct.unpack_from('<i', request, 4)[0]
    return struct.pack('<iiiiIB', length, 0, request_id, OP_MSG, 0, 0) + doc


# Bytes of a BSON value of each fixed-size type; strings, documents, arrays and binaries say
# their own size; a regex is two cstrings.
_FIXED = {0x01: 8, 0x06: 0, 0x07: 12, 0x08: 1, 0x09: 8, 0x0A: 0, 0x10: 4, 0x11: 8, 0x12: 8,
          0x13: 16, 0x7F: 0, 0xFF: 0}


def bson_elements(buf, start):
    """(type, name, value offset, value end) of each element of the BSON document at start,
    without decoding anything: a large embedded array (bucketd's readings) is skipped in one
    step, so walking a statement costs the same whatever its size."""
    size = struct.unpack_from('<i', buf, start)[0]
    i = start + 4
    end = start + size - 1
    while i < end:
        t = buf[i]
        j = buf.index(b'\0', i + 1)
        name = bytes(buf[i + 1:j])
        v = j + 1
        if t in (0x03, 0x04):
            n = struct.unpack_from('<i', buf, v)[0]
        elif t in (0x02, 0x0D, 0x0E):
            n = 4 + struct.unpack_from('<i', buf, v)[0]
        elif t == 0x05:
            n = 5 + struct.unpack_from('<i', buf, v)[0]
        elif t == 0x0B:
            n = buf.index(b'\0', buf.index(b'\0', v) + 1) + 1 - v
        elif t in _FIXED:
            n = _FIXED[t]
        else:
            raise ValueError('BSON type 0x%02x' % t)
        yield t, name, v, v + n
        i = v + n


def bson_path(buf, start, path):
    """(type, value offset) of the element at path (a list of names) below the document at
    start, or None."""
    for k, name in enumerate(path):
        for t, n, v, _ in bson_elements(buf, start):
            if n == name:
                if k == len(path) - 1:
                    return t, v
                if t not in (0x03, 0x04):
                    return None
                start = v
                break
        else:
            return None
    return None


def statement_readings(buf, start):
    """Readings an update statement of bucketd's appends: its stage-1 count increment
    ({count: {$add: [{$ifNull: [...]}, N]}}), which equals the length of the $literal readings
    array; read without decoding the readings. None if the statement has no such field."""
    got = bson_path(buf, start, [b'u', b'0', b'$set', b'count', b'$add', b'1'])
    if got is None:
        return None
    t, v = got
    if t == 0x12:
        return struct.unpack_from('<q', buf, v)[0]
    if t == 0x10:
        return struct.unpack_from('<i', buf, v)[0]
    return None


def fast_update_summary(msg):
    """(statements, readings) of an update command whose statements are a document sequence,
    walked without decoding; None when it does not look like that (then the slow path)."""
    if len(msg) < 21 or struct.unpack_from('<i', msg, 12)[0] != OP_MSG:
        return None
    flags = struct.unpack_from('<I', msg, 16)[0]
    end = len(msg) - (4 if flags & 1 else 0)
    i = 20
    stmts = readings = 0
    seen = False
    while i < end:
        kind = msg[i]
        size = struct.unpack_from('<i', msg, i + 1)[0]
        if kind == 1:
            j = msg.index(b'\0', i + 5) + 1
            if bytes(msg[i + 5:j - 1]) == b'updates':
                seen = True
                stop = i + 1 + size
                while j < stop:
                    n = statement_readings(msg, j)
                    if n is None:
                        return None
                    readings += n
                    stmts += 1
                    j += struct.unpack_from('<i', msg, j)[0]
        i += 1 + size
    return (stmts, readings) if seen else None


def bulk_update_summary(msg):
    """(statements, readings) of an OP_MSG update command, or None for anything else."""
    if is_update_command(msg):
        try:
            fast = fast_update_summary(msg)
        except (ValueError, struct.error, IndexError):
            fast = None
        if fast is not None:
            return fast
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
    """Copies one direction of one connection and counts it.

    With `hold` (--sink or --delay-writes, client->server only) messages are forwarded whole,
    and update commands are delayed and, with --sink, answered here instead of forwarded."""

    def __init__(self, src, dst, writes=None, t0=0.0, hold=None, replies=None, asked=None):
        self.src = src
        self.dst = dst
        self.replies = replies  # server->client with --replies: {responseTo: time}
        self.asked = asked      # client->server with --replies: [(requestID, item)]
        self.aggregates = []    # client->server with --replies: itemised aggregate commands
        self.bytes = 0
        self.messages = 0
        self.writes = writes    # list to append decoded update commands to, or None
        self.t0 = t0
        self.hold = hold        # {'delay': s, 'sink': bool, 'lock': Lock} or None
        self.sunk = 0
        self.delayed = 0
        self.reply_bytes = 0    # replies the proxy made (server->client)
        self._need = 0          # bytes left in the current message
        self._hdr = b''         # partial length prefix
        self._msg = bytearray()
        self._t_first = 0.0     # when the current message's length prefix arrived
        self._out = []          # whole messages ready to forward (hold mode)

    def _done(self):
        msg = self._msg
        self._msg = bytearray()
        if self.replies is not None:
            if len(msg) >= 12:
                self.replies[struct.unpack_from('<i', msg, 8)[0]] = time.monotonic()
            return
        if self.hold is not None:
            # Itemised once forwarded or answered: decoding a large bulk takes a while, and the
            # client should not wait for it.
            self._out.append((msg, self._t_first, time.monotonic()))
        else:
            self._itemise(msg, self._t_first, time.monotonic())

    def _itemise(self, msg, t_first, t, t_reply=None):
        if self.writes is None:
            return
        try:
            s = bulk_update_summary(msg)
        except Exception:  # a message we cannot decode is only not itemised
            s = None
        if s is not None:
            w = {'t': round(t - self.t0, 4), 'bytes': len(msg), 'updates': s[0],
                 'readings': s[1], 't_first': round(t_first - self.t0, 4)}
            if t_reply is not None:
                w['t_reply'] = round(t_reply - self.t0, 4)
            self.writes.append(w)
            if self.asked is not None:
                self.asked.append((struct.unpack_from('<i', msg, 4)[0], w))
        elif self.asked is not None and command_name(msg) == 'aggregate':
            w = {'t': round(t - self.t0, 4), 'bytes': len(msg),
                 't_first': round(t_first - self.t0, 4), 'merge': b'$merge' in msg}
            self.aggregates.append(w)
            self.asked.append((struct.unpack_from('<i', msg, 4)[0], w))

    def _keep(self):
        return self.writes is not None or self.hold is not None or self.replies is not None

    def _frame(self, data):
        i = 0
        n = len(data)
        while i < n:
            if self._need > 0:
                take = min(self._need, n - i)
                if self._keep():
                    self._msg += data[i:i + take]
                self._need -= take
                i += take
                if self._need == 0 and self._keep():
                    self._done()
                continue
            want = 4 - len(self._hdr)
            self._hdr += data[i:i + want]
            i += min(want, n - i)
            if len(self._hdr) == 4:
                self._t_first = time.monotonic()
                length = struct.unpack('<i', self._hdr)[0]
                if self._keep():
                    self._msg = bytearray(self._hdr)
                self._hdr = b''
                self.messages += 1
                self._need = max(length - 4, 0)
                if self._need == 0 and self._keep():
                    self._done()

    def _forward_held(self):
        """Forward (or answer) the whole messages read so far, in order."""
        out, self._out = self._out, []
        for msg, t_first, t in out:
            if not is_update_command(msg):
                self.dst.sendall(msg)
                continue
            if self.hold['delay'] > 0:
                time.sleep(self.hold['delay'])
                self.delayed += 1
            t_reply = None
            if not self.hold['sink']:
                self.dst.sendall(msg)
            else:
                self.sunk += 1
                flags = struct.unpack_from('<I', msg, 16)[0]
                if not flags & 2:  # moreToCome: the client expects no reply
                    n = update_statements(msg)
                    reply = op_msg_reply(msg, {'n': n, 'nModified': n, 'ok': 1.0})
                    self.reply_bytes += len(reply)
                    with self.hold['lock']:
                        self.src.sendall(reply)
                    t_reply = time.monotonic()
            self._itemise(msg, t_first, t, t_reply)

    def run(self):
        try:
            while True:
                data = self.src.recv(1 << 16)
                if not data:
                    break
                self.bytes += len(data)
                self._frame(data)
                if self.hold is None:
                    self.dst.sendall(data)
                else:
                    self._forward_held()
        except OSError:
            pass
        finally:
            for s in (self.dst, self.src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class LockedSocket(object):
    """The client socket as the server->client pump sees it when the proxy also answers on it:
    a reply the proxy makes and one the server sends must not interleave."""

    def __init__(self, sock, lock):
        self.sock = sock
        self.lock = lock

    def sendall(self, data):
        with self.lock:
            self.sock.sendall(data)

    def recv(self, n):
        return self.sock.recv(n)

    def shutdown(self, how):
        self.sock.shutdown(how)


def parse_addr(s):
    host, _, port = s.rpartition(':')
    return host.strip('[]') or '127.0.0.1', int(port)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--target', required=True, help='HOST:PORT of the server')
    ap.add_argument('--listen', default='127.0.0.1:0', help='HOST:PORT to listen on')
    ap.add_argument('--writes', action='store_true', help='itemise update commands')
    ap.add_argument('--replies', action='store_true',
                    help='with --writes, forwarding: time the server\'s reply to each update '
                    'and aggregate command')
    ap.add_argument('--sink', action='store_true',
                    help='answer update commands here instead of forwarding them')
    ap.add_argument('--delay-writes', type=float, default=0.0, metavar='S',
                    help='hold each update command S seconds')
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

    print(json.dumps({'ready': True, 'port': lsock.getsockname()[1], 't0': t0}), flush=True)

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
        hold = None
        to_client = client
        if args.sink or args.delay_writes > 0:
            hold = {'delay': args.delay_writes, 'sink': args.sink, 'lock': threading.Lock()}
            to_client = LockedSocket(client, hold['lock'])
        timed = args.replies and args.writes and hold is None
        up = Pump(client, server, writes if args.writes else None, t0, hold,
                  asked=[] if timed else None)
        down = Pump(server, to_client, replies={} if timed else None)
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
            's2c_bytes': sum(d.bytes + u.reply_bytes for u, d in pumps),
            'c2s_messages': sum(u.messages for u, _ in pumps),
            's2c_messages': sum(d.messages for _, d in pumps),
        }
        if args.sink or args.delay_writes > 0:
            totals['sunk_writes'] = sum(u.sunk for u, _ in pumps)
            totals['delayed_writes'] = sum(u.delayed for u, _ in pumps)
        if args.writes:
            aggregates = []
            for u, d in pumps:
                for rid, w in (u.asked or ()):
                    if d.replies is not None and rid in d.replies:
                        w['t_server_reply'] = round(d.replies[rid] - t0, 4)
                aggregates.extend(u.aggregates)
            totals['writes'] = sorted(writes, key=lambda w: w['t'])
            if args.replies:
                totals['aggregates'] = sorted(aggregates, key=lambda w: w['t'])
    print(json.dumps(totals), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
