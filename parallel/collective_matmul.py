"""Collective matmul (Wang et al. 2023; PyTorch's async TP in torchtitan): tensor parallelism with the residual
stream sharded along the sequence (Megatron's sequence parallelism) and its two collectives decomposed into ring
steps, each hidden behind a partial matmul.

Under the `collective_matmul` overlap schedule (parallel/overlap.py) rank r of the P tensor-parallel ranks holds
the contiguous chunk r of every sequence between the first layer and the last (`scatter_to_sequence`,
`gather_from_sequence`). A sub-block then reads the whole sequence only inside its column-parallel linears and
returns its chunk from its row-parallel one:

- `all_gather_linears(x, linears, group)`: the all-gather of the normed chunk before the column-parallel linears,
  as P - 1 ring shifts: while chunk c travels on to the next rank, this rank multiplies the chunk at hand by its
  weight shards. Backward: the reduce-scatter of the input's gradient the same way (each step's partial product
  computed while the running sum is in flight), the weights' gradients computed chunk by chunk in the same steps.
- `linear_reduce_scatter(pairs, group)`: the reduce-scatter after the row-parallel linear(s), as P - 1 ring shifts
  of a running sum: each step's partial product (the chunk the sum is for) computed while the previous sum is in
  flight. Backward: the all-gather of the output's gradient, each chunk's products computed while the next travels.

The ring steps are `parallel.comm.send_recv` shifts (counted, and timed on the simulated link); each is waited
right after the matmul it hides behind, in the loops below. Under torch.compile (fullgraph) a shift traces as a
functional all-to-all; the compiled prefill, static-cache decode and training step equal eager's at TP 2
(tests/test_collective_matmul.py).
A sub-block's input and output are sequence chunks, so the all-reduce of plain TP is gone: its two halves are
these gather and scatter. In comm's `none` mode a shift returns its input, so a rank computes the same P chunk
products (the same per-rank compute) on meaningless values.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.comm_reduce import compute_dtype


def _size_rank(group) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def ring_gather(x: torch.Tensor, group, compute) -> None:
    """Pass every rank's `x` around the ring: `compute(c, chunk)` for rank c's chunk, each while the next one is
    in flight."""
    p, r = _size_rank(group)
    chunk = x
    for step in range(p):
        hop = comm.send_recv(chunk, group) if step < p - 1 else None  # the next chunk travels ...
        compute((r - step) % p, chunk)  # ... behind this chunk's matmuls
        if hop is not None:
            chunk = hop.wait()


def ring_reduce_scatter(group, part) -> torch.Tensor:
    """The sum over ranks of `part(r)` (this rank's chunk r), as a running sum passed around the ring: at each
    step this rank computes `part(c)` for the chunk the incoming sum is for while that sum is in flight."""
    p, r = _size_rank(group)
    total = None
    for step in range(p):
        partial = part((r - 1 - step) % p)  # computed while the previous rank's running sum travels
        if total is not None:
            partial = partial + total.wait()
        if step < p - 1:
            total = comm.send_recv(partial, group)
    return partial


class _AllGatherLinears(torch.autograd.Function):
    """[chunk_c W_i^T + b_i for every chunk c, joined along `dim`] for each linear i, from this rank's chunk."""

    # forward(ctx, *args), unpacked inside: torch.compile (2.13) binds named arguments before a *varargs wrongly
    # for an autograd Function (the first tensor taken for an int), while it traces this form.
    @staticmethod
    def forward(ctx, *args):
        x, group, dim, dtype, params = args[0], args[1], args[2], args[3], args[4:]
        pairs = list(zip(params[0::2], params[1::2], strict=True))
        weights = [w.to(dtype) for w, _ in pairs]
        biases = [None if b is None else b.to(dtype) for _, b in pairs]
        p, _ = _size_rank(group)
        outs, chunks = [[None] * p for _ in pairs], [None] * p

        def compute(c, chunk):
            chunks[c] = chunk
            for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
                outs[i][c] = F.linear(chunk, w, b)

        ring_gather(x.to(dtype), group, compute)
        ctx.group, ctx.dim, ctx.dtypes = group, dim, (x.dtype, [w.dtype for w, _ in pairs])
        ctx.save_for_backward(*chunks, *weights)
        ctx.p = p  # how many of the saved tensors are chunks
        return tuple(torch.cat(o, dim=dim) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        chunks, weights = saved[: ctx.p], saved[ctx.p :]
        x_dtype, w_dtypes = ctx.dtypes
        grad_chunks = [g.chunk(ctx.p, dim=ctx.dim) for g in grads]
        grad_w = [torch.zeros_like(w) for w in weights]
        grad_b = [None] * len(weights)

        def part(c):
            # dL/dx of chunk c (this rank's share of the sum over ranks), and the weights' gradients of chunk c.
            out = None
            for i, w in enumerate(weights):
                g = grad_chunks[i][c]
                rows = g.reshape(-1, g.shape[-1])
                grad_w[i] += rows.T @ chunks[c].reshape(-1, chunks[c].shape[-1])
                if ctx.needs_input_grad[5 + 2 * i]:
                    grad_b[i] = rows.sum(0) if grad_b[i] is None else grad_b[i] + rows.sum(0)
                out = g @ w if out is None else out + g @ w
            return out

        grad_x = ring_reduce_scatter(ctx.group, part).to(x_dtype)
        param_grads = []
        for i, dtype in enumerate(w_dtypes):
            param_grads.append(grad_w[i].to(dtype) if ctx.needs_input_grad[4 + 2 * i] else None)
            param_grads.append(None if grad_b[i] is None else grad_b[i].to(dtype))
        return grad_x, None, None, None, *param_grads


class _LinearReduceScatter(torch.autograd.Function):
    """This rank's chunk (along `dim`) of sum over ranks of sum_i y_i W_i^T (row-parallel linears, no bias)."""

    @staticmethod
    def forward(ctx, *args):  # unpacked inside, as _AllGatherLinears.forward (why: there)
        group, dim, dtype, n, tensors = args[0], args[1], args[2], args[3], args[4:]
        ys, weights = [y.to(dtype) for y in tensors[:n]], [w.to(dtype) for w in tensors[n:]]
        p, _ = _size_rank(group)
        y_chunks = [y.chunk(p, dim=dim) for y in ys]

        def part(c):
            out = None
            for y, w in zip(y_chunks, weights, strict=True):
                out = F.linear(y[c], w) if out is None else out + F.linear(y[c], w)
            return out

        out = ring_reduce_scatter(group, part)
        ctx.group, ctx.dim, ctx.n, ctx.p = group, dim, n, p
        ctx.dtypes = ([y.dtype for y in tensors[:n]], [w.dtype for w in tensors[n:]])
        ctx.save_for_backward(*ys, *weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        ys, weights = saved[: ctx.n], saved[ctx.n :]
        y_dtypes, w_dtypes = ctx.dtypes
        y_chunks = [y.chunk(ctx.p, dim=ctx.dim) for y in ys]
        grad_y = [[None] * ctx.p for _ in ys]
        grad_w = [torch.zeros_like(w) for w in weights]

        def compute(c, g):
            rows = g.reshape(-1, g.shape[-1])
            for i, w in enumerate(weights):
                grad_y[i][c] = g @ w
                grad_w[i] += rows.T @ y_chunks[i][c].reshape(-1, y_chunks[i][c].shape[-1])

        ring_gather(grad.to(weights[0].dtype).contiguous(), ctx.group, compute)
        return (
            None, None, None, None,
            *[torch.cat(g, dim=ctx.dim).to(dt) for g, dt in zip(grad_y, y_dtypes, strict=True)],
            *[g.to(dt) for g, dt in zip(grad_w, w_dtypes, strict=True)],
        )  # fmt: skip


def all_gather_linears(x: torch.Tensor, linears: list[nn.Linear], group, dim: int = 1) -> tuple[torch.Tensor, ...]:
    """Each column-parallel linear of `linears` applied to the whole sequence, from this rank's chunk `x` of it:
    the all-gather along `dim` decomposed into ring steps behind the chunks' matmuls (module docstring)."""
    params = [t for linear in linears for t in (linear.weight, linear.bias)]
    return _AllGatherLinears.apply(x, group, dim, compute_dtype(x), *params)


def linear_reduce_scatter(pairs: list[tuple[torch.Tensor, nn.Linear]], group, dim: int = 1) -> torch.Tensor:
    """This rank's chunk along `dim` of the sum over ranks of every (input, row-parallel linear) pair's product:
    the reduce-scatter decomposed into ring steps behind the chunks' matmuls (module docstring)."""
    for _, linear in pairs:
        if linear.bias is not None:
            raise ValueError("linear_reduce_scatter takes row-parallel linears without a bias (parallel/tp.py).")
    ys = [y for y, _ in pairs]
    return _LinearReduceScatter.apply(group, dim, compute_dtype(ys[0]), len(pairs), *ys, *[m.weight for _, m in pairs])


def sequence_norm(norm: nn.Module, x: torch.Tensor, group) -> torch.Tensor:
    """`norm(x)` on this rank's chunk of the sequence: its replicated weight sees only this chunk's tokens, so its
    gradient is summed over the tensor-parallel ranks (Megatron's f on the weight: identity forward)."""
    return comm.copy_to_tp_region(norm.weight, group) * norm.normalize(x)


def check_sequence_length(tokens: int, group) -> None:
    p, _ = _size_rank(group)
    if tokens % p:
        raise ValueError(
            f"overlap=collective_matmul shards the sequence over the {p} tensor-parallel ranks, and this forward has "
            f"{tokens} tokens, not a multiple of {p}: pad the input to {tokens + (-tokens) % p} tokens or use "
            "overlap='none'."
        )


class _ScatterToSequence(torch.autograd.Function):
    """This rank's chunk along `dim` of a replicated tensor; backward: the chunks' gradients gathered (every rank's
    copy of the input gets the whole gradient, as the replicated embedding before it needs)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        p, r = _size_rank(group)
        ctx.group, ctx.dim, ctx.p = group, dim, p
        return x.chunk(p, dim=dim)[r].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, ctx.p), None, None


class _GatherFromSequence(torch.autograd.Function):
    """Every rank's chunk joined along `dim`, for a replicated computation after it (the final norm, the LM
    head); backward: this rank's chunk of the gradient, which is the same on every rank."""

    @staticmethod
    def forward(ctx, x, group, dim):
        p, r = _size_rank(group)
        ctx.dim, ctx.p, ctx.r = dim, p, r
        return _gather(x, group, dim, p)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.p, dim=ctx.dim)[ctx.r].contiguous(), None, None


def _gather(x, group, dim, p):
    chunks = [None] * p

    def keep(c, chunk):
        chunks[c] = chunk

    ring_gather(x.contiguous(), group, keep)
    return torch.cat(chunks, dim=dim)


def scatter_to_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    check_sequence_length(x.shape[dim], group)
    return _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _GatherFromSequence.apply(x, group, dim)
