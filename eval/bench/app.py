"""The bench app (`python -m eval.bench`: eval/bench/__main__.py): its checks, its sections in turn, results.json.

`run_bench` checks every setting first (`check_settings`: the generation section's and each other section's
own), then runs each section that is on: generation over the degree points (eval.bench.generation), expert
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
from eval.bench.generation import run_real, run_single_process
from eval.bench.generation_report import add_comparisons, clock_note, notes_for
from eval.bench.moe import check_expert_throughput, expert_throughput
from eval.bench.settings import (
    SIMULATED_DTYPE,
    archs_at_all_points,
    bench_points,
    check_generation_settings,
    compute_info,
    cpu_threads,
    degrees_key,
    degrees_label,
    hardware_info,
    predicted,
    ranks,
    real_points,
    resolve_device,
    resolve_real,
)
from eval.bench.sp import (
    SP_ALGORITHMS,
    SP_DEVICE_KERNELS,
    check_sequence_parallel,
    sequence_parallel,
    sp_bytes_rows,
)
from eval.bench.sp_report import add_sp_comparisons
from eval.bench.training import check_training, training_rows
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


def check_settings(cfg: dict) -> tuple[dict[tuple, list[str]], list[str]]:
    """Fail before measuring anything if a setting is out of range, an architecture cannot be built at the
    shape, or a degree point fits no architecture (each architecture's own `check_layout`). Returns which
    architectures run at each point and the notes of those skipped (`archs_at_points`)."""
    resolved = check_generation_settings(cfg)
    check_expert_throughput(cfg)
    check_sequence_parallel(cfg)
    check_decode_paths(cfg)
    check_training(cfg)
    return archs_at_all_points(resolved)


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
            archs = archs_at[degrees_key(degrees)]
            rows += run_single_process(cfg, degrees, archs, device, dtype, skipped)
            print(
                f"[bench] {degrees_label(degrees)}: simulated / upper bound done "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    for degrees in real_points(cfg):
        p, label = ranks(degrees), degrees_label(degrees)
        if device.type == "cuda" and torch.cuda.device_count() < p:
            skipped.append(f"real {label}: needs {p} GPUs, this machine has {torch.cuda.device_count()}.")
            continue
        rows += run_real(cfg, degrees, archs_at[degrees_key(degrees)])
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
        sp["methods"] = {m: SP_ALGORITHMS[m] for m in cfg["sequence_parallel"]["methods"]}
        sp["dtype"] = str(sp_dtype).removeprefix("torch.")
        if predicted(cfg):
            kernels = cfg["sequence_parallel"].get("device_kernels", "gpu")
            sp["device_kernels"] = {"setting": kernels, "what": SP_DEVICE_KERNELS[kernels]}
        add_sp_comparisons(sp, cfg)
        print(f"[bench] sequence parallel done ({time.perf_counter() - started:.0f} s)", flush=True)
    paths = {}
    if (cfg.get("decode_paths") or {}).get("enabled"):
        paths = decode_paths(cfg, device, dtype)
        print(f"[bench] decode paths done ({time.perf_counter() - started:.0f} s)", flush=True)
    training = []
    if (cfg.get("training") or {}).get("enabled"):
        training, notes = training_rows(cfg)
        skipped += notes
        print(f"[bench] training done ({time.perf_counter() - started:.0f} s)", flush=True)
    add_comparisons(rows, cfg["baseline"], cfg["min_comm_fraction"])
    # The virtual clock counting Python time as compute: a measured-compute artefact only.
    slow_clock = None if predicted(cfg) else clock_note(rows, cfg["baseline"])
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
        "notes": notes_for(cfg, device.type, hw, rows) + ([slow_clock] if slow_clock else []),
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
