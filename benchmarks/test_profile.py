"""Where the unit tests' time goes: CPU seconds and XLA compilations per test file and per test.

Run the tests with ``GAGAR_TEST_PROFILE=<prefix>`` (tests/compile_profile.py writes one JSON line
per test to ``<prefix>.<worker>.jsonl``), then sum them:

    GAGAR_TEST_PROFILE=/tmp/prof PYTHONPATH=$PWD .venv/bin/python -m pytest -q -n 2 \\
        -m "not e2e and not sglang and not ray and not bench" tests
    .venv/bin/python benchmarks/test_profile.py /tmp/prof --tests 30

CPU seconds are the process's (every thread), so they hold under load where wall seconds do not.
"""

import argparse
import collections
import glob
import json


def load(prefix: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(f"{prefix}.*.jsonl")):
        with open(path) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


# (key, header, format): the per-test columns, summed per file.
COLUMNS = (
    ("cpu_s", "cpu_s", "8.1f"),
    ("child_cpu_s", "child_s", "8.1f"),
    ("wall_s", "wall_s", "8.1f"),
    ("compiles", "compiles", "8d"),
    ("compile_s", "compile_s", "9.1f"),
    ("trace_s", "trace_s", "8.1f"),
    ("lower_s", "lower_s", "8.1f"),
    ("cache_hits", "hits", "5d"),
    ("cache_hit_s", "saved_s", "8.1f"),
)
FILE_COLUMNS = (("tests", "tests", "5d"),)


def header(columns) -> str:
    return " ".join(f"{title:>{fmt.split('.')[0].rstrip('df')}}" for _, title, fmt in columns)


def cells(row, columns) -> str:
    return " ".join(f"{row.get(key, 0):{fmt}}" for key, _, fmt in columns)


def _cpu(row) -> float:
    return row.get("cpu_s", 0.0) + row.get("child_cpu_s", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="the GAGAR_TEST_PROFILE prefix the tests wrote")
    parser.add_argument("--files", type=int, default=40, help="files to list (most CPU first)")
    parser.add_argument("--tests", type=int, default=20, help="tests to list (most CPU first)")
    args = parser.parse_args()
    rows = load(args.prefix)
    if not rows:
        raise SystemExit(f"no {args.prefix}.*.jsonl rows")
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        per_file[row["file"]].update({k: row.get(k, 0) for k, _, _ in COLUMNS})
        per_file[row["file"]]["tests"] += 1
    total = collections.Counter()
    for c in per_file.values():
        total.update(c)
    print(header(COLUMNS + FILE_COLUMNS) + "  file")
    by_cpu = sorted(per_file.items(), key=lambda kv: -_cpu(kv[1]))
    for name, c in by_cpu[: args.files]:
        print(cells(c, COLUMNS + FILE_COLUMNS) + f"  {name}")
    print(cells(total, COLUMNS + FILE_COLUMNS) + f"  TOTAL ({len(per_file)} files)")
    print()
    print(header(COLUMNS) + "  test")
    for row in sorted(rows, key=lambda r: -_cpu(r))[: args.tests]:
        print(cells(row, COLUMNS) + f"  {row['test']}")


if __name__ == "__main__":
    main()
