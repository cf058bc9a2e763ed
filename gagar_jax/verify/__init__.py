"""Verifiers: sandboxed execution, the Python-repo test verifier, the behaviour monitor."""

from gagar_jax.verify.flags import MonitorFlag
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
