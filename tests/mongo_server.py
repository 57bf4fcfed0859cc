#!/usr/bin/python3
# -*- coding: utf-8 -*-
"""In-memory MongoDB stand-in for bucketd's tests.

    /usr/bin/python3 tests/mongo_server.py [--port N] [--verbose] [--sharded KEYSPEC]
        [--unstable-sortarray] [--fail-command JSON] [--max-write-batch N]

Binds 127.0.0.1 (a free port unless --port is given), prints the port number
alone on one line to stdout once it accepts connections, and serves until
SIGTERM or SIGINT, then exits 0.  Nothing is logged per request unless
--verbose is given (then one line per command goes to stderr).

Where a real deployment is stricter than a standalone mongod, or leaves something unspecified
that a standalone happens to do one way, a switch makes this server strict too (the default
behaviour is unchanged without it):

  --sharded KEYSPEC   every collection of a user database is taken as sharded by KEYSPEC,
                      "field:hashed" or "field:1[,field:1...]" (dotted paths allowed), and an
                      update with upsert: true whose filter does not pin every shard-key field
                      by equality fails alone with a writeErrors entry {code: 61
                      (ShardKeyNotFound), errmsg: "Failed to target upsert by query :: could
                      not extract exact shard key"}, as mongos 5.x-6.x answers
                      (src/mongo/s/chunk_manager_targeter.cpp targetUpdate,
                      ShardKeyPattern::extractShardKeyFromQuery).  An equality is {f: value}
                      (a value that is neither an operator object nor a regex) or {f: {$eq:
                      value}}, at the top level or under $and (also a one-value $in and a
                      one-clause $or, which the query canonicaliser rewrites into one); the
                      value may not be an array, a regex or an object with $-prefixed names;
                      an equality on a parent path ({a: {b: 1}} for key a.b) counts, one on a
                      child path does not; _id alone pins no other field.  Updates without
                      upsert and deletes are not checked (mongos may send them to every
                      shard; its rule for single updates, an exact _id or the shard key, also
                      depends on where chunks live, which is not modelled), nor is
                      findAndModify.  The handshake stays a standalone's (a mongos one would
                      make drivers send transaction numbers); collStats adds "sharded".
                      A $merge into an existing (so sharded) collection must name every
                      shard-key field in 'on', as the manual requires for a sharded output
                      collection: mongos finds no unique index for such fields, and fails the
                      aggregate with 51190 "Cannot find index to verify that join fields will
                      be unique" (its code also for any 'on' fields without a supporting
                      index, where mongod says 51183; src/mongo/db/pipeline/process_interface/
                      mongos_process_interface.cpp ensureFieldsUniqueOrResolveDocumentKey).
                      Without 'on' it merges on the shard-key fields and _id (the document
                      key, no index needed), so each result must hold them.  A $merge into
                      a collection that does not exist yet is not held to this (mongos
                      creates it unsharded); once created, it counts as sharded like any
                      other.
  --unstable-sortarray
                      $sortArray returns elements with equal sort keys in reverse input order
                      (MongoDB documents no stability for it; by default the sort is stable).
  --fail-command JSON configures the failCommand fail point (below) before the port is
                      printed: JSON is the rest of a configureFailPoint command, e.g.
                      '{"mode": {"times": 2}, "data": {"failCommands": ["update"],
                      "errorCode": 365, "errorLabels": ["RetryableWriteError"]}}'
                      (MongoDB extended JSON: {"$numberLong": "5"} and the like work).
  --max-write-batch N hello's maxWriteBatchSize is N (100,000 by default, as on every real
                      server), and an insert, update or delete command with more than N
                      statements fails whole with InvalidLength (16), "Write batch sizes must be
                      between 1 and N. Got M operations.", as mongod answers past its limit
                      (src/mongo/db/ops/write_ops.cpp checkOpCountForCommand). Drivers split a
                      bulk into commands of at most maxWriteBatchSize statements, so a small N
                      makes them split bulks of a few updates (a bulk a driver splits can fail in
                      one command after another answered).

The 16 MiB document limit has no switch: it is always on, as on every real server.

Rewrite cost.  MongoDB's storage engine writes a changed document whole, so what an update
costs is the BSON size of the document it produced.  The server counts, per collection, the
documents update statements wrote (modified, or inserted by an upsert; a no-op update writes
nothing) and their sizes, and reports them with the current size of what is stored:

    {bucketdTestStats: 1 | "<collection>", reset: true | false}     on the database
    -> {docBytesWritten, updatesApplied, storedBytes, count,          (Int64, over the
        collections: {<name>: {docBytesWritten, updatesApplied,        database or the one
                               storedBytes, count}}, ok: 1}            collection)

docBytesWritten is the sum of the BSON sizes of the documents written by updates,
updatesApplied their number, storedBytes the sum of the BSON sizes of the documents stored now
and count their number; docBytesWritten / storedBytes is the rewrite ratio.  reset: true zeroes
the two write counters after the reply was made from them; dropping a collection zeroes them
too.  Plain inserts are not counted; the updates and upserts a $merge makes are.  A real
MongoDB has no such command.

The wire protocol (OP_MSG with document sequences, OP_QUERY handshakes) comes
from python3-mockupdb; the data model and query language from
python3-mongomock.  On top of those this file adds what the daemon and the
other clients need and the libraries lack or get wrong:

* a standalone MongoDB 6.0 handshake (wire version 17, sessions) and the
  admin commands drivers send on connect (buildInfo, serverStatus, ...);
* real cursors (find/aggregate first batch of 101, getMore, killCursors);
* write commands answering like MongoDB (n, nModified, upserted,
  writeErrors with codes; ordered and unordered);
* update pipelines ($set/$addFields, $unset, $project, $replaceRoot,
  $replaceWith) with MongoDB's upsert seeding and dotted-path semantics;
* aggregation expressions with MongoDB's semantics: BSON comparison order
  across types, missing versus null, int32/int64/double arithmetic and
  promotion, $sortArray, $arrayElemAt with negative indexes, $objectToArray,
  $arrayToObject, ...;
* $group with MongoDB's accumulators ($sum, $avg, $min, $max, $first, $last, $push,
  $addToSet, $mergeObjects, $count): groups by BSON equality of _id (missing is null),
  $sum/$min/$max keep BSON types, $first/$last take the first/last document's value (missing
  gives null); groups come out sorted by _id, where MongoDB promises no order.  $unwind
  with MongoDB's options and errors (includeArrayIndex an Int64);
* $merge (src/mongo/db/pipeline/document_source_merge.cpp, document_source_merge_spec.cpp,
  merge_processor.cpp, process_interface/common_mongod_process_interface.cpp, and the
  manual's $merge page), as the last stage only (40601):
    - into: a collection name or {db, coll}, in any database, also the collection being
      aggregated (allowed since MongoDB 4.4); on: "_id" (the default, needs no index) or
      field names, which need a unique, non-partial index with the simple collation whose
      key is exactly those fields in any order (sparse counts), else 51183 "Cannot find
      index to verify that join fields will be unique" (also when the collection does not
      exist yet); whenMatched "replace", "keepExisting", "merge", "fail" and whenNotMatched
      "insert", "discard", "fail" in the pairs MongoDB has (else 51181).  A whenMatched
      pipeline, and a collation on such an aggregate, answer 238 (not supported).
    - the stage is checked field by field as its IDL parser does: an unknown field 40415,
      no 'into' 40414, 51178 / 5786800 / 5786801 for 'into', 51186 / 51187 / 51134 / 31465
      for 'on', 51191 or BadValue (2) for 'whenMatched', TypeMismatch or BadValue for
      'whenNotMatched', 51199 for 'let' without a pipeline, 31319 / 31320 for system
      collections and the admin, config and local databases.
    - each result needs its 'on' fields: an array there is 51185, missing (also behind a
      non-document), null or undefined 51132 (6.0's rule; 8.1 merges those as null); with
      'on' "_id" a result without _id gets a new ObjectId (never a match).
    - each result is written the way MongoDB's merge strategy writes it, through this
      server's write path (the 16 MiB limit: 17419 / 17420, unique indexes, validators and
      bypassDocumentValidation, the output collection's bucketdTestStats counters, which
      count every document the $merge updated or upserted): whenMatched "fail" inserts it
      (a match is a duplicate key, 11000); "replace" replaces the matched document, which
      keeps its _id (a result with another _id: 66, ImmutableField), "merge" $sets its
      fields, "keepExisting" leaves the match alone, each as an upsert of the document by
      the 'on' fields for whenNotMatched "insert" (a new ObjectId when neither the result
      nor 'on' gives _id).  The writes go in unordered batches of up to 100,000 documents
      and 16 MiB: every write of a batch is tried, then the first error fails the command
      (MergeStageNoMatchingDocument, 13113, for an unmatched result under whenNotMatched
      "fail"); what earlier batches wrote stays, as on a real server.
    - the output collection is created by its first write; the reply is an empty cursor on
      the aggregated namespace; writeConcern is checked as for other writes, and failCommand
      treats such an aggregate as a write (its writeConcernError applies);
* unique secondary indexes that are checked without scanning;
* an O(1) path for {_id: X} filters;
* MongoDB's limits: a document over 16 MiB is not stored (the one write fails: 17419 for an
  update, 17420 for the insert of an upsert, BadValue for an insert), a command or one
  document of an OP_MSG document sequence over 16 MiB + 16 KiB fails the command
  (BSONObjectTooLarge, 10334), a message over maxMessageSizeBytes ends the connection; and a
  standalone's refusal of transaction numbers (IllegalOperation, 20);
* collection validators (create / collMod with validator, validationLevel,
  validationAction; query operators and a top-level $jsonSchema subset): a write whose
  result fails it fails alone with DocumentValidationFailure (121);
* TTL indexes as MongoDB 6.0 checks them: createIndexes takes expireAfterSeconds only as a
  number from 0 to the seconds since 1970 (else CannotCreateIndex, 67), and an index with
  the same name or key but another expireAfterSeconds is IndexOptionsConflict (85); collMod
  {index: {name | keyPattern, expireAfterSeconds}} changes it in place (the reply has
  expireAfterSeconds_new, and expireAfterSeconds_old when the index had one; an index without
  one becomes a TTL index if it has a single field, as since 5.1) and refuses what mongod does:
  an unknown field (40415), a wrong type (14), both or neither of name and keyPattern, no
  option to change, a negative or too large value, the _id index, a compound index (72), an
  index that does not exist (27); hidden, unique and prepareUnique answer 238 (not supported
  here).  listIndexes shows expireAfterSeconds.  Expiry is mongomock's: a document whose
  indexed date is older than expireAfterSeconds is removed the next time its collection is
  read or written, at once, where MongoDB's TTL monitor deletes it within about 60 s (and
  only on a primary);
* the failCommand fail point of mongod's test commands, on the admin database:

    {configureFailPoint: "failCommand",
     mode: "alwaysOn" | "off" | {times: N} | {skip: N},
     data: {failCommands: ["update", ...] | failAllCommands: true,
            appName: "...", namespace: "db.coll",          # optional filters
            errorCode: N, errorLabels: [...],               # fail before running
            closeConnection: true,                          # drop it, no reply
            blockConnection: true, blockTimeMS: N,          # hold the command first
            writeConcernError: {code, codeName, errmsg, errInfo},   # run, then report
            writeErrorCode: N, writeErrorIndexes: [i, ...]}}        # this server only

  with mongod's semantics (src/mongo/db/commands.cpp evaluateFailCommandFailPoint,
  src/mongo/util/fail_point.cpp): a pass counts only for a command the data names; errorCode
  fails it unapplied with {ok: 0, code, codeName, errmsg: "Failing command via 'failCommand'
  failpoint"} and the data's errorLabels; writeConcernError lets the write apply and adds the
  error to its reply (with the data's errorLabels too).  Any code can be given, e.g. 365
  (TemporarilyUnavailable, what 6.0+ answers under storage-engine cache pressure) with
  errorLabels ["RetryableWriteError"].  A standalone never adds RetryableWriteError by itself
  (that label is for retryable writes, which need a replica set); the reply's "count" is the
  times entered.
  writeErrorCode is not mongod's: real servers report some failures per statement (a
  writeErrors entry in an ok: 1 reply), which failCommand cannot produce.  Given for an
  insert, update or delete the data names, the command runs but each statement listed in
  writeErrorIndexes (default: every one) fails unapplied with a writeErrors entry {index,
  code: N, errmsg: "Failing command via 'failCommand' failpoint"} (an ordered write stops
  there); errorLabels are not added to such a reply, as a real server gives labels only to
  command errors and write concern errors.  errorCode wins when both are given.

It is a correctness reference for tests, not a performance one.
"""

import argparse
import copy
import datetime
import decimal
import functools
import gc
import itertools
import math
import os
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import uuid

import bson
from bson.binary import Binary
from bson.code import Code
from bson.codec_options import CodecOptions
from bson.dbref import DBRef
from bson.decimal128 import Decimal128, create_decimal128_context
from bson import json_util
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp

import mockupdb
import mongomock
from mongomock import aggregate as mm_aggregate
from mongomock import collection as mm_collection
from mongomock import filtering as mm_filtering
from mongomock import helpers as mm_helpers
from pymongo.errors import DuplicateKeyError, OperationFailure, WriteError
from sentinels import NOTHING

SERVER_VERSION = '6.0.0'
VERSION_ARRAY = [6, 0, 0, 0]
MAX_WIRE_VERSION = 17
MAX_BSON_SIZE = 16 * 1024 * 1024
BATCH_HEADROOM = 64 * 1024
# BSONObjMaxInternalSize: the largest document mongod parses off the wire (a command or one
# document of an OP_MSG document sequence); BSONObjMaxUserSize (MAX_BSON_SIZE) is the largest
# it stores.
MAX_INTERNAL_BSON_SIZE = MAX_BSON_SIZE + 16 * 1024
MAX_MESSAGE_SIZE = 48000000
MAX_WRITE_BATCH = 100000
SESSION_TIMEOUT_MINUTES = 30
DEFAULT_BATCH = 101
CURSOR_IDLE_SECONDS = 600

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

OP_MSG_MORE_TO_COME = 2

CODE_NAMES = {
    1: 'InternalError', 2: 'BadValue', 8: 'UnknownError', 9: 'FailedToParse',
    13: 'Unauthorized', 14: 'TypeMismatch', 20: 'IllegalOperation',
    26: 'NamespaceNotFound', 27: 'IndexNotFound', 40: 'ConflictingUpdateOperators',
    43: 'CursorNotFound', 48: 'NamespaceExists', 52: 'DollarPrefixedFieldName',
    59: 'CommandNotFound', 61: 'ShardKeyNotFound', 66: 'ImmutableField', 67: 'CannotCreateIndex',
    72: 'InvalidOptions', 73: 'InvalidNamespace', 76: 'NoReplicationEnabled',
    85: 'IndexOptionsConflict', 86: 'IndexKeySpecsConflict',
    16: 'InvalidLength', 238: 'NotImplemented', 10334: 'BSONObjectTooLarge',
    11000: 'DuplicateKey',
    17276: 'Location17276',
    6: 'HostUnreachable', 7: 'HostNotFound', 17: 'ProtocolError', 50: 'MaxTimeMSExpired',
    64: 'WriteConcernFailed', 89: 'NetworkTimeout', 91: 'ShutdownInProgress',
    112: 'WriteConflict', 121: 'DocumentValidationFailure', 134:
    'ReadConcernMajorityNotAvailableYet', 189: 'PrimarySteppedDown', 262: 'ExceededTimeLimit',
    266: 'FailPointSetFailed', 365: 'TemporarilyUnavailable', 9001: 'SocketException',
    10107: 'NotWritablePrimary',
    11600: 'InterruptedAtShutdown', 11602: 'InterruptedDueToReplStateChange',
    13435: 'NotPrimaryNoSecondaryOk', 13436: 'NotPrimaryOrSecondary', 40415: 'Location40415',
    13113: 'MergeStageNoMatchingDocument',
}


def code_name(code):
    return CODE_NAMES.get(code, 'Location%d' % code)


def fail(code, msg):
    """Raise a MongoDB error with the given code."""
    raise OperationFailure(msg, code)


# --------------------------------------------------------------------------
# BSON values: type order, comparison, numbers
# --------------------------------------------------------------------------

class _Missing(object):
    """A field that is not there (BSON EOO); sorts below null."""
    __slots__ = ()

    def __repr__(self):
        return 'MISSING'

    def __bool__(self):
        return False


MISSING = _Missing()

_RE_PATTERN = type(re.compile(''))

# Canonical type order (see bsontypes.h canonicalizeBSONType).
_CANON = {
    _Missing: 0, type(None): 5, bool: 40, int: 10, Int64: 10, float: 10,
    Decimal128: 10, str: 15, dict: 20, list: 25, tuple: 25, bytes: 30,
    Binary: 30, uuid.UUID: 30, ObjectId: 35, datetime.datetime: 45,
    Timestamp: 47, Regex: 50, _RE_PATTERN: 50, MinKey: -1, MaxKey: 127,
    DBRef: 20,
}


def canon(v):
    c = _CANON.get(type(v))
    if c is not None:
        if c == 60 and v.scope is not None:
            return 65
        return c
    if v is NOTHING:
        return 0
    if isinstance(v, bool):
        return 40
    if isinstance(v, Code):
        return 65 if v.scope is not None else 60
    for klass, c in _CANON.items():
        if isinstance(v, klass):
            return c
    if isinstance(v, dict):
        return 20
    if isinstance(v, (list, tuple)):
        return 25
    return 100


_CANON[Code] = 60


def type_name(v):
    """The $type name of a value."""
    if v is MISSING or v is NOTHING:
        return 'missing'
    if v is None:
        return 'null'
    if isinstance(v, bool):
        return 'bool'
    if isinstance(v, Int64):
        return 'long'
    if isinstance(v, int):
        return 'int' if INT32_MIN <= v <= INT32_MAX else 'long'
    if isinstance(v, float):
        return 'double'
    if isinstance(v, Decimal128):
        return 'decimal'
    if isinstance(v, str):
        return 'string'
    if isinstance(v, (dict, DBRef)):
        return 'object'
    if isinstance(v, (list, tuple)):
        return 'array'
    if isinstance(v, (bytes, Binary, uuid.UUID)):
        return 'binData'
    if isinstance(v, ObjectId):
        return 'objectId'
    if isinstance(v, datetime.datetime):
        return 'date'
    if isinstance(v, Timestamp):
        return 'timestamp'
    if isinstance(v, (Regex, _RE_PATTERN)):
        return 'regex'
    if isinstance(v, Code):
        return 'javascriptWithScope' if v.scope is not None else 'javascript'
    if isinstance(v, MinKey):
        return 'minKey'
    if isinstance(v, MaxKey):
        return 'maxKey'
    return type(v).__name__


def _naive(dt):
    if dt.tzinfo is not None:
        return (dt - dt.utcoffset()).replace(tzinfo=None)
    return dt


def _sign(a, b):
    return (a > b) - (a < b)


def _num_value(v):
    return v.to_decimal() if isinstance(v, Decimal128) else v


def _num_cmp(a, b):
    a = _num_value(a)
    b = _num_value(b)
    a_nan = a != a
    b_nan = b != b
    if a_nan or b_nan:
        if a_nan and b_nan:
            return 0
        return -1 if a_nan else 1
    return _sign(a, b)


def _bin_parts(v):
    if isinstance(v, uuid.UUID):
        return 16, 4, v.bytes
    if isinstance(v, Binary):
        return len(v), v.subtype, bytes(v)
    return len(v), 0, bytes(v)


def bson_cmp(a, b):
    """Compare two values in BSON order; returns -1, 0 or 1."""
    ca = canon(a)
    cb = canon(b)
    if ca != cb:
        return -1 if ca < cb else 1
    if ca == 10:
        return _num_cmp(a, b)
    if ca == 15:
        return _sign(a, b)
    if ca == 45:
        return _sign(_naive(a), _naive(b))
    if ca == 20:
        if isinstance(a, DBRef):
            a = a.as_doc()
        if isinstance(b, DBRef):
            b = b.as_doc()
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            c = _sign(canon(va), canon(vb))
            if c:
                return c
            c = _sign(ka, kb)
            if c:
                return c
            c = bson_cmp(va, vb)
            if c:
                return c
        return _sign(len(a), len(b))
    if ca == 25:
        for va, vb in zip(a, b):
            c = bson_cmp(va, vb)
            if c:
                return c
        return _sign(len(a), len(b))
    if ca == 40:
        return _sign(a, b)
    if ca == 35:
        return _sign(a.binary, b.binary)
    if ca == 30:
        return _sign(_bin_parts(a), _bin_parts(b))
    if ca == 47:
        return _sign((a.time, a.inc), (b.time, b.inc))
    if ca == 50:
        return _sign((a.pattern, str(a.flags)), (b.pattern, str(b.flags)))
    if ca in (60, 65):
        c = _sign(str(a), str(b))
        if c or ca == 60:
            return c
        return bson_cmp(a.scope, b.scope)
    return 0


def bson_eq(a, b):
    return bson_cmp(a, b) == 0


def hkey(v):
    """A hashable key such that bson_eq(a, b) implies hkey(a) == hkey(b)."""
    c = canon(v)
    if c == 10:
        v = _num_value(v)
        if v != v:
            return (10, 'nan')
        return (10, v)
    if c in (15, 40, 35, 45):
        return (c, _naive(v) if c == 45 else v)
    if c == 20:
        if isinstance(v, DBRef):
            v = v.as_doc()
        return (20, tuple((k, hkey(x)) for k, x in v.items()))
    if c == 25:
        return (25, tuple(hkey(x) for x in v))
    if c == 30:
        return (30,) + _bin_parts(v)
    if c in (0, 5, -1, 127):
        return (c,)
    if c == 47:
        return (47, v.time, v.inc)
    if c == 50:
        return (50, v.pattern, str(v.flags))
    try:
        hash(v)
        return (c, v)
    except TypeError:
        return (c, repr(v))


def num_kind(v):
    """0 int32, 1 int64, 2 double, 3 decimal, None when not a number."""
    t = type(v)
    if t is float:
        return 2
    if t is Int64:
        return 1
    if t is int:
        return 0 if INT32_MIN <= v <= INT32_MAX else 1
    if t is bool:
        return None
    if t is Decimal128:
        return 3
    if isinstance(v, bool):
        return None
    if isinstance(v, Int64):
        return 1
    if isinstance(v, int):
        return 0 if INT32_MIN <= v <= INT32_MAX else 1
    if isinstance(v, float):
        return 2
    if isinstance(v, Decimal128):
        return 3
    return None


_DEC_CTX = create_decimal128_context()


def _to_dec(v):
    if isinstance(v, Decimal128):
        return v.to_decimal()
    if isinstance(v, float):
        # MongoDB converts doubles to decimal with 15 significant digits.
        return _DEC_CTX.create_decimal(repr(v)) if v == v else decimal.Decimal('NaN')
    return decimal.Decimal(int(v))


def _make_dec(d):
    with decimal.localcontext(_DEC_CTX) as ctx:
        return Decimal128(ctx.create_decimal(d))


def make_int(value, kind):
    """An integer result typed like MongoDB: int32 grows to int64 grows to double."""
    if kind == 0 and INT32_MIN <= value <= INT32_MAX:
        return int(value)
    if INT64_MIN <= value <= INT64_MAX:
        return Int64(value)
    return float(value)


def num_sum(values):
    """Sum of numbers with MongoDB's result type (widest operand, promoted on overflow)."""
    kind = 0
    for v in values:
        k = num_kind(v)
        if k > kind:
            kind = k
    if kind == 3:
        with decimal.localcontext(_DEC_CTX):
            total = decimal.Decimal(0)
            for v in values:
                total += _to_dec(v)
        return _make_dec(total)
    if kind == 2:
        return math.fsum(float(_num_value(v)) for v in values)
    return make_int(sum(int(v) for v in values), kind)


def num_mul(values):
    kind = 0
    for v in values:
        k = num_kind(v)
        if k > kind:
            kind = k
    if kind == 3:
        with decimal.localcontext(_DEC_CTX):
            total = decimal.Decimal(1)
            for v in values:
                total *= _to_dec(v)
        return _make_dec(total)
    if kind == 2:
        total = 1.0
        for v in values:
            total *= float(v)
        return total
    total = 1
    for v in values:
        total *= int(v)
    return make_int(total, kind)


def num_sub(a, b):
    kind = max(num_kind(a), num_kind(b))
    if kind == 3:
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(_to_dec(a) - _to_dec(b))
    if kind == 2:
        return float(a) - float(b)
    return make_int(int(a) - int(b), kind)


def is_number(v):
    return num_kind(v) is not None


def nullish(v):
    return v is None or v is MISSING or v is NOTHING


def truthy(v):
    """MongoDB's conversion of an expression result to a boolean."""
    if v is None or v is MISSING or v is False or v is NOTHING:
        return False
    if v is True:
        return True
    k = num_kind(v)
    if k is not None:
        return _num_value(v) != 0
    return True


_MS = datetime.timedelta(milliseconds=1)


def _now():
    now = datetime.datetime.utcnow()
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _date_add_ms(date, ms):
    if isinstance(ms, float):
        ms = int(round(ms))
    else:
        ms = int(_num_value(ms))
    return date + datetime.timedelta(milliseconds=ms)


def _date_ms(date):
    return (_naive(date) - datetime.datetime(1970, 1, 1)) // _MS


def fmt_value(v):
    """Render a value roughly like the server does in error messages."""
    if isinstance(v, str):
        return '"%s"' % v.replace('"', '\\"')
    if isinstance(v, bool):
        return 'true' if v else 'false'
    if v is None:
        return 'null'
    if isinstance(v, dict):
        if not v:
            return '{}'
        return '{ %s }' % ', '.join('%s: %s' % (k, fmt_value(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return '[ %s ]' % ', '.join(fmt_value(x) for x in v)
    if isinstance(v, datetime.datetime):
        return 'new Date(%d)' % _date_ms(v)
    if isinstance(v, ObjectId):
        return "ObjectId('%s')" % v
    return str(v)


# --------------------------------------------------------------------------
# Aggregation expressions
# --------------------------------------------------------------------------

def agg_get(value, parts, i=0):
    """Resolve a field path the way aggregation does: arrays of documents
    yield the array of the sub-field; missing raises KeyError."""
    n = len(parts)
    while i < n:
        if isinstance(value, dict):
            try:
                value = value[parts[i]]
            except KeyError:
                raise KeyError(parts[i]) from None
            i += 1
        elif isinstance(value, list):
            if i == n - 1:
                part = parts[i]
                return [el[part] for el in value if isinstance(el, dict) and part in el]
            out = []
            for el in value:
                if isinstance(el, dict):
                    try:
                        out.append(agg_get(el, parts, i))
                    except KeyError:
                        pass
            return out
        else:
            raise KeyError(parts[i])
    return value


_PATH_CACHE = {}


def _path_parts(path):
    """Split and check a dotted field path (results are cached)."""
    parts = _PATH_CACHE.get(path)
    if parts is not None:
        return parts
    parts = path.split('.')
    for p in parts:
        if not p:
            fail(15998, "FieldPath field names may not be empty strings.")
        if p[0] == '$':
            fail(16410, "FieldPath field names may not start with '$'. "
                        "Consider using $getField or $setField.")
    if len(_PATH_CACHE) > 10000:
        _PATH_CACHE.clear()
    _PATH_CACHE[path] = parts
    return parts


_BaseParser = mm_aggregate._Parser


class ExprParser(_BaseParser):
    """mongomock's expression parser with MongoDB's semantics where they
    differ.  A missing value is signalled by KeyError, as in mongomock."""

    def parse(self, expression):
        t = type(expression)
        if t is str:
            if expression[:1] == '$':
                return self._path(expression)
            return expression
        if t is dict or isinstance(expression, dict):
            for first in expression:
                break
            else:
                return {}
            if first[:1] == '$':
                if len(expression) != 1:
                    fail(15983, 'an expression specification must contain exactly one '
                                'field, the name of the expression. Found %d fields in %s'
                         % (len(expression), fmt_value(expression)))
                handler = _EXPR_HANDLERS.get(first)
                if handler is not None:
                    return handler(self, expression[first])
                try:
                    return _BaseParser.parse(self, expression)
                except OperationFailure as e:
                    if not e.code and str(e).startswith('Unrecognized expression'):
                        fail(168, "Unrecognized expression '%s'" % first)
                    raise
            out = {}
            for k, v in expression.items():
                if k[:1] == '$':
                    fail(16410, "FieldPath field names may not start with '$'. "
                                "Consider using $getField or $setField.")
                try:
                    out[k] = self.parse(v)
                except KeyError:
                    pass
            return out
        if t is list or isinstance(expression, list):
            return [self.value_or_null(e) for e in expression]
        return expression

    def _path(self, expr):
        if expr[1:2] != '$':
            if len(expr) == 1:
                fail(16872, "'$' by itself is not a valid FieldPath")
            parts = _PATH_CACHE.get(expr)
            if parts is None:
                parts = _path_parts(expr[1:])
                _PATH_CACHE[expr] = parts
            value = self._doc_dict
            for i, part in enumerate(parts):
                if type(value) is dict:
                    try:
                        value = value[part]
                    except KeyError:
                        raise KeyError(part) from None
                else:
                    return agg_get(value, parts, i)
            return value
        name, dot, rest = expr[2:].partition('.')
        if name in self._user_vars:
            base = self._user_vars[name]
        elif name in ('ROOT', 'CURRENT'):
            base = self._doc_dict
        elif name == 'REMOVE':
            raise KeyError(expr)
        elif name == 'NOW':
            base = _now()
        else:
            fail(17276, 'Use of undefined variable: %s' % name)
        if not dot:
            return base
        return agg_get(base, _path_parts(rest))

    def eval(self, expression):
        """Evaluate; MISSING instead of KeyError."""
        t = type(expression)
        if t is not dict and t is not list and t is not str:
            return expression
        try:
            return self.parse(expression)
        except KeyError:
            return MISSING

    def value_or_null(self, expression):
        try:
            return self.parse(expression)
        except KeyError:
            return None

    def sub(self, extra_vars):
        return ExprParser(self._doc_dict, dict(self._user_vars, **extra_vars),
                          ignore_missing_keys=self._ignore_missing_keys)


def _args(v, op, n=None, lo=None, hi=None):
    args = v if isinstance(v, list) else [v]
    if n is not None and len(args) != n:
        fail(16020, 'Expression %s takes exactly %d arguments. %d were passed in.'
             % (op, n, len(args)))
    if lo is not None and len(args) < lo:
        fail(16020, 'Expression %s takes at least %d arguments, and at most %d, '
                    'but %d were passed in.' % (op, lo, hi or lo, len(args)))
    if hi is not None and len(args) > hi:
        fail(16020, 'Expression %s takes at least %d arguments, and at most %d, '
                    'but %d were passed in.' % (op, lo or 0, hi, len(args)))
    return args


def _unary(v, op):
    if isinstance(v, list):
        if len(v) != 1:
            fail(16020, 'Expression %s takes exactly 1 arguments. %d were passed in.'
                 % (op, len(v)))
        return v[0]
    return v


def _x_literal(p, v):
    return v


def _x_add(p, v):
    date = None
    nums = []
    is_null = False
    for e in (v if type(v) is list else [v]):
        x = p.eval(e)
        if x is None or x is MISSING:
            is_null = True
        elif type(x) is datetime.datetime:
            if date is not None:
                fail(16612, 'only one date allowed in an $add expression')
            date = x
        elif num_kind(x) is not None:
            nums.append(x)
        else:
            fail(16554, '$add only supports numeric or date types, not %s' % type_name(x))
    if is_null:
        return None
    if date is not None:
        return _date_add_ms(date, num_sum(nums) if nums else 0)
    return num_sum(nums) if nums else 0


def _x_subtract(p, v):
    a, b = [p.eval(e) for e in _args(v, '$subtract', 2)]
    if nullish(a) or nullish(b):
        return None
    if isinstance(a, datetime.datetime):
        if isinstance(b, datetime.datetime):
            return Int64((_naive(a) - _naive(b)) // _MS)
        if is_number(b):
            return _date_add_ms(a, -_num_value(b) if not isinstance(b, Decimal128)
                                else -int(b.to_decimal()))
    elif is_number(a) and is_number(b):
        return num_sub(a, b)
    fail(16556, "can't $subtract %s from %s" % (type_name(b), type_name(a)))


def _x_multiply(p, v):
    nums = []
    is_null = False
    for e in _args(v, '$multiply'):
        x = p.eval(e)
        if nullish(x):
            is_null = True
        elif is_number(x):
            nums.append(x)
        else:
            fail(16555, '$multiply only supports numeric types, not %s' % type_name(x))
    if is_null:
        return None
    return num_mul(nums) if nums else 1


def _x_divide(p, v):
    a, b = [p.eval(e) for e in _args(v, '$divide', 2)]
    if nullish(a) or nullish(b):
        return None
    if not is_number(a) or not is_number(b):
        fail(16609, '$divide only supports numeric types, not %s and %s'
             % (type_name(a), type_name(b)))
    if _num_value(b) == 0:
        fail(16608, "can't $divide by zero")
    if isinstance(a, Decimal128) or isinstance(b, Decimal128):
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(_to_dec(a) / _to_dec(b))
    return float(a) / float(b)


def _x_mod(p, v):
    a, b = [p.eval(e) for e in _args(v, '$mod', 2)]
    if nullish(a) or nullish(b):
        return None
    if not is_number(a) or not is_number(b):
        fail(16611, '$mod only supports numeric types, not %s and %s'
             % (type_name(a), type_name(b)))
    if _num_value(b) == 0:
        fail(16610, "can't $mod by zero")
    kind = max(num_kind(a), num_kind(b))
    if kind == 3:
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(_to_dec(a) % _to_dec(b))
    if kind == 2:
        return math.fmod(float(a), float(b))
    r = abs(int(a)) % abs(int(b))
    return make_int(-r if a < 0 else r, kind)


def _rounding(fn, op):
    def handler(p, v):
        x = p.eval(_unary(v, op))
        if nullish(x):
            return None
        k = num_kind(x)
        if k is None:
            fail(28765, '%s only supports numeric types, not %s' % (op, type_name(x)))
        if k in (0, 1):
            return x
        if k == 3:
            return Decimal128(fn(x.to_decimal()))
        if x != x or x in (float('inf'), float('-inf')):
            return x
        return float(fn(x))
    return handler


def _x_abs(p, v):
    x = p.eval(_unary(v, '$abs'))
    if nullish(x):
        return None
    k = num_kind(x)
    if k is None:
        fail(28765, '$abs only supports numeric types, not %s' % type_name(x))
    if k == 3:
        return Decimal128(abs(x.to_decimal()))
    if k == 2:
        return abs(x)
    return make_int(abs(int(x)), k)


def _x_ifnull(p, v):
    if not isinstance(v, list) or len(v) < 2:
        fail(1257300, '$ifNull needs at least two arguments, had: %d'
             % (len(v) if isinstance(v, list) else 1))
    for e in v[:-1]:
        x = p.eval(e)
        if not nullish(x):
            return x
    return p.parse(v[-1])


def _x_cond(p, v):
    if isinstance(v, list):
        if len(v) != 3:
            fail(16020, 'Expression $cond takes exactly 3 arguments. %d were passed in.'
                 % len(v))
        cond, then, other = v
    elif isinstance(v, dict):
        for k in v:
            if k not in ('if', 'then', 'else'):
                fail(17083, 'Unrecognized parameter to $cond: %s' % k)
        for k in ('if', 'then', 'else'):
            if k not in v:
                fail(17080 + ('if', 'then', 'else').index(k), "Missing '%s' parameter to $cond" % k)
        cond, then, other = v['if'], v['then'], v['else']
    else:
        fail(16020, 'Expression $cond takes exactly 3 arguments. 1 were passed in.')
    return p.parse(then if truthy(p.eval(cond)) else other)


def _x_array_elem_at(p, v):
    arr, idx = [p.eval(e) for e in _args(v, '$arrayElemAt', 2)]
    if nullish(arr) or nullish(idx):
        return None
    if not isinstance(arr, list):
        fail(28689, "$arrayElemAt's first argument must be an array, but is %s"
             % type_name(arr))
    if not is_number(idx):
        fail(28690, "$arrayElemAt's second argument must be a numeric value, but is %s"
             % type_name(idx))
    i = _num_value(idx)
    if i != i or int(i) != i or not INT32_MIN <= int(i) <= INT32_MAX:
        fail(28691, "$arrayElemAt's second argument must be representable as a 32-bit "
                    "integer: %s" % fmt_value(idx))
    i = int(i)
    if i < 0:
        i += len(arr)
    if i < 0 or i >= len(arr):
        raise KeyError('$arrayElemAt')
    return arr[i]


def _first_last(op, pick):
    def handler(p, v):
        x = p.eval(_unary(v, op))
        if nullish(x):
            return None
        if not isinstance(x, list):
            fail(28689, "%s's argument must be an array, but is %s" % (op, type_name(x)))
        if not x:
            raise KeyError(op)
        return x[pick]
    return handler


def _x_concat_arrays(p, v):
    out = []
    parts = []
    for e in _args(v, '$concatArrays'):
        x = p.eval(e)
        if nullish(x):
            return None
        if not isinstance(x, list):
            fail(28664, '$concatArrays only supports arrays, not %s' % type_name(x))
        out.extend(x)
        parts.append(x)
    note_list_parts(out, parts)
    return out


# --unstable-sortarray (set by Backend).
UNSTABLE_SORT_ARRAY = [False]


def _x_sort_array(p, v):
    if not isinstance(v, dict):
        fail(2, 'sortArray expects an object as its argument, but found: %s' % type_name(v))
    for k in v:
        if k not in ('input', 'sortBy'):
            fail(2, '$sortArray found an unknown argument: %s' % k)
    if 'input' not in v:
        fail(2, "$sortArray requires 'input' to be specified")
    if 'sortBy' not in v:
        fail(2, "$sortArray requires 'sortBy' to be specified")
    sort_by = v['sortBy']
    if isinstance(sort_by, dict):
        if not sort_by:
            fail(2, 'sortBy must not be empty')
        keys = _sort_items(sort_by)
    elif is_number(sort_by) and _num_value(sort_by) in (1, -1):
        keys = None
    else:
        fail(2, 'sortBy must be either 1, -1, or an object')
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(2, 'The input argument to $sortArray must be an array, but was of type: %s'
             % type_name(arr))
    # The server documents no stability for $sortArray; with --unstable-sortarray elements
    # with equal sort keys come out in reverse input order (the sorts below are stable, also
    # for descending order), so that code relying on a stable sort fails here as it could on a
    # real server.
    src = arr[::-1] if UNSTABLE_SORT_ARRAY[0] else arr
    if keys is None:
        out = sort_values(src, _num_value(sort_by) < 0)
    else:
        out = sort_docs(src, keys)
    note_list_parts(out, [arr])
    return out


def _accumulator_inputs(p, v):
    """Operands of $min/$max/$sum/$avg used as expressions: one operand that
    is an array is traversed, several operands are taken as they are."""
    if isinstance(v, list) and len(v) != 1:
        return [p.eval(e) for e in v]
    x = p.eval(v[0] if isinstance(v, list) else v)
    if isinstance(x, list):
        return x
    return [x]


def bson_min_max(values, want_max):
    best = MISSING
    for x in values:
        if nullish(x):
            continue
        if best is MISSING:
            best = x
            continue
        c = bson_cmp(x, best)
        if (c > 0) if want_max else (c < 0):
            best = x
    return None if best is MISSING else best


def sum_numbers(values):
    nums = [x for x in values if is_number(x)]
    if not nums:
        return 0
    return num_sum(nums)


def avg_numbers(values):
    nums = [x for x in values if is_number(x)]
    if not nums:
        return None
    if any(isinstance(x, Decimal128) for x in nums):
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(num_sum(nums).to_decimal() / len(nums))
    return float(_num_value(num_sum(nums))) / len(nums)


def _x_min(p, v):
    return bson_min_max(_accumulator_inputs(p, v), False)


def _x_max(p, v):
    return bson_min_max(_accumulator_inputs(p, v), True)


def _x_sum(p, v):
    return sum_numbers(_accumulator_inputs(p, v))


def _x_avg(p, v):
    return avg_numbers(_accumulator_inputs(p, v))


def _comparison(op, test):
    def handler(p, v):
        a, b = [p.eval(e) for e in _args(v, op, 2)]
        return test(bson_cmp(a, b))
    return handler


def _x_cmp(p, v):
    a, b = [p.eval(e) for e in _args(v, '$cmp', 2)]
    return bson_cmp(a, b)


def _x_and(p, v):
    for e in _args(v, '$and'):
        if not truthy(p.eval(e)):
            return False
    return True


def _x_or(p, v):
    for e in _args(v, '$or'):
        if truthy(p.eval(e)):
            return True
    return False


def _x_not(p, v):
    return not truthy(p.eval(_unary(v, '$not')))


def _x_in(p, v):
    x, arr = [p.eval(e) for e in _args(v, '$in', 2)]
    if not isinstance(arr, list):
        fail(40081, '$in requires an array as a second argument, found: %s' % type_name(arr))
    return any(bson_cmp(x, el) == 0 for el in arr)


def _x_size(p, v):
    x = p.eval(_unary(v, '$size'))
    if not isinstance(x, list):
        fail(17124, 'The argument to $size must be an array. Type of argument is %s'
             % type_name(x))
    return len(x)


def _x_type(p, v):
    return type_name(p.eval(_unary(v, '$type')))


def _x_is_array(p, v):
    return isinstance(p.eval(_unary(v, '$isArray')), list)


def _x_is_number(p, v):
    return is_number(p.eval(_unary(v, '$isNumber')))


def _convert_int(x, op, bits):
    if nullish(x):
        return None
    lo, hi = (INT32_MIN, INT32_MAX) if bits == 32 else (INT64_MIN, INT64_MAX)
    if isinstance(x, bool):
        n = int(x)
    elif is_number(x):
        f = _num_value(x)
        if f != f or f in (float('inf'), float('-inf')):
            fail(241, 'Attempt to convert NaN or infinity value to integer in %s' % op)
        n = int(f)
    elif isinstance(x, datetime.datetime) and bits == 64:
        n = _date_ms(x)
    elif isinstance(x, str):
        try:
            n = int(x.strip(), 10)
        except ValueError:
            fail(241, 'Failed to parse number \'%s\' in $convert with no onError value' % x)
    else:
        fail(241, 'Unsupported conversion from %s to %s in $convert with no onError value'
             % (type_name(x), 'int' if bits == 32 else 'long'))
    if not lo <= n <= hi:
        fail(241, 'Conversion would overflow target type in $convert with no onError value')
    return int(n) if bits == 32 else Int64(n)


def _x_to_int(p, v):
    return _convert_int(p.eval(_unary(v, '$toInt')), '$toInt', 32)


def _x_to_long(p, v):
    return _convert_int(p.eval(_unary(v, '$toLong')), '$toLong', 64)


def _x_to_double(p, v):
    x = p.eval(_unary(v, '$toDouble'))
    if nullish(x):
        return None
    if isinstance(x, bool):
        return float(x)
    if is_number(x):
        return float(_num_value(x))
    if isinstance(x, datetime.datetime):
        return float(_date_ms(x))
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            fail(241, "Failed to parse number '%s' in $convert with no onError value" % x)
    fail(241, 'Unsupported conversion from %s to double in $convert with no onError value'
         % type_name(x))


def _x_to_bool(p, v):
    x = p.eval(_unary(v, '$toBool'))
    if nullish(x):
        return None
    return truthy(x)


def _x_to_date(p, v):
    x = p.eval(_unary(v, '$toDate'))
    if nullish(x):
        return None
    if isinstance(x, datetime.datetime):
        return x
    if is_number(x) and not isinstance(x, bool):
        return _date_add_ms(datetime.datetime(1970, 1, 1), _num_value(x))
    if isinstance(x, ObjectId):
        return x.generation_time.replace(tzinfo=None)
    fail(241, 'Unsupported conversion from %s to date in $convert with no onError value'
         % type_name(x))


def _x_merge_objects(p, v):
    out = {}
    for e in _args(v, '$mergeObjects'):
        x = p.eval(e)
        if nullish(x):
            continue
        if not isinstance(x, dict):
            fail(40400, '$mergeObjects requires object inputs, but input %s is of type %s'
                 % (fmt_value(x), type_name(x)))
        out.update(x)
    return out


def _x_map(p, v):
    if not isinstance(v, dict):
        fail(16878, '$map only supports an object as its argument')
    for k in v:
        if k not in ('input', 'as', 'in'):
            fail(16879, 'Unrecognized parameter to $map: %s' % k)
    for k in ('input', 'in'):
        if k not in v:
            fail(16881 if k == 'in' else 16880, "Missing '%s' parameter to $map" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(16883, 'input to $map must be an array not %s' % type_name(arr))
    name = v.get('as', 'this')
    return [p.sub({name: item}).value_or_null(v['in']) for item in arr]


def _x_let(p, v):
    if not isinstance(v, dict):
        fail(16874, '$let only supports an object as its argument')
    for k in v:
        if k not in ('vars', 'in'):
            fail(16875, 'Unrecognized parameter to $let: %s' % k)
    if 'vars' not in v:
        fail(16876, "Missing 'vars' parameter to $let")
    if 'in' not in v:
        fail(16877, "Missing 'in' parameter to $let")
    if not isinstance(v['vars'], dict):
        fail(10065, "invalid parameter: expected an object (vars)")
    # Every variable is evaluated in the outer scope, then 'in' sees them all.
    values = {name: p.value_or_null(expr) for name, expr in v['vars'].items()}
    return p.sub(values).value_or_null(v['in'])


def _x_range(p, v):
    args = _args(v, '$range', lo=2, hi=3)
    vals = [p.eval(a) for a in args]
    for what, x in zip(('starting value', 'ending value', 'step value'), vals):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or int(x) != x or \
                not -2 ** 31 <= int(x) < 2 ** 31:
            fail(34443, '$range requires a %s that can be represented as a 32-bit integer, '
                 'found value: %r' % (what, x))
    start, end = int(vals[0]), int(vals[1])
    step = int(vals[2]) if len(vals) == 3 else 1
    if step == 0:
        fail(34449, '$range requires a non-zero step value')
    return list(range(start, end, step))


def _x_filter(p, v):
    if not isinstance(v, dict):
        fail(28646, '$filter only supports an object as its argument')
    for k in v:
        if k not in ('input', 'as', 'cond', 'limit'):
            fail(28647, 'Unrecognized parameter to $filter: %s' % k)
    for k in ('input', 'cond'):
        if k not in v:
            fail(28648 if k == 'input' else 28650, "Missing '%s' parameter to $filter" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(28651, 'input to $filter must be an array not %s' % type_name(arr))
    limit = None
    if 'limit' in v:
        limit = p.eval(v['limit'])
        if nullish(limit):
            limit = None
        elif not is_number(limit) or _num_value(limit) < 1:
            fail(327392, '$filter: limit must be greater than 0')
        else:
            limit = int(_num_value(limit))
    name = v.get('as', 'this')
    out = []
    for item in arr:
        if truthy(p.sub({name: item}).eval(v['cond'])):
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
    return out


def _x_object_to_array(p, v):
    x = p.eval(_unary(v, '$objectToArray'))
    if nullish(x):
        return None
    if not isinstance(x, dict):
        fail(40390, '$objectToArray requires a document input, found: %s' % type_name(x))
    return [{'k': k, 'v': val} for k, val in x.items()]


def _x_array_to_object(p, v):
    """$arrayToObject (ExpressionArrayToObject): [{k, v}, ...] or [[k, v], ...], one format
    throughout; a repeated key keeps its first position and takes the last value."""
    arr = p.eval(_unary(v, '$arrayToObject'))
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(40386, '$arrayToObject requires an array input, found: %s' % type_name(arr))
    out = {}
    if not arr:
        return out
    objects = isinstance(arr[0], dict)
    if not objects and not isinstance(arr[0], list):
        fail(40398, 'Unrecognised input type format for $arrayToObject: %s' % type_name(arr[0]))
    for el in arr:
        if objects:
            if not isinstance(el, dict):
                fail(40391, '$arrayToObject requires a consistent input format. Elements must '
                            'all be arrays or all be objects. Object was detected, now found: '
                            '%s' % type_name(el))
            if len(el) != 2:
                fail(40392, "$arrayToObject requires an object keys of 'k' and 'v'. Found "
                            "incorrect number of keys:%d" % len(el))
            if 'k' not in el or 'v' not in el:
                fail(40393, "$arrayToObject requires an object with keys 'k' and 'v'. Missing "
                            "either or both keys from: %s" % fmt_value(el))
            key, value = el['k'], el['v']
            if not isinstance(key, str):
                fail(40394, "$arrayToObject requires an object with keys 'k' and 'v', where "
                            "the value of 'k' must be of type string. Found type: %s"
                     % type_name(key))
            if '\x00' in key:
                fail(4940401, "Key field cannot contain an embedded null byte")
        else:
            if not isinstance(el, list):
                fail(40396, '$arrayToObject requires a consistent input format. Elements must '
                            'all be arrays or all be objects. Array was detected, now found: '
                            '%s' % type_name(el))
            if len(el) != 2:
                fail(40397, '$arrayToObject requires an array of size 2 arrays,found array of '
                            'size: %d' % len(el))
            key, value = el
            if not isinstance(key, str):
                fail(40395, '$arrayToObject requires an array of key-value pairs, where the key '
                            'must be of type string. Found key type: %s' % type_name(key))
            if '\x00' in key:
                fail(4940400, "Key field cannot contain an embedded null byte")
        out[key] = value
    return out


def _x_reduce(p, v):
    if not isinstance(v, dict):
        fail(40075, '$reduce only supports an object as its argument')
    for k in ('input', 'initialValue', 'in'):
        if k not in v:
            fail(40077, "Missing '%s' parameter to $reduce" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(40080, 'input to $reduce must be an array not %s' % type_name(arr))
    acc = p.eval(v['initialValue'])
    for item in arr:
        acc = p.sub({'value': acc, 'this': item}).eval(v['in'])
    if acc is MISSING:
        raise KeyError('$reduce')
    return acc


_EXPR_HANDLERS = {
    '$literal': _x_literal,
    '$add': _x_add,
    '$subtract': _x_subtract,
    '$multiply': _x_multiply,
    '$divide': _x_divide,
    '$mod': _x_mod,
    '$abs': _x_abs,
    '$floor': _rounding(math.floor, '$floor'),
    '$ceil': _rounding(math.ceil, '$ceil'),
    '$ifNull': _x_ifnull,
    '$cond': _x_cond,
    '$arrayElemAt': _x_array_elem_at,
    '$first': _first_last('$first', 0),
    '$last': _first_last('$last', -1),
    '$concatArrays': _x_concat_arrays,
    '$sortArray': _x_sort_array,
    '$min': _x_min,
    '$max': _x_max,
    '$sum': _x_sum,
    '$avg': _x_avg,
    '$eq': _comparison('$eq', lambda c: c == 0),
    '$ne': _comparison('$ne', lambda c: c != 0),
    '$gt': _comparison('$gt', lambda c: c > 0),
    '$gte': _comparison('$gte', lambda c: c >= 0),
    '$lt': _comparison('$lt', lambda c: c < 0),
    '$lte': _comparison('$lte', lambda c: c <= 0),
    '$cmp': _x_cmp,
    '$and': _x_and,
    '$or': _x_or,
    '$not': _x_not,
    '$in': _x_in,
    '$size': _x_size,
    '$type': _x_type,
    '$isArray': _x_is_array,
    '$isNumber': _x_is_number,
    '$toInt': _x_to_int,
    '$toLong': _x_to_long,
    '$toDouble': _x_to_double,
    '$toBool': _x_to_bool,
    '$toDate': _x_to_date,
    '$mergeObjects': _x_merge_objects,
    '$map': _x_map,
    '$let': _x_let,
    '$range': _x_range,
    '$filter': _x_filter,
    '$reduce': _x_reduce,
    '$objectToArray': _x_object_to_array,
    '$arrayToObject': _x_array_to_object,
}


def _expr_for_match(expression, doc, ignore_missing_keys=False):
    """$expr inside a query: true when the expression is truthy."""
    try:
        return truthy(ExprParser(doc, ignore_missing_keys=True).parse(expression))
    except KeyError:
        return False


# --------------------------------------------------------------------------
# Sorting
# --------------------------------------------------------------------------

def _sort_items(spec):
    items = []
    for path, direction in spec.items():
        if isinstance(direction, dict):
            fail(238, 'sorting by %s is not supported by the test server' % fmt_value(direction))
        if not is_number(direction) or _num_value(direction) not in (1, -1):
            fail(15975, '$sort key ordering must be 1 (for ascending) or -1 (for descending)')
        items.append((path, _num_value(direction) < 0))
    return items


def _sort_value(doc, path, desc):
    """The value a document sorts by: min (asc) or max (desc) of the values
    found at the path, arrays taken element by element; missing is null."""
    if not isinstance(doc, dict):
        return None
    if '.' not in path:
        v = doc.get(path, MISSING)
        if v is MISSING:
            return None
        if not isinstance(v, list):
            return v
        cands = v if v else [MISSING]
    else:
        cands = []
        for v in mm_filtering.iter_key_candidates(path, doc):
            if v is NOTHING:
                continue
            if isinstance(v, list):
                if v:
                    cands.extend(v)
                else:
                    cands.append(MISSING)
            else:
                cands.append(v)
        if not cands:
            return None
    best = cands[0]
    for x in cands[1:]:
        c = bson_cmp(x, best)
        if (c > 0) if desc else (c < 0):
            best = x
    return best


def _fast_sort_key(values):
    """A plain key function when all values are of one simply ordered type."""
    t = None
    for v in values:
        if isinstance(v, bool) or v is None:
            return None
        if isinstance(v, datetime.datetime):
            if v.tzinfo is not None:
                return None
            k = 'date'
        elif isinstance(v, (int, float)):
            if v != v:
                return None
            k = 'num'
        elif isinstance(v, str):
            k = 'str'
        else:
            return None
        if t is None:
            t = k
        elif t != k:
            return None
    return True


def sort_values(values, desc):
    values = list(values)
    if _fast_sort_key(values):
        return sorted(values, reverse=desc)
    return sorted(values, key=functools.cmp_to_key(bson_cmp), reverse=desc)


def sort_docs(docs, keys):
    """Stable sort of documents by [(path, descending)] in BSON order."""
    docs = list(docs)
    if not keys:
        return docs
    if keys[0][0] == '$natural':
        return docs[::-1] if keys[0][1] else docs
    if len(keys) == 1:
        path, desc = keys[0]
        vals = [_sort_value(d, path, desc) for d in docs]
        if _fast_sort_key(vals):
            order = sorted(range(len(docs)), key=vals.__getitem__, reverse=desc)
            return [docs[i] for i in order]
    decorated = [([_sort_value(d, path, desc) for path, desc in keys], d) for d in docs]

    def cmp(x, y):
        for j, (_, desc) in enumerate(keys):
            c = bson_cmp(x[0][j], y[0][j])
            if c:
                return -c if desc else c
        return 0
    decorated.sort(key=functools.cmp_to_key(cmp))
    return [d for _, d in decorated]


# --------------------------------------------------------------------------
# Pipeline stages used by update pipelines (and by aggregate)
# --------------------------------------------------------------------------

def _is_expression_object(v):
    if type(v) is not dict and not isinstance(v, dict):
        return False
    for first in v:
        return first[:1] == '$'
    return False


def _add_to_tree(node, path, expr, stage, values):
    parts = _path_parts(path)
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = ('node', {})
        elif child[0] != 'node':
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        node = child[1]
    last = parts[-1]
    if isinstance(expr, dict) and not _is_expression_object(expr):
        if not expr:
            fail(40180, 'Invalid %s :: caused by :: an empty object is not a valid value. '
                        'Found empty object at path %s' % (stage, path))
        child = node.get(last)
        if child is None:
            child = node[last] = ('node', {})
        elif child[0] != 'node':
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        for k, v in expr.items():
            _add_to_tree(child[1], k, v, stage, values)
    else:
        if last in node:
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        node[last] = ('expr', len(values))
        values.append(expr)


_PLAN_CACHE = {}


def compile_add_fields(spec, stage='$addFields'):
    """Compile a $set/$addFields stage into (plan, expressions): the plan is
    a tree {field: ('expr', i) | ('node', subtree)} with dotted paths and
    nested field specs merged; plans are cached by the spec's field names."""
    if not isinstance(spec, dict):
        fail(40272, '%s specification stage must be an object, got %s' % (stage, type_name(spec)))
    if not spec:
        fail(40177, 'Invalid %s :: caused by :: specification must have at least one field'
             % stage)
    flat = True
    for v in spec.values():
        if isinstance(v, dict) and not _is_expression_object(v):
            flat = False
            break
    if flat:
        keys = tuple(spec)
        plan = _PLAN_CACHE.get(keys)
        if plan is not None:
            return plan, list(spec.values())
    tree = {}
    values = []
    for path, expr in spec.items():
        _add_to_tree(tree, path, expr, stage, values)
    if flat:
        if len(_PLAN_CACHE) > 1000:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[keys] = tree
    return tree, values


def _apply_fields(out, tree, vals):
    for k, (kind, x) in tree.items():
        if kind == 'expr':
            v = vals[x]
            if v is MISSING:
                out.pop(k, None)
            else:
                out[k] = v
        else:
            out[k] = _apply_subtree(out.get(k, MISSING), x, vals)


def _apply_subtree(value, tree, vals):
    if isinstance(value, dict):
        out = dict(value)
        _apply_fields(out, tree, vals)
        return out
    if isinstance(value, list):
        return [_apply_subtree(el, tree, vals) for el in value]
    out = {}
    _apply_fields(out, tree, vals)
    return out


def add_fields(doc, compiled, user_vars=None):
    """$addFields/$set: every expression sees the stage's input document;
    the result is a new document (the input is not modified)."""
    tree, exprs = compiled
    parser = ExprParser(doc, user_vars, ignore_missing_keys=True)
    vals = [parser.eval(e) for e in exprs]
    out = dict(doc)
    _apply_fields(out, tree, vals)
    return out


def compile_unset(spec):
    paths = [spec] if isinstance(spec, str) else spec
    if not isinstance(paths, list) or not paths:
        fail(31002, '$unset specification must be a string or an array')
    tree = {}
    for path in paths:
        if not isinstance(path, str):
            fail(31120, '$unset specification must be a string or an array containing only '
                        'string values')
        node = tree
        parts = _path_parts(path)
        for p in parts[:-1]:
            child = node.get(p)
            if child is True:
                break
            if child is None:
                child = node[p] = {}
            node = child
        else:
            node[parts[-1]] = True
    return tree


def _exclude(value, tree):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            t = tree.get(k)
            if t is True:
                continue
            out[k] = _exclude(v, t) if t else v
        return out
    if isinstance(value, list):
        return [_exclude(el, tree) for el in value]
    return value


def replace_root(doc, expr, user_vars=None):
    new = ExprParser(doc, user_vars, ignore_missing_keys=True).eval(expr)
    if not isinstance(new, dict):
        fail(40228, "'replacement document' must evaluate to an object, but resulting value "
                    "was: %s. Type of resulting value: '%s'. Input document: %s"
             % ('MISSING' if new is MISSING else fmt_value(new), type_name(new),
                fmt_value({'_id': doc.get('_id')})))
    return new


def project(doc, spec):
    if not spec:
        fail(51272, '$project specification must have at least one field')
    out = mm_aggregate._handle_project_stage([doc], None, spec)
    return out[0] if out else {}


def compile_update_pipeline(pipeline):
    stages = []
    for stage in pipeline:
        if not isinstance(stage, dict) or len(stage) != 1:
            fail(40323, 'A pipeline stage specification object must contain exactly one field.')
        (name, spec), = stage.items()
        if name in ('$addFields', '$set'):
            stages.append(('set', compile_add_fields(spec, name)))
        elif name == '$unset':
            stages.append(('unset', compile_unset(spec)))
        elif name == '$project':
            if not isinstance(spec, dict):
                fail(15969, '$project specification must be an object')
            stages.append(('project', spec))
        elif name == '$replaceRoot':
            if not isinstance(spec, dict) or 'newRoot' not in spec:
                fail(40231, "no newRoot specified for the $replaceRoot stage")
            stages.append(('replace', spec['newRoot']))
        elif name == '$replaceWith':
            stages.append(('replace', spec))
        else:
            fail(72, '%s is not allowed to be used within an update' % name)
    return stages


_MONGOMOCK_OPERATORS = frozenset(itertools.chain(
    mm_aggregate.arithmetic_operators, mm_aggregate.project_operators,
    mm_aggregate.projection_operators, mm_aggregate.comparison_operators,
    mm_aggregate.date_operators, mm_aggregate.array_operators,
    mm_aggregate.conditional_operators, mm_aggregate.control_flow_operators,
    mm_aggregate.set_operators, mm_aggregate.string_operators,
    mm_aggregate.type_convertion_operators, mm_aggregate.boolean_operators))


def check_expression(expr):
    """Reject unknown expression operators without evaluating anything."""
    if isinstance(expr, list):
        for e in expr:
            check_expression(e)
    elif isinstance(expr, dict):
        for k, v in expr.items():
            if k[:1] == '$':
                if k not in _EXPR_HANDLERS and k not in _MONGOMOCK_OPERATORS:
                    fail(168, "Unrecognized expression '%s'" % k)
                if k == '$literal':
                    continue
            check_expression(v)


def check_update_pipeline(stages):
    for kind, spec in stages:
        if kind == 'set':
            check_expression(spec[1])
        elif kind == 'replace':
            check_expression(spec)
        elif kind == 'project':
            check_expression(list(spec.values()))


def run_update_pipeline(doc, stages, user_vars=None):
    for kind, spec in stages:
        if kind == 'set':
            doc = add_fields(doc, spec, user_vars)
        elif kind == 'unset':
            doc = _exclude(doc, spec)
        elif kind == 'project':
            doc = project(doc, spec)
        else:
            doc = replace_root(doc, spec, user_vars)
    return doc


def _agg_add_fields(coll, db, options):
    compiled = compile_add_fields(options)
    return [add_fields(d, compiled) for d in coll]


def _agg_unset(coll, db, options):
    tree = compile_unset(options)
    return [_exclude(d, tree) for d in coll]


def _agg_replace_root(coll, db, options):
    if not isinstance(options, dict) or 'newRoot' not in options:
        fail(40231, 'no newRoot specified for the $replaceRoot stage')
    return [replace_root(d, options['newRoot']) for d in coll]


def _agg_replace_with(coll, db, options):
    return [replace_root(d, options) for d in coll]


def _agg_sort(coll, db, options):
    if not isinstance(options, dict) or not options:
        fail(15976, '$sort stage must have at least one sort key')
    return sort_docs(coll, _sort_items(options))


# $group (DocumentSourceGroup, src/mongo/db/pipeline/document_source_group.cpp and the
# accumulators in src/mongo/db/pipeline/accumulator_*.cpp).

# Accumulators the test server implements; the others MongoDB 6.0 has are refused with 238.
_GROUP_ACCUMULATORS = frozenset((
    '$sum', '$avg', '$min', '$max', '$first', '$last', '$push', '$addToSet', '$mergeObjects',
    '$count'))
_GROUP_ACCUMULATORS_UNSUPPORTED = frozenset((
    '$stdDevPop', '$stdDevSamp', '$top', '$bottom', '$topN', '$bottomN', '$firstN', '$lastN',
    '$maxN', '$minN', '$accumulator'))


def compile_group(spec):
    """[(field, accumulator, operand)] of a $group specification, checked as
    AccumulationStatement::parseAccumulationStatement does."""
    if not isinstance(spec, dict):
        fail(15947, "a group's fields must be specified in an object")
    if '_id' not in spec:
        fail(15955, 'a group specification must include an _id')
    accs = []
    for name, acc in spec.items():
        if name == '_id':
            continue
        if not isinstance(acc, dict) or not acc or next(iter(acc))[:1] != '$':
            fail(40234, "The field '%s' must be an accumulator object" % name)
        if '.' in name:
            fail(40235, "The field name '%s' cannot contain '.'" % name)
        if name[:1] == '$':
            fail(40236, "The field name '%s' cannot be an operator name" % name)
        if len(acc) != 1:
            fail(40238, "The field '%s' must specify one accumulator" % name)
        (op, operand), = acc.items()
        if isinstance(operand, list):
            fail(40237, 'The %s accumulator is a unary operator' % op)
        if op in _GROUP_ACCUMULATORS_UNSUPPORTED:
            fail(238, 'the %s accumulator is not supported by the test server' % op)
        if op not in _GROUP_ACCUMULATORS:
            fail(15952, "unknown group operator '%s'" % op)
        if op == '$count':
            if operand != {}:
                fail(14, '$count takes no arguments, i.e. $count:{}')
            op, operand = '$sum', 1
        check_expression(operand)
        accs.append((name, op, operand))
    check_expression(spec['_id'])
    return accs


def _accumulate(op, values):
    """The result of one accumulator over the operand values of a group's documents, in
    input order (MISSING where the operand evaluated to missing)."""
    if op == '$sum':
        return sum_numbers(values)
    if op == '$avg':
        return avg_numbers(values)
    if op == '$min':
        return bson_min_max(values, False)
    if op == '$max':
        return bson_min_max(values, True)
    if op in ('$first', '$last'):
        # AccumulatorFirst/Last keep the value of the first/last document as it is, missing
        # included, and a missing value comes out as null.
        v = values[0] if op == '$first' else values[-1]
        return None if v is MISSING else v
    if op == '$push':
        return [v for v in values if v is not MISSING]
    if op == '$addToSet':
        seen = set()
        out = []
        for v in values:
            if v is MISSING:
                continue
            h = hkey(v)
            if h not in seen:
                seen.add(h)
                out.append(v)
        return out
    # $mergeObjects
    out = {}
    for v in values:
        if nullish(v):
            continue
        if not isinstance(v, dict):
            fail(40400, '$mergeObjects requires object inputs, but input %s is of type %s'
                 % (fmt_value(v), type_name(v)))
        out.update(v)
    return out


def _agg_group(coll, db, options):
    """$group: documents are grouped by the BSON value of _id (numbers of different types
    that are equal are one group; missing is null), each accumulator sees its operand for
    every document of the group in input order.  MongoDB gives groups in no particular
    order; this server gives them sorted by _id."""
    accs = compile_group(options)
    id_expr = options['_id']
    groups = {}
    for doc in coll:
        parser = ExprParser(doc, ignore_missing_keys=True)
        key = parser.eval(id_expr)
        if key is MISSING:
            key = None
        h = hkey(key)
        group = groups.get(h)
        if group is None:
            group = groups[h] = (key, [[] for _ in accs])
        for (_, _, operand), values in zip(accs, group[1]):
            values.append(parser.eval(operand))
    out = []
    for key, values in groups.values():
        doc = {'_id': key}
        for (name, op, _), vals in zip(accs, values):
            doc[name] = _accumulate(op, vals)
        out.append(doc)
    if len(out) > 1:
        out.sort(key=functools.cmp_to_key(lambda a, b: bson_cmp(a['_id'], b['_id'])))
    return out


def _unwind_options(options):
    if isinstance(options, str):
        path, preserve, index_field = options, False, None
    elif isinstance(options, dict):
        path = preserve = index_field = None
        for k, v in options.items():
            if k == 'path':
                if not isinstance(v, str):
                    fail(28808, 'expected a string as the path for $unwind stage, got %s'
                         % type_name(v))
                path = v
            elif k == 'preserveNullAndEmptyArrays':
                if not isinstance(v, bool):
                    fail(28809, 'expected a boolean for the preserveNullAndEmptyArrays option '
                                'to $unwind stage, got %s' % type_name(v))
                preserve = v
            elif k == 'includeArrayIndex':
                if not isinstance(v, str) or not v:
                    fail(28810, 'expected a non-empty string for the includeArrayIndex option '
                                'to $unwind stage, got %s' % type_name(v))
                if v[0] == '$':
                    fail(28822, "includeArrayIndex option to $unwind stage should not be "
                                "prefixed with a '$': %s" % v)
                index_field = v
            else:
                fail(28811, 'unrecognized option to $unwind stage: %s' % k)
        if path is None:
            fail(28812, 'no path specified to $unwind stage')
    else:
        fail(15981, 'expected either a string or an object as specification for $unwind '
                    'stage, got %s' % type_name(options))
    if path[:1] != '$':
        fail(28818, "path option to $unwind stage should be prefixed with a '$': %s" % path)
    return (_path_parts(path[1:]), bool(preserve),
            _path_parts(index_field) if index_field else None)


def _get_nested(doc, parts):
    """Document::getNestedField: through sub-documents only (an array on the way is
    missing)."""
    value = doc
    for part in parts:
        if not isinstance(value, dict):
            return MISSING
        value = value.get(part, MISSING)
    return value


def _set_nested(doc, parts, value):
    """A copy of doc with the path set (value MISSING: removed); the containers on the path
    are copied, the rest is shared."""
    out = dict(doc)
    head = parts[0]
    if len(parts) == 1:
        if value is MISSING:
            out.pop(head, None)
        else:
            out[head] = value
        return out
    child = out.get(head)
    if not isinstance(child, dict):
        if value is MISSING:
            return out
        child = {}
    out[head] = _set_nested(child, parts[1:], value)
    return out


def _agg_unwind(coll, db, options):
    """$unwind (src/mongo/db/pipeline/document_source_unwind.cpp): one document per element
    of the array at the path; a value that is neither an array nor null/missing is taken as
    a one-element array; includeArrayIndex is an Int64 (null where there was no array)."""
    parts, preserve, index_parts = _unwind_options(options)
    out = []
    for doc in coll:
        value = _get_nested(doc, parts)
        if isinstance(value, list) and value:
            for i, el in enumerate(value):
                new = _set_nested(doc, parts, el)
                if index_parts:
                    new = _set_nested(new, index_parts, Int64(i))
                out.append(new)
            continue
        if isinstance(value, list):
            if not preserve:
                continue
            new = _set_nested(doc, parts, MISSING)
        elif nullish(value):
            if not preserve:
                continue
            new = doc
        else:
            new = doc
        if index_parts:
            new = _set_nested(new, index_parts, None)
        out.append(new)
    return out


def _install_mongomock_fixes():
    """Route mongomock's aggregation, filtering and update code through the
    MongoDB-faithful pieces above."""
    mm_aggregate._Parser = ExprParser
    mm_filtering.register_parse_expression(_expr_for_match)
    mm_aggregate._PIPELINE_HANDLERS.update({
        '$addFields': _agg_add_fields,
        '$set': _agg_add_fields,
        '$unset': _agg_unset,
        '$replaceRoot': _agg_replace_root,
        '$replaceWith': _agg_replace_with,
        '$sort': _agg_sort,
        '$group': _agg_group,
        '$unwind': _agg_unwind,
    })
    mm_aggregate._GROUPING_OPERATOR_MAP.update({
        '$sum': sum_numbers,
        '$avg': avg_numbers,
        '$min': lambda values: bson_min_max(values, False),
        '$max': lambda values: bson_min_max(values, True),
    })

    def bson_compare(op, a, b, can_compare_types=True):
        ca, cb = canon(a), canon(b)
        if ca != cb:
            return can_compare_types and op(ca, cb)
        return op(bson_cmp(a, b), 0)
    mm_filtering.bson_compare = bson_compare
    mm_filtering._get_compare_type = canon

    mm_collection._updaters.update({
        '$set': _set_updater,
        '$inc': _inc_updater,
        '$mul': _mul_updater,
        '$min': _min_updater,
        '$max': _max_updater,
    })
    mm_collection._set_updater = _set_updater
    mongomock.SERVER_VERSION = SERVER_VERSION


# Classic update operators mongomock gets wrong for BSON types.

def _set_updater(doc, field_name, value):
    if isinstance(doc, dict):
        doc[field_name] = value
    elif isinstance(doc, list):
        i = int(field_name)
        if i < 0:
            raise WriteError('Negative index provided', 2)
        if i >= len(doc):
            doc.extend([None] * (i + 1 - len(doc)))
        doc[i] = value


def _arith_updater(op, combine, missing):
    def updater(doc, field_name, value):
        if not is_number(value):
            raise WriteError('Cannot %s with non-numeric argument: {%s: %s}'
                             % ('increment' if op == '$inc' else 'multiply', field_name,
                                fmt_value(value)), 14)
        if isinstance(doc, dict):
            container, key, present = doc, field_name, field_name in doc
        elif isinstance(doc, list):
            key = int(field_name)
            if key < 0:
                raise WriteError('Negative index provided', 2)
            if key >= len(doc):
                doc.extend([None] * (key + 1 - len(doc)))
            container, present = doc, doc[key] is not None
        else:
            return
        if not present:
            container[key] = missing(value)
            return
        cur = container[key]
        if not is_number(cur):
            raise WriteError('Cannot apply %s to a value of non-numeric type. The field \'%s\' '
                             'has non-numeric type %s' % (op, field_name, type_name(cur)), 14)
        container[key] = combine(cur, value)
    return updater


_inc_updater = _arith_updater('$inc', lambda a, b: num_sum([a, b]), lambda v: v)
_mul_updater = _arith_updater('$mul', lambda a, b: num_mul([a, b]),
                              lambda v: num_mul([v, 0]))


def _min_updater(doc, field_name, value):
    if isinstance(doc, dict):
        if field_name not in doc or bson_cmp(value, doc[field_name]) < 0:
            doc[field_name] = value


def _max_updater(doc, field_name, value):
    if isinstance(doc, dict):
        if field_name not in doc or bson_cmp(value, doc[field_name]) > 0:
            doc[field_name] = value


CLASSIC_UPDATE_OPERATORS = frozenset([
    '$set', '$unset', '$inc', '$mul', '$min', '$max', '$rename', '$setOnInsert',
    '$currentDate', '$addToSet', '$pull', '$pullAll', '$push', '$pop'])


# --------------------------------------------------------------------------
# Collections
# --------------------------------------------------------------------------

def id_key(value):
    """The key mongomock stores a document under."""
    if isinstance(value, dict):
        return mm_helpers.hashdict(value)
    return value


_NO_FAST = object()


def _fast_id_key(spec):
    """(store key, _id value) when the filter pins _id to one value, else _NO_FAST."""
    if not isinstance(spec, dict) or '_id' not in spec:
        return _NO_FAST
    v = spec['_id']
    if isinstance(v, dict) and v:
        first = next(iter(v))
        if first[:1] == '$':
            if len(v) == 1 and first == '$eq':
                v = v['$eq']
            else:
                return _NO_FAST
    if v is None or isinstance(v, (list, Regex, _RE_PATTERN, float)):
        return _NO_FAST
    try:
        k = id_key(v)
        hash(k)
    except TypeError:
        return _NO_FAST
    return k, v


def _index_key_values(doc, field):
    out = []
    found = False
    for v in mm_filtering.iter_key_candidates(field, doc):
        if v is NOTHING:
            continue
        found = True
        if isinstance(v, list):
            if v:
                out.extend(v)
            else:
                out.append(MISSING)
        else:
            out.append(v)
    return found, out or [None]


class _UniqueIndex(object):
    """A unique secondary index: key -> ids of the documents holding it.

    Entries may go stale when documents are deleted or replaced; a conflict
    is only reported after re-checking the other document."""
    __slots__ = ('name', 'fields', 'pattern', 'sparse', 'pfe', 'by_key', 'by_id')

    def __init__(self, name, info):
        self.name = name
        self.fields = [f for f, _ in info['key']]
        self.pattern = dict(info['key'])
        self.sparse = bool(info.get('sparse'))
        self.pfe = info.get('partialFilterExpression')
        self.by_key = {}
        self.by_id = {}

    def keys_of(self, doc):
        """{hashable key: tuple of field values} of one document."""
        if self.pfe is not None and not mm_filtering.filter_applies(self.pfe, doc):
            return {}
        per_field = []
        any_found = False
        for f in self.fields:
            found, vals = _index_key_values(doc, f)
            any_found = any_found or found
            per_field.append([(hkey(v), v) for v in vals])
        if self.sparse and not any_found:
            return {}
        out = {}
        for combo in itertools.product(*per_field):
            out[tuple(h for h, _ in combo)] = tuple(v for _, v in combo)
        return out

    def add(self, idk, keys):
        old = self.by_id.get(idk, frozenset())
        new = frozenset(keys)
        for k in old - new:
            s = self.by_key.get(k)
            if s is not None:
                s.discard(idk)
                if not s:
                    del self.by_key[k]
        for k in new - old:
            self.by_key.setdefault(k, set()).add(idk)
        if new:
            self.by_id[idk] = new
        else:
            self.by_id.pop(idk, None)


class _UniqueState(object):
    __slots__ = ('documents', 'sig', 'indexes')


def _unique_specs(store):
    return [(name, info) for name, info in store.indexes.items() if info.get('unique')]


class FastCollection(mm_collection.Collection):
    """mongomock's Collection with an O(1) path for _id equality, hashed
    unique indexes, and copy-on-write storage: a stored document object is
    never modified in place once stored, so cursors and update pipelines can
    share it safely."""

    _cow = False
    _cow_originals = None
    # What _insert is doing, for the error MongoDB gives a document over 16 MiB: a plain
    # insert or the insert half of an upsert.
    _insert_kind = 'insert'
    # bypassDocumentValidation of the command being run.
    _bypass_validation = False
    # The rewrite-cost counters of this collection ([document bytes written by updates,
    # documents written by updates]; Backend.coll gives each collection its own) and the
    # BSON size check_write last measured.
    _write_stats = None
    _checked_size = 0

    def note_update_write(self):
        """An update statement wrote the document check_write last measured: a modified
        document, or the document an upsert inserted.  MongoDB's storage engine writes a
        changed document whole, so its size is the cost of the update."""
        stats = self._write_stats
        if stats is not None:
            stats[0] += self._checked_size
            stats[1] += 1

    def _docs(self):
        store = self._store
        if store._ttl_indexes:
            store._remove_expired_documents()
        return store._documents

    def _iter_documents(self, filter):
        docs = self._docs()
        fast = _fast_id_key(filter)
        if fast is not _NO_FAST:
            doc = docs.get(fast[0])
            # Python's 1 == True must not make a number _id match a boolean.
            if doc is None or isinstance(doc['_id'], bool) != isinstance(fast[1], bool):
                matches = []
            elif len(filter) == 1 or mm_filtering.filter_applies(filter, doc):
                matches = [doc]
            else:
                matches = []
        else:
            if not docs:
                mm_filtering.filter_applies(filter, {})
                matches = []
            else:
                matches = (d for d in list(docs.values())
                           if mm_filtering.filter_applies(filter, d))
        if self._cow:
            return self._copy_on_write(matches)
        return iter(matches)

    def _copy_on_write(self, matches):
        docs = self._docs()
        originals = self._cow_originals
        for doc in matches:
            mine = copy.deepcopy(doc)
            idk = id_key(doc['_id'])
            if originals is not None:
                originals.setdefault(idk, doc)
            docs[idk] = mine
            yield mine

    def _update(self, *args, **kwargs):
        # mongomock's classic update loop: documents are copied before they change, and the
        # originals are kept so that a document refused after the change (too large, failing
        # validation) can be put back, as MongoDB never stores it.
        self._cow = True
        self._cow_originals = {}
        try:
            return super(FastCollection, self)._update(*args, **kwargs)
        finally:
            self._cow = False
            self._cow_originals = None

    def _insert(self, data, session=None, ordered=True):
        if not isinstance(data, dict):
            return [self._insert(d) for d in data]
        for k in data:
            if not isinstance(k, str):
                raise WriteError('Document keys must be strings', 2)
        if '_id' not in data:
            data = dict(itertools.chain((('_id', ObjectId()),), data.items()))
        elif next(iter(data)) != '_id':
            data = dict(itertools.chain((('_id', data['_id']),),
                                        ((k, v) for k, v in data.items() if k != '_id')))
        _id = data['_id']
        if isinstance(_id, list):
            raise WriteError("The '_id' value cannot be of type array", 53)
        if isinstance(_id, (Regex, _RE_PATTERN)):
            raise WriteError("can't use a regex for _id", 2)
        docs = self._docs()
        k = id_key(_id)
        if k in docs:
            raise self._dup_error('_id_', {'_id': 1}, {'_id': _id})
        self.check_write(data, self._insert_kind)
        docs[k] = data
        try:
            self.add_uniques(data)
        except DuplicateKeyError:
            del docs[k]
            raise
        if self._insert_kind == 'upsert':
            self.note_update_write()
        # A collection stays when its last document is deleted.
        self._store._is_force_created = True
        return _id

    def _dup_error(self, index_name, pattern, value):
        msg = 'E11000 duplicate key error collection: %s index: %s dup key: %s' % (
            self.full_name, index_name, fmt_value(value))
        return DupKeyError(msg, pattern, value)

    def _unique_state(self):
        store = self._store
        specs = _unique_specs(store)
        if not specs:
            return None
        sig = tuple((name, id(info)) for name, info in specs)
        st = getattr(store, '_bd_unique', None)
        if st is None or st.documents is not store._documents or st.sig != sig:
            st = _UniqueState()
            st.documents = store._documents
            st.sig = sig
            st.indexes = [_UniqueIndex(name, info) for name, info in specs]
            for idk, doc in store._documents.items():
                for ix in st.indexes:
                    ix.add(idk, ix.keys_of(doc))
            store._bd_unique = st
        return st

    def _ensure_uniques(self, new_data):
        """mongomock calls this for every document its classic update loop changed: the
        place to refuse what MongoDB would refuse, and to restore the original if so."""
        if self._cow:
            idk = id_key(new_data['_id'])
            old = (self._cow_originals or {}).get(idk)
            try:
                self.check_write(new_data, 'update', old)
            except Exception:
                if old is not None:
                    self._docs()[idk] = old
                raise
        self.add_uniques(new_data)
        if self._cow:
            self.note_update_write()

    def check_write(self, doc, kind, old=None):
        """Refuse a document MongoDB would not store: over 16 MiB of BSON, or failing the
        collection's validator.  kind: 'insert', 'upsert' (the insert of an upsert) or
        'update' (old is then the document before the update)."""
        size = bson_size(doc)
        if size > MAX_BSON_SIZE:
            raise WriteError(*_too_large(kind, size))
        self._checked_size = size
        options = getattr(self._store, '_bd_options', None)
        if options and options.get('validator') and not self._bypass_validation:
            _check_validator(self.full_name, options, doc, kind, old)

    def add_uniques(self, new_data):
        st = self._unique_state()
        if st is None:
            return
        docs = self._docs()
        idk = id_key(new_data['_id'])
        new_keys = []
        for ix in st.indexes:
            keys = ix.keys_of(new_data)
            for k, values in keys.items():
                for other in ix.by_key.get(k, ()):
                    if other == idk:
                        continue
                    odoc = docs.get(other)
                    if odoc is not None and k in ix.keys_of(odoc):
                        raise self._dup_error(ix.name, ix.pattern, dict(zip(ix.fields, values)))
            new_keys.append(keys)
        for ix, keys in zip(st.indexes, new_keys):
            ix.add(idk, keys)

    def delete_matching(self, spec, just_one):
        docs = self._docs()
        matches = self._iter_documents(spec)
        n = 0
        for doc in matches:
            del docs[id_key(doc['_id'])]
            n += 1
            if just_one:
                break
        return n


class DupKeyError(DuplicateKeyError):
    """A duplicate key, with the index pattern and value MongoDB reports."""

    def __init__(self, msg, pattern, value):
        DuplicateKeyError.__init__(self, msg, 11000)
        self.key_pattern = pattern
        self.key_value = value

    def key_fields(self):
        if getattr(self, 'key_pattern', None) is None:
            return {}
        return {'keyPattern': self.key_pattern, 'keyValue': self.key_value}


# --------------------------------------------------------------------------
# What MongoDB refuses to store: documents over 16 MiB, documents failing validation
# --------------------------------------------------------------------------

# BSON bytes of a value after its type byte and key, for the types of fixed size.
_FIXED_SIZE = {float: 8, bool: 1, datetime.datetime: 8, Int64: 8, type(None): 0,
               ObjectId: 12, Decimal128: 16, Timestamp: 8, MinKey: 0, MaxKey: 0}

# BSON sizes of arrays and of the documents inside arrays (bucket readings), by identity, and
# how arrays made by $concatArrays and $sortArray were made (from which arrays): the size of
# an appended readings array is then the stored array's size plus the new readings', not a
# walk over every reading.  Stored documents are never modified in place (FastCollection is
# copy-on-write, update pipelines build new containers), and an entry holds its object, so an
# id cannot be reused while its entry lives.  What the entries keep alive after the documents
# let go of it (older versions of a readings array, dropped collections) is bounded: both
# tables are emptied when the memory they hold, roughly counted, passes a budget, and when a
# collection or database is dropped.
_SIZE_MEMO = {}
_LIST_PARTS = {}
_MEMO_BUDGET = 128 * 1024 * 1024
_memo_bytes = [0]


def clear_size_memo():
    _SIZE_MEMO.clear()
    _LIST_PARTS.clear()
    _memo_bytes[0] = 0


def _memo_pin(obj):
    """Account for keeping obj (a dict or a list) alive; empties the tables when full."""
    cost = 64 + (40 if type(obj) is dict else 8) * len(obj)
    if _memo_bytes[0] + cost > _MEMO_BUDGET:
        clear_size_memo()
    _memo_bytes[0] += cost


def note_list_parts(out, parts):
    """out is a new array holding the elements of parts (concatenated, or one array
    reordered); for bson_size."""
    if len(out) > 64:
        for part in parts:
            _memo_pin(part)
        _LIST_PARTS[id(out)] = (out, parts)


def _index_keys_size(n):
    """Bytes of the keys "0", "1", ... "n-1" of an n-element BSON array, with their type
    bytes and NULs."""
    total = 2 * n
    digits, start = 1, 0
    while start < n:
        end = min(n, 10 ** digits)
        total += digits * (end - start)
        start, digits = end, digits + 1
    return total


def _list_size(v):
    hit = _SIZE_MEMO.get(id(v))
    if hit is not None and hit[0] is v:
        return hit[1]
    total = 5 + _index_keys_size(len(v))
    src = _LIST_PARTS.get(id(v))
    if src is not None and src[0] is v:
        for part in src[1]:
            total += _list_size(part) - 5 - _index_keys_size(len(part))
    else:
        memo = _SIZE_MEMO
        for e in v:
            if type(e) is dict:
                hit = memo.get(id(e))
                if hit is not None and hit[0] is e:
                    total += hit[1]
                    continue
                size = bson_size(e)
                _memo_pin(e)
                memo[id(e)] = (e, size)
                total += size
            else:
                total += _value_size(e)
    if len(v) > 64:
        _memo_pin(v)
        _SIZE_MEMO[id(v)] = (v, total)
    return total


def _value_size(v):
    t = type(v)
    size = _FIXED_SIZE.get(t)
    if size is not None:
        return size
    if t is str:
        return (len(v) if v.isascii() else len(v.encode('utf-8', 'surrogatepass'))) + 5
    if t is int:
        return 4 if INT32_MIN <= v <= INT32_MAX else 8
    if t is dict:
        return bson_size(v)
    if t is list:
        return _list_size(v)
    # Anything else (binary, regex, code, ...): let the encoder say.
    return len(bson.encode({'': v})) - 7


def bson_size(doc):
    """len(bson.encode(doc)) for a stored document, without encoding it (this bson has no C
    extension here: encoding a bucket of 3600 readings takes ~13 ms, this ~0.5 ms)."""
    total = 5
    for k, v in doc.items():
        total += (len(k) if k.isascii() else len(k.encode('utf-8', 'surrogatepass'))) + 2
        total += _value_size(v)
    return total


def _too_large(kind, size):
    """(message, code) for a document of size bytes over the 16 MiB limit.

    As mongod 6.0 words them: src/mongo/db/exec/update_stage.cpp (17419, an update of an
    existing document: "Resulting document after update is larger than 16777216"),
    src/mongo/db/exec/upsert_stage.cpp (17420, the document an upsert inserts: "Document to
    upsert is larger than 16777216"), src/mongo/db/ops/insert.cpp fixDocumentForInsert
    (BadValue, an insert: "object to insert too large. size in bytes: N, max size: 16777216").
    Newer servers (8.x, src/mongo/db/update/update_util.cpp) answer an update with
    BSONObjectTooLarge (10334) and the same message."""
    if kind == 'update':
        return 'Resulting document after update is larger than %d' % MAX_BSON_SIZE, 17419
    if kind == 'upsert':
        return 'Document to upsert is larger than %d' % MAX_BSON_SIZE, 17420
    return ('object to insert too large. size in bytes: %d, max size: %d'
            % (size, MAX_BSON_SIZE), 2)


class DocumentValidationError(WriteError):
    """A write refused by the collection's validator (code 121, DocumentValidationFailure)."""

    def __init__(self, doc_id, details):
        WriteError.__init__(self, 'Document failed validation', 121)
        self.err_info = {'failingDocumentId': doc_id, 'details': details}


VALIDATION_LEVELS = ('off', 'strict', 'moderate')
VALIDATION_ACTIONS = ('error', 'warn')


def _check_validator(ns, options, doc, kind, old):
    """Apply a collection's validator the way mongod does (validationLevel: "strict" checks
    every insert and update, "moderate" skips updates of documents that were already invalid,
    "off" nothing; validationAction "warn" logs and lets the write through)."""
    level = options.get('validationLevel', 'strict')
    if level == 'off':
        return
    validator = options['validator']
    if level == 'moderate' and kind == 'update' and old is not None and \
            not validator_matches(validator, old):
        return
    if validator_matches(validator, doc):
        return
    if options.get('validationAction', 'error') == 'warn':
        sys.stderr.write('mongo_server: %s: document %s failed validation (validationAction '
                         'warn: written anyway)\n' % (ns, fmt_value(doc.get('_id'))))
        return
    # mongod explains which rule failed in errInfo.details; this test server only names the
    # validator, which is enough for a client that logs it.
    raise DocumentValidationError(doc.get('_id'), {'operatorName': '$and',
                                                   'specifiedAs': validator})


def validator_matches(validator, doc):
    """True if doc passes a validator: query operators (through mongomock's matcher) and a
    top-level $jsonSchema (the subset in _schema_ok)."""
    rest = validator
    if '$jsonSchema' in validator:
        if not _schema_ok(validator['$jsonSchema'], doc):
            return False
        rest = {k: v for k, v in validator.items() if k != '$jsonSchema'}
    return not rest or mm_filtering.filter_applies(rest, doc)


_SCHEMA_KEYWORDS = frozenset((
    'bsonType', 'type', 'required', 'properties', 'additionalProperties', 'minimum', 'maximum',
    'exclusiveMinimum', 'exclusiveMaximum', 'enum', 'minLength', 'maxLength', 'pattern',
    'items', 'minItems', 'maxItems', 'minProperties', 'maxProperties', 'title', 'description'))

# $jsonSchema "type" names (JSON Schema) and the bsonType names they stand for.
_JSON_TYPES = {'object': ('object',), 'array': ('array',), 'string': ('string',),
               'boolean': ('bool',), 'null': ('null',),
               'number': ('int', 'long', 'double', 'decimal')}


def check_json_schema(schema, path='$jsonSchema'):
    """Refuse a $jsonSchema this test server cannot evaluate (rather than ignore it)."""
    if not isinstance(schema, dict):
        raise CommandError(14, '%s must be an object' % path)
    unknown = set(schema) - _SCHEMA_KEYWORDS
    if unknown:
        raise CommandError(238, '$jsonSchema keyword %s is not supported by the test server'
                           % sorted(unknown)[0])
    for name, sub in (schema.get('properties') or {}).items():
        check_json_schema(sub, '%s.properties.%s' % (path, name))
    if isinstance(schema.get('items'), dict):
        check_json_schema(schema['items'], path + '.items')
    if isinstance(schema.get('additionalProperties'), dict):
        check_json_schema(schema['additionalProperties'], path + '.additionalProperties')


def _schema_types(schema):
    names = []
    for key in ('bsonType', 'type'):
        v = schema.get(key)
        if v is None:
            continue
        for t in (v if isinstance(v, list) else [v]):
            if key == 'type':
                names.extend(_JSON_TYPES.get(t, (t,)))
            elif t == 'number':
                names.extend(_JSON_TYPES['number'])
            else:
                names.append(t)
    return names


def _schema_ok(schema, value):
    """$jsonSchema keywords MongoDB implements, on one value (a missing field is never
    checked: only "required" asks for presence)."""
    types = _schema_types(schema)
    if types and type_name(value) not in types:
        return False
    if 'enum' in schema and not any(bson_eq(value, e) for e in schema['enum']):
        return False
    if is_number(value):
        v = _num_value(value)
        if 'minimum' in schema and (v < schema['minimum'] or (
                schema.get('exclusiveMinimum') is True and v == schema['minimum'])):
            return False
        if 'maximum' in schema and (v > schema['maximum'] or (
                schema.get('exclusiveMaximum') is True and v == schema['maximum'])):
            return False
    if isinstance(value, str):
        n = len(value)
        if n < schema.get('minLength', 0) or n > schema.get('maxLength', n):
            return False
        if 'pattern' in schema and not re.search(schema['pattern'], value):
            return False
    if isinstance(value, list):
        n = len(value)
        if n < schema.get('minItems', 0) or n > schema.get('maxItems', n):
            return False
        items = schema.get('items')
        if isinstance(items, dict) and not all(_schema_ok(items, x) for x in value):
            return False
    if isinstance(value, dict):
        n = len(value)
        if n < schema.get('minProperties', 0) or n > schema.get('maxProperties', n):
            return False
        if any(k not in value for k in schema.get('required', ())):
            return False
        props = schema.get('properties') or {}
        for k, sub in props.items():
            if k in value and not _schema_ok(sub, value[k]):
                return False
        extra = schema.get('additionalProperties', True)
        if extra is not True:
            for k, v in value.items():
                if k in props:
                    continue
                if extra is False or (isinstance(extra, dict) and not _schema_ok(extra, v)):
                    return False
    return True


class _DbView(object):
    """What mongomock's $lookup/$out stages need from a database."""

    def __init__(self, backend, db):
        self._backend = backend
        self.name = db

    def get_collection(self, name):
        return self._backend.coll(self.name, name)

    __getitem__ = get_collection


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------

class CommandError(Exception):
    def __init__(self, code, msg, **extra):
        Exception.__init__(self, msg)
        self.code = code
        self.msg = msg
        self.extra = extra


def error_reply(code, msg, **extra):
    doc = {'ok': 0.0, 'errmsg': msg, 'code': code, 'codeName': code_name(code)}
    doc.update(extra)
    return doc


def _write_error_entry(index, exc):
    """Turn an exception raised while applying one write into a writeErrors entry."""
    if isinstance(exc, DuplicateKeyError):
        entry = {'index': index, 'code': 11000, 'errmsg': str(exc)}
        if isinstance(exc, DupKeyError):
            entry.update(exc.key_fields())
        return entry
    if isinstance(exc, OperationFailure):
        code = exc.code
        msg = str(exc)
        if not code:
            code = 66 if "(immutable) field '_id'" in msg else 2
        entry = {'index': index, 'code': code, 'errmsg': msg}
        if getattr(exc, 'err_info', None) is not None:
            entry['errInfo'] = exc.err_info
        return entry
    if isinstance(exc, CommandError):
        return {'index': index, 'code': exc.code, 'errmsg': exc.msg}
    if isinstance(exc, NotImplementedError):
        return {'index': index, 'code': 238,
                'errmsg': 'not supported by the test server: %s' % exc}
    if isinstance(exc, bson.errors.InvalidDocument):
        return {'index': index, 'code': 2, 'errmsg': str(exc)}
    return {'index': index, 'code': 2, 'errmsg': '%s: %s' % (type(exc).__name__, exc)}


_DB_NAME_BAD = re.compile(r'[/\\. "$\x00]')


def _check_db_name(db):
    if not isinstance(db, str) or not db or _DB_NAME_BAD.search(db) or len(db) >= 64:
        raise CommandError(73, 'Invalid database name: \'%s\'' % (db,))


def _check_coll_name(db, name):
    if not isinstance(name, str):
        raise CommandError(73, 'collection name has invalid type %s' % type_name(name))
    if not name or '\x00' in name or name.startswith('.') or (
            '$' in name and not name.startswith('oplog.$')):
        raise CommandError(73, 'Invalid namespace specified \'%s.%s\'' % (db, name))


class _Cursor(object):
    __slots__ = ('id', 'ns', 'docs', 'pos', 'used')


def _as_int(v, field, minimum=None):
    if v is None:
        return None
    if not is_number(v) or isinstance(v, Decimal128):
        raise CommandError(14, "BSON field '%s' is the wrong type '%s', expected types "
                               "'[long, int, decimal, double]'" % (field, type_name(v)))
    n = int(v)
    if minimum is not None and n < minimum:
        raise CommandError(51024, "BSON field '%s' value must be >= %d, actual value '%d'"
                           % (field, minimum, n))
    return n


def _upsert_seed(coll, spec):
    """The document an upsert starts from: the equality fields of the filter
    (including those inside a top-level $and)."""
    flat = {}
    for k, v in spec.items():
        if k == '$and' and isinstance(v, list):
            for clause in v:
                if isinstance(clause, dict):
                    flat.update((ck, cv) for ck, cv in clause.items() if ck[:1] != '$')
        else:
            flat[k] = v
    seed = coll._discard_operators(coll._expand_dots(flat))[0]
    if not isinstance(seed, dict):
        return {}
    return dict(seed)


# --------------------------------------------------------------------------
# Sharded mode (--sharded KEYSPEC): mongos's targeting rule for upserts
# --------------------------------------------------------------------------

SHARD_KEY_MSG = 'Failed to target upsert by query :: could not extract exact shard key'


def parse_shard_key(spec):
    """'sensor_id:hashed' or 'sensor_id:1,bucket_start:1' -> [(path, 1 | 'hashed')], checked
    as src/mongo/s/shard_key_pattern.cpp parseShardKeyPattern checks a key pattern: non-empty
    dotted paths without empty parts, each 1 or "hashed", at most one hashed field."""
    fields = []
    for item in spec.split(','):
        path, sep, kind = item.strip().rpartition(':')
        if not sep:
            path, kind = kind, '1'
        if not path or any(not part for part in path.split('.')) or path[:1] == '$':
            raise ValueError('bad shard key field %r' % item)
        if kind == '1':
            kind = 1
        elif kind != 'hashed':
            raise ValueError('shard key field %r: give 1 or hashed' % item)
        if any(path == p for p, _ in fields):
            raise ValueError('shard key field %r given twice' % path)
        fields.append((path, kind))
    if not fields:
        raise ValueError('empty shard key')
    if sum(1 for _, kind in fields if kind == 'hashed') > 1:
        raise ValueError('a shard key has at most one hashed field')
    return fields


class _NoShardKey(Exception):
    pass


def _is_prefix(a, b):
    """Dotted path a is b or a parent of b."""
    return a == b or b.startswith(a + '.')


def _add_equality(path, value, key_paths, out):
    """pathsupport::extractFullEqualityMatches for one equality: paths unrelated to the
    shard key are ignored; one below a key field ('a.b' for key 'a') does not give the
    whole value; two equalities on one path, or on a path and its parent, conflict."""
    related = [k for k in key_paths if _is_prefix(path, k) or _is_prefix(k, path)]
    if not related:
        return
    if any(not _is_prefix(path, k) for k in related):
        raise _NoShardKey()
    for other in out:
        if _is_prefix(other, path) or _is_prefix(path, other):
            raise _NoShardKey()
    out[path] = value


def _in_single_value(values):
    """The one value of an $in the query optimiser turns into an equality
    (InMatchExpression's optimizer: one distinct value and no regex), else MISSING."""
    if not isinstance(values, list) or not values:
        return MISSING
    first = values[0]
    for v in values:
        if isinstance(v, (Regex, _RE_PATTERN)) or canon(v) != canon(first) or \
                bson_cmp(v, first) != 0:
            return MISSING
    return first


def _collect_equalities(query, key_paths, out):
    """The equalities of a filter that mongos's canonical query holds at its top level or
    under $and: {f: value} (a value that is no operator object and no regex) and
    {f: {$eq: value, ...}}; also a one-value $in and a one-clause $or, which the
    canonicaliser rewrites into those."""
    for k, v in query.items():
        if k == '$and':
            if isinstance(v, list):
                for clause in v:
                    if isinstance(clause, dict):
                        _collect_equalities(clause, key_paths, out)
        elif k == '$or':
            if isinstance(v, list) and len(v) == 1 and isinstance(v[0], dict):
                _collect_equalities(v[0], key_paths, out)
        elif k[:1] == '$':
            continue
        elif isinstance(v, dict) and v and next(iter(v))[:1] == '$':
            if '$eq' in v:
                _add_equality(k, v['$eq'], key_paths, out)
            if '$in' in v:
                one = _in_single_value(v['$in'])
                if one is not MISSING:
                    _add_equality(k, one, key_paths, out)
        elif not isinstance(v, (Regex, _RE_PATTERN)):
            _add_equality(k, v, key_paths, out)


def _storage_valid(value):
    """BSONObj::storageValidEmbedded: no $-prefixed field names (but DBRef's), nested too."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k[:1] == '$' and k not in ('$ref', '$id', '$db'):
                return False
            if not _storage_valid(v):
                return False
    elif isinstance(value, list):
        return all(_storage_valid(v) for v in value)
    return True


def shard_key_from_query(query, key_fields):
    """ShardKeyPattern::extractShardKeyFromQuery (src/mongo/s/shard_key_pattern.cpp): the
    shard key values a filter pins by equality, or None when it does not pin every field
    to one value mongos can target (missing, an array, a regex, an object with $-prefixed
    names).  An equality on _id alone never gives another field's value."""
    key_paths = [path for path, _ in key_fields]
    equalities = {}
    try:
        _collect_equalities(query, key_paths, equalities)
    except _NoShardKey:
        return None
    key = {}
    for path in key_paths:
        found = [p for p in equalities if _is_prefix(p, path)]
        if not found:
            return None
        value = equalities[found[0]]
        for part in path[len(found[0]) + 1:].split('.') if path != found[0] else ():
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        if isinstance(value, (list, Regex, _RE_PATTERN)) or not _storage_valid(value):
            return None
        key[path] = value
    return key


def _with_id_first(doc, _id):
    if doc and next(iter(doc)) == '_id':
        if doc['_id'] is _id:
            return doc
        out = dict(doc)
        out['_id'] = _id
        return out
    return dict(itertools.chain((('_id', _id),), ((k, v) for k, v in doc.items() if k != '_id')))


def _identical(a, b):
    if a is b:
        return True
    try:
        if a != b:
            return False
        return bson.encode(a) == bson.encode(b)
    except Exception:
        return False


def _check_update_conflicts(update):
    seen = set()
    paths = []
    for op, fields in update.items():
        for f in fields:
            paths.append(f)
            if op == '$rename' and isinstance(fields[f], str):
                paths.append(fields[f])
    for p in paths:
        if p in seen:
            raise CommandError(40, "Updating the path '%s' would create a conflict at '%s'"
                               % (p, p))
        seen.add(p)
    for p in paths:
        parts = p.split('.')
        for i in range(1, len(parts)):
            prefix = '.'.join(parts[:i])
            if prefix in seen:
                raise CommandError(40, "Updating the path '%s' would create a conflict at "
                                       "'%s'" % (p, prefix))


# --------------------------------------------------------------------------
# $merge (src/mongo/db/pipeline/document_source_merge.cpp, document_source_merge_spec.cpp,
# merge_processor.cpp, process_interface/common_mongod_process_interface.cpp)
# --------------------------------------------------------------------------

# The (whenMatched, whenNotMatched) pairs MongoDB has a merge strategy for
# (getMergeStrategyDescriptors); any other pair is refused with 51181.
MERGE_MODES = frozenset((
    ('replace', 'insert'), ('replace', 'fail'), ('replace', 'discard'),
    ('merge', 'insert'), ('merge', 'fail'), ('merge', 'discard'),
    ('keepExisting', 'insert'), ('fail', 'insert'),
    ('pipeline', 'insert'), ('pipeline', 'fail'), ('pipeline', 'discard')))
MERGE_WHEN_MATCHED = ('replace', 'keepExisting', 'merge', 'fail')
MERGE_WHEN_NOT_MATCHED = ('insert', 'discard', 'fail')
MERGE_NO_MATCH_MSG = ('$merge could not find a matching document in the target collection for '
                      'at least one document in the source collection')
MERGE_INDEX_MSG = 'Cannot find index to verify that join fields will be unique'


class MergeSpec(object):
    """A parsed $merge stage."""
    __slots__ = ('db', 'coll', 'on', 'when_matched', 'when_not_matched')


def _merge_bad_type(field, v, expected):
    fail(14, "BSON field '$merge.%s' is the wrong type '%s', expected type '%s'"
         % (field, type_name(v), expected))


def parse_merge_spec(spec, db):
    """Parse a $merge stage as DocumentSourceMerge::LiteParsed::parse and createFromBson do:
    the IDL fields in the order given (an unknown one is 40415, 'into' is required), then
    the target namespace and the mode pair.  on: None when not given."""
    out = MergeSpec()
    out.db, out.on = db, None
    out.when_matched, out.when_not_matched = 'merge', 'insert'
    if isinstance(spec, str):
        into = spec
    elif isinstance(spec, dict):
        into = MISSING
        for k, v in spec.items():
            if k == 'into':
                into = v
                if not isinstance(v, (str, dict)):
                    fail(51178, "$merge 'into' field  must be either a string or an object, "
                                "but found %s" % type_name(v))
            elif k == 'on':
                if isinstance(v, str):
                    fields = [v]
                elif isinstance(v, list):
                    for f in v:
                        if not isinstance(f, str):
                            fail(51134, "$merge 'on' array elements must be strings, but found "
                                        "%s" % type_name(f))
                    fields = list(v)
                else:
                    fail(51186, "$merge 'on' field  must be either a string or an array of "
                                "strings, but found %s" % type_name(v))
                if not fields:
                    fail(51187, "If explicitly specifying $merge 'on', must include at least "
                                "one field")
                out.on = fields
            elif k == 'whenMatched':
                if isinstance(v, list):
                    out.when_matched = 'pipeline'
                elif isinstance(v, str):
                    if v not in MERGE_WHEN_MATCHED:
                        fail(2, "Enumeration value '%s' for field 'whenMatched' is not a valid "
                                "value." % v)
                    out.when_matched = v
                else:
                    fail(51191, "$merge 'whenMatched' field  must be either a string or an "
                                "array, but found %s" % type_name(v))
            elif k == 'whenNotMatched':
                if not isinstance(v, str):
                    _merge_bad_type(k, v, 'string')
                if v not in MERGE_WHEN_NOT_MATCHED:
                    fail(2, "Enumeration value '%s' for field '$merge.whenNotMatched' is not a "
                            "valid value." % v)
                out.when_not_matched = v
            elif k == 'let':
                if not isinstance(v, dict):
                    _merge_bad_type(k, v, 'object')
            elif k == 'targetCollectionVersion':
                # Only a router sends it (with the shard version of the target).
                fail(51123, 'Unexpected target chunk version specified')
            else:
                fail(40415, "BSON field '$merge.%s' is an unknown field." % k)
        if into is MISSING:
            fail(40414, "BSON field '$merge.into' is missing but a required field")
    else:
        fail(14, '$merge requires a string or object argument, but found %s' % type_name(spec))
    if isinstance(into, str):
        if not into:
            fail(5786800, "$merge 'into' field cannot be an empty string")
        out.coll = into
    else:
        coll = None
        for k, v in into.items():
            if k in ('db', 'coll'):
                if not isinstance(v, str):
                    fail(14, "BSON field 'into.%s' is the wrong type '%s', expected type "
                             "'string'" % (k, type_name(v)))
                if k == 'db':
                    out.db = v
                else:
                    coll = v
            else:
                fail(40415, "BSON field 'into.%s' is an unknown field." % k)
        if not coll:
            fail(5786801, "$merge 'into' field must specify a 'coll' that is not empty, null "
                          "or undefined")
        out.coll = coll
    try:
        _check_db_name(out.db)
        _check_coll_name(out.db, out.coll)
    except CommandError:
        fail(73, "Invalid $merge target namespace: '%s.%s'" % (out.db, out.coll))
    if (out.when_matched, out.when_not_matched) not in MERGE_MODES:
        fail(51181, "Combination of $merge modes 'whenMatched: %s' and 'whenNotMatched: %s' is "
                    "not supported" % (out.when_matched, out.when_not_matched))
    if out.on is not None:
        seen = set()
        for f in out.on:
            if not f:
                fail(40352, 'FieldPath cannot be constructed with empty string')
            _path_parts(f)
            if f in seen:
                fail(31465, "Found a duplicate field '%s'" % f)
            seen.add(f)
    if out.coll.startswith('system.'):
        fail(31319, 'Cannot $merge to special collection: %s' % out.coll)
    if out.db in ('admin', 'config', 'local'):
        fail(31320, 'Cannot $merge to internal database: %s' % out.db)
    if out.when_matched == 'pipeline':
        raise CommandError(238, '$merge with a whenMatched pipeline is not supported by the '
                                'test server')
    if isinstance(spec, dict) and spec.get('let') is not None:
        fail(51199, "Cannot use 'let' variables with 'whenMatched: %s' mode" % out.when_matched)
    return out


def merge_supporting_index(store, on_fields):
    """Whether an index of the collection proves the 'on' fields unique, as supportsUniqueKey
    decides: the _id index for ["_id"], else a unique, non-partial index with the simple
    collation whose key pattern names exactly the 'on' fields (any order, ascending or
    descending; a sparse one counts)."""
    if set(on_fields) == {'_id'}:
        return True
    if not store.is_created:
        return False
    want = set(on_fields)
    for info in store.indexes.values():
        if not info.get('unique') or 'partialFilterExpression' in info:
            continue
        if info.get('collation') not in (None, {'locale': 'simple'}):
            continue
        key = info['key']
        if len(key) != len(want) or {f for f, _ in key} != want:
            continue
        if all(is_number(d) and not isinstance(d, bool) for _, d in key):
            return True
    return False


def merge_on_value(doc, path):
    """The value of one 'on' field of a result document (MergeProcessor::
    _extractMergeOnFieldsFromDoc, 6.0): an array there is 51185; missing (also behind a
    non-document on the path), null or undefined is 51132."""
    value = doc
    parts = path.split('.')
    for i, part in enumerate(parts):
        if not isinstance(value, dict):
            value = MISSING
            break
        value = value.get(part, MISSING)
        if isinstance(value, list) and i == len(parts) - 1:
            fail(51185, "$merge write error: 'on' field '%s' is an array" % path)
    if nullish(value):
        fail(51132, "$merge write error: 'on' field '%s' cannot be missing, null, undefined or "
                    "an array" % path)
    return value


def _merge_set_fields(base, doc):
    """base with the top-level fields of doc $set: existing fields replaced in place, new
    ones added in field-name order, as the update system adds the fields of one $set."""
    out = dict(base)
    for k in sorted(doc):
        if '.' in k or k[:1] == '$':
            raise CommandError(238, "$merge of a field named '%s' is not supported by the test "
                                    "server" % k)
        out[k] = doc[k]
    return out


def _upsert_base(key, _id):
    """The document an upsert by the 'on' fields starts from: _id, then the query's
    equality fields (dotted paths as sub-documents)."""
    base = {'_id': _id}
    for path in sorted(key):
        if path == '_id':
            continue
        base = _set_nested(base, path.split('.'), key[path])
    return base


def _same_value(a, b):
    """Binary equality of two values (same BSON type and bytes), as the immutable _id check
    compares them."""
    return _identical({'v': a}, {'v': b})


# --------------------------------------------------------------------------
# Fail points (what mongod offers tests with --setParameter enableTestCommands=1)
# --------------------------------------------------------------------------

class FailPoint(object):
    """One fail point and its mode, as src/mongo/util/fail_point.cpp keeps it: "off",
    "alwaysOn", {times: N} (the next N passes, then off) or {skip: N} (every pass after the
    first N).  A pass is counted only when the caller's condition holds (the command is one
    the data names), as FailPoint::executeIf checks the predicate before the mode."""

    __slots__ = ('mode', 'value', 'data', 'entered')

    def __init__(self):
        self.mode = 'off'
        self.value = 0
        self.data = {}
        self.entered = 0

    def configure(self, cmd):
        """Parse a configureFailPoint command like FailPoint::parseBSON; returns the number
        of times the fail point was entered so far (the reply's "count")."""
        if 'mode' not in cmd:
            raise CommandError(20, "When setting a failpoint, you must supply a 'mode'")
        mode = cmd['mode']
        value = 0
        if isinstance(mode, str):
            if mode not in ('off', 'alwaysOn'):
                raise CommandError(2, 'unknown mode: %s' % mode)
        elif isinstance(mode, dict):
            for key in ('times', 'skip'):
                if key in mode:
                    v = mode[key]
                    if not is_number(v) or isinstance(v, Decimal128):
                        raise CommandError(14, "Expected field \"%s\" to have numeric type, but "
                                               "found %s" % (key, type_name(v)))
                    value = int(v)
                    if value < 0:
                        raise CommandError(2, "'%s' option to 'mode' must be positive" % key)
                    if value > INT32_MAX:
                        raise CommandError(2, "'%s' option to 'mode' is too large" % key)
                    break
            else:
                if 'activationProbability' in mode:
                    raise CommandError(238, 'activationProbability is not supported by the '
                                            'test server')
                raise CommandError(2, "'mode' must be one of 'off', 'alwaysOn', '{times:n}', "
                                      "'{skip:n}' or '{activationProbability:p}'")
            mode = key
            if mode == 'times' and value == 0:
                mode = 'off'
        else:
            raise CommandError(14, "'mode' must be a string or JSON object")
        data = cmd.get('data', {})
        if not isinstance(data, dict):
            raise CommandError(14, "the 'data' option must be a JSON object")
        self.mode, self.value, self.data = mode, value, data
        return self.entered

    def enter(self):
        """One pass whose condition held: the data if the fail point fires, else None."""
        if self.mode == 'off':
            return None
        if self.mode == 'times':
            self.value -= 1
            if self.value <= 0:
                self.mode = 'off'
        elif self.mode == 'skip' and self.value > 0:
            self.value -= 1
            return None
        self.entered += 1
        return self.data


# The names under which one command answers (Command::hasAlias): a failCommands entry names
# the command by any of them.
_COMMAND_ALIASES = {'isMaster': 'hello', 'ismaster': 'hello', 'buildinfo': 'buildInfo',
                    'findandmodify': 'findAndModify', 'getlasterror': 'getLastError',
                    'deleteIndexes': 'dropIndexes'}

# Commands for which Command::supportsWriteConcern is true, i.e. that a failCommand
# writeConcernError can be attached to.
WRITE_CONCERN_COMMANDS = frozenset((
    'insert', 'update', 'delete', 'findAndModify', 'create', 'drop', 'dropDatabase',
    'createIndexes', 'dropIndexes', 'renameCollection', 'collMod'))

FAIL_COMMAND_MSG = "Failing command via 'failCommand' failpoint"


def aggregate_writes(cmd):
    """Whether an aggregate writes (ends with $merge or $out), which makes it a command that
    supports writeConcern (Pipeline::aggHasWriteStage)."""
    pipeline = cmd.get('pipeline')
    return (isinstance(pipeline, list) and pipeline and isinstance(pipeline[-1], dict) and
            ('$merge' in pipeline[-1] or '$out' in pipeline[-1]))


# The write commands a failCommand writeErrorCode (an extension of this server) can fail.
WRITE_ERROR_COMMANDS = frozenset(('insert', 'update', 'delete'))


class FailAction(object):
    """What failCommand does to one command before it runs."""
    __slots__ = ('block_ms', 'close', 'reply', 'write_errors')

    def __init__(self):
        self.block_ms = 0
        self.close = False
        self.reply = None
        # (code, statement indexes or None for all) for a writeErrorCode.
        self.write_errors = None


class Backend(object):
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

    # -- fail points ---------------------------------------------------------

    def cmd_configureFailPoint(self, db, cmd, name, conn):
        if db != 'admin':
            raise CommandError(13, 'configureFailPoint may only be run against the admin '
                                   'database.')
        fp_name = cmd[name]
        with self.fp_lock:
            fp = self.fail_points.get(fp_name) if isinstance(fp_name, str) else None
            if fp is None:
                raise CommandError(266, '%s not found' % (fp_name,))
            count = fp.configure(cmd)
        return {'count': Int64(count), 'ok': 1.0}

    def note_client(self, conn_id, cmd):
        """Remember the appName a connection's handshake gave (failCommand's appName)."""
        client = cmd.get('client')
        app = client.get('application') if isinstance(client, dict) else None
        name = app.get('name') if isinstance(app, dict) else None
        if isinstance(name, str):
            self.conn_app[conn_id] = name

    def forget_connection(self, conn_id):
        self.conn_app.pop(conn_id, None)

    def _fail_command_applies(self, data, db, name, cmd, conn_id):
        """CommandHelpers::shouldActivateFailCommandFailPoint (src/mongo/db/commands.cpp)."""
        if name == 'configureFailPoint':  # banned even if listed
            return False
        if 'appName' in data and data['appName'] != self.conn_app.get(conn_id, ''):
            return False
        if 'namespace' in data:
            target = cmd.get(name)
            ns = '%s.%s' % (db, target) if isinstance(target, str) else db
            if data['namespace'] != ns:
                return False
        if data.get('failAllCommands'):
            return True
        canonical = _COMMAND_ALIASES.get(name, name)
        names = data.get('failCommands')
        return isinstance(names, list) and any(
            isinstance(n, str) and _COMMAND_ALIASES.get(n, n) == canonical for n in names)

    def fail_command_before(self, db, name, cmd, conn_id):
        """CommandHelpers::evaluateFailCommandFailPoint: a FailAction, or None when the fail
        point does not fire.  Only data with closeConnection, blockConnection or an integer
        errorCode counts a pass here (or a writeErrorCode, for a write command)."""
        if name not in self.commands:
            return None
        with self.fp_lock:
            fp = self.fail_points['failCommand']
            if fp.mode == 'off':
                return None
            data = fp.data
            close = data.get('closeConnection') is True
            block = data.get('blockConnection') is True
            code = data.get('errorCode')
            has_code = is_number(code) and not isinstance(code, Decimal128)
            wcode = data.get('writeErrorCode')
            has_wcode = (is_number(wcode) and not isinstance(wcode, Decimal128)
                         and _COMMAND_ALIASES.get(name, name) in WRITE_ERROR_COMMANDS)
            if not (close or block or has_code or has_wcode):
                return None
            if not self._fail_command_applies(data, db, name, cmd, conn_id):
                return None
            data = fp.enter()
        if data is None:
            return None
        action = FailAction()
        labels = data.get('errorLabels')
        if block:
            ms = data.get('blockTimeMS')
            if not is_number(ms) or isinstance(ms, Decimal128):
                action.reply = error_reply(72, "must specify 'blockTimeMS' when "
                                               "'blockConnection' is true")
                return action
            if ms < 0:
                action.reply = error_reply(72, "'blockTimeMS' must be non-negative")
                return action
            action.block_ms = int(ms)
        if close:
            action.close = True
            return action
        if has_code:
            action.reply = error_reply(int(code), FAIL_COMMAND_MSG)
            # errorLabels in the data replace whatever labels the server would have given
            # (errorLabelsOverride); none otherwise, since a standalone has no retryable
            # writes to label.
            if isinstance(labels, list) and labels:
                action.reply['errorLabels'] = list(labels)
        elif has_wcode:
            indexes = data.get('writeErrorIndexes')
            if isinstance(indexes, list):
                indexes = frozenset(int(i) for i in indexes if is_number(i))
            else:
                indexes = None
            action.write_errors = (int(wcode), indexes)
        return action

    def fail_command_after(self, db, name, cmd, conn_id, reply):
        """The writeConcernError of a failCommand, attached to the reply of a command that
        ran (its writes applied), in place of waiting for the write concern."""
        if _COMMAND_ALIASES.get(name, name) not in WRITE_CONCERN_COMMANDS and not (
                name == 'aggregate' and aggregate_writes(cmd)):
            return
        with self.fp_lock:
            fp = self.fail_points['failCommand']
            if fp.mode == 'off' or 'writeConcernError' not in fp.data:
                return
            if not self._fail_command_applies(fp.data, db, name, cmd, conn_id):
                return
            data = fp.enter()
        if data is not None:
            reply['writeConcernError'] = data['writeConcernError']
            # As with errorCode, the data's errorLabels replace the server's own
            # (RunCommandAndWaitForWriteConcern sets errorLabelsOverride): none if empty.
            labels = data.get('errorLabels')
            if isinstance(labels, list) and labels:
                reply['errorLabels'] = list(labels)

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

    # -- databases and collections ----------------------------------------

    def _db_size(self, db):
        dstore = self.server_store[db]
        size = 0
        for cname in dstore.list_created_collection_names():
            for doc in dstore[cname]._documents.values():
                size += len(bson.encode(doc))
        return size

    def cmd_listDatabases(self, db, cmd, name, conn):
        if db != 'admin':
            raise CommandError(13, 'listDatabases may only be run against the admin database.')
        out = []
        total = 0
        for dbname in sorted(self.server_store.list_created_database_names()):
            size = 0 if cmd.get('nameOnly') else self._db_size(dbname)
            entry = {'name': dbname, 'sizeOnDisk': float(size), 'empty': size == 0}
            flt = cmd.get('filter')
            if flt and not mm_filtering.filter_applies(flt, entry):
                continue
            total += size
            out.append({'name': dbname} if cmd.get('nameOnly') else entry)
        reply = {'databases': out, 'ok': 1.0}
        if not cmd.get('nameOnly'):
            reply['totalSize'] = float(total)
            reply['totalSizeMb'] = Int64(total // (1024 * 1024))
        return reply

    def _collection_uuid(self, store):
        u = getattr(store, '_bd_uuid', None)
        if u is None:
            u = store._bd_uuid = Binary(uuid.uuid4().bytes, 4)
        return u

    def cmd_listCollections(self, db, cmd, name, conn):
        dstore = self.server_store[db]
        flt = cmd.get('filter') or {}
        out = []
        for cname in sorted(dstore.list_created_collection_names()):
            options = dict(getattr(dstore[cname], '_bd_options', None) or {})
            entry = {'name': cname, 'type': 'collection', 'options': options,
                     'info': {'readOnly': False, 'uuid': self._collection_uuid(dstore[cname])},
                     'idIndex': {'v': 2, 'key': {'_id': 1}, 'name': '_id_'}}
            if flt and not mm_filtering.filter_applies(flt, entry):
                continue
            if cmd.get('nameOnly'):
                entry = {'name': cname, 'type': 'collection'}
            out.append(entry)
        batch = (cmd.get('cursor') or {}).get('batchSize')
        return self.cursor_reply('%s.$cmd.listCollections' % db, out,
                                 _as_int(batch, 'batchSize', 0) if batch is not None
                                 else len(out))

    def _validation_options(self, db, cmd, name):
        """validator / validationLevel / validationAction of a create or collMod, checked
        as mongod checks them."""
        out = {}
        if 'validator' in cmd:
            validator = cmd['validator']
            if not isinstance(validator, dict):
                raise CommandError(14, "BSON field '%s.validator' is the wrong type '%s', "
                                       "expected type 'object'" % (name, type_name(validator)))
            if validator and db in ('admin', 'local', 'config'):
                raise CommandError(72, 'Document validators not allowed on system collection '
                                       '%s.%s' % (db, cmd[name]))
            if '$jsonSchema' in validator:
                check_json_schema(validator['$jsonSchema'])
            try:  # unknown operators are refused now, not at the first write
                validator_matches(validator, {})
            except NotImplementedError as e:
                raise CommandError(238, 'not supported by the test server: %s' % e)
            out['validator'] = validator
        if 'validationLevel' in cmd:
            level = cmd['validationLevel']
            if level not in VALIDATION_LEVELS:
                raise CommandError(2, "Enumeration value '%s' for field '%s.validationLevel' "
                                      "is not a valid value." % (level, name))
            out['validationLevel'] = level
        if 'validationAction' in cmd:
            action = cmd['validationAction']
            if action not in VALIDATION_ACTIONS:
                raise CommandError(2, "Enumeration value '%s' for field '%s.validationAction' "
                                      "is not a valid value." % (action, name))
            out['validationAction'] = action
        return out

    def cmd_create(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        if coll._store.is_created:
            raise CommandError(48, 'Collection %s.%s already exists.' % (db, coll_name))
        options = self._validation_options(db, cmd, name)
        coll._store.create()
        coll._store._bd_options = options or None
        return {'ok': 1.0}

    def cmd_collMod(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        store = coll._store
        if not store.is_created:
            raise CommandError(26, 'ns does not exist: %s.%s' % (db, coll_name))
        for key in cmd:
            if key in (name, 'index', 'validator', 'validationLevel', 'validationAction',
                       'writeConcern', 'lsid', '$db', '$readPreference', '$clusterTime'):
                continue
            if key in ('expireAfterSeconds', 'viewOn', 'pipeline',
                       'changeStreamPreAndPostImages', 'timeseries', 'recordPreImages'):
                raise CommandError(238, 'collMod %s is not supported by the test server' % key)
            raise CommandError(40415, "BSON field 'collMod.%s' is an unknown field." % key)
        index_change = None
        if 'index' in cmd:
            index_change = self._collmod_index(db, coll_name, store, cmd['index'])
        options = dict(getattr(store, '_bd_options', None) or {})
        options.update(self._validation_options(db, cmd, name))
        store._bd_options = options or None
        reply = {}
        if index_change is not None:
            reply.update(index_change())
        reply['ok'] = 1.0
        return reply

    def _collmod_index(self, db, coll_name, store, spec):
        """collMod's index option, checked as MongoDB 6.0 checks it (coll_mod.idl, coll_mod.cpp
        parseCollModRequest, coll_mod_index.cpp): expireAfterSeconds of one index, found by name
        or by key pattern; hidden, unique and prepareUnique are not supported here (238).
        Returns a function that applies the change and gives the reply's fields, so that
        nothing changes when another option of the command is refused."""
        if not isinstance(spec, dict):
            raise CommandError(14, "BSON field 'collMod.index' is the wrong type '%s', expected "
                                   "type 'object'" % type_name(spec))
        types = {'name': ('string',), 'keyPattern': ('object',), 'hidden': ('bool',),
                 'unique': ('bool',), 'prepareUnique': ('bool',),
                 'expireAfterSeconds': ('long', 'int', 'decimal', 'double')}
        for field, value in spec.items():
            if field not in types:
                raise CommandError(40415, "BSON field 'collMod.index.%s' is an unknown field."
                                   % field)
            if type_name(value) not in types[field]:
                want = types[field]
                raise CommandError(14, "BSON field 'collMod.index.%s' is the wrong type '%s', "
                                       "expected %s" % (
                                           field, type_name(value),
                                           "type '%s'" % want[0] if len(want) == 1 else
                                           "types '[%s]'" % ', '.join(want)))
        if 'name' in spec and 'keyPattern' in spec:
            raise CommandError(72, 'Cannot specify both key pattern and name.')
        if 'name' not in spec and 'keyPattern' not in spec:
            raise CommandError(72, 'Must specify either index name or key pattern.')
        if not any(f in spec for f in ('expireAfterSeconds', 'hidden', 'unique',
                                       'prepareUnique')):
            raise CommandError(72, 'no expireAfterSeconds, hidden, unique, or prepareUnique '
                                   'field')
        for field in ('hidden', 'unique', 'prepareUnique'):
            if field in spec:
                raise CommandError(238, 'collMod index %s is not supported by the test server'
                                   % field)
        new = spec['expireAfterSeconds']
        if isinstance(new, Decimal128):
            new = new.to_decimal()
        seconds = int(new) if not (isinstance(new, float) and math.isnan(new)) else 0
        if seconds < 0:
            raise CommandError(72, "TTL index 'expireAfterSeconds' option cannot be less than 0")
        if seconds > int(time.time()):
            raise CommandError(72, "TTL index 'expireAfterSeconds' option must be within an "
                                   "acceptable range, try a lower number")
        ns = '%s.%s' % (db, coll_name)
        if 'name' in spec:
            iname = spec['name']
            if iname == '_id_':
                info = {'key': [('_id', 1)]}
            elif iname in store.indexes:
                info = store.indexes[iname]
            else:
                raise CommandError(27, 'cannot find index %s for ns %s' % (iname, ns))
        else:
            pattern = spec['keyPattern']
            if bson_cmp(pattern, {'_id': 1}) == 0:
                iname, info = '_id_', {'key': [('_id', 1)]}
            else:
                found = [(n, i) for n, i in store.indexes.items()
                         if bson_cmp(dict(i['key']), pattern) == 0]
                if not found:
                    raise CommandError(27, 'cannot find index %s for ns %s'
                                       % (fmt_value(pattern), ns))
                iname, info = found[0]
        old = info.get('expireAfterSeconds')
        if old is None:
            if iname == '_id_':
                raise CommandError(72, 'the _id field does not support TTL indexes')
            if len(info['key']) != 1:
                raise CommandError(72, 'TTL indexes are single-field indexes, compound indexes '
                                       'do not support TTL')
        elif not is_number(old):
            raise CommandError(72, 'existing expireAfterSeconds field is not a number')

        def apply():
            # The reply carries the new value, and the old one when the index had one, whether
            # or not it changed (coll_mod_index.cpp processCollModIndexRequest, 6.0).
            info['expireAfterSeconds'] = spec['expireAfterSeconds']
            store._ttl_indexes[iname] = info
            out = {'expireAfterSeconds_new': spec['expireAfterSeconds']}
            if old is not None:
                out = {'expireAfterSeconds_old': old,
                       'expireAfterSeconds_new': spec['expireAfterSeconds']}
            return out
        return apply

    def _kill_ns_cursors(self, prefix):
        for cid in [c.id for c in self.cursors.values() if c.ns.startswith(prefix)]:
            del self.cursors[cid]

    def cmd_drop(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        store = coll._store
        if not store.is_created:
            raise CommandError(26, 'ns not found')
        n = 1 + len(store.indexes)
        store.drop()
        store._bd_options = None
        clear_size_memo()
        self._reset_write_stats(db, coll_name)
        self._kill_ns_cursors('%s.%s' % (db, coll_name))
        return {'nIndexesWas': n, 'ns': '%s.%s' % (db, coll_name), 'ok': 1.0}

    def _reset_write_stats(self, db, coll_name=None):
        """A dropped collection starts its rewrite-cost counters again."""
        for (d, c), stats in self.write_stats.items():
            if d == db and coll_name in (None, c):
                stats[0] = stats[1] = 0

    def cmd_dropDatabase(self, db, cmd, name, conn):
        dstore = self.server_store[db]
        for cname in list(dstore._collections):
            dstore[cname].drop()
            dstore[cname]._bd_options = None
        clear_size_memo()
        self._reset_write_stats(db)
        self._kill_ns_cursors(db + '.')
        return {'dropped': db, 'ok': 1.0}

    def cmd_renameCollection(self, db, cmd, name, conn):
        src, dst = cmd['renameCollection'], cmd.get('to')
        if not isinstance(src, str) or not isinstance(dst, str) or '.' not in src \
                or '.' not in dst:
            raise CommandError(73, 'Invalid namespace specified')
        sdb, scoll = src.split('.', 1)
        ddb, dcoll = dst.split('.', 1)
        if sdb != ddb:
            raise CommandError(238, 'renaming across databases is not supported by the test '
                                    'server')
        dstore = self.server_store[sdb]
        if not dstore[scoll].is_created:
            raise CommandError(26, 'Source collection %s does not exist' % src)
        if dstore[dcoll].is_created:
            if not cmd.get('dropTarget'):
                raise CommandError(48, 'target namespace exists')
            dstore[dcoll].drop()
            dstore[dcoll]._bd_options = None
        dstore.rename(scoll, dcoll)
        for key in [(sdb, scoll), (sdb, dcoll)]:
            self.colls.pop(key, None)
        self._kill_ns_cursors(src)
        return {'ok': 1.0}

    def cmd_dbStats(self, db, cmd, name, conn):
        dstore = self.server_store[db]
        names = dstore.list_created_collection_names()
        objects = sum(len(dstore[c]._documents) for c in names)
        size = self._db_size(db)
        nindexes = sum(1 + len(dstore[c].indexes) for c in names)
        return {'db': db, 'collections': len(names), 'views': 0, 'objects': objects,
                'avgObjSize': float(size) / objects if objects else 0.0,
                'dataSize': float(size), 'storageSize': float(size), 'indexes': nindexes,
                'indexSize': 0.0, 'totalSize': float(size), 'scaleFactor': 1.0, 'ok': 1.0}

    def cmd_collStats(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        store = coll._store
        if not store.is_created:
            raise CommandError(26, 'ns not found')
        docs = coll._docs()
        size = sum(len(bson.encode(d)) for d in docs.values())
        names = ['_id_'] + list(store.indexes)
        reply = {'ns': '%s.%s' % (db, coll_name), 'count': len(docs), 'size': size,
                 'avgObjSize': size // len(docs) if docs else 0, 'storageSize': size,
                 'nindexes': len(names), 'totalIndexSize': 0,
                 'indexSizes': dict.fromkeys(names, 0), 'capped': False, 'ok': 1.0}
        if self.shard_key is not None:
            # collStats through mongos says whether the collection is sharded.
            reply['sharded'] = self.sharded(db, coll_name)
        return reply

    def cmd_bucketdTestStats(self, db, cmd, name, conn):
        """The storage engine's rewrite cost, which MongoDB does not report per write:
        {bucketdTestStats: 1 | "<collection>", reset: <bool>} on a database."""
        target = cmd[name]
        if isinstance(target, str):
            _check_coll_name(db, target)
            names = [target]
        else:
            dstore = self.server_store[db]
            names = set(dstore.list_created_collection_names())
            names.update(c for (d, c) in self.write_stats if d == db)
            names = sorted(names)
        totals = {'docBytesWritten': 0, 'updatesApplied': 0, 'storedBytes': 0, 'count': 0}
        per_coll = {}
        for cname in names:
            docs = self.coll(db, cname)._docs()
            stats = self.write_stats[(db, cname)]
            entry = {'docBytesWritten': Int64(stats[0]), 'updatesApplied': Int64(stats[1]),
                     'storedBytes': Int64(sum(bson_size(d) for d in docs.values())),
                     'count': Int64(len(docs))}
            per_coll[cname] = entry
            for k in totals:
                totals[k] += int(entry[k])
            if cmd.get('reset'):
                stats[0] = stats[1] = 0
        reply = {k: Int64(v) for k, v in totals.items()}
        reply['collections'] = per_coll
        reply['ok'] = 1.0
        return reply

    # -- indexes -----------------------------------------------------------

    def cmd_createIndexes(self, db, cmd, name, conn):
        self.opcounters['command'] += 1
        coll_name, coll = self._collection_arg(db, cmd, name)
        specs = cmd.get('indexes')
        if not isinstance(specs, list) or not specs:
            raise CommandError(2, 'Must specify at least one index to create')
        store = coll._store
        created_automatically = not store.is_created
        before = 1 + len(store.indexes)
        to_create = []
        for spec in specs:
            if not isinstance(spec, dict):
                raise CommandError(14, "BSON field 'createIndexes.indexes' is the wrong type")
            key = spec.get('key')
            iname = spec.get('name')
            if not isinstance(key, dict) or not key:
                raise CommandError(67, "The 'key' field is a required property of an index "
                                       "specification")
            if not isinstance(iname, str) or not iname:
                raise CommandError(9, "The 'name' field is a required property of an index "
                                      "specification")
            for f, d in key.items():
                if not (is_number(d) and _num_value(d) != 0) and d not in (
                        'text', '2d', '2dsphere', 'hashed', 'geoHaystack'):
                    raise CommandError(67, 'Values in index key pattern must be non-zero '
                                           'numbers or index type strings: %s'
                                       % fmt_value(key))
            info = {'key': [(f, d) for f, d in key.items()]}
            if 'expireAfterSeconds' in spec:
                _check_ttl_option(spec)
            for opt, v in spec.items():
                if opt in ('key', 'name', 'v', 'ns', 'background'):
                    continue
                if opt in ('unique', 'sparse'):
                    if v:
                        info[opt] = True
                    continue
                info[opt] = v
            if iname == '_id_' or list(key) == ['_id']:
                if list(key) != ['_id'] or iname != '_id_' or info.get('unique') is False:
                    if iname == '_id_' or list(key) != ['_id']:
                        raise CommandError(197, 'The index name \'_id_\' is reserved for the '
                                                '_id index')
                continue
            existing = store.indexes.get(iname)
            if existing is not None:
                if bson_cmp(dict(existing['key']), dict(info['key'])) != 0:
                    raise CommandError(
                        86, 'An existing index has the same name as the requested index. '
                            'Requested index: %s, existing index: %s'
                        % (fmt_value(dict(spec)),
                           fmt_value(dict(existing, key=dict(existing['key']), name=iname))))
                if not _same_index_options(existing, info):
                    raise CommandError(
                        85, 'An equivalent index already exists with the same name but '
                            'different options. Requested index: %s, existing index: %s'
                        % (fmt_value(dict(spec)),
                           fmt_value(dict(existing, key=dict(existing['key']), name=iname))))
                continue
            clash = None
            for oname, other in store.indexes.items():
                if bson_cmp(dict(other['key']), dict(info['key'])) == 0:
                    clash = oname
            if clash is not None:
                raise CommandError(85, 'Index already exists with a different name: %s' % clash)
            to_create.append((iname, info))
        for iname, info in to_create:
            if info.get('unique'):
                ix = _UniqueIndex(iname, info)
                seen = {}
                for doc in coll._docs().values():
                    for pk, values in ix.keys_of(doc).items():
                        if pk in seen:
                            value = dict(zip(ix.fields, values))
                            raise CommandError(
                                11000, 'Index build failed: E11000 duplicate key error '
                                       'collection: %s.%s index: %s dup key: %s'
                                % (db, coll_name, iname, fmt_value(value)),
                                keyPattern=ix.pattern, keyValue=value)
                        seen[pk] = True
            store.create_index(iname, info)
        if created_automatically:
            store.create()
        reply = {'numIndexesBefore': before, 'numIndexesAfter': 1 + len(store.indexes),
                 'createdCollectionAutomatically': created_automatically, 'ok': 1.0}
        if not to_create:
            reply['note'] = 'all indexes already exist'
        return reply

    def _index_docs(self, store):
        out = [{'v': 2, 'key': {'_id': 1}, 'name': '_id_'}]
        for iname, info in store.indexes.items():
            doc = {'v': 2, 'key': dict(info['key']), 'name': iname}
            for opt, v in info.items():
                if opt != 'key':
                    doc[opt] = v
            out.append(doc)
        return out

    def cmd_listIndexes(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        store = coll._store
        if not store.is_created:
            raise CommandError(26, 'ns does not exist: %s.%s' % (db, coll_name))
        out = self._index_docs(store)
        batch = (cmd.get('cursor') or {}).get('batchSize')
        return self.cursor_reply('%s.%s' % (db, coll_name), out,
                                 _as_int(batch, 'batchSize', 0) if batch is not None
                                 else len(out))

    def cmd_dropIndexes(self, db, cmd, name, conn):
        coll_name, coll = self._collection_arg(db, cmd, name)
        store = coll._store
        if not store.is_created:
            raise CommandError(26, 'ns not found %s.%s' % (db, coll_name))
        before = 1 + len(store.indexes)
        which = cmd.get('index')
        if which == '*':
            for iname in list(store.indexes):
                store.drop_index(iname)
            return {'nIndexesWas': before, 'ok': 1.0}
        if isinstance(which, dict):
            names = [n for n, info in store.indexes.items()
                     if bson_cmp(dict(info['key']), which) == 0]
            if not names:
                if bson_cmp(which, {'_id': 1}) == 0:
                    raise CommandError(72, 'cannot drop _id index')
                raise CommandError(27, "can't find index with key: %s" % fmt_value(which))
        elif isinstance(which, str):
            names = [which]
        elif isinstance(which, list):
            names = which
        else:
            raise CommandError(14, "BSON field 'dropIndexes.index' is the wrong type")
        for iname in names:
            if iname == '_id_':
                raise CommandError(72, 'cannot drop _id index')
            if iname not in store.indexes:
                raise CommandError(27, 'index not found with name [%s]' % iname)
        for iname in names:
            store.drop_index(iname)
        return {'nIndexesWas': before, 'ok': 1.0}

    cmd_deleteIndexes = cmd_dropIndexes

    # -- writes ------------------------------------------------------------

    def _write_reply(self, n, errors, extra=None):
        reply = {'n': n}
        if extra:
            reply.update(extra)
        if errors:
            reply['writeErrors'] = errors
        reply['ok'] = 1.0
        return reply

    def _check_batch_size(self, ops):
        """mongod's limit on the statements of one write command (checkOpCountForCommand)."""
        if len(ops) > self.max_write_batch:
            raise CommandError(16, 'Write batch sizes must be between 1 and %d. Got %d '
                                   'operations.' % (self.max_write_batch, len(ops)))

    def _injected_write_error(self, index):
        """Fail statement index of the running write command if a failCommand
        writeErrorCode names it."""
        failing = self.failing_writes
        if failing is not None and (failing[1] is None or index in failing[1]):
            raise WriteError(FAIL_COMMAND_MSG, failing[0])

    def cmd_insert(self, db, cmd, name, conn):
        self._check_write_concern(cmd)
        coll_name, coll = self._collection_arg(db, cmd, name)
        docs = cmd.get('documents')
        if not isinstance(docs, list):
            raise CommandError(14, "BSON field 'insert.documents' is missing or has the wrong "
                                   "type")
        self._check_batch_size(docs)
        ordered = cmd.get('ordered', True)
        n = 0
        errors = []
        coll._bypass_validation = bool(cmd.get('bypassDocumentValidation'))
        try:
            for i, doc in enumerate(docs):
                self.opcounters['insert'] += 1
                try:
                    self._injected_write_error(i)
                    if not isinstance(doc, dict):
                        raise CommandError(14, 'documents must be objects')
                    coll._insert(doc)
                    n += 1
                except Exception as exc:  # one failed write never stops the server
                    errors.append(_write_error_entry(i, exc))
                    if ordered:
                        break
        finally:
            coll._bypass_validation = False
        return self._write_reply(n, errors)

    def apply_update(self, coll, spec, update, upsert=False, multi=False, let=None,
                     array_filters=None):
        """Apply one update statement.  Returns (matched, modified, upserted_id)
        where upserted_id is MISSING when nothing was inserted."""
        coll._insert_kind = 'upsert'
        try:
            return self._apply_update(coll, spec, update, upsert, multi, let, array_filters)
        finally:
            coll._insert_kind = 'insert'

    def _apply_update(self, coll, spec, update, upsert, multi, let, array_filters):
        if not isinstance(spec, dict):
            raise CommandError(14, "BSON field 'q' is the wrong type '%s', expected type "
                                   "'object'" % type_name(spec))
        if isinstance(update, list):
            return self._pipeline_update(coll, spec, update, upsert, multi, let)
        if not isinstance(update, dict):
            raise CommandError(14, "Update argument must be either an object or an array")
        if array_filters:
            raise CommandError(238, 'arrayFilters are not supported by the test server')
        keys = list(update)
        if keys and keys[0][:1] == '$':
            for k in keys:
                if k not in CLASSIC_UPDATE_OPERATORS:
                    raise CommandError(9, 'Unknown modifier: %s. Expected a valid update '
                                          'modifier or pipeline-style update specified as an '
                                          'array' % k)
                if not isinstance(update[k], dict):
                    raise CommandError(9, 'Modifiers operate on fields but we found type %s '
                                          'instead. For example: {$mod: {<field>: ...}} not '
                                          '{%s: %s}' % (type_name(update[k]), k,
                                                        fmt_value(update[k])))
            _check_update_conflicts(update)
        else:
            for k in keys:
                if k[:1] == '$':
                    raise CommandError(52, "The dollar ($) prefixed field '%s' in '%s' is not "
                                           "allowed in the context of an update's replacement "
                                           "document. Consider using an aggregation pipeline "
                                           "with $replaceWith." % (k, k))
            if multi:
                raise CommandError(9, 'multi update is not supported for replacement-style '
                                      'update')
        res = coll._update(spec, update, upsert=upsert, multi=multi)
        if not res['updatedExisting'] and res['n']:
            return 1, 0, res['upserted']
        return res['n'], res['nModified'], MISSING

    def _pipeline_update(self, coll, spec, pipeline, upsert, multi, let):
        stages = compile_update_pipeline(pipeline)
        docs = coll._docs()
        matched = modified = 0
        for old in list(coll._iter_documents(spec)):
            matched += 1
            new = run_update_pipeline(old, stages, let)
            if '_id' in new and not bson_eq(new['_id'], old['_id']):
                raise WriteError("Performing an update on the path '_id' would modify the "
                                 "immutable field '_id'", 66)
            new = _with_id_first(new, old['_id'])
            if not _identical(new, old):
                coll.check_write(new, 'update', old)
                coll.add_uniques(new)
                docs[id_key(old['_id'])] = new
                coll.note_update_write()
                modified += 1
            if not multi:
                break
        if matched:
            return matched, modified, MISSING
        if not upsert:
            # MongoDB parses the pipeline even when nothing matches.
            check_update_pipeline(stages)
            return 0, 0, MISSING
        seed = _upsert_seed(coll, spec)
        new = run_update_pipeline(seed, stages, let)
        if '_id' in seed:
            if '_id' in new and not bson_eq(new['_id'], seed['_id']):
                raise WriteError("Performing an update on the path '_id' would modify the "
                                 "immutable field '_id'", 66)
            new = _with_id_first(new, seed['_id'])
        elif '_id' not in new:
            new = _with_id_first(new, ObjectId())
        coll._insert(new)
        return 1, 0, new['_id']

    def cmd_update(self, db, cmd, name, conn):
        self._check_write_concern(cmd)
        coll_name, coll = self._collection_arg(db, cmd, name)
        updates = cmd.get('updates')
        if not isinstance(updates, list):
            raise CommandError(14, "BSON field 'update.updates' is missing or has the wrong "
                                   "type")
        self._check_batch_size(updates)
        ordered = cmd.get('ordered', True)
        let = cmd.get('let')
        sharded = self.sharded(db, coll_name)
        n = modified = 0
        upserted = []
        errors = []
        coll._bypass_validation = bool(cmd.get('bypassDocumentValidation'))
        try:
            for i, u in enumerate(updates):
                self.opcounters['update'] += 1
                try:
                    self._injected_write_error(i)
                    if not isinstance(u, dict) or 'q' not in u or 'u' not in u:
                        raise CommandError(40414, "BSON field 'update.updates.q' is missing "
                                                  "but a required field")
                    if u.get('upsert') and sharded and isinstance(u['q'], dict) and \
                            shard_key_from_query(u['q'], self.shard_key) is None:
                        # mongos targets an upsert by the shard key its filter pins
                        # (chunk_manager_targeter.cpp targetUpdate, 5.x-6.x); a non-upsert
                        # update may go to every shard.
                        raise WriteError(SHARD_KEY_MSG, 61)
                    m, mod, up = self.apply_update(coll, u['q'], u['u'], bool(u.get('upsert')),
                                                   bool(u.get('multi')), let,
                                                   u.get('arrayFilters'))
                except Exception as exc:  # one failed write never stops the server
                    errors.append(_write_error_entry(i, exc))
                    if ordered:
                        break
                    continue
                n += m
                modified += mod
                if up is not MISSING:
                    upserted.append({'index': i, '_id': up})
        finally:
            coll._bypass_validation = False
        extra = {'nModified': modified}
        if upserted:
            extra['upserted'] = upserted
        return self._write_reply(n, errors, extra)

    def cmd_delete(self, db, cmd, name, conn):
        self._check_write_concern(cmd)
        coll_name, coll = self._collection_arg(db, cmd, name)
        deletes = cmd.get('deletes')
        if not isinstance(deletes, list):
            raise CommandError(14, "BSON field 'delete.deletes' is missing or has the wrong "
                                   "type")
        self._check_batch_size(deletes)
        ordered = cmd.get('ordered', True)
        n = 0
        errors = []
        for i, d in enumerate(deletes):
            self.opcounters['delete'] += 1
            try:
                self._injected_write_error(i)
                if not isinstance(d, dict) or not isinstance(d.get('q'), dict):
                    raise CommandError(40414, "BSON field 'delete.deletes.q' is missing but a "
                                              "required field")
                limit = d.get('limit', 0)
                if not is_number(limit) or _num_value(limit) not in (0, 1):
                    raise CommandError(9, 'The limit field in delete objects must be 0 or 1. '
                                          'Got %s' % fmt_value(limit))
                n += coll.delete_matching(d['q'], _num_value(limit) == 1)
            except Exception as exc:  # one failed write never stops the server
                errors.append(_write_error_entry(i, exc))
                if ordered:
                    break
        return self._write_reply(n, errors)

    def cmd_findAndModify(self, db, cmd, name, conn):
        self._check_write_concern(cmd)
        coll_name, coll = self._collection_arg(db, cmd, name)
        coll._bypass_validation = bool(cmd.get('bypassDocumentValidation'))
        try:
            return self._find_and_modify(db, cmd, coll)
        finally:
            coll._bypass_validation = False

    def _find_and_modify(self, db, cmd, coll):
        query = cmd.get('query') or {}
        remove = bool(cmd.get('remove'))
        update = cmd.get('update')
        if remove == (update is not None):
            raise CommandError(9, 'Either an update or remove=true must be specified')
        if remove and cmd.get('new'):
            raise CommandError(9, 'Cannot specify both new=true and remove=true; \'remove\' '
                                  'always returns the deleted document')
        fields = cmd.get('fields')
        matches = list(coll._iter_documents(query))
        if cmd.get('sort'):
            matches = sort_docs(matches, _sort_items(cmd['sort']))
        old = matches[0] if matches else None
        if remove:
            self.opcounters['delete'] += 1
            if old is not None:
                del coll._docs()[id_key(old['_id'])]
            return {'lastErrorObject': {'n': 1 if old is not None else 0},
                    'value': self._project(coll, old, fields) if old is not None else None,
                    'ok': 1.0}
        self.opcounters['update'] += 1
        if old is not None:
            spec = dict(query)
            spec['_id'] = old['_id']
            self.apply_update(coll, spec, update, False, False, cmd.get('let'),
                              cmd.get('arrayFilters'))
            new = coll._docs().get(id_key(old['_id']))
            value = new if cmd.get('new') else old
            return {'lastErrorObject': {'n': 1, 'updatedExisting': True},
                    'value': self._project(coll, value, fields), 'ok': 1.0}
        if not cmd.get('upsert'):
            return {'lastErrorObject': {'n': 0, 'updatedExisting': False}, 'value': None,
                    'ok': 1.0}
        _, _, upserted = self.apply_update(coll, query, update, True, False, cmd.get('let'),
                                           cmd.get('arrayFilters'))
        value = None
        if cmd.get('new'):
            value = self._project(coll, coll._docs().get(id_key(upserted)), fields)
        return {'lastErrorObject': {'n': 1, 'updatedExisting': False, 'upserted': upserted},
                'value': value, 'ok': 1.0}

    # -- reads -------------------------------------------------------------

    def _project(self, coll, doc, projection):
        if not projection or doc is None:
            return doc
        for k, v in projection.items():
            if '$' in k or isinstance(v, dict) and any(
                    op in v for op in ('$slice', '$elemMatch')):
                return coll._copy_only_fields(doc, dict(projection), dict)
        spec = {}
        for k, v in projection.items():
            if isinstance(v, bool) or is_number(v):
                spec[k] = 1 if truthy(v) else 0
            else:
                spec[k] = v
        return project(doc, spec)

    def cmd_find(self, db, cmd, name, conn):
        self.opcounters['query'] += 1
        coll_name, coll = self._collection_arg(db, cmd, name)
        flt = cmd.get('filter')
        if flt is None:
            flt = {}
        if not isinstance(flt, dict):
            raise CommandError(14, "BSON field 'FindCommandRequest.filter' is the wrong type "
                                   "'%s', expected type 'object'" % type_name(flt))
        if cmd.get('tailable'):
            raise CommandError(238, 'tailable cursors are not supported by the test server')
        skip = _as_int(cmd.get('skip'), 'skip', 0) or 0
        limit = _as_int(cmd.get('limit'), 'limit', 0) or 0
        batch = _as_int(cmd.get('batchSize'), 'batchSize', 0)
        docs = list(coll._iter_documents(flt))
        sort = cmd.get('sort')
        if sort:
            if not isinstance(sort, dict):
                raise CommandError(14, "BSON field 'FindCommandRequest.sort' is the wrong type")
            docs = sort_docs(docs, _sort_items(sort))
        if skip:
            docs = docs[skip:]
        if limit:
            docs = docs[:limit]
        projection = cmd.get('projection')
        if projection:
            docs = [self._project(coll, d, projection) for d in docs]
        return self.cursor_reply('%s.%s' % (db, coll_name), docs, batch,
                                 bool(cmd.get('singleBatch')))

    def cmd_count(self, db, cmd, name, conn):
        self.opcounters['command'] += 1
        coll_name, coll = self._collection_arg(db, cmd, name)
        query = cmd.get('query') or {}
        n = sum(1 for _ in coll._iter_documents(query))
        skip = _as_int(cmd.get('skip'), 'skip', 0) or 0
        limit = abs(_as_int(cmd.get('limit'), 'limit') or 0)
        n = max(0, n - skip)
        if limit:
            n = min(n, limit)
        return {'n': n, 'ok': 1.0}

    def cmd_distinct(self, db, cmd, name, conn):
        self.opcounters['command'] += 1
        coll_name, coll = self._collection_arg(db, cmd, name)
        key = cmd.get('key')
        if not isinstance(key, str):
            raise CommandError(14, "BSON field 'distinct.key' is the wrong type")
        seen = set()
        values = []
        for doc in coll._iter_documents(cmd.get('query') or {}):
            for v in mm_filtering.iter_key_candidates(key, doc):
                if v is NOTHING:
                    continue
                for x in (v if isinstance(v, list) else [v]):
                    h = hkey(x)
                    if h not in seen:
                        seen.add(h)
                        values.append(x)
        return {'values': sort_values(values, False), 'ok': 1.0}

    def cmd_aggregate(self, db, cmd, name, conn):
        self.opcounters['command'] += 1
        target = cmd['aggregate']
        pipeline = cmd.get('pipeline')
        if not isinstance(pipeline, list):
            raise CommandError(14, "BSON field 'aggregate.pipeline' is missing or has the "
                                   "wrong type")
        if cmd.get('explain'):
            raise CommandError(238, 'explain is not supported by the test server')
        if not isinstance(cmd.get('cursor'), dict):
            raise CommandError(9, "The 'cursor' option is required, except for aggregate with "
                                  "the explain argument")
        if not isinstance(target, str):
            raise CommandError(238, 'database-level aggregation is not supported by the test '
                                    'server')
        _check_coll_name(db, target)
        coll = self.coll(db, target)
        stages = list(pipeline)
        for st in stages:
            if not isinstance(st, dict) or len(st) != 1:
                raise CommandError(40323, 'A pipeline stage specification object must contain '
                                          'exactly one field.')
        merge = None
        for i, st in enumerate(stages):
            if '$merge' in st:
                spec = parse_merge_spec(st['$merge'], db)
                on_fields = self._merge_on_fields(db, spec)
                if i != len(stages) - 1:
                    raise CommandError(40601, '$merge can only be the final stage in the '
                                              'pipeline')
                merge = (spec, on_fields)
        if merge is not None:
            self._check_write_concern(cmd)
            collation = cmd.get('collation')
            if collation is not None and collation != {'locale': 'simple'}:
                raise CommandError(238, '$merge with a collation is not supported by the test '
                                        'server')
            stages = stages[:-1]
        if stages and '$match' in stages[0]:
            docs = list(coll._iter_documents(stages[0]['$match']))
            stages = stages[1:]
        else:
            docs = list(coll._docs().values())
        names = {next(iter(st)) for st in stages}
        if names & {'$lookup', '$graphLookup', '$facet', '$out'}:
            docs = copy.deepcopy(docs)
        out = list(mm_aggregate.process_pipeline(docs, _DbView(self, db), stages, None))
        if merge is not None:
            self._run_merge(merge[0], merge[1], out, bool(cmd.get('bypassDocumentValidation')))
            out = []
        if stages and '$out' in stages[-1]:
            out = []
        batch = _as_int(cmd['cursor'].get('batchSize'), 'batchSize', 0)
        return self.cursor_reply('%s.%s' % (db, target), out, batch)

    def _merge_on_fields(self, db, spec):
        """The 'on' fields of a $merge, checked against the output collection
        (ensureFieldsUniqueOrResolveDocumentKey): given ones need a supporting unique index,
        51183 (mongos: 51190); with --sharded, an existing output collection counts as
        sharded, given 'on' fields must then hold every shard-key field (mongos finds no
        index otherwise: 51190) and the default is the shard-key fields and _id (the
        document key), which needs no index check."""
        store = self.coll(spec.db, spec.coll)._store
        sharded = self.sharded(spec.db, spec.coll)
        key_paths = [p for p, _ in self.shard_key] if sharded else []
        if spec.on is None:
            if sharded and store.is_created:
                return key_paths + ([] if '_id' in key_paths else ['_id'])
            return ['_id']
        if sharded and store.is_created and not set(key_paths) <= set(spec.on):
            raise CommandError(51190, MERGE_INDEX_MSG)
        if not merge_supporting_index(store, spec.on):
            raise CommandError(51190 if sharded else 51183, MERGE_INDEX_MSG)
        return spec.on

    def _run_merge(self, spec, on_fields, docs, bypass_validation):
        """Write the results of a pipeline as $merge does: in batches (of up to
        MAX_WRITE_BATCH documents and about 16 MiB, as the writer of a $merge batches), each
        document's 'on' fields extracted first (an error there fails the batch unwritten),
        then every write of the batch attempted (the batches are unordered) and the first
        write error, if any, failing the command; earlier batches stay written."""
        coll = self.coll(spec.db, spec.coll)
        with_id = '_id' in on_fields
        coll._bypass_validation = bypass_validation
        try:
            batch = []
            size = 0
            for doc in docs:
                if with_id and '_id' not in doc:
                    doc = dict(doc)
                    doc['_id'] = ObjectId()
                key = {f: merge_on_value(doc, f) for f in on_fields}
                doc_size = bson_size(doc)
                if batch and (len(batch) >= MAX_WRITE_BATCH or
                              size + doc_size > MAX_BSON_SIZE):
                    self._merge_batch(coll, spec, batch)
                    batch, size = [], 0
                batch.append((doc, key))
                size += doc_size
            if batch:
                self._merge_batch(coll, spec, batch)
        finally:
            coll._bypass_validation = False

    def _merge_batch(self, coll, spec, batch):
        error = None
        unmatched = False
        for doc, key in batch:
            self.opcounters['insert' if spec.when_matched == 'fail' else 'update'] += 1
            try:
                if not self._merge_one(coll, spec, doc, key):
                    unmatched = True
            except (OperationFailure, CommandError) as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error
        if unmatched and spec.when_not_matched == 'fail':
            raise CommandError(13113, MERGE_NO_MATCH_MSG)

    def _merge_one(self, coll, spec, doc, key):
        """One result document through the write MongoDB's merge strategy sends for it
        (merge_processor.cpp): whenMatched "fail" inserts it; the others update by the 'on'
        fields, "replace" with the document as a replacement, "merge" with {$set: document},
        "keepExisting" with {$setOnInsert: document}, as an upsert for whenNotMatched
        "insert".  False when nothing matched and nothing was inserted."""
        if spec.when_matched == 'fail':
            coll._insert(dict(doc))
            return True
        old = next(iter(coll._iter_documents(key)), None)
        if old is None:
            if spec.when_not_matched != 'insert':
                return False
            if spec.when_matched == 'replace':
                new = dict(doc)
                _id = new.pop('_id', MISSING)
                if _id is MISSING:
                    _id = key.get('_id', ObjectId())
                new = _with_id_first(new, _id)
            else:
                # {$set | $setOnInsert: document} upserted: the query's equality fields, then
                # the document's (its _id, if any, is the new document's).
                _id = key['_id'] if '_id' in key else doc.get('_id', MISSING)
                new = _merge_set_fields(_upsert_base(key, ObjectId() if _id is MISSING
                                                     else _id), doc)
            coll._insert_kind = 'upsert'
            try:
                coll._insert(new)
            finally:
                coll._insert_kind = 'insert'
            return True
        if spec.when_matched == 'keepExisting':
            return True
        if spec.when_matched == 'replace':
            if '_id' in doc and not _same_value(doc['_id'], old['_id']):
                raise WriteError("After applying the update, the (immutable) field '_id' was "
                                 "found to have been altered to _id: %s"
                                 % fmt_value(doc['_id']), 66)
            new = _with_id_first(doc, old['_id'])
        else:
            if '_id' in doc and not _same_value(doc['_id'], old['_id']):
                raise WriteError("Performing an update on the path '_id' would modify the "
                                 "immutable field '_id'", 66)
            new = _merge_set_fields(old, doc)
        if not _identical(new, old):
            coll.check_write(new, 'update', old)
            coll.add_uniques(new)
            coll._docs()[id_key(old['_id'])] = new
            coll.note_update_write()
        return True


def _check_ttl_option(spec):
    """expireAfterSeconds of a createIndexes spec, as MongoDB 6.0 checks it
    (index_key_validate.cpp validateIndexSpecTTL): a number, not negative, and no more than the
    seconds since 1970."""
    v = spec['expireAfterSeconds']
    shown = fmt_value(dict(spec))
    if not is_number(v):
        raise CommandError(67, "TTL index 'expireAfterSeconds' option must be numeric, but "
                               "received a type of '%s'. Index spec: %s" % (type_name(v), shown))
    if isinstance(v, Decimal128):
        v = v.to_decimal()
    if not (isinstance(v, float) and math.isnan(v)) and int(v) < 0:
        raise CommandError(67, "TTL index 'expireAfterSeconds' option cannot be less than 0. "
                               "Index spec: %s" % shown)
    if not (isinstance(v, float) and math.isnan(v)) and int(v) > int(time.time()):
        raise CommandError(67, "TTL index 'expireAfterSeconds' option must be within an "
                               "acceptable range, try a lower number. Index spec: %s" % shown)


def _same_index_options(a, b):
    ignore = ('key', 'v', 'ns', 'background', 'name')
    oa = {k: v for k, v in a.items() if k not in ignore}
    ob = {k: v for k, v in b.items() if k not in ignore}
    if set(oa) != set(ob):
        return False
    return all(bson_eq(oa[k], ob[k]) for k in oa)


# --------------------------------------------------------------------------
# Wire protocol
# --------------------------------------------------------------------------

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


def main(argv=None):
    parser = argparse.ArgumentParser(
        description='MongoDB wire-compatible in-memory test server (mockupdb + mongomock).')
    parser.add_argument('--port', type=int, default=0,
                        help='TCP port on 127.0.0.1 (default: a free one)')
    parser.add_argument('--verbose', action='store_true',
                        help='log one line per command to stderr')
    parser.add_argument('--sharded', metavar='KEYSPEC',
                        help='refuse upserts like mongos 5.x-6.x does for collections sharded '
                             'by KEYSPEC (e.g. sensor_id:hashed or sensor_id:1,bucket_start:1)')
    parser.add_argument('--unstable-sortarray', action='store_true',
                        help='$sortArray returns equal sort keys in reverse input order')
    parser.add_argument('--fail-command', metavar='JSON',
                        help='configure the failCommand fail point at start: the mode and '
                             'data of configureFailPoint as (extended) JSON')
    parser.add_argument('--max-write-batch', metavar='N', type=int, default=MAX_WRITE_BATCH,
                        help="hello's maxWriteBatchSize, and the most statements a write "
                             'command may carry (default %d)' % MAX_WRITE_BATCH)
    args = parser.parse_args(argv)
    if args.max_write_batch < 1:
        parser.error('--max-write-batch: must be at least 1')
    shard_key = None
    if args.sharded is not None:
        try:
            shard_key = parse_shard_key(args.sharded)
        except ValueError as e:
            parser.error('--sharded: %s' % e)
    fail_command = None
    if args.fail_command is not None:
        try:
            fail_command = json_util.loads(args.fail_command)
            if not isinstance(fail_command, dict):
                raise ValueError('not an object')
        except ValueError as e:
            parser.error('--fail-command: %s' % e)

    # Requests come in with plain dicts rather than OrderedDicts: cheaper to
    # copy and compare, and dicts keep field order anyway.
    mockupdb.CODEC_OPTIONS = CodecOptions(document_class=dict)
    _install_mongomock_fixes()

    # Block the stop signals before any thread starts (threads inherit the
    # mask), so the main thread can wait for them synchronously.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)

    backend = Backend(verbose=args.verbose, shard_key=shard_key,
                      unstable_sort_array=args.unstable_sortarray,
                      max_write_batch=args.max_write_batch)
    if fail_command is not None:
        cmd = {'configureFailPoint': 'failCommand'}
        cmd.update(fail_command)
        reply = backend.run('admin', cmd, 0)
        if not reply.get('ok'):
            parser.error('--fail-command: %s' % reply.get('errmsg'))
    server = WireServer(backend, port=args.port or None, verbose=args.verbose)
    try:
        port = server.run()
    except OSError as e:
        sys.stderr.write('mongo_server: cannot listen on 127.0.0.1:%d: %s\n' % (args.port, e))
        return 1

    # Bucket documents hold many small containers; frequent full collections
    # would dominate the run time.
    gc.collect()
    gc.freeze()
    gc.set_threshold(200000, 50, 100)

    sys.stdout.write('%d\n' % port)
    sys.stdout.flush()
    if args.verbose:
        sys.stderr.write('mongo_server: listening on 127.0.0.1:%d\n' % port)
        sys.stderr.flush()

    signum = signal.sigwait(stop_signals)

    server.shutdown()
    # Let a command that is running finish its reply, then leave without
    # waiting for idle connection threads.
    if backend.lock.acquire(timeout=5):
        backend.lock.release()
    if args.verbose:
        sys.stderr.write('mongo_server: stopped by signal %d\n' % signum)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == '__main__':
    sys.exit(main())
