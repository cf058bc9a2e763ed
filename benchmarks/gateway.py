"""Benchmark: the gateway's per-call overhead over a direct engine call, and 64 concurrent
sessions, in one run on the embedded sampler (a tiny random model and the tests' tokenizer).

Run: `.venv/bin/python benchmarks/gateway.py [--pairs 60] [--sessions 64] [--calls 3]`.

1. Overhead: `--pairs` rounds, each one direct `Sampler.generate` call on the prompt ids and one
   OpenAI-format HTTP call through the gateway (rendering, session bookkeeping, the batching
   window, FastAPI/uvicorn, JSON) for the same messages, greedy, a fixed number of new tokens
   (`ignore_eos`-like: the EOS id is never the argmax of these weights in the measured prompts;
   the row reports the completion lengths). The order alternates between rounds; the table
   shows the median of each and the median of the per-round differences (the overhead).
2. Concurrency: `--sessions` sessions, each a thread of its own doing `--calls` chained calls
   (each call's history extends the previous answer, as a harness does) with the official
   OpenAI SDK; the errors (must be 0), the wall time, the engine calls the batching made and
   the rows per engine call.

The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--window-ms", type=float, default=0.0)
    args = ap.parse_args()

    import httpx
    import openai

    from gagar_jax.models import create_model
    from gagar_jax.rollout.gateway import BatchingBackend, Gateway, GatewayConfig, GatewayServer
    from gagar_jax.rollout.hf_tokenizer import HFTokenizer
    from gagar_jax.rollout.sampler import Sampler
    from gagar_jax.rollout.types import SamplingParams
    from tests.hf_fixtures import make_tiny_tokenizer
    from tests.update_fixtures import tiny_config

    print(f"load average before: {os.getloadavg()}")
    tok = HFTokenizer(make_tiny_tokenizer(tempfile.mkdtemp(prefix="gw_bench_tok_")))
    model = create_model(tiny_config(vocab_size=tok.vocab_size), seed=0)
    sampler = Sampler(
        model,
        pad_id=tok.pad_id,
        batch_buckets=(1, 2, 4, 8, 16, 32, 64),
        prompt_buckets=(64, 128),
        new_token_buckets=(16,),
    )
    gw = Gateway(
        BatchingBackend(sampler, max_batch=64, window_s=args.window_ms / 1000),
        tok,
        GatewayConfig(context_limit=128, default_max_tokens=args.new_tokens, max_tokens_cap=16),
    )
    msgs = [{"role": "user", "content": "Fix the failing test in slug.py, please."}]
    ids = tok.render_prompt(msgs)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.new_tokens, stop_token_ids=(tok.eos_id,)
    )
    with GatewayServer(gw) as server:
        s = gw.open_session("bench-overhead")
        http = httpx.Client(timeout=60)
        url = f"{server.session_url(s)}/chat/completions"
        body = {"model": "p", "messages": msgs, "temperature": 0.0, "max_tokens": args.new_tokens}

        def direct():
            t = time.perf_counter()
            out = sampler.generate([ids], params)
            return time.perf_counter() - t, len(out[0][0].tokens)

        def through():
            t = time.perf_counter()
            r = http.post(url, json=body)
            r.raise_for_status()
            return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]

        for _ in range(3):  # compile and warm both paths
            direct(), through()
        d_times, g_times, diffs, lengths = [], [], [], set()
        for k in range(args.pairs):
            first, second = (direct, through) if k % 2 == 0 else (through, direct)
            a, b = first(), second()
            (dt, dn), (gt, gn) = (a, b) if first is direct else (b, a)
            d_times.append(dt)
            g_times.append(gt)
            diffs.append(gt - dt)
            lengths.update({dn, gn})
        gw.finish_session(s.token)
        ms = lambda x: f"{1000 * x:.2f} ms"  # noqa: E731
        print(f"\n1. per-call overhead ({args.pairs} interleaved pairs, greedy, completion "
              f"lengths {sorted(lengths)}, batching window {args.window_ms} ms)")  # fmt: skip
        print(f"   direct engine call  median {ms(statistics.median(d_times))}")
        print(f"   through the gateway median {ms(statistics.median(g_times))}")
        q = statistics.quantiles(diffs, n=10)
        print(f"   overhead            median {ms(statistics.median(diffs))} "
              f"(p10 {ms(q[0])}, p90 {ms(q[-1])})")  # fmt: skip

        # 2. concurrent sessions (each batch bucket compiled first: not timed)
        t = time.perf_counter()
        for b in sampler.batch_buckets:
            for prompt_len in (40, 100):
                sampler.generate([[5 + i % 90] * prompt_len for i in range(b)], params)
        print(f"\n   (compiling the batch buckets for part 2: {time.perf_counter() - t:.1f} s)")
        batches0, rows0 = gw.backend.batches, gw.backend.rows
        errors: list[str] = []
        done = []

        def session(i: int):
            sess = gw.open_session(f"bench-{i}")
            client = openai.OpenAI(base_url=server.session_url(sess), api_key="x", max_retries=0)
            history = [{"role": "user", "content": f"task {i}: make the tests pass"}]
            try:
                for turn in range(args.calls):
                    r = client.chat.completions.create(
                        model="p", messages=history, max_tokens=args.new_tokens
                    )
                    history += [
                        r.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": f"observation {turn}"},
                    ]
                rec = gw.finish_session(sess.token)
                links = [c["linked_call"] for c in rec["calls"]]
                if links != [None, *range(args.calls - 1)]:
                    errors.append(f"session {i}: calls not linked: {links}")
                done.append(i)
            except Exception as e:  # noqa: BLE001 -- counted and printed
                errors.append(f"session {i}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=session, args=(i,)) for i in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        batches, rows = gw.backend.batches - batches0, gw.backend.rows - rows0
        print(f"\n2. {args.sessions} concurrent sessions x {args.calls} chained calls (OpenAI SDK)")
        print(f"   sessions completed {len(done)}/{args.sessions}, errors {len(errors)}")
        for e in errors[:5]:
            print(f"     {e}")
        print(f"   wall {wall:.2f} s; {rows} calls in {batches} engine calls "
              f"({rows / max(batches, 1):.1f} rows per engine call)")  # fmt: skip
    print(f"\nload average after: {os.getloadavg()}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
