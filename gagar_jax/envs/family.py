"""The task-family interface: everything the training loop knows about a family of tasks.

The loop imports only this module of ``gagar_jax.envs``. A family is a :class:`TaskFamily`
subclass registered under a name (``task.family`` in the config); :func:`make_family` builds it
from plain settings (:class:`FamilySettings`), so the family never imports the loop's config.

What a family provides (the issue's list, one method each):

* a task stream: ``num_train`` tasks with random access ``train_task(i)`` (the loop's resumable
  data position is an index into them) and a held-out set ``eval_tasks()`` from another seed;
* ``prompt_tokens(task)``: the prompt rendered through the policy's tokenizer (the chat template
  for Hugging Face tokenizers), checked against the prompt budget;
* ``make_env(task)``: for multi-turn families (``multi_turn = True``), the episode environment
  of one rollout (``gagar_jax.rollout.ToolEnvironment``: text in, observation out); the loop runs
  every episode of a step through ``gagar_jax.rollout.run_episodes`` (one batched engine call per
  turn) and renders observations with ``observation_tokens``;
* ``verify(task, attempt) -> Outcome``: passed / cheat / infra error, the test log and the
  monitor flags of one rollout (its decoded response, or its finished episode);
* ``workspace(group_id, task, rollouts)``: the grading workspace of a group
  (``gagar_jax.grading.GroupWorkspace``), and ``check_runner()`` for the agentic grader;
* ``demonstrations(num_tasks)``: optional SFT warm-start trajectories (token ids + loss mask).

Small types owned here (the loop adapts to them, never the other way round): :class:`Attempt`
(what the family sees of a rollout), :class:`Outcome` (its verification), :class:`Demonstration`
and :class:`FamilySettings`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from gagar_jax.grading.evidence_tokens import TokenSpans
from gagar_jax.verify.flags import MonitorFlag


@runtime_checkable
class FamilyTokenizer(Protocol):
    """The policy's tokenizer as a family uses it (``ToyTokenizer``, ``HFTokenizer``)."""

    vocab_size: int
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class FamilySettings:
    """The settings a family takes, as plain values (the loop fills them from its config).

    Attributes:
      seed: task generation / shuffling seed.
      difficulty: toy difficulty (1..3); ignored by families without one.
      num_train: training tasks (the toy families generate them; repository families take at
        most this many from the pool, 0 = all).
      num_eval: held-out tasks (0 = none).
      max_prompt_len: prompt budget in tokens; a longer prompt is an error naming the task.
      data_path: where the task pool lives (a directory of task dirs or a ``.jsonl`` file) for
        repository / front-end families; "" for generated families.
      eval_data_path: the held-out pool (same format); "" = the last ``num_eval`` of the pool.
      repos_dir: for SWE-bench-format pools (``gagar_jax.data.swe``): the directory of the
        git repositories the rows name; "" = the pool holds whole trees.
      tokenizer_path: a Hugging Face checkpoint / tokenizer directory (``tokenizer.json`` +
        ``tokenizer_config.json``); "" = the family's built-in tokenizer.
      max_turns: model turns per episode (multi-turn families).
      max_observation_tokens: observations are cut to this many tokens.
      extra: family-specific settings (documented by each family).
    """

    seed: int = 0
    difficulty: int = 1
    num_train: int = 256
    num_eval: int = 32
    max_prompt_len: int = 128
    data_path: str = ""
    eval_data_path: str = ""
    repos_dir: str = ""
    tokenizer_path: str = ""
    max_turns: int = 6
    max_observation_tokens: int = 256
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Attempt:
    """One rollout as the family sees it.

    Attributes:
      response_tokens: the model's tokens after the prompt (single-turn: the whole response;
        multi-turn: turns and observations, as in ``Episode.tokens[prompt_len:]``).
      text: the decoded response (single-turn), "" for episodes.
      episode: the finished ``gagar_jax.rollout.Episode`` of a multi-turn rollout, else None.
      env: the episode's environment after the episode (multi-turn), else None.
    """

    response_tokens: Sequence[int] = ()
    text: str = ""
    episode: Any = None
    env: Any = None

    def trajectory(self) -> list[dict[str, Any]]:
        """The episode as trajectory events (``grading.TrajectoryEvent`` fields ``turn``,
        ``kind``, ``text``, ``tokens``): per turn a ``tool_call`` (a parsed call) or ``action``
        event with the model's text and token count, then the ``observation``; empty for
        single-turn rollouts. The grader cites these by index; the monitor reads the actions."""
        if self.episode is None:
            return []
        events: list[dict[str, Any]] = []
        for t in self.episode.turns:
            kind = "tool_call" if t.info.get("tool") is not None else "action"
            events.append(
                {
                    "turn": t.index,
                    "kind": kind,
                    "text": t.action_text,
                    "tokens": t.model_span[1] - t.model_span[0],
                }
            )
            events.append(
                {"turn": t.index, "kind": "observation", "text": t.observation, "tokens": 0}
            )
        return events

    def summary(self) -> str:
        """One line per turn (the episode's turn summaries); "" for single-turn rollouts."""
        return "" if self.episode is None else "\n".join(self.episode.summaries())


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The verification of one rollout.

    Attributes:
      passed: the task's tests pass (the binary reward, before the cheat penalty).
      infra_error: the verifier failed (never the policy's fault): the rollout is masked out.
      cheat: a confirmed behaviour-monitor flag (reward 0).
      test_log: what the tests printed, evidence for the grader.
      flags: the monitor's flags (confirmed or suspected).
      quality: optional per-dimension quality scores in [0, 1] (metrics only).
      patch: the final patch of the rollout in the family's own format (empty if none).
      detail: the family's full verification result (host only).
    """

    passed: bool
    infra_error: bool = False
    cheat: bool = False
    test_log: str = ""
    flags: tuple[MonitorFlag, ...] = ()
    quality: Mapping[str, float] = dataclasses.field(default_factory=dict)
    patch: str = ""
    detail: Any = None


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One SFT warm-start trajectory: ``tokens`` with ``loss_mask`` True on model tokens.

    Single-turn: prompt then response (+ EOS). Multi-turn: prompt, then each tool call (mask 1)
    and the observation the environment really returned (mask 0).
    """

    tokens: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    prompt_len: int

    def __post_init__(self):
        if len(self.tokens) != len(self.loss_mask):
            raise ValueError(
                f"Demonstration: {len(self.tokens)} tokens but "
                f"{len(self.loss_mask)} loss-mask entries"
            )
        if not 1 <= self.prompt_len <= len(self.tokens):
            raise ValueError(
                f"Demonstration.prompt_len={self.prompt_len} outside [1, {len(self.tokens)}]"
            )
        if any(self.loss_mask[: self.prompt_len]):
            raise ValueError("Demonstration.loss_mask must be False on the prompt")

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class GroupMember:
    """One rollout of a group handed to ``workspace``: its id, attempt and outcome."""

    candidate_id: str
    attempt: Attempt
    outcome: Outcome


class TaskFamily(abc.ABC):
    """A family of tasks behind the loop's one interface (see the module docstring)."""

    name: ClassVar[str] = ""
    multi_turn: ClassVar[bool] = False

    def __init__(self, settings: FamilySettings):
        self.settings = settings

    # ---- the policy's tokenizer ------------------------------------------------------------
    @property
    @abc.abstractmethod
    def tokenizer(self) -> FamilyTokenizer:
        """The tokenizer prompts, responses and observations are encoded with."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Generation (of a response, or of one model turn) stops after any of these."""
        return (self.tokenizer.eos_id,)

    # ---- the task stream -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_train(self) -> int:
        """Training tasks available (the data position cycles over them)."""

    @abc.abstractmethod
    def train_task(self, index: int) -> Any:
        """The training task at ``index`` in ``[0, num_train)`` (random access)."""

    @abc.abstractmethod
    def eval_tasks(self) -> list[Any]:
        """The held-out tasks (never training tasks)."""

    @staticmethod
    def task_id(task: Any) -> str:
        return str(task.task_id)

    # ---- prompts and episodes ----------------------------------------------------------------
    @abc.abstractmethod
    def prompt_tokens(self, task: Any) -> list[int]:
        """The prompt ids (chat template applied where the tokenizer has one)."""

    def make_env(self, task: Any) -> Any:
        """The ``ToolEnvironment`` of one episode of ``task`` (multi-turn families)."""
        raise NotImplementedError(f"family {self.name!r} is single-turn: no episode environment")

    def observation_tokens(self, text: str) -> list[int]:
        """Token ids of one observation, as the tokenizer's template renders a tool message.

        Appended after a model turn (which ends with a stop token); mask 0 in the update.
        """
        return self.tokenizer.encode(f"\n{text}\n")

    # ---- verification, grading, demonstrations ---------------------------------------------
    @abc.abstractmethod
    def verify(self, task: Any, attempt: Attempt) -> Outcome:
        """Verifies one rollout. Never raises for a bad response (it fails); a crash of the
        verifier itself is ``Outcome(passed=False, infra_error=True)``."""

    @abc.abstractmethod
    def workspace(self, group_id: str, task: Any, members: Sequence[GroupMember]) -> Any:
        """The grading workspace (``gagar_jax.grading.GroupWorkspace``) of one group."""

    def check_runner(self) -> Any:
        """The targeted-check runner of the agentic grader for this family (None = none)."""
        return None

    def demonstrations(self, num_tasks: int) -> list[Demonstration]:
        """SFT warm-start trajectories on ``num_tasks`` tasks of their own seed (none by
        default)."""
        return []

    def token_spans(self, task: Any, attempt: Attempt) -> Any:
        """Where the rollout's artefacts live in its response tokens
        (``gagar_jax.grading.evidence_tokens.TokenSpans``), so a verdict's evidence maps to the
        tokens that wrote it (token-level credit). Default: for an episode, trajectory event
        ``2 i`` (turn i's action, as in ``Attempt.trajectory``) is that turn's model tokens and
        event ``2 i + 1`` (its observation) none; single-turn rollouts map nothing (None).
        Families whose responses are patches override this to map patch lines."""
        del task
        if attempt.episode is None:
            return None
        n = len(attempt.response_tokens)
        offset = len(attempt.episode.tokens) - n  # model spans count the prompt
        events: list[tuple[int, ...]] = []
        for t in attempt.episode.turns:
            lo, hi = t.model_span
            events.append(tuple(i - offset for i in range(lo, hi) if 0 <= i - offset < n))
            events.append(())
        return TokenSpans(length=n, events=tuple(events))


FAMILIES: dict[str, Callable[[FamilySettings], TaskFamily]] = {}


def register_family(name: str, factory: Callable[[FamilySettings], TaskFamily]) -> None:
    """Makes ``factory`` available as ``task.family = name`` (a later call replaces it)."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"family name must be a non-empty identifier, got {name!r}")
    FAMILIES[name] = factory


def family_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(FAMILIES))


def make_family(name: str, settings: FamilySettings | None = None) -> TaskFamily:
    """The family registered as ``name``; a ValueError names the known ones otherwise."""
    _load_builtin()
    if name not in FAMILIES:
        raise ValueError(f"task.family must be one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name](settings or FamilySettings())


def _load_builtin() -> None:
    # Imported on first use, not at the top: every family module imports this one.
    from gagar_jax.envs import families  # noqa: F401
