"""Training infrastructure: checkpoints (Orbax, kill-safe, with the data-iterator position) and metrics
(metrics.jsonl, TensorBoard, W&B, a progress bar). The training loop builds on these.

  checkpoint.py  Checkpointer (save every N steps, keep the newest K, sharded restore), latest_step(run_dir)
  identity.py    what a checkpoint records about its model (full or LoRA, the base by path and weights hash) and
                 the checks that refuse a resume or load onto another model
  metrics.py     MetricsWriter (run.loggers: jsonl + TensorBoard / W&B, process 0 only, truncated on resume),
                 ProgressBar
  lifecycle.py   SIGTERM within the grace, the config a resume may change, the config history, the model revision
                 (the run lock, the lease, the stop path and the exit codes: g2rl_jax/control);
                 iterator_state.py: a checkpoint's data-iterator item
  dynamic.py     DAPO dynamic sampling: which groups a step keeps over rollout rounds, merging the rounds
  loop.py        the Trainer; command.py: `python -m g2rl_jax.train`; its rollout rounds and validation:
                 sampling_rounds.py; its update (rows kept, mini-batches, PPO epochs): update_rounds.py;
                 stages.py: the `stage` context that names a failing stage and its input shapes
  step.py        one RL step's stages as pure functions (batch, score, reference, advantages); update.py: the
                 update stage (loss, micro-batch gradients, optimizer step, token rules); optim.py: the optimizer
                 and its sharded state; micro.py: length-grouped micro-batches
  warmup.py      compiles the run's layout and prompt buckets (chosen in g2rl_jax/shapes) at the first step;
                 packing.py: packed micro-batches; compiles.py: the per-step compile clock
"""
from g2rl_jax.train.checkpoint import Checkpointer, latest_step
from g2rl_jax.train.metrics import MetricsWriter, ProgressBar

__all__ = ["Checkpointer", "MetricsWriter", "ProgressBar", "latest_step"]
