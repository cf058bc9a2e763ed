"""Python repository tasks: ``RepoTask`` and the ``python_repo`` task family.

A :class:`RepoTask` is a repository snapshot (``{path: text}``), the issue text and the pytest
node ids that must pass (SWE-bench style); ``gagar_jax.verify.verify_repo_patch`` verifies a
candidate patch of it in the sandbox with the task's hidden tests.

The ``python_repo`` family (:class:`PythonRepoFamily`) is multi-turn through the
``CodeAgentEnv`` tools, called in the model's own format (Qwen/Hermes ``<tool_call>`` JSON,
listed in the prompt through the checkpoint's chat template, :data:`TOOLS`):

* ``read_file(path)``, ``edit(path, old, new)`` (one exact occurrence) or ``edit(path,
  content)``, over the pristine repository;
* ``run_tests()``: the task's required tests on the current tree, in the sandbox, *without* the
  hidden ``test_patch`` (the tests the agent may see), on the execution back-end
  (``gagar_jax.verify.execution``: the trainer's process or a Ray cluster);
* ``submit()``: ends the episode. The final patch (the unified diff of the tree against the
  pristine repository) is verified by ``verify_repo_patch`` with the hidden tests and the
  behaviour monitor (which also reads the trajectory). An episode that never submits fails.

Observations are rendered as tool messages of the chat template (``HFTokenizer``). The task
pool is a JSONL file (one ``RepoTask.to_dict()`` per line, as ``gagar_jax.data``'s
``repo_tasks`` builder reads) or a directory of task directories (``task.json`` + ``repo/``).
Demonstrations: for each task with a reference patch, read each file it changes, edit it hunk
by hunk, run the tests, submit, with the observations the environment returns.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from gagar_jax.envs.family import Attempt, Demonstration, GroupMember, Outcome, TaskFamily
from gagar_jax.envs.hf_tokenizer import HFTokenizer, tool_call_text
from gagar_jax.envs.shell import SHELL_TOOLS, ShellRepoEnv, bash_calls
from gagar_jax.grading import schema
from gagar_jax.grading.adapters import SandboxCheckRunner, run_check_in_tree
from gagar_jax.rollout.episode import CodeAgentEnv
from gagar_jax.verify.diff import (
    DiffError,
    apply_patch,
    apply_unified_diff,
    safe_path,
    tree_patch,
)
from gagar_jax.verify.execution import ensure_env, task_env, verify_repo_call
from gagar_jax.verify.layout import detect_pythonpath
from gagar_jax.verify.monitor import MonitorRefusal, monitor_log
from gagar_jax.verify.repo import env_site_packages, prepare_tree, verify_repo_patch
from gagar_jax.verify.untrusted import split_test_log


@dataclasses.dataclass(frozen=True)
class RepoTask:
    """A Python repository task.

    Attributes:
      task_id: unique id.
      issue: the problem statement shown to the policy.
      files: the pristine repository, ``{relative posix path: text}``.
      fail_to_pass: pytest node ids a correct patch makes pass.
      pass_to_pass: pytest node ids that must keep passing.
      test_files: paths reset to pristine before running (the task's tests).
      test_patch: hidden unified diff applied after the reset (may be empty).
      reference_patch: a known-good patch (for tests and demonstrations; may be empty).
      pythonpath: directories of the tree, relative to its root, put on the sandboxed
        interpreter's path besides the root (``("src",)`` for a ``src/`` layout); when empty,
        detected from the tree (``verify.layout.detect_pythonpath``).
      env_path: a virtual environment (``gagar_jax.data.repos.build_env``) whose site-packages
        hold the task's dependencies and pytest; bound read-only into the sandbox ("" = the
        test runner's environment only: pytest and its plugins, never the trainer's packages).
      test_timeout_s: per-test timeout through pytest-timeout (0 = none): a hanging test fails
        that test, not the run.
      env_hash: the environment's content address (interpreter + resolved lockfile), or "".
      image: a local container image the tests run in (``verify.container``), or "".
      dockerfile: an absolute path to a Dockerfile (or its directory) to build that image from
        offline, or "".
      image_python: the interpreter inside the image that has pytest ("" = ``python3``;
        SWE-bench images: ``/opt/miniconda3/envs/testbed/bin/python``).
      image_workdir: where the image holds the repository (SWE-bench images: ``/testbed``):
        the run's work tree is seeded from it (build artefacts), the task's tree copied over
        it ("" = ``/workdir``, nothing seeded).
      harbor_tests: a Harbor task's ``tests/`` directory (absolute; ``data.harbor``): the task
        is verified by its ``test.sh`` in its image (``verify.harbor_run``), its one required
        test ``tests/test.sh::reward``; "" for a pytest task.
    """

    task_id: str
    issue: str
    files: Mapping[str, str]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()
    test_patch: str = ""
    reference_patch: str = ""
    pythonpath: tuple[str, ...] = ()
    env_path: str = ""
    test_timeout_s: float = 0.0
    env_hash: str = ""
    image: str = ""
    dockerfile: str = ""
    image_python: str = ""
    image_workdir: str = ""
    harbor_tests: str = ""

    def __post_init__(self):
        if not self.task_id:
            raise ValueError("RepoTask.task_id must be non-empty")
        if not self.files:
            raise ValueError(f"RepoTask {self.task_id}: files must be a non-empty mapping")
        for p in self.files:
            if safe_path(p) != p:
                raise ValueError(f"RepoTask {self.task_id}: file path {p!r} is not normalised")
        if not self.fail_to_pass:
            raise ValueError(f"RepoTask {self.task_id}: fail_to_pass must name at least one test")
        for tid in self.fail_to_pass + self.pass_to_pass:
            if "::" not in tid:
                raise ValueError(f"RepoTask {self.task_id}: test id {tid!r} is not 'file::name'")
        if not self.pythonpath:  # the layout's own: its pytest configuration's, or src/
            object.__setattr__(self, "pythonpath", detect_pythonpath(self.files))
        for p in self.pythonpath:
            if not isinstance(p, str) or safe_path(p) != p:
                raise ValueError(
                    f"RepoTask {self.task_id}: pythonpath entry {p!r} must be a "
                    "normalised path relative to the repository root"
                )
        if self.env_path and not os.path.isabs(self.env_path):
            raise ValueError(
                f"RepoTask {self.task_id}: env_path {self.env_path!r} must be absolute"
            )
        if not isinstance(self.test_timeout_s, (int, float)) or not self.test_timeout_s >= 0:
            raise ValueError(
                f"RepoTask {self.task_id}: test_timeout_s must be a number >= 0, "
                f"got {self.test_timeout_s!r}"
            )

    @property
    def required_tests(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.fail_to_pass + self.pass_to_pass))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["files"] = dict(self.files)
        for k in ("fail_to_pass", "pass_to_pass", "test_files", "pythonpath"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RepoTask:
        """From a JSON object (one JSONL line); ``files`` is ``{path: text}``."""
        for key in ("task_id", "issue", "files", "fail_to_pass"):
            if key not in d:
                raise ValueError(f"repo task is missing field {key!r}")
        if not isinstance(d["files"], Mapping):
            raise ValueError(f"repo task {d['task_id']}: 'files' must be an object path -> text")
        return cls(
            task_id=str(d["task_id"]),
            issue=str(d["issue"]),
            files=dict(d["files"]),
            fail_to_pass=tuple(d["fail_to_pass"]),
            pass_to_pass=tuple(d.get("pass_to_pass", ())),
            test_files=tuple(d.get("test_files", ())),
            test_patch=str(d.get("test_patch", "")),
            reference_patch=str(d.get("reference_patch", "")),
            pythonpath=tuple(d.get("pythonpath", ())),
            env_path=str(d.get("env_path", "")),
            test_timeout_s=float(d.get("test_timeout_s", 0.0)),
            env_hash=str(d.get("env_hash", "")),
            image=str(d.get("image", "")),
            dockerfile=str(d.get("dockerfile", "")),
            image_python=str(d.get("image_python", "")),
            image_workdir=str(d.get("image_workdir", "")),
            harbor_tests=str(d.get("harbor_tests", "")),
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> RepoTask:
        """Loads ``task.json`` + ``repo/`` (+ ``test_patch_file``/``reference_patch_file``)."""
        path = os.fspath(path)
        with open(os.path.join(path, "task.json")) as f:
            meta = json.load(f)
        files = read_tree(os.path.join(path, "repo"))
        for key in ("test_patch", "reference_patch"):
            if f"{key}_file" in meta:
                with open(os.path.join(path, meta.pop(f"{key}_file"))) as f:
                    meta[key] = f.read()
        return cls.from_dict({**meta, "files": files})


def read_tree(root: str) -> dict[str, str]:
    """All regular text files under ``root`` as ``{posix relative path: text}`` (no symlinks)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__"))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            with open(full, encoding="utf-8") as f:
                out[rel] = f.read()
    return out


class SweReader(NamedTuple):
    """How SWE-bench-format rows become ``RepoTask``s (rows that name a git repository and a
    commit rather than holding the tree): the task data package's reader,
    ``gagar_jax.data.swe``, registered with :func:`register_swe_reader` when it is imported
    (it materialises trees from git and builds environments, a layer above the families)."""

    # (pool path, repos_dir, *, use_image) -> RepoTasks
    load_tasks: Callable[..., list]
    # (row, where, repos_dir, *, use_image) -> RepoTask
    row_task: Callable[..., Any]


_SWE_READER: list[SweReader] = []


def register_swe_reader(reader: SweReader) -> None:
    """Makes ``reader`` the one :func:`load_repo_tasks` reads SWE-bench-format pools with (a
    later call replaces it). ``gagar_jax.data.swe`` registers its own when imported."""
    _SWE_READER[:] = [reader]


def _swe_reader(path: str) -> SweReader:
    if not _SWE_READER:
        raise LookupError(
            f"task pool {path!r} holds SWE-bench-format rows (task.repos_dir is set) and no "
            "reader of them is registered (import gagar_jax.data.swe, which registers it)"
        )
    return _SWE_READER[0]


_HARBOR_READER: list[Callable[[str], RepoTask]] = []


def register_harbor_reader(reader: Callable[[str], RepoTask]) -> None:
    """Registers the reader of Harbor task directories (``path -> RepoTask``) that
    :func:`load_repo_tasks` uses (a later call replaces it). ``gagar_jax.data.harbor`` registers
    its own when imported (``gagar_jax.data.swe`` imports it)."""
    _HARBOR_READER[:] = [reader]


def _harbor_reader(path: str) -> Callable[[str], RepoTask]:
    if not _HARBOR_READER:
        raise LookupError(
            f"task pool {path!r} holds Harbor tasks (task.toml) and no reader of them is "
            "registered (import gagar_jax.data.harbor, which registers it)"
        )
    return _HARBOR_READER[0]


def load_repo_tasks(path: str, repos_dir: str = "", *, container: bool = False) -> list[RepoTask]:
    """Tasks from a ``.jsonl`` file (one ``RepoTask.to_dict()`` per line) or a directory of task
    directories (each with ``task.json`` and ``repo/``, sorted by name), or a Harbor task
    directory or a directory of them (``task.toml``: ``gagar_jax.data.harbor``, verified on the
    container back-end). Errors name the file
    and line. With ``repos_dir``, ``path`` holds SWE-bench-format rows (``.jsonl``, ``.json``,
    ``.parquet`` or a directory of Harbor tasks) naming repositories there, read by the
    registered :class:`SweReader` (``gagar_jax.data.swe.load_tasks``: trees materialised from
    git per commit, environments built once and reused); a ``.jsonl`` pool may mix such rows (a
    line with an ``instance_id``) with ``RepoTask`` lines. ``container`` (a run with
    ``execution.environment="container"``): SWE-bench-format rows run in the image they name,
    and their system setup commands become steps of a derived image, instead of a task error.
    """
    if not path:
        return []
    if repos_dir and not (os.path.isfile(path) and path.endswith(".jsonl")):
        return _swe_reader(path).load_tasks(path, repos_dir, use_image=container)
    if os.path.isfile(path):
        tasks, seen = [], set()
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from e
                if isinstance(obj, dict) and "instance_id" in obj:
                    if not repos_dir:
                        raise ValueError(
                            f"{path}:{n}: a SWE-bench-format row "
                            f"({obj['instance_id']!r}) needs task.repos_dir, the "
                            "directory of its repository"
                        )
                    task = _swe_reader(path).row_task(
                        obj, f"{path}:{n}", repos_dir, use_image=container
                    )
                else:
                    try:
                        task = RepoTask.from_dict(obj)
                    except (ValueError, TypeError) as e:
                        raise ValueError(f"{path}:{n}: not a repo task: {e}") from e
                if task.task_id in seen:
                    raise ValueError(f"{path}:{n}: duplicate task id {task.task_id!r}")
                seen.add(task.task_id)
                tasks.append(task)
        return tasks
    if os.path.isdir(path):
        harbor = sorted(
            d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "task.toml"))
        )
        if harbor or os.path.isfile(os.path.join(path, "task.toml")):
            to_repo_task = _harbor_reader(path)  # Harbor tasks: built in containers
            if not harbor:
                return [to_repo_task(path)]
            return [to_repo_task(os.path.join(path, d)) for d in harbor]
        dirs = sorted(
            d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "task.json"))
        )
        if not dirs and os.path.isfile(os.path.join(path, "task.json")):
            return [RepoTask.from_dir(path)]
        return [RepoTask.from_dir(os.path.join(path, d)) for d in dirs]
    raise FileNotFoundError(
        f"task pool {path!r} (task.data_path) is neither a .jsonl file nor a directory"
    )


# ---------------------------------------------------------------------------------------------
# The python_repo family
# ---------------------------------------------------------------------------------------------
def _function(name: str, description: str, properties: dict, required: Sequence[str] = ()):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


_STR = {"type": "string"}
TOOLS = (
    _function("read_file", "Read one file of the repository.", {"path": _STR}, ["path"]),
    _function(
        "edit",
        "Replace the one exact occurrence of `old` by `new` in a file (or write "
        "the whole file with `content`).",
        {"path": _STR, "old": _STR, "new": _STR, "content": _STR},
        ["path"],
    ),
    _function("run_tests", "Run the task's tests on the current repository.", {}),
    _function("submit", "Submit the current repository as the solution (ends the episode).", {}),
)
SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. Call one "
    "tool per turn; submit when the tests pass."
)


def repo_prompt_messages(task: RepoTask) -> list[dict[str, str]]:
    files = "\n".join(sorted(task.files))
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Issue:\n{task.issue}\n\nRepository files:\n{files}"},
    ]


def tree_digest(files: Mapping[str, str]) -> str:
    """SHA-256 of a tree (``{path: text}``, order-free): two trees are the same iff equal."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(json.dumps([path, files[path]]).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


VERIFY_LOG_ENV = "GAGAR_VERIFY_LOG"


def _audit(record: Mapping[str, Any]) -> None:
    """Appends ``record`` to the JSONL file named by ``$GAGAR_VERIFY_LOG`` (if set): where each
    verification ran and which tree each graded group saw (``scripts/e2e.py`` checks it)."""
    path = os.environ.get(VERIFY_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(record)) + "\n")


def visible_test_ids(task: RepoTask) -> tuple[str, ...]:
    """The required test ids the agent's ``run_tests`` can run: those whose file is in the
    pristine repository and whose class and function names appear in it (a test the hidden
    ``test_patch`` adds, to a new file or to an existing one, is left out)."""
    out = []
    for tid in task.required_tests:
        path, _, rest = tid.partition("::")
        text = task.files.get(path)
        if text is None:
            continue
        names = [part.split("[", 1)[0] for part in rest.split("::")]
        if all(re.search(rf"\b(def|class)\s+{re.escape(n)}\b", text) for n in names):
            out.append(tid)
    return tuple(out)


class RepoAgentEnv:
    """One ``python_repo`` episode: ``CodeAgentEnv`` over the pristine files; ``run_tests`` runs
    the required tests in the sandbox without the hidden test patch."""

    def __init__(self, task: RepoTask, *, verify_kwargs: Mapping[str, Any] | None = None):
        self.task = task
        self.submitted = False
        self.phase = "rollout"  # "demonstration" while a demonstration is built (audit records)
        self.verify_kwargs = dict(verify_kwargs or {})
        self.env = CodeAgentEnv(dict(task.files), self._run_tests)

    def _run_tests(self, files: dict[str, str]) -> tuple[bool, str]:
        ids = visible_test_ids(self.task)
        hidden = len(self.task.required_tests) - len(ids)
        if not ids:
            return False, (
                f"no test ran: the task's {hidden} required test(s) are not in the visible tests"
            )
        # Only the visible ids: pytest ends a whole session with a usage error when an id on its
        # command line names a file or a test that does not exist.
        visible = dataclasses.replace(self.task, test_patch="", fail_to_pass=ids, pass_to_pass=())
        v = verify_repo_call(
            visible, tree_patch(self.task.files, files), run_monitor=False, **self.verify_kwargs
        )
        _audit(
            {
                "kind": "run_tests",
                "phase": self.phase,
                "task_id": self.task.task_id,
                "status": v.status,
                "env_hash": self.task.env_hash,
                "env_path": self.task.env_path,
                "sandbox_pythonpath": list(getattr(v, "pythonpath", ())),
                "tree": tree_digest(self.task.files),
            }
        )
        if v.status in ("infra_error", "timeout", "resource_killed") or v.patch_error:
            return False, f"{v.status}: {v.patch_error or v.test_log[-500:]}"
        lines = [f"{o.upper()} {t}" for t, o in v.tests.items()]
        if hidden:
            lines.append(f"({hidden} required test(s) are not in the visible tests)")
        return all(o == "passed" for o in v.tests.values()), "\n".join(lines)

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


class TaskEnvCheckRunner:
    """``grading.adapters.SandboxCheckRunner`` per task environment: the checks of a group whose
    task has an ``env_path`` see that environment's site-packages (read-only) and the task's
    ``pythonpath`` on ``PYTHONPATH``, as the verifier's runs do; other groups get the plain
    runner. ``group_tasks``: group id -> task, filled by the family's ``workspace``."""

    def __init__(self, group_tasks: Mapping[str, RepoTask], **runner_kwargs):
        self._groups = group_tasks
        self._kwargs = runner_kwargs
        self._plain = SandboxCheckRunner(**runner_kwargs)
        self._by_env: dict[tuple, Any] = {}

    def runner_for(self, task: RepoTask | None):
        if task is None or not task.env_path:
            return self._plain
        key = (task.env_path, task.pythonpath)
        if key not in self._by_env:
            site = env_site_packages(task.env_path)
            r = SandboxCheckRunner(**self._kwargs)
            base = tuple(self._kwargs.get("ro_paths", ()))
            r.ro_paths = base + site
            r.env = {"PYTHONPATH": os.pathsep.join([*site, ".", *task.pythonpath])}
            if task.env_hash:  # on a cluster: the node's own copy of the environment
                spec = task_env(task)
                r.node_call = (spec, run_check_in_node_env, (spec, task.pythonpath, base))
            self._by_env[key] = r
        return self._by_env[key]

    def run(self, workspace, candidate, command, time_limit_s=None):
        return self.runner_for(self._groups.get(workspace.group_id)).run(
            workspace, candidate, command, time_limit_s=time_limit_s
        )


def run_check_in_node_env(files, argv, limits, config, spec, pythonpath, ro_paths):
    """``grading.adapters.run_check_in_tree`` with the task environment ``spec`` of this node
    (built once here: ``verify.execution.ensure_env``): its site-packages read-only and on
    ``PYTHONPATH`` with the tree's ``pythonpath``, as ``TaskEnvCheckRunner`` gives them on the
    trainer."""
    site = env_site_packages(ensure_env(spec.env_hash, spec.build))
    env = {"PYTHONPATH": os.pathsep.join([*site, ".", *pythonpath])}
    return run_check_in_tree(files, argv, limits, config, env, tuple(ro_paths) + site)


class PythonRepoFamily(TaskFamily):
    """Repository tasks, multi-turn through tools (``task.family = "python_repo"``).

    Settings: ``data_path`` (the pool), ``eval_data_path`` (held-out pool; "" = the last
    ``num_eval`` tasks of the pool), ``repos_dir`` (the pool is SWE-bench-format rows whose
    repositories live there: imported or ``gagar_jax.data.synth`` tasks), ``num_train`` (at
    most this many training tasks),
    ``tokenizer_path`` (required: a Hugging Face tokenizer with a chat template),
    ``extra["demo_data_path"]`` (demonstration tasks; default: the training tasks),
    ``extra["verify_kwargs"]`` (passed to ``verify_repo_patch``: limits, extra_pythonpath),
    ``extra["tools"]`` ("structured": ``read_file``/``edit``/``run_tests``/``submit``, the
    default; "bash": a ``bash`` tool in a sandboxed checkout of the task and ``submit``, see
    ``gagar_jax.envs.shell``; the workspace's final diff is verified the same way).
    """

    name = "python_repo"
    multi_turn = True

    def __init__(self, settings):
        super().__init__(settings)
        if not settings.tokenizer_path:
            raise ValueError(
                "task.family='python_repo' needs a Hugging Face tokenizer: set "
                "task.tokenizer_path or model.hf_checkpoint"
            )
        self._tokenizer = HFTokenizer(settings.tokenizer_path)
        repos_dir = getattr(settings, "repos_dir", "")
        container = settings.extra.get("environment", "uv") == "container"
        pool = load_repo_tasks(settings.data_path, repos_dir, container=container)
        if not pool:
            raise ValueError(f"task.data_path={settings.data_path!r} holds no repo tasks")
        if settings.eval_data_path:
            self._eval = load_repo_tasks(settings.eval_data_path, repos_dir, container=container)[
                : settings.num_eval
            ]
            train = pool
        else:
            n_eval = min(settings.num_eval, len(pool) - 1)
            self._eval = pool[len(pool) - n_eval :] if n_eval > 0 else []
            train = pool[: len(pool) - n_eval]
        self._train = train[: settings.num_train] if settings.num_train > 0 else train
        self._verify_kwargs = dict(settings.extra.get("verify_kwargs", {}))
        self._tools = settings.extra.get("tools", "structured")
        if self._tools not in ("structured", "bash"):
            raise ValueError(f"task.tools must be 'structured' or 'bash', got {self._tools!r}")
        self._group_tasks: dict[str, RepoTask] = {}
        demo_path = settings.extra.get("demo_data_path", "")
        self._demo_tasks = (
            load_repo_tasks(demo_path, repos_dir, container=container) if demo_path else self._train
        )

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_task(self, index: int) -> RepoTask:
        if not 0 <= index < self.num_train:
            raise IndexError(f"train task index {index} outside [0, {self.num_train})")
        return self._train[index]

    def eval_tasks(self) -> list[RepoTask]:
        return list(self._eval)

    def prompt_tokens(self, task: RepoTask) -> list[int]:
        tools = SHELL_TOOLS if self._tools == "bash" else TOOLS
        ids = self._tokenizer.render_prompt(repo_prompt_messages(task), tools=tools)
        if len(ids) > self.settings.max_prompt_len:
            raise ValueError(
                f"task {task.task_id}: prompt is {len(ids)} tokens > "
                f"rollout.max_prompt_len={self.settings.max_prompt_len}"
            )
        return ids

    def make_env(self, task: RepoTask) -> RepoAgentEnv | ShellRepoEnv:
        if self._tools == "bash":
            return ShellRepoEnv(task)
        return RepoAgentEnv(task, verify_kwargs=self._verify_kwargs)

    def observation_tokens(self, text: str) -> list[int]:
        return self._tokenizer.tool_message_tokens(text)

    def verify(self, task: RepoTask, attempt: Attempt) -> Outcome:
        env = attempt.env
        autosubmit = (
            env is not None and not env.submitted and self.settings.extra.get("autosubmit", False)
        )
        if env is None or not (env.submitted or autosubmit):
            reason = getattr(attempt.episode, "finish_reason", "no episode")
            return Outcome(
                passed=False,
                test_log=f"episode ended without submit ({reason})",
                patch=env.patch() if env is not None else "",
            )
        patch = env.patch()
        refused = getattr(env, "refused", ())
        if isinstance(env, ShellRepoEnv):
            env.close()  # the checkout is done with: the verifier takes a pristine tree
        if refused:
            reasons = "; ".join(f"{path}: {why}" for path, why in refused)
            return Outcome(passed=False, test_log=f"workspace diff refused: {reasons}", patch="")
        v = verify_repo_call(task, patch, events=attempt.trajectory(), **self._verify_kwargs)
        if autosubmit:
            reason = getattr(attempt.episode, "finish_reason", "no episode")
            note = f"episode ended without submit ({reason}); its final tree verified "
            v = dataclasses.replace(v, test_log=note + "(task.autosubmit)\n" + v.test_log)
        _audit(
            {
                "kind": "verify",
                "phase": getattr(env, "phase", "rollout"),
                "autosubmit": bool(autosubmit),
                "task_id": task.task_id,
                "status": v.status,
                "env_hash": task.env_hash,
                "env_path": task.env_path,
                "sandbox_pythonpath": list(getattr(v, "pythonpath", ())),
                "tree": tree_digest(task.files),
            }
        )
        return Outcome(
            passed=v.passed,
            infra_error=v.infra_error,
            cheat=v.cheat,
            test_log=v.test_log,
            flags=tuple(v.flags),
            patch=patch,
            detail=v,
        )

    def workspace(self, group_id: str, task: RepoTask, members: Sequence[GroupMember]):
        cands = [
            repo_candidate(
                m.candidate_id,
                m.outcome.patch,
                m.outcome,
                trajectory=m.attempt.trajectory(),
                summary=m.attempt.summary(),
                task=task,
            )
            for m in members
        ]
        self._group_tasks[group_id] = task
        while len(self._group_tasks) > 4096:  # groups graded long ago
            self._group_tasks.pop(next(iter(self._group_tasks)))
        ws = repo_workspace(task, group_id, cands)
        _audit(
            {
                "kind": "grade",
                "group_id": group_id,
                "task_id": task.task_id,
                "tree": tree_digest(ws.repo_files),
                "env_path": task.env_path,
                "check_pythonpath": TaskEnvCheckRunner({})
                .runner_for(task)
                .env.get("PYTHONPATH", "")
                if task.env_path
                else "",
            }
        )
        return ws

    def check_runner(self):
        """The grader's sandboxed check runner: a group's checks run with its task's
        environment and ``pythonpath`` (``TaskEnvCheckRunner``)."""
        return TaskEnvCheckRunner(self._group_tasks)

    # ---- demonstrations ------------------------------------------------------------------
    def demonstration_calls(self, task: RepoTask) -> list[tuple[str, dict[str, Any]]]:
        """Tool calls that turn the pristine tree into the reference patch's: ``read_file``
        then one ``edit(path, old, new)`` per changed block of each file (whole-file ``edit``
        for new files or when a block's text is not unique), then ``run_tests`` and
        ``submit``."""
        after = apply_unified_diff(task.files, task.reference_patch)
        calls: list[tuple[str, dict[str, Any]]] = []
        for path in sorted(set(after) | set(task.files)):
            a, b = task.files.get(path), after.get(path)
            if a == b or b is None:
                continue
            if a is None:
                calls.append(("edit", {"path": path, "content": b}))
                continue
            calls.append(("read_file", {"path": path}))
            cur = a
            al, bl = a.splitlines(keepends=True), b.splitlines(keepends=True)
            ops = difflib.SequenceMatcher(a=al, b=bl, autojunk=False).get_opcodes()
            # blocks from the end so earlier offsets stay valid; each grows by context lines
            # until its old text is unique in the current file
            for tag, i1, i2, j1, j2 in reversed(ops):
                if tag == "equal":
                    continue
                lo, hi = i1, i2
                while True:
                    old = "".join(al[lo:hi])
                    if old and cur.count(old) == 1:
                        break
                    if lo == 0 and hi == len(al):
                        old = None
                        break
                    lo, hi = max(lo - 1, 0), min(hi + 1, len(al))
                if old is None:
                    calls.append(("edit", {"path": path, "content": b}))
                    break
                new = "".join(al[lo:i1]) + "".join(bl[j1:j2]) + "".join(al[i2:hi])
                calls.append(("edit", {"path": path, "old": old, "new": new}))
                cur = cur.replace(old, new)
            if cur != b:
                raise RuntimeError(
                    f"{task.task_id}: demonstration edits of {path} do not "
                    "reproduce the reference patch (a family bug)"
                )
        calls += [("run_tests", {}), ("submit", {})]
        return bash_calls(calls) if self._tools == "bash" else calls

    def demonstrations(self, num_tasks: int) -> list[Demonstration]:
        """Tool-call trajectories from the reference patches of up to ``num_tasks`` tasks,
        with the observations the environment really returns; tasks whose reference patch is
        missing, does not apply or whose submitted patch fails the hidden tests are skipped."""
        tok = self._tokenizer
        out = []
        for task in [t for t in self._demo_tasks if t.reference_patch.strip()][:num_tasks]:
            try:
                calls = self.demonstration_calls(task)
            except (DiffError, ValueError):
                continue
            prompt = self.prompt_tokens(task)
            env = self.make_env(task)
            env.phase = "demonstration"
            tokens, mask = list(prompt), [False] * len(prompt)
            for name, args in calls:
                ids = tok.encode(tool_call_text(name, args)) + [tok.eos_id]
                tokens += ids
                mask += [True] * len(ids)
                result = env.step(tok.decode(ids))
                if result.done:
                    break
                obs = self.observation_tokens(result.observation)
                tokens += obs
                mask += [False] * len(obs)
            if env.submitted and self.verify(task, Attempt(env=env)).passed:
                out.append(Demonstration(tuple(tokens), tuple(mask), len(prompt)))
        return out


# The family's grading workspace


def repo_candidate(
    candidate_id: str,
    patch: str,
    verification: Any,
    *,
    trajectory: Sequence[Any] = (),
    summary: str = "",
    task: Any = None,
) -> schema.Candidate:
    """A Python-repository rollout (``verify.verify_repo_patch`` result) as a grading ``Candidate``.

    With ``task``, the candidate carries the patch as it ran: the changes the verifier kept
    (``verify.diff.apply_patch``, the verifier's own parse and applier, less the files
    ``verify.repo.prepare_tree`` reset to pristine, which never ran and which no view shows as
    the candidate's work; the monitor's flags still say they were edited), and the tree the
    verifier prepared from it (protected files reset, hidden tests applied), which the grader's
    ``run_check`` runs in. An infrastructure error is not a pass (and should be masked by the
    caller, not graded).
    """
    applied = prepared = None
    view = patch
    if task is not None:
        try:
            applied = apply_patch(task.files, patch) if patch.strip() else None
            # its canonical text: the same parse; the tree as changes to the task's files
            tree, _ = prepare_tree(task, applied.text if applied is not None else "")
            prepared = {p: t for p, t in tree.items() if task.files.get(p) != t}
            prepared.update({p: None for p in task.files if p not in tree})
            if applied is not None:
                ran = dict(task.files)
                for p in set(applied.before) | set(applied.after):
                    if p in applied.after and tree.get(p) == applied.after[p]:
                        ran[p] = applied.after[p]  # a change that ran
                    elif p not in applied.after and p not in tree:
                        ran.pop(p, None)  # a deletion that ran
                view = tree_patch(task.files, ran)
                applied = apply_patch(task.files, view) if view else None
        except (DiffError, ValueError):
            prepared = None  # it did not apply or the verifier refused its tree: no checks
    return schema.Candidate(
        candidate_id=candidate_id,
        patch=applied.text if applied is not None else view,
        passed=bool(verification.passed),
        test_log=verification.test_log,
        trajectory=tuple(trajectory),
        summary=summary,
        monitor_flags=tuple(verification.flags) + log_flags(verification.test_log),
        applied=applied,
        prepared=prepared,
        verdict_lines=verdict_lines(verification),
    )


def verdict_lines(verification: Any) -> tuple[str, ...]:
    """The verdict as lines built from the verifier's structured result (its status and the
    task's test ids with their outcomes): what a grader may read as the verifier's own."""
    detail = getattr(verification, "detail", None)  # a family Outcome holds the verification
    v = detail if hasattr(detail, "tests") else verification
    status = str(getattr(v, "status", "passed" if verification.passed else "failed"))
    tests = getattr(v, "tests", None) or {}
    return (f"status: {status}", *(f"{str(o).upper():8s} {t}" for t, o in tests.items()))


def log_flags(test_log: str) -> tuple:
    """Monitor flags of what the candidate's code printed (the part of a verifier log after its
    header): text addressed to the grader, imitations of the verifier's header lines."""
    try:
        return tuple(monitor_log(split_test_log(test_log or "")[1], source="test output"))
    except MonitorRefusal:
        return ()  # the log is clipped by the verifier: a refusal here is not the candidate's


def repo_workspace(
    task: Any, group_id: str, candidates: Sequence[schema.Candidate]
) -> schema.GroupWorkspace:
    """The workspace of a :class:`RepoTask`: issue text and pristine files (scope inferred)."""
    return schema.GroupWorkspace(
        group_id=group_id,
        task_text=task.issue,
        repo_files=dict(task.files),
        candidates=tuple(candidates),
    )


def repo_group(task: Any, group_id: str, patches: Sequence[str], **verify_kwargs: Any):
    """Verifies each patch in the sandbox; builds the workspace (candidates ``r0``, ``r1``, ...)."""
    cands = [
        repo_candidate(f"r{k}", p, verify_repo_patch(task, p, **verify_kwargs), task=task)
        for k, p in enumerate(patches)
    ]
    return repo_workspace(task, group_id, cands)
