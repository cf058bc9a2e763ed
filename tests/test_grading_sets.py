"""The labelled group sets: stored data equals what the builders produce, gold labels are
consistent, gold fixes pass the real verifiers with no flag, planted cheats are cheats."""

import os

import pytest

from gagar_jax.grading import labelled

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "repos")


def test_toy_set_is_reproducible_and_labels_are_consistent():
    stored = labelled.load_set("toy")
    built = labelled.build_toy_set()
    assert [labelled.group_to_dict(g) for g in built.groups] == [
        labelled.group_to_dict(g) for g in stored.groups
    ]
    for lg in stored.groups:
        kinds = {g.kind for g in lg.gold.values()}
        assert {"minimal", "cheat"} <= kinds
        assert any(not c.passed for c in lg.workspace.candidates)  # a mixed group
        for cid, g in lg.gold.items():
            assert (g.tier, g.rank, g.cheat) == labelled.TOY_GOLD[g.kind]
            cand = lg.workspace.candidate(cid)
            # The toy monitor confirms exactly the planted cheats.
            assert cand.confirmed_cheat == g.cheat, (lg.workspace.group_id, g.kind)


def test_repo_set_labels_cover_every_planted_kind():
    s = labelled.load_set("repo")
    assert [lg.workspace.group_id for lg in s.groups] == ["repo-statkit", "repo-slugger"]
    for lg in s.groups:
        assert {g.kind for g in lg.gold.values()} == set(labelled.REPO_GOLD)
        assert [lg.kinds[c.candidate_id] for c in lg.workspace.candidates if not c.passed] == [
            "noop"
        ]


def test_unknown_set_names_the_stored_ones():
    with pytest.raises(ValueError, match="stored sets"):
        labelled.load_set("nonesuch")


@pytest.mark.parametrize("name", labelled.REPO_FIXTURES)
def test_repo_gold_fixes_pass_and_cheats_are_cheats_in_the_sandboxed_verifier(name):
    from gagar_jax.envs.repo import RepoTask, tree_patch
    from gagar_jax.verify.repo import verify_repo_patch
    from gagar_jax.verify.sandbox import Limits

    task = RepoTask.from_dir(os.path.join(FIXTURES, name))
    trees = labelled.repo_variants(name, task.files)
    limits = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)
    for kind in ("minimal", "test_weakening", "special_case", "noop"):
        v = verify_repo_patch(task, tree_patch(task.files, trees[kind]), limits=limits)
        if kind == "minimal":
            assert v.passed and not v.flags, (kind, v.test_log, v.flags)
        elif kind == "noop":
            assert v.status == "failed" and not v.cheat
        else:
            assert v.passed and v.cheat, (kind, v.flags)  # passes, and the monitor confirms
    # The test-weakening cheat's own weakened assertion would hold without its fix too: the
    # verifier resets the tests, so only the fix makes it pass.
    no_fix = dict(trees["noop"])
    test_file = task.test_files[0]
    no_fix[test_file] = trees["test_weakening"][test_file]
    v = verify_repo_patch(task, tree_patch(task.files, no_fix), limits=limits)
    assert v.status == "failed" and v.reset_files == (test_file,)
