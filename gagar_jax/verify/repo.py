"""Test verifier for Python repository tasks (SWE-bench style), run in the sandbox.

A task is a repository snapshot (``{path: text}``), the issue text, and the pytest node ids that
must pass: fail-to-pass (fixed by a correct patch) and pass-to-pass (must keep passing).
``verify_repo_patch(task, patch)``:

1. applies the candidate unified diff to a fresh copy (``diff.apply_unified_diff``: path-safe;
   a patch that does not apply is the candidate's failure);
2. resets the task's test files, every ``conftest.py`` and the root pytest configuration files to
   their pristine versions (files the patch added there are removed), then applies the task's
   hidden ``test_patch`` (tests the candidate never saw, as SWE-bench does);
3. runs ``python -P -m pytest <ids> --junitxml=<random name>`` in the sandbox (``-P``: the repo
   cannot shadow ``pytest`` by adding a ``pytest.py``; addopts and plugins from config are off);
4. passes only if every required id appears as passed in that JUnit report. The exit status and
   anything printed ("PASSED") are ignored; a missing or unreadable report fails the candidate.

What this cannot stop: code under test runs inside the pytest process, so a patch can still
forge results in-process (monkeypatching ``_pytest``, rewriting the report at exit). Those need
source-level evidence, which is the behaviour monitor's job (``monitor.py`` rule
``tamper_test_harness``). Infrastructure errors (sandbox did not start, pytest not importable
in the sandbox) come back as ``status="infra_error"``: mask the sample, never score it 0.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import secrets
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.verify.diff import DiffError, apply_unified_diff, safe_path
from gagar_jax.verify.flags import MonitorFlag
from gagar_jax.verify.sandbox import (
    Limits,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    python_for_sandbox,
    run_sandboxed,
)

PROTECTED_CONFIG = ("pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
MAX_REPORT_BYTES = 16 << 20
DEFAULT_LIMITS = Limits(wall_s=120, cpu_s=120, memory_bytes=2 << 30, nproc=128)

# ``RepoTask`` and ``read_tree`` live in ``gagar_jax.envs.repo`` (next to the python_repo task
# family). The verifier reads a task only through the attributes ``task_id``, ``files``,
# ``test_files``, ``test_patch``, ``reference_patch`` and ``required_tests``; the old import path
# ``gagar_jax.verify.repo.RepoTask`` still resolves (lazily, see ``__getattr__`` below).
_MOVED = ("RepoTask", "read_tree")


def __getattr__(name: str):
    if name in _MOVED:
        from gagar_jax.envs import repo as _envs_repo

        return getattr(_envs_repo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_tree(root: str, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        full = os.path.join(root, *safe_path(rel).split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)


@dataclasses.dataclass(frozen=True)
class RepoVerification:
    """Verdict for one candidate patch.

    Attributes:
      status: passed | failed | timeout | resource_killed | infra_error.
      tests: outcome per required id: passed | failed | error | skipped | missing.
      patch_error: why the patch did not apply (then nothing ran), else None.
      reset_files: protected files the patch had changed and the verifier restored/removed.
      test_log: a short human/grader-readable log (outcomes, then the pytest output tail).
      sandbox: the sandbox result (None if nothing ran).
      flags: behaviour-monitor flags of the patch (and trajectory, if given); see ``cheat``.
    """

    status: str
    tests: dict[str, str]
    patch_error: str | None
    reset_files: tuple[str, ...]
    test_log: str
    sandbox: SandboxResult | None
    flags: tuple[MonitorFlag, ...] = ()

    @property
    def cheat(self) -> bool:
        """A confirmed monitor flag: the kernels turn this rollout's reward into 0."""
        return any(f.confirmed for f in self.flags)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def infra_error(self) -> bool:
        return self.status == "infra_error"


def _is_protected(path: str, task: Any) -> bool:
    return (
        path in task.test_files
        or posixpath.basename(path) == "conftest.py"
        or path in PROTECTED_CONFIG
    )


def prepare_tree(task: Any, patch: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """Patched tree with protected files reset and the hidden tests applied.

    Returns (files, reset paths). Raises DiffError if the candidate patch does not apply; a
    ``test_patch`` that does not apply is a task bug and raises ValueError.
    """
    patched = apply_unified_diff(task.files, patch) if patch.strip() else dict(task.files)
    reset = []
    for path in sorted(set(patched) | set(task.files)):
        if not _is_protected(path, task):
            continue
        if task.files.get(path) != patched.get(path):
            reset.append(path)
            if path in task.files:
                patched[path] = task.files[path]
            else:
                del patched[path]
    if task.test_patch.strip():
        try:
            patched = apply_unified_diff(patched, task.test_patch)
        except DiffError as e:
            raise ValueError(f"task {task.task_id}: test_patch does not apply: {e}") from e
    return patched, tuple(reset)


def _node_id(case: ET.Element) -> str | None:
    """pytest node id of a JUnit (xunit1) testcase: file + class path + name."""
    file, classname, name = case.get("file"), case.get("classname", ""), case.get("name")
    if not file or name is None:
        return None
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    parts = [file]
    if classname.startswith(module + "."):
        parts += classname[len(module) + 1 :].split(".")
    return "::".join(parts + [name])


def parse_junit(xml_bytes: bytes) -> dict[str, str]:
    """``{node id: passed|failed|error|skipped}``; a repeated id keeps its worst outcome."""
    root = ET.fromstring(xml_bytes)
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        nid = _node_id(case)
        if nid is None:
            continue
        tags = {child.tag for child in case}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")  # fmt: skip
        if rank[outcome] >= rank[out.get(nid, "passed")]:
            out[nid] = outcome
    return out


def _read_report(path: str) -> bytes | None:
    """The report written by the sandboxed run, refusing symlinks, links and oversized files."""
    try:
        # O_NONBLOCK: the sandboxed code may have swapped the report for a FIFO (a blocking open
        # would hang the verifier); regular files ignore the flag.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > MAX_REPORT_BYTES:
            return None
        return f.read(MAX_REPORT_BYTES)


def _special_files(directory: str, names: list[str]) -> list[str]:
    out = []
    for n in names:
        st = os.lstat(os.path.join(directory, n))
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            out.append(n)
    return out


def pytest_argv(test_ids: Sequence[str], report_name: str) -> list[str]:
    exe, _ = python_for_sandbox()
    return [
        exe, "-P", "-m", "pytest", "-q", "-rA", "--rootdir=.", "-p", "no:cacheprovider",
        "-o", "addopts=", "-o", "pythonpath=.", "-o", "junit_family=xunit1",
        "-o", "console_output_style=classic", f"--junitxml={report_name}", "--", *test_ids,
    ]  # fmt: skip


_PREFLIGHT: dict[tuple, str | None] = {}


def sandbox_pytest_problem(config: SandboxConfig | None = None) -> str | None:
    """None if the sandboxed interpreter can import pytest, else why (checked once)."""
    key = (config,)
    if key not in _PREFLIGHT:
        exe, pythonpath = python_for_sandbox()
        with tempfile.TemporaryDirectory(prefix="gagar_preflight_") as d:
            r = run_sandboxed([exe, "-P", "-c", "import pytest"], d, Limits(wall_s=60),
                              config=config, env={"PYTHONPATH": ":".join(pythonpath)},
                              ro_paths=pythonpath)  # fmt: skip
        _PREFLIGHT[key] = None if r.passed else (
            f"pytest is not importable in the sandbox ({exe}, PYTHONPATH={pythonpath}): "
            f"{r.status} {r.error or r.stderr.strip()[-300:]}"
        )
    return _PREFLIGHT[key]


def verify_repo_patch(
    task: Any,
    patch: str,
    *,
    limits: Limits = DEFAULT_LIMITS,
    config: SandboxConfig | None = None,
    keep_dir: str | None = None,
    events: Sequence[Any] = (),
    references: Mapping[str, str] | None = None,
    run_monitor: bool = True,
    extra_pythonpath: Sequence[str] = (),
) -> RepoVerification:
    """Verifies one candidate patch of ``task`` in the sandbox (see the module docstring).

    Args:
      task: the task (a ``gagar_jax.envs.repo.RepoTask``).
      patch: the candidate's unified diff (empty string: run the pristine repository).
      limits, config: sandbox settings.
      keep_dir: if given, the work tree is copied there after the run (debugging).
      events: the rollout's trajectory events, for the monitor's trajectory rules.
      references: reference/leaked solutions for the leakage pre-screen (the task's
        ``reference_patch`` is always included).
      run_monitor: run the behaviour monitor (``flags``; confirmed ones set ``cheat``).
      extra_pythonpath: more read-only directories for the sandboxed interpreter's PYTHONPATH
        (the task's dependencies), after the one holding pytest.

    Never raises for a bad patch (it fails). A bug of the verifier or of the task itself (e.g. a
    ``test_patch`` that does not apply) comes back as ``infra_error``: masked, not scored.
    """
    try:
        return _verify_repo_patch(task, patch, limits, config, keep_dir, events, references,
                                  run_monitor, tuple(extra_pythonpath))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a verifier/task bug must be masked, never scored
        return RepoVerification("infra_error", {t: "missing" for t in task.required_tests}, None,
                                (), f"verifier error: {type(e).__name__}: {e}", None)  # fmt: skip


def _verify_repo_patch(task, patch, limits, config, keep_dir, events, references, run_monitor,
                       extra_pythonpath):  # fmt: skip
    flags: tuple[MonitorFlag, ...] = ()
    if run_monitor:
        from gagar_jax.verify.monitor import context_for_repo_task, monitor

        flags = tuple(monitor(patch, events, context_for_repo_task(task, references)))
    try:
        files, reset = prepare_tree(task, patch)
    except DiffError as e:
        return RepoVerification("failed", {t: "missing" for t in task.required_tests}, str(e), (),
                                f"patch does not apply: {e}", None, flags)  # fmt: skip
    try:
        problem = sandbox_pytest_problem(config)
    except SandboxUnavailable as e:
        problem = f"no sandbox: {e}"
    if problem:
        return RepoVerification("infra_error", {t: "missing" for t in task.required_tests}, None,
                                reset, problem, None, flags)  # fmt: skip
    _, pythonpath = python_for_sandbox()
    pythonpath = tuple(pythonpath) + extra_pythonpath
    work_parent = tempfile.mkdtemp(prefix="gagar_repo_")
    os.chmod(work_parent, 0o711)  # the sandbox uid must traverse it (mkdtemp makes 0700)
    try:
        work = os.path.join(work_parent, "repo")
        os.mkdir(work)
        write_tree(work, files)
        report_name = f".gagar-junit-{secrets.token_hex(8)}.xml"
        env = {"PYTHONPATH": ":".join(pythonpath), "PYTHONNOUSERSITE": "1",
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
        result = run_sandboxed(pytest_argv(task.required_tests, report_name), work, limits,
                               config=config, env=env, ro_paths=pythonpath)  # fmt: skip
        report = _read_report(os.path.join(work, report_name))
        if keep_dir:  # regular files and directories only (no FIFOs/devices the code made)
            shutil.copytree(work, keep_dir, symlinks=True, dirs_exist_ok=True,
                            ignore=_special_files)  # fmt: skip
    finally:
        shutil.rmtree(work_parent, ignore_errors=True)

    outcomes: dict[str, str] = {}
    report_note = ""
    if report is not None:
        try:
            outcomes = parse_junit(report)
        except ET.ParseError as e:
            report_note = f"JUnit report unreadable: {e}"
    else:
        report_note = "no JUnit report was written"
    tests = {t: outcomes.get(t, "missing") for t in task.required_tests}
    all_passed = all(v == "passed" for v in tests.values())

    if result.status in ("infra_error", "timeout", "resource_killed"):
        status = result.status
    elif report is None or report_note:
        status = "failed"
    else:
        status = "passed" if all_passed else "failed"

    lines = [f"status: {status} (sandbox: {result.status}, {result.mechanism})"]
    if result.error:
        lines.append(f"sandbox error: {result.error}")
    if report_note:
        lines.append(report_note)
    if reset:
        lines.append("reset to pristine: " + ", ".join(reset))
    lines += [f"{v.upper():8s} {t}" for t, v in tests.items()]
    lines.append("--- pytest output (untrusted) ---")
    lines.append(result.stdout[-4000:])
    if result.stderr.strip():
        lines.append("--- stderr (untrusted) ---")
        lines.append(result.stderr[-2000:])
    if flags:
        lines.insert(1, "monitor: " + "; ".join(
            f"{f.rule}{'' if f.confirmed else '?'} @ {f.evidence}" for f in flags))  # fmt: skip
    return RepoVerification(status, tests, None, reset, "\n".join(lines), result, flags)
