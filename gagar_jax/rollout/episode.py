"""Multi-turn agent episodes: model turns alternate with environment observations.

One episode is a single token sequence

    [prompt][model turn 1][observation 1][model turn 2][observation 2] ... [model turn n]

with a `response_mask` that is 1 exactly on the tokens the policy generated (so only they enter the
loss) and 0 on the prompt and on every observation token, the behaviour log-probability of every
model token (0 elsewhere), the token span of each turn, and a one-line summary per turn that the
grader reads. Model tokens are appended exactly as generated, never re-tokenised from text, so the
log-probabilities stay aligned with the tokens the update scores.

The environment sees text. `ToolEnvironment.step(text)` gets the decoded model turn and answers an
observation; `CodeAgentEnv` is the code-agent one: a parsed tool call (`read_file`, `edit`,
`run_tests`, `submit`) against an in-memory repository, with tests run by an injected runner (the
sandboxed verifier in `gagar_jax.verify`). The tool-call syntax is pluggable (`parse_action`); the
default is the Hermes/Qwen style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and a
plain fallback `name arg1 arg2` on the first line.

`run_episodes` advances all live episodes together: each turn is one batched `engine.generate` call,
so the embedded sampler or an SGLang server sees a batch, not a loop of single requests.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import posixpath
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from gagar_jax.rollout.types import RolloutEngine, SamplingParams


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: str
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class ToolEnvironment(Protocol):
    """An episode's environment: ``step`` takes the model's turn as text and answers with the
    observation and whether the episode is done (a task family builds one per rollout)."""

    def step(self, action_text: str) -> StepResult: ...


@dataclasses.dataclass
class Turn:
    """One model turn and the observation that answered it (token spans are [start, end))."""

    index: int
    model_span: tuple[int, int]
    observation_span: tuple[int, int]
    finish_reason: str
    action_text: str
    observation: str
    summary: str
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Episode:
    """A finished multi-turn rollout.

    Attributes:
      tokens: [T] prompt + all turns + observations.
      response_mask: [T] 1 on model-generated tokens, 0 on prompt and observation tokens.
      logprobs: [T] behaviour log-probability on model tokens, 0.0 elsewhere.
      prompt_len: number of prompt tokens at the front.
      turns: per-turn spans, texts and summaries.
      finish_reason: "submitted" (env said done), "max_turns", "max_tokens" (episode budget spent),
        "abort" (the engine gave up on a turn).
      policy_versions: the policy version of each model turn (a turn sampled in chunks across a
        weight sync: the version it began with).
      token_versions: [T] the policy version that produced each model token (-1 on the prompt
        and observations): one per turn, several when a weight sync fell between turns or
        between two chunks of a turn.
      info: the environment's final info (e.g. the patch and test results after submit).
      routes: an engine that records mixture-of-experts routes (``Sample.routes``):
        ``[T, layers, K]`` int16, the experts each token was first routed to (a model token:
        the decode step that fed it back; a prompt or observation token: the prefill of the
        first call that held it), -1 where none was recorded (an observation after the last
        turn); None when the engine records none.
    """

    tokens: list[int]
    response_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    turns: list[Turn]
    finish_reason: str
    policy_versions: list[int]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    routes: Any = None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)

    def summaries(self) -> list[str]:
        return [t.summary for t in self.turns]

    def trajectory(self) -> list[dict[str, Any]]:
        """Grader-readable events: one per turn, with the action, observation and summary."""
        return [
            {
                "turn": t.index,
                "action": t.action_text,
                "observation": t.observation,
                "summary": t.summary,
                **{k: v for k, v in t.info.items() if k != "files"},
            }
            for t in self.turns
        ]


# ---------------------------------------------------------------------------- actions

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _carriable_path(path: str) -> bool:
    """Whether a unified diff can name ``path``: relative, normalised, no ``..`` or ``.git``,
    no backslash or control character (a newline would split the patch's header)."""
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or any(c < " " or c == "\x7f" for c in path)
    ):
        return False
    parts = path.split("/")
    return posixpath.normpath(path) == path and ".." not in parts and ".git" not in parts


def parse_action(text: str) -> ToolCall | None:
    """Parses a tool call: `<tool_call>{json}</tool_call>` or a first line `name arg ...`."""
    m = _TOOL_CALL_RE.search(text)
    if m:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if isinstance(args, dict):
                return ToolCall(obj["name"], args)
        return None
    stripped = text.lstrip()
    if not stripped.strip():
        return None
    first, _, rest = stripped.partition("\n")
    words = first.split()
    name = words[0]
    if name == "read_file" and len(words) == 2:
        return ToolCall("read_file", {"path": words[1]})
    if name == "edit" and len(words) == 2:  # edit PATH\n<new content>
        return ToolCall("edit", {"path": words[1], "content": rest})
    if name in ("run_tests", "submit") and len(words) == 1:
        return ToolCall(name, {})
    return None


def _short(text: str, n: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= n else line[: n - 3] + "..."


class CodeAgentEnv:
    """A code-agent environment over an in-memory repository.

    Tools: `read_file(path)`, `edit(path, content)` (whole-file write) or `edit(path, old, new)`
    (replace one exact occurrence), `run_tests()`, `submit()`. `run_tests` and `submit` call
    `test_runner(files) -> (passed: bool, log: str)`; submit ends the episode with the unified diff
    of the repository against its start in `info["patch"]`.

    Args:
      files: path -> content at the start.
      test_runner: runs the task's tests on a repository snapshot (sandboxed in real use).
      parse: text -> ToolCall | None.
      max_observation_chars: observations are cut to this length (the cut is marked).
    """

    def __init__(
        self,
        files: dict[str, str],
        test_runner: Callable[[dict[str, str]], tuple[bool, str]],
        *,
        parse: Callable[[str], ToolCall | None] = parse_action,
        max_observation_chars: int = 2000,
    ):
        self.initial = dict(files)
        self.files = dict(files)
        self.test_runner = test_runner
        self.parse = parse
        self.max_observation_chars = int(max_observation_chars)
        self.counts = {"invalid_actions": 0, "test_runs": 0, "edits": 0}

    def patch(self) -> str:
        out = []
        for path in sorted(set(self.initial) | set(self.files)):
            a, b = self.initial.get(path, ""), self.files.get(path, "")
            if a != b:
                out.extend(
                    difflib.unified_diff(
                        a.splitlines(keepends=True),
                        b.splitlines(keepends=True),
                        fromfile=f"a/{path}",
                        tofile=f"b/{path}",
                    )
                )
        return "".join(out)

    def _cut(self, text: str) -> str:
        n = self.max_observation_chars
        return text if len(text) <= n else text[:n] + f"\n[... {len(text) - n} chars cut]"

    def step(self, action_text: str) -> StepResult:
        call = self.parse(action_text)
        if call is None:
            self.counts["invalid_actions"] += 1
            return StepResult(
                "error: no valid tool call (tools: read_file, edit, run_tests, submit)",
                info={"tool": None, "summary": "invalid action"},
            )
        args, name = call.arguments, call.name
        if name == "read_file":
            path = str(args.get("path", ""))
            if path not in self.files:
                return StepResult(
                    f"error: no file {path!r}; files: {sorted(self.files)}",
                    info={"tool": name, "path": path, "summary": f"read_file {path}: missing"},
                )
            text = self.files[path]
            return StepResult(
                self._cut(text),
                info={
                    "tool": name,
                    "path": path,
                    "summary": f"read_file {path} ({len(text.splitlines())} lines)",
                },
            )
        if name == "edit":
            path = str(args.get("path", ""))
            if not _carriable_path(path):  # a path no patch could carry: refused here
                return StepResult(
                    f"error: edit needs a normalised relative path without control characters, "
                    f"got {path[:200]!r}",
                    info={"tool": name, "path": path[:200], "summary": "edit: bad path"},
                )
            if "content" in args:
                self.files[path] = str(args["content"])
            else:
                old, new = args.get("old"), args.get("new")
                cur = self.files.get(path)
                if (
                    cur is None
                    or not isinstance(old, str)
                    or not isinstance(new, str)
                    or cur.count(old) != 1
                ):
                    return StepResult(
                        "error: edit needs an existing file and `old` occurring exactly once in "
                        f"{path!r}",
                        info={"tool": name, "path": path, "summary": f"edit {path}: rejected"},
                    )
                self.files[path] = cur.replace(old, new)
            self.counts["edits"] += 1
            return StepResult(
                f"edited {path}", info={"tool": name, "path": path, "summary": f"edit {path}"}
            )
        if name in ("run_tests", "submit"):
            passed, log = self.test_runner(dict(self.files))
            self.counts["test_runs"] += 1
            verdict = "passed" if passed else "failed"
            if name == "run_tests":
                return StepResult(
                    self._cut(f"tests {verdict}\n{log}"),
                    info={"tool": name, "passed": passed, "summary": f"run_tests: {verdict}"},
                )
            return StepResult(
                f"submitted; tests {verdict}",
                done=True,
                info={
                    "tool": name,
                    "passed": passed,
                    "patch": self.patch(),
                    "test_log": log,
                    "summary": f"submit: tests {verdict}",
                },
            )
        self.counts["invalid_actions"] += 1
        return StepResult(
            f"error: unknown tool {name!r}", info={"tool": name, "summary": f"unknown tool {name}"}
        )


# ---------------------------------------------------------------------------- driver


@dataclasses.dataclass
class _Live:
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    turns: list[Turn]
    versions: list[int]
    token_versions: list[int]  # [T] the version of each model token, -1 elsewhere
    finish: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # chunked turns: the tokens, log-probs and versions of the turn in progress (not yet in
    # ``tokens``: the environment has not seen it)
    part_tokens: list[int] = dataclasses.field(default_factory=list)
    part_logprobs: list[float] = dataclasses.field(default_factory=list)
    part_versions: list[int] = dataclasses.field(default_factory=list)
    # [T] (and the turn in progress's) recorded experts of each token: [layers, K] or None
    routes: list = dataclasses.field(default_factory=list)
    part_routes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EpisodeBatch:
    """Episodes in progress, interruptible at a turn boundary (:func:`start_episodes`,
    :func:`advance_episodes`, :func:`finish_episodes`; ``run_episodes`` is the three in a row),
    or, when turns are sampled in chunks (``advance_episodes(chunk_tokens=...)``), between two
    chunks of a turn.

    An interrupted batch resumes exactly where it stopped: turn ``t`` of an episode samples with
    the same seed and in the same batch of live episodes whenever it runs (a chunk: with the
    seed of its episode, turn and position in the turn, and the episodes still in that turn),
    so where the weights did not change in between, the resumed episodes equal uninterrupted
    ones token for token and log-prob for log-prob; where they did, each model token carries
    the version that produced it (``Episode.token_versions``). :meth:`state_dict` is its JSON
    form (tokens, log-probs, versions, turn spans, the turn in progress),
    :func:`restore_episodes` rebuilds it with fresh environments by replaying the recorded
    actions.
    """

    live: list[_Live]
    budgets: list[int]  # [E] token budget of each episode's whole sequence
    episode_seeds: list[int] | None
    next_turn: int = 0
    next_chunk: int = 0  # chunked turns: chunks of turn ``next_turn`` already sampled

    @property
    def done(self) -> bool:
        return all(e.finish is not None for e in self.live)

    def state_dict(self) -> dict[str, Any]:
        return {
            "budgets": list(self.budgets),
            "episode_seeds": self.episode_seeds,
            "next_turn": self.next_turn,
            "next_chunk": self.next_chunk,
            "episodes": [
                {
                    "tokens": e.tokens,
                    "mask": e.mask,
                    "logprobs": e.logprobs,
                    "token_versions": e.token_versions,
                    "prompt_len": e.prompt_len,
                    "versions": e.versions,
                    "turn_finish": [t.finish_reason for t in e.turns],
                    "model_spans": [list(t.model_span) for t in e.turns],
                    "finish": e.finish,
                    "partial": {
                        "tokens": e.part_tokens,
                        "logprobs": e.part_logprobs,
                        "versions": e.part_versions,
                        "routes": _routes_json(e.part_routes),
                    },
                    "routes": _routes_json(e.routes),
                }
                for e in self.live
            ],
        }


def _routes_json(routes: list):
    """Per-token recorded experts as JSON (None when none was recorded at all)."""
    if all(r is None for r in routes):
        return None
    return [None if r is None else np.asarray(r).tolist() for r in routes]


def _routes_from_json(saved, n: int) -> list:
    if saved is None:
        return [None] * n
    return [None if r is None else np.asarray(r, np.int16) for r in saved]


def _routes_array(routes: list):
    """``[T, layers, K]`` int16 with -1 where a token has none, or None if none has any."""
    known = [r for r in routes if r is not None]
    if not known:
        return None
    out = np.full((len(routes),) + np.shape(known[0]), -1, np.int16)
    for i, r in enumerate(routes):
        if r is not None:
            out[i] = r
    return out


def _record_context_routes(ep: _Live, sample, context_len: int) -> None:
    """The prefill routes of a call whose context was the first ``context_len`` tokens of
    ``ep`` (its history, then the turn in progress): kept for the tokens that have none yet."""
    pr = getattr(sample, "prompt_routes", None)
    if pr is None:
        return
    start = context_len - len(pr)
    for j, r in enumerate(pr):
        pos = start + j
        if pos < len(ep.routes):
            if ep.routes[pos] is None:
                ep.routes[pos] = np.asarray(r, np.int16)
        elif ep.part_routes[pos - len(ep.routes)] is None:
            ep.part_routes[pos - len(ep.routes)] = np.asarray(r, np.int16)


def _sample_routes(sample) -> list:
    """Per generated token its recorded experts, None where it has none (a row of -1: an
    SGLang sample's last token, never fed back; a later call's prefill may fill it in)."""
    r = getattr(sample, "routes", None)
    if r is None:
        return [None] * len(sample.tokens)
    rows = [np.asarray(x, np.int16) for x in r]
    return [None if np.any(x < 0) else x for x in rows]


def _observation_fn(tokenizer, observation_format, observation_tokens):
    if observation_tokens is not None:
        return observation_tokens
    return lambda text: tokenizer.encode(observation_format.format(text))


def _apply_turn(
    ep: _Live,
    env,
    tokenizer,
    turn: int,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    version: int,
    finish_reason: str,
    *,
    budget: int,
    max_observation_tokens: int,
    observation_tokens: Callable[[str], list[int]],
    token_versions: Sequence[int] | None = None,
    routes: Sequence | None = None,
) -> None:
    """Appends one model turn to ``ep``, steps ``env`` with its text and appends the
    observation (cut to ``max_observation_tokens`` and to the budget). ``version`` is the
    turn's (the one it began with); ``token_versions`` each token's when they differ (a turn
    sampled in chunks across a weight sync), else ``version`` for all."""
    start = len(ep.tokens)
    ep.tokens += tokens
    ep.routes += list(routes) if routes is not None else [None] * len(tokens)
    ep.mask += [1] * len(tokens)
    ep.logprobs += list(logprobs)
    if token_versions is None:
        ep.token_versions += [int(version)] * len(tokens)
    else:
        ep.token_versions += [int(v) for v in token_versions]
    ep.versions.append(int(version))
    model_span = (start, len(ep.tokens))
    action_text = tokenizer.decode(tokens)
    result = env.step(action_text)
    obs_start = len(ep.tokens)
    if not result.done and len(ep.tokens) < budget:
        obs_ids = list(observation_tokens(result.observation))
        obs_ids = obs_ids[: min(max_observation_tokens, budget - len(ep.tokens))]
        ep.tokens += obs_ids
        ep.routes += [None] * len(obs_ids)  # recorded by the next call's prefill
        ep.mask += [0] * len(obs_ids)
        ep.logprobs += [0.0] * len(obs_ids)
        ep.token_versions += [-1] * len(obs_ids)
    summary = result.info.get("summary") or f"{_short(action_text)} -> {_short(result.observation)}"
    ep.turns.append(
        Turn(
            index=turn,
            model_span=model_span,
            observation_span=(obs_start, len(ep.tokens)),
            finish_reason=finish_reason,
            action_text=action_text,
            observation=result.observation,
            summary=f"turn {turn}: {summary}",
            info={k: v for k, v in result.info.items() if k != "summary"},
        )
    )
    if result.done:
        ep.finish = "submitted"
        ep.info = dict(result.info)
    elif len(ep.tokens) >= budget:
        ep.finish = "max_tokens"


def start_episodes(
    prompts: Sequence[Sequence[int]],
    *,
    max_total_tokens: int | Sequence[int] = 2048,
    episode_seeds: Sequence[int] | None = None,
) -> EpisodeBatch:
    """An :class:`EpisodeBatch` of one episode per prompt, before its first turn (arguments as
    in :func:`run_episodes`)."""
    if isinstance(max_total_tokens, int):
        budgets = [max_total_tokens] * len(prompts)
    else:
        budgets = [int(b) for b in max_total_tokens]
        if len(budgets) != len(prompts):
            raise ValueError(
                f"max_total_tokens has {len(budgets)} entries for {len(prompts)} prompts"
            )
    if episode_seeds is not None:
        episode_seeds = [int(x) for x in episode_seeds]
        if len(episode_seeds) != len(prompts) or not all(0 <= x < 2**32 for x in episode_seeds):
            raise ValueError(
                f"episode_seeds must be {len(prompts)} ints in [0, 2**32) (one per "
                f"episode), got {episode_seeds!r:.200}"
            )
    live = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
        if len(p) >= budgets[i]:
            raise ValueError(f"prompts[{i}] has {len(p)} tokens, max_total_tokens={budgets[i]}")
        live.append(_Live(list(p), [0] * len(p), [0.0] * len(p), len(p), [], [], [-1] * len(p)))
        live[-1].routes = [None] * len(p)
    return EpisodeBatch(live=live, budgets=budgets, episode_seeds=episode_seeds)


def advance_episodes(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    envs: Sequence[ToolEnvironment],
    batch: EpisodeBatch,
    params: SamplingParams,
    *,
    until_turn: int,
    max_observation_tokens: int = 512,
    observation_format: str = "\n<observation>\n{}\n</observation>\n",
    observation_tokens: Callable[[str], list[int]] | None = None,
    chunk_tokens: int = 0,
    until_chunk: int = 0,
) -> EpisodeBatch:
    """Runs turns ``batch.next_turn`` up to ``until_turn - 1`` of the live episodes (each turn one
    batched engine call per distinct turn budget) and returns ``batch`` (advanced in place).

    ``chunk_tokens > 0`` (needs ``batch.episode_seeds``): each turn is sampled in chunks of at
    most that many tokens, one batched engine call per chunk over the episodes still in the
    turn, each continuing its episode's context plus the turn's tokens so far, seeded by the
    episode, the turn and the position in the turn; a turn ends at a stop token or its budget.
    ``until_chunk``: then also the first ``until_chunk`` chunks of turn ``until_turn`` (the
    batch stops mid-turn; a later call with the same ``chunk_tokens`` resumes it, possibly with
    other weights: each token keeps the version that produced it)."""
    if len(envs) != len(batch.live):
        raise ValueError(f"{len(envs)} envs for {len(batch.live)} episodes")
    if params.n != 1:
        raise ValueError(
            f"run_episodes needs SamplingParams.n == 1 (one trajectory per env), got n={params.n}"
        )
    observation_tokens = _observation_fn(tokenizer, observation_format, observation_tokens)
    if chunk_tokens or until_chunk or batch.next_chunk:
        _advance_chunked(
            engine,
            tokenizer,
            envs,
            batch,
            params,
            until_turn=until_turn,
            until_chunk=until_chunk,
            chunk_tokens=chunk_tokens,
            max_observation_tokens=max_observation_tokens,
            observation_tokens=observation_tokens,
        )
        return batch
    live, budgets, episode_seeds = batch.live, batch.budgets, batch.episode_seeds
    for turn in range(batch.next_turn, until_turn):
        batch.next_turn = turn + 1
        active = [i for i, e in enumerate(live) if e.finish is None]
        if not active:
            break
        # One engine call per distinct turn budget (usually one call: every episode far from
        # its token budget gets params.max_tokens).
        by_budget: dict[int, list[int]] = {}
        for i in active:
            budget = min(params.max_tokens, budgets[i] - len(live[i].tokens))
            by_budget.setdefault(budget, []).append(i)
        outs = {}
        seed = None if params.seed is None else (params.seed + turn) % 2**31
        for budget, idx in by_budget.items():
            turn_params = dataclasses.replace(params, max_tokens=budget, seed=seed)
            contexts = [live[i].tokens for i in idx]
            if episode_seeds is None:
                results = engine.generate(contexts, turn_params)
            else:
                seeds = [_turn_seed(episode_seeds[i], turn) for i in idx]
                results = engine.generate(contexts, turn_params, prompt_seeds=seeds)
            for i, samples in zip(idx, results):
                outs[i] = samples
        for i in active:
            s = outs[i][0]
            if s.finish_reason == "abort":
                live[i].finish = "abort"
                continue
            _record_context_routes(live[i], s, len(live[i].tokens))
            _apply_turn(
                live[i],
                envs[i],
                tokenizer,
                turn,
                s.tokens,
                s.logprobs,
                s.policy_version,
                s.finish_reason,
                budget=budgets[i],
                max_observation_tokens=max_observation_tokens,
                observation_tokens=observation_tokens,
                routes=_sample_routes(s),
            )
    return batch


def _advance_chunked(
    engine,
    tokenizer,
    envs,
    batch: EpisodeBatch,
    params: SamplingParams,
    *,
    until_turn: int,
    until_chunk: int,
    chunk_tokens: int,
    max_observation_tokens: int,
    observation_tokens: Callable[[str], list[int]],
) -> None:
    """:func:`advance_episodes` with each turn sampled in chunks of ``chunk_tokens``."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be an int >= 1 to sample turns in chunks (or resume a batch "
            f"stopped mid-turn), got {chunk_tokens!r}"
        )
    if until_chunk < 0:
        raise ValueError(f"until_chunk must be >= 0, got {until_chunk}")
    if batch.episode_seeds is None:
        raise ValueError(
            "chunked turns need episode_seeds (each chunk is seeded by its episode, turn and "
            "position, so a resumed turn draws what an uninterrupted one draws)"
        )
    live, budgets = batch.live, batch.budgets
    while (batch.next_turn, batch.next_chunk) < (until_turn, until_chunk):
        turn = batch.next_turn
        # the episodes in turn `turn`: not finished and not yet through it
        active = [i for i, e in enumerate(live) if e.finish is None and len(e.turns) == turn]
        if not active:
            if batch.next_chunk == 0:  # every episode has finished
                break
            batch.next_turn, batch.next_chunk = turn + 1, 0
            continue
        by_size: dict[int, list[int]] = {}
        turn_budget = {}
        for i in active:
            turn_budget[i] = min(params.max_tokens, budgets[i] - len(live[i].tokens))
            size = min(chunk_tokens, turn_budget[i] - len(live[i].part_tokens))
            by_size.setdefault(size, []).append(i)
        outs = {}
        seed = None if params.seed is None else (params.seed + turn) % 2**31
        for size, idx in by_size.items():
            chunk_params = dataclasses.replace(params, max_tokens=size, seed=seed)
            contexts = [live[i].tokens + live[i].part_tokens for i in idx]
            seeds = [
                _chunk_seed(batch.episode_seeds[i], turn, len(live[i].part_tokens)) for i in idx
            ]
            for i, samples in zip(idx, engine.generate(contexts, chunk_params, prompt_seeds=seeds)):
                outs[i] = samples[0]
        batch.next_chunk += 1
        for i in active:
            s, ep = outs[i], live[i]
            if s.finish_reason == "abort":
                ep.finish = "abort"
                ep.part_tokens, ep.part_logprobs, ep.part_versions = [], [], []
                ep.part_routes = []
                continue
            _record_context_routes(ep, s, len(ep.tokens) + len(ep.part_tokens))
            ep.part_routes += _sample_routes(s)
            ep.part_tokens += [int(t) for t in s.tokens]
            ep.part_logprobs += [float(x) for x in s.logprobs]
            ep.part_versions += [int(s.policy_version)] * len(s.tokens)
            # the turn ends at a stop token, at its budget, or where a chunk drew nothing
            if s.finish_reason == "length" and 0 < len(ep.part_tokens) < turn_budget[i]:
                continue
            versions = ep.part_versions or [int(s.policy_version)]
            _apply_turn(
                ep,
                envs[i],
                tokenizer,
                turn,
                ep.part_tokens,
                ep.part_logprobs,
                versions[0],
                s.finish_reason,
                budget=budgets[i],
                max_observation_tokens=max_observation_tokens,
                observation_tokens=observation_tokens,
                token_versions=ep.part_versions,
                routes=ep.part_routes,
            )
            ep.part_tokens, ep.part_logprobs, ep.part_versions = [], [], []
            ep.part_routes = []


def _chunk_seed(episode_seed: int, turn: int, position: int) -> int:
    """The engine seed of the chunk of one episode's turn that starts ``position`` tokens into
    the turn, in [0, 2**32)."""
    return int(np.random.default_rng([episode_seed, turn, position]).integers(2**32))


def finish_episodes(batch: EpisodeBatch) -> list[Episode]:
    """The :class:`Episode` of each episode of ``batch`` (one still live ends as
    ``max_turns``; a batch stopped mid-turn cannot be finished)."""
    if any(e.part_tokens for e in batch.live):
        raise ValueError(
            "finish_episodes: the batch stopped in the middle of a turn (resume it with "
            "advance_episodes first)"
        )
    return [
        Episode(
            tokens=ep.tokens,
            response_mask=ep.mask,
            logprobs=ep.logprobs,
            prompt_len=ep.prompt_len,
            turns=ep.turns,
            finish_reason=ep.finish or "max_turns",
            policy_versions=ep.versions,
            info=ep.info,
            token_versions=ep.token_versions,
            routes=_routes_array(ep.routes),
        )
        for ep in batch.live
    ]


def restore_episodes(
    state: dict[str, Any],
    envs: Sequence[ToolEnvironment],
    tokenizer: Tokenizer,
    *,
    max_observation_tokens: int = 512,
    observation_format: str = "\n<observation>\n{}\n</observation>\n",
    observation_tokens: Callable[[str], list[int]] | None = None,
) -> EpisodeBatch:
    """The :class:`EpisodeBatch` of :meth:`EpisodeBatch.state_dict`, with ``envs`` (fresh ones,
    in the episodes' order) brought to their saved state by replaying every recorded model turn
    (the environments are deterministic functions of the actions they receive).

    Raises:
      ValueError: ``envs`` do not match the episodes, or a replayed observation differs from
        the saved one (an environment that is not a function of its actions cannot be resumed).
    """
    saved = state["episodes"]
    if len(envs) != len(saved):
        raise ValueError(f"{len(envs)} envs for {len(saved)} saved episodes")
    observation_tokens = _observation_fn(tokenizer, observation_format, observation_tokens)
    batch = start_episodes(
        [e["tokens"][: e["prompt_len"]] for e in saved],
        max_total_tokens=list(state["budgets"]),
        episode_seeds=state["episode_seeds"],
    )
    batch.next_turn = int(state["next_turn"])
    batch.next_chunk = int(state.get("next_chunk", 0))
    for i, (ep, e, env) in enumerate(zip(batch.live, saved, envs)):
        for turn, ((a, b), finish, version) in enumerate(
            zip(e["model_spans"], e["turn_finish"], e["versions"])
        ):
            _apply_turn(
                ep,
                env,
                tokenizer,
                turn,
                [int(t) for t in e["tokens"][a:b]],
                [float(x) for x in e["logprobs"][a:b]],
                version,
                finish,
                budget=batch.budgets[i],
                max_observation_tokens=max_observation_tokens,
                observation_tokens=observation_tokens,
            )
        if ep.tokens != [int(t) for t in e["tokens"]]:
            raise ValueError(
                f"restore_episodes: episode {i}: replaying its {len(e['model_spans'])} actions "
                "gave other observations than the saved ones (the environment is not a "
                "deterministic function of its actions)"
            )
        ep.logprobs = [float(x) for x in e["logprobs"]]  # observation zeros, as saved
        ep.token_versions = [int(v) for v in e["token_versions"]]
        ep.finish = e["finish"]
        part = e.get("partial") or {}
        ep.part_tokens = [int(t) for t in part.get("tokens", [])]
        ep.part_logprobs = [float(x) for x in part.get("logprobs", [])]
        ep.part_versions = [int(v) for v in part.get("versions", [])]
        ep.routes = _routes_from_json(e.get("routes"), len(ep.tokens))
        ep.part_routes = _routes_from_json(part.get("routes"), len(ep.part_tokens))
    return batch


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    envs: Sequence[ToolEnvironment],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    max_turns: int = 8,
    max_total_tokens: int | Sequence[int] = 2048,
    max_observation_tokens: int = 512,
    observation_format: str = "\n<observation>\n{}\n</observation>\n",
    observation_tokens: Callable[[str], list[int]] | None = None,
    episode_seeds: Sequence[int] | None = None,
) -> list[Episode]:
    """Runs one episode per (env, prompt) pair, all live episodes batched per turn.

    Args:
      engine: any RolloutEngine; each turn calls it once with the live episodes' full contexts.
      tokenizer: encodes observations and decodes model turns for the environment.
      envs: one environment per episode (state is per episode).
      prompts: [E] prompt token ids.
      params: sampling parameters of each model turn (n must be 1: one trajectory per env).
      max_turns: model turns per episode.
      max_total_tokens: budget on the whole sequence; a turn gets min(params.max_tokens, left).
        One int for every episode, or one per episode (e.g. prompt length + a response budget).
      max_observation_tokens: observations are cut to this many tokens (mask 0 anyway).
      observation_format: wraps each observation's text before encoding.
      observation_tokens: renders an observation to token ids instead of
        ``tokenizer.encode(observation_format.format(text))`` (e.g. as a tool message of the
        tokenizer's chat template).

      episode_seeds: [E] optional seeds in [0, 2**32), one per episode: turn ``t`` of episode
        ``i`` samples with its own seed (a function of ``(episode_seeds[i], t)``, passed as the
        engine's ``prompt_seeds``), so an episode does not depend on which other episodes share
        its engine calls (several hosts split a step's episodes between them).

    Without ``episode_seeds``, with ``params.seed`` set, turn ``t`` samples with seed
    ``params.seed + t`` (mod 2**31): each turn draws fresh randomness, and the episodes are
    still a function of the seed (and of the batch).

    The same as :func:`start_episodes`, :func:`advance_episodes` up to ``max_turns`` and
    :func:`finish_episodes` (an :class:`EpisodeBatch` can stop between turns and resume).

    Returns:
      [E] Episodes, in the order of `envs`.
    """
    if len(envs) != len(prompts):
        raise ValueError(
            f"envs and prompts must have the same length, got {len(envs)} and {len(prompts)}"
        )
    if params.n != 1:
        raise ValueError(
            f"run_episodes needs SamplingParams.n == 1 (one trajectory per env), got n={params.n}"
        )
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    batch = start_episodes(prompts, max_total_tokens=max_total_tokens, episode_seeds=episode_seeds)
    advance_episodes(
        engine,
        tokenizer,
        envs,
        batch,
        params,
        until_turn=max_turns,
        max_observation_tokens=max_observation_tokens,
        observation_format=observation_format,
        observation_tokens=observation_tokens,
    )
    return finish_episodes(batch)


def _turn_seed(episode_seed: int, turn: int) -> int:
    """The engine seed of one turn of one episode, in [0, 2**32)."""
    return int(np.random.default_rng([episode_seed, turn]).integers(2**32))


def run_episode(
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    env: ToolEnvironment,
    prompt: Sequence[int],
    params: SamplingParams,
    **kwargs: Any,
) -> Episode:
    """One episode (see `run_episodes`)."""
    return run_episodes(engine, tokenizer, [env], [prompt], params, **kwargs)[0]
