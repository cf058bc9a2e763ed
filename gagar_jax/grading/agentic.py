"""The agentic grader: an LLM reviews a group in a tool loop and returns a validated verdict.

Following Gagar (and Agent-as-a-Judge), the grader is not a single scoring call. It gets a shared
workspace per group (task, repository snapshot, every candidate's turn summaries, trajectory,
patch and test log; failed candidates as background) and tools to gather evidence:

==================  ===========================================================================
tool                returns
==================  ===========================================================================
read_summaries      every candidate: status, patch size and files, turns/tokens, summary, flags
read_trajectory     events ``[start, end)`` of one candidate's trajectory, with their indices
read_file           numbered lines of a repository file (the snapshot before any patch)
show_diff           one candidate's unified diff (optionally one file of it)
read_test_log       one candidate's test output
run_check           a targeted check on one candidate through a ``CheckRunner`` (sandboxed)
submit_verdict      the final verdict (validated; a rejection is reported back while steps last)
==================  ===========================================================================

Candidates are anonymised (``C1``, ``C2``, ...) and shuffled per group and vote (seeded), so
neither the rollout order nor ids leak into the judgement. The shuffle starts from a canonical
order (by a hash of each candidate's patch, outcome and test log; ``canonical_order``), not the
group's: the same group in any slot order gives the model the same prompt, so the grader's
position bias cannot turn a permutation into a different verdict (with deterministic sampling
the verdict is then permutation-invariant by construction); the verdict is mapped back to the
real ids and validated against the real workspace (``schema.validate``), with the outputs of the
checks the grader ran counted as execution evidence.

Budgets: ``max_steps`` model calls and ``time_budget_s`` seconds per vote; the pool's cancel event
is checked before each call. The time a ``run_check`` spends running a candidate's code is not
the grader's: it is not charged to ``time_budget_s`` but to a budget of its own,
``check_budget_s`` per vote, and each check runs at most what is left of it (a runner that takes
``time_limit_s`` is held to it; a later check once it is spent answers that it is, unrun). A
candidate whose code stalls its check therefore costs the vote at most ``check_budget_s``
seconds and never the group's verdict. A model that never produces a valid verdict (e.g. a
tiny random model) ends in ``VerdictRejected`` with the last rejection's reason
(``malformed_output`` for text with no verdict) or ``budget_exhausted``; the pool turns it into
a counted fallback. A client error (server down after its retries) propagates and becomes
``grader_error``.

Self-consistency: ``votes > 1`` runs independent episodes (each on its own shuffle of the
candidates; sampled at ``vote_temperature``, greedy by default) and merges the accepted ones:
majority tier per candidate (ties go to the worse tier), mean scores, majority cheat, union of
evidence, ranks by mean vote rank within tiers; ``agreement`` is the mean fraction of votes that
gave each candidate its majority tier. Fewer than ``min_votes`` accepted votes reject the group.

Untrusted content: every piece of candidate-produced text a tool returns (diffs, file paths,
test output, the verifier's notes that quote the candidate, trajectory events, summaries,
monitor evidence) is enclosed in per-episode random delimiters and escaped
(``untrusted.Envelope``); lines the candidate's code printed are marked ``| `` so they cannot
imitate the verifier's header; the system prompt (``prompts/v2``) says all of it is data. Diffs
are rendered from the candidate's applied patch (``grading.views``), never from its text.
One candidate whose material cannot be rendered (a patch that does not parse, binary text) shows
as an error line in its own entries; the rest of the group is graded as usual.

Any OpenAI-compatible endpoint works: the client only needs
``chat_completions(messages, *, tools, max_tokens, temperature) -> dict`` (``SGLangClient`` has
it; so does ``scripted.ScriptedGraderPolicy``, a deterministic policy used to test this loop).
Prompts are versioned files under ``prompts/<version>/``.

Compact prompts (``COMPACT_PROMPT_VERSIONS``, ``c1``): for small models with a short context.
No tool schemas are sent (``use_tools`` defaults to False for them) and the task message carries,
per candidate, what ``read_summaries``, ``show_diff`` and ``read_test_log`` would return, cut
short (``compact_details``): status, file and line counts and monitor flag rules outside the
envelope; the file paths (at most ``COMPACT_MAX_FILES``, then a count), the applied hunks'
changed lines (``views.changed_sections``: ``COMPACT_DIFF_CHARS`` in all, per file under a
header line, code files first, each file its own share) and the test output (last
``COMPACT_LOG_CHARS``) inside one untrusted envelope per passing candidate; a failed candidate is
one line. The task text is cut to ``COMPACT_TASK_CHARS``. The verdict
format, its validation and the voting are the same as for every other version; what a compact
prompt loses is everything a tool would have shown beyond the cut (context lines, hunk
positions, trajectories, the rest of a long diff or log) and the ability to run checks.

Constrained decoding (``constrain_answer``, on by default when the model answers in plain JSON,
as with the compact prompts): each call carries an OpenAI ``response_format`` with the vote's
verdict schema (``verdict_json_schema``: one item per passing alias, in alias order, tiers,
ranks, scores and evidence bounded to what the view holds), which SGLang enforces with
xgrammar. The schema only narrows what a model can write; the answer is parsed and validated
by ``schema.parse_verdict`` exactly as without it. An endpoint that refuses the field gets the
call again without it (counted, see ``AgenticGrader``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import importlib.resources
import inspect
import json
import random
import secrets
import string
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gagar_jax.grading import schema, views
from gagar_jax.grading.schema import (
    DIMENSIONS,
    Candidate,
    GroupWorkspace,
    Judgement,
    RejectReason,
    Verdict,
    VerdictRejected,
)
from gagar_jax.verify import diff, execution
from gagar_jax.verify.untrusted import Envelope, mark, sanitize

PROMPT_VERSION = "v2"
MAX_TOOL_OUTPUT_CHARS = 6000
COMPACT_PROMPT_VERSIONS = ("c1",)  # no tool schemas; the evidence is in the task message
COMPACT_DIFF_CHARS = 600
COMPACT_LOG_CHARS = 300
COMPACT_TASK_CHARS = 1000
COMPACT_MAX_FILES = 12  # paths a compact view lists per candidate (then a count)
# A summary's detail, most first: (files listed, flags listed, evidence chars, summary chars);
# ``read_summaries`` gives each candidate the first level that fits its share of the output.
SUMMARY_LEVELS = ((200, 40, 400, 800), (40, 20, 160, 300), (8, 12, 0, 120), (0, 6, 0, 0))


def load_prompt(name: str, version: str = PROMPT_VERSION) -> str:
    """The text of ``prompts/<version>/<name>.md`` (package data)."""
    res = importlib.resources.files("gagar_jax.grading") / "prompts" / version / f"{name}.md"
    if not res.is_file():
        raise FileNotFoundError(
            f"grading prompt {version}/{name}.md not found in gagar_jax.grading"
        )
    return res.read_text(encoding="utf-8")


def _group_content(workspace: GroupWorkspace) -> str:
    """The task and the candidates' content in canonical order: the same for any slot order."""
    return "\0".join(
        [workspace.task_text, *(_content_key(c)[0] for c in canonical_order(workspace.candidates))]
    )


class ChatClient(Protocol):
    def chat_completions(
        self, messages: list[dict], *, tools: list[dict] | None, max_tokens: int, temperature: float
    ) -> dict: ...


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """Outcome of a targeted check: ``status`` (passed|failed|timeout|error|unavailable) and log."""

    status: str
    log: str


class CheckRunner(Protocol):
    def run(self, workspace: GroupWorkspace, candidate: Candidate, command: str) -> CheckResult: ...


def _takes_time_limit(runner: Any) -> bool:
    """Whether ``runner.run`` accepts ``time_limit_s`` (the most seconds a check may run)."""
    try:
        params = inspect.signature(runner.run).parameters
    except (TypeError, ValueError):
        return False
    return "time_limit_s" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class NoCheckRunner:
    """The check runner when no sandbox is configured: says so (the grader continues without)."""

    def run(self, workspace: GroupWorkspace, candidate: Candidate, command: str) -> CheckResult:
        return CheckResult("unavailable", "targeted checks are not available for this task")


def _fn(name: str, description: str, properties: dict, required: Sequence[str] = ()) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


_CAND = {"type": "string", "description": "candidate id, e.g. C1"}
_VERDICT_ITEM = {
    "type": "object",
    "properties": {
        "candidate": {"type": "string"},
        "tier": {"type": "integer", "minimum": 1, "maximum": 3},
        "rank": {"type": "integer", "minimum": 1},
        "scores": {
            "type": "object",
            "properties": {d: {"type": "number", "minimum": 0, "maximum": 1} for d in DIMENSIONS},
            "required": list(DIMENSIONS),
        },
        "cheat": {"type": "boolean"},
        "cheat_reason": {"type": "string"},
        "evidence": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "claim": {"type": "string", "enum": list(schema.CLAIMS)},
                    "kind": {"type": "string", "enum": list(schema.EVIDENCE_KINDS)},
                    "candidate": {"type": "string"},
                    "file": {"type": "string"},
                    "line": {"type": "integer"},
                    "event": {"type": "integer"},
                    "quote": {"type": "string"},
                    "note": {"type": "string"},
                },
                "required": ["claim", "kind"],
            },
        },
    },
    "required": ["candidate", "tier", "rank", "scores", "cheat", "evidence"],
}

TOOLS = [
    _fn(
        "read_summaries", "Every candidate: status, patch size, turns, tokens, summary, flags.", {}
    ),
    _fn(
        "read_trajectory",
        "Events [start, end) of one candidate's trajectory (at most 20), with event indices.",
        {"candidate": _CAND, "start": {"type": "integer"}, "end": {"type": "integer"}},
        ["candidate"],
    ),
    _fn(
        "read_file",
        "Numbered lines [start_line, end_line] of a repository file before any patch.",
        {
            "path": {"type": "string"},
            "start_line": {"type": "integer"},
            "end_line": {"type": "integer"},
        },
        ["path"],
    ),
    _fn(
        "show_diff",
        "One candidate's unified diff, optionally only one file of it.",
        {"candidate": _CAND, "file": {"type": "string"}},
        ["candidate"],
    ),
    _fn("read_test_log", "One candidate's test output.", {"candidate": _CAND}, ["candidate"]),
    _fn(
        "run_check",
        "Run a targeted check (a command) against one candidate's patched repository.",
        {"candidate": _CAND, "command": {"type": "string"}},
        ["candidate", "command"],
    ),
    _fn(
        "submit_verdict",
        "Submit the final verdict: one item per passing candidate.",
        {"verdicts": {"type": "array", "items": _VERDICT_ITEM}},
        ["verdicts"],
    ),
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


def _clip(text: str, limit: int = MAX_TOOL_OUTPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} chars cut]"


def _content_key(c: Candidate) -> tuple[str, str]:
    blob = "\0".join((c.patch, str(bool(c.passed)), c.test_log, c.summary))
    return hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest(), c.candidate_id


def canonical_order(candidates) -> list[Candidate]:
    """``candidates`` sorted by content (patch, pass/fail, test log, summary), ids breaking
    exact ties: independent of the order the group arrived in."""
    return sorted(candidates, key=_content_key)


class AnonymisedView:
    """A workspace as the model sees it: aliases ``C1..Cn`` in a seeded shuffled order."""

    def __init__(self, workspace: GroupWorkspace, seed: int, envelope: Envelope | None = None):
        self.workspace = workspace
        self.envelope = envelope or Envelope()
        order = canonical_order(workspace.candidates)
        random.Random(seed).shuffle(order)
        self.alias_of = {c.candidate_id: f"C{i + 1}" for i, c in enumerate(order)}
        self.real_of = {a: cid for cid, a in self.alias_of.items()}
        self.order = order
        self.check_logs: dict[str, list[str]] = collections.defaultdict(list)
        self.check_s = 0.0  # seconds this vote's checks ran (``AgenticGrader.check_budget_s``)

    def candidate(self, alias: Any) -> Candidate:
        cid = self.real_of.get(alias) if isinstance(alias, str) else None
        if cid is None:
            raise ValueError(f"unknown candidate {alias!r}; known: {sorted(self.real_of)}")
        return self.workspace.candidate(cid)

    def summaries(self, budget: int = MAX_TOOL_OUTPUT_CHARS) -> dict:
        """Every candidate's summary, each within its own share of ``budget`` characters (of
        the JSON the tool returns): a candidate that touched thousands of files or raised
        hundreds of flags is summarised more briefly (counts instead of lists, a note that
        entries were cut) and can never push a sibling out of the clipped output."""
        share = max(400, (budget - 40) // max(1, len(self.order)) - 40)
        return {"candidates": [self._summary_within(c, share) for c in self.order]}

    def _summary_within(self, c: Candidate, share: int) -> dict:
        for level in range(len(SUMMARY_LEVELS)):
            out = self._summary(c, level)
            if len(json.dumps(out, indent=1)) + 8 * 40 <= share or level == len(SUMMARY_LEVELS) - 1:
                return out
        raise AssertionError("unreachable")

    def _summary(self, c: Candidate, level: int = 0) -> dict:
        files_cap, flags_cap, evidence_chars, summary_chars = SUMMARY_LEVELS[level]
        alias = self.alias_of[c.candidate_id]
        env = self.envelope
        out: dict[str, Any] = {
            "candidate": alias,
            "status": "passed" if c.passed else "failed (background only)",
        }
        try:
            pp = c.parsed_patch
            listed = views.file_list(pp, files_cap)
            out["patch"] = {
                "files": env.wrap(listed, f"{alias} patch files") if listed else "",
                "num_files": len(pp.files),
                "added_lines": pp.num_added,
                "removed_lines": pp.num_removed,
                "hunks": pp.num_hunks,
            }
            if views.files_not_listed(pp, files_cap):
                out["patch"]["files_not_listed"] = views.files_not_listed(pp, files_cap)
        except Exception as e:  # noqa: BLE001 - this candidate's patch only
            out["patch"] = {"files": [], "error": f"patch not readable: {type(e).__name__}"}
        out["turns"] = c.num_turns
        out["tokens"] = c.num_tokens
        out["trajectory_events"] = len(c.trajectory)
        out["summary"] = (
            env.wrap(_clip(c.summary, summary_chars), f"{alias} summary")
            if c.summary and summary_chars
            else ""
        )
        flags = c.monitor_flags
        out["monitor_flags"] = [
            {
                "rule": sanitize(f.rule)[:64],
                **(
                    {"evidence": env.wrap(_clip(f.evidence, evidence_chars), f"{alias} evidence")}
                    if evidence_chars
                    else {}
                ),
                "confirmed": f.confirmed,
            }
            for f in flags[:flags_cap]
        ]
        if len(flags) > flags_cap:
            out["monitor_flags_not_listed"] = (
                f"{len(flags) - flags_cap} more flags, "
                f"{sum(f.confirmed for f in flags[flags_cap:])} of them confirmed"
            )
        return out

    def anonymise_text(self, text: str) -> str:
        for cid, alias in sorted(self.alias_of.items(), key=lambda kv: -len(kv[0])):
            if len(cid) >= 3:  # short ids ("a", "r1") would corrupt ordinary text
                text = text.replace(cid, alias)
        return text


@dataclasses.dataclass
class EpisodeStats:
    steps: int = 0
    tool_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bad_tool_calls: int = 0
    rejections: collections.Counter = dataclasses.field(default_factory=collections.Counter)


CONSTRAINED_MAX_FILES = 32  # patch files named per candidate in the schema (more: any string)
CONSTRAINED_MAX_QUOTES = 12  # test-log lines offered as execution quotes per candidate
CONSTRAINED_QUOTE_CHARS = 60
CONSTRAINED_REASON_CHARS = 80


def _quote_lines(c: Candidate) -> list[str]:
    """Lines of ``c``'s test log an execution quote may use: stripped, cut to
    ``CONSTRAINED_QUOTE_CHARS``, printable ASCII without quotes, backslashes or angle
    brackets (candidate text becomes schema literals: nothing that needs escaping, nothing
    like an envelope tag); the first and the last ``CONSTRAINED_MAX_QUOTES // 2`` of them."""
    lines = list(
        dict.fromkeys(
            q
            for q in (
                ln.strip()[:CONSTRAINED_QUOTE_CHARS].strip() for ln in c.test_log.splitlines()
            )
            if len(q) >= schema.MIN_QUOTE_CHARS
            and q.isascii()
            and q.isprintable()
            and not any(ch in q for ch in '"\\<>')
        )
    )
    half = CONSTRAINED_MAX_QUOTES // 2
    return lines if len(lines) <= 2 * half else lines[:half] + lines[-half:]


def verdict_json_schema(view: AnonymisedView) -> dict:
    """The JSON schema of a verdict for ``view`` (what constrained decoding lets a model write).

    Built from the anonymised view only, so a permuted group gets the same schema. One item per
    passing candidate, in alias order (``prefixItems``, no further items): the alias as a
    constant, ``tier`` in 1..3, ``rank`` in 1..n (n passing candidates), each score a number
    in [0, 1] (xgrammar bounds its digits), ``cheat`` a boolean, ``cheat_reason`` (1 to
    ``CONSTRAINED_REASON_CHARS`` characters) exactly when ``cheat`` is true, and at most
    ``len(CLAIMS)`` evidence items, at least one for a cheat, a tier 2 or 3 or a score below
    ``schema.NEGATIVE_SCORE`` (an item without evidence scores every dimension at least that),
    each either ``patch`` evidence naming a candidate (any alias) and one of the files its
    patch changes, or ``execution`` evidence quoting one of the lines of that candidate's test
    log (``_quote_lines``). Every object is closed (``additionalProperties: false``) and every
    string and array bounded, so a constrained answer ends (whitespace between tokens is the
    server's to bound: SGLang's ``--constrained-json-max-whitespace-cnt``).

    The schema narrows what can be generated; it validates nothing: the answer is parsed and
    checked by ``schema.parse_verdict`` like any other (tier/rank consistency, evidence for
    negative scores, locations). Every answer ``protocol_student.render_verdict`` writes for
    this view satisfies it.
    """
    passing = [view.alias_of[c.candidate_id] for c in view.order if c.passed]
    passing.sort(key=lambda a: int(a[1:]))
    claim = {"type": "string", "enum": list(schema.CLAIMS)}
    branches: list[dict] = []
    for c in view.order:
        alias = view.alias_of[c.candidate_id]
        try:
            files = list(c.parsed_patch.paths)
        except Exception:  # noqa: BLE001 - this candidate's patch only
            files = []
        if files:
            file = (
                {"type": "string", "enum": files}
                if len(files) <= CONSTRAINED_MAX_FILES
                else {"type": "string", "minLength": 1, "maxLength": 200}
            )
            branches.append(
                _closed(
                    {
                        "claim": claim,
                        "kind": {"const": "patch"},
                        "candidate": {"const": alias},
                        "file": file,
                    }
                )
            )
        quotes = _quote_lines(c)
        if quotes:
            branches.append(
                _closed(
                    {
                        "claim": claim,
                        "kind": {"const": "execution"},
                        "candidate": {"const": alias},
                        "quote": {"type": "string", "enum": quotes},
                    }
                )
            )
    score = {"type": "number", "minimum": 0, "maximum": 1}
    high = {"type": "number", "minimum": schema.NEGATIVE_SCORE, "maximum": 1}
    defs: dict = {
        "scores": _closed({d: score for d in DIMENSIONS}),
        "high_scores": _closed({d: high for d in DIMENSIONS}),
    }
    if branches:
        defs["evidence"] = {
            "type": "array",
            "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
            "maxItems": len(schema.CLAIMS),
        }
        defs["cited"] = defs["evidence"] | {"minItems": 1}
    else:  # nothing to cite: evidence can only be empty
        defs["evidence"] = {"type": "array", "maxItems": 0}
    n = len(passing)
    # Three rules of one item are in the schema (validation checks them again): a tier 2 or 3,
    # a cheat and a negative score cite evidence, and a cheat has a reason. Five variants of an
    # item: tier 1 without a cheat, either uncited with no negative score or cited; tier 1 with
    # a cheat; tier 2-3 with or without one (only the first when nothing can be cited). Which
    # claim the evidence makes is left to validation.
    variants = [
        (tiers, cheat, cited)
        for tiers in ([1], list(range(2, schema.NUM_TIERS + 1)))
        for cheat in (False, True)
        for cited in (False, True)
        if (cited or (tiers == [1] and not cheat)) and (branches or not cited)
    ]

    def item(alias: str, tiers: list[int], cheat: bool, cited: bool) -> dict:
        props: dict = {
            "candidate": {"const": alias},
            "tier": {"type": "integer", "enum": tiers},
            "rank": {"type": "integer", "enum": list(range(1, n + 1))},
            "scores": {"$ref": "#/$defs/scores" if cited else "#/$defs/high_scores"},
            "cheat": {"const": cheat},
        }
        if cheat:
            props["cheat_reason"] = {
                "type": "string",
                "minLength": 1,
                "maxLength": CONSTRAINED_REASON_CHARS,
            }
        props["evidence"] = {"$ref": "#/$defs/cited" if cited else "#/$defs/evidence"}
        return _closed(props)

    items = []
    for alias in passing:
        alts = [item(alias, tiers, cheat, cited) for tiers, cheat, cited in variants]
        items.append(alts[0] if len(alts) == 1 else {"anyOf": alts})
    verdicts: dict = {"type": "array", "minItems": n, "maxItems": n}
    if items:
        verdicts |= {"prefixItems": items, "items": False}
    return _closed({"verdicts": verdicts}) | {"$defs": defs}


def _closed(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def verdict_response_format(view: AnonymisedView) -> dict:
    """The OpenAI ``response_format`` that constrains an answer to ``verdict_json_schema``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": verdict_json_schema(view), "strict": True},
    }


class AgenticGrader:
    """LLM grader with a tool loop over an anonymised group workspace (see module docstring).

    Args:
      client: anything with ``chat_completions`` (``SGLangClient``, ``ScriptedGraderPolicy``).
      check_runner: runs ``run_check`` (default: ``NoCheckRunner``).
      max_steps: model calls per vote.
      time_budget_s: wall-clock budget per vote, the time ``run_check`` runs a candidate's code
        left out.
      check_budget_s: seconds of ``run_check`` per vote (None: ``time_budget_s``); each check
        runs at most what is left of it.
      max_tokens: per model call.
      temperature: sampling temperature of the first vote.
      votes: self-consistency votes (independent episodes).
      vote_temperature: temperature of votes after the first. 0 (the default): votes differ by
        their shuffles only, and since a shuffle starts from the candidates' content, a group is
        graded alike whatever its slot order (measured flip rate 0 on a real server). Above 0,
        votes also differ by chance, and a permuted group is graded alike only where the server
        honours ``seed_votes``.
      min_votes: accepted votes needed (default: a majority of ``votes``).
      seed: base seed of the anonymising shuffles.
      prompt_version: directory under ``prompts/``.
      use_tools: send the tool schemas (False: the model must answer with the verdict JSON);
        None: False for ``COMPACT_PROMPT_VERSIONS``, True otherwise.
      constrain_answer: send each call a ``response_format`` with the vote's verdict schema
        (``verdict_response_format``: constrained decoding on servers that support it, such as
        SGLang); None: on when the model answers in plain JSON (``use_tools`` False). Only
        without tools: a tool-calling reply is not one JSON object. A client or server that
        rejects the field (a ``TypeError`` naming it, or an HTTP 4xx) gets the same call
        again without it; when that one succeeds, this grader stops sending the schema
        (``metrics["constrain/rejected"]``). The answer is validated by ``parse_verdict``
        either way.
      rank_order: ``"strict"``: a vote whose ranks contradict its own tiers (a better tier
        ranked below a worse one) is rejected (``tier_rank_inconsistent``). ``"tier_first"``:
        its tiers are kept and its ranks renumbered in (tier, rank) order
        (``schema.order_ranks_by_tier``), counted in ``metrics["ranks_reordered"]``; every
        other rule still rejects. The order inside each tier is the vote's own, as the
        discount factors (which read ranks only within a tier) and the merge of votes (in
        (tier, mean rank) order) use it; the spacing of ranks inside a tier can change where
        the vote had interleaved another tier's candidates. What it gives up is the
        inconsistency as a sign of a careless vote.
      uncited_scores: ``"cite"``: a vote with a dimension scored below
        ``schema.NEGATIVE_SCORE`` and no evidence of that claim is rejected
        (``missing_evidence``). ``"drop_uncited"``: those scores are raised to the threshold
        (``schema.drop_uncited_scores``: a criticism nobody cited is not believed) and the vote
        is kept, counted in ``metrics["uncited_scores_dropped"]`` (one per vote). Tiers and
        ranks, which are all the advantage kernels read, are the vote's own; a cheat flag or a
        tier 2 or 3 still needs evidence.
        A vote is first validated under the strict rules; the relaxed policies are tried only
        when it is rejected, the ranks alone first, then the scores alone, then both.
      seed_votes: send each call an OpenAI ``seed`` (SGLang: the request's sampling seed)
        derived from ``seed``, the group's content in canonical order, the vote and the step:
        sampled votes stay diverse across votes but are a function of what is graded, so a
        group with its candidates in another order is sampled alike, up to the server's own
        numerical non-determinism (batching). Off by default because a chat client must
        accept the ``seed`` keyword.
    """

    grader_id = "agentic"

    def __init__(
        self,
        client: ChatClient,
        *,
        check_runner: CheckRunner | None = None,
        max_steps: int = 12,
        time_budget_s: float = 600.0,
        check_budget_s: float | None = None,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        votes: int = 1,
        vote_temperature: float = 0.0,
        min_votes: int | None = None,
        seed: int = 0,
        prompt_version: str = PROMPT_VERSION,
        use_tools: bool | None = None,
        constrain_answer: bool | None = None,
        rank_order: str = "strict",
        uncited_scores: str = "cite",
        seed_votes: bool = False,
    ):
        if max_steps < 1:
            raise ValueError(f"AgenticGrader.max_steps must be >= 1, got {max_steps}")
        if votes < 1:
            raise ValueError(f"AgenticGrader.votes must be >= 1, got {votes}")
        self.client = client
        self.check_runner = check_runner or NoCheckRunner()
        self.max_steps = max_steps
        self.time_budget_s = float(time_budget_s)
        check_budget_s = self.time_budget_s if check_budget_s is None else check_budget_s
        if not check_budget_s >= 0:
            raise ValueError(
                f"AgenticGrader.check_budget_s must be >= 0 seconds, got {check_budget_s!r}"
            )
        self.check_budget_s = float(check_budget_s)
        self._check_takes_limit = _takes_time_limit(self.check_runner)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.votes = votes
        self.vote_temperature = vote_temperature
        self.min_votes = min_votes if min_votes is not None else votes // 2 + 1
        if not 1 <= self.min_votes <= votes:
            raise ValueError(
                f"AgenticGrader.min_votes must be in 1..votes={votes}, got {min_votes}"
            )
        self.seed = seed
        self._nonce_key = secrets.token_bytes(16)
        self.prompt_version = prompt_version
        self.system_prompt = load_prompt("system", prompt_version)
        self.task_template = string.Template(load_prompt("task", prompt_version))
        if use_tools is None:
            use_tools = prompt_version not in COMPACT_PROMPT_VERSIONS
        self.use_tools = use_tools
        if constrain_answer is None:
            constrain_answer = not use_tools
        if constrain_answer and use_tools:
            raise ValueError("AgenticGrader.constrain_answer needs use_tools=False")
        self.constrain_answer = bool(constrain_answer)
        self._constrain = self.constrain_answer  # False once the endpoint rejected the schema
        if rank_order not in schema.RANK_POLICIES:
            raise ValueError(
                f"AgenticGrader.rank_order: expected one of {schema.RANK_POLICIES}, "
                f"got {rank_order!r}"
            )
        self.rank_order = rank_order
        if uncited_scores not in schema.SCORE_POLICIES:
            raise ValueError(
                f"AgenticGrader.uncited_scores: expected one of {schema.SCORE_POLICIES}, "
                f"got {uncited_scores!r}"
            )
        self.uncited_scores = uncited_scores
        self.seed_votes = bool(seed_votes)
        self.version = f"{prompt_version}"
        settings = (
            prompt_version,
            max_steps,
            self.time_budget_s,
            max_tokens,
            temperature,
            votes,
            vote_temperature,
            self.min_votes,
            seed,
            use_tools,
            *(("constrained",) if self.constrain_answer else ()),
            *(("ranks:" + rank_order,) if rank_order != "strict" else ()),
            *(("scores:" + uncited_scores,) if uncited_scores != "cite" else ()),
            *(("seeded",) if self.seed_votes else ()),
            *(
                (f"checks:{self.check_budget_s:g}",)
                if self.check_budget_s != self.time_budget_s
                else ()
            ),
            type(client).__name__,
            getattr(client, "base_url", ""),
            type(self.check_runner).__name__,
        )
        digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]
        self.cache_id = f"{self.grader_id}@{prompt_version}/{digest}"
        self._lock = threading.Lock()
        self.metrics: collections.Counter[str] = collections.Counter()

    # -- public ------------------------------------------------------------------------------

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        """Runs the votes and returns the (merged) validated verdict; raises VerdictRejected."""
        t0 = time.monotonic()
        accepted: list[Verdict] = []
        reasons: list[VerdictRejected] = []
        for vote in range(self.votes):
            if cancel is not None and cancel.is_set():
                break
            try:
                accepted.append(self._episode(workspace, vote, cancel))
            except VerdictRejected as e:
                reasons.append(e)
                self._count(f"rejected/{e.reason.value}")
        latency = time.monotonic() - t0
        if len(accepted) < self.min_votes:
            if reasons:
                worst = collections.Counter(e.reason for e in reasons).most_common(1)[0][0]
                detail = next(e.detail for e in reasons if e.reason == worst)
            else:
                worst, detail = RejectReason.BUDGET_EXHAUSTED, "cancelled before any vote finished"
            raise VerdictRejected(
                worst, f"{len(accepted)}/{self.votes} votes accepted (< {self.min_votes}): {detail}"
            )
        self._count("accepted")
        if len(accepted) == 1 and self.votes == 1:
            return dataclasses.replace(accepted[0], latency_s=latency)
        return merge_votes(accepted, workspace, latency_s=latency)

    # -- one episode -------------------------------------------------------------------------

    def episode_messages(
        self, workspace: GroupWorkspace, vote: int
    ) -> tuple[list[dict], AnonymisedView]:
        """The system and task messages vote ``vote`` starts from, and the anonymised view they
        show (the aliases): exactly what ``grade`` sends first (used to log and imitate it)."""
        seed = int.from_bytes(
            hashlib.sha256(f"{self.seed}/{workspace.group_id}/{vote}".encode()).digest()[:8], "big"
        )
        # The envelope's nonce: unpredictable (a per-grader secret), yet a function of the
        # group's content and the vote, so a permuted group gets the very same prompt.
        content = _group_content(workspace)
        nonce = hmac.new(self._nonce_key, f"{content}/{vote}".encode(), "sha256").hexdigest()[:16]
        view = AnonymisedView(workspace, seed, Envelope(nonce))
        messages: list[dict] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self._task_message(view)},
        ]
        return messages, view

    def call_seed(self, workspace: GroupWorkspace, vote: int, step: int) -> int | None:
        """The sampling seed of a vote's call (``seed_votes``; None when off): a function of the
        grader's ``seed``, the group's content in canonical order, the vote and the step."""
        if not self.seed_votes:
            return None
        key = f"{self.seed}/{_group_content(workspace)}/{vote}/{step}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % 2**31

    def _episode(
        self, workspace: GroupWorkspace, vote: int, cancel: threading.Event | None
    ) -> Verdict:
        messages, view = self.episode_messages(workspace, vote)
        temperature = self.temperature if vote == 0 else self.vote_temperature
        stats = EpisodeStats()
        deadline = time.monotonic() + self.time_budget_s
        last: VerdictRejected | None = None
        t0 = time.monotonic()
        while stats.steps < self.max_steps:
            if cancel is not None and cancel.is_set():
                raise VerdictRejected(RejectReason.BUDGET_EXHAUSTED, "cancelled by the pool")
            if time.monotonic() >= deadline + view.check_s:  # the checks' time is not the model's
                break
            stats.steps += 1
            self._count("steps")
            execution.llm_rate_limit()  # one limit for every grader of the cluster
            seed = self.call_seed(workspace, vote, stats.steps)
            response = self._call(messages, view, temperature, seed)
            message = _first_message(response)
            if message is None:
                last = VerdictRejected(
                    RejectReason.MALFORMED, "response without choices[0].message"
                )
                messages.append({"role": "user", "content": "Your last reply was empty. Continue."})
                continue
            content = message.get("content") or ""
            if not isinstance(content, str):
                content = str(content)
            raw_calls = message.get("tool_calls") or []
            if not isinstance(raw_calls, list):
                raw_calls = [raw_calls]
            decoded = [_decode_call(call, k) for k, call in enumerate(raw_calls)]
            good = [(name, args, cid) for name, args, cid, err in decoded if err is None]
            errors = [err for _, _, _, err in decoded if err is not None]
            # Echo only well-formed calls (re-encoded): a strict server rejects a conversation
            # whose tool messages answer calls it cannot parse.
            echoed = [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for name, args, cid in good
            ]
            messages.append(
                {
                    "role": "assistant",
                    "content": _clip(content, 4000),
                    **({"tool_calls": echoed} if echoed else {}),
                }
            )
            if errors:
                stats.bad_tool_calls += len(errors)
                self._count("bad_tool_calls", len(errors))
            if not raw_calls:
                try:
                    return self._accept(content, view, t0)
                except VerdictRejected as e:
                    last = e
                    stats.rejections[e.reason] += 1
                    messages.append({"role": "user", "content": self._feedback(e)})
                    continue
            for name, args, call_id in good:
                stats.tool_calls[name] += 1
                self._count(f"tool/{name}")
                if name == "submit_verdict":
                    try:
                        return self._accept(args, view, t0)
                    except VerdictRejected as e:
                        last = e
                        stats.rejections[e.reason] += 1
                        messages.append(_tool_msg(call_id, self._feedback(e)))
                        continue
                try:
                    out = self._run_tool(name, args, view)
                except Exception as e:  # noqa: BLE001 - a bad argument is reported to the model
                    stats.bad_tool_calls += 1
                    self._count("bad_tool_calls")
                    out = f"error: {type(e).__name__}: {sanitize(str(e))[:500]}"
                messages.append(_tool_msg(call_id, _clip_enveloped(out, view.envelope)))
            if errors:
                last = last or VerdictRejected(RejectReason.MALFORMED, "malformed tool calls")
                messages.append(
                    {"role": "user", "content": "Malformed tool calls: " + "; ".join(errors)}
                )
        if last is not None:
            raise VerdictRejected(
                last.reason, f"no valid verdict in {stats.steps} steps; last: {last.detail}"
            )
        raise VerdictRejected(
            RejectReason.BUDGET_EXHAUSTED,
            f"no verdict within {stats.steps} steps / {self.time_budget_s} s",
        )

    def _call(
        self,
        messages: list[dict],
        view: AnonymisedView,
        temperature: float,
        seed: int | None = None,
    ) -> Any:
        kwargs = dict(
            tools=TOOLS if self.use_tools else None,
            max_tokens=self.max_tokens,
            temperature=temperature,
            **({"seed": seed} if seed is not None else {}),
        )
        if not self._constrain:
            return self.client.chat_completions(messages, **kwargs)
        self._count("constrain/calls")
        try:
            return self.client.chat_completions(
                messages, response_format=verdict_response_format(view), **kwargs
            )
        except Exception as e:
            if not _rejects_response_format(e):
                raise
            first = e
        # The endpoint refused the schema: the same call without it. Only when that succeeds
        # is the schema dropped for good (a 4xx for another reason fails again and is raised).
        try:
            response = self.client.chat_completions(messages, **kwargs)
        except Exception as e:
            raise e from first
        self._constrain = False
        self._count("constrain/rejected")
        return response

    def _accept(self, output: str | Mapping, view: AnonymisedView, t0: float) -> Verdict:
        # Vote metadata is the grader's to report, never the model's.
        if isinstance(output, Mapping):
            output = {k: v for k, v in output.items() if k not in ("votes", "agreement")}

        def parse(ranks: str, scores: str) -> Verdict:
            return schema.parse_verdict(
                output,
                view.workspace,
                grader_id=self.grader_id,
                grader_version=self.version,
                latency_s=time.monotonic() - t0,
                check_logs=view.check_logs,
                id_map=view.real_of,
                ranks=ranks,
                scores=scores,
            )

        # The strict rules first; then each configured relaxation alone, then both.
        policies = [("strict", "cite")]
        if self.rank_order != "strict":
            policies.append((self.rank_order, "cite"))
        if self.uncited_scores != "cite":
            policies.append(("strict", self.uncited_scores))
            if self.rank_order != "strict":
                policies.append((self.rank_order, self.uncited_scores))
        for i, (ranks, scores) in enumerate(policies):
            try:
                v = parse(ranks, scores)
                break
            except VerdictRejected:
                if i == len(policies) - 1:
                    raise  # the most relaxed policy's reason
        if ranks != "strict":
            self._count("ranks_reordered")
        if scores != "cite":
            self._count("uncited_scores_dropped")
        return dataclasses.replace(v, votes=1, agreement=None)

    @staticmethod
    def _feedback(e: VerdictRejected) -> str:
        return (
            f"Verdict rejected ({e.reason.value}): {e.detail}. Fix it and call submit_verdict "
            "again with the complete verdict."
        )

    def _task_message(self, view: AnonymisedView) -> str:
        passing = [view.alias_of[c.candidate_id] for c in view.order if c.passed]
        lines = []
        for c in view.order:
            pp = c.parsed_patch
            status = "PASSED" if c.passed else "failed (background)"
            lines.append(
                f"- {view.alias_of[c.candidate_id]}: {status}; {len(pp.files)} file(s), "
                f"+{pp.num_added}/-{pp.num_removed} lines"
            )
        example = {
            "verdicts": [
                {
                    "candidate": passing[0] if passing else "C1",
                    "tier": 2,
                    "rank": 1,
                    "scores": {d: 0.8 for d in DIMENSIONS} | {"minimality": 0.4},
                    "cheat": False,
                    "cheat_reason": "",
                    "evidence": [
                        {
                            "claim": "minimality",
                            "kind": "patch",
                            "candidate": passing[0] if passing else "C1",
                            "file": "path/to/file.py",
                            "line": 12,
                            "note": "reformats an unrelated function",
                        }
                    ],
                }
            ]
        }
        task = view.anonymise_text(view.workspace.task_text)
        compact = "$details" in self.task_template.template
        return self.task_template.substitute(
            task=_clip(task, COMPACT_TASK_CHARS) if compact else task,
            details=compact_details(view) if compact else "",
            candidates="\n".join(lines),
            max_steps=self.max_steps,
            passing=", ".join(passing) or "none",
            verdict_example=json.dumps(example, indent=2),
            nonce=view.envelope.nonce,
        )

    def _run_tool(self, name: str, args: Mapping[str, Any], view: AnonymisedView) -> str:
        ws = view.workspace
        if name == "read_summaries":
            return view.anonymise_text(json.dumps(view.summaries(), indent=1))
        if name == "read_trajectory":
            c = view.candidate(args.get("candidate"))
            start = max(0, int(args.get("start", 0)))
            end = min(len(c.trajectory), int(args.get("end", start + 20)), start + 20)
            events = [
                {
                    "event": i,
                    "turn": e.turn,
                    "kind": e.kind,
                    "tokens": e.tokens,
                    "text": view.envelope.wrap(
                        view.anonymise_text(_clip(e.text, 600)),
                        f"{args['candidate']} event {i}",
                    ),
                }
                for i, e in enumerate(c.trajectory[start:end], start=start)
            ]
            return json.dumps(
                {"candidate": args["candidate"], "of": len(c.trajectory), "events": events},
                indent=1,
            )
        if name == "read_file":
            path = args.get("path")
            if path not in ws.repo_files:
                raise ValueError(f"no file {path!r} in the repository snapshot")
            lines = ws.repo_files[path].splitlines()
            start = max(1, int(args.get("start_line", 1)))
            end = min(len(lines), int(args.get("end_line", start + 199)), start + 199)
            return "\n".join(f"{n:5d}  {lines[n - 1]}" for n in range(start, end + 1)) or "(empty)"
        if name == "show_diff":
            c = view.candidate(args.get("candidate"))
            file = args.get("file") or None
            try:  # the patch as it applied, rendered (never the text the policy wrote)
                patch = views.patch_text(c.parsed_patch, file)
            except KeyError:
                raise ValueError(
                    f"candidate {args['candidate']} does not touch that file (read_summaries "
                    "lists the files it touches)"
                ) from None
            if not patch:
                return "(empty patch)"
            return view.envelope.wrap(
                _clip(patch, MAX_TOOL_OUTPUT_CHARS - 200), f"{args['candidate']} diff"
            )
        if name == "read_test_log":
            c = view.candidate(args.get("candidate"))
            if not c.test_log:
                return "(no test output)"
            return views.verifier_log(
                view.envelope,
                _clip(c.test_log, MAX_TOOL_OUTPUT_CHARS - 400),
                f"{args['candidate']} test output",
                c.verdict_lines,
            )
        if name == "run_check":
            c = view.candidate(args.get("candidate"))
            command = args.get("command")
            if not isinstance(command, str) or not command.strip():
                raise ValueError("run_check needs a non-empty 'command'")
            left = self.check_budget_s - view.check_s
            if left <= 0:
                return (
                    f"check status: unavailable\nthis vote's check budget "
                    f"({self.check_budget_s:g} s) is spent; grade with the evidence you have"
                )
            t0 = time.monotonic()
            try:
                if self._check_takes_limit:
                    res = self.check_runner.run(ws, c, command, time_limit_s=left)
                else:
                    res = self.check_runner.run(ws, c, command)
            finally:
                view.check_s += time.monotonic() - t0
            log = _clip(res.log, 4000)
            if res.status != "unavailable":
                view.check_logs[c.candidate_id].append(log)
            wrapped = view.envelope.wrap(log, f"{args['candidate']} check output", marked=True)
            return f"check status: {res.status}\n{wrapped}"
        raise ValueError(f"unknown tool {name!r}; tools: {TOOL_NAMES}")

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.metrics[key] += n


def compact_details(view: AnonymisedView) -> str:
    """The candidates as a compact prompt shows them (see the module docstring), in the view's
    order: a header line per candidate (alias, status, files, line counts, monitor flag rules)
    and, for a passing one, its changed diff lines and the tail of its test output in one
    untrusted envelope."""
    blocks = []
    for c in view.order:
        alias = view.alias_of[c.candidate_id]
        try:
            pp = c.parsed_patch
            files = f"{len(pp.files)} file(s)"
            size = f"+{pp.num_added}/-{pp.num_removed}"
        except Exception as e:  # noqa: BLE001 - this candidate's patch only
            pp, files, size = diff.Patch(), f"patch not readable: {type(e).__name__}", "?"
        if not c.passed:
            blocks.append(f"{alias} failed (background): {files} {size}")
            continue
        flags = "; ".join(
            dict.fromkeys(
                sanitize(f.rule)[:64] + (" (confirmed)" if f.confirmed else "")
                for f in c.monitor_flags[:40]
            )
        )
        # The applied hunks' lines, nothing split from text: per file, code first, each file
        # its own share.
        changed = views.changed_sections(pp, COMPACT_DIFF_CHARS)
        log = c.test_log.strip()
        if len(log) > COMPACT_LOG_CHARS:
            log = "[...] " + log[-COMPACT_LOG_CHARS:]
        more = views.files_not_listed(pp, COMPACT_MAX_FILES)
        body = (
            f"files:\n{views.file_list(pp, COMPACT_MAX_FILES)}\n"
            + (f"{more}\n" if more else "")
            + f"changes:\n{changed}\ntest output:\n"
            f"{mark(log) if log else '(none)'}"
        )
        blocks.append(
            f"{alias} PASSED: {files} {size}; monitor flags: {flags or 'none'}\n"
            + view.envelope.wrap(view.anonymise_text(body), f"{alias}")
        )
    return "\n".join(blocks)


def _clip_enveloped(text: str, envelope: Envelope, limit: int = MAX_TOOL_OUTPUT_CHARS) -> str:
    """``_clip`` that never leaves an envelope open (a cut inside one closes it)."""
    out = _clip(text, limit)
    if out.count(envelope.open_prefix) > out.count(envelope.close):
        out += "\n" + envelope.close
    return out


def _rejects_response_format(e: BaseException) -> bool:
    """Whether ``e`` may mean the client or endpoint does not take ``response_format``: a
    Python client without the keyword, or a server answering 4xx (``SGLangRequestError``)."""
    if isinstance(e, TypeError):
        return "response_format" in str(e)
    from gagar_jax.rollout.sglang_client import SGLangRequestError

    return isinstance(e, SGLangRequestError)


def _first_message(response: Any) -> dict | None:
    try:
        msg = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    return msg if isinstance(msg, dict) else None


def _tool_msg(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _decode_call(call: Any, k: int) -> tuple[str, dict, str, str | None]:
    """(name, arguments, id, error) of one OpenAI tool call."""
    call_id = f"call_{k}"
    if not isinstance(call, dict):
        return "", {}, call_id, "tool call is not an object"
    call_id = str(call.get("id") or call_id)
    fn = call.get("function")
    if not isinstance(fn, dict):
        return "", {}, call_id, "tool call without 'function'"
    name = fn.get("name")
    if name not in TOOL_NAMES:
        return "", {}, call_id, f"unknown tool {name!r}; tools: {TOOL_NAMES}"
    raw = fn.get("arguments") or "{}"
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        return name, {}, call_id, f"arguments are not JSON: {e}"
    if not isinstance(args, dict):
        return name, {}, call_id, "arguments must be a JSON object"
    return name, args, call_id, None


def merge_votes(
    verdicts: Sequence[Verdict], workspace: GroupWorkspace, *, latency_s: float
) -> Verdict:
    """Merges accepted votes (see module docstring) into one validated verdict."""
    ids = [j.candidate_id for j in verdicts[0].judgements]
    by = {cid: [v.judgement(cid) for v in verdicts] for cid in ids}
    tiers, agreement, merged = {}, [], {}
    for cid, js in by.items():
        counts = collections.Counter(j.tier for j in js)
        top = max(counts.values())
        tiers[cid] = max(t for t, n in counts.items() if n == top)  # ties: the worse tier
        agreement.append(counts[tiers[cid]] / len(js))
    for cid, js in by.items():
        scores = {d: sum(float(j.scores[d]) for j in js) / len(js) for d in DIMENSIONS}
        cheats = [j for j in js if j.cheat]
        cheat = 2 * len(cheats) > len(js)
        evidence = tuple(dict.fromkeys(e for j in js for e in j.evidence))
        merged[cid] = Judgement(
            cid,
            tiers[cid],
            1,
            scores,
            cheat,
            "; ".join(dict.fromkeys(j.cheat_reason for j in cheats)) if cheat else "",
            evidence,
        )
    mean_rank = {cid: sum(j.rank for j in js) / len(js) for cid, js in by.items()}
    keys = sorted({(tiers[c], round(mean_rank[c], 6)) for c in ids})
    rank_of = {k: i + 1 for i, k in enumerate(keys)}
    judgements = tuple(
        dataclasses.replace(merged[c], rank=rank_of[(tiers[c], round(mean_rank[c], 6))])
        for c in ids
    )
    v = Verdict(
        workspace.group_id,
        judgements,
        verdicts[0].grader_id,
        verdicts[0].grader_version,
        latency_s=latency_s,
        votes=len(verdicts),
        agreement=sum(agreement) / len(agreement) if agreement else 1.0,
    )
    # Scores are means: a dimension can fall below the evidence threshold with evidence from the
    # votes that scored it low; validation checks that the union carries it.
    return schema.validate(v, workspace)
