"""The bench's files: results.json, README.md (every section that ran, in turn), the plots, and a W&B run."""

from pathlib import Path

from eval import report
from eval.bench.decode_paths_report import DECODE_PATH_PLOTS, decode_paths_section, plot_decode_paths
from eval.bench.generation_report import (
    ONE_GPU_COLUMNS,
    SIMULATED_COLUMNS,
    TABLE_COLUMNS,
    display_rows,
    generation_intro,
    make_plots,
    variant_key,
)
from eval.bench.moe_report import MOE_PLOTS, moe_sections, plot_a2a_exposed, plot_expert_throughput
from eval.bench.settings import degrees_label
from eval.bench.sp_report import SP_PLOTS, sp_plots, sp_section
from eval.bench.training import training_section


def write_readme(results: dict, images: dict[str, Path], out_dir: Path) -> Path:
    cfg, hw, rows = results["settings"], results["hardware"], results["rows"]
    points = ", ".join(degrees_label(d) for d in results["degrees"])
    if results.get("real_degrees"):
        points += f" (real: {', '.join(degrees_label(d) for d in results['real_degrees'])})"
    lines = [
        f"# Speed benchmark: {cfg['bench_shape']['name']} shape",
        "",
        f"`{results['command'] or 'eval.bench.run_bench(...)'}`",
        "",
    ]
    if rows:
        lines += generation_intro(results, points)
    else:  # only the sequence-parallel section ran
        setting = (results.get("compute") or {}).get("setting", "measured")
        machine = "Hardware" if setting == "measured" else f"Compute predicted for {setting} by the device model, on"
        lines += [
            f"{machine}: {hw.get('gpu', hw['cpu'])} ({hw['cpu_cores']} CPU cores, load average "
            f"{hw['load_average_1m']:.2f} at start, {hw['torch_threads']} torch threads), torch {hw['torch']}, "
            f"transformers {hw['transformers']}. Elapsed {results['elapsed_s']:.0f} s.",
            "",
        ]
    for note in results["notes"]:
        lines.append(f"> {note}")
        lines.append("")
    for v in dict.fromkeys(variant_key(r) for r in rows):
        sel = [r for r in rows if variant_key(r) == v]
        cols = TABLE_COLUMNS + (SIMULATED_COLUMNS if v.startswith("simulated") else [])
        if any(r.get("speedup_decode_vs_one_gpu") is not None for r in sel):
            cols = cols + ONE_GPU_COLUMNS
        lines += [f"## {v}", "", report.write_markdown_table(display_rows(sel), cols)]
    lines += moe_sections(results, images)
    lines += sp_section(results, images)
    lines += decode_paths_section(results, images)
    lines += training_section(results)
    lines += ["## Link presets", ""]
    lines.append(
        report.write_markdown_table(
            results["links"], [("name", "preset"), ("base_us", "base us"), ("alpha_us", "alpha us/hop"), ("beta_GBps", "beta GB/s"), "note"]
        )
    )
    for name, path in images.items():
        if name not in MOE_PLOTS + SP_PLOTS + DECODE_PATH_PLOTS:  # shown in their own sections
            lines += [f"![{name}]({path.name})", ""]
    if results["skipped"]:
        lines += ["## Skipped", "", "Architectures not measured at a degree point (a layout that refuses it, or a "
                  "forward the device model cannot run):", ""]  # fmt: skip
        lines += [f"- {s}" for s in results["skipped"]] + [""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path


def write_files(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, the plots and README.md under `out_dir`; returns the plots {name: path}."""
    report.write_json(out_dir / "results.json", results)
    cfg = results["settings"]
    images = make_plots(results["rows"], list(cfg["archs"]), cfg["baseline"], out_dir)
    images.update(plot_a2a_exposed(results["rows"], out_dir))
    if results.get("expert_throughput"):
        images["expert_throughput"] = plot_expert_throughput(results["expert_throughput"], out_dir)
    images.update(sp_plots(results, out_dir))
    if (results.get("decode_paths") or {}).get("rows"):
        images["decode_paths"] = plot_decode_paths(results["decode_paths"], out_dir)
    write_readme(results, images, out_dir)
    return images


def log_to_wandb(results: dict, images: dict[str, Path], out_dir: Path, wandb_cfg: dict) -> None:
    rows = display_rows(results["rows"])
    columns = ["variant", "link"] + [k for k, _ in TABLE_COLUMNS + SIMULATED_COLUMNS]
    summary = {}
    for r in results["rows"]:
        key = f"{r['arch']}/{degrees_label(r['degrees'], sep='')}/{variant_key(r)}/b{r['batch']}"
        for m in ("decode_tok_s", "prefill_ms", "speedup_decode", "hidden_fraction_decode"):
            summary[f"{key}/{m}"] = r[m]
        for m in ("prefill_a2a_exposed_ms_per_layer", "prefill_a2a_hidden_share", "prefill_a2a_bytes"):
            if r.get(m) is not None:
                summary[f"{key}/{m}"] = r[m]
    for e in results.get("expert_throughput") or []:
        summary[f"expert_throughput/{e['label']}/tokens_per_s"] = e["tokens_per_s"]
        summary[f"expert_throughput/{e['label']}/speedup"] = e["speedup"]
    for r in (results.get("decode_paths") or {}).get("rows") or []:
        key = f"decode_paths/{r['arch']}/{r['path'] or 'default'}/b{r['batch']}/q{r['q_len']}"
        summary[f"{key}/decode_tok_s"] = r["decode_tok_s"]
        summary[f"{key}/kv_bytes_per_token"] = r["kv_bytes_per_token"]
    for h in (results.get("sequence_parallel") or {}).get("headline") or []:
        key = f"sequence_parallel/{h['rank']}/{h['link']}/N{h['n']}-P{h['p']}"
        for m in ("speedup_over_lasp1", "comm_speedup_over_lasp1", "speedup_over_ring", "lasp2_exposed_ms", "lasp1_exposed_ms"):
            summary[f"{key}/{m}"] = h.get(m)
    report.log_to_wandb(
        out_dir,
        project=wandb_cfg.get("project", "overlap-zoo"),
        name=wandb_cfg.get("name", "bench"),
        tags=wandb_cfg.get("tags") or [],
        config={
            k: v
            for k, v in results.items()
            if k in ("settings", "hardware", "dtype", "compute", "links", "degrees", "real_degrees")
        },
        summary=summary,
        tables={"bench/results": (columns, rows)},
        images={f"bench/{k}": v for k, v in images.items()},
    )
