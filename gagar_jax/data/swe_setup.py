"""A task row's setup commands (``pre_install``, ``install``), run as SWE-bench's harness runs them.

SWE-bench builds an instance's image by running, in the repository's directory and in the
activated environment, the row's ``pre_install`` commands and then its ``install`` command
(e.g. ``sed -i`` edits of the tree, ``apt-get install -y ...``, ``python -m pip install -e .``).
Here those commands are split into steps and each kind runs where it can run safely:

- **tree edits and Python commands** (``sed -i``, ``echo ... > file``, ``rm``, ``python
  script.py``, ``export``, ``cd``; ``kind="shell"``) run in order as one ``bash -e`` script
  **in the sandbox** (no network, an unprivileged uid, the tree at its work directory and its
  only writable place), with ``python``/``python3`` on ``PATH`` and the build backend's
  environment on its path: :func:`run_shell_steps`; what they leave in the tree becomes the
  task's tree. A step that fails is a task error naming it; so is one that builds binary files
  (a compiled extension: the text tree cannot hold it, use a container image that has it);
- **the install of the tree** (``pip install -e .[extras]``, ``pip install .``, ``python
  setup.py develop|install``, ``uv pip install -e .``, ``uv sync``; ``kind="install"``) is the
  build backend's metadata hook on the edited tree (``environments.install_repository``);
- **packages** (``pip install "numpy<2" -r requirements-dev.txt``; ``kind="requirements"``)
  join the environment's requirements, resolved with uv (``-r`` files are read from the edited
  tree); ``pip uninstall`` drops names from them (``kind="uninstall"``);
- **environment activation** (``source /opt/miniconda3/bin/activate``, ``conda activate
  testbed``; ``kind="activate"``) is what the verifier does anyway: the task's environment is
  the one its tests run in;
- **system commands** (``apt-get``, ``apt``, ``dpkg``, ``conda``/``mamba`` installs,
  ``locale-gen``, ``sudo``, anything writing outside the tree such as ``echo ... >
  /etc/locale.gen``; ``kind="system"``) need a container: under ``execution.environment =
  "container"`` they run as ``RUN`` steps of an image derived from the task's image
  (``verify.container.setup_image``, with the network, like SWE-bench's image builds); under
  ``"uv"`` such a row is a task error that names the command.

A command chain (``a && b; c``) is split at its top-level ``&&`` and ``;`` (quotes respected; a
command with a here-document stays whole). The steps of each kind keep their order; the system
steps run before the others (they run while the image is built, before the tree exists there),
and the install of the tree reads the tree every shell step left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence

KINDS = ("shell", "install", "requirements", "uninstall", "activate", "system")
# Programs that change the system (packages, locales, users): only a container image can.
SYSTEM_PROGRAMS = frozenset(
    {
        "apt-get", "apt", "aptitude", "dpkg", "add-apt-repository", "yum", "dnf", "rpm",
        "apk", "zypper", "pacman", "brew", "snap", "conda", "mamba", "micromamba",
        "locale-gen", "update-locale", "localedef", "dpkg-reconfigure", "sudo", "su",
        "useradd", "adduser", "groupadd", "update-alternatives", "ldconfig", "systemctl",
        "service",
    }
)  # fmt: skip  # one set
# Programs that fetch from the network (the sandbox has none; an image build has).
NETWORK_PROGRAMS = frozenset({"wget", "curl", "aria2c"})
# An argument (or a redirection's target) naming a system directory: the command writes
# outside the tree (``echo 'en_US UTF-8' > /etc/locale.gen``).
_SYSTEM_PATH = re.compile(r"^/(etc|usr|opt|var|root|lib|lib32|lib64|bin|sbin|boot|srv|home)(/|$)")
# pip options that take a value (their value is not a target).
_PIP_VALUE_OPTS = frozenset(
    {
        "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
        "--config-settings", "-C", "--global-option", "--install-option", "--prefix",
        "--root", "--target", "-t", "--src", "--python", "-p", "--cache-dir", "--log",
        "--progress-bar", "--upgrade-strategy", "--platform", "--python-version",
        "--implementation", "--abi", "--trusted-host", "--timeout", "--retries", "--proxy",
        "--no-binary", "--only-binary", "--group", "--extra",
    }
)  # fmt: skip  # one set
_TREE_TARGET = re.compile(r"(\.|\./)(\[[\w,.\- ]*\])?")
SHELL_LIMIT_S = 300


class SetupError(RuntimeError):
    """A setup command that cannot be run (a task error: names the command and why)."""


@dataclasses.dataclass(frozen=True)
class SetupStep:
    """One command of a row's setup, and what it is.

    Attributes:
      command: the command's text (one part of a ``&&``/``;`` chain).
      kind: one of KINDS (see the module docstring).
      extras: the extras an install of the tree asks for (``.[test]`` -> ``("test",)``).
      requirements: requirement strings a ``pip install`` of packages names (or, for
        ``uninstall``, the names it removes).
      requirement_files: ``-r`` files, tree-relative, read after the shell steps.
    """

    command: str
    kind: str
    extras: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    requirement_files: tuple[str, ...] = ()


def commands(pre_install: object = (), install: object = "") -> list[str]:
    """The row's setup commands in SWE-bench's order: every ``pre_install`` one, then
    ``install`` (each a string or a list of strings; empty ones dropped)."""
    out: list[str] = []
    for field, value in (("pre_install", pre_install), ("install", install)):
        if value is None:
            continue
        if hasattr(value, "tolist"):  # numpy arrays from parquet
            value = value.tolist()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(c, str) for c in items):
            raise SetupError(f"{field} must be a command string or a list of them")
        out += [c.strip() for c in items if c.strip()]
    return out


def split_chain(command: str) -> list[str]:
    """The parts of a command chain at its top-level ``&&`` and ``;`` (quotes and backslashes
    respected); a command with a here-document (``<<``) is one part."""
    if "<<" in command:
        return [command.strip()]
    parts, cur, quote, i = [], [], "", 0
    while i < len(command):
        c = command[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(command):
                cur.append(command[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c == "\\" and i + 1 < len(command):
            cur += [c, command[i + 1]]
            i += 1
        elif c in "'\"":
            quote = c
            cur.append(c)
        elif c == ";" or command.startswith("&&", i):
            parts.append("".join(cur))
            cur = []
            i += 1 if c == ";" else 2
            continue
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _words(part: str) -> list[str]:
    try:
        lexer = shlex.shlex(part, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError as e:
        raise SetupError(f"setup command {part!r} does not parse: {e}") from e


def _program(argv: list[str]) -> tuple[str, list[str]]:
    """(program name, its argv) after ``VAR=value`` settings and ``env``/``time`` wrappers."""
    while argv and (
        re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]) or argv[0] in ("env", "time", "command")
    ):
        argv = argv[1:]
    return (posixpath.basename(argv[0]) if argv else ""), argv


def _pip_argv(prog: str, argv: list[str]) -> list[str] | None:
    """``["install", ...]`` for a pip call (``pip``, ``pip3``, ``python -m pip``, ``uv pip``),
    else None."""
    if re.fullmatch(r"pip[\d.]*", prog):
        return argv[1:]
    if re.fullmatch(r"python[\d.]*", prog) and argv[1:3] == ["-m", "pip"]:
        return argv[3:]
    if prog == "uv" and argv[1:2] == ["pip"]:
        return argv[2:]
    return None


def classify(part: str) -> SetupStep:
    """What one command (a part of a chain) is: see the module docstring. Only the command
    before a ``||``, ``|`` or redirection says what it installs (``pip install -e . || true``
    is an install of the tree)."""
    words = _words(part)
    cut = next((i for i, w in enumerate(words) if w and set(w) <= set("|&<>;")), len(words))
    prog, argv = _program(words[:cut])
    if not prog:
        return SetupStep(part, "shell")
    if prog in SYSTEM_PROGRAMS and not (prog == "conda" and argv[1:2] == ["activate"]):
        return SetupStep(part, "system")
    if prog in NETWORK_PROGRAMS or (
        prog == "git" and argv[1:2] in (["clone"], ["fetch"], ["pull"])
    ):
        return SetupStep(part, "system")
    if any(_SYSTEM_PATH.match(w) for w in words) and prog not in ("source", "."):
        return SetupStep(part, "system")
    if prog in ("source", ".") and argv[1:] and posixpath.basename(argv[1]) == "activate":
        return SetupStep(part, "activate")
    if prog == "conda" and argv[1:2] == ["activate"]:
        return SetupStep(part, "activate")
    if re.fullmatch(r"python[\d.]*", prog) and argv[1:2] == ["setup.py"]:
        if argv[2:3] in (["develop"], ["install"]):
            return SetupStep(part, "install")
        return SetupStep(part, "shell")  # build_ext --inplace, egg_info, ...
    if prog == "uv" and argv[1:2] == ["sync"]:
        extras = tuple(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--extra")
        return SetupStep(part, "install", extras=extras)
    pip = _pip_argv(prog, argv)
    if pip is None:
        return SetupStep(part, "shell")
    if pip[:1] == ["uninstall"]:
        names = tuple(a for a in pip[1:] if not a.startswith("-"))
        return SetupStep(part, "uninstall", requirements=names)
    if pip[:1] != ["install"]:
        return SetupStep(part, "activate")  # pip list/freeze/show: informational
    return _pip_install(part, pip[1:])


def _pip_install(part: str, args: list[str]) -> SetupStep:
    tree, extras, reqs, files = False, [], [], []
    i = 0
    while i < len(args):
        a = args[i]
        value = None
        if a in ("-e", "--editable", "-r", "--requirement"):
            if i + 1 >= len(args):
                raise SetupError(f"install command {part!r}: {a} needs a value")
            value, i = args[i + 1], i + 2
        elif a.startswith(("--editable=", "--requirement=")):
            a, value = a.split("=", 1)
            i += 1
        elif a in _PIP_VALUE_OPTS:
            i += 2
            continue
        elif a.startswith("-"):
            i += 1
            continue
        else:
            value, i = a, i + 1
        if a in ("-r", "--requirement"):
            files.append(posixpath.normpath(value))
            continue
        m = _TREE_TARGET.fullmatch(value)
        if m:
            tree = True
            if m.group(2):
                extras += [e.strip() for e in m.group(2)[1:-1].split(",") if e.strip()]
            continue
        if value.startswith((".", "/")) or a in ("-e", "--editable") or "://" in value:
            raise SetupError(
                f"install command {part!r} installs {value!r}, which is neither the "
                "repository nor a package of the registry: it needs a container environment"
            )
        reqs.append(value)
    if tree and (reqs or files):
        # both at once: the packages join the environment, the tree is installed
        return SetupStep(part, "install", tuple(extras), tuple(reqs), tuple(files))
    if tree:
        return SetupStep(part, "install", extras=tuple(extras))
    return SetupStep(part, "requirements", requirements=tuple(reqs), requirement_files=tuple(files))


def plan(cmds: Iterable[str]) -> list[SetupStep]:
    """Every step of ``cmds`` (see :func:`commands`), classified, in order. A chain whose
    commands are all tree edits stays one step, run as written (``grep -q x setup.py && sed
    -i ... || sed -i ...`` keeps its meaning); a chain of several kinds is split."""
    out: list[SetupStep] = []
    for c in cmds:
        steps = [classify(p) for p in split_chain(c)]
        if len(steps) > 1 and all(s.kind == "shell" for s in steps):
            out.append(SetupStep(c.strip(), "shell"))
        else:
            out += steps
    return out


def system_steps(steps: Sequence[SetupStep]) -> list[str]:
    return [s.command for s in steps if s.kind == "system"]


def require_no_system(steps: Sequence[SetupStep]) -> None:
    """SetupError naming the first system command: the uv environment cannot run it."""
    for s in steps:
        if s.kind == "system":
            raise SetupError(
                f"setup command {s.command!r} needs system packages, the network or writes "
                "outside the repository: it needs a container environment (run this task with "
                'execution.environment="container": the command then runs while its image '
                "is built)"
            )


def requirements_of(steps: Sequence[SetupStep], files: Mapping[str, str]) -> list[str]:
    """The requirement strings the steps add (``-r`` files read from ``files``, the tree after
    the shell steps; their comments, options and nested ``-r`` lines followed)."""
    out: list[str] = []
    for s in steps:
        if s.kind in ("requirements", "install"):
            out += s.requirements
            for f in s.requirement_files:
                out += _requirements_file(f, files, set())
    return list(dict.fromkeys(out))


def _requirements_file(path: str, files: Mapping[str, str], seen: set[str]) -> list[str]:
    if path in seen:
        return []
    seen.add(path)
    if path not in files:
        raise SetupError(
            f"requirements file {path!r} named by an install command is not in the tree"
        )
    out = []
    for line in files[path].splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement ")):
            nested = line.split(None, 1)[1].strip()
            out += _requirements_file(
                posixpath.normpath(posixpath.join(posixpath.dirname(path), nested)), files, seen
            )
        elif line.startswith(("-e ", "--editable ")) or line in (".", "-e ."):
            continue  # the repository itself: installed anyway
        elif not line.startswith("-"):
            out.append(line)
    return out


def uninstalled(steps: Sequence[SetupStep]) -> set[str]:
    """Normalised names that ``pip uninstall`` steps remove."""
    return {re.sub(r"[-_.]+", "-", n).lower() for s in steps if s.kind == "uninstall"
            for n in s.requirements}  # fmt: skip


def drop_uninstalled(reqs: Sequence[str], names: set[str]) -> list[str]:
    if not names:
        return list(reqs)
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for r in reqs:
        try:
            name = re.sub(r"[-_.]+", "-", Requirement(r).name).lower()
        except InvalidRequirement:
            name = ""
        if name not in names:
            out.append(r)
    return out


def extras_of(steps: Sequence[SetupStep]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(e for s in steps if s.kind == "install" for e in s.extras))


_STEP_MARK = "gagar-setup-step:"
_SCRATCH = re.compile(r"(^|/)(__pycache__|\.git)(/|$)")


def run_shell_steps(
    files: Mapping[str, str],
    steps: Sequence[SetupStep],
    *,
    site: Sequence[str] = (),
    cache_dir: str | None = None,
    key_extra: str = "",
    wall_s: float = SHELL_LIMIT_S,
) -> dict[str, str]:
    """The tree after the shell steps of ``steps`` ran in order, as one ``bash -e`` script, in
    the sandbox (see the module docstring), cached per (tree, steps, ``key_extra``: the build
    environment's hash). ``site``: read-only directories put on ``PYTHONPATH``.

    Raises SetupError naming the step that failed, or the binary files a step built."""
    shell = [s.command for s in steps if s.kind == "shell"]
    if not shell:
        return dict(files)
    from gagar_jax.data import repos
    from gagar_jax.verify.repo import read_text_tree, write_tree
    from gagar_jax.verify.sandbox import Limits, python_for_sandbox, run_sandboxed

    h = hashlib.sha256()
    for p in sorted(files):
        h.update(p.encode() + b"\0" + files[p].encode() + b"\0")
    h.update(json.dumps([shell, key_extra, list(site)]).encode())
    key = h.hexdigest()[:32]
    root = os.path.join(os.path.abspath(cache_dir or repos.default_cache_dir()), "setup")
    record = os.path.join(root, key + ".json")
    try:
        with open(record) as f:
            return json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        pass
    exe, _ = python_for_sandbox()
    script = ["set -e"]
    for n, cmd in enumerate(shell):
        script += [f"echo '{_STEP_MARK}{n}' >&2", cmd]
    parent = tempfile.mkdtemp(prefix="gagar_setup_")
    os.chmod(parent, 0o711)
    try:
        work, tools = os.path.join(parent, "repo"), os.path.join(parent, "bin")
        os.mkdir(work)
        os.mkdir(tools)
        write_tree(work, files)
        for name in ("python", "python3"):
            os.symlink(exe, os.path.join(tools, name))
        os.chmod(tools, 0o555)
        r = run_sandboxed(
            ["/bin/bash", "-c", "\n".join(script)],
            work,
            Limits(wall_s=wall_s, cpu_s=wall_s, memory_bytes=2 << 30, nproc=128),
            env={
                "PATH": f"{tools}:/usr/bin:/bin",
                "PYTHONPATH": ":".join(site),
                "PYTHONNOUSERSITE": "1",
            },
            ro_paths=(tools, *site),
            private_workdir=False,  # what the steps write into the tree is their result
        )
        if r.status != "passed":
            marks = re.findall(rf"{_STEP_MARK}(\d+)", r.stderr)
            failed = shell[int(marks[-1])] if marks else shell[0]
            detail = re.sub(rf"{_STEP_MARK}\d+\n?", "", r.stderr)[-1200:]
            raise SetupError(
                f"setup command {failed!r} failed ({r.status}): {r.error or ''}{detail}"
            )
        after = read_text_tree(work)
        binary = sorted(
            p
            for p in _all_files(work)
            if p not in after
            and not _SCRATCH.search(p)
            and not os.path.islink(os.path.join(work, p))
        )
        if binary:
            raise SetupError(
                f"setup commands {shell!r} built binary files ({', '.join(binary[:5])}): a "
                "compiled build needs a container image that has it"
            )
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    out = {p: t for p, t in after.items() if not _SCRATCH.search(p)}
    os.makedirs(root, exist_ok=True)
    tmp = f"{record}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": out, "steps": shell}, f)
    os.replace(tmp, record)
    return out


def _all_files(root: str) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".git", "__pycache__")]
        out += [os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/") for n in names]
    return out
