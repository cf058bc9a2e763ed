"""A task factory over real packages: procedural bugs in functions their tests cover.

    python -m gagar_jax.data.synth --packages toolz,cachetools --out DIR [--tasks-per-package N]

For each package: download its source distribution from the registry (``pip download
--no-binary :all:``), build its environment (``gagar_jax.data.repos.build_env``: uv, cached),
run its test suite once in the sandbox with a tracer (``synth_trace.py``) that records which
functions each test calls, then mutate covered functions with ``libcst`` transforms
(:data:`TRANSFORMS`): flip an operator or a comparison, invert a condition, change a constant,
swap operands, remove an assignment, a branch or a loop, off-by-one in a slice or a range.

A mutant becomes a task only if, in the sandbox, at least one of the tests covering it fails
(fail-to-pass) and at least one keeps passing (pass-to-pass), the reverse patch (the fix)
passes 3 of 3 runs, the empty patch fails 3 of 3, no run hits the wall-clock limit (the
per-test timeout holds), and the issue text does not leak the fix (``audit.leak_kinds``). The
issue is written from a versioned template (:data:`ISSUE_TEMPLATE_VERSION`) over the failing
tests' output: the tests that fail and their assertion lines, never the changed code. With
``--issue-llm URL`` an OpenAI-compatible chat endpoint writes it from the same output instead
(:class:`IssueWriter`); its text is kept only if it passes the same leak check, else the
template's is (counted: ``issue_llm_fallbacks``; each row's ``synth.issue_source`` names the
writer).

Speed: a candidate runs only the tests covering it (sampled when many do) and a few other tests
of the same files; its screening run counts as the first empty run and validation stops at the
first run that rules it out; mutants whose run is slow are rejected; packages and candidates are
worked on in parallel, their sandboxed runs bounded by ``--workers`` in all. Tests that fail when
the suite runs in reverse order (order-dependent) are never used.

Output: ``DIR/instances.jsonl`` (SWE-bench-format rows, ``gagar_jax.data.swe``) and
``DIR/repos/pypi__<package>/`` (a git repository: the pristine release on ``main`` and, per
task, a commit with the bug on its own branch; ``base_commit`` is that commit, ``patch`` the
fix) plus ``DIR/synth_stats.json`` (yield, time per task, the transform mix).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import importlib.resources
import json
import os
import random
import re
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from gagar_jax.data import audit, repos, swe
from gagar_jax.envs.repo import RepoTask
from gagar_jax.rollout.sglang_client import SGLangClient
from gagar_jax.verify.diff import tree_patch
from gagar_jax.verify.repo import env_site_packages, verify_repo_patch, write_tree
from gagar_jax.verify.sandbox import Limits, python_for_sandbox, run_sandboxed
from gagar_jax.verify.untrusted import Envelope

ISSUE_TEMPLATE_VERSION = "synth-issue-v1"
ISSUE_TEMPLATE = """\
{title}

After updating to this revision of `{package}`, {n_fail} of its tests fail that passed before:

{failing}

What the failing checks report:

```
{evidence}
```

Expected: these tests pass, as they did before, without changing the tests.
"""

# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------
_FLIP_BIN = {
    cst.Add: cst.Subtract,
    cst.Subtract: cst.Add,
    cst.Multiply: cst.FloorDivide,
    cst.FloorDivide: cst.Multiply,
    cst.BitAnd: cst.BitOr,
    cst.BitOr: cst.BitAnd,
    cst.LeftShift: cst.RightShift,
    cst.RightShift: cst.LeftShift,
    cst.Modulo: cst.FloorDivide,
}
_FLIP_BOOL = {cst.And: cst.Or, cst.Or: cst.And}
_FLIP_CMP = {
    cst.LessThan: cst.LessThanEqual,
    cst.LessThanEqual: cst.LessThan,
    cst.GreaterThan: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.GreaterThan,
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
    cst.In: cst.NotIn,
    cst.NotIn: cst.In,
    cst.Is: cst.IsNot,
    cst.IsNot: cst.Is,
}
_NONCOMMUTATIVE = (
    cst.Subtract,
    cst.Divide,
    cst.FloorDivide,
    cst.Modulo,
    cst.Power,
    cst.LeftShift,
    cst.RightShift,
)
_PASS = cst.SimpleStatementLine([cst.Pass()])


def _one(v: int) -> cst.Integer:
    return cst.Integer(str(v))


def _shift(expr: cst.BaseExpression, delta: int) -> cst.BaseExpression:
    op = cst.Add() if delta > 0 else cst.Subtract()
    return cst.BinaryOperation(left=expr, operator=op, right=_one(abs(delta)))


def _t_flip_operator(node):
    if isinstance(node, cst.BinaryOperation) and type(node.operator) in _FLIP_BIN:
        return node.with_changes(operator=_FLIP_BIN[type(node.operator)]())
    if isinstance(node, cst.BooleanOperation) and type(node.operator) in _FLIP_BOOL:
        return node.with_changes(operator=_FLIP_BOOL[type(node.operator)]())
    return None


def _t_flip_comparison(node):
    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
        target = node.comparisons[0]
        if type(target.operator) in _FLIP_CMP:
            return node.with_changes(
                comparisons=[target.with_changes(operator=_FLIP_CMP[type(target.operator)]())]
            )
    return None


def _t_invert_condition(node):
    if isinstance(node, (cst.If, cst.While)):
        return node.with_changes(
            test=cst.UnaryOperation(
                operator=cst.Not(),
                expression=cst.ensure_type(
                    node.test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()]),
                    cst.BaseExpression,
                ),
            )
        )
    return None


def _t_change_constant(node):
    if isinstance(node, cst.Integer):
        v = node.evaluated_value
        return node.with_changes(value=str(v + 1 if v in (0, 1) else v - 1))
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.with_changes(value="False" if node.value == "True" else "True")
    return None


def _t_swap_operands(node):
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, _NONCOMMUTATIVE):
        return node.with_changes(left=node.right, right=node.left)
    return None


def _t_remove_assignment(node):
    if (
        isinstance(node, cst.SimpleStatementLine)
        and len(node.body) == 1
        and isinstance(node.body[0], (cst.Assign, cst.AugAssign, cst.AnnAssign))
    ):
        return _PASS.with_changes(leading_lines=node.leading_lines)
    return None


def _t_remove_branch(node):
    if isinstance(node, cst.If):
        if node.orelse is not None:
            return node.with_changes(orelse=None)
        return _PASS.with_changes(leading_lines=node.leading_lines)
    return None


def _t_remove_loop(node):
    if isinstance(node, (cst.For, cst.While)):
        return _PASS.with_changes(leading_lines=node.leading_lines)
    return None


def _t_off_by_one(node):
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Name)
        and node.func.value == "range"
        and 1 <= len(node.args) <= 3
        and all(a.keyword is None and not a.star for a in node.args)
    ):
        i = 0 if len(node.args) == 1 else 1
        args = list(node.args)
        args[i] = args[i].with_changes(value=_shift(args[i].value, -1 if i == 0 else 1))
        return node.with_changes(args=args)
    if isinstance(node, cst.Slice) and (node.upper is not None or node.lower is not None):
        if node.upper is not None:
            return node.with_changes(upper=_shift(node.upper, -1))
        return node.with_changes(lower=_shift(node.lower, 1))
    return None


TRANSFORMS: dict[str, Callable[[cst.CSTNode], cst.CSTNode | None]] = {
    "flip_operator": _t_flip_operator,
    "flip_comparison": _t_flip_comparison,
    "invert_condition": _t_invert_condition,
    "change_constant": _t_change_constant,
    "swap_operands": _t_swap_operands,
    "remove_assignment": _t_remove_assignment,
    "remove_branch": _t_remove_branch,
    "remove_loop": _t_remove_loop,
    "off_by_one": _t_off_by_one,
}


def _def_lines(visitor, node: cst.FunctionDef) -> range:
    """Lines from the first decorator to the ``def`` (``co_firstlineno`` is the first)."""
    end = visitor.get_metadata(PositionProvider, node).start.line
    start = (
        visitor.get_metadata(PositionProvider, node.decorators[0]).start.line
        if node.decorators
        else end
    )
    return range(min(start, end), end + 1)


class _Mutator(cst.CSTTransformer):
    """Applies ``fn`` to the ``index``-th eligible node inside the function starting at line
    ``line`` (``index`` -1: only counts the eligible nodes)."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, fn, line: int, index: int = -1):
        super().__init__()
        self.fn, self.line, self.index = fn, line, index
        self.depth = 0  # > 0 inside the target function's body
        self.count = 0
        self.done = False

    def _is_target(self, node: cst.FunctionDef) -> bool:
        return self.line in _def_lines(self, node)

    def visit_FunctionDef(self, node):
        if self.depth or self._is_target(node):
            self.depth += 1
        return True

    def leave_FunctionDef(self, original, updated):
        if self.depth:
            self.depth -= 1
        return updated

    def on_leave(self, original, updated):
        updated = super().on_leave(original, updated)
        if not self.depth or self.done or isinstance(original, cst.FunctionDef):
            return updated
        if not isinstance(updated, cst.CSTNode):
            return updated
        try:
            new = self.fn(updated)
        except Exception:  # noqa: BLE001 - a node the transform cannot handle is skipped
            new = None
        if new is None:
            return updated
        i = self.count
        self.count += 1
        if i == self.index:
            self.done = True
            return new
        return updated


class _SiteCounter(cst.CSTTransformer):
    """Counts, in one pass, the sites of every transform in every function (a nested
    function's sites count for each enclosing one, as ``_Mutator`` sees them)."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self):
        super().__init__()
        self.stack: list[int] = []
        self.counts: collections.Counter = collections.Counter()

    def visit_FunctionDef(self, node):
        self.stack.append(_def_lines(self, node)[0])
        return True

    def leave_FunctionDef(self, original, updated):
        self.stack.pop()
        return updated

    def on_leave(self, original, updated):
        updated = super().on_leave(original, updated)
        if not self.stack or isinstance(original, cst.FunctionDef):
            return updated
        if not isinstance(updated, cst.CSTNode):
            return updated
        for name, fn in TRANSFORMS.items():
            try:
                hit = fn(updated) is not None
            except Exception:  # noqa: BLE001 - as in _Mutator
                hit = False
            if hit:
                for first in self.stack:
                    self.counts[(first, name)] += 1
        return updated


def all_sites(source: str) -> dict[tuple[int, str], int]:
    """``{(function's first line, transform): sites}`` of every function in ``source``."""
    c = _SiteCounter()
    MetadataWrapper(cst.parse_module(source)).visit(c)
    return dict(c.counts)


def function_sites(source: str, line: int, transform: str) -> int:
    """How many nodes of the function starting at ``line`` ``transform`` can change."""
    m = _Mutator(TRANSFORMS[transform], line)
    MetadataWrapper(cst.parse_module(source)).visit(m)
    return m.count


def mutate(source: str, line: int, transform: str, index: int) -> str | None:
    """``source`` with the ``index``-th site of ``transform`` in the function starting at
    ``line`` changed, or None (no such site, the same code, or code that does not compile)."""
    m = _Mutator(TRANSFORMS[transform], line, index)
    out = MetadataWrapper(cst.parse_module(source)).visit(m).code
    if not m.done or out == source:
        return None
    try:
        compile(out, "<mutant>", "exec")
    except (SyntaxError, ValueError):
        return None
    return out


def functions_at(source: str) -> dict[int, str]:
    """``{first line (decorator or def): qualified name}`` of every function in ``source``."""
    out: dict[int, str] = {}

    class V(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def __init__(self):
            self.stack: list[str] = []

        def visit_ClassDef(self, node):
            self.stack.append(node.name.value)

        def leave_ClassDef(self, node):
            self.stack.pop()

        def visit_FunctionDef(self, node):
            name = ".".join([*self.stack, node.name.value])
            for ln in _def_lines(self, node):
                out[ln] = name
            self.stack.append(node.name.value)

        def leave_FunctionDef(self, node):
            self.stack.pop()

    MetadataWrapper(cst.parse_module(source)).visit(V())
    return out


# ---------------------------------------------------------------------------------------------
# Packages
# ---------------------------------------------------------------------------------------------
def _pip(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def download_sdist(spec: str, dest: str) -> str:
    """The source distribution of ``spec`` (``name`` or ``name==version``) from the registry,
    downloaded once into ``dest``; returns its path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(==[A-Za-z0-9.+!-]+)?", spec):
        raise ValueError(f"package spec {spec!r}: expected 'name' or 'name==version'")
    os.makedirs(dest, exist_ok=True)
    name = re.split(r"==", spec)[0].lower().replace("-", "_")
    version = spec.split("==")[1] if "==" in spec else None

    def found():
        pats = [
            f"{name}-{version or '*'}.tar.gz",
            f"{name.replace('_', '-')}-{version or '*'}.tar.gz",
        ]
        hits = sorted({p for pat in pats for p in glob.glob(os.path.join(dest, pat))})
        return hits[-1] if hits and version else None

    if found():
        return found()
    before = set(os.listdir(dest))
    for isolation in (["--no-build-isolation"], []):
        r = _pip(
            "download", "-q", "--no-deps", "--no-binary", ":all:", *isolation, "-d", dest, spec
        )
        if r.returncode == 0:
            break
    else:
        raise RuntimeError(f"pip download {spec} failed: {r.stderr.strip()[-800:]}")
    new = sorted(set(os.listdir(dest)) - before) or [
        os.path.basename(p) for p in glob.glob(os.path.join(dest, f"{name}-*.tar.gz"))
    ]
    tars = [n for n in new if n.endswith((".tar.gz", ".zip"))]
    if not tars:
        raise RuntimeError(f"pip download {spec}: no source distribution in {dest}")
    return os.path.join(dest, tars[-1])


def extract_sdist(path: str, dest: str) -> str:
    """The sdist's top directory, extracted under ``dest``."""
    with tarfile.open(path) as tf:
        tf.extractall(dest, filter="data")
    tops = [d for d in os.listdir(dest) if os.path.isdir(os.path.join(dest, d))]
    if len(tops) != 1:
        raise RuntimeError(f"{path}: expected one top directory, found {tops}")
    return os.path.join(dest, tops[0])


def _clean_tree(files: dict[str, str]) -> dict[str, str]:
    """Drops build leftovers of an sdist (``*.egg-info``, ``PKG-INFO``) and binary files."""
    return {
        p: t
        for p, t in files.items()
        if ".egg-info/" not in p and p != "PKG-INFO" and not p.endswith((".pyc", ".so"))
    }


# ---------------------------------------------------------------------------------------------
# Running tests in the sandbox
# ---------------------------------------------------------------------------------------------
@functools.cache
def _trace_dir() -> str:
    d = tempfile.mkdtemp(prefix="gagar_synth_trace_")
    dst = os.path.join(d, "_gagar_synth_trace.py")
    shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), "synth_trace.py"), dst)
    os.chmod(dst, 0o444)
    os.chmod(d, 0o555)
    return d


def trace_suite(
    files: Mapping[str, str],
    env_path: str,
    pythonpath: Sequence[str],
    *,
    timeout_s: float,
    wall_s: float = 900,
) -> dict[str, Any]:
    """Runs the whole suite once in the sandbox; ``{"calls": {test: [[path, line]...]},
    "outcomes": {test: outcome}, "seconds": wall}``."""

    exe, _ = python_for_sandbox()
    paths = (_trace_dir(), *env_site_packages(env_path))
    parent = tempfile.mkdtemp(prefix="gagar_synth_")
    os.chmod(parent, 0o711)
    try:
        work = os.path.join(parent, "repo")
        os.mkdir(work)
        write_tree(work, files)
        os.chmod(work, 0o777)
        argv = [exe, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                "_gagar_synth_trace", "-p", "pytest_timeout", "-o", f"timeout={timeout_s:g}",
                "-o", "addopts=", "-o", "pythonpath=" + " ".join((".", *pythonpath)),
                "-o", "console_output_style=classic",
                # a test module that cannot be imported (a test-only dependency the environment
                # lacks) leaves its tests out, not the whole suite
                "--continue-on-collection-errors"]  # fmt: skip  # argv pairs
        env = {
            "PYTHONPATH": ":".join(paths),
            "PYTHONNOUSERSITE": "1",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "GAGAR_TRACE_OUT": ".gagar_trace.json",
        }
        r = run_sandboxed(
            argv,
            work,
            Limits(
                wall_s=wall_s,
                cpu_s=int(wall_s),
                memory_bytes=4 << 30,
                nproc=256,
                disk_bytes=1 << 30,
            ),
            env=env,
            ro_paths=paths,
            private_workdir=False,  # the trace is read back from the tree
        )
        out = os.path.join(work, ".gagar_trace.json")
        if not os.path.isfile(out):
            raise RuntimeError(
                f"the test suite did not finish ({r.status}): "
                f"{(r.error or r.stdout[-600:] + r.stderr[-600:]).strip()}"
            )
        with open(out) as f:
            data = json.load(f)
        data["seconds"] = r.wall_s
        return data
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Issue text
# ---------------------------------------------------------------------------------------------
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$")


def _section_names(test_id: str) -> set[str]:
    """The headers pytest gives a test's failure/error sections (``test_x``, ``Class.test_x``,
    ``ERROR at setup of test_x`` ...)."""
    name = ".".join(test_id.split("::")[1:]) or test_id
    return {name, *(f"ERROR at {when} of {name}" for when in ("setup", "teardown", "call"))}


def failure_evidence(test_log: str, failing: Sequence[str], max_lines: int = 8) -> str:
    """The assertion/exception lines (pytest's ``E`` lines) of the failing tests' output; never
    source lines. Lines inside a failure section of another test (the verifier's hidden canary
    tests, a test that is not fail-to-pass) are left out."""
    wanted = set().union(*(_section_names(t) for t in failing)) if failing else set()
    lines, keep = [], True
    for ln in test_log.splitlines():
        s = ln.rstrip()
        m = _SECTION.match(s)
        if m:
            keep = m.group(1).strip() in wanted
            continue
        if s.startswith("=") or s.startswith("--- "):
            keep = True  # the end of the failure sections (or of the verifier's log part)
            continue
        if keep and s.startswith("E ") and s[1:].strip():
            lines.append(s[1:].strip())
    lines = list(dict.fromkeys(lines))[:max_lines]
    return "\n".join(lines) if lines else "(the tests fail without an assertion message)"


def issue_text(package: str, failing: Sequence[str], test_log: str) -> str:
    """The issue of a synthesised bug, from :data:`ISSUE_TEMPLATE` (the symptom only)."""
    first = failing[0].split("::")[-1]
    title = f"{first} fails" + (f" (and {len(failing) - 1} more)" if len(failing) > 1 else "")
    shown = list(failing[:10]) + (
        [f"... and {len(failing) - 10} more"] if len(failing) > 10 else []
    )
    return ISSUE_TEMPLATE.format(
        title=title,
        package=package,
        n_fail=len(failing),
        failing="\n".join(f"- `{t}`" for t in shown),
        evidence=failure_evidence(test_log, failing),
    )


ISSUE_PROMPT_VERSION = "v1"
MAX_LLM_ISSUE_CHARS = 4000
_ISSUE_EVIDENCE_LINES = 20


def template_source() -> str:
    """The ``issue_source`` of a template-written issue."""
    return f"template@{ISSUE_TEMPLATE_VERSION}"


def load_issue_prompt(name: str, version: str = ISSUE_PROMPT_VERSION) -> str:
    res = importlib.resources.files("gagar_jax.data") / "prompts" / version / f"{name}.md"
    if not res.is_file():
        raise FileNotFoundError(f"issue prompt {version}/{name}.md not found in gagar_jax.data")
    return res.read_text(encoding="utf-8")


class IssueWriter:
    """Issue text asked of an OpenAI-compatible chat endpoint, checked, else the template's.

    The model sees the package's name, the failing tests' ids and the assertion/exception lines
    of their output (:func:`failure_evidence`: pytest's ``E`` lines, never the source lines a
    traceback quotes), enclosed as untrusted data (``verify.untrusted.Envelope``); never the
    code, the bug or the fix. Prompts are versioned files ``data/prompts/<version>/
    synth_issue_system.md`` and ``synth_issue.md``.

    :meth:`write` returns ``(text, source)``: the model's text when it is non-empty, at most
    :data:`MAX_LLM_ISSUE_CHARS` characters, holds no envelope tag and passes ``accept`` (the
    factory's leak check, the one the template text must pass); else the template text given
    (``source`` ``template@<version>``), counted in :attr:`metrics` (``fallbacks`` and
    ``fallback_<reason>``: ``client_error``, ``no_response``, ``empty``, ``too_long``,
    ``envelope``, ``no_symptom`` (:func:`names_symptom`), ``leaks``). A dead endpoint costs one
    failed request per task, never a task.

    Args:
      client: anything with ``chat_completions(messages, *, tools, max_tokens, temperature,
        **extra) -> dict`` (``rollout.SGLangClient``), or an ``http(s)`` URL for one.
      model: the ``model`` field of the request (SGLang serves one model: ``default``).
      request_timeout_s, max_retries: for the client made from a URL.
    """

    def __init__(
        self,
        client: Any,
        *,
        model: str = "default",
        max_tokens: int = 768,
        temperature: float = 0.0,
        prompt_version: str = ISSUE_PROMPT_VERSION,
        request_timeout_s: float = 120.0,
        max_retries: int = 1,
    ):
        if isinstance(client, str):
            client = SGLangClient(
                client,
                max_retries=max_retries,
                request_timeout_s=request_timeout_s,
                max_retry_time_s=request_timeout_s,
                backoff_max_s=2.0,
            )
        if not callable(getattr(client, "chat_completions", None)):
            raise TypeError(
                "IssueWriter.client: expected an http(s) URL or an object with "
                f"chat_completions(messages, ...), got {type(client).__name__}"
            )
        if not isinstance(model, str) or not model:
            raise ValueError(f"IssueWriter.model: expected a non-empty string, got {model!r}")
        if max_tokens < 1:
            raise ValueError(f"IssueWriter.max_tokens must be >= 1, got {max_tokens}")
        self.client = client
        self.model = model
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.prompt_version = prompt_version
        self.system = load_issue_prompt("synth_issue_system", prompt_version)
        self.template = string.Template(load_issue_prompt("synth_issue", prompt_version))
        self.source = f"llm@synth_issue/{prompt_version}"
        self.metrics: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, *keys: str) -> None:
        with self._lock:
            self.metrics.update(keys)

    def messages(self, package: str, failing: Sequence[str], test_log: str) -> list[dict]:
        """The chat request's messages: the test output enclosed in a fresh envelope."""
        env = Envelope()
        shown = list(failing[:20]) + (
            [f"... and {len(failing) - 20} more"] if len(failing) > 20 else []
        )
        evidence = failure_evidence(test_log, failing, max_lines=_ISSUE_EVIDENCE_LINES)
        user = self.template.substitute(
            package=package,
            n_fail=len(failing),
            failing=env.wrap("\n".join(f"- {t}" for t in shown), "failing test ids"),
            test_output=env.wrap(evidence, "failing test assertion lines", marked=True),
            max_chars=MAX_LLM_ISSUE_CHARS,
        )
        return [{"role": "system", "content": self.system}, {"role": "user", "content": user}]

    def _reply(self, package, failing, test_log) -> str:
        """The model's text (stripped), or raises ``_Fallback`` naming why not."""
        try:
            resp = self.client.chat_completions(
                self.messages(package, failing, test_log),
                tools=None,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                # SGLang serves one model, "default"; a client without a `model` keyword
                # (a scripted policy) works with the default
                **({"model": self.model} if self.model != "default" else {}),
            )
        except Exception as e:  # noqa: BLE001 - a dead or failing server falls back
            raise _Fallback("client_error") from e
        try:
            text = resp["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as e:
            raise _Fallback("no_response") from e
        if not isinstance(text, str) or not text.strip():
            raise _Fallback("empty")
        text = text.strip()
        if len(text) > MAX_LLM_ISSUE_CHARS:
            raise _Fallback("too_long")
        if re.search(r"</?untrusted-", text, re.IGNORECASE):
            raise _Fallback("envelope")
        if not names_symptom(text, failing, test_log):
            raise _Fallback("no_symptom")
        return text + "\n"

    def write(
        self,
        package: str,
        failing: Sequence[str],
        test_log: str,
        *,
        template: str,
        accept: Callable[[str], bool],
    ) -> tuple[str, str]:
        """``(issue text, issue_source)``: the model's if accepted, else ``template``'s."""
        self._count("calls")
        try:
            text = self._reply(package, failing, test_log)
            if not accept(text):
                raise _Fallback("leaks")
        except _Fallback as f:
            self._count("fallbacks", f"fallback_{f.reason}")
            return template, template_source()
        self._count("accepted")
        return text, self.source


_SYMPTOM_STOPWORDS = frozenset(
    {"assert", "where", "None", "True", "False", "self", "return", "from", "with", "lambda"}
)


def names_symptom(text: str, failing: Sequence[str], test_log: str) -> bool:
    """Whether ``text`` names what fails: one of the failing tests (its function's name, without
    parameters), or a name from their assertion/exception lines (the function a failing
    assertion called, an exception type such as ``KeyError``). An issue that names none of them
    describes no observable symptom and is not kept."""
    names = {t.split("::")[-1].split("[")[0] for t in failing}
    evidence = failure_evidence(test_log, failing, max_lines=_ISSUE_EVIDENCE_LINES)
    names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", evidence)) - _SYMPTOM_STOPWORDS
    return any(
        n and re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", text) for n in names
    )


class _Fallback(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def leak_reason(kinds: Mapping[str, Sequence[str]]) -> str:
    """The rejection reason of a candidate the audit finds leaking its fix: ``leaks_<kind>``
    of the first kind found (``audit.LEAK_KINDS`` order; ``issue_text`` is the template's
    ``issue_leaks_fix``, kept under that name)."""
    kind = next(k for k in audit.LEAK_KINDS if k in kinds)
    return "issue_leaks_fix" if kind == "issue_text" else f"leaks_{kind}"


def issue_leaks(task: RepoTask, issue: str) -> bool:
    """Whether ``issue`` as the task's issue text leaks its fix (``audit.leak_kinds``)."""
    return "issue_text" in audit.leak_kinds(dataclasses.replace(task, issue=issue))


# ---------------------------------------------------------------------------------------------
# The factory
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Stats:
    package: str
    candidates: int = 0
    screened: int = 0
    kept: int = 0
    p2p_dropped: int = 0  # candidates whose order-dependent pass-to-pass tests were dropped
    issue_llm_accepted: int = 0  # tasks whose issue the LLM wrote
    issue_llm_fallbacks: int = 0  # tasks whose LLM issue was refused: the template wrote it
    order_dependent: int = 0  # passing tests of the suite that fail in reverse order only
    # passing tests of the suite the verifier's own run loses (left out), and by reason: a
    # confirmed runtime-audit event that made a run count as tampered, the audit's evidence of
    # a run whose tests fail under the verifier in suite order too, or ``fails_under_verifier``
    verifier_lost: int = 0
    verifier_lost_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # candidates whose fix the verifier flagged (confirmed), by the flag's kind
    fix_flagged: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    transforms_kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    env_seconds: float = 0.0
    env_reused: bool = False
    suite_seconds: float = 0.0
    seconds: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rejected"] = dict(self.rejected)
        d["verifier_lost_by"] = dict(self.verifier_lost_by)
        d["fix_flagged"] = dict(self.fix_flagged)
        d["transforms_kept"] = dict(self.transforms_kept)
        return d


def _candidates(files, calls, passing, rng) -> Iterator[tuple[str, int, str, str, int]]:
    """(path, line, function, transform, site) over covered functions, shuffled."""
    covered: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for test, sites in calls.items():
        if test in passing:
            for path, line in sites:
                covered[(path, line)].add(test)
    out = []
    parsed: dict[str, tuple[dict, dict]] = {}
    for path, line in sorted(covered):
        if path not in files or not path.endswith(".py") or _is_test_file(path):
            continue
        if path not in parsed:
            try:
                parsed[path] = (functions_at(files[path]), all_sites(files[path]))
            except cst.ParserSyntaxError:
                parsed[path] = ({}, {})
        names, sites = parsed[path]
        if line not in names:
            continue
        for t in TRANSFORMS:
            out += [(path, line, names[line], t, i) for i in range(sites.get((line, t), 0))]
    rng.shuffle(out)
    # round-robin over transforms so the mix is not dominated by the commonest site kind
    by_t: dict[str, list] = collections.defaultdict(list)
    for c in out:
        by_t[c[3]].append(c)
    order = list(TRANSFORMS)
    rng.shuffle(order)  # which transform comes first differs per package
    while any(by_t.values()):
        for t in order:
            if by_t[t]:
                yield by_t[t].pop()


def _is_test_file(path: str) -> bool:
    base = os.path.basename(path)
    return (
        base.startswith("test_")
        or base.endswith("_test.py")
        or base == "conftest.py"
        or "/tests/" in "/" + path
        or "/test/" in "/" + path
    )


def coverage_index(calls: Mapping[str, Sequence], passing) -> dict[tuple[str, int], list[str]]:
    """``{(path, function's first line): [passing tests that call it]}`` (sorted)."""
    out: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for test in sorted(passing):
        for path, line in calls.get(test, ()):
            out[(path, line)].append(test)
    return dict(out)


def _run_ids(
    covering: Sequence[str], passing, rng, max_p2p: int, max_covering: int = 40
) -> tuple[str, ...]:
    """The tests a candidate runs: the tests that cover it (a sample of ``max_covering`` when
    more do: a function every parametrised case of a large suite calls would make slow,
    thousand-test tasks) and up to ``max_p2p`` other passing tests of the same files (the
    pass-to-pass candidates); only these files are collected."""
    covering = list(covering)
    if len(covering) > max_covering:
        covering = sorted(rng.sample(covering, max_covering))
    files = {c.split("::")[0] for c in covering}
    chosen = set(covering)
    others = sorted(t for t in passing if t.split("::")[0] in files and t not in chosen)
    rng.shuffle(others)
    return tuple(covering + others[:max_p2p])


def _validate_early(task, screen, runs: int, verify, gate) -> tuple[dict[str, Any], Any]:
    """swe's validation line of ``task`` (gold ``runs`` times, empty ``runs`` times), stopping
    at the first run that rules the task out (gold not passed, empty not failed, a test whose
    outcome changed): the line then carries the statuses seen so far. ``screen`` (the
    screening run of the same tests on the buggy tree, or None) counts as the first empty run.
    Runs alternate gold, empty, gold ... so that a broken fix is seen after one run. Returns
    (the line, the first gold run)."""

    results = [("empty", screen)] if screen is not None else []
    first_gold = None
    kinds = ["gold", "empty"] * runs
    if screen is not None:
        kinds.pop()  # the screening run was the first empty one
    for kind in kinds:
        with gate:
            v = verify(task, task.reference_patch if kind == "gold" else "")
        first_gold = first_gold or (v if kind == "gold" else None)
        results.append((kind, v))
        rep = swe.summarise_runs(task, results)
        want = "passed" if kind == "gold" else "failed"
        if v.status != want or rep["flaky_tests"]:
            return rep, first_gold
    return swe.summarise_runs(task, results), first_gold


def _order_dependent(gold, f2p: Sequence[str], p2p: Sequence[str]) -> set[str]:
    """Pass-to-pass tests that failed under the fix while every fail-to-pass test passed: they
    passed in the screening run, whose test order differs (fail-to-pass tests run first in
    the task), so they depend on the order of the tests (e.g. on state another test sets)."""
    if gold is None or gold.status in ("infra_error", "timeout", "resource_killed"):
        return set()
    if not all(gold.tests.get(t) == "passed" for t in f2p):
        return set()
    return {t for t in p2p if gold.tests.get(t) not in ("passed", "skipped")}


def flag_kind(flag) -> str:
    """A monitor flag's kind: the runtime audit's event kind when it came from the audit
    (``read_test_source``, ``test_function_changed``, ...), else its rule."""
    m = re.match(r"(?:test report: )?runtime audit: ([\w.]+):", flag.evidence)
    return m.group(1) if m else flag.rule


def _confirmed_kinds(v) -> collections.Counter:
    """Confirmed flags of a verification by kind (the test report's repeat of the first audit
    event is not counted again)."""
    return collections.Counter(
        flag_kind(f)
        for f in v.flags
        if f.confirmed and not f.evidence.startswith("test report: runtime audit:")
    )


# The runtime audit's evidence-level events that refuse what was asked (the test's line comes
# back empty): a test of the package's own suite can fail on them.
REFUSED_EVIDENCE = frozenset({"read_test_line"})


def _evidence_kinds(v) -> collections.Counter:
    return collections.Counter(flag_kind(f) for f in v.flags if not f.confirmed)


@dataclasses.dataclass
class SuiteCheck:
    """What the verifier's own runs of a suite's passing tests keep and lose
    (:func:`check_suite_order`)."""

    kept: list[str]  # in suite order
    order_dependent: list[str] = dataclasses.field(default_factory=list)
    verifier_lost: list[str] = dataclasses.field(default_factory=list)
    lost_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    notes: list[str] = dataclasses.field(default_factory=list)  # one log line each


def check_suite_order(
    files: Mapping[str, str],
    passing: Sequence[str],
    verify: Callable[[RepoTask], Any],
    **task_kw: Any,
) -> SuiteCheck:
    """Which of the suite's passing tests (``passing``, in suite order) a task may use.

    A task runs its fail-to-pass tests first, so the passing tests run once in reverse order
    under the verifier (``verify(task)``, the runtime audit on, as every task run has it):

    - a run the verifier judges tampered (a confirmed runtime-audit event: the package's own
      code does something the audit refuses) counts every test as missing; the test files
      then run one by one, and the tests of each file whose run is judged tampered are lost
      to the verifier, by the kinds of its confirmed events;
    - a test that fails in reverse order runs again in suite order (with every test kept so
      far): failing again, it is lost to the verifier, by what the audit refused when its file's
      lost tests run alone (confirmed kinds, else ``read_test_line``, else
      ``fails_under_verifier``); passing, it depends on the order of the tests.

    Every loss is named in ``notes`` (the factory's log) and counted by reason in ``lost_by``
    (tests lost per reason). ``task_kw`` are the ``RepoTask`` fields of the runs."""
    out = SuiteCheck(kept=[])

    def run(ids, name):
        v = verify(RepoTask(name, "", files, tuple(ids), **task_kw))
        if v.status not in ("passed", "failed"):
            raise RuntimeError(
                f"the verifier's run of the suite ended {v.status}: {v.test_log[-600:]}"
            )
        return v

    def kinds_text(c):
        return ", ".join(f"{k} {n}" for k, n in sorted(c.items()))

    def sample(v, refused=False):
        ev = next((f.evidence for f in v.flags if f.confirmed), "") or next(
            (
                f.evidence
                for f in v.flags
                if refused and flag_kind(f) in REFUSED_EVIDENCE and not f.confirmed
            ),
            "",
        )
        return f"; e.g. {ev[:200]}" if ev else ""

    rv = run(list(passing)[::-1], "order-check")
    ok = set(passing)
    failing: list[str] = []
    conf = _confirmed_kinds(rv)
    if conf:
        out.notes.append(
            f"the verifier judged the suite's run tampered (confirmed: {kinds_text(conf)}"
            f"{sample(rv)}): its test files run one by one"
        )
        by_file: dict[str, list[str]] = {}
        for t in passing:
            by_file.setdefault(t.split("::")[0], []).append(t)
        for path, ids in by_file.items():
            fv = run(ids[::-1], "order-check-file")
            fconf = _confirmed_kinds(fv)
            if fconf:
                ok -= set(ids)
                out.verifier_lost += ids
                for k in fconf:
                    out.lost_by[k] += len(ids)
                out.notes.append(
                    f"{len(ids)} tests of {path} lost to the verifier (its run judged tampered, "
                    f"confirmed: {kinds_text(fconf)}{sample(fv)})"
                )
            else:
                failing += [t for t in ids if fv.tests.get(t) != "passed"]
    else:
        failing = [t for t in passing if rv.tests.get(t) != "passed"]
    if failing:
        # the suite order of every test still kept (a test needing another one gets it first)
        fwd = run([t for t in passing if t in ok], "order-check-forward")
        again = [t for t in failing if fwd.tests.get(t) != "passed"]
        by_file = {}
        for t in again:
            by_file.setdefault(t.split("::")[0], []).append(t)
        for path, ids in by_file.items():
            # alone, so that the audit's events are theirs: what the run refused
            lone = run(ids, "order-check-lost")
            why = _confirmed_kinds(lone) or collections.Counter(
                {k: n for k, n in _evidence_kinds(lone).items() if k in REFUSED_EVIDENCE}
            )
            why = why or collections.Counter({"fails_under_verifier": 1})
            out.verifier_lost += ids
            for k in why:
                out.lost_by[k] += len(ids)
            out.notes.append(
                f"{len(ids)} tests of {path} fail under the verifier in suite order too, lost to "
                f"it ({kinds_text(why)}{sample(lone, refused=True)}): {', '.join(ids[:3])}"
                + (" ..." if len(ids) > 3 else "")
            )
        out.order_dependent = [t for t in failing if t not in again]
        ok -= set(failing)
    out.notes.append(
        f"{len(out.order_dependent)} tests fail in reverse order only (order-dependent, left out)"
    )
    out.kept = [t for t in passing if t in ok]
    return out


def make_package_tasks(
    spec: str,
    out_dir: str,
    *,
    max_tasks: int,
    cache_dir: str | None = None,
    runs: int = 3,
    seed: int = 0,
    test_timeout_s: float = 10.0,
    max_candidates: int = 200,
    max_p2p: int = 20,
    workers: int = 1,
    max_run_s: float = 10.0,
    run_gate=None,
    issue_llm: Any = None,
    issue_llm_model: str = "default",
    log: Callable[[str], None] = print,
) -> tuple[list[dict], Stats]:
    """Tasks of one package (SWE-bench rows) and their statistics; the repository goes to
    ``out_dir/repos/pypi__<name>``.

    ``workers`` candidates are screened and validated at once (threads); ``run_gate`` (a
    semaphore shared by packages made at the same time) bounds the sandboxed runs of all of
    them. A candidate is validated with early rejection (:func:`_validate_early`); a mutant
    whose screening run takes longer than ``max_run_s`` is rejected (``slow_run``): every
    rollout of such a task would pay for it.

    ``issue_llm``: None (the template writes every issue), an OpenAI-compatible endpoint's URL
    (``issue_llm_model`` names the model) or an :class:`IssueWriter`; the model's issue is kept
    only when it passes the leak check, else the template's is (counted in
    ``issue_llm_fallbacks``); each row's ``synth.issue_source`` says which wrote it."""
    t0 = time.monotonic()
    name = spec.split("==")[0]
    stats = Stats(spec)
    cache = os.path.abspath(cache_dir or repos.default_cache_dir())
    work = tempfile.mkdtemp(prefix=f"gagar_synth_{name}_")
    gate = run_gate if run_gate is not None else threading.BoundedSemaphore(max(1, workers))
    rows: list[dict] = []
    writer = (
        issue_llm
        if issue_llm is None or isinstance(issue_llm, IssueWriter)
        else IssueWriter(issue_llm, model=issue_llm_model)
    )
    try:
        sdist = download_sdist(spec, os.path.join(cache, "sdists"))
        top = extract_sdist(sdist, work)
        files = _clean_tree(repos.read_text_tree(top))
        pythonpath = repos.detect_pythonpath(files)
        deps = repos.package_requirements(files)
        env = repos.build_env(deps, cache_dir=cache)
        stats.env_seconds, stats.env_reused = env.seconds, env.reused
        log(
            f"{spec}: {len(files)} files, env {env.env_hash[:12]} "
            f"({'reused' if env.reused else 'built'} in {env.seconds:.1f}s)"
        )
        with gate:
            trace = trace_suite(files, env.path, pythonpath, timeout_s=test_timeout_s)
        stats.suite_seconds = trace["seconds"]
        passing = {t for t, o in trace["outcomes"].items() if o == "passed" and "::" in t}
        log(
            f"{spec}: suite {len(trace['outcomes'])} tests, {len(passing)} pass "
            f"({trace['seconds']:.1f}s)"
        )
        # A task runs its fail-to-pass tests first: a test that passes only after another one
        # (state a test sets on its class or module) would fail under the fix, and a test the
        # verifier's own run loses (the runtime audit refusing the package's code) could never
        # pass; both are left out, each loss logged and counted by reason.
        order = [t for t in trace["outcomes"] if t in passing]
        with gate:
            sc = check_suite_order(
                files,
                order,
                lambda t: verify_repo_patch(
                    t,
                    "",
                    limits=Limits(wall_s=900, cpu_s=900, memory_bytes=4 << 30, nproc=256),
                    run_monitor=False,
                ),
                test_timeout_s=test_timeout_s,
                env_path=env.path,
                pythonpath=pythonpath,
            )
        stats.order_dependent = len(sc.order_dependent)
        stats.verifier_lost = len(sc.verifier_lost)
        stats.verifier_lost_by.update(sc.lost_by)
        passing = set(sc.kept)
        for note in sc.notes:
            log(f"{spec}: {note}")
        key = "pypi__" + re.sub(r"[^\w.-]", "_", name.lower())
        repo_name = key.replace("__", "/", 1)
        store = os.path.join(out_dir, "repos", key)
        if os.path.exists(store):
            shutil.rmtree(store)
        os.makedirs(store)
        repos.git("init", "-q", "-b", "main", cwd=store)
        write_tree(store, files)
        repos.git("add", "-A", cwd=store)
        repos.git("commit", "-q", "--no-verify", "-m", f"{spec} (pristine)", cwd=store)
        rng = random.Random(f"{seed}:{spec}")
        limits = Limits(
            wall_s=max(60.0, 4 * test_timeout_s + 30), cpu_s=300, memory_bytes=2 << 30, nproc=128
        )
        lock = threading.Condition()
        errors: list[BaseException] = []
        seen_funcs: collections.Counter = collections.Counter()
        in_flight = [0]
        cands = _candidates(files, trace["calls"], passing, rng)
        index = coverage_index(trace["calls"], passing)

        # a screening run longer than max_run_s is rejected anyway: its limit ends it soon after
        screen_limits = dataclasses.replace(limits, wall_s=min(limits.wall_s, max_run_s + 5))

        def verify(task, patch, lim=limits):
            return verify_repo_patch(task, patch, limits=lim, run_monitor=False)

        def take():
            """The next candidate worth trying, or None when the package is done; waits while
            the candidates in flight could still fill the quota."""
            with lock:
                while True:
                    if errors or stats.kept >= max_tasks or stats.candidates >= max_candidates:
                        return None
                    if stats.kept + in_flight[0] < max_tasks:
                        break
                    lock.wait()
                for cand in cands:
                    if seen_funcs[(cand[0], cand[2])] >= 2:  # spread tasks over functions
                        continue
                    stats.candidates += 1
                    in_flight[0] += 1
                    seen_funcs[(cand[0], cand[2])] += 1  # released if it is rejected
                    return cand, random.Random(rng.random())
                return None

        def reject(cand, reason):
            with lock:
                stats.rejected[reason] += 1
                seen_funcs[(cand[0], cand[2])] -= 1

        def attempt(cand, crng) -> None:
            path, line, func, transform, site = cand
            mutant = mutate(files[path], line, transform, site)
            if mutant is None:
                return reject(cand, "no_change")
            buggy = {**files, path: mutant}
            covering = index.get((path, line), [])
            run_ids = _run_ids(covering, passing, crng, max_p2p)
            with lock:
                stats.screened += 1
            probe = RepoTask(
                "probe",
                "",
                buggy,
                run_ids,
                test_timeout_s=test_timeout_s,
                env_path=env.path,
                pythonpath=pythonpath,
                env_hash=env.env_hash,
            )
            with gate:
                v = verify(probe, "", screen_limits)
            if v.status == "timeout":
                return reject(cand, "slow_run")
            if v.status in ("infra_error", "resource_killed"):
                return reject(cand, f"screen_{v.status}")
            if v.sandbox is not None and v.sandbox.wall_s > max_run_s:
                return reject(cand, "slow_run")
            f2p = tuple(t for t in run_ids if v.tests.get(t) != "passed")
            p2p = tuple(t for t in run_ids if v.tests.get(t) == "passed")
            if not f2p:
                return reject(cand, "no_fail_to_pass")
            if not p2p:
                return reject(cand, "no_pass_to_pass")
            fix = tree_patch(buggy, files)
            issue = issue_text(name, f2p, v.test_log)
            test_paths = tuple(sorted({t.split("::")[0] for t in run_ids}))
            task = RepoTask(
                f"{key}.candidate",
                issue,
                buggy,
                f2p,
                p2p,
                test_files=test_paths,
                reference_patch=fix,
                pythonpath=pythonpath,
                env_path=env.path,
                test_timeout_s=test_timeout_s,
                env_hash=env.env_hash,
            )
            leaks = audit.leak_kinds(task)  # the audit's every kind, file_text included
            if leaks:
                return reject(cand, leak_reason(leaks))
            issue_source = template_source()
            rep, gold = _validate_early(task, v, runs, verify, gate)
            odd = _order_dependent(gold, f2p, p2p) if rep["gold"] != "passed" else set()
            if odd and len(odd) < len(p2p):
                # drop them and validate again from scratch (the screening run had them)
                with lock:
                    stats.p2p_dropped += 1
                p2p = tuple(t for t in p2p if t not in odd)
                task = dataclasses.replace(task, pass_to_pass=p2p)
                rep, _ = _validate_early(task, None, runs, verify, gate)
            if rep["gold"] != "passed":
                flagged = _confirmed_kinds(gold) if gold is not None else None
                if flagged:
                    # the fix itself judged a cheat: the verifier's doing, counted by kind
                    with lock:
                        stats.fix_flagged.update(flagged.keys())
                    return reject(cand, "validation_gold_flagged")
                return reject(cand, "validation_gold")
            if rep["empty"] != "failed" or rep["flaky_tests"]:
                return reject(
                    cand, "validation_empty" if not rep["flaky_tests"] else "validation_flaky"
                )
            if writer is not None:  # asked only for a validated task: it is kept either way
                issue, issue_source = writer.write(
                    name,
                    f2p,
                    v.test_log,
                    template=issue,
                    accept=lambda text: not issue_leaks(task, text),
                )
                task = dataclasses.replace(task, issue=issue)
            with lock:
                tid = f"{key}.{stats.kept + 1:04d}"
                branch = f"task/{tid}"
                repos.git("checkout", "-q", "-b", branch, "main", cwd=store)
                with open(os.path.join(store, path), "w", encoding="utf-8") as f:
                    f.write(mutant)
                repos.git("commit", "-q", "--no-verify", "-am", "base", cwd=store)
                sha = repos.git("rev-parse", "HEAD", cwd=store).stdout.decode().strip()
                repos.git("checkout", "-q", "main", cwd=store)
                rows.append(
                    swe.SweInstance(
                        tid,
                        repo_name,
                        sha,
                        fix,
                        "",
                        issue,
                        f2p,
                        p2p,
                        hints_text="",
                        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        version=spec.split("==")[1] if "==" in spec else "",
                        environment_setup_commit=sha,
                        test_cmd="pytest",
                        python_deps=tuple(deps),
                        install="pythonpath",
                    ).to_row()
                    | {
                        "synth": {
                            "transform": transform,
                            "file": path,
                            "function": func,
                            "template": ISSUE_TEMPLATE_VERSION,
                            "issue_source": issue_source,
                        }
                    }
                )
                stats.kept += 1
                stats.transforms_kept[transform] += 1
                if writer is not None:
                    if issue_source == template_source():
                        stats.issue_llm_fallbacks += 1
                    else:
                        stats.issue_llm_accepted += 1
            log(
                f"{spec}: task {tid} ({transform} in {path}:{func}; F2P {len(f2p)}, P2P {len(p2p)})"
            )

        def worker() -> None:
            while True:
                got = take()
                if got is None:
                    return
                try:
                    attempt(*got)
                except BaseException as e:  # noqa: BLE001 - ends the package, reported below
                    errors.append(e)
                finally:
                    with lock:
                        in_flight[0] -= 1
                        lock.notify_all()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        if stats.fix_flagged:
            log(
                f"{spec}: {stats.rejected['validation_gold_flagged']} candidates lost: the "
                "verifier flagged their fix (confirmed: "
                + ", ".join(f"{k} {n}" for k, n in sorted(stats.fix_flagged.items()))
                + ")"
            )
    except Exception as e:  # noqa: BLE001 - one package's failure is reported, others go on
        stats.error = f"{type(e).__name__}: {e}"
        log(f"{spec}: failed: {stats.error}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        stats.seconds = time.monotonic() - t0
    return rows, stats


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the sandboxed runs)."""
    import resource

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _reversed(fp):
    """The file patch that undoes ``fp`` (old and new sides swapped)."""
    from gagar_jax.verify.diff import FilePatch, Hunk

    flip = {"+": "-", "-": "+", " ": " "}
    hunks = tuple(
        Hunk(
            h.new_start,
            h.new_len,
            h.old_start,
            h.old_len,
            tuple(flip[ln[0]] + ln[1:] for ln in h.lines),
            h.new_eof_newline,
            h.old_eof_newline,
        )
        for h in fp.hunks
    )
    return FilePatch(fp.new_path, fp.old_path, hunks)


def rebuild_repos(
    instances: str,
    out_dir: str,
    *,
    cache_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> str:
    """The repositories of factory rows, rebuilt from the registry: an instances file can be
    shared without its ``repos/``.

    For each package (``repo`` ``pypi/<name>``, ``version``) the release's source distribution
    is downloaded (cached) and committed on ``main`` of ``out_dir/repos/pypi__<name>``; each
    row's bug is its ``patch`` (the fix) undone on that tree, committed on ``task/<id>``, and
    checked: the fix must give the release back. Writes the rows, ``base_commit`` and
    ``environment_setup_commit`` set to the new commits, to ``out_dir/instances.jsonl`` and
    returns its path. A row that is not a factory row, or whose fix does not match the
    release, raises ValueError naming the row."""
    from gagar_jax.data import repos
    from gagar_jax.verify.diff import DiffError, apply_unified_diff, parse_unified_diff
    from gagar_jax.verify.repo import write_tree

    with open(instances, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_pkg: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for n, row in enumerate(rows, start=1):
        repo, version = row.get("repo", ""), row.get("version", "")
        if not (isinstance(repo, str) and repo.startswith("pypi/") and version):
            raise ValueError(
                f"{instances}:{n}: repo {repo!r}, version {version!r}: expected a "
                "factory row ('pypi/<name>' and the release's version)"
            )
        by_pkg[(repo, version)].append(row)
    cache = os.path.abspath(cache_dir or repos.default_cache_dir())
    os.makedirs(os.path.join(out_dir, "repos"), exist_ok=True)
    for (repo, version), pkg_rows in by_pkg.items():
        spec = f"{repo.split('/', 1)[1]}=={version}"
        work = tempfile.mkdtemp(prefix="gagar_rebuild_")
        try:
            top = extract_sdist(download_sdist(spec, os.path.join(cache, "sdists")), work)
            files = _clean_tree(repos.read_text_tree(top))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        store = os.path.join(out_dir, "repos", repos.repo_key(repo))
        shutil.rmtree(store, ignore_errors=True)
        os.makedirs(store)
        repos.git("init", "-q", "-b", "main", cwd=store)
        write_tree(store, files)
        repos.git("add", "-A", cwd=store)
        repos.git("commit", "-q", "--no-verify", "-m", f"{spec} (pristine)", cwd=store)
        for row in pkg_rows:
            where = f"{instances}: {row.get('instance_id')!r}"
            try:
                fix = parse_unified_diff(row["patch"])
                buggy = apply_unified_diff(files, [_reversed(fp) for fp in fix])
                restored = apply_unified_diff(buggy, fix)
            except (DiffError, KeyError) as e:
                raise ValueError(f"{where}: its patch does not undo on {spec}: {e}") from e
            if restored != files:
                raise ValueError(f"{where}: its patch does not give {spec} back")
            repos.git("checkout", "-q", "-b", f"task/{row['instance_id']}", "main", cwd=store)
            write_tree(store, {p: t for p, t in buggy.items() if files.get(p) != t})
            repos.git("commit", "-q", "--no-verify", "-am", "base", cwd=store)
            sha = repos.git("rev-parse", "HEAD", cwd=store).stdout.decode().strip()
            repos.git("checkout", "-q", "main", cwd=store)
            row["base_commit"] = row["environment_setup_commit"] = sha
        log(f"rebuilt {repo} ({spec}): {len(pkg_rows)} task(s)")
    path = os.path.join(out_dir, "instances.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.data.synth")
    ap.add_argument("--packages", required=True, help="comma-separated names or name==version")
    ap.add_argument("--out", required=True, help="output directory (instances.jsonl, repos/)")
    ap.add_argument("--tasks-per-package", type=int, default=25)
    ap.add_argument(
        "--max-candidates", type=int, default=200, help="mutants tried per package at most"
    )
    ap.add_argument("--runs", type=int, default=3, help="validation runs of gold and empty")
    ap.add_argument("--test-timeout", type=float, default=10.0, help="per-test timeout (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="sandboxed runs at once, over all packages (default: one per core, at most 4); "
        "as many packages are made at once, each trying as many candidates at once",
    )
    ap.add_argument(
        "--max-run-seconds",
        type=float,
        default=10.0,
        help="a mutant whose screening run takes longer is rejected (slow_run)",
    )
    ap.add_argument("--cache", default=None, help="sdist/environment cache directory")
    ap.add_argument(
        "--issue-llm",
        default="",
        metavar="URL",
        help="an OpenAI-compatible chat endpoint (an SGLang server) that writes each issue from "
        "the failing tests' output; a refused or failed answer falls back to the template",
    )
    ap.add_argument(
        "--issue-llm-model", default="default", help="the model named in --issue-llm requests"
    )
    args = ap.parse_args(argv)
    from concurrent.futures import ThreadPoolExecutor

    specs = [p.strip() for p in args.packages.split(",") if p.strip()]
    if not specs:
        ap.error("--packages names no package")
    os.makedirs(os.path.join(args.out, "repos"), exist_ok=True)
    t0 = time.monotonic()
    load_start = os.getloadavg()
    workers = max(1, args.workers or swe.default_workers())
    gate = threading.BoundedSemaphore(workers)  # sandboxed runs at once, all packages together
    writer = None
    if args.issue_llm:
        try:
            writer = IssueWriter(args.issue_llm, model=args.issue_llm_model)
        except (TypeError, ValueError) as e:
            ap.error(f"--issue-llm: {e}")
    all_rows, all_stats = [], []
    path = os.path.join(args.out, "instances.jsonl")

    def one(spec):
        return make_package_tasks(
            spec,
            args.out,
            max_tasks=args.tasks_per_package,
            cache_dir=args.cache,
            runs=args.runs,
            seed=args.seed,
            test_timeout_s=args.test_timeout,
            max_candidates=args.max_candidates,
            workers=workers,
            max_run_s=args.max_run_seconds,
            run_gate=gate,
            issue_llm=writer,
        )

    with open(path, "w", encoding="utf-8") as f, ThreadPoolExecutor(workers) as pool:
        for rows, stats in pool.map(one, specs):  # in the packages' order
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            all_rows += rows
            all_stats.append(stats)
    wall = time.monotonic() - t0
    mix = collections.Counter()
    for s in all_stats:
        mix.update(s.transforms_kept)
    screened = sum(s.screened for s in all_stats)
    summary = {
        "tasks": len(all_rows),
        "packages": len(specs),
        "packages_with_tasks": sum(s.kept > 0 for s in all_stats),
        "seconds": round(wall, 1),
        "tasks_per_hour": round(len(all_rows) / wall * 3600, 1) if wall else 0.0,
        "seconds_per_task": round(wall / len(all_rows), 1) if all_rows else None,
        "yield": round(len(all_rows) / screened, 3) if screened else 0.0,
        "transform_mix": dict(mix),
        "template": ISSUE_TEMPLATE_VERSION,
        "issue_llm": (
            {"prompt": writer.source, "model": args.issue_llm_model} if writer is not None else None
        ),
        "issue_llm_accepted": sum(s.issue_llm_accepted for s in all_stats),
        "issue_llm_fallbacks": sum(s.issue_llm_fallbacks for s in all_stats),
        "issue_llm_fallback_reasons": (
            {k: n for k, n in writer.metrics.items() if k.startswith("fallback_")} if writer else {}
        ),
        "workers": workers,
        "cpu_seconds": round(_cpu_seconds(), 1),
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "verifier_lost": sum(s.verifier_lost for s in all_stats),
        "fix_flagged": sum(sum(s.fix_flagged.values()) for s in all_stats),
        "per_package": [s.to_dict() for s in all_stats],
    }
    with open(os.path.join(args.out, "synth_stats.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"{len(all_rows)} tasks from {summary['packages_with_tasks']}/{len(specs)} packages "
        f"in {wall:.0f}s ({summary['tasks_per_hour']} tasks/hour, yield "
        f"{summary['yield']:.0%} of screened mutants, {summary['cpu_seconds']} CPU-s, load "
        f"{summary['load_start'][0]} -> {summary['load_end'][0]}); mix {dict(mix)} -> {path}"
    )
    if summary["verifier_lost"] or summary["fix_flagged"]:
        print(
            f"lost to the verifier: {summary['verifier_lost']} passing tests of the suites, "
            f"{summary['fix_flagged']} candidates whose fix it flagged (by reason: "
            "synth_stats.json per_package verifier_lost_by, fix_flagged)"
        )
    return 0 if all_rows else 1


if __name__ == "__main__":
    sys.exit(main())
