"""FLOPs per token of the zoo's architectures, counted on the meta device, and the peak FLOP/s of a device: MFU's
numerator and denominator (the trainer's ThroughputMonitor, the speed simulator, the benches).

- `flops_per_token(model_name, config, seq_len)`: the model's own FLOPs per token, counted once on the meta
  device (no memory, no values: any size is free) by running a real forward and a real backward of
  batch x seq_len token ids under `torch.utils.flop_counter.FlopCounterMode`, with the speed simulator's
  formulas for the ops torch has none for (`EXTRA_FLOPS`: the experts' `_grouped_mm`).
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
- `peak_flops(device, peak_tflops)`: a device's peak dense bf16 FLOP/s (`parallel.devices.DEVICES`).

MFU (torchtitan's definition): `flops_per_token` is the WHOLE model's, however it is split, and

    achieved model FLOP/s per device = global tokens/s x flops_per_token / world_size
    MFU = achieved model FLOP/s per device / peak FLOP/s of one device

so tensor, sequence and expert parallelism (each rank computing a part of every token) and data parallelism
(each rank a part of the tokens) are all covered by dividing by the number of devices.
"""

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import wraps

import torch
from torch.utils.flop_counter import FlopCounterMode

import models
from parallel.devices import DEVICES
from train.activation_checkpointing import SAVED_OPS


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """`aten::_grouped_mm`: each element of `mat_a` meets one column block of `mat_b` of width N, whichever the
    layout ([rows, K] x [G, K, N] as the experts' forward and dA; [K, rows] x [rows, N] with offsets along the
    rows, dB; [G, M, K] x [G, K, N] batched): 2 x numel(a) x N multiply-adds."""
    return 2 * mat_a.numel() * mat_b.shape[-1]


# FLOP formulas torch.utils.flop_counter does not have.
EXTRA_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


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
    `parallel.devices.DEVICES` ("h100-sxm", "h200", ...); "auto" (or None): the preset of this process's
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
