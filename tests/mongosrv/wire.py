"""The wire protocol: framing of requests and replies, and the server's connections.

OP_MSG (with document sequences) and OP_QUERY handshakes as python3-mockupdb parses them,
replies encoded here with MongoDB's size limits (BSONObjectTooLarge for a command or document
sequence over 16 MiB + 16 KiB, the connection closed for a message over maxMessageSizeBytes),
and WireServer, which accepts connections and hands each command to Backend.
"""

import itertools
import socket
import struct
import sys
import time

import bson
import mockupdb

from .bsonvalues import (MAX_BSON_SIZE, MAX_INTERNAL_BSON_SIZE, MAX_MESSAGE_SIZE,
                         OP_MSG_MORE_TO_COME)
from .errors import error_reply


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise EOFError('connection closed')
        pos += got
    return bytes(buf)


_reply_ids = itertools.count(1)


def _encode_reply(doc):
    try:
        payload = bson.encode(doc)
    except Exception as e:  # a reply we cannot encode becomes an error reply
        payload = bson.encode(error_reply(2, 'cannot encode reply: %s' % e))
    if len(payload) > MAX_BSON_SIZE + 16 * 1024:
        payload = bson.encode(error_reply(10334, 'BSONObj size: %d is invalid. Size must be '
                                                 'between 0 and 16793600(16MB)' % len(payload)))
    return payload


def _oversized_section(body):
    """The error message if an OP_MSG carries a document over BSONObjMaxInternalSize (its
    body, or one document of a sequence, e.g. one update statement), else None.  Only the
    length prefixes are read; anything malformed is left to the parser."""
    try:
        flags = struct.unpack_from('<I', body, 0)[0]
        end = len(body) - (4 if flags & 1 else 0)
        pos = 4
        while pos < end:
            kind = body[pos]
            pos += 1
            if kind == 0:
                starts = [pos]
                pos += struct.unpack_from('<i', body, pos)[0]
            elif kind == 1:
                size = struct.unpack_from('<i', body, pos)[0]
                if size < 5:
                    return None
                section_end = pos + size
                p = body.index(b'\x00', pos + 4) + 1
                starts = []
                while p < section_end:
                    starts.append(p)
                    n = struct.unpack_from('<i', body, p)[0]
                    if n < 5:
                        return None
                    p += n
                pos = section_end
            else:
                return None
            for start in starts:
                n = struct.unpack_from('<i', body, start)[0]
                if n > MAX_INTERNAL_BSON_SIZE:
                    key_end = body.index(b'\x00', start + 5)
                    first = body[start + 5:key_end].decode('utf-8', 'replace')
                    # As BSONObj::_assertInvalid words it (src/mongo/bson/bsonobj.cpp).
                    return ('BSONObj size: %d (0x%X) is invalid. Size must be between 0 and '
                            '%d(%dMB) First element: %s: ?' % (
                                n, n, MAX_INTERNAL_BSON_SIZE,
                                MAX_INTERNAL_BSON_SIZE // (1024 * 1024), first))
    except (struct.error, ValueError, IndexError):
        return None
    return None


def _send_msg(sock, response_to, doc):
    """An OP_MSG reply built by hand (for requests mockupdb never parsed)."""
    payload = _encode_reply(doc)
    header = struct.pack('<iiiiIb', 21 + len(payload), next(_reply_ids) & 0x7fffffff,
                         response_to, mockupdb.OP_MSG, 0, 0)
    sock.sendall(header + payload)


def send_reply(request, doc, query_failure=False):
    """Answer a request in kind: OP_MSG for OP_MSG, OP_REPLY for OP_QUERY."""
    reply_id = next(_reply_ids) & 0x7fffffff
    payload = _encode_reply(doc)
    if isinstance(request, mockupdb.OpMsg):
        if request.flags & OP_MSG_MORE_TO_COME:
            return
        header = struct.pack('<iiiiIb', 21 + len(payload), reply_id, request.request_id,
                             mockupdb.OP_MSG, 0, 0)
    else:
        flags = 2 if query_failure else 0
        header = struct.pack('<iiiiiqii', 36 + len(payload), reply_id, request.request_id,
                             mockupdb.OP_REPLY, flags, 0, 0, 1)
    request._client.sendall(header + payload)


class WireServer(mockupdb.MockupDB):
    """mockupdb's server with its per-connection loop replaced: requests go
    straight to one handler (every request is ours, so no matching), are not
    formatted for the debug log, and run without mockupdb's server lock
    (the backend has its own)."""

    def __init__(self, backend, port=None, verbose=False):
        mockupdb.MockupDB.__init__(self, port=port, verbose=False, request_timeout=int(1e6))
        self._address = ('127.0.0.1', port or 0)
        self._backend = backend
        self._bd_verbose = verbose
        self._conn_ids = itertools.count(1)

    def _server_loop(self, client, client_addr):
        conn_id = next(self._conn_ids)
        backend = self._backend
        backend.connections[conn_id] = client_addr
        backend.total_connections += 1
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        try:
            while not self._stopped:
                try:
                    header = _recv_exact(client, 16)
                    length, request_id, _, opcode = struct.unpack('<iiii', header)
                    if length < 16 or length > MAX_MESSAGE_SIZE:
                        break
                    body = _recv_exact(client, length - 16)
                except (OSError, EOFError):
                    break
                if opcode == mockupdb.OP_MSG:
                    too_large = _oversized_section(body)
                    if too_large is not None:
                        # mongod fails the command while parsing it (BSONObj's size check)
                        # and answers with the error; the connection stays usable.
                        if not struct.unpack_from('<I', body, 0)[0] & OP_MSG_MORE_TO_COME:
                            _send_msg(client, request_id, error_reply(10334, too_large))
                        continue
                cls = mockupdb.OPCODES.get(opcode)
                if cls is None:
                    self._log_line('connection %d: unsupported opcode %d' % (conn_id, opcode))
                    break
                try:
                    request = cls.unpack(body, client, self, request_id)
                except Exception as e:  # malformed message: drop the connection
                    self._log_line('connection %d: bad message: %s' % (conn_id, e))
                    break
                self._requests_count += 1
                try:
                    if self.handle(request, conn_id) is False:
                        break  # closeConnection of a fail point
                except OSError:
                    break
        finally:
            backend.connections.pop(conn_id, None)
            backend.forget_connection(conn_id)
            try:
                client.close()
            except OSError:
                pass

    def _log_line(self, msg):
        if self._bd_verbose:
            sys.stderr.write('mongo_server: %s\n' % msg)
            sys.stderr.flush()

    def handle(self, request, conn_id):
        if isinstance(request, (mockupdb.OpMsg, mockupdb.Command)):
            cmd = request.doc
            if isinstance(request, mockupdb.OpMsg):
                db = cmd.get('$db') or request.namespace
            else:
                db = request.namespace
                if '$query' in cmd and isinstance(cmd['$query'], dict):
                    cmd = cmd['$query']
            started = time.perf_counter()
            backend = self._backend
            name = next(iter(cmd)) if cmd else ''
            if name in ('hello', 'isMaster', 'ismaster'):
                backend.note_client(conn_id, cmd)
            action = backend.fail_command_before(db, name, cmd, conn_id)
            reply = None
            if action is not None:
                if action.block_ms:
                    time.sleep(action.block_ms / 1000.0)
                if action.close:
                    self._log_line('conn%d %s: closeConnection (failCommand)' % (conn_id, name))
                    return False
                reply = action.reply
            if reply is None:
                reply = backend.run(db, cmd, conn_id,
                                    action.write_errors if action is not None else None)
                backend.fail_command_after(db, name, cmd, conn_id, reply)
            send_reply(request, reply)
            if self._bd_verbose:
                name = next(iter(cmd)) if cmd else '?'
                target = cmd.get(name) if isinstance(cmd.get(name), str) else ''
                if name == 'getMore':
                    target = cmd.get('collection', '')
                status = 'ok' if reply.get('ok') else 'error %s: %s' % (
                    reply.get('code'), reply.get('errmsg'))
                extra = ''
                if reply.get('writeErrors'):
                    extra = ' writeErrors=%d' % len(reply['writeErrors'])
                self._log_line('conn%d %s %s.%s %.2fms %s%s' % (
                    conn_id, name, db, target, (time.perf_counter() - started) * 1000,
                    status, extra))
        elif isinstance(request, mockupdb.OpQuery):
            send_reply(request, {'$err': 'legacy OP_QUERY find is not supported; use the find '
                                         'command', 'code': 352}, query_failure=True)
        elif isinstance(request, mockupdb.OpGetMore):
            reply_id = next(_reply_ids) & 0x7fffffff
            request._client.sendall(struct.pack('<iiiiiqii', 36, reply_id, request.request_id,
                                                mockupdb.OP_REPLY, 1, 0, 0, 0))
        # Legacy OP_INSERT/OP_UPDATE/OP_DELETE/OP_KILL_CURSORS get no reply.
        return True

    def shutdown(self):
        """Stop accepting, drop every connection; does not wait for threads."""
        self._stopped = True
        try:
            self._listening_sock.close()
        except OSError:
            pass
        for sock in list(self._server_socks):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
