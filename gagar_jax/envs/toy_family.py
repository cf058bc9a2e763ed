"""The toy code-repair families behind the task-family interface: ``toy`` and ``toy_agent``.

``toy`` (single-turn): the prompt is the task's program and visible tests; the response is a
line-edit patch (``N : stmt``, ``ins N : stmt``, ``del N``) verified in-process by
``gagar_jax.envs.toy.verify``. Its behaviour is the one the loop had before the interface
(``train/tasks.py::ToyTaskPool``): same tokenizer, seeds, prompts, verification, workspaces and
demonstrations.

``toy_agent`` (multi-turn): the same programs as a tool task over ``CodeAgentEnv``. The policy
calls, one per turn (the first line of the turn names the tool, in toy vocabulary; the toy
tokenizer cannot spell JSON, so this family uses ``CodeAgentEnv``'s plain-call form):

==============================  ==========================================================
``read_file``                   the observation is ``program.toy`` (numbered lines)
``edit`` + line-edit patch      sets ``program.toy`` to the original program with the patch
                                applied (line numbers refer to the original program, as in
                                ``toy``; a later edit replaces an earlier one)
``run_tests``                   the visible tests, run in-process: ``tests passed`` or
                                ``tests failed`` and one ``f ( x ) == y got z`` line per failure
``submit``                      ends the episode
==============================  ==========================================================

The submitted patch (the last accepted edit) is verified exactly as a ``toy`` response (tests,
monitor, quality features); an episode that never submits fails (``test_log`` says why).
The tokenizer is the toy vocabulary with the tool words appended (``ToyAgentTokenizer``), so
every ``toy`` token keeps its id. Demonstrations: read the file, edit it with a passing
non-cheating patch kind, run the tests, submit, with the observations the environment returns.

``toy`` on a Hugging Face policy (``task.tokenizer_path`` or ``model.hf_checkpoint`` set, e.g. an
SGLang-served checkpoint): prompts, responses and demonstrations go through that checkpoint's
tokenizer (the prompt as one user message of its chat template, when it has one), so the ids
the policy samples are the ids the family decodes; the programs, verification and workspaces
are unchanged. Only the evidence-to-token map of token-level credit needs the toy vocabulary's
line structure (``token_spans`` is None there: evidence maps to no tokens). ``toy_agent`` always
uses its own vocabulary (its tool words) and refuses a Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from gagar_jax.envs import toy, toy_grading
from gagar_jax.envs.family import Attempt, Demonstration, GroupMember, Outcome, TaskFamily
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.envs.tokenizer import TOKENIZER, ToyTokenizer
from gagar_jax.grading.adapters import ToyCheckRunner
from gagar_jax.rollout.episode import CodeAgentEnv, ToolCall
from gagar_jax.verify import toy_lang as L

# Held-out and SFT-demonstration tasks come from other seeds, so neither coincides with the RL
# training tasks (the warm start must not hand the RL prompts their answers).
EVAL_SEED_OFFSET = 1_000_003
SFT_SEED_OFFSET = 2_000_003
# Demonstration kinds used for the SFT warm start: every passing, non-cheating kind.
DEMO_KINDS = ("minimal", "inconsistent", "sprawling", "out_of_scope", "side_effect")
PROGRAM_FILE = "program.toy"
TOOL_WORDS = (
    "read_file",
    "edit",
    "run_tests",
    "submit",
    "tools",
    "passed",
    "failed",
    "got",
    "edited",
    "error",
    "submitted",
)


def parse_demo_kinds(spec) -> tuple[str, ...]:
    """``"sprawling,side_effect"`` (or a sequence of names) -> those kinds in ``DEMO_KINDS``
    order; ``""`` -> every kind of ``DEMO_KINDS``. An unknown or empty selection is an error
    naming ``task.demo_kinds`` (the run config field that sets ``extra["demo_kinds"]``)."""
    words = [w.strip() for w in spec.split(",")] if isinstance(spec, str) else list(spec)
    words = [w for w in words if w]
    if not words:
        return DEMO_KINDS
    unknown = sorted(set(words) - set(DEMO_KINDS))
    if unknown:
        raise ValueError(
            f"task.demo_kinds: {unknown} not demonstration kinds; expected a "
            f"comma-separated subset of {', '.join(DEMO_KINDS)}"
        )
    return tuple(k for k in DEMO_KINDS if k in words)


def quality_dims(quality) -> dict[str, float]:
    return {k: float(quality[k]) for k in toy.QUALITY_DIMENSIONS if k in quality}


def quality_score(quality) -> float | None:
    """Mean of the five quality dimensions (None when the verifier reported none)."""
    vals = [quality[k] for k in toy.QUALITY_DIMENSIONS if k in quality]
    return sum(vals) / len(vals) if vals else None


def _outcome(v: toy.Verification, patch: str, *, log_prefix: str = "") -> Outcome:
    return Outcome(
        passed=bool(v.passed),
        infra_error=bool(v.infra_error),
        cheat=bool(v.cheat),
        test_log=log_prefix + v.test_log,
        flags=tuple(v.cheat_flags),
        quality=quality_dims(v.quality) if v.passed else {},
        patch=patch,
        detail=v,
    )


class ToyFamily(TaskFamily):
    """Single-turn toy code repair (``task.family = "toy"``)."""

    name = "toy"
    multi_turn = False

    def __init__(self, settings):
        super().__init__(settings)
        s = settings
        self._train = toy.ToyTaskGenerator(seed=s.seed, difficulty=s.difficulty)
        self._eval = toy.ToyTaskGenerator(seed=s.seed + EVAL_SEED_OFFSET, difficulty=s.difficulty)
        self._sft = toy.ToyTaskGenerator(seed=s.seed + SFT_SEED_OFFSET, difficulty=s.difficulty)
        self._cache: dict[int, toy.ToyTask] = {}
        self._eval_tasks: list[toy.ToyTask] | None = None
        self._hf = None
        if s.tokenizer_path:
            self._hf = HFTokenizer(s.tokenizer_path)
        self.demo_kinds = parse_demo_kinds(s.extra.get("demo_kinds", ""))

    @property
    def tokenizer(self):
        """The toy vocabulary, or the policy checkpoint's ``HFTokenizer`` (module docstring)."""
        return TOKENIZER if self._hf is None else self._hf

    @property
    def num_train(self) -> int:
        return self.settings.num_train

    def train_task(self, index: int) -> toy.ToyTask:
        if not 0 <= index < self.num_train:
            raise IndexError(f"train task index {index} outside [0, {self.num_train})")
        task = self._cache.get(index)
        if task is None:
            task = self._cache[index] = self._train.task(index)
        return task

    def eval_tasks(self) -> list[toy.ToyTask]:
        if self._eval_tasks is None:
            self._eval_tasks = self._eval.tasks(self.settings.num_eval)
        return self._eval_tasks

    def prompt_text(self, task: toy.ToyTask) -> str:
        return task.prompt

    def prompt_tokens(self, task: toy.ToyTask) -> list[int]:
        if self._hf is not None and self._hf.chat_template:
            ids = self._hf.render_prompt([{"role": "user", "content": self.prompt_text(task)}])
        else:
            ids = self.tokenizer.encode(self.prompt_text(task))
        if len(ids) > self.settings.max_prompt_len:
            raise ValueError(
                f"task {task.task_id}: prompt is {len(ids)} tokens > "
                f"rollout.max_prompt_len={self.settings.max_prompt_len}; raise it "
                "or lower task.difficulty"
            )
        return ids

    def verify(self, task: toy.ToyTask, attempt: Attempt) -> Outcome:
        return _outcome(toy.verify(task, attempt.text), attempt.text)

    def workspace(self, group_id: str, task: toy.ToyTask, members: Sequence[GroupMember]):
        """Each line-edit patch rendered as a unified diff of ``program.toy`` with its test log,
        monitor flags and quality features (``toy_grading``); infra-error rollouts go in as
        failed candidates."""
        cands = []
        for m in members:
            v = m.outcome.detail
            if v is None:  # an outcome without the toy verification (e.g. a verifier crash)
                v = toy.Verification(False, True, m.outcome.test_log, [], {})
            cands.append(
                toy_grading.toy_candidate(
                    task,
                    m.candidate_id,
                    m.outcome.patch,
                    v,
                    trajectory=m.attempt.trajectory(),
                    summary=m.attempt.summary(),
                )
            )
        return toy_grading.toy_workspace(task, group_id, cands)

    def token_spans(self, task: toy.ToyTask, attempt: Attempt):
        """Each line edit's response tokens and the lines of ``program.toy`` it wrote
        (``toy_grading.toy_token_spans``)."""
        if self._hf is not None:  # the map reads the toy vocabulary's newline / EOS ids
            return None
        return toy_grading.toy_token_spans(task, attempt.response_tokens, self.tokenizer)

    def check_runner(self):
        return ToyCheckRunner()

    def demonstration_patches(self, task: toy.ToyTask) -> list[str]:
        """The passing non-cheating patch kinds of ``task`` among ``self.demo_kinds``
        (``DEMO_KINDS`` order; ``settings.extra["demo_kinds"]`` narrows them)."""
        out = []
        for kind, patch in toy.candidate_patches(task).items():
            if kind not in self.demo_kinds:
                continue
            v = toy.verify(task, patch)
            if v.passed and not v.cheat:
                out.append(patch)
        return out

    def demonstrations(self, num_tasks: int) -> list[Demonstration]:
        """Prompt + patch + EOS for each passing non-cheat patch kind of ``num_tasks`` tasks of
        their own seed (disjoint from RL and eval tasks): the warm-started policy produces
        solutions of every quality, which gives the grader something to rank."""
        out = []
        eos = self.tokenizer.eos_id
        for task in self._sft.tasks(num_tasks):
            prompt = self.prompt_tokens(task)
            for patch in self.demonstration_patches(task):
                response = self.tokenizer.encode(patch) + [eos]
                out.append(
                    Demonstration(
                        tuple(prompt) + tuple(response),
                        (False,) * len(prompt) + (True,) * len(response),
                        len(prompt),
                    )
                )
        return out


# ---------------------------------------------------------------------------------------------
# toy_agent
# ---------------------------------------------------------------------------------------------
class ToyAgentTokenizer(ToyTokenizer):
    """The toy vocabulary plus the tool words (appended: every toy id is unchanged)."""

    def __init__(self):
        super().__init__()
        self.vocab = self.vocab + TOOL_WORDS
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}


AGENT_TOKENIZER = ToyAgentTokenizer()


def toy_test_log(task: toy.ToyTask, lines: Sequence[str]) -> tuple[bool, str]:
    """Runs the visible tests on a program (in-process); the log is in toy vocabulary."""
    try:
        program = L.parse_program(list(lines))
    except L.ToyError:
        return False, "tests failed\nerror"
    fails = []
    for x, want in task.tests:
        got = L.try_run(program, x)
        if got != want:
            shown = "error" if got is None else toy._num_text(got)
            fails.append(f"f ( {toy._num_text(x)} ) == {toy._num_text(want)} got {shown}")
    return (not fails), "\n".join(["tests passed" if not fails else "tests failed", *fails])


class ToyAgentEnv:
    """One ``toy_agent`` episode: ``CodeAgentEnv`` over ``program.toy`` with the toy tool calls.

    ``patch`` is the last accepted line-edit patch ("" before any edit); ``submitted`` tells
    whether the episode ended with ``submit``.
    """

    def __init__(self, task: toy.ToyTask):
        self.task = task
        self.patch = ""
        self.submitted = False
        self._pending: str | None = None
        self.env = CodeAgentEnv(
            {PROGRAM_FILE: toy.numbered(task.lines)}, self._run_tests, parse=self._parse
        )

    def _run_tests(self, files: dict[str, str]) -> tuple[bool, str]:
        text = files.get(PROGRAM_FILE, "")
        lines = [ln.split(":", 1)[1].strip() if ":" in ln else ln for ln in text.split("\n")]
        return toy_test_log(self.task, lines)

    def _parse(self, text: str):
        first, _, rest = text.strip().partition("\n")
        words = L.lex(first)
        if words == ["read_file"]:
            return ToolCall("read_file", {"path": PROGRAM_FILE})
        if words in (["run_tests"], ["submit"]):
            return ToolCall(words[0], {})
        if words == ["edit"]:
            try:
                new = toy.apply_patch(self.task, rest)
            except toy.PatchError:
                return None  # an invalid action: CodeAgentEnv answers with an error
            self._pending = rest
            return ToolCall(
                "edit", {"path": PROGRAM_FILE, "content": toy.numbered(new.split("\n"))}
            )
        return None

    def step(self, action_text: str):
        self._pending = None
        result = self.env.step(action_text)
        if result.info.get("tool") == "edit" and self._pending is not None:
            self.patch = self._pending
        if result.done:
            self.submitted = True
        if result.info.get("tool") is None:
            result.observation = "error\ntools read_file edit run_tests submit"
        elif result.info.get("tool") == "submit":
            result.observation = "submitted"
        elif result.info.get("tool") == "edit":
            result.observation = "edited" if self._pending is not None else "error"
        elif result.info.get("tool") == "run_tests":
            result.observation = result.observation.split("\n", 1)[1]  # drop "tests passed\n"
        return result


class ToyAgentFamily(ToyFamily):
    """Multi-turn toy code repair through tools (``task.family = "toy_agent"``)."""

    name = "toy_agent"
    multi_turn = True

    def __init__(self, settings):
        if settings.tokenizer_path:
            raise ValueError(
                "task.family='toy_agent' speaks its own vocabulary (the toy tokens and tool "
                f"words): task.tokenizer_path / model.hf_checkpoint must be empty, got "
                f"{settings.tokenizer_path!r} (the single-turn 'toy' family runs on a Hugging "
                "Face checkpoint)"
            )
        super().__init__(settings)

    @property
    def tokenizer(self) -> ToyAgentTokenizer:
        return AGENT_TOKENIZER

    def prompt_text(self, task: toy.ToyTask) -> str:
        body = task.prompt.rsplit("patch\n", 1)[0]
        return f"{body}tools read_file edit run_tests submit\n"

    def make_env(self, task: toy.ToyTask) -> ToyAgentEnv:
        return ToyAgentEnv(task)

    def observation_tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(f"\n{text}\n")

    def verify(self, task: toy.ToyTask, attempt: Attempt) -> Outcome:
        env = attempt.env
        if env is None or not env.submitted:
            reason = getattr(attempt.episode, "finish_reason", "no episode")
            v = toy.verify(task, "")
            return Outcome(
                passed=False,
                test_log=f"episode ended without submit ({reason})",
                flags=tuple(v.cheat_flags),
                patch=getattr(env, "patch", ""),
                detail=toy.Verification(
                    False, False, "not submitted", [], toy._zero_quality(), "not submitted"
                ),
            )
        return _outcome(toy.verify(task, env.patch), env.patch)

    def demonstration_turns(self, task: toy.ToyTask, patch: str) -> list[str]:
        return ["read_file", f"edit\n{patch}", "run_tests", "submit"]

    def token_spans(self, task: toy.ToyTask, attempt: Attempt):
        """Episodes: the generic turn-event mapping of ``TaskFamily.token_spans``."""
        return TaskFamily.token_spans(self, task, attempt)

    def demonstrations(self, num_tasks: int) -> list[Demonstration]:
        """read_file, edit (each passing non-cheat patch kind), run_tests, submit, with the
        observations the environment returns, on ``num_tasks`` tasks of the SFT seed."""
        tok = self.tokenizer
        out = []
        for task in self._sft.tasks(num_tasks):
            prompt = self.prompt_tokens(task)
            for patch in self.demonstration_patches(task):
                env = self.make_env(task)
                tokens, mask = list(prompt), [False] * len(prompt)
                for turn in self.demonstration_turns(task, patch):
                    ids = tok.encode(turn) + [tok.eos_id]
                    tokens += ids
                    mask += [True] * len(ids)
                    result = env.step(tok.decode(ids))
                    if result.done:
                        break
                    obs = self.observation_tokens(result.observation)
                    tokens += obs
                    mask += [False] * len(obs)
                if not (env.submitted and toy.verify(task, env.patch).passed):
                    raise RuntimeError(
                        f"toy_agent demonstration of {task.task_id} did not "
                        "submit a passing patch (a family bug)"
                    )
                out.append(Demonstration(tuple(tokens), tuple(mask), len(prompt)))
        return out
