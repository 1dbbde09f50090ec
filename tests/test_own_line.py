"""A line the run prints while its progress bar is drawn (the stop line, the lease thread's warnings) starts on a line
of its own: tqdm ends its line only when the bar closes."""
import sys

from tqdm import tqdm

from g2rl_jax.control import lease, stop


def _lines_while_a_bar_is_drawn(say, capsys) -> list[str]:
    bar = tqdm(total=4, file=sys.stderr, desc="step")
    bar.update(1)
    say()
    bar.close()
    return capsys.readouterr().err.split("\n")


def test_the_lease_warning_starts_its_own_line_under_a_progress_bar(capsys):
    lines = _lines_while_a_bar_is_drawn(lambda: lease.warn("could not renew the lease"), capsys)
    assert "warning: could not renew the lease" in lines, lines


def test_the_stop_line_starts_its_own_line_under_a_progress_bar(capsys):
    lines = _lines_while_a_bar_is_drawn(lambda: stop.print_own_line("the run stops"), capsys)
    assert "the run stops" in lines, lines


def test_without_a_bar_the_line_is_printed_alone(capsys):
    lease.warn("alone")
    assert capsys.readouterr().err == "warning: alone\n"
