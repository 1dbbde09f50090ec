"""launch/colab.ipynb runs top to bottom on CPU (nbclient, a real Jupyter kernel): it builds the demo model,
samples a group, shows Φ, ν, shaped rewards and advantages, and runs one training step."""
import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_colab_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("G2RL_MODEL_PATH", f"demo:{tmp_path / 'model'}")
    monkeypatch.setenv("G2RL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device, as in a fresh Colab CPU runtime
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in cell.get("outputs", [])) for i, cell in enumerate(nb.cells)
               if cell.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "pairwise cosines" in text and "A(G2RL)" in text
    assert "accuracy" in text and "novelty" in text and "grad_norm" in text
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
