"""Throughput, MFU and peak memory of a training run, logged per step: the Lightning callback and its arithmetic.

- `throughput_metrics(tokens, seconds, devices, flops_per_token, peak_flops_per_s)`: one step's tokens/s per
  device and MFU (the model's FLOPs per token and a device's peak: train.flops, where MFU is defined).
- `peak_memory_gb(device)`: the CUDA allocator's peak, or the process's peak resident set on CPU.
- `ThroughputMonitor`: a Lightning callback logging per training step `train/tokens_per_s_per_device`,
  `train/mfu` and `train/peak_memory_gb`.
"""

import logging
import resource
import sys
import time

import lightning as L
import torch

from train.flops import flops_per_token, peak_flops

log = logging.getLogger(__name__)


def throughput_metrics(
    tokens: int, seconds: float, devices: int, flops_per_token: float, peak_flops_per_s: float | None
) -> dict[str, float]:
    """One step's `tokens_per_s_per_device` (global tokens / seconds / devices) and `mfu` (that x the whole
    model's flops_per_token / one device's peak; left out when the peak is unknown)."""
    per_device = tokens / max(seconds, 1e-9) / devices
    out = {"tokens_per_s_per_device": per_device}
    if peak_flops_per_s:
        out["mfu"] = per_device * flops_per_token / peak_flops_per_s
    return out


def peak_memory_gb(device: torch.device | None = None) -> float:
    """This process's peak memory in GB (1e9 bytes): the CUDA allocator's peak on a CUDA device (since the
    process started or its last reset), else the process's peak resident set size."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


class ThroughputMonitor(L.Callback):
    """Logs per training step (on_step, not on_epoch), each rank its own values (loggers write rank 0's):

    - `train/tokens_per_s_per_device`: the step's global tokens (batch["input_ids"].numel() x the data
      replicas, as `train.module.CausalLMModule` counts them for `train/tokens_per_s`) / wall seconds since
      the previous batch ended (data loading included; validation is not charged) / `devices`;
    - `train/mfu`: that x `flops_per_token` (the whole model's: `flops_per_token(...).train`) /
      `peak_flops_per_s` (one device's), only when the peak is known;
    - `train/peak_memory_gb`: `peak_memory_gb` of this rank.

    `devices`: the world size the step ran on (None: the trainer's `world_size`).

    As the pretraining app builds it (conf/callbacks/default.yaml: `peak_tflops: ${trainer.peak_tflops}`),
    `flops_per_token` is None and is counted in `setup`, before the layout shards the model, from the
    module's own model and settings (`train.module.CausalLMModule`: its architecture, config, and the
    forward its `activation_checkpointing` recomputes) at the data module's `seq_len`; the peak is
    `peak_tflops` when set, else the CUDA device's preset (`peak_flops`).
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        peak_flops_per_s: float | None = None,
        devices: int | None = None,
        peak_tflops: float | None = None,
    ):
        super().__init__()
        if flops_per_token is not None and not flops_per_token > 0:
            raise ValueError(f"flops_per_token={flops_per_token!r} must be > 0.")
        self.flops_per_token = float(flops_per_token) if flops_per_token is not None else None
        self.peak_flops_per_s = (
            peak_flops_per_s if peak_flops_per_s is not None else peak_flops("auto", peak_tflops)
        )
        self.devices = devices
        self._clock: float | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.flops_per_token is not None:
            return
        hparams = pl_module.hparams
        seq_len = trainer.datamodule.seq_len
        counted = flops_per_token(hparams["model_name"], pl_module.model.config, seq_len)
        self.flops_per_token = counted.with_recompute(hparams.get("activation_checkpointing", "none"))

    def on_train_start(self, trainer, pl_module) -> None:
        if self.peak_flops_per_s is None and trainer.is_global_zero:
            log.info(
                "MFU is not logged: no peak FLOP/s is known for this device (set the peak TFLOP/s to log it)."
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._clock is None:
            self._clock = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._clock = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        seconds, self._clock = now - (self._clock if self._clock is not None else now), now
        replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        tokens = batch["input_ids"].numel() * replicas
        devices = self.devices or trainer.world_size
        metrics = throughput_metrics(tokens, seconds, devices, self.flops_per_token, self.peak_flops_per_s)
        metrics["peak_memory_gb"] = peak_memory_gb(pl_module.device)
        for name, value in metrics.items():
            pl_module.log(f"train/{name}", value, on_step=True, on_epoch=False)
