"""The standard pre-norm decoder block: x = x + Attn(LN1(x)); x = x + MLP(LN2(x)).

Llama's layer, shared by every architecture built from it (Llama itself, Ladder's rewired stream,
Kraken's streams, the MoE layers of `moe` and `moepp`, whose experts take the MLP's place). Parameter
names are Hugging Face Llama's (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`,
`post_attention_layernorm`), so HF Llama checkpoints load unchanged.

`PreNormAttention` is its attention sub-block alone, for a block that is laid out otherwise around it
(ScMoE's MoE block).
"""

from dataclasses import dataclass

import torch
from torch import nn

from models.common.attention import Attention, make_causal_mask, merge_heads
from models.common.cache import BatchSplit, ChunkKV, is_static
from models.common.mlp import SwiGLUMLP
from models.common.norm import RMSNorm
from parallel import comm
from parallel.collective_matmul import (
    all_gather_linears,
    gather_from_sequence,
    linear_reduce_scatter,
    scatter_to_sequence,
    sequence_norm,
)
from parallel.overlap import MIN_BATCH


def batch_halves(hidden_states, position_embeddings, attention_mask, cache) -> list[tuple]:
    """A layer's inputs as two halves of the batch, [(hidden_states, position_embeddings, attention_mask, cache)] x 2,
    for the token_split overlap schedule (parallel/overlap.py): a tensor with the batch dimension is split, one
    broadcast over the batch is shared, and a cache is seen through `BatchSplit` (each half its own rows). The first
    half holds the extra sequence of an odd batch."""
    batch = hidden_states.shape[0]
    if batch < MIN_BATCH["token_split"]:
        raise ValueError(
            f"overlap=token_split needs a batch of at least {MIN_BATCH['token_split']} sequences to split; this one has "
            f"{batch}."
        )
    halves = (slice(0, (batch + 1) // 2), slice((batch + 1) // 2, batch))
    split = None if cache is None else BatchSplit(cache, halves, batch)  # one per forward: its halves share it

    def half(x, i):
        return x[halves[i]] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x

    return [
        (hidden_states[halves[i]], tuple(half(t, i) for t in position_embeddings), half(attention_mask, i),
         None if split is None else split.half(i))
        for i in (0, 1)
    ]  # fmt: skip


def sequence_halves(hidden_states, position_embeddings, attention_mask, cache) -> list[tuple]:
    """A layer's inputs as two chunks of the sequence, [(hidden_states, position_embeddings, attention_mask, cache)]
    x 2, for the seq_split overlap schedule (parallel/overlap.py; ISO's sequence-level overlap): the first chunk
    holds the extra token of an odd length. The second chunk's causal attention reads the first chunk's keys and
    values: both chunks write the same cache one after the other (a chunked prefill), or, without a cache, the second
    chunk's `ChunkKV` reads the first's; each chunk's mask is its rows of the layer's mask, over the keys its attention sees."""
    tokens = hidden_states.shape[1]
    if tokens < 2:
        raise ValueError(f"overlap=seq_split needs a forward of at least 2 tokens to split; this one has {tokens}.")
    first = (tokens + 1) // 2
    chunks = (slice(0, first), slice(first, tokens))
    if attention_mask is None:  # plain causal attention from the first query on (no key before it)
        masks = (None, make_causal_mask(None, tokens - first, 0, hidden_states.device, q_offset=first))
    else:  # [B or 1, 1, tokens, keys]: a static cache returns every slot to both chunks, a growing one its keys so far
        keys = attention_mask.shape[-1] if is_static(cache) else attention_mask.shape[-1] - (tokens - first)
        masks = (attention_mask[..., :first, :keys], attention_mask[..., first:, :])
    first_kv = ChunkKV()
    caches = (first_kv, ChunkKV(first_kv)) if cache is None else (cache, cache)
    return [
        (hidden_states[:, chunks[i]],
         None if position_embeddings is None else tuple(t[:, chunks[i]] for t in position_embeddings),
         masks[i], caches[i])
        for i in (0, 1)
    ]  # fmt: skip


# Each splitting schedule (parallel/overlap.py): its inputs' halves and the dimension their outputs join along.
SPLITS = {"token_split": (batch_halves, 0), "seq_split": (sequence_halves, 1)}


def runs_split(overlap: str, hidden_states) -> bool:
    """Whether a trunk under `overlap` runs this forward split: token_split always (it refuses a batch of one);
    seq_split when the forward has two tokens or more (a decode step's one token runs unsplit: ISO overlaps the
    prefill)."""
    return overlap == "token_split" or (overlap == "seq_split" and hidden_states.shape[1] > 1)


@dataclass(frozen=True)
class Split:
    """One forward under a splitting schedule: each half's layer inputs besides its stream, `(position_embeddings,
    attention_mask, cache)`, the same at every layer, and the dimension the halves join along at the end."""

    schedule: str
    dim: int
    halves: tuple[tuple, tuple]


def run_split(layers, schedule: str, hidden_states, position_embeddings, attention_mask, cache, aux=None):
    """The layers over the two halves of a forward under the splitting schedule `schedule`, split once and joined
    once. Each layer's `split_layer(x0, x1, carried, split)` runs its sub-blocks on the halves in turn and returns
    `(x0, x1, carried)` (an MoE layer: and its aux dict, appended to `aux`): half 1's last collective of the layer
    is still in flight (`carried`), waited by the next layer behind half 0's first sub-block, so a layer boundary
    does not expose it (TokenWeave's and Domino's cross-layer overlap); the last layer's is waited before the
    join."""
    parts, dim = SPLITS[schedule]
    (x0, *rest0), (x1, *rest1) = parts(hidden_states, position_embeddings, attention_mask, cache)
    split, carried = Split(schedule, dim, (tuple(rest0), tuple(rest1))), None
    for layer in layers:
        x0, x1, carried, *extra = layer.split_layer(x0, x1, carried, split)
        if extra and aux is not None:
            aux.append(extra[0])
    return torch.cat([x0, add_pending(x1, carried)], dim=dim)


def runs_sequence_sharded(overlap: str, hidden_states) -> bool:
    """Whether a trunk under `overlap` shards this forward's stream along the sequence: collective_matmul with two
    tokens or more (a decode step's one token runs as `none`)."""
    return overlap == "collective_matmul" and hidden_states.shape[1] > 1


def run_sequence_sharded(layers, hidden_states, position_embeddings, attention_mask, cache):
    """The layers under the collective_matmul schedule (parallel/overlap.py): the stream sharded along the sequence
    over the tensor-parallel ranks on entry, each layer called on this rank's chunk (`sequence_sharded=True`), the
    chunks gathered after the last layer. Positions, mask and cache are the whole sequence's: attention reads every
    token's keys once the column-parallel linears have gathered them."""
    group = layers[0].tp_group
    x = scatter_to_sequence(hidden_states, group)
    for layer in layers:
        x = layer(x, position_embeddings, attention_mask, cache, sequence_sharded=True)
    return gather_from_sequence(x, group)


def gathered_attention(attn: Attention, q, k, v, position_embeddings, attention_mask, cache):
    """Attention's heads of this rank over the whole sequence, from its q / k / v projections gathered by
    `all_gather_linears` (the collective_matmul schedule); the output before o_proj, [B, T, local heads x D]."""
    return merge_heads(attn.mix(*attn.heads(q, k, v, position_embeddings), attention_mask, cache))


def add_pending(x, pending):
    """`x` plus a collective's result once it is waited (`pending.wait()`); `x` itself where nothing is pending."""
    return x if pending is None else x + pending.wait()


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

    def forward(self, hidden_states, position_embeddings, attention_mask, cache, sequence_sharded=False):
        if sequence_sharded:
            return self.sequence_sharded_forward(hidden_states, position_embeddings, attention_mask, cache)
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        # Standard block: the next sub-block reads this output, so the all-reduce is waited at once.
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        mlp_out = self.mlp_block(hidden_states)
        return hidden_states + comm.all_reduce(mlp_out, self.tp_group).wait()

    def split_layer(self, x0, x1, carried, split: Split):
        """The block over the two halves of a split forward, in turn (`run_split`; parallel/overlap.py): the batch's
        halves (token_split) or the sequence's chunks (seq_split). Each half's all-reduce is issued as soon as its
        sub-block is done and waited only after the other half's next sub-block: the previous layer's last one
        (half 1's MLP, `carried`) behind half 0's attention, half 0's attention behind half 1's, half 1's behind half
        0's MLP, half 0's MLP behind half 1's; half 1's MLP is returned in flight. Every token sees the same
        computation as in `forward`: with a KV cache each batch half writes and reads its own rows of it
        (models.common.cache.BatchSplit), and the second chunk of a sequence attends to the first's keys."""
        (pos0, mask0, cache0), (pos1, mask1, cache1) = split.halves
        attn0 = comm.all_reduce(self.attention_block(x0, pos0, mask0, cache0), self.tp_group)
        x1 = add_pending(x1, carried)  # the previous layer's half 1 MLP all-reduce ran behind half 0's attention
        attn1 = comm.all_reduce(self.attention_block(x1, pos1, mask1, cache1), self.tp_group)
        x0 = x0 + attn0.wait()  # half 0's all-reduce ran behind half 1's attention
        mlp0 = comm.all_reduce(self.mlp_block(x0), self.tp_group)
        x1 = x1 + attn1.wait()  # half 1's behind half 0's MLP
        mlp1 = comm.all_reduce(self.mlp_block(x1), self.tp_group)
        return x0 + mlp0.wait(), x1, mlp1  # half 0's behind half 1's MLP; half 1's waited by the next layer

    def sequence_sharded_forward(self, x, position_embeddings, attention_mask, cache):
        """The block on this rank's chunk `x` of the sequence (the collective_matmul schedule, `run_sequence_sharded`):
        each sub-block gathers the normed chunks inside its column-parallel linears and reduce-scatters its output
        inside its row-parallel one, ring step by ring step, each step waited behind a chunk's matmul
        (parallel/collective_matmul.py); so nothing is all-reduced, and each sub-block's output is this chunk's."""
        group, attn, mlp = self.tp_group, self.self_attn, self.mlp
        q, k, v = all_gather_linears(sequence_norm(self.input_layernorm, x, group), [attn.q_proj, attn.k_proj, attn.v_proj], group)
        out = gathered_attention(attn, q, k, v, position_embeddings, attention_mask, cache)
        x = x + linear_reduce_scatter([(out, attn.o_proj)], group)
        gate, up = all_gather_linears(sequence_norm(self.post_attention_layernorm, x, group), [mlp.gate_proj, mlp.up_proj], group)
        return x + linear_reduce_scatter([(torch.nn.functional.silu(gate) * up, mlp.down_proj)], group)
