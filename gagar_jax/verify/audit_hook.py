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
traceback (``traceback``,         an exception, ``inspect.stack``, a
``logging``, ``warnings``,        library's own formatter calling
``inspect.stack``, a call of      ``linecache.getline``: the line comes back
``linecache.getline``)            empty, as for a file without source)
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
``compile`` under a protected     a loader or importer serving other text     refused, confirmed
file's name of text that is not   for a test module or helper (any frame,
the file's (nor a contiguous run  the import system's too)
of its lines)
``object.__getattr__``:           the expected values (its constants)         refused, confirmed
``__code__`` of a collected test
function, ``f_code`` of its
frame (directly, through ``dis``
or ``inspect.getmembers``)
``object.__setattr__``:           a helper or test neutered in place (a copy  refused, confirmed
``__code__``/``__defaults__``/    of a test function given its original's
``__kwdefaults__`` of a function  keyword defaults is no change: allowed)
of the tests
``object.__setattr__``:           the module's lookup taken over (no-ops for  refused, confirmed
``__class__`` of a module of the  its checks, its test functions)
tests
``sys.addaudithook``              a hook that would see every later event     not added, evidence
``SERVE_EVENT`` (a protected      the pristine bytes (the files themselves    answered to
source asked for by the runner's  are unreadable, ``source_lock.py``)         trusted code only
``open``)
``LITERAL_EVENT`` (a literal of   the expected values                         answered to the
the tests' assertions,                                                        tests' frames;
``pristine_asserts.py``)                                                      else confirmed
================================  ==========================================  ================

The ``exec`` event records the module code that trusted code (importlib, pytest's rewriting
importer) executes from each protected file; :func:`install`'s ``check_modules`` (called by the
runner after collection, after each test's teardown and at the session's end) compares
``sys.modules`` with it: every name a protected file can be imported under (from the run's
path entries and pytest's prepend rule) must hold a module of that file, read and executed by
trusted code, whose functions are still the file's (``test_module_replaced``,
``test_function_replaced``, confirmed).

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

import gc
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
        "exec",
        "object.__getattr__",
        "sys.addaudithook",
        "gagar.pristine_source",
        "gagar.test_literals",
        "gagar.test_literal",
    }
)
LITERALS_EVENT = "gagar.test_literals"  # pristine_asserts: a test module's assertion literals
LITERAL_EVENT = "gagar.test_literal"  # pristine_asserts: one of them asked for
SERVE_EVENT = "gagar.pristine_source"  # source_lock.SERVE_EVENT: a trusted read of a test source
# Trusted readers that hand a code object to their caller (``dis.get_instructions(f)``,
# ``inspect.getmembers(f)``): a test function's code read through them is read by the caller.
READERS = ("/dis.py",)
INSPECT_READERS = frozenset({"getmembers", "getmembers_static", "_getmembers"})
# Attributes of a function that decide what it does: set on a function of the tests (its code
# compiled from a protected file) they are refused from anywhere but the tests' own frames.
FUNCTION_STATE = frozenset({"__code__", "__defaults__", "__kwdefaults__"})
MAX_EVENTS = 64
CODE_WRITE_SUFFIXES = (".pyc", ".pth")
TEST_DIR_WRITE_SUFFIXES = (".py", ".pyc", ".pth", ".so")
# Trusted modules on the stack that read source lines of frames as part of formatting a stack
# (an honest library logging an exception shows the test's line): evidence, never confirmed.
FORMATTERS = ("/traceback.py", "/logging/__init__.py", "/warnings.py", "/pdb.py", "/cgitb.py")
INSPECT_FORMATTERS = frozenset(
    {"getframeinfo", "stack", "trace", "getouterframes", "getinnerframes", "_get_code_position"}
)
# ``linecache.getline`` called by untrusted code itself: one line of a file, what a library's
# own traceback formatter asks for a frame's line (boltons' ``tbutils``). Refused all the same
# (the line comes back empty) and evidence, as for the formatters above: the read gives nothing
# away. Whole-file reads (``linecache.getlines``/``updatecache``, ``open``, ``inspect``) stay
# confirmed.
LINE_READER = (os.path.join(os.path.dirname(os.__file__), "linecache.py"), "getline")
FRAMEWORK_MODULES = ("unittest", "_pytest", "pytest", "pluggy")
_O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def module_names(root, sources, paths):
    """{module name: absolute test source} for every name a protected ``.py`` file can be
    imported under: relative to each of the run's path entries, and as pytest's prepend mode
    names it (relative to the first ancestor directory without ``__init__.py``). A name two
    files could take is left out (which one wins is the run's own business)."""
    out, clash = {}, set()
    bases = []
    for p in paths:
        b = os.path.normpath(os.path.join(root, p))
        if b == root or b.startswith(root + "/"):
            bases.append(b)
    for src in sources:
        d = os.path.dirname(src)
        while d.startswith(root + "/") and os.path.isfile(os.path.join(d, "__init__.py")):
            d = os.path.dirname(d)
        for base in {*bases, d}:
            if not src.startswith(base + "/"):
                continue
            parts = src[len(base) + 1 : -3].split("/")
            if parts[-1] == "__init__":
                parts.pop()
            if not parts or not all(x.isidentifier() for x in parts):
                continue
            name = ".".join(parts)
            if out.get(name, src) != src:
                clash.add(name)
            out[name] = src
    for name in clash:
        del out[name]
    return out


def is_fragment(text, whole):
    """Whether ``text`` is the pristine file ``whole`` or a contiguous run of its lines
    (indentation and blank lines aside: an instrumenting library recompiles one function's
    dedented source)."""
    if text == whole:
        return True
    a = [x.strip() for x in text.splitlines() if x.strip()]
    b = [x.strip() for x in whole.splitlines() if x.strip()]
    if not a:
        return True
    n = len(a)
    return any(b[i : i + n] == a for i in range(len(b) - n + 1) if b[i] == a[0])


class Served(BaseException):  # noqa: N818 - not an error: how the bytes travel
    """What the hook raises to hand a protected source's pristine bytes (``args[0]``) to the
    reader that asked through ``SERVE_EVENT`` (``source_lock.serve_reads``): raised by the first
    hook, it reaches the reader and no hook added later."""


class HookRefused(RuntimeError):
    """Raised on ``sys.addaudithook``: the new hook is not added (the interpreter suppresses
    a ``RuntimeError`` raised there)."""


class Refused(PermissionError):
    """What the hook raises to refuse an operation (any other fault inside the hook is
    swallowed: a bug of the audit must never break honest code)."""


def install(
    fd,
    root,
    protected,
    test_dirs,
    trusted,
    test_pid=None,
    aliases=(),
    paths=(".",),
    changed=(),
    pristine=None,
):
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
      paths: the run's tree-relative ``sys.path`` entries (the root and the task's
        ``pythonpath``), computed once before the run: the names a test module or helper is
        imported under are computed from them (and from pytest's prepend rule).
      changed: tree-relative files the candidate's patch added or changed (a module of a test
        file's name loaded from one of them is the candidate's doing).
      pristine: {absolute path: bytes} of the protected sources, read before anything of the
        tree ran (``source_lock.read_sources``): what trusted readers are served (``Served``)
        once the files are unreadable, and what text compiled under a test file's name is
        compared with. Default: each file read when first needed.

    Returns:
      an object with ``report``, ``was_loaded``, ``check_modules`` and ``protect_code``:
      ``report(kind, what, confirmed)`` writes one line as the hook does; ``was_loaded(path)``
      says whether trusted code alone read the tree-relative test file ``path`` (a test module
      pytest collected without reading its file came from elsewhere); ``check_modules()``
      reports every module of ``sys.modules`` under a test file's name that is not what the
      import system made of that pristine file; ``protect_code(codes)`` makes the collected
      test functions' code objects unreadable to the candidate's code.
    """
    # Everything the hook calls is bound here: replacing ``os.write`` or ``json.dumps`` later
    # changes nothing it does.
    _write, _fstat, _getpid, _kill, _stat = os.write, os.fstat, os.getpid, os.kill, os.stat
    _getcwd, _join, _normpath, _fspath = os.getcwd, os.path.join, os.path.normpath, os.fspath
    _realpath, _dirname = os.path.realpath, os.path.dirname
    _dumps, _getframe, _sigkill = json.dumps, sys._getframe, signal.SIGKILL
    _get_referrers = gc.get_referrers
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
    module_code = {}  # test source -> the module code trusted code last executed from it
    test_codes = set()  # ids of every code object of those modules (kept alive in module_code)
    _modules, _ModuleType, _FunctionType = sys.modules, type(sys), type(install)
    _module_dict = _ModuleType.__dict__["__dict__"].__get__
    _code_type = type(install.__code__)
    changed = frozenset(_normpath(_join(root, p)) for p in changed)
    names = module_names(root, sources, paths)
    kept = []  # the recorded code objects, alive so that their ids stay theirs
    bound = {}  # test source -> names first seen bound to a function of the tests
    item_codes = set()  # ids of the collected test functions' code (``protect_code``)
    tracer = []  # the trace/profile hooks the candidate's code installed (``sys.settrace``)
    _open, _isfile, _frame_type = open, os.path.isfile, type(sys._getframe())

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
        """(file:line of the innermost untrusted frame or None, a formatter on the stack).

        The untrusted frame's own call of ``linecache.getline`` (one line of a file, what a
        traceback formatter of a library asks for) counts as formatting too."""
        f = _getframe(1)
        formatting = False
        called = None  # the trusted function the untrusted frame called
        while f is not None:
            code = f.f_code
            fn = code.co_filename
            if fn.startswith(trusted) or fn.startswith("<frozen "):
                if fn.endswith(FORMATTERS) or (
                    fn.endswith("inspect.py") and code.co_name in INSPECT_FORMATTERS
                ):
                    formatting = True
                called = code
                f = f.f_back
                continue
            if called is not None and (called.co_filename, called.co_name) == LINE_READER:
                formatting = True
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

    pristine = dict(pristine or {})  # test source -> its bytes, read once

    def serve(args):
        """A trusted reader asking for a protected source's pristine bytes (``SERVE_EVENT``):
        answered with ``Served`` when no frame of the candidate's code is on the stack; any
        other caller gets nothing here (its real ``open`` is refused below and by the kernel)."""
        if not args or not isinstance(args[0], str | bytes):
            return
        p = args[0]
        if isinstance(p, bytes):
            p = p.decode("utf-8", "surrogateescape")
        path = canonical(p)
        data = pristine.get(path)
        if data is None or path not in sources:
            return
        who, _ = candidate()
        if who is not None:
            return
        loaded.add(path)
        raise Served(data)

    literals = {}  # token -> a literal of the tests' assertions (pristine_asserts)

    def on_literals(args):
        """A rewritten test module's assertion literals, registered by trusted code."""
        if len(args) < 2 or not isinstance(args[0], str) or type(args[1]) is not dict:
            return
        if canonical(args[0]) not in sources or candidate()[0] is not None:
            return
        literals.update(args[1])

    def on_literal(args):
        """One literal asked for: answered (``Served``) to a frame of the tests only."""
        if not args or not isinstance(args[0], str) or args[0] not in literals:
            return
        who, _ = candidate()
        if who is None:
            raise Served(literals[args[0]])
        report("read_test_literal", f"{who} asks for an expected value of the tests", True)

    def pristine_text(path):
        if path not in pristine:
            try:
                with _open(path, "rb") as f:
                    pristine[path] = f.read()
            except OSError:
                pristine[path] = None
        data = pristine[path]
        return None if data is None else data.decode("utf-8", "surrogateescape")

    def code_named(filename, source=None):
        if not isinstance(filename, str | bytes):
            return
        if isinstance(filename, bytes):
            filename = filename.decode("utf-8", "surrogateescape")
        path = canonical(filename, root) if filename and filename[0] != "<" else ""
        if path in sources:
            if isinstance(source, bytes | bytearray):
                text = bytes(source).decode("utf-8", "surrogateescape")
            elif isinstance(source, str):
                text = source
            else:
                text = None  # an AST (pytest's rewritten tests) or a code object's bytes
            whole = pristine_text(path) if text is not None else None
            forged = whole is not None and not is_fragment(text, whole)
            who = direct()
            if forged:
                # Text that is not the file's compiled under its name: by the import system
                # (a loader serving other bytes) or by the candidate, never honest.
                by = who or candidate()[0] or "the import system"
                report("test_module_forged", f"{by} compiles other text as {rel(path)}", True)
                raise Refused(13, "only the pristine test file compiles under its name", path)
            # Evidence only: honest instrumenting libraries recompile a decorated test function
            # under its own file's name. A test module replaced that way is caught anyway: its
            # file is never read by pytest (``was_loaded``).
            if who is not None:
                report("code_as_test", f"{who} makes code named {rel(path)}", False)
        elif path.startswith(trusted):
            # Code posing as trusted code: its frames would pass for the standard library's.
            who = direct()
            if who is not None:
                report("code_as_trusted", f"{who} makes code named {path}", True)

    def on_exec(code):
        """Records the module code trusted code executes from a test source (the import
        system, pytest's rewriting importer): what ``check_modules`` compares against."""
        if type(code) is not _code_type or code.co_name != "<module>":
            return
        fn = code.co_filename
        path = canonical(fn, root) if fn and fn[0] != "<" else ""
        if path not in sources or direct() is not None:
            return
        module_code[path] = code
        kept.append(code)
        todo = [code]
        while todo:
            c = todo.pop()
            test_codes.add(id(c))
            todo.extend(x for x in c.co_consts if type(x) is _code_type)

    def first_outside():
        f = _getframe(1)
        while f is not None and f.f_code.co_filename == own:
            f = f.f_back
        return f

    def copies_kwdefaults(obj, value):
        """Whether setting ``obj.__kwdefaults__ = value`` only gives a copy of a function its
        original's keyword defaults: ``obj`` has none and ``value`` is None or the very dict
        another function of the same code holds (``copy_function``-style helpers build the
        copy with ``FunctionType(f.__code__, ...)``, which takes no keyword defaults). Every
        function of a code takes its keyword defaults from the same ``def``, so this cannot
        give a function of the tests defaults its code was not made with."""
        if obj.__kwdefaults__ is not None:
            return False
        if value is None:
            return True
        code = obj.__code__
        return any(
            type(g) is _FunctionType
            and g is not obj
            and g.__code__ is code
            and g.__kwdefaults__ is value
            for g in _get_referrers(code)
        )

    def on_function_state(obj, name, value):
        """A function of the tests (code from a protected file) changed: refused unless the
        tests themselves (or trusted code they called) do it, or the change only gives a copy
        of a test function its original's keyword defaults (:func:`copies_kwdefaults`)."""
        code = obj.__code__
        fn = code.co_filename
        if id(code) not in test_codes and (fn[:1] == "<" or canonical(fn, root) not in sources):
            return
        if name == "__kwdefaults__" and copies_kwdefaults(obj, value):
            return
        who, _ = candidate()
        if who is None:
            return
        what = f"{who} sets {name} of {code.co_name} ({rel(canonical(fn, root))})"
        report("test_function_changed", what, True)
        raise Refused(13, "the tests' functions are not changed here", name)

    def module_source(mod):
        """The protected source a module object was made from (by its ``__file__`` or by the
        name it is imported under), else None."""
        try:
            d = _module_dict(mod)
        except Exception:  # noqa: BLE001 - not a module's dict
            return None
        f = d.get("__file__")
        if isinstance(f, str) and f and f[0] != "<":
            path = canonical(f, root)
            if path in sources:
                return path
        name = d.get("__name__")
        return names.get(name) if isinstance(name, str) else None

    def foreign_type(cls):
        """Where a module type other than ``ModuleType`` defines behaviour outside trusted code
        and the tests (the candidate's attribute lookup), else None."""
        for klass in cls.__mro__:
            if klass is _ModuleType or klass is object:
                continue
            for v in list(vars(klass).values()):
                code = getattr(getattr(v, "__func__", v), "__code__", None)
                if type(code) is not _code_type:
                    continue
                fn = code.co_filename
                path = canonical(fn, root) if fn[:1] != "<" else fn
                if not path.startswith(trusted) and path not in sources:
                    return f"{klass.__qualname__}.{code.co_name} ({rel(path)})"
        return None

    def on_module_class(mod, cls):
        """A module of the tests (a test module, a helper) given another type: its attribute
        lookup is then the new type's. Refused from the candidate's code."""
        path = module_source(mod)
        if path is None:
            return
        who, _ = candidate()
        if who is None:
            return
        what = f"{who} sets the type of {rel(path)}'s module to {getattr(cls, '__name__', cls)}"
        report("test_module_changed", what, True)
        raise Refused(13, "the tests' modules keep their type", rel(path))

    def on_read_code(obj, name):
        """The code object of a collected test function read by the candidate (directly, or
        through ``dis``): the expected values are its constants. Refused and confirmed for a
        function's ``__code__``; evidence only for a frame's ``f_code``."""
        if name == "__code__" and type(obj) is _FunctionType:
            code = obj.__code__
        elif name == "f_code" and type(obj) is _frame_type:
            code = obj.f_code
        else:
            return
        if id(code) not in item_codes:
            return
        who = direct()
        if who is None:
            f = first_outside()
            via = f.f_code.co_filename if f is not None else ""
            if not via.endswith(READERS) and not (
                via.endswith("/inspect.py") and f.f_code.co_name in INSPECT_READERS
            ):
                return
            who, _ = candidate()
            if who is None:
                return
        if name == "f_code" and not tracer:
            # a frame's code is what stack-level helpers of honest libraries read (deprecation
            # wrappers, traceback formatters: ``inspect.getfile(frame.f_code)``, ``co_name``):
            # evidence for the grader, never refused; once the candidate's code has installed
            # a trace or profile function (which can rewrite a test's frame as it runs), read
            # and refused as a function's code is
            report("read_test_code", f"{who} reads the code of {code.co_name} (a frame)", False)
            return
        report("read_test_code", f"{who} reads the code of {code.co_name}", True)
        raise Refused(13, "the tests' code is not readable here", code.co_name)

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
            elif event == SERVE_EVENT:
                serve(args)
            elif event == LITERAL_EVENT:
                on_literal(args)
            elif event == LITERALS_EVENT:
                on_literals(args)
            elif event == "sys.addaudithook":
                # A hook of the candidate's would see every event after this one's (the module
                # code the import system executes, its constants): never added.
                who, _ = candidate()
                if who is not None:
                    report("audit_hook_added", f"{who} adds an audit hook (not added)", False)
                    raise HookRefused("audit hooks are not added here")
            elif event == "import":
                if _sys.pycache_prefix != pycache_prefix:
                    _sys.pycache_prefix = pycache_prefix
                    report("pycache_prefix", "sys.pycache_prefix changed", True)
            elif event == "compile":
                if len(args) > 1:
                    code_named(args[1], args[0])
            elif event == "exec":
                if args:
                    on_exec(args[0])
            elif event == "object.__getattr__":
                if len(args) > 1 and args[1] in ("__code__", "f_code") and item_codes:
                    on_read_code(args[0], args[1])
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
                if type(obj) is _FunctionType and args[1] in FUNCTION_STATE:
                    on_function_state(obj, args[1], args[2] if len(args) > 2 else obj)
                elif args[1] == "__class__" and isinstance(obj, _ModuleType):
                    on_module_class(obj, args[2] if len(args) > 2 else None)
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
                    if event in ("sys.settrace", "sys.setprofile"):
                        tracer.append(event)
                report(event, what, False)
        except (Refused, HookRefused):
            raise
        except Exception:  # noqa: BLE001, S110 - see Refused
            pass
        finally:
            busy.discard(me)

    def was_loaded(path):
        """Whether trusted code alone (pytest, importlib) read the test file ``path``."""
        return _normpath(_join(root, path)) in loaded

    def protect_code(codes):
        """Makes the code objects ``codes`` (the collected test functions') unreadable to the
        candidate's code (see ``on_read_code``)."""
        for c in codes:
            if type(c) is _code_type:
                kept.append(c)
                item_codes.add(id(c))

    def check_modules():
        """Every module in ``sys.modules`` under a name of a test source (the tests, their
        helpers, ``__init__.py``) must be what trusted code executed from that pristine file,
        its top-level functions still the file's. Reports each difference (confirmed, unless
        the module came from a pristine file of the tree under a clashing name)."""
        for name, path in list(names.items()):
            mod = _modules.get(name)
            if mod is None:
                continue
            r = rel(path)
            if not isinstance(mod, _ModuleType):
                report("test_module_replaced", f"sys.modules[{name!r}] ({r}) is no module", True)
                continue
            if type(mod) is not _ModuleType:
                # A module type of the candidate's decides what the tests' names resolve to
                # (however its ``__class__`` was set); one of the tests' own is theirs.
                where = foreign_type(type(mod))
                if where is not None:
                    what = f"{name} ({r}) has the module type {type(mod).__name__}: {where}"
                    report("test_module_replaced", what, True)
                    continue
            d = _module_dict(mod)
            f = d.get("__file__")
            if not isinstance(f, str):
                report("test_module_replaced", f"{name} ({r}) was made without a file", True)
                continue
            where = canonical(f, root)
            if where != path:
                # A clash of names with an unchanged file of the repository or an installed
                # module (read-only to the candidate) is the repository's own business.
                honest = where.startswith(trusted) or (
                    where.startswith(prefix) and where not in changed and _isfile(where)
                )
                what = f"{name} ({r}) was loaded from {rel(where)}"
                report("test_module_replaced", what, not honest)
                continue
            code = module_code.get(path)
            if path not in loaded or code is None:
                what = f"{name} ({r}) was not executed from its file by the import system"
                report("test_module_replaced", what, True)
                continue
            defs = {}
            for c in code.co_consts:
                if type(c) is _code_type:
                    defs.setdefault(c.co_name, set()).add(id(c))
            # The names bound to the tests' own functions when first seen (a helper the test
            # module imported, its own defs): rebound later to other code is the same forgery.
            seen = bound.setdefault(path, {})
            for fname, v in list(d.items()):
                if type(v) is not _FunctionType:
                    continue
                vcode = v.__code__
                if id(vcode) in test_codes:
                    seen.setdefault(fname, True)
                    continue
                if fname not in defs and fname not in seen:
                    continue
                # A decorator's wrapper is fine from trusted code, the tests or the repository's
                # unchanged code (evidence); from the candidate's files or made outside the
                # tree, even one that names the original as ``__wrapped__``, it is the forgery.
                vf = vcode.co_filename
                vpath = canonical(vf, root) if vf[:1] != "<" else vf
                if vpath.startswith(trusted) or vpath in sources:
                    continue
                honest = vpath.startswith(prefix) and vpath not in changed
                what = f"{r}: {fname} was replaced by code of {rel(vpath)}"
                report("test_function_replaced", what, not honest)
            hook_fn = d.get("__getattr__")
            if hook_fn is not None and "__getattr__" not in code.co_names:
                # A lookup hook the file does not make answers for every name the module lacks
                # (one deleted, one a later test imports): the module's behaviour changed.
                where = getattr(getattr(hook_fn, "__code__", None), "co_filename", "?")
                where = rel(canonical(where)) if where.startswith("/") else where
                what = f"{name} ({r}) was given a module __getattr__ ({where})"
                report("test_module_changed", what, True)
            for fname in list(seen):
                # A name of the tests' functions deleted (a module ``__getattr__`` answers for
                # it then) or bound to something that is no function (a callable object).
                v = d.get(fname)
                if type(v) is not _FunctionType:
                    kind = "removed" if v is None else f"replaced by a {type(v).__name__}"
                    report("test_function_replaced", f"{r}: {fname} was {kind}", True)

    sys.addaudithook(hook)

    class Audit:
        pass

    audit = Audit()
    audit.report, audit.was_loaded, audit.check_modules = report, was_loaded, check_modules
    audit.protect_code = protect_code
    audit.helper_names = sorted(
        n
        for n, p in names.items()
        if not p.rpartition("/")[2].startswith("test")
        and not p.endswith(("/conftest.py", "_test.py"))
    )
    return audit
