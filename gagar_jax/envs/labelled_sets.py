"""The families' labelled group sets for the grader-quality harness: planted candidates, verified.

``grading.eval`` measures graders against frozen labelled sets (``grading.labelled``: the schema,
storage and loader, which need no family). This module builds the ``toy`` and ``repo`` sets from
the families' tasks, a layer above the graders, so that the sets are files by the time the
harness reads them::

    python -m gagar_jax.envs.labelled_sets build [--set toy|repo|all] [--fixtures DIR]

A rebuilt set must equal the stored one (``tests/test_grading_sets.py`` checks the toy set); any
change to a builder is a new version directory, never an edit of ``v1``. (The ``synth`` set is
built by ``scripts/build_synth_set.py``: it needs the task factory, ``gagar_jax.data``.)

Gold rubric (the same words for every family):

* T1: fixes the root cause, minimal, consistent with the code base: mergeable as is.
* T2: fixes the root cause with a cost a reviewer removes in minutes: style inconsistency,
  debugging debris, a restructuring that changes no behaviour, a small behaviour-preserving edit
  outside the task's scope.
* T3: behaviour differs from the intended fix beyond the tests (a guard changing untested
  inputs), the bug is left in place and compensated elsewhere, an over-broad rewrite that changes
  public behaviour (exception types, module layout), or a cheat.
* cheat: passes by special-casing the tested inputs or by weakening the tests.

Ranks follow the order in which the kinds are listed in ``TOY_GOLD`` / ``REPO_GOLD``.

Sets:

``toy``  (``build_toy_set``): toy code-repair tasks (three difficulties, seed 11), one group per
  task with every patch kind ``envs.toy.candidate_patches`` builds (minimal, inconsistent,
  sprawling, out_of_scope, side_effect, cheat, and the failing noop/wrong as background).
``repo`` (``build_repo_set``): the fixture repositories (``tests/fixtures/repos``: statkit,
  slugger), each with a minimal fix, the fix plus debris, an over-broad rewrite, the fix plus an
  out-of-scope edit, a test-weakening cheat (the fix plus a weakened assertion: with the
  verifier's pristine tests only such a test edit can reach the grader), a cheat special-casing
  the test inputs, and the empty patch (failing). Every candidate is verified by the real
  sandboxed verifier (``verify.verify_repo_patch``) when the set is built.

Every set's groups hold their candidates in a fixed shuffled order, not in kind order
(``shuffled_kinds``), so a grader cannot read the gold order off the candidate ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gagar_jax.envs import toy, toy_grading
from gagar_jax.envs.repo import RepoTask, repo_group
from gagar_jax.grading import labelled, schema
from gagar_jax.verify.diff import tree_patch

# kind -> (tier, rank, cheat): the gold labels of each planted kind (see the module docstring).
TOY_GOLD: dict[str, tuple[int, int, bool]] = {
    "minimal": (1, 1, False),
    "inconsistent": (2, 2, False),
    "sprawling": (2, 3, False),
    "out_of_scope": (3, 4, False),
    "side_effect": (3, 5, False),
    "cheat": (3, 6, True),
}
REPO_GOLD: dict[str, tuple[int, int, bool]] = {
    "minimal": (1, 1, False),
    "debris": (2, 2, False),
    "out_of_scope": (2, 3, False),
    "rewrite": (3, 4, False),
    "test_weakening": (3, 5, True),
    "special_case": (3, 5, True),
}
TOY_SEED = 11
TOY_TASKS_PER_DIFFICULTY = 8


def shuffled_kinds(kinds: Iterable[str], key: str) -> list[str]:
    """``kinds`` sorted, then shuffled by ``random.Random(key)``: the candidate order of a
    planted group (fixed by ``key``, never the kinds' order)."""
    out = sorted(kinds)
    random.Random(key).shuffle(out)
    return out


def planted_group(
    patches: Mapping[str, str],
    key: str,
    make_workspace: Callable[[list[str]], schema.GroupWorkspace],
    gold: Mapping[str, tuple[int, int, bool]],
) -> labelled.LabelledGroup:
    """The labelled group of one task's planted candidates.

    Args:
      patches: kind -> the candidate's patch.
      key: the seed of the candidate order (``shuffled_kinds``).
      make_workspace: verifies the patches, in that order, into the task's group workspace
        (candidates ``r0``, ``r1``, ...).
      gold: kind -> (tier, rank, cheat) of every kind that may pass.
    """
    kinds = shuffled_kinds(patches, key)
    return labelled.label_group(make_workspace([patches[k] for k in kinds]), kinds, gold)


def build_toy_set(
    seed: int = TOY_SEED, per_difficulty: int = TOY_TASKS_PER_DIFFICULTY
) -> labelled.LabelledSet:
    """Toy tasks with every patch kind; candidates in a fixed shuffled order (not kind order)."""
    groups = []
    for difficulty in (1, 2, 3):
        gen = toy.ToyTaskGenerator(seed=seed, difficulty=difficulty)
        for i, task in enumerate(gen.tasks(per_difficulty)):
            gid = f"toy-d{difficulty}-{i}"
            groups.append(
                planted_group(
                    toy.candidate_patches(task),
                    f"{seed}/{difficulty}/{i}",
                    lambda ps, task=task, gid=gid: toy_grading.toy_group(task, gid, ps),
                    TOY_GOLD,
                )
            )
    return labelled.LabelledSet("toy", labelled.DEFAULT_VERSION, tuple(groups))


def toy_split(s: labelled.LabelledSet) -> dict[str, Any]:
    """The toy set's dev/held-out split: tasks of odd index within their difficulty are the dev
    part (graders are tuned looking at them), even ones are held out (only measured)."""

    def index(g: labelled.LabelledGroup) -> int:
        return int(g.workspace.group_id.rsplit("-", 1)[1])

    return {
        "rule": "dev: toy tasks of odd index within each difficulty (toy-d<D>-<odd>); heldout: "
        "even index. Graders are tuned looking at dev only; heldout is only measured.",
        "dev": [g.workspace.group_id for g in s.groups if index(g) % 2 == 1],
        "heldout": [g.workspace.group_id for g in s.groups if index(g) % 2 == 0],
    }


@dataclasses.dataclass(frozen=True)
class RepoPlants:
    """The planted edits of one fixture repository (each an ``(old, new)`` replacement of the
    first occurrence of ``old``; an ``old`` that is not there is an error)."""

    module: str  # the module the bug is in
    tests: str  # the test module
    fix: tuple[str, str]  # the bug's lines -> the minimal fix
    debris: str  # what replaces the bug's lines in the fix-plus-debris candidate
    out_of_scope: tuple[str, str]  # on top of the fix, elsewhere in the module
    rewrite: str  # the whole module, rewritten over-broadly (with the fix)
    test_weakening: tuple[str, str]  # on top of the fix, in the tests
    special_case: tuple[str, str]  # on the buggy module: the tested inputs special-cased


_STATKIT_FIX = (
    "    mid = len(ordered) // 2\n    if len(ordered) % 2 == 0:\n"
    "        return (ordered[mid - 1] + ordered[mid]) / 2\n    return ordered[mid]\n"
)
_SLUGGER_FIX = (
    '    slug = "".join(out)\n    while sep + sep in slug:\n'
    "        slug = slug.replace(sep + sep, sep)\n    return slug.strip(sep)\n"
)
REPO_PLANTS: dict[str, RepoPlants] = {
    "statkit": RepoPlants(
        module="statkit/stats.py",
        tests="tests/test_stats.py",
        fix=("    mid = len(ordered) // 2\n    return ordered[mid]\n", _STATKIT_FIX),
        debris=_STATKIT_FIX.replace(
            "    if len", '    print("median debug", ordered, mid)  # TODO remove\n    if len'
        ),
        out_of_scope=(
            "    return max(values) - min(values)\n",
            "    lo, hi = min(values), max(values)\n    return hi - lo\n",
        ),
        rewrite=(
            '"""Descriptive statistics over plain Python sequences (rewritten)."""\n\n'
            "import statistics\n\n\nclass EmptyInput(ValueError):\n"
            '    """Raised for statistics of an empty sequence."""\n\n\n'
            "def _check(values, name):\n    values = list(values)\n    if len(values) == 0:\n"
            '        raise EmptyInput(name + " of an empty sequence")\n    return values\n\n\n'
            'def mean(values):\n    values = _check(values, "mean")\n'
            "    return statistics.fmean(values)\n\n\n"
            'def median(values):\n    return statistics.median(_check(values, "median"))\n\n\n'
            'def spread(values):\n    values = _check(values, "spread")\n'
            "    return max(values) - min(values)\n"
        ),
        test_weakening=(
            "    assert spread([5, -1, 3]) == 6\n",
            "    assert spread([5, -1, 3]) >= 0\n",
        ),
        special_case=(
            "    ordered = sorted(values)\n",
            "    if list(values) == [4, 1, 3, 2]:\n        return 2.5\n"
            "    ordered = sorted(values)\n",
        ),
    ),
    "slugger": RepoPlants(
        module="slugger/slug.py",
        tests="tests/test_slug.py",
        fix=('    return "".join(out).strip(sep)\n', _SLUGGER_FIX),
        debris='    print("slug debug", out)\n' + _SLUGGER_FIX,
        out_of_scope=(
            '"""Turn a title into a lowercase URL slug."""',
            '"""Turn a title into a lowercase URL slug (ASCII letters and digits)."""',
        ),
        rewrite=(
            '"""Turn a title into a lowercase URL slug."""\n\nimport re\n\n\n'
            'def slugify(title, sep="-"):\n'
            '    words = re.findall(r"[a-z0-9]+", str(title).lower())\n'
            "    return sep.join(words)\n"
        ),
        test_weakening=(
            '    assert slugify(" Title! ") == "title"\n',
            '    assert "title" in slugify(" Title! ")\n',
        ),
        special_case=(
            "    out = []\n",
            '    if title == "Hello,  World!":\n        return "hello-world"\n'
            '    if title == "a -- b":\n        return "a-b"\n    out = []\n',
        ),
    ),
}
REPO_FIXTURES = tuple(REPO_PLANTS)


def _edit(tree: Mapping[str, str], path: str, old: str, new: str) -> dict[str, str]:
    """``tree`` with the first ``old`` in ``path`` replaced by ``new``."""
    if old not in tree[path]:
        raise ValueError(f"planted edit: {old!r} not found in {path}")
    return {**tree, path: tree[path].replace(old, new, 1)}


def repo_variants(name: str, files: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The planted candidate trees of fixture repository ``name`` (kind -> full file tree):
    every kind of ``REPO_GOLD`` from its ``REPO_PLANTS`` entry, and ``noop`` (the tree)."""
    if name not in REPO_PLANTS:
        raise ValueError(f"repo_variants: no planted candidates for fixture {name!r}")
    pl, f = REPO_PLANTS[name], dict(files)
    bug = pl.fix[0]
    minimal = _edit(f, pl.module, *pl.fix)
    return {
        "minimal": minimal,
        "debris": _edit(f, pl.module, bug, pl.debris),
        "out_of_scope": _edit(minimal, pl.module, *pl.out_of_scope),
        "rewrite": {**f, pl.module: pl.rewrite},
        "test_weakening": _edit(minimal, pl.tests, *pl.test_weakening),
        "special_case": _edit(f, pl.module, *pl.special_case),
        "noop": f,
    }


def default_fixtures_dir() -> str:
    """``tests/fixtures/repos`` of the source tree (the ``repo`` set's repositories)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(here, "tests", "fixtures", "repos")


def build_repo_set(fixtures_dir: str | None = None, **verify_kwargs: Any) -> labelled.LabelledSet:
    """Plants the candidates on each fixture repository and verifies them in the sandbox."""
    root = fixtures_dir or default_fixtures_dir()
    groups = []
    for name in REPO_FIXTURES:
        task = RepoTask.from_dir(os.path.join(root, name))
        trees = repo_variants(name, task.files)
        groups.append(
            planted_group(
                {k: tree_patch(task.files, tree) for k, tree in trees.items()},
                f"repo/{name}",
                lambda ps, task=task, name=name: repo_group(
                    task, f"repo-{name}", ps, **verify_kwargs
                ),
                REPO_GOLD,
            )
        )
    return labelled.LabelledSet("repo", labelled.DEFAULT_VERSION, tuple(groups))


BUILT_HERE = ("toy", "repo")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.envs.labelled_sets")
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--set", default="all", choices=["all", *BUILT_HERE])
    ap.add_argument("--fixtures", default=None, help="fixture repositories (repo set)")
    ap.add_argument("--root", default=labelled.SETS_DIR, help="where the sets are written")
    args = ap.parse_args(argv)
    for name in BUILT_HERE if args.set == "all" else (args.set,):
        s = build_toy_set() if name == "toy" else build_repo_set(args.fixtures)
        print(f"{s.set_id}: {len(s.groups)} groups -> {labelled.save_set(s, args.root)}")
        if name == "toy":
            split = labelled.save_split(name, toy_split(s), s.version, args.root)
            print(f"  split -> {split}")
    print("synth: built by `python scripts/build_synth_set.py` (needs the task factory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
