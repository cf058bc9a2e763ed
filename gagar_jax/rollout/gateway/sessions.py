"""Per-episode sessions of the gateway and what each records.

A session is one episode: a secret token (the harness's API key, or the path segment of its base
URL ``.../sessions/<token>/v1``), its limits (calls, completion tokens, wall time), and one
:class:`CallRecord` per model call: the prompt ids, completion ids, behaviour log-probabilities and
policy version, which call's prompt + completion it extends, and the messages in and out (what the
behaviour monitor and the trajectory export read). A finished session is written to the record
directory as one JSON file (written to a temporary name, then renamed), and the store reloads
those files when it starts: a gateway restart loses no finished episode.

Status: ``open`` (taking calls), ``finished`` (closed by the trainer), ``infra_error`` (the engine
failed under it: the episode is masked, never scored). A session that spent a limit stays open but
refuses calls with a 400 naming the limit (``limit_reason``), so the harness stops and the trainer
still closes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import tempfile
import threading
import time
from typing import Any

STATUSES = ("open", "finished", "infra_error")


@dataclasses.dataclass
class CallRecord:
    """One model call of a session (ids exact; ``linked_call``: the earlier call whose prompt +
    completion this prompt starts with, None when it was rendered whole from text)."""

    index: int
    api: str  # "openai" | "anthropic"
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: str  # the engine's: "stop" | "length" | "abort"
    linked_call: int | None
    temperature: float
    messages: list[dict]  # the request's messages, in the gateway's form
    response: dict  # {"content": str, "tool_calls": [...]} as returned
    tools: list[dict] | None = None
    stop_string: str | None = None
    latency_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallRecord:
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """Per-episode limits (0: none): model calls, completion tokens summed over the calls,
    seconds since the session opened."""

    max_calls: int = 0
    max_completion_tokens: int = 0
    max_wall_s: float = 0.0

    def __post_init__(self):
        for name in ("max_calls", "max_completion_tokens", "max_wall_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"SessionLimits.{name} must be a number >= 0, got {v!r}")


@dataclasses.dataclass
class Session:
    token: str
    episode_id: str
    limits: SessionLimits
    seed: int
    created: float = dataclasses.field(default_factory=time.time)
    status: str = "open"
    reason: str = ""  # why it ended (infra_error: the engine's error)
    limit_reason: str = ""  # the limit it spent, if any
    calls: list[CallRecord] = dataclasses.field(default_factory=list)
    # prefix key of (tools, messages up to and including a returned assistant message) -> call
    by_key: dict[str, CallRecord] = dataclasses.field(default_factory=dict, repr=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    in_flight: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)

    def spent(self) -> str:
        """Which of the episode's limits (calls, tokens, wall time) is used up ("" if none)."""
        lim = self.limits
        if lim.max_calls and len(self.calls) + self.in_flight >= lim.max_calls:
            return f"max_calls={lim.max_calls} model calls per episode"
        if lim.max_completion_tokens and self.completion_tokens >= lim.max_completion_tokens:
            return f"max_completion_tokens={lim.max_completion_tokens} per episode"
        if lim.max_wall_s and time.time() - self.created >= lim.max_wall_s:
            return f"max_wall_s={lim.max_wall_s} seconds per episode"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "status": self.status,
            "reason": self.reason,
            "limit_reason": self.limit_reason,
            "created": self.created,
            "limits": dataclasses.asdict(self.limits),
            "seed": self.seed,
            "calls": [c.to_dict() for c in self.calls],
        }


def _safe_name(episode_id: str) -> str:
    """A file name for the episode: its id's safe characters and a digest of the whole id (two
    ids that differ only in unsafe characters get two files)."""
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in episode_id)[:100]
    digest = hashlib.sha256(episode_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{keep.lstrip('.') or 'episode'}-{digest}"


class SessionStore:
    """The gateway's sessions: open ones in memory, finished ones on disk (``record_dir``, one
    ``<episode_id>.json`` each, read back on request: a long run does not hold every episode in
    memory), or in memory when ``record_dir`` is None."""

    def __init__(self, record_dir: str | None = None):
        self.record_dir = record_dir
        self._open: dict[str, Session] = {}
        # episode_id -> its record file (with record_dir) or the record itself
        self._finished: dict[str, str | dict] = {}
        self._lock = threading.Lock()
        if record_dir:
            os.makedirs(record_dir, exist_ok=True)
            for name in sorted(os.listdir(record_dir)):
                if name.endswith(".json"):
                    path = os.path.join(record_dir, name)
                    with open(path, encoding="utf-8") as f:
                        rec = json.load(f)
                    self._finished[rec["episode_id"]] = path

    def open(
        self, episode_id: str | None = None, *, limits: SessionLimits | None = None, seed=None
    ) -> Session:
        token = "gs-" + secrets.token_urlsafe(32)
        episode_id = episode_id or token[3:15]
        if not isinstance(episode_id, str) or not episode_id:
            raise ValueError(f"episode_id must be a non-empty string, got {episode_id!r}")
        with self._lock:
            if episode_id in self._finished or any(
                s.episode_id == episode_id for s in self._open.values()
            ):
                raise ValueError(f"episode_id {episode_id!r} already has a session")
            s = Session(
                token=token,
                episode_id=episode_id,
                limits=limits or SessionLimits(),
                seed=secrets.randbelow(2**31) if seed is None else int(seed),
            )
            self._open[token] = s
        return s

    def get(self, token: str) -> Session | None:
        """The open session of ``token`` (None: unknown or finished)."""
        if not isinstance(token, str):
            return None
        with self._lock:
            return self._open.get(token)

    def finish(self, token: str, *, status: str = "finished", reason: str = "") -> dict:
        """Closes the session (``status`` finished or infra_error), writes its record and
        returns it. KeyError for an unknown or already finished token."""
        if status not in STATUSES[1:]:
            raise ValueError(f"status must be one of {STATUSES[1:]}, got {status!r}")
        with self._lock:
            s = self._open.pop(token)
        with s.lock:
            if s.status == "open":
                s.status, s.reason = status, reason or s.reason
            rec = s.to_dict()
        kept: str | dict = rec
        if self.record_dir:
            path = os.path.join(self.record_dir, _safe_name(s.episode_id) + ".json")
            fd, tmp = tempfile.mkstemp(dir=self.record_dir, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(rec, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            kept = path
        with self._lock:
            self._finished[s.episode_id] = kept
        return rec

    def known(self, episode_id: str) -> bool:
        """Whether ``episode_id`` has a session, open or finished (finished ones include those
        read back from ``record_dir``)."""
        with self._lock:
            return episode_id in self._finished or any(
                s.episode_id == episode_id for s in self._open.values()
            )

    def finished(self, episode_id: str) -> dict | None:
        """A finished episode's record (None: no such episode)."""
        with self._lock:
            kept = self._finished.get(episode_id)
        if isinstance(kept, str):
            with open(kept, encoding="utf-8") as f:
                return json.load(f)
        return kept

    def open_sessions(self) -> list[Session]:
        with self._lock:
            return list(self._open.values())
