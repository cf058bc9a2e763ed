"""The RL experiment: run config, the training loop, collection, resume, metrics writers.

It drives the update library (:mod:`gagar_jax.update`) with rollouts (:mod:`gagar_jax.rollout`),
task families (:mod:`gagar_jax.envs`) and graders (:mod:`gagar_jax.grading`), and is the only
package that imports all of them.

Modules: ``config`` (``RunConfig``, the validated run config), ``train`` (``train_and_evaluate``,
``rl_step`` and its named phases, ``evaluate_checkpoint``), ``asynchronous`` (the loop with
``rollout.max_staleness > 0``: admission control, oldest-first training, the bias monitor),
``collect`` (rollout records, groups, generation and verification, dynamic sampling, packing),
``grade`` (workspaces, verdicts as arrays, grading metrics), ``policy`` (model, the update
call, weight sync, checkpoints), ``engines`` (rollout engine, grading pool), ``resume`` (the
loop state), ``writers`` (metrics JSONL/TensorBoard/console, plots, comparisons),
``multihost`` (one loop over ``jax.distributed`` processes). The package itself imports
nothing, so ``from gagar_jax.rl import writers`` stays light.
"""
