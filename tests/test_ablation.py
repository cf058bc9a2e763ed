"""The multi-seed ablation report: mean and standard error over seeds, the paired pass-rate
change, the imbalance-entropy fit, the banded plot and the README block, on synthetic runs."""

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
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{ablation.README_BEGIN}\nold\n{ablation.README_END}\nrest\n")
    text = ablation.compare_seeds(
        str(root),
        ["gagar", "discount_only", "gagar_token"],
        range(3),
        str(tmp_path / "out"),
        command="make compare",
        readme=str(readme),
    )
    data = json.loads((tmp_path / "out" / "ablation.json").read_text())
    mean, se, n = data["aggregate"]["gagar"]["eval_pass_gain"]
    assert n == 3 and mean == pytest.approx(0.1)
    assert se == pytest.approx(np.std([0.1, 0.12, 0.08], ddof=1) / math.sqrt(3))
    assert "gagar: 0.1 ± 0.012 -> raised (mean > 2 SE)" in text
    assert "discount_only: " in text and "not distinguishable from 0 at 2 SE" in text
    fit = data["fit"]
    assert fit["n"] == 6 and fit["slope"] == pytest.approx(2.0) and fit["r"] == pytest.approx(1)
    assert "Missing runs" in text and "gagar_token/seed0" in text  # never padded
    assert "gagar_token/seed1 (unfinished)" in text and "| gagar_token |" not in text
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 10_000
    doc = readme.read_text()
    assert doc.startswith("intro\n") and doc.endswith("rest\n") and "old" not in doc
    assert "Command: `make compare`" in doc


def test_mean_se_and_fit_degenerate():
    assert ablation.mean_se([2.0]) == (2.0, 0.0, 1)
    assert math.isnan(ablation.mean_se([])[0])
    assert math.isnan(ablation.linear_fit([1, 2], [3, 4])["r"])
    with pytest.raises(FileNotFoundError, match="no runs"):
        ablation.compare_seeds("/nonexistent", ["gagar"], [0], "/tmp/x")
