"""A task pointing at an image laid out as SWE-bench's official instance images, used unchanged.

No image registry is reachable from here, so no official image could be pulled: the test builds
one locally that follows their layout (``tests/fixtures/containers/swebench/Dockerfile``: the
repository at ``/testbed``, a git checkout installed into the environment with ``pip install -e
.[test]``; the environment ``testbed`` under ``/opt/miniconda3/envs``, activated as SWE-bench's
eval script does, ``source /opt/miniconda3/bin/activate && conda activate testbed``), names it as
SWE-bench's harness names an instance's image, and runs a SWE-bench row that names it through
``execution.environment="container"`` with no task-specific code: the gold patch passes, the
empty patch fails. What only the image has is needed for that: the version file the install
generated, the installed distribution's entry points and requirements, and the activated
environment's ``python`` on ``PATH``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest
from container_fixtures import base_image
from test_environments import FAST, VERPKG, VERPKG_PLUGINS, VERPKG_TESTS

from gagar_jax.data import swe
from gagar_jax.verify import container as ctr
from gagar_jax.verify.repo import verify_repo_patch

HERE = os.path.dirname(__file__)
LAYOUT = os.path.join(HERE, "fixtures", "containers", "swebench")
# A test only the activated environment passes: ``python`` is the environment's interpreter.
ACTIVATED_TEST = """\
import subprocess


def test_python_on_path_is_the_environment():
    code = "import toolz, verpkg, sys; print(sys.prefix)"
    out = subprocess.run(["python", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "/opt/miniconda3/envs/testbed"
"""


def _layout_hash() -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(LAYOUT)):
        dirs.sort()
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read())
    for p in sorted(VERPKG):
        h.update(p.encode() + b"\0" + VERPKG[p].encode())
    return h.hexdigest()[:10]


def _build(image: str, repo_files: dict[str, str], tmp_path) -> None:
    """Builds the SWE-bench-layout image of ``repo_files`` as ``image`` (once: kept by the
    engine between sessions; its name carries the layout's content hash)."""
    if ctr.image_exists(image):
        return
    ctx = tmp_path / "ctx"
    shutil.copytree(LAYOUT, ctx)
    for path, text in repo_files.items():
        full = ctx / "repo" / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)
    engine = ctr._engine_argv()
    argv = [*engine, "build", "--network", "host", "-t", image]
    host_ca = "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(host_ca):  # a proxy's CA the image's own bundle lacks
        argv += ["-v", f"{host_ca}:/.host-ca.crt:ro", "--build-arg", "PIP_CERT=/.host-ca.crt"]
    argv.append(str(ctx))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1500)
    if r.returncode != 0:
        pytest.skip(f"could not build the SWE-bench-layout image: {r.stderr[-800:]}")


@pytest.mark.container
def test_a_swebench_layout_image_verifies_gold_and_empty_unchanged(tmp_path):
    from tests.swe_fixtures import make_instance

    base_image()
    repos_dir = str(tmp_path / "repos")
    instance_id = f"acme__verpkg-{_layout_hash()}"
    base = {k: v for k, v in VERPKG.items() if k != "tests/test_verpkg.py"}
    row = make_instance(
        repos_dir,
        "acme/verpkg",
        base,
        {"verpkg/plugins.py": VERPKG_PLUGINS.replace("lower", "upper")},
        {"tests/test_verpkg.py": VERPKG_TESTS, "tests/test_activated.py": ACTIVATED_TEST},
        ["tests/test_verpkg.py::test_shout"],
        [
            "tests/test_verpkg.py::test_version",
            "tests/test_verpkg.py::test_deps",
            "tests/test_activated.py::test_python_on_path_is_the_environment",
        ],
        instance_id=instance_id,
        image_name=swe.swebench_image_name(instance_id),
        install="python -m pip install -e .[test]",
    )
    _build(row["image_name"], base, tmp_path)
    inst = swe.parse_instance(row)
    task = swe.to_repo_task(inst, repos_dir, cache_dir=str(tmp_path / "cache"), use_image=True)
    # the task's tree is the row's commit: no generated version file, no installed metadata
    assert "verpkg/_version.py" not in task.files
    assert not any(".dist-info/" in p for p in task.files)
    assert task.image == "sweb.eval.x86_64." + instance_id.lower() + ":latest"
    spec = ctr.container_spec(task, "container")
    assert spec.workdir == "/testbed" and spec.seed_workdir
    assert "source /opt/miniconda3/bin/activate && conda activate testbed" in spec.activate
    # the environment has no pytest-timeout: the runs go without the per-test timeout (the
    # wall limit still holds); the back-end's own image has it
    assert not ctr.image_has_pytest_timeout(spec) and task.test_timeout_s > 0
    assert ctr.image_has_pytest_timeout(ctr.DEFAULT_SPEC)
    gold = verify_repo_patch(task, task.reference_patch, limits=FAST, environment="container")
    assert gold.status == "passed" and gold.sandbox.mechanism == "container", gold.test_log
    empty = verify_repo_patch(task, "", limits=FAST, environment="container")
    assert empty.status == "failed", empty.test_log
    assert empty.tests["tests/test_verpkg.py::test_shout"] == "failed"
    assert empty.tests["tests/test_verpkg.py::test_version"] == "passed"
    # without the activation, `python` is not the environment's (nothing else changed)
    plain = ctr.ContainerSpec(image=task.image, python=spec.python, workdir="/testbed",
                              seed_workdir=True)  # fmt: skip
    v = verify_repo_patch(task, task.reference_patch, limits=FAST, container=plain,
                          environment="container")  # fmt: skip
    assert v.status == "failed", v.test_log
    assert v.tests["tests/test_activated.py::test_python_on_path_is_the_environment"] == "failed"
    assert v.tests["tests/test_verpkg.py::test_shout"] == "passed"


def test_conda_environments_are_activated_as_swebench_eval_scripts_do():
    act = ctr.conda_activation("/opt/miniconda3/envs/testbed/bin/python")
    assert act == (
        "if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate"
        " && conda activate testbed; fi"
    )
    assert "conda activate py39" in ctr.conda_activation("/opt/conda/envs/py39/bin/python3.9")
    for other in ("python3", "/usr/bin/python3", "/opt/testbed/bin/python"):
        assert ctr.conda_activation(other) == ""


def test_a_container_run_reads_pool_rows_for_their_images(tmp_path):
    """The training loop's task family reads a SWE-bench-format pool for the run's environment:
    under ``execution.environment="container"`` a row that names an image runs there (its tests
    on the container back-end); the run config hands the environment to the family."""
    import dataclasses
    import json

    from gagar_jax.envs.repo import load_repo_tasks
    from gagar_jax.rl import collect
    from gagar_jax.rl.config import RunConfig
    from tests.swe_fixtures import make_instance

    repos_dir = str(tmp_path / "repos")
    instance_id = "acme__verpkg-pool"
    base = {k: v for k, v in VERPKG.items() if k != "tests/test_verpkg.py"}
    row = make_instance(
        repos_dir,
        "acme/verpkg",
        base,
        {"verpkg/plugins.py": VERPKG_PLUGINS.replace("lower", "upper")},
        {"tests/test_verpkg.py": VERPKG_TESTS},
        ["tests/test_verpkg.py::test_shout"],
        ["tests/test_verpkg.py::test_version"],
        instance_id=instance_id,
        image_name=swe.swebench_image_name(instance_id),
        install="python -m pip install -e .[test]",
    )
    pool = tmp_path / "pool.jsonl"
    pool.write_text(json.dumps(row) + "\n")
    (task,) = load_repo_tasks(str(pool), repos_dir, container=True)
    assert task.image == row["image_name"] and not task.env_path
    cfg = RunConfig()
    assert "environment" not in collect.family_settings(cfg).extra
    cfg = dataclasses.replace(
        cfg, execution=dataclasses.replace(cfg.execution, environment="container")
    )
    assert collect.family_settings(cfg).extra["environment"] == "container"
