"""What MongoDB refuses to store: documents over 16 MiB, documents failing validation.

The BSON size of documents, computed incrementally for bucket readings (what the 16 MiB limit
and the rewrite-cost counters need), the errors of the limit, and collection validators:
validationLevel and validationAction, query operators and a top-level $jsonSchema subset.
"""

import datetime
import re
import sys

import bson
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.timestamp import Timestamp
from mongomock import filtering as mm_filtering
from pymongo.errors import WriteError

from .bsonvalues import (INT32_MAX, INT32_MIN, MAX_BSON_SIZE, _num_value, bson_eq, fmt_value,
                         is_number, type_name)
from .errors import CommandError


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
