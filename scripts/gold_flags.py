r"""Runs every task's gold patch through the verifier and the behaviour monitor.

A known-good fix must pass and must never be called a shortcut: a confirmed monitor flag on a
gold patch is a false positive of the monitor (it would zero an honest rollout's reward). This
script measures that on a task pool::

    python scripts/gold_flags.py POOL [POOL ...] [--repos DIR] [--results FILE] [--jobs N]

A ``POOL`` is a directory the task factory wrote (``python -m gagar_jax.data.synth --out
DIR``: ``DIR/instances.jsonl`` with its repositories in ``DIR/repos``) or a pool file as
``task.data_path`` takes it (``RepoTask`` lines, or SWE-bench-format rows whose repositories are
in ``--repos``). Tasks are loaded with ``envs.repo.load_repo_tasks`` and each gold patch
(``reference_patch``) is verified as a training rollout's submission is: one
``verify.execution.verify_repo_call`` with the monitor on (the runtime audit, the patch rules
and the AST rules), as ``PythonRepoFamily.verify`` calls it.

One JSON line per task goes to ``--results`` as it finishes (status, the flags with their
evidence, a note for a gold patch that did not pass). Run again with the same file to go on
where it stopped: tasks already recorded are not run again, except those that ended in an
infrastructure error. The table at the end counts tasks, gold passes, confirmed flags (by rule,
with the task ids), advisory flags (evidence for the grader) and infrastructure errors, over
every task of the pools that has a result (a task without a gold patch is only counted), then
the same per package (a task id's ``pypi__<name>.NNNN`` or ``pypi__<name>-<version>``). The
exit status is 1 when a gold patch got a confirmed flag or did not pass, else 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

EVIDENCE_CHARS = 400  # evidence kept per flag in the results file


def pool_paths(pool: str, repos: str) -> tuple[str, str]:
    """``(data_path, repos_dir)`` of ``pool``: a factory directory or a pool file."""
    if os.path.isdir(pool) and os.path.isfile(os.path.join(pool, "instances.jsonl")):
        return os.path.join(pool, "instances.jsonl"), os.path.join(pool, "repos")
    if not os.path.exists(pool):
        raise SystemExit(f"pool {pool!r} does not exist")
    return pool, repos


def load_results(path: str) -> dict[str, dict]:
    """The recorded result per task id (the last line of an id wins)."""
    out: dict[str, dict] = {}
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    print(f"{path}:{n}: not JSON, ignored (a run cut short?)", file=sys.stderr)
                    continue
                out[rec["task_id"]] = rec
    return out


def check_gold(task) -> dict:
    """The gold patch of ``task`` verified with the monitor, as a training submission is."""
    from gagar_jax.verify.execution import verify_repo_call

    t0 = time.monotonic()
    if not task.reference_patch.strip():
        return {"task_id": task.task_id, "status": "no_gold", "flags": [], "seconds": 0.0}
    v = verify_repo_call(task, task.reference_patch, events=())
    rec = {
        "task_id": task.task_id,
        "status": v.status,
        "flags": [
            {
                "rule": f.rule,
                "confirmed": bool(f.confirmed),
                "evidence": f.evidence[:EVIDENCE_CHARS],
            }
            for f in v.flags
        ],
        "seconds": round(time.monotonic() - t0, 2),
    }
    if v.status != "passed":
        bad = {t: o for t, o in v.tests.items() if o != "passed"}
        rec["note"] = (v.patch_error or "") + json.dumps(bad)[:300] + " | " + v.test_log[:600]
    return rec


def kind(flag: dict) -> str:
    """A flag's rule, with the runtime audit's event kind when it came from the audit."""
    m = re.match(r"(?:test report: )?runtime audit: ([\w.]+):", flag["evidence"])
    return f"{flag['rule']}/{m.group(1)}" if m else flag["rule"]


def summarise(recs: list[dict]) -> dict:
    """The table's figures over ``recs``."""
    confirmed = collections.defaultdict(list)  # rule -> task ids
    advisory = collections.Counter()
    advisory_tasks = set()
    for r in recs:
        for f in r["flags"]:
            if f["confirmed"]:
                confirmed[kind(f)].append(r["task_id"])
            else:
                advisory[kind(f)] += 1
                advisory_tasks.add(r["task_id"])
    status = collections.Counter(r["status"] for r in recs)
    return {
        "tasks": len(recs) - status["no_gold"],
        "no_gold": status["no_gold"],
        "gold_passed": status["passed"],
        "gold_not_passed": {
            r["task_id"]: r["status"]
            for r in recs
            if r["status"] not in ("passed", "infra_error", "no_gold")
        },
        "confirmed": {k: sorted(set(v)) for k, v in sorted(confirmed.items())},
        "confirmed_flags": sum(len(v) for v in confirmed.values()),
        "confirmed_tasks": len({t for v in confirmed.values() for t in v}),
        "advisory": dict(sorted(advisory.items())),
        "advisory_tasks": len(advisory_tasks),
        "infra_errors": sorted(r["task_id"] for r in recs if r["status"] == "infra_error"),
    }


def package_of(task_id: str) -> tuple[str, str]:
    """``(package, source)`` of a task id: the factory's ``pypi__<name>.NNNN`` (source
    ``factory``), a release row's ``pypi__<name>-<version>`` (``release``), else the id itself."""
    m = re.fullmatch(r"(.+?)(\.\d{4,}|-\d[\w.+!]*)", task_id)
    if not m:
        return task_id, ""
    return m.group(1).removeprefix("pypi__"), "factory" if m.group(2)[0] == "." else "release"


def per_package(recs: list[dict]) -> str:
    """One row per package and source: tasks, gold passes, confirmed and evidence flags by
    kind, infrastructure errors."""
    groups = collections.defaultdict(list)
    for r in recs:
        groups[package_of(r["task_id"])].append(r)

    def kinds(flags):
        c = collections.Counter(kind(f) for f in flags)
        return ", ".join(f"{k} {n}" for k, n in sorted(c.items())) or "0"

    rows = [
        "| package | source | tasks | gold passed | confirmed flags | evidence flags "
        "| infra errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for (pkg, src), rs in sorted(groups.items()):
        flags = [f for r in rs for f in r["flags"]]
        gold = [r for r in rs if r["status"] != "no_gold"]
        rows.append(
            f"| {pkg} | {src} | {len(gold)} | {sum(r['status'] == 'passed' for r in gold)} | "
            f"{kinds([f for f in flags if f['confirmed']])} | "
            f"{kinds([f for f in flags if not f['confirmed']])} | "
            f"{sum(r['status'] == 'infra_error' for r in gold)} |"
        )
    return "\n".join(rows)


def format_table(s: dict) -> str:
    def kinds(d):
        return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"

    conf = "; ".join(f"{k}: {', '.join(v)}" for k, v in s["confirmed"].items())
    rows = [
        (
            "tasks",
            s["tasks"]
            if not s["no_gold"]
            else f"{s['tasks']} ({s['no_gold']} more without a gold patch)",
        ),
        ("gold passed", s["gold_passed"]),
        (
            "gold not passed",
            f"{len(s['gold_not_passed'])}"
            + (f" ({kinds(s['gold_not_passed'])})" if s["gold_not_passed"] else ""),
        ),
        (
            "confirmed flags",
            f"{s['confirmed_flags']} on {s['confirmed_tasks']} tasks"
            + (f" ({conf})" if conf else ""),
        ),
        (
            "advisory flags",
            f"{sum(s['advisory'].values())} on {s['advisory_tasks']} tasks "
            f"({kinds(s['advisory'])})",
        ),
        (
            "infra errors",
            f"{len(s['infra_errors'])}"
            + (f" ({', '.join(s['infra_errors'])})" if s["infra_errors"] else ""),
        ),
    ]
    return "\n".join(["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pools", nargs="+", help="factory output directories or pool files")
    ap.add_argument("--repos", default="", help="repositories of SWE-bench-format rows in a file")
    ap.add_argument("--results", default="gold_flags.jsonl", help="per-task results (resumed)")
    ap.add_argument("--jobs", type=int, default=1, help="verifications at once")
    ap.add_argument("--limit", type=int, default=0, help="run at most this many new tasks")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    from gagar_jax.data import swe  # noqa: F401 - registers the SWE-bench row reader, as rl does
    from gagar_jax.envs.repo import load_repo_tasks

    tasks = []
    for pool in args.pools:
        data_path, repos_dir = pool_paths(pool, args.repos)
        loaded = load_repo_tasks(data_path, repos_dir)
        print(f"{pool}: {len(loaded)} tasks", flush=True)
        tasks += loaded
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise SystemExit(f"task ids occur in more than one pool: {dup[:5]}")
    done = load_results(args.results)
    todo = [t for t in tasks if t.task_id not in done or done[t.task_id]["status"] == "infra_error"]
    if args.limit:
        todo = todo[: args.limit]
    print(
        f"{len(tasks) - len(todo)} recorded, {len(todo)} to run ({args.jobs} at once)", flush=True
    )
    lock = threading.Lock()
    with open(args.results, "a", encoding="utf-8") as sink, ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(check_gold, t): t for t in todo}
        for n, fut in enumerate(as_completed(futures), start=1):
            task = futures[fut]
            try:
                rec = fut.result()
            except Exception as e:  # noqa: BLE001 - the script's own fault: recorded, not fatal
                rec = {"task_id": task.task_id, "status": "infra_error", "flags": []}
                rec["note"] = f"{type(e).__name__}: {e}"
            with lock:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                done[task.task_id] = rec
            conf = sorted({kind(f) for f in rec["flags"] if f["confirmed"]})
            print(
                f"[{n}/{len(todo)}] {task.task_id}: {rec['status']}"
                + (f", CONFIRMED {conf}" if conf else "")
                + f" ({rec.get('seconds', 0)}s)",
                flush=True,
            )
    recs = [done[i] for i in ids if i in done]
    s = summarise(recs)
    print(format_table(s))
    print()
    print(per_package(recs))
    for r in recs:
        for ev in sorted({f["evidence"] for f in r["flags"] if f["confirmed"]}):
            print(f"confirmed on {r['task_id']}: {ev}")
    return 1 if s["confirmed"] or s["gold_not_passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
