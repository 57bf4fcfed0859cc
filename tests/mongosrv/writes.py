"""Write commands: insert, update, delete and findAndModify, answering like MongoDB.

n, nModified, upserted and writeErrors with codes, ordered and unordered; update pipelines
and classic updates with MongoDB's upsert seeding; the write batch limit; the per-statement
write errors of failCommand's writeErrorCode; the sharded-mode upsert check.
"""

from bson.objectid import ObjectId
from pymongo.errors import WriteError

from .bsonvalues import (MISSING, _num_value, _sort_items, bson_eq, fmt_value, is_number,
                         sort_docs, type_name)
from .commands import _upsert_seed, _write_error_entry
from .errors import CommandError
from .failpoints import FAIL_COMMAND_MSG
from .pipeline import (CLASSIC_UPDATE_OPERATORS, check_update_pipeline, compile_update_pipeline,
                       run_update_pipeline)
from .sharding import (SHARD_KEY_MSG, _check_update_conflicts, _identical, _with_id_first,
                       shard_key_from_query)
from .store import id_key


class WriteCommands(object):
    """The write commands, for Backend: run under Backend.lock."""

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
