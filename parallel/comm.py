"""The collectives models use, issued asynchronously, waited where the architecture needs them.

Every function takes a tensor and a process group and returns a `Handle`; `handle.wait()` gives the
result. The place a model calls `wait()` is the place the communication stops being hidden, so it
is written in the model's `forward()`. With `group=None` (no tensor parallelism) every function is
the identity and nothing is counted.

Modes (`set_mode`, or the `use_mode` context manager):
- `real`: torch.distributed collectives (gloo on CPU, nccl on CUDA), `async_op=True`.
- `none`: skip every collective and return the local tensor: the communication-free upper bound,
  same per-rank compute, meaningless values.
- `simulated`: one process plays rank 0 of a P-way group (e.g. on PyTorch's fake process group);
  nothing is sent, each collective is timed on a virtual link (`parallel.link.VirtualClock`).

All functions are autograd-correct (the backward of each collective is its adjoint), so the same
calls serve tensor-parallel training. Calls and bytes are counted per kind in `counters`.
"""

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.link import VirtualClock, get_link

MODES = ("real", "none", "simulated")


@dataclass
class _State:
    mode: str = "real"
    clock: VirtualClock | None = None


_state = _State()
counters: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})


def set_mode(mode: str, *, link="nvlink-h100", world_size: int | None = None, now=None, sync=None) -> None:
    """Switch communication mode. `simulated` needs `world_size` (P) and uses `link`'s alpha-beta model."""
    if mode not in MODES:
        raise ValueError(f"Unknown communication mode {mode!r}; choose one of {MODES}.")
    _state.mode = mode
    _state.clock = None
    if mode == "simulated":
        if not world_size or world_size < 2:
            raise ValueError(f"Simulated mode needs world_size >= 2 (the P it plays rank 0 of), got {world_size}.")
        kwargs = {"now": now} if now is not None else {}
        _state.clock = VirtualClock(get_link(link), world_size, sync=sync, **kwargs)


def get_mode() -> str:
    return _state.mode


def get_clock() -> VirtualClock | None:
    return _state.clock


@contextmanager
def use_mode(mode: str, **kwargs):
    previous, clock = _state.mode, _state.clock
    set_mode(mode, **kwargs)
    try:
        yield _state.clock
    finally:
        _state.mode, _state.clock = previous, clock


def reset_counters() -> None:
    counters.clear()


def snapshot_counters() -> dict[str, dict[str, int]]:
    return {kind: dict(c) for kind, c in counters.items()}


class Handle:
    """A collective in flight. `wait()` returns its result (and, when simulated, advances the clock)."""

    def __init__(self, tensor: torch.Tensor, work=None, ready_at: float | None = None):
        self._tensor, self._work, self._ready_at = tensor, work, ready_at
        if ready_at is not None:
            # The Python between `issue` and here (autograd bookkeeping) is not compute that could
            # hide the transfer; without this a model that waits at once would look partly hidden.
            _state.clock.rebase()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._ready_at is not None:
            _state.clock.wait(self._ready_at)
            self._ready_at = None
        return self._tensor


def _active(group) -> bool:
    return group is not None and _state.mode != "none" and dist.get_world_size(group) > 1


def _record(kind: str, nbytes: int) -> float | None:
    counters[kind]["calls"] += 1
    counters[kind]["bytes"] += nbytes
    return _state.clock.issue(kind, nbytes) if _state.mode == "simulated" else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the collectives, each an autograd Function whose forward issues the op asynchronously --------
# The async work handle cannot be an autograd output, so forward stores it in a small box.


class _Box:
    work = None
    ready_at = None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, box):
        out = x.contiguous().clone()
        box.ready_at = _record("all_reduce", _nbytes(out))
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
        box.ready_at = _record("all_gather", _nbytes(out))
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
    ready_at = _record("reduce_scatter", _nbytes(x))
    if _state.mode == "real":
        dist.reduce_scatter_single(out, torch.cat(parts, dim=0), group=group)
        return out
    _state.clock.wait(ready_at)  # issued synchronously: the simulated rank waits at once
    return parts[0].clone()


def _all_gather_sync(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    box = _Box()
    out = _AllGather.apply(x, group, dim, box)
    return _finish(box, out)


def _finish(box: _Box, out: torch.Tensor) -> torch.Tensor:
    return Handle(out, _FinishingWork(box) if box.work is not None else None, box.ready_at).wait()


class _FinishingWork:
    """Wait on the raw work, then run the copy that puts the result in place (if any)."""

    def __init__(self, box):
        self.box = box

    def wait(self):
        self.box.work.wait()
        if getattr(self.box, "finish", None) is not None:
            # Fill the autograd output in place without recording the copy (it is not part of the graph).
            with torch.no_grad():
                self.box.finish()


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_sync(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sync(grad, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    """Equal splits along dim 0: chunk i goes to rank i; the result stacks the chunks received."""

    @staticmethod
    def forward(ctx, x, group, box):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        box.ready_at = _record("all_to_all", _nbytes(x))
        if _state.mode == "real":
            box.work = dist.all_to_all_single(out, x, group=group, async_op=True)
        else:
            out = x.clone()
        return out

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an equal-split all-to-all is the same all-to-all.
        box = _Box()
        out = _AllToAll.apply(grad.contiguous(), ctx.group, box)
        return _finish(box, out), None, None


class _CopyToTPRegion(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the gradient of a replicated input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group).wait(), None


# --- public API -------------------------------------------------------------------------------


def all_reduce(x: torch.Tensor, group) -> Handle:
    """Sum `x` over the ranks of `group`."""
    if not _active(group):
        return Handle(x)
    box = _Box()
    out = _AllReduce.apply(x, group, box)
    return Handle(out, box.work, box.ready_at)


def all_gather(x: torch.Tensor, group, dim: int = 0) -> Handle:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    if not _active(group):
        return Handle(x)
    box = _Box()
    out = _AllGather.apply(x, group, dim, box)
    return Handle(out, _FinishingWork(box) if box.work is not None else None, box.ready_at)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> Handle:
    """Sum over ranks, then keep this rank's chunk along `dim`. (Issued synchronously.)"""
    if not _active(group):
        return Handle(x)
    return Handle(_ReduceScatter.apply(x, group, dim))


def all_to_all(x: torch.Tensor, group) -> Handle:
    """Send chunk i of `x` (equal splits along dim 0) to rank i; receive one chunk from each rank."""
    if not _active(group):
        return Handle(x)
    box = _Box()
    out = _AllToAll.apply(x, group, box)
    return Handle(out, box.work, box.ready_at)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Mark `x` as the replicated input of column-parallel layers (its gradient is all-reduced)."""
    if not _active(group):
        return x
    return _CopyToTPRegion.apply(x, group)
