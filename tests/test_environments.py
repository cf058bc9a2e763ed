"""What a verification sees: the task's environment and tree, never the trainer's packages.

- The test runner's environment (``verify.runner_env``): pytest and its plugins at our versions,
  staged where every sandbox uid can read it, and nothing else of this process's site-packages.
- The attrs case: a package the trainer has installed (attrs, through jsonschema) must not stand
  in for the task's tree: the gold patch passes, the empty and a wrong patch fail.
- ``RepoTask`` finds a ``src/`` layout's import path itself.
- Every dependency declaration of a tree (``verify.layout.declared_requirements``).
"""

from __future__ import annotations

import difflib
import os
import stat
import sysconfig

import pytest

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify import layout, runner_env
from gagar_jax.verify import sandbox as sb
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits

FAST = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)


def _diff(path, old, new):
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


# A tree of the package the trainer has installed as ``attr`` (attrs), in a src/ layout, whose
# asdict drops the last attribute. The test passes against the installed attrs release.
ATTR_SRC = """\
class _Attribute:
    pass


def ib():
    return _Attribute()


def s(cls):
    names = [k for k, v in vars(cls).items() if isinstance(v, _Attribute)]

    def __init__(self, *args):
        for name, value in zip(names, args):
            setattr(self, name, value)

    cls.__init__ = __init__
    cls.__attrs_names__ = names
    return cls


def asdict(obj):
    return {n: getattr(obj, n) for n in obj.__attrs_names__[:-1]}
"""
ATTR_TEST = """\
import attr


@attr.s
class Point:
    x = attr.ib()
    y = attr.ib()


def test_asdict():
    assert attr.asdict(Point(1, 2)) == {"x": 1, "y": 2}


def test_init():
    assert Point(3, 4).y == 4
"""


def _attr_task(**kw):
    files = {
        "pyproject.toml": '[project]\nname = "attrs"\nversion = "0.1"\n',
        "src/attr/__init__.py": ATTR_SRC,
        "tests/test_attr.py": ATTR_TEST,
    }
    return RepoTask(
        task_id="attrs-shadow",
        issue="asdict drops the last attribute",
        files=files,
        fail_to_pass=("tests/test_attr.py::test_asdict",),
        pass_to_pass=("tests/test_attr.py::test_init",),
        test_files=("tests/test_attr.py",),
        **kw,
    )


def test_runner_env_holds_the_test_tools_only_readable_by_every_uid():
    exe, paths = sb.python_for_sandbox()
    assert len(paths) == 1
    site = paths[0]
    assert site != sysconfig.get_paths()["purelib"]
    assert site.startswith(runner_env.stage_root() + os.sep)
    names = {n.split("-")[0].lower() for n in os.listdir(site) if n.endswith(".dist-info")}
    want = {r.split("==")[0].replace("-", "_") for r in runner_env.runner_requirements()}
    assert names == want
    assert {"pytest", "pytest_timeout", "pluggy"} <= names
    assert not {"attrs", "jax", "numpy", "gagar_jax"} & names
    # every directory on the way is open to an unprivileged uid (no bind needed)
    d = site
    while d != "/":
        assert os.stat(d).st_mode & stat.S_IXOTH, d
        d = os.path.dirname(d)


def test_runner_env_copy_fallback_has_the_same_distributions(tmp_path, monkeypatch):
    # without uv (or without the registry) the installed files are staged instead
    monkeypatch.setenv("GAGAR_SANDBOX_ENVS", str(tmp_path / "envs"))
    exe, _ = sb.python_for_sandbox()
    site = runner_env.build_runner_env(exe, use_uv=False)
    names = sorted(n for n in os.listdir(site) if n.endswith(".dist-info"))
    assert len(names) == len(runner_env.runner_requirements())
    assert os.path.isfile(os.path.join(site, "_pytest", "main.py"))
    assert runner_env.build_runner_env(exe, use_uv=False) == site  # cached


def test_runner_env_root_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)  # writable by others: another user could swap the packages
    monkeypatch.setenv("GAGAR_SANDBOX_ENVS", str(root))
    with pytest.raises(runner_env.RunnerEnvError, match="writable by nobody else"):
        runner_env.stage_root()


def test_repo_task_detects_the_src_layout():
    assert _attr_task().pythonpath == ("src",)
    assert _attr_task(pythonpath=("lib",)).pythonpath == ("lib",)
    flat = RepoTask("flat", "x", {"m.py": "", "t/test_m.py": ""}, ("t/test_m.py::test_a",))
    assert flat.pythonpath == ()


def test_an_installed_release_does_not_satisfy_the_task():
    import attr  # noqa: F401  # installed here (jsonschema's dependency): the case tested

    task = _attr_task()
    fixed = ATTR_SRC.replace("[:-1]", "")
    wrong = ATTR_SRC.replace("getattr(obj, n)", "None")
    results = {
        "gold": verify_repo_patch(
            task, _diff("src/attr/__init__.py", ATTR_SRC, fixed), limits=FAST
        ),
        "empty": verify_repo_patch(task, "", limits=FAST),
        "wrong": verify_repo_patch(
            task, _diff("src/attr/__init__.py", ATTR_SRC, wrong), limits=FAST
        ),
    }
    assert results["gold"].status == "passed", results["gold"].test_log
    assert results["empty"].status == "failed", results["empty"].test_log
    assert results["wrong"].status == "failed", results["wrong"].test_log
    assert results["empty"].tests["tests/test_attr.py::test_asdict"] == "failed"
    for r in results.values():
        assert sysconfig.get_paths()["purelib"] not in r.pythonpath


def test_declared_requirements_read_every_declaration():
    files = {
        "pyproject.toml": """
[project]
name = "demo-pkg"
dependencies = ["six>=1.0"]
[project.optional-dependencies]
tests = ["demo_pkg[extra-a]", "pytest>=7", "hypothesis"]
extra-a = ["toolz"]
docs = ["sphinx"]
[dependency-groups]
test = ["freezegun", {include-group = "typing"}]
typing = ["typing-extensions"]
lint = ["ruff"]
""",
        "requirements-test.txt": "# comment\n-r requirements/base.txt\nidna==3.4 --hash=sha256:x\n"
        "-e .\nhttps://example.invalid/x.whl\n",
        "requirements/base.txt": "attrs\n",
        "requirements-docs.txt": "furo\n",
        "tox.ini": "[testenv]\ndeps =\n    wcwidth\n    py38: mock\n    {env:EXTRA}\n"
        "commands = pytest\n",
    }
    got = layout.declared_requirements(files)
    assert got == [
        "six>=1.0",
        "hypothesis",
        "freezegun",
        "typing-extensions",
        "attrs",
        "idna==3.4",
        "wcwidth",
        "toolz",  # demo_pkg[extra-a], expanded after the declarations
    ]
    assert not layout.needs_backend_metadata(files)


def test_declared_requirements_from_setup_cfg_and_setup_py_only():
    cfg = {
        "setup.cfg": "[metadata]\nname = x\n[options]\ninstall_requires =\n    six\n"
        "tests_require = mock\n[options.extras_require]\ntesting =\n    toolz\n",
        "setup.py": "from setuptools import setup\nsetup()\n",
    }
    assert layout.declared_requirements(cfg) == ["six", "mock", "toolz"]
    assert not layout.needs_backend_metadata(cfg)
    only_py = {"setup.py": "from setuptools import setup\nsetup(install_requires=['six'])\n"}
    assert layout.declared_requirements(only_py) == []
    assert layout.needs_backend_metadata(only_py)
    assert layout.declared_requirements(only_py, runtime=["six"]) == ["six"]
    dynamic = {"pyproject.toml": '[project]\nname = "d"\ndynamic = ["dependencies"]\n'}
    assert layout.needs_backend_metadata(dynamic)


# A setuptools project known only through setup.py: its version file is written by the build,
# its plugins are found by entry-point name, and its one dependency (six) is declared nowhere
# else. ``shout`` has the bug the task fixes.
VERPKG_SETUP = """\
import os
from setuptools import setup

with open(os.path.join("verpkg", "_version.py"), "w") as f:
    f.write('__version__ = "1.2.3"\\n')
setup(
    name="verpkg",
    version="1.2.3",
    packages=["verpkg"],
    install_requires=["six"],
    extras_require={"test": ["toolz"]},
    entry_points={"verpkg.plugins": ["upper = verpkg.plugins:upper"]},
)
"""
VERPKG_INIT = """\
import importlib.metadata

from verpkg._version import __version__


def plugin(name):
    (ep,) = importlib.metadata.entry_points(group="verpkg.plugins", name=name)
    return ep.load()


def shout(text):
    return plugin("upper")(text)
"""
VERPKG_PLUGINS = "def upper(text):\n    return text.lower()\n"
VERPKG_TESTS = """\
import importlib.metadata

import six
import toolz

import verpkg


def test_version():
    assert verpkg.__version__ == importlib.metadata.version("verpkg") == "1.2.3"


def test_shout():
    assert verpkg.shout("hi") == "HI"


def test_deps():
    assert six.PY3 and toolz.identity(1) == 1
"""
VERPKG = {
    "setup.py": VERPKG_SETUP,
    "verpkg/__init__.py": VERPKG_INIT,
    "verpkg/plugins.py": VERPKG_PLUGINS,
    "tests/test_verpkg.py": VERPKG_TESTS,
}


def test_a_repository_installed_into_its_environment(tmp_path):
    from gagar_jax.data import environments, repos

    cache = str(tmp_path / "cache")
    assert layout.needs_backend_metadata(VERPKG)
    inst = environments.install_repository(VERPKG, cache_dir=cache)
    assert inst.files["verpkg/_version.py"] == '__version__ = "1.2.3"\n'  # written by the build
    assert "verpkg-1.2.3.dist-info/entry_points.txt" in inst.metadata_paths
    assert set(inst.requires) == {"six", "toolz"}  # setup.py's and the test extra's
    assert not any(p.startswith(("build/", "verpkg.egg-info")) for p in inst.files)
    again = environments.install_repository(VERPKG, cache_dir=cache)
    assert again.reused and again.files == inst.files
    env = repos.build_env(
        layout.declared_requirements(VERPKG, runtime=inst.requires), cache_dir=cache
    )
    files = {**VERPKG, **inst.files}
    task = RepoTask(
        task_id="verpkg",
        issue="shout does not shout",
        files=files,
        fail_to_pass=("tests/test_verpkg.py::test_shout",),
        pass_to_pass=("tests/test_verpkg.py::test_version", "tests/test_verpkg.py::test_deps"),
        test_files=("tests/test_verpkg.py", *inst.metadata_paths),
        env_path=env.path,
        env_hash=env.env_hash,
    )
    gold = _diff("verpkg/plugins.py", VERPKG_PLUGINS, VERPKG_PLUGINS.replace("lower", "upper"))
    v = verify_repo_patch(task, gold, limits=FAST)
    assert v.status == "passed", v.test_log
    empty = verify_repo_patch(task, "", limits=FAST)
    assert empty.status == "failed" and empty.tests["tests/test_verpkg.py::test_shout"] == "failed"
    assert empty.tests["tests/test_verpkg.py::test_version"] == "passed"
    # without the install: no version file, no metadata, no six: the gold patch cannot pass
    bare = RepoTask("bare", "x", VERPKG, task.fail_to_pass, task.pass_to_pass)
    assert verify_repo_patch(bare, gold, limits=FAST).status == "failed"


def test_test_commands_of_task_rows():
    from gagar_jax.data.environments import InstallError, check_test_command

    for ok in ("pytest", "pytest -rA --tb=short", "python -m pytest -x", "PYTHONWARNINGS=i pytest"):
        check_test_command(ok)
    for bad in ("tox -e py", "./tests/runtests.py", "pytest && rm -rf /", "make test"):
        with pytest.raises(InstallError, match="container environment"):
            check_test_command(bad)


def test_metadata_requirements_keep_the_test_extras():
    from gagar_jax.data.environments import metadata_requirements

    meta = (
        "Metadata-Version: 2.1\nName: x\nRequires-Dist: six\n"
        'Requires-Dist: toolz ; extra == "test"\n'
        'Requires-Dist: mock ; python_version < "3.8" and extra == "tests"\n'
        'Requires-Dist: sphinx ; extra == "docs"\n'
    )
    assert metadata_requirements(meta) == ["six", "toolz", 'mock ; python_version < "3.8"']


def _verpkg_row(repos_dir, **extra):
    from tests.swe_fixtures import make_instance

    fixed = {"verpkg/plugins.py": VERPKG_PLUGINS.replace("lower", "upper")}
    base = {k: v for k, v in VERPKG.items() if k != "tests/test_verpkg.py"}
    return make_instance(
        repos_dir,
        "acme/verpkg",
        base,
        fixed,
        {"tests/test_verpkg.py": VERPKG_TESTS},
        ["tests/test_verpkg.py::test_shout"],
        ["tests/test_verpkg.py::test_version", "tests/test_verpkg.py::test_deps"],
        **extra,
    )


def test_a_swe_row_without_python_deps_installs_its_repository(tmp_path):
    from gagar_jax.data import swe

    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    inst = swe.parse_instance(_verpkg_row(repos_dir, install="python -m pip install -e .[test]"))
    assert not inst.python_deps
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache)
    assert task.files["verpkg/_version.py"] == '__version__ = "1.2.3"\n'
    assert "verpkg-1.2.3.dist-info/entry_points.txt" in task.test_files  # reset to pristine
    lock = open(os.path.join(task.env_path, ".gagar-env")).read()
    assert "six==" in lock and "toolz==" in lock  # setup.py's and its test extra's
    gold = verify_repo_patch(task, task.reference_patch, limits=FAST)
    assert gold.status == "passed", gold.test_log
    assert verify_repo_patch(task, "", limits=FAST).status == "failed"


def test_a_row_that_cannot_be_installed_or_resolved_is_a_task_error(tmp_path):
    from gagar_jax.data import swe

    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = _verpkg_row(repos_dir, install="apt-get install -y libfoo && pip install -e .")
    with pytest.raises(swe.InstanceError, match="install: .*container environment"):
        swe.to_repo_task(swe.parse_instance(row), repos_dir, cache_dir=cache)
    # the factory's rows import the package from the tree, with no install
    plain = swe.to_repo_task(swe.parse_instance({**row, "install": "pythonpath"}), repos_dir,
                             cache_dir=cache)  # fmt: skip
    assert not any(".dist-info/" in p for p in plain.files)
    tox = {**row, "install": "", "test_cmd": "tox -e py311"}
    with pytest.raises(swe.InstanceError, match="test_cmd .*container environment"):
        swe.to_repo_task(swe.parse_instance(tox), repos_dir, cache_dir=cache)
    broken = {**row, "instance_id": "acme__verpkg-2", "install": "",
              "python_deps": ["gagar-no-such-package-anywhere==0.0.1"]}  # fmt: skip
    with pytest.raises(swe.InstanceError, match="its environment"):
        swe.to_repo_task(swe.parse_instance(broken), repos_dir, cache_dir=cache)


def test_an_environment_the_sandbox_uid_cannot_reach_is_an_infra_error_not_a_silent_run(tmp_path):
    """A task environment under a private (0700) directory: bwrap binds it around the private
    ancestor; the mechanisms that see real paths cannot read it, and say so (infra_error,
    masked), never run the tests without their interpreter's packages."""
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    _, (runner_site,) = sb.python_for_sandbox()
    import shutil

    site = private / "env" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(runner_site, site)
    task = _attr_task(env_path=str(private / "env"))
    fixed = _diff("src/attr/__init__.py", ATTR_SRC, ATTR_SRC.replace("[:-1]", ""))
    avail = sb.available_mechanisms()
    for mech in ("bwrap", "unshare", "rlimits"):
        if avail[mech] is not None:
            continue
        v = verify_repo_patch(task, fixed, limits=FAST, config=sb.SandboxConfig(mechanism=mech))
        if mech == "bwrap":
            assert v.status == "passed", v.test_log
        else:
            assert v.status == "infra_error", v.test_log
            assert "pytest is not importable in the sandbox" in v.test_log
