"""Causal linear attention: two references, the chunked kernel used for training, and a dispatcher.

With a per-head decay lambda = exp(log_decay) in (0, 1] (no decay: lambda = 1), the output of token i is

    o_i = sum_{j <= i} lambda^(i - j) (q_i . k_j) v_j

and the recurrent state after token t is S_t = lambda S_{t-1} + k_t^T v_t (d_k x d_v per batch row and
head), so o_t = q_t S_t. No feature map and no scale here: the layer applies them (SiLU on q and k,
models/linear/modeling.py).

Layout [B, H, T, D] everywhere (batch, heads, tokens, head dim); `log_decay` is [H], <= 0, or None. States
are [B, H, d_k, d_v] in fp32 (fp64 for fp64 inputs) whatever the input dtype: a state sums every token
seen so far, and bf16 would lose the small late contributions. Outputs are in v's dtype.

The functions (the sequence-parallel code, parallel/sequence.py, builds LASP-2 and LASP-1 on them):

- `linear_attention_quadratic(q, k, v, log_decay=None) -> o`: the naive reference, masked
  (Q K^T * D) V with D[i, j] = lambda^(i - j) for j <= i and 0 above the diagonal. O(T^2).
- `linear_attention_recurrent(q, k, v, log_decay=None, initial_state=None) -> (o, final_state)`: the
  other reference, one token at a time (the decoding recurrence).
- `linear_attention_chunked(q, k, v, log_decay=None, chunk_size=64, initial_state=None) -> (o, final_state)`:
  the training path on CPU: within a chunk the quadratic form, across chunks the state (Lightning
  Attention-2's intra / inter split). Any T: the last chunk may be shorter.
- `linear_attention(q, k, v, log_decay=None, initial_state=None, chunk_size=64) -> (o, final_state)`: on
  CUDA with fla-core installed (the optional `gpu` extra) fla's Triton kernel `chunk_simple_gla`, else
  the chunked path. fla's `chunk_linear_attn(normalize=False)` is `chunk_simple_gla` without decay, so
  the one kernel serves every decay.
"""

import functools

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (the state and the sums need it), fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def linear_attention_quadratic(q, k, v, log_decay=None):
    """Masked (Q K^T * D) V: the definition, O(T^2) in time and memory. Returns o [B, H, T, d_v]."""
    out_dtype, dtype = v.dtype, _compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    t = q.shape[-2]
    pos = torch.arange(t, device=q.device)
    distance = pos[:, None] - pos[None, :]  # i - j
    causal = (distance >= 0).to(dtype)
    if log_decay is None:
        weights = causal
    else:
        # Clamped before exp: above the diagonal exp(-log_decay * (j - i)) could overflow to inf, and
        # inf * 0 is NaN (in the backward too).
        weights = torch.exp(log_decay.to(dtype)[:, None, None] * distance.clamp(min=0)) * causal  # [H, T, T]
    return (((q @ k.transpose(-1, -2)) * weights) @ v).to(out_dtype)


def linear_attention_recurrent(q, k, v, log_decay=None, initial_state=None):
    """One token at a time: S <- lambda S + k_t^T v_t, o_t = q_t S. Returns (o, final state)."""
    out_dtype, dtype = v.dtype, _compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, h, t, d_k = q.shape
    state = q.new_zeros(b, h, d_k, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    decay = None if log_decay is None else torch.exp(log_decay.to(dtype))[:, None, None]  # [H, 1, 1]
    outputs = []
    for i in range(t):
        if decay is not None:
            state = decay * state
        state = state + k[:, :, i, :, None] * v[:, :, i, None, :]
        outputs.append((q[:, :, i, None, :] @ state)[:, :, 0])
    return torch.stack(outputs, dim=2).to(out_dtype), state


def linear_attention_chunked(q, k, v, log_decay=None, chunk_size=64, initial_state=None):
    """Chunk by chunk: the quadratic form inside a chunk plus the chunk's queries times the state of
    every token before it; then the state moves past the chunk. Returns (o, final state).

    For a chunk of n tokens (index i in 0..n-1) after state S:
        o_i = quadratic(chunk)_i + lambda^(i+1) q_i S
        S  <- lambda^n S + sum_i lambda^(n-1-i) k_i^T v_i
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer.")
    out_dtype, dtype = v.dtype, _compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, h, t, d_k = q.shape
    state = q.new_zeros(b, h, d_k, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    log_decay = None if log_decay is None else log_decay.to(dtype)[:, None]  # [H, 1]
    outputs = []
    for start in range(0, t, chunk_size):
        qc, kc, vc = (x[:, :, start : start + chunk_size] for x in (q, k, v))
        n = qc.shape[2]
        o = linear_attention_quadratic(qc, kc, vc, log_decay[:, 0] if log_decay is not None else None)
        if log_decay is None:
            o = o + qc @ state
            state = state + kc.transpose(-1, -2) @ vc
        else:
            i = torch.arange(n, device=q.device, dtype=dtype)
            # Query i of the chunk is i + 1 steps after the state's last token; key i is n - 1 - i steps
            # before the chunk's end.
            o = o + (qc * torch.exp(log_decay * (i + 1))[..., None]) @ state
            weighted_k = kc * torch.exp(log_decay * (n - 1 - i))[..., None]
            state = torch.exp(log_decay * n)[..., None] * state + weighted_k.transpose(-1, -2) @ vc
        outputs.append(o)
    return torch.cat(outputs, dim=2).to(out_dtype), state


@functools.cache
def _fla_chunk_simple_gla():
    """fla's `chunk_simple_gla`, or None where fla-core (the optional `gpu` extra) is not installed.

    Imported here, guarded, and not at the top of the file: fla is optional (its kernels need Triton
    and a GPU), and an exported checkpoint's code must load without it."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


def fla_available() -> bool:
    return _fla_chunk_simple_gla() is not None


def linear_attention_fla(q, k, v, log_decay=None, initial_state=None):
    """fla's Triton kernel (layout [B, T, H, D], hence the transposes). Returns (o, final state)."""
    chunk_simple_gla = _fla_chunk_simple_gla()
    if chunk_simple_gla is None:
        raise RuntimeError("fla-core is not installed: pip install 'overlap-zoo[gpu]' (it needs a CUDA GPU).")
    b, h, t, _ = q.shape
    g = g_gamma = None
    if log_decay is not None and log_decay.requires_grad:
        # fla gives no gradient for g_gamma; a learned decay goes in as the per-token gate g instead
        # (the same value at every token), whose gradient it does return.
        g = log_decay.float()[None, None, :].expand(b, t, h)
    elif log_decay is not None:
        g_gamma = log_decay.float()
    if initial_state is not None:
        initial_state = initial_state.float()
    o, state = chunk_simple_gla(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        g=g,
        g_gamma=g_gamma,
        scale=1.0,  # fla's default is d_k^-0.5; the layer scales q itself
        initial_state=initial_state,
        output_final_state=True,
    )
    return o.transpose(1, 2), state


def linear_attention(q, k, v, log_decay=None, initial_state=None, chunk_size=64):
    """The fast path for this device: fla on CUDA where installed, else the chunked kernel."""
    if q.is_cuda and fla_available():
        return linear_attention_fla(q, k, v, log_decay, initial_state)
    return linear_attention_chunked(q, k, v, log_decay, chunk_size, initial_state)
