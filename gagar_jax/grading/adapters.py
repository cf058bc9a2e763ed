"""Adapters from task families to grading workspaces, and family-specific targeted checks.

Graders work on the generic ``Candidate``/``GroupWorkspace``; each family adapts to them here.

Toy code-repair family (``gagar_jax.envs``): a rollout's line-edit patch (``N : stmt``,
``ins N : stmt``, ``del N``) is rendered as a unified diff of ``program.toy`` (the raw program,
one statement per line, so diff line numbers are the prompt's line numbers); the verifier's test
log, monitor flags and five quality features pass through (the heuristic grader blends the
features into its scores, citing the log). ``ToyCheckRunner`` is a real targeted check for the
agentic grader: it runs the candidate's patched program, the original and every other passing
candidate on the inputs named in the command (the interpreter is in-process and bounded).

Any repository: ``SandboxCheckRunner`` materialises the candidate's patched repository in a fresh
temporary directory and runs the command there under ``gagar_jax.verify.run_sandboxed`` (the
measured isolation chain), returning its status and output as the check log.

Python-repository tasks (``envs.repo.RepoTask``): ``repo_group`` verifies each candidate's unified
diff with ``verify.verify_repo_patch`` (sandboxed pytest, JUnit verdict, behaviour monitor) and
builds the workspace from the pristine files and the issue text.

The envs and verify packages are imported lazily, so grading works without them.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import tempfile
from collections.abc import Sequence
from typing import Any

from gagar_jax.grading import schema
from gagar_jax.grading.agentic import CheckResult
from gagar_jax.verify import diff

TOY_PROGRAM = "program.toy"
TOY_TESTS = "tests.toy"
MAX_CHECK_INPUTS = 16


def _source(lines: Sequence[str]) -> str:
    return "".join(f"{ln}\n" for ln in lines)


def toy_candidate(
    task: Any,
    candidate_id: str,
    patch_text: str,
    verification: Any,
    *,
    trajectory: Sequence[Any] = (),
    summary: str = "",
) -> schema.Candidate:
    """A toy rollout as a grading ``Candidate``.

    Args:
      task: a ``gagar_jax.envs.ToyTask``.
      candidate_id: unique within the group.
      patch_text: the rollout's line-edit patch.
      verification: ``gagar_jax.envs.verify(task, patch_text)``.
      trajectory, summary: as in ``Candidate``; the raw line edits are appended to the summary.
    """
    from gagar_jax.envs import toy

    try:
        new = toy.apply_patch(task, patch_text)
        diff = "".join(
            difflib.unified_diff(
                _source(task.lines).splitlines(True),
                _source(new.splitlines()).splitlines(True),
                f"a/{TOY_PROGRAM}",
                f"b/{TOY_PROGRAM}",
            )
        )
    except toy.PatchError:
        diff = ""  # an unparseable patch fails verification; there is nothing to diff
    quality = {
        d: float(verification.quality[d]) for d in schema.DIMENSIONS if d in verification.quality
    }
    note = f"line edits:\n{patch_text}"
    return schema.Candidate(
        candidate_id=candidate_id,
        patch=diff,
        passed=bool(verification.passed) and not verification.infra_error,
        test_log=verification.test_log,
        trajectory=tuple(trajectory),
        summary=f"{summary}\n{note}" if summary else note,
        monitor_flags=tuple(verification.cheat_flags),
        quality=quality,
    )


def toy_workspace(
    task: Any, group_id: str, candidates: Sequence[schema.Candidate]
) -> schema.GroupWorkspace:
    """The group workspace of a toy task: ``program.toy`` (raw source) and ``tests.toy``."""
    return schema.GroupWorkspace(
        group_id=group_id,
        task_text=task.prompt,
        repo_files={TOY_PROGRAM: _source(task.lines), TOY_TESTS: task.repo_files[TOY_TESTS]},
        candidates=tuple(candidates),
        scope_files=(TOY_PROGRAM,),
    )


def toy_group(task: Any, group_id: str, patches: Sequence[str]) -> schema.GroupWorkspace:
    """Verifies each patch and builds the workspace (candidates ``r0``, ``r1``, ... in order)."""
    from gagar_jax.envs import toy

    cands = [toy_candidate(task, f"r{k}", p, toy.verify(task, p)) for k, p in enumerate(patches)]
    return toy_workspace(task, group_id, cands)


class ToyCheckRunner:
    """Runs toy programs on inputs named in the command (e.g. ``"f(25) f(-3)"`` or ``"25 -3"``).

    The log lists, per input, the candidate's output, the original program's, and each other
    passing candidate's (by anonymised position in the group, never by id).
    """

    def run(
        self, workspace: schema.GroupWorkspace, candidate: schema.Candidate, command: str
    ) -> CheckResult:
        from gagar_jax.envs import toy_lang as L

        xs = [int(v) for v in re.findall(r"-?\s*\d+", command.replace(" ", ""))][:MAX_CHECK_INPUTS]
        if not xs:
            return CheckResult("error", f"no integer inputs in {command!r}; try 'f(25) f(-3)'")

        def program_of(c: schema.Candidate):
            files = diff.apply_unified_diff(workspace.repo_files, c.parsed_patch)
            return L.parse_program(files[TOY_PROGRAM].splitlines())

        try:
            mine = program_of(candidate)
            original = L.parse_program(workspace.repo_files[TOY_PROGRAM].splitlines())
            others = [program_of(c) for c in workspace.passing if c is not candidate]
        except (L.ToyError, diff.DiffError, KeyError) as e:
            return CheckResult("error", f"cannot build the programs: {e}")
        lines = []
        for x in xs:
            row = f"f({x}) = {L.try_run(mine, x)}; original = {L.try_run(original, x)}"
            if others:
                row += "; other passing = " + ", ".join(str(L.try_run(p, x)) for p in others)
            lines.append(row)
        return CheckResult("passed", "\n".join(lines))


class SandboxCheckRunner:
    """Runs a check command in the candidate's patched repository, sandboxed (``gagar_jax.verify``).

    Args:
      limits: ``gagar_jax.verify.sandbox.Limits`` (default: 30 s wall, 30 CPU seconds).
      config: ``gagar_jax.verify.sandbox.SandboxConfig`` (default: strongest mechanism).
      ro_paths: host paths the command may read (e.g. the site-packages that holds pytest).
      python: interpreter substituted for a leading ``python``/``python3``; by default
        ``verify.sandbox.python_for_sandbox()`` (one the dropped uid can run), whose
        site-packages (pytest) is then exposed read-only on ``PYTHONPATH``.
    """

    def __init__(self, limits=None, config=None, ro_paths=(), python: str | None = None):
        from gagar_jax.verify import sandbox

        self.limits = limits or sandbox.Limits(wall_s=30.0, cpu_s=30)
        self.config = config
        extra: tuple[str, ...] = ()
        if python is None:
            python, extra = sandbox.python_for_sandbox()
        self.python = python
        self.ro_paths = tuple(ro_paths) + tuple(extra)
        self.env = {"PYTHONPATH": os.pathsep.join(extra)} if extra else None

    def run(
        self, workspace: schema.GroupWorkspace, candidate: schema.Candidate, command: str
    ) -> CheckResult:
        try:
            argv = shlex.split(command)
        except ValueError as e:
            return CheckResult("error", f"cannot parse command {command!r}: {e}")
        if not argv:
            return CheckResult("error", "empty command")
        if argv[0] in ("python", "python3"):
            argv[0] = self.python
        try:
            files = diff.apply_unified_diff(workspace.repo_files, candidate.parsed_patch)
        except diff.DiffError as e:
            return CheckResult("error", f"the patch does not apply to the snapshot: {e}")
        from gagar_jax.verify import execution

        # on the execution back-end (the trainer's process, or a node of the Ray cluster)
        call = execution.current().call(
            run_check_in_tree,
            files,
            argv,
            self.limits,
            self.config,
            self.env,
            self.ro_paths,
            deadline_s=self.limits.wall_s + execution.CALL_MARGIN_S,
            kind="check",
        )
        if not call.ok:
            return CheckResult("error", f"$ {command}\n{call.status}: {call.error}")
        res = call.value
        if isinstance(res, str):
            return CheckResult("error", res)
        head = f"$ {command}\nstatus: {res.status} (sandbox: {res.mechanism})\n"
        log = head + res.stdout + res.stderr
        if res.status == "infra_error":
            return CheckResult("error", f"{log}\nsandbox error: {res.error}")
        return CheckResult(res.status, log)


def run_check_in_tree(files, argv, limits, config=None, env=None, ro_paths=()):
    """Writes ``files`` to a fresh temporary directory and runs ``argv`` there in the sandbox
    (``verify.run_sandboxed``); the sandbox result, or a message when a path escapes."""
    from gagar_jax.verify import sandbox

    with tempfile.TemporaryDirectory(prefix="gagar-check-") as d:
        for path, text in files.items():
            full = os.path.normpath(os.path.join(d, path))
            if not full.startswith(d + os.sep):
                return f"path {path!r} escapes the repository"
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        return sandbox.run_sandboxed(argv, d, limits, config=config, env=env, ro_paths=ro_paths)


def repo_candidate(
    candidate_id: str,
    patch: str,
    verification: Any,
    *,
    trajectory: Sequence[Any] = (),
    summary: str = "",
) -> schema.Candidate:
    """A Python-repository rollout (``verify.verify_repo_patch`` result) as a grading ``Candidate``.

    An infrastructure error is not a pass (and should be masked by the caller, not graded).
    """
    return schema.Candidate(
        candidate_id=candidate_id,
        patch=patch,
        passed=bool(verification.passed),
        test_log=verification.test_log,
        trajectory=tuple(trajectory),
        summary=summary,
        monitor_flags=tuple(verification.flags) + log_flags(verification.test_log),
    )


def log_flags(test_log: str) -> tuple:
    """Monitor flags of what the candidate's code printed (the part of a verifier log after its
    header): text addressed to the grader, imitations of the verifier's header lines."""
    from gagar_jax.grading.untrusted import split_test_log
    from gagar_jax.verify.monitor import MonitorRefusal, monitor_log

    try:
        return tuple(monitor_log(split_test_log(test_log or "")[1], source="test output"))
    except MonitorRefusal:
        return ()  # the log is clipped by the verifier: a refusal here is not the candidate's


def repo_workspace(
    task: Any, group_id: str, candidates: Sequence[schema.Candidate]
) -> schema.GroupWorkspace:
    """The workspace of a ``envs.repo.RepoTask``: issue text and pristine files (scope inferred)."""
    return schema.GroupWorkspace(
        group_id=group_id,
        task_text=task.issue,
        repo_files=dict(task.files),
        candidates=tuple(candidates),
    )


def repo_group(task: Any, group_id: str, patches: Sequence[str], **verify_kwargs: Any):
    """Verifies each patch in the sandbox; builds the workspace (candidates ``r0``, ``r1``, ...)."""
    from gagar_jax.verify.repo import verify_repo_patch

    cands = [
        repo_candidate(f"r{k}", p, verify_repo_patch(task, p, **verify_kwargs))
        for k, p in enumerate(patches)
    ]
    return repo_workspace(task, group_id, cands)
