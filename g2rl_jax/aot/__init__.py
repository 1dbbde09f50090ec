"""Ahead-of-time compile: every program of a training step, compiled for a real accelerator slice without it.

    python -m g2rl_jax.plan --config FILE --target v5p-8 --compile [--programs all|largest] [key=value ...]

    targets.py   Target (platform, user-facing name, compile devices, HBM per chip, hosts, chips) and
                 parse_target(name); TPU names as gcloud's accelerator types (v4-8, v5litepod-16, v5p-8, v6e-8)
    programs.py  the programs of one step (rollout, score, reference, gradient, optimizer, advantages, embedder),
                 lowered from the project's own jitted functions over abstract sharded inputs
    packed.py    with algorithm.packing, the packed score, reference and gradient programs the warm-up compiles
    report.py    compile each one, per-chip bytes from the compiler, the table, planner vs compiler
    bill.py      the whole run's compile bill: the bounded set a run compiles at its first step, its seconds, and
                 their share of the estimated run time
    check.py     the whole check and its one-line verdict (fits, or what to change)

Extending to another platform: write a module that builds `Target`s for its names and registers a parser with
`targets.register(platform, parser, forms)`, where `parser(name) -> Target | None` returns None for names it does
not know and `forms` describes the names it accepts (for the error message). A Target's `make_devices()` returns the
compile-only devices (e.g. `jax.experimental.topologies.get_topology_desc(...).devices`); `hbm_bytes` is the memory
of one device; `peak_tflops` / `hbm_gbps` feed the step-time estimate only. Import the module in
`g2rl_jax/aot/__init__.py` so that its names parse. Nothing else changes: programs.py takes any mesh, and the model's
attention backend follows the mesh's devices' platform.

Compiling needs the platform's compiler: for TPU, libtpu (`pip install "g2rl_jax[tpu]"`, the jax[tpu] of the
pinned jax); without it the command says so in one line. Multi-host slices compile from one process.
"""
from g2rl_jax.aot import gpu  # noqa: F401, E402 - registers the GPU names (h100-8, ...)
from g2rl_jax.aot.targets import Target, TargetError, parse_target, register

__all__ = ["Target", "TargetError", "parse_target", "register"]
