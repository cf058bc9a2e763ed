"""The RL loop with the mismatch tools on: the bitwise on-policy mode keeps the update's
log-probs of the sampled tokens equal to the recorded ones at every step, and an int8 sampler
runs with truncated IS on and reports the mismatch (the toy family's smoke config)."""

import pytest

from configs import toy_gagar
from gagar_jax.analysis import writers
from gagar_jax.rl.config import RunConfig

# Runs of the whole loop: tens of seconds each on 2 cores (make test-unit skips them).
pytestmark = pytest.mark.e2e


def smoke_config(**overrides):
    d = toy_gagar.get_config("gagar,smoke").to_dict()
    for dotted, value in overrides.items():
        section, field = dotted.split(".")
        d[section][field] = value
    return RunConfig.from_config_dict(d)


def train_rows(workdir):
    rows = writers.read_jsonl(str(workdir / "metrics.jsonl"))
    return [r for r in rows if r["phase"] == "train"]


def test_bitwise_onpolicy_loop_is_exactly_aligned_every_step(tmp_path):
    from gagar_jax.rl import train

    cfg = smoke_config(**{"rollout.bitwise_onpolicy": True})
    assert cfg.learner.mismatch_metrics
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = train_rows(tmp_path)
    assert len(rows) == cfg.loop.total_steps
    for r in rows:
        assert r["mismatch/logprob_max_abs_diff"] == 0.0 and r["mismatch/k3"] == 0.0


def test_int8_sampler_loop_runs_with_truncated_is_and_reports_the_mismatch(tmp_path):
    from gagar_jax.rl import train

    cfg = smoke_config(**{"rollout.precision": "int8"})
    assert cfg.learner.rollout_is == "token" and cfg.learner.decoupled
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = train_rows(tmp_path)
    assert len(rows) == cfg.loop.total_steps
    for r in rows:
        assert r["mismatch/logprob_max_abs_diff"] > 1e-3 and r["mismatch/k3"] > 0.0
        assert 0.0 < r["is_ess"] <= 1.0
