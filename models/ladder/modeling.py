"""Ladder Residual Transformer.

Laddered layer i, in one-stream form (the spec's forward; `a_prev`, `m_prev` are handles of the
previous sub-blocks' all-reduces, still in flight):

    x = x + a_prev.wait();  a_prev = all_reduce_async(Attn_i(LN1_i(x)))
    x = x + m_prev.wait();  m_prev = all_reduce_async(MLP_i(LN2_i(x)))

so each all-reduce runs while the next sub-block computes. Non-laddered layers are standard Llama
layers (the shared pre-norm block). Without a process group the all-reduces are identities and this is
still the Ladder model.
"""

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.ladder.configuration import ZooLadderConfig
from models.ladder.sharding import PLAN
from parallel import comm


class ZooLadderPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLadderConfig
    config: ZooLadderConfig
    _no_split_modules = ["PreNormDecoderLayer"]


class ZooLadderModel(ZooLadderPreTrainedModel, ZooDecoderModel):
    runs_layers_whole = False  # run_layers calls the layers' sub-blocks itself

    def make_layer(self, config, layer_idx):
        return PreNormDecoderLayer(config, layer_idx)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        x = hidden_states
        laddered = self.config.laddered
        attn_pending = mlp_pending = None  # all-reduces in flight from the previous laddered layer
        for i, layer in enumerate(self.layers):
            if i not in laddered:
                x = _add(_add(x, attn_pending), mlp_pending)
                attn_pending = mlp_pending = None
                x = layer(x, position_embeddings, attention_mask, cache)
                continue
            x = _add(x, attn_pending)  # wait for layer i-1's attention output
            attn_out = layer.attention_block(x, position_embeddings, attention_mask, cache)
            attn_pending = comm.all_reduce(attn_out, layer.tp_group)  # overlaps this layer's MLP
            x = _add(x, mlp_pending)  # wait for layer i-1's MLP output
            mlp_out = layer.mlp_block(x)
            mlp_pending = comm.all_reduce(mlp_out, layer.tp_group)  # overlaps the next attention
        return _add(_add(x, attn_pending), mlp_pending)


def _add(x, pending: "comm.Handle | None"):
    return x if pending is None else x + pending.wait()


class ZooLadderForCausalLM(ZooLadderPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooLadderModel
    shard_plan = PLAN
