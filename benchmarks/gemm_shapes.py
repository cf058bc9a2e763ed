"""The update's own dots against the machine's GEMM peak: the ceiling of its MFU.

``benchmarks/update.py`` reads an update step's MFU against one large GEMM (f32, 1024^3). The
step's dots are not that GEMM: at the small config they contract over 256 or 704, and the
attention runs many small batched dots per query block. This benchmark times every dot one
update step of a config runs, each alone, at the shape and in the form the model and the update
write it (``_linear``'s forward and its two backward dots, the fused LM head and its backward,
the blocked attention's forward, recomputed scores and backward), XLA:CPU (each dot repeated
in one jitted loop: a step has no per-dot dispatch) and ``torch.matmul`` (eager calls, as a
PyTorch step makes them), one framework after the other in one process, and adds the dots up
with their counts per step:

- **dot ceiling**: the config's model FLOPs (``benchmarks/update.py``'s formula) over the summed
  best times of its dots, as a fraction of the same run's 1024^3 and 2048^3 GEMM peaks. An
  update step does these dots and more (the elementwise work, the optimizer, layout copies), so
  its MFU cannot exceed this ceiling unless its dots run faster inside the step than alone.

Usage:
    .venv/bin/python benchmarks/gemm_shapes.py                  # small and ~100M configs
    .venv/bin/python benchmarks/gemm_shapes.py --configs small --reps 7 --no-torch
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import update as ub  # noqa: E402  (one CPU device, the configs and the FLOP formula)

from gagar_jax.models.transformer import _causal_blocks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Dot:
    """One dot of an update step: ``count`` batched ``[batch, m, k] @ [batch, k, n]`` products.

    ``form`` names how the step writes it: ``nn`` a plain ``a @ b``; ``nt`` ``a @ b^T`` with
    ``b`` stored ``[n, k]`` (the backward's ``dy @ W^T``, the LM head's ``h @ W^T``). No dot
    of the update contracts its left operand's leading axis (the attention's ``dv = p^T do``
    is computed as ``dv^T = do^T p``)."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 1
    count: int = 1
    form: str = "nn"

    @property
    def call_flops(self) -> float:
        """FLOPs of one product (all ``batch`` of it)."""
        return 2.0 * self.batch * self.m * self.k * self.n

    @property
    def flops(self) -> float:
        """FLOPs of all ``count`` products in a step."""
        return self.call_flops * self.count

    @property
    def group(self) -> str:
        """projections, head, rope or attention."""
        first = self.name.split()[0]
        return {"attn": "attention"}.get(first, first if first in ("head", "rope") else
                                         "projections")  # fmt: skip


def update_dots(c, batch: int, length: int) -> list[Dot]:
    """Every dot one update step of model ``c`` runs on ``batch`` sequences of ``length``."""
    t, e, d = batch * length, c.hidden_size, c.head_dim
    layers, out = c.num_layers, []

    def linear(name, i, o):
        # _linear: y = x @ W; dx = dy @ W^T; dW = x^T @ dy (I <= O) or (dy^T @ x)^T.
        out.append(Dot(f"{name} fwd", t, i, o, count=layers))
        out.append(Dot(f"{name} dx", t, o, i, count=layers, form="nt"))
        if i <= o:
            out.append(Dot(f"{name} dW", i, t, o, count=layers))
        else:
            out.append(Dot(f"{name} dW", o, t, i, count=layers))

    linear("qkv", e, (c.num_heads + 2 * c.num_kv_heads) * d)
    linear("o", c.num_heads * d, e)
    linear("gate", e, c.intermediate_size)
    linear("up", e, c.intermediate_size)
    linear("down", c.intermediate_size, e)
    # The LM head and its written-out backward (update/step.py): logits = h @ W^T; dh = dz @ W;
    # dW = (h^T dz)^T when tokens >= 2 x width, else dz^T @ h.
    v = c.vocab_size
    out.append(Dot("head fwd", t, e, v, form="nt"))
    out.append(Dot("head dh", t, v, e))
    if t >= 2 * e:
        out.append(Dot("head dW", e, t, v))
    else:
        out.append(Dot("head dW", v, t, e))
    # RoPE's cos and sin tables, each made one buffer by a dot with the identity
    # (transformer._materialized), once per step for all layers.
    out.append(Dot("rope tables", t, d, d, count=2))
    # Blocked causal attention, per query block [lo, hi) against keys [0, hi), batched over
    # (sequence, KV head); G query heads per KV head share the block's rows.
    g, kv = c.num_heads // c.num_kv_heads, c.num_kv_heads
    bk = batch * kv
    for lo, hi in _causal_blocks(length, c.causal_block_size):
        rows = (hi - lo) * g
        # forward: scores q k^T, out p v; backward: dp = do v^T, dv^T = do^T p, dk^T = q^T ds
        # (do^T and q^T laid out once per layer), dq = ds k. The backward's recomputed scores
        # are the forward's dot: XLA computes it once in the update's one program.
        out.append(Dot(f"attn scores [{lo}:{hi}]", rows, d, hi, bk, layers, "nt"))
        out.append(Dot(f"attn pv [{lo}:{hi}]", rows, hi, d, bk, layers))
        out.append(Dot(f"attn dp [{lo}:{hi}]", rows, d, hi, bk, layers, "nt"))
        out.append(Dot(f"attn dv dk [{lo}:{hi}]", d, rows, hi, bk, 2 * layers))
        out.append(Dot(f"attn dq [{lo}:{hi}]", rows, hi, d, bk, layers))
    return out


def _operands(dot: Dot, rng):
    a_shape = (dot.m, dot.k)
    b_shape = {"nn": (dot.k, dot.n), "nt": (dot.n, dot.k)}[dot.form]
    if dot.batch > 1:
        a_shape, b_shape = (dot.batch, *a_shape), (dot.batch, *b_shape)
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32)
    return a, b


def _dot_fn(form: str):
    if form == "nn":
        return lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return lambda a, b: jnp.einsum("...mk,...nk->...mn", a, b, preferred_element_type=jnp.float32)


def _jax_looped(dot: Dot, repeats: int):
    """One program that runs the dot ``repeats`` times (a step has no per-dot dispatch). The
    operands pass an ``optimization_barrier`` in each iteration, so XLA cannot hoist the
    dot out of the loop."""
    fn = _dot_fn(dot.form)

    def run(a, b):
        def body(_, carry):
            a, b, _ = carry
            a, b = jax.lax.optimization_barrier((a, b))
            return a, b, fn(a, b)

        out = jax.eval_shape(fn, a, b)
        return jax.lax.fori_loop(0, repeats, body, (a, b, jnp.zeros(out.shape, out.dtype)))[2]

    return jax.jit(run)


def _torch_fn(form: str):
    import torch

    if form == "nn":
        return lambda a, b: torch.matmul(a, b)
    return lambda a, b: torch.matmul(a, b.transpose(-1, -2))  # nt


def _repeats(dot: Dot) -> int:
    """Calls per timed repeat: ~20 ms of work at 100 GFLOP/s, 1 to 200."""
    return int(min(200, max(1, round(2e9 / dot.call_flops))))


def time_dots(dots: list[Dot], reps: int, impl: str) -> dict:
    """Best wall seconds per call of each dot with ``impl`` (``jax`` or ``torch``).

    The two run in separate phases, never interleaved: after each op PyTorch's OpenMP threads
    keep spinning for a while, and an XLA dot started then shares the cores with them (timed
    between torch calls, an XLA dot of the MLP measured 77 GFLOP/s here; alone, 179-208).
    """
    rng = np.random.default_rng(0)
    best = {}
    for dot in dots:
        a, b = _operands(dot, rng)
        r = _repeats(dot)
        if impl == "jax":
            ja, jb, fn = jnp.asarray(a), jnp.asarray(b), _jax_looped(dot, r)
            fn(ja, jb).block_until_ready()  # compile

            def call(fn=fn, ja=ja, jb=jb):
                fn(ja, jb).block_until_ready()
        else:
            import torch

            ta, tb, tf = torch.from_numpy(a), torch.from_numpy(b), _torch_fn(dot.form)
            tf(ta, tb)

            def call(tf=tf, ta=ta, tb=tb, r=r):
                for _ in range(r):
                    tf(ta, tb)

        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) / r)
        best[dot.name] = min(times)
    return best


def report(name: str, dots: list[Dot], best: dict, peaks: dict, model_flops: float) -> None:
    impls = [k for k in ("jax", "torch") if best[k]]
    print(f"\n{name}: {len(dots)} dot shapes, {sum(d.flops for d in dots) / 1e9:.1f} GFLOP "
          f"executed per step ({model_flops / 1e9:.1f} model GFLOP)")  # fmt: skip
    head = "| dot | batch x m x k x n | count | GFLOP | " + " | ".join(
        f"{k} GFLOP/s | {k} % peak" for k in impls
    )
    print(head + " |")
    print("|" + "---|" * (4 + 2 * len(impls)))
    for dot in dots:
        cells = []
        for k in impls:
            rate = dot.call_flops / best[k][dot.name]
            cells += [f"{rate / 1e9:.0f}", f"{100 * rate / peaks[k]:.0f}%"]
        print(f"| {dot.name} | {dot.batch}x{dot.m}x{dot.k}x{dot.n} | {dot.count} | "
              f"{dot.flops / 1e9:.2f} | " + " | ".join(cells) + " |")  # fmt: skip
    for k in impls:
        groups: dict[str, list[float]] = {}
        for d in dots:
            g = groups.setdefault(d.group, [0.0, 0.0])
            g[0] += d.flops
            g[1] += best[k][d.name] * d.count
        print(f"{k}: " + "; ".join(f"{g} {f / 1e9:.1f} GFLOP in {t:.3f} s ({f / t / 1e9:.0f} "
                                   f"GFLOP/s)" for g, (f, t) in groups.items()))  # fmt: skip
        total = sum(best[k][d.name] * d.count for d in dots)
        ceiling = model_flops / total
        print(f"{k}: the dots alone take {total:.3f} s per step: {ceiling / 1e9:.0f} model "
              f"GFLOP/s, an MFU ceiling of {100 * ceiling / peaks[k]:.1f}% of this run's "
              f"{peaks[k] / 1e9:.0f} GFLOP/s peak")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="small,100m")
    parser.add_argument("--reps", type=int, default=15, help="timed repeats of each dot")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    with_torch = not args.no_torch
    if with_torch:
        import torch

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {ub._load()}")
    for name in filter(None, args.configs.split(",")):
        if name not in ub.CONFIGS:
            parser.error(f"--configs: unknown config {name!r} (known: {sorted(ub.CONFIGS)})")
        c, batch, length = ub.CONFIGS[name]
        dots = update_dots(c, batch, length)
        best, peaks = {"jax": {}, "torch": {}}, {}
        for impl in ["jax", "torch"] if with_torch else ["jax"]:
            peak = ub.jax_peak if impl == "jax" else ub.torch_peak
            before = max(peak(1024), peak(2048, reps=5))
            best[impl] = time_dots(dots, args.reps, impl)
            peaks[impl] = max(before, peak(1024), peak(2048, reps=5))
            print(f"{impl}: dots timed; peak (best of 1024^3 and 2048^3, before and after) "
                  f"{peaks[impl] / 1e9:.0f} GFLOP/s; {ub._load()}")  # fmt: skip
        report(name, dots, best, peaks, ub.model_flops(c, batch, length))
        print(ub._load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
