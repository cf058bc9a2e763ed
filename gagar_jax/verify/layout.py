"""What a repository's files declare: the import path of its layout and its dependencies.

Pure functions of a tree (``{relative posix path: text}``); nothing is executed here.

- :func:`detect_pythonpath`: the directories of the tree the package under test is imported
  from besides the root (the pytest configuration's ``pythonpath``, else ``src`` for a ``src/``
  layout). ``RepoTask`` calls it when a task names none.
- :func:`declared_requirements`: every requirement the repository declares for its tests, read
  from each place a Python project writes them: ``[project].dependencies`` and its test extras
  (``[project.optional-dependencies]``), ``[dependency-groups]`` (PEP 735, with
  ``include-group``), ``setup.cfg`` (``install_requires``, test extras, ``tests_require``),
  ``requirements*.txt`` (and ``requirements/*.txt``, with ``-r`` includes), and tox's
  ``[testenv] deps``. A self-reference (``pkg[tests]``) expands to that extra. The test
  framework itself (pytest, pytest-timeout) is left out: the verifier pins its own versions.
  Dependencies that only ``setup.py`` (or a dynamic ``[project]``) knows come from the build
  backend's metadata, which means running the repository's code: ``needs_backend_metadata``
  says when, and ``gagar_jax.data.environments`` does it in the sandbox.
"""

from __future__ import annotations

import configparser
import posixpath
import re
import tomllib
from collections.abc import Iterable, Mapping

# Names of the extras and dependency groups that hold a project's test requirements.
TEST_EXTRAS = ("test", "tests", "testing", "dev", "develop")
_TEST_NAMES = frozenset({"test", "tests", "testing"})
# Requirements the verifier supplies itself at its own versions (its outcome plugin is tested
# against them), and coverage's plugin, which it never loads; a repository's pins on them are
# dropped.
FRAMEWORK = frozenset({"pytest", "pytest-timeout", "pytest-cov"})
# Requirements files of other purposes than running the tests.
_NOT_TEST_FILES = ("doc", "lint", "update", "release", "upload", "publish", "typing", "mypy")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject(files: Mapping[str, str]) -> dict:
    text = files.get("pyproject.toml")
    if not text:
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {}


def _config(files: Mapping[str, str], name: str) -> configparser.ConfigParser | None:
    if name not in files:
        return None
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read_string(files[name])
    except configparser.Error:
        return None
    return cp


def detect_pythonpath(files: Mapping[str, str]) -> tuple[str, ...]:
    """Tree-relative directories the package under test is imported from, besides the root:
    the ``pythonpath`` of the repository's pytest configuration if it sets one, else ``src``
    when the packages live there (``src/<pkg>/__init__.py``)."""
    ini = _pyproject(files).get("tool", {}).get("pytest", {}).get("ini_options", {})
    pp = ini.get("pythonpath") if isinstance(ini, dict) else None
    if isinstance(pp, str):
        pp = pp.split()
    if isinstance(pp, list) and pp:
        return tuple(str(p).strip("/") for p in pp if str(p).strip("/") not in ("", "."))
    sections = (("pytest.ini", "pytest"), ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest"))
    for name, section in sections:
        cp = _config(files, name)
        pp = cp.get(section, "pythonpath", fallback="").split() if cp else []
        if pp:
            return tuple(p.strip("/") for p in pp if p.strip("/") not in ("", "."))
    if any(re.fullmatch(r"src/\w+/__init__\.py", p) for p in files):
        return ("src",)
    return ()


def project_name(files: Mapping[str, str]) -> str:
    """The distribution name the tree declares (pyproject ``[project].name`` or setup.cfg
    ``[metadata] name``), canonicalised; "" when only setup.py knows it."""
    name = _pyproject(files).get("project", {}).get("name")
    if isinstance(name, str) and name:
        return _canonical(name)
    cp = _config(files, "setup.cfg")
    if cp is not None and cp.get("metadata", "name", fallback=""):
        return _canonical(cp.get("metadata", "name"))
    return ""


def _lines(raw: str) -> list[str]:
    return [ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _requirements_file(files: Mapping[str, str], path: str, seen: set[str]) -> list[str]:
    """PEP 508 lines of one requirements file, following ``-r`` includes; options, editable
    and local paths (``-e .``, ``.``), URLs and hash flags are left out."""
    if path in seen or path not in files:
        return []
    seen.add(path)
    out = []
    for ln in _lines(files[path]):
        ln = ln.split(" #", 1)[0].strip()
        m = re.match(r"^(-r|--requirement)\s*(\S+)", ln)
        if m:
            out += _requirements_file(
                files, posixpath.normpath(posixpath.join(posixpath.dirname(path), m[2])), seen
            )
            continue
        if ln.startswith(("-", ".", "/")) or "://" in ln:
            continue
        out.append(ln.split(" --", 1)[0].strip())
    return out


def _requirement_files(files: Mapping[str, str]) -> list[str]:
    """``requirements*.txt`` / ``*-requirements.txt`` at the root and ``*.txt`` under
    ``requirements/``; those of documentation, linting, releases and updates left out."""
    out = []
    for p in sorted(files):
        base = posixpath.basename(p)
        top = posixpath.dirname(p)
        low = base.lower()
        if not low.endswith((".txt", ".in")) or any(w in low for w in _NOT_TEST_FILES):
            continue
        if (top == "" and "requirements" in low) or top in ("requirements", "reqs"):
            out.append(p)
    return out


def _tox_deps(files: Mapping[str, str]) -> list[str]:
    cp = _config(files, "tox.ini")
    if cp is None or not cp.has_section("testenv"):
        return []
    out = []
    for ln in _lines(cp.get("testenv", "deps", fallback="")):
        if "{" in ln or re.match(r"^[\w,.-]+:\s", ln):  # substitutions, factor-conditional
            continue
        m = re.match(r"^(-r|--requirement)\s*(\S+)", ln)
        if m:
            out += _requirements_file(files, posixpath.normpath(m[2]), set())
        elif not ln.startswith(("-", ".", "/")) and "://" not in ln:
            out.append(ln)
    return out


def _groups(pyproject: dict) -> dict[str, list]:
    groups = pyproject.get("dependency-groups", {})
    return groups if isinstance(groups, dict) else {}


def _group(groups: Mapping[str, list], name: str, seen: set[str]) -> list[str]:
    """One PEP 735 group's requirements, ``{include-group = ...}`` expanded."""
    if name in seen:
        return []
    seen.add(name)
    out = []
    for item in groups.get(name) or ():
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("include-group"), str):
            out += _group(groups, item["include-group"], seen)
    return out


def _extras(files: Mapping[str, str]) -> dict[str, list[str]]:
    """``{extra: requirements}`` from pyproject's optional-dependencies and setup.cfg."""
    out: dict[str, list[str]] = {}
    opt = _pyproject(files).get("project", {}).get("optional-dependencies", {})
    if isinstance(opt, dict):
        for k, v in opt.items():
            if isinstance(v, list):
                out.setdefault(_canonical(k), []).extend(str(r) for r in v)
    cp = _config(files, "setup.cfg")
    if cp is not None and cp.has_section("options.extras_require"):
        for k, v in cp.items("options.extras_require"):
            out.setdefault(_canonical(k), []).extend(_lines(v))
    return out


def needs_backend_metadata(files: Mapping[str, str]) -> bool:
    """Whether only the build backend knows the runtime dependencies: a ``setup.py`` with no
    static declaration, or a ``[project]`` that lists ``dependencies`` as dynamic."""
    project = _pyproject(files).get("project")
    if isinstance(project, dict):
        return "dependencies" in (project.get("dynamic") or ())
    cp = _config(files, "setup.cfg")
    if cp is not None and cp.has_option("options", "install_requires"):
        return False
    return "setup.py" in files


def _bare(req: str) -> str:
    """``req`` without its version specifiers (name, extras and marker kept)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        r = Requirement(req)
    except InvalidRequirement:
        return req
    r.specifier = type(r.specifier)()
    return str(r)


def declared_requirements(
    files: Mapping[str, str],
    extras: Iterable[str] = TEST_EXTRAS,
    runtime: Iterable[str] = (),
) -> list[str]:
    """Every requirement the tree declares for running its tests (see the module docstring),
    deduplicated in order of appearance, the test framework and the project itself left out.

    The project's own declarations (``[project]``, setup.cfg, the test extras and groups, or
    ``runtime``) are kept as written. Requirements files and tox ``deps`` often pin whole
    environments, one file per Python version: a name they pin in two different ways, or that
    the project declares itself, keeps the project's declaration or else its name alone.

    Args:
      files: the repository tree.
      extras: the extras and dependency groups that hold test requirements (the first of
        ``TEST_EXTRAS``' test names present are taken; ``dev``/``develop`` only when no
        test-named one exists).
      runtime: runtime requirements from the build backend's metadata (setup.py), used in
        place of the static ``[project]``/``setup.cfg`` ones when given.
    """
    pyproject = _pyproject(files)
    self_name = project_name(files)
    all_extras = _extras(files)
    groups = _groups(pyproject)
    want = {_canonical(e) for e in extras}
    present = set(all_extras) | {_canonical(g) for g in groups}
    if want & present & _TEST_NAMES:
        want -= {"dev", "develop"}
    reqs: list[str] = list(runtime)
    if not reqs:
        deps = pyproject.get("project", {}).get("dependencies")
        if isinstance(deps, list):
            reqs += [str(d) for d in deps]
        cp = _config(files, "setup.cfg")
        if cp is not None:
            reqs += _lines(cp.get("options", "install_requires", fallback=""))
            reqs += _lines(cp.get("options", "tests_require", fallback=""))
    for name, items in all_extras.items():
        if name in want:
            reqs += items
    seen_groups: set[str] = set()
    for name in groups:
        if _canonical(name) in want:
            reqs += _group(groups, name, seen_groups)
    loose: list[str] = []
    seen_files: set[str] = set()
    for path in _requirement_files(files):
        loose += _requirements_file(files, path, seen_files)
    loose += _tox_deps(files)
    out: dict[str, list[str]] = {}  # canonical name -> its requirement strings
    own: set[str] = set()
    expanded: set[str] = set()
    queue = [(r, True) for r in reqs] + [(r, False) for r in loose]
    while queue:
        r, authoritative = queue.pop(0)
        r = r.strip()
        m = _NAME.match(r)
        if not m:
            continue
        name = _canonical(m[1])
        if name in FRAMEWORK:
            continue
        if self_name and name == self_name:  # pkg[extra]: that extra's requirements
            rest = r[m.end() :].lstrip()
            named = rest[1:].split("]", 1)[0] if rest.startswith("[") else ""
            for extra in (_canonical(e) for e in re.findall(r"[\w.-]+", named)):
                if extra not in expanded:
                    expanded.add(extra)
                    queue += [(x, authoritative) for x in all_extras.get(extra, [])]
            continue
        if authoritative:
            own.add(name)
        elif name in own:
            continue
        if r not in out.setdefault(name, []):
            out[name].append(r)
    result = []
    for name, rs in out.items():
        if len(rs) > 1 and name not in own:  # pinned two ways by requirements files
            rs = list(dict.fromkeys(_bare(r) for r in rs))[:1]
        result += rs
    return result
