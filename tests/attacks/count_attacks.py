"""Counts the attacks in each file of ``tests/attacks/`` (collected test cases per file).

Run: ``.venv/bin/python tests/attacks/count_attacks.py`` (collection only, nothing runs). An
attack is one collected test case: each parametrised case of an attack table counts once; the
false-positive files count honest cases.
"""

import collections
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", HERE],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(HERE)),
                         check=False).stdout  # fmt: skip  # argv pairs
    counts: collections.Counter[str] = collections.Counter()
    for line in out.splitlines():
        if "::" in line:
            counts[os.path.basename(line.split("::", 1)[0])] += 1
    for name, n in sorted(counts.items()):
        print(f"{n:5d}  {name}")
    print(f"{sum(counts.values()):5d}  total")


if __name__ == "__main__":
    main()
