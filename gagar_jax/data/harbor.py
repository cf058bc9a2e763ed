"""Harbor tasks as repository tasks of the loop and of ``swe validate``, on the container back-end.

A Harbor task is a directory: ``task.toml`` (timeouts, resources, metadata), ``instruction.md``
(what the agent is asked), ``environment/`` (a ``Dockerfile`` and its build context; or
``[environment] docker_image``), ``tests/`` (``test.sh``, which writes the reward to
``/logs/verifier/reward.txt``) and, optionally, ``solution/solve.sh`` (the reference solution).
The ``harbor`` package's own models need Python >= 3.12 (this project supports 3.11), so this
module reads the documented format itself (:func:`read_harbor_task`).

:func:`to_repo_task` makes a :class:`~gagar_jax.envs.repo.RepoTask` of one: its image built
offline (``verify.container.ensure_image``), its ``files`` the text files of the image's working
directory, its ``reference_patch`` the difference ``solution/solve.sh`` makes there (run once in
a container of the image, without network), its one required test ``tests/test.sh::reward``.
Its verification (``verify.harbor_run``) runs ``tests/test.sh`` in a container of the image,
the candidate's tree copied over the image's working directory, and passes when the reward is
1.

CLI: ``python -m gagar_jax.data.harbor convert TASK_DIR... --out tasks.jsonl`` writes the tasks
as JSONL rows (``RepoTask.from_dict``) for the loop's task files.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.envs.repo import RepoTask, register_harbor_reader
from gagar_jax.verify import container as ctr
from gagar_jax.verify.diff import tree_patch

HARBOR_TEST_ID = "tests/test.sh::reward"
MAX_FILE_BYTES = 1 << 20  # larger files of the image's working directory stay out of the tree


@dataclasses.dataclass(frozen=True)
class HarborTask:
    """One Harbor task directory, as read (see the module docstring).

    Attributes:
      path: the task directory (absolute).
      name: the task's name (``[task] name``, else the directory's name).
      instruction: ``instruction.md``.
      environment_dir: ``environment/`` holding a Dockerfile, or "".
      docker_image: ``[environment] docker_image``, or "".
      tests_dir: ``tests/`` (holds ``test.sh``).
      solution_dir: ``solution/`` (holds ``solve.sh``), or "".
      verifier_timeout_s, agent_timeout_s: ``[verifier]``/``[agent]`` ``timeout_sec``.
      cpus, memory_mb, storage_mb: ``[environment]`` resources.
      config: the whole ``task.toml``.
    """

    path: str
    name: str
    instruction: str
    environment_dir: str
    docker_image: str
    tests_dir: str
    solution_dir: str
    verifier_timeout_s: float
    agent_timeout_s: float
    cpus: float
    memory_mb: int
    storage_mb: int
    config: Mapping[str, Any]


def _section(cfg: Mapping[str, Any], name: str, path: str) -> Mapping[str, Any]:
    sect = cfg.get(name, {})
    if not isinstance(sect, Mapping):
        raise ValueError(f"{path}: [{name}] must be a table")
    return sect


def _number(sect: Mapping[str, Any], key: str, default: float, where: str) -> float:
    v = sect.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        raise ValueError(f"{where}.{key} must be a number > 0, got {v!r}")
    return float(v)


def read_harbor_task(path: str) -> HarborTask:
    """Reads a Harbor task directory; ValueError naming the file or field that is wrong."""
    path = os.path.abspath(path)
    toml_path = os.path.join(path, "task.toml")
    try:
        with open(toml_path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not a Harbor task (no task.toml)") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{toml_path}: {e}") from e
    try:
        with open(os.path.join(path, "instruction.md"), encoding="utf-8") as f:
            instruction = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no instruction.md") from None
    tests_dir = os.path.join(path, "tests")
    if not os.path.isfile(os.path.join(tests_dir, "test.sh")):
        raise ValueError(f"{path}: no tests/test.sh")
    env = _section(cfg, "environment", toml_path)
    image = env.get("docker_image", "") or ""
    if not isinstance(image, str):
        raise ValueError(f"{toml_path}: environment.docker_image must be a string")
    env_dir = os.path.join(path, "environment")
    has_dockerfile = os.path.isfile(os.path.join(env_dir, "Dockerfile"))
    if not (image or has_dockerfile):
        raise ValueError(f"{path}: neither environment/Dockerfile nor environment.docker_image")
    task_sect = _section(cfg, "task", toml_path)
    name = task_sect.get("name") or os.path.basename(path)
    solution = os.path.join(path, "solution")
    return HarborTask(
        path=path,
        name=str(name),
        instruction=instruction,
        environment_dir=env_dir if has_dockerfile else "",
        docker_image=image,
        tests_dir=tests_dir,
        solution_dir=solution if os.path.isfile(os.path.join(solution, "solve.sh")) else "",
        verifier_timeout_s=_number(
            _section(cfg, "verifier", toml_path), "timeout_sec", 600.0, "verifier"
        ),
        agent_timeout_s=_number(_section(cfg, "agent", toml_path), "timeout_sec", 600.0, "agent"),
        cpus=_number(env, "cpus", 1, "environment"),
        memory_mb=int(_number(env, "memory_mb", 2048, "environment")),
        storage_mb=int(_number(env, "storage_mb", 10240, "environment")),
        config=cfg,
    )


def _spec(task: HarborTask) -> ctr.ContainerSpec:
    # with a Dockerfile the image is named after its build context (docker_image then only
    # names a prebuilt alternative, which offline builds do not need)
    if task.environment_dir:
        return ctr.ContainerSpec(dockerfile=task.environment_dir)
    return ctr.ContainerSpec(image=task.docker_image)


def image_workdir(image: str) -> str:
    """The image's working directory (``WORKDIR``; Harbor's tasks run there), "/" if unset."""
    argv = [*ctr._engine_argv(), "image", "inspect", "--format", "{{.Config.WorkingDir}}", image]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise ValueError(f"inspecting {image}: {r.stderr.strip()[-300:]}")
    return r.stdout.strip() or "/"


def _tree_from_tar(data: bytes) -> dict[str, str]:
    files: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            if not m.isfile() or m.size > MAX_FILE_BYTES:
                continue
            rel = os.path.normpath(m.name)
            if rel in (".", "") or rel.startswith(("..", "/")) or "__pycache__" in rel.split("/"):
                continue
            raw = tar.extractfile(m).read()
            try:
                files[rel] = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue  # binary: not part of the text tree the agent edits
    return files


def _workdir_tree(image: str, workdir: str, before: str = "", binds=()) -> dict[str, str]:
    """The text files of ``workdir`` in a fresh container of ``image`` (no network), after the
    shell command ``before`` ran there (the task's own code: the solution)."""
    script = (f"{before} >&2 && " if before else "") + 'cd "$0" && tar -cf - .'
    argv = [*ctr._engine_argv(), "run", "--rm", "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]  # fmt: skip
    for host, inside in binds:
        argv += ["-v", f"{host}:{inside}:ro"]
    argv += ["--entrypoint", "/bin/sh", image, "-c", script, workdir]
    r = subprocess.run(argv, capture_output=True, timeout=1800)
    if r.returncode != 0:
        raise ValueError(
            f"reading {workdir} of {image}: {r.stderr.decode(errors='replace').strip()[-800:]}"
        )
    return _tree_from_tar(r.stdout)


def to_repo_task(path: str):
    """A :class:`~gagar_jax.envs.repo.RepoTask` of the Harbor task at ``path`` (see the module
    docstring). Needs a container engine; ValueError for a task that cannot be built or whose
    solution fails."""
    h = read_harbor_task(path)
    image = ctr.ensure_image(_spec(h))
    workdir = image_workdir(image)
    if workdir == "/":
        raise ValueError(f"{h.path}: the image sets no WORKDIR (where the agent works)")
    files = _workdir_tree(image, workdir)
    if not files:
        raise ValueError(f"{h.path}: the image's {workdir} holds no text file")
    reference = ""
    if h.solution_dir:
        solved = _workdir_tree(
            image, workdir, "bash /solution/solve.sh", [(h.solution_dir, "/solution")]
        )
        reference = tree_patch(files, solved)
    return RepoTask(
        task_id=h.name,
        issue=h.instruction,
        files=files,
        fail_to_pass=(HARBOR_TEST_ID,),
        reference_patch=reference,
        image=image,
        image_workdir=workdir,
        harbor_tests=h.tests_dir,
    )


register_harbor_reader(to_repo_task)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.data.harbor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="Harbor task directories -> RepoTask JSONL rows")
    c.add_argument("tasks", nargs="+", help="Harbor task directories")
    c.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        for path in args.tasks:
            f.write(json.dumps(to_repo_task(path).to_dict()) + "\n")
    print(f"wrote {len(args.tasks)} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
