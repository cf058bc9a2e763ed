"""The embedded JAX sampler: logprob equality with the training forward, determinism, stop tokens,
bucketing without recompiles, truncation, weight sync."""

import asyncio
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.models import Transformer, TransformerConfig, create_model, save_hf_safetensors
from gagar_jax.rollout import CodeAgentEnv, SamplingParams, run_episodes
from gagar_jax.rollout.sampler import (
    Sampler,
    _argmax,
    _segment_ends,
    inverse_cdf_draw,
    sample_token,
    score_tokens,
)
from tests.update_fixtures import tiny_config

CONFIG = tiny_config(initializer_range=0.3)  # peaked logits: samples differ by temperature
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [3] * 12]


def make_model(seed):
    return create_model(CONFIG, seed=seed)


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, batch_buckets=(4, 8), prompt_buckets=(16, 32), new_token_buckets=(16, 32))


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    return model(ids, pos, attention_mask=mask)[0]


def forward_logits(model, tokens, pad_to=64):
    """Training-forward logits [len(tokens), V] (right-padded to one shape: one compile)."""
    ids = np.zeros((1, pad_to), np.int32)
    ids[0, : len(tokens)] = tokens
    mask = np.arange(pad_to)[None] < len(tokens)
    return np.asarray(_logits(*nnx.split(model), ids, mask))[: len(tokens)]


def test_awaitable_generate_samples_what_generate_samples(sampler):
    """Both entry points of the engine protocol draw the same samples for the same params."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5)
    want = sampler.generate(PROMPTS, params)
    got = asyncio.run(sampler.agenerate(PROMPTS, params))
    assert [[(s.tokens, s.finish_reason) for s in r] for r in got] == [
        [(s.tokens, s.finish_reason) for s in r] for r in want
    ]
    for r_got, r_want in zip(got, want):
        for a, b in zip(r_got, r_want):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 10, 0.9), (1.3, 0, 1.0)])
def test_logprobs_equal_training_forward(model, sampler, temperature, top_k, top_p):
    params = SamplingParams(
        n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, seed=3
    )
    out = sampler.generate(PROMPTS, params)
    assert [len(row) for row in out] == [2, 2, 2]
    for prompt, row in zip(PROMPTS, out):
        for s in row:
            assert len(s.tokens) == 12 and s.finish_reason == "length"
            ref = score_tokens(model, prompt + s.tokens, len(prompt), temperature)
            np.testing.assert_allclose(s.logprobs, ref, rtol=0, atol=1e-5)
            if temperature == 0.0:  # greedy: every token is the forward pass's argmax
                logits = forward_logits(model, prompt + s.tokens)
                assert s.tokens == list(np.argmax(logits[len(prompt) - 1 : -1], axis=-1))


def test_deterministic_under_seed_and_independent_of_batch_bucket(sampler):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=42)
    a = sampler.generate(PROMPTS, params)
    b = sampler.generate(PROMPTS, params)
    assert [[s.tokens for s in r] for r in a] == [[s.tokens for s in r] for r in b]
    # More prompts (a larger batch bucket, 8 rows): the first prompts' samples are unchanged.
    c = sampler.generate(PROMPTS + [[1, 2]], params)
    assert [[s.tokens for s in r] for r in c[:3]] == [[s.tokens for s in r] for r in a]
    d = sampler.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=43))
    assert [[s.tokens for s in r] for r in d] != [[s.tokens for s in r] for r in a]
    # The two samples of one prompt differ (independent keys per row).
    assert a[0][0].tokens != a[0][1].tokens
    # No seed: successive calls differ.
    e1 = sampler.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=10))
    e2 = sampler.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=10))
    assert e1[0][0].tokens != e2[0][0].tokens


def test_stop_tokens_and_max_tokens(sampler):
    greedy = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    toks = greedy[1][0].tokens
    # Pick a stop token whose first occurrence in row 1 is at index >= 2.
    k = next(i for i in range(2, 16) if toks[i] not in toks[:i])
    stop = toks[k]
    out = sampler.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop, 96))
    )
    s = out[1][0]
    assert s.tokens == toks[: k + 1] and s.finish_reason == "stop"
    assert s.logprobs == pytest.approx(greedy[1][0].logprobs[: k + 1], abs=1e-6)
    for g, o in zip(greedy, out):  # every row stops right after its own first stop token
        full = g[0].tokens
        cut = next((i + 1 for i, t in enumerate(full) if t in (stop, 96)), len(full))
        assert o[0].tokens == full[:cut]
        assert o[0].finish_reason == (
            "stop" if cut < len(full) or full[-1] in (stop, 96) else "length"
        )
    short = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))
    assert all(
        r[0].tokens == g[0].tokens[:5] and r[0].finish_reason == "length"
        for r, g in zip(short, greedy)
    )


def test_top_k_and_top_p_truncate(model, sampler):
    prompt = PROMPTS[1]
    one = sampler.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=8, seed=1)
    )
    tiny_p = sampler.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, top_p=1e-6, max_tokens=8, seed=1)
    )
    greedy = sampler.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    for s in one[0] + tiny_p[0]:
        assert s.tokens == greedy[0][0].tokens
    k = 3
    out = sampler.generate(
        [prompt], SamplingParams(n=4, temperature=2.0, top_k=k, max_tokens=12, seed=5)
    )
    for s in out[0]:
        logits = forward_logits(model, prompt + s.tokens)[len(prompt) - 1 : -1]
        ranks = [(row > row[t]).sum() for row, t in zip(logits, s.tokens)]
        assert max(ranks) < k
    # top-p = 0.5: every drawn token lies in the smallest set holding >= half of the mass.
    out = sampler.generate(
        [prompt], SamplingParams(n=4, temperature=1.0, top_p=0.5, max_tokens=12, seed=6)
    )
    for s in out[0]:
        logits = forward_logits(model, prompt + s.tokens)[len(prompt) - 1 : -1]
        for row, t in zip(logits, s.tokens):
            p = np.exp(row - row.max())
            p /= p.sum()
            before = p[p > p[t]].sum()
            assert before < 0.5 + 1e-6


def test_no_recompile_within_a_bucket(model):
    # pad_id is part of the program key: pad_id=1 gives this test programs no other test compiled.
    # Each prompt's samples on its own copy of its cache: the program depends on the buckets
    # only (with shared_prefix, the samples per prompt are part of it too; see below).
    s = Sampler(
        model,
        pad_id=1,
        batch_buckets=(4, 8),
        prompt_buckets=(16, 32),
        new_token_buckets=(16, 32),
        shared_prefix=False,
    )
    calls = [
        ([[1, 2, 3]], SamplingParams(max_tokens=4)),
        ([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(n=2, max_tokens=16, temperature=0.5)),
        (PROMPTS, SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(4, 5, 6))),
        (PROMPTS[:2], SamplingParams(n=2, top_k=5, top_p=0.8, seed=9, max_tokens=11)),
    ]
    for prompts, params in calls:  # (B<=4, P<=16, N<=16): one executable
        s.generate(prompts, params)
    assert s.trace_count == 1
    s.generate(PROMPTS, SamplingParams(n=2, max_tokens=7))  # 6 rows -> batch bucket 8
    assert s.trace_count == 2
    s.generate(PROMPTS, SamplingParams(n=2, max_tokens=3))
    assert s.trace_count == 2
    s.generate([[1] * 20], SamplingParams(max_tokens=20))  # P 32, N 32
    assert s.trace_count == 3


def test_shared_prefix_programs_per_bucket_and_samples_per_prompt(model):
    """With ``shared_prefix`` (the default) a call's program is keyed by its buckets and, when
    its prompts' samples share their prompt's cache, by the samples per prompt: other
    sampling knobs, prompts and prompt counts within the buckets reuse it."""
    s = Sampler(
        model, pad_id=2, batch_buckets=(4, 8), prompt_buckets=(16,), new_token_buckets=(16,)
    )
    s.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=5, temperature=0.5))
    assert s.trace_count == 1
    s.generate(PROMPTS[1:3], SamplingParams(n=2, max_tokens=9, top_k=3, seed=4))
    s.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=16, temperature=0.0))  # 2 rows: 4
    assert s.trace_count == 1
    s.generate(PROMPTS[:1], SamplingParams(n=4, max_tokens=5))  # 4 samples per prompt
    assert s.trace_count == 2
    s.generate(PROMPTS[:1], SamplingParams(n=1, max_tokens=5))  # no samples to share with
    assert s.trace_count == 3


def test_sync_weights_changes_outputs_without_retrace(model, tmp_path):
    s = Sampler(model, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(16,))
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    before = s.generate(PROMPTS, greedy)
    traces = s.trace_count
    other = make_model(1)
    assert s.sync_weights(other, version=7) == 7
    after = s.generate(PROMPTS, greedy)
    assert [r[0].tokens for r in after] != [r[0].tokens for r in before]
    assert all(r[0].policy_version == 7 for r in after)
    ref = score_tokens(other, PROMPTS[0] + after[0][0].tokens, len(PROMPTS[0]), 0.0)
    np.testing.assert_allclose(after[0][0].logprobs, ref, atol=1e-5)
    # The trainer's pure params dict and an exported safetensors directory work the same way.
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert s.sync_weights(params, version=8) == 8
    assert [r[0].tokens for r in s.generate(PROMPTS, greedy)] == [r[0].tokens for r in before]
    s.sync_weights(save_hf_safetensors(other, CONFIG, str(tmp_path / "ckpt")), version=9)
    assert [r[0].tokens for r in s.generate(PROMPTS, greedy)] == [r[0].tokens for r in after]
    assert s.trace_count == traces <= 1  # new weights never retrace
    wrong = Transformer(
        TransformerConfig(
            vocab_size=97,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=64,
        ),
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="sync_weights"):
        s.sync_weights(wrong, version=10)
    with pytest.raises(TypeError, match="sync_weights takes"):
        s.sync_weights(3.0, version=10)
    assert s.policy_version == 9


class AsciiTokenizer:
    """id 0 = pad, ids 1..95 = printable ASCII, 96 = newline (the 97-token test vocabulary)."""

    def encode(self, text):
        return [96 if c == "\n" else ord(c) - 31 for c in text if c == "\n" or 32 <= ord(c) < 127]

    def decode(self, ids):
        return "".join("\n" if i == 96 else chr(i + 31) for i in ids if 0 < i < 97)


def test_multi_turn_episode_with_the_sampler(model):
    """A random policy in a real code-agent env: its turns are invalid actions, answered by error
    observations. Masks cover exactly the model's tokens, and every model token's logprob equals
    the training forward's on the whole episode (observations included in the context)."""
    tok = AsciiTokenizer()
    s = Sampler(model, batch_buckets=(2,), prompt_buckets=(64, 128, 256), new_token_buckets=(8,))
    envs = [CodeAgentEnv({"a.py": "x = 1\n"}, lambda files: (False, "no tests")) for _ in range(2)]
    prompts = [tok.encode("Fix a.py.\n"), tok.encode("Make a.py pass.\n")]
    eps = run_episodes(
        s,
        tok,
        envs,
        prompts,
        SamplingParams(temperature=1.0, max_tokens=8, seed=0),
        max_turns=3,
        max_total_tokens=256,
        max_observation_tokens=24,
    )
    for ep in eps:
        assert ep.finish_reason == "max_turns" and len(ep.turns) == 3
        assert ep.num_model_tokens == 24
        lp = score_tokens(model, ep.tokens, 1, temperature=1.0)  # logprob of tokens[1:]
        for turn in ep.turns:
            a, b = turn.model_span
            np.testing.assert_allclose(ep.logprobs[a:b], lp[a - 1 : b - 1], atol=1e-5)
            assert ep.response_mask[a:b] == [1] * (b - a)
            oa, ob = turn.observation_span
            assert ob - oa == 24 and ep.response_mask[oa:ob] == [0] * 24


def test_agenerate_and_input_errors(sampler):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    got = asyncio.run(sampler.agenerate(PROMPTS[:1], params))
    assert got[0][0].tokens == sampler.generate(PROMPTS[:1], params)[0][0].tokens
    with pytest.raises(ValueError, match=r"prompts\[1\].*outside"):
        sampler.generate([[1], [200]], params)
    with pytest.raises(ValueError, match=r"prompts\[0\] must be a non-empty"):
        sampler.generate([[]], params)
    with pytest.raises(ValueError, match="max_tokens=64 exceeds the largest bucket 32"):
        sampler.generate([[1]], SamplingParams(max_tokens=64))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="stop_token_ids outside"):
        sampler.generate([[1]], SamplingParams(stop_token_ids=(500,)))
    assert jax.tree.leaves(sampler.state)  # parameters are held as arrays


def test_shared_prefill_duplicate_prompts_and_exact_logprobs(model):
    """n samples of a prompt, and repeated prompts, share one prefilled cache: the prompt
    batch is the distinct prompts (bucket 4 here, 10 sample rows in bucket 16), and every
    sample's logprobs still equal the training forward's."""
    s = Sampler(model, batch_buckets=(4, 16), prompt_buckets=(16,), new_token_buckets=(8,))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    out = s.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=11))
    assert s.stats["prefill_tokens"] == sum(len(p) for p in PROMPTS)  # distinct prompts only
    for prompt, row in zip(prompts, out):
        for smp in row:
            ref = score_tokens(model, prompt + smp.tokens, len(prompt), 1.0)
            np.testing.assert_allclose(smp.logprobs, ref, rtol=0, atol=1e-5)
    # Rows r = i * n + j keep their own keys: a repeated prompt gets other samples.
    assert out[0][0].tokens != out[2][0].tokens


def test_sync_of_trainer_params_compiles_nothing_new(model):
    """The trainer's params (a pure dict, as `rl.policy.local_params` hands them over) replace
    the weights without a new executable: the sampler's weights are committed to their device
    from the start, like the synced ones (a program compiled for uncommitted weights compiled
    again after the first sync). A dict that does not cover the model is refused."""
    from gagar_jax.models import stack_layer_params
    from gagar_jax.rollout.sampler import _generate_program

    s = Sampler(model, pad_id=3, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(8,))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    s.generate(PROMPTS, greedy)
    programs = _generate_program._cache_size()
    other = make_model(1)
    params = jax.device_put(nnx.to_pure_dict(nnx.state(other, nnx.Param)), jax.devices()[0])
    s.sync_weights(params, version=2)
    got = s.generate(PROMPTS, greedy)
    assert _generate_program._cache_size() == programs
    ref = Sampler(other, pad_id=3, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(8,))
    assert [r[0].tokens for r in got] == [r[0].tokens for r in ref.generate(PROMPTS, greedy)]
    s.sync_weights(stack_layer_params(params), version=3)  # the scan layout converts
    assert [r[0].tokens for r in s.generate(PROMPTS, greedy)] == [r[0].tokens for r in got]
    broken = dict(params)
    del broken["norm"]
    with pytest.raises(ValueError, match="missing"):
        s.sync_weights(broken, version=4)
    assert s.policy_version == 3


def test_prefill_bucket_independent_of_sample_rows(model):
    """A batch bucket sized for the sample rows (3 prompts x 16 samples in a 64-row bucket) does
    not pad the shared prefill to 64 rows: copying the prompts' caches to their samples, the
    distinct prompts take the smallest prefill bucket (8); sharing them (``shared_prefix``),
    the prefill takes the bucket's rows over the samples per prompt (4). The samples equal
    those of samplers whose batch buckets hold 3 rows, either way."""
    from gagar_jax.rollout.sampler import prefill_buckets

    assert prefill_buckets((128,)) == (8, 16, 32, 64, 128)
    assert prefill_buckets((4, 8)) == (4, 8)
    assert prefill_buckets((12, 96), multiple=12) == (12, 24, 36, 72, 96)
    params = SamplingParams(n=16, temperature=1.0, max_tokens=8, seed=3)
    kw = dict(prompt_buckets=(16,), new_token_buckets=(8,))
    ref = Sampler(model, batch_buckets=(3, 64), shared_prefix=False, **kw)
    want = ref.generate(PROMPTS[:3], params)
    assert want[0][0].meta["prefill_rows"] == 3
    for shared, rows in ((False, 8), (True, 4)):
        wide = Sampler(model, batch_buckets=(64,), shared_prefix=shared, **kw)
        out = wide.generate(PROMPTS[:3], params)
        assert out[0][0].meta["prefill_rows"] == rows and out[0][0].meta["bucket"][0] == 64
        for got_row, want_row in zip(out, want):
            for got, exp in zip(got_row, want_row):
                assert got.tokens == exp.tokens
                np.testing.assert_allclose(got.logprobs, exp.logprobs, rtol=0, atol=1e-5)


def test_multi_turn_prefix_cache_exact_and_reused(model):
    """prefix_cache: turns 2 and 3 prefill only the observation (the history comes from the
    kept cache), the sampled tokens equal the full-prefill sampler's (same seed), and every
    model token's logprob equals the training forward's on the whole episode."""
    tok = AsciiTokenizer()

    def run(prefix_cache):
        s = Sampler(
            model,
            batch_buckets=(2,),
            prompt_buckets=(32, 64, 128),
            new_token_buckets=(8,),
            prefix_cache=prefix_cache,
        )
        envs = [CodeAgentEnv({"a.py": "x = 1\n"}, lambda f: (False, "no")) for _ in range(2)]
        prompts = [tok.encode("Fix a.py.\n"), tok.encode("Make a.py pass, please.\n")]
        eps = run_episodes(
            s,
            tok,
            envs,
            prompts,
            SamplingParams(temperature=1.0, max_tokens=8, seed=0, stop_token_ids=(96,)),
            max_turns=3,
            max_total_tokens=128,
            max_observation_tokens=12,
        )
        return s, eps

    cached, eps = run(1)
    full, eps_full = run(0)
    assert cached.stats["calls_reusing_cache"] == 2 and full.stats["calls_reusing_cache"] == 0
    assert cached.stats["reused_tokens"] > 0
    assert cached.stats["prefill_tokens"] < full.stats["prefill_tokens"]
    for ep, ep_full in zip(eps, eps_full):
        assert ep.tokens == ep_full.tokens and len(ep.turns) == 3
        np.testing.assert_allclose(ep.logprobs, ep_full.logprobs, atol=1e-5)
        lp = score_tokens(model, ep.tokens, 1, temperature=1.0)
        for turn in ep.turns:
            a, b = turn.model_span
            # Cached-prefix decoding and one whole-episode forward are different float32 programs:
            # equal within a few float32 roundings of the value (|logprob| up to about 8).
            np.testing.assert_allclose(ep.logprobs[a:b], lp[a - 1 : b - 1], rtol=5e-6, atol=1e-5)
    # New weights drop the kept caches (they belong to the old policy).
    cached.sync_weights(model, version=1)
    assert cached._kept == []


def test_remat_model_samples_like_the_plain_model():
    """``remat=True`` (the pod configs' setting, for the update's backward pass) changes nothing
    when sampling: same tokens and log-probs as the plain model (it used to fail in the decode
    loop with flax's TraceContextError)."""
    kw = dict(
        vocab_size=32,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
    )
    out = []
    for remat in (False, True):
        sampler = Sampler(
            Transformer(TransformerConfig(remat=remat, **kw), rngs=nnx.Rngs(0)), seed=0
        )
        rows = sampler.generate(
            [[1, 2, 3], [4, 5]], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1)
        )
        out.append([s for row in rows for s in row])
    assert [s.tokens for s in out[0]] == [s.tokens for s in out[1]]
    np.testing.assert_allclose(
        [x for s in out[0] for x in s.logprobs], [x for s in out[1] for x in s.logprobs], atol=1e-6
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([-np.inf, -2.0, 0.0, 0.5, 1.0, 3.0]), min_size=5, max_size=5),
        min_size=1,
        max_size=4,
    )
)
def test_argmax_is_jnp_argmax_with_ties_and_inf(rows):
    """The sampler's two-reduction argmax picks the first maximum, as ``jnp.argmax`` does."""
    x = jnp.asarray(np.array(rows, np.float32))
    np.testing.assert_array_equal(np.asarray(_argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))


def _np_inverse_cdf(x, u):
    """float64 reference: the first token whose cumulative softmax probability exceeds u."""
    x = np.asarray(x, np.float64)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    cum = np.cumsum(p / p.sum(axis=-1, keepdims=True), axis=-1)
    return np.array([int(np.searchsorted(c, v, side="right")) for c, v in zip(cum, u)])


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_tokens_are_the_inverse_cdf_draws(seed):
    """Untruncated sampling (top-k/top-p off) draws, in each row, the token where the row key's
    uniform number falls in the softmax's cumulative distribution (float64 reference), and its
    log-probs are the full log-softmax's. 257 tokens: the last block holds one."""
    x = 3.0 * jax.random.normal(jax.random.key(seed), (32, 257))
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed + 7), r))(jnp.arange(32))
    t = jnp.float32(0.7)
    tok, lp = sample_token(x, keys, t, jnp.float32(1.0), jnp.int32(0))
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys))
    ref = _np_inverse_cdf(np.asarray(x / t), u)
    np.testing.assert_array_equal(np.asarray(tok), ref)
    logp = np.asarray(jax.nn.log_softmax(x / t, axis=-1))
    np.testing.assert_allclose(np.asarray(lp), logp[np.arange(32), ref], rtol=1e-6)


def test_sampled_token_frequencies_are_the_softmax():
    """200,000 draws from one truncated row (1,000 tokens, a third excluded): every token's
    frequency within 5 standard errors of its softmax probability (plus 1e-4), no excluded
    token ever drawn, and the draws' mean log-probability the distribution's."""
    rng = np.random.default_rng(0)
    row = rng.normal(0, 2.0, 1000).astype(np.float32)
    row[rng.choice(1000, 333, replace=False)] = -np.inf
    row[int(np.argmax(row))] += 1.0
    n, reps = 20_000, 10
    x = jnp.broadcast_to(jnp.asarray(row), (n, 1000))
    top = jnp.max(x, axis=-1, keepdims=True)
    counts = np.zeros(1000)
    for r in range(reps):
        u = jax.random.uniform(jax.random.key(r), (n,), jnp.float32)
        counts += np.bincount(np.asarray(inverse_cdf_draw(x, top, u)), minlength=1000)
    p = np.exp(row.astype(np.float64) - row.max())
    p /= p.sum()
    freq = counts / (n * reps)
    assert counts[~np.isfinite(row)].sum() == 0
    se = np.sqrt(p * (1 - p) / (n * reps))
    assert np.all(np.abs(freq - p) <= 5 * se + 1e-4), np.max(np.abs(freq - p) / (se + 1e-12))


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 200),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.5, float(np.nextafter(np.float32(1), np.float32(0)))]),
)
def test_inverse_cdf_draw_edges(vocab, seed, u_edge):
    """Any vocabulary size (a partial last block), rows with one allowed token, huge logit gaps,
    and uniforms at 0 and at the largest float32 below 1: the draw is always a token of
    positive weight, the first one at u = 0 and, in the rows of equal weights, the last one at
    u -> 1; and always a token whose interval of the float64 cumulative distribution holds u,
    up to float32 rounding."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, rng.choice([0.1, 3.0, 30.0]), (4, vocab)).astype(np.float32)
    x[rng.random((4, vocab)) < 0.5] = -np.inf
    x[1, :] = -np.inf
    x[1, rng.integers(vocab)] = 0.0  # one allowed token
    for r in (0, 2, 3):  # a finite maximum in every row
        finite = x[r][np.isfinite(x[r])]
        x[r, rng.integers(vocab)] = (finite.max() if finite.size else 0.0) + 1e-3
    x[0, :] = np.where(np.isfinite(x[0]), 0.0, -np.inf)  # uniform over the allowed ones
    xj = jnp.asarray(x)
    u = np.full(4, u_edge, np.float32)
    tok = np.asarray(inverse_cdf_draw(xj, jnp.max(xj, axis=-1, keepdims=True), jnp.asarray(u)))
    # Drawable: a positive float32 weight exp(x - max) as XLA computes it (an allowed token
    # ~87 or more below the maximum has a subnormal or zero weight, which XLA flushes to 0).
    drawable = np.asarray(jnp.exp(xj - jnp.max(xj, axis=-1, keepdims=True))) > 0
    assert drawable[np.arange(4), tok].all()
    ids = [np.flatnonzero(a) for a in drawable]
    if u_edge == 0.0:
        assert [t == i[0] for t, i in zip(tok, ids)] == [True] * 4
    if u_edge > 0.9:
        assert tok[0] == ids[0][-1] and tok[1] == ids[1][-1]
    # The drawn token's interval of the float64 CDF holds u, up to float32 rounding of the
    # cumulative sums (near u = 1 the tail tokens' intervals are all within an ulp of 1).
    p = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    cum = np.cumsum(p / p.sum(axis=-1, keepdims=True), axis=-1)
    for row, t in enumerate(tok):
        lo = cum[row, t - 1] if t else 0.0
        assert lo - 1e-5 <= u[row] <= cum[row, t] + 1e-5, (row, t, lo, cum[row, t], u[row])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 16))
def test_segment_ends_cover_the_budget(n, segments):
    """The decode loop's segments: increasing ends that stop at the budget, at most
    ``segments`` of them, every one but the last a multiple of 8 and at least 16 tokens."""
    ends = _segment_ends(n, segments)
    assert ends[-1] == n and 1 <= len(ends) <= segments
    assert all(a < b for a, b in zip(ends, ends[1:]))
    assert all(e % 8 == 0 and e - s >= 16 for s, e in zip([0] + ends, ends[:-1]))


@pytest.mark.parametrize("max_tokens", [40, 13, 16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_segments_sample_what_one_loop_samples(model, max_tokens, temperature):
    """A decode loop split into segments (caches growing between them: ends 16, 32, 40 for a
    budget of 40) and the single loop over the whole budget draw the same tokens, stop at the
    same stop token, and agree on every log-prob, which still equals the training forward's.
    ``max_tokens`` ends inside a segment (13), on a segment end (16), and at the budget (40);
    the kept multi-turn cache is the same one."""
    assert _segment_ends(40, 3) == [16, 32, 40]
    prompts = PROMPTS + [[9, 8, 7, 6]]
    outs, kept = [], []
    stop = None
    for segments in (1, 3):
        s = Sampler(
            model,
            batch_buckets=(8,),
            prompt_buckets=(16,),
            new_token_buckets=(40,),
            decode_segments=segments,
            prefix_cache=1,
        )
        if stop is None:  # a stop token that row 0 first draws after the first segment end
            free_params = SamplingParams(temperature=temperature, max_tokens=40, seed=5)
            toks = s.generate(prompts, free_params)[0][0].tokens
            at = next(i for i, t in enumerate(toks) if i >= 17 and t not in toks[:i])
            stop = toks[at]
        params = SamplingParams(
            n=2, temperature=temperature, max_tokens=max_tokens, seed=5, stop_token_ids=(stop,)
        )
        outs.append([smp for row in s.generate(prompts, params) for smp in row])
        kept.append(s._kept[0]["cache"])
    one, seg = outs
    if at < max_tokens:  # row 0 stops in the second segment or later
        assert one[0].finish_reason == "stop" and len(one[0].tokens) == at + 1
    assert [smp.tokens for smp in seg] == [smp.tokens for smp in one]
    assert [smp.finish_reason for smp in seg] == [smp.finish_reason for smp in one]
    np.testing.assert_allclose(
        [x for smp in seg for x in smp.logprobs],
        [x for smp in one for x in smp.logprobs],
        rtol=0,
        atol=1e-5,
    )
    for i, prompt in enumerate(prompts):
        for smp in seg[2 * i : 2 * i + 2]:
            ref = score_tokens(model, prompt + smp.tokens, len(prompt), temperature)
            np.testing.assert_allclose(smp.logprobs, ref, rtol=0, atol=1e-5)
    a, b = kept[1], kept[0]
    assert a.mask.shape == b.mask.shape
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    valid = np.asarray(b.mask)
    for x, y in zip(a.k, b.k):  # [B, KV, D, S]: compare the valid slots only
        np.testing.assert_allclose(
            np.asarray(x).transpose(0, 3, 1, 2)[valid],
            np.asarray(y).transpose(0, 3, 1, 2)[valid],
            atol=1e-5,
        )


def test_decode_segments_must_be_a_positive_int(model):
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="decode_segments"):
            Sampler(model, decode_segments=bad)


def _data_mesh(size):
    return jax.sharding.Mesh(np.array(jax.devices()[:size]), ("data",))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_data_parallel_sampler_samples_what_one_device_samples(model, temperature):
    """Rows split over a 4-device data axis: the prefill is partitioned (samples copy their
    prompt's cache across shards: prompt 0's rows sit on shards 0 and 2), each shard runs its
    own decode loop and stops when its rows are done, and a second turn continues the kept,
    sharded cache. Tokens, finish reasons and the kept cache are those of the one-device
    sampler, log-probs agree and equal the training forward's, and nothing retraces in a bucket."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], [9, 8, 7, 6], PROMPTS[1]]
    # A stop token some rows draw early: shards finish at different steps.
    free = Sampler(model, batch_buckets=(16,), prompt_buckets=(16,), new_token_buckets=(16,))
    params = SamplingParams(n=2, temperature=temperature, max_tokens=16, seed=3)
    stop = free.generate(prompts, params)[1][0].tokens[2]
    params = dataclasses.replace(params, stop_token_ids=(stop,))
    runs = []
    for mesh in (None, _data_mesh(4)):
        s = Sampler(
            model,
            batch_buckets=(8, 16),
            prompt_buckets=(16, 32, 64),
            new_token_buckets=(16,),
            mesh=mesh,
            prefix_cache=1,
        )
        first = s.generate(prompts, params)
        kept = s._kept[0]["cache"]
        # Turn 2: every row's prompt + sample + an observation, from the kept cache.
        nexts = [prompts[i] + first[i][0].tokens + [40, 41, 42] for i in range(len(prompts))]
        second = s.generate(nexts, params)
        traces = s.trace_count
        s.generate(prompts, dataclasses.replace(params, seed=4))
        assert s.trace_count == traces  # the first call's bucket, other seed: no retrace
        runs.append((s, first, second, kept))
    (one, first1, second1, kept1), (dp, first4, second4, kept4) = runs
    assert dp.stats == one.stats and dp.stats["calls_reusing_cache"] == 1
    for x in jax.tree.leaves(dp.state):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 4
    assert any(smp.finish_reason == "stop" for row in first1 for smp in row)
    assert any(smp.finish_reason == "length" for row in first1 for smp in row)
    for a, b, call_prompts in ((first1, first4, prompts), (second1, second4, nexts)):
        flat_a = [smp for row in a for smp in row]
        flat_b = [smp for row in b for smp in row]
        assert [s.tokens for s in flat_b] == [s.tokens for s in flat_a]
        assert [s.finish_reason for s in flat_b] == [s.finish_reason for s in flat_a]
        # Shards run smaller batches, whose float32 sums XLA may block differently: agreement to
        # float32 rounding over two layers (1.1e-5 at a log-prob of -3.0 on one CPU model).
        np.testing.assert_allclose(
            [x for s in flat_b for x in s.logprobs],
            [x for s in flat_a for x in s.logprobs],
            rtol=5e-6,
            atol=1e-5,
        )
        for prompt, row in zip(call_prompts, b):
            for smp in row:
                ref = score_tokens(model, prompt + smp.tokens, len(prompt), temperature)
                np.testing.assert_allclose(smp.logprobs, ref, rtol=0, atol=1e-5)
    assert len(kept4.mask.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(kept4.mask), np.asarray(kept1.mask))
    assert int(kept4.index) == int(kept1.index)
    valid = np.asarray(kept1.mask)
    for x, y in zip(kept4.v, kept1.v):  # [B, KV, S, D]: the valid slots
        np.testing.assert_allclose(
            np.asarray(x).transpose(0, 2, 1, 3)[valid],
            np.asarray(y).transpose(0, 2, 1, 3)[valid],
            atol=1e-5,
        )


@pytest.mark.parametrize(
    "scan,n,repeat", [(False, 4, False), (True, 4, False), (False, 3, False), (False, 4, True)]
)
def test_shared_prefix_decode_samples_what_copies_sample(scan, n, repeat):
    """``shared_prefix``: a prompt's samples decode against its one cache (the prefill takes
    the bucket's rows over the samples per prompt, rounded up: with 3 samples per prompt the
    16-row bucket decodes 6 groups, 8 on four devices) and keep only their own tokens' keys
    and values. Tokens, finish reasons and the next turn's continuation from the kept cache
    are those of the sampler that copies the prompt's cache to every sample, on one device
    and with the rows split over two and four devices (each shard holding its rows'
    prompts); log-probs agree and equal the training forward's. A call that repeats a
    prompt prefills it once and decodes each repeat against a copy of that cache row, with
    samples of its own."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    model = create_model(dataclasses.replace(CONFIG, scan_layers=scan), seed=0)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0] if repeat else PROMPTS[2], [9, 8, 7, 6]]
    kw = dict(batch_buckets=(16,), prompt_buckets=(16, 64), new_token_buckets=(16,))
    free = Sampler(model, shared_prefix=False, **kw)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=16, seed=3)
    stop = free.generate(prompts, params)[1][0].tokens[2]
    params = dataclasses.replace(params, stop_token_ids=(stop,))
    runs = {}
    for name, shared, mesh in (
        ("copies", False, None),
        ("shared", True, None),
        ("shared-2", True, _data_mesh(2)),
        ("shared-4", True, _data_mesh(4)),
    ):
        s = Sampler(model, shared_prefix=shared, mesh=mesh, prefix_cache=1, **kw)
        first = s.generate(prompts, params)
        nexts = [prompts[i] + first[i][1].tokens + [40, 41] for i in range(len(prompts))]
        second = s.generate(nexts, dataclasses.replace(params, max_tokens=8))
        assert s.stats["calls_reusing_cache"] == 1
        runs[name] = (first, second, nexts)
    groups = -(-16 // n)  # the bucket's rows in whole groups: 4, or 6 for n = 3
    if repeat:  # the 3 distinct prompts in the smallest prefill bucket
        assert runs["shared"][0][0][0].meta["prefill_rows"] == 8
        assert runs["shared"][0][0][0].tokens != runs["shared"][0][2][0].tokens
    else:
        assert runs["shared"][0][0][0].meta["prefill_rows"] == groups
        assert runs["shared-4"][0][0][0].meta["prefill_rows"] == -(-groups // 4) * 4
    assert runs["copies"][0][0][0].meta["prefill_rows"] == 8  # the smallest prefill bucket
    want_first, want_second, want_nexts = runs["copies"]
    flat = [smp for call in (want_first, want_second) for row in call for smp in row]
    assert {smp.finish_reason for smp in flat} == {"stop", "length"}
    for name in ("shared", "shared-2", "shared-4"):
        first, second, nexts = runs[name]
        assert nexts == want_nexts
        got = [smp for call in (first, second) for row in call for smp in row]
        assert [x.tokens for x in got] == [x.tokens for x in flat], name
        assert [x.finish_reason for x in got] == [x.finish_reason for x in flat], name
        np.testing.assert_allclose(
            [v for x in got for v in x.logprobs],
            [v for x in flat for v in x.logprobs],
            rtol=5e-6,
            atol=1e-5,
            err_msg=name,
        )
        for call_prompts, call in ((prompts, first), (nexts, second)):
            for prompt, row in zip(call_prompts, call):
                for smp in row:
                    ref = score_tokens(model, prompt + smp.tokens, len(prompt), 1.0)
                    np.testing.assert_allclose(smp.logprobs, ref, rtol=5e-6, atol=1e-5)


def test_shared_prefix_must_be_a_bool(model):
    with pytest.raises(ValueError, match="Sampler.shared_prefix must be a bool"):
        Sampler(model, shared_prefix=1)


def test_data_parallel_sampler_sync_weights_and_buckets(model):
    """sync_weights keeps the weights replicated on the mesh (the programs are reused) and the
    new weights sample what a one-device sampler over them samples; the default batch buckets
    are rounded up to the data axis's multiples; a call of fewer rows than devices still fits."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    dp = Sampler(model, mesh=_data_mesh(4), prompt_buckets=(16,), new_token_buckets=(8,))
    assert dp.batch_buckets == (4, 8, 16, 32, 64, 128, 256)
    three = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("data",))
    assert Sampler(model, mesh=three).batch_buckets == (3, 6, 9, 18, 33, 66, 129, 258)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    dp.generate([PROMPTS[0]], params)  # one row, bucket 4
    traces = dp.trace_count
    new = make_model(1)
    dp.sync_weights(new, version=7)
    out = dp.generate([PROMPTS[0]], params)
    assert dp.trace_count == traces
    for x in jax.tree.leaves(dp.state):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 4
    ref = Sampler(new, prompt_buckets=(16,), new_token_buckets=(8,)).generate([PROMPTS[0]], params)
    assert out[0][0].tokens == ref[0][0].tokens and out[0][0].policy_version == 7
    np.testing.assert_allclose(out[0][0].logprobs, ref[0][0].logprobs, rtol=0, atol=1e-5)


def test_data_parallel_sampler_rejects_what_cannot_work(model):
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = _data_mesh(4)
    with pytest.raises(ValueError, match=r"Sampler.batch_buckets must be multiples .* 4"):
        Sampler(model, mesh=mesh, batch_buckets=(4, 6))
    with pytest.raises(ValueError, match="Sampler.data_axis='rows' is not an axis"):
        Sampler(model, mesh=mesh, data_axis="rows")
    two_d = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="only the data axis"):
        Sampler(model, mesh=two_d)
    with pytest.raises(TypeError, match="Sampler.mesh must be a jax.sharding.Mesh"):
        Sampler(model, mesh=jax.devices()[:4])


def test_decode_loop_evaluates_no_cos_sin(model, monkeypatch):
    """The sampler's compiled decode loops contain no ``cos`` / ``sin``: the RoPE tables of all
    steps are computed before the loops and each step slices its own (in the loop body XLA
    evaluated them again in every layer's query and key-cache-write fusions, per step)."""
    import re

    import gagar_jax.rollout.sampler as sampler_module

    program, seen = sampler_module._generate_program, {}

    def capture(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return program(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "_generate_program", capture)
    Sampler(model, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(32,)).generate(
        PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=32)
    )
    text = program.lower(*seen["args"], **seen["kwargs"]).compile().as_text()
    comps, cur = {}, None
    for line in text.splitlines():
        if line and not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
            cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[cur] = []
        elif cur:
            comps[cur].append(line)

    def reachable(name, out):  # a computation and every computation it calls
        if name not in out:
            out.add(name)
            for line in comps.get(name, []):
                for callee in re.findall(
                    r"(?:calls|body|to_apply|computations)=\{?%([\w.\-]+)", line
                ):
                    reachable(callee, out)
                for callee in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    for c in re.findall(r"%([\w.\-]+)", callee):
                        reachable(c, out)
        return out

    bodies = re.findall(r"body=%([\w.\-]+)", text)
    assert bodies, "no while loop in the compiled sampler"
    inside = set()
    for body in bodies:
        reachable(body, inside)
    trig = [
        c for c in inside if any(op in line for line in comps[c] for op in (" cosine(", " sine("))
    ]
    assert not trig, trig


def test_sync_of_a_pure_dict_places_checks_and_keeps_the_old_state(model):
    """A pure dict of the sampler's own tree swaps its leaves in directly: host (NumPy) leaves
    land committed on the sampler's device, a leaf of the wrong dtype or shape is refused with
    the sampler's weights and version unchanged, and the state handed out before a sync keeps
    the old weights (the sampler never writes into a tree it gave away)."""
    s = Sampler(model, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(8,))
    assert s._pure_in_state_order  # the direct path is the one this model's dicts take
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before_state = s.state
    before = [r[0].tokens for r in s.generate(PROMPTS, greedy)]
    other = make_model(1)
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(other, nnx.Param)))
    assert s.sync_weights(host, version=5) == 5
    device = jax.tree.leaves(before_state)[0].sharding
    assert all(x.sharding == device and x.committed for x in jax.tree.leaves(s.state))
    ref = Sampler(other, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(8,))
    got = [r[0].tokens for r in s.generate(PROMPTS, greedy)]
    assert got == [r[0].tokens for r in ref.generate(PROMPTS, greedy)] != before
    old = nnx.to_pure_dict(before_state)
    np.testing.assert_array_equal(
        old["norm"]["weight"], nnx.to_pure_dict(nnx.state(model, nnx.Param))["norm"]["weight"]
    )
    for bad in (
        jax.tree.map(lambda x: x.astype(np.float16), host),
        {**host, "norm": {"weight": np.zeros(3, np.float32)}},
    ):
        with pytest.raises(ValueError, match="sync_weights: leaf shape/dtype"):
            s.sync_weights(bad, version=6)
    assert s.policy_version == 5
    assert [r[0].tokens for r in s.generate(PROMPTS, greedy)] == got
