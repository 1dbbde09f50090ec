"""The training path depends on neither the benchmarks nor the demos: no module under g2rl_jax/train, rollout, model,
rewards or data (nor g2rl_jax/shapes, the shapes they compile) reaches g2rl_jax.bench or g2rl_jax.demo through any
chain of imports, module-level or inside a function. What they need of the demo (the `demo:DIR` model-path schemes,
the demo datasets) they reach through g2rl_jax/registry.py, which names the providing module and imports it only
when a config names one of its schemes or datasets. Read from the source (ast), nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "g2rl_jax"
TRAINING_PATH = ("train", "rollout", "model", "rewards", "data", "shapes")
FORBIDDEN = ("g2rl_jax.bench", "g2rl_jax.demo")


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, wherever the statement is (a function body too), with the packages
    above each (their __init__ runs first)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
    above = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return {m for m in found | above | {package} if m in known and m != name}


def chains(package: Path) -> dict[str, list[str]]:
    """For every module of the training path that reaches a forbidden package, one import chain to it."""
    known = modules(package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    out = {}
    for start in sorted(n for n in known if n.split(".")[1:2] and n.split(".")[1] in TRAINING_PATH):
        seen, frontier = {start: [start]}, [start]
        while frontier:
            nxt = []
            for m in frontier:
                for dep in sorted(graph[m]):
                    if dep not in seen:
                        seen[dep] = [*seen[m], dep]
                        nxt.append(dep)
            frontier = nxt
        bad = [m for m in seen if m.startswith(FORBIDDEN)]
        if bad:
            out[start] = seen[min(bad, key=lambda m: len(seen[m]))]
    return out


def test_the_walk_sees_imports_in_function_bodies_and_packages(tmp_path):
    """The walker finds a function-local import, a relative one and the package __init__ an import runs, so that a
    clean result means something: a planted train module reaching the demo three ways is caught each time."""
    root = tmp_path / "g2rl_jax"
    for rel in ("__init__.py", "train/__init__.py", "demo/__init__.py", "demo/build.py", "plan.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    (root / "plan.py").write_text("def f():\n    from g2rl_jax.demo.build import x\n")
    for body in ("def g():\n    from g2rl_jax import plan\n", "from ..demo import build\n",
                 "import g2rl_jax.demo.build as b\n"):
        (root / "train" / "setup.py").write_text(body)
        assert chains(root)["g2rl_jax.train.setup"][-1] in ("g2rl_jax.demo", "g2rl_jax.demo.build"), body
    (root / "train" / "setup.py").write_text("from g2rl_jax import registry  # names the demo by a string\n")
    assert chains(root) == {}


@pytest.mark.parametrize("forbidden", FORBIDDEN)
def test_the_training_path_imports_neither_the_benches_nor_the_demos(forbidden):
    found = {start: chain for start, chain in chains(PACKAGE).items() if chain[-1].startswith(forbidden)}
    assert found == {}, "\n".join(" -> ".join(chain) for chain in found.values())


def test_the_registry_names_what_the_demo_registers():
    """registry.py's table names exactly the demo's schemes and datasets, and a name resolves through it."""
    from g2rl_jax import registry
    from g2rl_jax.data import load_dataset
    from g2rl_jax.demo import build, task  # noqa: F401 - registers the datasets

    assert set(registry.MODEL_SCHEMES) == set(build.SCHEMES)
    assert registry.model_scheme("countdown:runs/x").prefix == "countdown:"
    assert registry.model_scheme("models/Qwen3-1.7B") is None and registry.architecture("models/Qwen3-1.7B") is None
    assert registry.architecture("demo:runs/x") == build.demo_architecture()
    assert registry.resolve_model_paths("models/Qwen3-1.7B", None) == ("models/Qwen3-1.7B", None)
    from g2rl_jax.data.datasets import _REGISTRY

    by_demo = {name for name, loader in _REGISTRY.items()
               if getattr(getattr(loader, "func", loader), "__module__", "").startswith("g2rl_jax.demo")}
    assert by_demo == set(registry.DATASETS) and load_dataset("demo_test")
