"""Parallel attention + MLP block (GPT-J, PaLM): x = x + Attn(LN(x)) + MLP(LN(x))."""

from torch import nn

from models.common import Attention, RMSNorm, SwiGLUMLP, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.decoder import Split, add_pending, gathered_attention
from models.parallel_block.configuration import ZooParallelConfig
from models.parallel_block.sharding import PLAN
from parallel import comm
from parallel.collective_matmul import all_gather_linears, linear_reduce_scatter, sequence_norm


class ParallelDecoderLayer(nn.Module):
    # The layer's one sub-block, a unit of activation checkpointing where the trunk calls it directly (a split
    # forward, `split_layer`) as well as inside `forward`.
    checkpoint_methods = ("parallel_block",)

    def __init__(self, config: ZooParallelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention.from_config(config, layer_idx)
        self.mlp = SwiGLUMLP.from_config(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tp_group = None

    def parallel_block(self, hidden_states, position_embeddings, attention_mask, cache):
        """Attn(LN(x)) + MLP(LN(x)): under TP a partial, un-reduced sum."""
        h = self.input_layernorm(hidden_states)
        return self.self_attn(h, position_embeddings, attention_mask, cache) + self.mlp(h)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache, sequence_sharded=False):
        if sequence_sharded:
            return self.sequence_sharded_forward(hidden_states, position_embeddings, attention_mask, cache)
        partial = self.parallel_block(hidden_states, position_embeddings, attention_mask, cache)
        return hidden_states + comm.all_reduce(partial, self.tp_group).wait()

    def split_layer(self, x0, x1, carried, split: Split):
        """The block over the two halves of a split forward, in turn (models.common.decoder.run_split): the previous
        layer's half 1 all-reduce (`carried`) runs behind half 0's block, half 0's behind half 1's; half 1's is
        returned in flight, for the next layer."""
        (pos0, mask0, cache0), (pos1, mask1, cache1) = split.halves
        out0 = comm.all_reduce(self.parallel_block(x0, pos0, mask0, cache0), self.tp_group)
        x1 = add_pending(x1, carried)
        out1 = comm.all_reduce(self.parallel_block(x1, pos1, mask1, cache1), self.tp_group)
        return x0 + out0.wait(), x1, out1


    def sequence_sharded_forward(self, x, position_embeddings, attention_mask, cache):
        """The block on this rank's chunk `x` of the sequence (the collective_matmul schedule,
        models.common.decoder.run_sequence_sharded): the normed chunks gathered once inside the attention's and the
        MLP's column-parallel linears, the two row-parallel outputs summed into one reduce-scatter, ring step by ring
        step behind the chunks' matmuls (parallel/collective_matmul.py)."""
        group, attn, mlp = self.tp_group, self.self_attn, self.mlp
        h = sequence_norm(self.input_layernorm, x, group)
        q, k, v, gate, up = all_gather_linears(h, [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj], group)
        out = gathered_attention(attn, q, k, v, position_embeddings, attention_mask, cache)
        act = nn.functional.silu(gate) * up
        return x + linear_reduce_scatter([(out, attn.o_proj), (act, mlp.down_proj)], group)


class ZooParallelPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooParallelConfig
    config: ZooParallelConfig
    _no_split_modules = ["ParallelDecoderLayer"]


class ZooParallelModel(ZooParallelPreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return ParallelDecoderLayer(config, layer_idx)


class ZooParallelForCausalLM(ZooParallelPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooParallelModel
    overlap_schedules = ("token_split", "seq_split", "collective_matmul")  # parallel/overlap.py
    shard_plan = PLAN
