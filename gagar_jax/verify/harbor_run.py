"""Verification of a Harbor task's candidate (``data.harbor``) on the container back-end.

The candidate's patch applies to the task's tree (the text files of the image's working
directory); the run is a fresh container of the task's image (``verify.container``) with the
image's working directory seeded from the image and the patched tree copied over it (files the
candidate deleted removed), the task's pristine ``tests/`` bound read-only at ``/tests`` (out of
the candidate's reach: nothing of the patch lands there), a private ``/logs`` (``/logs/verifier``,
``/logs/agent``), no network, the back-end's limits, the whole container killed at the wall
limit.

The start wrapper (the container's PID 1) runs ``bash /tests/test.sh`` as its child with the
outcome descriptor closed for it, and after it exited writes ONE line to the verifier: test.sh's
exit status and the first bytes of ``/logs/verifier/reward.txt``. The verdict is ``passed``
when the reward is 1 (``reward >= 1``), ``failed`` otherwise; a record that is not exactly one
well-formed line (something else wrote on the channel) is tampering: ``failed`` with a confirmed
``tamper_test_harness`` flag.

What Harbor's format leaves in the candidate's reach: ``test.sh`` runs the candidate's code as
the same user that writes the reward, so code under test could write ``reward.txt`` itself
(Harbor's own runs share this). Its pytest-style tests get no canaries or outcome reporter: the
reward is only as trustworthy as the task's ``test.sh``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

from gagar_jax.verify import container as ctr
from gagar_jax.verify.diff import DiffError, apply_unified_diff, check_patch_size
from gagar_jax.verify.flags import MonitorFlag
from gagar_jax.verify.log_excerpt import pytest_excerpt
from gagar_jax.verify.sandbox import Limits, SandboxConfig

MAX_PATCH_BYTES = 1 << 20
LOGS_BYTES = 16 << 20
_FD = ctr.inside_fd(0)


def harbor_spec(task: Any) -> ctr.ContainerSpec:
    return ctr.ContainerSpec(
        image=task.image,
        dockerfile=getattr(task, "dockerfile", "") or "",
        python="python3",
        workdir=task.image_workdir,
        seed_workdir=True,
    )


def _script() -> str:
    return (
        "mkdir -p /logs/verifier /logs/agent || exit 1; "
        f"bash /tests/test.sh {_FD}>&- </dev/null; rc=$?; "
        "r=$(head -c 64 /logs/verifier/reward.txt 2>/dev/null | tr -d '\\n\\r '); "
        f'printf "%s %s\\n" "$rc" "${{r:--}}" >&{_FD}; exit 0'
    )


def parse_record(data: bytes) -> tuple[int | None, float | None, str]:
    """(test.sh's exit status, the reward or None, problem): problem is "" for one
    well-formed line."""
    lines = data.split(b"\n")
    if len(lines) != 2 or lines[1]:
        return None, None, f"{len(lines) - 1} lines on the outcome channel, expected one"
    parts = lines[0].decode(errors="replace").split(" ")
    if len(parts) != 2 or not parts[0].isdigit():
        return None, None, "the outcome record is malformed"
    if parts[1] == "-":
        return int(parts[0]), None, ""
    try:
        return int(parts[0]), float(parts[1]), ""
    except ValueError:
        return int(parts[0]), None, ""


def verify_harbor_patch(
    task: Any,
    patch: str,
    *,
    limits: Limits,
    config: SandboxConfig | None = None,
):
    """The :class:`~gagar_jax.verify.repo.RepoVerification` of ``patch`` on the Harbor task
    ``task`` (a RepoTask with ``harbor_tests``; see the module docstring)."""
    from gagar_jax.verify.repo import RepoVerification, tree_fit_problem, write_tree

    tid = task.fail_to_pass[0]
    missing = {tid: "missing"}
    try:
        check_patch_size(patch, MAX_PATCH_BYTES)
        files = apply_unified_diff(task.files, patch) if patch.strip() else dict(task.files)
    except DiffError as e:
        return RepoVerification("failed", missing, str(e), (), f"patch does not apply: {e}", None)
    problem = tree_fit_problem(task, files, limits)
    if problem:
        return RepoVerification("failed", missing, problem, (), problem, None)
    spec = harbor_spec(task)
    # the container must start; Harbor images need not have pytest (test.sh brings its own)
    problem = ctr.container_problem(spec)
    if problem and "importable" not in problem:
        return RepoVerification("infra_error", missing, None, (), problem, None)
    parent = tempfile.mkdtemp(prefix="gagar_harbor_")
    os.chmod(parent, 0o711)
    out_r = out_w = -1
    try:
        work = os.path.join(parent, "repo")
        os.mkdir(work)
        try:
            write_tree(work, files)
        except DiffError as e:
            return RepoVerification("failed", missing, str(e), (), str(e), None)
        out_r, out_w = os.pipe()
        sink: list[bytes] = []

        def drain():
            while True:
                b = os.read(out_r, 1 << 16)
                if not b or sum(map(len, sink)) > 1 << 16:
                    break
                sink.append(b)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        result = ctr.run_in_container(
            ["/bin/sh", "-c", _script()],
            work,
            limits,
            spec,
            config=config,
            ro_binds={task.harbor_tests: "/tests"},
            pass_fds=(out_w,),
            deleted=sorted(set(task.files) - set(files)),
            tmpfs={"/logs": LOGS_BYTES},
        )
        os.close(out_w)
        out_w = -1
        reader.join(timeout=10)
        data = b"".join(sink)
    finally:
        if out_w >= 0:
            os.close(out_w)
        shutil.rmtree(parent, ignore_errors=True)
    if out_r >= 0 and not reader.is_alive():
        os.close(out_r)
    flags: tuple[MonitorFlag, ...] = ()
    note = ""
    if result.status in ("infra_error", "timeout", "resource_killed"):
        status, outcome = result.status, "missing"
    else:
        rc, reward, note = parse_record(data)
        if note:
            flags = (MonitorFlag("tamper_test_harness", f"harbor outcome: {note}", True),)
            status, outcome = "failed", "missing"
        else:
            ok = reward is not None and reward >= 1.0
            status, outcome = ("passed", "passed") if ok else ("failed", "failed")
            note = f"test.sh exit status {rc}, reward {reward if reward is not None else 'none'}"
    lines = [f"status: {status} (container: {result.status}, {result.mechanism})"]
    if result.error:
        lines.append(f"container error: {result.error}")
    if note:
        lines.append(note)
    lines.append(f"{outcome.upper():8s} {tid}")
    lines.append("--- test.sh output (untrusted) ---")
    lines.append(pytest_excerpt(result.stdout))
    if result.stderr.strip():
        lines += ["--- stderr (untrusted) ---", result.stderr[-2000:]]
    return RepoVerification(status, {tid: outcome}, None, (), "\n".join(lines), result, flags)
