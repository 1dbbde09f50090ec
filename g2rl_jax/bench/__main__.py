"""Dispatch `python -m g2rl_jax.bench NAME [args]` to the benchmark module NAME."""
import importlib
import sys

from g2rl_jax import cli
from g2rl_jax.bench import BENCHMARKS


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        if argv and argv[0] not in ("-h", "--help"):
            return cli.fail("bench", f"unknown benchmark {argv[0]!r}; choose one of: {known}")
        print(f"usage: python -m g2rl_jax.bench NAME [args]\n  NAME: {known}")
        return 0
    module = importlib.import_module(BENCHMARKS[argv[0]])
    try:
        return module.main(argv[1:]) or 0
    except cli.USER_ERRORS as err:  # e.g. `bench step --config` with a bad config
        return cli.fail(f"bench {argv[0]}", err)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
