"""Static caches: buffers of a fixed number of tokens, written in place, the fill position on the device.

The program a compiled decode step (and the speed simulator, and the Ladder paper's gpt-fast benchmark)
runs: every step has the same shapes, attention reads the whole buffer under a mask, and the number of
tokens cached so far is a 0-dim tensor (`cumulative_length`, transformers' name) that the step reads and
advances on the device. No Python int changes from one step to the next, so one graph (one CUDA graph)
serves every step, and no step syncs with the host.

- `StaticKVLayer(max_cache_len, device)`: transformers' `StaticLayer` (K/V buffers [B, H, max_cache_len, D]
  allocated at the first write, new tokens copied in with `index_copy_` at cumulative_length + i) whose
  counter lives on `device` from the start, so the trunk can read the first position before any layer
  has written. transformers' own `StaticCache(config=..., max_cache_len=...)` works too (its counter is
  moved to the model's device when read).
- `StaticStateLayer(device)`: a recurrent state (linear attention's [B, H, d_k, d_v]) kept in one buffer
  that each step overwrites in place, with the same device-side counter.
- `StaticKVCache(num_layers, max_cache_len, device)`: one `StaticKVLayer` per layer (the default static
  cache of `ZooDecoderModel.make_cache(..., static=True)`; Kraken, GQLA and linear attention build theirs
  from these layers).
- `is_static(cache)`, `cache_start(cache, device)` (tokens cached before this forward, a 0-dim tensor) and
  `cache_capacity(cache)` (the buffers' length): what the trunk needs to build positions and the mask.
- `make_static_causal_mask(...)`: the mask of a static cache's forward, [B or 1, 1, q_len, max_cache_len].
- `BatchSplit(cache, halves, batch)`: a cache seen as two halves of its batch, each written and read on its own (the
  token_split overlap schedule, models.common.decoder).
- `ChunkKV()` / `ChunkKV(first)`: a sequence's first chunk's keys and values kept for its second chunk's attention,
  where a forward has no cache (the seq_split overlap schedule, models.common.decoder).

`reset()` empties a static cache in place (buffers zeroed, counters 0), keeping every address: a
benchmark reuses one cache across generations, as gpt-fast does, and a CUDA graph keeps pointing at it.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, StaticLayer


def _mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these buffers keep their address (mutated in place, never reallocated): no recompile, and
    CUDA graphs read them where they are. Not possible while tracing (a buffer made inside a graph)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class StaticKVLayer(StaticLayer):
    """transformers' static K/V layer with its fill counter made on `device` up front."""

    def __init__(self, max_cache_len: int, device: torch.device | str | None = None):
        super().__init__(max_cache_len=max_cache_len)
        if device is not None:
            self.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
            _mark_static(self.cumulative_length)


class StaticStateLayer(CacheLayerMixin):
    """The cache of one recurrent layer: its state, overwritten in place after every forward, and the number
    of tokens it has summed (on the device). The state's shape is known at the first write (prefill)."""

    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, device: torch.device | str | None = None):
        super().__init__()
        self.state = None
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
        _mark_static(self.cumulative_length)

    def lazy_initialization(self, key_states, value_states) -> None:
        raise TypeError("A recurrent layer's cache holds a state, not keys and values.")

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("A recurrent layer's cache holds a state, not keys and values: use update_state.")

    def update_state(self, state: torch.Tensor, num_tokens: int) -> None:
        if self.state is None:
            self.state = state.clone()
            self.device = state.device
            _mark_static(self.state)
            self.is_initialized = True
        else:
            self.state.copy_(state)
        self.cumulative_length.add_(num_tokens)

    def get_seq_length(self) -> torch.Tensor:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1  # a state has no length limit

    def reset(self) -> None:
        if self.state is not None:
            self.state.zero_()
        self.cumulative_length.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.copy_(self.state.index_select(0, beam_idx.to(self.state.device)))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(
                "A recurrent state cannot be rolled back by tokens (it sums all of them), so assisted / "
                "speculative decoding, which crops the cache, does not work with this model."
            )


class StaticKVCache(Cache):
    """One `StaticKVLayer` of `max_cache_len` tokens per layer."""

    def __init__(self, num_layers: int, max_cache_len: int, device: torch.device | str | None = None):
        super().__init__(layers=[StaticKVLayer(max_cache_len, device) for _ in range(num_layers)])


def check_capacity(max_cache_len) -> int:
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(
            f"A static cache needs max_cache_len, the most tokens it will hold (prompt + new tokens), as a "
            f"positive int; got {max_cache_len!r}."
        )
    return max_cache_len


def is_static(cache: Cache | None) -> bool:
    """True for a cache whose every layer is static (fixed buffers, device-side counter)."""
    return (
        cache is not None
        and len(cache.layers) > 0
        and all(isinstance(layer, (StaticLayer, StaticStateLayer)) for layer in cache.layers)
    )


def cache_start(cache: Cache, device: torch.device) -> torch.Tensor:
    """Tokens cached before this forward, a 0-dim long tensor on `device` (read before any layer writes)."""
    return cache.layers[0].cumulative_length.to(device)


def cache_capacity(cache: Cache) -> int | None:
    """The K/V buffers' length in tokens; None for a cache of recurrent states only (no keys to mask)."""
    lengths = {layer.max_cache_len for layer in cache.layers if isinstance(layer, StaticLayer)}
    if len(lengths) > 1:
        raise ValueError(f"The static cache's layers hold different numbers of tokens ({sorted(lengths)}).")
    return lengths.pop() if lengths else None


def make_static_causal_mask(
    attention_mask: torch.Tensor | None,
    start: torch.Tensor,
    q_len: int,
    max_cache_len: int,
    device: torch.device,
    batch_size: int,
) -> torch.Tensor:
    """Boolean mask [batch or 1, 1, q_len, max_cache_len] of a forward on a static cache (True = may attend).

    Query i sits at position start + i (start: a 0-dim tensor, the tokens cached before) and sees every
    cache slot up to its own; slots after it (empty, or stale after a reset) are masked. `attention_mask`:
    the usual 2-D padding mask [batch_size, L] over the first L slots, L <= max_cache_len (generate passes
    L = cached + new tokens; slots past L are masked by causality anyway). A padding query sees itself, so
    SDPA never gets a row with no key (it would return NaN).
    """
    if attention_mask is not None:
        shape = tuple(attention_mask.shape)
        if attention_mask.dim() != 2 or shape[0] != batch_size or shape[1] > max_cache_len:
            raise ValueError(
                f"attention_mask has shape {shape}, but a forward on a static cache of {max_cache_len} tokens "
                f"needs [batch, cached + new tokens] = [{batch_size}, at most {max_cache_len}]: 1 for tokens to "
                "attend to and 0 for padding."
            )
    q_pos = (start + torch.arange(q_len, device=device))[:, None]
    k_pos = torch.arange(max_cache_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if attention_mask is not None:
        padding = torch.nn.functional.pad(attention_mask.bool(), (0, max_cache_len - attention_mask.shape[1]))
        mask = (mask & padding[:, None, None, :]) | (k_pos == q_pos)[None, None]
    return mask


class BatchSplit:
    """A cache seen as two halves of its batch, for a layer that runs each half's attention on its own (the
    `token_split` overlap schedule, models.common.decoder): `half(i)` is a cache whose `update(k, v, layer_idx)`
    writes that half's keys and values into its rows of the whole cache and returns those rows.

    Static layers (fixed buffers): both halves write at the same positions, and the fill counter advances once,
    after the second half. Growing layers (`DynamicLayer`): each half's rows grow by its tokens and the layer holds
    both once the second half has written. The buffers are allocated for the whole batch on the first write."""

    def __init__(self, cache: Cache, halves: tuple[slice, slice], batch: int):
        self.cache, self.halves, self.batch = cache, halves, batch
        self._grown = {}  # layer_idx -> the first half's grown keys and values (growing layers)

    def half(self, i: int) -> "_CacheHalf":
        return _CacheHalf(self, i)

    def update(self, i: int, key_states, value_states, layer_idx: int):
        cache = self.cache
        while len(cache.layers) <= layer_idx and cache.layer_class_to_replicate is not None:
            cache.layers.append(cache.layer_class_to_replicate())
        layer, rows, last = cache.layers[layer_idx], self.halves[i], i == len(self.halves) - 1
        if isinstance(layer, StaticLayer):
            if not layer.is_initialized:
                full = (self.batch, *key_states.shape[1:])
                layer.lazy_initialization(key_states.new_empty(full), value_states.new_empty((self.batch, *value_states.shape[1:])))
            positions = torch.arange(key_states.shape[-2], device=layer.device) + layer.cumulative_length
            keys, values = layer.keys[rows], layer.values[rows]  # views: written in place into the buffers
            keys.index_copy_(2, positions, key_states)
            values.index_copy_(2, positions, value_states)
            if last:
                layer.cumulative_length.add_(key_states.shape[-2])
            return keys, values
        if isinstance(layer, DynamicLayer):
            if not layer.is_initialized:
                layer.lazy_initialization(key_states, value_states)
            old = layer.keys.numel() > 0
            keys = torch.cat([layer.keys[rows], key_states], dim=-2) if old else key_states
            values = torch.cat([layer.values[rows], value_states], dim=-2) if old else value_states
            if last:
                first_keys, first_values = self._grown.pop(layer_idx)
                layer.keys, layer.values = torch.cat([first_keys, keys]), torch.cat([first_values, values])
            else:
                self._grown[layer_idx] = (keys, values)
            return keys, values
        raise TypeError(f"A batch split cannot write into a {type(layer).__name__} (static or growing K/V layers only).")


class _CacheHalf:
    """One half of a `BatchSplit`: what the attention of that half sees as its cache."""

    def __init__(self, split: BatchSplit, i: int):
        self.split, self.i = split, i

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.split.update(self.i, key_states, value_states, layer_idx)


class ChunkKV:
    """The keys and values of a sequence's first chunk for its second chunk, where a forward has no cache (the
    seq_split overlap schedule, models.common.decoder): `ChunkKV()` is the first chunk's cache, whose `update` keeps
    each layer's keys and values (by `layer_idx`: one pair serves every layer of the forward) and returns them;
    `ChunkKV(first)` is the second chunk's, whose `update` returns the first chunk's of that layer followed by its
    own, so the later chunk's causal attention reads the earlier chunk's keys and values as the unsplit attention
    does (autograd flows through both). Each chunk's `update` does the same thing every time it runs: activation
    checkpointing's recomputation of either chunk of any layer repeats its forward exactly."""

    def __init__(self, first: "ChunkKV | None" = None):
        self.first, self.kv = first, {}

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.first is None:
            self.kv[layer_idx] = (key_states, value_states)
            return key_states, value_states
        keys, values = self.first.kv[layer_idx]
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
