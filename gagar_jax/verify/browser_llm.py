"""The browser judge's optional LLM stages: a one-pass planner and a grounded frame judge.

Both talk to any OpenAI-compatible chat endpoint (``chat_completions(messages, *, tools,
max_tokens, temperature) -> dict``: ``rollout.SGLangClient``, or ``ScriptedBrowserPolicy`` in
tests) and validate the model's output the way grader verdicts are validated: a malformed or
ungrounded answer is re-asked with the reason (``max_attempts`` in all), then falls back; a
fallback never turns into a score of 0.

``BrowserLLMPlanner``: for checklist items that only have a description, the model writes the
``actions``/``expect`` lists of the rubric schema in one pass from the page snapshot. Output::

  {"items": [{"id": "adds_item", "actions": [...], "expect": [...]}]}

Validated by the rubric schema (``browser_rubric.parse_item``), every asked id exactly once, and
every target either on the loaded page (in the ARIA snapshot, or a CSS selector that matches) or
named by the rubric's author; an unknown target rejects the plan. Fallback: the items stay
unplanned, are left out of the score (``passed=None``) and counted.

``BrowserLLMJudge``: reads the checklist, the rule checks' outcomes, the recorded frames' runtime
ARIA text and (capped) source, and answers per item::

  {"items": [{"id": "adds_item", "pass": true, "frame": 4, "quote": "listitem: milk"}]}

A ``pass`` must quote (>= 3 characters) the runtime text of the frame it cites, so a pass is
grounded in behaviour, never in the source (padding the source cannot buy one). The LLM can veto
a rule pass and decides unplanned items; it cannot pass an item whose rule checks failed.
Fallback: the rule results stand.

Untrusted content: everything the page under test produced (its title and snapshot, the frames'
text, its source, page text quoted in the rule checks' evidence) is enclosed in per-call random
delimiters and escaped (``verify.untrusted.Envelope``), and the system prompts say it is data,
never instructions. The answer parser (``answer_object``) reads exactly one answer object: a
reply that holds a second ``"items"`` object (a quoted one, e.g. an answer planted in the page)
is rejected and re-asked, never read in part.

Prompts are versioned files under ``verify/prompts/<version>/`` (``browser_planner.md``,
``browser_judge.md``; ``v2`` adds the untrusted-content rules).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.resources
import json
import re
import string
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gagar_jax.verify.browser_rubric import ChecklistEntry, RubricError, Target, parse_item
from gagar_jax.verify.untrusted import Envelope

PROMPT_VERSION = "v2"
MAX_OUTPUT_CHARS = 100_000
MIN_QUOTE_CHARS = 3


def load_prompt(name: str, version: str = PROMPT_VERSION) -> str:
    res = importlib.resources.files("gagar_jax.verify") / "prompts" / version / f"{name}.md"
    if not res.is_file():
        raise FileNotFoundError(f"browser prompt {version}/{name}.md not found in gagar_jax.verify")
    return res.read_text(encoding="utf-8")


class OutputRejected(ValueError):
    """The model's answer failed validation (the reason is fed back on a re-ask)."""


def answer_object(text: Any, key: str = "items") -> dict:
    """The one answer object of a reply (fenced or bare); raises ``OutputRejected``.

    The reply is scanned for top-level JSON objects (an object inside another, or inside a
    string, is part of that one). It must hold at most one object with ``key``: a second one
    means the model quoted one (an answer planted in the page would otherwise win), so the reply
    is rejected, never read in part. With no such object the first object is returned (the
    validation then names what is missing).
    """
    if not isinstance(text, str) or not text.strip():
        raise OutputRejected("empty answer; expected a JSON object")
    if len(text) > MAX_OUTPUT_CHARS:
        raise OutputRejected(f"answer of {len(text)} chars exceeds {MAX_OUTPUT_CHARS}")
    decoder = json.JSONDecoder()
    objects: list[dict] = []
    start, tries = text.find("{"), 0
    while start != -1 and tries < 64:  # bounded: pathological text stays cheap
        tries += 1
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            objects.append(obj)
        start = text.find("{", end)
    answers = [o for o in objects if key in o]
    if len(answers) > 1:
        raise OutputRejected(
            f"the reply holds {len(answers)} objects with {key!r}; answer with "
            "exactly one (a quoted answer is never read)"
        )
    if answers or objects:
        return (answers or objects)[0]
    raise OutputRejected("no JSON object in the answer")


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def first_json_object(text: Any) -> dict:
    """The first JSON object in ``text`` (fenced first, then bare); raises ``OutputRejected``.

    For replies that hold no untrusted text; the browser stages read ``answer_object``."""
    if not isinstance(text, str) or not text.strip():
        raise OutputRejected("empty answer; expected a JSON object")
    if len(text) > MAX_OUTPUT_CHARS:
        raise OutputRejected(f"answer of {len(text)} chars exceeds {MAX_OUTPUT_CHARS}")
    decoder = json.JSONDecoder()
    for chunk in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        start, tries = chunk.find("{"), 0
        while start != -1 and tries < 64:
            tries += 1
            try:
                obj, _ = decoder.raw_decode(chunk, start)
                if isinstance(obj, dict):
                    return obj
            except (json.JSONDecodeError, RecursionError):
                pass
            start = chunk.find("{", start + 1)
    raise OutputRejected("no JSON object in the answer")


def _inline(envelope: Any, text: str, source: str) -> str:
    """``text`` enclosed on one line (escaped; newlines shown as ``\\n``)."""
    body = envelope.escape(text).replace("\n", "\\n")
    return f'{envelope.open_prefix} source="{source}">{body}{envelope.close}'


def _envelope() -> Any:
    return Envelope()


def _content(response: Any) -> str:
    try:
        content = response["choices"][0]["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise OutputRejected("response without choices[0].message") from e
    return content if isinstance(content, str) else ""


class _Asker:
    """Shared ask / validate / re-ask loop."""

    def __init__(self, client, *, max_attempts, max_tokens, temperature, prompt_version):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.client = client
        self.max_attempts = int(max_attempts)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.prompt_version = prompt_version
        self.metrics: collections.Counter[str] = collections.Counter()

    async def _ask(self, system: str, user: str, validate: Callable[[dict], Awaitable[Any]]):
        """(validated result or None, rejection reasons)."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        reasons: list[str] = []
        for _ in range(self.max_attempts):
            self.metrics["calls"] += 1
            try:
                response = await asyncio.to_thread(
                    self.client.chat_completions,
                    messages,
                    tools=None,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                )
            except Exception as e:  # noqa: BLE001 - a dead server is a fallback, not a crash
                self.metrics["client_errors"] += 1
                reasons.append(f"client error: {type(e).__name__}: {str(e)[:200]}")
                break
            text = ""
            try:
                text = _content(response)
                result = await validate(answer_object(text))
                self.metrics["accepted"] += 1
                return result, reasons
            except (OutputRejected, RubricError) as e:
                self.metrics["rejected"] += 1
                reasons.append(str(e)[:300])
                messages += [
                    {"role": "assistant", "content": text[:4000]},
                    {
                        "role": "user",
                        "content": f"Rejected: {e}. Answer again with the complete JSON object.",
                    },
                ]
        self.metrics["fallback"] += 1
        return None, reasons


class BrowserLLMPlanner(_Asker):
    """Plans description-only checklist items from the page snapshot (module docstring)."""

    def __init__(
        self,
        client,
        *,
        max_attempts: int = 2,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        prompt_version: str = PROMPT_VERSION,
        max_snapshot_chars: int = 6000,
    ):
        super().__init__(
            client,
            max_attempts=max_attempts,
            max_tokens=max_tokens,
            temperature=temperature,
            prompt_version=prompt_version,
        )
        self.system = load_prompt("browser_planner_system", prompt_version)
        self.template = string.Template(load_prompt("browser_planner", prompt_version))
        self.max_snapshot_chars = max_snapshot_chars

    async def aplan(
        self,
        entries: Sequence[ChecklistEntry],
        snapshot: Any,
        on_page: Callable[[Target], Awaitable[bool]],
    ) -> tuple[dict[str, tuple], list[str]]:
        """``({item id: (actions, expect)}, rejection reasons)``; ``{}`` on fallback."""
        ids = [e.id for e in entries]
        env = _envelope()
        page = f"title: {snapshot.title}\n{snapshot.aria[: self.max_snapshot_chars]}"
        user = self.template.safe_substitute(
            items="\n".join(f"- {e.id}: {e.description}" for e in entries),
            snapshot=env.wrap(page, "page snapshot"),
            ids=", ".join(ids),
            nonce=env.nonce,
        )

        async def validate(obj: dict):
            items = obj.get("items")
            if not isinstance(items, list):
                raise OutputRejected("field 'items' must be a list")
            out: dict[str, tuple] = {}
            for k, raw in enumerate(items):
                where = f"items[{k}]"
                item = parse_item(raw, where, require_expect=True)
                if item.id not in ids:
                    raise OutputRejected(f"{where}.id: {item.id!r} was not asked for ({ids})")
                if item.id in out:
                    raise OutputRejected(f"{where}.id: {item.id!r} planned twice")
                targets = [a.target for a in item.actions if a.target is not None]
                targets += [e.target for e in item.expect if e.target is not None]
                for t in targets:
                    if not await on_page(t):
                        raise OutputRejected(
                            f"{where}: target {t.selector()} is not on the page snapshot"
                        )
                out[item.id] = (item.actions, item.expect)
            missing = [i for i in ids if i not in out]
            if missing:
                raise OutputRejected(f"items {missing} have no plan")
            return out

        result, reasons = await self._ask(self.system, user, validate)
        return (result or {}), reasons


class BrowserLLMJudge(_Asker):
    """Judges items from recorded frames; a pass must quote its frame's runtime text."""

    def __init__(
        self,
        client,
        *,
        max_attempts: int = 2,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        prompt_version: str = PROMPT_VERSION,
        max_frame_chars: int = 1500,
        max_source_chars: int = 3000,
    ):
        super().__init__(
            client,
            max_attempts=max_attempts,
            max_tokens=max_tokens,
            temperature=temperature,
            prompt_version=prompt_version,
        )
        self.system = load_prompt("browser_judge_system", prompt_version)
        self.template = string.Template(load_prompt("browser_judge", prompt_version))
        self.max_frame_chars = int(max_frame_chars)
        self.max_source_chars = int(max_source_chars)

    async def ajudge(self, checklist, results, frames, source: str):
        """(merged ``ItemResult`` list, detail); on fallback the rule results stand."""
        by_id = {r.id: r for r in results}
        ids = list(checklist.ids)
        env = _envelope()
        items_text = []
        for e in checklist.entries:
            r = by_id[e.id]
            rule = "not checked" if r.passed is None else ("PASS" if r.passed else "FAIL")
            ev = _inline(env, str(r.evidence), "rule evidence")
            items_text.append(f"- {e.id}: {e.description} (rule checks: {rule}; {ev})")
        frames_text = "\n".join(
            f"[frame {f.index}] item={f.item_id} after: "
            f"{env.escape(str(f.step)).replace(chr(10), chr(92) + 'n')}\n"
            + env.wrap(f.aria, f"frame {f.index}")
            for f in frames
        )
        user = self.template.safe_substitute(
            items="\n".join(items_text),
            frames=frames_text,
            source=env.wrap(source[: self.max_source_chars], "page source"),
            ids=", ".join(ids),
            nonce=env.nonce,
        )

        async def validate(obj: dict):
            items = obj.get("items")
            if not isinstance(items, list):
                raise OutputRejected("field 'items' must be a list")
            out = {}
            for k, raw in enumerate(items):
                where = f"items[{k}]"
                if not isinstance(raw, dict):
                    raise OutputRejected(f"{where}: expected an object")
                iid, ok, frame = raw.get("id"), raw.get("pass"), raw.get("frame")
                if iid not in ids or iid in out:
                    raise OutputRejected(f"{where}.id: {iid!r} unknown or repeated (ids: {ids})")
                if not isinstance(ok, bool):
                    raise OutputRejected(f"{where}.pass: expected true or false")
                if not isinstance(frame, int) or isinstance(frame, bool):
                    raise OutputRejected(f"{where}.frame: expected a frame index")
                if not 0 <= frame < len(frames):
                    raise OutputRejected(f"{where}.frame: {frame} not in [0, {len(frames)})")
                quote = raw.get("quote") or ""
                if ok:
                    if not isinstance(quote, str) or len(quote.strip()) < MIN_QUOTE_CHARS:
                        raise OutputRejected(f"{where}.quote: a pass needs a quote of the frame")
                    q, aria = quote.strip(), frames[frame].aria
                    if q not in aria and q not in env.escape(aria):  # as shown, or as it is
                        raise OutputRejected(
                            f"{where}.quote: {quote[:60]!r} is not in frame {frame}'s page text"
                        )
                out[iid] = (ok, frame, str(quote)[:200])
            missing = [i for i in ids if i not in out]
            if missing:
                raise OutputRejected(f"items {missing} are not judged")
            return out

        judged, reasons = await self._ask(self.system, user, validate)
        if judged is None:
            return list(results), "llm judge fallback (rule results kept): " + "; ".join(
                reasons[-2:]
            )
        merged = []
        for r in results:
            ok, frame, quote = judged[r.id]
            if r.passed is None:
                passed, ev = ok, f"llm: {'pass' if ok else 'fail'} at frame {frame}: {quote}"
            else:
                passed = r.passed and ok  # the LLM may veto a rule pass, never lift a failure
                ev = r.evidence if ok or not r.passed else f"llm veto at frame {frame}"
            merged.append(
                dataclasses.replace(
                    r,
                    passed=passed,
                    frame=frame if r.passed is None else r.frame,
                    evidence=ev,
                    judged_by="rules+llm" if r.passed is not None else "llm",
                )
            )
        return merged, ""


class ScriptedBrowserPolicy:
    """A deterministic chat policy for the LLM stages (tests; not a mock of a server).

    It reads only the conversation: the planner prompt's snapshot and ids, the judge prompt's
    frames. ``mode``: ``"good"``; ``"garbage_first"`` (an unparseable first answer, then good);
    ``"garbage"`` (never JSON); ``"hallucinate"`` (plans a target that is not on the page);
    ``"ungrounded"`` (judge: passes everything quoting text that no frame shows).
    Planner: for an item whose description mentions a word, it fills the page's first textbox
    with that quoted word, clicks the first button, and expects the word to be visible.
    """

    def __init__(self, mode: str = "good"):
        self.mode = mode
        self.calls = 0

    def chat_completions(self, messages, *, tools=None, max_tokens=1024, temperature=0.0):
        self.calls += 1
        user = messages[1]["content"]
        if self.mode == "garbage" or (self.mode == "garbage_first" and len(messages) == 2):
            return _reply("I think the page looks fine!")
        if "ACTION PLAN" in user:
            return _reply(json.dumps(self._plan(user)))
        return _reply(json.dumps(self._judge(user)))

    def _plan(self, user: str) -> dict:
        snap = user.split("SNAPSHOT:", 1)[1]
        box = re.search(r'- textbox "([^"]+)"', snap)
        btn = re.search(r'- button "([^"]+)"', snap)
        items = []
        for m in re.finditer(r'^- ([A-Za-z0-9_.-]+): .*?"([^"]+)"', user, re.MULTILINE):
            iid, word = m.group(1), m.group(2)
            button = "Launch the rocket" if self.mode == "hallucinate" else btn.group(1)
            items.append(
                {
                    "id": iid,
                    "actions": [
                        {"fill": {"role": "textbox", "name": box.group(1)}, "text": word},
                        {"click": {"role": "button", "name": button}},
                    ],
                    "expect": [{"text_visible": word}],
                }
            )
        return {"items": items}

    def _judge(self, user: str) -> dict:
        frames = re.findall(r"^\[frame (\d+)\] item=(\S+) after: (.*)$", user, re.MULTILINE)
        last = {}
        for idx, item, step in frames:
            if step == "check":
                last[item] = int(idx)
        out = []
        for m in re.finditer(r"^- ([A-Za-z0-9_.-]+): .*\(rule checks: (\w+)", user, re.MULTILINE):
            iid, rule = m.group(1), m.group(2)
            f = last.get(iid, 0)
            section = user.split("Frames:", 1)[1].split("\nSource (", 1)[0]
            body = section.split(f"[frame {f}]", 1)[1].split("\n[frame ", 1)[0]
            text = [
                ln.strip()
                for ln in body.splitlines()[1:]
                if len(ln.strip()) >= 3 and not ln.startswith(("<untrusted-", "</untrusted-"))
            ]  # the delimiters
            if self.mode == "ungrounded":
                out.append({"id": iid, "pass": True, "frame": f, "quote": "everything works"})
            else:
                ok = rule != "FAIL" and bool(text)
                out.append({"id": iid, "pass": ok, "frame": f, "quote": text[-1] if ok else ""})
        return {"items": out}


def _reply(content: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
