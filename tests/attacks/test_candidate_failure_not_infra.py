"""Attack class: the candidate's own failure becomes an unscored ``infra_error``.

``infra_error`` masks a sample out of training; a policy that learns to end a failing rollout
that way escapes its zero reward. Every exception from parsing, applying or monitoring the
candidate's patch or tool calls is the candidate's ``failed`` with a named reason. These run on
the trusted side before any sandbox (the class does not depend on the mechanism). Honest
patches of files with CRLF line endings or form feeds apply exactly.
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    BUGGY,
    FIXED,
    TASK,
    assert_blocked,
    change,
    new_file,
    verify,
)

from gagar_jax.envs.repo import RepoAgentEnv  # noqa: E402
from gagar_jax.verify.diff import (  # noqa: E402
    MAX_APPLY_COMPARISONS,
    MAX_PATCH_BYTES,
    DiffError,
    apply_unified_diff,
    tree_patch,  # noqa: E402
)

ATTACKS = {
    "hunk_header_of_thousands_of_digits": (
        "--- a/app.py\n+++ b/app.py\n@@ -" + "9" * 5000 + ",1 +1,1 @@\n-x\n+y\n",
        "malformed",
    ),
    "hunk_length_of_thousands_of_digits": (
        "--- a/app.py\n+++ b/app.py\n@@ -1," + "7" * 4500 + " +1 @@\n-x\n",
        "malformed",
    ),
    "path_with_a_newline": ("--- a/ap\np.py\n+++ b/ap\np.py\n@@ -1 +1 @@\n-x\n+y\n", "header"),
    "path_with_an_escape_character": (new_file("a\x1b[2Jb.py", "x = 1\n"), "control character"),
    "path_with_a_carriage_return": (new_file("ab\r.py", "x = 1\n"), "control character"),
    "patch_over_the_size_limit": (
        new_file("big.py", "x = 1\n" * (MAX_PATCH_BYTES // 6 + 10)),
        "patch_too_large",
    ),
    "binary_patch": ("diff --git a/app.py b/app.py\nGIT binary patch\nliteral 0\n", "binary"),
    "rename": ("diff --git a/app.py b/main.py\nrename from app.py\nrename to main.py\n", "renames"),
    "unencodable_text": (new_file("ok.py", "x = '\udcff'\n"), "UTF-8"),
    "hunk_claims_more_lines_than_it_has": (
        "--- a/app.py\n+++ b/app.py\n@@ -1,99999999 +1,99999999 @@\n-x\n",
        "ends early",
    ),
    "garbage": ("\x00\x01\x02 not a diff", "no file headers"),
    "file_both_created_and_changed": (new_file("app.py", "x = 1\n"), "already exists"),
}

# What the candidate writes that the behaviour monitor must survive (it runs first).
MONITOR_ATTACKS = {
    "float_literal_1e999": change("app.py", BUGGY, BUGGY + "LIMIT = 1e999\nN = int(-1e999)\n"),
    "deeply_nested_expression": change(
        "app.py", BUGGY, BUGGY + "X = " + "(" * 5000 + "1" + ")" * 5000 + "\n"
    ),
    "a_208_kb_line": change("app.py", BUGGY, BUGGY + "S = '" + "ab(" * 70_000 + "'\n"),
    "null_byte_in_source": change("app.py", BUGGY, BUGGY + "S = '\x00'\n"),
    "huge_integer_literal": change("app.py", BUGGY, BUGGY + "N = " + "9" * 5000 + "\n"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_bad_patch_is_the_candidate_s_failure(name):
    patch, reason = ATTACKS[name]
    t0 = time.monotonic()
    v = verify(patch, run_monitor=True)
    elapsed = time.monotonic() - t0
    assert_blocked(v)
    assert v.sandbox is None and v.patch_error and reason in v.patch_error, v.test_log
    print(f"{name}: refused in {elapsed:.3f} s")  # the figure, not an assertion (loaded CI)


@pytest.mark.parametrize("name", sorted(MONITOR_ATTACKS))
def test_what_breaks_the_monitor_is_the_candidate_s_failure(name):
    v = verify(MONITOR_ATTACKS[name], run_monitor=True)
    assert_blocked(v)


def test_a_bytes_patch_is_refused_with_a_reason():
    v = verify(b"--- a/app.py\n+++ b/app.py\n", run_monitor=False)  # type: ignore[arg-type]
    assert_blocked(v)
    assert "must be str" in v.patch_error


def test_a_costly_hunk_search_is_bounded():
    # 40k identical lines and hunks whose context almost matches everywhere: without a bound the
    # search is quadratic. It is refused with a named reason instead.
    files = {"a.py": "x = 1\n" * 40_000}
    hunks = "".join(f"@@ -{i},3 +{i},3 @@\n x = 1\n-x = 1\n+x = 2\n x = 1\n" for i in range(1, 3))
    body = "".join(
        "@@ -1,2001 +1,2001 @@\n" + " x = 1\n" * 2000 + "-y = 1\n+y = 2\n" for _ in range(40)
    )
    assert apply_unified_diff(files, "--- a/a.py\n+++ b/a.py\n" + hunks)["a.py"].count("x = 2") == 2
    t0 = time.monotonic()
    with pytest.raises(DiffError, match="not apply|patch_too_costly"):
        apply_unified_diff(files, "--- a/a.py\n+++ b/a.py\n" + body)
    print(f"refused in {time.monotonic() - t0:.3f} s; budget {MAX_APPLY_COMPARISONS}")


def test_an_edit_tool_call_with_a_newline_in_its_path_is_an_error_message():
    env = RepoAgentEnv(TASK)
    call = (
        '<tool_call>{"name": "edit", "arguments": {"path": %s, "content": "x = 1\\n"}}</tool_call>'
    )
    r = env.step(call % '"ap\\np.py"')
    assert "error" in r.observation and not r.done
    r = env.step(call % '"../etc/x.py"')
    assert "error" in r.observation
    assert env.files == dict(TASK.files)  # nothing was written
    v = verify(env.patch())
    assert v.status == "failed" and not v.infra_error


# --- honest patches that used to fail: CRLF and form feeds --------------------------------------

CRLF_BUGGY = "def half(x):\r\n    # halves\x0c\r\n    return x\r\n"
CRLF_FIXED = "def half(x):\r\n    # halves\x0c\r\n    return x / 2\r\n"


def test_crlf_and_form_feed_files_apply_exactly():
    import dataclasses

    t = dataclasses.replace(TASK, files={**TASK.files, "app.py": CRLF_BUGGY})
    patch = tree_patch(t.files, {**t.files, "app.py": CRLF_FIXED})
    assert apply_unified_diff(t.files, patch)["app.py"] == CRLF_FIXED
    v = verify(patch, the_task=t, run_monitor=True)
    assert v.status == "passed" and not v.cheat, v.test_log
    # A hand-written CRLF diff (git's output for such a file) applies too.
    git_style = (
        "--- a/app.py\r\n+++ b/app.py\r\n@@ -1,3 +1,3 @@\r\n def half(x):\r\n"
        "     # halves\x0c\r\n-    return x\r\n+    return x / 2\r\n"
    )
    assert apply_unified_diff(t.files, git_style)["app.py"] == CRLF_FIXED


def test_a_file_without_a_final_newline_round_trips():
    before = {"app.py": BUGGY.rstrip("\n")}
    after = {"app.py": FIXED.rstrip("\n")}
    assert apply_unified_diff(before, tree_patch(before, after)) == after
