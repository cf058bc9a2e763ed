"""SWE-bench-format tasks: import, grading and validation.

**Rows.** :func:`load_instances` reads SWE-bench-format rows from JSONL, JSON (a list of rows) or
parquet, with the fields ``instance_id, repo, base_commit, patch, test_patch,
problem_statement, hints_text, created_at, version, FAIL_TO_PASS, PASS_TO_PASS,
environment_setup_commit`` (``FAIL_TO_PASS``/``PASS_TO_PASS`` as JSON-encoded strings or lists)
plus the optional ``test_cmd``, ``python_deps`` (requirement strings for the environment),
``pre_install`` (a list of setup commands) and ``install``, run as SWE-bench's harness runs them
(``gagar_jax.data.swe_setup``). A row with an empty ``FAIL_TO_PASS`` is refused
(:class:`EmptyFailToPass`); any other bad field raises :class:`InstanceError` naming the row
and the field. SWE-smith rows (no ``base_commit``, an ``image_name``; the bug on the branch
``instance_id`` of the mirror repository, ``patch`` the bug) are read too
(:func:`swesmith_row`).

**Repositories.** ``repos_dir`` holds, per ``repo`` ``owner/name``, ``owner__name/``,
``owner__name.git/`` or ``owner__name.bundle``; :func:`to_repo_task` materialises the tree of
``base_commit`` (``gagar_jax.data.repos.snapshot``, cached per commit, no history) and, with
``build_envs``, the environment of the row's requirements (``repos.build_env``: uv,
content-addressed, reused), and returns a ``RepoTask`` whose hidden tests are ``test_patch``.
Importing this module registers :func:`load_tasks` and :func:`row_task` with the ``python_repo``
family (``gagar_jax.envs.repo.register_swe_reader``), which reads ``task.repos_dir`` pools
through them: the family sits below the task data and imports none of it.

**Grading** (swebench 5.0): :func:`grade` over a per-test status map: a fail-to-pass test
resolves only when passed (or xfail); a skipped one fails; a pass-to-pass test is kept when
passed, xfail or skipped; a test absent from the map fails. The verifier
(``verify.verify_repo_patch``) applies the same rule to the outcomes of its trusted plugin, and a
run with no report, or whose exit status contradicts the report, is never a pass.
:func:`parse_log_pytest` reads a pytest ``-rA`` log as swebench's parser of that name does.

**Validation.** ``python -m gagar_jax.data.swe validate --instances FILE --repos DIR [--runs 3]
[--out report.jsonl]`` runs every row's gold and empty patch ``--runs`` times in the sandbox and
writes one JSON line per instance ``{"instance_id", "gold", "empty", "flaky_tests",
"infra_errors", "env_hash", "seconds"}`` (a status is the runs' common status, ``"flaky"`` when
they differ), then a summary line; it exits 0 when every row was validated, whatever the
statuses, and 1 when a row could not be (its line carries ``"error"``; so does a row none of
whose gold or empty runs gave a verdict, every one an infrastructure error). The runs of all rows
share one pool of ``--workers`` sandboxed runs (default: one per core), so the next rows are
prepared while earlier ones run and no core idles behind one slow run. With ``--execution ray
[--ray-address auto|local|ADDR]`` each (row, patch, run) is one call of the execution back-end
(``gagar_jax.verify.execution``) on a Ray cluster, at most ``--max-inflight`` at once; the lines
are the same, and a run the infrastructure failed on every attempt counts in ``infra_errors``.
``validate --harbor TASK_DIR...`` validates Harbor task directories instead (``data.harbor``:
the solution as gold, the reward of ``tests/test.sh`` in the task's container), with the same
lines; ``--environment container`` runs the rows' tests on the container back-end
(``verify.container``): a row's ``image_name`` when it has one (``to_repo_task(use_image=True)``),
else the back-end's base image.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gagar_jax.data import environments, harbor, repos, swe_setup
from gagar_jax.envs.repo import RepoTask, SweReader, register_swe_reader
from gagar_jax.verify import layout
from gagar_jax.verify.diff import DiffError, apply_unified_diff, touched_files, tree_patch
from gagar_jax.verify.repo import env_site_packages, verify_repo_patch

FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "hints_text",
    "created_at",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "environment_setup_commit",
)
REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "FAIL_TO_PASS",
)
OPTIONAL = ("test_cmd", "python_deps", "install", "pre_install")
STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL")
RESOLVED_FULL, RESOLVED_PARTIAL, RESOLVED_NO = "RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"
DEFAULT_TEST_TIMEOUT_S = 60.0


class InstanceError(ValueError):
    """A row that is not a valid SWE-bench-format instance (names the row and the field)."""


class EmptyFailToPass(InstanceError):
    """A row whose FAIL_TO_PASS is empty: nothing would tell a fix from no fix."""


@dataclasses.dataclass(frozen=True)
class SweInstance:
    """One SWE-bench-format row (``FAIL_TO_PASS``/``PASS_TO_PASS`` decoded to tuples)."""

    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    problem_statement: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...] = ()
    hints_text: str = ""
    created_at: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    test_cmd: str = ""
    python_deps: tuple[str, ...] = ()
    install: str = ""
    pre_install: tuple[str, ...] = ()
    layout: str = "swebench"
    image_name: str = ""  # a container image holding the repository at /testbed (SWE-smith's)

    def to_row(self) -> dict[str, Any]:
        """The row as SWE-bench stores it (test lists JSON-encoded)."""
        d = dataclasses.asdict(self)
        d["FAIL_TO_PASS"] = json.dumps(list(self.FAIL_TO_PASS))
        d["PASS_TO_PASS"] = json.dumps(list(self.PASS_TO_PASS))
        d["python_deps"] = list(self.python_deps)
        d["pre_install"] = list(self.pre_install)
        return d


def _tests(value: Any, field: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError as e:
            raise InstanceError(f"{where}: {field} is not a JSON list of test ids: {e}") from None
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise InstanceError(
            f"{where}: {field} must be a list of test id strings (or its JSON "
            f"encoding), got {type(value).__name__}"
        )
    return tuple(value)


def swesmith_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A SWE-smith row (``instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS, image_name,
    problem_statement``) in this module's terms: the bug lives on the branch named
    ``instance_id`` of the mirror ``repo`` (``swesmith/owner__name.<commit>``), one commit on
    top of the original; ``patch`` introduces the bug, so the fix is its reverse, computed at
    :func:`to_repo_task` from the branch and its parent."""
    out = dict(row)
    out.update(
        base_commit=str(row.get("instance_id", "")),
        test_patch="",
        layout="swesmith",
        environment_setup_commit=str(row.get("instance_id", "")),
    )
    return out


R2E_TESTS_DIR = "r2e_tests"  # where R2E-Gym's hidden tests live in the repository


def _json_field(row: Mapping[str, Any], key: str, where: str) -> Any:
    value = row.get(key)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise InstanceError(f"{where}: {key} is not valid JSON: {e}") from None
    if value is None:
        raise InstanceError(f"{where}: missing field {key!r}")
    return value


def _is_r2e_test_file(path: str) -> bool:
    parts = path.split("/")
    base = parts[-1]
    dirs = ("test", "tests", "Test", "Tests", R2E_TESTS_DIR)
    return (
        base.startswith("test_") or base.endswith("_test.py") or any(p in dirs for p in parts[:-1])
    )


def r2egym_row(row: Mapping[str, Any], where: str = "row") -> dict[str, Any]:
    """An R2E-Gym row in this module's terms.

    R2E-Gym's fields: ``repo_name`` (``aiohttp``), ``docker_image``, ``commit_hash`` (the fix
    commit), ``parsed_commit_content`` (JSON: ``old_commit_hash``, ``new_commit_hash``,
    ``commit_message``, ``commit_date`` and ``file_diffs``, each with its ``header.file.path``
    and the file's ``old_file_content``/``new_file_content``), ``execution_result_content``
    (JSON: the hidden test files ``test_file_names``/``test_file_codes`` and the test runs'
    output on both commits, ``old_commit_res_stdout``/``new_commit_res_stdout``),
    ``expected_output_json`` (JSON: ``{test: status}`` after the fix) and
    ``problem_statement``.

    The task starts from ``old_commit_hash``; ``patch`` is the commit's change to non-test
    files, ``test_patch`` its change to test files plus R2E-Gym's hidden tests (added under
    ``r2e_tests/`` unless their names hold a directory). ``FAIL_TO_PASS``: tests expected to
    pass after the fix that did not pass on the old commit (its ``-rA`` log read by
    :func:`parse_log_pytest`); ``PASS_TO_PASS``: those that passed on both. ``repo`` is
    ``r2e-gym/<repo_name>`` unless the row names an ``owner/name`` ``repo``.
    """
    name = row.get("repo_name")
    if not isinstance(name, str) or not re.fullmatch(r"[\w-][\w.-]*", name):
        raise InstanceError(f"{where}: repo_name must be a repository name, got {name!r}")
    commit = _json_field(row, "parsed_commit_content", where)
    if not isinstance(commit, Mapping) or not isinstance(commit.get("file_diffs"), list):
        raise InstanceError(
            f"{where}: parsed_commit_content must be an object with a file_diffs list"
        )
    old_sha = commit.get("old_commit_hash")
    if not isinstance(old_sha, str) or not old_sha:
        raise InstanceError(f"{where}: parsed_commit_content.old_commit_hash is missing")
    before: dict[str, dict[str, str]] = {"code": {}, "tests": {}}
    after: dict[str, dict[str, str]] = {"code": {}, "tests": {}}
    for i, fd in enumerate(commit["file_diffs"]):
        try:
            path = fd["header"]["file"]["path"]
            old, new = fd.get("old_file_content") or "", fd.get("new_file_content") or ""
        except (KeyError, TypeError):
            raise InstanceError(
                f"{where}: parsed_commit_content.file_diffs[{i}] has no header.file.path"
            ) from None
        if fd.get("is_binary_file"):
            continue
        kind = "tests" if _is_r2e_test_file(path) else "code"
        if old:
            before[kind][path] = old
        if new:
            after[kind][path] = new
    execution = (
        _json_field(row, "execution_result_content", where)
        if row.get("execution_result_content")
        else {}
    )
    names = execution.get("test_file_names") or []
    codes = execution.get("test_file_codes") or []
    if len(names) != len(codes):
        raise InstanceError(
            f"{where}: execution_result_content has {len(names)} "
            f"test_file_names but {len(codes)} test_file_codes"
        )
    for n, code in zip(names, codes, strict=True):
        after["tests"][n if "/" in n else f"{R2E_TESTS_DIR}/{n}"] = code
    expected = _json_field(row, "expected_output_json", where)
    if not isinstance(expected, Mapping):
        raise InstanceError(f"{where}: expected_output_json must be an object {{test: status}}")
    old_status = parse_log_pytest(execution.get("old_commit_res_stdout") or "")
    f2p, p2p = [], []
    for test, status in expected.items():
        test = test.split(" - ")[0]
        if status not in ("PASSED", "XFAIL"):
            continue  # a test that fails after the fix requires nothing
        if "::" not in test:
            raise InstanceError(
                f"{where}: expected_output_json key {test!r} is not a pytest node id 'file::name'"
            )
        (p2p if old_status.get(test) in ("PASSED", "XFAIL") else f2p).append(test)
    statement = str(row.get("problem_statement") or "")
    m = re.search(r"\[ISSUE\](.*?)(\[/ISSUE\]|$)", statement, re.S)
    if m:
        statement = m.group(1).strip()
    repo = row.get("repo")
    if not (isinstance(repo, str) and "/" in repo):
        repo = f"r2e-gym/{name}"
    new_sha = str(commit.get("new_commit_hash") or row.get("commit_hash") or "")
    return {
        "instance_id": str(row.get("instance_id") or f"{name}__{new_sha[:12] or old_sha[:12]}"),
        "repo": repo,
        "base_commit": old_sha,
        "patch": tree_patch(before["code"], after["code"]),
        "test_patch": tree_patch(before["tests"], after["tests"]),
        "problem_statement": statement,
        "hints_text": "",
        "created_at": str(commit.get("commit_date") or ""),
        "version": "",
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "environment_setup_commit": old_sha,
        "layout": "r2egym",
        **{k: row[k] for k in ("install", "pre_install", "test_cmd", "python_deps") if row.get(k)},
    }


def harbor_row(task_dir: str) -> dict[str, Any]:
    """The SWE-bench row of a Harbor task directory (``task.toml``, ``instruction.md``,
    ``environment/``, ``tests/``, ``solution/``), as Harbor's SWE-bench adapter writes it: the
    instance's record in ``tests/config.json``, the text the agent sees in ``instruction.md``
    (it replaces ``problem_statement``). The task's id is the record's ``instance_id`` (else the
    directory's name); ``task.toml``'s ``[verifier] timeout_sec`` and ``[metadata]`` are kept
    under ``harbor``. A directory without ``task.toml`` or ``tests/config.json`` raises
    :class:`InstanceError` naming the file."""
    import tomllib

    where = task_dir
    toml_path = os.path.join(task_dir, "task.toml")
    try:
        with open(toml_path, "rb") as f:
            meta = tomllib.load(f)
    except FileNotFoundError:
        raise InstanceError(f"{where}: no task.toml (not a Harbor task directory)") from None
    except tomllib.TOMLDecodeError as e:
        raise InstanceError(f"{toml_path}: not TOML: {e}") from None
    config_path = os.path.join(task_dir, "tests", "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        raise InstanceError(
            f"{where}: no tests/config.json: a Harbor task without a SWE-bench "
            "record cannot be read as a repository task"
        ) from None
    except ValueError as e:
        raise InstanceError(f"{config_path}: not JSON: {e}") from None
    if not isinstance(record, Mapping):
        raise InstanceError(f"{config_path}: expected an object (the SWE-bench record)")
    out = dict(record)
    try:
        with open(os.path.join(task_dir, "instruction.md"), encoding="utf-8") as f:
            out["problem_statement"] = f.read()
    except FileNotFoundError:
        pass
    out.setdefault("instance_id", os.path.basename(os.path.normpath(task_dir)))
    verifier = meta.get("verifier") if isinstance(meta.get("verifier"), Mapping) else {}
    out["harbor"] = {
        "timeout_sec": verifier.get("timeout_sec"),
        "metadata": dict(meta.get("metadata") or {}),
    }
    out["layout"] = "harbor"
    return out


def harbor_rows(root: str) -> list[dict[str, Any]]:
    """Rows of every Harbor task directory under ``root`` (``root`` itself or its
    subdirectories holding a ``task.toml``, sorted by name)."""
    if os.path.isfile(os.path.join(root, "task.toml")):
        return [harbor_row(root)]
    dirs = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "task.toml")))
    if not dirs:
        raise InstanceError(f"{root}: no Harbor task directory (a subdirectory with task.toml)")
    return [harbor_row(os.path.join(root, d)) for d in dirs]


def parse_instance(row: Mapping[str, Any], where: str = "row") -> SweInstance:
    """A validated :class:`SweInstance` from one row (see the module docstring)."""
    if not isinstance(row, Mapping):
        raise InstanceError(f"{where}: expected an object, got {type(row).__name__}")
    where = f"{where} ({row.get('instance_id', '?')})"
    if "base_commit" not in row and "image_name" in row:
        row = swesmith_row(row)
    elif "parsed_commit_content" in row and "base_commit" not in row:
        row = r2egym_row(row, where)
    for key in REQUIRED:
        if key not in row or row[key] is None:
            raise InstanceError(f"{where}: missing field {key!r}")
    for key in ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement"):
        if not isinstance(row[key], str):
            raise InstanceError(f"{where}: {key} must be a string, got {type(row[key]).__name__}")
    if not re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", row["repo"]):
        raise InstanceError(f"{where}: repo must be 'owner/name', got {row['repo']!r}")
    f2p = _tests(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where)
    if not f2p:
        raise EmptyFailToPass(
            f"{where}: FAIL_TO_PASS is empty (a task needs at least one test "
            "that the fix makes pass)"
        )
    p2p = _tests(row.get("PASS_TO_PASS"), "PASS_TO_PASS", where)
    deps = row.get("python_deps") or ()
    if isinstance(deps, str):
        deps = json.loads(deps) if deps.strip().startswith("[") else deps.split()
    if hasattr(deps, "tolist"):
        deps = deps.tolist()
    if not all(isinstance(d, str) for d in deps):
        raise InstanceError(f"{where}: python_deps must be a list of requirement strings")
    try:
        pre_install = tuple(swe_setup.commands(row.get("pre_install") or ()))
        install = " && ".join(swe_setup.commands((), row.get("install") or ""))
    except swe_setup.SetupError as e:
        raise InstanceError(f"{where}: {e}") from None
    text = {
        k: row.get(k) or ""
        for k in (
            "hints_text",
            "created_at",
            "version",
            "environment_setup_commit",
            "test_cmd",
            "image_name",
        )
    }
    return SweInstance(
        row["instance_id"],
        row["repo"],
        row["base_commit"],
        row["patch"],
        row["test_patch"],
        row["problem_statement"],
        f2p,
        p2p,
        python_deps=tuple(deps),
        install=install,
        pre_install=pre_install,
        layout=str(row.get("layout") or "swebench"),
        **{k: str(v) for k, v in text.items()},
    )


def read_rows(path: str) -> list[dict[str, Any]]:
    """The raw rows of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file, or of a
    directory of Harbor task directories (:func:`harbor_rows`)."""
    if os.path.isdir(path):
        return harbor_rows(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise InstanceError(f"{path}: a .json instances file must hold a list of rows")
            return data
        rows = []
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise InstanceError(f"{path}:{n}: not JSON: {e}") from None
        return rows


def load_instances(path: str) -> list[SweInstance]:
    """Validated instances of ``path`` (errors name the file and row)."""
    out, seen = [], set()
    for n, row in enumerate(read_rows(path), start=1):
        inst = parse_instance(row, f"{path}:{n}")
        if inst.instance_id in seen:
            raise InstanceError(f"{path}:{n}: duplicate instance_id {inst.instance_id!r}")
        seen.add(inst.instance_id)
        out.append(inst)
    return out


def write_instances(path: str, instances: Iterable[SweInstance]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for inst in instances:
            f.write(json.dumps(inst.to_row()) + "\n")


# ---------------------------------------------------------------------------------------------
# Logs and grading
# ---------------------------------------------------------------------------------------------
def parse_log_pytest(log: str) -> dict[str, str]:
    """``{test id: PASSED|FAILED|SKIPPED|ERROR|XFAIL}`` from the short test summary of a pytest
    ``-rA`` log, as swebench's ``parse_log_pytest`` reads it: every line that starts with a
    status word, ``FAILED`` lines with their `` - `` message separator dropped, the second word
    as the id (the last line of an id wins); ``SKIPPED [N] file:line`` counts are not tests."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        status = next((s for s in STATUSES if line.startswith(s)), None)
        if status is None:
            continue
        if line.startswith("FAILED"):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) < 2:
            continue
        if words[0] == "SKIPPED" and re.fullmatch(r"\[\d+\]", words[1]):
            continue
        out[words[1]] = words[0]
    return out


_VERIFIER_STATUS = {
    "passed": "PASSED",
    "failed": "FAILED",
    "error": "ERROR",
    "skipped": "SKIPPED",
    "xfail": "XFAIL",
}


def _status_key(case: str, sm: Mapping[str, str]) -> str | None:
    """The map's key for ``case``; an id cut inside its parameters (more ``[`` than ``]``)
    matches by prefix when all the matches agree on passing."""
    if case in sm:
        return case
    if case.count("[") > case.count("]"):
        keys = [k for k in sm if k.startswith(case)]
        if keys and len({sm[k] in ("PASSED", "XFAIL") for k in keys}) == 1:
            return keys[0]
    return None


def normalise_status_map(sm: Mapping[str, str]) -> dict[str, str]:
    """Upper-case swebench statuses from the verifier's (``passed`` ...; ``missing`` dropped)."""
    return {t: _VERIFIER_STATUS.get(s, s) for t, s in sm.items() if s != "missing"}


def grade(
    status_map: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
) -> dict[str, Any]:
    """swebench 5.0's report of one run: ``FAIL_TO_PASS``/``PASS_TO_PASS`` ``success`` and
    ``failure`` lists and ``resolved`` (RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO)."""
    sm = normalise_status_map(status_map)

    def passed(t):
        k = _status_key(t, sm)
        return k is not None and sm[k] in ("PASSED", "XFAIL")

    def kept(t):
        k = _status_key(t, sm)
        return passed(t) or (k is not None and sm[k] == "SKIPPED")

    f_ok = [t for t in fail_to_pass if passed(t)]
    f_bad = [t for t in fail_to_pass if not passed(t)]
    p_ok = [t for t in pass_to_pass if kept(t)]
    p_bad = [t for t in pass_to_pass if not kept(t)]
    f_rate = len(f_ok) / len(fail_to_pass) if fail_to_pass else 1.0
    p_rate = len(p_ok) / len(pass_to_pass) if pass_to_pass else 1.0
    if f_rate == 1 and p_rate == 1:
        resolved = RESOLVED_FULL
    elif 0 < f_rate < 1 and p_rate == 1:
        resolved = RESOLVED_PARTIAL
    else:
        resolved = RESOLVED_NO
    return {
        "FAIL_TO_PASS": {"success": f_ok, "failure": f_bad},
        "PASS_TO_PASS": {"success": p_ok, "failure": p_bad},
        "resolved": resolved,
    }


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------
SWEBENCH_PYTHON = "/opt/miniconda3/envs/testbed/bin/python"  # the conda env of the images
SWEBENCH_WORKDIR = "/testbed"


def swebench_image_name(
    instance_id: str, *, namespace: str = "", arch: str = "x86_64", tag: str = "latest"
) -> str:
    """The name of SWE-bench's evaluation image of ``instance_id``, as its harness names it:
    ``sweb.eval.<arch>.<instance_id>:<tag>`` in lower case; under a registry ``namespace``
    (``swebench``) with ``__`` spelled ``_1776_`` (registries refuse double underscores)."""
    key = f"sweb.eval.{arch}.{instance_id}:{tag}"
    if namespace:
        key = f"{namespace}/{key}".replace("__", "_1776_")
    return key.lower()


def to_repo_task(
    inst: SweInstance,
    repos_dir: str,
    *,
    cache_dir: str | None = None,
    build_envs: bool = True,
    test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
    use_image: bool = False,
) -> RepoTask:
    """The ``RepoTask`` of ``inst``: the tree of ``base_commit`` from ``repos_dir``, the hidden
    ``test_patch``, the gold ``patch`` as reference, the layout's ``pythonpath`` and (with
    ``build_envs``) the environment of ``python_deps`` or, without them, of the dependencies
    the repository declares. With ``use_image`` a row that names an ``image_name`` runs its
    tests in that image instead (the container back-end: the repository at ``/testbed``, the
    conda environment ``testbed``, as SWE-bench's and SWE-smith's images hold them)."""
    files = repos.snapshot_files(repos_dir, inst.repo, inst.base_commit, cache_dir)
    reference = inst.patch
    if inst.layout == "swesmith":
        reference = _swesmith_fix(inst, repos_dir, files, cache_dir)
    try:
        hidden = touched_files(inst.test_patch) if inst.test_patch.strip() else []
    except DiffError as e:
        raise InstanceError(f"{inst.instance_id}: test_patch does not parse: {e}") from e
    # the files of every named test are reset to pristine before a run: a candidate cannot
    # pass a pass-to-pass test by editing it
    named = {t.split("::", 1)[0] for t in inst.FAIL_TO_PASS + inst.PASS_TO_PASS}
    test_files = tuple(sorted(set(hidden) | {p for p in named if p in files}))
    env_path = env_hash = ""
    if use_image and inst.image_name:
        # the image holds the repository, installed, and its environment (SWE-bench's and
        # SWE-smith's layout): the tests run there, on the container back-end, unchanged
        return RepoTask(
            task_id=inst.instance_id,
            issue=inst.problem_statement,
            files=files,
            fail_to_pass=inst.FAIL_TO_PASS,
            pass_to_pass=inst.PASS_TO_PASS,
            test_files=test_files,
            test_patch=inst.test_patch,
            reference_patch=reference,
            pythonpath=repos.detect_pythonpath(files),
            test_timeout_s=test_timeout_s,
            image=inst.image_name,
            image_python=SWEBENCH_PYTHON,
            image_workdir=SWEBENCH_WORKDIR,
        )
    image = ""
    if build_envs:
        files, reqs, metadata, system = _install(inst, files, cache_dir, container=use_image)
        test_files = tuple(sorted({*test_files, *metadata}))
        try:
            env = repos.build_env(reqs, cache_dir=cache_dir)
        except repos.EnvBuildError as e:  # the task's, never a candidate's failure
            raise InstanceError(f"{inst.instance_id}: its environment: {e}") from e
        env_path, env_hash = env.path, env.env_hash
        if system:  # system packages: an image derived from the back-end's base image
            from gagar_jax.verify import container as ctr

            try:
                image = ctr.setup_image(ctr.DEFAULT_IMAGE, system)
            except (ctr.ContainerUnavailable, ValueError, OSError) as e:
                raise InstanceError(f"{inst.instance_id}: install: {e}") from e
    return RepoTask(
        task_id=inst.instance_id,
        issue=inst.problem_statement,
        files=files,
        fail_to_pass=inst.FAIL_TO_PASS,
        pass_to_pass=inst.PASS_TO_PASS,
        test_files=test_files,
        test_patch=inst.test_patch,
        reference_patch=reference,
        pythonpath=repos.detect_pythonpath(files),
        env_path=env_path,
        test_timeout_s=test_timeout_s,
        env_hash=env_hash,
        image=image,
    )


def _install(
    inst: SweInstance, files: dict[str, str], cache_dir: str | None, container: bool = False
) -> tuple[dict[str, str], list[str], tuple[str, ...], list[str]]:
    """(the tree with the row's setup done and the repository installed into it, the
    environment's requirements, the installed metadata files, the system commands left for
    the container image): the row's ``test_cmd`` checked to be a pytest run; its
    ``pre_install`` and ``install`` commands run as SWE-bench's harness runs them
    (``swe_setup``: tree edits and Python commands in the sandbox, the install of the tree
    through the build backend, packages into the requirements, system commands only in a
    container, ``container``), or an install of the tree inferred for a Python project
    (``environments.install_repository``); the requirements are the row's ``python_deps`` or,
    without them, every declaration of the tree (the build backend's metadata where only
    setup.py knows them), plus the packages the commands install. A row that cannot be set up
    is an ``InstanceError`` naming the command."""
    no_install = inst.install.strip() == environments.NO_INSTALL  # the factory's rows
    try:
        if inst.test_cmd.strip():
            environments.check_test_command(inst.test_cmd)
        steps = swe_setup.plan(
            swe_setup.commands(inst.pre_install, "" if no_install else inst.install)
        )
        if not container:
            swe_setup.require_no_system(steps)
        system = swe_setup.system_steps(steps)
        if any(s.kind == "shell" for s in steps):
            requires, _, _ = environments.build_system(files)
            benv = repos.build_env(list(requires), cache_dir=cache_dir)
            files = swe_setup.run_shell_steps(
                files,
                steps,
                site=env_site_packages(benv.path),
                cache_dir=cache_dir,
                key_extra=benv.env_hash,
            )
        extras = swe_setup.extras_of(steps)
        added = swe_setup.requirements_of(steps, files)
        gone = swe_setup.uninstalled(steps)
        install_tree = any(s.kind == "install" for s in steps) or (
            not no_install and not inst.install.strip() and environments.is_project(files)
        )
        if not install_tree:
            reqs = list(inst.python_deps) or layout.declared_requirements(files)
            return files, swe_setup.drop_uninstalled([*reqs, *added], gone), (), system
        installed = environments.install_repository(files, extras=extras, cache_dir=cache_dir)
    except (environments.InstallError, swe_setup.SetupError) as e:
        raise InstanceError(f"{inst.instance_id}: install: {e}") from e
    except (repos.EnvBuildError, ValueError) as e:
        raise InstanceError(f"{inst.instance_id}: install: the build environment: {e}") from e
    files = {**files, **installed.files}
    runtime = installed.requires if layout.needs_backend_metadata(files) else ()
    reqs = list(inst.python_deps) or layout.declared_requirements(
        files, extras=(*layout.TEST_EXTRAS, *extras), runtime=runtime
    )
    reqs = swe_setup.drop_uninstalled([*reqs, *added], gone)
    return files, list(dict.fromkeys(reqs)), installed.metadata_paths, system


def _swesmith_fix(
    inst: SweInstance, repos_dir: str, buggy: Mapping[str, str], cache_dir: str | None
) -> str:
    """The fix of a SWE-smith row: the bug branch's tree back to its parent's, checked against
    the row's bug patch."""
    parent = repos.snapshot_files(repos_dir, inst.repo, inst.base_commit + "^", cache_dir)
    try:
        paths = touched_files(inst.patch)
        again = apply_unified_diff(parent, inst.patch)
    except DiffError as e:
        raise InstanceError(
            f"{inst.instance_id}: the bug patch does not apply to the parent "
            f"of branch {inst.base_commit!r}: {e}"
        ) from e
    if any(again.get(p) != buggy.get(p) for p in paths):
        raise InstanceError(
            f"{inst.instance_id}: branch {inst.base_commit!r} is not its parent "
            "plus the row's bug patch"
        )
    return tree_patch(
        {p: buggy[p] for p in paths if p in buggy}, {p: parent[p] for p in paths if p in parent}
    )


def load_tasks(path: str, repos_dir: str, **kwargs) -> list[RepoTask]:
    """``RepoTask``s of every row of ``path`` (see :func:`to_repo_task`)."""
    return [to_repo_task(inst, repos_dir, **kwargs) for inst in load_instances(path)]


def row_task(row: Mapping[str, Any], where: str, repos_dir: str, **kwargs) -> RepoTask:
    """The ``RepoTask`` of one SWE-bench-format row (errors name ``where``; ``kwargs`` as
    :func:`to_repo_task`'s)."""
    return to_repo_task(parse_instance(row, where), repos_dir, **kwargs)


# The python_repo family reads SWE-bench-format pools (task.repos_dir) with these.
register_swe_reader(SweReader(load_tasks, row_task))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def default_workers() -> int:
    """Sandboxed runs at once: one per CPU core, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def _verify_job(task, patch: str, verify_kwargs: Mapping[str, Any], backend=None):
    """One sandboxed run of ``patch``: here (``backend`` None) or as one call of the execution
    back-end (``verify.execution.verify_repo_call``: a cluster's deadlines, retries and node
    environments; a call that failed for the infrastructure comes back as ``infra_error``)."""
    if backend is None:
        return verify_repo_patch(task, patch, run_monitor=False, **verify_kwargs)
    from gagar_jax.verify import execution

    return execution.verify_repo_call(
        task, patch, backend=backend, run_monitor=False, **verify_kwargs
    )


def _runs_at_once(backend, workers: int | None) -> int:
    """Sandboxed runs in flight at once: ``workers`` (default :func:`default_workers`) here or
    on a local back-end, the back-end's ``max_inflight`` on a cluster."""
    if backend is not None and backend.name != "local":
        return max(1, int(getattr(backend, "max_inflight", 1)))
    return max(1, workers or default_workers())


def summarise_runs(task, results: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The report line (without timing) of ``results``: ``(kind, RepoVerification)`` pairs,
    kind ``"gold"`` or ``"empty"``. A kind's status is its runs' common status, ``"flaky"``
    when they differ; a test is flaky when its outcome differs between runs of one kind.
    A run that ended in an infrastructure error says nothing of the patch: it is counted in
    ``infra_errors`` and left out of the statuses and the tests (a kind none of whose runs
    gave a verdict has status None)."""
    out: dict[str, Any] = {"instance_id": task.task_id}
    flaky: set[str] = set()
    infra = 0
    for kind in ("gold", "empty"):
        statuses, seen = [], {}
        for v in (v for k, v in results if k == kind):
            if v.status == "infra_error":
                infra += 1
                continue
            statuses.append(v.status)
            for t, o in v.tests.items():
                seen.setdefault(t, set()).add(o)
        flaky |= {t for t, os_ in seen.items() if len(os_) > 1}
        out[kind] = (statuses[0] if len(set(statuses)) == 1 else "flaky") if statuses else None
    out.update(flaky_tests=sorted(flaky), infra_errors=infra, env_hash=task.env_hash)
    return out


def _jobs(task, runs: int) -> list[tuple[str, str]]:
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    # gold and empty interleaved: a row's runs of each kind spread over the pool's workers
    return [job for _ in range(runs) for job in (("gold", task.reference_patch), ("empty", ""))]


def validate_task(
    task, runs: int = 3, *, workers: int = 1, backend=None, **verify_kwargs
) -> dict[str, Any]:
    """Runs the gold and the empty patch ``runs`` times (``workers`` sandboxed runs at once);
    the report line (without timing). ``backend``: an execution back-end
    (``verify.execution.Backend``) whose calls run them, each (patch, run) one call, as many at
    once as it allows (its ``max_inflight`` on a cluster); None runs them here."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = _jobs(task, runs)
    n = _runs_at_once(backend, workers) if backend is not None else max(1, workers)
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(
            pool.map(lambda j: (j[0], _verify_job(task, j[1], verify_kwargs, backend)), jobs)
        )
    return summarise_runs(task, results)


def validate(
    instances_path: str,
    repos_dir: str,
    *,
    runs: int = 3,
    out_path: str | None = None,
    cache_dir: str | None = None,
    log=print,
    emit=None,
    workers: int | None = None,
    backend=None,
) -> tuple[list[dict], bool]:
    """Validates every row; returns (report lines, every row validated). ``emit`` gets each
    line as it is made (in the rows' order); ``log`` the summary.

    All sandboxed runs of all rows go through one pool of ``workers`` threads (default
    :func:`default_workers`): while the runs of earlier rows execute, the next rows' trees
    and environments are prepared, and a slow run of one row overlaps with the runs of others.
    A line's ``seconds`` is the time from its row's preparation to its last run's end (the
    runs of several rows overlap, so the lines' seconds add up to more than the wall time).

    ``backend`` (a ``verify.execution.Backend``, e.g. a ``RayBackend``): every (row, patch,
    run) is one call of it (``verify_repo_call``), at most its ``max_inflight`` at once on a
    cluster (``workers`` is then ignored); a call that failed for the infrastructure on every
    attempt counts in the row's ``infra_errors``. None (the default) runs them here."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    t_all = time.monotonic()
    lines, ok = [], True
    insts = load_instances(instances_path)
    workers = _runs_at_once(backend, workers)
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    sink = open(out_path, "w", encoding="utf-8") if out_path else None  # noqa: SIM115
    # rows whose runs are queued or running; a bound keeps the prepared trees in memory few
    pending: collections.deque = collections.deque()
    max_pending = 2 * workers + 1
    if backend is not None and backend.name != "local":  # enough rows to fill the cluster
        max_pending = 2 * -(-workers // (2 * runs)) + 1

    def finish(entry) -> None:
        nonlocal ok
        inst, t0, task, futures, error = entry
        if error is None:
            try:
                results = [(kind, f.result()) for kind, f in futures]
                rec = summarise_runs(task, results)
            except Exception as e:  # noqa: BLE001 - reported on the row's line
                error = e
            else:
                lost = [k for k in ("gold", "empty") if rec[k] is None]
                if lost:  # every run of a kind was the infrastructure's failure: no verdict
                    ok = False
                    rec["error"] = (
                        f"no verdict for {' and '.join(lost)}: all {len(results) // 2} runs "
                        "ended in an infrastructure error"
                    )
        if error is not None:
            ok = False
            rec = {
                "instance_id": inst.instance_id,
                "gold": None,
                "empty": None,
                "flaky_tests": [],
                "infra_errors": 0,
                "env_hash": "",
                "error": f"{type(error).__name__}: {error}",
            }
        rec["seconds"] = round(time.monotonic() - t0, 3)
        lines.append(rec)
        if emit:
            emit(rec)
        if sink:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for inst in insts:
                while len(pending) >= max_pending:
                    finish(pending.popleft())
                t0 = time.monotonic()
                try:
                    task = to_repo_task(
                        inst,
                        repos_dir,
                        cache_dir=cache_dir,
                        use_image=getattr(backend, "environment", "uv") == "container",
                    )
                    futures = [
                        (kind, pool.submit(_verify_job, task, patch, {}, backend))
                        for kind, patch in _jobs(task, runs)
                    ]
                    pending.append((inst, t0, task, futures, None))
                except Exception as e:  # noqa: BLE001 - one bad row is reported, the rest go on
                    pending.append((inst, t0, None, [], e))
            while pending:
                finish(pending.popleft())
    finally:
        if sink:
            sink.close()
    n = len(lines)
    where = f" on the {backend.name} back-end" if backend is not None else ""
    good = sum(
        1
        for r in lines
        if r["gold"] == "passed" and r["empty"] == "failed" and not r["flaky_tests"]
    )
    log(
        f"validated {sum('error' not in r for r in lines)}/{n} instances in "
        f"{time.monotonic() - t_all:.1f}s ({workers} runs at once{where}): {good} sound "
        f"(gold passed, empty failed, not flaky), "
        f"{sum(bool(r['flaky_tests']) for r in lines)} flaky, "
        f"{sum(r['infra_errors'] for r in lines)} infra errors, "
        f"{sum('error' in r for r in lines)} not validated"
    )
    return lines, ok


def validate_harbor(
    paths: Sequence[str], *, runs: int = 3, out_path: str | None = None, log=print
) -> tuple[list[dict], bool]:
    """``validate`` for Harbor task directories (``data.harbor.to_repo_task``): each task's
    solution (gold) and the empty patch ``runs`` times on the container back-end; one line per
    task (printed, and written to ``out_path``), then the summary. Returns (lines, every task
    validated)."""
    lines, ok = [], True
    for path in paths:
        t0 = time.monotonic()
        try:
            task = harbor.to_repo_task(path)
            rec = validate_task(task, runs)
        except Exception as e:  # noqa: BLE001 - reported on the task's line
            ok = False
            rec = {"instance_id": os.path.basename(os.path.normpath(path)), "gold": None,
                   "empty": None, "flaky_tests": [], "infra_errors": 0, "env_hash": "",
                   "error": f"{type(e).__name__}: {e}"}  # fmt: skip
        rec["seconds"] = round(time.monotonic() - t0, 3)
        lines.append(rec)
        log(json.dumps(rec))
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in lines)
    good = sum(1 for r in lines if r["gold"] == "passed" and r["empty"] == "failed")
    log(
        f"validated {sum('error' not in r for r in lines)}/{len(lines)} Harbor tasks: {good} "
        f"sound (gold passed, empty failed), {sum(r['infra_errors'] for r in lines)} infra errors"
    )
    return lines, ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.data.swe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="run each instance's gold and empty patch in the sandbox")
    v.add_argument("--instances", help="SWE-bench-format rows (.jsonl/.json/.parquet)")
    v.add_argument("--repos", help="directory of owner__name repositories")
    v.add_argument(
        "--harbor",
        nargs="+",
        default=None,
        help="Harbor task directories to validate (instead of --instances/--repos)",
    )
    v.add_argument(
        "--environment",
        choices=("uv", "container"),
        default="uv",
        help="where the tests run: uv (the bwrap sandbox, the row's environment) or container",
    )
    v.add_argument("--runs", type=int, default=3)
    v.add_argument("--out", default=None, help="report JSONL (one line per instance)")
    v.add_argument("--cache", default=None, help="snapshot/environment cache directory")
    v.add_argument(
        "--workers",
        type=int,
        default=None,
        help="sandboxed runs at once on the local back-end (default: one per core, at most 4)",
    )
    v.add_argument(
        "--execution",
        choices=("local", "ray"),
        default="local",
        help="where the runs go: local (threads of this process) or ray (one Ray task each, "
        "with the execution back-end's deadlines and retries)",
    )
    v.add_argument(
        "--ray-address",
        default="auto",
        help="with --execution ray: 'auto' (the cluster this machine belongs to), 'local' (a "
        "one-machine cluster started here) or a cluster address (default: auto)",
    )
    v.add_argument(
        "--max-inflight",
        type=int,
        default=64,
        help="with --execution ray: calls on the cluster at once (default: 64)",
    )
    v.add_argument(
        "--resources",
        default="{}",
        help="with --execution ray: custom resources each run reserves, as JSON, e.g. "
        "'{\"verifier\": 1}' (only nodes that advertise them take the runs)",
    )
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if args.harbor:
        return 0 if validate_harbor(args.harbor, runs=args.runs, out_path=args.out)[1] else 1
    if not (args.instances and args.repos):
        ap.error("give --instances and --repos (or --harbor TASK_DIR...)")
    if args.max_inflight < 1:
        ap.error("--max-inflight must be >= 1")
    try:
        resources = json.loads(args.resources)
        if not isinstance(resources, dict):
            raise ValueError("not an object")
    except ValueError as e:
        ap.error(
            f'--resources must be a JSON object of name -> amount, e.g. {{"verifier": 1}}: {e}'
        )
    emit = None if args.out else (lambda rec: print(json.dumps(rec), flush=True))
    backend = None
    if args.execution == "ray" or args.environment != "uv":
        from gagar_jax.verify import execution

        backend = execution.make_backend(
            args.execution,
            ray_address=args.ray_address,
            max_inflight=args.max_inflight,
            resources=resources,
            environment=args.environment,
        )
    try:
        _, ok = validate(
            args.instances,
            args.repos,
            runs=args.runs,
            out_path=args.out,
            cache_dir=args.cache,
            emit=emit,
            workers=args.workers,
            backend=backend,
        )
    finally:
        if backend is not None:
            backend.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
