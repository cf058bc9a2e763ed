"""Low-precision rollouts: the weight formats, the sampler's conversion once per sync, the KV
cache dtype, and the run config's defaults (truncated IS on when the precisions differ)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.models import create_model
from gagar_jax.rollout import SamplingParams
from gagar_jax.rollout.precision import (
    QuantizedArray,
    convert_params,
    dequantize_tree,
    quantize,
    weight_bytes,
)
from gagar_jax.rollout.sampler import Sampler, score_tokens
from tests.update_fixtures import tiny_config

MODEL = tiny_config(initializer_range=0.3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
BUCKETS = dict(batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))


@pytest.fixture(scope="module")
def model():
    return create_model(MODEL, seed=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-3, 10.0), kind=st.sampled_from(["int8"]))
def test_int8_rounds_each_weight_to_its_nearest_grid_point(seed, scale, kind):
    w = np.random.default_rng(seed).normal(0, scale, (3, 7, 5)).astype(np.float32)
    w[0, :, 0] = 0.0  # an all-zero output column
    q = quantize(jnp.asarray(w), kind, dtype="float32")
    assert q.values.dtype == jnp.int8 and q.scale.shape == (3, 1, 5)
    back = np.asarray(q.dequantize())
    assert (np.abs(back - w) <= np.asarray(q.scale) / 2 * (1 + 1e-5)).all()
    assert np.abs(np.asarray(q.values)).max() <= 127
    np.testing.assert_array_equal(back[0, :, 0], 0.0)


def test_fp8_keeps_the_relative_error_of_e4m3():
    w = np.random.default_rng(0).normal(0, 1, (16, 8)).astype(np.float32)
    q = quantize(jnp.asarray(w), "fp8", dtype="float32")
    assert q.values.dtype == jnp.float8_e4m3fn
    big = np.abs(w) > 0.05 * np.abs(w).max(axis=0)
    rel = np.abs(np.asarray(q.dequantize()) - w)[big] / np.abs(w)[big]
    assert rel.max() <= 2**-4  # 3 mantissa bits: half an ulp of 2^-3


def test_convert_params_quantizes_the_projections_only(model):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    conv = convert_params(params, "int8")
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(conv, is_leaf=is_q)[0]
    kinds = {jax.tree_util.keystr(p): ("q" if is_q(x) else str(x.dtype)) for p, x in flat}
    assert kinds["['embed_tokens']"] == "bfloat16"
    assert kinds["['lm_head']"] == "q" and kinds["['layers'][0]['mlp']['down_proj']"] == "q"
    assert kinds["['layers'][0]['self_attn']['q_proj']"] == "q"
    assert kinds["['layers'][0]['input_layernorm']['weight']"] == "bfloat16"
    q = conv["layers"][0]["self_attn"]["q_proj"]  # [E, N, D]: one scale per (head, dim)
    assert q.scale.shape == (1,) + q.values.shape[1:]
    o = conv["layers"][0]["self_attn"]["o_proj"]  # [N, D, E]
    assert o.scale.shape == (1, 1, o.values.shape[-1])
    assert weight_bytes(conv) < 0.4 * weight_bytes(params)
    assert convert_params(params, "float32") is params
    deq = dequantize_tree(conv)
    assert deq["lm_head"].dtype == jnp.bfloat16


@pytest.mark.parametrize("precision", ["bfloat16", "int8", "fp8"])
def test_sampler_converts_once_per_sync_and_compiles_nothing_new(model, precision):
    sampler = Sampler(model, precision=precision, **BUCKETS)
    assert sampler.config.dtype == "bfloat16" and sampler.model_config.dtype == "float32"
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1)
    first = sampler.generate(PROMPTS, params)
    traces = sampler.trace_count
    trainer = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sampler.sync_weights(trainer, 7) == 7
    again = sampler.generate(PROMPTS, params)
    assert sampler.trace_count == traces  # the converted tree is the sampler's own
    assert [[s.tokens for s in row] for row in again] == [[s.tokens for s in row] for row in first]
    assert again[0][0].policy_version == 7
    # a model object and an nnx.State convert too
    sampler.sync_weights(model, 8)
    sampler.sync_weights(nnx.state(model, nnx.Param), 9)
    assert sampler.trace_count == traces
    # and another model's weights give other samples
    other = nnx.to_pure_dict(nnx.state(create_model(MODEL, seed=3), nnx.Param))
    sampler.sync_weights(other, 10)
    moved = sampler.generate(PROMPTS, params)
    assert [[s.tokens for s in row] for row in moved] != [[s.tokens for s in row] for row in first]


def test_low_precision_logprobs_are_close_to_the_float32_trainers(model):
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=1)
    worst = {}
    for precision, kv in (
        ("float32", "auto"),
        ("float32", "bfloat16"),
        ("float32", "int8"),
        ("int8", "auto"),
    ):
        out = Sampler(model, precision=precision, kv_cache_dtype=kv, **BUCKETS).generate(
            PROMPTS, params
        )
        worst[(precision, kv)] = max(
            float(np.abs(score_tokens(model, p + s.tokens, len(p)) - np.array(s.logprobs)).max())
            for p, row in zip(PROMPTS, out)
            for s in row
        )
    assert worst[("float32", "auto")] < 1e-4
    assert 1e-4 < worst[("float32", "bfloat16")] < 0.2  # keys and values rounded to bfloat16
    assert 1e-4 < worst[("float32", "int8")] < 0.3  # keys and values on a per-token int8 grid
    assert 1e-3 < worst[("int8", "auto")] < 0.5


def test_bad_precision_names_the_argument(model):
    with pytest.raises(ValueError, match="precision"):
        Sampler(model, precision="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Sampler(model, kv_cache_dtype="int4")


def test_run_config_turns_truncated_is_on_for_a_low_precision():
    from gagar_jax.rl.config import ConfigError, RunConfig

    base = RunConfig.from_config_dict({})
    assert base.learner.rollout_is == "none" and not base.learner.decoupled
    assert not base.learner.mismatch_metrics
    low = RunConfig.from_config_dict({"rollout": {"precision": "int8"}})
    assert low.learner.rollout_is == "token" and low.learner.decoupled
    assert low.learner.mismatch_metrics
    assert low.fingerprint() != base.fingerprint()
    # explicitly off stays off; a weighting correction takes TIS's place
    off = RunConfig.from_config_dict(
        {"rollout": {"precision": "int8"}, "learner": {"rollout_is": "none"}}
    )
    assert off.learner.rollout_is == "none"
    ice = RunConfig.from_config_dict(
        {"rollout": {"precision": "bfloat16"}, "learner": {"rollout_correction": "icepop"}}
    )
    assert ice.learner.rollout_is == "none" and ice.learner.decoupled
    bitwise = RunConfig.from_config_dict({"rollout": {"bitwise_onpolicy": True}})
    assert bitwise.learner.mismatch_metrics and bitwise.learner.rollout_is == "none"
    with pytest.raises(ConfigError, match="rollout.bitwise_onpolicy"):
        RunConfig.from_config_dict({"rollout": {"bitwise_onpolicy": True, "precision": "int8"}})
    with pytest.raises(ConfigError, match="rollout.bitwise_onpolicy"):
        RunConfig.from_config_dict({"rollout": {"bitwise_onpolicy": True, "max_staleness": 1}})
    with pytest.raises(ConfigError, match="rollout.precision"):
        RunConfig.from_config_dict(
            {"rollout": {"engine": "sglang", "sglang_url": "http://x", "precision": "int8"}}
        )
    with pytest.raises(ConfigError, match="rollout.precision"):
        RunConfig.from_config_dict({"rollout": {"precision": "int4"}})
    int8_kv = RunConfig.from_config_dict({"rollout": {"kv_cache_dtype": "int8"}})
    assert int8_kv.learner.rollout_is == "token" and int8_kv.learner.mismatch_metrics
    with pytest.raises(ConfigError, match="rollout.kv_cache_dtype"):
        RunConfig.from_config_dict({"rollout": {"kv_cache_dtype": "int4"}})
