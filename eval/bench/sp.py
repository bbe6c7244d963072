"""The sequence-parallel section: one layer's forward + backward of the linear model over N and P ranks.

Per method (LASP-2 and LASP-1 on a linear layer, LASP-2H and ring attention on a softmax layer;
parallel/sequence.py): bytes per layer vs N and P counted on the meta device beside the spec's formulas
(`sp_bytes_rows`), and the simulated-link forward + backward time of one rank of a P-way fake process group
(rank 0 and / or P-1), each run replayed on every link preset. Its compute follows `compute`: measured for
real (`sequence_parallel`, points within `max_chunk` / `max_attended`), or predicted by the device model
(`sequence_parallel_predicted`: the trunk on the meta device in bfloat16, the forward's and the backward's
aten ops charged, the GPU's fused kernels charged as eval.simulator.kernels models them; any N and P).
"""

import statistics
import time
from contextlib import ExitStack, closing

import torch
import torch.distributed as dist

import models
import parallel
from eval.bench.settings import SIMULATED_DTYPE, SPSettings
from eval.simulator.device import DeviceClock, DeviceModel
from eval.simulator.kernels import FlashBackward, fla_intra
from eval.simulator.replay import bandwidth_share
from eval.simulator.sp_methods import SP_ALGORITHMS, method_config
from models.common.attention import make_causal_mask
from parallel import comm
from parallel.link import LINK_PRESETS, ClockRecorder

SP_RANKS = ("first", "last")


def sp_rank(label: str, p: int) -> int:
    """The rank a `sequence_parallel.ranks` entry plays: `first` = 0, `last` = P-1."""
    return 0 if label == "first" else p - 1


def sp_timed_points(sp: SPSettings) -> tuple[list[tuple[int, int]], list[str]]:
    """The (N, P) points timed and a note for each left out. Measured compute: every N of `lengths` at every P of
    `sp` whose chunk N/P is within `max_chunk` (CPU time and memory grow with the chunk; the byte counts cover
    every point, on the meta device). With a device preset as `compute` nothing is computed, so no limit applies
    and the `device_points` (the LASP-2 paper's 2048K tokens on 64 ranks) are timed too."""
    pairs = [(n, p) for n in sp.lengths for p in sp.sp]
    if sp.compute.predicted:
        return list(dict.fromkeys(pairs + [(e["n"], e["sp"]) for e in sp.device_points])), []
    points, skipped = [], []
    for n, p in pairs:
        if n // p > sp.max_chunk:
            skipped.append(f"N={n}, P={p}: chunk N/P={n // p} tokens is over max_chunk={sp.max_chunk}.")
        else:
            points.append((n, p))
    return points, skipped


def sp_attended(n: int, p: int, rank: int) -> int:
    """(query, key) pairs a softmax layer of rank `rank` scores: its C queries against the (rank+1) C keys up
    to its chunk (LASP-2H and ring attention alike)."""
    c = n // p
    return c * (rank + 1) * c


def check_sequence_parallel(sp: SPSettings) -> None:
    unknown = [m for m in sp.methods if m not in SP_ALGORITHMS]
    if unknown or not sp.methods:
        raise ValueError(f"sequence_parallel.methods {list(sp.methods)} must name some of {list(SP_ALGORITHMS)}.")
    bad_ranks = [r for r in sp.ranks if r not in SP_RANKS]
    if bad_ranks or not sp.ranks:
        raise ValueError(f"sequence_parallel.ranks {list(sp.ranks)} must be some of {list(SP_RANKS)} (rank 0 or P-1).")
    for what, lengths, degrees in (("", sp.lengths, sp.sp), ("bytes.", sp.bytes_lengths, sp.bytes_sp)):
        pairs = [(n, p) for n in lengths for p in degrees]
        extra = sp.bytes_extra_points if what else sp.device_points
        pairs += [(e["n"], e["sp"]) for e in extra or []]
        # With a device preset a timed P = 1 is the single-GPU baseline (the whole sequence on one rank, nothing
        # sent); the bytes grid and measured compute need P >= 2.
        least = 1 if sp.compute.predicted and not what else 2
        for n, p in pairs:
            if isinstance(p, bool) or not isinstance(p, int) or p < least:
                raise ValueError(
                    f"sequence_parallel.{what}sp degree {p!r} must be an integer >= {least} (one rank has no "
                    "communication" + (")." if least == 1 or what else "; one rank, the single-GPU baseline, is "
                                       "predicted with compute=<a device preset>).")
                )
            if isinstance(n, bool) or not isinstance(n, int) or n < p or n % p:
                raise ValueError(
                    f"sequence_parallel.{what}lengths: N={n!r} does not split over P={p} ranks (each holds N/P "
                    f"tokens); use lengths divisible by every degree, e.g. powers of two >= {p}."
                )
    for link in sp.links:
        if link not in LINK_PRESETS:
            raise ValueError(f"Unknown link preset {link!r} in sequence_parallel.links; choose from {sorted(LINK_PRESETS)}.")
    if sp.device_kernels not in SP_DEVICE_KERNELS:
        raise ValueError(
            f"sequence_parallel.device_kernels={sp.device_kernels!r} must be one of {list(SP_DEVICE_KERNELS)}."
        )
    if sp.repeats < 1 or sp.warmup < 0 or sp.batch < 1:
        raise ValueError("sequence_parallel needs repeats >= 1, warmup >= 0 and batch >= 1.")
    for method in sp.methods:
        method_config(sp.shape, sp.overrides, method, 2)  # the shape builds as this method's model (its own config checks)
    if not sp_timed_points(sp)[0]:
        raise ValueError(
            f"No (N, P) point of sequence_parallel.lengths x sp has a chunk N/P within max_chunk={sp.max_chunk}; "
            "raise max_chunk or add larger degrees."
        )


def fake_sp_mesh(p: int, rank: int):
    """A P-way sp mesh on PyTorch's fake process group in which this process is rank `rank`.

    parallel.init_mesh(fake=True) always plays rank 0; here the group is started at the rank wanted and
    init_mesh builds its mesh over it (it uses a process group that is already running)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p)
    return parallel.init_mesh(sp=p, device_type="cpu")


def build_sp_trunk(sp: SPSettings, method: str, p: int, mesh, device: torch.device, dtype: torch.dtype):
    """The trunk (decoder layers, rotary, sequence offset) of a random Linear-Llama of `method`, sharded over
    the P-way sp mesh; on the meta device it stays there (counting bytes needs no values)."""
    with torch.device("meta"):
        model = models.get("linear").model_class(method_config(sp.shape, sp.overrides, method, p))
    parallel.parallelize(model, mesh)
    model.to(dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        torch.manual_seed(sp.seed)
        with torch.no_grad():
            model.apply(model._init_weights)
    model.train()
    return model.model


def sp_inputs(trunk, n: int, p: int, batch: int, seed: int, device: torch.device, dtype: torch.dtype) -> dict:
    """This rank's chunk of a random sequence (the layer input, needing its gradient as in training), the
    gradient of the layers' output, and what the trunk hands every layer: rotary (cos, sin) at the chunk's
    global positions and the causal mask offset by the rank. Made here, once per point, so the time measured
    is the layers' own (the trunk makes them once per forward, whatever the layer count)."""
    c = n // p
    gen = torch.Generator().manual_seed(seed)
    hidden = trunk.config.hidden_size
    if device.type == "meta":
        x, grad = (torch.empty(batch, c, hidden, device=device, dtype=dtype) for _ in range(2))
    else:
        x, grad = (torch.randn(batch, c, hidden, generator=gen).to(device, dtype) for _ in range(2))
    offset = trunk.sequence_offset(c)
    mask = make_causal_mask(None, c, 0, device, batch_size=batch, q_offset=offset)
    position_ids = torch.arange(offset, offset + c, device=device)[None]
    rotary = None if trunk.rotary_emb is None else trunk.rotary_emb(x, position_ids)
    return {"x": x, "grad": grad, "rotary": rotary, "mask": mask}


def sp_run_once(trunk, inputs: dict, p: int, link: str, sync=None, now=None) -> dict:
    """One forward + backward of the trunk's layers on this rank's chunk, collectives on the simulated link
    (recorded for replay on every preset), counters per phase. `now`: what the link's clock reads as the time
    (default: wall time; `eval.simulator.device.DeviceClock.mark` for a device model, whose op count at the end of
    the forward is returned as `fwd_ops`)."""
    trunk.zero_grad(set_to_none=True)
    x = inputs["x"].detach().requires_grad_()
    with comm.use_mode("simulated", link=link, world_size=p, sync=sync, now=now) as clock:
        recorder = ClockRecorder(clock)
        comm.reset_counters()
        clock.start()
        h = x
        for layer in trunk.layers:
            h = layer(h, inputs["rotary"], inputs["mask"], None)
        clock.elapsed()  # mark: end of the forward
        fwd_ops = None if now is None else now()  # read past the recorder: not part of the replay
        forward = comm.snapshot_counters()
        comm.reset_counters()
        clock.rebase()  # the counter bookkeeping is not compute
        h.backward(inputs["grad"])
        clock.elapsed()  # mark: end of the backward
        backward = comm.snapshot_counters()
    return {"recorder": recorder, "counts": {"fwd": forward, "bwd": backward}, "fwd_ops": fwd_ops}


# With a device preset, how the sequence-parallel rows charge the two kernels whose GPU version the meta device does
# not run (`sequence_parallel.device_kernels`): `gpu` as a GPU runs them, `as_run` every aten op as the meta device
# runs them.
SP_DEVICE_KERNELS = {
    "gpu": "the linear layers' intra-chunk kernel charged as fla's chunk kernel (what models/linear/ops.py runs on "
           "CUDA; the meta device runs the CPU chunked kernel instead, one kernel per op per 64-token chunk and a "
           "full-size slice gradient per chunk in the backward) and the backward of F.scaled_dot_product_attention "
           "as flash attention's (2.5x the forward's FLOPs, Q, K, V, O, dO read once; the meta device differentiates "
           "the math decomposition, which materialises the scores)",
    "as_run": "every aten op charged as the meta device runs it (the CPU chunked kernel of the linear layers, the "
              "math decomposition's backward of scaled_dot_product_attention)",
}  # fmt: skip
def sp_record(trunk, inputs: dict, p: int, link: str, kernels: str = "gpu") -> dict:
    """`sp_run_once` on the meta device under a `DeviceClock`: every aten op of the forward and the backward
    (autograd runs the backward's ops through the same dispatch mode) recorded as FLOPs and bytes, the link's
    clock reading the op count. `kernels` (SP_DEVICE_KERNELS): `gpu` charges the linear layers' intra-chunk
    kernel as fla's and attention's backward as flash attention's. `times` (a `DeviceModel`'s cumulative op
    times) turns the recording into seconds."""
    from models.linear.modeling import LinearAttention

    clock, patched = DeviceClock(), []
    with clock, ExitStack() as stack:
        if kernels == "gpu":
            stack.enter_context(FlashBackward(clock))
            for attn in (layer.self_attn for layer in trunk.layers):
                if isinstance(attn, LinearAttention):
                    attn.intra_chunk = fla_intra(clock, attn.intra_chunk)  # shadows the method on this instance
                    patched.append(attn)
        try:
            run = sp_run_once(trunk, inputs, p, link, now=clock.mark)
        finally:
            for attn in patched:
                del attn.intra_chunk
    return {**run, "clock": clock}


def sp_compute_columns(clock: DeviceClock, fwd_ops: int, times: list[float], layers: int) -> dict:
    """Per layer, of forward and backward apart: the device model's compute ms, kernels, FLOPs and HBM bytes."""
    out = {}
    for phase, ops in (("fwd", slice(0, fwd_ops)), ("bwd", slice(fwd_ops, None))):
        start, stop = ops.start, len(clock.flops) if ops.stop is None else ops.stop
        out[f"{phase}_compute_ms"] = 1e3 * (times[stop] - times[start]) / layers
        out[f"{phase}_kernels"] = sum(clock.kernel[ops]) / layers
        out[f"{phase}_flops"] = sum(clock.flops[ops]) / layers
        out[f"{phase}_hbm_bytes"] = sum(clock.bytes[ops]) / layers
    return out


def sp_link_bytes(counts: dict, p: int) -> int:
    """Bytes that cross this rank's link, from comm's counters: an all-gather's counter holds the gathered
    output and a reduce-scatter's its input, of which the (P-1)/P from / to the other ranks cross; a ring
    shift's counter holds the tensor sent (and as much is received)."""
    total = 0
    for kind, c in counts.items():
        if kind in ("all_gather", "reduce_scatter"):
            total += c["bytes"] * (p - 1) // p
        elif kind == "send_recv":
            total += c["bytes"]
        else:
            raise ValueError(f"Unexpected collective {kind!r} in a sequence-parallel layer.")
    return total


def sp_formula_bytes(config, method: str, phase: str, n: int, p: int, batch: int, dtype: torch.dtype) -> int:
    """The spec's bytes per layer per rank (LASP-2's and ring attention's volumes per layer per rank), that cross the
    link in one forward (`fwd`) or backward (`bwd`); states and accumulators are fp32 (fp64 stays fp64), K and
    V in the model dtype:

    - LASP-2: one all-gather of the states, (P-1) B H d_k d_v; the backward's all-gather of dS likewise.
    - LASP-1: P-1 serial hops of one rank's states, B H d_k d_v each; the backward the other way likewise.
    - ring attention: P-1 shifts of a K/V block, (P-1) B (N/P) 2 H_kv d_h; the backward shifts the blocks
      again (P-1) and sends each block's gradient accumulator home, P hops of it.
    - LASP-2H: all-gathers of K and V, (P-1) B (N/P) 2 H_kv d_h, as many bytes as ring attention's forward in
      one collective; the backward reduce-scatters dK, dV, as many again.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    d, c = config.head_dim, n // p
    state = batch * config.num_attention_heads * d * d * acc  # one rank's B x H states d_k x d_v
    kv = batch * c * 2 * config.num_key_value_heads * d  # values of one rank's K and V block
    if method in ("lasp2", "lasp1"):
        return (p - 1) * state
    if method == "lasp2h":
        return (p - 1) * kv * elem
    if method == "ring":
        return (p - 1) * kv * elem if phase == "fwd" else (p - 1) * kv * elem + p * kv * acc
    raise ValueError(f"Unknown sequence-parallel method {method!r}.")


def _sp_row(sp: SPSettings, method, n, p, rank_label, rank, counts, dtype) -> dict:
    """What a bytes row and a timed row share: the point and, per layer and phase, counters and bytes."""
    config = method_config(sp.shape, sp.overrides, method, p)
    layers = config.num_hidden_layers
    row = {"method": method, "label": SP_ALGORITHMS[method]["label"], "layer": "linear" if SP_ALGORITHMS[method]["pattern"] == "L"
           else "softmax", "n": n, "p": p, "chunk": n // p, "batch": sp.batch, "rank": rank_label,
           "rank_index": rank, "layers": layers}  # fmt: skip
    for phase in ("fwd", "bwd"):
        per_layer = {kind: {k: v // layers for k, v in c.items()} for kind, c in counts[phase].items()}
        row[f"{phase}_comm"] = per_layer
        row[f"{phase}_calls"] = sum(c["calls"] for c in per_layer.values())
        row[f"{phase}_counted_bytes"] = sum(c["bytes"] for c in per_layer.values())
        row[f"{phase}_link_bytes"] = sp_link_bytes(per_layer, p)
        row[f"{phase}_link_bytes_formula"] = sp_formula_bytes(config, method, phase, n, p, sp.batch, dtype)
    row["link_bytes"] = row["fwd_link_bytes"] + row["bwd_link_bytes"]
    row["link_bytes_formula"] = row["fwd_link_bytes_formula"] + row["bwd_link_bytes_formula"]
    return row


def sp_bytes_rows(sp: SPSettings, dtype: torch.dtype) -> list[dict]:
    """Bytes per layer at every (N, P) of `sequence_parallel.bytes` (and its extra points: the paper's 2048K
    tokens on 64 ranks), counted by comm's counters on one forward + backward on the META device: the real
    code path with no values, so any size costs seconds. Link time per layer on each preset from the clock
    (its compute here is Python time on meta: only the link time is reported)."""
    pairs = [(n, p) for p in sp.bytes_sp for n in sp.bytes_lengths]
    pairs += [(e["n"], e["sp"]) for e in sp.bytes_extra_points]
    meta = torch.device("meta")
    rows = []
    try:
        for p in dict.fromkeys(p for _, p in pairs):
            mesh = fake_sp_mesh(p, 0)  # every rank sends and receives the same bytes
            for method in sp.methods:
                trunk = build_sp_trunk(sp, method, p, mesh, meta, dtype)
                for n in sorted({n for n, q in pairs if q == p}):
                    inputs = sp_inputs(trunk, n, p, sp.batch, sp.seed, meta, dtype)
                    run = sp_run_once(trunk, inputs, p, sp.links[0])
                    row = _sp_row(sp, method, n, p, "first", 0, run["counts"], dtype)
                    for link in sp.links:
                        fwd, total = run["recorder"].replay(link)
                        row[f"link_ms:{link}"] = 1e3 * total["busy"] / row["layers"]
                    rows.append(row)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def sequence_parallel(sp: SPSettings, device: torch.device, dtype: torch.dtype) -> dict:
    """The long-sequence rows of the linear model's sequence parallelism (docs/architectures.md): per method of
    `sequence_parallel.methods` (LASP-2 and LASP-1 on a linear layer, LASP-2H and ring attention on a softmax
    layer), one process plays one rank of a P-way fake process group in simulated mode.

    - `bytes`: bytes per layer per rank vs N and P, counted (meta device) beside the spec's formula;
    - `timed` (measured compute; with a device preset `sequence_parallel_predicted`): per (N, P) within
      `max_chunk`, rank played (`first` = 0, `last` = P-1: softmax layers are
      unbalanced, the last rank attends to every chunk and sets the step time) and link preset, the virtual
      clock of one forward + backward of the shape's layers: this rank's compute measured for real on this
      device, each collective on the link, exposed where the compute issued before its wait does not cover it.
      Warm-up, then repeats interleaved across methods; each run is recorded once and replayed on every preset
      (`ClockRecorder`). A softmax method whose rank would score more than `max_attended` (query, key) pairs
      is skipped at that point (CPU time).
    """
    if sp.compute.predicted:
        return sequence_parallel_predicted(sp)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    points, skipped = sp_timed_points(sp)
    rows = []
    started = time.perf_counter()
    with closing(_timed_points(sp, points, device, dtype)) as each_point:
        for p, rank_label, rank, trunks, n in each_point:
            methods = []
            for m in sp.methods:
                if SP_ALGORITHMS[m]["pattern"] == "N" and sp_attended(n, p, rank) > sp.max_attended:
                    skipped.append(
                        f"{m} at N={n}, P={p}, rank {rank_label} ({rank}): it would score "
                        f"{sp_attended(n, p, rank):,} (query, key) pairs, over max_attended={sp.max_attended:,}."
                    )
                else:
                    methods.append(m)
            inputs = {m: sp_inputs(trunks[m], n, p, sp.batch, sp.seed, device, dtype) for m in methods}
            for m in methods:
                for _ in range(sp.warmup):
                    sp_run_once(trunks[m], inputs[m], p, sp.links[0], sync)
            runs = {m: [] for m in methods}
            for _ in range(sp.repeats):
                for m in methods:
                    runs[m].append(sp_run_once(trunks[m], inputs[m], p, sp.links[0], sync))
            for m in methods:
                rows += _sp_timed_rows(sp, m, n, p, rank_label, rank, runs[m], dtype)
            del inputs
            print(f"[bench] sequence parallel N={n} P={p} rank {rank_label}: {len(methods)} methods "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return {"timed": rows, "skipped": skipped}


def _timed_points(sp: SPSettings, points: list[tuple[int, int]], device: torch.device, dtype: torch.dtype):
    """(P, rank label, rank, {method: trunk}, N) for every timed point: one fake P-way mesh per (P, rank played)
    with every method's trunk on it, reused over the N at that P; the process group is taken down at the end."""
    try:
        for p in sorted({p for _, p in points}):
            for rank_label in sp.ranks:
                rank = sp_rank(rank_label, p)
                mesh = fake_sp_mesh(p, rank)
                trunks = {m: build_sp_trunk(sp, m, p, mesh, device, dtype) for m in sp.methods}
                for n in sorted(n for n, q in points if q == p):
                    yield p, rank_label, rank, trunks, n
                del trunks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sequence_parallel_predicted(sp: SPSettings) -> dict:
    """The `timed` rows of `sequence_parallel` with a device preset as `compute`: the trunk built on the meta
    device in bfloat16 (SIMULATED_DTYPE) and its inputs there, one forward + backward per (N, P, rank, method)
    recorded under `DeviceClock` (`sp_record`) and replayed on every link preset with the device model's op
    times, plus its contention of every overlapped second of communication (`contention` and `contention_bw` by the
    share of the link time that is bandwidth-bound, as `eval.simulator.replay.Phase.replay`).
    Nothing is computed: one deterministic run per row (no warm-up, no repeats), any N and P (no max_chunk or
    max_attended), the `device_points` included."""
    dtype, meta, dm = SIMULATED_DTYPE, torch.device("meta"), sp.compute.device_model
    points, skipped = sp_timed_points(sp)
    rows = []
    started = time.perf_counter()
    with closing(_timed_points(sp, points, meta, dtype)) as each_point:
        for p, rank_label, rank, trunks, n in each_point:
            for m in sp.methods:
                inputs = sp_inputs(trunks[m], n, p, sp.batch, sp.seed, meta, dtype)
                run = sp_record(trunks[m], inputs, p, sp.links[0], sp.device_kernels)
                run["times"] = run["clock"].times(dm)
                rows += _sp_timed_rows(sp, m, n, p, rank_label, rank, [run], dtype, dm)
            print(f"[bench] sequence parallel (device model {dm.device.name}) N={n} P={p} rank {rank_label} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return {"timed": rows, "skipped": skipped}


def _sp_timed_rows(sp: SPSettings, method, n, p, rank_label, rank, runs, dtype, dm: DeviceModel | None = None) -> list[dict]:
    """One row per link preset: medians (and min-max) over the repeats of the replayed clock, per layer. With a
    device model `dm` (one recorded run, `sp_record`): its op times, and its contention added to the time."""
    base = _sp_row(sp, method, n, p, rank_label, rank, runs[-1]["counts"], dtype)
    layers, out = base["layers"], []
    if dm is not None:
        (run,) = runs
        base.update(sp_compute_columns(run["clock"], run["fwd_ops"], run["times"], layers))
    for link in sp.links:
        # The contention of the run's overlapped link time, by the share of it that is bandwidth-bound on this link
        # (`DeviceModel.contention_at`, as eval.simulator.replay.Phase.replay charges it).
        contention = 0.0 if dm is None else dm.contention_at(bandwidth_share(runs[-1]["recorder"].calls, link))
        marks = [run["recorder"].replay(link, run.get("times")) for run in runs]
        for mark in (m for pair in marks for m in pair):
            # NCCL's kernels share the SMs and HBM with the compute they overlap (device model only).
            mark["overlapped"] = max(0.0, mark["busy"] - mark["exposed"])
            mark["time"] += contention * mark["overlapped"]
        row = {**base, "link": link}
        for key, values in (("fwd_ms", [f["time"] for f, _ in marks]), ("fwd_bwd_ms", [t["time"] for _, t in marks])):
            values = [1e3 * v / layers for v in values]
            row[key], row[f"{key}_min"], row[f"{key}_max"] = statistics.median(values), min(values), max(values)
        fwd_exposed = [1e3 * f["exposed"] / layers for f, _ in marks]
        all_exposed = [1e3 * t["exposed"] / layers for _, t in marks]
        row["fwd_exposed_ms"] = statistics.median(fwd_exposed)
        row["bwd_exposed_ms"] = statistics.median(a - f for f, a in zip(fwd_exposed, all_exposed, strict=True))
        row["exposed_ms"] = statistics.median(all_exposed)
        # The link's time does not depend on compute: the same in every repeat.
        fwd, total = marks[-1]
        row["fwd_link_ms"] = 1e3 * fwd["busy"] / layers
        row["bwd_link_ms"] = 1e3 * (total["busy"] - fwd["busy"]) / layers
        row["link_ms"] = 1e3 * total["busy"] / layers
        # What the clock counted as compute (this device's, or the device model's), per run: the time less the
        # exposed communication (and less the contention, which is the communication's).
        row["compute_ms"] = statistics.median(
            1e3 * (t["time"] - t["exposed"] - contention * t["overlapped"]) / layers for _, t in marks
        )
        if dm is not None:
            row["contention_ms"] = 1e3 * contention * total["overlapped"] / layers
        out.append(row)
    return out


