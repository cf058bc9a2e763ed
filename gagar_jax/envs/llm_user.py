"""An LLM simulated user for the toy family: process-level feedback asked of a chat model.

The alternative to the rule-based user (:mod:`gagar_jax.envs.simulated_user`, the default):
the same evidence (the task, the patch with its edit lines numbered, the verifier's test log, the
behaviour monitor's flags, the reference fix) goes to any OpenAI-compatible chat endpoint
(``chat_completions(messages, *, tools, max_tokens, temperature) -> dict``:
``rollout.SGLangClient``, or :class:`ScriptedUserPolicy` in tests), which answers::

  {"feedback": [{"line": 2, "polarity": "negative", "text": "you edited a line outside ..."},
                {"char_range": [0, 13], "polarity": "positive", "text": "good, ..."}]}

Each item refers to one numbered edit line (``line``, 1-based) **or** to a character range
``[start, end)`` of the patch text (``char_range``, mapped to the sampled tokens whose characters
it touches), never both. Validation is strict: anything malformed rejects the whole answer with
a named reason (``rejected_<reason>`` in :attr:`LLMUser.metrics`): ``client_error``,
``no_response``, ``too_long``, ``no_json`` (also huge integers, deep nesting), ``not_object``
(:func:`validate_answer` given a non-object),
``bad_items``, ``too_many_items``, ``bad_item``, ``unknown_field``, ``bad_ref``, ``bad_type``,
``out_of_range``, ``empty_range``, ``no_tokens``, ``overlap``, ``bad_polarity``, ``bad_text``.
A rejected answer is re-asked once with the reason (``max_attempts=2`` in all); then the
rule-based user answers instead (``fallback`` counted). So every item that comes out has a
non-empty, in-response, non-overlapping ``token_range``: a malicious or confused model can
change the words and polarities of the feedback, never produce an invalid span or a crash.

Prompts are versioned files under ``envs/prompts/<version>/`` (``llm_user_system.md``,
``llm_user.md``).
"""

from __future__ import annotations

import collections
import importlib.resources
import json
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from gagar_jax.envs.simulated_user import _line_token_ranges, user_feedback
from gagar_jax.envs.tokenizer import TOKENIZER, encode_with_offsets
from gagar_jax.envs.toy import ToyTask, verify

PROMPT_VERSION = "v1"
MAX_OUTPUT_CHARS = 20_000
MAX_ITEMS = 16
MAX_TEXT_CHARS = 500
POLARITIES = ("positive", "neutral", "negative")
_ITEM_FIELDS = {"line", "char_range", "polarity", "text"}


def load_prompt(name: str, version: str = PROMPT_VERSION) -> str:
    res = importlib.resources.files("gagar_jax.envs") / "prompts" / version / f"{name}.md"
    if not res.is_file():
        raise FileNotFoundError(f"LLM user prompt {version}/{name}.md not found in gagar_jax.envs")
    return res.read_text(encoding="utf-8")


class UserOutputRejected(ValueError):
    """The model's answer failed validation; ``reason`` names why (a metrics key)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def parse_answer(text: Any) -> dict:
    """The first JSON object in ``text`` (fenced or bare); raises ``UserOutputRejected``."""
    if not isinstance(text, str) or not text.strip():
        raise UserOutputRejected("no_json", "empty answer; expected a JSON object")
    if len(text) > MAX_OUTPUT_CHARS:
        raise UserOutputRejected("too_long", f"{len(text)} chars exceed {MAX_OUTPUT_CHARS}")
    decoder = json.JSONDecoder()
    for chunk in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        start, tries = chunk.find("{"), 0
        while start != -1 and tries < 32:
            tries += 1
            try:
                obj, _ = decoder.raw_decode(chunk, start)
                if isinstance(obj, dict):  # always, starting at "{"; stay safe
                    return obj
            # ValueError covers JSONDecodeError and integers beyond int_max_str_digits;
            # RecursionError deep nesting.
            except (ValueError, RecursionError):
                pass
            start = chunk.find("{", start + 1)
    raise UserOutputRejected("no_json", "no parseable JSON object in the answer")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_answer(
    obj: Any,
    *,
    lines: Sequence[tuple[int, int]],
    token_offsets: Sequence[tuple[int, int]] | None,
    num_chars: int,
) -> list[dict]:
    """Feedback items with ``token_range`` (relative to the response) from a parsed answer.

    ``lines``: the ``[start, end)`` token range of each numbered edit line; ``token_offsets``:
    each response token's character interval in the patch text (``None``: char ranges cannot be
    mapped for this response and are rejected).
    """
    if not isinstance(obj, dict):
        raise UserOutputRejected("not_object", "expected a JSON object")
    items = obj.get("feedback")
    if not isinstance(items, list):
        raise UserOutputRejected("bad_items", "field 'feedback' must be a list")
    if len(items) > MAX_ITEMS:
        raise UserOutputRejected("too_many_items", f"{len(items)} items, at most {MAX_ITEMS}")
    out: list[dict] = []
    taken: list[tuple[int, int, str]] = []
    for k, raw in enumerate(items):
        where = f"feedback[{k}]"
        if not isinstance(raw, dict):
            raise UserOutputRejected("bad_item", f"{where}: expected an object")
        unknown = sorted(str(f)[:40] for f in set(raw) - _ITEM_FIELDS)
        if unknown:
            raise UserOutputRejected("unknown_field", f"{where}: unknown fields {unknown}")
        pol, text = raw.get("polarity"), raw.get("text")
        if not isinstance(pol, str) or pol not in POLARITIES:
            raise UserOutputRejected("bad_polarity", f"{where}.polarity: one of {POLARITIES}")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT_CHARS:
            raise UserOutputRejected(
                "bad_text", f"{where}.text: a non-empty string of <= {MAX_TEXT_CHARS} chars"
            )
        has_line, has_chars = "line" in raw, "char_range" in raw
        if has_line == has_chars:
            raise UserOutputRejected("bad_ref", f"{where}: give exactly one of line, char_range")
        if has_line:
            ln = raw["line"]
            if not _is_int(ln):
                raise UserOutputRejected("bad_type", f"{where}.line: expected an integer")
            if not 1 <= ln <= len(lines):
                raise UserOutputRejected(
                    "out_of_range", f"{where}.line: {str(ln)[:24]} not in [1, {len(lines)}]"
                )
            a, b = lines[ln - 1]
            ref = f"line {ln}"
        else:
            cr = raw["char_range"]
            if not (isinstance(cr, list) and len(cr) == 2 and all(_is_int(c) for c in cr)):
                raise UserOutputRejected(
                    "bad_type", f"{where}.char_range: expected [start, end] integers"
                )
            s, e = cr
            if not 0 <= s < e <= num_chars:
                if 0 <= s <= num_chars and s == e:
                    raise UserOutputRejected("empty_range", f"{where}.char_range is empty")
                raise UserOutputRejected(
                    "out_of_range",
                    f"{where}.char_range: need 0 <= start < end <= {num_chars}",
                )
            if token_offsets is None:
                raise UserOutputRejected(
                    "no_tokens",
                    f"{where}.char_range: no token map for this text; use line",
                )
            hit = [i for i, (ts, te) in enumerate(token_offsets) if ts < e and te > s]
            if not hit:
                raise UserOutputRejected("no_tokens", f"{where}.char_range covers no token")
            a, b = min(hit), max(hit) + 1
            ref = f"char_range [{s}, {e})"
        for pa, pb, pref in taken:
            if a < pb and pa < b:
                raise UserOutputRejected("overlap", f"{where} ({ref}) overlaps {pref}")
        taken.append((a, b, ref))
        out.append({"text": text.strip(), "polarity": pol, "token_range": [a, b]})
    return out


class LLMUser:
    """Process-level feedback from a chat model, validated, re-asked once, then rule-based.

    Called like :func:`~gagar_jax.envs.simulated_user.user_feedback`:
    ``user(task, response_tokens, tokenizer=...) -> items`` (``token_range`` relative to the
    response), so :func:`~gagar_jax.envs.simulated_user.feedback_record` takes it as ``user=``.
    """

    def __init__(
        self,
        client,
        *,
        max_attempts: int = 2,
        max_tokens: int = 512,
        temperature: float = 0.0,
        prompt_version: str = PROMPT_VERSION,
        fallback: Callable[..., list[dict]] = user_feedback,
    ):
        if max_attempts < 1:
            raise ValueError(f"LLMUser.max_attempts must be >= 1, got {max_attempts}")
        self.client = client
        self.max_attempts = int(max_attempts)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.prompt_version = prompt_version
        self.fallback = fallback
        self.system = load_prompt("llm_user_system", prompt_version)
        self.template = string.Template(load_prompt("llm_user", prompt_version))
        self.metrics: collections.Counter[str] = collections.Counter()

    def _prompt(self, task: ToyTask, patch: str, patch_lines: list[str]) -> str:
        v = verify(task, patch)
        flags = "; ".join(f"{f.rule}: {f.evidence}" for f in v.cheat_flags) or "no flags"
        return self.template.substitute(
            task=task.prompt,
            lines="\n".join(f"[{k}] {t}" for k, t in enumerate(patch_lines, start=1)) or "(empty)",
            verdict="all pass" if v.passed else "some fail",
            test_log=v.test_log[:2000],
            flags=flags[:1000],
            reference=task.reference_patch,
            max_items=MAX_ITEMS,
            num_lines=len(patch_lines),
            num_chars=len(patch),
            max_text_chars=MAX_TEXT_CHARS,
        )

    def __call__(self, task: ToyTask, response_tokens: Sequence[int], *, tokenizer=TOKENIZER):
        self.metrics["records"] += 1
        tokens = list(response_tokens)
        lines = _line_token_ranges(tokens, tokenizer)
        if not lines:
            self.metrics["no_lines"] += 1
            return []
        body = tokens[: lines[-1][1]]
        patch = tokenizer.decode(body)
        offsets: list[tuple[int, int]] | None
        try:
            ids, offs = encode_with_offsets(tokenizer, patch)
            offsets = offs if list(ids) == body else None
        except Exception:  # noqa: BLE001 - an unmappable text only disables char ranges
            offsets = None
        patch_lines = [tokenizer.decode(tokens[a:b]) for a, b in lines]
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self._prompt(task, patch, patch_lines)},
        ]
        for _ in range(self.max_attempts):
            self.metrics["calls"] += 1
            try:
                response = self.client.chat_completions(
                    messages,
                    tools=None,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
            except Exception:  # noqa: BLE001 - a dead server is a fallback, not a crash
                self.metrics["rejected_client_error"] += 1
                break
            text = ""
            try:
                try:
                    text = response["choices"][0]["message"]["content"]
                except (KeyError, IndexError, TypeError) as e:
                    raise UserOutputRejected("no_response", "no choices[0].message") from e
                items = validate_answer(
                    parse_answer(text), lines=lines, token_offsets=offsets, num_chars=len(patch)
                )
            except UserOutputRejected as e:
                self.metrics["rejected"] += 1
                self.metrics[f"rejected_{e.reason}"] += 1
                messages = messages + [
                    {"role": "assistant", "content": text[:4000] if isinstance(text, str) else ""},
                    {
                        "role": "user",
                        "content": f"Rejected: {str(e)[:300]}. Answer again with "
                        "the complete JSON object.",
                    },
                ]
                continue
            self.metrics["accepted"] += 1
            return items
        self.metrics["fallback"] += 1
        return self.fallback(task, response_tokens, tokenizer=tokenizer)


class ScriptedUserPolicy:
    """A deterministic chat policy for :class:`LLMUser` (tests; not a mock of a server).

    Plays ``answers`` in order (the last one repeats); an answer is a string sent as the
    message content, or a callable ``(messages) -> str`` that reads the conversation (e.g.
    :meth:`line_critic`). ``raise_error=True`` raises like an unreachable server.
    """

    def __init__(self, answers: Sequence[Any] = (), *, raise_error: bool = False):
        self.answers = list(answers) or [self.line_critic]
        self.raise_error = raise_error
        self.calls = 0
        self.conversations: list[list[dict]] = []

    def chat_completions(self, messages, *, tools=None, max_tokens=512, temperature=0.0):
        self.conversations.append([dict(m) for m in messages])
        self.calls += 1
        if self.raise_error:
            raise ConnectionError("scripted: server unreachable")
        a = self.answers[min(self.calls - 1, len(self.answers) - 1)]
        content = a(messages) if callable(a) else a
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}

    @staticmethod
    def line_critic(messages) -> str:
        """Praises a numbered line equal to the reference fix, criticises every other line."""
        user = messages[1]["content"]
        ref = user.split("The reference fix: ", 1)[1].split("\n", 1)[0].strip()
        section = user.split("# What the assistant answered", 1)[1].split("# What you know", 1)[0]
        items = []
        for m in re.finditer(r"^\[(\d+)\] (.*)$", section, re.MULTILINE):
            good = m.group(2).strip() == ref
            items.append(
                {
                    "line": int(m.group(1)),
                    "polarity": "positive" if good else "negative",
                    "text": "good, that is the fix" if good else "this step is not the fix",
                }
            )
        return json.dumps({"feedback": items})
