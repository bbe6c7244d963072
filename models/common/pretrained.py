"""The base class of every zoo model, `ZooPreTrainedModel`: weight init, the check of a shard layout's
degrees, and a `from_pretrained` that turns a checkpoint which does not fit the class into one clear error
(transformers only warns and leaves random weights). The decoder trunk and the LM head built on it are
models/common/causal_lm.py.
"""

import math
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init

from models.common.norm import RMSNorm
from models.common.rotary import RotaryEmbedding, rope_inv_freq
from models.registry import entry_for  # ZOO is filled when `models` is imported, after this module

# Output projections feed the residual stream; GPT-2 / Megatron scale their init by 1/sqrt(2L) so the
# stream's variance does not grow with depth.
RESIDUAL_OUTPUT_PROJECTIONS = ("o_proj", "down_proj")

# The checkpoints (config.json `model_type`) each architecture's `from_pretrained` loads. Llama, Ladder
# and the parallel block share Llama's state-dict names, so an HF or zoo Llama converts to either
# (`ZooLadderForCausalLM.from_pretrained(llama_dir, ladder_layers=N)`) and a Ladder back to Llama.
# An architecture not listed loads its own checkpoints only.
LOADS_FROM = {
    "zoo_llama": ("zoo_llama", "llama", "zoo_ladder"),
    "zoo_ladder": ("zoo_ladder", "llama", "zoo_llama"),
    "zoo_parallel": ("zoo_parallel", "llama", "zoo_llama"),
}
# Checkpoint weights a conversion leaves unused on purpose: the parallel block has one norm per layer,
# so a Llama's second norm (post_attention_layernorm) has no place in it.
UNUSED_ON_CONVERSION = {
    ("zoo_parallel", "llama"): ".post_attention_layernorm.",
    ("zoo_parallel", "zoo_llama"): ".post_attention_layernorm.",
}


def _checkpoint_model_type(path, kwargs: dict) -> str | None:
    """The `model_type` in the checkpoint's config.json, or None where there is none to read."""
    if path is None:  # from_pretrained(None, config=..., state_dict=...)
        return None
    download_keys = ("cache_dir", "revision", "subfolder", "local_files_only", "token")
    where = {k: kwargs[k] for k in download_keys if k in kwargs}
    try:
        config_dict, _ = PreTrainedConfig.get_config_dict(path, **where)
    except (OSError, ValueError):
        return None  # no config.json (a bare weights folder, say): the weight-name checks still apply
    return config_dict.get("model_type")


def _loader_of(model_type: str | None) -> str:
    """The class to suggest for a checkpoint of `model_type`."""
    entry = entry_for(model_type)
    if entry is not None:
        return f"{entry.model_class.__name__} (or AutoModelForCausalLM)"
    if model_type == "llama":
        return "ZooLlamaForCausalLM (or transformers' LlamaForCausalLM)"
    return "the class of its own architecture (AutoModelForCausalLM, if transformers knows it)"


def _unreadable_weights_message(folder: Path, error: Exception) -> str:
    """Names the .safetensors file(s) of `folder` that do not open (truncated or corrupt)."""
    bad = []
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError:
            bad.append(str(file))
    where = ", ".join(bad) if bad else f"the weights of {folder}"
    return (
        f"Cannot read {where} ({error}): the file is truncated or corrupt (an interrupted save or copy?); "
        "save or download the checkpoint again."
    )


class ZooPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_attention_backend = False

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            name = getattr(module, "_zoo_name", "")
            scale = 1 / math.sqrt(2 * self.config.num_hidden_layers) if name in RESIDUAL_OUTPUT_PROJECTIONS else 1
            init.normal_(module.weight, mean=0.0, std=std * scale)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            # Non-persistent buffer: not in checkpoints, so it must be rebuilt after meta-device loading.
            init.copy_(module.inv_freq, rope_inv_freq(module.rope_parameters, module.head_dim))

    # What `save_pretrained` calls to write the model's own code and `auto_map` beside its weights, so that the
    # folder loads with trust_remote_code=True where this package is not installed: `models.checkpoint.code_writer`,
    # set by `import models` (the package above this module). None in the copy of this file that an exported
    # checkpoint carries: transformers saves a class it loaded as remote code with its code itself.
    code_writer = None

    def save_pretrained(self, save_directory, *args, **kwargs):
        # The code is built first: an architecture that cannot be exported fails before anything is written.
        write_code = self.code_writer(self) if self.code_writer is not None else None
        super().save_pretrained(save_directory, *args, **kwargs)
        if write_code is not None and kwargs.get("is_main_process", True):
            write_code(save_directory)

    def check_layout(self, degrees: dict[str, int]) -> None:
        """One clear error unless the mesh degrees ({"tp": 2}) fit the architecture's shard layout: the check
        of its sharding.py, through its registry entry (`parallel.parallelize` asks first)."""
        entry = entry_for(self.config.model_type)
        if entry is None:
            raise ValueError(
                f"{type(self).__name__} (model_type {self.config.model_type!r}) is not a registered zoo "
                "architecture, so there is no shard layout to check its degrees against; `import models` "
                "registers the zoo."
            )
        entry.check_layout(self.config, degrees)

    def __init__(self, config, *args, **kwargs):
        # A field assigned after the config was built (`config.ladder_layers = 7`) skipped its checks;
        # run them again before building anything from it.
        if hasattr(config, "validate"):
            config.validate()
        super().__init__(config, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """HF `from_pretrained`, but a checkpoint that does not fit this class is one clear error.

        transformers only warns, and leaves random weights, when the checkpoint is another
        architecture's (`LOADS_FROM`), when its shapes do not fit the config, or when the model has
        weights the checkpoint lacks (or the other way round); a truncated weights file fails without
        naming the file. `ignore_mismatched_sizes=True` gives transformers' own behaviour back.
        """
        if kwargs.get("ignore_mismatched_sizes"):
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        path = pretrained_model_name_or_path
        own_type = cls.config_class.model_type
        ckpt_type = _checkpoint_model_type(path, kwargs)
        loads = LOADS_FROM.get(own_type, (own_type,))
        if ckpt_type is not None and ckpt_type not in loads:
            raise ValueError(
                f"Checkpoint {path} has model_type={ckpt_type!r} (its config.json), which {cls.__name__} "
                f"(model_type={own_type!r}) cannot load: it loads {', '.join(map(repr, loads))} checkpoints. "
                f"Load it with {_loader_of(ckpt_type)}."
            )
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                path, *args, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
            )
        except SafetensorError as error:
            raise OSError(_unreadable_weights_message(Path(path) / kwargs.get("subfolder", ""), error)) from error
        if info["mismatched_keys"]:
            key, ckpt_shape, model_shape = sorted(info["mismatched_keys"])[0]
            raise ValueError(
                f"Checkpoint {pretrained_model_name_or_path} does not fit {cls.__name__}'s config: {key} has shape "
                f"{tuple(ckpt_shape)} in the checkpoint but {tuple(model_shape)} from the config "
                f"({len(info['mismatched_keys'])} tensors differ); load it with the checkpoint's own config.json."
            )
        # Missing: model weights the checkpoint lacks, left randomly initialised (tied and non-persistent
        # ones are not listed). Unexpected: checkpoint weights the model has no place for.
        missing = sorted(info["missing_keys"])
        unused_on_purpose = UNUSED_ON_CONVERSION.get((own_type, ckpt_type))
        unexpected = sorted(
            key
            for key in info["unexpected_keys"]
            # a causal-LM checkpoint loaded into the bare decoder trunk: the head is not part of it
            if not (key.startswith("lm_head.") and not hasattr(model, "lm_head"))
            and not (unused_on_purpose and unused_on_purpose in key)
        )
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} of the model's weights are not in it and would stay random ({missing[0]}, ...)"
                )
            if unexpected:
                parts.append(f"{len(unexpected)} of its weights have no place in the model ({unexpected[0]}, ...)")
            # Its config.json says it is ours (or convertible), so the weights file is what is wrong.
            fix = (
                "Save it again with save_pretrained"
                if ckpt_type is not None
                else "Load it with the class of the architecture it was saved from"
            )
            raise ValueError(
                f"Checkpoint {path} (model_type={ckpt_type!r}) does not hold {cls.__name__}'s weights: "
                f"{'; '.join(parts)}. {fix}, or pass ignore_mismatched_sizes=True to "
                "load what fits and initialise the rest."
            )
        return (model, info) if want_info else model

    def post_init(self):
        # Remember each linear's attribute name so `_init_weights` can find residual output projections.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                module._zoo_name = name.rsplit(".", 1)[-1]
        super().post_init()
