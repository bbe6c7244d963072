"""Llama (GQA) -> GQLA conversion: TransGQLA (docs/architectures.md#gqla, extending TransMLA).

Per layer, with the source's H query heads, n_g KV heads (= GQLA groups), head_dim hd and RoPE in
rotate-half pairing (pair i = dims (i, i + hd/2), frequency theta^(-2i/hd)):

1. RoRoPE. GQLA keeps RoPE on d_r = qk_rope_head_dim dims of ONE shared key, with frequencies
   theta^(-2j/d_r), j < d_r/2: exactly the source's pairs i = j * hd/d_r (evenly spaced; the kept
   frequencies are fixed by the model's RoPE, no config change). For each kept pair i, a joint PCA across the
   n_g KV heads (covariance of the n_g heads' pair-i keys over both dims of the pair, from calibration
   activations) gives the top direction u (unit, length n_g): the shared RoPE key is k_r,i = sum_g u_g k_g,i,
   and query head h's RoPE part is u_g(h) q_h,i. A rotation mixing heads with the same real coefficients on
   both dims of a pair commutes with RoPE, so the scores keep RoPE on that part; the residual
   k_g,i - u_g k_r,i (the other principal directions) is dropped. The other pairs of every group keep their
   keys without RoPE: they are the nope part (d_nope = hd - d_r, the default), in the source's dim order.
   With one KV head u = [1], so nothing is dropped; with d_r = hd there are no nope dims.
2. Balance: the nope keys are divided by alpha = rms(K_nope) / rms(V) (from calibration) so that K and V
   weigh the same in the joint factorisation; the query's nope part is multiplied by alpha.
3. Joint low rank: Z = [K_nope / alpha ; V] over all groups (n_g (d_nope + hd) values, a linear map W of the
   attention input x). With the calibration covariance C = E[x x^T], the top d_c eigenvectors B of W C W^T
   give W_DKV = B^T W (kv_a_proj), and each group's W_UK^(g), W_UV^(g) are B's rows for that group.
   At full rank (d_c = rank of W) B B^T W = W: exact.
4. Written as GQLA: q_proj rows per head [alpha q_nope ; u_g q_rope], k_rope_proj the shared RoPE key,
   o_proj, MLP, norms, embeddings, LM head copied.

Exact (up to float rounding) for one KV head, d_r = head_dim, full rank; lossy otherwise, less so as d_c
grows. `LLAMA_TO_GQLA` is the converter `train.convert` runs:
`python -m train.convert converter=llama_to_gqla source=DIR kv_lora_rank=32 qk_rope_head_dim=8`.
The rank sweep (several ranks from one calibration, validation loss per rank) is an evaluation:
`python -m eval.gqla_rank_sweep` (eval/gqla_rank_sweep.py).
"""

from functools import partial
from pathlib import Path

import torch

from models.gqla.configuration import ZooGQLAConfig
from models.gqla.modeling import ZooGQLAForCausalLM
from models.llama.configuration import ZooLlamaConfig
from models.llama.modeling import ZooLlamaForCausalLM
from models.registry import LLAMA_TYPES, config_summary, from_llama
from models.weight_map import Rule, check_mapped, map_weights

CONVERTIBLE = LLAMA_TYPES
GQLA_OPTIONS = ("kv_lora_rank", "qk_rope_head_dim", "calibration_batches")
NOT_COPIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")
DEFAULT_CALIBRATION_BATCHES = 8


def target_config(source_config: ZooLlamaConfig, kv_lora_rank: int | None, qk_rope_head_dim: int | None):
    """The GQLA config for a Llama config: same shapes, n_g = KV heads, d_nope = hd - d_r, d_v = hd.

    One clear error for options that do not fit (d_c above full rank, d_r not dividing head_dim, ...)."""
    hd = source_config.head_dim
    fields = {k: v for k, v in source_config.to_dict().items() if k not in NOT_COPIED}
    d_r = hd if qk_rope_head_dim is None else qk_rope_head_dim
    if source_config.attention_bias:
        raise ValueError("TransGQLA converts Llamas without attention biases (attention_bias=False).")
    rope_type = (source_config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"TransGQLA keeps the source's RoPE frequencies only for rope_type='default', not {rope_type!r}."
        )
    if not isinstance(d_r, int) or d_r < 2 or d_r % 2 or hd % d_r:
        raise ValueError(
            f"qk_rope_head_dim={d_r} must be an even divisor of head_dim={hd}: GQLA's RoPE frequencies "
            f"theta^(-2j/d_r) are the source's every (head_dim/d_r)-th frequency pair."
        )
    groups = source_config.num_key_value_heads
    full = min(source_config.hidden_size, groups * (hd - d_r + hd))
    d_c = full if kv_lora_rank is None else kv_lora_rank
    if not isinstance(d_c, int) or not 1 <= d_c <= full:
        raise ValueError(
            f"kv_lora_rank={d_c} is out of range for this checkpoint: the latent encodes the nope keys and values "
            f"of {groups} KV heads, n_g x (d_nope + d_v) = {groups} x ({hd - d_r} + {hd}), at most hidden_size="
            f"{source_config.hidden_size}: full rank {full}; use kv_lora_rank in 1..{full}."
        )
    fields.update(
        kv_lora_rank=d_c,
        qk_rope_head_dim=d_r,
        qk_nope_head_dim=hd - d_r,
        v_head_dim=hd,
        attn_path="absorb",
        kv_a_layernorm=False,
    )
    return ZooGQLAConfig(**fields)


def run_calibration(model, batches, hooks: list) -> None:
    """Run `batches` of token ids through `model` in eval mode without a cache, for the statistics its `hooks`
    (the handles of the forward hooks that gather them) collect; then remove the hooks and put the model back
    in its mode, even on an error."""
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)


@torch.no_grad()
def calibrate(model: ZooLlamaForCausalLM, batches) -> list[torch.Tensor]:
    """Per layer, the second moment E[x x^T] (fp64, [d, d]) of the attention input over `batches` of ids."""
    layers = model.model.layers
    sums = [
        torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64) for _ in layers
    ]
    counts = [0] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):

        def hook(module, args, kwargs, i=i):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
            x = x.reshape(-1, x.shape[-1]).double().cpu()
            sums[i] += x.T @ x
            counts[i] += x.shape[0]

        hooks.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    run_calibration(model, batches, hooks)
    if not counts[0]:
        raise ValueError("No calibration batches: give at least one batch of token ids.")
    return [s / n for s, n in zip(sums, counts, strict=True)]


@torch.no_grad()
def convert_model(
    model: ZooLlamaForCausalLM,
    covariances: list[torch.Tensor],
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
) -> ZooGQLAForCausalLM:
    """TransGQLA of a loaded Llama with per-layer attention-input covariances (module docstring)."""
    src = model.config
    config = target_config(src, kv_lora_rank, qk_rope_head_dim)
    H, G, hd, d = src.num_attention_heads, src.num_key_value_heads, src.head_dim, src.hidden_size
    d_r, d_c = config.qk_rope_head_dim, config.kv_lora_rank
    d_nope, half, step = hd - d_r, hd // 2, hd // d_r
    kept = torch.arange(0, half, step)  # source pairs kept with RoPE: j * hd / d_r
    rope_dims = torch.cat([kept, kept + half])  # rotate-half layout of the d_r dims
    dropped = torch.tensor([i for i in range(half) if i % step])
    nope_dims = torch.cat([dropped, dropped + half]) if d_nope else torch.zeros(0, dtype=torch.long)
    per_group = H // G

    def attention(q_proj, k_proj, v_proj, cov):
        """One layer's q / k / v weights -> its q_proj, kv_a_proj, k_rope_proj, k_up, v_up (steps 1-4)."""
        wq = q_proj.double().view(H, hd, d)
        wk = k_proj.double().view(G, hd, d)
        wv = v_proj.double().view(G, hd, d)
        # 1. RoRoPE: per kept pair, the top principal direction across the KV heads.
        k_rope = torch.empty(d_r, d, dtype=torch.float64)
        u = torch.empty(len(kept), G, dtype=torch.float64)
        for j, i in enumerate(kept.tolist()):
            pair = wk[:, [i, i + half]]  # [G, 2, d]
            c_pair = torch.einsum("gad,de,hae->gh", pair, cov, pair)  # summed over both dims of the pair
            _, vecs = torch.linalg.eigh(c_pair)
            top = vecs[:, -1]
            top = top * (1.0 if top.sum() >= 0 else -1.0)
            u[j] = top
            k_rope[j] = torch.einsum("g,gd->d", top, pair[:, 0])
            k_rope[j + d_r // 2] = torch.einsum("g,gd->d", top, pair[:, 1])
        u_full = torch.cat([u, u])  # [d_r, G]: coefficient of each rope dim per group
        # 2. Balance K_nope and V.
        k_nope = wk[:, nope_dims]  # [G, d_nope, d]

        def energy(w):
            """Mean squared activation of the rows of w [.., d] under the covariance."""
            w = w.reshape(-1, d)
            return torch.einsum("nd,de,ne->", w, cov, w).clamp_min(1e-30) / w.shape[0]

        alpha = 1.0
        if d_nope:
            alpha = float((energy(k_nope) / energy(wv)).sqrt())
        # 3. Joint low-rank factorisation of [K_nope / alpha ; V] per group.
        w = torch.cat([k_nope / alpha, wv], dim=1).reshape(-1, d)  # [G (d_nope + hd), d]
        _, vecs = torch.linalg.eigh(w @ cov @ w.T)
        basis = vecs[:, -d_c:].flip(-1)  # [G (d_nope + hd), d_c]
        up = basis.view(G, d_nope + hd, d_c)
        # 4. Queries: per head [alpha q_nope ; u_g q_rope].
        groups = torch.arange(H) // per_group
        q_nope = wq[:, nope_dims] * alpha
        q_rope = wq[:, rope_dims] * u_full[:, groups].T[:, :, None]
        new_q = torch.cat([q_nope, q_rope], dim=1).reshape(H * (d_nope + d_r), d)
        return new_q, basis.T @ w, k_rope, up[:, :d_nope], up[:, d_nope:]

    rules = []  # one a layer, with that layer's covariance; MLP, norms, embeddings, LM head copied
    for layer, cov in enumerate(covariances):
        a = f"model.layers.{layer}.self_attn."
        sources = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
        targets = (a + "q_proj.weight", a + "kv_a_proj.weight", a + "k_rope_proj.weight", a + "k_up", a + "v_up")
        rules.append(Rule(sources, targets, partial(attention, cov=cov)))
    new_state = map_weights(model.state_dict(), rules)
    target = ZooGQLAForCausalLM(config).to(torch.float64 if model.dtype == torch.float64 else torch.float32)
    own = target.state_dict()
    check_mapped(new_state, own, "TransGQLA")
    target.load_state_dict({k: v.to(own[k].dtype) for k, v in new_state.items()})
    return target.to(model.dtype)


def load_source(source: str | Path) -> ZooLlamaForCausalLM:
    return ZooLlamaForCausalLM.from_pretrained(source)


def llama_to_gqla(
    source: str | Path,
    batches: list[torch.Tensor],
    kv_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    calibration_batches: int | None = None,
) -> ZooGQLAForCausalLM:
    """TransGQLA of the Llama checkpoint at `source`, calibrated on `batches` (token ids: train.convert hands
    it the first `calibration_batches` training batches of its data, `Converter.calibration`)."""
    check_options(source, kv_lora_rank, qk_rope_head_dim, calibration_batches)
    model = load_source(source)
    return convert_model(model, calibrate(model, batches), kv_lora_rank, qk_rope_head_dim)


def check_options(source, kv_lora_rank=None, qk_rope_head_dim=None, calibration_batches=None) -> None:
    """One clear error for options that do not fit the checkpoint, from its config alone."""
    if calibration_batches is not None and (
        not isinstance(calibration_batches, int) or calibration_batches < 1
    ):
        raise ValueError(f"calibration_batches={calibration_batches!r} must be a positive integer.")
    target_config(ZooLlamaConfig.from_pretrained(source), kv_lora_rank, qk_rope_head_dim)


def _kv_cache_fraction_absorb(c) -> float:
    llama_bytes = 2 * c.num_key_value_heads * c.head_dim * 2  # bf16 GQA K and V
    return round(c.kv_bytes_per_token("absorb") / llama_bytes, 6)


summary = config_summary(
    "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "num_kv_groups",
    kv_cache_fraction_absorb=_kv_cache_fraction_absorb,
)

LLAMA_TO_GQLA = from_llama("gqla", "GQLA", llama_to_gqla, summary, check=check_options, options=GQLA_OPTIONS,
                           source_types=CONVERTIBLE, calibration=DEFAULT_CALIBRATION_BATCHES)
