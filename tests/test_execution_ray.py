"""Fault injection on a simulated Ray cluster: verification, tools and grading on the nodes.

One ``ray.cluster_utils.Cluster`` per module (a head without CPUs and two worker nodes that
advertise the ``verifier`` resource, each with a 100 MB object store, no dashboard); each test
injects one fault and asserts the invariants: a verdict or a counted fallback within the
deadline plus a margin, the same verdicts (and update batch) as the ``local`` back-end, no
``infra_error`` scored 0, and no orphan process or temporary directory.
"""

import dataclasses
import functools
import json
import os
import tempfile
import threading
import time

import execution_faults as faults  # noqa: E402
import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster  # noqa: E402

from gagar_jax.envs.family import Attempt, Outcome  # noqa: E402
from gagar_jax.envs.repo import RepoTask  # noqa: E402
from gagar_jax.grading import GradingPool  # noqa: E402
from gagar_jax.grading.schema import FallbackReason  # noqa: E402
from gagar_jax.rl.collect import Group, _rollout, pack_groups  # noqa: E402
from gagar_jax.verify import execution  # noqa: E402
from gagar_jax.verify.sandbox import Limits  # noqa: E402

pytestmark = pytest.mark.ray

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(HERE, "fixtures", "repos")
LIMITS = Limits(wall_s=60, cpu_s=60, memory_bytes=512 << 20, nproc=64)
MARGIN_S = 30.0  # scheduling and process start on a loaded 2-core machine
STORE = 100 << 20


def _task(name):
    return RepoTask.from_dir(os.path.join(FIXTURES, name))


def _patch(name, kind):
    with open(os.path.join(FIXTURES, name, "patches", f"{kind}.diff")) as f:
        return f.read()


def _node_args(name, tmp):
    return dict(
        num_cpus=1,
        resources={"verifier": 1},
        object_store_memory=STORE,
        env_vars={
            "GAGAR_TEST_NODE": name,
            "GAGAR_ENV_CACHE": os.path.join(tmp, f"envs-{name}"),
            "PYTHONPATH": os.pathsep.join([HERE, ROOT]),
        },
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ray_cluster"))
    c = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=0, object_store_memory=STORE, include_dashboard=False),
    )
    nodes = [c.add_node(**_node_args(f"w{i}", tmp)) for i in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, namespace=execution.RAY_NAMESPACE)
    try:
        yield c, nodes, tmp
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def backend(cluster):
    b = execution.RayBackend(
        max_inflight=4,
        max_retries=3,
        deadline_grace_s=5.0,
        resources=execution.CallResources(1.0, 0, {"verifier": 1}),
    )
    yield b
    b.close()


@pytest.fixture
def no_orphans():
    """Lists the tests' marked processes and the calls' temporary directories before and after."""
    tmp = tempfile.gettempdir()

    def dirs():  # every temporary directory of a call lives in its call directory
        return {n for n in os.listdir(tmp) if n.startswith(execution.CALL_DIR_PREFIX)}

    before = dirs()
    assert not faults.marked_processes(faults.HANG_MARK, faults.GRADER_MARK)
    yield
    end = time.monotonic() + 10  # a killed tree takes a moment to vanish from /proc
    while time.monotonic() < end and (
        faults.marked_processes(faults.HANG_MARK, faults.GRADER_MARK) or dirs() - before
    ):
        time.sleep(0.2)
    assert faults.marked_processes(faults.HANG_MARK, faults.GRADER_MARK) == []
    assert dirs() - before == set()


class _RepoFamily:
    """The part of the python_repo family the loop's ``_rollout`` uses: a rollout's response
    is its patch, verified through the current back-end (by ``fn``: ``verify_repo_patch``'s
    signature, default that function)."""

    def __init__(self, fn=None):
        self.fn = fn

    def verify(self, task, attempt):
        v = execution.verify_repo_call(task, attempt.text, limits=LIMITS, fn=self.fn)
        return Outcome(
            passed=v.passed,
            infra_error=v.infra_error,
            cheat=v.cheat,
            test_log=v.test_log,
            flags=tuple(v.flags),
            patch=attempt.text,
            detail=v,
        )


def _groups(backend, spec, fam=None):
    """Groups of rollouts verified on ``backend`` (the loop's gather_groups + _rollout)."""
    fam = fam or _RepoFamily()
    thunks = [
        [
            (
                lambda t=task, p=patch, k=k: _rollout(
                    fam,
                    t,
                    [1, 2, 3],
                    Attempt(response_tokens=[4 + k, 5], text=p),
                    response_tokens=[4 + k, 5],
                    logprobs=[-0.5, -0.25],
                    finish_reason="stop",
                    policy_version=0,
                )
            )
            for k, patch in enumerate(patches)
        ]
        for task, patches in spec
    ]
    with execution.using(backend):
        verified = backend.gather_groups(thunks, grader=1)
    return [Group(f"g{i}", task, rs) for i, ((task, _), rs) in enumerate(zip(spec, verified))]


def _verdicts(groups):
    return [
        [
            (
                r.outcome.detail.status,
                tuple(sorted(r.outcome.detail.tests.items())),
                r.passed,
                r.cheat,
                r.infra_error,
            )
            for r in g.rollouts
        ]
        for g in groups
    ]


def _pack(groups):
    return pack_groups(
        groups,
        num_groups=len(groups),
        num_rollouts=len(groups[0].rollouts),
        max_prompt_len=4,
        max_new_tokens=4,
        pad_id=0,
    )


def _spec():
    s, g = _task("statkit"), _task("slugger")
    return [
        (
            s,
            [
                "",
                _patch("statkit", "minimal"),
                _patch("statkit", "edit_tests"),
                _patch("statkit", "sprawling"),
            ],
        ),
        (
            g,
            [
                _patch("slugger", "minimal"),
                "",
                _patch("slugger", "special_case"),
                _patch("slugger", "network"),
            ],
        ),
    ]


@pytest.fixture(scope="module")
def local_reference():
    """The local back-end's verdicts and update batch on the same rollouts."""
    groups = _groups(execution.LocalBackend(), _spec())
    return _verdicts(groups), _pack(groups)


def _assert_same_batch(a, b):
    for name in a._fields:  # UpdateBatch: a NamedTuple of arrays
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is y, name
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


# ---------------------------------------------------------------------------------------------
def test_node_killed_in_the_middle_of_a_group(
    cluster, backend, local_reference, no_orphans, tmp_path
):
    """A third node takes part of a group and is killed while its calls run: they are retried on
    the others, every member gets the verdict the local back-end gives, the loss is counted."""
    c, _, tmp = cluster
    victim = c.add_node(**_node_args("victim", tmp))
    c.wait_for_nodes()
    markers = str(tmp_path)
    # each verification first leaves a marker naming its node and waits 3 s: the window in
    # which the victim is killed
    fam = _RepoFamily(functools.partial(faults.marked_verify, markers, 3.0))
    out: dict = {}
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: out.update(groups=_groups(backend, _spec(), fam)))
    worker.start()
    end = time.monotonic() + 60
    while not any(n.startswith("victim.") for n in os.listdir(markers)):
        assert time.monotonic() < end, "no call reached the victim node"
        time.sleep(0.1)
    c.remove_node(victim, allow_graceful=False)
    worker.join(timeout=2 * (LIMITS.wall_s + 3 * MARGIN_S))
    elapsed = time.monotonic() - t0
    assert not worker.is_alive() and "groups" in out
    groups = out["groups"]
    # every member has the local back-end's verdict, so the update batch is the same
    assert _verdicts(groups) == local_reference[0]
    assert all(len(g.rollouts) == 4 and not any(r.infra_error for r in g.rollouts) for g in groups)
    _assert_same_batch(_pack(groups), local_reference[1])
    assert elapsed < 2 * (LIMITS.wall_s + 3 * MARGIN_S)  # two groups, one after the other
    m1 = backend.metrics()
    assert m1["execution/retries"] >= 1 and m1["execution/infra_errors"] == 0, m1
    # the cluster declares the node dead (missed heartbeats); the next calls on the survivors
    # reap what the killed calls left in the (here shared) temporary directory
    end = time.monotonic() + 90
    while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == victim.node_id):
        assert time.monotonic() < end, "the killed node is never declared dead"
        time.sleep(0.5)
    groups = _groups(backend, _spec()[:1])
    assert _verdicts(groups) == local_reference[0][:1]
    m2 = backend.metrics()
    assert m2["execution/infra_errors"] == 0, m2
    # counted once, by the first look after the cluster declared it dead
    assert m1["execution/node_losses"] + m2["execution/node_losses"] == 1, (m1, m2)


def test_verdicts_and_update_batch_equal_the_local_backend(backend, local_reference, no_orphans):
    groups = _groups(backend, _spec())
    assert _verdicts(groups) == local_reference[0]
    assert all(len(g.rollouts) == 4 for g in groups)  # no group with a member missing
    _assert_same_batch(_pack(groups), local_reference[1])
    m = backend.metrics()
    assert m["execution/calls"] == 8 and m["execution/calls_in_flight_max"] <= 4, m


def test_hung_sandbox_is_killed_at_its_deadline_as_the_rollouts_timeout(backend, no_orphans):
    """The code under test starts a setsid escapee and sleeps: the call is killed at its
    deadline with its whole tree; the rollout fails with ``timeout`` (its own fault, scored),
    never ``infra_error``."""
    task = _task("statkit")
    deadline = 6.0
    t0 = time.monotonic()
    with execution.using(backend):
        v = execution.verify_repo_call(
            task, faults.hanging_patch(task, "statkit/stats.py"), limits=LIMITS, deadline_s=deadline
        )
    assert v.status == "timeout" and not v.infra_error and not v.passed, v.test_log
    assert time.monotonic() - t0 < deadline + MARGIN_S
    # a bare call that hangs outside any sandbox is ended the same way
    r = backend.call(faults.hang_with_escapee, deadline_s=3.0)
    assert r.status == "timeout" and r.reaped >= 1, r
    assert backend.metrics()["execution/orphans_reaped"] >= 1


def test_grader_that_never_answers_falls_back_at_its_deadline(backend, no_orphans):
    """Graded on the cluster, a grader that never answers is killed with its children at the
    pool's deadline; the group falls back (``deadline``, counted) instead of waiting."""
    from gagar_jax.envs import repo as envs_repo

    task = _task("statkit")
    cands = [
        envs_repo.repo_candidate(f"r{k}", p, execution.verify_repo_call(task, p, limits=LIMITS))
        for k, p in enumerate(["", _patch("statkit", "minimal")])
    ]
    ws = envs_repo.repo_workspace(task, "g-hang", cands)
    pool = GradingPool(faults.HangingGrader(), max_concurrency=1, deadline_s=4.0, backend=backend)
    t0 = time.monotonic()
    try:
        pool.submit(ws)
        (res,) = pool.results(["g-hang"], timeout=4.0 + MARGIN_S)
    finally:
        pool.close()
    assert res.verdict is None and res.fallback_reason == FallbackReason.DEADLINE
    assert time.monotonic() - t0 < 4.0 + MARGIN_S
    assert pool.metrics()["fallback/deadline"] == 1
    end = time.monotonic() + 20  # the call itself ends at the same deadline: nothing abandoned
    while backend.metrics(reset=False)["execution/calls_in_flight"] and time.monotonic() < end:
        time.sleep(0.2)
    assert backend.metrics()["execution/timeouts"] == 1


def test_verifier_over_its_memory_limit_fails_the_rollout_not_the_node(backend, no_orphans):
    """Code that allocates 1.5 GiB under a 512 MiB limit: the sandbox kills it; the verdict
    (a failure of the code, not infra_error) is the local back-end's, the node lives on."""
    task = _task("statkit")
    patch = faults.memory_hog_patch(task, "statkit/stats.py")
    local = execution.verify_repo_call(task, patch, backend=execution.LocalBackend(), limits=LIMITS)
    t0 = time.monotonic()
    remote = execution.verify_repo_call(task, patch, backend=backend, limits=LIMITS)
    assert time.monotonic() - t0 < LIMITS.wall_s + MARGIN_S  # its verdict within its deadline
    assert local.status in ("resource_killed", "failed") and not local.infra_error
    assert (remote.status, remote.tests) == (local.status, local.tests)
    ok = execution.verify_repo_call(
        task, _patch("statkit", "minimal"), backend=backend, limits=LIMITS
    )
    assert ok.status == "passed"  # the node still verifies
    m = backend.metrics()
    assert m["execution/retries"] == 0 and m["execution/infra_errors"] == 0


def test_node_start_that_fails_three_times(cluster, no_orphans, tmp_path):
    """The environment a call needs fails to build three times (injected): with three retries
    the fourth attempt verifies it, identically; with two the call is infra_error, masked out
    of the update batch (never a 0 reward), and counted."""
    _, _, tmp = cluster
    task = _task("statkit")
    patch = _patch("statkit", "minimal")
    env = execution.EnvSpec("env-flaky-a", faults.flaky_build(str(tmp_path / "a"), fails=3))
    t0 = time.monotonic()
    with execution.RayBackend(max_retries=3, deadline_grace_s=5.0) as b:
        v = execution.verify_repo_call(task, patch, backend=b, limits=LIMITS, env=env)
        m = b.metrics()
    assert v.status == "passed" and m["execution/retries"] == 3, (v.test_log, m)
    assert time.monotonic() - t0 < LIMITS.wall_s + MARGIN_S  # three failed starts are quick

    env = execution.EnvSpec("env-flaky-b", faults.flaky_build(str(tmp_path / "b"), fails=3))
    with execution.RayBackend(max_retries=2, deadline_grace_s=5.0) as b:
        with execution.using(b):
            rs = [
                _rollout(
                    fam,
                    task,
                    [1, 2],
                    Attempt(text=p),
                    response_tokens=[3],
                    logprobs=[-1.0],
                    finish_reason="stop",
                    policy_version=0,
                )
                for fam, p in (
                    (_EnvFamily(env), patch),
                    (_RepoFamily(), ""),
                    (_RepoFamily(), patch),
                )
            ]
        m = b.metrics()
    assert rs[0].infra_error and not rs[0].passed and m["execution/infra_errors"] == 1
    assert m["execution/retries"] == 2
    batch = _pack([Group("g", task, rs)])
    assert not np.asarray(batch.valid)[0, 0] and np.asarray(batch.valid)[0, 1:].all()
    assert list(np.asarray(batch.rewards)[0, 1:]) == [0.0, 1.0]


class _EnvFamily:
    """Verification that needs a task environment on its node."""

    def __init__(self, env):
        self.env = env

    def verify(self, task, attempt):
        v = execution.verify_repo_call(task, attempt.text, limits=LIMITS, env=self.env)
        return Outcome(
            passed=v.passed,
            infra_error=v.infra_error,
            test_log=v.test_log,
            patch=attempt.text,
            detail=v,
        )


def test_llm_rate_limit_is_global_across_nodes(cluster):
    """Two callers on two nodes share one token bucket (2 requests/s, burst 1): 6 requests
    take at least 2.5 s in all, however they are spread."""
    with execution.RayBackend(max_inflight=2, llm_requests_per_s=2.0) as b:
        futs = [b.submit(faults.RateLimitedProbe(3), deadline_s=60) for _ in range(2)]
        results = [f.result() for f in futs]
        granted = b.limiter_stats()["granted"]
    assert all(r.ok for r in results), results
    times = sorted(t for r in results for t in r.value)
    assert granted == 6 and times[-1] - times[0] >= 2.5 - 0.1, times


def test_environment_built_once_per_node(backend, tmp_path):
    """Four calls on two nodes need one environment: each node builds it once, under its lock."""
    futs = [backend.submit(faults.env_marker, "env-once", deadline_s=60) for _ in range(4)]
    paths = {f.result().value for f in futs}
    assert all(os.path.isdir(p) for p in paths) and 1 <= len(paths) <= 2
    assert all("envs-w" in p for p in paths)


def test_swe_agent_smoke_config_verifies_on_the_cluster(cluster, tmp_path, no_orphans):
    """``configs/swe_agent.py:smoke`` with ``execution.backend=ray`` on the cluster: the
    family's ``run_tests`` tool, its verifier and the grader's check runner run as Ray calls and
    give what the local back-end gives (the demonstrations' observations, token for token)."""
    import importlib.util

    from hf_fixtures import fixture_pool, make_tiny_tokenizer

    from gagar_jax.envs import repo as envs_repo
    from gagar_jax.rl.collect import build_family
    from gagar_jax.rl.config import RunConfig

    c, _, _ = cluster
    spec = importlib.util.spec_from_file_location(
        "_swe_agent", os.path.join(ROOT, "configs", "swe_agent.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    d = module.get_config("smoke")
    d.task.data_path = fixture_pool(tmp_path / "pool.jsonl")
    d.task.tokenizer_path = make_tiny_tokenizer(tmp_path / "tok")
    d.execution.update(
        backend="ray", ray_address=c.address, max_inflight=4, resources=(("verifier", 1),)
    )
    cfg = RunConfig.from_config_dict(d)
    family = build_family(cfg)
    local = family.demonstrations(2)
    backend = execution.make_backend(**dataclasses.asdict(cfg.execution), grader_slots=2)
    assert backend.name == "ray"
    try:
        with execution.using(backend):
            remote = family.demonstrations(2)
            task = family.train_task(0)
            ws = envs_repo.repo_workspace(
                task,
                "g",
                [
                    envs_repo.repo_candidate(
                        "r0",
                        task.reference_patch,
                        execution.verify_repo_call(task, task.reference_patch),
                    )
                ],
            )
            check = family.check_runner().run(ws, ws.candidates[0], "python -m pytest -q")
        m = backend.metrics()
    finally:
        backend.close()
    local_check = family.check_runner().run(ws, ws.candidates[0], "python -m pytest -q")
    assert len(local) == 2 and [x.tokens for x in remote] == [x.tokens for x in local]
    # per demonstration: one run_tests call and one verification; then one more and the check
    assert m["execution/calls"] >= 6 and m["execution/infra_errors"] == 0, m
    assert check.status == local_check.status == "passed", (check.log, local_check.log)


def test_a_call_that_cannot_be_shipped_is_an_infra_error_not_a_hang(backend):
    lock = threading.Lock()  # locks do not pickle
    r = backend.call(len, [lock], deadline_s=30)
    assert r.status == "infra_error" and "cannot submit" in r.error, r
    assert backend.call(len, [1, 2], deadline_s=30).value == 2  # the dispatcher lives on


@pytest.fixture(scope="module")
def package_row(tmp_path_factory):
    """A real-package row (``tests/swe_fixtures.py``: a ``src/`` layout whose hidden test imports
    ``cachetools`` from the registry): (repositories directory, cache directory, the row)."""
    from swe_fixtures import src_layout_row

    tmp = tmp_path_factory.mktemp("package_task")
    repos_dir, cache = str(tmp / "repos"), str(tmp / "cache")
    return repos_dir, cache, src_layout_row(repos_dir)


@pytest.fixture(scope="module")
def package_task(package_row):
    """The real-package row's task, its environment built on the trainer as the loader does."""
    from gagar_jax.data import swe

    repos_dir, cache, row = package_row
    inst = swe.parse_instance(row)
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache)
    assert task.env_hash and os.path.isdir(task.env_path)
    return task, inst.patch


def test_package_task_environment_is_built_once_per_node(cluster, package_task, no_orphans):
    """Four verifications at once, two on each node (half a verifier each): each node builds
    the task's environment from its lockfile, and materialises the repository's snapshot, once
    (the second call there waits on the lock); later calls reuse both, and the verdicts are the
    local back-end's (the gold patch passes only with the registry package of the
    environment)."""
    _, _, tmp = cluster
    task, gold = package_task
    patches = [gold, "", gold, ""]
    local = execution.LocalBackend()
    want = {
        p: execution.verify_repo_call(task, p, backend=local, limits=LIMITS) for p in (gold, "")
    }
    assert want[gold].status == "passed" and want[""].status == "failed", want[gold].test_log
    half = execution.CallResources(0.5, 0, {"verifier": 0.5})
    t0 = time.monotonic()
    with execution.RayBackend(max_inflight=4, resources=half, deadline_grace_s=5.0) as b:
        rounds = []
        for _ in range(2):
            got = b.gather(
                [
                    lambda p=p: execution.verify_repo_call(task, p, backend=b, limits=LIMITS)
                    for p in patches
                ]
            )
            rounds.append((got, b.metrics()))
    for got, _ in rounds:
        assert [(v.status, v.tests) for v in got] == [
            (want[p].status, want[p].tests) for p in patches
        ], [v.test_log for v in got]
    (_, m1), (_, m2) = rounds
    assert m1["execution/calls"] == 4 and m1["execution/calls_in_flight_max"] == 4, m1
    assert m1["execution/env_builds"] == 2 and m2["execution/env_builds"] == 0, (m1, m2)
    tree = execution.tree_hash(task.files)
    for node in ("w0", "w1"):  # one copy per node, in that node's cache
        names = os.listdir(os.path.join(tmp, f"envs-{node}"))
        assert f"{task.env_hash}.ready" in names, (node, names)
        # the repository's snapshot too: calls carry its hash, not the repository
        assert f"{tree}.ready" in names, (node, names)
        assert not [n for n in names if ".build-" in n], names  # no half-built leftovers
    assert time.monotonic() - t0 < 2 * (LIMITS.wall_s + MARGIN_S)


def _quick_group(b, log, tag, k=2):
    """``k`` thunks that each record ``tag`` and make one call on ``b``."""

    def member():
        log.append(tag)
        return b.call(len, [tag], deadline_s=60).value

    return [member] * k


def test_a_group_is_admitted_only_with_its_verifier_slots_and_a_grader_slot(cluster):
    """Grader slots held by groups that wait for grading hold back the next round's groups until
    the grading pool finishes them; verifier slots are reserved all or none."""
    small = execution.CallResources(0.25, 0, {"verifier": 0.25})
    with execution.RayBackend(max_inflight=4, grader_slots=2, resources=small) as b:
        log: list[str] = []
        # one round of two groups: admitted together, each keeps its grader slot afterwards
        out = b.gather_groups(
            [_quick_group(b, log, "a"), _quick_group(b, log, "a")], grader=1, keys=["a0", "a1"]
        )
        assert out == [[1, 1], [1, 1]] and b.grader_slots_held() == 2
        nxt = threading.Thread(
            target=lambda: b.gather_groups([_quick_group(b, log, "b")], grader=1, keys=["b0"])
        )
        nxt.start()
        time.sleep(1.5)
        assert "b" not in log and nxt.is_alive()  # both grader slots are held: it waits
        # the grading pool finishes group a0 (its grader fails: a counted fallback) and frees
        # its slot through the loop's hook
        pool = GradingPool(_FailingGrader(), max_concurrency=1, deadline_s=30.0)
        pool.add_finish_callback(b.release_grader)
        try:
            pool.submit(_workspace("a0"))
            (res,) = pool.results(["a0"], timeout=30)
        finally:
            pool.close()
        assert res.fallback_reason == FallbackReason.GRADER_ERROR
        nxt.join(timeout=60)
        assert not nxt.is_alive() and log.count("b") == 2
        assert b.grader_slots_held() == 2  # a1 and b0
        m = b.metrics()
        assert m["execution/admission_waits"] == 1 and m["execution/admission_wait_s"] >= 1.0, m
        assert m["execution/grader_slots_held"] == 2
        assert b.release_grader(["a1", "b0", "never-admitted"]) == 2
        assert b.grader_slots_held() == 0

        # verifier slots: a group of 3 waits while another holds 2 of the 4
        order = []
        with b.admit(2):
            t = threading.Thread(target=lambda: order.append(_admit_and_mark(b, 3)))
            t.start()
            time.sleep(1.0)
            order.append("released")
        t.join(timeout=30)
        assert order == ["released", "admitted"]
        with pytest.raises(ValueError, match="max_inflight"):
            with b.admit(5):
                pass
        with pytest.raises(ValueError, match="grader_slots"):
            with b.admit(1, grader=3):
                pass


def _admit_and_mark(b, slots):
    with b.admit(slots):
        return "admitted"


class _FailingGrader:
    """A grader that fails (after ``delay_s``): each group falls back, counted."""

    grader_id = "failing"
    version = "1"

    def __init__(self, delay_s=0.0):
        self.delay_s = delay_s

    def grade(self, workspace):
        time.sleep(self.delay_s)
        raise RuntimeError("this grader always fails")


def _workspace(group_id):
    from gagar_jax.envs import repo as envs_repo
    from gagar_jax.verify.repo import RepoVerification

    task = _task("statkit")
    tests = {t: "failed" for t in task.required_tests}
    v = RepoVerification("failed", tests, None, (), "FAILED: test log of the candidate", None)
    return envs_repo.repo_workspace(task, group_id, [envs_repo.repo_candidate("r0", "", v)])


def test_the_loops_collection_frees_every_grader_slot_it_takes(cluster, monkeypatch):
    """``train.collect_phase`` with grading and dynamic sampling: round one keeps two mixed
    groups (they hold their grader slots while the slow pool grades them) and drops two (freed
    when dropped); round two waits at admission until the pool has finished one of them. Once
    the step's verdicts are in, no slot is held."""
    import importlib
    import types

    from gagar_jax.rl import collect, resume, train
    from gagar_jax.rl.config import RunConfig

    script = iter([2, 0, 1, 4, 3, 2])  # passes per drawn group, of 4: mixed, all-fail, ...

    def scripted_generate(engine, family, tasks, *, step, round_id, hold_grader=False, **kw):
        ids = [f"s{step}-r{round_id}-{i}" for i in range(len(tasks))]
        execution.current().gather_groups(
            [_quick_group(b, [], "v", k=4) for _ in tasks],
            grader=int(hold_grader),
            keys=ids if hold_grader else None,
        )
        return [_scripted_group(collect, gid, next(script)) for gid in ids]

    monkeypatch.setattr(train, "generate_groups", scripted_generate)
    cd = importlib.import_module("configs.toy_gagar").get_config("binary,smoke").to_dict()
    cd["rollout"].update(num_prompts=4, num_rollouts=4, max_prompt_len=8, max_new_tokens=8)
    cd["grading"].update(enabled=True, max_inflight_groups=2)
    cd["sampling"].update(enabled=True, oversample=1.0, allow_partial=True, max_rounds=4)
    cfg = RunConfig.from_config_dict(cd)
    family = types.SimpleNamespace(
        train_task=lambda i: i,
        tokenizer=types.SimpleNamespace(pad_id=0),
        workspace=lambda gid, task, members: _workspace(gid),
    )
    small = execution.CallResources(0.25, 0, {"verifier": 0.25})
    pool = GradingPool(_FailingGrader(delay_s=1.0), max_concurrency=1, deadline_s=30.0)
    with execution.RayBackend(
        max_inflight=4, grader_slots=cfg.grading.max_inflight_groups, resources=small
    ) as b:
        pool.add_finish_callback(b.release_grader)
        try:
            with execution.using(b):
                got = train.collect_phase(
                    None,
                    family,
                    pool,
                    resume.TaskStream(8, seed=0),
                    resume.LoopState(rng_key=[0, 1]),
                    cfg,
                    step=0,
                    hosts=train.Hosts(60.0),
                )
            assert got.sampling.rounds == 2 and len(got.submitted) == 4
            assert b.grader_slots_held() <= 4  # the two dropped groups hold nothing
            results = pool.results(list(got.submitted), timeout=60)
        finally:
            pool.close()
        assert all(r.fallback_reason == FallbackReason.GRADER_ERROR for r in results)
        assert b.grader_slots_held() == 0
        m = b.metrics()
    assert m["execution/admission_waits"] >= 1 and m["execution/admission_wait_s"] > 0, m


def _scripted_group(collect, gid, passes, K=4):
    rollouts = [
        collect.Rollout(
            prompt_tokens=[1, 2, 3],
            response_tokens=[7, 7],
            logprobs=[-0.5, -0.5],
            passed=k < passes,
        )
        for k in range(K)
    ]
    return collect.Group(group_id=gid, task=None, rollouts=rollouts)


def test_grader_checks_of_a_package_task_see_the_nodes_environment(cluster, package_task):
    """The agentic grader's check runner, for a real-package task, runs its command on a node
    against that node's copy of the task's environment (built there from the lockfile), with
    the outcome the trainer's own run gives."""
    from gagar_jax.envs import repo as envs_repo
    from gagar_jax.verify.repo import RepoVerification

    task, gold = package_task
    v = RepoVerification("passed", {}, None, (), "PASSED tests/test_add.py::test_add", None)
    ws = envs_repo.repo_workspace(task, "g-check", [envs_repo.repo_candidate("r0", gold, v)])
    runner = envs_repo.TaskEnvCheckRunner({"g-check": task}, limits=LIMITS)
    cmd = 'python -c "import cachetools, srcpkg; print(srcpkg.add(2, 3), cachetools.__file__)"'
    local = runner.run(ws, ws.candidates[0], cmd)
    with execution.RayBackend(max_inflight=2, resources=execution.CallResources(1.0)) as b:
        with execution.using(b):
            remote = runner.run(ws, ws.candidates[0], cmd)
        m = b.metrics()
    assert local.status == remote.status == "passed", (local.log, remote.log)
    assert "5 " + task.env_path in local.log, local.log  # the trainer's environment
    assert "5 " in remote.log and "/envs-w" in remote.log, remote.log  # the node's
    assert m["execution/calls"] == 1 and m["execution/infra_errors"] == 0, m


def test_task_validation_on_the_cluster_gives_the_local_report(
    cluster, package_row, no_orphans, tmp_path, monkeypatch
):
    """``python -m gagar_jax.data.swe validate --execution ray``: every (row, patch, run) is one
    call on the cluster's nodes (each builds the task's environment from its lockfile), at most
    ``--max-inflight`` at once, and the report is the local one line for line (timing aside)."""
    from gagar_jax.data import swe

    repos_dir, cache, row = package_row
    rows = tmp_path / "rows.jsonl"  # two rows: the second one is prepared while the first runs
    again = {**row, "instance_id": row["instance_id"] + "-again"}
    rows.write_text("".join(json.dumps(r) + "\n" for r in (row, again)))
    made, real = [], execution.make_backend  # the command's back-end, kept for its counters
    monkeypatch.setattr(
        execution, "make_backend", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1]
    )
    args = ["validate", "--instances", str(rows), "--repos", repos_dir, "--cache", cache]
    args += ["--runs", "2"]
    ray_args = ["--execution", "ray", "--ray-address", cluster[0].address, "--max-inflight", "3"]
    out = {}
    for where, extra in (
        ("local", ["--execution", "local"]),
        ("ray", [*ray_args, "--resources", '{"verifier": 1}']),
    ):
        path = tmp_path / f"{where}.jsonl"
        t0 = time.monotonic()
        assert swe.main([*args, *extra, "--out", str(path)]) == 0, where
        seconds = time.monotonic() - t0
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert all(x.pop("seconds") >= 0 for x in lines), lines
        out[where] = (lines, seconds)
    (local, _), (remote, ray_s) = out["local"], out["ray"]
    assert [x["instance_id"] for x in local] == [row["instance_id"], again["instance_id"]]
    for x in local:  # a sound task, validated: the gold patch passes only in its environment
        assert (x["gold"], x["empty"], x["flaky_tests"], x["infra_errors"]) == (
            "passed",
            "failed",
            [],
            0,
        ), x
        assert "error" not in x and x["env_hash"], x
    assert remote == local
    (b,) = made
    m = b.metrics()
    assert m["execution/calls"] == 8 and m["execution/infra_errors"] == 0, m
    assert 1 <= m["execution/calls_in_flight_max"] <= 3, m
    assert m["execution/timeouts"] == 0 and m["execution/retries"] == 0, m
    assert ray_s < 2 * (LIMITS.wall_s + MARGIN_S)
