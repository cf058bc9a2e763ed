"""Builds the ``synth`` labelled set of the grader-quality harness.

    python scripts/build_synth_set.py [--version v1] [--pool DIR] [--cache DIR]

Runs the task factory (``gagar_jax.data.synth``) on ``grading.synth_set.SYNTH_PACKAGES``,
plants the candidate kinds of ``grading.synth_set`` on every task, verifies each candidate in the
sandboxed verifier and writes ``gagar_jax/grading/sets/synth/<version>/groups.jsonl``: labels,
patches and verifier outputs, never the package's files (rebuilt from the registry's source
distribution when the set is loaded) nor a patch re-emitting one of its modules (each ``rewrite``
candidate is stored as a recipe, ``synth_set.store_candidates``, checked here to make its patch
again on the rebuilt repository). ``--pool``: use a factory output made earlier
(``python -m gagar_jax.data.synth --packages toolz==1.0.0 --out DIR``). About 3 minutes for the
six toolz tasks on a loaded 2-core machine (the factory about 1.5, the verification about 1.5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from gagar_jax.data import swe, synth
from gagar_jax.envs import labelled_sets
from gagar_jax.envs.repo import repo_group, repo_workspace
from gagar_jax.grading import labelled, synth_set
from gagar_jax.verify.diff import tree_patch


def build_synth_set(
    packages: Sequence[str] = synth_set.SYNTH_PACKAGES,
    *,
    tasks_per_package: int = synth_set.SYNTH_TASKS_PER_PACKAGE,
    cache_dir: str | None = None,
    work_dir: str | None = None,
    pool_dir: str | None = None,
    log=print,
    **verify_kwargs: Any,
):
    """Runs the task factory on ``packages``, plants the candidates on every task, verifies
    them in the sandbox and keeps the kinds that behave as named (gold kinds pass without a
    confirmed monitor flag, cheats pass, the empty patch fails). ``pool_dir``: the factory's
    output for ``packages`` made earlier (``instances.jsonl`` and ``repos/``), used as is."""
    work = pool_dir or work_dir or tempfile.mkdtemp(prefix="gagar_synth_set_")
    instances = os.path.join(work, "instances.jsonl")
    if pool_dir is None:
        with open(instances, "w", encoding="utf-8") as f:
            for spec in packages:
                rows, _ = synth.make_package_tasks(
                    spec, work, max_tasks=tasks_per_package, cache_dir=cache_dir, log=log
                )
                f.writelines(json.dumps(row) + "\n" for row in rows)
    groups = []
    for spec in packages:
        repo = "pypi/" + spec.split("==")[0]
        path = os.path.join(work, f"{spec.split('==')[0]}.jsonl")
        with open(instances, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as g:
            g.writelines(ln for ln in f if json.loads(ln)["repo"] == repo)
        pristine = synth_set.pristine_files(spec, cache_dir)
        for task in swe.load_tasks(path, os.path.join(work, "repos"), cache_dir=cache_dir):
            try:
                trees = synth_set.plant(task)
            except ValueError as e:
                log(f"{task.task_id}: skipped ({e})")
                continue
            kinds = labelled_sets.shuffled_kinds(trees, f"synth/{task.task_id}")
            patches = [tree_patch(task.files, trees[k]) for k in kinds]
            ws = repo_group(task, f"synth-{task.task_id}", patches, **verify_kwargs)
            keep = []
            for c, k in zip(ws.candidates, kinds):
                confirmed = any(f.confirmed for f in c.monitor_flags)
                gold = labelled_sets.REPO_GOLD.get(k)
                ok = (
                    (not c.passed)
                    if k == "noop"
                    else c.passed and (gold is not None and (gold[2] or not confirmed))
                )
                log(f"{task.task_id} {k}: passed={c.passed} flags={confirmed} kept={ok}")
                if ok:
                    keep.append((c, k))
            if not any(k == "minimal" for _, k in keep):
                continue
            ws = repo_workspace(task, ws.group_id, [c for c, _ in keep])
            lg = labelled.label_group(ws, [k for _, k in keep], labelled_sets.REPO_GOLD)
            source = {
                "package": spec,
                "bug_patch": tree_patch(pristine, task.files),
                "task_id": task.task_id,
                "fail_to_pass": list(task.fail_to_pass),
                "pass_to_pass": list(task.pass_to_pass),
                "test_files": list(task.test_files),
            }
            if synth_set.rebuild_files(source, cache_dir) != dict(task.files):
                raise RuntimeError(
                    f"{task.task_id}: the release plus the bug patch is not the task"
                )
            group = dataclasses.replace(lg, source=source)
            # The stored record: rewrite patches become recipes (an error if one cannot).
            loaded = labelled.group_from_dict(labelled.group_to_dict(group), cache_dir)
            if [c.patch for c in loaded.workspace.candidates] != [c.patch for c in ws.candidates]:
                raise RuntimeError(f"{task.task_id}: the stored patches do not load as built")
            groups.append(group)
    return groups


def build_set(version: str = "v1", **kwargs: Any) -> labelled.LabelledSet:
    """``build_synth_set`` as a ``labelled.LabelledSet`` named ``synth``."""
    return labelled.LabelledSet("synth", version, tuple(build_synth_set(**kwargs)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default="v1", help="the set version written")
    ap.add_argument("--pool", default=None, help="the task factory's output, made earlier")
    ap.add_argument("--cache", default=None, help="sdist and environment cache")
    ap.add_argument("--root", default=labelled.SETS_DIR, help="where the sets are written")
    args = ap.parse_args(argv)
    s = build_set(args.version, pool_dir=args.pool, cache_dir=args.cache)
    print(f"{s.set_id}: {len(s.groups)} groups -> {labelled.save_set(s, args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
