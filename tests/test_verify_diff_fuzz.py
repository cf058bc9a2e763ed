"""Fuzzing the diff parser and applier with random and adversarial patches.

Every input is either accepted or refused with a ``DiffError`` naming why (never another
exception, which the verifier would have to treat as its own fault); honest round trips of
files with any line-ending characters apply exactly; and through the repository verifier no
such patch ever comes back as ``infra_error``. Time is bounded by construction (bounded hunk
numbers, an indexed hunk search with a comparison budget, a size limit checked first); the
largest adversarial shapes are run here at full size.
"""

import os
import re
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.diff import (
    MAX_PATCH_BYTES,
    DiffError,
    apply_patch,
    apply_unified_diff,
    check_patch_size,
    parse_unified_diff,
    tree_patch,
)
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits

FILES = {"a.py": "x = 1\ny = 2\nz = 3\n", "pkg/b.py": "def f():\n    return 1\n", "c.txt": ""}

# Characters that break naive line handling: CR, FF, VT, NEL, LS, PS, NUL, ESC, tab.
ODD = "\r\x0c\x0b\x85\u2028\u2029\x00\x1b\t"
line_text = st.text(alphabet=st.sampled_from("ab =()\\+-@ " + ODD), max_size=12)
number = st.one_of(
    st.integers(0, 12),
    st.integers(0, 10**12),
    st.text(alphabet="0123456789", min_size=10, max_size=6000),
)
path = st.one_of(
    st.sampled_from(sorted(FILES) + ["new.py", "/dev/null"]),
    st.text(alphabet=st.sampled_from("ab./\n\r\x00\\" + ODD), min_size=1, max_size=20),
)


@st.composite
def adversarial_patch(draw):
    """A patch from the unified-diff grammar with every part open to bad values."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        old, new = draw(path), draw(path)
        prefix = draw(st.sampled_from(["a/", "b/", ""]))
        out.append(f"--- {prefix if old != '/dev/null' else ''}{old}")
        out.append(f"+++ {'b/' if prefix and new != '/dev/null' else ''}{new}")
        for _ in range(draw(st.integers(0, 3))):
            a, b, c, d = (draw(number) for _ in range(4))
            out.append(f"@@ -{a},{b} +{c},{d} @@" if draw(st.booleans()) else f"@@ -{a} +{c} @@")
            for _ in range(draw(st.integers(0, 6))):
                tag = draw(st.sampled_from([" ", "-", "+", "\\", "", "@", "x"]))
                out.append(tag + draw(line_text))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    return eol.join(out) + draw(st.sampled_from(["", eol]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=400), adversarial_patch()))
def test_any_text_is_accepted_or_refused_with_a_reason(text):
    try:
        patches = parse_unified_diff(text)
    except DiffError as e:
        assert str(e)  # a named reason
        return
    assert patches
    try:
        apply_unified_diff(FILES, patches)
    except DiffError as e:
        assert str(e)


file_text = st.text(alphabet=st.sampled_from("ab \n" + ODD), max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["a.py", "d/b.py", "c"]), file_text, max_size=3),
    st.dictionaries(st.sampled_from(["a.py", "d/b.py", "c"]), file_text, max_size=3),
)
def test_honest_round_trip_with_any_line_endings(before, after):
    patch = tree_patch(before, after)
    if not patch:
        assert before == after
        return
    assert apply_unified_diff(before, patch) == after


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["a.py", "d/b.py", "c"]), file_text, max_size=3),
    st.dictionaries(st.sampled_from(["a.py", "d/b.py", "c"]), file_text, max_size=3),
    st.integers(-3, 40),
    st.text(max_size=30).filter(lambda t: "\n" not in t),
)
def test_the_applied_patch_is_the_change_whatever_the_text_around_it(before, after, shift, note):
    """An honest patch with a preamble, words after its hunk headers and header numbers moved
    by ``shift`` applies to the same tree, and its ``AppliedPatch`` is the honest patch: the
    same canonical text (``tree_patch``'s), the same parse, the tree it names."""
    patch = tree_patch(before, after)
    if not patch:
        return
    noisy = []
    for line in patch.split("\n"):
        m = re.match(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@$", line)
        if m:
            o, n = max(int(m.group(1)) + shift, 0), max(int(m.group(3)) + shift, 0)
            line = f"@@ -{o}{m.group(2) or ''} +{n}{m.group(4) or ''} @@ {note}"
        noisy.append(line)
    noisy_text = "preamble: " + note + "\n" + "\n".join(noisy)
    try:
        applied = apply_patch(before, noisy_text)
    except DiffError:
        return  # a shifted header whose context now matches elsewhere first: refused, fine
    if applied.tree(before) != after:
        return  # an ambiguous context found earlier (as patch would): a different, valid change
    honest = apply_patch(before, patch)
    assert applied.text == honest.text == patch
    assert parse_unified_diff(applied.text) == list(applied.patch.files)
    assert apply_unified_diff(before, applied.text) == after


def test_the_largest_adversarial_shapes_are_bounded():
    # A hunk header of 10k digits, 1 MiB of one-character hunk lines, 20k hunks on a file of
    # identical lines: each ends in a DiffError (or applies) without an unbounded search.
    big_lines = {"a.py": "x\n" * 100_000}
    shapes = [
        "--- a/a.py\n+++ b/a.py\n@@ -" + "9" * 10_000 + " +1 @@\n-x\n+y\n",
        "--- a/a.py\n+++ b/a.py\n@@ -1,400000 +1,400000 @@\n" + " x\n" * 400_000,
        "--- a/a.py\n+++ b/a.py\n" + "@@ -1,2 +1,2 @@\n x\n-y\n+z\n" * 20_000,
    ]
    for patch in shapes:
        assert len(patch) <= MAX_PATCH_BYTES * 2
        t0 = time.monotonic()
        try:
            apply_unified_diff(big_lines, patch)
        except DiffError:
            pass
        print(f"{len(patch)} bytes: {time.monotonic() - t0:.2f} s")  # reported, not asserted
    too_big = "x" * (MAX_PATCH_BYTES + 1)
    try:
        check_patch_size(too_big)
        raise AssertionError("not refused")
    except DiffError as e:
        assert "patch_too_large" in str(e)


FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "repos", "statkit")
FAST = Limits(wall_s=30, cpu_s=30, memory_bytes=512 << 20, nproc=64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial_patch())
def test_the_verifier_never_turns_a_bad_patch_into_infra_error(patch):
    task = RepoTask.from_dir(FIXTURE)
    v = verify_repo_patch(task, patch, limits=FAST)
    assert not v.infra_error, v.test_log
    assert v.status == "failed" or (v.status == "passed" and not patch.strip()), v.test_log
