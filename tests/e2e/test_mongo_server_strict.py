#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Tests for the MongoDB test server (tests/mongo_server.py): its strictness switches
(--sharded, --unstable-sortarray, --max-write-batch, ...), its rewrite-cost counters, its
injected write errors, and the server process itself.

Run: /usr/bin/python3 tests/e2e/test_mongo_server_strict.py

Each test class runs a test server of its own, never an external MongoDB: with
BUCKETD_TEST_MONGODB_URI set they still run against the test server, and only the tests of
the server process itself are skipped.
"""

import datetime
import os
import socket
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mongo_fixture import start_mongo, unique_db_name  # noqa: E402
from mongo_server_cases import (EXTERNAL, HOUR, MAX_BSON, bucket_update, reading,  # noqa: E402
                                summary_pipeline, field_summary, summary_page)

import bson  # noqa: E402
import pymongo  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from pymongo import UpdateOne  # noqa: E402
from pymongo.errors import BulkWriteError, OperationFailure, PyMongoError, WriteError  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Strictness switches: each test class runs a test server of its own with the switch (never an
# external MongoDB), next to one without it, to show the default is unchanged.
# ---------------------------------------------------------------------------------------------

def _server_module():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mongo_server
    return mongo_server


class StandInCase(unittest.TestCase):
    """Starts tests/mongo_server.py with options (server_options) and, when there are any,
    without, for the class."""

    server_options = {}

    @classmethod
    def setUpClass(cls):
        cls.servers = []
        cls.strict = cls._start(**cls.server_options)
        cls.plain = cls._start() if cls.server_options else cls.strict

    @classmethod
    def _start(cls, **options):
        mongo = start_mongo(use_external=False, **options)
        cls.servers.append(mongo)
        c = pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000, retryWrites=False)
        cls.servers.append(c)
        return c[unique_db_name('bucketd_strict')]

    @classmethod
    def tearDownClass(cls):
        for s in reversed(cls.servers):
            if isinstance(s, pymongo.MongoClient):
                s.close()
            else:
                s.stop()

    def colls(self):
        """The collection of this test on the strict and on the plain server."""
        name = self._testMethodName
        return self.strict[name], self.plain[name]


def shard_error(test, details, index):
    """Check that writeErrors holds exactly mongos's ShardKeyNotFound for statement index."""
    errors = details['writeErrors']
    test.assertEqual([(e['index'], e['code']) for e in errors], [(index, 61)], errors)
    test.assertEqual(errors[0]['errmsg'],
                     'Failed to target upsert by query :: could not extract exact shard key')


class ShardedTest(StandInCase):
    """--sharded: an upsert must pin every shard-key field by equality (mongos 5.x-6.x)."""

    server_options = {'sharded': 'sensor_id:1,bucket_start:1'}
    T = datetime.datetime(2025, 1, 15, 14, 0, 0)

    def test_bucket_upsert_with_the_shard_key_is_targeted(self):
        # The update bucketd sends: _id, the shard-key fields and the writer's sequence.
        strict, _ = self.colls()
        _, flt, pipeline = bucket_update('s1', {'measurement': 'm', 'tags': {}}, self.T, 0,
                                         [reading(self.T, 1, 20.5, 1)], 'temp', 'w', 1)
        flt['sensor_id'] = 's1'
        flt['bucket_start'] = self.T
        res = strict.update_one(flt, pipeline, upsert=True)
        self.assertIsNotNone(res.upserted_id)
        self.assertEqual(strict.find_one()['count'], 1)

    def test_upsert_by_id_alone_fails_with_61_the_rest_applies(self):
        strict, plain = self.colls()
        ops = [UpdateOne({'_id': 'a', 'sensor_id': 's', 'bucket_start': self.T},
                         {'$set': {'v': 1}}, upsert=True),
               UpdateOne({'_id': 'b'}, {'$set': {'v': 2}}, upsert=True),
               UpdateOne({'_id': 'c', 'sensor_id': 's', 'bucket_start': self.T + HOUR},
                         {'$set': {'v': 3}}, upsert=True)]
        with self.assertRaises(BulkWriteError) as cm:
            strict.bulk_write(ops, ordered=False)
        shard_error(self, cm.exception.details, 1)
        self.assertEqual(cm.exception.details['nUpserted'], 2)
        self.assertEqual(sorted(d['_id'] for d in strict.find()), ['a', 'c'])
        # An ordered bulk stops there.
        with self.assertRaises(BulkWriteError) as cm:
            strict.bulk_write([UpdateOne({'_id': 'd'}, {'$set': {'v': 4}}, upsert=True),
                               UpdateOne({'_id': 'e', 'sensor_id': 's', 'bucket_start': self.T},
                                         {'$set': {'v': 5}}, upsert=True)])
        shard_error(self, cm.exception.details, 0)
        self.assertIsNone(strict.find_one({'_id': 'e'}))
        # The default server (a standalone) takes all of them.
        self.assertEqual(plain.bulk_write(ops, ordered=False).upserted_count, 3)

    def test_what_counts_as_equality(self):
        strict, _ = self.colls()
        t = self.T
        good = [
            {'sensor_id': 's', 'bucket_start': t},
            {'sensor_id': {'$eq': 's'}, 'bucket_start': {'$eq': t}},
            {'sensor_id': {'$eq': 's', '$ne': 'x'}, 'bucket_start': t},
            {'$and': [{'sensor_id': 's'}, {'$and': [{'bucket_start': t}]}]},
            {'sensor_id': {'$in': ['s']}, 'bucket_start': t},
            {'sensor_id': 's', 'bucket_start': t, 'w.x': {'$not': {'$gte': 3}}},
            {'sensor_id': None, 'bucket_start': t},
        ]
        bad = [
            {'_id': 'x'},
            {'sensor_id': 's'},
            {'sensor_id': {'$gte': 's'}, 'bucket_start': t},
            {'sensor_id': {'$in': ['s', 't']}, 'bucket_start': t},
            {'$or': [{'sensor_id': 's', 'bucket_start': t}, {'_id': 'x'}]},
            {'sensor_id': ['s'], 'bucket_start': t},
            {'sensor_id': bson.regex.Regex('^s'), 'bucket_start': t},
            {'sensor_id': {'$eq': bson.regex.Regex('^s')}, 'bucket_start': t},
            {'sensor_id': 's', '$and': [{'sensor_id': 's'}], 'bucket_start': t},
            {'sensor_id': {'$exists': True}, 'bucket_start': t},
        ]
        for i, flt in enumerate(good):
            strict.update_one(flt, {'$set': {'case': i}}, upsert=True)
            strict.delete_many({})
        for flt in bad:
            with self.assertRaises(WriteError, msg=repr(flt)) as cm:
                strict.update_one(flt, {'$set': {'v': 1}}, upsert=True)
            self.assertEqual(cm.exception.code, 61, flt)
        self.assertEqual(strict.count_documents({}), 0)

    def test_updates_and_deletes_without_upsert_are_not_checked(self):
        strict, _ = self.colls()
        strict.insert_one({'_id': 'a', 'sensor_id': 's', 'bucket_start': self.T, 'v': 0})
        self.assertEqual(strict.update_one({'_id': 'a'}, {'$inc': {'v': 1}}).modified_count, 1)
        self.assertEqual(strict.update_many({}, {'$inc': {'v': 1}}).modified_count, 1)
        self.assertEqual(strict.update_one({'_id': 'zz'}, {'$inc': {'v': 1}}).matched_count, 0)
        self.assertEqual(strict.find_one()['v'], 2)
        self.assertEqual(strict.delete_one({'_id': 'a'}).deleted_count, 1)

    def test_coll_stats_says_sharded(self):
        strict, plain = self.colls()
        strict.insert_one({'_id': 1})
        plain.insert_one({'_id': 1})
        self.assertIs(strict.database.command('collStats', strict.name)['sharded'], True)
        self.assertNotIn('sharded', plain.database.command('collStats', plain.name))

    def test_key_extraction(self):
        # The rule itself, for key shapes the wire tests above do not use.
        ms = _server_module()
        hashed = ms.parse_shard_key('sensor_id:hashed')
        nested = ms.parse_shard_key('meta.site:1,sensor_id:1')
        key = ms.shard_key_from_query
        self.assertEqual(key({'_id': 1, 'sensor_id': 's'}, hashed), {'sensor_id': 's'})
        self.assertIsNone(key({'_id': 1}, hashed))
        self.assertIsNone(key({'sensor_id': {'$in': []}}, hashed))
        self.assertEqual(key({'sensor_id': {'$in': [1, 1.0]}}, hashed), {'sensor_id': 1})
        self.assertEqual(key({'$or': [{'sensor_id': 's'}]}, hashed), {'sensor_id': 's'})
        self.assertEqual(key({'sensor_id': {'a': 1}}, hashed), {'sensor_id': {'a': 1}})
        self.assertIsNone(key({'sensor_id': {'a': {'$x': 1}}}, hashed))
        # A parent's equality gives the child's value; a child's does not give the parent's.
        self.assertEqual(key({'meta': {'site': 'x', 'k': 1}, 'sensor_id': 's'}, nested),
                         {'meta.site': 'x', 'sensor_id': 's'})
        self.assertEqual(key({'meta.site': 'x', 'sensor_id': 's'}, nested),
                         {'meta.site': 'x', 'sensor_id': 's'})
        self.assertIsNone(key({'meta': {'k': 1}, 'sensor_id': 's'}, nested))
        self.assertIsNone(key({'meta': [{'site': 'x'}], 'sensor_id': 's'}, nested))
        self.assertIsNone(key({'meta.site': 'x', 'meta': {'site': 'x'}, 'sensor_id': 's'},
                              nested))
        self.assertIsNone(key({'meta.site.a': 'x', 'sensor_id': 's'}, nested))
        # Unrelated paths never matter, not even conflicting ones.
        self.assertEqual(key({'sensor_id': 's', 'a': 1, '$and': [{'a': 2}]}, hashed),
                         {'sensor_id': 's'})
        for spec in ('', 'a:2', 'a:hashed,b:hashed', 'a..b:1', 'a:1,a:1', '$a:1'):
            with self.assertRaises(ValueError, msg=spec):
                ms.parse_shard_key(spec)
        self.assertEqual(ms.parse_shard_key('a,b.c:1'), [('a', 1), ('b.c', 1)])

    def test_bad_keyspec_stops_the_server(self):
        with self.assertRaises(RuntimeError) as cm:
            start_mongo(use_external=False, sharded='a:2')
        self.assertIn('--sharded', str(cm.exception))


class HashedShardKeyTest(StandInCase):

    server_options = {'sharded': 'sensor_id:hashed'}

    def test_hashed_key(self):
        strict, plain = self.colls()
        strict.update_one({'_id': 'a', 'sensor_id': 's'}, {'$set': {'v': 1}}, upsert=True)
        with self.assertRaises(WriteError) as cm:
            strict.update_one({'_id': 'b'}, {'$set': {'v': 1}}, upsert=True)
        self.assertEqual(cm.exception.code, 61)
        # A replacement upsert is targeted by its filter too, not by the new document.
        with self.assertRaises(WriteError) as cm:
            strict.replace_one({'_id': 'c'}, {'sensor_id': 's'}, upsert=True)
        self.assertEqual(cm.exception.code, 61)
        plain.update_one({'_id': 'b'}, {'$set': {'v': 1}}, upsert=True)
        self.assertEqual([d['_id'] for d in strict.find()], ['a'])


class UnstableSortArrayTest(StandInCase):
    """--unstable-sortarray: equal sort keys come out in reverse input order."""

    server_options = {'unstable_sortarray': True}
    ITEMS = [{'k': 1, 'i': 0}, {'k': 0, 'i': 1}, {'k': 1, 'i': 2}, {'k': 0, 'i': 3}]

    def sorted_by(self, coll, sort_by, items=None):
        coll.update_one({'_id': 1}, [{'$set': {'out': {'$sortArray': {
            'input': {'$literal': items or self.ITEMS}, 'sortBy': sort_by}}}}], upsert=True)
        out = coll.find_one({'_id': 1})['out']
        return [x['i'] if isinstance(x, dict) else x for x in out]

    def test_equal_keys_reversed(self):
        strict, plain = self.colls()
        self.assertEqual(self.sorted_by(strict, {'k': 1}), [3, 1, 2, 0])
        self.assertEqual(self.sorted_by(strict, {'k': -1}), [2, 0, 3, 1])
        self.assertEqual(self.sorted_by(plain, {'k': 1}), [1, 3, 0, 2])
        self.assertEqual(self.sorted_by(plain, {'k': -1}), [0, 2, 1, 3])
        # Whole values: 1, 1.0 and 1 (int64) are equal keys.
        values = [Int64(1), 2, 1.0, 1]
        out = self.sorted_by(strict, 1, values)
        self.assertEqual([type(v) for v in out], [int, float, Int64, int])
        out = self.sorted_by(plain, 1, values)
        self.assertEqual([type(v) for v in out], [Int64, float, int, int])
        # Distinct keys sort the same either way.
        self.assertEqual(self.sorted_by(strict, {'i': -1}), [3, 2, 1, 0])

    def test_late_readings_with_equal_timestamps(self):
        # A bucket's late readings are merged by $sortArray on ts: readings with the same
        # timestamp may come out in either order on a real server.
        strict, plain = self.colls()
        start = datetime.datetime(2025, 1, 15, 14, 0, 0)
        for coll in (strict, plain):
            for batch in ([reading(start, 10, 1.0, 1), reading(start, 20, 2.0, 2)],
                          [reading(start, 10, 3.0, 3), reading(start, 15, 4.0, 4)]):
                _, flt, pipeline = bucket_update('s', {}, start, 0, batch, 'temp')
                coll.update_one(flt, pipeline, upsert=True)
        self.assertEqual([r['n'] for r in strict.find_one()['readings']], [3, 1, 4, 2])
        self.assertEqual([r['n'] for r in plain.find_one()['readings']], [1, 3, 4, 2])


class MaxWriteBatchTest(StandInCase):
    """--max-write-batch: hello's maxWriteBatchSize, and mongod's refusal of a write command
    with more statements than that; drivers then split a bulk into several commands."""

    server_options = {'max_write_batch': 2}

    def test_hello_says_it(self):
        self.assertEqual(self.strict.client.admin.command('hello')['maxWriteBatchSize'], 2)
        self.assertEqual(self.plain.client.admin.command('hello')['maxWriteBatchSize'], 100000)

    def test_a_longer_command_is_refused_whole(self):
        strict, plain = self.colls()
        for kind, key, ops in (
                ('update', 'updates', [{'q': {'_id': i}, 'u': {'$set': {'v': i}}, 'upsert': True}
                                       for i in range(3)]),
                ('insert', 'documents', [{'_id': 10 + i} for i in range(3)]),
                ('delete', 'deletes', [{'q': {'_id': i}, 'limit': 1} for i in range(3)])):
            reply = strict.database.command(kind, strict.name, **{key: ops, 'check': False})
            self.assertEqual((reply['ok'], reply['code'], reply['codeName']),
                             (0.0, 16, 'InvalidLength'), kind)
            self.assertEqual(reply['errmsg'],
                             'Write batch sizes must be between 1 and 2. Got 3 operations.')
            self.assertNotIn('n', reply, kind)
            self.assertEqual(plain.database.command(kind, plain.name, **{key: ops})['n'], 3,
                             kind)
        self.assertEqual(strict.count_documents({}), 0, 'nothing of the refused commands ran')
        reply = strict.database.command('update', strict.name, updates=[
            {'q': {'_id': i}, 'u': {'$set': {'v': i}}, 'upsert': True} for i in range(2)])
        self.assertEqual(reply['n'], 2, 'two statements are within the limit')

    def test_a_driver_splits_a_bulk(self):
        strict, _ = self.colls()
        before = self.strict.client.admin.command('serverStatus')['opcounters']['update']
        result = strict.bulk_write([UpdateOne({'_id': i}, {'$set': {'v': i}}, upsert=True)
                                    for i in range(5)], ordered=False)
        self.assertEqual(result.upserted_count, 5)
        self.assertEqual(sorted(result.upserted_ids), [0, 1, 2, 3, 4],
                         'indexes into the whole bulk')
        after = self.strict.client.admin.command('serverStatus')['opcounters']['update']
        self.assertEqual(after - before, 5)
        self.assertEqual(strict.count_documents({}), 5)

    def test_a_split_bulk_stopped_by_a_fail_point(self):
        # The second command (skip: 1) fails whole; the driver stops the unordered bulk there
        # (pymongo raises the command's error, as NotPrimaryError for 11600): the first
        # command's duplicate key was answered and its upsert stays, the second command's
        # updates never ran.
        strict, _ = self.colls()
        strict.insert_one({'_id': 0, 'v': 'theirs'})
        admin = self.strict.client.admin
        admin.command('configureFailPoint', 'failCommand', mode={'skip': 1},
                      data={'failCommands': ['update'], 'errorCode': 11600,
                            'namespace': strict.full_name})
        self.addCleanup(admin.command, 'configureFailPoint', 'failCommand', mode='off')
        with self.assertRaises(PyMongoError) as cm:
            strict.bulk_write([UpdateOne({'_id': i, 'v': {'$ne': 'theirs'}},
                                         {'$set': {'v': i}}, upsert=True) for i in range(4)],
                              ordered=False)
        self.assertEqual(cm.exception.details['code'], 11600, cm.exception)
        self.assertEqual(sorted(d['_id'] for d in strict.find()), [0, 1])
        self.assertEqual(admin.command('configureFailPoint', 'failCommand',
                                       mode='off')['count'], 1)


class RewriteStatsTest(StandInCase):
    """{bucketdTestStats: ...}: the BSON bytes of every document an update wrote."""

    def stats(self, coll, **kw):
        reply = coll.database.command('bucketdTestStats', coll.name, **kw)
        return (reply['docBytesWritten'], reply['updatesApplied'], reply['storedBytes'],
                reply['count'])

    def size(self, coll, _id):
        return len(bson.encode(coll.find_one({'_id': _id})))

    def test_counts_what_updates_write(self):
        coll, _ = self.colls()
        self.assertEqual(self.stats(coll), (0, 0, 0, 0))
        coll.insert_one({'_id': 1, 'v': 0})             # an insert is not an update
        self.assertEqual(self.stats(coll), (0, 0, self.size(coll, 1), 1))
        written = 0
        coll.update_one({'_id': 1}, {'$set': {'v': 'x' * 100}})
        written += self.size(coll, 1)
        coll.update_one({'_id': 1}, {'$set': {'v': 'x' * 100}})  # no change: nothing written
        coll.update_one({'_id': 2}, {'$set': {'v': 1}}, upsert=True)
        written += self.size(coll, 2)
        coll.update_one({'_id': 2}, [{'$set': {'w': {'$add': ['$v', 1]}}}])
        written += self.size(coll, 2)
        coll.update_one({'_id': 3}, [{'$set': {'v': 3}}], upsert=True)
        written += self.size(coll, 3)
        coll.find_one_and_update({'_id': 3}, {'$inc': {'v': 1}})
        written += self.size(coll, 3)
        coll.update_many({}, {'$set': {'m': True}})
        written += sum(self.size(coll, i) for i in (1, 2, 3))
        stored = sum(len(bson.encode(d)) for d in coll.find())
        self.assertEqual(self.stats(coll), (written, 8, stored, 3))
        # A refused update (too large) writes nothing; a delete shrinks what is stored.
        with self.assertRaises(WriteError):
            coll.update_one({'_id': 1}, {'$set': {'big': 'b' * (MAX_BSON + 1)}})
        coll.delete_one({'_id': 1})
        stored = sum(len(bson.encode(d)) for d in coll.find())
        self.assertEqual(self.stats(coll, reset=True), (written, 8, stored, 2))
        self.assertEqual(self.stats(coll), (0, 0, stored, 2))

    def test_bucket_appends_rewrite_the_whole_document(self):
        # One reading a flush into one bucket: the n-th update rewrites a document holding n
        # readings, so bytes rewritten / bytes stored grows with the number of flushes.
        coll, _ = self.colls()
        start = datetime.datetime(2025, 1, 15, 14, 0, 0)
        sizes = []
        for sec in range(60):
            _, flt, pipeline = bucket_update('s', {'measurement': 'm', 'tags': {}}, start, 0,
                                             [reading(start, sec, 20.0 + sec, sec)], 'temp')
            coll.update_one(flt, pipeline, upsert=True)
            sizes.append(len(bson.encode(coll.find_one())))
        written, updates, stored, count = self.stats(coll)
        self.assertEqual((written, updates, stored, count), (sum(sizes), 60, sizes[-1], 1))
        self.assertGreater(written / stored, 25)

    def test_database_totals_and_drop(self):
        database = self.strict.client[unique_db_name('bucketd_stats')]
        self.addCleanup(self.strict.client.drop_database, database.name)
        coll, other = database['one'], database['other']
        coll.update_one({'_id': 1}, {'$set': {'v': 1}}, upsert=True)
        other.update_one({'_id': 1}, {'$set': {'v': 22}}, upsert=True)
        other.update_one({'_id': 1}, {'$set': {'v': 23}})
        reply = coll.database.command('bucketdTestStats', 1)
        per = reply['collections']
        self.assertEqual(per[coll.name]['updatesApplied'], 1)
        self.assertEqual(per[other.name]['updatesApplied'], 2)
        self.assertEqual(reply['updatesApplied'], sum(c['updatesApplied'] for c in per.values()))
        self.assertEqual(reply['docBytesWritten'],
                         sum(c['docBytesWritten'] for c in per.values()))
        self.assertEqual(reply['storedBytes'], 2 * len(bson.encode({'_id': 1, 'v': 1})))
        other.drop()
        self.assertEqual(self.stats(other), (0, 0, 0, 0))
        self.assertEqual(self.stats(coll)[1], 1)


class MergeShardedTest(StandInCase):
    """--sharded: the 'on' fields of a $merge into an existing (so sharded) collection must
    hold every shard-key field; mongos then finds no supporting index (51190).  Without
    'on', the shard-key fields and _id are the default."""

    server_options = {'sharded': 'sensor_id:1,bucket_start:1'}
    T = datetime.datetime(2025, 1, 15, 14, 0, 0)

    def setup(self, coll, pages, indexes=()):
        """coll (the output) created with the unique indexes [(name, key)], and a page
        collection holding pages next to it."""
        source = coll.database['%s_pages' % coll.name]
        source.drop()
        source.insert_many(pages)
        coll.drop()
        coll.database.create_collection(coll.name)
        for name, key in indexes:
            coll.database.command('createIndexes', coll.name, indexes=[
                {'key': key, 'name': name, 'unique': True}])
        return source

    def test_summary_pipeline_names_the_shard_key(self):
        strict, _ = self.colls()
        pages = self.setup(strict, [
            summary_page('s1', self.T, 0, 3, {'temp': field_summary([1.5])}),
            summary_page('s1', self.T, 1, 2)],
            [('sk', {'sensor_id': 1, 'bucket_start': 1})])
        pages.database.command('aggregate', pages.name, cursor={},
                               pipeline=summary_pipeline([('s1', self.T)], strict.name))
        doc = strict.find_one()
        self.assertEqual((doc['count'], doc['pages']), (5, 2))

    def test_on_without_the_shard_key(self):
        strict, plain = self.colls()
        for coll in (plain, strict):
            pages = self.setup(coll, [{'_id': i, 'sensor_id': s, 'bucket_start': self.T}
                                      for i, s in enumerate('ab')],
                               [('sensor', {'sensor_id': 1})])
            for on in ('_id', 'sensor_id'):
                cmd = dict(cursor={}, pipeline=[{'$merge': {'into': coll.name, 'on': on}}])
                if coll is plain:
                    pages.database.command('aggregate', pages.name, **cmd)
                    continue
                with self.assertRaises(OperationFailure) as cm:
                    pages.database.command('aggregate', pages.name, **cmd)
                self.assertEqual(cm.exception.code, 51190)
                self.assertEqual(cm.exception.details['errmsg'],
                                 'Cannot find index to verify that join fields will be unique')
        self.assertEqual(plain.count_documents({}), 2)
        self.assertEqual(strict.count_documents({}), 0)
        # Not created yet, the output collection is not sharded: "_id" is enough.
        other = strict.database['%s_new' % strict.name]
        pages.database.command('aggregate', pages.name, cursor={},
                               pipeline=[{'$merge': {'into': other.name, 'on': '_id'}}])
        self.assertEqual(other.count_documents({}), 2)

    def test_default_on_is_the_document_key(self):
        strict, _ = self.colls()
        pages = self.setup(strict, [summary_page('s1', self.T, 0, 3),
                                    summary_page('s1', self.T, 1, 2)])
        merge = {'$merge': {'into': strict.name, 'whenMatched': 'replace'}}
        pages.database.command('aggregate', pages.name, cursor={}, pipeline=[merge])
        pages.database.command('aggregate', pages.name, cursor={}, pipeline=[merge])
        self.assertEqual(strict.count_documents({}), 2)
        # Every shard-key field must be in each result.
        with self.assertRaises(OperationFailure) as cm:
            pages.database.command('aggregate', pages.name, cursor={}, pipeline=[
                {'$project': {'bucket_start': 0}}, merge])
        self.assertEqual(cm.exception.code, 51132)


class MergeWriteStatsTest(StandInCase):
    """The writes of a $merge go through the server's write path: counted by
    bucketdTestStats as the updates they are, refused past 16 MiB, write concern checked."""

    def test_counts_what_merge_writes(self):
        coll, _ = self.colls()
        pages = coll.database['%s_pages' % coll.name]
        t = datetime.datetime(2025, 1, 15, 14, 0, 0)
        pages.insert_many([summary_page('s1', t, 0, 3, {'temp': field_summary([1.5, 2.5])}),
                           summary_page('s1', t + HOUR, 0, 1, {})])
        coll.database.command('createIndexes', coll.name, indexes=[
            {'key': {'sensor_id': 1, 'bucket_start': 1}, 'name': 'sk', 'unique': True}])
        pipeline = summary_pipeline([('s1', t), ('s1', t + HOUR)], coll.name)

        def stats():
            reply = coll.database.command('bucketdTestStats', coll.name)
            return reply['docBytesWritten'], reply['updatesApplied']

        def size(doc):
            return len(bson.encode(doc))

        coll.database.command('aggregate', pages.name, pipeline=pipeline, cursor={})
        self.assertEqual(stats(), (sum(size(d) for d in coll.find()), 2))   # two upserts
        coll.database.command('aggregate', pages.name, pipeline=pipeline, cursor={})
        self.assertEqual(stats()[1], 2)                  # nothing changed: nothing written
        before = stats()[0]
        pages.insert_one(summary_page('s1', t, 1, 1, {'temp': field_summary([9.5])}))
        coll.database.command('aggregate', pages.name, pipeline=pipeline, cursor={})
        self.assertEqual(stats(), (before + size(coll.find_one({'bucket_start': t})), 3))

    def test_limits_and_write_concern(self):
        coll, _ = self.colls()
        pages = coll.database['%s_pages' % coll.name]
        pages.insert_one({'_id': 1, 'big': 'x' * (MAX_BSON - 100)})
        coll.insert_one({'_id': 1})
        grow = [{'$set': {'more': 'y' * 200}}, {'$merge': {'into': coll.name}}]
        with self.assertRaises(OperationFailure) as cm:
            coll.database.command('aggregate', pages.name, pipeline=grow, cursor={})
        self.assertEqual(cm.exception.code, 17419)       # an update past 16 MiB
        self.assertEqual(coll.find_one(), {'_id': 1})
        coll.delete_many({})
        with self.assertRaises(OperationFailure) as cm:
            coll.database.command('aggregate', pages.name, pipeline=grow, cursor={})
        self.assertEqual(cm.exception.code, 17420)       # the insert of an upsert
        with self.assertRaises(OperationFailure) as cm:
            coll.database.command('aggregate', pages.name, pipeline=[
                {'$merge': {'into': coll.name}}], cursor={}, writeConcern={'w': 2})
        self.assertEqual(cm.exception.code, 2)
        self.assertIsNone(coll.find_one())


class InjectedErrorTest(StandInCase):
    """failCommand with code 365 (TemporarilyUnavailable): a command error with
    errorLabels, as mongod gives it, and the per-statement writeErrorCode of this server;
    and --fail-command, which sets it up before the first connection."""

    def fail(self, mode, **data):
        return self.strict.client.admin.command('configureFailPoint', 'failCommand',
                                                mode=mode, data=data)

    def tearDown(self):
        self.strict.client.admin.command('configureFailPoint', 'failCommand', mode='off')

    def test_fail_command_at_start(self):
        mongo = start_mongo(use_external=False, fail_command={
            'mode': {'times': 1},
            'data': {'failCommands': ['insert'], 'errorCode': 365,
                     'errorLabels': ['RetryableWriteError']}})
        self.addCleanup(mongo.stop)
        c = pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000, retryWrites=False)
        self.addCleanup(c.close)
        coll = c.t.c
        with self.assertRaises(OperationFailure) as cm:
            coll.insert_one({'_id': 1})
        self.assertEqual(cm.exception.code, 365)
        self.assertTrue(cm.exception.has_error_label('RetryableWriteError'))
        self.assertEqual(cm.exception.details['codeName'], 'TemporarilyUnavailable')
        coll.insert_one({'_id': 2})                     # times: 1, used up
        self.assertEqual([d['_id'] for d in coll.find()], [2])

    def test_command_error_365_with_label(self):
        strict, _ = self.colls()
        self.fail({'times': 1}, failCommands=['update'], errorCode=365,
                  errorLabels=['RetryableWriteError'])
        reply = strict.database.command(
            'update', strict.name, updates=[{'q': {'_id': 1}, 'u': {'$set': {'v': 1}},
                                             'upsert': True}], check=False)
        self.assertEqual((reply['ok'], reply['code'], reply['codeName']),
                         (0.0, 365, 'TemporarilyUnavailable'))
        self.assertEqual(reply['errorLabels'], ['RetryableWriteError'])
        self.assertIsNone(strict.find_one())

    def test_write_error_365_per_statement(self):
        strict, _ = self.colls()
        self.fail({'times': 1}, failCommands=['update'], writeErrorCode=365,
                  writeErrorIndexes=[1], errorLabels=['RetryableWriteError'])
        reply = strict.database.command('update', strict.name, updates=[
            {'q': {'_id': i}, 'u': {'$set': {'v': i}}, 'upsert': True} for i in range(3)],
            ordered=False)
        self.assertEqual(reply['ok'], 1.0)
        self.assertEqual(reply['n'], 2)
        self.assertEqual([(e['index'], e['code']) for e in reply['writeErrors']], [(1, 365)])
        self.assertEqual(reply['writeErrors'][0]['errmsg'],
                         "Failing command via 'failCommand' failpoint")
        self.assertNotIn('errorLabels', reply)          # labels are for command errors
        self.assertEqual([d['_id'] for d in strict.find()], [0, 2])
        # Every statement by default; an ordered bulk stops at the first.
        self.fail({'times': 1}, failCommands=['insert', 'update'], writeErrorCode=365)
        with self.assertRaises(BulkWriteError) as cm:
            strict.bulk_write([UpdateOne({'_id': 5}, {'$set': {'v': 5}}, upsert=True),
                               UpdateOne({'_id': 6}, {'$set': {'v': 6}}, upsert=True)])
        self.assertEqual([(e['index'], e['code']) for e in cm.exception.details['writeErrors']],
                         [(0, 365)])
        self.assertEqual(strict.count_documents({}), 2)
        # Not for a read.
        self.fail('alwaysOn', failCommands=['find'], writeErrorCode=365)
        self.assertEqual(strict.count_documents({}), 2)

    def test_write_concern_error_keeps_the_labels(self):
        strict, _ = self.colls()
        wce = {'code': 64, 'codeName': 'WriteConcernFailed', 'errmsg': 'timed out'}
        self.fail({'times': 1}, failCommands=['update'], writeConcernError=wce,
                  errorLabels=['RetryableWriteError'])
        reply = strict.database.command(
            'update', strict.name, updates=[{'q': {'_id': 1}, 'u': {'$set': {'v': 1}},
                                             'upsert': True}])
        self.assertEqual(reply['writeConcernError']['code'], 64)
        self.assertEqual(reply['errorLabels'], ['RetryableWriteError'])
        self.assertEqual(strict.find_one(), {'_id': 1, 'v': 1})

    def test_bad_fail_command_stops_the_server(self):
        for bad in ('{', '[1]', '{"mode": "sometimes"}'):
            with self.assertRaises(RuntimeError, msg=bad) as cm:
                start_mongo(use_external=False, fail_command=bad)
            self.assertIn('--fail-command', str(cm.exception))


@unittest.skipIf(EXTERNAL, 'server process tests need the test server')
class ServerProcessTest(unittest.TestCase):

    def test_sigterm_exits_zero(self):
        # With a client still connected: the server must not wait for idle connections.
        # stop() fails the test if the process is still there after its (generous) timeout;
        # how fast it goes is not this test's business.
        mongo = start_mongo(use_external=False)
        with pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000) as c:
            c.t.c.insert_one({'_id': 1})
            self.assertEqual(c.t.c.find_one(), {'_id': 1})
            self.assertEqual(mongo.stop(timeout=30.0), 0)

    def test_fixed_port_and_sigint(self):
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        mongo = start_mongo(port=port, use_external=False, verbose=True)
        self.assertEqual(mongo.uri, 'mongodb://127.0.0.1:%d/' % port)
        with pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000) as c:
            c.admin.command('ping')
        proc = mongo.proc
        proc.send_signal(2)
        self.assertEqual(proc.wait(5), 0)
        self.assertIn('ping', mongo.log_text())
        mongo.stop()

    def test_size_accounting_is_exact(self):
        # The server measures every document it stores (16 MiB limit) without encoding it,
        # with shortcuts for arrays built by $concatArrays / $sortArray: the measure must be
        # the encoder's, byte for byte, through a series of bucket appends and late readings.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import mongo_server
        mongo_server._install_mongomock_fixes()
        backend = mongo_server.Backend()
        start = datetime.datetime(2025, 1, 15, 14, 0, 0)
        meta = {'measurement': 'm', 'tags': {'k': 'v\u00e9'}}
        for flush in range(40):
            seconds = [(flush * 37 + k * 11) % 3600 for k in range(30)]  # late ones too
            batch = [reading(start, sec, 0.5 * sec, sec) for sec in sorted(seconds)]
            _, flt, pipeline = bucket_update('s\u00fc', meta, start, 0, batch, 'temp',
                                             writer='w', seq=flush + 1)
            reply = backend.run('sizes', {'update': 'b', 'updates': [
                {'q': flt, 'u': pipeline, 'upsert': True}]}, 1)
            self.assertEqual((reply['ok'], reply.get('writeErrors')), (1.0, None), reply)
            doc = backend.coll('sizes', 'b')._docs()[flt['_id']]
            self.assertEqual(mongo_server.bson_size(doc), len(bson.encode(doc)))
        self.assertEqual(len(doc['readings']), 40 * 30)

    def test_quiet_without_verbose(self):
        mongo = start_mongo(use_external=False)
        with pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000) as c:
            for i in range(20):
                c.t.c.insert_one({'i': i})
            with self.assertRaises(OperationFailure):
                c.t.command('nope')
        mongo.stop()
        self.assertEqual(mongo.log_text(), '')


if __name__ == '__main__':
    unittest.main(verbosity=2)
