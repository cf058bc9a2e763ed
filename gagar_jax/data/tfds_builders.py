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


class ToyTasks(tfds.core.GeneratorBasedBuilder):
    """Seeded toy code-repair tasks (``gagar_jax.envs.ToyTaskGenerator``) as array_record."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        ToyTasksConfig(name=f"d{d}", description=f"difficulty {d}", difficulty=d)
        for d in (1, 2, 3)
    ]

    def __init__(self, **kwargs):
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
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
            }),
            homepage="https://github.com/gagar-jax",
            disable_shuffling=True,  # record i of a split is task i of its generator
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if c.difficulty not in (1, 2, 3):
            raise ValueError(f"ToyTasksConfig.difficulty must be 1, 2 or 3, got {c.difficulty}")
        if c.num_train < 0 or c.num_test < 0:
            raise ValueError(f"ToyTasksConfig num_train/num_test must be >= 0, got "
                             f"{c.num_train}/{c.num_test}")  # fmt: skip
        return {
            "train": self._generate_examples(c.seed, c.num_train),
            "test": self._generate_examples(c.seed + TEST_SEED_OFFSET, c.num_test),
        }

    def _generate_examples(self, seed: int, n: int) -> Iterator[tuple[str, dict]]:
        gen = ToyTaskGenerator(seed, self.builder_config.difficulty)
        for i in range(n):
            yield f"{i:08d}", toy_task_to_record(gen.task(i))


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


class RepoTasks(tfds.core.GeneratorBasedBuilder):
    """Python repository tasks (``gagar_jax.envs.repo.RepoTask``) from JSONL in the manual dir."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train.jsonl / validation.jsonl / test.jsonl (one RepoTask.to_dict() object per "
        "line) in the manual directory."
    )

    def __init__(self, **kwargs):
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
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
            }),
            homepage="https://github.com/gagar-jax",
            disable_shuffling=True,  # records keep the JSONL order
        )

    def _split_generators(self, dl_manager):
        manual = dl_manager.manual_dir
        found = {s: manual / f"{s}.jsonl" for s in REPO_SPLITS if (manual / f"{s}.jsonl").exists()}
        if not found:
            raise ValueError(f"no {', '.join(s + '.jsonl' for s in REPO_SPLITS)} in {manual}")
        return {s: self._generate_examples(p) for s, p in found.items()}

    def _generate_examples(self, path) -> Iterator[tuple[str, dict]]:
        seen = set()
        with path.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    task = RepoTask.from_dict(json.loads(line))
                except (ValueError, TypeError, KeyError) as e:
                    raise ValueError(f"{path}:{n}: bad repo task: {e}") from e
                if task.task_id in seen:
                    raise ValueError(f"{path}:{n}: duplicate task_id {task.task_id!r}")
                seen.add(task.task_id)
                yield task.task_id, repo_task_to_record(task)


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
