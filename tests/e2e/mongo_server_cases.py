# -*- coding: utf-8 -*-
"""What the tests of the MongoDB test server (test_mongo_server*.py) share: the limits they
check, the database each test module works in, and the documents bucketd writes (bucket page
updates, the summary aggregate and what it should produce).
"""

import datetime

import pymongo
from bson.int64 import Int64
from pymongo import UpdateOne

from mongo_fixture import external_uri, start_mongo, unique_db_name


EXTERNAL = external_uri() is not None
HOUR = datetime.timedelta(hours=1)
MS = datetime.timedelta(milliseconds=1)
SECOND = datetime.timedelta(seconds=1)
EPOCH = datetime.datetime(1970, 1, 1)

MAX_BSON = 16 * 1024 * 1024              # BSONObjMaxUserSize: the largest stored document
MAX_INTERNAL_BSON = MAX_BSON + 16 * 1024  # BSONObjMaxInternalSize: the largest on the wire
MAX_MESSAGE = 48000000                    # maxMessageSizeBytes
MIB = 1024 * 1024


def use_database(module):
    """Give the test module (its globals()) a setUpModule that starts the test server, or
    connects to BUCKETD_TEST_MONGODB_URI, into its globals server, client and db (a database of
    its own), and a tearDownModule that drops that database and stops what it started."""

    def set_up():
        module['server'] = start_mongo()
        module['client'] = pymongo.MongoClient(module['server'].uri,
                                               serverSelectionTimeoutMS=10000)
        module['db'] = module['client'][unique_db_name('bucketd_mongo_server')]

    def tear_down():
        try:
            if module['client'] is not None:
                module['client'].drop_database(module['db'].name)
                module['client'].close()
        finally:
            if module['server'] is not None:
                module['server'].stop()

    module.update(server=None, client=None, db=None, setUpModule=set_up,
                  tearDownModule=tear_down)


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
