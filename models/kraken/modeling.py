"""Kraken: k independent streams per layer; the one all-reduce per layer is hidden behind attention.

Stream i, as in the spec (S is the sum of all k streams of the previous layer):

    x0  = embed(ids)
    s_i = Block_i^0(x0)                                  layer 0: a plain pre-norm block, no communication
    for l >= 1:
        S   = all_reduce_async(s_i)                      issued first ...
        a_i = s_i + Attn_i(LN1_i(s_i))                   ... so that it overlaps the stream's own attention
        s_i = a_i + MLP_i(LN2_i(a_i - s_i + wait(S)))    the MLP reads attention output + sum of streams
    y = LN_f(W_conj . concat_i(s_i) + b)                 row-split: one more all-reduce, then the bias

W_conj starts as `config.conjunction_init` says (configuration.py): "random" (default, the authors' code),
"mean" (y = LN_f(mean_i s_i) at init) or "identity" (y = LN_f(sum_i s_i) at init); b starts at 0.

In one process all k streams are local, so their local sum is S and the all-reduce is the identity;
after `parallel.parallelize` at TP degree k rank i holds stream i alone and the all-reduce sums over
ranks. Each stream is a Llama decoder block (the shared pre-norm block), with its names:
`model.layers.{l}.streams.{i}.self_attn...`.

KV cache: stream i of layer l has its own cache layer, l * k + i (under TP, where rank i holds one
stream per layer, l). The model's `make_cache` hook (used by forward and `generate()`) makes a
DynamicCache of that many layers (static=True: a StaticKVCache of that many); a cache made by the caller
the transformers way, `DynamicCache(config=...)`, has one layer per model layer, so `run_layers` tops it up.
"""

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.cache import StaticKVCache
from models.common.pretrained import RESIDUAL_OUTPUT_PROJECTIONS
from models.kraken.configuration import ZooKrakenConfig
from models.kraken.sharding import PLAN
from parallel import comm


class KrakenDecoderLayer(nn.Module):
    """One layer: k streams side by side, each a Llama decoder block with weights of its own."""

    def __init__(self, config: ZooKrakenConfig, layer_idx: int):
        super().__init__()
        k = config.kraken_degree
        # Keyed by stream index (not a ModuleList) so that a rank can hold stream i alone under its own
        # name: checkpoints and gradients then line up with the one-process model's.
        self.streams = nn.ModuleDict({str(i): PreNormDecoderLayer(config, layer_idx * k + i) for i in range(k)})


class ZooKrakenPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooKrakenConfig
    config: ZooKrakenConfig
    _no_split_modules = ["KrakenDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and getattr(module, "_zoo_name", "") in RESIDUAL_OUTPUT_PROJECTIONS:
            # GPT-2's residual scaling counts every output projection that adds to the streams' sum:
            # k per sub-block, so 1/sqrt(2 L k) (the paper's init).
            layers, k = self.config.num_hidden_layers, self.config.kraken_degree
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range / math.sqrt(2 * layers * k))
            if module.bias is not None:
                init.zeros_(module.bias)
            return
        super()._init_weights(module)
        if getattr(module, "_kraken_conjunction", False):
            # After the normal init above (which drew from the generator all the same, so that the other
            # weights do not depend on this choice); init.copy_ leaves a weight loaded from a checkpoint alone.
            weight = conjunction_weight(self.config, module.weight)
            if weight is not None:
                init.copy_(module.weight, weight)
        if isinstance(module, ZooKrakenModel) and hasattr(module, "conjunction_bias"):  # not yet in the first pass
            init.zeros_(module.conjunction_bias)


class ZooKrakenModel(ZooKrakenPreTrainedModel, ZooDecoderModel):
    runs_layers_whole = False  # run_layers calls the layers' sub-blocks itself

    def __init__(self, config: ZooKrakenConfig):
        super().__init__(config)
        d, k = config.hidden_size, config.kraken_degree
        # W_conj and b kept apart: under TP W_conj is row-split and b must be added once, after the sum.
        self.conjunction = nn.Linear(k * d, d, bias=False)
        self.conjunction._kraken_conjunction = True  # _init_weights gives it `config.conjunction_init`
        self.conjunction_bias = nn.Parameter(torch.zeros(d))
        self.tp_group = None  # set by parallel.parallelize; None = single device
        self.post_init()  # the base class initialised everything but the conjunction

    def make_layer(self, config, layer_idx):
        return KrakenDecoderLayer(config, layer_idx)

    def num_cache_layers(self) -> int:
        """One cache layer per stream this process holds in every layer: L * k, or L under TP."""
        return sum(len(layer.streams) for layer in self.layers)

    def make_cache(self, batch_size: int | None = None, max_cache_len: int | None = None, static: bool = False) -> Cache:
        if static:  # one static KV layer per stream this process holds
            return StaticKVCache(self.num_cache_layers(), self.static_capacity(max_cache_len), self.device)
        return _reserve_cache_layers(DynamicCache(config=self.config), self.num_cache_layers())

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        group, rope, mask = self.tp_group, position_embeddings, attention_mask
        _reserve_cache_layers(cache, self.num_cache_layers())  # a cache the caller made (make_cache's fits)
        # Every stream reads the replicated embedding, each its own way: f sums the gradients over ranks.
        x0 = comm.copy_to_tp_region(hidden_states, group)
        first, *rest = self.layers
        streams = []
        for block in first.streams.values():  # layer 0: one plain pre-norm block per stream, no communication
            a = x0 + block.attention_block(x0, rope, mask, cache)
            streams.append(a + block.mlp_block(a))
        for layer in rest:
            blocks = list(layer.streams.values())
            # S = the sum of the k streams: issued before attention, waited at the MLP input.
            pending_sum = comm.all_reduce(torch.stack(streams).sum(0), group)
            attn = [block.attention_block(s, rope, mask, cache) for block, s in zip(blocks, streams, strict=True)]
            # The MLP reads attention output + S (the spec's a_i - s_i + S). S is replicated and each
            # rank's stream uses it its own way, so f sums its gradient over ranks.
            stream_sum = comm.copy_to_tp_region(pending_sum.wait(), group)
            streams = [
                s + o + block.mlp_block(o + stream_sum) for block, s, o in zip(blocks, streams, attn, strict=True)
            ]
        # The conjunction, row-split under TP: each rank multiplies its streams by its columns of W_conj,
        # the partial products are summed, and the bias is added once.
        partial = self.conjunction(torch.cat(streams, dim=-1))
        return comm.all_reduce(partial, group).wait() + self.conjunction_bias


def conjunction_weight(config: ZooKrakenConfig, like: torch.Tensor) -> torch.Tensor | None:
    """W_conj at init for `config.conjunction_init` (d' x k d', as `like`): k blocks of I / k ("mean") or of I
    ("identity") side by side; None for "random" (nn.Linear's normal init stands)."""
    if config.conjunction_init == "random":
        return None
    d, k = config.hidden_size, config.kraken_degree
    scale = 1.0 / k if config.conjunction_init == "mean" else 1.0
    eye = torch.eye(d, dtype=like.dtype, device=like.device) * scale
    return eye.repeat(1, k)


def _reserve_cache_layers(cache: Cache | None, n: int) -> Cache | None:
    """Grow a cache sized one layer per model layer to the `n` (layers x local streams) the model uses."""
    if cache is None or len(cache.layers) >= n:
        return cache
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"Kraken needs {n} KV-cache layers (one per stream of every layer) but got a {type(cache).__name__} "
            f"with {len(cache.layers)}; use model.model.make_cache() (a growing cache), or "
            "make_cache(max_cache_len=..., static=True) for a static one."
        )
    cache.layers.extend(DynamicLayer() for _ in range(n - len(cache.layers)))
    return cache


class ZooKrakenForCausalLM(ZooKrakenPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooKrakenModel
    shard_plan = PLAN
