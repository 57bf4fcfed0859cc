"""The pipeline stages of update pipelines and aggregate, and the fixes to mongomock.

$addFields/$set, $unset, $project, $replaceRoot/$replaceWith compiled
once per spec; $group with MongoDB's accumulators; $unwind with its options and errors; the
classic update operators mongomock gets wrong for BSON types; and _install_mongomock_fixes,
which routes mongomock's aggregation, filtering and update code through all of these.
"""

import functools
import itertools

from bson.int64 import Int64
import mongomock
from mongomock import aggregate as mm_aggregate
from mongomock import collection as mm_collection
from mongomock import filtering as mm_filtering
from pymongo.errors import WriteError

from .bsonvalues import (MISSING, SERVER_VERSION, _sort_items, bson_cmp, canon, fmt_value, hkey,
                         is_number, nullish, num_mul, num_sum, sort_docs, type_name)
from .errors import fail
from .expressions import (ExprParser, _EXPR_HANDLERS, _expr_for_match, _path_parts, avg_numbers,
                          bson_min_max, sum_numbers)


def _is_expression_object(v):
    if type(v) is not dict and not isinstance(v, dict):
        return False
    for first in v:
        return first[:1] == '$'
    return False


def _add_to_tree(node, path, expr, stage, values):
    parts = _path_parts(path)
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = ('node', {})
        elif child[0] != 'node':
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        node = child[1]
    last = parts[-1]
    if isinstance(expr, dict) and not _is_expression_object(expr):
        if not expr:
            fail(40180, 'Invalid %s :: caused by :: an empty object is not a valid value. '
                        'Found empty object at path %s' % (stage, path))
        child = node.get(last)
        if child is None:
            child = node[last] = ('node', {})
        elif child[0] != 'node':
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        for k, v in expr.items():
            _add_to_tree(child[1], k, v, stage, values)
    else:
        if last in node:
            fail(31250, 'Invalid %s :: caused by :: Path collision at %s' % (stage, path))
        node[last] = ('expr', len(values))
        values.append(expr)


_PLAN_CACHE = {}


def compile_add_fields(spec, stage='$addFields'):
    """Compile a $set/$addFields stage into (plan, expressions): the plan is
    a tree {field: ('expr', i) | ('node', subtree)} with dotted paths and
    nested field specs merged; plans are cached by the spec's field names."""
    if not isinstance(spec, dict):
        fail(40272, '%s specification stage must be an object, got %s' % (stage, type_name(spec)))
    if not spec:
        fail(40177, 'Invalid %s :: caused by :: specification must have at least one field'
             % stage)
    flat = True
    for v in spec.values():
        if isinstance(v, dict) and not _is_expression_object(v):
            flat = False
            break
    if flat:
        keys = tuple(spec)
        plan = _PLAN_CACHE.get(keys)
        if plan is not None:
            return plan, list(spec.values())
    tree = {}
    values = []
    for path, expr in spec.items():
        _add_to_tree(tree, path, expr, stage, values)
    if flat:
        if len(_PLAN_CACHE) > 1000:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[keys] = tree
    return tree, values


def _apply_fields(out, tree, vals):
    for k, (kind, x) in tree.items():
        if kind == 'expr':
            v = vals[x]
            if v is MISSING:
                out.pop(k, None)
            else:
                out[k] = v
        else:
            out[k] = _apply_subtree(out.get(k, MISSING), x, vals)


def _apply_subtree(value, tree, vals):
    if isinstance(value, dict):
        out = dict(value)
        _apply_fields(out, tree, vals)
        return out
    if isinstance(value, list):
        return [_apply_subtree(el, tree, vals) for el in value]
    out = {}
    _apply_fields(out, tree, vals)
    return out


def add_fields(doc, compiled, user_vars=None):
    """$addFields/$set: every expression sees the stage's input document;
    the result is a new document (the input is not modified)."""
    tree, exprs = compiled
    parser = ExprParser(doc, user_vars, ignore_missing_keys=True)
    vals = [parser.eval(e) for e in exprs]
    out = dict(doc)
    _apply_fields(out, tree, vals)
    return out


def compile_unset(spec):
    paths = [spec] if isinstance(spec, str) else spec
    if not isinstance(paths, list) or not paths:
        fail(31002, '$unset specification must be a string or an array')
    tree = {}
    for path in paths:
        if not isinstance(path, str):
            fail(31120, '$unset specification must be a string or an array containing only '
                        'string values')
        node = tree
        parts = _path_parts(path)
        for p in parts[:-1]:
            child = node.get(p)
            if child is True:
                break
            if child is None:
                child = node[p] = {}
            node = child
        else:
            node[parts[-1]] = True
    return tree


def _exclude(value, tree):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            t = tree.get(k)
            if t is True:
                continue
            out[k] = _exclude(v, t) if t else v
        return out
    if isinstance(value, list):
        return [_exclude(el, tree) for el in value]
    return value


def replace_root(doc, expr, user_vars=None):
    new = ExprParser(doc, user_vars, ignore_missing_keys=True).eval(expr)
    if not isinstance(new, dict):
        fail(40228, "'replacement document' must evaluate to an object, but resulting value "
                    "was: %s. Type of resulting value: '%s'. Input document: %s"
             % ('MISSING' if new is MISSING else fmt_value(new), type_name(new),
                fmt_value({'_id': doc.get('_id')})))
    return new


def project(doc, spec):
    if not spec:
        fail(51272, '$project specification must have at least one field')
    out = mm_aggregate._handle_project_stage([doc], None, spec)
    return out[0] if out else {}


def compile_update_pipeline(pipeline):
    stages = []
    for stage in pipeline:
        if not isinstance(stage, dict) or len(stage) != 1:
            fail(40323, 'A pipeline stage specification object must contain exactly one field.')
        (name, spec), = stage.items()
        if name in ('$addFields', '$set'):
            stages.append(('set', compile_add_fields(spec, name)))
        elif name == '$unset':
            stages.append(('unset', compile_unset(spec)))
        elif name == '$project':
            if not isinstance(spec, dict):
                fail(15969, '$project specification must be an object')
            stages.append(('project', spec))
        elif name == '$replaceRoot':
            if not isinstance(spec, dict) or 'newRoot' not in spec:
                fail(40231, "no newRoot specified for the $replaceRoot stage")
            stages.append(('replace', spec['newRoot']))
        elif name == '$replaceWith':
            stages.append(('replace', spec))
        else:
            fail(72, '%s is not allowed to be used within an update' % name)
    return stages


_MONGOMOCK_OPERATORS = frozenset(itertools.chain(
    mm_aggregate.arithmetic_operators, mm_aggregate.project_operators,
    mm_aggregate.projection_operators, mm_aggregate.comparison_operators,
    mm_aggregate.date_operators, mm_aggregate.array_operators,
    mm_aggregate.conditional_operators, mm_aggregate.control_flow_operators,
    mm_aggregate.set_operators, mm_aggregate.string_operators,
    mm_aggregate.type_convertion_operators, mm_aggregate.boolean_operators))


def check_expression(expr):
    """Reject unknown expression operators without evaluating anything."""
    if isinstance(expr, list):
        for e in expr:
            check_expression(e)
    elif isinstance(expr, dict):
        for k, v in expr.items():
            if k[:1] == '$':
                if k not in _EXPR_HANDLERS and k not in _MONGOMOCK_OPERATORS:
                    fail(168, "Unrecognized expression '%s'" % k)
                if k == '$literal':
                    continue
            check_expression(v)


def check_update_pipeline(stages):
    for kind, spec in stages:
        if kind == 'set':
            check_expression(spec[1])
        elif kind == 'replace':
            check_expression(spec)
        elif kind == 'project':
            check_expression(list(spec.values()))


def run_update_pipeline(doc, stages, user_vars=None):
    for kind, spec in stages:
        if kind == 'set':
            doc = add_fields(doc, spec, user_vars)
        elif kind == 'unset':
            doc = _exclude(doc, spec)
        elif kind == 'project':
            doc = project(doc, spec)
        else:
            doc = replace_root(doc, spec, user_vars)
    return doc


def _agg_add_fields(coll, db, options):
    compiled = compile_add_fields(options)
    return [add_fields(d, compiled) for d in coll]


def _agg_unset(coll, db, options):
    tree = compile_unset(options)
    return [_exclude(d, tree) for d in coll]


def _agg_replace_root(coll, db, options):
    if not isinstance(options, dict) or 'newRoot' not in options:
        fail(40231, 'no newRoot specified for the $replaceRoot stage')
    return [replace_root(d, options['newRoot']) for d in coll]


def _agg_replace_with(coll, db, options):
    return [replace_root(d, options) for d in coll]


def _agg_sort(coll, db, options):
    if not isinstance(options, dict) or not options:
        fail(15976, '$sort stage must have at least one sort key')
    return sort_docs(coll, _sort_items(options))


# $group (DocumentSourceGroup, src/mongo/db/pipeline/document_source_group.cpp and the
# accumulators in src/mongo/db/pipeline/accumulator_*.cpp).

# Accumulators the test server implements; the others MongoDB 6.0 has are refused with 238.
_GROUP_ACCUMULATORS = frozenset((
    '$sum', '$avg', '$min', '$max', '$first', '$last', '$push', '$addToSet', '$mergeObjects',
    '$count'))
_GROUP_ACCUMULATORS_UNSUPPORTED = frozenset((
    '$stdDevPop', '$stdDevSamp', '$top', '$bottom', '$topN', '$bottomN', '$firstN', '$lastN',
    '$maxN', '$minN', '$accumulator'))


def compile_group(spec):
    """[(field, accumulator, operand)] of a $group specification, checked as
    AccumulationStatement::parseAccumulationStatement does."""
    if not isinstance(spec, dict):
        fail(15947, "a group's fields must be specified in an object")
    if '_id' not in spec:
        fail(15955, 'a group specification must include an _id')
    accs = []
    for name, acc in spec.items():
        if name == '_id':
            continue
        if not isinstance(acc, dict) or not acc or next(iter(acc))[:1] != '$':
            fail(40234, "The field '%s' must be an accumulator object" % name)
        if '.' in name:
            fail(40235, "The field name '%s' cannot contain '.'" % name)
        if name[:1] == '$':
            fail(40236, "The field name '%s' cannot be an operator name" % name)
        if len(acc) != 1:
            fail(40238, "The field '%s' must specify one accumulator" % name)
        (op, operand), = acc.items()
        if isinstance(operand, list):
            fail(40237, 'The %s accumulator is a unary operator' % op)
        if op in _GROUP_ACCUMULATORS_UNSUPPORTED:
            fail(238, 'the %s accumulator is not supported by the test server' % op)
        if op not in _GROUP_ACCUMULATORS:
            fail(15952, "unknown group operator '%s'" % op)
        if op == '$count':
            if operand != {}:
                fail(14, '$count takes no arguments, i.e. $count:{}')
            op, operand = '$sum', 1
        check_expression(operand)
        accs.append((name, op, operand))
    check_expression(spec['_id'])
    return accs


def _accumulate(op, values):
    """The result of one accumulator over the operand values of a group's documents, in
    input order (MISSING where the operand evaluated to missing)."""
    if op == '$sum':
        return sum_numbers(values)
    if op == '$avg':
        return avg_numbers(values)
    if op == '$min':
        return bson_min_max(values, False)
    if op == '$max':
        return bson_min_max(values, True)
    if op in ('$first', '$last'):
        # AccumulatorFirst/Last keep the value of the first/last document as it is, missing
        # included, and a missing value comes out as null.
        v = values[0] if op == '$first' else values[-1]
        return None if v is MISSING else v
    if op == '$push':
        return [v for v in values if v is not MISSING]
    if op == '$addToSet':
        seen = set()
        out = []
        for v in values:
            if v is MISSING:
                continue
            h = hkey(v)
            if h not in seen:
                seen.add(h)
                out.append(v)
        return out
    # $mergeObjects
    out = {}
    for v in values:
        if nullish(v):
            continue
        if not isinstance(v, dict):
            fail(40400, '$mergeObjects requires object inputs, but input %s is of type %s'
                 % (fmt_value(v), type_name(v)))
        out.update(v)
    return out


def _agg_group(coll, db, options):
    """$group: documents are grouped by the BSON value of _id (numbers of different types
    that are equal are one group; missing is null), each accumulator sees its operand for
    every document of the group in input order.  MongoDB gives groups in no particular
    order; this server gives them sorted by _id."""
    accs = compile_group(options)
    id_expr = options['_id']
    groups = {}
    for doc in coll:
        parser = ExprParser(doc, ignore_missing_keys=True)
        key = parser.eval(id_expr)
        if key is MISSING:
            key = None
        h = hkey(key)
        group = groups.get(h)
        if group is None:
            group = groups[h] = (key, [[] for _ in accs])
        for (_, _, operand), values in zip(accs, group[1]):
            values.append(parser.eval(operand))
    out = []
    for key, values in groups.values():
        doc = {'_id': key}
        for (name, op, _), vals in zip(accs, values):
            doc[name] = _accumulate(op, vals)
        out.append(doc)
    if len(out) > 1:
        out.sort(key=functools.cmp_to_key(lambda a, b: bson_cmp(a['_id'], b['_id'])))
    return out


def _unwind_options(options):
    if isinstance(options, str):
        path, preserve, index_field = options, False, None
    elif isinstance(options, dict):
        path = preserve = index_field = None
        for k, v in options.items():
            if k == 'path':
                if not isinstance(v, str):
                    fail(28808, 'expected a string as the path for $unwind stage, got %s'
                         % type_name(v))
                path = v
            elif k == 'preserveNullAndEmptyArrays':
                if not isinstance(v, bool):
                    fail(28809, 'expected a boolean for the preserveNullAndEmptyArrays option '
                                'to $unwind stage, got %s' % type_name(v))
                preserve = v
            elif k == 'includeArrayIndex':
                if not isinstance(v, str) or not v:
                    fail(28810, 'expected a non-empty string for the includeArrayIndex option '
                                'to $unwind stage, got %s' % type_name(v))
                if v[0] == '$':
                    fail(28822, "includeArrayIndex option to $unwind stage should not be "
                                "prefixed with a '$': %s" % v)
                index_field = v
            else:
                fail(28811, 'unrecognized option to $unwind stage: %s' % k)
        if path is None:
            fail(28812, 'no path specified to $unwind stage')
    else:
        fail(15981, 'expected either a string or an object as specification for $unwind '
                    'stage, got %s' % type_name(options))
    if path[:1] != '$':
        fail(28818, "path option to $unwind stage should be prefixed with a '$': %s" % path)
    return (_path_parts(path[1:]), bool(preserve),
            _path_parts(index_field) if index_field else None)


def _get_nested(doc, parts):
    """Document::getNestedField: through sub-documents only (an array on the way is
    missing)."""
    value = doc
    for part in parts:
        if not isinstance(value, dict):
            return MISSING
        value = value.get(part, MISSING)
    return value


def _set_nested(doc, parts, value):
    """A copy of doc with the path set (value MISSING: removed); the containers on the path
    are copied, the rest is shared."""
    out = dict(doc)
    head = parts[0]
    if len(parts) == 1:
        if value is MISSING:
            out.pop(head, None)
        else:
            out[head] = value
        return out
    child = out.get(head)
    if not isinstance(child, dict):
        if value is MISSING:
            return out
        child = {}
    out[head] = _set_nested(child, parts[1:], value)
    return out


def _agg_unwind(coll, db, options):
    """$unwind (src/mongo/db/pipeline/document_source_unwind.cpp): one document per element
    of the array at the path; a value that is neither an array nor null/missing is taken as
    a one-element array; includeArrayIndex is an Int64 (null where there was no array)."""
    parts, preserve, index_parts = _unwind_options(options)
    out = []
    for doc in coll:
        value = _get_nested(doc, parts)
        if isinstance(value, list) and value:
            for i, el in enumerate(value):
                new = _set_nested(doc, parts, el)
                if index_parts:
                    new = _set_nested(new, index_parts, Int64(i))
                out.append(new)
            continue
        if isinstance(value, list):
            if not preserve:
                continue
            new = _set_nested(doc, parts, MISSING)
        elif nullish(value):
            if not preserve:
                continue
            new = doc
        else:
            new = doc
        if index_parts:
            new = _set_nested(new, index_parts, None)
        out.append(new)
    return out


def _install_mongomock_fixes():
    """Route mongomock's aggregation, filtering and update code through the
    MongoDB-faithful pieces of this package."""
    mm_aggregate._Parser = ExprParser
    mm_filtering.register_parse_expression(_expr_for_match)
    mm_aggregate._PIPELINE_HANDLERS.update({
        '$addFields': _agg_add_fields,
        '$set': _agg_add_fields,
        '$unset': _agg_unset,
        '$replaceRoot': _agg_replace_root,
        '$replaceWith': _agg_replace_with,
        '$sort': _agg_sort,
        '$group': _agg_group,
        '$unwind': _agg_unwind,
    })
    mm_aggregate._GROUPING_OPERATOR_MAP.update({
        '$sum': sum_numbers,
        '$avg': avg_numbers,
        '$min': lambda values: bson_min_max(values, False),
        '$max': lambda values: bson_min_max(values, True),
    })

    def bson_compare(op, a, b, can_compare_types=True):
        ca, cb = canon(a), canon(b)
        if ca != cb:
            return can_compare_types and op(ca, cb)
        return op(bson_cmp(a, b), 0)
    mm_filtering.bson_compare = bson_compare
    mm_filtering._get_compare_type = canon

    mm_collection._updaters.update({
        '$set': _set_updater,
        '$inc': _inc_updater,
        '$mul': _mul_updater,
        '$min': _min_updater,
        '$max': _max_updater,
    })
    mm_collection._set_updater = _set_updater
    mongomock.SERVER_VERSION = SERVER_VERSION


# Classic update operators mongomock gets wrong for BSON types.

def _set_updater(doc, field_name, value):
    if isinstance(doc, dict):
        doc[field_name] = value
    elif isinstance(doc, list):
        i = int(field_name)
        if i < 0:
            raise WriteError('Negative index provided', 2)
        if i >= len(doc):
            doc.extend([None] * (i + 1 - len(doc)))
        doc[i] = value


def _arith_updater(op, combine, missing):
    def updater(doc, field_name, value):
        if not is_number(value):
            raise WriteError('Cannot %s with non-numeric argument: {%s: %s}'
                             % ('increment' if op == '$inc' else 'multiply', field_name,
                                fmt_value(value)), 14)
        if isinstance(doc, dict):
            container, key, present = doc, field_name, field_name in doc
        elif isinstance(doc, list):
            key = int(field_name)
            if key < 0:
                raise WriteError('Negative index provided', 2)
            if key >= len(doc):
                doc.extend([None] * (key + 1 - len(doc)))
            container, present = doc, doc[key] is not None
        else:
            return
        if not present:
            container[key] = missing(value)
            return
        cur = container[key]
        if not is_number(cur):
            raise WriteError('Cannot apply %s to a value of non-numeric type. The field \'%s\' '
                             'has non-numeric type %s' % (op, field_name, type_name(cur)), 14)
        container[key] = combine(cur, value)
    return updater


_inc_updater = _arith_updater('$inc', lambda a, b: num_sum([a, b]), lambda v: v)
_mul_updater = _arith_updater('$mul', lambda a, b: num_mul([a, b]),
                              lambda v: num_mul([v, 0]))


def _min_updater(doc, field_name, value):
    if isinstance(doc, dict):
        if field_name not in doc or bson_cmp(value, doc[field_name]) < 0:
            doc[field_name] = value


def _max_updater(doc, field_name, value):
    if isinstance(doc, dict):
        if field_name not in doc or bson_cmp(value, doc[field_name]) > 0:
            doc[field_name] = value


CLASSIC_UPDATE_OPERATORS = frozenset([
    '$set', '$unset', '$inc', '$mul', '$min', '$max', '$rename', '$setOnInsert',
    '$currentDate', '$addToSet', '$pull', '$pullAll', '$push', '$pop'])
