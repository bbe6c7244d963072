"""Regrouping a GQLA to fewer groups (TransGQLA-style): DeepSeek's MLA (one group per head) -> n_g groups.

GQLA's point is the gqa path: each group's keys and values are one KV head of a standard grouped cache,
sharded over TP by groups, n_g (d_nope + d_r + d_v) values per token per layer. A model converted from
DeepSeek has a group per head (its cache on that path is MHA's); regrouping merges the m = n_old / n_new
consecutive groups of each new group (heads stay in order, head h reads group h // (H / n_g)) into one pair
of up-projections W_UK^(G) [d_nope, d_c], W_UV^(G) [d_v, d_c], keeping the latent, the RoPE key and every
width, and folding what each old group had of its own into the query and the output:

- keys: score_h = q_h^T W_UK^(g) c. With W_UK^(g) ~= A_g W_UK^(G), q_h^T W_UK^(g) c ~= (A_g^T q_h)^T W_UK^(G) c:
  head h's query rows (q_proj, or q_b_proj with q_lora_rank) become A_g^T times them. W_UK^(G), A_g minimise
  E[(q_h^T (W_UK^(g) - A_g W_UK^(G)) c)^2] summed over the group's heads: with P_g = E[q q^T]^(1/2) over the
  old group's heads' nope queries and C = E[c c^T] = L L^T (the latent as the layer computes it, normed), the
  top d_nope right singular vectors V of the stacked [P_g W_UK^(g) L] give W_UK^(G) = V^T L^-1 and
  A_g = P_g^-1 (U S)_g (Eckart-Young in the whitened space).
- values: o = sum_h O_h W_UV^(g) z_h (O_h: head h's columns of o_proj, z_h = sum_t p_h,t c_t). With
  W_UV^(g) ~= D_g W_UV^(G), O_h becomes O_h D_g; the same construction with R_g = (sum_h O_h^T O_h)^(1/2) in
  place of P_g and C standing for E[z z^T] (z is a convex combination of latents: an approximation).
Exact when the stacked up-projections of each new group have rank <= d_nope (keys) and <= d_v (values), in
particular when n_new = n_old; lossy otherwise: `python -m eval.gqla_regroup` measures the validation loss
on the bundled corpus. The gqa path's cache shrinks by n_old / n_new; the absorb path's [c ; k_r] is the
same (and computes the regrouped function too).
"""

import torch

from models.gqla.configuration import ZooGQLAConfig, _divisors
from models.gqla.convert import run_calibration
from models.gqla.modeling import ZooGQLAForCausalLM


def check_groups(config: ZooGQLAConfig, num_kv_groups) -> None:
    """One clear error for a group count the model cannot be regrouped to."""
    old, d_c = config.num_kv_groups, config.kv_lora_rank
    per_group = config.qk_nope_head_dim + config.v_head_dim
    # The latent is kept, so the regrouped config must still allow it: d_c <= min(d, n_g (d_nope + d_v)).
    fits = [g for g in _divisors(old) if d_c <= min(config.hidden_size, g * per_group)]
    if isinstance(num_kv_groups, bool) or not isinstance(num_kv_groups, int) or num_kv_groups not in fits:
        raise ValueError(
            f"num_kv_groups={num_kv_groups!r} cannot be reached from the model's {old} groups: regrouping merges "
            f"consecutive groups (so the count divides {old}) and keeps the latent, kv_lora_rank={d_c}, which must "
            f"not exceed the new groups' full rank n_g x (qk_nope_head_dim + v_head_dim) = n_g x {per_group}; use "
            f"one of {fits}."
        )


@torch.no_grad()
def attention_statistics(model: ZooGQLAForCausalLM, batches) -> list[dict[str, torch.Tensor]]:
    """Per layer, in fp64: `latent` E[c c^T] [d_c, d_c] (c as the layer computes it, after kv_a_layernorm) and
    `query` E[q q^T] per head of the nope query parts [H, d_nope, d_nope], over `batches` of token ids."""
    config = model.config
    H, d_nope, d_c = config.num_attention_heads, config.qk_nope_head_dim, config.kv_lora_rank
    stats = [
        {"latent": torch.zeros(d_c, d_c, dtype=torch.float64), "query": torch.zeros(H, d_nope, d_nope, dtype=torch.float64)}
        for _ in model.model.layers
    ]
    counts = [0] * len(stats)
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(module, args, kwargs, i=i):
            x = args[0] if args else kwargs["x"]
            c = module.kv_a_proj(x)
            if module.kv_a_layernorm is not None:
                c = module.kv_a_layernorm(c)
            if module.q_proj is not None:
                q = module.q_proj(x)
            else:
                q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
            c = c.reshape(-1, d_c).double().cpu()
            q = q.reshape(-1, H, d_nope + module.qk_rope_head_dim)[..., :d_nope].double().cpu()
            stats[i]["latent"] += c.T @ c
            stats[i]["query"] += torch.einsum("thn,thm->hnm", q, q)
            counts[i] += c.shape[0]

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    run_calibration(model, batches, hooks)
    if not counts[0]:
        raise ValueError("No calibration batches: give at least one batch of token ids.")
    return [{k: v / n for k, v in s.items()} for s, n in zip(stats, counts, strict=True)]


def _sqrt_and_inverse(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its (pseudo-)inverse, eigenvalues floored relative to the
    largest so that a direction nothing uses does not blow up the inverse."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp_min(vals.max().clamp_min(1e-300) * 1e-12)
    root = vals.sqrt()
    return (vecs * root) @ vecs.T, (vecs / root) @ vecs.T


def merge(ups: torch.Tensor, weights: torch.Tensor, chol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ups [m, r, d_c] (m old groups), weights [m, r, r] (each group's PSD weight on its r output rows), chol
    L with C = L L^T. Returns the shared up-projection B [r, d_c] and the per-group folds A [m, r, r] with
    ups[g] ~= A[g] B, minimising sum_g ||W_g^(1/2) (ups[g] - A[g] B) L||_F^2."""
    m, r, d_c = ups.shape
    if r == 0:  # no nope dims: nothing to merge
        return ups.new_zeros(0, d_c), ups.new_zeros(m, 0, 0)
    roots, inverses = zip(*(_sqrt_and_inverse(w) for w in weights), strict=True)
    stacked = torch.cat([root @ up @ chol for root, up in zip(roots, ups, strict=True)])  # [m r, d_c]
    u, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    shared = torch.linalg.solve_triangular(chol, vh[:r], upper=False, left=False)  # vh_r L^-1
    folds = (u[:, :r] * s[:r]).view(m, r, r)
    return shared, torch.stack([inv @ f for inv, f in zip(inverses, folds, strict=True)])


@torch.no_grad()
def regroup(
    model: ZooGQLAForCausalLM, num_kv_groups: int, statistics: list[dict[str, torch.Tensor]] | None = None
) -> ZooGQLAForCausalLM:
    """`model` with its groups merged into `num_kv_groups` (module docstring); `statistics` from
    `attention_statistics` (None: identity weights, uncalibrated). A new model; `model` is left as it was."""
    config = model.config
    check_groups(config, num_kv_groups)
    H, old, d_c = config.num_attention_heads, config.num_kv_groups, config.kv_lora_rank
    d_nope, d_r, d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    m, heads_old = old // num_kv_groups, H // old
    new_config = ZooGQLAConfig(**{**config.to_dict(), "num_key_value_heads": num_kv_groups})
    state = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        q_name = p + ("q_proj" if config.q_lora_rank is None else "q_b_proj")
        wq = state[q_name + ".weight"].view(H, d_nope + d_r, -1)
        bq = state.get(q_name + ".bias")
        bq = None if bq is None else bq.view(H, d_nope + d_r)
        wo = state[p + "o_proj.weight"].view(-1, H, d_v)  # [d, H, d_v]
        stats = None if statistics is None else statistics[i]
        latent = torch.eye(d_c, dtype=torch.float64) if stats is None else stats["latent"]
        chol = torch.linalg.cholesky(latent + torch.eye(d_c, dtype=torch.float64) * 1e-12 * latent.diagonal().mean())
        if stats is None:
            q_moment = torch.eye(d_nope, dtype=torch.float64).expand(H, -1, -1)
        else:
            q_moment = stats["query"]
        k_up, v_up = state[p + "k_up"], state[p + "v_up"]
        new_k, new_v = [], []
        for G in range(num_kv_groups):
            groups = range(G * m, (G + 1) * m)
            heads = [list(range(g * heads_old, (g + 1) * heads_old)) for g in groups]
            q_weights = torch.stack([q_moment[h].sum(0) for h in heads])
            o_weights = torch.stack([torch.einsum("dhv,dhw->vw", wo[:, h], wo[:, h]) for h in heads])
            k_shared, k_folds = merge(k_up[list(groups)], q_weights, chol)
            v_shared, v_folds = merge(v_up[list(groups)], o_weights, chol)
            new_k.append(k_shared)
            new_v.append(v_shared)
            for j, hs in enumerate(heads):
                for h in hs:
                    # Query nope rows: A_g^T q (the key fold moves into the query); output columns: O_h D_g.
                    wq[h, :d_nope] = k_folds[j].T @ wq[h, :d_nope]
                    if bq is not None:
                        bq[h, :d_nope] = k_folds[j].T @ bq[h, :d_nope]
                    wo[:, h] = wo[:, h] @ v_folds[j]
        state[p + "k_up"] = torch.stack(new_k)
        state[p + "v_up"] = torch.stack(new_v)
    target = ZooGQLAForCausalLM(new_config).to(torch.float64)
    target.load_state_dict(state)
    return target.to(model.dtype).eval()
