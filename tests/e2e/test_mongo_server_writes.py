#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""Tests for the MongoDB test server (tests/mongo_server.py), through pymongo: the failCommand
fail point, collection validators and $merge.

Run: /usr/bin/python3 tests/e2e/test_mongo_server_writes.py

With BUCKETD_TEST_MONGODB_URI set, the same checks run against that MongoDB
instead (in a database of their own, dropped afterwards).
"""

import datetime
import os
import sys
import unittest
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mongo_fixture import unique_db_name  # noqa: E402
from mongo_server_cases import (HOUR, use_database, bucket_op, reading,  # noqa: E402
                                summary_pipeline, field_summary, summary_page, expected_summary)

import pymongo  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from bson.objectid import ObjectId  # noqa: E402
from pymongo import InsertOne, UpdateOne  # noqa: E402
from pymongo.errors import (BulkWriteError, ConnectionFailure, NetworkTimeout,  # noqa: E402
                            OperationFailure, PyMongoError, WriteConcernError, WriteError)


server = client = db = None  # set by setUpModule
use_database(globals())


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


if __name__ == '__main__':
    unittest.main(verbosity=2)
