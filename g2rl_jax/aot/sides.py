"""The two sides of a split run (mesh.rollout_devices = R > 0 or mesh.rollout_processes = N > 0, docs/async.md) for
the planner and the TPU compiler.

    train_cfg, train_chips, rollout_cfg, rollout_chips = side_configs(cfg, chips, hosts)
    plan_lines(cfg, model, chips, hosts, platform, target)     # per-side memory, fit and step time (plan)
    check_sides(cfg, model, target, scope, say, threads)       # both sides compiled (plan --compile)

With mesh.rollout_devices the training side is the config's data/fsdp/tensor mesh on chips - hosts x R chips; the
rollout side, what one host runs (parallel.split_meshes): its R chips (data R / rollout_tensor, tensor
rollout_tensor, the weights replicated over data) sampling its prompts_per_step / hosts prompts. Every host's
rollout side is alike. With mesh.rollout_processes (a host is a process) the rollout side is every chip of the last
N hosts, one mesh sampling every prompt (parallel.side_meshes), the training side the other hosts' chips.

Memory per chip. Training side: params, optimizer, reference and the update (plan's update phase), and the weight
sync's (memory.weight_sync_bytes): the versions its first chip holds until the rollout acknowledges them, and, while
it pushes one, the whole trainable params gathered on every chip. Rollout side: its whole copy of the weights
(LoRA: the base and the adapters), with max_staleness > 0 a second version of the trainable part (the one in flight
while the next is drawn), the KV cache and the rollout's temporaries, or a version arriving whole on its first chip.

Step time, an ESTIMATE from the same models as `plan --compile`'s (aot/report.step_time_estimate: the passes from
the FLOP model at ESTIMATE_MFU, the decode's lower bound from HBM bandwidth): colocated = passes on every chip +
decode on every chip; split, k = 0 = rollout side's decode + training side's passes; k >= 1 = the larger of the
two, which names the side that limits the step. Rewards, the weight sync and the first (serial) step are left out.
"""
from __future__ import annotations

import dataclasses
import math
import types

from g2rl_jax.config import Config, MeshConfig
from g2rl_jax.memory import PlanError
from g2rl_jax.rollout import batching

GiB = 1024**3


def colocated(cfg: Config) -> Config:
    """The same run with one mesh for both (mesh.rollout_devices and rollout_processes 0, max_staleness=0)."""
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rollout_devices=0, rollout_processes=0),
                               rollout=dataclasses.replace(cfg.rollout, max_staleness=0))


def side_configs(cfg: Config, chips: int, hosts: int) -> tuple[Config, int, Config, int]:
    """(training config, its chips, one rollout mesh's config, its chips); see the module docstring."""
    r, rt, n = cfg.mesh.rollout_devices, cfg.mesh.rollout_tensor, cfg.mesh.rollout_processes
    if n:
        if chips % hosts or n >= hosts:
            raise PlanError(f"mesh.rollout_processes={n} leaves no training process of the {hosts} host(s); "
                            "give the rollout fewer, or plan for a slice of more hosts (--target)")
        r, meshes = n * (chips // hosts), 1  # the rollout: every chip of its hosts, one mesh for every prompt
    elif chips % hosts or r >= chips // hosts:
        raise PlanError(f"mesh.rollout_devices={r} leaves no training chip of the {chips // hosts} each of the "
                        f"{hosts} host(s) has; give the rollout fewer")
    else:
        meshes = hosts  # each host's rollout side samples its own share
    if cfg.data.prompts_per_step % meshes:
        raise PlanError(f"data.prompts_per_step={cfg.data.prompts_per_step} does not split over {hosts} hosts, "
                        "each of whose rollout sides samples its own share")
    one = dataclasses.replace(cfg.rollout, max_staleness=0)  # each side alone is a one-mesh config
    train = colocated(cfg)
    share = dataclasses.replace(cfg.data, prompts_per_step=cfg.data.prompts_per_step // meshes)
    mini = math.gcd(cfg.algorithm.mini_batch_size, share.prompts_per_step * cfg.rollout.num_samples)
    algo = dataclasses.replace(cfg.algorithm, mini_batch_size=mini,  # no update runs there: valid, unused
                               micro_batch_size=math.gcd(mini, cfg.algorithm.micro_batch_size))
    rollout = dataclasses.replace(cfg, mesh=MeshConfig(data=r // rt, fsdp=1, tensor=rt), data=share, rollout=one,
                                  algorithm=algo)
    return train, chips - (r if n else hosts * r), rollout, r


def side_bytes(cfg: Config, model, chips: int, hosts: int, platform: str) -> dict[str, int]:
    """Per-chip peak bytes of each side, and the colocated run's (the planner's figures); "sync": the weight sync's
    (memory.weight_sync_bytes), "in_flight": the rollout's second version."""
    from g2rl_jax.memory import weight_sync_bytes
    from g2rl_jax.plan import plan

    train_cfg, tc, roll_cfg, rc = side_configs(cfg, chips, hosts)
    tp, rp = plan(train_cfg, model, tc, platform), plan(roll_cfg, model, rc, platform)
    in_flight = rp.optimizer // 2 if cfg.rollout.max_staleness > 0 else 0  # one more copy of the trained part
    sync = weight_sync_bytes(cfg, model, hosts)
    colocated = plan(train_cfg, model, chips, platform).peak
    training = tp.persistent + sync["held"] + max(tp.update_phase, sync["gathered"])
    return {"training": training, "rollout": rp.params + in_flight + max(rp.rollout_phase, sync["arrived"]),
            "colocated": colocated, "training_chips": tc, "rollout_chips": rc, "in_flight": in_flight,
            "sync": training - tp.persistent - tp.update_phase}  # what the weight sync adds to the peak


def step_seconds(cfg: Config, model, target) -> dict[str, float]:
    """The step-time model (module docstring): colocated, each side, and the split step, in seconds."""
    from g2rl_jax.aot.report import step_time_estimate

    train_cfg, tc, roll_cfg, rc = side_configs(cfg, target.chips, target.hosts)
    shapes = types.SimpleNamespace(step_rows=cfg.data.prompts_per_step * cfg.rollout.num_samples,
                                   prompt_len=batching.bucket(cfg.data.max_prompt_tokens, batching.MIN_PROMPT_BUCKET),
                                   new_tokens=batching.new_tokens_bucket(cfg.rollout.max_new_tokens))
    passes, decode = step_time_estimate(train_cfg, model, shapes, target)
    train_s, _ = step_time_estimate(train_cfg, model, shapes, dataclasses.replace(target, chips=tc))
    _, rollout_s = step_time_estimate(roll_cfg, model, shapes, dataclasses.replace(target, chips=rc))
    split = rollout_s + train_s if cfg.rollout.max_staleness == 0 else max(rollout_s, train_s)
    return {"colocated": passes + decode, "rollout": rollout_s, "training": train_s, "split": split}


def plan_lines(cfg: Config, model, chips: int, hosts: int, platform: str, target=None) -> list[str]:
    """The planner's per-side report (and, with a target, each side's fit and the step-time model)."""
    from g2rl_jax.plan import USABLE_FRACTION

    b = side_bytes(cfg, model, chips, hosts, platform)
    k = cfg.rollout.max_staleness
    where = (f"mesh.rollout_processes={cfg.mesh.rollout_processes} of {hosts} host(s)" if cfg.mesh.rollout_processes
             else f"mesh.rollout_devices={cfg.mesh.rollout_devices} per host")
    on = "in all" if cfg.mesh.rollout_processes else f"on each of {hosts} host(s)"
    lines = [f"split run ({where}, max_staleness={k}): training side {b['training_chips']} chips, rollout side "
             f"{b['rollout_chips']} chips {on}",
             f"  per chip, GiB: training side {b['training'] / GiB:.2f}"
             + (f" (of it {b['sync'] / GiB:.2f} the weight sync's)" if b["sync"] else "")
             + f", rollout side {b['rollout'] / GiB:.2f}"
             + (f" (of it {b['in_flight'] / GiB:.2f} the version in flight)" if k else "")
             + f"; colocated on all {chips} chips {b['colocated'] / GiB:.2f}"]
    if target is not None:
        limit = USABLE_FRACTION * target.hbm_bytes
        for side in ("training", "rollout"):
            verdict = "fits" if b[side] <= limit else "DOES NOT FIT"
            lines.append(f"  {side} side: {verdict} ({b[side] / GiB:.2f} of {limit / GiB:.1f} GiB usable per chip)")
        lines += step_lines(cfg, model, target)
    return lines


def step_lines(cfg: Config, model, target) -> list[str]:
    t = step_seconds(cfg, model, target)
    limiting = "rollout" if t["rollout"] >= t["training"] else "training"
    how = "serial (k=0): rollout + training" if cfg.rollout.max_staleness == 0 else \
        f"overlapped (k={cfg.rollout.max_staleness}): the slower side"
    return [f"  step time, an ESTIMATE (FLOP model at the MFU and HBM-bandwidth decode bound of plan --compile): "
            f"colocated {t['colocated']:.1f} s; split rollout side {t['rollout']:.1f} s, training side "
            f"{t['training']:.1f} s, {how} = {t['split']:.1f} s ({t['colocated'] / t['split']:.2f}x colocated); "
            f"the {limiting} side limits it"]


def side_meshes(cfg: Config, target, train_cfg: Config, roll_cfg: Config):
    """(training mesh, host 0's rollout mesh) on the target's compile-only devices, which carry their host as
    process_index: each host's last R devices its rollout side's, or with mesh.rollout_processes every device of the
    last N hosts one rollout mesh (as parallel.split_meshes does in a run)."""
    from g2rl_jax import parallel

    hosts: dict[int, list] = {}
    for d in target.devices():
        hosts.setdefault(d.process_index, []).append(d)
    if cfg.mesh.rollout_processes:
        order = sorted(hosts)
        rollout_hosts = set(order[-cfg.mesh.rollout_processes:])
        train = [d for h in order if h not in rollout_hosts for d in hosts[h]]
        rollout = [d for h in order if h in rollout_hosts for d in hosts[h]]
        return parallel.make_mesh(train_cfg.mesh, train), parallel.make_mesh(roll_cfg.mesh, rollout)
    r = cfg.mesh.rollout_devices
    train = [d for host in hosts.values() for d in host[:-r]]
    return parallel.make_mesh(train_cfg.mesh, train), parallel.make_mesh(roll_cfg.mesh, hosts[min(hosts)][-r:])


def check_sides(cfg: Config, model, target, scope: str, say, threads: int,
                only: tuple[str, ...] = ()) -> tuple[bool, list[str]]:
    """Compile the rollout programs on one host's rollout mesh and the rest on the training mesh; (both fit, the
    report's lines: a table and a verdict per side, then the step-time model). `only`: just the programs whose
    name contains one of these strings (a side with none of them is left out)."""
    from g2rl_jax.aot import programs as programs_lib
    from g2rl_jax.aot import report as report_lib
    from g2rl_jax.plan import USABLE_FRACTION

    train_cfg, tc, roll_cfg, rc = side_configs(cfg, target.chips, target.hosts)
    from g2rl_jax.memory import weight_sync_bytes

    train_mesh, roll_mesh = side_meshes(cfg, target, train_cfg, roll_cfg)
    in_flight = side_bytes(cfg, model, target.chips, target.hosts, target.platform)["in_flight"]
    held = weight_sync_bytes(cfg, model, target.hosts)["held"]  # versions the rollout has not acknowledged
    sides = {
        "rollout": [dataclasses.replace(p, resident=in_flight)  # beside it: only the version in flight, if any
                    for p in programs_lib.step_programs(roll_cfg, model, roll_mesh, scope=scope)
                    if p.phase == "rollout"],
        "training": [dataclasses.replace(p, resident=p.resident + held)
                     for p in programs_lib.step_programs(train_cfg, model, train_mesh, scope=scope)
                     if p.phase != "rollout"],
    }
    if only:
        sides = {side: [p for p in progs if any(text in p.name for text in only)] for side, progs in sides.items()}
        if not any(sides.values()):
            raise PlanError(f"--only {list(only)}: no program of this step is named so; see the names that "
                            "--programs largest prints")
    limit, fits, lines = USABLE_FRACTION * target.hbm_bytes, True, []
    for side, progs in ((s, p) for s, p in sides.items() if p):
        chips = rc if side == "rollout" else tc
        say(f"{side} side: compiling {len(progs)} programs on {chips} chips"
            + (" (one host's)" if side == "rollout" else ""))
        results = report_lib.compile_programs(progs, say, threads, target.kernel_mark)
        bad = [r for r in results if r.error is not None or r.total > limit]
        top = max(results, key=lambda r: r.total)
        fits &= not bad
        verdict = (f"{side} side FITS: the largest program, {top.program.name}, holds {top.total / GiB:.2f} GiB "
                   f"per chip of {limit / GiB:.1f} usable" if not bad else
                   f"{side} side DOES NOT FIT: {bad[0].program.name}: "
                   + (bad[0].error or f"{bad[0].total / GiB:.2f} GiB per chip of {limit / GiB:.1f} usable"))
        mesh = roll_mesh if side == "rollout" else train_mesh
        lines += [f"{side} side, {chips} chips, mesh {dict(mesh.shape)}:",
                  *report_lib.table(results, target), verdict, ""]
    lines += step_lines(cfg, model, target)
    return fits, lines
