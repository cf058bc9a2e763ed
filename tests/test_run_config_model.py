"""The model and update options a researcher sets from the command line reach the policy: the
toy config lists every ``TransformerConfig`` execution/architecture field and the update's
chunked logits and MoE loss weight, and a Hugging Face checkpoint runs with the config's
execution options (dtype, remat, scanned layers) while keeping its own architecture."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import toy_gagar
from gagar_jax.models import Transformer, TransformerConfig, save_hf_safetensors
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.policy import EXECUTION_FIELDS, build_model
from gagar_jax.update import UpdateConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _toy_config(arg="smoke"):
    return toy_gagar.get_config(arg)


def test_model_and_update_options_are_overridable_and_reach_the_run_config():
    c = _toy_config()
    # what `--config.model.scan_layers=True ...` sets: every key must already exist
    c.model.update(
        scan_layers=True,
        remat=True,
        remat_policy="dots",
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    c.learner.update(logits_chunk_size=8, router_aux_loss_coef=0.01)
    cfg = RunConfig.from_config_dict(c)
    m = cfg.model_config(vocab_size=100)
    assert (m.scan_layers, m.remat, m.remat_policy, m.qk_norm) == (True, True, "dots", True)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (4, 2, 32)
    assert (cfg.learner.logits_chunk_size, cfg.learner.router_aux_loss_coef) == (8, 0.01)
    # the defaults the config lists are the library's: listing them changes no run
    base = RunConfig.from_config_dict(_toy_config())
    library = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    for f in (
        "scan_layers",
        "remat_policy",
        "qk_norm",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "causal_block_size",
    ):
        assert getattr(base.model, f) == library[f], f
    updates = {f.name: f.default for f in dataclasses.fields(UpdateConfig)}
    for f in ("logits_chunk_size", "router_aux_loss_coef"):
        assert getattr(base.learner, f) == updates[f], f


def test_hf_checkpoint_runs_with_the_configs_execution_options(tmp_path):
    c = _toy_config()
    cfg = RunConfig.from_config_dict(c)
    plain = Transformer(cfg.model_config(vocab_size=64), rngs=nnx.Rngs(0))
    save_hf_safetensors(plain, plain.config, str(tmp_path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    mask = jnp.ones((2, 7), bool)
    want = np.asarray(plain(tokens, positions, attention_mask=mask))

    c.model.update(hf_checkpoint=str(tmp_path), scan_layers=True, remat=True, causal_block_size=3)
    c.model.num_layers = 5  # architecture comes from config.json, not from the run config
    cfg = RunConfig.from_config_dict(c)
    model_config, model = build_model(cfg, vocab_size=64)
    assert model_config.scan_layers and model_config.remat
    assert model_config.num_layers == plain.config.num_layers
    for f in EXECUTION_FIELDS:
        assert getattr(model_config, f) == getattr(cfg.model, f), f
    got = model(tokens, positions, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
