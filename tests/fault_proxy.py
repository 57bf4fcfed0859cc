#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Fault-injecting TCP proxy for the MongoDB wire protocol.

Sits between a MongoDB client (bucketd's libmongoc, pymongo, ...) and a MongoDB server (the
stand-in tests/mongo_server.py or a real mongod), cuts the byte streams into wire-protocol
messages and, on command, misbehaves the way networks and servers do.  DESIGN.md §6 asks for it:
the daemon's retry and idempotency logic can only be tested if a write can be applied while its
reply is lost.

Faults (one at a time, switchable at runtime while connections are open):

  pass        forward everything (the default).
  drop_reply  forward the request, wait for the server's reply, then close the client connection
              instead of delivering it: the ambiguous failure (applied, but the client cannot
              know).  Options: writes_only (only insert/update/delete commands), commands (only
              these command names), count (only the next N matching requests, then back to
              pass), rst (close with a TCP reset instead of a FIN).
  delay       hold each matching reply for `seconds` after it arrives from the server.  Same
              writes_only / commands / count options.
  stall       keep accepting and keep every connection open, but forward nothing in either
              direction.  Switching to any other fault resumes: messages held meanwhile are then
              delivered, as TCP would after a partition heals (a request sent during a stall is
              therefore applied late even if its client gave up).
  refuse      accept new connections and close them at once (the client reads EOF).
  reset       accept new connections and reset them (SO_LINGER 0: the client sees ECONNRESET).
  unlisten    close the listening socket (the client sees ECONNREFUSED); reopened on the same
              port when the fault changes.
  race_insert MongoDB's window between an upsert's match and its insert, opened on purpose: when
              an OP_MSG "update" command carries a statement with upsert: true whose filter's _id
              is `match_id` (any _id when none is given), the proxy first inserts a document with
              that _id into the same database and collection over its own connection to the
              server (`fields` added to {_id}, or `document` as given), waits for the insert's
              reply, and only then forwards the client's request (held meanwhile; later requests
              of that connection wait behind it, and so does every write on the other
              connections: a retry on a new connection must not reach the server first).  The client's upsert then finds the racing
              document: if its filter has conditions that document does not meet, it tries to
              insert and gets duplicate key (11000), as it would from a concurrent writer.
              Options: match_id, fields, document, count (statements raced, then back to pass).

`existing` says what happens to the connections open when a fault is set: "keep", "close" (FIN)
or "reset" (RST).  refuse and unlisten close them by default, reset resets them, the others keep
them, so "refuse" or "reset" alone look like a server going away.

Decisions that act on a reply (drop_reply, delay) are taken when the request is forwarded, so
"count=2" means the next two matching requests, whatever happens to their replies.  Only
requests that expect a reply can match (an OP_MSG with moreToCome, i.e. w:0, cannot).  Replies
that continue an exhaust stream (moreToCome replies) inherit the decision of their request.

In-process use (one selector thread, all sockets non-blocking; stop() joins it):

    from fault_proxy import FaultProxy
    with FaultProxy('127.0.0.1', mongo_port) as proxy:     # or proxy.start() / proxy.stop()
        uri = 'mongodb://127.0.0.1:%d/?directConnection=true' % proxy.port
        proxy.set_fault('drop_reply', writes_only=True, count=1)
        ...
        proxy.stats()['replies_dropped']

set_fault() returns once the proxy thread has applied the fault (existing connections already
closed, listener already closed or reopened), so a test can act on it immediately.

Command line (a person driving it by hand):

    /usr/bin/python3 tests/fault_proxy.py --listen 127.0.0.1:0 --upstream 127.0.0.1:27017

prints "listen HOST:PORT" and "control HOST:PORT" on stdout, then serves until SIGTERM or
SIGINT (SIGUSR1 prints the counters to stderr).  The control port takes one command per line
and answers one line, "ok ..." or "error ...":

    $ nc 127.0.0.1 CONTROL_PORT
    drop_reply writes count=2        delay 0.5 writes         stall          pass
    refuse [existing=keep]           reset                    unlisten       kill [close]
    race_insert id=ID count=1 fields='{"w": {"other": 1}}'      (Extended JSON; quote as in sh)
    stats                            fault                    help           quit | shutdown

Give the client directConnection=true (and no replicaSet): otherwise a driver that learns the
real server addresses from hello connects there and bypasses the proxy.  TLS cannot be proxied
(the proxy must read the messages).  race_insert's own connection uses pymongo (Debian's
python3-pymongo) to mongodb://UPSTREAM/?directConnection=true, or `upstream_uri` /
--upstream-uri when the server needs credentials.
"""

import argparse
import collections
import errno
import json
import selectors
import shlex
import signal
import socket
import struct
import sys
import threading
import time
import zlib

# Wire-protocol opcodes (https://www.mongodb.com/docs/manual/reference/mongodb-wire-protocol/).
OP_REPLY = 1
OP_UPDATE = 2001
OP_INSERT = 2002
OP_QUERY = 2004
OP_GET_MORE = 2005
OP_DELETE = 2006
OP_KILL_CURSORS = 2007
OP_COMPRESSED = 2012
OP_MSG = 2013

MSG_CHECKSUM_PRESENT = 1 << 0
MSG_MORE_TO_COME = 1 << 1

HEADER = struct.Struct('<iiii')  # messageLength, requestID, responseTo, opCode
INT32 = struct.Struct('<i')
UINT32 = struct.Struct('<I')

WRITE_COMMANDS = frozenset(('insert', 'update', 'delete'))
LEGACY_WRITE_OPCODES = frozenset((OP_INSERT, OP_UPDATE, OP_DELETE))

# mongod accepts messages up to 48 000 000 bytes; a little more so that the proxy is never the
# component that refuses a legal message.  Anything larger, or shorter than a header, means the
# stream is not MongoDB (or is TLS) and the connection is closed as a protocol error.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024
# Stop reading from a socket while this much of its data waits to be forwarded (a stall, or a
# slow reader on the other side): TCP back-pressure then reaches the sender instead of our memory.
BACKPRESSURE_BYTES = 16 * 1024 * 1024
RECV_SIZE = 256 * 1024

PASS = 'pass'
DROP_REPLY = 'drop_reply'
DELAY = 'delay'
STALL = 'stall'
REFUSE = 'refuse'
RESET = 'reset'
UNLISTEN = 'unlisten'
RACE_INSERT = 'race_insert'
FAULT_KINDS = (PASS, DROP_REPLY, DELAY, STALL, REFUSE, RESET, UNLISTEN, RACE_INSERT)
ANY_ID = object()  # race_insert without match_id: every upsert's _id
EXISTING_ACTIONS = ('keep', 'close', 'reset')
DEFAULT_EXISTING = {REFUSE: 'close', RESET: 'reset', UNLISTEN: 'close'}


# ---------------------------------------------------------------------------------------------
# Wire-protocol framing
# ---------------------------------------------------------------------------------------------

class WireMessage(object):
    """What the proxy needs to know about one message; parsing never raises."""

    __slots__ = ('request_id', 'response_to', 'opcode', 'command', 'flags', 'compressed')

    def __init__(self, request_id, response_to, opcode):
        self.request_id = request_id
        self.response_to = response_to
        self.opcode = opcode        # the original opcode for OP_COMPRESSED
        self.command = None         # first key of the command document, when there is one
        self.flags = 0              # OP_MSG flagBits
        self.compressed = False

    @property
    def more_to_come(self):
        return self.opcode == OP_MSG and bool(self.flags & MSG_MORE_TO_COME)

    @property
    def expects_reply(self):
        """A request the server answers (legacy inserts, kill-cursors and w:0 OP_MSGs do not)."""
        if self.opcode == OP_MSG:
            return not self.more_to_come
        return self.opcode in (OP_QUERY, OP_GET_MORE)

    @property
    def is_write(self):
        return self.command in WRITE_COMMANDS or self.opcode in LEGACY_WRITE_OPCODES

    def __repr__(self):
        return '<WireMessage op=%d id=%d to=%d cmd=%r>' % (
            self.opcode, self.request_id, self.response_to, self.command)


def _cstring(data, pos):
    """The NUL-terminated string at pos and the position after its NUL."""
    end = data.index(b'\x00', pos)
    return data[pos:end].decode('utf-8', 'replace'), end + 1


def _first_key(data, pos):
    """First key of the BSON document at pos, and where that element's value starts."""
    if data[pos + 4] == 0:
        return None, None  # empty document
    return _cstring(data, pos + 5)


def _decompress(compressor_id, payload):
    if compressor_id == 0:  # noop
        return payload
    if compressor_id == 2:
        return zlib.decompress(payload)
    # snappy (1) and zstd (3) only if their modules happen to be installed; otherwise the
    # message is still forwarded, it just cannot match a command-name filter.
    if compressor_id == 1:
        import snappy
        return snappy.uncompress(payload)
    if compressor_id == 3:
        import zstandard
        return zstandard.ZstdDecompressor().decompress(payload)
    raise ValueError('unknown compressor %d' % compressor_id)


def parse_message(data):
    """A WireMessage for the complete message in data (bytes starting at its header)."""
    _, request_id, response_to, opcode = HEADER.unpack_from(data, 0)
    msg = WireMessage(request_id, response_to, opcode)
    body = data
    try:
        if opcode == OP_COMPRESSED:
            msg.compressed = True
            msg.opcode = opcode = INT32.unpack_from(data, 16)[0]
            body = data[:16] + _decompress(data[24], data[25:])
        if opcode == OP_MSG:
            msg.flags = UINT32.unpack_from(body, 16)[0]
            msg.command = _op_msg_command(body, msg.flags)
        elif opcode == OP_QUERY:
            msg.command = _op_query_command(body)
    except Exception:  # noqa: BLE001 - a message we cannot read is still forwarded untouched
        pass
    return msg


def _op_msg_command(body, flags):
    # flagBits, then sections up to the optional CRC-32C.  The spec allows the body (kind 0)
    # after document sequences (kind 1), so walk them all rather than assume it comes first.
    end = len(body) - (4 if flags & MSG_CHECKSUM_PRESENT else 0)
    pos = 20
    while pos < end:
        kind = body[pos]
        pos += 1
        if kind == 0:
            return _first_key(body, pos)[0]
        if kind != 1:
            return None  # kinds we do not know have no length we could skip
        pos += INT32.unpack_from(body, pos)[0]
    return None


def decode_op_msg(data):
    """(body, {sequence name: [documents]}) of a complete OP_MSG (or OP_COMPRESSED OP_MSG)
    message, decoded with pymongo's bson; None for anything else."""
    import bson
    _, _, _, opcode = HEADER.unpack_from(data, 0)
    body = data
    if opcode == OP_COMPRESSED:
        opcode = INT32.unpack_from(data, 16)[0]
        body = data[:16] + _decompress(data[24], data[25:])
    if opcode != OP_MSG:
        return None
    flags = UINT32.unpack_from(body, 16)[0]
    end = len(body) - (4 if flags & MSG_CHECKSUM_PRESENT else 0)
    pos = 20
    doc = None
    sequences = {}
    while pos < end:
        kind = body[pos]
        pos += 1
        if kind == 0:
            n = INT32.unpack_from(body, pos)[0]
            doc = bson.decode(body[pos:pos + n])
            pos += n
        elif kind == 1:
            size = INT32.unpack_from(body, pos)[0]
            section_end = pos + size
            name, p = _cstring(body, pos + 4)
            docs = []
            while p < section_end:
                n = INT32.unpack_from(body, p)[0]
                docs.append(bson.decode(body[p:p + n]))
                p += n
            sequences[name] = docs
            pos = section_end
        else:
            return None
    if doc is None:
        return None
    return doc, sequences


def _same_value(a, b):
    """a and b are one BSON value (Python's 1 == True must not make them so)."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _op_query_command(body):
    # flags, fullCollectionName, numberToSkip, numberToReturn, query.  Old drivers wrap the
    # command as {$query: {...}, $readPreference: ...}; the name is then the inner first key.
    _, pos = _cstring(body, 20)
    pos += 8
    name, value_pos = _first_key(body, pos)
    if name in ('$query', 'query') and body[pos + 4] == 0x03:
        name, _ = _first_key(body, value_pos)
    return name


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------

class Fault(object):
    """The current fault and its options (owned by the proxy thread once it runs)."""

    def __init__(self, kind=PASS, seconds=0.0, writes_only=False, commands=None, count=None,
                 rst=False, match_id=ANY_ID, fields=None, document=None):
        self.kind = kind
        self.seconds = seconds
        self.writes_only = writes_only
        self.commands = commands
        self.remaining = count
        self.rst = rst
        self.match_id = match_id
        self.fields = fields
        self.document = document

    def race_matches(self, statement):
        """The _id of an update statement this race_insert fault acts on, else ANY_ID."""
        if not isinstance(statement, dict) or statement.get('upsert') is not True:
            return ANY_ID
        q = statement.get('q')
        if not isinstance(q, dict) or '_id' not in q:
            return ANY_ID
        _id = q['_id']
        if isinstance(_id, dict):
            if list(_id) != ['$eq']:
                return ANY_ID  # not one value: nothing the upsert could insert
            _id = _id['$eq']
        if self.match_id is not ANY_ID and not _same_value(_id, self.match_id):
            return ANY_ID
        return _id

    def race_document(self, _id):
        if self.document is not None:
            doc = dict(self.document)
            doc.setdefault('_id', _id)
        else:
            doc = {'_id': _id}
            doc.update(self.fields or {})
        return doc

    def matches(self, msg):
        if self.kind not in (DROP_REPLY, DELAY) or not msg.expects_reply:
            return False
        if self.writes_only and not msg.is_write:
            return False
        if self.commands is not None and msg.command not in self.commands:
            return False
        return True

    def describe(self):
        words = [self.kind]
        if self.kind == DELAY:
            words.append('seconds=%g' % self.seconds)
        if self.writes_only:
            words.append('writes')
        if self.commands is not None:
            words.append('commands=%s' % ','.join(sorted(self.commands)))
        if self.kind == RACE_INSERT:
            words.append('id=%s' % ('*' if self.match_id is ANY_ID else
                                    json.dumps(self.match_id, default=str)))
        if self.remaining is not None:
            words.append('left=%d' % self.remaining)
        if self.rst:
            words.append('rst')
        return ' '.join(words)


class _ReplyAction(object):
    """What to do with the reply of one forwarded request."""

    __slots__ = ('drop', 'rst', 'delay')

    def __init__(self, drop=False, rst=False, delay=0.0):
        self.drop = drop
        self.rst = rst
        self.delay = delay


# ---------------------------------------------------------------------------------------------
# Connections
# ---------------------------------------------------------------------------------------------

class _Direction(object):
    """One direction of a proxied connection.

    Bytes read from src collect in inbuf until a whole message is there; whole messages wait in
    held (with the time they may leave) until the fault lets them go; then they are copied to
    outbuf, which is written to dst as fast as dst takes it."""

    def __init__(self, src, dst, upstream):
        self.src = src
        self.dst = dst
        self.upstream = upstream      # True for client -> server (requests)
        self.inbuf = bytearray()
        self.held = collections.deque()  # [release_at, bytes, WireMessage, counted_as_stalled]
        self.held_bytes = 0
        self.outbuf = bytearray()
        self.eof = False

    def queued_bytes(self):
        return len(self.inbuf) + self.held_bytes + len(self.outbuf)


class _Link(object):
    """A client connection and its upstream connection."""

    def __init__(self, link_id, client, upstream):
        self.id = link_id
        self.client = client
        self.upstream = upstream
        self.connecting = True
        self.closed = False
        self.requests = _Direction(client, upstream, True)
        self.replies = _Direction(upstream, client, False)
        # requestID -> _ReplyAction, only for requests a fault acted on; other replies pass.
        self.actions = {}
        self.masks = {client: 0, upstream: 0}


def _abort(sock):
    """Close with SO_LINGER 0: the kernel sends RST instead of FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy(object):
    """A fault-injecting MongoDB wire-protocol proxy on 127.0.0.1 (see the module docstring).

    All sockets belong to one selector thread; the public methods post work to it and wait, so
    they are safe from any thread and take effect before they return."""

    def __init__(self, upstream_host, upstream_port, listen_host='127.0.0.1', listen_port=0,
                 log=None, upstream_uri=None):
        self.upstream_host = upstream_host
        self.upstream_port = int(upstream_port)
        # race_insert's own connection to the server (a pymongo client, made on first use).
        self.upstream_uri = upstream_uri
        self._race_client = None
        self._race_lock = threading.Lock()
        self._race_error = None
        self._race_threads = []
        self._races_in_flight = 0  # racing inserts without their reply yet: writes wait
        self.listen_host = listen_host
        self.port = int(listen_port)
        self._log_fn = log
        self._upstream_addr = None
        self._listener = None
        self._sel = None
        self._wake_r = self._wake_w = None
        self._thread = None
        self._stopping = False
        self._loop_error = None
        self._commands = collections.deque()
        self._links = {}
        self._next_link_id = 1
        self._fault = Fault()
        self._counters = collections.Counter()
        self._command_counts = collections.Counter()

    # -- public API ----------------------------------------------------------------------------

    def start(self):
        """Bind, start the proxy thread and return the listening port."""
        if self._thread is not None:
            raise RuntimeError('FaultProxy already started')
        # Resolve once here so a bad upstream name fails in the caller, not in the thread.
        family, stype, proto, _, addr = socket.getaddrinfo(
            self.upstream_host, self.upstream_port, 0, socket.SOCK_STREAM)[0]
        self._upstream_addr = (family, stype, proto, addr)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ('wake', None))
        try:
            if self._fault.kind != UNLISTEN:
                self._open_listener()
            else:
                self.port = self.port or self._reserve_port()
        except Exception:
            self._close_loop_resources()
            raise
        self._thread = threading.Thread(target=self._run, name='fault-proxy:%d' % self.port,
                                        daemon=True)
        self._thread.start()
        return self.port

    def stop(self, timeout=5.0):
        """Close every connection and the listener and join the proxy thread.

        Never waits longer than timeout; raises if the thread did not finish or had crashed
        (a crash would otherwise show up only as mysterious client errors)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping = True
        self._wake()
        thread.join(timeout)
        for t in self._race_threads:
            t.join(timeout)
        self._race_threads = []
        with self._race_lock:
            if self._race_client is not None:
                self._race_client.close()
                self._race_client = None
        if thread.is_alive():
            raise RuntimeError('fault proxy thread did not stop within %.1fs' % timeout)
        self._thread = None
        if self._loop_error is not None:
            error, self._loop_error = self._loop_error, None
            raise RuntimeError('fault proxy thread failed: %r' % (error,)) from error

    def set_fault(self, kind, seconds=None, writes_only=False, commands=None, count=None,
                  rst=False, existing=None, match_id=ANY_ID, fields=None, document=None):
        """Switch to fault `kind` (see the module docstring); returns its description.

        race_insert: match_id (the _id of the upserts to race; every upsert's when not
        given), fields (added to {_id: <that id>} for the racing document) or document (the
        racing document itself; its _id defaults to the upsert's), count (statements raced)."""
        if kind not in FAULT_KINDS:
            raise ValueError('unknown fault %r (one of %s)' % (kind, ', '.join(FAULT_KINDS)))
        if kind == DELAY:
            if seconds is None or seconds < 0:
                raise ValueError('delay needs seconds >= 0')
        elif seconds is not None:
            raise ValueError('seconds only applies to delay')
        if kind != RACE_INSERT and (match_id is not ANY_ID or fields is not None or
                                    document is not None):
            raise ValueError('match_id, fields and document apply to race_insert')
        if fields is not None and document is not None:
            raise ValueError('give fields or document, not both')
        for name, value in (('fields', fields), ('document', document)):
            if value is not None and not isinstance(value, dict):
                raise ValueError('%s must be a document' % name)
        if kind == RACE_INSERT and (writes_only or commands is not None):
            raise ValueError('race_insert acts on upserts; writes_only and commands do not '
                             'apply')
        matching = kind in (DROP_REPLY, DELAY, RACE_INSERT)
        if not matching and (writes_only or commands is not None or count is not None):
            raise ValueError('writes_only, commands and count apply to drop_reply, delay and '
                             'race_insert')
        if rst and kind != DROP_REPLY:
            raise ValueError('rst applies to drop_reply (use reset for connections)')
        if count is not None and (int(count) != count or count < 1):
            raise ValueError('count must be a positive integer')
        if existing is None:
            existing = DEFAULT_EXISTING.get(kind, 'keep')
        if existing not in EXISTING_ACTIONS:
            raise ValueError('existing must be one of %s' % ', '.join(EXISTING_ACTIONS))
        if isinstance(commands, str):
            commands = [commands]
        fault = Fault(kind, float(seconds or 0.0), bool(writes_only),
                      frozenset(commands) if commands is not None else None,
                      int(count) if count is not None else None, bool(rst),
                      match_id, dict(fields) if fields is not None else None,
                      dict(document) if document is not None else None)
        return self._call(lambda: self._apply_fault(fault, existing))

    def fault(self):
        """Description of the current fault, e.g. "drop_reply writes left=1"."""
        return self._call(lambda: self._fault.describe())

    def reset_connections(self):
        """Reset (RST) every open connection; returns how many."""
        return self._call(lambda: self._end_links('reset', 'kill'))

    def close_connections(self):
        """Close (FIN) every open connection; returns how many."""
        return self._call(lambda: self._end_links('close', 'kill'))

    def stats(self):
        """A snapshot of the counters (a plain dict, safe to keep).

        connections_accepted   every accept(), including those refused or reset at once
        connections_refused    closed at accept by refuse
        connections_reset      reset by us: at accept (reset), or open ones (reset, kill)
        connections_closed     open ones closed by a fault's existing=close or kill close
        connections_active     open proxied connections now
        upstream_connect_failures, protocol_errors (bad message length)
        requests_forwarded, writes_forwarded (insert/update/delete and legacy write opcodes)
        replies_forwarded, replies_dropped, replies_delayed
        messages_stalled       messages that had to wait for a stall to end
        races                  upsert statements race_insert acted on (one racing insert each)
        race_inserts           racing documents the server stored
        race_insert_errors     racing inserts that failed (race_insert_error: the last message)
        bytes_to_upstream, bytes_to_client, faults_set, faults_expired (count used up)
        listening, fault (description), commands ({command name: requests forwarded})
        """
        return self._call(self._snapshot)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.stop()

    # -- calls into the proxy thread -----------------------------------------------------------

    def _call(self, fn, timeout=10.0):
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return fn()  # no other thread touches the state
        done = threading.Event()
        box = {}
        self._commands.append((fn, done, box))
        self._wake()
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if not thread.is_alive():
                # The thread ended (stop() or a crash) after we looked: the state is ours now.
                self._run_commands()
            elif time.monotonic() > deadline:
                raise TimeoutError('fault proxy thread did not answer within %.0fs' % timeout)
        if 'error' in box:
            raise box['error']
        return box.get('result')

    def _run_commands(self):
        while self._commands:
            fn, done, box = self._commands.popleft()
            try:
                box['result'] = fn()
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                box['error'] = e
            done.set()

    def _wake(self):
        try:
            self._wake_w.send(b'\0')
        except (OSError, AttributeError):
            pass  # a wake-up is already pending, or the thread has closed its end

    def _log(self, fmt, *args):
        if self._log_fn is not None:
            self._log_fn(fmt % args if args else fmt)

    # -- state changes (proxy thread) ----------------------------------------------------------

    def _apply_fault(self, fault, existing):
        # Before start() and after stop() there is no selector: start() opens the listener
        # according to the fault then in force.
        if self._sel is not None:
            if fault.kind == UNLISTEN:
                self._close_listener()
            elif self._listener is None:
                self._open_listener()
        self._fault = fault
        self._counters['faults_set'] += 1
        ended = self._end_links(existing, fault.kind) if existing != 'keep' else 0
        self._log('fault: %s (existing: %s, %d ended)', fault.describe(), existing, ended)
        return fault.describe()

    def _end_links(self, how, why):
        links = list(self._links.values())
        for link in links:
            self._close_link(link, reset=(how == 'reset'), reason=why)
            self._counters['connections_reset' if how == 'reset' else 'connections_closed'] += 1
        return len(links)

    def _snapshot(self):
        snap = {
            'connections_accepted': 0, 'connections_refused': 0, 'connections_reset': 0,
            'connections_closed': 0, 'upstream_connect_failures': 0, 'protocol_errors': 0,
            'requests_forwarded': 0, 'writes_forwarded': 0, 'replies_forwarded': 0,
            'replies_dropped': 0, 'replies_delayed': 0, 'messages_stalled': 0,
            'bytes_to_upstream': 0, 'bytes_to_client': 0, 'faults_set': 0, 'faults_expired': 0,
            'races': 0, 'race_inserts': 0, 'race_insert_errors': 0,
        }
        snap.update(self._counters)
        snap['connections_active'] = len(self._links)
        snap['listening'] = self._listener is not None
        snap['fault'] = self._fault.describe()
        snap['commands'] = dict(self._command_counts)
        if self._race_error:
            snap['race_insert_error'] = self._race_error
        return snap

    # -- listener ------------------------------------------------------------------------------

    def _reserve_port(self):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((self.listen_host, 0))
            return s.getsockname()[1]

    def _open_listener(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # REUSEADDR so that reopening after unlisten works while old connections on this
            # port sit in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.listen_host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, ('listen', None))

    def _close_listener(self):
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _accept(self):
        for _ in range(64):  # bounded, so a connection storm cannot starve the other sockets
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # ECONNABORTED and friends: the client gave up while queued; EMFILE: out of
                # descriptors, try again on the next event rather than spin.
                self._log('accept: %s', e)
                return
            self._counters['connections_accepted'] += 1
            kind = self._fault.kind
            if kind == REFUSE:
                self._counters['connections_refused'] += 1
                client.close()
                continue
            if kind == RESET:
                self._counters['connections_reset'] += 1
                _abort(client)
                continue
            self._new_link(client)

    def _new_link(self, client):
        family, stype, proto, addr = self._upstream_addr
        upstream = socket.socket(family, stype, proto)
        client.setblocking(False)
        upstream.setblocking(False)
        for s in (client, upstream):
            # Small request/reply messages: Nagle would add 40 ms here and there and make
            # timing-based tests lie.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(self._next_link_id, client, upstream)
        self._next_link_id += 1
        self._links[link.id] = link
        err = upstream.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._counters['upstream_connect_failures'] += 1
            self._close_link(link, reset=False, reason='connect: %s' % errno.errorcode.get(err))
            return
        self._log('link %d: accepted', link.id)
        self._update_interest(link)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self):
        try:
            while not self._stopping:
                events = self._sel.select(self._next_timeout())
                for key, mask in events:
                    what, link = key.data
                    if what == 'wake':
                        self._drain_wake()
                    elif what == 'listen':
                        if self._listener is not None:
                            self._accept()
                    elif not link.closed:
                        self._on_socket(link, key.fileobj, mask)
                self._run_commands()
                now = time.monotonic()
                for link in list(self._links.values()):
                    self._service(link, now)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self._loop_error = e
        finally:
            self._run_commands()  # nobody may be left waiting on an Event
            for link in list(self._links.values()):
                self._close_link(link, reset=False, reason='stop')
            self._close_loop_resources()

    def _close_loop_resources(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        self._wake_r = self._wake_w = None
        if self._sel is not None:
            self._sel.close()
            self._sel = None

    def _drain_wake(self):
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _next_timeout(self):
        """Sleep until the first delayed message is due; wake-ups cover everything else."""
        if self._fault.kind == STALL:
            return 1.0
        now = time.monotonic()
        timeout = 1.0
        for link in self._links.values():
            for d in (link.requests, link.replies):
                if d.held:
                    timeout = min(timeout, max(0.0, d.held[0][0] - now))
        return timeout

    def _on_socket(self, link, sock, mask):
        if link.connecting and sock is link.upstream:
            if mask & selectors.EVENT_WRITE:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._counters['upstream_connect_failures'] += 1
                    self._close_link(link, reset=False,
                                     reason='connect: %s' % errno.errorcode.get(err, err))
                    return
                link.connecting = False
            return
        if mask & selectors.EVENT_READ:
            d = link.requests if sock is link.client else link.replies
            self._read(link, d)
        if not link.closed and mask & selectors.EVENT_WRITE:
            d = link.replies if sock is link.client else link.requests
            self._write(link, d)

    def _read(self, link, d):
        try:
            chunk = d.src.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            # Pass a reset on: the other peer should see what a direct connection would show.
            self._close_link(link, reset=(e.errno == errno.ECONNRESET), reason='recv: %s' % e)
            return
        if not chunk:
            d.eof = True
            return
        d.inbuf += chunk
        now = time.monotonic()
        while len(d.inbuf) >= 16 and not link.closed:
            length = INT32.unpack_from(d.inbuf, 0)[0]
            if length < 16 or length > MAX_MESSAGE_SIZE:
                self._counters['protocol_errors'] += 1
                self._close_link(link, reset=False, reason='bad message length %d' % length)
                return
            if len(d.inbuf) < length:
                return
            data = bytes(d.inbuf[:length])
            del d.inbuf[:length]
            msg = parse_message(data)
            release_at = now
            if not d.upstream:
                action = link.actions.pop(msg.response_to, None)
                if action is not None:
                    if msg.more_to_come:  # the next reply of an exhaust stream answers this one
                        link.actions[msg.request_id] = action
                    if action.drop:
                        self._counters['replies_dropped'] += 1
                        self._close_link(link, reset=action.rst, reason='drop_reply')
                        return
                    if action.delay > 0:
                        self._counters['replies_delayed'] += 1
                        release_at = now + action.delay
            d.held.append([release_at, data, msg, False, False])
            d.held_bytes += len(data)

    def _write(self, link, d):
        if link.connecting or not d.outbuf:
            return
        try:
            n = d.dst.send(d.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._close_link(link, reset=(e.errno == errno.ECONNRESET), reason='send: %s' % e)
            return
        del d.outbuf[:n]
        self._counters['bytes_to_upstream' if d.upstream else 'bytes_to_client'] += n

    def _service(self, link, now):
        """Release due messages, write what can be written, notice finished connections."""
        stalled = self._fault.kind == STALL
        for d in (link.requests, link.replies):
            if link.closed:
                return
            if stalled:
                for entry in d.held:
                    if not entry[3]:
                        entry[3] = True
                        self._counters['messages_stalled'] += 1
            else:
                while d.held and d.held[0][0] <= now and not link.closed:
                    entry = d.held[0]
                    if d.upstream and not entry[4] and self._fault.kind == RACE_INSERT and \
                            self._start_race(link, entry):
                        break  # held until the racing insert has its reply
                    if d.upstream and self._races_in_flight and entry[2].is_write:
                        break  # no write overtakes a racing insert (from any connection)
                    _, data, msg, _, _ = d.held.popleft()
                    d.held_bytes -= len(data)
                    if d.upstream:
                        self._on_request_forwarded(link, msg)
                    else:
                        self._counters['replies_forwarded'] += 1
                    d.outbuf += data
            self._write(link, d)
        if link.closed:
            return
        # A peer that hung up: close the pair once everything it sent has been passed on (as TCP
        # would deliver it); a partial message left in inbuf could never be used.
        for d in (link.requests, link.replies):
            if d.eof and not d.held and not d.outbuf:
                self._close_link(link, reset=False, reason='eof from %s' %
                                 ('client' if d.upstream else 'upstream'))
                return
        self._update_interest(link)

    def _on_request_forwarded(self, link, msg):
        self._counters['requests_forwarded'] += 1
        if msg.is_write:
            self._counters['writes_forwarded'] += 1
        self._command_counts[msg.command or 'op%d' % msg.opcode] += 1
        fault = self._fault
        if not fault.matches(msg):
            return
        if fault.kind == DROP_REPLY:
            link.actions[msg.request_id] = _ReplyAction(drop=True, rst=fault.rst)
        else:
            link.actions[msg.request_id] = _ReplyAction(delay=fault.seconds)
        if fault.remaining is not None:
            fault.remaining -= 1
            if fault.remaining <= 0:
                self._fault = Fault()
                self._counters['faults_expired'] += 1
                self._log('fault: %s used up, back to pass', fault.kind)

    def _start_race(self, link, entry):
        """race_insert: if the request in entry is an update with upserts the fault names,
        hold it and insert the racing documents from a helper thread; True if held."""
        msg = entry[2]
        entry[4] = True  # decided once per request
        if msg.command != 'update':
            return False
        try:
            decoded = decode_op_msg(entry[1])
        except Exception as e:  # noqa: BLE001 - forwarded untouched, as any unreadable message
            self._log('race_insert: cannot read an update: %s', e)
            return False
        if decoded is None:
            return False
        body, sequences = decoded
        db, coll = body.get('$db'), body.get('update')
        statements = sequences.get('updates', body.get('updates'))
        if not isinstance(db, str) or not isinstance(coll, str) or \
                not isinstance(statements, list):
            return False
        fault = self._fault
        docs = []
        for st in statements:
            if fault.remaining is not None and fault.remaining <= len(docs):
                break
            _id = fault.race_matches(st)
            if _id is not ANY_ID:
                docs.append(fault.race_document(_id))
        if not docs:
            return False
        self._counters['races'] += len(docs)
        if fault.remaining is not None:
            fault.remaining -= len(docs)
            if fault.remaining <= 0:
                self._fault = Fault()
                self._counters['faults_expired'] += 1
                self._log('fault: race_insert used up, back to pass')
        entry[0] = float('inf')
        self._log('link %d: race_insert of %d document(s) into %s.%s before forwarding',
                  link.id, len(docs), db, coll)
        self._races_in_flight += 1
        t = threading.Thread(target=self._race, args=(link, entry, db, coll, docs),
                             name='fault-proxy-race:%d' % self.port, daemon=True)
        self._race_threads = [x for x in self._race_threads if x.is_alive()] + [t]
        t.start()
        return True

    def _race(self, link, entry, db, coll, docs):
        """Helper thread: insert the racing documents, then let the held request go."""
        inserted, error = 0, None
        try:
            client = self._upstream_client()
            for doc in docs:
                try:
                    client[db][coll].insert_one(doc)
                    inserted += 1
                except Exception as e:  # noqa: BLE001 - reported in the counters
                    error = '%s: %s' % (type(e).__name__, e)
        except Exception as e:  # noqa: BLE001 - no client: the request still goes on
            error = '%s: %s' % (type(e).__name__, e)

        def release():
            self._races_in_flight -= 1
            self._counters['race_inserts'] += inserted
            if error is not None:
                self._counters['race_insert_errors'] += len(docs) - inserted
                self._race_error = error
                self._log('race_insert: %s', error)
            entry[0] = 0.0  # the request may go (if its connection is still there)
        self._post(release)

    def _upstream_client(self):
        with self._race_lock:
            if self._race_client is None:
                import pymongo
                uri = self.upstream_uri or 'mongodb://%s:%d/?directConnection=true' % (
                    ('[%s]' % self.upstream_host) if ':' in self.upstream_host
                    else self.upstream_host, self.upstream_port)
                self._race_client = pymongo.MongoClient(
                    uri, serverSelectionTimeoutMS=10000, connectTimeoutMS=10000,
                    socketTimeoutMS=30000, appname='fault_proxy race_insert')
            return self._race_client

    def _post(self, fn):
        """Run fn in the proxy thread without waiting for it (helper threads)."""
        self._commands.append((fn, threading.Event(), {}))
        self._wake()

    def _update_interest(self, link):
        want_client = 0
        want_upstream = 0
        if link.connecting:
            want_upstream = selectors.EVENT_WRITE
        else:
            if link.requests.outbuf:
                want_upstream |= selectors.EVENT_WRITE
            if not link.replies.eof and link.replies.queued_bytes() < BACKPRESSURE_BYTES:
                want_upstream |= selectors.EVENT_READ
        if link.replies.outbuf:
            want_client |= selectors.EVENT_WRITE
        if not link.requests.eof and link.requests.queued_bytes() < BACKPRESSURE_BYTES:
            want_client |= selectors.EVENT_READ
        for sock, want in ((link.client, want_client), (link.upstream, want_upstream)):
            have = link.masks[sock]
            if want == have:
                continue
            if have == 0:
                self._sel.register(sock, want, ('link', link))
            elif want == 0:
                self._sel.unregister(sock)
            else:
                self._sel.modify(sock, want, ('link', link))
            link.masks[sock] = want

    def _close_link(self, link, reset, reason):
        if link.closed:
            return
        link.closed = True
        self._links.pop(link.id, None)
        for sock in (link.client, link.upstream):
            if link.masks.get(sock):
                self._sel.unregister(sock)
            if reset:
                _abort(sock)
            else:
                sock.close()
        self._log('link %d: %s (%s)', link.id, 'reset' if reset else 'closed', reason)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

CONTROL_HELP = ('pass | drop_reply [writes] [commands=a,b] [count=N] [rst] | '
                'delay SECONDS [writes] [commands=a,b] [count=N] | stall | '
                'refuse|reset|unlisten [existing=keep|close|reset] | '
                'race_insert [id=ID] [count=N] [fields=JSON | document=JSON] | kill [close] | '
                'stats | fault | help | quit | shutdown')

_TRUE = ('1', 'true', 'yes', 'on')


def _json_value(text):
    """A value given on the control port: Extended JSON when it starts like JSON (a quoted
    string, an object, an array), else the text itself (most _ids are plain strings)."""
    if text[:1] in ('"', '{', '['):
        from bson import json_util
        try:
            return json_util.loads(text)
        except ValueError as e:
            raise ValueError('bad JSON %r: %s' % (text, e))
    return text


def parse_fault_words(words):
    """('drop_reply', {'writes_only': True, 'count': 2}) for ['drop_reply', 'writes', 'count=2']."""
    kind = words[0]
    opts = {}
    for word in words[1:]:
        key, eq, value = word.partition('=')
        if not eq:
            if key in ('writes', 'rst'):
                value = '1'
            elif kind == DELAY and 'seconds' not in opts:
                key, value = 'seconds', key
            else:
                raise ValueError('unexpected %r' % word)
        if key in ('writes', 'writes_only'):
            opts['writes_only'] = value.lower() in _TRUE
        elif key == 'rst':
            opts['rst'] = value.lower() in _TRUE
        elif key == 'seconds':
            opts['seconds'] = float(value)
        elif key == 'count':
            opts['count'] = int(value)
        elif key == 'commands':
            opts['commands'] = [c for c in value.split(',') if c]
        elif key == 'existing':
            opts['existing'] = value
        elif key == 'id':
            opts['match_id'] = _json_value(value)
        elif key in ('fields', 'document'):
            opts[key] = _json_value(value)
        else:
            raise ValueError('unknown option %r' % key)
    return kind, opts


def control_command(proxy, line):
    """Run one control line; returns (reply line, keep the connection, shut down).  Words
    are split as a shell would (quotes keep JSON with spaces together)."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        return 'error %s' % e, True, False
    if not words:
        return None, True, False
    cmd = words[0].lower()
    try:
        if cmd == 'help':
            return 'ok ' + CONTROL_HELP, True, False
        if cmd == 'quit':
            return 'ok bye', False, False
        if cmd == 'shutdown':
            return 'ok shutting down', False, True
        if cmd == 'stats':
            return 'ok ' + json.dumps(proxy.stats(), sort_keys=True), True, False
        if cmd == 'fault':
            return 'ok ' + proxy.fault(), True, False
        if cmd == 'kill':
            if words[1:] == ['close']:
                return 'ok closed %d' % proxy.close_connections(), True, False
            if words[1:] not in ([], ['reset']):
                raise ValueError('kill takes "close" or "reset"')
            return 'ok reset %d' % proxy.reset_connections(), True, False
        words[0] = cmd
        kind, opts = parse_fault_words(words)
        return 'ok ' + proxy.set_fault(kind, **opts), True, False
    except (ValueError, TypeError, OSError) as e:
        return 'error %s' % e, True, False


def _hostport(text):
    host, sep, port = text.rpartition(':')
    if not sep or not host:
        raise argparse.ArgumentTypeError('expected HOST:PORT, got %r' % text)
    try:
        return host.strip('[]'), int(port)
    except ValueError:
        raise argparse.ArgumentTypeError('bad port in %r' % text)


def _serve_control(proxy, control_sock, stop_flag):
    """Line-based control connections, in the main thread, until shutdown or a signal."""
    sel = selectors.DefaultSelector()
    sel.register(control_sock, selectors.EVENT_READ, None)
    buffers = {}
    try:
        while not stop_flag:
            # A short timeout so that a signal's flag is noticed promptly.
            for key, _ in sel.select(0.2):
                sock = key.fileobj
                if sock is control_sock:
                    try:
                        conn, _ = control_sock.accept()
                    except OSError:
                        continue
                    buffers[conn] = bytearray()
                    sel.register(conn, selectors.EVENT_READ, None)
                    continue
                try:
                    chunk = sock.recv(4096)
                except OSError:
                    chunk = b''
                keep = bool(chunk)
                buf = buffers[sock]
                buf += chunk
                if len(buf) > 65536:  # nobody types that much; do not grow without bound
                    keep = False
                while keep and b'\n' in buf:
                    line, _, rest = bytes(buf).partition(b'\n')
                    buf[:] = rest
                    reply, keep, shutdown = control_command(
                        proxy, line.decode('utf-8', 'replace'))
                    if reply is not None:
                        try:
                            sock.sendall((reply + '\n').encode())
                        except OSError:
                            keep = False
                    if shutdown:
                        stop_flag.append('shutdown')
                if not keep:
                    sel.unregister(sock)
                    sock.close()
                    del buffers[sock]
    finally:
        for sock in list(buffers):
            sock.close()
        sel.close()


def main(argv=None):
    parser = argparse.ArgumentParser(
        description='Fault-injecting MongoDB wire-protocol proxy (see the module docstring).')
    parser.add_argument('--listen', type=_hostport, default=('127.0.0.1', 0),
                        help='address for clients (default 127.0.0.1:0, a free port)')
    parser.add_argument('--upstream', type=_hostport, required=True,
                        help='the MongoDB server, HOST:PORT')
    parser.add_argument('--upstream-uri', default=None,
                        help='URI for race_insert\'s own connection to the server (default '
                             'mongodb://UPSTREAM/?directConnection=true)')
    parser.add_argument('--control', type=_hostport, default=('127.0.0.1', 0),
                        help='line-based control port (default 127.0.0.1:0, a free port)')
    parser.add_argument('--fault', default='pass',
                        help='initial fault, as a control line (e.g. "drop_reply writes")')
    parser.add_argument('--verbose', action='store_true',
                        help='log connections and fault changes to stderr')
    args = parser.parse_args(argv)

    log = (lambda line: print('fault_proxy: ' + line, file=sys.stderr, flush=True)) \
        if args.verbose else None
    proxy = FaultProxy(args.upstream[0], args.upstream[1], args.listen[0], args.listen[1],
                       log=log, upstream_uri=args.upstream_uri)
    kind, opts = parse_fault_words(shlex.split(args.fault))
    proxy.set_fault(kind, **opts)
    control_sock = socket.create_server(args.control, reuse_port=False)
    stop_flag = []

    def on_stop(signum, frame):
        stop_flag.append(signum)

    def on_usr1(signum, frame):
        print(json.dumps(proxy.stats(), sort_keys=True), file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, on_usr1)
    try:
        port = proxy.start()
        print('listen %s:%d' % (args.listen[0], port))
        print('control %s:%d' % control_sock.getsockname()[:2], flush=True)
        _serve_control(proxy, control_sock, stop_flag)
    finally:
        control_sock.close()
        proxy.stop()
    return 0


if __name__ == '__main__':
    sys.exit(main())
