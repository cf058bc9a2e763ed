"""A shell workspace per episode: a checkout of the task's tree in the sandbox, and a ``bash`` tool.

:class:`ShellWorkspace` holds one episode's checkout of a task's repository (its pristine
``files``; the hidden tests are never written there) in a directory of its own. When the
process may mount (root), the directory is a tmpfs of ``disk_bytes``: a hard disk quota that
lasts across commands, counted whatever the commands write (files unlinked while open and
preallocated ones included); otherwise the sandbox's disk accounting bounds each command.

Each command runs through ``gagar_jax.verify.sandbox.run_sandboxed`` (bwrap with no network, the
minimal read-only system view, the checkout as the only writable directory at ``/workdir``,
per-command wall-clock, CPU and memory limits, a fresh uid), and every process it started is
killed when it ends: nothing outlives a command. The observation is the exit code, stdout and
stderr, each cut to ``output_chars`` with the cut said in the text.

At the end :meth:`ShellWorkspace.diff` compares the checkout with the base: text files changed,
added or deleted make the unified diff the standard verifier applies to a fresh pristine tree
(``verify_repo_patch``, with the hidden tests); a binary file, a change of a file's mode, a
symlink (one that leaves the tree is said so) or a special file is refused with a reason naming
the path, and such a diff is not verified (the episode fails with the reasons). Byte-code caches
(``__pycache__``, ``*.pyc``, ``.pytest_cache``) are not part of the diff.

:class:`ShellAgentEnv` is the native loop's environment for ``task.tools = "bash"``: the
``bash(command)`` and ``submit()`` tools over a workspace, in the model's tool-call format.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import weakref
from collections.abc import Mapping, Sequence

from gagar_jax.rollout.episode import StepResult, parse_action
from gagar_jax.verify.diff import DiffError, safe_path, tree_patch
from gagar_jax.verify.repo import env_site_packages
from gagar_jax.verify.sandbox import (
    SANDBOX_WORKDIR,
    Limits,
    SandboxConfig,
    python_for_sandbox,
    run_sandboxed,
)

IGNORED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = (".pyc", ".pyo")


@dataclasses.dataclass(frozen=True)
class ShellLimits:
    """Limits of a workspace and of each of its commands.

    Attributes:
      command_wall_s: wall-clock seconds per command (then every process of it is killed).
      command_cpu_s: CPU seconds per process of a command.
      memory_bytes: memory of a command (cgroup; the address-space rlimit backs it up).
      disk_bytes: what the checkout may hold in all (a tmpfs of this size where mountable).
      nproc: processes of a command at once.
      output_chars: stdout and stderr are each cut to this many characters in the observation.
    """

    command_wall_s: float = 30.0
    command_cpu_s: int = 30
    memory_bytes: int = 512 << 20
    disk_bytes: int = 256 << 20
    nproc: int = 64
    output_chars: int = 4000

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ShellLimits.{f.name} must be a number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """One command's outcome: ``status`` is the sandbox's (passed, failed, timeout,
    resource_killed, infra_error)."""

    command: str
    exit_code: int | None
    stdout: str
    stderr: str
    status: str
    observation: str
    wall_s: float
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkspaceDiff:
    """The checkout against its base: ``patch`` (text files only) and ``refused`` ((path,
    reason) of every change a patch cannot carry); ``ok`` when nothing was refused."""

    patch: str
    refused: tuple[tuple[str, str], ...]
    files: Mapping[str, str]

    @property
    def ok(self) -> bool:
        return not self.refused

    def reasons(self) -> str:
        return "; ".join(f"{path}: {why}" for path, why in self.refused)


def _cut(text: str, n: int, name: str) -> str:
    if len(text) <= n:
        return text
    head, tail = text[: n // 2], text[len(text) - n // 2 :]
    cut = len(text) - len(head) - len(tail)
    return f"{head}\n[... {name} cut: {cut} of {len(text)} chars ...]\n{tail}"


class ShellWorkspace:
    """One episode's checkout of ``files`` under ``root`` (a fresh temporary directory when
    None), with a ``bash`` tool run in the sandbox.

    Args:
      files: the task's pristine repository, ``{relative posix path: text}``.
      limits: :class:`ShellLimits`.
      config: the sandbox's :class:`~gagar_jax.verify.sandbox.SandboxConfig`.
      site_packages: read-only host directories put on the commands' ``PYTHONPATH`` (the
        task environment's, which hold pytest; default: the verifier's own interpreter's).
      pythonpath: tree-relative directories also on ``PYTHONPATH`` (``("src",)``).
      env: extra environment variables of every command.
    """

    def __init__(
        self,
        files: Mapping[str, str],
        *,
        root: str | None = None,
        limits: ShellLimits | None = None,
        config: SandboxConfig | None = None,
        site_packages: Sequence[str] | None = None,
        pythonpath: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.limits = limits or ShellLimits()
        self.config = config or SandboxConfig()
        self.base = {safe_path(p): str(t) for p, t in files.items()}
        self.root = root or tempfile.mkdtemp(prefix="gagar_shell_")
        os.chmod(self.root, 0o755)
        self.tree = os.path.join(self.root, "tree")
        os.makedirs(self.tree, exist_ok=True)
        self.quota = "accounted"
        if os.geteuid() == 0:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={int(self.limits.disk_bytes)},mode=0755",
                 "gagar-shell", self.tree],
                capture_output=True,
            )  # fmt: skip  # one mount argv
            if r.returncode == 0:
                self.quota = "tmpfs"
        for path, text in self.base.items():
            full = os.path.join(self.tree, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            os.chmod(full, 0o644)
        exe, default_site = python_for_sandbox()
        self.site_packages = tuple(default_site if site_packages is None else site_packages)
        # `python` and `python3` for the commands: a read-only directory of two symlinks.
        self.bin_dir = os.path.join(self.root, "bin")
        os.makedirs(self.bin_dir, exist_ok=True)
        for name in ("python", "python3"):
            link = os.path.join(self.bin_dir, name)
            if not os.path.lexists(link):
                os.symlink(exe, link)
        os.chmod(self.bin_dir, 0o755)
        inside = [f"{SANDBOX_WORKDIR}/{safe_path(p)}" for p in pythonpath]
        self.env = {
            "HOME": "/tmp",
            "PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": ":".join([SANDBOX_WORKDIR, *inside, *self.site_packages]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TERM": "dumb",
            **dict(env or {}),
        }
        self.commands: list[CommandResult] = []
        self.closed = False
        # An episode dropped without close() still gives its mount and files back.
        self._finalizer = weakref.finalize(self, _remove, self.root, self.tree, self.quota)

    def run(self, command: str) -> CommandResult:
        """Runs ``command`` with ``bash -c`` in the checkout (cwd ``/workdir``)."""
        if self.closed:
            raise RuntimeError("the workspace is closed")
        if not isinstance(command, str):
            raise TypeError(f"command must be a string, got {type(command).__name__}")
        lim = self.limits
        res = run_sandboxed(
            ["/bin/bash", "-c", command],
            self.tree,
            Limits(
                wall_s=lim.command_wall_s,
                cpu_s=int(lim.command_cpu_s),
                memory_bytes=int(lim.memory_bytes),
                disk_bytes=int(lim.disk_bytes),
                nproc=int(lim.nproc),
                output_bytes=max(4 * int(lim.output_chars), 64 << 10),
            ),
            config=self.config,
            env=self.env,
            ro_paths=(self.bin_dir, *self.site_packages),
        )
        n = int(lim.output_chars)
        out, err = _cut(res.stdout, n, "stdout"), _cut(res.stderr, n, "stderr")
        if res.stdout_truncated:
            out += "\n[stdout truncated by the sandbox's capture]"
        if res.stderr_truncated:
            err += "\n[stderr truncated by the sandbox's capture]"
        if res.status == "timeout":
            head = f"command timed out after {lim.command_wall_s:g} s (killed)"
        elif res.status == "resource_killed":
            head = f"command killed by a resource limit ({', '.join(res.limit_hits) or 'kill'})"
        elif res.status == "infra_error":
            head = f"the sandbox failed: {res.error}"
        else:
            head = f"exit code: {res.returncode}"
        obs = f"{head}\nstdout:\n{out}\nstderr:\n{err}".rstrip("\n")
        result = CommandResult(
            command, res.returncode, out, err, res.status, obs, res.wall_s, res.error
        )
        self.commands.append(result)
        return result

    def diff(self) -> WorkspaceDiff:
        """The checkout against the base (see the module docstring)."""
        refused: list[tuple[str, str]] = []
        now: dict[str, str] = {}
        tree_real = os.path.realpath(self.tree)
        for dirpath, dirnames, filenames in os.walk(self.tree):
            rel_dir = os.path.relpath(dirpath, self.tree)
            dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_DIRS)
            for name in sorted(filenames) + [
                d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
            ]:
                full = os.path.join(dirpath, name)
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                try:
                    path = safe_path(rel)
                except DiffError as e:
                    refused.append((rel[:200], f"path a patch cannot carry ({e})"))
                    continue
                st = os.lstat(full)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(full)
                    where = os.path.realpath(os.path.join(dirpath, target))
                    inside = where == tree_real or where.startswith(tree_real + os.sep)
                    refused.append(
                        (
                            path,
                            f"symlink to {target[:200]!r}"
                            + ("" if inside else " leaves the tree")
                            + " (patches carry regular text files only)",
                        )
                    )
                    continue
                if not stat.S_ISREG(st.st_mode):
                    refused.append((path, "special file (fifo, socket or device)"))
                    continue
                with open(full, "rb") as f:
                    data = f.read()
                try:
                    text = data.decode("utf-8")
                    binary = "\x00" in text
                except UnicodeDecodeError:
                    binary = True
                if binary:
                    if path in self.base or data:
                        refused.append((path, "binary file"))
                    continue
                mode = stat.S_IMODE(st.st_mode)
                if mode & 0o111:
                    refused.append(
                        (path, f"mode change to {mode:04o} (patches carry no file modes)")
                    )
                    continue
                now[path] = text
        if refused:
            return WorkspaceDiff("", tuple(refused), now)
        return WorkspaceDiff(tree_patch(self.base, now), (), now)

    def close(self) -> None:
        """Unmounts and removes the checkout (the commands' processes are already gone)."""
        self.closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _remove(root: str, tree: str, quota: str) -> None:
    if quota == "tmpfs":
        subprocess.run(["umount", "-l", tree], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the repository (cwd /workdir); returns the exit "
        "code, stdout and stderr. No network. Each command starts fresh (no background jobs).",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
SUBMIT_TOOL = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the repository as it is now as the solution (ends the episode).",
        "parameters": {"type": "object", "properties": {}},
    },
}
SHELL_TOOLS = (BASH_TOOL, SUBMIT_TOOL)


class ShellAgentEnv:
    """A ``ToolEnvironment`` of ``bash(command)`` and ``submit()`` over a :class:`ShellWorkspace`.

    ``submit`` ends the episode with ``info["patch"]`` (the workspace's diff) and
    ``info["refused"]`` (its refusals, then the patch is ""). A turn without a valid call is
    answered with the tools' names (counted in ``counts["invalid_actions"]``).
    """

    def __init__(self, workspace: ShellWorkspace, *, max_observation_chars: int = 8000):
        self.workspace = workspace
        self.max_observation_chars = int(max_observation_chars)
        self.submitted = False
        self.final: WorkspaceDiff | None = None
        self.counts = {"invalid_actions": 0, "commands": 0}

    def step(self, action_text: str) -> StepResult:
        call = parse_action(action_text)
        if call is None or call.name not in ("bash", "submit"):
            self.counts["invalid_actions"] += 1
            return StepResult(
                "error: no valid tool call (tools: bash, submit)",
                info={"tool": None if call is None else call.name, "summary": "invalid action"},
            )
        if call.name == "submit":
            self.submitted = True
            self.final = self.workspace.diff()
            verdict = "submitted" if self.final.ok else f"diff refused: {self.final.reasons()}"
            return StepResult(
                verdict,
                done=True,
                info={
                    "tool": "submit",
                    "patch": self.final.patch,
                    "refused": [list(r) for r in self.final.refused],
                    "summary": "submit" if self.final.ok else "submit: diff refused",
                },
            )
        command = call.arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            self.counts["invalid_actions"] += 1
            return StepResult(
                "error: bash needs a non-empty `command` string",
                info={"tool": "bash", "summary": "bash: no command"},
            )
        self.counts["commands"] += 1
        r = self.workspace.run(command)
        obs = r.observation
        if len(obs) > self.max_observation_chars:
            obs = _cut(obs, self.max_observation_chars, "observation")
        first = command.strip().splitlines()[0][:80]
        return StepResult(
            obs,
            info={
                "tool": "bash",
                "command": command,
                "exit_code": r.exit_code,
                "status": r.status,
                "summary": f"bash {first!r}: {r.status}",
            },
        )

    def patch(self) -> str:
        d = self.final or self.workspace.diff()
        return d.patch

    @property
    def refused(self) -> tuple[tuple[str, str], ...]:
        return self.final.refused if self.final is not None else ()

    def close(self) -> None:
        self.workspace.close()


class ShellRepoEnv(ShellAgentEnv):
    """A ``python_repo`` episode with ``task.tools = "bash"``: the task's pristine files in a
    :class:`ShellWorkspace` (its environment's site-packages and ``pythonpath`` on the
    commands' ``PYTHONPATH``); the family verifies ``patch()`` as for the structured tools."""

    def __init__(self, task, *, limits: ShellLimits | None = None, config=None):
        site = env_site_packages(task.env_path) if getattr(task, "env_path", "") else None
        workspace = ShellWorkspace(
            task.files,
            limits=limits,
            config=config,
            site_packages=site,
            pythonpath=tuple(getattr(task, "pythonpath", ()) or ()),
        )
        super().__init__(workspace)
        self.task = task
        self.phase = "rollout"

    @property
    def files(self) -> dict[str, str]:
        return dict(self.workspace.diff().files)


def bash_calls(calls: Sequence[tuple[str, Mapping]]) -> list[tuple[str, dict]]:
    """The structured tools' calls (``read_file``, ``edit``, ``run_tests``, ``submit``) as
    ``bash`` commands doing the same (the demonstrations of ``task.tools = "bash"``)."""
    out: list[tuple[str, dict]] = []
    for name, args in calls:
        if name == "read_file":
            cmd = f"cat {shlex.quote(args['path'])}"
        elif name == "edit" and "content" in args:
            cmd = (
                "python - <<'GAGAR_EOF'\nimport pathlib\n"
                f"p = pathlib.Path({args['path']!r})\np.parent.mkdir(parents=True, exist_ok=True)\n"
                f"p.write_text({args['content']!r})\nGAGAR_EOF"
            )
        elif name == "edit":
            cmd = (
                "python - <<'GAGAR_EOF'\nimport pathlib\n"
                f"p = pathlib.Path({args['path']!r})\n"
                f"p.write_text(p.read_text().replace({args['old']!r}, {args['new']!r}, 1))\n"
                "GAGAR_EOF"
            )
        elif name == "run_tests":
            cmd = "python -m pytest -q 2>&1 | tail -20"
        elif name == "submit":
            out.append(("submit", {}))
            continue
        else:
            raise ValueError(f"no bash form of the tool {name!r}")
        out.append(("bash", {"command": cmd}))
    return out


__all__ = [
    "BASH_TOOL",
    "SHELL_TOOLS",
    "CommandResult",
    "ShellAgentEnv",
    "ShellLimits",
    "ShellRepoEnv",
    "bash_calls",
    "ShellWorkspace",
    "WorkspaceDiff",
]
