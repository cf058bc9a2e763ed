"""Task pool glue for the loop: prompts in, verified :class:`~gagar_jax.train.sampling.Rollout` out.

The loop talks to a task family only through :class:`ToyTaskPool` (``gagar_jax.envs``):

* ``train_task(i)`` / ``eval_tasks()``: training tasks by index (random access, so the data
  position of :class:`~gagar_jax.train.resume.TaskStream` is all a resumed run needs) and a
  held-out set generated from another seed.
* ``prompt_tokens(task)``: the prompt ids, checked against ``rollout.max_prompt_len``.
* ``make_rollout(task, prompt, sample)``: decodes the response to a patch, verifies it in the
  family's verifier and returns the rollout with its reward inputs (``passed``, ``cheat``,
  ``infra_error``) and quality score (metrics only; the *grader* decides tiers).
* ``demonstrations(n)``: SFT warm-start pairs on n tasks of their own seed, from the family's
  passing non-cheat patch kinds (minimal, inconsistent, sprawling, ...): the warm-started
  policy produces solutions of every quality, which gives the grader something to rank.
* ``workspace(group)``: the grading workspace of a group (``gagar_jax.grading``).
"""

from __future__ import annotations

from typing import Any

from gagar_jax.train.run_config import RolloutConfig, TaskConfig
from gagar_jax.train.sampling import Group, Rollout

# Held-out and SFT-demonstration tasks come from other seeds, so neither coincides with the RL
# training tasks (the warm start must not hand the RL prompts their answers).
EVAL_SEED_OFFSET = 1_000_003
SFT_SEED_OFFSET = 2_000_003
# Demonstration kinds used for the SFT warm start: every passing, non-cheating kind.
DEMO_KINDS = ("minimal", "inconsistent", "sprawling", "out_of_scope", "side_effect")


def _dims(quality: dict[str, float]) -> dict[str, float]:
    from gagar_jax.envs import QUALITY_DIMENSIONS

    return {k: float(quality[k]) for k in QUALITY_DIMENSIONS if k in quality}


def quality_score(quality: dict[str, float]) -> float | None:
    """Mean of the five quality dimensions (None when the verifier reported none)."""
    from gagar_jax.envs import QUALITY_DIMENSIONS

    vals = [quality[k] for k in QUALITY_DIMENSIONS if k in quality]
    return sum(vals) / len(vals) if vals else None


class ToyTaskPool:
    def __init__(self, task_cfg: TaskConfig, rollout_cfg: RolloutConfig):
        from gagar_jax import envs

        self._envs = envs
        self.cfg = task_cfg
        self.rollout_cfg = rollout_cfg
        self.tokenizer = envs.TOKENIZER
        self._train = envs.ToyTaskGenerator(seed=task_cfg.seed, difficulty=task_cfg.difficulty)
        self._eval = envs.ToyTaskGenerator(seed=task_cfg.seed + EVAL_SEED_OFFSET,
                                           difficulty=task_cfg.difficulty)
        self._sft = envs.ToyTaskGenerator(seed=task_cfg.seed + SFT_SEED_OFFSET,
                                          difficulty=task_cfg.difficulty)
        self._cache: dict[int, Any] = {}
        self._eval_tasks: list[Any] | None = None

    @property
    def num_train(self) -> int:
        return self.cfg.num_train

    def train_task(self, index: int):
        if not 0 <= index < self.cfg.num_train:
            raise IndexError(f"train task index {index} outside [0, {self.cfg.num_train})")
        task = self._cache.get(index)
        if task is None:
            task = self._cache[index] = self._train.task(index)
        return task

    def eval_tasks(self) -> list[Any]:
        if self._eval_tasks is None:
            self._eval_tasks = self._eval.tasks(self.cfg.num_eval)
        return self._eval_tasks

    def prompt_tokens(self, task) -> list[int]:
        ids = self.tokenizer.encode(task.prompt)
        if len(ids) > self.rollout_cfg.max_prompt_len:
            raise ValueError(f"task {task.task_id}: prompt is {len(ids)} tokens > "
                             f"rollout.max_prompt_len={self.rollout_cfg.max_prompt_len}; raise it "
                             "or lower task.difficulty")
        return ids

    def make_rollout(self, task, prompt: list[int], sample) -> Rollout:
        """Verifies one sample. A verifier crash is an infra error (masked), never a failure."""
        patch = self.tokenizer.decode(sample.tokens)
        v = self._envs.verify(task, patch)
        return Rollout(
            prompt_tokens=list(prompt), response_tokens=list(sample.tokens),
            logprobs=[float(x) for x in sample.logprobs], finish_reason=sample.finish_reason,
            policy_version=int(sample.policy_version), patch=patch, passed=bool(v.passed),
            infra_error=bool(v.infra_error), cheat=bool(v.cheat),
            quality=quality_score(v.quality) if v.passed else None, test_log=v.test_log,
            monitor_flags=list(v.cheat_flags), quality_dims=_dims(v.quality) if v.passed else {},
            verification=v)

    def demonstrations(self, num_tasks: int) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, response ids + EOS) for each passing non-cheat patch kind of each of
        ``num_tasks`` demonstration tasks (their own seed: disjoint from RL and eval tasks)."""
        out = []
        eos = self.tokenizer.eos_id
        for task in self._sft.tasks(num_tasks):
            prompt = self.prompt_tokens(task)
            for kind, patch in self._envs.candidate_patches(task).items():
                if kind not in DEMO_KINDS:
                    continue
                v = self._envs.verify(task, patch)
                if not v.passed or v.cheat:
                    continue
                response = self.tokenizer.encode(patch) + [eos]
                if len(response) > self.rollout_cfg.max_new_tokens:
                    continue  # too long for the static response budget; skip, never truncate
                out.append((prompt, response))
        return out

    def token_spans(self, task, response_tokens):
        """Where a rollout's edits live in its response tokens (``grading.evidence_tokens``)."""
        from gagar_jax.grading import evidence_tokens

        return evidence_tokens.toy_token_spans(task, response_tokens, self.tokenizer)

    def workspace(self, group: Group):
        """The grading workspace of one group (``gagar_jax.grading.adapters``: each line-edit
        patch rendered as a unified diff of ``program.toy``, with its test log, monitor flags
        and quality features; infra-error rollouts go in as failed candidates)."""
        from gagar_jax.grading import adapters

        candidates = [
            adapters.toy_candidate(group.task, f"{group.group_id}/{k}", r.patch, r.verification)
            for k, r in enumerate(group.rollouts)]
        return adapters.toy_workspace(group.task, group.group_id, candidates)
