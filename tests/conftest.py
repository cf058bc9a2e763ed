"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Simulated Ray clusters bind to the loopback address, never to the machine's network interface
# (read by ray when it is imported: with it off, ray uses 127.0.0.1 for every node).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import sys  # noqa: E402

# The checkout's root first: `configs` and `gagar_jax` of this tree, whatever is installed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Shared fixtures: one real SGLang server per test session (see tests/sglang_fixtures.py).
from sglang_fixtures import (  # noqa: E402, F401
    sglang_client,
    sglang_server,
    sglang_workdir,
    tiny_sglang_model,
)

from tests.update_fixtures import tiny_config  # noqa: E402


@pytest.fixture
def tiny_model_config():
    """The tests' tiny decoder config (``tests.update_fixtures.tiny_config``)."""
    return tiny_config()


# CI runs on 2 shared cores: no deadline per example (jit compiles vary), fixed example counts.
settings.register_profile("ci", deadline=None, max_examples=40, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
