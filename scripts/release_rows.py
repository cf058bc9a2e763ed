r"""SWE-bench rows from consecutive releases of packages on PyPI: real fixes with real tests.

    python scripts/release_rows.py --pairs toolz==1.0.0:1.1.0,six==1.16.0:1.17.0 --out DIR

For each pair ``name==OLD:NEW`` both source distributions are downloaded from the registry
(``data.synth.download_sdist``) and the row is built as SWE-bench builds one from a pull
request: the repository at ``base_commit`` is release OLD; ``patch`` is what NEW changes in the
package's non-test Python files; ``test_patch`` is what NEW changes in its test files (hidden
from the agent, written by the verifier); the tests of the files ``test_patch`` touches are run
in the sandbox on OLD with the new tests and on NEW (``data.synth.trace_suite``, the task's
environment built with ``data.repos.build_env`` from NEW's declared requirements):
``FAIL_TO_PASS`` are those that fail on the first and pass on the second, ``PASS_TO_PASS``
(up to ``--max-p2p``) those that pass on both. A pair without a fail-to-pass test is skipped,
named in the log.

Output, as the task factory writes it and the SWE-bench import reads it: ``DIR/instances.jsonl``
(``instance_id`` ``pypi__<name>-<NEW>``, ``repo`` ``pypi/<name>``) and ``DIR/repos/pypi__<name>``
(a git repository, one commit per row's OLD release on a branch of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time


def tree(spec: str, cache: str) -> dict[str, str]:
    from gagar_jax.data import repos, synth

    work = tempfile.mkdtemp(prefix="gagar_release_")
    try:
        top = synth.extract_sdist(synth.download_sdist(spec, os.path.join(cache, "sdists")), work)
        return synth._clean_tree(repos.read_text_tree(top))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def with_changes(base: dict[str, str], new: dict[str, str], pick) -> dict[str, str]:
    """``base`` with ``new``'s version of every path ``pick`` selects (added, changed, removed)."""
    out = dict(base)
    for p in set(base) | set(new):
        if not pick(p):
            continue
        if p in new:
            out[p] = new[p]
        else:
            out.pop(p, None)
    return out


def build_row(name: str, old: str, new: str, cache: str, store: str, max_p2p: int, log):
    from gagar_jax.data import repos, swe, synth
    from gagar_jax.verify.diff import tree_patch

    a, b = tree(f"{name}=={old}", cache), tree(f"{name}=={new}", cache)

    def is_code(p):
        return p.endswith(".py") and not synth._is_test_file(p) and p != "setup.py"

    tests_new = with_changes(a, b, synth._is_test_file)
    gold = with_changes(tests_new, b, is_code)
    patch, test_patch = tree_patch(a, with_changes(a, b, is_code)), tree_patch(a, tests_new)
    if not patch.strip() or not test_patch.strip():
        log(f"{name} {old} -> {new}: skipped (no code or no test change)")
        return None
    touched = sorted(p for p in set(a) | set(b) if synth._is_test_file(p) and a.get(p) != b.get(p))
    pythonpath = repos.detect_pythonpath(gold)
    deps = repos.package_requirements(gold)
    env = repos.build_env(deps, cache_dir=cache)
    fixed = synth.trace_suite(gold, env.path, pythonpath, timeout_s=10)["outcomes"]
    broken = synth.trace_suite(tests_new, env.path, pythonpath, timeout_s=10)["outcomes"]
    mine = [t for t in fixed if "::" in t and t.split("::")[0] in touched]
    f2p = tuple(t for t in mine if fixed[t] == "passed" and broken.get(t) != "passed")
    p2p = tuple(t for t in mine if fixed[t] == "passed" and broken.get(t) == "passed")[:max_p2p]
    if not f2p:
        log(f"{name} {old} -> {new}: skipped (no fail-to-pass test among {len(mine)})")
        return None
    key = "pypi__" + re.sub(r"[^\w.-]", "_", name.lower())
    root = os.path.join(store, key)
    if not os.path.isdir(os.path.join(root, ".git")):
        os.makedirs(root, exist_ok=True)
        repos.git("init", "-q", "-b", "main", cwd=root)
        repos.git("commit", "-q", "--allow-empty", "--no-verify", "-m", "empty", cwd=root)
    repos.git("checkout", "-q", "--orphan", f"release/{old}", cwd=root)
    repos.git("rm", "-rfq", "--ignore-unmatch", ".", cwd=root)
    from gagar_jax.verify.repo import write_tree

    write_tree(root, a)
    repos.git("add", "-A", cwd=root)
    repos.git("commit", "-q", "--no-verify", "-m", f"{name}=={old}", cwd=root)
    sha = repos.git("rev-parse", "HEAD", cwd=root).stdout.decode().strip()
    repos.git("checkout", "-q", "main", cwd=root)
    log(f"{name} {old} -> {new}: F2P {len(f2p)}, P2P {len(p2p)}")
    issue = (
        f"`{name}` {old} misbehaves where {new} does not: these tests fail on {old}:\n\n"
        + "\n".join(f"- {t}" for t in f2p[:10])
    )
    return swe.SweInstance(
        f"{key}-{new}",
        f"pypi/{name}",
        sha,
        patch,
        test_patch,
        issue,
        f2p,
        p2p,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        version=old,
        environment_setup_commit=sha,
        test_cmd="pytest",
        python_deps=tuple(deps),
        install="pythonpath",
    ).to_row()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", required=True, help="name==OLD:NEW,...")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None, help="sdist and environment cache")
    ap.add_argument("--max-p2p", type=int, default=20)
    args = ap.parse_args(argv)
    from gagar_jax.data import repos

    cache = os.path.abspath(args.cache or repos.default_cache_dir())
    pairs = []
    for item in args.pairs.split(","):
        m = re.fullmatch(r"([A-Za-z0-9][\w.-]*)==([\w.+!-]+):([\w.+!-]+)", item.strip())
        if not m:
            ap.error(f"--pairs: {item!r} is not name==OLD:NEW")
        pairs.append(m.groups())
    store = os.path.join(args.out, "repos")
    os.makedirs(store, exist_ok=True)
    rows = []
    for name, old, new in pairs:
        try:
            row = build_row(name, old, new, cache, store, args.max_p2p, print)
        except Exception as e:  # noqa: BLE001 - one pair's failure is named, the others go on
            print(f"{name} {old} -> {new}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        if row is not None:
            rows.append(row)
    with open(os.path.join(args.out, "instances.jsonl"), "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} rows from {len(pairs)} pairs -> {args.out}/instances.jsonl")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
