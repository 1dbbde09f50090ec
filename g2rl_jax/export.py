"""`python -m g2rl_jax.export --checkpoint RUN_OR_STEP_DIR --out DIR [--adapter]`: a training checkpoint as a
Hugging Face dir.

The output holds config.json, safetensors and the base model's tokenizer files, so
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` (and so vLLM or `python -m g2rl_jax.eval --model-path DIR`)
loads the trained policy. A LoRA run's checkpoint is written merged, W + (alpha/r)·A·B, in model.param_dtype (the
adapters' dtype: float32 keeps the small update that bfloat16 rounding of W would lose). With `--adapter` (LoRA
runs only) DIR is instead a PEFT adapter (adapter_config.json + adapter_model.safetensors) that
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model, and that `model.lora.init_from` starts a run
from. `--checkpoint` takes a run directory (its newest checkpoint) or one `<run>/checkpoints/<step>` directory.
Nothing already in `--out` is overwritten unless `--overwrite` is given.
"""
from __future__ import annotations

import os
import sys
import tempfile

from g2rl_jax import cli, storage

# Files a Hugging Face model dir keeps besides the weights: the tokenizer and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m g2rl_jax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run directory or <run>/checkpoints/<step> directory")
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--adapter", action="store_true", help="LoRA runs: write a PEFT adapter, not merged weights")
    parser.add_argument("--overwrite", action="store_true", help="replace model files already in --out")
    return parser.parse_args(argv)


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, adapter: bool = False,
           overwrite: bool = False):
    """Write the policy of `checkpoint` to `out` as a Hugging Face directory (merged weights), or with `adapter` its
    LoRA adapters as a PEFT adapter directory; returns `out`. Either may be a URL (gs://...): a bucket's `out` is
    written in a local temporary directory, then uploaded file by file."""
    from g2rl_jax.train import identity
    from g2rl_jax.train.checkpoint import resolve_checkpoint

    storage.check_readable(checkpoint, "--checkpoint")  # a server gone away: one line within a bounded time
    if storage.is_url(out):
        storage.check_writable(out, "--out")  # a missing bucket, no credentials: one line before any model loads
    if storage.names(out) and not overwrite:
        raise FileExistsError(f"--out {str(out)!r} is not empty; choose an empty directory or pass --overwrite")
    run_dir, step_dir = resolve_checkpoint(checkpoint)
    record = identity.saved(step_dir)
    if adapter and record["lora"] is None:
        raise ValueError(f"--adapter: {step_dir} is a full fine-tune (model.lora.rank=0), which has no adapters; "
                         "export it without --adapter")
    if not storage.is_url(out):
        return _write(checkpoint, storage.path(out), adapter, record, run_dir)
    with tempfile.TemporaryDirectory(prefix="g2rl_jax_export_") as local:
        storage.upload_tree(_write(checkpoint, local, adapter, record, run_dir), out)
    return storage.path(out)


def _write(checkpoint, out, adapter: bool, record: dict, run_dir):
    """The export into local directory `out`."""
    from g2rl_jax.model import lora, peft_io, save_pretrained
    from g2rl_jax.train.checkpoint import load_policy, run_config

    model, base_dir = load_policy(checkpoint)
    if adapter:
        return peft_io.save_adapter(model, out, base_model=record["base"]["path"], base_sha256=record["base"]["sha256"])
    if record["lora"] is not None:
        model = lora.merged(model, run_config(run_dir).model.param_dtype)
    save_pretrained(model, out)
    for name in TOKENIZER_FILES:
        if storage.is_file(base_dir / name):
            storage.write_bytes(storage.path(out) / name, storage.read_bytes(base_dir / name))
    return out


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export(args.checkpoint, args.out, adapter=args.adapter, overwrite=args.overwrite)
    except (*cli.USER_ERRORS, ValueError) as err:
        return cli.fail("export", err)
    how = ("peft.PeftModel.from_pretrained(base_model, {!r})" if args.adapter
           else "transformers.AutoModelForCausalLM.from_pretrained({!r})")
    print(f"wrote {out} (load with {how.format(str(out))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
