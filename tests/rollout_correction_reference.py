"""Plain NumPy references of the rollout-correction toolbox (gagar_jax.losses.rollout_correction):
loops over sequences and tokens, written for clarity, float64. Used only by the tests."""

from __future__ import annotations

import math

import numpy as np


def _d(prox, behav, mask, b, t):
    return min(max(float(prox[b, t]) - float(behav[b, t]), -20.0), 20.0) if mask[b, t] else 0.0


def _result(weights, keep, mask):
    """(weights, keep, masked token share, masked sequence share)."""
    B, T = mask.shape
    n_tok = sum(1 for b in range(B) for t in range(T) if mask[b, t])
    n_seq = sum(1 for b in range(B) if any(mask[b]))
    dropped = [[bool(mask[b, t] and not keep[b, t]) for t in range(T)] for b in range(B)]
    tok = sum(sum(row) for row in dropped) / max(n_tok, 1)
    seq = sum(1 for row in dropped if any(row)) / max(n_seq, 1)
    w = np.where(keep, weights, 0.0)
    return w, keep, tok, seq


def icepop(prox, behav, mask, low, high):
    B, T = mask.shape
    w, keep = np.ones((B, T)), np.zeros((B, T), bool)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            r = math.exp(_d(prox, behav, mask, b, t))
            w[b, t] = r
            keep[b, t] = low <= r <= high
    return _result(w, keep, mask)


def seq_mask_tis(prox, behav, mask, low, high, cap):
    B, T = mask.shape
    w, keep = np.ones((B, T)), np.zeros((B, T), bool)
    for b in range(B):
        ds = [_d(prox, behav, mask, b, t) for t in range(T)]
        n = max(sum(1 for t in range(T) if mask[b, t]), 1)
        geo = math.exp(sum(ds) / n)
        for t in range(T):
            if mask[b, t]:
                w[b, t] = min(math.exp(ds[t]), cap)
                keep[b, t] = low <= geo <= high
    return _result(w, keep, mask)


def outlier(prox, behav, mask, threshold, veto):
    B, T = mask.shape
    keep = np.array(mask, bool)
    for b in range(B):
        out = [bool(mask[b, t]) and abs(_d(prox, behav, mask, b, t)) > math.log(threshold)
               for t in range(T)]  # fmt: skip
        for t in range(T):
            if out[t] or (veto and any(out)):
                keep[b, t] = False
    return _result(np.ones((B, T)), keep, mask)


def tv_trust_region(logp, behav, adv, mask, delta):
    B, T = mask.shape
    keep = np.array(mask, bool)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            p, q = math.exp(float(logp[b, t])), math.exp(float(behav[b, t]))
            a = float(adv[b]) if np.ndim(adv) == 1 else float(adv[b, t])
            outward = (a > 0 and p > q) or (a < 0 and p < q)
            if abs(p - q) > delta and outward:
                keep[b, t] = False
    return _result(np.ones((B, T)), keep, mask)
