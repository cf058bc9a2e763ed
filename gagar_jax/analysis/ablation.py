"""The multi-seed toy ablation: per-mode means and standard errors, a banded plot, a results table.

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
* does discount-only's credit imbalance move the entropy? three measurements:

  - per run (``fit``): over every run of every mode, the credit imbalance
    ``mean_steps(1 - credit_ratio)`` against the entropy drift
    ``entropy(last window) - entropy(first window)``: Pearson r, the least-squares slope and its
    standard error;
  - per step (``step_fit``, ``step_fit_within``): over every run and step ``t``, the step's
    imbalance ``1 - credit_ratio[t]`` against the next step's entropy change
    ``entropy[t+1] - entropy[t]``, pooled, and within runs (both centred on their run's mean, so
    a run-level offset cannot make the relation);
  - paired by seed (``paired``): mode A minus mode B on the same seed (the same
    initialisation, task order and sampling seed; ``paired_modes`` names the pairs, by default
    ``discount_only`` - ``gagar``) for the entropy drift, the response-length drift, the
    pg-loss mean, the credit imbalance, the held-out pass-rate gain and the last window's
    quality and T1 share (``PAIRED``), mean +- SE over the seeds both finished.
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

# The block of a results page (docs/results/*.md) that `replace_results_block` rewrites.
BLOCK_BEGIN = "<!-- ablation-table:begin -->"
BLOCK_END = "<!-- ablation-table:end -->"


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


def is_complete(rows: Sequence[Mapping[str, Any]], total_steps: int | None = None) -> bool:
    """True when the run reached its final evaluation (the loop evaluates after the last
    step, at ``step = last train step + 1``), or, given the run's ``total_steps``, logged its
    last train step (a run without held-out evaluation); a run still in progress or killed is
    not."""
    train = [int(r["step"]) for r in rows if r.get("phase") == "train"]
    evals = [int(r["step"]) for r in rows if r.get("phase") == "eval"]
    if total_steps is not None and train and max(train) + 1 >= total_steps:
        return True
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
    if "response_length_first" in out:
        out["response_length_drift"] = out["response_length_last"] - out["response_length_first"]
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
    """Pearson r, least-squares slope/intercept of ys on xs and the slope's standard error
    (``sqrt(SSR / (n - 2) / Sxx)``, the OLS formula); nan when undefined (n < 3, constant xs)."""
    n = len(xs)
    nan = {
        "n": float(n),
        "r": math.nan,
        "slope": math.nan,
        "slope_se": math.nan,
        "intercept": math.nan,
    }
    if n < 3:
        return nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    if sxx <= 0:
        return nan
    slope = sxy / sxx
    r = sxy / math.sqrt(sxx * syy) if syy > 0 else math.nan
    ssr = max(syy - slope * sxy, 0.0)
    return {
        "n": float(n),
        "r": r,
        "slope": slope,
        "slope_se": math.sqrt(ssr / (n - 2) / sxx),
        "intercept": my - slope * mx,
    }


def step_pairs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """``(1 - credit_ratio[t], entropy[t+1] - entropy[t])`` for each pair of consecutive logged
    train steps that both carry the two metrics."""
    by_step: dict[int, dict[str, float]] = {}
    for key in ("credit_ratio", "entropy"):
        for x, y in zip(*series(rows, key)):
            by_step.setdefault(x, {})[key] = y
    steps = sorted(s for s, m in by_step.items() if len(m) == 2)
    return [
        (1.0 - by_step[a]["credit_ratio"], by_step[b]["entropy"] - by_step[a]["entropy"])
        for a, b in zip(steps, steps[1:])
        if b == a + 1
    ]


def step_fits(runs: Sequence[Sequence[Mapping[str, Any]]]) -> tuple[dict, dict]:
    """(pooled, within-run) ``linear_fit`` of the next step's entropy change on the step's
    credit imbalance over every run and step; within-run centres both on each run's mean."""
    xs, ys, wx, wy = [], [], [], []
    for rows in runs:
        pairs = step_pairs(rows)
        if not pairs:
            continue
        mx = sum(p[0] for p in pairs) / len(pairs)
        my = sum(p[1] for p in pairs) / len(pairs)
        for x, y in pairs:
            xs.append(x)
            ys.append(y)
            wx.append(x - mx)
            wy.append(y - my)
    return linear_fit(xs, ys), linear_fit(wx, wy)


# (summary key, label) of the paired discount_only - gagar differences
PAIRED: tuple[tuple[str, str], ...] = (
    ("entropy_drift", "entropy drift"),
    ("response_length_drift", "response-length drift"),
    ("pg_loss_mean_last", "pg-loss mean (last window)"),
    ("credit_imbalance", "credit imbalance"),
    ("eval_pass_gain", "held-out pass-rate gain"),
    ("quality_last", "quality of passing (last window)"),
    ("t1_share_last", "T1 share (last window)"),
)


def paired_differences(
    summaries: Mapping[str, Sequence[Mapping[str, float]]],
    seeds: Mapping[str, Sequence[int]],
    a: str,
    b: str,
) -> dict[str, tuple[float, float, int]]:
    """``a - b`` per ``PAIRED`` key over the seeds both modes finished: mean, SE, count."""
    if a not in summaries or b not in summaries:
        return {}
    sa = dict(zip(seeds[a], summaries[a]))
    sb = dict(zip(seeds[b], summaries[b]))
    shared = sorted(set(sa) & set(sb))
    out = {}
    for key, _ in PAIRED:
        d = [sa[s][key] - sb[s][key] for s in shared if key in sa[s] and key in sb[s]]
        if d:
            out[key] = mean_se(d)
    return out


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
    step_fit: Mapping[str, float] | None = None,
    step_fit_within: Mapping[str, float] | None = None,
    paired: Mapping[tuple[str, str], Mapping[str, tuple]] | None = None,
) -> str:
    """The results table (first -> last, mean ± SE over seeds) and the readings (module
    docstring): the paired pass-rate change, the imbalance-entropy fits, the paired mode
    differences."""
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
            f"runs: Pearson r = {fit['r']:.3g}, slope = {_slope(fit)} entropy per unit "
            "imbalance.",
        ]
    for f, what in ((step_fit, "pooled"), (step_fit_within, "within runs")):
        if f:
            lines.append(
                f"Per step ({what}, {int(f['n'])} step pairs): step imbalance vs the next "
                f"step's entropy change: Pearson r = {f['r']:.3g}, slope = {_slope(f)}."
            )
    for (a, b), diffs in (paired or {}).items():
        if not diffs:
            continue
        n = max(v[2] for v in diffs.values())
        lines += ["", f"Paired by seed, {a} - {b} (mean ± SE over {n} shared seeds):", ""]
        for key, label in PAIRED:
            if key in diffs:
                lines.append(f"- {label}: {_fmt(diffs[key])}")
    return "\n".join(lines)


def _slope(fit: Mapping[str, float]) -> str:
    se = fit.get("slope_se", math.nan)
    return f"{fit['slope']:.3g}" + (f" ± {se:.2g} (SE)" if math.isfinite(se) else "")


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


def replace_results_block(page_path: str, text: str, block: str = "ablation-table") -> None:
    """Replaces the text between ``<!-- block:begin -->`` and ``<!-- block:end -->`` of a
    results page (``docs/results/<study>.md``); the rest of the page is kept as it is."""
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    with open(page_path, encoding="utf-8") as f:
        doc = f.read()
    if begin not in doc or end not in doc:
        raise ValueError(f"{page_path}: no {begin} ... {end} block to replace")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(page_path, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{text}\n{end}{tail}")


def load_runs(
    root: str, modes: Sequence[str], seeds: Sequence[int], *, window: int = 5
) -> tuple[dict, dict, dict, list]:
    """``(runs, summaries, seeds, missing)`` of the finished runs ``root/<mode>/seed<s>``:
    mode -> rows lists / ``run_summary`` dicts / seed numbers; ``missing`` lists the absent
    and unfinished run directories."""
    runs: dict[str, list] = {}
    summaries: dict[str, list] = {}
    done_seeds: dict[str, list] = {}
    missing = []
    for mode in modes:
        for s in seeds:
            wd = os.path.join(root, mode, f"seed{s}")
            try:
                rows = read_rows(wd)
            except FileNotFoundError:
                missing.append(wd)
                continue
            if not is_complete(rows, _total_steps(wd)):
                missing.append(wd + " (unfinished)")
                continue
            runs.setdefault(mode, []).append(rows)
            summaries.setdefault(mode, []).append(run_summary(rows, window=window))
            done_seeds.setdefault(mode, []).append(s)
    return runs, summaries, done_seeds, missing


def _total_steps(workdir: str) -> int | None:
    """``loop.total_steps`` of the run's ``config.json`` (None without one)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["loop"]["total_steps"])


def run_fit(summaries: Mapping[Any, Sequence[Mapping[str, float]]]) -> dict[str, float]:
    """``linear_fit`` of entropy drift on credit imbalance over every run summary given."""
    pts = [
        (s["credit_imbalance"], s["entropy_drift"])
        for ss in summaries.values()
        for s in ss
        if "credit_imbalance" in s and "entropy_drift" in s
    ]
    return linear_fit([p[0] for p in pts], [p[1] for p in pts]) if pts else {}


def compare_seeds(
    root: str,
    modes: Sequence[str],
    seeds: Sequence[int],
    out_dir: str,
    *,
    window: int = 5,
    command: str = "",
    results_page: str | None = None,
    title: str = "",
    block: str = "ablation-table",
    image: str | None = None,
    paired_modes: Sequence[tuple[str, str]] = (("discount_only", "gagar"),),
    prefix: str = "ablation",
    fit_roots: Sequence[str] = (),
) -> str:
    """Reads ``root/<mode>/seed<s>``, writes ``out_dir/<prefix>.{md,png,json}``; returns the md.

    Missing and unfinished runs are skipped and listed (a sweep cut short is reported as such,
    never padded).
    ``fit_roots``: further sweep roots (every ``<mode>/seed<s>`` found under them, finished
    runs only) whose runs join this one's in a pooled imbalance-entropy fit, reported apart.
    """
    runs, summaries, done_seeds, missing = load_runs(root, modes, seeds, window=window)
    if not runs:
        raise FileNotFoundError(f"no runs under {root} for modes {list(modes)}")
    agg = aggregate(summaries)
    fit = run_fit(summaries)
    sfit, sfit_within = step_fits([r for rs in runs.values() for r in rs])
    paired = {(a, b): paired_differences(summaries, done_seeds, a, b) for a, b in paired_modes}
    text = markdown(
        agg,
        fit,
        command=command,
        window=window,
        step_fit=sfit,
        step_fit_within=sfit_within,
        paired=paired,
    )
    pooled = {}
    if fit_roots:
        all_runs = {(root, m): rs for m, rs in runs.items()}
        all_sums = {(root, m): ss for m, ss in summaries.items()}
        for other in fit_roots:
            if os.path.abspath(other) == os.path.abspath(root):
                continue
            o_modes = sorted(d for d in os.listdir(other) if os.path.isdir(os.path.join(other, d)))
            o_seeds = sorted(
                {
                    int(d[4:])
                    for m in o_modes
                    for d in os.listdir(os.path.join(other, m))
                    if d.startswith("seed") and d[4:].isdigit()
                }
            )
            o_runs, o_sums, _, _ = load_runs(other, o_modes, o_seeds, window=window)
            for m in o_runs:
                all_runs[(other, m)], all_sums[(other, m)] = o_runs[m], o_sums[m]
        roots = sorted({r for r, _ in all_runs})
        pf = run_fit(all_sums)
        ps, pw = step_fits([r for rs in all_runs.values() for r in rs])
        pooled = {"roots": roots, "fit": pf, "step_fit": ps, "step_fit_within": pw}
        text += (
            f"\n\nPooled over {int(pf['n'])} runs of {', '.join(roots)}: per run r = "
            f"{pf['r']:.3g}, slope = {_slope(pf)}; per step (within runs, {int(pw['n'])} "
            f"pairs) r = {pw['r']:.3g}, slope = {_slope(pw)}."
        )
    if missing:
        text += "\n\nMissing runs (not included): " + ", ".join(missing)
    os.makedirs(out_dir, exist_ok=True)
    counts = ", ".join(f"{m}: {len(r)}" for m, r in runs.items())
    title = f"{title} (finished seeds per mode: {counts})" if title else counts
    png = plot(runs, os.path.join(out_dir, f"{prefix}.png"), title=title)
    # The markdown's image link: relative to the markdown by default, `image` for a results
    # page in another directory.
    text += f"\n\n![ablation]({image or os.path.basename(png)})"
    with open(os.path.join(out_dir, f"{prefix}.md"), "w", encoding="utf-8") as f:
        # A title of its own, so the file is a valid docs page wherever it is written.
        f.write(f"# Multi-seed ablation: {prefix}\n\n{text}\n")
    with open(os.path.join(out_dir, f"{prefix}.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "summaries": summaries,
                "seeds": done_seeds,
                "aggregate": agg,
                "fit": fit,
                "step_fit": sfit,
                "step_fit_within": sfit_within,
                "paired": {f"{a}-{b}": d for (a, b), d in paired.items()},
                "pooled": pooled,
            },
            f,
            indent=1,
        )
    if results_page:
        replace_results_block(results_page, text, block)
    return text
