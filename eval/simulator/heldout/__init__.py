"""Held-out validation of the speed simulator: each paper's headline speed-up predicted at the paper's own setting.

Nothing here is fitted. The device model's constants are the ones eval.costmodel fitted to the Ladder paper's 70B
record (conf/bench.yaml `device_model`, reports/costmodel), the device and link presets come from spec sheets
(eval.simulator.device.DEVICES, parallel.link.LINK_PRESETS), and each paper's row is computed the way the paper
computes its headline (its model shapes, hardware, baselines, batch and sequence lengths, what is timed) by running
the architectures' own `forward()` on the meta device (eval.simulator.replay, eval.bench). A row that misses its
target names the effect the model lacks, with a sensitivity run as evidence; no constant is tuned to a row.

One module per paper, each with

    PAPER: str                         # the key: "kraken", "scmoe", "moepp", "lasp2"
    def validate(quick: bool = False) -> dict   # the row (below); quick: tiny shapes, only the plumbing (tests)

and the row it returns:

    {
      "paper": "Kraken (Prabhakar, Zhang, Wentzlaff, NeurIPS 2024)",
      "source": "where every published number comes from (arXiv id and version, table / figure / section)",
      "headline": "the claim as the paper states it",
      "setting": "model shapes, hardware presets, baselines, batch and sequence lengths, what is timed",
      "published": 1.356,              # the headline as a speed-up ratio (> 1: faster)
      "predicted": 1.29,               # computed the same way from the simulator's cells
      "cells": [{"label": ..., "published": float | None, "predicted": float, "what": ...}, ...],
      "sensitivity": [{"effect": ..., "value": ..., "predicted": float}, ...],   # evidence for a miss
      "lacks": "" or "the effect the model lacks, with the sensitivity run that shows it",
      "notes": ["...", ...],
    }

Training rows (LASP-2; ScMoE's training speed-ups) replay whole training steps with eval.simulator.training
(`record_training_at`, `train_step` below: the rank a row plays, and the contention the inference rows charge).

`eval.validation` (python -m eval.validation) adds `ratio` = predicted / published and `within` (|ratio - 1| <=
TARGET) and writes reports/simulator-validation/.
"""

import importlib
import math
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from eval.simulator.device import DeviceModel

TARGET = 0.15  # each headline speed-up within 15% of the published ratio (issue 19)
# The keys of a row (above); eval.validation fills the last three with empty values when a row leaves them out.
ROW_KEYS = ("paper", "source", "headline", "setting", "published", "predicted", "cells", "sensitivity", "lacks", "notes")
OPTIONAL_KEYS = ("sensitivity", "lacks", "notes")
PAPERS = ("kraken", "scmoe", "moepp", "lasp2", "torchtitan")
_BENCH_YAML = Path(__file__).resolve().parents[3] / "conf" / "bench.yaml"


def fitted_constants() -> dict:
    """The device model's constants as committed (conf/bench.yaml `device_model`: eval.costmodel's Ladder fit)."""
    return OmegaConf.to_container(OmegaConf.load(_BENCH_YAML)["device_model"])


def device_model(preset: str, **changes) -> DeviceModel:
    """The committed constants on a device preset; `changes` override some (sensitivity runs only)."""
    return DeviceModel.from_config(preset, **{**fitted_constants(), **changes})


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def module(paper: str):
    if paper not in PAPERS:
        raise ValueError(f"Unknown held-out paper {paper!r}; choose from {list(PAPERS)}.")
    return importlib.import_module(f"eval.simulator.heldout.{paper}")


# -- training steps (eval.simulator.training) ------------------------------------------------------------------
@contextmanager
def _fake_rank(rank: int):
    """`parallel.init_mesh(fake=True)` playing `rank` instead of rank 0 (record_training builds its mesh with it):
    a row's step is set by its slowest rank (LASP-2: the last chunk's rank, which ring attention gives the most
    blocks); eval.bench.sp.fake_sp_mesh starts the fake group the same way."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import parallel

    real = parallel.init_mesh

    def init_mesh(*, fake: bool = False, **degrees):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(degrees.values()))
        return real(**degrees, device_type="cpu")  # over the group just started (init_mesh reuses a running one)

    parallel.init_mesh = init_mesh
    try:
        yield
    finally:
        parallel.init_mesh = real


@contextmanager
def _distinct_ready_times():
    """Record on a link whose collectives each take a tiny time, so that every collective's ready time is distinct.

    Why: record_training records on `replay.NO_COMM` (free collectives), where two collectives issued with no op
    between them (FSDP's replicated and expert gathers, ring attention's last shift and the gradient all-reduce)
    are ready at the same time; parallel.link.ClockRecorder keys the collective a wait refers to by that time, so
    the replay then waits on the wrong collective (a ring-attention step lost its gradient all-reduce). On one FIFO
    link with a positive duration every ready time is later than the last. Only the ready times change: the replay
    reads the recorded op counts, never the recording clock. (To be fixed in training.py / parallel.link.)"""
    from eval.simulator import training
    from parallel.link import LinkPreset

    real = training.NO_COMM
    training.NO_COMM = LinkPreset("no-comm-distinct", 0.0, float("inf"), "free collectives, distinct ready times", 1e-6)
    try:
        yield
    finally:
        training.NO_COMM = real


@contextmanager
def _no_model_flops():
    """record_training without its MFU numerator: eval.throughput.flops_per_token runs the whole unsharded model at
    the full sequence length on the meta device, and a linear layer's CPU chunked kernel there is one kernel per
    64 tokens (hours at LASP-2's 2048K). The rows use step times only; their `mfu` is NaN."""
    import eval.throughput as throughput

    real = throughput.flops_per_token
    nan = float("nan")
    throughput.flops_per_token = lambda *args, **kwargs: throughput.FlopsPerToken(nan, nan, nan)
    try:
        yield
    finally:
        throughput.flops_per_token = real


def record_training_at(arch: str, config, layout, rank: int = 0):
    """eval.simulator.training.record_training as rank `rank` of the layout's mesh (fake process group), with
    the two workarounds above (distinct ready times, no MFU count)."""
    from eval.simulator.training import record_training

    with _fake_rank(rank), _distinct_ready_times(), _no_model_flops():
        return record_training(arch, config, layout)


def train_step(recording, device: DeviceModel, link) -> dict:
    """`recording.predict` plus the contention of its overlapped communication, as the inference rows charge it
    (eval.simulator.replay.Phase.replay: NCCL's kernels share the SMs and HBM with the compute they overlap; the
    committed `contention` / `contention_bw` weighted by the bandwidth-bound share of the link time).
    TrainingRecording.predict leaves it out; with it every row is charged by the same device model."""
    from eval.simulator.replay import bandwidth_share

    out = recording.predict(device, link)
    overlapped = max(0.0, out["busy_s"] - out["exposed_s"])
    contention = device.contention_at(bandwidth_share(recording.recorder.calls, link)) * overlapped
    step = out["step_s"] + contention
    return {**out, "step_s": step, "contention_s": contention, "overlapped_s": overlapped,
            "tokens_per_s": out["tokens_per_s"] * out["step_s"] / step}  # fmt: skip
