"""Unified-diff parsing and application round-trip against difflib."""

import difflib

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from gagar_jax.grading import diffs

LINES = st.lists(
    st.sampled_from(["a = 1", "b = a", "", "-- x", "++ y", "--- z", "+++ w", "  ret"]), max_size=30
)


@settings(max_examples=200, deadline=None)
@given(old=LINES, new=LINES, n=st.integers(0, 3))
def test_parse_and_apply_round_trip(old, new, n):
    a = "".join(ln + "\n" for ln in old)
    b = "".join(ln + "\n" for ln in new)
    patch = "".join(
        difflib.unified_diff(a.splitlines(True), b.splitlines(True), "a/f.py", "b/f.py", n=n)
    )
    pp = diffs.parse_unified_diff(patch)
    if a == b:
        assert pp.files == ()
        return
    (fd,) = pp.files
    assert fd.path == "f.py"
    assert len(fd.added) == sum(1 for ln in patch.splitlines()[2:] if ln.startswith("+"))
    assert diffs.apply_file_diff(a, fd) == b
    assert diffs.split_by_file(patch) == {"f.py": patch}


def test_new_deleted_and_mismatched_files():
    patch = (
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
        "--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z = 3\n"
    )
    pp = diffs.parse_unified_diff(patch)
    assert [(f.path, f.is_new, f.is_deleted) for f in pp.files] == [
        ("new.py", True, False),
        ("old.py", False, True),
    ]
    assert diffs.apply_patch({"old.py": "z = 3\n"}, pp) == {"new.py": "x = 1\ny = 2\n"}
    bad = diffs.parse_unified_diff("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-nope\n+yes\n")
    with pytest.raises(diffs.PatchApplyError, match="expects 'nope'"):
        diffs.apply_patch({"f": "other\n"}, bad)
    assert diffs.parse_unified_diff("not a diff at all\n@@ nonsense").files == ()
    assert diffs.is_test_path("tests/x.py") and diffs.is_test_path("pkg/test_y.py")
    assert not diffs.is_test_path("pkg/core.py")


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
    pp = diffs.parse_unified_diff(GIT_DIFF)
    assert pp.paths == ("src/lib.py", "src/new_mod.py")
    lib, new = pp.files
    assert [n for n, _ in lib.added] == [11, 12] and [n for n, _ in lib.removed] == [11]
    assert new.is_new and new.added == [(1, "VALUE = 1")]
    assert pp.has_location("src/lib.py", 12) and not pp.has_location("src/lib.py", 40)
    assert set(diffs.split_by_file(GIT_DIFF)) == {"src/lib.py", "src/new_mod.py"}
