"""The execution back-end without a cluster: the local back-end, isolated calls killed at their
deadline with their whole tree, per-node environments under a lock, the token bucket, config."""

import os
import subprocess
import sys
import threading
import time

import execution_faults as faults
import pytest

from gagar_jax.rl.config import ConfigError, ExecutionConfig, RunConfig
from gagar_jax.verify import execution
from gagar_jax.verify.repo import env_site_packages


def _add(a, b):
    return a + b


def _boom():
    raise KeyError("bug in the call")


def test_local_backend_runs_calls_in_the_callers_thread_and_masks_a_raising_call():
    b = execution.LocalBackend()
    r = b.call(_add, 2, 3)
    assert r.ok and r.value == 5 and r.attempts == 1
    r = b.call(_boom)
    assert r.status == "infra_error" and "KeyError" in r.error and r.value is None
    m = b.metrics()
    assert m["execution/calls"] == 2 and m["execution/infra_errors"] == 1
    assert b.metrics()["execution/calls"] == 0  # per step: reset by the read
    assert b.gather([lambda: 1, lambda: 2]) == [1, 2]
    assert b.gather_groups([[lambda: 1, lambda: 2], [lambda: 3]]) == [[1, 2], [3]]


def test_the_process_backend_is_local_until_one_is_installed():
    assert isinstance(execution.current(), execution.LocalBackend)
    mine = execution.LocalBackend()
    with execution.using(mine):
        assert execution.current() is mine
    assert execution.current() is not mine


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc process trees")
def test_isolated_call_is_killed_at_its_deadline_with_its_escapee_and_leaves_no_directory():
    import ray  # noqa: F401  # cloudpickle for a function defined in a test module

    tag = f"{time.monotonic_ns() % 10**6}.25"
    before = set(execution.call_dirs())
    b = execution.LocalBackend(isolate=True)
    t0 = time.monotonic()
    r = b.call(faults.hang_with_escapee, tag, deadline_s=3.0)
    assert r.status == "timeout" and "deadline" in r.error
    assert time.monotonic() - t0 < 3.0 + 20.0
    assert r.reaped >= 1  # the setsid sleep was found in its own session and killed
    end = time.monotonic() + 5
    while faults.marked_processes(tag) and time.monotonic() < end:
        time.sleep(0.1)
    assert faults.marked_processes(tag) == []
    assert set(execution.call_dirs()) - before == set()
    assert b.call(_add, 1, 1).value == 2  # by reference: needs no cloudpickle


def test_kill_tree_reaches_descendants_in_other_sessions():
    n = time.monotonic_ns() % 10**6
    tag = f"{n}.75"  # the parent's command line holds n, not the tag
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; subprocess.Popen(['sleep', "
            f"str({n}) + '.75'], start_new_session=True); time.sleep(60)",
        ],
        start_new_session=True,
    )
    end = time.monotonic() + 10
    while not faults.marked_processes(tag):
        assert time.monotonic() < end
        time.sleep(0.05)
    assert execution.kill_tree(parent.pid) >= 1
    parent.wait(timeout=5)
    time.sleep(0.2)
    assert faults.marked_processes(tag) == []


def test_stale_call_directories_of_dead_workers_are_reaped(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{execution.CALL_DIR_PREFIX}{dead.pid}_x"
    live = tmp_path / f"{execution.CALL_DIR_PREFIX}{os.getpid()}_y"
    for d in (stale, live):
        (d / "gagar_repo_z").mkdir(parents=True)
    assert execution.reap_stale_call_dirs(str(tmp_path)) == 1
    assert not stale.exists() and live.exists()


def test_environment_built_once_under_a_lock_and_rebuilt_after_a_failure(tmp_path):
    builds = []

    def build(path):
        builds.append(path)
        time.sleep(0.2)
        with open(os.path.join(path, "ok"), "w") as f:
            f.write("1")

    out = []
    threads = [
        threading.Thread(
            target=lambda: out.append(execution.ensure_env("h1", build, cache_dir=str(tmp_path)))
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(set(out)) == 1
    assert os.path.exists(os.path.join(out[0], "ok"))

    def broken(path):
        with open(os.path.join(path, "half"), "w") as f:
            f.write("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        execution.ensure_env("h2", broken, cache_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["h1", "h1.lock", "h1.ready", "h2.lock"]
    assert os.path.isdir(execution.ensure_env("h2", build, cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="env_hash"):
        execution.ensure_env("../x", build, cache_dir=str(tmp_path))


def test_token_bucket_spaces_requests_at_its_rate():
    bucket = execution.TokenBucket(rate=10.0, burst=2)
    waits = [bucket.reserve() for _ in range(6)]
    # two tokens in the burst, then one every 0.1 s: waits 0, 0, 0.1, 0.2, 0.3, 0.4 (+- timing)
    assert waits[:2] == [0.0, 0.0]
    assert all(abs(w - 0.1 * (i - 1)) < 0.05 for i, w in enumerate(waits[2:], start=2))
    with pytest.raises(ValueError, match="rate"):
        execution.TokenBucket(rate=0)


def test_local_rate_limit_applies_through_use():
    with execution.using(execution.LocalBackend(llm_requests_per_s=20.0)):
        t0 = time.monotonic()
        for _ in range(5):
            execution.llm_rate_limit()
        assert time.monotonic() - t0 >= 4 / 20.0 - 0.02
    assert execution.llm_rate_limit() == 0.0  # no limiter installed: no wait


def test_call_resources_validate_and_become_ray_options():
    r = execution.CallResources(num_cpus=2, memory=1 << 30, resources={"verifier": 1})
    assert r.ray_options() == {"num_cpus": 2, "memory": 1 << 30, "resources": {"verifier": 1}}
    with pytest.raises(ValueError, match="memory"):
        execution.CallResources(memory=1.5)
    with pytest.raises(ValueError, match="resources"):
        execution.CallResources(resources={"verifier": -1})


def test_execution_config_validates_and_is_not_in_the_fingerprint():
    base = RunConfig()
    ray = RunConfig(
        execution=ExecutionConfig(
            backend="ray", ray_address="10.0.0.1:6379", resources={"verifier": 1}
        )
    )
    assert ray.execution.resources == (("verifier", 1),)
    assert ray.fingerprint() == base.fingerprint()  # deployment, not the run
    assert RunConfig.from_config_dict(ray.to_dict()).execution == ray.execution
    for field, value, match in [
        ("backend", "dask", "execution.backend"),
        ("max_inflight", 0, "execution.max_inflight"),
        ("memory", -1, "execution.memory"),
        ("resources", {"verifier": -2}, "execution.resources"),
        ("llm_requests_per_s", -1.0, "execution.llm_requests_per_s"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ExecutionConfig(**{field: value})
    with pytest.raises(ConfigError, match="execution.max_inflight"):
        RunConfig(execution=ExecutionConfig(backend="ray", max_inflight=4))  # K = 8 > 4
    with pytest.raises(ValueError, match="execution.backend"):
        execution.make_backend("dask")


def test_a_nodes_copy_of_a_task_environment_is_built_from_its_lockfile_once(tmp_path):
    """The trainer's environment (resolved and built by ``build_env``) rebuilt in another
    cache, as a node does: from the recorded lockfile, once for four concurrent callers, with
    the same packages; a node whose interpreter differs refuses to build it."""
    from gagar_jax.data import repos

    env = repos.build_env(["cachetools==5.5.0"], cache_dir=str(tmp_path / "trainer"))
    builder = repos.node_env_builder(env.path, env.env_hash)
    assert builder.lockfile == env.lockfile and "cachetools==5.5.0" in builder.lockfile
    node_cache = str(tmp_path / "node")
    out, built = [], []

    def one():
        path, secs = execution._ensure_env(env.env_hash, builder, node_cache)
        out.append(path)
        built.append(secs is not None)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and sum(built) == 1, (out, built)
    (site,) = env_site_packages(out[0])
    assert os.path.isdir(os.path.join(site, "cachetools"))
    with open(os.path.join(out[0], ".gagar-env")) as f:
        assert f'"env_hash": "{env.env_hash}"' in f.read()
    alien = repos.LockfileEnv(env.env_hash, env.lockfile, "2.7.18 (default)")
    with pytest.raises(repos.EnvBuildError, match="Python 2.7.18"):
        execution.ensure_env("alien", alien, cache_dir=node_cache)
    assert not os.path.exists(os.path.join(node_cache, "alien"))
    with pytest.raises(repos.EnvBuildError, match="no readable record"):
        repos.node_env_builder(str(tmp_path / "nowhere"), "f" * 32)
