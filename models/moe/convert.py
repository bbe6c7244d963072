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
"""

import re
from pathlib import Path

import torch
from torch import nn

from models.llama.configuration import ZooLlamaConfig
from models.llama.modeling import ZooLlamaForCausalLM
from models.moe.configuration import ZooMoeConfig
from models.moe.modeling import ZooMoeForCausalLM
from models.registry import Converter

UPCYCLABLE = ("llama", "zoo_llama")
# The converter's options (train.convert reads them from its config; None there: the target config's
# default): how many experts, how many per token, which layers, the balance loss's weight.
MOE_OPTIONS = ("num_local_experts", "num_experts_per_tok", "moe_layer_freq", "router_aux_loss_coef")
# config.json fields that describe the source file, not the model: not carried into the target config.
NOT_COPIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")
MLP_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight")


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


def stack_expert(weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """One dense projection weight [out, in] copied into every expert slot: [E, out, in]."""
    return weight.unsqueeze(0).expand(num_experts, *weight.shape).clone()


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
    state, fresh = {}, set()
    for name, value in dense.state_dict().items():
        match = MLP_WEIGHT.fullmatch(name)
        if match and config.is_moe_layer(int(match[1])):
            state[f"model.layers.{match[1]}.mlp.experts.{match[2]}"] = stack_expert(value, config.num_local_experts)
        else:
            state[name] = value
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


def summary(model: ZooMoeForCausalLM) -> dict:
    c = model.config
    return {
        "num_local_experts": c.num_local_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_layer_freq": c.moe_layer_freq,
        "num_moe_layers": c.num_moe_layers,
        "num_hidden_layers": c.num_hidden_layers,
    }


LLAMA_TO_MOE = Converter(
    name="llama_to_moe",
    source="llama",
    source_types=UPCYCLABLE,
    source_title="Llama",
    target="moe",
    target_title="MoE",
    convert=llama_to_moe,
    options=MOE_OPTIONS,
    check=check_llama_to_moe,
    summary=summary,
)
