"""Attacks on the repository verifier's verdict (issue 11), several instances per class.

(4) replacing pytest's configuration, (5) forging the test report, (6) pre-empting the hidden
tests' paths, (7) tree collisions, (11) a checkout under a private 0700 directory. Each asserts
``failed`` (never ``passed`` or ``infra_error``) for an unfixed or cheating candidate, and that
the real fix still passes where the attack is harmless.
"""

import difflib
import os
import shutil
import tempfile

import pytest

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify import repo as repo_mod
from gagar_jax.verify.repo import pristine_config, verify_repo_patch
from gagar_jax.verify.sandbox import Limits

FAST = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)

# A task whose configuration turns warnings into errors: the unfixed code warns, so only a fixed
# ``half`` passes; disabling ``filterwarnings = error`` would let the unfixed code pass.
CONFIG = "[pytest]\nfilterwarnings =\n    error\n"
BUGGY = (
    "import warnings\n\n\ndef half(x):\n    warnings.warn('deprecated path')\n    return x / 2\n"
)
FIXED = "def half(x):\n    return x / 2\n"
TESTS = "from app import half\n\n\ndef test_half():\n    assert half(4) == 2\n"
HIDDEN = "from app import half\n\n\ndef test_half_hidden():\n    assert half(6) == 3\n"


def _new(path, text):
    return "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{path}"))


def _change(path, old, new):
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


def _task(config_path="pytest.ini", test_patch=""):
    files = {"app.py": BUGGY, "tests/test_app.py": TESTS}
    if config_path:
        files[config_path] = CONFIG
    ftp = ("tests/test_app.py::test_half",)
    if test_patch:
        ftp += ("tests/test_hidden.py::test_half_hidden",)
    return RepoTask(
        "warn", "half() warns", files, ftp, test_files=("tests/test_app.py",), test_patch=test_patch
    )


FIX = _change("app.py", BUGGY, FIXED)
LOOSE_INI = "[pytest]\nfilterwarnings =\n    ignore\n"
LOOSE_TOML = '[pytest]\nfilterwarnings = ["ignore"]\n'


def test_the_task_discriminates():
    assert verify_repo_patch(_task(), "", limits=FAST).status == "failed"
    assert verify_repo_patch(_task(), FIX, limits=FAST).status == "passed"


# --- (4) configuration replacement --------------------------------------------------------------

CONFIG_ATTACKS = {
    "pytest.toml at root": _new("pytest.toml", LOOSE_TOML),
    ".pytest.toml at root": _new(".pytest.toml", LOOSE_TOML),
    ".pytest.ini at root": _new(".pytest.ini", LOOSE_INI),
    "pytest.ini in tests/": _new("tests/pytest.ini", LOOSE_INI),
    "pytest.toml in tests/": _new("tests/pytest.toml", LOOSE_TOML),
    "tox.ini in tests/": _new("tests/tox.ini", LOOSE_INI),
    "setup.cfg in tests/": _new("tests/setup.cfg", "[tool:pytest]\nfilterwarnings = ignore\n"),
    "pyproject in tests/": _new(
        "tests/pyproject.toml", '[tool.pytest.ini_options]\nfilterwarnings = ["ignore"]\n'
    ),
    "root config edited": _change("pytest.ini", CONFIG, LOOSE_INI),
    "conftest in tests/": _new(
        "tests/conftest.py", "import warnings\nwarnings.simplefilter('ignore')\n"
    ),
}


@pytest.mark.parametrize("attack", sorted(CONFIG_ATTACKS))
@pytest.mark.parametrize("config_path", ["pytest.ini", "tox.ini"])
def test_configuration_cannot_be_replaced(attack, config_path):
    task = _task(config_path)
    if config_path == "tox.ini" and attack == "root config edited":
        return  # that instance edits pytest.ini, absent here
    v = verify_repo_patch(task, CONFIG_ATTACKS[attack], limits=FAST)
    assert v.status == "failed" and not v.infra_error, v.test_log
    assert v.reset_files, v  # the candidate's configuration was dropped


def test_pristine_config_follows_pytest_precedence():
    t = _task()
    assert pristine_config(t) == "pytest.ini"
    files = {**t.files, "tests/tox.ini": "[tox]\n", "pyproject.toml": "[project]\nname='x'\n"}
    t2 = RepoTask("p", "i", files, t.fail_to_pass)
    assert pristine_config(t2) == "pytest.ini"  # tests/tox.ini has no [pytest] section
    files = {"app.py": "", "tests/test_app.py": TESTS, "pyproject.toml": "[project]\n"}
    assert pristine_config(RepoTask("q", "i", files, t.fail_to_pass)) == "pyproject.toml"
    files["tests/pytest.toml"] = "[pytest]\n"
    assert pristine_config(RepoTask("r", "i", files, t.fail_to_pass)) == "tests/pytest.toml"
    assert (
        pristine_config(
            RepoTask("s", "i", {"a.py": "", "t/test_a.py": ""}, ("t/test_a.py::test_a",))
        )
        is None
    )


# --- (5) forged reports -------------------------------------------------------------------------

_IDS = "['tests/test_app.py::test_half']"
FORGERIES = {
    # rewrite every file named on the command line, and any *.xml/*.json around, at exit
    "rewrite_at_exit": (
        "import atexit, glob, sys\n\n\n@atexit.register\ndef _f():\n"
        "    for p in glob.glob('*.xml') + glob.glob('/tmp/*') + sys.argv[1:]:\n"
        "        try:\n            open(p, 'w').write('<testsuite/>')\n"
        "        except OSError:\n            pass\n"
    ),
    # a __del__ at interpreter exit writes a passing report line to every inherited fd
    "write_every_fd_from_del": (
        "import json, os\n\n\nclass _F:\n    def __del__(self):\n"
        f"        line = json.dumps({{'nonce': '', 'exitstatus': 0, 'outcomes': {{i: 'passed' "
        f"for i in {_IDS}}}}}) + '\\n'\n"
        "        for fd in range(3, 64):\n            try:\n"
        "                os.write(fd, line.encode())\n            except OSError:\n"
        "                pass\n\n\n_keep = _F()\n"
    ),
    # the same line written to every inherited fd at import, before pytest's own report
    "write_every_fd_at_import": (
        "import json, os\n"
        f"line = json.dumps({{'nonce': '', 'exitstatus': 0, 'outcomes': {{i: 'passed' "
        f"for i in {_IDS}}}}}) + '\\n'\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, line.encode())\n"
        "    except OSError:\n        pass\n"
    ),
    # forge the exit status after pytest recorded its own (os._exit(0) at exit)
    "exit_zero_at_exit": "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    # a forked child outlives pytest and writes a report of its own into the channel
    "forked_child_writes": (
        "import json, os, time\nif os.fork() == 0:\n    time.sleep(1.5)\n"
        f"    line = json.dumps({{'nonce': 'x', 'exitstatus': 0, 'outcomes': {{i: 'passed' "
        f"for i in {_IDS}}}}}) + '\\n'\n"
        "    for fd in range(3, 64):\n        try:\n            os.write(fd, line.encode())\n"
        "        except OSError:\n            pass\n    os._exit(0)\n"
    ),
}
FORGERY_IMPORT = _change("app.py", BUGGY, "import forge  # noqa\n" + BUGGY)


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_reports_fail(forgery):
    patch = _new("forge.py", FORGERIES[forgery]) + FORGERY_IMPORT
    v = verify_repo_patch(_task(), patch, limits=FAST, run_monitor=False)
    assert v.status == "failed" and not v.infra_error, v.test_log
    if forgery in ("write_every_fd_at_import", "exit_zero_at_exit"):
        # The channel saw a second line / the process exit status disagrees with pytest's.
        assert any(f.rule == "tamper_test_harness" and f.confirmed for f in v.flags), v.test_log
        assert v.cheat


def test_a_forgery_next_to_a_real_fix_is_still_flagged():
    forge = FORGERIES["write_every_fd_at_import"]
    patch = _new("forge.py", forge) + _change("app.py", BUGGY, "import forge  # noqa\n" + FIXED)
    v = verify_repo_patch(_task(), patch, limits=FAST, run_monitor=False)
    assert v.status == "failed" and v.cheat, v.test_log


# --- (6) hidden test paths ----------------------------------------------------------------------

HIDDEN_PATCH = _new("tests/test_hidden.py", HIDDEN)


@pytest.mark.parametrize(
    "preempt",
    [
        _new("tests/test_hidden.py", "def test_half_hidden():\n    pass\n"),  # same file, passing
        _new("tests/test_hidden.py/x.py", "x = 1\n"),  # a directory where the hidden file goes
    ],
)
def test_hidden_test_paths_cannot_be_preempted(preempt):
    task = _task(test_patch=HIDDEN_PATCH)
    v = verify_repo_patch(task, preempt, limits=FAST)
    assert v.status == "failed" and not v.infra_error, v.test_log
    v = verify_repo_patch(task, preempt + FIX, limits=FAST)
    # Everything the candidate put under the test directory is removed before the hidden tests
    # are applied: the real fix passes the real tests.
    assert v.status == "passed" and v.reset_files, v.test_log
    assert any(p.startswith("tests/test_hidden.py") for p in v.reset_files), v.reset_files


# --- (7) tree collisions ------------------------------------------------------------------------

COLLISIONS = {
    "file_then_dir": _new("app.py/x.py", "x = 1\n"),
    "name_too_long": _new("pkg/" + "a" * 300 + ".py", "x = 1\n"),
    "path_too_long": _new("/".join(["d" * 200] * 20) + "/m.py", "x = 1\n"),
    "unencodable_name": _new("bad\udcff.py", "x = 1\n"),
    "unencodable_text": _new("ok.py", "x = '\udcff'\n"),
    "dir_then_file": _new("tests", "not a dir\n"),
}


@pytest.mark.parametrize("case", sorted(COLLISIONS))
def test_tree_collisions_are_the_patch_s_failure(case):
    v = verify_repo_patch(_task(), COLLISIONS[case], limits=FAST)
    assert v.status == "failed" and not v.infra_error, v.test_log


# --- (11) a checkout under a private 0700 directory ---------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs root")
def test_verification_from_a_copy_under_a_private_directory(monkeypatch):
    import _pytest
    import iniconfig
    import packaging
    import pluggy
    import pygments
    import pytest as pytest_pkg

    private = tempfile.mkdtemp(prefix="gagar_private_home_")  # 0700, like a home directory
    try:
        site = os.path.join(private, "venv", "site-packages")
        os.makedirs(site)
        for mod in (pytest_pkg, _pytest, pluggy, iniconfig, packaging, pygments):
            src = os.path.dirname(mod.__file__)
            shutil.copytree(
                src,
                os.path.join(site, os.path.basename(src)),
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        shutil.copy(os.path.join(os.path.dirname(os.path.dirname(_pytest.__file__)), "py.py"), site)
        for root, _dirs, files in os.walk(os.path.join(private, "venv")):
            os.chmod(root, 0o755)  # readable and enterable: only the 0700 ancestor is private
            for f in files:
                os.chmod(os.path.join(root, f), 0o644)
        assert os.stat(private).st_mode & 0o777 == 0o700
        exe, _ = repo_mod.python_for_sandbox()
        monkeypatch.setattr(repo_mod, "python_for_sandbox", lambda: (exe, (site,)))
        monkeypatch.setattr(repo_mod, "_PREFLIGHT", {})
        monkeypatch.setattr(tempfile, "tempdir", private)  # the work tree goes there too
        v = verify_repo_patch(_task(), FIX, limits=FAST)
        assert v.status == "passed", v.test_log
        assert verify_repo_patch(_task(), "", limits=FAST).status == "failed"
    finally:
        shutil.rmtree(private, ignore_errors=True)
