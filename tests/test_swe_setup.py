"""A task row's ``pre_install``/``install`` commands, run as SWE-bench's harness runs them
(``gagar_jax.data.swe_setup``): tree edits and Python commands in the sandbox, the install of
the tree through its build backend, packages into the environment, system commands only on the
container back-end (a task error under the uv environment, naming the command)."""

from __future__ import annotations

import os

import pytest
from test_environments import FAST, VERPKG, VERPKG_PLUGINS, VERPKG_TESTS

from gagar_jax.data import swe, swe_setup
from gagar_jax.verify.repo import verify_repo_patch


def _kinds(*cmds):
    return [(s.command, s.kind) for s in swe_setup.plan(cmds)]


def test_real_rows_commands_are_classified_as_swebench_runs_them():
    # astropy's and sphinx's pre_install edits, django's and matplotlib's system packages,
    # their installs, scikit-learn's compiled editable install, the conda activation of the
    # images' setup scripts
    astropy = (
        'sed -i \'s/requires = \\["setuptools",/requires = ["setuptools==68.0.0",/\' pyproject.toml'
    )
    assert _kinds(astropy, "python -m pip install -e .[test] --verbose") == [
        (astropy, "shell"),
        ("python -m pip install -e .[test] --verbose", "install"),
    ]
    steps = swe_setup.plan(["python -m pip install -e .[test] --verbose"])
    assert swe_setup.extras_of(steps) == ("test",)
    django = [
        "apt-get update && apt-get install -y locales",
        "echo 'en_US UTF-8' > /etc/locale.gen",
        "locale-gen en_US.UTF-8",
    ]
    assert [k for _, k in _kinds(*django)] == ["system"] * 4
    sphinx = [
        "sed -i 's/pytest/pytest -rA/' tox.ini",
        "sed -i 's/Jinja2>=2.3/Jinja2<3.0/' setup.py",
    ]
    assert [k for _, k in _kinds(*sphinx)] == ["shell", "shell"]
    sklearn = "python -m pip install -v --no-use-pep517 --no-build-isolation -e ."
    assert _kinds(sklearn) == [(sklearn, "install")]
    assert [k for _, k in _kinds("python setup.py develop", "python setup.py build_ext -i")] == [
        "install",
        "shell",
    ]
    act = "source /opt/miniconda3/bin/activate && conda activate testbed"
    assert [k for _, k in _kinds(act)] == ["activate", "activate"]
    (req,) = swe_setup.plan(["pip install 'numpy<2' -r requirements/dev.txt -c c.txt"])
    assert req.kind == "requirements" and req.requirements == ("numpy<2",)
    assert req.requirement_files == ("requirements/dev.txt",)
    (un,) = swe_setup.plan(["pip uninstall -y pytest-xdist"])
    assert un.kind == "uninstall" and swe_setup.uninstalled([un]) == {"pytest-xdist"}
    # a quoted && is part of its command, a here-document stays whole
    assert swe_setup.split_chain("sed -i 's/a && b/c/' x.py; rm -f y") == [
        "sed -i 's/a && b/c/' x.py",
        "rm -f y",
    ]
    assert _kinds("sed -i 's/a && b/c/' x.py && pip install -e .") == [
        ("sed -i 's/a && b/c/' x.py", "shell"),
        ("pip install -e .", "install"),
    ]
    assert len(swe_setup.plan(["cat <<'EOF' > a.txt\nx && y\nEOF"])) == 1
    # a chain of tree edits stays whole (its || keeps its meaning, as sphinx's rows need);
    # only the command before || or a redirection says what a pip call installs
    guard = "grep -q 'htmlhelp>=2.0.0' setup.py && sed -i 's/a/b/' setup.py || sed -i 's/c/d/' x"
    assert _kinds(guard) == [(guard, "shell")]
    assert _kinds("pip install -e . || true") == [("pip install -e . || true", "install")]
    # matplotlib's qhull download needs the network: only an image build has it
    assert [k for _, k in _kinds('wget -O "$T" "$URL"', "git clone https://x/y")] == ["system"] * 2
    with pytest.raises(swe_setup.SetupError, match="neither the repository nor a package"):
        swe_setup.plan(["pip install -e ./plugins/extra"])
    with pytest.raises(swe_setup.SetupError, match="does not parse"):
        swe_setup.plan(["sed -i 's/unterminated"])
    with pytest.raises(swe_setup.SetupError, match="pre_install must be"):
        swe_setup.commands({"a": 1})


def test_requirement_files_are_read_from_the_tree():
    files = {
        "requirements/dev.txt": "# tools\n-r base.txt\npytest-mock>=3  # mocks\n-e .\n",
        "requirements/base.txt": "six\n--index-url https://x\n",
    }
    steps = swe_setup.plan(["pip install -r requirements/dev.txt toolz"])
    assert swe_setup.requirements_of(steps, files) == ["toolz", "six", "pytest-mock>=3"]
    with pytest.raises(swe_setup.SetupError, match="not in the tree"):
        swe_setup.requirements_of(swe_setup.plan(["pip install -r nope.txt"]), files)


# verpkg whose setup.py pins a package that does not exist (the pre_install step edits it out,
# as SWE-bench's sphinx rows re-pin Jinja2), and whose tests need a file a Python command of
# the setup writes and a package only the install command names.
PINNED_SETUP = (
    VERPKG["setup.py"]
    .replace(
        'install_requires=["six"]', 'install_requires=["six", "gagar-no-such-package-anywhere"]'
    )
    .replace('extras_require={"test": ["toolz"]},', "")
)
BUILT_TEST = """\
import toolz

from verpkg import _built


def test_built():
    assert _built.BUILT == "yes" and toolz.identity(1) == 1
"""
PRE_INSTALL = [
    "sed -i 's/, \"gagar-no-such-package-anywhere\"//' setup.py",
    "python -c \"open('verpkg/_built.py', 'w').write('BUILT = \\'yes\\'\\n')\" && rm -f NOTES",
]


def _row(repos_dir, **extra):
    from tests.swe_fixtures import make_instance

    base = {
        **{k: v for k, v in VERPKG.items() if k != "tests/test_verpkg.py"},
        "setup.py": PINNED_SETUP,
        "NOTES": "scratch\n",
    }
    return make_instance(
        repos_dir,
        "acme/verpkg",
        base,
        {"verpkg/plugins.py": VERPKG_PLUGINS.replace("lower", "upper")},
        {"tests/test_verpkg.py": VERPKG_TESTS, "tests/test_built.py": BUILT_TEST},
        ["tests/test_verpkg.py::test_shout"],
        ["tests/test_verpkg.py::test_version", "tests/test_built.py::test_built"],
        **extra,
    )


def test_pre_install_edits_python_commands_and_pip_installs_run_in_the_sandbox(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = _row(
        repos_dir,
        pre_install=PRE_INSTALL,
        install="python -m pip install -e . && python -m pip install 'toolz>=0.10'",
    )
    inst = swe.parse_instance(row)
    assert inst.pre_install == tuple(PRE_INSTALL)
    assert swe.parse_instance(inst.to_row()) == inst  # the row round-trips
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache)
    # the sed edit reached the tree and the install (else the pin cannot be resolved), the
    # Python command's file exists, the removed file is gone, the build's version file too
    assert "gagar-no-such-package-anywhere" not in task.files["setup.py"]
    assert task.files["verpkg/_built.py"] == "BUILT = 'yes'\n"
    assert "NOTES" not in task.files
    assert task.files["verpkg/_version.py"] == '__version__ = "1.2.3"\n'
    lock = open(os.path.join(task.env_path, ".gagar-env")).read()
    assert "six==" in lock and "toolz==" in lock  # setup.py's and the pip command's
    gold = verify_repo_patch(task, task.reference_patch, limits=FAST)
    assert gold.status == "passed", gold.test_log
    empty = verify_repo_patch(task, "", limits=FAST)
    assert empty.status == "failed" and empty.tests["tests/test_built.py::test_built"] == "passed"
    # `python setup.py develop` is the same install of the tree
    develop = {**row, "install": "python setup.py develop && pip install toolz"}
    again = swe.to_repo_task(swe.parse_instance(develop), repos_dir, cache_dir=cache)
    assert again.files == task.files and again.env_hash == task.env_hash
    # without the pre_install steps the pinned package cannot be resolved: a task error
    with pytest.raises(swe.InstanceError, match="gagar-no-such-package-anywhere"):
        swe.to_repo_task(swe.parse_instance({**row, "pre_install": []}), repos_dir, cache_dir=cache)


def test_a_failing_setup_command_is_a_task_error_naming_it(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = _row(repos_dir, pre_install=[PRE_INSTALL[0], "sed -i 's/x/y/' no_such_file.cfg"])
    with pytest.raises(swe.InstanceError, match="no_such_file.cfg.* failed"):
        swe.to_repo_task(swe.parse_instance(row), repos_dir, cache_dir=cache)
    # the sandbox has no network and cannot write outside the tree
    net = {
        **row,
        "pre_install": [
            "python -c \"import urllib.request as u; u.urlopen('http://pypi.org', timeout=5)\""
        ],
    }
    with pytest.raises(swe.InstanceError, match="failed"):
        swe.to_repo_task(swe.parse_instance(net), repos_dir, cache_dir=cache)


def test_system_commands_under_the_uv_environment_are_a_task_error(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = _row(repos_dir, pre_install=["apt-get update && apt-get install -y jq", *PRE_INSTALL])
    with pytest.raises(
        swe.InstanceError, match=r"'apt-get update'.*execution.environment=\"container\""
    ):
        swe.to_repo_task(swe.parse_instance(row), repos_dir, cache_dir=cache)
    locale = {**row, "pre_install": ["echo 'en_US UTF-8' > /etc/locale.gen"]}
    with pytest.raises(swe.InstanceError, match="/etc/locale.gen.*container"):
        swe.to_repo_task(swe.parse_instance(locale), repos_dir, cache_dir=cache)


JQWRAP = """\
import subprocess

import toolz


def first(text):
    argv = toolz.identity(["jq", "-r", ".[1]"])
    out = subprocess.run(argv, input=text, capture_output=True, text=True, check=True)
    return out.stdout.strip()
"""
JQWRAP_TEST = (
    'from jqwrap import first\n\n\ndef test_first():\n    assert first(\'["a", "b"]\') == "a"\n'
)


@pytest.mark.container
def test_apt_get_install_runs_on_the_container_back_end(tmp_path):
    from container_fixtures import base_image

    from gagar_jax.verify import container as ctr
    from tests.swe_fixtures import make_instance

    base_image()
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = make_instance(
        repos_dir,
        "acme/jqwrap",
        {"jqwrap/__init__.py": JQWRAP},
        {"jqwrap/__init__.py": JQWRAP.replace(".[1]", ".[0]")},
        {"tests/test_first.py": JQWRAP_TEST},
        ["tests/test_first.py::test_first"],
        [],
        pre_install=["apt-get update -q", "apt-get install -y -q --no-install-recommends jq"],
        install="python -m pip install toolz",
    )
    inst = swe.parse_instance(row)
    with pytest.raises(swe.InstanceError, match="apt-get update"):
        swe.to_repo_task(inst, repos_dir, cache_dir=cache)  # the uv environment
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache, use_image=True)
    assert task.image.startswith("localhost/gagar-setup:")
    # the system packages come from the image, the Python ones from the task's uv environment
    spec = ctr.container_spec(task, "container")
    assert spec.site_dirs and all(d.startswith(task.env_path) for d in spec.site_dirs)
    gold = verify_repo_patch(task, task.reference_patch, limits=FAST, environment="container")
    assert gold.status == "passed" and gold.sandbox.mechanism == "container", gold.test_log
    empty = verify_repo_patch(task, "", limits=FAST, environment="container")
    assert empty.status == "failed" and empty.tests["tests/test_first.py::test_first"] == "failed"
    # the base image has no jq: the same task there fails its gold patch
    from dataclasses import replace

    bare = verify_repo_patch(
        replace(task, image=""), task.reference_patch, limits=FAST, environment="container"
    )
    assert bare.status == "failed" and "jq" in bare.test_log, bare.test_log


def test_swesmith_and_r2egym_rows_keep_their_setup_commands():
    import json

    from tests.swe_fixtures import LAYOUTS

    with open(os.path.join(LAYOUTS, "r2egym_rows.jsonl")) as f:
        (r2e,) = [json.loads(line) for line in f if line.strip()]
    r2e = {**r2e, "pre_install": ["sed -i 's/a/b/' setup.cfg"], "install": ["pip install -e ."]}
    inst = swe.parse_instance(r2e)
    assert inst.layout == "r2egym" and inst.pre_install == ("sed -i 's/a/b/' setup.cfg",)
    assert inst.install == "pip install -e ."
    smith = {"instance_id": "o__n.abc.x", "repo": "swesmith/o__n.abc", "patch": "",
             "FAIL_TO_PASS": ["t.py::t"], "image_name": "swesmith.x86_64.o__n.abc",
             "problem_statement": "p", "pre_install": "apt-get install -y libxml2-dev",
             "install": ["python -m pip install -e .", "pip install pytest-mock"]}  # fmt: skip
    inst = swe.parse_instance(smith)
    assert inst.layout == "swesmith" and inst.pre_install == ("apt-get install -y libxml2-dev",)
    assert [s.kind for s in swe_setup.plan([*inst.pre_install, inst.install])] == [
        "system",
        "install",
        "requirements",
    ]
    with pytest.raises(swe.InstanceError, match="pre_install must be"):
        swe.parse_instance({**smith, "pre_install": [1]})
