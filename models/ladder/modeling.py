"""Ladder Residual Transformer: Llama's layers under the ladder residual schedule (models/common/residual.py).

Each laddered layer's attention and MLP all-reduces are waited one sub-block later, so each runs while the next
sub-block computes; the other layers are standard Llama layers. Without a process group the all-reduces are
identities and this is still the Ladder model.
"""

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.residual import run_ladder
from models.ladder.configuration import ZooLadderConfig
from models.ladder.sharding import PLAN


class ZooLadderPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLadderConfig
    config: ZooLadderConfig
    _no_split_modules = ["PreNormDecoderLayer"]


class ZooLadderModel(ZooLadderPreTrainedModel, ZooDecoderModel):
    runs_layers_whole = False  # run_layers calls the layers' sub-blocks itself

    def make_layer(self, config, layer_idx):
        return PreNormDecoderLayer(config, layer_idx)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        # Laddered layers' all-reduces are waited one sub-block later (run_ladder); see its docstring.
        return run_ladder(self.layers, self.config.laddered, hidden_states, position_embeddings, attention_mask, cache)


class ZooLadderForCausalLM(ZooLadderPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooLadderModel
    shard_plan = PLAN
