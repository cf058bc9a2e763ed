"""The shell workspace: a sandboxed checkout per episode, the ``bash`` tool, the final diff and
``task.tools = "bash"`` in the python_repo family (real bwrap sandbox, real verifier)."""

import os
import subprocess

import pytest

from gagar_jax.envs.family import Attempt, FamilySettings, make_family
from gagar_jax.envs.hf_tokenizer import tool_call_text
from gagar_jax.envs.repo import RepoTask
from gagar_jax.envs.shell import ShellAgentEnv, ShellLimits, ShellWorkspace, bash_calls
from gagar_jax.verify.diff import apply_unified_diff
from tests.hf_fixtures import FIXTURE_REPOS, fixture_pool, make_tiny_tokenizer

FILES = {
    "a.py": "x = 1\n",
    "tests/test_a.py": "from a import x\n\ndef test():\n    assert x == 2\n",
}


@pytest.fixture
def ws():
    w = ShellWorkspace(FILES, limits=ShellLimits(command_wall_s=10, output_chars=300))
    yield w
    w.close()


def test_bash_edits_the_checkout_and_the_diff_is_the_patch(ws):
    r = ws.run("python -m pytest -q 2>&1 | tail -1")
    assert r.exit_code == 0 and "1 failed" in r.stdout
    r = ws.run("sed -i 's/x = 1/x = 2/' a.py && python -m pytest -q 2>&1 | tail -1; exit 3")
    assert r.exit_code == 3 and "1 passed" in r.stdout and r.observation.startswith("exit code: 3")
    d = ws.diff()
    assert d.ok and apply_unified_diff(FILES, d.patch) == {**FILES, "a.py": "x = 2\n"}
    ws.run("rm tests/test_a.py; mkdir -p pkg && echo 'y = 3' > pkg/new.py")
    after = apply_unified_diff(FILES, ws.diff().patch)
    assert after == {"a.py": "x = 2\n", "pkg/new.py": "y = 3\n"}


def test_output_is_cut_with_a_note_and_errors_show(ws):
    r = ws.run("python -c \"print('y' * 5000)\"; echo oops >&2; false")
    assert r.exit_code == 1 and "[... stdout cut: 4701 of 5001 chars ...]" in r.observation
    assert r.stderr.strip() == "oops"


def test_a_command_is_killed_at_its_time_limit_and_leaves_no_process(tmp_path):
    w = ShellWorkspace(FILES, limits=ShellLimits(command_wall_s=2))
    try:
        r = w.run("sleep 60")
        assert r.status == "timeout" and r.observation.startswith("command timed out after 2 s")
        w.run("(setsid sleep 300 &) ; nohup sleep 300 >/dev/null 2>&1 &")
        # nothing of the sandbox uids survives the command, on the host's view
        ps = subprocess.run(["ps", "-eo", "uid=,args="], capture_output=True, text=True).stdout
        assert not [ln for ln in ps.splitlines() if "sleep 300" in ln]
    finally:
        w.close()


def test_no_network_no_writes_outside_and_a_disk_quota(ws):
    r = ws.run(
        "python -c \"import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)\""
    )
    assert r.exit_code != 0 and ("unreachable" in r.stderr or "refused" in r.stderr)
    marker = f"/tmp/gagar_shell_escape_{os.getpid()}"
    r = ws.run(f"touch /usr/escape; echo x > {marker}; touch ../../escape; echo done")
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    assert not os.path.exists(marker) and not os.path.exists("/usr/escape")
    assert not os.path.exists(os.path.join(os.path.dirname(ws.root), "escape"))
    small = ShellWorkspace(FILES, limits=ShellLimits(disk_bytes=8 << 20))
    try:
        r = small.run("head -c 20000000 /dev/zero > big; echo rc=$?")
        if small.quota == "tmpfs":  # a hard quota across commands (root: a tmpfs per episode)
            assert "No space left on device" in r.stderr
        else:  # the sandbox's accounting kills the command
            assert r.status == "resource_killed"
    finally:
        small.close()


def test_the_diff_refuses_what_a_patch_cannot_carry(ws):
    ws.run("printf 'a\\000b' > blob.bin; chmod +x a.py; ln -s /etc/passwd out; ln -s a.py in")
    d = ws.diff()
    reasons = dict(d.refused)
    assert not d.ok and d.patch == ""
    assert reasons["blob.bin"] == "binary file"
    assert reasons["a.py"].startswith("mode change to 0755")
    assert "leaves the tree" in reasons["out"] and "leaves the tree" not in reasons["in"]
    env = ShellAgentEnv(ws)
    done = env.step(tool_call_text("submit", {}))
    assert done.done and done.observation.startswith("diff refused: ")
    assert env.refused == d.refused


def test_bash_family_verifies_the_workspace_diff_without_showing_hidden_tests(tmp_path):
    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    settings = FamilySettings(
        data_path=fixture_pool(tmp_path / "pool.jsonl"),
        tokenizer_path=tok_dir,
        num_eval=0,
        max_prompt_len=1024,
        extra={"tools": "bash"},
    )
    fam = make_family("python_repo", settings)
    task = fam.train_task(0)
    text = fam.tokenizer.decode(fam.prompt_tokens(task), skip_special_tokens=False)
    assert '"name": "bash"' in text and '"name": "read_file"' not in text
    env = fam.make_env(task)
    hidden = (FIXTURE_REPOS / "slugger" / "test_patch.diff").read_text()
    added = [ln[1:] for ln in hidden.splitlines() if ln.startswith("+") and "def test" in ln]
    r = env.workspace.run("grep -rn 'def test' . || true")
    assert added and not any(a.strip() in r.stdout for a in added)
    for name, args in fam.demonstration_calls(task):
        result = env.step(tool_call_text(name, args))
    assert result.done and env.submitted and env.refused == ()
    out = fam.verify(task, Attempt(env=env))
    assert out.passed, out.test_log
    assert env.workspace.closed
    # A tree the patch cannot carry fails with the reason, unverified.
    env2 = fam.make_env(task)
    env2.step(tool_call_text("bash", {"command": "chmod +x $(ls *.py */*.py | head -1)"}))
    env2.step(tool_call_text("submit", {}))
    bad = fam.verify(task, Attempt(env=env2))
    assert not bad.passed and bad.test_log.startswith("workspace diff refused: ")
    assert bash_calls([("run_tests", {})]) == [
        ("bash", {"command": "python -m pytest -q 2>&1 | tail -20"})
    ]


def test_repo_task_fixture_layout_is_what_the_family_reads():
    task = RepoTask.from_dir(FIXTURE_REPOS / "slugger")
    assert task.test_patch and all("test_patch" not in p for p in task.files)
