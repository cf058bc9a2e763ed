"""Shared pieces of the gateway, harness and attack tests: the tiny policy, its tokenizer, and
``ForcedEngine``.

A tiny random model never writes a tool call, so tests that need one use ``ForcedEngine``:
teacher-forced decoding of scripted text through the real model (its log-probs are that model's
scores of the forced tokens), standing in for a policy that has learned the tool syntax.
"""

from gagar_jax.models import create_model
from gagar_jax.rollout.sampler import score_tokens
from gagar_jax.rollout.types import Sample
from tests.update_fixtures import tiny_config


class ForcedEngine:
    """Teacher-forced decoding (tests only): each call answers the next scripted text (its
    tokens + EOS; the last text repeats once the script is spent), with the model's log-probs
    of those tokens after the prompt."""

    def __init__(self, model, tokenizer, texts, *, version: int = 3):
        self.model, self.tokenizer, self.texts = model, tokenizer, list(texts)
        self.version = version
        self.prompts: list[list[int]] = []

    async def agenerate(self, prompts, params, prompt_seeds=None):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
            lp = score_tokens(self.model, list(p) + ids, len(p))
            out.append([Sample(ids, [float(x) for x in lp], "stop", self.version)])
        return out


def tiny_policy(tokenizer, seed: int = 0):
    """The tests' tiny decoder over ``tokenizer``'s vocabulary."""
    return create_model(tiny_config(vocab_size=tokenizer.vocab_size), seed=seed)


def tool_text(command: str, prefix: str = "") -> str:
    """What a policy writes to call the ``bash`` tool (Hermes format)."""
    import json

    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{prefix}<tool_call>\n{call}\n</tool_call>"
