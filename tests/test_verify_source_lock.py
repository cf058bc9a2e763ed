"""The source lock (``verify/source_lock.py``) on a real kernel: which paths get rules, and what a
locked process and its children can still read."""

import os
import subprocess
import sys

import pytest

from gagar_jax.verify import source_lock

HAS_LANDLOCK = source_lock.landlock_abi()[0] >= 1


def _tree(tmp_path):
    root = tmp_path / "repo"
    (root / "tests" / "data").mkdir(parents=True)
    (root / "pkg").mkdir()
    (root / "app.py").write_text("A = 1\n")
    (root / "pkg" / "mod.py").write_text("B = 2\n")
    (root / "tests" / "test_app.py").write_text("SECRET = 5\n")
    (root / "tests" / "helpers.py").write_text("SECRET = 6\n")
    (root / "tests" / "data" / "cases.txt").write_text("8 4\n")
    (root / "tests" / "notes.txt").write_text("n\n")
    os.symlink("tests/test_app.py", root / "alias.py")
    return root


def test_rule_paths_cover_everything_but_the_protected_files_and_their_directories(tmp_path):
    root = _tree(tmp_path)
    protected = [str(root / "tests" / "test_app.py"), str(root / "tests" / "helpers.py")]
    rules = set(source_lock.rule_paths(protected))
    for p in ("app.py", "pkg", "tests/data", "tests/notes.txt"):
        assert str(root / p) in rules, p
    for p in ("tests/test_app.py", "tests/helpers.py", "tests", "", "alias.py"):
        assert str(root / p).rstrip("/") not in rules, p
    assert "/" not in rules and str(tmp_path) not in rules


LOCKED = """
import os, subprocess, sys
sys.path.insert(0, {here!r})
from gagar_jax.verify import source_lock
root = {root!r}
protected = [os.path.join(root, 'tests', 'test_app.py'), os.path.join(root, 'tests', 'helpers.py')]
print(source_lock.lock(protected))
def can(p):
    try:
        with open(p, 'rb') as f:
            f.read()
        return 'ok'
    except OSError as e:
        return type(e).__name__
for p in ('app.py', 'pkg/mod.py', 'tests/data/cases.txt', 'tests/test_app.py',
          'tests/helpers.py', 'alias.py'):
    print(p, can(os.path.join(root, p)))
os.makedirs('/tmp/lockscratch', exist_ok=True)
with open(os.path.join(root, 'pkg', 'new.txt'), 'w') as f:
    f.write('x')
print('new in pkg', can(os.path.join(root, 'pkg', 'new.txt')))
with open(os.path.join(root, 'new.txt'), 'w') as f:
    f.write('x')
print('new in root', can(os.path.join(root, 'new.txt')))
r = subprocess.run(['cat', os.path.join(root, 'tests', 'test_app.py')], capture_output=True)
print('child', r.returncode, len(r.stdout))
"""


@pytest.mark.skipif(not HAS_LANDLOCK, reason="the kernel has no Landlock")
def test_a_locked_process_and_its_children_cannot_read_the_protected_files(tmp_path):
    root = _tree(tmp_path)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", LOCKED.format(here=here, root=str(root))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0].startswith("landlock ABI"), out
    got = dict(line.rsplit(" ", 1) for line in out[1:7])
    assert got == {
        "app.py": "ok",
        "pkg/mod.py": "ok",
        "tests/data/cases.txt": "ok",
        "tests/test_app.py": "PermissionError",
        "tests/helpers.py": "PermissionError",
        "alias.py": "PermissionError",
    }
    assert out[7] == "new in pkg ok"
    # The known price: a file made in a directory above a protected file is not readable.
    assert out[8] == "new in root PermissionError"
    assert out[9].startswith("child 1 0"), out[9]


def test_without_landlock_lock_raises_naming_why(monkeypatch):
    """A kernel without Landlock cannot be produced on this machine: its answer is stood in
    for (named as such), and ``lock`` must refuse with the reason the verdict records."""
    monkeypatch.setattr(source_lock, "landlock_abi", lambda: (0, "landlock unavailable (ENOSYS)"))
    with pytest.raises(OSError, match="landlock unavailable"):
        source_lock.lock(["/nonexistent/tests/test_x.py"])
