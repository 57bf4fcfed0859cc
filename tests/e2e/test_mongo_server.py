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
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mongo_fixture import external_uri, start_mongo, unique_db_name  # noqa: E402

import pymongo  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from pymongo import InsertOne, UpdateOne  # noqa: E402
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure  # noqa: E402

EXTERNAL = external_uri() is not None
HOUR = datetime.timedelta(hours=1)
MS = datetime.timedelta(milliseconds=1)

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


@unittest.skipIf(EXTERNAL, 'server process tests need the test server')
class ServerProcessTest(unittest.TestCase):

    def test_sigterm_exits_zero(self):
        mongo = start_mongo(use_external=False)
        with pymongo.MongoClient(mongo.uri, serverSelectionTimeoutMS=10000) as c:
            c.t.c.insert_one({'_id': 1})
            self.assertEqual(c.t.c.find_one(), {'_id': 1})
            started = time.monotonic()
            self.assertEqual(mongo.stop(), 0)
        self.assertLess(time.monotonic() - started, 3.0)

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
