#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Tests for the fault-injecting proxy (tests/fault_proxy.py), through pymongo.

Run: /usr/bin/python3 tests/e2e/test_fault_proxy.py

The proxy sits between pymongo and the MongoDB test server (or, with BUCKETD_TEST_MONGODB_URI
set, that MongoDB: the proxy then forwards to its primary and the test client keeps the URI's
credentials and options).  Each fault is proven from the client's side (the error it gets, the
time it waits) and from the server's side (what a direct client reads), and each test ends by
switching back to pass and checking that the client recovers.

Timing is only ever bounded from below (a delayed reply takes at least the delay); recovery and
counters are polled with generous deadlines, so a slow machine makes the tests slower, not red.
"""

import datetime
import os
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for fault_proxy

from mongo_fixture import PYTHON, external_uri, start_mongo, unique_db_name  # noqa: E402

import fault_proxy  # noqa: E402
from fault_proxy import FaultProxy, parse_message  # noqa: E402

import bson  # noqa: E402
import pymongo  # noqa: E402
from pymongo import uri_parser  # noqa: E402
from pymongo import UpdateOne  # noqa: E402
from pymongo.errors import (BulkWriteError, ConnectionFailure, DuplicateKeyError,  # noqa: E402
                            NetworkTimeout)

PROXY_SCRIPT = os.path.join(os.path.dirname(HERE), 'fault_proxy.py')
EXTERNAL = external_uri() is not None

# How long the client waits for a usable server while the proxy refuses.  Short, so that each
# refused operation fails fast; recovery is polled separately with RECOVERY_TIMEOUT.
SELECTION_TIMEOUT_MS = 1000
RECOVERY_TIMEOUT = 20.0

server = None       # the test server (None for an external MongoDB)
direct = None       # pymongo client straight to the server: the ground truth
upstream = None     # (host, port) the proxy forwards to
db_name = None


def setUpModule():
    global server, direct, upstream, db_name
    server = start_mongo()
    uri = server.uri
    parsed = uri_parser.parse_uri(uri)
    opts = {k.lower(): v for k, v in parsed['options'].items()}
    if opts.get('tls') or opts.get('ssl') or uri.startswith('mongodb+srv://'):
        server.stop()
        raise unittest.SkipTest('the proxy must read the messages: TLS cannot be proxied')
    direct = pymongo.MongoClient(uri, serverSelectionTimeoutMS=10000)
    # Writes must reach the primary; a replica set's hello names it.
    primary = direct.admin.command('hello').get('primary')
    if primary:
        host, _, port = primary.rpartition(':')
        upstream = (host, int(port))
    else:
        upstream = parsed['nodelist'][0]
    db_name = unique_db_name('bucketd_fault_proxy')


def tearDownModule():
    global direct, server
    try:
        if direct is not None:
            direct.drop_database(db_name)
            direct.close()
    finally:
        if server is not None:
            server.stop()


def proxied_uri(port):
    """The server's URI with its hosts replaced by the proxy.

    directConnection: a driver that saw the replica set's real members would connect to them
    and bypass the proxy.  No compressors: a filter on command names must be able to read
    every message, and snappy/zstd may not be installed here."""
    scheme, _, rest = server.uri.partition('://')
    authority, slash, tail = rest.partition('/')
    userinfo, at, _ = authority.rpartition('@')
    path, _, query = tail.partition('?')
    dropped = ('replicaset', 'directconnection', 'compressors', 'zlibcompressionlevel',
               'loadbalanced')
    params = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)
              if k.lower() not in dropped]
    params.append(('directConnection', 'true'))
    return '%s://%s%s127.0.0.1:%d/%s?%s' % (scheme, userinfo, at, port, path,
                                            urllib.parse.urlencode(params))


def proxy_threads():
    return [t for t in threading.enumerate() if t.name.startswith('fault-proxy')]


def closed_by_peer(sock):
    """True once the peer closed sock: EOF, or a reset (the kernel sends RST instead of FIN
    when a socket is closed with unread bytes, or while it still waits in the accept queue)."""
    try:
        return sock.recv(16) == b''
    except ConnectionResetError:
        return True


def wait_for(cond, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


class ProxyCase(unittest.TestCase):
    """A proxy per test, a client through it, and a collection per test."""

    def setUp(self):
        self.proxy = FaultProxy(*upstream)
        self.port = self.proxy.start()
        self.clients = []
        self.client = self.connect()
        self.coll = self.client[db_name][self._testMethodName]
        self.truth = direct[db_name][self._testMethodName]
        self.truth.drop()

    def tearDown(self):
        for c in self.clients:
            c.close()
        self.proxy.stop()
        self.assertEqual(proxy_threads(), [])

    def connect(self, **overrides):
        # No retries: the test must see exactly the failure the proxy caused.  A short
        # heartbeat so the client notices recovery quickly after pass.
        opts = dict(retryWrites=False, retryReads=False, heartbeatFrequencyMS=500,
                    serverSelectionTimeoutMS=10000, connectTimeoutMS=5000,
                    socketTimeoutMS=10000)
        opts.update(overrides)
        client = pymongo.MongoClient(proxied_uri(self.port), **opts)
        self.clients.append(client)
        return client

    def wait_recovered(self, client=None):
        """Ping until it works again (the driver rediscovers the server on its own)."""
        client = client or self.client

        def ping():
            try:
                return client.admin.command('ping')['ok'] == 1.0
            except ConnectionFailure:
                return False
        self.assertTrue(wait_for(ping, RECOVERY_TIMEOUT, 0.1),
                        'client did not recover through the proxy: %r' % self.proxy.stats())

    def assert_round_trip(self, doc_id):
        """A write and a read through the proxy, checked directly on the server."""
        self.coll.insert_one({'_id': doc_id, 'v': 1})
        self.assertEqual(self.coll.find_one({'_id': doc_id}), {'_id': doc_id, 'v': 1})
        self.assertEqual(self.truth.find_one({'_id': doc_id}), {'_id': doc_id, 'v': 1})


class PassTest(ProxyCase):

    def test_crud_passes_and_is_counted(self):
        self.coll.insert_many([{'_id': i, 'n': i} for i in range(50)])
        self.coll.update_many({'_id': {'$lt': 10}}, {'$set': {'small': True}})
        self.coll.delete_one({'_id': 49})
        # 150 documents of 20 KB: several getMore round trips and replies bigger than one
        # recv(), so framing across reads is exercised.
        self.coll.insert_many([{'_id': 1000 + i, 'pad': 'x' * 20000} for i in range(150)])
        self.assertEqual(self.coll.count_documents({'small': True}), 10)
        self.assertEqual(len(list(self.coll.find({'_id': {'$gte': 1000}}, batch_size=40))), 150)
        self.assertEqual(self.truth.count_documents({}), 199)
        self.assertIsNone(self.truth.find_one({'_id': 49}))

        stats = self.proxy.stats()
        self.assertEqual(stats['fault'], 'pass')
        self.assertGreaterEqual(stats['connections_accepted'], 1)
        self.assertGreaterEqual(stats['commands'].get('insert', 0), 2)
        self.assertGreaterEqual(stats['commands'].get('getMore', 0), 3)
        # insert x2, update, delete; hello/ping/find/aggregate are not writes.
        self.assertGreaterEqual(stats['writes_forwarded'], 4)
        self.assertGreater(stats['requests_forwarded'], stats['writes_forwarded'])
        self.assertGreater(stats['bytes_to_client'], 150 * 20000)
        for zero in ('replies_dropped', 'replies_delayed', 'connections_refused',
                     'connections_reset', 'protocol_errors', 'messages_stalled'):
            self.assertEqual(stats[zero], 0, zero)

    def test_not_mongodb_is_a_protocol_error(self):
        # A length field of 4 GiB - 1 (what a TLS ClientHello or an HTTP request looks like).
        with socket.create_connection(('127.0.0.1', self.port), timeout=10) as s:
            s.sendall(b'GET / HTTP/1.0\r\n\r\n')
            self.assertTrue(closed_by_peer(s))
        self.assertTrue(wait_for(lambda: self.proxy.stats()['protocol_errors'] == 1, 10))
        self.assert_round_trip(1)


class DropReplyTest(ProxyCase):

    def test_write_is_applied_but_its_reply_is_lost(self):
        self.client.admin.command('ping')
        self.proxy.set_fault('drop_reply', writes_only=True)
        # Reads, hellos and pings still flow: only writes lose their replies.
        self.assertIsNone(self.coll.find_one({'_id': 'ambiguous'}))
        self.client.admin.command('ping')
        with self.assertRaises(ConnectionFailure):
            self.coll.insert_one({'_id': 'ambiguous', 'v': 1})
        # The ambiguous failure: the client got an error, the server has the document.
        self.assertEqual(self.truth.find_one({'_id': 'ambiguous'}), {'_id': 'ambiguous', 'v': 1})
        # The driver reconnects (its handshake is not a write) and reads, then loses again.
        self.assertEqual(self.coll.find_one({'_id': 'ambiguous'}), {'_id': 'ambiguous', 'v': 1})
        with self.assertRaises(ConnectionFailure):
            self.coll.update_one({'_id': 'ambiguous'}, {'$inc': {'v': 1}})
        self.assertEqual(self.truth.find_one({'_id': 'ambiguous'})['v'], 2)

        stats = self.proxy.stats()
        self.assertEqual(stats['replies_dropped'], 2)
        self.assertEqual(stats['fault'], 'drop_reply writes')
        self.proxy.set_fault('pass')
        self.wait_recovered()
        self.assert_round_trip('after')
        self.assertEqual(self.proxy.stats()['replies_dropped'], 2)

    def test_count_limits_the_fault_then_it_passes(self):
        self.proxy.set_fault('drop_reply', writes_only=True, count=2)
        self.assertEqual(self.proxy.fault(), 'drop_reply writes left=2')
        outcomes = []
        for i in range(5):
            self.coll.find_one({})  # never counts against the fault: not a write
            try:
                self.coll.insert_one({'_id': i})
                outcomes.append('ok')
            except ConnectionFailure:
                outcomes.append('lost')
        self.assertEqual(outcomes, ['lost', 'lost', 'ok', 'ok', 'ok'])
        self.assertEqual(sorted(d['_id'] for d in self.truth.find()), [0, 1, 2, 3, 4])
        stats = self.proxy.stats()
        self.assertEqual(stats['replies_dropped'], 2)
        self.assertEqual(stats['faults_expired'], 1)
        self.assertEqual(stats['fault'], 'pass')
        self.assertEqual(stats['commands']['insert'], 5)

    def test_command_filter_and_reset(self):
        # Only "find" loses its reply, with a TCP reset instead of a FIN.
        self.proxy.set_fault('drop_reply', commands=['find'], count=1, rst=True)
        self.coll.insert_one({'_id': 1})
        with self.assertRaises(ConnectionFailure):
            self.coll.find_one({'_id': 1})
        self.assertEqual(self.proxy.fault(), 'pass')
        self.wait_recovered()
        self.assertEqual(self.coll.find_one({'_id': 1}), {'_id': 1})
        self.assertEqual(self.proxy.stats()['replies_dropped'], 1)


class DelayTest(ProxyCase):

    def test_only_write_replies_are_delayed(self):
        delay = 0.5
        self.client.admin.command('ping')
        self.proxy.set_fault('delay', seconds=delay, writes_only=True)
        started = time.monotonic()
        self.coll.insert_one({'_id': 1})
        self.assertGreaterEqual(time.monotonic() - started, delay)
        self.assertEqual(self.truth.find_one({'_id': 1}), {'_id': 1})
        # Reads are not delayed: proven by the counter, not by a clock.
        self.assertEqual(self.coll.find_one({'_id': 1}), {'_id': 1})
        started = time.monotonic()
        self.coll.update_one({'_id': 1}, {'$set': {'x': 1}})
        self.assertGreaterEqual(time.monotonic() - started, delay)
        stats = self.proxy.stats()
        self.assertEqual(stats['replies_delayed'], 2)
        self.assertEqual(stats['replies_dropped'], 0)

    def test_counted_delay_of_every_reply(self):
        delay = 0.3
        self.client.admin.command('ping')
        self.proxy.set_fault('delay', seconds=delay, count=2)
        for _ in range(2):
            started = time.monotonic()
            self.client.admin.command('ping')
            self.assertGreaterEqual(time.monotonic() - started, delay)
        self.client.admin.command('ping')
        stats = self.proxy.stats()
        self.assertEqual(stats['replies_delayed'], 2)
        self.assertEqual(stats['fault'], 'pass')

    def test_delay_longer_than_socket_timeout_times_out(self):
        client = self.connect(socketTimeoutMS=300)
        coll = client[db_name][self._testMethodName]
        client.admin.command('ping')
        self.proxy.set_fault('delay', seconds=1.5, writes_only=True, count=1)
        with self.assertRaises(NetworkTimeout):
            coll.insert_one({'_id': 'late'})
        # The server applied it anyway: a timeout is as ambiguous as a lost reply.
        self.assertTrue(wait_for(lambda: self.truth.find_one({'_id': 'late'}), 10))
        coll.insert_one({'_id': 'next'})


class RefuseTest(ProxyCase):

    def fails_fast_client(self):
        client = self.connect(serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS,
                              connectTimeoutMS=2000)
        client.admin.command('ping')
        return client

    def test_refuse_closes_new_and_open_connections(self):
        client = self.fails_fast_client()
        self.proxy.set_fault('refuse')
        with socket.create_connection(('127.0.0.1', self.port), timeout=10) as s:
            self.assertEqual(s.recv(16), b'')  # accepted, then closed at once: EOF
        with self.assertRaises(ConnectionFailure):
            client.admin.command('ping')
        with self.assertRaises(ConnectionFailure):
            client[db_name].c.insert_one({'_id': 1})
        stats = self.proxy.stats()
        self.assertGreaterEqual(stats['connections_refused'], 1)
        self.assertGreaterEqual(stats['connections_closed'], 1)  # the open ones, at the switch
        self.assertEqual(stats['connections_active'], 0)
        self.proxy.set_fault('pass')
        self.wait_recovered(client)
        self.assert_round_trip(1)

    def test_reset_resets_new_and_open_connections(self):
        client = self.fails_fast_client()
        self.proxy.set_fault('reset')
        # The kernel completes the handshake before the proxy accepts, and the reset follows
        # at once: on loopback it can beat connect()'s return, so either call may see it.
        with self.assertRaises(ConnectionResetError):
            with socket.create_connection(('127.0.0.1', self.port), timeout=10) as s:
                s.recv(16)
        with self.assertRaises(ConnectionFailure):
            client.admin.command('ping')
        stats = self.proxy.stats()
        self.assertGreaterEqual(stats['connections_reset'], 2)  # the open ones and the raw one
        self.assertEqual(stats['connections_active'], 0)
        self.proxy.set_fault('pass')
        self.wait_recovered(client)
        self.assert_round_trip(1)

    def test_unlisten_refuses_at_tcp_level_and_reopens_the_same_port(self):
        client = self.fails_fast_client()
        self.proxy.set_fault('unlisten')
        self.assertFalse(self.proxy.stats()['listening'])
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(('127.0.0.1', self.port), timeout=10).close()
        with self.assertRaises(ConnectionFailure):
            client.admin.command('ping')
        self.proxy.set_fault('pass')
        self.assertTrue(self.proxy.stats()['listening'])
        self.assertEqual(self.proxy.port, self.port)
        self.wait_recovered(client)
        self.assert_round_trip(1)

    def test_refuse_can_keep_open_connections(self):
        client = self.fails_fast_client()
        self.proxy.set_fault('refuse', existing='keep')
        with socket.create_connection(('127.0.0.1', self.port), timeout=10) as s:
            self.assertEqual(s.recv(16), b'')
        # The pooled connection still works; only new ones are refused.
        client.admin.command('ping')
        active = self.proxy.stats()['connections_active']
        self.assertGreater(active, 0)
        # Resetting them by hand then leaves the client with nothing.
        self.assertEqual(self.proxy.reset_connections(), active)
        stats = self.proxy.stats()
        self.assertEqual((stats['connections_active'], stats['connections_reset']), (0, active))
        with self.assertRaises(ConnectionFailure):
            client.admin.command('ping')
        self.proxy.set_fault('pass')
        self.wait_recovered(client)


class StallTest(ProxyCase):

    def test_stall_outlasts_the_socket_timeout_then_resumes(self):
        client = self.connect(socketTimeoutMS=400)
        coll = client[db_name][self._testMethodName]
        coll.insert_one({'_id': 1})
        active = self.proxy.stats()['connections_active']
        self.proxy.set_fault('stall')
        with self.assertRaises(NetworkTimeout):
            coll.find_one({'_id': 1})
        # New connections are accepted (and kept), they just carry nothing.
        with socket.create_connection(('127.0.0.1', self.port), timeout=10) as s:
            s.settimeout(0.3)
            with self.assertRaises(socket.timeout):
                s.recv(16)
        stats = self.proxy.stats()
        self.assertGreaterEqual(stats['messages_stalled'], 1)
        self.assertEqual(stats['connections_refused'] + stats['connections_reset'], 0)
        self.assertGreaterEqual(stats['connections_accepted'], active + 1)
        self.proxy.set_fault('pass')
        self.wait_recovered(client)
        self.assertEqual(coll.find_one({'_id': 1}), {'_id': 1})
        coll.insert_one({'_id': 2})
        self.assertEqual(self.truth.count_documents({}), 2)

    def test_stalled_request_is_delivered_on_resume(self):
        # Like TCP after a partition heals: what was sent during the stall arrives late.
        client = self.connect(socketTimeoutMS=300)
        coll = client[db_name][self._testMethodName]
        client.admin.command('ping')
        self.proxy.set_fault('stall')
        with self.assertRaises(NetworkTimeout):
            coll.insert_one({'_id': 'late'})
        self.assertIsNone(self.truth.find_one({'_id': 'late'}))
        self.proxy.set_fault('pass')
        self.assertTrue(wait_for(lambda: self.truth.find_one({'_id': 'late'}), 10))


class RaceInsertTest(ProxyCase):
    """race_insert: a racing document inserted over the proxy's own connection before the
    client's upsert reaches the server (MongoDB's window between an upsert's match and its
    insert).  Against a real MongoDB the racing connection uses the test URI's credentials."""

    def setUp(self):
        self.proxy = FaultProxy(*upstream, upstream_uri=server.uri)
        self.port = self.proxy.start()
        self.clients = []
        self.client = self.connect()
        self.coll = self.client[db_name][self._testMethodName]
        self.truth = direct[db_name][self._testMethodName]
        self.truth.drop()

    def test_upsert_with_other_conditions_gets_duplicate_key(self):
        self.assertEqual(self.proxy.set_fault('race_insert', match_id='r1',
                                              fields={'v': 0, 'who': 'racer'}, count=1),
                         'race_insert id="r1" left=1')
        # The racing document fails the filter (v is 0): the upsert inserts, and collides.
        with self.assertRaises(DuplicateKeyError):
            self.coll.update_one({'_id': 'r1', 'v': {'$ne': 0}}, {'$set': {'mine': True}},
                                 upsert=True)
        self.assertEqual(self.truth.find_one({'_id': 'r1'}), {'_id': 'r1', 'v': 0, 'who': 'racer'})
        stats = self.proxy.stats()
        self.assertEqual((stats['races'], stats['race_inserts'], stats['race_insert_errors']),
                         (1, 1, 0))
        self.assertEqual(stats['fault'], 'pass')
        # Used up: the same upsert now simply runs.
        self.coll.update_one({'_id': 'r1b', 'v': {'$ne': 0}}, {'$set': {'mine': True}},
                             upsert=True)
        self.assertEqual(self.truth.find_one({'_id': 'r1b'}), {'_id': 'r1b', 'mine': True})
        self.assertEqual(self.proxy.stats()['races'], 1)

    def test_upsert_whose_filter_matches_updates_the_racing_document(self):
        self.proxy.set_fault('race_insert', match_id='r2', fields={'other': 1}, count=1)
        res = self.coll.update_one({'_id': 'r2'}, {'$set': {'mine': 2}}, upsert=True)
        self.assertEqual((res.matched_count, res.upserted_id), (1, None))
        self.assertEqual(self.truth.find_one({'_id': 'r2'}), {'_id': 'r2', 'other': 1, 'mine': 2})

    def test_only_upserts_of_the_named_id(self):
        self.proxy.set_fault('race_insert', match_id='r3', fields={'v': 0}, count=2)
        self.coll.update_one({'_id': 'elsewhere', 'v': {'$ne': 0}}, {'$set': {'a': 1}},
                             upsert=True)
        self.coll.update_one({'_id': 'r3'}, {'$set': {'a': 1}})  # not an upsert
        self.coll.insert_one({'_id': 'plain'})
        self.assertEqual(self.proxy.stats()['races'], 0)
        self.assertIsNone(self.truth.find_one({'_id': 'r3'}))
        with self.assertRaises(DuplicateKeyError):
            self.coll.update_one({'_id': {'$eq': 'r3'}, 'v': {'$ne': 0}}, {'$set': {'a': 1}},
                                 upsert=True)
        self.assertEqual(self.proxy.fault(), 'race_insert id="r3" left=1')
        self.assertEqual(self.proxy.stats()['races'], 1)

    def test_any_id_in_an_unordered_bulk(self):
        self.proxy.set_fault('race_insert', fields={'v': 0}, count=2)
        ops = [UpdateOne({'_id': 'b%d' % i, 'v': {'$ne': 0}}, {'$set': {'mine': i}}, upsert=True)
               for i in range(3)]
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write(ops, ordered=False)
        details = cm.exception.details
        self.assertEqual([(e['index'], e['code']) for e in details['writeErrors']],
                         [(0, 11000), (1, 11000)])
        self.assertEqual(details['nUpserted'], 1)
        self.assertEqual({d['_id']: d for d in self.truth.find()},
                         {'b0': {'_id': 'b0', 'v': 0}, 'b1': {'_id': 'b1', 'v': 0},
                          'b2': {'_id': 'b2', 'mine': 2}})
        self.assertEqual(self.proxy.stats()['fault'], 'pass')

    def test_failed_racing_insert_still_forwards_the_request(self):
        self.truth.insert_one({'_id': 'r5', 'first': True})
        self.proxy.set_fault('race_insert', match_id='r5', count=1)
        self.coll.update_one({'_id': 'r5'}, {'$set': {'mine': 1}}, upsert=True)
        self.assertEqual(self.truth.find_one({'_id': 'r5'}), {'_id': 'r5', 'first': True,
                                                              'mine': 1})
        stats = self.proxy.stats()
        self.assertEqual((stats['races'], stats['race_inserts'], stats['race_insert_errors']),
                         (1, 0, 1))
        self.assertIn('DuplicateKeyError', stats['race_insert_error'])

    def test_no_write_overtakes_a_slow_racing_insert(self):
        """A second client's upsert of the same _id, sent on its own connection while the
        racing insert is still on its way (the server holds it 1.5 s), waits for it: both
        upserts then meet the racing document, as when a retry on a new connection follows a
        write that timed out."""
        self.proxy.set_fault('race_insert', match_id='r7', fields={'v': 0}, count=1)
        self.addCleanup(lambda: direct.admin.command('configureFailPoint', 'failCommand',
                                                     mode='off'))
        direct.admin.command('configureFailPoint', 'failCommand', mode={'times': 1},
                             data={'failCommands': ['insert'],
                                   'appName': 'fault_proxy race_insert',
                                   'blockConnection': True, 'blockTimeMS': 1500})
        other = self.connect()[db_name][self._testMethodName]
        other.find_one({})  # its own connection, open before the race starts
        outcomes = {}

        def upsert(name, coll):
            try:
                coll.update_one({'_id': 'r7', 'v': {'$ne': 0}}, {'$set': {name: True}},
                                upsert=True)
                outcomes[name] = 'stored'
            except DuplicateKeyError:
                outcomes[name] = 'duplicate key'
        first = threading.Thread(target=upsert, args=('first', self.coll))
        first.start()
        self.assertTrue(wait_for(lambda: self.proxy.stats()['races'] == 1, 10))
        upsert('second', other)
        first.join(20)
        self.assertEqual(outcomes, {'first': 'duplicate key', 'second': 'duplicate key'})
        stats = self.proxy.stats()
        self.assertEqual((stats['race_inserts'], stats['race_insert_errors']), (1, 0), stats)
        self.assertEqual(self.truth.find_one({'_id': 'r7'}), {'_id': 'r7', 'v': 0})

    def test_whole_document_and_bad_arguments(self):
        self.proxy.set_fault('race_insert', match_id='r6',
                             document={'v': 0, 'nested': {'x': [1, 2]}}, count=1)
        with self.assertRaises(DuplicateKeyError):
            self.coll.update_one({'_id': 'r6', 'v': 1}, {'$set': {'a': 1}}, upsert=True)
        self.assertEqual(self.truth.find_one({'_id': 'r6'}),
                         {'_id': 'r6', 'v': 0, 'nested': {'x': [1, 2]}})
        for bad in (dict(kind='race_insert', fields={'a': 1}, document={'b': 1}),
                    dict(kind='race_insert', writes_only=True),
                    dict(kind='race_insert', fields=[1]),
                    dict(kind='delay', seconds=1, match_id='x'),
                    dict(kind='race_insert', count=0)):
            with self.assertRaises(ValueError, msg=bad):
                self.proxy.set_fault(**bad)


class LifecycleTest(unittest.TestCase):

    def test_stop_is_prompt_with_busy_connections(self):
        proxy = FaultProxy(*upstream)
        port = proxy.start()
        # A short server selection timeout: close() tries to send endSessions through the
        # stopped proxy and waits that long for a server.
        client = pymongo.MongoClient(proxied_uri(port), retryReads=False, retryWrites=False,
                                     serverSelectionTimeoutMS=SELECTION_TIMEOUT_MS,
                                     socketTimeoutMS=10000)
        try:
            client.admin.command('ping')
            proxy.set_fault('delay', seconds=30)
            errors = []

            def slow_ping():
                try:
                    client.admin.command('ping')
                except ConnectionFailure as e:
                    errors.append(e)
            t = threading.Thread(target=slow_ping)
            t.start()
            self.assertTrue(wait_for(lambda: proxy.stats()['replies_delayed'] >= 1, 10))
            accepted = proxy.stats()['connections_accepted']
            raw = socket.create_connection(('127.0.0.1', port), timeout=10)
            # Accepted and proxied, so stop() has a live connection to close, not a queued one.
            self.assertTrue(wait_for(
                lambda: proxy.stats()['connections_accepted'] > accepted, 10))
            started = time.monotonic()
            proxy.stop()
            self.assertLess(time.monotonic() - started, 5.0)
            self.assertEqual(proxy_threads(), [])
            t.join(15)
            self.assertFalse(t.is_alive())
            self.assertEqual(len(errors), 1)  # the held reply was never delivered
            self.assertEqual(raw.recv(16), b'')  # closed with a FIN, nothing was unread
            raw.close()
            proxy.stop()  # twice is harmless
        finally:
            client.close()

    def test_fault_set_before_start_and_bad_arguments(self):
        proxy = FaultProxy(*upstream)
        proxy.set_fault('unlisten')
        port = proxy.start()
        try:
            with self.assertRaises(ConnectionRefusedError):
                socket.create_connection(('127.0.0.1', port), timeout=10).close()
            for bad in (dict(kind='nope'), dict(kind='delay'), dict(kind='pass', count=1),
                        dict(kind='drop_reply', count=0), dict(kind='stall', seconds=1),
                        dict(kind='refuse', existing='maybe'), dict(kind='reset', rst=True)):
                with self.assertRaises(ValueError, msg=bad):
                    proxy.set_fault(**bad)
            proxy.set_fault('pass')
            with pymongo.MongoClient(proxied_uri(port), serverSelectionTimeoutMS=10000) as c:
                c.admin.command('ping')
        finally:
            proxy.stop()
        self.assertEqual(proxy_threads(), [])


class FramingTest(unittest.TestCase):
    """Command names out of hand-built messages (no server needed)."""

    @staticmethod
    def header(body, opcode, request_id=7, response_to=0):
        return fault_proxy.HEADER.pack(16 + len(body), request_id, response_to, opcode) + body

    def op_msg(self, flags=0, sections=b''):
        return self.header(fault_proxy.UINT32.pack(flags) + sections, fault_proxy.OP_MSG)

    def test_op_msg_body_after_a_document_sequence(self):
        docs = bson.encode({'_id': 1}) + bson.encode({'_id': 2})
        ident = b'documents\x00'
        seq = b'\x01' + fault_proxy.INT32.pack(4 + len(ident) + len(docs)) + ident + docs
        body = b'\x00' + bson.encode({'insert': 'c', '$db': 'd'})
        msg = parse_message(self.op_msg(sections=seq + body))
        self.assertEqual(msg.command, 'insert')
        self.assertTrue(msg.is_write)
        self.assertTrue(msg.expects_reply)

    def test_more_to_come_and_checksum(self):
        body = b'\x00' + bson.encode({'delete': 'c'})
        msg = parse_message(self.op_msg(flags=3, sections=body) + b'\0\0\0\0')
        self.assertEqual(msg.command, 'delete')
        self.assertFalse(msg.expects_reply)  # w:0 write: nothing to drop or delay

    def test_op_query_wrapped_command(self):
        query = bson.encode({'$query': {'isMaster': 1}, '$readPreference': {'mode': 'primary'}})
        body = (fault_proxy.INT32.pack(0) + b'admin.$cmd\x00' + fault_proxy.INT32.pack(0)
                + fault_proxy.INT32.pack(-1) + query)
        msg = parse_message(self.header(body, fault_proxy.OP_QUERY))
        self.assertEqual(msg.command, 'isMaster')
        self.assertFalse(msg.is_write)

    def test_op_compressed_zlib(self):
        import zlib
        inner = fault_proxy.UINT32.pack(0) + b'\x00' + bson.encode({'update': 'c'})
        body = (fault_proxy.INT32.pack(fault_proxy.OP_MSG) + fault_proxy.INT32.pack(len(inner))
                + b'\x02' + zlib.compress(inner))
        msg = parse_message(self.header(body, fault_proxy.OP_COMPRESSED))
        self.assertEqual((msg.opcode, msg.command, msg.compressed), (fault_proxy.OP_MSG,
                                                                     'update', True))

    def test_garbage_never_raises(self):
        for body in (b'', b'\x00', b'\x00\x00\x00\x00\x05', b'\xff' * 40):
            msg = parse_message(self.header(body, fault_proxy.OP_MSG))
            self.assertIsNone(msg.command)
        self.assertEqual(parse_message(self.header(b'', 1, 9, 7)).response_to, 7)


class CommandLineTest(unittest.TestCase):

    def test_control_channel_drives_the_proxy(self):
        proc = subprocess.Popen([PYTHON, PROXY_SCRIPT, '--listen', '127.0.0.1:0', '--upstream',
                                 '%s:%d' % upstream, '--upstream-uri', server.uri],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True)
        try:
            ports = {}
            for _ in range(2):
                word, _, addr = proc.stdout.readline().decode().strip().partition(' ')
                ports[word] = int(addr.rpartition(':')[2])
            self.assertEqual(sorted(ports), ['control', 'listen'])
            ctl = socket.create_connection(('127.0.0.1', ports['control']), timeout=10)
            lines = ctl.makefile('rw', encoding='utf-8', newline='\n')

            def command(text):
                lines.write(text + '\n')
                lines.flush()
                return lines.readline().rstrip('\n')

            self.assertEqual(command('fault'), 'ok pass')
            self.assertTrue(command('help').startswith('ok pass | drop_reply'))
            self.assertEqual(command('drop_reply writes count=1'), 'ok drop_reply writes left=1')
            self.assertTrue(command('frobnicate').startswith('error unknown fault'))
            self.assertTrue(command('delay').startswith('error delay needs seconds'))
            uri = proxied_uri(ports['listen'])
            with pymongo.MongoClient(uri, retryWrites=False,
                                     serverSelectionTimeoutMS=10000) as client:
                coll = client[db_name].cli
                with self.assertRaises(ConnectionFailure):
                    coll.insert_one({'_id': 'cli'})
                self.assertEqual(direct[db_name].cli.find_one(), {'_id': 'cli'})
                reply = command('stats')
                self.assertTrue(reply.startswith('ok {'))
                import json
                stats = json.loads(reply[3:])
                self.assertEqual(stats['replies_dropped'], 1)
                self.assertEqual(stats['fault'], 'pass')
                self.assertEqual(command('delay 0.2 writes'), 'ok delay seconds=0.2 writes')
                started = time.monotonic()
                coll.insert_one({'_id': 'slow'})
                self.assertGreaterEqual(time.monotonic() - started, 0.2)
                # race_insert: quoted Extended JSON (a date) for the racing document.
                reply = command('race_insert id=cli-race count=1 fields=\'{"v": 0, '
                                '"at": {"$date": "2025-01-15T14:00:00Z"}}\'')
                self.assertEqual(reply, 'ok race_insert id="cli-race" left=1')
                self.assertTrue(command('race_insert fields=\'{"v": ').startswith('error '))
                with self.assertRaises(DuplicateKeyError):
                    coll.update_one({'_id': 'cli-race', 'v': 1}, {'$set': {'a': 1}},
                                    upsert=True)
                racer = direct[db_name].cli.find_one({'_id': 'cli-race'})
                self.assertEqual(racer['v'], 0)
                self.assertEqual(racer['at'].replace(tzinfo=None),
                                 datetime.datetime(2025, 1, 15, 14, 0, 0))
                self.assertTrue(command('kill').startswith('ok reset '))
            self.assertEqual(command('shutdown'), 'ok shutting down')
            ctl.close()
            self.assertEqual(proc.wait(10), 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            err = proc.stderr.read().decode()
            proc.stderr.close()
        self.assertEqual(err, '')

    def test_sigterm_exits_zero(self):
        proc = subprocess.Popen([PYTHON, PROXY_SCRIPT, '--upstream', '%s:%d' % upstream,
                                 '--fault', 'stall'],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, close_fds=True)
        try:
            listen = int(proc.stdout.readline().decode().rpartition(':')[2])
            proc.stdout.readline()
            raw = socket.create_connection(('127.0.0.1', listen), timeout=10)
            proc.terminate()
            self.assertEqual(proc.wait(10), 0)
            self.assertTrue(closed_by_peer(raw))  # not left hanging by the dead proxy
            raw.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


if __name__ == '__main__':
    unittest.main(verbosity=2)
