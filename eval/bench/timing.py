"""One timed generation (gpt-fast's benchmark loop): prefill, then greedy decode steps, each phase timed.

`generate_once` runs a `Program` (eval.bench.steps' prefill and decode step, eager or compiled as a whole, on a
static cache reused across generations or a growing one) for a prompt's prefill and `new_tokens - 1` decode
steps under a timer (`WallTimer`: wall time, the device synchronised; `ClockTimer`: the simulated link's
virtual clock), with parallel.comm's counters per phase; `measure_interleaved` warms every architecture up
(a compiled program compiles there) and interleaves the repeats across them (repeat r of every arch before
repeat r+1, so slow drift in a shared machine's load hits every architecture alike); `summarize` turns the
runs into a row's numbers (median, min-max, communication per forward, kernels per decode step). The decode loop
itself is `decode_steps`; eval.gpu_check times its programs' decode steps through it and `WallTimer` too.
"""

import statistics
import time

import torch
import torch.distributed as dist

from eval.bench.steps import compile_steps, decode_step, prefill
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


PROGRAMS = ("eager", "compiled")


class Program:
    """What one architecture runs for one batch size: its two steps (eval.bench.steps), eager or compiled, and
    its cache. A static cache (`static`) is made once and emptied in place before every generation, as gpt-fast
    reuses its caches (and a CUDA graph keeps reading the same buffers); its buffers are allocated by one eager
    prefill first, so that they exist outside any graph. A growing cache is made fresh each time."""

    def __init__(
        self, model, name: str, batch: int, max_len: int, static: bool, device: torch.device, backend="inductor"
    ):
        if name not in PROGRAMS:
            raise ValueError(f"program={name!r}; the bench runs {' or '.join(PROGRAMS)}.")
        if name == "compiled" and not static:
            raise ValueError("The compiled program needs the static cache (static_cache=true): a growing cache "
                             "changes shape at every step.")  # fmt: skip
        self.model, self.name, self.batch, self.max_len = model, name, batch, max_len
        self.graphs = None
        if name == "compiled":
            # CUDA graphs on CUDA (gpt-fast's decode step); on CPU there are none.
            mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
            self.prefill, self.step, self.graphs = compile_steps(mode=mode, backend=backend)
        else:
            self.prefill, self.step = prefill, decode_step
        self.cache = None
        if static:
            self.cache = model.model.make_cache(batch_size=batch, max_cache_len=max_len, static=True)
            with torch.no_grad(), comm.use_mode("none"):
                prefill(model, torch.zeros(batch, 1, dtype=torch.long, device=device), self.cache)

    def fresh_cache(self):
        if self.cache is None:
            return self.model.model.make_cache(batch_size=self.batch)
        self.cache.reset()
        return self.cache

    def counts(self, phase: str, calls: int) -> dict:
        """The collectives of `calls` calls of a phase: counted as they ran (eager), or read off the compiled
        graph (a compiled graph's collectives are not counted at run time: parallel.comm_modes._record)."""
        counts = comm.snapshot_counters()
        if self.graphs is not None and self.graphs[phase].graphs:
            for kind, c in self.graphs[phase].graphs[-1].items():
                mine = counts.setdefault(kind, {"calls": 0, "bytes": 0})
                for n, v in c.items():
                    mine[n] = mine.get(n, 0) + v * calls
        return counts

    def kernels_per_step(self, ids: torch.Tensor) -> int | None:
        """Kernels one decode step launches: eager, every aten op that is not a view or a factory
        (eval.simulator.device.DeviceClock, nothing fused), counted on one step with collectives off;
        compiled, inductor's kernels of the decode graph (generated + extern, counted when it was compiled)."""
        if self.graphs is not None:
            return self.graphs["decode"].kernels[-1] if self.graphs["decode"].kernels else None
        from eval.simulator.device import DeviceClock

        cache = self.fresh_cache()
        with torch.no_grad(), comm.use_mode("none"):
            token, _ = self.prefill(self.model, ids, cache)
            with DeviceClock(fuse_pointwise=False) as clock:
                self.step(self.model, token, cache)
        return int(sum(clock.kernel))


def generate_once(program: Program, ids: torch.Tensor, new_tokens: int, timer) -> dict:
    """Prefill then new_tokens - 1 greedy decode steps of `program`; times, exposed comm and comm counts of
    each phase."""
    model, cache = program.model, program.fresh_cache()
    comm.reset_counters()
    timer.start()
    token, _ = program.prefill(model, ids, cache)
    prefill_phase = _phase(timer)
    prefill_phase["counts"] = program.counts("prefill", 1)
    comm.reset_counters()
    timer.start()
    decode_steps(program, token, cache, new_tokens - 1)
    decode = _phase(timer)
    decode["counts"] = program.counts("decode", new_tokens - 1)
    return {"prefill": prefill_phase, "decode": decode}


def decode_steps(program: Program, token: torch.Tensor, cache, steps: int, mark_steps: bool = False,
                 clone: bool | None = None) -> torch.Tensor:  # fmt: skip
    """`steps` greedy decode steps of `program` from `token` into `cache`; the last token. A CUDA graph's output is
    overwritten by its next replay, so the token is cloned before it goes back in: by default where the program
    is compiled and on CUDA; `clone=True` after every step. `mark_steps`: every step begins a new CUDA-graph step
    (torch.compiler.cudagraph_mark_step_begin), as eval.gpu_check's timed runs mark their compiled steps."""
    for _ in range(steps):
        if mark_steps:
            torch.compiler.cudagraph_mark_step_begin()
        token, _ = program.step(program.model, token, cache)
        if clone or (clone is None and program.graphs is not None and token.is_cuda):
            token = token.clone()
    return token


def _phase(timer) -> dict:
    t = timer.stop()
    return {"time": t, "exposed": timer.exposed, "comm_busy": timer.comm_busy, "exposed_by": timer.exposed_by,
            "busy_by": timer.busy_by}  # fmt: skip


def cache_length(cfg: dict) -> int:
    """The static cache's length: prompt + new tokens rounded up to 8 (as the speed simulator's)."""
    return -(-(cfg["prompt_len"] + cfg["new_tokens"]) // 8) * 8


def measure_interleaved(
    built: dict, cfg: dict, batch: int, make_timer, device, program: str = "eager"
) -> dict[str, list[dict]]:
    """Warm up every arch (a compiled program compiles there), then `repeats` rounds of one generation per
    arch; {arch: [run, ...]}, each run with the decode step's kernel count."""
    gen = torch.Generator().manual_seed(cfg["seed"] + batch)
    ids = torch.randint(0, cfg["bench_shape"]["vocab_size"], (batch, cfg["prompt_len"]), generator=gen).to(device)
    static = bool(cfg.get("static_cache", True))
    backend = cfg.get("compile_backend", "inductor")
    programs = {
        arch: Program(model, program, batch, cache_length(cfg), static, device, backend) for arch, model in built.items()
    }
    for prog in programs.values():
        for _ in range(max(cfg["warmup"], 1 if program == "compiled" else 0)):
            generate_once(prog, ids, cfg["new_tokens"], make_timer())
    runs = {arch: [] for arch in built}
    for _ in range(cfg["repeats"]):
        for arch, prog in programs.items():
            runs[arch].append(generate_once(prog, ids, cfg["new_tokens"], make_timer()))
    for arch, prog in programs.items():
        kernels = prog.kernels_per_step(ids)
        for run in runs[arch]:
            run["decode"]["kernels"] = kernels
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
    row["decode_kernels_per_step"] = runs[-1]["decode"].get("kernels")
    # Per-forward names: prefill is one forward, decode figures are per step (one forward each).
    return row


