"""Harbor task directories (``data.harbor``) as tasks of the loop and of ``swe validate``, on the
container back-end (``verify.harbor_run``): the solution passes, the empty patch fails, the
tests and the outcome channel stay out of the candidate's reach."""

import dataclasses
import json
import os
import shutil

import pytest
from container_fixtures import base_image

from gagar_jax.data import harbor
from gagar_jax.data import swe as swe_mod
from gagar_jax.envs.repo import RepoAgentEnv, load_repo_tasks
from gagar_jax.verify import execution
from gagar_jax.verify.diff import tree_patch
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits

GREET = os.path.join(os.path.dirname(__file__), "fixtures", "harbor", "greet")
LIMITS = Limits(wall_s=60, cpu_s=60, memory_bytes=512 << 20, disk_bytes=64 << 20)


def test_reading_the_documented_format():
    h = harbor.read_harbor_task(GREET)
    assert h.name == "greet" and "Hello, <name>!" in h.instruction
    assert h.environment_dir.endswith("environment") and h.solution_dir.endswith("solution")
    assert h.verifier_timeout_s == 60.0 and h.memory_mb == 512 and h.storage_mb == 64


def test_a_broken_task_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="no task.toml"):
        harbor.read_harbor_task(str(tmp_path))
    bad = tmp_path / "bad"
    shutil.copytree(GREET, bad)
    (bad / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n")
    with pytest.raises(ValueError, match="verifier.timeout_sec"):
        harbor.read_harbor_task(str(bad))
    os.remove(bad / "tests" / "test.sh")
    with pytest.raises(ValueError, match="tests/test.sh"):
        harbor.read_harbor_task(str(bad))


@pytest.fixture(scope="module")
def task():
    base_image()
    return harbor.to_repo_task(GREET)


@pytest.mark.container
def test_the_solution_is_gold_and_the_empty_patch_fails(task):
    assert task.image_workdir == "/app" and set(task.files) == {"greet.py"}
    assert "Hello, {name}!" in task.reference_patch  # what solve.sh changed
    gold = verify_repo_patch(task, task.reference_patch, limits=LIMITS)
    assert gold.status == "passed" and gold.tests == {harbor.HARBOR_TEST_ID: "passed"}, (
        gold.test_log
    )
    assert gold.sandbox.mechanism == "container" and "network" in gold.sandbox.isolation
    empty = verify_repo_patch(task, "", limits=LIMITS)
    assert empty.status == "failed" and "reward 0" in empty.test_log, empty.test_log


def _patch(task, text):
    return tree_patch(task.files, {"greet.py": text})


FIXED = 'def greet(name):\n    return f"Hello, {name}!"\n'


@pytest.mark.container
def test_the_tests_and_the_channel_are_out_of_reach(task):
    # The pristine tests are bound read-only: rewriting them at import fails the write, and
    # the real tests still run against the buggy code.
    rewrite = (
        "try:\n    open('/tests/test_outputs.py', 'w').write('def test_ok():\\n    pass\\n')\n"
        "except OSError:\n    pass\n"
        "def greet(name):\n    return 'Hello ' + name\n"
    )
    v = verify_repo_patch(task, _patch(task, rewrite), limits=LIMITS)
    assert v.status == "failed" and not v.infra_error, v.test_log
    # A record forged on every inherited descriptor makes the channel carry more than the one
    # line the start wrapper writes: tampering.
    forge = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n        os.write(fd, b'0 1\\n')\n    except OSError:\n        pass\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        for fd in range(3, 16):\n"
        "            try:\n"
        "                with open(f'/proc/{pid}/fd/{fd}', 'wb') as f:\n"
        "                    f.write(b'0 1\\n')\n"
        "            except OSError:\n                pass\n"
        "def greet(name):\n    return 'Hello ' + name\n"
    )
    v = verify_repo_patch(task, _patch(task, forge), limits=LIMITS)
    assert v.status == "failed" and not v.passed, v.test_log
    # A hung candidate is killed with its container at the wall limit.
    hang = "import time\nwhile True:\n    time.sleep(1)\n" + FIXED
    v = verify_repo_patch(task, _patch(task, hang), limits=dataclasses.replace(LIMITS, wall_s=5))
    assert v.status == "timeout", v.test_log


@pytest.mark.container
def test_a_harbor_task_in_the_loop(task, tmp_path):
    # The loop's pool reads Harbor directories; its calls go through the execution back-end.
    pool = load_repo_tasks(os.path.dirname(GREET))
    assert [t.task_id for t in pool] == ["greet"] and pool[0].harbor_tests
    v = execution.verify_repo_call(
        pool[0], pool[0].reference_patch, backend=execution.LocalBackend(), limits=LIMITS
    )
    assert v.status == "passed", v.test_log
    # The agent's run_tests has no visible test to run: the reward stays hidden.
    ok, text = RepoAgentEnv(pool[0])._run_tests(dict(pool[0].files))
    assert not ok and "no test ran" in text
    # JSONL rows round-trip (python -m gagar_jax.data.harbor convert)
    out = tmp_path / "tasks.jsonl"
    assert harbor.main(["convert", GREET, "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["harbor_tests"] == harbor.read_harbor_task(GREET).tests_dir


@pytest.mark.container
def test_swe_validate_on_a_harbor_task(task, tmp_path, capsys):
    out = tmp_path / "report.jsonl"
    rc = swe_mod.main(["validate", "--harbor", GREET, "--runs", "1", "--out", str(out)])
    assert rc == 0
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["gold"] == "passed" and line["empty"] == "failed" and line["infra_errors"] == 0
    assert "1 sound" in capsys.readouterr().out
