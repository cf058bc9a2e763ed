"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Simulated Ray clusters bind to the loopback address, never to the machine's network interface
# (read by ray when it is imported: with it off, ray uses 127.0.0.1 for every node).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import atexit  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib.metadata  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# Tests check values, not speed, and most of a unit pass's CPU time is XLA compiling small
# programs. So XLA compiles them fast: backend optimisations off (LLVM at -O0, no expensive
# passes), the classic elemental emitters instead of the MLIR fusion emitters, one codegen
# module per program. The update step of the tests' tiny model compiles in ~2 CPU-s instead of
# ~10 and runs as fast. The xdist workers and the subprocesses the tests start inherit the
# setting; a flag this jaxlib does not know is left out (the probe below), and
# GAGAR_TEST_FAST_COMPILE=0 compiles as users' runs do. The probe (a Python start that imports
# jax, ~1.6 s before any test runs) answers once per virtual environment: an accepted set of
# flags is remembered there, keyed by the jaxlib version, the interpreter and the flags.
FAST_COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _xla_flags_accepted(env: dict) -> bool:
    """Whether jax starts with ``env``'s XLA_FLAGS (XLA aborts on a flag it does not know).
    Only a yes is remembered: a probe that failed for any other reason is tried again."""
    try:
        key = "|".join((importlib.metadata.version("jaxlib"), sys.executable, env["XLA_FLAGS"]))
    except importlib.metadata.PackageNotFoundError:
        key = None
    marker = None
    if key is not None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        marker = os.path.join(sys.prefix, f".gagar-test-xla-flags-{digest}")
        if os.path.exists(marker):
            return True
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    if subprocess.run(probe, env=env, capture_output=True).returncode != 0:
        return False
    if marker is not None:
        with contextlib.suppress(OSError):
            with open(marker, "w") as f:
                f.write(key + "\n")
    return True


if (
    "PYTEST_XDIST_WORKER" not in os.environ
    and os.environ.get("GAGAR_TEST_FAST_COMPILE", "1") != "0"
):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    _extra = [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in os.environ["XLA_FLAGS"]]
    _probe_env = dict(os.environ, XLA_FLAGS=" ".join([os.environ["XLA_FLAGS"], *_extra]))
    if _extra and _xla_flags_accepted(_probe_env):
        os.environ["XLA_FLAGS"] = _probe_env["XLA_FLAGS"]

# One persistent JAX compilation cache per pytest run, in a fresh temporary directory (every run
# starts cold), shared by the run's xdist workers (they inherit this process's environment): a
# program one worker compiled, or one a test builds again from a new closure (an identical
# program), is read back instead of compiled. Programs under 0.1 s of compile time are not
# written. A run that names its own JAX_COMPILATION_CACHE_DIR keeps it; GAGAR_TEST_JAX_CACHE=0
# turns the cache off.
if (
    "PYTEST_XDIST_WORKER" not in os.environ
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
    and os.environ.get("GAGAR_TEST_JAX_CACHE", "1") != "0"
):
    _JAX_CACHE = tempfile.mkdtemp(prefix="gagar_jax_test_cache_")
    atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


def pytest_configure(config):
    """``GAGAR_TEST_PROFILE=<prefix>``: per-test CPU seconds and compilations (compile_profile)."""
    from tests import compile_profile

    compile_profile.register(config)


@pytest.fixture
def tiny_model_config():
    """The tests' tiny decoder config (``tests.update_fixtures.tiny_config``)."""
    return tiny_config()


# CI runs on 2 shared cores: no deadline per example (jit compiles vary), fixed example counts.
settings.register_profile("ci", deadline=None, max_examples=40, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
