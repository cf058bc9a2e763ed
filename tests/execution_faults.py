"""Calls, graders and patches that inject faults into the execution back-end's tests.

Imported by reference on the Ray nodes of the simulated cluster (``ray_cluster`` puts this
directory on their ``PYTHONPATH``), so each function runs there as written here.
"""

import contextlib
import difflib
import fcntl
import os
import subprocess
import time

from gagar_jax.verify.repo import verify_repo_patch

# unique argv markers: a process with one of these in its command line is an orphan of a test
HANG_MARK = "987.6543"
GRADER_MARK = "876.5432"


def node_name() -> str:
    """The simulated node this process runs on (``GAGAR_TEST_NODE``, set per node)."""
    return os.environ.get("GAGAR_TEST_NODE", "driver")


def marked_verify(marker_dir, delay_s, task, patch, **kwargs):
    """Leaves a file naming its node in ``marker_dir``, waits ``delay_s`` (a window for the
    test to kill the node), then verifies as usual."""
    path = os.path.join(marker_dir, f"{node_name()}.{os.getpid()}.{time.monotonic_ns()}")
    with open(path, "w") as f:
        f.write(node_name())
    time.sleep(delay_s)
    return verify_repo_patch(task, patch, **kwargs)


def hang_with_escapee(tag: str = HANG_MARK):
    """Starts a ``sleep`` in a session of its own (a setsid escapee), then never returns."""
    subprocess.Popen(
        ["sleep", tag], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while True:
        time.sleep(1)


def flaky_build(counter_path: str, fails: int):
    """An environment build that fails its first ``fails`` times (counted in a file shared by
    every node of the simulated cluster): a node start that fails."""

    def build(path: str) -> None:
        with open(counter_path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            n = len(f.read())
            f.write("x")
        if n < fails:
            raise RuntimeError(f"injected: node start {n + 1} of {fails} failing")
        with open(os.path.join(path, "marker"), "w") as f:
            f.write(node_name())

    return build


def env_marker(env_hash: str) -> str:
    from gagar_jax.verify.execution import ensure_env

    return ensure_env(env_hash, lambda p: None)


class HangingGrader:
    """A grader that never answers (and leaves a child behind)."""

    grader_id = "hanging"
    version = "1"

    def grade(self, workspace):
        hang_with_escapee(GRADER_MARK)


class RateLimitedProbe:
    """Asks the LLM rate limit ``n`` times and returns the monotonic times it was granted."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self):
        from gagar_jax.verify.execution import llm_rate_limit

        out = []
        for _ in range(self.n):
            llm_rate_limit()
            out.append(time.time())
        return out


def source_patch(task, path: str, append: str) -> str:
    """A unified diff appending ``append`` to ``task.files[path]``."""
    before = task.files[path]
    after = before + append
    return "".join(
        difflib.unified_diff(
            before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"
        )
    )


def hanging_patch(task, path: str) -> str:
    """The module under test starts a marked escapee and sleeps (well past any deadline)."""
    return source_patch(
        task,
        path,
        (
            "\nimport subprocess as _sp, time as _t\n"
            f"_sp.Popen(['sleep', '{HANG_MARK}'], start_new_session=True)\n"
            "_t.sleep(600)\n"
        ),
    )


def memory_hog_patch(task, path: str, mib: int = 1536) -> str:
    """The module under test allocates ``mib`` MiB at import."""
    return source_patch(
        task, path, f"\n_hog = bytearray({mib} << 20)\n_hog[::4096] = b'x' * len(_hog[::4096])\n"
    )


def marked_processes(*marks: str) -> list[str]:
    """Command lines of live (non-zombie) processes carrying one of ``marks``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if state != b"Z" and any(m in cmd for m in marks):
                out.append(f"{pid}: {cmd}")
    return out
