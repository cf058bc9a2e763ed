"""Train/rollout mismatch diagnostics of the update (``UpdateConfig.mismatch_metrics``).

At the start of an update the trainer's own log-probs of the sampled tokens (the proximal
pass, the parameters the update starts from) are compared with the behaviour log-probs the
rollout engine recorded. With the weights the engine sampled with (the synchronous loop, no
staleness) the two differ only by how the engine computes: its precision, its kernels, its
temperature, its routing. ``mismatch/logprob_max_abs_diff`` is the largest difference on a
response token (exactly 0 with ``rollout.bitwise_onpolicy``), ``mismatch/k3`` the token-mean
k3 estimate of KL(mu || pi_prox).

Mixture-of-experts models with recorded routes (``UpdateBatch.routes``): the update also
routes every token with its own router, without replay, and reports
``mismatch/route_diff_frac`` (attended tokens with recorded routes whose set of experts
differs from the recorded one in at least one layer), ``mismatch/k3_no_replay`` (the k3 of
that forward's log-probs),
and with ``learner.routing_replay`` ``mismatch/k3_replay`` (the same as ``mismatch/k3``) and
``mismatch/route_replay_match_frac`` (attended tokens whose experts in the replayed forward
are the recorded ones in every layer: 1), with ``mismatch/route_recorded_frac`` the share of
attended tokens that have recorded routes (the others route freely: e.g. each SGLang sample's
last token, which the server never fed to its model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logprob_mismatch(proximal, behaviour, mask):
    """(max |pi_prox - mu| over the masked tokens, sum of k3 = exp(d) - d - 1, token count).

    Arrays are token-aligned ``[..., T]`` (the same position scores the same token); a
    difference past 20 nats is clamped in the k3 (as the loss clamps it)."""
    mask = mask.astype(bool)
    d = jnp.where(mask, proximal.astype(jnp.float32) - behaviour.astype(jnp.float32), 0.0)
    dc = jnp.clip(d, -20.0, 20.0)
    k3 = jnp.where(mask, jnp.exp(dc) - dc - 1.0, 0.0)
    return (
        jnp.max(jnp.abs(d), initial=0.0),
        jnp.sum(k3),
        jnp.sum(mask.astype(jnp.float32)),
    )


def proximal_mismatch_metrics(data: dict) -> dict[str, jax.Array]:
    """``mismatch/logprob_max_abs_diff`` and ``mismatch/k3`` from the split update data
    (``[M, A, b, T]`` fields: ``proximal_logprobs`` indexed by the predicting position,
    ``old_logprobs`` and ``response_mask`` by the token)."""
    prox = jax.lax.stop_gradient(data["proximal_logprobs"])[..., :-1]
    old = data["old_logprobs"][..., 1:]
    mask = data["response_mask"][..., 1:]
    max_diff, k3, n = logprob_mismatch(prox, old, mask)
    return {
        "mismatch/logprob_max_abs_diff": max_diff,
        "mismatch/k3": k3 / jnp.maximum(n, 1.0),
    }


def route_mismatch_metrics(data: dict, free_lp, free_routes, replay_lp=None, replay_routes=None):
    """The route metrics (module docstring) from the update's no-replay pass (``free_lp``
    ``[M, A, b, T]``, ``free_routes`` ``[M, A, b, T, L, K]``) and, with replay, the replayed
    pass's (``replay_lp``, ``replay_routes``); ``data`` the split update data with
    ``routes``."""
    recorded = data["routes"].astype(jnp.int32)
    # tokens with recorded routes (-1: not recorded, e.g. an episode's last observation)
    tokens = data["attention_mask"].astype(bool)
    attended = tokens & jnp.all(recorded >= 0, axis=(-1, -2))
    n = jnp.maximum(jnp.sum(attended.astype(jnp.float32)), 1.0)

    def same(a):  # [..., T] every layer's set of experts equal to the recorded one
        return jnp.all(jnp.sort(a, axis=-1) == jnp.sort(recorded, axis=-1), axis=(-1, -2))

    def k3(lp):
        _, total, count = logprob_mismatch(
            jax.lax.stop_gradient(lp)[..., :-1],
            data["old_logprobs"][..., 1:],
            data["response_mask"][..., 1:],
        )
        return total / jnp.maximum(count, 1.0)

    out = {
        "mismatch/route_recorded_frac": jnp.sum(attended.astype(jnp.float32))
        / jnp.maximum(jnp.sum(tokens.astype(jnp.float32)), 1.0),
        "mismatch/route_diff_frac": jnp.sum((attended & ~same(free_routes)).astype(jnp.float32))
        / n,
        "mismatch/k3_no_replay": k3(free_lp),
    }
    if replay_routes is not None:
        out["mismatch/route_replay_match_frac"] = (
            jnp.sum((attended & same(replay_routes)).astype(jnp.float32)) / n
        )
        out["mismatch/k3_replay"] = k3(replay_lp)
    return out
