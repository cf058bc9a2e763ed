"""SGLang's routed experts in the layout routing replay consumes (``gagar_jax.rollout.
sglang_routes``, ``SGLangClient(record_routes=...)``), checked on a response a real SGLang
0.5.23 server gave (CPU, ``--enable-return-routed-experts``) for the tiny Qwen3-MoE below
(``create_model(MOE, seed=0)`` exported with ``save_hf_safetensors``): greedy, 5 prompt tokens,
6 new ones. The server's routes are the JAX model's own, row by row, which pins the layout
(rows = prompt + generated - 1 tokens, then layers, then the top-k). The live server's test is
``tests/test_routing_replay_sglang.py``."""

import base64

import jax.numpy as jnp
import numpy as np
import pytest

from gagar_jax.models import TransformerConfig, create_model
from gagar_jax.rollout.sglang_client import SGLangClient, SGLangRequestError
from gagar_jax.rollout.sglang_routes import RoutesFormatError, routes_from_meta

MOE = TransformerConfig(
    vocab_size=1024,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=128,
    rope_theta=10000.0,
    qkv_bias=False,
    qk_norm=True,
    initializer_range=0.2,
    max_position_embeddings=2048,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
PROMPT = [5, 17, 300, 42, 7]
# the server's answer (meta_info trimmed to the fields the client reads)
RESPONSE = {
    "output_ids": [119, 792, 489, 489, 124, 124],
    "meta_info": {
        "finish_reason": {"type": "length", "length": 6},
        "weight_version": "default",
        "output_token_logprobs": [
            [-3.9385523796081543, 119, None],
            [-3.5099122524261475, 792, None],
            [-3.0332717895507812, 489, None],
            [-3.2267515659332275, 489, None],
            [-3.00449538230896, 124, None],
            [-1.9588596820831299, 124, None],
        ],
        "routed_experts": (
            "AgAAAAEAAAAFAAAAAwAAAAIAAAAEAAAABQAAAAQAAAAAAAAAAgAAAAUAAAAHAAAAAwAAAAQAAAAEAAAABwAA"
            "AAIAAAABAAAABwAAAAUAAAAAAAAABwAAAAcAAAADAAAABAAAAAAAAAADAAAABwAAAAAAAAAFAAAAAwAAAAcA"
            "AAAAAAAABQAAAAMAAAAHAAAAAAAAAAIAAAADAAAABwAAAA=="
        ),
    },
}
SHAPE = (MOE.num_layers, MOE.num_experts_per_tok, MOE.num_experts)


def test_real_response_converts_to_the_models_own_routes():
    gen = RESPONSE["output_ids"]
    prompt_routes, routes = routes_from_meta(RESPONSE["meta_info"], len(PROMPT), len(gen), *SHAPE)
    assert prompt_routes.shape == (5, 2, 2) and routes.shape == (6, 2, 2)
    assert prompt_routes.dtype == np.int16 and routes.dtype == np.int16
    assert np.all(routes[-1] == -1) and np.all(routes[:-1] >= 0)  # the last token: never fed
    model = create_model(MOE, seed=0)
    tokens = jnp.asarray([PROMPT + gen[:-1]], jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    _, own = model.hidden_states(tokens, positions, return_routes=True)
    own = np.sort(np.asarray(own[0]), axis=-1)  # [T, L, K]
    ours = np.sort(np.concatenate([prompt_routes, routes[:-1]]), axis=-1)
    np.testing.assert_array_equal(ours, own)


def test_client_attaches_the_routes_to_the_sample():
    client = SGLangClient("http://127.0.0.1:1", record_routes=SHAPE)
    s = client._to_sample(RESPONSE, "r0", (), len(PROMPT))
    assert s.tokens == RESPONSE["output_ids"]
    assert s.routes.shape == (6, 2, 2) and s.prompt_routes.shape == (5, 2, 2)
    assert np.all(s.routes[-1] == -1)
    # a stop the client enforces (ignore_eos) cuts the routes with the tokens
    stopping = SGLangClient("http://127.0.0.1:1", record_routes=SHAPE, ignore_eos=True)
    cut = stopping._to_sample(RESPONSE, "r1", (489,), len(PROMPT))
    assert cut.tokens == [119, 792, 489] and cut.routes.shape == (3, 2, 2)
    assert np.all(cut.routes >= 0)  # the stop token was fed back: its row is known
    np.testing.assert_array_equal(cut.routes, s.routes[:3])
    plain = SGLangClient("http://127.0.0.1:1")._to_sample(RESPONSE, "r2", (), len(PROMPT))
    assert plain.routes is None and plain.prompt_routes is None


def test_bad_routes_are_clear_errors():
    meta = dict(RESPONSE["meta_info"])
    client = SGLangClient("http://127.0.0.1:1", record_routes=SHAPE)
    with pytest.raises(SGLangRequestError, match="enable-return-routed-experts"):
        client._to_sample({**RESPONSE, "meta_info": {**meta, "routed_experts": None}}, "r", (), 5)
    with pytest.raises(RoutesFormatError, match="expected rows x layers x k"):
        routes_from_meta(meta, 4, 6, *SHAPE)  # one prompt token fewer than the server ran
    with pytest.raises(RoutesFormatError, match="not base64"):
        routes_from_meta({"routed_experts": "not base64!"}, 5, 6, *SHAPE)
    big = base64.b64encode(np.full(40, 9, "<i4").tobytes()).decode()
    with pytest.raises(RoutesFormatError, match=r"outside \[0, 8\)"):
        routes_from_meta({"routed_experts": big}, 5, 6, *SHAPE)
    with pytest.raises(ValueError, match="record_routes"):
        SGLangClient("http://127.0.0.1:1", record_routes=(2, 2))
    # a plain list (the field decoded by the caller) is taken too
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").tolist()
    a = routes_from_meta(meta, 5, 6, *SHAPE)
    b = routes_from_meta({"routed_experts": flat}, 5, 6, *SHAPE)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_episode_leaves_an_unfed_tokens_routes_unknown():
    """A row of -1 (an SGLang sample's last token) is no recorded route: None in the
    episode, so the next call's prefill routes can fill it in."""
    from gagar_jax.rollout.episode import _sample_routes

    s = SGLangClient("http://127.0.0.1:1", record_routes=SHAPE)._to_sample(RESPONSE, "r", (), 5)
    rows = _sample_routes(s)
    assert rows[-1] is None and all(r is not None for r in rows[:-1])
