"""Backend: runs one command against the in-memory data.

Command dispatch (cmd_<name> methods, from this class and its mixins: failpoints, catalog,
writes, reads), the write-concern check of a standalone, cursors (first batches, getMore,
killCursors) and the handshake and administration commands drivers send on connect.  One lock
serialises all commands: mongomock is not thread-safe.
"""

import os
import random
import socket
import sys
import threading
import time
import traceback
import uuid

import bson
from bson.binary import Binary
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
import mongomock
from pymongo.errors import DuplicateKeyError, OperationFailure

from .bsonvalues import (BATCH_HEADROOM, CURSOR_IDLE_SECONDS, DEFAULT_BATCH, INT64_MAX,
                         MAX_BSON_SIZE, MAX_MESSAGE_SIZE, MAX_WIRE_VERSION, MAX_WRITE_BATCH,
                         SERVER_VERSION, SESSION_TIMEOUT_MINUTES, VERSION_ARRAY, _now, _num_value,
                         is_number, type_name)
from .catalog import CatalogCommands
from .commands import _Cursor, _as_int, _check_coll_name, _check_db_name
from .errors import CommandError, DupKeyError, error_reply
from .expressions import UNSTABLE_SORT_ARRAY
from .failpoints import FailPoint, FailPointCommands
from .reads import ReadCommands
from .store import FastCollection
from .writes import WriteCommands


class Backend(FailPointCommands, CatalogCommands, WriteCommands, ReadCommands):
    """Executes commands against the in-memory data.  One lock serialises
    all commands: mongomock is not thread-safe."""

    def __init__(self, verbose=False, shard_key=None, unstable_sort_array=False,
                 max_write_batch=MAX_WRITE_BATCH):
        """shard_key: None, or the [(path, 1 | 'hashed')] of parse_shard_key that every
        collection of a user database is sharded by (--sharded); max_write_batch: hello's
        maxWriteBatchSize and the most statements a write command may carry
        (--max-write-batch)."""
        self.verbose = verbose
        self.max_write_batch = max_write_batch
        self.shard_key = shard_key
        UNSTABLE_SORT_ARRAY[0] = bool(unstable_sort_array)
        # Rewrite-cost counters per (db, collection): see cmd_bucketdTestStats.
        self.write_stats = {}
        # Statements of the running write command that a failCommand writeErrorCode fails:
        # None, or (code, indexes or None for all).
        self.failing_writes = None
        self.lock = threading.Lock()
        self.client = mongomock.MongoClient()
        self.server_store = self.client._store
        self.colls = {}
        self.cursors = {}
        self.started = time.time()
        self.connections = {}
        self.total_connections = 0
        self.opcounters = dict.fromkeys(
            ('insert', 'query', 'update', 'delete', 'getmore', 'command'), 0)
        self.process_id = ObjectId()
        # Fail points (configureFailPoint) and the appName each connection gave in its
        # handshake; both are read by connection threads outside self.lock.
        self.fp_lock = threading.Lock()
        self.fail_points = {'failCommand': FailPoint()}
        self.conn_app = {}
        self.commands = {}
        for name in dir(self):
            if name.startswith('cmd_'):
                self.commands[name[4:]] = getattr(self, name)
        aliases = {'isMaster': 'hello', 'ismaster': 'hello', 'buildinfo': 'buildInfo',
                   'findandmodify': 'findAndModify', 'getlasterror': 'getLastError'}
        for alias, target in aliases.items():
            self.commands[alias] = self.commands[target]

    # -- plumbing ----------------------------------------------------------

    def coll(self, db, name):
        key = (db, name)
        c = self.colls.get(key)
        if c is None:
            database = self.client[db]
            c = FastCollection(database, name, _db_store=database._store)
            c._write_stats = self.write_stats.setdefault(key, [0, 0])
            self.colls[key] = c
        return c

    def sharded(self, db, coll_name):
        """Whether --sharded applies to this collection: every collection but those of the
        admin, config and local databases and the system.* ones, which are never sharded."""
        return (self.shard_key is not None and db not in ('admin', 'config', 'local')
                and not coll_name.startswith('system.'))

    def _collection_arg(self, db, cmd, name):
        coll_name = cmd[name]
        _check_coll_name(db, coll_name)
        return coll_name, self.coll(db, coll_name)

    def run(self, db, cmd, conn_id, failing_writes=None):
        """Run one command; failing_writes: what a failCommand writeErrorCode fails in it
        (see fail_command_before)."""
        if not cmd:
            return error_reply(59, "no such command: ''")
        name = next(iter(cmd))
        handler = self.commands.get(name)
        if handler is None:
            return error_reply(59, "no such command: '%s'" % name)
        try:
            _check_db_name(db)
            if 'txnNumber' in cmd:
                # A standalone mongod (what hello says this is) has no retryable writes or
                # transactions; drivers know and never send a txnNumber to one.
                raise CommandError(20, 'Transaction numbers are only allowed on a replica set '
                                       'member or mongos')
            with self.lock:
                self.failing_writes = failing_writes
                try:
                    return handler(db, cmd, name, conn_id)
                finally:
                    self.failing_writes = None
        except CommandError as e:
            return error_reply(e.code, e.msg, **e.extra)
        except DuplicateKeyError as e:
            extra = e.key_fields() if isinstance(e, DupKeyError) else {}
            return error_reply(11000, str(e), **extra)
        except OperationFailure as e:
            return error_reply(e.code or 2, str(e))
        except NotImplementedError as e:
            return error_reply(238, 'not supported by the test server: %s' % e)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError,
                bson.errors.BSONError) as e:
            if self.verbose:
                traceback.print_exc()
            return error_reply(2, '%s: %s' % (type(e).__name__, e))
        except Exception as e:  # never let a command take the server down
            if self.verbose:
                traceback.print_exc()
            return error_reply(1, 'internal error: %s: %s' % (type(e).__name__, e))

    def _check_write_concern(self, cmd):
        wc = cmd.get('writeConcern')
        if isinstance(wc, dict):
            w = wc.get('w', 1)
            if is_number(w) and _num_value(w) > 1:
                raise CommandError(2, "cannot use 'w' > 1 on a standalone")
            if isinstance(w, str) and w != 'majority':
                raise CommandError(79, "No write concern mode named '%s' found in replica "
                                       "set configuration" % w)


    # -- cursors -----------------------------------------------------------

    def _reap_cursors(self):
        if len(self.cursors) < 64:
            return
        limit = time.time() - CURSOR_IDLE_SECONDS
        for cid in [c.id for c in self.cursors.values() if c.used < limit]:
            del self.cursors[cid]

    def _batch(self, cursor, batch_size):
        docs = cursor.docs
        pos = cursor.pos
        end = len(docs)
        out = []
        size = 0
        while pos < end and (batch_size is None or len(out) < batch_size):
            raw = RawBSONDocument(bson.encode(docs[pos]))
            # An array element also carries its type byte and its index as a C string.
            n = len(raw.raw) + len(str(len(out))) + 2
            # The batch travels inside a reply document that must itself stay under the BSON
            # limit, so leave room for the envelope, as mongod does.
            if out and size + n > MAX_BSON_SIZE - BATCH_HEADROOM:
                break
            out.append(raw)
            size += n
            pos += 1
        cursor.pos = pos
        cursor.used = time.time()
        return out

    def cursor_reply(self, ns, docs, batch_size=None, single_batch=False):
        cursor = _Cursor()
        cursor.ns = ns
        cursor.docs = docs
        cursor.pos = 0
        cursor.id = 0
        first = self._batch(cursor, DEFAULT_BATCH if batch_size is None else batch_size)
        if cursor.pos < len(docs) and not single_batch:
            self._reap_cursors()
            cid = random.randint(1, INT64_MAX)
            while cid in self.cursors:
                cid = random.randint(1, INT64_MAX)
            cursor.id = cid
            self.cursors[cid] = cursor
        return {'cursor': {'firstBatch': first, 'id': Int64(cursor.id), 'ns': ns}, 'ok': 1.0}

    def cmd_getMore(self, db, cmd, name, conn):
        self.opcounters['getmore'] += 1
        cid = cmd['getMore']
        coll_name = cmd.get('collection')
        if not isinstance(cid, int):
            raise CommandError(14, "BSON field 'getMore.getMore' is the wrong type '%s', "
                                   "expected type 'long'" % type_name(cid))
        cursor = self.cursors.get(int(cid))
        if cursor is None:
            raise CommandError(43, 'cursor id %d not found' % cid)
        ns = '%s.%s' % (db, coll_name)
        if cursor.ns != ns:
            raise CommandError(13, "Requested getMore on namespace '%s', but cursor belongs "
                                   "to a different namespace %s" % (ns, cursor.ns))
        batch = self._batch(cursor, _as_int(cmd.get('batchSize'), 'batchSize', 0) or None)
        cid_out = cursor.id
        if cursor.pos >= len(cursor.docs):
            del self.cursors[cursor.id]
            cid_out = 0
        return {'cursor': {'nextBatch': batch, 'id': Int64(cid_out), 'ns': cursor.ns},
                'ok': 1.0}

    def cmd_killCursors(self, db, cmd, name, conn):
        killed, not_found = [], []
        for cid in cmd.get('cursors') or []:
            if self.cursors.pop(int(cid), None) is not None:
                killed.append(Int64(cid))
            else:
                not_found.append(Int64(cid))
        return {'cursorsKilled': killed, 'cursorsNotFound': not_found, 'cursorsAlive': [],
                'cursorsUnknown': [], 'ok': 1.0}

    # -- handshake and administration -------------------------------------

    def cmd_hello(self, db, cmd, name, conn):
        # A standalone 6.0 without topologyVersion: drivers then poll with
        # plain hellos instead of the streaming (awaitable hello) protocol.
        self.opcounters['command'] += 1
        doc = {}
        if cmd.get('helloOk'):
            doc['helloOk'] = True
        if name == 'hello':
            doc['isWritablePrimary'] = True
        else:
            doc['ismaster'] = True
        doc.update({
            'maxBsonObjectSize': MAX_BSON_SIZE,
            'maxMessageSizeBytes': MAX_MESSAGE_SIZE,
            'maxWriteBatchSize': self.max_write_batch,
            'localTime': _now(),
            'logicalSessionTimeoutMinutes': SESSION_TIMEOUT_MINUTES,
            'connectionId': conn,
            'minWireVersion': 0,
            'maxWireVersion': MAX_WIRE_VERSION,
            'readOnly': False,
            'ok': 1.0,
        })
        return doc

    def cmd_ping(self, db, cmd, name, conn):
        self.opcounters['command'] += 1
        return {'ok': 1.0}

    def cmd_buildInfo(self, db, cmd, name, conn):
        return {
            'version': SERVER_VERSION, 'gitVersion': '0' * 40, 'modules': [],
            'allocator': 'system', 'javascriptEngine': 'none', 'sysInfo': 'deprecated',
            'versionArray': list(VERSION_ARRAY),
            'openssl': {'running': 'disabled', 'compiled': 'disabled'},
            'buildEnvironment': {}, 'bits': 64, 'debug': False,
            'maxBsonObjectSize': MAX_BSON_SIZE,
            'storageEngines': ['ephemeralForTest'], 'ok': 1.0,
        }

    def cmd_serverStatus(self, db, cmd, name, conn):
        now = time.time()
        return {
            'host': socket.gethostname(), 'version': SERVER_VERSION, 'process': 'mongod',
            'pid': Int64(os.getpid()), 'uptime': float(int(now - self.started)),
            'uptimeMillis': Int64(int((now - self.started) * 1000)),
            'uptimeEstimate': Int64(int(now - self.started)), 'localTime': _now(),
            'connections': {'current': len(self.connections), 'available': 1000,
                            'totalCreated': self.total_connections, 'active': 1},
            'opcounters': dict(self.opcounters),
            'mem': {'bits': 64, 'resident': 0, 'virtual': 0, 'supported': False},
            'storageEngine': {'name': 'ephemeralForTest', 'supportsCommittedReads': False,
                              'persistent': False},
            'ok': 1.0,
        }

    def cmd_getParameter(self, db, cmd, name, conn):
        known = {'featureCompatibilityVersion': {'version': '6.0'},
                 'authenticationMechanisms': [], 'logLevel': 0,
                 'maxBSONDepth': 200}
        if cmd.get('getParameter') == '*':
            out = dict(known)
        else:
            out = {k: known[k] for k in cmd if k in known}
            if not out:
                raise CommandError(72, 'no option found to get')
        out['ok'] = 1.0
        return out

    def cmd_endSessions(self, db, cmd, name, conn):
        return {'ok': 1.0}

    cmd_refreshSessions = cmd_endSessions
    cmd_killSessions = cmd_endSessions
    cmd_killAllSessions = cmd_endSessions
    cmd_resetError = cmd_endSessions
    cmd_fsync = cmd_endSessions

    def cmd_startSession(self, db, cmd, name, conn):
        return {'id': {'id': Binary(uuid.uuid4().bytes, 4)},
                'timeoutMinutes': SESSION_TIMEOUT_MINUTES, 'ok': 1.0}

    def cmd_getLastError(self, db, cmd, name, conn):
        return {'err': None, 'n': 0, 'connectionId': conn, 'ok': 1.0}

    def cmd_whatsmyuri(self, db, cmd, name, conn):
        return {'you': '127.0.0.1:0', 'ok': 1.0}

    def cmd_connectionStatus(self, db, cmd, name, conn):
        return {'authInfo': {'authenticatedUsers': [], 'authenticatedUserRoles': []},
                'ok': 1.0}

    def cmd_getCmdLineOpts(self, db, cmd, name, conn):
        return {'argv': list(sys.argv), 'parsed': {}, 'ok': 1.0}

    def cmd_hostInfo(self, db, cmd, name, conn):
        return {'system': {'hostname': socket.gethostname(), 'cpuAddrSize': 64,
                           'numCores': os.cpu_count() or 1, 'cpuArch': os.uname().machine},
                'os': {'type': os.uname().sysname, 'name': os.uname().sysname,
                       'version': os.uname().release},
                'extra': {}, 'ok': 1.0}

    def cmd_getLog(self, db, cmd, name, conn):
        if cmd.get('getLog') == '*':
            return {'names': ['global', 'startupWarnings'], 'ok': 1.0}
        return {'totalLinesWritten': 0, 'log': [], 'ok': 1.0}

    def cmd_replSetGetStatus(self, db, cmd, name, conn):
        raise CommandError(76, 'not running with --replSet')
