"""The README front page: the two commands first, under 10 KB, and its Python examples run."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_front_page_starts_with_the_two_commands_and_stays_short():
    text = _readme()
    assert len(text.encode()) <= 10_000
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first] == [["make", "train"], ["make", "test"]]


def test_kernel_example_prints_what_it_says(capsys):
    code = re.findall(r"```python\n(.*?)```", _readme(), re.S)[0]
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.split("\n")
    assert out[0].startswith("[[ 0.3658") and "-0.75" in out[0]  # T1 above T2, failure kept
    assert abs(float(out[1]) - 1.0) < 1e-5  # the credit balance is preserved


def test_training_example_builds_its_config():
    code = re.findall(r"```python\n(.*?)```", _readme(), re.S)[1]
    code = code.replace('summary = train_and_evaluate(cfg, "/tmp/smoke")', "result = cfg")
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["result"].name == "toy_gagar_smoke" and scope["result"].loop.total_steps == 3
