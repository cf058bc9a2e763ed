"""Run records: console progress with ETA, JSONL, TensorBoard, plots, summaries, comparisons.

Every training loop writes its metrics with :class:`MetricsWriter` (the RL loop,
``gagar_jax.rl.train``, and the feedback trainer, ``gagar_jax.feedback.run``), and the run's
summary, plots and comparisons read them back here, so the record of a run has one format and
one reader whichever experiment wrote it. It imports nothing of the package.

Only the primary process (``jax.process_index() == 0``) writes; the others get a writer whose
methods do nothing, so the loop never branches on the process index itself.

Files in ``workdir``:

* ``metrics.jsonl``: one JSON object per logged step and phase
  (``{"step": 3, "phase": "train", "time": ..., "pass_rate": 0.4, ...}``); appended, so a resumed
  run continues the same file (rows of steps after the checkpoint are dropped on resume by
  :func:`truncate_jsonl`, so no step appears twice).
* ``tb/``: TensorBoard event files (tensorboardX), one scalar per metric under ``phase/name``.
* ``training_dynamics.png``: :func:`plot_run`, the paper's panels (pass rate, quality score,
  T1 share, response length, entropy, policy-gradient loss mean, credit ratio).
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The panels of the per-run plot and the comparison: (metric key, title).
PLOT_PANELS: tuple[tuple[str, str], ...] = (
    ("pass_rate", "pass rate (train rollouts)"),
    ("eval_pass_rate", "pass rate (held-out)"),
    ("quality", "quality score of passing solutions"),
    ("t1_share", "T1 share of passing solutions"),
    ("rank1_share", "rank-1 share of passing non-cheats"),
    ("response_length", "response length (tokens)"),
    ("entropy", "policy entropy"),
    ("pg_loss_mean", "policy-gradient loss mean"),
    ("credit_ratio", "credit ratio (pos total / |neg total|)"),
)
# Figures shown on the console line, in order: (key, short label, format).
CONSOLE_KEYS: tuple[tuple[str, str, str], ...] = (
    ("pass_rate", "pass", ".2f"),
    ("quality", "qual", ".2f"),
    ("t1_share", "T1", ".2f"),
    ("rank1_share", "R1", ".2f"),
    ("response_length", "len", ".1f"),
    ("entropy", "ent", ".3f"),
    ("pg_loss_mean", "pg", "+.4f"),
    ("credit_ratio", "credit", ".2f"),
    ("sampling_rounds", "rounds", ".0f"),
)


def _finite_float(value: Any) -> float | None:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsWriter:
    """Writes scalars to console, JSONL and TensorBoard (primary process only).

    Args:
      workdir: the run directory.
      total_steps: for the progress bar and the ETA.
      start_step: first step this process runs (a resumed run starts later; the ETA uses only
        the steps this process timed).
      primary: whether this process writes (``jax.process_index() == 0``).
      tensorboard: write TensorBoard event files.
      stream: where console lines go.
    """

    def __init__(
        self,
        workdir: str,
        *,
        total_steps: int,
        start_step: int = 0,
        primary: bool = True,
        tensorboard: bool = True,
        stream=None,
    ):
        self.workdir = workdir
        self.total_steps = total_steps
        self.start_step = start_step
        self.primary = primary
        self.stream = stream or sys.stdout
        self._t0 = time.monotonic()
        self._tb = None
        self._jsonl = None
        if not primary:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: not needed off process 0

            self._tb = SummaryWriter(os.path.join(workdir, "tb"), flush_secs=10)

    def start_clock(self, step: int) -> None:
        """Restarts the ETA clock at ``step`` (call when the timed phase begins, after setup)."""
        self._t0 = time.monotonic()
        self.start_step = step

    def write(self, step: int, metrics: Mapping[str, Any], *, phase: str = "train") -> None:
        """Records finite scalars of ``metrics`` at ``step``; non-finite ones are kept as null."""
        if not self.primary:
            return
        row: dict[str, Any] = {"step": int(step), "phase": phase, "time": time.time()}
        for key, value in metrics.items():
            row[key] = _finite_float(value)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key in ("step", "phase", "time") or value is None:
                    continue
                self._tb.add_scalar(f"{phase}/{key}", value, global_step=int(step))

    def progress(self, step: int, metrics: Mapping[str, Any]) -> str:
        """Prints (and returns) one progress line: bar, step, ETA and the key figures."""
        done = step + 1
        frac = done / max(self.total_steps, 1)
        width = 20
        bar = "#" * int(round(frac * width))
        elapsed = time.monotonic() - self._t0
        timed = max(done - self.start_step, 1)
        eta = elapsed / timed * max(self.total_steps - done, 0)
        parts = [
            f"[{bar:<{width}}] step {done}/{self.total_steps}",
            f"{format_duration(elapsed)} elapsed, ETA {format_duration(eta)}",
        ]
        for key, label, fmt in CONSOLE_KEYS:
            value = _finite_float(metrics.get(key))
            if value is not None:
                parts.append(f"{label} {value:{fmt}}")
        line = " | ".join(parts)
        if self.primary:
            print(line, file=self.stream, flush=True)
        return line

    def log(self, message: str) -> None:
        if self.primary:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Rows of a metrics file; a torn last line (a killed writer) is skipped."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def truncate_jsonl(
    path: str, *, keep_before_step: int, drop_phases: Sequence[str] | None = None
) -> int:
    """Drops rows a resumed run will write again; returns how many were dropped.

    Train rows with ``step >= keep_before_step`` go (those steps are redone; an eval row at
    step n, written after n updates, is kept for n == keep_before_step > 0); SFT rows are
    step-indexed separately and are kept unless their phase is in ``drop_phases`` (an SFT phase
    that was killed before finishing is redone from its start). Rewrites the file atomically.
    """
    if not os.path.exists(path):
        return 0
    drop = set(drop_phases or ())
    rows = read_jsonl(path)
    k = keep_before_step

    def keep(r):
        phase, step = r.get("phase"), int(r.get("step", 0))
        if phase in drop:
            return False
        if phase == "sft":
            return True
        if phase == "eval":  # an eval after n updates is logged at step n, before checkpoint n
            return step < k or (step == k and k > 0)
        return step < k

    kept = [r for r in rows if keep(r)]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return len(rows) - len(kept)


def series(
    rows: Iterable[Mapping[str, Any]], key: str, *, phase: str | None = None
) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping rows where it is missing or null."""
    xs, ys = [], []
    for r in rows:
        if phase is not None and r.get("phase") != phase:
            continue
        v = r.get(key)
        if v is None:
            continue
        xs.append(int(r["step"]))
        ys.append(float(v))
    return xs, ys


def run_series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """A panel's series: ``eval_*`` keys come from eval rows, the rest from train rows."""
    return series(rows, key, phase="eval" if key.startswith("eval_") else "train")


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    out_path: str,
    *,
    title: str = "",
    smooth: int = 1,
) -> str:
    """One figure with a panel per :data:`PLOT_PANELS` entry and a line per run.

    Args:
      runs: label -> metric rows (from :func:`read_jsonl`).
      out_path: the PNG to write.
      smooth: trailing moving-average window for train series (1 = raw).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows_n = math.ceil(len(PLOT_PANELS) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
    for ax, (key, panel_title) in zip(axes.flat, PLOT_PANELS):
        for label, rows in runs.items():
            xs, ys = run_series(rows, key)
            if not xs:
                continue
            if smooth > 1 and not key.startswith("eval_"):
                ys = _moving_average(ys, smooth)
            ax.plot(xs, ys, marker="o" if len(xs) < 12 else None, ms=3, label=label)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        lo, hi = ax.get_ylim()
        if ax.lines and hi - lo < 1e-3:  # a conserved quantity: show it flat, not float jitter
            mid = (lo + hi) / 2
            ax.set_ylim(mid - 0.05 * max(abs(mid), 1.0), mid + 0.05 * max(abs(mid), 1.0))
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PLOT_PANELS) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if len(runs) > 1 and handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def plot_run(workdir: str, *, out_path: str | None = None, smooth: int = 1) -> str:
    """The per-run training-dynamics plot, ``workdir/training_dynamics.png`` by default."""
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    out_path = out_path or os.path.join(workdir, "training_dynamics.png")
    return plot_runs(
        {os.path.basename(os.path.normpath(workdir)): rows}, out_path, title=workdir, smooth=smooth
    )


def _moving_average(ys: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        chunk = ys[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def summarize(rows: Sequence[Mapping[str, Any]], *, window: int = 5) -> dict[str, float | None]:
    """Per-metric summary of a run: mean over the first and last ``window`` logged steps.

    Returns ``{f"{key}_first": ..., f"{key}_last": ..., "eval_pass_rate_final": ...}`` for
    each plot panel (``None`` where the run never logged it).
    """
    out: dict[str, float | None] = {}
    for key, _ in PLOT_PANELS:
        _, ys = run_series(rows, key)
        if key.startswith("eval_"):
            out[f"{key}_first"] = ys[0] if ys else None
            out[f"{key}_last"] = ys[-1] if ys else None
            continue
        out[f"{key}_first"] = sum(ys[:window]) / len(ys[:window]) if ys else None
        out[f"{key}_last"] = sum(ys[-window:]) / len(ys[-window:]) if ys else None
    return out


def binomial_diff_se(p_first: float, p_last: float, n: int) -> float:
    """Standard error of ``p_last - p_first``, two pass rates of ``n`` samples each (treated
    as independent draws; samples of the same tasks are correlated, so this is a lower bound
    on the evaluation noise)."""
    n = max(int(n), 1)
    return math.sqrt((p_first * (1 - p_first) + p_last * (1 - p_last)) / n)


def format_summary(title: str, summary: Mapping[str, Any], *, eval_samples: int) -> str:
    """The console summary of a finished run: first -> last per panel, then what changed.

    The closing lines compare the held-out pass rate's change with the noise of one evaluation
    (``eval_samples`` samples, :func:`binomial_diff_se`) and say in words what improved: a
    newcomer reads whether RL raised the pass rate beyond noise, and if not, what it did change.

    Args:
      title: the first line (run name, mode, steps, workdir).
      summary: :func:`summarize`'s dict (``<key>_first`` / ``<key>_last``), optionally with
        ``update_traces`` and ``plot``.
      eval_samples: samples per held-out evaluation (tasks x samples per task).
    """
    lines = [title, f"   {'':<42s} {'first':>10s} -> {'last':>10s}"]
    for key, name in PLOT_PANELS:
        a, b = summary.get(f"{key}_first"), summary.get(f"{key}_last")
        if a is None or b is None:
            continue
        lines.append(f"   {name:<42s} {a:10.4f} -> {b:10.4f}")
    if summary.get("update_traces") is not None:
        lines.append(f"   update compiled {summary['update_traces']} time(s) (static batch shape)")
    if "plot" in summary:
        lines.append(f"   plot: {summary['plot']}")

    def change(key):
        a, b = summary.get(f"{key}_first"), summary.get(f"{key}_last")
        return None if a is None or b is None else (a, b, b - a)

    lines.append("What changed:")
    held = change("eval_pass_rate")
    beyond = False
    if held is not None:
        a, b, d = held
        se = binomial_diff_se(a, b, eval_samples)
        beyond = abs(d) > 2 * se
        verdict = (
            ("raised" if d > 0 else "lowered") + " beyond the noise of one evaluation"
            if beyond
            else "within the noise of one evaluation"
        )
        lines.append(
            f"   held-out pass rate {a:.3f} -> {b:.3f} ({d:+.3f}; 2 SE of the change "
            f"at {eval_samples} samples: {2 * se:.3f}): {verdict}"
        )
    gains = []
    for key, name in (
        ("quality", "quality of passing solutions"),
        ("t1_share", "share of passing solutions in the best tier (T1)"),
    ):
        c = change(key)
        if c is not None:
            lines.append(f"   {name} {c[0]:.3f} -> {c[1]:.3f} ({c[2]:+.3f})")
            if c[2] > 0:
                gains.append(name)
    if held is not None and not beyond and gains:
        lines.append(
            _wrap(
                "RL changed which passing patch the policy writes ("
                + " and ".join(gains)
                + " rose), not how often it passes on held-out tasks: the grader's quality "
                "signal acts among passing solutions, and one evaluation cannot resolve a "
                "pass-rate change smaller than the figure above. docs/results/heldout_gain.md "
                "measures the change on 512 held-out tasks over seeds (the toy job's "
                "weak_start variant)."
            )
        )
    elif held is not None and beyond and held[2] > 0:
        lines.append(
            _wrap(
                "RL raised the held-out pass rate beyond one evaluation's noise; "
                "compare seeds before reading it as a gain "
                "(docs/results/heldout_gain.md)."
            )
        )
    return "\n".join(lines)


def _wrap(text: str) -> str:
    return textwrap.fill(
        text, width=100, initial_indent="   ", subsequent_indent="   ", break_on_hyphens=False
    )


def markdown_table(summaries: Mapping[str, Mapping[str, float | None]]) -> str:
    """A markdown table: one row per run, first -> last for each panel metric."""
    keys = [k for k, _ in PLOT_PANELS]
    header = "| run | " + " | ".join(keys) + " |"
    sep = "|---|" + "---|" * len(keys)
    lines = [header, sep]
    for label, s in summaries.items():
        cells = []
        for k in keys:
            a, b = s.get(f"{k}_first"), s.get(f"{k}_last")
            cells.append("n/a" if a is None or b is None else f"{a:.3g} -> {b:.3g}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_runs(
    workdirs: Mapping[str, str], out_dir: str, *, window: int = 5, smooth: int = 3
) -> str:
    """Plot + markdown comparison of several runs; returns the markdown.

    Writes ``out_dir/comparison.png`` and ``out_dir/comparison.md``. The markdown holds the
    table of :func:`markdown_table` and, when runs labelled ``gagar`` / ``binary`` /
    ``discount_only`` are present, the paper's three comparisons as plain differences of the
    last-window means (no claim is made beyond the figures).

    Raises:
      FileNotFoundError: a workdir has no ``metrics.jsonl`` (names it).
    """
    runs = {}
    for label, wd in workdirs.items():
        path = os.path.join(wd, "metrics.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"run {label!r}: no metrics file at {path}")
        runs[label] = read_jsonl(path)
    os.makedirs(out_dir, exist_ok=True)
    png = plot_runs(
        runs,
        os.path.join(out_dir, "comparison.png"),
        title="Gagar ablation (toy): " + ", ".join(runs),
        smooth=smooth,
    )
    summaries = {label: summarize(rows, window=window) for label, rows in runs.items()}
    lines = [
        f"# Run comparison\n\nFirst -> last: means over the first and last {window} logged "
        "train steps (eval: first and last evaluation).\n",
        markdown_table(summaries),
        "",
        f"![comparison]({os.path.basename(png)})",
        "",
    ]
    notes = _ablation_notes(summaries)
    if notes:
        lines += ["## Paper's comparisons at this scale (last-window means)", ""] + notes + [""]
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "comparison.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def _ablation_notes(s: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    def last(label, key):
        return s.get(label, {}).get(f"{key}_last")

    notes = []
    if "gagar" in s and "binary" in s:
        for key, better in (
            ("quality", "higher"),
            ("t1_share", "higher"),
            ("response_length", "shorter"),
            ("eval_pass_rate", "higher"),
        ):
            a, b = last("gagar", key), last("binary", key)
            if a is None or b is None:
                continue
            expected = (a > b) if better == "higher" else (a < b)
            seen = "reproduced" if expected else "NOT reproduced"
            notes.append(
                f"- {key}: gagar {a:.4g} vs binary {b:.4g} (diff {a - b:+.4g}); paper "
                f"expects gagar {better}: {seen}"
            )
    if "discount_only" in s:
        for key, ref in (
            ("pg_loss_mean", "gagar"),
            ("entropy", "gagar"),
            ("credit_ratio", "gagar"),
        ):
            a, b = last("discount_only", key), last(ref, key)
            if a is None or b is None:
                continue
            notes.append(f"- {key}: discount_only {a:.4g} vs {ref} {b:.4g} (diff {a - b:+.4g})")
    return notes
