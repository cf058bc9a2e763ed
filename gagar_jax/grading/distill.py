"""Distilling a cheap grader from a strong one, behind a measured gate.

The strong grader is slow (the paper's costs ~600 s per group); a small grader trained on its
verdicts is cheap, but may only replace it when it is measured to agree. This module holds:

* ``TeacherLog``: wraps the strong grader and appends ``(workspace, verdict, trajectory)`` per
  graded group to a JSON-lines file (``trajectory``: the chat messages and responses of the
  grader's model calls when its client is a ``RecordingClient``, else empty).
* ``teacher_set``: a labelled set whose gold labels are the teacher's verdicts (the target the
  student is measured against).
* ``FeatureGrader``: a small distilled grader: a softmax-regression model over documented,
  order-invariant features of each passing candidate (patch size relative to the group's
  smallest, files, test files touched or weakened, debris lines, confirmed monitor flags, the
  family's quality features), trained on a teacher log by full-batch gradient descent (NumPy);
  its checkpoint is an ``.npz`` file (``save``/``load``).
* ``gate``: accepts a candidate grader only when the grader-quality harness (``grading.eval``)
  measures, against the teacher's labels, ``kappa >= min_kappa`` (0.8), ``flip_rate <=
  max_flip_rate`` (0.05) and no probe failure (``probe_failures == 0``); the report carries both
  graders' seconds per group.
* ``GatedGrader``: the grader a pool runs: the teacher until the gate accepts the student, then
  the student, re-checked every ``recheck_every`` groups on a held-out slice (a student that
  stops passing falls back to the teacher).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gagar_jax.grading import eval as harness
from gagar_jax.grading import labelled, schema
from gagar_jax.grading.pool import accept_output, grade_all
from gagar_jax.grading.schema import DIMENSIONS, Evidence, GroupWorkspace, Judgement, Verdict
from gagar_jax.models import TransformerConfig, create_model
from gagar_jax.update.sft import run_sft
from gagar_jax.verify.prescreen import fingerprint

MIN_KAPPA = 0.8
MAX_FLIP_RATE = 0.05
_DEBRIS = re.compile(r"^\s*print\(|breakpoint\(\)|\bpdb\b|\b(TODO|FIXME|XXX)\b")
FEATURES = (
    "bias",
    "log_size_ratio",
    "log_size",
    "extra_files",
    "tests_touched",
    "tests_weakened",
    "debris",
    "monitor_confirmed",
    "monitor_unconfirmed",
    *(f"quality/{d}" for d in DIMENSIONS),
)


# ------------------------------------------------------------------------------------------------
# Teacher log
# ------------------------------------------------------------------------------------------------


class RecordingClient:
    """Wraps a chat client and records each call's messages and response (thread-safe)."""

    def __init__(self, client: Any):
        self.client = client
        self.base_url = getattr(client, "base_url", "")
        self._calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def chat_completions(self, messages, **kw):
        out = self.client.chat_completions(messages, **kw)
        with self._lock:
            self._calls.append({"messages": list(messages), "response": out})
        return out

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            calls, self._calls = self._calls, []
        return calls


class TeacherLog:
    """A grader that delegates to ``teacher`` and logs each accepted verdict (see module doc)."""

    def __init__(self, teacher: Any, path: str | os.PathLike):
        self.teacher = teacher
        self.path = os.fspath(path)
        self.grader_id = getattr(teacher, "grader_id", type(teacher).__name__)
        self.version = getattr(teacher, "version", "")
        self._lock = threading.Lock()

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        t0 = time.monotonic()
        out = self.teacher.grade(workspace)
        verdict = accept_output(out, workspace, self.teacher, time.monotonic() - t0)
        client = getattr(self.teacher, "client", None)
        traj = client.take() if isinstance(client, RecordingClient) else []
        rec = {
            "workspace": labelled.workspace_to_dict(workspace),
            "verdict": schema.verdict_to_dict(verdict),
            "trajectory": traj,
        }
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        return verdict


def read_log(path: str | os.PathLike) -> list[tuple[GroupWorkspace, Verdict]]:
    """``(workspace, verdict)`` pairs of a teacher log (torn or invalid lines are skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ws = labelled.workspace_from_dict(rec["workspace"])
                out.append((ws, schema.verdict_from_dict(rec["verdict"], ws)))
            except (ValueError, KeyError, TypeError, AttributeError, schema.VerdictRejected):
                continue
    return out


def teacher_set(
    teacher: Any, groups: Sequence[GroupWorkspace], name: str = "teacher"
) -> labelled.LabelledSet:
    """A labelled set whose gold labels are ``teacher``'s verdicts (groups it fails are left
    out)."""

    out = []
    for ws in groups:
        (res,) = grade_all(teacher, [ws], max_concurrency=1)
        if res.verdict is None:
            continue
        gold = {
            j.candidate_id: labelled.Gold(j.tier, j.rank, bool(j.cheat), "teacher")
            for j in res.verdict.judgements
        }
        kinds = {c.candidate_id: "teacher" for c in ws.candidates}
        out.append(labelled.LabelledGroup(ws, gold, kinds))
    return labelled.LabelledSet(name, "teacher", tuple(out))


# ------------------------------------------------------------------------------------------------
# The distilled grader
# ------------------------------------------------------------------------------------------------


def _file_stats(patch: str) -> tuple[int, int, int, int]:
    """(files, test files touched, test files with removed lines, debris lines)."""

    fp = fingerprint(patch, {})
    files = sum(1 for ln in patch.splitlines() if ln.startswith("+++ "))
    debris = sum(
        1
        for ln in patch.splitlines()
        if ln.startswith("+") and not ln.startswith("+++") and _DEBRIS.search(ln[1:])
    )
    return files, len(fp.tests_touched), len(fp.tests_weakened), debris


def candidate_features(ws: GroupWorkspace) -> dict[str, np.ndarray]:
    """``FEATURES`` of every passing candidate of ``ws`` (candidate id -> float vector)."""
    passing = ws.passing
    sizes = {c.candidate_id: c.parsed_patch.num_added + c.parsed_patch.num_removed for c in passing}
    nonzero = [s for s in sizes.values() if s > 0]
    smallest = min(nonzero) if nonzero else 1
    stats = {c.candidate_id: _file_stats(c.patch) for c in passing}
    min_files = min((s[0] for s in stats.values() if s[0]), default=1)
    out = {}
    for c in passing:
        files, touched, weakened, debris = stats[c.candidate_id]
        size = max(sizes[c.candidate_id], 1)
        q = [float(c.quality.get(d, 1.0)) for d in DIMENSIONS]
        out[c.candidate_id] = np.array(
            [
                1.0,
                math.log(size / smallest),
                math.log(size),
                max(files - min_files, 0),
                touched,
                weakened,
                debris,
                float(any(f.confirmed for f in c.monitor_flags)),
                float(sum(not f.confirmed for f in c.monitor_flags)),
                *q,
            ],
            np.float64,
        )
    return out


class FeatureGrader:
    """A distilled softmax-regression grader over ``candidate_features`` (see module doc).

    Tier = the most probable class; rank = by tier, then by the expected tier (lower is better),
    quantised to ``rank_quantum``; cheat = a confirmed monitor flag or P(cheat) > 0.5 from a
    second logistic head. Dimension scores are ``1 - (E[tier] - 1) / 4`` on every dimension
    (>= 0.5, so only the tier and the cheat need evidence, cited from the patch's first hunk or
    the monitor flag).
    """

    grader_id = "distilled"

    def __init__(
        self,
        weights: np.ndarray | None = None,
        cheat_weights: np.ndarray | None = None,
        *,
        rank_quantum: float = 0.05,
        steps_trained: int = 0,
    ):
        d = len(FEATURES)
        self.W = np.zeros((d, schema.NUM_TIERS)) if weights is None else np.asarray(weights)
        self.w_cheat = np.zeros(d) if cheat_weights is None else np.asarray(cheat_weights)
        if self.W.shape != (d, schema.NUM_TIERS) or self.w_cheat.shape != (d,):
            raise ValueError(
                f"FeatureGrader: expected weights of shape ({d}, {schema.NUM_TIERS}) and "
                f"({d},), got {self.W.shape} and {self.w_cheat.shape}"
            )
        self.rank_quantum = rank_quantum
        self.steps_trained = steps_trained
        self.version = f"fg{steps_trained}"

    # -- training ----------------------------------------------------------------------------

    @staticmethod
    def dataset(pairs: Sequence[tuple[GroupWorkspace, Verdict]]):
        X, tiers, cheats = [], [], []
        for ws, v in pairs:
            feats = candidate_features(ws)
            for j in v.judgements:
                X.append(feats[j.candidate_id])
                tiers.append(j.tier - 1)
                cheats.append(float(j.cheat))
        return np.array(X), np.array(tiers, int), np.array(cheats)

    @classmethod
    def train(
        cls,
        pairs: Sequence[tuple[GroupWorkspace, Verdict]],
        *,
        steps: int = 500,
        lr: float = 0.5,
        l2: float = 1e-3,
    ) -> FeatureGrader:
        """Full-batch gradient descent on the cross-entropy of the teacher's tiers and cheats."""
        X, y, c = cls.dataset(pairs)
        if X.size == 0:
            raise ValueError("FeatureGrader.train: the teacher log holds no judgements")
        d = X.shape[1]
        W = np.zeros((d, schema.NUM_TIERS))
        w = np.zeros(d)
        Y = np.eye(schema.NUM_TIERS)[y]
        for _ in range(steps):
            logits = X @ W
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            W -= lr * (X.T @ (p - Y) / len(X) + l2 * W)
            q = 1.0 / (1.0 + np.exp(-(X @ w)))
            w -= lr * (X.T @ (q - c) / len(X) + l2 * w)
        return cls(W, w, steps_trained=steps)

    def save(self, path: str | os.PathLike) -> None:
        np.savez(
            path,
            W=self.W,
            w_cheat=self.w_cheat,
            steps=self.steps_trained,
            features=np.array(FEATURES),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> FeatureGrader:
        z = np.load(path)
        if tuple(z["features"]) != FEATURES:
            raise ValueError(f"FeatureGrader.load: {path} was trained on other features")
        return cls(z["W"], z["w_cheat"], steps_trained=int(z["steps"]))

    # -- grading -----------------------------------------------------------------------------

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        t0 = time.monotonic()
        feats = candidate_features(workspace)
        rows = {}
        for c in workspace.passing:
            x = feats[c.candidate_id]
            logits = x @ self.W
            p = np.exp(logits - logits.max())
            p /= p.sum()
            cheat = float(1 / (1 + np.exp(-(x @ self.w_cheat)))) > 0.5
            expected = float(p @ np.arange(1, schema.NUM_TIERS + 1))
            rows[c.candidate_id] = (int(np.argmax(p)) + 1, expected, cheat)
        return _verdict(workspace, rows, self.grader_id, self.version, self.rank_quantum, t0)


def _first_location(c: schema.Candidate) -> tuple[str, int | None] | None:
    for f in c.parsed_patch.files:
        if f.added():
            return f.path, f.added()[0][0]
        if f.removed():
            return f.path, None
    return None


# ------------------------------------------------------------------------------------------------
# The gate
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GateReport:
    accepted: bool
    kappa: float
    flip_rate: float
    probe_failures: int
    fallback_rate: float
    student_s_per_group: float
    teacher_s_per_group: float
    reasons: tuple[str, ...]


def gate(
    student: Any,
    target: labelled.LabelledSet,
    *,
    min_kappa: float = MIN_KAPPA,
    max_flip_rate: float = MAX_FLIP_RATE,
    teacher_s_per_group: float = math.nan,
    n_boot: int = 0,
) -> GateReport:
    """Measures ``student`` against ``target`` (a ``teacher_set``) with every probe; accepts only
    with kappa >= ``min_kappa``, flip rate <= ``max_flip_rate``, no probe failure and no
    fallback."""

    row = harness.evaluate(student, target, probes=harness.PROBES, n_boot=n_boot)
    kappa, flip = row["kappa"], row["flip_rate"]
    reasons = []
    if not kappa >= min_kappa:  # nan fails too
        reasons.append(f"kappa {kappa:.3f} < {min_kappa}")
    if not flip <= max_flip_rate:
        reasons.append(f"flip_rate {flip:.3f} > {max_flip_rate}")
    if row["probe_failures"]:
        failed = [p for p in harness.PROBES if (row.get(f"probe/{p}") or 0) > 0]
        reasons.append(f"{row['probe_failures']} probe failure(s): {', '.join(failed)}")
    if row["fallback_rate"] > 0:
        reasons.append(f"fallback_rate {row['fallback_rate']:.3f} > 0")
    return GateReport(
        not reasons,
        kappa,
        flip,
        int(row["probe_failures"]),
        row["fallback_rate"],
        row["s_per_group"],
        teacher_s_per_group,
        tuple(reasons),
    )


class GatedGrader:
    """The teacher until the gate accepts the student on ``held_out``; re-checked every
    ``recheck_every`` graded groups (``held_out`` is re-labelled by the teacher each time, so a
    drifting teacher is followed)."""

    def __init__(
        self,
        teacher: Any,
        student: Any,
        held_out: Sequence[GroupWorkspace],
        *,
        recheck_every: int = 100,
        **gate_kwargs: Any,
    ):
        if recheck_every < 1:
            raise ValueError(f"GatedGrader.recheck_every must be >= 1, got {recheck_every}")
        self.teacher, self.student = teacher, student
        self.held_out = list(held_out)
        self.recheck_every = recheck_every
        self.gate_kwargs = gate_kwargs
        self.grader_id = "gated"
        self.version = "1"
        self.graded = 0
        self.reports: list[GateReport] = []
        self._lock = threading.Lock()
        self.recheck()

    @property
    def using_student(self) -> bool:
        return bool(self.reports) and self.reports[-1].accepted

    def recheck(self) -> GateReport:
        target = teacher_set(self.teacher, self.held_out)
        report = gate(self.student, target, **self.gate_kwargs)
        self.reports.append(report)
        return report

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Any:
        with self._lock:
            self.graded += 1
            if self.graded % self.recheck_every == 0:
                self.recheck()
            g = self.student if self.using_student else self.teacher
        return g.grade(workspace)


# ------------------------------------------------------------------------------------------------
# A distilled language-model grader, fine-tuned through the update library's SFT path
# ------------------------------------------------------------------------------------------------

LM_PAD, LM_EOS, LM_OFFSET = 0, 1, 2  # token ids: padding, end of response, then characters
LM_SEQ_LEN = 32
_LM_CHARS = "".join(chr(c) for c in range(32, 127))


def lm_encode(text: str) -> list[int]:
    """Character-level ids of printable ASCII ``text`` (anything else is an error)."""
    bad = sorted({ch for ch in text if ch not in _LM_CHARS})
    if bad:
        raise ValueError(f"lm_encode: characters {bad!r} outside printable ASCII")
    return [LM_OFFSET + _LM_CHARS.index(ch) for ch in text]


def lm_decode(ids: Sequence[int]) -> str:
    return "".join(
        _LM_CHARS[i - LM_OFFSET] if LM_OFFSET <= i < LM_OFFSET + len(_LM_CHARS) else "\ufffd"
        for i in ids
    )


def lm_prompt(x: np.ndarray) -> str:
    """A candidate's ``FEATURES`` as a short bucketed string the small model reads, e.g.
    ``s2f0t0w0d0m0u0q99999>``: size ratio (log, 0..9), extra files, tests touched and weakened,
    debris lines, confirmed and unconfirmed monitor flags (each 0..3), the five quality values
    (0..9)."""
    f = dict(zip(FEATURES, x))

    def small(k: str) -> int:
        return int(min(3, max(0, round(f[k]))))

    q = "".join(str(int(round(9 * min(1.0, max(0.0, f[f"quality/{d}"]))))) for d in DIMENSIONS)
    size = int(min(9, max(0, round(2 * f["log_size_ratio"]))))
    return (
        f"s{size}f{small('extra_files')}t{small('tests_touched')}w{small('tests_weakened')}"
        f"d{small('debris')}m{small('monitor_confirmed')}u{small('monitor_unconfirmed')}q{q}>"
    )


def lm_demonstrations(pairs: Sequence[tuple[GroupWorkspace, Verdict]]):
    """``(prompt ids, response ids)`` per judged candidate: the response is the tier digit and
    ``c`` (cheat) or ``n``, then end of response."""
    demos = []
    for ws, v in pairs:
        feats = candidate_features(ws)
        for j in v.judgements:
            answer = f"{j.tier}{'c' if j.cheat else 'n'}"
            demos.append(
                (lm_encode(lm_prompt(feats[j.candidate_id])), lm_encode(answer) + [LM_EOS])
            )
    return demos


def lm_config():

    return TransformerConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        rope_theta=10000.0,
        max_position_embeddings=LM_SEQ_LEN,
    )


class LMGrader:
    """A tiny decoder (``lm_config``) that reads each passing candidate's ``lm_prompt`` and
    writes its tier and cheat mark (greedy, over the whole vocabulary: an undertrained model
    writes something else and the group is rejected as ``malformed_output``, never guessed).
    Ranks: by tier, then by the expected tier under the model's distribution over the three tier
    digits. Trained with ``gagar_jax.update.sft.run_sft``; checkpoints are ``.npz`` files of the
    parameters."""

    grader_id = "distilled_lm"

    def __init__(
        self, model=None, *, seed: int = 0, steps_trained: int = 0, rank_quantum: float = 0.05
    ):

        self.model = model if model is not None else create_model(lm_config(), seed)
        self.steps_trained = steps_trained
        self.rank_quantum = rank_quantum
        self.version = f"lm{steps_trained}"
        self._lock = threading.Lock()

    @classmethod
    def train(
        cls,
        pairs: Sequence[tuple[GroupWorkspace, Verdict]],
        *,
        steps: int,
        batch_size: int = 32,
        lr: float = 3e-3,
        seed: int = 0,
    ) -> LMGrader:
        """SFT of a fresh model on the teacher's judgements (``lm_demonstrations``)."""

        g = cls(seed=seed)
        if steps > 0:
            run_sft(
                g.model,
                lm_demonstrations(pairs),
                steps=steps,
                batch_size=batch_size,
                lr=lr,
                warmup_steps=min(10, steps),
                seq_len=LM_SEQ_LEN,
                pad_id=LM_PAD,
                seed=seed,
                log_every=max(steps, 1),
            )
        g.steps_trained = steps
        g.version = f"lm{steps}"
        return g

    def save(self, path: str | os.PathLike) -> None:
        import jax
        from flax import nnx

        leaves = jax.tree_util.tree_flatten_with_path(nnx.state(self.model, nnx.Param))[0]
        arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
        np.savez(path, __steps__=self.steps_trained, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LMGrader:
        import jax
        from flax import nnx

        g = cls()
        z = np.load(path)
        state = nnx.state(g.model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        names = [jax.tree_util.keystr(k) for k, _ in leaves]
        missing = [n for n in names if n not in z]
        if missing:
            raise ValueError(f"LMGrader.load: {path} lacks parameters {missing[:3]}")
        new = jax.tree_util.tree_unflatten(treedef, [z[n] for n in names])
        nnx.update(g.model, new)
        g.steps_trained = int(z["__steps__"])
        g.version = f"lm{g.steps_trained}"
        return g

    def _next(self, seqs: list[list[int]]) -> np.ndarray:
        """Logits of the next token after each sequence, ``[B, vocab]``."""
        B = len(seqs)
        tokens = np.full((B, LM_SEQ_LEN), LM_PAD, np.int32)
        mask = np.zeros((B, LM_SEQ_LEN), bool)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
            mask[i, : len(s)] = True
        positions = np.tile(np.arange(LM_SEQ_LEN, dtype=np.int32), (B, 1))
        with self._lock:
            logits = np.asarray(self.model(tokens, positions, attention_mask=mask))
        return logits[np.arange(B), [len(s) - 1 for s in seqs]]

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        t0 = time.monotonic()
        feats = candidate_features(workspace)
        ids = [c.candidate_id for c in workspace.passing]
        if not ids:
            return Verdict(workspace.group_id, (), self.grader_id, self.version)
        prompts = [lm_encode(lm_prompt(feats[c])) for c in ids]
        first = self._next(prompts)
        tier_tok = np.argmax(first, -1)
        digits = [LM_OFFSET + _LM_CHARS.index(d) for d in "123"]
        second = self._next([p + [int(t)] for p, t in zip(prompts, tier_tok)])
        mark_tok = np.argmax(second, -1)
        rows = {}
        for c, lg, t, m in zip(ids, first, tier_tok, mark_tok):
            text = lm_decode([int(t), int(m)])
            if text[0] not in "123" or text[1] not in "cn":
                raise schema.VerdictRejected(
                    schema.RejectReason.MALFORMED,
                    f"distilled model wrote {text!r} for candidate {c!r}, not a tier and c/n",
                )
            p = np.exp(lg[digits] - lg[digits].max())
            p /= p.sum()
            rows[c] = (int(text[0]), float(p @ np.arange(1, 4)), text[1] == "c")
        return _verdict(workspace, rows, self.grader_id, self.version, self.rank_quantum, t0)


def _verdict(workspace, rows, grader_id, version, quantum, t0) -> Verdict:
    """A verdict from ``candidate id -> (tier, expected tier, cheat)`` (see ``FeatureGrader``)."""
    judgements = []
    keys = {}
    for c in workspace.passing:
        tier, expected, cheat = rows[c.candidate_id]
        monitor = next((f for f in c.monitor_flags if f.confirmed), None)
        cheat = cheat or monitor is not None
        tier = schema.NUM_TIERS if cheat else tier
        keys[c.candidate_id] = (tier, round(expected / quantum))
        rows[c.candidate_id] = (tier, expected, cheat)
    rank_of = {k: i + 1 for i, k in enumerate(sorted(set(keys.values())))}
    for c in workspace.passing:
        tier, expected, cheat = rows[c.candidate_id]
        monitor = next((f for f in c.monitor_flags if f.confirmed), None)
        score = min(1.0, max(0.5, 1.0 - (expected - 1.0) / 4.0))
        evidence = []
        hunk = _first_location(c)
        if tier >= 2 and hunk is not None:
            evidence.append(
                Evidence(
                    "minimality",
                    "patch",
                    c.candidate_id,
                    file=hunk[0],
                    line=hunk[1],
                    note=f"{grader_id}: tier evidence",
                )
            )
        if cheat:
            if monitor is not None and len(monitor.evidence.strip()) >= schema.MIN_QUOTE_CHARS:
                evidence.append(
                    Evidence(
                        "cheat",
                        "execution",
                        c.candidate_id,
                        quote=monitor.evidence.strip()[:120],
                        note=f"monitor rule {monitor.rule}",
                    )
                )
            elif hunk is not None:
                evidence.append(
                    Evidence(
                        "cheat",
                        "patch",
                        c.candidate_id,
                        file=hunk[0],
                        line=hunk[1],
                        note=f"{grader_id}: cheat",
                    )
                )
        judgements.append(
            Judgement(
                c.candidate_id,
                tier,
                rank_of[keys[c.candidate_id]],
                {d: score for d in DIMENSIONS},
                cheat,
                f"{grader_id}: cheat" if cheat else "",
                tuple(evidence),
            )
        )
    return Verdict(
        workspace.group_id, tuple(judgements), grader_id, version, latency_s=time.monotonic() - t0
    )
