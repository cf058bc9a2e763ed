"""Container execution back-end: a verification run inside an OCI image (podman, or docker).

``execution.environment = "container"`` (or a task that names an ``image`` or ships a
``dockerfile``) runs the verifier's test session in a container instead of the bwrap sandbox,
for tasks that need system packages or an environment of their own (SWE-bench's official
images: a conda environment ``testbed`` with the repository installed at ``/testbed``).

Every guarantee of the bwrap sandbox holds inside, by the same means:

- the **tree** is bound read-only at ``/.gagar-tree`` and copied onto a tmpfs of
  ``limits.disk_bytes`` mounted at the task's work directory (a hard disk quota: filling it is
  ``limit_hits`` "disk", status ``resource_killed``; nothing reaches the host); with
  ``seed_workdir`` the image's own work directory (build artefacts, an editable install's
  metadata) is copied first, from the image mounted read-only, and the task's tree over it;
- the **outcome channel**: the verifier's pipes reach the runner as inherited descriptors
  (``--preserve-fds``), renumbered 4, 5, ... (:func:`inside_fd`); no path inside names them;
- the **start marker** is a pipe on descriptor 3 that the start wrapper writes one byte to and
  closes before the command runs: a run that never reached the command is ``infra_error``;
- **no network** (``--network none``), every capability dropped, ``no-new-privileges``, a
  read-only root file system, a size-capped ``/tmp`` and ``/dev/shm``;
- **limits**: memory (``--memory``, no swap), processes (``--pids-limit`` and RLIMIT_NPROC),
  CPU (``--cpus`` and RLIMIT_CPU), file size, open files; run as the sandbox slot's
  unprivileged uid (one uid per concurrent run, as under bwrap);
- **kill on timeout**: at the wall limit the whole container is killed (``kill``, then
  removed), whatever its processes did (``setsid`` escapees included).

The runtime is ``runc``: the default ``crun`` cannot start containers on hosts with cgroup v1
controllers mounted beside v2. No registry is needed: :func:`build_base_image` makes an image
from Debian packages (``mmdebstrap``, then ``podman import``), and :func:`ensure_image` builds a
task's Dockerfile offline (``FROM`` a local image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from gagar_jax.verify.sandbox import (
    TREE_SOURCE,
    Limits,
    SandboxConfig,
    SandboxResult,
    _read_capped,
    _slot,
)

ENGINES = ("podman", "docker")
ENVIRONMENTS = ("uv", "container")
MECHANISM = "container"
ISOLATION = frozenset(
    {"uid", "rlimits", "cgroup", "pid", "network", "filesystem", "disk", "container"}
)
RUNNER_DIR = "/.gagar-runner"  # the test runner's directory, read-only, inside the container
IMAGE_ROOT = "/.gagar-image"  # the image itself, read-only (``seed_workdir``)
MARKER_FD = 3
_COPY_EXIT = 97  # the copy-in failed: the pristine tree does not fit (infra_error)
_DISK_POLL_S = 0.1
_TMPFS_FULL_BYTES = 64 << 10


class ContainerUnavailable(RuntimeError):
    """No container engine (podman or docker) on this machine, or it cannot start containers."""


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
    """Where a task's tests run when they run in a container.

    Attributes:
      image: a local image name (``localhost/name:tag``, ``sweb.eval.x86_64.<id>:latest``).
      dockerfile: a Dockerfile (or a directory holding one) to build the image from, offline
        (``FROM`` a local image); the image is then named after its content hash.
      python: the interpreter inside that has pytest (SWE-bench images:
        ``/opt/miniconda3/envs/testbed/bin/python``).
      workdir: where the repository lives inside (SWE-bench images: ``/testbed``).
      seed_workdir: copy the image's own ``workdir`` first (what its build made there: compiled
        extensions, generated files, an editable install's metadata), then the task's tree over
        it, removing the files the candidate deleted.
      activate: shell commands sourced (by ``bash``) in the work directory before the command
        runs, as an image's own evaluation script activates its environment (SWE-bench's:
        ``source /opt/miniconda3/bin/activate && conda activate testbed``: the environment's
        ``bin`` first on ``PATH``, its ``activate.d`` scripts run). A failing activation is an
        ``infra_error`` (the run never reached its command).
      site_dirs: host directories of installed packages (a task's uv environment) bound
        read-only at the same paths and put on ``PYTHONPATH``: for an image whose interpreter is
        the Python the environment was built for (the back-end's own images; checked,
        ``container_problem``), never for an image with an environment of its own.
    """

    image: str = ""
    dockerfile: str = ""
    python: str = "python3"
    workdir: str = "/workdir"
    seed_workdir: bool = False
    activate: str = ""
    site_dirs: tuple[str, ...] = ()

    def __post_init__(self):
        if not (self.image or self.dockerfile):
            raise ValueError("ContainerSpec: give an image or a dockerfile")
        if self.dockerfile and not os.path.isabs(self.dockerfile):
            raise ValueError(f"ContainerSpec.dockerfile {self.dockerfile!r} must be absolute")
        for name in ("workdir",):
            v = getattr(self, name)
            if not v.startswith("/") or v == "/" or ".." in v.split("/"):
                raise ValueError(f"ContainerSpec.{name} {v!r} must be an absolute directory")
        if not self.python:
            raise ValueError("ContainerSpec.python must name an interpreter")
        for d in self.site_dirs:
            if not os.path.isabs(d) or ":" in d:
                raise ValueError(f"ContainerSpec.site_dirs: {d!r} must be an absolute path")


def inside_fd(i: int) -> int:
    """The descriptor number, inside the container, of the ``i``-th of ``pass_fds``."""
    return MARKER_FD + 1 + i


@functools.cache
def container_engine() -> tuple[str, str]:
    """(name, path) of the engine: podman where installed, else docker.

    Raises ContainerUnavailable when neither is installed."""
    for name in ENGINES:
        path = shutil.which(name)
        if path:
            return name, path
    raise ContainerUnavailable("no container engine: install podman (or docker)")


def _engine_argv() -> list[str]:
    name, path = container_engine()
    # crun cannot start containers where cgroup v1 controllers sit beside v2: runc can.
    if name == "podman" and shutil.which("runc"):
        return [path, "--runtime", shutil.which("runc") or "runc"]
    return [path]


def image_exists(image: str) -> bool:
    argv = [*_engine_argv(), "image", "inspect", image]
    return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0


def _dockerfile_path(dockerfile: str) -> tuple[str, str]:
    """(Dockerfile, build context) of a Dockerfile or of a directory holding one."""
    if os.path.isdir(dockerfile):
        return os.path.join(dockerfile, "Dockerfile"), dockerfile
    return dockerfile, os.path.dirname(dockerfile)


def _context_hash(context: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, context).encode() + b"\0")
            with open(p, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


_BUILD_LOCK = threading.Lock()


def ensure_image(spec: ContainerSpec, *, timeout_s: float = 1800.0) -> str:
    """The image ``spec`` runs in: its ``image`` (checked to exist locally), or its Dockerfile
    built once (offline; tagged ``localhost/gagar-task:<context hash>``, reused while the
    build context is unchanged).

    Raises ContainerUnavailable (no engine), ValueError (a missing image or a failing build:
    the task's fault, never the candidate's)."""
    if not spec.dockerfile:
        if not image_exists(spec.image):
            raise ValueError(f"image {spec.image!r} is not present locally (no registry here)")
        return spec.image
    dockerfile, context = _dockerfile_path(spec.dockerfile)
    if not os.path.isfile(dockerfile):
        raise ValueError(f"dockerfile {dockerfile!r} does not exist")
    tag = spec.image or f"localhost/gagar-task:{_context_hash(context)}"
    with _BUILD_LOCK:
        if image_exists(tag):
            return tag
        argv = [*_engine_argv(), "build", "--network", "none", "-f", dockerfile, "-t", tag]
        if container_engine()[0] == "podman":
            argv.append("--pull=never")
        r = subprocess.run([*argv, context], capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise ValueError(f"building {dockerfile}: {(r.stderr or r.stdout).strip()[-800:]}")
    return tag


def setup_image(base: str, commands: Sequence[str], *, timeout_s: float = 1800.0) -> str:
    """An image derived from ``base`` by running ``commands`` (a task's system setup steps:
    ``apt-get install -y ...``, ``locale-gen ...``) as root, in order, as one ``bash -e``
    script, with the host's network (as SWE-bench builds its images: the package archives must
    be reachable; the tests that run later in the image never have a network). Tagged
    ``localhost/gagar-setup:<hash of base's id and the commands>`` and reused while neither
    changes.

    Raises ContainerUnavailable (no engine), ValueError (no ``base``, or a command failed: the
    task's fault, named with the build's output)."""
    if not image_exists(base):
        raise ValueError(f"image {base!r} is not present locally (no registry here)")
    argv = _engine_argv()
    r = subprocess.run([*argv, "image", "inspect", "--format", "{{.Id}}", base],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    key = hashlib.sha256(f"{r.stdout.strip()}\0{json.dumps(list(commands))}".encode())
    tag = f"localhost/gagar-setup:{key.hexdigest()[:16]}"
    with _BUILD_LOCK:
        if image_exists(tag):
            return tag
        with tempfile.TemporaryDirectory(prefix="gagar_setup_image_") as ctx:
            with open(os.path.join(ctx, "setup.sh"), "w") as f:
                f.write("set -e\nexport DEBIAN_FRONTEND=noninteractive\n")
                f.write("\n".join(commands) + "\n")
            with open(os.path.join(ctx, "Containerfile"), "w") as f:
                f.write(
                    f"FROM {base}\nUSER root\nCOPY setup.sh /.gagar-setup.sh\n"
                    "RUN if command -v bash >/dev/null; then bash -e /.gagar-setup.sh; "
                    "else sh -e /.gagar-setup.sh; fi && rm -f /.gagar-setup.sh\n"
                )
            build = [*argv, "build", "--network", "host", "-f",
                     os.path.join(ctx, "Containerfile"), "-t", tag]  # fmt: skip
            if container_engine()[0] == "podman":
                build.append("--pull=never")
            r = subprocess.run([*build, ctx], capture_output=True, text=True, timeout=timeout_s)
            if r.returncode != 0:
                raise ValueError(
                    f"the setup commands {list(commands)!r} failed on {base}: "
                    f"{(r.stderr or r.stdout).strip()[-1200:]}"
                )
    return tag


def build_base_image(
    tag: str,
    cache_dir: str,
    *,
    packages: Sequence[str] = ("python3", "python3-pytest", "python3-pytest-timeout"),
    suite: str = "bookworm",
) -> str:
    """A base image from Debian packages (no registry needed): ``mmdebstrap --variant=minbase``
    into ``cache_dir/rootfs-<hash>.tar`` (kept: later calls only import it), then ``import``
    as ``tag``. Returns ``tag``; an existing ``tag`` is reused as it is."""
    if image_exists(tag):
        return tag
    key = hashlib.sha256(f"{suite} {' '.join(packages)}".encode()).hexdigest()[:12]
    os.makedirs(cache_dir, exist_ok=True)
    # one builder at a time (concurrent test workers): the others wait, then reuse its image
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if image_exists(tag):
            return tag
        return _build_base_image(tag, os.path.join(cache_dir, f"rootfs-{key}.tar"), packages, suite)


def _build_base_image(tag: str, tar: str, packages: Sequence[str], suite: str) -> str:
    if not os.path.exists(tar):
        tmp = f"{tar[:-4]}.{os.getpid()}.tmp.tar"  # mmdebstrap picks the format by extension
        include = ",".join(packages)
        r = subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={include}", suite, tmp],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if r.returncode != 0:
            raise ContainerUnavailable(f"mmdebstrap: {r.stderr.strip()[-800:]}")
        os.replace(tmp, tar)
    argv = [*_engine_argv(), "import", "--change", "WORKDIR /", tar, tag]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise ContainerUnavailable(f"importing {tar}: {r.stderr.strip()[-800:]}")
    return tag


def _start_script(spec: ContainerSpec, deleted: Sequence[str]) -> str:
    """The start wrapper (PID 1, then exec'd into the command): copies the tree in, writes the
    start marker and closes it, runs the command."""
    wd = shlex.quote(spec.workdir)
    parts = []

    def copy(src: str) -> str:
        # entry by entry: the tmpfs root belongs to root, its times cannot be preserved
        q = shlex.quote(src)
        return (
            f'for f in {q}/* {q}/.[!.]* {q}/..?*; do {{ [ -e "$f" ] || [ -L "$f" ]; }} '
            f'|| continue; cp -dR --preserve=mode,timestamps "$f" {wd}/ || exit {_COPY_EXIT}; done'
        )

    if spec.seed_workdir:
        src = IMAGE_ROOT + spec.workdir
        parts.append(f"{{ [ ! -d {shlex.quote(src)} ] || {{ {copy(src)}; }}; }}")
    parts.append(copy(TREE_SOURCE))
    parts.append(f"cd {wd}")
    if spec.seed_workdir and deleted:
        parts.append("rm -f -- " + " ".join(shlex.quote(p) for p in deleted))
    if spec.activate:
        # in a function: a sourced script sees no positional parameters (a script's own
        # activation has none), not the command's
        parts.append(f"_gagar_activate() {{ {spec.activate}; }} && _gagar_activate >&2")
    steps = " && ".join(parts)
    return (
        f"{{ {steps}; }} || exit {_COPY_EXIT}; "
        f'printf S >&{MARKER_FD}; exec {MARKER_FD}>&-; exec "$@"'
    )


def container_argv(
    image: str,
    spec: ContainerSpec,
    argv: Sequence[str],
    workdir: str,
    limits: Limits,
    uid: int,
    name: str,
    *,
    env: Mapping[str, str] | None = None,
    ro_binds: Mapping[str, str] | None = None,
    tmpfs: Mapping[str, int] | None = None,
    n_fds: int = 0,
    deleted: Sequence[str] = (),
    conmon_pidfile: str | None = None,
) -> list[str]:
    """The engine's command line for one run (see the module docstring)."""
    engine = container_engine()[0]
    nofile, nproc = int(limits.nofile), int(limits.nproc)
    cmd = [
        *_engine_argv(), "run", "--rm", "--name", name, "--network", "none",
        "--user", f"{uid}:{uid}", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--memory", str(int(limits.memory_bytes)),
        "--memory-swap", str(int(limits.memory_bytes)),
        "--pids-limit", str(nproc), "--cpus", f"{limits.cpu_cores:g}",
        "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}",
        "--ulimit", f"cpu={int(limits.cpu_s)}:{int(limits.cpu_s) + 1}",
        "--ulimit", f"fsize={int(limits.file_bytes)}:{int(limits.file_bytes)}",
        "--ulimit", "core=0:0",
        "--read-only", "--shm-size", str(int(limits.shm_bytes)),
        "--tmpfs", f"/tmp:rw,nosuid,nodev,size={int(limits.tmp_bytes)},mode=1777",
        # the work tree: empty (no copy-up of the image's directory there), owned by the run's
        # uid (podman's U; an image's directory keeps its own mode, which tmpfs mode= cannot
        # override), at most disk_bytes
        "--tmpfs",
        f"{spec.workdir}:rw,nosuid,nodev,size={int(limits.disk_bytes)},"
        + ("mode=0700,notmpcopyup,U" if engine == "podman" else "mode=1777"),
        "-v", f"{workdir}:{TREE_SOURCE}:ro",
        "--workdir", "/",
        "--entrypoint", "/bin/bash" if spec.activate else "/bin/sh",
    ]  # fmt: skip  # argv pairs
    if engine == "podman":
        cmd += ["--read-only-tmpfs=false"]
        if conmon_pidfile:
            cmd += ["--conmon-pidfile", conmon_pidfile]
        cmd += ["--preserve-fds", str(n_fds + 1)]
    if spec.seed_workdir:
        cmd += ["--mount", f"type=image,source={image},destination={IMAGE_ROOT}"]
    for host, inside in (ro_binds or {}).items():
        cmd += ["-v", f"{host}:{inside}:ro"]
    for d in spec.site_dirs:
        cmd += ["-v", f"{d}:{d}:ro"]
    if spec.site_dirs:
        env = {**(env or {}), "PYTHONPATH": ":".join(spec.site_dirs)}
    for inside, size in (tmpfs or {}).items():
        own = ",mode=0700,notmpcopyup,U" if engine == "podman" else ",mode=1777"
        cmd += ["--tmpfs", f"{inside}:rw,nosuid,nodev,size={int(size)}{own}"]
    for k, v in {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", **(env or {})}.items():
        cmd += ["-e", f"{k}={v}"]
    cmd += ["-e", "HOME=/tmp", "-e", "TMPDIR=/tmp", "-e", "LANG=C.UTF-8"]
    return cmd + [image, "-c", _start_script(spec, deleted), "sandbox-start", *argv]


def _container_init_pid(conmon_pidfile: str) -> int | None:
    """The container's PID 1 (a child of its conmon process), once started."""
    try:
        with open(conmon_pidfile) as f:
            conmon = int(f.read().strip())
        with open(f"/proc/{conmon}/task/{conmon}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return None
    for k in kids:
        if os.path.isdir(f"/proc/{k}/root{TREE_SOURCE}"):
            return k
    return None


def _tmpfs_full(pid: int | None, workdir: str, limits: Limits) -> bool:
    if pid is None:
        return False
    try:
        st = os.statvfs(f"/proc/{pid}/root{workdir}")
    except OSError:
        return False
    if st.f_files and st.f_files - st.f_ffree > limits.disk_files:
        return True
    return st.f_bavail * st.f_frsize < min(_TMPFS_FULL_BYTES, limits.disk_bytes // 4)


def _kill(name: str) -> None:
    """Kills and removes the container ``name`` (every process in it), whatever its state."""
    argv = _engine_argv()
    for sub in (["kill", "--signal", "KILL", name], ["rm", "-f", name]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*argv, *sub], capture_output=True, timeout=60)


def _high_dup(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)


def run_in_container(
    argv: Sequence[str],
    workdir: str,
    limits: Limits,
    spec: ContainerSpec,
    *,
    image: str | None = None,
    config: SandboxConfig | None = None,
    env: Mapping[str, str] | None = None,
    ro_binds: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    deleted: Sequence[str] = (),
    tmpfs: Mapping[str, int] | None = None,
) -> SandboxResult:
    """Runs untrusted ``argv`` in a fresh container of ``spec`` (the container counterpart of
    ``sandbox.run_sandboxed``; see the module docstring).

    Args:
      argv: the command, run in ``spec.workdir`` holding a private copy of ``workdir``.
      workdir: the host tree (read-only inside; never written).
      limits: resource limits (``wall_s``: the whole container is killed at it).
      spec: image, interpreter and work directory.
      image: the image to run (default: ``ensure_image(spec)``).
      config: slot settings (each concurrent run gets its own uid, as under bwrap).
      env: environment variables besides the image's own.
      ro_binds: ``{host path: path inside}`` bound read-only.
      tmpfs: ``{path inside: bytes}``: more private writable directories of those sizes.
      pass_fds: descriptors the command inherits, as ``inside_fd(0)``, ``inside_fd(1)``, ...
      deleted: tree paths removed after seeding (``spec.seed_workdir``).

    Returns a SandboxResult (``mechanism="container"``); an engine that fails to start the
    container, or a tree that does not fit the quota, is ``infra_error``.
    """
    config = config or SandboxConfig()
    t0 = time.monotonic()

    def infra(msg: str) -> SandboxResult:
        return SandboxResult(
            "infra_error", None, None, "", "", False, False, time.monotonic() - t0,
            MECHANISM, ISOLATION, (), msg,
        )  # fmt: skip  # positional fields, as sandbox.py's

    try:
        image = image or ensure_image(spec)
    except (ContainerUnavailable, ValueError, OSError, subprocess.SubprocessError) as e:
        return infra(f"image: {e}")
    name = f"gagar-{secrets.token_hex(8)}"
    marker_r, marker_w = os.pipe()
    highs: list[int] = []
    try:
        with _slot(config) as slot, tempfile.TemporaryDirectory(prefix="gagar_ctr_io_") as io:
            os.chmod(io, 0o700)
            uid = config.uid_base + slot
            conmon = os.path.join(io, "conmon.pid")
            cmd = container_argv(
                image, spec, argv, workdir, limits, uid, name,
                env=env, ro_binds=ro_binds, tmpfs=tmpfs, n_fds=len(pass_fds),
                deleted=deleted,
                conmon_pidfile=conmon,
            )  # fmt: skip
            # The engine hands on descriptors 3, 4, ...: the marker, then pass_fds in order.
            # Dup'd high first, so the renumbering never overwrites a source.
            highs = [_high_dup(fd) for fd in (marker_w, *pass_fds)]
            redirs = " ".join(f"{MARKER_FD + i}>&{h}" for i, h in enumerate(highs))
            shell = ["/bin/bash", "-c", f'exec "$@" {redirs}', "container-fds", *cmd]
            out_p, err_p = os.path.join(io, "stdout"), os.path.join(io, "stderr")
            timed_out = disk_hit = False
            with open(out_p, "wb") as out, open(err_p, "wb") as err:
                try:
                    # cwd: conmon drops an ``oom`` file in its working directory when the
                    # kernel's OOM killer ends the container (read below)
                    proc = subprocess.Popen(
                        shell,
                        cwd=io,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=tuple(highs),
                    )
                except OSError as e:
                    return infra(f"could not start the container engine: {e}")
                finally:
                    for h in highs:
                        os.close(h)
                    highs = []
                    os.close(marker_w)
                    marker_w = -1
                deadline = t0 + limits.wall_s
                pid = None
                while True:
                    try:
                        rc = proc.wait(
                            timeout=max(0.0, min(_DISK_POLL_S, deadline - time.monotonic()))
                        )
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    pid = pid or _container_init_pid(conmon)
                    if _tmpfs_full(pid, spec.workdir, limits):
                        disk_hit = True
                        break
                    if time.monotonic() >= deadline:
                        timed_out = True
                        break
                if timed_out or disk_hit:
                    _kill(name)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                if timed_out or disk_hit:
                    _kill(name)  # an engine killed mid-start may have left it behind
            wall = time.monotonic() - t0
            os.set_blocking(marker_r, False)
            try:
                started = os.read(marker_r, 1) == b"S"
            except BlockingIOError:
                started = False
            oom = os.path.exists(os.path.join(io, "oom"))
            stdout, out_trunc = _read_capped(out_p, limits.output_bytes)
            stderr, err_trunc = _read_capped(err_p, limits.output_bytes)
            out_size, err_size = os.path.getsize(out_p), os.path.getsize(err_p)
    except (OSError, TimeoutError) as e:
        return infra(f"slot: {e}")
    finally:
        os.close(marker_r)
        if marker_w >= 0:
            os.close(marker_w)
        for h in highs:
            os.close(h)
    return _verdict(
        rc, started, timed_out, disk_hit, stdout, stderr, out_trunc, err_trunc, wall, limits,
        max(out_size, err_size), oom,
    )  # fmt: skip


def _verdict(
    rc, started, timed_out, disk_hit, stdout, stderr, out_trunc, err_trunc, wall, limits, size,
    oom=False,
):  # fmt: skip
    hits: list[str] = []
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else None)
    if sig == signal.SIGXCPU:
        hits.append("cpu")
    if sig == signal.SIGXFSZ or size >= limits.file_bytes:
        hits.append("file_size")
    if oom:
        hits.append("memory")  # the memory cgroup's OOM killer (conmon's record of it)
    elif sig == signal.SIGKILL and not timed_out and not disk_hit:
        hits.append("cpu")  # RLIMIT_CPU's hard limit: nothing else inside can SIGKILL PID 1
    if disk_hit:
        hits.append("disk")
    if timed_out:
        hits.append("wall")
    error = None
    if not started:
        status = "infra_error"
        error = (
            f"container did not start within {limits.wall_s} s"
            if timed_out
            else f"container did not start (rc {rc}): {stderr.strip()[-500:]}"
        )
    elif disk_hit:
        status = "resource_killed"
    elif timed_out:
        status = "timeout"
    elif rc == 0:
        status = "passed"
    elif hits:
        status = "resource_killed"
    else:
        status = "failed"
    return SandboxResult(
        status, rc if rc >= 0 else 128 - rc, sig, stdout, stderr, out_trunc, err_trunc, wall,
        MECHANISM, ISOLATION, tuple(hits), error,
    )  # fmt: skip


def container_problem(
    spec: ContainerSpec, image: str | None = None, *, timeout: bool = False
) -> str | None:
    """None if a container of ``spec`` can start and its interpreter imports pytest, else why
    (an ``infra_error`` of every verification on it, never the candidate's failure). An image
    without pytest-timeout (an environment SWE-bench's harness built need not have it) is no
    problem: its runs go without the per-test timeout (:func:`image_has_pytest_timeout`), the
    wall limit still kills the whole container. Definitive answers are cached. ``timeout`` is
    accepted for callers that ask about it and changes nothing."""
    del timeout
    try:
        image = image or ensure_image(spec)
    except (ContainerUnavailable, ValueError, OSError, subprocess.SubprocessError) as e:
        return f"no container image: {e}"
    return _probe(image, spec)[0]


def image_has_pytest_timeout(spec: ContainerSpec, image: str | None = None) -> bool:
    """Whether the interpreter of ``spec`` imports pytest-timeout (a task's per-test timeout
    needs it); False when the image cannot be probed (``container_problem`` says why)."""
    try:
        image = image or ensure_image(spec)
    except (ContainerUnavailable, ValueError, OSError, subprocess.SubprocessError):
        return False
    return _probe(image, spec)[1]


_PROBES: dict[tuple, tuple[str | None, bool]] = {}
_PROBE_LOCK = threading.Lock()
_PROBE_CODE = (
    "import sys\nprint('python%d.%d' % sys.version_info[:2])\n"
    "import pytest\ntry:\n    import pytest_timeout\nexcept ImportError:\n"
    "    print('no-pytest-timeout')\nelse:\n    print('pytest-timeout')\n"
)


def _probe(image: str, spec: ContainerSpec) -> tuple[str | None, bool]:
    """(why a container of ``spec`` cannot run the tests or None, whether it has
    pytest-timeout), cached when definitive."""
    key = (image, spec)
    with _PROBE_LOCK:
        if key in _PROBES:
            return _PROBES[key]
        with tempfile.TemporaryDirectory(prefix="gagar_ctr_check_") as d:
            os.chmod(d, 0o755)
            r = run_in_container(
                [spec.python, "-c", _PROBE_CODE],
                d,
                Limits(wall_s=120, cpu_s=120),
                spec,
                image=image,
            )
        if r.status in ("infra_error", "timeout"):
            why = f"the container could not run the pytest check ({r.status}): {r.error or ''}"
            return why, False
        lines = r.stdout.strip().splitlines()
        built = {
            m.group(1) for d in spec.site_dirs for m in [re.search(r"/lib/(python[\d.]+)/", d)] if m
        }
        if built and lines[:1] and built != {lines[0]}:
            out = (
                f"the task's environment was built for {', '.join(sorted(built))}, the "
                f"interpreter {spec.python} of {image} is {lines[0]}",
                False,
            )
        elif not r.passed:
            out = (f"pytest not importable by {spec.python} in {image}: {r.stderr[-300:]}", False)
        else:
            out = (None, lines[-1:] == ["pytest-timeout"])
        _PROBES[key] = out
        return out


# Lists, inside the container, what the interpreter's sys.path offers outside the work tree:
# {dotted name: [kind, directory]}, kind "module" (a module or regular package) or "namespace"
# (a directory without __init__.py, followed down); a regular module anywhere wins, as the
# import system resolves it. Runs on any Python 3.
_LIST_MODULES = r"""
import json, os, sys
wd = os.path.realpath(sys.argv[1])
out = {}
def add(name, kind, d):
    if name not in out or (out[name][0] == "namespace" and kind == "module"):
        out[name] = [kind, d]
def scan(d, prefix, depth):
    try:
        entries = sorted(os.listdir(d))
    except OSError:
        return
    for e in entries:
        p = os.path.join(d, e)
        if os.path.isdir(p):
            if not e.isidentifier():
                continue
            if os.path.isfile(os.path.join(p, "__init__.py")):
                add(prefix + e, "module", d)
            else:
                add(prefix + e, "namespace", d)
                if depth < 4:
                    scan(p, prefix + e + ".", depth + 1)
        elif e.endswith((".py", ".pyc", ".so", ".pyd")):
            name = e.split(".", 1)[0]
            if name.isidentifier():
                add(prefix + name, "module", d)
for d in sys.path:
    if not d:
        continue
    r = os.path.realpath(d)
    if r == wd or r.startswith(wd + "/") or not os.path.isdir(r):
        continue
    scan(r, "", 0)
print(json.dumps(out))
"""
_MODULES: dict[tuple, dict[str, tuple[str, str]]] = {}


def image_modules(
    spec: ContainerSpec, image: str | None = None
) -> dict[str, tuple[str, str]] | None:
    """What the interpreter of ``spec`` imports from the image, outside the work directory:
    ``{dotted name: (kind, directory)}``, kind ``"module"`` (a module or a regular package) or
    ``"namespace"`` (a namespace portion, followed down four levels). A candidate's new module
    must not shadow any of them (``verify.repo.shadowing_problem``), as it must not shadow what
    the bwrap sandbox's environment holds. Cached per (image, spec); None when the image cannot
    be probed (``container_problem`` then says why)."""
    try:
        image = image or ensure_image(spec)
    except (ContainerUnavailable, ValueError, OSError, subprocess.SubprocessError):
        return None
    key = (image, spec)
    with _PROBE_LOCK:
        if key in _MODULES:
            return _MODULES[key]
        with tempfile.TemporaryDirectory(prefix="gagar_ctr_modules_") as d:
            os.chmod(d, 0o755)
            r = run_in_container(
                [spec.python, "-c", _LIST_MODULES, spec.workdir],
                d,
                Limits(wall_s=120, cpu_s=120),
                dataclasses.replace(spec, seed_workdir=False),
                image=image,
            )
        if not r.passed:
            return None
        try:
            listing = json.loads(r.stdout.strip().splitlines()[-1])
            out = {str(k): (str(v[0]), str(v[1])) for k, v in listing.items()}
        except (ValueError, IndexError, TypeError, KeyError):
            return None
        _MODULES[key] = out
        return out


DEFAULT_IMAGE = "localhost/gagar-base:bookworm"
DEFAULT_SPEC = ContainerSpec(image=DEFAULT_IMAGE)


def container_spec(
    task, environment: str | None = None, container: ContainerSpec | None = None
) -> ContainerSpec | None:
    """The container a verification of ``task`` runs in, or None (the bwrap sandbox).

    ``environment`` "uv": None; "container": ``container``, else the task's own (its
    ``image``/``dockerfile``, ``image_python`` and ``image_workdir``: a task whose image holds
    the repository names its work directory, which is then seeded from the image), else
    ``DEFAULT_SPEC``; None: "container" when the task names an image or a Dockerfile."""
    image = getattr(task, "image", "") or ""
    dockerfile = getattr(task, "dockerfile", "") or ""
    if environment is None:
        environment = "container" if (image or dockerfile or container) else "uv"
    if environment not in ENVIRONMENTS:
        raise ValueError(f"environment must be one of {ENVIRONMENTS}, got {environment!r}")
    if environment == "uv":
        return None
    if container is not None:
        return container
    workdir = getattr(task, "image_workdir", "") or ""
    # the task's uv environment, unless the image holds the repository and its own environment
    sites = () if workdir else _site_dirs(getattr(task, "env_path", "") or "")
    if not (image or dockerfile):
        return dataclasses.replace(DEFAULT_SPEC, site_dirs=sites) if sites else DEFAULT_SPEC
    python = getattr(task, "image_python", "") or "python3"
    return ContainerSpec(
        image=image,
        dockerfile=dockerfile,
        python=python,
        workdir=workdir or "/workdir",
        seed_workdir=bool(workdir),
        activate=conda_activation(python),
        site_dirs=sites,
    )


def _site_dirs(env_path: str) -> tuple[str, ...]:
    """The site-packages directories of the virtual environment ``env_path`` (none for "")."""
    if not env_path:
        return ()
    lib = os.path.join(os.path.abspath(env_path), "lib")
    names = sorted(os.listdir(lib)) if os.path.isdir(lib) else []
    found = [os.path.join(lib, n, "site-packages") for n in names if n.startswith("python")]
    return tuple(d for d in found if os.path.isdir(d))


def conda_activation(python: str) -> str:
    """How an image's evaluation script activates the conda environment of ``python``
    (``<conda root>/envs/<name>/bin/python``: ``source <conda root>/bin/activate && conda
    activate <name>``, as SWE-bench's eval scripts do, where the image has that script; an
    image without it runs the interpreter as it is), or "" for any other interpreter."""
    m = re.fullmatch(r"(/[^\0]+?)/envs/([\w.+-]+)/bin/python[\d.]*", python)
    if not m:
        return ""
    script = shlex.quote(m.group(1) + "/bin/activate")
    return f"if [ -f {script} ]; then source {script} && conda activate {m.group(2)}; fi"
