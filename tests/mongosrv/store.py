"""Collections: FastCollection, a copy-on-write mongomock collection with an O(1) path for
{_id: X} filters, a one-pass path for an $or of equalities (the flusher's page look-up),
unique secondary indexes checked without scanning, and per-collection counters of the
documents updates wrote (bucketdTestStats).
"""

import copy
import datetime
import itertools

from bson.objectid import ObjectId
from bson.regex import Regex
from mongomock import collection as mm_collection
from mongomock import filtering as mm_filtering
from mongomock import helpers as mm_helpers
from pymongo.errors import DuplicateKeyError, WriteError
from sentinels import NOTHING

from .bsonvalues import MAX_BSON_SIZE, MISSING, _RE_PATTERN, fmt_value, hkey
from .errors import DupKeyError
from .limits import _check_validator, _too_large, bson_size


def id_key(value):
    """The key mongomock stores a document under."""
    if isinstance(value, dict):
        return mm_helpers.hashdict(value)
    return value


_NO_FAST = object()


# Values an $or clause may pin a field to for the one-pass path: a document field holding one of
# these types equals the clause's value exactly when Python's == says so (no numbers: 1 == True
# and 1 == 1.0 follow other rules in MongoDB).
_OR_SCALARS = (str, datetime.datetime)


def _or_of_equalities(spec):
    """(keys, set of value tuples) when the filter is {$or: [clause, ...]} whose clauses all pin
    the same top-level fields, in the same order, to strings or dates, else None. The flusher's
    page look-up ({$or: [{sensor_id, bucket_start}, ...]}, hundreds of clauses) is such a
    query; mongomock's matcher would try every clause on every document."""
    if not isinstance(spec, dict) or len(spec) != 1:
        return None
    clauses = spec.get('$or')
    if not isinstance(clauses, list) or not clauses or not isinstance(clauses[0], dict):
        return None
    keys = tuple(clauses[0])
    if not keys or any(not isinstance(k, str) or '.' in k or k.startswith('$') for k in keys):
        return None
    wanted = set()
    for c in clauses:
        if not isinstance(c, dict) or tuple(c) != keys:
            return None
        vals = tuple(c[k] for k in keys)
        if any(type(v) not in _OR_SCALARS for v in vals):
            return None
        wanted.add(vals)
    return keys, wanted


def _or_applies(spec, keys, wanted, doc):
    """A document whose fields hold strings or dates matches when its value tuple is wanted;
    any other (a field missing, an array, a document) goes through mongomock's matcher."""
    vals = tuple(doc.get(k, MISSING) for k in keys)
    if all(type(v) in _OR_SCALARS for v in vals):
        return vals in wanted
    return mm_filtering.filter_applies(spec, doc)


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
            fast_or = _or_of_equalities(filter)
            if not docs:
                mm_filtering.filter_applies(filter, {})
                matches = []
            elif fast_or is not None:
                keys, wanted = fast_or
                matches = [d for d in list(docs.values()) if _or_applies(filter, keys, wanted, d)]
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
