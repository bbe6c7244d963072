"""The zoo tour: train, convert, evaluate and bench every architecture, then write one report.

    python -m eval.tour                          # what `make demo` runs (about 11 minutes on 2 CPU cores)
    python -m eval.tour report_dir=reports/demo  # ... and rewrite the committed example report

Each step is the zoo's own entry point called in-process with its Hydra config (pretrain, convert,
quality, bench), so the tour shows exactly what those commands do. The report (`report_dir`,
default `<run dir>/report/README.md`, under outputs/) puts quality (validation perplexity, bundled
lm-eval tasks, loss curves; total and active parameters) beside speed for every architecture: one bench
per family (`benches`), each against its own baseline (the tensor-parallel architectures against llama,
the MoE family over expert parallelism against moe).
"""

import json
import math
import shutil
import time
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

import models  # registers the zoo's configs with AutoConfig
from eval import report
from eval.bench.decode_paths_report import decode_paths_section
from eval.bench.settings import degrees_label, link_label, ranks
from eval.bench.sp_report import sp_section


def _compose(name: str, overrides: list[str]) -> DictConfig:
    return compose(config_name=name, overrides=list(overrides))


def pretrain_all(cfg: DictConfig, run_dir: Path) -> dict[str, dict]:
    from train.pretrain import train

    results = {}
    for arch in cfg.archs:
        print(f"[tour] pretraining {arch}", flush=True)
        started = time.perf_counter()
        model = (cfg.get("model_configs") or {}).get(arch, arch)
        c = _compose("pretrain", [f"model={model}", *cfg.pretrain_overrides, f"seed={cfg.seed}"])
        c.paths.output_dir = str(run_dir / "pretrain" / arch)
        results[arch] = train(c)
        results[arch]["num_active_parameters"] = active_parameters(results[arch]["hf_dir"], results[arch]["num_parameters"])
        print(f"[tour] pretrained {arch} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def active_parameters(checkpoint: str, total: int) -> int:
    """Parameters one token's forward uses: the MoE configs' `num_active_parameters_formula()` (all but the
    experts a token is not routed to; MoE++: an upper bound), the total for dense architectures."""
    formula = getattr(AutoConfig.from_pretrained(checkpoint), "num_active_parameters_formula", None)
    return formula() if formula is not None else total


def convert_all(cfg: DictConfig, run_dir: Path, checkpoints: dict[str, str]) -> dict[str, dict]:
    """Every converter of `convert.converters` applied to the trained `convert.source` architecture and
    retrained briefly (train.convert): {converter name: its result}."""
    from train.convert import convert

    retrain = ",".join(f"'{o}'" for o in cfg.convert.retrain_overrides)
    results = {}
    for name, options in cfg.convert.converters.items():
        print(f"[tour] converting {cfg.convert.source} with {name} and retraining", flush=True)
        started = time.perf_counter()
        c = _compose(
            "convert",
            [f"converter={name}", f"source={checkpoints[cfg.convert.source]}",
             *[f"{key}={value}" for key, value in (options or {}).items()],
             "retrain.enabled=true", f"retrain.overrides=[{retrain}]"],
        )
        c.paths.output_dir = str(run_dir / "convert" / name)
        results[name] = convert(c)
        print(f"[tour] converted with {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def converted_name(result: dict, source: str) -> str:
    """The converted checkpoint's name in the report, e.g. "ladder (converted from llama)"."""
    return f"{result['target']} (converted from {source})"


def evaluate_all(cfg: DictConfig, run_dir: Path, checkpoints: dict[str, str]) -> dict[str, dict]:
    from eval.quality import run

    results = {}
    for name, path in checkpoints.items():
        print(f"[tour] evaluating {name}", flush=True)
        started = time.perf_counter()
        c = _compose("quality", [f"checkpoint={path}", *cfg.quality_overrides])
        c.out_dir = str(run_dir / "quality" / name.replace(" ", "_").replace(",", ""))
        results[name] = run(c)
        print(f"[tour] evaluated {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def bench_all(cfg: DictConfig, run_dir: Path) -> dict[str, dict]:
    """One bench per entry of `benches` whose baseline (its first arch) the tour trains, over the
    architectures of `archs` it lists: {bench name: results, with "title" and "out_dir" added}."""
    from eval.bench import run_bench_overrides

    results = {}
    for name, spec in cfg.benches.items():
        archs = [a for a in spec.archs if a in cfg.archs]
        if not archs or archs[0] != spec.archs[0]:
            print(f"[tour] bench {name} skipped: its baseline {spec.archs[0]} is not in archs", flush=True)
            continue
        print(f"[tour] benchmarking {name}: {', '.join(archs)}", flush=True)
        started = time.perf_counter()
        overrides = [f"archs=[{','.join(archs)}]", f"baseline={archs[0]}", *spec.overrides]
        out_dir = run_dir / "bench" / name
        results[name] = run_bench_overrides(overrides, out_dir)
        results[name].update(title=spec.title, out_dir=str(out_dir))
        print(f"[tour] benchmarked {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


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
            # The cloze task's acc (the word is the greedy continuation, every token of it) is 0 for every tiny
            # model; its mean log-likelihood per target word tells them apart: -log of lm-eval's perplexity
            # aggregate exp(-mean log P(word | context)).
            "cloze log-lik/word": _neg_log(_metric(tasks, "shakespeare_cloze", "perplexity")),
            "passages bits/byte": _metric(tasks, "shakespeare_passages", "bits_per_byte"),
        }
        if name in pretrained:
            row["params"] = pretrained[name].get("num_parameters")
            row["active params"] = pretrained[name].get("num_active_parameters")
        rows.append(row)
    return rows


def _neg_log(value: float | None) -> float | None:
    return -math.log(value) if value is not None and value > 0 and math.isfinite(value) else None


def _metric(tasks: dict, task: str, metric: str):
    value = tasks.get(task, {}).get("metrics", {}).get(metric)
    return value.get("value") if isinstance(value, dict) else value


def speed_rows(bench: dict, archs: list[str]) -> list[dict]:
    """The bench's simulated and real rows of every architecture but its baseline, sorted by variant,
    degrees, batch; with the MoE all-to-all's share hidden per layer where the rows carry it."""
    keyed = []
    for r in bench["rows"]:
        if r["arch"] == bench["settings"]["baseline"] or r["variant"] not in ("simulated", "real"):
            continue
        row = {
            "arch": r["arch"],
            "variant": r["variant"] + (f":{r['link']}" if r.get("link") else ""),
            "degrees": degrees_label(r["degrees"]),
            "batch": r["batch"],
            "prefill speed-up": r["speedup_prefill"],
            "decode speed-up": r["speedup_decode"],
            "hidden (decode)": r["hidden_fraction_decode"],
            "hidden (exposed, decode)": r.get("exposed_hidden_fraction_decode"),
            "collectives/step": r["decode_comm_calls"],
        }
        if "decode_a2a_bytes" in r:  # expert parallelism: per MoE layer, from the virtual clock
            row["a2a bytes/layer (decode)"] = r["decode_a2a_bytes"]
            row["a2a hidden share (decode)"] = r.get("decode_a2a_hidden_share")
            row["a2a exposed / baseline's (decode)"] = r.get("decode_a2a_exposed_vs_baseline")
            row["published hidden share"] = r.get("a2a_hidden_anchor")
        order = (row["variant"], ranks(r["degrees"]), row["degrees"], r["batch"], archs.index(r["arch"]))
        keyed.append((order, row))
    return [row for _, row in sorted(keyed, key=lambda pair: pair[0])]


def glance_rows(q_rows: list[dict], benches: dict[str, dict], archs: list[str]) -> list[dict]:
    """One row per architecture: quality beside what its schedule hides, in the bench of its family, at
    that bench's largest degree point, first link, batch 1."""
    out = []
    for arch in archs:
        q = next((r for r in q_rows if r["model"] == arch), {})
        row = {"arch": arch, "params": q.get("params"), "active params": q.get("active params"), "val ppl": q.get("val ppl")}
        # the bench of its family with generation rows (not the sequence-parallel or decode-path sections only)
        bench = next((b for b in benches.values() if arch in b["settings"]["archs"] and b["rows"]), None)
        if bench is not None:
            rows = bench["rows"]
            top = max(bench["degrees"], key=ranks)  # the most ranks measured
            link = bench["settings"]["simulated"]["links"][0]
            picked = next(
                (r for r in rows if (r["arch"], r["variant"], r.get("link"), r["degrees"], r["batch"])
                 == (arch, "simulated", link, top, 1)),
                {},
            )
            hidden = sorted(
                r["exposed_hidden_fraction_decode"]
                for r in rows
                if r["arch"] == arch and r["variant"] == "simulated" and r.get("exposed_hidden_fraction_decode") is not None
            )
            row.update({
                "against": bench["settings"]["baseline"],
                "at": f"{degrees_label(top)}, {link_label(link)}",
                "collectives per decode step": picked.get("decode_comm_calls"),
                "share of exposed comm hidden (simulated, median)": hidden[len(hidden) // 2] if hidden else None,
                "prefill speed-up (batch 1)": picked.get("speedup_prefill"),
                "decode speed-up (batch 1)": picked.get("speedup_decode"),
            })
        out.append(row)
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


# The generation bench's plots (eval.bench.generation_report.make_plots), shown under its rows.
GENERATION_PLOTS = ("speedup_vs_batch", "speedup_vs_degree", "hidden_fraction_exposed", "a2a_exposed")


def speed_section(name: str, bench: dict, archs: list[str], out: Path) -> tuple[list[str], list[dict], dict[str, Path]]:
    """The report's section of one bench: (Markdown lines, its rows, the plots copied beside the report)."""
    images = {}
    for src in sorted(Path(bench["out_dir"]).glob("*.png")):
        images[f"{name}_{src.stem}"] = Path(shutil.copy(src, out / f"{name}_{src.stem}.png"))
    own = {k.removeprefix(f"{name}_"): v for k, v in images.items()}  # the bench's own plot names
    rows = speed_rows(bench, archs)
    base = bench["settings"]["baseline"]
    moe = any("a2a hidden share (decode)" in r for r in rows)
    lines = [f"## Speed: {bench['title']} (bench, random weights)", "", f"`{bench['command']}`."]
    if rows:
        lines[-1] += (
            f" Speed-ups are over `{base}` in the same variant; hidden = (T_{base} - T_arch) / (T_{base} - "
            f"T_upper_bound); hidden (exposed) = 1 - exposed_arch / exposed_{base} on the virtual clock. Simulated "
            "rows: one rank's real compute + the link model; real rows: gloo processes on this machine's cores."
        )
    lines.append("")
    if moe:
        lines += [
            "Per MoE layer (simulated rows): **a2a bytes/layer** = bytes this rank hands to one token all-to-all, "
            "counted; **a2a hidden share** = 1 - exposed / link time of the layer's two token all-to-alls on the "
            f"virtual clock; **a2a exposed / baseline's** = against `{base}` (this mixes the schedule with the bytes: "
            "ScMoE routes top-1, moe top-2); **published hidden share**: the ScMoE paper's.",
            "",
        ]
    lines += [
        *[f"> {n}" for n in bench["notes"]],
        "",
    ]
    if rows:
        lines += [report.write_markdown_table(rows, list(rows[0])), ""]
        lines += [f"![{k}]({v.name})" for k, v in own.items() if k in GENERATION_PLOTS]
        lines.append("")
    # The bench's own sections where it ran them (sequence parallelism, decode paths), a level down.
    for section in (sp_section(bench, own), decode_paths_section(bench, own)):
        lines += ["#" + line if line.startswith("#") else line for line in section]
    experts = bench.get("expert_throughput") or []
    if experts:
        lines += [
            f"One MoE layer's forward timed for real on this machine ({experts[0]['tokens']} tokens, every expert "
            "here, no communication), each router pushed to the load its balance loss aims for; speed-up over "
            f"`{experts[0]['label']}`:",
            "",
            report.write_markdown_table(
                experts,
                [("label", "layer"), ("ffn_rows_per_token", "expert rows/token"), ("tokens_per_s", "tokens/s"),
                 ("speedup", "speed-up"), ("anchor", "published")],
            ),
            "",
        ]
        if "expert_throughput" in own:
            lines += [f"![expert_throughput]({own['expert_throughput'].name})", ""]
    return lines, rows, images


def conversion_lines(converted: dict[str, dict]) -> list[str]:
    """One section per conversion: its settings and the validation loss before, right after and after retraining."""
    lines = []
    for result in converted.values():
        settings = ", ".join(f"{k}={v}" for k, v in result["details"].items())
        lines += [
            f"## {result['title']} conversion (`converter={result['converter']}`: {settings})",
            "",
            "Measured by `train.convert` on its own validation batches (`evaluate.max_batches`), so the "
            "numbers differ slightly from the table above; the retrained model saw extra steps.",
            "",
            "| model | val loss | val ppl |",
            "|---|---|---|",
            *[f"| {k} | {v['loss']:.4f} | {v['ppl']:.2f} |" for k, v in result["val"].items()],
            "",
        ]
    return lines


def zero_computation_mix(pretrained: dict[str, dict]) -> str:
    """Each trained model's expert mix where its architecture states one (the registry's `expert_mix` hook:
    MoE++'s FFN and zero-computation experts and k_eff at the balanced load), read from its saved config so
    that the text follows `model_configs`."""
    parts = []
    for arch, result in pretrained.items():
        c = AutoConfig.from_pretrained(result["hf_dir"])
        entry = models.registry.entry_for(c.model_type)
        if entry is not None and entry.expert_mix is not None:
            parts.append(f"{arch}: {entry.expert_mix(c)}")
    return "; ".join(parts) or "no MoE++ model in this tour"


def seed_noise_line(path: str | None) -> str:
    """What one seed's numbers can tell apart: the seed-to-seed spread of eval.replicate's report at `path`
    (the range of its per-architecture sample std of the final validation loss, and of the paired differences
    to the baseline), or, without that report, the command that measures it."""
    results = Path(path) if path else None
    if results is None or not results.is_file():
        return ("**One seed.** Every row above is one training run; the same architecture trained with another "
                "seed lands elsewhere, by about as much as the differences between rows at this budget. "
                "`python -m eval.replicate` measures that spread (3 seeds, paired differences to each baseline).")
    r = json.loads(results.read_text())
    st = r["settings"]
    stds = [row["val_loss"]["std"] for row in r["rows"] if row["val_loss"]["std"] is not None]
    diffs = [row["diff_loss"]["std"] for row in r["rows"] if row.get("diff_loss") and row["diff_loss"]["std"] is not None]
    if not stds:
        return f"**One seed.** Every row above is one training run ({results} has no spread yet)."
    line = (f"**One seed.** Every row above is one training run. In `{results.parent}` ({len(st['seeds'])} seeds, "
            f"{st['max_steps']} steps of the same pretraining) one architecture's final validation loss has a "
            f"seed-to-seed sample std of {min(stds):.3f}-{max(stds):.3f} nats")
    if diffs:
        line += f", and its paired difference to its baseline one of {min(diffs):.3f}-{max(diffs):.3f} nats"
    return line + ("; a difference between two rows here that is not well above that is not a result (that "
                   "README gives each architecture's mean and spread).")


def write_report(cfg, out: Path, pretrained, converted, quality, benches, elapsed) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    archs = list(cfg.archs)
    images = {"loss_curves": loss_curves(out / "loss_curves.png", pretrained)}
    q_rows = quality_rows(quality, pretrained)
    g_rows = glance_rows(q_rows, benches, archs)
    speed_lines, s_rows = [], {}
    for name, bench in benches.items():
        lines, s_rows[name], bench_images = speed_section(name, bench, archs, out)
        speed_lines += lines
        images.update(bench_images)
    hardware = next(iter(benches.values()))["hardware"] if benches else {}
    lines = [
        "# overlap-zoo tour",
        "",
        f"Produced by `make demo` (`python -m eval.tour`) in {elapsed / 60:.1f} minutes on "
        f"{hardware.get('cpu', hardware.get('device', 'this machine'))}. "
        "Every number below was measured in this run.",
        "",
        "## At a glance",
        "",
        "Quality from the pretraining below; speed from the benches below (simulated link: one rank's real "
        "compute on this machine plus the link model), each architecture against the baseline of its family "
        "(`against`) at the bench's largest degree point on its first link (`at`). The share of exposed "
        "communication hidden is the robust number on a CPU; time-based speed-ups carry this machine's timing "
        "noise.",
        "",
        report.write_markdown_table(g_rows, list(g_rows[0])),
        "",
        "## Quality at equal tokens",
        "",
        f"Each architecture: the tiny config (`conf/model/<arch>.yaml`, or the `model_configs` entry: "
        f"{', '.join(f'{a} = `conf/model/{m}.yaml`' for a, m in (cfg.get('model_configs') or {}).items()) or 'none'}), "
        f"trained with `{' '.join(cfg.pretrain_overrides)}` on the bundled corpus, seed {cfg.seed}; evaluated on "
        "the held-out plays. "
        "**params** counts every parameter, **active params** those one token's forward uses (the configs' "
        "`num_active_parameters_formula()`: all but the experts a token is not routed to). The MoE configs are "
        "sized for equal ACTIVE parameters: each token can use as many as in llama (within 0.6%: moe top-2 of 4 "
        "experts half llama's MLP width; scmoe dense + (shared + top-1) pairs; MoE++ FFN and zero-computation "
        "experts), with more parameters in all (the experts). For MoE++ that count "
        "is an upper bound, k FFN experts per token: a token routed to a zero-computation expert runs fewer, "
        "and at the load its balance loss aims for a token runs k_eff = k tau N_FFN / (tau N_FFN + N_ZC) "
        f"FFN experts on average ({zero_computation_mix(pretrained)}): less "
        "compute per token on average, by design; eval.replicate compares it at equal expert compute too. "
        "**cloze log-lik/word**: the mean "
        "log-likelihood (nats, higher is better) of the held-out word in `shakespeare_cloze`, log P(word | "
        "context); the task's accuracy (the word is the model's greedy continuation) is 0 for every model this "
        "small, so it is not shown.",
        "",
        seed_noise_line(cfg.get("seed_noise")),
        "",
        report.write_markdown_table(q_rows, list(q_rows[0])),
        "",
        "![validation loss](loss_curves.png)",
        "",
        *conversion_lines(converted),
        *speed_lines,
    ]
    path = out / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    report.write_json(out / "tour.json", {"glance": g_rows, "quality": q_rows, "speed": s_rows, "conversion": {name: r["val"] for name, r in converted.items()}})
    if cfg.wandb:
        tables = {"tour/quality": (list(q_rows[0]), q_rows)}
        tables.update({f"tour/speed/{name}": (list(rows[0]), rows) for name, rows in s_rows.items() if rows})
        report.log_to_wandb(
            Path(cfg.paths.output_dir),  # the run directory, not the committed report folder
            project="overlap-zoo",
            name="tour",
            config=OmegaConf.to_container(cfg, resolve=True),
            summary={f"quality/{r['model']}/val_ppl": r["val ppl"] for r in q_rows},
            tables=tables,
            images={f"tour/{k}": v for k, v in images.items()},
            tags=["tour"],
        )
    return path


def tour(cfg: DictConfig) -> Path:
    started = time.perf_counter()
    run_dir = Path(cfg.paths.output_dir).resolve()
    pretrained = pretrain_all(cfg, run_dir)
    checkpoints = {arch: r["hf_dir"] for arch, r in pretrained.items()}
    converted = {}
    if cfg.convert.enabled and cfg.convert.source in pretrained:
        converted = convert_all(cfg, run_dir, checkpoints)
        for result in converted.values():
            checkpoints[converted_name(result, cfg.convert.source)] = result["retrain"]["hf_dir"]
    quality = evaluate_all(cfg, run_dir, checkpoints)
    benches = bench_all(cfg, run_dir)
    path = write_report(cfg, Path(cfg.report_dir), pretrained, converted, quality, benches,
                        time.perf_counter() - started)
    print(f"[tour] report: {path} ({(time.perf_counter() - started) / 60:.1f} minutes)", flush=True)
    print(path.read_text(), flush=True)
    return path


@hydra.main(config_path="../conf", config_name="tour", version_base="1.3")
def main(cfg: DictConfig) -> None:
    tour(cfg)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
