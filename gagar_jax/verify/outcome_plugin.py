"""The sandboxed test runner: a supervisor, the pytest process, and the outcome reporter.

The verifier runs this file by absolute path (``python -P /abs/runner.py CTL_FD``) from a
read-only directory; it is never imported by name, so no module of the repository under test can
stand in for it, and it must not import gagar_jax (the sandbox sees only its directory: this file
and ``audit_hook.py``).

Before anything of the tree is importable it reads its control record (the pytest arguments and
the number of the outcome descriptor) from the inherited descriptor ``CTL_FD`` and closes it, marks
itself non-dumpable (``PR_SET_DUMPABLE 0``: its memory and descriptors are then out of reach of
processes of the same uid, through ``/proc/<pid>/mem``, ``/proc/<pid>/fd`` or ``ptrace``), and
forks:

- the **child** closes the outcome descriptor, renames itself (``PR_SET_NAME``) to a per-run name
  the supervisor chose, adds the runtime audit hook (``audit_hook.py``, loaded by absolute path
  from this directory; its reports go to the same pipe) before anything of the tree can be
  imported, imports pytest and runs the session with the reporter registered as a
  plugin *object*. The reporter also checks, after collection, that every collected test module
  came from its file (read by trusted code alone), reports import hooks added during the
  session and modules imported from outside the run's path as evidence, and clears
  ``linecache`` before every test. The reporter streams every outcome as pytest reports it, one
  line per phase, ``{"id": nodeid, "when": "setup"|"call"|"subtest"|"teardown", "outcome":
  ...}``, to a pipe read by the supervisor (what was sent cannot be taken back by changing the
  process's memory later); after ``pytest.main`` returns, the child writes a last line
  ``{"exitstatus": ...}`` and exits with pytest's exit status (its own ``atexit`` handlers and
  those of the code under test still run);
- the **supervisor** (PID 1 of the sandbox's PID namespace under bwrap, which ignores signals from
  inside it) holds the only copy of the outcome descriptor. It collects what arrives on the
  child's pipe until the child has exited, reads the exited child's name before reaping it (an
  ``exec`` of another program renames the process after the program), and writes ONE line to the
  verifier: ``{"report": <the child's bytes>, "exit": <the child's exit status>, "named": <its
  name was still the one given>}``. It exits with the child's exit status.

Before forking, the supervisor also watches the test files with inotify (``watch_files`` and
``watch_dirs`` of the control record: the hidden tests, everything under the test directories,
the canaries, every ``conftest.py`` and configuration file). The child closes the watch
descriptor before anything of the tree is imported, so only the supervisor reads the events: a
watched file modified, deleted, renamed or re-permissioned during the session, or a Python file
(``.py``/``.pyc``/``.pth``/``.so``) created in or moved into or out of a watched directory, is
listed in the record's ``changed`` (what the tests ran was not the pristine tests, even if the
code restored them before exiting). Creating other files or directories there is not watched.

With ``audit`` in the control record, the supervisor also reads the protected test sources
into memory and makes them unreadable to itself and every process it starts (Landlock,
``source_lock.py``; ``source_lock`` of the record says what held, ``detection only`` where the
kernel cannot); the test process's audit hook serves them to trusted readers from memory.

With ``exec_filter`` in the control record, the supervisor first installs that seccomp program
on itself with a listener (``seccomp.exec_notify_filter``: every ``execve``/``execveat`` of the
session is handed to it) and forks: it refuses an exec by the test process (any of its threads)
with ``EPERM`` and lets any other process of the session exec; the refusals are the record's
``exec_refused`` (``exec_control``: whether the kernel accepted the filter).

No secret sits in the pytest process: the record carries nothing the code under test could steal
to forge another one. The verifier trusts the report only as far as it agrees with what the
supervisor saw (the exit status, the process's name at exit) and with the canary tests, hidden
tests of unpredictable names whose outcomes the verifier knows in advance.
"""

import json
import linecache
import os
import secrets
import select
import signal
import struct
import sys

_MAX_REPORT = 16 << 20
PR_SET_NAME = 15
PR_SET_DUMPABLE = 4
# inotify(7)
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_ISDIR = 0x400, 0x800, 0x4000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
FILE_EVENTS = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF
DIR_EVENTS = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
CODE_SUFFIXES = (".py", ".pyc", ".pth", ".so")
MAX_WATCHES = 4096
DEADLINE_EXIT = 124  # the supervisor's exit status after it killed a test past its deadline
AUDIT_MODULE = "_gagar_audit_hook"
ASSERTS_MODULE = "_gagar_pristine_asserts"
LOCK_MODULE = "_gagar_source_lock"
# seccomp(2) user notifications (linux/seccomp.h)
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
NOTIF_SIZE = 80  # struct seccomp_notif: id, pid, flags, struct seccomp_data
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif)
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp)


class Reporter:
    """pytest plugin object: streams every test phase's outcome from pytest's reports.

    The outcome of a test function's call is the runner's own: around ``pytest_runtest_call``
    (a hook wrapper, which runs whatever plugin answers the hooks inside it) the reporter puts
    a wrapper of its own in place of the item's function, which notes that the function
    returned. pytest's report of a call passing counts only when the test function the runner
    wrapped was called and returned: a plugin answering ``pytest_pyfunc_call``, a replaced
    ``runtest``, a report made up by ``pytest_runtest_makereport`` or rewritten before it
    reaches the reporter, all report a pass for a body that never ran (or raised), and the
    reporter sends ``failed`` with a confirmed ``outcome_forged`` line instead."""

    def __init__(
        self,
        fd,
        was_loaded=None,
        roots=(),
        timed=False,
        audit=None,
        function_type=None,
        unittest_obj=True,
    ):
        self._fd = fd
        self._was_loaded = was_loaded
        self._roots = tuple(os.path.join(r, "") for r in roots)
        self._foreign = set()
        self._timed = timed
        self._audit = audit
        self._function_type = function_type
        self._unittest_calls_obj = unittest_obj
        self._functions = set()  # node ids of the collected test functions
        self._returned = {}  # node id -> whether its wrapped function returned (last call)

    def _line(self, kind, what, confirmed):
        line = {"audit": kind, "what": what[:300], "confirmed": confirmed}
        _write_all(self._fd, (json.dumps(line) + "\n").encode())

    def pytest_runtest_call(self, item):
        # Made a hook wrapper in ``_child`` (the runner imports pytest only there).
        done = []
        restore = None
        if self._function_type is not None and isinstance(item, self._function_type):
            try:
                orig = item.obj
                item.obj = _note_return(orig, done)
                restore = orig
            except Exception:  # noqa: BLE001 - an item whose function cannot be wrapped
                restore = None
                self._functions.discard(item.nodeid)
        try:
            yield
        finally:
            if restore is not None:
                item.obj = restore
                self._returned[item.nodeid] = bool(done)

    def _timing(self, key, nodeid):
        # Read by the supervisor, which keeps the per-test deadline (``_Deadlines``).
        if self._timed:
            _write_all(self._fd, (json.dumps({key: nodeid}) + "\n").encode())

    def pytest_runtest_logstart(self, nodeid, location):
        self._timing("start", nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        self._timing("finish", nodeid)
        # After the test's teardown (a ``monkeypatch`` of the tests' own modules is undone).
        if self._audit is not None:
            self._audit.check_modules()

    def _foreign_modules(self):
        """Evidence of modules imported from outside the run's path (the tree and the trusted
        directories): code written elsewhere at run time and imported."""
        if not self._roots:
            return
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None)
            if not isinstance(f, str) or name in self._foreign or f.startswith(self._roots):
                continue
            self._foreign.add(name)
            if len(self._foreign) > 8:
                return
            line = {
                "audit": "foreign_module",
                "what": f"module {name} imported from {f} (outside the run's path)",
                "confirmed": False,
            }
            _write_all(self._fd, (json.dumps(line) + "\n").encode())

    def pytest_sessionstart(self, session):
        self._finders = (list(sys.meta_path), list(sys.path_hooks))

    def _import_hooks_changed(self):
        """Evidence (never confirmed: a pristine conftest may add one) of import hooks added or
        removed since the session started, with the module each new one comes from."""
        before = getattr(self, "_finders", None)
        if before is None:
            return
        for now, was, what in ((sys.meta_path, before[0], "meta_path"),
                               (sys.path_hooks, before[1], "path_hooks")):  # fmt: skip
            added = [f for f in now if not any(f is g for g in was)]
            if added or len(now) != len(was):
                where = ", ".join(f"{type(f).__module__}.{type(f).__qualname__}" for f in added[:3])
                line = {
                    "audit": "import_hooks",
                    "what": f"sys.{what} changed during the session ({where or 'entries removed'})",
                    "confirmed": False,
                }
                _write_all(self._fd, (json.dumps(line) + "\n").encode())
        self._finders = (list(sys.meta_path), list(sys.path_hooks))

    def pytest_sessionfinish(self, session):
        self._import_hooks_changed()
        self._foreign_modules()
        if self._audit is not None:
            self._audit.check_modules()

    def pytest_collection_finish(self, session):
        self._import_hooks_changed()
        self._foreign_modules()
        codes = []
        for item in session.items:
            if self._function_type is None or not isinstance(item, self._function_type):
                continue
            unittest_item = any(k.__name__ == "TestCaseFunction" for k in type(item).__mro__)
            if unittest_item and not self._unittest_calls_obj:
                continue  # pytest < 5.4 calls a unittest method without ``item.obj``
            self._functions.add(item.nodeid)
            f = getattr(item, "obj", None)
            f = getattr(f, "__func__", f)
            for _ in range(8):  # the test function under its decorators
                code = getattr(f, "__code__", None)
                if code is not None:
                    codes.append(code)
                f = getattr(f, "__wrapped__", None)
                if f is None:
                    break
        if self._audit is not None:
            self._audit.protect_code(codes)
            self._audit.check_modules()
        # Each collected test module must be the file pytest was asked to collect: a module of
        # the same name imported beforehand from elsewhere (a directory the code put first on
        # ``sys.path``, with ``PY_IGNORE_IMPORTMISMATCH`` set) is not the pristine test.
        seen = set()
        for item in session.items:
            mod = getattr(item, "module", None)
            if mod is None or id(mod) in seen:
                continue
            seen.add(id(mod))
            spec = getattr(mod, "__spec__", None)
            where = getattr(spec, "origin", None) or getattr(mod, "__file__", None) or "?"
            path = item.nodeid.split("::")[0]
            what = None
            if os.path.realpath(str(where)) != os.path.realpath(str(item.path)):
                what = f"{path} was loaded from {where}"
            elif self._was_loaded is not None and not self._was_loaded(path):
                what = f"{path} was collected without its file being read"
            if what:
                line = {"audit": "test_module_replaced", "what": what, "confirmed": True}
                _write_all(self._fd, (json.dumps(line) + "\n").encode())

    def pytest_runtest_setup(self, item):
        # Source lines a failing test left in linecache would be readable without an ``open``.
        linecache.clearcache()

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            if hasattr(report, "wasxfail"):  # xfail counts as skipped, a strict xpass failed
                outcome = "skipped" if report.skipped else "failed"
            else:
                outcome = report.outcome
        elif report.failed:
            outcome = "error"  # setup or teardown failed
        elif report.skipped:
            outcome = "skipped"
        else:
            return
        when = report.when
        if (
            when == "call"
            and outcome == "passed"
            and not hasattr(report, "context")  # a subtest, reported while the call runs
            and report.nodeid in self._functions
            and not self._returned.get(report.nodeid, False)
        ):
            # pytest says it passed; the function the runner wrapped never returned.
            what = f"{report.nodeid} reported passed, but its test function did not return"
            self._line("outcome_forged", what, True)
            outcome = "failed"
        if when == "call" and hasattr(report, "context"):
            # A subtest (pytest's ``subtests`` fixture, unittest's ``subTest``): one test may
            # report many, so they travel as their own phase; the worst outcome still counts.
            when = "subtest"
        line = {"id": report.nodeid, "when": when, "outcome": outcome}
        _write_all(self._fd, (json.dumps(line) + "\n").encode())


def _note_return(orig, done):
    """``orig`` wrapped so that ``done`` gets an entry when it returns (an ``async`` function
    when it completes); its attributes (marks, ``__wrapped__``) are the original's."""
    import functools
    import inspect

    if inspect.iscoroutinefunction(orig):

        async def body(*args, **kwargs):
            result = await orig(*args, **kwargs)
            done.append(True)
            return result

    else:

        def body(*args, **kwargs):
            result = orig(*args, **kwargs)
            done.append(True)
            return result

    return functools.update_wrapper(body, orig)


class _Deadlines:
    """The per-test timeout, kept by the supervisor on its own clock (``test_timeout_s`` of the
    control record): the code under test shares a process with pytest-timeout's alarm and can
    disarm it, but not this.

    The reporter sends ``{"start": id}`` and ``{"finish": id}`` around each test (setup, call
    and teardown); the supervisor takes them out of the report and times each test from the
    first line that started it to the last line about it that arrives (its outcomes, its
    finish: a finish forged early is overtaken by the real lines that follow). A test that took
    longer than the timeout plus ``slack`` (scheduling jitter of the two processes) is
    ``overran``; a test still running ``grace`` seconds past the timeout (pytest-timeout had
    its chance to fail it) gets the test process killed (``killed``). An outcome line of a test
    that was never started is ``unstarted`` (the timing lines were suppressed)."""

    def __init__(self, limit_s):
        self.limit = float(limit_s)
        self.slack = max(0.25, 0.25 * self.limit)
        self.grace = max(5.0, self.limit)
        self.first = {}  # id -> when its first start line arrived
        self.current = None  # (id, when it started): the test running now
        self.overran = {}  # id -> seconds
        self.unstarted = []
        self.killed = None
        self._buf = b""

    def feed(self, data, now):
        """The report's bytes in ``data`` with the timing lines taken out (a partial last line
        is kept back until its end arrives)."""
        lines = (self._buf + data).split(b"\n")
        self._buf = lines.pop()
        keep = []
        for line in lines:
            if line.startswith((b'{"start": ', b'{"finish": ', b'{"id": ')):
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if isinstance(rec, dict) and len(rec) == 1:
                    ((key, nodeid),) = rec.items()
                    if key in ("start", "finish") and isinstance(nodeid, str):
                        self._timing(key, nodeid, now)
                        continue
                elif isinstance(rec, dict) and isinstance(rec.get("id"), str):
                    self._seen(rec["id"], now)
            keep.append(line + b"\n")
        return b"".join(keep)

    def rest(self):
        """What is left of the report: a last line without its end."""
        rest, self._buf = self._buf, b""
        return rest

    def _timing(self, key, nodeid, now):
        if key == "start":
            self.first.setdefault(nodeid, now)
            self.current = (nodeid, now)
            return
        self._seen(nodeid, now)
        if self.current is not None and self.current[0] == nodeid:
            self.current = None

    def _seen(self, nodeid, now):
        t0 = self.first.get(nodeid)
        if t0 is None:
            if len(self.unstarted) < 8:
                self.unstarted.append(nodeid)
            return
        took = now - t0
        if took > self.limit + self.slack and len(self.overran) < 64:
            self.overran[nodeid] = round(max(took, self.overran.get(nodeid, 0.0)), 3)

    def wait(self, now):
        """Seconds until the running test's kill deadline (None: no test is running)."""
        if self.current is None:
            return None
        return max(0.0, self.current[1] + self.limit + self.grace - now)

    def expired(self, now):
        """The running test's id once it is past its kill deadline, else None."""
        if self.current is None or now < self.current[1] + self.limit + self.grace:
            return None
        nodeid = self.current[0]
        self._seen(nodeid, now)
        self.killed = nodeid
        self.current = None
        return nodeid

    def record(self):
        return {
            "test_timeout_s": self.limit,
            "overran": [{"id": k, "s": v} for k, v in self.overran.items()],
            "unstarted": self.unstarted,
            "killed": self.killed,
        }


def _read_all(fd, cap=_MAX_REPORT):
    chunks, total = [], 0
    while total <= cap:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
        total += len(b)
    return b"".join(chunks)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def _prctl(option, arg):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


class _Watch:
    """inotify watches on the test files (see the module docstring); read by the supervisor."""

    def __init__(self, files, dirs):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        self.paths = {}  # wd -> (path, is_dir)
        self.names = {}  # directory -> names of watched files in it
        self.unwatched = 0
        if self.fd < 0:
            self.unwatched = len(files) + len(dirs)
            return
        for path in list(files)[:MAX_WATCHES]:
            self._add(path, FILE_EVENTS, False)
            d, _, base = path.rpartition("/")
            self.names.setdefault(d, set()).add(base)
        for path in list(dirs)[: max(0, MAX_WATCHES - len(self.paths))]:
            self._add(path, DIR_EVENTS, True)
        self.unwatched += max(0, len(files) + len(dirs) - MAX_WATCHES)

    def _add(self, path, mask, is_dir):
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path or "."), mask)
        if wd < 0:
            self.unwatched += 1  # gone already (a hidden path the run deletes) or no room
        else:
            self.paths[wd] = (path, is_dir)

    def changes(self, cap=8):
        """What changed, as short descriptions (at most ``cap``)."""
        out = []
        if self.fd < 0:
            return out
        data = b""
        while True:
            try:
                b = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not b:
                break
            data += b
            if len(data) > _MAX_REPORT:
                out.append("more changes than could be read")
                break
        k = 0
        while k + 16 <= len(data) and len(out) < cap:
            wd, mask, _, n = struct.unpack_from("iIII", data, k)
            name = data[k + 16 : k + 16 + n].split(b"\0", 1)[0].decode("utf-8", "replace")
            k += 16 + n
            if mask & IN_Q_OVERFLOW:
                out.append("more changes than inotify could queue")
                continue
            path, is_dir = self.paths.get(wd, ("?", False))
            if not is_dir:
                if mask & FILE_EVENTS:
                    out.append(f"{path} {_what(mask)}")
                continue
            if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                out.append(f"{path or '.'}/ {_what(mask)}")
                continue
            watched = name in self.names.get(path, ())
            # A new ``__pycache__`` is where forged bytecode caches would go; other new
            # directories are the tests' own (honest tests write data there).
            code = name == "__pycache__" if mask & IN_ISDIR else name.endswith(CODE_SUFFIXES)
            if watched or code:
                out.append(f"{path + '/' if path else ''}{name} {_what(mask)}")
        return out

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _what(mask):
    for bit, word in (
        (IN_DELETE_SELF, "deleted"),
        (IN_MOVE_SELF, "moved"),
        (IN_MODIFY, "modified"),
        (IN_CLOSE_WRITE, "written"),
        (IN_ATTRIB, "metadata changed"),
        (IN_CREATE, "created"),
        (IN_DELETE, "deleted"),
        (IN_MOVED_TO, "moved in"),
        (IN_MOVED_FROM, "moved out"),
    ):
        if mask & bit:
            return word
    return f"changed ({mask:#x})"


def _load_runner_module(name):
    """A module of the runner (``audit_hook.py``, ``pristine_asserts.py``) beside this file,
    loaded by absolute path."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trusted_dirs(root):
    """Directories of trusted code: the interpreter's path at start (``-P``: none of the tree)
    and this file's directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = [here]
    for p in sys.path:
        p = os.path.abspath(p) if p else ""
        if p and p != root and not p.startswith(root + "/"):
            out.append(p)
    return out


def _protected_sources(audit, root):
    """The absolute paths of the protected ``.py`` files (the audit hook's sources) and of the
    same files under the tree's aliases."""
    rels = sorted({os.path.normpath(p) for p in audit.get("protected", ()) if p.endswith(".py")})
    own = [os.path.join(root, p) for p in rels]
    other = [
        os.path.join(a, p)
        for a in audit.get("aliases", ())
        if a and os.path.normpath(a) != root
        for p in rels
    ]
    return own, other


def _lock_sources(audit, lock):
    """Reads the protected sources, then makes them unreadable to this process and every
    process it starts (``source_lock.py``). Returns ({path: bytes}, what held)."""
    root = os.getcwd()
    own, other = _protected_sources(audit, root)
    lockmod = _load_runner_module(LOCK_MODULE)
    pristine = lockmod.read_sources(own)
    if lock is not True:
        return pristine, f"detection only: {lock or 'the source lock is off'}"
    try:
        return pristine, lockmod.lock(own + other)
    except OSError as e:
        return pristine, f"detection only: {e.strerror or e}"


def _child(args, report_fd, name, audit=None, timed=False, sources=None):
    _prctl(PR_SET_NAME, name.encode())
    was_loaded, roots, hook = None, (), None
    if audit is not None:
        root = os.getcwd()
        trusted = _trusted_dirs(root)
        pristine = sources.pop() if sources else None
        audit_mod = _load_runner_module(AUDIT_MODULE)
        hook = audit_mod.install(
            report_fd,
            root,
            audit["protected"],
            audit["test_dirs"],
            trusted,
            aliases=audit.get("aliases", ()),
            paths=audit.get("paths", (".",)),
            changed=audit.get("changed", ()),
            pristine=pristine,
        )
        del pristine  # held by the hook alone from here
        # Trusted readers get the pristine sources from the hook (the files may be unreadable).
        _load_runner_module(LOCK_MODULE).serve_reads(audit_mod.Served)
        was_loaded = hook.was_loaded
        roots = (root, *trusted)
    import pytest
    from _pytest.python import Function

    Reporter.pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(Reporter.pytest_runtest_call)
    version = tuple(int(x) for x in pytest.__version__.split(".")[:2] if x.isdigit())
    plugins = [Reporter(report_fd, was_loaded, roots, timed, hook, Function, version >= (5, 4))]
    if audit is not None:
        asserts = _load_runner_module(ASSERTS_MODULE)
        plugins.append(
            asserts.install(
                hook.report, root, audit["protected"], hook.helper_names, audit_mod.Served
            )
        )
    ret = int(pytest.main(list(args), plugins=plugins))
    line = json.dumps({"exitstatus": ret}) + "\n"
    try:
        _write_all(report_fd, line.encode())
        os.close(report_fd)
    except OSError:
        pass
    return ret


def _exec_listener(prog_hex, nr):
    """Installs the exec filter (``seccomp.exec_notify_filter``) on this process with a
    listener; returns the listener's descriptor, or -1 where the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    prog = bytes.fromhex(prog_hex)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class _FProg(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _FProg(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return -1
    fd = libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_long(SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(SECCOMP_FILTER_FLAG_NEW_LISTENER),
        ctypes.byref(fprog),
    )
    return fd if fd >= 0 else -1


def _tgid(tid):
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _answer_exec(listener, pid, refused):
    """Answers one exec notification: refused for the test process, continued for others."""
    import fcntl

    buf = bytearray(NOTIF_SIZE)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
    except OSError:
        return  # the caller died meanwhile
    nid, tid = struct.unpack_from("=QI", buf, 0)
    tgid = _tgid(tid)
    if tgid == pid or tid == pid:
        resp = struct.pack("=QqiI", nid, 0, -1, 0)  # error: -EPERM
        if len(refused) < 8:
            refused.append(f"the test process (thread {tid}) tried to exec")
    else:
        resp = struct.pack("=QqiI", nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, resp)
    except OSError:
        pass


def _supervise(
    pid, report_r, out_fd, name, watch=None, listener=-1, deadlines=None, source_lock=""
):
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pidfd = os.pidfd_open(pid)
    chunks, total = [], 0
    refused = []
    fds = [report_r, pidfd] + ([listener] if listener >= 0 else [])

    def take(b):
        nonlocal total
        if deadlines is not None:
            b = deadlines.feed(b, time.monotonic())
        if b and total <= _MAX_REPORT:
            chunks.append(b)
            total += len(b)

    while True:
        wait = None if deadlines is None else deadlines.wait(time.monotonic())
        ready, _, _ = select.select(fds, [], [], wait)
        if not ready:
            if deadlines.expired(time.monotonic()) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)  # past its per-test deadline
                except ProcessLookupError:
                    pass
            continue
        if listener in ready:
            _answer_exec(listener, pid, refused)
            if len(ready) == 1:
                continue
        if report_r in ready:
            b = os.read(report_r, 1 << 16)
            if b:
                take(b)
            else:
                ready = [pidfd]  # every writer closed: the child has exited or is about to
        if pidfd in ready:
            break
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    os.set_blocking(report_r, False)
    try:
        while total <= _MAX_REPORT:  # what the child wrote before it exited
            b = os.read(report_r, 1 << 16)
            if not b:
                break
            take(b)
    except BlockingIOError:
        pass
    if deadlines is not None:
        chunks.append(deadlines.rest())
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            seen = f.read().strip().decode("ascii", "replace")
    except OSError:
        seen = ""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    record = {
        "report": b"".join(chunks).decode("utf-8", "replace"),
        "exit": code,
        "named": seen == name,
        "name": seen,
        "exec_control": listener >= 0,
        "exec_refused": refused,
        "source_lock": source_lock,
    }
    if watch is not None:
        record["changed"] = watch.changes()
        record["unwatched"] = watch.unwatched
    if deadlines is not None:
        record["deadlines"] = deadlines.record()
    _write_all(out_fd, (json.dumps(record) + "\n").encode())
    os.close(out_fd)
    if deadlines is not None and deadlines.killed is not None:
        # Killed by this process, not by a limit of the sandbox: an ordinary failing exit.
        os._exit(DEADLINE_EXIT)
    os._exit(code if code >= 0 else 128 - code)


def main(argv):
    if argv[1:] == ["--check"]:  # preflight: everything the run needs is importable
        import ctypes  # noqa: F401

        import pytest  # noqa: F401

        return 0
    ctl_fd = int(argv[1])
    ctl = json.loads(_read_all(ctl_fd))
    os.close(ctl_fd)
    out_fd = int(ctl["out_fd"])
    _prctl(PR_SET_DUMPABLE, 0)  # inherited by the child: neither is reachable through /proc
    name = "t" + secrets.token_hex(7)
    listener = -1
    if ctl.get("exec_filter"):
        listener = _exec_listener(ctl["exec_filter"], int(ctl["seccomp_nr"]))
    watch = None
    if "watch_files" in ctl or "watch_dirs" in ctl:
        watch = _Watch(ctl.get("watch_files", ()), ctl.get("watch_dirs", ()))
    sources, source_lock = [], ""
    if ctl.get("audit") is not None:
        # Before the fork, so that the test process and everything it starts inherit the lock.
        pristine, source_lock = _lock_sources(ctl["audit"], ctl.get("source_lock", True))
        sources.append(pristine)
        del pristine
    limit = float(ctl.get("test_timeout_s") or 0)
    deadlines = _Deadlines(limit) if limit > 0 else None
    report_r, report_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if watch is not None:
            watch.close()  # only the supervisor reads the events
        if listener >= 0:
            os.close(listener)  # only the supervisor answers
        os.close(report_r)
        os.close(out_fd)
        del ctl["out_fd"]
        timed = deadlines is not None
        sys.exit(_child(ctl["args"], report_w, name, ctl.get("audit"), timed, sources))
    sources.clear()
    os.close(report_w)
    _supervise(pid, report_r, out_fd, name, watch, listener, deadlines, source_lock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
