"""Feedback schema, validation, char -> token spans, packing, and the TFDS feedback builder."""

import json

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from gagar_jax.data.feedback import (
    FeedbackError,
    FeedbackRecord,
    derive_spans,
    pack_examples,
    read_jsonl,
    write_jsonl,
)
from gagar_jax.envs import TOKENIZER, ToyTaskGenerator
from gagar_jax.envs.tokenizer import encode_with_offsets

TASK = ToyTaskGenerator(0, 1).task(0)
PATCH = "1 : a = x * 3\nins 2 : b = x"


def _record(feedback, *, segments=None, rid="r0"):
    segments = segments or [
        {"role": "prompt", "text": TASK.prompt},
        {"role": "model", "text": PATCH},
    ]
    return {"record_id": rid, "task_id": TASK.task_id, "segments": segments, "feedback": feedback}


def _derive(d, **kw):
    return derive_spans(FeedbackRecord.from_dict(d), TOKENIZER, **kw)


def test_char_ranges_map_to_token_spans_and_uncovered_runs_are_neutral():
    first = PATCH.index("\n")
    ex = _derive(
        _record(
            [
                {
                    "text": "good, that was the failing line",
                    "polarity": "positive",
                    "turn": 0,
                    "char_range": [0, first],
                },
                {
                    "text": "you edited a line outside the function",
                    "polarity": "negative",
                    "turn": 0,
                    "char_range": [first + 1, first + 4],
                },  # "ins"
            ]
        )
    )
    words = [TOKENIZER.vocab[i] for i in ex.tokens]
    resp = np.flatnonzero(ex.response_mask)
    assert "".join(words[i] for i in resp).startswith("1:a=x*3")
    assert not ex.response_mask[: len(TOKENIZER.encode(TASK.prompt))].any()
    # spans in order: positive line 1, neutral newline, negative "ins", neutral rest
    assert list(ex.span_polarity) == [1, 0, -1, 0]
    assert ex.span_texts[0].startswith("good") and ex.span_texts[1] == ""
    pos = [words[i] for i in np.flatnonzero(ex.span_ids == 0)]
    assert pos == ["1", ":", "a", "=", "x", "*", "3"]
    assert [words[i] for i in np.flatnonzero(ex.span_ids == 2)] == ["ins"]
    # every response token is in exactly one span; no prompt token is in any
    assert np.all(ex.span_ids[ex.response_mask] >= 0)
    assert np.all(ex.span_ids[~ex.response_mask] == -1)
    ig = _derive(
        _record([{"text": "x", "polarity": 1, "turn": 0, "char_range": [0, 1]}]), uncovered="ignore"
    )
    assert list(ig.span_polarity) == [1] and (ig.span_ids >= 0).sum() == 1


def test_char_range_partial_token_takes_the_whole_token():
    # "ins" starts at first + 1; a range inside it still selects that one token
    first = PATCH.index("\n")
    ex = _derive(
        _record([{"text": "", "polarity": -1, "turn": 0, "char_range": [first + 2, first + 3]}]),
        uncovered="ignore",
    )
    assert [TOKENIZER.vocab[i] for i in ex.tokens[ex.span_ids == 0]] == ["ins"]


def test_turn_feedback_on_multi_turn_trajectory():
    segs = [
        {"role": "prompt", "text": TASK.prompt},
        {"role": "model", "text": "1 : a = x"},
        {"role": "observation", "text": "f ( 3 ) == 9"},
        {"role": "model", "text": "del 1"},
    ]
    ex = _derive(
        _record(
            [
                {
                    "text": "you submitted without running the tests",
                    "polarity": "negative",
                    "turn": 1,
                }
            ],
            segments=segs,
        )
    )
    obs = ex.roles == 2
    assert obs.any() and np.all(ex.span_ids[obs] == -1)
    neg = ex.span_ids == int(np.flatnonzero(ex.span_polarity == -1)[0])
    assert [TOKENIZER.vocab[i] for i in ex.tokens[neg]] == ["del", "1"]
    assert list(ex.span_polarity) == [0, -1]  # turn 0 uncovered -> neutral


@pytest.mark.parametrize(
    "feedback, segments, match",
    [
        ([{"polarity": "meh", "turn": 0}], None, r"record 'r0': feedback\[0\]\.polarity"),
        ([{"polarity": 2, "turn": 0}], None, r"feedback\[0\]\.polarity must be one of"),
        ([{"turn": 0}], None, r"feedback\[0\]\.polarity is missing"),
        ([{"polarity": 1, "turn": 3}], None, r"feedback\[0\]\.turn 3 is outside the response"),
        (
            [{"polarity": 1, "turn": 0, "char_range": [0, 999]}],
            None,
            r"feedback\[0\]\.char_range \[0, 999\) is outside turn 0",
        ),
        (
            [{"polarity": 1, "turn": 0, "char_range": [5, 2]}],
            None,
            r"feedback\[0\]\.char_range must satisfy 0 <= start < end",
        ),
        ([{"polarity": 1, "char_range": [0, 2]}], None, r"char_range needs the turn"),
        (
            [{"polarity": 1, "token_range": [0, 3]}],
            None,
            r"feedback\[0\] covers prompt tokens .*model \(response\) tokens only",
        ),
        (
            [{"polarity": 1, "token_range": [0, 10_000]}],
            None,
            r"token_range \[0, 10000\) is outside the trajectory",
        ),
        (
            [
                {"polarity": 1, "turn": 0, "char_range": [0, 5]},
                {"polarity": -1, "turn": 0, "char_range": [4, 9]},
            ],
            None,
            r"feedback\[1\] overlaps feedback\[0\]",
        ),
        ([{"polarity": 1, "turn": 0, "char_range": [1, 2]}], None, r"covers no token"),  # a space
        ([{"polarity": 1}], None, r"feedback\[0\] must point somewhere"),
        ([], [{"role": "prompt", "text": "patch"}], r"no 'model' segment"),
        ([], [{"role": "tool", "text": "x"}], r"segments\[0\]\.role must be one of"),
    ],
)
def test_validation_errors_name_record_and_field(feedback, segments, match):
    with pytest.raises(FeedbackError, match=match):
        _derive(_record(feedback, segments=segments))


def test_observation_tokens_are_refused():
    segs = [
        {"role": "prompt", "text": "patch"},
        {"role": "model", "text": "1 : a = x"},
        {"role": "observation", "text": "f ( 3 ) == 9"},
        {"role": "model", "text": "del 1"},
    ]
    n_prompt_model = len(TOKENIZER.encode("patch")) + len(TOKENIZER.encode("1 : a = x"))
    with pytest.raises(FeedbackError, match="covers observation tokens"):
        _derive(
            _record(
                [{"polarity": -1, "token_range": [n_prompt_model - 1, n_prompt_model + 2]}],
                segments=segs,
            )
        )


def test_given_tokens_are_used_as_they_are_and_need_token_ranges():
    ids = TOKENIZER.encode("1 : a = x") + [TOKENIZER.eos_id]
    segs = [{"role": "prompt", "text": "patch"}, {"role": "model", "text": "", "tokens": ids}]
    ex = _derive(_record([{"polarity": 1, "token_range": [1, 3]}], segments=segs))
    assert list(ex.tokens[1:]) == ids and list(ex.span_polarity) == [1, 0]
    with pytest.raises(FeedbackError, match="use token_range"):
        _derive(_record([{"polarity": 1, "turn": 0, "char_range": [0, 1]}], segments=segs))


def test_hf_tokenizer_offsets():
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = sorted(set("you edited the wrong line good fix".split()))
    tok = tokenizers.Tokenizer(
        WordLevel({w: i + 1 for i, w in enumerate(words)} | {"[UNK]": 0}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = Whitespace()
    text = "good fix you edited the wrong line"
    ids, offsets = encode_with_offsets(tok, text)
    assert [text[a:b] for a, b in offsets] == text.split()
    rec = {
        "record_id": "h",
        "segments": [{"role": "prompt", "text": "good"}, {"role": "model", "text": text}],
        "feedback": [{"polarity": -1, "turn": 0, "char_range": [text.index("wrong"), len(text)]}],
    }
    ex = derive_spans(FeedbackRecord.from_dict(rec), tok)
    neg = ex.span_ids == int(np.flatnonzero(ex.span_polarity == -1)[0])
    assert [words[i - 1] for i in ex.tokens[neg]] == ["wrong", "line"]


def test_jsonl_round_trip_and_pack(tmp_path):
    recs = [
        FeedbackRecord.from_dict(
            _record([{"text": "t", "polarity": p, "turn": 0, "char_range": [0, 1]}], rid=f"r{i}")
        )
        for i, p in enumerate(("positive", "negative", "neutral"))
    ]
    path = str(tmp_path / "fb.jsonl")
    write_jsonl(path, recs)
    assert read_jsonl(path) == recs
    exs = [derive_spans(r, TOKENIZER) for r in recs]
    b = pack_examples(exs, seq_len=64, max_spans=4, pad_id=0)
    assert b.tokens.shape == (3, 64) and b.span_polarity.shape == (3, 4)
    assert list(b.span_polarity[:, 0]) == [1, -1, 0]
    np.testing.assert_array_equal(b.token_polarity[b.span_ids == -1], 0)
    assert not b.response_mask[:, 0].any()
    with pytest.raises(ValueError, match="seq_len"):
        pack_examples(exs, seq_len=8, max_spans=4, pad_id=0)
    with pytest.raises(ValueError, match="max_spans"):
        pack_examples(exs, seq_len=64, max_spans=1, pad_id=0)
    with open(path, "a") as f:
        f.write(json.dumps(_record([{"polarity": "bad", "turn": 0}], rid="r9")) + "\n")
    with pytest.raises(FeedbackError, match=r"fb\.jsonl:4: record 'r9': feedback\[0\]"):
        read_jsonl(path)


@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 6), st.sampled_from([-1, 0, 1])), max_size=6
    )
)
def test_property_spans_partition_the_response(items):
    text = PATCH + "\n2 : return a"
    feedback = []
    for start, length, pol in items:
        a, b = start, min(start + length, len(text))
        if a >= b or not text[a:b].strip():
            continue
        feedback.append({"polarity": pol, "turn": 0, "char_range": [a, b]})
    try:
        ex = _derive(
            _record(
                feedback,
                segments=[{"role": "prompt", "text": "patch"}, {"role": "model", "text": text}],
            )
        )
    except FeedbackError as e:
        assert "overlaps" in str(e)
        return
    resp = ex.response_mask
    assert np.all(ex.span_ids[resp] >= 0) and np.all(ex.span_ids[~resp] == -1)
    # each span is one contiguous run with one polarity; spans ordered by position
    ids = ex.span_ids[resp]
    assert np.all(np.diff(ids) >= 0) and set(ids) == set(range(len(ex.span_polarity)))
    polar = [f["polarity"] for f in feedback]
    assert sorted(int(p) for p in ex.span_polarity if p != 0) == sorted(p for p in polar if p)


# ------------------------------------------------------------------------------------------
# TFDS builder
# ------------------------------------------------------------------------------------------
def test_feedback_builder_round_trip(tmp_path):
    import tensorflow_datasets as tfds

    from gagar_jax.data import feedback_builder as FB

    manual = tmp_path / "manual"
    manual.mkdir()
    recs = [
        FeedbackRecord.from_dict(
            _record(
                [{"text": f"item {i}", "polarity": 1 - i % 3, "turn": 0, "char_range": [0, 5]}],
                rid=f"r{i}",
            )
        )
        for i in range(5)
    ]
    write_jsonl(str(manual / "train.jsonl"), recs[:4])
    write_jsonl(str(manual / "test.jsonl"), recs[4:])
    builder = FB.FeedbackSpans(data_dir=str(tmp_path / "out"))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(manual))
    )
    assert builder.info.file_format.value == "array_record"
    src = builder.as_data_source()
    assert (len(src["train"]), len(src["test"])) == (4, 1)
    got = [FB.feedback_example_from_record(r) for r in src["train"]]
    for g, r in zip(got, recs[:4]):
        want = derive_spans(r, TOKENIZER)
        assert g.record_id == want.record_id and g.span_texts == want.span_texts
        for f in ("tokens", "roles", "span_ids", "span_polarity"):
            np.testing.assert_array_equal(getattr(g, f), getattr(want, f), err_msg=f)
    assert FeedbackRecord.from_dict(json.loads(src["train"][0]["record_json"])) == recs[0]

    bad = tmp_path / "bad"
    bad.mkdir()
    with open(bad / "train.jsonl", "w") as f:
        f.write(recs[0].to_json() + "\n")
        f.write(json.dumps(_record([{"polarity": 1, "token_range": [0, 2]}], rid="p")) + "\n")
    with pytest.raises(
        FeedbackError,
        match=r"train\.jsonl:2: record 'p': feedback\[0\] covers "
        r"prompt tokens",
    ):
        FB.FeedbackSpans(data_dir=str(tmp_path / "out2")).download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=str(bad))
        )
