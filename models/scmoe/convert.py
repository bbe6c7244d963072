"""Dense Llama -> ScMoE by sparse upcycling (as `models/moe/convert.py`, for ScMoE's blocks).

Position 2 (default): layers 0, 2, ... stay dense blocks, copied unchanged; layers 1, 3, ... become MoE
blocks. Position 1 (`shortcut_position=1`): every layer becomes an MoE block. In an MoE block i:

- attention, `input_layernorm`, `post_attention_layernorm`: layer i's, copied;
- `shared_expert`: layer i's dense MLP, copied. It reads what that MLP read, N2_i(h) of the block's own
  post-attention stream, so it carries on the dense layer's work;
- every routed expert (`mlp.experts`): layer i's dense MLP too (sparse upcycling), and
  `shortcut_layernorm` (the routed experts' own pre-norm): layer i's `post_attention_layernorm`, the norm
  that MLP was trained behind;
- the router and the shared expert's gate W_cg are fresh: the router from the model's init, W_cg ZERO, so
  that g = sigmoid(W_cg s) = 1/2 for every token at the start (a deterministic split that W_cg then learns).

The result is NOT the dense model's function, unlike the upcycled `moe`. A dense block adds MLP_i(N2_i(h));
the upcycled MoE block adds 1/2 MLP_i(N2_i(h)) + p(r) MLP_i(Ns_i(r)), where the routed experts read the
shortcut r (the PRECEDING block's post-attention stream h1 at Position 2, the layer's input at Position
1), not h, and their top-1 gate p(r) is the softmax probability of the chosen expert (not renormalised,
so about 1/E at first). No choice of the fresh weights makes the two equal for every input; the
conversion report measures the jump (validation loss right after conversion) and how far short
retraining recovers it.

`LLAMA_TO_SCMOE` is the converter `train.convert` runs:
`python -m train.convert converter=llama_to_scmoe source=DIR num_local_experts=4`.
"""

from pathlib import Path

from models.llama.modeling import ZooLlamaForCausalLM
from models.moe.convert import MLP_WEIGHT, UPCYCLABLE, load_upcycled, moe_layer, target_config
from models.registry import config_summary, from_llama
from models.scmoe.configuration import ZooScMoeConfig
from models.scmoe.modeling import ZooScMoeForCausalLM
from models.weight_map import Rule, map_weights, stack_copies

# The converter's options (None in train.convert's config: the ScMoE config's default). The shared
# expert's width is the dense MLP's (it is a copy of it), so it is not an option.
SCMOE_OPTIONS = ("num_local_experts", "num_experts_per_tok", "shortcut_position", "router_aux_loss_coef")
POST_ATTENTION_NORM = "model.layers.{layer}.post_attention_layernorm.weight"


def scmoe_config(source: str | Path, options: dict) -> ZooScMoeConfig:
    config = target_config(ZooScMoeConfig, source, options, "scmoe")
    if config.shared_expert_intermediate_size != config.intermediate_size:  # cannot happen from a Llama config
        raise ValueError("Upcycling copies the dense MLP into the shared expert: its width must be intermediate_size.")
    return config


def upcycle_to_scmoe(dense: ZooLlamaForCausalLM, config: ZooScMoeConfig) -> ZooScMoeForCausalLM:
    """An `scmoe` model of `config` (the dense model's shapes) upcycled from `dense` (module doc)."""
    model = ZooScMoeForCausalLM(config).to(dense.dtype)
    moe, stack = moe_layer(config), stack_copies(config.num_local_experts)
    rules = [
        # The dense MLP into the shared expert and, copied, into every routed expert.
        Rule(
            MLP_WEIGHT,
            ("model.layers.{layer}.shared_expert.{proj}.weight", "model.layers.{layer}.mlp.experts.{proj}"),
            lambda weight: (weight, stack(weight)),
            moe,
        ),
        # The post-attention norm kept as the block's own and copied as the routed experts' pre-norm.
        Rule(
            POST_ATTENTION_NORM,
            (POST_ATTENTION_NORM, "model.layers.{layer}.shortcut_layernorm.weight"),
            lambda weight: (weight, weight),
            moe,
        ),
    ]
    state, fresh = map_weights(dense.state_dict(), rules), set()
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            model.model.layers[i].shared_expert_gate.weight.data.zero_()  # g = 1/2 at the start
            fresh |= {f"model.layers.{i}.shared_expert_gate.weight"}
            fresh |= {n for n in model.state_dict() if n.startswith(f"model.layers.{i}.mlp.router.")}
    return load_upcycled(model, state, fresh)


def check_llama_to_scmoe(source: str | Path, **options) -> None:
    """Every check of the conversion from the checkpoint's config.json alone: nothing is loaded."""
    scmoe_config(source, options)


def llama_to_scmoe(source: str | Path, **options) -> ZooScMoeForCausalLM:
    """Load a dense Llama checkpoint directory as an upcycled `scmoe` model; `options`: `SCMOE_OPTIONS`."""
    config = scmoe_config(source, options)
    return upcycle_to_scmoe(ZooLlamaForCausalLM.from_pretrained(source), config)


summary = config_summary(
    "num_local_experts", "num_experts_per_tok", "shortcut_position", "num_moe_layers", "num_hidden_layers"
)


LLAMA_TO_SCMOE = from_llama("scmoe", "ScMoE", llama_to_scmoe, summary, check=check_llama_to_scmoe,
                            options=SCMOE_OPTIONS, source_types=UPCYCLABLE)
