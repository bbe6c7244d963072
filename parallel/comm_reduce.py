"""All-reduce, all-gather and reduce-scatter (the collectives of tensor and sequence parallelism), and
Megatron's copy into a tensor-parallel region (identity forward, gradient all-reduced).

Each is an autograd Function whose forward issues the op asynchronously and returns a `Handle`; under
torch.compile a functional collective instead (`_functional()`), waited by `Handle.wait()` at the same place.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from parallel.comm_modes import (
    _FUNCTIONAL,
    Handle,
    _active,
    _Box,
    _finish,
    _FinishingWork,
    _functional,
    _nbytes,
    _record,
    _state,
)


class _FunctionalAllReduce(torch.autograd.Function):
    """The all-reduce as a functional collective: no side effects, so that dynamo can trace it."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # as _AllReduce


class _FunctionalCopyToTPRegion(torch.autograd.Function):
    """`_CopyToTPRegion` with the gradient's all-reduce functional (counted in `copy_to_tp_region`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad, "sum", ctx.group)), None


class _FunctionalAllGather(torch.autograd.Function):
    """The all-gather along dim 0 as a functional collective (not waited); the backward reduce-scatters the
    gradient (each rank may use the gathered tensor its own way), waited at once."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.all_gather_tensor(x.contiguous(), 0, group)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, ctx.group)), None


class _FunctionalReduceScatter(torch.autograd.Function):
    """The reduce-scatter along dim 0 as a functional collective; its backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group)

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_gather_tensor(grad.contiguous(), 0, ctx.group)), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, box):
        out = x.contiguous().clone()
        box.ready_at = _record("all_reduce", _nbytes(out), group)
        if _state.mode == "real":
            box.work = dist.all_reduce(out, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        # y = sum_r x_r and every rank uses y the same way: dL/dx_r = dL/dy.
        return grad, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, box):
        ctx.group, ctx.dim = group, dim
        p = dist.get_world_size(group)
        x = x.contiguous()
        shape = list(x.shape)
        shape[dim] *= p
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        box.ready_at = _record("all_gather", _nbytes(out), group)
        if _state.mode == "real":
            # Gather along dim 0 of a stacked buffer, then move the rank axis next to `dim`.
            stacked = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            box.work = dist.all_gather_single(stacked, x, group=group, async_op=True)
            box.finish = lambda: out.copy_(torch.cat(stacked.view(p, *x.shape).unbind(0), dim=dim))
        else:
            out = torch.cat([x] * p, dim=dim) if _state.mode == "simulated" else out
        return out

    @staticmethod
    def backward(ctx, grad):
        # Each rank may use the gathered tensor differently: sum the gradients of my slice over ranks.
        return _reduce_scatter_sync(grad, ctx.group, ctx.dim), None, None, None


def _reduce_scatter_sync(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if not _active(group):
        return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)] if group else x
    p = dist.get_world_size(group)
    parts = [c.contiguous() for c in x.chunk(p, dim=dim)]
    out = torch.empty_like(parts[0])
    ready_at = _record("reduce_scatter", _nbytes(x), group)
    if _state.mode == "real":
        dist.reduce_scatter_single(out, torch.cat(parts, dim=0), group=group)
        return out
    _state.clock.wait(ready_at)  # issued synchronously: the simulated rank waits at once
    return parts[0].clone()


def _all_gather_sync(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    box = _Box()
    out = _AllGather.apply(x, group, dim, box)
    return _finish(box, out)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_sync(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sync(grad, ctx.group, ctx.dim), None, None


class _CopyToTPRegion(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the gradient of a replicated input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group).wait(), None


class _ColumnParallelLinears(torch.autograd.Function):
    """Megatron's f fused with the column-parallel linears that read its input: forward x -> [x W_i^T + b_i];
    backward issues the all-reduce of dL/dx = sum_i g_i W_i, computes the weights' gradients while it is in
    flight, then waits (Megatron-LM's asynchronous gradient all-reduce of a column-parallel input).

    The linears are computed at autocast's dtype when it is on (what nn.Linear under autocast computes), so the
    backward needs no autocast state of its own."""

    @staticmethod
    def forward(ctx, x, group, functional, dtype, *params):
        pairs = list(zip(params[0::2], params[1::2], strict=True))  # (weight, bias or None) per linear
        xc = x.to(dtype)
        weights = [w.to(dtype) for w, _ in pairs]
        ctx.group, ctx.functional, ctx.dtypes = group, functional, (x.dtype, [w.dtype for w, _ in pairs])
        ctx.save_for_backward(xc, *weights)
        return tuple(
            torch.nn.functional.linear(xc, w, None if b is None else b.to(dtype))
            for w, (_, b) in zip(weights, pairs, strict=True)
        )

    @staticmethod
    def backward(ctx, *grads):  # every grad a tensor (autograd materializes the unused outputs' as zeros)
        xc, *weights = ctx.saved_tensors
        x_dtype, w_dtypes = ctx.dtypes
        handle = grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = sum(g @ w for g, w in zip(grads, weights, strict=True))
            handle = all_reduce(grad_x, ctx.group, functional=ctx.functional)  # issued; waited below
        # While the all-reduce is in flight: the weights' (and biases') gradients, which do not need it. A bias
        # that is None needs no gradient.
        rows = xc.reshape(-1, xc.shape[-1])
        param_grads = []
        for i, g in enumerate(grads):
            g_rows = g.reshape(-1, g.shape[-1])
            needs_w, needs_b = ctx.needs_input_grad[4 + 2 * i], ctx.needs_input_grad[5 + 2 * i]
            param_grads.append((g_rows.T @ rows).to(w_dtypes[i]) if needs_w else None)
            param_grads.append(g_rows.sum(0).to(w_dtypes[i]) if needs_b else None)
        if handle is not None:
            grad_x = handle.wait().to(x_dtype)
        return grad_x, None, None, None, *param_grads


# --- public API -------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, group, functional: bool | None = None) -> Handle:
    """Sum `x` over the ranks of `group`. `functional` (default: whether torch.compile is tracing now) picks
    the functional collective; a backward decides it at its forward, since AOT traces backwards outside
    dynamo."""
    if not _active(group):
        return Handle(x)
    if _functional() if functional is None else functional:
        return Handle(_FunctionalAllReduce.apply(x, group), _FUNCTIONAL)
    box = _Box()
    out = _AllReduce.apply(x, group, box)
    return Handle(out, box.work, box.ready_at)


def all_gather(x: torch.Tensor, group, dim: int = 0) -> Handle:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if not _active(group):
        return Handle(x)
    if _functional():
        # Gathered along dim 0 (what the collective does), put along `dim` after the wait.
        p, shape = dist.get_world_size(group), x.shape
        finish = None if dim == 0 else (lambda out: torch.cat(out.view(p, *shape).unbind(0), dim=dim))
        return Handle(_FunctionalAllGather.apply(x, group), _FUNCTIONAL, finish=finish)
    box = _Box()
    out = _AllGather.apply(x, group, dim, box)
    return Handle(out, _FinishingWork(box) if box.work is not None else None, box.ready_at)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> Handle:
    """Sum over ranks, then keep this rank's chunk along `dim`. (Issued synchronously.)"""
    if not _active(group):
        return Handle(x)
    if _functional():
        p = dist.get_world_size(group)
        stacked = torch.cat(x.chunk(p, dim=dim), dim=0) if dim != 0 else x  # rank r's chunk at rows r
        return Handle(_FunctionalReduceScatter.apply(stacked, group), _FUNCTIONAL)
    return Handle(_ReduceScatter.apply(x, group, dim))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear on `x` computes in: autocast's when it is on for `x`'s device (what nn.Linear under autocast
    computes), else `x`'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if device != "meta" and torch.is_autocast_enabled(device) else x.dtype


def column_parallel_linears(x: torch.Tensor, linears, group) -> tuple[torch.Tensor, ...]:
    """`linear(copy_to_tp_region(x))` for each of `linears` (column-parallel shards reading one replicated input),
    computed as one autograd node whose backward hides the input gradient's all-reduce behind the weight
    gradients."""
    if not _active(group) or not torch.is_grad_enabled():  # no backward, nothing to hide
        return tuple(torch.nn.functional.linear(x, linear.weight, linear.bias) for linear in linears)
    params = [p for linear in linears for p in (linear.weight, linear.bias)]
    return _ColumnParallelLinears.apply(x, group, _functional(), compute_dtype(x), *params)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Mark `x` as the replicated input of column-parallel layers (its gradient is all-reduced)."""
    if not _active(group):
        return x
    if _functional():
        return _FunctionalCopyToTPRegion.apply(x, group)
    return _CopyToTPRegion.apply(x, group)
