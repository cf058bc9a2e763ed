"""Harness episodes with ``execution.backend=ray``: the episodes run on the trainer's host (the
gateway is in its process), their verification runs as Ray calls on a simulated cluster's
nodes, admitted group by group as native groups are (K verifier slots, and a grader slot held
under the group's id until released), with the verdicts the local back-end gives."""

import dataclasses
import os

import pytest
import ray
from ray.cluster_utils import Cluster

from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.rl import collect
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.verify import execution
from tests.gateway_fixtures import tiny_policy
from tests.hf_fixtures import make_tiny_tokenizer
from tests.test_harness import HTTP_HARNESS, TASK, _script
from tests.test_harness_loop import RepoFamily, _cfg

pytestmark = pytest.mark.ray

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STORE = 100 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head without CPUs and one worker node advertising ``verifier`` (as
    ``tests/test_execution_ray.py``'s cluster, one node smaller)."""
    tmp = str(tmp_path_factory.mktemp("ray_cluster"))
    c = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=0, object_store_memory=STORE, include_dashboard=False),
    )
    c.add_node(
        num_cpus=1,
        resources={"verifier": 1},
        object_store_memory=STORE,
        env_vars={
            "GAGAR_ENV_CACHE": os.path.join(tmp, "envs"),
            "PYTHONPATH": os.pathsep.join([HERE, ROOT]),
        },
    )
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, namespace=execution.RAY_NAMESPACE)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_harness_episodes_verify_on_the_cluster_like_native_groups(cluster, tmp_path):
    tokenizer = HFTokenizer(make_tiny_tokenizer(tmp_path / "tok"))
    sampler = Sampler(
        tiny_policy(tokenizer),
        pad_id=tokenizer.pad_id,
        batch_buckets=(1, 2),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    cfg = _cfg(harness="command", harness_command=_script(HTTP_HARNESS), harness_max_wall_s=60)

    def collect_with(backend, prefix):
        with execution.using(backend):
            (group,) = collect.generate_groups(
                sampler,
                RepoFamily(tokenizer),
                [TASK],
                cfg=cfg,
                step=0,
                round_id=0,
                num_rollouts=2,
                temperature=1.0,
                id_prefix=prefix,
                prompt_seeds=[7],
                hold_grader=True,
            )
        return group

    with execution.RayBackend(
        max_inflight=2,
        grader_slots=1,
        resources=execution.CallResources(1.0, 0, {"verifier": 1}),
    ) as b:
        group = collect_with(b, "ray")
        # the group holds its grader slot under its id until the grading pool releases it
        assert b.grader_slots_held() == 1
        assert b.release_grader(group.group_id) == 1 and b.grader_slots_held() == 0
        m = b.metrics()
    # both episodes' verifications were Ray calls on the node
    assert m["execution/calls"] == 2 and m["execution/infra_errors"] == 0, m
    local = collect_with(execution.LocalBackend(), "local")
    for r, want in zip(group.rollouts, local.rollouts, strict=True):
        assert r.passed and not r.infra_error, r.test_log[-2000:]
        assert (r.passed, r.cheat, r.infra_error) == (want.passed, want.cheat, want.infra_error)
        assert r.patch == want.patch and "+x = 2" in r.patch
        # the same episodes (seeded alike): the same recorded tokens whichever back-end verified
        assert r.response_tokens == want.response_tokens
    assert dataclasses.asdict(group.rollouts[0].attempt.harness.diff) == dataclasses.asdict(
        local.rollouts[0].attempt.harness.diff
    )
