"""Linked segments: building them from gateway calls, and the episode's credit across them.

The property: an episode trained as several segments gets exactly the credit it gets as one
sample (the same episode with its model tokens in one row), under Gagar's sum-preserving group
redistribution followed by the token broadcast, per-segment token credit, or episode-wide token
credit; the episode-wide token credit also gives every token the weight of the one-row form.
"""

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax import advantages as adv
from gagar_jax.rollout.segments import build_segments, pack_segments, segment_metrics


def _call(index, prompt, completion, version=0):
    return {
        "index": index,
        "prompt_ids": list(prompt),
        "completion_ids": list(completion),
        "logprobs": [-0.1 * (k + 1) for k in range(len(completion))],
        "policy_version": version,
    }


def test_appending_calls_merge_into_one_segment():
    c0 = _call(0, [1, 2, 3], [4, 5])
    c1 = _call(1, [1, 2, 3, 4, 5, 9, 9], [6], version=1)  # prompt = c0 + observation [9, 9]
    (seg,) = build_segments([c0, c1])
    assert seg.tokens == [1, 2, 3, 4, 5, 9, 9, 6]
    assert seg.response_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert seg.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.1])
    assert seg.token_versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert seg.prompt_len == 3 and seg.calls == [0, 1]


def test_an_edited_history_starts_a_new_segment_and_a_resumed_one_continues():
    c0 = _call(0, [1, 2], [3])
    c1 = _call(1, [1, 7], [8])  # compacted: no longer extends [1, 2, 3]
    c2 = _call(2, [1, 2, 3, 5], [6])  # extends the first segment again (after a sub-agent)
    s0, s1 = build_segments([c0, c1, c2])
    assert s0.calls == [0, 2] and s0.tokens == [1, 2, 3, 5, 6]
    assert s1.calls == [1] and s1.tokens == [1, 7, 8] and s1.response_mask == [0, 0, 1]
    m = segment_metrics([[s0, s1], [s0]])
    assert m["episode/segments"] == 1.5 and m["episode/calls"] == 2.5
    assert m["episode/tokens"] == (8 + 5) / 2 and m["episode/model_tokens"] == (3 + 2) / 2


def test_mismatched_logprobs_are_refused():
    bad = _call(0, [1], [2, 3])
    bad["logprobs"] = [0.0]
    with pytest.raises(ValueError, match="calls\\[0\\]: 2 completion ids but 1 log-probs"):
        build_segments([bad])


@st.composite
def segmented_groups(draw):
    """G groups of K episodes: rewards/passed/tiers, and per episode its model-token importance
    cut into 1..4 segments, each with 0..3 context tokens before its model tokens."""
    g, k = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    passed = draw(hnp.arrays(bool, (g, k)))
    tier = np.where(passed, draw(hnp.arrays(np.int32, (g, k), elements=st.integers(1, 3))), 0)
    rank = draw(hnp.arrays(np.int32, (g, k), elements=st.integers(1, 4)))
    episodes = []
    for _ in range(g * k):
        n = draw(st.integers(1, 12))
        imp = draw(
            hnp.arrays(np.float32, (n,), elements=st.floats(0, 10, width=32).map(np.float32))
        )
        cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3)) - {n})
        parts = np.split(imp, cuts)
        context = [draw(st.integers(0, 3)) for _ in parts]
        episodes.append((imp, parts, context))
    return passed, tier, rank, episodes


def _rows(episodes, split: bool):
    """[S, T] importance and mask, and the episode of each row; one row per episode when not
    ``split`` (context tokens first, then all model tokens)."""
    rows = []
    for e, (imp, parts, context) in enumerate(episodes):
        if split:
            rows += [(e, c, p) for c, p in zip(context, parts)]
        else:
            rows.append((e, sum(context), imp))
    t = max(c + len(p) for _, c, p in rows)
    importance = np.zeros((len(rows), t), np.float32)
    mask = np.zeros((len(rows), t), bool)
    for i, (_, c, p) in enumerate(rows):
        importance[i, c : c + len(p)] = p
        mask[i, c : c + len(p)] = True
    return importance, mask, np.array([e for e, _, _ in rows], np.int32)


@settings(max_examples=30, deadline=None)
@given(
    segmented_groups(),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from(["broadcast", "redistribute"]),
)
def test_total_credit_with_segments_equals_one_sample(data, gamma, negative):
    passed, tier, rank, episodes = data
    g, k = passed.shape
    out = adv.gagar_advantages(
        passed.astype(np.float32),
        passed,
        np.zeros_like(passed),
        tier,
        rank,
        np.ones((g,), bool),
        np.ones((g, k), bool),
        config=adv.GagarConfig(mode="sum_preserving"),
    )
    a_ep = jnp.asarray(out.advantages).reshape(-1)  # [E], the episodes' advantages
    n_ep = np.array([len(imp) for imp, _, _ in episodes], np.float32)

    imp1, mask1, ids1 = _rows(episodes, split=False)
    imp_s, mask_s, ids_s = _rows(episodes, split=True)
    a_seg = adv.segment_advantages(a_ep, ids_s)
    assert np.array_equal(np.asarray(a_seg), np.asarray(a_ep)[ids_s])

    one = np.asarray(adv.redistribute_tokens(a_ep, imp1, mask1, gamma=gamma, negative=negative))
    variants = {
        "broadcast": np.asarray(adv.broadcast_to_tokens(a_seg, mask_s)),
        "per_segment": np.asarray(
            adv.redistribute_tokens(a_seg, imp_s, mask_s, gamma=gamma, negative=negative)
        ),
        "episode_wide": np.asarray(
            adv.redistribute_segment_tokens(
                a_ep, imp_s, mask_s, ids_s, gamma=gamma, negative=negative
            )
        ),
    }
    want = np.asarray(a_ep) * n_ep  # the one-sample episode's credit: A_e |M_e|
    np.testing.assert_allclose(one.sum(-1), want, rtol=1e-5, atol=1e-5)
    for name, tok in variants.items():
        per_episode = np.zeros(len(episodes))
        np.add.at(per_episode, ids_s, tok.sum(-1))
        np.testing.assert_allclose(per_episode, want, rtol=1e-5, atol=1e-5, err_msg=name)
        assert np.all(tok[~mask_s] == 0), name
    # The group's balance is the one-sample balance: positive and negative totals agree.
    seg_tok = variants["episode_wide"]
    assert np.isclose(seg_tok[seg_tok > 0].sum(), one[one > 0].sum(), rtol=1e-5, atol=1e-5)
    assert np.isclose(seg_tok[seg_tok < 0].sum(), one[one < 0].sum(), rtol=1e-5, atol=1e-5)
    # Episode-wide credit gives every model token its one-row weight.
    flat_one = [one[e][mask1[e]] for e in range(len(episodes))]
    flat_seg = [
        np.concatenate([seg_tok[i][mask_s[i]] for i in np.flatnonzero(ids_s == e)])
        for e in range(len(episodes))
    ]
    for a, b in zip(flat_one, flat_seg):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_broadcast_credit_is_exact_with_two_segments():
    # Episode 0 in two segments of 3 and 2 model tokens, A = 0.75: 0.75 * 5 = 3.75 exactly.
    mask = np.array([[0, 1, 1, 1], [0, 0, 1, 1]], bool)
    a_seg = adv.segment_advantages(jnp.array([0.75, -0.75]), np.array([0, 0]))
    tok = np.asarray(adv.broadcast_to_tokens(a_seg, mask))
    assert tok.sum() == 3.75
    same = np.asarray(
        adv.redistribute_segment_tokens(
            jnp.array([0.75, -0.75]), mask.astype(np.float32), mask, np.array([0, 0]), gamma=0.5
        )
    )
    assert np.array_equal(same, tok)  # constant importance: the broadcast, bit for bit


def test_segment_kernels_name_bad_fields():
    with pytest.raises(ValueError, match="segment_episode: expected values in \\[0, 2\\)"):
        adv.segment_advantages(jnp.zeros(2), np.array([0, 2]))
    with pytest.raises(ValueError, match="segment_episode: expected shape \\[2\\]"):
        adv.redistribute_segment_tokens(
            jnp.zeros(2),
            np.ones((2, 3), np.float32),
            np.ones((2, 3), bool),
            np.array([0]),
            gamma=0.1,
        )


def test_pack_segments_rows():
    segs = build_segments([_call(0, [1, 2], [3]), _call(1, [4], [5, 6])])
    packed = pack_segments([segs, segs[:1]])
    assert packed["tokens"].shape == (3, 3)
    assert packed["segment_episode"].tolist() == [0, 0, 1]
    assert packed["response_mask"][1].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="more than length=2"):
        pack_segments([segs], length=2)
