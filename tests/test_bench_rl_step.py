"""The whole-step race (benchmarks/rl_step.py) compares equal work: the three frameworks are
configured alike (same first-token log-probabilities from the same weights, same mean-centred
advantages on a fixed reward vector, same prompt token ids), and the check that says so fails
when any of them drifts.

The fast tests run gagar_jax's side in this process against a ``transformers`` forward of the
same safetensors and the NumPy reference; the ``bench`` test builds the TRL and Tunix virtual
environments (first run: minutes) and runs the benchmark's own ``--check`` on every framework.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_rl_step", ROOT / "benchmarks" / "rl_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _good_checks(shape):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (shape["prompts"], shape["prompt_len"])).tolist()
    lp = rng.normal(-7, 1, (shape["prompts"], bench.CHECK_COMPLETION)).tolist()
    adv = bench.mean_centred(bench.CHECK_REWARDS, bench.CHECK_GROUP)
    return {
        fw: {"prompt_ids": ids, "first_logprobs": lp, "advantages": adv} for fw in bench.FRAMEWORKS
    }


def test_mean_centred_reference():
    adv = bench.mean_centred([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], 2)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])


def test_compare_checks_accepts_equal_and_flags_every_drift():
    shape = bench.SHAPES["quick-rl"]
    good = _good_checks(shape)
    assert bench.compare_checks(good, {}, shape) == []
    # Advantages divided by the group's std (GRPO's default, TRL's scale_rewards="group",
    # Tunix's "grpo" estimator) is another algorithm: flagged.
    r = np.array(bench.CHECK_REWARDS).reshape(-1, bench.CHECK_GROUP)
    scaled = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    bad = json.loads(json.dumps(good))
    bad["tunix"]["advantages"] = scaled.reshape(-1).tolist()
    assert any("tunix: advantages" in p for p in bench.compare_checks(bad, {}, shape))
    # Log-probs off by more than float tolerance (another model, another temperature).
    bad = json.loads(json.dumps(good))
    bad["trl"]["first_logprobs"][1][0] += 1e-3
    assert any("trl: first-token log-probs" in p for p in bench.compare_checks(bad, {}, shape))
    bad["trl"]["first_logprobs"][1][0] -= 1e-3 - 5e-5  # within tolerance again
    assert bench.compare_checks(bad, {}, shape) == []
    # Another tokenisation (a BOS token, a different split) changes the work.
    bad = json.loads(json.dumps(good))
    bad["tunix"]["prompt_ids"][0] = [1] + bad["tunix"]["prompt_ids"][0][:-1]
    assert any("tunix: prompt token ids" in p for p in bench.compare_checks(bad, {}, shape))
    bad = json.loads(json.dumps(good))
    bad["gagar_jax"]["prompt_ids"][2] = bad["gagar_jax"]["prompt_ids"][2][:-1]
    assert any("prompt token counts" in p for p in bench.compare_checks(bad, {}, shape))


def test_trl_advantage_path_is_mean_centred_only_without_scaling():
    import torch  # noqa: F401

    class Trainer:
        scale_rewards = "none"

    adv = bench._trl_advantages(Trainer(), bench.CHECK_REWARDS, bench.CHECK_GROUP)
    np.testing.assert_allclose(
        adv, bench.mean_centred(bench.CHECK_REWARDS, bench.CHECK_GROUP), atol=1e-6
    )
    Trainer.scale_rewards = "group"
    scaled = bench._trl_advantages(Trainer(), bench.CHECK_REWARDS, bench.CHECK_GROUP)
    assert not np.allclose(scaled, adv, atol=1e-3)


def test_gagar_side_matches_transformers_and_reference(tmp_path, monkeypatch):
    """gagar_jax's check (the update's own scoring, the configured advantage pipeline, the
    tokenisation) on the benchmark's tiny assets: first-token log-probs equal a ``transformers``
    forward of the same safetensors, advantages equal the mean-centred reference, prompts are
    exactly ``prompt_len`` tokens."""
    import torch
    import transformers

    assets = bench.make_assets("tiny", root=tmp_path)
    shape = bench.SHAPES["quick-rl"]
    spec = dict(assets=str(assets), shape_name="quick-rl", mode="check", **shape)
    got = []
    monkeypatch.setattr(bench, "_reply", got.append)
    bench._gagar_worker(spec)
    (check,) = got
    np.testing.assert_allclose(
        check["advantages"], bench.mean_centred(bench.CHECK_REWARDS, bench.CHECK_GROUP), atol=1e-6
    )
    assert [len(p) for p in check["prompt_ids"]] == [shape["prompt_len"]] * shape["prompts"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(assets), dtype=torch.float32)
    completion = bench._check_inputs(spec, json.loads((assets / "bench-assets.json").read_text()))[
        1
    ]
    ids = torch.tensor([p + completion for p in check["prompt_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)
    p = shape["prompt_len"]
    ref = logp[:, p - 1 : p - 1 + len(completion)].gather(-1, ids[:, p:, None])[..., 0].numpy()
    np.testing.assert_allclose(check["first_logprobs"], ref, atol=1e-4, rtol=0)
    # The reward: 1 for an even count of "e".
    assert bench.reward_of_text("eel") == 1.0 and bench.reward_of_text("e") == 0.0


@pytest.mark.bench
def test_three_frameworks_configured_equally():
    """The benchmark's own check on TRL, Tunix and gagar_jax (builds the TRL / Tunix venvs
    from the pinned versions on first use)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "rl_step.py"), "--quick", "--check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=7200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("equal-configuration check passed") == 2, out.stdout


def test_one_interpreter_for_the_trainers_replaces_their_venvs(tmp_path, monkeypatch):
    """``$GAGAR_BENCH_PYTHON``: TRL's and Tunix's workers run that interpreter with this
    process's ``PYTHONPATH`` (where a machine without a registry carries their packages), and
    no virtual environment is built; without it they get their own venvs and an empty path."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv(bench.PYTHON_ENV, raising=False)
    assert bench.python_of("trl") == str(bench.VENVS["trl"] / "bin" / "python")
    assert bench.python_of("gagar_jax") == sys.executable

    monkeypatch.setenv(bench.PYTHON_ENV, sys.executable)
    assert bench.ensure_venv("tunix") is None
    assert bench.python_of("tunix") == sys.executable
    # The worker command is recorded, then replaced by an interpreter that exits at once.
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        seen[cmd[cmd.index("--worker") + 1]] = (cmd[0], kw["env"]["PYTHONPATH"])
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    for fw in ("trl", "gagar_jax"):
        w = bench.WorkerProc(fw, {}, tmp_path / f"{fw}.log")
        w.proc.wait()
        w.log.close()
        assert w.proc.returncode == 0
    assert seen["trl"] == (sys.executable, str(tmp_path))
    assert seen["gagar_jax"] == (sys.executable, os.pathsep.join([str(ROOT), str(tmp_path)]))


def test_the_two_device_variant_gets_two_host_devices_and_this_interpreter(tmp_path, monkeypatch):
    """``gagar_2dev`` runs gagar_jax's worker in this interpreter with exactly two host devices
    (whatever ``XLA_FLAGS`` the driver has); the one-device workers get no ``XLA_FLAGS``."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.delenv(bench.PYTHON_ENV, raising=False)
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        seen[cmd[cmd.index("--worker") + 1]] = (cmd[0], kw["env"].get("XLA_FLAGS"))
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    for fw in ("gagar_jax", "gagar_2dev", "trl"):
        w = bench.WorkerProc(fw, {}, tmp_path / f"{fw}.log")
        w.proc.wait()
        w.log.close()
    assert seen["gagar_jax"] == (sys.executable, None)
    assert seen["gagar_2dev"] == (sys.executable, "--xla_force_host_platform_device_count=2")
    assert seen["trl"][1] is None
    assert bench.is_gagar("gagar_2dev") and not bench.is_gagar("trl")


@pytest.mark.parametrize("shape_name", ["quick-rl", "quick-multiturn"])
def test_model_flops_count_the_work_gagar_jax_update_runs(tmp_path, shape_name):
    """The roofline's ``update_shared`` (each prompt once per group) is the dot arithmetic of
    gagar_jax's compiled update at the race's shapes: at most the dots XLA runs, which add
    only the masked halves of the attention blocks; the per-sample count, which every
    framework is also given, is more."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import xla_profile

    from gagar_jax.models import load_hf_safetensors
    from gagar_jax.rl.collect import Group, Rollout, pack_groups
    from gagar_jax.update import create_train_state, jit_update, make_mesh, shard_batch

    assets = bench.make_assets("tiny", root=tmp_path)
    shape = bench.SHAPES[shape_name]
    g, k, p, n = shape["prompts"], shape["samples"], shape["prompt_len"], shape["new"]
    cfg, _ = load_hf_safetensors(str(assets))
    ucfg = bench.gagar_update_config(shape)
    assert ucfg.shared_prefix
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    groups = []
    for i in range(g):
        prompt = rng.integers(5, cfg.vocab_size, p).tolist()
        rollouts = [
            Rollout(
                prompt_tokens=prompt,
                response_tokens=rng.integers(5, cfg.vocab_size, n).tolist(),
                logprobs=[-1.0] * n,
                finish_reason="length",
                policy_version=0,
                passed=bool(j % 2),
            )
            for j in range(k)
        ]
        groups.append(Group(group_id=str(i), task=None, rollouts=rollouts))
    pad = json.loads((assets / "bench-assets.json").read_text())["pad_id"]
    batch = pack_groups(
        groups, None, num_groups=g, num_rollouts=k, max_prompt_len=p, max_new_tokens=n, pad_id=pad
    )
    ub = shard_batch(batch._replace(evidence=None), mesh)
    state = create_train_state(cfg, ucfg, mesh, seed=0)
    hlo = jit_update(cfg, ucfg, mesh).lower(state, ub).compile().as_text()
    ran = sum(xla_profile.dot_instruction_flops(hlo))
    flops = bench.model_flops(assets, shape)
    assert flops["update_shared"] <= ran <= 1.1 * flops["update_shared"], (flops, ran)
    assert flops["update"] > 1.3 * ran
    assert flops["generate_shared"] < flops["generate"]


def test_the_heap_setting_is_the_same_in_every_worker(tmp_path, monkeypatch):
    """``--keep-heap`` gives every framework's worker the same ``GLIBC_TUNABLES``; without it no
    worker gets any, whatever the driver's own environment holds. gagar_jax's own kept heap
    (its trainer's ``prepare_cpu_host``) is left on unless ``--glibc-heap`` turns it off."""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setenv("GAGAR_MALLOC_KEEP_HEAP", "0")
    monkeypatch.delenv(bench.PYTHON_ENV, raising=False)
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        env = kw["env"]
        seen[cmd[cmd.index("--worker") + 1]] = (
            env.get("GLIBC_TUNABLES"),
            env.get("GAGAR_MALLOC_KEEP_HEAP"),
        )
        return real_popen([sys.executable, "-c", "pass"], **kw)

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    for keep, glibc, want in (
        (True, False, (bench.KEEP_HEAP_TUNABLES, None)),
        (False, False, (None, None)),
        (False, True, (None, "0")),
    ):
        seen.clear()
        for fw in ("gagar_jax", "gagar_2dev", "trl", "tunix"):
            spec = {"keep_heap": keep, "glibc_heap": glibc}
            w = bench.WorkerProc(fw, spec, tmp_path / f"{fw}.log")
            w.proc.wait()
            w.log.close()
        assert seen == dict.fromkeys(("gagar_jax", "gagar_2dev", "trl", "tunix"), want)


_REFAULT = """
import resource, numpy as np
n = 64 * 2**20
a = np.ones(n, np.uint8); del a  # allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(n, np.uint8)  # the same size again
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_keep_heap_tunables_reuse_freed_memory():
    """The tunables take effect: with them, a 64 MB block freed and allocated again is served
    from the kept heap (almost no page faults); with glibc's defaults it is mapped and faulted
    in afresh (one fault per 4 KB page or per huge page)."""

    def faults(keep):
        env = bench.worker_env("trl", keep)
        out = subprocess.run(
            [sys.executable, "-c", _REFAULT], env=env, capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    kept, fresh = faults(True), faults(False)
    assert kept < 100, kept
    assert fresh > 10 * max(kept, 1), (kept, fresh)
