"""Export a zoo `gqla` at one group per head to transformers' stock `DeepseekV3ForCausalLM`.

    to_deepseek(model)                               # the stock model in memory, in the model's dtype
    export_deepseek(model, out_dir, tokenizer=None)  # writes out_dir (save_pretrained), returns it

At one group per head (num_kv_groups = num_attention_heads) with the latent norm (kv_a_layernorm=True) the
zoo's gqla is DeepSeek's MLA, so the checkpoint loads with `AutoModelForCausalLM.from_pretrained(out_dir)` in
plain transformers (model_type deepseek_v3, no trust_remote_code). The mapping is models/gqla/deepseek.py's,
inverted: `kv_a_proj` and `k_rope_proj` stacked into `kv_a_proj_with_mqa`, `k_up` / `v_up` interleaved per
head into `kv_b_proj`, everything else by name. The config is written with `rope_interleave=False` (the
zoo's rotate-half pairing, which DeepseekV3 computes too), so no row is reordered, and with
`first_k_dense_replace = num_hidden_layers`: every layer is DeepSeek's dense MLP (the MoE fields are then
unused). V3, not V2: DeepseekV2 always interleaves.

Refused, by name: fewer groups than heads (DeepSeek's kv_b_proj has one key / value per head: regrouped
models have no stock class), no latent norm (DeepSeek always norms c), attention biases (DeepSeek's layout of
them differs), an MLP bias, a RoPE type other than 'default' (the zoo's YaRN is not DeepSeek's mscale'd one),
and rms_norm_eps other than 1e-6 (DeepSeek's latent norms use 1e-6 whatever rms_norm_eps says).
Round trip (tests/test_deepseek.py, float64): DeepseekV3's logits equal the zoo's within 1e-6 relative (its
RMSNorms compute in fp32); deepseek_to_gqla of the export gives back the zoo model's weights exactly.
"""

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from models.gqla.deepseek import ATTENTION, CARRIED, LATENT_NORM_EPS
from models.weight_map import Rule, concat, load_mapped, map_weights

# zoo gqla field -> DeepseekV3Config field, carried as they are: the same fields as the import's (both ways).


def check_exportable(config) -> None:
    """One clear error for a zoo gqla config DeepseekV3ForCausalLM does not compute (module docstring)."""
    if getattr(config, "model_type", None) != "zoo_gqla":
        raise ValueError(
            f"export_deepseek takes a zoo gqla model, not model_type={getattr(config, 'model_type', None)!r}."
        )
    if getattr(config, "residual", "standard") != "standard":
        raise ValueError(
            f"residual={config.residual!r}: DeepSeek's layers add each sub-block's output at once; only a gqla "
            "with the standard residual schedule exports."
        )
    H, groups = config.num_attention_heads, config.num_kv_groups
    if groups != H:
        raise ValueError(
            f"num_kv_groups={groups} with num_attention_heads={H}: DeepSeek's MLA has one group per head "
            f"(kv_b_proj expands a key and a value for every head); only a gqla at num_kv_groups={H} exports."
        )
    if not config.kv_a_layernorm:
        raise ValueError(
            "kv_a_layernorm=False: DeepSeek always RMSNorms the latent (kv_a_layernorm), so this gqla has no "
            "DeepSeek equivalent; export one trained with kv_a_layernorm=True."
        )
    if config.attention_bias:
        raise ValueError(
            "attention_bias=True: the zoo biases every attention projection, DeepSeek only kv_a_proj_with_mqa, "
            "q_a_proj and o_proj; no DeepSeek config computes it."
        )
    if config.mlp_bias:
        raise ValueError("mlp_bias=True: DeepSeek's MLP has no biases.")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters rope_type={rope_type!r}: export_deepseek writes rope_type='default' only (DeepSeek's "
            "YaRN also rescales the softmax, which the zoo does not)."
        )
    if config.rms_norm_eps != LATENT_NORM_EPS:
        raise ValueError(
            f"rms_norm_eps={config.rms_norm_eps}: DeepSeek's latent norms use eps {LATENT_NORM_EPS} whatever "
            f"rms_norm_eps is, the zoo's use rms_norm_eps; they agree only at {LATENT_NORM_EPS}."
        )


def deepseek_config(config) -> DeepseekV3Config:
    """The DeepseekV3Config computing the zoo gqla `config`'s function (every layer dense, rotate-half RoPE)."""
    check_exportable(config)
    return DeepseekV3Config(
        **{name: getattr(config, name) for name in CARRIED},
        num_key_value_heads=config.num_attention_heads,
        first_k_dense_replace=config.num_hidden_layers,  # every layer DeepSeek's dense MLP
        rope_parameters=dict(config.rope_parameters),
        rope_interleave=False,  # the zoo's rotate-half pairing
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
    )


def gqla_state_to_deepseek(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The zoo gqla's weights under DeepseekV3's names and shapes (models/gqla/deepseek.py's table, inverted)."""
    d_c, a = config.kv_lora_rank, ATTENTION
    # q_proj, q_a_proj, q_a_layernorm, q_b_proj, kv_a_layernorm, o_proj and the rest: the same names and shapes.
    rules = [
        Rule((a + "kv_a_proj.weight", a + "k_rope_proj.weight"), a + "kv_a_proj_with_mqa.weight", concat()),
        # [H, d_nope + d_v, d_c]: per head [k ; v], rows interleaved per head
        Rule((a + "k_up", a + "v_up"), a + "kv_b_proj.weight", lambda k, v: torch.cat([k, v], dim=1).reshape(-1, d_c)),
    ]
    return map_weights(state, rules)


@torch.no_grad()
def to_deepseek(model) -> DeepseekV3ForCausalLM:
    """The stock DeepseekV3ForCausalLM computing what the zoo gqla `model` computes, in its dtype."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "lm_head"):
        raise TypeError(f"export_deepseek takes a zoo gqla ...ForCausalLM (with its LM head), not {type(model).__name__}.")
    stock_config = deepseek_config(config)
    stock_config.dtype = model.dtype
    state = gqla_state_to_deepseek({k: v.detach() for k, v in model.state_dict().items()}, config)
    stock = load_mapped(
        DeepseekV3ForCausalLM, stock_config, state, model.dtype, "Exporting gqla to DeepseekV3ForCausalLM"
    )
    if getattr(model, "generation_config", None) is not None:
        stock.generation_config = model.generation_config
    return stock.to(model.device).eval()


def export_deepseek(model, out_dir: str | Path, tokenizer=None) -> Path:
    """Write the zoo gqla `model` (one group per head) as a DeepseekV3ForCausalLM checkpoint to `out_dir` (and
    `tokenizer` beside it): it loads with plain `AutoModelForCausalLM.from_pretrained(out_dir)`. Returns it."""
    out_dir = Path(out_dir)
    to_deepseek(model).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
