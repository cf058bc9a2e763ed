"""Hugging Face tokenizers with their chat template: ``gagar_jax.rollout.hf_tokenizer``.

The class lives with the rollout engines (the gateway renders requests with it; ``rollout``
may not import ``envs``); the task families import it from here as before.
"""

from gagar_jax.rollout.hf_tokenizer import HFTokenizer, tool_call_text

__all__ = ["HFTokenizer", "tool_call_text"]
