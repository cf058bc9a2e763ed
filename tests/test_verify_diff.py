"""Tests for the unified-diff parser/applier (real git/diff output and generated diffs)."""

import difflib
import glob
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.diff import DiffError, apply_unified_diff, parse_unified_diff, safe_path

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "repos")


def _udiff(path, old, new):
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        f"a/{path}", f"b/{path}"))  # fmt: skip


def test_fixture_patches_parse_and_apply():
    # Every fixture patch is real `git diff` output; all must apply to their pristine repo.
    n = 0
    for task_dir in sorted(glob.glob(os.path.join(FIXTURES, "*"))):
        task = RepoTask.from_dir(task_dir)
        for p in sorted(glob.glob(os.path.join(task_dir, "patches", "*.diff"))):
            out = apply_unified_diff(task.files, open(p).read())
            assert out != dict(task.files), p
            n += 1
    assert n >= 10


def test_new_deleted_and_no_newline_files():
    files = {"a.py": "x = 1\ny = 2\n", "gone.py": "bye\n", "nonl.txt": "last"}
    patch = (
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+print(1)\n+print(2)\n"
        "--- a/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"
        "--- a/nonl.txt\n+++ b/nonl.txt\n@@ -1 +1 @@\n-last\n\\ No newline at end of file\n+last\n"
        "--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
    )
    out = apply_unified_diff(files, patch)
    assert out == {"a.py": "x = 1\ny = 3\n", "new.py": "print(1)\nprint(2)\n", "nonl.txt": "last\n"}
    fps = parse_unified_diff(patch)
    assert [fp.path for fp in fps] == ["new.py", "gone.py", "nonl.txt", "a.py"]
    assert fps[0].is_new and fps[1].is_deleted
    assert fps[3].hunks[0].added() == [(2, "y = 3")] and fps[3].hunks[0].removed() == [(2, "y = 2")]


def test_hunk_with_offset_applies():
    files = {"f.py": "".join(f"line{i}\n" for i in range(1, 21))}
    new = files["f.py"].replace("line15\n", "LINE15\n")
    patch = _udiff("f.py", files["f.py"], new).replace("@@ -12,7 +12,7 @@", "@@ -9,7 +9,7 @@")
    assert apply_unified_diff(files, patch)["f.py"] == new


@pytest.mark.parametrize(
    "patch, msg",
    [
        ("--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "escapes"),
        ("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "absolute"),
        ("--- a/.git/config\n+++ b/.git/config\n@@ -1 +1 @@\n-a\n+b\n", ".git"),
        ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-nothere\n+b\n", "does not apply"),
        ("--- a/zz.py\n+++ b/zz.py\n@@ -1 +1 @@\n-a\n+b\n", "not in the repository"),
        ("--- a/a.py\n+++ b/a.py\n@@ -1,3 +1,3 @@\n-x = 1\n", "ends early"),
        ("--- a/a.py\n+++ b/b.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n", "renames"),
        ("--- a/a.py\n+++ b/a.py\n@@ bad @@\n", "malformed"),
        ("just some text\n", "no file headers"),
        ("--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n+x\n", "already exists"),
        (
            "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
            "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 3\n",
            "twice",
        ),
    ],
)
def test_bad_patches_are_rejected_with_reason(patch, msg):
    with pytest.raises(DiffError, match=msg):
        apply_unified_diff({"a.py": "x = 1\n"}, patch)


def test_safe_path():
    assert safe_path("pkg/./mod.py") == "pkg/mod.py"
    for bad in ("", "/x", "a/../../x", "..", "a\\b", ".git/x", "a/.git/hooks/x"):
        with pytest.raises(DiffError):
            safe_path(bad)


_line = st.text(alphabet="abc xyz=+()", min_size=0, max_size=8)


@settings(max_examples=60, deadline=None)
@given(old=st.lists(_line, min_size=1, max_size=25), data=st.data())
def test_round_trip_of_generated_diffs(old, data):
    # Property: applying difflib's unified diff of (old -> new) to old gives new.
    new = list(old)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(new)))
        op = data.draw(st.sampled_from(["ins", "del", "rep"]))
        if op == "ins" or not new:
            new.insert(i, data.draw(_line))
        elif op == "del":
            del new[min(i, len(new) - 1)]
        else:
            new[min(i, len(new) - 1)] = data.draw(_line) + "!"
    old_text = "".join(x + "\n" for x in old)
    new_text = "".join(x + "\n" for x in new)
    if old_text == new_text:
        return
    patch = _udiff("m.py", old_text, new_text)
    assert apply_unified_diff({"m.py": old_text}, patch) == {"m.py": new_text}
