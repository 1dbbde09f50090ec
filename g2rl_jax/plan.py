"""Memory planner: `python -m g2rl_jax.plan --config FILE [--devices N | --target SLICE [--compile]] [key=value ...]`.

With `--target v5p-8` (a gcloud accelerator type) the plan is for that slice's chips; adding `--compile` also
compiles every program of a step for it without the hardware, reports the whole run's compile bill (the programs of
the bounded set a run compiles at its first step, their seconds and their share of the estimated run time,
g2rl_jax/aot/bill.py) and ends in one verdict (g2rl_jax/aot). The exit
status is 0 when it fits, 1 when it does not, 2 on bad input.

Analytic per-device bytes of a training run, from the config alone (nothing is allocated):

    params       the policy's parameters in model.param_dtype, each sharded as g2rl_jax.parallel's DEFAULT_RULES
                 map its logical axes (embed -> fsdp, heads/kv_heads/mlp/vocab -> tensor); with LoRA
                 (model.lora.rank > 0) the frozen base in model.lora.base_dtype plus the adapters in model.param_dtype
    optimizer    AdamW's mu and nu (optax keeps them in the parameters' dtype), sharded like the parameters; with
                 LoRA the adapters' only
    gradients    the float32 accumulator of train.update.update plus one micro-batch's gradients (param dtype), of
                 the trained parameters (LoRA: the adapters)
    reference    a frozen copy of the parameters when algorithm.kl_coef > 0 (none with LoRA: the reference is the
                 base, the same weights with the adapters off)
    kv_cache     rollout K/V: the prompt prefix once per prompt plus the suffix per sample, layers x (P*S + P*m*T)
                 x kv_heads x head_dim x 2 x kv dtype, batch over (data, fsdp) and kv_heads over tensor
    rollout_tmp  the sampled tokens and log-probs of every sample [B, T], the layer weights cast to the compute
                 dtype once per rollout (one array per layer, read by every decode step) and, when fsdp shards them,
                 their copy gathered whole over fsdp for the decode loop (the compiler hoists the loop-invariant
                 gathers), plus the largest of: the
                 prefill (xla attention scores, and the scan's stacked prompt K/V before it is split into one
                 buffer per layer), a decode step (the [B, V] float32 logits and one layer's [B, H, S + T] float32
                 scores; the cache is written in place, nothing of it is copied), and a compaction (the cache moves
                 one layer at a time: one new layer of half the rows, each with its own prompt, beside the old cache,
                 and with more than one batch shard what XLA's row gathers gather whole first: a chunk of the suffix
                 slots of every row, and the prefix)
    activations  one micro-batch of the update with model.remat: the layer-boundary activations [b, L, D] of every
                 layer (twice on TPU, once on GPU: calibrated against each compiler, memory.SAVED_COPIES), one
                 layer's recomputed internals and their cotangents (attention scores [b, H, L, L] with the xla
                 backend, cuDNN's [b, 1, L, L] mask bias on GPU), one layer's all-gathered weights, and the chunked
                 [b, 64, V] logits of the loss
    batch        the update's mini-batch arrays (ids, masks, old/ref log-probs, advantages)

Peak = params + optimizer + reference + max(rollout: kv_cache + rollout_tmp, update: gradients + activations +
batch). Shapes are the ones the code runs: prompt count, prompt length and max_new_tokens bucketed as in
g2rl_jax.rollout.batching (the worst case: every response reaching the budget), L = S + T. `fits()` then
tries TPU v5e/v5p/v6e and H100/H200 slices, fsdp filling each, with tensor-parallel sizes 1/2/4/8 when the config
leaves mesh.tensor at 1 (its data size and other tensor sizes kept), and reports the smallest slice that
holds the peak within USABLE_FRACTION of each chip's memory. The byte counts are in g2rl_jax.memory.
tests/test_plan.py checks the update-phase estimate against XLA's compiled memory analysis of the real
`train.update.update`, and the rollout phase against the sampler's compiled prefill and decode, on CPU for small
configs (within 25%).
At 1.7B (8k) and 4B (12k) on v5p and v6e slices each phase is within 10% of the TPU compiler's per-chip peak
(`python -m g2rl_jax.plan --target SLICE --compile`, figures in docs/tpu.md).
"""
from __future__ import annotations

import dataclasses
import json
import sys

from g2rl_jax import cli, registry, storage
from g2rl_jax.config import Config, load_config
from g2rl_jax.memory import (
    F32,
    PlanError,
    activation_parts,
    adapter_elements,
    attention_scores_bytes,
    check_divisible,
    decode_weight_bytes,
    gathered_decode_weight_bytes,
    kv_cache_bytes,
    kv_token_bytes,
    micro_rows_per_device,
    nbytes,
    param_elements,
    resolve_mesh,
    shards,
)
from g2rl_jax.model.config import DTYPES, PRESETS, Qwen3Config, RuntimeConfig, resolve_attention

GiB = 2**30
USABLE_FRACTION = 0.90  # share of HBM a run can use (runtime reserve; gpu.sh sets XLA_PYTHON_CLIENT_MEM_FRACTION)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_gib: float
    chips: tuple[int, ...]  # slice sizes tried, smallest first
    slice_name: str  # format of the slice name, {n} = chips, {n2} = TensorCores
    platform: str = "tpu"  # decides model.attention=auto (splash on tpu, cudnn on gpu)
    compute_capability: tuple[int, int] | None = None  # a GPU's; below sm_80 no cuDNN fused attention (xla)

    def label(self, n: int) -> str:
        return self.slice_name.format(n=n, n2=2 * n)


_POW2 = tuple(2**i for i in range(13))
ACCELERATORS = (
    Accelerator("v5e", 16, (1, 4, 8, 16, 32, 64, 128, 256), "v5litepod-{n}"),
    Accelerator("v5p", 95, tuple(c for c in _POW2 if 4 <= c <= 4096), "v5p-{n2}"),
    Accelerator("v6e", 32, (1, 4, 8, 16, 32, 64, 128, 256), "v6e-{n}"),
    Accelerator("H100", 80, tuple(c for c in _POW2 if c <= 1024), "{n} x H100", "gpu"),
    Accelerator("H200", 141, tuple(c for c in _POW2 if c <= 1024), "{n} x H200", "gpu"),
    Accelerator("A100", 80, tuple(c for c in _POW2 if c <= 1024), "{n} x A100 80GB", "gpu"),
    # a 16 GB GPU (Colab's T4, V100-16GB, ...): 16e9 bytes less CUDA's own reserve, 15 GiB as nvidia-smi shows
    Accelerator("16GB", 15, (1, 2, 4, 8), "{n} x 16 GB GPU", "gpu", (7, 5)),
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of each component (see the module docstring) for one config on one mesh."""

    mesh: dict[str, int]
    params: int
    optimizer: int
    gradients: int
    reference: int
    kv_cache: int
    rollout_tmp: int
    activations: int
    batch: int
    notes: tuple[str, ...] = ()

    @property
    def persistent(self) -> int:
        return self.params + self.optimizer + self.reference

    @property
    def rollout_phase(self) -> int:
        return self.kv_cache + self.rollout_tmp

    @property
    def update_phase(self) -> int:
        return self.gradients + self.activations + self.batch

    @property
    def peak(self) -> int:
        return self.persistent + max(self.rollout_phase, self.update_phase)


def plan(cfg: Config, model: Qwen3Config, devices: int, platform: str = "tpu",
         compute_capability: tuple[int, int] | None = None) -> Plan:
    """The per-device memory plan of `cfg` with architecture `model` on `devices` devices of `platform` ("tpu" or
    "gpu", with its `compute_capability`: they decide the attention kernel, as model.config.resolve_attention does
    for a run)."""
    mesh = resolve_mesh(cfg, devices)
    check_divisible(model, mesh)
    lora_on = cfg.model.lora.rank > 0
    base_dtype = cfg.model.lora.base_dtype if lora_on else cfg.model.param_dtype
    runtime = RuntimeConfig(param_dtype=base_dtype, compute_dtype=cfg.model.compute_dtype,
                            remat=cfg.model.remat,
                            attention=resolve_attention(cfg.model.attention, DTYPES[cfg.model.compute_dtype],
                                                        platform, compute_capability),
                            kv_cache_dtype=cfg.model.kv_cache_dtype)
    n_local = param_elements(model, runtime, mesh)
    pbytes = n_local * nbytes(base_dtype)
    n_lora = adapter_elements(model, cfg.model.lora, mesh)
    lbytes = n_lora * nbytes(cfg.model.param_dtype)
    n_trained, trained_bytes = (n_lora, lbytes) if lora_on else (n_local, pbytes)
    kv, p, s, t = kv_cache_bytes(cfg, model, mesh)
    batch_shards, tp = shards("batch", mesh), shards("heads", mesh)
    length = s + t
    m = cfg.rollout.num_samples
    rows_local = -(-p * m // batch_shards)
    kv_shards, prompts_local = shards("kv_heads", mesh), -(-p // batch_shards)
    prefill = (attention_scores_bytes(runtime, model.num_attention_heads // tp, prompts_local, s)
               + model.num_hidden_layers * prompts_local * s * kv_token_bytes(cfg, model) // kv_shards)
    decode = rows_local * (3 * model.vocab_size + model.num_attention_heads // tp * (s + t)) * F32
    # a compaction's row gathers take rows from every batch shard, and XLA gathers their operand whole first: a
    # REGROUP_CHUNK of the suffix slots at a time, and the prefix (one row per batch row after the first compaction)
    from g2rl_jax.rollout.engine import REGROUP_CHUNK

    chunk = REGROUP_CHUNK if t % REGROUP_CHUNK == 0 else t
    gathered = rows_local * batch_shards * (chunk + s // 2) if batch_shards > 1 else 0
    compact = (rows_local // 2 * (s + t) + gathered) * kv_token_bytes(cfg, model) // kv_shards
    # the TPU compiler hoists the decode loop's weight gathers; the GPU compiler does not (8 x H100, 1.7B: the
    # compiled decode segment holds 1.07 GiB of temporaries, the whole decode weights are 2.63 GiB)
    gathered = gathered_decode_weight_bytes(cfg, model, mesh) if platform == "tpu" else 0
    rollout_tmp = (rows_local * t * (4 + F32) + decode_weight_bytes(cfg, model, mesh) + gathered
                   + max(prefill, decode, compact))
    mini_local = -(-cfg.algorithm.mini_batch_size // batch_shards)
    notes = []
    b = micro_rows_per_device(cfg, mesh)
    if b * batch_shards != cfg.algorithm.micro_batch_size:
        notes.append(f"update micro-batch rows per device = {b}, not micro_batch_size/batch shards = "
                     f"{cfg.algorithm.micro_batch_size}/{batch_shards}: a micro-batch smaller than the batch "
                     "shards leaves devices padded")
    if runtime.attention == "xla":
        notes.append("model.attention=xla materialises [b, H, L, L] scores; splash (TPU) / cudnn (GPU) do not")
    if lora_on:
        notes.append(f"LoRA rank {cfg.model.lora.rank} on {','.join(cfg.model.lora.targets)}: base frozen in "
                     f"{base_dtype}, {n_lora:,} adapter elements per device in {cfg.model.param_dtype} (only these "
                     "get gradients and AdamW moments), no reference copy")
    return Plan(
        mesh=mesh,
        params=pbytes + lbytes,
        optimizer=2 * trained_bytes,
        gradients=n_trained * F32 + trained_bytes,
        reference=pbytes if cfg.algorithm.kl_coef > 0 and not lora_on else 0,
        kv_cache=kv,
        rollout_tmp=rollout_tmp,
        activations=sum(activation_parts(cfg, model, runtime, mesh, length, t, platform).values()),
        batch=mini_local * (2 * length * 4 + 3 * t * F32 + F32),
        notes=tuple(notes) + (f"shapes: P={p} prompts x S={s} prompt tokens, m={m}, T={t} new tokens, "
                              f"L=S+T={length}",),
    )


TENSOR_SIZES = (1, 2, 4, 8)  # tensor-parallel sizes fits() tries when the config leaves mesh.tensor at 1


def slice_meshes(cfg: Config, chips: int) -> list[Config]:
    """The config on a slice of `chips`, fsdp filling it: with the config's tensor size, or each of TENSOR_SIZES
    when that is 1 (tensor parallelism splits the KV cache over KV heads, which fsdp alone cannot)."""
    from g2rl_jax.config import MeshConfig

    data = cfg.mesh.data if cfg.mesh.data != -1 else 1
    tensor = cfg.mesh.tensor if cfg.mesh.tensor != -1 else 1
    tensors = TENSOR_SIZES if tensor == 1 else (tensor,)
    return [dataclasses.replace(cfg, mesh=MeshConfig(data=data, fsdp=-1, tensor=t)) for t in tensors
            if chips % (data * t) == 0]


def fits(cfg: Config, model: Qwen3Config) -> list[tuple[Accelerator, int | None, Plan | None]]:
    """For each accelerator, the smallest slice (chips) on which some mesh of `slice_meshes` fits, with the plan of
    least peak there (None, None: no slice tried fits)."""
    out = []
    for acc in ACCELERATORS:
        found = (acc, None, None)
        for chips in acc.chips:
            fitting = []
            for candidate in slice_meshes(cfg, chips):
                try:
                    p = plan(candidate, model, chips, acc.platform, acc.compute_capability)
                except PlanError:
                    continue
                if p.peak <= USABLE_FRACTION * acc.hbm_gib * GiB:
                    fitting.append(p)
            if fitting:
                found = (acc, chips, min(fitting, key=lambda p: p.peak))
                break
        out.append(found)
    return out


# ------------------------------------------------------------------------------------------------ the CLI
def model_config(cfg: Config, preset: str | None) -> tuple[Qwen3Config, str]:
    """The architecture: --preset, else a model-path scheme's (the demo policy for `demo:DIR`, through
    g2rl_jax/registry.py, nothing built), else model.path/config.json, else a preset named in model.path."""
    if preset is not None:
        if preset not in PRESETS:
            raise PlanError(f"--preset {preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        return PRESETS[preset], f"preset {preset}"
    scheme = registry.architecture(cfg.model.path)
    if scheme is not None:  # the demo policy: its architecture, built or not
        return scheme, f"demo policy ({cfg.model.path})"
    path = storage.path(cfg.model.path, "model.path") / "config.json"  # local or gs://... (a hub id: by its name)
    if storage.is_file(path):
        return Qwen3Config.from_hf_dict(json.loads(storage.read_text(path)), str(path)), str(path)
    name = path.parent.name.lower()
    matches = sorted((k for k in PRESETS if name.startswith(k)), key=len)
    if not matches:
        raise PlanError(f"model.path: no {path} and {name!r} names no preset; download the model or pass "
                        f"--preset one of {', '.join(PRESETS)}")
    return PRESETS[matches[-1]], f"preset {matches[-1]} (no {path}; matched by name)"


def _gib(n: int) -> str:
    return f"{n / GiB:8.2f}"


def report(cfg: Config, model: Qwen3Config, source: str, devices: int, platform: str = "tpu", target=None) -> str:
    """The plan's text; with a split run (mesh.rollout_devices or rollout_processes) the table is the colocated run's,
    and each side's follows
    (aot/sides.py), with its fit and the step-time model when `target` (a slice) is given."""
    from g2rl_jax.aot import sides

    split, cfg = cfg, sides.colocated(cfg)
    p = plan(cfg, model, devices, platform, target.compute_capability if target else None)
    rows = [("params", p.params), ("optimizer (AdamW mu, nu)", p.optimizer),
            ("gradients (f32 acc + micro)", p.gradients), ("reference model", p.reference),
            ("rollout KV cache", p.kv_cache), ("rollout temporaries", p.rollout_tmp),
            ("activations (1 micro-batch)", p.activations), ("update batch arrays", p.batch)]
    lines = [f"model: {source}: {model.num_params() / 1e9:.2f}B params, {model.num_hidden_layers} layers, "
             f"D={model.hidden_size}, heads={model.num_attention_heads}/{model.num_key_value_heads} kv",
             f"dtypes: params {cfg.model.param_dtype}"
             + (f" (LoRA adapters; base {cfg.model.lora.base_dtype})" if cfg.model.lora.rank else "")
             + f", compute {cfg.model.compute_dtype}, "
             f"kv cache {cfg.model.kv_cache_dtype}; remat {cfg.model.remat}; attention {cfg.model.attention}",
             f"mesh on {devices} devices: {p.mesh}", *(f"note: {n}" for n in p.notes), "",
             f"{'per device':32s}{'GiB':>8s}"]
    lines += [f"{name:32s}{_gib(b)}" for name, b in rows]
    lines += [f"{'peak (rollout phase)':32s}{_gib(p.persistent + p.rollout_phase)}",
              f"{'peak (update phase)':32s}{_gib(p.persistent + p.update_phase)}",
              f"{'PEAK':32s}{_gib(p.peak)}", "",
              f"smallest slice that fits ({USABLE_FRACTION:.0%} of HBM usable; fsdp fills the slice, tensor "
              f"{'/'.join(map(str, TENSOR_SIZES))} tried when mesh.tensor is 1):"]
    for acc, chips, fp in fits(cfg, model):
        need = "does not fit in any slice tried" if chips is None else (
            f"{acc.label(chips):14s} {_gib(fp.peak).strip()} GiB/chip of {acc.hbm_gib} GiB, mesh {fp.mesh}")
        lines.append(f"  {acc.name:5s} {need}")
    if split.mesh.rollout_devices or split.mesh.rollout_processes:
        lines += ["", *sides.plan_lines(split, model, devices, target.hosts if target else 1, platform, target)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = cli.ArgumentParser(prog="python -m g2rl_jax.plan", description=__doc__.split("\n\n")[0],
                                epilog="Config keys: python -m g2rl_jax.train --help")
    parser.add_argument("--config", required=True, help="training config YAML")
    parser.add_argument("--devices", type=int, default=8, help="devices for the first table (default: 8, the paper's)")
    parser.add_argument("--preset", help=f"architecture preset instead of model.path/config.json: {', '.join(PRESETS)}")
    parser.add_argument("--target", help="a slice as gcloud names it (v4-8, v5litepod-16, v5p-8, v6e-8, ...): plan "
                        "for its chips instead of --devices")
    parser.add_argument("--compile", action="store_true",
                        help="also compile every program of a step for --target and give a verdict")
    parser.add_argument("--programs", choices=("all", "largest"), default="all",
                        help="with --compile: every shape a run reaches (default), or only the largest shape of each "
                        "program, which bounds the others' memory and compiles much faster")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --compile: compile this many programs at once (each compile takes one core and a "
                        "few GiB of memory; default 1)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="with --compile: only the programs whose name contains TEXT (repeatable), e.g. to finish "
                        "a check that was cut short")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.devices < 1:
        parser.error(f"--devices must be >= 1, got {args.devices}")
    if args.compile and not args.target:
        parser.error("--compile needs --target, e.g. --target v5p-8")
    from g2rl_jax.aot import TargetError, parse_target

    try:
        cfg = load_config(args.config, args.overrides)
        model, source = model_config(cfg, args.preset)
        target = parse_target(args.target) if args.target else None
        print(report(cfg, model, source, target.chips if target else args.devices,
                     target.platform if target else "tpu", target), flush=True)
        if args.compile:
            from g2rl_jax.aot.check import check

            fits, text = check(cfg, model, target, args.programs, threads=args.threads, only=tuple(args.only))
            print("\n" + text)
            return 0 if fits else 1
    except (*cli.USER_ERRORS, PlanError, TargetError) as err:
        return cli.fail("plan", err)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
