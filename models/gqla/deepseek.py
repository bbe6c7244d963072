"""DeepSeek-V2 / V3 checkpoints (MLA) into the zoo's `gqla`: `converter=deepseek_to_gqla`.

DeepSeek's multi-head latent attention is GQLA with one group per head: the latent c = RMSNorm(W_DKV x), one
decoupled RoPE key shared by every head, and per-head up-projections packed in `kv_b_proj`. The conversion
renames and reshapes, nothing is approximated (tests/test_deepseek.py: float64 logits of transformers'
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM within 1e-6 relative; their RMSNorms and V2's complex RoPE
compute in fp32 whatever the dtype, so not fp64 rounding):

    DeepSeek (per layer, model.layers.i.)          zoo gqla (num_kv_groups = num_attention_heads)
    self_attn.q_proj                               self_attn.q_proj (q_lora_rank null, as V2-Lite)
    self_attn.q_a_proj, q_a_layernorm, q_b_proj    the same names (q_lora_rank set, as V2 / V3)
    self_attn.kv_a_proj_with_mqa [d_c + d_r, d]    self_attn.kv_a_proj (rows :d_c), k_rope_proj (rows d_c:)
    self_attn.kv_a_layernorm                       self_attn.kv_a_layernorm (kv_a_layernorm=True)
    self_attn.kv_b_proj [H (d_nope + d_v), d_c]    self_attn.k_up [H, d_nope, d_c], v_up [H, d_v, d_c]
    self_attn.o_proj, mlp.*, norms, embeddings, lm_head: unchanged.

RoPE: the zoo pairs dim i with i + d_r/2 (rotate-half); DeepSeek-V2 always, and V3 with `rope_interleave`
(its default), pairs 2i with 2i + 1. The RoPE rows of the queries and of the shared key are reordered
[0, 2, 4, ..., 1, 3, 5, ...]: pair i keeps its frequency, and q . k is unchanged by one permutation applied
to both. Refused, each by name: MoE layers (the zoo's gqla has Llama's dense MLP: only a checkpoint whose
`first_k_dense_replace` >= `num_hidden_layers`, every layer dense, converts), RoPE other than 'default'
(YaRN's mscale changes the softmax scale), attention biases, a non-SiLU MLP, attention dropout, and a
`rms_norm_eps` other than 1e-6 (DeepSeek's latent norms q_a_layernorm / kv_a_layernorm always use 1e-6, the
zoo's use rms_norm_eps). DeepSeek-V3's multi-token-prediction layers are not part of transformers' model
(it drops them on load) and are not converted.

Option `num_kv_groups` (default: one per head, exact): regroup the converted model to fewer groups for TP on
the gqa path (models/gqla/regroup.py, TransGQLA-style, lossy), calibrated on train.convert's batches.
"""

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from models.gqla.configuration import ZooGQLAConfig
from models.gqla.modeling import ZooGQLAForCausalLM
from models.registry import Converter, config_summary, register_converter
from models.weight_map import Rule, check_mapped, map_weights

DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
DEEPSEEK_OPTIONS = ("num_kv_groups", "calibration_batches")
DEFAULT_CALIBRATION_BATCHES = 8
# A layer's attention weights, in both models (models/weight_map.py names; the rest keeps its name both ways).
ATTENTION = "model.layers.{layer}.self_attn."
# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) are built with this eps whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6
# DeepSeek config field -> zoo gqla field, carried as they are.
CARRIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


def interleaved(config) -> bool:
    """Whether the checkpoint's RoPE pairs dims (2i, 2i + 1): always in V2, `rope_interleave` in V3."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


def rope_order(d_r: int) -> torch.Tensor:
    """Interleaved RoPE rows -> rotate-half order: [0, 2, 4, ..., 1, 3, 5, ...] (pair i = (i, i + d_r/2))."""
    return torch.cat([torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)])


def check_deepseek_config(config) -> None:
    """One clear error for a DeepSeek config the zoo's gqla does not compute (module docstring)."""
    if config.model_type not in DEEPSEEK_TYPES:
        raise ValueError(
            f"deepseek_to_gqla reads DeepSeek-V2 / V3 checkpoints (model_type {' or '.join(DEEPSEEK_TYPES)}), not "
            f"model_type={config.model_type!r}."
        )
    layers, dense = config.num_hidden_layers, config.first_k_dense_replace
    if dense is None or dense < layers:
        moe = f"layers {dense or 0}..{layers - 1}"
        raise ValueError(
            f"first_k_dense_replace={dense} with num_hidden_layers={layers}: {moe} are DeepSeekMoE layers "
            f"(n_routed_experts={config.n_routed_experts}, n_shared_experts={config.n_shared_experts}), and the "
            "zoo's gqla has a dense Llama MLP in every layer; only a checkpoint whose layers are all dense "
            f"(first_k_dense_replace >= num_hidden_layers = {layers}) converts."
        )
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters rope_type={rope.get('rope_type')!r}: the zoo's gqla computes rope_type='default' "
            "only (YaRN rescales the frequencies and, with mscale, DeepSeek's softmax scale); convert a checkpoint "
            "with default RoPE."
        )
    if config.attention_bias:
        raise ValueError(
            "attention_bias=True: DeepSeek then biases kv_a_proj_with_mqa, q_a_proj and o_proj but not q_proj / "
            "q_b_proj / kv_b_proj, which the zoo's gqla (a bias on every projection or none) does not express."
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: the zoo's MLP is SwiGLU (hidden_act='silu').")
    if config.attention_dropout:
        raise ValueError(f"attention_dropout={config.attention_dropout}: the zoo's gqla has no attention dropout.")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True: DeepSeek's MLP has no biases; this config is not DeepSeek's.")
    if config.rms_norm_eps != LATENT_NORM_EPS:
        raise ValueError(
            f"rms_norm_eps={config.rms_norm_eps}: DeepSeek's latent norms (kv_a_layernorm, q_a_layernorm) use "
            f"eps {LATENT_NORM_EPS} whatever rms_norm_eps is, the zoo's use rms_norm_eps, so the two agree only "
            f"at rms_norm_eps={LATENT_NORM_EPS} (every released DeepSeek-V2 / V3 config)."
        )
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} differs from num_attention_heads="
            f"{config.num_attention_heads}: DeepSeek's MLA expands one key and value per head (kv_b_proj)."
        )


def gqla_config(config) -> ZooGQLAConfig:
    """The zoo gqla config of a DeepSeek config: one group per head, the latent norm, the absorb path."""
    check_deepseek_config(config)
    fields = {name: getattr(config, name) for name in CARRIED}
    return ZooGQLAConfig(
        **fields,
        num_key_value_heads=config.num_attention_heads,  # = num_kv_groups: one group per head
        head_dim=config.qk_rope_head_dim,  # as DeepSeek's config sets it; the widths above are explicit
        rope_parameters=dict(config.rope_parameters),
        kv_a_layernorm=True,
        attn_path="absorb",
        dtype=config.dtype,
    )


def deepseek_state_to_gqla(state: dict[str, torch.Tensor], source_config, config: ZooGQLAConfig) -> dict:
    """DeepSeek's weights under the zoo gqla's names and shapes (module docstring's table)."""
    H, d_c, d_r = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    d_nope, d_v = config.qk_nope_head_dim, config.v_head_dim
    order = rope_order(d_r) if interleaved(source_config) else torch.arange(d_r)
    # Per head [nope ; rope] rows of the query: reorder the rope rows of every head.
    q_rows = torch.cat([torch.arange(d_nope), d_nope + order])
    q_rows = (torch.arange(H)[:, None] * (d_nope + d_r) + q_rows).reshape(-1)

    def split_kv(kv_b):  # [H (d_nope + d_v), d_c] -> per head k_up [H, d_nope, d_c], v_up [H, d_v, d_c]
        kv = kv_b.reshape(H, d_nope + d_v, d_c)
        return kv[:, :d_nope].contiguous(), kv[:, d_nope:].contiguous()

    a = ATTENTION
    # q_a_proj, q_a_layernorm, kv_a_layernorm, o_proj, embeddings, norms, MLP, lm_head: the same names and shapes.
    rules = [
        Rule(a + "{q:q_proj|q_b_proj}.weight", a + "{q}.weight", lambda q: q[q_rows]),
        Rule(
            a + "kv_a_proj_with_mqa.weight",
            (a + "kv_a_proj.weight", a + "k_rope_proj.weight"),
            lambda kv_a: (kv_a[:d_c], kv_a[d_c:][order]),
        ),
        Rule(a + "kv_b_proj.weight", (a + "k_up", a + "v_up"), split_kv),
    ]
    return map_weights(state, rules)


@torch.no_grad()
def convert_deepseek(source_model) -> ZooGQLAForCausalLM:
    """A loaded DeepseekV2ForCausalLM / DeepseekV3ForCausalLM as the zoo gqla computing its function."""
    config = gqla_config(source_model.config)
    state = deepseek_state_to_gqla(source_model.state_dict(), source_model.config, config)
    target = ZooGQLAForCausalLM(config).to(source_model.dtype)
    check_mapped(state, target.state_dict(), "DeepSeek -> gqla")
    target.load_state_dict(state)
    if getattr(source_model, "generation_config", None) is not None:
        target.generation_config = source_model.generation_config
    return target.eval()


def load_deepseek(source: str | Path):
    """The DeepSeek checkpoint at `source` (a directory or hub id) in transformers' own class, in its dtype,
    after its config has been checked (nothing is loaded for a checkpoint that would be refused)."""
    check_deepseek_config(AutoConfig.from_pretrained(str(source)))
    return AutoModelForCausalLM.from_pretrained(str(source), dtype="auto")


def deepseek_to_gqla(
    source: str | Path,
    batches: list[torch.Tensor] | None = None,
    num_kv_groups: int | None = None,
    calibration_batches: int | None = None,
) -> ZooGQLAForCausalLM:
    """The DeepSeek-V2 / V3 checkpoint at `source` as a zoo gqla, exact at one group per head (the default);
    `num_kv_groups` < num_attention_heads regroups it (models/gqla/regroup.py), calibrated on `batches`."""
    check_options(source, num_kv_groups, calibration_batches)
    model = convert_deepseek(load_deepseek(source))
    if num_kv_groups is None or num_kv_groups == model.config.num_kv_groups:
        return model
    from models.gqla.regroup import attention_statistics, regroup

    if not batches:
        raise ValueError(f"num_kv_groups={num_kv_groups} regroups on calibration data: give batches of token ids.")
    return regroup(model, num_kv_groups, attention_statistics(model, batches))


def check_options(source, num_kv_groups=None, calibration_batches=None) -> None:
    """One clear error for a checkpoint or options that do not fit, from the config alone."""
    config = AutoConfig.from_pretrained(str(source)) if not isinstance(source, PreTrainedConfig) else source
    target = gqla_config(config)
    if calibration_batches is not None and (not isinstance(calibration_batches, int) or calibration_batches < 1):
        raise ValueError(f"calibration_batches={calibration_batches!r} must be a positive integer.")
    if num_kv_groups is not None:
        from models.gqla.regroup import check_groups

        check_groups(target, num_kv_groups)


summary = config_summary(
    "num_kv_groups", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"
)


DEEPSEEK_TO_GQLA = Converter(name="deepseek_to_gqla", source="deepseek", source_types=DEEPSEEK_TYPES,
                             source_title="DeepSeek-V2 / V3", target="gqla", target_title="GQLA",
                             convert=deepseek_to_gqla, options=DEEPSEEK_OPTIONS, check=check_options,
                             summary=summary, calibration=DEFAULT_CALIBRATION_BATCHES)  # fmt: skip
register_converter(DEEPSEEK_TO_GQLA)
