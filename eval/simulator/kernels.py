"""Kernel cost models of the speed simulator: a fused GPU kernel the meta device does not run, charged as one.

The device model (eval/simulator/device.py) charges every aten op the meta device runs. Where a GPU runs one
fused kernel in place of what the meta device runs (fla's chunked linear-attention kernel in place of the CPU
chunked kernel of models/linear/ops.py; flash attention's backward in place of the math decomposition's), the
decomposition runs inside `DeviceClock.quiet()` (its ops uncharged, its values and gradients kept) and the
fused kernel's cost is charged instead, through `DeviceClock.charge`:

    out = charged_kernel(clock, fn, forward_costs, backward_costs, *tensors)

- `fla_chunk_costs` / `fla_intra`: fla's `chunk_simple_gla` (what models/linear/ops.py calls on CUDA);
- `flash_backward_cost` / `FlashBackward`: flash attention's backward of `F.scaled_dot_product_attention`
  (its forward is the device model's own fused charge, `_FusedAttention`).

A new fused kernel is one more cost function of (name, FLOPs, HBM bytes) tuples handed to `charged_kernel`.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from eval.simulator.attention import attention_charges, sdpa_keywords, tensor_bytes
from eval.simulator.device import DeviceClock
from models.common.values import has_values

FLA_CHUNK = 64  # fla's chunk_simple_gla: tokens per chunk (BT)


class _ChargedKernel(torch.autograd.Function):
    """`fn(*tensors)` run quietly under a DeviceClock, the costs of a fused kernel charged instead: `forward`
    [(name, FLOPs, bytes)] when it runs, `backward` when its gradient is taken (also quietly)."""

    @staticmethod
    def forward(ctx, clock, fn, forward, backward, *tensors):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        # Without values (the meta device) the gradients are shapes only: the decomposition's graph is not kept
        # (nor differentiated again: inside a selective activation-checkpointing region that would be a second
        # backward of the region).
        shapes_only = all(not has_values(t) for t in tensors)
        with torch.set_grad_enabled(not shapes_only), clock.quiet():
            out = fn(*leaves)
        for name, flops, nbytes in forward:
            clock.charge(name, flops, nbytes)
        ctx.clock, ctx.costs, ctx.graph = clock, backward, (None if shapes_only else out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = ctx.graph
        del ctx.graph
        wanted = [x for x in leaves if x.requires_grad]
        if out is None:
            found = iter(torch.empty_like(x) for x in wanted)
        else:
            with ctx.clock.quiet():
                found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        for name, flops, nbytes in ctx.costs:
            ctx.clock.charge(name, flops, nbytes)
        return (None, None, None, None, *(next(found) if x.requires_grad else None for x in leaves))


def charged_kernel(clock: DeviceClock, fn, forward: list, backward: list, *tensors: torch.Tensor) -> torch.Tensor:
    """`fn(*tensors)` with its ops uncharged and `forward` [(name, FLOPs, bytes)] charged as it runs, `backward`
    when its gradient is taken (the decomposition's gradient computed quietly too). Values and gradients are
    `fn`'s own."""
    return _ChargedKernel.apply(clock, fn, forward, backward, *tensors)


def fla_chunk_costs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
    """(forward, backward) kernels of fla's chunk_simple_gla on [B, H, T, D] inputs, as (name, FLOPs, bytes), chunks
    of BT = 64 tokens with per-chunk states h [B, H, T/BT, d_k, d_v] kept in the input dtype:

    - forward: chunk_fwd_h (the states: k^T v per chunk, 2 T d_k d_v per head), chunk_fwd_o (intra-chunk
      (Q K^T) V, 2 T BT (d_k + d_v), plus Q h, 2 T d_k d_v);
    - backward: chunk_fwd_h again (recomputed), chunk_bwd_dh (dh from Q and dO), the dQ / dK kernel (dO V^T, dS K,
      dS^T Q within chunks and dO h^T, V dh^T across them) and the dV kernel ((Q K^T)^T dO and K dh): about 2.75x the
      forward's FLOPs at d = BT = 64.
    The decay's gradient (a learned decay) is not charged: a few elementwise passes."""
    b, h, t, dk = q.shape
    dv, e = v.shape[-1], q.element_size()
    bt = min(FLA_CHUNK, t)
    states = b * h * -(-t // FLA_CHUNK) * dk * dv * e
    nq, nk, nv = tensor_bytes(q), tensor_bytes(k), tensor_bytes(v)
    no = nv  # O and dO: [B, H, T, d_v] in the input dtype
    kv = 2 * b * h * t * dk * dv  # one pass of T x d_k x d_v products (states, Q h, ...)
    qk, av = 2 * b * h * t * bt * dk, 2 * b * h * t * bt * dv  # one intra-chunk product each
    fwd_h = ("fla:chunk_fwd_h", kv, nk + nv + states)
    forward = [fwd_h, ("fla:chunk_fwd_o", qk + av + kv, nq + nk + nv + states + no)]
    backward = [
        fwd_h,
        ("fla:chunk_bwd_dh", kv, nq + no + states),
        ("fla:chunk_bwd_dqk", av + 2 * qk + 2 * kv, nq + nk + nv + no + 2 * states + nq + nk),
        ("fla:chunk_bwd_dv", qk + av + kv, nq + nk + no + states + nv),
    ]
    return forward, backward


def fla_intra(clock: DeviceClock, kernel):
    """The intra-chunk kernel `kernel(q, k, v, log_decay)` (a LinearAttention's `intra_chunk`), run quietly with
    fla's chunk kernel charged for it (`fla_chunk_costs`)."""

    def intra(q, k, v, log_decay):
        tensors = (q, k, v) if log_decay is None else (q, k, v, log_decay)
        forward, backward = fla_chunk_costs(q, k, v)
        return charged_kernel(clock, lambda q, k, v, g=None: kernel(q, k, v, g), forward, backward, *tensors)

    return intra


def flash_backward_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> tuple:
    """Flash attention's backward as one kernel (name, FLOPs, bytes): 2.5x the forward's FLOPs (FlashAttention-2:
    five Tq x Tk x d products to the forward's two; causal halves both), reading Q, K, V, O, dO (and a mask) and
    writing dQ, dK, dV once (the forward's charge: eval.simulator.device._FusedAttention)."""
    b, h, tq, d = q.shape
    flops = 4 * b * h * tq * k.shape[-2] * d
    if kwargs.get("is_causal") and tq > 1:
        flops //= 2
    nbytes = 2 * (tensor_bytes(q) + tensor_bytes(k) + tensor_bytes(v)) + 2 * tensor_bytes(q) * v.shape[-1] // d
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        nbytes += tensor_bytes(mask)
    return ("flash_attention_backward", flops * 5 // 2, nbytes)


class FlashBackward(TorchFunctionMode):
    """Under a DeviceClock: F.scaled_dot_product_attention's backward charged as flash attention's (its forward
    stays the device model's fused charge), the math decomposition's backward run quietly."""

    def __init__(self, clock: DeviceClock):
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        q, k, v, rest = *args[:3], args[3:]
        if rest:  # positional attn_mask, dropout_p, is_causal: as keywords
            kwargs = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), rest, strict=False)), **kwargs}
        if not any(t.requires_grad for t in (q, k, v)):
            return func(q, k, v, **kwargs)
        cost = flash_backward_cost(q, k, v, kwargs)
        return charged_kernel(self.clock, lambda q, k, v: func(q, k, v, **kwargs), [], [cost], q, k, v)




@contextmanager
def flash_attention(clock: DeviceClock):
    """`F.scaled_dot_product_attention` replaced, for the duration, by flash attention's forward and backward
    charged as one kernel each (`attention_charges`, `flash_backward_cost`), the meta device's own run quiet.

    What `FlashBackward` (with the clock's `_FusedAttention`) does, as a patched function rather than a torch
    function mode: activation checkpointing recomputes a region inside the backward, where no torch function mode
    is active (torch 2.13), so a mode would charge the original forward and not its recomputation, and the two
    would save different tensors (checkpoint refuses that). A module attribute is seen by both."""
    original = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        q, k, v, kwargs = sdpa_keywords(args, kwargs)
        for charge in attention_charges(q, k, v, kwargs, gqa_expand=clock.gqa_expand):
            clock.charge(*charge)

        def run(q, k, v):
            with torch._C.DisableTorchFunction():  # the clock's own attention mode: charged above already
                return original(q, k, v, **kwargs)

        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
            with clock.quiet():
                return run(q, k, v)
        return charged_kernel(clock, run, [], [flash_backward_cost(q, k, v, kwargs)], q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
