"""The checks ``make e2e`` applies to the factory-made task's records (scripts/e2e.py)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e_script", f"{ROOT}/scripts/e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SITE = "/envs/h1/lib/python3.11/site-packages"
EXPECT = {"pypi__x.0001": {"env_hash": "h1", "env_path": "/envs/h1", "site": [SITE], "tree": "t1"}}


def _run(**kw):
    r = {
        "kind": "verify",
        "phase": "rollout",
        "task_id": "pypi__x.0001",
        "status": "failed",
        "env_hash": "h1",
        "env_path": "/envs/h1",
        "sandbox_pythonpath": [SITE],
        "tree": "t1",
    }
    return {**r, **kw}


GRADE = {
    "kind": "grade",
    "group_id": "g0",
    "task_id": "pypi__x.0001",
    "tree": "t1",
    "env_path": "/envs/h1",
    "check_pythonpath": f"{SITE}:.:src",
}


def test_factory_checks_pass_on_sound_records_and_name_each_fault():
    from gagar_jax.verify.sandbox import python_for_sandbox

    check = _e2e().check_factory
    assert check([_run(), GRADE], EXPECT) == []
    # a call the back-end ended without a sandboxed run is not evidence either way
    assert check([_run(), _run(status="timeout", sandbox_pythonpath=[]), GRADE], EXPECT) == []
    # on a Ray node: that node's copy of the same environment
    node = ["/ray/node/envs/h1/lib/python3.11/site-packages"]
    assert check([_run(sandbox_pythonpath=node), GRADE], EXPECT) == []
    own = list(python_for_sandbox()[1])
    faults = {
        "no rollout of the factory tasks": [_run(phase="demonstration"), GRADE],
        "was verified in the sandbox": [_run(kind="run_tests"), GRADE],
        "infrastructure error": [_run(status="infra_error"), GRADE],
        "not its environment": [_run(sandbox_pythonpath=own), GRADE],
        "ran on": [_run(sandbox_pythonpath=["/envs/h2/lib/python3.11/site-packages"]), GRADE],
        "not the tree materialised": [_run(tree="t2"), GRADE],
        "was graded": [_run()],
        "grading of g0: not the materialised tree": [_run(), {**GRADE, "tree": "t2"}],
        "checks without its environment": [_run(), {**GRADE, "check_pythonpath": ".:src"}],
    }
    for fault, records in faults.items():
        problems = check(records, EXPECT)
        assert any(fault in p for p in problems), (fault, problems)
