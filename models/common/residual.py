"""Residual schedules: when a layer's sub-block outputs join the residual stream.

- standard: each sub-block's output (under TP a partial sum) is reduced and added at once, because the next
  sub-block reads it (`PreNormDecoderLayer.forward`).
- ladder (Ladder Residual, Zhang, Mishra et al. 2025): a laddered layer's sub-block reads the stream WITHOUT the
  previous sub-block's output, whose reduction is still in flight; it is added one sub-block later. In one-stream
  form, with `a_prev`, `m_prev` the handles of the previous laddered sub-blocks' collectives:

      x = x + a_prev.wait();  a_prev = reduce_async(Attn_i(LN1_i(x)))
      x = x + m_prev.wait();  m_prev = reduce_async(MLP_i(LN2_i(x)))

  so each collective runs while the next sub-block computes. Non-laddered layers run the standard block.

`ladder_layers` names the laddered layers: an int N (the LAST N layers; 0 = the standard architecture,
`num_hidden_layers` = every layer) or a list of layer indices; None (every layer) is resolved to the number when
the config is built, so a config.json always states it.

A layer the ladder schedule runs has two sub-blocks, `attention_block(x, position_embeddings, attention_mask,
cache)` and `mlp_block(x)`, each returning its output before its reduction, and `tp_group` (the all-reduce's group;
None on one device).
"""

from parallel import comm


def check_ladder_layers(ladder_layers, num_hidden_layers: int):
    """`ladder_layers` resolved (None -> every layer) and checked; one error naming the value and what fits."""
    n = num_hidden_layers
    if ladder_layers is None:
        return n  # the default: the paper's Ladder Transformer, every layer laddered
    if isinstance(ladder_layers, bool) or not isinstance(ladder_layers, (int, list, tuple)):
        raise ValueError(
            f"ladder_layers={ladder_layers!r} must be an int in 0..{n} (the number of last layers "
            f"to ladder), a list of layer indices in 0..{n - 1}, or None (every layer, the default)."
        )
    if isinstance(ladder_layers, int):
        if not 0 <= ladder_layers <= n:
            raise ValueError(
                f"ladder_layers={ladder_layers} is out of range; use 0..{n} (the number of last "
                f"layers to ladder) or a list of layer indices in 0..{n - 1}."
            )
    else:
        bad = [i for i in ladder_layers if isinstance(i, bool) or not (isinstance(i, int) and 0 <= i < n)]
        if bad or len(set(ladder_layers)) != len(ladder_layers):
            raise ValueError(f"ladder_layers={list(ladder_layers)} must list distinct layer indices in 0..{n - 1}.")
    return ladder_layers


def laddered_indices(ladder_layers, num_hidden_layers: int) -> frozenset[int]:
    """Indices of the laddered layers (None: every layer)."""
    if ladder_layers is None:
        return frozenset(range(num_hidden_layers))
    if isinstance(ladder_layers, int):
        return frozenset(range(num_hidden_layers - ladder_layers, num_hidden_layers))
    return frozenset(ladder_layers)


def run_ladder(layers, laddered: frozenset[int], hidden_states, position_embeddings, attention_mask, cache):
    """The ladder schedule over `layers`: each laddered sub-block's all-reduce is waited one sub-block later."""
    x = hidden_states
    attn_pending = mlp_pending = None  # all-reduces in flight from the previous laddered layer
    for i, layer in enumerate(layers):
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
