"""Trains a small model to speak the agentic grader's protocol and measures it on a real server.

    PYTHONPATH=$PWD .venv/bin/python scripts/train_agentic_student.py --out runs/agentic_student
    PYTHONPATH=$PWD .venv/bin/python scripts/train_agentic_student.py --out runs/agentic_student \\
        --eval toy:heldout,repo,synth --votes 3

Steps (``gagar_jax.grading.protocol_student`` holds the pieces):

1. training groups: the toy set's ``dev`` half and freshly generated toy groups (other seeds;
   any whose task text equals one of the labelled toy groups' is dropped: the only use of the
   ``heldout`` half before evaluation). Nothing of ``repo`` or ``synth`` is read before it.
2. the heuristic grader answers the agentic grader's compact prompts (``c1``) for ``--episodes``
   votes per group (different shuffles); ``teacher_log.jsonl`` is the TeacherLog.
3. a byte-level BPE tokenizer on those prompts and answers; a Qwen2-shaped decoder fine-tuned
   through ``update.sft.run_sft`` on the answers; exported to ``<out>/model`` (safetensors).
4. ``--eval``: an SGLang server (CPU, ``.venv-sglang``) serves ``<out>/model`` and the
   grader-quality harness (``python -m gagar_jax.grading.eval``) grades the given sets with the
   agentic grader (``--prompt-version c1``, ``--votes``, permutation probe); ``--untrained`` does
   the same for the same architecture with its initial weights.

``<out>/summary.json`` records the data sizes, the training curve, the wall times and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generated_toy_groups(seeds, per_difficulty, exclude_texts):
    """Toy groups built like the labelled toy set (every patch kind, shuffled), other seeds."""
    from gagar_jax.envs import toy, toy_grading

    groups = []
    for seed in seeds:
        for difficulty in (1, 2, 3):
            gen = toy.ToyTaskGenerator(seed=seed, difficulty=difficulty)
            for i, task in enumerate(gen.tasks(per_difficulty)):
                patches = toy.candidate_patches(task)
                kinds = sorted(patches)
                random.Random(f"{seed}/{difficulty}/{i}").shuffle(kinds)
                ws = toy_grading.toy_group(
                    task, f"gen-s{seed}-d{difficulty}-{i}", [patches[k] for k in kinds]
                )
                if ws.task_text not in exclude_texts:
                    groups.append(ws)
    return groups


def log_line(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


def train(args) -> dict:
    from gagar_jax.grading import labelled
    from gagar_jax.grading import protocol_student as ps
    from gagar_jax.grading.heuristic import HeuristicGrader
    from gagar_jax.models import save_hf_safetensors  # noqa: F401 (fail early without safetensors)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"args": vars(args), "load_start": os.getloadavg()}
    t0 = time.monotonic()
    toy_all = labelled.load_set("toy")
    dev = labelled.select_split(toy_all, "dev")
    exclude = {g.workspace.task_text for g in toy_all.groups}
    gen = generated_toy_groups(range(1000, 1000 + args.gen_seeds), args.gen_per_difficulty, exclude)
    groups = [g.workspace for g in dev.groups] + gen
    summary["groups"] = {"toy_dev": len(dev.groups), "generated_toy": len(gen)}
    log_line(f"{len(groups)} training groups ({len(dev.groups)} toy dev, {len(gen)} generated)")

    log = out / "teacher_log.jsonl"
    if log.exists():
        log.unlink()
    episodes = ps.record_episodes(HeuristicGrader(), groups, votes=args.episodes, log_path=log)
    log_line(f"{len(episodes)} teacher episodes in {time.monotonic() - t0:.0f} s")

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [(stdlib / f).read_text(errors="replace") for f in ("textwrap.py", "difflib.py")]
    texts = [ps.chat_text(e.messages) + e.answer for e in episodes] + code
    tok_dir = ps.train_tokenizer(texts, out / "tokenizer", args.vocab_size)
    tok = ps.StudentTokenizer(tok_dir)
    demos, dropped = ps.demonstrations(episodes, tok, max_len=args.seq_len)
    lengths = sorted(len(p) + len(a) for p, a in demos)
    summary["demos"] = {
        "n": len(demos),
        "dropped_over_seq_len": dropped,
        "tokens_median": lengths[len(lengths) // 2],
        "tokens_max": lengths[-1],
        "answer_tokens_max": max(len(a) for _, a in demos),
    }
    log_line(f"demonstrations: {summary['demos']}")

    config = ps.student_config(
        tok.vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=3 * args.hidden,
    )
    summary["model"] = {"params": config.num_params, "config": config.to_hf()}
    log_line(f"student: {config.num_params} parameters, seq_len {args.seq_len}")

    curve = []

    def log_fn(step, m):
        curve.append({"step": step, **m, "load": os.getloadavg()[0]})
        log_line(
            f"step {step}: loss {m['sft_loss']:.3f} token acc {m['sft_token_accuracy']:.3f} "
            f"({time.monotonic() - t_train:.0f} s)"
        )

    untrained, _ = ps.train_student(
        demos, config, steps=0, seq_len=args.seq_len, pad_id=tok.pad_id, seed=args.seed
    )
    ps.export_student(untrained, config, tok_dir, str(out / "untrained"))
    # Trained in rounds of --export-every steps (each a fresh warm-up and cosine decay, as
    # run_sft schedules one call), exported after each: the latest export is always usable.
    t_train = time.monotonic()
    model, done = untrained, 0
    if args.resume:  # continue from <out>/model (same data, tokenizer and config)
        from gagar_jax.models import load_hf_safetensors

        _, model = load_hf_safetensors(str(out / "model"))
        done = args.resume
        args.steps += done
        curve = summary["curve"] = json.loads((out / "summary.json").read_text()).get("curve", [])
    while done < args.steps:
        n = min(args.export_every, args.steps - done)
        _, _ = ps.train_student(
            demos,
            config,
            steps=n,
            seq_len=args.seq_len,
            pad_id=tok.pad_id,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed + done,
            log_fn=lambda step, m, base=done: log_fn(base + step, m),
            log_every=args.log_every,
            model=model,
        )
        done += n
        ps.export_student(model, config, tok_dir, str(out / "model"))
        summary.update(steps_done=done, train_s=time.monotonic() - t_train, curve=curve)
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        log_line(f"exported {out / 'model'} after {done} steps")
    summary["load_end"] = os.getloadavg()
    summary["total_s"] = time.monotonic() - t0
    log_line(f"trained {args.steps} steps in {time.monotonic() - t_train:.0f} s")
    return summary


def evaluate(model_dir: Path, sets: list[str], args, label: str) -> list[dict]:
    """Serves ``model_dir`` and grades ``sets`` (``name`` or ``name:split``) with the agentic
    grader through the harness, ``--workers`` groups at a time (one grader per group, the
    server batching their requests); one harness row per set, as the CLI writes it."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from gagar_jax.grading import eval as harness
    from gagar_jax.grading import labelled
    from gagar_jax.grading.agentic import AgenticGrader
    from gagar_jax.rollout.sglang_client import SGLangClient
    from gagar_jax.rollout.sglang_server import CONSTRAINED_JSON_FLAGS, SGLangServer

    probes = harness.PROBES if args.probes == "all" else tuple(p for p in args.probes.split(","))
    probes = tuple(p for p in probes if p and p != "none")
    server = SGLangServer(
        model_dir,
        context_length=8192,
        max_total_tokens=65536,
        max_running_requests=max(8, args.workers),
        model_modules=("qwen2",),
        extra_args=CONSTRAINED_JSON_FLAGS,
    )
    t0 = time.monotonic()
    server.start(timeout_s=600)
    log_line(f"{label}: server up in {time.monotonic() - t0:.0f} s at {server.url}")
    jobs = []
    for spec in sets:
        name, _, split = spec.partition(":")
        lset = labelled.load_set(name, split=split or "all")
        if args.limit:
            lset = dataclasses.replace(lset, groups=lset.groups[: args.limit])
        jobs += [(spec, lset, k) for k in range(len(lset.groups))]

    def one(job):
        spec, lset, k = job
        if time.monotonic() > t + args.deadline_s:
            return None  # not started before the deadline: left out (rows say how many ran)
        # As harness.make_grader("agentic", ...) builds it, with time limits for a slow CPU
        # server (a 500-token answer runs for minutes when many are decoded at once).
        counter = harness.TokenCounter(
            SGLangClient(server.url, max_retries=1, request_timeout_s=args.request_timeout_s)
        )
        grader = AgenticGrader(
            counter,
            votes=args.votes,
            vote_temperature=args.vote_temperature,
            time_budget_s=args.request_timeout_s,
            max_steps=args.max_steps,
            max_tokens=args.max_tokens,
            prompt_version="c1",
            constrain_answer=not args.unconstrained,
            rank_order=args.rank_order,
            uncited_scores=args.uncited_scores,
            seed_votes=args.seed_votes,
        )
        grader.token_counter = counter
        sub = dataclasses.replace(lset, groups=(lset.groups[k],))
        row = harness.evaluate(
            grader, sub, probes=probes, n_boot=0, deadline_s=args.group_deadline_s
        )
        log_line(f"{label} {spec} group {k}: fallback {row['fallback_rate']}")
        return row["grader"], row["outcomes"][0], dict(grader.metrics)

    load0 = os.getloadavg()
    t = time.monotonic()
    try:
        with ThreadPoolExecutor(args.workers) as ex:
            results = list(ex.map(one, jobs))
    finally:
        server.stop()
    rows = []
    for spec in sets:
        mine = [(job, res) for job, res in zip(jobs, results) if job[0] == spec and res]
        if not mine:
            continue
        lset = mine[0][0][1]
        outcomes = [res[1] for _, res in mine]
        row = {"grader": mine[0][1][0], "set": lset.set_id, "groups": len(outcomes)}
        row.update(harness.metrics(outcomes))
        for p in probes:
            runs = sum(o.probe_runs.get(p, 0) for o in outcomes)
            fails = sum(o.probe_failures.get(p, 0) for o in outcomes)
            row[f"probe/{p}"] = fails / runs if runs else float("nan")
            row[f"probe_runs/{p}"] = runs
        for k, ci in harness.bootstrap_ci(outcomes, 200).items():
            row[f"{k}_ci"] = list(ci)
        counts = {}
        for _, res in mine:
            for key, n in res[2].items():
                counts[key] = counts.get(key, 0) + n
        row.update(
            model=label,
            constrained=not args.unconstrained,
            rank_order=args.rank_order,
            uncited_scores=args.uncited_scores,
            seed_votes=args.seed_votes,
            grader_counts=counts,
            eval_wall_s=time.monotonic() - t,
            workers=args.workers,
            concurrent_groups=len(jobs),
            load_before=load0,
            load_after=os.getloadavg(),
            vote_temperature=args.vote_temperature,
            votes=args.votes,
        )
        rows.append(harness.public_row(row))
        log_line(
            f"{label} {spec}: kappa {row['kappa']} flip {row['flip_rate']} "
            f"({row['flip_pairs']} pairs) fallback {row['fallback_rate']} "
            f"s/group {row['s_per_group']:.1f}"
        )
    return rows


def main(argv=None) -> int:
    from gagar_jax.grading import schema

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/agentic_student")
    ap.add_argument("--skip-train", action="store_true", help="reuse <out>/model")
    ap.add_argument(
        "--resume", type=int, default=0, help="continue <out>/model, trained this many steps"
    )
    ap.add_argument("--gen-seeds", type=int, default=8)
    ap.add_argument("--gen-per-difficulty", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=3, help="teacher votes (shuffles) per group")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1792)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--export-every", type=int, default=100, help="steps per training round")
    ap.add_argument("--eval", default="", help="comma-separated sets, e.g. toy:heldout,repo")
    ap.add_argument("--untrained", action="store_true", help="also evaluate the initial weights")
    ap.add_argument("--votes", type=int, default=3)
    ap.add_argument("--vote-temperature", type=float, default=0.0)
    ap.add_argument(
        "--unconstrained",
        action="store_true",
        help="grade without the verdict schema (constrained decoding is the default)",
    )
    ap.add_argument(
        "--rank-order",
        choices=schema.RANK_POLICIES,
        default="strict",
        help="reject a vote whose ranks contradict its tiers (strict) or renumber its ranks in "
        "(tier, rank) order (tier_first)",
    )
    ap.add_argument(
        "--uncited-scores",
        choices=schema.SCORE_POLICIES,
        default="cite",
        help="reject a vote with a low score that cites no evidence (cite) or raise such scores "
        "to the threshold and keep the vote (drop_uncited)",
    )
    ap.add_argument(
        "--seed-votes",
        action="store_true",
        help="seed each call's sampling from the group's content, vote and step",
    )
    ap.add_argument("--max-steps", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--probes", default="permute")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8, help="groups graded at once")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no group after this")
    ap.add_argument("--request-timeout-s", type=float, default=900.0, help="per model call")
    ap.add_argument(
        "--group-deadline-s",
        type=float,
        default=1800.0,
        help="the pool's deadline for grading one group (all its votes), and again for its "
        "permuted copy",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    summary_path = out / "summary.json"
    summary = {}
    if args.skip_train:
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
    else:
        summary = train(args)
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
    if args.eval:
        sets = [s for s in args.eval.split(",") if s]
        rows = evaluate(out / "model", sets, args, "trained")
        if args.untrained:
            rows += evaluate(out / "untrained", sets, args, "untrained")
        summary.setdefault("eval", []).extend(rows)
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
        for r in rows:
            print(json.dumps(r, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
