"""The RL experiment: run config, the training loop, collection, resume.

It drives the update library (:mod:`gagar_jax.update`) with rollouts (:mod:`gagar_jax.rollout`),
task families (:mod:`gagar_jax.envs`) and graders (:mod:`gagar_jax.grading`), and is the only
package that imports all of them.

Modules: ``config`` (``RunConfig``, the validated run config), ``train`` (``train_and_evaluate``,
``rl_step`` and its named phases, ``evaluate_checkpoint``), ``paired_eval`` (two
checkpoints of a run on the same tasks with the same sample seeds: the pass-rate change RL
made), ``asynchronous`` (the loop with ``rollout.max_staleness > 0``: admission control,
oldest-first training, the bias monitor),
``collect`` (rollout records, groups, generation and verification, dynamic sampling, packing),
``grade`` (workspaces, verdicts as arrays, grading metrics), ``policy`` (model, the update
call, weight sync, checkpoints), ``engines`` (rollout engine, grading pool), ``resume`` (the
loop state), ``multihost`` (one loop over ``jax.distributed`` processes). Its metrics go through
the run records' writers (``gagar_jax.analysis.writers``: JSONL/TensorBoard/console, plots,
comparisons), which the feedback trainer shares. The package itself imports nothing.
"""
