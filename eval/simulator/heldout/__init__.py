"""Held-out validation of the speed simulator: each paper's headline speed-up predicted at the paper's own setting.

Nothing here is fitted. The device model's constants are the ones eval.costmodel fitted to the Ladder paper's 70B
record (conf/bench.yaml `device_model`, reports/costmodel), the device and link presets come from spec sheets
(eval.simulator.device.DEVICES, parallel.link.LINK_PRESETS), and each paper's row is computed the way the paper
computes its headline (its model shapes, hardware, baselines, batch and sequence lengths, what is timed) by running
the architectures' own `forward()` on the meta device (eval.simulator.replay, eval.bench). A row that misses its
target names the effect the model lacks, with a sensitivity run as evidence; no constant is tuned to a row.

One module per paper, each with

    PAPER: str                         # the key: "kraken", "scmoe", "moepp", "lasp2", ...
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
      "comparable": True,              # optional; False where the paper's setting could not be read and is assumed
    }

Training rows (LASP-2; ScMoE's training speed-ups; torchtitan's tables) replay whole training steps with
eval.simulator.training (`record_training_at`, `train_step` below: the rank a row plays).

`eval.validation` (python -m eval.validation) adds `ratio` = predicted / published and `within` (|ratio - 1| <=
TARGET) and writes reports/simulator-validation/.
"""

import importlib
import math
from pathlib import Path

from omegaconf import OmegaConf

from eval.simulator.device import DeviceModel

TARGET = 0.15  # each headline speed-up within 15% of the published ratio
# The keys of a row (above); eval.validation fills the optional ones with their defaults when a row leaves them out.
ROW_KEYS = ("paper", "source", "headline", "setting", "published", "predicted", "cells", "sensitivity", "lacks", "notes")
OPTIONAL_KEYS = ("sensitivity", "lacks", "notes")
# Beyond them, a row may say `comparable: False` (its setting assumed); eval.validation sets True where it does not.
PAPERS = ("kraken", "scmoe", "moepp", "lasp2", "torchtitan", "ladder_record", "tokenweave", "iso", "async_tp")
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
def record_training_at(arch: str, config, layout, rank: int = 0):
    """eval.simulator.training.record_training as rank `rank` of the layout's mesh (a row's step is set by its
    slowest rank: LASP-2's last chunk, which ring attention gives the most blocks), without the MFU count (the
    rows use step times; counting it runs the whole model at the full length: hours at LASP-2's 2048K)."""
    from eval.simulator.training import record_training

    return record_training(arch, config, layout, rank=rank, model_flops=False)


def train_step(recording, device: DeviceModel, link) -> dict:
    """A training row's step on `device` and `link`: `recording.predict`, whose contention of overlapped
    communication is the one the inference rows charge (one device model for every row)."""
    return recording.predict(device, link)
