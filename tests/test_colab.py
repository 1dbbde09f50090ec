"""launch/colab.ipynb runs top to bottom on CPU (nbclient, a real Jupyter kernel started in launch/, as a local
Jupyter opened on the notebook starts it: the notebook finds the checkout above it): it loads the demo model
(`demo:DIR`, built once for the session; the build itself is tested in test_demo_assets.py), samples a group,
shows Φ, ν, shaped rewards and advantages, runs one training step, and one with LoRA. Its GPU and TPU paths are
g2rl_jax.colab's detection and choice, run here with mocked nvidia-smi output, /dev entries and jax devices."""
import pathlib
import subprocess
import sys
import types

import nbformat
import pytest
from nbclient import NotebookClient

from g2rl_jax import colab

from _helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_colab_notebook_executes(tmp_path, monkeypatch, demo_model_dir):
    monkeypatch.setenv("G2RL_MODEL_PATH", f"demo:{demo_model_dir}")  # built once for the session (conftest.py)
    monkeypatch.setenv("G2RL_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("G2RL_COLAB_RUNTIME", "cpu")  # the CPU path, whatever this machine has
    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # one CPU device, as in a fresh Colab CPU runtime
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "launch")}}).execute()  # the kernel's folder
    outputs = {i: "".join(o.get("text", "") for o in cell.get("outputs", [])) for i, cell in enumerate(nb.cells)
               if cell.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert "pairwise cosines" in text and "A(G2RL)" in text
    assert "accuracy" in text and "novelty" in text and "grad_norm" in text
    assert "LoRA rank 8:" in text and "base unchanged: True" in text  # the LoRA cell
    assert "runtime: Runtime(kind='cpu'" in text and "configs/demo.yaml: the embedded demo" in text
    assert f"working in {ROOT}" in text
    restart, command = outputs[max(outputs)].splitlines()  # the whole-run cell: restart first, then the command
    assert restart.startswith("Restart the runtime first (Runtime > Restart session)")
    assert command.startswith(f"!cd {ROOT} && python -m g2rl_jax.train --config configs/demo.yaml model.path=demo:")
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors


def test_install_cell_in_colab_without_a_repo_says_what_to_set(tmp_path, monkeypatch):
    """In Colab with no checkout and no REPO, the install cell stops with an error naming REPO / G2RL_REPO."""
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.delenv("G2RL_REPO", raising=False)
    monkeypatch.chdir(tmp_path)
    install = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4).cells[1].source
    with pytest.raises(ValueError, match="set REPO in this cell \\(or G2RL_REPO\\)"):
        exec(compile(install, "colab install cell", "exec"), {})


def test_the_notebook_opens_with_an_open_in_colab_link_and_says_to_restart_before_the_full_run():
    cells = nbformat.read(ROOT / "launch" / "colab.ipynb", as_version=4).cells
    assert cells[0].source.startswith("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                                      "(https://colab.research.google.com/github/")
    assert "**Restart the runtime first**" in cells[-2].source


def test_the_install_is_shown_as_it_runs(tmp_path):
    """run_shown hands each line of pip's output over as it comes: the child holds its second line until the first
    arrived (a buffered or quiet install would hang here, then fail on the timeout)."""
    gate = tmp_path / "gate"
    child = ("import os, sys, time\nprint('Collecting g2rl_jax', flush=True)\n"
             f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n"
             "print('Installing collected packages', file=sys.stderr, flush=True)\nsys.exit(3)\n")
    seen = []

    def say(line):
        seen.append(line)
        gate.touch()

    assert colab.run_shown([sys.executable, "-c", child], say=say) == 3
    assert seen == ["Collecting g2rl_jax", "Installing collected packages"]


def smi(*answers):
    """A fake subprocess.run for nvidia-smi: each call gets the next answer (stdout text, or a return code)."""
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        answer = answers[len(calls) - 1]
        if isinstance(answer, BaseException):
            raise answer
        code, out = (answer, "") if isinstance(answer, int) else (0, answer)
        return subprocess.CompletedProcess(argv, code, stdout=out, stderr="")

    run.calls = calls
    return run


NO_GPU = smi(FileNotFoundError("nvidia-smi"))


@pytest.mark.parametrize("line, cc, attention_override", [
    ("Tesla T4, 15360, 7.5", (7, 5), True),     # Colab's T4: no cuDNN fused attention before sm_80
    ("NVIDIA L4, 23034, 8.9", (8, 9), False),
    ("NVIDIA A100-SXM4-40GB, 40960, 8.0", (8, 0), False),
])
def test_gpu_runtime_installs_cuda_and_picks_lora(tmp_path, line, cc, attention_override):
    runtime = colab.detect({}, run=smi(line + "\n"), dev=tmp_path)
    assert runtime.kind == "gpu" and runtime.compute_capability == cc and runtime.name == line.split(",")[0]
    assert runtime.memory_gib == round(int(line.split(",")[1]) / 1024, 1)
    assert colab.install_args(runtime, ".") == ["install", "--progress-bar", "off", "-e", ".[cuda]"]
    choice = colab.choose(runtime)
    assert choice.config == colab.LORA_CONFIG and choice.model_path == colab.LORA_MODEL
    assert ("model.attention=xla" in choice.overrides) == attention_override
    assert colab.backend_problem(runtime, "gpu") is None
    assert "restart the runtime" in colab.backend_problem(runtime, "cpu")


def test_old_driver_without_compute_cap_falls_back_to_the_card_name(tmp_path):
    run = smi(6, "Tesla T4, 15360\n")  # nvidia-smi refuses the compute_cap field: asked again without it
    runtime = colab.detect({}, run=run, dev=tmp_path)
    assert len(run.calls) == 2 and runtime.compute_capability == (7, 5)
    assert colab.choose(runtime).overrides == ("model.attention=xla",)


def test_small_gpu_gets_the_demo_and_a_real_model_there_is_refused(tmp_path):
    runtime = colab.detect({}, run=smi("Tesla K80, 11441, 3.7\n"), dev=tmp_path)
    assert colab.choose(runtime).config == colab.DEMO_CONFIG
    with pytest.raises(ValueError, match="configs/demo.yaml, a float32 full fine-tune"):
        colab.choose(runtime, "Qwen/Qwen3-1.7B-Base")


def test_tpu_v5e_1_installs_tpu_jax_and_picks_lora(tmp_path):
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "0").touch()
    runtime = colab.detect({"TPU_ACCELERATOR_TYPE": "v5litepod-1"}, run=NO_GPU, dev=tmp_path)
    assert runtime == colab.Runtime("tpu", "v5litepod-1", 16, None, 1)
    assert colab.install_args(runtime, ".") == ["install", "--progress-bar", "off", "-e", ".[tpu]"]
    choice = colab.choose(runtime)
    assert choice.config == colab.LORA_CONFIG and choice.overrides == ()  # splash attention, as auto picks
    assert colab.backend_problem(runtime, "tpu") is None


def test_tpu_found_by_its_chips_gets_its_size_from_jax(tmp_path):
    (tmp_path / "accel0").touch()
    runtime = colab.detect({}, run=NO_GPU, dev=tmp_path)
    assert runtime.kind == "tpu" and runtime.memory_gib == 0
    assert colab.choose(runtime).config == colab.DEMO_CONFIG  # size unknown: nothing is promised
    chip = types.SimpleNamespace(device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": 16 * 2**30})
    runtime = colab.with_device_memory(runtime, [chip])
    assert runtime.name == "TPU v5 lite" and runtime.memory_gib == 16
    assert colab.choose(runtime).config == colab.LORA_CONFIG


def test_cpu_runtime_and_the_quiet_tpu_variables(tmp_path):
    """No GPU, no chips: CPU, even with the TPU variables `import g2rl_jax` sets on a machine with libtpu."""
    quiet = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "G2RL_JAX_QUIET_TPU": "TPU_ACCELERATOR_TYPE,TPU_WORKER_HOSTNAMES"}
    runtime = colab.detect(quiet, run=NO_GPU, dev=tmp_path)
    assert runtime == colab.Runtime("cpu")
    assert colab.install_args(runtime) == ["install", "--progress-bar", "off", "-e", "g2rl_jax"]
    assert colab.choose(runtime).config == colab.DEMO_CONFIG and colab.backend_problem(runtime, "cpu") is None
    with pytest.raises(ValueError, match="pick a T4, L4, A100 or TPU v5e-1 runtime"):
        colab.choose(runtime, "models/Qwen3-1.7B-Base")
    t4 = smi("Tesla T4, 15360, 7.5\n")
    assert colab.detect({"G2RL_COLAB_RUNTIME": "cpu"}, run=t4, dev=tmp_path).kind == "cpu" and not t4.calls
    assert colab.choose(colab.detect({}, run=smi("Tesla T4, 15360, 7.5"), dev=tmp_path),
                        "demo:runs/m").config == colab.DEMO_CONFIG  # the demo on a GPU, when asked for


def test_restart_is_needed_once_jax_was_imported():
    assert colab.restart_needed({"jax": object()}) and not colab.restart_needed({})


def test_choices_load_and_the_lora_peak_is_the_planners():
    """Each choice's config and overrides load (every key real), and the constants the choice compares against
    are the planner's: LORA_PEAK_GIB its per-chip peak of the LoRA config, USABLE_FRACTION its share."""
    from g2rl_jax import plan
    from g2rl_jax.config import load_config
    from g2rl_jax.model.config import PRESETS

    for runtime in (colab.Runtime("cpu"), colab.Runtime("gpu", "Tesla T4", 15.0, (7, 5)),
                    colab.Runtime("tpu", "v5litepod-1", 16)):
        choice = colab.choose(runtime)
        cfg = load_config(choice.config, [f"model.path={choice.model_path}", *choice.overrides])
        assert choice.command("runs/x").startswith(f"python -m g2rl_jax.train --config {choice.config} ")
    assert choice.config == colab.LORA_CONFIG  # the last one, on the v5e chip
    assert round(plan.plan(cfg, PRESETS["qwen3-1.7b"], 1).peak / 2**30, 2) == colab.LORA_PEAK_GIB
    assert colab.USABLE_FRACTION == plan.USABLE_FRACTION


@pytest.mark.parametrize("path", ["README.md", "docs/lora.md", "configs/qwen3_1p7b_g2rl_lora.yaml",
                                  "launch/colab.ipynb"])
def test_one_account_of_the_t4(path):
    """Everywhere the T4 is named, it comes with the attention it needs (model.attention=xla)."""
    text = (ROOT / path).read_text(encoding="utf-8")
    assert "T4" in text and "model.attention=xla" in text, path


def test_auto_attention_on_the_colab_gpus_compile_devices():
    """A T4 (sm_75) has no cuDNN fused attention: `auto` resolves to xla on its devices, cudnn on an L4's (sm_89)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from g2rl_jax.aot import parse_target
    from g2rl_jax.model.attention import mesh_kernel

    kernels = {name: mesh_kernel("auto", jnp.bfloat16, Mesh(parse_target(name).devices(), ("data",)))
               for name in ("t4", "l4")}
    assert kernels == {"t4": "xla", "l4": "cudnn"}


def test_colab_gpus_are_compile_targets():
    """`plan --target t4 / l4` (the fits docs/lora.md quotes): one card each, the memory CUDA reports for it."""
    from g2rl_jax.aot import parse_target

    t4, l4 = parse_target("t4"), parse_target("l4")
    assert (t4.platform, t4.chips, t4.hbm_bytes) == ("gpu", 1, 15_843_721_216)
    assert (l4.platform, l4.chips, round(l4.hbm_bytes / 2**30, 1)) == ("gpu", 1, 22.0)
    assert colab.LORA_PEAK_GIB <= colab.USABLE_FRACTION * t4.hbm_bytes / 2**30  # the choice's rule, on the target
