"""Sandboxed execution of untrusted commands (model-written code and its tests).

``run_sandboxed(argv, workdir, limits)`` runs ``argv`` with ``workdir`` as its only writable
directory and returns a ``SandboxResult`` whose ``status`` is one of

  passed           exit status 0
  failed           any other exit status of the command itself
  timeout          the wall-clock limit was hit; every descendant was killed
  resource_killed  ended unsuccessfully with a limit seen to fire (CPU seconds, file size, memory
                   cgroup OOM, pids), or by SIGKILL that was not ours
  infra_error      the sandbox itself did not start (never the code's fault: mask, don't score)

The chain is built as one argv (no ``preexec_fn``: unsafe in the threaded JAX trainer), strongest
mechanism first, following the measurements in ``shared/SANDBOX.md``::

  [sh: join per-slot cgroups pids + memory]                          (bwrap+cgroup only)
  prlimit --cpu --as --fsize --nofile --nproc --core=0 --             (every mechanism)
  setpriv --reuid U --regid U --clear-groups --no-new-privs --        (when started as root)
  [unshare -m; mount --bind PRIVATE VIEW]      (bwrap, only for a bind source under a 0700 dir)
  bwrap --unshare-all --disable-userns --as-pid-1 --seccomp FD --die-with-parent --new-session
        <minimal ro view> --tmpfs /tmp, /dev read-only with a capped /dev/shm ...
        [--size DISK --tmpfs /workdir; the tree bound read-only and copied in] (private_workdir)
      | unshare -Urnpfm --mount-proc --kill-child                      (fallback)
  sh -c 'printf S >&0; exec 0</dev/null; exec "$@"' CMD...  (start marker into a root-owned pipe)

Mechanisms, in the measured order: ``bwrap+cgroup``, ``bwrap``, ``unshare``, ``rlimits`` (uid drop
and rlimits only: no network or filesystem isolation, reported in ``isolation``), and ``none``,
which is refused unless ``SandboxConfig(allow_unisolated=True)``.

What each mechanism contains and what it does not (the containment probes asserted per
mechanism in ``tests/test_verify_sandbox*.py`` and ``tests/attacks/``) is set out in the threat
model, ``docs/threat_model.md``. In short: ``rlimits`` has no network, filesystem or PID
isolation; ``unshare`` has no filesystem isolation and no seccomp filter; ``bwrap`` without a
known syscall table runs unfiltered. With ``private_workdir`` (bwrap only) the work tree is a
tmpfs of ``disk_bytes``, a hard quota; otherwise the quota is accounting (a walk every 0.1 s
that files unlinked while open escape). Memory of a tmpfs counts against the memory cgroup only
under ``bwrap+cgroup``.

Design notes (each a trap measured on these machines):
- Each concurrent run holds a *slot* (an ``flock``-ed file, machine-wide) with its own uid
  (``uid_base + slot``) and its own cgroups: RLIMIT_NPROC counts per uid and is ignored for root.
- Infrastructure errors cannot be faked by the sandboxed code: the innermost wrapper writes a start
  marker to its stdin (the write end of a pipe whose read end only the caller holds; the pipe is
  root's, mode 0600, whatever the umask) and then re-opens stdin on /dev/null. No marker means the
  sandbox never reached the command. The code can add bytes, never remove the marker. Once the
  marker is there, anything that goes wrong (unreadable output, ...) is the code's ``failed``.
- The outcome is out of the code's reach: under bwrap the command is PID 1 of its namespace
  (``--as-pid-1``; bwrap's own reaper runs as the code's uid and its memory would be writable
  through /proc/1/mem), and a seccomp filter (``seccomp.py``) refuses ptrace, process_vm_*,
  pidfd_getfd and kcmp; under unshare ``--mount-proc`` leaves the parent without a pid.
- Output goes to files (never pipes: a ``setsid`` escapee would hold a pipe open), capped by
  RLIMIT_FSIZE; only ``limits.output_bytes`` of each is read back (head and tail).
- Every descendant is killed at the end of each run, ``setsid`` escapees included: by PID namespace
  (bwrap/unshare), by the slot cgroup, by process group, and by scanning /proc for the slot uid.
- The system view under bwrap is minimal: /usr, /etc, /bin, /lib*, /sbin read-only plus any
  ``ro_paths`` (e.g. the site-packages holding pytest); the workdir is mounted at ``/workdir``.
  A bind source below a directory the slot uid cannot traverse (a 0700 home) is first bound, by
  root, onto a traversable view in a mount namespace of that run only: only the files' own
  permissions matter.
  Under ``unshare`` and ``rlimits`` the command sees the real paths; use relative paths in argv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import os
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from gagar_jax.verify import runner_env, seccomp

STATUSES = ("passed", "failed", "timeout", "resource_killed", "infra_error")
MECHANISMS = ("bwrap+cgroup", "bwrap", "unshare", "rlimits", "none")
SANDBOX_WORKDIR = "/workdir"  # where the workdir appears inside bwrap
TREE_SOURCE = "/.gagar-tree"  # the host workdir, read-only, copied into a private /workdir
_TREE_SOURCE = TREE_SOURCE
_CGROUP_ROOT = "/sys/fs/cgroup"
_CGROUP_PARENT = "gagar_jax_sandbox"
_SLOT_DIR = "/tmp/gagar_jax_sandbox_slots"
_VIEW_DIR = "/tmp/gagar_jax_sandbox_view"  # empty; a run's private binds are mounted over it
_MAX_LEFTOVER = 4  # processes (zombies) a slot's uid may still hold when a run starts
_SYSTEM_RO = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/lib32", "/sbin")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run (plain byte counts; ``prlimit --as=1G`` misparses).

    Attributes:
      wall_s: wall-clock seconds before every process of the run is killed (status timeout).
      cpu_s: CPU seconds per process (RLIMIT_CPU).
      memory_bytes: memory cgroup limit (resident memory of the whole run) when cgroups are used.
      address_space_bytes: RLIMIT_AS per process, the backstop without cgroups (None: 2x memory).
      file_bytes: largest file any process may write (RLIMIT_FSIZE); also caps stdout/stderr.
      tmp_bytes: size of the private /tmp (bwrap only).
      shm_bytes: size of the private /dev/shm (bwrap only; the rest of /dev is read-only).
      disk_bytes: total bytes the workdir may hold (every file, all processes together);
        accounted while the run goes and at its end, the run killed when exceeded
        (``limit_hits`` "disk", status resource_killed).
      disk_files: total directory entries the workdir may hold (bounds the accounting walk).
      nproc: processes of the slot uid (RLIMIT_NPROC) and cgroup ``pids.max``.
      nofile: open files per process.
      output_bytes: how much of stdout and stderr is read back (head and tail halves).
      cpu_cores: CPU time per wall second the whole run may take, in cores (the slot cgroup's
        CFS quota, under ``bwrap+cgroup`` where the ``cpu`` controller is mounted): CPU-bound
        processes of one run, in whatever session, cannot starve a concurrent run.
    """

    wall_s: float = 60.0
    cpu_s: int = 60
    memory_bytes: int = 1 << 30
    address_space_bytes: int | None = None
    file_bytes: int = 64 << 20
    tmp_bytes: int = 64 << 20
    shm_bytes: int = 64 << 20
    disk_bytes: int = 1 << 30
    disk_files: int = 100_000
    nproc: int = 64
    nofile: int = 256
    output_bytes: int = 64 << 10
    cpu_cores: float = 1.0

    def __post_init__(self):
        for name in (
            "wall_s",
            "cpu_s",
            "memory_bytes",
            "file_bytes",
            "tmp_bytes",
            "shm_bytes",
            "disk_bytes",
            "disk_files",
            "nproc",
            "nofile",
            "output_bytes",
            "cpu_cores",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {value!r}")
        if self.address_space_bytes is not None and self.address_space_bytes <= 0:
            raise ValueError(
                f"Limits.address_space_bytes must be > 0, got {self.address_space_bytes}"
            )

    @property
    def as_bytes(self) -> int:
        # Virtual size runs well above resident size (Python maps ~30-100 MB it never touches):
        # the cgroup limits resident memory, the rlimit is only a backstop.
        return self.address_space_bytes or 2 * self.memory_bytes


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How to sandbox.

    Attributes:
      mechanism: ``"auto"`` (strongest available) or one of MECHANISMS to force (an unavailable
        forced mechanism is an infra_error, never a silent downgrade).
      allow_unisolated: permit ``none`` (no uid drop, no namespaces). Only for trusted code.
      uid_base: slot ``i`` runs as uid/gid ``uid_base + i`` (when started as root).
      num_slots: concurrent runs per machine.
      slot_wait_s: how long to wait for a free slot before an infra_error.
    """

    mechanism: str = "auto"
    allow_unisolated: bool = False
    uid_base: int = 61000
    num_slots: int = 32
    slot_wait_s: float = 60.0

    def __post_init__(self):
        if self.mechanism != "auto" and self.mechanism not in MECHANISMS:
            raise ValueError(f"SandboxConfig.mechanism must be 'auto' or one of {MECHANISMS}")
        if self.num_slots < 1:
            raise ValueError(f"SandboxConfig.num_slots must be >= 1, got {self.num_slots}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
      status: one of STATUSES.
      returncode: exit status of the command (128 + signal when killed by one), None if unknown.
      signal: the signal that ended it, if any.
      stdout, stderr: captured text (at most ``limits.output_bytes`` each, head + tail).
      stdout_truncated, stderr_truncated: whether more was written than was read back.
      wall_s: seconds from start to the last process killed.
      mechanism: the mechanism used (MECHANISMS).
      isolation: what was isolated: subset of {"uid", "rlimits", "cgroup", "pid", "network",
        "filesystem"}.
      limit_hits: limits seen to trigger ("cpu", "file_size", "memory", "pids", "wall").
      error: for infra_error, what failed.
    """

    status: str
    returncode: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    mechanism: str
    isolation: frozenset[str]
    limit_hits: tuple[str, ...] = ()
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def infra_error(self) -> bool:
        return self.status == "infra_error"


class SandboxUnavailable(RuntimeError):
    """No acceptable isolation mechanism (and ``allow_unisolated`` is off)."""


# ----------------------------------------------------------------------------------------------
# Capability probes (cached per process)
# ----------------------------------------------------------------------------------------------


def _is_root() -> bool:
    return os.geteuid() == 0


def _which(name: str) -> str | None:
    return shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")


def _cgroup_dirs(uid: int) -> dict[str, str]:
    names = ("pids", "memory", "cpu") if _cpu_cgroup_usable() else ("pids", "memory")
    return {c: f"{_CGROUP_ROOT}/{c}/{_CGROUP_PARENT}/slot-{uid}" for c in names}


@functools.cache
def _cpu_cgroup_usable() -> bool:
    """The cgroup v1 ``cpu`` controller (CFS bandwidth: ``cpu.cfs_quota_us``) is mounted and we
    may create groups in it. Each slot then gets its own group: the scheduler shares the CPU
    between slots (``cpu.shares``, equal), not between processes, and a slot's quota caps what
    all its processes together may take (``Limits.cpu_cores``)."""
    base = f"{_CGROUP_ROOT}/cpu"
    if not (_is_root() and os.path.exists(f"{base}/cpu.cfs_quota_us")):
        return False
    try:
        os.makedirs(f"{base}/{_CGROUP_PARENT}", exist_ok=True)
    except OSError:
        return False
    return True


@functools.cache
def _cgroups_usable() -> bool:
    """cgroup v1 pids + memory hierarchies exist and we may create groups in them."""
    if not _is_root():
        return False
    for c in ("pids", "memory"):
        base = f"{_CGROUP_ROOT}/{c}"
        if not os.path.exists(f"{base}/cgroup.procs"):
            return False
        try:
            os.makedirs(f"{base}/{_CGROUP_PARENT}", exist_ok=True)
        except OSError:
            return False
    return True


PROBE_TIMEOUT_S = 10.0
_PROBED: dict[tuple[str, SandboxConfig], str | None] = {}  # definitive verdicts only
_PROBE_LOCKS: dict[tuple[str, SandboxConfig], threading.Lock] = {}
_PROBE_GUARD = threading.Lock()


class SandboxBusy(TimeoutError):
    """A mechanism's probe could not finish on a busy machine: nothing is known about it yet
    (the run that needed it is an infrastructure error; nothing is downgraded or remembered)."""


def _probe_once(mechanism: str, config: SandboxConfig, timeout: float) -> tuple[str | None, bool]:
    """(None if ``/bin/true`` runs under the mechanism else why, whether that is definitive)."""
    with tempfile.TemporaryDirectory(prefix="gagar_probe_") as d, _slot(config) as slot:
        os.chmod(d, 0o755)
        uid = config.uid_base + slot
        sec_fd = _seccomp_fd(mechanism)
        argv = _chain(mechanism, ["/bin/true"], d, Limits(wall_s=timeout), uid, None, (), sec_fd)
        try:
            p = subprocess.run(
                argv,
                cwd=d,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                env=_base_env(d, mechanism),
                pass_fds=() if sec_fd is None else (sec_fd,),
            )
        except subprocess.TimeoutExpired as e:
            return f"{type(e).__name__}: {e}", False
        except OSError as e:
            return f"{type(e).__name__}: {e}", True
        finally:
            if _is_root():
                _kill_uid(uid)  # what a killed probe left behind
            if sec_fd is not None:
                os.close(sec_fd)
        if p.returncode != 0:
            return p.stderr.decode(errors="replace").strip()[-300:] or f"rc {p.returncode}", True
    return None, True


def _probe(mechanism: str, config: SandboxConfig) -> str | None:
    """Runs ``/bin/true`` under the mechanism; returns None if it works, else the reason.

    Kept per process only when definitive (it ran, or the tool is missing). A probe that did
    not finish in :data:`PROBE_TIMEOUT_S` on a loaded machine is tried again with six times
    the time; if that does not finish either, :class:`SandboxBusy` is raised: a busy moment must
    neither be remembered as "this mechanism does not work" nor silently pick a weaker one."""
    key = (mechanism, config)
    if key in _PROBED:  # the common case: no lock
        return _PROBED[key]
    with _PROBE_GUARD:
        lock = _PROBE_LOCKS.setdefault(key, threading.Lock())
    with lock:  # one probe per key at a time; other keys are not held up
        if key in _PROBED:
            return _PROBED[key]
        need = {"bwrap": "bwrap", "unshare": "unshare"}.get(mechanism)
        for tool in ("prlimit", "setpriv" if _is_root() else None, need):
            if tool and not _which(tool):
                _PROBED[key] = f"{tool} not found"
                return _PROBED[key]
        for timeout in (PROBE_TIMEOUT_S, 6 * PROBE_TIMEOUT_S):
            reason, definitive = _probe_once(mechanism, config, timeout)
            if definitive:
                _PROBED[key] = reason
                return reason
        raise SandboxBusy(f"the {mechanism} probe did not finish within {timeout:g} s: {reason}")


def available_mechanisms(config: SandboxConfig | None = None) -> dict[str, str | None]:
    """Each mechanism -> None if usable here, else why not (probes run once per process)."""
    config = config or SandboxConfig()
    out: dict[str, str | None] = {}
    for m in MECHANISMS:
        if m == "none":
            out[m] = None if config.allow_unisolated else "not allowed (allow_unisolated=False)"
        elif m == "bwrap+cgroup" and not _cgroups_usable():
            out[m] = "cgroup v1 pids/memory not writable"
        elif m == "rlimits" and not _is_root():
            out[m] = "without root there is no separate uid: no isolation from the caller"
        else:
            out[m] = _probe(m.replace("+cgroup", ""), config)
    return out


def select_mechanism(config: SandboxConfig | None = None) -> str:
    """The mechanism ``run_sandboxed`` would use; raises SandboxUnavailable if none is allowed."""
    config = config or SandboxConfig()
    avail = available_mechanisms(config)
    if config.mechanism != "auto":
        if avail[config.mechanism] is not None:
            raise SandboxUnavailable(f"mechanism {config.mechanism!r}: {avail[config.mechanism]}")
        return config.mechanism
    for m in MECHANISMS:
        if avail[m] is None:
            return m
    raise SandboxUnavailable(
        "no sandbox mechanism available and allow_unisolated=False: "
        + "; ".join(f"{m}: {why}" for m, why in avail.items())
        + ". Install bubblewrap (apt-get install -y bubblewrap)."
    )


ISOLATION = {
    "bwrap+cgroup": frozenset({"uid", "rlimits", "cgroup", "pid", "network", "filesystem"}),
    "bwrap": frozenset({"uid", "rlimits", "pid", "network", "filesystem"}),
    "unshare": frozenset({"uid", "rlimits", "pid", "network"}),
    "rlimits": frozenset({"uid", "rlimits"}),
    "none": frozenset({"rlimits"}),
}


# ----------------------------------------------------------------------------------------------
# The chain
# ----------------------------------------------------------------------------------------------

_START_WRAPPER = 'printf S >&0; exec 0</dev/null; exec "$@"'
# cp fails (no marker: infra_error) only if the pristine tree does not fit the quota.
_COPY_IN = f"cp -dR --preserve=mode,timestamps {_TREE_SOURCE}/. . || exit 97; "


def _chain(
    mechanism: str,
    argv: Sequence[str],
    workdir: str,
    limits: Limits,
    uid: int,
    cgroups: Mapping[str, str] | None,
    ro_paths: Sequence[str],
    seccomp_fd: int | None = None,
    private_workdir: bool = False,
) -> list[str]:
    chain: list[str] = []
    sources = {p: p for p in ro_paths}
    sources[workdir] = workdir
    private = [p for p in sources if mechanism.startswith("bwrap") and not _open_to_others(p)]
    if private and _is_root():
        # bwrap (run as the slot uid) resolves each bind source itself, so a directory under a
        # private 0700 ancestor (a home directory) cannot be bound. Root binds those onto a
        # traversable view first, in a mount namespace of this run only; then only the files'
        # own permissions matter.
        script = [f"mount -t tmpfs -o size=65536,mode=0755 gagar-view {_VIEW_DIR}"]
        for i, p in enumerate(private):
            view = f"{_VIEW_DIR}/{i}"
            script += [f"mkdir {view}", f"mount --bind {shlex.quote(p)} {view}"]
            sources[p] = view
        script_text = " && ".join(script) + ' && exec "$@"'
        chain += [_which("unshare") or "unshare", "-m", "--propagation", "private", "--",
                  "/bin/sh", "-c", script_text, "sandbox-binds"]  # fmt: skip  # argv pairs
    if cgroups:
        joins = " && ".join(
            f"echo $$ > {shlex.quote(d + '/cgroup.procs')}" for d in cgroups.values()
        )
        chain += ["/bin/sh", "-c", f'{joins} && exec "$@"', "sandbox-cgroup"]
    chain += [
        _which("prlimit") or "prlimit",
        # soft:hard. SIGXCPU at the soft limit; equal limits would skip it and SIGKILL at once.
        f"--cpu={int(limits.cpu_s)}:{int(limits.cpu_s) + 1}",
        f"--as={int(limits.as_bytes)}",
        f"--fsize={int(limits.file_bytes)}",
        f"--nofile={int(limits.nofile)}",
        f"--nproc={int(limits.nproc)}",
        "--core=0",
        "--",
    ]
    if _is_root() and mechanism != "none":
        chain += [
            _which("setpriv") or "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            "--",
        ]
    if mechanism.startswith("bwrap"):
        # --disable-userns: a nested user namespace could mount an unbounded tmpfs of its own.
        # --as-pid-1: no bwrap reaper inside the PID namespace. That reaper runs as the code's
        # uid, holds the start marker and decides the exit status; the code could write its
        # memory through /proc/1/mem (an open(), which seccomp cannot tell apart) and make a
        # failing run exit 0. Now PID 1 is the start wrapper, which execs the command itself.
        chain += [_which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
                  "--as-pid-1", "--die-with-parent", "--new-session"]  # fmt: skip  # argv pairs
        for p in _SYSTEM_RO:
            chain += ["--ro-bind-try", p, p]
        # /dev is a host-sized tmpfs: made read-only, with a size-capped /dev/shm inside it.
        chain += [
            "--dev",
            "/dev",
            "--size",
            str(int(limits.shm_bytes)),
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--proc",
            "/proc",
            "--size",
            str(int(limits.tmp_bytes)),
            "--tmpfs",
            "/tmp",
        ]
        if seccomp_fd is not None:
            chain += ["--seccomp", str(seccomp_fd)]
        for p in ro_paths:  # after the tmpfs, or a path under /tmp would be hidden by it
            chain += ["--ro-bind", sources[p], p]
        if private_workdir:
            # The work tree on a tmpfs of disk_bytes: its size is the quota, so files unlinked
            # while open and preallocated ones count, and nothing the run writes reaches the
            # host's disk. The start wrapper copies the tree in before the start marker.
            chain += ["--size", str(int(limits.disk_bytes)), "--tmpfs", SANDBOX_WORKDIR,
                      "--ro-bind", sources[workdir], _TREE_SOURCE]  # fmt: skip  # argv pairs
        else:
            chain += ["--bind", sources[workdir], SANDBOX_WORKDIR]
        chain += ["--chdir", SANDBOX_WORKDIR, "--"]
        if private_workdir:
            return chain + ["/bin/sh", "-c", _COPY_IN + _START_WRAPPER, "sandbox-start", *argv]
    elif mechanism == "unshare":
        # --mount-proc: /proc shows only the new PID namespace, so the code cannot name (ptrace,
        # pidfd_getfd) the unshare process outside it that holds the start marker.
        chain += [_which("unshare") or "unshare", "-Urnpfm", "--mount-proc", "--kill-child", "--"]
    return chain + ["/bin/sh", "-c", _START_WRAPPER, "sandbox-start", *argv]


def _base_env(workdir: str, mechanism: str, extra: Mapping[str, str] | None = None) -> dict:
    inside = mechanism.startswith("bwrap")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp" if inside else workdir,
        "TMPDIR": "/tmp" if inside else workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }
    env.update(extra or {})
    return env


# ----------------------------------------------------------------------------------------------
# Slots: a machine-wide lock per slot, each with its own uid and cgroups
# ----------------------------------------------------------------------------------------------

_local_slots: set[int] = set()
_local_lock = threading.Lock()


@contextlib.contextmanager
def _slot(config: SandboxConfig) -> Iterator[int]:
    os.makedirs(_SLOT_DIR, mode=0o700, exist_ok=True)
    deadline = time.monotonic() + config.slot_wait_s
    while True:
        for i in range(config.num_slots):
            with _local_lock:
                if i in _local_slots:
                    continue
                fd = os.open(
                    f"{_SLOT_DIR}/slot-{config.uid_base + i}.lock", os.O_RDWR | os.O_CREAT, 0o600
                )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if _is_root() and len(_uid_pids(config.uid_base + i, True)) > _MAX_LEFTOVER:
                    # Zombies that init has not reaped yet (it takes it ~1.5 s here after a fork
                    # bomb) count against this uid's RLIMIT_NPROC: use another slot meanwhile.
                    _kill_uid(config.uid_base + i)
                    if len(_uid_pids(config.uid_base + i, True)) > _MAX_LEFTOVER:
                        os.close(fd)
                        continue
                _local_slots.add(i)
            try:
                yield i
            finally:
                with _local_lock:
                    _local_slots.discard(i)
                os.close(fd)  # releases the flock
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free sandbox slot within {config.slot_wait_s} s")
        time.sleep(0.05)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_int_field(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == field:
                    return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _prepare_cgroups(uid: int, limits: Limits) -> dict[str, str]:
    dirs = _cgroup_dirs(uid)
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
        _kill_cgroup(d)
    _write(f"{dirs['pids']}/pids.max", str(int(limits.nproc)))
    mem = dirs["memory"]
    with contextlib.suppress(OSError):  # drop the previous run's page cache charged to the slot
        _write(f"{mem}/memory.force_empty", "0")
    memsw = f"{mem}/memory.memsw.limit_in_bytes"
    # limit_in_bytes <= memsw.limit_in_bytes must hold after every single write.
    order = [f"{mem}/memory.limit_in_bytes"] + ([memsw] if os.path.exists(memsw) else [])
    try:
        for p in reversed(order):
            _write(p, str(int(limits.memory_bytes)))
    except OSError:
        for p in order:
            _write(p, str(int(limits.memory_bytes)))
    with contextlib.suppress(OSError):
        _write(f"{mem}/memory.failcnt", "0")
        _write(f"{mem}/memory.max_usage_in_bytes", "0")
    if "cpu" in dirs:
        period = 100_000
        _write(f"{dirs['cpu']}/cpu.cfs_period_us", str(period))
        _write(f"{dirs['cpu']}/cpu.cfs_quota_us", str(max(1000, int(limits.cpu_cores * period))))
    return dirs


def _cgroup_pids(d: str) -> list[int]:
    try:
        with open(f"{d}/cgroup.procs") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _kill_all(list_pids) -> None:
    """SIGKILLs what `list_pids()` returns until it returns nothing (at most 200 rounds: a
    process may fork between listing and killing)."""
    for _ in range(200):
        pids = list_pids()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _kill_cgroup(d: str) -> None:
    _kill_all(lambda: _cgroup_pids(d))


def _uid_pids(uid: int, zombies: bool = False) -> list[int]:
    """Processes owned by ``uid`` (/proc shows host uids); zombies only if asked.

    One ``stat`` per process (the /proc/<pid> owner is its effective uid, equal to the real one
    after setpriv); the state is read only for the few that match.
    """
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            if not zombies:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
                if state in (b"Z", b"X"):
                    continue
        except (OSError, IndexError):
            continue
        out.append(int(name))
    return out


def _kill_uid(uid: int, reap_wait_s: float = 0.0) -> bool:
    """SIGKILLs every process of ``uid``; then waits up to ``reap_wait_s`` for their zombies to
    be reaped (zombies count against RLIMIT_NPROC of the next run in this slot). Returns whether
    the uid ended with no process at all."""
    _kill_all(lambda: _uid_pids(uid))
    deadline = time.monotonic() + reap_wait_s
    while _uid_pids(uid, zombies=True):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= cap:
            return f.read().decode(errors="replace"), False
        head = f.read(cap // 2)
        f.seek(size - cap // 2)
        tail = f.read()
    skipped = size - len(head) - len(tail)
    text = head.decode(errors="replace") + f"\n[... {skipped} bytes elided ...]\n"
    return text + tail.decode(errors="replace"), True


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, uid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(root, n), uid, uid)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------


def run_sandboxed(
    argv: Sequence[str],
    workdir: str | os.PathLike,
    limits: Limits | None = None,
    *,
    config: SandboxConfig | None = None,
    env: Mapping[str, str] | None = None,
    ro_paths: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    private_workdir: bool = True,
) -> SandboxResult:
    """Runs untrusted ``argv`` in ``workdir`` under the strongest available isolation.

    Args:
      argv: the command; it runs with cwd = the workdir (``/workdir`` under bwrap).
      workdir: an existing directory, the only place the command may write (made owned by the
        slot uid when running as root). Use a fresh copy per run.
      limits: resource limits (``Limits()`` defaults).
      config: mechanism choice and slot settings (``SandboxConfig()`` defaults).
      env: extra environment variables (the environment is otherwise cleared).
      ro_paths: host paths made visible read-only at the same path (bwrap only), e.g. the
        site-packages that holds pytest. Their files must be readable by an unprivileged uid;
        under bwrap (as root) a private 0700 ancestor does not matter (see ``_chain``).
      pass_fds: descriptors the command inherits at the same numbers (e.g. the write end of a
        pipe the caller reads: an outcome channel with no path the code could reopen).
      private_workdir: (default) under bwrap, run in a copy of the workdir on a tmpfs of
        ``limits.disk_bytes`` (a hard quota: unlinked-while-open and preallocated files count;
        filling it is ``limit_hits`` "disk"); what the command writes there is discarded and the
        host workdir stays as it was (``isolation`` gains "disk"). Other mechanisms use the
        accounted host workdir as without it. ``False`` is the explicit opt-out for a caller
        that reads back what the command wrote: the host workdir is bound writable and the
        quota is only accounted (a walk every 0.1 s, which files unlinked while still open and
        preallocated blocks pass).

    Returns:
      SandboxResult. Problems of the sandbox itself come back as ``status="infra_error"`` with
      ``error`` set; ``SandboxUnavailable`` is raised only when no mechanism is allowed at all.
    """
    limits = limits or Limits()
    config = config or SandboxConfig()
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty sequence of str, got {argv!r}")
    workdir = os.path.abspath(os.fspath(workdir))
    if not os.path.isdir(workdir):
        raise ValueError(f"workdir {workdir!r} is not a directory")
    for p in ro_paths:
        if not os.path.isabs(p) or not os.path.exists(p):
            raise ValueError(f"ro_paths entry {p!r} must be an existing absolute path")
    try:
        mechanism = select_mechanism(config)
    except TimeoutError as e:  # a probe found no free slot, or could not finish: busy, not known
        return SandboxResult(
            "infra_error",
            None,
            None,
            "",
            "",
            False,
            False,
            0.0,
            config.mechanism if config.mechanism != "auto" else "none",
            frozenset(),
            (),
            f"probing the sandbox: {e}",
        )

    def infra(msg: str, t0: float = time.monotonic()) -> SandboxResult:
        wall = time.monotonic() - t0
        return SandboxResult(
            "infra_error",
            None,
            None,
            "",
            "",
            False,
            False,
            wall,
            mechanism,
            ISOLATION[mechanism],
            (),
            msg,
        )

    try:
        slot_cm = _slot(config)
        slot = slot_cm.__enter__()
    except (OSError, TimeoutError) as e:
        return infra(f"slot: {e}")
    try:
        res = _run_in_slot(
            argv,
            workdir,
            limits,
            config,
            env,
            ro_paths,
            mechanism,
            slot,
            infra,
            tuple(pass_fds),
            private_workdir,
        )
        if private_workdir and mechanism.startswith("bwrap"):
            res = dataclasses.replace(res, isolation=res.isolation | {"disk"})
        return res
    finally:
        slot_cm.__exit__(None, None, None)


def _seccomp_fd(mechanism: str) -> int | None:
    """A memfd holding the seccomp program for bwrap (None: not bwrap, or no table here)."""
    prog = seccomp.host_filter()
    if not mechanism.startswith("bwrap") or prog is None:
        return None
    fd = os.memfd_create("gagar-seccomp", os.MFD_CLOEXEC)
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _disk_usage(root: str, max_entries: int) -> tuple[int, int]:
    """(bytes, entries) under ``root``, not following symlinks; stops counting once
    ``max_entries`` is passed (an inode flood must not make the accounting itself slow)."""
    total = entries = 0
    stack = [root]
    while stack and entries <= max_entries:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                entries += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                # The larger of allocated and apparent size: a file system that has not allocated
                # delayed writes yet reports few blocks; a sparse file counts at its full size.
                total += max(st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return total, entries


def _disk_exceeded(workdir: str, limits: Limits) -> bool:
    used, entries = _disk_usage(workdir, limits.disk_files)
    return used > limits.disk_bytes or entries > limits.disk_files


_DISK_POLL_S = 0.1
_TMPFS_FULL_BYTES = 64 << 10  # a private work tree with less free is full: the quota was hit


def _sandbox_root_pid(pid: int) -> int | None:
    """The descendant of ``pid`` (the bwrap process) whose root holds the private work tree."""
    frontier = [pid]
    for _ in range(3):
        nxt = []
        for p in frontier:
            try:
                with open(f"/proc/{p}/task/{p}/children") as f:
                    nxt += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
        for c in nxt:
            if os.path.isdir(f"/proc/{c}/root{_TREE_SOURCE}"):
                return c
        frontier = nxt
    return None


def _tmpfs_full(pid: int | None, limits: Limits) -> bool:
    """Whether the private work tree of the run whose PID-1 is ``pid`` is (nearly) full, or
    holds more than ``limits.disk_files`` entries."""
    if pid is None:
        return False
    try:
        st = os.statvfs(f"/proc/{pid}/root{SANDBOX_WORKDIR}")
    except OSError:
        return False
    if st.f_files and st.f_files - st.f_ffree > limits.disk_files:
        return True  # an inode flood: empty files take no blocks but kernel memory
    return st.f_bavail * st.f_frsize < min(_TMPFS_FULL_BYTES, limits.disk_bytes // 4)


class _ExitWaiter:
    """``waiter(timeout) -> exit status or None`` for ``proc``, woken the moment it exits.

    ``Popen.wait(timeout)`` polls with sleeps of up to 50 ms, which every run paid after its
    command had ended; a pidfd (Linux 5.3+) is readable at once. Falls back to ``Popen.wait``
    where ``pidfd_open`` is missing. ``close()`` releases the pidfd (idempotent).
    """

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        try:
            self._fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self._fd = -1

    def __call__(self, timeout: float) -> int | None:
        if self._fd < 0:
            try:
                return self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return None
        self.close()
        return self._proc.wait()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _run_in_slot(
    argv,
    workdir,
    limits,
    config,
    env,
    ro_paths,
    mechanism,
    slot,
    infra,
    fds=(),
    private_workdir=False,
):
    private = private_workdir and mechanism.startswith("bwrap")
    uid = config.uid_base + slot
    use_uid = _is_root() and mechanism != "none"
    # No traversal check of the workdir's ancestors: bwrap binds a private one through the
    # view (see _chain); unshare and rlimits start in it (the cwd is inherited as an open
    # directory, so a 0700 ancestor does not matter to relative paths).
    try:
        if use_uid:
            _kill_uid(uid)  # a previous holder's leftovers (should be none)
            _chown_tree(workdir, uid)
            if mechanism.startswith("bwrap"):
                os.makedirs(_VIEW_DIR, mode=0o755, exist_ok=True)
        cgroups = _prepare_cgroups(uid, limits) if mechanism == "bwrap+cgroup" else None
    except OSError as e:
        return infra(f"preparing the slot: {e}")
    oom_before = pids_max_before = 0
    if cgroups:
        oom_before = _read_int_field(f"{cgroups['memory']}/memory.oom_control", "oom_kill")
        pids_max_before = _read_int_field(f"{cgroups['pids']}/pids.events", "max")

    # The start marker travels through a pipe whose read end only this (root) process holds:
    # the sandboxed code can add bytes, never remove the marker (a file could be truncated
    # through /proc/1/fd/0 or a descriptor taken with pidfd_getfd), and the pipe's inode is
    # owned by us with mode 0600 whatever the umask.
    marker_r, marker_w = os.pipe()
    sec_fd = None
    try:
        sec_fd = _seccomp_fd(mechanism)
        chain = _chain(mechanism, argv, workdir, limits, uid, cgroups, ro_paths, sec_fd, private)
        with tempfile.TemporaryDirectory(prefix="gagar_sandbox_io_") as io_dir:
            os.chmod(io_dir, 0o700)
            paths = {k: os.path.join(io_dir, k) for k in ("stdout", "stderr")}
            t0 = time.monotonic()
            timed_out = disk_hit = False
            with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
                try:
                    proc = subprocess.Popen(
                        chain,
                        cwd=workdir,
                        stdin=marker_w,
                        stdout=out,
                        stderr=err,
                        env=_base_env(workdir, mechanism, env),
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=fds + (() if sec_fd is None else (sec_fd,)),
                    )
                except OSError as e:
                    return infra(f"could not start {chain[0]}: {e}", t0)
                finally:
                    os.close(marker_w)
                    marker_w = -1
                deadline = t0 + limits.wall_s
                root_pid = None
                exited = _ExitWaiter(proc)
                while True:
                    rc = exited(max(0.0, min(_DISK_POLL_S, deadline - time.monotonic())))
                    if rc is not None:
                        break
                    if private:
                        root_pid = root_pid or _sandbox_root_pid(proc.pid)
                        if _tmpfs_full(root_pid, limits):
                            disk_hit = True
                            break
                    elif _disk_exceeded(workdir, limits):
                        disk_hit = True
                        break
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
                exited.close()
                # Kill every descendant whatever happened: setsid escapees outlive their parent.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                if cgroups:
                    for d in cgroups.values():
                        _kill_cgroup(d)
                if use_uid:
                    _kill_uid(uid)  # zombies left for init to reap: see _slot
                wall = time.monotonic() - t0
            os.set_blocking(marker_r, False)
            try:
                started = os.read(marker_r, 1) == b"S"
            except BlockingIOError:
                started = False
            if not started:
                stderr, _ = _read_capped(paths["stderr"], limits.output_bytes)
                return _verdict(
                    rc,
                    False,
                    timed_out,
                    False,
                    "",
                    stderr,
                    False,
                    False,
                    wall,
                    mechanism,
                    cgroups,
                    oom_before,
                    pids_max_before,
                    limits,
                    0,
                    0,
                )
            # From here on the code ran: any problem reading what it left is its failure.
            try:
                disk_hit = disk_hit or (not private and _disk_exceeded(workdir, limits))
                out_size, err_size = (
                    os.path.getsize(paths["stdout"]),
                    os.path.getsize(paths["stderr"]),
                )
                stdout, out_trunc = _read_capped(paths["stdout"], limits.output_bytes)
                stderr, err_trunc = _read_capped(paths["stderr"], limits.output_bytes)
            except (OSError, ValueError) as e:
                return SandboxResult(
                    "failed",
                    rc if rc >= 0 else None,
                    None,
                    "",
                    "",
                    False,
                    False,
                    wall,
                    mechanism,
                    ISOLATION[mechanism],
                    (),
                    f"reading the run's output: {e}",
                )
    finally:
        os.close(marker_r)
        if marker_w >= 0:
            os.close(marker_w)
        if sec_fd is not None:
            os.close(sec_fd)
    return _verdict(
        rc,
        True,
        timed_out,
        disk_hit,
        stdout,
        stderr,
        out_trunc,
        err_trunc,
        wall,
        mechanism,
        cgroups,
        oom_before,
        pids_max_before,
        limits,
        out_size,
        err_size,
    )


def _verdict(
    rc,
    started,
    timed_out,
    disk_hit,
    stdout,
    stderr,
    out_trunc,
    err_trunc,
    wall,
    mechanism,
    cgroups,
    oom_before,
    pids_max_before,
    limits,
    out_size,
    err_size,
):
    hits = []
    sig = None
    if rc < 0:
        sig = -rc
    elif rc > 128 and mechanism != "none":
        sig = rc - 128  # bwrap, unshare and sh report a signalled child as 128 + signal
    if cgroups:
        mem = cgroups["memory"]
        if _read_int_field(f"{mem}/memory.oom_control", "oom_kill") > oom_before:
            hits.append("memory")
        if _read_int_field(f"{cgroups['pids']}/pids.events", "max") > pids_max_before:
            hits.append("pids")
    if sig == signal.SIGXCPU:
        hits.append("cpu")
    elif (
        sig == signal.SIGKILL
        and mechanism.startswith("bwrap")
        and not timed_out
        and not disk_hit
        and "memory" not in hits
    ):
        # The code is its PID namespace's init: SIGXCPU (default action) does not reach it,
        # and nothing inside can SIGKILL it; the kernel's RLIMIT_CPU hard limit can.
        hits.append("cpu")
    # Python ignores SIGXFSZ: its writes fail with EFBIG instead, seen as a full-size file.
    if sig == signal.SIGXFSZ or max(out_size, err_size) >= limits.file_bytes:
        hits.append("file_size")
    if disk_hit:
        hits.append("disk")
    if timed_out:
        hits.append("wall")

    if not started:
        status = "infra_error"
        error = (
            f"sandbox did not start within {limits.wall_s} s"
            if timed_out
            else f"sandbox did not start (rc {rc}): {stderr.strip()[-500:]}"
        )
    elif disk_hit:
        status, error = "resource_killed", None  # a passing exit status does not undo it
    elif timed_out:
        status, error = "timeout", None
    elif rc == 0:
        status, error = "passed", None
    elif (
        sig in (signal.SIGXCPU, signal.SIGXFSZ, signal.SIGKILL)
        or hits
        or (
            # unshare as PID 1's parent cannot report a kernel-signalled child: it prints this and
            # exits 1 (measured). Faking it only turns the code's own failure into another failure.
            mechanism == "unshare" and rc == 1 and "sigprocmask unblock failed" in stderr[-300:]
        )
    ):
        status, error = "resource_killed", None  # a limit fired and the command did not succeed
    else:
        status, error = "failed", None
    returncode = rc if rc >= 0 else 128 + sig
    return SandboxResult(
        status,
        returncode,
        sig,
        stdout,
        stderr,
        out_trunc,
        err_trunc,
        wall,
        mechanism,
        ISOLATION[mechanism],
        tuple(hits),
        error,
    )


def _open_to_others(path: str, own_only: bool = False) -> bool:
    """Whether an unprivileged uid can read and enter/execute ``path`` (o+rx, o+x on ancestors
    unless ``own_only``)."""
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
        return False
    if own_only:
        return True
    parent = os.path.dirname(path)
    while parent and parent != "/":
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(parent)
    return True


@functools.cache
def python_for_sandbox() -> tuple[str, tuple[str, ...]]:
    """An interpreter the sandbox uid can run, and the read-only paths to put on its PYTHONPATH.

    Order: ``$GAGAR_SANDBOX_PYTHON``; this process's interpreter (resolved: the ``python3`` on
    PATH may be a pyenv shim under /root); ``/usr/bin/python3``; ``/usr/local/bin/python3``.
    The path to expose is the test runner's environment (``runner_env``): pytest and its
    plugins at this process's versions, built for that interpreter where every uid can read it,
    never this process's own site-packages (a package the trainer has installed must not stand
    in for the task's tree, and a private checkout must not hide pytest from the fallback
    mechanisms).

    Raises:
      SandboxUnavailable: no interpreter is readable by an unprivileged uid, or no runner
        environment can be built for it.
    """
    candidates = [
        os.environ.get("GAGAR_SANDBOX_PYTHON"),
        os.path.realpath(sys.executable),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    for exe in filter(None, candidates):
        exe = os.path.realpath(exe)
        if not _open_to_others(exe):
            continue
        try:
            subprocess.run(
                [exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        try:  # pytest and its plugins only, staged where every uid can read them
            return exe, (runner_env.build_runner_env(exe),)
        except (runner_env.RunnerEnvError, OSError, subprocess.SubprocessError) as e:
            raise SandboxUnavailable(f"no test runner environment for {exe}: {e}") from e
    raise SandboxUnavailable(
        "no Python interpreter readable by an unprivileged uid (tried "
        f"{[c for c in candidates if c]}); set GAGAR_SANDBOX_PYTHON"
    )


def release_cgroups(config: SandboxConfig | None = None) -> None:
    """Removes this package's (empty) slot cgroups; safe to call at exit."""
    config = config or SandboxConfig()
    for slot in range(config.num_slots):
        for d in _cgroup_dirs(config.uid_base + slot).values():
            if os.path.isdir(d) and not _cgroup_pids(d):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
