"""The communication modes, the `Handle` every collective returns, and the counters of calls and bytes.

`set_mode` / `use_mode` switch between `real`, `none` and `simulated` (a virtual link per group,
`parallel.link.VirtualClock`); `Handle.wait()` is where a model stops hiding a collective. `_record` counts a
collective (and, simulated, puts it on its group's link); `graph_collectives` reads the collectives off a
compiled graph, which are not counted at run time. The collectives themselves: `parallel.comm_reduce` and
`parallel.comm_all_to_all` (all of them under `parallel.comm`).
"""

from collections import defaultdict
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


# The async work handle cannot be an autograd output, so a collective's forward stores it in a small box.
class _Box:
    work = None
    ready_at = None


# `Handle._work` of a functional collective (torch.distributed._functional_collectives): waited with
# `wait_tensor`, which a compiled graph holds as an op at the place forward() waits.
_FUNCTIONAL = object()


def _functional() -> bool:
    """Real collectives inside torch.compile: functional ones (traceable, out of place, no copy)."""
    return _state.mode == "real" and torch.compiler.is_compiling()


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
