"""The planner's hint for a run that ran out of device memory (control/errors.py's DeviceOutOfMemory): what
`python -m g2rl_jax.plan` would say for the run's config, in one clause. The peak per device on this run's devices;
the largest algorithm.micro_batch_size (a divisor of algorithm.mini_batch_size, smaller than the run's) whose peak
fits the device's memory (when the runtime says how much it has; else the next smaller one); the smallest slice of
this platform's accelerators that holds the run as it is (python -m g2rl_jax.plan's table).
"""
from __future__ import annotations

import dataclasses

GiB = 2**30


def _device_bytes() -> int | None:
    """The memory the runtime gives one device (TPU, GPU), None where it says nothing (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _with_micro(cfg, micro: int):
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, micro_batch_size=micro))


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def hint(cfg, config_path) -> str:
    """The clause for a run of `cfg` (its resolved config at `config_path`) that ran out of device memory."""
    import jax

    from g2rl_jax import plan as planner

    command = f"python -m g2rl_jax.plan --config {config_path}"
    try:
        model, _ = planner.model_config(cfg, None)
        platform = "gpu" if jax.default_backend() == "gpu" else "tpu"
        devices = jax.device_count()
        now = planner.plan(cfg, model, devices, platform)
        limit = _device_bytes()
        usable = None if limit is None else planner.USABLE_FRACTION * limit
        said = [f"the planner puts this run's peak at {_size(now.peak)} per device on {devices} device"
                f"{'s' if devices != 1 else ''} (rollout "
                f"phase {_size(now.persistent + now.rollout_phase)}, update phase "
                f"{_size(now.persistent + now.update_phase)}" + ("" if limit is None else f", of {_size(limit)}")
                + ")"]
        algo = cfg.algorithm
        for micro in sorted((d for d in range(1, algo.micro_batch_size) if algo.mini_batch_size % d == 0),
                            reverse=True):
            smaller = planner.plan(_with_micro(cfg, micro), model, devices, platform)
            update = smaller.persistent + smaller.update_phase
            if update < now.persistent + now.update_phase and (usable is None or smaller.peak <= usable):
                said.append(f"try algorithm.micro_batch_size={micro} (update phase {_size(update)})")
                break
        slices = [f"{acc.label(chips)} ({_size(fit.peak)} a chip)" for acc, chips, fit in planner.fits(cfg, model)
                  if chips is not None and acc.platform == platform]
        if slices:
            said.append(f"the smallest slices that hold it: {', '.join(slices[:3])}")
        return "; ".join(said) + f" ({command})"
    except Exception as err:  # noqa: BLE001 - the hint must not hide the failure it explains
        return (f"try a smaller algorithm.micro_batch_size or a larger slice ({command}; the planner could not "
                f"size this run here: {type(err).__name__}: {err})")
