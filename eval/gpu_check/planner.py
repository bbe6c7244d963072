"""The time planner of the compiled phase: `compiled_queue` orders what runs (llama first: the device model's
calibration anchor and the compile that sizes the others; the fla kernel check; every other item at the first
batch size with a fair share of the time left; the other batch sizes), `CompileClock` estimates a compile's
seconds from the compiles so far, and `choose_layers` picks how many layers a compiled row gets within the
`--budget` (fewer layers where the whole model would not finish in time, none under `MIN_LAYERS`).
"""

import statistics

from eval.gpu_check.build import Item
from eval.gpu_check.report import Report
from eval.gpu_check.settings import Settings

ANCHORS = ("llama", "ladder")  # compiled first: the device model is fitted on the Ladder paper's table
MIN_LAYERS = 4  # a compiled row with fewer layers than this is skipped rather than run


class CompileClock:
    """Seconds a compile of an L-layer decode step takes, a + b L, fitted to the compiles so far (a prior
    before the first; with one, a is at most half of it)."""

    def __init__(self, a: float, b: float):
        self.prior, self.obs = (a, b), []

    def add(self, layers: int, seconds: float) -> None:
        self.obs.append((layers, seconds))

    def coeffs(self) -> tuple[float, float]:
        if not self.obs:
            return self.prior
        xs, ys = zip(*self.obs, strict=True)
        if len(set(xs)) == 1:
            t = statistics.mean(ys)
            a = min(self.prior[0], t / 2)
            return a, (t - a) / xs[0]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        b = sum((x - mx) * (y - my) for x, y in self.obs) / sum((x - mx) ** 2 for x in xs)
        b = max(b, 0.05 * my / mx)
        return max(0.0, my - b * mx), b

    def need(self, layers: int) -> float:
        a, b = self.coeffs()
        return 1.15 * (a + b * layers)


def compiled_queue(items: list[Item], batches: list[int]) -> list[tuple]:
    """What phase 2 runs, in order, each (kind, item, batch, policy): llama at the first shape (the device
    model's calibration anchor, and the compile that sizes the others; policy "max": every layer the budget
    allows), the fla kernel check, then every other item at the first batch size ("fair": an equal share of
    the time left, so every architecture gets a compiled row, at fewer layers if need be): llama at the other
    shapes, the rest, ladder at the larger shapes last (in comm mode none it computes what llama does); then
    the other batch sizes ("max")."""
    if not items or not batches:
        return [("kernel", None, None, None)]
    first = items[0].shape
    lead = [i for i in items if i.arch == ANCHORS[0] and i.shape == first] or items[:1]
    rest = [i for i in items if all(i is not x for x in lead)]
    rest = (
        [i for i in rest if i.arch == ANCHORS[0]]
        + [i for i in rest if i.arch != ANCHORS[0] and (i.arch not in ANCHORS or i.shape == first)]
        + [i for i in rest if i.arch in ANCHORS[1:] and i.shape != first]
    )
    b1, more = batches[0], batches[1:]
    queue = [("compiled", i, b1, "max") for i in lead] + [("kernel", None, None, None)]
    queue += [("compiled", i, b1, "fair") for i in rest]
    queue += [("compiled", i, b, "max") for b in more for i in lead + rest]
    return queue


def choose_layers(item: Item, batch: int, policy: str, fair_left: int, s: Settings, clock: CompileClock,
                  report: Report) -> tuple[int | None, float]:  # fmt: skip
    """The layers to compile `item` with (None: none fit) and the estimated seconds at the full count."""
    eager = report.rows.get((item.shape, item.label, batch, item.layers), {}).get("eager") or {}
    step_s, prefill_s = eager.get("step_ms", 50.0) * 1e-3, eager.get("prefill_ms", 100.0) * 1e-3

    def need(layers: int) -> float:
        share = layers / item.layers
        t = clock.need(layers) + 5.0 + (item.params_gb or 0) * share * 0.05  # compile, build and free
        t += share * s.repeats * (prefill_s + (s.warmup + s.compiled_steps) * step_s * 0.5)  # compiled runs
        if layers != item.layers:  # its own eager row too
            t += share * s.repeats * (prefill_s + (s.warmup + s.eager_steps) * step_s)
        return t

    remaining = s.budget_s - report.elapsed()
    allowance = remaining
    if policy == "fair":
        allowance = min(remaining, max(remaining / max(1, fair_left), need(min(MIN_LAYERS, item.layers))))
    if need(item.layers) <= allowance:
        return item.layers, need(item.layers)
    for layers in range((item.layers - 1) // 2 * 2, MIN_LAYERS - 1, -2):
        if need(layers) <= allowance:
            return layers, need(item.layers)
    return None, need(item.layers)
