"""Paired evaluation: held-out sampling in calls of any size, the same seeds at two
checkpoints, and the paired statistics (``gagar_jax.rl.paired_eval``, ``train.eval_groups``).

The real embedded sampler over the toy ``smoke`` policy; the checkpoint tests (``e2e``: about
a minute on a loaded 2-core machine) train the smoke run itself (3 steps) and evaluate its
step-0 and last checkpoints."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.rl import engines, paired_eval, policy, train
from gagar_jax.rl.config import RunConfig
from tests.test_loop_pieces import load_config_module

K = 2


def _cfg(**loop) -> RunConfig:
    d = load_config_module("toy_gagar").get_config("smoke").to_dict()
    d["loop"].update(eval_rollouts=K, **loop)
    return RunConfig.from_config_dict(d)


@pytest.fixture(scope="module")
def setup():
    cfg = _cfg()
    family = train.build_family(cfg)
    _, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    return cfg, family, engine


def _draws(groups):
    return [(g.group_id, [r.response_tokens for r in g.rollouts]) for g in groups]


def test_eval_groups_in_several_calls_equal_one_call(setup, monkeypatch):
    cfg, family, engine = setup
    tasks = [family.train_task(i) for i in range(6)]
    one = train.eval_groups(engine, family, cfg, tasks, step=4)
    monkeypatch.setattr(train, "EVAL_CALL_ROWS", 2 * K)  # two tasks per call: three calls
    three = train.eval_groups(engine, family, cfg, tasks, step=4)
    assert len(one) == len(three) == 6
    assert _draws(three) == _draws(one)
    assert [g.num_passed for g in three] == [g.num_passed for g in one]


def test_the_same_sample_step_draws_the_same_samples(setup):
    cfg, family, engine = setup
    tasks = [family.train_task(i) for i in range(4)]
    a = train.eval_groups(engine, family, cfg, tasks, step=3, sample_step=0)
    b = train.eval_groups(engine, family, cfg, tasks, step=9, sample_step=0)
    c = train.eval_groups(engine, family, cfg, tasks, step=3)  # seeded by step 3
    tokens = [[r.response_tokens for r in g.rollouts] for g in a]
    assert tokens == [[r.response_tokens for r in g.rollouts] for g in b]
    assert tokens != [[r.response_tokens for r in g.rollouts] for g in c]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=12))
def test_paired_mean_se_matches_numpy(diffs):
    mean, se = paired_eval.paired_mean_se(diffs)
    x = np.asarray(diffs, np.float64)
    assert mean == pytest.approx(x.mean(), abs=1e-12)
    assert se == pytest.approx(x.std(ddof=1) / np.sqrt(len(x)), abs=1e-12)


def test_paired_mean_se_of_one_and_of_none():
    mean, se = paired_eval.paired_mean_se([0.25])
    assert mean == 0.25 and math.isnan(se)
    with pytest.raises(ValueError, match="at least one"):
        paired_eval.paired_mean_se([])


def test_pass_rate_counts_valid_samples():
    recs = [{"n": 4, "passed": 1}, {"n": 2, "passed": 2}, {"n": 0, "passed": 0}]
    assert paired_eval.pass_rate(recs) == pytest.approx(3 / 6)
    assert paired_eval.pass_rate([{"n": 0, "passed": 0}]) == 0.0


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("paired_smoke"))
    cfg = _cfg(keep_checkpoints=10, plot=False)
    train.train_and_evaluate(cfg, workdir)
    return workdir


@pytest.mark.e2e
def test_checkpoint_pass_counts_pairs_the_sft_start_and_the_end(smoke_run):
    got = paired_eval.checkpoint_pass_counts(smoke_run, [0, -1], num_tasks=6, samples=2)
    assert sorted(got) == [0, 3]  # -1 resolved to the last checkpoint
    for recs in got.values():
        assert len(recs) == 6
        assert all(r["n"] == 2 and 0 <= r["passed"] <= 2 for r in recs)
        assert {r["kind"] for r in recs} <= {"operator", "constant"}  # difficulty-1 bugs
    again = paired_eval.checkpoint_pass_counts(smoke_run, [0], num_tasks=6, samples=2)
    assert again[0] == got[0]  # the same seeds: the same draws
    train_split = paired_eval.checkpoint_pass_counts(
        smoke_run, [0], split="train", num_tasks=6, samples=2
    )
    assert [r["task_id"] for r in train_split[0]] != [r["task_id"] for r in got[0]]


@pytest.mark.e2e
def test_evaluate_checkpoint_at_other_samples_and_temperature(smoke_run):
    # the evaluation settings are not the checkpoint's: its config fingerprint still matches
    metrics, step = train.evaluate_checkpoint(smoke_run, step=0, samples=3, temperature=1.0)
    assert step == 0 and 0.0 <= metrics["eval_pass_rate"] <= 1.0


@pytest.mark.e2e
def test_checkpoint_pass_counts_names_what_is_wrong(smoke_run, tmp_path):
    with pytest.raises(ValueError, match=r"checkpoints \[7\] not in"):
        paired_eval.checkpoint_pass_counts(smoke_run, [7], num_tasks=2, samples=1)
    with pytest.raises(ValueError, match="split must be one of"):
        paired_eval.checkpoint_pass_counts(smoke_run, [0], split="test")
    with pytest.raises(ValueError, match="exceeds the run's training pool"):
        paired_eval.checkpoint_pass_counts(smoke_run, [0], split="train", num_tasks=10_000)
    with pytest.raises(FileNotFoundError, match="run directory"):
        paired_eval.checkpoint_pass_counts(str(tmp_path), [0])
