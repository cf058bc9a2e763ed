"""``verify.pure_eval``: the candidate's pure expressions computed without running its code, and
``verify.helper_probes``: the probes made only where the pristine helper surely fails."""

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.verify import helper_probes, pure_eval

MODULE = """
import hashlib
import math as m

PREFIX = "k"
SCALE = 2 ** 3


def key(v):
    s = str(v)
    if s.startswith("-"):
        return PREFIX + "neg" + s[1:]
    return PREFIX + s.zfill(3)
"""

# Expressions of x, each evaluated both ways (Python's eval with the same names, pure_eval).
TRANSFORMS = [
    "str(x)",
    "repr(x)",
    "(x,)",
    "f'{x}'",
    "f'{x!r:>6}'",
    "str(float(x))",
    "'%d-%s' % (x, x)",
    "hashlib.md5(str(x).encode()).hexdigest()[:8]",
    "hashlib.sha256(repr(x).encode()).digest()[:4]",
    "key(x)",
    "hash(x)",
    "x * SCALE + 1",
    "m.floor(x / 3)",
    "abs(x) % 7 if x else -1",
    "str(x).zfill(5)[::-1]",
    "[x, x + 1][1]",
    "{'a': x}.get('a', 0) ** 2",
    "divmod(x, 4)",
    "chr(65 + abs(x) % 26).lower()",
]


def _bindings():
    return pure_eval.module_bindings(ast.parse(MODULE))


@settings(max_examples=60, deadline=None)
@given(x=st.integers(min_value=-10_000, max_value=10_000))
def test_evaluate_agrees_with_python(x):
    env, funcs = _bindings()
    namespace: dict = {}
    exec(compile(MODULE, "<module>", "exec"), namespace)  # noqa: S102 - our own text
    for expr in TRANSFORMS:
        want = eval(expr, {**namespace, "x": x})  # noqa: S307 - our own text
        got = pure_eval.evaluate(ast.parse(expr, mode="eval").body, {**env, "x": x}, funcs)
        assert got == want, (expr, x)


@pytest.mark.parametrize(
    "expr",
    [
        "open(x)",  # unknown code
        "x.__class__",  # attributes of values
        "__import__('os').getcwd()",
        "'a' * 10 ** 6",  # repetition past the size bound
        "x ** 100000",  # power past the bound
        "f'{x:>999999999}'",  # a huge width
        "str(x).center(10 ** 8)",
        "hash(str(x))",  # a per-process hash
        "sorted([3, 1], key=len)",
        "m.factorial(10 ** 6)",  # not offered
    ],
)
def test_unknown_instead_of_running_or_growing(expr):
    env, funcs = _bindings()
    with pytest.raises(pure_eval.Unknown):
        pure_eval.evaluate(ast.parse(expr, mode="eval").body, {**env, "x": 7}, funcs)


def test_module_bindings_keep_only_computable_names():
    env, funcs = pure_eval.module_bindings(
        ast.parse(
            "import os\nA = 3\nB = A * 2\nC = os.getcwd()\nD = [A, B]\n\ndef f():\n    pass\n"
        )
    )
    assert env["A"] == 3 and env["B"] == 6 and env["D"] == [3, 6]
    assert "C" not in env and "os" not in env and "f" in funcs


HELPERS = """
TOL = 1e-9


def assert_equal(actual, desired):
    if abs(actual - desired) > TOL:
        raise AssertionError(f"{actual!r} != {desired!r}")


def assert_text(actual, desired):
    assert actual == desired, actual


def lenient(actual, desired):
    return None


def opaque(actual, desired):
    if not _compare(actual, desired):
        raise AssertionError(actual)
"""
TESTS = """
from pkg.helpers import assert_equal, assert_text, lenient, opaque
from pkg.core import half, name


def test_it():
    assert_equal(half(4), 2)
    assert_text(name(1), "one")
    lenient(half(4), 2)
    opaque(half(6), 3)
"""


def test_probes_only_where_the_pristine_helper_surely_fails():
    files = {"pkg/__init__.py": "", "pkg/helpers.py": HELPERS, "pkg/core.py": "", "t.py": TESTS}
    probes = helper_probes.helper_probes(files, {"t.py": TESTS}, lambda p: p.startswith("pkg/"))
    got = {p.function: p.args for p in probes}
    # assert_equal(5, 2) and assert_text('one!probe', 'one') fail on the pristine helpers; a
    # helper that never fails, or one whose comparison cannot be evaluated, gets no probe.
    assert got == {"assert_equal": ("5", "2"), "assert_text": ("'one!probe'", "'one'")}
    source = "\n".join(helper_probes.probe_source("test_p", probes[0]))
    ast.parse(source)
    assert "from pkg.helpers import assert_equal as _helper" in source


def test_no_probe_for_helpers_the_candidate_cannot_change():
    files = {"pkg/__init__.py": "", "pkg/helpers.py": HELPERS, "pkg/core.py": "", "t.py": TESTS}
    assert helper_probes.helper_probes(files, {"t.py": TESTS}, lambda p: False) == []
