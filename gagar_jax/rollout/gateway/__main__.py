"""``python -m gagar_jax.rollout.gateway``: the gateway as a process of its own.

    python -m gagar_jax.rollout.gateway --engine embedded --model-dir DIR [--tokenizer DIR]
    python -m gagar_jax.rollout.gateway --engine sglang --sglang-url http://127.0.0.1:30000 \\
        --tokenizer DIR

The trainer opens and finishes sessions with the admin key (``--admin-key``, else
``$GAGAR_GATEWAY_ADMIN_KEY``, else a fresh one printed at start); finished episodes are written to
``--record-dir`` and served again after a restart.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys


def build_gateway(args):
    from gagar_jax.rollout.gateway import BatchingBackend, DirectBackend, Gateway, GatewayConfig
    from gagar_jax.rollout.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(args.tokenizer or args.model_dir)
    if args.engine == "embedded":
        from gagar_jax.models import load_hf_safetensors
        from gagar_jax.rollout.sampler import Sampler

        _, model = load_hf_safetensors(args.model_dir)
        sampler = Sampler(model, pad_id=tokenizer.pad_id, seed=args.seed)
        backend = BatchingBackend(sampler, max_batch=args.max_batch)
        context = min(args.context_limit, sampler.prompt_buckets[-1])
        cap = sampler.new_token_buckets[-1]
    else:
        from gagar_jax.rollout import SGLangClient

        client = SGLangClient(args.sglang_url, vocab_size=tokenizer.vocab_size)
        backend = DirectBackend(client)
        context, cap = args.context_limit, args.context_limit
    config = GatewayConfig(
        model_name=args.model_name,
        context_limit=context,
        default_max_tokens=min(args.default_max_tokens, cap),
        max_tokens_cap=cap,
        temperature=args.temperature,
    )
    return Gateway(backend, tokenizer, config, record_dir=args.record_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.rollout.gateway", description=__doc__)
    ap.add_argument("--engine", choices=("embedded", "sglang"), required=True)
    ap.add_argument("--model-dir", help="embedded: HF safetensors + config.json (+ tokenizer)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: --model-dir)")
    ap.add_argument("--sglang-url", help="sglang: the server's or router's URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--uds", default=None, help="also serve on this Unix socket")
    ap.add_argument("--record-dir", default=None)
    ap.add_argument("--admin-key", default=os.environ.get("GAGAR_GATEWAY_ADMIN_KEY"))
    ap.add_argument("--model-name", default="policy")
    ap.add_argument("--context-limit", type=int, default=4096)
    ap.add_argument("--default-max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.engine == "embedded" and not args.model_dir:
        ap.error("--engine embedded needs --model-dir")
    if args.engine == "sglang" and not (args.sglang_url and args.tokenizer):
        ap.error("--engine sglang needs --sglang-url and --tokenizer")
    admin_key = args.admin_key or secrets.token_urlsafe(24)
    if not args.admin_key:
        print(f"gateway: admin key {admin_key}", file=sys.stderr, flush=True)
    from gagar_jax.rollout.gateway.server import GatewayServer

    server = GatewayServer(
        build_gateway(args), host=args.host, port=args.port, admin_key=admin_key, uds=args.uds
    )
    where = server.url + (f" and {args.uds}" if args.uds else "")
    print(f"gateway: serving on {where} ({args.engine})", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
