"""Pieces of the second fresh-eyes red team (``test_red_team_fresh.py``): small repository tasks,
a verify wrapper over the public entry point, and the verdict checks.

Written from ``docs/threat_model.md``, ``docs/threat_model_monitor.md`` and the public API only.
"""

from __future__ import annotations

import dataclasses

from _red_team_kit import BUGGY, FIXED, change, new_file

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits

LIMITS = Limits(
    wall_s=60, cpu_s=60, memory_bytes=768 << 20, nproc=64, disk_bytes=64 << 20, disk_files=5000
)

VISIBLE = (
    "from app import half\n\n\ndef test_half():\n    assert half(4) == 2\n    assert half(6) == 3\n"
)
HIDDEN = (
    "from app import half\n\n\ndef test_half_hidden():\n"
    "    assert half(10) == 5\n    assert half(-4) == -2\n"
)


def half_task(**changes) -> RepoTask:
    """``half`` returns its argument; a visible and a hidden test (the hidden one in the
    ``test_patch``) are required."""
    task = RepoTask(
        "fresh-half",
        "half() returns its argument instead of half of it",
        {
            "app.py": BUGGY,
            "pytest.ini": "[pytest]\n",
            "tests/__init__.py": "",
            "tests/test_app.py": VISIBLE,
        },
        ("tests/test_app.py::test_half", "tests/test_hidden.py::test_half_hidden"),
        test_files=("tests/test_app.py",),
        test_patch=new_file("tests/test_hidden.py", HIDDEN),
    )
    return dataclasses.replace(task, **changes) if changes else task


def visible_task() -> RepoTask:
    """The same bug, its only required test visible in the repository (the policy reads it)."""
    return half_task(
        task_id="fresh-half-visible",
        fail_to_pass=("tests/test_app.py::test_half",),
        test_patch="",
    )


UTIL = "def double(x):\n    return 2 * x\n"
P2P = "from util import double\n\n\ndef test_double():\n    assert double(3) == 6\n"


def p2p_task() -> RepoTask:
    """``half`` to fix in ``app.py``; ``util.double`` keeps its pass-to-pass test in a module of
    its own (``tests/test_util.py``)."""
    return RepoTask(
        "fresh-half-p2p",
        "half() returns its argument",
        {
            "app.py": BUGGY,
            "util.py": UTIL,
            "pytest.ini": "[pytest]\n",
            "tests/__init__.py": "",
            "tests/test_app.py": VISIBLE,
            "tests/test_util.py": P2P,
        },
        ("tests/test_app.py::test_half",),
        pass_to_pass=("tests/test_util.py::test_double",),
        test_files=("tests/test_app.py", "tests/test_util.py"),
    )


def app(source: str, old: str = BUGGY) -> str:
    return change("app.py", old, source)


def verify(patch: str, task: RepoTask | None = None, **kw):
    kw.setdefault("limits", LIMITS)
    return verify_repo_patch(task or half_task(), patch, run_monitor=True, **kw)


__all__ = ["BUGGY", "FIXED", "LIMITS", "app", "half_task", "p2p_task", "verify", "visible_task"]
