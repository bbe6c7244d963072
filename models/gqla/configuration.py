"""Configuration of GQLA (group-query latent attention; docs/architectures.md#gqla): a Llama config plus
the latent-attention fields, in DeepSeek MLA's names.

- `kv_lora_rank` (d_c): width of the shared latent c = W_DKV x, the one vector per token (with k_r) that
  the absorb path caches. At most the full rank, min(hidden_size, n_g x (qk_nope_head_dim + v_head_dim)):
  the keys and values of all groups are a linear map of c, so a wider latent adds parameters and cache but
  nothing the model can express.
- `qk_rope_head_dim` (d_r): width of the one decoupled RoPE key k_r = RoPE(W_KR x), shared by every head,
  and of each query head's RoPE part. RoPE is applied to these dims only (rotate-half pairing, dim i with
  i + d_r/2, frequencies rope_theta^(-2i/d_r): `RotaryEmbedding(rope_parameters, d_r)`).
- `qk_nope_head_dim` (d_nope, may be 0): each query head's and each group key's part without position.
  Default: head_dim - qk_rope_head_dim, so a query head is as wide as a Llama head.
- `v_head_dim` (d_v): each group's value width. Default: head_dim.
- `num_kv_groups` (n_g): the groups of the up-projections W_UK^(g), W_UV^(g); query head h reads group
  h // (num_attention_heads / n_g). It is the same number as GQA's KV heads (on the gqa path each group is
  exactly one KV head of the cache), so it is stored as Llama's `num_key_value_heads` (an `attribute_map`
  alias: both names read and write the one value; config.json has `num_key_value_heads`). A Llama shape
  thereby gives its GQLA at the same grouping, and TP degrees divide it as they divide KV heads.
- `attn_path` (`absorb` | `gqa`): which exact decode path the attention runs, over the same weights:
  `absorb` caches [c ; k_r] (d_c + d_r values per token per layer) and absorbs W_UK / W_UV into the query
  and the output; `gqa` caches each group's K_g = [W_UK^(g) c ; k_r] and V_g = W_UV^(g) c and runs
  standard grouped attention (the one that shards over TP). Switch a loaded model with
  `model.set_attn_path(...)`; `model.expand_cache(cache)` turns an absorb cache into gqa form.
- `q_lora_rank` (d_q, default None): DeepSeek-V2 / V3's query low-rank path, q = q_b_proj(RMSNorm(q_a_proj x))
  with q_a_proj d -> d_q and q_b_proj d_q -> H (d_nope + d_r) (the norm is `q_a_layernorm`, always there, as
  in DeepSeek). None: one full-rank `q_proj`, as DeepSeek-V2-Lite. It changes the query only, so both decode
  paths and their caches are the same; under TP q_b_proj is split by heads as q_proj is, the query latent
  replicated (sharding.py).
- `kv_a_layernorm` (default False): an RMSNorm on the latent c, as DeepSeek MLA has. Off by default: a
  latent converted from a GQA checkpoint (TransGQLA) is exact only without it, since the norm would rescale
  each token's keys and values.

The softmax scale is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), the query head's width, on both paths.
`head_dim` is Llama's field; GQLA uses it only for the defaults above.
"""

import torch

from models.common.residual import check_residual
from models.llama.configuration import ZooLlamaConfig

ATTN_PATHS = ("absorb", "gqa")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class ZooGQLAConfig(ZooLlamaConfig):
    model_type = "zoo_gqla"
    # n_g is GQA's number of KV heads: one stored value, two names (module docstring).
    attribute_map = {"num_kv_groups": "num_key_value_heads"}

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    attn_path: str = "absorb"
    kv_a_layernorm: bool = False
    q_lora_rank: int | None = None
    # The residual schedule (models/common/residual.py): "ladder" waits each laddered sub-block's TP all-reduce
    # one sub-block later; `ladder_layers` as Ladder's (None: every layer).
    residual: str = "standard"
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        # The group checks come first so that their message names n_g, not Llama's KV heads.
        heads, groups = self.num_attention_heads, self.num_key_value_heads
        # The head widths left unset follow Llama's head_dim (filled from hidden_size / heads by then).
        if self.qk_nope_head_dim is None and isinstance(self.head_dim, int):
            self.qk_nope_head_dim = self.head_dim - self.qk_rope_head_dim
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if not _positive_int(groups):
            raise ValueError(
                f"num_kv_groups={groups!r} must be a positive integer: the number of up-projection groups."
            )
        if _positive_int(heads) and heads % groups != 0:
            raise ValueError(
                f"num_attention_heads={heads} is not divisible by num_kv_groups={groups} (stored as "
                f"num_key_value_heads): every group serves the same number of query heads; num_kv_groups must "
                f"be one of {_divisors(heads)}."
            )
        super().validate()
        self.ladder_layers = check_residual(self.residual, self.ladder_layers, self.num_hidden_layers)
        if self.attn_path not in ATTN_PATHS:
            raise ValueError(
                f"attn_path={self.attn_path!r} is not a GQLA decode path; use 'absorb' (latent cache) or 'gqa' "
                "(per-group cache, the one that shards over TP)."
            )
        d_r, d_nope, d_v = self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        if not _positive_int(d_r) or d_r % 2 != 0:
            raise ValueError(
                f"qk_rope_head_dim={d_r!r} must be a positive even integer: RoPE rotates pairs of dims."
            )
        if isinstance(d_nope, bool) or not isinstance(d_nope, int) or d_nope < 0:
            raise ValueError(
                f"qk_nope_head_dim={d_nope!r} must be an integer >= 0 (0: queries and keys are all RoPE dims); "
                f"its default, head_dim - qk_rope_head_dim = {self.head_dim} - {d_r}, needs head_dim >= "
                "qk_rope_head_dim, or set it explicitly."
            )
        if not _positive_int(d_v):
            raise ValueError(f"v_head_dim={d_v!r} must be a positive integer.")
        if self.q_lora_rank is not None and not _positive_int(self.q_lora_rank):
            raise ValueError(
                f"q_lora_rank={self.q_lora_rank!r} must be a positive integer (the width of the query latent, "
                "DeepSeek-V2 / V3's q_a_proj) or null (one full-rank q_proj)."
            )
        if not isinstance(self.kv_a_layernorm, bool):
            raise ValueError(f"kv_a_layernorm={self.kv_a_layernorm!r} must be true or false.")
        d_c, full = self.kv_lora_rank, self.full_rank
        if not _positive_int(d_c):
            raise ValueError(f"kv_lora_rank={d_c!r} must be a positive integer: the width of the latent c.")
        if d_c > full:
            raise ValueError(
                f"kv_lora_rank={d_c} is larger than the full rank of the keys and values it encodes, "
                f"min(hidden_size={self.hidden_size}, num_kv_groups x (qk_nope_head_dim + v_head_dim) = "
                f"{groups} x ({d_nope} + {d_v})) = {full}: a wider latent adds cache but nothing the model can "
                f"express; use kv_lora_rank in 1..{full}."
            )

    @property
    def full_rank(self) -> int:
        """The most dims the latent can usefully have: the rank of x -> [K_nope; V] over all groups."""
        return min(self.hidden_size, self.num_key_value_heads * (self.qk_nope_head_dim + self.v_head_dim))

    def kv_bytes_per_token(
        self, path: str | None = None, dtype: torch.dtype = torch.bfloat16, tp: int = 1
    ) -> int:
        """KV-cache bytes per token per layer on `path` (default: `attn_path`), on one of `tp` ranks.

        absorb: [c ; k_r], d_c + d_r values, the same on every rank (the path does not shard).
        gqa: per group [W_UK^(g) c ; k_r] and W_UV^(g) c, n_g (d_nope + d_r + d_v) values, 1/tp of them
        per rank. At the Llama-3-8B shape (8 groups, d_nope = d_r = 64, d_v = 128, d_c = 512) absorb is
        576 values against gqa's 2048 = Llama's 2 x 8 x 128: 28.125%.
        """
        path = self.attn_path if path is None else path
        if path not in ATTN_PATHS:
            raise ValueError(f"path={path!r} is not a GQLA decode path; use 'absorb' or 'gqa'.")
        if path == "absorb":
            values = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_group = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
            values = self.num_key_value_heads // tp * per_group
        return values * torch.empty((), dtype=dtype).element_size()

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it).

        Per layer the attention has q_proj (d -> H (d_nope + d_r)) or, with q_lora_rank d_q, q_a_proj
        (d -> d_q), q_a_layernorm (d_q) and q_b_proj (d_q -> H (d_nope + d_r)), kv_a_proj = W_DKV (d -> d_c),
        k_rope_proj = W_KR (d -> d_r), k_up [n_g, d_nope, d_c], v_up [n_g, d_v, d_c], o_proj (H d_v -> d)
        and, if asked, kv_a_layernorm (d_c); it replaces Llama's q, k, v, o.
        """
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        d_c, d_r, d_nope, d_v = (
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )
        llama_attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        d_q = self.q_lora_rank
        query = d * h * (d_nope + d_r) if d_q is None else d * d_q + d_q + d_q * h * (d_nope + d_r)
        attn = query + d * d_c + d * d_r + kv * (d_nope + d_v) * d_c + h * d_v * d
        if self.attention_bias:
            llama_attn += h * hd + 2 * kv * hd + d
            attn += h * (d_nope + d_r) + d_c + d_r + d + (0 if d_q is None else d_q)
        if self.kv_a_layernorm:
            attn += d_c
        return super().num_parameters_formula() + self.num_hidden_layers * (attn - llama_attn)
