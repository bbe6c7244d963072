"""The timed runs of one item on the device: `run_eager` (the eager decode step and prefill at every batch size)
and `run_compiled` (the decode step compiled by eval.bench.steps.compile_steps: inductor with CUDA graphs on a
GPU), each building the model, recording its numbers (or its failure) in the report's row and freeing it.

`time_generation` is the measurement: an eval.bench.timing `Program` (its static cache, its eager or compiled
decode step) timed by eval.bench.timing's `WallTimer` and `decode_steps`, the bench's own timer and decode loop.
"""

import statistics

import torch

from eval.gpu_check.build import Item, build_model, free
from eval.gpu_check.errors import error_record
from eval.gpu_check.report import Report
from eval.gpu_check.settings import Settings


def make_program(model, name: str, batch: int, s: Settings, device: torch.device):
    """The bench's program `name` ("eager" or "compiled") for `model` at `batch`, on a static cache of
    `s.capacity` tokens. Compiled, its decode step is compiled as `s.mode` says: reduce-overhead (CUDA graphs)
    with inductor on CUDA, no mode on a CPU. The program fills its new cache once with an untimed one-token eager
    prefill, so that the cache's buffers exist outside any CUDA graph."""
    from eval.bench.timing import Program

    return Program(model, name, batch, s.capacity, True, device, s.backend)


def time_generation(program, s: Settings, steps: int, device: torch.device) -> dict:
    """Per repeat: the static cache reset, an eager prefill of the prompt, `warmup` steps, then `steps` timed
    decode steps (mean); the median over repeats. A compiled program's first `compile_calls` steps (compile,
    then CUDA graphs' warm-up and recording) are timed one by one before the repeats. The step's token is cloned
    before it goes back in (gpt-fast's loop: a CUDA graph's output buffer is rewritten by its next replay). The
    prompt goes in through the eager prefill in both programs: only the decode step is compiled and compared."""
    from eval.bench.steps import prefill
    from eval.bench.timing import WallTimer, decode_steps

    model, compiled = program.model, program.name == "compiled"
    prompt = torch.randint(0, model.config.vocab_size, (program.batch, s.prompt_len), device=device)
    timer = WallTimer(device)

    def run(token, n):
        return decode_steps(program, token, program.cache, n, mark_steps=compiled, clone=True)

    out = {"step_ms_runs": [], "prefill_ms_runs": []}
    if compiled:  # compile (first call), then CUDA graphs' warm-up and recording
        token = prefill(model, prompt, program.fresh_cache())[0]
        calls = []
        for _ in range(s.compile_calls):
            timer.start()
            token = run(token, 1)
            calls.append(timer.stop())
        out["compile_s"], out["warmup_calls_s"] = calls[0], calls
    for _ in range(s.repeats):
        cache = program.fresh_cache()
        timer.start()
        token = prefill(model, prompt, cache)[0]
        out["prefill_ms_runs"].append(timer.stop() * 1e3)
        token = run(token, s.warmup)
        timer.start()
        token = run(token, steps)
        out["step_ms_runs"].append(timer.stop() * 1e3 / steps)
    out["step_ms"] = statistics.median(out["step_ms_runs"])
    out["prefill_ms"] = statistics.median(out["prefill_ms_runs"])
    return out


def run_eager(item: Item, layers: int, batches, s, device, report: Report) -> None:
    """Build the item, time eager decode (and prefill) at every batch size, free it."""
    from parallel import comm

    model = program = None
    try:
        model, dispatch = build_model(item, layers, device, s.dtype)
        with comm.use_mode("none"):
            for batch in batches:
                row = report.row(item, batch, layers)
                row["dispatch"] = dispatch
                try:
                    program = make_program(model, "eager", batch, s, device)
                    row["eager"] = time_generation(program, s, s.eager_steps, device)
                    program = None  # its cache freed before the next batch size's
                    print(f"[gpu_check] {report.elapsed():6.0f}s eager {item.shape} {item.label} b{batch} L{layers}: "
                          f"{row['eager']['step_ms']:.3f} ms", flush=True)  # fmt: skip
                except Exception as err:  # noqa: BLE001 - reported, the run goes on
                    row["eager"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    report.errors.append(error_record(f"{item.shape} {item.label} batch {batch}: eager", err))
    except Exception as err:  # noqa: BLE001 - reported
        for batch in batches:
            report.row(item, batch, layers)["eager"] = {
                "error": f"build: {type(err).__name__}: {str(err)[:300]}"
            }
        report.errors.append(error_record(f"{item.shape} {item.label}: build (eager)", err))
    finally:
        model = program = None
        free(device)


def run_compiled(item: Item, layers: int, batch: int, s, device, report: Report, eager_too: bool) -> None:
    """Build the item, compile its decode step and time it (and eager too, for a row at a reduced layer
    count): the row's `compiled` (`error` on failure)."""
    from parallel import comm

    row = report.row(item, batch, layers)
    model = program = None
    try:
        model, dispatch = build_model(item, layers, device, s.dtype)
        row["dispatch"] = dispatch
        with comm.use_mode("none"):
            if eager_too:
                program = make_program(model, "eager", batch, s, device)
                row["eager"] = time_generation(program, s, s.eager_steps, device)
                program = None
            torch._dynamo.reset()
            counters = torch._dynamo.utils.counters
            counters.clear()
            program = make_program(model, "compiled", batch, s, device)
            result = time_generation(program, s, s.compiled_steps, device)
            result.update(
                graphs=len(program.graphs["decode"].graphs),
                cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)),
                graph_breaks=int(sum(counters["graph_break"].values())),
                backend=s.backend,
                mode=s.mode,
            )
            row["compiled"] = result
            print(f"[gpu_check] {report.elapsed():6.0f}s compiled {item.shape} {item.label} b{batch} L{layers}: "
                  f"{result['step_ms']:.3f} ms (compile {result['compile_s']:.0f} s)", flush=True)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - reported, the run goes on
        row["compiled"] = {"error": f"{type(err).__name__}: {str(err)[:300]}", "status": "failed"}
        report.errors.append(error_record(f"{item.shape} {item.label} batch {batch}: compiled", err))
    finally:
        model = program = None
        free(device)
