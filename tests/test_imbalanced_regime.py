"""The discount-only regime (`configs/toy_gagar.py:imbalanced`): SFT demonstrations narrowed by
`task.demo_kinds`, so the warm-started policy writes T2 patches and discount-only's credit
imbalance persists through RL (README "The discount-only question")."""

import pytest

from configs import toy_gagar
from gagar_jax.envs import TOKENIZER, candidate_patches, toy_grading, verify
from gagar_jax.envs.family import FamilySettings, make_family
from gagar_jax.envs.toy_family import DEMO_KINDS, parse_demo_kinds
from gagar_jax.grading.heuristic import HeuristicGrader


def _config(arg):
    return toy_gagar, toy_gagar.get_config(arg)


def test_parse_demo_kinds():
    assert parse_demo_kinds("") == DEMO_KINDS
    assert parse_demo_kinds(" side_effect, sprawling ") == ("sprawling", "side_effect")
    assert parse_demo_kinds(["out_of_scope"]) == ("out_of_scope",)
    with pytest.raises(ValueError, match=r"task\.demo_kinds.*cheat"):
        parse_demo_kinds("sprawling,cheat")


@pytest.mark.parametrize("family", ["toy", "toy_agent"])
def test_demo_kinds_narrow_the_demonstrations(family):
    kinds = "sprawling,out_of_scope,side_effect"
    settings = dict(num_train=8, num_eval=2, max_prompt_len=128)
    full = make_family(family, FamilySettings(**settings))
    narrow = make_family(family, FamilySettings(**settings, extra={"demo_kinds": kinds}))
    assert narrow.demo_kinds == ("sprawling", "out_of_scope", "side_effect")
    n_full, n_narrow = len(full.demonstrations(6)), len(narrow.demonstrations(6))
    assert 0 < n_narrow < n_full
    for task in narrow._sft.tasks(6):
        got = narrow.demonstration_patches(task)
        cands = candidate_patches(task)
        want = [cands[k] for k in ("sprawling", "out_of_scope", "side_effect") if k in cands]
        assert got == want
        assert cands["minimal"] not in got and cands.get("inconsistent") not in got


def test_no_demonstrated_kind_is_t1_so_discounting_has_something_to_discount():
    # The premise of the regime: the heuristic grader puts only `minimal` in T1, so a policy
    # warm-started without it writes T2 passes, which discount_only scales by 0.6.
    fam = make_family(
        "toy",
        FamilySettings(
            num_train=8,
            num_eval=2,
            max_prompt_len=128,
            extra={"demo_kinds": "sprawling,out_of_scope,side_effect"},
        ),
    )
    grader = HeuristicGrader()
    for i, task in enumerate(fam._sft.tasks(8)):
        demos = fam.demonstration_patches(task)
        patches = demos + [task.reference_patch]
        ws = toy_grading.toy_group(task, f"g{i}", patches)
        v = grader.grade(ws)
        tiers = [v.judgement(c.candidate_id).tier for c in ws.candidates]
        assert tiers[-1] == 1 and all(t >= 2 for t in tiers[:-1]), tiers
        for p in demos:
            assert verify(task, p).passed and TOKENIZER.encode(p)


def test_imbalanced_config_variant():
    from gagar_jax.rl.config import RunConfig
    from gagar_jax.rl.train import family_settings

    module, cd = _config("discount_only,imbalanced")
    cfg = RunConfig.from_config_dict(cd)
    assert cfg.mode == "discount_only" and cfg.task.demo_kinds == module.IMBALANCED_DEMO_KINDS
    assert cfg.learner.learning_rate == 1e-3 and cfg.sft.steps == 150
    assert cfg.loop.total_steps == module.IMBALANCED_STEPS
    assert family_settings(cfg).extra == {"demo_kinds": module.IMBALANCED_DEMO_KINDS}
    assert cd.name == "toy_discount_only_imbalanced"
    _, smoke = _config("imbalanced,smoke")
    assert RunConfig.from_config_dict(smoke).loop.total_steps <= 5
    _, default = _config(None)
    assert family_settings(RunConfig.from_config_dict(default)).extra == {}
    with pytest.raises(ValueError, match="imbalance"):
        _config("imbalance")
