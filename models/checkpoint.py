"""Saving zoo checkpoints: the one function every writer of a checkpoint folder calls.

`save_checkpoint(model, tokenizer, directory)` writes a folder that

- carries the tokenizer's special tokens: config.json and generation_config.json get the tokenizer's
  bos / eos / pad ids (a fresh config has Llama's defaults, bos 1 and eos 2, which in the bundled
  tokenizer are `<|pad|>` and "!"; `generate()` would then stop at "!" and never at end of text);
- loads without this package: the model's code is written beside the weights and config.json names it
  in `auto_map` (models/export.py; `model.save_pretrained(dir)` does the same through `code_writer`), so
  `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works in plain transformers, and
  `from_pretrained(dir)` after `import models`;
- is readable by others on a shared filesystem: safetensors 0.8's `save_file` (what transformers 5
  saves weights with) creates model.safetensors with mode 0600 whatever the umask; the files get the
  usual umask-respecting mode (0644 under umask 022) instead (`share_files`);
- carries no loading option of the machine that saved it: `tokenizer_config.json` would otherwise store
  `local_files_only: true` (train.data.load_tokenizer offline), which follows the checkpoint to machines
  that do have a hub.

`check_finite_weights(model, source)` refuses a model with NaN or infinite weights, naming the tensors:
such a model computes NaN logits, and greedy `generate()` then returns eos ids without a word.

`apply_special_tokens(model_or_config, tokenizer)` is the first step alone, for a model (or config) in
memory: called where a model is built next to its tokenizer, it makes `generate()` stop at the
tokenizer's eos before anything is saved.
"""

import json
import os
import time
from pathlib import Path

import torch
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from models.export import build_remote_code, write_remote_code
from models.registry import ZOO

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Options of one from_pretrained call that transformers stores in tokenizer_config.json; they describe the
# machine that loaded the tokenizer, not the tokenizer.
LOADING_OPTIONS = ("local_files_only",)


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """{bos,eos,pad}_token_id of `tokenizer` (None where it has no such token)."""
    return {name: getattr(tokenizer, name) for name in SPECIAL_TOKENS}


def apply_special_tokens(
    model_or_config: PreTrainedModel | PreTrainedConfig, tokenizer: PreTrainedTokenizerBase
):
    """Set the bos / eos / pad ids of a config, or of a model's config and generation config, to the
    tokenizer's; returns its argument.

    A token the tokenizer lacks becomes None rather than keeping a default id that means some other
    token in this vocabulary. Given a config before the model is built, pad also becomes the
    embedding's `padding_idx` (as in Hugging Face models: that row gets no gradient); on a built
    model it changes only what `generate()` and saved files use.
    """
    ids = special_token_ids(tokenizer)
    if isinstance(model_or_config, PreTrainedConfig):
        configs = [model_or_config]
    elif isinstance(model_or_config, PreTrainedModel):
        configs = [model_or_config.config]
        if getattr(model_or_config, "generation_config", None) is not None:
            configs.append(model_or_config.generation_config)
    else:
        raise TypeError(
            f"apply_special_tokens takes a transformers model or config, not {type(model_or_config).__name__}."
        )
    vocab_size = getattr(configs[0], "vocab_size", None)
    too_big = {
        name: i for name, i in ids.items() if i is not None and vocab_size is not None and i >= vocab_size
    }
    if too_big:
        raise ValueError(
            f"The tokenizer's special tokens {too_big} do not fit the model's vocab_size={vocab_size}; "
            "build the model with vocab_size=len(tokenizer)."
        )
    for config in configs:
        for name, value in ids.items():
            setattr(config, name, value)
    return model_or_config


def save_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path, blocks=None
) -> Path:
    """Save `model` (unsharded) and `tokenizer` to `directory` as a checkpoint that loads anywhere.

    The model's special token ids are set to the tokenizer's (in memory too, so that later `generate()`
    calls stop at the tokenizer's eos), then the weights, configs, tokenizer, the model's self-contained
    code with `auto_map`, and a README on how to load it are written. Returns the directory.

    `blocks`: the weights as an iterable of state-dict parts (`parallel.checkpoint.stream_full_state`),
    written one safetensors shard each as they arrive, so the whole model is never in memory at once;
    `model` then only gives the config and the code (it may live on the meta device).
    """
    directory = Path(directory)
    # Build the code first: an architecture that cannot be exported fails before anything is written.
    build_remote_code(model)
    apply_special_tokens(model, tokenizer)
    started = time.time()
    if blocks is None:
        model.save_pretrained(directory)  # the weights, the configs and the code (ZooPreTrainedModel.save_pretrained)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)
        if model.can_generate():
            model.generation_config.save_pretrained(directory)
        write_weight_shards(model, blocks, directory)
        code_writer(model)(directory)
    tokenizer.save_pretrained(directory)
    drop_loading_options(directory)
    share_files(directory, since=started)
    return directory


def code_writer(model: PreTrainedModel):
    """A function of a directory that writes `model`'s self-contained code, `auto_map` and model card there
    (`models.export`), built now; None for a class defined outside this package (a user's subclass elsewhere:
    saved as transformers saves it). What `ZooPreTrainedModel.save_pretrained` calls after writing the weights."""
    if type(model).__module__.split(".")[0] != "models":
        return None
    code = build_remote_code(model)

    def write(directory: str | Path) -> None:
        write_remote_code(code, directory, architecture=_architecture_name(model), class_name=type(model).__name__)

    return write


def write_weight_shards(model: PreTrainedModel, blocks, directory: Path) -> None:
    """One `model-0000i-of-0000n.safetensors` per block and the `model.safetensors.index.json` Hugging Face
    loads sharded weights by. A weight tied to an earlier one (the head to the embedding) is left out, as
    `save_pretrained` does; `from_pretrained` ties it again."""
    from safetensors.torch import save_file

    seen, tied = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    files, weight_map, total = [], {}, 0
    for index, block in enumerate(blocks):
        block = {name: t.contiguous() for name, t in block.items() if name not in tied}
        if not block:
            continue
        path = directory / f"model-{index:05d}.safetensors"
        save_file(block, path, metadata={"format": "pt"})
        files.append(path)
        total += sum(t.numel() * t.element_size() for t in block.values())
        weight_map.update(dict.fromkeys(block, path.name))
    # Renamed once their number is known: the names HF's own sharded checkpoints have.
    renamed = {}
    for i, path in enumerate(files, start=1):
        final = path.with_name(f"model-{i:05d}-of-{len(files):05d}.safetensors")
        path.rename(final)
        renamed[path.name] = final.name
    index = {"metadata": {"total_size": total}, "weight_map": {n: renamed[f] for n, f in sorted(weight_map.items())}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint folder as one state dict: its `model.safetensors`, or every shard its
    `model.safetensors.index.json` lists (what `write_weight_shards` writes)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(directory / "model.safetensors")
    weights = {}
    for name in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())):
        weights.update(load_file(directory / name))
    return weights


def drop_loading_options(directory: str | Path) -> None:
    """Remove `LOADING_OPTIONS` (e.g. `local_files_only: true`) from the folder's tokenizer_config.json."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if any(name in config for name in LOADING_OPTIONS):
        for name in LOADING_OPTIONS:
            config.pop(name, None)
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def share_files(directory: str | Path, since: float = 0.0) -> None:
    """Give the files written in `directory` since `since` (a time.time()) the mode a plain `open()` gives:
    0666 less the process's umask (0644 under umask 022). safetensors 0.8 creates weight files 0600, which
    others on a shared filesystem cannot read."""
    umask = os.umask(0)
    os.umask(umask)  # os.umask is the only way to read it; put it back at once
    mode = 0o666 & ~umask
    for path in Path(directory).iterdir():
        if path.is_file() and not path.is_symlink() and path.stat().st_mtime >= since - 1:
            path.chmod(mode)


def nonfinite_counts(named_tensors) -> list[tuple[str, int, int, int]]:
    """(name, NaN count, inf count, numel) of every floating-point tensor of `named_tensors` ((name, value) pairs:
    a state dict's items, named_parameters) that holds NaN or infinite values; other values and meta tensors are
    skipped. The one scan behind the loaders' refusals (here and train.module.nonfinite_tensors)."""
    found = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.device.type == "meta":
            continue
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        if nan or inf:
            found.append((name, nan, inf, tensor.numel()))
    return found


def check_finite_weights(model: torch.nn.Module, source: str) -> None:
    """Raise ValueError naming every parameter or buffer of `model` that holds NaN or infinite values.

    `source` says where the model came from (e.g. "checkpoint=outputs/.../hf"), for the message."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    bad = [f"{name} ({nan + inf} of {numel} values)" for name, nan, inf, numel in nonfinite_counts(tensors)]
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"{source} has non-finite (NaN or infinite) weights in {len(bad)} tensor(s): {shown}; its outputs "
            "would be NaN (generate() returns eos ids, the perplexity is nan): evaluate an earlier checkpoint or "
            "retrain from one."
        )


def _architecture_name(model: PreTrainedModel) -> str:
    """The zoo name of the model's architecture (e.g. "ladder"), else its model_type."""
    for name, entry in ZOO.items():
        if entry.model_class is type(model):
            return name
    return model.config.model_type


__all__ = [
    "SPECIAL_TOKENS",
    "apply_special_tokens",
    "code_writer",
    "check_finite_weights",
    "nonfinite_counts",
    "drop_loading_options",
    "save_checkpoint",
    "share_files",
    "special_token_ids",
]
