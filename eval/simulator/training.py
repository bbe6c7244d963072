"""Training steps in the speed simulator: one micro-batch's forward AND backward of an architecture's own code on the
meta device, the FSDP2 engine's gathers and reduce-scatters where the trainer's FSDP2 issues them, the optimizer.

    layout = TrainLayout(dp=8, tp=1, micro_batch=1, seq_len=8192, ac="selective")
    run = record_training("llama", config, layout)                        # meta device, fake mesh of 8
    run.predict(DeviceModel(get_device("h100-sxm")), link="nvlink-h100")  # {"step_s", "tokens_per_s_per_device", ...}

What is recorded (one rank, rank 0, of the dp x ep x sp x tp mesh; every aten op under `DeviceClock`):

- the layout: `parallel.parallelize` on PyTorch's fake process group, as the trainer; its TP / EP / SP collectives
  issued and waited where forward() and autograd issue and wait them (parallel.comm in simulated mode);
- activation checkpointing: the trainer's own (`train.activation_checkpointing.apply_activation_checkpointing`,
  none / full / selective), so the backward replays what it recomputes;
- the GPU's fused kernels the meta device does not run: flash attention's backward and fla's chunk kernel of the
  linear layers (eval.simulator.kernels), as the sequence-parallel bench charges them;
- FSDP2 (`parallel.fsdp.apply_fsdp`'s units: one per decoder layer, the experts over dp x sp, the root holding the
  embedding, final norm and head), which cannot run on the meta device, is played by hooks on the same modules that
  issue its collectives on the simulated link where FSDP2 issues them: the root's all-gather before the forward
  (kept to the end of the backward), each layer's all-gather (parameters in `param_dtype`) waited at its
  pre-forward with the next layer's issued then (FSDP2's implicit forward prefetch: the CPU runs ahead of the
  GPU); with `reshard_after_forward` the all-gather again at each layer's pre-backward, the one before it
  prefetched (FSDP2's default backward prefetch); each layer's reduce-scatter of fp32 gradients issued when its
  backward ends (when the next one's begins), all waited at the end of the backward (FSDP2's root waits them
  before the optimizer). All collectives of a rank share one FIFO link per preset (parallel.link.VirtualClock):
  the gathers and reduce-scatters queue behind each other and behind the layout's collectives;
- without FSDP (`fsdp=False`: parallel/grad_sync.py's trainer) fp32 all-reduces after the backward, exposed: the
  replicated parameters' gradients over dp x ep x sp, the experts' over dp x sp.

A step: `grad_accum` micro-batches (the trainer reduce-scatters each), then the optimizer over this rank's shard:
AdamW plus the gradient norm's clipping, memory-bound: `OPTIMIZER_BYTES_PER_PARAM` of HBM traffic per fp32
element of the shard, plus the norm's all-reduce of one number over every rank. Overlapped communication is charged
the device model's contention, as in the generation replay.

MFU (`mfu`) is the model FLOPs utilisation as PaLM and torchtitan define it: the forward + backward FLOPs of the
tokens (train.flops.flops_per_token: the trainer's own count, without the recomputation) per second, over the
peak of the devices; `hfu` counts the recorded FLOPs (recomputation included).
"""

import math
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import models
import parallel
from eval.simulator.device import DeviceClock, DeviceModel
from eval.simulator.kernels import fla_intra, flash_attention
from eval.simulator.replay import bandwidth_fraction, link_time_split
from parallel import comm
from parallel.fsdp import is_expert, unit_modules
from parallel.layout import shard_specs
from parallel.link import ClockRecorder, collective_time, get_links
from train.activation_checkpointing import MODES as AC_MODES
from train.activation_checkpointing import apply_activation_checkpointing
from train.flops import flops_per_token

# HBM traffic of one optimizer step per fp32 element of the shard (assumed: fused AdamW, torchtitan's default):
# master weight, both moments read and written (24 B), the gradient read (4 B); the gradient norm reads the
# gradient again and the clipping scales it in place (4 + 8 B).
OPTIMIZER_BYTES_PER_PARAM = 40
OPTIMIZER_KERNELS = (
    3  # the norm, the clip, the fused step (multi-tensor kernels: overhead, not bytes, per launch)
)
FSDP_DIM, EXPERT_DIM = "fsdp", "fsdp_experts"  # the link names the FSDP collectives are issued on
RECORDING_LINK = "nvlink-h100"  # what the recording clock times collectives on (any link with a positive time)


@dataclass(frozen=True)
class TrainLayout:
    """One rank's training layout: mesh degrees, engine settings and the micro-batch."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    sp: int = 1
    fsdp: bool = True
    reshard_after_forward: bool = True
    ac: str = "none"
    micro_batch: int = 1  # sequences per rank per micro-batch
    seq_len: int = 2048  # tokens per sequence (each sp rank holds seq_len / sp of them)
    grad_accum: int = 1
    overlap: str = "none"  # the system-level overlap schedule (parallel/overlap.py)

    def __post_init__(self):
        for name in ("dp", "tp", "ep", "sp", "micro_batch", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainLayout.{name}={value!r} must be an integer >= 1.")
        if self.ac not in AC_MODES:
            raise ValueError(f"TrainLayout.ac={self.ac!r} is not one of {AC_MODES}.")
        if self.seq_len % self.sp:
            raise ValueError(
                f"seq_len={self.seq_len} does not split over sp={self.sp}; use a multiple of {self.sp}."
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "ep": self.ep, "sp": self.sp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.sp * self.tp

    @property
    def fsdp_size(self) -> int:
        """Ranks the replicated parameters are sharded over (1: not sharded)."""
        return self.dp * self.ep * self.sp if self.fsdp else 1

    @property
    def expert_fsdp_size(self) -> int:
        return self.dp * self.sp if self.fsdp else 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks (tp ranks share theirs, sp ranks split theirs)."""
        return self.dp * self.ep * self.micro_batch * self.seq_len * self.grad_accum

    def label(self) -> str:
        parts = [f"{k}{v}" for k, v in self.degrees.items() if v > 1] or ["1 GPU"]
        engine = "fsdp" if self.fsdp and self.fsdp_size > 1 else "replicated"
        overlap = "" if self.overlap == "none" else f" overlap={self.overlap}"
        return f"{' x '.join(parts)} {engine} ac={self.ac} mb={self.micro_batch}x{self.seq_len} ga={self.grad_accum}{overlap}"


@dataclass
class Unit:
    """An FSDP unit: its modules, and its parameters' numel on this TP / EP rank (replicated part, experts)."""

    modules: list
    replicated: int
    experts: int


def fsdp_units(model: nn.Module) -> tuple[Unit, list[Unit]]:
    """(root, layers): the units `parallel.fsdp.apply_fsdp` makes, with this rank's parameter counts (before FSDP)."""
    specs = shard_specs(model)
    decoder = model.model
    experts = {p for name, p in model.named_parameters() if is_expert(specs.get(name, ()))}
    whole = getattr(decoder, "runs_layers_whole", True)
    layers, seen = [], set()
    for layer in decoder.layers:
        params = list(layer.parameters())
        seen.update(map(id, params))
        modules = [layer] if whole else unit_modules(layer, experts)
        layers.append(Unit(modules, sum(p.numel() for p in params if p not in experts),
                           sum(p.numel() for p in params if p in experts)))  # fmt: skip
    rest = [p for p in model.parameters() if id(p) not in seen]
    root = Unit(
        [model],
        sum(p.numel() for p in rest if p not in experts),
        sum(p.numel() for p in rest if p in experts),
    )
    return root, layers


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `hook` first: a unit's pre-backward (its output's gradient has arrived)."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


def _mark_output(out, hook):
    if isinstance(out, torch.Tensor):
        return _Mark.apply(hook, out) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        for i, x in enumerate(out):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                return type(out)((*out[:i], _Mark.apply(hook, x), *out[i + 1 :]))
    return out


@dataclass
class FSDPSchedule:
    """FSDP2's collectives issued on the simulated link at the points FSDP2 issues them (module docstring)."""

    layout: TrainLayout
    root: Unit
    layers: list[Unit]
    param_bytes: int = 2  # the all-gathered dtype (MixedPrecisionPolicy.param_dtype)
    reduce_bytes: int = 4  # the reduce-scatter's (reduce_dtype fp32)
    _gathered: dict = field(default_factory=dict)
    _pending: list = field(default_factory=list)
    backward: bool = False

    def install(self) -> list:
        hooks = []
        for i, unit in enumerate(self.layers):
            for m in unit.modules:
                hooks.append(m.register_forward_pre_hook(lambda *_, i=i: self.pre_forward(i)))
                hooks.append(
                    m.register_forward_hook(
                        lambda _m, _a, out, i=i: _mark_output(out, lambda: self.pre_backward(i))
                    )
                )
        return hooks

    # -- the collectives of one unit -----------------------------------------------------------------------
    def _issue(self, kind: str, unit: Unit, nbytes: int) -> list:
        clock, ready = comm.get_clock(), []
        if unit.replicated and self.layout.fsdp_size > 1:
            ready.append(clock.issue(kind, unit.replicated * nbytes, self.layout.fsdp_size, FSDP_DIM))
        if unit.experts and self.layout.expert_fsdp_size > 1:
            ready.append(clock.issue(kind, unit.experts * nbytes, self.layout.expert_fsdp_size, EXPERT_DIM))
        return ready

    def _gather(self, key) -> None:
        if key not in self._gathered and (key == "root" or 0 <= key < len(self.layers)):
            unit = self.root if key == "root" else self.layers[key]
            self._gathered[key] = self._issue("all_gather", unit, self.param_bytes)

    def _wait(self, key) -> None:
        self._gather(key)
        for ready in self._gathered[key]:
            comm.get_clock().wait(ready)
        self._gathered[key] = []

    def start_forward(self) -> None:
        self.backward, self._gathered = False, {}
        if self.layout.fsdp_size > 1:
            self._gather("root")
            self._gather(0)
            self._wait("root")

    def pre_forward(self, i: int) -> None:
        if self.backward or self.layout.fsdp_size == 1 or self._gathered.get(i) == []:
            return  # a recomputation in the backward, no FSDP, or a unit already gathered (a later sub-block)
        self._wait(i)
        self._gather(i + 1)

    def start_backward(self) -> None:
        self.backward, self._done = True, set()
        if self.layout.reshard_after_forward:
            self._gathered = {
                "root": []
            }  # the root stays gathered; the layers were freed after their forward

    def pre_backward(self, i: int) -> None:
        if not self.backward or i in self._done or self.layout.fsdp_size == 1:
            return
        self._done.add(i)
        if i + 1 < len(self.layers) and i + 1 in self._done:
            self._pending += self._issue("reduce_scatter", self.layers[i + 1], self.reduce_bytes)
        if self.layout.reshard_after_forward:
            self._wait(i)
            self._gather(i - 1)

    def end_backward(self) -> None:
        if self.layout.fsdp_size == 1:
            return
        if self._done:
            self._pending += self._issue("reduce_scatter", self.layers[min(self._done)], self.reduce_bytes)
        self._pending += self._issue("reduce_scatter", self.root, self.reduce_bytes)
        for ready in self._pending:
            comm.get_clock().wait(ready)
        self._pending = []


def overlap_of(arch: str, layout: TrainLayout) -> str:
    """The overlap schedule a replay of `arch` at `layout` runs: the layout's, or the one the name asks for
    (`llama+token_split`)."""
    return layout.overlap if layout.overlap != "none" else models.schedule_of(arch)


def build_training_meta(
    arch: str, config, layout: TrainLayout, dtype=torch.bfloat16, rank: int = 0, device: str = "meta"
) -> nn.Module:
    """`arch` on `device` (meta: shapes only; cpu: the bench's measured step) in `dtype`, laid out for `layout` on a
    fake mesh (rank `rank`'s shards), activation checkpointing applied as the trainer applies it. The mesh stays up
    until `eval.simulator.replay.release()`."""
    mesh = parallel.init_mesh(**layout.degrees, fake=True, rank=rank)
    with torch.device(device):
        model = models.get(arch).model_class(config)
    parallel.parallelize(model, mesh)
    parallel.set_overlap(model, overlap_of(arch, layout))
    model.to(dtype)
    model.train()
    apply_activation_checkpointing(model, layout.ac)
    return model


@dataclass
class TrainingRecording:
    layout: TrainLayout
    clock: DeviceClock
    recorder: ClockRecorder
    counts: dict
    shard_params: int  # fp32 elements the optimizer updates on this rank
    all_params: int  # the whole model's (every rank's parameters once)
    model_flops_per_token: float | None  # forward + backward, no recomputation (train.flops); None: not counted
    world_size: int

    def predict(self, device: DeviceModel, link) -> dict:
        """Step time, tokens/s per device, MFU and exposed communication on `device` and `link` (one preset for
        every collective, or {dimension: preset} with `fsdp` / `fsdp_experts` for FSDP's own). Overlapped
        communication is charged the device model's contention, as the generation replay charges it
        (eval.simulator.replay.Phase.replay: NCCL's kernels share the SMs and HBM with the compute they overlap)."""
        return predict_step(self.parts(device, link), self.layout, device, link, self.world_size)

    def parts(self, device: DeviceModel, link) -> dict:
        """What `predict` is computed from, each a sum over the micro-batch's ops and collectives (so that the
        parts of stacks of other depths combine linearly, eval.simulator.stack): the replay's marks, the link time
        and its latency part, the compute, the recorded FLOPs, the optimizer's shard and the model's FLOPs."""
        times = self.clock.times(device)
        marks = self.recorder.replay(link, times)
        forward, micro = marks[0], marks[-1]
        link_total, link_latency = link_time_split(self.recorder.calls, link)
        return {
            "forward": forward["time"], "micro": micro["time"], "busy": micro["busy"], "exposed": micro["exposed"],
            "exposed_by": dict(micro["exposed_by"]), "link_total": link_total, "link_latency": link_latency,
            "compute": times[-1], "recorded_flops": sum(self.clock.flops), "shard_params": self.shard_params,
            "model_flops_per_token": math.nan if self.model_flops_per_token is None else self.model_flops_per_token,
        }  # fmt: skip


def predict_step(parts: dict, layout: TrainLayout, device: DeviceModel, link, world_size: int) -> dict:
    """`TrainingRecording.predict` from its `parts` (module docstring)."""
    overlapped = max(0.0, parts["busy"] - parts["exposed"])
    share = bandwidth_fraction(parts["link_total"], parts["link_latency"])
    contention = device.contention_at(share) * overlapped
    micro_s = parts["micro"] + contention
    optimizer = optimizer_time(parts["shard_params"], device, link, world_size)
    step = layout.grad_accum * micro_s + optimizer
    tokens = layout.tokens_per_step
    peak = device.device.peak_flops
    return {
        "step_s": step,
        "micro_batch_s": micro_s,
        "forward_s": parts["forward"],
        "backward_s": parts["micro"] - parts["forward"],
        "contention_s": contention * layout.grad_accum,
        "overlapped_s": overlapped * layout.grad_accum,
        "optimizer_s": optimizer,
        "compute_s": parts["compute"],
        "exposed_s": parts["exposed"] * layout.grad_accum,
        "exposed_by": {k: v * layout.grad_accum for k, v in parts["exposed_by"].items()},
        "busy_s": parts["busy"] * layout.grad_accum,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / world_size,
        "mfu": parts["model_flops_per_token"] * tokens / step / (world_size * peak),
        "hfu": parts["recorded_flops"] * layout.grad_accum / step / peak,
    }


def optimizer_time(shard_params: float, device: DeviceModel, link, world_size: int) -> float:
    """AdamW and the gradient norm's clipping over this rank's shard (memory-bound), plus the norm's all-reduce."""
    nbytes = OPTIMIZER_BYTES_PER_PARAM * shard_params
    t = device.op_time(0, nbytes, True) + (OPTIMIZER_KERNELS - 1) * device.kernel_overhead_s
    links = get_links(link)
    preset = links if not isinstance(links, dict) else links.get(FSDP_DIM, next(iter(links.values())))
    return t + collective_time("all_reduce", 4, world_size, preset)  # the norm over every rank


def shard_params(model: nn.Module, layout: TrainLayout) -> int:
    specs = shard_specs(model)
    total = 0
    for name, p in model.named_parameters():
        over = layout.expert_fsdp_size if is_expert(specs.get(name, ())) else layout.fsdp_size
        total += math.ceil(p.numel() / over) if over > 1 else p.numel()
    return total


def run_step(model: nn.Module, layout: TrainLayout, vclock, schedule: "FSDPSchedule", ids: torch.Tensor) -> None:
    """One micro-batch's forward and backward on the simulated link's clock `vclock`, FSDP2's collectives by
    `schedule`, the replicated trainer's gradient all-reduces after the backward; two marks (`elapsed`): the end
    of the forward and of the backward."""
    vclock.start()
    schedule.start_forward()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    vclock.elapsed()  # mark: end of the forward
    schedule.start_backward()
    loss.backward()
    if not layout.fsdp:  # parallel.grad_sync: all-reduces after the backward, exposed
        root, layers = schedule.root, schedule.layers
        for numel, ranks, dim in ((root.replicated + sum(u.replicated for u in layers), layout.dp * layout.ep * layout.sp, FSDP_DIM),
                                  (root.experts + sum(u.experts for u in layers), layout.dp * layout.sp, EXPERT_DIM)):  # fmt: skip
            if numel and ranks > 1:  # experts: over dp x sp only (the all-to-all summed them over ep)
                vclock.wait(vclock.issue("all_reduce", 4 * numel, ranks, dim))
    schedule.end_backward()
    vclock.elapsed()  # mark: end of the backward


def record_training(
    arch: str, config, layout: TrainLayout, kernels: str = "gpu", fuse_pointwise: bool = True, rank: int = 0,
    model_flops: bool = True,
) -> TrainingRecording:
    """One micro-batch's forward and backward of `arch` at `layout`, recorded for replay (module docstring).
    `kernels="gpu"` charges flash attention's backward and fla's chunk kernel as the GPU runs them; "as_run" every
    aten op as the meta device runs it. `fuse_pointwise`: elementwise ops fused into their neighbours (a compiled
    step, `trainer.compile=true`); False charges each as a kernel of its own (eager). `rank`: the rank played
    (a step is set by its slowest rank: sequence parallelism's last chunk). `model_flops=False` skips MFU's
    numerator (train.flops counts it on the whole unsharded model at the full length: slow for the linear
    models' CPU chunked kernel at millions of tokens); `mfu` is then NaN."""
    if kernels not in ("gpu", "as_run"):
        raise ValueError(f"kernels={kernels!r} must be 'gpu' or 'as_run'.")
    flops = flops_per_token(arch, config, layout.seq_len).train if model_flops else None
    model = build_training_meta(arch, config, layout, rank=rank)
    try:
        shard = shard_params(model, layout)
        root, layers = fsdp_units(model)
        schedule = FSDPSchedule(layout, root, layers)
        hooks = schedule.install() if layout.fsdp else []
        ids = torch.zeros(layout.micro_batch, layout.seq_len // layout.sp, dtype=torch.long, device="meta")
        clock = DeviceClock(fuse_pointwise=fuse_pointwise)
        world = dist.get_world_size()
        with clock, ExitStack() as stack:
            if kernels == "gpu":
                stack.enter_context(flash_attention(clock))
                for module in model.modules():
                    if callable(getattr(module, "intra_chunk", None)):  # a linear-attention mixer's chunk kernel
                        module.intra_chunk = fla_intra(clock, module.intra_chunk)
            # Recorded on a link where every collective takes time (the replay decides the real link): the
            # recorder keys the collective a wait refers to by its ready time, which must be distinct; on a free
            # link two collectives issued back to back would be ready at the same time.
            vclock = stack.enter_context(
                comm.use_mode("simulated", link=RECORDING_LINK, world_size=world, now=clock.mark)
            )
            recorder = ClockRecorder(vclock)
            comm.reset_counters()
            run_step(model, layout, vclock, schedule, ids)
        for h in hooks:
            h.remove()
        all_params = _whole_model_params(model, layout)
        return TrainingRecording(layout, clock, recorder, comm.snapshot_counters(), shard, all_params, flops, world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _whole_model_params(model: nn.Module, layout: TrainLayout) -> int:
    """Every rank's parameters once: a TP-sharded tensor times tp, an expert times ep (parallel.layout's specs)."""
    specs = shard_specs(model)
    total = 0
    for name, p in model.named_parameters():
        total += p.numel() * math.prod(layout.degrees.get(s.mesh_dim, 1) for s in specs.get(name, ()))
    return total

