"""Chat requests to token ids and completions back to messages, token-exact.

The gateway renders a request's messages with the policy's chat template (``HFTokenizer``) into
prompt ids. Generated text is never tokenised again: when a request repeats an assistant message
that the gateway itself returned earlier in the session (after the same messages and tools), the
prompt is that call's recorded prompt ids + completion ids, followed by the template's text for
the messages after it (cut right after the end-of-turn token that closes the assistant turn, as
``HFTokenizer.tool_message_tokens`` cuts an observation). Only what the harness added (tool
results, user turns) is encoded from text. A request whose history does not repeat a returned
message (edited, compacted, or rendered otherwise by the template) is rendered and encoded whole;
the segments built from the record (``gagar_jax.rollout.segments``) start a new segment there.

Both APIs come down to one message form, the one chat templates read::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"name": str, "arguments": dict | str}, ...],   # assistant only
     "tool_call_id": str}                                           # tool only

OpenAI ``messages`` (text parts only; ``developer`` is ``system``) and Anthropic ``system`` +
``messages`` (``text``, ``tool_use`` and ``tool_result`` blocks; each ``tool_result`` becomes a
``tool`` message) both parse to it; anything else is a :class:`RequestError` naming the field.

Tool calls are the Qwen/Hermes format the multi-turn episode uses
(``gagar_jax.envs.hf_tokenizer.tool_call_text``): a template that reads ``tool_calls`` gets them
as structured calls; one that does not gets their Hermes text in the assistant's content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.rollout.hf_tokenizer import tool_call_text

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class RequestError(ValueError):
    """A request the gateway refuses (HTTP 400): ``field`` names the offending field."""

    def __init__(self, field: str, message: str, *, code: str = "invalid_request"):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


# ---------------------------------------------------------------------------- messages


def _expect(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise RequestError(field, message)


def _text_parts(content: Any, field: str) -> str:
    """OpenAI content: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _expect(isinstance(content, list), field, "expected a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        f = f"{field}[{j}]"
        _expect(isinstance(part, Mapping), f, "expected an object")
        _expect(
            part.get("type") == "text",
            f"{f}.type",
            f"only text parts are supported, got {part.get('type')!r}",
        )
        _expect(isinstance(part.get("text"), str), f"{f}.text", "expected a string")
        out.append(part["text"])
    return "".join(out)


def _arguments(raw: Any, field: str) -> dict | str:
    """Tool-call arguments: a JSON object (given as text by OpenAI, as an object by Anthropic);
    text that is not a JSON object is kept as text."""
    if isinstance(raw, Mapping):
        return dict(raw)
    _expect(isinstance(raw, str), field, "expected a JSON string")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, dict) else raw


def openai_messages(messages: Any) -> list[dict]:
    """OpenAI chat ``messages`` in the gateway's message form."""
    _expect(isinstance(messages, list) and messages, "messages", "expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        _expect(isinstance(m, Mapping), f, "expected an object")
        role = m.get("role")
        _expect(
            role in ("system", "developer", "user", "assistant", "tool"),
            f"{f}.role",
            f"expected system, developer, user, assistant or tool, got {role!r}",
        )
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text_parts(m.get("content"), f"{f}.content"),
        }
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            _expect(isinstance(calls, list), f"{f}.tool_calls", "expected a list")
            msg["tool_calls"] = []
            for k, c in enumerate(calls):
                g = f"{f}.tool_calls[{k}]"
                _expect(isinstance(c, Mapping), g, "expected an object")
                fn = c.get("function")
                _expect(isinstance(fn, Mapping), f"{g}.function", "expected an object")
                _expect(isinstance(fn.get("name"), str), f"{g}.function.name", "expected a string")
                msg["tool_calls"].append(
                    {
                        "name": fn["name"],
                        "arguments": _arguments(
                            fn.get("arguments", "{}"), f"{g}.function.arguments"
                        ),
                    }
                )
        if role == "tool":
            tid = m.get("tool_call_id")
            _expect(isinstance(tid, str), f"{f}.tool_call_id", "expected a string")
            msg["tool_call_id"] = tid
        out.append(msg)
    return out


def _anthropic_text(content: Any, field: str) -> str:
    """Anthropic text content: a string or a list of ``text`` blocks."""
    if isinstance(content, str):
        return content
    _expect(isinstance(content, list), field, "expected a string or a list of text blocks")
    out = []
    for j, b in enumerate(content):
        _expect(isinstance(b, Mapping), f"{field}[{j}]", "expected an object")
        _expect(
            b.get("type") == "text",
            f"{field}[{j}].type",
            f"only text blocks are supported here, got {b.get('type')!r}",
        )
        _expect(isinstance(b.get("text"), str), f"{field}[{j}].text", "expected a string")
        out.append(b["text"])
    return "".join(out)


def anthropic_messages(system: Any, messages: Any) -> list[dict]:
    """Anthropic ``system`` + ``messages`` in the gateway's message form."""
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": _anthropic_text(system, "system")})
    _expect(isinstance(messages, list) and messages, "messages", "expected a non-empty list")
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        _expect(isinstance(m, Mapping), f, "expected an object")
        role = m.get("role")
        _expect(
            role in ("user", "assistant"), f"{f}.role", f"expected user or assistant, got {role!r}"
        )
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        _expect(isinstance(content, list), f"{f}.content", "expected a string or a list of blocks")
        text, calls, results = [], [], []
        for j, b in enumerate(content):
            g = f"{f}.content[{j}]"
            _expect(isinstance(b, Mapping), g, "expected an object")
            kind = b.get("type")
            if kind == "text":
                _expect(isinstance(b.get("text"), str), f"{g}.text", "expected a string")
                text.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                _expect(isinstance(b.get("name"), str), f"{g}.name", "expected a string")
                _expect(isinstance(b.get("input", {}), Mapping), f"{g}.input", "expected an object")
                calls.append({"name": b["name"], "arguments": dict(b.get("input", {}))})
            elif kind == "tool_result" and role == "user":
                _expect(
                    isinstance(b.get("tool_use_id"), str), f"{g}.tool_use_id", "expected a string"
                )
                body = b.get("content", "")
                body = _anthropic_text(body, f"{g}.content") if body else ""
                if b.get("is_error"):
                    body = f"error: {body}"
                results.append({"role": "tool", "content": body, "tool_call_id": b["tool_use_id"]})
            else:
                raise RequestError(
                    f"{g}.type", f"unsupported content block {kind!r} in a {role} message"
                )
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out.extend(results)
            if text or not results:
                out.append({"role": "user", "content": "".join(text)})
    return out


def openai_tools(tools: Any) -> list[dict] | None:
    """OpenAI ``tools`` (function tools) as the template's tool list."""
    if tools is None:
        return None
    _expect(isinstance(tools, list), "tools", "expected a list")
    out = []
    for i, t in enumerate(tools):
        f = f"tools[{i}]"
        _expect(isinstance(t, Mapping), f, "expected an object")
        _expect(
            t.get("type") == "function", f"{f}.type", f"only function tools, got {t.get('type')!r}"
        )
        fn = t.get("function")
        _expect(isinstance(fn, Mapping), f"{f}.function", "expected an object")
        _expect(isinstance(fn.get("name"), str), f"{f}.function.name", "expected a string")
        out.append({"type": "function", "function": dict(fn)})
    return out or None


def anthropic_tools(tools: Any) -> list[dict] | None:
    """Anthropic ``tools`` (name, description, input_schema) as the template's tool list."""
    if tools is None:
        return None
    _expect(isinstance(tools, list), "tools", "expected a list")
    out = []
    for i, t in enumerate(tools):
        f = f"tools[{i}]"
        _expect(isinstance(t, Mapping), f, "expected an object")
        _expect(isinstance(t.get("name"), str), f"{f}.name", "expected a string")
        fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


# ---------------------------------------------------------------------------- matching


def _canonical_args(args: dict | str) -> str:
    return json.dumps(args, sort_keys=True, ensure_ascii=False) if isinstance(args, dict) else args


def message_key(msg: Mapping[str, Any]) -> list:
    """What identifies a message when a harness sends it back: role, content (an assistant's
    stripped: clients trim it) and tool calls by name and canonical arguments (call ids are the
    client's business)."""
    content = msg.get("content") or ""
    if msg["role"] == "assistant":
        content = content.strip()
    calls = [[c["name"], _canonical_args(c["arguments"])] for c in msg.get("tool_calls") or ()]
    return [msg["role"], content, calls, msg.get("tool_call_id")]


def prefix_keys(messages: Sequence[Mapping[str, Any]], tools: Sequence | None) -> list[str]:
    """``keys[i]``: a digest of the tools and ``messages[: i + 1]`` (one pass, running hash)."""
    h = hashlib.sha256(json.dumps(tools or [], sort_keys=True).encode())
    keys = []
    for m in messages:
        h.update(b"\x00" + json.dumps(message_key(m), ensure_ascii=False).encode())
        keys.append(h.copy().hexdigest())
    return keys


# ---------------------------------------------------------------------------- rendering


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A request's prompt ids; ``linked_call`` is the index of the session's call whose
    prompt + completion ids the prompt starts with (None: rendered whole from text)."""

    prompt_ids: list[int]
    linked_call: int | None
    extension_ids: list[int]  # the ids encoded from text after the linked call (all if None)


class ChatRenderer:
    """Renders gateway messages with ``tokenizer``'s chat template (an ``HFTokenizer``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.eos_id
        self.structured_tool_calls = "tool_calls" in (tokenizer.chat_template or "")

    def template_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Messages as the template reads them (tool calls structured or as Hermes text)."""
        out = []
        for m in messages:
            t = {"role": m["role"], "content": m.get("content") or ""}
            calls = m.get("tool_calls") or []
            if calls and self.structured_tool_calls:
                t["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ]
            elif calls:
                texts = [
                    tool_call_text(c["name"], c["arguments"])
                    if isinstance(c["arguments"], dict)
                    else f'<tool_call>\n{{"name": {json.dumps(c["name"])}, "arguments": '
                    f"{json.dumps(c['arguments'])}}}\n</tool_call>"
                    for c in calls
                ]
                t["content"] = "\n".join(([t["content"]] if t["content"] else []) + texts)
            if m.get("tool_call_id"):
                t["tool_call_id"] = m["tool_call_id"]
            out.append(t)
        return out

    def text(self, messages, tools=None, *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                self.template_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 -- a template's raise_exception on this request
            raise RequestError("messages", f"the chat template refused them: {e}") from None

    def render(self, messages, tools, calls: Mapping[str, Any]) -> Rendered:
        """Prompt ids of ``messages`` (+ ``tools``). ``calls``: prefix key -> recorded call
        (``prompt_ids``, ``completion_ids``, ``index``) of the session's earlier answers."""
        full = self.text(messages, tools, add_generation_prompt=True)
        keys = prefix_keys(messages, tools)
        for j in range(len(messages) - 1, -1, -1):
            if messages[j]["role"] != "assistant" or keys[j] not in calls:
                continue
            rec = calls[keys[j]]
            head = self.text(messages[: j + 1], tools, add_generation_prompt=False)
            cut = head.rfind(self.eos_token)
            if cut < 0:
                continue
            ended = bool(rec.completion_ids) and rec.completion_ids[-1] == self.eos_id
            if ended:
                cut += len(self.eos_token)
            if not full.startswith(head[:cut]):
                continue  # the template renders this history otherwise: no link
            ext = self.tokenizer.encode(full[cut:])
            return Rendered(list(rec.prompt_ids) + list(rec.completion_ids) + ext, rec.index, ext)
        ids = self.tokenizer.encode(full)
        return Rendered(ids, None, ids)

    # ------------------------------------------------------------------ completions

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        ids = list(completion_ids)
        if ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def parse_completion(text: str, *, tools: bool) -> tuple[str, list[dict]]:
    """(content, tool calls) of a completion's text: with ``tools``, each well-formed
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block becomes a call and leaves
    the content; a malformed block stays in the content as text."""
    if not tools:
        return text, []
    calls, kept, pos = [], [], 0
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                continue
        if not isinstance(args, dict):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append({"name": obj["name"], "arguments": args})
    kept.append(text[pos:])
    return ("".join(kept).strip() if calls else text), calls


def truncate_at_stop(
    text_of, completion_ids: Sequence[int], stops: Sequence[str]
) -> tuple[int, str, str | None]:
    """The shortest prefix of ``completion_ids`` whose text contains one of ``stops``:
    (number of ids kept, the text before the stop string, the stop string), or
    (all ids, their text, None). ``text_of(ids) -> str``. The kept ids end with the token that
    completes the stop string: those are the tokens the model produced up to it, log-probs and
    all; the tail after it is dropped (the episode never contained it)."""
    full = text_of(completion_ids)
    if not stops or not any(s in full for s in stops):
        return len(completion_ids), full, None
    lo, hi = 1, len(completion_ids)
    while lo < hi:  # the text of a prefix grows with it: bisect on "contains a stop"
        mid = (lo + hi) // 2
        if any(s in text_of(completion_ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = text_of(completion_ids[:lo])
    first = min((text.find(s), s) for s in stops if s in text)
    return lo, text[: first[0]], first[1]
