"""The collectives models use, issued asynchronously, waited where the architecture needs them.

Every function takes a tensor and a process group and returns a `Handle`; `handle.wait()` gives the
result. The place a model calls `wait()` is the place the communication stops being hidden, so it
is written in the model's `forward()`. With `group=None` (no parallelism over that dimension) every
function is the identity and nothing is counted.

Collectives: `all_reduce`, `all_gather`, `reduce_scatter`, `send_recv` (point to point: a ring shift,
every rank sends to the rank `shift` places after it and receives from the one `shift` places before:
what ring attention and LASP-1's ring of states need), and `all_to_all` with equal splits or with
unequal per-rank row counts (`send_splits` / `recv_splits`, rows along dim 0; what expert parallelism
needs to send each expert's tokens to the rank holding it). `exchange_splits` tells every rank how
many rows it will receive from each peer (a small blocking all-to-all of the counts: one per peer,
or a row per peer, e.g. one count per expert the peer holds).

Modes (`set_mode`, or the `use_mode` context manager):
- `real`: torch.distributed collectives (gloo on CPU, nccl on CUDA), `async_op=True`. Inside a region
  torch.compile traces (`torch.compiler.is_compiling()`), the all-reduce (and the gradient all-reduce of
  `copy_to_tp_region`) is a functional collective instead (`torch.distributed._functional_collectives`: out
  of place, no copy) and `Handle.wait()` is its `wait_tensor`, at the same place in forward(): a tensor-
  parallel forward and backward compile with `fullgraph=True` and the schedule is still the model's code.
  The all-gather (gathered on dim 0, put along its dim after the wait), the reduce-scatter and the ring
  shift of `send_recv` (an all-to-all with one non-empty chunk each way) are functional there too.
  Traced collectives are not counted at run time (see `_record`); `graph_collectives(gm)` reads them off
  the compiled graph.
  An all-to-all whose splits are known on the host (equal splits, or splits given as ints: what the MoE
  family's "padded" dispatch sends, models/common/moe.py) is one too: `funcol.all_to_all_single`, its
  backward the all-to-all with the splits swapped. `exchange_splits` (the dropless dispatch's count
  exchange, read on the host) and the other collectives are not traceable yet (issue 18).
- `none`: skip every collective and return the local tensor: the communication-free upper bound,
  same per-rank compute, meaningless values. An all-to-all whose receive counts differ from its send
  counts returns each send chunk cut or zero-padded to its receive count (right shape, still
  differentiable); `exchange_splits` returns the send counts (traffic taken as symmetric).
- `simulated`: one process plays rank 0 of the mesh (e.g. on PyTorch's fake process group); nothing
  is sent, each collective is timed on a virtual link (`parallel.link.VirtualClock`) with the size
  P of ITS OWN group (`dist.get_world_size(group)`: on an ep x tp mesh the all-to-all over ep and the
  all-reduce over tp have different P). The link is one preset for every group
  (`set_mode("simulated", link="nvlink-h100")`) or one per mesh dimension
  (`link={"tp": "nvlink-h100", "ep": "ethernet-25g"}`; a group's dimension is the name
  `parallel.mesh` gave it). `world_size` is only the fallback P for a clock used without groups.
  The values are stand-ins: peers are taken to send this rank what it sends them (so
  `exchange_splits` returns the send counts and an all-to-all returns its input, each chunk cut or
  zero-padded to the receive count when those are given and differ). An all-to-all with unequal
  splits is timed by the bytes this rank sends to and receives from its peers:
  (P-1) alpha + max(sent, received) / beta (`parallel.link.all_to_all_time`).

All functions are autograd-correct (the backward of each collective is its adjoint; for an
all-to-all, the all-to-all with send and receive splits swapped), so the same calls serve training.
Backward collectives are issued and waited at once. Calls and bytes are counted per kind in
`counters` (bytes = the input tensor's size; for all-to-all, the rows this rank sends including its
own chunk); the count exchange of `exchange_splits` is counted as its own kind, `exchange_splits`, and
the simulated clock keeps its link and exposed time apart under that label too (`busy_by`, `exposed_by`).
"""

import math
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from parallel.link import VirtualClock, get_links
from parallel.mesh import group_dim

MODES = ("real", "none", "simulated")


@dataclass
class _State:
    mode: str = "real"
    clock: VirtualClock | None = None


_state = _State()
counters: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})


def set_mode(mode: str, *, link="nvlink-h100", world_size: int | None = None, now=None, sync=None) -> None:
    """Switch communication mode.

    `simulated` times each collective on `link`'s alpha-beta model: a preset name or `LinkPreset` for
    every group, or {mesh dimension name: preset}. Each collective uses its own group's size;
    `world_size` (optional) is the P for clock calls that name no group.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown communication mode {mode!r}; choose one of {MODES}.")
    clock = None
    if mode == "simulated":
        # P = 1 is the single-GPU baseline (the speed simulator's TP 1): nothing is sent, the clock is compute.
        if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
            raise ValueError(
                f"Simulated mode's world_size (the P it plays rank 0 of) must be an integer >= 1 (1: one device, "
                f"no collectives), got {world_size!r}."
            )
        kwargs = {"now": now} if now is not None else {}
        clock = VirtualClock(get_links(link), world_size, sync=sync, **kwargs)
    # Switch only once the link is known good, so a bad preset leaves the previous mode in place.
    _state.mode, _state.clock = mode, clock


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

    def __init__(self, tensor: torch.Tensor, work=None, ready_at: float | None = None, finish=None):
        self._tensor, self._work, self._ready_at = tensor, work, ready_at
        self._finish = finish  # a functional collective's rearrangement after its wait (all-gather on dim > 0)
        if ready_at is not None:
            # The Python between `issue` and here (autograd bookkeeping) is not compute that could
            # hide the transfer; without this a model that waits at once would look partly hidden.
            _state.clock.rebase()

    def wait(self) -> torch.Tensor:
        if self._work is _FUNCTIONAL:
            # A functional collective (under torch.compile): the wait is an op of the graph, here.
            self._tensor = funcol.wait_tensor(self._tensor)
            if self._finish is not None:
                self._tensor, self._finish = self._finish(self._tensor), None
            self._work = None
        elif self._work is not None:
            self._work.wait()
            self._work = None
        if self._ready_at is not None:
            _state.clock.wait(self._ready_at)
            self._ready_at = None
        return self._tensor


def _active(group) -> bool:
    return group is not None and _state.mode != "none" and dist.get_world_size(group) > 1


def _record(kind: str, nbytes: int, group, peer_bytes=None, counter: str | None = None) -> float | None:
    """Count a collective; when simulated, put it on its group's link and return when it is ready.

    Nothing is counted while torch.compile traces: a count there would be replayed after the graph, but its
    read of the counters would be a guard on their values, and a compiled decode step would recompile at
    every step. A compiled graph's collectives are its functional-collective nodes (`graph_collectives`)."""
    if torch.compiler.is_compiling():
        return None
    counters[counter or kind]["calls"] += 1
    counters[counter or kind]["bytes"] += nbytes
    if _state.mode != "simulated":
        return None
    p = dist.get_world_size(group)
    return _state.clock.issue(kind, nbytes, p, group_dim(group), peer_bytes=peer_bytes, label=counter or kind)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the collectives, each an autograd Function whose forward issues the op asynchronously --------
# The async work handle cannot be an autograd output, so forward stores it in a small box.


class _Box:
    work = None
    ready_at = None


# `Handle._work` of a functional collective (torch.distributed._functional_collectives): waited with
# `wait_tensor`, which a compiled graph holds as an op at the place forward() waits.
_FUNCTIONAL = object()


def _functional() -> bool:
    """Real collectives inside torch.compile: functional ones (traceable, out of place, no copy)."""
    return _state.mode == "real" and torch.compiler.is_compiling()


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


class _FunctionalAllToAll(torch.autograd.Function):
    """The all-to-all as a functional collective (host-known splits; None = equal), as `_AllToAll`: the
    backward sends each gradient row back where it came from (splits swapped), waited at once. Not counted
    at run time (`_record`): `graph_collectives` finds both in the graph."""

    @staticmethod
    def forward(ctx, x, group, send, recv):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return funcol.all_to_all_single(x.contiguous(), recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        back = funcol.all_to_all_single(grad.contiguous(), ctx.send, ctx.recv, ctx.group)
        return funcol.wait_tensor(back), None, None, None


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


def _ring_splits(rows: int, group, shift: int) -> tuple[list[int], list[int]]:
    """A ring shift as an all-to-all's splits: all rows to rank r + shift, all from rank r - shift."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    send, recv = [0] * p, [0] * p
    send[(me + shift) % p] = rows
    recv[(me - shift) % p] = rows
    return send, recv


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
    """Rows along dim 0: chunk i (send[i] rows) goes to rank i; the result stacks the chunks received
    (recv[i] rows from rank i). send = recv = None means equal splits."""

    @staticmethod
    def forward(ctx, x, group, send, recv, box):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        x = x.contiguous()
        rows = x.shape[0] if recv is None else sum(recv)
        if _state.mode != "none":
            box.ready_at = _record("all_to_all", _nbytes(x), group, _peer_bytes(x, group, send, recv))
        if _state.mode == "real":
            out = x.new_empty((rows, *x.shape[1:]))
            box.work = dist.all_to_all_single(
                out, x, output_split_sizes=recv, input_split_sizes=send, group=group, async_op=True
            )
            return out
        return _stand_in(x, send, recv)

    @staticmethod
    def backward(ctx, grad):
        # Row j of rank r's output is one row of some rank's input, moved unchanged: the adjoint sends
        # each gradient row back where it came from, the all-to-all with the splits swapped.
        box = _Box()
        out = _AllToAll.apply(grad.contiguous(), ctx.group, ctx.recv, ctx.send, box)
        return _finish(box, out), None, None, None, None


def _peer_bytes(x: torch.Tensor, group, send, recv) -> tuple[int, int] | None:
    """(sent, received) bytes to/from the OTHER ranks, for timing an uneven all-to-all; None if equal."""
    if send is None:
        return None  # equal splits: the ring formula on the input size gives the same time
    me = dist.get_rank(group)
    row_bytes = x.element_size() * math.prod(x.shape[1:])  # x may have no rows
    return (sum(send) - send[me]) * row_bytes, (sum(recv) - recv[me]) * row_bytes


def _stand_in(x: torch.Tensor, send, recv) -> torch.Tensor:
    """What `none` / `simulated` return: peers send back what they were sent, cut or zero-padded per chunk
    to the receive counts. Its adjoint is the same operation with the counts swapped."""
    if send is None or send == recv:
        return x.clone()
    pieces = []
    for chunk, rows in zip(x.split(send), recv, strict=True):
        if chunk.shape[0] >= rows:
            pieces.append(chunk[:rows])
        else:
            pieces += [chunk, x.new_zeros((rows - chunk.shape[0], *x.shape[1:]))]
    return torch.cat(pieces)


class _SendRecv(torch.autograd.Function):
    """Ring shift: send `x` to rank (r + shift) % P of the group, receive from rank (r - shift) % P."""

    @staticmethod
    def forward(ctx, x, group, shift, box):
        ctx.group, ctx.shift = group, shift
        x = x.contiguous()
        box.ready_at = _record("send_recv", _nbytes(x), group)
        if _state.mode != "real":
            return x.clone()  # simulated: the peer is taken to send what this rank sends
        p, me = dist.get_world_size(group), dist.get_rank(group)
        out = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, dist.get_global_rank(group, (me + shift) % p), group),
            dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - shift) % p), group),
        ]
        box.work = _P2PWork(dist.batch_isend_irecv(ops), x)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Rank r's output is rank (r - shift)'s input, unchanged: the adjoint sends each gradient back
        # where the value came from, the shift the other way.
        box = _Box()
        out = _SendRecv.apply(grad.contiguous(), ctx.group, -ctx.shift, box)
        return _finish(box, out), None, None, None


class _P2PWork:
    """The send and the receive of one shift, waited together; holds the send buffer until then."""

    def __init__(self, works, send_buffer):
        self.works, self.send_buffer = works, send_buffer

    def wait(self):
        for work in self.works:
            work.wait()
        self.send_buffer = None


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
    if _functional():
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


def send_recv(x: torch.Tensor, group, shift: int = 1) -> Handle:
    """Ring shift over `group`: send `x` to rank (r + shift) % P, receive the same-shaped tensor from rank
    (r - shift) % P. Every rank of the group takes part (a chain such as LASP-1's is P-1 shifts in which
    each rank's send carries its latest value). Counted under `send_recv` (bytes = the tensor sent); the
    simulated link times one hop, alpha + bytes / beta. Its backward is the shift the other way."""
    if not _active(group):
        return Handle(x)
    if _functional():
        # No functional send / recv: the shift is the all-to-all whose only non-empty chunks go to r + shift
        # and come from r - shift (NCCL runs it as that send and that receive); its backward shifts back.
        rows = x.reshape(1, -1)
        send, recv = _ring_splits(1, group, shift)
        return Handle(_FunctionalAllToAll.apply(rows, group, send, recv), _FUNCTIONAL, finish=lambda out: out.view_as(x))
    box = _Box()
    out = _SendRecv.apply(x, group, shift, box)
    return Handle(out, box.work, box.ready_at)


def all_to_all(x: torch.Tensor, group, send_splits=None, recv_splits=None) -> Handle:
    """Send rows of `x` (dim 0) to the ranks of `group`: `send_splits[i]` rows to rank i, in order; receive
    `recv_splits[i]` rows from rank i, stacked in rank order.

    Both None: equal splits (`x.shape[0]` divisible by P). Only `send_splits`: the receive counts are
    found first with `exchange_splits` (a blocking exchange; pass `recv_splits` when known to skip it).
    Only `recv_splits`: equal send splits. Splits are sequences of ints (or 1-D tensors) of length P.
    """
    p = dist.get_world_size(group) if group is not None else 1
    send = _splits(send_splits, p, "send_splits")
    recv = _splits(recv_splits, p, "recv_splits")
    if send is not None or recv is not None:
        if send is None:
            send = _equal_splits(x, p)
        if sum(send) != x.shape[0]:
            raise ValueError(f"send_splits {send} sum to {sum(send)} rows but the tensor has {x.shape[0]} rows.")
        if recv is None:
            recv = exchange_splits(send, group)
    elif p > 1:
        _equal_splits(x, p)  # checks divisibility
    if p == 1:  # no group, or a group of one rank
        if recv != send:
            raise ValueError(f"On one rank the rows received must be the rows sent ({send}), got recv_splits {recv}.")
        return Handle(x)
    if _state.mode == "none" and recv == send:
        return Handle(x)
    if _functional():
        # Host-known splits (the count exchange above, if any, is not traceable: graphs hold none). Not
        # counted at run time (`_record`): `graph_collectives` reads it off the graph.
        return Handle(_FunctionalAllToAll.apply(x, group, send, recv), _FUNCTIONAL)
    box = _Box()
    out = _AllToAll.apply(x, group, send, recv, box)
    return Handle(out, box.work, box.ready_at)


def exchange_splits(send_splits, group) -> list[int] | list[list[int]]:
    """Given how many rows this rank sends to each rank of `group`, return how many it receives from
    each (an all-to-all of the counts, waited at once: the counts size the receive buffer).

    `send_splits` may also be P rows of m counts each (a [P, m] tensor or P lists of m ints; expert
    parallelism sends the token count of each of rank i's m local experts): row i goes to rank i, and the
    result is P rows of m, row i received from rank i (still one all-to-all, of P*m counts).

    `none` and `simulated` modes return the send counts (peers taken to send back what they receive).
    """
    p = dist.get_world_size(group) if group is not None else 1
    rows = _count_rows(send_splits, p)
    send = [n for row in rows for n in row] if rows is not None else _splits(send_splits, p, "send_splits")
    if send is None:
        raise ValueError("exchange_splits needs the send counts, got None.")
    if not _active(group):
        return rows if rows is not None else send
    # Timed and counted as an all-to-all of the int64 counts, under its own counter name.
    ready_at = _record("all_to_all", 8 * len(send), group, counter="exchange_splits")
    if _state.mode == "simulated":
        _state.clock.wait(ready_at)
        return rows if rows is not None else send
    if isinstance(send_splits, torch.Tensor):
        device = send_splits.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    counts = torch.tensor(send, dtype=torch.int64, device=device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    if rows is not None:
        return [[int(n) for n in row] for row in received.view(p, -1).tolist()]
    return [int(n) for n in received.tolist()]


def _count_rows(splits, p: int) -> list[list[int]] | None:
    """P rows of m non-negative counts (a [P, m] tensor or P sequences), or None if `splits` is not 2-D."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 2:
            return None
        splits = splits.tolist()
    elif not (isinstance(splits, Sequence) and splits and isinstance(splits[0], Sequence | torch.Tensor)):
        return None
    rows = [_splits(row, len(row), "send_splits") for row in splits]
    if len(rows) != p or len({len(row) for row in rows}) != 1:
        raise ValueError(
            f"send_splits must be {p} rows of equally many counts (one row per rank of the group), "
            f"got rows of lengths {[len(row) for row in rows]}."
        )
    return rows


def _splits(splits, p: int, name: str) -> list[int] | None:
    """Validate per-rank row counts: None, or P non-negative ints (a list, tuple or 1-D tensor)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, Sequence):
        raise ValueError(f"{name} must be a sequence of {p} row counts, got {splits!r}.")
    counts = [int(n) for n in splits]
    if len(counts) != p or any(n < 0 for n in counts):
        raise ValueError(f"{name} must be {p} non-negative row counts (one per rank of the group), got {counts}.")
    return counts


def _equal_splits(x: torch.Tensor, p: int) -> list[int]:
    if x.shape[0] % p:
        raise ValueError(f"An equal-split all-to-all over {p} ranks needs rows divisible by {p}, got {x.shape[0]}.")
    return [x.shape[0] // p] * p


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Mark `x` as the replicated input of column-parallel layers (its gradient is all-reduced)."""
    if not _active(group):
        return x
    if _functional():
        return _FunctionalCopyToTPRegion.apply(x, group)
    return _CopyToTPRegion.apply(x, group)


# The functional collectives a compiled graph holds, by the kind `_record` counts them under.
_GRAPH_KINDS = {
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


def graph_collectives(gm: torch.fx.GraphModule) -> dict[str, dict[str, int]]:
    """The collectives of a traced graph (an AOT forward or backward graph), as `snapshot_counters` gives
    them for the eager run of the same code: {kind: {"calls", "bytes"}}, bytes = each op's input."""
    found = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            # An op's name reads "_c10d_functional.all_reduce" (dynamo's graph) or "...all_reduce.default" (AOT's).
            namespace, _, name = str(node.target).partition(".")
            name = name.split(".")[0]
            if node.op != "call_function" or namespace != "_c10d_functional" or name not in _GRAPH_KINDS:
                continue
            meta = node.args[0].meta  # AOT graphs say "val", dynamo's (and its subgraphs) "example_value"
            value = meta["val"] if "val" in meta else meta["example_value"]
            found[_GRAPH_KINDS[name]]["calls"] += 1
            found[_GRAPH_KINDS[name]]["bytes"] += value.numel() * value.element_size()
    return {kind: dict(c) for kind, c in found.items()}
