"""Verifiers: sandboxed execution, the Python-repo test verifier, the behaviour monitor."""

from gagar_jax.verify.diff import DiffError, apply_unified_diff, parse_unified_diff
from gagar_jax.verify.flags import MonitorFlag
from gagar_jax.verify.monitor import (
    RULES,
    MonitorContext,
    MonitorRefusal,
    leakage_screen,
    monitor,
    monitor_log,
    monitor_metrics,
    monitor_patch,
    monitor_trajectory,
    patch_similarity,
)
from gagar_jax.verify.repo import RepoVerification, context_for_repo_task, verify_repo_patch
from gagar_jax.verify.sandbox import (
    MECHANISMS,
    STATUSES,
    Limits,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    available_mechanisms,
    python_for_sandbox,
    run_sandboxed,
    select_mechanism,
)

__all__ = [
    "RULES",
    "MonitorContext",
    "MonitorRefusal",
    "context_for_repo_task",
    "leakage_screen",
    "monitor",
    "monitor_log",
    "monitor_metrics",
    "monitor_patch",
    "monitor_trajectory",
    "patch_similarity",
    "DiffError",
    "RepoVerification",
    "apply_unified_diff",
    "parse_unified_diff",
    "verify_repo_patch",
    "MECHANISMS",
    "STATUSES",
    "Limits",
    "MonitorFlag",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "available_mechanisms",
    "python_for_sandbox",
    "run_sandboxed",
    "select_mechanism",
]
