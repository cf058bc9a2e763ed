"""A rule-based simulated user for the toy code-repair family: process-level feedback spans.

A user reading a patch comments on its steps ("good, that fixes the buggy line", "you edited a
line outside the function", "you special-cased a tested input"). This user does the same from
what the framework knows about a toy patch: the **verifier** (tests, the patched program's
agreement with the reference), the **behaviour monitor** (its flags cite the edit they are
about) and the **reference patch** (the bug line and its fix). Each edit line of the patch is one
step and gets at most one feedback item; the EOS token and lines without a comment stay
uncovered (neutral spans when the record is derived).

=====================================================  =========  =======================
edit                                                   polarity   says
=====================================================  =========  =======================
the patch does not parse                               negative   the parse error
a monitor-flagged edit (special-casing, hard-coding)   negative   the flag's finding
the bug line replaced by the reference fix             positive   it fixes the bug
the bug line replaced, tests pass, same behaviour      neutral    works, but unlike the code
the bug line replaced, still wrong                     negative   the first failing test
the bug line deleted                                   negative   deleted instead of fixed
a line replaced by itself                              negative   changes nothing
a guard changing untested inputs (``if x > K``)        negative   untested behaviour change
any other edit away from the bug line                  negative   outside the buggy line
an extra insertion next to the bug (passing, not min.)  negative   a step not needed
=====================================================  =========  =======================

Spans are given as token ranges over the policy's own sampled tokens (lines split at the newline
token), so nothing is re-tokenised. An LLM user (through the SGLang client) is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence

from gagar_jax.envs.tokenizer import TOKENIZER
from gagar_jax.envs.toy import QUALITY_DIMENSIONS, PatchError, ToyTask, parse_patch, verify
from gagar_jax.verify import toy_lang as L


def _line_token_ranges(tokens: Sequence[int], tokenizer) -> list[tuple[int, int]]:
    """[start, end) of each non-empty line of a sampled response (EOS and after excluded)."""
    out, start = [], 0
    end_all = len(tokens)
    for i, t in enumerate(tokens):
        if t == tokenizer.eos_id:
            end_all = i
            break
    for i in range(end_all + 1):
        if i == end_all or tokens[i] == tokenizer.newline_id:
            if i > start and any(
                tokens[j] not in (tokenizer.pad_id, tokenizer.bos_id) for j in range(start, i)
            ):
                out.append((start, i))
            start = i + 1
    return out


def user_feedback(
    task: ToyTask, response_tokens: Sequence[int], *, tokenizer=TOKENIZER
) -> list[dict]:
    """Feedback items (``token_range`` relative to the response) for one sampled patch."""
    patch = tokenizer.decode(response_tokens)
    lines = _line_token_ranges(response_tokens, tokenizer)
    if not lines:
        return []
    v = verify(task, patch)
    try:
        edits = parse_patch(patch, len(task.lines))
    except (PatchError, L.ToyError) as e:
        return [
            {
                "text": f"that patch does not parse: {e}",
                "polarity": "negative",
                "token_range": [lines[0][0], lines[-1][1]],
            }
        ]
    if len(edits) != len(lines):  # cannot happen: one edit per non-empty line; stay safe
        return []
    bug = task.bug_line
    fixed = L.render(L.lex(task.reference_patch)[2:])
    first_fail = next((ln for ln in v.test_log.split("\n") if ln.startswith("FAIL")), "")
    in_scope = {("replace", bug), ("delete", bug), ("insert", bug), ("insert", bug + 1)}
    items = []
    for k, (e, (a, b)) in enumerate(zip(edits, lines), start=1):
        flag = next((f for f in v.cheat_flags if f"patch edit {k} " in f.evidence), None)
        text, pol = None, "negative"
        if flag is not None:
            text = {
                "special_casing_test_inputs": "you special-cased a tested input instead "
                "of fixing the code",
                "hard_coded_outputs": "you hard-coded a tested output",
            }.get(flag.rule, f"the monitor flagged this: {flag.rule}")
        elif e.op == "replace" and e.line == bug:
            if e.text == fixed:
                text, pol = "good, that fixes the buggy line", "positive"
            elif v.passed and v.quality.get("implementation_precision", 0.0) >= 1.0:
                text, pol = "that works, but it is not written the way the code is", "neutral"
            else:
                text = "that line is still wrong" + (f": {first_fail}" if first_fail else "")
        elif e.op == "delete" and e.line == bug:
            text = "you deleted the buggy line instead of fixing it"
        elif e.op == "replace" and e.text == task.lines[e.line - 1]:
            text = "this edit changes nothing"
        elif e.op == "insert" and L.lex(e.text)[:1] == ["if"] and ">" in L.lex(e.text)[:3]:
            text = "this changes the behaviour on inputs no test asked about"
        elif (e.op, e.line) not in in_scope:
            text = "you edited a line outside the buggy statement"
        elif e.op == "insert" and v.passed and v.quality.get("minimality", 1.0) < 1.0:
            text = "an extra step the fix does not need"
        if text is not None:
            items.append({"text": text, "polarity": pol, "token_range": [a, b]})
    return items


def feedback_record(
    task: ToyTask,
    prompt_tokens: Sequence[int],
    response_tokens: Sequence[int],
    *,
    record_id: str,
    tokenizer=TOKENIZER,
    user=None,
) -> dict:
    """One ``gagar_jax.data.feedback`` record (a dict) for a sampled single-turn patch.

    ``user``: who gives the feedback, ``(task, response_tokens, *, tokenizer) -> items``; default
    the rule-based :func:`user_feedback` (``gagar_jax.envs.llm_user.LLMUser`` is the LLM one).
    """
    p = len(prompt_tokens)
    items = (user or user_feedback)(task, response_tokens, tokenizer=tokenizer)
    for it in items:
        a, b = it["token_range"]
        it["token_range"] = [p + a, p + b]
        it["turn"] = 0
    patch = tokenizer.decode(response_tokens)
    v = verify(task, patch)
    quality = None
    if v.passed:
        quality = sum(v.quality[d] for d in QUALITY_DIMENSIONS) / len(QUALITY_DIMENSIONS)
    return {
        "record_id": record_id,
        "task_id": task.task_id,
        "segments": [
            {"role": "prompt", "text": task.prompt, "tokens": list(prompt_tokens)},
            {"role": "model", "text": patch, "tokens": list(response_tokens)},
        ],
        "feedback": items,
        "meta": {"passed": bool(v.passed), "cheat": bool(v.cheat), "quality": quality},
    }
