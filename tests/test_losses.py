"""Losses against plain NumPy references (loops allowed here only)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from gagar_jax.losses import aggregate, kl_estimate, policy_loss, token_logprobs_and_entropy


def np_logprobs_entropy(logits, targets):
    lp = np.zeros(targets.shape)
    ent = np.zeros(targets.shape)
    for idx in np.ndindex(targets.shape):
        z = logits[idx].astype(np.float64)
        logz = np.log(np.sum(np.exp(z - z.max()))) + z.max()
        logp = z - logz
        lp[idx] = logp[targets[idx]]
        ent[idx] = -np.sum(np.exp(logp) * logp)
    return lp, ent


def np_aggregate(values, mask, mode, num_tokens=None, num_seqs=None):
    mask = mask.astype(np.float64)
    if mode == "token-mean":
        n = mask.sum() if num_tokens is None else num_tokens
        return (values * mask).sum() / max(n, 1.0)
    per_seq = []
    for b in range(values.shape[0]):
        t = mask[b].sum()
        s = (values[b] * mask[b]).sum()
        if t > 0:
            per_seq.append(s / t if mode == "seq-mean-token-mean" else s)
    n = len(per_seq) if num_seqs is None else num_seqs
    return sum(per_seq) / max(n, 1)


def np_pg_per_token(logp, old, adv, clip_low, clip_high, dual_clip):
    out = np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        a = adv[idx]
        r = np.exp(logp[idx] - old[idx])
        loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
        if dual_clip is not None and a < 0:
            loss = min(loss, -a * dual_clip)
        out[idx] = loss
    return out


def _data(seed, b=4, t=7):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 1.0, (b, t)))
    old = logp + rng.normal(0, 0.4, (b, t))  # ratios well outside [0.8, 1.28]
    adv = rng.normal(0, 1, (b,))
    mask = rng.uniform(size=(b, t)) < 0.7
    mask[-1] = False  # an empty sequence (e.g. a padded slot)
    ref = logp + rng.normal(0, 0.3, (b, t))
    ent = rng.uniform(0, 3, (b, t))
    return logp, old, adv, mask, ref, ent


class LossTest(parameterized.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_logprobs_entropy(self):
        rng = np.random.default_rng(0)
        logits = rng.normal(0, 5, (2, 5, 33)).astype(np.float32)
        logits[0, 0, 3] = 80.0  # large logit: must not overflow
        targets = rng.integers(0, 33, (2, 5))
        lp, ent = self.variant(token_logprobs_and_entropy)(logits, targets)
        lp_ref, ent_ref = np_logprobs_entropy(logits, targets)
        np.testing.assert_allclose(lp, lp_ref, atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(ent, ent_ref, atol=1e-4, rtol=1e-5)

    def test_logprobs_grad_is_softmax_minus_onehot(self):
        rng = np.random.default_rng(1)
        logits = jnp.asarray(rng.normal(0, 1, (3, 11)), jnp.float32)
        targets = jnp.asarray([0, 5, 10])
        g = jax.grad(lambda z: token_logprobs_and_entropy(z, targets)[0].sum())(logits)
        expected = np.eye(11)[np.asarray(targets)] - jax.nn.softmax(logits)
        np.testing.assert_allclose(g, expected, atol=1e-6)

    @parameterized.product(
        mode=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"], seed=[0, 1]
    )
    def test_aggregate(self, mode, seed):
        values, _, _, mask, _, _ = _data(seed)
        got = aggregate(jnp.asarray(values), jnp.asarray(mask), mode)
        np.testing.assert_allclose(got, np_aggregate(values, mask, mode), rtol=1e-5)

    @parameterized.product(
        mode=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
        dual_clip=[None, 3.0],
        seed=[0, 1],
    )
    def test_pg_loss_matches_numpy(self, mode, dual_clip, seed):
        logp, old, adv, mask, _, _ = _data(seed)
        terms = jax.jit(
            lambda *a: policy_loss(
                *a, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, aggregation=mode
            )
        )(
            jnp.asarray(logp, jnp.float32),
            jnp.asarray(old, jnp.float32),
            jnp.asarray(adv, jnp.float32),
            jnp.asarray(mask),
        )
        per_tok = np_pg_per_token(
            logp, old, np.broadcast_to(adv[:, None], logp.shape), 0.2, 0.28, dual_clip
        )
        np.testing.assert_allclose(terms.pg_loss, np_aggregate(per_tok, mask, mode), rtol=1e-5)
        np.testing.assert_allclose(terms.loss, terms.pg_loss)
        r = np.exp(logp - old)
        a = np.broadcast_to(adv[:, None], logp.shape)
        low = (r < 0.8) & (a < 0)
        high = (r > 1.28) & (a > 0)
        np.testing.assert_allclose(
            terms.clip_frac_low, np_aggregate(low, mask, "token-mean"), rtol=1e-6
        )
        np.testing.assert_allclose(
            terms.clip_frac_high, np_aggregate(high, mask, "token-mean"), rtol=1e-6
        )
        self.assertGreater(float(terms.clip_frac_low) + float(terms.clip_frac_high), 0.0)
        np.testing.assert_allclose(
            terms.approx_kl, np_aggregate(r - 1 - np.log(r), mask, "token-mean"), rtol=1e-5
        )

    def test_dual_clip_bounds_negative_advantage_loss(self):
        # A = -1, ratio = e^3 ~ 20: PPO loss = 20, dual clip c=3 caps it at -A*c = 3.
        logp = jnp.full((1, 1), 0.0)
        old = jnp.full((1, 1), -3.0)
        adv = jnp.full((1,), -1.0)
        mask = jnp.ones((1, 1), bool)
        plain = policy_loss(logp, old, adv, mask)
        dual = policy_loss(logp, old, adv, mask, dual_clip=3.0)
        np.testing.assert_allclose(plain.pg_loss, np.exp(3.0), rtol=1e-6)
        np.testing.assert_allclose(dual.pg_loss, 3.0, rtol=1e-6)
        self.assertEqual(float(dual.dual_clip_frac), 1.0)
        with self.assertRaisesRegex(ValueError, "dual_clip"):
            policy_loss(logp, old, adv, mask, dual_clip=0.5)

    def test_clip_higher_gradient_zero_outside_range(self):
        # Positive advantage: gradient flows while r < 1 + eps_high, is zero beyond it.
        adv = jnp.ones((1,))
        mask = jnp.ones((1, 1), bool)
        old = jnp.zeros((1, 1))
        for log_r, expect_zero in ((np.log(1.25), False), (np.log(1.30), True)):
            g = jax.grad(
                lambda lp: policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28).loss
            )(jnp.full((1, 1), log_r))
            self.assertEqual(bool(np.all(np.asarray(g) == 0)), expect_zero)

    @parameterized.parameters("k1", "k3")
    def test_kl_and_entropy_terms(self, kind):
        logp, old, adv, mask, ref, ent = _data(3)
        terms = policy_loss(
            jnp.asarray(logp),
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            jnp.asarray(ent),
            jnp.asarray(ref),
            kl_coef=0.1,
            kl_estimator=kind,
            entropy_coef=0.01,
        )
        d = ref - logp
        kl_tok = -d if kind == "k1" else np.exp(d) - d - 1
        kl = np_aggregate(kl_tok, mask, "token-mean")
        ent_m = np_aggregate(ent, mask, "token-mean")
        np.testing.assert_allclose(terms.kl, kl, rtol=1e-5)
        np.testing.assert_allclose(terms.entropy, ent_m, rtol=1e-5)
        np.testing.assert_allclose(terms.loss, terms.pg_loss + 0.1 * kl - 0.01 * ent_m, rtol=1e-5)
        if kind == "k3":
            self.assertTrue(
                np.all(np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(ref))) >= 0)
            )

    @parameterized.parameters("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    def test_accumulation_rule(self, mode):
        """Micro-batch terms with mini-batch normalisers sum to the full-batch loss and grad;
        the mean of micro-batch means differs (token-mean on unequal micro-batch sizes)."""
        logp, old, adv, mask, _, _ = _data(4, b=8, t=6)
        mask[:4, 2:] = False  # first half much shorter than second
        mask[4:7] = True
        args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv)] + [jnp.asarray(mask)]

        def full(lp):
            return policy_loss(lp, *args[1:], aggregation=mode).loss

        n_tok = float(mask.sum())
        n_seq = float((mask.sum(1) > 0).sum())

        def accumulated(lp):
            total = 0.0
            for sl in (slice(0, 4), slice(4, 8)):
                total = (
                    total
                    + policy_loss(
                        lp[sl],
                        args[1][sl],
                        args[2][sl],
                        args[3][sl],
                        aggregation=mode,
                        num_tokens=n_tok,
                        num_seqs=n_seq,
                    ).loss
                )
            return total

        lp = args[0]
        np.testing.assert_allclose(accumulated(lp), full(lp), rtol=1e-5)
        np.testing.assert_allclose(jax.grad(accumulated)(lp), jax.grad(full)(lp), atol=1e-6)
        if mode == "token-mean":
            mean_of_means = np.mean(
                [
                    float(policy_loss(lp[sl], args[1][sl], args[2][sl], args[3][sl]).loss)
                    for sl in (slice(0, 4), slice(4, 8))
                ]
            )
            self.assertGreater(abs(mean_of_means - float(full(lp))), 1e-3)

    def test_bad_mode_named(self):
        with pytest.raises(ValueError, match="aggregation"):
            aggregate(jnp.ones((2, 2)), jnp.ones((2, 2)), "mean")
        with pytest.raises(ValueError, match="kl estimator"):
            kl_estimate(jnp.ones((2, 2)), jnp.ones((2, 2)), "k2")
