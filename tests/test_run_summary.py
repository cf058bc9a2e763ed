"""The console summary of a finished run (gagar_jax.analysis.writers.format_summary): the held-out
pass rate's change against one evaluation's noise, and what improved, in words."""

import math

import pytest

from gagar_jax.analysis import writers


def _summary(eval_first, eval_last, quality=(0.82, 0.97), t1=(0.25, 0.9)):
    s = {f"{k}_first": 0.5 for k, _ in writers.PLOT_PANELS}
    s.update({f"{k}_last": 0.5 for k, _ in writers.PLOT_PANELS})
    s.update(
        eval_pass_rate_first=eval_first,
        eval_pass_rate_last=eval_last,
        quality_first=quality[0],
        quality_last=quality[1],
        t1_share_first=t1[0],
        t1_share_last=t1[1],
    )
    return s


def test_binomial_diff_se():
    # two rates of 128 samples: sqrt((p1 q1 + p2 q2) / n)
    assert writers.binomial_diff_se(0.438, 0.406, 128) == pytest.approx(
        math.sqrt((0.438 * 0.562 + 0.406 * 0.594) / 128)
    )
    assert writers.binomial_diff_se(0.0, 1.0, 10) == 0.0


def test_a_pass_rate_change_within_noise_is_read_as_such_and_quality_named():
    text = writers.format_summary("== run", _summary(0.438, 0.406), eval_samples=128)
    assert text.splitlines()[0] == "== run"
    text = " ".join(text.split())  # the closing sentence is wrapped for the console
    # 2 SE of the change at 128 samples is 0.123: a -0.032 change is noise
    assert (
        "held-out pass rate 0.438 -> 0.406 (-0.032; 2 SE of the change at 128 samples: "
        "0.123): within the noise of one evaluation" in text
    )
    assert "quality of passing solutions 0.820 -> 0.970 (+0.150)" in text
    assert (
        "RL changed which passing patch the policy writes (quality of passing solutions "
        "and share of passing solutions in the best tier (T1) rose)" in text
    )


def test_a_pass_rate_gain_beyond_noise_is_said():
    text = writers.format_summary("== run", _summary(0.30, 0.60), eval_samples=128)
    text = " ".join(text.split())
    assert "raised beyond the noise of one evaluation" in text
    assert "RL changed which passing patch" not in text
    assert "compare seeds" in text


def test_nothing_is_claimed_when_quality_fell_too():
    text = writers.format_summary(
        "== run", _summary(0.44, 0.43, quality=(0.9, 0.8), t1=(0.5, 0.4)), eval_samples=128
    )
    assert "within the noise" in text and "RL changed which" not in text and "raised" not in text


def test_a_run_without_evaluations_prints_its_panels():
    s = _summary(None, None)
    text = writers.format_summary("== run", s, eval_samples=128)
    assert "held-out" not in text.split("What changed:")[1]
    assert "quality score of passing solutions" in text
