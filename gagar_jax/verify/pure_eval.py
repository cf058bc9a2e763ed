"""Evaluating the pure part of the candidate's code on the tests' inputs, without running it.

The monitor must know what a lookup in the candidate's code does with a tested input: the key
``str(x)``, ``repr(x)``, ``(x,)``, ``f"n{x}"``, ``float(x)``, ``hashlib.md5(str(x).encode())
.hexdigest()`` or a helper of the same file that computes one. :func:`evaluate` computes an
expression of a function's parameters (bound to a tested input) on the trusted side by
interpreting its syntax tree over a closed set of pure operations:

* literals, containers, f-strings (conversions and format specifications), arithmetic,
  comparisons, boolean and conditional expressions, subscripts and slices;
* calls of pure builtins (``str``, ``repr``, ``int``, ``float``, ``tuple``, ``hash`` of
  numbers, ``len``, ``abs``, ``round``, ``format``, ``chr``, ``ord``, ``min``, ``max``...), of
  non-mutating methods of ``str``/``bytes``/numbers/tuples/lists/dicts, of ``math``,
  ``hashlib``, ``zlib``, ``base64``, ``binascii`` and ``json`` functions named through the
  file's imports, and of the file's own module-level functions whose body is assignments,
  ``if`` statements and ``return`` (inlined, a few levels deep);
* names: the bindings given (parameters, module constants), then assignments in order.

Anything else (a call of unknown code, an attribute of an object, a loop) is :class:`Unknown`:
the caller draws no conclusion. Sizes are bounded (a power, a shift, a repetition, a string
past ``MAX_SIZE`` is Unknown), so no input makes the evaluation slow or large. Nothing of the
candidate runs: its text is only read.
"""

from __future__ import annotations

import ast
import base64
import binascii
import hashlib
import json
import math
import operator
import zlib
from collections.abc import Mapping

__all__ = ["Unknown", "evaluate", "module_bindings", "run_body"]

MAX_SIZE = 10_000  # characters/items of any intermediate value
MAX_DEPTH = 4  # nested calls of the file's own functions


class Unknown(Exception):
    """The expression is outside what can be evaluated without running the code."""


def _hash(v):
    if isinstance(v, int | float | bool | complex) or v is None:
        return hash(v)
    if isinstance(v, tuple) and all(isinstance(e, int | float | bool) for e in v):
        return hash(v)
    raise Unknown("hash of a value whose hash is per process")  # str/bytes: randomised


def _sorted(v, *a, **k):
    if a or k:
        raise Unknown("sorted with a key")
    return sorted(v)


_BUILTINS = {
    "str": str,
    "repr": repr,
    "ascii": ascii,
    "int": int,
    "float": float,
    "complex": complex,
    "bool": bool,
    "tuple": tuple,
    "list": list,
    "frozenset": frozenset,
    "abs": abs,
    "round": round,
    "hash": _hash,
    "len": len,
    "min": min,
    "max": max,
    "sum": sum,
    "any": any,
    "all": all,
    "sorted": _sorted,
    "format": format,
    "divmod": divmod,
    "chr": chr,
    "ord": ord,
    "hex": hex,
    "oct": oct,
    "bin": bin,
    "bytes": bytes,
}
_MODULES = {
    "math": {
        n: getattr(math, n)
        for n in (
            "floor ceil trunc sqrt isqrt log log2 log10 exp fabs copysign gcd lcm isclose "
            "isfinite isnan isinf degrees radians hypot fmod modf frexp"
        ).split()
        if hasattr(math, n)
    },
    "hashlib": {
        n: getattr(hashlib, n)
        for n in "md5 sha1 sha224 sha256 sha384 sha512 blake2b blake2s sha3_256".split()
    },
    "zlib": {"crc32": zlib.crc32, "adler32": zlib.adler32},
    "base64": {
        n: getattr(base64, n)
        for n in "b64encode b32encode b16encode urlsafe_b64encode b85encode".split()
    },
    "binascii": {"hexlify": binascii.hexlify, "crc32": binascii.crc32},
    "json": {"dumps": json.dumps},
    "operator": {
        n: getattr(operator, n)
        for n in "add sub mul truediv floordiv mod neg pos abs index itemgetter".split()
    },
}
_HASH_TYPE = type(hashlib.md5())
_METHODS = {
    str: frozenset(
        "lower upper casefold strip lstrip rstrip title capitalize swapcase zfill replace split "
        "rsplit join startswith endswith encode center ljust rjust removeprefix "
        "removesuffix partition rpartition count find rfind index rindex isdigit isalpha "
        "isalnum isspace islower isupper isdecimal isnumeric splitlines".split()
    ),
    bytes: frozenset("decode hex lower upper strip startswith endswith count find".split()),
    int: frozenset("bit_length to_bytes conjugate".split()),
    float: frozenset("hex is_integer conjugate as_integer_ratio".split()),
    tuple: frozenset(("index", "count")),
    list: frozenset(("index", "count")),
    dict: frozenset(("get", "keys", "values", "items")),
    _HASH_TYPE: frozenset(("hexdigest", "digest")),
}
_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_,
    ast.BitXor: operator.xor,
}
_CMP = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


class _Module:
    """A module name bound by an import (its pure functions only)."""

    def __init__(self, name: str):
        self.name = name


def _sized(v):
    if isinstance(v, str | bytes | tuple | list | dict | frozenset | set) and len(v) > MAX_SIZE:
        raise Unknown("value too large")
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 4 * MAX_SIZE:
        raise Unknown("integer too large")
    return v


_FUNCTIONS = frozenset(
    id(f) for f in (*_BUILTINS.values(), *(f for m in _MODULES.values() for f in m.values()))
)


def _checked(v):
    """Only plain values, containers of them, hash objects and the whitelisted functions flow
    through the evaluation."""
    if isinstance(v, (*_PLAIN, _HASH_TYPE, _Module)) or id(v) in _FUNCTIONS:
        return v
    if isinstance(v, tuple | list | frozenset | set):
        for e in v:
            _checked(e)
        return v
    if isinstance(v, dict):
        for k, e in v.items():
            _checked(k)
            _checked(e)
        return v
    raise Unknown(f"a value of type {type(v).__name__}")


def module_bindings(tree: ast.Module) -> tuple[dict[str, object], dict[str, ast.AST]]:
    """(constants, functions) of a module: names bound to values :func:`evaluate` computes
    (literals, expressions of earlier constants, imported pure modules) and the module-level
    function definitions."""
    env: dict[str, object] = {}
    funcs: dict[str, ast.AST] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.name in _MODULES:
                    env[a.asname or a.name] = _Module(a.name)
        elif isinstance(stmt, ast.ImportFrom) and stmt.module in _MODULES and not stmt.level:
            for a in stmt.names:
                if a.name in _MODULES[stmt.module]:
                    env[a.asname or a.name] = _MODULES[stmt.module][a.name]
        elif isinstance(stmt, ast.FunctionDef):
            funcs[stmt.name] = stmt
            env.pop(stmt.name, None)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            try:
                value = evaluate(stmt.value, env, funcs)
            except Unknown:
                value = _NOTHING
            for t in targets:
                if isinstance(t, ast.Name):
                    if value is _NOTHING:
                        env.pop(t.id, None)
                    else:
                        env[t.id] = value
    return env, funcs


_NOTHING = object()


def evaluate(node: ast.AST, env: Mapping[str, object], funcs: Mapping[str, ast.AST], depth=0):
    """The value of expression ``node`` under ``env`` (see the module docstring); raises
    :class:`Unknown` when it cannot be computed without running the code."""
    try:
        return _sized(_checked(_eval(node, env, funcs, depth)))
    except Unknown:
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - the expression raised: no value
        raise Unknown(f"{type(e).__name__}") from None


def _eval(node, env, funcs, depth):
    ev = lambda n: evaluate(n, env, funcs, depth)  # noqa: E731 - a local shorthand
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in _BUILTINS and node.id not in funcs:
            return _BUILTINS[node.id]
        raise Unknown(f"name {node.id}")
    if isinstance(node, ast.Tuple):
        return tuple(ev(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [ev(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {ev(e) for e in node.elts}
    if isinstance(node, ast.Dict):
        if None in node.keys:
            raise Unknown("dict unpacking")
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.JoinedStr):
        return "".join(str(ev(v)) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        v = ev(node.value)
        conv = {-1: lambda x: x, 115: str, 114: repr, 97: ascii}[node.conversion]
        spec = ev(node.format_spec) if node.format_spec is not None else ""
        if len(spec) > 20 or _big_number_in(spec):
            raise Unknown("format specification")
        return format(conv(v), spec)
    if isinstance(node, ast.BinOp):
        a, b = ev(node.left), ev(node.right)
        op = type(node.op)
        if op not in _BIN:
            raise Unknown("operator")
        if op is ast.Pow and (
            not isinstance(b, int | float)
            or abs(b) > 256
            or (isinstance(a, int) and a.bit_length() * abs(b) > 4 * MAX_SIZE)
        ):
            raise Unknown("power")
        if op in (ast.LShift, ast.RShift) and (not isinstance(b, int) or abs(b) > 256):
            raise Unknown("shift")
        if op is ast.Mult and any(isinstance(x, str | bytes | tuple | list) for x in (a, b)):
            seq, n = (a, b) if isinstance(a, str | bytes | tuple | list) else (b, a)
            if not isinstance(n, int) or n * len(seq) > MAX_SIZE:
                raise Unknown("repetition")
        if op is ast.Mod and isinstance(a, str | bytes):
            if not isinstance(b, (*_PLAIN, tuple)):
                raise Unknown("%-formatting of a mapping")
        return _BIN[op](a, b)
    if isinstance(node, ast.UnaryOp):
        v = ev(node.operand)
        return (not v) if isinstance(node.op, ast.Not) else _UNARY[type(node.op)](v)
    if isinstance(node, ast.BoolOp):
        v = None
        for e in node.values:
            v = ev(e)
            if isinstance(node.op, ast.And) and not v:
                return v
            if isinstance(node.op, ast.Or) and v:
                return v
        return v
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = ev(right_node)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return ev(node.body) if ev(node.test) else ev(node.orelse)
    if isinstance(node, ast.Subscript):
        value = ev(node.value)
        if isinstance(node.slice, ast.Slice):
            s = node.slice
            parts = [ev(p) if p is not None else None for p in (s.lower, s.upper, s.step)]
            return value[slice(*parts)]
        return value[ev(node.slice)]
    if isinstance(node, ast.Attribute):
        base = ev(node.value)
        if isinstance(base, _Module):
            fn = _MODULES[base.name].get(node.attr)
            if fn is None:
                raise Unknown(f"{base.name}.{node.attr}")
            return fn
        raise Unknown("attribute of a value")  # methods: called below
    if isinstance(node, ast.Call):
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            raise Unknown("unpacked arguments")
        args = [ev(a) for a in node.args]
        kwargs = {k.arg: ev(k.value) for k in node.keywords}
        f = node.func
        if isinstance(f, ast.Attribute):
            base = ev(f.value)
            if isinstance(base, _Module):
                fn = _MODULES[base.name].get(f.attr)
                if fn is None:
                    raise Unknown(f"{base.name}.{f.attr}")
                return fn(*args, **kwargs)
            allowed = next((m for t, m in _METHODS.items() if type(base) is t), frozenset())
            if f.attr not in allowed:
                raise Unknown(f"method {f.attr}")
            if not _small(base, *args, *kwargs.values()):
                raise Unknown("method arguments too large")
            return getattr(base, f.attr)(*args, **kwargs)
        if isinstance(f, ast.Name) and f.id in funcs and f.id not in env:
            return _inline(funcs[f.id], args, kwargs, env, funcs, depth)
        fn = ev(f)
        if fn in _BUILTINS.values() or any(fn in m.values() for m in _MODULES.values()):
            return fn(*args, **kwargs)
        raise Unknown("call of unknown code")
    raise Unknown(type(node).__name__)


def _big_number_in(spec: str) -> bool:
    digits = "".join(c if c.isdigit() else " " for c in spec).split()
    return any(len(d) > 4 for d in digits)


def _small(*values) -> bool:
    """Arguments a method may take without making a large value (a width, a replacement)."""
    for v in values:
        if isinstance(v, str | bytes | tuple | list | dict) and len(v) > 1000:
            return False
        if isinstance(v, int) and abs(v) > MAX_SIZE:
            return False
    return True


def _inline(fn, args, kwargs, env, funcs, depth):
    """A call of one of the file's own functions, evaluated when its body is simple."""
    if depth >= MAX_DEPTH or not isinstance(fn, ast.FunctionDef):
        raise Unknown("call too deep")
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
        raise Unknown("signature")
    names = [p.arg for p in a.args]
    if len(args) > len(names):
        raise Unknown("arity")
    local = {k: v for k, v in env.items() if k not in names}
    local.update(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k not in names or k in local and k in names[: len(args)]:
            raise Unknown("argument")
        local[k] = v
    defaults = dict(zip(names[len(names) - len(a.defaults) :], a.defaults, strict=True))
    for n in names:
        if n not in local:
            if n not in defaults:
                raise Unknown("missing argument")
            local[n] = evaluate(defaults[n], env, funcs, depth + 1)
    done, value = run_body(fn.body, local, funcs, depth + 1)
    if not done:
        raise Unknown("no return")
    return value


def run_body(body, env: dict, funcs: Mapping[str, ast.AST], depth: int = 0):
    """Runs straight-line statements (assignments, ``if``, ``return``, ``pass``, docstrings)
    on ``env`` (updated in place): ``(True, value)`` at a ``return``, ``(False, None)`` when
    the body ends without one; :class:`Unknown` at any other statement."""
    for stmt in body:
        if isinstance(stmt, ast.Return):
            return True, evaluate(stmt.value, env, funcs, depth) if stmt.value else None
        if isinstance(stmt, ast.Assign):
            value = evaluate(stmt.value, env, funcs, depth)
            for t in stmt.targets:
                if not isinstance(t, ast.Name):
                    raise Unknown("assignment target")
                env[t.id] = value
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            op = type(stmt.op)
            fake = ast.BinOp(left=ast.Name(id=stmt.target.id), op=stmt.op, right=stmt.value)
            if op not in _BIN:
                raise Unknown("operator")
            env[stmt.target.id] = evaluate(fake, env, funcs, depth)
        elif isinstance(stmt, ast.If):
            branch = stmt.body if evaluate(stmt.test, env, funcs, depth) else stmt.orelse
            done, value = run_body(branch, env, funcs, depth)
            if done:
                return done, value
        elif isinstance(stmt, ast.Pass) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            continue
        else:
            raise Unknown(type(stmt).__name__)
    return False, None
