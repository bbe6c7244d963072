"""Linear-Llama: the Llama stack with causal linear attention as the sequence mixer, and hybrids of it.

A linear-attention layer (`LinearAttention`; docs/architectures.md#linear, the LASP-2 paper's
Linear-Llama3):

    q = silu(W_q x) / sqrt(h_d),  k = silu(W_k x),  v = W_v x        per head, no RoPE
    o = causal linear attention of (q, k, v) with the head's decay     (ops.py)
    out = W_o (RMSNorm(o) * silu(W_g x))                               per-head norm, output gate

The SiLU feature map keeps q . k >= 0; the per-head RMSNorm replaces softmax's normalisation (TransNormer's
NormAttention), and the scale (fla's default) only keeps o's magnitude off the norm's eps. `layer_pattern`
("LLLN": one softmax layer in four) mixes in N layers: the shared softmax Attention with RoPE and a KV
cache (`SoftmaxAttention`). Every layer is the shared pre-norm block with the SwiGLU MLP.

Decoding keeps O(1) memory per linear layer: `LinearCache` holds its [B, H, d_k, d_v] state (fp32) and a
growing KV cache only for the N layers. Padding (a 2-D attention_mask, left padding) drops the padded
tokens' keys from the state.

Sequence parallelism (parallel/sequence.py and this folder's sharding.py; on one device none of this
runs). The trunk and each attention module have `sp_group = None`, set by the "sp" layout; the trunk then
offsets positions and the causal mask by the rank (`parallel.sequence.chunk_offset`), and the module
hands its q, k, v (layout [B, H, C, D], this rank's chunk of C tokens, after the feature map, the scale
and RoPE) to parallel.sequence, with the config's `sp_method` ("lasp2" | "lasp1"):

- linear layers (`LinearAttention.mix`): `linear_attention(q, k, v, group, log_decay, method=...,
  intra=...)`, `log_decay` [H] (<= 0) or None, `intra` this layer's kernel for the chunk's own causal
  part (ops.linear_attention: fla on CUDA, the chunked kernel on CPU);
- softmax layers (`SoftmaxAttention.mix`): `softmax_attention(q, k, v, group, attention_mask,
  method=...)`, k and v with `num_key_value_heads` heads (fewer bytes to gather), the trunk's mask over
  the keys before and in the chunk.
Each returns the chunk's output [B, H, C, D]. A cache under sequence parallelism is an error (decode on
one device).

Tensor parallelism (sharding.py states the layout): the same forward on a rank's heads. `num_heads` is then
the local count and `first_head` the first of them (the decay's values are those heads'); the output norm
(`HeadNorm`, one weight shared by every head) gets its full gradient through `tp_group`; the decoder layer
all-reduces each sub-block's partial output. A cache then holds the rank's heads only.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from models.common import (
    Attention,
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    ZooDecoderModel,
    ZooForCausalLM,
    ZooPreTrainedModel,
)
from models.common.cache import StaticKVLayer, StaticStateLayer, is_static
from models.common.residual import ResidualSchedule
from models.linear.configuration import ZooLinearConfig
from models.linear.ops import linear_attention
from models.linear.sharding import PLAN
from parallel import comm
from parallel.sequence import chunk_offset
from parallel.sequence import linear_attention as sp_linear_attention
from parallel.sequence import softmax_attention as sp_softmax_attention


def _no_cache_under_sp(cache) -> None:
    if cache is not None:
        raise ValueError(
            "A cache was passed to a sequence-parallel forward: decoding runs on one device. Pass use_cache=False "
            "when training under sp, and generate with the unsharded model."
        )


# --- decay


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's head slopes (Press et al. 2022): 2^(-8 (h+1) / H) for a power-of-two H; otherwise those of
    the power of two below H, then every other slope of the one above."""
    if math.log2(num_heads).is_integer():
        return [2 ** (-8 * (h + 1) / num_heads) for h in range(num_heads)]
    below = 2 ** math.floor(math.log2(num_heads))
    return alibi_slopes(below) + alibi_slopes(2 * below)[0::2][: num_heads - below]


def fixed_log_decay(decay: str, num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """log lambda_h [H] of a fixed decay.

    - `lightning` (TransNormerLLM / Lightning Attention-2, Qin et al. 2023-24, as in their released code and
      MiniMax-01's): lambda_h = exp(-s_h (1 - l / (L - 1) + 1e-5)) with s_h the ALiBi slopes, l the layer
      index and L the layers: decay is strongest in the first layer and all but gone in the last.
    - `retnet` (Sun et al. 2023, RetNet): lambda_h = 1 - 2^(-5 - h), the same in every layer.
    """
    if decay == "lightning":
        depth = 1 - layer_idx / (num_layers - 1) + 1e-5 if num_layers > 1 else 1 + 1e-5
        return -torch.tensor(alibi_slopes(num_heads), dtype=torch.float64) * depth
    if decay == "retnet":
        return torch.log1p(-(2.0 ** (-5 - torch.arange(num_heads, dtype=torch.float64))))
    raise ValueError(f"decay={decay!r} has no fixed values; the fixed decays are 'lightning' and 'retnet'.")


def learned_decay_init(num_heads: int) -> torch.Tensor:
    """Logits whose log-sigmoid is RetNet's log decay: a learned decay starts where RetNet's stays."""
    return torch.log(2.0 ** (5 + torch.arange(num_heads, dtype=torch.float64)) - 1)


# --- the cache


class LinearStateLayer(CacheLayerMixin):
    """The cache of one linear-attention layer: its state [B, H, d_k, d_v] (fp32) and the number of tokens
    seen, whatever that number. The position of the next token is not needed: a fixed decay depends only
    on distances, which the state already carries."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.state = None
        self.seen_tokens = 0
        self.device = None

    def lazy_initialization(self, key_states, value_states) -> None:
        raise TypeError("A linear-attention layer's cache holds a state, not keys and values.")

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(
            "A linear-attention layer's cache holds a state, not keys and values: use LinearCache.update_state."
        )

    def update_state(self, state: torch.Tensor, num_tokens: int) -> None:
        self.state, self.device = state, state.device
        self.seen_tokens += num_tokens
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1  # no limit

    def offload(self):
        if self.state is not None:
            self.state = self.state.to("cpu", non_blocking=True)

    def prefetch(self):
        if self.state is not None and self.state.device != self.device:
            self.state = self.state.to(self.device, non_blocking=True)

    def reset(self) -> None:
        self.state, self.seen_tokens, self.is_initialized = None, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(0, beam_idx.to(self.state.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = self.state.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state[indices]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(
                "A linear-attention state cannot be rolled back by tokens (it sums all of them), so "
                "assisted / speculative decoding, which crops the cache, does not work with this model."
            )


class LinearCache(Cache):
    """The cache of a Linear-Llama: a `LinearStateLayer` per linear layer (O(1) in the tokens) and a growing
    KV `DynamicLayer` per softmax layer of a hybrid (`cache.update(k, v, layer_idx)`, as the shared
    Attention uses it). With `max_cache_len`: the static form, a `StaticStateLayer` per linear layer and a
    `StaticKVLayer` per softmax layer (models.common.cache), for a compiled decode step."""

    def __init__(self, config: ZooLinearConfig, max_cache_len: int | None = None, device=None):
        if max_cache_len is None:
            layers = [
                LinearStateLayer() if config.is_linear_layer(i) else DynamicLayer()
                for i in range(config.num_hidden_layers)
            ]
        else:  # static (models.common.cache): states overwritten in place, K/V in buffers of max_cache_len
            layers = [
                StaticStateLayer(device) if config.is_linear_layer(i) else StaticKVLayer(max_cache_len, device)
                for i in range(config.num_hidden_layers)
            ]
        super().__init__(layers=layers)

    def get_state(self, layer_idx: int) -> torch.Tensor | None:
        """Layer `layer_idx`'s state, or None before its first token."""
        return self.layers[layer_idx].state

    def update_state(self, state: torch.Tensor, num_tokens: int, layer_idx: int) -> None:
        """Store layer `layer_idx`'s state after `num_tokens` more tokens."""
        self.layers[layer_idx].update_state(state, num_tokens)


def _check_cache(cache) -> None:
    if cache is not None and not isinstance(cache, LinearCache):
        raise TypeError(
            f"A Linear-Llama needs its own cache (LinearCache, from model.model.make_cache()), not a "
            f"{type(cache).__name__}: its linear layers keep a state instead of keys and values."
        )


# --- the sequence mixers


class HeadNorm(RMSNorm):
    """The per-head output RMSNorm: one weight over head_dim that every head shares. Under tensor parallelism a
    rank normalises its own heads only, so the weight's gradient there is a partial sum over heads; Megatron's
    f on the weight (identity forward, gradient all-reduced over `tp_group`, set by the "tp" layout) gives
    every rank the full one."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__(head_dim, eps=eps)
        self.tp_group = None  # set by the "tp" layout (sharding.py); None = one device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.copy_to_tp_region(self.weight, self.tp_group) * self.normalize(x)


class LinearAttention(nn.Module):
    """Causal linear attention with SiLU feature map, per-head output RMSNorm and output gate; optional
    per-head decay. Parameter names follow Llama's attention (q_proj, k_proj, v_proj, o_proj) plus the
    gate's g_proj and the norm's o_norm."""

    def __init__(self, config: ZooLinearConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # Local head counts and the first local head: the "tp" layout (sharding.py) keeps a rank's heads.
        # Every head has its own keys and values (no grouping): num_key_value_heads = num_heads.
        self.num_heads = self.num_key_value_heads = config.num_attention_heads
        self.first_head = 0
        self.head_dim = config.head_dim
        self.chunk_size = config.chunk_size
        self.decay = config.decay
        d, inner, bias = config.hidden_size, self.num_heads * self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(d, inner, bias=bias)
        self.k_proj = nn.Linear(d, inner, bias=bias)
        self.v_proj = nn.Linear(d, inner, bias=bias)
        self.g_proj = nn.Linear(d, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d, bias=bias)
        self.o_norm = HeadNorm(self.head_dim, eps=config.rms_norm_eps)
        if self.decay == "learned":
            # log lambda = logsigmoid(decay_logits): always < 0, so the state never grows without bound.
            self.decay_logits = nn.Parameter(learned_decay_init(self.num_heads).float())
        elif self.decay != "none":
            # The exact fp64 values, kept as their bits (int64): nn.Module.to(dtype) casts floating
            # buffers, and a bf16 model's bf16 decays would be off by up to 2^-9 relative (lambda^t drifts
            # over long sequences); an integer buffer moves with .to(device) and is never cast. `log_decay`
            # gives them in the compute dtype: fp32-rounded for bf16 / fp16 / fp32 models, exact in a
            # float64 one. Not in checkpoints (it follows from the config); rebuilt after meta-device
            # loading (_init_weights).
            values = fixed_log_decay(self.decay, self.num_heads, layer_idx, config.num_hidden_layers)
            self.register_buffer("fixed_log_decay_bits", values.view(torch.int64), persistent=False)
        self.num_layers = config.num_hidden_layers
        # Set by the "sp" layout (sharding.py); None = one device.
        self.sp_group = None
        self.sp_method = config.sp_method

    def heads(self) -> slice:
        """This module's heads among the layer's num_attention_heads (all of them but under TP)."""
        return slice(self.first_head, self.first_head + self.num_heads)

    def log_decay(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """log lambda_h [H] (<= 0), or None without decay. A fixed decay in promote_types(dtype, fp32) (the
        kernels' compute dtype for inputs of `dtype`), rounded once from its fp64 value; a learned one in its
        parameter's dtype."""
        if self.decay == "none":
            return None
        if self.decay == "learned":
            return F.logsigmoid(self.decay_logits)
        return self.fixed_log_decay_bits.view(torch.float64).to(torch.promote_types(dtype, torch.float32))

    def forward(self, x, position_embeddings=None, attention_mask=None, cache=None):
        bsz, q_len, _ = x.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = F.silu(self.q_proj(x)).view(shape).transpose(1, 2) * self.head_dim**-0.5
        k = F.silu(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if attention_mask is not None:
            # Padding: the trunk's mask [B, 1, q_len, keys] lets its last query see every key of this chunk
            # except padding (and itself); a padded token's key then adds nothing to the state. The chunk's
            # last token always counts (the mask cannot say it is padding): pad on the left, as generate does.
            last = attention_mask[:, :, -1:, :]
            if attention_mask.shape[-1] != q_len and is_static(cache):
                # A static cache's mask spans its K/V buffer: this chunk's keys sit at its fill level.
                chunk = cache.layers[self.layer_idx].cumulative_length + torch.arange(q_len, device=k.device)
                last = last.index_select(-1, chunk)
            k = k * last[..., -q_len:].transpose(-1, -2).to(k.dtype)
        o = self.mix(q, k, v, cache)
        o = self.o_norm(o.transpose(1, 2)).reshape(bsz, q_len, -1)
        return self.o_proj(o * F.silu(self.g_proj(x)))

    def mix(self, q, k, v, cache=None):
        """The sequence mixing: o [B, H, T, d_v] from q, k, v [B, H, T, D]. On one device, the chunked
        kernel (fla on CUDA) starting from the cache's state and leaving the new one there; under sequence
        parallelism, `sp_method` over `sp_group` (module docstring)."""
        log_decay = self.log_decay(q.dtype)
        if self.sp_group is not None:
            _no_cache_under_sp(cache)
            return sp_linear_attention(
                q, k, v, self.sp_group, log_decay, method=self.sp_method, intra=self.intra_chunk
            )
        _check_cache(cache)
        state = None if cache is None else cache.get_state(self.layer_idx)
        o, state = linear_attention(q, k, v, log_decay, initial_state=state, chunk_size=self.chunk_size)
        if cache is not None:
            cache.update_state(state, q.shape[2], self.layer_idx)
        return o

    def intra_chunk(self, q, k, v, log_decay):
        """The causal linear attention within one chunk of tokens (sequence parallelism adds the rest)."""
        return linear_attention(q, k, v, log_decay, chunk_size=self.chunk_size)[0]


class SoftmaxAttention(Attention):
    """The shared softmax attention (RoPE, GQA, KV cache) of a hybrid's N layers, with the sequence-parallel
    hook: on one device it is exactly the shared Attention."""

    def __init__(self, *args, sp_method: str = "lasp2", **kwargs):
        super().__init__(*args, **kwargs)
        # Set by the "sp" layout (sharding.py); None = one device.
        self.sp_group = None
        self.sp_method = sp_method

    def mix(self, q, k, v, attention_mask=None, cache=None):
        if self.sp_group is None:
            return super().mix(q, k, v, attention_mask, cache)
        # Under sequence parallelism the keys and values of the tokens before this chunk come from the group.
        _no_cache_under_sp(cache)
        return sp_softmax_attention(q, k, v, self.sp_group, attention_mask, method=self.sp_method)


class LinearDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block (attention then SwiGLU MLP) with the mixer the layer pattern gives."""

    def __init__(self, config: ZooLinearConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.is_linear_layer(layer_idx):
            self.self_attn = LinearAttention(config, layer_idx)
        else:
            self.self_attn = SoftmaxAttention.from_config(config, layer_idx, sp_method=config.sp_method)


# --- the model


class ZooLinearPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLinearConfig
    config: ZooLinearConfig
    _no_split_modules = ["LinearDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if not isinstance(module, LinearAttention) or module.decay == "none":
            return
        # The values of the module's own heads (a slice of them under TP: built on the meta device, sharded,
        # then materialised).
        heads = self.config.num_attention_heads
        if module.decay == "learned":
            init.copy_(module.decay_logits, learned_decay_init(heads)[module.heads()])
        else:
            values = fixed_log_decay(module.decay, heads, module.layer_idx, module.num_layers)[module.heads()]
            init.copy_(module.fixed_log_decay_bits, values.contiguous().view(torch.int64))


class ZooLinearModel(ZooLinearPreTrainedModel, ResidualSchedule, ZooDecoderModel):
    def __init__(self, config):
        super().__init__(config)
        # Set by the "sp" layout (sharding.py); None = one device.
        self.sp_group = None

    def make_layer(self, config, layer_idx):
        return LinearDecoderLayer(config, layer_idx)

    def sequence_offset(self, q_len: int) -> int:
        """Under sequence parallelism rank r's chunk of q_len tokens starts at r * q_len (0 on one device)."""
        return 0 if self.sp_group is None else chunk_offset(self.sp_group, q_len)

    def make_rotary(self, config) -> RotaryEmbedding | None:
        """RoPE for the softmax layers of a hybrid; a pure linear model has no positions at all."""
        return super().make_rotary(config) if config.num_linear_layers < config.num_hidden_layers else None

    def make_cache(
        self, batch_size: int | None = None, max_cache_len: int | None = None, static: bool = False
    ) -> LinearCache:
        """States for the linear layers, KV caches for the softmax layers; neither needs sizes up front
        (`static`: the states in place and the K/V in buffers of `max_cache_len` tokens)."""
        if static:
            return LinearCache(self.config, self.static_capacity(max_cache_len), self.device)
        return LinearCache(self.config)


class ZooLinearForCausalLM(ZooLinearPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooLinearModel
    shard_plan = PLAN
