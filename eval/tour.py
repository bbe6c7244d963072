"""The zoo tour: train, convert, evaluate and bench every architecture, then write one report.

    python -m eval.tour                          # what `make demo` runs (about 8-10 minutes on 2 CPU cores)
    python -m eval.tour report_dir=reports/demo  # ... and rewrite the committed example report

Each step is the zoo's own entry point called in-process with its Hydra config (pretrain, convert,
quality, bench), so the tour shows exactly what those commands do. The report (`report_dir`,
default `<run dir>/report/README.md`, under outputs/) puts quality (validation perplexity, bundled
lm-eval tasks, loss curves) beside speed (simulated-link and real-gloo bench) for every architecture.
"""

import shutil
import time
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from eval import bench_report, report


def _compose(name: str, overrides: list[str]) -> DictConfig:
    return compose(config_name=name, overrides=list(overrides))


def pretrain_all(cfg: DictConfig, run_dir: Path) -> dict[str, dict]:
    from train.pretrain import train

    results = {}
    for arch in cfg.archs:
        print(f"[tour] pretraining {arch}", flush=True)
        c = _compose("pretrain", [f"model={arch}", *cfg.pretrain_overrides, f"seed={cfg.seed}"])
        c.paths.output_dir = str(run_dir / "pretrain" / arch)
        results[arch] = train(c)
    return results


def convert_llama(cfg: DictConfig, run_dir: Path, llama_hf: str) -> dict:
    from train.convert import convert

    print("[tour] converting llama -> ladder and retraining", flush=True)
    retrain = ",".join(f"'{o}'" for o in cfg.convert.retrain_overrides)
    c = _compose(
        "convert",
        [f"source={llama_hf}", f"ladder_layers={cfg.convert.ladder_layers}", "retrain.enabled=true",
         f"retrain.overrides=[{retrain}]"],
    )
    c.paths.output_dir = str(run_dir / "convert")
    return convert(c)


def evaluate_all(cfg: DictConfig, run_dir: Path, checkpoints: dict[str, str]) -> dict[str, dict]:
    from eval.quality import run

    results = {}
    for name, path in checkpoints.items():
        print(f"[tour] evaluating {name}", flush=True)
        c = _compose("quality", [f"checkpoint={path}", *cfg.quality_overrides])
        c.out_dir = str(run_dir / "quality" / name.replace(" ", "_").replace(",", ""))
        results[name] = run(c)
    return results


def bench_all(cfg: DictConfig, run_dir: Path) -> dict:
    from eval.bench import run_bench

    print("[tour] benchmarking", flush=True)
    c = _compose("bench", [f"archs=[{','.join(cfg.archs)}]", *cfg.bench_overrides])
    plain = OmegaConf.to_container(c, resolve=False)
    settings = {k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}
    command = " ".join(["python -m eval.bench", f"archs=[{','.join(cfg.archs)}]", *cfg.bench_overrides])
    return run_bench(settings, run_dir / "bench", None, command)


# ------------------------------------------------------------------------------------------- report


def quality_rows(quality: dict[str, dict], pretrained: dict[str, dict]) -> list[dict]:
    rows = []
    for name, q in quality.items():
        tasks = q["tasks"]
        row = {
            "model": name,
            "val loss": q["perplexity"]["loss"],
            "val ppl": q["perplexity"]["ppl"],
            "next line acc_mutual_info": _metric(tasks, "shakespeare_next_line", "acc_mutual_info"),
            "cloze acc": _metric(tasks, "shakespeare_cloze", "acc"),
            "passages bits/byte": _metric(tasks, "shakespeare_passages", "bits_per_byte"),
        }
        if name in pretrained:
            row["params"] = pretrained[name].get("num_parameters")
        rows.append(row)
    return rows


def _metric(tasks: dict, task: str, metric: str):
    value = tasks.get(task, {}).get("metrics", {}).get(metric)
    return value.get("value") if isinstance(value, dict) else value


def speed_rows(bench: dict, archs: list[str]) -> list[dict]:
    keyed = []
    for r in bench["rows"]:
        if r["arch"] == bench["settings"]["baseline"] or r["variant"] not in ("simulated", "real"):
            continue
        row = {
            "arch": r["arch"],
            "variant": r["variant"] + (f":{r['link']}" if r.get("link") else ""),
            "degrees": bench_report.degrees_label(r["degrees"]),
            "batch": r["batch"],
            "prefill speed-up": r["speedup_prefill"],
            "decode speed-up": r["speedup_decode"],
            "hidden (decode)": r["hidden_fraction_decode"],
            "hidden (exposed, decode)": r.get("exposed_hidden_fraction_decode"),
            "all-reduces/step": r["decode_comm_calls"],
        }
        order = (row["variant"], bench_report.ranks(r["degrees"]), row["degrees"], r["batch"], archs.index(r["arch"]))
        keyed.append((order, row))
    return [row for _, row in sorted(keyed, key=lambda pair: pair[0])]


def glance_rows(q_rows: list[dict], bench: dict, archs: list[str]) -> list[dict]:
    """One row per architecture: quality beside what its schedule hides, for the first screen."""
    rows = bench["rows"]
    top = max(bench["degrees"], key=bench_report.ranks)  # the most ranks measured
    top_label = bench_report.degrees_label(top)
    links = bench["settings"]["simulated"]["links"]

    def pick(arch, key):
        for r in rows:
            if (r["arch"], r["variant"], r.get("link"), r["degrees"], r["batch"]) == (arch, "simulated", links[0], top, 1):
                return r.get(key)
        return None

    out = []
    for arch in archs:
        q = next((r for r in q_rows if r["model"] == arch), {})
        hidden = sorted(
            r["exposed_hidden_fraction_decode"]
            for r in rows
            if r["arch"] == arch and r["variant"] == "simulated" and r.get("exposed_hidden_fraction_decode") is not None
        )
        out.append({
            "arch": arch,
            "params": q.get("params"),
            "val ppl": q.get("val ppl"),
            "all-reduces per decode step": pick(arch, "decode_comm_calls"),
            "share of exposed comm hidden (simulated, median)": hidden[len(hidden) // 2] if hidden else None,
            f"prefill speed-up ({links[0]}, {top_label}, batch 1)": pick(arch, "speedup_prefill"),
            f"decode speed-up ({links[0]}, {top_label}, batch 1)": pick(arch, "speedup_decode"),
        })
    return out


def loss_curves(path: Path, pretrained: dict[str, dict]) -> Path:
    def curve(r, start=0):
        points = [(step, loss) for step, loss, _ in r["val_history"] if step >= start]
        return [s for s, _ in points], [loss for _, loss in points]

    # The second panel leaves out step 0 (loss ~ log(vocab)), which flattens the differences.
    panels = {
        "pretraining at equal tokens": {arch: curve(r) for arch, r in pretrained.items()},
        "from the first validation on": {arch: curve(r, start=1) for arch, r in pretrained.items()},
    }
    return report.plot_lines(path, panels, xlabel="optimizer step", ylabel="validation loss",
                             title="validation loss on held-out plays")


def write_report(cfg, out: Path, pretrained, converted, quality, bench, elapsed) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    images = {"loss_curves": loss_curves(out / "loss_curves.png", pretrained)}
    for name in ("speedup_vs_batch.png", "speedup_vs_degree.png", "hidden_fraction_exposed.png"):
        src = Path(bench["out_dir"]) / name if "out_dir" in bench else None
        if src and src.exists():
            images[name.removesuffix(".png")] = Path(shutil.copy(src, out / name))
    q_rows = quality_rows(quality, pretrained)
    s_rows = speed_rows(bench, list(cfg.archs))
    g_rows = glance_rows(q_rows, bench, list(cfg.archs))
    conv = converted["val"]
    lines = [
        "# overlap-zoo tour",
        "",
        f"Produced by `make demo` (`python -m eval.tour`) in {elapsed / 60:.1f} minutes on "
        f"{bench['hardware'].get('cpu', bench['hardware'].get('device', 'this machine'))}. "
        "Every number below was measured in this run.",
        "",
        "## At a glance",
        "",
        "Quality from the pretraining below; speed from the bench below (simulated link: one rank's real "
        "compute on this machine plus the link model). The share of exposed communication hidden is the "
        "robust number on a CPU; time-based speed-ups carry this machine's timing noise.",
        "",
        report.write_markdown_table(g_rows, list(g_rows[0])),
        "",
        "## Quality at equal tokens",
        "",
        f"Each architecture: the tiny config (`conf/model/<arch>.yaml`), trained with "
        f"`{' '.join(cfg.pretrain_overrides)}` on the bundled corpus; evaluated on the held-out plays.",
        "",
        report.write_markdown_table(q_rows, list(q_rows[0])),
        "",
        "![validation loss](loss_curves.png)",
        "",
        f"## Llama -> Ladder conversion (last {converted['ladder_layers']} of "
        f"{converted['num_hidden_layers']} layers)",
        "",
        "Measured by `train.convert` on its own validation batches (`evaluate.max_batches`), so the "
        "numbers differ slightly from the table above; the retrained model saw extra steps.",
        "",
        "| model | val loss | val ppl |",
        "|---|---|---|",
        *[f"| {k} | {v['loss']:.4f} | {v['ppl']:.2f} |" for k, v in conv.items()],
        "",
        "## Speed (bench, random weights)",
        "",
        f"`{bench['command']}`. Speed-ups are over `llama` in the same variant; hidden = "
        "(T_llama - T_arch) / (T_llama - T_upper_bound); hidden (exposed) = 1 - exposed_arch / exposed_llama "
        "on the virtual clock. Simulated rows: one rank's real compute + the link model; real rows: "
        "gloo processes on this machine's cores.",
        "",
        *[f"> {n}" for n in bench["notes"]],
        "",
        report.write_markdown_table(s_rows, list(s_rows[0]) if s_rows else []),
        "",
        *[f"![{k}]({v.name})" for k, v in images.items() if k != "loss_curves"],
        "",
    ]
    path = out / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    report.write_json(out / "tour.json", {"glance": g_rows, "quality": q_rows, "speed": s_rows, "conversion": conv})
    if cfg.wandb:
        report.log_to_wandb(
            Path(cfg.paths.output_dir),  # the run directory, not the committed report folder
            project="overlap-zoo",
            name="tour",
            config=OmegaConf.to_container(cfg, resolve=True),
            summary={f"quality/{r['model']}/val_ppl": r["val ppl"] for r in q_rows},
            tables={"tour/quality": (list(q_rows[0]), q_rows), "tour/speed": (list(s_rows[0]), s_rows)}
            if s_rows
            else {"tour/quality": (list(q_rows[0]), q_rows)},
            images={f"tour/{k}": v for k, v in images.items()},
            tags=["tour"],
        )
    return path


def tour(cfg: DictConfig) -> Path:
    started = time.perf_counter()
    run_dir = Path(cfg.paths.output_dir).resolve()
    pretrained = pretrain_all(cfg, run_dir)
    checkpoints = {arch: r["hf_dir"] for arch, r in pretrained.items()}
    converted = {"val": {}, "ladder_layers": None, "num_hidden_layers": None}
    if cfg.convert.enabled and "llama" in pretrained:
        converted = convert_llama(cfg, run_dir, checkpoints["llama"])
        checkpoints["ladder (converted from llama)"] = converted["retrain"]["hf_dir"]
    quality = evaluate_all(cfg, run_dir, checkpoints)
    bench = bench_all(cfg, run_dir)
    bench["out_dir"] = str(run_dir / "bench")
    path = write_report(cfg, Path(cfg.report_dir), pretrained, converted, quality, bench,
                        time.perf_counter() - started)
    print(f"[tour] report: {path}", flush=True)
    print(path.read_text(), flush=True)
    return path


@hydra.main(config_path="../conf", config_name="tour", version_base="1.3")
def main(cfg: DictConfig) -> None:
    tour(cfg)


if __name__ == "__main__":
    main()
