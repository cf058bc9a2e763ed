"""The simulated toy user, the feedback loop's batching, and the feedback entry point end to end
(real parts: flax policy, embedded sampler, toy verifier, orbax checkpoints)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gagar_jax.analysis import writers
from gagar_jax.data.feedback import FeedbackRecord, derive_spans
from gagar_jax.envs import TOKENIZER, ToyTaskGenerator, candidate_patches
from gagar_jax.envs.simulated_user import feedback_record, user_feedback
from gagar_jax.feedback.run import batch_indices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _items(task, text, tail=(TOKENIZER.eos_id,)):
    return user_feedback(task, TOKENIZER.encode(text) + list(tail))


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_simulated_user_judges_each_patch_kind(difficulty):
    task = ToyTaskGenerator(3, difficulty).task(1)
    kinds = candidate_patches(task)
    pols = {k: [f["polarity"] for f in _items(task, p)] for k, p in kinds.items()}
    assert pols["minimal"] == ["positive"]
    if "out_of_scope" in pols:
        assert set(pols["out_of_scope"]) == {"negative"}
    assert pols["cheat"] and set(pols["cheat"]) == {"negative"}
    texts = [f["text"] for f in _items(task, kinds["cheat"])]
    assert all("special-cased a tested input" in t for t in texts)
    assert pols["side_effect"] == ["positive", "negative"]
    assert pols["wrong"] == ["negative"] and pols["noop"] == ["negative"]
    assert "negative" in pols["sprawling"] and "positive" not in pols["sprawling"]
    bad = _items(task, "1 : a =")
    assert [f["polarity"] for f in bad] == ["negative"] and "does not parse" in bad[0]["text"]
    # every record the user writes validates and maps onto the sampled tokens exactly
    prompt = TOKENIZER.encode(task.prompt)
    for kind, patch in kinds.items():
        toks = TOKENIZER.encode(patch) + [TOKENIZER.eos_id]
        rec = FeedbackRecord.from_dict(feedback_record(task, prompt, toks, record_id=kind))
        ex = derive_spans(rec, TOKENIZER)
        assert list(ex.tokens[len(prompt) :]) == toks
        assert ex.span_ids[-1] >= 0 and ex.span_polarity[ex.span_ids[-1]] == 0  # EOS neutral


def test_simulated_user_cannot_be_talked_into_praise():
    """The verdict comes from the verifier and the monitor, never from the patch's words: a
    cheat padded with junk after EOS, or a near-miss fix, stays negative."""
    task = ToyTaskGenerator(0, 1).task(2)
    cheat = candidate_patches(task)["cheat"]
    after_eos = TOKENIZER.encode("1 : " + task.reference_patch.split(" : ", 1)[1])
    items = user_feedback(task, TOKENIZER.encode(cheat) + [TOKENIZER.eos_id] + after_eos)
    assert items and all(f["polarity"] == "negative" for f in items)
    # tokens after EOS are never covered
    n = len(TOKENIZER.encode(cheat))
    assert all(b <= n for _, b in (f["token_range"] for f in items))
    assert user_feedback(task, [TOKENIZER.eos_id]) == []


def test_batch_indices_are_seeded_epochs():
    a = [batch_indices(s, 5, 12, seed=3) for s in range(12)]
    assert all(len(x) == 5 for x in a)
    flat = np.concatenate(a)  # 60 draws = 5 epochs of 12: each record once per epoch
    for e in range(5):
        assert sorted(flat[e * 12 : (e + 1) * 12]) == list(range(12))
    np.testing.assert_array_equal(batch_indices(7, 5, 12, seed=3), a[7])  # pure in (seed, s)
    assert not np.array_equal(
        np.concatenate([batch_indices(s, 5, 12, 4) for s in range(3)]), flat[:15]
    )


@pytest.mark.e2e  # scripts/train_feedback.py, twice
def test_entry_point_smoke_and_resume(tmp_path):
    workdir = str(tmp_path / "run")
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "train_feedback.py"),
        f"--config={os.path.join(ROOT, 'configs', 'feedback_toy.py')}:span_kto,smoke",
        f"--workdir={workdir}",
    ]
    env = dict(
        os.environ, XLA_FLAGS="", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in train)
    assert all("kto/z_used" in r and "logp_neg" in r for r in train)
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 2, 3]
    summary = json.load(open(os.path.join(workdir, "summary.json")))
    assert summary["mode"] == "span_kto" and summary["compiles"] == 1
    assert os.path.exists(os.path.join(workdir, "base", "feedback.jsonl"))
    # the same command again resumes at the last checkpoint (step 3 = done): nothing repeats
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed" in second.stdout + second.stderr
    rows2 = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows2 if r["phase"] == "train"] == [0, 1, 2]


def test_base_params_round_trip_through_orbax(tmp_path):
    import numpy as np

    from gagar_jax.feedback.run import load_params, save_params

    params = {
        "layer": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "b": np.ones((3,), np.float32),
    }
    save_params(str(tmp_path / "base_params"), params)
    like = {"layer": {"w": np.zeros((2, 3), np.float32)}, "b": np.zeros((3,), np.float32)}
    got = load_params(str(tmp_path / "base_params"), like)
    np.testing.assert_array_equal(got["layer"]["w"], params["layer"]["w"])
    np.testing.assert_array_equal(got["b"], params["b"])
