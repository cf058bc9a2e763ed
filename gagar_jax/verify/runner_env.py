"""The test runner's own environment: pytest and its plugins, and nothing of the trainer's.

A sandboxed test run needs pytest (and pytest-timeout) importable by the sandbox's unprivileged
uid. It must not see the trainer's site-packages: a package under test that the trainer happens
to have installed (attrs, say) would be imported from there instead of the task's tree, and a
gold patch, an empty one and a wrong one would all pass. Nor may it depend on where the trainer
lives: a checkout in a private directory (0700, a home) cannot be read by that uid under the
fallback mechanisms (``unshare``, ``rlimits``), which see the real paths.

So :func:`runner_site_packages` builds, once per (interpreter, versions), a site-packages holding
exactly the distributions pytest and pytest-timeout need, at the versions installed here (the
outcome plugin is tested against them), under a root that every uid can read
(:func:`stage_root`: ``$GAGAR_SANDBOX_ENVS`` or ``/tmp/gagar_jax_sandbox_envs-<uid>``, owned by
this user and writable by nobody else). It is installed with uv (``uv pip install --target``, the
same tool that builds the task environments) for the sandbox's interpreter and compiled to
bytecode (the sandbox binds it read-only); without uv, or where uv cannot fetch the packages,
the installed files themselves (the distributions' ``RECORD``) are copied: a readable staged
copy of the same versions. A finished build is published by an atomic rename, so concurrent
processes share one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence

TOOLS = ("pytest", "pytest-timeout")
DEFAULT_STAGE_ROOT = "/tmp/gagar_jax_sandbox_envs-{uid}"  # one per user: each owns its own
_MARKER = ".gagar-runner-env"


class RunnerEnvError(RuntimeError):
    """The runner's environment cannot be built or its root is not safe to use."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def runner_requirements(tools: Sequence[str] = TOOLS) -> tuple[str, ...]:
    """``name==version`` of ``tools`` and every distribution they need (their requirements'
    closure, markers evaluated for this interpreter, extras ignored), at the versions installed
    in this environment; sorted. RunnerEnvError if a tool is not installed here."""
    from packaging.requirements import Requirement  # pytest's own dependency

    seen: dict[str, str] = {}
    todo = list(tools)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError as e:
            raise RunnerEnvError(f"{name} is not installed in {sys.prefix}") from e
        seen[name] = dist.version
        for spec in dist.requires or ():
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    return tuple(f"{n}=={v}" for n, v in sorted(seen.items()))


def stage_root() -> str:
    """The directory the runner environments live under, created 0755 if absent.

    RunnerEnvError if it is not a directory owned by this user that no other user may write
    (a directory another user made first in /tmp could swap the packages under the verifier)."""
    root = os.environ.get("GAGAR_SANDBOX_ENVS") or DEFAULT_STAGE_ROOT.format(uid=os.geteuid())
    root = os.path.abspath(root)
    try:
        os.makedirs(root, mode=0o755, exist_ok=True)
        st = os.lstat(root)
    except OSError as e:
        raise RunnerEnvError(f"cannot create the runner environment root {root!r}: {e}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RunnerEnvError(
            f"the runner environment root {root!r} must be a directory owned by uid "
            f"{os.geteuid()} and writable by nobody else (it is uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}); remove it or set GAGAR_SANDBOX_ENVS"
        )
    if st.st_mode & 0o005 != 0o005:
        os.chmod(root, 0o755)
    return root


def _interpreter_version(exe: str) -> str:
    return subprocess.run(
        [exe, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()


def _uv() -> str | None:
    return shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")


def _install_with_uv(target: str, exe: str, requirements: Sequence[str]) -> str | None:
    """Installs ``requirements`` (exact pins, no resolution) into ``target`` for ``exe``;
    None if it worked, else why."""
    uv = _uv()
    if not uv:
        return "uv is not installed"
    env = dict(os.environ, UV_NO_PROGRESS="1")
    r = subprocess.run(
        [uv, "pip", "install", "-q", "--no-deps", "--link-mode", "copy", "--python", exe,
         "--target", target, *requirements],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip  # argv pairs
    if r.returncode != 0:
        return f"uv pip install: {r.stderr.strip()[-500:]}"
    return None


def _copy_installed(target: str, requirements: Sequence[str]) -> None:
    """Copies the installed files of each distribution of ``requirements`` (its ``RECORD``:
    modules, packages and metadata; console scripts left out) into ``target``."""
    for req in requirements:
        dist = importlib.metadata.distribution(req.split("==", 1)[0])
        base = os.path.realpath(str(dist.locate_file("")))
        for f in dist.files or ():
            src = os.path.realpath(str(dist.locate_file(f)))
            if not src.startswith(base + os.sep) or "__pycache__" in f.parts:
                continue  # a script in bin/, or a stale bytecode file
            if not os.path.isfile(src):
                continue
            dst = os.path.join(target, os.path.relpath(src, base))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)


def _make_readable(root: str) -> None:
    for d, _, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)


def build_runner_env(exe: str, *, use_uv: bool = True) -> str:
    """The site-packages directory of the runner environment for interpreter ``exe`` (built
    on first use, then reused by every process of this machine).

    Args:
      exe: the sandbox's interpreter (``verify.sandbox.python_for_sandbox``).
      use_uv: install with uv (the default); False copies the installed files, as happens when
        uv is missing or cannot reach the packages.

    Raises:
      RunnerEnvError: the root is unsafe, or neither uv nor a copy could build it.
    """
    version = _interpreter_version(exe)
    requirements = runner_requirements()
    key = hashlib.sha256(json.dumps([version, requirements]).encode()).hexdigest()[:24]
    root = stage_root()
    dest = os.path.join(root, key)
    site = os.path.join(dest, "site-packages")
    if os.path.isfile(os.path.join(dest, _MARKER)):
        return site
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=root)
    try:
        target = os.path.join(tmp, "site-packages")
        why = _install_with_uv(target, exe, requirements) if use_uv else "uv not asked for"
        how = "uv"
        if why is not None:
            shutil.rmtree(target, ignore_errors=True)
            exe_minor = version.split()[0].rsplit(".", 1)[0]
            own_minor = "{}.{}".format(*sys.version_info[:2])
            if exe_minor != own_minor:
                raise RunnerEnvError(
                    f"cannot build the test runner's environment for {exe} (Python {exe_minor}):"
                    f" {why}; and this process's packages are for Python {own_minor}"
                )
            _copy_installed(target, requirements)
            how = "copy"
        subprocess.run([exe, "-m", "compileall", "-q", "-j", "0", target],
                       capture_output=True, timeout=600, check=False)  # fmt: skip  # argv pairs
        with open(os.path.join(tmp, _MARKER), "w") as f:
            json.dump({"interpreter": version, "requirements": requirements, "how": how}, f)
        _make_readable(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, _MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return site
