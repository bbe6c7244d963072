"""Speed simulator: an architecture's own `forward()` at any shape, charged to a device model.

    model = build_meta("ladder", config, {"tp": 8})                  # meta device, sharded on a fake mesh
    run = record_generation(model, batch=4, prompt_len=1024, new_tokens=512)
    run.predict(DeviceModel(get_device("h100-sxm")), link="nvlink-h100")   # {"tok_s": ..., "prefill": ...}

The model is built on the meta device (no memory: a 70B model at TP 8 is free) and sharded by
`parallel.parallelize` on PyTorch's fake process group; its real prefill and one real decode step run under
`eval.simulator.device.DeviceClock` (every aten op recorded as FLOPs and bytes) with `parallel.comm` in simulated
mode, the link's virtual clock reading the op count as its `now`, and every call to that clock recorded
(`parallel.link.ClockRecorder`). Nothing about the schedule is written here: where `forward()` issues and
waits each collective is where the clock sees it. `Recording.predict` replays the run under a device model
(op times) and a link (collective times), so one recording serves every preset and every fitted constant,
and the same inputs give the same numbers on any machine.

Generation, as the Ladder paper's reference benchmark (gpt-fast) measures it: a prompt of `prompt_len`
tokens (prefill, logits of the last position), then `new_tokens - 1` decode steps of one token;
tokens/s = batch x new_tokens / (prefill + (new_tokens - 1) x decode step). Caches: the architecture's own
static cache (`make_cache(..., static=True)`, models.common.cache: K/V, per-stream, latent or recurrent-state
buffers of prompt + new tokens, rounded up to 8, that attention reads in full under a mask at every step,
the fill level on the device: the reference's, and the real bench's compiled path's), or with
`static_cache=False` its growing one. The decode step is recorded with the cache filled to the middle of the
generation (prompt_len + new_tokens / 2): for a growing cache, the average step.

Attention is charged as the program the recording names (`attention_program`: flash attention by default; the
reference's repeated K / V, `gqa_expand`; or the math decomposition over it, `math`, the scores in HBM):
eval.simulator.attention.ATTENTION_PROGRAMS. A model built at degree 1 (`build_meta(arch, config, {"tp": 1})`) is
the single-GPU baseline: unsharded, no collective sent, its time its compute (a speed-up over one GPU).
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from transformers.cache_utils import Cache

import models
import parallel
from eval.simulator.attention import attention_program_of
from eval.simulator.device import DeviceClock, DeviceModel
from parallel import comm
from parallel.link import (
    ClockRecorder,
    LinkPreset,
    all_to_all_time,
    collective_time,
    get_links,
    without_bandwidth,
)

# The upper bound: the same run with every collective free.
NO_COMM = LinkPreset("no-comm", 0.0, float("inf"), "upper bound: communication costs nothing")


def make_cache(model, batch: int, max_len: int, static: bool = True) -> Cache:
    """The architecture's own cache (its `make_cache` hook): static (fixed buffers of `max_len` tokens, the fill
    level on the device: the cache the real bench's compiled path uses) or growing."""
    if static:
        return model.model.make_cache(batch_size=batch, max_cache_len=max_len, static=True)
    return model.model.make_cache(batch_size=batch, max_cache_len=max_len)


def build_meta(arch: str, config, degrees: dict[str, int], dtype: torch.dtype = torch.bfloat16):
    """`arch` with `config` on the meta device, sharded for `degrees` on a fake mesh (rank 0's shards).
    The mesh (a fake process group) stays up until `release()`."""
    mesh = parallel.init_mesh(**degrees, fake=True)
    with torch.device("meta"):
        model = models.get(arch).model_class(config)
    parallel.parallelize(model, mesh)
    parallel.set_overlap(model, models.schedule_of(arch))  # `llama+token_split`: llama under that schedule
    model.to(dtype)
    model.eval()
    return model


def release() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Phase:
    """One recorded forward: its aten ops (`clock`) and its calls to the link's virtual clock (`recorder`)."""

    clock: DeviceClock
    recorder: ClockRecorder
    counts: dict  # collectives sent, per kind ({kind: {"calls", "bytes"}}, parallel.comm's counters)

    def replay(self, device: DeviceModel, link, graphed: bool = True) -> dict:
        """{time, exposed, busy, overlapped, ...} in seconds: the schedule on `link` with op times under
        `device`, plus its contention of every overlapped second of communication (NCCL kernels share the
        SMs and HBM bandwidth with the compute they overlap): `contention` and `contention_bw` weighted by the
        share of the phase's link time that is bandwidth-bound (`bandwidth_share`). Not `graphed` (launched
        from the host, not replayed from a CUDA graph): every collective also pays the device's
        `collective_launch_s` (free communication, NO_COMM, stays free)."""
        times = self.clock.times(device)
        if not graphed and device.collective_launch_s and link is not NO_COMM:
            times = host_launched(times, self.recorder.issue_marks, device.collective_launch_s)
        (mark,) = self.recorder.replay(link, times)
        overlapped = max(0.0, mark["busy"] - mark["exposed"])
        share = bandwidth_share(self.recorder.calls, link)
        return {
            "time": mark["time"] + device.contention_at(share) * overlapped,
            "bandwidth_share": share,
            "exposed": mark["exposed"],
            "busy": mark["busy"],
            "overlapped": overlapped,
            "exposed_by": mark["exposed_by"],  # per collective label (kind), as the link's clock keeps them
            "busy_by": mark["busy_by"],
            "compute": times[-1],
            "kernels": sum(self.clock.kernel),
            "flops": sum(self.clock.flops),
            "bytes": sum(self.clock.bytes),
        }


def host_launched(times: list[float], issue_marks: list[float], seconds: float) -> list[float]:
    """Cumulative op times with `seconds` of the compute stream's own time charged at every collective's issue
    (a collective launched from the host outside a CUDA graph: the stream waits while c10d hands it over, so it is
    paid whether the collective then overlaps compute or not): the time after m ops grows by `seconds` for each
    collective issued after m ops or fewer."""
    issued = np.searchsorted(np.sort(np.asarray(issue_marks, dtype=np.float64)), np.arange(len(times)), side="right")
    return (np.asarray(times) + seconds * issued).tolist()


def bandwidth_share(calls, link) -> float:
    """The fraction of the recorded collectives' link time on `link` that is bandwidth-bound (the rest is the
    link's latency: base + hops x alpha, `parallel.link.collective_time` with unlimited bandwidth)."""
    return bandwidth_fraction(*link_time_split(calls, link))


def bandwidth_fraction(total: float, latency: float) -> float:
    """The bandwidth-bound fraction of `total` link time of which `latency` is latency (0 for no link time)."""
    return 0.0 if total <= 0 else (total - latency) / total


def link_time_split(calls, link) -> tuple[float, float]:
    """(link time, its latency part) of the recorded collectives on `link`: sums over the collectives, so that
    recordings of parts of a run add up (eval.simulator.stack)."""
    links = get_links(link)
    total = latency = 0.0
    for name, args, kwargs in calls:
        if name != "issue":
            continue
        kind, nbytes, *rest = args
        p = rest[0] if rest and rest[0] is not None else kwargs.get("world_size")
        dim = rest[1] if len(rest) > 1 else kwargs.get("dim")
        preset = links[dim] if isinstance(links, dict) else links
        free = without_bandwidth(preset)
        if p is None or p <= 1 or free == preset:  # no collective, or a link with no bandwidth term
            continue
        peer = kwargs.get("peer_bytes")
        if peer is not None:
            total += all_to_all_time(*peer, p, preset)
            latency += all_to_all_time(*peer, p, free)
        else:
            total += collective_time(kind, nbytes, p, preset)
            latency += collective_time(kind, nbytes, p, free)
    return total, latency


@dataclass
class Recording:
    batch: int
    prompt_len: int
    new_tokens: int
    phases: dict[str, Phase]
    # The phases run as CUDA graphs (gpt-fast and the zoo's compiled bench capture the decode step, not the
    # prefill): the others' collectives pay the device's host-side `collective_launch_s`.
    graphed: tuple[str, ...] = ("decode",)

    def predict(self, device: DeviceModel, link) -> dict:
        """Prefill and decode-step times (replayed) and the benchmark's tokens/s."""
        out = {name: phase.replay(device, link, graphed=name in self.graphed) for name, phase in self.phases.items()}
        total = out["prefill"]["time"] + (self.new_tokens - 1) * out["decode"]["time"]
        out["tok_s"] = self.batch * self.new_tokens / total
        out["decode_tok_s"] = self.batch / out["decode"]["time"]
        return out


def _record(model, run, world_size: int, attention_program: str) -> Phase:
    clock = DeviceClock(attention_program=attention_program)
    comm.reset_counters()
    with comm.use_mode("simulated", link="nvlink-h100", world_size=world_size, now=clock.mark) as vclock:
        recorder = ClockRecorder(vclock)
        with clock:
            vclock.start()
            run()
            vclock.elapsed()
    return Phase(clock, recorder, comm.snapshot_counters())


@torch.no_grad()
def record_generation(
    model, batch: int, prompt_len: int, new_tokens: int, static_cache: bool = True, gqa_expand: bool = False,
    prefill_logits: int = 1, attention_program: str | None = None,
) -> Recording:
    """Record the prefill of a `prompt_len` prompt and one decode step at the middle of `new_tokens`.
    `attention_program`: how attention is charged (eval.simulator.attention.ATTENTION_PROGRAMS: `flash`,
    `gqa_expand`, `math`); None: `gqa_expand` if `gqa_expand` (the older flag: K and V repeated to every query
    head first), else `flash`. Unsharded (no process group, or one of one rank: TP 1) is the single-GPU
    baseline: nothing is sent, the time is the compute.
    `prefill_logits`: the prompt positions the prefill computes logits for (the last one; 0 = every position,
    as gpt-fast's prefill does, `model(x, input_pos)` through the full lm_head)."""
    if prompt_len < 1 or new_tokens < 1 or batch < 1:
        raise ValueError(f"batch={batch}, prompt_len={prompt_len}, new_tokens={new_tokens} must all be >= 1.")
    program = attention_program_of(gqa_expand, attention_program)
    world = dist.get_world_size() if dist.is_initialized() else 1
    max_len = -(-(prompt_len + new_tokens) // 8) * 8
    device = next(model.parameters()).device
    prompt = torch.zeros(batch, prompt_len, dtype=torch.long, device=device)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def prefill():
        cache = make_cache(model, batch, max_len, static_cache)
        out = model(prompt, cache=cache, use_cache=True, logits_to_keep=prefill_logits)
        out.logits[:, -1].argmax(-1, keepdim=True)

    # The decode step's cache: filled (not recorded, no link) to the middle of the generation.
    cache = make_cache(model, batch, max_len, static_cache)
    with comm.use_mode("none"):
        middle = torch.zeros(batch, prompt_len + new_tokens // 2, dtype=torch.long, device=device)
        cache = model(middle, cache=cache, use_cache=True, logits_to_keep=1).cache

    def decode():
        out = model(token, cache=cache, use_cache=True)
        out.logits[:, -1].argmax(-1, keepdim=True)

    phases = {"prefill": _record(model, prefill, world, program), "decode": _record(model, decode, world, program)}
    return Recording(batch, prompt_len, new_tokens, phases)
