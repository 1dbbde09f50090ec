"""Benchmarks: `python -m g2rl_jax.bench NAME [args]`. Each NAME is a module here with `main(argv)`.

Every benchmark measures ratios side by side in one run (these machines are noisy) and prints the
figures docs/performance.md quotes, with the command that produced them.
"""

BENCHMARKS = {
    "forward": "g2rl_jax.bench.forward",   # model forward vs transformers PyTorch (issue: foundation)
    "rollout": "g2rl_jax.bench.rollout",   # generate() vs transformers generate (issue: rollout)
    "score": "g2rl_jax.bench.score",       # fused token_stats vs log-probs alone / naive (issue: G2RL core)
    "verify": "g2rl_jax.bench.verify",     # answers verified per second per core (issue: rewards)
    "step": "g2rl_jax.bench.step",         # RL step split: rollout / rewards / scoring / update (issue: training)
    "methods": "g2rl_jax.bench.methods",   # each exploration method's cost per step against GRPO, side by side
    "update": "g2rl_jax.bench.update",     # the PPO update alone: time and MFU per remat / micro / dtype setting
    "lora": "g2rl_jax.bench.lora",         # LoRA vs full fine-tuning: update time and memory, decode tokens/s
    "compile": "g2rl_jax.bench.compile",   # compile seconds of a step's programs, per program and per thread count
    "scan_decode": "g2rl_jax.bench.scan_decode",  # the decode segment's layers unrolled vs scanned: compile, memory
    "ladder": "g2rl_jax.bench.ladder",     # the rollout's rungs and prompt buckets: programs vs decode roofline
    "storage": "g2rl_jax.bench.storage",   # a run in a bucket vs local disk: checkpoints, metrics, first step
    "preempt": "g2rl_jax.bench.preempt",   # kill -9 at random moments (>= 20), relaunch as another host: lost steps
    "fence": "g2rl_jax.bench.fence",       # tensorstore straight to the store vs through the fence's forwarder: MB/s
    "chaos": "g2rl_jax.bench.chaos",       # >= 30 faults (kill, stop, outage, storms, lost replies): records once
    "tune-shapes": "g2rl_jax.bench.tune_shapes",  # measured shape tuning: a shape file run.shapes_file pins
    "programs": "g2rl_jax.bench.programs",  # what one run compiles: the listener's count beside the bill, by kind
    "once": "g2rl_jax.bench.once",         # a run compiles once: trainer, study, rollout and TPU bill, before/after
    "async": "g2rl_jax.bench.ahead",       # rollout ahead of the update (k = 0, 1, 2) vs colocated, side by side
    "async_sides": "g2rl_jax.bench.async_sides",  # one process per side: the weight sync's seconds and bytes
    "gpu": "g2rl_jax.bench.gpu",           # the GPU batch: decode vs roofline, long tail, update MFU, step, cold/warm
    "channel": "g2rl_jax.bench.channel",   # the key-value channel between two processes: MB/s of a large value
}
