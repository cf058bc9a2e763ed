"""TFDS builders for task pools: the toy code-repair family and Python repository tasks.

Both write ``array_record`` files and are read with random access through
``tfds.data_source`` (or ``builder.as_data_source()``): no TensorFlow is needed to build or to
read (only ``as_dataset()`` would need it). Text comes back as ``bytes``; ``toy_task_from_record``
and ``repo_task_from_record`` turn a record back into the dataclass the verifiers take.

``toy_tasks``: configs ``d1``, ``d2``, ``d3`` (difficulty; seed 0; 1000 train / 200 test tasks).
The test split uses another seed (``seed + TEST_SEED_OFFSET``), so it never repeats a train task.
Build a custom pool with ``ToyTasks(config=ToyTasksConfig(name=..., ...), data_dir=...)``.

``repo_tasks``: reads ``<split>.jsonl`` files (``train``, ``validation``, ``test``; whichever
exist) from the manual directory, one ``RepoTask.to_dict()`` JSON object per line::

    builder = RepoTasks(data_dir=out_dir)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=jsonl_dir))
    tasks = [repo_task_from_record(r) for r in builder.as_data_source()["train"]]

Audit results and pass rates (optional, per task): a ``<split>.jsonl`` line may be a
``PoolEntry`` object (``{"task": ..., "precheck": ..., "audit": ..., "attempts": [...]}``, the
lines :func:`gagar_jax.data.audit.save_pool` writes) instead of a bare task, and an optional
``audit.jsonl`` in the manual directory holds more of them (``save_pool`` output, or lines
``{"task_id": ..., "precheck": ..., "audit": ..., "attempts": ...}``); for a task it names, it
replaces what the split line carried. Every record has the fields of :data:`AUDIT_DEFAULTS`
(a task without audit results reads back with exactly those defaults; ``toy_tasks`` records have
them too, from ``ToyTasksConfig.audit_path``), so a built pool can be filtered by them without
parsing anything (``r["precheck_ok"]``, ``r["underspecification"]``,
``r["pass_rate"]``); :func:`pool_entry_from_record` rebuilds the ``PoolEntry`` for
:func:`gagar_jax.data.audit.filter_tasks`.

Records are validated while building (a malformed line fails the build naming file and line).
Shuffling is disabled: record ``i`` of a toy split is ``ToyTaskGenerator(...).task(i)`` and repo
records keep the JSONL order, so a data position is just an index.

Dependency note: tensorflow-datasets 4.9.10 imports ``importlib_resources`` when it locates a
builder defined outside its own package (it declares it only for Python < 3.9), so the ``data``
extra lists it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils.epath import Path as epath

from gagar_jax.data.audit import AuditReport, PoolEntry, TaskAudit
from gagar_jax.envs.repo import RepoTask
from gagar_jax.envs.toy import ToyTask, ToyTaskGenerator

TEST_SEED_OFFSET = 1_000_003
REPO_SPLITS = ("train", "validation", "test")


def _text(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes | np.bytes_) else str(x)


# ----------------------------------------------------------------------------------------------
# Toy tasks
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class ToyTasksConfig(tfds.core.BuilderConfig):
    """A toy task pool: ``num_train``/``num_test`` tasks of one difficulty from one seed."""

    difficulty: int = 1
    seed: int = 0
    num_train: int = 1000
    num_test: int = 200
    audit_path: str = ""  # optional save_pool / audit JSONL: results and attempts by task_id


class ToyTasks(tfds.core.GeneratorBasedBuilder):
    """Seeded toy code-repair tasks (``gagar_jax.envs.ToyTaskGenerator``) as array_record."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "1.1.0": "Audit fields (AUDIT_DEFAULTS) from ToyTasksConfig.audit_path.",
    }
    BUILDER_CONFIGS = [
        ToyTasksConfig(name=f"d{d}", description=f"difficulty {d}", difficulty=d) for d in (1, 2, 3)
    ]

    def __init__(self, **kwargs):
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "task_id": tfds.features.Text(),
                    "difficulty": np.int32,
                    "prompt": tfds.features.Text(),
                    "source": tfds.features.Text(),
                    "tests_x": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                    "tests_y": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                    "hidden_x": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                    "hidden_y": tfds.features.Tensor(shape=(None,), dtype=np.int64),
                    "reference_patch": tfds.features.Text(),
                    "bug_line": np.int32,
                    "bug_kind": tfds.features.Text(),
                    **_audit_features(),
                }
            ),
            homepage="https://github.com/gagar-jax",
            disable_shuffling=True,  # record i of a split is task i of its generator
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if c.difficulty not in (1, 2, 3):
            raise ValueError(f"ToyTasksConfig.difficulty must be 1, 2 or 3, got {c.difficulty}")
        if c.num_train < 0 or c.num_test < 0:
            raise ValueError(
                f"ToyTasksConfig num_train/num_test must be >= 0, got {c.num_train}/{c.num_test}"
            )
        audits = _read_audits(epath(c.audit_path)) if c.audit_path else {}
        return {
            "train": self._generate_examples(c.seed, c.num_train, audits),
            "test": self._generate_examples(c.seed + TEST_SEED_OFFSET, c.num_test, audits),
        }

    def _generate_examples(self, seed: int, n: int, audits) -> Iterator[tuple[str, dict]]:
        gen = ToyTaskGenerator(seed, self.builder_config.difficulty)
        for i in range(n):
            task = gen.task(i)
            yield f"{i:08d}", toy_task_to_record(task) | audit_to_record(audits.get(task.task_id))


def toy_task_to_record(task: ToyTask) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "difficulty": task.difficulty,
        "prompt": task.prompt,
        "source": task.source,
        "tests_x": np.array([x for x, _ in task.tests], np.int64),
        "tests_y": np.array([y for _, y in task.tests], np.int64),
        "hidden_x": np.array([x for x, _ in task.hidden_tests], np.int64),
        "hidden_y": np.array([y for _, y in task.hidden_tests], np.int64),
        "reference_patch": task.reference_patch,
        "bug_line": task.bug_line,
        "bug_kind": task.bug_kind,
    }


def toy_task_from_record(r: Mapping[str, Any]) -> ToyTask:
    """The ToyTask of one ``toy_tasks`` record (as ``tfds.data_source`` returns it)."""
    return ToyTask(
        task_id=_text(r["task_id"]),
        difficulty=int(r["difficulty"]),
        prompt=_text(r["prompt"]),
        source=_text(r["source"]),
        tests=tuple(zip(map(int, r["tests_x"]), map(int, r["tests_y"]))),
        hidden_tests=tuple(zip(map(int, r["hidden_x"]), map(int, r["hidden_y"]))),
        reference_patch=_text(r["reference_patch"]),
        bug_line=int(r["bug_line"]),
        bug_kind=_text(r["bug_kind"]),
    )


# ----------------------------------------------------------------------------------------------
# Python repository tasks
# ----------------------------------------------------------------------------------------------


# The audit fields of every repo_tasks record and their values for a task without results.
AUDIT_DEFAULTS: dict[str, Any] = {
    "precheck_ran": False,  # a pre-check result is stored
    "precheck_ok": False,  # it ran and found nothing
    "precheck_reasons": [],  # its named reasons (gold_fails_f2p, flaky, ...)
    "audit_ok": False,  # an accepted (non-fallback) LLM audit is stored
    "underspecification": -1,  # the merged audit's scores 0..3; -1 = none
    "test_validity": -1,
    "audit_difficulty": "",
    "audit_category": "",
    "audit_prompt_version": "",
    "pass_rate": -1.0,  # empirical pass rate over the stored attempts; -1 = no attempts
    "num_attempts": 0,
    "attempts": [],  # the stored attempts, oldest first (True = passed)
    "precheck_json": "",  # the full AuditReport / TaskAudit as JSON ("" = none)
    "audit_json": "",
}
AUDIT_FILE = "audit.jsonl"


def _audit_features() -> dict[str, Any]:
    return {
        "precheck_ran": np.bool_,
        "precheck_ok": np.bool_,
        "precheck_reasons": tfds.features.Sequence(tfds.features.Text()),
        "audit_ok": np.bool_,
        "underspecification": np.int32,
        "test_validity": np.int32,
        "audit_difficulty": tfds.features.Text(),
        "audit_category": tfds.features.Text(),
        "audit_prompt_version": tfds.features.Text(),
        "pass_rate": np.float32,
        "num_attempts": np.int32,
        "attempts": tfds.features.Tensor(shape=(None,), dtype=np.bool_),
        "precheck_json": tfds.features.Text(),
        "audit_json": tfds.features.Text(),
    }


def audit_to_record(entry: PoolEntry | None) -> dict[str, Any]:
    """The audit fields of one record (:data:`AUDIT_DEFAULTS` for what ``entry`` lacks)."""
    r = dict(AUDIT_DEFAULTS)
    if entry is None:
        return r | {"attempts": np.zeros(0, np.bool_)}
    if entry.precheck is not None:
        r.update(
            precheck_ran=True,
            precheck_ok=bool(entry.precheck.ok),
            precheck_reasons=list(entry.precheck.reasons),
            precheck_json=json.dumps(entry.precheck.to_dict(), sort_keys=True),
        )
    if entry.audit is not None:
        r["audit_json"] = json.dumps(entry.audit.to_dict(), sort_keys=True)
        r["audit_prompt_version"] = entry.audit.prompt_version
        v = entry.audit.vote
        if v is not None:
            r.update(
                audit_ok=True,
                underspecification=int(v.underspecification),
                test_validity=int(v.test_validity),
                audit_difficulty=v.difficulty,
                audit_category=v.category,
            )
    a = [bool(x) for x in entry.attempts]
    r.update(
        attempts=np.array(a, np.bool_),
        num_attempts=len(a),
        pass_rate=sum(a) / len(a) if a else -1.0,
    )
    return r


def audit_from_record(r: Mapping[str, Any]) -> dict[str, Any]:
    """The audit fields of a record as plain Python values (keys of :data:`AUDIT_DEFAULTS`)."""
    out: dict[str, Any] = {}
    for k, default in AUDIT_DEFAULTS.items():
        v = r[k]
        if isinstance(default, bool):
            out[k] = bool(v)
        elif isinstance(default, int):
            out[k] = int(v)
        elif isinstance(default, float):
            out[k] = float(v)
        elif isinstance(default, str):
            out[k] = _text(v)
        elif k == "attempts":
            out[k] = [bool(x) for x in v]
        else:
            out[k] = [_text(x) for x in v]
    return out


def pool_entry_from_record(r: Mapping[str, Any], task_from_record=None) -> PoolEntry:
    """The ``PoolEntry`` (task, pre-check, audit, attempts) of one record; ``task_from_record``
    defaults to :func:`repo_task_from_record` (pass :func:`toy_task_from_record` for toy pools)."""
    pre, aud = _text(r["precheck_json"]), _text(r["audit_json"])
    return PoolEntry(
        (task_from_record or repo_task_from_record)(r),
        AuditReport.from_dict(json.loads(pre)) if pre else None,
        TaskAudit.from_dict(json.loads(aud)) if aud else None,
        tuple(bool(x) for x in r["attempts"]),
    )


def _audit_entry(d: Mapping[str, Any]) -> PoolEntry:
    """A PoolEntry from a ``save_pool`` line or a ``{"task_id": ...}`` audit line."""
    if "task" in d:
        return PoolEntry.from_dict(d)
    if not isinstance(d.get("task_id"), str):
        raise ValueError("an audit line needs 'task' (a save_pool line) or a string 'task_id'")
    return PoolEntry.from_dict({**d, "task": {"task_id": d["task_id"]}})


class RepoTasks(tfds.core.GeneratorBasedBuilder):
    """Python repository tasks (``gagar_jax.envs.repo.RepoTask``) from JSONL in the manual dir."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "1.1.0": "Audit fields: pre-check, LLM audit scores, pass rate and attempts per task.",
    }
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train.jsonl / validation.jsonl / test.jsonl (one RepoTask.to_dict() object, or a "
        "save_pool PoolEntry line, per line) in the manual directory, and optionally "
        "audit.jsonl (save_pool output) with audit results and attempts."
    )

    def __init__(self, **kwargs):
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "task_id": tfds.features.Text(),
                    "issue": tfds.features.Text(),
                    "files": tfds.features.Sequence(
                        {"path": tfds.features.Text(), "content": tfds.features.Text()}
                    ),
                    "fail_to_pass": tfds.features.Sequence(tfds.features.Text()),
                    "pass_to_pass": tfds.features.Sequence(tfds.features.Text()),
                    "test_files": tfds.features.Sequence(tfds.features.Text()),
                    "test_patch": tfds.features.Text(),
                    "reference_patch": tfds.features.Text(),
                    **_audit_features(),
                }
            ),
            homepage="https://github.com/gagar-jax",
            disable_shuffling=True,  # records keep the JSONL order
        )

    def _split_generators(self, dl_manager):
        manual = dl_manager.manual_dir
        found = {s: manual / f"{s}.jsonl" for s in REPO_SPLITS if (manual / f"{s}.jsonl").exists()}
        if not found:
            raise ValueError(f"no {', '.join(s + '.jsonl' for s in REPO_SPLITS)} in {manual}")
        audits = _read_audits(manual / AUDIT_FILE) if (manual / AUDIT_FILE).exists() else {}
        return {s: self._generate_examples(p, audits) for s, p in found.items()}

    def _generate_examples(self, path, audits) -> Iterator[tuple[str, dict]]:
        seen = set()
        with path.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    entry = _audit_entry(d) if "task" in d else None
                    task = RepoTask.from_dict(entry.task if entry else d)
                except (ValueError, TypeError, KeyError) as e:
                    raise ValueError(f"{path}:{n}: bad repo task: {e}") from e
                if task.task_id in seen:
                    raise ValueError(f"{path}:{n}: duplicate task_id {task.task_id!r}")
                seen.add(task.task_id)
                entry = audits.get(task.task_id, entry)
                yield task.task_id, repo_task_to_record(task) | audit_to_record(entry)


def _read_audits(path) -> dict[str, PoolEntry]:
    out: dict[str, PoolEntry] = {}
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                e = _audit_entry(json.loads(line))
                tid = e.task_id
            except (ValueError, TypeError, KeyError) as err:
                raise ValueError(f"{path}:{n}: bad audit line: {err}") from err
            if tid in out:
                raise ValueError(f"{path}:{n}: duplicate task_id {tid!r}")
            out[tid] = e
    return out


def repo_task_to_record(task: RepoTask) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "issue": task.issue,
        "files": [{"path": p, "content": c} for p, c in sorted(task.files.items())],
        "fail_to_pass": list(task.fail_to_pass),
        "pass_to_pass": list(task.pass_to_pass),
        "test_files": list(task.test_files),
        "test_patch": task.test_patch,
        "reference_patch": task.reference_patch,
    }


def repo_task_from_record(r: Mapping[str, Any]) -> RepoTask:
    """The RepoTask of one ``repo_tasks`` record (as ``tfds.data_source`` returns it)."""
    files = r["files"]
    return RepoTask(
        task_id=_text(r["task_id"]),
        issue=_text(r["issue"]),
        files={_text(p): _text(c) for p, c in zip(files["path"], files["content"])},
        fail_to_pass=tuple(_text(t) for t in r["fail_to_pass"]),
        pass_to_pass=tuple(_text(t) for t in r["pass_to_pass"]),
        test_files=tuple(_text(t) for t in r["test_files"]),
        test_patch=_text(r["test_patch"]),
        reference_patch=_text(r["reference_patch"]),
    )
