"""Contrastive token credit: Gagar's redistribution concentrated on the tokens that differ.

Sequence-level Gagar moves credit between the passing rollouts of a group (`A*_i = lambda f_i
A_i`) and broadcasts each `A*_i` over all of its tokens. Most of those tokens are shared with
rollouts of another quality (the same line number, the same fix): on a state two rollouts
share, the redistribution adds to one rollout what it takes from the other, and the policy's
choice between a better and a worse solution is made only where their tokens part. Only there
does the quality preference act, and there it acts with the difference `A*_i - A*_j` of the
sequence advantages.

`distinguishing_tokens` finds those tokens: token t of a passing rollout i is *distinguishing*
when no passing rollout j of the group with another discount factor (`|f_j - f_i| > tol`) has
the same tokens up to and including t. The first of them is where i parts from the last of
those rollouts; the ones after it write i's own continuation.

`contrastive_tokens` keeps the shared tokens of a redistributed rollout near the binary
advantage `A_i` (the base estimator's, before the redistribution) and puts the redistribution's
change `A*_i - A_i` on its distinguishing tokens. Per sequence, on its masked tokens M (n of
them), with D the distinguishing ones among them (d of them):

    delta = beta (A*_i - A_i)                      (beta = strength in [0, 1])
    A_t   = A*_i + delta (n [t in D] / d - 1)      on M,   0 off M

so shared tokens get `A*_i - delta` (at beta = 1: exactly `A_i`) and distinguishing tokens
`A*_i + delta (n / d - 1)` (at beta = 1: `A_i + (A*_i - A_i) n / d`, the whole change on the
d tokens). Properties (each is a test in tests/test_advantages_contrast.py):

* conservation: `sum_{t in M} A_t = n A*_i` for every delta, because `sum_M (n [t in D]/d - 1)
  = 0`: the token mean of every sequence is its Gagar advantage, so the sequence's credit under
  the token-mean and seq-mean aggregations (and the batch's positive and negative totals) are
  Gagar's;
* identity: beta = 0, rows with `A*_i <= 0` (failed rollouts keep the broadcast), rows with no
  distinguishing or only distinguishing tokens (a group whose passes all share one factor,
  or a rollout that shares no token with another quality), and rows whose change is 0 give
  exactly `broadcast_to_tokens(A*)`;
* direction: with `A*_i > A_i` (an above-average pass) its distinguishing tokens get more than
  its shared ones, with `A*_i < A_i` less;
* signs (``keep_sign=True``, the default): delta is limited per row so that no token of a
  positive sequence falls below 0 (`delta >= -A*_i d / (n - d)` and `delta <= A*_i`); the
  limit scales delta, so conservation is untouched. ``keep_sign=False`` lets the
  distinguishing tokens of a strongly discounted pass go negative: the pass is still reinforced
  on what it shares, and pushed away from where it parts from better passes.

Layout: group-major `[G, K]` sequences and `[G, K, T]` tokens (the prefix comparison needs the
group); `contrastive_tokens` itself is row-wise and also takes flat `[N]` / `[N, T]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax.advantages import _layout

Array = jax.Array


def _check_strength(strength) -> float:
    if isinstance(strength, bool) or not isinstance(
        strength, (int, float, np.floating, np.integer)
    ):
        raise TypeError(f"strength: expected a static Python float in [0, 1], got {strength!r}")
    strength = float(strength)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength: expected a value in [0, 1], got {strength}")
    return strength


@functools.partial(jax.jit, static_argnames=("tol",))
def _distinguishing(tokens, mask, factors, passed, valid, *, tol):
    k = tokens.shape[1]
    # same[g, i, j, t]: rows i and j hold the same tokens at positions 0..t.
    eq = tokens[:, :, None, :] == tokens[:, None, :, :]  # [G, K, K, T]
    same = jnp.cumprod(eq.astype(jnp.int32), axis=-1) > 0
    live = passed & valid  # [G, K]
    other = (
        live[:, :, None]
        & live[:, None, :]
        & (jnp.abs(factors[:, :, None] - factors[:, None, :]) > tol)
        & ~jnp.eye(k, dtype=bool)[None]
    )  # [G, K, K]: j is a pass of another factor than pass i
    shared = jnp.any(other[..., None] & same, axis=2)  # [G, K, T]
    return mask & live[..., None] & ~shared


def distinguishing_tokens(
    tokens: Array,
    mask: Array,
    factors: Array,
    passed: Array,
    valid: Array,
    *,
    tol: float = 1e-6,
) -> Array:
    """The tokens where a passing rollout parts from every pass of another quality.

    Token t of row (g, i) is distinguishing when i is a valid pass, t is on the mask, and no
    other valid pass j of group g with `|f_j - f_i| > tol` has `tokens[g, j, :t+1] ==
    tokens[g, i, :t+1]` (the prompt is part of the prefix: rows of one group share it, rows
    that do not share it share no token). A pass without a pass of another factor in its group
    has every masked token distinguishing (nothing to contrast: `contrastive_tokens` then
    leaves it as the broadcast). Cost: O(G K^2 T) comparisons.

    Args:
      tokens: [G, K, T] int, prompt + response tokens of each rollout (rows of a group aligned
        at the same positions, as the update's packed batch holds them).
      mask: [G, K, T] bool, the response tokens that count.
      factors: [G, K] float32, the discount factors (`GagarOutput.factors`).
      passed, valid: [G, K] bool (`GagarOutput.passed`: after the cheat penalty).
      tol: static float >= 0, factors closer than this are one quality.

    Returns:
      [G, K, T] bool.

    Raises:
      ValueError / TypeError naming the field: shapes other than `[G, K, T]` / `[G, K]`,
      a non-integer `tokens`, a negative `tol`.
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 3:
        raise TypeError(
            f"tokens: expected a [G, K, T] integer array, got {tokens.dtype} {list(tokens.shape)}"
        )
    mask = _layout.check_bool("mask", mask)
    _layout.check_shape("mask", mask, tokens.shape, "tokens.shape")
    f = _layout.check_float("factors", factors)
    _layout.check_shape("factors", f, tokens.shape[:2], "tokens.shape[:2]")
    p = _layout.check_bool("passed", passed)
    _layout.check_shape("passed", p, tokens.shape[:2], "tokens.shape[:2]")
    v = _layout.check_bool("valid", valid)
    _layout.check_shape("valid", v, tokens.shape[:2], "tokens.shape[:2]")
    if not float(tol) >= 0:
        raise ValueError(f"tol: expected a value >= 0, got {tol}")
    return _distinguishing(tokens.astype(jnp.int32), mask, f, p, v, tol=float(tol))


def distinguishing_tokens_unchecked(tokens, mask, factors, passed, valid, *, tol=1e-6):
    """`distinguishing_tokens` without the entry checks (inside the jitted update)."""
    return _distinguishing(tokens, mask, factors, passed, valid, tol=float(tol))


@functools.partial(jax.jit, static_argnames=("strength", "keep_sign"))
def _contrastive(seq, base, dist, mask, *, strength, keep_sign):
    maskf = mask.astype(jnp.float32)
    d_mask = dist & mask
    n = jnp.sum(maskf, axis=-1)
    d = jnp.sum(d_mask.astype(jnp.float32), axis=-1)
    act = (seq > 0) & (base > 0) & (d > 0) & (d < n)
    delta = jnp.where(act, strength * (seq - base), 0.0)
    if keep_sign:
        # delta >= -A* d / (n - d): distinguishing tokens stay >= 0; delta <= A*: shared ones.
        lo = -seq * d / jnp.where(act, n - d, 1.0)
        delta = jnp.where(act, jnp.clip(delta, lo, seq), 0.0)
    share = jnp.where(d_mask, n[..., None] / jnp.where(act, d, 1.0)[..., None], 0.0) - 1.0
    # delta = 0 gives (seq + 0) * mask: bit for bit the broadcast's seq * mask.
    return (seq[..., None] + delta[..., None] * share) * maskf


def contrastive_tokens(
    seq_advantages: Array,
    base_advantages: Array,
    distinguishing: Array,
    mask: Array,
    *,
    strength: float,
    keep_sign: bool = True,
) -> Array:
    """Token advantages whose redistribution change sits on the distinguishing tokens.

    `A_t = A* + delta (n [t in D] / d - 1)` on the mask, `delta = strength (A* - A)` (limited
    per row by `keep_sign`), 0 off the mask; see the module docstring. The masked token
    advantages of every row sum to `n A*` (exactly in real arithmetic, to float32 rounding
    here).

    Args:
      seq_advantages: [...] float32, the redistributed advantages `A*` (Gagar's).
      base_advantages: [...] float32, the base estimator's advantages `A` before the
        redistribution (`GagarOutput.original`); rows where either is <= 0 are broadcast.
      distinguishing: [..., T] bool, `distinguishing_tokens(...)`.
      mask: [..., T] bool, the tokens the loss trains on.
      strength: static float in [0, 1]: 0 is sequence-level Gagar, 1 leaves the shared tokens
        at the base advantage.
      keep_sign: limit delta so that no token of a positive row goes below 0.

    Returns:
      [..., T] float32.

    Raises:
      ValueError / TypeError naming the field for shapes other than `seq.shape + [T]`, a
      strength outside [0, 1].
    """
    strength = _check_strength(strength)
    seq = _layout.check_float("seq_advantages", seq_advantages)
    base = _layout.check_float("base_advantages", base_advantages)
    _layout.check_shape("base_advantages", base, seq.shape, "seq_advantages.shape")
    mask = _layout.check_bool("mask", mask)
    if mask.ndim != seq.ndim + 1 or mask.shape[:-1] != seq.shape:
        raise ValueError(
            f"mask: expected shape {list(seq.shape) + ['T']} (seq_advantages.shape + [T]), "
            f"got {list(mask.shape)}"
        )
    dist = _layout.check_bool("distinguishing", distinguishing)
    _layout.check_shape("distinguishing", dist, mask.shape, "mask.shape")
    return _contrastive(seq, base, dist, mask, strength=strength, keep_sign=bool(keep_sign))


def contrastive_tokens_unchecked(
    seq, base, distinguishing, mask, *, strength, keep_sign=True
) -> Array:
    """`contrastive_tokens` without the entry checks (inside the jitted update)."""
    return _contrastive(
        seq, base, distinguishing, mask, strength=float(strength), keep_sign=bool(keep_sign)
    )
