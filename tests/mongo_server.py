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
python3-mongomock.  On top of those this server adds what the daemon and the
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

This file is the entry point (the command line above, main) and keeps the names its users import
(Backend, WireServer, bson_size, parse_shard_key, ...); the server itself is the package
tests/mongosrv beside it, one module per role:

  errors       error code names, CommandError, DupKeyError, error replies
  bsonvalues   constants and limits; BSON comparison order, numbers, sorting
  expressions  aggregation expressions (ExprParser)
  pipeline     update-pipeline and aggregate stages, $group, $unwind, mongomock fixes
  store        FastCollection: copy-on-write collections, _id fast path, unique indexes
  limits       the 16 MiB document limit (BSON sizes) and collection validators
  commands     what the command handlers share (writeErrors entries, name checks, cursors)
  sharding     --sharded: mongos's shard-key targeting of upserts
  merge        the $merge stage's spec and merge strategies
  failpoints   FailPoint and the failCommand fail point
  backend      Backend: command dispatch, cursors, handshake and admin commands
  catalog      databases, collections and indexes (create, collMod, TTL, stats)
  writes       insert, update, delete, findAndModify
  reads        find, count, distinct, aggregate and the writes of $merge
  wire         wire protocol framing and WireServer
"""

import argparse
import gc
import os
import signal
import sys

from bson import json_util
from bson.codec_options import CodecOptions
import mockupdb

from mongosrv.backend import Backend
from mongosrv.bsonvalues import MAX_BSON_SIZE, MAX_WIRE_VERSION, MAX_WRITE_BATCH, SERVER_VERSION
from mongosrv.errors import CommandError
from mongosrv.failpoints import FailPoint
from mongosrv.limits import bson_size
from mongosrv.pipeline import _install_mongomock_fixes
from mongosrv.sharding import parse_shard_key, shard_key_from_query
from mongosrv.wire import WireServer

# The names the tests import from this module (tests/e2e/test_mongo_server.py).
__all__ = ['Backend', 'CommandError', 'FailPoint', 'MAX_BSON_SIZE', 'MAX_WIRE_VERSION',
           'MAX_WRITE_BATCH', 'SERVER_VERSION', 'WireServer', '_install_mongomock_fixes',
           'bson_size', 'main', 'parse_shard_key', 'shard_key_from_query']


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
