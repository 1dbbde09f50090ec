"""Config: YAML loading, typed overrides, error messages, base-file inclusion, help text, resolved round trip."""
from pathlib import Path

import pytest

from g2rl_jax import config as C

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MINIMAL = "run:\n  output_dir: out\nmodel:\n  path: model_dir\n"


@pytest.fixture
def minimal(tmp_path):
    path = tmp_path / "min.yaml"
    path.write_text(MINIMAL)
    return path


def test_yaml_load_and_defaults(minimal):
    cfg = C.load_config(minimal)
    assert cfg.run.output_dir == "out" and cfg.model.path == "model_dir"
    assert cfg.algorithm == C.AlgorithmConfig()
    assert cfg.optim.learning_rate == 5e-7 and cfg.algorithm.kl_coef == 0.001


def test_overrides_of_every_type(minimal):
    cfg = C.load_config(minimal, [
        "run.total_steps=10",                      # int
        "optim.learning_rate=1e-6",                # float in exponent form (PyYAML would read a string)
        "algorithm.filter_equal_groups=true",      # bool
        "model.path=/abs/model",                   # str
        "rollout.top_k=50",                        # Optional[int] set
        "algorithm.dual_clip=3",                   # Optional[float] from an int literal
        "algorithm.exploration=grpo",              # Literal
        "data.eval_datasets=math500, aime2024",    # tuple[str, ...] from "a,b"
        "distributed.coordinator_address=10.0.0.1:1234",
    ])
    assert cfg.run.total_steps == 10 and isinstance(cfg.run.total_steps, int)
    assert cfg.optim.learning_rate == 1e-6 and isinstance(cfg.optim.learning_rate, float)
    assert cfg.algorithm.filter_equal_groups is True
    assert cfg.model.path == "/abs/model"
    assert cfg.rollout.top_k == 50
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.algorithm.exploration == "grpo"
    assert cfg.data.eval_datasets == ("math500", "aime2024")
    assert cfg.distributed.coordinator_address == "10.0.0.1:1234"
    back = C.load_config(minimal, ["rollout.top_k=50", "rollout.top_k=null", "algorithm.filter_equal_groups=0"])
    assert back.rollout.top_k is None and back.algorithm.filter_equal_groups is False


def test_yaml_values_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "optim:\n  learning_rate: 5e-7\ndata:\n  eval_datasets: [aime2025]\n"
                    "rollout:\n  temperature: 1\n")
    cfg = C.load_config(path)
    assert cfg.optim.learning_rate == 5e-7 and cfg.data.eval_datasets == ("aime2025",)
    assert isinstance(cfg.rollout.temperature, float)


def test_unknown_key_names_nearest_and_source(minimal, tmp_path):
    with pytest.raises(C.ConfigError, match=r"unknown key 'algorithm\.explorasion'.*'algorithm\.exploration'"):
        C.load_config(minimal, ["algorithm.explorasion=grpo"])
    with pytest.raises(C.ConfigError, match=r"'rollout\.lam'.*did you mean 'algorithm\.lam'"):
        C.load_config(minimal, ["rollout.lam=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL + "optim:\n  learnig_rate: 1e-6\n")
    with pytest.raises(C.ConfigError, match=rf"{bad}.*'optim\.learnig_rate'.*'optim\.learning_rate'"):
        C.load_config(bad)
    bad.write_text(MINIMAL + "optimizer:\n  learning_rate: 1e-6\n")
    with pytest.raises(C.ConfigError, match=r"unknown group 'optimizer'; did you mean 'optim'"):
        C.load_config(bad)


def test_bad_literal_lists_allowed_values(minimal):
    with pytest.raises(C.ConfigError, match=r"algorithm\.exploration: 'ppo'.*grpo, entropy_bonus, evol, g2rl"):
        C.load_config(minimal, ["algorithm.exploration=ppo"])


@pytest.mark.parametrize("override, pattern", [
    ("run.total_steps=ten", r"run\.total_steps: expected an int"),
    ("run.total_steps=2.5", r"run\.total_steps: expected an int"),
    ("optim.learning_rate=fast", r"optim\.learning_rate: expected a float"),
    ("algorithm.filter_equal_groups=maybe", r"filter_equal_groups: expected a bool"),
    ("run.total_steps", r"expected group\.key=value"),
])
def test_bad_type_names_key_and_source(minimal, override, pattern):
    with pytest.raises(C.ConfigError, match=pattern) as info:
        C.load_config(minimal, [override])
    assert "command-line override" in str(info.value)


def test_bad_type_in_yaml_names_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL.replace("model_dir", "123"))
    with pytest.raises(C.ConfigError, match=rf"{path}: model\.path: expected a string"):
        C.load_config(path)


@pytest.mark.parametrize("override, key", [
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.temperature=-0.1", "rollout.temperature"),
    ("run.total_steps=0", "run.total_steps"),
    ("algorithm.micro_batch_size=5", "algorithm.micro_batch_size"),   # does not divide 32
    ("algorithm.mini_batch_size=48", "algorithm.mini_batch_size"),    # does not divide 16*16
    ("algorithm.exploration=evol", "algorithm.embedding_model"),      # evol needs an encoder
    ("algorithm.embedding_model=enc", "algorithm.embedding_model"),   # ...and only evol reads one
    ("algorithm.exploration=entropy_bonus", "algorithm.entropy_coef"),
    ("algorithm.entropy_coef=0.01", "algorithm.entropy_coef"),          # ...and only entropy_bonus reads it
    ("algorithm.entropy_coef=0.01", "algorithm.entropy_coef"),
    ("mesh.data=-1", "mesh.fsdp"),                                    # two fill axes
    ("distributed.process_id=0", None),
    ("rollout.temperature=0", "rollout.temperature"),                 # greedy groups carry no signal
    ("optim.learning_rate=inf", "optim.learning_rate"),
    ("optim.learning_rate=nan", "optim.learning_rate"),
    ("optim.learning_rate=0", "optim.learning_rate"),
    ("optim.learning_rate=-1e-6", "optim.learning_rate"),
    ("run.seed=-1", "run.seed"),
    ("run.seed=4294967296", "run.seed"),                              # 2**32
    ("data.shuffle_seed=-3", "data.shuffle_seed"),
    ("run.output_dir=", "run.output_dir"),                            # would write into the current directory
    ("run.output_dir=  ", "run.output_dir"),
    ("data.fields=problem", "data.fields"),                           # FIELD=KEY
    ("data.fields=question=q", "data.fields"),                        # not an Example field
])
def test_post_init_checks(minimal, override, key):
    if key is None:  # valid: process_id without num_processes (auto-detected count)
        assert C.load_config(minimal, [override]).distributed.process_id == 0
        return
    with pytest.raises(C.ConfigError, match=rf"command-line override.*{key}"):
        C.load_config(minimal, [override])


def test_required_key_missing(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  output_dir: out\n")
    with pytest.raises(C.ConfigError, match=r"model\.path is required.*model\.path=VALUE"):
        C.load_config(path)


def test_base_inclusion_relative_to_including_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text(MINIMAL + "run:\n  output_dir: base_out\n  total_steps: 7\n")
    child = tmp_path / "sub" / "child.yaml"
    child.write_text("base: ../base.yaml\nrun:\n  total_steps: 9\nalgorithm:\n  exploration: grpo\n")
    cfg = C.load_config(child, ["run.seed=3"])
    assert (cfg.run.output_dir, cfg.run.total_steps, cfg.run.seed) == ("base_out", 9, 3)
    assert cfg.model.path == "model_dir" and cfg.algorithm.exploration == "grpo"
    (tmp_path / "base.yaml").write_text("base: sub/child.yaml\n")
    with pytest.raises(C.ConfigError, match="cycle"):
        C.load_config(child)


def test_error_in_base_names_base_file(tmp_path):
    (tmp_path / "base.yaml").write_text(MINIMAL + "rollout:\n  top_p: 2.0\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\n")
    with pytest.raises(C.ConfigError, match=rf"{tmp_path / 'base.yaml'}: rollout\.top_p"):
        C.load_config(tmp_path / "child.yaml")


def test_help_lists_every_key_with_description():
    text = C.format_help()
    for key in C.all_keys():
        assert f"  {key} [" in text, key
    for binding in ("run.output_dir", "run.total_steps", "run.checkpoint_every", "run.eval_every", "run.seed",
                    "model.path", "algorithm.exploration", "algorithm.embedding_model",
                    "distributed.coordinator_address", "distributed.num_processes", "distributed.process_id"):
        assert binding in C.all_keys()
    assert "grpo|entropy_bonus|evol|g2rl" in text and "(required)" in text


def test_resolved_round_trip(minimal, tmp_path):
    cfg = C.load_config(minimal, ["data.eval_datasets=a,b", "rollout.top_k=20", "optim.eps=1e-12",
                                  "algorithm.exploration=evol", "algorithm.embedding_model=enc"])
    written = C.save_resolved(cfg, tmp_path / "run")
    assert written == tmp_path / "run" / "config.yaml"
    assert C.load_config(written) == cfg


@pytest.mark.parametrize("name", ["qwen3_1p7b_g2rl", "qwen3_4b_g2rl", "qwen3_1p7b_grpo",
                                  "qwen3_1p7b_entropy_bonus", "qwen3_1p7b_evol"])
def test_paper_configs_load(name, tmp_path):
    cfg = C.load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.data.prompts_per_step, cfg.rollout.num_samples) == (16, 16)
    assert (cfg.rollout.temperature, cfg.data.eval_temperature) == (1.0, 0.8)
    assert (cfg.optim.learning_rate, cfg.algorithm.kl_coef, cfg.algorithm.kl_kind) == (5e-7, 0.001, "k3")
    assert cfg.rollout.max_new_tokens == (12288 if "4b" in name else 8192)
    expected = name.split("_", 2)[-1]
    assert cfg.algorithm.exploration == expected
    assert C.load_config(C.save_resolved(cfg, tmp_path)) == cfg


def test_parse_cli(minimal):
    assert C.parse_cli(["--help"]) is None and C.parse_cli([]) is None
    cfg = C.parse_cli(["--config", str(minimal), "run.total_steps=10", "algorithm.exploration=grpo"])
    assert cfg.run.total_steps == 10 and cfg.algorithm.exploration == "grpo"
    with pytest.raises(C.ConfigError, match="--config FILE"):
        C.parse_cli(["run.total_steps=10"])


def test_model_group_offers_what_the_model_supports():
    """model.remat and model.attention take exactly the values RuntimeConfig accepts (no more, no fewer)."""
    import typing

    from g2rl_jax.model.config import ATTENTION_BACKENDS, REMAT_POLICIES

    hints = typing.get_type_hints(C.ModelConfig)
    assert set(typing.get_args(hints["remat"])) == set(REMAT_POLICIES)
    assert set(typing.get_args(hints["attention"])) == set(ATTENTION_BACKENDS)


def test_mesh_minus_one_fills_and_wrong_sizes_name_both_numbers():
    from g2rl_jax.parallel import mesh_sizes

    assert C.MeshConfig() == C.MeshConfig(data=1, fsdp=-1, tensor=1)
    assert mesh_sizes(C.MeshConfig(), 8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert mesh_sizes(C.MeshConfig(data=2, fsdp=2, tensor=-1), 8) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(C.ConfigError, match="the fixed axes multiply to 3, which does not divide the 8 devices"):
        mesh_sizes(C.MeshConfig(data=3), 8)
    with pytest.raises(C.ConfigError, match="needs 4 devices, but there are 8"):
        mesh_sizes(C.MeshConfig(data=2, fsdp=2), 8)
def test_seed_limits_and_data_fields(minimal):
    cfg = C.load_config(minimal, ["run.seed=4294967295", "data.fields=problem=question, answer = gold"])
    assert cfg.run.seed == 2**32 - 1
    assert cfg.data.field_map() == {"problem": "question", "answer": "gold"}
    assert C.load_config(minimal).data.field_map() == {}


def test_non_utf8_yaml_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(MINIMAL.replace("model_dir", "mod\xe8le").encode("latin-1"))
    with pytest.raises(C.ConfigError, match=rf"{path}: not UTF-8 text.*save the file as UTF-8"):
        C.load_config(path)


def test_errors_live_below_storage_and_the_config():
    """storage (the lowest layer) raises ConfigError without importing the config, the methods or JAX: a fresh
    interpreter imports g2rl_jax (whose start may import jax itself, on a machine with JAX's CUDA plugin and no
    driver), then storage, and lists what storage added."""
    import subprocess
    import sys

    code = ("import sys, g2rl_jax; before = set(sys.modules); import g2rl_jax.storage; "
            "new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('jax', 'jaxlib', 'flax') "
            "or m.startswith(('g2rl_jax.methods', 'g2rl_jax.config'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from g2rl_jax import errors, storage
    assert storage.ConfigError is errors.ConfigError is C.ConfigError
    assert issubclass(storage.StorageError, C.ConfigError)


def test_no_method_is_special_cased_by_name():
    """What a method needs (the entropy term, an embedding model) comes from its registry entry (Method.needs and
    check), not from `exploration == NAME` tests in the config or the ahead-of-time compile."""
    import re

    root = Path(C.__file__).parent
    for path in [root / "config_groups.py", root / "config.py", *sorted((root / "aot").glob("*.py"))]:
        assert not re.search(r"exploration\s*(==|!=|in)\s*[\"'(]", path.read_text()), path
