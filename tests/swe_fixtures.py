"""Tiny real git repositories in SWE-bench format, built with git in a test's tmp_path."""

from __future__ import annotations

import json
import os

from gagar_jax.data.repos import git
from gagar_jax.verify.diff import tree_patch


def write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def commit_all(root, msg):
    git("add", "-A", cwd=root)
    git("commit", "-q", "--no-verify", "-m", msg, cwd=root)
    return git("rev-parse", "HEAD", cwd=root).stdout.decode().strip()


def make_instance(
    repos_dir, repo, base, fix, new_tests, f2p, p2p, *, future=True, instance_id=None, **extra
):
    """A repository ``owner__name/`` in ``repos_dir`` whose ``base_commit`` holds ``base``;
    ``patch`` turns it into ``fix`` (changed files only); ``test_patch`` adds ``new_tests``.
    With ``future``, a later commit holding the fix and a tag are kept in the store (what a
    snapshot must never expose)."""
    root = os.path.join(repos_dir, repo.replace("/", "__"))
    os.makedirs(root)
    git("init", "-q", "-b", "main", cwd=root)
    write(root, base)
    sha = commit_all(root, "base")
    if future:
        write(root, {**fix, **new_tests})
        commit_all(root, "the fix")
        git("tag", "v-fixed", cwd=root)
    after = {**base, **fix}
    row = {
        "instance_id": instance_id or repo.replace("/", "__") + "-1",
        "repo": repo,
        "base_commit": sha,
        "patch": tree_patch(base, after),
        "test_patch": tree_patch(base, {**base, **new_tests}),
        "problem_statement": "add() gives the wrong sum",
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p),
        "environment_setup_commit": sha,
        **extra,
    }
    return row


SRC_BASE = {
    "pyproject.toml": '[project]\nname = "srcpkg"\nversion = "1.0"\n',
    "src/srcpkg/__init__.py": "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n",
    "tests/test_neg.py": "from srcpkg import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n",
}
SRC_FIX = {"src/srcpkg/__init__.py": SRC_BASE["src/srcpkg/__init__.py"].replace("a - b", "a + b")}
# the hidden test needs a third-party package that only the task's environment holds
SRC_TESTS = {
    "tests/test_add.py": "import cachetools\nfrom srcpkg import add\n\n\n"
    "def test_add():\n    assert cachetools.LRUCache(2).maxsize == 2\n"
    "    assert add(2, 3) == 5\n"
}


def src_layout_row(repos_dir, **kw):
    return make_instance(
        repos_dir,
        "acme/srcpkg",
        SRC_BASE,
        SRC_FIX,
        SRC_TESTS,
        ["tests/test_add.py::test_add"],
        ["tests/test_neg.py::test_neg"],
        python_deps=["cachetools==5.5.0"],
        **kw,
    )


# ---- recorded rows of other layouts (tests/fixtures/swe_layouts) ------------------------------

LAYOUTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "swe_layouts")
FIXED_DATE = "2024-01-01T00:00:00+00:00"
CALC_GOOD = {
    "calc.py": "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n",
    "tests/test_calc.py": "from calc import add, mul\n\n\ndef test_add():\n"
    "    assert add(2, 3) == 5\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n",
}
CALC_BAD = {**CALC_GOOD, "calc.py": CALC_GOOD["calc.py"].replace("a + b", "a - b")}


def commit_fixed(root, msg):
    """``commit_all`` with a fixed author, committer and date: the same files give the same
    commit id on every machine (the recorded rows name these ids)."""
    import subprocess

    from gagar_jax.data.repos import GIT_ENV

    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        **GIT_ENV,
        "GIT_AUTHOR_DATE": FIXED_DATE,
        "GIT_COMMITTER_DATE": FIXED_DATE,
    }
    for args in (["add", "-A"], ["commit", "-q", "--no-verify", "-m", msg]):
        subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)
    return git("rev-parse", "HEAD", cwd=root).stdout.decode().strip()


def calc_repo(repos_dir, key, *, bug_branch=None):
    """``repos_dir/key``: the calc repository. Without ``bug_branch`` its one commit holds the
    bug (an R2E-Gym or SWE-bench base commit); with it, ``main`` holds the good code and the
    branch ``bug_branch`` one commit with the bug (SWE-smith's layout). Returns the commit ids
    (base, bug-branch tip or None)."""
    root = os.path.join(repos_dir, key)
    os.makedirs(root)
    git("init", "-q", "-b", "main", cwd=root)
    if bug_branch is None:
        write(root, CALC_BAD)
        return commit_fixed(root, "calc"), None
    write(root, CALC_GOOD)
    base = commit_fixed(root, "calc")
    git("checkout", "-q", "-b", bug_branch, cwd=root)
    write(root, CALC_BAD)
    tip = commit_fixed(root, "bug")
    git("checkout", "-q", "main", cwd=root)
    return base, tip
