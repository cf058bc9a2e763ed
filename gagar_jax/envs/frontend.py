"""The ``frontend`` task family: small HTML/JS tasks judged in a real browser.

A :class:`FrontendTask` is a starting page (``{path: text}``: markup without working behaviour),
an instruction, and a rubric (``verify.browser_rubric``) that says what a user must be able to do.
The policy edits the HTML/JS through the code-agent tools (``read_file``, ``edit``,
``run_tests``, ``submit``; the same ``CodeAgentEnv`` and tool schema as ``python_repo``);
``run_tests`` and the final verification run the browser judge (``verify.browser.BrowserJudge``)
on the current files. ``Outcome.passed`` is ``score >= pass_threshold`` (default 0.5);
``quality["checklist_pass_rate"]`` and the judge's report (one ``PASS``/``FAIL`` line per item)
go to the grader, whose ``BrowserGrader`` turns pass rates into tiers.

Tasks are generated (CPU-sized, seeded, random access) from three templates with varied labels
and numbers: a counter (increment by ``step``, reset), a to-do list (add by button and Enter),
and a details toggle (show/hide a paragraph). Each carries a reference solution for tests and
demonstrations. ``data_path`` may instead name a JSONL pool of ``FrontendTask.to_dict()``.

Settings: ``tokenizer_path`` (a Hugging Face tokenizer with a chat template, required for
prompts), ``extra["pass_threshold"]``, ``extra["judge_kwargs"]`` (``BrowserJudge`` arguments).
One judge (one kept browser) serves the family; ``close()`` ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.envs.family import Attempt, GroupMember, Outcome, TaskFamily
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.envs.repo import TOOLS
from gagar_jax.grading import schema
from gagar_jax.grading.browser import BrowserGrader, write_artifact
from gagar_jax.rollout.episode import CodeAgentEnv
from gagar_jax.verify.browser import BrowserJudge
from gagar_jax.verify.browser_rubric import validate_rubric
from gagar_jax.verify.diff import tree_patch

TEMPLATES = ("counter", "todo", "toggle")
SYSTEM_PROMPT = (
    "You are a front-end engineer. Make the page in the repository work as the task "
    "says by editing its HTML/JS. Call one tool per turn; submit when the checks "
    "pass."
)


@dataclasses.dataclass(frozen=True)
class FrontendTask:
    """A front-end task: starting ``files``, the ``instruction``, the ``rubric`` (a dict)."""

    task_id: str
    instruction: str
    files: Mapping[str, str]
    rubric: Mapping[str, Any]
    solution: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):

        if not self.task_id:
            raise ValueError("FrontendTask.task_id must be non-empty")
        validate_rubric(self.rubric)  # a RubricError names the field
        if validate_rubric(self.rubric).entry not in self.files:
            raise ValueError(f"FrontendTask {self.task_id}: entry page is not in files")

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "instruction": self.instruction,
            "files": dict(self.files),
            "rubric": dict(self.rubric),
            "solution": dict(self.solution),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrontendTask:
        for key in ("task_id", "instruction", "files", "rubric"):
            if key not in d:
                raise ValueError(f"frontend task is missing field {key!r}")
        return cls(
            str(d["task_id"]),
            str(d["instruction"]),
            dict(d["files"]),
            dict(d["rubric"]),
            dict(d.get("solution", {})),
        )


def _page(title: str, body: str, script: str = "") -> str:
    s = f"<script>\n{script}\n</script>\n" if script else ""
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n'
        f"<body>\n{body}\n{s}</body></html>\n"
    )


def _click(name: str) -> dict:
    return {"click": {"role": "button", "name": name}}


def make_task(template: str, index: int, seed: int = 0) -> FrontendTask:
    """The ``index``-th task of ``template`` (depends only on the arguments)."""
    rng = random.Random(f"gagar-frontend:{seed}:{template}:{index}")
    tid = f"fe-{template}-s{seed}-{index}"
    if template == "counter":
        inc = rng.choice(["Increment", "Add one", "Plus", "Count up"])
        reset = rng.choice(["Reset", "Clear", "Start over"])
        step = rng.randint(1, 3)
        body = (
            f'<p id="out">Count: 0</p>\n<button id="inc">{inc}</button> '
            f'<button id="reset">{reset}</button>'
        )
        script = (
            f"let n = 0; const out = document.getElementById('out');\n"
            f"document.getElementById('inc').onclick = () => {{ n += {step}; "
            "out.textContent = 'Count: ' + n; };\n"
            "document.getElementById('reset').onclick = () => { n = 0; "
            "out.textContent = 'Count: ' + n; };"
        )
        instruction = (
            f"Clicking '{inc}' must add {step} to the count shown as 'Count: N'; "
            f"'{reset}' sets it back to 0."
        )
        rubric = {
            "entry": "index.html",
            "items": [
                {
                    "id": "increments",
                    "description": f"two clicks on {inc} show Count: {2 * step}",
                    "actions": [_click(inc), _click(inc)],
                    "expect": [{"text_visible": f"Count: {2 * step}"}],
                },
                {
                    "id": "resets",
                    "description": f"{reset} shows Count: 0",
                    "actions": [_click(reset)],
                    "expect": [{"text_visible": "Count: 0"}],
                },
                {
                    "id": "counts_again",
                    "description": f"one click after the reset shows Count: {step}",
                    "actions": [_click(inc)],
                    "expect": [{"text_visible": f"Count: {step}"}, {"no_console_errors": True}],
                },
            ],
        }
    elif template == "todo":
        add = rng.choice(["Add item", "Add", "Save item"])
        box = rng.choice(["New item", "Task", "What to do"])
        words = rng.sample(["milk", "eggs", "bread", "tea", "rice", "soap"], 2)
        body = (
            f'<label for="new">{box}</label><input id="new" type="text">\n'
            f'<button id="add">{add}</button>\n<ul id="list"></ul>'
        )
        script = (
            "const input = document.getElementById('new'), "
            "list = document.getElementById('list');\n"
            "function add() { const v = input.value.trim(); if (!v) return;\n"
            "  const li = document.createElement('li'); li.textContent = v; "
            "list.appendChild(li); input.value = ''; }\n"
            "document.getElementById('add').addEventListener('click', add);\n"
            "input.addEventListener('keydown', e => {\n"
            "  if (e.key === 'Enter') add(); });"
        )
        instruction = (
            f"Typing into '{box}' and clicking '{add}' (or pressing Enter) must append "
            "the text to the list and clear the box."
        )
        tb = {"role": "textbox", "name": box}
        rubric = {
            "entry": "index.html",
            "items": [
                {
                    "id": "adds_by_button",
                    "description": f"{add} appends {words[0]}",
                    "actions": [{"fill": tb, "text": words[0]}, _click(add)],
                    "expect": [
                        {"text_visible": words[0]},
                        {"count": {"css": "#list li"}, "equals": 1},
                        {"value": tb, "equals": ""},
                    ],
                },
                {
                    "id": "adds_by_enter",
                    "description": f"Enter appends {words[1]}",
                    "actions": [{"fill": tb, "text": words[1]}, {"press": tb, "key": "Enter"}],
                    "expect": [
                        {"count": {"css": "#list li"}, "equals": 2},
                        {"text_visible": words[1]},
                    ],
                },
            ],
        }
    elif template == "toggle":
        show = rng.choice(["Show details", "More", "Expand"])
        text = rng.choice(["Ships in 3 days.", "Made of oak.", "Battery lasts a week."])
        body = (
            f'<h1>Product</h1>\n<button id="toggle">{show}</button>\n'
            f'<p id="details" hidden>{text}</p>'
        )
        script = (
            "const d = document.getElementById('details');\n"
            "document.getElementById('toggle').onclick = () => { d.hidden = !d.hidden; };"
        )
        instruction = f"'{show}' must show the details paragraph; clicking again hides it."
        rubric = {
            "entry": "index.html",
            "items": [
                {
                    "id": "shows",
                    "description": f"{show} shows the details",
                    "actions": [_click(show)],
                    "expect": [{"text_visible": text}],
                },
                {
                    "id": "hides",
                    "description": "a second click hides them",
                    "actions": [_click(show)],
                    "expect": [{"count": {"css": "#details:not([hidden])"}, "equals": 0}],
                },
                {
                    "id": "shows_again",
                    "description": "a third click shows them again",
                    "actions": [_click(show)],
                    "expect": [{"text_visible": text}],
                },
            ],
        }
    else:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    title = template.capitalize()
    return FrontendTask(
        tid,
        instruction,
        {"index.html": _page(title, body)},
        rubric,
        {"index.html": _page(title, body, script)},
    )


def generated_tasks(n: int, seed: int = 0, start: int = 0) -> list[FrontendTask]:
    return [
        make_task(TEMPLATES[i % len(TEMPLATES)], i // len(TEMPLATES), seed)
        for i in range(start, start + n)
    ]


def load_frontend_tasks(path: str) -> list[FrontendTask]:
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    tasks.append(FrontendTask.from_dict(json.loads(line)))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a frontend task: {e}") from e
    return tasks


class FrontendJudgeRunner:
    """Runs the browser judge on a file tree: ``(files) -> (passed, report, verdict)``."""

    def __init__(self, pass_threshold: float = 0.5, judge_kwargs: Mapping[str, Any] | None = None):
        if not 0.0 <= pass_threshold <= 1.0:
            raise ValueError(f"pass_threshold must be in [0, 1], got {pass_threshold!r}")
        self.pass_threshold = float(pass_threshold)
        self.judge_kwargs = dict(judge_kwargs or {})
        self._judge = None
        self._lock = threading.Lock()

    @property
    def judge(self):
        with self._lock:
            if self._judge is None:
                self._judge = BrowserJudge(**{"keep_browser": True, **self.judge_kwargs})
            return self._judge

    def run(self, files: Mapping[str, str], rubric: Any):

        with tempfile.TemporaryDirectory(prefix="gagar-frontend-") as d:
            try:
                write_artifact(d, files)
            except ValueError as e:
                return False, f"bad file path: {e}", None
            v = self.judge.judge(d, rubric)
        return v.status == "ok" and v.score >= self.pass_threshold, v.report(), v

    def close(self) -> None:
        with self._lock:
            if self._judge is not None:
                self._judge.close()
                self._judge = None


class FrontendAgentEnv:
    """One episode: ``CodeAgentEnv`` over the starting files; the browser judge runs the tests."""

    def __init__(self, task: FrontendTask, runner: FrontendJudgeRunner):

        self.task = task
        self.runner = runner
        self.submitted = False
        self.env = CodeAgentEnv(dict(task.files), self._run_tests)

    def _run_tests(self, files: dict[str, str]) -> tuple[bool, str]:
        passed, report, _ = self.runner.run(files, self.task.rubric)
        return passed, report

    @property
    def files(self) -> dict[str, str]:
        return self.env.files

    def patch(self) -> str:

        return tree_patch(self.task.files, self.env.files)

    def step(self, action_text: str):
        result = self.env.step(action_text)
        if result.done:
            self.submitted = True
        return result


class FrontendFamily(TaskFamily):
    """Front-end tasks, multi-turn through tools (``task.family = "frontend"``)."""

    name = "frontend"
    multi_turn = True

    def __init__(self, settings):
        super().__init__(settings)
        if settings.data_path:
            pool = load_frontend_tasks(settings.data_path)
            n_eval = min(settings.num_eval, max(0, len(pool) - 1))
            self._train = pool[: len(pool) - n_eval]
            self._eval = pool[len(pool) - n_eval :] if n_eval else []
            if settings.num_train > 0:
                self._train = self._train[: settings.num_train]
        else:
            self._train = generated_tasks(settings.num_train, settings.seed)
            self._eval = generated_tasks(settings.num_eval, settings.seed + 1_000_003)
        self.runner = FrontendJudgeRunner(
            float(settings.extra.get("pass_threshold", 0.5)),
            settings.extra.get("judge_kwargs"),
        )
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if not self.settings.tokenizer_path:
                raise ValueError(
                    "task.family='frontend' needs a Hugging Face tokenizer: set "
                    "task.tokenizer_path or model.hf_checkpoint"
                )
            self._tokenizer = HFTokenizer(self.settings.tokenizer_path)
        return self._tokenizer

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_task(self, index: int) -> FrontendTask:
        if not 0 <= index < self.num_train:
            raise IndexError(f"train task index {index} outside [0, {self.num_train})")
        return self._train[index]

    def eval_tasks(self) -> list[FrontendTask]:
        return list(self._eval)

    def prompt_messages(self, task: FrontendTask) -> list[dict[str, str]]:
        files = "\n".join(sorted(task.files))
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Task:\n{task.instruction}\n\nFiles:\n{files}"},
        ]

    def prompt_tokens(self, task: FrontendTask) -> list[int]:

        ids = self.tokenizer.render_prompt(self.prompt_messages(task), tools=TOOLS)
        if len(ids) > self.settings.max_prompt_len:
            raise ValueError(
                f"task {task.task_id}: prompt is {len(ids)} tokens > "
                f"rollout.max_prompt_len={self.settings.max_prompt_len}"
            )
        return ids

    def make_env(self, task: FrontendTask) -> FrontendAgentEnv:
        return FrontendAgentEnv(task, self.runner)

    def observation_tokens(self, text: str) -> list[int]:
        return self.tokenizer.tool_message_tokens(text)

    def verify_files(self, task: FrontendTask, files: Mapping[str, str]) -> Outcome:

        patch = tree_patch(task.files, files)
        try:
            passed, report, v = self.runner.run(files, task.rubric)
        except Exception as e:  # noqa: BLE001 - a verifier crash is masked, never scored
            return Outcome(False, infra_error=True, test_log=f"judge error: {e}", patch=patch)
        if v is None:
            return Outcome(False, test_log=report, patch=patch)
        return Outcome(
            passed=passed,
            infra_error=v.status != "ok",
            test_log=report,
            quality={"checklist_pass_rate": v.pass_rate},
            patch=patch,
            detail=v,
        )

    def verify(self, task: FrontendTask, attempt: Attempt) -> Outcome:
        env = attempt.env
        if env is None or not env.submitted:
            reason = getattr(attempt.episode, "finish_reason", "no episode")
            return Outcome(
                passed=False,
                test_log=f"episode ended without submit ({reason})",
                patch=env.patch() if env is not None else "",
            )
        return self.verify_files(task, env.files)

    def workspace(self, group_id: str, task: FrontendTask, members: Sequence[GroupMember]):

        cands = [
            schema.Candidate(
                candidate_id=m.candidate_id,
                patch=m.outcome.patch,
                passed=bool(m.outcome.passed) and not m.outcome.infra_error,
                test_log=m.outcome.test_log,
                trajectory=tuple(m.attempt.trajectory()),
                summary=m.attempt.summary(),
                monitor_flags=tuple(m.outcome.flags),
            )
            for m in members
        ]
        return schema.GroupWorkspace(
            group_id,
            f"{task.instruction}\n\nRUBRIC:\n{json.dumps(task.rubric)}",
            dict(task.files),
            tuple(cands),
            scope_files=tuple(task.files),
        )

    def grader(self, **kwargs: Any):
        """A ``BrowserGrader`` sharing the family's judge; the rubric is read from the task text
        of the workspace (``workspace`` appends it after ``RUBRIC:``)."""

        def rubric_for(ws) -> Any:
            return json.loads(ws.task_text.rsplit("RUBRIC:\n", 1)[1])

        return BrowserGrader(self.runner.judge, rubric_for, **kwargs)

    def close(self) -> None:
        self.runner.close()


def write_task_dir(task: FrontendTask, root: str | os.PathLike) -> None:
    """Writes a task's starting page under ``root`` (for looking at it in a browser)."""

    write_artifact(os.fspath(root), task.files)
