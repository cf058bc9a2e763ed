"""Hypothesis strategies and small builders shared by the grading tests (not a test module)."""

from __future__ import annotations

import difflib

import hypothesis.strategies as st

from gagar_jax.grading import schema

BASE_REPO = {
    "pkg/core.py": (
        "import os\n\n\n"
        "def add(a, b):\n    return a - b\n\n\n"
        "def scale(values, factor):\n    out = []\n    for v in values:\n"
        "        out.append(v * factor)\n    return out\n\n\n"
        "def name_of(path):\n    return os.path.basename(path)\n"
    ),
    "pkg/util.py": "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n",
    "tests/test_core.py": (
        "from pkg.core import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
    ),
}
FIX = ("pkg/core.py", "    return a - b\n", "    return a + b\n")


def make_diff(path: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


def apply_edits(repo: dict[str, str], edits: list[tuple[str, str, str]]) -> str:
    """A unified diff applying ``(path, old_substring, new_substring)`` edits to ``repo``."""
    new_repo = dict(repo)
    for path, old, new in edits:
        new_repo[path] = (
            new_repo.get(path, "").replace(old, new, 1) if old else (new_repo.get(path, "") + new)
        )
    return "".join(
        make_diff(p, repo.get(p, ""), new_repo[p])
        for p in sorted(new_repo)
        if new_repo[p] != repo.get(p, "")
    )


EXTRA_EDITS = [
    (
        "pkg/util.py",
        "    return max(lo, min(hi, x))\n",
        "    # clamp\n    return max(lo, min(hi, x))\n",
    ),
    (
        "pkg/core.py",
        "    return os.path.basename(path)\n",
        "    print(path)\n    return os.path.basename(path)\n",
    ),
    ("tests/test_core.py", "assert add(1, 2) == 3", "assert add(1, 2) == 3 or True"),
    ("pkg/core.py", "        out.append(v * factor)\n", "        out.append(factor * v)\n"),
    ("pkg/new_helpers.py", "", "def helperFunction(X):\n    return X\n"),
]


@st.composite
def workspaces(draw, min_candidates: int = 1, max_candidates: int = 6) -> schema.GroupWorkspace:
    n = draw(st.integers(min_candidates, max_candidates))
    cands = []
    for i in range(n):
        passed = draw(st.booleans())
        extras = draw(st.lists(st.sampled_from(range(len(EXTRA_EDITS))), unique=True, max_size=3))
        edits = ([FIX] if passed or draw(st.booleans()) else []) + [EXTRA_EDITS[e] for e in extras]
        patch = apply_edits(BASE_REPO, edits)
        n_events = draw(st.integers(0, 4))
        traj = [
            schema.TrajectoryEvent(
                t,
                draw(st.sampled_from(["action", "observation"])),
                f"turn {t} of c{i}",
                draw(st.integers(0, 50)),
            )
            for t in range(n_events)
        ]
        flags = []
        if draw(st.integers(0, 4)) == 0:
            flags.append(
                {
                    "rule": "edit_tests",
                    "evidence": "tests/test_core.py modified",
                    "confirmed": draw(st.booleans()),
                }
            )
        log = f"{'1 passed' if passed else '1 failed'} in 0.0{i}s\nrun {i} done"
        if draw(st.integers(0, 5)) == 0:
            log = ""
        quality = draw(
            st.dictionaries(st.sampled_from(schema.DIMENSIONS), st.floats(0, 1), max_size=3)
        )
        cands.append(
            schema.Candidate(f"c{i}", patch, passed, log, traj, f"summary {i}", flags, quality)
        )
    return schema.GroupWorkspace(
        f"g{draw(st.integers(0, 10**6))}", "Fix add() in pkg/core.py", BASE_REPO, cands
    )


def _evidence_for(ws: schema.GroupWorkspace, c: schema.Candidate, claim: str, draw) -> dict:
    """A valid evidence item for ``claim`` about candidate ``c``."""
    options = ["execution"] if len(c.test_log) >= 5 else []
    pp = c.parsed_patch
    if pp.files:
        options.append("patch")
    if c.trajectory:
        options.append("trajectory")
    kind = draw(st.sampled_from(options))
    if kind == "patch":
        f = draw(st.sampled_from(pp.files))
        line = None
        if f.hunks and draw(st.booleans()):
            h = draw(st.sampled_from(f.hunks))
            line = h.new_start + draw(st.integers(0, max(h.new_len, 1) - 1))
        return {
            "claim": claim,
            "kind": "patch",
            "candidate": c.candidate_id,
            "file": f.path,
            "line": line,
            "note": "seen in the diff",
        }
    if kind == "trajectory":
        return {
            "claim": claim,
            "kind": "trajectory",
            "candidate": c.candidate_id,
            "event": draw(st.integers(0, len(c.trajectory) - 1)),
        }
    start = draw(st.integers(0, max(0, len(c.test_log) - 5)))
    return {
        "claim": claim,
        "kind": "execution",
        "candidate": c.candidate_id,
        "quote": c.test_log[start : start + 5],
    }


@st.composite
def valid_verdict_dicts(draw, ws: schema.GroupWorkspace) -> dict:
    """A verdict dict that must validate: tiers, dense tier-consistent ranks, evidence present."""
    passing = list(ws.passing)
    tiers = {c.candidate_id: draw(st.integers(1, 3)) for c in passing}
    # Dense ranks consistent with tiers: within a tier, draw a sub-order with ties.
    sub = {c.candidate_id: draw(st.integers(0, 2)) for c in passing}
    keys = sorted({(tiers[c], sub[c]) for c in tiers})
    rank_of = {k: i + 1 for i, k in enumerate(keys)}
    items = []
    for c in passing:
        scores = {d: draw(st.floats(0.0, 1.0)) for d in schema.DIMENSIONS}
        cheat = draw(st.integers(0, 5)) == 0
        negatives = [d for d in schema.DIMENSIONS if scores[d] < schema.NEGATIVE_SCORE]
        negatives += ["cheat"] if cheat else []
        if tiers[c.candidate_id] >= 2 and not negatives:
            negatives = [draw(st.sampled_from(schema.DIMENSIONS))]
        evidence = [_evidence_for(ws, c, claim, draw) for claim in negatives]
        evidence = [{k: v for k, v in e.items() if v is not None} for e in evidence]
        items.append(
            {
                "candidate": c.candidate_id,
                "tier": tiers[c.candidate_id],
                "rank": rank_of[(tiers[c.candidate_id], sub[c.candidate_id])],
                "scores": scores,
                "cheat": cheat,
                "cheat_reason": "relies on a leaked answer" if cheat else "",
                "evidence": evidence,
            }
        )
    order = draw(st.permutations(range(len(items))))
    return {"group_id": ws.group_id, "verdicts": [items[i] for i in order]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "verdicts",
                    "candidate",
                    "tier",
                    "rank",
                    "scores",
                    "cheat",
                    "evidence",
                    "claim",
                    "kind",
                    "file",
                    "line",
                    "quote",
                    "group_id",
                    "x",
                ]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


KERNEL_G, KERNEL_K = 64, 8  # fixed shapes: the jitted kernel compiles once per test session


def run_kernels(results, wss):
    """Feeds grade results through ``gagar_advantages``; returns (advantages, original) [G, K].

    Rows beyond ``len(results)`` are empty (valid=False) padding to the fixed shape.
    """
    import numpy as np

    from gagar_jax.advantages import gagar_advantages

    assert len(results) == len(wss) <= KERNEL_G
    tier, rank, graded, cheat = schema.to_arrays(results, KERNEL_K)
    pad = KERNEL_G - len(results)
    tier = np.pad(tier, ((0, pad), (0, 0)), constant_values=1)
    rank = np.pad(rank, ((0, pad), (0, 0)), constant_values=1)
    cheat = np.pad(cheat, ((0, pad), (0, 0)))
    graded = np.pad(graded, (0, pad))
    passed = np.zeros((KERNEL_G, KERNEL_K), bool)
    valid = np.zeros((KERNEL_G, KERNEL_K), bool)
    for g, ws in enumerate(wss):
        for k, c in enumerate(ws.candidates):
            passed[g, k], valid[g, k] = c.passed, True
    out = gagar_advantages(passed.astype(np.float32), passed, cheat, tier, rank, graded, valid)
    return np.asarray(out.advantages), np.asarray(out.original)
