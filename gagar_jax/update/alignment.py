"""Behaviour log-probabilities computed by the update's own program (``rollout.bitwise_onpolicy``).

The embedded sampler's decode (one token at a time against a KV cache) and the update's forward
(whole sequences, blocked causal attention, other matrix shapes) round differently: in float32
the sampler's recorded log-probabilities differ from the update's by about 1e-6. In the bitwise
mode the behaviour log-probabilities of a packed batch are instead recomputed with the
sampler's weights by :func:`jit_behaviour_logprobs`: the update's proximal pass
(``update.step._proximal_logprobs``), on the update's own mini- and micro-batch layout and
shardings, so that at equal weights the update's log-probabilities of the sampled tokens equal
the recorded ones bit for bit. ``mismatch/logprob_max_abs_diff`` (``learner.mismatch_metrics``)
is then exactly 0, and anything that breaks the alignment (weights that differ from the
trainer's, another temperature, other routes, a packing bug) makes it non-zero.

The tokens are still drawn from the decode's distribution: what is bitwise is the scoring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gagar_jax.models import BATCH_AXES, TransformerConfig
from gagar_jax.update.state import UpdateConfig, abstract_model, state_shardings
from gagar_jax.update.step import (
    UpdateBatch,
    _proximal_logprobs,
    _shares_prefix,
    _split,
    _split_groups,
    batch_shardings,
)


def _unsplit(y, n: int):
    """The inverse of ``step._split``: ``[M, A, per, ...]`` -> ``[N, ...]``."""
    return jnp.moveaxis(y, 2, 0).reshape((n,) + y.shape[3:])


def _unsplit_groups(y, n: int, k: int):
    """The inverse of ``step._split_groups``: ``[M, A, per_g * K, ...]`` -> ``[N, ...]``."""
    m, a, rows = y.shape[:3]
    y = y.reshape((m, a, rows // k, k) + y.shape[3:])
    return jnp.moveaxis(y, 2, 0).reshape((n,) + y.shape[4:])


def behaviour_logprobs(
    params, batch: UpdateBatch, *, graphdef, config: UpdateConfig, mesh: Mesh | None = None
) -> jax.Array:
    """``[N, T]`` float32: each response token's log-probability under ``params`` at its own
    position (0 elsewhere), as ``UpdateBatch.old_logprobs`` holds them, computed by the
    update's proximal pass on the update's split of ``batch`` (``config``'s mini- and
    micro-batches; a group's rows together where the update runs the shared-prefix forward).
    """
    n, t = batch.tokens.shape
    g, k = batch.rewards.shape
    moe = nnx.merge(graphdef, params).config.num_experts > 0
    shared = not moe and batch.row_episode is None and _shares_prefix(config, t, g, mesh)
    m, a = config.num_minibatches, config.num_microbatches
    fields = dict(
        tokens=batch.tokens, positions=batch.positions, attention_mask=batch.attention_mask
    )
    if batch.routes is not None and config.routing_replay:
        fields["routes"] = batch.routes
    if shared:
        data = {key: _split_groups(v, m, a, k, mesh) for key, v in fields.items()}
    else:
        data = {key: _split(v, m, a, mesh) for key, v in fields.items()}
    lp = _proximal_logprobs(params, data, graphdef, config)  # [M, A, b, T], by predictor
    lp = _unsplit_groups(lp, n, k) if shared else _unsplit(lp, n)
    token_lp = jnp.concatenate([jnp.zeros((n, 1), jnp.float32), lp[:, :-1]], axis=1)
    return jnp.where(batch.response_mask, token_lp, 0.0)


def jit_behaviour_logprobs(
    model_config: TransformerConfig,
    config: UpdateConfig,
    mesh: Mesh,
    *,
    temperature: float | None = None,
    with_ref: bool = False,
    with_evidence: bool = False,
    with_routes: bool = False,
):
    """``fn(params, batch) -> [N, T]`` (:func:`behaviour_logprobs`) jitted with the update's
    shardings on ``mesh``: the parameters as the train state's, the batch as
    ``batch_shardings`` (``with_*``: which optional fields it holds). ``temperature``: the
    behaviour policy's (the rollout's; default ``config.temperature``): the update scores at
    its own, so two temperatures show as a mismatch."""
    if temperature is not None:
        config = dataclasses.replace(config, temperature=float(temperature))
    graphdef = nnx.graphdef(abstract_model(model_config))
    _, st_sh = state_shardings(model_config, config, mesh)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))

    def fn(params, batch):
        return behaviour_logprobs(params, batch, graphdef=graphdef, config=config, mesh=mesh)

    batch_sh = batch_shardings(mesh, with_ref, with_evidence, with_routes)
    jitted = jax.jit(fn, in_shardings=(st_sh.params, batch_sh), out_shardings=rows)

    def call(params, batch):
        # the sampler's weights (on its own device) placed as the train state's
        return jitted(jax.device_put(params, st_sh.params), batch)

    return call
