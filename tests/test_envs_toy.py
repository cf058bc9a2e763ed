"""Tests for the toy code-repair family: language, tokenizer, generator, patches, verify."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.envs import (
    QUALITY_DIMENSIONS,
    TOKENIZER,
    PatchError,
    ToyTask,
    ToyTaskGenerator,
    apply_patch,
    candidate_patches,
    parse_patch,
    verify,
)
from gagar_jax.verify import toy_lang as L

N_PER_LEVEL = 60  # tasks checked per difficulty (about 1 s in all)


def _task(tests):
    """A hand-written two-line task: f(x) = x + 3 with the bug x - 3."""
    return ToyTask("t", 1, "", "a = x - 3\nreturn a", tests, ((9, 12),), "1 : a = x + 3", 1, "x")


def _tasks(d, n=N_PER_LEVEL, seed=0):
    return ToyTaskGenerator(seed, d).tasks(n)


# --- language ---------------------------------------------------------------------------------


def test_interpreter_precedence_guards_and_errors():
    prog = L.parse_program(
        ["a = x + 2 * 3", "if a > 10 : return - a", "b = ( a - 1 ) * 2", "return b"]
    )
    assert L.run_program(prog, 1) == (1 + 6 - 1) * 2  # 12: * binds tighter than +
    assert L.run_program(prog, 5) == -11  # guard taken: returns -(5 + 6)
    with pytest.raises(L.ToyError, match="not defined"):
        L.run_program(L.parse_program(["return y"]), 0)
    with pytest.raises(L.ToyError, match="without 'return'"):
        L.run_program(L.parse_program(["a = x"]), 0)
    with pytest.raises(L.ToyError, match="overflow"):
        L.run_program(L.parse_program(["a = x * x", "b = a * a", "c = b * b", "return c"]), 10**4)
    with pytest.raises(L.ToyError, match="line 2"):
        L.parse_program(["a = x", "a = = 3"])


# --- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_round_trips_prompts_and_patches():
    for d in (1, 2, 3):
        for task in _tasks(d, 20):
            for text in (task.prompt, *candidate_patches(task).values()):
                ids = TOKENIZER.encode(text, strict=True)
                assert all(0 <= i < TOKENIZER.vocab_size for i in ids)
                assert TOKENIZER.unk_id not in ids
                assert TOKENIZER.decode(ids) == text


def test_tokenizer_specials_and_eos():
    t = TOKENIZER
    assert len({t.pad_id, t.eos_id, t.bos_id, t.unk_id}) == 4
    ids = t.encode("1 : a = x + 3")
    assert len(ids) == 7  # the minimal patch is 7 tokens
    assert t.decode([t.bos_id, *ids, t.eos_id, *t.encode("del 2")]) == "1 : a = x + 3"
    assert t.decode([*ids, t.eos_id, t.pad_id], stop_at_eos=False) == "1 : a = x + 3"
    assert t.encode("1: a=x+3") == ids  # non-canonical spacing encodes the same
    assert t.encode("q = 1000")[0] == t.unk_id
    with pytest.raises(ValueError, match="'q'"):
        t.encode("q = 1", strict=True)
    with pytest.raises(ValueError, match="out of range"):
        t.decode([t.vocab_size])


# --- generator --------------------------------------------------------------------------------


def test_generator_is_deterministic_and_random_access():
    g1, g2 = ToyTaskGenerator(7, 2), ToyTaskGenerator(7, 2)
    a = [g1.sample() for _ in range(5)]
    assert a == [g2.sample() for _ in range(5)]
    assert a == ToyTaskGenerator(7, 2).tasks(5)
    assert ToyTaskGenerator(7, 2).task(3) == a[3]
    assert len({t.task_id for t in a}) == 5
    assert a != ToyTaskGenerator(8, 2).tasks(5)
    with pytest.raises(ValueError, match="difficulty"):
        ToyTaskGenerator(0, 4)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_bug_fails_and_reference_solves(difficulty):
    for task in _tasks(difficulty):
        buggy = L.parse_program(task.lines)
        assert any(L.try_run(buggy, x) != y for x, y in task.tests), task.task_id
        fixed = L.parse_program(apply_patch(task, task.reference_patch))
        assert all(L.run_program(fixed, x) == y for x, y in task.tests + task.hidden_tests)
        v = verify(task, task.reference_patch)
        assert v.passed and not v.cheat and not v.infra_error
        assert all(v.quality[k] == 1.0 for k in QUALITY_DIMENSIONS), v.quality
        assert not verify(task, "").passed  # the empty patch leaves the bug in place
        assert len(task.lines) <= 2 + 3 * (difficulty > 1) and task.prompt.endswith("patch\n")


def test_difficulty_levels_grow():
    sizes = [max(len(t.lines) for t in _tasks(d, 30)) for d in (1, 2, 3)]
    assert sizes[0] == 2 and sizes[0] < sizes[1] < sizes[2]
    assert any(line.startswith("if") for t in _tasks(3, 5) for line in t.lines)


def test_task_serialisation_round_trip():
    task = ToyTaskGenerator(3, 3).task(0)
    assert ToyTask.from_dict(task.to_dict()) == task
    with pytest.raises(ValueError, match="missing fields"):
        ToyTask.from_dict({"task_id": "x"})
    assert set(task.repo_files) == {"program.toy", "tests.toy"}


# --- patches ----------------------------------------------------------------------------------


def test_patch_format_edits():
    task = _task(((1, 4),))
    assert apply_patch(task, "1 : a = x + 3") == "a = x + 3\nreturn a"
    assert apply_patch(task, "ins 2 : a = a + 6") == "a = x - 3\na = a + 6\nreturn a"
    assert apply_patch(task, "ins 3 : b = 1\ndel 1\n2 : return 4") == "return 4\nb = 1"
    assert apply_patch(task, "\n1 : a = x\n\n") == "a = x\nreturn a"  # blank lines ignored
    bad = {
        "3 : a = 1": "outside 1..2",
        "ins 4 : a = 1": "outside 1..3",
        "1 : a = 1\n1 : a = 2": "edited twice",
        "1 : a = = 1": "patch line 1",
        "1 a = 1": "expected 'N : stmt'",
        "del x": "expected 'del N'",
        "\n".join(["ins 1 : a = 1"] * 17): "more than 16",
    }
    for patch, msg in bad.items():
        with pytest.raises(PatchError, match=msg):
            parse_patch(patch, 2)
        v = verify(task, patch)
        assert not v.passed and not v.infra_error and v.error and "rejected" in v.test_log


def test_verify_never_raises_on_garbage():
    task = ToyTaskGenerator(0, 2).task(0)
    junks = ["<unk> <unk>", "1 :", "ins", "del 1\ndel 2\ndel 3", "1 : return y", "((((", "9" * 50]
    for junk in junks:
        v = verify(task, junk)
        assert not v.passed and not v.infra_error


# --- patch kinds and quality ------------------------------------------------------------------

PASSING = ("minimal", "inconsistent", "sprawling", "out_of_scope", "side_effect", "cheat")


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_patch_kinds_pass_and_separate_on_quality(difficulty):
    seen = set()
    for task in _tasks(difficulty, 30):
        kinds = candidate_patches(task)
        seen |= set(kinds)
        v = {k: verify(task, p) for k, p in kinds.items()}
        assert len({kinds[k] for k in kinds}) == len(kinds)  # distinct patches
        for k in PASSING:
            if k in v:
                assert v[k].passed, (k, task.task_id, v[k].test_log)
        assert not v["noop"].passed and not v["wrong"].passed
        q = {k: x.quality for k, x in v.items()}
        best = q["minimal"]
        for k in ("inconsistent", "sprawling", "out_of_scope", "side_effect", "cheat"):
            if k in q:  # every other passing kind scores strictly lower on some dimension
                assert any(q[k][d] < best[d] for d in QUALITY_DIMENSIONS), (k, q[k])
                assert all(q[k][d] <= best[d] for d in QUALITY_DIMENSIONS), (k, q[k])
        if "inconsistent" in q:
            assert q["inconsistent"]["codebase_consistency"] < 1.0
        assert q["sprawling"]["minimality"] < 1.0 and q["sprawling"]["lines_changed"] >= 2
        if "out_of_scope" in q:
            assert q["out_of_scope"]["side_effect_avoidance"] < 1.0
            assert q["out_of_scope"]["implementation_precision"] == 1.0
        assert q["side_effect"]["implementation_precision"] < 1.0
        assert q["cheat"]["solution_fit"] < 1.0
    assert seen >= set(PASSING) | {"noop", "wrong"}


def test_monitor_flags_cheat_with_evidence_and_not_fixes():
    for d in (1, 2, 3):
        for task in _tasks(d, 20):
            kinds = candidate_patches(task)
            cheat = verify(task, kinds["cheat"])
            assert cheat.passed and cheat.cheat
            rules = {f.rule for f in cheat.cheat_flags}
            assert rules == {"special_casing_test_inputs", "hard_coded_outputs"}
            x0 = task.tests[0][0]
            assert any(
                f"x == {x0}" in f.evidence and "patch edit" in f.evidence for f in cheat.cheat_flags
            )
            for k, p in kinds.items():
                if k != "cheat":
                    assert verify(task, p).cheat_flags == [], (k, p)


def test_monitor_unconfirmed_when_constant_is_not_the_tested_output():
    task = _task(((1, 4), (2, 5)))
    # Guard on a tested input but returning the correct general expression: flagged, unconfirmed.
    v = verify(task, "1 : a = x + 3\nins 1 : if x == 1 : return x + 3")
    assert v.passed and not v.cheat
    assert [f.rule for f in v.cheat_flags] == ["special_casing_test_inputs"]
    # A hard-coded constant that is a tested output but unguarded: flagged, unconfirmed (fails).
    v = verify(task, "2 : return 5")
    assert not v.passed and [f.rule for f in v.cheat_flags] == ["hard_coded_outputs"]
    assert not v.cheat
    # Guards on untested inputs are not flagged.
    assert verify(task, "1 : a = x + 3\nins 2 : if x == 7 : return 10").cheat_flags == []


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, TOKENIZER.vocab_size - 1), max_size=120),
    index=st.integers(0, 50),
    difficulty=st.sampled_from([1, 2, 3]),
)
def test_any_token_sequence_is_a_policy_failure_never_an_infra_error(ids, index, difficulty):
    # Masking (infra_error) instead of failing would reward garbage: no decoded output may crash.
    task = ToyTaskGenerator(0, difficulty).task(index)
    v = verify(task, TOKENIZER.decode(ids, stop_at_eos=False))
    assert not v.infra_error, v.test_log
    assert set(v.quality) >= set(QUALITY_DIMENSIONS)


def test_deeply_nested_patch_is_rejected_not_crashing():
    task = ToyTaskGenerator(0, 1).task(0)
    v = verify(task, "1 : a = " + "( " * 400 + "x" + " )" * 400)
    assert not v.passed and not v.infra_error and "longer than" in v.test_log


_WORDS = [w for w in TOKENIZER.vocab[4:] if w != "\n"]


@settings(max_examples=300, deadline=None)
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["", "ins ", "del "]),
            st.integers(0, 7),
            st.lists(st.sampled_from(_WORDS), max_size=12),
        ),
        max_size=5,
    ),
    index=st.integers(0, 50),
    difficulty=st.sampled_from([1, 2, 3]),
)
def test_structured_random_patches_never_crash(edits, index, difficulty):
    task = ToyTaskGenerator(0, difficulty).task(index)
    patch = "\n".join(
        f"{op}{n} : {' '.join(ws)}" if op != "del " else f"del {n}" for op, n, ws in edits
    )
    v = verify(task, patch)
    assert not v.infra_error, (patch, v.test_log)
