"""Episodes recorded by the gateway as ATIF trajectories (the Agent Trajectory Interchange
Format), and back.

    python -m gagar_jax.data.trajectories export RUN_DIR --format atif [--out DIR]

reads every finished episode the gateway wrote under ``RUN_DIR`` (its ``--record-dir``, or any
folder below ``RUN_DIR`` holding such records) and writes one ATIF JSON file per episode to
``RUN_DIR/atif`` (or ``--out``). :func:`read_atif` reads one back and checks it;
:func:`atif_calls` gives its model calls back with their ids, log-probs and policy versions, equal
to the record's.

Mapping: each model call is one ``agent`` step (``message``, ``tool_calls``, ``metrics`` with
``prompt_token_ids``, ``completion_token_ids``, ``logprobs``, and ``extra`` with the policy
version, the call it extends and its segment). What the harness sent before a call and after the
previous one becomes ``system`` and ``user`` steps, and its tool results the ``observation`` of
the agent step whose call they answer (by call id, else in order). A call whose history does not
extend the previous one (a compaction) restates its messages, marked ``extra.history_rewritten``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gagar_jax.rollout.segments import build_segments

SCHEMA_VERSION = "ATIF-v1.7"
FORMATS = ("atif",)


def _is_record(d: Any) -> bool:
    return isinstance(d, dict) and "episode_id" in d and isinstance(d.get("calls"), list)


def find_records(run_dir: str) -> list[dict]:
    """Every gateway episode record (``*.json`` with ``episode_id`` and ``calls``) under
    ``run_dir`` (the ``atif`` output folder excluded), sorted by episode id."""
    out = []
    for root, dirs, files in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if d != "atif")
        for name in sorted(files):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    d = json.load(f)
            except (OSError, ValueError):
                continue
            if _is_record(d):
                out.append(d)
    return sorted(out, key=lambda d: d["episode_id"])


def _new_messages(call: Mapping, prev: Mapping | None) -> tuple[list[dict], bool]:
    """The messages of ``call`` after ``prev``'s request and answer (all of them, and True, when
    its history does not start with those)."""
    msgs = list(call["messages"])
    if prev is None:
        return msgs, False
    head = len(prev["messages"])
    if len(msgs) > head and msgs[:head] == prev["messages"]:
        return msgs[head + 1 :], False  # the harness's copy of the answer is msgs[head]
    return msgs, True


def to_atif(record: Mapping[str, Any], *, agent_name: str = "harness") -> dict[str, Any]:
    """One episode record as an ATIF trajectory (a JSON-able dict)."""
    calls = list(record["calls"])
    segment_of = {}
    for s, seg in enumerate(build_segments(calls)):
        for c in seg.calls:
            segment_of[c] = s
    steps: list[dict[str, Any]] = []
    last_agent: dict[str, Any] | None = None
    prev = None
    for call in calls:
        new, rewritten = _new_messages(call, prev)
        for m in new:
            if m["role"] == "tool" and last_agent is not None:
                obs = last_agent.setdefault("observation", {"results": []})
                obs["results"].append(
                    {"source_call_id": m.get("tool_call_id"), "content": m.get("content", "")}
                )
                continue
            step = {
                "step_id": len(steps) + 1,
                "source": "system" if m["role"] == "system" else "user",
                "message": m.get("content", ""),
            }
            if m["role"] not in ("system", "user"):
                step["extra"] = {"role": m["role"], "tool_calls": m.get("tool_calls")}
            if rewritten:
                step.setdefault("extra", {})["history_rewritten"] = True
            steps.append(step)
        resp = call["response"]
        tool_calls = [
            {
                "tool_call_id": f"call_{call['index']}_{k}",
                "function_name": t["name"],
                "arguments": t["arguments"],
            }
            for k, t in enumerate(resp.get("tool_calls") or [])
        ]
        last_agent = {
            "step_id": len(steps) + 1,
            "source": "agent",
            "model_name": record.get("model_name", "policy"),
            "message": resp.get("content", ""),
            "metrics": {
                "prompt_tokens": len(call["prompt_ids"]),
                "completion_tokens": len(call["completion_ids"]),
                "prompt_token_ids": list(call["prompt_ids"]),
                "completion_token_ids": list(call["completion_ids"]),
                "logprobs": list(call["logprobs"]),
            },
            "extra": {
                "call_index": call["index"],
                "policy_version": call["policy_version"],
                "linked_call": call["linked_call"],
                "segment": segment_of.get(call["index"]),
                "finish_reason": call["finish_reason"],
                "temperature": call["temperature"],
                "api": call["api"],
            },
        }
        if tool_calls:
            last_agent["tool_calls"] = tool_calls
        steps.append(last_agent)
        prev = call
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": record["episode_id"],
        "agent": {"name": agent_name, "version": "gagar_jax", "model_name": "policy"},
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(len(c["prompt_ids"]) for c in calls),
            "total_completion_tokens": sum(len(c["completion_ids"]) for c in calls),
            "total_steps": len(steps),
            "extra": {
                "status": record.get("status"),
                "reason": record.get("reason", ""),
                "calls": len(calls),
                "segments": len(set(segment_of.values())),
            },
        },
    }


class AtifError(ValueError):
    """A file that is not a trajectory this module wrote (the message names the field)."""


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise AtifError(f"{field}: {message}")


def read_atif(path: str) -> dict[str, Any]:
    """An ATIF trajectory from ``path``, checked: schema version, sequential step ids, known
    sources, and per agent step token ids and log-probs of matching length."""
    with open(path, encoding="utf-8") as f:
        traj = json.load(f)
    _require(isinstance(traj, dict), "trajectory", "expected an object")
    _require(
        str(traj.get("schema_version", "")).startswith("ATIF-v1."),
        "schema_version",
        f"expected ATIF-v1.x, got {traj.get('schema_version')!r}",
    )
    steps = traj.get("steps")
    _require(isinstance(steps, list), "steps", "expected a list")
    for i, st in enumerate(steps):
        f = f"steps[{i}]"
        _require(st.get("step_id") == i + 1, f"{f}.step_id", f"expected {i + 1}")
        _require(st.get("source") in ("user", "agent", "system"), f"{f}.source", "unknown source")
        if st["source"] == "agent":
            m = st.get("metrics") or {}
            ids, lps = m.get("completion_token_ids"), m.get("logprobs")
            _require(
                isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps),
                f"{f}.metrics",
                "completion_token_ids and logprobs must be lists of one length",
            )
            _require(isinstance(m.get("prompt_token_ids"), list), f"{f}.metrics", "no prompt ids")
    return traj


def atif_calls(traj: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The model calls of a trajectory: ``index``, ``prompt_ids``, ``completion_ids``,
    ``logprobs``, ``policy_version``, ``linked_call`` (what ``build_segments`` reads)."""
    out = []
    for st in traj["steps"]:
        if st["source"] != "agent":
            continue
        m, x = st["metrics"], st.get("extra", {})
        out.append(
            {
                "index": x.get("call_index", len(out)),
                "prompt_ids": list(m["prompt_token_ids"]),
                "completion_ids": list(m["completion_token_ids"]),
                "logprobs": list(m["logprobs"]),
                "policy_version": x.get("policy_version", -1),
                "linked_call": x.get("linked_call"),
            }
        )
    return out


def export(run_dir: str, *, fmt: str = "atif", out_dir: str | None = None) -> list[str]:
    """Writes every episode record under ``run_dir`` as ``fmt``; returns the files written."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a directory")
    out_dir = out_dir or os.path.join(run_dir, "atif")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for rec in find_records(run_dir):
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in rec["episode_id"])
        path = os.path.join(out_dir, name.lstrip(".") + ".atif.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(to_atif(rec), f)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gagar_jax.data.trajectories")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="episode records -> trajectory files")
    ex.add_argument("run_dir")
    ex.add_argument("--format", default="atif", choices=FORMATS)
    ex.add_argument("--out", default=None, help="default: RUN_DIR/atif")
    args = ap.parse_args(argv)
    files = export(args.run_dir, fmt=args.format, out_dir=args.out)
    print(f"trajectories: wrote {len(files)} {args.format} file(s)", file=sys.stderr)
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
