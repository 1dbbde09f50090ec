"""`python -m g2rl_jax.train --config FILE [key=value ...]`: parse the config, start jax.distributed, open the run
(train/loop.py's Trainer), resume it and train. Every failure a user or a supervisor acts on is one line and an exit
code from control/exits.py: 2 for bad input, 143 after SIGTERM, and the code of each failure classified where it
was raised (control/errors.py: 3 lease lost, 4 device out of memory, 5 reward function, 75 storage, 76 peer lost);
the table and what a supervisor does with each: docs/running.md."""
from __future__ import annotations

import sys

import jax

from g2rl_jax import cli, parallel
from g2rl_jax.config import RESOLVED_NAME, ConfigError
from g2rl_jax.control import stop
from g2rl_jax.control.errors import RunFailure, end_run, exit_code
from g2rl_jax.control.exits import Exit
from g2rl_jax.data import DataError
from g2rl_jax.storage import StorageUnreachable
from g2rl_jax.train.checkpoint import CheckpointError, checkpoint_dir
from g2rl_jax.train.loop import Trainer
from g2rl_jax.train.setup import check_platforms
from g2rl_jax.train.sides import run_rollout_process
from g2rl_jax.train.sides_store import told_if_failed
from g2rl_jax.train.weight_sync import enable_cross_host_transfers


def _setup_failure(err: BaseException) -> int:
    """The one line of a Trainer that could not open the run, and its exit code (control/errors.py's `exit_code`,
    the one mapping): a check's error (config, data, a path given that is not usable) is a config error; a file or
    object that a read or write did not find, or was refused, is a storage error, named with its type (a storage
    client's message may be only the object's path). A run directory whose store did not answer the start's check
    ends as the storage's failure (exit 75: relaunch later)."""
    if isinstance(err, StorageUnreachable):
        print(f"train error: {cli.one_line(err)}", file=sys.stderr, flush=True)
    elif isinstance(err, (ConfigError, DataError)):
        cli.fail("config", err)
    else:
        cli.fail("storage", f"{type(err).__name__}: {err}")
    return int(exit_code(err))


def main(argv: list[str] | None = None) -> int:
    from g2rl_jax.config import format_help, parse_cli

    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_cli(argv)
    except ConfigError as err:
        return cli.fail("config", err)
    if cfg is None:  # --help
        print(format_help())
        return 0
    try:
        if cfg.distributed.transfer_address:  # before the backend starts
            enable_cross_host_transfers(cfg.distributed.transfer_address)
        parallel.initialize_distributed(cfg.distributed)  # before anything touches the devices
        check_platforms()
        parallel.set_sides(cfg.mesh)  # one process per side: before any host collective
    except ValueError as err:
        return cli.fail("config", err)
    if parallel.is_rollout_process(cfg.mesh):  # one process per side: this one draws the samples
        return run_rollout_process(cfg)
    try:
        with told_if_failed(cfg.mesh):  # one process per side: the rollout process ends too
            trainer = Trainer(cfg)
    except cli.USER_ERRORS as err:
        return _setup_failure(err)
    except CheckpointError as err:
        return cli.fail("checkpoint", err)
    except RunFailure as err:  # classified where raised: its line and exit code (control/errors.py)
        end_run(err, None, cfg.run.output_dir, cfg)
    try:
        start = trainer.resume()
    except CheckpointError as err:
        trainer.close()
        return cli.fail("checkpoint", err)
    except RunFailure as err:
        end_run(err, None, trainer.run_dir, trainer.cfg)
    if start and jax.process_index() == 0:
        print(f"resumed from the checkpoint of step {start} in {checkpoint_dir(trainer.run_dir)}", flush=True)
    try:
        trainer.run()
    except RunFailure as err:  # a notebook's: the loop ended the run with it, and raised it (control/stop.py)
        end_run(err, trainer.step, trainer.run_dir, trainer.cfg)
    stop.await_stop()  # another thread of this process stops the run (a lost lease): its code, not done's
    if trainer.preempted:
        saved = (f"the checkpoint of step {trainer.step} is in {checkpoint_dir(trainer.run_dir)}" if trainer.step
                 else "no step had finished, so there is no checkpoint")
        print(f"stopped by SIGTERM after step {trainer.step}: {saved}. Resume with the same command, or "
              f"`python -m g2rl_jax.train --config {trainer.run_dir / RESOLVED_NAME}`", file=sys.stderr, flush=True)
        return Exit.PREEMPTED
    return Exit.DONE


if __name__ == "__main__":
    raise SystemExit(main())
