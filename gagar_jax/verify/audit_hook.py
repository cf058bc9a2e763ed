"""The runtime audit of a verification: a PEP 578 audit hook in the sandboxed test process.

The test runner (``outcome_plugin.py``) loads this file by absolute path from its read-only
directory and calls :func:`install` in the test process before pytest or anything of the tree is
imported (it must not import gagar_jax: the sandbox sees only the runner's directory). An audit
hook cannot be removed once added (``sys.addaudithook`` has no inverse), so every event below is
seen for the whole session, whatever the code under test does.

Paths are compared as the file they name: relative to the working directory, with ``/proc``,
``/dev/fd`` and ``//`` links resolved and the tree's aliases (the sandbox's read-only source of
its private copy) mapped back onto the tree. Each event is attributed to the innermost frame that
is not trusted code (the standard library,
the read-only site-packages holding pytest and the task's dependencies, the runner itself,
importlib's frozen modules): a frame of a protected test file (the hidden tests, the task's test
files, everything under the test directories, ``conftest.py``, the canaries) is the tests' own
doing and is ignored; any other frame (the repository's code, code compiled from a string) is
the candidate's, and so is a thread other than the main one with no untrusted frame at all (one
started on a library function: pytest reads the tests in the main thread). Events:

================================  ==========================================  ================
event                             from the candidate's code                   what happens
================================  ==========================================  ================
``open`` of a protected ``.py``   reading the tests' source (expected         refused, confirmed
(directly, ``inspect``,           values, canary outcomes)
``linecache``)
the same, while formatting a      the current line of a test frame (logging   refused, evidence
traceback (``traceback``,         an exception, ``inspect.stack``: the line
``logging``, ``warnings``,        comes back empty, as for a file without
``inspect.stack``)                source)
``open`` of any ``.pyc`` outside  any frame, pytest's and importlib's too:    refused; confirmed
the trusted directories           no bytecode cache of the tree is ever       when the file exists
                                  read (the tree is written without any)
``open`` for writing of a         a bytecode cache, a ``.pth``, a module in   refused, confirmed
``.pyc``/``.pth`` anywhere, or    a test directory or beside a test file
a ``.py``/``.so`` under a test
directory or beside a test file
``open`` for writing of a ``.py`` a module written at run time                evidence
elsewhere
``compile``/``code.__new__``      code posing as trusted code (its frames     confirmed
naming a file of a trusted        would pass for the standard library's)
directory, or a protected file    or as a test file (instrumenting libraries  evidence
                                  recompile test functions too)
``os.symlink``/``os.link`` of a   the tests' source under another name        refused, confirmed
protected file
``os.exec*`` in the test process  the runner replaced (also refused by        confirmed
                                  seccomp, see ``seccomp.exec_notify_filter``)
``object.__setattr__`` on a class patching the test framework (the call made   confirmed
of the installed unittest,        by the candidate's code itself)
pytest or pluggy
``sys.settrace``/``setprofile``,  walking or rewriting the interpreter's      evidence
``gc.get_referrers``/``objects``  state
/``referents``, ``ctypes.dlopen``,
``marshal.loads``, a subprocess
of the interpreter
``sys.pycache_prefix`` changed    bytecode caches moved (checked at each      restored, confirmed
                                  import)
================================  ==========================================  ================

Reports travel out of band, never on stdout: one JSON line per event,
``{"audit": kind, "what": detail, "confirmed": bool}``, written to the test process's outcome
pipe (the supervisor's, see ``outcome_plugin.py``), each distinct event once and at most
``MAX_EVENTS`` in all. The hook holds its own references to the functions it calls (a module
attribute the code replaces later does not silence it) and checks before every write that its
descriptor is still the pipe it was given: a channel closed, or replaced with ``dup2``, makes the
hook kill the process (``SIGKILL``), so a run whose channel was taken away ends without its
end-of-run record and fails. What it cannot see: code that never raises an event (pure Python
computation, ``os.write`` to an inherited descriptor, ``os._exit``), nor lines a test frame left in
``linecache`` (the runner clears that cache before every test).
"""

import json
import os
import signal
import sys

EVENTS = frozenset(
    {
        "open",
        "compile",
        "code.__new__",
        "marshal.loads",
        "ctypes.dlopen",
        "os.exec",
        "os.posix_spawn",
        "subprocess.Popen",
        "sys.settrace",
        "sys.setprofile",
        "gc.get_referrers",
        "gc.get_objects",
        "gc.get_referents",
        "object.__setattr__",
        "import",
        "os.symlink",
        "os.link",
    }
)
MAX_EVENTS = 64
CODE_WRITE_SUFFIXES = (".pyc", ".pth")
TEST_DIR_WRITE_SUFFIXES = (".py", ".pyc", ".pth", ".so")
# Trusted modules on the stack that read source lines of frames as part of formatting a stack
# (an honest library logging an exception shows the test's line): evidence, never confirmed.
FORMATTERS = ("/traceback.py", "/logging/__init__.py", "/warnings.py", "/pdb.py", "/cgitb.py")
INSPECT_FORMATTERS = frozenset(
    {"getframeinfo", "stack", "trace", "getouterframes", "getinnerframes", "_get_code_position"}
)
FRAMEWORK_MODULES = ("unittest", "_pytest", "pytest", "pluggy")
_O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Refused(PermissionError):
    """What the hook raises to refuse an operation (any other fault inside the hook is
    swallowed: a bug of the audit must never break honest code)."""


def install(fd, root, protected, test_dirs, trusted, test_pid=None, aliases=()):
    """Adds the audit hook to this process (see the module docstring).

    Args:
      fd: the descriptor the reports are written to (the outcome pipe).
      root: the tree's absolute directory (the run's working directory).
      protected: tree-relative paths of the protected files (test files, the hidden tests,
        conftest and configuration files, the canaries, everything under the test directories).
      test_dirs: tree-relative test directories.
      trusted: absolute directories of trusted code (the standard library, the read-only
        site-packages, the runner's directory).
      test_pid: the test process (``os.exec*`` there is the runner replaced); default: this one.
      aliases: other absolute directories where the same tree is visible (the sandbox's
        read-only source of the private work tree): a path under one is the tree's.

    Returns:
      (report, was_loaded): ``report(kind, what, confirmed)`` writes one line as the hook does;
      ``was_loaded(path)`` says whether trusted code alone read the tree-relative test file
      ``path`` (a test module pytest collected without reading its file came from elsewhere).
    """
    # Everything the hook calls is bound here: replacing ``os.write`` or ``json.dumps`` later
    # changes nothing it does.
    _write, _fstat, _getpid, _kill, _stat = os.write, os.fstat, os.getpid, os.kill, os.stat
    _getcwd, _join, _normpath, _fspath = os.getcwd, os.path.join, os.path.normpath, os.fspath
    _realpath, _dirname = os.path.realpath, os.path.dirname
    _dumps, _getframe, _sigkill = json.dumps, sys._getframe, signal.SIGKILL
    _sys = sys
    import _thread

    _ident = _thread.get_ident
    main = _ident()  # install runs in the main thread, where pytest runs
    st = _fstat(fd)
    channel = (st.st_dev, st.st_ino)
    root = _normpath(root)
    prefix = root + "/"
    protected_abs = frozenset(_normpath(_join(root, p)) for p in protected)
    sources = frozenset(p for p in protected_abs if p.endswith(".py"))
    source_dirs = tuple({os.path.dirname(p) + "/" for p in sources})
    dirs = tuple(_normpath(_join(root, d)) + "/" for d in test_dirs)
    trusted = tuple(_normpath(t) + "/" for t in trusted if t)
    aliases = tuple(_normpath(a) + "/" for a in aliases if a and _normpath(a) != root)
    pid = test_pid or _getpid()
    pycache_prefix = sys.pycache_prefix
    busy = set()
    sent = {}
    loaded = set()  # test sources read by trusted code alone (pytest, importlib)

    def is_test(path):
        return path in protected_abs or path.startswith(dirs)

    def report(kind, what, confirmed):
        key = (kind, what)
        if key in sent or len(sent) >= MAX_EVENTS:
            return
        sent[key] = confirmed
        line = _dumps({"audit": kind, "what": what[:300], "confirmed": confirmed}) + "\n"
        try:
            s = _fstat(fd)
            if (s.st_dev, s.st_ino) != channel:
                raise OSError("the audit channel was replaced")
            data = line.encode()
            while data:
                data = data[_write(fd, data) :]
        except OSError:
            _kill(_getpid(), _sigkill)  # the channel is gone: the run cannot end as a pass

    def origin():
        """(file:line of the innermost untrusted frame or None, a formatter on the stack)."""
        f = _getframe(1)
        formatting = False
        while f is not None:
            code = f.f_code
            fn = code.co_filename
            if fn.startswith(trusted) or fn.startswith("<frozen "):
                if fn.endswith(FORMATTERS) or (
                    fn.endswith("inspect.py") and code.co_name in INSPECT_FORMATTERS
                ):
                    formatting = True
                f = f.f_back
                continue
            return fn, f.f_lineno, formatting
        return None, 0, formatting

    def candidate():
        """The candidate's frame that caused the event, or None (trusted code, the tests).

        A thread other than the main one whose stack holds no untrusted frame at all (a
        thread started on a library function, ``Thread(target=open, ...)``) is the candidate's:
        pytest reads the tests in the main thread."""
        fn, line, formatting = origin()
        if fn is None:
            return ("a thread of the test process" if _ident() != main else None), formatting
        if is_test(_normpath(fn) if fn.startswith("/") else fn):
            return None, formatting
        return f"{fn[len(prefix) :] if fn.startswith(prefix) else fn}:{line}", formatting

    own = install.__code__.co_filename

    def direct():
        """The candidate's frame when it made the call itself (the first frame outside this
        hook is the candidate's), else None: code that trusted code compiles or classes it sets
        up while the candidate imports it are trusted code's doing."""
        f = _getframe(1)
        while f is not None and f.f_code.co_filename == own:
            f = f.f_back
        if f is None:
            return None
        fn = f.f_code.co_filename
        if fn.startswith(trusted) or fn.startswith("<frozen "):
            return None
        if is_test(_normpath(fn) if fn.startswith("/") else fn):
            return None
        return f"{fn[len(prefix) :] if fn.startswith(prefix) else fn}:{f.f_lineno}"

    def canonical(path, base=None):
        """``path`` as an absolute path of the tree where it names one: relative to ``base``
        (default the working directory), ``/proc`` and ``/dev/fd`` links and ``//`` resolved,
        the tree's aliases mapped back onto it."""
        if not path.startswith("/"):
            path = _join(base or _getcwd(), path)
        if path.startswith(("/proc/", "//", "/dev/fd/", "/dev/stdin")):
            path = _realpath(path)
        path = _normpath(path)
        for a in aliases:
            if path.startswith(a):
                return prefix + path[len(a) :]
        return path

    def rel(path):
        return path[len(prefix) :] if path.startswith(prefix) else path

    def on_open(args):
        path, mode, flags = (tuple(args) + (None, None))[:3]
        if isinstance(path, int):
            return
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        elif not isinstance(path, str):
            try:
                path = _fspath(path)
            except TypeError:
                return
            if isinstance(path, bytes):
                path = path.decode("utf-8", "surrogateescape")
        path = canonical(path)
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _O_WRITE
        )
        if writing:
            bad = path.endswith(CODE_WRITE_SUFFIXES) or (
                (is_test(path) or (path.rpartition("/")[0] + "/") in source_dirs)
                and path.endswith(TEST_DIR_WRITE_SUFFIXES)
            )
            if bad:
                who, _ = candidate()
                if who is not None:
                    report("write_code", f"{who} writes {rel(path)}", True)
                    raise Refused(13, "refused by the verifier", path)
            elif path.endswith((".py", ".so")):
                who, _ = candidate()
                if who is not None:
                    report("write_module", f"{who} writes {rel(path)}", False)
            return
        if path.endswith(".pyc"):
            if path.startswith(trusted):
                return
            try:
                _stat(path)
            except OSError:
                exists = False
            else:
                exists = True
            if exists:
                who, _ = candidate()
                report("read_bytecode", f"{who or 'the import system'} reads {rel(path)}", True)
            raise Refused(13, "bytecode caches of the tree are not read", path)
        if path in sources:
            who, formatting = candidate()
            if who is None:
                loaded.add(path)
                return
            if formatting:
                report("read_test_line", f"{who} formats a stack showing {rel(path)}", False)
            else:
                report("read_test_source", f"{who} reads {rel(path)}", True)
            raise Refused(13, "the tests' source is not readable here", path)

    def code_named(filename):
        if not isinstance(filename, str | bytes):
            return
        if isinstance(filename, bytes):
            filename = filename.decode("utf-8", "surrogateescape")
        path = canonical(filename, root) if filename and filename[0] != "<" else ""
        if path in sources:
            # Evidence only: honest instrumenting libraries recompile a decorated test function
            # under its own file's name. A test module replaced this way is caught anyway: its
            # file is never read by pytest (``was_loaded``).
            who = direct()
            if who is not None:
                report("code_as_test", f"{who} makes code named {rel(path)}", False)
        elif path.startswith(trusted):
            # Code posing as trusted code: its frames would pass for the standard library's.
            who = direct()
            if who is not None:
                report("code_as_trusted", f"{who} makes code named {path}", True)

    def on_link(event, args):
        src, dst = args[0], args[1]
        if isinstance(src, int) or isinstance(dst, int):
            return
        src = src.decode("utf-8", "surrogateescape") if isinstance(src, bytes) else _fspath(src)
        dst = dst.decode("utf-8", "surrogateescape") if isinstance(dst, bytes) else _fspath(dst)
        if event == "os.symlink":  # a relative target is relative to the link's directory
            base = _dirname(canonical(dst))
        else:
            base = None
        path = canonical(src, base)
        if path in sources:
            who, _ = candidate()
            if who is not None:
                report("link_test_source", f"{who} links {rel(path)} to {dst}", True)
                raise Refused(13, "the tests' source is not linked here", path)

    def hook(event, args):
        if event not in EVENTS:
            return
        me = _ident()
        if me in busy:
            return
        busy.add(me)
        try:
            if event == "open":
                on_open(args)
            elif event == "import":
                if _sys.pycache_prefix != pycache_prefix:
                    _sys.pycache_prefix = pycache_prefix
                    report("pycache_prefix", "sys.pycache_prefix changed", True)
            elif event == "compile":
                if len(args) > 1:
                    code_named(args[1])
            elif event == "code.__new__":
                if len(args) > 1:
                    code_named(args[1])
            elif event in ("os.symlink", "os.link"):
                on_link(event, args)
            elif event == "os.exec":
                if _getpid() == pid:
                    who, _ = candidate()
                    report("exec", f"{who or 'the test process'} execs {args[0]!r}", True)
            elif event == "object.__setattr__":
                obj = args[0]
                mod = str(getattr(obj, "__module__", "")) if isinstance(obj, type) else ""
                where = getattr(_sys.modules.get(mod), "__file__", None) or ""
                if mod.startswith(FRAMEWORK_MODULES) and where.startswith(trusted):
                    who = direct()
                    if who is not None:
                        what = f"{who} sets {obj.__module__}.{obj.__qualname__}.{args[1]}"
                        report("patch_framework", what, True)
            else:
                who, _ = candidate()
                if who is None:
                    return
                if event in ("subprocess.Popen", "os.posix_spawn"):
                    exe = args[0]
                    if exe is None and isinstance(args[1], list | tuple) and args[1]:
                        exe = args[1][0]
                    exe = exe.decode("utf-8", "replace") if isinstance(exe, bytes) else str(exe)
                    if "python" not in exe.rsplit("/", 1)[-1]:
                        return
                    what = f"{who} starts the interpreter ({exe})"
                elif event == "ctypes.dlopen":
                    what = f"{who} loads a library with ctypes ({args[0]!r})"
                else:
                    what = f"{who} calls {event}"
                report(event, what, False)
        except Refused:
            raise
        except Exception:  # noqa: BLE001, S110 - see Refused
            pass
        finally:
            busy.discard(me)

    def was_loaded(path):
        """Whether trusted code alone (pytest, importlib) read the test file ``path``."""
        return _normpath(_join(root, path)) in loaded

    sys.addaudithook(hook)
    return report, was_loaded
