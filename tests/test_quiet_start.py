"""Quiet start: without PyTorch (a plain `pip install -e .`), starting the project prints no transformers advisory;
with the CUDA plugin and no NVIDIA driver (the test extra on a CPU machine), no plugin log.

torch stays installed for the other tests; each subprocess hides it by `sys.modules["torch"] = None`, which makes
`importlib.util.find_spec("torch")` (what transformers and g2rl_jax check) return None."""
import os
import subprocess
import sys

ADVISORY = "PyTorch was not found"
HIDE_TORCH = "import sys; sys.modules['torch'] = None; "


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    done = subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_transformers_alone_prints_the_advisory_without_torch():
    """The check below can fail: with torch hidden, a bare transformers import does print the advisory."""
    assert ADVISORY in _run("import transformers")


def test_train_help_is_quiet_without_torch():
    out = _run("import runpy; sys.argv = ['g2rl_jax.train', '--help']\n"
               "try:\n    runpy.run_module('g2rl_jax.train', run_name='__main__')\n"
               "except SystemExit as stop:\n    assert stop.code == 0, stop.code\n"
               "import g2rl_jax.demo.tokenizer\n"  # the demo's first run loads transformers here (help no longer does)
               "print('transformers imported:', 'transformers' in sys.modules)")
    assert "usage: python -m g2rl_jax.train" in out
    assert "transformers imported: True" in out  # the import that would print the advisory did happen
    assert ADVISORY not in out


CUDA_LOG = "cuda drivers"


def test_jax_alone_logs_the_cuda_plugin_without_a_driver():
    """The check below can fail: with the CUDA plugin installed (test extra) and no NVIDIA driver, a bare jax start
    logs the plugin's "Could not find cuda drivers" lines."""
    if os.path.exists("/proc/driver/nvidia/version"):
        return  # a machine with a driver: the plugin finds it and logs nothing (checked on the CPU CI machine)
    assert CUDA_LOG in _run("import jax; jax.devices()")


def test_a_command_starts_without_the_cuda_plugin_log():
    out = _run("import runpy; sys.argv = ['g2rl_jax.train', '--help']\n"
               "try:\n    runpy.run_module('g2rl_jax.train', run_name='__main__')\n"
               "except SystemExit as stop:\n    assert stop.code == 0, stop.code\n"
               "import jax; jax.devices()")
    assert CUDA_LOG not in out and "InitializeLog" not in out, out[-3000:]
