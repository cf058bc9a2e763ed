"""When the heap-keeping allocator setting applies: XLA:CPU hosts only, unless asked for."""

import os
import subprocess
import sys

import pytest

from gagar_jax.update import malloc


@pytest.mark.parametrize(
    "platforms, want",
    [("cpu", None), ("CPU ", None), ("cuda", "cuda"), ("tpu,cpu", "tpu,cpu")],
)
def test_accelerator_plugin_follows_jax_platforms(monkeypatch, platforms, want):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert malloc.accelerator_plugin() == want


def test_accelerator_plugin_finds_installed_plugins(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)

    class EntryPoint:
        name = "xla_cuda13"

    # Stands in for an installed GPU plugin, which this CPU-only machine cannot have.
    monkeypatch.setattr(malloc.metadata, "entry_points", lambda group: [EntryPoint()])
    assert malloc.accelerator_plugin() == "xla_cuda13"


# The module alone (standard library only), without the package's JAX imports: a child
# interpreter starts in a fraction of a second.
_LOAD = (
    "import importlib.util as u\n"
    f"spec = u.spec_from_file_location('malloc', {malloc.__file__!r})\n"
    "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
)


def _keep_heap_in_child(env: dict) -> str:
    """keep_heap() in a fresh interpreter (the setting is process-wide)."""
    code = _LOAD + "print(m.keep_heap())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    "extra, want",
    [
        ({"JAX_PLATFORMS": "cpu"}, "True"),
        ({"JAX_PLATFORMS": "cpu", "GAGAR_MALLOC_KEEP_HEAP": "0"}, "False"),
        ({"JAX_PLATFORMS": "cuda"}, "False"),
    ],
)
def test_keep_heap_default_is_cpu_only(extra, want):
    env = {k: v for k, v in os.environ.items() if k not in ("GAGAR_MALLOC_KEEP_HEAP",)}
    env.update(extra)
    assert _keep_heap_in_child(env) == want


def test_keep_heap_explicit_enable_applies_on_any_host(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert malloc.keep_heap(enable=False) is False
    # An explicit True is obeyed whatever the platform (run in a child: process-wide).
    code = "import os; os.environ['JAX_PLATFORMS'] = 'cuda'\n" + _LOAD + "print(m.keep_heap(True))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
