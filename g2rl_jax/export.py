"""`python -m g2rl_jax.export --checkpoint RUN_OR_STEP_DIR --out DIR`: a training checkpoint as a Hugging Face dir.

The output holds config.json, safetensors and the base model's tokenizer files, so
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` (and so vLLM or `python -m g2rl_jax.eval --model-path DIR`)
loads the trained policy. `--checkpoint` takes a run directory (its newest checkpoint) or one
`<run>/checkpoints/<step>` directory. Nothing already in `--out` is overwritten unless `--overwrite` is given.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from g2rl_jax import cli

# Files a Hugging Face model dir keeps besides the weights: the tokenizer and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m g2rl_jax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run directory or <run>/checkpoints/<step> directory")
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--overwrite", action="store_true", help="replace model files already in --out")
    return parser.parse_args(argv)


def export(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the policy of `checkpoint` to `out` as a Hugging Face directory; returns `out`."""
    from g2rl_jax.model import save_pretrained
    from g2rl_jax.train.checkpoint import load_policy

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {str(out)!r} is not empty; choose an empty directory or pass --overwrite")
    model, base_dir = load_policy(checkpoint)
    save_pretrained(model, out)
    for name in TOKENIZER_FILES:
        if (Path(base_dir) / name).is_file():
            shutil.copy2(Path(base_dir) / name, out / name)
    return out


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export(args.checkpoint, args.out, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        return cli.fail("export", err)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
