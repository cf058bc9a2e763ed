"""Running an agent harness on a task: the harness inside the sandbox, the gateway its only
endpoint, the episode's shell workspace its working directory.

``rollout.harness`` picks who drives an episode: ``"native"`` (our own episode loop,
``gagar_jax.rollout.episode``), ``"mini_swe_agent"`` (the reference harness, unmodified, from its
own venv built by ``scripts/setup_agents.sh``) or ``"command"`` (any program:
``rollout.harness_command``, run with ``bash -c``). For the last two, :class:`HarnessRunner`:

1. checks out the task into a :class:`~gagar_jax.envs.shell.ShellWorkspace` (no hidden tests);
2. opens a gateway session with the episode's limits (model calls, completion tokens, wall time);
3. runs the harness in the sandbox with the checkout as ``/workdir`` (its commands run there too:
   the harness's own subprocesses inherit the sandbox), no network but a loopback port that
   ``harness_proxy.py`` forwards to the gateway's Unix socket, and the wall-time limit; every
   process of it is killed when it ends;
4. finishes the session (its calls become linked segments) and takes the workspace's diff.

The harness gets, as environment variables: ``OPENAI_BASE_URL``/``OPENAI_API_BASE`` and
``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` (the session's base URL and
token), ``GAGAR_GATEWAY_URL``, ``GAGAR_MODEL``, ``GAGAR_SESSION_KEY``, ``GAGAR_WORKSPACE``
(``/workdir``) and ``GAGAR_TASK_FILE`` (the issue text, read-only).

An episode whose engine failed is ``infra_error`` (masked, never scored); a harness that crashes
(non-zero exit), hangs (wall time) or loops (a limit) ends with that reason and is verified on
what its workspace holds: one that leaves no diff fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.envs.family import Outcome
from gagar_jax.envs.shell import ShellLimits, ShellWorkspace, WorkspaceDiff
from gagar_jax.rollout.gateway import Gateway, GatewayServer, SessionLimits
from gagar_jax.rollout.segments import Segment, build_segments
from gagar_jax.verify.execution import verify_repo_call
from gagar_jax.verify.repo import env_site_packages
from gagar_jax.verify.sandbox import Limits, SandboxConfig, python_for_sandbox, run_sandboxed

HARNESSES = ("native", "mini_swe_agent", "command")
PROXY_PORT = 8000


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """How a harness episode runs.

    Attributes:
      harness: "mini_swe_agent" or "command" ("native" runs no harness here).
      command: the ``bash -c`` command line of a "command" harness.
      max_calls: model calls per episode (0: none).
      max_completion_tokens: completion tokens per episode (0: none).
      max_wall_s: seconds the harness may run (then it and its commands are killed).
      agents_venv: the venv holding mini-swe-agent (``scripts/setup_agents.sh``).
      memory_bytes: memory of the harness and its commands together.
      nproc: processes at once.
      disk_bytes: the workspace's quota.
      ro_paths: host directories the harness sees read-only at the same path (e.g. the venv of
        a "command" harness: the sandbox exposes no package of the trainer's).
    """

    harness: str = "command"
    command: str = ""
    max_calls: int = 32
    max_completion_tokens: int = 0
    max_wall_s: float = 600.0
    agents_venv: str = ".venv-agents"
    memory_bytes: int = 2 << 30
    nproc: int = 128
    disk_bytes: int = 512 << 20
    ro_paths: tuple[str, ...] = ()

    def __post_init__(self):
        for p in self.ro_paths:
            if not os.path.isabs(p) or not os.path.exists(p):
                raise ValueError(f"HarnessConfig.ro_paths: {p!r} is not an existing absolute path")
        if self.harness not in HARNESSES[1:]:
            raise ValueError(
                f"HarnessConfig.harness must be one of {HARNESSES[1:]}, got {self.harness!r}"
            )
        if self.harness == "command" and not self.command.strip():
            raise ValueError("rollout.harness='command' needs rollout.harness_command")
        if not self.max_wall_s > 0:
            raise ValueError(f"HarnessConfig.max_wall_s must be > 0, got {self.max_wall_s!r}")


@dataclasses.dataclass
class HarnessEpisode:
    """One harness episode.

    Attributes:
      episode_id: the gateway session's episode id.
      status: "finished", or "infra_error" (the engine or the sandbox failed: mask it).
      finish_reason: "exited", "crashed (exit N)", "timeout", "limit: ...", or the infra error.
      record: the gateway's record of the session (calls with ids and log-probs).
      segments: the calls as linked segments (the training rows).
      diff: the workspace against the task's files.
      stdout, stderr: the harness's output (cut by the sandbox).
    """

    episode_id: str
    status: str
    finish_reason: str
    record: dict[str, Any]
    segments: list[Segment]
    diff: WorkspaceDiff
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None

    @property
    def patch(self) -> str:
        return self.diff.patch

    @property
    def infra_error(self) -> bool:
        return self.status == "infra_error"

    def trajectory(self) -> list[dict[str, Any]]:
        """One entry per model call: the model's text, its tool calls (the commands) and what
        the harness sent back after it (the outputs)."""
        return trajectory_events(self.record.get("calls", []))

    def events(self) -> list[dict[str, Any]]:
        """The episode as the grader's and the behaviour monitor's trajectory events (as
        ``Attempt.trajectory`` gives them for native episodes): per call a ``tool_call`` (or
        ``action``) event with the model's text and its commands, then the ``observation``."""
        out = []
        calls = self.record.get("calls", [])
        for e, c in zip(self.trajectory(), calls):
            calls_text = [f"{t['name']}: {json.dumps(t['arguments'])}" for t in e["tool_calls"]]
            text = "\n".join([e["action"], *calls_text]).strip()
            kind = "tool_call" if e["tool_calls"] else "action"
            out.append(
                {"turn": e["turn"], "kind": kind, "text": text, "tokens": len(c["completion_ids"])}
            )
            out.append(
                {"turn": e["turn"], "kind": "observation", "text": e["observation"], "tokens": 0}
            )
        return out


def verify_harness_episode(task, episode: HarnessEpisode, **verify_kwargs: Any) -> Outcome:
    """The standard verification of a harness episode: its workspace diff applied to a fresh
    pristine tree with the hidden tests (``verify_repo_call``), the behaviour monitor reading
    :meth:`HarnessEpisode.events`. An engine or sandbox failure is ``infra_error``; a refused
    diff, or none at all, fails unverified with the reason."""
    if episode.infra_error:
        return Outcome(passed=False, infra_error=True, test_log=episode.finish_reason)
    if not episode.diff.ok:
        return Outcome(passed=False, test_log=f"workspace diff refused: {episode.diff.reasons()}")
    if not episode.patch.strip():
        return Outcome(
            passed=False, test_log=f"episode ended without a diff ({episode.finish_reason})"
        )
    v = verify_repo_call(task, episode.patch, events=episode.events(), **verify_kwargs)
    return Outcome(
        passed=v.passed,
        infra_error=v.infra_error,
        cheat=v.cheat,
        test_log=f"harness: {episode.finish_reason}\n{v.test_log}",
        flags=tuple(v.flags),
        patch=episode.patch,
        detail=v,
    )


def trajectory_events(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    events = []
    for i, c in enumerate(calls):
        resp = c.get("response", {})
        nxt = calls[i + 1]["messages"] if i + 1 < len(calls) else []
        after = nxt[len(c["messages"]) + 1 :] if len(nxt) > len(c["messages"]) else []
        tools = [t for t in resp.get("tool_calls", []) or []]
        commands = [
            t["arguments"].get("command")
            for t in tools
            if isinstance(t.get("arguments"), dict)
            and isinstance(t["arguments"].get("command"), str)
        ]
        events.append(
            {
                "turn": i,
                "action": resp.get("content", ""),
                "tool_calls": tools,
                "commands": commands,
                "observation": "\n".join(m.get("content", "") for m in after),
                "summary": (
                    f"call {i}: "
                    + (f"bash {commands[0][:60]!r}" if commands else f"{len(tools)} tool call(s)")
                ),
            }
        )
    return events


_HERE = os.path.dirname(os.path.abspath(__file__))


class HarnessRunner:
    """Runs harness episodes against ``gateway``, served by ``server`` (which must serve a
    Unix socket: ``GatewayServer(..., uds=...)``)."""

    def __init__(
        self,
        gateway: Gateway,
        server: GatewayServer,
        config: HarnessConfig,
        *,
        sandbox: SandboxConfig | None = None,
    ):
        if not server.uds:
            raise ValueError("HarnessRunner needs a gateway server with a Unix socket (uds=...)")
        self.gateway, self.server, self.config = gateway, server, config
        self.sandbox = sandbox or SandboxConfig()
        if config.harness == "mini_swe_agent":
            mini = os.path.join(os.path.realpath(config.agents_venv), "bin", "mini")
            if not os.path.exists(mini):
                raise FileNotFoundError(
                    f"{mini} not found: build the harness venv with scripts/setup_agents.sh "
                    f"{config.agents_venv}"
                )

    def _argv(self, base_url: str) -> list[str]:
        cfg = self.config
        if cfg.harness == "command":
            return ["/bin/bash", "-c", cfg.command]
        venv = os.path.realpath(cfg.agents_venv)
        # mini-swe-agent's own CLI and its default config, told where its model is.
        return [
            f"{venv}/bin/mini", "--yolo", "--exit-immediately",
            "-m", f"openai/{self.gateway.config.model_name}",
            "-t", "$GAGAR_TASK",  # replaced below: the CLI takes the text itself
            "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={base_url}",
            "-c", "model.cost_tracking=ignore_errors",
            "-c", "agent.cost_limit=0",
            "-c", f"agent.step_limit={cfg.max_calls}",
            "-o", "/tmp/mini.traj.json",
        ]  # fmt: skip  # option pairs

    def run(self, task, *, episode_id: str, seed: int | None = None) -> HarnessEpisode:
        """One episode of ``task`` (a ``RepoTask``-like object: ``files``, ``issue``,
        ``env_path``, ``pythonpath``)."""
        cfg = self.config
        site = env_site_packages(task.env_path) if getattr(task, "env_path", "") else None
        ws = ShellWorkspace(
            task.files,
            limits=ShellLimits(
                command_wall_s=cfg.max_wall_s,
                memory_bytes=cfg.memory_bytes,
                disk_bytes=cfg.disk_bytes,
                nproc=cfg.nproc,
            ),
            config=self.sandbox,
            site_packages=site,
            pythonpath=tuple(getattr(task, "pythonpath", ()) or ()),
        )
        run_dir = tempfile.mkdtemp(prefix="gagar_harness_")
        os.chmod(run_dir, 0o755)
        session = self.gateway.open_session(
            episode_id,
            limits=SessionLimits(cfg.max_calls, cfg.max_completion_tokens, cfg.max_wall_s),
            seed=seed,
        )
        try:
            proxy = os.path.join(run_dir, "harness_proxy.py")
            shutil.copyfile(os.path.join(_HERE, "harness_proxy.py"), proxy)
            task_file = os.path.join(run_dir, "task.md")
            with open(task_file, "w", encoding="utf-8") as f:
                f.write(task.issue)
            for p in (proxy, task_file):
                os.chmod(p, 0o444)
            base = f"http://127.0.0.1:{PROXY_PORT}/sessions/{session.token}/v1"
            argv = self._argv(base)
            if "$GAGAR_TASK" in argv:
                argv[argv.index("$GAGAR_TASK")] = task.issue
            env = {
                **ws.env,
                "OPENAI_BASE_URL": base,
                "OPENAI_API_BASE": base,
                "OPENAI_API_KEY": session.token,
                "ANTHROPIC_BASE_URL": base[: -len("/v1")],
                "ANTHROPIC_API_KEY": session.token,
                "GAGAR_GATEWAY_URL": base,
                "GAGAR_MODEL": self.gateway.config.model_name,
                "GAGAR_SESSION_KEY": session.token,
                "GAGAR_WORKSPACE": "/workdir",
                "GAGAR_TASK_FILE": task_file,
                # mini-swe-agent: no first-run questions, config under /tmp, no cost lookups
                # over the network (there is none), quiet start.
                "MSWEA_CONFIGURED": "true",
                "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            }
            exe, _ = python_for_sandbox()
            ro = [run_dir, os.path.dirname(self.server.uds), ws.bin_dir, *ws.site_packages]
            if cfg.harness == "mini_swe_agent":
                ro.append(os.path.realpath(cfg.agents_venv))
            ro.extend(cfg.ro_paths)
            res = run_sandboxed(
                [exe, proxy, self.server.uds, str(PROXY_PORT), "--", *argv],
                ws.tree,
                Limits(
                    wall_s=cfg.max_wall_s,
                    cpu_s=int(cfg.max_wall_s) + 1,
                    memory_bytes=cfg.memory_bytes,
                    disk_bytes=cfg.disk_bytes,
                    nproc=cfg.nproc,
                ),
                config=self.sandbox,
                env=env,
                ro_paths=tuple(dict.fromkeys(ro)),
                private_workdir=False,  # the checkout itself: its diff is the episode's result
            )
            spent = session.limit_reason
            record = self.gateway.finish_session(session.token)
            diff = ws.diff()
        finally:
            if self.gateway.store.get(session.token) is not None:
                self.gateway.finish_session(session.token)
            ws.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        if record["status"] == "infra_error":
            status, reason = "infra_error", f"engine: {record['reason']}"
        elif res.status == "infra_error":
            status, reason = "infra_error", f"sandbox: {res.error}"
        else:
            status = "finished"
            if res.status == "timeout":
                reason = f"timeout: the harness ran past max_wall_s={cfg.max_wall_s:g}"
            elif spent:
                reason = f"limit: {spent}"
            elif res.status == "resource_killed":
                reason = f"resource_killed: {', '.join(res.limit_hits) or 'killed'}"
            elif res.returncode:
                reason = f"crashed (exit {res.returncode})"
            else:
                reason = "exited"
        return HarnessEpisode(
            episode_id=episode_id,
            status=status,
            finish_reason=reason,
            record=record,
            segments=build_segments(record["calls"]),
            diff=diff,
            stdout=res.stdout,
            stderr=res.stderr,
            exit_code=res.returncode,
        )


def episode_summary(ep: HarnessEpisode) -> dict[str, Any]:
    """A JSON-able one-line summary of an episode (for logs)."""
    return {
        "episode_id": ep.episode_id,
        "status": ep.status,
        "finish_reason": ep.finish_reason,
        "calls": len(ep.record.get("calls", [])),
        "segments": len(ep.segments),
        "diff_ok": ep.diff.ok,
        "patch_lines": ep.patch.count("\n"),
    }


__all__ = [
    "HARNESSES",
    "HarnessConfig",
    "HarnessEpisode",
    "HarnessRunner",
    "episode_summary",
    "trajectory_events",
    "verify_harness_episode",
]
