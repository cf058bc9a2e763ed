r"""Frozen-reference log-probs for Span-KTO: inside the jitted step vs precomputed per batch.

    XLA_FLAGS= python benchmarks/feedback_ref.py [--sizes=64x2,256x4] [--iters=20]

Both sides in one run, interleaved, median of ``--iters`` timed calls after warm-up, machine
load (``os.getloadavg``) printed before and after. Sides:

* ``inside``: one compiled step = reference forward + policy forward/backward + AdamW;
* ``precomputed``: a separate compiled reference forward (``jit_ref_logprobs``) per batch, its
  ``[N, T]`` result fed to the step; timed as the sum of both calls;
* ``step only``: the step with reference log-probs already in hand (the cost when they are
  computed once per dataset: the reference never changes).
"""

import argparse
import os
import statistics
import time

import jax
import numpy as np
from flax import nnx

from gagar_jax.feedback.step import (
    FeedbackObjective,
    create_feedback_state,
    jit_feedback_step,
    jit_ref_logprobs,
    shard_train_batch,
    to_train_batch,
)
from gagar_jax.models import Transformer, TransformerConfig
from gagar_jax.update.state import UpdateConfig, make_mesh


def batch(n, t, vocab, seed=0):
    from gagar_jax.data.feedback import FeedbackBatch

    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab, (n, t)).astype(np.int32)
    resp = np.zeros((n, t), bool)
    resp[:, t // 3 :] = True
    span_ids = np.where(resp, (np.arange(t)[None] - t // 3) // 8, -1).astype(np.int32)
    s = int(span_ids.max()) + 1
    pol = rng.integers(-1, 2, (n, s)).astype(np.int32)
    tok_pol = np.where(span_ids >= 0, np.take_along_axis(pol, np.clip(span_ids, 0, None), 1), 0)
    return FeedbackBatch(
        tokens=tokens,
        positions=np.tile(np.arange(t, dtype=np.int32), (n, 1)),
        attention_mask=np.ones((n, t), bool),
        response_mask=resp,
        span_ids=span_ids,
        span_polarity=pol,
        token_polarity=tok_pol,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64x2,256x4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}; devices: {jax.devices()}")
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    uc = UpdateConfig(learning_rate=1e-4)
    print(
        "| model (hidden x layers) | inside (ms) | precomputed: ref + step (ms) | step only (ms) |"
    )
    print("|---|---|---|---|")
    for size in args.sizes.split(","):
        h, layers = (int(x) for x in size.split("x"))
        mc = TransformerConfig(
            vocab_size=512,
            hidden_size=h,
            num_layers=layers,
            num_heads=max(h // 32, 1),
            num_kv_heads=max(h // 64, 1),
            intermediate_size=2 * h,
            qkv_bias=False,
            tie_embeddings=True,
        )
        params = nnx.to_pure_dict(nnx.state(Transformer(mc, rngs=nnx.Rngs(0)), nnx.Param))
        fb = batch(args.batch, args.seq, mc.vocab_size)
        ref_fn = jit_ref_logprobs(mc, uc, mesh)
        st_in = create_feedback_state(mc, uc, mesh, params)
        st_pre = create_feedback_state(mc, uc, mesh, params)
        tb_in = shard_train_batch(to_train_batch(fb), mesh)
        ref0 = np.asarray(ref_fn(st_pre.ref_params, fb.tokens, fb.positions, fb.attention_mask))
        tb_pre_host = to_train_batch(fb, ref_logprobs=ref0)
        step_in = jit_feedback_step(mc, FeedbackObjective(ref_logprobs="inside"), uc, mesh, tb_in)
        step_pre = jit_feedback_step(
            mc, FeedbackObjective(ref_logprobs="precomputed"), uc, mesh, tb_pre_host
        )
        tb_pre = shard_train_batch(tb_pre_host, mesh)
        times = {"inside": [], "pre": [], "step": []}
        for i in range(args.iters + 3):
            t0 = time.perf_counter()
            st_in, m = step_in(st_in, tb_in)
            jax.block_until_ready(m)
            t1 = time.perf_counter()
            ref = ref_fn(st_pre.ref_params, fb.tokens, fb.positions, fb.attention_mask)
            tb = tb_pre._replace(ref_logprobs=ref)
            st_pre, m2 = step_pre(st_pre, tb)
            jax.block_until_ready(m2)
            t2 = time.perf_counter()
            st_pre, m3 = step_pre(st_pre, tb_pre)
            jax.block_until_ready(m3)
            t3 = time.perf_counter()
            if i >= 3:
                times["inside"].append(t1 - t0)
                times["pre"].append(t2 - t1)
                times["step"].append(t3 - t2)
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(
            f"| {h} x {layers} | {med['inside']:.1f} | {med['pre']:.1f} | {med['step']:.1f} |",
            flush=True,
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
