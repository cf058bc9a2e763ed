"""Attack class: verdict rules the candidate can steer, and siblings starved of CPU.

- A pass-to-pass regression turned into a skip by the code under test (``unittest.SkipTest``,
  ``pytest.importorskip``): a pass-to-pass test is judged against its outcome on the pristine
  repository, so a skip after a pass there is a regression (``failed``), while a test the
  pristine repository skips too still may be skipped.
- A tree that cannot be materialised (a path 1,200 directories deep, more entries than
  ``disk_files``, more bytes than ``disk_bytes``): refused before anything is written, in bounded
  time, as the candidate's ``failed`` (never ``infra_error``).
- The per-test timeout disarmed by the code under test (pytest-timeout's alarm lives in the
  test process: ``setitimer(0)``, ``SIGALRM`` ignored or blocked, a forged early ``finish``
  line): the timeout is kept by the runner's supervisor on its own clock, so a test past it
  fails (or, still running, gets the test process killed: ``timeout``) whatever the process did.
- A candidate whose code stalls the grader's ``run_check``: the time a check runs a candidate's
  code is not charged to the vote's time budget but to a check budget of its own, and each
  check runs at most what is left of it, so the group still gets its verdict.
- CPU-bound children of one run in sessions of their own: each sandbox slot has its own CPU
  cgroup with a CFS quota (``Limits.cpu_cores``), so the scheduler shares the CPU between runs,
  not between processes.
"""

import dataclasses
import functools
import glob
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    BUGGY,
    FIX,
    FIXED,
    LIMITS,
    TASK,
    change,
    new_file,
    verify,
)

from gagar_jax.verify import repo as vrepo  # noqa: E402
from gagar_jax.verify import sandbox as sb  # noqa: E402
from gagar_jax.verify.sandbox import Limits  # noqa: E402

# A pass-to-pass test of ``double`` beside the task's fail-to-pass tests of ``half``.
DOUBLE = "\n\ndef double(x):\n    return 2 * x\n"
P2P_TEST = "from app import double\n\n\ndef test_double():\n    assert double(3) == 6\n"
P2P = dataclasses.replace(
    TASK,
    task_id="half_p2p",
    files={**TASK.files, "app.py": BUGGY + DOUBLE, "tests/test_double.py": P2P_TEST},
    pass_to_pass=("tests/test_double.py::test_double",),
)

SKIPS = {
    "unittest_skiptest": (
        "import unittest\n\n\ndef double(x):\n    raise unittest.SkipTest('n/a')\n"
    ),
    "pytest_importorskip": (
        "def double(x):\n    import pytest\n\n    pytest.importorskip('no_such_module_here')\n"
    ),
    "pytest_skip": "def double(x):\n    import pytest\n\n    pytest.skip('n/a')\n",
    # An expected failure is reported as skipped (``wasxfail``): the same regression.
    "pytest_xfail": "def double(x):\n    import pytest\n\n    pytest.xfail('flaky')\n",
    "skiptest_subclass": (
        "import unittest\n\n\nclass Unsupported(unittest.SkipTest):\n    pass\n\n\n"
        "def double(x):\n    raise Unsupported('platform')\n"
    ),
}


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_a_pass_to_pass_test_skipped_by_the_code_is_a_regression(name):
    patch = change("app.py", BUGGY + DOUBLE, FIXED + "\n\n" + SKIPS[name])
    v = verify(patch, the_task=P2P)
    assert v.tests["tests/test_double.py::test_double"] == "skipped", v.test_log
    assert v.status == "failed" and not v.infra_error, v.test_log
    assert "passes on the pristine repository" in v.test_log


def test_a_pass_to_pass_test_the_pristine_repository_skips_may_be_skipped():
    skipped = "import pytest\n\n\n@pytest.mark.skip('not here')\n" + P2P_TEST.split("\n\n\n")[1]
    t = dataclasses.replace(
        P2P, task_id="half_p2p_skipped", files={**P2P.files, "tests/test_double.py": skipped}
    )
    v = verify(change("app.py", BUGGY + DOUBLE, FIXED + DOUBLE), the_task=t)
    assert v.tests["tests/test_double.py::test_double"] == "skipped"
    assert v.status == "passed", v.test_log


def test_an_honest_fix_keeps_its_pass_to_pass_test():
    v = verify(change("app.py", BUGGY + DOUBLE, FIXED + DOUBLE), the_task=P2P)
    assert v.status == "passed" and v.tests["tests/test_double.py::test_double"] == "passed"


TREES = {
    "path_1200_directories_deep": (
        new_file("/".join(["d"] * 1200) + "/x.py", "x = 1\n") + FIX,
        "path_too_deep",
    ),
    # 100 characters, 300 bytes: NAME_MAX counts bytes, not characters.
    "name_of_multibyte_characters_over_name_max": (
        new_file("\u20ac" * 100 + ".py", "x = 1\n") + FIX,
        "over 255 bytes",
    ),
    "a_file_where_the_test_directory_goes": (
        new_file("tests", "not a directory\n") + FIX,
        "both a file and a directory",
    ),
    "a_directory_where_the_configuration_file_goes": (
        new_file("pytest.ini/x.py", "x = 1\n") + FIX,
        "both a file and a directory",
    ),
    "more_entries_than_disk_files": (
        "".join(new_file(f"pkg/f{i}.py", "x = 1\n") for i in range(LIMITS.disk_files + 10)) + FIX,
        "tree_too_large",
    ),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_a_tree_that_cannot_be_materialised_is_the_candidates_failure(name):
    patch, reason = TREES[name]
    v = verify(patch)
    assert v.status == "failed" and not v.infra_error and v.sandbox is None, v.test_log
    assert reason in (v.patch_error or ""), v.patch_error


def test_a_tree_over_the_byte_quota_is_refused_before_the_run():
    limits = dataclasses.replace(LIMITS, disk_bytes=256 << 10)
    lines = "".join(f"X{i} = {'1' * 100!r}\n" for i in range(1400))  # ~160 KiB of text
    v = verify(new_file("data_a.py", lines) + new_file("data_b.py", lines) + FIX, limits=limits)
    assert v.status == "failed" and "tree_too_large" in (v.patch_error or ""), v.test_log


def test_tree_size_counts_files_and_directories():
    assert vrepo.tree_size({"a/b/c.py": "x", "a/d.py": "yy", "e.py": "é"}) == (5, 5)
    # The pristine tree already over the limit is the task's problem, not the candidate's.
    t = dataclasses.replace(TASK, files={**TASK.files, **{f"p/{i}.py": "" for i in range(50)}})
    small = Limits(disk_files=10)
    assert vrepo.tree_fit_problem(t, t.files, small) is None
    assert "tree_too_large" in vrepo.tree_fit_problem(TASK, t.files, small)


# --- the per-test timeout, kept outside the test process -------------------------------------

SLOW = "def half(x):\n    time.sleep(2.0)\n    return x / 2\n"
DISARMS = {
    "setitimer_zero": "    signal.setitimer(signal.ITIMER_REAL, 0)\n",
    "sigalrm_ignored": "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n",
    "sigalrm_blocked": "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n",
    # A ``finish`` line for the running test, written to every pipe the process holds, then the
    # slow work: the real lines that follow are timed from the test's start all the same.
    "finish_forged_early": (
        "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "    _t = os.environ.get('PYTEST_CURRENT_TEST', '').rsplit(' ', 1)[0]\n"
        "    for _fd in map(int, os.listdir('/proc/self/fd')):\n"
        "        try:\n"
        "            if stat.S_ISFIFO(os.fstat(_fd).st_mode):\n"
        '                os.write(_fd, (\'{"finish": "%s"}\\n\' % _t).encode())\n'
        "        except OSError:\n"
        "            pass\n"
    ),
}
TIMED = dataclasses.replace(TASK, task_id="half_timed", test_timeout_s=1.0)


def _slow(disarm: str) -> str:
    head = "import os\nimport signal\nimport stat\nimport time\n\n\n"
    return change("app.py", BUGGY, head + SLOW.replace("    time.sleep", disarm + "    time.sleep"))


def test_a_slow_test_fails_its_per_test_timeout():
    v = verify(_slow(""), the_task=TIMED)
    assert v.status == "failed" and v.tests["tests/test_app.py::test_half"] == "failed", v.test_log


@pytest.mark.parametrize("name", sorted(DISARMS))
def test_a_per_test_timeout_disarmed_by_the_code_still_fails_the_test(name):
    v = verify(_slow(DISARMS[name]), the_task=TIMED)
    assert v.status == "failed" and not v.infra_error, v.test_log
    assert v.tests["tests/test_app.py::test_half"] == "failed", v.test_log
    assert "past the per-test timeout" in v.test_log, v.test_log


def test_a_hang_with_the_alarm_disarmed_is_killed_by_the_supervisor():
    """No alarm, no end: the supervisor kills the test process once the test is ``grace``
    seconds past the timeout (1 + 5 s), long before the run's wall limit (30 s)."""
    hang = (
        "import signal\nimport time\n\n\ndef half(x):\n"
        "    signal.setitimer(signal.ITIMER_REAL, 0)\n    while True:\n        time.sleep(0.05)\n"
    )
    t0 = time.monotonic()
    v = verify(change("app.py", BUGGY, hang), the_task=TIMED)
    assert v.status == "timeout" and not v.infra_error, v.test_log
    assert "killed the test process" in v.test_log, v.test_log
    assert time.monotonic() - t0 < LIMITS.wall_s - 5, "the supervisor did not kill it"


def test_an_honest_fix_within_the_per_test_timeout_passes():
    v = verify(FIX, the_task=TIMED)
    assert v.status == "passed" and not v.cheat, v.test_log


def test_deadlines_time_each_test_from_its_first_start_to_its_last_line():
    """The supervisor's bookkeeping on a scripted clock: a forged early finish is overtaken by
    the real lines; an outcome of a test never started is reported; a test past its grace is
    the one killed."""
    from gagar_jax.verify.outcome_plugin import _Deadlines

    d = _Deadlines(1.0)
    out = d.feed(b'{"start": "a"}\n{"finish": "a"}\n', 0.0)
    assert out == b"" and d.current is None
    assert d.feed(b'{"id": "a", "when": "call", "outcome": "passed"}\n', 3.0).startswith(b'{"id"')
    assert d.overran == {"a": 3.0}
    d.feed(b'{"id": "b", "when": "call", "outcome": "passed"}\n{"start": "c"}\n{"fin', 4.0)
    assert d.unstarted == ["b"] and d.rest() == b'{"fin'
    assert d.wait(4.0) == pytest.approx(6.0) and d.expired(9.0) is None
    assert d.expired(10.5) == "c" and d.killed == "c" and d.wait(11.0) is None
    d2 = _Deadlines(1.0)
    d2.feed(b'{"start": "x"}\n', 0.0)
    d2.feed(b'{"id": "x", "when": "call", "outcome": "passed"}\n{"finish": "x"}\n', 1.2)
    assert d2.overran == {}  # within the slack (a quarter of the timeout, at least 0.25 s)


# --- the grader's checks cannot starve the group's verdict ----------------------------------

# Sleeps on import unless the verifier's runner imports it: the verification passes, every
# grader check (``python -m pytest``) stalls.
STALL = (
    "import sys\nimport time\n\nif 'outcome_plugin' not in sys.argv[0]:\n    time.sleep(30)\n\n\n"
)


@functools.cache
def _stalling_group():
    from gagar_jax.envs.repo import repo_candidate, repo_workspace

    patches = [FIX, change("app.py", BUGGY, STALL + FIXED)]
    patches.append(change("app.py", BUGGY, STALL + FIXED.replace("2", "2.0")))
    cands = []
    for i, p in enumerate(patches):
        v = verify(p)
        assert v.status == "passed", v.test_log
        cands.append(repo_candidate(f"r{i}", p, v, task=TASK))
    return repo_workspace(TASK, "g-stall", cands)


def _check_every_candidate():
    """The scripted grader policy, checking every passing candidate instead of one."""
    import json

    from gagar_jax.grading.scripted import ScriptedGraderPolicy

    class CheckEvery(ScriptedGraderPolicy):
        outputs: list = []

        def chat_completions(self, messages, **kw):
            done = {m.get("tool_call_id"): m.get("content", "") for m in messages}
            CheckEvery.outputs = [v for k, v in done.items() if str(k).startswith("check:")]
            if "summaries" in done:
                summ = json.loads(done["summaries"])["candidates"]
                todo = [
                    (f"check:{c['candidate']}", "run_check", {"candidate": c["candidate"],
                                                               "command": self.check_command})
                    for c in summ
                    if c["status"] == "passed" and f"check:{c['candidate']}" not in done
                ]  # fmt: skip
                if todo:
                    return self._calls(todo[:1])
            return super().chat_completions(messages, **kw)

    return CheckEvery(use_check=True)


def test_stalling_checks_cost_the_vote_its_check_budget_not_its_verdict():
    """Two of three candidates stall every check for 30 s; the grader's time budget is 1 s and
    its check budget 3 s: each check is cut to what is left of the check budget, the later
    ones answer that it is spent, and the group is graded in bounded time."""
    from gagar_jax.grading import AgenticGrader
    from gagar_jax.grading.adapters import SandboxCheckRunner

    ws = _stalling_group()
    policy = _check_every_candidate()
    runner = SandboxCheckRunner(limits=Limits(wall_s=60, cpu_s=60))
    grader = AgenticGrader(policy, check_runner=runner, time_budget_s=1, check_budget_s=3)
    t0 = time.monotonic()
    verdict = grader.grade(ws)
    assert {j.candidate_id for j in verdict.judgements} == {"r0", "r1", "r2"}
    assert time.monotonic() - t0 < 25, "the checks were not held to the check budget"
    assert len(policy.outputs) == 3
    assert any("check budget (3 s) is spent" in o for o in policy.outputs), policy.outputs


@pytest.mark.e2e
def test_a_check_runner_without_a_time_limit_is_not_charged_to_the_vote():
    """A runner of the plain protocol (no ``time_limit_s``) whose check of a stalling
    candidate runs past the vote's whole time budget: the vote still ends in a verdict."""
    from gagar_jax.grading import AgenticGrader
    from gagar_jax.grading.adapters import SandboxCheckRunner
    from gagar_jax.grading.scripted import ScriptedGraderPolicy

    inner = SandboxCheckRunner(limits=Limits(wall_s=4, cpu_s=4))

    class Plain:
        def run(self, workspace, candidate, command):
            return inner.run(workspace, candidate, command)

    ws = _stalling_group()
    grader = AgenticGrader(
        ScriptedGraderPolicy(use_check=True), check_runner=Plain(), time_budget_s=2
    )
    for k in range(3):  # the candidate checked is a shuffle: several groups, 2 of 3 stall
        g = dataclasses.replace(ws, group_id=f"g-stall-{k}")
        assert len(grader.grade(g).judgements) == 3


def test_check_budget_must_not_be_negative():
    from gagar_jax.grading import AgenticGrader
    from gagar_jax.grading.scripted import ScriptedGraderPolicy

    with pytest.raises(ValueError, match="check_budget_s"):
        AgenticGrader(ScriptedGraderPolicy(), check_budget_s=-1)


# --- CPU per slot ----------------------------------------------------------------------------

needs_cpu_cgroup = pytest.mark.skipif(
    not (sb._cgroups_usable() and sb._cpu_cgroup_usable()),
    reason="needs root and the cgroup cpu controller",
)


def _throttled() -> dict[str, int]:
    out = {}
    for f in glob.glob(f"{sb._CGROUP_ROOT}/cpu/{sb._CGROUP_PARENT}/slot-*/cpu.stat"):
        with open(f) as fh:
            stat = dict(line.split() for line in fh if line.strip())
        out[f] = int(stat.get("nr_throttled", 0))
    return out


@needs_cpu_cgroup
def test_cpu_bound_children_in_their_own_sessions_are_held_to_the_slots_quota(tmp_path):
    # Three spinning children, each in a session of its own, against a quota of a twentieth of a
    # core: the kernel throttles the slot's cgroup (whatever the children's sessions).
    spin = "import time\\nt = time.time()\\nwhile time.time() - t < 1.0:\\n    pass\\n"
    code = (
        "import subprocess, sys, time\n"
        f"ps = [subprocess.Popen([sys.executable, '-c', '{spin}'], start_new_session=True)\n"
        "      for _ in range(3)]\n"
        "[p.wait() for p in ps]\n"
    )
    os.chmod(tmp_path, 0o755)
    before = _throttled()
    r = sb.run_sandboxed(
        [sb.python_for_sandbox()[0], "-c", code],
        tmp_path,
        Limits(wall_s=30, cpu_cores=0.05),
        config=sb.SandboxConfig(mechanism="bwrap+cgroup"),
    )
    after = _throttled()
    assert r.status == "passed", r
    gained = max(after[f] - before.get(f, 0) for f in after)
    assert gained >= 3, (before, after)  # throttled in several 100 ms periods


@needs_cpu_cgroup
def test_each_slot_gets_the_quota_of_its_limits():
    config = sb.SandboxConfig()
    with sb._slot(config) as slot:  # a free slot: preparing it kills what its cgroups hold
        dirs = sb._prepare_cgroups(config.uid_base + slot, Limits(cpu_cores=1.5))
        with open(f"{dirs['cpu']}/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open(f"{dirs['cpu']}/cpu.cfs_period_us") as f:
            period = int(f.read())
    assert quota == int(1.5 * period)


def test_cpu_cores_must_be_positive():
    with pytest.raises(ValueError, match="cpu_cores"):
        Limits(cpu_cores=0)
