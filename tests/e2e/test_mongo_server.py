#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Tests for the MongoDB test server (tests/mongo_server.py), through pymongo.

Run: /usr/bin/python3 tests/e2e/test_mongo_server.py

With BUCKETD_TEST_MONGODB_URI set, the same checks run against that MongoDB
instead (in a database of their own, dropped afterwards); only the tests of
the server process itself are skipped.
"""

import datetime
import os
import socket
import struct
import sys
import unittest
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mongo_fixture import external_uri, start_mongo, unique_db_name  # noqa: E402

import bson  # noqa: E402
import pymongo  # noqa: E402
from bson.binary import Binary  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from bson.objectid import ObjectId  # noqa: E402
from pymongo import InsertOne, UpdateOne, uri_parser  # noqa: E402
from pymongo.errors import (BulkWriteError, ConnectionFailure, DuplicateKeyError,  # noqa: E402
                            NetworkTimeout, OperationFailure, PyMongoError, WriteConcernError,
                            WriteError)

EXTERNAL = external_uri() is not None
HOUR = datetime.timedelta(hours=1)
MS = datetime.timedelta(milliseconds=1)
SECOND = datetime.timedelta(seconds=1)
EPOCH = datetime.datetime(1970, 1, 1)

MAX_BSON = 16 * 1024 * 1024              # BSONObjMaxUserSize: the largest stored document
MAX_INTERNAL_BSON = MAX_BSON + 16 * 1024  # BSONObjMaxInternalSize: the largest on the wire
MAX_MESSAGE = 48000000                    # maxMessageSizeBytes
MIB = 1024 * 1024

server = None
client = None
db = None


def setUpModule():
    global server, client, db
    server = start_mongo()
    client = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=10000)
    db = client[unique_db_name('bucketd_mongo_server')]


def tearDownModule():
    global server, client
    try:
        if client is not None:
            client.drop_database(db.name)
            client.close()
    finally:
        if server is not None:
            server.stop()


def bucket_update(sensor_id, meta, bucket_start, page, readings, field, writer=None, seq=None):
    """The update bucketd sends for one bucket page (see DESIGN.md section 3)."""
    values = [r[field] for r in readings]
    first_ts = readings[0]['ts']
    appended = {'$concatArrays': [{'$ifNull': ['$readings', []]}, {'$literal': readings}]}
    path = 'summary.%s.' % field
    stage = {
        'sensor_id': {'$literal': sensor_id},
        'meta': {'$literal': meta},
        'bucket_start': {'$literal': bucket_start},
        'bucket_end': {'$literal': bucket_start + HOUR - MS},
        'page': {'$literal': page},
        'count': {'$add': [{'$ifNull': ['$count', Int64(0)]}, Int64(len(readings))]},
        'readings': {'$cond': [
            {'$gte': [first_ts, {'$arrayElemAt': ['$readings.ts', -1]}]},
            appended,
            {'$sortArray': {'input': appended, 'sortBy': {'ts': 1}}}]},
        path + 'min': {'$min': ['$' + path + 'min', {'$literal': min(values)}]},
        path + 'max': {'$max': ['$' + path + 'max', {'$literal': max(values)}]},
        path + 'sum': {'$add': [{'$ifNull': ['$' + path + 'sum', 0.0]}, sum(values)]},
        path + 'count': {'$add': [{'$ifNull': ['$' + path + 'count', Int64(0)]},
                                  Int64(len(values))]},
    }
    if writer is not None:
        stage['w.' + writer] = {'$literal': Int64(seq)}
    pipeline = [{'$set': stage},
                {'$set': {path + 'avg': {'$divide': ['$' + path + 'sum', '$' + path + 'count']}}}]
    doc_id = '%s|%d|%d' % (sensor_id, int((bucket_start - datetime.datetime(1970, 1, 1))
                                          .total_seconds()), page)
    flt = {'_id': doc_id}
    if writer is not None:
        flt['w.' + writer] = {'$not': {'$gte': Int64(seq)}}
    return doc_id, flt, pipeline


def bucket_op(*args, **kwargs):
    doc_id, flt, pipeline = bucket_update(*args, **kwargs)
    return doc_id, UpdateOne(flt, pipeline, upsert=True)


def reading(start, seconds, temp, n):
    return {'ts': start + datetime.timedelta(seconds=seconds), 'temp': temp, 'n': Int64(n),
            'on': True}


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


# ---------------------------------------------------------------------------------------------
# Fail points (configureFailPoint failCommand)
# ---------------------------------------------------------------------------------------------

class FailPointTest(unittest.TestCase):
    """failCommand as mongod implements it for tests (src/mongo/db/commands.cpp
    evaluateFailCommandFailPoint, src/mongo/util/fail_point.cpp).  A real mongod needs
    --setParameter enableTestCommands=1.  Every fail point here names an appName of its own,
    so nothing else talking to the same server is failed, and is switched off afterwards."""

    def setUp(self):
        self.app = 'bd-fp-%s' % uuid.uuid4().hex[:12]
        self.clients = []
        self.fp_client = self.connect()
        self.coll = self.fp_client[db.name]['fp_%s' % self._testMethodName]
        self.truth = db['fp_%s' % self._testMethodName]
        self.truth.drop()

    def tearDown(self):
        client.admin.command('configureFailPoint', 'failCommand', mode='off')
        for c in self.clients:
            c.close()

    def connect(self, **kw):
        opts = dict(appname=self.app, retryWrites=False, retryReads=False,
                    serverSelectionTimeoutMS=10000)
        opts.update(kw)
        c = pymongo.MongoClient(server.uri, **opts)
        self.clients.append(c)
        return c

    def fail(self, mode, **data):
        data.setdefault('appName', self.app)
        return client.admin.command('configureFailPoint', 'failCommand', mode=mode, data=data)

    def command_error(self, fn):
        """The server's reply to a command that failed (pymongo raises NotPrimaryError, not
        OperationFailure, for shutdown and not-primary codes)."""
        with self.assertRaises(PyMongoError) as cm:
            fn()
        return getattr(cm.exception, 'details', None) or {}

    def test_error_code_for_n_times_then_off(self):
        self.fail({'times': 2}, failCommands=['insert'], errorCode=91)
        for i in range(2):
            reply = self.command_error(lambda: self.coll.insert_one({'_id': i}))
            self.assertEqual((reply.get('ok'), reply.get('code')), (0.0, 91), reply)
            self.assertEqual(reply.get('codeName'), 'ShutdownInProgress')
            self.assertEqual(reply.get('errmsg'), "Failing command via 'failCommand' failpoint")
            self.assertNotIn('errorLabels', reply)  # not a retryable write: no label
        self.coll.insert_one({'_id': 'third'})
        self.assertEqual([d['_id'] for d in self.truth.find()], ['third'])

    def test_only_the_named_commands_and_app_fail(self):
        self.fail('alwaysOn', failCommands=['insert'], errorCode=2)
        self.assertIsNone(self.coll.find_one())  # find is not named
        other = pymongo.MongoClient(server.uri, appname=self.app + '-other',
                                    serverSelectionTimeoutMS=10000)
        self.clients.append(other)
        other[db.name][self.coll.name].insert_one({'_id': 'other-app'})
        with self.assertRaises(OperationFailure):
            self.coll.insert_one({'_id': 'mine'})
        self.assertEqual([d['_id'] for d in self.truth.find()], ['other-app'])

    def test_skip_then_always(self):
        self.fail({'skip': 1}, failCommands=['find'], errorCode=2)
        self.assertIsNone(self.coll.find_one())
        for _ in range(2):
            with self.assertRaises(OperationFailure) as cm:
                self.coll.find_one()
            self.assertEqual(cm.exception.code, 2)

    def test_count_is_the_times_entered(self):
        before = self.fail({'times': 3}, failCommands=['find'], errorCode=2)['count']
        with self.assertRaises(OperationFailure):
            self.coll.find_one()
        after = client.admin.command('configureFailPoint', 'failCommand', mode='off')['count']
        self.assertEqual(after - before, 1)
        self.assertIsNone(self.coll.find_one())

    def test_write_concern_error_after_the_write_applied(self):
        wce = {'code': 64, 'codeName': 'WriteConcernFailed',
               'errmsg': 'waiting for replication timed out', 'errInfo': {'wtimeout': True}}
        self.fail({'times': 1}, failCommands=['insert', 'update'], writeConcernError=wce)
        with self.assertRaises(WriteConcernError) as cm:
            self.coll.insert_one({'_id': 1, 'v': 1})
        self.assertEqual(cm.exception.code, 64)
        self.assertEqual(self.truth.find_one({'_id': 1}), {'_id': 1, 'v': 1})
        # Used up: the next write gets a plain reply.
        self.coll.update_one({'_id': 1}, {'$set': {'v': 2}})
        self.assertEqual(self.truth.find_one({'_id': 1}), {'_id': 1, 'v': 2})

        # In an unordered bulk, as libmongoc sends bucketd's upserts: applied, and reported.
        self.fail({'times': 1}, failCommands=['update'], writeConcernError=wce)
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([UpdateOne({'_id': 2}, {'$set': {'v': 1}}, upsert=True),
                                  UpdateOne({'_id': 1}, {'$inc': {'v': 1}})], ordered=False)
        details = cm.exception.details
        self.assertEqual(details['writeErrors'], [])
        self.assertEqual([e['code'] for e in details['writeConcernErrors']], [64])
        self.assertEqual((details['nUpserted'], details['nModified']), (1, 1))
        self.assertEqual(self.truth.find_one({'_id': 1})['v'], 3)
        self.assertEqual(self.truth.find_one({'_id': 2})['v'], 1)

        # The raw reply: the write's own result, plus writeConcernError, no error label (the
        # label is for retryable writes, which carry a txnNumber).
        self.fail({'times': 1}, failCommands=['update'], writeConcernError=wce)
        reply = self.fp_client[db.name].command(
            'update', self.coll.name, updates=[{'q': {'_id': 3}, 'u': {'$set': {'v': 3}},
                                                'upsert': True}])
        self.assertEqual(reply['ok'], 1.0)
        self.assertEqual(reply['n'], 1)
        self.assertEqual(reply['writeConcernError']['code'], 64)
        self.assertEqual(reply['writeConcernError']['errInfo'], {'wtimeout': True})
        self.assertNotIn('errorLabels', reply)
        self.assertEqual(self.truth.find_one({'_id': 3})['v'], 3)

    def test_aggregate_with_merge(self):
        # An aggregate is failed like any command; a $merge makes it a write, so a
        # writeConcernError comes after its writes applied.
        self.truth.insert_one({'_id': 1, 'v': 1})
        out = db['%s_out' % self.truth.name]
        out.drop()
        self.addCleanup(out.drop)
        merge = [{'$merge': {'into': out.name}}]
        self.fail({'times': 1}, failCommands=['aggregate'], errorCode=365)
        reply = self.command_error(lambda: self.coll.database.command(
            'aggregate', self.coll.name, pipeline=merge, cursor={}))
        self.assertEqual(reply.get('code'), 365, reply)
        self.assertIsNone(out.find_one())
        wce = {'code': 64, 'codeName': 'WriteConcernFailed',
               'errmsg': 'waiting for replication timed out'}
        self.fail({'times': 1}, failCommands=['aggregate'], writeConcernError=wce)
        reply = self.coll.database.command('aggregate', self.coll.name, pipeline=merge,
                                           cursor={})
        self.assertEqual(reply['writeConcernError']['code'], 64)
        self.assertEqual(out.find_one(), {'_id': 1, 'v': 1})

    def test_error_labels_from_the_data(self):
        self.fail({'times': 1}, failCommands=['update'], errorCode=10107,
                  errorLabels=['RetryableWriteError'])
        reply = self.command_error(
            lambda: self.coll.update_one({'_id': 1}, {'$set': {'v': 1}}, upsert=True))
        self.assertEqual(reply.get('code'), 10107, reply)
        self.assertEqual(reply.get('errorLabels'), ['RetryableWriteError'])
        self.assertIsNone(self.truth.find_one())

    def test_close_connection_without_reply(self):
        self.coll.insert_one({'_id': 1})
        self.fail({'times': 1}, failCommands=['find'], closeConnection=True)
        with self.assertRaises(ConnectionFailure):
            self.coll.find_one({'_id': 1})
        self.assertEqual(self.coll.find_one({'_id': 1}), {'_id': 1})

    def test_block_connection(self):
        # The server holds the command 5 s; the client gives up after 0.3 s.  (No clock is
        # read here: a slow machine only makes the client give up all the more surely.)
        impatient = self.connect(socketTimeoutMS=300)
        impatient.admin.command('ping')
        self.fail({'times': 1}, failCommands=['ping'], blockConnection=True, blockTimeMS=5000)
        with self.assertRaises(NetworkTimeout):
            impatient.admin.command('ping')
        self.assertEqual(self.fp_client.admin.command('ping')['ok'], 1.0)

    def test_bad_configurations(self):
        with self.assertRaises(OperationFailure) as cm:
            db.command('configureFailPoint', 'failCommand', mode='off')
        self.assertEqual(cm.exception.code, 13)
        with self.assertRaises(OperationFailure) as cm:
            client.admin.command('configureFailPoint', 'bucketdNoSuchFailPoint', mode='off')
        self.assertEqual(cm.exception.code, 266)
        with self.assertRaises(OperationFailure) as cm:
            client.admin.command('configureFailPoint', 'failCommand', mode='sometimes')
        self.assertEqual(cm.exception.code, 2)
        with self.assertRaises(OperationFailure) as cm:
            client.admin.command('configureFailPoint', 'failCommand')
        self.assertEqual(cm.exception.code, 20)


# ---------------------------------------------------------------------------------------------
# Collection validators
# ---------------------------------------------------------------------------------------------

class ValidatorTest(unittest.TestCase):
    """validator / validationLevel / validationAction on create and collMod: a write whose
    resulting document fails the validator fails with DocumentValidationFailure (121), alone;
    the rest of an unordered bulk applies."""

    def setUp(self):
        self.name = 'val_%s' % self._testMethodName
        db[self.name].drop()
        self.coll = db[self.name]

    def assertRefused(self, details, indexes):
        errors = details['writeErrors']
        self.assertEqual([(e['index'], e['code']) for e in errors], [(i, 121) for i in indexes])
        for e in errors:
            self.assertEqual(e['errmsg'], 'Document failed validation')
            self.assertIn('failingDocumentId', e.get('errInfo', {}))

    def test_query_validator_refuses_one_update_of_a_bulk(self):
        db.create_collection(self.name, validator={'sensor_id': {'$ne': 'poison'}})
        self.coll.insert_one({'_id': 'good', 'sensor_id': 'good', 'n': 1})
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([
                UpdateOne({'_id': 'a'}, {'$set': {'sensor_id': 'a'}}, upsert=True),
                UpdateOne({'_id': 'p'}, {'$set': {'sensor_id': 'poison'}}, upsert=True),
                UpdateOne({'_id': 'good'}, {'$set': {'sensor_id': 'poison'}}),
                UpdateOne({'_id': 'good'}, {'$inc': {'n': 1}}),
            ], ordered=False)
        self.assertRefused(cm.exception.details, [1, 2])
        self.assertEqual(cm.exception.details['writeErrors'][0]['errInfo']['failingDocumentId'],
                         'p')
        self.assertEqual(sorted(d['_id'] for d in self.coll.find()), ['a', 'good'])
        self.assertEqual(self.coll.find_one({'_id': 'good'}),
                         {'_id': 'good', 'sensor_id': 'good', 'n': 2})
        with self.assertRaises(WriteError) as cm:
            self.coll.insert_one({'_id': 'q', 'sensor_id': 'poison'})
        self.assertEqual(cm.exception.code, 121)

    def test_pipeline_upsert_of_a_bucket_is_validated(self):
        db.create_collection(self.name, validator={'sensor_id': {'$ne': 'poison'}})
        start = datetime.datetime(2025, 1, 15, 14, 0, 0)
        meta = {'measurement': 'm', 'tags': {}}
        _, ok = bucket_op('fine', meta, start, 0, [reading(start, 1, 1.0, 1)], 'temp')
        _, bad = bucket_op('poison', meta, start, 0, [reading(start, 1, 1.0, 2)], 'temp')
        with self.assertRaises(BulkWriteError) as cm:
            self.coll.bulk_write([bad, ok], ordered=False)
        self.assertRefused(cm.exception.details, [0])
        self.assertEqual([d['sensor_id'] for d in self.coll.find()], ['fine'])

    def test_collmod_levels_and_actions(self):
        self.coll.insert_many([{'_id': 'valid', 'v': 1}, {'_id': 'invalid', 'v': -1}])
        db.command('collMod', self.name, validator={'v': {'$gte': 0}})
        options = db[self.name].options()
        self.assertEqual(options.get('validator'), {'v': {'$gte': 0}})
        # strict (the default): an update of an already invalid document is checked too.
        with self.assertRaises(WriteError) as cm:
            self.coll.update_one({'_id': 'invalid'}, {'$set': {'w': 1}})
        self.assertEqual(cm.exception.code, 121)
        # moderate: updates of documents that were invalid already are not checked.
        db.command('collMod', self.name, validationLevel='moderate')
        self.coll.update_one({'_id': 'invalid'}, {'$set': {'w': 1}})
        with self.assertRaises(WriteError):
            self.coll.update_one({'_id': 'valid'}, {'$set': {'v': -5}})
        with self.assertRaises(WriteError):
            self.coll.insert_one({'_id': 'new', 'v': -2})
        # warn: written anyway.
        db.command('collMod', self.name, validationAction='warn')
        self.coll.update_one({'_id': 'valid'}, {'$set': {'v': -5}})
        # off: nothing checked.
        db.command('collMod', self.name, validationLevel='off', validationAction='error')
        self.coll.insert_one({'_id': 'new', 'v': -2})
        self.assertEqual({d['_id']: d['v'] for d in self.coll.find()},
                         {'valid': -5, 'invalid': -1, 'new': -2})
        with self.assertRaises(OperationFailure):
            db.command('collMod', self.name, validationLevel='sometimes')
        with self.assertRaises(OperationFailure) as cm:
            db.command('collMod', 'val_no_such_collection', validator={'v': 1})
        self.assertEqual(cm.exception.code, 26)

    def test_bypass_document_validation(self):
        db.create_collection(self.name, validator={'v': {'$gte': 0}})
        self.coll.bulk_write([InsertOne({'_id': 1, 'v': -1}),
                              UpdateOne({'_id': 2}, {'$set': {'v': -2}}, upsert=True)],
                             bypass_document_validation=True)
        self.assertEqual(self.coll.count_documents({}), 2)

    def test_json_schema(self):
        db.create_collection(self.name, validator={'$jsonSchema': {
            'bsonType': 'object', 'required': ['sensor_id', 'count'],
            'properties': {'sensor_id': {'bsonType': 'string', 'minLength': 1},
                           'count': {'bsonType': 'long', 'minimum': 0},
                           'readings': {'bsonType': 'array', 'maxItems': 2}}}})
        self.coll.insert_one({'_id': 1, 'sensor_id': 's', 'count': Int64(0)})
        for bad in ({'_id': 2, 'count': Int64(0)},                       # required
                    {'_id': 3, 'sensor_id': 's', 'count': 0},            # int32, not long
                    {'_id': 4, 'sensor_id': '', 'count': Int64(0)},      # minLength
                    {'_id': 5, 'sensor_id': 's', 'count': Int64(-1)},    # minimum
                    {'_id': 6, 'sensor_id': 's', 'count': Int64(1), 'readings': [1, 2, 3]}):
            with self.assertRaises(WriteError) as cm:
                self.coll.insert_one(bad)
            self.assertEqual(cm.exception.code, 121, bad)
        self.assertEqual([d['_id'] for d in self.coll.find()], [1])


# ---------------------------------------------------------------------------------------------
# $merge: the per-bucket summary the daemon maintains from its pages
# ---------------------------------------------------------------------------------------------

def summary_pipeline(buckets, into):
    """The aggregate bucketd runs on the page collection to (re)write the summary documents of
    some buckets: [(sensor_id, bucket_start)], merged into the collection into."""
    return [
        {'$match': {'$or': [{'sensor_id': s, 'bucket_start': t} for s, t in buckets]}},
        {'$project': {'_id': 0, 'sensor_id': 1, 'meta': 1, 'bucket_start': 1, 'bucket_end': 1,
                      'f': {'$concatArrays': [
                          [{'k': None, 'c': '$count', 'p': {'$literal': 1}}],
                          {'$objectToArray': {'$ifNull': ['$summary', {}]}}]}}},
        {'$unwind': '$f'},
        {'$group': {'_id': {'s': '$sensor_id', 't': '$bucket_start', 'k': '$f.k'},
                    'meta': {'$first': '$meta'}, 'end': {'$first': '$bucket_end'},
                    'min': {'$min': '$f.v.min'}, 'max': {'$max': '$f.v.max'},
                    'sum': {'$sum': '$f.v.sum'}, 'n': {'$sum': '$f.v.count'},
                    'count': {'$sum': '$f.c'}, 'pages': {'$sum': '$f.p'}}},
        {'$group': {'_id': {'s': '$_id.s', 't': '$_id.t'},
                    'meta': {'$first': '$meta'}, 'end': {'$first': '$end'},
                    'count': {'$sum': '$count'}, 'pages': {'$sum': '$pages'},
                    'fields': {'$push': {'k': '$_id.k', 'v': {
                        'min': '$min', 'max': '$max', 'sum': '$sum', 'count': '$n',
                        'avg': {'$cond': [{'$gt': ['$n', 0]},
                                          {'$divide': ['$sum', '$n']}, None]}}}}}},
        {'$project': {'_id': 0, 'sensor_id': '$_id.s', 'bucket_start': '$_id.t',
                      'bucket_end': '$end', 'meta': 1, 'pages': 1, 'count': 1,
                      'summary': {'$arrayToObject': {'$filter': {
                          'input': '$fields', 'as': 'x', 'cond': {'$ne': ['$$x.k', None]}}}}}},
        {'$merge': {'into': into, 'on': ['sensor_id', 'bucket_start'],
                    'whenMatched': 'replace', 'whenNotMatched': 'insert'}},
    ]


def field_summary(values):
    """A page's summary entry for one field, as bucketd writes it (int64 values: an int64
    sum)."""
    total = sum(values)
    if all(type(v) is Int64 for v in values):
        total = Int64(total)
    return {'min': min(values), 'max': max(values), 'sum': total,
            'count': Int64(len(values)), 'avg': total / len(values)}


def summary_page(sensor_id, start, page, count, summary=None):
    """A page document of a bucket (summary None: the page has no summary field)."""
    doc = {'_id': '%s|%d|%d' % (sensor_id, (start - EPOCH) // SECOND, page),
           'sensor_id': sensor_id, 'meta': {'measurement': 'weather', 'tags': {'site': 'roof'}},
           'bucket_start': start, 'bucket_end': start + HOUR - MS, 'page': page,
           'count': Int64(count), 'readings': [], 'w': {'gw1': Int64(page + 1)}}
    if summary is not None:
        doc['summary'] = summary
    return doc


def expected_summary(pages):
    """What the summary pipeline must give for the pages of one bucket, computed here: counts
    and page numbers added up, per field the smallest min, the largest max, the sums and the
    counts added up (types kept: doubles stay doubles, int64s int64s) and their quotient."""
    first = pages[0]
    fields = {}
    for p in pages:
        for name, s in (p.get('summary') or {}).items():
            fields.setdefault(name, []).append(s)
    summary = {}
    for name, entries in fields.items():
        total = entries[0]['sum']
        for e in entries[1:]:
            total += e['sum']
        n = Int64(sum(e['count'] for e in entries))
        summary[name] = {'min': min(e['min'] for e in entries),
                         'max': max(e['max'] for e in entries),
                         'sum': Int64(total) if isinstance(total, int) else total,
                         'count': n, 'avg': float(total) / n}
    return {'sensor_id': first['sensor_id'], 'bucket_start': first['bucket_start'],
            'bucket_end': first['bucket_end'], 'meta': first['meta'],
            'count': Int64(sum(p['count'] for p in pages)), 'pages': len(pages),
            'summary': summary}


def server_version():
    return tuple(client.admin.command('buildInfo')['versionArray'][:2])


class MergeStageTest(unittest.TestCase):
    """$merge (src/mongo/db/pipeline/document_source_merge.cpp, merge_processor.cpp and
    process_interface/common_mongod_process_interface.cpp of the server; the manual's $merge
    page): the summary aggregate bucketd runs, and each rule a real server enforces on it."""

    T = datetime.datetime(2025, 1, 15, 14, 0, 0)

    def setUp(self):
        self.pages = db['merge_pages_%s' % self._testMethodName]
        self.out = db['merge_summary_%s' % self._testMethodName]
        for c in (self.pages, self.out):
            c.drop()

    def unique_index(self, coll, keys, **options):
        spec = {'key': dict(keys), 'name': '_'.join('%s_%s' % kv for kv in keys),
                'unique': True}
        spec.update(options)
        db.command('createIndexes', coll.name, indexes=[spec])

    def aggregate(self, pipeline, coll=None, **kw):
        return db.command('aggregate', (coll or self.pages).name, pipeline=pipeline,
                          cursor={}, **kw)

    def merge_error(self, stage, pipeline=(), coll=None):
        """The code of the aggregate [*pipeline, stage] failing."""
        with self.assertRaises(OperationFailure, msg=repr(stage)) as cm:
            self.aggregate(list(pipeline) + [stage], coll)
        return cm.exception.code

    def fixture(self):
        t, t2 = self.T, self.T + HOUR
        temp = field_summary
        return {
            ('s1', t): [
                summary_page('s1', t, 0, 3, {'temp': temp([19.0, 23.5, 17.5]),
                                             'hum': temp([Int64(35), Int64(48), Int64(37)])}),
                summary_page('s1', t, 1, 2, {'temp': temp([18.0, 22.0])}),
                summary_page('s1', t, 2, 4)],                  # booleans only: no summary
            ('s1', t2): [summary_page('s1', t2, 0, 1, {})],     # booleans only: {}
            ('s2', t): [summary_page('s2', t, 0, 5, {'temp': temp([1.5, 2.5])})],
        }

    def summaries(self):
        return {(d['sensor_id'], d['bucket_start']): d for d in self.out.find()}

    def check_summary(self, doc, pages):
        self.assertEqual({k: v for k, v in doc.items() if k != '_id'}, expected_summary(pages))
        self.assertIs(type(doc['count']), Int64)
        self.assertIs(type(doc['pages']), int)
        for entry in doc['summary'].values():
            self.assertIs(type(entry['count']), Int64)
            self.assertIs(type(entry['avg']), float)
        if 'temp' in doc['summary']:
            self.assertEqual({type(v) for k, v in doc['summary']['temp'].items()
                              if k != 'count'}, {float})
        if 'hum' in doc['summary']:
            self.assertEqual([type(doc['summary']['hum'][k]) for k in ('min', 'max', 'sum')],
                             [Int64] * 3)

    def test_summary_pipeline(self):
        buckets = self.fixture()
        for pages in buckets.values():
            self.pages.insert_many(pages)
        self.unique_index(self.out, [('sensor_id', 1), ('bucket_start', 1)])
        wanted = [('s1', self.T), ('s1', self.T + HOUR)]
        reply = self.aggregate(summary_pipeline(wanted, self.out.name),
                               writeConcern={'w': 'majority'})
        self.assertEqual(reply['cursor']['firstBatch'], [])
        self.assertEqual(reply['cursor']['id'], 0)
        got = self.summaries()
        self.assertEqual(set(got), set(wanted))          # s2 was not asked for
        for key in wanted:
            self.check_summary(got[key], buckets[key])
            # Not in the results: an insert by the 'on' fields generates an ObjectId.
            self.assertIsInstance(got[key]['_id'], ObjectId)
        self.assertEqual(got[('s1', self.T + HOUR)]['summary'], {})

        # A page more (a new field too): the summary is replaced, its _id kept.
        late = summary_page('s1', self.T, 3, 2, {'temp': field_summary([30.5, 16.0]),
                                                  'pres': field_summary([1013.25, 1012.75])})
        self.pages.insert_one(late)
        buckets[('s1', self.T)].append(late)
        self.aggregate(summary_pipeline(wanted, self.out.name), writeConcern={'w': 'majority'})
        again = self.summaries()
        self.assertEqual(self.out.count_documents({}), 2)
        for key in wanted:
            self.assertEqual(again[key]['_id'], got[key]['_id'])
            self.check_summary(again[key], buckets[key])
        self.assertEqual(again[('s1', self.T)]['summary']['temp']['min'], 16.0)
        self.assertEqual(again[('s1', self.T)]['pages'], 4)

    def test_stages_of_the_pipeline(self):
        # The pieces the summary relies on, one by one.
        self.pages.insert_many([
            {'_id': 1, 'g': 'a', 'v': 1, 'l': Int64(10), 'd': 0.5, 'o': {'x': 1, 'y': 'z'},
             'arr': [1, 2]},
            {'_id': 2, 'g': 'a', 'v': Int64(2), 'l': Int64(20), 'd': 1.5, 'arr': []},
            {'_id': 3, 'g': 'b', 'v': 'text', 'arr': None},
            {'_id': 4, 'arr': 'scalar', 'd': 2.0}])
        out = list(self.pages.aggregate([
            {'$sort': {'_id': 1}},
            {'$group': {'_id': {'g': '$g', 'k': None},
                        'first': {'$first': '$o'}, 'last': {'$last': '$o'},
                        'min': {'$min': '$v'}, 'max': {'$max': '$v'},
                        'sum': {'$sum': '$v'}, 'longs': {'$sum': '$l'},
                        'dbl': {'$sum': '$d'}, 'n': {'$sum': 1}, 'none': {'$sum': '$nothing'},
                        'push': {'$push': '$o.y'}}},
            {'$sort': {'_id.g': 1}}]))
        self.assertEqual([d['_id'] for d in out],
                         [{'k': None}, {'g': 'a', 'k': None}, {'g': 'b', 'k': None}])
        nog, a, b = out
        # $first/$last take the first/last document's value, missing as null.
        self.assertEqual((a['first'], a['last']), ({'x': 1, 'y': 'z'}, None))
        self.assertEqual((a['min'], a['max']), (1, 2))
        self.assertIs(type(a['max']), Int64)            # $max keeps the type
        self.assertEqual((b['min'], b['max']), ('text', 'text'))
        self.assertEqual((a['sum'], a['longs'], a['dbl'], a['n']), (3, 30, 2.0, 2))
        self.assertEqual([type(a[k]) for k in ('sum', 'longs', 'dbl', 'n')],
                         [Int64, Int64, float, int])
        self.assertEqual((b['sum'], b['none'], nog['dbl']), (0, 0, 2.0))
        self.assertIs(type(b['sum']), int)
        self.assertEqual((a['push'], b['push']), (['z'], []))   # $push skips missing

        unwound = list(self.pages.aggregate([{'$unwind': '$arr'}, {'$sort': {'_id': 1, 'arr': 1}},
                                             {'$project': {'arr': 1}}]))
        self.assertEqual(unwound, [{'_id': 1, 'arr': 1}, {'_id': 1, 'arr': 2},
                                   {'_id': 4, 'arr': 'scalar'}])
        doc = list(self.pages.aggregate([{'$match': {'_id': 1}}, {'$project': {
            '_id': 0,
            'pairs': {'$objectToArray': '$o'},
            'none': {'$objectToArray': {'$ifNull': ['$missing', {}]}},
            'null': {'$objectToArray': '$missing'},
            'back': {'$arrayToObject': {'$objectToArray': '$o'}},
            'kept': {'$arrayToObject': [[['a', 1], ['b', 2], ['a', 3]]]},
            'cat': {'$concatArrays': [[{'k': None, 'c': '$l', 'm': '$missing',
                                        'p': {'$literal': 1}}], '$arr']},
            'odd': {'$filter': {'input': '$arr', 'as': 'x', 'cond': {'$ne': ['$$x', 2]}}},
            'half': {'$cond': [{'$gt': ['$l', 0]}, {'$divide': ['$l', 4]}, None]},
            'o': 1}}]))[0]
        self.assertEqual(list(doc), ['o', 'pairs', 'none', 'null', 'back', 'kept', 'cat',
                                     'odd', 'half'])
        self.assertEqual(doc['pairs'], [{'k': 'x', 'v': 1}, {'k': 'y', 'v': 'z'}])
        self.assertEqual((doc['none'], doc['null']), ([], None))
        self.assertEqual(doc['back'], {'x': 1, 'y': 'z'})
        self.assertEqual(doc['kept'], {'a': 3, 'b': 2})        # the last value of a key
        self.assertEqual(doc['cat'], [{'k': None, 'c': 10, 'p': 1}, 1, 2])
        self.assertIs(type(doc['cat'][0]['c']), Int64)
        self.assertEqual(doc['odd'], [1])
        self.assertEqual(doc['half'], 2.5)
        for bad, code in (([{'k': 1, 'v': 2}], 40394), ([['a']], 40397), ('str', 40386),
                          ([{'k': 'a', 'v': 1}, ['b', 2]], 40391)):
            with self.assertRaises(OperationFailure, msg=repr(bad)) as cm:
                list(self.pages.aggregate([{'$project': {
                    'x': {'$arrayToObject': {'$literal': bad}}}}]))
            self.assertEqual(cm.exception.code, code, bad)
        with self.assertRaises(OperationFailure) as cm:
            list(self.pages.aggregate([{'$project': {'x': {'$objectToArray': '$v'}}}]))
        self.assertEqual(cm.exception.code, 40390)

    def test_on_fields_need_a_unique_index(self):
        self.pages.insert_many([{'_id': i, 'a': i, 'b': -i} for i in range(3)])
        stage = {'$merge': {'into': self.out.name, 'on': ['a', 'b']}}
        # No collection yet: only "_id" can do without an index.
        self.assertEqual(self.merge_error(stage), 51183)
        db.create_collection(self.out.name)
        self.assertEqual(self.merge_error(stage), 51183)
        self.out.create_index([('a', 1), ('b', 1)])                     # not unique
        self.assertEqual(self.merge_error(stage), 51183)
        self.unique_index(self.out, [('a', 1), ('b', 1), ('c', 1)])     # more fields
        self.unique_index(self.out, [('a', 1)])                         # fewer
        self.unique_index(self.out, [('b', 1), ('a', 1)], name='partial',
                          partialFilterExpression={'a': {'$gte': 0}})
        self.assertEqual(self.merge_error(stage), 51183)
        self.unique_index(self.out, [('b', -1), ('a', 1)])              # any order, direction
        self.aggregate([stage])
        self.assertEqual(self.out.count_documents({}), 3)
        # A sparse one counts too.
        sparse = {'$merge': {'into': self.out.name, 'on': 'b', 'whenMatched': 'replace'}}
        self.assertEqual(self.merge_error(sparse), 51183)
        self.unique_index(self.out, [('b', 1)], sparse=True)
        self.aggregate([sparse])
        # "_id" (the default) needs nothing, and creates the collection.
        other = db['%s_id' % self.out.name]
        other.drop()
        self.addCleanup(other.drop)
        self.aggregate([{'$merge': {'into': other.name, 'on': '_id'}}])
        self.aggregate([{'$merge': other.name}])
        self.assertEqual(sorted(d['_id'] for d in other.find()), [0, 1, 2])

    def test_stage_specification_errors(self):
        self.pages.insert_one({'_id': 1, 'a': 1})
        into = self.out.name
        cases = [
            ({'$merge': {'into': into, 'bogus': 1}}, 40415),
            ({'$merge': {'on': '_id'}}, 40414),
            ({'$merge': 5}, 14),
            ({'$merge': {'into': 5}}, 51178),
            ({'$merge': {'into': {'db': db.name}}}, 5786801),
            ({'$merge': {'into': into, 'on': 3.5}}, 51186),
            ({'$merge': {'into': into, 'on': []}}, 51187),
            ({'$merge': {'into': into, 'on': ['a', 1]}}, 51134),
            ({'$merge': {'into': into, 'on': ['_id', '_id']}}, 31465),
            ({'$merge': {'into': into, 'whenMatched': 'overwrite'}}, 2),
            ({'$merge': {'into': into, 'whenMatched': 1}}, 51191),
            ({'$merge': {'into': into, 'whenNotMatched': 'upsert'}}, 2),
            ({'$merge': {'into': into, 'whenMatched': 'keepExisting',
                         'whenNotMatched': 'discard'}}, 51181),
            ({'$merge': {'into': into, 'whenMatched': 'fail', 'whenNotMatched': 'fail'}}, 51181),
            ({'$merge': {'into': into, 'whenMatched': 'replace', 'let': {'x': 1}}}, 51199),
            ({'$merge': {'into': 'system.views'}}, 31319),
        ]
        for stage, code in cases:
            self.assertEqual(self.merge_error(stage), code, stage)
        # Only as the last stage.
        with self.assertRaises(OperationFailure) as cm:
            self.aggregate([{'$merge': {'into': into}}, {'$match': {}}])
        self.assertEqual(cm.exception.code, 40601)
        self.assertNotIn(into, db.list_collection_names())

    def test_on_field_values(self):
        self.unique_index(self.out, [('k', 1)])
        stage = {'$merge': {'into': self.out.name, 'on': 'k'}}
        self.pages.insert_one({'_id': 1, 'k': [1, 2]})
        self.assertEqual(self.merge_error(stage), 51185)
        self.pages.delete_many({})
        self.unique_index(self.out, [('a.b', 1)])
        self.pages.insert_one({'_id': 1, 'a': {'b': ['x']}})
        self.assertEqual(self.merge_error({'$merge': {'into': self.out.name, 'on': 'a.b'}}),
                         51185)
        # Missing, null (MongoDB 8.1 merges these as null when the index is not sparse).
        if server_version() < (8, 1):
            for doc in ({'_id': 2}, {'_id': 3, 'k': None}):
                self.pages.delete_many({})
                self.pages.insert_one(doc)
                self.assertEqual(self.merge_error(stage), 51132, doc)
        self.assertEqual(self.out.count_documents({}), 0)

    def test_id_rules(self):
        self.unique_index(self.out, [('k', 1)])
        self.out.insert_one({'_id': 'kept', 'k': 1, 'old': True})
        self.pages.insert_many([{'_id': 10, 'k': 1, 'new': True}, {'_id': 11, 'k': 2}])
        replace = {'$merge': {'into': self.out.name, 'on': 'k', 'whenMatched': 'replace'}}
        # A result _id other than the matched document's: _id is immutable.
        self.assertEqual(self.merge_error(replace), 66)
        self.assertEqual(self.out.find_one({'k': 1}), {'_id': 'kept', 'k': 1, 'old': True})
        # Without _id in the results: the matched document keeps its own, an insert gets one.
        self.out.delete_many({'k': 2})
        self.aggregate([{'$project': {'_id': 0}}, replace])
        self.assertEqual(self.out.find_one({'k': 1}), {'_id': 'kept', 'k': 1, 'new': True})
        self.assertIsInstance(self.out.find_one({'k': 2})['_id'], ObjectId)
        # The same _id is no change of it.
        self.out.delete_many({})
        self.out.insert_one({'_id': 10, 'k': 1})
        self.aggregate([{'$match': {'_id': 10}}, replace])
        self.assertEqual(list(self.out.find()), [{'_id': 10, 'k': 1, 'new': True}])
        # On "_id", a result without one gets a new ObjectId: never a match.
        self.out.drop()
        for _ in range(2):
            self.aggregate([{'$project': {'_id': 0}}, {'$merge': {'into': self.out.name}}])
        self.assertEqual(self.out.count_documents({}), 4)

    def test_modes(self):
        self.pages.insert_many([{'_id': 1, 'a': 'new', 'b': 'new'}, {'_id': 2, 'a': 'new'}])

        def reset():
            self.out.delete_many({})
            self.out.insert_one({'_id': 1, 'a': 'old', 'c': 'old'})

        def run(matched, not_matched='insert'):
            reset()
            return self.aggregate([{'$merge': {'into': self.out.name, 'whenMatched': matched,
                                               'whenNotMatched': not_matched}}])

        def stored():
            return sorted(self.out.find(), key=lambda d: d['_id'])

        run('merge')
        self.assertEqual(stored(), [{'_id': 1, 'a': 'new', 'c': 'old', 'b': 'new'},
                                    {'_id': 2, 'a': 'new'}])
        run('replace')
        self.assertEqual(stored(), [{'_id': 1, 'a': 'new', 'b': 'new'}, {'_id': 2, 'a': 'new'}])
        run('keepExisting')
        self.assertEqual(stored(), [{'_id': 1, 'a': 'old', 'c': 'old'}, {'_id': 2, 'a': 'new'}])
        run('replace', 'discard')
        self.assertEqual(stored(), [{'_id': 1, 'a': 'new', 'b': 'new'}])
        run('merge', 'discard')
        self.assertEqual(stored(), [{'_id': 1, 'a': 'new', 'c': 'old', 'b': 'new'}])
        with self.assertRaises(OperationFailure) as cm:
            run('fail')
        self.assertEqual(cm.exception.code, 11000)
        self.assertEqual(self.out.find_one({'_id': 1}), {'_id': 1, 'a': 'old', 'c': 'old'})
        for matched in ('replace', 'merge'):
            with self.assertRaises(OperationFailure) as cm:
                run(matched, 'fail')
            self.assertEqual(cm.exception.code, 13113)      # MergeStageNoMatchingDocument
            self.assertIsNone(self.out.find_one({'_id': 2}))
        # No match at all: "fail" is fine.
        self.out.delete_many({})
        self.aggregate([{'$merge': {'into': self.out.name, 'whenMatched': 'fail'}}])
        self.assertEqual(self.out.count_documents({}), 2)

    def test_targets(self):
        self.pages.insert_many([{'_id': 1, 'v': 1}, {'_id': 2, 'v': 2}])
        # Another database.
        other = client[unique_db_name('bucketd_merge')]
        self.addCleanup(client.drop_database, other.name)
        self.aggregate([{'$merge': {'into': {'db': other.name, 'coll': 'out'}}}])
        self.assertEqual(sorted(d['_id'] for d in other.out.find()), [1, 2])
        # The collection being aggregated (MongoDB 4.4 and later).
        self.aggregate([{'$project': {'seen': {'$literal': True}}},
                        {'$merge': {'into': self.pages.name, 'whenMatched': 'merge'}}])
        self.assertEqual(list(self.pages.find().sort('_id', 1)),
                         [{'_id': 1, 'v': 1, 'seen': True}, {'_id': 2, 'v': 2, 'seen': True}])

    def test_writes_are_checked(self):
        self.pages.insert_many([{'_id': 1, 'u': 'x'}, {'_id': 2, 'u': 'x'}])
        # Other unique indexes of the output collection.
        self.unique_index(self.out, [('u', 1)])
        with self.assertRaises(OperationFailure) as cm:
            self.aggregate([{'$merge': {'into': self.out.name}}])
        self.assertEqual(cm.exception.code, 11000)
        self.assertEqual(self.out.count_documents({}), 1)
        # Its validator.
        checked = db['%s_checked' % self.out.name]
        checked.drop()
        self.addCleanup(checked.drop)
        db.create_collection(checked.name, validator={'u': {'$type': 'int'}})
        with self.assertRaises(OperationFailure) as cm:
            self.aggregate([{'$merge': {'into': checked.name}}])
        self.assertEqual(cm.exception.code, 121)
        self.assertEqual(checked.count_documents({}), 0)
        self.aggregate([{'$merge': {'into': checked.name}}], bypassDocumentValidation=True)
        self.assertEqual(checked.count_documents({}), 2)


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
