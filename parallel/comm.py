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
  Traced collectives are not counted at run time (see `parallel.comm_modes._record`); `graph_collectives(gm)` reads them off
  the compiled graph.
  An all-to-all whose splits are known on the host (equal splits, or splits given as ints: what the MoE
  family's "padded" dispatch sends, models/common/moe.py) is one too: `funcol.all_to_all_single`, its
  backward the all-to-all with the splits swapped. `exchange_splits` (the dropless dispatch's count
  exchange, read on the host) and the other collectives are not traceable yet.
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
Backward collectives are issued and waited at once, but for one: `column_parallel_linears` (the column-parallel
linears that read one replicated input, as one autograd node) issues its input gradient's all-reduce, computes
the weights' gradients, then waits. Calls and bytes are counted per kind in
`counters` (bytes = the input tensor's size; for all-to-all, the rows this rank sends including its
own chunk); the count exchange of `exchange_splits` is counted as its own kind, `exchange_splits`, and
the simulated clock keeps its link and exposed time apart under that label too (`busy_by`, `exposed_by`).

This module is the one name models and tools import (`from parallel import comm`); the code lives in one file
per job: the modes, the `Handle` and the counters (`parallel.comm_modes`), all-reduce / all-gather /
reduce-scatter (`parallel.comm_reduce`), the all-to-all, its count exchange and the ring shift
(`parallel.comm_all_to_all`).
"""


from parallel.comm_all_to_all import all_to_all, exchange_splits, send_recv
from parallel.comm_modes import (
    MODES,
    Handle,
    counters,
    get_clock,
    get_mode,
    graph_collectives,
    reset_counters,
    set_mode,
    snapshot_counters,
    use_mode,
)
from parallel.comm_reduce import (
    all_gather,
    all_reduce,
    column_parallel_linears,
    copy_to_tp_region,
    reduce_scatter,
)

__all__ = [
    "MODES",
    "Handle",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "column_parallel_linears",
    "copy_to_tp_region",
    "counters",
    "exchange_splits",
    "get_clock",
    "get_mode",
    "graph_collectives",
    "reduce_scatter",
    "reset_counters",
    "send_recv",
    "set_mode",
    "snapshot_counters",
    "use_mode",
]
