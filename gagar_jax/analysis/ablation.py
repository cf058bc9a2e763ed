"""The multi-seed toy ablation: per-mode means and standard errors, a banded plot, a README table.

Input: one run directory per (mode, seed), each with the loop's ``metrics.jsonl``
(``ROOT/<mode>/seed<s>``, as ``make compare SEEDS=n`` writes them). For every run and metric the
summary takes the mean over the first and the last ``window`` logged train steps (eval metrics:
the first evaluation, which is the SFT start at step 0, and the last one); across seeds each
mode then gets the mean and the standard error of the mean (``std(ddof=1) / sqrt(n)``; 0 for a
single seed, which the table marks).

Two readings the paper's claims need, both computed from the runs, never asserted:

* does RL raise the held-out pass rate over the SFT start? per mode, the paired change
  ``eval_pass_rate(last) - eval_pass_rate(step 0)`` over seeds, mean +- SE; "raised" when the
  mean exceeds two standard errors;
* does discount-only's credit imbalance move the entropy? over every run of every mode, the
  credit imbalance ``mean_steps(1 - credit_ratio)`` against the entropy drift
  ``entropy(last window) - entropy(first window)``: Pearson r and the least-squares slope.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

# (metric key, table/plot title); eval_* keys come from eval rows.
METRICS: tuple[tuple[str, str], ...] = (
    ("eval_pass_rate", "held-out pass rate"),
    ("pass_rate", "train pass rate"),
    ("quality", "quality of passing"),
    ("t1_share", "T1 share"),
    ("response_length", "response length"),
    ("entropy", "entropy"),
    ("pg_loss_mean", "pg-loss mean"),
    ("credit_ratio", "credit ratio"),
    ("token_credit/evidence_share", "positive credit on evidence tokens"),
    ("token_credit/gini", "token-credit Gini"),
)

README_BEGIN = "<!-- ablation-table:begin -->"
README_END = "<!-- ablation-table:end -->"


def read_rows(workdir: str) -> list[dict[str, Any]]:
    """The rows of ``workdir/metrics.jsonl`` (FileNotFoundError naming the path)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric: eval rows for ``eval_*`` keys, train rows otherwise."""
    phase = "eval" if key.startswith("eval_") else "train"
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if r.get("phase") != phase or v is None:
            continue
        try:
            v = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(v)
    return xs, ys


def is_complete(rows: Sequence[Mapping[str, Any]]) -> bool:
    """True when the run reached its final evaluation (the loop evaluates after the last
    step, at ``step = last train step + 1``); a run still in progress or killed is not."""
    train = [int(r["step"]) for r in rows if r.get("phase") == "train"]
    evals = [int(r["step"]) for r in rows if r.get("phase") == "eval"]
    return bool(train) and bool(evals) and max(evals) >= max(train) + 1


def run_summary(rows: Sequence[Mapping[str, Any]], *, window: int = 5) -> dict[str, float]:
    """``{key_first, key_last}`` per metric, plus ``credit_imbalance`` and ``entropy_drift``."""
    out: dict[str, float] = {}
    for key, _ in METRICS:
        _, ys = series(rows, key)
        if not ys:
            continue
        if key.startswith("eval_"):
            out[f"{key}_first"], out[f"{key}_last"] = ys[0], ys[-1]
        else:
            out[f"{key}_first"] = sum(ys[:window]) / len(ys[:window])
            out[f"{key}_last"] = sum(ys[-window:]) / len(ys[-window:])
    _, ratio = series(rows, "credit_ratio")
    if ratio:
        out["credit_imbalance"] = sum(1.0 - r for r in ratio) / len(ratio)
    if "entropy_first" in out:
        out["entropy_drift"] = out["entropy_last"] - out["entropy_first"]
    if "eval_pass_rate_first" in out:
        out["eval_pass_gain"] = out["eval_pass_rate_last"] - out["eval_pass_rate_first"]
    return out


def mean_se(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, standard error of the mean (ddof=1; 0 for one value) and count."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0, 1
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n), n


def aggregate(summaries: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict]:
    """mode -> {stat name -> (mean, se, n)} over that mode's seeds."""
    out = {}
    for mode, runs in summaries.items():
        keys = sorted({k for s in runs for k in s})
        out[mode] = {k: mean_se([s[k] for s in runs if k in s]) for k in keys}
    return out


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Pearson r and least-squares slope/intercept of ys on xs (nan when undefined)."""
    n = len(xs)
    if n < 3:
        return {"n": float(n), "r": math.nan, "slope": math.nan, "intercept": math.nan}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx > 0 else math.nan
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
    return {"n": float(n), "r": r, "slope": slope, "intercept": my - slope * mx}


def _fmt(stat: tuple[float, float, int], digits: int = 3) -> str:
    mean, se, n = stat
    if n == 0 or not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}g} ± {se:.2g}" if n > 1 else f"{mean:.{digits}g} (1 seed)"


def markdown(
    agg: Mapping[str, Mapping[str, tuple]],
    fit: Mapping[str, float],
    *,
    command: str = "",
    window: int = 5,
) -> str:
    """The README table (first -> last, mean ± SE over seeds) and the two readings."""
    seeds = {m: max((v[2] for v in stats.values()), default=0) for m, stats in agg.items()}
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Mean ± standard error over seeds; first -> last = means over the first / last {window} "
        "train steps (held-out: the SFT start at step 0 -> the last evaluation).",
        "",
        "| mode | seeds | " + " | ".join(title for _, title in METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for mode, stats in agg.items():
        cells = []
        for key, _ in METRICS:
            a, b = stats.get(f"{key}_first"), stats.get(f"{key}_last")
            cells.append("n/a" if a is None or b is None else f"{_fmt(a)} -> {_fmt(b)}")
        lines.append(f"| {mode} | {seeds[mode]} | " + " | ".join(cells) + " |")
    lines += ["", "Held-out pass-rate change over the SFT start (paired per seed):", ""]
    for mode, stats in agg.items():
        gain = stats.get("eval_pass_gain")
        if gain is None:
            continue
        mean, se, n = gain
        verdict = (
            "raised (mean > 2 SE)"
            if n > 1 and mean > 2 * se
            else "lowered (mean < -2 SE)"
            if n > 1 and mean < -2 * se
            else "not distinguishable from 0 at 2 SE"
            if n > 1
            else "one seed: no spread"
        )
        lines.append(f"- {mode}: {_fmt(gain)} -> {verdict}")
    if fit:
        lines += [
            "",
            f"Credit imbalance (mean 1 - credit ratio) vs entropy drift over all {int(fit['n'])} "
            f"runs: Pearson r = {fit['r']:.3g}, slope = {fit['slope']:.3g} entropy per unit "
            "imbalance.",
        ]
    return "\n".join(lines)


def plot(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], out_path: str, *, title: str = ""
) -> str:
    """One panel per metric: per mode the mean over seeds and a ±1 SE band, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows_n = math.ceil(len(METRICS) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.0 * cols, 3.0 * rows_n), squeeze=False)
    for ax, (key, panel) in zip(axes.flat, METRICS):
        for mode, seeds in runs.items():
            by_step: dict[int, list[float]] = {}
            for rows in seeds:
                for x, y in zip(*series(rows, key)):
                    by_step.setdefault(x, []).append(y)
            if not by_step:
                continue
            xs = sorted(by_step)
            stats = [mean_se(by_step[x]) for x in xs]
            mean = [s[0] for s in stats]
            se = [s[1] for s in stats]
            (line,) = ax.plot(xs, mean, label=mode, marker="o" if len(xs) < 12 else None, ms=3)
            ax.fill_between(
                xs,
                [m - e for m, e in zip(mean, se)],
                [m + e for m, e in zip(mean, se)],
                color=line.get_color(),
                alpha=0.2,
            )
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(METRICS) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)) or ".", exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def replace_readme_block(readme_path: str, text: str, block: str = "ablation-table") -> None:
    """Replaces the text between ``<!-- block:begin -->`` and ``<!-- block:end -->``."""
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    with open(readme_path, encoding="utf-8") as f:
        doc = f.read()
    if begin not in doc or end not in doc:
        raise ValueError(f"{readme_path}: no {begin} ... {end} block to replace")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(readme_path, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{text}\n{end}{tail}")


def compare_seeds(
    root: str,
    modes: Sequence[str],
    seeds: Sequence[int],
    out_dir: str,
    *,
    window: int = 5,
    command: str = "",
    readme: str | None = None,
    title: str = "",
    readme_block: str = "ablation-table",
    image: str | None = None,
) -> str:
    """Reads ``root/<mode>/seed<s>``, writes ``out_dir/ablation.{md,png,json}``; returns the md.

    Missing and unfinished runs are skipped and listed (a sweep cut short is reported as such,
    never padded).
    """
    runs: dict[str, list] = {}
    summaries: dict[str, list] = {}
    missing = []
    for mode in modes:
        for s in seeds:
            wd = os.path.join(root, mode, f"seed{s}")
            try:
                rows = read_rows(wd)
            except FileNotFoundError:
                missing.append(wd)
                continue
            if not is_complete(rows):
                missing.append(wd + " (unfinished)")
                continue
            runs.setdefault(mode, []).append(rows)
            summaries.setdefault(mode, []).append(run_summary(rows, window=window))
    if not runs:
        raise FileNotFoundError(f"no runs under {root} for modes {list(modes)}")
    agg = aggregate(summaries)
    pts = [
        (s["credit_imbalance"], s["entropy_drift"])
        for ss in summaries.values()
        for s in ss
        if "credit_imbalance" in s and "entropy_drift" in s
    ]
    fit = linear_fit([p[0] for p in pts], [p[1] for p in pts]) if pts else {}
    text = markdown(agg, fit, command=command, window=window)
    if missing:
        text += "\n\nMissing runs (not included): " + ", ".join(missing)
    os.makedirs(out_dir, exist_ok=True)
    counts = ", ".join(f"{m}: {len(r)}" for m, r in runs.items())
    title = f"{title} (finished seeds per mode: {counts})" if title else counts
    png = plot(runs, os.path.join(out_dir, "ablation.png"), title=title)
    # The markdown's image link: relative to the markdown by default, `image` for a README.
    text += f"\n\n![ablation]({image or os.path.basename(png)})"
    with open(os.path.join(out_dir, "ablation.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "ablation.json"), "w", encoding="utf-8") as f:
        json.dump({"summaries": summaries, "aggregate": agg, "fit": fit}, f, indent=1)
    if readme:
        replace_readme_block(readme, text, readme_block)
    return text
