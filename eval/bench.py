"""Speed benchmark of the zoo's architectures over mesh degrees (tp, ep, ...): `python -m eval.bench`.

Random weights at a given shape (`conf/bench_shape/`), greedy generation from a random prompt:
prefill (time to first token) and the decode loop are timed separately after warm-up, the device
synchronised at each boundary, median and min/max over repeats (gpt-fast's benchmark loop). Each
architecture is measured at each degree point (`tp: [2, 4]` gives {"tp": 2} and {"tp": 4}, `ep: [2]`
gives {"ep": 2}, `degrees: [{ep: 2, tp: 2}]` a point of several dimensions) in one run in three ways
(DESIGN.md, "Measuring speed honestly"):

- `simulated`: this process plays rank 0 of a P-way fake process group, holds only its shards and
  computes; collectives go on the virtual link of `parallel.link` (one row per preset) and the reported
  time is that virtual clock;
- `upper_bound`: the same rank-0 compute with every collective skipped (comm mode `none`);
- `real`: P spawned processes with real collectives (gloo on CPU, nccl on GPU, 127.0.0.1); the same
  processes also time `upper_bound_real` (all ranks running, no collectives), its own upper bound.

The compute of the first two (`compute`): `measured` (default) times rank 0's real compute on this machine;
a device preset (`compute=h100-sxm`, parallel.device.DEVICES) predicts it instead with the speed simulator
(eval/simulate.py): each architecture is built on the meta device in bfloat16 (a GPU's dtype; no memory, so
any shape, a 70B model at TP 8 included), its own prefill and one decode step (static KV cache of prompt +
new tokens, `static_cache`) run once under `parallel.device.DeviceClock`, every aten op charged to the
preset's roofline with the `device_model` constants (eval.costmodel's fit), and that one recording is
replayed on every link preset (`upper_bound`: free communication, `eval.simulate.NO_COMM`). Nothing is
timed on this machine: the rows are deterministic (min = max = median, no warm-up or repeats), and `real`
(which measures this machine) is off.

Measured repeats are interleaved across architectures (repeat r of every arch before repeat r+1) so slow
drift in a shared machine's load hits every architecture alike. Per row (one architecture at one set of mesh
degrees, `{"tp": 2}`, one variant and batch size): prefill ms, decode tokens/s, communication
calls/bytes per forward, exposed communication (simulated), in total and per collective kind. Rows of
architectures with expert-parallel all-to-alls also carry, per MoE layer, the all-to-all bytes counted
beside the entry's dropless formula and (simulated) the all-to-all link time, the part of it left
exposed and the share hidden (`all_to_all_columns`). `eval.bench_report` adds the speed-up over the
baseline and the hidden fraction (T_base - T_arch) / (T_base - T_upper_bound) and writes results.json,
README.md (tables) and PNG plots under the run directory, and a W&B run.

An architecture whose layout refuses a degree point (llama has no ep layout) is skipped at that point
and listed in the report; a point no architecture fits is an error. Links per mesh dimension:
`simulated.links` entries are a preset for every dimension or {dimension: preset}.

`expert_throughput` (off by default): one MoE layer's forward timed for real on this device, no
communication, each router pushed to the load its balance loss aims for (MoE++ at tau), tokens/s of
each layer beside the first's: its own rows, in results.json under "expert_throughput".

`sequence_parallel` (off by default; `bench_preset=sp`): the linear model's sequence parallelism over long
sequences, per method (LASP-2 and LASP-1 on a linear layer, LASP-2H and ring attention on a softmax layer;
parallel/sequence.py): bytes per layer vs N and P counted on the meta device beside the spec's formulas, and
the simulated-link forward + backward time of one rank of a P-way fake process group (rank 0 and / or P-1),
each run replayed on every link preset; in results.json under "sequence_parallel". Its compute follows
`compute`: measured for real (points within `max_chunk` / `max_attended`), or with a device preset predicted by
the device model (`sequence_parallel_predicted`: the trunk on the meta device in bfloat16, the forward's and the
backward's aten ops charged, one deterministic run per row, any N and P: `device_points` adds the LASP-2 paper's
2048K tokens on 64 ranks).

`decode_paths` (off by default; `bench_preset=gqla`): on one device, decode tokens/s of each architecture on each
of its decode-path variants (`decode_paths.paths`, e.g. two exact paths over the same weights), per batch size
and query length (1 or 2 new tokens per step), timed for real, and the KV bytes per token per layer (the model's
own `kv_bytes_per_token` where it has one, else 2 x KV heads x head_dim); also that accounting at a large shape,
config only. In results.json under "decode_paths".

Apart from that section, which measures the linear model's algorithms by name, nothing here names an
architecture: how the bench shape becomes an architecture's config
(`bench_config`), which degrees fit it (`check_layout`) and what it sends (`collectives_per_forward`)
come from its registry entry (models/<name>/entry.py and sharding.py).
"""

import inspect
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from omegaconf import DictConfig, OmegaConf
from torch.overrides import TorchFunctionMode

import models
import parallel
from eval import bench_report
from eval.simulate import NO_COMM, build_meta, record_generation, release
from models.common import RMSNorm, SwiGLUMLP
from models.common.attention import make_causal_mask
from models.common.moe import GroupedExperts, TopKRouter
from parallel import comm
from parallel.device import DEVICES, DeviceClock, DeviceModel
from parallel.link import LINK_PRESETS, ClockRecorder
from parallel.mesh import DIM_ORDER

# --- setup ------------------------------------------------------------------------------------


def bench_points(cfg: dict) -> list[dict[str, int]]:
    """The points the single-process variants (simulated, upper bound) measure."""
    return bench_report.degree_points(cfg["tp"], cfg.get("ep"), cfg.get("degrees"))


def real_points(cfg: dict) -> list[dict[str, int]]:
    """The points launched as real processes (after `resolve_real`)."""
    real = cfg["real"]
    if not real["enabled"]:
        return []
    return bench_report.degree_points(real["tp"], real.get("ep"), real.get("degrees"))


# The dtype of the device model's rows: a GPU's (the meta device allocates nothing, so no CPU cost).
SIMULATED_DTYPE = torch.bfloat16


def compute_of(cfg: dict) -> str:
    """The `compute` setting: `measured`, or a device preset name (parallel.device.DEVICES)."""
    return cfg.get("compute") or "measured"


def predicted(cfg: dict) -> bool:
    """Whether the simulated and upper-bound rows are a device model's prediction (not measured here)."""
    return compute_of(cfg) != "measured"


def check_compute(cfg: dict) -> None:
    compute = compute_of(cfg)
    if compute != "measured" and compute not in DEVICES:
        raise ValueError(
            f"Unknown compute={compute!r}; choose 'measured' (time rank 0's compute on this machine) or a device "
            f"preset of parallel.device.DEVICES: {sorted(DEVICES)}."
        )
    if compute != "measured":
        device_model(cfg)  # constants out of range fail here, before anything runs


def device_model(cfg: dict) -> DeviceModel:
    """The `device_model` constants (conf/bench.yaml) on the `compute` preset."""
    return DeviceModel.from_config(compute_of(cfg), **cfg["device_model"])


def compute_info(cfg: dict) -> dict:
    """What results.json records about the compute: the setting and, for a device preset, the model."""
    if not predicted(cfg):
        return {"setting": "measured"}
    dm = device_model(cfg)
    return {
        "setting": compute_of(cfg),
        "device": {"name": dm.device.name, "peak_flops": dm.device.peak_flops, "hbm_Bps": dm.device.hbm_Bps,
                   "note": dm.device.note},
        "eff_flops": dm.eff_flops,
        "eff_hbm": dm.eff_hbm,
        "kernel_overhead_us": dm.kernel_overhead_s * 1e6,
        "contention": dm.contention,
        "dtype": str(SIMULATED_DTYPE).removeprefix("torch."),
        "static_cache": bool(cfg.get("static_cache", True)),
    }  # fmt: skip


def resolve_real(cfg: dict, device_type: str) -> dict:
    """`auto` real degrees: on CPU only 2-rank points ([2] for an axis the bench measures; every rank needs
    cores of its own), every point on GPUs (one needing more GPUs than the machine has is skipped later).
    With a device preset as `compute` the real variant is off: it would measure this machine."""
    real = dict(cfg["real"])
    if predicted(cfg):
        real["enabled"] = False
    for axis in ("tp", "ep"):
        if real.get(axis, "auto") == "auto":
            wanted = list(cfg.get(axis) or [])
            real[axis] = ([2] if wanted else []) if device_type == "cpu" else wanted
    if real.get("degrees", "auto") == "auto":
        real["degrees"] = [] if device_type == "cpu" else list(cfg.get("degrees") or [])
    return {**cfg, "real": real}


def model_config(cfg: dict, arch: str, degrees: dict[str, int], **extra):
    """The config of `arch` at the bench shape and `degrees`, as its own folder builds it (its registry
    entry's `bench_config`), with `config_overrides[arch]` on top (and `extra` on top of those)."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    overrides = (cfg.get("config_overrides") or {}).get(arch) or {}
    return models.get(arch).bench_config(shape, degrees, **{**overrides, **extra})


def archs_at_points(cfg: dict, points: list[dict[str, int]]) -> tuple[dict[tuple, list[str]], list[str]]:
    """Which of `archs` run at each degree point ({degrees_key: [arch, ...]}) and a note for each one
    skipped: its sharding.py has no layout over a dimension of the point (llama at ep 2: parallelize would
    replicate it there, so it would communicate nothing over that dimension and there is nothing to
    compare), or its config or `check_layout` refuses the point. A point that no architecture fits is an
    error naming each one's reason."""
    archs_at, skipped = {}, []
    for degrees in points:
        label, fit, refused = bench_report.degrees_label(degrees), [], []
        for arch in cfg["archs"]:
            entry = models.get(arch)
            missing = [dim for dim, n in degrees.items() if n > 1 and dim not in entry.degrees]
            if missing:
                refused.append(
                    f"{arch}: no {'/'.join(missing)} layout (its sharding.py shards over {list(entry.degrees)}), "
                    f"so at {label} it would run replicated with nothing to communicate over {'/'.join(missing)}."
                )
                continue
            try:
                entry.check_layout(model_config(cfg, arch, degrees), degrees)
            except ValueError as err:
                refused.append(f"{arch}: {err}")
            else:
                fit.append(arch)
        if not fit:
            raise ValueError(f"No architecture of archs={list(cfg['archs'])} fits the degrees {label}. " + " ".join(refused))
        archs_at[bench_report.degrees_key(degrees)] = fit
        skipped += [f"{label}: {reason}" for reason in refused]
    return archs_at, skipped


def link_label(link) -> str:
    """A `simulated.links` entry as rows name it: the preset, or `ep=pcie4,tp=nvlink-h100` per dimension."""
    if isinstance(link, dict):
        return ",".join(f"{dim}={preset}" for dim, preset in sorted(link.items()))
    return link


def link_of(link, dim: str) -> str | None:
    """The preset a collective over mesh dimension `dim` runs on under this `simulated.links` entry."""
    return link.get(dim) if isinstance(link, dict) else link


def build_sharded(arch: str, cfg: dict, degrees: dict[str, int], mesh, device: torch.device, dtype: torch.dtype):
    """A random `arch` model holding only this rank's shards, materialised on `device`.

    Built on the meta device and sharded there, so a rank never allocates the full model (a 70B shape
    at TP 8 fits one GPU's share); weights are then initialised with the model's own init.
    """
    with torch.device("meta"):
        model = models.get(arch).model_class(model_config(cfg, arch, degrees))
    parallel.parallelize(model, mesh)
    model.to(dtype)
    model.to_empty(device=device)
    # Same seed on every rank: replicated weights (embedding, norms, LM head) agree across ranks,
    # so real ranks pick the same greedy tokens.
    torch.manual_seed(cfg["seed"])
    with torch.no_grad():
        model.apply(model._init_weights)
    model.eval()
    if cfg["compile"]:
        # Compile compute between collectives; communication and the virtual clock stay eager (the Ladder
        # reference's "semi-compiled" model compiles per sub-block too). Attention stays eager: it updates
        # the growing DynamicCache, whose changing strides recompile it at every step.
        for module in model.modules():
            if isinstance(module, (SwiGLUMLP, RMSNorm)):
                module.compile(dynamic=True)
    return model


def _check_degree_list(values, name: str) -> None:
    for p in values or ():
        if isinstance(p, bool) or not isinstance(p, int) or p < 2:
            raise ValueError(f"{name} degree {p!r} in the bench must be an integer >= 2 (degree 1 has no communication).")


def _check_points(points: list[dict[str, int]], what: str) -> None:
    for d in points:
        bad = [k for k in d if k not in DIM_ORDER]
        if bad:
            raise ValueError(f"{what} point {d} names {bad}; mesh dimensions are {list(DIM_ORDER)}.")
        for k, p in d.items():
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise ValueError(f"{what} point {d}: {k}={p!r} must be a positive integer.")
        if bench_report.ranks(d) < 2:
            raise ValueError(f"{what} point {d} has one rank, so no communication to measure; give a degree >= 2.")


def check_settings(cfg: dict) -> tuple[dict[tuple, list[str]], list[str]]:
    """Fail before measuring anything if a setting is out of range, an architecture cannot be built at the
    shape, or a degree point fits no architecture (each architecture's own `check_layout`). Returns which
    architectures run at each point and the notes of those skipped (`archs_at_points`)."""
    check_compute(cfg)
    _check_degree_list(cfg["tp"], "TP")
    _check_degree_list(cfg.get("ep"), "EP")
    points = bench_points(cfg)
    _check_points(points, "degrees")
    sp_enabled = (cfg.get("sequence_parallel") or {}).get("enabled")
    if not points and not sp_enabled:
        raise ValueError(
            "No degree point to measure: give tp, ep or degrees (e.g. tp=[2] or ep=[2]), or turn on the "
            "sequence_parallel section (bench_preset=sp)."
        )
    cfg = resolve_real(cfg, resolve_device(cfg)[0].type)
    _check_degree_list(cfg["real"]["tp"], "real TP")
    _check_degree_list(cfg["real"].get("ep"), "real EP")
    reals = real_points(cfg)
    _check_points(reals, "real")
    for name in cfg.get("config_overrides") or {}:
        if name not in cfg["archs"]:
            raise ValueError(f"config_overrides names {name!r}, which is not in archs={list(cfg['archs'])}.")
    for arch in cfg["archs"]:
        if models.get(arch).bench_config is None:
            raise ValueError(
                f"Architecture {arch!r} declares no bench_config (models/<name>/entry.py, passed to "
                "models.register), so the bench cannot build it at a shape; leave it out of archs."
            )
    if cfg["baseline"] not in cfg["archs"]:
        raise ValueError(f"baseline={cfg['baseline']!r} must be one of archs={list(cfg['archs'])}.")
    if cfg["new_tokens"] < 2:
        raise ValueError(f"new_tokens={cfg['new_tokens']} leaves no decode step; use at least 2.")
    if cfg["repeats"] < 1:
        raise ValueError(f"repeats={cfg['repeats']} must be at least 1.")
    for link in cfg["simulated"]["links"]:
        presets = link.values() if isinstance(link, dict) else [link]
        for preset in presets:
            if preset not in LINK_PRESETS:
                raise ValueError(f"Unknown link preset {preset!r}; choose from {sorted(LINK_PRESETS)}.")
        if isinstance(link, dict) and [dim for dim in link if dim not in DIM_ORDER]:
            raise ValueError(f"simulated.links entry {link} names a dimension outside the mesh's {list(DIM_ORDER)}.")
        if isinstance(link, dict) and cfg["simulated"]["enabled"]:
            for d in points:
                missing = [dim for dim, n in d.items() if n > 1 and dim not in link]
                if missing:
                    raise ValueError(
                        f"simulated.links entry {link} names no link for {missing}, which the point {d} "
                        f"communicates over; add one (e.g. {{{missing[0]}: pcie4}}) or give one preset for all."
                    )
    check_expert_throughput(cfg)
    check_sequence_parallel(cfg)
    check_decode_paths(cfg)
    archs_at, skipped = archs_at_points(cfg, points)
    if reals:
        real_at, real_skipped = archs_at_points(cfg, reals)
        archs_at.update(real_at)
        skipped += [f"real {note}" for note in real_skipped if note not in skipped]
    return archs_at, skipped


def resolve_device(cfg: dict) -> tuple[torch.device, torch.dtype]:
    name = cfg["device"]
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={cfg['device']} but CUDA is not available on this machine (torch {torch.__version__}); "
            "use device=auto or device=cpu."
        )
    dtype = cfg["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device, getattr(torch, dtype)


def cpu_threads(cfg: dict) -> int | None:
    """Threads per process: `auto` = one rank's share of the cores when the largest P ranks share them
    (the most ranks of any point measured, simulated or real; `cfg` with its real degrees resolved)."""
    if cfg["threads"] != "auto":
        return int(cfg["threads"]) if cfg["threads"] else None
    # No degree point (only the sequence_parallel section, one process): all the cores.
    ranks = max((bench_report.ranks(d) for d in [*bench_points(cfg), *real_points(cfg)]), default=1)
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def hardware_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- one timed generation -------------------------------------------------------------------


class WallTimer:
    """Wall time with the device synchronised at both ends (and ranks aligned by a barrier if real)."""

    exposed = comm_busy = exposed_by = busy_by = None

    def __init__(self, device: torch.device, barrier: bool = False):
        self.device, self.barrier = device, barrier

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self):
        self._sync()
        if self.barrier:
            dist.barrier()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._t0


class ClockTimer:
    """The simulated link's virtual clock: measured compute plus communication left exposed."""

    def __init__(self, clock):
        self.clock = clock

    def start(self):
        self.clock.start()

    def stop(self) -> float:
        t = self.clock.elapsed()
        self.exposed, self.comm_busy = self.clock.exposed, self.clock.comm_busy
        # Per label (collective kind; the count exchange of expert parallelism apart): the MoE columns.
        self.exposed_by, self.busy_by = dict(self.clock.exposed_by), dict(self.clock.busy_by)
        return t


@torch.no_grad()
def generate_once(model, ids: torch.Tensor, new_tokens: int, timer) -> dict:
    """Prefill then new_tokens - 1 greedy decode steps; times, exposed comm and comm counts of each phase."""
    comm.reset_counters()
    timer.start()
    out = model(ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = _phase(timer)
    prefill["counts"] = comm.snapshot_counters()
    comm.reset_counters()
    cache = out.cache
    timer.start()
    for _ in range(new_tokens - 1):
        out = model(token, cache=cache, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    decode = _phase(timer)
    decode["counts"] = comm.snapshot_counters()
    return {"prefill": prefill, "decode": decode}


def _phase(timer) -> dict:
    t = timer.stop()
    return {"time": t, "exposed": timer.exposed, "comm_busy": timer.comm_busy, "exposed_by": timer.exposed_by,
            "busy_by": timer.busy_by}  # fmt: skip


def measure_interleaved(built: dict, cfg: dict, batch: int, make_timer, device) -> dict[str, list[dict]]:
    """Warm up every arch, then `repeats` rounds of one generation per arch; {arch: [run, ...]}."""
    gen = torch.Generator().manual_seed(cfg["seed"] + batch)
    ids = torch.randint(0, cfg["bench_shape"]["vocab_size"], (batch, cfg["prompt_len"]), generator=gen).to(device)
    for model in built.values():
        for _ in range(cfg["warmup"]):
            generate_once(model, ids, cfg["new_tokens"], make_timer())
    runs = {arch: [] for arch in built}
    for _ in range(cfg["repeats"]):
        for arch, model in built.items():
            runs[arch].append(generate_once(model, ids, cfg["new_tokens"], make_timer()))
    return runs


def summarize(runs: list[dict], batch: int, new_tokens: int) -> dict:
    """Median and min/max over repeats, per-forward communication counts, in report units."""
    steps = new_tokens - 1
    pre = [r["prefill"]["time"] for r in runs]
    dec = [r["decode"]["time"] for r in runs]
    total = [batch * new_tokens / (p + d) for p, d in zip(pre, dec, strict=True)]
    row = {
        "prefill_ms": 1e3 * statistics.median(pre),
        "prefill_ms_min": 1e3 * min(pre),
        "prefill_ms_max": 1e3 * max(pre),
        "decode_ms_per_step": 1e3 * statistics.median(dec) / steps,
        "decode_tok_s": batch * steps / statistics.median(dec),
        "decode_tok_s_min": batch * steps / max(dec),
        "decode_tok_s_max": batch * steps / min(dec),
        "total_tok_s": statistics.median(total),
    }
    for phase, per in (("prefill", 1), ("decode", steps)):
        counts = runs[-1][phase]["counts"]
        row[f"{phase}_comm_calls"] = sum(c["calls"] for c in counts.values()) / per
        row[f"{phase}_comm_bytes"] = sum(c["bytes"] for c in counts.values()) / per
        row[f"{phase}_comm_by_kind"] = {k: {n: v / per for n, v in c.items()} for k, c in counts.items()}
        exposed = [r[phase]["exposed"] for r in runs]
        if exposed[0] is not None:
            row[f"{phase}_exposed_ms"] = 1e3 * statistics.median(exposed) / per
            row[f"{phase}_comm_busy_ms"] = 1e3 * statistics.median(r[phase]["comm_busy"] for r in runs) / per
            # Share of the link time left exposed. The standard block waits every collective at once, so
            # for it this should be 1; less means the clock counted time between issue and wait as compute.
            busy = row[f"{phase}_comm_busy_ms"]
            row[f"{phase}_exposed_share"] = row[f"{phase}_exposed_ms"] / busy if busy > 0 else None
            labels = sorted({k for r in runs for k in r[phase]["busy_by"]})
            for name, key in (("exposed_ms_by_kind", "exposed_by"), ("comm_busy_ms_by_kind", "busy_by")):
                row[f"{phase}_{name}"] = {
                    k: 1e3 * statistics.median(r[phase][key].get(k, 0.0) for r in runs) / per for k in labels
                }
    # Per-forward names: prefill is one forward, decode figures are per step (one forward each).
    return row


# --- the variants -----------------------------------------------------------------------------


def run_single_process(
    cfg: dict, degrees: dict[str, int], archs: list[str], device, dtype, skipped: list[str] | None = None
) -> list[dict]:
    """Simulated-link and upper-bound rows of `archs` at `degrees`, one process playing rank 0: its compute
    measured on `device`, or predicted by the device model (`compute` a device preset: `run_device_model`,
    which appends to `skipped` an architecture whose forward cannot run on the meta device)."""
    if predicted(cfg):
        return run_device_model(cfg, degrees, archs, skipped)
    rows = []
    p = bench_report.ranks(degrees)
    mesh = parallel.init_mesh(**degrees, fake=True)
    try:
        built = {arch: build_sharded(arch, cfg, degrees, mesh, device, dtype) for arch in archs}
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        for batch in cfg["batch_sizes"]:
            if cfg["simulated"]["enabled"]:
                for link in cfg["simulated"]["links"]:
                    # A dict gives each mesh dimension its own link (parallel.comm times each collective on
                    # its group's); a preset name is the link of every dimension.
                    with comm.use_mode("simulated", link=link, world_size=p, sync=sync) as clock:
                        runs = measure_interleaved(built, cfg, batch, lambda c=clock: ClockTimer(c), device)
                    rows += _rows(runs, cfg, degrees, batch, "simulated", link, dtype)
            if cfg["upper_bound"]["enabled"]:
                with comm.use_mode("none"):
                    runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device), device)
                rows += _rows(runs, cfg, degrees, batch, "upper_bound", None, dtype)
        del built
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def run_device_model(
    cfg: dict, degrees: dict[str, int], archs: list[str], skipped: list[str] | None = None
) -> list[dict]:
    """Simulated-link and upper-bound rows of `archs` at `degrees` predicted by the device model: each
    architecture built on the meta device (bfloat16) and sharded on a fake mesh (`eval.simulate.build_meta`,
    which brings the mesh up; `release` takes it down), its generation recorded once per batch size and
    replayed on every link preset (`upper_bound`: free communication). The rows go through the same
    `summarize` / `_rows` as measured ones, one run each (min = max = median). An architecture whose forward
    needs values the meta device does not have (a data-dependent op such as boolean-mask indexing) is not
    predicted: a note for it goes to `skipped` (any other error is raised)."""
    dm, dtype = device_model(cfg), SIMULATED_DTYPE
    recordings = {batch: {} for batch in cfg["batch_sizes"]}
    for arch in archs:
        try:
            model = build_meta(arch, model_config(cfg, arch, degrees), degrees, dtype)
            recorded = {
                batch: record_generation(
                    model, batch, cfg["prompt_len"], cfg["new_tokens"], bool(cfg.get("static_cache", True))
                )
                for batch in cfg["batch_sizes"]
            }
        except (NotImplementedError, RuntimeError) as err:
            if "meta" not in str(err):
                raise
            note = (
                f"{bench_report.degrees_label(degrees)}: {arch}: its forward does not run on the meta device, so "
                f"compute={compute_of(cfg)} cannot predict it ({type(err).__name__}: {str(err).split('. ')[0]})"
            )
            print(f"[bench] skipped {note}", flush=True)
            if skipped is not None:
                skipped.append(note)
            continue
        finally:
            release()
            model = None
        for batch, recording in recorded.items():
            recordings[batch][arch] = recording
    rows = []
    for batch, recs in recordings.items():
        if cfg["simulated"]["enabled"]:
            for link in cfg["simulated"]["links"]:
                runs = {arch: [predicted_run(rec, dm, link)] for arch, rec in recs.items()}
                rows += _rows(runs, cfg, degrees, batch, "simulated", link, dtype)
        if cfg["upper_bound"]["enabled"]:
            runs = {arch: [predicted_run(rec, dm, NO_COMM, upper_bound=True)] for arch, rec in recs.items()}
            rows += _rows(runs, cfg, degrees, batch, "upper_bound", None, dtype)
    return rows


def predicted_run(recording, dm: DeviceModel, link, upper_bound: bool = False) -> dict:
    """One recording's prediction as one run of `generate_once`: prefill, and the decode loop as the one
    recorded step times the new_tokens - 1 steps (its counts too), which `summarize` divides back. The upper
    bound reads as a measured one does: no exposure, nothing sent (comm mode `none` counts nothing)."""
    out = recording.predict(dm, link)
    steps = recording.new_tokens - 1
    run = {}
    for phase, per in (("prefill", 1), ("decode", steps)):
        p, counts = out[phase], recording.phases[phase].counts
        run[phase] = {"time": p["time"] * per}
        if upper_bound:
            run[phase].update(exposed=None, comm_busy=None, exposed_by=None, busy_by=None, counts={})
        else:
            run[phase].update(
                exposed=p["exposed"] * per,
                comm_busy=p["busy"] * per,
                exposed_by={k: v * per for k, v in p["exposed_by"].items()},
                busy_by={k: v * per for k, v in p["busy_by"].items()},
                counts={kind: {n: v * per for n, v in c.items()} for kind, c in counts.items()},
            )
    return run


def _rows(runs, cfg, degrees, batch, variant, link, dtype) -> list[dict]:
    out = []
    for arch, arch_runs in runs.items():
        row = {"arch": arch, "degrees": dict(degrees), "variant": variant, "link": None, "batch": batch}
        if link is not None:
            row["link"] = link_label(link)
            row["links"] = link  # the setting itself: one preset, or {dimension: preset}
        row.update(summarize(arch_runs, batch, cfg["new_tokens"]))
        row.update(all_to_all_columns(row, cfg, arch, degrees, dtype))
        out.append(row)
    return out


# --- MoE: all-to-all per layer -----------------------------------------------------------------


def all_to_all_columns(row: dict, cfg: dict, arch: str, degrees: dict[str, int], dtype: torch.dtype) -> dict:
    """Per MoE layer, for a row whose forward sent token all-to-alls (expert parallelism), per phase
    (prefill = one forward of batch x prompt tokens, decode = one step of batch tokens):

    - `{phase}_moe_layers`: all-to-all calls / 2 (dispatch and combine per MoE layer, models/common/moe.py);
    - `{phase}_a2a_bytes`: bytes per token all-to-all, counted by comm.counters (the rows this rank hands
      to the all-to-all, its own chunk included; the count exchange is counted apart);
    - `{phase}_a2a_formula_bytes`: the same from the architecture's declared collectives_per_forward, which
      is the spec's dropless T_local * k * h * bytes (MoE++: k_eff at the balanced load, not an integer);
      `{phase}_a2a_link_bytes_formula` = that * (P-1)/P, the part that leaves the rank (specs/moe.md);
      `{phase}_a2a_rows_per_token` and `..._formula`: the same two as rows (experts) per token, k;
    - simulated rows: `{phase}_a2a_link_ms_per_layer` (the link model's time of the layer's two token
      all-to-alls), `{phase}_a2a_exposed_ms_per_layer` (the part of it the rank waited for, from the
      virtual clock), `{phase}_a2a_hidden_share` = 1 - exposed / link time, and
      `{phase}_count_exchange_exposed_ms_per_layer` (the blocking exchange of per-expert counts);
      `a2a_hidden_anchor`: the published share for this architecture on the ep link (settings `anchors`).
    """
    out = {}
    p = degrees.get("ep", 1)  # the expert-parallel all-to-alls run over ep
    config = model_config(cfg, arch, degrees)
    d, elem = config.hidden_size, torch.empty((), dtype=dtype).element_size()
    declared = (models.get(arch).collectives_per_forward or (lambda c, g: {}))(config, degrees).get("all_to_all")
    tokens = {"prefill": row["batch"] * cfg["prompt_len"], "decode": row["batch"]}
    for phase, n in tokens.items():
        a2a = row[f"{phase}_comm_by_kind"].get("all_to_all")
        if not a2a or not a2a["calls"]:
            continue
        layers = a2a["calls"] / 2
        per_call = a2a["bytes"] / a2a["calls"]
        out[f"{phase}_moe_layers"] = layers
        out[f"{phase}_a2a_bytes"] = per_call
        out[f"{phase}_a2a_rows_per_token"] = per_call / (n * d * elem)
        if declared is not None and declared.calls:
            formula = declared.values_per_token / declared.calls * n * elem
            out[f"{phase}_a2a_formula_bytes"] = formula
            out[f"{phase}_a2a_link_bytes_formula"] = formula * (p - 1) / p
            out[f"{phase}_a2a_rows_per_token_formula"] = declared.values_per_token / declared.calls / d
        busy, exposed = row.get(f"{phase}_comm_busy_ms_by_kind"), row.get(f"{phase}_exposed_ms_by_kind")
        if busy is not None:
            link_ms = busy.get("all_to_all", 0.0) / layers
            exposed_ms = exposed.get("all_to_all", 0.0) / layers
            out[f"{phase}_a2a_link_ms_per_layer"] = link_ms
            out[f"{phase}_a2a_exposed_ms_per_layer"] = exposed_ms
            out[f"{phase}_a2a_hidden_share"] = 1 - exposed_ms / link_ms if link_ms > 0 else None
            out[f"{phase}_count_exchange_exposed_ms_per_layer"] = exposed.get("exchange_splits", 0.0) / layers
    if out and row.get("links") is not None:
        anchors = ((cfg.get("anchors") or {}).get("a2a_hidden_share") or {}).get(arch) or {}
        out["a2a_hidden_anchor"] = anchors.get(link_of(row["links"], "ep"))
    return out


# --- MoE: one expert layer's throughput, for real on one device ---------------------------------


def expert_layer_label(spec: dict) -> str:
    """`moepp tau=0.75`: the architecture and the config fields set for this entry."""
    overrides = spec.get("overrides") or {}
    return " ".join([spec["arch"], *(f"{k}={v}" for k, v in overrides.items())])


def check_expert_throughput(cfg: dict) -> None:
    et = cfg.get("expert_throughput") or {}
    if not et.get("enabled"):
        return
    if not et.get("layers"):
        raise ValueError("expert_throughput.layers is empty: list the MoE layers to time, the baseline first.")
    if et["tokens"] < 1 or et["repeats"] < 1:
        raise ValueError(f"expert_throughput needs tokens >= 1 and repeats >= 1, got {et['tokens']}, {et['repeats']}.")
    for spec in et["layers"]:
        entry = models.get(spec["arch"])
        config = model_config(cfg, spec["arch"], {}, **(spec.get("overrides") or {}))
        declared = entry.collectives_per_forward(config, {"ep": 2}) if entry.collectives_per_forward else {}
        if "all_to_all" not in declared:
            raise ValueError(
                f"expert_throughput times MoE layers, but {spec['arch']!r} declares no expert-parallel all-to-all "
                "(collectives_per_forward at ep 2); list MoE architectures only."
            )


def first_moe_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The first module with a top-k `router` and grouped `experts` (models/common/moe.py): an MoE layer."""
    for module in model.modules():
        if isinstance(getattr(module, "router", None), TopKRouter) and isinstance(
            getattr(module, "experts", None), GroupedExperts
        ):
            return module
    raise ValueError(f"{type(model).__name__} has no MoE layer (a module with a TopKRouter and GroupedExperts).")


def _ffn_rows_per_token(layer, x: torch.Tensor, offset: float) -> float:
    """Rows per token the router sends to the grouped (FFN) experts when the experts past them
    (MoE++'s zero-computation experts) get `offset` added to their logits."""
    n_ffn, n = layer.experts.num_experts, layer.router.num_experts
    bias = torch.zeros(n, device=x.device)
    bias[n_ffn:] = offset
    routing = layer.router(x, extra_logits=bias.expand(x.shape[0], n))
    return (routing.expert_idx < n_ffn).sum().item() / x.shape[0]


def route_at_target(layer, x: torch.Tensor, target: float) -> float:
    """Push `layer`'s router to the load its balance loss aims for: `target` rows per token to the grouped
    experts (the entry's declared all-to-all rows per token, k_eff for MoE++). Random weights route about
    uniformly over ALL experts whatever tau is, so without this tau would change nothing; trained routers
    reach that load through the heterogeneous balance loss. A logit offset on the experts past the grouped
    ones (none in a plain MoE) is found by bisection and added on every call by a forward pre-hook on the
    router (no model code changes). Returns the offset (0 without such experts)."""
    if layer.router.num_experts == layer.experts.num_experts:
        return 0.0
    lo, hi = -30.0, 30.0  # rows per token fall as the offset grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if _ffn_rows_per_token(layer, x, mid) > target:
            lo = mid
        else:
            hi = mid
    offset = (lo + hi) / 2
    n_ffn, n = layer.experts.num_experts, layer.router.num_experts
    bias = torch.zeros(n, device=x.device)
    bias[n_ffn:] = offset

    def add_bias(module, args, kwargs):
        extra = kwargs.get("extra_logits")
        kwargs["extra_logits"] = bias if extra is None else extra + bias
        return args, kwargs

    layer.router.register_forward_pre_hook(add_bias, with_kwargs=True)
    return offset


def expert_throughput(cfg: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Tokens/s of one MoE layer's forward (router, experts, combine; no communication: every expert on this
    device), for each entry of `expert_throughput.layers` at the bench shape, timed for real, interleaved
    over repeats like the generation bench; the first entry is the baseline of `speedup`. Each router is
    pushed to the load its balance loss aims for (`route_at_target`)."""
    et = cfg["expert_throughput"]
    gen = torch.Generator().manual_seed(cfg["seed"])
    layers, rows = {}, []
    for spec in et["layers"]:
        label, arch = expert_layer_label(spec), spec["arch"]
        entry = models.get(arch)
        config = model_config(cfg, arch, {}, **(spec.get("overrides") or {}))
        with torch.device("meta"):
            model = entry.model_class(config)  # on meta: only the layer timed is materialised
        layer = first_moe_layer(model)
        layer.to(dtype)
        layer.to_empty(device=device)
        torch.manual_seed(cfg["seed"])
        with torch.no_grad():
            layer.apply(model._init_weights)
        layer.eval()
        declared = entry.collectives_per_forward(config, {"ep": 2})["all_to_all"]
        target = declared.values_per_token / declared.calls / config.hidden_size
        x = torch.randn(et["tokens"], config.hidden_size, generator=gen).to(device, dtype)
        with torch.no_grad():
            offset = route_at_target(layer, x, target)
            realised = _ffn_rows_per_token(layer, x, 0.0)  # the hook adds the offset now
        # MoE layers take the tokens first; anything else they take (MoE++: the previous layer's router
        # logits, for its gating residual) is None, as for a first layer.
        extra = [None] * (sum(1 for q in inspect.signature(layer.forward).parameters.values() if q.default is q.empty) - 1)
        layers[label] = (layer, x, extra)
        rows.append({"label": label, "arch": arch, "overrides": dict(spec.get("overrides") or {}),
                     "anchor": spec.get("anchor"), "tokens": et["tokens"], "target_rows_per_token": target,
                     "ffn_rows_per_token": realised, "router_offset": offset})  # fmt: skip
        del model

    def run_once(label):
        layer, x, extra = layers[label]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        layer(x, *extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    times = {label: [] for label in layers}
    with torch.no_grad(), comm.use_mode("none"):
        for label in layers:
            for _ in range(et["warmup"]):
                run_once(label)
        for _ in range(et["repeats"]):
            for label in layers:
                times[label].append(run_once(label))
    for row in rows:
        t = times[row["label"]]
        row.update(ms=1e3 * statistics.median(t), ms_min=1e3 * min(t), ms_max=1e3 * max(t))
        row["tokens_per_s"] = row["tokens"] / statistics.median(t)
    base = rows[0]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        # What the speed-up would be if the grouped experts were all the time: the ratio of their rows.
        row["expert_rows_ratio"] = base["ffn_rows_per_token"] / row["ffn_rows_per_token"] if row["ffn_rows_per_token"] else None
    return rows


# --- sequence parallelism: one layer's forward + backward over sequence length N and sp degree P -------

# The four sequence-parallel algorithms of parallel/sequence.py, each as Linear-Llama builds it: the layer
# pattern (one letter repeated over the shape's layers: L linear, N softmax) and the config's sp_method.
SP_METHODS = {
    "lasp2": {"pattern": "L", "sp_method": "lasp2", "label": "LASP-2",
              "what": "linear layer, one all-gather of the d_k x d_v states, in flight during the intra-chunk compute"},
    "lasp1": {"pattern": "L", "sp_method": "lasp1", "label": "LASP-1",
              "what": "linear layer, the states pass a ring: P-1 serial hops"},
    "lasp2h": {"pattern": "N", "sp_method": "lasp2", "label": "LASP-2H",
               "what": "softmax layer, all-gather of K and V (backward: reduce-scatter of dK, dV)"},
    "ring": {"pattern": "N", "sp_method": "lasp1", "label": "ring attention",
             "what": "softmax layer, P-1 shifts of the K/V blocks, each during the attention to the block at hand"},
}  # fmt: skip
SP_RANKS = ("first", "last")


def sp_rank(label: str, p: int) -> int:
    """The rank a `sequence_parallel.ranks` entry plays: `first` = 0, `last` = P-1."""
    return 0 if label == "first" else p - 1


def sp_config(cfg: dict, method: str, p: int):
    """Linear-Llama at the bench shape with the layer pattern and sp_method of `method` (SP_METHODS), with
    `sequence_parallel.overrides` (e.g. a decay) under them."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    spec = SP_METHODS[method]
    overrides = {**(cfg["sequence_parallel"].get("overrides") or {}), "layer_pattern": spec["pattern"],
                 "sp_method": spec["sp_method"]}  # fmt: skip
    return models.get("linear").bench_config(shape, {"sp": p}, **overrides)


def sp_timed_points(cfg: dict) -> tuple[list[tuple[int, int]], list[str]]:
    """The (N, P) points timed and a note for each left out. Measured compute: every N of `lengths` at every P of
    `sp` whose chunk N/P is within `max_chunk` (CPU time and memory grow with the chunk; the byte counts cover
    every point, on the meta device). With a device preset as `compute` nothing is computed, so no limit applies
    and the `device_points` (the LASP-2 paper's 2048K tokens on 64 ranks) are timed too."""
    sp = cfg["sequence_parallel"]
    pairs = [(n, p) for n in sp["lengths"] for p in sp["sp"]]
    if predicted(cfg):
        return list(dict.fromkeys(pairs + [(e["n"], e["sp"]) for e in sp.get("device_points") or []])), []
    points, skipped = [], []
    for n, p in pairs:
        if n // p > sp["max_chunk"]:
            skipped.append(f"N={n}, P={p}: chunk N/P={n // p} tokens is over max_chunk={sp['max_chunk']}.")
        else:
            points.append((n, p))
    return points, skipped


def sp_attended(n: int, p: int, rank: int) -> int:
    """(query, key) pairs a softmax layer of rank `rank` scores: its C queries against the (rank+1) C keys up
    to its chunk (LASP-2H and ring attention alike)."""
    c = n // p
    return c * (rank + 1) * c


def check_sequence_parallel(cfg: dict) -> None:
    sp = cfg.get("sequence_parallel") or {}
    if not sp.get("enabled"):
        return
    unknown = [m for m in sp["methods"] if m not in SP_METHODS]
    if unknown or not sp["methods"]:
        raise ValueError(f"sequence_parallel.methods {list(sp['methods'])} must name some of {list(SP_METHODS)}.")
    bad_ranks = [r for r in sp["ranks"] if r not in SP_RANKS]
    if bad_ranks or not sp["ranks"]:
        raise ValueError(f"sequence_parallel.ranks {list(sp['ranks'])} must be some of {list(SP_RANKS)} (rank 0 or P-1).")
    for what, lengths, degrees in (("", sp["lengths"], sp["sp"]), ("bytes.", sp["bytes"]["lengths"], sp["bytes"]["sp"])):
        pairs = [(n, p) for n in lengths for p in degrees]
        extra = sp["bytes"].get("extra_points") if what else sp.get("device_points")
        pairs += [(e["n"], e["sp"]) for e in extra or []]
        for n, p in pairs:
            if isinstance(p, bool) or not isinstance(p, int) or p < 2:
                raise ValueError(f"sequence_parallel.{what}sp degree {p!r} must be an integer >= 2 (one rank has no communication).")
            if isinstance(n, bool) or not isinstance(n, int) or n < p or n % p:
                raise ValueError(
                    f"sequence_parallel.{what}lengths: N={n!r} does not split over P={p} ranks (each holds N/P "
                    f"tokens); use lengths divisible by every degree, e.g. powers of two >= {p}."
                )
    for link in sp["links"]:
        if link not in LINK_PRESETS:
            raise ValueError(f"Unknown link preset {link!r} in sequence_parallel.links; choose from {sorted(LINK_PRESETS)}.")
    if sp.get("device_kernels", "gpu") not in SP_DEVICE_KERNELS:
        raise ValueError(
            f"sequence_parallel.device_kernels={sp['device_kernels']!r} must be one of {list(SP_DEVICE_KERNELS)}."
        )
    if sp["repeats"] < 1 or sp["warmup"] < 0 or sp["batch"] < 1:
        raise ValueError("sequence_parallel needs repeats >= 1, warmup >= 0 and batch >= 1.")
    for method in sp["methods"]:
        sp_config(cfg, method, 2)  # the shape builds as this method's model (its own config checks)
    if not sp_timed_points(cfg)[0]:
        raise ValueError(
            f"No (N, P) point of sequence_parallel.lengths x sp has a chunk N/P within max_chunk={sp['max_chunk']}; "
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


def build_sp_trunk(cfg: dict, method: str, p: int, mesh, device: torch.device, dtype: torch.dtype):
    """The trunk (decoder layers, rotary, sequence offset) of a random Linear-Llama of `method`, sharded over
    the P-way sp mesh; on the meta device it stays there (counting bytes needs no values)."""
    with torch.device("meta"):
        model = models.get("linear").model_class(sp_config(cfg, method, p))
    parallel.parallelize(model, mesh)
    model.to(dtype)
    if device.type != "meta":
        model.to_empty(device=device)
        torch.manual_seed(cfg["seed"])
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
    (default: wall time; `parallel.device.DeviceClock.mark` for a device model, whose op count at the end of
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
FLA_CHUNK = 64  # fla's chunk_simple_gla: tokens per chunk (BT)


@contextmanager
def _quiet(clock: DeviceClock):
    """Ops run inside are not charged (a fused kernel charged as one; parallel.device uses the same counter)."""
    clock._quiet += 1
    try:
        yield
    finally:
        clock._quiet -= 1


class _ChargedKernel(torch.autograd.Function):
    """`fn(*tensors)` run quietly under a DeviceClock, the costs of a fused kernel charged instead: `forward`
    [(name, FLOPs, bytes)] when it runs, `backward` when its gradient is taken (also quietly)."""

    @staticmethod
    def forward(ctx, clock, fn, forward, backward, *tensors):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        with torch.enable_grad(), _quiet(clock):
            out = fn(*leaves)
        for name, flops, nbytes in forward:
            clock.charge(name, flops, nbytes)
        ctx.clock, ctx.costs, ctx.graph = clock, backward, (out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = ctx.graph
        del ctx.graph
        wanted = [x for x in leaves if x.requires_grad]
        with _quiet(ctx.clock):
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        for name, flops, nbytes in ctx.costs:
            ctx.clock.charge(name, flops, nbytes)
        return (None, None, None, None, *(next(found) if x.requires_grad else None for x in leaves))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fla_chunk_costs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[list, list]:
    """(forward, backward) kernels of fla's chunk_simple_gla on [B, H, T, D] inputs, as (name, FLOPs, bytes), chunks
    of BT = 64 tokens with per-chunk states h [B, H, T/BT, d_k, d_v] kept in the input dtype:

    - forward: chunk_fwd_h (the states: k^T v per chunk, 2 T d_k d_v per head), chunk_fwd_o (intra-chunk
      (Q K^T) V, 2 T BT (d_k + d_v), plus Q h, 2 T d_k d_v);
    - backward: chunk_fwd_h again (recomputed), chunk_bwd_dh (dh from Q and dO), the dQ / dK kernel (dO V^T, dS K,
      dS^T Q within chunks and dO h^T, V dh^T across them) and the dV kernel ((Q K^T)^T dO and K dh): about 2.75x the
      forward's FLOPs at d = BT = 64.
    The decay's gradient (a learned decay) is not charged: a few elementwise passes."""
    b, h, t, dk = q.shape
    dv, e = v.shape[-1], q.element_size()
    bt = min(FLA_CHUNK, t)
    states = b * h * -(-t // FLA_CHUNK) * dk * dv * e
    nq, nk, nv = _nbytes(q), _nbytes(k), _nbytes(v)
    no = nv  # O and dO: [B, H, T, d_v] in the input dtype
    kv = 2 * b * h * t * dk * dv  # one pass of T x d_k x d_v products (states, Q h, ...)
    qk, av = 2 * b * h * t * bt * dk, 2 * b * h * t * bt * dv  # one intra-chunk product each
    fwd_h = ("fla:chunk_fwd_h", kv, nk + nv + states)
    forward = [fwd_h, ("fla:chunk_fwd_o", qk + av + kv, nq + nk + nv + states + no)]
    backward = [
        fwd_h,
        ("fla:chunk_bwd_dh", kv, nq + no + states),
        ("fla:chunk_bwd_dqk", av + 2 * qk + 2 * kv, nq + nk + nv + no + 2 * states + nq + nk),
        ("fla:chunk_bwd_dv", qk + av + kv, nq + nk + no + states + nv),
    ]
    return forward, backward


def fla_intra(clock: DeviceClock, kernel):
    """The intra-chunk kernel `kernel(q, k, v, log_decay)` (a LinearAttention's `intra_chunk`), run quietly with
    fla's chunk kernel charged for it (`fla_chunk_costs`)."""

    def intra(q, k, v, log_decay):
        tensors = (q, k, v) if log_decay is None else (q, k, v, log_decay)
        forward, backward = fla_chunk_costs(q, k, v)
        return _ChargedKernel.apply(clock, lambda q, k, v, g=None: kernel(q, k, v, g), forward, backward, *tensors)

    return intra


def flash_backward_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> tuple:
    """Flash attention's backward as one kernel (name, FLOPs, bytes): 2.5x the forward's FLOPs (FlashAttention-2:
    five Tq x Tk x d products to the forward's two; causal halves both), reading Q, K, V, O, dO (and a mask) and
    writing dQ, dK, dV once (the forward's charge: parallel.device._FusedAttention)."""
    b, h, tq, d = q.shape
    flops = 4 * b * h * tq * k.shape[-2] * d
    if kwargs.get("is_causal") and tq > 1:
        flops //= 2
    nbytes = 2 * (_nbytes(q) + _nbytes(k) + _nbytes(v)) + 2 * _nbytes(q) * v.shape[-1] // d
    mask = kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        nbytes += _nbytes(mask)
    return ("flash_attention_backward", flops * 5 // 2, nbytes)


class _FlashBackward(TorchFunctionMode):
    """Under a DeviceClock: F.scaled_dot_product_attention's backward charged as flash attention's (its forward
    stays parallel.device's fused charge), the math decomposition's backward run quietly."""

    def __init__(self, clock: DeviceClock):
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        q, k, v, rest = *args[:3], args[3:]
        if rest:  # positional attn_mask, dropout_p, is_causal: as keywords
            kwargs = {**dict(zip(("attn_mask", "dropout_p", "is_causal"), rest, strict=False)), **kwargs}
        if not any(t.requires_grad for t in (q, k, v)):
            return func(q, k, v, **kwargs)
        cost = flash_backward_cost(q, k, v, kwargs)
        return _ChargedKernel.apply(self.clock, lambda q, k, v: func(q, k, v, **kwargs), [], [cost], q, k, v)


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
            stack.enter_context(_FlashBackward(clock))
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
    """The spec's bytes per layer per rank (specs/linear.md, "Communication per layer per rank"), that cross the
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


def _sp_row(cfg, method, n, p, rank_label, rank, counts, dtype) -> dict:
    """What a bytes row and a timed row share: the point and, per layer and phase, counters and bytes."""
    sp = cfg["sequence_parallel"]
    config = sp_config(cfg, method, p)
    layers = config.num_hidden_layers
    row = {"method": method, "label": SP_METHODS[method]["label"], "layer": "linear" if SP_METHODS[method]["pattern"] == "L"
           else "softmax", "n": n, "p": p, "chunk": n // p, "batch": sp["batch"], "rank": rank_label,
           "rank_index": rank, "layers": layers}  # fmt: skip
    for phase in ("fwd", "bwd"):
        per_layer = {kind: {k: v // layers for k, v in c.items()} for kind, c in counts[phase].items()}
        row[f"{phase}_comm"] = per_layer
        row[f"{phase}_calls"] = sum(c["calls"] for c in per_layer.values())
        row[f"{phase}_counted_bytes"] = sum(c["bytes"] for c in per_layer.values())
        row[f"{phase}_link_bytes"] = sp_link_bytes(per_layer, p)
        row[f"{phase}_link_bytes_formula"] = sp_formula_bytes(config, method, phase, n, p, sp["batch"], dtype)
    row["link_bytes"] = row["fwd_link_bytes"] + row["bwd_link_bytes"]
    row["link_bytes_formula"] = row["fwd_link_bytes_formula"] + row["bwd_link_bytes_formula"]
    return row


def sp_bytes_rows(cfg: dict, dtype: torch.dtype) -> list[dict]:
    """Bytes per layer at every (N, P) of `sequence_parallel.bytes` (and its extra points: the paper's 2048K
    tokens on 64 ranks), counted by comm's counters on one forward + backward on the META device: the real
    code path with no values, so any size costs seconds. Link time per layer on each preset from the clock
    (its compute here is Python time on meta: only the link time is reported)."""
    sp = cfg["sequence_parallel"]
    pairs = [(n, p) for p in sp["bytes"]["sp"] for n in sp["bytes"]["lengths"]]
    pairs += [(e["n"], e["sp"]) for e in sp["bytes"].get("extra_points") or []]
    meta = torch.device("meta")
    rows = []
    try:
        for p in dict.fromkeys(p for _, p in pairs):
            mesh = fake_sp_mesh(p, 0)  # every rank sends and receives the same bytes
            for method in sp["methods"]:
                trunk = build_sp_trunk(cfg, method, p, mesh, meta, dtype)
                for n in sorted({n for n, q in pairs if q == p}):
                    inputs = sp_inputs(trunk, n, p, sp["batch"], cfg["seed"], meta, dtype)
                    run = sp_run_once(trunk, inputs, p, sp["links"][0])
                    row = _sp_row(cfg, method, n, p, "first", 0, run["counts"], dtype)
                    for link in sp["links"]:
                        fwd, total = run["recorder"].replay(link)
                        row[f"link_ms:{link}"] = 1e3 * total["busy"] / row["layers"]
                    rows.append(row)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def sequence_parallel(cfg: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The long-sequence rows of the linear model's sequence parallelism (specs/linear.md): per method of
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
    if predicted(cfg):
        return sequence_parallel_predicted(cfg)
    sp = cfg["sequence_parallel"]
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    points, skipped = sp_timed_points(cfg)
    rows = []
    started = time.perf_counter()
    try:
        for p in sorted({p for _, p in points}):
            for rank_label in sp["ranks"]:
                rank = sp_rank(rank_label, p)
                mesh = fake_sp_mesh(p, rank)
                trunks = {m: build_sp_trunk(cfg, m, p, mesh, device, dtype) for m in sp["methods"]}
                for n in sorted(n for n, q in points if q == p):
                    methods = []
                    for m in sp["methods"]:
                        if SP_METHODS[m]["pattern"] == "N" and sp_attended(n, p, rank) > sp["max_attended"]:
                            skipped.append(
                                f"{m} at N={n}, P={p}, rank {rank_label} ({rank}): it would score "
                                f"{sp_attended(n, p, rank):,} (query, key) pairs, over max_attended={sp['max_attended']:,}."
                            )
                        else:
                            methods.append(m)
                    inputs = {m: sp_inputs(trunks[m], n, p, sp["batch"], cfg["seed"], device, dtype) for m in methods}
                    for m in methods:
                        for _ in range(sp["warmup"]):
                            sp_run_once(trunks[m], inputs[m], p, sp["links"][0], sync)
                    runs = {m: [] for m in methods}
                    for _ in range(sp["repeats"]):
                        for m in methods:
                            runs[m].append(sp_run_once(trunks[m], inputs[m], p, sp["links"][0], sync))
                    for m in methods:
                        rows += _sp_timed_rows(cfg, m, n, p, rank_label, rank, runs[m], dtype)
                    del inputs
                    print(f"[bench] sequence parallel N={n} P={p} rank {rank_label}: {len(methods)} methods "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
                del trunks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"timed": rows, "skipped": skipped}


def sequence_parallel_predicted(cfg: dict) -> dict:
    """The `timed` rows of `sequence_parallel` with a device preset as `compute`: the trunk built on the meta
    device in bfloat16 (SIMULATED_DTYPE) and its inputs there, one forward + backward per (N, P, rank, method)
    recorded under `DeviceClock` (`sp_record`) and replayed on every link preset with the device model's op
    times, plus its `contention` of every overlapped second of communication (as `eval.simulate.Phase.replay`).
    Nothing is computed: one deterministic run per row (no warm-up, no repeats), any N and P (no max_chunk or
    max_attended), the `device_points` included."""
    sp, dtype, meta = cfg["sequence_parallel"], SIMULATED_DTYPE, torch.device("meta")
    dm = device_model(cfg)
    points, skipped = sp_timed_points(cfg)
    rows = []
    started = time.perf_counter()
    try:
        for p in sorted({p for _, p in points}):
            for rank_label in sp["ranks"]:
                rank = sp_rank(rank_label, p)
                mesh = fake_sp_mesh(p, rank)
                trunks = {m: build_sp_trunk(cfg, m, p, mesh, meta, dtype) for m in sp["methods"]}
                for n in sorted(n for n, q in points if q == p):
                    for m in sp["methods"]:
                        inputs = sp_inputs(trunks[m], n, p, sp["batch"], cfg["seed"], meta, dtype)
                        run = sp_record(trunks[m], inputs, p, sp["links"][0], sp.get("device_kernels", "gpu"))
                        run["times"] = run["clock"].times(dm)
                        rows += _sp_timed_rows(cfg, m, n, p, rank_label, rank, [run], dtype, dm)
                    print(f"[bench] sequence parallel (device model {dm.device.name}) N={n} P={p} rank {rank_label} "
                          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
                del trunks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"timed": rows, "skipped": skipped}


def _sp_timed_rows(cfg, method, n, p, rank_label, rank, runs, dtype, dm: DeviceModel | None = None) -> list[dict]:
    """One row per link preset: medians (and min-max) over the repeats of the replayed clock, per layer. With a
    device model `dm` (one recorded run, `sp_record`): its op times, and its contention added to the time."""
    base = _sp_row(cfg, method, n, p, rank_label, rank, runs[-1]["counts"], dtype)
    layers, out = base["layers"], []
    if dm is not None:
        (run,) = runs
        base.update(sp_compute_columns(run["clock"], run["fwd_ops"], run["times"], layers))
    contention = 0.0 if dm is None else dm.contention
    for link in cfg["sequence_parallel"]["links"]:
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


# --- real processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_rank(rank: int, degrees: dict[str, int], archs: list[str], port: int, cfg: dict, out_path: str) -> None:
    """One rank of the real launch: real collectives, then no collectives, in the same processes."""
    world_size = bench_report.ranks(degrees)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    device, dtype = resolve_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    threads = cpu_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    backend = cfg["real"]["backend"]
    try:
        mesh = parallel.init_mesh(**degrees, backend=None if backend == "auto" else backend)
        built = {arch: build_sharded(arch, cfg, degrees, mesh, device, dtype) for arch in archs}
        rows = []
        for batch in cfg["batch_sizes"]:
            with comm.use_mode("real"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, degrees, batch, "real", None, dtype)
            with comm.use_mode("none"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, degrees, batch, "upper_bound_real", None, dtype)
        for row in rows:
            row["threads_per_rank"] = torch.get_num_threads()
            row["backend"] = dist.get_backend()
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_real(cfg: dict, degrees: dict[str, int], archs: list[str]) -> list[dict]:
    """Spawn one process per rank on 127.0.0.1; rank 0's rows come back through a file. A rank's error is
    raised here; ranks still running after real.timeout_s (e.g. a hung collective) are terminated and that
    is an error."""
    p = bench_report.ranks(degrees)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(
            _real_rank, args=(degrees, archs, _free_port(), cfg, out_path), nprocs=p, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + cfg["real"]["timeout_s"]
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                raise TimeoutError(
                    f"The real {bench_report.degrees_label(degrees)} ranks ran past "
                    f"real.timeout_s={cfg['real']['timeout_s']} s."
                )
        return json.loads(Path(out_path).read_text())


# --- decode paths: one device, per architecture and decode-path variant, decode tokens/s and KV bytes ------


def decode_path_variants(cfg: dict, arch: str) -> list:
    """The decode-path variants of `arch` the section measures: `decode_paths.paths[arch]` (values of the
    config field `decode_paths.path_field`), or [None] (the architecture's only path)."""
    return list(((cfg["decode_paths"].get("paths") or {}).get(arch)) or [None])


def decode_path_config(cfg: dict, arch: str, path, shape: dict | None = None):
    """`arch`'s one-device config at the bench shape (or `shape`), on decode path `path` (None: as built)."""
    extra = {} if path is None else {cfg["decode_paths"]["path_field"]: path}
    if shape is None:
        return model_config(cfg, arch, {}, **extra)
    shape = {k: v for k, v in shape.items() if k != "name"}
    overrides = (cfg.get("config_overrides") or {}).get(arch) or {}
    return models.get(arch).bench_config(shape, {}, **{**overrides, **extra})


def kv_bytes_per_token(source, config, dtype: torch.dtype) -> int:
    """KV-cache bytes per token per layer. A model or config that accounts for its own cache says so
    (`kv_bytes_per_token(dtype=...)`: a latent cache is not K and V); otherwise a standard K and V cache:
    2 x KV heads x head_dim values."""
    if hasattr(source, "kv_bytes_per_token"):
        return int(source.kv_bytes_per_token(dtype=dtype))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def check_decode_paths(cfg: dict) -> None:
    dp = cfg.get("decode_paths") or {}
    if not dp.get("enabled"):
        return
    for name in dp.get("paths") or {}:
        if name not in cfg["archs"]:
            raise ValueError(f"decode_paths.paths names {name!r}, which is not in archs={list(cfg['archs'])}.")
    if not dp["q_lens"] or any(not isinstance(q, int) or q < 1 for q in dp["q_lens"]):
        raise ValueError(f"decode_paths.q_lens {dp['q_lens']} must be integers >= 1 (new tokens per decode step).")
    if not dp["batch_sizes"] or any(not isinstance(b, int) or b < 1 for b in dp["batch_sizes"]):
        raise ValueError(f"decode_paths.batch_sizes {dp['batch_sizes']} must be integers >= 1.")
    if dp["steps"] < 1 or dp["repeats"] < 1 or dp["warmup"] < 0:
        raise ValueError("decode_paths needs steps >= 1, repeats >= 1 and warmup >= 0.")
    for arch in cfg["archs"]:
        for path in decode_path_variants(cfg, arch):
            decode_path_config(cfg, arch, path)  # a path the config refuses fails here, before any timing


def build_one_device(cfg: dict, config, arch: str, device: torch.device, dtype: torch.dtype):
    """A random `arch` model on one device (no mesh), the model's own init from the bench seed: every
    path variant of an architecture gets the same weights."""
    torch.manual_seed(cfg["seed"])
    model = models.get(arch).model_class(config).to(device=device, dtype=dtype)
    model.eval()
    return model


@torch.no_grad()
def decode_once(model, prompt: torch.Tensor, steps: torch.Tensor, device: torch.device) -> float:
    """Prefill `prompt` (not timed), then one forward per step of `steps` [batch, n_steps, q_len] with the
    cache: the wall time of the decode steps. The tokens are fixed random ones (a step of q_len > 1 tokens
    is what a draft-verify or multi-token decode feeds; greedy picks only one)."""
    cache = model(prompt, use_cache=True, logits_to_keep=1).cache
    timer = WallTimer(device)
    timer.start()
    for i in range(steps.shape[1]):
        cache = model(steps[:, i], cache=cache, use_cache=True, logits_to_keep=1).cache
    return timer.stop()


def decode_paths(cfg: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """On this one device: decode tokens/s of every architecture of `archs` on each of its decode-path
    variants, per batch size and query length (new tokens per step), timed for real and interleaved over
    repeats; KV bytes per token per layer from the model's own accounting (or 2 x KV heads x head_dim), and
    the same accounting at `decode_paths.accounting_shape` (config only, nothing built)."""
    dp, baseline = cfg["decode_paths"], cfg["baseline"]
    built, rows = {}, []
    for arch in cfg["archs"]:
        for path in decode_path_variants(cfg, arch):
            config = decode_path_config(cfg, arch, path)
            model = build_one_device(cfg, config, arch, device, dtype)
            built[(arch, path)] = model
            rows.append({"arch": arch, "path": path, "kv_bytes_per_token": kv_bytes_per_token(model, config, dtype)})
    kv = {(r["arch"], r["path"]): r["kv_bytes_per_token"] for r in rows}
    base_kv = kv[(baseline, decode_path_variants(cfg, baseline)[0])]
    vocab, timed = cfg["bench_shape"]["vocab_size"], []
    for batch in dp["batch_sizes"]:
        for q_len in dp["q_lens"]:
            gen = torch.Generator().manual_seed(cfg["seed"] + 1000 * batch + q_len)
            prompt = torch.randint(0, vocab, (batch, cfg["prompt_len"]), generator=gen).to(device)
            steps = torch.randint(0, vocab, (batch, dp["steps"], q_len), generator=gen).to(device)
            times = {key: [] for key in built}
            with comm.use_mode("none"):
                for model in built.values():
                    for _ in range(dp["warmup"]):
                        decode_once(model, prompt, steps, device)
                for _ in range(dp["repeats"]):
                    for key, model in built.items():
                        times[key].append(decode_once(model, prompt, steps, device))
            new = batch * q_len * dp["steps"]
            for (arch, path), t in times.items():
                timed.append({
                    "arch": arch, "path": path, "batch": batch, "q_len": q_len, "variant": "measured",
                    "decode_ms_per_step": 1e3 * statistics.median(t) / dp["steps"],
                    "decode_tok_s": new / statistics.median(t), "decode_tok_s_min": new / max(t),
                    "decode_tok_s_max": new / min(t), "kv_bytes_per_token": kv[(arch, path)],
                    "kv_fraction": kv[(arch, path)] / base_kv,
                })  # fmt: skip
    for row in timed:
        base = next(r for r in timed if r["arch"] == baseline and r["batch"] == row["batch"] and r["q_len"] == row["q_len"])
        row["speedup_decode"] = row["decode_tok_s"] / base["decode_tok_s"]
    del built
    accounting = []
    name = dp.get("accounting_shape")
    if name:
        shape = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "bench_shape" / f"{name}.yaml"))
        for arch in cfg["archs"]:
            for path in decode_path_variants(cfg, arch):
                config = decode_path_config(cfg, arch, path, shape)
                accounting.append({"arch": arch, "path": path, "shape": name, "dtype": "bfloat16",
                                   "kv_bytes_per_token": kv_bytes_per_token(config, config, torch.bfloat16)})  # fmt: skip
        base_acc = next(a for a in accounting if a["arch"] == baseline)["kv_bytes_per_token"]
        for a in accounting:
            a["kv_fraction"] = a["kv_bytes_per_token"] / base_acc
    return {"kv": rows, "rows": timed, "accounting": accounting, "dtype": str(dtype).removeprefix("torch.")}


# --- the app ---------------------------------------------------------------------------------


def run_bench(cfg: dict, out_dir: Path, wandb_cfg: dict | None = None, command: str = "") -> dict:
    """Run every variant, write results.json, README.md and PNGs to `out_dir`, log to W&B if asked. The
    process's torch thread count (set for the bench's own timing, `threads`) is put back afterwards, so that
    a caller (the tour, eval.at_scale, a test) computes as before."""
    threads_before = torch.get_num_threads()
    try:
        return _run_bench(cfg, out_dir, wandb_cfg, command)
    finally:
        torch.set_num_threads(threads_before)


def run_bench_overrides(overrides: list[str], out_dir: Path) -> dict:
    """`python -m eval.bench <overrides>` in this process, inside an initialised Hydra (the tour,
    eval.at_scale): conf/bench.yaml composed with `overrides`, run without W&B, written to `out_dir`."""
    from hydra import compose

    plain = OmegaConf.to_container(compose(config_name="bench", overrides=list(overrides)), resolve=False)
    return run_bench(settings_of(plain), out_dir, None, " ".join(["python -m eval.bench", *overrides]))


def settings_of(plain: dict) -> dict:
    """The bench's settings from its composed config: all but the logger, paths and Hydra's own keys."""
    return {k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}


def _run_bench(cfg: dict, out_dir: Path, wandb_cfg: dict | None, command: str) -> dict:
    device, dtype = resolve_device(cfg)
    cfg = resolve_real(cfg, device.type)
    archs_at, skipped = check_settings(cfg)
    for note in skipped:
        print(f"[bench] skipped {note}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = cpu_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    hw = hardware_info(device)
    rows = []
    started = time.perf_counter()
    for degrees in bench_points(cfg):
        if cfg["simulated"]["enabled"] or cfg["upper_bound"]["enabled"]:
            archs = archs_at[bench_report.degrees_key(degrees)]
            rows += run_single_process(cfg, degrees, archs, device, dtype, skipped)
            print(
                f"[bench] {bench_report.degrees_label(degrees)}: simulated / upper bound done "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    for degrees in real_points(cfg):
        p, label = bench_report.ranks(degrees), bench_report.degrees_label(degrees)
        if device.type == "cuda" and torch.cuda.device_count() < p:
            skipped.append(f"real {label}: needs {p} GPUs, this machine has {torch.cuda.device_count()}.")
            continue
        rows += run_real(cfg, degrees, archs_at[bench_report.degrees_key(degrees)])
        print(f"[bench] {label}: real done ({time.perf_counter() - started:.0f} s)", flush=True)
    experts = []
    if (cfg.get("expert_throughput") or {}).get("enabled"):
        experts = expert_throughput(cfg, device, dtype)
        print(f"[bench] expert throughput done ({time.perf_counter() - started:.0f} s)", flush=True)
    sp = {}
    if (cfg.get("sequence_parallel") or {}).get("enabled"):
        # With a device preset, a GPU's dtype throughout (K and V of the softmax layers move in it).
        sp_dtype = SIMULATED_DTYPE if predicted(cfg) else dtype
        sp = {"bytes": sp_bytes_rows(cfg, sp_dtype), **sequence_parallel(cfg, device, sp_dtype)}
        sp["methods"] = {m: SP_METHODS[m] for m in cfg["sequence_parallel"]["methods"]}
        sp["dtype"] = str(sp_dtype).removeprefix("torch.")
        if predicted(cfg):
            kernels = cfg["sequence_parallel"].get("device_kernels", "gpu")
            sp["device_kernels"] = {"setting": kernels, "what": SP_DEVICE_KERNELS[kernels]}
        bench_report.add_sp_comparisons(sp, cfg)
        print(f"[bench] sequence parallel done ({time.perf_counter() - started:.0f} s)", flush=True)
    paths = {}
    if (cfg.get("decode_paths") or {}).get("enabled"):
        paths = decode_paths(cfg, device, dtype)
        print(f"[bench] decode paths done ({time.perf_counter() - started:.0f} s)", flush=True)
    bench_report.add_comparisons(rows, cfg["baseline"], cfg["min_comm_fraction"])
    # The virtual clock counting Python time as compute: a measured-compute artefact only.
    clock_note = None if predicted(cfg) else bench_report.clock_note(rows, cfg["baseline"])
    results = {
        "command": command,
        "settings": cfg,
        "degrees": bench_points(cfg),
        "real_degrees": real_points(cfg),
        "hardware": hw,
        "dtype": str(dtype).removeprefix("torch."),
        "compute": compute_info(cfg),
        "links": [
            {"name": k, "base_us": v.base_s * 1e6, "alpha_us": v.alpha_s * 1e6, "beta_GBps": v.beta_Bps / 1e9, "note": v.note}
            for k, v in LINK_PRESETS.items()
        ],
        "notes": bench_report.notes_for(cfg, device.type, hw, rows) + ([clock_note] if clock_note else []),
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
        "expert_throughput": experts,
        "sequence_parallel": sp,
        "decode_paths": paths,
    }
    images = bench_report.write_files(results, out_dir)
    if wandb_cfg:
        bench_report.log_to_wandb(results, images, out_dir, wandb_cfg)
    return results


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    plain = OmegaConf.to_container(cfg, resolve=False)
    wandb_cfg = None
    if cfg.get("logger") and "wandb" in cfg.logger:
        wandb_cfg = {
            "project": cfg.logger.wandb.get("project", "overlap-zoo"),
            "name": cfg.task_name,
            "tags": list(cfg.get("tags") or []),
        }
    settings = settings_of(plain)
    command = " ".join(["python -m eval.bench", *HydraConfig.get().overrides.task])
    results = run_bench(settings, out_dir, wandb_cfg, command)
    print(f"[bench] {len(results['rows'])} rows -> {out_dir}/README.md, results.json, *.png", flush=True)


if __name__ == "__main__":
    main()
