"""TFDS builder for feedback-span datasets (array_record, no TensorFlow), from JSONL.

Reads ``<split>.jsonl`` files (``train``, ``validation``, ``test``; whichever exist) of
:class:`~gagar_jax.data.feedback.FeedbackRecord` objects from the manual directory, validates
each record and derives its token spans with the configured tokenizer while building (a
malformed record fails the build naming file, line, record and field)::

    builder = FeedbackSpans(data_dir=out_dir)          # config "toy": the toy tokenizer
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=jsonl_dir))
    examples = [feedback_example_from_record(r) for r in builder.as_data_source()["train"]]

A Hugging Face tokenizer: ``FeedbackSpans(config=FeedbackSpansConfig(name="qwen",
tokenizer="/path/to/tokenizer.json"), ...)`` (a ``tokenizers`` JSON file; offsets from it).
Records keep the JSONL order (shuffling disabled), so a data position is an index.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from gagar_jax.data.feedback import (
    UNCOVERED,
    FeedbackError,
    FeedbackExample,
    FeedbackRecord,
    derive_spans,
)
from gagar_jax.envs import TOKENIZER

SPLITS = ("train", "validation", "test")


def _text(x: Any) -> str:
    return x.decode("utf-8") if isinstance(x, bytes | np.bytes_) else str(x)


def load_tokenizer(name: str):
    """``toy`` -> the toy tokenizer; a path to a ``tokenizer.json`` -> ``tokenizers.Tokenizer``."""
    if name == "toy":
        return TOKENIZER
    from tokenizers import Tokenizer

    return Tokenizer.from_file(name)


@dataclasses.dataclass(eq=False)
class FeedbackSpansConfig(tfds.core.BuilderConfig):
    """``tokenizer``: ``toy`` or a ``tokenizer.json`` path; ``uncovered``: ``neutral|ignore``."""

    tokenizer: str = "toy"
    uncovered: str = "neutral"


class FeedbackSpans(tfds.core.GeneratorBasedBuilder):
    """Trajectories with user feedback and their derived token spans, as array_record."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [FeedbackSpansConfig(name="toy", description="toy tokenizer")]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train.jsonl / validation.jsonl / test.jsonl (one FeedbackRecord.to_dict() object "
        "per line) in the manual directory."
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
                    "record_id": tfds.features.Text(),
                    "task_id": tfds.features.Text(),
                    "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "roles": tfds.features.Tensor(shape=(None,), dtype=np.int8),
                    "span_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "span_polarity": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "span_texts": tfds.features.Sequence(tfds.features.Text()),
                    "record_json": tfds.features.Text(),
                }
            ),
            homepage="https://github.com/gagar-jax",
            disable_shuffling=True,  # records keep the JSONL order
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        if c.uncovered not in UNCOVERED:
            raise ValueError(
                f"FeedbackSpansConfig.uncovered must be one of {UNCOVERED}, got {c.uncovered!r}"
            )
        manual = dl_manager.manual_dir
        found = {s: manual / f"{s}.jsonl" for s in SPLITS if (manual / f"{s}.jsonl").exists()}
        if not found:
            raise ValueError(f"no {', '.join(s + '.jsonl' for s in SPLITS)} in {manual}")
        tokenizer = load_tokenizer(c.tokenizer)
        return {s: self._generate_examples(p, tokenizer) for s, p in found.items()}

    def _generate_examples(self, path, tokenizer) -> Iterator[tuple[str, dict]]:
        seen = set()
        with path.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = FeedbackRecord.from_dict(json.loads(line))
                    ex = derive_spans(rec, tokenizer, uncovered=self.builder_config.uncovered)
                except (json.JSONDecodeError, FeedbackError) as e:
                    raise FeedbackError(f"{path}:{n}: {e}") from e
                if rec.record_id in seen:
                    raise FeedbackError(f"{path}:{n}: duplicate record_id {rec.record_id!r}")
                seen.add(rec.record_id)
                yield rec.record_id, feedback_example_to_record(ex, rec)


def feedback_example_to_record(ex: FeedbackExample, rec: FeedbackRecord) -> dict[str, Any]:
    return {
        "record_id": ex.record_id,
        "task_id": ex.task_id,
        "tokens": ex.tokens.astype(np.int32),
        "roles": ex.roles.astype(np.int8),
        "span_ids": ex.span_ids.astype(np.int32),
        "span_polarity": ex.span_polarity.astype(np.int32),
        "span_texts": list(ex.span_texts),
        "record_json": rec.to_json(),
    }


def feedback_example_from_record(r: Mapping[str, Any]) -> FeedbackExample:
    """The FeedbackExample of one ``feedback_spans`` record (as ``tfds.data_source`` returns)."""
    return FeedbackExample(
        record_id=_text(r["record_id"]),
        task_id=_text(r["task_id"]),
        tokens=np.asarray(r["tokens"], np.int32),
        roles=np.asarray(r["roles"], np.int8),
        span_ids=np.asarray(r["span_ids"], np.int32),
        span_polarity=np.asarray(r["span_polarity"], np.int32),
        span_texts=tuple(_text(t) for t in r["span_texts"]),
    )
