"""Grader evidence -> response tokens: a cited patch line maps exactly to the tokens of the edit
that wrote it, in the toy family, for every patch kind and every line the diff shows."""

import jax.numpy as jnp
import numpy as np

from gagar_jax import advantages as adv
from gagar_jax.envs import TOKENIZER, ToyTaskGenerator, candidate_patches, toy, toy_grading
from gagar_jax.grading import evidence_tokens, schema
from gagar_jax.grading.heuristic import HeuristicGrader

EOS = TOKENIZER.eos_id


def _tasks():
    for difficulty in (1, 2, 3):
        yield from ToyTaskGenerator(seed=11, difficulty=difficulty).tasks(4)


def _line_token_indices(patch_text):
    """Token indices of each patch line in `encode(patch) + [EOS]`, computed from the text."""
    out, start = [], 0
    for line in patch_text.split("\n"):
        n = len(TOKENIZER.encode(line))
        out.append(list(range(start, start + n)))
        start += n + 1  # the newline token
    return out


def test_each_cited_patch_line_maps_exactly_to_that_edits_tokens():
    checked = 0
    for task in _tasks():
        for kind, patch in candidate_patches(task).items():
            tokens = TOKENIZER.encode(patch) + [EOS]
            spans = toy_grading.toy_token_spans(task, tokens)
            v = toy.verify(task, patch)
            cand = toy_grading.toy_candidate(task, "c0", patch, v)
            fd = cand.parsed_patch.file(toy_grading.TOY_PROGRAM)
            if fd is None:  # "noop": rewrites a line with its own text, an empty diff
                continue
            added = {n: text.strip() for n, text in fd.added()}
            lines = _line_token_indices(patch)
            edits = toy.parse_patch(patch, len(task.lines))
            assert len(spans.edits) == len(edits), kind
            for e, span, want in zip(edits, spans.edits, lines):
                assert list(span.tokens) == want  # the tokens of that patch line, no newline
                for n in span.new_lines:
                    # The line is a real location of the unified diff the grader sees, and
                    # the text the edit wrote is what the patched file holds there.
                    ev = schema.Evidence("minimality", "patch", "c0", file=fd.path, line=n)
                    if added.get(n) == e.text:
                        assert cand.parsed_patch.has_location(fd.path, n)
                        mask = evidence_tokens.evidence_token_mask([ev], "c0", spans)
                        assert np.flatnonzero(mask).tolist() == want, (kind, patch, n)
                        checked += 1
    assert checked >= 30


def test_deleted_line_whole_file_execution_and_other_candidates():
    task = next(iter(ToyTaskGenerator(seed=3, difficulty=2).tasks(1)))
    n = len(task.lines)
    patch = f"del 1\n{n} : {task.lines[-1]}"
    tokens = TOKENIZER.encode(patch) + [EOS, 0, 0]  # padding after EOS is ignored
    spans = toy_grading.toy_token_spans(task, tokens)
    assert spans.length == len(tokens)
    lines = _line_token_indices(patch)
    patch_ev = lambda line, cid="c": schema.Evidence(
        "minimality", "patch", cid, "program.toy", line
    )
    # Line 1 of the patched file is original line 2, written by no edit, so a citation of
    # line 1 falls back to the original numbering: the deletion of original line 1.
    mask = evidence_tokens.evidence_token_mask([patch_ev(1)], "c", spans)
    assert np.flatnonzero(mask).tolist() == lines[0]
    whole = evidence_tokens.evidence_token_mask([patch_ev(None)], "c", spans)
    assert np.flatnonzero(whole).tolist() == lines[0] + lines[1]
    quote = schema.Evidence("solution_fit", "execution", "c", quote="FAILED something")
    other = patch_ev(None, cid="someone-else")
    assert not evidence_tokens.evidence_token_mask([quote, other], "c", spans).any()


def test_trajectory_events_and_bad_patches():
    task = next(iter(ToyTaskGenerator(seed=3, difficulty=1).tasks(1)))
    spans = evidence_tokens.TokenSpans(length=6, events=((0, 1), (4, 5)))
    ev = schema.Evidence("minimality", "trajectory", "c", event=1)
    assert np.flatnonzero(evidence_tokens.evidence_token_mask([ev], "c", spans)).tolist() == [4, 5]
    # A line edited twice does not apply: no spans (and verification fails it anyway).
    twice = TOKENIZER.encode("1 : a = x\n1 : a = x + 1")
    assert toy_grading.toy_token_spans(task, twice).edits == ()
    garbage = TOKENIZER.encode("return return : :")
    assert toy_grading.toy_token_spans(task, garbage).edits == ()


def test_heuristic_verdict_evidence_moves_credit_off_the_cited_line():
    # End to end on a real group: the heuristic grader's evidence on the inconsistent patch
    # (the operand order of its one line) and the sprawling patch maps to response tokens, and
    # token redistribution gives those tokens less of the positive advantage.
    hits = 0
    for gi, task in enumerate(_tasks()):
        kinds = candidate_patches(task)
        names = sorted(kinds)
        ws = toy_grading.toy_group(task, f"g{gi}", [kinds[k] for k in names])
        verdict = schema.validate(HeuristicGrader().grade(ws), ws)
        tokens = {
            c.candidate_id: TOKENIZER.encode(kinds[k]) + [EOS] for k, c in zip(names, ws.candidates)
        }
        spans = {cid: toy_grading.toy_token_spans(task, t) for cid, t in tokens.items()}
        masks = evidence_tokens.verdict_token_masks(verdict, spans)
        for _cid, ev_mask in masks.items():
            resp = np.ones(len(ev_mask), bool)  # every response token trains, EOS included
            if not ev_mask.any() or ev_mask.all():
                continue
            hits += 1
            inputs = adv.ImportanceInputs(mask=jnp.asarray(resp[None]), evidence=ev_mask[None])
            imp = adv.EvidenceImportance()(inputs)
            out = np.asarray(adv.redistribute_tokens(np.float32([0.5]), imp, resp[None], gamma=0.5))
            share_before = ev_mask.mean()
            share_after = out[0][ev_mask].sum() / out[0].sum()
            assert share_after < share_before
            np.testing.assert_allclose(out[0].mean(), 0.5, rtol=1e-5)
    assert hits >= 3


def test_loop_attaches_cited_tokens_and_packs_them_at_the_response_positions():
    from gagar_jax.envs.family import Attempt, FamilySettings, make_family
    from gagar_jax.rl import grade
    from gagar_jax.rl.collect import Group, pack_groups
    from gagar_jax.rl.train import _rollout, group_workspace

    family = make_family("toy", FamilySettings(num_train=4, max_prompt_len=64))
    task = family.train_task(0)
    kinds = candidate_patches(task)
    names = [k for k in ("minimal", "sprawling", "inconsistent", "wrong") if k in kinds]
    prompt = family.prompt_tokens(task)
    rollouts = []
    for k in names:
        resp = TOKENIZER.encode(kinds[k]) + [EOS]
        attempt = Attempt(response_tokens=resp, text=TOKENIZER.decode(resp))
        rollouts.append(
            _rollout(
                family,
                task,
                prompt,
                attempt,
                response_tokens=resp,
                logprobs=[-0.5] * len(resp),
                finish_reason="stop",
                policy_version=0,
            )
        )
    group = Group(group_id="g0", task=task, rollouts=rollouts)
    ws = group_workspace(family, group)
    verdict = schema.validate(HeuristicGrader().grade(ws), ws)
    res = schema.GradeResult.accepted(ws, verdict)
    grades = grade.to_arrays(
        [res],
        [group],
        num_groups=2,
        num_rollouts=len(rollouts),
        max_new_tokens=48,
        token_spans=family.token_spans,
    )
    assert grades.evidence.shape == (2, len(rollouts), 48) and grades.graded.tolist() == [1, 0]
    batch = pack_groups(
        [group],
        grades,
        num_groups=2,
        num_rollouts=len(rollouts),
        max_prompt_len=64,
        max_new_tokens=48,
        pad_id=TOKENIZER.pad_id,
    )
    cited = 0
    for k, r in enumerate(rollouts):
        cid = ws.candidates[k].candidate_id
        spans = family.token_spans(task, r.attempt)
        j = verdict.judgement(cid)
        want = np.zeros(len(r.response_tokens), bool)
        if j is not None:
            want = evidence_tokens.evidence_token_mask(j.evidence, cid, spans)
        row = batch.evidence[k]  # group-major rows: group 0, rollout k
        P = len(prompt)
        np.testing.assert_array_equal(row[P : P + len(want)], want)
        assert not row[:P].any() and not row[P + len(want) :].any()
        cited += int(want.sum())
    assert cited > 0  # the heuristic grader cited at least one line of these patches
    assert not batch.evidence[len(rollouts) :].any()  # the padding group
