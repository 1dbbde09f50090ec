"""Run control: what keeps an unattended run safe to leave alone.

  exits.py   the exit codes of every process and what a supervisor does with each (stdlib only)
  channel.py the one key-value channel between a run's processes (jax.distributed's store): chunks, bounded gets
  wire.py    values that cross a process or a file: JSON plus arrays, checked when read, never pickle
  stop.py    the one stop path: publish "stop with code C and line L", watch for it, the trainer's end
"""
