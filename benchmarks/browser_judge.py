"""Benchmark: time per artifact of the browser judge, by stage, on the calibration set.

Run: `.venv/bin/python benchmarks/browser_judge.py [--rounds 2] [--fresh]` (needs Debian's
chromium and the playwright package: `make system-deps setup`).

For every page of `tests/fixtures/browser_calibration` (17 artifacts: working, dead, padded,
throwing, looping, flooding, ...) the judge runs with its default settings (no LLM), `--rounds`
times; the table gives p50 / p95 / max seconds per stage and in total, over all artifacts and
split into well-behaved pages and hostile ones (those with a planted fault). The baseline row,
measured in the same run on the same browser, is the least any judge must do: load the page and
take one screenshot. The machine's load average is printed before and after (the figures of a
shared machine are not quiet-machine figures). Goal: p50 <= 10 s per artifact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gagar_jax.verify import browser as B  # noqa: E402

CAL = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "browser_calibration")
STAGES = ("launch", "snapshot", "checklist", "plan", "execute", "judge", "teardown", "total")


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def baseline(cases, rounds: int) -> list[float]:
    """Bare Playwright: goto(file://) + one screenshot per artifact, same browser binary."""
    from playwright.async_api import async_playwright

    async def run():
        out = []
        async with async_playwright() as p:
            b = await p.chromium.launch(
                executable_path=B.DEFAULT_EXECUTABLE, headless=True, args=["--no-sandbox"]
            )
            for _ in range(rounds):
                for c in cases:
                    if c["label"].get("fault"):
                        continue  # hostile pages would hang a judge-less baseline
                    t0 = time.perf_counter()
                    ctx = await b.new_context()
                    page = await ctx.new_page()
                    await page.goto(
                        "file://" + os.path.abspath(os.path.join(c["dir"], "index.html"))
                    )
                    await page.screenshot(type="jpeg", quality=50)
                    await ctx.close()
                    out.append(time.perf_counter() - t0)
            await b.close()
        return out

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fresh", action="store_true", help="a fresh browser per artifact")
    ap.add_argument("--json", default="", help="also write the raw timings here")
    args = ap.parse_args()
    cases = B.load_calibration(CAL)
    load0 = os.getloadavg()
    print(
        f"# browser judge benchmark: {len(cases)} artifacts x {args.rounds} rounds, "
        f"{'fresh browser per artifact' if args.fresh else 'one kept browser'}"
    )
    print(
        f"# cpus: {os.cpu_count()}, load average before: {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f}"
    )
    base = baseline(cases, args.rounds)
    rows = []
    judge = B.BrowserJudge(keep_browser=not args.fresh)
    try:
        for _ in range(args.rounds):
            for c in cases:
                v = judge.judge(c["dir"], c["rubric"])
                ok = v.status == "ok" and abs(v.score - c["label"]["score"]) < 1e-6
                times = {s: v.timings.get(s, 0.0) for s in STAGES}
                rows.append(
                    {
                        "page": c["page"],
                        "hostile": bool(c["label"].get("fault")),
                        "agree": ok,
                        "score": v.score,
                        "fault": v.fault,
                        "detail": v.detail[:160],
                        **times,
                    }
                )
    finally:
        judge.close()
    load1 = os.getloadavg()
    print(f"# load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print(f"# agreement with planted labels: {sum(r['agree'] for r in rows)}/{len(rows)}")
    for r in rows:
        if not r["agree"]:
            print(
                f"#   disagrees: {r['page']} score {r['score']:.2f} fault {r['fault']} "
                f"({r['detail']}) after {r['total']:.1f} s"
            )
    print()
    print("| set | n | " + " | ".join(f"{s} p50" for s in STAGES) + " | total p95 | total max |")
    print("|---|---|" + "---|" * (len(STAGES) + 2))
    for name, sel in (
        ("all", rows),
        ("well-behaved", [r for r in rows if not r["hostile"]]),
        ("hostile", [r for r in rows if r["hostile"]]),
    ):
        cells = [f"{statistics.median([r[s] for r in sel]):.2f}" for s in STAGES]
        tot = [r["total"] for r in sel]
        print(
            f"| {name} | {len(sel)} | "
            + " | ".join(cells)
            + f" | {pct(tot, 0.95):.2f} | {max(tot):.2f} |"
        )
    print(
        f"| baseline: goto + 1 screenshot (well-behaved) | {len(base)} | "
        + " | ".join(["-"] * (len(STAGES) - 1))
        + f" | {statistics.median(base):.2f} | "
        f"{pct(base, 0.95):.2f} | {max(base):.2f} |"
    )
    print()
    print("| page | total s (median over rounds) |")
    print("|---|---|")
    for c in cases:
        ts = [r["total"] for r in rows if r["page"] == c["page"]]
        print(f"| {c['page']} | {statistics.median(ts):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "baseline": base, "load": [load0, load1]}, f, indent=1)


if __name__ == "__main__":
    main()
