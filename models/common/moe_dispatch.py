"""Dispatch / combine of the MoE layer (models/common/moe.py): each assignment's token sent to the rank that
holds its expert (the all-to-all over the ep group), the experts run there, the rows sent back and summed with
their gates. Two dispatches, `MOE_DISPATCHES` (`check_moe_dispatch` checks a choice): "dropless" (`dispatch`)
and "padded" (`dispatch_padded`, every size known on the host).

- `dispatch(x [T, d], assignments, experts, ep_group=None, capacity=None) -> MoEDispatch`, then
  `.compute()`, then `.combine() -> [T, d]`: the three steps of an MoE layer split so that an architecture
  places each wait where it wants (ScMoE overlaps them with its dense block):
  * `dispatch`: a stable argsort of the expert ids gathers the tokens expert by expert; the token counts
    per expert are exchanged over ep (`comm.exchange_splits`, blocking: they size the receive buffer, one
    device-to-host sync); the tokens go out with the uneven `comm.all_to_all`: ISSUED, not waited.
  * `compute()`: waits the dispatch all-to-all, reorders the received (source rank, local expert) runs to
    expert-major order, runs the local experts, and issues the combine all-to-all (not waited).
  * `combine()`: waits the combine all-to-all, weights each returned row by its gate in `routing_dtype`
    and sums a token's rows in a fixed order (no atomics: deterministic on every device); returns x's dtype.
  `assignments` is a `Routing` or any object with `token_idx`, `expert_idx`, `gates` (a subset of a
  routing: MoE++'s FFN experts only; expert ids index `experts`).
  Dropless by default. With `capacity=C` each rank sends at most C assignments to each expert (the first
  C in assignment order, i.e. earlier tokens first; the rest are dropped: the token keeps its other
  experts' output and its residual). C comes from `capacity(num_tokens, num_experts, top_k,
  capacity_factor)` = top_k * ceil(capacity_factor * num_tokens / num_experts) (Switch Transformer's capacity, k per token) with the
  rank's own token count: every rank feeding the same batch shape gets the same C. Counts are exchanged
  before every all-to-all, so no choice of C can hang one; C bounds each expert's rows (at most P * C).
- `dispatch_padded(x [T, d], assignments, experts, ep_group=None, capacity=None, valid=None) -> PaddedDispatch`
  (then `.compute()`, `.combine()`, as above): the "padded" dispatch, whose every size is known on the host,
  so that no device-to-host copy stops a CUDA graph or `torch.compile(fullgraph=True)` from holding an MoE
  step (low-latency EP kernels such as DeepEP's do the same). Each rank sends exactly C rows to each of the
  E experts: a fixed [E * C, d] buffer, expert e's rows at [e C, (e + 1) C) in assignment order (earlier
  tokens first), padding rows zero, split evenly over the ep ranks (E/P * C rows each: the equal-split
  `comm.all_to_all`, a functional collective under torch.compile). `compute()` runs the local experts as a
  batched matmul on [E/P, P * C, d] (`GroupedExperts.forward_padded`: no counts; a padding row gives 0)
  and sends the rows back the same way; `combine()` gathers each assignment's row back by its fixed index
  (the row it was sent in), weights it by its gate (0 for a dropped one) and sums each token's rows in a
  fixed order as above. `capacity` defaults to T, the rank's token count: a token picks an expert at most
  once, so C = T never drops and padded == dropless (the experts compute E T rows where dropless computes
  k T: the price of fixed sizes, small at decode). `padded_capacity(T, E, top_k, factor)` gives the
  smaller C = ceil(factor * T * top_k / E) (at least 1, at most T). An expert with more than C assignments
  from one rank keeps its first C; the rest are dropped (the token keeps its residual and its other
  experts), and `PaddedDispatch.dropped` counts them on the device (no host read). `valid` [A] (bool)
  marks the assignments to send; the others (MoE++'s zero-computation experts, assignments over MoE++'s
  own capacities) stay in the fixed layout as invalid: no boolean selection, so no data-dependent size,
  and their expert ids are not read. Needs every token to have the same number of assignments (k = A / T,
  token-major as `TopKRouter` gives them, in any order) and every ep rank to feed the same T (C, hence
  the all-to-all's size, is computed on each rank from its own T). On the meta device (the speed
  simulator) it runs as it is, with no value read: the simulator sees the padded buffers' real sizes.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.common.moe_experts import GroupedExperts
from models.common.moe_routing import count_per_index, routing_dtype
from models.common.values import has_values
from parallel import comm

MOE_DISPATCHES = ("dropless", "padded")


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments each rank may send to one expert: top_k * ceil(capacity_factor * num_tokens / num_experts)
    (Switch Transformer's capacity, k per token). From the rank's token count, which is the same on every rank fed the same batch shape."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0 (None: dropless).")
    return top_k * math.ceil(capacity_factor * num_tokens / num_experts)


def check_moe_dispatch(mode: str, capacity_factor: float | None = None) -> None:
    """One clear error for an MoE dispatch (`moe_dispatch`) or a padded capacity factor that does not fit."""
    if not isinstance(mode, str) or mode not in MOE_DISPATCHES:
        raise ValueError(
            f"moe_dispatch={mode!r} is not an MoE dispatch; choose one of {MOE_DISPATCHES}: 'dropless' (exact, "
            "the all-to-all sized by counts read off the device; the default, for training) or 'padded' (a fixed "
            "capacity per expert, every size known on the host: for decode under CUDA graphs / torch.compile)."
        )
    factor = capacity_factor
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0
    ):
        raise ValueError(
            f"dispatch_capacity_factor={factor!r} must be a finite number > 0 (the padded dispatch's capacity per "
            "expert is then ceil(factor * tokens * top_k / experts)), or None for a capacity of every token (the "
            "padded dispatch never drops)."
        )


def padded_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None = None) -> int:
    """The padded dispatch's rows per (rank, expert): T (`capacity_factor` None: a token picks an expert at
    most once, so nothing is dropped), else ceil(capacity_factor * T * top_k / E), at least 1 and at most T.
    From the rank's own token count: every rank fed the same batch shape gets the same C."""
    check_moe_dispatch("padded", capacity_factor)
    if capacity_factor is None:
        return max(1, num_tokens)
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def balanced_counts(assignments: int, num_experts: int, capacity: int | None = None) -> list[int]:
    """`assignments` spread as evenly as they go over `num_experts` (the first ones get one more), each cut
    to `capacity`: the routing the speed simulator assumes, where the router has no values to choose by."""
    base, extra = divmod(assignments, num_experts)
    counts = [base + (e < extra) for e in range(num_experts)]
    return counts if capacity is None else [min(c, capacity) for c in counts]


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _token_slots(token_idx: torch.Tensor, num_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [A], per_token [T]): each assignment's place among its token's assignments (0, 1, ... in
    assignment order), so that the combine sums them without atomics, and each token's count of them."""
    per_token = count_per_index(token_idx, num_tokens)
    by_token = torch.argsort(token_idx, stable=True)
    token_first = per_token.cumsum(0) - per_token
    slot = torch.empty_like(token_idx)
    slot[by_token] = torch.arange(token_idx.numel(), device=device) - token_first[token_idx[by_token]]
    return slot, per_token


def _sum_over_slots(weighted: torch.Tensor, token_idx, slot_idx, num_tokens: int, slots: int) -> torch.Tensor:
    """Each token's sum of its gated expert outputs `weighted` [A, d], [T, d]. Each (token, slot) receives
    exactly one row, so this is a copy, not an accumulation; the sum over slots then runs in a fixed order on
    every device."""
    by_slot = weighted.new_zeros(num_tokens, slots, weighted.shape[-1])
    by_slot = by_slot.index_put((token_idx, slot_idx), weighted)
    return by_slot.sum(1)


@dataclass(eq=False)
class MoEDispatch:
    """An MoE layer's tokens in flight: made by `dispatch`, then `compute()`, then `combine()`."""

    experts: GroupedExperts
    ep_group: object
    ep_size: int
    num_tokens: int  # T, of this rank
    dtype: torch.dtype  # x's, for the combined output
    in_flight: comm.Handle  # the dispatch all-to-all, then the combine all-to-all
    send_splits: list[int]  # rows this rank sends to each ep rank
    recv_splits: list[int]  # rows it receives from each
    expert_counts: list[int]  # rows each local expert receives, over all sources
    gates: torch.Tensor  # [A_kept] routing_dtype(x's), the sent rows' gates, in the order they were sent
    token_idx: torch.Tensor  # [A_kept] the token of each sent row
    slot_idx: torch.Tensor  # [A_kept] its place among that token's assignments
    slots: int  # the most assignments any token has
    expert_major: torch.Tensor | None = None  # received rows -> (local expert, source rank) runs (ep > 1)
    back_to_sources: torch.Tensor | None = None  # its inverse
    stage: str = "dispatched"

    def compute(self) -> None:
        """Wait the dispatch all-to-all, run the local experts, issue the combine all-to-all."""
        if self.stage != "dispatched":
            raise RuntimeError(f"MoEDispatch.compute() runs once, after dispatch; this one is {self.stage}.")
        received = self.in_flight.wait()  # [R, d], runs by (source rank, local expert)
        if self.ep_size > 1:
            # Expert-major order for the grouped matmul: (local expert, source rank) runs.
            received = received[self.expert_major]
        out = self.experts(received, self.expert_counts)
        if self.ep_size > 1:
            out = out[self.back_to_sources]
        # Returned the way the tokens came: splits swapped.
        self.in_flight = comm.all_to_all(out, self.ep_group, self.recv_splits, self.send_splits)
        self.stage = "computed"

    def combine(self) -> torch.Tensor:
        """Wait the combine all-to-all; each token's output = sum of gate * expert output, [T, d] in x's dtype."""
        if self.stage != "computed":
            raise RuntimeError(f"MoEDispatch.combine() runs once, after compute(); this one is {self.stage}.")
        returned = self.in_flight.wait()  # [A_kept, d] in the expert-sorted order of this rank's assignments
        weighted = returned.to(self.gates.dtype) * self.gates[:, None]
        self.stage = "combined"
        return _sum_over_slots(weighted, self.token_idx, self.slot_idx, self.num_tokens, self.slots).to(self.dtype)


def dispatch(
    x: torch.Tensor, assignments, experts: GroupedExperts, ep_group=None, capacity: int | None = None
) -> MoEDispatch:
    """Send each assignment's token to the rank holding its expert (module docstring); the all-to-all is
    issued, not waited."""
    num_tokens, device = x.shape[0], x.device
    token_idx, expert_idx, gates = assignments.token_idx, assignments.expert_idx, assignments.gates
    num_experts, ep_size = experts.num_experts, _group_size(ep_group)
    local = _local_experts(experts, ep_size)
    # Expert-sorted order; stable, so each expert's assignments keep their order (earlier tokens first).
    order = torch.argsort(expert_idx, stable=True)
    counts = count_per_index(expert_idx, num_experts)
    if capacity is not None and has_values(x):
        first = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=device) - first[expert_idx[order]]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    slot, per_token = _token_slots(token_idx, num_tokens, device)
    if not has_values(x):
        # The speed simulator (eval.simulator.replay) runs without values: the routing is taken to be the load the
        # balance loss aims for, the assignments spread evenly over the experts (capacity then applied).
        counts, slots = balanced_counts(token_idx.numel(), num_experts, capacity), max(1, -(-token_idx.numel() // num_tokens))
        order = order[: sum(counts)]
    else:
        # The one device-to-host copy of the layer: the split sizes must be known on the host.
        host = torch.cat([counts, per_token.max().view(1)]).tolist()
        counts, slots = host[:num_experts], host[num_experts]
    count_rows = [counts[r * local : (r + 1) * local] for r in range(ep_size)]  # per destination rank
    send_splits = [sum(row) for row in count_rows]
    if ep_size > 1:
        # What every rank sends to each of my experts (blocking: it sizes the receive buffer).
        recv_rows = comm.exchange_splits(count_rows, ep_group)
    else:
        recv_rows = count_rows
    recv_splits = [sum(row) for row in recv_rows]
    routed = x[token_idx[order]]
    pending = comm.all_to_all(routed, ep_group, send_splits, recv_splits)  # issued, waited in compute()
    expert_major = back_to_sources = None
    if ep_size > 1:
        expert_major, back_to_sources = _expert_major_order(recv_rows, device)
    return MoEDispatch(
        experts=experts,
        ep_group=ep_group,
        ep_size=ep_size,
        num_tokens=num_tokens,
        dtype=x.dtype,
        in_flight=pending,
        send_splits=send_splits,
        recv_splits=recv_splits,
        expert_counts=[sum(row[e] for row in recv_rows) for e in range(local)],
        gates=gates[order].to(routing_dtype(x.dtype)),
        token_idx=token_idx[order],
        slot_idx=slot[order],
        slots=slots,
        expert_major=expert_major,
        back_to_sources=back_to_sources,
    )


def _local_experts(experts: GroupedExperts, ep_size: int) -> int:
    """E / P, the experts each ep rank holds, after checking that `experts` holds that many."""
    num_experts = experts.num_experts
    local = num_experts // ep_size
    if num_experts % ep_size or experts.gate_proj.shape[0] != local:
        raise ValueError(
            f"The experts hold {experts.gate_proj.shape[0]} of {num_experts} experts, but an ep group of {ep_size} "
            f"ranks needs {num_experts / ep_size:g} per rank; shard them with parallel.parallelize."
        )
    return local


@dataclass(eq=False)
class PaddedDispatch:
    """An MoE layer's tokens in flight in the padded layout (module docstring): made by `dispatch_padded`,
    then `compute()`, then `combine()`, as `MoEDispatch`. Every size is a Python int known before forward."""

    experts: GroupedExperts
    ep_group: object
    ep_size: int
    capacity: int  # C: rows per (rank, expert)
    num_tokens: int  # T, of this rank
    slots: int  # assignments per token (k)
    dtype: torch.dtype  # x's, for the combined output
    in_flight: comm.Handle  # the dispatch all-to-all of [E * C, d], then the combine all-to-all
    row: torch.Tensor  # [A] the buffer row each assignment went in (E * C: not sent)
    gates: torch.Tensor  # [A] routing_dtype(x's), 0 where not sent
    token_idx: torch.Tensor  # [A]
    slot_idx: torch.Tensor  # [A] its place among that token's assignments
    dropped: torch.Tensor  # 0-d int64: valid assignments over the capacity, not sent
    stage: str = "dispatched"

    def compute(self) -> None:
        """Wait the dispatch all-to-all, run the local experts on [E/P, P * C, d], issue the combine."""
        if self.stage != "dispatched":
            raise RuntimeError(f"PaddedDispatch.compute() runs once, after dispatch; this one is {self.stage}.")
        received = self.in_flight.wait()  # [P * E/P * C, d]: (source rank, local expert, row) blocks
        p, c, d = self.ep_size, self.capacity, received.shape[-1]
        local = self.experts.gate_proj.shape[0]
        by_expert = received.view(p, local, c, d).transpose(0, 1).reshape(local, p * c, d)
        out = self.experts.forward_padded(by_expert)
        back = out.view(local, p, c, d).transpose(0, 1).reshape(p * local * c, d)
        self.in_flight = comm.all_to_all(back, self.ep_group)  # equal splits, as the rows came
        self.stage = "computed"

    def combine(self) -> torch.Tensor:
        """Wait the combine all-to-all; each token's output = sum of gate * expert output, [T, d] in x's dtype."""
        if self.stage != "computed":
            raise RuntimeError(f"PaddedDispatch.combine() runs once, after compute(); this one is {self.stage}.")
        returned = self.in_flight.wait()  # [E * C, d], in the layout this rank sent
        # One zero row more for the assignments not sent, so that every assignment gathers a row.
        returned = torch.cat([returned, returned.new_zeros(1, returned.shape[-1])])
        weighted = returned[self.row].to(self.gates.dtype) * self.gates[:, None]
        self.stage = "combined"
        return _sum_over_slots(weighted, self.token_idx, self.slot_idx, self.num_tokens, self.slots).to(self.dtype)


def dispatch_padded(
    x: torch.Tensor,
    assignments,
    experts: GroupedExperts,
    ep_group=None,
    capacity: int | None = None,
    valid: torch.Tensor | None = None,
) -> PaddedDispatch:
    """The padded dispatch (module docstring): C = `capacity` (default T) rows to every expert, every size
    known on the host, nothing read off the device; the all-to-all is issued, not waited. `valid` [A] bool:
    the assignments to send (default all); the others are ignored, expert ids included."""
    num_tokens, d = x.shape
    token_idx, expert_idx, gates = assignments.token_idx, assignments.expert_idx, assignments.gates
    num_experts, ep_size = experts.num_experts, _group_size(ep_group)
    _local_experts(experts, ep_size)
    count = token_idx.shape[0]
    if count % max(num_tokens, 1):
        raise ValueError(
            f"The padded dispatch needs the same number of assignments for every token, but {count} assignments do "
            f"not split evenly over {num_tokens} tokens; route with a top-k router (k per token), or use 'dropless'."
        )
    slots = count // max(num_tokens, 1)
    c = max(1, num_tokens) if capacity is None else capacity
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"The padded dispatch's capacity must be an int >= 1 (rows per expert), got {capacity!r}.")
    device = x.device
    # Invalid assignments take expert E: sorted after every real expert, never within its capacity.
    expert = expert_idx if valid is None else torch.where(valid, expert_idx, num_experts)
    counts = count_per_index(expert, num_experts + 1)
    order = torch.argsort(expert, stable=True)  # stable: each expert's assignments in assignment order
    first = counts.cumsum(0) - counts
    position = torch.empty_like(expert)
    position[order] = torch.arange(count, device=device) - first[expert[order]]
    real = expert < num_experts
    sent = real & (position < c)
    dropped = (real & ~sent).sum()
    unsent = num_experts * c  # the row after the buffer: where the assignments not sent point
    row = torch.where(sent, expert * c + position, unsent)
    # Which token fills each buffer row (T: a zero row). Only the row after the buffer is written twice.
    source = torch.full((unsent + 1,), num_tokens, dtype=torch.long, device=device)
    source = source.index_put((row,), token_idx)[:unsent]
    buffer = torch.cat([x, x.new_zeros(1, d)])[source]  # [E * C, d], expert-major; padding rows zero
    pending = comm.all_to_all(buffer, ep_group)  # equal splits, E/P * C rows per rank: issued, waited in compute()
    slot, _ = _token_slots(token_idx, num_tokens, device)  # a fixed-shape sort, no host read
    return PaddedDispatch(
        experts=experts,
        ep_group=ep_group,
        ep_size=ep_size,
        capacity=c,
        num_tokens=num_tokens,
        slots=slots,
        dtype=x.dtype,
        in_flight=pending,
        row=row,
        gates=torch.where(sent, gates.to(routing_dtype(x.dtype)), 0.0),
        token_idx=token_idx,
        slot_idx=slot,
        dropped=dropped,
    )


def _expert_major_order(recv_rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking received rows, runs (source rank s, local expert e) in that order, to runs (e, s),
    and its inverse."""
    counts = torch.tensor(recv_rows, dtype=torch.long, device=device)  # [P, E_local]
    total = int(sum(map(sum, recv_rows)))
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    run_counts, run_starts = counts.T.flatten(), starts.T.flatten()  # runs in (e, s) order
    within = torch.arange(total, device=device) - (run_counts.cumsum(0) - run_counts).repeat_interleave(
        run_counts, output_size=total
    )
    order = run_starts.repeat_interleave(run_counts, output_size=total) + within
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=device)
    return order, inverse
