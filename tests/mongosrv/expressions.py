"""Aggregation expressions with MongoDB's semantics.

ExprParser replaces mongomock's expression parser (installed by
pipeline._install_mongomock_fixes): field paths, $literal, arithmetic with BSON type
promotion, $cond/$ifNull, array operators ($arrayElemAt with negative indexes, $concatArrays,
$sortArray, $map, $filter, $reduce, $objectToArray, $arrayToObject, ...), comparisons in BSON
order, conversions and the accumulator operators used as expressions.
"""

import datetime
import decimal
import math

from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from mongomock import aggregate as mm_aggregate
from pymongo.errors import OperationFailure

from .bsonvalues import (INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, MISSING, _DEC_CTX, _MS,
                         _date_add_ms, _date_ms, _make_dec, _naive, _now, _num_value, _sort_items,
                         _to_dec, bson_cmp, fmt_value, is_number, make_int, nullish, num_kind,
                         num_mul, num_sub, num_sum, sort_docs, sort_values, truthy, type_name)
from .errors import fail
from .limits import note_list_parts


def agg_get(value, parts, i=0):
    """Resolve a field path the way aggregation does: arrays of documents
    yield the array of the sub-field; missing raises KeyError."""
    n = len(parts)
    while i < n:
        if isinstance(value, dict):
            try:
                value = value[parts[i]]
            except KeyError:
                raise KeyError(parts[i]) from None
            i += 1
        elif isinstance(value, list):
            if i == n - 1:
                part = parts[i]
                return [el[part] for el in value if isinstance(el, dict) and part in el]
            out = []
            for el in value:
                if isinstance(el, dict):
                    try:
                        out.append(agg_get(el, parts, i))
                    except KeyError:
                        pass
            return out
        else:
            raise KeyError(parts[i])
    return value


_PATH_CACHE = {}


def _path_parts(path):
    """Split and check a dotted field path (results are cached)."""
    parts = _PATH_CACHE.get(path)
    if parts is not None:
        return parts
    parts = path.split('.')
    for p in parts:
        if not p:
            fail(15998, "FieldPath field names may not be empty strings.")
        if p[0] == '$':
            fail(16410, "FieldPath field names may not start with '$'. "
                        "Consider using $getField or $setField.")
    if len(_PATH_CACHE) > 10000:
        _PATH_CACHE.clear()
    _PATH_CACHE[path] = parts
    return parts


_BaseParser = mm_aggregate._Parser


class ExprParser(_BaseParser):
    """mongomock's expression parser with MongoDB's semantics where they
    differ.  A missing value is signalled by KeyError, as in mongomock."""

    def parse(self, expression):
        t = type(expression)
        if t is str:
            if expression[:1] == '$':
                return self._path(expression)
            return expression
        if t is dict or isinstance(expression, dict):
            for first in expression:
                break
            else:
                return {}
            if first[:1] == '$':
                if len(expression) != 1:
                    fail(15983, 'an expression specification must contain exactly one '
                                'field, the name of the expression. Found %d fields in %s'
                         % (len(expression), fmt_value(expression)))
                handler = _EXPR_HANDLERS.get(first)
                if handler is not None:
                    return handler(self, expression[first])
                try:
                    return _BaseParser.parse(self, expression)
                except OperationFailure as e:
                    if not e.code and str(e).startswith('Unrecognized expression'):
                        fail(168, "Unrecognized expression '%s'" % first)
                    raise
            out = {}
            for k, v in expression.items():
                if k[:1] == '$':
                    fail(16410, "FieldPath field names may not start with '$'. "
                                "Consider using $getField or $setField.")
                try:
                    out[k] = self.parse(v)
                except KeyError:
                    pass
            return out
        if t is list or isinstance(expression, list):
            return [self.value_or_null(e) for e in expression]
        return expression

    def _path(self, expr):
        if expr[1:2] != '$':
            if len(expr) == 1:
                fail(16872, "'$' by itself is not a valid FieldPath")
            parts = _PATH_CACHE.get(expr)
            if parts is None:
                parts = _path_parts(expr[1:])
                _PATH_CACHE[expr] = parts
            value = self._doc_dict
            for i, part in enumerate(parts):
                if type(value) is dict:
                    try:
                        value = value[part]
                    except KeyError:
                        raise KeyError(part) from None
                else:
                    return agg_get(value, parts, i)
            return value
        name, dot, rest = expr[2:].partition('.')
        if name in self._user_vars:
            base = self._user_vars[name]
        elif name in ('ROOT', 'CURRENT'):
            base = self._doc_dict
        elif name == 'REMOVE':
            raise KeyError(expr)
        elif name == 'NOW':
            base = _now()
        else:
            fail(17276, 'Use of undefined variable: %s' % name)
        if not dot:
            return base
        return agg_get(base, _path_parts(rest))

    def eval(self, expression):
        """Evaluate; MISSING instead of KeyError."""
        t = type(expression)
        if t is not dict and t is not list and t is not str:
            return expression
        try:
            return self.parse(expression)
        except KeyError:
            return MISSING

    def value_or_null(self, expression):
        try:
            return self.parse(expression)
        except KeyError:
            return None

    def sub(self, extra_vars):
        return ExprParser(self._doc_dict, dict(self._user_vars, **extra_vars),
                          ignore_missing_keys=self._ignore_missing_keys)


def _args(v, op, n=None, lo=None, hi=None):
    args = v if isinstance(v, list) else [v]
    if n is not None and len(args) != n:
        fail(16020, 'Expression %s takes exactly %d arguments. %d were passed in.'
             % (op, n, len(args)))
    if lo is not None and len(args) < lo:
        fail(16020, 'Expression %s takes at least %d arguments, and at most %d, '
                    'but %d were passed in.' % (op, lo, hi or lo, len(args)))
    if hi is not None and len(args) > hi:
        fail(16020, 'Expression %s takes at least %d arguments, and at most %d, '
                    'but %d were passed in.' % (op, lo or 0, hi, len(args)))
    return args


def _unary(v, op):
    if isinstance(v, list):
        if len(v) != 1:
            fail(16020, 'Expression %s takes exactly 1 arguments. %d were passed in.'
                 % (op, len(v)))
        return v[0]
    return v


def _x_literal(p, v):
    return v


def _x_add(p, v):
    date = None
    nums = []
    is_null = False
    for e in (v if type(v) is list else [v]):
        x = p.eval(e)
        if x is None or x is MISSING:
            is_null = True
        elif type(x) is datetime.datetime:
            if date is not None:
                fail(16612, 'only one date allowed in an $add expression')
            date = x
        elif num_kind(x) is not None:
            nums.append(x)
        else:
            fail(16554, '$add only supports numeric or date types, not %s' % type_name(x))
    if is_null:
        return None
    if date is not None:
        return _date_add_ms(date, num_sum(nums) if nums else 0)
    return num_sum(nums) if nums else 0


def _x_subtract(p, v):
    a, b = [p.eval(e) for e in _args(v, '$subtract', 2)]
    if nullish(a) or nullish(b):
        return None
    if isinstance(a, datetime.datetime):
        if isinstance(b, datetime.datetime):
            return Int64((_naive(a) - _naive(b)) // _MS)
        if is_number(b):
            return _date_add_ms(a, -_num_value(b) if not isinstance(b, Decimal128)
                                else -int(b.to_decimal()))
    elif is_number(a) and is_number(b):
        return num_sub(a, b)
    fail(16556, "can't $subtract %s from %s" % (type_name(b), type_name(a)))


def _x_multiply(p, v):
    nums = []
    is_null = False
    for e in _args(v, '$multiply'):
        x = p.eval(e)
        if nullish(x):
            is_null = True
        elif is_number(x):
            nums.append(x)
        else:
            fail(16555, '$multiply only supports numeric types, not %s' % type_name(x))
    if is_null:
        return None
    return num_mul(nums) if nums else 1


def _x_divide(p, v):
    a, b = [p.eval(e) for e in _args(v, '$divide', 2)]
    if nullish(a) or nullish(b):
        return None
    if not is_number(a) or not is_number(b):
        fail(16609, '$divide only supports numeric types, not %s and %s'
             % (type_name(a), type_name(b)))
    if _num_value(b) == 0:
        fail(16608, "can't $divide by zero")
    if isinstance(a, Decimal128) or isinstance(b, Decimal128):
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(_to_dec(a) / _to_dec(b))
    return float(a) / float(b)


def _x_mod(p, v):
    a, b = [p.eval(e) for e in _args(v, '$mod', 2)]
    if nullish(a) or nullish(b):
        return None
    if not is_number(a) or not is_number(b):
        fail(16611, '$mod only supports numeric types, not %s and %s'
             % (type_name(a), type_name(b)))
    if _num_value(b) == 0:
        fail(16610, "can't $mod by zero")
    kind = max(num_kind(a), num_kind(b))
    if kind == 3:
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(_to_dec(a) % _to_dec(b))
    if kind == 2:
        return math.fmod(float(a), float(b))
    r = abs(int(a)) % abs(int(b))
    return make_int(-r if a < 0 else r, kind)


def _rounding(fn, op):
    def handler(p, v):
        x = p.eval(_unary(v, op))
        if nullish(x):
            return None
        k = num_kind(x)
        if k is None:
            fail(28765, '%s only supports numeric types, not %s' % (op, type_name(x)))
        if k in (0, 1):
            return x
        if k == 3:
            return Decimal128(fn(x.to_decimal()))
        if x != x or x in (float('inf'), float('-inf')):
            return x
        return float(fn(x))
    return handler


def _x_abs(p, v):
    x = p.eval(_unary(v, '$abs'))
    if nullish(x):
        return None
    k = num_kind(x)
    if k is None:
        fail(28765, '$abs only supports numeric types, not %s' % type_name(x))
    if k == 3:
        return Decimal128(abs(x.to_decimal()))
    if k == 2:
        return abs(x)
    return make_int(abs(int(x)), k)


def _x_ifnull(p, v):
    if not isinstance(v, list) or len(v) < 2:
        fail(1257300, '$ifNull needs at least two arguments, had: %d'
             % (len(v) if isinstance(v, list) else 1))
    for e in v[:-1]:
        x = p.eval(e)
        if not nullish(x):
            return x
    return p.parse(v[-1])


def _x_cond(p, v):
    if isinstance(v, list):
        if len(v) != 3:
            fail(16020, 'Expression $cond takes exactly 3 arguments. %d were passed in.'
                 % len(v))
        cond, then, other = v
    elif isinstance(v, dict):
        for k in v:
            if k not in ('if', 'then', 'else'):
                fail(17083, 'Unrecognized parameter to $cond: %s' % k)
        for k in ('if', 'then', 'else'):
            if k not in v:
                fail(17080 + ('if', 'then', 'else').index(k), "Missing '%s' parameter to $cond" % k)
        cond, then, other = v['if'], v['then'], v['else']
    else:
        fail(16020, 'Expression $cond takes exactly 3 arguments. 1 were passed in.')
    return p.parse(then if truthy(p.eval(cond)) else other)


def _x_array_elem_at(p, v):
    arr, idx = [p.eval(e) for e in _args(v, '$arrayElemAt', 2)]
    if nullish(arr) or nullish(idx):
        return None
    if not isinstance(arr, list):
        fail(28689, "$arrayElemAt's first argument must be an array, but is %s"
             % type_name(arr))
    if not is_number(idx):
        fail(28690, "$arrayElemAt's second argument must be a numeric value, but is %s"
             % type_name(idx))
    i = _num_value(idx)
    if i != i or int(i) != i or not INT32_MIN <= int(i) <= INT32_MAX:
        fail(28691, "$arrayElemAt's second argument must be representable as a 32-bit "
                    "integer: %s" % fmt_value(idx))
    i = int(i)
    if i < 0:
        i += len(arr)
    if i < 0 or i >= len(arr):
        raise KeyError('$arrayElemAt')
    return arr[i]


def _first_last(op, pick):
    def handler(p, v):
        x = p.eval(_unary(v, op))
        if nullish(x):
            return None
        if not isinstance(x, list):
            fail(28689, "%s's argument must be an array, but is %s" % (op, type_name(x)))
        if not x:
            raise KeyError(op)
        return x[pick]
    return handler


def _x_concat_arrays(p, v):
    out = []
    parts = []
    for e in _args(v, '$concatArrays'):
        x = p.eval(e)
        if nullish(x):
            return None
        if not isinstance(x, list):
            fail(28664, '$concatArrays only supports arrays, not %s' % type_name(x))
        out.extend(x)
        parts.append(x)
    note_list_parts(out, parts)
    return out


# --unstable-sortarray (set by Backend).
UNSTABLE_SORT_ARRAY = [False]


def _x_sort_array(p, v):
    if not isinstance(v, dict):
        fail(2, 'sortArray expects an object as its argument, but found: %s' % type_name(v))
    for k in v:
        if k not in ('input', 'sortBy'):
            fail(2, '$sortArray found an unknown argument: %s' % k)
    if 'input' not in v:
        fail(2, "$sortArray requires 'input' to be specified")
    if 'sortBy' not in v:
        fail(2, "$sortArray requires 'sortBy' to be specified")
    sort_by = v['sortBy']
    if isinstance(sort_by, dict):
        if not sort_by:
            fail(2, 'sortBy must not be empty')
        keys = _sort_items(sort_by)
    elif is_number(sort_by) and _num_value(sort_by) in (1, -1):
        keys = None
    else:
        fail(2, 'sortBy must be either 1, -1, or an object')
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(2, 'The input argument to $sortArray must be an array, but was of type: %s'
             % type_name(arr))
    # The server documents no stability for $sortArray; with --unstable-sortarray elements
    # with equal sort keys come out in reverse input order (the sorts below are stable, also
    # for descending order), so that code relying on a stable sort fails here as it could on a
    # real server.
    src = arr[::-1] if UNSTABLE_SORT_ARRAY[0] else arr
    if keys is None:
        out = sort_values(src, _num_value(sort_by) < 0)
    else:
        out = sort_docs(src, keys)
    note_list_parts(out, [arr])
    return out


def _accumulator_inputs(p, v):
    """Operands of $min/$max/$sum/$avg used as expressions: one operand that
    is an array is traversed, several operands are taken as they are."""
    if isinstance(v, list) and len(v) != 1:
        return [p.eval(e) for e in v]
    x = p.eval(v[0] if isinstance(v, list) else v)
    if isinstance(x, list):
        return x
    return [x]


def bson_min_max(values, want_max):
    best = MISSING
    for x in values:
        if nullish(x):
            continue
        if best is MISSING:
            best = x
            continue
        c = bson_cmp(x, best)
        if (c > 0) if want_max else (c < 0):
            best = x
    return None if best is MISSING else best


def sum_numbers(values):
    nums = [x for x in values if is_number(x)]
    if not nums:
        return 0
    return num_sum(nums)


def avg_numbers(values):
    nums = [x for x in values if is_number(x)]
    if not nums:
        return None
    if any(isinstance(x, Decimal128) for x in nums):
        with decimal.localcontext(_DEC_CTX):
            return _make_dec(num_sum(nums).to_decimal() / len(nums))
    return float(_num_value(num_sum(nums))) / len(nums)


def _x_min(p, v):
    return bson_min_max(_accumulator_inputs(p, v), False)


def _x_max(p, v):
    return bson_min_max(_accumulator_inputs(p, v), True)


def _x_sum(p, v):
    return sum_numbers(_accumulator_inputs(p, v))


def _x_avg(p, v):
    return avg_numbers(_accumulator_inputs(p, v))


def _comparison(op, test):
    def handler(p, v):
        a, b = [p.eval(e) for e in _args(v, op, 2)]
        return test(bson_cmp(a, b))
    return handler


def _x_cmp(p, v):
    a, b = [p.eval(e) for e in _args(v, '$cmp', 2)]
    return bson_cmp(a, b)


def _x_and(p, v):
    for e in _args(v, '$and'):
        if not truthy(p.eval(e)):
            return False
    return True


def _x_or(p, v):
    for e in _args(v, '$or'):
        if truthy(p.eval(e)):
            return True
    return False


def _x_not(p, v):
    return not truthy(p.eval(_unary(v, '$not')))


def _x_in(p, v):
    x, arr = [p.eval(e) for e in _args(v, '$in', 2)]
    if not isinstance(arr, list):
        fail(40081, '$in requires an array as a second argument, found: %s' % type_name(arr))
    return any(bson_cmp(x, el) == 0 for el in arr)


def _x_size(p, v):
    x = p.eval(_unary(v, '$size'))
    if not isinstance(x, list):
        fail(17124, 'The argument to $size must be an array. Type of argument is %s'
             % type_name(x))
    return len(x)


def _x_type(p, v):
    return type_name(p.eval(_unary(v, '$type')))


def _x_is_array(p, v):
    return isinstance(p.eval(_unary(v, '$isArray')), list)


def _x_is_number(p, v):
    return is_number(p.eval(_unary(v, '$isNumber')))


def _convert_int(x, op, bits):
    if nullish(x):
        return None
    lo, hi = (INT32_MIN, INT32_MAX) if bits == 32 else (INT64_MIN, INT64_MAX)
    if isinstance(x, bool):
        n = int(x)
    elif is_number(x):
        f = _num_value(x)
        if f != f or f in (float('inf'), float('-inf')):
            fail(241, 'Attempt to convert NaN or infinity value to integer in %s' % op)
        n = int(f)
    elif isinstance(x, datetime.datetime) and bits == 64:
        n = _date_ms(x)
    elif isinstance(x, str):
        try:
            n = int(x.strip(), 10)
        except ValueError:
            fail(241, 'Failed to parse number \'%s\' in $convert with no onError value' % x)
    else:
        fail(241, 'Unsupported conversion from %s to %s in $convert with no onError value'
             % (type_name(x), 'int' if bits == 32 else 'long'))
    if not lo <= n <= hi:
        fail(241, 'Conversion would overflow target type in $convert with no onError value')
    return int(n) if bits == 32 else Int64(n)


def _x_to_int(p, v):
    return _convert_int(p.eval(_unary(v, '$toInt')), '$toInt', 32)


def _x_to_long(p, v):
    return _convert_int(p.eval(_unary(v, '$toLong')), '$toLong', 64)


def _x_to_double(p, v):
    x = p.eval(_unary(v, '$toDouble'))
    if nullish(x):
        return None
    if isinstance(x, bool):
        return float(x)
    if is_number(x):
        return float(_num_value(x))
    if isinstance(x, datetime.datetime):
        return float(_date_ms(x))
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            fail(241, "Failed to parse number '%s' in $convert with no onError value" % x)
    fail(241, 'Unsupported conversion from %s to double in $convert with no onError value'
         % type_name(x))


def _x_to_bool(p, v):
    x = p.eval(_unary(v, '$toBool'))
    if nullish(x):
        return None
    return truthy(x)


def _x_to_date(p, v):
    x = p.eval(_unary(v, '$toDate'))
    if nullish(x):
        return None
    if isinstance(x, datetime.datetime):
        return x
    if is_number(x) and not isinstance(x, bool):
        return _date_add_ms(datetime.datetime(1970, 1, 1), _num_value(x))
    if isinstance(x, ObjectId):
        return x.generation_time.replace(tzinfo=None)
    fail(241, 'Unsupported conversion from %s to date in $convert with no onError value'
         % type_name(x))


def _x_merge_objects(p, v):
    out = {}
    for e in _args(v, '$mergeObjects'):
        x = p.eval(e)
        if nullish(x):
            continue
        if not isinstance(x, dict):
            fail(40400, '$mergeObjects requires object inputs, but input %s is of type %s'
                 % (fmt_value(x), type_name(x)))
        out.update(x)
    return out


def _x_map(p, v):
    if not isinstance(v, dict):
        fail(16878, '$map only supports an object as its argument')
    for k in v:
        if k not in ('input', 'as', 'in'):
            fail(16879, 'Unrecognized parameter to $map: %s' % k)
    for k in ('input', 'in'):
        if k not in v:
            fail(16881 if k == 'in' else 16880, "Missing '%s' parameter to $map" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(16883, 'input to $map must be an array not %s' % type_name(arr))
    name = v.get('as', 'this')
    return [p.sub({name: item}).value_or_null(v['in']) for item in arr]


def _x_let(p, v):
    if not isinstance(v, dict):
        fail(16874, '$let only supports an object as its argument')
    for k in v:
        if k not in ('vars', 'in'):
            fail(16875, 'Unrecognized parameter to $let: %s' % k)
    if 'vars' not in v:
        fail(16876, "Missing 'vars' parameter to $let")
    if 'in' not in v:
        fail(16877, "Missing 'in' parameter to $let")
    if not isinstance(v['vars'], dict):
        fail(10065, "invalid parameter: expected an object (vars)")
    # Every variable is evaluated in the outer scope, then 'in' sees them all.
    values = {name: p.value_or_null(expr) for name, expr in v['vars'].items()}
    return p.sub(values).value_or_null(v['in'])


def _x_range(p, v):
    args = _args(v, '$range', lo=2, hi=3)
    vals = [p.eval(a) for a in args]
    for what, x in zip(('starting value', 'ending value', 'step value'), vals):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or int(x) != x or \
                not -2 ** 31 <= int(x) < 2 ** 31:
            fail(34443, '$range requires a %s that can be represented as a 32-bit integer, '
                 'found value: %r' % (what, x))
    start, end = int(vals[0]), int(vals[1])
    step = int(vals[2]) if len(vals) == 3 else 1
    if step == 0:
        fail(34449, '$range requires a non-zero step value')
    return list(range(start, end, step))


def _x_filter(p, v):
    if not isinstance(v, dict):
        fail(28646, '$filter only supports an object as its argument')
    for k in v:
        if k not in ('input', 'as', 'cond', 'limit'):
            fail(28647, 'Unrecognized parameter to $filter: %s' % k)
    for k in ('input', 'cond'):
        if k not in v:
            fail(28648 if k == 'input' else 28650, "Missing '%s' parameter to $filter" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(28651, 'input to $filter must be an array not %s' % type_name(arr))
    limit = None
    if 'limit' in v:
        limit = p.eval(v['limit'])
        if nullish(limit):
            limit = None
        elif not is_number(limit) or _num_value(limit) < 1:
            fail(327392, '$filter: limit must be greater than 0')
        else:
            limit = int(_num_value(limit))
    name = v.get('as', 'this')
    out = []
    for item in arr:
        if truthy(p.sub({name: item}).eval(v['cond'])):
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
    return out


def _x_object_to_array(p, v):
    x = p.eval(_unary(v, '$objectToArray'))
    if nullish(x):
        return None
    if not isinstance(x, dict):
        fail(40390, '$objectToArray requires a document input, found: %s' % type_name(x))
    return [{'k': k, 'v': val} for k, val in x.items()]


def _x_array_to_object(p, v):
    """$arrayToObject (ExpressionArrayToObject): [{k, v}, ...] or [[k, v], ...], one format
    throughout; a repeated key keeps its first position and takes the last value."""
    arr = p.eval(_unary(v, '$arrayToObject'))
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(40386, '$arrayToObject requires an array input, found: %s' % type_name(arr))
    out = {}
    if not arr:
        return out
    objects = isinstance(arr[0], dict)
    if not objects and not isinstance(arr[0], list):
        fail(40398, 'Unrecognised input type format for $arrayToObject: %s' % type_name(arr[0]))
    for el in arr:
        if objects:
            if not isinstance(el, dict):
                fail(40391, '$arrayToObject requires a consistent input format. Elements must '
                            'all be arrays or all be objects. Object was detected, now found: '
                            '%s' % type_name(el))
            if len(el) != 2:
                fail(40392, "$arrayToObject requires an object keys of 'k' and 'v'. Found "
                            "incorrect number of keys:%d" % len(el))
            if 'k' not in el or 'v' not in el:
                fail(40393, "$arrayToObject requires an object with keys 'k' and 'v'. Missing "
                            "either or both keys from: %s" % fmt_value(el))
            key, value = el['k'], el['v']
            if not isinstance(key, str):
                fail(40394, "$arrayToObject requires an object with keys 'k' and 'v', where "
                            "the value of 'k' must be of type string. Found type: %s"
                     % type_name(key))
            if '\x00' in key:
                fail(4940401, "Key field cannot contain an embedded null byte")
        else:
            if not isinstance(el, list):
                fail(40396, '$arrayToObject requires a consistent input format. Elements must '
                            'all be arrays or all be objects. Array was detected, now found: '
                            '%s' % type_name(el))
            if len(el) != 2:
                fail(40397, '$arrayToObject requires an array of size 2 arrays,found array of '
                            'size: %d' % len(el))
            key, value = el
            if not isinstance(key, str):
                fail(40395, '$arrayToObject requires an array of key-value pairs, where the key '
                            'must be of type string. Found key type: %s' % type_name(key))
            if '\x00' in key:
                fail(4940400, "Key field cannot contain an embedded null byte")
        out[key] = value
    return out


def _x_reduce(p, v):
    if not isinstance(v, dict):
        fail(40075, '$reduce only supports an object as its argument')
    for k in ('input', 'initialValue', 'in'):
        if k not in v:
            fail(40077, "Missing '%s' parameter to $reduce" % k)
    arr = p.eval(v['input'])
    if nullish(arr):
        return None
    if not isinstance(arr, list):
        fail(40080, 'input to $reduce must be an array not %s' % type_name(arr))
    acc = p.eval(v['initialValue'])
    for item in arr:
        acc = p.sub({'value': acc, 'this': item}).eval(v['in'])
    if acc is MISSING:
        raise KeyError('$reduce')
    return acc


_EXPR_HANDLERS = {
    '$literal': _x_literal,
    '$add': _x_add,
    '$subtract': _x_subtract,
    '$multiply': _x_multiply,
    '$divide': _x_divide,
    '$mod': _x_mod,
    '$abs': _x_abs,
    '$floor': _rounding(math.floor, '$floor'),
    '$ceil': _rounding(math.ceil, '$ceil'),
    '$ifNull': _x_ifnull,
    '$cond': _x_cond,
    '$arrayElemAt': _x_array_elem_at,
    '$first': _first_last('$first', 0),
    '$last': _first_last('$last', -1),
    '$concatArrays': _x_concat_arrays,
    '$sortArray': _x_sort_array,
    '$min': _x_min,
    '$max': _x_max,
    '$sum': _x_sum,
    '$avg': _x_avg,
    '$eq': _comparison('$eq', lambda c: c == 0),
    '$ne': _comparison('$ne', lambda c: c != 0),
    '$gt': _comparison('$gt', lambda c: c > 0),
    '$gte': _comparison('$gte', lambda c: c >= 0),
    '$lt': _comparison('$lt', lambda c: c < 0),
    '$lte': _comparison('$lte', lambda c: c <= 0),
    '$cmp': _x_cmp,
    '$and': _x_and,
    '$or': _x_or,
    '$not': _x_not,
    '$in': _x_in,
    '$size': _x_size,
    '$type': _x_type,
    '$isArray': _x_is_array,
    '$isNumber': _x_is_number,
    '$toInt': _x_to_int,
    '$toLong': _x_to_long,
    '$toDouble': _x_to_double,
    '$toBool': _x_to_bool,
    '$toDate': _x_to_date,
    '$mergeObjects': _x_merge_objects,
    '$map': _x_map,
    '$let': _x_let,
    '$range': _x_range,
    '$filter': _x_filter,
    '$reduce': _x_reduce,
    '$objectToArray': _x_object_to_array,
    '$arrayToObject': _x_array_to_object,
}


def _expr_for_match(expression, doc, ignore_missing_keys=False):
    """$expr inside a query: true when the expression is truthy."""
    try:
        return truthy(ExprParser(doc, ignore_missing_keys=True).parse(expression))
    except KeyError:
        return False
