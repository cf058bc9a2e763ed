# Shared fixtures: one real SGLang server per test session (see tests/sglang_fixtures.py).
from sglang_fixtures import (  # noqa: F401
    sglang_client,
    sglang_server,
    sglang_workdir,
    tiny_sglang_model,
)
