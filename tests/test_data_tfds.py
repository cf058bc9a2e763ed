"""TFDS builders (array_record, no TensorFlow): tiny datasets built in tmp dirs, read back."""

import dataclasses
import json
import os
import sys

import pytest
import tensorflow_datasets as tfds

from gagar_jax.data import tfds_builders as B  # noqa: E402
from gagar_jax.envs import ToyTaskGenerator, verify  # noqa: E402
from gagar_jax.envs.repo import RepoTask  # noqa: E402
from gagar_jax.verify.repo import verify_repo_patch  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "repos")


def test_no_tensorflow_needed():
    assert "tensorflow" not in sys.modules


def test_toy_tasks_round_trip(tmp_path):
    cfg = B.ToyTasksConfig(name="tiny3", difficulty=3, seed=5, num_train=12, num_test=4)
    builder = B.ToyTasks(config=cfg, data_dir=str(tmp_path))
    builder.download_and_prepare()
    assert builder.info.file_format.value == "array_record"
    assert list(tmp_path.glob(f"toy_tasks/tiny3/{builder.version}/*.array_record*"))
    src = builder.as_data_source()
    assert (len(src["train"]), len(src["test"])) == (12, 4)
    train = [B.toy_task_from_record(src["train"][i]) for i in range(12)]
    assert train == ToyTaskGenerator(5, 3).tasks(12)  # record i is task i: no shuffling
    test = [B.toy_task_from_record(r) for r in src["test"]]
    assert not {t.task_id for t in test} & {t.task_id for t in train}
    assert all(verify(t, t.reference_patch).passed for t in train + test)


def test_toy_tasks_registered_config_via_data_source(tmp_path):
    ds = tfds.data_source("toy_tasks/d1", data_dir=str(tmp_path))
    assert (len(ds["train"]), len(ds["test"])) == (1000, 200)
    task = B.toy_task_from_record(ds["train"][7])
    assert task == ToyTaskGenerator(0, 1).task(7)


def test_toy_tasks_bad_config(tmp_path):
    cfg = B.ToyTasksConfig(name="bad", difficulty=7)
    with pytest.raises(ValueError, match="difficulty"):
        B.ToyTasks(config=cfg, data_dir=str(tmp_path)).download_and_prepare()


def _write_jsonl(path, tasks):
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(t.to_dict()) + "\n")


def test_repo_tasks_from_jsonl_and_verify(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    statkit = RepoTask.from_dir(os.path.join(FIXTURES, "statkit"))
    slugger = RepoTask.from_dir(os.path.join(FIXTURES, "slugger"))
    _write_jsonl(manual / "train.jsonl", [statkit, slugger])
    _write_jsonl(manual / "test.jsonl", [slugger])
    builder = B.RepoTasks(data_dir=str(tmp_path / "data"))
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
    ds = tfds.data_source("repo_tasks", data_dir=str(tmp_path / "data"))
    assert set(ds) == {"train", "test"}
    train = [B.repo_task_from_record(r) for r in ds["train"]]
    assert train == [statkit, slugger]  # JSONL order, every field (hidden test_patch too)
    assert B.repo_task_from_record(ds["test"][0]) == slugger
    # A task read back from TFDS verifies in the sandbox like the original.
    with open(os.path.join(FIXTURES, "slugger", "patches", "minimal.diff")) as f:
        assert verify_repo_patch(train[1], f.read()).status == "passed"


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "train.jsonl:2"),
        (json.dumps({"task_id": "x", "issue": "", "files": {"a.py": ""}}), "fail_to_pass"),
        (
            json.dumps(
                {"task_id": "x", "issue": "", "files": {"a.py": ""}, "fail_to_pass": ["t.py"]}
            ),
            "not 'file::name'",
        ),
    ],
)
def test_repo_tasks_bad_lines_fail_the_build(tmp_path, line, msg):
    manual = tmp_path / "manual"
    manual.mkdir()
    good = RepoTask.from_dir(os.path.join(FIXTURES, "statkit"))
    (manual / "train.jsonl").write_text(json.dumps(good.to_dict()) + "\n" + line + "\n")
    builder = B.RepoTasks(data_dir=str(tmp_path / "data"))
    with pytest.raises(Exception, match=msg):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual)
        )


def test_repo_tasks_without_jsonl(tmp_path):
    builder = B.RepoTasks(data_dir=str(tmp_path / "data"))
    with pytest.raises(Exception, match="train.jsonl"):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=tmp_path)
        )


def test_repo_tasks_audit_fields_round_trip(tmp_path):
    """A pool built with audit results and pass rates reads them back; others get defaults."""
    from gagar_jax.data import audit as A

    statkit = RepoTask.from_dir(os.path.join(FIXTURES, "statkit"))
    slugger = RepoTask.from_dir(os.path.join(FIXTURES, "slugger"))
    report = A.AuditReport(
        statkit.task_id,
        False,
        ("flaky", "leaks_solution"),
        (A.AuditRun("gold", 0, "passed", {"t::a": "passed"}),),
        {"flaky": "t::a"},
    )
    vote = A.AuditVote(2, 1, "15m-1h", "bug_fix", (A.AuditEvidence("issue", quote="the mean"),))
    audit = A.TaskAudit(statkit.task_id, vote, (vote, vote), 1, "max_severity", "v1", ("x",))
    entry = A.PoolEntry(statkit, report, audit, (True, False, True, True))
    manual = tmp_path / "manual"
    manual.mkdir()
    # train: a save_pool line (statkit, with results) and a task without any (other);
    # test: a bare slugger whose attempts and failed audit come from audit.jsonl
    other = dataclasses.replace(slugger, task_id="slugger-copy")
    A.save_pool(manual / "train.jsonl", [entry, A.PoolEntry(other)])
    _write_jsonl(manual / "test.jsonl", [slugger])
    fell_back = A.TaskAudit(slugger.task_id, None, (), 3, "majority", "v1", ("schema",))
    with open(manual / "audit.jsonl", "w") as f:
        f.write(
            json.dumps(
                {
                    "task_id": slugger.task_id,
                    "audit": fell_back.to_dict(),
                    "attempts": [False, False],
                }
            )
            + "\n"
        )
    builder = B.RepoTasks(data_dir=str(tmp_path / "data"))
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual))
    ds = tfds.data_source("repo_tasks", data_dir=str(tmp_path / "data"))
    r0, r1 = ds["train"][0], ds["train"][1]
    assert B.repo_task_from_record(r0) == statkit
    assert B.audit_from_record(r0) == {
        "precheck_ran": True,
        "precheck_ok": False,
        "precheck_reasons": ["flaky", "leaks_solution"],
        "audit_ok": True,
        "underspecification": 2,
        "test_validity": 1,
        "audit_difficulty": "15m-1h",
        "audit_category": "bug_fix",
        "audit_prompt_version": "v1",
        "pass_rate": 0.75,
        "num_attempts": 4,
        "attempts": [True, False, True, True],
        "precheck_json": json.dumps(report.to_dict(), sort_keys=True),
        "audit_json": json.dumps(audit.to_dict(), sort_keys=True),
    }
    back = B.pool_entry_from_record(r0)
    assert (back.task, back.precheck, back.audit, back.attempts) == (
        statkit,
        report,
        audit,
        entry.attempts,
    )
    # no audit results: exactly the documented defaults
    assert B.audit_from_record(r1) == B.AUDIT_DEFAULTS
    assert B.pool_entry_from_record(r1) == A.PoolEntry(other)
    t = B.audit_from_record(ds["test"][0])
    assert (t["audit_ok"], t["audit_prompt_version"], t["underspecification"]) == (False, "v1", -1)
    assert (t["pass_rate"], t["num_attempts"], t["precheck_ran"]) == (0.0, 2, False)
    # the built pool filters by its stored results
    pool = [B.pool_entry_from_record(r) for r in ds["train"]]
    kept, rep = A.filter_tasks(pool, {"require_precheck": True})
    assert kept == [] and rep["reasons"] == {
        "precheck:flaky": 1,
        "precheck:leaks_solution": 1,
        "precheck:missing": 1,
    }
    kept, _ = A.filter_tasks(pool, {"max_underspecification": 1})
    assert [e.task_id for e in kept] == [other.task_id]


def test_repo_tasks_bad_audit_line_fails_the_build(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    _write_jsonl(manual / "train.jsonl", [RepoTask.from_dir(os.path.join(FIXTURES, "slugger"))])
    (manual / "audit.jsonl").write_text('{"attempts": [true]}\n')
    with pytest.raises(ValueError, match="audit.jsonl:1.*task_id"):
        B.RepoTasks(data_dir=str(tmp_path / "data")).download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual)
        )


def test_toy_tasks_audit_fields_from_audit_path(tmp_path):
    from gagar_jax.data import audit as A

    tasks = ToyTaskGenerator(2, 1).tasks(3)
    path = tmp_path / "audit.jsonl"
    A.save_pool(path, [A.PoolEntry(tasks[1], attempts=(True,) * 4)])
    cfg = B.ToyTasksConfig(name="aud", seed=2, num_train=3, num_test=1, audit_path=str(path))
    builder = B.ToyTasks(config=cfg, data_dir=str(tmp_path / "data"))
    builder.download_and_prepare()
    src = builder.as_data_source()["train"]
    assert [B.toy_task_from_record(r) for r in src] == tasks
    assert B.audit_from_record(src[0]) == B.AUDIT_DEFAULTS
    got = B.audit_from_record(src[1])
    assert (got["pass_rate"], got["num_attempts"], got["precheck_ran"]) == (1.0, 4, False)
    pool = [B.pool_entry_from_record(r, B.toy_task_from_record) for r in src]
    kept, rep = A.filter_tasks(pool, {"skip_saturated": {"window": 4, "min_attempts": 4}})
    assert [e.task for e in kept] == [tasks[0], tasks[2]]
    assert rep["reasons"] == {"saturated:pass_rate=1": 1}
