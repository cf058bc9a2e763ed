"""Run records and their analysis: the metrics writers every training loop uses
(``gagar_jax.analysis.writers``: JSONL, TensorBoard, console, per-run plots and summaries) and
the multi-seed ablation of finished runs (means, standard errors, banded plots)."""

from gagar_jax.analysis.ablation import (
    METRICS,
    aggregate,
    compare_seeds,
    linear_fit,
    mean_se,
    run_summary,
)

__all__ = ["METRICS", "aggregate", "compare_seeds", "linear_fit", "mean_se", "run_summary"]
