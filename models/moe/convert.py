"""Dense Llama -> vanilla MoE by sparse upcycling (Komatsuzaki et al., "Sparse Upcycling: Training
Mixture-of-Experts from Dense Checkpoints", ICLR 2023).

Every MoE layer (every `moe_layer_freq`-th layer, `ZooMoeConfig.is_moe_layer`) gets `num_local_experts`
experts that are all copies of that layer's dense MLP (its gate / up / down weights copied into each slice
of the stacked [E, ...] expert weights, which are laid out as nn.Linear weights for exactly this) and a
fresh router (the model's own init, N(0, initializer_range)); attention, norms, embeddings, the LM head
and the dense MLPs of the other layers are copied unchanged.

The upcycled model computes the dense model's function: a token's output is sum_j g_j E_j(x) with every
E_j the dense MLP and the renormalised top-k gates summing to 1, i.e. exactly MLP(x) (up to float
rounding; `tests/test_convert_moe.py`). So the router learns nothing from the language-model loss at first
(its gates do not change the output until the experts differ); the experts drift apart through the
different tokens each one is sent, and the balance loss (training mode) moves the router from the first
step. A `capacity_factor` (not an option here) would drop tokens and break the equality.

`LLAMA_TO_MOE` is the converter `train.convert` runs:
`python -m train.convert converter=llama_to_moe source=DIR num_local_experts=4 moe_layer_freq=2`.
Sources: an HF `LlamaForCausalLM` directory or a zoo `llama` checkpoint (not a Ladder one: its layers
compute a different function, which the upcycled model would not reproduce).

`MIXTRAL_TO_MOE` (`converter=mixtral_to_moe`) reads a trained Mixtral checkpoint (an HF
`MixtralForCausalLM` directory, or a hub id through the same `from_pretrained`) into the zoo's `moe`: not an
upcycling, a renaming. Mixtral is the zoo's `moe` with every layer an MoE layer (moe_layer_freq=1), softmax
top-k routing renormalised, dropless, no biases. transformers' own loader reads the weights, so both layouts
load: the hub's per-expert `block_sparse_moe.experts.N.w1 / w2 / w3` + `block_sparse_moe.gate` (what
`save_pretrained` writes, transformers 5 included) and transformers 5's in-memory fused layout
(`mlp.experts.gate_up_proj` [E, 2f, d], gate rows first, `mlp.experts.down_proj`, `mlp.gate`; on disk with
`save_pretrained(save_original_format=False)`). Renamed: `mlp.gate.weight` -> `mlp.router.gate.weight`,
`gate_up_proj` split into the zoo's `experts.gate_proj` / `experts.up_proj` (down_proj as is); everything else
keeps its name. Carried over: the shapes, rope_parameters (theta, llama3 scaling), rms_norm_eps, the special
tokens, tie_word_embeddings, num_local_experts / num_experts_per_tok, router_aux_loss_coef (0.001 unless the
option says otherwise) with router_aux_loss_style="hf" (transformers' balance loss, which Mixtral was trained
with; option `router_aux_loss_style=zoo` for the zoo's) and the checkpoint's dtype. Refused with one clear error each (the zoo would compute
something else): a sliding window, router jitter noise, attention dropout, an activation other than SiLU, a
RoPE type the zoo lacks, a quantized checkpoint, and any MixtralConfig field this converter does not know
(a newer transformers' feature). In float64 the logits agree to ~1e-7 relative, not to fp64 rounding:
Mixtral's RMSNorm casts to fp32 whatever the dtype, its RoPE table is fp32 arithmetic, and both routers score
in fp32 (the zoo's on fp32 inputs, Mixtral's on fp64 logits rounded to fp32) (`tests/test_mixtral.py`:
within 1e-6, same experts for every token, same greedy generation).
"""

from pathlib import Path

import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedConfig

from models.llama.configuration import ZooLlamaConfig
from models.llama.modeling import ZooLlamaForCausalLM
from models.moe.configuration import ZooMoeConfig
from models.moe.modeling import ZooMoeForCausalLM
from models.registry import LLAMA_TYPES, Converter, config_summary, from_llama, register_converter
from models.weight_map import Rule, chunks, loading_gaps, map_weights, stack_copies

UPCYCLABLE = LLAMA_TYPES
# The converter's options (train.convert reads them from its config; None there: the target config's
# default): how many experts, how many per token, which layers, the balance loss's weight.
MOE_OPTIONS = ("num_local_experts", "num_experts_per_tok", "moe_layer_freq", "router_aux_loss_coef")
# config.json fields that describe the source file, not the model: not carried into the target config.
NOT_COPIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")
# A dense layer's MLP projection (models/weight_map.py names).
MLP_WEIGHT = "model.layers.{layer}.mlp.{proj:gate_proj|up_proj|down_proj}.weight"


def dense_config(source: str | Path) -> ZooLlamaConfig:
    """The source's Llama config (an HF or zoo config.json), refused if its MLP cannot become experts."""
    config = ZooLlamaConfig.from_pretrained(source)
    if config.mlp_bias:
        raise ValueError(
            f"Checkpoint {source} has mlp_bias=True, but the experts have no biases, so upcycling would drop "
            "its MLP biases; upcycle a Llama without MLP biases (mlp_bias=false, as Llama itself)."
        )
    return config


def target_config(config_class, source: str | Path, options: dict, what: str):
    """`config_class` with the source's Llama fields and `options` on top (None: the class default), its
    own checks run: one clear error naming the checkpoint for options that do not fit it."""
    dense = dense_config(source)
    fields = {k: v for k, v in dense.to_dict().items() if k not in NOT_COPIED}
    fields.update({k: v for k, v in options.items() if v is not None})
    try:
        return config_class(**fields)
    except ValueError as error:
        raise ValueError(f"{source} cannot be upcycled to {what} with {_describe(options)}: {error}") from error


def _describe(options: dict) -> str:
    given = {k: v for k, v in options.items() if v is not None}
    return ", ".join(f"{k}={v}" for k, v in given.items()) if given else "the default options"


def moe_layer(config):
    """A weight-map rule's `when`: the weight is of one of `config`'s MoE layers."""
    return lambda fields: config.is_moe_layer(int(fields["layer"]))


def load_upcycled(model: nn.Module, state: dict[str, torch.Tensor], fresh: set[str]) -> nn.Module:
    """Load `state` into `model`, which keeps its own (fresh) values for exactly the names in `fresh`.

    Anything else missing or left over is a mapping bug: refused rather than silently left random."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != fresh or unexpected:
        raise RuntimeError(
            f"Upcycling to {type(model).__name__} left weights unmapped: missing {sorted(set(missing) - fresh)}, "
            f"not fresh {sorted(fresh - set(missing))}, unexpected {sorted(unexpected)}."
        )
    return model


def upcycle_to_moe(dense: ZooLlamaForCausalLM, config: ZooMoeConfig) -> ZooMoeForCausalLM:
    """A `moe` model of `config` (the dense model's shapes) whose experts copy `dense`'s MLPs (module doc)."""
    model = ZooMoeForCausalLM(config).to(dense.dtype)
    # Each dense projection [out, in] copied into every expert slot: [E, out, in].
    experts = Rule(
        MLP_WEIGHT, "model.layers.{layer}.mlp.experts.{proj}", stack_copies(config.num_local_experts), moe_layer(config)
    )
    state, fresh = map_weights(dense.state_dict(), [experts]), set()
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            # The router (and its balance bias, zero, when router_balance_bias is on) starts fresh.
            fresh |= {n for n in model.state_dict() if n.startswith(f"model.layers.{i}.mlp.router.")}
    return load_upcycled(model, state, fresh)


def check_llama_to_moe(source: str | Path, **options) -> None:
    """Every check of the conversion from the checkpoint's config.json alone: nothing is loaded."""
    target_config(ZooMoeConfig, source, options, "moe")


def llama_to_moe(source: str | Path, **options) -> ZooMoeForCausalLM:
    """Load a dense Llama checkpoint directory as an upcycled `moe` model; `options`: `MOE_OPTIONS`."""
    config = target_config(ZooMoeConfig, source, options, "moe")
    return upcycle_to_moe(ZooLlamaForCausalLM.from_pretrained(source), config)


summary = config_summary(
    "num_local_experts", "num_experts_per_tok", "moe_layer_freq", "num_moe_layers", "num_hidden_layers"
)


LLAMA_TO_MOE = from_llama("moe", "MoE", llama_to_moe, summary, check=check_llama_to_moe, options=MOE_OPTIONS,
                          source_types=UPCYCLABLE)


# --- Mixtral -> moe: a renaming (module docstring) ---------------------------------------------------------

MIXTRAL_TYPES = ("mixtral",)
# Options: the balance loss's weight when retraining (default: the checkpoint's, Mixtral's 0.001) and its
# convention (default "hf": the loss the checkpoint was trained with; "zoo": the zoo's, models/common/moe.py).
MIXTRAL_OPTIONS = ("router_aux_loss_coef", "router_aux_loss_style")
# MixtralConfig fields and what becomes of each. Carried: the same name means the same in ZooMoeConfig.
MIXTRAL_CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
)
# Checked (`mixtral_refusals`): carried only at the value the zoo computes. Ignored: an output switch, not
# part of the function (the zoo's model returns its balance loss in training mode on its own).
MIXTRAL_CHECKED = ("hidden_act", "sliding_window", "router_jitter_noise", "attention_dropout")
MIXTRAL_IGNORED = ("output_router_logits",)
# config.json keys of older transformers that MixtralConfig reads into its own fields.
MIXTRAL_LEGACY_KEYS = ("rope_theta", "rope_scaling", "torch_dtype")
ZOO_ROPE_TYPES = ("default", "llama3")  # models/common/rotary.py
# transformers 5's Mixtral names -> the zoo moe's (models/weight_map.py); everything else keeps its name.
MIXTRAL_MLP = "model.layers.{layer}.mlp."
MIXTRAL_TO_ZOO = (
    # [E, 2f, d], gate rows first (MixtralExperts: linear(x, gate_up_proj[e]).chunk(2) -> gate, up).
    Rule(
        MIXTRAL_MLP + "experts.gate_up_proj",
        (MIXTRAL_MLP + "experts.gate_proj", MIXTRAL_MLP + "experts.up_proj"),
        chunks(2, dim=1),
    ),
    Rule(MIXTRAL_MLP + "gate.weight", MIXTRAL_MLP + "router.gate.weight"),
)


def mixtral_refusals(config: MixtralConfig, raw: dict) -> list[str]:
    """What of this Mixtral config the zoo's moe cannot compute, one sentence each (empty: it converts).
    `raw`: the config.json as read, for keys MixtralConfig does not declare (a quantization_config, ...)."""
    out = []
    unknown_fields = sorted(
        set(MixtralConfig.__annotations__) - {*MIXTRAL_CARRIED, *MIXTRAL_CHECKED, *MIXTRAL_IGNORED}
    )
    if unknown_fields:
        out.append(
            f"this transformers' MixtralConfig has fields {unknown_fields} that mixtral_to_moe does not know, so it "
            "cannot tell whether the zoo computes them (models/moe/convert.py MIXTRAL_CARRIED lists what it maps)"
        )
    known_keys = {*MixtralConfig().to_dict(), *MIXTRAL_LEGACY_KEYS}
    stray = sorted(set(raw) - known_keys)
    if stray:
        out.append(
            f"config.json has {stray}, which MixtralConfig does not declare (a quantized or otherwise modified "
            "checkpoint?); the zoo reads plain Mixtral weights: dequantize, or drop the keys if they do not "
            "change the model"
        )
    if config.hidden_act != "silu":
        out.append(f"hidden_act={config.hidden_act!r}: the zoo's experts are SwiGLU with SiLU only")
    if config.sliding_window is not None:
        out.append(
            f"sliding_window={config.sliding_window}: the zoo's attention has no sliding window (every token "
            "attends to every earlier one), which differs from Mixtral's for sequences longer than the window; "
            "Mixtral-8x7B's own config has sliding_window null. Set it to null in config.json only if no "
            "sequence you run is longer than the window"
        )
    if config.router_jitter_noise:
        out.append(
            f"router_jitter_noise={config.router_jitter_noise}: the zoo's router has no jitter (Mixtral multiplies "
            "the MoE input by uniform noise in training); set it to 0.0 in config.json to convert without it"
        )
    if config.attention_dropout:
        out.append(
            f"attention_dropout={config.attention_dropout}: the zoo's attention has no dropout; set it to 0.0 in "
            "config.json to convert without it"
        )
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ZOO_ROPE_TYPES:
        out.append(f"rope_type={rope_type!r}: the zoo's RoPE is one of {ZOO_ROPE_TYPES}")
    return out


def mixtral_source_config(source: str | Path) -> tuple[MixtralConfig, dict]:
    """The checkpoint's MixtralConfig and its config.json as a dict, refused unless it is a Mixtral."""
    raw, _ = PreTrainedConfig.get_config_dict(str(source))
    if raw.get("model_type") not in MIXTRAL_TYPES:
        raise ValueError(
            f"{source} has model_type={raw.get('model_type')!r}, not a Mixtral ({MIXTRAL_TYPES}); "
            "converter=mixtral_to_moe reads MixtralForCausalLM checkpoints (llama_to_moe upcycles a Llama)."
        )
    return MixtralConfig.from_pretrained(str(source)), raw


def moe_config_from_mixtral(config: MixtralConfig, raw: dict | None = None, source="the checkpoint", **options):
    """The ZooMoeConfig that computes what `config`'s MixtralForCausalLM computes (module docstring);
    `options`: `MIXTRAL_OPTIONS` (None: the checkpoint's value). One clear error naming what does not fit."""
    refusals = mixtral_refusals(config, raw if raw is not None else config.to_dict())
    if refusals:
        raise ValueError(f"{source} cannot be converted to the zoo's moe exactly: " + "; ".join(refusals) + ".")
    fields = {name: getattr(config, name) for name in MIXTRAL_CARRIED}
    fields["head_dim"] = config.head_dim or config.hidden_size // config.num_attention_heads
    fields["router_aux_loss_style"] = "hf"  # Mixtral's own balance loss, so retraining continues it
    fields.update({k: v for k, v in options.items() if v is not None})
    widths_fit = config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0
    fields.update(
        moe_layer_freq=1,  # Mixtral: every layer an MoE layer
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        capacity_factor=None,  # dropless, as Mixtral
        router_score_func="softmax",
        router_balance_bias=False,
        # Same function either way; grouped_mm is faster but needs widths that are multiples of 8.
        experts_impl="grouped_mm" if widths_fit else "loop",
    )
    dtype = getattr(config, "dtype", None)
    try:
        moe = ZooMoeConfig(**fields)
    except ValueError as error:
        raise ValueError(f"{source} does not fit the zoo's moe: {error}") from error
    if dtype is not None:
        moe.dtype = dtype
    return moe


def mixtral_state_to_moe(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MixtralForCausalLM's state dict (transformers 5's fused names) in the zoo moe's names. Consumes
    `state` (each tensor popped as it is mapped, so a large model is not held twice)."""
    return map_weights(state, MIXTRAL_TO_ZOO, consume=True)


def check_mixtral_to_moe(source: str | Path, **options) -> None:
    """Every check of the conversion from the checkpoint's config.json alone: nothing is loaded."""
    config, raw = mixtral_source_config(source)
    moe_config_from_mixtral(config, raw, source, **options)


def mixtral_to_moe(source: str | Path, dtype: torch.dtype | str = "auto", **options) -> ZooMoeForCausalLM:
    """A Mixtral checkpoint (directory or hub id) as the zoo's `moe`, same function (module docstring).
    `dtype`: "auto" keeps the checkpoint's; `options`: `MIXTRAL_OPTIONS`."""
    config, raw = mixtral_source_config(source)
    moe_config = moe_config_from_mixtral(config, raw, source, **options)
    # transformers' loader reads either layout (and sharded files, and the hub) into its fused names.
    hf, info = MixtralForCausalLM.from_pretrained(str(source), dtype=dtype, output_loading_info=True)
    if incomplete := loading_gaps(info):
        raise ValueError(f"{source} is not a complete Mixtral checkpoint: {incomplete}; save or download it again.")
    dtype = hf.dtype
    state = mixtral_state_to_moe(dict(hf.state_dict()))
    del hf
    moe_config.dtype = dtype
    # The zoo's loader: every weight of the model must come from `state` and every tensor of `state` find
    # a place, else one error naming them (models/common/causal_lm.py).
    return ZooMoeForCausalLM.from_pretrained(None, config=moe_config, state_dict=state, dtype=dtype)


mixtral_summary = config_summary(
    "num_local_experts", "num_experts_per_tok", "num_hidden_layers", "router_aux_loss_coef", "router_aux_loss_style"
)


MIXTRAL_TO_MOE = Converter(name="mixtral_to_moe", source="mixtral", source_types=MIXTRAL_TYPES,
                           source_title="Mixtral", target="moe", target_title="MoE", convert=mixtral_to_moe,
                           options=MIXTRAL_OPTIONS, check=check_mixtral_to_moe, summary=mixtral_summary)  # fmt: skip
# Registered here (models/__init__.py imports this module for LLAMA_TO_MOE), beside its definition.
register_converter(MIXTRAL_TO_MOE)
