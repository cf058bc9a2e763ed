"""Lists the `sgl_kernel` names a real CPU SGLang server imports and calls (run from the JAX venv).

    .venv/bin/python scripts/sglang_cpu/check_sgl_kernel_names.py MODEL_DIR

Starts the server with the import-only stand-in on PYTHONPATH and GAGAR_SGL_KERNEL_LOG set, sends
one generation, stops it, and prints the names. Any "call" line means a stand-in was called: that
code path needs the real kernel library. Re-run after every SGLang upgrade.
"""

import collections
import sys
import tempfile
from pathlib import Path

from gagar_jax.rollout import SamplingParams, SGLangClient
from gagar_jax.rollout.sglang_server import SGLangServer


def main(model_dir: str) -> int:
    log = Path(tempfile.mkdtemp()) / "sgl_kernel.log"
    server = SGLangServer(model_dir)
    server.env["GAGAR_SGL_KERNEL_LOG"] = str(log)
    with server:
        client = SGLangClient(server.url)
        client.generate([[1, 2, 3]], SamplingParams(n=2, temperature=1.0, max_tokens=8))
        client.generate([[1, 2, 3]], SamplingParams(temperature=0.0, top_k=5, max_tokens=8))
    events = log.read_text().splitlines() if log.exists() else []
    kinds = collections.defaultdict(set)
    for line in events:
        _, kind, name = line.split()
        kinds[kind].add(name)
    print(f"imported ({len(kinds['import'])}): {sorted(kinds['import'])}")
    print(f"called ({len(kinds['call'])}): {sorted(kinds['call'])}")
    return 1 if kinds["call"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
