"""Per-step scalar metrics to the loggers of run.loggers: `<run_dir>/metrics.jsonl` (always), TensorBoard events,
Weights & Biases (optional extra, `pip install -e ".[wandb]"`), and a tqdm progress bar.

Only process 0 writes (on other processes every method is a no-op), so multi-host runs produce one file.

    check_loggers(cfg.run.loggers)                                    # before anything heavy: is wandb installed?
    metrics = MetricsWriter(run_dir, start_step=restored_step or 0, loggers=cfg.run.loggers, config=to_dict(cfg))
    bar = ProgressBar(total_steps=cfg.run.total_steps, start_step=restored_step or 0)
    for step in range(start + 1, total + 1):
        scalars = {"accuracy": ..., "reward": ..., "kl": ..., "entropy": ..., "tokens_per_second": ...}
        metrics.write(step, scalars)
        bar.update(step, scalars)
    metrics.close(); bar.close()

Each step's record is written once. The trainer writes a step's training record before its checkpoint and its
validation, and the validation's figures (val/...) as a second record of the same step; `read_metrics` gives one
record per step, the step's records merged in order (`metric_lines`: the lines as written). Every append is
conditional on the version of the file this writer last wrote (g2rl_jax/storage_append.py), so a retried request
never doubles a line, and a writer whose file another writer changed (a trainer that lost the run) raises
storage.ObjectChanged and writes nothing.

Storage (g2rl_jax.storage): run_dir may be a URL. On GCS, where an object cannot be appended to and an object may
be updated about once a second, the records are buffered and composed onto metrics.jsonl (one part upload and one
compose whatever the file's size) every $G2RL_JAX_FLUSH_SECONDS (default 5 s), at `flush()` (the trainer's every
checkpoint, before the save) and at `close()`; TensorBoard's events, written to a local directory, have their new
bytes composed onto their object on the same schedule; W&B keeps its local files in the cache
(storage.scratch_dir). Compose parts left by a killed writer are deleted when the next writer opens the run (it
holds the run lock). What a kill -9 loses is at most the records since the last flush, all of steps after the last
checkpoint, which the resumed run recomputes (and rewrites: see Resuming).

Resuming: a run restored from the checkpoint at step s writes steps s+1, s+2, ... again, so MetricsWriter first
rewrites metrics.jsonl without the records past s (and a torn last line from a kill mid-write), making the file
equal to an uninterrupted run's; TensorBoard is told the same through `purge_step=s+1`. A start from step 0 moves
an existing metrics.jsonl aside (metrics.jsonl.1, .2, ...) instead.
`step_metrics(...)` is the trainer's record of one step (reductions over the global arrays, the learning rate and
the sampler's log-prob drift, all one program; the update's figures, the stage times); part of it,
`single_class_metrics(signal, novelty=)` reduces the step's single-class diagnostics (shares of single-class and
all-wrong groups, the advantages they give their most and least novel response).
Non-finite values are written as JSON null (strict JSON) and skipped in TensorBoard and W&B.
W&B: the run's id is kept in `<run_dir>/wandb_id.txt`, so a resumed run continues the same W&B run (resume
"allow"); W&B cannot take back steps it already has, so after a resume it ignores (and warns about) the steps
it had logged past the checkpoint, while metrics.jsonl and TensorBoard are rewound. Project and mode come from
W&B's own environment variables (WANDB_PROJECT, default "g2rl_jax"; WANDB_MODE=offline writes
`<run_dir>/wandb/` for a later `wandb sync`).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import secrets
import sys
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from g2rl_jax import storage

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id.txt"
# metric name -> short label shown on the progress bar, in display order
HEADLINE = {"accuracy": "acc", "reward": "reward", "kl": "kl", "entropy": "ent", "tokens_per_second": "tok/s",
            "programs_compiled": "compiled", "compile_seconds": "compile s"}


def _masked_sums(x_B, mask_B):
    """(rows where mask is set, the sum of x over them); traced."""
    return jnp.sum(mask_B), jnp.sum(jnp.where(mask_B, x_B, 0.0))


def _token_sums(mask_BxT, entropy_BxT):
    """(response tokens, the entropy summed over them); traced."""
    return jnp.sum(mask_BxT), jnp.sum(entropy_BxT * mask_BxT)


def _drift(sampler_logp_BxT, scorer_logp_BxT, response_mask_BxT):
    """(mean, max) of |sampler - scorer| log-probs over the response tokens; traced."""
    mask_BxT = response_mask_BxT > 0
    diff_BxT = jnp.where(mask_BxT, jnp.abs(jnp.asarray(sampler_logp_BxT, jnp.float32)
                                           - jnp.asarray(scorer_logp_BxT, jnp.float32)), 0.0)
    return diff_BxT.sum() / jnp.maximum(mask_BxT.sum(), 1), diff_BxT.max()


@functools.partial(jax.jit, static_argnames=("schedule",))
def _reductions(means, masked, tokens=None, drift=None, update=None, *, schedule=None):
    """Every device reduction of a step's record, as one program: the mean of each array of `means`, each masked
    (x_B, mask_B) of `masked` as _masked_sums, tokens = (mask_BxT, entropy_BxT) as _token_sums, drift = (sampler,
    scorer, mask) [B, T] as _drift, and the learning rate schedule(update) (the optimizer's schedule)."""
    return {"means": jax.tree.map(jnp.mean, means), "masked": {k: _masked_sums(*v) for k, v in masked.items()},
            "tokens": None if tokens is None else _token_sums(*tokens),
            "drift": None if drift is None else _drift(*drift),
            "learning_rate": None if schedule is None else schedule(update)}


def _masked_means(sums: Mapping[str, tuple], names) -> dict[str, float]:
    """The masked mean of each of `names`, in that order, from its (rows, sum): NaN (written as null) when no row
    is set. Both sums run every step, so the program compiles at the first step, not at the first step that has a
    masked row."""
    out = {}
    for name in names:
        count, total = (float(x) for x in sums[name])
        out[name] = total / count if count else math.nan
    return out


def _single_class_inputs(signal: Mapping[str, Any], novelty: bool) -> tuple[dict, dict]:
    """What single_class_metrics reduces: the row means {name: x_B} and the masked means {name: (x_B, mask_B)}."""
    single_B, wrong_B = signal["single_class"], signal["all_wrong"]
    masked = {}
    if novelty:
        for which in ("most", "least"):
            adv_B = signal[f"{which}_novel_advantage"]
            masked[f"single_class_adv_{which}_novel"] = (adv_B, single_B)
            masked[f"all_wrong_adv_{which}_novel"] = (adv_B, wrong_B)
    return {"single_class_fraction": single_B, "all_wrong_fraction": wrong_B}, masked


def single_class_metrics(signal: Mapping[str, Any], *, novelty: bool) -> dict[str, float]:
    """Step metrics of the groups whose base correctness is all equal, from `train.step.advantages`' per-group
    arrays (each repeated over its group's rows, so row means are group means): `single_class_fraction` and
    `all_wrong_fraction` (shares of groups), and with novelty (g2rl) the mean advantage those groups give their
    most and least novel response, over all single-class groups and over the all-wrong ones (null if none).
    One program (`step_metrics` reduces these with the rest of a step's record in its own)."""
    means, masked = _single_class_inputs(signal, novelty)
    got = jax.device_get(_reductions(means, masked))
    return {k: float(v) for k, v in got["means"].items()} | _masked_means(got["masked"], masked)


def step_metrics(batch, scores, signal, info, times, *, step: int, learning_rate: tuple, novelty: bool,
                 truncated_B=None, sampling: Mapping[str, float] | None = None,
                 sampler_logp_BxT=None) -> dict[str, float]:
    """The trainer's record of one step: reductions over the global arrays (every process gets the same numbers),
    the update's `info`, and the stage times `times` = (start, rollout done, rewards done, advantages done, update
    done) in perf_counter seconds; truncated_B: 1 for each response that hit the budget; learning_rate =
    (schedule, update): the optimizer's schedule and the update whose rate to show; `sampling`: the rollout rounds'
    figures (dynamic sampling); sampler_logp_BxT: the sampler's log-probs, for how far they drift from the scoring
    pass's (rollout_logprob_diff_mean / _max: the two engines compute the same log softmax(z / T)[token], so a
    value far above float rounding means they drifted apart). Every reduction is one program (`_reductions`)."""
    t0, t1, t2, t3, t4 = times
    mask_BxT = batch.response_mask
    means = {"accuracy": batch.correct, "reward": signal["shaped_rewards"],
             **({"novelty": signal["nu"]} if novelty else {}),
             **({} if truncated_B is None else {"truncated_fraction": truncated_B})}
    class_means, masked = _single_class_inputs(signal, novelty)
    schedule, update = learning_rate
    drift = None if sampler_logp_BxT is None else (sampler_logp_BxT, scores.logp_BxT, mask_BxT)
    got = jax.device_get(_reductions(means | class_means, masked, (mask_BxT, scores.entropy_BxT), drift, update,
                                     schedule=schedule))
    means = {k: float(v) for k, v in got["means"].items()}
    tokens, entropy = (float(x) for x in got["tokens"])
    out = {"novelty": means["novelty"]} if novelty else {}
    out |= {
        "step": step + 1,
        "accuracy": means["accuracy"],
        "reward": means["reward"],
        "loss": info["loss"], "kl": info.get("kl", 0.0),
        "entropy": entropy / max(tokens, 1.0),
        "response_length": tokens / mask_BxT.shape[0],
        "clip_fraction": info["clip_frac_low"] + info["clip_frac_high"],
        "approx_kl": info["approx_kl"], "grad_norm": info["grad_norm"],
        "learning_rate": float(got["learning_rate"]),
        "skipped_updates": info["skipped_updates"], "groups_kept": info["groups_kept"],
        "rollout_seconds": t1 - t0, "reward_seconds": t2 - t1, "score_seconds": t3 - t2,
        "update_seconds": t4 - t3,
        "tokens_per_second": tokens / max(t4 - t0, 1e-9),
        "update_tokens_per_second": info["update_tokens"] / max(t4 - t3, 1e-9),
        "padding_fraction": info["padding"] / max(info["positions"], 1),
    }
    if truncated_B is not None:
        out["truncated_fraction"] = means["truncated_fraction"]
    out |= {k: v for k, v in means.items() if k in class_means}  # in the order the program returns them
    out |= _masked_means(got["masked"], masked)
    out |= {k: info[k] for k in ("rollout_is_weight_mean", "rollout_is_capped_frac") if k in info}
    out |= dict(sampling or {})
    if drift is not None:
        out["rollout_logprob_diff_mean"], out["rollout_logprob_diff_max"] = (float(x) for x in got["drift"])
    return out


def _summary_writer(*args, **kwargs):
    """A tensorboardX SummaryWriter, its module imported without torch: where torch is installed, tensorboardX imports
    it (about 2 s of every trainer start) only to accept torch tensors, which the trainer never logs. `torch` stays
    importable afterwards (a reward that uses it is unaffected)."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's path without torch
        try:
            import tensorboardX  # noqa: F401 - imported once here, without torch
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter(*args, **kwargs)


def _is_writer() -> bool:
    return jax.process_index() == 0


def _as_number(name: str, value) -> int | float:
    """A Python int/float from a Python, NumPy or 0-d JAX scalar; anything else is an error naming the metric."""
    array = np.asarray(value)
    if array.shape != () or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise TypeError(f"metric {name!r} must be a real scalar, got {type(value).__name__} "
                        f"with shape {array.shape} and dtype {array.dtype}")
    return array.item() if np.issubdtype(array.dtype, np.integer) else float(array)


def check_loggers(loggers) -> None:
    """Fail early, with the fix, when a requested logger's package is missing (only wandb is optional)."""
    if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
        from g2rl_jax.config import ConfigError

        raise ConfigError("run.loggers: wandb is listed but the wandb package is not installed; "
                          "pip install -e \".[wandb]\" (or drop wandb from run.loggers)")


def _local_dir(run_dir, purpose: str):
    """run_dir itself, or for a URL the local directory kept for it (storage.scratch_dir): TensorBoard's writer and
    W&B write local files only."""
    return storage.scratch_dir(run_dir, purpose) if storage.is_url(run_dir) else run_dir


def _wandb_run(run_dir, config: Mapping[str, Any] | None):
    """Start (or, with the id kept in run_dir, resume) the W&B run of this training run."""
    import wandb

    id_file = run_dir / WANDB_ID_FILE
    run_id = storage.read_text(id_file).strip() if storage.exists(id_file) else secrets.token_hex(4)  # [a-z0-9]
    storage.write_text(id_file, run_id + "\n")
    return wandb.init(dir=str(_local_dir(run_dir, "wandb")), id=run_id, resume="allow", name=run_dir.name,
                      config=dict(config or {}), project=os.environ.get("WANDB_PROJECT", "g2rl_jax"))


def metric_lines(run_dir: str | os.PathLike) -> list[dict]:
    """Every complete line of run_dir/metrics.jsonl as written (a torn final line from a kill is ignored): a
    validated step has two, its training record and its validation's."""
    path = storage.path(run_dir) / METRICS_FILE
    if not storage.exists(path):
        return []
    lines = storage.read_text(path).splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number} is not valid JSON and is not the last line; "
                                 "the file was edited or corrupted, fix or delete that line") from None
    return records


def merge_steps(lines: list[dict]) -> list[dict]:
    """One record per step, in the order of each step's first line: the step's lines merged in order."""
    by_step: dict[int, dict] = {}
    for line in lines:
        by_step.setdefault(line["step"], {}).update(line)
    return list(by_step.values())


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of run_dir/metrics.jsonl, one per step (metric_lines merged by step)."""
    return merge_steps(metric_lines(run_dir))


def _move_aside(path):
    """Rename `path` to the first free `<name>.<n>` and return the new path."""
    n = 1
    while storage.exists(path.with_name(f"{path.name}.{n}")):
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    storage.move(path, target)
    return target


def _truncate(run_dir, start_step: int) -> None:
    """Rewrite metrics.jsonl whole with only the records of steps <= start_step: a run resumed at step k keeps what
    steps 1..k wrote (and the step-0 validation). A run that (re)starts from step 0 (no checkpoint) begins a new
    file; a non-empty old one is moved aside to metrics.jsonl.<n>, never truncated."""
    path = run_dir / METRICS_FILE
    if start_step == 0 and storage.exists(path) and storage.path(path).stat().length:
        print(f"warning: no checkpoint to resume from, so this run starts at step 0; the existing {path} was "
              f"moved to {_move_aside(path)}", file=sys.stderr, flush=True)
    kept = [r for r in metric_lines(run_dir) if r["step"] <= start_step] if start_step > 0 else []
    storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


class MetricsWriter:
    """Append one JSON line (and TensorBoard / W&B scalars, as `loggers` asks) per `write`: a step's training
    record, and a validated step's validation record; records past `start_step` are dropped on open."""

    def __init__(self, run_dir: str | os.PathLike, *, start_step: int, loggers=("jsonl", "tensorboard"),
                 config: Mapping[str, Any] | None = None):
        self._enabled = _is_writer()
        if not self._enabled:
            return
        check_loggers(loggers)
        run_dir = storage.path(run_dir)
        storage.makedirs(run_dir)
        for folder in (run_dir, run_dir / TENSORBOARD_DIR):
            storage.remove_orphan_parts(folder)  # a killed writer's; this one holds the run
        _truncate(run_dir, start_step)
        self._file = storage.Appender(run_dir / METRICS_FILE)  # on GCS buffered, composed onto the object
        self._tb = self._wandb = self._tb_mirror = None
        if "tensorboard" in loggers:
            events = run_dir / TENSORBOARD_DIR
            if storage.is_url(events):  # written locally, each flush's new bytes appended to the bucket's copy
                self._tb_mirror = storage.Mirror(events, TENSORBOARD_DIR)
            # a unique file per writer: tensorboardX names files by the second, so a quick resume would clobber one
            self._tb = _summary_writer(str(self._tb_mirror.local_dir if self._tb_mirror else events),
                                       purge_step=start_step + 1 if start_step else 0,
                                       filename_suffix=f".{os.getpid()}.{time.time_ns()}")
        if "wandb" in loggers:
            self._wandb = _wandb_run(run_dir, config)

    def write(self, step: int, scalars: Mapping[str, object]) -> None:
        if not self._enabled:
            return
        record = {"step": int(step)}
        if "step" in scalars and _as_number("step", scalars["step"]) != step:
            raise ValueError(f"metrics carry step={scalars['step']} but are written for step {step}")
        for name, value in ((k, v) for k, v in scalars.items() if k != "step"):
            number = _as_number(name, value)
            record[name] = number if math.isfinite(number) else None
        finite = {k: v for k, v in record.items() if k != "step" and v is not None}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for name, number in finite.items():
                self._tb.add_scalar(name, number, global_step=int(step))
            self._tb.flush()
            if self._tb_mirror is not None:
                self._tb_mirror.sync()
        if self._wandb is not None:
            self._wandb.log(finite, step=int(step))

    def flush(self) -> None:
        """Everything written so far to the run directory now (the trainer calls it at every checkpoint)."""
        if self._enabled:
            self._file.flush()
            if self._tb_mirror is not None:
                self._tb.flush()
                self._tb_mirror.sync(force=True)

    def close(self) -> None:
        if self._enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
                if self._tb_mirror is not None:
                    self._tb_mirror.close()
            if self._wandb is not None:
                self._wandb.finish()


class ProgressBar:
    """tqdm bar over RL steps showing the HEADLINE metrics present in each update (process 0 only)."""

    def __init__(self, *, total_steps: int, start_step: int):
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=not _is_writer())
        self._step = start_step

    def update(self, step: int, scalars: Mapping[str, object]) -> None:
        shown = {label: f"{_as_number(name, scalars[name]):.4g}" for name, label in HEADLINE.items()
                 if name in scalars}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(step - self._step)
        self._step = step

    def close(self) -> None:
        self._bar.close()
