"""Verifiers: sandboxed execution, the Python-repo test verifier, the behaviour monitor."""

from gagar_jax.verify.flags import MonitorFlag

__all__ = ["MonitorFlag"]
