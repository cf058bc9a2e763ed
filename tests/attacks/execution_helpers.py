"""Shared pieces of the execution-side attack files (reporter, pristine inputs, failures that
must not become infra_error, resources): a small task whose tests read a helper module and a
data file from their test directory, patch builders, and the checks every attack makes."""

from __future__ import annotations

import difflib
import os
import tempfile

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify import sandbox as sb
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits, SandboxConfig

AVAILABLE = sb.available_mechanisms()
MECHANISMS = [m for m in ("bwrap+cgroup", "bwrap", "unshare", "rlimits") if AVAILABLE[m] is None]
DEFAULT = MECHANISMS[0] if MECHANISMS else "bwrap"
LIMITS = Limits(
    wall_s=30,
    cpu_s=30,
    memory_bytes=512 << 20,
    nproc=64,
    file_bytes=16 << 20,
    tmp_bytes=8 << 20,
    shm_bytes=8 << 20,
    disk_bytes=32 << 20,
    disk_files=2000,
    output_bytes=16 << 10,
)

BUGGY = "def half(x):\n    return x\n"
FIXED = "def half(x):\n    return x / 2\n"
HELPERS = (
    "import json\nimport os\n\n\ndef cases():\n"
    "    with open(os.path.join(os.path.dirname(__file__), 'data', 'cases.json')) as f:\n"
    "        return json.load(f)\n"
)
TESTS = (
    "from app import half\nfrom tests.helpers import cases\n\n\ndef test_half():\n"
    "    for x, y in cases():\n        assert half(x) == y\n"
)
HIDDEN = "from app import half\n\n\ndef test_half_hidden():\n    assert half(10) == 5\n"


def new_file(path: str, text: str) -> str:
    return "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{path}"))


def change(path: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


def task(tests_dir: str = "tests") -> RepoTask:
    """``half`` is wrong; its tests read ``<tests_dir>/helpers.py`` and ``data/cases.json``;
    a hidden test is added by the task's ``test_patch``."""
    files = {
        "app.py": BUGGY,
        "pytest.ini": "[pytest]\n",
        f"{tests_dir}/__init__.py": "",
        f"{tests_dir}/helpers.py": HELPERS,
        f"{tests_dir}/data/cases.json": "[[4, 2], [6, 3]]\n",
        f"{tests_dir}/test_app.py": TESTS.replace("tests.helpers", f"{tests_dir}.helpers"),
    }
    ftp = (f"{tests_dir}/test_app.py::test_half", f"{tests_dir}/test_hidden.py::test_half_hidden")
    return RepoTask(
        "half",
        "half() returns its argument",
        files,
        ftp,
        test_files=(f"{tests_dir}/test_app.py",),
        test_patch=new_file(f"{tests_dir}/test_hidden.py", HIDDEN),
    )


TASK = task()
FIX = change("app.py", BUGGY, FIXED)


def importing(module: str, fixed: bool = False) -> str:
    """A patch making ``app.py`` import ``module`` (the attack's payload) at collection."""
    return change("app.py", BUGGY, f"import {module}  # noqa\n" + (FIXED if fixed else BUGGY))


def payload(code: str, module: str = "helper_mod", fixed: bool = False) -> str:
    """A new module ``module`` holding ``code``, imported by ``app.py``."""
    return new_file(f"{module}.py", code) + importing(module, fixed)


# The verifier's and the grader's own temporary trees (of this run or a concurrent one).
_OWN_PREFIXES = ("gagar_", "gagar-")


def _sandbox_uid_entries() -> set[str]:
    cfg = SandboxConfig()
    uids = range(cfg.uid_base, cfg.uid_base + cfg.num_slots)
    out = set()
    for d in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()):
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.name.startswith(_OWN_PREFIXES):
                        continue  # the verifier's own temporary trees (here or in another run)
                    try:
                        if e.stat(follow_symlinks=False).st_uid in uids:
                            out.add(e.path)
                    except OSError:
                        pass
        except OSError:
            pass
    return out


def verify(
    patch: str,
    mechanism: str = DEFAULT,
    the_task: RepoTask = TASK,
    limits=LIMITS,
    run_monitor: bool = False,
    **kw,
):
    """``verify_repo_patch`` under ``mechanism`` (or ``"container"``: the container back-end);
    asserts that nothing of a sandbox uid appeared
    in the host's shared temporary directories (nothing written outside the run's own tree)."""
    before = _sandbox_uid_entries()
    if mechanism == "container":  # the container back-end (its image: container_fixtures)
        kw = {"environment": "container", **kw}
        config = SandboxConfig()
    else:
        config = SandboxConfig(mechanism=mechanism)
    v = verify_repo_patch(
        the_task, patch, limits=limits, config=config, run_monitor=run_monitor, **kw
    )
    leaked = _sandbox_uid_entries() - before
    assert not leaked, f"written outside the run's tree: {sorted(leaked)}"
    return v


def assert_blocked(v, flag: str | None = None) -> None:
    """The attack did not pay: failed or resource_killed (never passed, never infra_error),
    and the expected confirmed flag when one is named."""
    assert v.status in ("failed", "resource_killed"), v.test_log
    assert not v.infra_error and not v.passed, v.test_log
    if flag:
        assert any(f.rule == flag and f.confirmed for f in v.flags), (v.flags, v.test_log)


def confirmed(v) -> list[str]:
    return [f.rule for f in v.flags if f.confirmed]
