"""Draw the training-dynamics figure of one or more runs (figures.training_figure):

    python -m g2rl_jax.plot runs/grpo runs/g2rl [--out curves.png]
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from g2rl_jax import cli
from g2rl_jax.figures import load_runs, training_figure


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m g2rl_jax.plot", description="Draw the training-dynamics figure "
                                "(accuracy, response length, entropy, novelty vs step) of one or more runs.")
    p.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl (local or gs://...)")
    p.add_argument("--out", help="PNG path, local or gs://... (default: RUN_DIR/curves.png for one run, "
                                 "./curves.png for several)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or (f"{str(args.runs[0]).rstrip('/')}/curves.png" if len(args.runs) == 1 else "curves.png")
    try:
        path = training_figure(load_runs(args.runs), out)
    except (*cli.USER_ERRORS, ValueError) as err:  # no metrics.jsonl there, or a damaged one
        return cli.fail("plot", err)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
