"""Hugging Face tokenizers from a checkpoint directory, with the checkpoint's chat template.

``HFTokenizer(path)`` reads ``tokenizer.json`` (the ``tokenizers`` library: the same fast
tokenizer ``transformers`` wraps) and ``tokenizer_config.json`` (EOS / pad tokens and the Jinja
``chat_template``; ``chat_template.jinja`` next to it is used when the config has none). The
template is rendered as ``transformers`` renders it (a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``tojson``, ``raise_exception``), so prompts are the ones the
model was trained on, without importing ``transformers``.

Token alignment: model tokens are never re-tokenised. What this module encodes is only what the
environment adds: the prompt (``render_prompt``) and each observation (``tool_message_tokens``),
as the suffix the template renders for a ``tool`` message after the assistant's turn (Qwen2.5:
``\\n<|im_start|>user\\n<tool_response>...``; ChatML templates: ``\\n<|im_start|>tool\\n...``).
The assistant turn itself ends with the EOS token the model generated (the stop token is kept).

Tool calls are the Qwen/Hermes format, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` (:func:`tool_call_text`); ``gagar_jax.rollout.parse_action`` parses them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer


def _token_text(x: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(x, Mapping):
        x = x.get("content")
    return x if isinstance(x, str) and x else None


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call in the Qwen/Hermes format (what the model generates for a call)."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


class HFTokenizer:
    """A Hugging Face tokenizer directory (see the module docstring).

    Attributes:
      vocab_size: ids the tokenizer can produce (added tokens included).
      eos_id: the id of ``eos_token`` (the end of an assistant turn for chat models).
      pad_id: ``pad_token``'s id, or ``eos_id`` when the tokenizer has none.
      chat_template: the Jinja template ("" if the directory has none).
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(
                f"{tok_file} not found: a Hugging Face tokenizer directory "
                "needs tokenizer.json and tokenizer_config.json"
            )
        self.path = path
        self._tok = Tokenizer.from_file(tok_file)
        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template") or ""
        jinja_file = os.path.join(path, "chat_template.jinja")
        if not template and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), "")
        self.chat_template: str = template or ""
        self.eos_token = _token_text(cfg.get("eos_token"))
        if self.eos_token is None:
            raise ValueError(f"{cfg_file}: eos_token missing (needed to end a model turn)")
        self.eos_id = self._id(self.eos_token, "eos_token")
        pad = _token_text(cfg.get("pad_token"))
        self.pad_token = pad or self.eos_token
        self.pad_id = self._id(self.pad_token, "pad_token")
        bos = _token_text(cfg.get("bos_token"))
        self.bos_id = self._id(bos, "bos_token") if bos else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str, field: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.path}: {field} {token!r} is not in tokenizer.json")
        return int(i)

    # ---- ids <-> text --------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special tokens written in the text (``<|im_start|>``) become their
        ids, nothing is added around it."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    # ---- chat template ---------------------------------------------------------------------
    @functools.cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError(f"{self.path}: tokenizer_config.json has no chat_template")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The template's text for ``messages`` (and the ``tools`` it lists)."""
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token="" if self.bos_id is None else self._tok.id_to_token(self.bos_id),
        )

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids: ``messages`` through the template, ending with the assistant header."""
        return self.encode(
            self.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        )

    @functools.cached_property
    def _tool_suffix(self) -> tuple[str, str]:
        """(text before, text after) an observation in the template's tool message, starting
        right after the assistant turn's EOS token and ending with the next assistant header."""
        marker = "\x00OBSERVATION\x00"
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        prev = self.apply_chat_template(base)
        cut = prev.rfind(self.eos_token)
        if cut < 0:
            raise ValueError(
                f"{self.path}: the chat template does not end an assistant turn "
                f"with eos_token {self.eos_token!r}"
            )
        cut += len(self.eos_token)
        full = self.apply_chat_template(
            base + [{"role": "tool", "content": marker}], add_generation_prompt=True
        )
        if not full.startswith(prev[:cut]) or marker not in full:
            raise ValueError(
                f"{self.path}: cannot render a tool message after an assistant "
                "turn with this chat template"
            )
        before, after = full[cut:].split(marker, 1)
        return before, after

    def tool_message_tokens(self, text: str) -> list[int]:
        """Ids of one observation as a tool message, appended after the model's EOS token."""
        before, after = self._tool_suffix
        return self.encode(before + text + after)
