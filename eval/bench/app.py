"""The bench app (`python -m eval.bench`: eval/bench/__main__.py): its checks, its sections in turn, results.json.

`run_bench` reads the settings once into typed settings and checks them first (`checked_settings`:
eval.bench.settings.read_settings, then each other section's own checks), then hands each section that is on its
own settings: generation over the degree points (eval.bench.generation), expert
throughput (eval.bench.moe), sequence parallelism (eval.bench.sp), decode paths (eval.bench.decode_paths),
training steps (eval.bench.training); it
adds the comparisons, writes results.json, README.md and the plots (eval.bench.report) and logs to W&B if asked.
The schema of results.json is the keys of `results` below.
"""

import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eval.bench import report
from eval.bench.decode_paths import check_decode_paths, decode_paths
from eval.bench.degrees import degrees_key, degrees_label, ranks
from eval.bench.generation import archs_at_all_points, run_real, run_single_process
from eval.bench.generation_report import add_comparisons, clock_note, notes_for
from eval.bench.machine import hardware_info
from eval.bench.moe import check_expert_throughput, expert_throughput
from eval.bench.settings import SIMULATED_DTYPE, BenchSettings, read_settings
from eval.bench.sp import (
    SP_DEVICE_KERNELS,
    check_sequence_parallel,
    sequence_parallel,
    sp_bytes_rows,
)
from eval.bench.sp_report import add_sp_comparisons
from eval.bench.training import check_training, training_rows
from eval.simulator.sp_methods import SP_ALGORITHMS
from parallel.link import LINK_PRESETS


def rows_written(results: dict) -> str:
    """What the bench measured, section by section, for its last line: "12 generation rows, 40 sequence-parallel
    rows (24 timed, 16 bytes)", not the generation rows alone (0 in `bench_preset=sp`)."""
    sp = results.get("sequence_parallel") or {}
    timed, counted = len(sp.get("timed") or []), len(sp.get("bytes") or [])
    parts = [
        (len(results.get("rows") or []), "generation rows"),
        (len(results.get("expert_throughput") or []), "expert-throughput rows"),
        (timed + counted, f"sequence-parallel rows ({timed} timed, {counted} bytes)"),
        (len((results.get("decode_paths") or {}).get("rows") or []), "decode-path rows"),
        (len(results.get("training") or []), "training rows"),
    ]
    parts = [f"{n} {what}" for n, what in parts if n]
    return ", ".join(parts) or "no rows (every section off or skipped)"


def checked_settings(cfg: dict) -> BenchSettings:
    """The bench's settings read once from `cfg` (`read_settings`: the device's and the generation section's
    checked as they are read), then each other section that is on checks its own: fails before measuring
    anything if a setting is out of range or an architecture cannot be built at the shape."""
    settings = read_settings(cfg)
    if settings.expert_throughput:
        check_expert_throughput(settings.expert_throughput)
    if settings.sequence_parallel:
        check_sequence_parallel(settings.sequence_parallel)
    if settings.decode_paths:
        check_decode_paths(settings.decode_paths)
    if settings.training:
        check_training(settings.training)
    return settings


def check_settings(cfg: dict) -> tuple[dict[tuple, list[str]], list[str]]:
    """Fail before measuring anything if a setting is out of range, an architecture cannot be built at the
    shape, or a degree point fits no architecture (each architecture's own `check_layout`). Returns which
    architectures run at each point and the notes of those skipped (`archs_at_points`)."""
    configs_at, skipped = archs_at_all_points(checked_settings(cfg).generation)
    return {key: list(configs) for key, configs in configs_at.items()}, skipped


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
    settings = checked_settings(cfg)
    gen, device, dtype = settings.generation, settings.device, settings.dtype
    configs_at, skipped = archs_at_all_points(gen)
    for note in skipped:
        print(f"[bench] skipped {note}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    hw = hardware_info(device)
    rows = []
    started = time.perf_counter()
    for degrees in gen.points:
        if gen.simulated or gen.upper_bound:
            rows += run_single_process(gen, degrees, configs_at[degrees_key(degrees)], device, dtype, skipped)
            print(
                f"[bench] {degrees_label(degrees)}: simulated / upper bound done "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    for degrees in gen.real.points:
        p, label = ranks(degrees), degrees_label(degrees)
        if device.type == "cuda" and torch.cuda.device_count() < p:
            skipped.append(f"real {label}: needs {p} GPUs, this machine has {torch.cuda.device_count()}.")
            continue
        rows += run_real(gen, degrees, configs_at[degrees_key(degrees)], device, dtype, settings.threads)
        print(f"[bench] {label}: real done ({time.perf_counter() - started:.0f} s)", flush=True)
    experts = []
    if settings.expert_throughput:
        experts = expert_throughput(settings.expert_throughput, device, dtype)
        print(f"[bench] expert throughput done ({time.perf_counter() - started:.0f} s)", flush=True)
    sp, sp_settings = {}, settings.sequence_parallel
    if sp_settings:
        # With a device preset, a GPU's dtype throughout (K and V of the softmax layers move in it).
        sp_dtype = SIMULATED_DTYPE if settings.compute.predicted else dtype
        sp = {"bytes": sp_bytes_rows(sp_settings, sp_dtype), **sequence_parallel(sp_settings, device, sp_dtype)}
        sp["methods"] = {m: SP_ALGORITHMS[m] for m in sp_settings.methods}
        sp["dtype"] = str(sp_dtype).removeprefix("torch.")
        if settings.compute.predicted:
            kernels = sp_settings.device_kernels
            sp["device_kernels"] = {"setting": kernels, "what": SP_DEVICE_KERNELS[kernels]}
        add_sp_comparisons(sp, sp_settings.anchor)
        print(f"[bench] sequence parallel done ({time.perf_counter() - started:.0f} s)", flush=True)
    paths = {}
    if settings.decode_paths:
        paths = decode_paths(settings.decode_paths, device, dtype)
        print(f"[bench] decode paths done ({time.perf_counter() - started:.0f} s)", flush=True)
    training = []
    if settings.training:
        training, notes = training_rows(settings.training)
        skipped += notes
        print(f"[bench] training done ({time.perf_counter() - started:.0f} s)", flush=True)
    add_comparisons(rows, gen.baseline, gen.min_comm_fraction)
    # The virtual clock counting Python time as compute: a measured-compute artefact only.
    slow_clock = None if settings.compute.predicted else clock_note(rows, gen.baseline)
    results = {
        "command": command,
        "settings": settings.recorded,
        "degrees": gen.points,
        "real_degrees": gen.real.points,
        "hardware": hw,
        "dtype": str(dtype).removeprefix("torch."),
        "compute": settings.compute.info(),
        "links": [
            {"name": k, "base_us": v.base_s * 1e6, "alpha_us": v.alpha_s * 1e6, "beta_GBps": v.beta_Bps / 1e9, "note": v.note}
            for k, v in LINK_PRESETS.items()
        ],
        "notes": notes_for(settings.compute, gen.real.points, device.type, hw, rows) + ([slow_clock] if slow_clock else []),
        "skipped": skipped,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
        "expert_throughput": experts,
        "sequence_parallel": sp,
        "decode_paths": paths,
        "training": training,
    }
    images = report.write_files(results, out_dir)
    if wandb_cfg:
        report.log_to_wandb(results, images, out_dir, wandb_cfg)
    return results
