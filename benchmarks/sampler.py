"""Benchmark: the embedded JAX sampler against Hugging Face `transformers` `generate`, same weights.

Run: `make bench` (or `.venv/bin/python benchmarks/sampler.py [--quick]`). Needs the `parity`
extra (CPU torch + transformers), which `make setup` installs.

Both engines decode greedily from the same random Qwen2-style model (exported with
`save_hf_safetensors` and loaded by `transformers`), the same prompts, the same number of new
tokens (no early stop), in float32 on the same CPU, one after the other in this process. Rows:
batch size; new tokens per second for each engine (median of `--repeats` timed runs after one
warm-up that includes compilation); their ratio; and the fraction of greedy tokens on which the
engines agree (random weights give near-ties, so a few late divergences are expected in fp32).
Compile time of the JAX sampler is reported separately (it is paid once per shape bucket).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens (CI smoke)")
    args = ap.parse_args()

    import jax
    import torch
    import transformers

    from gagar_jax.models import TransformerConfig, create_model, save_hf_safetensors
    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.sampler import Sampler

    if args.quick:
        cfg = TransformerConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, intermediate_size=128, rope_theta=10000.0)
        args.new_tokens, args.repeats = 16, 1
    else:  # a small Qwen2-shaped model: ~9M parameters
        cfg = TransformerConfig(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8,
                                num_kv_heads=4, intermediate_size=704, rope_theta=10000.0)
    batches = [int(b) for b in args.batches.split(",")]
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    model = create_model(cfg, seed=0)
    sampler = Sampler(model, batch_buckets=tuple(sorted(set(batches))),
                      prompt_buckets=(args.prompt_len,), new_token_buckets=(args.new_tokens,))
    with tempfile.TemporaryDirectory() as d:
        save_hf_safetensors(model, cfg, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.eval()
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    print(f"model: {cfg.num_params / 1e6:.1f}M params (hidden {cfg.hidden_size}, "
          f"{cfg.num_layers} layers, vocab {cfg.vocab_size}); prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy, float32; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, torch {torch.__version__} ({threads} threads), "
          f"transformers {transformers.__version__}")
    print(f"{'batch':>5} | {'jax tok/s':>10} | {'hf tok/s':>10} | {'jax/hf':>6} | "
          f"{'agree':>6} | {'jax compile s':>13}")
    print("-" * 66)
    for b in batches:
        prompts = rng.integers(1, cfg.vocab_size, (b, args.prompt_len)).tolist()

        t0 = time.perf_counter()
        out = sampler.generate(prompts, params)  # compiles this bucket
        compile_s = time.perf_counter() - t0
        jax_times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = sampler.generate(prompts, params)
            jax_times.append(time.perf_counter() - t0)
        jax_tokens = np.array([row[0].tokens for row in out])

        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)
        kw = dict(attention_mask=mask, max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, do_sample=False)
        with torch.inference_mode():
            hf.generate(ids, **kw)  # warm-up
            hf_times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                gen = hf.generate(ids, **kw)
                hf_times.append(time.perf_counter() - t0)
        hf_tokens = gen[:, args.prompt_len:].numpy()

        n_tok = b * args.new_tokens
        jax_tps = n_tok / statistics.median(jax_times)
        hf_tps = n_tok / statistics.median(hf_times)
        agree = float((jax_tokens == hf_tokens).mean())
        print(f"{b:>5} | {jax_tps:>10.0f} | {hf_tps:>10.0f} | {jax_tps / hf_tps:>6.2f} | "
              f"{agree:>6.3f} | {compile_s:>13.1f}")


if __name__ == "__main__":
    main()
