"""Sharded mode (--sharded KEYSPEC): mongos's targeting rule for upserts.

Parses the shard-key spec and extracts an exact shard key from an update filter the way
mongos 5.x-6.x does (src/mongo/s/chunk_manager_targeter.cpp targetUpdate,
ShardKeyPattern::extractShardKeyFromQuery); also the checks an update's operators and _id get
before they are applied.
"""

import itertools

import bson
from bson.regex import Regex

from .bsonvalues import MISSING, _RE_PATTERN, bson_cmp, canon
from .errors import CommandError


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
