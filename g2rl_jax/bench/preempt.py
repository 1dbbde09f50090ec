"""`python -m g2rl_jax.bench preempt`: kill -9 a trainer at random moments, at least --kills times, each relaunch as
another host, on a gs:// run (fake-gcs-server on loopback), and count what the kills cost: the chaos soak
(bench/chaos.py) with one fault kind, kill -9, on one trainer process without validation.

With --after-checkpoint each launch is killed the moment it has committed a new checkpoint; with --kills 1 --lease 60
that measures a relaunch's time to resume with the default lease (docs/running.md). Reported as by the chaos soak:
the kills (how many came during a save), lost, doubled and differing records against an uninterrupted run, writes
by a fenced-out holder, human steps, and each relaunch's seconds to its "resumed from the checkpoint" line and to its
first step after it.
"""
from __future__ import annotations

import sys

from g2rl_jax import cli
from g2rl_jax.bench import chaos


def parse_args(argv) -> chaos.Options:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.bench preempt", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kill -9 at least this many launches (default 20)")
    p.add_argument("--steps", type=int, default=6, help="run.total_steps of each run (default 6)")
    p.add_argument("--lease", type=float, default=9.0, help="run.lock_lease_seconds (default 9, the smallest)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--after-checkpoint", action="store_true",
                   help="kill each launch the moment it has committed a new checkpoint, not at a random moment (with "
                        "--kills 1 --lease 60: a relaunch's time to resume with the default lease)")
    args = p.parse_args(argv)
    return chaos.Options(layout="one", faults=args.kills, during_save=0, kinds=("kill",), steps=args.steps,
                         eval_every=0, lease=args.lease, after_checkpoint=args.after_checkpoint, seed=args.seed)


def main(argv=None) -> int:
    return chaos.soak(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
