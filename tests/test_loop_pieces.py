"""Unit tests of the training loop's host-side pieces: config, dynamic sampling, packing,
resume bookkeeping and metrics output."""

import dataclasses
import importlib
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gagar_jax.analysis import writers
from gagar_jax.rl import collect, grade, resume
from gagar_jax.rl.config import ConfigError, RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config_module(name):
    return importlib.import_module(f"configs.{name}")


# ---------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("arg", [None, "smoke", "binary", "discount_only,smoke", "gagar"])
def test_toy_config_builds_and_validates(arg):
    cfg = RunConfig.from_config_dict(load_config_module("toy_gagar").get_config(arg))
    mode = (arg or "gagar").split(",")[0] if arg not in (None, "smoke") else "gagar"
    assert cfg.mode == mode
    assert (
        cfg.redistribution
        == {"gagar": "sum_preserving", "binary": "none", "discount_only": "discount_only"}[mode]
    )
    if arg and "smoke" in arg:
        assert cfg.loop.total_steps <= 5


@pytest.mark.parametrize("name", ["swe_agent", "tpu_pod"])
def test_scale_configs_validate(name):
    module = load_config_module(name)
    cfg = RunConfig.from_config_dict(module.get_config(None))
    # repository tasks, rolled out and graded by SGLang servers, from an SFT'd checkpoint
    assert (cfg.task.family, cfg.rollout.engine, cfg.grading.grader) == (
        "python_repo",
        "sglang",
        "agentic",
    )
    assert cfg.sft.steps == 0 and cfg.hf_checkpoint
    cfg_smoke = RunConfig.from_config_dict(module.get_config("smoke"))
    assert cfg_smoke.loop.total_steps < cfg.loop.total_steps
    assert cfg_smoke.batch_rollouts < cfg.batch_rollouts


def test_tpu_pod_config_is_the_papers_controlled_batch():
    cfg = RunConfig.from_config_dict(load_config_module("tpu_pod").get_config(None))
    assert (cfg.rollout.num_prompts, cfg.rollout.num_rollouts) == (128, 16)


def test_config_argument_typo_is_an_error():
    with pytest.raises(ValueError, match="smok"):
        load_config_module("toy_gagar").get_config("smok")


def test_unknown_field_is_named():
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    cd["learner"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match=r"learner\.lrr"):
        RunConfig.from_config_dict(cd)
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    cd["optimizer"] = {}
    with pytest.raises(ConfigError, match="optimizer"):
        RunConfig.from_config_dict(cd)


@pytest.mark.parametrize(
    "section,field,value,match",
    [
        ("learner", "learning_rate", -1.0, r"learner\.learning_rate must be >= 0"),
        ("rollout", "num_rollouts", 1, r"rollout\.num_rollouts"),
        ("rollout", "engine", "vllm", r"rollout\.engine"),
        ("model", "num_kv_heads", 3, r"config\.model: .*num_kv_heads"),
        ("mesh", "shape", (-1, -1, 1), r"mesh\.shape"),
        ("sampling", "oversample", 0.5, r"sampling\.oversample"),
    ],
)
def test_bad_value_names_field(section, field, value, match):
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    cd[section][field] = value
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_config_dict(cd)


def test_gagar_needs_grader():
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    cd["grading"]["enabled"] = False
    with pytest.raises(ConfigError, match="grading.enabled"):
        RunConfig.from_config_dict(cd)
    cd["mode"] = "binary"
    assert RunConfig.from_config_dict(cd).mode == "binary"


def test_config_is_frozen_and_fingerprint_tracks_what_matters():
    cd = load_config_module("toy_gagar").get_config("smoke")
    cfg = RunConfig.from_config_dict(cd)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learner.learning_rate = 1.0  # frozen
    d = cd.to_dict()
    d["loop"]["total_steps"] = 99
    assert RunConfig.from_config_dict(d).fingerprint() == cfg.fingerprint()
    d["learner"]["learning_rate"] = 1e-2
    assert RunConfig.from_config_dict(d).fingerprint() != cfg.fingerprint()


def test_config_sections_are_the_library_types():
    """One config layer: ``model`` is the TransformerConfig, ``learner`` the UpdateConfig the
    update receives (with its GagarConfig); the derived fields come from the run's choices and
    a config that contradicts them is refused, naming the field."""
    from gagar_jax.advantages import GagarConfig
    from gagar_jax.models import TransformerConfig
    from gagar_jax.update import UpdateConfig

    cd = load_config_module("toy_gagar").get_config("binary,smoke").to_dict()
    cd["rollout"]["temperature"] = 0.6
    cd["loop"]["total_steps"] = 7
    cd["learner"]["num_minibatches"] = 2
    cfg = RunConfig.from_config_dict(cd)
    assert type(cfg.model) is TransformerConfig and type(cfg.learner) is UpdateConfig
    assert type(cfg.learner.advantages) is GagarConfig
    assert cfg.learner.learning_rate == cd["learner"]["learning_rate"]
    assert cfg.learner.temperature == 0.6  # the sampler's: the update scores at it
    assert cfg.learner.decay_steps == 7 * 2  # optimizer steps of the run
    assert cfg.learner.advantages.mode == "none" and cfg.learner.token_credit == "broadcast"
    assert cfg.model_config(139).vocab_size == 139
    assert cfg.model_config(139).hidden_size == cd["model"]["hidden_size"]
    assert RunConfig.from_config_dict(cfg.to_dict()) == cfg  # config.json round trip
    token = load_config_module("toy_gagar").get_config("gagar_token,smoke")
    assert RunConfig.from_config_dict(token).learner.token_credit == "evidence"
    for section, field, value, match in [
        ("learner", "temperature", 0.5, r"learner\.temperature"),
        ("learner", "token_credit", "entropy", r"learner\.token_credit"),
        ("advantages", "mode", "sum_preserving", r"learner\.advantages\.mode"),
        ("advantages", "estimator", "ppo", r"config\.learner\.advantages: estimator"),
        ("model", "dtype", "int8", r"config\.model: model\.dtype"),
    ]:
        bad = load_config_module("toy_gagar").get_config("binary,smoke").to_dict()
        (bad["learner"]["advantages"] if section == "advantages" else bad[section])[field] = value
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_config_dict(bad)


# ---------------------------------------------------------------------- dynamic sampling
def make_group(gid, passes, K=4, prompt_len=3, resp_len=2, infra=()):
    rollouts = []
    for k in range(K):
        rollouts.append(
            collect.Rollout(
                prompt_tokens=list(range(1, prompt_len + 1)),
                response_tokens=[7] * resp_len,
                logprobs=[-0.5] * resp_len,
                passed=k < passes,
                infra_error=k in infra,
            )
        )
    return collect.Group(group_id=str(gid), task=None, rollouts=rollouts)


class ScriptedDraw:
    """Draws groups whose pass counts follow a fixed script (0 = all fail, K = all pass)."""

    def __init__(self, script, K=4):
        self.script, self.K, self.pos, self.calls = list(script), K, 0, []

    def __call__(self, n):
        self.calls.append(n)
        out = []
        for _ in range(n):
            passes = self.script[self.pos % len(self.script)]
            out.append(make_group(self.pos, passes, K=self.K))
            self.pos += 1
        return out


def test_group_outcomes():
    assert make_group(0, 2).outcome == "mixed"
    assert make_group(0, 4).outcome == "all_pass"
    assert make_group(0, 0).outcome == "all_fail"
    assert make_group(0, 0, infra=(0, 1, 2, 3)).outcome == "empty"
    # an infra error is masked, not a failure: 3 valid, all passing -> all_pass
    g = make_group(0, 3, infra=(3,))
    assert g.outcome == "all_pass" and g.valid_mask() == [True, True, True, False]


def test_refill_until_target_and_oversample():
    draw = ScriptedDraw([0, 2, 4, 1])  # every other group is mixed
    kept_order = []
    res = collect.collect_groups(
        draw,
        target=4,
        oversample=1.5,
        max_rounds=5,
        on_keep=lambda g: kept_order.append(g.group_id),
    )
    assert len(res.groups) == 4 and all(g.is_mixed for g in res.groups)
    # round 1 draws ceil(1.5*4)=6 (3 mixed), round 2 draws ceil(1.5*1)=2 (1 mixed)
    assert draw.calls == [6, 2] and res.rounds == 2 and res.drawn == 8
    assert kept_order == [g.group_id for g in res.groups]
    assert res.counts == {"mixed": 4, "all_pass": 2, "all_fail": 2, "empty": 0}
    m = res.metrics(4)
    assert m["sampling_fill"] == 1.0 and m["sampling_mixed_frac"] == 0.5


def test_extra_mixed_groups_are_counted_not_kept():
    res = collect.collect_groups(ScriptedDraw([2]), target=2, oversample=2.0)
    assert len(res.groups) == 2 and res.discarded_mixed == 2


@pytest.mark.parametrize("script,word", [([4, 4, 4, 2], "too easy"), ([0, 0, 0, 1], "too hard")])
def test_cap_raises_clear_error(script, word):
    draw = ScriptedDraw(script)
    with pytest.raises(collect.DynamicSamplingError, match=word) as e:
        collect.collect_groups(draw, target=8, oversample=1.0, max_rounds=2)
    assert "sampling.max_rounds=2" in str(e.value)
    assert len(draw.calls) == 2  # stops at the cap, never loops forever


def test_cap_with_nothing_mixed_raises_even_if_partial_allowed():
    with pytest.raises(collect.DynamicSamplingError, match="0 of 2"):
        collect.collect_groups(ScriptedDraw([0]), target=2, max_rounds=2, allow_partial=True)


def test_partial_batches_when_allowed():
    res = collect.collect_groups(
        ScriptedDraw([0, 0, 0, 2]), target=8, oversample=1.0, max_rounds=2, allow_partial=True
    )
    assert 0 < len(res.groups) < 8 and res.rounds == 2


def test_disabled_keeps_first_draw():
    res = collect.collect_groups(ScriptedDraw([0, 4, 2]), target=3, enabled=False)
    assert [g.outcome for g in res.groups] == ["all_fail", "all_pass", "mixed"]
    assert res.rounds == 1


# ---------------------------------------------------------------------------------- packing
def test_pack_layout():
    g = make_group("a", 2, K=3, prompt_len=3, resp_len=2, infra=(2,))
    grades = grade.no_grades(2, 3, 3)
    grades.tier[0], grades.rank[0], grades.graded[0] = [1, 2, 1], [1, 2, 1], True
    b = collect.pack_groups(
        [g], grades, num_groups=2, num_rollouts=3, max_prompt_len=4, max_new_tokens=3, pad_id=0
    )
    assert b.tokens.shape == (2 * 3, 7)  # group-major rows n = g * K + k
    np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 7, 7, 0, 0])
    np.testing.assert_array_equal(b.response_mask[0], [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.attention_mask[0], [1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 4, 0, 0])
    np.testing.assert_allclose(b.old_logprobs[0], [0, 0, 0, -0.5, -0.5, 0, 0])
    np.testing.assert_array_equal(b.rewards[0], [1, 1, 0])
    np.testing.assert_array_equal(b.valid, [[1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(b.graded, [1, 0])
    np.testing.assert_array_equal(b.tier[0], [1, 2, 1])
    assert not b.response_mask[3:].any()  # padding group carries no loss tokens


def test_pack_rejects_grades_of_another_shape():
    with pytest.raises(ValueError, match=r"grades\.evidence has shape"):
        collect.pack_groups(
            [make_group("a", 2)],
            grade.no_grades(1, 4, 5),
            num_groups=1,
            num_rollouts=4,
            max_prompt_len=3,
            max_new_tokens=2,
            pad_id=0,
        )


def test_cheat_gets_zero_reward():
    g = make_group("c", 2, K=2)
    g.rollouts[0].cheat = True
    b = collect.pack_groups(
        [g], num_groups=1, num_rollouts=2, max_prompt_len=3, max_new_tokens=2, pad_id=0
    )
    np.testing.assert_array_equal(b.rewards[0], [0, 1])
    np.testing.assert_array_equal(b.cheat[0], [1, 0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_prompt_len=2), "rollout.max_prompt_len"),
        (dict(max_new_tokens=1), "rollout.max_new_tokens"),
        (dict(num_groups=0), "num_groups=0"),
    ],
)
def test_pack_rejects_what_does_not_fit(kwargs, match):
    base = dict(num_groups=1, num_rollouts=4, max_prompt_len=3, max_new_tokens=2, pad_id=0)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        collect.pack_groups([make_group("x", 2)], **base)


def test_refills_keep_batch_shapes_static_one_trace():
    """However many refill rounds a step took, or a partial batch, the update traces once."""

    @jax.jit
    @chex.assert_max_traces(n=1)
    def fake_update(batch):
        # touches every field so that any shape/dtype change would retrace
        return sum(jnp.sum(jnp.asarray(x, jnp.float32)) for x in batch if x is not None)

    chex.clear_trace_counter()
    for script, partial in [([2], False), ([0, 4, 2], False), ([0, 0, 0, 0, 0, 2], True)]:
        res = collect.collect_groups(
            ScriptedDraw(script), target=4, max_rounds=6, oversample=1.0, allow_partial=partial
        )
        batch = collect.pack_groups(
            res.groups, num_groups=4, num_rollouts=4, max_prompt_len=5, max_new_tokens=3, pad_id=0
        )
        fake_update(batch)


# ------------------------------------------------------------------------------- resume
def test_task_stream_epochs_are_permutations_and_resume_exactly():
    s = resume.TaskStream(7, seed=3)
    idx, pos = s.take(0, 21)
    assert pos == 21
    for e in range(3):
        assert sorted(idx[7 * e : 7 * e + 7]) == list(range(7))
    assert idx[:7] != idx[7:14]  # reshuffled per epoch (fixed seed: deterministic)
    # a "resumed" stream from position 10 continues exactly
    s2 = resume.TaskStream(7, seed=3)
    a, _ = s2.take(10, 11)
    assert a == idx[10:21]


def test_loop_state_is_an_item_of_the_checkpoint_step(tmp_path):
    """The loop state goes into the same orbax step as the train state: a step is listed only
    when both are written (an unfinished one is invisible), keep-N drops both together, and
    the state comes back exactly."""
    from gagar_jax.models import TransformerConfig
    from gagar_jax.update import Checkpointer, TrainState, UpdateConfig

    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params={"w": jnp.arange(4.0)},
        opt_state=(),
    )
    ckpt = Checkpointer(
        str(tmp_path),
        model_config=TransformerConfig(4, 8, 1, 2, 1, 8),
        update_config=UpdateConfig(),
        keep=2,
        fingerprint="ab",
    )
    st = resume.LoopState(
        step=5,
        data_position=40,
        rng_key=[0, 7],
        policy_version=5,
        sft_done=True,
        grader_cache={"k": {"tier": [1, 2]}},
    )
    for step, ls in ((5, st), (10, resume.LoopState(step=10))):
        ckpt.save(
            step,
            state,
            data_position=ls.data_position,
            extra={resume.LOOP_STATE_KEY: dataclasses.asdict(ls)},
            wait=True,
        )
    assert resume.read_loop_state(str(tmp_path), 5) == st
    # checkpoint 15 not finished (killed while writing): orbax does not list it -> resume from 10
    (tmp_path / "15.orbax-checkpoint-tmp-1").mkdir()
    assert ckpt.all_steps() == [5, 10]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    _, info = ckpt.restore(abstract)
    assert info.step == 10 and info.extra[resume.LOOP_STATE_KEY]["step"] == 10
    ckpt.save(15, state, extra={resume.LOOP_STATE_KEY: {"step": 15}}, wait=True)
    assert ckpt.all_steps() == [10, 15]
    ckpt.close()
    with pytest.raises(ValueError, match="unknown fields"):
        resume.LoopState.from_json(json.dumps({"step": 1, "bogus": 2}))


# ------------------------------------------------------------------------------- metrics
def test_metrics_writer_jsonl_tensorboard_console(tmp_path):
    import io

    out = io.StringIO()
    w = writers.MetricsWriter(str(tmp_path), total_steps=4, stream=out)
    for step in range(4):
        w.write(step, {"pass_rate": 0.1 * step, "entropy": float("nan"), "t1_share": 0.5})
        line = w.progress(step, {"pass_rate": 0.1 * step, "t1_share": 0.5})
    w.write(3, {"eval_pass_rate": 0.75}, phase="eval")
    w.close()
    assert "step 4/4" in line and "ETA" in line and "pass 0.30" in line and "T1 0.50" in line
    assert out.getvalue().count("\n") == 4
    rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert len(rows) == 5 and rows[1]["pass_rate"] == pytest.approx(0.1)
    assert rows[0]["entropy"] is None  # non-finite kept as null, not NaN in JSON
    events = os.listdir(tmp_path / "tb")
    assert events and events[0].startswith("events.out.tfevents")
    assert os.path.getsize(tmp_path / "tb" / events[0]) > 100
    # resume drops the steps that will be redone
    assert writers.truncate_jsonl(str(tmp_path / "metrics.jsonl"), keep_before_step=2) == 3
    assert [r["step"] for r in writers.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0, 1]


def test_truncate_keeps_finished_sft_rows_drops_unfinished(tmp_path):
    p = str(tmp_path / "metrics.jsonl")
    w = writers.MetricsWriter(str(tmp_path), total_steps=3, tensorboard=False)
    for s in range(5):
        w.write(s, {"sft_loss": 1.0}, phase="sft")
    for s in range(3):
        w.write(s, {"pass_rate": 0.5})
    w.close()
    assert writers.truncate_jsonl(p, keep_before_step=1) == 2  # train steps 1, 2
    assert len(writers.read_jsonl(p)) == 6
    assert writers.truncate_jsonl(p, keep_before_step=0, drop_phases=("sft",)) == 6


def test_non_primary_process_writes_nothing(tmp_path):
    w = writers.MetricsWriter(str(tmp_path / "w"), total_steps=2, primary=False)
    w.write(0, {"a": 1.0})
    w.progress(0, {"a": 1.0})
    w.close()
    assert not os.path.exists(tmp_path / "w")


def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "phase": "train", "pass_rate": 0.5}\n{"step": 1, "pha')
    assert len(writers.read_jsonl(str(p))) == 1


def test_plot_and_summary_and_table(tmp_path):
    w = writers.MetricsWriter(str(tmp_path), total_steps=10, tensorboard=False)
    for s in range(10):
        w.write(
            s,
            {
                "pass_rate": s / 10,
                "quality": 0.5,
                "t1_share": 0.2 + s / 100,
                "response_length": 20 - s,
                "entropy": 1.0,
                "pg_loss_mean": 0.0,
                "credit_ratio": 1.0,
            },
        )
    w.write(9, {"eval_pass_rate": 0.6}, phase="eval")
    w.close()
    png = writers.plot_run(str(tmp_path))
    assert os.path.getsize(png) > 10_000
    s = writers.summarize(writers.read_jsonl(str(tmp_path / "metrics.jsonl")), window=2)
    assert s["pass_rate_first"] == pytest.approx(0.05)
    assert s["pass_rate_last"] == pytest.approx(0.85)
    assert s["eval_pass_rate_last"] == 0.6
    table = writers.markdown_table({"run": s})
    assert "| run |" in table and "0.05 -> 0.85" in table


def test_compare_runs_writes_plot_table_and_ablation_notes(tmp_path):
    def fake_run(name, quality, entropy, credit):
        w = writers.MetricsWriter(str(tmp_path / name), total_steps=6, tensorboard=False)
        for s in range(6):
            w.write(
                s,
                {
                    "pass_rate": 0.3,
                    "quality": quality[0] + s * quality[1],
                    "t1_share": 0.5,
                    "response_length": 10.0,
                    "entropy": entropy,
                    "pg_loss_mean": 0.01,
                    "credit_ratio": credit,
                },
            )
        w.close()
        return str(tmp_path / name)

    runs = {
        "gagar": fake_run("gagar", (0.5, 0.05), 1.0, 1.0),
        "binary": fake_run("binary", (0.5, 0.0), 1.0, 1.0),
        "discount_only": fake_run("discount_only", (0.5, 0.02), 1.5, 0.8),
    }
    md = writers.compare_runs(runs, str(tmp_path / "cmp"), window=2)
    assert os.path.getsize(tmp_path / "cmp" / "comparison.png") > 10_000
    assert (tmp_path / "cmp" / "comparison.md").read_text() == md
    assert "| gagar |" in md and "| discount_only |" in md
    assert "- quality: gagar 0.725 vs binary 0.5" in md and "reproduced" in md
    assert "entropy: discount_only 1.5 vs gagar 1" in md
    with pytest.raises(FileNotFoundError, match="nope"):
        writers.compare_runs({"nope": str(tmp_path / "nope")}, str(tmp_path / "x"))


def test_mesh_shape_resolution():
    from gagar_jax.update.state import mesh_shape

    assert mesh_shape((1, -1, 1), 8) == (1, 8, 1)
    assert mesh_shape((2, 2, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match="mesh.shape"):
        mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match="needs 4 devices"):
        mesh_shape((2, 2, 1), 8)


def test_distributed_init_is_a_noop_single_process(monkeypatch):
    from gagar_jax.rl import train
    from gagar_jax.rl.config import MeshConfig

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    train.initialize_distributed(MeshConfig())  # nothing configured: must not touch jax.distributed
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    with pytest.raises(ValueError, match="process id 5"):
        train.initialize_distributed(MeshConfig())


def test_infra_error_rate_is_counted_per_policy_version():
    # issue 11: infra_error is masked (never scored), so its rate per policy version is reported.
    from gagar_jax.rl.collect import Group, Rollout
    from gagar_jax.rl.train import StepCounters

    def r(version, infra):
        return Rollout([1], [2], [0.0], policy_version=version, infra_error=infra)

    c = StepCounters()
    c.add(Group("g0", None, [r(3, True), r(3, False), r(3, False), r(3, False)]))
    c.add(Group("g1", None, [r(4, True), r(4, True)]))
    m = c.metrics()
    assert m["infra_errors"] == 3 and m["infra_error_rate"] == pytest.approx(0.5)
    assert c.by_version == {3: [4, 1], 4: [2, 2]}


# ------------------------------------------------------------ skipping saturated tasks
def _tracker(history, window=4, min_attempts=2):
    from gagar_jax.data.audit import PassRateTracker

    tr = PassRateTracker(window, min_attempts)
    for task, passed in history.items():
        tr.record(str(task), passed)
    return tr


def test_select_prompts_skips_saturated_tasks_within_the_window():
    T, F = True, False
    tr = _tracker(
        {
            2: [T, T],  # all pass, enough attempts: skipped
            5: [F, F, F],  # all fail: skipped
            6: [T, F, F, F, F],  # the last 4 (the window) all fail: skipped
            1: [F, F, F, T],  # mixed within the window: kept
            3: [T, F],  # mixed: kept
            4: [T],  # too few attempts (min_attempts=2): kept
        }
    )
    assert [t for t in map(str, range(8)) if tr.skip(t)] == ["2", "5", "6"]
    stream = resume.TaskStream(8, seed=1)
    skip = lambda i: tr.skip(str(i))  # noqa: E731
    idx, pos, new_pos, skipped = collect.select_prompts(stream, 3, 10, skip)
    plain, _ = stream.take(3, new_pos - 3)
    assert idx == [i for i in plain if i not in (2, 5, 6)]
    assert len(idx) == 10 and skipped == new_pos - 3 - 10 > 0
    assert [stream.index(p) for p in pos] == idx and pos == sorted(pos)
    # flag off (skip=None): exactly the stream, positions contiguous, nothing skipped
    assert collect.select_prompts(stream, 3, 10) == (
        stream.take(3, 10)[0],
        list(range(3, 13)),
        13,
        0,
    )
    # every task saturated: selection still ends (takes after a full pool of skips)
    idx, _, new_pos, skipped = collect.select_prompts(stream, 0, 3, lambda i: True)
    assert len(idx) == 3 and skipped == 8 * 3 and new_pos == 3 + 8 * 3


def test_pass_rate_tracker_state_round_trips():
    from gagar_jax.data.audit import PassRateTracker

    tr = _tracker({"a": [True, False, True, True, True], "b": [False] * 3}, window=3)
    back = PassRateTracker.from_state(json.loads(json.dumps(tr.state_dict())))
    assert back.state_dict() == tr.state_dict()
    assert back.saturated() == tr.saturated() == ["a", "b"]
    assert back.attempts("a") == (True, True, True)


class _Hosts:
    """Simulated hosts (threads) exchanging JSON like the real coordinator does."""

    def __init__(self, index, count, board, barrier):
        self.index, self.count, self.board, self.barrier = index, count, board, barrier

    def allgather(self, tag, value):
        self.board[(tag, self.index)] = json.loads(json.dumps(value))
        self.barrier.wait()
        out = [self.board[(tag, i)] for i in range(self.count)]
        self.barrier.wait()
        return out


def _skip_saturated_steps(monkeypatch, *, skip, num_hosts, steps=3):
    """Runs collect_step for ``steps`` steps on ``num_hosts`` simulated hosts; task i's groups
    pass ``PASSES[i]`` of 4 rollouts. Returns per host: (tasks drawn per step, metrics, state)."""
    import threading
    import types

    from gagar_jax.data.audit import PassRateTracker
    from gagar_jax.rl import train

    passes = [4, 0, 2, 1, 3, 0, 2, 4]  # tasks 0, 1, 5, 7 saturate after one group
    drawn: dict[tuple[int, int], list[int]] = {}

    def fake_generate(engine, family, tasks, *, step, **kw):
        key = (threading.current_thread().host, step)
        drawn.setdefault(key, []).extend(tasks)
        return [make_group(f"{step}-{t}", passes[t]) for t in tasks]

    monkeypatch.setattr(train, "generate_groups", fake_generate)
    cd = load_config_module("toy_gagar").get_config("binary,smoke").to_dict()
    cd["rollout"].update(
        num_prompts=2 * num_hosts, num_rollouts=4, max_prompt_len=8, max_new_tokens=8
    )
    cd["task"].update(
        num_train=8, skip_saturated=skip, saturation_window=4, saturation_min_attempts=4
    )
    cd["grading"]["enabled"] = False
    cd["sampling"].update(enabled=True, allow_partial=True, max_rounds=4)
    cfg = RunConfig.from_config_dict(cd)
    family = types.SimpleNamespace(
        train_task=lambda i: i, tokenizer=types.SimpleNamespace(pad_id=0)
    )
    board, barrier, out = {}, threading.Barrier(num_hosts), {}

    def host(h):
        threading.current_thread().host = h
        hosts = _Hosts(h, num_hosts, board, barrier)
        ls = resume.LoopState(rng_key=[0, 1])
        tracker = PassRateTracker(4, 4) if skip else None
        ms = []
        for step in range(steps):
            sres, *_ = train.collect_step(
                None,
                family,
                None,
                resume.TaskStream(8, seed=0),
                ls,
                cfg,
                step=step,
                hosts=hosts,
                tracker=tracker,
            )
            ms.append(train.saturation_metrics(sres, tracker) if tracker else {})
        out[h] = (ms, tracker.state_dict() if tracker else None, ls.data_position)

    threads = [threading.Thread(target=host, args=(h,)) for h in range(num_hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == num_hosts
    tasks = {s: [t for h in range(num_hosts) for t in drawn.get((h, s), [])] for s in range(steps)}
    return tasks, out


@pytest.mark.parametrize("num_hosts", [1, 2])
def test_collect_step_skips_saturated_tasks_identically_on_every_host(monkeypatch, num_hosts):
    tasks, out = _skip_saturated_steps(monkeypatch, skip=True, num_hosts=num_hosts)
    saturated = {0, 1, 5, 7}
    seen: set[int] = set()
    for s in range(3):
        # a task drawn in an earlier step and saturated there is never drawn again
        assert not set(tasks[s]) & (seen & saturated)
        seen |= set(tasks[s])
    assert seen & saturated  # some were drawn once (and then skipped)
    ms, state, pos = out[0]
    assert sum(m["sampling_skipped_saturated"] for m in ms) > 0
    assert ms[-1]["sampling_saturated_tasks"] == len(seen & saturated)
    assert set(state["attempts"]) == {str(t) for t in seen}
    for h in range(1, num_hosts):  # the same tracker, metrics and stream on every host
        assert out[h] == out[0]


def test_collect_step_without_skip_saturated_draws_the_plain_stream(monkeypatch):
    tasks, out = _skip_saturated_steps(monkeypatch, skip=False, num_hosts=2)
    _, _, pos = out[0]
    drawn = [t for s in range(3) for t in tasks[s]]
    # every host draws all prompts of a round and generates its block: in stream order per
    # round; over the run exactly the stream's first `pos` tasks, none skipped
    assert sorted(drawn) == sorted(resume.TaskStream(8, seed=0).take(0, pos)[0])


def test_skip_saturated_config_and_fingerprint():
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    base = RunConfig.from_config_dict(cd)
    assert base.task.skip_saturated is False
    cd["task"]["saturation_window"] = 16  # unused while the flag is off: same run
    assert RunConfig.from_config_dict(cd).fingerprint() == base.fingerprint()
    cd["task"]["skip_saturated"] = True
    assert RunConfig.from_config_dict(cd).fingerprint() != base.fingerprint()
    cd["task"]["saturation_min_attempts"] = 17
    with pytest.raises(ConfigError, match="task.saturation_min_attempts"):
        RunConfig.from_config_dict(cd)


def test_skip_saturated_tracker_resumes_from_the_loop_state(tmp_path):
    from gagar_jax.rl import train

    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    assert train.pass_rate_tracker(RunConfig.from_config_dict(cd), resume.LoopState()) is None
    cd["task"].update(skip_saturated=True, saturation_window=3, saturation_min_attempts=2)
    cfg = RunConfig.from_config_dict(cd)
    ls = resume.LoopState(step=4)
    fresh = train.pass_rate_tracker(cfg, ls)
    assert (fresh.window, fresh.min_attempts, fresh.saturated()) == (3, 2, [])
    fresh.record("5", [True, True])
    fresh.record("2", [False, True, False])
    ls.extra[train.PASS_RATES_KEY] = fresh.state_dict()  # what the loop saves at a checkpoint
    back = train.pass_rate_tracker(cfg, resume.LoopState.from_json(ls.to_json()))  # saved form
    assert back.state_dict() == fresh.state_dict() and back.saturated() == ["5"]
