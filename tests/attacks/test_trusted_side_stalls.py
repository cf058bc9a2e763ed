"""Class 6: input that would stall the trusted side (the monitor runs in the trainer process).

Each pathological patch line or trajectory action below took the earlier text rules seconds to
minutes (quadratic backtracking: ``\\d+\\s+passed`` on a run of digits, three adjacent optional
whitespace runs after ``except``, ``subprocess.x(.*curl``, ``git log[^|]*--all``, a redirect
followed by ``\\S*``). The monitor now answers every one of them with flags under its default
deadline (no ``MonitorRefusal``), input over its size bounds is refused by name, and the
verifier turns a refusal into ``failed``, never ``infra_error``.
"""

import importlib

import pytest
from _monitor_kit import CTX, app, verdict, verify

M = importlib.import_module("gagar_jax.verify.monitor")  # the package exports the function

N = 208_000  # the size of the patch line that took the old rules 70 s
PATCH_LINES = {
    "digits": "1" * N,
    "except_then_spaces": "except" + " " * N + "x",
    "sys_exit_then_spaces": "sys.exit(" + " " * N + "x",
    "repeated_subprocess_calls": "subprocess.run(" * (N // 15),
    "assert_not_then_spaces": "assert not" + " " * N + "x",
    "open_parentheses": "(" * N,
    "quotes": "'" * N,
    "grader_words": "note to " * (N // 8),
}
ACTIONS = {
    "repeated_git_log": "git log " * 8_000,
    "repeated_rm": "rm " * 21_000,
    "repeated_sed": "sed -i " * 9_000,
    "redirections": ">" * 64_000,
    "slashes": "/" * 64_000,
    "parent_dirs": "../" * 21_000,
}


def one_line_patch(line):
    head = "--- a/app.py\n+++ b/app.py\n@@ -1,2 +1,2 @@\n def half(x):\n"
    return f"{head}-    return x // 2 + 1\n+{line}\n"


@pytest.mark.parametrize("name", sorted(PATCH_LINES))
def test_pathological_patch_lines_get_a_verdict(name):
    flags = M.monitor_patch(one_line_patch(PATCH_LINES[name]), CTX)  # raises on a refusal
    assert all(f.rule in M.RULES for f in flags)


@pytest.mark.parametrize("name", sorted(ACTIONS))
def test_pathological_actions_get_a_verdict(name):
    events = [
        {"turn": 0, "kind": "tool_call", "text": ACTIONS[name]},
        {"turn": 1, "kind": "message", "text": ACTIONS[name]},
    ]
    flags = M.monitor_trajectory(events, CTX)
    assert all(f.rule in M.RULES for f in flags)
    assert all(f.rule in M.RULES for f in M.monitor_log(ACTIONS[name]))


def test_a_patch_over_the_bound_is_refused_by_name():
    with pytest.raises(M.MonitorRefusal) as e:
        M.monitor_patch(one_line_patch("x" * (M.MAX_PATCH_CHARS + 1)), CTX)
    assert e.value.reason == "patch_too_large"


def test_a_trajectory_over_the_bound_is_refused_by_name():
    big = "y" * (M.MAX_TRAJECTORY_CHARS // 4 + 1)
    events = [{"turn": k, "kind": "tool_call", "text": big} for k in range(4)]
    with pytest.raises(M.MonitorRefusal) as e:
        M.monitor_trajectory(events, CTX)
    assert e.value.reason == "trajectory_too_large"


def test_the_deadline_is_a_named_refusal():
    patch = app("".join(f"v{k} = {k}\n" for k in range(3000)) + "def half(x):\n    return x\n")
    with pytest.raises(M.MonitorRefusal) as e:
        M.monitor(patch, [], CTX, deadline_s=0.0)
    assert e.value.reason == "deadline"


def test_a_refusal_fails_the_candidate_not_the_infrastructure():
    v = verify(one_line_patch("x = 1 " * (M.MAX_PATCH_CHARS // 6 + 1)))
    assert v.status == "failed" and verdict(v) == "failed" and not v.infra_error
    assert "patch_too_large" in v.test_log  # the verifier's own bound may refuse it first
    with pytest.raises(M.MonitorRefusal):  # the monitor's bound holds without the verifier's
        M.monitor(one_line_patch("x = 1 " * (M.MAX_PATCH_CHARS // 6 + 1)), [], CTX)
    huge = [{"turn": 0, "kind": "tool_call", "text": "y" * (M.MAX_TRAJECTORY_CHARS + 1)}]
    v = verify(app("def half(x):\n    return x / 2\n"), events=huge)  # a fix, but a refusal
    assert v.status == "failed" and not v.infra_error
    assert "monitor refused the candidate (trajectory_too_large)" in v.test_log


@pytest.mark.parametrize(
    "source",
    [
        "def half(x):\n    return 1e999 if x == 1e999 else x / 2\n",  # int(inf) raised before
        "def half(x):\n    return -1e999 if x == 'a -- b' else x / 2\n",
        "def half(x):\n    return 1e999j if x == 10**5000 else x / 2\n",  # a 5000-digit literal
        "def half(x:\n    return x / 2\n",  # unparsable: the run fails, the monitor does not
        "def half(x):\n" + "    " + "[" * 300 + "]" * 300 + "\n    return x / 2\n",  # deep nesting
        "def half(x):\n    return x / 2\n\x00\n",  # a NUL byte
    ],
)
def test_odd_but_legal_input_is_never_an_infra_error(source):
    ctx = M.MonitorContext(test_sources={"t.py": "def test():\n    assert f(1e999) == 1e999\n"})
    assert all(f.rule in M.RULES for f in M.monitor_patch(app(source), ctx))
    v = verify(app(source))
    assert not v.infra_error and "monitor refused" not in v.test_log, v.test_log[-500:]
