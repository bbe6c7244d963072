"""Sequence parallelism: attention over sequences split across the ranks of an sp group.

Rank t of P holds the contiguous chunk [t*C, (t+1)*C) of every sequence (C = N/P, `split_sequence`) and
computes that chunk's outputs; the tokens before it reach it only through the collectives here, all
issued through `parallel.comm` (counted, and timed on the simulated link). Layout [B, H, T, D].

Linear attention, with an optional per-head log decay g <= 0 (lambda = exp(g); None: no decay):

    O_i = sum_{j <= i} lambda^(i-j) (q_i . k_j) v_j

splits at the chunk boundary into the chunk's own causal part (`intra`, the model's kernel) and the
part of the earlier chunks, which reaches chunk t as one d_k x d_v state per (batch, head):

    M_s     = sum_j lambda^(C-1-j) k_j^T v_j                    (chunk s's state, decay-weighted)
    S_pre_t = sum_{s<t} lambda^(C (t-1-s)) M_s                  (exclusive, rank-weighted prefix)
    O_t     = intra(Q_t, K_t, V_t) + (Q_t * lambda^(i+1)) S_pre_t

- `lasp2` (LASP-2, Sun et al. 2025): ONE all-gather of the states M_s, issued before the intra-chunk
  compute and waited after it, then the prefix on every rank. Its size, P x B x H x d_k x d_v, does not
  grow with N. The backward is the same with the roles turned: dS_t = (Q_t * lambda^(i+1))^T dO_t,
  one all-gather, the suffix sum_{u>t} lambda^(C (u-1-t)) dS_u is the gradient of M_t.
- `lasp1` (LASP-1, the baseline): the states travel along a ring, P-1 serial hops; rank t's prefix is
  complete once rank t-1's is (backward: the other way round).
- `lasp2h` (LASP-2H, for the softmax layers of hybrids): all-gather K and V, attend the local queries
  with the causal mask offset by the rank; the all-gather's adjoint reduce-scatters dK and dV.
- `ring_attention` (the baseline for softmax layers): P-1 shifts of the K/V blocks around the ring,
  each overlapped with the attention to the block at hand, combined by online softmax.

`linear_attention` and `softmax_attention` pick one by `sp_method` ("lasp2": LASP-2 / LASP-2H,
"lasp1": LASP-1 / ring attention).

The two LASP functions are autograd Functions whose backward issues its own collectives. What is local
to a rank (the intra-chunk kernel, the decay factors, the product with the prefix) is differentiated
by autograd on a graph built in the forward; the collectives only carry the states and their gradients.
That keeps any differentiable `intra` kernel usable, and a learned decay gets its gradient: each use
of g sits on one rank, which adds that use's share (the sp gradient sum of parallel.grad_sync adds the
shares up, as for every weight replicated over sp).

States and their gradients are kept in fp32 (fp64 inputs stay fp64). In comm's `none` mode the
collectives return the local tensor, which is repeated to the shape the real one has, so the per-rank
compute is the same. In `simulated` mode one process plays rank 0: every rank takes part in each LASP-1
hop and ring shift, so rank 0's timeline carries all P-1 of them, as the last rank's does; but ring
attention's compute is unbalanced (rank t attends to t+1 blocks, rank 0 to one), so rank 0's simulated
time is a lower bound for it.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import comm

# The values of a model's `sp_method` (Linear-Llama's config accepts exactly these) and what each runs.
SP_METHODS = {
    "lasp2": "LASP-2 for linear layers (one all-gather of d_k x d_v states), LASP-2H for softmax layers",
    "lasp1": "LASP-1 for linear layers (ring of states, P-1 serial hops), ring attention for softmax layers",
}


def check_sp_method(method: str) -> None:
    if method not in SP_METHODS:
        choices = "; ".join(f"{name}: {what}" for name, what in SP_METHODS.items())
        raise ValueError(f"Unknown sp_method {method!r}; choose one of {choices}.")


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


# --- the data side ------------------------------------------------------------------------------------


def split_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's chunk [r*N/P, (r+1)*N/P) of `x` along `dim` (the whole of `x` without a group)."""
    if group is None:
        return x
    rank, p = _rank_and_size(group)
    n = x.shape[dim]
    if n % p:
        lower, upper = n - n % p, n + p - n % p
        fits = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"A sequence of N={n} tokens does not split over sp={p} ranks (each rank holds N/P tokens); "
            f"use a length divisible by {p}, e.g. {fits}."
        )
    # Contiguous: views of a row's middle would trip .view() in losses and need copies in collectives anyway.
    return x.narrow(dim, rank * (n // p), n // p).contiguous()


def chunk_offset(group, q_len: int) -> int:
    """How many tokens of each sequence precede this rank's chunk of `q_len` tokens: rank * q_len."""
    return 0 if group is None else dist.get_rank(group) * q_len


def _all_ranks(gathered: torch.Tensor, p: int, dim: int = 0) -> torch.Tensor:
    """A gathered tensor as the real all-gather gives it: in `none` mode comm skips the gather and returns
    the local tensor, repeated here to the real shape so that the compute after it is the same."""
    return torch.cat([gathered] * p, dim=dim) if comm.get_mode() == "none" else gathered


# --- linear attention: decay factors and states ---------------------------------------------------------


def _acc(x: torch.Tensor) -> torch.dtype:
    """States and their gradients: fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _powers(log_decay, exponents: torch.Tensor) -> torch.Tensor:
    """lambda^exponents per head: [H, *exponents.shape] (log_decay [H])."""
    return torch.exp(log_decay.reshape(-1, *([1] * exponents.dim())) * exponents)


def _chunk_state(k: torch.Tensor, v: torch.Tensor, log_decay) -> torch.Tensor:
    """M = sum_j lambda^(C-1-j) k_j^T v_j: [B, H, d_k, d_v], what this chunk adds to the state."""
    acc = _acc(k)
    k, v = k.to(acc), v.to(acc)
    if log_decay is not None:
        c = k.shape[2]
        k = k * _powers(log_decay.to(acc), torch.arange(c - 1, -1, -1, dtype=acc, device=k.device))[..., None]
    return k.transpose(-1, -2) @ v


def _decayed_queries(q: torch.Tensor, log_decay) -> torch.Tensor:
    """Q * lambda^(i+1): query i reads a state that ended i+1 decay steps before it."""
    acc = _acc(q)
    q = q.to(acc)
    if log_decay is None:
        return q
    c = q.shape[2]
    return q * _powers(log_decay.to(acc), torch.arange(1, c + 1, dtype=acc, device=q.device))[..., None]


def _chunk_decay(log_decay, c: int, state: torch.Tensor):
    """lambda^C per head, shaped to scale a [B, H, d_k, d_v] state (1 without decay)."""
    if log_decay is None:
        return 1.0
    return torch.exp(log_decay.to(state.dtype) * c)[:, None, None]


def _weighted_sum(states: torch.Tensor, log_decay, c: int, hops: torch.Tensor) -> torch.Tensor:
    """sum_s lambda^(C * hops[s]) states[s], states [S, B, H, d_k, d_v] (zeros when S = 0)."""
    if log_decay is None:
        return states.sum(0)
    weights = _powers(log_decay.to(states.dtype), c * hops.to(states.dtype))  # [H, S]
    return torch.einsum("hs,sbhkv->bhkv", weights, states)


def _leaves(build: bool, *tensors):
    """Detached copies that track gradients where the originals need them (None stays None)."""
    return [None if x is None else x.detach().requires_grad_(build and x.requires_grad) for x in tensors]


def _grads(outputs, grad_outputs, leaves) -> list:
    """d(outputs)/d(leaves) given the outputs' gradients; None for leaves without grad (or not reached)."""
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    found = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True) if wanted else ())
    return [next(found) if x is not None and x.requires_grad else None for x in leaves]


def _add(a: list, b: list) -> list:
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b, strict=True)]


# --- LASP-2 ----------------------------------------------------------------------------------------


class _LASP2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_decay, group, intra, build):
        rank, p = _rank_and_size(group)
        c = q.shape[2]
        with torch.set_grad_enabled(build):
            leaves = q_, k_, v_, g_ = _leaves(build, q, k, v, log_decay)
            state = _chunk_state(k_, v_, g_)
            # The one collective of the forward: every rank's d_k x d_v state, whatever N is ...
            gathered = comm.all_gather(state.detach()[None], group)
            # ... in flight while the chunk's own causal part is computed.
            out = intra(q_, k_, v_, g_)
            states = _all_ranks(gathered.wait(), p)
            hops = torch.arange(rank - 1, -1, -1, device=q.device)  # chunk s < t is t-1-s chunks back
            prefix = _weighted_sum(states[:rank], g_, c, hops)
            queries = _decayed_queries(q_, g_)
            out = out + (queries @ prefix).to(out.dtype)
        if build:
            ctx.group, ctx.c = group, c
            ctx.graph = (out, state, leaves, queries.detach())
        return out.detach()

    @staticmethod
    def backward(ctx, d_out):
        out, state, leaves, queries = ctx.graph
        del ctx.graph
        group, c = ctx.group, ctx.c
        rank, p = _rank_and_size(group)
        # dS_t: the gradient of this rank's prefix; one all-gather, in flight during the local backward.
        d_prefix = queries.transpose(-1, -2) @ d_out.to(queries.dtype)
        gathered = comm.all_gather(d_prefix[None], group)
        grads = _grads(out, d_out, leaves)  # intra-chunk terms, dQ's inter term, g through its local uses
        d_prefixes = _all_ranks(gathered.wait(), p)
        if rank < p - 1:
            # M_t feeds the prefix of every later rank u, weighted lambda^(C (u-1-t)): the suffix sum.
            log_decay = None if leaves[3] is None else leaves[3].detach()
            hops = torch.arange(0, p - 1 - rank, device=d_out.device)
            d_state = _weighted_sum(d_prefixes[rank + 1 :], log_decay, c, hops)
            grads = _add(grads, _grads(state, d_state, leaves))
        return (*grads, None, None, None)


def lasp2(q, k, v, group, log_decay=None, *, intra):
    """Causal linear attention of this rank's chunk of each sequence, by LASP-2 (module docstring).

    q, k: [B, H, C, d_k], v: [B, H, C, d_v], this rank's chunk; log_decay: [H] (<= 0) or None.
    `intra(q, k, v, log_decay) -> out` is the causal linear attention within the chunk (the model's
    kernel, any C). Without a group (or with one rank) it is `intra` alone.
    """
    return _over_ranks(_LASP2, q, k, v, group, log_decay, intra)


# --- LASP-1 ----------------------------------------------------------------------------------------


class _LASP1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_decay, group, intra, build):
        rank, p = _rank_and_size(group)
        c = q.shape[2]
        with torch.set_grad_enabled(build):
            leaves = q_, k_, v_, g_ = _leaves(build, q, k, v, log_decay)
            state = _chunk_state(k_, v_, g_)
            decay = _chunk_decay(None if g_ is None else g_.detach(), c, state)
            # P-1 hops along the ring; at each, every rank passes on its best prefix so far, decayed over its
            # chunk, plus its own state. Rank t's prefix is complete after hop t, once rank t-1's was:
            # the serial chain of LASP-1. The first hop is in flight during the intra-chunk compute.
            prefix = torch.zeros_like(state.detach())
            hop = comm.send_recv(state.detach(), group)
            out = intra(q_, k_, v_, g_)
            for i in range(p - 1):
                if i > 0:
                    hop = comm.send_recv(decay * prefix + state.detach(), group)
                received = hop.wait()
                # Rank 0 has no predecessor: what wraps round from rank P-1 is not its prefix.
                prefix = received if rank > 0 else prefix
            prefix = prefix.requires_grad_(build)
            queries = _decayed_queries(q_, g_)
            out = out + (queries @ prefix).to(out.dtype)
            passed_on = _chunk_decay(g_, c, state) * prefix + state  # what rank t+1 received from this rank
        if build:
            ctx.group, ctx.c = group, c
            ctx.graph = (out, passed_on, leaves, queries.detach(), decay)
        return out.detach()

    @staticmethod
    def backward(ctx, d_out):
        out, passed_on, leaves, queries, decay = ctx.graph
        del ctx.graph
        rank, p = _rank_and_size(ctx.group)
        # The gradient of this rank's prefix: its own queries' part plus lambda^C x that of what it passed on,
        # which comes back from rank t+1: P-1 hops the other way round the ring.
        d_prefix = queries.transpose(-1, -2) @ d_out.to(queries.dtype)
        d_passed_on = torch.zeros_like(d_prefix)
        hop = comm.send_recv(d_prefix, ctx.group, shift=-1)
        grads = _grads(out, d_out, leaves)  # the local terms, during the first hop
        for i in range(p - 1):
            if i > 0:
                hop = comm.send_recv(d_prefix + decay * d_passed_on, ctx.group, shift=-1)
            received = hop.wait()
            # The last rank passes nothing on: what wraps round from rank 0 is not its gradient.
            d_passed_on = received if rank < p - 1 else d_passed_on
        if rank < p - 1:
            grads = _add(grads, _grads(passed_on, d_passed_on, leaves))
        return (*grads, None, None, None)


def lasp1(q, k, v, group, log_decay=None, *, intra):
    """Causal linear attention of this rank's chunk by LASP-1: the states travel a ring of P-1 serial
    hops (the baseline LASP-2 replaces). Same arguments and result as `lasp2`."""
    return _over_ranks(_LASP1, q, k, v, group, log_decay, intra)


# Run eagerly inside a compiled model (a graph break): the Functions build their local autograd graph in
# forward and differentiate it twice in backward (the output's, then the state's, with a collective between),
# while a compiled region spanning both runs its backward once and donates its buffers.
@torch.compiler.disable
def _over_ranks(method: type[torch.autograd.Function], q, k, v, group, log_decay, intra):
    """`method` (_LASP2 or _LASP1) over the sp group, keeping the graph of its local parts only where an input
    needs gradients; `intra` alone without a group or with one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return intra(q, k, v, log_decay)
    build = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, log_decay))
    return method.apply(q, k, v, log_decay, group, intra, build)


def linear_attention(q, k, v, group, log_decay=None, *, method: str = "lasp2", intra):
    """The sequence-parallel causal linear attention of `method` ("lasp2" or "lasp1")."""
    check_sp_method(method)
    return (lasp2 if method == "lasp2" else lasp1)(q, k, v, group, log_decay, intra=intra)


# --- softmax attention ------------------------------------------------------------------------------


def _causal_block_mask(c: int, before: int, device) -> torch.Tensor:
    """[C, before + C] (True = may attend): query i at position before + i sees keys up to itself."""
    q_pos = torch.arange(before, before + c, device=device)[:, None]
    return torch.arange(before + c, device=device)[None, :] <= q_pos


def lasp2h(q, k, v, group, attention_mask=None, scale=None):
    """Causal softmax attention of this rank's chunk by LASP-2H: all-gather K and V over the sp group and
    attend the local queries to the keys up to theirs.

    q: [B, H, C, D]; k, v: [B, H_kv, C, D] (H a multiple of H_kv); `attention_mask`: the trunk's boolean
    mask over the keys before and in this chunk ([B or 1, 1, C, (t+1) C], True = attend) or None (plain
    causal). The gathers are comm's autograd all-gathers, whose backward reduce-scatters dK and dV.
    """
    if group is None or dist.get_world_size(group) == 1:
        return _sdpa(q, k, v, attention_mask, scale, causal=attention_mask is None)
    rank, p = _rank_and_size(group)
    c = q.shape[2]
    keys = comm.all_gather(k, group, dim=2)
    values = comm.all_gather(v, group, dim=2)
    # Keys after this chunk are masked for every local query: leave them out.
    k_all = _all_ranks(keys.wait(), p, dim=2)[:, :, : (rank + 1) * c]
    v_all = _all_ranks(values.wait(), p, dim=2)[:, :, : (rank + 1) * c]
    if attention_mask is None and rank > 0:
        attention_mask = _causal_block_mask(c, rank * c, q.device)
    return _sdpa(q, k_all, v_all, attention_mask, scale, causal=attention_mask is None)


def _sdpa(q, k, v, mask, scale, causal: bool):
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal and q.shape[2] > 1,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _block_mask(attention_mask, block: int, rank: int, c: int, device):
    """The mask of this rank's queries against chunk `block`'s keys (None: all visible)."""
    if attention_mask is not None:
        return attention_mask[..., block * c : (block + 1) * c]
    return _causal_block_mask(c, 0, device) if block == rank else None


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _block_scores(q, k, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, -math.inf)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, attention_mask, scale):
        rank, p = _rank_and_size(group)
        c, heads, acc = q.shape[2], q.shape[1], _acc(q)
        qa = q.to(acc)
        out = torch.zeros_like(qa)
        lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
        block = torch.stack([k, v])
        for step in range(p):
            source = (rank - step) % p  # whose keys this rank holds at this step
            if step < p - 1:
                shift = comm.send_recv(block, group)  # the next block travels while this one is used
            if source <= rank:  # later chunks are all masked (causal)
                kb, vb = (_expand_heads(x, heads).to(acc) for x in block)
                scores = _block_scores(qa, kb, _block_mask(attention_mask, source, rank, c, q.device), scale)
                new_lse = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
                out = out * torch.exp(lse - new_lse)[..., None] + torch.exp(scores - new_lse[..., None]) @ vb
                lse = new_lse
            if step < p - 1:
                block = shift.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.attention_mask, ctx.scale = group, attention_mask, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, p = _rank_and_size(group)
        c, heads, kv_heads, acc = q.shape[2], q.shape[1], k.shape[1], _acc(q)
        qa, d_out = q.to(acc), d_out.to(acc)
        d_q = torch.zeros_like(qa)
        delta = (d_out * out).sum(-1, keepdim=True)
        # The K/V blocks go round the ring again, each followed by its gradient accumulator: every rank adds
        # what its queries contribute to the block at hand and passes the sum on. P hops bring each
        # accumulator home; each is in flight during the next block's compute.
        block = torch.stack([k, v])
        d_block = torch.zeros(block.shape, dtype=acc, device=k.device)
        arriving = None  # the accumulator of the block at hand, on its way from the previous rank
        for step in range(p):
            source = (rank - step) % p
            if step < p - 1:
                shift = comm.send_recv(block, group)
            d_kv = 0.0
            if source <= rank:
                kb, vb = (_expand_heads(x, heads).to(acc) for x in block)
                mask = _block_mask(ctx.attention_mask, source, rank, c, q.device)
                probs = torch.exp(_block_scores(qa, kb, mask, scale) - lse[..., None])
                d_scores = probs * (d_out @ vb.transpose(-1, -2) - delta) * scale
                d_q += d_scores @ kb
                d_k = d_scores.transpose(-1, -2) @ qa
                d_v = probs.transpose(-1, -2) @ d_out
                # GQA: a KV head's gradient sums over the query heads that share it.
                groups = heads // kv_heads
                d_kv = torch.stack([x.unflatten(1, (kv_heads, groups)).sum(2) for x in (d_k, d_v)])
            if arriving is not None:
                d_block = arriving.wait()
            arriving = comm.send_recv(d_block + d_kv, group)
            if step < p - 1:
                block = shift.wait()
        d_block = arriving.wait()
        return d_q.to(q.dtype), d_block[0].to(k.dtype), d_block[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, attention_mask=None, scale=None):
    """Causal softmax attention of this rank's chunk by ring attention: P-1 shifts of the K/V blocks, each
    overlapped with the attention to the block at hand, merged by online softmax (the baseline LASP-2H is
    measured against). Same arguments and result as `lasp2h`."""
    if group is None or dist.get_world_size(group) == 1:
        return _sdpa(q, k, v, attention_mask, scale, causal=attention_mask is None)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, attention_mask, scale)


def softmax_attention(q, k, v, group, attention_mask=None, scale=None, *, method: str = "lasp2"):
    """The sequence-parallel causal softmax attention of `method`: "lasp2" -> LASP-2H, "lasp1" -> ring."""
    check_sp_method(method)
    return (lasp2h if method == "lasp2" else ring_attention)(q, k, v, group, attention_mask, scale)
