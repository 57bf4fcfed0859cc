"""Databases, collections and indexes: the catalog commands of Backend.

listDatabases, listCollections, create and collMod (validators, TTL changes), drop,
dropDatabase, renameCollection, dbStats, collStats, bucketdTestStats (the rewrite-cost
counters), createIndexes, listIndexes and dropIndexes, with the checks MongoDB 6.0 makes.
"""

import math
import time
import uuid

import bson
from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from mongomock import filtering as mm_filtering

from .bsonvalues import _num_value, bson_cmp, bson_eq, fmt_value, is_number, type_name
from .commands import _as_int, _check_coll_name
from .errors import CommandError
from .limits import (VALIDATION_ACTIONS, VALIDATION_LEVELS, bson_size, check_json_schema,
                     clear_size_memo, validator_matches)
from .store import _UniqueIndex


class CatalogCommands(object):
    """The catalog commands, for Backend: run under Backend.lock."""

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
