"""launch/: tpu.sh, gpu.sh and the SLURM example, driven with fake `gcloud` / `python` / `srun` executables placed
first on PATH. Each fake appends its argv (shell-quoted, one line per call) and the environment variables a test
asks about to a record file, so the tests assert the exact commands the scripts run."""
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
TPU, GPU, SLURM = ROOT / "launch" / "tpu.sh", ROOT / "launch" / "gpu.sh", ROOT / "launch" / "slurm_example.sbatch"
WORKER_SOURCE = ("${TPU_WORKER_ID:-$(curl -s -H 'Metadata-Flavor: Google' "
                 "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)}")
BUCKET_SOURCE = ("${G2RL_JAX_BUCKET-$(curl -s -f -H 'Metadata-Flavor: Google' "
                 "http://metadata.google.internal/computeMetadata/v1/instance/attributes/g2rl-jax-bucket || true)}")

FAKE = """#!{python} -S
import json, os, shlex, sys
with open({record!r}, "a") as fh:
    fh.write(json.dumps({{"argv": shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                          "env": {{k: os.environ.get(k) for k in {keys!r}}},
                          "cwd": os.getcwd()}}) + "\\n")
print("fake", os.path.basename(sys.argv[0]), "ran")
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""
ENV_KEYS = ["JAX_PLATFORMS", "PYTHONUNBUFFERED", "TPU_ACCELERATOR_TYPE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "CUDA_VISIBLE_DEVICES", "XLA_FLAGS", "HF_HOME", "SLURM_PROCID"]


@pytest.fixture
def fakes(tmp_path):
    """A bin/ dir with fake gcloud, python, python3; returns (env, read_calls)."""
    bindir, record = tmp_path / "bin", tmp_path / "calls.jsonl"
    bindir.mkdir()
    for name in ("gcloud", "python", "python3"):
        exe = bindir / name
        exe.write_text(FAKE.format(python=sys.executable, record=str(record), keys=ENV_KEYS))
        exe.chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "HOME": str(tmp_path)}

    def calls() -> list[dict]:
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    return env, calls


def run(script, args, env, timeout=60, **kw):
    # tpu.sh execs python3, which is faked on PATH: run tpu.py with the real interpreter instead.
    cmd = [sys.executable, "-S", str(ROOT / "launch" / "tpu.py"), *args] if script == TPU else [str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def test_tpu_sh_wrapper_runs_tpu_py():
    out = subprocess.run([str(TPU), "delete", "--name", "n", "--zone", "z", "--dry-run"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["gcloud compute tpus queued-resources delete n --zone z --force --quiet"]


@pytest.mark.parametrize("spot,project", [(True, None), (False, "my-proj")])
def test_create_queued_resource(fakes, spot, project):
    env, calls = fakes
    args = ["create", "--name", "g2rl", "--zone", "us-east5-a", "--accelerator-type", "v5p-32", "--force", "--no-wait"]
    args += (["--spot", "--bucket", "gs://b/d"] if spot else []) + (["--project", project] if project else [])
    out = run(TPU, args, env)
    assert out.returncode == 0, out.stderr
    expected = ("gcloud compute tpus queued-resources create g2rl --node-id g2rl --zone us-east5-a"
                + (f" --project {project}" if project else "")
                + " --accelerator-type v5p-32 --runtime-version v2-alpha-tpuv5"
                + (" --metadata g2rl-jax-bucket=gs://b/d --spot" if spot else ""))
    assert [c["argv"] for c in calls()] == [expected]


def test_create_runtime_version_default_and_override(fakes):
    env, calls = fakes
    assert run(TPU, ["create", "--name", "a", "--zone", "z", "--accelerator-type", "v6e-8", "--force", "--no-wait"],
               env).returncode == 0
    assert run(TPU, ["create", "--name", "b", "--zone", "z", "--accelerator-type", "v5litepod-16", "--force",
                     "--no-wait", "--runtime-version", "custom-rt"], env).returncode == 0
    argv = [shlex.split(c["argv"]) for c in calls()]
    assert argv[0][argv[0].index("--runtime-version") + 1] == "v2-alpha-tpuv6e"
    assert argv[1][argv[1].index("--runtime-version") + 1] == "custom-rt"
    out = run(TPU, ["create", "--name", "c", "--zone", "z", "--accelerator-type", "v9x-8", "--force"], env)
    assert out.returncode != 0 and "--runtime-version" in out.stderr and "v9x-8" in out.stderr
    assert len(calls()) == 2


def test_dry_run_prints_exact_commands_and_runs_nothing(fakes):
    env, calls = fakes
    out = run(TPU, ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5p-8", "--dry-run", "--force"],
              env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "gcloud compute tpus queued-resources create g --node-id g --zone z --accelerator-type v5p-8 "
        "--runtime-version v2-alpha-tpuv5",
        "gcloud compute tpus queued-resources describe g --zone z '--format=value(state.state)'   # until ACTIVE"]
    out = run(TPU, ["train", "--name", "g", "--zone", "z", "--config", "c.yaml", "--dry-run"], env)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1
    assert shlex.split(out.stdout)[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g", "--zone", "z"]
    assert calls() == []


def test_v5e_is_understood_as_v5litepod(fakes):
    env, calls = fakes
    out = run(TPU, ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5e-8", "--force", "--no-wait"], env)
    assert out.returncode == 0, out.stderr
    assert calls()[0]["argv"] == ("gcloud compute tpus queued-resources create g --node-id g --zone z "
                                  "--accelerator-type v5litepod-8 --runtime-version v2-alpha-tpuv5-lite")


BASE = ["--name", "g", "--zone", "z"]
DRY = {  # every subcommand, as a user would call it
    "create": ["--accelerator-type", "v5p-8", "--config", "c.yaml", "--bucket", "gs://b/d", "--spot"],
    "setup": ["--repo", "r"], "train": ["--config", "c.yaml"], "python": ["--", "-m", "g2rl_jax.eval", "--help"],
    "status": ["--bucket", "gs://b/d"], "logs": ["--follow"], "ssh": [], "delete": [],
    "watch": ["--accelerator-type", "v5p-8", "--spot", "--bucket", "gs://b/d", "--repo", "r", "--config", "c.yaml",
              "--delete-when-done"],
}


@pytest.mark.parametrize("subcommand", sorted(DRY))
def test_dry_run_runs_nothing_anywhere(fakes, subcommand):
    """--dry-run prints what it would run and runs nothing: no gcloud, no python (the fit check's either)."""
    env, calls = fakes
    out = run(TPU, [subcommand, *BASE, "--dry-run", *DRY[subcommand]], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and calls() == []


def _venv_python(checkout: Path, env: dict) -> None:
    """<checkout>/.venv/bin/python: the fake python (what setup's environment would hold)."""
    venv = checkout / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(Path(env["PATH"].split(":")[0]) / "python")


def _ssh_command(argv: str) -> tuple[list[str], str]:
    """Split a recorded `gcloud ... ssh` call into its gcloud flags and the --command text."""
    words = shlex.split(argv)
    command = [w for w in words if w.startswith("--command=")]
    assert len(command) == 1, argv
    return [w for w in words if not w.startswith("--command=")], command[0][len("--command="):]


def test_setup_clones_and_makes_a_python_3_11_env_on_all_workers(fakes):
    env, calls = fakes
    out = run(TPU, ["setup", "--name", "g", "--zone", "z", "--repo", "https://example.com/g2rl_jax.git",
                    "--branch", "dev"], env)
    assert out.returncode == 0, out.stderr
    (call,) = calls()
    flags, command = _ssh_command(call["argv"])
    assert flags == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g", "--zone", "z", "--worker=all"]
    assert "git clone --branch dev https://example.com/g2rl_jax.git ~/g2rl_jax" in command
    assert "git -C ~/g2rl_jax pull --ff-only origin dev" in command
    assert "uv venv --allow-existing --python-preference only-managed --python 3.11 .venv;" in command
    assert "uv pip install --python .venv/bin/python -e '.[tpu,gcs]'" in command
    assert "python3 -m pip install -e" not in command  # the image's 3.10 gets uv at most, never the project


def test_setup_script_really_clones_and_installs(fakes, tmp_path):
    """Run the remote setup line with bash against a local git repository (uv is the fake of test_tpu_watch.py)."""
    from test_tpu_watch import fake_uv

    env, calls = fakes
    fake_uv(Path(env["PATH"].split(":")[0]), sys.executable)
    src = tmp_path / "src"
    src.mkdir()
    git_env = {**env, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(cmd, cwd=src, env=git_env, check=True)
    dest = tmp_path / "checkout"
    out = run(TPU, ["setup", "--name", "g", "--zone", "z", "--repo", str(src), "--dir", str(dest), "--dry-run"], env)
    _, command = _ssh_command(out.stdout.strip())
    for _ in range(2):  # first a clone, then an update of the existing checkout
        done = subprocess.run(["bash", "-c", command], env=git_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert (dest / ".git").is_dir()
    installs = [c for c in calls() if c["argv"].startswith("uv pip")]
    assert [c["argv"] for c in installs] == ["uv pip install --python .venv/bin/python -e '.[tpu,gcs]'"] * 2
    assert all(c["cwd"] == str(dest) for c in installs)


def test_train_command_on_all_workers(fakes):
    env, calls = fakes
    out = run(TPU, ["train", "--name", "g", "--zone", "z", "--project", "p", "--config", "configs/qwen3_4b_g2rl.yaml",
                    "--env", "HF_HOME=/mnt/hf", "run.total_steps=3", "mesh.tensor=2"], env)
    assert out.returncode == 0, out.stderr
    (call,) = calls()
    flags, command = _ssh_command(call["argv"])
    assert flags == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "g", "--zone", "z", "--project", "p",
                     "--worker=all"]
    assert command == (
        f"set -e; cd ~/g2rl_jax; mkdir -p logs; WORKER={WORKER_SOURCE}; BUCKET={BUCKET_SOURCE}; "
        "CACHE=${BUCKET:+$BUCKET/jax_cache}; rm -f logs/worker-$WORKER.exit logs/worker-$WORKER.pid; "
        "( trap '' HUP; trap true TERM; set +e; env -u JAX_PLATFORMS PYTHONUNBUFFERED=1 HF_HOME=/mnt/hf "
        ".venv/bin/python -m g2rl_jax.train --config configs/qwen3_4b_g2rl.yaml run.total_steps=3 mesh.tensor=2 "
        '${BUCKET:+"run.output_dir=$BUCKET/runs/g"} '
        '"run.compilation_cache_dir=${CACHE:-~/.cache/g2rl_jax/jax}"; echo $? > logs/worker-$WORKER.exit.tmp; '
        "mv logs/worker-$WORKER.exit.tmp logs/worker-$WORKER.exit ) > logs/worker-$WORKER.log 2>&1 "
        "< /dev/null & echo $! > logs/worker-$WORKER.pid; "
        "echo \"worker $WORKER: started, log $PWD/logs/worker-$WORKER.log\"")


def test_train_script_runs_per_worker_with_its_own_log(fakes, tmp_path):
    """Execute the remote train line with bash as workers 0 and 3 would: one log each, JAX_PLATFORMS unset,
    TPU_* untouched, PYTHONUNBUFFERED=1 (python3 is the fake and writes to the log)."""
    env, calls = fakes
    workdir = tmp_path / "work"
    _venv_python(workdir, env)
    out = run(TPU, ["train", "--name", "g", "--zone", "z", "--config", "c.yaml", "--dir", str(workdir),
                    "--compile-cache", "/cache", "--dry-run", "run.seed=1"], env)
    _, command = _ssh_command(out.stdout.strip())
    for worker in ("0", "3"):
        worker_env = {**env, "TPU_WORKER_ID": worker, "JAX_PLATFORMS": "cpu", "TPU_ACCELERATOR_TYPE": "v5p-32",
                      "G2RL_JAX_BUCKET": ""}  # set, so the metadata server is not asked: no bucket
        done = subprocess.run(["bash", "-c", command], env=worker_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"worker {worker}: started, log {workdir}/logs/worker-{worker}.log" in done.stdout
    deadline = time.time() + 30
    while len(calls()) < 2 and time.time() < deadline:
        time.sleep(0.1)
    runs = calls()
    assert len(runs) == 2
    for c in runs:
        assert c["argv"] == "python -m g2rl_jax.train --config c.yaml run.seed=1 run.compilation_cache_dir=/cache"
        assert c["env"]["JAX_PLATFORMS"] is None and c["env"]["PYTHONUNBUFFERED"] == "1"
        assert c["env"]["TPU_ACCELERATOR_TYPE"] == "v5p-32" and c["cwd"] == str(workdir)
    for worker in ("0", "3"):
        log = workdir / "logs" / f"worker-{worker}.log"
        status = workdir / "logs" / f"worker-{worker}.exit"
        while not (status.exists() and status.read_text()) and time.time() < deadline:
            time.sleep(0.1)
        assert log.read_text() == "fake python ran\n" and status.read_text() == "0\n"
        assert (workdir / "logs" / f"worker-{worker}.pid").read_text().strip().isdigit()


def test_create_bucket_points_the_run_and_the_compile_cache_there(fakes, tmp_path):
    """create --bucket keeps it in the VM's metadata; the train line each worker runs reads it back (here from
    G2RL_JAX_BUCKET, as the metadata server would give it) and writes run.output_dir and the compile cache there;
    without one, the cache stays on the worker's disk; train --bucket names one directly."""
    env, calls = fakes
    _venv_python(tmp_path, env)
    out = run(TPU, ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5p-8", "--force", "--bucket",
                    "gs://my-bucket/g2rl/", "--no-wait"], env)
    assert out.returncode == 0, out.stderr
    assert calls()[-1]["argv"].endswith("--runtime-version v2-alpha-tpuv5 --metadata g2rl-jax-bucket=gs://my-bucket/g2rl")
    out = run(TPU, ["train", "--name", "g", "--zone", "z", "--config", "c.yaml", "--dir", str(tmp_path), "--dry-run",
                    "run.seed=1"], env)
    _, command = _ssh_command(out.stdout.strip())
    for bucket, want in (("gs://my-bucket/g2rl", " run.output_dir=gs://my-bucket/g2rl/runs/g "
                                                 "run.compilation_cache_dir=gs://my-bucket/g2rl/jax_cache"),
                         ("", " 'run.compilation_cache_dir=~/.cache/g2rl_jax/jax'")):  # ~: expanded by python
        done = subprocess.run(["bash", "-c", command], env={**env, "TPU_WORKER_ID": "0", "G2RL_JAX_BUCKET": bucket},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        deadline = time.time() + 30
        while not (tmp_path / "logs" / "worker-0.exit").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert calls()[-1]["argv"] == "python -m g2rl_jax.train --config c.yaml run.seed=1" + want
        (tmp_path / "logs" / "worker-0.log").write_text("")
    out = run(TPU, ["train", "--name", "g", "--zone", "z", "--config", "c.yaml", "--bucket", "gs://b/x", "--dry-run"],
              env)
    assert "BUCKET=gs://b/x;" in out.stdout and "metadata" not in out.stdout.split("BUCKET=")[1].split(";")[0]
    out = run(TPU, ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5p-8", "--force", "--bucket",
                    "/local/dir"], env)
    assert out.returncode == 2 and "--bucket '/local/dir': expected gs://BUCKET/DIR" in out.stderr


def test_logs_tail_follow_and_collect(fakes, tmp_path):
    env, calls = fakes
    base = ["--name", "g", "--zone", "z"]
    assert run(TPU, ["logs", *base], env).returncode == 0
    assert run(TPU, ["logs", *base, "--worker", "2", "--lines", "10", "--follow"], env).returncode == 0
    dest = tmp_path / "collected"
    assert run(TPU, ["logs", *base, "--collect", str(dest)], env).returncode == 0
    argv = [c["argv"] for c in calls()]
    assert argv == [
        "gcloud compute tpus tpu-vm ssh g --zone z --worker=all '--command=tail -n 50 ~/g2rl_jax/logs/worker-*.log'",
        "gcloud compute tpus tpu-vm ssh g --zone z --worker=2 '--command=tail -n 10 -f ~/g2rl_jax/logs/worker-*.log'",
        f"gcloud compute tpus tpu-vm scp 'g:~/g2rl_jax/logs/worker-*.log' {dest} --zone z --worker=all",
    ]
    assert dest.is_dir()  # made by the (real) mkdir -p before the scp
    out = run(TPU, ["logs", *base, "--follow", "--collect", str(dest)], env)
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_ssh_and_delete(fakes):
    env, calls = fakes
    base = ["--name", "g", "--zone", "z"]
    assert run(TPU, ["ssh", *base], env).returncode == 0
    assert run(TPU, ["ssh", *base, "--worker", "all", "--command", "pkill -f g2rl_jax.train"], env).returncode == 0
    assert run(TPU, ["delete", *base], env).returncode == 0
    assert [c["argv"] for c in calls()] == [
        "gcloud compute tpus tpu-vm ssh g --zone z --worker=0",
        "gcloud compute tpus tpu-vm ssh g --zone z --worker=all '--command=pkill -f g2rl_jax.train'",
        "gcloud compute tpus queued-resources delete g --zone z --force --quiet",
    ]


@pytest.mark.parametrize("args,message", [
    (["frobnicate", "--name", "g", "--zone", "z"], "invalid choice: 'frobnicate'"),
    ([], "required: {create,setup,train,python,status,watch,logs,ssh,delete}"),
    (["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5p-8", "--force", "--spot"],
     "create --spot needs --bucket gs://BUCKET/DIR: a preempted VM's disk"),
    (["setup", "--name", "g", "--zone", "z", "--repo", "r", "--python", "3.10"], "expected 3.11 or newer"),
    (["python", "--name", "g", "--zone", "z"], "give python's arguments after --"),
    (["create", "--zone", "z", "--accelerator-type", "v5p-8"], "the following arguments are required: --name"),
    (["delete", "--name", "g"], "the following arguments are required: --zone"),
    (["train", "--name", "g", "--zone", "z"], "required: --config"),
    (["train", "--name", "g", "--zone", "z", "--config", "c", "steps10"], "'steps10' is not a config override"),
    (["train", "--name", "g", "--zone", "z", "--config", "c", "--env", "NOVALUE"], "expected KEY=VALUE"),
    (["train", "--name", "g", "--zone", "z", "--config", "c", "--dir", "my dir"], "without spaces"),
    (["setup", "--name", "g", "--zone", "z"], "required: --repo"),
    (["logs", "--name", "g", "--zone", "z", "--lines", "0"], "--lines must be >= 1"),
])
def test_bad_input_is_a_usage_error(fakes, args, message):
    env, calls = fakes
    out = run(TPU, args, env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "usage:" in out.stderr
    assert calls() == []


def test_gcloud_failure_stops_and_propagates(fakes):
    env, calls = fakes
    out = run(TPU, ["delete", "--name", "g", "--zone", "z"], {**env, "FAKE_EXIT": "7"})
    assert out.returncode == 7 and "gcloud exited with status 7" in out.stderr


# ----------------------------------------------------------------------------------------------------- gpu.sh
def test_gpu_sh_runs_one_process_over_the_chosen_gpus(fakes, tmp_path):
    env, calls = fakes
    log = tmp_path / "out" / "train.log"
    out = run(GPU, ["--gpus", "0,1,2,3", "--mem-fraction", "0.85", "--log", str(log), "--config", "cfg.yaml",
                    "mesh.tensor=2", "run.total_steps=5"], {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--foo"})
    assert out.returncode == 0, out.stderr
    check, train = calls()  # the GPU check first, with the environment the run gets
    assert check["argv"].startswith("python -c ") and "jax.devices(\"gpu\")" in check["argv"]
    assert train["argv"] == "python -m g2rl_jax.train --config cfg.yaml mesh.tensor=2 run.total_steps=5"
    for call in (check, train):
        assert call["env"] == {**dict.fromkeys(ENV_KEYS), "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
                               "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.85",
                               "XLA_FLAGS": "--foo --xla_gpu_enable_latency_hiding_scheduler=true"}
    assert log.read_text() == "fake python ran\n"


def test_gpu_sh_dry_run_and_exit_status(fakes, tmp_path):
    env, calls = fakes
    out = run(GPU, ["--dry-run", "--config", "c.yaml"], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("env -u JAX_PLATFORMS XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 PYTHONUNBUFFERED=1 "
                                  "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true "
                                  "python -m g2rl_jax.train --config c.yaml")
    assert calls() == []
    trainer = tmp_path / "exits3"  # passes the GPU check, then the run exits 3
    trainer.write_text("#!/bin/sh\n[ \"$1\" = -c ] && echo 'gpu.sh: 1 GPU(s), fake' && exit 0\nexit 3\n")
    trainer.chmod(0o755)
    assert run(GPU, ["--config", "c.yaml"], {**env, "PYTHON": str(trainer)}).returncode == 3


def test_gpu_sh_refuses_a_jax_that_cannot_use_a_gpu(fakes, tmp_path):
    """--gpus with a CPU-only jax (no CUDA plugin), and with this environment's jax (its CUDA plugin, no GPU here):
    one line each, exit 2, and no training starts (the old gpu.sh trained on the CPU without a word)."""
    env, calls = fakes
    cpu_only = tmp_path / "python-cpu-jax"  # this interpreter, with jax's CUDA plugins hidden
    cpu_only.write_text(f"#!{sys.executable}\nimport sys\nsys.modules.update(jax_cuda12_plugin=None, "
                        "jax_cuda13_plugin=None)\nassert sys.argv[1] == '-c'\nsys.argv = sys.argv[2:]\n"
                        "exec(compile(sys.argv[0], '-c', 'exec'), {'__name__': '__main__'})\n")
    cpu_only.chmod(0o755)
    for python, line in ((cpu_only, f"gpu.sh: --gpus 0: the jax of {sys.executable} has no CUDA support (a CPU-only "
                                    "jax): install the GPU build with pip install -e \".[cuda]\", then run again"),
                         (sys.executable, f"gpu.sh: --gpus 0: the jax of {sys.executable} (jax_cuda12_plugin) cannot "
                                          "use a GPU here: ")):
        out = run(GPU, ["--gpus", "0", "--config", "c.yaml"], {**env, "PYTHON": str(python)}, timeout=120)
        assert out.returncode == 2 and out.stderr.startswith(line), out.stderr
        assert len(out.stderr.splitlines()) == 1 and out.stdout == ""
    assert calls() == []


@pytest.mark.parametrize("args,message", [
    (["run.total_steps=1"], "--config FILE is required"),
    (["--config", "c", "--gpus", "a,b"], "expected indices like 0,1,2,3"),
    (["--config", "c", "--mem-fraction", "1.5"], "expected a number in (0, 1]"),
    (["--config", "c", "--bogus"], "unknown option '--bogus'"),
    (["--config", "c", "notanoverride"], "'notanoverride' is not a config override"),
    (["--config"], "--config needs a YAML file"),
])
def test_gpu_sh_bad_input(fakes, args, message):
    env, calls = fakes
    out = run(GPU, args, env)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""
    assert calls() == []


# ----------------------------------------------------------------------------------------------------- SLURM
def test_slurm_example_passes_distributed_overrides_per_task(fakes, tmp_path):
    """Fake scontrol/srun: srun runs its command once per task with SLURM_PROCID set, like SLURM does."""
    env, calls = fakes
    bindir = Path(env["PATH"].split(":")[0])
    (bindir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-node-7\\ngpu-node-8\\n'\n")
    (bindir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for i in 0 1; do SLURM_PROCID=$i SLURM_NTASKS=2 \"$@\" || exit $?; done\n")
    for name in ("scontrol", "srun"):
        (bindir / name).chmod(0o755)
    slurm_env = {**env, "SLURM_JOB_NODELIST": "gpu-node-[7-8]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
                 "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(["bash", str(SLURM), "run.total_steps=2"], env=slurm_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    runs = calls()
    assert [c["argv"] for c in runs] == [
        f"python -m g2rl_jax.train --config configs/qwen3_4b_g2rl.yaml distributed.coordinator_address="
        f"gpu-node-7:12355 distributed.num_processes=2 distributed.process_id={i} run.total_steps=2" for i in (0, 1)]
    assert all(c["env"]["JAX_PLATFORMS"] is None and c["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
               for c in runs)
    assert (tmp_path / "logs" / "slurm-42-host1.log").read_text() == "fake python ran\n"


def test_slurm_log_is_written_where_sbatch_runs():
    """sbatch opens --output before the job's script runs, so its directory must exist at submission: the job's
    log goes to the directory sbatch runs in (no subdirectory), the per-host logs to logs/, which the job makes."""
    outputs = [line.split("=", 1)[1] for line in SLURM.read_text().splitlines() if line.startswith("#SBATCH --output")]
    assert outputs == ["%x-%j.out"] and "/" not in outputs[0]


# ------------------------------------------------------------------------------------- create's fit check
def _tiny_config(tmp_path, model_config=None, **extra) -> Path:
    """A config with a small step over a model directory (config.json only: the check builds nothing), the tiny
    preset by default."""
    from g2rl_jax.model.config import PRESETS

    model = tmp_path / f"model{len(list(tmp_path.glob('model*')))}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps((model_config or PRESETS["tiny"]).to_hf_dict()))
    keys = {"model.path": str(model), "run.output_dir": str(tmp_path / "run"), "data.prompts_per_step": 4,
            "rollout.num_samples": 4, "rollout.max_new_tokens": 16, "data.max_prompt_tokens": 16,
            "algorithm.mini_batch_size": 16, "algorithm.micro_batch_size": 4, **extra}
    groups: dict[str, dict] = {}
    for key, value in keys.items():
        group, name = key.split(".")
        groups.setdefault(group, {})[name] = value
    path = tmp_path / "tiny.yaml"
    path.write_text(f"base: {ROOT / 'configs' / 'qwen3_1p7b_g2rl.yaml'}\n" + "".join(
        f"{group}:\n" + "".join(f"  {k}: {v}\n" for k, v in values.items()) for group, values in groups.items()))
    return path


def test_create_runs_the_fit_check_first_and_refuses_what_does_not_fit(fakes, tmp_path):
    """The real check (jax + libtpu here) with a small step: a 2-layer model 16,384 wide (12.6B parameters, 47 GiB
    of parameters, AdamW state and reference per chip) does not fit a v5litepod-4's 16 GiB chips, so no VM is
    requested; --force requests it anyway; the tiny model fits."""
    pytest.importorskip("libtpu")
    from g2rl_jax.model.config import Qwen3Config

    env, calls = fakes
    base = ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5litepod-4"]
    wide = Qwen3Config(vocab_size=151936, hidden_size=16384, intermediate_size=65536, num_hidden_layers=2,
                       num_attention_heads=128, num_key_value_heads=8, head_dim=128)
    big = _tiny_config(tmp_path, wide)
    out = run(TPU, [*base, "--config", str(big)], env, timeout=600)
    assert out.returncode == 2, (out.stdout, out.stderr[-3000:])
    assert "VERDICT: DOES NOT FIT on v5litepod-4" in out.stdout and "Change:" in out.stdout
    assert "no VM was created" in out.stderr and "--force" in out.stderr
    assert calls() == []
    assert run(TPU, [*base, "--config", str(big), "--force", "--no-wait"], env).returncode == 0
    assert len(calls()) == 1 and "queued-resources create g" in calls()[0]["argv"]
    small = _tiny_config(tmp_path)
    out = run(TPU, [*base, "--config", str(small), "--no-wait", "data.shuffle_seed=1"], env, timeout=600)
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:])
    assert "VERDICT: FITS on v5litepod-4" in out.stdout
    assert len(calls()) == 2


def test_create_needs_a_config_or_force_and_dry_run_prints_the_check(fakes, tmp_path):
    env, calls = fakes
    base = ["create", "--name", "g", "--zone", "z", "--accelerator-type", "v5p-8"]
    out = run(TPU, base, env)
    assert out.returncode == 2 and "--config FILE is required" in out.stderr and "--force" in out.stderr
    out = run(TPU, [*base, "--config", "c.yaml", "--dry-run", "run.seed=2"], env)
    assert out.returncode == 0, out.stderr
    which, check, create, wait = out.stdout.splitlines()
    tried = ", ".join(dict.fromkeys([sys.executable, str(ROOT / ".venv" / "bin" / "python")]))  # one when they agree
    assert which.startswith(f"# the fit check, run by the first of {tried} that has ") and "libtpu" in which
    assert wait.startswith("gcloud compute tpus queued-resources describe g")
    assert shlex.split(check)[1:] == ["-m", "g2rl_jax.plan", "--config", "c.yaml", "--target", "v5p-8", "--compile",
                                      "--programs", "largest", "run.seed=2"]
    assert create.startswith("gcloud compute tpus queued-resources create g")
    assert calls() == []


FAKE_PLAN = """import os, sys, time
print("plan: the report", flush=True)
print("compiling 3 programs", file=sys.stderr, flush=True)
gate = os.environ.get("FAKE_PLAN_GATE")
while gate and not os.path.exists(gate):  # held until the test has seen the first line
    time.sleep(0.05)
ending = os.environ["FAKE_PLAN"]
if ending == "traceback":
    raise RuntimeError("a bug in the check")
print({"fits": "VERDICT: FITS on v5p-8: ...", "no": "VERDICT: DOES NOT FIT on v5p-8: ...",
       "unknown": "VERDICT: cannot tell, 1 program(s) did not compile; first: ..."}[ending], flush=True)
sys.exit(0 if ending == "fits" else 1)
"""


def _checkout(tmp_path) -> Path:
    """A checkout of launch/ and the exit codes' table, whose g2rl_jax.plan is FAKE_PLAN."""
    root = tmp_path / "checkout"
    (root / "g2rl_jax" / "control").mkdir(parents=True)
    for name in ("tpu.py", "tpu_fit.py", "tpu_states.py", "tpu_watch.py"):
        (root / "launch").mkdir(exist_ok=True)
        (root / "launch" / name).write_text((ROOT / "launch" / name).read_text())
    (root / "g2rl_jax" / "control" / "exits.py").write_text((ROOT / "g2rl_jax" / "control" / "exits.py").read_text())
    (root / "g2rl_jax" / "__init__.py").write_text("")
    (root / "g2rl_jax" / "plan.py").write_text(FAKE_PLAN)
    return root


def test_create_says_in_one_line_where_the_fit_cannot_be_checked(fakes, tmp_path):
    """A python3 without the project (the launcher needs only python3 and gcloud), no .venv in the checkout: one
    line saying why and how to check, exit 2, no VM; never "does not fit" (the old check printed a traceback and
    then that)."""
    env, calls = fakes
    root = _checkout(tmp_path)
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = subprocess.run([str(bare / "bin" / "python"), str(root / "launch" / "tpu.py"), "create", *BASE,
                          "--accelerator-type", "v5p-8", "--config", "c.yaml"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr == (f"tpu.py create: cannot check here that c.yaml fits v5p-8: {bare}/bin/python has no jax, "
                          f"flax, libtpu; {root}/.venv/bin/python does not exist (libtpu installs on Linux x86-64 "
                          f"only). Install the project with the TPU compiler (pip install -e '.[tpu]' in {root}) and "
                          "run create again, or pass --force to create the VM without the check\n")
    assert calls() == []


@pytest.mark.parametrize("ending,code,message", [
    ("fits", 0, None),
    ("no", 2, "tpu.py create: c.yaml does not fit v5p-8 (the verdict above); no VM was created"),
    ("unknown", 2, "tpu.py create: the fit check ended with status 1 before a verdict that c.yaml fits v5p-8 "
                   "(VERDICT: cannot tell, 1 program(s) did not compile; first: ...); no VM was created"),
    ("traceback", 2, "tpu.py create: the fit check ended with status 1 before a verdict that c.yaml fits v5p-8 (its "
                     "output above says why); no VM was created"),
])
def test_create_shows_the_checks_progress_and_refuses_only_on_its_verdict(fakes, tmp_path, ending, code, message):
    """The check's output shows as it comes (the test holds the check until tpu.py has printed its first line);
    only a DOES NOT FIT verdict says so; a check that ended otherwise says it could not tell."""
    env, calls = fakes
    root, gate = _checkout(tmp_path), tmp_path / "gate"
    proc = subprocess.Popen([sys.executable, str(root / "launch" / "tpu.py"), "create", *BASE, "--accelerator-type",
                             "v5p-8", "--config", "c.yaml", "--no-wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**env, "FAKE_PLAN": ending, "FAKE_PLAN_GATE": str(gate)})
    try:
        assert proc.stdout.readline().startswith(f"checking that c.yaml fits v5p-8: {sys.executable} -m g2rl_jax.plan")
        assert proc.stdout.readline() == "plan: the report\n"  # while the check still runs
        gate.touch()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert ("compiling 3 programs" in stderr) and ("does not fit" in stdout + stderr) == (ending == "no")
    if message:
        assert message in stderr and "--force" in stderr and calls() == []
    else:
        assert [c["argv"].split()[:5] for c in calls()] == [["gcloud", "compute", "tpus", "queued-resources",
                                                             "create"]]
