"""The zoo tour's report (`report_dir`/README.md, its PNGs and tour.json): what a newcomer came for first, one row
per architecture with its quality against its baseline beside its predicted speed-up at the Llama 3 8B shape
(eval/tour_predict.py); then quality at equal tokens, the conversions, and last the tiny benches on this CPU, labelled
as what they are: a check that every schedule runs, numbers within this CPU's noise.
"""

import json
import math
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

import models
from eval import report
from eval.bench.decode_paths_report import decode_paths_section
from eval.bench.settings import degrees_label, ranks
from eval.bench.sp_report import sp_section


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


def quality_baseline(cfg: DictConfig, arch: str) -> str | None:
    """The architecture a row's quality is set against: its `predict` family's baseline (`quality_baseline` where the
    family's speed baseline is a schedule, not an architecture); itself for a baseline; None outside every family."""
    for fam in cfg.predict.families.values():
        base = fam.get("quality_baseline") or fam.get("baseline")
        if arch == base or arch in fam.archs:
            return base
    return None


def glance_rows(cfg: DictConfig, q_rows: list[dict], predicted: dict) -> list[dict]:
    """The report's first table: per architecture of `archs`, its quality against its family's baseline (validation
    perplexity, the difference of validation loss) beside its predicted speed-up at the real shape."""
    by_model = {r["model"]: r for r in q_rows}
    preds = {r["arch"]: r for r in (predicted or {}).get("rows", [])}
    out = []
    for arch in cfg.archs:
        q, p = by_model.get(arch, {}), preds.get(arch, {})
        base = quality_baseline(cfg, arch)
        b = by_model.get(base, {})
        diff = q["val loss"] - b["val loss"] if "val loss" in q and "val loss" in b else None
        at = p.get("at")
        if at and p.get("what") and p["what"] != "generation":
            at = f"{at}; {p['what']}"
        out.append({
            "arch": arch, "params": q.get("params"), "active params": q.get("active params"), "val ppl": q.get("val ppl"),
            "quality against": base, "val loss diff (nats)": diff,
            "speed against": p.get("against"), "predicted at": at or p.get("note"),
            "speed-up, batch 1": p.get("speedup_b1"), "speed-up, batch 16": p.get("speedup_b16"),
            "predicted in (s)": p.get("seconds"),
        })  # fmt: skip
    return out


def overlap_lines(predicted: dict | None) -> list[str]:
    """One line per family predicted against its baseline under a system-level overlap schedule as well: each
    architecture's tokens/s over that baseline's, at the largest batch the schedule has a row for."""
    lines = []
    rows = [r for r in (predicted or {}).get("rows", []) if r.get("overlap_baseline")]
    for baseline in dict.fromkeys(r["overlap_baseline"] for r in rows):
        mine = [r for r in rows if r["overlap_baseline"] == baseline]
        batches = sorted({int(k.removeprefix("vs_overlap_b")) for r in mine for k in r if k.startswith("vs_overlap_b")})
        if not batches:
            continue
        b = batches[-1]
        shown = ", ".join(f"`{r['arch']}` {r[f'vs_overlap_b{b}']:.2f}x" for r in mine if f"vs_overlap_b{b}" in r)
        lines += [f"**Against `{baseline}`** (the baseline with system-level overlap: the batch split in two halves "
                  f"that take turns; predicted as above, batch {b}): {shown}.", ""]  # fmt: skip
    return lines


def glance_lines(cfg: DictConfig, g_rows: list[dict], predicted: dict | None) -> list[str]:
    """The report's first section: the table and what its columns are."""
    lines = ["## At a glance: quality, and predicted speed at a real shape", ""]
    if predicted:
        shape = predicted["shape"]
        lines += [
            f"One row per architecture. **Quality** (this run's tiny models, below): validation perplexity on the "
            f"held-out plays, and **val loss diff** = its validation loss minus that of `quality against` (nats; "
            f"negative: better; one seed, see the note under the quality table). **Speed** (predicted, not measured, "
            f"random weights): the speed simulator at the {shape} shape (`compute=h100-sxm`: each architecture's own "
            f"forward() on the meta device, every op charged to the H100 device model that eval.costmodel fitted to "
            f"the Ladder paper's 70B table, every collective to the link model; as reports/at-scale, the same numbers "
            f"on any machine), with the settings of the commands below (conf/tour.yaml `predict`). Generation rows: "
            f"tokens/s of the whole generation (prefill + decode; by default prompt 1024, 512 new tokens, a static KV "
            f"cache) over `speed against`'s, at the degree and link of `predicted at`. Linear attention's own layout "
            f"is sequence parallelism (its tensor-parallel one is Llama's) and it does not decode under SP (one "
            f"device decodes), so its rows are a training step under SP (forward + backward over its layer pattern, "
            f"L linear, N softmax) by the zoo's schedule (LASP-2, LASP-2H) over the baselines' (LASP-1, ring "
            f"attention), batch 1. **predicted in**: the seconds its prediction took on this machine.",
            "",
        ]
    lines += [report.write_markdown_table(g_rows, list(g_rows[0])), ""]
    lines += overlap_lines(predicted)
    if predicted:
        lines += ["The predictions' commands (`python -m eval.bench`, one run per architecture):", ""]
        lines += [f"- {family}: `{command}`" for family, command in predicted["commands"].items()]
        lines.append("")
    return lines


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


# ------------------------------------------------------------------------- the tiny benches on this CPU

HIDDEN = ("hidden (decode)", "hidden (exposed, decode)")


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
            HIDDEN[0]: r["hidden_fraction_decode"],
            HIDDEN[1]: r.get("exposed_hidden_fraction_decode"),
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


def noise_marked(row: dict) -> dict:
    """A row as shown: a hidden fraction outside [0, 1] (a tiny shape's timing noise: the schedule cannot hide less
    than nothing nor more than all) marked "(noise)"; tour.json keeps the number."""
    out = dict(row)
    for key in HIDDEN:
        value = row.get(key)
        if isinstance(value, float) and not 0.0 <= value <= 1.0:
            out[key] = f"{report.format_value(value)} (noise)"
    return out


def cpu_plots(bench: dict) -> tuple[str, ...]:
    """The generation plots worth showing for a tiny CPU bench: speed-up vs batch / vs degree only with two points or
    more on that axis; no hidden-fraction plot (at a tiny shape on a CPU it is timing noise, -0.4 or 1.3)."""
    rows = bench["rows"]
    shown = ["a2a_exposed"]
    if len({r["batch"] for r in rows}) >= 2:
        shown.append("speedup_vs_batch")
    if len({degrees_label(r["degrees"]) for r in rows}) >= 2:
        shown.append("speedup_vs_degree")
    return tuple(shown)


def speed_section(name: str, bench: dict, archs: list[str], out: Path) -> tuple[list[str], list[dict], dict[str, Path]]:
    """The report's section of one small CPU bench: (Markdown lines, its rows, the plots it shows, copied beside the
    report)."""
    own = {src.stem: src for src in sorted(Path(bench["out_dir"]).glob("*.png"))}  # the bench's own plot names
    named = {k: Path(f"{name}_{k}.png") for k in own}  # as they are called beside the report
    rows = speed_rows(bench, archs)
    base = bench["settings"]["baseline"]
    moe = any("a2a hidden share (decode)" in r for r in rows)
    shape = (bench["settings"].get("bench_shape") or {}).get("name", "a small")
    lines = [
        f"## Every schedule runs: {bench['title']} ({shape} shape on this CPU; not speed results)",
        "",
        f"`{bench['command']}`. A check that every schedule runs end to end, at the `{shape}` bench shape "
        "(conf/bench_shape/) with random weights on this machine's cores: the numbers are within this CPU's timing "
        "noise (a few ms per step, shared cores), not speed results; the predicted speed-ups are at the top.",
    ]
    if rows:
        lines[-1] += (
            f" Speed-ups are over `{base}` in the same variant; hidden = (T_{base} - T_arch) / (T_{base} - "
            f"T_upper_bound); hidden (exposed) = 1 - exposed_arch / exposed_{base} on the virtual clock; one outside "
            "[0, 1] is marked (noise). Simulated rows: one rank's real compute + the link model; real rows: gloo "
            "processes on this machine's cores."
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
    lines += [*[f"> {n}" for n in bench["notes"]], ""]
    if rows:
        lines += [report.write_markdown_table([noise_marked(r) for r in rows], list(rows[0])), ""]
        lines += [f"![{k}]({named[k]})" for k in own if k in cpu_plots(bench)]
        lines.append("")
    # The bench's own sections where it ran them (sequence parallelism, decode paths), a level down.
    for section in (sp_section(bench, named), decode_paths_section(bench, named)):
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
            lines += [f"![expert_throughput]({named['expert_throughput']})", ""]
    text = "\n".join(lines)
    images = {}  # only the plots the section shows
    for k, src in own.items():
        if f"({named[k]})" in text:
            images[f"{name}_{k}"] = Path(shutil.copy(src, out / named[k]))
    return lines, rows, images


# ------------------------------------------------------------------------------- quality and conversions


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


def quality_lines(cfg: DictConfig, pretrained: dict[str, dict], q_rows: list[dict]) -> list[str]:
    """The quality section: how the tiny models were trained and counted, the one-seed note, the table, the curves."""
    configs = ", ".join(f"{a} = `conf/model/{m}.yaml`" for a, m in (cfg.get("model_configs") or {}).items()) or "none"
    return [
        "## Quality at equal tokens",
        "",
        f"Each architecture: the tiny config (`conf/model/<arch>.yaml`, or the `model_configs` entry: {configs}), "
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
    ]


# ------------------------------------------------------------------------------------------- the report


def write_report(cfg, out: Path, pretrained, converted, quality, benches, predicted, elapsed) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in cfg.benches:  # a bench plot an earlier report showed and this one does not stays out
        for stale in out.glob(f"{name}_*.png"):
            stale.unlink()
    archs = list(cfg.archs)
    images = {"loss_curves": loss_curves(out / "loss_curves.png", pretrained)}
    q_rows = quality_rows(quality, pretrained)
    g_rows = glance_rows(cfg, q_rows, predicted)
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
        f"{hardware.get('cpu', hardware.get('device', 'this machine'))}: the tiny models trained and evaluated here, "
        "the speed-ups predicted by the speed simulator at a real shape.",
        "",
        *glance_lines(cfg, g_rows, predicted),
        *quality_lines(cfg, pretrained, q_rows),
        *conversion_lines(converted),
        *speed_lines,
    ]
    path = out / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    report.write_json(out / "tour.json", {"glance": g_rows, "predicted": predicted, "quality": q_rows,
                                          "cpu_check": s_rows,
                                          "conversion": {name: r["val"] for name, r in converted.items()}})  # fmt: skip
    if cfg.wandb:
        tables = {"tour/glance": (list(g_rows[0]), g_rows), "tour/quality": (list(q_rows[0]), q_rows)}
        tables.update({f"tour/cpu_check/{name}": (list(rows[0]), rows) for name, rows in s_rows.items() if rows})
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
