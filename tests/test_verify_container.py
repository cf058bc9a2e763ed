"""The container back-end (``verify.container``): the fixture repositories' verdicts in a
container, an image laid out as SWE-bench's (repository at ``/testbed``, its own interpreter,
a build-generated file) built from a Dockerfile offline, and how a run picks its environment."""

import dataclasses
import difflib
import os

import pytest
from container_fixtures import base_image
from test_verify_repo import CASES, CHEATS, FAST, _patch, _task

from gagar_jax.envs.repo import RepoTask
from gagar_jax.rl.config import ExecutionConfig
from gagar_jax.verify import container as ctr
from gagar_jax.verify.repo import verify_repo_patch

HERE = os.path.dirname(__file__)
TESTBED = os.path.join(HERE, "fixtures", "containers", "testbed")


def _diff(path, old, new):
    return "".join(
        difflib.unified_diff(
            old.splitlines(True),
            new.splitlines(True),
            f"a/{path}" if old else "/dev/null",
            f"b/{path}",
        )
    )


# --- picking the environment (no engine needed) ------------------------------------------------


def test_the_environment_follows_the_task_and_the_setting():
    plain = _task("statkit")
    assert ctr.container_spec(plain) is None  # a plain task: the bwrap sandbox
    assert ctr.container_spec(plain, "container") == ctr.DEFAULT_SPEC
    imaged = dataclasses.replace(
        plain,
        image="sweb.eval.x86_64.a_1776_b-1:latest",
        image_python="/opt/miniconda3/envs/testbed/bin/python",
        image_workdir="/testbed",
    )
    spec = ctr.container_spec(imaged)
    assert spec.image.startswith("sweb.eval") and spec.workdir == "/testbed" and spec.seed_workdir
    assert spec.python == "/opt/miniconda3/envs/testbed/bin/python"
    assert ctr.container_spec(imaged, "uv") is None  # the setting wins over the task
    with pytest.raises(ValueError, match="environment"):
        ctr.container_spec(plain, "docker")


def test_swebench_image_names_and_rows_with_an_image():
    from gagar_jax.data import swe

    # the harness's names: local key lower-cased; a registry's with __ spelled _1776_
    assert swe.swebench_image_name("Django__django-11099") == (
        "sweb.eval.x86_64.django__django-11099:latest"
    )
    assert swe.swebench_image_name("django__django-11099", namespace="swebench") == (
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    row = {
        "instance_id": "o__r-1",
        "repo": "o/r",
        "base_commit": "abc",
        "patch": "",
        "test_patch": "",
        "problem_statement": "p",
        "FAIL_TO_PASS": '["t.py::test_a"]',
        "image_name": "swesmith.x86_64.o__r.abc",
    }
    assert swe.parse_instance(row).image_name == "swesmith.x86_64.o__r.abc"


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="image or a dockerfile"):
        ctr.ContainerSpec()
    with pytest.raises(ValueError, match="workdir"):
        ctr.ContainerSpec(image="x", workdir="relative")
    with pytest.raises(ValueError, match="execution.environment"):
        ExecutionConfig(environment="conda")
    t = RepoTask.from_dict({**_task("statkit").to_dict(), "image": "img", "image_workdir": "/tb"})
    assert t.image == "img" and t.image_workdir == "/tb"
    assert RepoTask.from_dict(t.to_dict()) == t


# --- in a container ---------------------------------------------------------------------------


@pytest.mark.container
@pytest.mark.parametrize("name, kind, status, reset", CASES)
def test_fixture_verdicts_in_a_container(name, kind, status, reset):
    base_image()
    task = _task(name)
    patch = _patch(name, kind) if kind else ""
    v = verify_repo_patch(task, patch, limits=FAST, environment="container")
    assert v.status == status, v.test_log
    assert v.cheat == (kind in CHEATS), v.flags
    assert v.reset_files == reset
    assert v.sandbox.mechanism == "container" and "network" in v.sandbox.isolation


VERKIT_INIT = "from verkit._version import VERSION\n\n\ndef major():\n    return 0\n"
VERKIT_FIXED = VERKIT_INIT.replace("return 0", "return int(VERSION.split('.')[0])")
VERKIT_TEST = "from verkit import major\n\n\ndef test_major():\n    assert major() == 1\n"


def _testbed_task(**kw):
    files = {
        "verkit/__init__.py": VERKIT_INIT,
        "tests/test_major.py": VERKIT_TEST,
        "pytest.ini": "[pytest]\n",
    }
    return RepoTask(
        "verkit",
        "major() is always 0",
        files,
        ("tests/test_major.py::test_major",),
        test_files=("tests/test_major.py",),
        reference_patch=_diff("verkit/__init__.py", VERKIT_INIT, VERKIT_FIXED),
        dockerfile=TESTBED,
        image_python="/opt/testbed/bin/python",
        image_workdir="/testbed",
        **kw,
    )


@pytest.mark.container
def test_an_image_with_the_repository_at_testbed():
    base_image()
    task = _testbed_task()
    # The generated _version.py exists only in the image: the run's tree is seeded from it.
    assert "verkit/_version.py" not in task.files
    gold = verify_repo_patch(task, task.reference_patch, limits=FAST)
    assert gold.status == "passed", gold.test_log
    empty = verify_repo_patch(task, "", limits=FAST)
    assert empty.status == "failed" and empty.tests["tests/test_major.py::test_major"] == "failed"
    # The image's own (stale, passing) copy of verkit/__init__.py never stands in for the
    # task's: the tree is copied over the seed, and a file the candidate deletes is gone.
    gone = _diff("verkit/__init__.py", VERKIT_INIT, "")
    gone = gone.replace("+++ b/verkit/__init__.py", "+++ /dev/null")
    v = verify_repo_patch(task, gone, limits=FAST)
    assert v.status == "failed" and v.patch_error is None, v.test_log
    assert "No module named 'verkit'" in v.test_log or "ImportError" in v.test_log, v.test_log


@pytest.mark.container
def test_a_per_test_timeout_in_a_container():
    # pytest-timeout comes from the image (the base image has Debian's): a hanging test fails
    # alone, the others report.
    base_image()
    task = dataclasses.replace(_task("statkit"), test_timeout_s=3.0)
    v = verify_repo_patch(task, _patch("statkit", "minimal"), limits=FAST, environment="container")
    assert v.status == "passed", v.test_log


@pytest.mark.container
def test_the_run_configs_environment_reaches_the_verifier():
    # execution.environment = "container" (the run config) -> the back-end -> every call.
    base_image()
    from gagar_jax.verify import execution

    b = execution.make_backend(**dataclasses.asdict(ExecutionConfig(environment="container")))
    task = _task("statkit")
    v = execution.verify_repo_call(task, _patch("statkit", "minimal"), backend=b, limits=FAST)
    assert v.status == "passed" and v.sandbox.mechanism == "container", v.test_log
    plain = execution.make_backend(**dataclasses.asdict(ExecutionConfig()))
    v = execution.verify_repo_call(task, _patch("statkit", "minimal"), backend=plain, limits=FAST)
    assert v.status == "passed" and v.sandbox.mechanism.startswith("bwrap"), v.test_log


@pytest.mark.container
def test_a_missing_image_is_an_infra_error():
    base_image()
    task = dataclasses.replace(_task("statkit"), image="localhost/gagar-no-such-image:1")
    v = verify_repo_patch(task, _patch("statkit", "minimal"), limits=FAST)
    assert v.infra_error and "not present locally" in v.test_log, v.test_log
