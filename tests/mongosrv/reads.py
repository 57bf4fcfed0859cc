"""Read commands: find, count, distinct and aggregate, and the writes of $merge."""

import copy

from bson.objectid import ObjectId
from mongomock import aggregate as mm_aggregate
from mongomock import filtering as mm_filtering
from pymongo.errors import OperationFailure, WriteError
from sentinels import NOTHING

from .bsonvalues import (MAX_BSON_SIZE, MAX_WRITE_BATCH, MISSING, _sort_items, fmt_value, hkey,
                         is_number, sort_docs, sort_values, truthy, type_name)
from .commands import _DbView, _as_int, _check_coll_name
from .errors import CommandError
from .limits import bson_size
from .merge import (MERGE_INDEX_MSG, MERGE_NO_MATCH_MSG, _merge_set_fields, _same_value,
                    _upsert_base, merge_on_value, merge_supporting_index, parse_merge_spec)
from .pipeline import project
from .sharding import _identical, _with_id_first
from .store import id_key


class ReadCommands(object):
    """The read commands and $merge, for Backend: run under Backend.lock."""

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
