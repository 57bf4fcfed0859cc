"""The server's constants and BSON values as MongoDB orders and computes them.

The identity the server reports (version, wire version, limits) and the BSON value model the
rest of the package builds on: canonical type order and comparison across types (bson_cmp),
missing versus null, int32/int64/double/Decimal128 arithmetic with MongoDB's promotion rules,
value formatting for error messages, and sorting values and documents in BSON order.
"""

import datetime
import decimal
import functools
import math
import re
import uuid

from bson.binary import Binary
from bson.code import Code
from bson.dbref import DBRef
from bson.decimal128 import Decimal128, create_decimal128_context
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from mongomock import filtering as mm_filtering
from sentinels import NOTHING

from .errors import fail


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
