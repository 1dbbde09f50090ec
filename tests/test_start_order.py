"""The trainer's start does the cheap checks first: the datasets' rows are read and checked before any model
resolves (a hub id's commit pinned, a download, the demo model's build), so a bad row is one line in seconds, not
after a 3.4 GB download. An ordering assertion: the model steps record that they ran; none may have."""
import json

import pytest

from g2rl_jax.config import ConfigError, load_config
from g2rl_jax.train import loop


@pytest.mark.parametrize("key", ["data.train_dataset", "data.eval_datasets"])
def test_a_bad_row_is_found_before_the_model_resolves(tmp_path, monkeypatch, key):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in ({"problem": "1+1", "answer": "2"},
                                                               {"problem": "2+2", "answer": None})))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    ran = []

    def model_step(name):
        def step(cfg, *args, **kwargs):
            ran.append(name)
            raise AssertionError(f"{name} ran before the rows were checked")
        return step

    monkeypatch.setattr(loop, "pin_revision", model_step("pin_revision"))  # resolves a hub id's commit
    monkeypatch.setattr(loop, "resolve_model_paths", model_step("resolve_model_paths"))  # downloads, builds the demo
    datasets = {"data.train_dataset": str(good), "data.eval_datasets": str(good), key: str(rows)}
    cfg = load_config("configs/demo.yaml", [f"run.output_dir={tmp_path / 'run'}", "model.path=Qwen/Qwen3-1.7B-Base",
                                            "run.eval_every=2", *(f"{k}={v}" for k, v in datasets.items())])
    with pytest.raises(ConfigError, match=rf"^{key}: .*rows.jsonl:2: .answer. is null"):
        loop.Trainer(cfg)
    assert ran == []
