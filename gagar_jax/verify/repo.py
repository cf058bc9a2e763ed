"""Test verifier for Python repository tasks (SWE-bench style), run in the sandbox.

A task is a repository snapshot (``{path: text}``), the issue text, and the pytest node ids that
must pass: fail-to-pass (fixed by a correct patch) and pass-to-pass (must keep passing).
``verify_repo_patch(task, patch)``:

1. applies the candidate unified diff to a fresh copy (``diff.apply_unified_diff``: path-safe;
   a patch that does not apply is the candidate's failure);
2. resets to pristine the task's test files, every path its hidden ``test_patch`` touches,
   every ``conftest.py`` and every pytest configuration file (``CONFIG_NAMES``: pytest.toml,
   .pytest.toml, pytest.ini, .pytest.ini, pyproject.toml, tox.ini, setup.cfg) in any directory
   (files the patch added there are removed), then applies the hidden ``test_patch``; a tree
   that cannot be written (a file where a directory must be, a 300-byte name, an unencodable
   name) or that collides with the hidden tests is the candidate's failure (``DiffError``);
3. runs ``python -P -m pytest -c <pristine config> --rootdir=. -p no:cacheprovider
   -p _gagar_outcome_plugin <ids>`` in the sandbox with PYTEST_DISABLE_PLUGIN_AUTOLOAD (``-P``:
   the repo cannot shadow ``pytest``; ``-c``: no configuration file the candidate adds anywhere
   is read; addopts are off; ``pythonpath`` is the root plus the task's ``python_path``, e.g.
   ``src``; with ``test_timeout_s`` pytest-timeout bounds each test); the task's ``env_path``
   environment, when set, supplies pytest and the dependencies, read-only;
4. reads the outcomes from the trusted plugin (``outcome_plugin.py``) through a pipe only the
   verifier holds (no file the code could rewrite at exit): passes only if exactly one report
   line with this run's nonce arrived, every fail-to-pass id is passed in it and every
   pass-to-pass id passed or skipped (SWE-bench's rule), and pytest's recorded
   exit status, the process's exit status and the outcomes agree. A second line, a wrong nonce or
   a disagreeing exit status is tampering: ``failed`` plus a confirmed ``tamper_test_harness``
   flag. Anything printed ("PASSED") is ignored.

What this cannot stop: code under test runs inside the pytest process, so a patch can still
forge results in-process (monkeypatching ``_pytest`` or the plugin before it reports). Those
need source-level evidence, which is the behaviour monitor's job (``monitor.py`` rule
``tamper_test_harness``). Infrastructure errors before the candidate's code ran (sandbox did not
start, pytest not importable in the sandbox, a broken task) come back as ``status="infra_error"``:
mask the sample, never score it 0; after it started, every problem is the candidate's ``failed``.
"""

from __future__ import annotations

import configparser
import dataclasses
import functools
import json
import os
import posixpath
import secrets
import shutil
import stat
import tempfile
import threading
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.verify.diff import DiffError, apply_unified_diff, safe_path, touched_files
from gagar_jax.verify.flags import MonitorFlag
from gagar_jax.verify.sandbox import (
    Limits,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    python_for_sandbox,
    run_sandboxed,
)

# Every file name pytest reads configuration from, in its precedence order (pytest 9.2:
# _pytest/config/findpaths.py). A candidate's version of any of them, in any directory, is
# dropped; pytest is run with ``-c`` on the task's pristine one anyway.
CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                "tox.ini", "setup.cfg")  # fmt: skip
PROTECTED_CONFIG = CONFIG_NAMES
PLUGIN_MODULE = "_gagar_outcome_plugin"
MAX_REPORT_BYTES = 16 << 20
MAX_NAME_BYTES = 255  # NAME_MAX of Linux file systems
MAX_PATH_BYTES = 3000  # well below PATH_MAX (4096) once the workdir prefix is added
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


def check_tree(files: Mapping[str, str]) -> None:
    """Raises DiffError if ``files`` cannot be written as a tree: a path that is both a file and
    a directory (``pkg/mod.py`` and ``pkg/mod.py/x.py``), a name over 255 bytes, a path over
    MAX_PATH_BYTES, a name or text that is not valid UTF-8 (lone surrogates)."""
    dirs: set[str] = set()
    for rel, text in files.items():
        if not isinstance(rel, str) or not isinstance(text, str):
            raise DiffError(f"tree entry {rel!r}: path and text must be str")
        try:
            raw = rel.encode("utf-8")
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DiffError(f"{rel!r}: not encodable as UTF-8 ({e.reason})") from None
        if len(raw) > MAX_PATH_BYTES:
            raise DiffError(f"{rel[:60]!r}...: path of {len(raw)} bytes exceeds {MAX_PATH_BYTES}")
        parts = safe_path(rel).split("/")
        for part in parts:
            if len(part.encode("utf-8")) > MAX_NAME_BYTES:
                raise DiffError(f"{rel[:60]!r}: a name over {MAX_NAME_BYTES} bytes")
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    clash = sorted(dirs & set(files))
    if clash:
        raise DiffError(f"{clash[0]!r} is both a file and a directory in the patched tree")


def write_tree(root: str, files: Mapping[str, str]) -> None:
    """Writes ``files`` under ``root``; DiffError (the patch's fault) if the tree cannot exist."""
    check_tree(files)
    for rel, text in files.items():
        full = os.path.join(root, *safe_path(rel).split("/"))
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        except (OSError, UnicodeError) as e:
            raise DiffError(f"{rel[:80]!r}: cannot be written: {type(e).__name__}: {e}") from e


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


def hidden_test_paths(task: Any) -> frozenset[str]:
    """Paths the task's hidden ``test_patch`` touches (protected like the test files)."""
    if not task.test_patch.strip():
        return frozenset()
    try:
        return frozenset(touched_files(task.test_patch))
    except DiffError as e:
        raise ValueError(f"task {task.task_id}: test_patch does not parse: {e}") from e


def _is_protected(path: str, task: Any, hidden: frozenset[str] = frozenset()) -> bool:
    base = posixpath.basename(path)
    return (
        path in task.test_files or path in hidden or base == "conftest.py" or base in CONFIG_NAMES
    )


def prepare_tree(task: Any, patch: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """Patched tree with protected files reset and the hidden tests applied.

    Protected: the task's test files, every path its hidden ``test_patch`` touches, every
    ``conftest.py`` and every pytest configuration file (CONFIG_NAMES) in any directory.

    Returns (files, reset paths). Raises DiffError if the candidate patch does not apply or
    makes a tree that cannot be written or that the hidden tests collide with (the candidate's
    fault); a ``test_patch`` that does not apply to the pristine repository is a task bug and
    raises ValueError.
    """
    hidden = hidden_test_paths(task)
    patched = apply_unified_diff(task.files, patch) if patch.strip() else dict(task.files)
    reset = []
    for path in sorted(set(patched) | set(task.files)):
        if not _is_protected(path, task, hidden):
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
            try:
                apply_unified_diff(task.files, task.test_patch)
            except DiffError:
                raise ValueError(f"task {task.task_id}: test_patch does not apply: {e}") from e
            raise DiffError(f"the patch collides with the task's hidden tests: {e}") from e
    try:
        check_tree(patched)
    except DiffError as e:
        try:
            check_tree(task.files)
        except DiffError:
            raise ValueError(f"task {task.task_id}: its tree cannot be written: {e}") from e
        raise
    return patched, tuple(reset)


def _has_pytest_section(name: str, text: str) -> bool | None:
    """Whether ``name`` (a CONFIG_NAMES basename) holds pytest configuration, as pytest decides
    (None: a pyproject.toml without it, which pytest still uses as the rootdir fallback)."""
    if name in ("pytest.ini", ".pytest.ini"):
        return True  # always configuration, even empty
    try:
        if name.endswith(".toml"):
            data = tomllib.loads(text)
            if name == "pyproject.toml":
                tool = data.get("tool", {})
                return True if isinstance(tool, dict) and "pytest" in tool else None
            return "pytest" in data
        cp = configparser.ConfigParser(interpolation=None)
        cp.read_string(text)
    except (tomllib.TOMLDecodeError, configparser.Error, AttributeError, TypeError):
        return False
    return cp.has_section("tool:pytest" if name == "setup.cfg" else "pytest")


def pristine_config(task: Any) -> str | None:
    """The configuration file pytest would pick for the task's tests in the *pristine*
    repository (searching upward from each test file, in pytest's precedence order), or None.

    The sandboxed pytest gets it with ``-c``, so no file the candidate adds or moves (a
    ``pytest.toml`` next to the tests, a ``.pytest.ini`` at the root) can replace it.
    """
    fallback = None
    for tid in task.required_tests:
        parts = tid.split("::", 1)[0].split("/")[:-1]
        for depth in range(len(parts), -1, -1):
            base = "/".join(parts[:depth])
            for name in CONFIG_NAMES:
                path = f"{base}/{name}" if base else name
                if path not in task.files:
                    continue
                has = _has_pytest_section(name, task.files[path])
                if has:
                    return path
                if has is None and fallback is None:
                    fallback = path
    return fallback


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


def pytest_argv(test_ids: Sequence[str], config_file: str, *, python_path: Sequence[str] = (),
                timeout_s: float = 0.0) -> list[str]:  # fmt: skip
    """The sandboxed pytest command: the pristine ``config_file`` (``-c``), no cache, no plugin
    but the outcome reporter (PYTEST_DISABLE_PLUGIN_AUTOLOAD is set in its environment).

    ``python_path``: tree-relative directories put on ``sys.path`` after the root (pytest's
    ``pythonpath`` option); ``timeout_s`` > 0 loads pytest-timeout with that per-test limit."""
    exe, _ = python_for_sandbox()
    paths = " ".join((".", *python_path))
    timeout = (["-p", "pytest_timeout", "-o", f"timeout={timeout_s:g}"]
               if timeout_s > 0 else [])  # fmt: skip
    return [
        exe, "-P", "-m", "pytest", "-q", "-rA", "-c", config_file, "--rootdir=.",
        "-p", "no:cacheprovider", "-p", PLUGIN_MODULE, *timeout, "-o", "addopts=",
        "-o", f"pythonpath={paths}", "-o", "console_output_style=classic", "--", *test_ids,
    ]  # fmt: skip


def env_site_packages(env_path: str) -> tuple[str, ...]:
    """The site-packages directories of the virtual environment ``env_path`` (ValueError if it
    holds none: a broken task)."""
    lib = os.path.join(env_path, "lib")
    names = os.listdir(lib) if os.path.isdir(lib) else ()
    found = [os.path.join(lib, d, "site-packages") for d in sorted(names) if d.startswith("py")]
    found = [d for d in found if os.path.isdir(d)]
    if not found:
        raise ValueError(f"env_path {env_path!r} holds no lib/python*/site-packages")
    return tuple(found)


def sandbox_paths(task: Any, extra_pythonpath: Sequence[str] = ()) -> tuple[tuple[str, ...],
                                                                            tuple[str, ...]]:
    """(read-only host directories for PYTHONPATH, tree-relative ``sys.path`` entries) of a run.

    With the task's ``env_path`` its site-packages (which hold pytest) replace the verifier's
    own; absolute ``extra_pythonpath`` entries are bound read-only after them, relative ones
    (``"src"``) name directories of the tree, like the task's ``python_path``."""
    env_path = getattr(task, "env_path", "") or ""
    if env_path:
        base: tuple[str, ...] = env_site_packages(env_path)
    else:
        _, base = python_for_sandbox()
    ro, rel = [], list(getattr(task, "python_path", ()) or ())
    for p in extra_pythonpath:
        if os.path.isabs(p):
            ro.append(p)
        else:
            rel.append(safe_path(p))
    return (plugin_dir(), *base, *ro), tuple(dict.fromkeys(r for r in rel if r != "."))


@functools.cache
def plugin_dir() -> str:
    """A read-only directory (0755, world-readable) holding the outcome plugin module."""
    d = tempfile.mkdtemp(prefix="gagar_outcome_plugin_")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outcome_plugin.py")
    dst = os.path.join(d, PLUGIN_MODULE + ".py")
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o444)
    os.chmod(d, 0o555)
    return d


def _drain(fd: int, sink: list[bytes]) -> None:
    """Reads ``fd`` to EOF (or MAX_REPORT_BYTES + 1) into ``sink``; run on a thread."""
    total = 0
    try:
        while total <= MAX_REPORT_BYTES:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            sink.append(b)
            total += len(b)
    except OSError:
        pass


def parse_outcome_report(data: bytes, nonce: str) -> tuple[dict | None, int | None, str, bool]:
    """Reads what came through the outcome pipe.

    Returns (outcomes, pytest's exit status, problem, tampered): ``problem`` is "" for one
    well-formed report; ``tampered`` is True when more than the plugin's one line arrived or
    its nonce is wrong (someone else wrote to the pipe).
    """
    if not data:
        return None, None, "no test report was written (pytest did not finish its session)", False
    if len(data) > MAX_REPORT_BYTES:
        return None, None, f"test report over {MAX_REPORT_BYTES} bytes", True
    lines = data.split(b"\n")
    if len(lines) != 2 or lines[1]:
        return None, None, f"{len(lines) - 1} lines on the outcome pipe, expected one", True
    try:
        rec = json.loads(lines[0])
    except (ValueError, RecursionError) as e:
        return None, None, f"test report unreadable: {type(e).__name__}", True
    if not isinstance(rec, dict) or rec.get("nonce") != nonce:
        return None, None, "test report does not carry this run's nonce", True
    outcomes, exitstatus = rec.get("outcomes"), rec.get("exitstatus")
    if (not isinstance(outcomes, dict) or not isinstance(exitstatus, int)
            or not all(isinstance(v, str) for v in outcomes.values())):  # fmt: skip
        return None, None, "test report malformed", True
    return outcomes, exitstatus, "", False


_PREFLIGHT: dict[tuple, str | None] = {}


def sandbox_pytest_problem(config: SandboxConfig | None = None,
                           paths: Sequence[str] | None = None,
                           timeout: bool = False) -> str | None:  # fmt: skip
    """None if the sandboxed interpreter can import pytest and the outcome plugin (and
    pytest-timeout with ``timeout``) from ``paths`` (default: the verifier's own), else why
    (checked once per config, paths and timeout)."""
    exe, pythonpath = python_for_sandbox()
    paths = tuple(paths) if paths is not None else (plugin_dir(), *pythonpath)
    key = (config, paths, timeout)
    if key not in _PREFLIGHT:
        mods = f"pytest, {PLUGIN_MODULE}" + (", pytest_timeout" if timeout else "")
        with tempfile.TemporaryDirectory(prefix="gagar_preflight_") as d:
            os.chmod(d, 0o755)
            r = run_sandboxed([exe, "-P", "-c", f"import {mods}"], d,
                              Limits(wall_s=60), config=config,
                              env={"PYTHONPATH": ":".join(paths)}, ro_paths=paths)  # fmt: skip
        _PREFLIGHT[key] = (
            None
            if r.passed
            else (
                f"pytest is not importable in the sandbox ({exe}, PYTHONPATH={paths}): "
                f"{r.status} {r.error or r.stderr.strip()[-300:]}"
            )
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
      references: leaked solutions (ones the agent could read) for the leakage pre-screen; the
        task's own ``reference_patch`` is not one: a correct fix may well reproduce it.
      run_monitor: run the behaviour monitor (``flags``; confirmed ones set ``cheat``).
      extra_pythonpath: more directories for the sandboxed interpreter's path: absolute ones
        (the task's dependencies) are bound read-only after the one holding pytest; relative
        ones are directories of the repository (``"src"``), like the task's ``python_path``.

    Never raises for a bad patch (it fails). A bug of the verifier or of the task itself (e.g. a
    ``test_patch`` that does not apply) before the candidate's code ran comes back as
    ``infra_error``: masked, not scored. Anything that goes wrong once the sandboxed run has
    started is attributable to the code and comes back as ``failed``.
    """
    started: list[bool] = []  # set by _verify_repo_patch once the sandbox reached the code
    try:
        return _verify_repo_patch(task, patch, limits, config, keep_dir, events, references,
                                  run_monitor, tuple(extra_pythonpath), started)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a verifier/task bug must be masked, never scored
        status = "failed" if started else "infra_error"
        return RepoVerification(status, {t: "missing" for t in task.required_tests}, None,
                                (), f"verifier error: {type(e).__name__}: {e}", None)  # fmt: skip


def tests_resolved(tests: Mapping[str, str], fail_to_pass: Sequence[str],
                   pass_to_pass: Sequence[str]) -> bool:  # fmt: skip
    """SWE-bench's rule on the per-test outcomes: every fail-to-pass test passed (a skipped one
    fails), every pass-to-pass test passed or skipped (a skip is not a regression)."""
    f2p = set(fail_to_pass)
    return (all(tests.get(t) == "passed" for t in f2p)
            and all(tests.get(t) in ("passed", "skipped") for t in pass_to_pass
                    if t not in f2p))  # fmt: skip


def _missing(task: Any) -> dict[str, str]:
    return {t: "missing" for t in task.required_tests}


def _verify_repo_patch(task, patch, limits, config, keep_dir, events, references, run_monitor,
                       extra_pythonpath, started):  # fmt: skip
    flags: tuple[MonitorFlag, ...] = ()
    if run_monitor:
        from gagar_jax.verify.monitor import context_for_repo_task, monitor

        flags = tuple(monitor(patch, events, context_for_repo_task(task, references)))
    try:
        files, reset = prepare_tree(task, patch)
    except DiffError as e:
        return RepoVerification("failed", _missing(task), str(e), (),
                                f"patch does not apply: {e}", None, flags)  # fmt: skip
    timeout_s = float(getattr(task, "test_timeout_s", 0.0) or 0.0)
    try:
        pythonpath, tree_paths = sandbox_paths(task, extra_pythonpath)
        problem = sandbox_pytest_problem(config, pythonpath, timeout_s > 0)
    except SandboxUnavailable as e:
        problem = f"no sandbox: {e}"
    if problem:
        return RepoVerification("infra_error", _missing(task), None, reset, problem, None,
                                flags)  # fmt: skip
    cfg = pristine_config(task)
    work_parent = tempfile.mkdtemp(prefix="gagar_repo_")
    os.chmod(work_parent, 0o711)  # the sandbox uid must traverse it (mkdtemp makes 0700)
    out_r = out_w = nonce_r = -1
    try:
        work = os.path.join(work_parent, "repo")
        os.mkdir(work)
        try:
            write_tree(work, files)
        except DiffError as e:
            note = f"patched tree cannot be written: {e}"
            return RepoVerification("failed", _missing(task), str(e), reset, note, None, flags)
        if cfg is None:  # no configuration in the task: an empty one, so none is searched for
            cfg = f".gagar-pytest-{secrets.token_hex(8)}.ini"
            with open(os.path.join(work, cfg), "w") as f:
                f.write("[pytest]\n")
        nonce = secrets.token_hex(16)
        out_r, out_w = os.pipe()
        nonce_r, nonce_w = os.pipe()
        os.write(nonce_w, nonce.encode())
        os.close(nonce_w)
        sink: list[bytes] = []
        reader = threading.Thread(target=_drain, args=(out_r, sink), daemon=True)
        reader.start()
        env = {"PYTHONPATH": ":".join(pythonpath), "PYTHONNOUSERSITE": "1",
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "GAGAR_OUTCOME_FD": str(out_w),
               "GAGAR_NONCE_FD": str(nonce_r)}  # fmt: skip
        argv = pytest_argv(task.required_tests, cfg, python_path=tree_paths,
                           timeout_s=timeout_s)
        result = run_sandboxed(argv, work, limits,
                               config=config, env=env, ro_paths=pythonpath,
                               pass_fds=(out_w, nonce_r))  # fmt: skip
        if result.status != "infra_error":
            started.append(True)
        os.close(out_w)  # every other holder is dead: the reader sees EOF
        out_w = -1
        reader.join(timeout=10)
        data = b"".join(sink)
        if keep_dir:  # regular files and directories only (no FIFOs/devices the code made)
            shutil.copytree(work, keep_dir, symlinks=True, dirs_exist_ok=True,
                            ignore=_special_files)  # fmt: skip
    finally:
        for fd in (out_w, nonce_r):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(work_parent, ignore_errors=True)
    if out_r >= 0 and not reader.is_alive():
        os.close(out_r)

    outcomes, exitstatus, report_note, tampered = parse_outcome_report(data, nonce)
    tests = {t: (outcomes or {}).get(t, "missing") for t in task.required_tests}
    all_passed = tests_resolved(tests, task.fail_to_pass, task.pass_to_pass)
    rc = result.returncode
    if result.status not in ("infra_error", "timeout", "resource_killed") and not report_note:
        if exitstatus != rc:
            tampered = True
            report_note = (f"pytest recorded exit status {exitstatus} but the process exited "
                           f"{rc}: the exit status was forged")  # fmt: skip
    if tampered:
        flags = flags + (MonitorFlag("tamper_test_harness",
                                     f"test report: {report_note}", True),)  # fmt: skip

    if result.status in ("infra_error", "timeout", "resource_killed"):
        status = result.status
    elif report_note or tampered:
        status = "failed"
    else:
        status = "passed" if all_passed and exitstatus == 0 and rc == 0 else "failed"

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
