r"""The multi-turn toy agent: the toy programs as a tool task, embedded sampler, CPU.

    python scripts/train.py --config=configs/toy_agent.py --workdir=runs/toy_agent
    python scripts/train.py --config=configs/toy_agent.py:binary,smoke --workdir=/tmp/s

Each rollout is an episode of up to ``task.max_turns`` model turns over ``CodeAgentEnv``:
``read_file``, ``edit`` (a line-edit patch), ``run_tests``, ``submit`` (``gagar_jax.envs.
toy_family``); observations are in the toy vocabulary and masked out of the loss. The SFT warm
start trains on tool-call trajectories built from each task's passing patch kinds. The argument
is as for ``configs/toy_gagar.py`` (a mode and/or ``smoke``).
"""

from configs import common, toy_gagar
from gagar_jax.rl.config import TRAINING_MODES


def get_config(arg=None):
    arg = common.parse_arg(arg, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False)
    c = toy_gagar.get_config(arg.mode + (",smoke" if arg.smoke else ""))
    c.name = "toy_agent_" + c.mode + ("_smoke" if arg.smoke else "")
    c.task.update(family="toy_agent", max_turns=6, max_observation_tokens=48)
    # the episode after the prompt: turns + observations; one turn is a tool call (the edit
    # carries the patch)
    c.rollout.update(max_prompt_len=64, max_new_tokens=96, max_turn_tokens=32)
    if arg.smoke:
        c.rollout.update(max_new_tokens=64, max_turn_tokens=16)
        c.task.max_turns = 4
    return c
