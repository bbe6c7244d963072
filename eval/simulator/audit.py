"""Which aten ops the speed simulator charges no FLOPs for, and why that is right: `python -m eval.simulator.audit`.

Every architecture of `models.ZOO` runs on the meta device (its tiny config, bfloat16, sharded at a degree
point of its own layout on a fake process group): a prefill and a decode step on its static cache (not
under sequence parallelism, which has no cache) and a training step, forward and backward. Each op that is
not a view or a factory and has no FLOP formula (`torch.utils.flop_counter`'s registry or
`eval.simulator.device.EXTRA_FLOPS`) is listed with how often it ran and its class: pointwise (aten's tag)
or one of `MEMORY_BOUND`'s. An op in neither is `UNCLASSIFIED`: a kernel that may do real arithmetic the
device model would charge as free; the test (tests/test_simulate.py) fails on one.
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import models
from eval.simulator.device import _FREE, EXTRA_FLOPS, MEMORY_BOUND
from eval.simulator.replay import build_meta, make_cache, release

UNCLASSIFIED = "UNCLASSIFIED: may do arithmetic the device model does not charge"


class _NoFormula(TorchDispatchMode):
    """Counts the ops run inside that have no FLOP formula (views and factories left out)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.pointwise = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name, packet = func._schema.name, func.overloadpacket
        if not (func.is_view or name in _FREE or packet in flop_registry or packet in EXTRA_FLOPS):
            self.ops[name] += 1
            if torch.Tag.pointwise in func.tags:
                self.pointwise.add(name)
        return out


def degree_point(entry) -> dict[str, int]:
    """A 2-way point of the architecture's own layout: tp if it has one, else ep, else sp."""
    for dim in ("tp", "ep", "sp"):
        if dim in entry.degrees:
            return {dim: 2}
    return {}


def classify(name: str, pointwise: set) -> str:
    if name in pointwise:
        return "pointwise (a few ops per element)"
    for why, names in MEMORY_BOUND.items():
        if name in names:
            return why
    return UNCLASSIFIED


def audit(archs=None) -> dict[str, dict]:
    """{op: {"count", "class", "archs"}} over `archs` (default every architecture)."""
    found, seen_in = _NoFormula(), collections.defaultdict(set)
    for arch in sorted(archs or models.ZOO):
        entry = models.get(arch)
        degrees = degree_point(entry)
        model = build_meta(arch, entry.tiny_at(degrees), degrees, torch.bfloat16)
        try:
            ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
            before = collections.Counter(found.ops)
            with found:
                if "sp" not in degrees:
                    cache = make_cache(model, 2, 16)
                    model(ids, cache=cache, use_cache=True)
                    model(ids[:, :1], cache=cache, use_cache=True)
                model.train()
                model(ids, labels=ids, use_cache=False).loss.backward()
            for name in found.ops - before:
                seen_in[name].add(arch)
        finally:
            release()
    return {
        name: {"count": n, "class": classify(name, found.pointwise), "archs": sorted(seen_in[name])}
        for name, n in sorted(found.ops.items())
    }


def main() -> None:
    rows = audit()
    print("| op | runs | class | architectures |\n|---|---|---|---|")
    for name, r in rows.items():
        if not r["class"].startswith("pointwise"):
            print(f"| `{name}` | {r['count']} | {r['class']} | {', '.join(r['archs'])} |")
    pointwise = [n for n, r in rows.items() if r["class"].startswith("pointwise")]
    print(f"\nPointwise (memory-bound, fused when compiled): {len(pointwise)} ops ({', '.join(pointwise)}).")
    unclassified = [n for n, r in rows.items() if r["class"] == UNCLASSIFIED]
    print(f"Unclassified: {', '.join(unclassified) if unclassified else 'none'}.")


if __name__ == "__main__":
    main()
