"""Export zoo models to stock transformers classes: a checkpoint that loads in any stack that knows the class,
with no zoo code and no trust_remote_code.

    export_stock(model, out_dir, tokenizer=None)     # writes out_dir, returns it
    to_stock(model)                                  # the stock model in memory
    python -m train.convert converter=export_stock source=<zoo checkpoint dir>

Where a stock class computes the zoo model's function:

- zoo `llama` -> `LlamaForCausalLM`: the zoo llama IS transformers' Llama (its config a `LlamaConfig`, its
  weights Llama's names), so the config is copied with Llama's model_type and the weights as they are.
  `hidden_act` and `attention_dropout` are written as what the zoo computes (SiLU, no dropout): the zoo's
  layers read neither field.
- zoo `moe` -> `MixtralForCausalLM`, where the config is Mixtral's: every layer an MoE layer
  (moe_layer_freq=1), softmax routing (router_score_func="softmax"), no balance bias
  (router_balance_bias=False), dropless (capacity_factor=None, and no dispatch_capacity_factor), no attention
  biases. Anything else is refused, naming the field. The router's `mlp.router.gate.weight` becomes
  Mixtral's `mlp.gate.weight`, the experts' `gate_proj` / `up_proj` are concatenated into `gate_up_proj`
  (gate rows first) and `down_proj` is copied; the class's own `save_pretrained` writes them in the hub's
  layout (`block_sparse_moe.experts.N.w1 / w2 / w3`). `router_aux_loss_coef` is carried; Mixtral computes
  only HF's balance loss (router_aux_loss_style="hf"; models/common/moe.py explains how it differs from the
  zoo's), which changes training only, not the function.
- zoo `gqla` at one group per head -> `DeepseekV3ForCausalLM`: models/gqla/stock.py's `to_deepseek` (its own
  refusals: fewer groups than heads, no latent norm, ...; tested in tests/test_deepseek.py).
- every other architecture is refused: Ladder, Kraken, the parallel block, linear attention, ScMoE and MoE++ compute functions no transformers
  class computes (they load with the zoo's remote code: `models.checkpoint.save_checkpoint`).

Exactness (tests/test_export_stock.py, float64): every weight bit for bit; the stock model's logits within
1e-6 of the zoo's, relative (measured ~1e-7), not fp64 rounding, because the stock classes' RMSNorm casts to
fp32 whatever the model's dtype and their RoPE table is computed in fp32 arithmetic (the zoo's is fp64,
rounded: one ulp apart). With those two made fp64 in the loaded model, llama agrees to fp64 rounding and
Mixtral within 1e-7, because both routers score in fp32 (Mixtral rounds its fp64 logits, the zoo its fp64
inputs). The same experts chosen; greedy generation identical.
"""

import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel

from models.registry import Converter, register_converter
from models.weight_map import Rule, concat, load_mapped, map_weights

# config.json keys that describe the zoo file, not the model: not carried into the stock config.
NOT_CARRIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")
# The zoo moe's config fields that are implementation choices (same function either way): not carried.
MOE_IMPLEMENTATION = ("experts_impl", "moe_dispatch")
# Zoo moe field -> the value Mixtral computes; any other value is refused.
MIXTRAL_REQUIRES = {
    "moe_layer_freq": 1,
    "router_score_func": "softmax",
    "router_balance_bias": False,
    "capacity_factor": None,
    "dispatch_capacity_factor": None,
    "attention_bias": False,
    "residual": "standard",  # Mixtral adds each sub-block's output at once
    "ladder_layers": None,
}
ZOO_MOE_FIELDS = (
    *MIXTRAL_REQUIRES,
    *MOE_IMPLEMENTATION,
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "router_aux_loss_style",  # Mixtral computes transformers' balance loss ("hf") whatever the zoo used
    "mlp_bias",  # of the dense MLPs: none when every layer is an MoE layer
)
STOCK_CLASSES = {
    "zoo_llama": "LlamaForCausalLM",
    "zoo_moe": "MixtralForCausalLM",
    "zoo_gqla": "DeepseekV3ForCausalLM (one group per head)",
}


def _fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in NOT_CARRIED}


def _refuse_other(model_type: str) -> None:
    if model_type in STOCK_CLASSES:
        return
    why = (
        f"{model_type} computes a function no transformers class computes; save it with "
        "models.checkpoint.save_checkpoint, which writes its code beside the weights (trust_remote_code=True)"
    )
    raise ValueError(
        f"export_stock writes {', '.join(f'{k} -> {v}' for k, v in STOCK_CLASSES.items())}; a {model_type} model "
        f"cannot be exported: {why}."
    )


def llama_config(config) -> LlamaConfig:
    fields = _fields(config)
    fields.update(hidden_act="silu", attention_dropout=0.0)  # what the zoo computes (module docstring)
    return LlamaConfig(**fields)


def mixtral_config(config) -> MixtralConfig:
    """The MixtralConfig of a zoo moe config, refused (naming the field) where Mixtral computes otherwise."""
    wrong = {k: getattr(config, k) for k, v in MIXTRAL_REQUIRES.items() if getattr(config, k) != v}
    if wrong:
        given = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        needed = ", ".join(f"{k}={MIXTRAL_REQUIRES[k]!r}" for k in wrong)
        raise ValueError(
            f"This moe has {given}, which MixtralForCausalLM cannot compute (it needs {needed}: every layer an "
            "MoE layer, softmax routing, no balance bias, dropless, no attention bias, the standard residual schedule); it cannot be exported to "
            "a stock class: save it with models.checkpoint.save_checkpoint (remote code) instead."
        )
    # The Llama fields Mixtral shares (the zoo moe's others are checked above or implementation choices).
    mixtral_keys = set(MixtralConfig().to_dict())
    fields = {k: v for k, v in _fields(config).items() if k in mixtral_keys and k not in ZOO_MOE_FIELDS}
    fields.update(
        hidden_act="silu",
        attention_dropout=0.0,
        sliding_window=None,  # the zoo attends to every earlier token
        router_jitter_noise=0.0,
        num_local_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        router_aux_loss_coef=config.router_aux_loss_coef,
    )
    return MixtralConfig(**fields)


# The zoo moe's names -> transformers 5's Mixtral names (models/weight_map.py); the rest keeps its name.
MOE_MLP = "model.layers.{layer}.mlp."
ZOO_TO_MIXTRAL = (
    Rule(MOE_MLP + "router.gate.weight", MOE_MLP + "gate.weight"),
    # gate rows first, as MixtralExperts reads gate_up_proj
    Rule((MOE_MLP + "experts.gate_proj", MOE_MLP + "experts.up_proj"), MOE_MLP + "experts.gate_up_proj", concat(dim=1)),
)


def moe_state_to_mixtral(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The zoo moe's state dict in transformers 5's Mixtral names (module docstring)."""
    return map_weights(state, ZOO_TO_MIXTRAL)


def to_stock(model: PreTrainedModel) -> PreTrainedModel:
    """The stock transformers model computing what the zoo `model` computes (module docstring), in its dtype."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise TypeError(f"export_stock takes a zoo ...ForCausalLM model, not {type(model).__name__}.")
    _refuse_other(model_type)
    if not hasattr(model, "lm_head"):
        raise TypeError(f"export_stock takes a zoo ...ForCausalLM (with its LM head), not {type(model).__name__}.")
    if model_type == "zoo_gqla":
        from models.gqla.stock import to_deepseek  # the gqla folder's own mapping

        return to_deepseek(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model_type == "zoo_llama":
        stock_class, stock_config = LlamaForCausalLM, llama_config(config)
    else:
        stock_class, stock_config = MixtralForCausalLM, mixtral_config(config)
        state = moe_state_to_mixtral(state)
    stock_config.dtype = model.dtype
    # Generation settings (eos, pad, ...) as the zoo model's.
    what = f"Exporting {model_type} to {stock_class.__name__}"
    stock = load_mapped(stock_class, stock_config, state, model.dtype, what)
    if getattr(model, "generation_config", None) is not None:
        stock.generation_config = model.generation_config
    return stock.to(model.device)


def export_stock(model: PreTrainedModel, out_dir: str | Path, tokenizer=None) -> Path:
    """Write `model` (zoo llama, moe or gqla) as a stock-class checkpoint to `out_dir` (and `tokenizer` beside it):
    it loads with `AutoModelForCausalLM.from_pretrained(out_dir)` in plain transformers. Returns `out_dir`."""
    from models.checkpoint import drop_loading_options, share_files

    out_dir = Path(out_dir)
    started = time.time()
    stock = to_stock(model)
    stock.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    # as save_checkpoint does: weights readable by others under the umask, no loading options of this machine
    share_files(out_dir, since=started)
    drop_loading_options(out_dir)
    return out_dir


# --- train.convert: converter=export_stock ---------------------------------------------------------------

# Every zoo checkpoint type: the converter's own check gives the clear refusal for those it cannot export.
ZOO_TYPES = (
    "zoo_llama",
    "zoo_moe",
    "zoo_gqla",
    "zoo_ladder",
    "zoo_kraken",
    "zoo_parallel",
    "zoo_linear",
    "zoo_scmoe",
    "zoo_moepp",
)


def check_stock_config(config) -> None:
    """One clear error, from the config alone, for a zoo model `to_stock` would refuse."""
    _refuse_other(config.model_type)
    if config.model_type == "zoo_moe":
        mixtral_config(config)
    elif config.model_type == "zoo_gqla":
        from models.gqla.stock import check_exportable

        check_exportable(config)


def check_export_stock(source: str | Path) -> None:
    from transformers import AutoConfig, PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(str(source))
    _refuse_other(raw.get("model_type"))  # before building a config of an architecture that cannot export
    check_stock_config(AutoConfig.from_pretrained(str(source)))


def export_stock_converter(source: str | Path) -> PreTrainedModel:
    """The zoo checkpoint at `source` as its stock-class model (train.convert saves it)."""
    from transformers import AutoModelForCausalLM

    return to_stock(AutoModelForCausalLM.from_pretrained(str(source), dtype="auto"))


EXPORT_STOCK = Converter(name="export_stock", source="zoo", source_types=ZOO_TYPES,
                         source_title="zoo llama / moe / gqla", target="stock",
                         target_title="stock transformers class", convert=export_stock_converter,
                         check=check_export_stock, summary=lambda model: {"class": type(model).__name__})  # fmt: skip
register_converter(EXPORT_STOCK)
