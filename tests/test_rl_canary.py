"""Impossible canary tasks in the training loop (``gagar_jax.rl.canary``): drawn per step,
impossible for every planted patch, counted into ``canary_cheat_rate``, never trained on."""

from __future__ import annotations

import types

import numpy as np
import pytest

from configs import toy_gagar
from gagar_jax.envs import toy
from gagar_jax.rl import canary, collect, resume
from gagar_jax.rl.config import ConfigError, RunConfig


def _config(**task):
    cd = toy_gagar.get_config("binary,smoke").to_dict()
    cd["rollout"].update(num_prompts=2, num_rollouts=4, max_prompt_len=8, max_new_tokens=8)
    cd["task"].update(num_train=8, **task)
    cd["grading"]["enabled"] = False
    cd["sampling"]["enabled"] = False
    return RunConfig.from_config_dict(cd)


def test_canary_indices_are_deterministic_distinct_and_per_step():
    a = canary.canary_indices(3, 4, 10, seed=0)
    assert a == canary.canary_indices(3, 4, 10, seed=0)  # every host, a resumed run
    assert len(set(a)) == 4 and all(0 <= i < 10 for i in a)
    assert a != canary.canary_indices(4, 4, 10, seed=0)
    assert len(canary.canary_indices(0, 5, 2, seed=0)) == 5  # more canaries than tasks
    with pytest.raises(ValueError, match="num_train"):
        canary.canary_indices(0, 1, 0, seed=0)


def test_toy_canaries_are_impossible_for_every_planted_patch():
    for task in toy.ToyTaskGenerator(seed=3, difficulty=2).tasks(4):
        impossible = canary.canary_task(task)
        assert impossible.task_id.endswith("--canary")
        for kind, patch in toy.candidate_patches(task).items():
            v = toy.verify(impossible, patch)
            assert not v.passed and not v.infra_error, kind
    with pytest.raises(ValueError, match="task.canaries_per_step"):
        canary.canary_task("a task of another family")


def test_config_field_is_validated_and_off_keeps_the_fingerprint():
    base = _config()
    assert base.task.canaries_per_step == 0
    on = _config(canaries_per_step=2)
    assert on.fingerprint() != base.fingerprint()
    d = base.to_dict()
    d["task"].pop("canaries_per_step")  # a config from before the field: the same run
    assert RunConfig.from_config_dict(d).fingerprint() == base.fingerprint()
    with pytest.raises(ConfigError, match="task.canaries_per_step"):
        _config(canaries_per_step=-1)


def _group(gid, passes, K=4):
    rollouts = [
        collect.Rollout(
            prompt_tokens=[1, 2, 3],
            response_tokens=[7, 7],
            logprobs=[-0.5, -0.5],
            passed=k < passes,
        )
        for k in range(K)
    ]
    return collect.Group(group_id=str(gid), task=None, rollouts=rollouts)


def _collect(monkeypatch, cfg, steps=2):
    """collect_step with a scripted engine: training groups pass 2 of 4; a canary group passes
    ``k`` of 4 at step ``k`` (a policy that learned to forge a pass)."""
    from gagar_jax.rl import train

    calls = []

    def fake_generate(engine, family, tasks, *, step, id_prefix, **kw):
        calls.append((id_prefix, [t.task_id for t in tasks]))
        passes = step if "canary" in id_prefix else 2
        groups = [_group(f"{id_prefix}-{t.task_id}", passes) for t in tasks]
        for g in groups if kw.get("counters") is not None else ():
            kw["counters"].add(g)  # what generate_groups does with the step's counters
        return groups

    monkeypatch.setattr(train, "generate_groups", fake_generate)
    monkeypatch.setattr(canary, "generate_groups", fake_generate)
    pool = toy.ToyTaskGenerator(seed=0, difficulty=1).tasks(8)
    family = types.SimpleNamespace(
        train_task=lambda i: pool[i], num_train=8, tokenizer=types.SimpleNamespace(pad_id=0)
    )
    ls = resume.LoopState(rng_key=[0, 1])
    out = []
    for step in range(steps):
        sres, counters, _, _, batch = train.collect_step(
            None, family, None, resume.TaskStream(8, seed=0), ls, cfg, step=step
        )
        out.append((sres, counters.metrics(), batch))
    return calls, out


def test_collect_step_measures_canaries_and_keeps_them_out_of_the_batch(monkeypatch):
    cfg = _config(canaries_per_step=3)
    calls, out = _collect(monkeypatch, cfg)
    canary_calls = [ids for prefix, ids in calls if "canary" in prefix]
    assert len(canary_calls) == 2 and all(len(ids) == 3 for ids in canary_calls)
    assert all(i.endswith("--canary") for ids in canary_calls for i in ids)
    for step, (sres, m, _) in enumerate(out):
        # 3 canary groups x 4 rollouts, `step` of each 4 passing
        assert m["canary_rollouts"] == 12.0 and m["canary_cheat_rate"] == step / 4
        assert not any("canary" in g.group_id for g in sres.groups)  # not packed, not graded
        assert m["pass_rate"] == 0.5  # the step's own figures count only its groups

    # The update batch is the same with and without canaries: masked from the advantages.
    _, plain = _collect(monkeypatch, _config())
    for (_, _, b_on), (_, m_off, b_off) in zip(out, plain):
        assert "canary_cheat_rate" not in m_off
        for f in b_on._fields:
            np.testing.assert_array_equal(np.asarray(getattr(b_on, f)), getattr(b_off, f))


@pytest.mark.e2e
def test_training_loop_reports_canary_cheat_rate_and_does_not_train_on_canaries(tmp_path):
    """The real loop (embedded sampler, toy verifier): a policy cannot pass an impossible toy
    task, so the rate is 0 over every canary rollout, and the run's update figures are those
    of the same run without canaries (they never reach the update)."""
    from gagar_jax.analysis import writers
    from gagar_jax.rl import train

    def run(n, workdir):
        d = toy_gagar.get_config("binary,smoke").to_dict()
        d["loop"]["total_steps"] = 1
        d["task"]["canaries_per_step"] = n
        cfg = RunConfig.from_config_dict(d)
        train.train_and_evaluate(cfg, str(workdir))
        rows = writers.read_jsonl(str(workdir / "metrics.jsonl"))
        return cfg, [r for r in rows if r["phase"] == "train"]

    cfg, on = run(2, tmp_path / "on")
    _, off = run(0, tmp_path / "off")
    assert on[0]["canary_cheat_rate"] == 0.0
    assert on[0]["canary_rollouts"] == 2 * cfg.rollout.num_rollouts
    assert "canary_cheat_rate" not in off[0]
    for key in ("pass_rate", "pg_loss_mean", "entropy"):
        assert on[0][key] == off[0][key], key


def test_counters_merge_across_hosts_and_from_a_state_saved_without_canary_fields():
    import dataclasses

    a = collect.StepCounters(rollouts=4, valid=4, canary_groups=1, canary_rollouts=4)
    b = collect.StepCounters(rollouts=4, valid=4, canary_groups=1, canary_rollouts=4)
    a.canary_passed = 1  # one forged pass on host 0
    parts = [dataclasses.asdict(a), dataclasses.asdict(b)]
    m = collect.StepCounters.merged(parts).metrics()
    assert m["canary_rollouts"] == 8.0 and m["canary_cheat_rate"] == 1 / 8
    old = {k: v for k, v in parts[1].items() if not k.startswith("canary")}
    assert collect.StepCounters.merged([parts[0], old]).canary_rollouts == 4
