"""The training loop (the command `python -m g2rl_jax.train --config FILE [key=value ...]` is train/command.py).

    trainer = Trainer(cfg)         # checks everything cheap first, then loads models, data, optimizer
    trainer.resume()               # from the newest checkpoint of run.output_dir, if any
    trainer.run()                  # rollout → rewards → score → novelty/advantages → update → metrics/ckpt

`Trainer.step_stages(step)` runs one step and returns every intermediate (rollout, batch, scores, signal, info),
which is what the Colab notebook shows; its rollout rounds and the validation are in train/sampling_rounds.py.
One mesh serves the policy, the reference model and the sampler: the sampler reads the very arrays the optimizer
updates, so no weights are copied or synchronised between them. With LoRA (model.lora.rank > 0) the params hold the
frozen base and the adapters; the optimizer state, the gradients and the checkpoints cover the adapters only, and the
reference policy is the same params with the adapters switched off (g2rl_jax/model/lora.py).

Multi-host (`distributed.*`, see parallel.initialize_distributed): every process runs this same loop. Process
block i of n (parallel.batch_block) reads rows [i·P/n, (i+1)·P/n) of each global prompt batch, gets its own
samples back from `generate`, scores their rewards locally, and contributes its rows to the global `Batch`
(parallel.global_rows); scoring, advantages and the update run on the global arrays, and every metric is a
reduction over them, so all processes agree and equal a one-process run on the same mesh. Only process 0 writes
metrics; checkpoints are Orbax multi-host (every process saves its shards and its data-iterator position).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from g2rl_jax import methods, parallel, storage
from g2rl_jax.config import Config, ConfigError, save_resolved, to_dict
from g2rl_jax.control import fence
from g2rl_jax.control.errors import RunFailure, device_boundary, device_failure, end_run
from g2rl_jax.control.runlock import RunLock
from g2rl_jax.data import make_prompt_loader
from g2rl_jax.model import load_pretrained, lora, peft_io
from g2rl_jax.rewards import answers_found
from g2rl_jax.rewards.custom import check_function, resolve_spec
from g2rl_jax.rollout import Rollout, sampling
from g2rl_jax.rollout.batching import MIN_PROMPT_BUCKET, bucket
from g2rl_jax.train import compiles, identity, passes, report, warmup
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update
from g2rl_jax.train.ahead import AheadSampler
from g2rl_jax.train.checkpoint import Checkpointer, check_model, latest_step
from g2rl_jax.train.lifecycle import (
    Preempted,
    StopSignal,
    append_history,
    check_resume_config,
    pin_revision,
)
from g2rl_jax.train.metrics import MetricsWriter, ProgressBar, check_loggers, read_metrics, step_metrics
from g2rl_jax.train.sampling_rounds import PendingRewards, SamplingRounds
from g2rl_jax.train.setup import (
    check_shared_output_dir,
    compilation_cache,
    copy_tree,
    embed_texts,
    eval_examples,
    load_model,
    load_rows,
    on_mesh,
    preflight,
    probe_output_dir,
    prompt_lengths,
    resolve_model_paths,
    runtime_config,
    shard_rows,
    stop_token_ids,
    usable_examples,
)
from g2rl_jax.train.sides import RemoteSampler
from g2rl_jax.train.stages import stage
from g2rl_jax.train.update_rounds import UpdateRounds


@dataclasses.dataclass
class StepResult:
    """Everything one step produced, for interactive inspection."""

    rollout: Rollout
    texts: list[str]
    batch: train_step.Batch
    scores: train_step.Scores
    ref_logp: jax.Array | None
    signal: dict[str, jax.Array]
    info: dict[str, float]
    metrics: dict[str, float]


class Trainer(SamplingRounds, UpdateRounds):
    """Holds the run: mesh, policy (graphdef, params), reference params, optimizer, data iterator, checkpoints."""

    def __init__(self, cfg: Config):
        self.started = time.perf_counter()
        self.clock = compiles.CompileClock()  # what the run compiles, step by step (train/compiles.py)
        preflight(cfg, model_dirs=False, output_dir=jax.process_index() == 0)  # the others probe under its lease
        self.run_dir = storage.path(cfg.run.output_dir, "run.output_dir")  # a local path or a URL
        check_shared_output_dir(cfg.run.output_dir)  # multi-host: every host must see the same run directory
        self.lock = RunLock(self.run_dir, cfg.run.lock_lease_seconds)  # process 0 holds it, the others follow
        self.ckpt = None
        self.ahead: AheadSampler | None = None  # the rollout driver on its own mesh (train/ahead.py), set by _setup
        self.stop = StopSignal(cfg.run.preempt_grace_seconds, on_abandon=self._abandon)
        self.preempted = False
        self.lock.take(jax.process_index())
        try:
            # a peer gone from a host collective: PeerLost; what a thawed process meets: the lease decides
            with self.lock.judged(), device_boundary("the run's setup"):
                self._setup(cfg)
        except BaseException:
            self.close()
            raise

    def _setup(self, given: Config) -> None:
        """Every check, then models, data and optimizer; config.yaml and the history are written last, so a
        relaunch that fails a check leaves the run's files as they were."""
        from g2rl_jax.data.tokenizer import load_tokenizer

        check_loggers(given.run.loggers)
        if jax.process_index() != 0:  # its probe through the fence: a launch thawed after a takeover writes none
            probe_output_dir(given)
        train_rows, eval_rows = load_rows(given)  # cheap checks first: a bad row is one line before any model resolves
        found = latest_step(self.run_dir)
        given = pin_revision(given, self.run_dir, resuming=found is not None)  # a hub id's commit, kept by resumes
        if found is not None:
            check_resume_config(given, self.run_dir)
        compilation_cache(given.run.compilation_cache_dir)  # before the first compile (the demo model's build)
        cfg = resolve_model_paths(given)  # builds the demo model on first use
        preflight(cfg, output_dir=False)  # probed already (process 0 before the lock was taken, the others above)
        self.cfg = cfg
        lora_on = cfg.model.lora.rank > 0
        self.base_sha256 = identity.base_sha256(cfg.model.path) if lora_on else None
        self.model_record = identity.record(given.model, self.base_sha256)
        if found is not None:
            check_model(self.run_dir, self.model_record)  # before anything is loaded or written
        self.mesh, rollout_mesh = parallel.split_meshes(cfg.mesh)  # rollout_mesh: None unless mesh.rollout_devices
        self.rollout_mesh = self.mesh if rollout_mesh is None else rollout_mesh
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.reward_cfg = cfg.reward  # a reward function's file path made absolute, and checked in a worker
        if cfg.reward.function:
            self.reward_cfg = dataclasses.replace(cfg.reward, function=resolve_spec(cfg.reward.function))
            try:
                check_function(self.reward_cfg.function, cfg.reward.timeout)
            except ValueError as err:
                raise ConfigError(f"reward.function: {err}") from None
        examples, dropped = usable_examples(cfg, self.tokenizer, train_rows)
        self.eval_sets, eval_dropped = eval_examples(cfg, self.tokenizer, eval_rows)
        # a few prompt shapes per run, whatever prompts a step draws (train/warmup.py: a run compiles once)
        train_lengths = prompt_lengths([examples], self.tokenizer, cfg.data)
        self.eval_prompt_len = bucket(int(max(prompt_lengths(self.eval_sets.values(), self.tokenizer, cfg.data),
                                              default=1)), MIN_PROMPT_BUCKET)
        block, blocks = parallel.batch_block(self.mesh)
        if cfg.data.prompts_per_step % blocks:
            raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} must be a multiple of the {blocks} "
                              "process blocks the mesh splits the batch into (one per host along data×fsdp)")
        self.loader = make_prompt_loader(examples, batch_size=cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed,
                                         shard_index=block, shard_count=blocks)
        model = load_model(cfg.model, self.mesh, seed=cfg.run.seed)
        if cfg.model.lora.init_from:
            try:
                peft_io.load_adapter(model, cfg.model.lora.init_from, base_sha256=self.base_sha256)
            except (OSError, ValueError) as err:
                raise ConfigError(f"model.lora.init_from: {err}") from None
        self.graphdef, self.params = nnx.split(model)
        if rollout_mesh is not None:  # one process per side: the draws come from the rollout process (train/sides.py)
            sampler = RemoteSampler if cfg.mesh.rollout_processes else AheadSampler
            self.ahead = sampler(self, self.loader, cfg.rollout.max_staleness)
            self.loader = self.ahead  # it draws the prompts, and checkpoints the samples drawn ahead
        self.ref_graphdef, self.ref_params = self.graphdef, None  # the KL reference (kl_coef > 0), see _reference
        if cfg.algorithm.kl_coef > 0 and lora_on:  # the same params with the adapters off: no copy
            self.ref_graphdef = lora.reference_graphdef(self.graphdef, self.params)
        elif cfg.algorithm.kl_coef > 0:  # frozen, sharded like the policy
            self.ref_params = copy_tree(self.params)
        self.embedder = self.embed_tokenizer = None
        self.method = methods.get(cfg.algorithm.exploration)
        if "embeddings" in self.method.needs:  # evol
            runtime = runtime_config(cfg.model, remat="none")  # frozen: in the base weights' dtype
            self.embedder = load_pretrained(cfg.algorithm.embedding_model, runtime.param_dtype, mesh=self.mesh,
                                            runtime=runtime)
            self.embed_tokenizer = load_tokenizer(cfg.algorithm.embedding_model)
        responses = cfg.data.prompts_per_step * cfg.rollout.num_samples
        if responses % cfg.algorithm.mini_batch_size:
            raise ConfigError(f"algorithm.mini_batch_size={cfg.algorithm.mini_batch_size} must divide the "
                              f"{responses} responses of a step (data.prompts_per_step × rollout.num_samples)")
        self.updates_per_step = cfg.algorithm.ppo_epochs * responses // cfg.algorithm.mini_batch_size
        self.optimizer = train_optim.make_optimizer(cfg.optim, cfg.run.total_steps * self.updates_per_step)
        # the learning rate a step's record shows: computed in the record's program (metrics.step_metrics)
        self.schedule = train_optim.learning_rate_schedule(cfg.optim, cfg.run.total_steps * self.updates_per_step)
        # the trainable params' state (the adapters' with LoRA), each moment sharded like its parameter
        self.opt_state = train_optim.init_optimizer(self.optimizer, lora.trainable(self.params))
        self.settings = train_update.LossSettings.from_config(cfg.algorithm, cfg.rollout.temperature)
        self.warmup = warmup.RunWarmup.for_run(cfg, model.config, self.mesh, self.run_dir, train_lengths)
        self.rng_key_data = jax.device_put(sampling.key_data(cfg.run.seed),  # made on the host, replicated
                                           jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self.step = 0
        self._warmed_prompts: set[int] = set()  # prompt buckets whose rollout is compiled
        self.ckpt = Checkpointer(self.run_dir, every=cfg.run.checkpoint_every, keep=cfg.run.keep_checkpoints,
                                 model=self.model_record)
        if jax.process_index() == 0:  # one writer when the hosts share run.output_dir; demo: paths kept as given
            save_resolved(given, self.run_dir)
            append_history(given, self.run_dir, checkpoint_found=found, train_rows=len(examples),
                           train_dropped_for_length=dropped, eval_dropped_for_length=eval_dropped)

    def _abandon(self) -> None:
        """What an abandoned step leaves (StopSignal, from its watchdog thread): the save in flight written, the
        run directory released."""
        if self.ckpt is not None:
            self.ckpt.wait()
        self.lock.release()

    def close(self) -> None:
        """Release run.output_dir (run() does this when it ends); other trainers may then start on it."""
        self.clock.close()
        if self.ahead is not None:
            self.ahead.close()
        self.lock.release()

    # ------------------------------------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: the trainable params (the adapters with LoRA, every weight without), the
        optimizer state, the step and the RNG key data (the data iterator is saved beside it)."""
        return {"params": lora.trainable(self.params), "opt_state": self.opt_state,
                "step": on_mesh(jax.device_put(np.int32(self.step)), self.mesh), "rng": self.rng_key_data}

    def resume(self) -> int:
        """Restore the newest readable checkpoint, if any (an unreadable newer one is reported and set aside);
        returns the step to continue from."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state())
        with self.lock.judged(), device_boundary("the restore"):  # as the setup (__init__)
            step, restored = self.ckpt.restore_newest(abstract, self.loader)
        if step is not None:
            self.params = nnx.merge_state(lora.split_trainable(self.params)[1], restored["params"])
            self.opt_state = restored["opt_state"]
            self.rng_key_data, self.step = restored["rng"], int(restored["step"])
        return self.step

    def _reference(self):
        """(graphdef, params) of the KL reference policy: with LoRA the live params under the graphdef whose
        adapters are off (the base), else the frozen copy of the initial params."""
        return self.ref_graphdef, self.params if self.ref_params is None else self.ref_params

    @property
    def model(self):
        """The policy as an NNX module over the live (sharded) params; no copy is made."""
        return nnx.merge(self.graphdef, self.params)

    def rollout_model(self):
        """The sampler of the training rollouts: the policy itself, or its copy on the rollout mesh."""
        return self.model if self.ahead is None else self.ahead.model()

    # ------------------------------------------------------------------------------------------- one step
    def step_stages(self, step: int) -> StepResult:
        """Run step `step` stage by stage and return every intermediate; the params are updated in place."""
        cfg, algo = self.cfg, self.cfg.algorithm
        m, micro, temp = cfg.rollout.num_samples, algo.micro_batch_size, self.settings.temperature
        t0 = time.perf_counter()
        # the rewards of a one-round step come while the score and reference passes run (PendingRewards)
        sample, ahead = (self._sample(step, overlap=True), {}) if self.ahead is None else self.ahead.take(step)
        examples, rollout, texts, scored, rollout_s, sampled_correct = sample
        pending = scored if isinstance(scored, PendingRewards) else None
        rewards_B = np.zeros(len(texts), np.float32) if pending else scored.rewards  # the batch's until they come
        t2 = time.perf_counter()
        t1 = t0 + rollout_s
        with stage("batch", prompt_ids=rollout.prompt_ids_BxS, completion_ids=rollout.completion_ids_BxT,
                   rewards=rewards_B):
            batch = train_step.build_batch(rollout.prompt_ids_BxS, rollout.prompt_mask_BxS, rollout.completion_ids_BxT,
                                           rollout.completion_mask_BxT, rewards_B, rewards_B > 0 if pending else
                                           scored.correct, m)
            batch = shard_rows(batch, self.mesh)
        with stage("score", input_ids=batch.input_ids, response_mask=batch.response_mask):
            shapes = self.warmup.score(self.graphdef, self.params, self._reference() if algo.kl_coef > 0 else None,
                                       batch, temperature=temp, micro=micro,
                                       batch_like=functools.partial(self._batch_like, batch))
            self.warm_prompt_buckets()
            scores = passes.score(self.graphdef, self.params, batch, temperature=temp, micro=micro, shapes=shapes)
        ref = None
        if algo.kl_coef > 0:
            with stage("reference", input_ids=batch.input_ids):
                ref = passes.ref_logprobs(*self._reference(), batch, temperature=temp, micro=micro, shapes=shapes)
        embeddings = valid = None
        if "embeddings" in self.method.needs:
            with stage("embed", texts=texts):
                embeddings = embed_texts(self.embedder, self.embed_tokenizer, texts, self.mesh,
                                         algo.embedding_max_tokens)
                valid = shard_rows(answers_found(texts, examples[0].kind), self.mesh)
        if pending is not None:  # the passes are dispatched: what the rewards could not hide is waited for here
            with stage("rewards", texts=texts):
                scored = pending.result()
            batch = train_step.with_rewards(batch, *shard_rows((scored.rewards, scored.correct), self.mesh))
            t2 += pending.waited  # the step's split: the rewards' seconds are the ones the step waited for them
        in_loss_B, truncated_B = shard_rows((scored.in_loss, scored.truncated.astype(np.float32)), self.mesh)
        with stage("advantages", phi=scores.phi_BxD, rewards=batch.rewards):
            logp = scores.logp_BxT if "seq_logp" in self.method.needs else None
            signal = jax.block_until_ready(train_step.advantages(batch, scores.phi_BxD, algo, embeddings, valid, logp))
        t3 = time.perf_counter()
        with stage("update", input_ids=batch.input_ids, advantages=signal["advantages"]):
            sampler_logp = None if algo.rollout_is_cap is None else shard_rows(rollout.logprobs_BxT, self.mesh)
            info = self._update(batch, scores.logp_BxT, ref, signal["advantages"], in_loss_B, sampler_logp,
                                scores.entropy_BxT, step, token_weight=signal.get("token_weight"))
        t4 = time.perf_counter()
        if self.ahead is not None:  # the new version goes to the rollout side
            self.ahead.publish(step + 1, self.params)
            ahead |= self.ahead.sync_figures()
        plan = passes.plan_for(batch, micro, shapes=shapes)  # the plan score (and the reference pass) ran over
        forwards = 1 + (ref is not None)
        info["positions"] += forwards * plan.positions
        info["padding"] += forwards * plan.padding
        metrics = step_metrics(batch, scores, signal, info, (t0, t1, t2, t3, t4), step=step,
                               learning_rate=(self.schedule, (step + 1) * self.updates_per_step - 1),
                               novelty=self.method.novelty, truncated_B=truncated_B,
                               sampling=self._sampling_metrics(sampled_correct),
                               sampler_logp_BxT=shard_rows(rollout.logprobs_BxT, self.mesh))
        metrics |= ahead
        return StepResult(rollout, texts, batch, scores, ref, signal, info, metrics)

    # ------------------------------------------------------------------------------------------- the loop
    def run(self, stop_after: int | None = None) -> list[dict[str, float]]:
        """Train until run.total_steps (or, for tests and notebooks, until step `stop_after`). With
        run.eval_every > 0 it validates before the first update and after the last, and a finished run writes
        summary.json and curves.png (g2rl_jax/train/report.py).

        Each step's record is written (and at a checkpoint flushed) before its checkpoint is saved, and both before
        its validation, whose figures are a second record of the step: a kill at any moment loses no record of a
        committed step, and a resumed run writes none twice (a validation the kill interrupted is run again first,
        `_missing_validation`). SIGTERM stops after the current step with a checkpoint of it when the step's
        measured time fits run.preempt_grace_seconds, else ends the process at once (lifecycle.StopSignal); a
        validation in progress is abandoned; `self.preempted` then says so. Ctrl-C during a validation keeps the
        step's checkpoint too. The run directory is released at the end."""
        cfg = self.cfg.run
        last = cfg.total_steps if stop_after is None else min(stop_after, cfg.total_steps)
        self.lock.take(jax.process_index())
        self.clock.open()
        writer = MetricsWriter(self.run_dir, start_step=self.step, loggers=cfg.loggers, config=to_dict(self.cfg))
        bar = ProgressBar(total_steps=cfg.total_steps, start_step=self.step)
        history, validation = [], None
        warm_step = self.step + 1  # the step that compiles the run's programs; later ones compile none
        after = {"compile_seconds": 0.0, "programs_compiled": 0}  # compiled after the steps' records
        finished = False
        with self.stop:  # SIGTERM: the step finished within run.preempt_grace_seconds, or abandoned
            try:
                if cfg.eval_every and self.step == 0:  # the "before" point of the curves and of summary.json
                    writer.write(0, self.validate())
                elif self._missing_validation():  # a kill ended the restored step's validation: run it now
                    validation = self.validate()
                    writer.write(self.step, validation)
                elif cfg.eval_every:  # a resumed run validates only later: compile its rollout now
                    self.warm_validation()
                while self.step < last and not self._stop_requested():
                    self.stop.begin_step()
                    result = self.step_stages(self.step)
                    self.stop.end_step()
                    self.step += 1
                    figures = self.clock.step_figures(self.step, after_warmup=self.step > warm_step,
                                                      strict=cfg.strict_compiles)
                    self.stop.less_compiles(figures["compile_seconds"])  # what SIGTERM expects of the next step
                    metrics = result.metrics | figures
                    writer.write(self.step, metrics)  # the step's record: before its checkpoint and its validation
                    if self.step % cfg.checkpoint_every == 0 or self.step == cfg.total_steps:
                        writer.flush()  # in the run directory before the checkpoint can commit
                    self.ckpt.save(self.step, self.state(), self.loader, force=self.step == cfg.total_steps)
                    validation = None
                    if self._validates(self.step):
                        validation = self._validate_step()
                        writer.write(self.step, validation)  # the step's second record
                        metrics = metrics | validation
                    # what the save and the validation compiled (the first save: its device-to-host programs):
                    # checked as this step's, counted in summary.json
                    late = self.clock.step_figures(self.step, after_warmup=self.step > warm_step,
                                                   strict=cfg.strict_compiles)
                    after = {k: v + late[k] for k, v in after.items()}
                    bar.update(self.step, metrics)
                    history.append(metrics)
                if self._stop_requested():
                    raise Preempted("SIGTERM")
                finished = self.step == cfg.total_steps and bool(history or validation)
            except Preempted:
                self.preempted = True
                if self.step:
                    self.ckpt.save(self.step, self.state(), self.loader, force=True)
            except Exception as err:  # classified where raised (control/errors.py), or a program's runtime error
                # surfacing outside its stage (JAX dispatches asynchronously): one line, every process stops
                typed = err if isinstance(err, RunFailure) else device_failure(err, f"step {self.step + 1}")
                typed = self.lock.lost(typed or err) or typed  # a thawed process: the lease decides
                if typed is None:
                    raise
                end_run(typed, self.step, self.run_dir, self.cfg)
            finally:
                summarize = functools.partial(self._summarize, history, validation, after) if finished else None
                self._close_run(bar, writer, summarize)
        return history

    def _summarize(self, history: list[dict], validation: dict | None, after: dict[str, float]) -> None:
        """summary.json and curves.png of a finished run (process 0), written under the lease: before its release."""
        compiled = (sum(h["programs_compiled"] for h in history) + after["programs_compiled"],
                    sum(h["compile_seconds"] for h in history) + after["compile_seconds"])
        summary = report.finish(self.run_dir, before=report.before(read_metrics(self.run_dir)), after=validation,
                                steps=self.step, seconds=time.perf_counter() - self.started, compiled=compiled)
        if summary is not None:
            keys = ("accuracy_before", "accuracy_after", *report.SHARES, "steps", "seconds", *report.COMPILE)
            print(json.dumps({k: summary[k] for k in keys}))
            print(f"wrote {self.run_dir / report.SUMMARY_FILE} and {self.run_dir / report.CURVES_FILE}")

    def _close_run(self, bar: ProgressBar, writer: MetricsWriter, summarize=None) -> None:
        """The last flushes, the last save, a finished run's summary (`summarize`) and the lock's release: every
        write of the run under its lease; a bucket that stops answering here too ends the run with one line (the
        checkpoints committed stand)."""
        try:
            bar.close()
            writer.close()
            self.ckpt.close()
            if summarize is not None:
                summarize()
            self.close()
        except RunFailure as err:
            if fence.closed():  # a failure is being reported already (a notebook's): release what this run holds
                self.close()
                return
            end_run(err, self.step, self.run_dir, self.cfg)
