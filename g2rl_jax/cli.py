"""Bad input to any command (`python -m g2rl_jax.train`, eval, analyze, export, plan, plot, bench, the demo's
explore_eval) ends the same way: one line on stderr, `<command> error: <what is wrong and what to do>`, exit code
2 (Exit.BAD_INPUT, control/exits.py), no traceback.

    parser = cli.ArgumentParser(prog="python -m g2rl_jax.eval", ...)  # a bad flag: one line, not the usage text
    try:
        ...
    except cli.USER_ERRORS as err:
        return cli.fail("eval", err)

USER_ERRORS are the errors whose message already says what to fix: a config (ConfigError, YAML syntax included), a
dataset (DataError: file and line), a path that is not there. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from g2rl_jax.control.exits import Exit
from g2rl_jax.data.datasets import DataError
from g2rl_jax.errors import ConfigError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


def one_line(message: object) -> str:
    """The message on one line (its lines joined with '; ')."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def fail(command: str, err: BaseException | str) -> int:
    """Print `<command> error: <err>` on one line to stderr; returns the exit code for bad input."""
    print(f"{command} error: {one_line(err)}", file=sys.stderr, flush=True)
    return Exit.BAD_INPUT


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, bad value, a check calling `parser.error`) are one line naming --help,
    instead of the usage text and the error."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.split("g2rl_jax.", 1)[-1]
        fail(command, f"{message} (see {self.prog} --help)")
        raise SystemExit(Exit.BAD_INPUT)
