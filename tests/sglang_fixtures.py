"""Session fixtures for tests that talk to a real SGLang server (CPU, tiny random model).

Imported by tests/conftest.py so every test module shares ONE server per pytest process. Mark such
tests with `SGLANG` (skips with a clear reason when .venv-sglang is absent; `make test` builds it,
and keeps all SGLang tests on one xdist worker with `--dist loadgroup`):

    from sglang_fixtures import SGLANG
    pytestmark = SGLANG

    def test_something(sglang_server, sglang_client): ...

`sglang_server` is a started `gagar_jax.rollout.sglang_server.SGLangServer` serving
`tiny_sglang_model` (a random Qwen2: hidden 64, 2 layers, 4 heads, 2 KV heads, a 1024-token BPE
tokenizer trained locally, ChatML template); it is stopped at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gagar_jax.rollout.sglang_client import SGLangClient
from gagar_jax.rollout.sglang_server import SGLangServer, make_tiny_model, sglang_python

HAVE_SGLANG = sglang_python().exists()
SKIP_REASON = (
    f"no SGLang venv at {sglang_python().parent.parent}: build it with `make sglang-venv` "
    "(scripts/setup_sglang.sh, ~5 min, ~11 GB)"
)
SGLANG = [
    pytest.mark.skipif(not HAVE_SGLANG, reason=SKIP_REASON),
    pytest.mark.xdist_group("sglang"),
]


@pytest.fixture(scope="session")
def sglang_workdir():
    """A private directory for models and server logs. Not under pytest's basetemp: concurrent
    pytest runs on one machine prune each other's old basetemps while a server still reads it.
    Removed at the end unless GAGAR_KEEP_SGLANG_DIR=1."""
    path = Path(tempfile.mkdtemp(prefix="gagar-sglang-"))
    yield path
    if os.environ.get("GAGAR_KEEP_SGLANG_DIR") != "1":
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_sglang_model(sglang_workdir):
    """Directory of the tiny random Qwen2 + tokenizer (HF layout), built in the SGLang venv."""
    if not HAVE_SGLANG:
        pytest.skip(SKIP_REASON)
    return make_tiny_model(sglang_workdir / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def sglang_server(tiny_sglang_model):
    """A real SGLang server on a free loopback port; stopped (process group killed) at the end."""
    server = SGLangServer(tiny_sglang_model)
    server.start(timeout_s=300)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sglang_client(sglang_server):
    """A client for the session server (fresh metrics per test)."""
    return SGLangClient(sglang_server.url, max_concurrency=8, ignore_eos=True, vocab_size=1024)
