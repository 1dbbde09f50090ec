"""Every run path goes through g2rl_jax.storage: no module of the package opens, stats, moves or deletes a file
with the standard library's local-only calls (open, pathlib.Path, os.path, shutil, os.replace, ...) except the
storage layer itself and the purely local places allowed below, each with its reason. A new `open(...)` on a run
path fails here and names its file and line."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "g2rl_jax"
OS_FILE_CALLS = {"replace", "rename", "remove", "unlink", "makedirs", "mkdir", "listdir", "scandir", "link", "rmdir",
                 "stat", "walk"}
ALLOWED = {
    "storage.py": "the storage layer itself",
    "storage_append.py": "the storage layer itself: appends within GCS's write rates (split from storage.py)",
    "storage_copies.py": "the storage layer itself: a bucket directory's local copy in the cache (split from "
                         "storage.py)",
    "__init__.py": "probes /dev and /proc for accelerators and silences a stream with os.devnull: no run path",
    "parallel.py": "probes /dev for TPU chips: no run path",
    "rewards/custom.py": "reward.function names Python source for the interpreter to import: a local file",
    "model/hf_io.py": "reads and writes a local Hugging Face directory: model paths are made local first "
                      "(model/sources.py: a bucket's copied to the cache, a hub id's snapshot), export uploads its "
                      "local output (export.py)",
    "model/peft_io.py": "the same for a PEFT adapter directory (model.lora.init_from is made local first)",
    "demo/build.py": "the demo policy's build cache, a local directory by design (demo:DIR)",
    "demo/study.py": "the laptop study's harness: local runs and files by design",
    "demo/explore_eval.py": "the laptop demo's Countdown evaluation of a local run",
    "bench/compile.py": "benchmark scratch: a temporary directory and the relaunched process's log",
    "bench/step.py": "benchmark scratch: a temporary random model directory",
    "bench/verify.py": "the package's source trees for the before/after verifier processes",
    "bench/programs.py": "benchmark scratch: a temporary run directory, compilation cache and random model",
    "bench/once.py": "benchmark scratch: temporary run directories and caches of the before/after checkouts' runs",
    "bench/ahead.py": "benchmark scratch: the variants' temporary run directories",
    "bench/chaos.py": "benchmark scratch: a temporary directory; a client's parent pid from /proc (Linux)",
    "bench/chaos_launch.py": "benchmark scratch: the launched processes' local logs",
    "bench/gcs_proxy.py": "names the process a 429 went to from /proc (Linux): no run path",
    "bench/gpu.py": "benchmark scratch: the GPU batch's local folder (its logs, caches, wheels and record)",
    "bench/rollout.py": "writes its figures to the local file --json names",
    "colab.py": "probes /dev for TPU chips before jax is installed: no run path",
    "model/sources.py": "the commit of a hub id is the name of its snapshot directory in huggingface_hub's local cache",
    "control/holder.py": "reads /proc for this process's identity (boot id, start time): no run path",
    "control/fence.py": "compares a local run path with the fenced directories by its resolved name: opens nothing",
}


def _annotations(tree) -> set[int]:
    """ids of the nodes inside type annotations (`path: Path` names a type, it touches no file)."""
    roots = [a.annotation for a in ast.walk(tree) if isinstance(a, ast.arg) and a.annotation is not None]
    roots += [f.returns for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.returns]
    roots += [a.annotation for a in ast.walk(tree) if isinstance(a, ast.AnnAssign)]
    return {id(n) for root in roots for n in ast.walk(root)}


def _violations(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    # Path(__file__): the package's own files (vendored datasets, package data), never a run path
    own = {id(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call) and
           any(isinstance(a, ast.Name) and a.id == "__file__" for a in c.args)}
    typed = _annotations(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Name) and node.id == "Path" and id(node) not in own | typed:
            what = "Path"  # called, or handed on (argparse's type=Path) to make local-only paths
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id == "open":
                what = "open"
            elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and id(fn) not in own:
                owner = fn.value.id
                if owner in ("pathlib", "shutil") or (owner == "os" and fn.attr in OS_FILE_CALLS) or \
                        (owner, fn.attr) in (("gzip", "open"), ("io", "open")):
                    what = f"{owner}.{fn.attr}"
            elif isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute) and \
                    isinstance(fn.value.value, ast.Name) and (fn.value.value.id, fn.value.attr) == ("os", "path"):
                what = f"os.path.{fn.attr}"
        if what is not None:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {what}")
    return found


def test_no_run_path_bypasses_the_storage_layer():
    found = [v for path in sorted(ROOT.rglob("*.py")) if path.relative_to(ROOT).as_posix() not in ALLOWED
             for v in _violations(path)]
    assert not found, "local-only file calls outside g2rl_jax/storage.py (use g2rl_jax.storage):\n" + "\n".join(found)


def test_the_rule_catches_what_it_names(tmp_path):
    """The check itself can fail: each forbidden form in a scratch module is reported."""
    sample = tmp_path / "sample.py"
    body = ("import os, pathlib, shutil\nfrom pathlib import Path\n"
            "open('m.jsonl', 'a')\nPath('runs')\npathlib.Path('x')\nos.path.exists('x')\nshutil.rmtree('x')\n"
            "os.replace('a', 'b')\nPath(__file__).parent\nparser.add_argument('--out', type=Path)\n"
            "def f(p: Path) -> Path: ...\n")
    sample.write_text(body)
    got = [v.split(": ", 1)[1] for v in _violations(sample, tmp_path)]
    assert sorted(got) == sorted(["open", "Path", "pathlib.Path", "os.path.exists", "shutil.rmtree", "os.replace",
                                  "Path"])


def test_every_allowance_is_still_needed():
    unused = [name for name in ALLOWED if name != "storage.py" and not _violations(ROOT / name)]
    assert not unused, f"allowed but no longer needed (remove from ALLOWED): {unused}"
