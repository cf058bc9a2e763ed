"""Per-op profile of a compiled JAX program: where its time goes, next to the GEMM peak.

Used by ``benchmarks/update.py --profile`` and ``benchmarks/sampler.py --profile``. The program
runs under ``jax.profiler`` (a Perfetto trace, read back as JSON); each traced op (an XLA
thunk: a fusion, a dot, a copy, a loop) is matched to its instruction in the compiled HLO
(``compiled.as_text()``), which gives

- its category: ``dot`` (an instruction or fusion holding a dot or convolution), ``layout``
  (only data movement: copy, transpose, slice, pad, concatenate, broadcast, bitcast, gather,
  dynamic slices and updates), ``control`` (while / conditional / call thunks: their time
  contains their body's), or ``elementwise`` (everything else: fused elementwise ops and
  reductions);
- for dots, the FLOPs of one execution (2 x output elements x contracted size, summed over
  the dots of a fusion), so the trace's execution count and time give the dot's achieved
  FLOP/s.

Times are the trace's op durations: on a loaded machine they include time the op's threads
waited for a core, so compare shares inside one profile, not absolute times across runs.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import math
import os
import re
import tempfile
from typing import NamedTuple

LAYOUT_OPS = frozenset(
    {
        "copy",
        "transpose",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "pad",
        "concatenate",
        "broadcast",
        "bitcast",
        "reshape",
        "gather",
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "iota",
    }
)
CONTROL_OPS = frozenset({"while", "conditional", "call"})


class OpInfo(NamedTuple):
    category: str  # dot | layout | elementwise | control
    shape: str  # the result shape as the HLO writes it
    flops: float  # FLOPs of one execution (dots only; 0 otherwise)
    source: str  # the JAX operation it came from (HLO metadata op_name)


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^\w+\[([\d,]*)\]")


def _dims(shape: str) -> list[int]:
    m = _SHAPE.match(shape)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """An HLO module's text as {computation: [(name, result shape, opcode, rest of line)]}."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    cur = None
    for line in hlo.splitlines():
        if line and not line.startswith((" ", "}")) and line.rstrip().endswith("{"):
            cur = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            cur = cur.lstrip("%")
            comps[cur] = []
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            comps[cur].append(m.groups())
    return comps


def dot_instruction_flops(hlo: str) -> list[float]:
    """The FLOPs of each dot instruction of an HLO module's text, fused or not, in the order
    they appear (a dot in a loop body counts once, whatever the trip count)."""
    return [
        _single_dot_flops(shape, rest, body)
        for body in _computations(hlo).values()
        for _, shape, op, rest in body
        if op == "dot"
    ]


def hlo_index(hlo: str) -> dict[str, OpInfo]:
    """Every instruction of an optimised HLO module's text, by name."""
    comps = _computations(hlo)

    def dot_flops(body) -> float:
        return sum(
            _single_dot_flops(shape, rest, body)
            for _, shape, op, rest in body
            if op in ("dot", "convolution")
        )

    out = {}
    for body in comps.values():
        for name, shape, op, rest in body:
            src = re.search(r'op_name="([^"]*)"', rest)
            src = src.group(1) if src else ""
            if op == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", rest)
                inner = comps.get(called.group(1), []) if called else []
                ops = {o for _, _, o, _ in inner}
                flops = dot_flops(inner)
                if flops or ops & {"dot", "convolution"}:
                    cat = "dot"
                elif ops <= LAYOUT_OPS:
                    cat = "layout"
                else:
                    cat = "elementwise"
            elif op in ("dot", "convolution"):
                flops, cat = _single_dot_flops(shape, rest, body), "dot"
            elif op in CONTROL_OPS:
                flops, cat = 0.0, "control"
            elif op in LAYOUT_OPS:
                flops, cat = 0.0, "layout"
            else:
                flops, cat = 0.0, "elementwise"
            out[name] = OpInfo(cat, shape, flops, src)
    return out


def _single_dot_flops(shape: str, rest: str, body) -> float:
    """2 x output elements x contracted size of one dot (operand shapes looked up in its
    computation's ``body``)."""
    shapes = {n: s for n, s, _, _ in body}
    operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
    lhs = _dims(shapes.get(operands[0], "")) if operands else []
    contract = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i) if contract and lhs else 1
    return 2.0 * math.prod(_dims(shape)) * k


def trace_ops(run, reps: int = 2) -> tuple[dict[str, float], dict[str, int]]:
    """Runs ``run()`` ``reps`` times under ``jax.profiler``; returns (seconds, executions) per
    traced op name, each divided by ``reps`` (per run)."""
    import jax

    with tempfile.TemporaryDirectory(prefix="xla-profile-") as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        try:
            for _ in range(reps):
                run()
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
        if not files:
            raise RuntimeError("jax.profiler wrote no Perfetto trace")
        with gzip.open(files[-1]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    secs, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            secs[e["name"]] += e.get("dur", 0) * 1e-6
            count[e["name"]] += 1
    return {k: v / reps for k, v in secs.items()}, {k: v / reps for k, v in count.items()}


def breakdown(secs: dict[str, float], count: dict[str, float], hlo: str) -> dict:
    """Per category: seconds per run and (dots) FLOPs per run; plus the ops by time."""
    index = hlo_index(hlo)
    cats = collections.defaultdict(lambda: {"s": 0.0, "flops": 0.0})
    ops = []
    for name, s in secs.items():
        info = index.get(name)
        if info is None:
            continue  # runtime bookkeeping (executor, Python frames), not an HLO op
        cats[info.category]["s"] += s
        cats[info.category]["flops"] += info.flops * count[name]
        ops.append((s, name, info, count[name]))
    ops.sort(key=lambda x: -x[0])
    return {"categories": dict(cats), "ops": ops}


def print_breakdown(result: dict, peak: float, top: int = 12, out=print) -> None:
    """The category table (share of op time; dots' FLOP/s against ``peak``) and the top ops."""
    cats = result["categories"]
    busy = sum(v["s"] for k, v in cats.items() if k != "control")
    out(f"{'category':12} {'s/run':>8} {'share':>6} {'GFLOP/s':>8} {'of peak':>8}")
    for k in ("dot", "elementwise", "layout"):
        v = cats.get(k, {"s": 0.0, "flops": 0.0})
        rate = v["flops"] / v["s"] if v["s"] and v["flops"] else 0.0
        out(
            f"{k:12} {v['s']:8.3f} {v['s'] / max(busy, 1e-12):6.1%} "
            + (f"{rate / 1e9:8.1f} {rate / peak:8.1%}" if rate else f"{'':8} {'':8}")
        )
    out(f"{'ops total':12} {busy:8.3f} (control thunks, which contain their bodies, left out)")
    out(f"top {top} ops (s/run, executions, category, result shape, source):")
    for s, _, info, n in [o for o in result["ops"] if o[2].category != "control"][:top]:
        rate = f" {info.flops * n / s / 1e9:6.1f} GFLOP/s" if info.flops and s else ""
        out(
            f"  {s:7.3f} {n:5.0f}x {info.category:11} {info.shape[:30]:30} "
            f"{info.source.split('/')[-1][:40]}{rate}"
        )
