"""Analysis of finished runs: the multi-seed ablation (means, standard errors, banded plots)."""

from gagar_jax.analysis.ablation import (
    METRICS,
    aggregate,
    compare_seeds,
    linear_fit,
    mean_se,
    run_summary,
)

__all__ = ["METRICS", "aggregate", "compare_seeds", "linear_fit", "mean_se", "run_summary"]
