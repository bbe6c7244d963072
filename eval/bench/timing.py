"""One timed generation (gpt-fast's benchmark loop): prefill, then greedy decode steps, each phase timed.

`generate_once` runs a prompt's prefill and `new_tokens - 1` decode steps under a timer (`WallTimer`: wall time,
the device synchronised; `ClockTimer`: the simulated link's virtual clock), with parallel.comm's counters per
phase; `measure_interleaved` warms every architecture up and interleaves the repeats across them (repeat r of
every arch before repeat r+1, so slow drift in a shared machine's load hits every architecture alike);
`summarize` turns the runs into a row's numbers (median, min-max, communication per forward).
"""

import statistics
import time

import torch
import torch.distributed as dist

from parallel import comm


class WallTimer:
    """Wall time with the device synchronised at both ends (and ranks aligned by a barrier if real)."""

    exposed = comm_busy = exposed_by = busy_by = None

    def __init__(self, device: torch.device, barrier: bool = False):
        self.device, self.barrier = device, barrier

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self):
        self._sync()
        if self.barrier:
            dist.barrier()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._t0


class ClockTimer:
    """The simulated link's virtual clock: measured compute plus communication left exposed."""

    def __init__(self, clock):
        self.clock = clock

    def start(self):
        self.clock.start()

    def stop(self) -> float:
        t = self.clock.elapsed()
        self.exposed, self.comm_busy = self.clock.exposed, self.clock.comm_busy
        # Per label (collective kind; the count exchange of expert parallelism apart): the MoE columns.
        self.exposed_by, self.busy_by = dict(self.clock.exposed_by), dict(self.clock.busy_by)
        return t


@torch.no_grad()
def generate_once(model, ids: torch.Tensor, new_tokens: int, timer) -> dict:
    """Prefill then new_tokens - 1 greedy decode steps; times, exposed comm and comm counts of each phase."""
    comm.reset_counters()
    timer.start()
    out = model(ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = _phase(timer)
    prefill["counts"] = comm.snapshot_counters()
    comm.reset_counters()
    cache = out.cache
    timer.start()
    for _ in range(new_tokens - 1):
        out = model(token, cache=cache, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    decode = _phase(timer)
    decode["counts"] = comm.snapshot_counters()
    return {"prefill": prefill, "decode": decode}


def _phase(timer) -> dict:
    t = timer.stop()
    return {"time": t, "exposed": timer.exposed, "comm_busy": timer.comm_busy, "exposed_by": timer.exposed_by,
            "busy_by": timer.busy_by}  # fmt: skip


def measure_interleaved(built: dict, cfg: dict, batch: int, make_timer, device) -> dict[str, list[dict]]:
    """Warm up every arch, then `repeats` rounds of one generation per arch; {arch: [run, ...]}."""
    gen = torch.Generator().manual_seed(cfg["seed"] + batch)
    ids = torch.randint(0, cfg["bench_shape"]["vocab_size"], (batch, cfg["prompt_len"]), generator=gen).to(device)
    for model in built.values():
        for _ in range(cfg["warmup"]):
            generate_once(model, ids, cfg["new_tokens"], make_timer())
    runs = {arch: [] for arch in built}
    for _ in range(cfg["repeats"]):
        for arch, model in built.items():
            runs[arch].append(generate_once(model, ids, cfg["new_tokens"], make_timer()))
    return runs


def summarize(runs: list[dict], batch: int, new_tokens: int) -> dict:
    """Median and min/max over repeats, per-forward communication counts, in report units."""
    steps = new_tokens - 1
    pre = [r["prefill"]["time"] for r in runs]
    dec = [r["decode"]["time"] for r in runs]
    total = [batch * new_tokens / (p + d) for p, d in zip(pre, dec, strict=True)]
    row = {
        "prefill_ms": 1e3 * statistics.median(pre),
        "prefill_ms_min": 1e3 * min(pre),
        "prefill_ms_max": 1e3 * max(pre),
        "decode_ms_per_step": 1e3 * statistics.median(dec) / steps,
        "decode_tok_s": batch * steps / statistics.median(dec),
        "decode_tok_s_min": batch * steps / max(dec),
        "decode_tok_s_max": batch * steps / min(dec),
        "total_tok_s": statistics.median(total),
    }
    for phase, per in (("prefill", 1), ("decode", steps)):
        counts = runs[-1][phase]["counts"]
        row[f"{phase}_comm_calls"] = sum(c["calls"] for c in counts.values()) / per
        row[f"{phase}_comm_bytes"] = sum(c["bytes"] for c in counts.values()) / per
        row[f"{phase}_comm_by_kind"] = {k: {n: v / per for n, v in c.items()} for k, c in counts.items()}
        exposed = [r[phase]["exposed"] for r in runs]
        if exposed[0] is not None:
            row[f"{phase}_exposed_ms"] = 1e3 * statistics.median(exposed) / per
            row[f"{phase}_comm_busy_ms"] = 1e3 * statistics.median(r[phase]["comm_busy"] for r in runs) / per
            # Share of the link time left exposed. The standard block waits every collective at once, so
            # for it this should be 1; less means the clock counted time between issue and wait as compute.
            busy = row[f"{phase}_comm_busy_ms"]
            row[f"{phase}_exposed_share"] = row[f"{phase}_exposed_ms"] / busy if busy > 0 else None
            labels = sorted({k for r in runs for k in r[phase]["busy_by"]})
            for name, key in (("exposed_ms_by_kind", "exposed_by"), ("comm_busy_ms_by_kind", "busy_by")):
                row[f"{phase}_{name}"] = {
                    k: 1e3 * statistics.median(r[phase][key].get(k, 0.0) for r in runs) / per for k in labels
                }
    # Per-forward names: prefill is one forward, decode figures are per step (one forward each).
    return row


