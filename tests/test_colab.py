"""launch/colab.ipynb runs top to bottom on CPU (nbclient, a real Jupyter kernel): it loads the demo model
(`demo:DIR`, built once for the session; the build itself is tested in test_demo_assets.py), samples a group,
shows Φ, ν, shaped rewards and advantages, runs one training step, and one with LoRA."""
import pathlib

import nbformat
from nbclient import NotebookClient

from _helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_colab_notebook_executes(tmp_path, monkeypatch, demo_model_dir):
    monkeypatch.setenv("G2RL_MODEL_PATH", f"demo:{demo_model_dir}")  # built once for the session (conftest.py)
    monkeypatch.setenv("G2RL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # one CPU device, as in a fresh Colab CPU runtime
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in cell.get("outputs", [])) for i, cell in enumerate(nb.cells)
               if cell.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "pairwise cosines" in text and "A(G2RL)" in text
    assert "accuracy" in text and "novelty" in text and "grad_norm" in text
    assert "LoRA rank 8:" in text and "base unchanged: True" in text  # the LoRA cell
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors


def test_install_cell_in_colab_without_a_repo_says_what_to_set(tmp_path, monkeypatch):
    """In Colab with no checkout and no REPO, the install cell stops with an error naming REPO / G2RL_REPO."""
    import sys
    import types

    import pytest

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.delenv("G2RL_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    install = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4).cells[1].source
    with pytest.raises(ValueError, match="set REPO in this cell \\(or G2RL_REPO\\)"):
        exec(compile(install, "colab install cell", "exec"), {})
