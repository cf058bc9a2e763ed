"""Repository snapshots from git and test environments without Docker.

**Snapshots.** A task names a repository (``owner/name``) and a commit. The repositories live in
a local directory holding, per repository, ``owner__name/`` (a work tree with ``.git``),
``owner__name.git/`` (a bare repository) or ``owner__name.bundle`` (a git bundle, cloned once
into the cache). :func:`snapshot` materialises the tree of one commit with ``git archive`` into a
cache directory (once per commit; later calls reuse it): the tree has no ``.git`` at all, so no
future commit, reflog, tag or packed object of the store is readable from it. The task stream
only names the commit; :func:`snapshot_files` reads the materialised tree when a task is built.

**Environments.** :func:`build_env` makes a virtual environment with ``uv`` from the package
registry: the requirements (the package's dependencies and its test requirements) are resolved
to a lockfile (``uv pip compile``), pytest and pytest-timeout are pinned to the verifier's own
versions, and the environment is content-addressed: ``env_hash`` = SHA-256 of the interpreter's
version and the resolved lockfile. It is built once under ``<cache>/envs/<env_hash>`` and reused
by every task naming the same requirements. The verifier binds its site-packages read-only into
the sandbox (``RepoTask.env_path``); the package under test itself is imported from the task's
tree (the repository root and, for a ``src/`` layout, ``src``: ``RepoTask.pythonpath``), which
is what an editable install provides, without a path baked into the environment.

**On the nodes of a cluster.** :class:`LockfileEnv` rebuilds an environment from the lockfile
recorded in the trainer's copy (``<env_path>/.gagar-env``; :func:`node_env_builder`), with no
resolution, on a machine that lacks it: ``verify.execution`` builds it once per node under a
lock (``ensure_env``) and verifies there against that copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence

from gagar_jax.verify import execution as _execution
from gagar_jax.verify.layout import declared_requirements, detect_pythonpath  # noqa: F401 (re-exported)
from gagar_jax.verify.repo import env_site_packages, read_text_tree
from gagar_jax.verify.sandbox import python_for_sandbox

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "HOME": "/nonexistent",
    "GIT_AUTHOR_NAME": "gagar",
    "GIT_AUTHOR_EMAIL": "gagar@localhost",
    "GIT_COMMITTER_NAME": "gagar",
    "GIT_COMMITTER_EMAIL": "gagar@localhost",
}
TEST_TOOLS = ("pytest", "pytest-timeout")


class RepoNotFound(FileNotFoundError):
    """No ``owner__name``, ``owner__name.git`` or ``owner__name.bundle`` in the repositories
    directory."""


def default_cache_dir() -> str:
    return os.environ.get("GAGAR_REPO_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "gagar_jax", "repos"
    )


def git(
    *args: str,
    cwd: str | None = None,
    check: bool = True,
    input: bytes | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``git`` with no system/user configuration and no prompts."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **GIT_ENV}
    r = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        input=input,
        timeout=timeout,
        check=False,
    )
    if check and r.returncode != 0:
        raise RuntimeError(
            f"git {' '.join(args[:3])} failed ({r.returncode}): "
            f"{r.stderr.decode(errors='replace').strip()[-500:]}"
        )
    return r


def repo_key(repo: str) -> str:
    """``owner/name`` -> ``owner__name`` (ValueError for anything else)."""
    if not isinstance(repo, str) or not re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", repo):
        raise ValueError(f"repo must be 'owner/name', got {repo!r}")
    return repo.replace("/", "__")


def find_repo(repos_dir: str, repo: str) -> str:
    """The path of ``repo`` in ``repos_dir``: ``owner__name/``, ``owner__name.git/`` or
    ``owner__name.bundle`` (first found, in that order)."""
    key = repo_key(repo)
    for name in (key, key + ".git", key + ".bundle"):
        path = os.path.join(repos_dir, name)
        if os.path.exists(path):
            return path
    raise RepoNotFound(
        f"repository {repo!r}: none of {key}/, {key}.git/, {key}.bundle in {repos_dir!r}"
    )


def git_dir(repos_dir: str, repo: str, cache_dir: str | None = None) -> str:
    """A git directory holding ``repo``'s objects (a bundle is cloned once into the cache)."""
    path = find_repo(repos_dir, repo)
    if path.endswith(".bundle"):
        cache = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), "stores")
        dest = os.path.join(cache, repo_key(repo) + ".git")
        if not os.path.isdir(dest):
            os.makedirs(cache, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".clone-", dir=cache)
            git("clone", "--bare", "-q", path, os.path.join(tmp, "r.git"))
            try:
                os.rename(os.path.join(tmp, "r.git"), dest)
            except OSError:
                pass  # another process cloned it first
            shutil.rmtree(tmp, ignore_errors=True)
        return dest
    return path


def resolve_commit(store: str, commit: str) -> str:
    if not re.fullmatch(r"[\w./^~-]+", commit or "") or commit.startswith("-"):
        raise ValueError(f"commit must be a hash or a ref name, got {commit!r}")
    r = git("rev-parse", "--verify", "--quiet", commit + "^{commit}", cwd=store, check=False)
    if r.returncode != 0:
        raise ValueError(f"commit {commit!r} is not in the repository at {store!r}")
    return r.stdout.decode().strip()


def snapshot(repos_dir: str, repo: str, commit: str, cache_dir: str | None = None) -> str:
    """The directory holding ``repo``'s tree at ``commit`` (``git archive``; no ``.git``),
    materialised once per commit under ``<cache>/trees/owner__name/<sha>`` and reused."""
    cache = os.path.abspath(cache_dir or default_cache_dir())
    store = git_dir(repos_dir, repo, cache)
    sha = resolve_commit(store, commit)
    dest = os.path.join(cache, "trees", repo_key(repo), sha)
    if os.path.isfile(os.path.join(dest, ".gagar-snapshot")):
        return os.path.join(dest, "tree")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".snap-", dir=os.path.dirname(dest))
    try:
        archive = git("archive", "--format=tar", sha, cwd=store).stdout
        tree = os.path.join(tmp, "tree")
        os.mkdir(tree)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
            tf.extractall(tree, filter="data")
        with open(os.path.join(tmp, ".gagar-snapshot"), "w") as f:
            json.dump({"repo": repo, "commit": sha}, f)
        for root, _dirs, _ in os.walk(tmp):  # readable by the sandbox uid
            os.chmod(root, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, ".gagar-snapshot")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.join(dest, "tree")


def snapshot_files(
    repos_dir: str, repo: str, commit: str, cache_dir: str | None = None
) -> dict[str, str]:
    """The text files of ``repo`` at ``commit`` (from the cached snapshot)."""
    return read_text_tree(snapshot(repos_dir, repo, commit, cache_dir))


def agent_git_repo(tree: str, dest: str) -> str:
    """A git repository at ``dest`` holding ``tree`` as its only commit, with no reflog, tag,
    remote or other object: the history an agent may be given without leaking the fix."""
    shutil.copytree(tree, dest, symlinks=True)
    git("init", "-q", "-b", "main", cwd=dest)
    git("add", "-A", cwd=dest)
    git("commit", "-q", "--no-verify", "-m", "base", cwd=dest)
    shutil.rmtree(os.path.join(dest, ".git", "logs"), ignore_errors=True)
    for name in ("ORIG_HEAD", "FETCH_HEAD", "COMMIT_EDITMSG"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(dest, ".git", name))
    return dest


# ---------------------------------------------------------------------------------------------
# Layout detection
# ---------------------------------------------------------------------------------------------
def package_requirements(files: Mapping[str, str]) -> list[str]:
    """Every requirement the repository declares for its tests, from each declaration
    (``verify.layout.declared_requirements``); setup.py is not executed here."""
    return declared_requirements(files)


# ---------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EnvInfo:
    """A built environment: ``path`` (the venv), ``env_hash``, the resolved ``lockfile`` text,
    ``seconds`` spent by this call and whether it was ``reused`` from the cache."""

    path: str
    env_hash: str
    lockfile: str
    seconds: float
    reused: bool


class EnvBuildError(RuntimeError):
    """The environment could not be resolved or installed (names the requirement step)."""


def uv_exe() -> str:
    exe = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if not exe:
        raise EnvBuildError("uv is not installed (pip install uv into this environment)")
    return exe


def _run_uv(args: Sequence[str], what: str, input: str | None = None, timeout: float = 900) -> str:
    env = dict(os.environ)
    env.setdefault("UV_NO_PROGRESS", "1")
    r = subprocess.run(
        [uv_exe(), *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
        env=env,
        check=False,
    )
    if r.returncode != 0:
        raise EnvBuildError(f"{what} failed: {r.stderr.strip()[-1500:]}")
    return r.stdout


def pinned_test_tools() -> list[str]:
    """pytest and pytest-timeout at the verifier's own versions (its outcome plugin and
    ``-p pytest_timeout`` are tested against them)."""
    out = []
    for name in TEST_TOOLS:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


@functools.cache
def _interpreter() -> tuple[str, str]:
    exe, _ = python_for_sandbox()
    version = subprocess.run(
        [exe, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    return exe, version


def lock_requirements(requirements: Sequence[str], python: str | None = None) -> str:
    """The resolved lockfile (``name==version`` lines, sorted, no comments) of
    ``requirements`` plus the pinned test tools, for the sandbox's interpreter."""
    exe = python or _interpreter()[0]
    for r in requirements:
        if not isinstance(r, str) or not r.strip() or r.strip().startswith("-"):
            raise ValueError(f"requirement {r!r}: expected a PEP 508 requirement string")
    reqs = "\n".join([*pinned_test_tools(), *(r.strip() for r in requirements)]) + "\n"
    out = _run_uv(
        ["pip", "compile", "-", "-q", "--no-header", "--no-annotate", "--python", exe],
        "resolving the requirements",
        input=reqs,
    )
    lines = sorted(
        {ln.strip() for ln in out.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    )
    return "\n".join(lines) + "\n"


def env_hash_of(interpreter_version: str, lockfile: str) -> str:
    return hashlib.sha256(f"{interpreter_version}\n{lockfile}".encode()).hexdigest()[:32]


_BUILT: dict[tuple, EnvInfo] = {}
ENV_FORMAT = 2  # 2: site-packages compiled to bytecode at build time


def compile_bytecode(venv: str, exe: str | None = None) -> None:
    """Compiles the environment's site-packages to bytecode with the sandbox's interpreter.

    The sandbox binds the environment read-only, so an interpreter there can never write a
    ``.pyc``: without this every run compiles pytest and the dependencies from source again
    (measured: importing pytest and pytest-timeout in the sandbox costs 0.27 s of CPU without
    bytecode, 0.12 s with it)."""

    exe = exe or _interpreter()[0]
    for sp in env_site_packages(venv):
        subprocess.run([exe, "-m", "compileall", "-q", "-j", "0", sp], capture_output=True,
                       timeout=900, check=False)  # fmt: skip  # argv pairs


def _mark_compiled(venv: str) -> None:
    """Brings an environment of an older format up to date (bytecode) and rewrites its
    marker; a no-op for a current one."""
    marker = os.path.join(venv, ".gagar-env")
    try:
        with open(marker) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return
    if meta.get("format", 1) >= ENV_FORMAT:
        return
    compile_bytecode(venv)
    meta["format"] = ENV_FORMAT
    tmp = marker + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, marker)


def _resolution_path(root: str, requirements: Sequence[str], version: str) -> str:
    key = hashlib.sha256(
        json.dumps([version, pinned_test_tools(), [r.strip() for r in requirements]]).encode()
    ).hexdigest()
    return os.path.join(root, "resolved", key[:32] + ".json")


def build_env(requirements: Sequence[str] = (), *, cache_dir: str | None = None) -> EnvInfo:
    """The environment of ``requirements`` (+ pinned pytest, pytest-timeout), built once per
    ``env_hash`` under ``<cache>/envs/`` and reused, its site-packages compiled to bytecode.

    A requirement list is resolved once per cache: its lockfile is remembered under
    ``<cache>/envs/resolved/`` (keyed by the interpreter's version, the test tools' pins and
    the requirement strings), so later processes reuse the environment without resolving again
    (a newer release of an unpinned requirement is picked up only after that file is
    deleted); within one process the same requirements are looked up once."""
    t0 = time.monotonic()
    root = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), "envs")
    memo_key = (tuple(requirements), root)
    known = _BUILT.get(memo_key)
    if known is not None and os.path.isfile(os.path.join(known.path, ".gagar-env")):
        # resolved and built by this process already: no second resolution
        return dataclasses.replace(known, seconds=time.monotonic() - t0, reused=True)
    exe, version = _interpreter()
    for r in requirements:
        if not isinstance(r, str) or not r.strip() or r.strip().startswith("-"):
            raise ValueError(f"requirement {r!r}: expected a PEP 508 requirement string")
    resolved = _resolution_path(root, requirements, version)
    lock = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(resolved) as f:
            lock = json.load(f)["lockfile"]
    if lock is None:
        lock = lock_requirements(requirements, exe)
    h = env_hash_of(version, lock)
    dest = os.path.join(root, h)
    if os.path.isfile(os.path.join(dest, ".gagar-env")):
        _mark_compiled(dest)
        _remember_resolution(resolved, requirements, lock)
        info = EnvInfo(dest, h, lock, time.monotonic() - t0, True)
        _BUILT[memo_key] = info
        return info
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{h}-", dir=root)
    try:
        venv = os.path.join(tmp, "venv")
        _install_env(venv, exe, version, lock, h)
        try:
            os.rename(venv, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, ".gagar-env")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remember_resolution(resolved, requirements, lock)
    info = EnvInfo(dest, h, lock, time.monotonic() - t0, False)
    _BUILT[memo_key] = info
    return info


def _remember_resolution(path: str, requirements: Sequence[str], lock: str) -> None:
    if os.path.isfile(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"requirements": list(requirements), "lockfile": lock}, f)
    os.replace(tmp, path)


def _install_env(venv: str, exe: str, version: str, lock: str, env_hash: str) -> None:
    """Creates the virtual environment ``venv`` (absent or empty) for interpreter ``exe`` and
    installs the resolved ``lock`` into it (no resolution: exactly those versions)."""
    _run_uv(["venv", "-q", "--allow-existing", "--python", exe, venv],
            "creating the virtual environment")  # fmt: skip  # argv pairs
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(lock)
    try:
        _run_uv(["pip", "install", "-q", "--no-deps", "--python",
                 os.path.join(venv, "bin", "python"), "-r", f.name],
                "installing the lockfile")  # fmt: skip  # argv pairs
    finally:
        os.unlink(f.name)
    compile_bytecode(venv, exe)
    with open(os.path.join(venv, ".gagar-env"), "w") as f:
        json.dump(
            {"env_hash": env_hash, "interpreter": version, "lockfile": lock, "format": ENV_FORMAT},
            f,
        )
    for d, _, _ in os.walk(venv):  # readable by the sandbox uid
        os.chmod(d, os.stat(d).st_mode | 0o555)


# ---------------------------------------------------------------------------------------------
# Environments on the nodes of a cluster
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LockfileEnv:
    """Builds the environment ``env_hash`` from its resolved lockfile on a machine that lacks
    it (a node of the execution cluster): no resolution, the exact versions the trainer
    resolved, so the environment is the one the hash names. A picklable ``build(path)`` for
    ``verify.execution.ensure_env``; it fills ``path`` with the virtual environment.

    A node whose sandbox interpreter is not the one the hash was computed for cannot build it
    (``EnvBuildError``): its environment would not be the one the hash names.
    """

    env_hash: str
    lockfile: str
    interpreter: str

    def __call__(self, path: str) -> None:
        exe, version = _interpreter()
        if version != self.interpreter:
            raise EnvBuildError(
                f"environment {self.env_hash} is for Python {self.interpreter.split()[0]}; "
                f"this node's sandbox interpreter is {version.split()[0]}"
            )
        if env_hash_of(version, self.lockfile) != self.env_hash:
            raise EnvBuildError(f"environment {self.env_hash}: the lockfile does not hash to it")
        _install_env(path, exe, version, self.lockfile, self.env_hash)


_NODE_ENVS: dict[str, LockfileEnv] = {}


def node_env_builder(env_path: str, env_hash: str) -> LockfileEnv:
    """The :class:`LockfileEnv` of the environment built at ``env_path`` (read from its
    ``.gagar-env`` record, once per process). ``EnvBuildError`` if the record is missing or
    names another hash."""
    known = _NODE_ENVS.get(env_hash)
    if known is not None:
        return known
    record = os.path.join(env_path, ".gagar-env")
    try:
        with open(record) as f:
            meta = json.load(f)
        lock, version = meta["lockfile"], meta["interpreter"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EnvBuildError(
            f"environment {env_hash}: no readable record at {record!r} ({type(e).__name__}: {e})"
        ) from e
    if meta.get("env_hash") != env_hash:
        raise EnvBuildError(
            f"environment record {record!r} is for {meta.get('env_hash')!r}, not {env_hash!r}"
        )
    _NODE_ENVS[env_hash] = LockfileEnv(env_hash, lock, version)
    return _NODE_ENVS[env_hash]


def _task_env_spec(task) -> _execution.EnvSpec | None:
    """The cluster back-end's view of ``task``'s environment: its hash and the
    :class:`LockfileEnv` a node builds it from (registered with the execution layer)."""
    h = getattr(task, "env_hash", "") or ""
    if not h:
        return None
    return _execution.EnvSpec(h, node_env_builder(getattr(task, "env_path", "") or "", h))


_execution.register_env_resolver(_task_env_spec)
