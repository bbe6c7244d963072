"""Throughput, MFU and peak memory of a training run: the architecture's FLOPs per token and a logging callback.

- `flops_per_token(model_name, config, seq_len)`: the model's own FLOPs per token, counted once on the meta
  device (no memory, no values: any size is free) by running a real forward and a real backward of
  batch x seq_len token ids under `torch.utils.flop_counter.FlopCounterMode`, with the speed simulator's
  formulas for the ops torch has none for (`eval.simulator.device.EXTRA_FLOPS`: the experts' `_grouped_mm`).
  The backward is measured, not assumed to be 2x the forward. What is counted is what the counter counts:
  matmul-like ops (matmuls, attention, grouped matmuls); elementwise ops, norms and softmaxes are free, as in
  every MFU convention. On the meta device `F.scaled_dot_product_attention` runs its math decomposition (two
  bmm over the full T x T square, causal mask or not), so attention counts 12 x layers x heads x head_dim x T
  per token for forward + backward: PaLM's (and torchtitan's) convention. Linear attention counts the
  zoo's own PyTorch formulation (what the CPU path and every reference run; fla's GPU kernels are not seen).
  MoE: only the experts a token is routed to compute. The meta device has no values to route by, so the
  models route as the speed simulator does (`models.common.moe.dispatch`, MoE++'s `expected_assignments`):
  the k x T assignments spread evenly over the experts (the load the balance loss aims for); a dropless
  layer then computes exactly k x T expert rows whatever the routing, so the count is exact for it, and for
  MoE++ it is the balanced share of FFN experts (zero-computation experts cost no matmul).
- `train_flops_per_token(..., recompute="none"|"full"|"selective")`: forward + backward, plus what activation
  checkpointing recomputes ("full": one more forward; "selective": the forward FLOPs of the ops it does not
  save). Model FLOPs (MFU's numerator, PaLM) exclude recomputation; with recompute the ratio is the hardware
  FLOPs utilization.
- `peak_flops(device, peak_tflops)`: a device's peak dense bf16 FLOP/s (`eval.simulator.device.DEVICES`).
- `ThroughputMonitor`: a Lightning callback logging per training step `train/tokens_per_s_per_device`,
  `train/mfu` and `train/peak_memory_gb`.

MFU (torchtitan's definition): `flops_per_token` is the WHOLE model's, however it is split, and

    achieved model FLOP/s per device = global tokens/s x flops_per_token / world_size
    MFU = achieved model FLOP/s per device / peak FLOP/s of one device

so tensor, sequence and expert parallelism (each rank computing a part of every token) and data parallelism
(each rank a part of the tokens) are all covered by dividing by the number of devices.
"""

import copy
import logging
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import wraps

import lightning as L
import torch
from torch.utils.flop_counter import FlopCounterMode

import models
from eval.simulator.device import DEVICES, EXTRA_FLOPS
from train.activation_checkpointing import SAVED_OPS

log = logging.getLogger(__name__)

RECOMPUTE = ("none", "full", "selective")
# The ops whose outputs selective activation checkpointing saves (its own policy's list, as packets: the FLOP
# counter keys by them); it recomputes everything else. The counter counts matmul-like ops only, so what
# selective adds is ~0 (exactly 0 for every zoo architecture: every op with a FLOP count is saved).
SELECTIVE_SAVES = {op.overloadpacket for op in SAVED_OPS}


def _raw(formula):
    """A formula of `EXTRA_FLOPS` (called with the tensors themselves, as `DeviceClock` calls it) as
    `FlopCounterMode(custom_mapping=...)` takes one: marked to get the tensors, not their shapes."""

    @wraps(formula)
    def counted(*args, **kwargs):
        return formula(*args, **kwargs)

    counted._get_raw = True
    return counted


@dataclass(frozen=True)
class FlopsPerToken:
    """One token's FLOPs in a training step of the whole model (module docstring)."""

    forward: float
    backward: float
    forward_unsaved: float  # forward FLOPs of ops outside SELECTIVE_SAVES: what selective AC recomputes

    @property
    def train(self) -> float:
        return self.forward + self.backward

    def with_recompute(self, recompute: str = "none") -> float:
        """Forward + backward + what activation checkpointing `recompute` computes again."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}.")
        extra = {"none": 0.0, "full": self.forward, "selective": self.forward_unsaved}[recompute]
        return self.train + extra


def flops_per_token(model_name: str, config, seq_len: int, batch: int = 1) -> FlopsPerToken:
    """`model_name`'s FLOPs per token at `seq_len`, counted on the meta device (module docstring). `config`: the
    architecture's config object (e.g. a built model's `.config`) or its fields as a dict."""
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len={seq_len} and batch={batch} must both be >= 1.")
    entry = models.get(model_name)
    if isinstance(config, Mapping):
        config = models.build_config(model_name, **config)
    else:
        config = copy.deepcopy(config)  # building a model may set fields on its config
    with torch.device("meta"):
        model = entry.model_class(config)
    # bf16, as the speed simulator runs: the meta kernel of grouped_mm takes no fp32 (the FLOPs are the same).
    model.to(torch.bfloat16).train()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False, custom_mapping={op: _raw(f) for op, f in EXTRA_FLOPS.items()})
    with counter:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        forward_ops = dict(counter.get_flop_counts()["Global"])
        loss.backward()
        total = counter.get_total_flops()
    forward = sum(forward_ops.values())
    unsaved = sum(n for op, n in forward_ops.items() if op not in SELECTIVE_SAVES)
    tokens = batch * seq_len
    return FlopsPerToken(forward / tokens, (total - forward) / tokens, unsaved / tokens)


def train_flops_per_token(model_name: str, config, seq_len: int, recompute: str = "none") -> float:
    """Forward + backward FLOPs per token, plus activation checkpointing's recomputation (`recompute`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}.")
    return flops_per_token(model_name, config, seq_len).with_recompute(recompute)


# CUDA device names (torch.cuda.get_device_name) -> preset, checked in order.
_CUDA_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A800", "a800"), ("A100", "a100-sxm"), ("A30", "a30"))


def peak_flops(device: str | None = "auto", peak_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one device: `peak_tflops` x 1e12 when given; else the preset `device` of
    `eval.simulator.device.DEVICES` ("h100-sxm", "h200", ...); "auto" (or None): the preset of this process's
    CUDA device, by its name. None when unknown (on CPU): MFU is then not logged."""
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops={peak_tflops!r} must be > 0 (or null to look the device up).")
        return float(peak_tflops) * 1e12
    if device not in (None, "auto"):
        if device not in DEVICES:
            raise ValueError(
                f"Unknown device preset {device!r}; choose one of {sorted(DEVICES)}, or set peak_tflops."
            )
        return DEVICES[device].peak_flops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((DEVICES[preset].peak_flops for key, preset in _CUDA_NAMES if key in name), None)


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
        self.peak_flops_per_s = peak_flops_per_s if peak_flops_per_s is not None else peak_flops("auto", peak_tflops)
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
