"""The RL loop with the mismatch tools on: the bitwise on-policy mode keeps the update's
log-probs of the sampled tokens equal to the recorded ones at every step, and an int8 sampler
runs with truncated IS on and reports the mismatch (the toy family's smoke config)."""

import numpy as np
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


def test_moe_loop_replays_recorded_routes_across_staleness_partial_rollouts_and_resume(tmp_path):
    """A mixture-of-experts policy sampled in bfloat16, one step stale, its samples spanning
    the weight sync (partial rollouts in chunks): the update replays the recorded routes on
    every token that has them, nearly every token has them (the in-flight batch's included,
    after a resume from the checkpoint), and it reports how many routes differ without replay."""
    from gagar_jax.rl import train

    over = {
        "rollout.precision": "bfloat16",
        "rollout.max_staleness": 1,
        "rollout.partial_rollout": True,
        "rollout.partial_chunk_tokens": 8,
        "learner.routing_replay": True,
        "model.num_experts": 4,
        "model.num_experts_per_tok": 2,
        "model.moe_intermediate_size": 32,
        "loop.total_steps": 2,
    }
    cfg = smoke_config(**over)
    train.train_and_evaluate(cfg, str(tmp_path))
    first = train_rows(tmp_path)
    assert len(first) == 2
    more = smoke_config(**dict(over, **{"loop.total_steps": 4}))
    train.train_and_evaluate(more, str(tmp_path))  # resumes with the in-flight batch
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["mismatch/route_replay_match_frac"] == 1.0
        assert r["mismatch/route_recorded_frac"] > 0.95
        assert 0.0 <= r["mismatch/route_diff_frac"] < 1.0
        assert r["mismatch/k3_no_replay"] >= 0.0 and r["mismatch/k3_replay"] >= 0.0
        assert all(v is None or np.isfinite(v) for v in r.values() if isinstance(v, (int, float)))
