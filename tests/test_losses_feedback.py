"""Feedback-span losses (re-weighted SFT, span-level KTO) against plain NumPy references.

Loops are allowed here only. The TRL reference is written from TRL's KTO documentation and
``KTOTrainer.kto_loss``: ``KL = clamp(mean(policy_KL_logps - reference_KL_logps), min=0)``
(detached), ``chosen = 1 - sigmoid(beta (logratio - KL))``, ``rejected = 1 - sigmoid(beta (KL -
logratio))``, ``loss = mean(cat(desirable_weight * chosen, undesirable_weight * rejected))``.
"""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax.losses import (
    aggregate,
    kto_kl_reference_point,
    rw_sft_loss,
    span_kto_loss,
    span_rewards,
)

KW = dict(beta=0.5, lambda_w=1.0, lambda_l=1.3, alpha=0.9, neutral_coef=0.2)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ------------------------------------------------------------------------------------------
# NumPy references
# ------------------------------------------------------------------------------------------
def np_rw_sft(logp, pol, mask, w_pos, w_neu, w_neg):
    num = 0.0
    for idx in np.ndindex(logp.shape):
        if mask[idx]:
            w = w_pos if pol[idx] > 0 else (w_neg if pol[idx] < 0 else w_neu)
            num += w * logp[idx]
    return -num / max(mask.sum(), 1)


def np_span_kto(
    logp,
    ref,
    span_ids,
    span_pol,
    z_ref,
    *,
    beta,
    lambda_w,
    lambda_l,
    alpha,
    neutral_coef,
    reference_point="ema",
    reward_norm="sum",
    ref_count=0.0,
):
    """Returns (loss, new_z, z_used, new_count, d loss / d logp)."""
    n, t = logp.shape
    spans = []  # (row, k, polarity, [token indices])
    for i in range(n):
        for k in range(span_pol.shape[1]):
            toks = [j for j in range(t) if span_ids[i, j] == k]
            if toks:
                spans.append((i, k, int(span_pol[i, k]), toks))
    polar = [s for s in spans if s[2] != 0]
    rewards = {}
    for i, k, _, toks in polar:
        r = sum(logp[i, j] - ref[i, j] for j in toks)
        rewards[(i, k)] = r / len(toks) if reward_norm == "mean_per_token" else r
    count = ref_count
    if polar:
        mean_r = np.mean(list(rewards.values()))
    if reference_point == "cumulative":
        if polar:
            count = ref_count + 1
            z = z_ref + (mean_r - z_ref) / count
        else:
            z = z_ref
        new_z = z
    else:
        z = z_ref
        if reference_point == "ema":
            new_z = alpha * z_ref + (1 - alpha) * mean_r if polar else z_ref
        else:
            new_z = z_ref
    grad = np.zeros_like(logp)
    pref = 0.0
    for i, k, p, toks in polar:
        a = rewards[(i, k)] - z
        scale = 1.0 / len(toks) if reward_norm == "mean_per_token" else 1.0
        if p > 0:
            pref += -lambda_w * _sigmoid(beta * a)
            g = -lambda_w * beta * _sigmoid(beta * a) * (1 - _sigmoid(beta * a))
        else:
            pref += -lambda_l * _sigmoid(-beta * a)
            g = lambda_l * beta * _sigmoid(-beta * a) * (1 - _sigmoid(-beta * a))
        for j in toks:
            grad[i, j] += g * scale / len(polar)
    pref = pref / len(polar) if polar else 0.0
    neutral = [(i, j) for i, _, p, toks in spans if p == 0 for j in toks]
    neu = -sum(logp[i, j] for i, j in neutral) / len(neutral) if neutral else 0.0
    for i, j in neutral:
        grad[i, j] += -neutral_coef / len(neutral)
    return pref + neutral_coef * neu, new_z, z, count, grad


def np_trl_kto(
    policy_logps,
    reference_logps,
    labels,
    policy_kl_logps,
    reference_kl_logps,
    *,
    beta,
    desirable_weight,
    undesirable_weight,
):
    """TRL KTOTrainer.kto_loss (loss_type="kto") on sequence log-probs, mean over the batch."""
    kl = max(np.mean(policy_kl_logps - reference_kl_logps), 0.0)
    logratios = policy_logps - reference_logps
    chosen = [
        desirable_weight * (1 - _sigmoid(beta * (lr - kl))) for lr, y in zip(logratios, labels) if y
    ]
    rejected = [
        undesirable_weight * (1 - _sigmoid(beta * (kl - lr)))
        for lr, y in zip(logratios, labels)
        if not y
    ]
    return np.mean(chosen + rejected)


# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------
def random_spans(rng, n, t, s, prompt_max=3):
    """Contiguous non-overlapping spans after a prompt of 0..prompt_max tokens per row."""
    span_ids = -np.ones((n, t), np.int32)
    span_pol = rng.integers(-1, 2, (n, s)).astype(np.int32)
    for i in range(n):
        pos = int(rng.integers(0, prompt_max + 1))
        k = 0
        while pos < t and k < s:
            length = int(rng.integers(1, 4))
            if rng.random() < 0.25:  # an uncovered gap
                pos += length
                continue
            span_ids[i, pos : pos + length] = k
            pos += length
            k += 1
    return span_ids, span_pol


def _data(seed, n=4, t=12, s=4):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 1.0, (n, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.3, (n, t))).astype(np.float32)
    span_ids, span_pol = random_spans(rng, n, t, s)
    return logp, ref, span_ids, span_pol


@st.composite
def span_batches(draw):
    """Random spans and polarities in a fixed [5, 10] x [5, 4] layout (one compile per mode):
    rows without spans, uncovered gaps, prompts of 0-3 tokens and empty span slots vary."""
    n, t, s = 5, 10, 4
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.02, 1.0, (n, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.5, (n, t))).astype(np.float32)
    span_ids, span_pol = random_spans(rng, n, t, s, prompt_max=draw(st.integers(0, t)))
    empty_rows = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    span_ids[np.asarray(empty_rows)] = -1
    z = np.float32(rng.normal(0, 0.5))
    return logp, ref, span_ids, span_pol, z


_JITTED = {}


def _jitted_kto(**kw):
    """loss, new_z and d loss / d logp, jitted once per keyword set."""
    key = tuple(sorted(kw.items()))
    if key not in _JITTED:

        def fn(a, b, c, d, z):
            (loss, (new_z, m)), g = jax.value_and_grad(
                lambda x: (lambda o: (o[0], (o[1], o[2])))(span_kto_loss(x, b, c, d, z, **kw)),
                has_aux=True,
            )(a)
            return loss, new_z, m, g

        _JITTED[key] = jax.jit(fn)
    return _JITTED[key]


# ------------------------------------------------------------------------------------------
# Re-weighted SFT
# ------------------------------------------------------------------------------------------
class RWSFTTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1.5, 1.0, 0.1), (1.0, 0.5, -0.7), (2.0, 0.0, 0.0))
    def test_matches_numpy(self, w_pos, w_neu, w_neg):
        rng = np.random.default_rng(0)
        logp = np.log(rng.uniform(0.05, 1.0, (3, 9))).astype(np.float32)
        pol = rng.integers(-1, 2, (3, 9)).astype(np.int32)
        mask = rng.random((3, 9)) < 0.7
        fn = self.variant(
            lambda a, b, c: rw_sft_loss(a, b, c, w_pos=w_pos, w_neu=w_neu, w_neg=w_neg)
        )
        loss, m = fn(logp, pol, mask)
        np.testing.assert_allclose(
            loss, np_rw_sft(logp, pol, mask, w_pos, w_neu, w_neg), rtol=1e-5, atol=1e-7
        )
        self.assertEqual(float(m["tokens_neg"]), float((mask & (pol < 0)).sum()))

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_ones_is_plain_cross_entropy_bit_for_bit(self):
        rng = np.random.default_rng(1)
        for shape in ((4, 16), (7, 33), (1, 1)):
            logp = jnp.asarray(np.log(rng.uniform(0.01, 1.0, shape)), jnp.float32)
            pol = jnp.asarray(rng.integers(-1, 2, shape), jnp.int32)
            mask = jnp.asarray(rng.random(shape) < 0.6)
            loss, _ = self.variant(
                lambda a, b, c: rw_sft_loss(a, b, c, w_pos=1.0, w_neu=1.0, w_neg=1.0)
            )(logp, pol, mask)
            ce = self.variant(lambda a, c: aggregate(-a, c, "token-mean"))(logp, mask)
            assert np.asarray(loss).tobytes() == np.asarray(ce).tobytes(), (loss, ce)
            # and the gradient: -1/n on every masked token, exactly
            g = jax.grad(
                lambda a, p=pol, m=mask: rw_sft_loss(a, p, m, w_pos=1.0, w_neu=1.0, w_neg=1.0)[0]
            )(logp)
            g_ce = jax.grad(lambda a, m=mask: aggregate(-a, m, "token-mean"))(logp)
            assert np.asarray(g).tobytes() == np.asarray(g_ce).tobytes()

    def test_float_weights_never_cast(self):
        # One masked token of each polarity: d loss / d logp_t = -w(p_t) / 3 exactly.
        logp = jnp.zeros((1, 3), jnp.float32)
        pol = jnp.asarray([[1, 0, -1]], jnp.int32)
        mask = jnp.ones((1, 3), bool)
        g = jax.grad(lambda a: rw_sft_loss(a, pol, mask, w_pos=0.75, w_neu=0.25, w_neg=-0.5)[0])(
            logp
        )
        np.testing.assert_allclose(g, [[-0.25, -0.25 / 3, 0.5 / 3]], rtol=1e-6)

    def test_masked_tokens_change_nothing(self):
        logp, _, _, _ = _data(2)
        pol = np.sign(np.random.default_rng(2).normal(size=logp.shape)).astype(np.int32)
        mask = np.ones(logp.shape, bool)
        mask[:, :3] = False
        poisoned = logp.copy()
        poisoned[:, :3] = np.nan
        kw = dict(w_pos=1.2, w_neu=1.0, w_neg=-0.3)
        a, _ = rw_sft_loss(jnp.asarray(logp), pol, mask, **kw)
        b, _ = rw_sft_loss(jnp.asarray(poisoned), pol, mask, **kw)
        np.testing.assert_array_equal(a, b)
        # an empty mask contributes 0, not NaN
        z, _ = rw_sft_loss(jnp.asarray(logp), pol, np.zeros_like(mask), **kw)
        self.assertEqual(float(z), 0.0)


# ------------------------------------------------------------------------------------------
# Span-level KTO
# ------------------------------------------------------------------------------------------
def _jax_kto(logp, ref, ids, pol, z, **kw):
    return span_kto_loss(
        jnp.asarray(logp),
        jnp.asarray(ref),
        jnp.asarray(ids),
        jnp.asarray(pol),
        jnp.asarray(z, jnp.float32),
        **kw,
    )


class SpanKTOTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        seed=[0, 1, 2],
        reference_point=["ema", "batch_kl", "cumulative"],
        reward_norm=["sum", "mean_per_token"],
    )
    def test_matches_numpy(self, seed, reference_point, reward_norm):
        logp, ref, ids, pol = _data(seed)
        kw = dict(KW, reference_point=reference_point, reward_norm=reward_norm)
        fn = self.variant(
            lambda a, b, c, d, z, cnt: span_kto_loss(a, b, c, d, z, ref_count=cnt, **kw)
        )
        loss, new_z, m = fn(logp, ref, ids, pol, jnp.float32(0.3), jnp.float32(2.0))
        want, want_z, z_used, count, grad = np_span_kto(
            logp, ref, ids, pol, 0.3, ref_count=2.0, **kw
        )
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new_z, want_z, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m["z_used"], z_used, rtol=1e-5, atol=1e-6)
        self.assertEqual(float(m["ref_count"]), count)
        g = jax.grad(
            lambda a: span_kto_loss(
                a, jnp.asarray(ref), ids, pol, jnp.float32(0.3), ref_count=jnp.float32(2.0), **kw
            )[0]
        )(jnp.asarray(logp))
        np.testing.assert_allclose(g, grad, rtol=1e-4, atol=1e-6)

    def test_hand_worked_ema(self):
        # Row 0: span 0 (+) tokens 1-2 with log-ratios 0.2, 0.3 -> r = 0.5; span 1 (-) token 3
        # with log-ratio -0.4 -> r = -0.4; token 0 (prompt) in no span; token 4 neutral span 2
        # with logp = -2. z_ref = 0.1, beta = 1, lambdas 1, alpha = 0.5, neutral_coef = 0.5:
        #   pref = mean(-sig(0.5 - 0.1), -sig(-(-0.4 - 0.1))) = -(sig(0.4) + sig(0.5)) / 2
        #   neutral = 2.0;  loss = pref + 0.5 * 2.0
        #   new_z = 0.5 * 0.1 + 0.5 * mean(0.5, -0.4) = 0.05 + 0.025 = 0.075
        logp = np.array([[-9.0, -1.0, -1.0, -1.0, -2.0]], np.float32)
        ref = logp - np.array([[0.0, 0.2, 0.3, -0.4, 0.0]], np.float32)
        ids = np.array([[-1, 0, 0, 1, 2]], np.int32)
        pol = np.array([[1, -1, 0]], np.int32)
        loss, new_z, m = _jax_kto(
            logp,
            ref,
            ids,
            pol,
            0.1,
            beta=1.0,
            lambda_w=1.0,
            lambda_l=1.0,
            alpha=0.5,
            neutral_coef=0.5,
        )
        want = -(_sigmoid(0.4) + _sigmoid(0.5)) / 2 + 1.0
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        np.testing.assert_allclose(new_z, 0.075, rtol=1e-6)
        self.assertEqual(
            (float(m["num_pos_spans"]), float(m["num_neg_spans"]), float(m["num_neutral_tokens"])),
            (1.0, 1.0, 1.0),
        )

    def test_empty_parts_and_unchanged_reference_point(self):
        logp, ref, ids, _ = _data(3)
        neutral_only = np.zeros((logp.shape[0], 4), np.int32)
        for mode in ("ema", "batch_kl", "cumulative"):
            loss, new_z, m = _jax_kto(
                logp, ref, ids, neutral_only, 0.7, **dict(KW, reference_point=mode)
            )
            self.assertEqual(float(new_z), np.float32(0.7), mode)
            self.assertEqual(float(m["pref_loss"]), 0.0)
            self.assertEqual(float(m["ref_count"]), 0.0)
            np.testing.assert_allclose(loss, KW["neutral_coef"] * m["neutral_loss"], rtol=1e-6)
        # no span at all: loss 0, z unchanged, no NaN
        none = -np.ones_like(ids)
        loss, new_z, _ = _jax_kto(logp, ref, none, neutral_only, 0.7, **KW)
        self.assertEqual((float(loss), float(new_z)), (0.0, np.float32(0.7)))
        # polar spans only: the neutral part contributes 0
        polar = np.ones((logp.shape[0], 4), np.int32)
        _, _, m = _jax_kto(logp, ref, ids, polar, 0.0, **KW)
        self.assertEqual(float(m["neutral_loss"]), 0.0)

    def test_tokens_in_no_span_change_nothing(self):
        logp, ref, ids, pol = _data(4)
        out = ids < 0
        assert out.any()
        bad_logp, bad_ref = logp.copy(), ref.copy()
        bad_logp[out] = np.nan
        bad_ref[out] = -np.inf
        a = _jax_kto(logp, ref, ids, pol, 0.2, **KW)
        b = _jax_kto(bad_logp, bad_ref, ids, pol, 0.2, **KW)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        g = jax.grad(
            lambda x: span_kto_loss(x, jnp.asarray(bad_ref), ids, pol, jnp.float32(0.2), **KW)[0]
        )(jnp.asarray(bad_logp))
        assert np.all(np.isfinite(g))
        np.testing.assert_array_equal(np.asarray(g)[out], 0.0)

    def test_no_gradient_through_reference_point_or_reference_policy(self):
        logp, ref, ids, pol = _data(5)
        for mode in ("ema", "batch_kl", "cumulative"):
            kw = dict(KW, reference_point=mode)
            gz = jax.grad(lambda z, kw=kw: span_kto_loss(logp, ref, ids, pol, z, **kw)[0])(
                jnp.float32(0.1)
            )
            gref = jax.grad(
                lambda r, kw=kw: span_kto_loss(logp, r, ids, pol, jnp.float32(0.1), **kw)[0]
            )(jnp.asarray(ref))
            self.assertEqual(float(gz), 0.0)
            np.testing.assert_array_equal(gref, 0.0)
            gnew = jax.grad(
                lambda x, kw=kw: span_kto_loss(x, ref, ids, pol, jnp.float32(0.1), **kw)[1]
            )(jnp.asarray(logp))
            np.testing.assert_array_equal(gnew, 0.0)  # new_z_ref is a statistic, not a loss

    def test_cumulative_is_running_mean_of_batch_means(self):
        # Three batches with polar batch means m1, m2, m3: z after each = running mean.
        z, count, means = 0.0, 0.0, []
        for seed in (6, 7, 8):
            logp, ref, ids, pol = _data(seed)
            pol = np.where(pol == 0, 1, pol)
            r, c = span_rewards(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(ids), 4)
            exists = np.asarray(c) > 0
            means.append(float(np.asarray(r)[exists].mean()))
            _, z, m = _jax_kto(
                logp,
                ref,
                ids,
                pol,
                z,
                ref_count=jnp.float32(count),
                **dict(KW, reference_point="cumulative"),
            )
            count = float(m["ref_count"])
            np.testing.assert_allclose(z, np.mean(means), rtol=1e-5)
        self.assertEqual(count, 3.0)

    def test_bad_arguments_named(self):
        logp, ref, ids, pol = _data(0)
        with pytest.raises(ValueError, match="reference_point"):
            _jax_kto(logp, ref, ids, pol, 0.0, **dict(KW, reference_point="mean"))
        with pytest.raises(ValueError, match="reward_norm"):
            _jax_kto(logp, ref, ids, pol, 0.0, **dict(KW, reward_norm="max"))
        with pytest.raises(ValueError, match="alpha"):
            _jax_kto(logp, ref, ids, pol, 0.0, **dict(KW, alpha=1.5))
        with pytest.raises(ValueError, match="beta"):
            _jax_kto(logp, ref, ids, pol, 0.0, **dict(KW, beta=0.0))

    def test_accumulation_with_batch_normalisers(self):
        logp, ref, ids, pol = _data(9, n=8)
        kw = dict(KW)
        full = lambda x: _jax_kto(x, ref, ids, pol, 0.1, **kw)[0]  # noqa: E731
        _, _, m = _jax_kto(logp, ref, ids, pol, 0.1, **kw)
        npol = m["num_pos_spans"] + m["num_neg_spans"]
        nneu = m["num_neutral_tokens"]

        def acc(x):
            return sum(
                span_kto_loss(
                    x[sl],
                    ref[sl],
                    ids[sl],
                    pol[sl],
                    jnp.float32(0.1),
                    num_polar_spans=npol,
                    num_neutral_tokens=nneu,
                    **kw,
                )[0]
                for sl in (slice(0, 3), slice(3, 8))
            )

        x = jnp.asarray(logp)
        np.testing.assert_allclose(jax.jit(acc)(x), jax.jit(full)(x), rtol=1e-5)
        np.testing.assert_allclose(jax.jit(jax.grad(acc))(x), jax.jit(jax.grad(full))(x), atol=1e-6)


@given(
    span_batches(),
    st.sampled_from(["ema", "batch_kl", "cumulative"]),
    st.sampled_from(["sum", "mean_per_token"]),
)
def test_property_matches_numpy(batch, reference_point, reward_norm):
    logp, ref, ids, pol, z = batch
    kw = dict(KW, reference_point=reference_point, reward_norm=reward_norm)
    loss, new_z, _, g = _jitted_kto(**kw)(logp, ref, ids, pol, z)
    want, want_z, _, _, grad = np_span_kto(logp, ref, ids, pol, float(z), **kw)
    np.testing.assert_allclose(loss, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new_z, want_z, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g, grad, rtol=1e-3, atol=1e-5)


@given(span_batches())
def test_property_row_permutation_and_polarity_flip(batch):
    logp, ref, ids, pol, z = batch
    loss, new_z, _, _ = _jitted_kto(**KW)(logp, ref, ids, pol, z)
    perm = np.random.default_rng(0).permutation(logp.shape[0])
    loss_p, new_z_p, _, _ = _jitted_kto(**KW)(logp[perm], ref[perm], ids[perm], pol[perm], z)
    np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_z_p, new_z, rtol=1e-5, atol=1e-6)
    # Swapping positive/negative, the log-ratios' sign and lambda_w/lambda_l mirrors the
    # preference loss exactly (sigmoid(beta a) <-> sigmoid(-beta (-a))) when z = 0.
    kw = dict(KW, neutral_coef=0.0)
    zero = np.float32(0.0)
    a, _, _, _ = _jitted_kto(**kw)(logp, ref, ids, pol, zero)
    kw_m = dict(kw, lambda_w=KW["lambda_l"], lambda_l=KW["lambda_w"])
    b, _, _, _ = _jitted_kto(**kw_m)(ref, logp, ids, -pol, zero)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@jax.jit
def _rw_sft_jit(logp, pol, mask, w_neg):
    return rw_sft_loss(logp, pol, mask, w_pos=1.5, w_neu=1.0, w_neg=w_neg)[0]


@given(span_batches(), st.floats(0.0, 1.0))
def test_property_rw_sft_matches_numpy(batch, w_neg):
    logp, _, ids, pol, _ = batch
    tok_pol = np.where(ids >= 0, np.take_along_axis(pol, np.clip(ids, 0, None), 1), 0)
    mask = ids >= 0
    loss = _rw_sft_jit(logp, tok_pol, mask, np.float32(-w_neg))
    np.testing.assert_allclose(
        loss, np_rw_sft(logp, tok_pol, mask, 1.5, 1.0, -w_neg), rtol=1e-4, atol=1e-6
    )


# ------------------------------------------------------------------------------------------
# TRL sequence-level KTO equivalence
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_span_per_completion_with_batch_kl_is_trl_kto(seed):
    """One span covering each whole completion + the batch_kl point == TRL's KTO loss up to its
    constant ``mean(lambda_k)`` (TRL minimises ``lambda (1 - sigmoid)``), with the same gradient."""
    rng = np.random.default_rng(seed)
    n, t, prompt = 6, 9, 3
    logp = np.log(rng.uniform(0.05, 1.0, (n, t)))
    ref = logp + rng.normal(0, 0.6, (n, t))
    labels = np.array([True, False, True, True, False, False])
    # Mismatched pairs (TRL's KL completions): prompt i with the completion of row i - 1.
    kl_logp = np.log(rng.uniform(0.05, 1.0, (n, t)))
    kl_ref = kl_logp + rng.normal(0.1, 0.5, (n, t))
    resp = np.zeros((n, t), bool)
    resp[:, prompt:] = True
    beta, dw, uw = 0.3, 1.0, 1.33

    seq = lambda x: np.where(resp, x, 0.0).sum(1)  # noqa: E731
    trl = np_trl_kto(
        seq(logp),
        seq(ref),
        labels,
        seq(kl_logp),
        seq(kl_ref),
        beta=beta,
        desirable_weight=dw,
        undesirable_weight=uw,
    )
    ids = np.where(resp, 0, -1).astype(np.int32)
    pol = np.where(labels, 1, -1)[:, None].astype(np.int32)
    z = kto_kl_reference_point(
        jnp.asarray(kl_logp, jnp.float32), jnp.asarray(kl_ref, jnp.float32), jnp.asarray(resp)
    )
    np.testing.assert_allclose(z, max(np.mean(seq(kl_logp) - seq(kl_ref)), 0.0), rtol=1e-5)
    kw = dict(
        beta=beta, lambda_w=dw, lambda_l=uw, alpha=0.9, neutral_coef=1.0, reference_point="batch_kl"
    )

    def ours(x):
        return span_kto_loss(x, jnp.asarray(ref, jnp.float32), ids, pol, z, **kw)[0]

    const = np.mean(np.where(labels, dw, uw))
    x = jnp.asarray(logp, jnp.float32)
    np.testing.assert_allclose(float(ours(x)) + const, trl, rtol=1e-5)
    # Gradient: central differences of the float64 TRL reference w.r.t. each token log-prob.
    g = np.asarray(jax.grad(ours)(x))
    eps = 1e-6
    for i in range(n):
        for j in range(t):
            up, dn = logp.copy(), logp.copy()
            up[i, j] += eps
            dn[i, j] -= eps
            fd = (
                np_trl_kto(
                    seq(up),
                    seq(ref),
                    labels,
                    seq(kl_logp),
                    seq(kl_ref),
                    beta=beta,
                    desirable_weight=dw,
                    undesirable_weight=uw,
                )
                - np_trl_kto(
                    seq(dn),
                    seq(ref),
                    labels,
                    seq(kl_logp),
                    seq(kl_ref),
                    beta=beta,
                    desirable_weight=dw,
                    undesirable_weight=uw,
                )
            ) / (2 * eps)
            np.testing.assert_allclose(g[i, j], fd, rtol=1e-3, atol=1e-7)
    # KL below zero clamps to 0, as TRL's clamp(min=0)
    z0 = kto_kl_reference_point(
        jnp.asarray(kl_ref, jnp.float32) - 5.0, jnp.asarray(kl_ref, jnp.float32), jnp.asarray(resp)
    )
    assert float(z0) == 0.0


# ------------------------------------------------------------------------------------------
# Sharded == unsharded
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("reference_point", ["ema", "cumulative", "batch_kl"])
def test_sharded_equals_unsharded(reference_point):
    logp, ref, ids, pol = _data(11, n=16, t=10, s=4)
    kw = dict(KW, reference_point=reference_point)
    want = span_kto_loss(logp, ref, ids, pol, jnp.float32(0.2), ref_count=jnp.float32(1.0), **kw)
    want_g = jax.grad(lambda x: span_kto_loss(x, ref, ids, pol, jnp.float32(0.2), **kw)[0])(
        jnp.asarray(logp)
    )
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    rep = NamedSharding(mesh, P())

    def fn(a, b, c, d, z, cnt):
        loss, new_z, m = span_kto_loss(a, b, c, d, z, ref_count=cnt, **kw)
        g = jax.grad(lambda x: span_kto_loss(x, b, c, d, z, **kw)[0])(a)
        return loss, new_z, m, g

    out = jax.jit(fn, in_shardings=(rows, rows, rows, rows, rep, rep))(
        logp, ref, ids, pol, jnp.float32(0.2), jnp.float32(1.0)
    )
    loss, new_z, m, g = out
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    np.testing.assert_allclose(new_z, want[1], rtol=1e-6)
    for k in want[2]:
        np.testing.assert_allclose(m[k], want[2][k], rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(g, want_g, rtol=1e-6, atol=1e-8)
    assert g.sharding.spec[0] == "data"
    sft = jax.jit(
        lambda a, b, c: rw_sft_loss(a, b, c, w_pos=1.5, w_neu=1.0, w_neg=-0.2)[0],
        in_shardings=(rows, rows, rows),
    )(logp, np.sign(ids), ids >= 0)
    np.testing.assert_allclose(
        sft,
        rw_sft_loss(logp, np.sign(ids), ids >= 0, w_pos=1.5, w_neu=1.0, w_neg=-0.2)[0],
        rtol=1e-6,
    )
