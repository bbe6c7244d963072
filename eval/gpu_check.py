"""The prepared GPU check (issue 18, item 7): one script, one GPU, about six minutes, a Markdown + JSON report.

    python -m eval.gpu_check [--out reports/gpu-check-h200] [--quick] [--budget 420]
    python -m eval.gpu_check --device cpu --quick            # the same code path on a CPU, tiny shape (tests)

What it measures, on ONE GPU (bf16, comm mode `none`: the GPU holds one rank's shards and skips every
collective, so this is the per-rank compute the device model predicts):

1. Decode-step latency of rank 0's shard of each architecture (llama, ladder, kraken, moe, scmoe, gqla on its
   gqa and its absorb path) at the Llama 3 8B and 70B bench shapes at TP 8 (conf/bench_shape/): the model
   built on the meta device, sharded on a fake 8-way process group and materialised (eval.bench.generation's
   `build_sharded`), a prompt of 128 tokens into the architecture's own static cache
   (`model.model.make_cache(..., static=True)`, prompt + warm-up + timed steps), then (a) eager
   `eval.bench.steps.decode_step` and (b) the same step compiled by `compile_steps(mode="reduce-overhead")`
   (inductor, fullgraph, CUDA graphs), each the median over repeats of the mean of N steps (the cache is reset
   and re-filled by an eager prefill before each repeat, so every timed step fits). Beside them the device
   model's prediction of the same step (`eval.simulator.replay.record_generation` on the same config and cache
   length, replayed with `DeviceModel` on the `h200` preset, conf/bench.yaml's `device_model` constants, and
   free communication), and measured / predicted. Layouts: TP 8 for the dense family; the MoE family (moe,
   scmoe) at EP 8 (their tp layouts split attention only and keep every expert whole on each rank: at the 70B
   shape 8 experts of a 28672-wide MLP per layer would not fit one GPU, and EP 8 is what eval.at_scale
   predicts), with `model.set_moe_dispatch("padded")` (host-known all-to-all sizes: the dispatch a compiled
   step needs) where the model has it; gqla's absorb path runs unsharded only, so its rows are the tp=1 model of
   the same shape (the whole model on one GPU). A model whose rank-0 weights would not fit `--mem-frac` of the
   GPU's memory (the 70B shape's MoE at EP 8 and unsharded absorb path: about 140 GB) runs with fewer layers,
   and its prediction is made at the same layer count (the row says how many). Eager rows at batch 1 and 8
   (`--batches`); the compiled step at batch 1 for every row the time budget allows (llama and ladder first:
   the device model's calibration anchors), then batch 8.
2. fla's chunk kernel (`models.linear.ops.linear_attention_fla`, fla-core's `chunk_simple_gla`) against the
   zoo's chunked kernel (`linear_attention_chunked`) at B=1, H=16, T=8192, D=128, bf16, a per-head decay:
   forward time of each and the largest absolute difference of their outputs (fla may not be installed: the
   report says so).
3. The environment: torch, CUDA, GPU, driver, fla / triton versions, the NCCL environment variables set.

Each measurement runs in its own try/except: one failure is recorded in the report and the run goes on. A time
guard (`--budget` seconds, default 420, from the start) skips what would not finish in time and lists it: a
compiled row whose compile (estimated from the compiles so far) would overrun is run with fewer layers where at
least 4 fit, else skipped. The report (README.md + results.json in `--out`) is rewritten after every
measurement, so a run killed at its limit leaves everything measured so far. The device model's recordings run
on the CPU in worker processes (`--workers`) while the GPU measures.
"""

import argparse
import difflib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHS = ("llama", "ladder", "kraken", "moe", "scmoe", "gqla")
ANCHORS = ("llama", "ladder")  # compiled first: the device model is fitted on the Ladder paper's table
MIN_LAYERS = 4  # a compiled row with fewer layers than this is skipped rather than run
PREDICT_DEVICE = "h200"  # eval.simulator.device.DEVICES; h100-sxm where a checkout lacks it


@dataclass
class Settings:
    device: str
    dtype: torch.dtype
    shapes: list
    archs: list
    degree: int
    batches: list
    compiled_batches: list
    prompt_len: int
    eager_steps: int
    compiled_steps: int
    warmup: int
    compile_calls: int
    repeats: int
    backend: str
    mode: str | None
    budget_s: float
    mem_frac: float
    workers: int
    kernel: dict
    compile_prior: tuple  # (a, b): a compile of an L-layer step takes a + b L seconds, before any is measured

    @property
    def capacity(self) -> int:
        """Tokens of every static cache: prompt + the most steps one sequence takes, rounded up to 8 (as
        record_generation rounds prompt + new_tokens)."""
        steps = max(self.warmup + self.eager_steps, self.warmup + self.compiled_steps, self.compile_calls)
        return -(-(self.prompt_len + steps) // 8) * 8

    @property
    def new_tokens(self) -> int:
        """record_generation's new_tokens whose cache is `capacity` long (the decode step's cost on a static
        cache depends on its length, not on its fill level)."""
        return self.capacity - self.prompt_len


@dataclass
class Item:
    """One model: an architecture (path) at a bench shape, as rank 0 of its layout."""

    shape: str
    arch: str
    label: str
    degrees: dict  # the mesh rank 0 plays; {} = unsharded
    overrides: dict
    layers_full: int
    layers: int = 0  # after the memory cap
    params_gb: float | None = None  # rank-0 weights at `layers`
    notes: list = field(default_factory=list)

    @property
    def layout(self) -> str:
        if not self.degrees:
            return "unsharded (tp=1)"
        return ",".join(f"{k}={v}" for k, v in sorted(self.degrees.items())) + " rank 0"


# --- settings ------------------------------------------------------------------------------------


def load_shape(name: str) -> dict:
    shape = yaml.safe_load((ROOT / "conf" / "bench_shape" / f"{name}.yaml").read_text())
    shape.pop("name", None)
    return shape


def device_model_constants() -> dict:
    return dict(yaml.safe_load((ROOT / "conf" / "bench.yaml").read_text())["device_model"])


def check_names(archs: list[str], shapes: list[str]) -> None:
    """Unknown architectures or bench shapes are refused before anything is measured (exit status 1)."""
    import models

    unknown = [a for a in archs if a not in models.ZOO]
    if unknown:
        near = {a: difflib.get_close_matches(a, list(models.ZOO), n=1) for a in unknown}
        hint = "".join(f" ({a}: did you mean {near[a][0]}?)" for a in unknown if near[a])
        raise SystemExit(
            f"Error: --archs names unknown architecture{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}{hint}; the zoo has {', '.join(sorted(models.ZOO))}."
        )
    known = sorted(p.stem for p in (ROOT / "conf" / "bench_shape").glob("*.yaml"))
    unknown = [sh for sh in shapes if sh not in known]
    if unknown:
        raise SystemExit(
            f"Error: --shapes names unknown bench shape{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; the shapes are {', '.join(known)} (conf/bench_shape/)."
        )


def predict_device() -> str:
    from eval.simulator.device import DEVICES

    return PREDICT_DEVICE if PREDICT_DEVICE in DEVICES else "h100-sxm"


def parse_args(argv=None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(prog="python -m eval.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports/gpu-check-h200", help="report folder (README.md, results.json)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="replace a report already in --out (without it, a folder that holds one is refused)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shape, llama and moe, few steps: a smoke run")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--budget", type=float, default=420.0, help="seconds; what would run past it is skipped")
    p.add_argument(
        "--archs", default=None, help="comma-separated (default: llama,ladder,kraken,moe,scmoe,gqla)"
    )
    p.add_argument("--shapes", default=None, help="bench shapes (default: llama3-8b,llama3-70b; quick: tiny)")
    p.add_argument(
        "--degree", type=int, default=None, help="TP (EP for the MoE family) degree rank 0 plays (8)"
    )
    p.add_argument("--batches", default=None, help="eager batch sizes (default 1,8; quick: 1)")
    p.add_argument("--compiled-batches", default=None, help="compiled batch sizes, in order (default 1,8)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (128; quick: 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median reported (3; quick: 2)")
    p.add_argument(
        "--backend", default="inductor", help="compile backend (inductor; aot_eager for fast tests)"
    )
    p.add_argument(
        "--mem-frac", type=float, default=0.6, help="largest share of GPU memory one model's weights take"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="CPU processes recording predictions (GPU: 3; CPU: 0)"
    )
    args = p.parse_args(argv)

    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"Error: --device {args.device}: CUDA is not available (torch {torch.__version__}); use --device cpu."
        )
    cuda = name.startswith("cuda")
    quick = args.quick

    def ints(text, default):
        try:
            values = [int(x) for x in text.split(",")] if text else list(default)
        except ValueError:
            raise SystemExit(f"Error: {text!r} is not a comma-separated list of integers (e.g. 1,8).") from None
        if any(v < 1 for v in values):
            raise SystemExit(f"Error: batch sizes {text!r}: each must be a positive integer (e.g. 1,8).")
        return values

    shapes = args.shapes.split(",") if args.shapes else (["tiny"] if quick else ["llama3-8b", "llama3-70b"])
    archs = args.archs.split(",") if args.archs else (["llama", "moe"] if quick else list(DEFAULT_ARCHS))
    check_names(archs, shapes)
    batches = ints(args.batches, [1] if quick else [1, 8])
    settings = Settings(
        device=name,
        dtype=torch.bfloat16 if cuda else torch.float32,  # bf16 matmuls are slow on most CPUs
        shapes=shapes,
        archs=archs,
        degree=args.degree or (2 if quick else 8),
        batches=batches,
        compiled_batches=ints(args.compiled_batches, [1] if quick else [1, 8]),
        prompt_len=args.prompt or (16 if quick else 128),
        eager_steps=4 if quick else 10,
        compiled_steps=4 if quick else 50,
        warmup=1 if quick else 2,
        compile_calls=2 if quick else 3,  # CUDA graphs: 1 compiles (and warms up), 2 records, 3 replays
        repeats=args.repeats or (2 if quick else 3),
        backend=args.backend,
        mode="reduce-overhead" if cuda else None,  # no CUDA graphs on a CPU
        budget_s=args.budget,
        mem_frac=args.mem_frac,
        workers=args.workers if args.workers is not None else (3 if cuda else 0),
        kernel=dict(B=1, H=2, T=256, D=32) if quick or not cuda else dict(B=1, H=16, T=8192, D=128),
        compile_prior=(15.0, 2.0) if cuda else (5.0, 10.0),
    )
    return args, settings


# --- models --------------------------------------------------------------------------------------


def plan_items(s: Settings) -> list[Item]:
    """Every (shape, architecture path) measured, in order: the 8B shape first."""
    items = []
    for shape in s.shapes:
        layers = load_shape(shape)["num_hidden_layers"]
        for arch in s.archs:
            import models

            entry = models.get(arch)
            if arch == "gqla":
                items.append(Item(shape, arch, "gqla (gqa)", {"tp": s.degree}, {}, layers))
                items.append(
                    Item(shape, arch, "gqla (absorb)", {}, {"attn_path": "absorb"}, layers,
                         notes=["absorb runs unsharded only: the tp=1 model of the same shape, whole on one device"])
                )  # fmt: skip
            elif "ep" in entry.degrees:
                items.append(
                    Item(shape, arch, arch, {"ep": s.degree}, {}, layers,
                         notes=[f"EP {s.degree} (its tp layout keeps every expert whole on each rank)"])
                )  # fmt: skip
            else:
                items.append(Item(shape, arch, arch, {"tp": s.degree}, {}, layers))
    return items


def item_config(item: Item, layers: int):
    from eval.bench.settings import model_config

    shape = {**load_shape(item.shape), "num_hidden_layers": layers}
    cfg = {"bench_shape": shape, "config_overrides": {item.arch: dict(item.overrides)}}
    return model_config(cfg, item.arch, item.degrees)


def set_dispatch(model) -> str | None:
    """The MoE family's host-sync-free dispatch where the model has it; what runs (None: not an MoE model)."""
    if hasattr(model, "set_moe_dispatch"):
        model.set_moe_dispatch("padded")
        return "padded"
    if getattr(model.config, "num_local_experts", None):
        return "dropless (no set_moe_dispatch in this checkout)"
    return None


def build_meta_model(item: Item, layers: int):
    """Rank 0's shards on the meta device (the fake process group stays up: release() takes it down). An
    unsharded item gets a fake 8-way group too, never used by the model: record_generation's simulated mode
    plays rank 0 of at least 2 ranks."""
    import models
    import parallel
    from eval.simulator.replay import build_meta

    config = item_config(item, layers)
    if item.degrees:
        model = build_meta(item.arch, config, item.degrees)
    else:
        parallel.init_mesh(tp=8, fake=True)
        with torch.device("meta"):
            model = models.get(item.arch).model_class(config)
        model.to(torch.bfloat16).eval()
    set_dispatch(model)
    return model


def size_items(items: list[Item], s: Settings, errors: list) -> None:
    """Rank-0 weight bytes (bf16) of each item from its meta model; layers cut (to an even count) where the
    weights would pass --mem-frac of the GPU's memory."""
    from eval.simulator.replay import release

    budget = None
    if s.device.startswith("cuda"):
        budget = s.mem_frac * torch.cuda.get_device_properties(torch.device(s.device)).total_memory
    for item in items:
        item.layers = item.layers_full
        try:
            model = build_meta_model(item, item.layers_full)
            total = sum(p.numel() for p in model.parameters()) * 2
            in_layers = sum(p.numel() for p in model.model.layers.parameters()) * 2
        except Exception as err:  # noqa: BLE001 - reported, the item runs (and fails) later
            errors.append(_error(f"{item.shape} {item.label}: sizing", err))
            continue
        finally:
            model = None
            release()
        per_layer = in_layers / item.layers_full
        if budget is not None and total > budget:
            fit = int((budget - (total - in_layers)) // per_layer) // 2 * 2
            item.layers = max(2, fit)
            item.notes.append(
                f"{item.layers} of {item.layers_full} layers: rank 0's {total / 1e9:.0f} GB of weights pass "
                f"{s.mem_frac:.0%} of the GPU's memory; predicted at the same layer count"
            )
        item.params_gb = (total - in_layers + per_layer * item.layers) / 1e9


def build_model(item: Item, layers: int, device: torch.device, dtype: torch.dtype):
    """Rank 0's shards materialised on `device` (eval.bench.generation.build_sharded; an unsharded item the
    same way without a mesh), random weights from the model's own init, the MoE dispatch set."""
    import models
    import parallel
    from eval.bench.generation import build_sharded
    from eval.simulator.replay import release

    release()
    if item.degrees:
        shape = {**load_shape(item.shape), "num_hidden_layers": layers}
        cfg = {
            "bench_shape": shape,
            "config_overrides": {item.arch: dict(item.overrides)},
            "seed": 0,
            "compile": False,
        }
        mesh = parallel.init_mesh(**item.degrees, fake=True)
        model = build_sharded(item.arch, cfg, item.degrees, mesh, device, dtype)
    else:
        with torch.device("meta"):
            model = models.get(item.arch).model_class(item_config(item, layers))
        model.to(dtype)
        model.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(model._init_weights)
        model.eval()
    return model, set_dispatch(model)


def free(device: torch.device) -> None:
    from eval.simulator.replay import release

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    release()


# --- predictions (CPU; worker processes on a GPU machine) ---------------------------------------------


def _worker_init() -> None:
    torch.set_num_threads(1)


def predict(spec: dict) -> dict:
    """The device model's prefill and decode step of one item (`spec`: plain values, picklable)."""
    from eval.simulator.device import DeviceModel
    from eval.simulator.replay import NO_COMM, record_generation, release

    start = time.perf_counter()
    item = Item(**spec["item"])
    try:
        model = build_meta_model(item, spec["layers"])
        recording = record_generation(model, spec["batch"], spec["prompt_len"], spec["new_tokens"], True)
    finally:
        model = None
        release()
    dm = DeviceModel.from_config(spec["device"], **spec["constants"])
    out = recording.predict(dm, NO_COMM)
    dec, pre = out["decode"], out["prefill"]
    return {
        "device": spec["device"],
        "decode_ms": dec["time"] * 1e3,
        "prefill_ms": pre["time"] * 1e3,
        "decode_kernels": dec["kernels"],
        "decode_gb": dec["bytes"] / 1e9,
        "decode_gflop": dec["flops"] / 1e9,
        "record_s": time.perf_counter() - start,
    }


class Predictions:
    """Recordings keyed by (shape, label, batch, layers): in a process pool, or in this process (workers 0)."""

    def __init__(self, s: Settings):
        self.s, self.futures, self.done, self.errors = s, {}, {}, {}
        self.device, self.constants = predict_device(), device_model_constants()
        self.pool = None
        if s.workers > 0:
            import multiprocessing

            try:
                self.pool = ProcessPoolExecutor(
                    s.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
                )
            except Exception as err:  # noqa: BLE001 - in-process then
                print(f"[gpu_check] no prediction workers ({err}); predicting in this process", flush=True)

    def spec(self, item: Item, batch: int, layers: int) -> dict:
        return {
            "item": asdict(item), "layers": layers, "batch": batch, "prompt_len": self.s.prompt_len,
            "new_tokens": self.s.new_tokens, "device": self.device, "constants": self.constants,
        }  # fmt: skip

    def submit(self, item: Item, batch: int, layers: int) -> None:
        key = (item.shape, item.label, batch, layers)
        if key in self.futures or key in self.done or key in self.errors:
            return
        spec = self.spec(item, batch, layers)
        if self.pool is not None:
            try:
                self.futures[key] = (self.pool.submit(predict, spec), spec)
                return
            except Exception:  # noqa: BLE001 - a broken pool: in this process from here on
                self.pool = None
        self._run_here(key, spec)

    def _run_here(self, key, spec) -> None:
        try:
            self.done[key] = predict(spec)
        except Exception as err:  # noqa: BLE001 - reported
            self.errors[key] = _error(f"{key[0]} {key[1]} batch {key[2]} layers {key[3]}: prediction", err)

    def collect(self, wait_s: float = 0.0) -> None:
        """Take the finished recordings (waiting up to `wait_s` for the rest); a recording whose worker died
        (a broken pool) is made in this process."""
        deadline = time.monotonic() + wait_s
        for key, (fut, spec) in list(self.futures.items()):
            remaining = deadline - time.monotonic()
            if not fut.done() and remaining <= 0:
                continue
            try:
                self.done[key] = fut.result(timeout=max(0.0, remaining))
            except TimeoutError:
                continue
            except BrokenExecutor:
                self.pool = None
                self._run_here(key, spec)
            except Exception as err:  # noqa: BLE001 - reported
                self.errors[key] = _error(
                    f"{key[0]} {key[1]} batch {key[2]} layers {key[3]}: prediction", err
                )
            del self.futures[key]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


# --- timing --------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generation(model, step_fn, batch: int, s: Settings, steps: int, device, compiled: bool) -> dict:
    """Per repeat: the static cache reset, an eager prefill of the prompt, `warmup` steps, then `steps` timed
    decode steps (mean); the median over repeats. The step's token is cloned before it goes back in (gpt-fast's
    loop: a CUDA graph's output buffer is rewritten by its next replay)."""
    from eval.bench.steps import prefill

    cache = model.model.make_cache(batch_size=batch, max_cache_len=s.capacity, static=True)
    prompt = torch.randint(0, model.config.vocab_size, (batch, s.prompt_len), device=device)

    def step(token):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return step_fn(model, token, cache)[0].clone()

    out = {"step_ms_runs": [], "prefill_ms_runs": []}
    if compiled:  # compile (first call), then CUDA graphs' warm-up and recording
        cache.reset()
        token = prefill(model, prompt, cache)[0]
        calls = []
        for _ in range(s.compile_calls):
            _sync(device)
            t = time.perf_counter()
            token = step(token)
            _sync(device)
            calls.append(time.perf_counter() - t)
        out["compile_s"], out["warmup_calls_s"] = calls[0], calls
    for _ in range(s.repeats):
        cache.reset()
        _sync(device)
        t = time.perf_counter()
        token = prefill(model, prompt, cache)[0]
        _sync(device)
        out["prefill_ms_runs"].append((time.perf_counter() - t) * 1e3)
        for _ in range(s.warmup):
            token = step(token)
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            token = step(token)
        _sync(device)
        out["step_ms_runs"].append((time.perf_counter() - t) * 1e3 / steps)
    out["step_ms"] = statistics.median(out["step_ms_runs"])
    out["prefill_ms"] = statistics.median(out["prefill_ms_runs"])
    return out


# --- the fla kernel check ------------------------------------------------------------------------------


def kernel_check(s: Settings, device: torch.device) -> dict:
    """fla's chunk kernel and the zoo's chunked kernel, forward only, on the same bf16 inputs."""
    from models.linear.ops import linear_attention_chunked

    b, h, t, d = (s.kernel[k] for k in "BHTD")
    dtype = torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(device, dtype) for _ in range(3))
    q = q * d**-0.5
    log_decay = torch.log1p(-(2.0 ** (-5.0 - torch.arange(h, dtype=torch.float32) * 5.0 / h))).to(device)
    out = {"shape": dict(B=b, H=h, T=t, D=d), "dtype": "bfloat16", "layout": "[B, H, T, D]", "decay": "per head",
           "kernels": {}}  # fmt: skip

    def timed(fn, reps):
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        first = time.perf_counter() - t0
        runs = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            runs.append((time.perf_counter() - t0) * 1e3)
        return result, {"first_call_s": first, "forward_ms": statistics.median(runs), "forward_ms_runs": runs}

    reps = 10 if device.type == "cuda" else 2
    with torch.no_grad():
        (zoo_o, zoo_state), zoo = timed(lambda: linear_attention_chunked(q, k, v, log_decay), reps)
        out["kernels"]["zoo linear_attention_chunked (chunk 64)"] = zoo
        if importlib.util.find_spec("fla") is None:
            out["fla"] = "fla not installed"
        elif device.type != "cuda":
            out["fla"] = "not run: fla's Triton kernels need a CUDA GPU"
        else:
            from models.linear.ops import linear_attention_fla

            try:
                (fla_o, fla_state), fla = timed(lambda: linear_attention_fla(q, k, v, log_decay), reps)
            except Exception as err:  # noqa: BLE001 - reported
                out["fla"] = f"fla failed: {type(err).__name__}: {str(err)[:300]}"
            else:
                diff = (fla_o.float() - zoo_o.float()).abs().max().item()
                scale = zoo_o.float().abs().max().item()
                fla["max_abs_diff_vs_zoo"] = diff
                fla["max_abs_zoo_output"] = scale
                fla["state_max_abs_diff_vs_zoo"] = (fla_state.float() - zoo_state.float()).abs().max().item()
                fla["speedup_over_zoo"] = zoo["forward_ms"] / fla["forward_ms"]
                out["kernels"]["fla chunk_simple_gla (linear_attention_fla)"] = fla
                out["fla"] = f"fla {_version('fla-core') or _version('flash-linear-attention') or '?'}"
    return out


# --- environment -------------------------------------------------------------------------------------


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "triton": _version("triton") or _version("pytorch-triton"),
        "fla": _version("fla-core") or _version("flash-linear-attention") or "not installed",
        "transformers": _version("transformers"),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "device": str(device),
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_"))},
    }
    env["nccl_env_set"] = bool(env["nccl_env"])
    if device.type == "cuda":
        try:
            props = torch.cuda.get_device_properties(device)
            env.update(
                gpu=props.name,
                gpu_memory_gib=props.total_memory / 2**30,
                sm_count=props.multi_processor_count,
                compute_capability=f"{props.major}.{props.minor}",
                gpu_count=torch.cuda.device_count(),
                cudnn=torch.backends.cudnn.version(),
            )
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            env["cuda_info_error"] = f"{type(err).__name__}: {err}"
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=15,
            ).stdout.strip()  # fmt: skip
        except Exception as err:  # noqa: BLE001 - optional
            env["nvidia_smi"] = f"unavailable ({type(err).__name__})"
    return env


# --- the report ----------------------------------------------------------------------------------------


def _error(what: str, err: BaseException) -> dict:
    tb = traceback.format_exception(type(err), err, err.__traceback__)
    print(f"[gpu_check] FAILED {what}: {type(err).__name__}: {err}", flush=True)
    return {
        "what": what,
        "error": f"{type(err).__name__}: {str(err)[:500]}",
        "traceback": "".join(tb)[-3000:],
    }


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


class Report:
    def __init__(self, out: Path, s: Settings, argv: list[str]):
        self.out, self.s, self.argv = out, s, argv
        self.start = time.monotonic()
        self.started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.env, self.kernel, self.rows, self.items = {}, None, {}, []
        self.errors, self.skipped, self.notes = [], [], []
        self.finished = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def row(self, item: Item, batch: int, layers: int) -> dict:
        key = (item.shape, item.label, batch, layers)
        if key not in self.rows:
            self.rows[key] = {
                "shape": item.shape, "arch": item.arch, "label": item.label, "layout": item.layout,
                "degrees": dict(item.degrees), "batch": batch, "layers": layers, "layers_full": item.layers_full,
                "params_gb": item.params_gb if layers == item.layers else None, "dispatch": None,
                "eager": None, "compiled": None, "predicted": None, "notes": list(item.notes),
            }  # fmt: skip
        return self.rows[key]

    def merge_predictions(self, preds: Predictions) -> None:
        for key, row in self.rows.items():
            if key in preds.done:
                row["predicted"] = preds.done[key]
            elif key in preds.errors:
                row["predicted"] = {"error": preds.errors[key]["error"]}
        for err in preds.errors.values():
            if err not in self.errors:
                self.errors.append(err)

    def _derive(self, row: dict) -> None:
        pred = row.get("predicted") or {}
        for mode in ("eager", "compiled"):
            m = row.get(mode) or {}
            ok = "step_ms" in m and "decode_ms" in pred
            row[f"{mode}_over_predicted"] = m["step_ms"] / pred["decode_ms"] if ok else None
        e = row.get("eager") or {}
        row["eager_prefill_over_predicted"] = (
            e["prefill_ms"] / pred["prefill_ms"] if "prefill_ms" in e and "prefill_ms" in pred else None
        )
        c = row.get("compiled") or {}
        row["compiled_GBps"] = (
            pred["decode_gb"] / c["step_ms"] * 1e3 if "step_ms" in c and "decode_gb" in pred else None
        )

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rows = list(self.rows.values())
        for row in rows:
            self._derive(row)
        s = self.s
        data = {
            "command": "python -m eval.gpu_check " + " ".join(self.argv),
            "started_at": self.started_at,
            "elapsed_s": self.elapsed(),
            "finished": self.finished,
            "settings": {
                **{k: v for k, v in asdict(s).items() if k != "dtype"},
                "dtype": str(s.dtype).removeprefix("torch."),
                "cache_tokens": s.capacity,
                "predicted_new_tokens": s.new_tokens,
                "predict_device": predict_device(),
                "device_model": device_model_constants(),
            },  # fmt: skip
            "environment": self.env,
            "rows": rows,
            "kernel": self.kernel,
            "skipped": self.skipped,
            "errors": self.errors,
            "notes": self.notes,
        }
        (self.out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (self.out / "README.md").write_text(self.markdown(data))

    def markdown(self, data: dict) -> str:
        s, env = self.s, self.env
        dm = data["settings"]["device_model"]
        lines = [
            "# GPU check: measured per-rank decode steps beside the device model",
            "",
            f"`{data['command']}` (eval/gpu_check.py), started {data['started_at']}, "
            f"{data['elapsed_s']:.0f} s{'' if data['finished'] else ' so far (not finished: the report is rewritten as it runs)'}.",
            "",
            f"Device: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, "
            f"triton {env.get('triton')}, fla {env.get('fla')}; NCCL env vars "
            f"{'set: ' + ', '.join(env['nccl_env']) if env.get('nccl_env') else 'not set'}. Everything in results.json.",
            "",
            f"Each row: rank 0's shard on one device, {str(s.dtype).removeprefix('torch.')}, comm mode `none` (every "
            f"collective skipped: the per-rank compute), prompt {s.prompt_len} into the architecture's static cache of "
            f"{s.capacity} tokens; decode step = median over {s.repeats} repeats of the mean of {s.eager_steps} (eager) / "
            f"{s.compiled_steps} (compiled: `compile_steps(mode={s.mode!r})`, backend {s.backend}) steps after "
            f"{s.warmup} warm-up steps, the cache reset and re-filled by an eager prefill before each repeat. "
            f"Predicted: `record_generation` (same config, same cache length) replayed on the `{predict_device()}` "
            f"device model with free communication (eff_hbm {dm['eff_hbm']}, eff_flops {dm['eff_flops']}, "
            f"{dm['kernel_overhead_us']} us per kernel: conf/bench.yaml). Ratios are measured / predicted; GB/s "
            "compiled = the predicted step's bytes over the measured compiled step; layers `N of M`: a model cut "
            "to fit the GPU's memory or the time budget (its prediction at N too); graphs: the compiled decode "
            "step's graphs (1: no recompile); cudagraph skips: inductor's count of graphs run without CUDA graphs.",
            "",
        ]
        for batch in sorted({r["batch"] for r in data["rows"]}):
            lines += [
                f"## Decode step, batch {batch} (ms)",
                "",
                "| shape | architecture | layout | layers | MoE dispatch | eager | compiled | predicted | eager / pred "
                "| compiled / pred | compile s | graphs | cudagraph skips | GB/s compiled |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in data["rows"]:
                if r["batch"] != batch:
                    continue
                e, c, p = r.get("eager") or {}, r.get("compiled") or {}, r.get("predicted") or {}
                layers = f"{r['layers']}" + (
                    "" if r["layers"] == r["layers_full"] else f" of {r['layers_full']}"
                )
                lines.append(
                    f"| {r['shape']} | {r['label']} | {r['layout']} | {layers} | {r['dispatch'] or '-'} "
                    f"| {_fmt(e.get('step_ms'))} | {_fmt(c.get('step_ms'), 3) if c.get('step_ms') else c.get('status', '-')} "
                    f"| {_fmt(p.get('decode_ms'))} | {_fmt(r['eager_over_predicted'])} | {_fmt(r['compiled_over_predicted'])} "
                    f"| {_fmt(c.get('compile_s'))} | {_fmt(c.get('graphs'))} | {_fmt(c.get('cudagraph_skips'))} "
                    f"| {_fmt(r['compiled_GBps'])} |"
                )
            lines.append("")
        lines += [
            "## Prefill (eager) beside the predicted prefill (ms)",
            "",
            "| shape | architecture | batch | layers | eager prefill | predicted | eager / pred |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["rows"]:
            e, p = r.get("eager") or {}, r.get("predicted") or {}
            if e.get("prefill_ms") is not None or p.get("prefill_ms") is not None:
                lines.append(
                    f"| {r['shape']} | {r['label']} | {r['batch']} | {r['layers']} | {_fmt(e.get('prefill_ms'))} "
                    f"| {_fmt(p.get('prefill_ms'))} | {_fmt(r['eager_prefill_over_predicted'])} |"
                )
        lines += ["", "## Linear attention: fla's chunk kernel vs the zoo's chunked kernel", ""]
        k = data["kernel"]
        if not k:
            lines.append("Not run.")
        elif "error" in k:
            lines.append(f"Failed: {k['error']}")
        else:
            shape = ", ".join(f"{a}={b}" for a, b in k["shape"].items())
            lines += [
                f"{shape}, {k['dtype']}, layout {k['layout']}, {k['decay']} decay; forward only. fla: {k.get('fla')}.",
                "",
                "| kernel | first call s | forward ms (median) | max abs diff vs zoo | max abs zoo output | speed-up |",
                "|---|---|---|---|---|---|",
            ]
            for name, m in k["kernels"].items():
                lines.append(
                    f"| {name} | {_fmt(m['first_call_s'])} | {_fmt(m['forward_ms'])} | {_fmt(m.get('max_abs_diff_vs_zoo'))} "
                    f"| {_fmt(m.get('max_abs_zoo_output'))} | {_fmt(m.get('speedup_over_zoo'))} |"
                )
        notes = sorted({n for r in data["rows"] for n in r["notes"]} | set(data["notes"]))
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes] if notes else []
        lines += ["", "## Skipped", ""] + ([f"- {x}" for x in data["skipped"]] or ["Nothing."])
        lines += ["", "## Errors", ""]
        lines += [f"- {e['what']}: `{e['error']}` (traceback in results.json)" for e in data["errors"]] or [
            "None."
        ]
        return "\n".join(lines) + "\n"


# --- the run -----------------------------------------------------------------------------------------


def run_eager(item: Item, layers: int, batches, s, device, report: Report) -> None:
    """Build the item, time eager decode (and prefill) at every batch size, free it."""
    from eval.bench.steps import decode_step
    from parallel import comm

    model = None
    try:
        model, dispatch = build_model(item, layers, device, s.dtype)
        with comm.use_mode("none"):
            for batch in batches:
                row = report.row(item, batch, layers)
                row["dispatch"] = dispatch
                try:
                    row["eager"] = time_generation(
                        model, decode_step, batch, s, s.eager_steps, device, compiled=False
                    )
                    print(f"[gpu_check] {report.elapsed():6.0f}s eager {item.shape} {item.label} b{batch} L{layers}: "
                          f"{row['eager']['step_ms']:.3f} ms", flush=True)  # fmt: skip
                except Exception as err:  # noqa: BLE001 - reported, the run goes on
                    row["eager"] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    report.errors.append(_error(f"{item.shape} {item.label} batch {batch}: eager", err))
    except Exception as err:  # noqa: BLE001 - reported
        for batch in batches:
            report.row(item, batch, layers)["eager"] = {
                "error": f"build: {type(err).__name__}: {str(err)[:300]}"
            }
        report.errors.append(_error(f"{item.shape} {item.label}: build (eager)", err))
    finally:
        model = None
        free(device)


def run_compiled(item: Item, layers: int, batch: int, s, device, report: Report, eager_too: bool) -> None:
    """Build the item, compile its decode step and time it (and eager too, for a row at a reduced layer
    count): the row's `compiled` (`error` on failure)."""
    from eval.bench.steps import compile_steps, decode_step
    from parallel import comm

    row = report.row(item, batch, layers)
    model = None
    try:
        model, dispatch = build_model(item, layers, device, s.dtype)
        row["dispatch"] = dispatch
        with comm.use_mode("none"):
            if eager_too:
                row["eager"] = time_generation(
                    model, decode_step, batch, s, s.eager_steps, device, compiled=False
                )
            torch._dynamo.reset()
            counters = torch._dynamo.utils.counters
            counters.clear()
            _, step_fn, graphs = compile_steps(mode=s.mode, backend=s.backend)
            result = time_generation(model, step_fn, batch, s, s.compiled_steps, device, compiled=True)
            result.update(
                graphs=len(graphs["decode"].graphs),
                cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)),
                graph_breaks=int(sum(counters["graph_break"].values())),
                backend=s.backend,
                mode=s.mode,
            )
            row["compiled"] = result
            print(f"[gpu_check] {report.elapsed():6.0f}s compiled {item.shape} {item.label} b{batch} L{layers}: "
                  f"{result['step_ms']:.3f} ms (compile {result['compile_s']:.0f} s)", flush=True)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - reported, the run goes on
        row["compiled"] = {"error": f"{type(err).__name__}: {str(err)[:300]}", "status": "failed"}
        report.errors.append(_error(f"{item.shape} {item.label} batch {batch}: compiled", err))
    finally:
        model = None
        free(device)


class CompileClock:
    """Seconds a compile of an L-layer decode step takes, a + b L, fitted to the compiles so far (a prior
    before the first; with one, a is at most half of it)."""

    def __init__(self, a: float, b: float):
        self.prior, self.obs = (a, b), []

    def add(self, layers: int, seconds: float) -> None:
        self.obs.append((layers, seconds))

    def coeffs(self) -> tuple[float, float]:
        if not self.obs:
            return self.prior
        xs, ys = zip(*self.obs, strict=True)
        if len(set(xs)) == 1:
            t = statistics.mean(ys)
            a = min(self.prior[0], t / 2)
            return a, (t - a) / xs[0]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        b = sum((x - mx) * (y - my) for x, y in self.obs) / sum((x - mx) ** 2 for x in xs)
        b = max(b, 0.05 * my / mx)
        return max(0.0, my - b * mx), b

    def need(self, layers: int) -> float:
        a, b = self.coeffs()
        return 1.15 * (a + b * layers)


def compiled_queue(items: list[Item], batches: list[int]) -> list[tuple]:
    """What phase 2 runs, in order, each (kind, item, batch, policy): llama at the first shape (the device
    model's calibration anchor, and the compile that sizes the others; policy "max": every layer the budget
    allows), the fla kernel check, then every other item at the first batch size ("fair": an equal share of
    the time left, so every architecture gets a compiled row, at fewer layers if need be): llama at the other
    shapes, the rest, ladder at the larger shapes last (in comm mode none it computes what llama does); then
    the other batch sizes ("max")."""
    if not items or not batches:
        return [("kernel", None, None, None)]
    first = items[0].shape
    lead = [i for i in items if i.arch == ANCHORS[0] and i.shape == first] or items[:1]
    rest = [i for i in items if all(i is not x for x in lead)]
    rest = (
        [i for i in rest if i.arch == ANCHORS[0]]
        + [i for i in rest if i.arch != ANCHORS[0] and (i.arch not in ANCHORS or i.shape == first)]
        + [i for i in rest if i.arch in ANCHORS[1:] and i.shape != first]
    )
    b1, more = batches[0], batches[1:]
    queue = [("compiled", i, b1, "max") for i in lead] + [("kernel", None, None, None)]
    queue += [("compiled", i, b1, "fair") for i in rest]
    queue += [("compiled", i, b, "max") for b in more for i in lead + rest]
    return queue


def choose_layers(item: Item, batch: int, policy: str, fair_left: int, s: Settings, clock: CompileClock,
                  report: Report) -> tuple[int | None, float]:  # fmt: skip
    """The layers to compile `item` with (None: none fit) and the estimated seconds at the full count."""
    eager = report.rows.get((item.shape, item.label, batch, item.layers), {}).get("eager") or {}
    step_s, prefill_s = eager.get("step_ms", 50.0) * 1e-3, eager.get("prefill_ms", 100.0) * 1e-3

    def need(layers: int) -> float:
        share = layers / item.layers
        t = clock.need(layers) + 5.0 + (item.params_gb or 0) * share * 0.05  # compile, build and free
        t += share * s.repeats * (prefill_s + (s.warmup + s.compiled_steps) * step_s * 0.5)  # compiled runs
        if layers != item.layers:  # its own eager row too
            t += share * s.repeats * (prefill_s + (s.warmup + s.eager_steps) * step_s)
        return t

    remaining = s.budget_s - report.elapsed()
    allowance = remaining
    if policy == "fair":
        allowance = min(remaining, max(remaining / max(1, fair_left), need(min(MIN_LAYERS, item.layers))))
    if need(item.layers) <= allowance:
        return item.layers, need(item.layers)
    for layers in range((item.layers - 1) // 2 * 2, MIN_LAYERS - 1, -2):
        if need(layers) <= allowance:
            return layers, need(item.layers)
    return None, need(item.layers)


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, s = parse_args(argv)
    # the one rule for every command that writes a report: never replace one unasked
    from train.cli import OutputExistsError, refuse_existing_output

    try:
        refuse_existing_output(args.out, args.overwrite, flag="--overwrite", other="--out <dir>")
    except OutputExistsError as error:
        raise SystemExit(f"Error: {error}") from None
    device = torch.device(s.device)
    report = Report(Path(args.out), s, argv)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: more threads than free cores stall every parallel region
    preds = None
    try:
        report.env = environment(device)
        report.write()
        items = plan_items(s)
        size_items(items, s, report.errors)
        report.items = items
        preds = Predictions(s)
        for item in items:
            for batch in s.batches:
                preds.submit(item, batch, item.layers)
                report.row(item, batch, item.layers)
        report.merge_predictions(preds)
        report.write()

        # 1. Eager, every item and batch size (cheap, so first: every row gets a measured number).
        for item in items:
            if report.elapsed() > s.budget_s:
                report.skipped.append(
                    f"eager {item.shape} {item.label} (batches {s.batches}): at {report.elapsed():.0f} s, past the "
                    f"{s.budget_s:.0f} s budget"
                )
                continue
            run_eager(item, item.layers, s.batches, s, device, report)
            preds.collect()
            report.merge_predictions(preds)
            report.write()

        # 2. Compiled (CUDA graphs on a GPU) and the fla kernel check, as compiled_queue orders them.
        clock = CompileClock(*s.compile_prior)
        queue = compiled_queue(items, s.compiled_batches)
        for n, (kind, item, batch, policy) in enumerate(queue):
            if kind == "kernel":
                if report.elapsed() + (20.0 if device.type == "cuda" else 0.0) > s.budget_s:
                    report.skipped.append(
                        f"fla / zoo kernel check: at {report.elapsed():.0f} s, near the budget"
                    )
                    continue
                try:
                    report.kernel = kernel_check(s, device)
                except Exception as err:  # noqa: BLE001 - reported
                    report.kernel = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    report.errors.append(_error("kernel check", err))
                finally:
                    free(device)
                report.write()
                continue
            what = f"compiled {item.shape} {item.label} batch {batch}"
            fair_left = sum(1 for q in queue[n:] if q[3] == "fair")
            layers, need = choose_layers(item, batch, policy, fair_left, s, clock, report)
            if layers is None:
                report.skipped.append(
                    f"{what}: about {need:.0f} s needed, {max(0.0, s.budget_s - report.elapsed()):.0f} s left of "
                    f"the {s.budget_s:.0f} s budget (not even {MIN_LAYERS} layers fit its share)"
                )
                row = report.row(item, batch, item.layers)
                row["compiled"] = row["compiled"] or {"status": "skipped (time)"}
                report.write()
                continue
            if layers != item.layers:
                report.notes.append(
                    f"{what}: compiled with {layers} of {item.layers_full} layers ({item.layers} were estimated at "
                    f"{need:.0f} s, past its share of the time budget); its eager and predicted numbers at {layers} too"
                )
                preds.submit(item, batch, layers)
            run_compiled(item, layers, batch, s, device, report, eager_too=layers != item.layers)
            compiled = report.row(item, batch, layers).get("compiled") or {}
            if "compile_s" in compiled:
                clock.add(layers, compiled["compile_s"])
            preds.collect()
            report.merge_predictions(preds)
            report.write()

        preds.collect(wait_s=max(30.0, s.budget_s + 60.0 - report.elapsed()))
        for key in list(preds.futures):
            report.skipped.append(
                f"prediction {key[0]} {key[1]} batch {key[2]} layers {key[3]}: not finished in time"
            )
        report.merge_predictions(preds)
        report.finished = True
    except Exception as err:  # noqa: BLE001 - the report says what happened
        report.errors.append(_error("gpu_check", err))
    finally:
        if preds is not None:
            preds.close()
        torch.set_num_threads(threads)
        report.write()
    print(f"[gpu_check] done in {report.elapsed():.0f} s: {report.out / 'README.md'}", flush=True)
    return report.out


if __name__ == "__main__":
    main()
