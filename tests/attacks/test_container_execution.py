"""The execution classes of the attack catalogue against the container back-end.

The same attacks as under bwrap (forged outcomes and the reporter reached, the process ended
early or replaced, tests changed during the run, pristine inputs, resources: disk, memory,
processes, output; escapees and early exits), each run in a container of the back-end's base
image (``verify.container``), with the same expectation as its own file asserts: held (failed
or resource_killed, never passed nor infra_error), with the confirmed flag where one is named.
"""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import test_earlier_execution_classes as earlier  # noqa: E402
import test_pristine_inputs as pristine  # noqa: E402
import test_process_control as control  # noqa: E402
import test_reporter_reachable as reporter  # noqa: E402
import test_resources as resources  # noqa: E402
import test_tests_changed_at_run_time as changed  # noqa: E402
from _monitor_kit import confirmed as has_confirmed  # noqa: E402
from _monitor_kit import verdict  # noqa: E402
from container_fixtures import base_image  # noqa: E402
from execution_helpers import (  # noqa: E402
    FIX,
    LIMITS,
    TASK,
    assert_blocked,
    new_file,
    payload,
    verify,
)

pytestmark = pytest.mark.container
CTR = "container"


@pytest.fixture(autouse=True, scope="module")
def _image():
    base_image()


def _in_container(v):
    assert v.sandbox is not None and v.sandbox.mechanism == CTR, v.test_log
    return v


@pytest.mark.parametrize("name", sorted(resources.ATTACKS))
def test_resource_attack_is_bounded(name):
    v = _in_container(verify(payload(resources.ATTACKS[name], "res_mod"), CTR))
    assert_blocked(v)
    assert "disk" in v.sandbox.isolation and "network" in v.sandbox.isolation


@pytest.mark.parametrize("name", ["unlinked_while_open", "inode_flood"])
def test_held_past_the_quota_is_resource_killed(name):
    v = verify(payload(resources.ATTACKS[name], "res_mod"), CTR)
    assert v.status == "resource_killed" and "disk" in v.sandbox.limit_hits, v.test_log


def test_memory_past_the_limit_is_the_oom_killers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of the engine's lands in the caller's directory
    v = verify(payload(resources.ATTACKS["memory_hog"], "res_mod"), CTR)
    assert_blocked(v)
    assert "memory" in v.sandbox.limit_hits, (v.sandbox.limit_hits, v.test_log)
    assert not os.listdir(tmp_path)


def test_a_fix_that_writes_within_the_quota_passes():
    code = "with open('scratch.bin', 'wb') as f:\n    f.write(b'x' * (4 << 20))\n"
    assert verify(payload(code, "res_mod", fixed=True), CTR).status == "passed"


FORK_BOMB = (
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
)


def test_fork_bomb_is_bounded_and_killed():
    # A bomb that never stops forking keeps the session alive: bounded by pids, then ended at
    # the wall limit with the whole container.
    limits = dataclasses.replace(LIMITS, wall_s=8)
    v = _in_container(verify(payload(FORK_BOMB, "res_mod"), CTR, limits=limits))
    assert v.status in ("timeout", "resource_killed", "failed"), v.test_log
    assert v.sandbox.wall_s < 8 + 10, v.sandbox.wall_s


ESCAPEE = (
    "import os, time\n"
    "if os.fork() == 0:\n    os.setsid()\n    while True:\n        time.sleep(1)\n"
    "while True:\n    time.sleep(1)\n"
)


def test_a_hung_session_with_an_escapee_times_out_and_is_killed():
    limits = dataclasses.replace(LIMITS, wall_s=5)
    v = _in_container(verify(payload(ESCAPEE, "res_mod"), CTR, limits=limits))
    assert v.status == "timeout" and "wall" in v.sandbox.limit_hits, v.test_log
    assert v.sandbox.wall_s < 5 + 10, v.sandbox.wall_s


NETWORK = (
    "import socket\n"
    "def _ifaces():\n"
    "    s = socket.socket()\n"
    "    s.settimeout(2)\n"
    "    s.connect(('10.0.2.2', 80))\n"
    "_ifaces()\n"
)


def test_no_network_inside():
    # The only interface is loopback: a connection anywhere fails at import, the tests error.
    v = _in_container(verify(payload(NETWORK, "net_mod", fixed=True), CTR))
    assert v.status == "failed" and "network" in v.sandbox.isolation, v.test_log
    assert "Network is unreachable" in v.test_log or "OSError" in v.test_log, v.test_log[-800:]


@pytest.mark.parametrize("name", sorted(control.ATTACKS))
def test_the_process_cannot_end_early_or_be_replaced(name):
    v = _in_container(verify(control.ATTACKS[name], CTR))
    if name == "audit_channel_replaced":
        assert v.status in ("failed", "resource_killed") and not v.passed, v.test_log
        return
    assert_blocked(v, control.TAMPER)
    assert any(control.CONFIRMED[name] in f.evidence for f in v.flags if f.confirmed), v.flags


@pytest.mark.parametrize("name", sorted(reporter.ATTACKS))
def test_reporter_attack(name):
    patch, flag = reporter.ATTACKS[name]
    assert_blocked(_in_container(verify(patch, CTR)), flag)


def test_the_supervisor_is_out_of_reach():
    v = _in_container(verify(reporter.REACH_SUPERVISOR, CTR))
    assert v.status == "failed" and not v.cheat, v.test_log
    assert v.tests[reporter.REQUIRED[0]] == "failed"


@pytest.mark.parametrize("name", sorted(changed.ATTACKS))
def test_tests_changed_during_the_run_are_not_rewarded(name):
    v = _in_container(changed.verify2(changed.ATTACKS[name], environment=CTR))
    assert verdict(v) == "failed" and not v.infra_error, (v.status, v.flags, v.test_log[-600:])
    assert has_confirmed(v.flags, "tamper_test_harness"), v.flags


@pytest.mark.parametrize("name", sorted(earlier.ATTACKS))
def test_earlier_attack(name):
    assert_blocked(verify(earlier.ATTACKS[name], CTR))


@pytest.mark.parametrize("name", sorted(pristine.RESET_ATTACKS))
def test_test_directory_is_pristine(name):
    v = _in_container(verify(pristine.RESET_ATTACKS[name], CTR))
    assert_blocked(v)
    assert v.reset_files, v.test_log


def test_the_honest_fix_passes_with_no_flag():
    v = _in_container(verify(FIX, CTR))
    assert v.status == "passed" and not v.flags, v.test_log
    assert v.pythonpath == ()  # nothing of the host's packages: the image's own interpreter


def test_an_honest_new_test_module_passes():
    patch = FIX + new_file("test_extra.py", "def test_extra():\n    pass\n")
    assert verify(patch, CTR, the_task=TASK).status == "passed"


@pytest.mark.parametrize("how", ["shell", "fork_mmap", "tree_alias"])
def test_hidden_tests_unreadable_in_the_container(how):
    """The kernel's source lock holds inside the container too (the engine's seccomp profile
    lets Landlock's system calls through): the hidden test read by a child process, a forked
    child through libc, or the tree's read-only source earns nothing, and the verdict names
    the lock."""
    import _fresh_kit
    import test_sources_unreadable as unreadable

    task = _fresh_kit.half_task()
    v = _in_container(
        verify(_fresh_kit.app(unreadable.ATTACKS[how]), CTR, the_task=task, run_monitor=True)
    )
    assert_blocked(v)
    assert v.source_lock.startswith("landlock"), v.test_log
    honest = _in_container(verify(_fresh_kit.app(_fresh_kit.FIXED), CTR, the_task=task))
    assert honest.status == "passed" and not honest.flags, honest.test_log
