"""The tables of results in README.md and docs/, written from the committed reports: `python -m eval.doc_tables`.

No number a report holds is copied into the docs by hand. Each table of results sits between two markers,

    <!-- table:NAME -->
    ...
    <!-- end table:NAME -->

and its lines are made here from the report's JSON (`TABLES`: name -> a function of the link prefix from the
page to the repository root). After regenerating a report, run this to rewrite every block; tests/test_docs.py
fails while a block differs from what this writes, so a report and the docs cannot disagree.
"""

import functools
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import models

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/*.md"]
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table:(?P=name) -->)", re.S)

AT_SCALE = "reports/at-scale/at_scale.json"
SEEDS = "reports/quality-seeds/results.json"
VALIDATION = "reports/simulator-validation/validation.json"
DEMO = "reports/demo/tour.json"
COSTMODEL = "reports/costmodel/costmodel.json"
DATA_PIPELINE = "reports/data-pipeline/results.json"
LADDER_CONVERSIONS = "reports/ladder-conversion/results.json"
# Conversions of a trained llama: (label, the report's JSON, the name of its converted model in `val`).
CONVERSIONS = [
    ("llama -> ladder (upper half laddered)", "reports/conversion/conversion.json", "ladder"),
    ("llama -> moe (sparse upcycling, 4 experts, top-2)", "reports/upcycling/moe/conversion.json", "moe"),
    ("llama -> scmoe (Position 2, 4 experts, top-1 + shared)", "reports/upcycling/scmoe/conversion.json", "scmoe"),
    ("llama continued, nothing converted (the control)", "reports/upcycling/dense_continued/conversion.json", "ladder"),
    ("llama -> gqla (TransGQLA, d_c 16, its own 100-step source)", "reports/gqla-conversion/conversion.json", "gqla"),
]
# The architectures of the glance table, each with the family baseline it is compared with; then every ladder
# variant the at-scale report sets against its standard sibling (`_at_scale_variants`), against that sibling.
GLANCE = ["parallel", "ladder", "kraken", "gqla", "scmoe", "moepp", "linear", "linear_hybrid"]
# The quality-over-seeds label an architecture's quality is read from, where it is not its name: MoE++ at the
# paper's expert ratio (8 FFN + 1 zero / 1 copy / 2 constant experts), as the tour trains it.
QUALITY_LABEL = {"moepp": "moepp_paper"}
# What a glance row's names stand for where one name holds two configurations (the speed rows take the bench's
# configs, bench_preset=moe; the quality rows conf/model/'s tiny ones): (the architecture's, its baseline's).
GLANCE_LABELS = {
    "scmoe": ("", "speed: MoE every second layer, where scmoe's pairs put theirs; quality: every layer"),
    "moepp": ("speed: 8 FFN + 4 zero-computation experts in every layer; quality: `moepp_paper`, the same ratio",
              "speed: MoE every second layer, so compare per MoE layer; quality: every layer"),
    "moe_ladder": ("", "speed: MoE every second layer, as the variant"),
    "moepp_ladder": ("speed: 8 FFN + 4 experts; quality: 4 FFN + 4 (conf/model/moepp.yaml)", "the same configuration"),
}


@functools.cache  # one read per report: the tables read the same ones over and over
def _load(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _pm(stats: dict, digits: int = 3, sign: str = "+") -> str:
    return f"{stats['mean']:{sign}.{digits}f} ± {stats['std']:.{digits}f}"


def _agrees(diff: dict | None) -> str:
    """Whether every seed's paired difference has the same sign ("-": no comparison)."""
    return ("yes" if diff["same_sign"] else "no") if diff else "-"


def _at_scale_speedups(arch: str) -> dict[str, list[float]]:
    """{run: [speed-up at batch 1, at batch 16]} of `arch` on NVLink, from the at-scale report: over the run's
    baseline, or a ladder variant's over its standard sibling."""
    out: dict[str, list[float]] = {}
    for row in _load(AT_SCALE)["rows"]:
        if row["arch"] == arch and row["arch"] != row["against"] and row["at"].endswith("nvlink-h100"):
            out.setdefault(row["run"], []).append(row["vs_sibling_total"] if row.get("sibling") else row["speedup_total"])
    return out


def _at_scale_variants() -> dict[str, str]:
    """{ladder variant: its standard sibling} of the at-scale report's rows, in the report's order."""
    return {row["arch"]: row["sibling"] for row in _load(AT_SCALE)["rows"] if row.get("sibling")}


def _paired(arch: str, against: str) -> dict | None:
    for comparison in _load(SEEDS)["comparisons"]:
        if comparison["arch"] == arch and comparison["against"] == against:
            return comparison["diff_loss"]
    return None


def _sp_training_step(arch: str) -> str | None:
    """The tour's prediction for an architecture without a generation row at scale (linear attention: a training
    step under SP 8 by its schedule over the baselines'), from the committed demo report."""
    for row in _load(DEMO)["predicted"]["rows"]:
        if row["arch"] == arch and row.get("speedup_b1") is not None and row["at"].startswith("sp="):
            return f"{_x(row['speedup_b1'])} (SP 8 training step, {row['what'].split(', ')[1]}, over {row['against']})"
    return None


def _param_range(rows: list[dict]) -> str:
    """The tiny models' active parameter counts as one range in millions ("1.8-1.9 M")."""
    low, high = (f"{f(r['active_params'] for r in rows) / 1e6:.1f}" for f in (min, max))
    return f"{low} M" if low == high else f"{low}-{high} M"


def glance(rel: str) -> list[str]:
    baselines = {row["arch"]: row["baseline"] for row in _load(SEEDS)["rows"]}
    variants = _at_scale_variants()
    lines = [
        "| architecture | against | predicted speed-up, 8B shape, batch 1 / 16 | 70B shape, batch 1 / 16 "
        "| validation loss - baseline's (3 seeds, paired) | every seed agrees |",
        "|---|---|---|---|---|---|",
    ]
    for arch in [*GLANCE, *variants]:
        against = variants.get(arch) or baselines[arch]
        anchor = "the-ladder-schedule-on-other-architectures" if arch in variants else arch
        runs = _at_scale_speedups(arch)
        first = runs.get("dense_8b") or runs.get("moe_8x7b")
        seventy = runs.get("dense_70b")
        generation = " / ".join(_x(v) for v in first) if first else None
        training = _sp_training_step(arch)  # linear attention: its SP training step too (the tour's)
        diff = _paired(QUALITY_LABEL.get(arch, arch), against)
        arch_note, against_note = (f" ({n})" if n else "" for n in GLANCE_LABELS.get(arch, ("", "")))
        lines.append(
            f"| [`{arch}`]({rel}docs/architectures.md#{anchor}){arch_note} | `{against}`{against_note} "
            f"| {'; '.join(filter(None, [generation, training])) or 'not predicted'} "
            f"| {' / '.join(_x(v) for v in seventy) if seventy else '-'} "
            f"| {_pm(diff) if diff else '-'} | {_agrees(diff)} |"
        )
    lines += [
        "",
        f"Speed-ups: tokens/s of generation (prompt 1024, 512 new tokens) over the baseline on 8 x H100, TP 8 (EP 8 for "
        f"the MoE family), predicted by the speed simulator ([reports/at-scale]({rel}reports/at-scale/README.md)); "
        f"`<name>_ladder`: `<name>` with the ladder residual schedule on every layer, over `<name>`; linear attention's "
        f"sequence-parallel training step as the tour predicts it ([reports/demo]({rel}reports/demo/README.md)). "
        f"Quality: tiny models ({_param_range(_load(SEEDS)['rows'])} active parameters) at equal tokens, 400 steps, seeds 42 / 43 / 44, mean ± std of the "
        f"per-seed difference; negative is better; a `<name>_ladder`'s tiny models ladder the upper 2 of 4 layers; MoE++ at the paper's expert ratio ([reports/quality-seeds]({rel}reports/quality-seeds/README.md)).",
    ]
    return lines


def validation(rel: str) -> list[str]:
    report = _load(VALIDATION)
    ladder = report["ladder"]
    lines = [
        "| paper | published headline | predicted | predicted / published | within 15%? |",
        "|---|---|---|---|---|",
        f"| Ladder Residual, 70B record (in sample: the constants were fitted to it) | every tokens/s cell | worst "
        f"error {ladder['worst_tok_s_error']:.1%} | prefill worst {ladder['worst_prefill_error']:.1%} | "
        f"{'yes' if ladder['worst_tok_s_error'] <= report['target'] else 'no'} |",
    ]
    for row in report["heldout"]:
        lines.append(
            f"| {row['paper'].split(' (')[0]} (held out{'' if row['comparable'] else ', not at its setting: assumed'}) "
            f"| {_x(row['published'])} | {_x(row['predicted'])} "
            f"| {row['ratio']:.2f} | {'yes' if row['within'] else '**no**'} |"
        )
    for row in report["heldout"]:
        if row.get("regimes"):
            lines += ["", f"{row['paper'].split(' (')[0]}, by regime (every cell held out, tokens/s and prefill ms):", "",
                      "| regime | cells | within 15% | worst predicted / logged |", "|---|---|---|---|"]  # fmt: skip
            lines += [f"| {g['regime']} | {g['cells']} | {g['within 15%']} | {g['worst ratio']:.2f} |" for g in row["regimes"]]
    lines += ["", f"From [reports/simulator-validation]({rel}reports/simulator-validation/README.md), which names each "
              "headline, its setting and what the model lacks where it misses."]
    return lines


def costmodel(rel: str) -> list[str]:
    report = _load(COSTMODEL)
    c = report["constants"]
    errors = report["mean_abs_log_ratio"]
    return [
        "| fitted once to the Ladder 70B record | value |",
        "|---|---|",
        f"| FLOP/s efficiency, HBM efficiency | {c['eff_flops']:.3f}, {c['eff_hbm']:.2f} |",
        f"| overhead per kernel | {c['kernel_overhead_us']:.2f} us |",
        f"| contention of overlapped communication (latency-bound / bandwidth-bound) | {c['contention']:.2f} / "
        f"{c['contention_bw']:.2f} |",
        f"| NVLink latency (held: the nvlink-h100 preset's, not refitted) | {c['link_base_us']:.1f} us + {c['link_alpha_us']:.1f} us per hop |",
        f"| per collective launched outside a CUDA graph (held: read off the record) | {c['collective_launch_us']:.1f} us |",
        f"| tokens/s cells: worst error, mean abs log-ratio | {report['worst_tok_s_error']:.1%}, {errors['all_tok_s']:.3f} |",
        f"| prefill cells: mean abs log-ratio | {errors['all_prefill']:.3f} |",
        f"| Ladder speed-ups: worst error | {report['worst_ladder_speedup_error']:.1%} |",
        "",
        f"From [reports/costmodel]({rel}reports/costmodel/README.md) (`python -m eval.costmodel`).",
    ]


def data_pipeline(rel: str) -> list[str]:
    """Preparation and training on corpora of growing size, from the data pipeline's benchmark."""
    report = _load(DATA_PIPELINE)
    lines = ["| corpus | step | processes | tokens | seconds | tokens/s | peak RSS |", "|---|---|---|---|---|---|---|"]
    for row in report["prepare"]:
        lines.append(f"| {row['corpus_bytes'] / 1e9:.1f} GB | prepare | {row['num_proc']} | {row['tokens']:,} | "
                     f"{row['seconds']:.0f} | {row['tokens_per_s']:,} | - |")
    for row in report["train"]:
        lines.append(f"| {row['corpus_bytes'] / 1e9:.1f} GB | train: command to fit | 1 | {row['train_tokens']:,} | "
                     f"{row['seconds_to_fit_start']} | loader {row['loader_tokens_per_s']:,}, trainer "
                     f"{row['trainer_tokens_per_s']:,} | {row['peak_rss_mb']} MB |")
    return lines + ["", f"From [reports/data-pipeline]({rel}reports/data-pipeline/README.md) (`python -m eval.bench_data`, "
                    f"{report['machine']})."]


def seeds(rel: str) -> list[str]:
    report = _load(SEEDS)
    lines = [
        "| architecture | against | parameters (active) | validation loss | - baseline's (paired) | every seed agrees |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        diff = _paired(row["arch"], row["baseline"]) if row["baseline"] else None
        params = f"{row['params'] / 1e6:.2f} M" + (
            f" ({row['active_params'] / 1e6:.2f} M)" if row["active_params"] != row["params"] else "")
        lines.append(
            f"| {row['arch']} | {row['baseline'] or '-'} | {params} | {_pm(row['val_loss'], 4, '')} "
            f"| {_pm(diff, 4) if diff else '-'} | {_agrees(diff)} |"
        )
    lines += ["", f"{len(report['settings']['seeds'])} seeds x {report['settings']['max_steps']} steps, from "
              f"[reports/quality-seeds]({rel}reports/quality-seeds/README.md) (`python -m eval.replicate`)."]
    return lines


def conversions(rel: str) -> list[str]:
    lines = ["| conversion | source | right after | retrained | report |", "|---|---|---|---|---|"]
    for label, path, target in CONVERSIONS:
        report = _load(path)
        val, steps = report["val"], report["retrain"].get("global_step")
        lines.append(
            f"| {label} | {val['llama (source)']['loss']:.4f} | {val[f'{target}, no retraining']['loss']:.4f} "
            f"| {val[f'{target}, retrained']['loss']:.4f}{f' ({steps} steps)' if steps else ''} "
            f"| [{Path(path).parent.as_posix()}]({rel}{Path(path).parent.as_posix()}/) |"
        )
    lines += ["", "Validation loss on the held-out plays."]
    return lines


def ladder_speed(rel: str) -> list[str]:
    """Each ladder variant against its standard sibling at scale, per run, link and batch, from the at-scale report."""
    lines = [
        "| variant | against | run | link | decode tokens/s, batch 1 / 16 | prefill, batch 1 / 16 "
        "| link time hidden in decode, variant / sibling (batch 1) | MoE combine hidden, batch 1 / 16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in _load(AT_SCALE)["rows"]:
        if row.get("sibling"):
            groups.setdefault((row["arch"], row["run"], row["at"]), []).append(row)
    for (arch, run, at), rows in groups.items():  # the report's order
        rows.sort(key=lambda r: r["batch"])
        combine = [r.get("combine_hidden") for r in rows]
        lines.append(
            f"| `{arch}` | `{rows[0]['sibling']}` | {run} | {at.split(', ')[-1]} "
            f"| {' / '.join(_x(r['vs_sibling_decode']) for r in rows)} "
            f"| {' / '.join(_x(r['vs_sibling_prefill']) for r in rows)} "
            f"| {rows[0]['hidden_decode']:.0%} / {rows[0]['sibling_hidden_decode']:.0%} "
            f"| {' / '.join(f'{c:.0%}' for c in combine) if all(c is not None for c in combine) else '-'} |"
        )
    lines += ["", f"Predicted on 8 x H100 (prompt 1024, 512 new tokens), every layer laddered, from "
              f"[reports/at-scale]({rel}reports/at-scale/README.md) (`python -m eval.at_scale`)."]
    return lines


def ladder_quality(rel: str) -> list[str]:
    """Each ladder variant's quality against its standard sibling (3 seeds, paired) and the conversion of a trained
    standard model (right after, retrained, against the control retrained as long)."""
    conversions = {}
    if (ROOT / LADDER_CONVERSIONS).is_file():
        conversions = {row["arch"]: row for row in _load(LADDER_CONVERSIONS)["rows"]}
    lines = [
        "| variant | against | validation loss - sibling's (3 seeds, paired) | every seed agrees "
        "| trained sibling converted: source / right after / retrained | control retrained |",
        "|---|---|---|---|---|---|",
    ]
    for variant in models.variants():
        sibling = models.registry.standard_sibling(variant)
        diff, c = _paired(variant, sibling), conversions.get(sibling)
        converted = f"{c['source']:.4f} / {c['right_after']:.4f} / {c['retrained']:.4f}" if c else "not run"
        control = f"{c['control_retrained']:.4f}" if c else "-"
        lines.append(
            f"| `{variant}` | `{sibling}` | {_pm(diff) if diff else 'not run'} "
            f"| {_agrees(diff)} | {converted} "
            f"| {control} |"
        )
    lines += ["", "Tiny models, the upper 2 of 4 layers laddered (as `ladder`'s): 400 steps x seeds 42 / 43 / 44 from "
              f"[reports/quality-seeds]({rel}reports/quality-seeds/README.md); the conversions from "
              f"[reports/ladder-conversion]({rel}reports/ladder-conversion/README.md) (`python -m eval.ladder_conversions`: "
              "the standard model pretrained 400 steps, converted, retrained 150; the control converted with "
              "ladder_layers=0, retrained as long). Negative is better."]
    return lines


# The columns of the system-level overlap tables (at-scale runs): the standard model under each schedule, each
# architecture (under a schedule where it takes one), and the standard model with its links free.
DENSE_OVERLAP = ["llama+token_split", "llama+seq_split", "llama+collective_matmul", "parallel", "parallel+token_split",
                 "parallel+seq_split", "parallel+collective_matmul", "ladder", "kraken", "gqla",
                 "llama (no communication)"]  # fmt: skip
MOE_OVERLAP = ["moe+token_split", "moe+seq_split", "scmoe", "moe_ladder", "moe (no communication)"]
OVERLAP_METRICS = (("speedup_total", "tokens/s"), ("speedup_prefill", "prefill (time to first token)"),
                   ("speedup_decode", "decode"))  # fmt: skip


def _overlap_matrix(rows: dict, runs: tuple, archs: list[str], key: str) -> list[str]:
    """One row per (shape, link, batch) of `runs` ((run, shape label)), one column per architecture of `archs`: its
    `key` speed-up over the run's baseline (n/a where it has no row: a batch split at batch 1)."""
    head = ["shape, link, batch", *(f"`{a}`" if "(" not in a else a.split(" (")[1].rstrip(")") for a in archs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, shape in runs:
        for at in sorted({k[3] for k in rows if k[0] == run}):
            for batch in sorted({k[2] for k in rows if k[0] == run and k[3] == at}):
                cells = [_x(rows[run, a, batch, at][key]) if (run, a, batch, at) in rows else "n/a" for a in archs]
                lines.append(f"| {shape}, {at.split(', ')[-1]}, batch {batch} | " + " | ".join(cells) + " |")
    return lines


def system_overlap(rel: str) -> list[str]:
    """Each architecture's predicted speed-up over the standard model beside the standard model's own under the
    system-level schedules (token_split, seq_split, collective_matmul) and with its links free: the dense family at the 8B and 70B
    shapes (TP 8), the MoE family at the 8B shape with 8 experts (EP 8), NVLink and PCIe, batch 1 and 16, for
    tokens/s, the prefill and decode; and a training step (the at-scale report's rows)."""
    rows = {(r["run"], r["arch"], r["batch"], r["at"]): r for r in _load(AT_SCALE)["rows"]}
    dense, moe = (("dense_8b", "8B"), ("dense_70b", "70B")), (("moe_8x7b", "8B, 8 experts"),)
    lines = []
    for key, what in OVERLAP_METRICS:
        lines += [f"**{what}**, over `llama` (TP 8):", ""] + _overlap_matrix(rows, dense, DENSE_OVERLAP, key) + [""]
    for key, what in OVERLAP_METRICS:
        lines += [f"**{what}**, over `moe` (EP 8):", ""] + _overlap_matrix(rows, moe, MOE_OVERLAP, key) + [""]
    lines += ["| shape, one training step | against `llama` | step speed-up | tokens/s per GPU |", "|---|---|---|---|"]
    for r in _load(AT_SCALE).get("training", []):
        if r["arch"] != r["against"]:
            shape = {"train_8b": "8B, FSDP 8 x TP 8", "train_70b": "70B, FSDP 32 x TP 8"}.get(r["run"], r["run"])
            lines.append(f"| {shape} | `{r['arch']}` | {_x(r['speedup_vs_baseline'])} | {r['tokens_per_s_per_device']:,.0f} |")
    lines += ["", "Generation: prompt 1024, 512 new tokens, on 8 x H100; training steps at torchtitan's 2-D layouts "
              "(8192-token sequences); `no communication`: the baseline with every link free (the bench's upper bound); "
              f"predicted: [reports/at-scale]({rel}reports/at-scale/README.md) (`python -m eval.at_scale`)."]
    return lines


TABLES: dict[str, Callable[[str], list[str]]] = {
    "glance": glance,
    "validation": validation,
    "costmodel": costmodel,
    "seeds": seeds,
    "data-pipeline": data_pipeline,
    "conversions": conversions,
    "ladder-speed": ladder_speed,
    "ladder-quality": ladder_quality,
    "system-overlap": system_overlap,
}


def pages() -> list[Path]:
    return sorted(p for pattern in PAGES for p in ROOT.glob(pattern))


def render(text: str, rel: str) -> str:
    """`text` with every table block rewritten; an unknown table name is an error naming the known ones."""

    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise ValueError(f"unknown table {name!r} in the docs: known tables are {sorted(TABLES)}")
        return f"{match.group(1)}{chr(10).join(TABLES[name](rel))}\n{match.group(4)}"

    return BLOCK.sub(block, text)


def link_prefix(page: Path) -> str:
    return "../" * (len(page.resolve().relative_to(ROOT).parts) - 1)


def stale() -> list[str]:
    """The pages whose table blocks differ from what the reports give now."""
    return [p.relative_to(ROOT).as_posix() for p in pages() if render(p.read_text(), link_prefix(p)) != p.read_text()]


def main() -> None:
    for page in pages():
        text = page.read_text()
        new = render(text, link_prefix(page))
        if new != text:
            page.write_text(new)
            print(f"rewrote the tables of {page.relative_to(ROOT)}")
    sys.exit(0)


if __name__ == "__main__":
    main()
