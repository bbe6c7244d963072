"""overlap-zoo models: `import models` registers every architecture; `models.ZOO[name]` gives its classes."""

from models.checkpoint import apply_special_tokens, code_writer, save_checkpoint
from models.common.pretrained import ZooPreTrainedModel
from models.common.residual import ladder_converter
from models.gqla import ZooGQLAConfig, ZooGQLAForCausalLM, ZooGQLAModel
from models.gqla.convert import LLAMA_TO_GQLA
from models.kraken import ZooKrakenConfig, ZooKrakenForCausalLM, ZooKrakenModel
from models.ladder import ZooLadderConfig, ZooLadderForCausalLM, ZooLadderModel
from models.ladder.convert import LLAMA_TO_LADDER
from models.linear import ZooLinearConfig, ZooLinearForCausalLM, ZooLinearModel
from models.linear import entry as linear_entry
from models.llama import ZooLlamaConfig, ZooLlamaForCausalLM, ZooLlamaModel
from models.moe import ZooMoeConfig, ZooMoeForCausalLM, ZooMoeModel
from models.moe.convert import LLAMA_TO_MOE
from models.moepp import ZooMoeppConfig, ZooMoeppForCausalLM, ZooMoeppModel
from models.parallel_block import ZooParallelConfig, ZooParallelForCausalLM, ZooParallelModel
from models.registry import (
    CONVERTERS,
    ZOO,
    Collectives,
    Converter,
    ZooEntry,
    build_config,
    build_model,
    get,
    get_converter,
    register,
    register_converter,
    schedule_of,
    standard_sibling,
    variants,
)
from models.scmoe import ZooScMoeConfig, ZooScMoeForCausalLM, ZooScMoeModel
from models.scmoe.convert import LLAMA_TO_SCMOE

# model.save_pretrained(dir) writes the model's code beside its weights, as save_checkpoint does.
ZooPreTrainedModel.code_writer = staticmethod(code_writer)

# Shapes shared by every tiny model, so tiny instances of different architectures compare fairly.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Each architecture's facts for shared code come from its own folder (sharding.py, entry.py), read by
# `register` (models/registry.py `folder_hooks`).
register(
    "llama",
    ZooLlamaConfig,
    ZooLlamaForCausalLM,
    ZooLlamaModel,
    tiny_config=TINY_LLAMA,
)
register(
    "parallel",
    ZooParallelConfig,
    ZooParallelForCausalLM,
    ZooParallelModel,
    tiny_config=TINY_LLAMA,
)
# Tiny ladder: the paper's hybrid, the upper half of the layers laddered.
register(
    "ladder",
    ZooLadderConfig,
    ZooLadderForCausalLM,
    ZooLadderModel,
    tiny_config={**TINY_LLAMA, "ladder_layers": 2},
)
# Tiny Kraken: two streams, each of the tiny llama's layer shapes (so TP 2 fits; `tiny_at({"tp": P})` has P).
register(
    "kraken",
    ZooKrakenConfig,
    ZooKrakenForCausalLM,
    ZooKrakenModel,
    tiny_config={**TINY_LLAMA, "kraken_degree": 2},
)
# Tiny MoE: 4 experts of the tiny llama's MLP width, top-2, in every other layer (GShard / Switch, and the
# dense + MoE pairs ScMoE compares against).
register(
    "moe",
    ZooMoeConfig,
    ZooMoeForCausalLM,
    ZooMoeModel,
    tiny_config={**TINY_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_layer_freq": 2},
)

# Tiny ScMoE: two (dense, MoE) pairs (Position 2), 4 routed experts top-1 plus a shared expert, each of the
# tiny llama's MLP width (the compute per token of the tiny moe's top-2).
register(
    "scmoe",
    ZooScMoeConfig,
    ZooScMoeForCausalLM,
    ZooScMoeModel,
    tiny_config={**TINY_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 1},
)
# Tiny MoE++: every layer 4 FFN experts (the tiny moe's) + 1 zero, 1 copy and 2 constant experts, top-2.
register(
    "moepp",
    ZooMoeppConfig,
    ZooMoeppForCausalLM,
    ZooMoeppModel,
    tiny_config={
        **TINY_LLAMA,
        "num_local_experts": 4,
        "num_zero_experts": 1,
        "num_copy_experts": 1,
        "num_constant_experts": 2,
        "num_experts_per_tok": 2,
    },
)

# Tiny Linear-Llama: linear attention in every layer (no decay), and the LASP-2 paper's hybrid, one softmax
# layer in four ("LLLN"), with Lightning Attention's decay: the same classes, two registry entries.
register(
    "linear",
    ZooLinearConfig,
    ZooLinearForCausalLM,
    ZooLinearModel,
    tiny_config=TINY_LLAMA,
)
register(
    "linear_hybrid",
    ZooLinearConfig,
    ZooLinearForCausalLM,
    ZooLinearModel,
    tiny_config={**TINY_LLAMA, "layer_pattern": linear_entry.HYBRID_PATTERN, "decay": "lightning"},
    bench_config=linear_entry.hybrid_bench_config,  # the folder's own is the pure linear model's
)

# Tiny GQLA: the tiny llama's 4 heads in its 2 KV groups (n_g is num_key_value_heads), query heads of 8 + 8
# RoPE dims, values of 16, a latent of 32 (full rank: min(64, 2 x (8 + 16)) = 48); the absorb path by default,
# the gqa path at TP > 1 (fit_degrees).
register(
    "gqla",
    ZooGQLAConfig,
    ZooGQLAForCausalLM,
    ZooGQLAModel,
    tiny_config={
        **TINY_LLAMA,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "attn_path": "absorb",
    },
)

register_converter(LLAMA_TO_LADDER)
# Sparse upcycling: a dense Llama's MLPs copied into every expert.
register_converter(LLAMA_TO_MOE)
register_converter(LLAMA_TO_SCMOE)
# TransGQLA: RoRoPE + joint low-rank [K_nope, V] of a GQA Llama (models/gqla/convert.py).
register_converter(LLAMA_TO_GQLA)
# The ladder residual schedule on a trained checkpoint of each architecture that takes it (<name>_to_ladder, the
# same weights; models/common/residual.py); one per config class (linear and linear_hybrid share theirs).
_laddered = {}  # config class -> the first entry of it
for _entry in ZOO.values():
    if "ladder" in _entry.residuals:
        _laddered.setdefault(_entry.config_class, _entry)
for _entry in _laddered.values():
    register_converter(ladder_converter(_entry.name, _entry.model_class))
# Out to stock transformers classes (llama -> LlamaForCausalLM, moe -> MixtralForCausalLM, gqla at one group per
# head -> DeepseekV3ForCausalLM): `models.export_stock(model, out_dir)`, `converter=export_stock` (registers itself).
from models.stock_export import EXPORT_STOCK, export_stock, to_stock  # noqa: E402

__all__ = [
    "CONVERTERS",
    "TINY_LLAMA",
    "ZOO",
    "Collectives",
    "Converter",
    "EXPORT_STOCK",
    "ZooEntry",
    "apply_special_tokens",
    "build_config",
    "build_model",
    "export_stock",
    "get",
    "get_converter",
    "register",
    "register_converter",
    "save_checkpoint",
    "schedule_of",
    "to_stock",
    "standard_sibling",
    "variants",
]
