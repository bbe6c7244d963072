"""GQLA: group-query latent attention (docs/architectures.md#gqla): one set of weights, two exact decode
paths.

Per layer, in DeepSeek MLA's notation (H query heads, n_g groups, head h in group g(h) = h // (H / n_g)):

    c    = W_DKV x                      kv_a_proj, d -> d_c   (optionally RMSNorm'd: kv_a_layernorm)
    k_r  = RoPE(W_KR x)                 k_rope_proj, d -> d_r: ONE RoPE key, shared by every head
    q_h  = [q_h^nope ; RoPE(q_h^r)]     q_proj, d -> H (d_nope + d_r), each head's row block [nope ; rope]
                                        (with q_lora_rank d_q: q_b_proj(RMSNorm(q_a_proj x)), DeepSeek's)
    W_UK^(g) [d_nope, d_c], W_UV^(g) [d_v, d_c]     k_up [n_g, d_nope, d_c], v_up [n_g, d_v, d_c]
    out  = o_proj(concat_h o_h)         o_proj, H d_v -> d

Both paths compute softmax_t((q_h . K_g(h),t) / sqrt(d_nope + d_r)) over the same keys and values:
- gqa: per-group keys and values K_g = [W_UK^(g) c ; k_r], V_g = W_UV^(g) c, cached per group, and standard
  grouped attention (SDPA with enable_gqa). Under TP a rank holds and caches only its groups (sharding.py).
- absorb: W_UK^(g) is absorbed into the query and W_UV^(g) into the output:
      score_h,t = (W_UK^(g)^T q_h^nope) . c_t + q_h^r . k_r,t,    o_h = W_UV^(g) (sum_t p_h,t c_t),
  which is multi-query attention over the latent: one key [c ; k_r] and one value c for all heads. Only
  [c ; k_r] is cached: d_c + d_r values per token per layer, whatever H and n_g.
The path is `config.attn_path`, read at every forward: `model.set_attn_path("gqa")` switches a loaded
model. RoPE touches the d_r dims only (the trunk's `make_rotary` hook at dim d_r).

Caches (made by the trunk's `make_cache` hook, so forward and generate() get the right one):
- `LatentCache` (absorb): a `LatentLayer` per layer holding [c ; k_r] as the key of a single KV head. The
  absorbed value is c, the key's first d_c dims, so the layer's values are zero-width: nothing is stored
  twice.
- `GroupedKVCache` (gqa): a transformers `DynamicLayer` per layer with keys [B, n_g, T, d_nope + d_r] and
  values [B, n_g, T, d_v] (this rank's groups under TP).
`make_cache(max_cache_len=N, static=True)` gives either in static buffers (`StaticLatentLayer`,
models.common.cache's `StaticKVLayer`), for a compiled decode step.
`model.expand_cache(latent_cache)` (or `latent_cache.to_gqa(model)`) up-projects an absorb cache into gqa
form, so decoding can switch paths mid-sequence. A plain transformers cache (DynamicCache) also works, on
whichever one path fills it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicLayer

from models.common import (
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    ZooDecoderModel,
    ZooForCausalLM,
    ZooPreTrainedModel,
    apply_rotary_pos_emb,
)
from models.common.attention import merge_heads
from models.common.cache import StaticKVLayer, cache_capacity, is_static
from models.common.residual import ResidualSchedule
from models.gqla.configuration import ATTN_PATHS, ZooGQLAConfig
from models.gqla.sharding import PLAN
from parallel import comm

# --- caches


class LatentLayer(DynamicLayer):
    """The absorb path's cache of one layer: [c ; k_r] per token, as the key of one KV head
    (`keys` [B, 1, T, d_c + d_r]). The value is c, the key's first d_c dims, so `values` is zero-width
    ([B, 1, T, 0]); every DynamicLayer operation (crop, beam reorder, batch select) applies unchanged."""

    @property
    def latent(self) -> torch.Tensor | None:
        """[B, T, d_c + d_r], or None before the first token."""
        return None if self.keys is None or not self.is_initialized else self.keys[:, 0]


class StaticLatentLayer(StaticKVLayer):
    """`LatentLayer` in a static buffer of `max_cache_len` tokens (models.common.cache): keys
    [B, 1, max_cache_len, d_c + d_r], zero-width values, the fill level on the device."""

    @property
    def latent(self) -> torch.Tensor | None:
        """[B, max_cache_len, d_c + d_r] (slots past the fill level are empty), or None before the first token."""
        return self.keys[:, 0] if self.is_initialized else None


class LatentCache(Cache):
    """The absorb path's cache: a `LatentLayer` per model layer (a `StaticLatentLayer` of `max_cache_len`
    tokens with `max_cache_len` given)."""

    attn_path = "absorb"

    def __init__(self, num_layers: int, max_cache_len: int | None = None, device=None):
        if max_cache_len is None:
            layers = [LatentLayer() for _ in range(num_layers)]
        else:
            layers = [StaticLatentLayer(max_cache_len, device) for _ in range(num_layers)]
        super().__init__(layers=layers)

    def to_gqa(self, model) -> "GroupedKVCache":
        """This cache in gqa form, up-projected with `model`'s weights (see `ZooGQLAModel.expand_cache`)."""
        return model.expand_cache(self)


class GroupedKVCache(Cache):
    """The gqa path's cache: per layer, each (local) group's keys [W_UK^(g) c ; k_r] and values W_UV^(g) c
    (static buffers of `max_cache_len` tokens with `max_cache_len` given)."""

    attn_path = "gqa"

    def __init__(self, num_layers: int, max_cache_len: int | None = None, device=None):
        if max_cache_len is None:
            layers = [DynamicLayer() for _ in range(num_layers)]
        else:
            layers = [StaticKVLayer(max_cache_len, device) for _ in range(num_layers)]
        super().__init__(layers=layers)


# --- the attention


class GroupQueryLatentAttention(nn.Module):
    """Latent keys and values shared by all heads, group-indexed up-projections; two exact paths (module doc).

    `forward` returns o_proj of this rank's heads: under TP (gqa path only) a partial sum that the decoder
    layer all-reduces.
    """

    def __init__(self, config: ZooGQLAConfig, layer_idx: int):
        super().__init__()
        self.config = config  # `attn_path` is read from it at every forward
        self.layer_idx = layer_idx
        # Local counts: the TP layout divides them by the degree (sharding.py).
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_kv_groups
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.v_head_dim = config.v_head_dim
        self.softmax_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        d, bias = config.hidden_size, config.attention_bias
        q_width = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        # DeepSeek-V2 / V3's query low-rank path (q_lora_rank) or one full-rank q_proj (V2-Lite, Llama-like);
        # the absent modules are None, as in transformers' DeepseekV3Attention.
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, q_width, bias=bias)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_width, bias=bias)
        self.kv_a_proj = nn.Linear(d, self.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = (
            RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps) if config.kv_a_layernorm else None
        )
        self.k_rope_proj = nn.Linear(d, self.qk_rope_head_dim, bias=bias)
        self.k_up = nn.Parameter(torch.empty(self.num_groups, self.qk_nope_head_dim, self.kv_lora_rank))
        self.v_up = nn.Parameter(torch.empty(self.num_groups, self.v_head_dim, self.kv_lora_rank))
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, d, bias=bias)
        self.tp_group = None  # set by the "gqla_groups" layout; None = single device

    def forward(self, x, position_embeddings, attention_mask=None, cache=None):
        bsz, q_len, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(bsz, q_len, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c = self.kv_a_proj(x)
        if self.kv_a_layernorm is not None:
            c = self.kv_a_layernorm(c)
        k_rope = self.k_rope_proj(x)[:, None]  # [B, 1, T, d_r]: one key head for all query heads
        cos, sin = position_embeddings
        q_rope, k_rope = apply_rotary_pos_emb(q_rope, k_rope, cos, sin)
        latent = torch.cat([c[:, None], k_rope], dim=-1)  # [B, 1, T, d_c + d_r]
        # Under TP every rank computes the same latent and reads it with its own groups only: Megatron's f
        # (identity forward, all-reduce of the gradient backward) gives the replicated W_DKV and W_KR their
        # full gradients. (q_proj's input gets its own f from the colwise role.)
        latent = comm.copy_to_tp_region(latent, self.tp_group)
        if self.config.attn_path == "absorb":
            out = self.absorbed_attention(q_nope, q_rope, latent, attention_mask, cache)
        else:
            out = self.grouped_attention(q_nope, q_rope, latent, attention_mask, cache)
        return self.o_proj(merge_heads(out))

    def per_group(self, x: torch.Tensor, equation: str, weight: torch.Tensor) -> torch.Tensor:
        """Apply group g's matrix of `weight` [n_g, ., .] to the heads of group g: x [B, H, T, D] viewed as
        [B, n_g, H / n_g, T, D] (heads are ordered by group)."""
        bsz, heads, q_len, _ = x.shape
        x = x.view(bsz, self.num_groups, heads // self.num_groups, q_len, -1)
        return torch.einsum(equation, x, weight).reshape(bsz, heads, q_len, -1)

    def absorbed_attention(self, q_nope, q_rope, latent, attention_mask, cache):
        """MQA over the latent: o_h = W_UV^(g) softmax((W_UK^(g)^T q_h^nope) . c + q_h^r . k_r) c.
        Returns [B, H, T, d_v]."""
        if self.tp_group is not None:
            raise ValueError(
                "attn_path='absorb' runs on one device only (its latent cache is shared by every head); this "
                "model is sharded over TP: use model.set_attn_path('gqa')."
            )
        if cache is not None:
            # The value is the key's first d_c dims: nothing more is stored (LatentLayer).
            latent, _ = cache.update(latent, latent[..., :0], self.layer_idx)
        # W_UK^(g)^T q_h^nope: the query in latent space, [B, H, T, d_c].
        q_latent = self.per_group(q_nope, "bgmtn,gnc->bgmtc", self.k_up)
        query = torch.cat([q_latent, q_rope], dim=-1)
        o_latent = F.scaled_dot_product_attention(
            query,
            latent,
            latent[..., : self.kv_lora_rank],
            attn_mask=attention_mask,
            is_causal=attention_mask is None and query.shape[2] > 1,
            scale=self.softmax_scale,  # of the query head's own width, not of the latent's
            enable_gqa=True,
        )
        return self.per_group(o_latent, "bgmtc,gvc->bgmtv", self.v_up)

    def grouped_attention(self, q_nope, q_rope, latent, attention_mask, cache):
        """Standard grouped attention over the per-group keys and values. [B, H, T, d_v]"""
        key, value = self.expand(latent)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        query = torch.cat([q_nope, q_rope], dim=-1)
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            is_causal=attention_mask is None and query.shape[2] > 1,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_groups,
        )

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, 1, T, d_c + d_r] -> this module's groups' keys K_g = [W_UK^(g) c ; k_r]
        [B, n_g, T, d_nope + d_r] and values V_g = W_UV^(g) c [B, n_g, T, d_v]."""
        c, k_rope = latent[:, 0].split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = torch.einsum("btc,gnc->bgtn", c, self.k_up)
        value = torch.einsum("btc,gvc->bgtv", c, self.v_up)
        key = torch.cat([k_nope, k_rope[:, None].expand(-1, self.num_groups, -1, -1)], dim=-1)
        return key, value


class GQLADecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block (attention then SwiGLU MLP) with group-query latent attention."""

    def __init__(self, config: ZooGQLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = GroupQueryLatentAttention(config, layer_idx)


# --- the model


class ZooGQLAPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooGQLAConfig
    config: ZooGQLAConfig
    _no_split_modules = ["GQLADecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GroupQueryLatentAttention):
            # Stacked up-projections: initialised like the other projections (nn.Linear weights).
            init.normal_(module.k_up, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.v_up, mean=0.0, std=self.config.initializer_range)


class ZooGQLAModel(ZooGQLAPreTrainedModel, ResidualSchedule, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return GQLADecoderLayer(config, layer_idx)

    def make_rotary(self, config) -> RotaryEmbedding:
        """RoPE over the d_r dims of the decoupled key and of each query head's rope part, nothing else."""
        return RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim)

    def make_cache(self, batch_size: int | None = None, max_cache_len: int | None = None, static: bool = False) -> Cache:
        """The current path's cache: [c ; k_r] per layer (absorb) or this rank's groups' K and V (gqa);
        `static`: in fixed buffers of `max_cache_len` tokens."""
        layers = self.config.num_hidden_layers
        size = self.static_capacity(max_cache_len) if static else None
        kind = LatentCache if self.config.attn_path == "absorb" else GroupedKVCache
        return kind(layers, size, self.device)

    @property
    def tp_sharded(self) -> bool:
        return self.layers[0].self_attn.tp_group is not None

    def set_attn_path(self, path: str) -> None:
        """Run the `path` ("absorb" | "gqa") from the next forward on; the weights are the same. A cache of
        the other path's form is refused then: expand an absorb cache with `expand_cache` first."""
        if path not in ATTN_PATHS:
            raise ValueError(f"attn_path={path!r} is not a GQLA decode path; use 'absorb' or 'gqa'.")
        if path == "absorb" and self.tp_sharded:
            raise ValueError(
                "attn_path='absorb' cannot run on a model sharded over TP (its latent cache is shared by every "
                "head and would not split); keep 'gqa', or use the unsharded model."
            )
        self.config.attn_path = path

    def expand_cache(self, cache: Cache) -> "GroupedKVCache":
        """An absorb-path cache ([c ; k_r] per token) in gqa form: each (local) group's
        K_g = [W_UK^(g) c ; k_r] and V_g = W_UV^(g) c, up-projected with this model's weights. The latent
        cache is left as it was."""
        if getattr(cache, "attn_path", None) != "absorb":
            raise ValueError(
                f"expand_cache takes the absorb path's LatentCache ([c ; k_r] per token), not a "
                f"{type(cache).__name__}; a gqa cache is already expanded."
            )
        static = is_static(cache)
        size = cache_capacity(cache) if static else None
        out = GroupedKVCache(len(cache.layers), size, self.device)
        for layer, old, new in zip(self.layers, cache.layers, out.layers, strict=True):
            if old.latent is not None:
                # A static buffer is expanded whole (slots past the fill level stay masked), then takes the
                # latent's fill level.
                new.update(*layer.self_attn.expand(old.keys))
                if static:
                    new.cumulative_length.copy_(old.cumulative_length)
        return out

    def kv_bytes_per_token(self, path: str | None = None, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes per token per layer that this model (this rank, under TP) holds on `path` (default:
        the current one) in `dtype` (default: the model's). See ZooGQLAConfig.kv_bytes_per_token."""
        tp = self.config.num_kv_groups // self.layers[0].self_attn.num_groups
        return self.config.kv_bytes_per_token(path, self.dtype if dtype is None else dtype, tp=tp)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        form, path = getattr(cache, "attn_path", None), self.config.attn_path
        # form None: a plain transformers cache, filled by whichever one path runs.
        if form is not None and form != path:
            fix = (
                "expand it first: cache = model.expand_cache(cache)"
                if form == "absorb"
                else "a gqa cache cannot be compressed back into the latent; keep attn_path='gqa' for this "
                "sequence, or prefill again on the absorb path"
            )
            raise ValueError(
                f"The cache is in the {form} path's form but the model runs attn_path={path!r}; {fix}."
            )
        return super().run_layers(hidden_states, position_embeddings, attention_mask, cache)


class ZooGQLAForCausalLM(ZooGQLAPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooGQLAModel
    shard_plan = PLAN

    @property
    def attn_path(self) -> str:
        return self.config.attn_path

    def set_attn_path(self, path: str) -> None:
        """See ZooGQLAModel.set_attn_path."""
        self.model.set_attn_path(path)

    def expand_cache(self, cache: Cache) -> GroupedKVCache:
        """See ZooGQLAModel.expand_cache."""
        return self.model.expand_cache(cache)

    def kv_bytes_per_token(self, path: str | None = None, dtype: torch.dtype | None = None) -> int:
        """See ZooGQLAModel.kv_bytes_per_token."""
        return self.model.kv_bytes_per_token(path, dtype)
