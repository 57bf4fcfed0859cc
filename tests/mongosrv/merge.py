"""The $merge stage: its spec as MongoDB parses it, and the pieces its writes use.

From src/mongo/db/pipeline/document_source_merge.cpp, document_source_merge_spec.cpp,
merge_processor.cpp and process_interface/common_mongod_process_interface.cpp: the merge modes,
the field-by-field checks of the stage, the unique index 'on' fields need, and how a result is
turned into the document written.  reads.ReadCommands runs the writes.
"""

from .bsonvalues import MISSING, is_number, nullish, type_name
from .commands import _check_coll_name, _check_db_name
from .errors import CommandError, fail
from .expressions import _path_parts
from .pipeline import _set_nested
from .sharding import _identical


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
