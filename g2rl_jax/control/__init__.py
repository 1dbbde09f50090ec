"""Run control: what keeps an unattended run safe to leave alone.

  exits.py   the exit codes of every process and what a supervisor does with each (stdlib only)
"""
