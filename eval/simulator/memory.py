"""Peak memory per rank, predicted by running the trainer's own engine on fake tensors: `python -m eval.plan` reads it.

    layout = TrainLayout(dp=8, micro_batch=2, seq_len=8192, ac="selective")
    predict_training_memory("llama", config, layout)   # {"peak_bytes", "params_bytes", "activations_bytes", ...}

The model is built under PyTorch's `FakeTensorMode` (shapes and devices, no storage: an 8B model costs nothing) on
the fake process group, laid out as the trainer lays it out: `parallel.parallelize`, activation checkpointing
(`train.activation_checkpointing`), FSDP2's `fully_shard` (`parallel.fsdp.apply_fsdp`, bf16 parameters, fp32
reduction) — the real FSDP2, its all-gather and reduce-scatter buffers included. One micro-batch's forward and
backward run under PyTorch's own memory tracker (`torch.distributed._tools.MemTracker`), which counts every tensor
alive at each moment by kind (parameters, gradients, activations, temporaries); the peak of the forward and
backward is the one it saw. Not its FSDP-aware subclass `FSDPMemTracker`: on torch 2.13 it re-registers FSDP2's
hooks module by module and loses the gather of a unit of several modules whose weight a module outside them reads
(ScMoE's router reading its gate's weight: "mixed torch.Tensor and DTensor"), and it counts AdamW's state of
DTensor parameters at about 4x the full model (1.9 GB for 0.11 GB). Where both run they agree on the peak (Llama 3
8B at dp 8, selective AC: 87.63 GiB each); the generic tracker only does not split FSDP's buffers out.
The models take their stand-in paths on fake tensors as on the meta device (models/common/values.py: a routing's
counts taken as the balanced load); collectives of the layout run in comm mode `none` (same shapes, no transfer).

What the tracker is not given: the optimizer, whose state is counted here from the shards, exactly: two fp32
moments per fp32 element of this rank's shard (`TrainingMemory.optimizer_bytes`), alive from the first step on, so
added to the forward / backward peak (gradients are freed between steps: Lightning's `zero_grad(set_to_none=True)`).

Not modelled: the CUDA caching allocator's reserve over what is allocated (fragmentation, blocks held for reuse:
torchtitan and `torch.cuda.max_memory_reserved` report the reserve), NCCL's own buffers and the CUDA context
(~0.5-1 GiB per GPU), and torch.compile's changes to what is saved (the numbers are eager's).

Generation (`predict_inference_memory`): the weights in their dtype, as sharded, and the architecture's static
cache (`make_cache(static=True)`) of `max_len` tokens, at the peak of a prefill of the prompt.
"""

from copy import deepcopy
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import MixedPrecisionPolicy

import models
import parallel
from eval.simulator.training import TrainLayout, overlap_of, shard_params
from parallel import comm
from parallel.fsdp import TOKEN_DIMS, apply_fsdp, fsdp_mesh
from train.activation_checkpointing import apply_activation_checkpointing

GiB = 2**30


@dataclass
class TrainingMemory:
    """Bytes per rank at the peak of a training step (module docstring)."""

    peak_bytes: int  # forward / backward peak + optimizer state
    params_bytes: int  # this rank's parameters as held between steps (fp32 shards)
    grads_bytes: int  # this rank's gradients at the end of the backward (fp32 shards)
    optimizer_bytes: int  # AdamW's two fp32 moments of this rank's shard
    activations_bytes: int  # activations alive at the peak
    gathered_params_bytes: int  # parameters held beyond the fp32 shards at the peak: FSDP's gathered units
    other_bytes: int  # temporaries, inputs, buffers at the peak
    peak_phase: str  # "forward" or "backward"
    saved_activations_bytes: int  # activations alive at the end of the forward (what the backward keeps)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["peak_gib"] = self.peak_bytes / GiB
        return out


class _RootPeakTracker(MemTracker):
    """PyTorch's MemTracker keeping the peak of the whole step and of the root module only.

    At every op the tracker updates the peak of each module it has seen that is running (walking a weak dictionary
    of all of them): most of a replay's time, for per-module peaks nothing here reads. This keeps its rule for the
    one module read (the root: its forward's peak tells the peak's phase) and for the step. Ours because torch has
    no setting for it; `_update_peak_stats` is the tracker's own hook at torch 2.13 (pinned)."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self._root = root

    def _update_peak_stats(self, peak_state) -> None:
        current = self._curr_mem_snap
        stats = self.memory_tracking.get(self._root)
        if stats is not None and stats.mod_fqn in self._mod_tracker.parents and peak_state in stats.snapshots:
            for dev, snap in current.items():
                if stats.local_peak.get(dev, 0) < snap["Total"]:
                    stats.local_peak[dev] = snap["Total"]
                    stats.snapshots[peak_state][-1][dev] = deepcopy(snap)
        for dev, snap in current.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = deepcopy(snap)


def _device_total(snapshot: dict) -> dict:
    """The tracker's snapshot of the one device it saw: {kind name: bytes}."""
    (per_device,) = [v for k, v in snapshot.items() if isinstance(k, torch.device)]
    return {getattr(k, "value", k): v for k, v in per_device.items()}


def predict_training_memory(
    arch: str, config, layout: TrainLayout, param_dtype: torch.dtype = torch.bfloat16
) -> TrainingMemory:
    """Peak bytes per rank of a training step of `arch` at `layout` (module docstring)."""
    mesh = parallel.init_mesh(**layout.degrees, fake=True)
    try:
        # FSDP's flattened meshes made before the fake mode (a mesh's own tensor of ranks must be real); apply_fsdp
        # finds them made.
        fsdp_mesh(mesh)
        fsdp_mesh(mesh, tuple(d for d in TOKEN_DIMS if d != "ep"))
        with FakeTensorMode(), comm.use_mode("none"):
            fsdp = layout.fsdp and layout.fsdp_size > 1
            # Without FSDP the replicated trainer's autocast is replayed as a bf16 model (below), built in bf16:
            # `module.to()` cannot swap fake parameters.
            model = _build(arch, config, torch.float32 if fsdp else param_dtype)
            parallel.parallelize(model, mesh)
            parallel.set_overlap(model, overlap_of(arch, layout))
            apply_activation_checkpointing(model, layout.ac)
            if fsdp:
                policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
                apply_fsdp(model, mesh, model.model, layout.reshard_after_forward, policy)
            model.train()
            shard = shard_params(model, layout) if not fsdp else _local_numel(model)
            ids = torch.zeros(layout.micro_batch, layout.seq_len // layout.sp, dtype=torch.long)
            tracker = _RootPeakTracker(model)
            tracker.track_external(model)
            with tracker:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                saved = _device_total(tracker.get_tracker_snapshot("current"))
                loss.backward()
            peak = _device_total(tracker.get_tracker_snapshot("peak"))
            phase = _peak_phase(tracker, model, peak["Total"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not fsdp:
        # The replicated trainer's bf16 autocast over fp32 parameters, replayed as a bf16 model (grouped_mm's meta
        # kernel takes bf16 only; activations come out in bf16 either way): its parameters and gradients counted
        # at fp32 instead, plus autocast's cached bf16 copy of the weights.
        held = peak.get("Parameter", 0) + peak.get("Gradient", 0)
        peak = {**peak, "Total": peak["Total"] - held + 4 * shard * 2 + 2 * shard}
    return _breakdown(peak, saved, shard, phase)


def _build(arch: str, config, dtype: torch.dtype):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return models.get(arch).model_class(config)
    finally:
        torch.set_default_dtype(default)


def _local_numel(model) -> int:
    """Elements of this rank's parameters (FSDP's DTensors by their local shard)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())


def _peak_phase(tracker, model, total: int) -> str:
    """Whether the peak came in the forward or the backward (the tracker's per-module snapshots of the root)."""
    stats = tracker.memory_tracking.get(model)
    if stats is None:
        return "forward/backward"
    forward = [_device_total(snap).get("Total", 0) for snap in stats.snapshots.get("Peak Forward", [])]
    return "forward" if max(forward, default=0) >= total else "backward"


def _breakdown(peak: dict, saved: dict, shard: int, phase: str) -> TrainingMemory:
    """The tracker's peak (its kinds: Parameter, Gradient, Activation, Temp, ...) and the state counted from the
    shards: parameters, gradients and optimizer moments exact; activations as tracked; the rest of the peak
    (temporaries, inputs, buffers, gradients alive at that moment) as `other_bytes`."""
    optimizer = 8 * shard
    params, activations = peak.get("Parameter", 0), peak.get("Activation", 0)
    gathered = max(0, params - 4 * shard)
    return TrainingMemory(
        peak_bytes=peak["Total"] + optimizer,
        params_bytes=4 * shard,
        grads_bytes=4 * shard,
        optimizer_bytes=optimizer,
        activations_bytes=activations,
        gathered_params_bytes=gathered,
        other_bytes=peak["Total"] - params - activations,
        peak_phase=phase,
        saved_activations_bytes=saved.get("Activation", 0),
    )


def predict_inference_memory(
    arch: str,
    config,
    degrees: dict[str, int],
    batch: int,
    prompt_len: int,
    max_len: int,
    dtype=torch.bfloat16,
) -> dict:
    """Peak bytes per rank of generation: weights (`dtype`, sharded by `degrees`), the static cache of `max_len`
    tokens, and the prefill's temporaries (logits of the last position), from PyTorch's MemTracker on fake tensors."""
    mesh = parallel.init_mesh(**degrees, fake=True)
    try:
        with FakeTensorMode(), comm.use_mode("none"), torch.no_grad():
            model = _build(arch, config, dtype)
            parallel.parallelize(model, mesh)
            model.eval()
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                cache = model.model.make_cache(batch_size=batch, max_cache_len=max_len, static=True)
                ids = torch.zeros(batch, prompt_len, dtype=torch.long)
                model(ids, cache=cache, use_cache=True, logits_to_keep=1)
                after = _device_total(tracker.get_tracker_snapshot("current"))
            peak = _device_total(tracker.get_tracker_snapshot("peak"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "peak_bytes": peak["Total"],
        "weights_bytes": weights,
        "cache_and_state_bytes": after["Total"] - weights,
    }
