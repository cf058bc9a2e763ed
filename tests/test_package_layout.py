"""The package split: the update library stands alone, and ``gagar_jax.train`` is only an alias."""

import subprocess
import sys

import gagar_jax.train
import gagar_jax.update


def test_update_library_imports_no_experiment_package():
    """``gagar_jax.update`` loads without envs/grading/rollout/rl (DESIGN's dependency order)."""
    code = (
        "import sys, gagar_jax.update, gagar_jax.update.sft\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[:2] in "
        "(['gagar_jax', p] for p in ('envs', 'grading', 'rollout', 'rl', 'verify', 'data')))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_train_alias_reexports_update_names():
    """``from gagar_jax.train import UpdateConfig, jit_update`` gets the update library's names."""
    assert gagar_jax.train.__all__
    for name in gagar_jax.train.__all__:
        assert getattr(gagar_jax.train, name) is getattr(gagar_jax.update, name), name
    assert set(gagar_jax.train.__all__) <= set(gagar_jax.update.__all__)
