"""The execution back-end: where the work that runs or judges a candidate's code runs.

Everything that runs a candidate's code or judges it (the sandboxed verifier, the agent's
``run_tests`` tool, the grader and its checks, task validation) is a *call*: a picklable function
and its arguments. A back-end runs calls and returns a :class:`CallResult` whose ``status`` is

  ok           the function returned (its value is ``value``; a failing verdict is still ok)
  timeout      the call passed its deadline; its whole process tree was killed
  infra_error  the infrastructure failed (a node lost, an environment that did not build, a
               worker killed) on every allowed attempt, or the function itself raised: never the
               candidate's fault, so the rollout is masked, never scored 0

Two back-ends behind one interface (``execution.backend`` in the run config):

* :class:`LocalBackend` (the default): calls run in the caller's thread, as they always did;
  a group's calls one after the other. The sandbox's own wall limit ends sandboxed code.
* :class:`RayBackend`: calls are Ray tasks on a cluster (``ray_address``: ``"auto"``, ``"local"``
  for a single-machine cluster started here, or an address), placed by their resources
  (``num_cpus``, ``memory`` in bytes, custom resources such as ``{"verifier": 1}``, so that
  verification lands on CPU nodes that advertise ``verifier`` and never on accelerator hosts).

Ray back-end semantics (each one counted in :meth:`RayBackend.metrics`):

* **Backpressure.** At most ``max_inflight`` calls are submitted to Ray at once; one dispatcher
  thread owns them and ``ray.wait``-s on them. Calls beyond that wait in a FIFO queue
  (``execution/queue_wait_s``).
* **Budget admission.** :meth:`RayBackend.admit` reserves a group's K verifier slots and its
  grader slot together (all or none) before its first call is dispatched. The verifier slots
  are held until the group's calls finish; the grader slot (one of ``grader_slots``) is held
  under the group's id until the group has been graded or is known not to be graded
  (:meth:`RayBackend.release_grader`: the loop wires the grading pool's completions to it and
  releases the groups it drops). So groups verified earlier and still waiting for a grader
  hold back new groups: a saturated cluster slows generation instead of piling up work. The
  groups of one ``gather_groups`` call are admitted against the slots other calls hold (a
  round's own groups cannot be graded before the round returns, so they never wait for each
  other's grader slots).
* **Deadlines end the work.** On the node, every call runs in a child process of its own session
  with a private temporary directory (``TMPDIR``); at the deadline the child's whole process tree
  (every descendant, found through ``/proc``, whatever session it moved to) is killed, and the
  temporary directory is removed after every call, whatever happened. The child dies with its
  Ray worker (``PR_SET_PDEATHSIG``). The driver backs this up: a call still running
  ``deadline_grace_s`` after its deadline is cancelled with ``ray.cancel(force=True)``.
* **Retries.** A call whose node or worker died, or whose node could not set up its environment,
  is submitted again (``max_retries`` times; ``execution/retries``, ``execution/node_losses``).
  The verdict is a pure function of the call's arguments, so a retried call gives the verdict
  the first attempt would have. Exhausted retries are ``infra_error``.
* **One global rate limit** for LLM-grader requests: a named Ray actor (a token bucket) that every
  worker asks before a request (:func:`llm_rate_limit`).
* **Environments on the nodes.** :func:`ensure_env` builds a task environment once per node,
  under a file lock, keyed by its environment hash (``GAGAR_ENV_CACHE``, default
  ``~/.cache/gagar_jax/envs``); a call may name one (``env=EnvSpec(hash, build)``) and then a
  node that lacks it builds it before the call runs (a failed build is the node's failure:
  retried elsewhere). :func:`verify_repo_call` and the grader's check runner name the
  environment of a real-package task (:func:`task_env`: rebuilt from the lockfile the trainer
  resolved) and run against the node's copy of it (:func:`with_task_env`).

The process-wide back-end that the call sites use (the repository family's verifier and
``run_tests`` tool, the grader's check runner, the grading pool, task validation) is
:func:`current`; the training loop installs the configured one with :func:`use`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import itertools
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gagar_jax.verify.repo import DEFAULT_LIMITS, RepoVerification, verify_repo_patch

BACKENDS = ("local", "ray")
CALL_STATUSES = ("ok", "timeout", "infra_error")
LLM_LIMITER_NAME = "gagar_llm_rate_limit"
RAY_NAMESPACE = "gagar_jax"
CALL_DIR_PREFIX = "gagar_call_"


# ---------------------------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CallResources:
    """What one call needs of a node (Ray's scheduling resources).

    Attributes:
      num_cpus: CPU cores reserved for the call.
      memory: bytes of memory reserved for the call (Ray's ``memory`` resource: a scheduling
        reservation; the sandbox's ``Limits`` bound what the code may really use).
      resources: custom resources, e.g. ``{"verifier": 1}`` (only nodes started with
        ``--resources='{"verifier": N}'`` take the call).
    """

    num_cpus: float = 1.0
    memory: int = 0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.num_cpus >= 0:
            raise ValueError(f"CallResources.num_cpus must be >= 0, got {self.num_cpus!r}")
        if not (isinstance(self.memory, int) and self.memory >= 0):
            raise ValueError(f"CallResources.memory must be bytes (int >= 0), got {self.memory!r}")
        for k, v in self.resources.items():
            if not (isinstance(k, str) and k and v >= 0):
                raise ValueError(
                    f"CallResources.resources[{k!r}] must be a name -> amount >= 0, got {v!r}"
                )

    def ray_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.memory:
            opts["memory"] = self.memory
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A task environment a call needs on its node: built once per node by ``build(path)``
    (which fills the empty directory ``path``), keyed by ``env_hash``."""

    env_hash: str
    build: Callable[[str], Any]


@dataclasses.dataclass(frozen=True)
class CallResult:
    """The outcome of one call.

    Attributes:
      status: ok | timeout | infra_error (module docstring).
      value: the function's return value when ok, else None.
      error: why it is not ok ("" when ok).
      attempts: how many times it was submitted (1 + retries).
      node_id: the node that ran the final attempt ("" locally).
      queue_wait_s: seconds from submission to dispatch (backpressure and admission).
      run_s: seconds from dispatch to result.
      reaped: processes still alive when the call ended, killed by the back-end.
      env_build_s: seconds the call's node spent building its environment (None: the node
        had it, or the call named none).
    """

    status: str
    value: Any = None
    error: str = ""
    attempts: int = 1
    node_id: str = ""
    queue_wait_s: float = 0.0
    run_s: float = 0.0
    reaped: int = 0
    env_build_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class CallInfraError(RuntimeError):
    """The node could not run the call (environment, child process): retried elsewhere."""


# ---------------------------------------------------------------------------------------------
# Process trees and call directories
# ---------------------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            # the command name may hold spaces and parentheses: fields start after the last ')'
            ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[ppid].append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), whatever session or group it is in."""
    tree = _children_map()
    out, todo = [], list(tree.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, ()))
    return out


def kill_tree(pid: int, *, include_root: bool = True, rounds: int = 5) -> int:
    """SIGKILLs ``pid``'s process group and every descendant, again until none is left (a
    forking process cannot outrun it: each round freezes what it finds first). Returns how many
    processes other than the root were found alive."""
    seen: set[int] = set()
    for _ in range(rounds):
        procs = descendants(pid)
        if include_root:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        seen.update(procs)
        time.sleep(0.01)
    return len(seen)


def call_dirs(root: str | None = None) -> list[str]:
    """The per-call temporary directories present under ``root`` (default: the temp dir)."""
    root = root or tempfile.gettempdir()
    try:
        return sorted(
            os.path.join(root, n) for n in os.listdir(root) if n.startswith(CALL_DIR_PREFIX)
        )
    except OSError:
        return []


def reap_stale_call_dirs(root: str | None = None) -> int:
    """Removes the call directories whose worker process is gone (a worker or node killed in
    the middle of a call: ``gagar_call_<pid>_...``); returns how many. Each node runs this
    before every call."""
    n = 0
    for path in call_dirs(root):
        try:
            pid = int(os.path.basename(path)[len(CALL_DIR_PREFIX) :].split("_", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # its worker is alive: the call is running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        n += not os.path.exists(path)
    return n


# The program of a call's child process (``python -c``: it imports nothing of this package
# unless the call does, so a call that runs little starts fast). It dies with its parent (the
# Ray worker: PR_SET_PDEATHSIG), runs the pickled call and pickles the result (plain pickle;
# ray's cloudpickle for what that cannot do).
_CHILD_CODE = """
import ctypes, os, pickle, signal, sys, traceback
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
except (OSError, AttributeError):
    pass
payload, out, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
if os.getppid() != parent:
    os._exit(1)
with open(payload, "rb") as f:
    fn, args, kwargs = pickle.load(f)
try:
    result = ("ok", fn(*args, **kwargs))
except BaseException as e:
    result = ("raised", f"{type(e).__name__}: {e}\\n{traceback.format_exc()[-2000:]}")
try:
    data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
except Exception:
    from ray import cloudpickle
    data = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
with open(out + ".tmp", "wb") as f:
    f.write(data)
os.replace(out + ".tmp", out)
"""


def run_isolated(
    fn: Callable,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    deadline_s: float,
    env: EnvSpec | Sequence[EnvSpec] | None = None,
) -> dict[str, Any]:
    """Runs ``fn(*args, **kwargs)`` in a child process of its own session with a private
    ``TMPDIR``; kills its whole tree at ``deadline_s`` and removes the directory afterwards.

    Returns ``{"status": ok|timeout|raised, "value", "error", "reaped", "node_id",
    "env_build_s"}`` (``env_build_s``: seconds spent building ``env`` here, None if it was
    there). Raises
    :class:`CallInfraError` when the node could not run it (environment build failed, the
    child died without a result): the caller retries such calls elsewhere.
    """
    env_build_s = _ensure_envs(env)
    node_id = _node_id()
    reaped = reap_stale_call_dirs()
    calldir = tempfile.mkdtemp(prefix=f"{CALL_DIR_PREFIX}{os.getpid()}_")
    os.chmod(calldir, 0o711)  # sandbox uids traverse it to their workdirs below
    try:
        payload, out = os.path.join(calldir, "call.pkl"), os.path.join(calldir, "result.pkl")
        with open(payload, "wb") as f:
            f.write(_dumps((fn, tuple(args), dict(kwargs or {}))))
        log_path = os.path.join(calldir, "child.log")
        env_vars = dict(os.environ, TMPDIR=calldir)
        # the child imports what its caller imports (functions are pickled by reference)
        paths = [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]
        env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        relay = _TokenRelay.start(env_vars)
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _CHILD_CODE, payload, out, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env_vars,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=relay.child_fds if relay else (),
                )
            if relay:
                relay.child_started()
            timed_out = False
            try:
                proc.wait(timeout=deadline_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                reaped += kill_tree(proc.pid)
                proc.wait()
        finally:
            if relay:
                relay.close()
        if timed_out:
            return {
                "status": "timeout",
                "value": None,
                "reaped": reaped,
                "node_id": node_id,
                "env_build_s": env_build_s,
                "error": f"killed at its deadline of {deadline_s:g} s",
            }
        if not os.path.exists(out):
            with open(log_path, "rb") as f:
                tail = f.read()[-1500:].decode("utf-8", "replace")
            raise CallInfraError(f"call process exited {proc.returncode} without a result: {tail}")
        with open(out, "rb") as f:
            kind, value = pickle.load(f)
        if kind == "ok":
            return {
                "status": "ok",
                "value": value,
                "error": "",
                "reaped": reaped,
                "node_id": node_id,
                "env_build_s": env_build_s,
            }
        return {
            "status": "raised",
            "value": None,
            "error": value,
            "reaped": reaped,
            "node_id": node_id,
            "env_build_s": env_build_s,
        }
    finally:
        shutil.rmtree(calldir, ignore_errors=True)


def _dumps(obj: Any) -> bytes:
    """Plain pickle (the child then never imports ray); cloudpickle for what it cannot do
    (functions defined in ``__main__`` or a test, closures), when ray is installed."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in data:
            return data
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    from ray import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - an id for metrics only
        pass
    return ""


# ---------------------------------------------------------------------------------------------
# Environments on the nodes
# ---------------------------------------------------------------------------------------------
def env_cache_dir() -> str:
    """This node's environment cache (``GAGAR_ENV_CACHE``, default ``~/.cache/gagar_jax/envs``)."""
    return os.environ.get("GAGAR_ENV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "gagar_jax", "envs"
    )


def ensure_env(
    env_hash: str, build_fn: Callable[[str], Any], *, cache_dir: str | None = None
) -> str:
    """The directory of environment ``env_hash`` on this node, built by ``build_fn(path)`` the
    first time (``path`` is an empty directory, renamed into place only once ``build_fn``
    returns). Concurrent callers on the node (threads or processes: Ray workers) wait on a file
    lock and build it once; a failed build leaves nothing behind and raises, so the next call
    builds again."""
    return _ensure_env(env_hash, build_fn, cache_dir)[0]


def _ensure_env(env_hash: str, build_fn: Callable[[str], Any], cache_dir: str | None = None):
    """``ensure_env`` and the seconds this call spent building (None: it was there)."""
    if not env_hash or "/" in env_hash or env_hash.startswith("."):
        raise ValueError(f"ensure_env: env_hash must be a plain non-empty name, got {env_hash!r}")
    root = cache_dir or env_cache_dir()
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, env_hash)
    ready = path + ".ready"
    if os.path.exists(ready):
        return path, None
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(ready):
                return path, None  # built by another caller while this one waited
            t0 = time.monotonic()
            shutil.rmtree(path, ignore_errors=True)  # a build that died half-way
            tmp = tempfile.mkdtemp(prefix=f".{env_hash}.build-", dir=root)
            try:
                build_fn(tmp)
                os.chmod(tmp, 0o755)  # sandbox uids read the environment
                os.rename(tmp, path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with open(ready, "w") as f:
                f.write(f"{time.time()}\n")
            return path, time.monotonic() - t0
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_envs(env: EnvSpec | Sequence[EnvSpec] | None) -> float | None:
    """Ensures each environment a call names on this node; the seconds spent building (None:
    all were there). Raises :class:`CallInfraError` (retried elsewhere) when one fails."""
    specs = () if env is None else (env,) if isinstance(env, EnvSpec) else tuple(env)
    total = None
    for spec in specs:
        try:
            _, built = _ensure_env(spec.env_hash, spec.build)
        except Exception as e:  # noqa: BLE001 - the node's fault: retried elsewhere
            raise CallInfraError(
                f"environment {spec.env_hash} did not build on this node: {type(e).__name__}: {e}"
            ) from e
        if built is not None:
            total = (total or 0.0) + built
    return total


# ---------------------------------------------------------------------------------------------
# Repository snapshots on the nodes
# ---------------------------------------------------------------------------------------------
TREE_FILE = "files.pkl"


def tree_hash(files: Mapping[str, str]) -> str:
    """The content address of a repository's text (``{path: text}``): ``tree-`` and 32 hex
    digits of a SHA-256 over the sorted paths and their texts."""
    h = hashlib.sha256()
    for path in sorted(files):
        text = files[path].encode("utf-8", "surrogatepass")
        h.update(f"{path}\0{len(text)}\0".encode("utf-8", "surrogatepass"))
        h.update(text)
    return "tree-" + h.hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class TreeBuild:
    """Materialises a repository's text on a node (``build(path)`` of :func:`ensure_env`):
    fetched once per node from the cluster's object store (``ref``, put there by the trainer)
    and kept in the node's cache, so later calls for the same snapshot ship none of it."""

    ref: Any

    def __call__(self, path: str) -> None:
        import ray

        files = ray.get(self.ref)
        with open(os.path.join(path, TREE_FILE), "wb") as f:
            pickle.dump(dict(files), f, protocol=pickle.HIGHEST_PROTOCOL)


def with_task_tree(
    tree: str, cls: type, fields: Mapping[str, Any], fn: Callable, *args: Any, **kwargs: Any
) -> Any:
    """``fn(task, *args, **kwargs)`` with ``task = cls(files=<snapshot tree>, **fields)``, the
    files read from this node's copy of snapshot ``tree`` (made by the call's worker before
    this runs: :class:`TreeBuild`)."""
    path = os.path.join(env_cache_dir(), tree)
    if not os.path.exists(path + ".ready"):
        raise CallInfraError(f"repository snapshot {tree} is not on this node")
    with open(os.path.join(path, TREE_FILE), "rb") as f:
        files = pickle.load(f)
    return fn(cls(files=files, **fields), *args, **kwargs)


def with_task_env(env: EnvSpec, fn: Callable, task: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(task', *args, **kwargs)`` where ``task'`` is ``task`` with ``env_path`` pointing at
    this node's copy of environment ``env`` (:func:`ensure_env`: built once per node). The call
    a cluster back-end makes for a task whose environment was built on the trainer."""
    path = ensure_env(env.env_hash, env.build)
    return fn(dataclasses.replace(task, env_path=path), *args, **kwargs)


_ENV_RESOLVERS: list[Callable[[Any], EnvSpec | None]] = []


def register_env_resolver(fn: Callable[[Any], EnvSpec | None]) -> None:
    """Add ``fn(task) -> EnvSpec | None`` to the resolvers :func:`task_env` asks, in order.

    The package that builds task environments registers its own when it is imported
    (``gagar_jax.data.repos`` does), so this module needs no knowledge of how an environment is
    built. Registering the same function twice has no effect."""
    if fn not in _ENV_RESOLVERS:
        _ENV_RESOLVERS.append(fn)


def task_env(task: Any) -> EnvSpec | None:
    """The :class:`EnvSpec` of ``task``'s environment (``env_hash`` and how a node builds it),
    from the first registered resolver that knows it; None for a task without one.

    Raises ``LookupError`` when the task names an environment no resolver knows, and whatever
    the resolver raises when the task's environment record cannot be read (for
    ``gagar_jax.data.repos``: ``EnvBuildError``)."""
    h = getattr(task, "env_hash", "") or ""
    if not h:
        return None
    for fn in _ENV_RESOLVERS:
        spec = fn(task)
        if spec is not None:
            return spec
    raise LookupError(
        f"task.env_hash={h!r}: no environment resolver is registered "
        "(import gagar_jax.data.repos, which registers the one for uv environments)"
    )


# ---------------------------------------------------------------------------------------------
# Rate limit for LLM-grader requests
# ---------------------------------------------------------------------------------------------
class TokenBucket:
    """``rate`` requests per second with bursts of ``burst``: :meth:`reserve` returns how long
    the caller must wait before its request (reservations are handed out in order)."""

    def __init__(self, rate: float, burst: int = 1):
        if not rate > 0:
            raise ValueError(f"TokenBucket.rate must be > 0 requests/s, got {rate!r}")
        if not (isinstance(burst, int) and burst >= 1):
            raise ValueError(f"TokenBucket.burst must be an int >= 1, got {burst!r}")
        self.rate, self.burst = float(rate), burst
        self._tokens = float(burst)
        self._t = time.monotonic()
        self._lock = threading.Lock()
        self.granted = 0

    def reserve(self, n: int = 1) -> float:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            self.granted += n
            return max(0.0, -self._tokens / self.rate)

    def stats(self) -> dict[str, float]:
        return {"granted": self.granted, "rate": self.rate}


_LOCAL_LIMITER: TokenBucket | None = None
_LIMIT_FD_ENV = "GAGAR_LLM_LIMIT_FD"
_RELAY_LOCK = threading.Lock()


class _TokenRelay:
    """Serves the cluster-wide limiter to a call's child process (which is not connected to
    Ray) over a socket pair: the child writes ``n``, the worker answers the wait in seconds."""

    def __init__(self, limiter):
        import socket

        self.limiter = limiter
        self.parent, self.child = socket.socketpair()
        self.child_fds = (self.child.fileno(),)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @classmethod
    def start(cls, env_vars: dict) -> _TokenRelay | None:
        limiter = _ray_limiter()
        if limiter is None:
            return None
        relay = cls(limiter)
        env_vars[_LIMIT_FD_ENV] = str(relay.child.fileno())
        return relay

    def child_started(self) -> None:
        self.child.close()
        self.thread.start()

    def _serve(self) -> None:
        import ray

        f = self.parent.makefile("rwb", buffering=0)
        try:
            for line in f:
                try:
                    wait = ray.get(self.limiter.reserve.remote(max(1, int(line))))
                except Exception:  # noqa: BLE001 - limiter gone: no wait, never a hung grader
                    wait = 0.0
                f.write(f"{wait}\n".encode())
        except OSError:
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.parent.close()
        with contextlib.suppress(OSError):
            self.child.close()


def llm_rate_limit(n: int = 1) -> float:
    """Waits for ``n`` LLM-grader request tokens: from the cluster-wide limiter when this
    process runs a call of a Ray cluster that has one, else from the process's own (set by
    :func:`use` from ``llm_requests_per_s``; none: no wait). Returns the seconds waited."""
    wait = 0.0
    fd = os.environ.get(_LIMIT_FD_ENV)
    limiter = None if fd else _ray_limiter()
    if fd:
        import socket

        with _RELAY_LOCK:  # one request at a time on the relay
            sock = socket.socket(fileno=os.dup(int(fd)))
            try:
                sock.sendall(f"{n}\n".encode())
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = sock.recv(64)
                    if not chunk:
                        raise OSError("the worker closed the rate-limit relay")
                    buf += chunk
                wait = float(buf)
            finally:
                sock.close()
    elif limiter is not None:
        import ray

        try:
            wait = ray.get(limiter.reserve.remote(n))
        except Exception:  # noqa: BLE001 - the limiter went away: no wait
            wait = 0.0
    elif _LOCAL_LIMITER is not None:
        wait = _LOCAL_LIMITER.reserve(n)
    if wait > 0:
        time.sleep(wait)
    return wait


def _ray_limiter():
    """The cluster's limiter actor, when this process is connected to a cluster that has one
    (looked up on each call: it may be started or stopped by another back-end)."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(LLM_LIMITER_NAME, namespace=RAY_NAMESPACE)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Back-ends
# ---------------------------------------------------------------------------------------------
class _Stats:
    """Per-step counters (``metrics(reset=True)`` starts the next step)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inflight = 0
        self.reset()

    def reset(self):
        self.calls = self.retries = self.node_losses = self.reaped = 0
        self.timeouts = self.infra_errors = self.admission_waits = 0
        self.admission_wait_s = 0.0
        self.env_builds = 0
        self.env_build_s = 0.0
        self.waits: list[float] = []
        self.runs: list[float] = []
        self.max_inflight = self.inflight

    def done(self, r: CallResult):
        with self.lock:
            self.calls += 1
            self.waits.append(r.queue_wait_s)
            self.runs.append(r.run_s)
            self.reaped += r.reaped
            self.timeouts += r.status == "timeout"
            self.infra_errors += r.status == "infra_error"
            if r.env_build_s is not None:
                self.env_builds += 1
                self.env_build_s += r.env_build_s

    def metrics(self, reset: bool) -> dict[str, float]:
        with self.lock:
            w = self.waits
            out = {
                "execution/calls": float(self.calls),
                "execution/calls_in_flight": float(self.inflight),
                "execution/calls_in_flight_max": float(self.max_inflight),
                "execution/queue_wait_s": sum(w) / len(w) if w else 0.0,
                "execution/queue_wait_max_s": max(w) if w else 0.0,
                "execution/run_s": sum(self.runs) / len(self.runs) if self.runs else 0.0,
                "execution/retries": float(self.retries),
                "execution/node_losses": float(self.node_losses),
                "execution/orphans_reaped": float(self.reaped),
                "execution/timeouts": float(self.timeouts),
                "execution/infra_errors": float(self.infra_errors),
                "execution/admission_waits": float(self.admission_waits),
                "execution/admission_wait_s": float(self.admission_wait_s),
                "execution/env_builds": float(self.env_builds),
                "execution/env_build_s": float(self.env_build_s),
            }
            if reset:
                self.reset()
            return out


class Backend:
    """The interface the call sites use (see the module docstring)."""

    name = ""
    # where a verification's tests run (``execution.environment``): "uv" (the bwrap sandbox
    # with the task's virtual environment) or "container" (``verify.container``); a task that
    # names an image or a Dockerfile runs in its container under either
    environment = "uv"
    container_image = ""  # the image of tasks without their own ("" = container.DEFAULT_IMAGE)

    def call(
        self,
        fn: Callable,
        *args: Any,
        deadline_s: float = 600.0,
        resources: CallResources | None = None,
        env: EnvSpec | None = None,
        kind: str = "verify",
        **kwargs: Any,
    ) -> CallResult:
        """Runs ``fn(*args, **kwargs)`` and waits for its :class:`CallResult`."""
        return self.submit(
            fn, *args, deadline_s=deadline_s, resources=resources, env=env, kind=kind, **kwargs
        ).result()

    def submit(
        self,
        fn: Callable,
        *args: Any,
        deadline_s: float = 600.0,
        resources: CallResources | None = None,
        env: EnvSpec | None = None,
        kind: str = "verify",
        **kwargs: Any,
    ) -> concurrent.futures.Future:
        raise NotImplementedError

    def gather(self, thunks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Runs the thunks (each may make calls) and returns their values in order."""
        return [t() for t in thunks]

    def gather_groups(
        self,
        groups: Sequence[Sequence[Callable[[], Any]]],
        *,
        grader: int = 0,
        keys: Sequence[str] | None = None,
    ) -> list[list[Any]]:
        """Runs each group's thunks once the group is admitted (:meth:`admit`: its K slots,
        and ``grader`` grader slots); values per group, in order, every member present.

        ``keys`` (one per group, its group id): each group's grader slots stay held after the
        call, under its key, until :meth:`release_grader` (the group was graded or dropped);
        without keys they are held while the group verifies."""
        if keys is not None and len(keys) != len(groups):
            raise ValueError(f"gather_groups: {len(keys)} keys for {len(groups)} groups")
        out = []
        for i, thunks in enumerate(groups):
            with self.admit(len(thunks), grader, key=None if keys is None else keys[i]):
                out.append(self.gather(thunks))
        return out

    @contextlib.contextmanager
    def admit(
        self,
        slots: int,
        grader: int = 0,
        timeout: float | None = None,
        *,
        key: str | None = None,
        batch: Any = None,
    ) -> Iterator[None]:
        """Reserves ``slots`` verifier slots and ``grader`` grader slots for one group, both or
        neither; the verifier slots for the block, the grader slots for the block too or,
        with ``key``, until :meth:`release_grader`. ``batch``: groups of one batch never wait
        for grader slots held by each other. (Local: calls run one at a time; nothing to
        reserve.)"""
        yield

    def release_grader(self, keys: str | Sequence[str]) -> int:
        """Frees the grader slots held under ``keys`` (group ids; unknown ones are ignored);
        returns how many."""
        return 0

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """This step's counters (``execution/*``); ``reset`` starts the next step."""
        out = self._stats.metrics(reset)
        out["execution/grader_slots_held"] = float(self.grader_slots_held())
        return out

    def grader_slots_held(self) -> int:
        """Grader slots held now by admitted groups."""
        return 0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalBackend(Backend):
    """Calls in the caller's thread (today's behaviour). With ``isolate``, each call runs in a
    child process killed at its deadline, as on a Ray node (needs ``ray`` for cloudpickle)."""

    name = "local"

    def __init__(
        self, *, isolate: bool = False, llm_requests_per_s: float = 0.0, llm_burst: int = 1
    ):
        self.isolate = isolate
        self._stats = _Stats()
        self.limiter = TokenBucket(llm_requests_per_s, llm_burst) if llm_requests_per_s else None

    def submit(
        self, fn, *args, deadline_s=600.0, resources=None, env=None, kind="verify", **kwargs
    ):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self._run(fn, args, kwargs, deadline_s, env))
        return fut

    def _run(self, fn, args, kwargs, deadline_s, env) -> CallResult:
        t0 = time.monotonic()
        with self._stats.lock:
            self._stats.inflight += 1
            self._stats.max_inflight = max(self._stats.max_inflight, self._stats.inflight)
        try:
            if self.isolate:
                try:
                    d = run_isolated(fn, args, kwargs, deadline_s=deadline_s, env=env)
                except CallInfraError as e:
                    r = CallResult("infra_error", error=str(e), run_s=time.monotonic() - t0)
                else:
                    status = "infra_error" if d["status"] == "raised" else d["status"]
                    r = CallResult(
                        status,
                        d["value"],
                        d["error"],
                        reaped=d["reaped"],
                        run_s=time.monotonic() - t0,
                        env_build_s=d["env_build_s"],
                    )
            else:
                try:
                    built = _ensure_envs(env)
                    r = CallResult(
                        "ok", fn(*args, **kwargs), run_s=time.monotonic() - t0, env_build_s=built
                    )
                except Exception as e:  # noqa: BLE001 - a call bug is masked, never scored
                    r = CallResult(
                        "infra_error", error=f"{type(e).__name__}: {e}", run_s=time.monotonic() - t0
                    )
        finally:
            with self._stats.lock:
                self._stats.inflight -= 1
        self._stats.done(r)
        return r


# The Ray side: one remote function, options set per call.
_REMOTE = None


def _remote_fn():
    global _REMOTE
    if _REMOTE is None:
        import ray

        @ray.remote(max_retries=0)
        def _ray_call(fn, args, kwargs, deadline_s, env):
            return run_isolated(fn, args, kwargs, deadline_s=deadline_s, env=env)

        _REMOTE = _ray_call
    return _REMOTE


def _limiter_actor_cls():
    import ray

    @ray.remote(num_cpus=0, max_restarts=-1)
    class _LimiterActor:
        def __init__(self, rate, burst):
            self.bucket = TokenBucket(rate, burst)

        def reserve(self, n=1):
            return self.bucket.reserve(n)

        def stats(self):
            return self.bucket.stats()

    return _LimiterActor


@dataclasses.dataclass
class _Call:
    fn: Callable
    args: tuple
    kwargs: dict
    deadline_s: float
    resources: CallResources
    env: EnvSpec | tuple[EnvSpec, ...] | None
    kind: str
    future: concurrent.futures.Future
    submitted: float
    attempts: int = 0
    dispatched: float = 0.0
    started: float = 0.0
    ref: Any = None


# Ray errors that mean the node or worker (not the call) failed: the call is submitted again.
_RETRYABLE_NAMES = (
    "WorkerCrashedError",
    "NodeDiedError",
    "ObjectLostError",
    "OwnerDiedError",
    "LocalRayletDiedError",
    "RaySystemError",
    "RuntimeEnvSetupError",
    "ObjectFetchTimedOutError",
    "OutOfMemoryError",
    "TaskUnschedulableError",
)


class RayBackend(Backend):
    """Calls as Ray tasks (see the module docstring).

    Args:
      ray_address: ``"auto"`` (a running cluster), ``"local"`` (start a one-machine cluster in
        this process), or a cluster address (``host:port``, ``ray://host:10001``). Ignored when
        this process is already connected.
      max_inflight: calls submitted to Ray at once (the rest wait).
      max_retries: extra attempts of a call whose node or worker failed.
      resources: default resources of a call (a call may pass its own).
      deadline_grace_s: how long after its deadline the driver cancels a call that the node did
        not end (a wedged worker).
      llm_requests_per_s, llm_burst: the global LLM-grader rate limit (0: none).
      grader_slots: groups that may hold a grader slot at once, from admission until they
        are graded or dropped (:meth:`admit`; 0: no grader budget).
      object_store_memory: object store bytes when ``ray_address="local"`` starts a cluster.
    """

    name = "ray"

    def __init__(
        self,
        ray_address: str = "auto",
        *,
        max_inflight: int = 64,
        max_retries: int = 3,
        resources: CallResources | None = None,
        deadline_grace_s: float = 10.0,
        llm_requests_per_s: float = 0.0,
        llm_burst: int = 1,
        grader_slots: int = 0,
        object_store_memory: int = 100 << 20,
        runtime_env: Mapping | None = None,
    ):
        import ray

        if not (isinstance(max_inflight, int) and max_inflight >= 1):
            raise ValueError(f"RayBackend.max_inflight must be an int >= 1, got {max_inflight!r}")
        if not (isinstance(max_retries, int) and max_retries >= 0):
            raise ValueError(f"RayBackend.max_retries must be an int >= 0, got {max_retries!r}")
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"namespace": RAY_NAMESPACE, "log_to_driver": False}
            if runtime_env:
                kw["runtime_env"] = dict(runtime_env)
            if ray_address == "local":
                ray.init(include_dashboard=False, object_store_memory=object_store_memory, **kw)
            else:
                ray.init(address=ray_address, **kw)
            self._owns_ray = True
        self.max_inflight = max_inflight
        self.max_retries = max_retries
        self.resources = resources or CallResources()
        self.deadline_grace_s = float(deadline_grace_s)
        self.grader_slots = grader_slots
        self._stats = _Stats()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Call] = collections.deque()
        self._inflight: dict[Any, _Call] = {}
        self._reserved = 0
        self._grading = 0  # grading calls in flight (a metric)
        self._held: dict[str, tuple[int, Any]] = {}  # group key -> (grader slots, batch)
        self._anon = itertools.count()  # keys of holds that end with their block
        # repository snapshots put in the object store (tree hash -> EnvSpec), and the
        # snapshot of each files mapping seen (id -> (mapping, spec)): both bounded
        self._trees: collections.OrderedDict[str, EnvSpec] = collections.OrderedDict()
        self._tree_of: collections.OrderedDict[int, tuple] = collections.OrderedDict()
        self._closed = False
        self._known_dead: set[str] = set()
        self._count_node_losses()  # nodes dead before this back-end started are not its losses
        self._stats.node_losses = 0
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(4, max_inflight), thread_name_prefix="gagar-exec"
        )
        self.limiter = None
        # the limiter is the cluster's: several trainer hosts share the first one's; only the
        # back-end that created it stops it
        self._created_limiter = bool(llm_requests_per_s) and _ray_limiter() is None
        if llm_requests_per_s:
            self.limiter = (
                _limiter_actor_cls()
                .options(
                    name=LLM_LIMITER_NAME,
                    namespace=RAY_NAMESPACE,
                    get_if_exists=True,
                )
                .remote(llm_requests_per_s, llm_burst)
            )
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="gagar-exec-ray", daemon=True
        )
        self._dispatcher.start()

    # -- public API --------------------------------------------------------------------------
    def submit(
        self, fn, *args, deadline_s=600.0, resources=None, env=None, kind="verify", **kwargs
    ):
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        c = _Call(
            fn,
            tuple(args),
            dict(kwargs),
            float(deadline_s),
            resources or self.resources,
            env,
            kind,
            fut,
            time.monotonic(),
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("RayBackend.submit after close()")
            self._queue.append(c)
            if kind == "grade":
                self._grading += 1
            self._cond.notify_all()
        return fut

    def gather(self, thunks):
        futs = [self._threads.submit(t) for t in thunks]
        return [f.result() for f in futs]

    def gather_groups(self, groups, *, grader: int = 0, keys=None):
        if keys is not None and len(keys) != len(groups):
            raise ValueError(f"gather_groups: {len(keys)} keys for {len(groups)} groups")
        batch = object()  # this call's groups never wait for each other's grader slots

        def one(i, thunks):
            key = None if keys is None else keys[i]
            with self.admit(len(thunks), grader, key=key, batch=batch):
                return self.gather(thunks)

        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(len(groups), 64)), thread_name_prefix="gagar-exec-group"
        ) as pool:
            futs = [pool.submit(one, i, list(t)) for i, t in enumerate(groups)]
            out = [f.result() for f in futs]
        for thunks, values in zip(groups, out):  # no group is ever scored with a member missing
            if len(values) != len(thunks):
                raise RuntimeError(f"a group returned {len(values)} of {len(thunks)} members")
        return out

    def _grader_busy(self, batch: Any) -> int:
        """Grader slots held by groups outside ``batch`` (lock held)."""
        return sum(n for n, b in self._held.values() if batch is None or b is not batch)

    @contextlib.contextmanager
    def admit(self, slots, grader=0, timeout=None, *, key=None, batch=None):
        if slots > self.max_inflight:
            raise ValueError(
                f"a group of {slots} calls can never be admitted with "
                f"execution.max_inflight={self.max_inflight}"
            )
        if grader and self.grader_slots and grader > self.grader_slots:
            raise ValueError(
                f"a group needing {grader} grader slots can never be admitted with "
                f"grader_slots={self.grader_slots}"
            )
        end = None if timeout is None else time.monotonic() + timeout
        t0 = time.monotonic()
        waited = False
        with self._cond:
            while not (
                self._reserved + slots <= self.max_inflight
                and (
                    not grader
                    or not self.grader_slots
                    or self._grader_busy(batch) + grader <= self.grader_slots
                )
            ):
                waited = True
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"no {slots} verifier slots and {grader} grader slots within {timeout} s"
                    )
                self._cond.wait(left if left is not None else 0.5)
            self._reserved += slots
            hold = f"\0{next(self._anon)}" if key is None else str(key)
            grader = grader if self.grader_slots else 0  # no budget: nothing to hold
            if grader:
                n, _ = self._held.get(hold, (0, None))
                self._held[hold] = (n + grader, batch)
        if waited:
            with self._stats.lock:
                self._stats.admission_waits += 1
                self._stats.admission_wait_s += time.monotonic() - t0
        try:
            yield
        finally:
            with self._cond:
                self._reserved -= slots
                if grader and key is None:
                    self._held.pop(hold, None)
                self._cond.notify_all()

    def release_grader(self, keys):
        keys = [keys] if isinstance(keys, str) else list(keys)
        with self._cond:
            n = sum(self._held.pop(str(k), (0, None))[0] for k in keys)
            if n:
                self._cond.notify_all()
        return n

    def grader_slots_held(self) -> int:
        with self._cond:
            return self._grader_busy(None)

    MAX_TREES = 1024  # snapshots kept in the object store (the least recently used go first)

    def share_tree(self, files: Mapping[str, str]) -> EnvSpec:
        """The snapshot ``files`` (a repository's text) as an environment the nodes
        materialise once each (:class:`TreeBuild`): put in the cluster's object store once per
        content hash, so a call ships its hash instead of the repository."""
        with self._cond:
            seen = self._tree_of.get(id(files))
            if seen is not None and seen[0] is files:
                self._tree_of.move_to_end(id(files))
                return seen[1]
        h = tree_hash(files)
        with self._cond:
            spec = self._trees.get(h)
        if spec is None:
            spec = EnvSpec(h, TreeBuild(self._ray.put(dict(files))))
        with self._cond:
            spec = self._trees.setdefault(h, spec)
            self._trees.move_to_end(h)
            self._tree_of[id(files)] = (files, spec)
            while len(self._trees) > self.MAX_TREES:  # a call in flight keeps its own ref
                self._trees.popitem(last=False)
            while len(self._tree_of) > 4 * self.MAX_TREES:
                self._tree_of.popitem(last=False)
        return spec

    def metrics(self, reset: bool = True) -> dict[str, float]:
        self._count_node_losses()  # nodes the cluster declared dead since the last look
        return super().metrics(reset)

    def limiter_stats(self) -> dict[str, float]:
        return {} if self.limiter is None else self._ray.get(self.limiter.stats.remote())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._queue) + list(self._inflight.values())
            self._queue.clear()
            self._held.clear()
            self._cond.notify_all()
        for c in pending:
            if c.ref is not None:
                with contextlib.suppress(Exception):
                    self._ray.cancel(c.ref, force=True)
            self._resolve(
                c, CallResult("infra_error", error="back-end closed", attempts=c.attempts)
            )
        self._dispatcher.join(timeout=10)
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.limiter is not None and self._created_limiter:
            with contextlib.suppress(Exception):
                self._ray.kill(self.limiter)
        if self._owns_ray:
            self._ray.shutdown()

    # -- dispatcher --------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        ray = self._ray
        while True:
            with self._cond:
                while not self._closed and not self._queue and not self._inflight:
                    self._cond.wait(0.5)
                if self._closed:
                    return
                while self._queue and len(self._inflight) < self.max_inflight:
                    self._try_start(self._queue.popleft())
                refs = list(self._inflight)
            if not refs:
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.05)
                if ready:  # collect every other finished one too
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            except Exception:  # noqa: BLE001 - a transient GCS hiccup: look again
                time.sleep(0.5)
                continue
            for ref in ready:
                with self._cond:
                    c = self._inflight.pop(ref, None)
                if c is not None:
                    self._finish(c, ref)
            self._check_deadlines()

    def _try_start(self, c: _Call) -> None:
        """``_start``, a call that cannot be submitted (arguments that do not pickle) ending
        as ``infra_error`` instead of the dispatcher (lock held)."""
        try:
            self._start(c)
        except Exception as e:  # noqa: BLE001 - the dispatcher must never die
            self._inflight.pop(c.ref, None)
            self._resolve(
                c,
                CallResult(
                    "infra_error",
                    error=f"cannot submit the call: {type(e).__name__}: {str(e)[:1000]}",
                    attempts=c.attempts,
                ),
            )

    def _start(self, c: _Call) -> None:
        """Submits one attempt (lock held)."""
        c.attempts += 1
        if c.attempts == 1:
            c.dispatched = time.monotonic()
        opts = c.resources.ray_options()
        c.ref = _remote_fn().options(**opts).remote(c.fn, c.args, c.kwargs, c.deadline_s, c.env)
        c.started = time.monotonic()
        self._inflight[c.ref] = c
        with self._stats.lock:
            self._stats.inflight = len(self._inflight)
            self._stats.max_inflight = max(self._stats.max_inflight, len(self._inflight))

    def _finish(self, c: _Call, ref) -> None:
        ray = self._ray
        try:
            d = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - sorted below
            self._failed(c, e)
            return
        status = "infra_error" if d["status"] == "raised" else d["status"]
        self._resolve(
            c,
            CallResult(
                status,
                d["value"],
                d["error"],
                c.attempts,
                d["node_id"],
                reaped=d["reaped"],
                env_build_s=d.get("env_build_s"),
            ),
        )

    def _failed(self, c: _Call, e: BaseException) -> None:
        retryable = _is_retryable(e)
        if retryable:
            self._count_node_losses()
        if retryable and c.attempts <= self.max_retries and not self._closed:
            with self._stats.lock:
                self._stats.retries += 1
            with self._cond:
                self._try_start(c)
            return
        what = "retries exhausted" if retryable else "the call raised"
        self._resolve(
            c,
            CallResult(
                "infra_error",
                error=f"{what} after {c.attempts} attempt(s): {type(e).__name__}: {str(e)[:1500]}",
                attempts=c.attempts,
            ),
        )

    def _count_node_losses(self) -> None:
        try:
            dead = {n["NodeID"] for n in self._ray.nodes() if not n.get("Alive", True)}
        except Exception:  # noqa: BLE001 - metrics only
            return
        new = dead - self._known_dead
        self._known_dead |= dead
        if new:
            with self._stats.lock:
                self._stats.node_losses += len(new)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        with self._cond:
            late = [
                c
                for c in self._inflight.values()
                if now - c.started > c.deadline_s + self.deadline_grace_s
            ]
            for c in late:
                self._inflight.pop(c.ref, None)
        for c in late:
            with contextlib.suppress(Exception):
                self._ray.cancel(c.ref, force=True)
            self._resolve(
                c,
                CallResult(
                    "timeout",
                    error=f"no result {c.deadline_s + self.deadline_grace_s:g} s after "
                    "dispatch: the worker was killed",
                    attempts=c.attempts,
                ),
            )

    def _resolve(self, c: _Call, r: CallResult) -> None:
        now = time.monotonic()
        r = dataclasses.replace(
            r, queue_wait_s=(c.dispatched or now) - c.submitted, run_s=now - (c.dispatched or now)
        )
        with self._cond:
            if c.kind == "grade" and not c.future.done():
                self._grading -= 1
            with self._stats.lock:
                self._stats.inflight = len(self._inflight)
            self._cond.notify_all()
        if not c.future.done():
            self._stats.done(r)
            c.future.set_result(r)


def _is_retryable(e: BaseException) -> bool:
    import ray.exceptions as rex

    if isinstance(e, CallInfraError):  # (Ray's RayTaskError subclasses the task's exception)
        return True  # the node could not prepare or run the call: retried elsewhere
    if isinstance(e, rex.RayTaskError):
        return isinstance(getattr(e, "cause", None), CallInfraError)
    return type(e).__name__ in _RETRYABLE_NAMES or isinstance(
        e, rex.WorkerCrashedError | rex.NodeDiedError | rex.ObjectLostError | rex.OwnerDiedError
    )


# ---------------------------------------------------------------------------------------------
# The process's back-end
# ---------------------------------------------------------------------------------------------
_CURRENT: Backend | None = None


def current() -> Backend:
    """The back-end the call sites use (a :class:`LocalBackend` unless :func:`use` set one)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = LocalBackend()
    return _CURRENT


def use(backend: Backend | None) -> Backend | None:
    """Makes ``backend`` the process's back-end (None: back to local); returns the previous."""
    global _CURRENT, _LOCAL_LIMITER
    prev, _CURRENT = _CURRENT, backend
    _LOCAL_LIMITER = (
        getattr(backend, "limiter", None) if isinstance(backend, LocalBackend) else None
    )
    return prev


@contextlib.contextmanager
def using(backend: Backend) -> Iterator[Backend]:
    """``use(backend)`` for the duration of a block."""
    prev = use(backend)
    try:
        yield backend
    finally:
        use(prev)


def attach_grading(pool: Any, backend: Backend) -> bool:
    """Lets ``pool`` (a ``grading.GradingPool``) run its grader through ``backend`` when that is
    a cluster and the grader can be shipped (pickled); True if it does."""
    if backend.name == "local":
        return False
    try:
        _dumps(pool.grader)
    except Exception:  # noqa: BLE001 - graders holding locks or sockets grade in the trainer
        return False
    pool.backend = backend
    return True


def make_backend(
    backend: str = "local",
    *,
    ray_address: str = "auto",
    max_inflight: int = 64,
    max_retries: int = 3,
    num_cpus: float = 1.0,
    memory: int = 0,
    resources: Mapping[str, float] | None = None,
    deadline_grace_s: float = 10.0,
    llm_requests_per_s: float = 0.0,
    grader_slots: int = 0,
    environment: str = "uv",
    container_image: str = "",
) -> Backend:
    """A back-end from plain settings (the run config's ``execution`` section)."""
    if backend not in BACKENDS:
        raise ValueError(f"execution.backend must be one of {BACKENDS}, got {backend!r}")
    if environment not in ("uv", "container"):
        raise ValueError(f"execution.environment must be uv|container, got {environment!r}")
    if backend == "local":
        b: Backend = LocalBackend(llm_requests_per_s=llm_requests_per_s)
    else:
        b = _ray_backend(
            ray_address,
            max_inflight,
            max_retries,
            num_cpus,
            memory,
            resources,
            deadline_grace_s,
            llm_requests_per_s,
            grader_slots,
        )
    b.environment, b.container_image = environment, container_image
    return b


def _ray_backend(
    ray_address,
    max_inflight,
    max_retries,
    num_cpus,
    memory,
    resources,
    deadline_grace_s,
    llm_requests_per_s,
    grader_slots,
) -> Backend:
    return RayBackend(
        ray_address,
        max_inflight=max_inflight,
        max_retries=max_retries,
        resources=CallResources(num_cpus, memory, dict(resources or {})),
        deadline_grace_s=deadline_grace_s,
        llm_requests_per_s=llm_requests_per_s,
        grader_slots=grader_slots,
    )


# ---------------------------------------------------------------------------------------------
# Call sites: the repository verifier through the back-end
# ---------------------------------------------------------------------------------------------
def container_settings(task: Any, b: Backend) -> dict[str, Any]:
    """``verify_repo_patch``'s ``environment``/``container`` arguments under back-end ``b``
    (its ``execution.environment`` and ``container_image``); {} for the defaults."""
    env = getattr(b, "environment", "uv")
    if env == "uv":
        return {}
    out: dict[str, Any] = {"environment": env}
    image = getattr(b, "container_image", "")
    if image and not (getattr(task, "image", "") or getattr(task, "dockerfile", "")):
        from gagar_jax.verify.container import ContainerSpec

        out["container"] = ContainerSpec(image=image)
    return out


CALL_MARGIN_S = 30.0  # a call's deadline beyond its sandbox's wall limit (setup, pytest start)


def verify_repo_call(
    task: Any,
    patch: str,
    *,
    backend: Backend | None = None,
    deadline_s: float | None = None,
    fn: Callable | None = None,
    env: EnvSpec | None = None,
    **kwargs: Any,
):
    """``verify.repo.verify_repo_patch(task, patch, **kwargs)`` through the back-end.

    The call's deadline (``deadline_s``) defaults to the sandbox's wall limit plus
    :data:`CALL_MARGIN_S`. A call that passes it is the rollout's own ``timeout`` failure (the
    sandbox should have ended it first: something of the candidate's hung); an infrastructure
    failure is ``infra_error`` (masked). ``fn`` replaces ``verify_repo_patch`` (same
    signature); ``env``: a task environment the call needs on its node.

    On a cluster back-end, a task with an environment (``env_hash``: a real package's
    dependencies, built on the trainer by ``data.repos.build_env``) is verified against the
    node's own copy of it: the node builds it from the recorded lockfile once, under a lock
    (:func:`ensure_env`), and every later call there reuses it. The task's repository text goes
    the same way (:meth:`RayBackend.share_tree`): into the object store once, materialised on
    each node once, and each call carries its hash and the patch.
    """
    limits = kwargs.get("limits") or DEFAULT_LIMITS
    b = backend or current()
    if fn is None and "environment" not in kwargs and "container" not in kwargs:
        kwargs.update(container_settings(task, b))
    deadline = deadline_s if deadline_s is not None else limits.wall_s + CALL_MARGIN_S
    call_fn, envs, r = fn or verify_repo_patch, [] if env is None else [env], None
    if env is None and b.name != "local" and getattr(task, "env_hash", ""):
        try:
            spec = task_env(task)
        except Exception as e:  # noqa: BLE001 - the trainer's record: never the candidate's
            r = CallResult("infra_error", error=f"{type(e).__name__}: {e}")
        else:
            envs.append(spec)
            call_fn = functools.partial(with_task_env, spec, call_fn)
    args: tuple = (task, patch)
    share = getattr(b, "share_tree", None)
    if r is None and share is not None and dataclasses.is_dataclass(task) and task.files:
        # the repository travels once per node (its snapshot), not with every call
        tree = share(task.files)
        envs.insert(0, tree)
        fields = {
            f.name: getattr(task, f.name)
            for f in dataclasses.fields(task)
            if f.init and f.name != "files"
        }
        call_fn = functools.partial(with_task_tree, tree.env_hash, type(task), fields, call_fn)
        args = (patch,)
    if r is None:
        r = b.call(call_fn, *args, deadline_s=deadline, env=tuple(envs) or None, **kwargs)
    if r.ok:
        return r.value
    missing = {t: "missing" for t in task.required_tests}
    return RepoVerification(r.status, missing, None, (), f"{r.status}: {r.error}", None)
