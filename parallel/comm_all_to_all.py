"""The collectives that move rows between ranks unchanged: the all-to-all, with equal splits or unequal
per-rank row counts (what expert parallelism needs to send each expert's tokens to the rank holding it),
`exchange_splits`, the blocking all-to-all of the counts that tells every rank how many rows it will receive
from each peer, and the ring shift `send_recv` (point to point: every rank sends to the rank `shift` places
after it and receives from the one `shift` places before; under torch.compile an all-to-all with one
non-empty chunk each way). The backward of each moves every gradient row back where it came from.

`none` and `simulated` return stand-ins: peers are taken to send back what they receive, each chunk cut or
zero-padded to the receive count.
"""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from parallel.comm_modes import (
    _FUNCTIONAL,
    Handle,
    _active,
    _Box,
    _finish,
    _functional,
    _nbytes,
    _record,
    _state,
)


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


# --- public API -------------------------------------------------------------------------------


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


# --- the ring shift (point to point) ----------------------------------------------------------


def _ring_splits(rows: int, group, shift: int) -> tuple[list[int], list[int]]:
    """A ring shift as an all-to-all's splits: all rows to rank r + shift, all from rank r - shift."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    send, recv = [0] * p, [0] * p
    send[(me + shift) % p] = rows
    recv[(me - shift) % p] = rows
    return send, recv


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
