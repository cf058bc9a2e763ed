r"""Where token-level credit lands, against the sequence-level split, on a run's own batches.

    python scripts/token_credit_analysis.py --run=runs/compare/gagar/seed0 --steps=0-4 \
        --out=docs/results/token_credit_analysis.json

Reads the run's stored rollouts (``rollouts.jsonl``: every rollout of every step, its patch and
its test result), rebuilds each mixed group of the chosen steps (the toy task from its id, the
response tokens from the patch, as the sampler wrote them), grades it with the heuristic grader
(deterministic: the verdict the run was paid on), and computes the token advantages of several
credit schemes on the same groups:

* ``binary``: the mean-centred advantage broadcast (no grader);
* ``gagar``: the sum-preserving redistribution, broadcast (sequence level);
* ``evidence g=0.5``: ``gagar`` then ``redistribute_tokens`` with the evidence importance (the
  ``gagar_token`` mode's default);
* ``distinguishing b=...``: ``gagar`` then ``contrastive_tokens`` (the redistribution's change
  on the tokens where a pass parts from the passes of another quality).

Token classes of a passing rollout: *distinguishing* (``distinguishing_tokens``: no pass of
another discount factor shares its tokens up to there), *shared* (the rest), *cited* (the
verdict's evidence); the *failed side* is every token of a failing rollout.

What it prints (and writes to ``--out``), per scheme:

* ``decision margin``: over every pair of passes (i, j) of one group with ``f_i > f_j``, the
  token advantage of i minus that of j at the first position where their tokens differ (the
  state they share, where the policy chooses between them): how hard the update pushes the
  better choice over the worse one there. Binary: 0. ``T1-vs-lower margin``: the same over
  the pairs of a T1 pass and a pass of a lower tier; ``pairs with margin < 0``: the share of
  pairs where the worse choice is pushed harder;
* ``worse passes, ... / binary``: the mean token advantage on the passes below their group's
  mean factor, as a multiple of the binary advantage, on their cited, uncited and
  distinguishing tokens (1 = no quality signal; Gagar's sequence level: the pass's
  ``A*_i / A_i`` on every token);
* ``moved onto distinguishing``: of the credit moved away from the binary broadcast
  (``sum |A_t - A_binary|`` over passing rows), the share on distinguishing tokens;
* ``positive on cited``: the share of the positive credit on cited tokens;
  ``failed-side credit``: the negative total (the same in every scheme);
* ``max conservation error``: ``max |sum_t A_t - n A|`` per sequence, A the scheme's
  sequence advantage (binary's own, Gagar's for the others).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gagar_jax import advantages as adv  # noqa: E402
from gagar_jax.envs import toy, toy_grading  # noqa: E402
from gagar_jax.envs.tokenizer import TOKENIZER  # noqa: E402
from gagar_jax.grading import evidence_tokens  # noqa: E402
from gagar_jax.grading.heuristic import HeuristicGrader  # noqa: E402


def _task(task_id: str) -> toy.ToyTask:
    # toy-d{difficulty}-s{seed}-{index}
    _, d, s, i = task_id.split("-")
    return toy.ToyTaskGenerator(seed=int(s[1:]), difficulty=int(d[1:])).task(int(i))


def load_groups(run: str, steps: range, max_groups: int | None = None):
    """Mixed groups of the chosen steps: (task, patches, passed) per group, slot order."""
    rows = collections.defaultdict(list)
    with open(os.path.join(run, "rollouts.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["step"] in steps and not r.get("infra_error"):
                rows[(r["step"], r["group_id"])].append(r)
    groups = []
    for key in sorted(rows):
        rs = sorted(rows[key], key=lambda r: r["slot"])
        passed = [bool(r["passed"]) and not r["cheat"] for r in rs]
        if 0 < sum(passed) < len(rs):
            groups.append((_task(rs[0]["task_id"]), [r["patch"] for r in rs], passed))
    return groups[:max_groups] if max_groups else groups


def build_batch(groups, grader=None):
    """Dense arrays [G, K, T] of the groups' response tokens, grades and evidence."""
    grader = grader or HeuristicGrader()
    tok = TOKENIZER
    G, K = len(groups), max(len(g[1]) for g in groups)
    resp = [[tok.encode(p) + [tok.eos_id] for p in patches] for _, patches, _ in groups]
    T = max(len(r) for rr in resp for r in rr)
    tokens = np.zeros((G, K, T), np.int32)
    mask = np.zeros((G, K, T), bool)
    evidence = np.zeros((G, K, T), bool)
    passed = np.zeros((G, K), bool)
    valid = np.zeros((G, K), bool)
    tier = np.ones((G, K), np.int32)
    rank = np.ones((G, K), np.int32)
    for g, (task, patches, ok) in enumerate(groups):
        ws = toy_grading.toy_group(task, f"g{g}", patches)
        verdict = grader.grade(ws)
        for k, r in enumerate(resp[g]):
            tokens[g, k, : len(r)] = r
            mask[g, k, : len(r)] = True
            valid[g, k] = True
            passed[g, k] = ok[k]
        for j in verdict.judgements:
            k = int(j.candidate_id[1:])
            tier[g, k], rank[g, k] = j.tier, j.rank
            spans = toy_grading.toy_token_spans(task, resp[g][k])
            m = evidence_tokens.evidence_token_mask(j.evidence, j.candidate_id, spans)
            evidence[g, k, : len(m)] = m
    return dict(
        tokens=tokens,
        mask=mask,
        evidence=evidence,
        passed=passed,
        valid=valid,
        tier=tier,
        rank=rank,
        rewards=passed.astype(np.float32),
    )


def schemes(b, strengths=(0.5, 1.0), gamma=0.5):
    """Token advantages [G, K, T] of each scheme, and the Gagar output they start from."""
    args = (
        b["rewards"],
        b["passed"],
        np.zeros_like(b["passed"]),
        b["tier"],
        b["rank"],
        np.ones(len(b["rewards"]), bool),
        b["valid"],
    )
    binary = adv.gagar_advantages(*args, config=adv.GagarConfig(mode="none"))
    gagar = adv.gagar_advantages(*args, config=adv.GagarConfig(mode="sum_preserving"))
    a_bin, a_g = np.asarray(binary.advantages), np.asarray(gagar.advantages)
    mask = b["mask"]
    out = {
        "binary": np.asarray(adv.broadcast_to_tokens(a_bin, mask)),
        "gagar": np.asarray(adv.broadcast_to_tokens(a_g, mask)),
    }
    imp = adv.EvidenceImportance()(adv.ImportanceInputs(mask=mask, evidence=b["evidence"]))
    out[f"evidence g={gamma}"] = np.asarray(adv.redistribute_tokens(a_g, imp, mask, gamma=gamma))
    dist = np.asarray(
        adv.distinguishing_tokens(b["tokens"], mask, gagar.factors, gagar.passed, b["valid"])
    )
    for s in strengths:
        out[f"distinguishing b={s}"] = np.asarray(
            adv.contrastive_tokens(a_g, np.asarray(gagar.original), dist, mask, strength=s)
        )
    return out, gagar, a_bin, dist


def _lcp(x, y, n):
    p = 0
    while p < n and x[p] == y[p]:
        p += 1
    return p


def tabulate(b, out, gagar, a_bin, dist):
    mask, tokens = b["mask"], b["tokens"]
    f = np.asarray(gagar.factors)
    passed = np.asarray(gagar.passed) & b["valid"]
    a_g = np.asarray(gagar.advantages)
    G, K, _ = mask.shape
    binary_tok = out["binary"]
    pairs = []  # (g, i better, j worse, position they part at)
    for g in range(G):
        for i in range(K):
            for j in range(K):
                if passed[g, i] and passed[g, j] and f[g, i] > f[g, j] + 1e-6:
                    n = min(mask[g, i].sum(), mask[g, j].sum())
                    p = _lcp(tokens[g, i], tokens[g, j], n)
                    if p < n:
                        pairs.append((g, i, j, p))
    fbar = np.zeros(G)
    for g in range(G):
        if passed[g].any():
            fbar[g] = f[g][passed[g]].mean()
    sign = np.sign(f - fbar[:, None]) * passed
    prow = passed[..., None] & mask
    dmask = prow & dist
    tier = b["tier"]
    t1_pairs = [(g, i, j, p) for g, i, j, p in pairs if tier[g, i] == 1 and tier[g, j] > 1]
    worse = (sign < 0)[..., None] & mask
    ev = b["evidence"]
    table = {}
    for name, a in out.items():
        margins = np.array([a[g, i, p] - a[g, j, p] for g, i, j, p in pairs])
        t1_margins = np.array([a[g, i, p] - a[g, j, p] for g, i, j, p in t1_pairs])
        moved = np.abs(a - binary_tok) * prow
        pos = np.maximum(a, 0) * prow
        total_pos = max(pos.sum(), 1e-30)
        n_tok = mask.sum(-1)
        own = a_bin if name == "binary" else a_g
        err = np.abs((a * mask).sum(-1) - n_tok * own)
        ratio = a / np.where(binary_tok != 0, binary_tok, 1.0)

        def mean(x, sel):
            return float(x[sel].mean()) if sel.any() else float("nan")

        table[name] = {
            "decision margin": float(margins.mean()) if len(margins) else 0.0,
            "T1-vs-lower margin": float(t1_margins.mean()) if len(t1_margins) else 0.0,
            "pairs with margin < 0": float((margins < -1e-6).mean()) if len(margins) else 0.0,
            "worse passes, cited tokens / binary": mean(ratio, worse & ev),
            "worse passes, uncited tokens / binary": mean(ratio, worse & ~ev),
            "worse passes, distinguishing / binary": mean(ratio, worse & dist),
            "moved onto distinguishing": float(moved[dmask].sum() / max(moved.sum(), 1e-30)),
            "positive on cited": float(pos[prow & ev].sum() / total_pos),
            "failed-side credit": float(
                (a * (mask & ~passed[..., None] & b["valid"][..., None])).sum()
            ),
            "max conservation error": float(err[b["valid"]].max()),
        }
    counts = {
        "groups": int(G),
        "passing rollouts": int(passed.sum()),
        "pairs of passes of different factors that part": len(pairs),
        "of them T1 against a lower tier": len(t1_pairs),
        "passing tokens": int(prow.sum()),
        "distinguishing share of passing tokens": float(dmask.sum() / max(prow.sum(), 1)),
        "cited share of passing tokens": float((prow & b["evidence"]).sum() / max(prow.sum(), 1)),
        "cited tokens that are distinguishing": float(
            (dmask & b["evidence"]).sum() / max((prow & b["evidence"]).sum(), 1)
        ),
        "pairs whose worse pass's parting token is cited": float(
            np.mean([b["evidence"][g, j, p] for g, _, j, p in pairs]) if pairs else 0.0
        ),
        "pairs whose better pass's parting token is cited": float(
            np.mean([b["evidence"][g, i, p] for g, i, _, p in pairs]) if pairs else 0.0
        ),
    }
    return table, counts


def markdown(table, counts) -> str:
    cols = list(next(iter(table.values())))
    lines = ["| scheme | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |")
    lines.append("")
    lines += [
        f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in counts.items()
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a toy run directory with rollouts.jsonl")
    ap.add_argument("--steps", default="0-4", help="steps to read, 'a-b' (inclusive)")
    ap.add_argument("--max_groups", type=int, default=0)
    ap.add_argument("--strengths", default="0.5,1.0", help="contrastive strengths to show")
    ap.add_argument("--out", default="", help="write the table and counts as JSON here")
    args = ap.parse_args(argv)
    lo, _, hi = args.steps.partition("-")
    steps = range(int(lo), int(hi or lo) + 1)
    groups = load_groups(args.run, steps, args.max_groups or None)
    if not groups:
        raise SystemExit(f"--run: no mixed groups at steps {args.steps} in {args.run}")
    b = build_batch(groups)
    out, gagar, a_bin, dist = schemes(b, tuple(float(s) for s in args.strengths.split(",")))
    table, counts = tabulate(b, out, gagar, a_bin, dist)
    print(markdown(table, counts))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"run": args.run, "steps": args.steps, "table": table, "counts": counts},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
