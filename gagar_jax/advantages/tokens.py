"""Credit-conserving token-level redistribution of sequence advantages, and its diagnostics.

Gagar trains with one advantage per sequence broadcast uniformly over the response tokens
(`broadcast_to_tokens`), so a trajectory's decisive edit and its redundant exploration get the
same reinforcement. The paper names the next step: "the same conservation principle can be
applied at the token level, redistributing positive credit among tokens without changing the
total". `redistribute_tokens` does that with bounded, importance-ordered weights:

    w_t  = importance of token t (>= 0), on the sequence's masked tokens t in M
    w_bar = sum_{t in M} o_t w_t / sum_{t in M} o_t            (o_t = token_weights, default 1)
    z_t  = (w_t - w_bar) / max_{s in M} |w_s - w_bar|           (0 if w is constant on M)
    c_t  = 1 + gamma * z_t                                       in [1 - gamma, 1 + gamma]
    A_t  = A * c_t on M,   A_t = 0 off M

Properties (each is a test in tests/test_advantages_tokens.py):

* conservation: `sum_{t in M} o_t A_t = A sum_{t in M} o_t`, because `sum_M o_t z_t = 0`; with
  the default `o = 1` the masked token advantages average to the sequence advantage;
* signs: `c_t >= 1 - gamma > 0` for `gamma < 1`, so every masked token keeps the sign of `A`
  (at `gamma = 1` a token may get 0, never the opposite sign);
* order: `c_t` is increasing in `w_t`, so with `A > 0` a more important token never gets less
  credit than a less important one (and with `A < 0`, under `negative="redistribute"`, never
  less blame);
* bound: `1 - gamma <= c_t <= 1 + gamma`, attained by the most extreme token: no token gets more
  than `(1 + gamma)` times, or less than `(1 - gamma)` times, its broadcast share;
* identity: `gamma = 0`, constant importance on a row, a row whose `o` is all zero, and rows not
  redistributed (`A <= 0` by default) give exactly `broadcast_to_tokens` (bit for bit);
* finite: empty rows (no masked token) are 0; all-equal and all-zero importance are the
  identity; non-finite or negative importance is rejected eagerly and treated as 0 under jit.

What is conserved under each loss aggregation (`gagar_jax.losses.AGGREGATIONS`): each of
"token-mean", "seq-mean-token-mean" and "seq-mean-token-sum" weighs all tokens of one sequence
equally (by `1/num_tokens`, `1/(n_b num_seqs)` and `1/num_seqs`), so conserving the masked
token *sum* (equivalently the mean, the token count of a sequence being fixed) conserves each
sequence's credit in the loss at ratio 1 under all three, and hence the batch's positive and
negative totals. A loss that weighs the tokens of one sequence unequally (a discounted or a
per-token-masked aggregation) conserves credit with the matching variant: pass its per-token
weights as `token_weights`, and `sum_t o_t A_t = A sum_t o_t` holds for those weights.

Clipping acts per token. The PPO-clip surrogate delivers `A_t r_t` to a token whose ratio is
inside the clip range and 0 to a clipped one; the clip set depends only on the ratio and the
sign of `A_t`, the same for the broadcast and the redistributed advantages, but the tokens it
removes carry different weights `c_t`, so what the clipped loss delivers is no longer conserved
exactly. `token_credit_metrics` reports both errors (before and after the clip).

Importance providers (`ImportanceProvider`): `UniformImportance` (the broadcast),
`EntropyImportance` (the policy's token entropy: credit moves towards the tokens where the
policy was uncertain, the decisions), and `EvidenceImportance` (tokens a grader's verdict cites
as evidence of a flaw -- an out-of-scope or redundant line -- get less of a positive
advantage). Host code maps a verdict's cited patch lines and trajectory events to response
tokens (`gagar_jax.grading.evidence_tokens`); the providers here are pure array functions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Protocol, runtime_checkable

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax.advantages import _layout

Array = jax.Array

NEGATIVE_MODES = ("broadcast", "redistribute")


def _check_gamma(gamma) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.floating, np.integer)):
        raise TypeError(f"gamma: expected a static Python float in [0, 1], got {gamma!r}")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: expected a value in [0, 1], got {gamma}")
    return gamma


def _check_token_args(seq_advantages, importance, mask, token_weights):
    """Shapes and dtypes of the token kernels, checked once at the public entry."""
    seq = _layout.check_float("seq_advantages", seq_advantages)
    mask = _layout.check_bool("mask", mask)
    want = list(seq.shape) + ["T"]
    if mask.ndim != seq.ndim + 1 or mask.shape[:-1] != seq.shape:
        raise ValueError(
            f"mask: expected shape {want} (seq_advantages.shape + [T]), got {list(mask.shape)}"
        )
    chex.assert_rank(mask, seq.ndim + 1)
    imp = _layout.check_float("importance", importance)
    _layout.check_shape("importance", imp, mask.shape, "seq_advantages.shape + [T]")
    ow = None
    if token_weights is not None:
        ow = _layout.check_float("token_weights", token_weights)
        _layout.check_shape("token_weights", ow, mask.shape, "seq_advantages.shape + [T]")
    chex.assert_equal_shape([imp, mask] + ([] if ow is None else [ow]))
    for name, x in (("importance", imp), ("token_weights", ow)):
        if x is not None and _layout.is_concrete(x, mask):
            xv, mv = np.asarray(x), np.asarray(mask)
            bad = mv & ~(np.isfinite(xv) & (xv >= 0))
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"{name}: expected finite values >= 0 on masked tokens, got {xv[where]} at "
                    f"index {where} ({int(bad.sum())} bad token(s))"
                )
    return seq, imp, mask, ow


def _credit_weights(imp: Array, mask: Array, gamma: float, ow: Array | None) -> Array:
    """`c = 1 + gamma z` of the module docstring, [..., T] float32 (1 off the mask)."""
    # Non-finite or negative importance only reaches here under jit: count it as 0.
    w = jnp.where(mask & jnp.isfinite(imp), jnp.maximum(imp, 0.0), 0.0)
    o = mask.astype(jnp.float32) if ow is None else jnp.where(mask & jnp.isfinite(ow), ow, 0.0)
    o = jnp.maximum(o, 0.0)
    o_sum = jnp.sum(o, axis=-1, keepdims=True)
    w_hi = jnp.max(jnp.where(mask, w, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    w_lo = jnp.min(jnp.where(mask, w, jnp.inf), axis=-1, keepdims=True, initial=jnp.inf)
    # The mean of the values shifted by the row's minimum: for values close together (6.0625
    # and 6.0819) the float32 mean of the values themselves is off by half an ulp of 6, which
    # is 2.5e-5 of their spread, and the scaling below would carry that into z. Shifted, the
    # deviations are exact to the float32 rounding of the spread.
    s = jnp.where(mask, w - jnp.where(jnp.isfinite(w_lo), w_lo, 0.0), 0.0)
    # A row without weight (empty, or all o = 0) divides by 1 and is reset to c = 1 below.
    s_bar = jnp.sum(o * s, axis=-1, keepdims=True) / jnp.where(o_sum > 0, o_sum, 1.0)
    dev = jnp.where(mask, s - s_bar, 0.0)
    scale = jnp.max(jnp.abs(dev), axis=-1, keepdims=True, initial=0.0)
    # Test constancy on the values themselves, not on `dev`: the float mean of equal values need
    # not equal them (3 x 0.1 / 3 != 0.1), and a constant row must be the identity exactly.
    varies = (w_hi > w_lo) & (o_sum > 0)
    # |dev| <= scale, so z is in [-1, 1] in exact arithmetic; XLA may divide through a
    # reciprocal (measured on CPU: -5e-31 / 5e-31 = -1.00000002), so clip to keep the
    # documented bound and the signs exact. Clipping is monotone: the order is kept.
    z = jnp.clip(dev / jnp.where(varies, scale, 1.0), -1.0, 1.0)
    z = jnp.where(varies & mask, z, 0.0)
    return 1.0 + gamma * z


@functools.partial(jax.jit, static_argnames=("gamma", "negative"))
def _redistribute_tokens(seq, imp, mask, ow, *, gamma, negative):
    c = _credit_weights(imp, mask, gamma, ow)
    apply = seq > 0 if negative == "broadcast" else seq != 0
    c = jnp.where(apply[..., None], c, 1.0)
    # Same operation order as `broadcast_to_tokens` (seq * mask), so c = 1 is bit-identical.
    return (seq[..., None] * c) * mask.astype(jnp.float32)


def redistribute_tokens(
    seq_advantages: Array,
    importance: Array,
    mask: Array,
    *,
    gamma: float,
    token_weights: Array | None = None,
    negative: str = "broadcast",
) -> Array:
    """Spreads each sequence advantage over its tokens by importance, conserving the credit.

    `A_t = A * (1 + gamma * z_t)` on masked tokens, with `z_t` the importance centred on its
    (`token_weights`-weighted) masked mean and scaled so that `max |z_t| = 1`; 0 off the mask.
    So `sum_t o_t A_t = A sum_t o_t` on every sequence with a masked token (the masked token
    advantages average exactly to `A` with the default `o = 1`: credit is conserved under the
    token-mean loss and under the two seq-mean aggregations), every masked token keeps the sign
    of `A`, more important tokens never get less credit, and each token's weight lies in
    `[1 - gamma, 1 + gamma]`. `gamma = 0` or constant importance give exactly
    `broadcast_to_tokens(seq_advantages, mask)`. Per sequence, on its masked tokens M:

        w_bar = sum_{t in M} o_t w_t / sum_{t in M} o_t      (w = importance, o = token_weights)
        z_t   = (w_t - w_bar) / max_{s in M} |w_s - w_bar|   (0 when w is constant on M)
        A_t   = A (1 + gamma z_t) on M,   0 off M

    so `sum_M o_t z_t = 0` is the conservation. Sequences with `A <= 0` keep the broadcast under
    `negative="broadcast"`.

    Layouts: flat (`seq_advantages [N]`, token arrays `[N, T]`) or group-major
    (`[G, K]` and `[G, K, T]`); rows are independent, so a batch sharded along its leading axis
    needs no communication and both layouts give the same numbers.

    Args:
      seq_advantages: [N] (or [G, K]) float32, one advantage per sequence (e.g. Gagar's
        `gagar_advantages(...).advantages`).
      importance: [N, T] (or [G, K, T]) float32 >= 0, how much token t deserves the credit;
        only the order and relative spacing within a row matter (the scale cancels). Values off
        the mask are ignored.
      mask: [N, T] (or [G, K, T]) bool, True on the response tokens the loss trains on.
      gamma: static float in [0, 1], the strength: 0 is the broadcast, 1 lets the least
        important token drop to 0 and the most important reach twice its broadcast share.
      token_weights: optional [N, T] (or [G, K, T]) float32 >= 0, the per-token weights `o_t`
        of the loss's aggregation within a sequence; the conserved quantity is
        `sum_t o_t A_t`. None (the default) means 1 on the mask: the token-mean and the
        seq-mean aggregations.
      negative: "broadcast" (default) leaves sequences with `A <= 0` as the broadcast --
        the paper's principle redistributes positive credit; "redistribute" applies the same
        weights to negative sequences (more important tokens get more of the blame).

    Returns:
      [N, T] (or [G, K, T]) float32 token advantages, 0 off the mask (and on rows without a
      masked token).

    Raises:
      ValueError / TypeError: a shape that is not `seq_advantages.shape + [T]`, a gamma outside
        [0, 1], an unknown `negative`, or (with concrete inputs) a negative or non-finite
        importance / token weight on a masked token; each message names the field.
    """
    gamma = _check_gamma(gamma)
    if negative not in NEGATIVE_MODES:
        raise ValueError(f"negative: expected one of {NEGATIVE_MODES}, got {negative!r}")
    seq, imp, mask, ow = _check_token_args(seq_advantages, importance, mask, token_weights)
    return _redistribute_tokens(seq, imp, mask, ow, gamma=gamma, negative=negative)


def redistribute_tokens_unchecked(
    seq, importance, mask, *, gamma, token_weights=None, negative="broadcast"
):
    """`redistribute_tokens` without the entry checks, for callers that validated already.

    Used inside the jitted policy update, where the inputs are tracers with checked shapes;
    takes float32 `seq [...]`, `importance [..., T]`, bool `mask [..., T]`.
    """
    return _redistribute_tokens(
        seq, importance, mask, token_weights, gamma=float(gamma), negative=negative
    )


# ---------------------------------------------------------------------------------------------
# Importance providers.


class ImportanceInputs(NamedTuple):
    """What a provider may read; every array is [..., T] (the token arrays' shape)."""

    mask: Array  # [..., T] bool, the loss's response tokens
    entropy: Array | None = None  # [..., T] float32, policy entropy of each token's distribution
    evidence: Array | None = None  # [..., T] bool, tokens a verdict cites (a flaw's tokens)


@runtime_checkable
class ImportanceProvider(Protocol):
    """`provider(inputs) -> importance [..., T] float32 >= 0`, a pure jittable function.

    `name` is the provider's config name; `needs` the `ImportanceInputs` fields it reads.
    """

    name: str
    needs: tuple[str, ...]

    def __call__(self, inputs: ImportanceInputs) -> Array: ...


@dataclasses.dataclass(frozen=True)
class UniformImportance:
    """Importance 1 on every masked token: `redistribute_tokens` is then the broadcast."""

    name: str = "uniform"
    needs: tuple[str, ...] = ()

    def __call__(self, inputs: ImportanceInputs) -> Array:
        return inputs.mask.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class EntropyImportance:
    """The policy's token entropy: more credit where the policy was choosing (high entropy),
    less on tokens it was already sure of (formatting, forced continuations). Gradients do not
    flow through the importance."""

    name: str = "entropy"
    needs: tuple[str, ...] = ("entropy",)

    def __call__(self, inputs: ImportanceInputs) -> Array:
        if inputs.entropy is None:
            raise ValueError("EntropyImportance: inputs.entropy [..., T] is required")
        e = jax.lax.stop_gradient(inputs.entropy.astype(jnp.float32))
        return jnp.where(inputs.mask, jnp.maximum(e, 0.0), 0.0)


@dataclasses.dataclass(frozen=True)
class EvidenceImportance:
    """Grader evidence: tokens a verdict cites as a flaw's location get `cited`, others
    `uncited` (defaults 0 and 1), so a positive advantage moves off the cited tokens onto the
    rest of the sequence. A row without cited tokens is constant: the broadcast."""

    cited: float = 0.0
    uncited: float = 1.0
    name: str = "evidence"
    needs: tuple[str, ...] = ("evidence",)

    def __post_init__(self):
        if not (self.cited >= 0 and self.uncited >= 0):
            raise ValueError(
                f"EvidenceImportance: cited, uncited must be >= 0, got {self.cited}, {self.uncited}"
            )

    def __call__(self, inputs: ImportanceInputs) -> Array:
        if inputs.evidence is None:
            raise ValueError("EvidenceImportance: inputs.evidence [..., T] is required")
        imp = jnp.where(inputs.evidence, jnp.float32(self.cited), jnp.float32(self.uncited))
        return jnp.where(inputs.mask, imp, 0.0)


IMPORTANCE_PROVIDERS = {
    "uniform": UniformImportance(),
    "entropy": EntropyImportance(),
    "evidence": EvidenceImportance(),
}


def importance_provider(name: str) -> ImportanceProvider:
    """The provider registered under `name`.

    Args:
      name: str, one of `IMPORTANCE_PROVIDERS` ("uniform", "entropy", "evidence").

    Returns:
      An `ImportanceProvider`: `provider(ImportanceInputs) -> [..., T] float32 >= 0`
      (uniform: 1 on the mask; entropy: `max(H_t, 0)` on the mask, no gradient; evidence:
      `cited` (0) on cited tokens and `uncited` (1) on the other masked tokens); 0 off the mask.

    Raises:
      ValueError naming `importance` and the registered names for an unknown `name`.
    """
    try:
        return IMPORTANCE_PROVIDERS[name]
    except KeyError:
        raise ValueError(
            f"importance: expected one of {tuple(IMPORTANCE_PROVIDERS)}, got {name!r}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Diagnostics.


def token_gini(values: Array, mask: Array) -> Array:
    """Gini coefficient of the non-negative `values` over each row's masked tokens.

    `Gini = sum_i (2 i - n - 1) x_(i) / (n sum_i x_i)` with `x_(1) <= ... <= x_(n)` the row's n
    masked values: 0 when every token gets the same credit (the broadcast), towards 1 when one
    token gets it all. A sort per row (O(T log T)), no pairwise [T, T] array.

    Args:
      values: [..., T] float32 >= 0 (e.g. `|A_t|`), only the masked ones count.
      mask: [..., T] bool.

    Returns:
      [...] float32, 0 for rows with fewer than two masked tokens or zero total.
    """
    x = jnp.where(mask, jnp.abs(values.astype(jnp.float32)), jnp.inf)
    xs = jnp.sort(x, axis=-1)  # masked values first, ascending; inf padding at the end
    n = jnp.sum(mask, axis=-1).astype(jnp.float32)
    i = jnp.arange(1, x.shape[-1] + 1, dtype=jnp.float32)
    live = i <= n[..., None]
    xs = jnp.where(live, xs, 0.0)
    total = jnp.sum(xs, axis=-1)
    num = jnp.sum((2.0 * i - n[..., None] - 1.0) * xs, axis=-1)
    hi = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, initial=-jnp.inf)
    lo = jnp.min(x, axis=-1, initial=jnp.inf)
    # A constant row is exactly 0 (the float sum above may leave a 1e-10 residue).
    ok = (n >= 2) & (total > 0) & (hi > lo)
    # Rows without spread divide by 1 and report 0.
    return jnp.where(ok, num / jnp.where(ok, n * total, 1.0), 0.0)


class TokenCredit(NamedTuple):
    """Per-sequence bookkeeping of a token redistribution (sums, so they add over batches)."""

    tokens: Array  # [...] f32, masked tokens of the sequence
    error_sum: Array  # [...] f32, |sum_t (A_t - A)| over masked tokens (0 up to rounding)
    positive: Array  # [...] f32, sum_t max(A_t, 0): the sequence's positive credit
    positive_on_evidence: Array  # [...] f32, the part of it on evidence tokens
    gini: Array  # [...] f32, `token_gini(|A_t|)` of the sequence


def token_credit(
    token_advantages: Array, seq_advantages: Array, mask: Array, evidence: Array | None = None
) -> TokenCredit:
    """Conservation error, positive credit (on evidence tokens) and Gini per sequence.

    Per sequence, over its masked tokens M (A = the sequence advantage, A_t the token ones):

        tokens               = |M|
        error_sum            = |sum_{t in M} A_t - A |M||   (0 up to rounding when conserved)
        positive             = sum_{t in M} max(A_t, 0)
        positive_on_evidence = sum_{t in M, evidence_t} max(A_t, 0)
        gini                 = token_gini(|A_t|, mask)

    Each is a per-row value, so batch figures are sums over rows (e.g. the update reports
    `sum error_sum / sum tokens` and `sum positive_on_evidence / sum positive`).

    Args:
      token_advantages: [..., T] float32, e.g. `redistribute_tokens(...)`.
      seq_advantages: [...] float32, the sequence advantages they came from.
      mask: [..., T] bool, the tokens that count.
      evidence: optional [..., T] bool, cited tokens (0 share without).

    Returns:
      `TokenCredit` of [...] float32 arrays.
    """
    maskf = mask.astype(jnp.float32)
    a = token_advantages.astype(jnp.float32) * maskf
    seq = seq_advantages.astype(jnp.float32)
    tokens = jnp.sum(maskf, axis=-1)
    error = jnp.abs(jnp.sum(a, axis=-1) - seq * tokens)
    pos = jnp.maximum(a, 0.0)
    on_ev = (
        jnp.zeros_like(tokens)
        if evidence is None
        else jnp.sum(jnp.where(evidence, pos, 0.0), axis=-1)
    )
    return TokenCredit(
        tokens=tokens,
        error_sum=error,
        positive=jnp.sum(pos, axis=-1),
        positive_on_evidence=on_ev,
        gini=token_gini(a, mask),
    )
