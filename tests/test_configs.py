"""The experiment configs: one source of defaults (configs/common.py), the argument parser, and
the main job's choices on top of the defaults."""

import os

import pytest

from configs import common, feedback_toy, swe_agent, toy_agent, toy_gagar, tpu_pod
from gagar_jax.feedback.run import FeedbackRunConfig
from gagar_jax.rl.config import TRAINING_MODES, RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _diff(a, b, prefix=""):
    """{dotted key: (a, b)} where two nested dicts differ."""
    out = {}
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out.update(_diff(x, y, f"{prefix}{k}."))
        elif x != y:
            out[prefix + k] = (x, y)
    return out


# ------------------------------------------------------------------------------- parse_arg
def test_parse_arg_words_flags_and_values():
    arg = common.parse_arg(
        "binary,smoke,steps=7,lr=1e-3,plot=false",
        words={"mode": TRAINING_MODES},
        mode="gagar",
        smoke=False,
        steps=3,
        lr=0.1,
        plot=True,
    )
    assert (arg.mode, arg.smoke, arg.steps, arg.lr, arg.plot) == ("binary", True, 7, 1e-3, False)
    defaults = common.parse_arg(None, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False)
    assert (defaults.mode, defaults.smoke) == ("gagar", False)


@pytest.mark.parametrize(
    "arg,match",
    [
        ("smok", r"'smok' not understood.*'smoke'"),  # a typo names itself and what is understood
        ("steps=x", r"steps='x': expected a int"),
        ("seed=1", r"unknown key 'seed'"),
        ("smoke=maybe", r"expected true or false"),
    ],
)
def test_parse_arg_rejects_by_name(arg, match):
    with pytest.raises(ValueError, match=match):
        common.parse_arg(arg, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False, steps=3)


# ------------------------------------------------------------------------------------ base
def test_base_is_the_run_config_defaults():
    cfg = RunConfig.from_config_dict(common.base())
    # decay_steps, score_window and shared_prefix are derived (from loop.total_steps,
    # rollout.max_new_tokens and the window) when a config leaves them out (base does)
    assert _diff(cfg.to_dict(), RunConfig().to_dict()) == {
        "learner.decay_steps": (RunConfig().loop.total_steps, RunConfig().learner.decay_steps),
        "learner.score_window": (RunConfig().rollout.max_new_tokens, 0),
        "learner.shared_prefix": (True, False),
    }


def test_base_leaves_derived_fields_derived():
    c = common.base()
    c.rollout.temperature = 0.3
    c.mode = "binary"
    cfg = RunConfig.from_config_dict(c)
    assert cfg.learner.temperature == 0.3 and cfg.learner.advantages.mode == "none"


def test_derived_fields_can_be_set_from_the_command_line():
    """Each derived field is an unset typed placeholder in base(): a command-line override
    (``--config.learner.score_window=0``, as scripts/train.py parses it) reaches it, and unset
    it stays derived."""
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..")
    child = (
        "import sys\n"
        "from absl import flags\n"
        "from ml_collections import config_flags\n"
        "from gagar_jax.rl.config import RunConfig\n"
        "config = config_flags.DEFINE_config_file('config')\n"
        "flags.FLAGS(sys.argv)\n"
        "c = RunConfig.from_config_dict(config.value)\n"
        "print(c.learner.score_window, c.learner.decay_steps, c.learner.temperature,"
        " c.rollout.temperature)\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            child,
            "--config=configs/toy_gagar.py",
            "--config.learner.score_window=0",
            "--config.learner.decay_steps=7",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    window, decay, temperature, rollout_temperature = out.stdout.split()
    assert (window, decay) == ("0", "7") and temperature == rollout_temperature
    c = common.base()
    for path in common.DERIVED_FIELDS:
        section = c
        for key in path[:-1]:
            section = section[key]
        assert section[path[-1]] is None
    with pytest.raises(TypeError):
        c.learner.score_window = "all"


def test_base_optional_fields_are_typed_placeholders():
    c = common.base()
    assert c.learner.dual_clip is None
    c.learner.dual_clip = 3.0
    with pytest.raises(TypeError):
        c.learner.dual_clip = "three"
    assert RunConfig.from_config_dict(c).learner.dual_clip == 3.0


# ------------------------------------------------------------------------ the experiments
def test_main_job_choices_on_top_of_the_defaults():
    """`make train` = RunConfig() plus exactly these choices (configs/toy_gagar.py)."""
    choices = _diff(
        RunConfig.from_config_dict(toy_gagar.get_config()).to_dict(), RunConfig().to_dict()
    )
    assert {k: v[0] for k, v in choices.items()} == {
        "task.num_train": 512,
        "model.hidden_size": 128,
        "model.head_dim": 32,
        "model.intermediate_size": 256,
        "rollout.max_prompt_len": 48,
        "rollout.max_new_tokens": 32,
        "sampling.allow_partial": True,
        "grading.max_concurrency": 2,
        "learner.learning_rate": 3e-4,
        "learner.warmup_steps": 3,
        "learner.decay_steps": 60,  # derived: loop.total_steps
        "learner.score_window": 32,  # derived: rollout.max_new_tokens
        "learner.shared_prefix": True,  # derived: there is a window
        "sft.steps": 300,
        "sft.lr": 3e-3,
        "loop.total_steps": 60,
        "loop.checkpoint_every": 10,
        "loop.eval_rollouts": 4,
    }


@pytest.mark.parametrize(
    "module,arg",
    [(toy_gagar, mode) for mode in TRAINING_MODES]
    + [
        (toy_gagar, "smoke"),
        (toy_gagar, "discount_only,imbalanced"),
        (toy_gagar, "gagar_token,distinguishing"),
        (toy_gagar, "binary,weak_start"),
        (toy_gagar, "weak_start,smoke"),
        (toy_agent, None),
        (toy_agent, "binary,smoke"),
        (swe_agent, None),
        (swe_agent, "smoke"),
        (tpu_pod, None),
        (tpu_pod, "smoke"),
        (tpu_pod, "smoke,sglang"),
    ],
)
def test_every_experiment_builds_and_validates(module, arg):
    cd = module.get_config(arg)
    cfg = RunConfig.from_config_dict(cd)
    words = (arg or "").split(",")
    assert cfg.mode == next((w for w in words if w in TRAINING_MODES), "gagar")
    assert ("_smoke" in cd.name) == ("smoke" in words) and cfg.name == cd.name


def test_mode_words_give_the_redistribution():
    got = {
        m: RunConfig.from_config_dict(toy_gagar.get_config(m)).redistribution
        for m in TRAINING_MODES
    }
    assert got == {
        "gagar": "sum_preserving",
        "binary": "none",
        "discount_only": "discount_only",
        "gagar_token": "sum_preserving",
    }


def test_weak_start_keeps_the_sft_start_and_evaluates_a_large_held_out_set():
    cfg = RunConfig.from_config_dict(toy_gagar.get_config("binary,weak_start"))
    default = RunConfig.from_config_dict(toy_gagar.get_config("binary"))
    assert cfg.sft.steps == toy_gagar.WEAK_START_SFT_STEPS < default.sft.steps
    assert cfg.task.num_eval == toy_gagar.WEAK_START_EVAL_TASKS > default.task.num_eval
    assert cfg.loop.eval_every == cfg.loop.total_steps == default.loop.total_steps
    # every checkpoint of the run stays, step 0 (the SFT start) included
    assert cfg.loop.keep_checkpoints >= cfg.loop.total_steps // cfg.loop.checkpoint_every + 1
    assert cfg.name == "toy_binary_weak_start"
    assert (cfg.learner, cfg.rollout, cfg.model) == (
        default.learner,
        default.rollout,
        default.model,
    )


def test_distinguishing_selects_the_contrastive_token_credit():
    cfg = RunConfig.from_config_dict(toy_gagar.get_config("gagar_token,distinguishing"))
    assert (cfg.learner.token_credit, cfg.learner.token_gamma) == ("distinguishing", 1.0)
    with pytest.raises(ValueError, match="needs mode gagar_token"):
        toy_gagar.get_config("gagar,distinguishing")


def test_tpu_pod_sglang_needs_smoke():
    with pytest.raises(ValueError, match="'sglang' is a variant of 'smoke'"):
        tpu_pod.get_config("sglang")


@pytest.mark.parametrize("arg", [None, "rw_sft,smoke", "sft_penalize_negative"])
def test_feedback_config_builds(arg):
    cfg = FeedbackRunConfig.from_config_dict(feedback_toy.get_config(arg).to_dict())
    assert cfg.objective.mode == (arg or "span_kto").split(",")[0]


def test_config_files_load_each_other_by_import():
    """No config file loads another by path (configs/ is a package)."""
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, "configs", name), encoding="utf-8") as f:
                assert "spec_from_file_location" not in f.read(), name


def test_feedback_config_sections_are_the_library_types():
    from gagar_jax.models import TransformerConfig
    from gagar_jax.update import UpdateConfig

    cfg = FeedbackRunConfig.from_config_dict(feedback_toy.get_config("sft"))
    assert isinstance(cfg.model, TransformerConfig) and isinstance(cfg.learner, UpdateConfig)
    # decay_steps follows the loop unless set; rope_theta is a field like any other
    assert cfg.learner.decay_steps == cfg.loop.steps and cfg.model.rope_theta == 10000.0
    c = feedback_toy.get_config("sft")
    c.learner.decay_steps = 7
    c.model.rope_theta = 5e5
    cfg = FeedbackRunConfig.from_config_dict(c)
    assert (cfg.learner.decay_steps, cfg.model.rope_theta) == (7, 5e5)
    assert FeedbackRunConfig.from_config_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("section,key", [("learner", "lr"), ("model", "hiddn_size")])
def test_feedback_config_unknown_library_field_is_named(section, key):
    from gagar_jax.feedback.run import FeedbackConfigError

    d = feedback_toy.get_config().to_dict()
    d[section][key] = 1
    with pytest.raises(FeedbackConfigError, match=rf"config\.{section}: unknown keys \['{key}'\]"):
        FeedbackRunConfig.from_config_dict(d)
