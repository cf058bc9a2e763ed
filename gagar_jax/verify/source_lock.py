"""The tests' source made unreadable to the whole session by the kernel (Landlock).

The test runner (``outcome_plugin.py``) loads this file by absolute path from its read-only
directory (it must not import gagar_jax). Its supervisor, before it forks the test process and
before anything of the tree can run, reads the protected test sources (the hidden tests, the
task's test files, every ``.py`` under the test directories, ``conftest.py``, the canaries) into
memory with :func:`read_sources`, then calls :func:`lock`: a Landlock ruleset that handles
``LANDLOCK_ACCESS_FS_READ_FILE`` and allows it beneath every directory and file of the mount
namespace except those sources. Landlock is an allow-list, so the rules are:

- a rule on every entry of every directory that holds a protected source (or a directory
  that does, up to ``/``), other than the protected sources themselves and those directories:
  existing files by inode, subdirectories with everything beneath them (``/tmp``, the site-
  packages, a subdirectory of the tree without tests);
- no rule on a protected source, nor on a directory above one.

The domain is inherited by every process the session starts (the test process, ``cat`` in a
child, a shell from ``subprocess``, a forked child calling ``os.open``) and cannot be left or
widened: an ``open`` for reading of a protected source fails with ``EACCES`` in any process,
through any path (``/proc/self/fd``, the sandbox's read-only source of the tree, a hard or
symbolic link: a rule belongs to an inode, links across directories are refused, renames keep
the inode), and with it every reader built on ``open`` (``read``, ``mmap``, ``sendfile``,
``copy_file_range``, libc through ``ctypes``).

What the lock costs: a file or directory created during the session directly in a directory
above a protected source (the tree's root, a test directory) has no rule, so it cannot be
opened for reading there (writing still works). Scratch space (``/tmp``, pytest's ``tmp_path``,
any existing subdirectory without tests) is unaffected.

The test process reads the pristine sources from memory instead: :func:`serve_reads` puts an
``open`` of its own in place of ``builtins.open``/``io.open``/``io.open_code`` (and the copy
``tokenize`` keeps, which ``linecache`` uses) that asks the runtime audit hook for the pristine
bytes through an audit event (``SERVE_EVENT``). The hook answers only trusted code (pytest
collecting and rewriting the tests, importlib, a traceback of a failing test): it raises its
``Served`` exception carrying the bytes, so no hook added later sees them and nothing of the
runner keeps a reference the candidate's code could follow. Any other caller falls through to
the real ``open``, which the hook refuses (confirmed) and the kernel denies.

Where Landlock is unavailable (an older kernel, a container whose seccomp profile blocks its
system calls) :func:`lock` raises ``OSError`` naming why; the runner records it (the verdict's
``source_lock``) and the audit hook's refusal of in-process reads is the only guard.
"""

import ctypes
import errno
import os
import struct

SYS_LANDLOCK_CREATE_RULESET = 444  # the same number on every architecture (asm-generic)
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_ACCESS_FS_READ_FILE = 1 << 2
PR_SET_NO_NEW_PRIVS = 38
SERVE_EVENT = "gagar.pristine_source"


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi():
    """The kernel's Landlock ABI version, or 0 with the reason (``(abi, why)``)."""
    libc = _libc()
    v = libc.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
    )
    if v < 0:
        e = ctypes.get_errno()
        return 0, f"landlock unavailable ({errno.errorcode.get(e, e)})"
    return int(v), ""


def read_sources(paths):
    """{absolute path: bytes} of the files ``paths`` that can be read (others left out)."""
    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = f.read()
        except OSError:
            pass
    return out


def rule_paths(protected):
    """The paths a READ_FILE rule goes on (see the module docstring): every entry of every
    directory above a protected file, other than the protected files and those directories.
    Symbolic links are left out (an open resolves them; the target's own place decides)."""
    protected = {os.path.normpath(p) for p in protected}
    above = set()
    for p in protected:
        d = os.path.dirname(p)
        while d not in above:
            above.add(d)
            if d == "/":
                break
            d = os.path.dirname(d)
    out = []
    for d in sorted(above):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in sorted(names):
            p = os.path.join(d, n)
            if p in above or p in protected or os.path.islink(p):
                continue
            out.append(p)
    return out


def lock(protected):
    """Makes the files ``protected`` (absolute paths) unreadable to this process and every
    process it starts from now on (see the module docstring). Returns a short description;
    raises ``OSError`` naming why where the kernel cannot."""
    abi, why = landlock_abi()
    if abi < 1:
        raise OSError(errno.ENOSYS, why)
    # A protected path that is a symbolic link protects its target too (the target's own
    # directory would otherwise give it a rule).
    protected = [p for p in protected if os.path.exists(p)]
    protected = sorted({*protected, *(os.path.realpath(p) for p in protected)})
    libc = _libc()
    attr = struct.pack("=Q", LANDLOCK_ACCESS_FS_READ_FILE)  # handled_access_fs only (ABI 1)
    buf = ctypes.create_string_buffer(attr, len(attr))
    rs = libc.syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), buf, ctypes.c_size_t(len(attr)), 0
    )
    if rs < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"landlock_create_ruleset: {errno.errorcode.get(e, e)}")
    try:
        n = 0
        for p in rule_paths(protected):
            try:
                fd = os.open(p, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile
            try:
                rule = ctypes.create_string_buffer(
                    struct.pack("=Qi", LANDLOCK_ACCESS_FS_READ_FILE, fd), 12
                )
                r = libc.syscall(
                    ctypes.c_long(SYS_LANDLOCK_ADD_RULE),
                    ctypes.c_int(rs),
                    ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                    rule,
                    ctypes.c_uint32(0),
                )
                if r < 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"landlock_add_rule({p}): {errno.errorcode.get(e, e)}")
                n += 1
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(rs), 0) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"landlock_restrict_self: {errno.errorcode.get(e, e)}")
    finally:
        os.close(rs)
    return f"landlock ABI {abi}: {len(protected)} test sources unreadable ({n} rules)"


def serve_reads(served):
    """Puts an ``open`` that serves the pristine sources from the audit hook's memory in
    place of the interpreter's (see the module docstring). ``served`` is the exception class
    the hook raises with the bytes."""
    import _io
    import builtins
    import io
    import locale
    import sys

    real_open = _io.open
    real_open_code = getattr(_io, "open_code", None)
    _audit, _fspath, _BytesIO, _TextIOWrapper = sys.audit, os.fspath, io.BytesIO, io.TextIOWrapper
    _encoding = locale.getpreferredencoding

    def pristine(file):
        try:
            path = _fspath(file)
        except TypeError:
            return None
        try:
            _audit(SERVE_EVENT, path)
        except served as e:
            return e.args[0]
        return None

    def open(  # noqa: A001 - the builtin's name and signature
        file,
        mode="r",
        buffering=-1,
        encoding=None,
        errors=None,
        newline=None,
        closefd=True,
        opener=None,
    ):
        if (
            opener is None
            and type(mode) is str
            and mode
            and not mode.strip("rbt")
            and not isinstance(file, int)
        ):
            data = pristine(file)
            if data is not None:
                buf = _BytesIO(data)
                buf.name = file
                if "b" in mode:
                    return buf
                text = _TextIOWrapper(
                    buf, encoding or _encoding(False), errors, newline, line_buffering=False
                )
                text.mode = mode
                return text
        return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)

    open.__doc__ = real_open.__doc__
    builtins.open = io.open = _io.open = open
    if real_open_code is not None:

        def open_code(path):
            data = pristine(path)
            if data is not None:
                buf = _BytesIO(data)
                buf.name = path
                return buf
            return real_open_code(path)

        io.open_code = _io.open_code = open_code
    tokenize = sys.modules.get("tokenize")
    if tokenize is not None and hasattr(tokenize, "_builtin_open"):
        tokenize._builtin_open = open
