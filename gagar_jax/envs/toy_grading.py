"""The toy family's side of grading: its workspace, token spans and targeted checks.

Workspace (``toy_candidate``, ``toy_workspace``): a rollout's line-edit patch (``N : stmt``,
``ins N : stmt``, ``del N``) is rendered as a unified diff of ``program.toy`` (the raw program,
one statement per line, so diff line numbers are the prompt's line numbers); the verifier's test
log, monitor flags and five quality features pass through (the heuristic grader blends the
features into its scores, citing the log).

Token spans (``toy_token_spans``): the response is a line-edit patch, one edit per line
separated by newline tokens and ended by EOS; the spans reproduce the unified diff's line numbers
from the edits (the edit order of ``toy.apply_edits``). An edit's tokens are the tokens of its
patch line, without the newline that ends it.

Checks: the agentic grader's targeted checks on these workspaces are
``gagar_jax.grading.adapters.ToyCheckRunner`` (the family's ``check_runner``), which runs the
programs with the toy interpreter (``gagar_jax.verify.toy_lang``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from gagar_jax.envs import toy
from gagar_jax.envs.tokenizer import TOKENIZER
from gagar_jax.grading import schema
from gagar_jax.grading.adapters import TOY_PROGRAM
from gagar_jax.grading.evidence_tokens import EditSpan, TokenSpans

TOY_TESTS = "tests.toy"


def _source(lines: Sequence[str]) -> str:
    return "".join(f"{ln}\n" for ln in lines)


def toy_candidate(
    task: toy.ToyTask,
    candidate_id: str,
    patch_text: str,
    verification: Any,
    *,
    trajectory: Sequence[Any] = (),
    summary: str = "",
) -> schema.Candidate:
    """A toy rollout as a grading ``Candidate``.

    Args:
      task: a ``gagar_jax.envs.ToyTask``.
      candidate_id: unique within the group.
      patch_text: the rollout's line-edit patch.
      verification: ``gagar_jax.envs.verify(task, patch_text)``.
      trajectory, summary: as in ``Candidate``; the raw line edits are appended to the summary.
    """
    try:
        new = toy.apply_patch(task, patch_text)
        rendered = "".join(
            difflib.unified_diff(
                _source(task.lines).splitlines(True),
                _source(new.splitlines()).splitlines(True),
                f"a/{TOY_PROGRAM}",
                f"b/{TOY_PROGRAM}",
            )
        )
    except toy.PatchError:
        rendered = ""  # an unparseable patch fails verification; there is nothing to diff
    quality = {
        d: float(verification.quality[d]) for d in schema.DIMENSIONS if d in verification.quality
    }
    note = f"line edits:\n{patch_text}"
    return schema.Candidate(
        candidate_id=candidate_id,
        patch=rendered,
        passed=bool(verification.passed) and not verification.infra_error,
        test_log=verification.test_log,
        trajectory=tuple(trajectory),
        summary=f"{summary}\n{note}" if summary else note,
        monitor_flags=tuple(verification.cheat_flags),
        quality=quality,
    )


def toy_workspace(
    task: Any, group_id: str, candidates: Sequence[schema.Candidate]
) -> schema.GroupWorkspace:
    """The group workspace of a toy task: ``program.toy`` (raw source) and ``tests.toy``."""
    return schema.GroupWorkspace(
        group_id=group_id,
        task_text=task.prompt,
        repo_files={TOY_PROGRAM: _source(task.lines), TOY_TESTS: task.repo_files[TOY_TESTS]},
        candidates=tuple(candidates),
        scope_files=(TOY_PROGRAM,),
    )


def toy_group(task: Any, group_id: str, patches: Sequence[str]) -> schema.GroupWorkspace:
    """Verifies each patch and builds the workspace (candidates ``r0``, ``r1``, ... in order)."""
    cands = [toy_candidate(task, f"r{k}", p, toy.verify(task, p)) for k, p in enumerate(patches)]
    return toy_workspace(task, group_id, cands)


def _split_lines(tokens: Sequence[int], newline_id: int, eos_id: int) -> list[list[int]]:
    """Response token indices per line (newline and everything from EOS on excluded)."""
    lines: list[list[int]] = [[]]
    for i, t in enumerate(tokens):
        if t == eos_id:
            break
        if t == newline_id:
            lines.append([])
        else:
            lines[-1].append(i)
    return lines


def toy_token_spans(task: Any, response_tokens: Sequence[int], tokenizer: Any = None) -> TokenSpans:
    """The :class:`TokenSpans` of a toy rollout's line-edit patch.

    Lines that do not parse as an edit (or a patch that edits a line twice, which fails
    verification) contribute no span. Line numbers follow ``toy.apply_edits``: original lines in
    order, an ``ins N`` edit's lines just before original line N, in patch order.

    Args:
      task: the ``gagar_jax.envs.ToyTask``.
      response_tokens: the rollout's response token ids (EOS and anything after it ignored).
      tokenizer: the toy tokenizer (default ``gagar_jax.envs.TOKENIZER``).
    """
    tok = tokenizer or TOKENIZER
    ids = [int(t) for t in response_tokens]
    num_lines = len(task.lines)
    parsed = []  # (edit, token indices) in patch order
    for idx in _split_lines(ids, tok.newline_id, tok.eos_id):
        if not idx:
            continue
        text = tok.decode([ids[i] for i in idx], stop_at_eos=False)
        try:
            edits = toy.parse_patch(text, num_lines)
        except toy.PatchError:
            continue
        if len(edits) == 1:
            parsed.append((edits[0], tuple(idx)))
    replaced = [e.line for e, _ in parsed if e.op != "insert"]
    if len(replaced) != len(set(replaced)):
        parsed = []  # an original line edited twice: the patch does not apply
    new_of: dict[int, list[int]] = {}  # parsed edit index -> new lines it wrote
    new_line = 0
    for n in range(1, num_lines + 2):
        for k, (e, _) in enumerate(parsed):
            if e.op == "insert" and e.line == n:
                new_line += 1
                new_of.setdefault(k, []).append(new_line)
        if n <= num_lines:
            k = next(
                (k for k, (e, _) in enumerate(parsed) if e.op != "insert" and e.line == n), None
            )
            if k is None or parsed[k][0].op == "replace":
                new_line += 1
                if k is not None:
                    new_of.setdefault(k, []).append(new_line)
    edits = tuple(
        EditSpan(
            file=TOY_PROGRAM,
            new_lines=tuple(new_of.get(k, ())),
            old_lines=() if e.op == "insert" else (e.line,),
            tokens=idx,
        )
        for k, (e, idx) in enumerate(parsed)
    )
    return TokenSpans(length=len(ids), edits=edits)
