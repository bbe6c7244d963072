"""The training section of the bench (`python -m eval.bench bench_preset=train`): one optimizer step per architecture,
layout and activation-checkpointing mode, predicted by the speed simulator and measured on this machine, side by side.

Both run the same code path (eval.simulator.training.run_step): one rank of the layout's mesh on PyTorch's fake
process group, its TP / EP / SP collectives and FSDP2's gathers and reduce-scatters on the simulated link.

- predicted: the step replayed on the meta device under the device model (`training.device`, or the bench's
  `compute` when it is a preset): step time, tokens/s per device, MFU, exposed communication;
- measured (`compute=measured`, the default): the same step run for real at the bench shape on this machine's CPU
  (real tensors, wall-clock compute between the collectives, the link simulated as in the generation rows), the
  median of `repeats` after `warmup`; the optimizer step (AdamW over this rank's shard plus the gradient norm's
  clipping) timed on a flat tensor of the shard's size. MFU needs the device's peak: reported as achieved TFLOP/s.

What compares across the two columns: ratios inside each (an architecture over the baseline at the same layout, an
AC mode over none), not the absolute times (a CPU is not the preset's GPU).
"""

import statistics
import time

import torch
import torch.distributed as dist

import models
from eval.bench.settings import TrainingSettings
from eval.simulator.heldout import device_model
from eval.simulator.training import (
    RECORDING_LINK,
    FSDPSchedule,
    TrainLayout,
    build_training_meta,
    fsdp_units,
    record_training,
    run_step,
    shard_params,
)
from parallel import comm
from parallel.link import ClockRecorder, collective_time, get_link
from train.activation_checkpointing import MODES as AC_MODES
from train.flops import flops_per_token

COLUMNS = [("arch", "arch"), ("layout", "layout"), ("ac", "AC"), ("compute", "compute"), ("step_ms", "step ms"),
           ("tokens_per_s_per_device", "tokens/s/device"), ("mfu", "MFU"), ("achieved_tflops", "TFLOP/s"),
           ("exposed_ms", "exposed comm ms"), ("speedup_vs_baseline", "vs baseline"), ("vs_no_ac", "vs AC none")]  # fmt: skip


def _layouts(t: TrainingSettings) -> list[TrainLayout]:
    out = []
    for degrees in t.layouts:
        unknown = sorted(set(degrees) - {"dp", "tp", "ep", "sp"})
        if unknown:
            raise ValueError(f"training.layouts entry {dict(degrees)} names {unknown}; use dp, tp, ep, sp.")
        for ac in t.ac:
            out.append(TrainLayout(**{d: int(degrees.get(d, 1)) for d in ("dp", "tp", "ep", "sp")}, fsdp=t.fsdp,
                                   ac=ac, micro_batch=t.micro_batch, seq_len=t.seq_len, grad_accum=t.grad_accum))  # fmt: skip
    return out


def check_training(t: TrainingSettings) -> None:
    bad = [a for a in t.ac if a not in AC_MODES]
    if bad or not t.ac:
        raise ValueError(f"training.ac {list(t.ac)} must name some of {list(AC_MODES)}.")
    if not t.layouts:
        raise ValueError("training.layouts is empty; give at least one, e.g. [{dp: 2}].")
    _layouts(t)  # TrainLayout's own errors (a degree < 1, seq_len not split by sp)
    get_link(t.link)
    for key, value in (("warmup", t.warmup), ("repeats", t.repeats)):
        if not isinstance(value, int) or value < (0 if key == "warmup" else 1):
            raise ValueError(f"training.{key}={value!r} must be an integer >= {0 if key == 'warmup' else 1}.")


def training_rows(t: TrainingSettings) -> tuple[list[dict], list[str]]:
    """(rows, skipped notes): every architecture at every layout and AC mode, predicted and (compute=measured)
    measured."""
    predicted = t.compute.predicted
    preset = t.compute.setting if predicted else t.device_preset
    device = device_model(preset)
    link = get_link(t.link)
    rows, skipped = [], []
    for arch in t.archs:
        for layout in _layouts(t):
            degrees = {k: v for k, v in layout.degrees.items() if k != "dp"}
            config = t.model.config(arch, degrees)
            try:
                models.get(arch).check_layout(config, degrees)
            except ValueError as err:
                skipped.append(f"training {arch} at {layout.label()}: {err}")
                continue
            base = {"arch": arch, "layout": layout.label(), "ac": layout.ac}
            pred = record_training(arch, config, layout).predict(device, link)
            rows.append({**base, "compute": preset, "step_ms": 1e3 * pred["step_s"], "mfu": pred["mfu"],
                         "tokens_per_s_per_device": pred["tokens_per_s_per_device"],
                         "exposed_ms": 1e3 * pred["exposed_s"]})  # fmt: skip
            if not predicted:
                rows.append({**base, **measure_training(arch, config, layout, link, t.warmup, t.repeats)})
            print(f"[bench] training {arch} {layout.label()} done", flush=True)
    add_training_comparisons(rows, t.baseline)
    return rows, skipped


def measure_training(arch: str, config, layout: TrainLayout, link, warmup: int, repeats: int) -> dict:
    """One step of rank 0 timed for real on this machine (module docstring)."""
    torch.manual_seed(0)
    model = build_training_meta(arch, config, layout, dtype=torch.float32, device="cpu")
    try:
        shard = shard_params(model, layout)
        root, layers = fsdp_units(model)
        schedule = FSDPSchedule(layout, root, layers)
        hooks = schedule.install() if layout.fsdp else []
        ids = torch.randint(0, config.vocab_size, (layout.micro_batch, layout.seq_len // layout.sp))
        world, micro = dist.get_world_size(), []
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            with comm.use_mode("simulated", link=RECORDING_LINK, world_size=world) as vclock:
                recorder = ClockRecorder(vclock)
                run_step(model, layout, vclock, schedule, ids)
            if i >= warmup:
                micro.append(recorder.replay(link)[-1])
        for h in hooks:
            h.remove()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    middle = sorted(micro, key=lambda m: m["time"])[len(micro) // 2]
    optimizer = _optimizer_time(shard, warmup, repeats) + collective_time("all_reduce", 4, world, link)
    step = layout.grad_accum * middle["time"] + optimizer
    tokens = layout.tokens_per_step
    flops = flops_per_token(arch, config, layout.seq_len).train * tokens / world
    return {"compute": "measured (this CPU)", "step_ms": 1e3 * step, "tokens_per_s_per_device": tokens / step / world,
            "mfu": None, "achieved_tflops": flops / step / 1e12, "exposed_ms": 1e3 * middle["exposed"] * layout.grad_accum}  # fmt: skip


def _optimizer_time(numel: int, warmup: int, repeats: int) -> float:
    """AdamW's step and the gradient clipping over a flat fp32 shard of `numel` elements, median seconds."""
    param = torch.zeros(numel, requires_grad=True)
    param.grad = torch.ones(numel)
    opt = torch.optim.AdamW([param], lr=1e-4)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([param], 1.0)
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def add_training_comparisons(rows: list[dict], baseline: str) -> None:
    """Per row: its tokens/s over the baseline architecture's (same layout, AC, compute) and over AC none's."""
    key = {(r["arch"], r["layout"], r["ac"], r["compute"]): r for r in rows}
    for r in rows:
        base = key.get((baseline, r["layout"], r["ac"], r["compute"]))
        r["speedup_vs_baseline"] = None if base is None else r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        none_label = r["layout"].replace(f"ac={r['ac']}", "ac=none")
        plain = key.get((r["arch"], none_label, "none", r["compute"]))
        r["vs_no_ac"] = None if plain is None else r["tokens_per_s_per_device"] / plain["tokens_per_s_per_device"]


def training_section(results: dict) -> list[str]:
    from eval import report

    rows = results.get("training") or []
    if not rows:
        return []
    t = results["settings"]["training"]
    return [
        "## Training steps",
        "",
        f"One optimizer step per architecture, layout and AC mode: micro-batch {t['micro_batch']} x {t['seq_len']} "
        f"tokens, {t['grad_accum']} micro-batch(es), {'FSDP2' if t['fsdp'] else 'the replicated trainer'}, link "
        f"`{t['link']}`. Predicted rows: the speed simulator's training replay (eval/simulator/training.py); "
        "measured rows: the same step run on this machine (rank 0 of the mesh, link simulated). Compare ratios inside "
        "a compute column, not times across them.",
        "",
        report.write_markdown_table(rows, COLUMNS),
        "",
    ]
