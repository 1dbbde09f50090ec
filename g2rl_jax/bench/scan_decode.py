"""`python -m g2rl_jax.bench scan_decode`: the decode segment with its layer loop unrolled (as the sampler runs it)
against the same segment with the layers under `lax.scan`: compile seconds and the compiler's memory, side by side.

    python -m g2rl_jax.bench scan_decode --config configs/qwen3_1p7b_g2rl.yaml --preset qwen3-1.7b --target v5p-8 \\
        --rows 256 --capacity 8192

The question it answers: would scanning the decode step's layers cut the segment's compile time, and at what
run-time cost? `Qwen3.decode_step` unrolls its layers so that each layer's suffix cache is its own buffer, written
in place and read where it lies. A scan needs the cache stacked [layers, ...] and carried through the loop: the
write is an in-place dynamic-update-slice of the carried buffer, but the read of layer i's slice is a
dynamic-slice, which XLA may copy. The compiled program's temporary bytes say whether it does: a copy shows up as
one layer's K and V cache per chip or more above the unrolled segment's. (Measured at 1.7B on v5p-8, docs/tpu.md:
the scan compiles in half the time but holds most of the suffix cache again in temporaries, and at 8,192 slots it
runs out of HBM.) Both programs are
`engine._segment` (the same while loop, sampling and bookkeeping), jitted alike (the suffix and the decode state
donated), over abstract inputs with the trainer's shardings; the scanned one swaps `Qwen3.decode_step` for a scan
over stacked layers, caches and weights while it is lowered. Nothing runs: a compile for --target (or this
process's devices) only. Model FLOPs and bytes moved per step are the same by construction; only a copy would add.

Each compiled program's HLO census (`census`): its conditionals and while loops (on a GPU the device reports each
conditional's branch index and each while loop's predicate to the host, which waits for it before it launches
what follows), its transfers to or from the host, and its copies of at least one cache row. `--target h200-1`
compiles for one H200 with XLA's GPU compiler (docs/gpu.md); `--loops unrolled` compiles the sampler's segment
only. The segment reads the read rungs of the budget (engine.read_ladder from rollout.first_capacity).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
import re
import resource
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from g2rl_jax.model import attention as attn
from g2rl_jax.model.qwen3 import PrefixCache, Qwen3, SuffixCache, _out_and_mlp, _qkv, rms_norm


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench scan_decode", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--preset", help="architecture preset instead of model.path/config.json")
    p.add_argument("--target", help="a TPU slice as gcloud names it (v5p-8, ...); default: this process's devices")
    p.add_argument("--rows", type=int, default=0, help="decode batch rows (default: the step's full batch)")
    p.add_argument("--capacity", type=int, default=0, help="suffix cache slots (default: the budget)")
    p.add_argument("--loops", default="unrolled,scan", help="which layer loops to compile (comma-separated; "
                   "default both): unrolled is the sampler's segment")
    p.add_argument("--reads", choices=("platform", "phased", "switch"), default="platform",
                   help="how a step picks its read rung: as the sampler does on the target's platform "
                   "(engine.PHASED_READS), a while loop per rung, or a lax.switch in each layer")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
    return p.parse_args(argv)


def scanned_decode_step(self, tokens_B, prefix: PrefixCache, suffix: SuffixCache, step, layers=None,
                        reads: tuple[int, ...] = ()):
    """Qwen3.decode_step with its layers under lax.scan: prefix and suffix K/V stacked [layers, ...], `layers` the
    stacked weights in the compute dtype; the suffix is carried and written with a dynamic-update-slice."""
    cfg, rt = self.config, self.runtime
    P, B = prefix.mask.shape[0], tokens_B.shape[0]
    positions_Bx1 = (jnp.repeat(prefix.lengths, B // P) + step)[:, None]
    x_Bx1xD = self._rows_sharded(jnp.take(self.embed_tokens[...], tokens_B[:, None], axis=0).astype(rt.compute_jnp))

    def layer(carry, xs):
        x, suf_k, suf_v = carry
        p, pre_k, pre_v, i = xs
        q, k_Bx1xGxK, v_Bx1xGxK = _qkv(x, p, positions_Bx1, cfg)
        suf_k = jax.lax.dynamic_update_slice(suf_k, k_Bx1xGxK.transpose(0, 2, 1, 3)[None].astype(suf_k.dtype),
                                             (i, 0, 0, step, 0))
        suf_v = jax.lax.dynamic_update_slice(suf_v, v_Bx1xGxK.transpose(0, 2, 1, 3)[None].astype(suf_v.dtype),
                                             (i, 0, 0, step, 0))
        a = attn.decode_attention(q[:, 0], pre_k, pre_v, prefix.mask, suf_k[i], suf_v[i], step + 1,
                                  reads)
        return (self._rows_sharded(_out_and_mlp(x, a[:, None], p, cfg)), suf_k, suf_v), None

    L = cfg.num_hidden_layers
    (x, suf_k, suf_v), _ = jax.lax.scan(layer, (x_Bx1xD, suffix.k, suffix.v),
                                        (layers, prefix.k, prefix.v, jnp.arange(L)))
    h = rms_norm(x, self.norm[...], cfg.rms_norm_eps)
    return self.logits(h)[:, 0], SuffixCache(k=suf_k, v=suf_v)


@contextlib.contextmanager
def _scanned():
    original = Qwen3.decode_step
    Qwen3.decode_step = scanned_decode_step
    try:
        yield
    finally:
        Qwen3.decode_step = original


def _stacked(one: jax.ShapeDtypeStruct, layers: int) -> jax.ShapeDtypeStruct:
    spec = tuple(one.sharding.spec) + (None,) * (one.ndim - len(one.sharding.spec))
    return jax.ShapeDtypeStruct((layers, *one.shape), one.dtype,
                                sharding=NamedSharding(one.sharding.mesh, PartitionSpec(None, *spec)))


def _compile(lower) -> tuple[object, float, float]:
    start, cpu = time.perf_counter(), _cpu()
    compiled = lower().compile()
    return compiled, time.perf_counter() - start, _cpu() - cpu


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    from g2rl_jax import parallel
    from g2rl_jax.aot import parse_target
    from g2rl_jax.aot.programs import Abstract, abstract_policy, decode_layers
    from g2rl_jax.config import load_config
    from g2rl_jax.memory import shards
    from g2rl_jax.plan import model_config
    from g2rl_jax.rollout import engine
    from g2rl_jax.rollout.sampling import spec_for
    from g2rl_jax.shapes.step import step_shapes
    from g2rl_jax.train import setup

    a = _args(argv)
    cfg = load_config(a.config, a.overrides)
    model, source = model_config(cfg, a.preset)
    devices = parse_target(a.target).devices() if a.target else jax.devices()
    mesh = parallel.make_mesh(cfg.mesh, devices)
    s = step_shapes(cfg, mesh)
    rows, capacity = a.rows or s.rows, a.capacity or s.new_tokens
    ab = Abstract(mesh)
    G, L, K = model.num_key_value_heads, model.num_hidden_layers, model.head_dim
    kv_dtype = jnp.dtype(cfg.model.kv_cache_dtype)
    graphdef, params = abstract_policy(model, setup.runtime_config(cfg.model), mesh)
    spec = spec_for(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k or 0, model.vocab_size)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    f32, i32, stops = ab.scalar(jnp.float32), ab.scalar(jnp.int32), ab.scalar(jnp.int32, (2,))
    prompts = s.prompts if rows == s.rows else rows
    pre = ab.kv(prompts, G, s.prompt_len, K, kv_dtype, L)
    suf = ab.kv(rows, G, capacity, K, kv_dtype, L)
    mask, lengths = ab.rows((prompts, s.prompt_len), jnp.bool_), ab.rows((prompts,), jnp.int32)
    B, T = s.rows, s.new_tokens
    ds = engine.DecodeState(last_X=ab.rows((rows,), jnp.int32), sample_X=ab.rows((rows,), jnp.int32),
                            stopped_X=ab.rows((rows,), jnp.bool_), tokens_BxT=ab.rows((B, T), jnp.int32),
                            logprobs_BxT=ab.rows((B, T), jnp.float32), lengths_B=ab.rows((B,), jnp.int32))
    scalars = (i32, i32, i32, key, f32, f32, stops)
    phased = a.reads == "phased" or (a.reads == "platform" and engine.run_platform(mesh) in engine.PHASED_READS)
    segment = functools.partial(engine._segment, phased=phased)
    fn = jax.jit(segment, static_argnames=("graphdef", "spec", "reads"), donate_argnames=("suffix", "ds"),
                 compiler_options=engine.CPU_PHASED_OPTIONS if phased and engine.run_platform(mesh) == "cpu" else None)
    reads = engine.read_ladder(capacity, cfg.rollout.first_capacity)
    per_layer = decode_layers(graphdef, params, mesh)
    stacked_w = {name: _stacked(one, L) for name, one in per_layer[0].items()}

    def lower_unrolled():
        with jax.set_mesh(mesh):
            return fn.lower(graphdef, params, per_layer, PrefixCache(pre, pre, mask, lengths), SuffixCache(suf, suf),
                            ds, *scalars, spec=spec, reads=reads)

    def lower_scanned():
        stacked_pre, stacked_suf = _stacked(pre[0], L), _stacked(suf[0], L)
        with jax.set_mesh(mesh), _scanned():
            return fn.lower(graphdef, params, stacked_w, PrefixCache(stacked_pre, stacked_pre, mask, lengths),
                            SuffixCache(stacked_suf, stacked_suf), ds, *scalars, spec=spec, reads=reads)

    layer_kv = 2 * rows * G * capacity * K * kv_dtype.itemsize / (shards("batch", dict(mesh.shape))
                                                                 * shards("kv_heads", dict(mesh.shape)))
    print(f"decode segment {rows} rows x {capacity} slots, read rungs {reads} ({'phased' if phased else 'switch'}), "
          f"{source}, "
          f"{a.target or devices[0].device_kind}, mesh {dict(mesh.shape)}; one layer's K and V cache: "
          f"{layer_kv / 2**30:.3f} GiB per device")
    print(f"| layer loop | compile s | CPU s | args GiB | out GiB | alias GiB | temp GiB | {' | '.join(CENSUS)} |"
          f"\n|{'---|' * (7 + len(CENSUS))}")
    temps = {}
    loops = {"unrolled": lower_unrolled, "scan": lower_scanned}
    for name in a.loops.split(","):
        try:
            compiled, wall, cpu = _compile(loops[name])
        except jax.errors.JaxRuntimeError as err:  # e.g. RESOURCE_EXHAUSTED: the compiler's own line says why
            print(f"| {name} | failed: {str(err).splitlines()[0]} |||||", flush=True)
            return 1
        m = compiled.memory_analysis()
        temps[name] = m.temp_size_in_bytes
        counts = census(compiled.as_text(), layer_kv / 2)
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {m.argument_size_in_bytes / 2**30:.3f} | "
              f"{m.output_size_in_bytes / 2**30:.3f} | {m.alias_size_in_bytes / 2**30:.3f} | "
              f"{m.temp_size_in_bytes / 2**30:.3f} | {' | '.join(str(counts[k]) for k in CENSUS)} |", flush=True)
    if a.target and set(temps) == {"unrolled", "scan"}:
        print(roofline(cfg, model, a.target, prompts, s.prompt_len, rows, capacity, layer_kv,
                       temps["scan"] - temps["unrolled"]))
    return 0


# what the compiled segment's HLO holds (census): control flow the device may have to report to the host (on a GPU
# a conditional's branch index and a while loop's predicate are copied to the host, which waits for them), transfers
# to or from the host, and copies as large as a layer's K cache or larger (a read rung's slice is smaller)
CENSUS = ("conditional", "while", "host transfer", "cache copies")


def census(hlo: str, layer_bytes: float) -> dict[str, int]:
    """Counts of CENSUS in compiled HLO text (layer_bytes: one layer's K cache, per device)."""
    copies = re.findall(r"=\s*(\S+)\s+copy\(", hlo)
    host = len(re.findall(r"\s(?:send|recv|infeed|outfeed)\(", hlo))
    host += len(re.findall(r'custom_call_target="[^"]*[Hh]ost', hlo))
    return {"conditional": len(re.findall(r"\sconditional\(", hlo)), "while": len(re.findall(r"\swhile\(", hlo)),
            "host transfer": host, "cache copies": sum(1 for shape in copies if _bytes(shape) >= layer_bytes)}


def _bytes(shape: str) -> int:
    """Bytes of an HLO array shape such as bf16[4,8,128,64]{...} (0 for a tuple or a token)."""
    m = re.match(r"(pred|[subf]\d+)\[([\d,]*)\]", shape)
    if not m:
        return 0
    dtype = m.group(1)
    size = 1 if dtype == "pred" else int(dtype[1:]) // 8
    return size * math.prod(int(d) for d in m.group(2).split(",") if d)


def roofline(cfg, model, target_name, prompts, prompt_len, rows, capacity, layer_kv, extra_temp) -> str:
    """The HBM roofline of one decode step of this segment, per chip: the decode weights (gathered over fsdp, as
    the compiled segment holds them) and the whole prefix and suffix cache read once. Both layer loops do the same
    FLOPs and read the same bytes, unless the scan copies each layer's cache slice out of the stacked buffer (read
    and write one layer's K and V: twice the suffix cache per step more); the compiler's temporaries say whether it
    keeps such a copy (about one layer's K and V more)."""
    from g2rl_jax.aot import parse_target
    from g2rl_jax.memory import decode_weight_bytes, gathered_decode_weight_bytes, kv_token_bytes, resolve_mesh, shards

    target = parse_target(target_name)
    sizes = resolve_mesh(cfg, target.chips)
    weights = max(decode_weight_bytes(cfg, model, sizes), gathered_decode_weight_bytes(cfg, model, sizes))
    per_chip = shards("batch", sizes) * shards("kv_heads", sizes)
    kv = model.num_hidden_layers * (prompts * prompt_len + rows * capacity) * kv_token_bytes(cfg, model) / per_chip
    step_s = (weights + kv) / (target.hbm_gbps * 1e9)
    copy_s = 2 * model.num_hidden_layers * layer_kv / (target.hbm_gbps * 1e9)
    copied = "yes" if extra_temp >= 0.5 * layer_kv else "no"
    suffix = model.num_hidden_layers * layer_kv
    return (f"roofline per decode step at {target.hbm_gbps:.0f} GB/s, per chip: {weights / 2**30:.2f} GiB of decode "
            f"weights + {kv / 2**30:.2f} GiB of cache = {step_s * 1e3:.1f} ms, the same for both layer loops (same "
            f"FLOPs and bytes); if the scan copies each layer's cache slice (read and write the suffix cache once "
            f"more per step): +{copy_s * 1e3:.1f} ms (+{copy_s / step_s:.0%}). Scanned temporaries - unrolled: "
            f"{extra_temp / 2**30:+.3f} GiB against one layer's K and V of {layer_kv / 2**30:.3f} GiB and the suffix "
            f"cache's {suffix / 2**30:.3f} GiB: a copy held, {copied}")
