"""Hugging Face checkpoints from sharded training: streamed at the end of a run, or offline from a checkpoint.

    python -m train.export_checkpoint <run>/checkpoints/last.ckpt <out dir> [--tokenizer PATH]

`export_streamed` is what `train.pretrain` does at the end of a sharded run: every rank takes part in
gathering the unsharded weights one block at a time (the embedding and head, then each decoder layer:
`parallel.checkpoint.stream_full_state`), rank 0 writes each block as one safetensors shard and drops it,
so no rank ever holds more than one layer's gathered weights, and none the optimizer.

The command converts a training checkpoint (a sharded torch.distributed.checkpoint directory, or a
one-file `.ckpt`) into the same `hf/` folder in one process, without the processes that trained it:
the weights are read at tp = ep = sp = 1 (DCP reshards them), the optimizer state is never read. The
tokenizer is the run's own (`<run>/hf/`) when it is there, else `--tokenizer` or the bundled one.
"""

import argparse
import sys
from pathlib import Path

import torch

import models
from models.checkpoint import save_checkpoint
from parallel.checkpoint import model_views, stream_full_state
from train import sharded_checkpoint
from train.data.tokenizer import load_tokenizer


def export_streamed(model, model_class, tokenizer, directory: Path, is_rank_zero: bool) -> None:
    """Write the sharded `model` (of `model_class`) with `tokenizer` to `directory` (collective)."""
    blocks = stream_full_state(model)
    if not is_rank_zero:
        for _ in blocks:  # take part in each block's gathering; rank 0 writes it
            pass
        return
    with torch.device("meta"):
        skeleton = model_class(model.config)  # the config and the code; no weights
    save_checkpoint(skeleton, tokenizer, directory, blocks=blocks)


def load_unsharded(checkpoint: str | Path):
    """The unsharded model of a training checkpoint, in this process (its weights only)."""
    checkpoint = Path(checkpoint)
    meta = sharded_checkpoint.read_meta(checkpoint)
    hparams = meta.get("hyper_parameters", {})
    if "model_name" not in hparams:
        raise ValueError(f"{checkpoint} is not a checkpoint of train.pretrain (it names no model_name).")
    entry = models.get(hparams["model_name"])
    if "model_config" in meta and "model_type" in meta["model_config"]:
        config = entry.config_class.from_dict(meta["model_config"])
    else:  # a one-file checkpoint: its hyper-parameters built the model
        config = models.build_config(hparams["model_name"], vocab_size=hparams["vocab_size"], **hparams["model_config"])
    model = entry.model_class(config)
    if sharded_checkpoint.is_sharded(checkpoint):
        # The LightningModule's names (its `model` attribute is this model), each tensor once, as saved
        state = model_views(model, mesh=None, prefix="model.")
        sharded_checkpoint.load({"state_dict": state}, checkpoint, no_dist=True)
    else:
        state = {k.removeprefix("model."): v for k, v in meta["state_dict"].items()}
        model.load_state_dict(state)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.export_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a training checkpoint: <run>/checkpoints/last.ckpt (a directory or a file)")
    parser.add_argument("out", help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the run's hf/, else the bundled one)")
    args = parser.parse_args(argv)
    checkpoint, out = Path(args.checkpoint), Path(args.out)
    problem = sharded_checkpoint.problem(checkpoint) if checkpoint.exists() or checkpoint.is_symlink() else "it does not exist"
    if problem:
        others = sharded_checkpoint.loadable_siblings(checkpoint) if checkpoint.parent.is_dir() else []
        older = f"; {others[0]} is the newest other checkpoint of the run that loads" if others else ""
        print(f"Error: cannot export {checkpoint}: {problem}{older}.", file=sys.stderr)
        return 1
    if out.exists() and any(out.iterdir()):
        print(f"Error: {out} is not empty; choose a new directory (nothing is overwritten).", file=sys.stderr)
        return 1
    run_hf = checkpoint.parent.parent / "hf"
    tokenizer_source = args.tokenizer or (str(run_hf) if (run_hf / "tokenizer.json").is_file() else None)
    try:
        model = load_unsharded(checkpoint)
        tokenizer = load_tokenizer(tokenizer_source)
    except sharded_checkpoint.DamagedCheckpoint as error:
        others = sharded_checkpoint.loadable_siblings(checkpoint)
        older = f" ({others[0]} is the newest other one)" if others else ""
        print(
            f"Error: cannot export {checkpoint}: {error.detail}; nothing was written. Export another checkpoint of "
            f"the run{older}.",
            file=sys.stderr,
        )
        return 1
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        print(f"Error: cannot export {checkpoint}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    save_checkpoint(model, tokenizer, out)
    print(f"Wrote {out} ({sum(p.numel() for p in model.parameters()):,} parameters) from {checkpoint}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
