"""A Hugging Face id is pinned to a commit: the trainer records the commit model.path resolves to as model.revision
(config.yaml, config_history.jsonl, each checkpoint's model.json); a resume loads that commit even after the hub's
main moved on; another commit is refused like any config change; model.revision pins one up front. A fake Hugging
Face cache (models--org--name/refs/main, snapshots/<commit>/, blobs/) with HF_HUB_OFFLINE=1: no network."""
import hashlib
import json
import os

import pytest
from test_train import assets, config  # noqa: F401 - assets is a fixture

from g2rl_jax.config import RESOLVED_NAME, ConfigError, load_config
from g2rl_jax.model.sources import hub_commit
from g2rl_jax.train.lifecycle import HISTORY_FILE, check_resume_config, config_changes, pin_revision

REPO = "tiny-org/tiny-qwen3"


def _commit(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def _snapshot(cache, model_dir, commit: str, main: bool) -> None:
    """`model_dir`'s files as commit `commit` of REPO in Hugging Face cache `cache` (refs/main naming it if `main`)."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(p for p in model_dir.iterdir() if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    if main:
        (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch, assets):  # noqa: F811
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _snapshot(cache, assets["policy"], _commit("a"), main=True)
    return cache


def test_a_hub_id_is_pinned_and_a_resume_keeps_its_commit(assets, hub, tmp_path):  # noqa: F811
    from g2rl_jax.train.loop import Trainer

    a, b = _commit("a"), _commit("b")
    assert hub_commit(REPO, "model.path") == a
    out = tmp_path / "run"
    trainer = Trainer(config(assets, out, steps=1, **{"model.path": REPO}))
    try:
        assert trainer.cfg.model.path.endswith(f"snapshots/{a}")
        assert trainer.model_record["revision"] == a  # each checkpoint's model.json
    finally:
        trainer.close()
    assert load_config(out / RESOLVED_NAME).model.revision == a
    history = [json.loads(line) for line in (out / HISTORY_FILE).read_text().splitlines()]
    assert history[-1]["config"]["model"]["revision"] == a

    _snapshot(hub, assets["policy"], b, main=True)  # the hub's main moves on
    given = config(assets, out, steps=1, **{"model.path": REPO})
    resumed = pin_revision(given, out, resuming=True)
    assert resumed.model.revision == a  # a resume loads the run's commit
    check_resume_config(resumed, out)
    assert pin_revision(given, out, resuming=False).model.revision == b  # a new run takes main as it is now
    moved = pin_revision(config(assets, out, steps=1, **{"model.path": REPO, "model.revision": "main"}), out, True)
    with pytest.raises(ConfigError, match=rf"model\.revision: '{a}' -> '{b}'"):
        check_resume_config(moved, out)
    pinned = pin_revision(config(assets, out, steps=1, **{"model.path": REPO, "model.revision": a}), out, False)
    assert pinned.model.revision == a  # pinned up front, whatever main says
    with pytest.raises(ConfigError, match=rf"model.path: '{REPO}' is not a local directory, and as a Hugging Face "
                                          r"id at revision 'f{40}' .*--revision f{40}"):
        pin_revision(config(assets, out, steps=1, **{"model.path": REPO, "model.revision": "f" * 40}), out, False)
    with pytest.raises(ConfigError, match="model.revision: 'abc' is set, but model.path .* is not a Hugging Face id"):
        pin_revision(config(assets, out, steps=1, **{"model.revision": "abc"}), out, False)


def test_a_run_from_before_revisions_may_resume(assets, tmp_path):  # noqa: F811
    old = config(assets, tmp_path, steps=1, **{"model.path": REPO})  # recorded no commit
    new = config(assets, tmp_path, steps=1, **{"model.path": REPO, "model.revision": _commit("a")})
    assert config_changes(old, new) == []
    assert config_changes(new, old) == [f"model.revision: '{_commit('a')}' -> ''"]
