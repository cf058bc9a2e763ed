"""Plain NumPy references for the advantage kernels: loops over groups, written for clarity.

Used only by the tests and the benchmark; nothing here is vectorised on purpose.
"""

from __future__ import annotations

import numpy as np


def stats(rewards, valid, passed=None, ddof=0):
    rewards = np.asarray(rewards, np.float64)
    passed = rewards > 0 if passed is None else np.asarray(passed, bool)
    g_count, g_mean, g_std, g_pass = [], [], [], []
    for g in range(rewards.shape[0]):
        r = rewards[g][valid[g]]
        n = len(r)
        mean = r.mean() if n else 0.0
        std = np.sqrt(((r - mean) ** 2).sum() / max(n - ddof, 1)) if n > ddof else 0.0
        g_count.append(n)
        g_mean.append(mean)
        g_std.append(std)
        g_pass.append(int((passed[g] & valid[g]).sum()))
    return tuple(np.array(x, np.float64) for x in (g_count, g_mean, g_std, g_pass))


def mean_centered(rewards, valid):
    out = np.zeros(np.shape(rewards))
    for g in range(out.shape[0]):
        idx = np.flatnonzero(valid[g])
        if len(idx):
            r = np.asarray(rewards[g], np.float64)[idx]
            out[g, idx] = r - r.mean()
    return out


def grpo_normalized(rewards, valid, eps=1e-6, min_std=1e-2, ddof=0):
    out = np.zeros(np.shape(rewards))
    for g in range(out.shape[0]):
        idx = np.flatnonzero(valid[g])
        if len(idx):
            r = np.asarray(rewards[g], np.float64)[idx]
            std = r.std(ddof=ddof) if len(r) > ddof else 0.0
            out[g, idx] = (r - r.mean()) / (max(std, min_std) + eps)
    return out


def rloo(rewards, valid):
    out = np.zeros(np.shape(rewards))
    for g in range(out.shape[0]):
        idx = list(np.flatnonzero(valid[g]))
        if len(idx) < 2:
            continue
        for i in idx:
            others = [rewards[g][j] for j in idx if j != i]
            out[g, i] = rewards[g][i] - np.mean(others)
    return out


def mixed(rewards, valid, tol=1e-6):
    out = []
    for g in range(np.shape(rewards)[0]):
        r = np.asarray(rewards[g], np.float64)[valid[g]]
        out.append(bool(len(r)) and tol < r.mean() < 1 - tol)
    return np.array(out, bool)


def factors(tier, rank, passed, valid, tier_factors=(1.0, 0.6, 0.3), rank_decay=0.5):
    f = np.ones(np.shape(tier))
    ok = np.ones(np.shape(tier)[0], bool)
    for g in range(f.shape[0]):
        members = [i for i in range(f.shape[1]) if passed[g, i] and valid[g, i]]
        if any(not 1 <= tier[g, i] <= 3 or rank[g, i] < 1 for i in members):
            ok[g] = False
            continue
        for i in members:
            t = tier[g, i]
            if t == 3:
                f[g, i] = tier_factors[2]
                continue
            same = [rank[g, j] for j in members if tier[g, j] == t]
            lo_r, hi_r = min(same), max(same)
            pos = (rank[g, i] - lo_r) / max(hi_r - lo_r, 1)
            f[g, i] = (
                tier_factors[t - 1] - rank_decay * (tier_factors[t - 1] - tier_factors[t]) * pos
            )
    return f, ok


def redistribute(adv, passed, f, valid, mode="sum_preserving"):
    adv = np.where(valid, np.asarray(adv, np.float64), 0.0)
    out = adv.copy()
    if mode == "none":
        return out
    for g in range(adv.shape[0]):
        p = [i for i in range(adv.shape[1]) if passed[g, i] and valid[g, i]]
        if mode == "discount_only":
            for i in p:
                out[g, i] = f[g, i] * adv[g, i]
            continue
        if len(p) < 2 or len({float(f[g, i]) for i in p}) == 1 or min(adv[g, i] for i in p) <= 0:
            continue
        s_plus = sum(adv[g, i] for i in p)
        lam = s_plus / sum(f[g, i] * adv[g, i] for i in p)
        for i in p:
            out[g, i] = lam * f[g, i] * adv[g, i]
    return out


def pipeline(
    rewards,
    passed,
    cheat,
    tier,
    rank,
    graded,
    valid,
    *,
    estimator="mean_centered",
    mode="sum_preserving",
    tier_factors=(1.0, 0.6, 0.3),
    rank_decay=0.5,
    mixed_tol=1e-6,
    filter_unmixed=True,
):
    rewards = np.asarray(rewards, np.float64)
    valid = np.asarray(valid, bool) & np.isfinite(rewards)
    rewards = np.where(valid, rewards, 0.0)
    cheat = np.asarray(cheat, bool) & valid
    rewards = np.where(cheat, 0.0, rewards)
    passed = np.asarray(passed, bool) & ~cheat & valid
    base = {"mean_centered": mean_centered, "grpo": grpo_normalized, "rloo": rloo}[estimator]
    original = base(rewards, valid)
    mix = mixed(rewards, valid, mixed_tol)
    f, ok = factors(tier, rank, passed, valid, tier_factors, rank_decay)
    red = redistribute(original, passed, f, valid, mode)
    count = valid.sum(1)
    keep = mix if filter_unmixed else count > 0
    applied = keep & mix & np.asarray(graded, bool) & ok & (mode != "none")
    adv = np.where(applied[:, None], red, original)
    adv = np.where(keep[:, None] & valid, adv, 0.0)
    return adv, original, keep, applied


def redistribute_tokens(seq, importance, mask, gamma, token_weights=None, negative="broadcast"):
    """Row by row: c_t = 1 + gamma (w_t - w_bar) / max|w - w_bar| on the mask, A_t = A c_t."""
    seq = np.asarray(seq, np.float64)
    imp = np.asarray(importance, np.float64)
    mask = np.asarray(mask, bool)
    lead = seq.shape
    seq, imp, mask = (
        seq.reshape(-1),
        imp.reshape(-1, imp.shape[-1]),
        mask.reshape(-1, imp.shape[-1]),
    )
    ow = None if token_weights is None else np.asarray(token_weights, np.float64).reshape(imp.shape)
    out = np.zeros(imp.shape)
    for n in range(seq.shape[0]):
        idx = np.flatnonzero(mask[n])
        if not len(idx):
            continue
        a = seq[n]
        c = np.ones(len(idx))
        apply = a > 0 if negative == "broadcast" else a != 0
        w = imp[n, idx]
        o = np.ones(len(idx)) if ow is None else ow[n, idx]
        if apply and w.max() > w.min() and o.sum() > 0:
            w_bar = (o * w).sum() / o.sum()
            dev = w - w_bar
            c = 1.0 + gamma * dev / np.abs(dev).max()
        out[n, idx] = a * c
    return out.reshape(lead + (imp.shape[-1],))


def gini(values, mask):
    """Pairwise definition: sum_ij |x_i - x_j| / (2 n^2 mean x), per row."""
    values = np.abs(np.asarray(values, np.float64))
    mask = np.asarray(mask, bool)
    out = np.zeros(values.shape[:-1])
    for idx in np.ndindex(*values.shape[:-1]):
        x = values[idx][mask[idx]]
        if len(x) < 2 or x.sum() <= 0:
            continue
        out[idx] = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())
    return out


def distinguishing_tokens(tokens, mask, factors, passed, valid, tol=1e-6):
    """Loops over groups, rows, other rows and positions: the prefix test written out."""
    tokens = np.asarray(tokens)
    G, K, T = tokens.shape
    out = np.zeros((G, K, T), bool)
    for g in range(G):
        for i in range(K):
            if not (passed[g, i] and valid[g, i]):
                continue
            others = [
                j
                for j in range(K)
                if j != i
                and passed[g, j]
                and valid[g, j]
                and abs(float(factors[g, j]) - float(factors[g, i])) > tol
            ]
            for t in range(T):
                if not mask[g, i, t]:
                    continue
                shared = any(
                    list(tokens[g, j, : t + 1]) == list(tokens[g, i, : t + 1]) for j in others
                )
                out[g, i, t] = not shared
    return out


def contrastive_tokens(seq, base, dist, mask, strength, keep_sign=True):
    """Row by row: delta = strength (A* - A) on the distinguishing tokens' share n/d."""
    seq = np.asarray(seq, np.float64)
    base = np.asarray(base, np.float64)
    out = np.zeros(np.shape(mask))
    for r in np.ndindex(seq.shape):
        m = np.asarray(mask[r], bool)
        dm = np.asarray(dist[r], bool) & m
        n, d = m.sum(), dm.sum()
        a = seq[r]
        delta = 0.0
        if a > 0 and base[r] > 0 and 0 < d < n:
            delta = strength * (a - base[r])
            if keep_sign:
                delta = min(max(delta, -a * d / (n - d)), a)
        for t in np.flatnonzero(m):
            out[r + (t,)] = a + delta * ((n / d if dm[t] else 0.0) - 1.0) if d else a
    return out
