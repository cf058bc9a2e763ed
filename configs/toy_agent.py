r"""The multi-turn toy agent: the toy programs as a tool task, embedded sampler, CPU.

    python scripts/train.py --config=configs/toy_agent.py --workdir=runs/toy_agent
    python scripts/train.py --config=configs/toy_agent.py:binary,smoke --workdir=/tmp/s

Each rollout is an episode of up to ``task.max_turns`` model turns over ``CodeAgentEnv``:
``read_file``, ``edit`` (a line-edit patch), ``run_tests``, ``submit`` (``gagar_jax.envs.
toy_family``); observations are in the toy vocabulary and masked out of the loss. The SFT warm
start trains on tool-call trajectories built from each task's passing patch kinds. The argument
is as for ``configs/toy_gagar.py`` (a mode and/or ``smoke``).
"""

import importlib.util
import os


def _toy():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_gagar.py")
    spec = importlib.util.spec_from_file_location("_toy_gagar_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    words = [w for w in (arg or "").split(",") if w]
    c = _toy().get_config(",".join(words))
    c.name = "toy_agent_" + c.mode + ("_smoke" if "smoke" in words else "")
    c.task.update(family="toy_agent", max_turns=6, max_observation_tokens=48)
    # the episode after the prompt: turns + observations; one turn is a tool call (the edit
    # carries the patch)
    c.rollout.update(max_prompt_len=64, max_new_tokens=96, max_turn_tokens=32)
    if "smoke" in words:
        c.rollout.update(max_new_tokens=64, max_turn_tokens=16)
        c.task.max_turns = 4
    return c
