"""Targeted checks for the agentic grader: sandboxed on any repository, in-process on toy code.

``SandboxCheckRunner`` materialises the tree the verifier ran the candidate's tests on
(``GroupWorkspace.tree_of``: the prepared tree, or the snapshot with the applied patch; never
the patch text applied again) in a fresh temporary directory and runs the command there under
``gagar_jax.verify.run_sandboxed`` (the measured isolation chain), on the execution back-end,
returning its status and output as the check log.

``ToyCheckRunner`` runs a toy workspace's program (``TOY_PROGRAM``) as the candidate patched it,
the original and every other passing candidate's on the inputs named in the command, with the
toy interpreter (``gagar_jax.verify.toy_lang``: in-process and bounded, no sandbox needed).

Each task family builds its own workspaces and says which runner checks them
(``TaskFamily.check_runner``: ``gagar_jax.envs.toy_grading``, ``gagar_jax.envs.repo``); graders
see only the generic ``Candidate``/``GroupWorkspace``. Both runners live here, below the
families, because the grader-quality harness (``grading.eval``) checks the stored labelled sets
with them without importing any family.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import tempfile
from typing import Any

from gagar_jax.grading import schema
from gagar_jax.grading.agentic import CheckResult
from gagar_jax.verify import diff, execution, sandbox
from gagar_jax.verify import toy_lang as L

# The program file of a toy group workspace (``envs.toy_grading.toy_workspace`` writes it; the
# stored toy labelled set holds it): the raw program, one statement per line.
TOY_PROGRAM = "program.toy"
MAX_CHECK_INPUTS = 16


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
        self.limits = limits or sandbox.Limits(wall_s=30.0, cpu_s=30)
        self.config = config
        extra: tuple[str, ...] = ()
        if python is None:
            python, extra = sandbox.python_for_sandbox()
        self.python = python
        self.ro_paths = tuple(ro_paths) + tuple(extra)
        self.env = {"PYTHONPATH": os.pathsep.join(extra)} if extra else None
        # (a task environment, call) on a cluster back-end: the call runs there instead, with
        # the node's copy of the environment (``envs.repo.TaskEnvCheckRunner`` sets it)
        self.node_call: tuple[Any, Any, tuple] | None = None

    def run(
        self,
        workspace: schema.GroupWorkspace,
        candidate: schema.Candidate,
        command: str,
        time_limit_s: float | None = None,
    ) -> CheckResult:
        """Runs ``command``; ``time_limit_s`` lowers the wall limit for this check (what is
        left of the grader's check budget)."""
        limits = self.limits
        if time_limit_s is not None and time_limit_s < limits.wall_s:
            limits = dataclasses.replace(limits, wall_s=max(0.5, float(time_limit_s)))
        try:
            argv = shlex.split(command)
        except ValueError as e:
            return CheckResult("error", f"cannot parse command {command!r}: {e}")
        if not argv:
            return CheckResult("error", "empty command")
        if argv[0] in ("python", "python3"):
            argv[0] = self.python
        try:  # the verifier's prepared tree (or the applied patch's): never the raw text
            files = workspace.tree_of(candidate)
        except diff.DiffError as e:
            return CheckResult("error", f"no tree to run the check in: {e}")
        # on the execution back-end (the trainer's process, or a node of the Ray cluster)
        backend = execution.current()
        fn, args, node_env = run_check_in_tree, (self.env, self.ro_paths), None
        if self.node_call is not None and backend.name != "local":
            node_env, fn, args = self.node_call
        call = backend.call(
            fn,
            files,
            argv,
            limits,
            self.config,
            *args,
            deadline_s=limits.wall_s + execution.CALL_MARGIN_S,
            kind="check",
            env=node_env,
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
    with tempfile.TemporaryDirectory(prefix="gagar-check-") as d:
        for path, text in files.items():
            full = os.path.normpath(os.path.join(d, path))
            if not full.startswith(d + os.sep):
                return f"path {path!r} escapes the repository"
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        return sandbox.run_sandboxed(argv, d, limits, config=config, env=env, ro_paths=ro_paths)


class ToyCheckRunner:
    """Runs toy programs on inputs named in the command (e.g. ``"f(25) f(-3)"`` or ``"25 -3"``).

    The log lists, per input, the candidate's output, the original program's, and each other
    passing candidate's (by anonymised position in the group, never by id).
    """

    def run(
        self, workspace: schema.GroupWorkspace, candidate: schema.Candidate, command: str
    ) -> CheckResult:
        xs = [int(v) for v in re.findall(r"-?\s*\d+", command.replace(" ", ""))][:MAX_CHECK_INPUTS]
        if not xs:
            return CheckResult("error", f"no integer inputs in {command!r}; try 'f(25) f(-3)'")

        def program_of(c: schema.Candidate):
            return L.parse_program(workspace.tree_of(c)[TOY_PROGRAM].splitlines())

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
