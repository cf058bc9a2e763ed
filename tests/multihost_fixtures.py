"""Starts the training script as several ``jax.distributed`` processes on this machine.

Each process is one "host" with one CPU device (``--xla_force_host_platform_device_count=1``),
configured exactly as a user would: ``JAX_COORDINATOR_ADDRESS`` (a free loopback port),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` in the environment, the same command line on every
host. Collectives between the processes are gloo over loopback (JAX's CPU default).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
TOY_CONFIG = os.path.join(ROOT, "configs", "toy_gagar.py")
POD_CONFIG = os.path.join(ROOT, "configs", "tpu_pod.py")
# One compilation cache for every multi-process run of the tests (same programs each time).
JAX_CACHE = os.path.join(tempfile.gettempdir(), "gagar_jax_test_multihost_jax_cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_env(
    process_id: int, num_processes: int, port: int, *, devices_per_host: int = 1, **extra: str
) -> dict[str, str]:
    """The environment of one host: its JAX_* variables, CPU devices, this checkout first."""
    env = dict(os.environ)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(process_id),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_host}",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def launch(
    workdir: str,
    *args: str,
    num_processes: int = 2,
    config: str = TOY_CONFIG + ":smoke",
    log_dir: str | None = None,
    env_extra: dict[str, str] | None = None,
    devices_per_host: int = 1,
) -> list[subprocess.Popen]:
    """Starts ``scripts/train.py`` on every host (``devices_per_host`` CPU devices each); host i
    logs to ``log_dir/i.log``."""
    port = free_port()
    log_dir = log_dir or workdir + ".logs"
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    for i in range(num_processes):
        cmd = [
            sys.executable,
            SCRIPT,
            f"--config={config}",
            f"--workdir={workdir}",
            f"--compilation_cache={JAX_CACHE}",
            *args,
        ]
        log = open(os.path.join(log_dir, f"{i}.log"), "w")  # noqa: SIM115 (closed by wait_all)
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=host_env(
                i, num_processes, port, devices_per_host=devices_per_host, **(env_extra or {})
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        p.log_path = log.name
        p.log_file = log
        procs.append(p)
    return procs


def read_log(proc) -> str:
    if not proc.log_file.closed:
        proc.log_file.flush()
    with open(proc.log_path, encoding="utf-8", errors="replace") as f:
        return f.read()


def wait_all(procs, timeout: float) -> list[str]:
    """Waits for every host (killing the rest on timeout); returns their logs."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.log_file.close()
    return [read_log(p) for p in procs]
