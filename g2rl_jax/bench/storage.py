"""`python -m g2rl_jax.bench storage`: what keeping a run in a bucket costs, against local disk, side by side in one
run.

The bucket is a fake-gcs-server on loopback (g2rl_jax/bench/gcs_emulator.py, the test extra) behind the strict proxy
(gcs_proxy.py: 429 for a second update of an object within a second, seeded 503s, slow answers and dropped
connections), or a real one with `--url gs://BUCKET/DIR` (credentials needed). Demo size by default (the demo
policy's architecture, random weights):
  checkpoint  Checkpointer.save (to the end of the asynchronous write) and restore_newest of the training state
              (trainable params, AdamW moments, step, RNG key), median of --repeats, each to a fresh directory;
  metrics     MetricsWriter.write of one step's record (--scalars numbers, jsonl + TensorBoard) over --steps steps:
              per-step mean, and the last --tail steps' mean (a growing file must not cost more per step);
  first step  `python -m g2rl_jax.train` for one step (no validation) with model.path a local directory and the same
              directory in the bucket, fresh processes, alternating --first-repeats times: seconds from the launch to
              the first step's metrics record, and the copy to the local cache alone (storage.local_copy).
  requests    (the proxy only) what each file costs the bucket, counted by the proxy: a trainer's steps
              (--request-steps records, --step-seconds apart, a checkpoint every --checkpoint-every steps with the
              metrics flushed before it) per step for metrics.jsonl, the TensorBoard events and per checkpoint;
              eval's records per problem (--problems, --problem-seconds apart), buffered as eval writes them and,
              for comparison, one append per record as before: requests, bytes each way, and the 429s the proxy served;
              and checkpoint saves as the Checkpointer writes them (one tensorstore transaction per process: one
              manifest.ocdbt write; on GCS into a launch's own directory, copied into place) against the same
              written in place (as before) and per-array commits (Orbax's default), each with the proxy's
              one-update-a-second rule and without it.
The emulator is on this machine, so its figures are the storage layer's own cost (requests, copies, composes)
without a network's latency; docs/performance.md says what a real bucket adds.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from g2rl_jax import cli, storage

ROOT = str(Path(__file__).resolve().parents[2])


def parse_args(argv):
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench storage", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a real bucket directory to measure (default: a fake-gcs-server on loopback)")
    p.add_argument("--hidden", type=int, help="model width (default: the demo policy's)")
    p.add_argument("--layers", type=int, help="model layers (default: the demo policy's)")
    p.add_argument("--repeats", type=int, default=5, help="checkpoint saves and restores per target")
    p.add_argument("--steps", type=int, default=200, help="metrics records per target")
    p.add_argument("--tail", type=int, default=20, help="the last steps whose mean is shown separately")
    p.add_argument("--scalars", type=int, default=40, help="numbers per metrics record (a demo step writes ~40)")
    p.add_argument("--first-repeats", type=int, default=1, help="trainer launches per model location (0: skip)")
    p.add_argument("--request-steps", type=int, default=30, help="requests: a trainer's steps")
    p.add_argument("--step-seconds", type=float, default=0.3, help="requests: seconds between a trainer's steps")
    p.add_argument("--checkpoint-every", type=int, default=10, help="requests: steps between checkpoints")
    p.add_argument("--problems", type=int, default=100, help="requests: eval problems (buffered records)")
    p.add_argument("--problem-seconds", type=float, default=0.05, help="requests: seconds between eval's problems")
    p.add_argument("--unbuffered-problems", type=int, default=10, help="requests: problems appended one at a time")
    return p.parse_args(argv)


def _model_dir(out: str, hidden: int | None, layers: int | None) -> str:
    """A random Qwen3 of the demo policy's architecture (or the given width and depth) with the demo tokenizer."""
    import dataclasses

    from flax import nnx

    from g2rl_jax.demo.build import demo_architecture
    from g2rl_jax.demo.tokenizer import make_tokenizer
    from g2rl_jax.model import Qwen3, RuntimeConfig, save_pretrained

    cfg = demo_architecture()
    if hidden or layers:
        cfg = dataclasses.replace(cfg, hidden_size=hidden or cfg.hidden_size,
                                  num_hidden_layers=layers or cfg.num_hidden_layers)
    save_pretrained(Qwen3(cfg, RuntimeConfig(), rngs=nnx.Rngs(0)), out)
    make_tokenizer().save_pretrained(out)
    return out


def _state(model_dir: str):
    """The training state a checkpoint holds (trainer.state()): params, AdamW moments, step, RNG key data."""
    import jax
    import optax
    from flax import nnx

    from g2rl_jax.model import load_pretrained

    params = nnx.state(load_pretrained(model_dir))
    return {"params": params, "opt_state": optax.adamw(1e-3).init(params), "step": jax.numpy.int32(1),
            "rng": jax.random.key_data(jax.random.key(0))}


class _Iterator:
    def get_state(self):
        return {"position": 1}

    def set_state(self, state):
        pass


def _checkpoint(root: str, state, repeats: int) -> tuple[float, float, int]:
    """(median save s, median restore s, bytes per checkpoint)."""
    import jax

    from g2rl_jax.train.checkpoint import Checkpointer

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    saves, restores = [], []
    for i in range(repeats):
        ckpt = Checkpointer(f"{root}/ckpt{i}", every=1, keep=1)
        t0 = time.perf_counter()
        ckpt.save(1, state, _Iterator(), force=True)
        ckpt.wait()
        saves.append(time.perf_counter() - t0)
        ckpt.close()
        reader = Checkpointer(f"{root}/ckpt{i}", every=1, keep=1)
        t0 = time.perf_counter()
        step, restored = reader.restore_newest(abstract, _Iterator())
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - t0)
        assert step == 1
        reader.close()
    size = sum(int(leaf.size * leaf.dtype.itemsize) for leaf in jax.tree.leaves(state))
    return statistics.median(saves), statistics.median(restores), size


def _metrics(root: str, steps: int, tail: int, scalars: int) -> tuple[float, float]:
    """(mean s per write over all steps, mean over the last `tail`)."""
    from g2rl_jax.train.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(root, start_step=0, loggers=("jsonl", "tensorboard"))
    rng = np.random.default_rng(0)
    times = []
    for step in range(1, steps + 1):
        record = {f"metric_{k}": float(v) for k, v in enumerate(rng.standard_normal(scalars))}
        t0 = time.perf_counter()
        writer.write(step, record)
        times.append(time.perf_counter() - t0)
    writer.close()
    assert len(read_metrics(root)) == steps
    return float(np.mean(times)), float(np.mean(times[-tail:]))


def _part_of(obj: str, root: str) -> str | None:
    """Which file of a run an object belongs to: metrics, events, checkpoint, records (a compose part counts as
    its file's)."""
    if not obj.startswith(root):
        return None
    rel = "/" + obj[len(root):].lstrip("/")
    for folder, part in (("/checkpoints/", "checkpoint"), ("/tensorboard/", "events"), ("/records/", "records")):
        if folder in rel:
            return part
    return "metrics" if "metrics.jsonl" in rel else None


def _tally(log, root: str) -> dict[str, list[int]]:
    """file -> [requests, bytes sent, bytes received, 429s served] of the proxy's log under `root`."""
    out: dict[str, list[int]] = {}
    for r in log:
        part = _part_of(r.obj, root) if r.obj else None
        if part:
            row = out.setdefault(part, [0, 0, 0, 0])
            row[0] += 1
            row[1] += r.bytes_in
            row[2] += r.bytes_out
            row[3] += r.status == 429
    return out


def _requests(proxy, url: str, state, args) -> list[tuple[str, str, float, list[int]]]:
    """(what, per, count, [requests, bytes up, bytes down, 429s]) rows: a trainer's steps and eval's records."""
    from g2rl_jax.train.checkpoint import Checkpointer
    from g2rl_jax.train.metrics import MetricsWriter

    bucket_root = url.split("://", 1)[1]
    rng = np.random.default_rng(0)
    run = f"{url}/requests_run"
    proxy.reset()
    writer = MetricsWriter(run, start_step=0, loggers=("jsonl", "tensorboard"))
    ckpt = Checkpointer(run, every=args.checkpoint_every, keep=2)
    for step in range(1, args.request_steps + 1):
        time.sleep(args.step_seconds)
        writer.write(step, {f"metric_{k}": float(v) for k, v in enumerate(rng.standard_normal(args.scalars))})
        if step % args.checkpoint_every == 0:
            writer.flush()  # as the trainer does: the step's record flushed before its checkpoint
        ckpt.save(step, state, _Iterator())
    ckpt.close()
    writer.close()
    tally = _tally(proxy.log, f"{bucket_root}/requests_run")
    checkpoints = args.request_steps // args.checkpoint_every
    rows = [("metrics.jsonl", "step", args.request_steps, tally.get("metrics", [0] * 4)),
            ("TensorBoard events", "step", args.request_steps, tally.get("events", [0] * 4)),
            ("checkpoint (Orbax)", "checkpoint", checkpoints, tally.get("checkpoint", [0] * 4))]
    for label, problems, buffered in (("eval records, buffered", args.problems, True),
                                      ("eval records, one append each", args.unbuffered_problems, False)):
        proxy.reset()
        path = f"{url}/requests_eval_{int(buffered)}/records/key.jsonl"
        record = json.dumps({"dataset": "d", "id": "0", "answers": ["1"] * 16, "correct": [True] * 16}) + "\n"
        appender = storage.Appender(path) if buffered else None
        t0 = time.perf_counter()
        for _ in range(problems):
            time.sleep(args.problem_seconds)
            appender.write(record) if buffered else storage.append_text(path, record)
        if appender is not None:
            appender.close()
        seconds = (time.perf_counter() - t0) / problems
        rows.append((f"{label} ({seconds:.2f} s a problem, {args.problem_seconds:g} s of it sampling)", "problem",
                     problems, _tally(proxy.log, bucket_root).get("records", [0] * 4)))
    return rows


def _per_array_commits():
    """The Checkpointer as it was: Orbax's PyTree handler under its default bound on bytes in flight (96 GB, as
    StandardCheckpointHandler), so every array's write commits on its own (checkpoint._state_handler says why)."""
    from unittest import mock

    import orbax.checkpoint as ocp

    from g2rl_jax.train import checkpoint

    return mock.patch.object(checkpoint, "_state_handler", lambda: ocp.PyTreeCheckpointHandler())


def _in_place():
    """The Checkpointer's commit on GCS as it was: each step written in place into `<step>/`, its commit_success.txt
    written last (Orbax's CommitFileTemporaryPath, the commit fenced), not in a launch's own directory copied into
    place (control/commits.py)."""
    from unittest import mock

    import orbax.checkpoint as ocp

    from g2rl_jax.control import commits, fence

    class InPlace(ocp.path.atomicity.CommitFileTemporaryPath):
        async def finalize(self, *args, **kwargs):
            with fence.guard(self.get_final()):
                await super().finalize(*args, **kwargs)

    return mock.patch.object(commits, "fenced_commits", lambda directory, launch: InPlace)


def _manifest_retries(proxy, url: str, state, repeats: int) -> list[tuple[str, str, float, int, int, int]]:
    """(save mode, rule, median save s, requests, manifest.ocdbt writes, 429s served; per save) of checkpoint saves
    with the proxy's one-update-a-second rule and without it: the Checkpointer's (one transaction per process, into a
    launch's own directory copied into place), the same written in place as before, and per-array commits (the same
    proxy and faults, alternating)."""
    from g2rl_jax.train.checkpoint import Checkpointer

    rule = proxy.update_interval
    modes = {"one transaction, own directory": contextlib.nullcontext, "one transaction, in place": _in_place,
             "per-array commits": _per_array_commits}
    runs = [(mode, interval) for mode in modes for interval in (rule, 0.0)]
    times: dict = {run: [] for run in runs}
    counts: dict = {run: [0, 0, 0] for run in runs}
    try:
        for i in range(repeats):
            for mode, interval in runs:
                proxy.update_interval = interval
                start = len(proxy.log)
                with modes[mode]():
                    ckpt = Checkpointer(f"{url}/manifest_{list(modes).index(mode)}_{interval:g}_{i}", every=1, keep=1)
                    t0 = time.perf_counter()
                    ckpt.save(1, state, _Iterator(), force=True)
                    ckpt.wait()
                    times[mode, interval].append(time.perf_counter() - t0)
                    ckpt.close()
                log = proxy.log[start:]
                counts[mode, interval][0] += len(log)
                counts[mode, interval][1] += sum(r.kind == "upload" and (r.obj or "").endswith("/manifest.ocdbt")
                                                 for r in log)
                counts[mode, interval][2] += sum(r.status == 429 for r in log)
    finally:
        proxy.update_interval = rule
    return [(mode, f"{interval:g} s per object" if interval else "no rate rule",
             statistics.median(times[mode, interval]), *(c / repeats for c in counts[mode, interval]))
            for mode, interval in runs]


def _first_step(model_path: str, out: str, env: dict) -> float:
    """Seconds from launching a one-step trainer to its step-1 metrics record."""
    from g2rl_jax.train.metrics import read_metrics

    cmd = [sys.executable, "-m", "g2rl_jax.train", "--config", f"{ROOT}/configs/demo.yaml",
           f"model.path={model_path}", f"run.output_dir={out}", "run.total_steps=2", "run.eval_every=0",
           "run.checkpoint_every=1000", "run.compilation_cache_dir="]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not read_metrics(out):
            if proc.poll() is not None:
                raise RuntimeError(f"the trainer ended before its first step: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.ExitStack() as stack:
        url, proxy = args.url, None
        if url is None:
            from g2rl_jax.bench.gcs_emulator import STRICT, GcsEmulator

            emulator = stack.enter_context(GcsEmulator(bucket="g2rl-bench", proxy=STRICT))
            url, proxy = emulator.url(f"bench-{os.getpid()}"), emulator.proxy
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="g2rl_bench_storage_"))
        where = {"local disk": f"{local}/run", "bucket": f"{url.rstrip('/')}/run"}
        model_dir = _model_dir(f"{local}/model", args.hidden, args.layers)
        state = _state(model_dir)
        rows = {}
        for name, root in where.items():
            save, restore, size = _checkpoint(f"{root}/checkpoints", state, args.repeats)
            per_step, tail = _metrics(f"{root}/metrics", args.steps, args.tail, args.scalars)
            rows[name] = (save, restore, per_step, tail)
        print(f"checkpoint: {size / 1e6:.2f} MB of state; metrics: {args.scalars} numbers a step, jsonl + tensorboard")
        print("| where | checkpoint save s | checkpoint restore s | metrics ms/step (all) | metrics ms/step "
              f"(last {args.tail}) |")
        print("|---|---|---|---|---|")
        for name, (save, restore, per_step, tail) in rows.items():
            print(f"| {name} | {save:.3f} | {restore:.3f} | {1e3 * per_step:.2f} | {1e3 * tail:.2f} |")
        if proxy is not None:
            t0, earlier = time.perf_counter(), (proxy.served_429, dict(proxy.throttled()))
            rows = _requests(proxy, url, state, args)
            print(f"\nrequests through the strict proxy (faults {proxy.faults}; {time.perf_counter() - t0:.0f} s): "
                  f"{args.request_steps} steps {args.step_seconds} s apart, a checkpoint every "
                  f"{args.checkpoint_every}, "
                  f"records flushed every {storage.flush_seconds():g} s")
            print("| file | per | requests | KB sent | KB received | 429s served (total) |")
            print("|---|---|---|---|---|---|")
            for what, per, count, (requests, up, down, throttled) in rows:
                print(f"| {what} | {per} | {requests / count:.2f} | {up / count / 1e3:.2f} | {down / count / 1e3:.2f} "
                      f"| {throttled} |")
            print(f"429s served while timing the saves, restores and metrics above: {earlier[0]} {earlier[1]}")
            print("\ncheckpoint saves, the Checkpointer's (one transaction per process, a launch's own directory) "
                  "against the same in place and per-array commits, with the proxy's rate rule and without it "
                  "(alternating; requests and 429s per save):")
            print("| save | rule | save s (median) | requests | manifest.ocdbt writes | 429s served |")
            print("|---|---|---|---|---|---|")
            for mode, rule, seconds, requests, manifests, throttled in _manifest_retries(proxy, url, state,
                                                                                         args.repeats):
                print(f"| {mode} | {rule} | {seconds:.2f} | {requests:.0f} | {manifests:.1f} | {throttled:.1f} |")
        if args.first_repeats:
            bucket_model = f"{url.rstrip('/')}/model"
            storage.upload_tree(model_dir, bucket_model)
            env = dict(os.environ, **{storage.CACHE_ENV: f"{local}/cache"})
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):  # the copy's one-line notice
                storage.local_copy(bucket_model, "model.path")
            copy = time.perf_counter() - t0
            storage.rmtree(f"{local}/cache")
            firsts = {"local disk": [], "bucket": []}
            for i in range(args.first_repeats):
                for name, path in (("local disk", model_dir), ("bucket", bucket_model)):
                    storage.rmtree(f"{local}/cache")  # every launch copies the model again
                    firsts[name].append(_first_step(path, f"{local}/first{i}_{name.split()[0]}", env))
            print(f"\ntime to the first step (launch -> step-1 record, compile included; {args.first_repeats} "
                  "launches each, alternating):")
            print("| model.path | seconds (median) | of which the copy to the local cache |")
            print("|---|---|---|")
            print(f"| local directory | {statistics.median(firsts['local disk']):.1f} | - |")
            print(f"| {bucket_model} | {statistics.median(firsts['bucket']):.1f} | {copy:.3f} (measured alone) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
