#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Tests for the MongoDB test server (tests/mongo_server.py), through pymongo: the handshake,
CRUD, TTL indexes, the 16 MiB and wire limits and a standalone's refusals.
test_mongo_server_writes.py has the fail points, validators and $merge, and
test_mongo_server_strict.py the strictness switches and the server process itself.

Run: /usr/bin/python3 tests/e2e/test_mongo_server.py

With BUCKETD_TEST_MONGODB_URI set, the same checks run against that MongoDB
instead (in a database of their own, dropped afterwards).
"""

import datetime
import os
import socket
import struct
import sys
import unittest
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mongo_server_cases import (EXTERNAL, HOUR, MS, MAX_BSON, MAX_INTERNAL_BSON,  # noqa: E402
                                MAX_MESSAGE, MIB, use_database, bucket_update, bucket_op, reading)

import bson  # noqa: E402
import pymongo  # noqa: E402
from bson.binary import Binary  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from pymongo import InsertOne, UpdateOne, uri_parser  # noqa: E402
from pymongo.errors import (BulkWriteError, DuplicateKeyError, OperationFailure,  # noqa: E402
                            WriteError)


server = client = db = None  # set by setUpModule
use_database(globals())


class HandshakeTest(unittest.TestCase):

    def test_hello_and_ismaster(self):
        hello = client.admin.command('hello')
        self.assertTrue(hello['isWritablePrimary'])
        ismaster = client.admin.command('ismaster')
        self.assertTrue(ismaster['ismaster'])
        for doc in (hello, ismaster):
            self.assertGreaterEqual(doc['maxWireVersion'], 17)
            self.assertEqual(doc['maxBsonObjectSize'], 16777216)
            self.assertEqual(doc['maxMessageSizeBytes'], 48000000)
            self.assertEqual(doc['maxWriteBatchSize'], 100000)
            self.assertIn('logicalSessionTimeoutMinutes', doc)
            if not EXTERNAL:
                self.assertEqual(doc['maxWireVersion'], 17)
                self.assertEqual(doc['minWireVersion'], 0)
                self.assertNotIn('setName', doc)

    def test_ping_build_info_server_status(self):
        self.assertEqual(client.admin.command('ping')['ok'], 1.0)
        info = client.admin.command('buildInfo')
        self.assertGreaterEqual(info['versionArray'][:1], [6])
        if not EXTERNAL:
            self.assertEqual(info['version'], '6.0.0')
            self.assertEqual(info['versionArray'], [6, 0, 0, 0])
        status = client.admin.command('serverStatus')
        self.assertEqual(status['ok'], 1.0)
        self.assertIn('version', status)
        self.assertIn('connections', status)
        self.assertEqual(client.admin.command('getParameter', 1,
                                              featureCompatibilityVersion=1)['ok'], 1.0)

    def test_unknown_command(self):
        with self.assertRaises(OperationFailure) as cm:
            db.command('bucketdNoSuchCommand')
        self.assertEqual(cm.exception.code, 59)
        self.assertEqual(cm.exception.details.get('codeName'), 'CommandNotFound')
        self.assertIn("no such command: 'bucketdNoSuchCommand'",
                      cm.exception.details.get('errmsg'))

    def test_list_databases_and_collections(self):
        coll = db.listing
        coll.insert_one({'_id': 1})
        self.assertIn(db.name, client.list_database_names())
        self.assertIn('listing', db.list_collection_names())
        coll.drop()
        self.assertNotIn('listing', db.list_collection_names())
        db.create_collection('created')
        self.assertIn('created', db.list_collection_names())
        with self.assertRaises(OperationFailure) as cm:
            db.command('create', 'created')
        self.assertEqual(cm.exception.code, 48)


class CrudTest(unittest.TestCase):

    def setUp(self):
        self.coll = db['crud_%s' % self._testMethodName]
        self.coll.drop()

    def test_batches_stay_under_the_reply_limit(self):
        # 40 000 small documents (~22 MB of BSON with array overhead) read in one cursor: each
        # reply must fit the 16 MB limit, so the server has to split where mongod would.
        self.coll.insert_many([{'_id': i, 's': 'x' * 500} for i in range(40000)])
        self.assertEqual(sum(1 for _ in self.coll.find({}, batch_size=0)), 40000)

    def test_insert_find_get_more(self):
        self.coll.insert_many([{'_id': i, 'x': i % 7, 'big': Int64(1 << 40)} for i in range(250)])
        docs = list(self.coll.find().sort('_id', 1))
        self.assertEqual([d['_id'] for d in docs], list(range(250)))
        self.assertIs(type(docs[0]['big']), Int64)

        first = db.command('find', self.coll.name, filter={}, sort={'_id': 1})
        self.assertEqual(len(first['cursor']['firstBatch']), 101)
        self.assertNotEqual(first['cursor']['id'], 0)
        self.assertEqual(first['cursor']['ns'], '%s.%s' % (db.name, self.coll.name))
        more = db.command('getMore', first['cursor']['id'], collection=self.coll.name,
                          batchSize=100)
        self.assertEqual([d['_id'] for d in more['cursor']['nextBatch']], list(range(101, 201)))
        rest = db.command('getMore', first['cursor']['id'], collection=self.coll.name)
        self.assertEqual([d['_id'] for d in rest['cursor']['nextBatch']], list(range(201, 250)))
        self.assertEqual(rest['cursor']['id'], 0)
        with self.assertRaises(OperationFailure) as cm:
            db.command('getMore', first['cursor']['id'], collection=self.coll.name)
        self.assertEqual(cm.exception.code, 43)

        got = list(self.coll.find({'x': {'$gte': 5}}, {'x': 1, '_id': 0})
                   .sort([('x', -1), ('_id', 1)]).skip(3).limit(40).batch_size(7))
        self.assertEqual(len(got), 40)
        self.assertEqual(got[0], {'x': 6})
        self.assertTrue(all(set(d) == {'x'} for d in got))
        self.assertEqual(self.coll.count_documents({'x': 3}), 36)
        self.assertEqual(sorted(self.coll.distinct('x')), list(range(7)))
        agg = list(self.coll.aggregate([{'$match': {'x': {'$lt': 2}}},
                                        {'$group': {'_id': '$x', 'n': {'$sum': 1},
                                                    'big': {'$sum': '$big'}}},
                                        {'$sort': {'_id': 1}}]))
        self.assertEqual([(d['_id'], d['n']) for d in agg], [(0, 36), (1, 36)])
        self.assertIs(type(agg[0]['big']), Int64)

        cursor = self.coll.find(batch_size=10)
        next(cursor)
        cursor.close()

    def test_or_of_equalities_matches_as_mongodb_does(self):
        # The flusher's page look-up: {$or: [{sensor_id, bucket_start}, ...]}. The server takes
        # such a filter in one pass over the collection; what it matches must not change:
        # arrays holding the value match (MongoDB's equality on an array field), a missing
        # field, another type or another date does not.
        t0 = datetime.datetime(2026, 11, 29, 10, 0)
        t1 = datetime.datetime(2026, 11, 29, 11, 0)
        docs = [{'_id': 1, 'sensor_id': 'a', 'bucket_start': t0},
                {'_id': 2, 'sensor_id': 'a', 'bucket_start': t1},
                {'_id': 3, 'sensor_id': 'b', 'bucket_start': t0},
                {'_id': 4, 'sensor_id': ['x', 'c'], 'bucket_start': t0},
                {'_id': 5, 'sensor_id': 'c'},
                {'_id': 6, 'sensor_id': 'c', 'bucket_start': [t1, t0]},
                {'_id': 7, 'sensor_id': 'd', 'bucket_start': 'not a date'},
                {'_id': 8, 'sensor_id': {'k': 'a'}, 'bucket_start': t0}]
        self.coll.insert_many(docs)
        flt = {'$or': [{'sensor_id': 'a', 'bucket_start': t0},
                       {'sensor_id': 'c', 'bucket_start': t0},
                       {'sensor_id': 'd', 'bucket_start': t0},
                       {'sensor_id': 'zz', 'bucket_start': t1}]}
        got = sorted(d['_id'] for d in self.coll.find(flt))
        self.assertEqual(got, [1, 4, 6])
        # The same through an aggregate's $match (the summaries' pipeline starts with one).
        got = sorted(d['_id'] for d in self.coll.aggregate([{'$match': flt}]))
        self.assertEqual(got, [1, 4, 6])
        # Clauses of other shapes still go through the general matcher.
        mixed = {'$or': [{'sensor_id': 'a', 'bucket_start': t1}, {'sensor_id': 'b'}]}
        self.assertEqual(sorted(d['_id'] for d in self.coll.find(mixed)), [2, 3])

    def test_update_delete_classic(self):
        self.coll.insert_many([{'_id': i, 'n': Int64(i), 'v': i} for i in range(5)])
        res = self.coll.update_many({'_id': {'$lt': 3}}, {'$inc': {'n': Int64(10)},
                                                          '$set': {'tag': 'a'}})
        self.assertEqual((res.matched_count, res.modified_count), (3, 3))
        doc = self.coll.find_one({'_id': 1})
        self.assertEqual(doc['n'], 11)
        self.assertIs(type(doc['n']), Int64)
        res = self.coll.update_one({'_id': 99}, {'$setOnInsert': {'v': 1}, '$max': {'m': 3}},
                                   upsert=True)
        self.assertEqual(res.upserted_id, 99)
        self.assertEqual(self.coll.find_one({'_id': 99}), {'_id': 99, 'v': 1, 'm': 3})
        self.assertEqual(self.coll.delete_many({'_id': {'$gte': 3}}).deleted_count, 3)
        self.assertEqual(self.coll.delete_one({}).deleted_count, 1)
        self.assertEqual(self.coll.count_documents({}), 2)
        with self.assertRaises(pymongo.errors.WriteError) as cm:
            self.coll.update_one({'_id': 1}, {'$bogus': {'a': 1}})
        self.assertEqual(cm.exception.code, 9)

    def test_unordered_bulk_with_duplicate_key(self):
        self.coll.insert_one({'_id': 2, 'orig': True})
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([InsertOne({'_id': 1}), InsertOne({'_id': 2}),
                                  InsertOne({'_id': 3}),
                                  UpdateOne({'_id': 4}, {'$set': {'a': 1}}, upsert=True)],
                                 ordered=False)
        details = cm.exception.details
        self.assertEqual([(e['index'], e['code']) for e in details['writeErrors']], [(1, 11000)])
        self.assertEqual(details['nInserted'], 2)
        self.assertEqual(details['nUpserted'], 1)
        self.assertEqual(sorted(d['_id'] for d in self.coll.find()), [1, 2, 3, 4])
        self.assertEqual(self.coll.find_one({'_id': 2}), {'_id': 2, 'orig': True})

        # Ordered: stops at the first error.
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([InsertOne({'_id': 5}), InsertOne({'_id': 5}),
                                  InsertOne({'_id': 6})], ordered=True)
        self.assertEqual([(e['index'], e['code']) for e in cm.exception.details['writeErrors']],
                         [(1, 11000)])
        self.assertIsNone(self.coll.find_one({'_id': 6}))

    def test_bucket_pipeline_update(self):
        start = datetime.datetime(2025, 1, 15, 14, 0, 0)
        meta = {'measurement': 'weather', 'tags': {'loc': 'us'}}
        batch1 = [reading(start, 0, 20.0, 1), reading(start, 10, 21.5, 2),
                  reading(start, 20, 22.0, 3)]
        batch2 = [reading(start, 30, 23.0, 4), reading(start, 40, 19.0, 5)]
        late = [reading(start, 5, 25.0, 6), reading(start, 25, 18.5, 7)]

        doc_id, op = bucket_op('weather,loc=us', meta, start, 0, batch1, 'temp')
        res = self.coll.bulk_write([op], ordered=False)
        self.assertEqual(res.upserted_count, 1)
        self.assertEqual(res.upserted_ids, {0: doc_id})
        doc = self.coll.find_one({'_id': doc_id})
        self.assertEqual(list(doc), ['_id', 'sensor_id', 'meta', 'bucket_start', 'bucket_end',
                                     'page', 'count', 'readings', 'summary'])
        self.assertEqual(doc['sensor_id'], 'weather,loc=us')
        self.assertEqual(doc['meta'], meta)
        self.assertEqual(doc['bucket_end'], start + HOUR - MS)
        self.assertEqual(doc['count'], 3)
        self.assertIs(type(doc['count']), Int64)
        self.assertEqual(doc['readings'], batch1)
        self.assertEqual(doc['summary'], {'temp': {'min': 20.0, 'max': 22.0, 'sum': 63.5,
                                                   'count': 3, 'avg': 63.5 / 3}})

        _, op = bucket_op('weather,loc=us', meta, start, 0, batch2, 'temp')
        res = self.coll.bulk_write([op], ordered=False)
        self.assertEqual((res.matched_count, res.modified_count, res.upserted_count), (1, 1, 0))
        doc = self.coll.find_one({'_id': doc_id})
        self.assertEqual(doc['readings'], batch1 + batch2)
        self.assertEqual(doc['count'], 5)

        _, op = bucket_op('weather,loc=us', meta, start, 0, late, 'temp')
        self.coll.bulk_write([op], ordered=False)
        doc = self.coll.find_one({'_id': doc_id})
        everything = sorted(batch1 + batch2 + late, key=lambda r: r['ts'])
        self.assertEqual(doc['readings'], everything)
        self.assertEqual([r['n'] for r in doc['readings']], [1, 6, 2, 3, 7, 4, 5])
        self.assertEqual(doc['count'], 7)
        self.assertIs(type(doc['count']), Int64)
        summary = doc['summary']['temp']
        temps = [r['temp'] for r in everything]
        self.assertEqual(summary['min'], min(temps))
        self.assertEqual(summary['max'], max(temps))
        self.assertEqual(summary['sum'], sum(temps))
        self.assertEqual(summary['count'], 7)
        self.assertIs(type(summary['count']), Int64)
        self.assertAlmostEqual(summary['avg'], sum(temps) / 7)
        self.assertIs(type(summary['avg']), float)
        for r in doc['readings']:
            self.assertIs(type(r['n']), Int64)
            self.assertIs(type(r['temp']), float)
            self.assertIs(r['on'], True)
        self.assertIs(type(doc['page']), int)

    def test_writer_sequence_is_idempotent(self):
        start = datetime.datetime(2025, 1, 15, 15, 0, 0)
        meta = {'measurement': 'm', 'tags': {}}
        batch = [reading(start, 1, 1.5, 1)]
        doc_id, flt, pipeline = bucket_update('m', meta, start, 0, batch, 'temp', writer='gw1',
                                              seq=1)
        op = UpdateOne(flt, pipeline, upsert=True)
        self.assertEqual(self.coll.bulk_write([op], ordered=False).upserted_count, 1)
        before = self.coll.find_one({'_id': doc_id})
        self.assertEqual(before['w'], {'gw1': 1})

        # The same flush again (a retry after a lost reply) is refused as a duplicate.
        other_id, other = bucket_op('m2', meta, start, 0, batch, 'temp', writer='gw1',
                                        seq=1)
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([op, other], ordered=False)
        errors = cm.exception.details['writeErrors']
        self.assertEqual([(e['index'], e['code']) for e in errors], [(0, 11000)])
        self.assertEqual(cm.exception.details['nUpserted'], 1)
        self.assertEqual(self.coll.find_one({'_id': doc_id}), before)

        with self.assertRaises(DuplicateKeyError):
            self.coll.update_one(flt, pipeline, upsert=True)

        # The next flush of that writer, and another writer's, apply.
        _, op2 = bucket_op('m', meta, start, 0, [reading(start, 2, 2.5, 2)], 'temp',
                               writer='gw1', seq=2)
        _, op3 = bucket_op('m', meta, start, 0, [reading(start, 3, 3.5, 3)], 'temp',
                               writer='gw2', seq=1)
        res = self.coll.bulk_write([op2, op3], ordered=False)
        self.assertEqual(res.modified_count, 2)
        after = self.coll.find_one({'_id': doc_id})
        self.assertEqual(after['count'], 3)
        self.assertEqual(after['w'], {'gw1': 2, 'gw2': 1})
        self.assertIs(type(after['w']['gw1']), Int64)

    def test_literal_keeps_dollar_strings(self):
        self.coll.insert_one({'_id': 1, 'x': 'X', 'y': 'Y'})
        self.coll.update_one({'_id': 1}, [{'$set': {
            'label': {'$literal': '$x'},
            'tmpl': {'$literal': {'a': '$x', 'b': ['$y', {'c': '$$ROOT'}]}},
            'copy': '$x',
            'arr': ['$y', {'$literal': '$y'}, '$missing'],
        }}])
        doc = self.coll.find_one({'_id': 1})
        self.assertEqual(doc['label'], '$x')
        self.assertEqual(doc['tmpl'], {'a': '$x', 'b': ['$y', {'c': '$$ROOT'}]})
        self.assertEqual(doc['copy'], 'X')
        self.assertEqual(doc['arr'], ['Y', '$y', None])
        out = list(self.coll.aggregate([{'$project': {'_id': 0,
                                                      'v': {'$literal': {'$add': [1, 2]}}}}]))
        self.assertEqual(out, [{'v': {'$add': [1, 2]}}])

    def test_expression_semantics(self):
        self.coll.insert_one({'_id': 1, 'a': [{'ts': 1}, {'ts': 2}, {'x': 0}], 'n': None,
                              'l': Int64(5)})
        out = list(self.coll.aggregate([{'$project': {
            '_id': 0,
            'last': {'$arrayElemAt': ['$a.ts', -1]},
            'none': {'$arrayElemAt': ['$nothing.ts', -1]},
            'cat_null': {'$concatArrays': [[1], '$nothing']},
            'gte_null': {'$gte': [datetime.datetime(2020, 1, 1), None]},
            'missing_lt_null': {'$lt': ['$nothing', None]},
            'num_lt_str': {'$lt': [5, 'a']},
            'obj_lt_arr': {'$lt': [{'z': 1}, [0]]},
            'min': {'$min': [None, '$nothing', 3, 2.5]},
            'max': {'$max': ['$a.ts']},
            'long': {'$add': ['$l', Int64(1)]},
            'dbl': {'$add': ['$l', 0.5]},
            'add_null': {'$add': ['$nothing', 1]},
            'sorted': {'$sortArray': {'input': [3, 1, 2], 'sortBy': -1}},
        }}]))
        self.assertEqual(len(out), 1)
        doc = out[0]
        self.assertEqual(doc['last'], 2)
        self.assertIsNone(doc['none'])
        self.assertIsNone(doc['cat_null'])
        self.assertIs(doc['gte_null'], True)
        self.assertIs(doc['missing_lt_null'], True)
        self.assertIs(doc['num_lt_str'], True)
        self.assertIs(doc['obj_lt_arr'], True)
        self.assertEqual(doc['min'], 2.5)
        self.assertEqual(doc['max'], 2)
        self.assertEqual(doc['long'], 6)
        self.assertIs(type(doc['long']), Int64)
        self.assertEqual(doc['dbl'], 5.5)
        self.assertIsNone(doc['add_null'])
        self.assertEqual(doc['sorted'], [3, 2, 1])

    def test_indexes(self):
        first = self.coll.create_index([('sensor_id', 1), ('bucket_start', 1)])
        again = self.coll.create_index([('sensor_id', 1), ('bucket_start', 1)])
        self.assertEqual(first, again)
        reply = db.command('createIndexes', self.coll.name, indexes=[
            {'key': {'sensor_id': 1, 'bucket_start': 1}, 'name': first}])
        self.assertEqual(reply['numIndexesBefore'], reply['numIndexesAfter'])
        names = {ix['name']: ix for ix in self.coll.list_indexes()}
        self.assertEqual(set(names), {'_id_', first})
        self.assertEqual(dict(names[first]['key']), {'sensor_id': 1, 'bucket_start': 1})

        self.coll.create_index('u', unique=True)
        self.coll.insert_one({'_id': 1, 'u': 'a'})
        with self.assertRaises(DuplicateKeyError):
            self.coll.insert_one({'_id': 2, 'u': 'a'})
        self.coll.insert_one({'_id': 3, 'u': 'b'})
        with self.assertRaises(DuplicateKeyError):
            self.coll.update_one({'_id': 3}, {'$set': {'u': 'a'}})
        self.coll.update_one({'_id': 1}, {'$set': {'u': 'c'}})
        self.coll.update_one({'_id': 3}, {'$set': {'u': 'a'}})
        self.assertEqual(self.coll.find_one({'_id': 3})['u'], 'a')

        with self.assertRaises(OperationFailure) as cm:
            self.coll.create_index([('other', 1)], name=first)
        self.assertEqual(cm.exception.code, 86)
        with self.assertRaises(OperationFailure) as cm:
            self.coll.create_index([('sensor_id', 1), ('bucket_start', 1)], name='another')
        self.assertEqual(cm.exception.code, 85)

        self.coll.drop_index('u_1')
        self.coll.insert_one({'_id': 4, 'u': 'a'})
        self.assertEqual({ix['name'] for ix in self.coll.list_indexes()}, {'_id_', first})


class TtlIndexTest(unittest.TestCase):
    """TTL indexes, as bucketd's retention uses them (src/retention.c): createIndexes with
    expireAfterSeconds, collMod of it by name or key pattern, and what MongoDB refuses."""

    def setUp(self):
        self.name = 'ttl_%s' % self._testMethodName
        db[self.name].drop()
        self.coll = db[self.name]
        self.coll.insert_one({'_id': 0, 'bucket_end': datetime.datetime.utcnow()})

    def expiry(self, name):
        for ix in self.coll.list_indexes():
            if ix['name'] == name:
                return ix.get('expireAfterSeconds')
        raise AssertionError('no index %s' % name)

    def create(self, seconds, name='bucket_end_ttl', key=None):
        return db.command('createIndexes', self.name, indexes=[
            {'key': key or {'bucket_end': 1}, 'name': name, 'expireAfterSeconds': seconds}])

    def coll_mod(self, index, name=None):
        return db.command('collMod', name or self.name, index=index)

    def assertCode(self, code, fn, *args):
        with self.assertRaises(OperationFailure) as cm:
            fn(*args)
        self.assertEqual(cm.exception.code, code, cm.exception.details)

    def test_created_then_changed_in_place(self):
        self.create(3600)
        self.assertEqual(self.expiry('bucket_end_ttl'), 3600)
        again = self.create(3600)
        self.assertEqual(again['numIndexesBefore'], again['numIndexesAfter'])
        self.assertCode(85, self.create, 7200)
        reply = self.coll_mod({'name': 'bucket_end_ttl', 'expireAfterSeconds': 7200})
        self.assertEqual((reply['expireAfterSeconds_old'], reply['expireAfterSeconds_new']),
                         (3600, 7200))
        self.assertEqual(self.expiry('bucket_end_ttl'), 7200)
        reply = self.coll_mod({'keyPattern': {'bucket_end': 1}, 'expireAfterSeconds': 60})
        self.assertEqual((reply['expireAfterSeconds_old'], reply['expireAfterSeconds_new']),
                         (7200, 60))
        self.assertEqual(self.expiry('bucket_end_ttl'), 60)
        self.coll.drop_index('bucket_end_ttl')
        self.assertEqual({ix['name'] for ix in self.coll.list_indexes()}, {'_id_'})

    def test_a_single_field_index_becomes_a_ttl_index(self):
        self.coll.create_index('bucket_end', name='plain')
        self.assertIsNone(self.expiry('plain'))
        reply = self.coll_mod({'name': 'plain', 'expireAfterSeconds': 600})
        self.assertNotIn('expireAfterSeconds_old', reply)
        self.assertEqual(reply['expireAfterSeconds_new'], 600)
        self.assertEqual(self.expiry('plain'), 600)

    def test_refusals_change_nothing(self):
        self.create(3600)
        self.coll.create_index([('a', 1), ('b', 1)], name='ab')
        for index, code in [
                ({'name': 'bucket_end_ttl', 'keyPattern': {'bucket_end': 1},
                  'expireAfterSeconds': 1}, 72),
                ({'expireAfterSeconds': 1}, 72),
                ({'name': 'bucket_end_ttl'}, 72),
                ({'name': 'bucket_end_ttl', 'expireAfterSeconds': -1}, 72),
                ({'name': 'bucket_end_ttl', 'expireAfterSeconds': 'x'}, 14),
                ({'name': 'bucket_end_ttl', 'expireAfterSeconds': 1, 'bogus': 1}, 40415),
                ({'name': 'nope', 'expireAfterSeconds': 1}, 27),
                ({'keyPattern': {'nope': 1}, 'expireAfterSeconds': 1}, 27),
                ({'name': '_id_', 'expireAfterSeconds': 1}, 72),
                ({'name': 'ab', 'expireAfterSeconds': 1}, 72)]:
            with self.subTest(index=index):
                self.assertCode(code, self.coll_mod, index)
        self.assertEqual(self.expiry('bucket_end_ttl'), 3600)
        self.assertCode(26, self.coll_mod, {'name': 'bucket_end_ttl', 'expireAfterSeconds': 1},
                        'ttl_no_such_collection')
        self.assertCode(67, self.create, 'x', 'other')
        self.assertCode(67, self.create, -5, 'other')
        self.assertEqual({ix['name'] for ix in self.coll.list_indexes()},
                         {'_id_', 'bucket_end_ttl', 'ab'})

    @unittest.skipIf(EXTERNAL, "MongoDB's TTL monitor deletes within about 60 s, not at once")
    def test_the_test_server_expires_documents_when_the_collection_is_next_read(self):
        now = datetime.datetime.utcnow()
        self.coll.insert_many([{'_id': 1, 'bucket_end': now - 2 * HOUR},
                               {'_id': 2, 'bucket_end': now}, {'_id': 3}])
        self.create(3600)
        self.assertEqual(sorted(d['_id'] for d in self.coll.find()), [0, 2, 3])


# ---------------------------------------------------------------------------------------------
# Raw wire messages, for what a driver refuses to send
# ---------------------------------------------------------------------------------------------

def _recv_exact(sock, n):
    buf = b''
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError('connection closed after %d of %d bytes' % (len(buf), n))
        buf += chunk
    return buf


def wire_address():
    """(host, port) of the server to talk raw OP_MSG to (a replica set's primary), or None
    when the URI needs authentication or TLS, which a raw socket cannot do."""
    parsed = uri_parser.parse_uri(server.uri)
    opts = {k.lower(): v for k, v in parsed['options'].items()}
    if parsed.get('username') or opts.get('tls') or opts.get('ssl') or \
            server.uri.startswith('mongodb+srv://'):
        return None
    primary = client.admin.command('hello').get('primary')
    if primary:
        host, _, port = primary.rpartition(':')
        return host, int(port)
    return parsed['nodelist'][0]


def op_msg(sock, body, sequences=(), request_id=1):
    """Send one OP_MSG (body, then document sequences) and return the reply document."""
    sections = b'\x00' + bson.encode(body)
    for ident, docs in sequences:
        data = ident.encode() + b'\x00' + b''.join(bson.encode(d) for d in docs)
        sections += b'\x01' + struct.pack('<i', 4 + len(data)) + data
    msg = struct.pack('<I', 0) + sections
    sock.sendall(struct.pack('<iiii', 16 + len(msg), request_id, 0, 2013) + msg)
    length, _, response_to, opcode = struct.unpack('<iiii', _recv_exact(sock, 16))
    rest = _recv_exact(sock, length - 16)
    assert opcode == 2013 and response_to == request_id, (opcode, response_to)
    return bson.decode(rest[5:])


class RawWireCase(unittest.TestCase):

    def setUp(self):
        addr = wire_address()
        if addr is None:
            self.skipTest('raw wire messages need a server without authentication or TLS')
        self.sock = socket.create_connection(addr, timeout=60)
        self.addCleanup(self.sock.close)


# ---------------------------------------------------------------------------------------------
# 16 MiB documents and wire limits
# ---------------------------------------------------------------------------------------------

class DocumentSizeTest(unittest.TestCase):
    """MongoDB refuses to store a document over 16 MiB (16777216 bytes of BSON): the one
    update or upsert that would produce it fails with a writeErrors entry, the rest of an
    unordered bulk applies (see _too_large in tests/mongo_server.py for the server source)."""

    def setUp(self):
        self.coll = db['size_%s' % self._testMethodName]
        self.coll.drop()

    def assertTooLarge(self, error, index, update_of_existing):
        """error: one writeErrors entry."""
        self.assertEqual(error['index'], index)
        if update_of_existing:
            # 17419 up to 7.x; 8.x reports BSONObjectTooLarge with the same message.
            codes = (17419, 10334) if EXTERNAL else (17419,)
            message = 'Resulting document after update is larger than 16777216'
        else:
            codes = (17420,)
            message = 'Document to upsert is larger than 16777216'
        self.assertIn(error['code'], codes)
        self.assertIn(message, error['errmsg'])

    def test_update_over_16mib_fails_that_update_only(self):
        self.coll.insert_one({'_id': 'big', 'a': 'a' * (9 * MIB)})
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([
                UpdateOne({'_id': 'big'}, {'$set': {'b': 'b' * (9 * MIB)}}),
                UpdateOne({'_id': 'small'}, {'$set': {'v': 1}}, upsert=True),
                UpdateOne({'_id': 'big'}, {'$set': {'c': 1}}),
            ], ordered=False)
        details = cm.exception.details
        self.assertEqual(len(details['writeErrors']), 1, details['writeErrors'])
        self.assertTooLarge(details['writeErrors'][0], 0, True)
        self.assertEqual(details['nUpserted'], 1)
        self.assertEqual(details['nModified'], 1)
        big = self.coll.find_one({'_id': 'big'})
        self.assertNotIn('b', big)
        self.assertEqual(big['c'], 1)
        self.assertEqual(len(big['a']), 9 * MIB)
        self.assertEqual(self.coll.find_one({'_id': 'small'}), {'_id': 'small', 'v': 1})

    def test_pipeline_update_over_16mib(self):
        self.coll.insert_one({'_id': 'p', 'a': 'a' * (9 * MIB)})
        with self.assertRaises(WriteError) as cm:
            self.coll.update_one({'_id': 'p'}, [{'$set': {'b': '$a'}}])
        self.assertIn(cm.exception.code, (17419, 10334) if EXTERNAL else (17419,))
        self.assertNotIn('b', self.coll.find_one({'_id': 'p'}))

    def test_exactly_16mib_is_stored_one_byte_more_is_not(self):
        self.coll.insert_one({'_id': 'edge', 'a': ''})
        room = MAX_BSON - len(bson.encode({'_id': 'edge', 'a': ''}))
        self.coll.update_one({'_id': 'edge'}, {'$set': {'a': 'x' * room}})
        self.assertEqual(len(bson.encode(self.coll.find_one({'_id': 'edge'}))), MAX_BSON)
        with self.assertRaises(WriteError) as cm:
            self.coll.update_one({'_id': 'edge'}, {'$set': {'a': 'x' * (room + 1)}})
        self.assertIn(cm.exception.code, (17419, 10334) if EXTERNAL else (17419,))
        self.assertEqual(len(self.coll.find_one({'_id': 'edge'})['a']), room)

    def test_upsert_over_16mib_is_not_inserted(self):
        # The filter's equality seeds the new document (8.5 MiB), the pipeline copies it.
        seed = 's' * (8 * MIB + MIB // 2)
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([
                UpdateOne({'_id': 'ok1'}, {'$set': {'v': 1}}, upsert=True),
                UpdateOne({'_id': 'huge', 'a': seed}, [{'$set': {'b': '$a'}}], upsert=True),
                UpdateOne({'_id': 'ok2'}, {'$set': {'v': 2}}, upsert=True),
            ], ordered=False)
        details = cm.exception.details
        self.assertEqual(len(details['writeErrors']), 1, details['writeErrors'])
        self.assertTooLarge(details['writeErrors'][0], 1, False)
        self.assertEqual(details['nUpserted'], 2)
        self.assertEqual(sorted(d['_id'] for d in self.coll.find({}, {'_id': 1})),
                         ['ok1', 'ok2'])


class WireLimitTest(RawWireCase):
    """What mongod does with messages over its parsing limits: a document over
    BSONObjMaxInternalSize (16 MiB + 16 KiB) fails the whole command with
    BSONObjectTooLarge (10334) while it is parsed (src/mongo/rpc/op_msg.cpp reads every
    section as a BSONObj), a message over maxMessageSizeBytes ends the connection without a
    reply (src/mongo/transport/asio/asio_session_impl.cpp, ProtocolError)."""

    def setUp(self):
        super().setUp()
        self.coll = db['wire_%s' % self._testMethodName]
        self.coll.drop()

    def test_update_statement_over_16mib_plus_16kib_fails_the_command(self):
        big = {'q': {'_id': 'big'}, 'u': {'$set': {'pad': 'p' * (MAX_INTERNAL_BSON + 1024)}},
               'upsert': True}
        small = {'q': {'_id': 'small'}, 'u': {'$set': {'v': 1}}, 'upsert': True}
        self.assertGreater(len(bson.encode(big)), MAX_INTERNAL_BSON)
        reply = op_msg(self.sock, {'update': self.coll.name, '$db': db.name, 'ordered': False},
                       [('updates', [small, big])])
        self.assertEqual(reply['ok'], 0.0, reply)
        self.assertEqual(reply['code'], 10334, reply)
        self.assertTrue(reply['errmsg'].startswith('BSONObj size: '), reply)
        # Refused while parsing: not even the small statement ran.
        self.assertEqual(self.coll.count_documents({}), 0)
        # The connection stays usable.
        reply = op_msg(self.sock, {'ping': 1, '$db': 'admin'}, request_id=2)
        self.assertEqual(reply['ok'], 1.0)

    def test_insert_over_16mib_is_a_write_error(self):
        doc = {'_id': 'big', 'pad': 'p' * MAX_BSON}  # over the stored limit, under the wire's
        self.assertLess(len(bson.encode(doc)), MAX_INTERNAL_BSON)
        reply = op_msg(self.sock, {'insert': self.coll.name, '$db': db.name, 'ordered': False},
                       [('documents', [doc, {'_id': 'small'}])])
        self.assertEqual(reply['ok'], 1.0, reply)
        self.assertEqual(reply['n'], 1)
        self.assertEqual([e['index'] for e in reply['writeErrors']], [0])
        self.assertIn(reply['writeErrors'][0]['code'], (2, 10334) if EXTERNAL else (2,))
        self.assertIn('object to insert too large', reply['writeErrors'][0]['errmsg'])
        self.assertEqual([d['_id'] for d in self.coll.find()], ['small'])

    def test_message_over_max_message_size_ends_the_connection(self):
        # Only the header: the server must give up on the length alone.
        self.sock.sendall(struct.pack('<iiii', MAX_MESSAGE + 1, 1, 0, 2013))
        try:
            self.assertEqual(self.sock.recv(16), b'')
        except ConnectionResetError:
            pass  # a reset is a closed connection too


class StandaloneTest(RawWireCase):

    def test_standalone_refuses_transaction_numbers(self):
        hello = client.admin.command('hello')
        if hello.get('setName') or hello.get('msg') == 'isdbgrid':
            self.skipTest('a replica set or mongos accepts transaction numbers')
        lsid = {'id': Binary(uuid.uuid4().bytes, 4)}
        reply = op_msg(self.sock, {'insert': 'txn', '$db': db.name, 'documents': [{'_id': 1}],
                                   'lsid': lsid, 'txnNumber': Int64(1)})
        self.assertEqual((reply['ok'], reply['code']), (0.0, 20), reply)
        self.assertIn('Transaction numbers are only allowed on a replica set member or mongos',
                      reply['errmsg'])
        self.assertIsNone(db.txn.find_one())


if __name__ == '__main__':
    unittest.main(verbosity=2)
