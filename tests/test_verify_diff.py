"""Tests for the unified-diff parser/applier (real git/diff output and generated diffs)."""

import difflib
import glob
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.diff import (
    DiffError,
    apply_unified_diff,
    is_test_path,
    parse_unified_diff,
    read_patch,
    safe_path,
    split_by_file,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "repos")


def _udiff(path, old, new):
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


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


def test_zero_context_inserts_land_where_their_headers_say():
    # difflib with n=0: "@@ -0,0 +1 @@" inserts before line 1, "@@ -1,0 +3 @@" after old line 1;
    # the first insertion must not shift the second one (no offset: each hunk is where it says).
    old, new = "b = a\na = 1\n", "a = 1\nb = a\n\na = 1\n"
    patch = "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/f.py", "b/f.py", n=0)
    )
    assert apply_unified_diff({"f.py": old}, patch) == {"f.py": new}


# The graders' view of a patch (read_patch, split_by_file) and the test-path rule.

LINES = st.lists(
    st.sampled_from(["a = 1", "b = a", "", "-- x", "++ y", "--- z", "+++ w", "  ret"]), max_size=30
)


@settings(max_examples=200, deadline=None)
@given(old=LINES, new=LINES, n=st.integers(0, 3))
def test_read_patch_and_apply_round_trip(old, new, n):
    a = "".join(ln + "\n" for ln in old)
    b = "".join(ln + "\n" for ln in new)
    patch = "".join(
        difflib.unified_diff(a.splitlines(True), b.splitlines(True), "a/f.py", "b/f.py", n=n)
    )
    pp = read_patch(patch)
    if a == b:
        assert pp.files == ()
        return
    (fd,) = pp.files
    assert fd.path == "f.py"
    assert len(fd.added()) == sum(1 for ln in patch.splitlines()[2:] if ln.startswith("+"))
    assert apply_unified_diff({"f.py": a}, pp) == {"f.py": b}
    assert split_by_file(patch) == {"f.py": patch}


def test_new_deleted_and_mismatched_files():
    patch = (
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
        "--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z = 3\n"
    )
    pp = read_patch(patch)
    assert [(f.path, f.is_new, f.is_deleted) for f in pp.files] == [
        ("new.py", True, False),
        ("old.py", False, True),
    ]
    assert apply_unified_diff({"old.py": "z = 3\n"}, pp) == {"new.py": "x = 1\ny = 2\n"}
    bad = read_patch("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-nope\n+yes\n")
    with pytest.raises(DiffError, match="context starting 'nope' not found"):
        apply_unified_diff({"f": "other\n"}, bad)
    assert read_patch("not a diff at all\n@@ nonsense").files == ()
    assert is_test_path("tests/x.py") and is_test_path("pkg/test_y.py")
    assert not is_test_path("pkg/core.py")


GIT_DIFF = "\n".join(
    [
        "diff --git a/src/lib.py b/src/lib.py",
        "index 3b18e51..a9c2f7e 100644",
        "--- a/src/lib.py",
        "+++ b/src/lib.py",
        "@@ -10,5 +10,6 @@ class Parser:",
        "     def parse(self, text):",
        '-        return text.split(",")',
        '+        parts = text.split(",")',
        "+        return [p.strip() for p in parts]",
        " ",
        "     def close(self):",
        "         pass",
        "\\ No newline at end of file",
        "diff --git a/src/new_mod.py b/src/new_mod.py",
        "new file mode 100644",
        "index 0000000..e69de29",
        "--- /dev/null",
        "+++ b/src/new_mod.py",
        "@@ -0,0 +1 @@",
        "+VALUE = 1",
        "",
    ]
)


def test_git_style_diff_headers():
    pp = read_patch(GIT_DIFF)
    assert pp.paths == ("src/lib.py", "src/new_mod.py")
    lib, new = pp.files
    assert [n for n, _ in lib.added()] == [11, 12] and [n for n, _ in lib.removed()] == [11]
    assert new.is_new and new.added() == [(1, "VALUE = 1")]
    assert pp.has_location("src/lib.py", 12) and not pp.has_location("src/lib.py", 40)
    assert set(split_by_file(GIT_DIFF)) == {"src/lib.py", "src/new_mod.py"}
