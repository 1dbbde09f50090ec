"""The Trainer's update of one step: the rows each method keeps, the mini-batches (and their token rules: Clip-Cov,
KL-Cov, forking tokens, decided on each mini-batch's current policy), and the PPO epochs over them
(train/passes.py's micro-batched gradient programs).

`UpdateRounds` is a mixin of `train.loop.Trainer`: it reads the trainer's cfg, method, mesh, graphdef, settings,
optimizer and warm-up, and updates only `params` and `opt_state`.
"""
from __future__ import annotations

import jax
import numpy as np

from g2rl_jax import parallel
from g2rl_jax.rollout import sampling
from g2rl_jax.train import passes
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.setup import shard_rows


class UpdateRounds:
    """The update stage of `train.loop.Trainer` (a mixin)."""

    def _update(self, batch: train_step.Batch, old_logp, ref_logp, adv_B, in_loss_B,
                sampler_logp=None, entropy=None, step: int = 0, token_weight=None) -> dict[str, float]:
        """token_weight [B, T]: the per-token loss weights a method decided with its advantages (Miner), or None."""
        algo = self.cfg.algorithm
        keep_B = np.ones(adv_B.shape[0], bool)
        if algo.filter_equal_groups:
            keep_B = train_step.group_keep_mask(parallel.gather(batch.correct), batch.group_size)
        groups_kept = float(keep_B.reshape(-1, batch.group_size)[:, 0].mean())
        keep_B = keep_B & parallel.gather(in_loss_B).astype(bool)  # reward.truncated=mask
        if self.method.keep_rows is not None:  # the method's own choice of rows (nsr: the wrong responses)
            keep_B = keep_B & np.asarray(self.method.keep_rows(parallel.gather(batch.correct)))
        mb = algo.mini_batch_size
        rules = self.method.tokens is not None  # Clip-Cov, KL-Cov, forking tokens: decided in each update

        def minis_of(batch: train_step.Batch, keep_B) -> list[tuple]:
            step_rows = train_step.MiniBatch(batch, old_logp, old_logp if ref_logp is None else ref_logp, adv_B,
                                             sampler_logp, token_weight)
            if rules:
                step_rows = train_update.with_token_fields(step_rows, algo)
            return train_step.mini_batches(step_rows, keep_B, mb, entropy if rules else None)

        minis, infos, plans = minis_of(batch, keep_B), [], []
        self.warmup.update(self.graphdef, self.params, minis[0][0], settings=self.settings, opt_state=self.opt_state,
                           optimizer=self.optimizer,
                           mini_like=lambda s: minis_of(self._batch_like(batch, s), np.ones_like(keep_B))[0][0])
        for epoch in range(algo.ppo_epochs):
            for i, (rows, entropy_X) in enumerate(minis):
                plans.append(passes.plan_for(rows.batch, algo.micro_batch_size, shapes=self.warmup.layout,
                                             in_loss=True))
                rule = None
                if rules:  # the step's first update starts from the behaviour policy: its scores are π_θ's
                    first = epoch == 0 and i == 0
                    current = (rows.old_logp_BxT, entropy_X) if first else None
                    rule = train_update.TokenRule(algo, sampling.key(self.cfg.run.seed), current,
                                                  folds=(step, epoch * len(minis) + i))
                    if not first:
                        plans.append(plans[-1])  # the current policy's forward pass over the same micro-batches
                self.params, self.opt_state, info = passes.update(
                    self.graphdef, self.params, self.opt_state, rows, optimizer=self.optimizer,
                    settings=self.settings, micro=algo.micro_batch_size, shapes=self.warmup.layout, rule=rule)
                infos.append(info)
        infos = jax.device_get(infos)
        stepped = [i for i in infos if not int(i["empty"])] or infos  # empty mini-batches took no step
        sums = ("skipped", "empty", train_update.TOKENS)
        out = {k: float(np.mean([i[k] for i in stepped])) for k in infos[0] if k not in sums}
        out["skipped_updates"] = int(sum(int(i["skipped"]) for i in infos))
        out["groups_kept"] = groups_kept
        out["update_tokens"] = sum(float(i[train_update.TOKENS]) for i in infos)  # response tokens trained
        out["positions"] = sum(p.positions for p in plans)
        out["padding"] = sum(p.padding for p in plans)
        return out

    def _batch_like(self, batch: train_step.Batch, prompt_len: int) -> train_step.Batch:
        """A batch of zeros placed as `batch`, with prompts of `prompt_len` tokens (the warm-up's template for the
        programs of another prompt bucket)."""
        _, blocks = parallel.batch_block(self.mesh)
        rows, t = batch.response_mask.shape[0] // blocks, batch.response_mask.shape[1]
        zeros = lambda width: np.zeros((rows, width), np.int32)  # noqa: E731
        like = train_step.build_batch(zeros(prompt_len), zeros(prompt_len) + 1, zeros(t), zeros(t),
                                      np.zeros(rows, np.float32), np.zeros(rows, bool), batch.group_size)
        return shard_rows(like, self.mesh)
