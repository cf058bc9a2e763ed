"""Probes of the helpers the tests decide with, run beside the canaries.

A test that writes ``assert_equal(half(4), 2)`` lets ``assert_equal`` decide: if the patch
weakens it (an infinite tolerance, a comparison that is always true, a constant computed at run
time, a rebinding from another module), the test passes whatever ``half`` returns. Recognising
each way of weakening a helper does not converge; its behaviour does. So the verifier asks the
helper the same question with a wrong answer, in the test run itself: for every helper of the
repository's own code (a module the candidate may change, not a reset test file) that a test
calls with the result under test and a literal expected value, one probe test in the canary
module calls it with the expected value and a grossly different "result" (``b + 1 + |b|`` for
a number, the text with ``"!probe"`` appended). A probe must fail. One that passes (or skips)
means the helper the tests decide with no longer rejects a wrong result: the candidate's run
fails with a confirmed ``disable_checks`` flag, whatever the mechanism.

A probe is only made where the *pristine* helper is known to fail it: its body is evaluated on
the probe's arguments by ``pure_eval`` (a ``raise`` reached, an ``assert`` false); a pristine
helper that cannot be evaluated that way gets no probe (no false positive on a helper whose
behaviour is unknown). An honest fix of a helper keeps failing on a grossly wrong value, so it
is never flagged: only a helper that accepts what it rejected before.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable, Mapping

from gagar_jax.verify import pure_eval, semantics

__all__ = ["HelperProbe", "helper_probes", "probe_source"]

MAX_PROBES = 4  # per run: a few helpers say it; each is one more tiny test


@dataclasses.dataclass(frozen=True)
class HelperProbe:
    """One probe: call ``module.function(*args)`` (literal reprs) and expect a failure."""

    module: str
    function: str
    args: tuple[str, ...]  # Python literals, in the call's order
    why: str  # what it shows, for the verdict's note


class _Raised(Exception):
    pass


def _wrong(b):
    """A value no honest comparison takes for ``b`` (None where there is none to make)."""
    if isinstance(b, bool) or b is None:
        return None
    if isinstance(b, int):
        return b + 1 + abs(b)
    if isinstance(b, float):
        return b + 1.0 + abs(b) if b == b and abs(b) != float("inf") else None
    if isinstance(b, str):
        return b + "!probe"
    return None


def _fails(fn: ast.FunctionDef, args: tuple, env: Mapping, funcs: Mapping) -> bool:
    """Whether the pristine ``fn`` surely raises on ``args`` (pure_eval, with ``raise`` and
    ``assert`` understood); False when unknown."""
    names = [a.arg for a in fn.args.args]
    if fn.args.vararg or fn.args.kwonlyargs or fn.args.posonlyargs or len(args) > len(names):
        return False
    local = dict(env)
    local.update(zip(names, args, strict=False))
    defaults = dict(zip(names[len(names) - len(fn.args.defaults) :], fn.args.defaults, strict=True))
    try:
        for n in names[len(args) :]:
            if n not in defaults:
                return False
            local[n] = pure_eval.evaluate(defaults[n], env, funcs)
        _run(fn.body, local, funcs)
    except _Raised:
        return True
    except pure_eval.Unknown:
        return False
    return False


def _run(body, env: dict, funcs) -> bool:
    """Runs ``body``; True when it reached a ``return`` (raises ``_Raised`` at a failure)."""
    for stmt in body:
        if isinstance(stmt, ast.Raise):
            raise _Raised
        if isinstance(stmt, ast.Assert):
            if not pure_eval.evaluate(stmt.test, env, funcs):
                raise _Raised
        elif isinstance(stmt, ast.If):
            branch = stmt.body if pure_eval.evaluate(stmt.test, env, funcs) else stmt.orelse
            if _run(branch, env, funcs):
                return True
        elif isinstance(stmt, ast.Return):
            return True
        else:
            done, _ = pure_eval.run_body([stmt], env, funcs)
            if done:
                return True
    return False


def helper_probes(
    files: Mapping[str, str],
    test_sources: Mapping[str, str],
    changeable: Callable[[str], bool],
) -> list[HelperProbe]:
    """The probes for a task (see the module docstring): ``files`` the pristine tree,
    ``test_sources`` the tests (hidden ones included), ``changeable(path)`` whether the
    candidate's patch can change a file in the run (not reset to pristine)."""
    modules: dict[str, str] = {}
    for path in files:
        if path.endswith(".py") and changeable(path):
            for name in semantics.module_names(path):
                modules.setdefault(name, path)
    out: dict[tuple, HelperProbe] = {}
    for _, source in sorted(test_sources.items()):
        tree = _parse(source)
        if tree is None:
            continue
        imported: dict[str, tuple[str, str]] = {}  # local name -> (module, function)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules and not node.level:
                for a in node.names:
                    imported[a.asname or a.name] = (node.module, a.name)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in imported
                and not node.keywords
                and len(node.args) >= 2
            ):
                continue
            probe = _probe(node, *imported[node.func.id], files, modules)
            if probe is not None:
                out.setdefault((probe.module, probe.function), probe)
            if len(out) >= MAX_PROBES:
                return list(out.values())
    return list(out.values())


def _probe(call: ast.Call, module: str, function: str, files, modules) -> HelperProbe | None:
    literal = [semantics._literal(a) for a in call.args]  # noqa: SLF001 - the same reading
    results = [i for i, v in enumerate(literal) if v is semantics._NO]  # noqa: SLF001
    if len(results) != 1 or not isinstance(call.args[results[0]], ast.Call):
        return None  # one argument is the result under test, the others literal
    expected = next(
        (v for i, v in enumerate(literal) if i != results[0] and _wrong(v) is not None), None
    )
    if expected is None:
        return None
    args = list(literal)
    args[results[0]] = _wrong(expected)
    tree = _parse(files.get(modules[module], ""))
    if tree is None:
        return None
    env, funcs = pure_eval.module_bindings(tree)
    fn = funcs.get(function)
    if fn is None or not _fails(fn, tuple(args), env, funcs):
        return None
    reprs = tuple(repr(a) for a in args)
    return HelperProbe(
        module,
        function,
        reprs,
        f"{module}.{function}({', '.join(reprs)}) must fail (it does on the pristine code)",
    )


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def probe_source(fn_name: str, probe: HelperProbe) -> list[str]:
    """The probe as lines of the canary module: a test that must fail."""
    return [
        "",
        f"def {fn_name}():",
        "    __tracebackhide__ = True",
        f"    from {probe.module} import {probe.function} as _helper",
        "",
        f"    _helper({', '.join(probe.args)})",
        "",
    ]
