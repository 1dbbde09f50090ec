"""figures and the plot CLI: the training-dynamics figure from real metrics.jsonl files (MetricsWriter), default
output paths, and the geometry figure from analyze's stats; every figure is checked to be a valid PNG of the
expected size."""
import math

import matplotlib.image
import numpy as np
import pytest

from g2rl_jax import figures, plot
from g2rl_jax.analyze import geometry_stats, pairwise_cosines
from g2rl_jax.train.metrics import MetricsWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path, width_in, height_in, dpi=120):
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.shape == (round(height_in * dpi), round(width_in * dpi), 4)
    assert np.ptp(image[..., :3]) > 0  # something was drawn


def _write_run(run_dir, steps, *, novelty: bool, val_every: int = 0):
    writer = MetricsWriter(run_dir, start_step=0)
    for step in range(1, steps + 1):
        scalars = {"accuracy": step / steps, "reward": 0.0, "loss": 0.1, "kl": 0.0, "entropy": 1.0 / step,
                   "response_length": 10.0 * step, "novelty": 0.5 if novelty else math.nan}
        if val_every and step % val_every == 0:
            scalars["val/aime25/mean@8"] = 0.1 * step
        writer.write(step, scalars)
    writer.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    _write_run(root / "grpo", 6, novelty=False)
    _write_run(root / "g2rl", 6, novelty=True, val_every=3)
    return root


def test_training_figure_from_run_dirs(runs, tmp_path):
    loaded = figures.load_runs([runs / "grpo", runs / "g2rl"])
    assert list(loaded) == ["grpo", "g2rl"]
    assert loaded["grpo"][0]["novelty"] is None  # NaN is stored as null and skipped when drawing
    assert figures.curve_keys(loaded) == ["accuracy", "val/aime25/mean@8", "response_length", "entropy", "novelty"]
    assert figures.panel_title("val/aime25/mean@8") == "aime25 mean@8 (validation)"
    steps, values = figures._series(loaded["g2rl"], "val/aime25/mean@8")
    np.testing.assert_array_equal(steps, [3, 6])
    np.testing.assert_allclose(values, [0.3, 0.6])
    assert len(figures._series(loaded["grpo"], "novelty")[0]) == 0
    out = tmp_path / "fig" / "curves.png"
    assert plot.main([str(runs / "grpo"), str(runs / "g2rl"), "--out", str(out)]) == 0
    _assert_png(out, 4.6 * 3, 3.4 * 2)  # 5 panels on a 2 x 3 grid


def test_default_output_paths(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plot.main([str(runs / "grpo")]) == 0
    _assert_png(runs / "grpo" / "curves.png", 4.6 * 3, 3.4 * 2)  # one run: next to its metrics
    assert plot.main([str(runs / "grpo"), str(runs / "g2rl")]) == 0
    _assert_png(tmp_path / "curves.png", 4.6 * 3, 3.4 * 2)  # several: the working directory


def test_run_without_metrics_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        figures.load_runs([tmp_path])


@pytest.mark.parametrize("semantic", [True, False])
def test_geometry_figure(tmp_path, semantic, monkeypatch):
    from matplotlib.colors import to_hex

    drawn = []
    save = figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: (drawn.append(fig), save(fig, path))[1])
    rng = np.random.default_rng(0)
    models = {}
    for label, shift in (("GRPO", 1.0), ("G2RL", 0.2)):
        cos = pairwise_cosines(rng.standard_normal((5, 8, 16)) + shift)
        sem = pairwise_cosines(rng.standard_normal((5, 8, 16)) + 2.0) if semantic else None
        models[label] = geometry_stats(cos, sem)
    out = figures.geometry_figure(models, tmp_path / f"geometry_{semantic}.png", title="test")
    _assert_png(out, 15, 4.2)
    left, middle, right = drawn[0].axes  # the paper's three panels
    assert "gradient" in left.get_title() and "semantic" in middle.get_title() and "negative" in right.get_title()
    bar_colours = [to_hex(bar.get_facecolor()) for bar in right.patches]
    assert len(set(bar_colours)) == 2, "one colour per model"
    assert [t.get_text() for t in right.get_xticklabels()] == ["GRPO", "G2RL"]
    np.testing.assert_allclose([bar.get_height() for bar in right.patches],
                               [100 * models[m]["negative_pair_ratio"] for m in ("GRPO", "G2RL")])
    for ax in (left, middle) if semantic else (left,):  # each model's histogram in that model's colour
        lines = {line.get_label(): to_hex(line.get_edgecolor()) for line in ax.patches if line.get_label() in models}
        assert lines == dict(zip(("GRPO", "G2RL"), bar_colours)), ax.get_title()


def test_empty_inputs_are_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        figures.geometry_figure({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one"):
        figures.training_figure({}, tmp_path / "x.png")
