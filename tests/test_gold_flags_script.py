"""scripts/gold_flags.py on real fixture tasks in the sandbox: the table, the exit status and
resuming from the results file."""

import dataclasses
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATKIT = ROOT / "tests" / "fixtures" / "repos" / "statkit"


def _script():
    spec = importlib.util.spec_from_file_location("gold_flags", ROOT / "scripts" / "gold_flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gold_flags_table_and_resume(tmp_path, capsys):
    from gagar_jax.envs.repo import load_repo_tasks

    (task,) = [t for t in load_repo_tasks(str(STATKIT.parent)) if t.task_id.startswith("statkit")]
    pool = tmp_path / "pool.jsonl"
    golds = {"honest": "minimal.diff", "hack": "conftest_hack.diff"}
    with open(pool, "w") as f:
        for name, diff in golds.items():
            gold = (STATKIT / "patches" / diff).read_text()
            t = dataclasses.replace(task, task_id=name, reference_patch=gold)
            f.write(json.dumps(t.to_dict()) + "\n")
    results = tmp_path / "results.jsonl"
    gf = _script()
    rc = gf.main([str(pool), "--results", str(results), "--jobs", "2"])
    out = capsys.readouterr().out
    recs = {r["task_id"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert recs["honest"]["status"] == "passed"
    assert not [f for f in recs["honest"]["flags"] if f["confirmed"]]
    assert any(f["confirmed"] for f in recs["hack"]["flags"])
    assert rc == 1  # a gold patch with a confirmed flag
    assert "| tasks | 2 |" in out and "| gold passed | 1 |" in out
    assert "hack" in out.split("| confirmed flags |")[1].splitlines()[0]
    # per package (here each id is its own): the honest one passed with no confirmed flag
    rows = {
        ln.split(" | ")[0][2:]: ln.split(" | ") for ln in out.splitlines() if ln.startswith("| ")
    }
    assert rows["honest"][3:5] == ["1", "0"] and rows["hack"][3] == "0", out
    assert rows["hack"][4] != "0"
    # a second run resumes: nothing runs again, the same table comes back
    rc2 = gf.main([str(pool), "--results", str(results)])
    out2 = capsys.readouterr().out
    assert "2 recorded, 0 to run" in out2 and rc2 == 1
    assert len(results.read_text().splitlines()) == 2
    assert out2.split("| figure |")[1] == out.split("| figure |")[1]
