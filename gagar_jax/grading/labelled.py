"""Labelled group sets: frozen grading workspaces with gold tiers, ranks and cheat labels.

A labelled set is what the grader-quality harness (``grading.eval``) measures graders against.
Each group is a ``GroupWorkspace`` exactly as a grader would receive it (the verifier's test logs
and behaviour-monitor flags included) plus, for every passing candidate, a ``Gold`` label: tier
(1..3, T1 best), rank within the group (1 best, ties allowed), cheat, and the candidate's kind.

Sets are versioned data under ``gagar_jax/grading/sets/<name>/<version>/groups.jsonl`` (one JSON
object per group) and are read by ``load_set``: this module is the sets' schema and storage, and
reads them without any task family. They are built from the families' planted candidates a layer
above, by ``gagar_jax.envs.labelled_sets`` (``toy``, ``repo``; its module docstring has the gold
rubric and the planted kinds)::

    python -m gagar_jax.envs.labelled_sets build [--fixtures tests/fixtures/repos]

and by ``scripts/build_synth_set.py`` (``synth``: the task factory's tasks, stored as recipes,
``grading.synth_set``). A rebuilt set must equal the stored one (``tests/test_grading_sets.py``
checks the toy set); any change to a builder is a new version directory, never an edit of
``v1``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.grading import schema, synth_set

SETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sets")
SET_NAMES = ("toy", "repo", "synth")
DEFAULT_VERSION = "v1"


@dataclasses.dataclass(frozen=True)
class Gold:
    """The gold label of one passing candidate."""

    tier: int
    rank: int
    cheat: bool
    kind: str

    def __post_init__(self):
        if not (isinstance(self.tier, int) and 1 <= self.tier <= schema.NUM_TIERS):
            raise ValueError(f"Gold.tier: expected an int in 1..3, got {self.tier!r}")
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"Gold.rank: expected an int >= 1, got {self.rank!r}")


@dataclasses.dataclass(frozen=True)
class LabelledGroup:
    """A grading workspace and the gold label of each passing candidate (and each kind)."""

    workspace: schema.GroupWorkspace
    gold: Mapping[str, Gold]
    kinds: Mapping[str, str]  # every candidate id -> its planted kind (failing ones included)
    # where the repository comes from when it is not stored (``synth_set.rebuild_files``)
    source: Mapping[str, Any] | None = None

    def __post_init__(self):
        passing = {c.candidate_id for c in self.workspace.passing}
        if set(self.gold) != passing:
            raise ValueError(
                f"LabelledGroup {self.workspace.group_id!r}: gold labels for {sorted(self.gold)},"
                f" but the passing candidates are {sorted(passing)}"
            )


@dataclasses.dataclass(frozen=True)
class LabelledSet:
    name: str
    version: str
    groups: tuple[LabelledGroup, ...]

    @property
    def set_id(self) -> str:
        return f"{self.name}@{self.version}"


# ------------------------------------------------------------------------------------------------
# (de)serialisation
# ------------------------------------------------------------------------------------------------


def _candidate_to_dict(c: schema.Candidate) -> dict[str, Any]:
    return {
        "candidate_id": c.candidate_id,
        "patch": c.patch,
        "passed": c.passed,
        "test_log": c.test_log,
        "summary": c.summary,
        "trajectory": [dataclasses.asdict(e) for e in c.trajectory],
        "monitor_flags": [dataclasses.asdict(f) for f in c.monitor_flags],
        "quality": dict(sorted(c.quality.items())),
    }


def workspace_to_dict(ws: schema.GroupWorkspace) -> dict[str, Any]:
    return {
        "group_id": ws.group_id,
        "task_text": ws.task_text,
        "repo_files": dict(sorted(ws.repo_files.items())),
        "scope_files": list(ws.scope_files),
        "candidates": [_candidate_to_dict(c) for c in ws.candidates],
    }


def workspace_from_dict(d: Mapping[str, Any]) -> schema.GroupWorkspace:
    for key in ("group_id", "task_text", "repo_files", "candidates"):
        if key not in d:
            raise ValueError(f"workspace record: missing field {key!r}")
    cands = tuple(schema.Candidate(**c) for c in d["candidates"])
    return schema.GroupWorkspace(
        d["group_id"], d["task_text"], d["repo_files"], cands, tuple(d.get("scope_files", ()))
    )


def group_to_dict(g: LabelledGroup) -> dict[str, Any]:
    """The stored record; a group with a ``source`` stores no repository files (they are
    rebuilt from the registry when the set is loaded) and stores its ``rewrite`` candidates'
    patches as recipes (``synth_set.store_candidates``)."""
    out = workspace_to_dict(g.workspace) | {
        "gold": {cid: dataclasses.asdict(x) for cid, x in sorted(g.gold.items())},
        "kinds": dict(sorted(g.kinds.items())),
    }
    if g.source is not None:
        out["candidates"] = synth_set.store_candidates(
            out["candidates"], g.kinds, g.workspace.repo_files, g.workspace.group_id
        )
        out["repo_files"] = {}
        out["source"] = dict(sorted(g.source.items()))
    return out


def group_from_dict(d: Mapping[str, Any], cache_dir: str | None = None) -> LabelledGroup:
    """A stored record as a group; one with a ``source`` has its repository rebuilt and its
    recipes made into patches (``synth_set``; ``cache_dir``: the source distributions' cache)."""
    for key in ("gold", "kinds"):
        if key not in d:
            raise ValueError(f"labelled group: missing field {key!r}")
    gold = {cid: Gold(**x) for cid, x in d["gold"].items()}
    source = d.get("source")
    if source is not None:
        files = synth_set.rebuild_files(source, cache_dir)
        cands = synth_set.load_candidates(d["candidates"], d["kinds"], files, d.get("group_id"))
        d = dict(d, repo_files=files, candidates=cands)
    return LabelledGroup(workspace_from_dict(d), gold, dict(d["kinds"]), source)


def set_path(name: str, version: str = DEFAULT_VERSION, root: str = SETS_DIR) -> str:
    return os.path.join(root, name, version, "groups.jsonl")


def save_set(s: LabelledSet, root: str = SETS_DIR) -> str:
    path = set_path(s.name, s.version, root)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for g in s.groups:
            f.write(json.dumps(group_to_dict(g), sort_keys=True) + "\n")
    return path


SPLITS = ("all", "dev", "heldout")


def split_path(name: str, version: str = DEFAULT_VERSION, root: str = SETS_DIR) -> str:
    return os.path.join(root, name, version, "split.json")


def save_split(name: str, split: Mapping[str, Any], version: str, root: str = SETS_DIR) -> str:
    path = split_path(name, version, root)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dict(split), f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def select_split(s: LabelledSet, split: str, root: str = SETS_DIR) -> LabelledSet:
    """The ``split`` part (``SPLITS``) of a stored set, per its ``split.json``; ``all``: the set.

    The returned set's version reads ``<version>:<split>`` so rows name what they measured."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if split == "all":
        return s
    path = split_path(s.name, s.version, root)
    if not os.path.exists(path):
        raise ValueError(f"labelled set {s.set_id} has no dev/heldout split ({path} missing)")
    with open(path, encoding="utf-8") as f:
        ids = set(json.load(f)[split])
    groups = tuple(g for g in s.groups if g.workspace.group_id in ids)
    return LabelledSet(s.name, f"{s.version}:{split}", groups)


def load_set(
    name: str, version: str = DEFAULT_VERSION, root: str = SETS_DIR, split: str = "all"
) -> LabelledSet:
    """Reads a stored set (its ``split`` part, see ``select_split``); an unknown name or version
    is an error listing the stored ones."""
    path = set_path(name, version, root)
    if not os.path.exists(path):
        have = sorted(os.listdir(root)) if os.path.isdir(root) else []
        raise ValueError(
            f"labelled set {name!r} version {version!r} not found at {path}; stored sets: {have}"
        )
    with open(path, encoding="utf-8") as f:
        groups = tuple(group_from_dict(json.loads(line)) for line in f if line.strip())
    return select_split(LabelledSet(name, version, groups), split, root)


def label_group(
    ws: schema.GroupWorkspace, kinds: Sequence[str], gold: Mapping[str, tuple[int, int, bool]]
) -> LabelledGroup:
    """The labelled group of ``ws`` whose candidates are, in order, of the planted ``kinds``;
    ``gold``: kind -> (tier, rank, cheat). A passing candidate of a kind ``gold`` does not label
    is an error naming the group and the kind (a failing one needs no label)."""
    if len(kinds) != len(ws.candidates):
        raise ValueError(
            f"group {ws.group_id!r}: {len(kinds)} kinds for {len(ws.candidates)} candidates"
        )
    kind_of = {c.candidate_id: k for c, k in zip(ws.candidates, kinds)}
    labels = {}
    for c in ws.passing:
        k = kind_of[c.candidate_id]
        if k not in gold:
            raise ValueError(f"group {ws.group_id!r}: passing candidate of unlabelled kind {k!r}")
        tier, rank, cheat = gold[k]
        labels[c.candidate_id] = Gold(tier, rank, cheat, k)
    return LabelledGroup(ws, labels, kind_of)
