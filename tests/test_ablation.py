"""The multi-seed ablation report: mean and standard error over seeds, the paired pass-rate
change, the imbalance-entropy fit, the banded plot and the results page's block, on synthetic
runs."""

import json
import math
import os

import numpy as np
import pytest

from gagar_jax.analysis import ablation


def _write_run(path, *, entropy, ratio, eval_pass):
    os.makedirs(path, exist_ok=True)
    rows = []
    for i, p in enumerate(eval_pass):  # step 0 and, for a finished run, after the last step
        rows.append({"step": i * len(entropy), "phase": "eval", "eval_pass_rate": p})
    for step, (e, r) in enumerate(zip(entropy, ratio)):
        rows.append(
            {
                "step": step,
                "phase": "train",
                "entropy": e,
                "credit_ratio": r,
                "pass_rate": 0.5,
                "token_credit/gini": None,
            }
        )
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_compare_seeds(tmp_path):
    root = tmp_path / "runs"
    gains = {"gagar": [0.1, 0.12, 0.08], "discount_only": [0.0, 0.02, -0.02]}
    for mode, gs in gains.items():
        for s, g in enumerate(gs):
            imbalance = 0.3 * (mode == "discount_only") + 0.01 * s
            drift = 2.0 * imbalance  # a known linear relation
            _write_run(
                root / mode / f"seed{s}",
                entropy=[0.3] * 5 + [0.3 + drift] * 5,
                ratio=[1 - imbalance] * 10,
                eval_pass=[0.4, 0.4 + g],
            )
    # An unfinished run (no final evaluation) is left out and listed, never averaged in.
    _write_run(root / "gagar_token" / "seed1", entropy=[0.3] * 3, ratio=[1.0] * 3, eval_pass=[0.4])
    page = tmp_path / "toy_ablation.md"
    page.write_text(f"# intro\n{ablation.BLOCK_BEGIN}\nold\n{ablation.BLOCK_END}\nrest\n")
    text = ablation.compare_seeds(
        str(root),
        ["gagar", "discount_only", "gagar_token"],
        range(3),
        str(tmp_path / "out"),
        command="make compare",
        results_page=str(page),
    )
    data = json.loads((tmp_path / "out" / "ablation.json").read_text())
    mean, se, n = data["aggregate"]["gagar"]["eval_pass_gain"]
    assert n == 3 and mean == pytest.approx(0.1)
    assert se == pytest.approx(np.std([0.1, 0.12, 0.08], ddof=1) / math.sqrt(3))
    assert "gagar: 0.1 ± 0.012 -> raised (mean > 2 SE)" in text
    assert "discount_only: " in text and "not distinguishable from 0 at 2 SE" in text
    fit = data["fit"]
    assert fit["n"] == 6 and fit["slope"] == pytest.approx(2.0) and fit["r"] == pytest.approx(1)
    # paired by seed: discount_only's drift is 2 x 0.3 above gagar's on every seed
    assert data["paired"]["discount_only-gagar"]["entropy_drift"][0] == pytest.approx(0.6)
    assert data["paired"]["discount_only-gagar"]["eval_pass_gain"][0] == pytest.approx(-0.1)
    assert (
        "Paired by seed, discount_only - gagar (mean ± SE over 3 shared seeds):" in text
        and "- entropy drift: 0.6 ± " in text
    )
    assert "Per step (pooled, 54 step pairs)" in text
    assert "Missing runs" in text and "gagar_token/seed0" in text  # never padded
    assert "gagar_token/seed1 (unfinished)" in text and "| gagar_token |" not in text
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 10_000
    doc = page.read_text()
    assert doc.startswith("# intro\n") and doc.endswith("rest\n") and "old" not in doc
    assert "Command: `make compare`" in doc
    # A second sweep pooled into the fit: same relation, so the pooled slope is still 2.
    other = tmp_path / "other"
    for s in range(2):
        _write_run(
            other / "binary" / f"seed{s}",
            entropy=[0.3] * 5 + [0.3 + 0.2 * s] * 5,
            ratio=[1 - 0.1 * s] * 10,
            eval_pass=[0.4, 0.4],
        )
    text = ablation.compare_seeds(
        str(root),
        ["gagar"],
        range(3),
        str(tmp_path / "d"),
        prefix="named",
        fit_roots=[str(other), str(root)],
    )
    assert sorted(os.listdir(tmp_path / "d")) == ["named.json", "named.md", "named.png"]
    pooled = json.loads((tmp_path / "d" / "named.json").read_text())["pooled"]
    assert pooled["fit"]["n"] == 5 and pooled["fit"]["slope"] == pytest.approx(2.0)
    assert f"Pooled over 5 runs of {other}, {root}" in text


def test_mean_se_and_fit_degenerate():
    assert ablation.mean_se([2.0]) == (2.0, 0.0, 1)
    assert math.isnan(ablation.mean_se([])[0])
    assert math.isnan(ablation.linear_fit([1, 2], [3, 4])["r"])
    with pytest.raises(FileNotFoundError, match="no runs"):
        ablation.compare_seeds("/nonexistent", ["gagar"], [0], "/tmp/x")


def test_linear_fit_slope_se_matches_scipy():
    from scipy import stats

    rng = np.random.default_rng(0)
    x = rng.normal(size=20)
    y = 0.7 * x + rng.normal(scale=0.3, size=20)
    fit = ablation.linear_fit(list(x), list(y))
    ref = stats.linregress(x, y)
    assert fit["slope"] == pytest.approx(ref.slope)
    assert fit["r"] == pytest.approx(ref.rvalue)
    assert fit["slope_se"] == pytest.approx(ref.stderr)
    assert math.isnan(ablation.linear_fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])["slope_se"])


def test_step_fits_and_paired_differences(tmp_path):
    # Within every run the next step's entropy change is 0.5 x the step's imbalance plus a
    # run-level offset; the pooled fit sees the offsets, the within-run fit recovers 0.5.
    rng = np.random.default_rng(1)
    runs = []
    for offset in (0.0, 0.05, -0.05):
        imb = rng.uniform(0, 0.4, size=12)
        ent = [0.3]
        for x in imb[:-1]:
            ent.append(ent[-1] + 0.5 * x + offset)
        rows = [
            {"step": t, "phase": "train", "credit_ratio": 1 - x, "entropy": e}
            for t, (x, e) in enumerate(zip(imb, ent))
        ]
        rows.insert(5, {"step": 5, "phase": "eval", "eval_pass_rate": 0.3})  # ignored
        runs.append(rows)
    pairs = ablation.step_pairs(runs[0])
    assert len(pairs) == 11
    assert pairs[0][1] == pytest.approx(0.5 * pairs[0][0])
    # a gap in the logged steps is not a step pair
    gap = [r for r in runs[0] if r["step"] != 4]
    assert len(ablation.step_pairs(gap)) == 9
    pooled, within = ablation.step_fits(runs)
    assert within["n"] == pooled["n"] == 33
    assert within["slope"] == pytest.approx(0.5) and within["r"] == pytest.approx(1.0)
    assert pooled["r"] < 0.99  # the offsets blur the pooled relation
    summaries = {
        "discount_only": [
            {"entropy_drift": 0.2, "credit_imbalance": 0.3},
            {"entropy_drift": 0.4, "credit_imbalance": 0.2},
            {"entropy_drift": 9.0},
        ],
        "gagar": [
            {"entropy_drift": 0.1, "credit_imbalance": 0.0},
            {"entropy_drift": 0.1, "credit_imbalance": 0.0},
        ],
    }
    seeds = {"discount_only": [0, 2, 5], "gagar": [0, 2]}
    d = ablation.paired_differences(summaries, seeds, "discount_only", "gagar")
    assert d["entropy_drift"] == pytest.approx((0.2, 0.1, 2))  # seed 5 has no gagar partner
    assert d["credit_imbalance"][0] == pytest.approx(0.25)
    assert ablation.paired_differences(summaries, seeds, "binary", "gagar") == {}


def test_a_run_without_held_out_evaluation_is_complete_at_its_total_steps(tmp_path):
    rows = [{"step": s, "phase": "train", "entropy": 0.3} for s in range(10)]
    assert not ablation.is_complete(rows)  # no final evaluation, no step count: unknown
    assert ablation.is_complete(rows, total_steps=10)
    assert not ablation.is_complete(rows[:7], total_steps=10)  # cut short
    for s, n in ((0, 10), (1, 7)):  # load_runs reads the count from the run's config.json
        wd = tmp_path / "gagar" / f"seed{s}"
        _write_run(wd, entropy=[0.3] * n, ratio=[1.0] * n, eval_pass=[])
        (wd / "config.json").write_text(json.dumps({"loop": {"total_steps": 10}}))
    runs, _, seeds, missing = ablation.load_runs(str(tmp_path), ["gagar"], range(2))
    assert seeds == {"gagar": [0]} and len(runs["gagar"]) == 1
    assert missing == [str(tmp_path / "gagar" / "seed1") + " (unfinished)"]
