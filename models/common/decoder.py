"""The standard pre-norm decoder block: x = x + Attn(LN1(x)); x = x + MLP(LN2(x)).

Llama's layer, shared by every architecture built from it (Llama itself, Ladder's rewired stream,
Kraken's streams, the MoE layers of `moe` and `moepp`, whose experts take the MLP's place). Parameter
names are Hugging Face Llama's (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`,
`post_attention_layernorm`), so HF Llama checkpoints load unchanged.

`PreNormAttention` is its attention sub-block alone, for a block that is laid out otherwise around it
(ScMoE's MoE block).
"""

from torch import nn

from models.common.attention import Attention
from models.common.mlp import SwiGLUMLP
from models.common.norm import RMSNorm
from parallel import comm


class PreNormAttention:
    """x -> Attn(LN1(x)) (under TP a partial, un-reduced sum) for a module with `self_attn` and
    `input_layernorm`."""

    def attention_block(self, hidden_states, position_embeddings, attention_mask, cache):
        return self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)


class PreNormDecoderLayer(PreNormAttention, nn.Module):
    """Attention then SwiGLU MLP, each pre-normed and added to the residual stream.

    Under tensor parallelism (Megatron col/row) each sub-block returns a partial sum; `forward`
    all-reduces it at once, since the next sub-block reads it. Architectures that wait elsewhere call
    `attention_block` / `mlp_block` themselves and keep the weights and names. An architecture whose
    feed-forward is something else (experts) returns it from `make_mlp`: it takes the MLP's place, name
    and order among the layer's modules.
    """

    # Whether the layer takes a value from the previous layer and passes one on (models/common/residual.py).
    passes_down = False

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention.from_config(config, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tp_group = None  # set by parallel.parallelize; None = single device

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The layer's feed-forward, `mlp`: Llama's SwiGLU."""
        return SwiGLUMLP.from_config(config)

    # The two sub-blocks, each returning its (under TP: partial, un-reduced) output; `attention_block`
    # is PreNormAttention's.
    def mlp_block(self, hidden_states):
        return self.mlp(self.post_attention_layernorm(hidden_states))

    def mlp_in_flight(self, hidden_states):
        """The MLP sub-block with its all-reduce still in flight, for a schedule that waits it later (the ladder
        residual schedule, models/common/residual.py): (pending, aux), `pending.wait()` the output to add."""
        return comm.all_reduce(self.mlp_block(hidden_states), self.tp_group), {}

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        # Standard block: the next sub-block reads this output, so the all-reduce is waited at once.
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        mlp_out = self.mlp_block(hidden_states)
        return hidden_states + comm.all_reduce(mlp_out, self.tp_group).wait()
