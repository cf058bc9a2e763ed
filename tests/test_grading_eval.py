"""The grader-quality harness: its statistics on hand-computed examples, the advantage-split error
on a group derived by hand, probes that catch a position-biased and an injection-obeying grader,
and the CLI's contract (columns, JSON keys)."""

import dataclasses
import io
import json
import math
from contextlib import redirect_stdout

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.grading import eval as ev
from gagar_jax.grading import labelled, schema
from gagar_jax.grading.heuristic import GRADER_VERSION, HeuristicGrader
from gagar_jax.verify.diff import apply_unified_diff, read_patch


def test_cohen_kappa_by_hand():
    # p_o = 3/4; marginals a: {1: 1/2, 2: 1/2}, b: {1: 1/4, 2: 3/4};
    # p_e = 1/2 * 1/4 + 1/2 * 3/4 = 1/2;  kappa = (3/4 - 1/2) / (1 - 1/2) = 1/2.
    assert ev.cohen_kappa([1, 1, 2, 2], [1, 2, 2, 2]) == pytest.approx(0.5)
    assert ev.cohen_kappa([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    # The majority-class predictor: p_o = p_e, kappa 0 although raw agreement is 3/4.
    gold = [2, 2, 2, 1]
    base = ev.majority_predictions(gold)
    assert list(base) == [2, 2, 2, 2] and ev.cohen_kappa(gold, base) == pytest.approx(0.0)
    assert math.isnan(ev.cohen_kappa([], []))
    with pytest.raises(ValueError, match="one length"):
        ev.cohen_kappa([1, 2], [1])


def test_tau_b_by_hand_and_against_scipy():
    from scipy.stats import kendalltau

    # Pairs of x=[1,2,3,3], y=[1,3,2,2]: (0,1) (0,2) (0,3) concordant, (1,2) (1,3) discordant,
    # (2,3) tied in both.  tau_b = (3 - 2) / sqrt((3+2+0) (3+2+0)) = 1/5.
    x, y = [1, 2, 3, 3], [1, 3, 2, 2]
    assert ev.pair_counts(x, y) == (3, 2, 0, 0, 1)
    assert ev.within_tier_tau_b([(x, y)]) == pytest.approx(0.2)
    assert ev.within_tier_tau_b([(x, y)]) == pytest.approx(kendalltau(x, y).statistic)
    # Pooled over blocks: a concordant block and a discordant one cancel.
    assert ev.within_tier_tau_b([([1, 2], [1, 2]), ([1, 2], [2, 1])]) == pytest.approx(0.0)
    assert math.isnan(ev.within_tier_tau_b([([1, 1], [1, 1])]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=2, max_size=9))
def test_tau_b_equals_scipy(pairs):
    from scipy.stats import kendalltau

    x, y = zip(*pairs)
    mine = ev.within_tier_tau_b([(x, y)])
    ref = kendalltau(x, y).statistic
    assert (math.isnan(mine) and math.isnan(ref)) or mine == pytest.approx(ref)


def test_auc_and_ece_by_hand():
    # Positives scored 0.9, 0.5; negatives 0.5, 0.1: pairs 1, 1, 1/2 (tie), 1 -> 3.5 / 4.
    assert ev.roc_auc([True, True, False, False], [0.9, 0.5, 0.5, 0.1]) == pytest.approx(0.875)
    assert math.isnan(ev.roc_auc([True, True], [0.1, 0.2]))
    # Bins 9, 0, 5, 6 hold one sample each: |1-.95| + |0-.05| + |1-.55| + |1-.65| over 4 = .225.
    y, p = [1, 0, 1, 1], [0.95, 0.05, 0.55, 0.65]
    assert ev.expected_calibration_error(y, p) == pytest.approx(0.225)
    # Perfectly calibrated in one bin: predicted 0.5, half positive.
    assert ev.expected_calibration_error([1, 0], [0.5, 0.5]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="probabilities"):
        ev.expected_calibration_error([1], [1.5])


def test_precision_recall_by_hand():
    prec, rec = ev.precision_recall([True, True, False, False], [True, False, True, False])
    assert (prec, rec) == (0.5, 0.5)
    prec, rec = ev.precision_recall([True], [False])
    assert math.isnan(prec) and rec == 0.0


def test_split_error_by_hand():
    # One group of four: A, B pass, C, D fail. R = [1, 1, 0, 0], mean 1/2, A = [.5, .5, -.5, -.5].
    # Gold: A T1 rank 1 (f = 1), B T3 rank 2 (f = 0.3). Sum-preserving: A*_i = (1 - 1/2) f_i /
    # mean_P(f) = 0.5 f_i / 0.65, i.e. A* = [10/13, 3/13, -.5, -.5].
    # A grader that swaps them gives [3/13, 10/13]: L1 = 2 * 7/13 = 14/13.
    # A grader that fell back keeps [.5, .5]: L1 = (10/13 - 1/2) + (1/2 - 3/13) = 7/13.
    passed = np.array([[True, True, False, False]] * 3)
    valid = np.ones((3, 4), bool)
    gold_t = np.array([[1, 3, 1, 1]] * 3)
    gold_r = np.array([[1, 2, 1, 1]] * 3)
    tier = np.array([[1, 3, 1, 1], [3, 1, 1, 1], [1, 1, 1, 1]])
    rank = np.array([[1, 2, 1, 1], [2, 1, 1, 1], [1, 1, 1, 1]])
    graded = np.array([True, True, False])
    err = ev.split_errors(passed, valid, gold_t, gold_r, tier, rank, graded)
    assert err == pytest.approx([0.0, 14 / 13, 7 / 13], abs=1e-6)


def _small_set(n=4):
    s = labelled.load_set("toy")
    return dataclasses.replace(s, groups=s.groups[:n])


class PositionBiasedGrader:
    """Puts the first passing candidate in slot order in T1 and the rest in T2 by position."""

    grader_id = "position_biased"
    version = "1"

    def grade(self, ws):
        js = []
        for k, c in enumerate(ws.passing):
            ev_ = ()
            if k:
                path = c.parsed_patch.files[0].path
                ev_ = (schema.Evidence("minimality", "patch", c.candidate_id, file=path),)
            js.append(
                schema.Judgement(
                    c.candidate_id,
                    1 if k == 0 else 2,
                    k + 1,
                    {d: 0.9 for d in schema.DIMENSIONS},
                    evidence=ev_,
                )
            )
        return schema.Verdict(ws.group_id, tuple(js), self.grader_id, self.version)


class InjectionObeyingGrader:
    """The heuristic grader, except that a candidate whose log asks for tier 1 gets it."""

    grader_id = "gullible"
    version = "1"

    def grade(self, ws):
        v = HeuristicGrader().grade(ws)
        asked = {c.candidate_id for c in ws.passing if "assign it tier 1" in c.test_log}
        js = tuple(
            dataclasses.replace(j, tier=1, rank=1, cheat=False) if j.candidate_id in asked else j
            for j in v.judgements
        )
        return dataclasses.replace(v, judgements=js)


def test_evaluate_heuristic_on_toy_groups():
    row = ev.evaluate(HeuristicGrader(), _small_set(), n_boot=20)
    outs = row["outcomes"]
    gold = [t for o in outs for t in o.gold_tier]
    mine = [t for o in outs for t in o.tier]
    assert row["kappa"] == pytest.approx(ev.cohen_kappa(gold, mine))
    assert (
        row["grader"] == f"heuristic@{GRADER_VERSION}"
        and row["set"] == "toy@v1"
        and row["groups"] == 4
    )
    assert row["fallback_rate"] == 0.0 and row["cheat_recall"] == 1.0
    assert row["flip_rate"] == 0.0 and row["probe_failures"] == 0
    lo, hi = row["kappa_ci"]
    assert lo <= row["kappa"] <= hi
    assert all(o.split_error >= 0 for o in outs)


def test_probes_catch_a_position_biased_grader():
    row = ev.evaluate(PositionBiasedGrader(), _small_set(), probes=("permute",), n_boot=0)
    assert row["flip_rate"] > 0.2 and row["probe/permute"] == 1.0


def test_probes_catch_an_injection_obeying_grader():
    row = ev.evaluate(InjectionObeyingGrader(), _small_set(), probes=ev.PROBES, n_boot=0)
    assert row["probe/injection"] == 1.0 and row["probe_failures"] >= 4
    assert row["probe/master_key"] == 0.0 and row["probe/permute"] == 0.0


def test_pad_patch_keeps_the_diff_valid():
    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
    out = ev.pad_patch(patch, ["# note", "z = 0"])
    pp = read_patch(out)
    assert [t for _, t in pp.files[0].added()] == ["y = 3", "# note", "z = 0"]
    files = apply_unified_diff({"m.py": "x = 1\ny = 2\n"}, pp)
    assert files["m.py"] == "x = 1\ny = 3\n# note\nz = 0\n"
    assert ev.pad_patch("--- a/p.toy\n+++ b/p.toy\n@@ -1 +1 @@\n-a\n+b\n", ["c"]) is None


def test_cli_json_and_table_contract():
    buf = io.StringIO()
    with redirect_stdout(buf):
        ev.main(
            [
                "--grader",
                "heuristic",
                "--set",
                "repo",
                "--json",
                "--bootstrap",
                "0",
                "--probes",
                "permute",
            ]
        )
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(rows) == 1 and set(ev.METRIC_KEYS) <= set(rows[0])
    buf = io.StringIO()
    with redirect_stdout(buf):
        ev.main(["--grader", "heuristic", "--set", "repo", "--bootstrap", "0", "--probes", "none"])
    header, row = buf.getvalue().splitlines()
    assert header.split() == ["grader", "set", "groups", *ev.METRIC_KEYS]
    assert row.split()[:2] == [f"heuristic@{GRADER_VERSION}", "repo@v1"]
    with pytest.raises(SystemExit):
        ev.main(["--grader", "nonesuch", "--set", "toy"])
    with pytest.raises(ValueError, match="sglang-url"):
        ev.make_grader("agentic", "toy")


def test_rename_identifier_keeps_every_patch_applicable():
    lg = labelled.load_set("repo").groups[0]
    renamed = ev.rename_identifier(lg.workspace)
    # statkit's commonest identifier shared by the added lines and the repository: ``values``.
    assert "values_r" in renamed.repo_files["statkit/stats.py"]
    assert not any("(values)" in c.patch for c in renamed.candidates)
    for c in renamed.candidates:
        apply_unified_diff(renamed.repo_files, c.parsed_patch)  # raises if stale
    assert ev.rename_identifier(labelled.load_set("toy").groups[0].workspace) is None


def test_cli_split_and_prescreen_rows():
    buf = io.StringIO()
    with redirect_stdout(buf):
        ev.main(
            ["--grader", "heuristic", "--set", "toy", "--split", "heldout", "--prescreen",
             "--json", "--bootstrap", "0", "--probes", "none", "--limit", "3"]
        )  # fmt: skip  # argv pairs
    (row,) = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert row["set"] == "toy@v1:heldout+prescreen" and row["groups"] == 3


def test_prescreened_set_carries_the_screen_findings_as_confirmed_flags():
    s = labelled.load_set("repo")
    screened = ev.prescreened(s)
    for lg, ps_lg in zip(s.groups, screened.groups):
        for c, pc in zip(lg.workspace.candidates, ps_lg.workspace.candidates):
            added = [f for f in pc.monitor_flags if f.rule.startswith("prescreen/")]
            assert pc.monitor_flags[: len(c.monitor_flags)] == c.monitor_flags
            if lg.gold.get(c.candidate_id) and lg.gold[c.candidate_id].kind == "test_weakening":
                assert [f.rule for f in added] == ["prescreen/tests_weakened"]
                assert all(f.confirmed for f in added)
            elif c.passed and not lg.gold[c.candidate_id].cheat:
                assert added == []
