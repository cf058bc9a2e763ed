"""Grading: verdict schema and validation, heuristic and agentic graders, asynchronous pool.

See ``schema`` for the verdict contract, ``heuristic`` for the embedded default grader,
``agentic`` for the LLM tool-loop grader (``scripted`` holds a deterministic policy for it),
``pool`` for overlapping grading with generation, ``adapters`` for sandboxed checks (each task
family builds its own workspaces, in ``gagar_jax.envs``), and ``testing`` for graders with known
(slow, crashing, hanging, garbage) behaviour. Grader quality: ``labelled`` (versioned labelled
group sets), ``eval`` (the measuring harness and its CLI), ``panel`` (heterogeneous panels) and
``distill`` (distilled graders and their gate).
"""

from gagar_jax.grading.agentic import (
    PROMPT_VERSION,
    TOOLS,
    AgenticGrader,
    CheckResult,
    NoCheckRunner,
    load_prompt,
    merge_votes,
)
from gagar_jax.grading.heuristic import HeuristicConfig, HeuristicGrader, infer_scope
from gagar_jax.grading.pool import GradingPool, VerdictCache, accept_output, grade_all
from gagar_jax.grading.schema import (
    CLAIMS,
    DIMENSIONS,
    EVIDENCE_KINDS,
    NEGATIVE_SCORE,
    Candidate,
    Evidence,
    FallbackReason,
    GradeResult,
    GroupWorkspace,
    Judgement,
    MonitorFlagView,
    RejectReason,
    TrajectoryEvent,
    Verdict,
    VerdictRejected,
    extract_json,
    parse_verdict,
    tier_histogram,
    to_arrays,
    validate,
    verdict_from_dict,
    verdict_to_dict,
)

__all__ = [
    "PROMPT_VERSION",
    "TOOLS",
    "AgenticGrader",
    "CheckResult",
    "GradingPool",
    "HeuristicConfig",
    "HeuristicGrader",
    "NoCheckRunner",
    "VerdictCache",
    "accept_output",
    "grade_all",
    "infer_scope",
    "load_prompt",
    "merge_votes",
    "CLAIMS",
    "DIMENSIONS",
    "EVIDENCE_KINDS",
    "NEGATIVE_SCORE",
    "Candidate",
    "Evidence",
    "FallbackReason",
    "GradeResult",
    "GroupWorkspace",
    "Judgement",
    "MonitorFlagView",
    "RejectReason",
    "TrajectoryEvent",
    "Verdict",
    "VerdictRejected",
    "extract_json",
    "parse_verdict",
    "tier_histogram",
    "to_arrays",
    "validate",
    "verdict_from_dict",
    "verdict_to_dict",
]
