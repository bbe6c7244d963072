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
in a shared machine's load hits every architecture alike. Per row: prefill ms, decode tokens/s,
communication calls/bytes per forward, exposed communication (simulated), speed-up over the baseline
in the same variant and the hidden fraction (T_base - T_arch) / (T_base - T_upper_bound).
Outputs: results.json, README.md (tables) and PNG plots under the run directory, and a W&B run.
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
from eval import report
from models.common import RMSNorm, SwiGLUMLP
from models.kraken import ZooKrakenConfig
from parallel import comm
from parallel.link import LINK_PRESETS
from parallel.tp import check_divisible

SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


# --- setup ------------------------------------------------------------------------------------


def model_config(cfg: dict, arch: str, tp: int):
    """The config of `arch` at the benchmark shape (for Kraken: k = the TP degree, matched parameters)."""
    kwargs = {k: cfg["bench_shape"][k] for k in SHAPE_FIELDS}
    if arch == "ladder":
        n = cfg["ladder_layers"]
        kwargs["ladder_layers"] = kwargs["num_hidden_layers"] if n is None else n
    if arch == "kraken":
        # Kraken runs one stream per rank, so its degree is the TP degree; its stream width is matched
        # to the llama of this shape's parameter count (models/kraken/configuration.py).
        return ZooKrakenConfig.from_llama(models.ZOO["llama"].config_class(**kwargs), tp)
    return models.ZOO[arch].config_class(**kwargs)


def build_sharded(arch: str, cfg: dict, mesh, device: torch.device, dtype: torch.dtype):
    """A random `arch` model holding only this rank's shards, materialised on `device`.

    Built on the meta device and sharded there, so a rank never allocates the full model (a 70B shape
    at TP 8 fits one GPU's share); weights are then initialised with the model's own init.
    """
    with torch.device("meta"):
        model = models.ZOO[arch].model_class(model_config(cfg, arch, mesh.size(mesh.mesh_dim_names.index("tp"))))
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


def check_shapes(cfg: dict) -> None:
    """Fail before measuring anything if a TP degree does not fit the shape."""
    shape = cfg["bench_shape"]
    sizes = {k: shape[k] for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    for p in sorted(set(cfg["tp"]) | set(cfg["real"]["tp"] if cfg["real"]["enabled"] else [])):
        if not isinstance(p, int) or p < 2:
            raise ValueError(f"TP degree {p!r} in the bench must be an integer >= 2 (TP 1 has no communication).")
        check_divisible(sizes, p)
    for arch in cfg["archs"]:
        models.get(arch)
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


def run_single_process(cfg: dict, p: int, device, dtype) -> list[dict]:
    """Simulated-link and upper-bound rows for TP degree p, one process playing rank 0."""
    rows = []
    mesh = parallel.init_mesh(tp=p, fake=True)
    try:
        built = {arch: build_sharded(arch, cfg, mesh, device, dtype) for arch in cfg["archs"]}
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        for batch in cfg["batch_sizes"]:
            if cfg["simulated"]["enabled"]:
                for link in cfg["simulated"]["links"]:
                    with comm.use_mode("simulated", link=link, world_size=p, sync=sync) as clock:
                        runs = measure_interleaved(built, cfg, batch, lambda c=clock: ClockTimer(c), device)
                    rows += _rows(runs, cfg, p, batch, "simulated", link)
            if cfg["upper_bound"]["enabled"]:
                with comm.use_mode("none"):
                    runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device), device)
                rows += _rows(runs, cfg, p, batch, "upper_bound", None)
        del built
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


def _rows(runs, cfg, p, batch, variant, link) -> list[dict]:
    out = []
    for arch, arch_runs in runs.items():
        row = {"arch": arch, "tp": p, "variant": variant, "link": link, "batch": batch}
        row.update(summarize(arch_runs, batch, cfg["new_tokens"]))
        out.append(row)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_rank(rank: int, world_size: int, port: int, cfg: dict, out_path: str) -> None:
    """One rank of the real launch: real collectives, then no collectives, in the same processes."""
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
        mesh = parallel.init_mesh(tp=world_size, backend=None if backend == "auto" else backend)
        built = {arch: build_sharded(arch, cfg, mesh, device, dtype) for arch in cfg["archs"]}
        rows = []
        for batch in cfg["batch_sizes"]:
            with comm.use_mode("real"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, world_size, batch, "real", None)
            with comm.use_mode("none"):
                runs = measure_interleaved(built, cfg, batch, lambda: WallTimer(device, barrier=True), device)
            rows += _rows(runs, cfg, world_size, batch, "upper_bound_real", None)
        for row in rows:
            row["threads_per_rank"] = torch.get_num_threads()
            row["backend"] = dist.get_backend()
        if rank == 0:
            report.write_json(out_path, rows)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_real(cfg: dict, p: int) -> list[dict]:
    """Spawn p ranks on 127.0.0.1; rank 0's rows come back through a file. A rank's error is raised here;
    ranks still running after real.timeout_s (e.g. a hung collective) are terminated and that is an error."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(
            _real_rank, args=(p, _free_port(), cfg, out_path), nprocs=p, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + cfg["real"]["timeout_s"]
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                raise TimeoutError(f"The real TP {p} ranks ran past real.timeout_s={cfg['real']['timeout_s']} s.")
        return json.loads(Path(out_path).read_text())


# --- derived numbers --------------------------------------------------------------------------


def hidden_fraction(t_base: float, t_arch: float, t_upper: float, min_comm_fraction: float = 0.01) -> float | None:
    """(T_base - T_arch) / (T_base - T_upper): the share of the baseline's communication overhead that
    the architecture removes. None when the baseline has (almost) no overhead to hide: a denominator
    below `min_comm_fraction` of T_base is noise, not communication."""
    gap = t_base - t_upper
    if gap <= min_comm_fraction * t_base:
        return None
    return (t_base - t_arch) / gap


UPPER_BOUND_OF = {"simulated": "upper_bound", "real": "upper_bound_real"}


def add_comparisons(rows: list[dict], baseline: str, min_comm_fraction: float) -> None:
    """Speed-up over the baseline arch in the same variant, and hidden fractions, added in place."""
    index = {(r["arch"], r["tp"], r["variant"], r["link"], r["batch"]): r for r in rows}
    for r in rows:
        base = index.get((baseline, r["tp"], r["variant"], r["link"], r["batch"]))
        r["speedup_prefill"] = base["prefill_ms"] / r["prefill_ms"] if base else None
        r["speedup_decode"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r["hidden_fraction_prefill"] = r["hidden_fraction_decode"] = None
        r["exposed_hidden_fraction_decode"] = None
        upper = index.get((baseline, r["tp"], UPPER_BOUND_OF.get(r["variant"]), None, r["batch"]))
        if base is None or upper is None or r["arch"] == baseline:
            continue
        r["hidden_fraction_prefill"] = hidden_fraction(
            base["prefill_ms"], r["prefill_ms"], upper["prefill_ms"], min_comm_fraction
        )
        r["hidden_fraction_decode"] = hidden_fraction(
            base["decode_ms_per_step"], r["decode_ms_per_step"], upper["decode_ms_per_step"], min_comm_fraction
        )
        # Simulated only: the same question asked of the virtual clock's exposed communication, which
        # does not depend on compute-time noise between architectures.
        if r.get("decode_exposed_ms") is not None and base.get("decode_exposed_ms"):
            r["exposed_hidden_fraction_decode"] = 1 - r["decode_exposed_ms"] / base["decode_exposed_ms"]


# --- reports ----------------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("arch", "arch"),
    ("tp", "TP"),
    ("batch", "batch"),
    ("prefill_ms", "prefill ms"),
    ("prefill_spread", "prefill min-max"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_spread", "decode tok/s min-max"),
    ("speedup_decode", "decode speed-up"),
    ("speedup_prefill", "prefill speed-up"),
    ("hidden_fraction_decode", "hidden (decode)"),
    ("hidden_fraction_prefill", "hidden (prefill)"),
    ("decode_comm_calls", "calls/step"),
    ("decode_comm_bytes", "bytes/step"),
    ("prefill_comm_bytes", "bytes/prefill"),
]
SIMULATED_COLUMNS = [
    ("decode_exposed_ms", "exposed ms/step"),
    ("decode_comm_busy_ms", "link busy ms/step"),
    ("decode_exposed_share", "exposed / link busy"),
    ("exposed_hidden_fraction_decode", "hidden (exposed, decode)"),
]


def variant_key(row: dict) -> str:
    return f"{row['variant']}:{row['link']}" if row["link"] else row["variant"]


def _display(rows: list[dict]) -> list[dict]:
    shown = []
    for r in rows:
        d = dict(r)
        d["prefill_spread"] = f"{r['prefill_ms_min']:.4g}-{r['prefill_ms_max']:.4g}"
        d["decode_spread"] = f"{r['decode_tok_s_min']:.4g}-{r['decode_tok_s_max']:.4g}"
        shown.append(d)
    return shown


def make_plots(rows: list[dict], cfg: dict, out_dir: Path) -> dict[str, Path]:
    """Decode speed-up vs batch and vs TP degree, hidden fraction per architecture vs batch; one panel per
    variant (upper-bound variants are the reference, not plotted)."""
    variants = [v for v in dict.fromkeys(variant_key(r) for r in rows) if not v.startswith("upper_bound")]
    archs = [a for a in cfg["archs"] if a != cfg["baseline"]]

    def panels(key, x_axis, only=None):
        out = {}
        for v in variants:
            if only and not v.startswith(only):
                continue
            sel = [r for r in rows if variant_key(r) == v]
            tps, batches = sorted({r["tp"] for r in sel}), sorted({r["batch"] for r in sel})
            if x_axis == "batch":
                out[v] = {f"{a} TP{p}": (batches, [_pick(sel, a, p, b, key) for b in batches]) for a in archs for p in tps}
            else:
                out[v] = {f"{a} b{b}": (tps, [_pick(sel, a, p, b, key) for p in tps]) for a in archs for b in batches}
        return out

    base = cfg["baseline"]
    plots = {
        "speedup_vs_batch": (panels("speedup_decode", "batch"), "batch size", f"decode speed-up over {base}"),
        "speedup_vs_tp": (panels("speedup_decode", "tp"), "TP degree", f"decode speed-up over {base}"),
        "hidden_fraction": (
            panels("hidden_fraction_decode", "batch"),
            "batch size",
            f"hidden fraction (decode) vs {base}",
        ),
        "hidden_fraction_exposed": (
            panels("exposed_hidden_fraction_decode", "batch", only="simulated"),
            "batch size",
            "hidden fraction of exposed comm (decode)",
        ),
    }
    images = {}
    for name, (data, xlabel, ylabel) in plots.items():
        if data:
            images[name] = report.plot_lines(
                out_dir / f"{name}.png", data, xlabel=xlabel, ylabel=ylabel, hline=1.0, logx=True
            )
    return images


def _pick(rows, arch, tp, batch, key):
    for r in rows:
        if r["arch"] == arch and r["tp"] == tp and r["batch"] == batch:
            return r.get(key)
    return None


def write_readme(results: dict, images: dict[str, Path], out_dir: Path) -> Path:
    cfg, hw, rows = results["settings"], results["hardware"], results["rows"]
    lines = [
        f"# Speed benchmark: {cfg['bench_shape']['name']} shape",
        "",
        f"`{results['command'] or 'eval.bench.run_bench(...)'}`",
        "",
        f"Architectures {', '.join(cfg['archs'])} (baseline `{cfg['baseline']}`), TP {cfg['tp']}, "
        f"batch {cfg['batch_sizes']}, prompt {cfg['prompt_len']} tokens, {cfg['new_tokens']} generated "
        f"({cfg['new_tokens'] - 1} decode steps), {cfg['warmup']} warm-up + {cfg['repeats']} timed repeats "
        f"(median, min-max), dtype {results['dtype']}, compile={cfg['compile']}.",
        "",
        f"Hardware: {hw.get('gpu', hw['cpu'])} ({hw['cpu_cores']} CPU cores, load average "
        f"{hw['load_average_1m']:.2f} at start), torch {hw['torch']}, transformers {hw['transformers']}.",
        "",
        "- **decode tok/s** = batch x decode steps / decode time; **prefill ms** = time to first token.",
        f"- **speed-up** = the architecture over `{cfg['baseline']}` in the same variant, TP and batch.",
        "- **hidden** = (T_base - T_arch) / (T_base - T_upper_bound), T = prefill time or time per decode "
        f"step, T_upper_bound = `{cfg['baseline']}` without collectives (`upper_bound` for simulated rows, "
        "`upper_bound_real` for real rows); n/a when T_base - T_upper_bound is below "
        f"{cfg['min_comm_fraction']:.0%} of T_base.",
        "- **hidden (exposed)** (simulated only) = 1 - exposed_arch / exposed_base on the virtual clock: "
        "the same question without compute-time noise between architectures.",
        "- **exposed / link busy** (simulated only): the share of the link's time that was not covered by compute. "
        f"`{cfg['baseline']}` waits every all-reduce at once, so its share should be 1: a lower value is Python "
        "time between issuing a collective and waiting for it that the virtual clock counted as compute.",
        "- Communication counts are per forward (prefill) and per decode step, summed over collective kinds.",
        "",
    ]
    for note in results["notes"]:
        lines.append(f"> {note}")
        lines.append("")
    for v in dict.fromkeys(variant_key(r) for r in rows):
        sel = [r for r in rows if variant_key(r) == v]
        cols = TABLE_COLUMNS + (SIMULATED_COLUMNS if v.startswith("simulated") else [])
        lines += [f"## {v}", "", report.write_markdown_table(_display(sel), cols)]
    lines += ["## Link presets", ""]
    lines.append(
        report.write_markdown_table(
            results["links"], [("name", "preset"), ("alpha_us", "alpha us/hop"), ("beta_GBps", "beta GB/s"), "note"]
        )
    )
    for name, path in images.items():
        lines += [f"![{name}]({path.name})", ""]
    if results["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s}" for s in results["skipped"]] + [""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path


def notes_for(cfg: dict, device: torch.device, hw: dict) -> list[str]:
    notes = [
        "Simulated rows time one rank's real compute on this machine plus the link model's communication; "
        "they show what each schedule hides on that link, not what this machine would do with P devices."
    ]
    if cfg["real"]["enabled"] and device.type == "cpu" and cfg["real"]["tp"]:
        p, cores, threads = max(cfg["real"]["tp"]), hw["cpu_cores"], hw["torch_threads"]
        if cores < p * (threads + 1):
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores. "
                "gloo's communication thread has no free core here, so an asynchronous all-reduce cannot run "
                "while the next sub-block computes: these rows measure gloo's cost on this box, not what an "
                "architecture can hide, and claim nothing about overlap."
            )
        else:
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores, "
                "leaving a core per rank for gloo's communication thread; gloo on CPU is still no model of NCCL."
            )
    if hw["load_average_1m"] > 0.5 * hw["cpu_cores"]:
        notes.append(
            f"The machine was shared (load average {hw['load_average_1m']:.2f} on {hw['cpu_cores']} cores at "
            "the start): timings are noisy; compare the min-max spreads before reading small differences."
        )
    return notes


def clock_note(rows: list[dict], baseline: str) -> str | None:
    """A warning when the virtual clock let the baseline hide communication it waits for at once."""
    shares = [
        r["decode_exposed_share"]
        for r in rows
        if r["arch"] == baseline and r["variant"] == "simulated" and r.get("decode_exposed_share") is not None
    ]
    if not shares or min(shares) >= 0.9:
        return None
    return (
        f"On the virtual clock `{baseline}` left only {min(shares):.0%}-{max(shares):.0%} of its link time exposed "
        "(decode), though it waits for every all-reduce at once (should be 100%): the clock counted the Python "
        "time between issuing a collective and waiting for it as compute, which covers short transfers. The "
        "simulated rows understate the baseline's communication cost, so their speed-ups and hidden fractions "
        "are too small (or n/a)."
    )


def run_bench(cfg: dict, out_dir: Path, wandb_cfg: dict | None = None, command: str = "") -> dict:
    """Run every variant, write results.json, README.md and PNGs to `out_dir`, log to W&B if asked."""
    device, dtype = resolve_device(cfg)
    # real.tp auto: TP 2 only on CPU (every rank needs cores of its own), every TP degree on GPUs.
    if cfg["real"]["tp"] == "auto":
        cfg = {**cfg, "real": {**cfg["real"], "tp": [2] if device.type == "cpu" else list(cfg["tp"])}}
    check_shapes(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = cpu_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    hw = hardware_info(device)
    rows, skipped = [], []
    started = time.perf_counter()
    for p in cfg["tp"]:
        if cfg["simulated"]["enabled"] or cfg["upper_bound"]["enabled"]:
            rows += run_single_process(cfg, p, device, dtype)
            print(f"[bench] TP {p}: simulated / upper bound done ({time.perf_counter() - started:.0f} s)", flush=True)
    if cfg["real"]["enabled"]:
        for p in cfg["real"]["tp"]:
            if device.type == "cuda" and torch.cuda.device_count() < p:
                skipped.append(f"real TP {p}: needs {p} GPUs, this machine has {torch.cuda.device_count()}.")
                continue
            rows += run_real(cfg, p)
            print(f"[bench] TP {p}: real done ({time.perf_counter() - started:.0f} s)", flush=True)
    add_comparisons(rows, cfg["baseline"], cfg["min_comm_fraction"])
    results = {
        "command": command,
        "settings": cfg,
        "hardware": hw,
        "dtype": str(dtype).removeprefix("torch."),
        "links": [
            {"name": k, "alpha_us": v.alpha_s * 1e6, "beta_GBps": v.beta_Bps / 1e9, "note": v.note}
            for k, v in LINK_PRESETS.items()
        ],
        "notes": notes_for(cfg, device, hw) + [n for n in [clock_note(rows, cfg["baseline"])] if n],
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
    }
    report.write_json(out_dir / "results.json", results)
    images = make_plots(rows, cfg, out_dir)
    write_readme(results, images, out_dir)
    if wandb_cfg:
        columns = [k for k, _ in TABLE_COLUMNS + SIMULATED_COLUMNS if k not in ("prefill_spread", "decode_spread")]
        columns = ["variant", "link"] + columns
        summary = {}
        for r in rows:
            key = f"{r['arch']}/tp{r['tp']}/{variant_key(r)}/b{r['batch']}"
            for m in ("decode_tok_s", "prefill_ms", "speedup_decode", "hidden_fraction_decode"):
                summary[f"{key}/{m}"] = r[m]
        report.log_to_wandb(
            out_dir,
            project=wandb_cfg.get("project", "overlap-zoo"),
            name=wandb_cfg.get("name", "bench"),
            tags=wandb_cfg.get("tags") or [],
            config={k: v for k, v in results.items() if k in ("settings", "hardware", "dtype", "links")},
            summary=summary,
            tables={"bench/results": (columns, rows)},
            images={f"bench/{k}": v for k, v in images.items()},
        )
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
