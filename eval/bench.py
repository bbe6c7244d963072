"""Speed benchmark of the zoo's architectures under tensor parallelism: `python -m eval.bench`.

Random weights at a given shape (`conf/bench_shape/`), greedy generation from a random prompt:
prefill (time to first token) and the decode loop are timed separately after warm-up, the device
synchronised at each boundary, median and min/max over repeats (gpt-fast's benchmark loop). Each
architecture and TP degree is measured in one run in three ways (DESIGN.md, "Measuring speed
honestly"):

- `simulated`: this process plays rank 0 of a P-way fake process group, holds only its shards and
  computes for real; collectives go on the virtual link of `parallel.link` (one row per preset) and
  the reported time is that virtual clock;
- `upper_bound`: the same rank-0 compute with every collective skipped (comm mode `none`);
- `real`: P spawned processes with real collectives (gloo on CPU, nccl on GPU, 127.0.0.1); the same
  processes also time `upper_bound_real` (all ranks running, no collectives), its own upper bound.

Repeats are interleaved across architectures (repeat r of every arch before repeat r+1) so slow drift
in a shared machine's load hits every architecture alike. Per row (one architecture at one set of mesh
degrees, `{"tp": 2}`, one variant and batch size): prefill ms, decode tokens/s, communication
calls/bytes per forward, exposed communication (simulated). `eval.bench_report` adds the speed-up over
the baseline and the hidden fraction (T_base - T_arch) / (T_base - T_upper_bound) and writes
results.json, README.md (tables) and PNG plots under the run directory, and a W&B run.

Nothing here names an architecture: how the bench shape becomes an architecture's config
(`bench_config`) and which degrees fit it (`check_layout`) come from its registry entry
(models/<name>/entry.py and sharding.py).
"""

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from omegaconf import DictConfig, OmegaConf

import models
import parallel
from eval import bench_report
from models.common import RMSNorm, SwiGLUMLP
from parallel import comm
from parallel.link import LINK_PRESETS

# --- setup ------------------------------------------------------------------------------------


def degree_points(tps) -> list[dict[str, int]]:
    """The mesh degrees measured: one {"tp": P} per TP degree of the settings."""
    return [{"tp": p} for p in tps]


def model_config(cfg: dict, arch: str, degrees: dict[str, int]):
    """The config of `arch` at the bench shape and `degrees`, as its own folder builds it (its registry
    entry's `bench_config`), with `config_overrides[arch]` on top."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    overrides = (cfg.get("config_overrides") or {}).get(arch) or {}
    return models.get(arch).bench_config(shape, degrees, **overrides)


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


def check_settings(cfg: dict) -> None:
    """Fail before measuring anything if an architecture cannot be built at the shape and every degree
    measured (each architecture's own `check_layout`), or a setting is out of range."""
    tps = sorted(set(cfg["tp"]) | set(cfg["real"]["tp"] if cfg["real"]["enabled"] else []))
    for p in tps:
        if isinstance(p, bool) or not isinstance(p, int) or p < 2:
            raise ValueError(f"TP degree {p!r} in the bench must be an integer >= 2 (TP 1 has no communication).")
    for name in cfg.get("config_overrides") or {}:
        if name not in cfg["archs"]:
            raise ValueError(f"config_overrides names {name!r}, which is not in archs={list(cfg['archs'])}.")
    for arch in cfg["archs"]:
        entry = models.get(arch)
        if entry.bench_config is None:
            raise ValueError(
                f"Architecture {arch!r} declares no bench_config (models/<name>/entry.py, passed to "
                "models.register), so the bench cannot build it at a shape; leave it out of archs."
            )
        for degrees in degree_points(tps):
            entry.check_layout(model_config(cfg, arch, degrees), degrees)
    if cfg["baseline"] not in cfg["archs"]:
        raise ValueError(f"baseline={cfg['baseline']!r} must be one of archs={list(cfg['archs'])}.")
    if cfg["new_tokens"] < 2:
        raise ValueError(f"new_tokens={cfg['new_tokens']} leaves no decode step; use at least 2.")
    if cfg["repeats"] < 1:
        raise ValueError(f"repeats={cfg['repeats']} must be at least 1.")
    for link in cfg["simulated"]["links"]:
        if link not in LINK_PRESETS:
            raise ValueError(f"Unknown link preset {link!r}; choose from {sorted(LINK_PRESETS)}.")


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
    """Threads per process: `auto` = one rank's share of the cores when the largest P ranks share them."""
    if cfg["threads"] != "auto":
        return int(cfg["threads"]) if cfg["threads"] else None
    ranks = max([*cfg["tp"], *(cfg["real"]["tp"] if cfg["real"]["enabled"] else [])])
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

    exposed = comm_busy = None

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
        return t


@torch.no_grad()
def generate_once(model, ids: torch.Tensor, new_tokens: int, timer) -> dict:
    """Prefill then new_tokens - 1 greedy decode steps; times, exposed comm and comm counts of each phase."""
    comm.reset_counters()
    timer.start()
    out = model(ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = {"time": timer.stop(), "exposed": timer.exposed, "comm_busy": timer.comm_busy}
    prefill["counts"] = comm.snapshot_counters()
    comm.reset_counters()
    cache = out.cache
    timer.start()
    for _ in range(new_tokens - 1):
        out = model(token, cache=cache, use_cache=True)
        cache = out.cache
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    decode = {"time": timer.stop(), "exposed": timer.exposed, "comm_busy": timer.comm_busy}
    decode["counts"] = comm.snapshot_counters()
    return {"prefill": prefill, "decode": decode}


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
    # Per-forward names: prefill is one forward, decode figures are per step (one forward each).
    return row


# --- the variants -----------------------------------------------------------------------------


def run_single_process(cfg: dict, degrees: dict[str, int], device, dtype) -> list[dict]:
    """Simulated-link and upper-bound rows at `degrees`, one process playing rank 0."""
    rows = []
    p = bench_report.ranks(degrees)
    mesh = parallel.init_mesh(**degrees, fake=True)
    try:
        built = {arch: build_sharded(arch, cfg, degrees, mesh, device, dtype) for arch in cfg["archs"]}
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        for batch in cfg["batch_sizes"]:
            if cfg["simulated"]["enabled"]:
                for link in cfg["simulated"]["links"]:
                    with comm.use_mode("simulated", link=link, world_size=p, sync=sync) as clock:
                        runs = measure_interleaved(built, cfg, batch, lambda c=clock: ClockTimer(c), device)
                    rows += _rows(runs, cfg, degrees, batch, "simulated", link)
            if cfg["upper_bound"]["enabled"]:
                with comm.use_mode("none"):
                    runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device), device)
                rows += _rows(runs, cfg, degrees, batch, "upper_bound", None)
        del built
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def _rows(runs, cfg, degrees, batch, variant, link) -> list[dict]:
    out = []
    for arch, arch_runs in runs.items():
        row = {"arch": arch, "degrees": dict(degrees), "variant": variant, "link": link, "batch": batch}
        row.update(summarize(arch_runs, batch, cfg["new_tokens"]))
        out.append(row)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_rank(rank: int, degrees: dict[str, int], port: int, cfg: dict, out_path: str) -> None:
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
        built = {arch: build_sharded(arch, cfg, degrees, mesh, device, dtype) for arch in cfg["archs"]}
        rows = []
        for batch in cfg["batch_sizes"]:
            with comm.use_mode("real"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, degrees, batch, "real", None)
            with comm.use_mode("none"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, degrees, batch, "upper_bound_real", None)
        for row in rows:
            row["threads_per_rank"] = torch.get_num_threads()
            row["backend"] = dist.get_backend()
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_real(cfg: dict, degrees: dict[str, int]) -> list[dict]:
    """Spawn one process per rank on 127.0.0.1; rank 0's rows come back through a file. A rank's error is
    raised here; ranks still running after real.timeout_s (e.g. a hung collective) are terminated and that
    is an error."""
    p = bench_report.ranks(degrees)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(
            _real_rank, args=(degrees, _free_port(), cfg, out_path), nprocs=p, join=False, start_method="spawn"
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


# --- the app ---------------------------------------------------------------------------------


def run_bench(cfg: dict, out_dir: Path, wandb_cfg: dict | None = None, command: str = "") -> dict:
    """Run every variant, write results.json, README.md and PNGs to `out_dir`, log to W&B if asked."""
    device, dtype = resolve_device(cfg)
    # real.tp auto: TP 2 only on CPU (every rank needs cores of its own), every TP degree on GPUs.
    if cfg["real"]["tp"] == "auto":
        cfg = {**cfg, "real": {**cfg["real"], "tp": [2] if device.type == "cpu" else list(cfg["tp"])}}
    check_settings(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = cpu_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    hw = hardware_info(device)
    rows, skipped = [], []
    started = time.perf_counter()
    for degrees in degree_points(cfg["tp"]):
        if cfg["simulated"]["enabled"] or cfg["upper_bound"]["enabled"]:
            rows += run_single_process(cfg, degrees, device, dtype)
            print(
                f"[bench] {bench_report.degrees_label(degrees)}: simulated / upper bound done "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    if cfg["real"]["enabled"]:
        for degrees in degree_points(cfg["real"]["tp"]):
            p, label = bench_report.ranks(degrees), bench_report.degrees_label(degrees)
            if device.type == "cuda" and torch.cuda.device_count() < p:
                skipped.append(f"real {label}: needs {p} GPUs, this machine has {torch.cuda.device_count()}.")
                continue
            rows += run_real(cfg, degrees)
            print(f"[bench] {label}: real done ({time.perf_counter() - started:.0f} s)", flush=True)
    bench_report.add_comparisons(rows, cfg["baseline"], cfg["min_comm_fraction"])
    clock_note = bench_report.clock_note(rows, cfg["baseline"])
    results = {
        "command": command,
        "settings": cfg,
        "degrees": degree_points(cfg["tp"]),
        "hardware": hw,
        "dtype": str(dtype).removeprefix("torch."),
        "links": [
            {"name": k, "alpha_us": v.alpha_s * 1e6, "beta_GBps": v.beta_Bps / 1e9, "note": v.note}
            for k, v in LINK_PRESETS.items()
        ],
        "notes": bench_report.notes_for(cfg, device.type, hw) + ([clock_note] if clock_note else []),
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
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
    settings = {k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}
    command = " ".join(["python -m eval.bench", *HydraConfig.get().overrides.task])
    results = run_bench(settings, out_dir, wandb_cfg, command)
    print(f"[bench] {len(results['rows'])} rows -> {out_dir}/README.md, results.json, *.png", flush=True)


if __name__ == "__main__":
    main()
