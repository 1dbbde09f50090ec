"""`python -m g2rl_jax.bench lora`: LoRA against full fine-tuning on one random model, side by side in one run.

    python -m g2rl_jax.bench lora                      # CPU, a few minutes: hidden 512, 4 layers, vocab 8k
    python -m g2rl_jax.bench lora --preset qwen3-1.7b --dtype bfloat16 --rows 16 --response-len 1024 ...  # a GPU

Printed, each pair measured alternately in one process (these machines are noisy):
  * update: seconds per optimizer update (`train.update.update`: AdamW, KL term on, micro-batches of --micro rows)
    of the full model against the same model with rank --rank adapters on every projection, and XLA's per-device
    bytes of the compiled update (arguments + outputs - donated aliases + temporaries; the optimizer state is an
    argument): what LoRA saves in gradients and AdamW moments;
  * decode: generated tokens/s of `generate` (--prompts x --samples, --new-tokens each, no stop token, so every
    sample generates every token) with the base model, with LoRA merged into the per-layer decode weights (what the
    sampler does), and with the adapters applied at every step instead (merge_for_decode off), and the bytes of
    the per-layer decode weights each way.
The adapters' B is random (not zero), so nothing is skipped because it is zero.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from g2rl_jax.config import AlgorithmConfig, OptimConfig
from g2rl_jax.model import PRESETS, Qwen3, Qwen3Config, RuntimeConfig, lora
from g2rl_jax.rollout import generate
from g2rl_jax.train import optim as train_optim
from g2rl_jax.train import step as train_step
from g2rl_jax.train import update as train_update


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench lora", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a published Qwen3 size (random weights)")
    p.add_argument("--hidden", type=int, default=512, help="without --preset: hidden size (heads of 64)")
    p.add_argument("--layers", type=int, default=4, help="without --preset: decoder layers")
    p.add_argument("--vocab", type=int, default=8192, help="without --preset: vocabulary size")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="base params and compute")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=8, help="update: responses per optimizer update")
    p.add_argument("--micro", type=int, default=8, help="update: rows per micro-batch")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="decode: prompts")
    p.add_argument("--samples", type=int, default=8, help="decode: samples per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="decode: tokens generated per sample")
    p.add_argument("--iters", type=int, default=3, help="timed repeats of each variant (median reported)")
    return p.parse_args(argv)


def _config(a) -> Qwen3Config:
    if a.preset:
        return PRESETS[a.preset]
    return Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                       num_key_value_heads=max(1, a.hidden // 128), head_dim=64, tie_word_embeddings=True)


def _models(cfg: Qwen3Config, a):
    """(base model, the same base with rank --rank adapters whose B is random)."""
    runtime = RuntimeConfig(param_dtype=a.dtype, compute_dtype=a.dtype, remat="none")
    base = Qwen3(cfg, runtime, rngs=nnx.Rngs(0))
    adapted = nnx.merge(*nnx.split(base))
    spec = lora.LoraSpec(a.rank, float(a.rank), tuple(lora.TARGETS.values()))
    lora.attach(adapted, spec, dtype="float32", seed=1)
    for i, name in enumerate(spec.targets):
        b = getattr(adapted.adapters, f"{name}_b")
        b[...] = 0.01 * jax.random.normal(jax.random.key(i), b.shape, b[...].dtype)
    return base, adapted


def _mini(cfg: Qwen3Config, a) -> train_step.MiniBatch:
    rng = np.random.default_rng(0)
    s, t, rows = a.prompt_len, a.response_len, a.rows
    batch = train_step.Batch(input_ids=jnp.asarray(rng.integers(1, cfg.vocab_size, (rows, s + t)), jnp.int32),
                             attention_mask=jnp.ones((rows, s + t), jnp.int32),
                             response_mask=jnp.ones((rows, t), jnp.float32),
                             rewards=jnp.asarray(rng.choice([-1.0, 1.0], rows), jnp.float32),
                             correct=jnp.zeros((rows,), bool), group_size=rows)
    logp = jnp.full((rows, t), -np.log(cfg.vocab_size), jnp.float32)
    return train_step.MiniBatch(batch, old_logp_BxT=logp, ref_logp_BxT=logp,
                                advantages_B=jnp.asarray(rng.standard_normal(rows), jnp.float32))


class _Update:
    """One variant's update: its params, optimizer state, and the compiled update's per-device bytes."""

    def __init__(self, model, mini, a):
        self.graphdef, params = nnx.split(model)
        # committed to the device, as the update's outputs are: else the first timed update compiles again
        self.params = jax.device_put(params, jax.devices()[0])
        self.optimizer = train_optim.make_optimizer(OptimConfig(learning_rate=1e-4), 1000)
        self.opt_state = jax.device_put(jax.jit(self.optimizer.init)(lora.trainable(self.params)), jax.devices()[0])
        self.settings = train_update.LossSettings.from_config(AlgorithmConfig(kl_coef=0.001), 1.0)
        self.mini, self.micro = mini, a.micro
        self.trained = sum(x.size for x in jax.tree.leaves(lora.trainable(self.params)))
        self.bytes = self._compiled_bytes()

    def _compiled_bytes(self) -> int:
        # placed as the update places its accumulator, so that this is the program the update runs (a persistent
        # compilation cache then compiles it once)
        grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding),
                             lora.trainable(self.params))
        on = self.mini.batch.rewards.sharding
        diag = jax.eval_shape(lambda: train_update.policy_loss(  # of one micro-batch, sliced abstractly
            self.params, self.graphdef, jax.tree.map(lambda x: x[:self.micro], self.mini), self.settings)[1])
        diag = {k: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=on) for k, d in diag.items()}
        loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=on)
        acc = train_update.accumulate.lower(self.graphdef, self.params, (grads, loss, diag), self.mini,
                                            np.arange(self.micro, dtype=np.int32), settings=self.settings,
                                            total_rows=self.mini.batch.rewards.shape[0],
                                            width=self.mini.batch.response_mask.shape[1])
        apply = train_update.apply_gradients.lower(self.params, self.opt_state, grads, loss, diag,
                                                 optimizer=self.optimizer)

        def used(compiled) -> int:
            st = compiled.compile().memory_analysis()
            return st.argument_size_in_bytes + st.output_size_in_bytes - st.alias_size_in_bytes + st.temp_size_in_bytes

        opt = sum(x.nbytes for x in jax.tree.leaves(self.opt_state))
        return max(used(acc) + opt, used(apply))

    def run(self) -> float:
        start = time.perf_counter()
        self.params, self.opt_state, info = train_update.update(
            self.graphdef, self.params, self.opt_state, self.mini, optimizer=self.optimizer,
            settings=self.settings, micro=self.micro)
        jax.block_until_ready((self.params, info))
        return time.perf_counter() - start


def _decode_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(model.decode_layers)))


def _generate_seconds(model, prompts, a) -> float:
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=a.new_tokens, temperature=1.0, num_samples=a.samples, seed=0)
    assert sum(map(len, out.completion_ids)) == len(prompts) * a.samples * a.new_tokens
    return time.perf_counter() - start


def _alternate(runs: dict, iters: int) -> dict[str, float]:
    """Median seconds of each callable, after one untimed call each, timed in turn `iters` times."""
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(iters):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    a = _args(argv or [])
    cfg = _config(a)
    base, adapted = _models(cfg, a)
    print(f"model: {cfg.num_params() / 1e6:.1f}M params ({a.dtype}), {cfg.num_hidden_layers} layers, "
          f"D={cfg.hidden_size}, vocab {cfg.vocab_size}; LoRA rank {a.rank} on q,k,v,o,gate,up,down; "
          f"{jax.devices()[0].platform}, {jax.device_count()} device(s)")

    mini = jax.device_put(_mini(cfg, a), jax.devices()[0])
    copy = lambda m: nnx.merge(nnx.graphdef(m), jax.tree.map(jnp.copy, nnx.state(m)))  # noqa: E731 - updates donate
    updates = {"full": _Update(copy(base), mini, a), "lora": _Update(copy(adapted), mini, a)}
    seconds = _alternate({k: u.run for k, u in updates.items()}, a.iters)
    print(f"\nupdate: {a.rows} rows x ({a.prompt_len} + {a.response_len}) tokens, micro-batches of {a.micro}")
    for name, u in updates.items():
        print(f"  {name:5s} {seconds[name]:8.3f} s/update  {u.trained / 1e6:8.2f}M trained params  "
              f"{u.bytes / 2**20:9.1f} MiB compiled update")
    print(f"  lora / full: time {seconds['lora'] / seconds['full']:.3f}, memory "
          f"{updates['lora'].bytes / updates['full'].bytes:.3f}")

    unmerged = nnx.merge(*nnx.split(adapted))
    unmerged.adapters.merge_for_decode = False
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.prompts)]
    variants = {"base": base, "lora merged": adapted, "lora unmerged": unmerged}
    seconds = _alternate({k: (lambda m=m: _generate_seconds(m, prompts, a)) for k, m in variants.items()}, a.iters)
    tokens = a.prompts * a.samples * a.new_tokens
    print(f"\ndecode: {a.prompts} prompts x {a.samples} samples x {a.new_tokens} new tokens (generate, warm)")
    for name, model in variants.items():
        print(f"  {name:14s} {tokens / seconds[name]:9.1f} tokens/s  per-layer decode weights "
              f"{_decode_bytes(model) / 2**20:8.1f} MiB")
    for name in ("lora merged", "lora unmerged"):
        print(f"  {name} / base: tokens/s {seconds['base'] / seconds[name]:.3f}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
