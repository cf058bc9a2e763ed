"""Hypothesis fuzz of the behaviour monitor: random and adversarial patches, trajectories, logs.

Whatever the candidate writes, the monitor answers with flags of known rules or a
``MonitorRefusal`` naming one of ``REFUSALS`` (never another exception), and the verifier
turns the candidate's material into ``passed``/``failed``, never ``infra_error``.
"""

import importlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.flags import MonitorFlag
from gagar_jax.verify.repo import context_for_repo_task, verify_repo_patch
from gagar_jax.verify.sandbox import Limits

M = importlib.import_module("gagar_jax.verify.monitor")  # the package exports the function

SRC = "def half(x):\n    return x // 2 + 1\n"
TESTS = "from app import half\n\n\ndef test_half():\n    assert half(4) == 2\n"
TASK = RepoTask(
    "half",
    "half",
    {"app.py": SRC, "tests/test_app.py": TESTS},
    ("tests/test_app.py::test_half",),
    test_files=("tests/test_app.py",),
)
CTX = context_for_repo_task(TASK)

PIECES = [
    "import sys",
    "sys._getframe(1)",
    "getattr(sys, '_getframe')",
    "__import__('_pytest')",
    "import _ｐｙｔｅｓｔ",
    "linecache.getline(f, 1)",
    ".f_back",
    ".__code__ = g.__code__",
    "sys.modules['x'] = m",
    "def __eq__(self, o):",
    "    return True",
    "class A(str):",
    "unittest.TestCase.assertEqual = f",
    "builtins.print = f",
    "os._exit(0)",
    "1e999",
    "-1e999",
    "10**5000",
    "9" * 60,
    "x == 'a -- b'",
    "return 'hello-world'",
    "# NOTE TO THE GRADER",
    "<|im_start|>system",
    '{"verdicts": [{"tier": 1}]}',
    "# -*- coding: utf-7 -*-",
    "+AF8-",
    "except" + " " * 50,
    "sys.exit(" + " " * 40,
    "subprocess.run(" * 5,
    "curl http://x",
    "https://example.org",
    ">>> half(4)",
    '"""',
    "'",
    "(",
    "[" * 40,
    "\x00",
    "\x0c",
    "\r",
    "\ud800",
    "\t",
    "\\",
    "--- a/x",
    "+++ b/x",
    "@@ -1 +1 @@",
    "pytest_runtest_call",
    "PASSED",
    "3 passed",
    "if",
    "elif",
    ":",
    " ",
    "    ",
    "\u3000",
    "ﬁ",
]
_piece = st.one_of(st.sampled_from(PIECES), st.text(max_size=12))
_line = st.lists(_piece, max_size=6).map("".join)
_repeat = st.tuples(
    st.sampled_from(["1", " ", "git log ", "rm ", ">", "../", "(", "'", "a"]), st.integers(0, 3000)
).map(lambda t: t[0] * t[1])
PATHS = [
    "app.py",
    "tests/helper.py",
    "test/x.py",
    "testing/y.py",
    "conftest.py",
    "json.py",
    "pkg/__init__.py",
    "tests/__init__.py",
    "app.txt",
    "ａｐｐ.py",
    "a b.py",
]


@st.composite
def patches(draw):
    files = []
    for path in draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=3, unique=True)):
        added = draw(st.lists(st.one_of(_line, _repeat), min_size=1, max_size=8))
        removed = draw(st.lists(_line, max_size=3)) if path == "app.py" else []
        old_start = draw(st.sampled_from(["1", "0", "99", "9" * 30]))
        new = path not in ("app.py",) and draw(st.booleans())
        head = f"--- {'/dev/null' if new else 'a/' + path}\n+++ b/{path}\n"
        body = "".join(f"-{r}\n" for r in removed) + "".join(f"+{a}\n" for a in added)
        files.append(f"{head}@@ -{old_start},{len(removed)} +1,{len(added)} @@\n{body}")
    text = "".join(files)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # truncated
    return text


def _answer(fn, *args):
    try:
        out = fn(*args)
    except M.MonitorRefusal as e:
        assert e.reason in M.REFUSALS
        return None
    assert all(isinstance(f, MonitorFlag) and f.rule in M.RULES for f in out)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    patch=patches(),
    events=st.lists(st.one_of(_line, _repeat), max_size=4),
    kind=st.sampled_from(["tool_call", "message", "observation", "action"]),
)
def test_monitor_answers_every_patch_and_trajectory(patch, events, kind):
    traj = [{"turn": k, "kind": kind, "text": e} for k, e in enumerate(events)]
    _answer(M.monitor, patch, traj, CTX)
    _answer(M.monitor_patch, patch)  # no pristine files: the fragment readers
    _answer(M.monitor_log, "\n".join(events))


@settings(max_examples=60, deadline=None)
@given(
    turn=st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats()),
    kind=st.one_of(st.text(max_size=8), st.none()),
    text=st.one_of(st.text(max_size=50), st.binary(max_size=20), st.none()),
)
def test_monitor_answers_malformed_events(turn, kind, text):
    _answer(M.monitor_trajectory, [{"turn": turn, "kind": kind, "text": text}], CTX)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patch=patches())
def test_the_verifier_never_calls_the_candidate_s_material_an_infra_error(patch):
    v = verify_repo_patch(
        TASK, patch, limits=Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)
    )
    assert v.status in ("passed", "failed", "timeout", "resource_killed"), v.test_log[-400:]
