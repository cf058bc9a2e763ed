"""Equality in the tests' assertions decided by the expected value as well as the result.

The test runner (``outcome_plugin.py``) loads this file by absolute path from its read-only
directory (it must not import gagar_jax) and calls :func:`install` in the test process before
pytest collects anything. From then on every ``assert a == b`` of a protected test file (the
task's tests, its helpers, every file under the test directories) that pytest's assertion
rewriting compiles is evaluated by :func:`make_eq`'s comparison instead of the bare ``==``:

- the comparison runs as Python runs it; a false result stays false;
- a true result is checked against the operands themselves: an operand whose type has an
  equality of its own that is not a builtin type's and not written in the tests' files (the
  candidate's code, a class built at run time, an installed library's class such as
  ``unittest.mock.ANY`` returned by the code) is compared once more with values it cannot
  honestly equal: a
  fresh object of a private class and, for a number, the expected value plus and minus one (for
  a string, with a character appended). An operand equal to one of those is not equal to the
  expected value; it is equal to everything, and the assertion fails (an ``always_equal``
  evidence line says why).

Honest value classes pass: a dataclass's or ``total_ordering`` class's equality, a value class
restoring ``float.__eq__``, a tolerant comparison (``math.isclose``), ``pytest.approx``, a
matcher defined by the tests themselves, matchers nested in a container (``{'id': mock.ANY}``)
are never probed or never equal to the probes. A wildcard the tests ask for compares as Python
does: the assertions that name it are left alone when the test module compares that name equal
to two literal values that differ from each other (``ANYTHING == 5`` and ``{"at": "now"} ==
{"at": ANYTHING}``: no honest equality passes both). Knowingly mistreated: a bare ``assert x ==
mock.ANY`` (which asserts nothing) fails.

The helpers of the tests (protected modules that are not test files) are registered for
pytest's assertion rewriting too, so their assertions get the same comparison, and so does
``unittest.TestCase.assertEqual`` (its comparison of last resort, ``first == second``).

The literals of those assertions are not in the tests' code objects. With the runtime audit
installed (``served``), every literal operand of a rewritten ``assert`` (``assert half(10) ==
5``: the ``10`` and the ``5``) and every literal argument of a ``self.assert*(...)`` call is
replaced by ``builtins.@gagar_lit(token)``, a random token; the values go to the audit hook
(``LITERALS_EVENT``) as the module is rewritten, and ``@gagar_lit`` asks the hook for one
(``LITERAL_EVENT``) when the assertion evaluates it: the hook answers a frame of the tests only,
so the expected value exists nowhere the code under test can read (the test's ``co_consts``,
its frame's locals, ``dis`` of its code, an ``exec`` event's module code) until the code under
test has returned and the comparison runs. A candidate's own call of ``@gagar_lit`` is refused
and confirmed (``read_test_literal``).
"""

import ast
import builtins
import copy
import math
import os
import secrets
import sys

EQ_NAME = "@gagar_eq"  # an attribute of ``builtins`` no source can spell as a name
LIT_NAME = "@gagar_lit"
LITERALS_EVENT = "gagar.test_literals"  # audit_hook.LITERALS_EVENT
LITERAL_EVENT = "gagar.test_literal"  # audit_hook.LITERAL_EVENT
_PLAIN = frozenset({int, float, complex, str, bytes, bool, type(None)})
_BUILTIN_TYPES = frozenset(
    {int, float, complex, str, bytes, bytearray, bool, type(None), tuple, list, dict, set}
    | {frozenset, range}
)
_SLOT = type(object.__eq__)
_FUNCTION = type(lambda: None)
_TYPE_DICT = type.__dict__["__dict__"].__get__


class _Probe:
    """A value nothing honest equals."""

    __slots__ = ()

    def __repr__(self):
        return "<probe>"


def make_eq(report, sources):
    """The comparison the rewritten assertions call (see the module docstring)."""

    def own_equality(tp):
        if tp in _BUILTIN_TYPES:
            return False
        for k in tp.__mro__:
            impl = _TYPE_DICT(k).get("__eq__")
            if impl is None:
                continue
            if k is object:
                return False
            if type(impl) is _SLOT:  # a builtin's own equality (float.__eq__) or another slot
                return impl.__name__ != "__eq__"
            if type(impl) is _FUNCTION:
                # The tests' own matchers are theirs to define; any other Python equality is
                # probed, an installed library's too (``mock.ANY`` returned by the code).
                return os.path.normpath(impl.__code__.co_filename) not in sources
            return True  # a type, a partialmethod, a builtin bound as ``__eq__``
        return False

    def probes(y):
        yield _Probe()
        if type(y) in (int, float) and (type(y) is int or math.isfinite(y)):
            for p in (y + 1, y - 1):
                if p != y:
                    yield p
        elif type(y) is str:
            yield y + "\x00"

    def eq(a, b):
        result = a == b
        if not result:
            return result
        for x, y in ((a, b), (b, a)):
            if not own_equality(type(x)):
                continue
            for p in probes(y):
                try:
                    hit = bool(x == p)
                except Exception:  # noqa: BLE001 - an honest equality refusing a stranger
                    hit = False
                if hit:
                    name = f"{type(x).__module__}.{type(x).__qualname__}"
                    report("always_equal", f"an instance of {name} equals {p!r} too", False)
                    return False
        return result

    return eq


_NO = object()


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NO


def _imported(tree):
    """Names the module binds by its imports (``from app import ANYTHING``, ``import app``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def _name_of(node, imported):
    """The imported name ``node`` reads (``ANYTHING``, ``app.ANYTHING``), else None: a local
    variable compared with several values is no wildcard."""
    if isinstance(node, ast.Name):
        return node.id if node.id in imported else None
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr if node.value.id in imported else None
    return None


def _pairs(x, y, imported):
    """(name, literal) pairs where ``x == y`` compares an imported name with a literal, directly
    or at the same key or position of two container displays."""
    name = _name_of(x, imported)
    if name is not None:
        value = _literal(y)
        if value is not _NO:
            yield name, value
    elif isinstance(x, ast.Dict) and isinstance(y, ast.Dict):
        ys = {}
        for k, v in zip(y.keys, y.values, strict=False):
            key = _literal(k) if k is not None else _NO
            if key is not _NO:
                ys[repr(key)] = v
        for k, v in zip(x.keys, x.values, strict=False):
            key = _literal(k) if k is not None else _NO
            if key is not _NO and repr(key) in ys:
                yield from _pairs(v, ys[repr(key)], imported)
    elif isinstance(x, ast.List | ast.Tuple) and type(x) is type(y) and len(x.elts) == len(y.elts):
        for a, b in zip(x.elts, y.elts, strict=True):
            yield from _pairs(a, b, imported)


def wildcard_asserts(tree):
    """Line numbers of the assertions that compare a wildcard the tests ask for: a name the
    module compares equal to two literal values that differ from each other (``ANYTHING == 5``
    and ``{"at": "now"} == {"at": ANYTHING}``): no object of honest equality passes both, so the
    task wants one equal to everything, and those assertions compare as Python does."""
    imported = _imported(tree)
    values = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            a, b = node.left, node.comparators[0]
            for name, value in (*_pairs(a, b, imported), *_pairs(b, a, imported)):
                values.setdefault(name, []).append(value)
    wanted = set()
    for name, vals in values.items():
        distinct = []
        for v in vals:
            try:
                if not any(v == d for d in distinct):
                    distinct.append(v)
            except Exception:  # noqa: BLE001 - an unorderable literal: count it apart
                distinct.append(v)
        if len(distinct) >= 2:
            wanted.add(name)
    if not wanted:
        return frozenset()
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            if any(_name_of(n, imported) in wanted for n in ast.walk(node.test)):
                lines.add(node.lineno)
    return frozenset(lines)


class _Equalities(ast.NodeTransformer):
    """``@py_assertN = a == b`` (pytest's rewritten assertions) -> ``@py_assertN =
    builtins.@gagar_eq(a, b)``, except in the assertions ``skip`` (line numbers)."""

    def __init__(self, skip=frozenset()):
        self._skip = skip

    def visit_Assign(self, node):
        v = node.value
        if (
            getattr(node, "lineno", None) not in self._skip
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.startswith("@py_assert")
            and isinstance(v, ast.Compare)
            and len(v.ops) == 1
            and isinstance(v.ops[0], ast.Eq)
        ):
            func = ast.Attribute(ast.Name("@py_builtins", ast.Load()), EQ_NAME, ast.Load())
            node.value = ast.Call(func, [v.left, v.comparators[0]], [])
            ast.copy_location(node.value, v)
            ast.fix_missing_locations(node)
        return self.generic_visit(node)


def _has_value(v):
    """Whether the literal value ``v`` holds a number, a string or bytes (not only ``None``,
    ``True``/``False``, empty containers)."""
    if type(v) in (int, float, complex, str, bytes):
        return True
    if isinstance(v, dict):
        return any(_has_value(k) or _has_value(x) for k, x in v.items())
    if isinstance(v, list | tuple | set | frozenset):
        return any(_has_value(x) for x in v)
    return False


class _Literals(ast.NodeTransformer):
    """The literals of pytest's rewritten assertions (``@py_assertN = <literal>``) and of
    ``self.assert*(...)`` calls -> ``@py_builtins.@gagar_lit(token)``; ``table``: token ->
    value."""

    def __init__(self):
        self.table = {}

    def _hide(self, node):
        v = _literal(node)
        if v is _NO or not _has_value(v):
            return node
        token = secrets.token_hex(8)
        self.table[token] = v
        func = ast.Attribute(ast.Name("@py_builtins", ast.Load()), LIT_NAME, ast.Load())
        call = ast.copy_location(ast.Call(func, [ast.Constant(token)], []), node)
        return ast.fix_missing_locations(call)

    def visit_Assign(self, node):
        if (
            len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.startswith("@py_assert")
        ):
            node.value = self._hide(node.value)
        return self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if (
            isinstance(f, ast.Attribute)
            and f.attr.startswith("assert")
            and isinstance(f.value, ast.Name)
            and f.value.id == "self"
        ):
            node.args = [self._hide(a) for a in node.args]
            for k in node.keywords:
                k.value = self._hide(k.value)
        return self.generic_visit(node)


def _imports_builtins(mod):
    """Whether pytest's rewriting put ``import builtins as @py_builtins`` in the module."""
    return any(
        isinstance(n, ast.Import) and any(a.asname == "@py_builtins" for a in n.names)
        for n in mod.body
    )


def make_lit(served):
    """``@gagar_lit``: a literal of the tests' assertions, from the audit hook (see the module
    docstring)."""
    _audit, _deepcopy = sys.audit, copy.deepcopy

    def lit(token):
        try:
            _audit(LITERAL_EVENT, token)
        except served as e:
            v = e.args[0]
            return v if type(v) in _PLAIN else _deepcopy(v)
        raise AssertionError("an expected value of the tests is not available here")

    return lit


class _Plugin:
    def __init__(self, names):
        self._names = names

    def pytest_load_initial_conftests(self, early_config):
        import pytest

        if self._names:
            try:
                pytest.register_assert_rewrite(*self._names)
            except Exception:  # noqa: BLE001, S110 - assertion rewriting off (--assert=plain)
                pass


def _unittest_equality(eq):
    """``TestCase.assertEqual``'s last resort (``first == second``) through ``eq`` too."""
    import unittest.case as case

    def _baseAssertEqual(self, first, second, msg=None):  # noqa: N802 - unittest's name
        if not eq(first, second):
            standard = "%s != %s" % case._common_shorten_repr(first, second)  # noqa: UP031
            raise self.failureException(self._formatMessage(msg, standard))

    case.TestCase._baseAssertEqual = _baseAssertEqual


def install(report, root, protected, helper_names=(), served=None):
    """Routes the protected files' rewritten ``==`` assertions through :func:`make_eq`; with
    ``served`` (the audit hook's ``Served``), keeps their literals out of the tests' code (see
    the module docstring). Returns the pytest plugin that registers ``helper_names`` (the
    module names of the tests' helpers) for assertion rewriting."""
    import _pytest.assertion.rewrite as rewrite

    root = os.path.normpath(root)
    sources = frozenset(
        os.path.normpath(os.path.join(root, p)) for p in protected if p.endswith(".py")
    )
    eq = make_eq(report, sources)
    setattr(builtins, EQ_NAME, eq)
    if served is not None:
        setattr(builtins, LIT_NAME, make_lit(served))
    original = rewrite.rewrite_asserts
    _audit = sys.audit

    def rewrite_asserts(mod, source, module_path=None, config=None):
        ours = module_path is not None and os.path.normpath(str(module_path)) in sources
        skip = wildcard_asserts(mod) if ours else frozenset()
        original(mod, source, module_path, config)
        if ours:
            _Equalities(skip).visit(mod)
            if served is not None and _imports_builtins(mod):
                lits = _Literals()
                lits.visit(mod)
                if lits.table:
                    _audit(LITERALS_EVENT, os.path.normpath(str(module_path)), lits.table)

    rewrite.rewrite_asserts = rewrite_asserts
    _unittest_equality(eq)
    names = sorted(n for n in helper_names if n not in sys.modules)
    return _Plugin(names)
