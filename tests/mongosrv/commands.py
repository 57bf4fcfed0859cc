"""What the command handlers share: writeErrors entries, database and collection name
checks, cursors, integer arguments, the seed document of an upsert and the database view
mongomock's aggregation stages need.
"""

import re

import bson
from bson.decimal128 import Decimal128
from pymongo.errors import DuplicateKeyError, OperationFailure

from .bsonvalues import is_number, type_name
from .errors import CommandError, DupKeyError


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


class _DbView(object):
    """What mongomock's $lookup/$out stages need from a database."""

    def __init__(self, backend, db):
        self._backend = backend
        self.name = db

    def get_collection(self, name):
        return self._backend.coll(self.name, name)

    __getitem__ = get_collection
