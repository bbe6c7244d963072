"""Mesh degree points and link settings as the bench names them: keys, labels, rank counts, the points of a setting.

A degree point is {mesh dimension: degree} (`{"tp": 2}`, `{"ep": 2, "tp": 2}`); a `simulated.links` entry is one
link preset for every dimension or {dimension: preset}. Nothing here reads the settings.
"""

import math


def degrees_key(degrees: dict[str, int]) -> tuple:
    """A hashable, order-free form of a degrees dict, to index rows by."""
    return tuple(sorted(degrees.items()))


def degrees_label(degrees: dict[str, int], sep: str = "=") -> str:
    """`tp=2` (tables), `tp2` (W&B keys, with sep=""); several dimensions joined by commas / dashes."""
    return ("," if sep else "-").join(f"{dim}{sep}{n}" for dim, n in sorted(degrees.items()))


def ranks(degrees: dict[str, int]) -> int:
    """Processes a run at these degrees takes (the product of the degrees)."""
    return math.prod(degrees.values())


def degree_points(tp=(), ep=(), degrees=()) -> list[dict[str, int]]:
    """The mesh degree points of the settings: {"tp": P} per TP degree and {"ep": P} per EP degree (one
    dimension at a time, so each is compared on its own), then each point of `degrees` as given
    ({"ep": 2, "tp": 2}); a point listed twice is measured once."""
    points = [{"tp": p} for p in tp or ()] + [{"ep": p} for p in ep or ()] + [dict(d) for d in degrees or ()]
    first = {}
    for d in points:
        first.setdefault(degrees_key(d), d)
    return list(first.values())


def link_label(link) -> str:
    """A `simulated.links` entry as rows name it: the preset, or `ep=pcie4,tp=nvlink-h100` per dimension."""
    if isinstance(link, dict):
        return ",".join(f"{dim}={preset}" for dim, preset in sorted(link.items()))
    return link


def link_of(link, dim: str) -> str | None:
    """The preset a collective over mesh dimension `dim` runs on under this `simulated.links` entry."""
    return link.get(dim) if isinstance(link, dict) else link
