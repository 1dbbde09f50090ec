"""The Trainer's rollouts: one step's sampling rounds (DAPO dynamic sampling draws more rounds until enough groups
have mixed correctness, train/dynamic.py) and the validation rollouts on data.eval_datasets (which steps validate,
and a validation a kill interrupted, run again first on resume).

`SamplingRounds` is a mixin of `train.loop.Trainer`: it reads the trainer's cfg, rng_key_data, tokenizer, mesh,
loader, reward_cfg, stop_ids, eval_sets, stop signal and policy (`self.model`; the training rollouts use
`self.rollout_model()` on `self.rollout_mesh`, the same unless mesh.rollout_devices > 0), and advances only the
data iterator.

The rewards of a step's one round overlap the step: `_sample(step, overlap=True)` hands the responses to the
verifier (a thread that feeds its worker processes, rewards/bounded.py) and returns at once with `PendingRewards`;
the trainer runs the score and reference passes meanwhile and collects the rewards before the advantages, which
are the first to need them (train/loop.py). What a step computes is the same: the rewards are the verifier's for
the same texts, and nothing before the advantages reads them. Dynamic sampling needs each round's correctness to
decide the next round, and the rollout side of a split run ships finished rewards: both wait for them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from g2rl_jax import parallel
from g2rl_jax.data import encode_prompts
from g2rl_jax.rewards.scoring import RewardResult, compute_rewards
from g2rl_jax.rollout import generate
from g2rl_jax.rollout.generate import warm
from g2rl_jax.train import dynamic, report
from g2rl_jax.train.lifecycle import Preempted
from g2rl_jax.train.metrics import read_metrics
from g2rl_jax.train.stages import stage


@jax.jit
def _seed_of(key_data, step, round_, block):
    """A rollout round's sampling seed from the run's key (one program for every step, round and block)."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
    key = jax.lax.cond(round_ > 0, lambda k: jax.random.fold_in(k, round_), lambda k: k, key)  # round 0: the step's
    key = jax.lax.cond(block > 0, lambda k: jax.random.fold_in(k, 2**20 + block), lambda k: k, key)  # one process
    return jax.random.randint(key, (), 0, 2**31 - 1)


_REWARDS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards")


class PendingRewards:
    """A round's rewards on their way: compute_rewards running in the rewards thread (which hands the checks to the
    verifier's worker processes) while the caller goes on; `result()` waits for them and re-raises what they raised
    (a user reward function's RewardFunctionError), `waited` says how long it waited."""

    def __init__(self, *args, **kwargs):
        self._future = _REWARDS.submit(compute_rewards, *args, **kwargs)
        self.waited = 0.0

    def result(self) -> RewardResult:
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self.waited += time.perf_counter() - start


def picked(rounds: list[tuple], correct: list[np.ndarray], m: int, blocks: int, block: int) -> tuple:
    """Dynamic sampling's groups of block `block` of `blocks` (dynamic.choose_groups) from each round's (examples,
    rollout, texts, rewards) of that block's rows and each round's global correctness: (examples, rollout, texts,
    rewards) of the step."""
    picks = dynamic.choose_groups([dynamic.mixed_groups(c, m) for c in correct], blocks, block)
    rows = [(r, g * m + j) for r, g in picks for j in range(m)]
    examples = [rounds[r][0][g] for r, g in picks]
    texts = [rounds[r][2][b] for r, b in rows]
    scored = type(rounds[0][3])(**{f.name: np.array([getattr(rounds[r][3], f.name)[b] for r, b in rows])
                                   for f in dataclasses.fields(rounds[0][3])})
    rollout = dynamic.merge_rollouts([x[1] for x in rounds], picks)
    return examples, rollout, texts, scored


class SamplingRounds:
    """Rollout rounds of a training step, and validation (see the module docstring)."""

    def _step_seed(self, step: int, round_: int = 0, block: int = 0) -> int:
        return int(_seed_of(self.rng_key_data, step, round_, block))  # block 0 keeps the seed of one process

    def _rollout_share(self) -> tuple[int, int]:
        """(i, n): the rollout mesh samples block i of the n blocks of the step's prompts by itself. (0, 1) when it
        spans every process (one mesh for both sides, or one process); with several processes and
        mesh.rollout_devices, each process's rollout devices sample its own block (parallel.split_meshes)."""
        if self.ahead is None or parallel.host_count() == 1:
            return 0, 1
        return parallel.batch_block(self.mesh)

    def _gather_rollout(self, name: str, local: np.ndarray) -> np.ndarray:
        """Every block's rows of `local` in block order, on every process (parallel.gather_blocks); host to host
        through jax.distributed's key-value store when the rollout runs beside the trainer (train/ahead.py)."""
        block, blocks = self._rollout_share()
        if blocks == 1:
            return parallel.gather_blocks(self.mesh, local)
        return np.concatenate(self.ahead.exchange(name, local, block), axis=0)

    def _sample_round(self, step: int, round_: int, overlap: bool = False):
        """One rollout round: the next prompts from the data iterator, their samples and ±1 rewards (with `overlap`,
        PendingRewards: the module docstring)."""
        cfg, m = self.cfg, self.cfg.rollout.num_samples
        examples = next(self.loader)
        prompts = encode_prompts(examples, self.tokenizer, cfg.data.prompt_template)
        longest = max(map(len, prompts))
        block, blocks = self._rollout_share()  # the prompts this process's rollout mesh samples: all, or its block
        if blocks > 1:  # the bucket of the global batch's longest prompt, the same on every process
            longest = int(np.max(self.ahead.exchange(f"longest/{step}/{round_}", np.int32(longest), block)))
        elif parallel.host_count() > 1:
            longest = int(np.max(parallel.allgather(np.int32(longest))))
        t0 = time.perf_counter()
        with stage("rollout", prompts=prompts):
            rollout = generate(self.rollout_model(), prompts, max_new_tokens=cfg.rollout.max_new_tokens,
                               temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                               top_k=cfg.rollout.top_k or 0, num_samples=m, stop_token_ids=self.stop_ids,
                               seed=self._step_seed(step, round_, block), mesh=self.rollout_mesh,
                               compile_threads=self.warmup.threads, first_capacity=cfg.rollout.first_capacity,
                               pad_to=(cfg.data.prompts_per_step // blocks, self.warmup.prompt_len(longest)))
        t1 = time.perf_counter()
        texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rows = [ex.as_row() for ex in examples for _ in range(m)]
        args = (texts, rows, rollout.completion_ids, self.reward_cfg)
        kwargs = dict(kind=examples[0].kind, max_new_tokens=cfg.rollout.max_new_tokens, stop_ids=self.stop_ids)
        if overlap:
            return examples, rollout, texts, PendingRewards(*args, **kwargs), t1 - t0
        with stage("rewards", texts=texts):
            scored = compute_rewards(*args, **kwargs)
        return examples, rollout, texts, scored, t1 - t0

    def _sample(self, step: int, overlap: bool = False):
        """The step's groups: one round, or DAPO dynamic sampling over rounds (train/dynamic.py). Returns examples,
        rollout, texts, rewards (this process's rows, a RewardResult; with `overlap` and one round, PendingRewards),
        rollout seconds, and each round's global correctness (dynamic sampling only)."""
        block, blocks = parallel.batch_block(self.mesh)
        if not self.cfg.algorithm.dynamic_sampling:
            return *self._sample_round(step, 0, overlap), []
        rounds, correct, rollout_s = self._rounds(step, blocks)
        return *picked(rounds, correct, self.cfg.rollout.num_samples, blocks, block), rollout_s, correct

    def _rounds(self, step: int, blocks: int) -> tuple[list[tuple], list[np.ndarray], float]:
        """Dynamic sampling's rounds until each of `blocks` blocks of the batch holds its share of mixed groups (or
        algorithm.max_sampling_rounds): each round's (examples, rollout, texts, rewards) of this process's rows,
        each round's global correctness, and the rollout seconds."""
        algo, m = self.cfg.algorithm, self.cfg.rollout.num_samples
        rounds, correct, mixed, rollout_s = [], [], [], 0.0
        while True:
            examples, rollout, texts, scored, seconds = self._sample_round(step, len(rounds))
            rounds.append((examples, rollout, texts, scored))
            rollout_s += seconds
            correct.append(self._gather_rollout(f"correct/{step}/{len(rounds)}", scored.correct))  # every process alike
            mixed.append(dynamic.mixed_groups(correct[-1], m))
            if dynamic.enough(mixed, blocks) or len(rounds) == algo.max_sampling_rounds:
                return rounds, correct, rollout_s

    def _sampling_metrics(self, sampled_correct: list[np.ndarray]) -> dict[str, float]:
        """Dynamic sampling only: rollout rounds this step, and the accuracy over every response they drew (the
        step's own `accuracy` is biased toward 0.5 by the choice of mixed groups)."""
        if not self.cfg.algorithm.dynamic_sampling:
            return {}
        return {"sampling_rounds": len(sampled_correct),
                "sampled_accuracy": float(np.mean(np.concatenate(sampled_correct)))}

    def validate(self) -> dict[str, float]:
        """mean@k accuracy on data.eval_datasets under the evaluation sampling settings (k = data.eval_samples),
        over the prompts that fit data.max_prompt_tokens (the training filter); {} when run.eval_every=0 (nothing
        is loaded then). A SIGTERM abandons it."""
        cfg = self.cfg.data
        block, blocks = parallel.batch_block(self.mesh)
        out = {}
        for name, examples in self.eval_sets.items():
            correct, all_flags = [], []
            for start in range(0, len(examples), cfg.prompts_per_step):
                if self._stop_requested():
                    raise Preempted(f"validation on {name!r} abandoned for SIGTERM")
                chunk = examples[start:start + cfg.prompts_per_step]
                real = len(chunk) * cfg.eval_samples
                chunk = chunk + chunk[-1:] * (-len(chunk) % blocks)  # equal blocks per process; copies not counted
                local = chunk[block * len(chunk) // blocks:(block + 1) * len(chunk) // blocks]
                prompts = encode_prompts(local, self.tokenizer, cfg.prompt_template)
                with stage("validate", dataset=name, prompts=prompts):
                    rollout = generate(self.model, prompts, max_new_tokens=cfg.eval_max_new_tokens,
                                       temperature=cfg.eval_temperature, num_samples=cfg.eval_samples,
                                       stop_token_ids=self.stop_ids, seed=self.cfg.run.seed + start, mesh=self.mesh,
                                       compile_threads=self.warmup.threads,
                                       first_capacity=self.cfg.rollout.first_capacity,
                                       pad_to=(cfg.prompts_per_step, self.eval_prompt_len))
                    texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
                    rows = [ex.as_row() for ex in local for _ in range(cfg.eval_samples)]
                    scored = compute_rewards(texts, rows, rollout.completion_ids, self.reward_cfg,
                                             kind=local[0].kind, max_new_tokens=cfg.eval_max_new_tokens,
                                             stop_ids=self.stop_ids)
                correct.append(parallel.gather_blocks(self.mesh, scored.correct)[:real])
                flags = report.response_flags(texts, rollout.finish_reasons)  # [B, len(report.SHARES)]
                all_flags.append(parallel.gather_blocks(self.mesh, flags)[:real])
            out[f"val/{name}/mean@{cfg.eval_samples}"] = float(np.mean(np.concatenate(correct)))
            shares = np.mean(np.concatenate(all_flags), axis=0)
            out |= {f"val/{name}/{k}": float(v) for k, v in zip(report.SHARES, shares)}
        return out

    def warm_prompt_buckets(self) -> None:
        """Compile the rollout at every prompt bucket of the run (train/warmup.py chose them on the first step,
        whose rollout compiled the largest), without running it."""
        cfg = self.cfg
        if jax.process_index() not in {d.process_index for d in self.rollout_mesh.devices.flat}:
            return  # one process per side: the rollout process compiles its own
        for prompt_len in self.warmup.prompts:
            if prompt_len not in self._warmed_prompts:
                self._warmed_prompts.add(prompt_len)
                if prompt_len != max(self.warmup.shares):
                    warm(self.rollout_model(), num_prompts=cfg.data.prompts_per_step // self._rollout_share()[1],
                         prompt_len=prompt_len,
                         max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                         top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k or 0, num_samples=cfg.rollout.num_samples,
                         stop_token_ids=self.stop_ids, mesh=self.rollout_mesh, compile_threads=self.warmup.threads,
                         first_capacity=cfg.rollout.first_capacity)

    def warm_validation(self) -> None:
        """Compile the validation's rollout (generate.warm) without running it: a resumed run validates first after
        its warm-up step, which must leave nothing to compile."""
        cfg = self.cfg.data
        if self.eval_sets:
            warm(self.model, num_prompts=cfg.prompts_per_step, prompt_len=self.eval_prompt_len,
                 max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.eval_temperature,
                 num_samples=cfg.eval_samples, stop_token_ids=self.stop_ids, mesh=self.mesh,
                 compile_threads=self.warmup.threads, first_capacity=self.cfg.rollout.first_capacity)

    def _stop_requested(self) -> bool:
        """Whether a SIGTERM asked to stop; every process agrees (any process's request stops them all)."""
        flag = self.stop.requested
        if parallel.host_count() > 1:
            flag = bool(np.max(parallel.allgather(np.int32(flag))))
        return flag

    def _validates(self, step: int) -> bool:
        """Whether step `step` (finished) is followed by a validation: every run.eval_every steps and the last."""
        every = self.cfg.run.eval_every
        return bool(every) and step > 0 and (step % every == 0 or step == self.cfg.run.total_steps)

    def _missing_validation(self) -> bool:
        """Whether the restored step is one to validate and metrics.jsonl has no validation record of it (a kill
        after its checkpoint committed, before its validation's record reached the run directory); process 0's
        reading, which every process follows."""
        flag = self._validates(self.step) and not any(
            k.startswith("val/") for r in read_metrics(self.run_dir) if r["step"] == self.step for k in r)
        if parallel.host_count() > 1:
            flag = bool(np.asarray(parallel.allgather(np.int32(flag))).reshape(-1)[0])
        return flag

    def _validate_step(self) -> dict[str, float]:
        """The validation of a finished step (its record written, its checkpoint saved unless not due); Ctrl-C
        during it saves the step's checkpoint before the interruption goes on (SIGTERM: run's own save)."""
        try:
            return self.validate()
        except KeyboardInterrupt:
            self.ckpt.save(self.step, self.state(), self.loader, force=True)
            raise
