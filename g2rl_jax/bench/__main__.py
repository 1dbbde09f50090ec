"""Dispatch `python -m g2rl_jax.bench NAME [args]` to the benchmark module NAME."""
import importlib
import sys

from g2rl_jax.bench import BENCHMARKS


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}; choose one of: {known}", file=sys.stderr)
            return 2
        print(f"usage: python -m g2rl_jax.bench NAME [args]\n  NAME: {known}")
        return 0
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
