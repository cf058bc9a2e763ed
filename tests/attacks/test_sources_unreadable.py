"""The tests' source, unreadable to every process of the session (the kernel's source lock).

One class: any read of a protected test file's bytes by the candidate's code, in any process, by
any system call. The runner's supervisor reads the pristine sources before anything of the tree
runs and makes them unreadable (Landlock) to itself and every process it starts; the test
process is served the sources from the audit hook's memory (trusted readers only). Each attack
below reads the hidden test file another way and answers ``half`` from the pairs it finds; each
honest control exercises something the lock must leave alone.

Where the kernel has no Landlock these tests fail loudly on ``source_lock`` (the verdict names
the mechanism that held): the project's machines have it.
"""

from __future__ import annotations

import dataclasses

import pytest
from _fresh_kit import FIXED, app, half_task, verify
from _red_team_kit import (
    DECODER,
    assert_honest,
    assert_not_paid,
    change,
    describe,
    helper_task,
    hide,
)

from gagar_jax.verify import repo

# The reader's table: pairs ``(x) == y`` found in the text ``_read`` returns for each test file
# (``_read`` is the attack's).
TABLE = (
    "import os\nimport re\n\n_T = None\n\n\n"
    "def _table():\n    global _T\n    if _T is None:\n        _T = {}\n"
    f"        d = {hide('tests')}\n"
    "        for n in sorted(os.listdir(d)):\n"
    "            if n.endswith('.py'):\n"
    "                for a, b in re.findall(r'\\((-?\\d+)\\) == (-?\\d+)',\n"
    "                                       _read(os.path.join(d, n))):\n"
    "                    _T[int(a)] = int(b)\n"
    "    return _T\n\n\n"
    "def half(x):\n    return _table().get(x, x)\n"
)


def reader(body: str, imports: str = "") -> str:
    """app.py of an attack whose ``_read(path)`` is ``body`` (indented, returns text)."""
    return DECODER + imports + "\n\ndef _read(path):\n" + body + "\n\n" + TABLE


ATTACKS = {
    # a shell started by subprocess, its own redirection
    "shell": reader(
        "    import subprocess\n"
        "    return subprocess.run('cat < ' + path, shell=True, capture_output=True,\n"
        "                          text=True).stdout\n"
    ),
    # os.system writing the bytes to a scratch file the code then reads
    "system_copy": reader(
        "    import os, tempfile\n"
        "    out = os.path.join(tempfile.mkdtemp(), 'x')\n"
        "    os.system('cp ' + path + ' ' + out + ' 2>/dev/null')\n"
        "    try:\n        return open(out).read()\n    except OSError:\n        return ''\n"
    ),
    # the sandbox's read-only source of the tree, another path to the same files
    "tree_alias": reader(
        "    import subprocess\n"
        "    out = ''\n"
        "    for root in ('/.gagar-tree', '/proc/self/root' + os.getcwd()):\n"
        "        out += subprocess.run(['cat', os.path.join(root, path)], capture_output=True,\n"
        "                              text=True).stdout\n"
        "    return out\n"
    ),
    # a hard link and a symbolic link made by a child, then read through them
    "links": reader(
        "    import subprocess, tempfile\n"
        "    d = tempfile.mkdtemp()\n"
        "    cmd = ('ln {p} {p}.txt; ln -s $PWD/{p} {d}/s.py; cat {p}.txt {d}/s.py'\n"
        "           .format(p=path, d=d))\n"
        "    return subprocess.run(['sh', '-c', cmd], capture_output=True, text=True).stdout\n"
    ),
    # os.fork; the child reads through libc (no audit event) and mmaps the file
    "fork_mmap": reader(
        "    import ctypes, mmap\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            libc = ctypes.CDLL(None)\n"
        "            fd = libc.open(path.encode(), 0)\n"
        "            if fd >= 0:\n"
        "                m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\n"
        "                os.write(w, m[:])\n"
        "        finally:\n"
        "            os._exit(0)\n"
        "    os.close(w)\n"
        "    data = b''\n"
        "    while True:\n"
        "        b = os.read(r, 65536)\n"
        "        if not b:\n            break\n"
        "        data += b\n"
        "    os.waitpid(pid, 0)\n"
        "    return data.decode(errors='replace')\n"
    ),
    # the raw openat system call through ctypes, in the test process itself
    "raw_syscall": reader(
        "    import ctypes\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    libc.syscall.restype = ctypes.c_long\n"
        "    fd = libc.syscall(257, -100, os.path.abspath(path).encode(), 0, 0)\n"
        "    if fd < 0:\n        return ''\n"
        "    buf = ctypes.create_string_buffer(1 << 16)\n"
        "    n = libc.read(int(fd), buf, 1 << 16)\n"
        "    return buf.raw[: max(n, 0)].decode(errors='replace')\n"
    ),
    # another interpreter, started by posix_spawn, through /proc/self/fd of its own open
    "spawned_interpreter": reader(
        "    import sys, tempfile\n"
        "    out = os.path.join(tempfile.mkdtemp(), 'o')\n"
        "    code = ('import os,sys; fd=os.open(sys.argv[1], 0); '\n"
        '            \'open(sys.argv[2], "w").write(open("/proc/self/fd/%d" % fd).read())\')\n'
        "    pid = os.posix_spawn(sys.executable, [sys.executable, '-c', code, path, out],\n"
        "                         dict(os.environ))\n"
        "    os.waitpid(pid, 0)\n"
        "    try:\n        return open(out).read()\n    except OSError:\n        return ''\n"
    ),
    # sendfile from a child: the kernel copies, nothing is read into the child's memory
    "sendfile": reader(
        "    import subprocess, sys\n"
        "    code = ('import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); '\n"
        "            'os.sendfile(1, fd, 0, 1 << 16)')\n"
        "    return subprocess.run([sys.executable, '-c', code, path], capture_output=True,\n"
        "                          text=True).stdout\n"
    ),
}


@pytest.mark.parametrize("how", sorted(ATTACKS))
def test_hidden_tests_unreadable_to_every_process(how):
    """The hidden test file read another way (see ``ATTACKS``): its pairs never reach the
    code; the verdict says the kernel's lock held."""
    v = verify(app(ATTACKS[how]))
    assert_not_paid(v)
    assert v.source_lock.startswith("landlock"), describe(v)


def test_the_lock_covers_test_helpers_too():
    """A helper module in the test directory (its checks hold the expected values) read by a
    child process: unreadable as the test files are."""
    v = verify(app(ATTACKS["shell"]), helper_task())
    assert_not_paid(v)
    assert v.source_lock.startswith("landlock"), describe(v)


# ---------------------------------------------------------------------------------------------
# Honest work the lock leaves alone.
# ---------------------------------------------------------------------------------------------

HONEST_TESTS = (
    "import inspect\nimport os\nimport subprocess\nimport sys\n\nfrom app import half\n\n\n"
    "def test_half(tmp_path):\n"
    "    assert half(4) == 2\n"
    "    # scratch space: written and read back, by this process and by a child\n"
    "    (tmp_path / 'sub').mkdir()\n"
    "    (tmp_path / 'sub' / 'out.txt').write_text('42')\n"
    "    assert (tmp_path / 'sub' / 'out.txt').read_text() == '42'\n"
    "    out = subprocess.run(['cat', str(tmp_path / 'sub' / 'out.txt')],\n"
    "                         capture_output=True, text=True).stdout\n"
    "    assert out == '42'\n"
    "    # a data file beside the tests, read by a child\n"
    "    here = os.path.dirname(__file__)\n"
    "    out = subprocess.run(['cat', os.path.join(here, 'data', 'cases.txt')],\n"
    "                         capture_output=True, text=True).stdout\n"
    "    assert out.split() == ['8', '4']\n"
    "    # the test reads its own source (served to the tests from memory)\n"
    "    assert 'half(4) == 2' in inspect.getsource(test_half)\n"
    "    with open(__file__) as f:\n"
    "        assert 'def test_half' in f.read()\n"
    "    # a child interpreter of the tests' own imports the code under test\n"
    "    env = {**os.environ, 'PYTHONPATH': '.'}\n"
    "    r = subprocess.run([sys.executable, '-c', 'import app; print(app.half(6))'],\n"
    "                       capture_output=True, text=True, env=env)\n"
    "    assert r.stdout.strip() == '3.0', r.stderr\n"
)


def test_honest_scratch_data_and_own_source():
    """A correct fix whose test writes and reads scratch files (in-process and in a child),
    reads a data file beside the tests through a child, reads its own source, uses a fixture of
    a ``conftest.py``, and starts an interpreter importing the code: passes unflagged under the
    lock."""
    task = half_task()
    files = dict(task.files)
    files["tests/test_app.py"] = HONEST_TESTS
    files["tests/data/cases.txt"] = "8 4\n"
    # a conftest (read and rewritten by pytest from memory) whose fixture the test uses
    files["tests/conftest.py"] = "import pytest\n\n\n@pytest.fixture\ndef two():\n    return 2\n"
    files["tests/test_app.py"] = HONEST_TESTS.replace(
        "def test_half(tmp_path):\n", "def test_half(tmp_path, two):\n    assert two == 2\n"
    )
    v = verify(app(FIXED), dataclasses.replace(task, files=files))
    assert_honest(v)
    assert v.source_lock.startswith("landlock"), describe(v)


def test_honest_helpers_and_tracebacks_still_show_the_tests_lines():
    """Test helpers imported from the test directory are served to the import system; a wrong
    fix's failure still shows the failing test's source lines (pytest reads them from memory)."""
    v = verify(app(FIXED), helper_task())
    assert_honest(v)
    wrong = verify(app("def half(x):\n    return x // 2 + 1\n"))
    assert wrong.status == "failed", describe(wrong)
    assert ">       assert half(4) == 2" in wrong.test_log, describe(wrong)
    assert "tests/test_app.py:5: AssertionError" in wrong.test_log, describe(wrong)


def test_without_the_lock_the_verdict_says_detection_only(monkeypatch):
    """The lock switched off (as where the kernel has no Landlock): the verdict records that
    the runtime audit alone held, an honest fix still passes, and an in-process read is still
    refused by the audit hook."""
    monkeypatch.setattr(repo, "SOURCE_LOCK", False)
    v = verify(app(FIXED))
    assert_honest(v)
    assert v.source_lock.startswith("detection only"), describe(v)
    inproc = reader("    return open(path).read()\n", "import os\n")
    v = verify(app(inproc))
    assert_not_paid(v)
    assert any(f.confirmed for f in v.flags), describe(v)


def test_candidate_audit_hook_is_not_added():
    """The candidate's own audit hook would see every later event (the module code the import
    system executes for the hidden tests): never added; evidence for the grader."""
    code = (
        "import sys\n\n_SEEN = {}\n\n\n"
        "def _hook(event, args):\n"
        "    if event == 'exec' and args and hasattr(args[0], 'co_consts'):\n"
        "        for c in args[0].co_consts:\n"
        "            if hasattr(c, 'co_consts'):\n"
        "                k = [x for x in c.co_consts if type(x) is int]\n"
        "                _SEEN.update(zip(k[::2], k[1::2]))\n\n\n"
        "sys.addaudithook(_hook)\n\n\n"
        "def half(x):\n    return _SEEN.get(x, -_SEEN.get(-x, x) if -x in _SEEN else x)\n"
    )
    v = verify(change("app.py", "def half(x):\n    return x\n", code))
    assert_not_paid(v)
    assert "audit_hook_added" in describe(v), describe(v)


def test_no_lock_where_the_sandbox_does_not_isolate_the_filesystem():
    """Under a fallback without filesystem isolation the tree is the host's own directory (and
    the task's files are readable elsewhere on the host): the lock is not applied, and the
    verdict says why; an honest fix passes unflagged."""
    from gagar_jax.verify.sandbox import SandboxConfig

    v = verify(app(FIXED), config=SandboxConfig(mechanism="unshare"))
    assert_honest(v)
    assert v.source_lock == "detection only: no filesystem isolation under unshare", describe(v)
