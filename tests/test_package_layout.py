"""The package layering: every import of one of our packages, function bodies included, against
the architecture table's "depends on" column (docs/concepts/architecture.md)."""

import ast
import functools
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gagar_jax")

# The "depends on" column, our packages only (jax, optax, httpx, ... are not checked here). A
# package may import what it lists and, transitively, what those list.
DEPENDS_ON = {
    "advantages": set(),
    "losses": set(),
    "models": set(),
    "update": {"models", "losses", "advantages"},
    "rollout": {"models"},
    "verify": set(),
    "grading": {"rollout", "verify", "advantages", "update"},
    "envs": {"verify", "rollout", "grading"},
    "data": {"verify", "rollout", "envs"},
    "rl": {
        "advantages",
        "losses",
        "models",
        "update",
        "rollout",
        "verify",
        "grading",
        "envs",
        "data",
        "analysis",
    },
    "feedback": {"update", "losses", "data", "envs", "analysis"},
    "analysis": set(),
}


# Top-level modules (``gagar_jax/<name>.py``) that import no package of ours: any package may
# import them (``host_cpu`` prepares the process before JAX starts its backend).
LEAF_MODULES = {"host_cpu"}


# Command-line entry points whose name puts them in a lower package but which drive the whole
# experiment (``python -m gagar_jax.verify.rescore RUN_DIR`` rebuilds a run's tasks from its
# config): the lazy imports inside them, of these packages only, are the one exception.
ENTRY_POINTS = {"verify/rescore.py": {"rl", "envs"}}


def closure(package):
    """What ``package`` may import: its listed dependencies and, transitively, theirs."""
    seen, todo = set(), list(DEPENDS_ON[package])
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(DEPENDS_ON.get(p, ()))
    return seen


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    return rel[:-1] if rel[-1] == "__init__" else rel


def imported_packages(path):
    """``{(our package, line)}`` for every import in the file at ``path``, anywhere in it."""
    mod = _module_name(path)
    is_init = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                base = mod if is_init else mod[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "gagar_jax":
                names = [f"gagar_jax.{a.name}" for a in node.names]
            else:
                names = [target]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "gagar_jax" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


@functools.cache
def package_imports():
    """``{(package, dependency): [file:line, ...]}`` over every module of gagar_jax."""
    edges = {}
    for dirpath, _, files in os.walk(PACKAGE):
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(dirpath, fname)
            parts = os.path.relpath(path, PACKAGE).split(os.sep)
            if len(parts) < 2:  # gagar_jax/__init__.py
                continue
            pkg = parts[0]
            rel = os.path.relpath(path, PACKAGE)
            for dep, line in imported_packages(path):
                if dep != pkg and dep not in ENTRY_POINTS.get(rel.replace(os.sep, "/"), ()):
                    edges.setdefault((pkg, dep), []).append(f"{rel}:{line}")
    return edges


def test_every_package_is_in_the_table():
    packages = {
        d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))
    }
    assert packages == set(DEPENDS_ON)


@pytest.mark.parametrize("package", sorted(DEPENDS_ON))
def test_imports_follow_the_table(package):
    allowed = closure(package) | LEAF_MODULES
    edges = package_imports()
    wrong = {
        dep: where for (pkg, dep), where in edges.items() if pkg == package and dep not in allowed
    }
    assert not wrong, f"{package}/ imports {sorted(wrong)} (allowed: {sorted(allowed)}): {wrong}"


def test_the_table_is_acyclic():
    """No package reaches itself through what it may import (the layers have an order)."""
    looping = [p for p in DEPENDS_ON if p in closure(p)]
    assert not looping, f"packages on a dependency cycle: {sorted(looping)}"


def test_no_package_is_imported_by_name_at_run_time():
    """Imports of our packages are import statements the checker above sees, never a module
    name handed to ``importlib.import_module`` or ``__import__``."""
    found = []
    for dirpath, _, files in os.walk(PACKAGE):
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(dirpath, fname)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                arg = node.args[0]
                if (
                    name in ("import_module", "__import__")
                    and isinstance(arg, ast.Constant)
                    and str(arg.value).startswith("gagar_jax")
                ):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not found, found


def test_the_checker_sees_function_bodies_and_relative_imports(tmp_path):
    pkg = tmp_path / "gagar_jax" / "grading"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import late\n")
    (pkg / "late.py").write_text(
        "def f():\n    from gagar_jax.envs import toy\n\n"
        "def g():\n    from ..rl import train\n    import gagar_jax.data.audit\n"
    )
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        got = imported_packages(str(pkg / "late.py"))
        init = imported_packages(str(pkg / "__init__.py"))
    finally:
        ROOT = old
    assert got == {("envs", 2), ("rl", 5), ("data", 6)}
    assert init == {("grading", 1)}


def test_docs_table_matches():
    """docs/concepts/architecture.md's table says what DEPENDS_ON says."""
    with open(os.path.join(ROOT, "docs", "concepts", "architecture.md"), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        name = re.match(r"`(\w+)/`", cells[0]).group(1)
        deps = set(re.findall(r"`(\w+)/`", cells[-1]))
        table[name] = deps
    expected = {k: v for k, v in DEPENDS_ON.items() if k != "rl"}
    assert {k: v for k, v in table.items() if k != "rl"} == expected


def test_update_library_imports_no_experiment_package():
    """``gagar_jax.update`` loads without envs/grading/rollout/rl (the table's order), in a
    fresh interpreter."""
    code = (
        "import sys, gagar_jax.update, gagar_jax.update.sft\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in "
        "(['gagar_jax', p] for p in ('envs', 'grading', 'rollout', 'rl', 'verify', 'data')))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def _loaded_in_fresh_interpreter(code, packages):
    """Runs ``code`` in a fresh interpreter; the modules of ``packages`` it loaded."""
    probe = (
        f"{code}\nimport sys\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
        f"(['gagar_jax', p] for p in {tuple(packages)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_grader_harness_reads_its_sets_without_any_family():
    """``grading.eval`` and the stored ``toy`` and ``repo`` sets load with no task family,
    task data or experiment imported: on the task side grading stands on ``verify/`` alone."""
    code = (
        "from gagar_jax.grading import eval as e, labelled\n"
        "for name in ('toy', 'repo'):\n"
        "    s = labelled.load_set(name)\n"
        "    assert s.groups and e.make_grader('scripted', name) is not None\n"
    )
    assert _loaded_in_fresh_interpreter(code, ("envs", "data", "feedback", "rl")) == "[]"


def test_the_families_load_without_the_task_data():
    code = "import gagar_jax.envs.families, gagar_jax.envs.labelled_sets, gagar_jax.envs.llm_user"
    assert _loaded_in_fresh_interpreter(code, ("data", "feedback", "rl", "analysis")) == "[]"


def test_no_test_skips_itself_when_an_import_fails():
    """Every dependency of the tests is installed by ``make setup``: a missing one (or a broken
    module of ours) must fail the run, never turn a whole file into skips."""
    tests = os.path.join(ROOT, "tests")
    offenders = []
    for name in sorted(os.listdir(tests)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(tests, name), encoding="utf-8") as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
            ):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, f"importorskip in {offenders}"


@pytest.mark.parametrize("module", sorted(LEAF_MODULES))
def test_leaf_modules_import_no_package_of_ours(module):
    """What every package may import must itself stand on nothing of ours."""
    path = os.path.join(PACKAGE, f"{module}.py")
    assert os.path.isfile(path), path
    assert not imported_packages(path), sorted(imported_packages(path))
